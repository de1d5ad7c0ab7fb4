/* A decode step's products in C: a few rows each (up to native.ROWS_MAX) through SwiGLU experts
 * (mixtral, qwen, olmoe, deepseek), bfloat16 weights in [out, in], many experts in one call; the
 * same through gpt-oss' clamped SwiGLU with biases, its weights in [out, in] (decoded from mxfp4)
 * or in transformers' [in, out] (its bf16 release); a few rows through a dense projection. Built
 * with native_decode.c and native_parallel.c into one library (moe_workers/model/native.py). A
 * step computes each expert's gate/up rows (`moe_swiglu_up`, `moe_gptoss_up`), then its down rows
 * (`moe_swiglu_down`, `moe_gptoss_down`); each call takes a range of rows of every expert, so the
 * caller's threads split the rows and one call replaces a Python loop of products and
 * element-wise ops per expert.
 *
 * Arithmetic: each product row is a dot product of bfloat16 values accumulated in float32 (the
 * CPU's bfloat16 dot-product instruction where it has one), rounded once to bfloat16; the
 * activation follows torch's on bfloat16 tensors, each op in float32 and rounded where torch
 * rounds it (silu(g) rounded, times u, rounded; gpt-oss: product, plus bias, each rounded; see
 * `gptoss_act`). The sums run in another order than torch's, so results agree within
 * bfloat16's rounding. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROWS_MAX 16 /* native.ROWS_MAX: rows of x an expert a call takes at most */

static inline float bf16_to_f32(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : r);
}

/* Four rows of w (row stride n) against K rows of x (row stride ldx), n values each: out[a][b]
 * = w row a . x row b. Each (a, b) sum runs in its own accumulator in the same order whatever K
 * is, so a row's result does not depend on how many rows share the call. */
static inline __attribute__((always_inline)) void dot4xk(const uint16_t *w, long n, const uint16_t *x, long ldx,
                                                         const int K, float out[4][4]) {
    long i = 0;
    float s[4][4] = {{0.f}};
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    __m512 acc[4][4];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < K; b++) acc[a][b] = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        __m512bh wv[4];
        for (int a = 0; a < 4; a++) wv[a] = (__m512bh)_mm512_loadu_si512(w + a * n + i);
        for (int b = 0; b < K; b++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + b * ldx + i);
            for (int a = 0; a < 4; a++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[a], xv);
        }
    }
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < K; b++) s[a][b] = _mm512_reduce_add_ps(acc[a][b]);
#endif
    for (; i < n; i++)
        for (int b = 0; b < K; b++) {
            const float xi = bf16_to_f32(x[b * ldx + i]);
            for (int a = 0; a < 4; a++) s[a][b] += bf16_to_f32(w[a * n + i]) * xi;
        }
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < K; b++) out[a][b] = s[a][b];
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

/* Rows [r0, r1) of Y = X w^T for nx rows of X [nx, n] against w [rows, n], rounded into Y [nx,
 * ldy]: four rows of w at a time against up to four rows of X, so each row of w is read from
 * memory once for all of X (a block of four stays in cache while X's rows go by). */
static void matmat_rows(const uint16_t *w, long n, const uint16_t *x, long nx, long r0, long r1, uint16_t *y,
                        long ldy) {
    long r = r0;
    float s[4][4];
    for (; r + 4 <= r1; r += 4)
        for (long b0 = 0; b0 < nx; b0 += 4) {
            const long k = nx - b0 < 4 ? nx - b0 : 4;
            const uint16_t *xb = x + b0 * n;
            switch (k) {
            case 1: dot4xk(w + r * n, n, xb, n, 1, s); break;
            case 2: dot4xk(w + r * n, n, xb, n, 2, s); break;
            case 3: dot4xk(w + r * n, n, xb, n, 3, s); break;
            default: dot4xk(w + r * n, n, xb, n, 4, s); break;
            }
            for (long b = 0; b < k; b++)
                for (int a = 0; a < 4; a++) y[(b0 + b) * ldy + r + a] = f32_to_bf16(s[a][b]);
        }
    for (; r < r1; r++)
        for (long b = 0; b < nx; b++) y[b * ldy + r] = f32_to_bf16(dot1(w + r * n, n, x + b * n));
}

/* rows [r0, r1) of Y = X w^T for nx rows X [nx, n] and one matrix w [rows, n] (a dense
 * projection's decode rows); Y [nx, rows] */
int moe_matvec_rows(const uint16_t *w, long n, const uint16_t *x, long nx, long rows, long r0, long r1, uint16_t *y) {
    matmat_rows(w, n, x, nx, r0, r1, y, rows);
    return 0;
}

/* For each of `count` experts, with nx[e] rows X_e [nx[e], hidden]: rows [r0, r1) of H_e =
 * silu(X_e w1^T) * (X_e w3^T), w1 and w3 [inter, hidden], H_e [nx[e], inter] (all bfloat16;
 * pointers per expert). `gate` and `up` are scratch of H_e's shape per expert (the products
 * before the activation). */
