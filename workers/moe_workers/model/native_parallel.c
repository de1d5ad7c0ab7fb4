/* The C kernels' entry points for Python: each splits its rows into `parts` ranges and runs them
 * on the OpenMP threads of the calling thread, which are torch's own intra-op threads (the
 * library links the libgomp torch has already loaded: one runtime, one team). A Python thread
 * pool beside torch's team left the team's threads spinning for work on the cores the kernel's
 * threads needed: at a Qwen3-30B-A3B layer on 2 cores the experts read 11-12 GB/s inside a
 * decode step against 22 alone.
 *
 * `parts` is fixed by the caller (a split that does not depend on how many threads the runtime
 * grants: vecmat's partial sums are one row per part); the parts go round-robin over the
 * threads there are. */
#include <stdint.h>
#include <omp.h>

int moe_fp8(const uint8_t *q, const float *s, long cols, long row0, long row1, long b0, long b1, void *out, int kind);
int moe_mxfp4(const uint8_t *b, const uint8_t *s, long groups, void *out, int kind);
int moe_swiglu_up(const uint16_t *const *w1, const uint16_t *const *w3, const uint16_t *const *x, const long *nx,
                  long count, long hidden, long inter, long r0, long r1, uint16_t *const *gate, uint16_t *const *up,
                  uint16_t *const *h);
int moe_swiglu_down(const uint16_t *const *w2, const uint16_t *const *h, const long *nx, long count, long inter,
                    long hidden, long r0, long r1, uint16_t *const *y);
int moe_gptoss_up(const uint16_t *const *gate_up, const uint16_t *const *bias, const uint16_t *const *x,
                  const long *nx, long count, long hidden, long inter, float alpha, float limit, long j0, long j1,
                  uint16_t *const *gu, uint16_t *const *h);
int moe_gptoss_down(const uint16_t *const *down, const uint16_t *const *bias, const uint16_t *const *h, const long *nx,
                    long count, long inter, long hidden, long c0, long c1, uint16_t *const *y);
int moe_inout_sums(const uint16_t *const *w, const uint16_t *const *x, const long *nx, long count, long n, long m,
                   long i0, long i1, float *acc);
int moe_gptoss_up_sums(const float *acc, int parts, const uint16_t *const *bias, const long *nx, long count,
                       long inter, float alpha, float limit, long j0, long j1, uint16_t *const *gu,
                       uint16_t *const *h);
int moe_gptoss_down_sums(const float *acc, int parts, const uint16_t *const *bias, const long *nx, long count,
                         long hidden, long c0, long c1, uint16_t *const *y);
int moe_matvec_rows(const uint16_t *w, long n, const uint16_t *x, long nx, long rows, long r0, long r1, uint16_t *y);
int moe_vecmat_rows(const uint16_t *x, const uint16_t *w, long m, long r0, long r1, float *acc);

static const long KIND_BYTES[] = {4, 2, 2}; /* OUT_F32, OUT_BF16, OUT_F16 */

/* part p of n items in `parts` ranges: [*a, *b) */
static inline void part_range(long n, int parts, int p, long *a, long *b) {
    const long step = (n + parts - 1) / parts;
    *a = p * step < n ? p * step : n;
    *b = *a + step < n ? *a + step : n;
}

