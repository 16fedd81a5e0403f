/* Weight-only int8 / int4 linear with int8 activations on the CPU: y[m, out] = x[m, in] . dequant(W)^T.
 *
 * The weight formats are kernels/cpu_quant_gemm.c's (kernels/quant_gemm.py `QuantWeight`): groups of
 * GROUP = 32 inputs, one fp32 scale d per sg (32 or 16) inputs, int8 q or int4 nibbles (byte j of
 * a group: element j low, j + 16 high), symmetric (int4: w = (nibble - 8) d) or affine
 * (w = q d + m). This kernel first quantizes each row of x per group of 32, as llama.cpp does for
 * its dot products: dx = max|x| / 127, xq = round(x / dx) in [-127, 127], and the sum of xq per
 * scale group. Then a group's products are integers, summed exactly (AVX2's maddubs + madd, or
 * VNNI's dpbusd: the same int32 lanes), and
 *   y = sum_groups sum_lanes float(lane) * (d dx)  +  sum_scales m (dx sum xq)  (+ bias)
 * with m = -8 d for symmetric int4 and no such term for symmetric int8. One group costs a few
 * integer instructions instead of widening 32 weights to fp32: this is what keeps a decode step
 * bound by reading the weights on a 2-core AVX2 machine, where the fp32 kernel was bound by its
 * instructions. The activations' rounding makes results differ from the fp32 kernel's by ~1e-3
 * relative (tests measure agreement).
 *
 * Order: every (output, row) pair sums its groups in 8 fp32 lanes (lane k holds inputs 4k..4k+3
 * of each group) and then the lanes in order, on every build (AVX2, AVX-512, VNNI or plain C), so a
 * row's result depends neither on the other rows in the call nor on the thread count nor on the
 * instruction set. Threads (OpenMP) split output rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "thread_scratch.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32
#define LANES 8
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32 /* output rows ahead whose weights are prefetched (as cpu_quant_gemm.c) */
#endif
#define JT 4             /* outputs a tile with one row; 2 x 2 tiles with more */

/* v's value is taken as computed: the compiler may not regroup the operations around it */
#if defined(__x86_64__) && defined(__AVX2__)
#define KEEP(v) __asm__("" : "+v"(v))
#else /* through memory: any type, any target */
#define KEEP(v) __asm__("" : "+m"(v))
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

int quant_dot_group(void) { return GROUP; } /* kernels/quant_gemm.py checks it */

/* ---- the activations, quantized per group of 32 ---- */

typedef struct {
    int8_t *q;   /* [m, in] */
    float *d;    /* [m, in / 32]: dx */
    float *sums; /* [m, in / sg]: dx * (sum of xq over the scale group) */
} qrows;


static void quantize_row(const float *x, int64_t in, int sg_shift, int8_t *xq, float *xd, float *xs) {
    for (int64_t g = 0; g < in / GROUP; g++) {
        const float *v = x + g * GROUP;
        float amax = 0.0f;
        for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s[2] = {0, 0};
        for (int i = 0; i < GROUP; i++) {
            const int32_t q = (int32_t)nearbyintf(v[i] * id);
            xq[g * GROUP + i] = (int8_t)q;
            s[i >> 4] += q;
        }
        xd[g] = d;
        if (sg_shift == 5) {
            xs[g] = d * (float)(s[0] + s[1]);
        } else {
            xs[2 * g] = d * (float)s[0];
            xs[2 * g + 1] = d * (float)s[1];
        }
    }
}

/* ---- one group's integer dot: 8 int32 lanes, lane k = inputs 4k..4k+3 ---- */

#if defined(__AVX2__)
typedef struct {
    __m256i u; /* the weights as unsigned bytes: nibbles, or |q| */
    __m256i s; /* int8 weights (their signs go onto x), unused for int4 */
} wgroup;

static inline __attribute__((always_inline)) wgroup load_w(const int bits, const uint8_t *g) {
    wgroup w;
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)g), nib = _mm_set1_epi8(15);
        w.u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib)); /* 0..15 | 16..31 */
        w.s = w.u;
    } else {
        w.s = _mm256_loadu_si256((const __m256i *)g);
        w.u = _mm256_sign_epi8(w.s, w.s); /* |q| (-128 -> 128 as unsigned) */
    }
    return w;
}

