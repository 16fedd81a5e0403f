/* Few-row linear on the CPU: y[m, out] = x[m, in] . W (+ bias), for decode steps at batch 1-16.
 *
 * W is packed once (kernels/panel_gemm.py) into panels of 16 output columns,
 * [ceil(out / 16), in, 16] (the last panel zero-padded), so a panel is one contiguous run
 * (32 KB at in = 512) that the hardware prefetcher streams, and the first row tile prefetches
 * the next panel into L2 while it computes. Into L1, a panel ahead of use, a 96 KB panel (in =
 * 1536) overran the 32 KB L1 and its lines were gone when needed: all the bench model's linears
 * at one row went 6.3-7.0 -> 4.7-5.3 ms with L2 (A/B in one process). Threads split panels, so
 * each streams whole panels; the C GEMV on an [in, out] copy (each thread reading part of every
 * weight row) managed about half the rate at one row. Against oneDNN's GEMM, with L2
 * prefetch: 25-40% faster at 5-12 rows, level at 16-32 (the tile reaches ~50-65% of a core's
 * FMA rate even with the panel in L2), so the caller keeps it to 16 rows
 * (docs/benchmarks/engine.md).
 *
 * Register tile: MR = 6 rows x 16 columns (12 ymm accumulators, two weight vectors, one
 * broadcast). Every output is a sum over `in` in order, one FMA a term: a row's result depends
 * neither on how many rows share the call nor on the thread count (threads split panels).
 * Threads: OpenMP on torch's own libgomp (see cpu_decode_attention.c).
 */
#include <stddef.h>
#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

#define PANEL 16
#define MR 6

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }

int panel_width(void) { return PANEL; }  /* kernels/panel_gemm.py packs to it */

/* rows [0, mr) of x (ldx floats apart) times one panel [in, 16] -> tile[mr][16] */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx,
                                                       const float *panel, int64_t in, float *out16,
                                                       const float *next) {
    v8 acc[MR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (v8){0};
    for (int64_t k = 0; k < in; k++) {
        if (next) __builtin_prefetch(next + k * PANEL, 0, 2);  /* the next panel into L2, while this one computes */
        const v8 w0 = load8(panel + k * PANEL), w1 = load8(panel + k * PANEL + 8);
        for (int r = 0; r < mr; r++) {
            const float xs = x[r * ldx + k];
            const v8 xr = {xs, xs, xs, xs, xs, xs, xs, xs};
            acc[r][0] += xr * w0;
            acc[r][1] += xr * w1;
        }
    }
    for (int r = 0; r < mr; r++) {
        store8(out16 + r * PANEL, acc[r][0]);
        store8(out16 + r * PANEL + 8, acc[r][1]);
    }
}

/* y [m, out] (dense) = x [m, in] (rows ldx floats apart) . panels (+ bias [out], may be NULL). */
int panel_gemm_f32(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t m,
                   int64_t in, int64_t out, int nthreads) {
    const int64_t np = (out + PANEL - 1) / PANEL;
    if (nthreads < 1) nthreads = 1;
    const int parts = nthreads < np ? nthreads : (int)np;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t p = 0; p < np; p++) {
        const float *panel = panels + p * in * PANEL;
        const int64_t c = p * PANEL, width = out - c < PANEL ? out - c : PANEL;
        float buf[MR * PANEL];
        for (int64_t r = 0; r < m; r += MR) {
            const int mr = m - r < MR ? (int)(m - r) : MR;
            const float *xr = x + r * ldx;
            /* the first row tile pulls the next panel into cache while it computes */
            const float *next = r == 0 && p + 1 < np ? panel + in * PANEL : NULL;
            switch (mr) {  /* one specialised copy of the tile per row count */
                case 6: tile(6, xr, ldx, panel, in, buf, next); break;
                case 5: tile(5, xr, ldx, panel, in, buf, next); break;
                case 4: tile(4, xr, ldx, panel, in, buf, next); break;
                case 3: tile(3, xr, ldx, panel, in, buf, next); break;
                case 2: tile(2, xr, ldx, panel, in, buf, next); break;
                default: tile(1, xr, ldx, panel, in, buf, next); break;
            }
            for (int i = 0; i < mr; i++) {
                float *yr = y + (r + i) * out + c;
                for (int64_t j = 0; j < width; j++) yr[j] = bias ? buf[i * PANEL + j] + bias[c + j] : buf[i * PANEL + j];
            }
        }
    }
    return 0;
}