/* the body runs once per part, with its range [a, b) and index p; the first error wins */
#define EACH_PART(n, parts, body)                                                                \
    int rc = 0;                                                                                  \
    _Pragma("omp parallel num_threads(parts)")                                                   \
    for (int p = omp_get_thread_num(); p < parts; p += omp_get_num_threads()) {                  \
        long a, b;                                                                               \
        part_range(n, parts, p, &a, &b);                                                         \
        if (a < b) {                                                                             \
            const int r = (body);                                                                \
            if (r) {                                                                             \
                _Pragma("omp atomic write") rc = r;                                              \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    return rc;

int moe_fp8_par(const uint8_t *q, const float *s, long rows, long cols, long b0, long b1, void *out, int kind,
                int parts) {
    if (kind < 0 || kind > 2) return -1;
    EACH_PART(rows, parts, moe_fp8(q, s, cols, a, b, b0, b1, (char *)out + a * cols * KIND_BYTES[kind], kind))
}

int moe_mxfp4_par(const uint8_t *blocks, const uint8_t *s, long groups, void *out, int kind, int parts) {
    if (kind < 0 || kind > 2) return -1;
    EACH_PART(groups, parts,
              moe_mxfp4(blocks + 16 * a, s + a, b - a, (char *)out + 32 * a * KIND_BYTES[kind], kind))
}

int moe_swiglu_up_par(const uint16_t *const *w1, const uint16_t *const *w3, const uint16_t *const *x, const long *nx,
                      long count, long hidden, long inter, uint16_t *const *gate, uint16_t *const *up,
                      uint16_t *const *h, int parts) {
    EACH_PART(inter, parts, moe_swiglu_up(w1, w3, x, nx, count, hidden, inter, a, b, gate, up, h))
}

int moe_swiglu_down_par(const uint16_t *const *w2, const uint16_t *const *h, const long *nx, long count, long inter,
                        long hidden, uint16_t *const *y, int parts) {
    EACH_PART(hidden, parts, moe_swiglu_down(w2, h, nx, count, inter, hidden, a, b, y))
}

/* gpt-oss' experts in [in, out]: part p's sums over its range of W's rows into acc [parts, all
 * experts' rows, m] (the next call adds the parts) */
static int inout_sums_par(const uint16_t *const *w, const uint16_t *const *x, const long *nx, long count, long n,
                          long m, float *acc, int parts) {
    long total = 0;
    for (long e = 0; e < count; e++) total += nx[e];
    EACH_PART(n, parts, moe_inout_sums(w, x, nx, count, n, m, a, b, acc + p * total * m))
}

static int gptoss_up_sums_par(const float *acc, const uint16_t *const *bias, const long *nx, long count, long inter,
                              float alpha, float limit, uint16_t *const *gu, uint16_t *const *h, int parts) {
    EACH_PART(inter, parts, moe_gptoss_up_sums(acc, parts, bias, nx, count, inter, alpha, limit, a, b, gu, h))
}

static int gptoss_down_sums_par(const float *acc, const uint16_t *const *bias, const long *nx, long count,
                                long hidden, uint16_t *const *y, int parts) {
    EACH_PART(hidden, parts, moe_gptoss_down_sums(acc, parts, bias, nx, count, hidden, a, b, y))
}

/* out_in: gate_up [2 * inter, hidden] rows split across the parts; else [hidden, 2 * inter], its
 * rows (the sums) split, then the pairs; acc [parts, all experts' rows, 2 * inter] float32
 * (unused when out_in) */
int moe_gptoss_up_par(const uint16_t *const *gate_up, const uint16_t *const *bias, const uint16_t *const *x,
                      const long *nx, long count, long hidden, long inter, int out_in, float alpha, float limit,
                      uint16_t *const *gu, uint16_t *const *h, float *acc, int parts) {
    if (!out_in) {
        const int rc = inout_sums_par(gate_up, x, nx, count, hidden, 2 * inter, acc, parts);
        return rc ? rc : gptoss_up_sums_par(acc, bias, nx, count, inter, alpha, limit, gu, h, parts);
    }
    EACH_PART(inter, parts, moe_gptoss_up(gate_up, bias, x, nx, count, hidden, inter, alpha, limit, a, b, gu, h))
}

/* the same for down ([hidden, inter] when out_in, else [inter, hidden]; acc [parts, rows, hidden]) */
int moe_gptoss_down_par(const uint16_t *const *down, const uint16_t *const *bias, const uint16_t *const *h,
                        const long *nx, long count, long inter, long hidden, int out_in, uint16_t *const *y,
                        float *acc, int parts) {
    if (!out_in) {
        const int rc = inout_sums_par(down, h, nx, count, inter, hidden, acc, parts);
        return rc ? rc : gptoss_down_sums_par(acc, bias, nx, count, hidden, y, parts);
    }
    EACH_PART(hidden, parts, moe_gptoss_down(down, bias, h, nx, count, inter, hidden, a, b, y))
}

int moe_matvec_par(const uint16_t *w, long rows, long n, const uint16_t *x, long nx, uint16_t *y, int parts) {
    EACH_PART(rows, parts, moe_matvec_rows(w, n, x, nx, rows, a, b, y))
}

/* acc [parts, m]: part p's sum over its rows of w; the caller adds the rows */
int moe_vecmat_par(const uint16_t *x, const uint16_t *w, long n, long m, float *acc, int parts) {
    EACH_PART(n, parts, moe_vecmat_rows(x, w, m, a, b, acc + p * m))
}
