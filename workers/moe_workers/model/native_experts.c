/* A decode step's products in C: one row each through SwiGLU experts (mixtral, qwen, olmoe,
 * deepseek), bfloat16 weights in [out, in], many experts in one call; one row through a dense
 * projection. Built with
 * native_decode.c into one library (moe_workers/model/native.py). A step computes each
 * expert's gate/up rows (`moe_swiglu_up`), then its down rows (`moe_swiglu_down`); each call
 * takes a range of rows of every expert, so the caller's threads split the rows and one call
 * replaces a Python loop of three products per expert.
 *
 * Arithmetic: each product row is a dot product of bfloat16 values accumulated in float32 (the
 * CPU's bfloat16 dot-product instruction where it has one), rounded once to bfloat16; the
 * activation follows torch's on bfloat16 tensors: silu(g) rounded, times u, rounded. The sums
 * run in another order than torch's, so results agree within bfloat16's rounding. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : r);
}

/* four rows of w (row stride n) against x, n values each */
static void dot4(const uint16_t *w, long n, const uint16_t *x, float *out) {
    long i = 0;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), xv);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + n + i), xv);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + 2 * n + i), xv);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + 3 * n + i), xv);
    }
    s0 = _mm512_reduce_add_ps(a0); s1 = _mm512_reduce_add_ps(a1);
    s2 = _mm512_reduce_add_ps(a2); s3 = _mm512_reduce_add_ps(a3);
#endif
    for (; i < n; i++) {
        const float xi = bf16_to_f32(x[i]);
        s0 += bf16_to_f32(w[i]) * xi; s1 += bf16_to_f32(w[n + i]) * xi;
        s2 += bf16_to_f32(w[2 * n + i]) * xi; s3 += bf16_to_f32(w[3 * n + i]) * xi;
    }
    out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}

static float dot1(const uint16_t *w, long n, const uint16_t *x) {
    long i = 0;
    float s = 0.f;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    s = _mm512_reduce_add_ps(a);
#endif
    for (; i < n; i++) s += bf16_to_f32(w[i]) * bf16_to_f32(x[i]);
    return s;
}

/* rows [r0, r1) of `rows`-row products w (row length n) against x, rounded into y */
static void matvec_rows(const uint16_t *w, long n, const uint16_t *x, long r0, long r1, uint16_t *y) {
    long r = r0;
    float s[4];
    for (; r + 4 <= r1; r += 4) {
        dot4(w + r * n, n, x, s);
        y[r] = f32_to_bf16(s[0]); y[r + 1] = f32_to_bf16(s[1]);
        y[r + 2] = f32_to_bf16(s[2]); y[r + 3] = f32_to_bf16(s[3]);
    }
    for (; r < r1; r++) y[r] = f32_to_bf16(dot1(w + r * n, n, x));
}

/* rows [r0, r1) of y = w x for one matrix w [rows, n] (a dense projection's decode row) */
int moe_matvec_rows(const uint16_t *w, long n, const uint16_t *x, long r0, long r1, uint16_t *y) {
    matvec_rows(w, n, x, r0, r1, y);
    return 0;
}

/* For each of `count` experts: rows [r0, r1) of h = silu(w1 x) * (w3 x), w1 and w3 [inter,
 * hidden], x [hidden], h [inter] (all bfloat16; pointers per expert). `gate` and `up` are
 * scratch of `inter` values per expert (the products before the activation). */
int moe_swiglu_up(const uint16_t *const *w1, const uint16_t *const *w3, const uint16_t *const *x, long count,
                  long hidden, long r0, long r1, uint16_t *const *gate, uint16_t *const *up, uint16_t *const *h) {
    for (long e = 0; e < count; e++) {
        matvec_rows(w1[e], hidden, x[e], r0, r1, gate[e]);
        matvec_rows(w3[e], hidden, x[e], r0, r1, up[e]);
        for (long r = r0; r < r1; r++) {
            const float g = bf16_to_f32(gate[e][r]);
            const float a = bf16_to_f32(f32_to_bf16(g / (1.0f + expf(-g))));
            h[e][r] = f32_to_bf16(a * bf16_to_f32(up[e][r]));
        }
    }
    return 0;
}

/* For each of `count` experts: rows [r0, r1) of y = w2 h, w2 [hidden, inter], h [inter], y [hidden]. */
int moe_swiglu_down(const uint16_t *const *w2, const uint16_t *const *h, long count, long inter, long r0, long r1,
                    uint16_t *const *y) {
    for (long e = 0; e < count; e++) matvec_rows(w2[e], inter, h[e], r0, r1, y[e]);
    return 0;
}

/* Rows [r0, r1) of y = x W for one row x [n] and W [n, m] in transformers' [in, out] layout
 * (gpt-oss' experts as its bf16 release stores them): the rows' products summed into acc [m]
 * (float32, every column). W's rows are read once, in order, four at a time, so each thread
 * streams a contiguous part of W; the caller sums the threads' acc and rounds once. */
int moe_vecmat_rows(const uint16_t *x, const uint16_t *w, long m, long r0, long r1, float *acc) {
    for (long c = 0; c < m; c++) acc[c] = 0.f;
    long i = r0;
    for (; i + 4 <= r1; i += 4) {
        const float x0 = bf16_to_f32(x[i]), x1 = bf16_to_f32(x[i + 1]);
        const float x2 = bf16_to_f32(x[i + 2]), x3 = bf16_to_f32(x[i + 3]);
        const uint16_t *w0 = w + i * m, *w1 = w0 + m, *w2 = w1 + m, *w3 = w2 + m;
        for (long c = 0; c < m; c++)
            acc[c] += x0 * bf16_to_f32(w0[c]) + x1 * bf16_to_f32(w1[c]) + x2 * bf16_to_f32(w2[c]) +
                      x3 * bf16_to_f32(w3[c]);
    }
    for (; i < r1; i++) {
        const float xi = bf16_to_f32(x[i]);
        const uint16_t *row = w + i * m;
        for (long c = 0; c < m; c++) acc[c] += xi * bf16_to_f32(row[c]);
    }
    return 0;
}
