/* One-row linear for the CPU: y[out] = x[in] . W[in, out] (+ bias), W stored [in, out].
 *
 * A decode step at batch 1 is a chain of these, and it is bound by reading the weights: the
 * bench model's 118 MB once a step. Each thread owns a contiguous range of output columns and
 * streams its part of every weight row in order (the hardware prefetcher follows), keeping its
 * accumulators in L1; four rows are folded per pass so the accumulators are loaded and stored
 * once per 32 weight floats read. Summation runs over `in` in order, with FMA, whatever the
 * thread count: results do not depend on it.
 *
 * Threads: OpenMP on torch's own libgomp (see cpu_decode_attention.c).
 */
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }

/* columns [c0, c1) of y; c1 - c0 a multiple of 8 except possibly at the end of the row */
static void gemv_cols(const float *x, const float *w, float *y, int64_t in, int64_t out, int64_t c0, int64_t c1) {
    const int64_t n8 = c0 + ((c1 - c0) & ~(int64_t)7);
    memset(y + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    int64_t i = 0;
    for (; i + 4 <= in; i += 4) {
        const float *w0 = w + i * out, *w1 = w0 + out, *w2 = w1 + out, *w3 = w2 + out;
        const v8 x0 = {x[i], x[i], x[i], x[i], x[i], x[i], x[i], x[i]};
        const v8 x1 = {x[i + 1], x[i + 1], x[i + 1], x[i + 1], x[i + 1], x[i + 1], x[i + 1], x[i + 1]};
        const v8 x2 = {x[i + 2], x[i + 2], x[i + 2], x[i + 2], x[i + 2], x[i + 2], x[i + 2], x[i + 2]};
        const v8 x3 = {x[i + 3], x[i + 3], x[i + 3], x[i + 3], x[i + 3], x[i + 3], x[i + 3], x[i + 3]};
        for (int64_t j = c0; j < n8; j += 8) {
            v8 acc = load8(y + j);
            acc += x0 * load8(w0 + j);
            acc += x1 * load8(w1 + j);
            acc += x2 * load8(w2 + j);
            acc += x3 * load8(w3 + j);
            store8(y + j, acc);
        }
        for (int64_t j = n8; j < c1; j++)
            y[j] = (((y[j] + x[i] * w0[j]) + x[i + 1] * w1[j]) + x[i + 2] * w2[j]) + x[i + 3] * w3[j];
    }
    for (; i < in; i++) {
        const float *wi = w + i * out;
        const v8 xi = {x[i], x[i], x[i], x[i], x[i], x[i], x[i], x[i]};
        for (int64_t j = c0; j < n8; j += 8) store8(y + j, load8(y + j) + xi * load8(wi + j));
        for (int64_t j = n8; j < c1; j++) y[j] += x[i] * wi[j];
    }
}

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
