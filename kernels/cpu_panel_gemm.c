/* Few-row linear on the CPU: y[m, out] = x[m, in] . W (+ bias), for decode steps at batch 1-16
 * (AVX2) or 1-32 (AVX-512; kernels/panel_gemm.py `few_rows`).
 *
 * W is packed once (kernels/panel_gemm.py) into panels of 16 output columns,
 * [ceil(out / 16), in, 16] (the last panel zero-padded), so a panel is one contiguous run
 * (32 KB at in = 512) that the hardware prefetcher streams, and the first row tile prefetches
 * the next panel into L2 while it computes. Into L1, a panel ahead of use, a 96 KB panel (in =
 * 1536) overran the 32 KB L1 and its lines were gone when needed: all the bench model's linears
 * at one row went 6.3-7.0 -> 4.7-5.3 ms with L2 (A/B in one process). Threads split panels, so
 * each streams whole panels; the C GEMV on an [in, out] copy (each thread reading part of every
 * weight row) managed about half the rate at one row. Against oneDNN's GEMM, with L2
 * prefetch: the AVX2 tile 25-40% faster at 5-12 rows, level at 16-32 (it reaches ~50-65% of a
 * core's FMA rate even with the panel in L2), so there the caller keeps it to 16 rows; the AVX-512
 * tile 1.1-1.5x oneDNN from 8 to 32 rows (docs/benchmarks/engine.md).
 *
 * Register tiles, rows x 16 columns: two ymm a row, up to 6 rows (12 accumulators, two weight
 * vectors, one broadcast); with AVX-512 also one zmm a row, 7 to 16 rows (up to 16 accumulators, the
 * weight vector, broadcasts folded into the FMAs), so a decode step of up to 16 rows reads each
 * panel once. Fewer zmm rows than that leave too few independent FMA chains to hide the FMA
 * latency (6 zmm rows ran 10-15% slower than 6 ymm ones), so those stay on ymm. Every output is a
 * sum over `in` in order, one FMA a term, whatever the tile: a row's result depends neither on how
 * many rows share the call, nor on the thread count (threads split panels), nor on the vector width.
 * Threads: OpenMP on torch's own libgomp (see cpu_decode_attention.c).
 *
 * bf16 weights (`panel_gemm_bf16`): the same tiles on bf16 panels, each weight vector widened to
 * fp32 as it is loaded (the 16 bits moved up: exact), the inputs widened once per call, the sums in
 * fp32 and each output rounded to bf16 once (nearest even), as torch's bf16 linear rounds: half
 * the bytes of an fp32 panel for a decode step to read.
 */
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

#define PANEL 16
#define MR_Y 6 /* rows of the ymm tile */
#if defined(__AVX512F__)
#define MR 16 /* rows of the widest tile */
#else
#define MR MR_Y
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

int panel_width(void) { return PANEL; }  /* kernels/panel_gemm.py packs to it */
int panel_tile_rows(void) { return MR; }  /* rows a pass over a panel takes, at most */

/* rows [0, mr) of x (ldx floats apart) times one panel [in, 16] of WT weights -> tile[mr][16], VW
 * floats a vector (8: two a row; 16: one a row); LOADW(p) gives the VW weights at p as floats */
