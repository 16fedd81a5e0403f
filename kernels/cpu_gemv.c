/* One-row linear for the CPU: y[out] = x[in] . W[in, out] (+ bias), W stored [in, out].
 *
 * A decode step at batch 1 is a chain of these, and it is bound by reading the weights: the
 * bench model's 118 MB once a step. Each thread owns a contiguous range of output columns and
 * streams its part of every weight row in order (the hardware prefetcher follows), keeping its
 * accumulators in L1; four rows are folded per pass so the accumulators are loaded and stored
 * once per 32 weight floats read. Summation runs over `in` in order, with FMA, whatever the
 * thread count: results do not depend on it.
 *
 * bf16 (`gemv_bf16`): the same walk over a bf16 weight, each 8 weights widened to fp32 as they are
 * loaded (exact), the input widened once, the sums in fp32 (a per-thread buffer) and each output
 * rounded to bf16 once: the one-row step of a model whose panel copy does not fit in memory.
 *
 * Threads: OpenMP on torch's own libgomp (see cpu_decode_attention.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }
static inline float load1(const float *p) { return *p; }
static inline float load1_bf16(const uint16_t *p) { return bf16_to_f32(*p); }

/* columns [c0, c1) of y (fp32; c1 - c0 a multiple of 8 except possibly at the end of the row) =
 * x (fp32) . w ([in, out] of WT; LOADV(p) gives 8 weights as floats, LOAD1(p) one) */
#define DEFINE_GEMV_COLS(name, WT, LOADV, LOAD1)                                                             \
    static void name(const float *x, const WT *w, float *y, int64_t in, int64_t out, int64_t c0, int64_t c1) { \
        const int64_t n8 = c0 + ((c1 - c0) & ~(int64_t)7);                                                    \
        memset(y + c0, 0, (size_t)(c1 - c0) * sizeof(float));                                                 \
        int64_t i = 0;                                                                                        \
        for (; i + 4 <= in; i += 4) {                                                                         \
            const WT *w0 = w + i * out, *w1 = w0 + out, *w2 = w1 + out, *w3 = w2 + out;                       \
            const v8 x0 = (v8){0} + x[i], x1 = (v8){0} + x[i + 1], x2 = (v8){0} + x[i + 2];                   \
            const v8 x3 = (v8){0} + x[i + 3];                                                                 \
            for (int64_t j = c0; j < n8; j += 8) {                                                            \
                v8 acc = load8(y + j);                                                                        \
                acc += x0 * LOADV(w0 + j);                                                                    \
                acc += x1 * LOADV(w1 + j);                                                                    \
                acc += x2 * LOADV(w2 + j);                                                                    \
                acc += x3 * LOADV(w3 + j);                                                                    \
                store8(y + j, acc);                                                                           \
            }                                                                                                 \
            for (int64_t j = n8; j < c1; j++)                                                                 \
                y[j] = (((y[j] + x[i] * LOAD1(w0 + j)) + x[i + 1] * LOAD1(w1 + j)) + x[i + 2] * LOAD1(w2 + j)) + \
                       x[i + 3] * LOAD1(w3 + j);                                                              \
        }                                                                                                     \
        for (; i < in; i++) {                                                                                 \
            const WT *wi = w + i * out;                                                                       \
            const v8 xi = (v8){0} + x[i];                                                                     \
            for (int64_t j = c0; j < n8; j += 8) store8(y + j, load8(y + j) + xi * LOADV(wi + j));           \
            for (int64_t j = n8; j < c1; j++) y[j] += x[i] * LOAD1(wi + j);                                   \
        }                                                                                                     \
    }

DEFINE_GEMV_COLS(gemv_cols, float, load8, load1)
DEFINE_GEMV_COLS(gemv_cols_bf16, uint16_t, bf16_widen8, load1_bf16)

/* y = x . w (+ bias). bias may be NULL. Returns 0. */
int gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t in, int64_t out, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    int64_t per = (out + nthreads - 1) / nthreads;
    per = (per + 7) & ~(int64_t)7;              /* ranges start on 8-float boundaries */
    const int parts = (int)((out + per - 1) / per);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int t = 0; t < parts; t++) {
        const int64_t c0 = t * per, c1 = c0 + per < out ? c0 + per : out;
        gemv_cols(x, w, y, in, out, c0, c1);
        if (bias)
            for (int64_t j = c0; j < c1; j++) y[j] += bias[j];
    }
    return 0;
}

/* bf16: y = x . w (+ bias), all bf16; bias may be NULL. Returns 0, or -1 when memory is short. */
int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t in, int64_t out,
              int nthreads) {
    if (nthreads < 1) nthreads = 1;
    int64_t per = (out + nthreads - 1) / nthreads;
    per = (per + 7) & ~(int64_t)7;
    const int parts = (int)((out + per - 1) / per);
    float *xf = malloc(sizeof(float) * (size_t)(in + (int64_t)parts * per)); /* x widened, then each part's sums */
    if (!xf) return -1;
    for (int64_t i = 0; i < in; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int t = 0; t < parts; t++) {
        const int64_t c0 = t * per, c1 = c0 + per < out ? c0 + per : out;
        float *acc = xf + in + t * per; /* the sums of columns [c0, c1), at acc[j - c0] */
        gemv_cols_bf16(xf, w + c0, acc, in, out, 0, c1 - c0); /* the weight from column c0 on */
        for (int64_t j = c0; j < c1; j++) y[j] = f32_to_bf16(bias ? acc[j - c0] + bf16_to_f32(bias[j]) : acc[j - c0]);
    }
    free(xf);
    return 0;
}