static inline __attribute__((always_inline)) v8f dot_lanes(const int bits, wgroup w, const int8_t *xg) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xg);
    if (bits == 8) x = _mm256_sign_epi8(x, w.s); /* x * sign(q): |q| . that = q . x */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w.u, x);
#elif defined(__AVXVNNI__)
    const __m256i p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w.u, x);
#else
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, x), _mm256_set1_epi16(1)); /* |.| <= 32512 */
#endif
    return (v8f)_mm256_cvtepi32_ps(p);
}
#else
typedef struct {
    uint8_t u[GROUP];
    int8_t s[GROUP];
} wgroup;

static inline wgroup load_w(const int bits, const uint8_t *g) {
    wgroup w;
    for (int i = 0; i < GROUP; i++) {
        const int v = bits == 4 ? (i < 16 ? g[i] & 15 : g[i - 16] >> 4) : (int8_t)g[i];
        w.s[i] = (int8_t)v;
        w.u[i] = (uint8_t)v;
    }
    return w;
}

static inline v8f dot_lanes(const int bits, wgroup w, const int8_t *xg) {
    v8f out;
    for (int k = 0; k < LANES; k++) {
        int32_t s = 0;
        for (int i = 4 * k; i < 4 * k + 4; i++) s += (bits == 4 ? (int32_t)w.u[i] : (int32_t)w.s[i]) * xg[i];
        out[k] = (float)s;
    }
    return out;
}
#endif

/* the 8 lanes' factors d dx: one scale a group (sg 32), or lanes 0-3 and 4-7 each their own (sg 16) */
static inline __attribute__((always_inline)) v8f lane_scales(const int sg_shift, const float *d, float dx) {
    if (sg_shift == 5) return (v8f){0} + d[0] * dx;
    const float a = d[0] * dx, b = d[1] * dx;
    return (v8f){a, a, a, a, b, b, b, b};
}

/* sum_k m_k * xs_k over one row's scales, m_k = offsets (affine) or -8 d (symmetric int4): 8 lanes,
 * then in order (the same on every build) */
static float offset_term(const int bits, const float *scales, const float *offsets, const float *xs, int64_t n) {
    if (!offsets && bits == 8) return 0.0f;
    v8f acc = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES) {
        v8f mv, xv;
        memcpy(&mv, (offsets ? offsets : scales) + k, sizeof mv);
        memcpy(&xv, xs + k, sizeof xv);
        if (!offsets) {
            mv = mv * -8.0f;
            KEEP(mv);
        }
        v8f t = acc + mv * xv;
        KEEP(t);
        acc = t;
    }
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) {
        sum += acc[i];
        KEEP(sum);
    }
    for (; k < n; k++) {
        float mk = offsets ? offsets[k] : scales[k] * -8.0f;
        KEEP(mk);
        sum += mk * xs[k];
        KEEP(sum);
    }
    return sum;
}

/* jn outputs from `o` times rn rows of the quantized x -> y */
static inline __attribute__((always_inline)) void tile(const int bits, const int sg_shift, const int jn, const int rn,
                                                       const qrows *x, int64_t r0, const uint8_t *q,
                                                       const float *scales, const float *offsets, const float *bias,
                                                       float *y, int64_t ldy, int64_t in, int64_t o) {
    const int64_t groups = in / GROUP, gbytes = GROUP * bits / 8, row_bytes = groups * gbytes;
    const int64_t row_scales = in >> sg_shift, per_group = GROUP >> sg_shift; /* scales a group: 1 or 2 */
    v8f acc[JT][2];
    for (int j = 0; j < jn; j++)
        for (int r = 0; r < rn; r++) acc[j][r] = (v8f){0};
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < jn; j++) {
            const wgroup w = load_w(bits, q + (o + j) * row_bytes + g * gbytes);
            const float *d = scales + (o + j) * row_scales + g * per_group;
            for (int r = 0; r < rn; r++) {
                const int64_t xr = r0 + r;
                const v8f p = dot_lanes(bits, w, x->q + xr * in + g * GROUP);
                const v8f sv = lane_scales(sg_shift, d, x->d[xr * groups + g]);
                v8f t = acc[j][r] + p * sv;
                KEEP(t);
                acc[j][r] = t;
            }
        }
    }
    for (int j = 0; j < jn; j++)
        for (int r = 0; r < rn; r++) {
            const int64_t xr = r0 + r, k0 = (o + j) * row_scales;
            float sum = 0.0f;
            for (int i = 0; i < LANES; i++) {
                sum += acc[j][r][i];
                KEEP(sum);
            }
            sum += offset_term(bits, scales + k0, offsets ? offsets + k0 : 0, x->sums + xr * row_scales, row_scales);
            y[xr * ldy + o + j] = sum + (bias ? bias[o + j] : 0.0f);
        }
}