#define DEFINE_TILE(name, VW, VT, VTU, WT, LOADW)                                                        \
    static inline __attribute__((always_inline)) void name(const int mr, const float *x, int64_t ldx, \
                                                           const WT *panel, int64_t in, float *out16,    \
                                                           const WT *next) {                             \
        enum { PV = PANEL / VW };                                                                        \
        VT acc[MR][PV];                                                                                  \
        for (int r = 0; r < mr; r++)                                                                     \
            for (int v = 0; v < PV; v++) acc[r][v] = (VT){0};                                            \
        for (int64_t k = 0; k < in; k++) {                                                               \
            if (next) __builtin_prefetch(next + k * PANEL, 0, 2); /* the next panel into L2 */           \
            VT w[PV];                                                                                    \
            for (int v = 0; v < PV; v++) w[v] = LOADW(panel + k * PANEL + v * VW);                       \
            for (int r = 0; r < mr; r++) {                                                               \
                const VT xr = (VT){0} + x[r * ldx + k];                                                  \
                for (int v = 0; v < PV; v++) acc[r][v] += xr * w[v];                                     \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < mr; r++)                                                                     \
            for (int v = 0; v < PV; v++) *(VTU *)(out16 + r * PANEL + v * VW) = acc[r][v];               \
    }

static inline v8 load8_f32(const float *p) { return *(const v8u *)p; }

DEFINE_TILE(tile_y, 8, v8, v8u, float, load8_f32)
DEFINE_TILE(tile_y_bf16, 8, v8, v8u, uint16_t, bf16_widen8)
#if MR == 16
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
static inline v16 load16_f32(const float *p) { return *(const v16u *)p; }
DEFINE_TILE(tile_z, 16, v16, v16u, float, load16_f32)
DEFINE_TILE(tile_z_bf16, 16, v16, v16u, uint16_t, bf16_widen16)
#endif

#define TILE_Y(n, T) \
    case n: T(n, xr, ldx, panel, in, buf, next); break;
#if MR == 16
#define Z_CASES(T)                                                                                       \
    TILE_Y(16, T) TILE_Y(15, T) TILE_Y(14, T) TILE_Y(13, T) TILE_Y(12, T) TILE_Y(11, T) TILE_Y(10, T) \
    TILE_Y(9, T) TILE_Y(8, T) TILE_Y(7, T)
#else
#define Z_CASES(T)
#endif

/* y [m, out] (dense; fp32, or bf16 rounded once from the fp32 sum when BF16_OUT) = x [m, in] (fp32,
 * rows ldx floats apart) . panels of WT (+ bias [out] of WT, may be NULL). */
#define DEFINE_GEMM(name, WT, TY, TZ, WIDEN, YT, STORE)                                                      \
    static int name(const float *x, int64_t ldx, const WT *panels, const WT *bias, YT *y, int64_t m,          \
                    int64_t in, int64_t out, int nthreads) {                                                  \
        const int64_t np = (out + PANEL - 1) / PANEL;                                                         \
        if (nthreads < 1) nthreads = 1;                                                                       \
        const int parts = nthreads < np ? nthreads : (int)np;                                                 \
        _Pragma("omp parallel for num_threads(parts) schedule(static) if (parts > 1)")                         \
        for (int64_t p = 0; p < np; p++) {                                                                    \
            const WT *panel = panels + p * in * PANEL;                                                        \
            const int64_t c = p * PANEL, width = out - c < PANEL ? out - c : PANEL;                           \
            float buf[MR * PANEL];                                                                            \
            for (int64_t r = 0; r < m; r += MR) {                                                             \
                const int mr = m - r < MR ? (int)(m - r) : MR;                                                \
                const float *xr = x + r * ldx;                                                                \
                /* the first row tile pulls the next panel into cache while it computes */                   \
                const WT *next = r == 0 && p + 1 < np ? panel + in * PANEL : NULL;                            \
                switch (mr) { /* one specialised copy of the tile per row count */                           \
                    Z_CASES(TZ)                                                                               \
                    TILE_Y(6, TY) TILE_Y(5, TY) TILE_Y(4, TY) TILE_Y(3, TY) TILE_Y(2, TY)                    \
                    default: TY(1, xr, ldx, panel, in, buf, next); break;                                     \
                }                                                                                             \
                for (int i = 0; i < mr; i++) {                                                                \
                    YT *yr = y + (r + i) * out + c;                                                           \
                    for (int64_t j = 0; j < width; j++)                                                       \
                        yr[j] = STORE(bias ? buf[i * PANEL + j] + WIDEN(bias[c + j]) : buf[i * PANEL + j]);  \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        return 0;                                                                                             \
    }

#define SAME(v) (v)
#if MR == 16
DEFINE_GEMM(gemm_f32, float, tile_y, tile_z, SAME, float, SAME)
DEFINE_GEMM(gemm_bf16, uint16_t, tile_y_bf16, tile_z_bf16, bf16_to_f32, uint16_t, f32_to_bf16)
#else
DEFINE_GEMM(gemm_f32, float, tile_y, tile_y, SAME, float, SAME)
DEFINE_GEMM(gemm_bf16, uint16_t, tile_y_bf16, tile_y_bf16, bf16_to_f32, uint16_t, f32_to_bf16)
#endif

/* y [m, out] (dense) = x [m, in] (rows ldx floats apart) . panels (+ bias [out], may be NULL). */
int panel_gemm_f32(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t m,
                   int64_t in, int64_t out, int nthreads) {
    return gemm_f32(x, ldx, panels, bias, y, m, in, out, nthreads);
}

/* bf16 weights: y [m, out] bf16 (dense) = x [m, in] bf16 (rows ldx apart) . bf16 panels (+ bf16
 * bias), summed in fp32 and rounded once; x widened to fp32 first (into `xf`, m x in floats). */
int panel_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *panels, const uint16_t *bias, uint16_t *y,
                    float *xf, int64_t m, int64_t in, int64_t out, int nthreads) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t k = 0; k < in; k++) xf[r * in + k] = bf16_to_f32(x[r * ldx + k]);
    return gemm_bf16(xf, in, panels, bias, y, m, in, out, nthreads);
}
