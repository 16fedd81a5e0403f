/* Weight-only int8 / int4 linear on the CPU: y[m, out] = x[m, in] . dequant(W)^T (+ bias).
 *
 * Layout (kernels/quant_gemm.py `QuantWeight`): W [out, in] in groups of GROUP = 32 consecutive
 * inputs; one fp32 scale d per `sg` inputs (sg = 32, or 16: scales [out, in / sg]):
 *   int8: q [out, in] int8, w = q * d                      (GGUF Q8_0's blocks, scale widened)
 *   int4: q [out, in / 2] bytes, 16 a group; byte j of a group holds element j in its low
 *         nibble and element j + 16 in its high one, w = (nibble - 8) * d   (GGUF Q4_0's blocks)
 * Affine (offsets given, [out, in / sg] like the scales): w = q * d + m with int4's nibble taken
 * as it is (0..15, no -8): GGUF's Q4_1, Q4_K and Q5_K (its 5-bit q in int8) in the very fp32
 * operations of ggml's own dequantization (d * q, then + m: never fused into one FMA).
 * Q6_K is int8 (q - 32) with sg = 16.
 * `in` is a multiple of 32 here (the caller pads x and the weight rows with zeros).
 *
 * `quant_gemm_f32` (decode: up to 48-64 rows) reads each quantized weight once a call, widens it to
 * fp32 in registers (w = q * d, the same fp32 product as the torch reference's dequantized
 * weight) and accumulates with FMA. A tile is J output rows x R input rows (J1 x 1 when the call
 * has fewer than R rows). Every build sums an (output, row) pair in LANES = 16 fp32 lanes (one
 * zmm; two ymm with AVX2, four xmm without): lane i takes inputs i and i + 16 of each group, group
 * after group, one FMA each; then the lanes in order. KEEP pins each step: -ffast-math lets GCC
 * regroup a chain differently per tile shape (it did on AVX2, and int4 rows changed between 1- and
 * 2-row tiles). So a row's result depends neither on the other rows in the call, nor on the thread
 * count (threads split output rows; each streams contiguous weight rows), nor on AVX2 vs AVX-512
 * (tests/kernels/test_quantized_gemv.py builds both). No int8 x int8 dot
 * (VNNI): that would quantize the activations too; the kernel is bound by reading weights, not
 * by FMAs, at these sizes.
 *
 * `quant_dequant_f32` widens output rows [o0, o1) to fp32 [o1 - o0, in] (prefill: the caller
 * multiplies a tile at a time with torch's GEMM).
 *
 * Vector width: 16 floats with AVX-512, 8 with AVX2, else 4 (SSE2, or whatever the compiler
 * lowers GCC's vector extensions to; no FMA there, so other bits). Threads: OpenMP on torch's libgomp.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 32
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32 /* output rows ahead whose weights are prefetched: a decode step streams them from \
                            memory once (8-64 rows all gave 1.8-1.9x the GB/s of none here, one thread) */
#endif

#define LANES 16 /* fp32 lanes an (output, row) sum keeps, on every build */
#if defined(__AVX512F__)
#define VW 16
#define J 4
#define J1 4
#define R 4
#elif defined(__AVX2__)
#define VW 8
#define J 2
#define J1 4 /* one row: 4 outputs' 8 chains hide the FMA latency; 2 x 2 tiles share widened weights */
#define R 2
#else
#define VW 4
#define J 2
#define J1 2
#define R 1
#endif
#define NV (LANES / VW) /* vectors a sum */
#define JT (J > J1 ? J : J1) /* outputs a tile, at most: threads split whole multiples of it */

/* v's value is taken as computed: the compiler may not regroup the operations around it */
#if defined(__x86_64__)
#define KEEP(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define KEEP(v) __asm__("" : "+w"(v))
#else
#define KEEP(v) ((void)0)
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int8_t vq __attribute__((vector_size(VW)));
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

int quant_group(void) { return GROUP; } /* kernels/quant_gemm.py checks it */

static inline vf loadf(const float *p) { return *(const vfu *)p; }

/* VW int8 -> VW int32 -> fp32: by intrinsics where there are (GCC turned the vector-extension
 * form of a load and convert into byte-by-byte scalar loads) */
static inline vf to_float(vq q) {
#if defined(__AVX512F__)
    __m128i b;
    memcpy(&b, &q, sizeof b);
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#elif defined(__AVX2__)
    __m128i b = _mm_setzero_si128();
    memcpy(&b, &q, sizeof q);
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
    return __builtin_convertvector(__builtin_convertvector(q, vi), vf);
#endif
}

/* elements [s * VW, s * VW + VW) of one group, as fp32 times their scale d (plus m when affine).
 * int4 with AVX-512: a table of the 16 possible values, (k - 8) * d (or k * d + m), permuted by the
 * nibbles: the very fp32 operations of widening each nibble, in fewer instructions a weight. */