int moe_swiglu_up(const uint16_t *const *w1, const uint16_t *const *w3, const uint16_t *const *x, const long *nx,
                  long count, long hidden, long inter, long r0, long r1, uint16_t *const *gate, uint16_t *const *up,
                  uint16_t *const *h) {
    for (long e = 0; e < count; e++) {
        matmat_rows(w1[e], hidden, x[e], nx[e], r0, r1, gate[e], inter);
        matmat_rows(w3[e], hidden, x[e], nx[e], r0, r1, up[e], inter);
        for (long b = 0; b < nx[e]; b++)
            for (long r = r0; r < r1; r++) {
                const float g = bf16_to_f32(gate[e][b * inter + r]);
                const float a = bf16_to_f32(f32_to_bf16(g / (1.0f + expf(-g))));
                h[e][b * inter + r] = f32_to_bf16(a * bf16_to_f32(up[e][b * inter + r]));
            }
    }
    return 0;
}

/* For each of `count` experts: rows [r0, r1) of Y_e = H_e w2^T, w2 [hidden, inter], H_e [nx[e],
 * inter], Y_e [nx[e], hidden]. */
int moe_swiglu_down(const uint16_t *const *w2, const uint16_t *const *h, const long *nx, long count, long inter,
                    long hidden, long r0, long r1, uint16_t *const *y) {
    for (long e = 0; e < count; e++) matmat_rows(w2[e], inter, h[e], nx[e], r0, r1, y[e], hidden);
    return 0;
}

