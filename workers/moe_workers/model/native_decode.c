/* The quantized experts' decoder in C: fp8 (E4M3 codes with a float32 scale per block) and mxfp4
 * (E2M1 codes, two a byte, low nibble first, with one E8M0 scale per 32 values) into float32,
 * bfloat16 or float16. moe_workers/model/native.py builds it with the machine's C compiler on
 * first use (-O3 -march=native, so the loops are vectorised for the CPU it runs on) and calls it
 * through ctypes; without a compiler the torch decoder in dequant.py runs instead.
 *
 * The arithmetic is the one transformers uses, and the torch decoder beside it: each value is
 * the float32 product of the code's value and its scale, rounded once to the output dtype
 * (round to nearest even; a NaN is 0x7fc0 in bfloat16). tests/unit/test_quantized.py checks
 * every code under every scale, bit for bit, against the published formula. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };

const char *moe_native_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "generic";
#endif
}

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : r);
}

/* E4M3 (fn: no infinities, S.1111.111 is NaN): the code's bits moved into a float32 and scaled
 * by 2^120 (7 - 127 of exponent bias) are its value, subnormal codes included, exactly */
static inline float e4m3(uint32_t x) {
    return from_bits(((x & 0x7fu) << 20) | ((x & 0x80u) << 24)) * 1.329227995784916e36f;
}

/* the float32 value of an E8M0 scale byte: 2^(e - 127); 2^-127 is a subnormal float32 */
static inline float e8m0(uint32_t e) { return e ? from_bits(e << 23) : 5.877471754111438e-39f; }

/* an E2M1 code's float32 value: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign */
static inline float e2m1(uint32_t c) {
    uint32_t m = c & 7u;
    uint32_t bits = m >= 2u ? (m + 252u) << 22 : (m == 1u ? 0x3f000000u : 0u);
    return from_bits(bits | ((c & 8u) << 28));
}

#define FP8_ROWS(T, CONV, NAN_BITS)                                                              \
    for (long i = row0; i < row1; i++) {                                                         \
        const float *srow = s + (i / b0) * gc;                                                   \
        const uint8_t *qi = q + i * cols;                                                        \
        T *oi = (T *)out + (i - row0) * cols;                                                    \
        for (long jb = 0; jb < cols; jb += b1) {                                                 \
            const float sc = srow[jb / b1];                                                      \
            const long end = jb + b1 < cols ? jb + b1 : cols;                                    \
            for (long j = jb; j < end; j++) {                                                    \
                uint32_t x = qi[j];                                                              \
                T v = CONV(e4m3(x) * sc);                                                        \
                oi[j] = (x & 0x7fu) == 0x7fu ? NAN_BITS : v;                                     \
            }                                                                                    \
        }                                                                                        \
    }

static inline float keep(float f) { return f; }
static inline _Float16 to_f16(float f) { return (_Float16)f; }

/* rows [row0, row1) of q [rows, cols] with scales s [ceil(rows / b0), ceil(cols / b1)] (float32),
 * into out (row row0 first, contiguous) as `kind`. Returns 0, or -1 for an unknown kind. */
int moe_fp8(const uint8_t *q, const float *s, long cols, long row0, long row1, long b0, long b1,
            void *out, int kind) {
    const long gc = (cols + b1 - 1) / b1;
    if (kind == OUT_BF16) {
        FP8_ROWS(uint16_t, to_bf16, (uint16_t)0x7fc0u)
    } else if (kind == OUT_F32) {
        FP8_ROWS(float, keep, from_bits(0x7fc00000u))
    } else if (kind == OUT_F16) {
        FP8_ROWS(_Float16, to_f16, (_Float16)from_bits(0x7fc00000u))
    } else {
        return -1;
    }
    return 0;
}

/* one group of 32 values by the float path (any scale byte, any kind) */
static void mxfp4_group(const uint8_t *bg, uint32_t e, void *out, long g, int kind) {
    const float sc = e8m0(e);
    for (int k = 0; k < 16; k++) {
        const float lo = e2m1(bg[k] & 15u) * sc, hi = e2m1((uint32_t)bg[k] >> 4) * sc;
        if (kind == OUT_BF16) {
            uint16_t *o = (uint16_t *)out + g * 32;
            o[2 * k] = to_bf16(lo); o[2 * k + 1] = to_bf16(hi);
        } else if (kind == OUT_F32) {
            float *o = (float *)out + g * 32;
            o[2 * k] = lo; o[2 * k + 1] = hi;
        } else {
            _Float16 *o = (_Float16 *)out + g * 32;
            o[2 * k] = (_Float16)lo; o[2 * k + 1] = (_Float16)hi;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 E2M1 codes (in 32-bit lanes) under a scale byte 2 <= e <= 252 as bfloat16 bits: every
 * product is then a normal bfloat16, so its bits are the sign, e + (m >> 1) - 1 as exponent and
 * one mantissa bit for the codes 3, 5 and 7 (no rounding happens) */
static inline __m512i e2m1_bf16x16(__m512i c, __m512i ev) {
    const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(7));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(8)), 12);
    const __m512i exp = _mm512_slli_epi32(
        _mm512_sub_epi32(_mm512_add_epi32(ev, _mm512_srli_epi32(m, 1)), _mm512_set1_epi32(1)), 7);
    const __mmask16 odd_big = _mm512_cmpgt_epu32_mask(m, _mm512_set1_epi32(1)) &
                              _mm512_test_epi32_mask(m, _mm512_set1_epi32(1));
    const __m512i mag = _mm512_mask_or_epi32(exp, odd_big, exp, _mm512_set1_epi32(1 << 6));
    const __mmask16 nonzero = _mm512_test_epi32_mask(m, m);
    return _mm512_or_si512(sign, _mm512_maskz_mov_epi32(nonzero, mag));
}
#endif

/* `groups` groups of blocks b [groups, 16] and scale bytes s [groups] into out [groups, 32] as `kind` */
int moe_mxfp4(const uint8_t *b, const uint8_t *s, long groups, void *out, int kind) {
    if (kind != OUT_BF16 && kind != OUT_F32 && kind != OUT_F16) return -1;
    for (long g = 0; g < groups; g++) {
        const uint32_t e = s[g];
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (kind == OUT_BF16 && e >= 2u && e <= 252u) {
            const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + g * 16)));
            const __m512i ev = _mm512_set1_epi32((int)e);
            const __m512i lo = e2m1_bf16x16(_mm512_and_si512(x, _mm512_set1_epi32(15)), ev);
            const __m512i hi = e2m1_bf16x16(_mm512_srli_epi32(x, 4), ev);
            _mm512_storeu_si512((uint32_t *)out + g * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            continue;
        }
#endif
        mxfp4_group(b + g * 16, e, out, g, kind);
    }
    return 0;
}