#define TILE(BITS, SG, JN, RN) tile(BITS, SG, JN, RN, x, r, q, scales, offsets, bias, y, out, in, o)
#define KIND(JN, RN)                                  \
    do {                                              \
        if (bits == 8 && sg_shift == 5) TILE(8, 5, JN, RN); \
        else if (bits == 8) TILE(8, 4, JN, RN);             \
        else if (sg_shift == 5) TILE(4, 5, JN, RN);         \
        else TILE(4, 4, JN, RN);                            \
    } while (0)
static void rows_range(const int bits, const int sg_shift, const qrows *x, const uint8_t *q, const float *scales,
                       const float *offsets, const float *bias, float *y, int64_t m, int64_t in, int64_t out,
                       int64_t o0, int64_t o1) {
    const int64_t row_bytes = in / GROUP * (GROUP * bits / 8), row_scales = in >> sg_shift;
    const int jt = m < 2 ? 4 : 2;
    for (int64_t o = o0; o < o1;) {
        const int jn = o + jt <= o1 ? jt : 1;
        if (o + PREFETCH_ROWS + jt <= o1) { /* the weights PREFETCH_ROWS rows ahead, on their way from memory */
            const char *ahead = (const char *)(q + (o + PREFETCH_ROWS) * row_bytes);
            for (int64_t b = 0; b < jt * row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
            for (int k = 0; k < 1 + (offsets != 0); k++) {
                const char *sahead = (const char *)((k ? offsets : scales) + (o + PREFETCH_ROWS) * row_scales);
                for (int64_t b = 0; b < jt * row_scales * 4; b += 64) __builtin_prefetch(sahead + b, 0, 0);
            }
        }
        int64_t r = 0;
        for (; r + 2 <= m; r += 2) {
            if (jn == 2) KIND(2, 2);
            else KIND(1, 2);
        }
        for (; r < m; r++) {
            if (jn == 4) KIND(4, 1);
            else if (jn == 2) KIND(2, 1);
            else KIND(1, 1);
        }
        o += jn;
    }
}
#undef KIND
#undef TILE

static int sg_shift_of(int sg) { return sg == 32 ? 5 : sg == 16 ? 4 : -1; }

/* Arguments as cpu_quant_gemm.c's quant_gemm_f32 (so the decode driver calls either): y [m, out] =
 * x [m, in] (rows ldx floats apart) . dequant(q, scales, offsets)^T (+ bias; may be NULL), x's
 * rows quantized to int8 first. Returns 0, -1 for a bad argument, -2 when out of memory. */
int quant_gemm_int8x(const float *x, int64_t ldx, const uint8_t *q, const float *scales, const float *offsets,
                     const float *bias, float *y, int64_t m, int64_t in, int64_t out, int bits, int sg, int nthreads) {
    const int sg_shift = sg_shift_of(sg);
    if ((bits != 8 && bits != 4) || in % GROUP || m < 1 || sg_shift < 0) return -1;
    const int64_t groups = in / GROUP, row_scales = in >> sg_shift;
    const size_t qbytes = (size_t)(m * in + 63) / 64 * 64;
    char *mem = scratch(qbytes + (size_t)m * (groups + row_scales) * sizeof(float));
    if (!mem) return -2;
    qrows xr = {(int8_t *)mem, (float *)(mem + qbytes), (float *)(mem + qbytes) + m * groups};
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * ldx, in, sg_shift, xr.q + r * in, xr.d + r * groups, xr.sums + r * row_scales);
    if (nthreads < 1) nthreads = 1;
    int64_t per = (out + nthreads - 1) / nthreads;
    per = (per + JT - 1) / JT * JT; /* ranges of whole tiles */
    const int parts = (int)((out + per - 1) / per);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int t = 0; t < parts; t++) {
        const int64_t o0 = t * per, o1 = o0 + per < out ? o0 + per : out;
        rows_range(bits, sg_shift, &xr, q, scales, offsets, bias, y, m, in, out, o0, o1);
    }
    return 0;
}