/* bf16(bf16(v) rounded from float32): torch's value after an op on bfloat16 tensors */
static inline float rnd(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* gpt-oss' clamped SwiGLU of one (gate, up) pair as transformers computes it on bfloat16 tensors:
 * gate = min(gate, limit), up = clamp(up, -limit, limit), glu = gate * sigmoid(gate * alpha),
 * (up + 1) * glu; each op in float32, rounded to bfloat16 where torch's bfloat16 op rounds. */
static inline uint16_t gptoss_act(float g, float u, float alpha, float limit) {
    g = rnd(g > limit ? limit : g); /* a NaN stays one, as through torch's clamp */
    u = rnd(u > limit ? limit : (u < -limit ? -limit : u));
    const float ga = rnd(g * alpha);
    const float glu = rnd(g * rnd(1.0f / (1.0f + expf(-ga))));
    return f32_to_bf16(rnd(u + 1.0f) * glu);
}

/* For each of `count` experts, with nx[e] rows X_e [nx[e], n] and W_e [n, m] in [in, out] (gpt-oss'
 * bf16 experts as transformers stores them): the float32 sums over W's rows [i0, i1) of X_e W_e,
 * into acc [all experts' rows, m] (expert e's rows after those of the experts before it). A
 * range of W's rows is read once, in order, eight rows at a time, for all of X_e's rows (as
 * `moe_vecmat_rows` streams W for one row), a tile of columns at a time: each thread streams a
 * contiguous part of W, the caller adds the parts' sums; a sum's order does not depend on nx. */
#define INOUT_TILE 512 /* columns: 8 rows of W's tile, 8 KiB */

int moe_inout_sums(const uint16_t *const *w, const uint16_t *const *x, const long *nx, long count, long n, long m,
                   long i0, long i1, float *acc) {
    for (long e = 0; e < count; e++) {
        if (nx[e] < 1 || nx[e] > ROWS_MAX) return -2;
        for (long c = 0; c < nx[e] * m; c++) acc[c] = 0.f;
        long i = i0;
        for (; i + 8 <= i1; i += 8) {
            const uint16_t *r[8];
            for (int k = 0; k < 8; k++) r[k] = w[e] + (i + k) * m;
            for (long t = 0; t < m; t += INOUT_TILE) {  /* the eight rows' tile stays in L1 for all of X_e */
                const long t1 = t + INOUT_TILE < m ? t + INOUT_TILE : m;
                for (long b = 0; b < nx[e]; b++) {
                    float v[8];
                    for (int k = 0; k < 8; k++) v[k] = bf16_to_f32(x[e][b * n + i + k]);
                    float *a = acc + b * m;
                    for (long c = t; c < t1; c++)
                        a[c] += (v[0] * bf16_to_f32(r[0][c]) + v[1] * bf16_to_f32(r[1][c]) +
                                 v[2] * bf16_to_f32(r[2][c]) + v[3] * bf16_to_f32(r[3][c])) +
                                (v[4] * bf16_to_f32(r[4][c]) + v[5] * bf16_to_f32(r[5][c]) +
                                 v[6] * bf16_to_f32(r[6][c]) + v[7] * bf16_to_f32(r[7][c]));
                }
            }
        }
        for (; i < i1; i++)
            for (long b = 0; b < nx[e]; b++) {
                const float xi = bf16_to_f32(x[e][b * n + i]);
                const uint16_t *row = w[e] + i * m;
                float *a = acc + b * m;
                for (long c = 0; c < m; c++) a[c] += xi * bf16_to_f32(row[c]);
            }
        acc += nx[e] * m;
    }
    return 0;
}

/* Columns [c0, c1) of row `row` of `total` rows [total, m]: the `parts` partial sums of
 * `moe_inout_sums` (acc [parts, total, m]) added in part order and rounded into y [m] */
static void add_parts(const float *acc, int parts, long total, long m, long row, long c0, long c1, uint16_t *y) {
    for (long c = c0; c < c1; c++) {
        float s = acc[row * m + c];
        for (int p = 1; p < parts; p++) s += acc[(p * total + row) * m + c];
        y[c] = f32_to_bf16(s);
    }
}

/* (gate, up) pairs [j0, j1) of one row's products gu [2 * inter] (rounded), plus bias [2 * inter]
 * (rounded), through gpt-oss' activation into h [inter] */
static void gptoss_up_row(const uint16_t *gu, const uint16_t *bias, long j0, long j1, float alpha, float limit,
                          uint16_t *h) {
    for (long j = j0; j < j1; j++) {
        const float g = rnd(bf16_to_f32(gu[2 * j]) + bf16_to_f32(bias[2 * j]));
        const float u = rnd(bf16_to_f32(gu[2 * j + 1]) + bf16_to_f32(bias[2 * j + 1]));
        h[j] = gptoss_act(g, u, alpha, limit);
    }
}

/* For each of `count` gpt-oss experts, with nx[e] rows X_e [nx[e], hidden]: the (gate, up) pairs
 * [j0, j1) of H_e [nx[e], inter] = act(X_e gate_up^T + bias), gate and up interleaved in gate_up's
 * rows (gate 2j, up 2j + 1) as the checkpoint stores them; gate_up [2 * inter, hidden] ([out, in],
 * decoded from mxfp4), bias [2 * inter]. `gu` is scratch [nx[e], 2 * inter] per expert (the
 * products, rounded as torch rounds them, before the bias). */
int moe_gptoss_up(const uint16_t *const *gate_up, const uint16_t *const *bias, const uint16_t *const *x,
                  const long *nx, long count, long hidden, long inter, float alpha, float limit, long j0, long j1,
                  uint16_t *const *gu, uint16_t *const *h) {
    for (long e = 0; e < count; e++) {
        if (nx[e] < 1 || nx[e] > ROWS_MAX) return -2;
        matmat_rows(gate_up[e], hidden, x[e], nx[e], 2 * j0, 2 * j1, gu[e], 2 * inter);
        for (long b = 0; b < nx[e]; b++)
            gptoss_up_row(gu[e] + b * 2 * inter, bias[e], j0, j1, alpha, limit, h[e] + b * inter);
    }
    return 0;
}

/* The same from `moe_inout_sums`' parts (gate_up in [in, out]): pairs [j0, j1) of every
 * expert's rows. */
int moe_gptoss_up_sums(const float *acc, int parts, const uint16_t *const *bias, const long *nx, long count,
                       long inter, float alpha, float limit, long j0, long j1, uint16_t *const *gu,
                       uint16_t *const *h) {
    long total = 0;
    for (long e = 0; e < count; e++) total += nx[e];
    for (long e = 0, row = 0; e < count; e++)
        for (long b = 0; b < nx[e]; b++, row++) {
            add_parts(acc, parts, total, 2 * inter, row, 2 * j0, 2 * j1, gu[e] + b * 2 * inter);
            gptoss_up_row(gu[e] + b * 2 * inter, bias[e], j0, j1, alpha, limit, h[e] + b * inter);
        }
    return 0;
}

/* For each of `count` gpt-oss experts: outputs [c0, c1) of Y_e = H_e down^T + bias, down [hidden,
 * inter] ([out, in]), bias [hidden], Y_e [nx[e], hidden]: the product rounded, then plus the bias
 * rounded, as torch's two ops. */
int moe_gptoss_down(const uint16_t *const *down, const uint16_t *const *bias, const uint16_t *const *h, const long *nx,
                    long count, long inter, long hidden, long c0, long c1, uint16_t *const *y) {
    for (long e = 0; e < count; e++) {
        if (nx[e] < 1 || nx[e] > ROWS_MAX) return -2;
        matmat_rows(down[e], inter, h[e], nx[e], c0, c1, y[e], hidden);
        for (long b = 0; b < nx[e]; b++)
            for (long c = c0; c < c1; c++)
                y[e][b * hidden + c] = f32_to_bf16(bf16_to_f32(y[e][b * hidden + c]) + bf16_to_f32(bias[e][c]));
    }
    return 0;
}

/* The same from `moe_inout_sums`' parts (down in [in, out]): outputs [c0, c1) of every expert's
 * rows. */
int moe_gptoss_down_sums(const float *acc, int parts, const uint16_t *const *bias, const long *nx, long count,
                         long hidden, long c0, long c1, uint16_t *const *y) {
    long total = 0;
    for (long e = 0; e < count; e++) total += nx[e];
    for (long e = 0, row = 0; e < count; e++)
        for (long b = 0; b < nx[e]; b++, row++) {
            uint16_t *out = y[e] + b * hidden;
            add_parts(acc, parts, total, hidden, row, c0, c1, out);
            for (long c = c0; c < c1; c++) out[c] = f32_to_bf16(bf16_to_f32(out[c]) + bf16_to_f32(bias[e][c]));
        }
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