static inline __attribute__((always_inline)) vf widen(const int bits, const int affine, const uint8_t *g, const int s,
                                                      const float d, const float m) {
#if defined(__AVX512F__)
    if (bits == 4) { /* the 16 nibbles' values by one permute of a 16-entry table */
        __m128i b;
        memcpy(&b, g, sizeof b); /* VW 16: s 0 takes the low nibbles, s 1 the high ones */
        __m512i idx = _mm512_cvtepu8_epi32(b);
        if (s) idx = _mm512_srli_epi32(idx, 4);
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        vf table = (vf)(affine ? iota : _mm512_sub_ps(iota, _mm512_set1_ps(8.0f))) * d; /* (q - 8) * d */
        KEEP(table); /* the same one product per value as widening each nibble */
        if (affine) {
            table += m;
            KEEP(table);
        }
        return (vf)_mm512_permutexvar_ps(idx, (__m512)table); /* permutes read an index's low 4 bits */
    }
#elif defined(__AVX2__)
    if (bits == 4) { /* VW 8: s 0, 1 the low nibbles of bytes 0-7, 8-15; s 2, 3 the high ones */
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + (s & 1) * 8)));
        v = s < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
        if (!affine) v = _mm256_sub_epi32(v, _mm256_set1_epi32(8));
        vf w = (vf)_mm256_cvtepi32_ps(v) * d;
        KEEP(w);
        if (affine) {
            w += m;
            KEEP(w);
        }
        return w;
    }
#endif
    vq q;
    if (bits == 8) {
        memcpy(&q, g + s * VW, sizeof q);
    } else {
        const int e = s * VW; /* element offset: low nibbles hold 0..15, high ones 16..31 */
        vb b;
        memcpy(&b, g + (e & 15), sizeof b);
        q = (vq)(e < 16 ? (b & 15) : (b >> 4));
        if (!affine) q -= 8;
    }
    vf w = to_float(q) * d;
    KEEP(w); /* w = q * d stays one product: -ffast-math may not regroup it per tile */
    if (affine) {
        w += m;
        KEEP(w);
    }
    return w;
}

/* the scale (and offset) of elements [s * VW, s * VW + VW) of group g: one per sg (16 or 32) */
static inline int64_t scale_index(int64_t g, int s, int sg_shift) {
    return sg_shift == 5 ? g : g * (GROUP / 16) + ((s * VW) >> 4); /* sg 32 or 16 */
}

/* sum + v's lanes, in order (v by value: indexing the accumulators' lanes kept them in memory) */
static inline __attribute__((always_inline)) float add_lanes(float sum, vf v) {
    for (int i = 0; i < VW; i++) {
        sum += v[i];
        KEEP(sum);
    }
    return sum;
}

/* How a weight's scales are laid out: one per 2^sg_shift inputs; offsets NULL (symmetric) or like
 * the scales (affine). */
typedef struct {
    const float *scales, *offsets;
    int sg_shift;
} qscales;

/* jn (<= JT) output rows from `o` times rn (<= R) rows of x -> y */
static inline __attribute__((always_inline)) void tile(const int bits, const int affine, const int sg_shift,
                                                       const int jn, const int rn, const float *x, int64_t ldx,
                                                       const uint8_t *q, qscales sc, const float *bias, float *y,
                                                       int64_t ldy, int64_t in, int64_t o) {
    const int64_t groups = in / GROUP, gbytes = GROUP * bits / 8, row_bytes = groups * gbytes;
    const int64_t row_scales = in >> sg_shift;
    vf acc[JT][R][NV]; /* elements [s * VW, s * VW + VW) of a group go to acc[.][.][s % NV] */
    for (int j = 0; j < jn; j++)
        for (int r = 0; r < rn; r++)
            for (int h = 0; h < NV; h++) acc[j][r][h] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        for (int s = 0; s < GROUP / VW; s++) {
            vf xs[R];
            for (int r = 0; r < rn; r++) xs[r] = loadf(x + r * ldx + g * GROUP + s * VW);
            const int64_t si = scale_index(g, s, sg_shift);
            for (int j = 0; j < jn; j++) {
                const int64_t k = (o + j) * row_scales + si;
                const vf w = widen(bits, affine, q + (o + j) * row_bytes + g * gbytes, s, sc.scales[k],
                                   affine ? sc.offsets[k] : 0.0f);
                for (int r = 0; r < rn; r++) {
                    vf t = acc[j][r][s % NV] + w * xs[r];
                    KEEP(t);
                    acc[j][r][s % NV] = t;
                }
            }
        }
    }
    for (int j = 0; j < jn; j++)
        for (int r = 0; r < rn; r++) {
            float sum = 0.0f; /* the LANES lanes in order */
            for (int h = 0; h < NV; h++) sum = add_lanes(sum, acc[j][r][h]);
            y[r * ldy + o + j] = sum + (bias ? bias[o + j] : 0.0f);
        }
}

/* full tiles, then the leftover rows/outputs one at a time: constant sizes so tiles unroll */
/* every format as constants, so each tile compiles for its own: (bits, affine, scale group) */
#define TILE(BITS, AFF, SG, JN, RN) \
    tile(BITS, AFF, SG, JN, RN, x + r * ldx, ldx, q, sc, bias, y + r * out, out, in, o)
#define KIND(JN, RN)                                                  \
    do {                                                              \
        if (bits == 8 && !affine && sc.sg_shift == 5) TILE(8, 0, 5, JN, RN); \
        else if (bits == 8 && !affine) TILE(8, 0, 4, JN, RN);                \
        else if (bits == 8 && sc.sg_shift == 5) TILE(8, 1, 5, JN, RN);      \
        else if (bits == 8) TILE(8, 1, 4, JN, RN);                           \
        else if (!affine && sc.sg_shift == 5) TILE(4, 0, 5, JN, RN);         \
        else if (!affine) TILE(4, 0, 4, JN, RN);                             \
        else if (sc.sg_shift == 5) TILE(4, 1, 5, JN, RN);                    \
        else TILE(4, 1, 4, JN, RN);                                          \
    } while (0)
static void rows_range(const int bits, const float *x, int64_t ldx, const uint8_t *q, qscales sc, const float *bias,
                       float *y, int64_t m, int64_t in, int64_t out, int64_t o0, int64_t o1) {
    const int affine = sc.offsets != 0;
    const int64_t row_bytes = in / GROUP * (GROUP * bits / 8), row_scales = in >> sc.sg_shift;
    const int jt = m < R ? J1 : J;
    for (int64_t o = o0; o < o1;) {
        const int jn = o + jt <= o1 ? jt : 1;
        if (o + PREFETCH_ROWS + jt <= o1) { /* the weights PREFETCH_ROWS rows ahead, on their way from memory */
            const char *ahead = (const char *)(q + (o + PREFETCH_ROWS) * row_bytes);
            for (int64_t b = 0; b < jt * row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
            for (int k = 0; k < 1 + affine; k++) { /* the scales (and offsets) of those rows */
                const char *sahead = (const char *)((k ? sc.offsets : sc.scales) + (o + PREFETCH_ROWS) * row_scales);
                for (int64_t b = 0; b < jt * row_scales * 4; b += 64) __builtin_prefetch(sahead + b, 0, 0);
            }
        }
        int64_t r = 0;
        for (; r + R <= m; r += R) {
            if (jn == J) KIND(J, R);
            else KIND(1, R);
        }
        for (; r < m; r++) {
            if (jn == J) KIND(J, 1);
#if J1 != J
            else if (jn == J1) KIND(J1, 1);
#endif
            else KIND(1, 1);
        }
        o += jn;
    }
}
#undef KIND
#undef TILE

static int sg_shift_of(int sg) { return sg == 32 ? 5 : sg == 16 ? 4 : -1; }

/* y [m, out] = x [m, in] (rows ldx floats apart) . dequant(q, scales, offsets)^T (+ bias; may be
 * NULL). bits 8 or 4; offsets NULL (symmetric) or one per scale; sg (inputs a scale) 32 or 16; in a
 * multiple of GROUP. Returns 0, or -1 for a bad argument. */
int quant_gemm_f32(const float *x, int64_t ldx, const uint8_t *q, const float *scales, const float *offsets,
                   const float *bias, float *y, int64_t m, int64_t in, int64_t out, int bits, int sg, int nthreads) {
    const qscales sc = {scales, offsets, sg_shift_of(sg)};
    if ((bits != 8 && bits != 4) || in % GROUP || m < 1 || sc.sg_shift < 0) return -1;
    if (nthreads < 1) nthreads = 1;
    int64_t per = (out + nthreads - 1) / nthreads;
    per = (per + JT - 1) / JT * JT; /* ranges of whole tiles */
    const int parts = (int)((out + per - 1) / per);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int t = 0; t < parts; t++) {
        const int64_t o0 = t * per, o1 = o0 + per < out ? o0 + per : out;
        rows_range(bits, x, ldx, q, sc, bias, y, m, in, out, o0, o1);
    }
    return 0;
}

/* w [o1 - o0, in] = dequant(q, scales, offsets) rows [o0, o1) (arguments as quant_gemm_f32's).
 * Returns 0, or -1 for a bad argument. */
int quant_dequant_f32(const uint8_t *q, const float *scales, const float *offsets, float *w, int64_t in, int64_t o0,
                      int64_t o1, int bits, int sg, int nthreads) {
    const int shift = sg_shift_of(sg), affine = offsets != 0;
    if ((bits != 8 && bits != 4) || in % GROUP || o1 < o0 || shift < 0) return -1;
    const int64_t groups = in / GROUP, gbytes = GROUP * bits / 8, row_scales = in >> shift;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static) if (nthreads > 1)
    for (int64_t o = o0; o < o1; o++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *src = q + (o * groups + g) * gbytes;
            float *dst = w + (o - o0) * in + g * GROUP;
            for (int s = 0; s < GROUP / VW; s++) {
                const int64_t k = o * row_scales + scale_index(g, s, shift);
                const float d = scales[k], m = affine ? offsets[k] : 0.0f;
                vf v;
                if (bits == 8) v = affine ? widen(8, 1, src, s, d, m) : widen(8, 0, src, s, d, m);
                else v = affine ? widen(4, 1, src, s, d, m) : widen(4, 0, src, s, d, m);
                memcpy(dst + s * VW, &v, sizeof v);
            }
        }
    }
    return 0;
}
