/* A prompt's linear on a GGUF file's blocks (Q4_K, Q5_K, Q6_K, Q8_0) in bf16:
 *   y[m, out] = bf16(x)[m, in] . bf16(dequant(W))^T (+ bias)
 * where bf16() rounds to nearest even (values below fp32's normal range to zero) and dequant is
 * ggml's widening (block_formats.h). On a CPU with AVX-512 BF16, `vdpbf16ps` multiplies 32 bf16
 * pairs an instruction, where the K-quants' int8 path takes two (maddubs, then the scaled madd) for
 * 64 products (cpu_block_dot.c); measured on Zen 5, 2.2x the int8 kernel's products a core from 256
 * rows, so a prompt's many rows go this way once the weight is widened. The weight
 * is widened one panel at a time (64 output rows by one super-block of 256 inputs, 32 KB, kept in
 * L1) and the panel serves every row of x: the widening is paid once a call, not a row.
 *
 * Order: every (row, output) pair starts at 0 and adds, for each pair of inputs 2p, 2p + 1 in turn,
 * x[2p + 1] w[2p + 1] and then x[2p] w[2p], each product exact in fp32 and each sum rounded (the
 * instruction's order); the bias is added last. A row's result depends neither on the other rows
 * in the call, nor on the thread count, so a prompt's KV is the same however it is chunked. Builds
 * without AVX-512 BF16 compute the same sums in fp32 multiply-adds (the same bits for values in
 * fp32's normal range; the instruction flushes denormal products and sums to zero).
 * Threads (OpenMP) split the output rows in panels of 64.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_formats.h"
#include "thread_scratch.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NR 64      /* output rows a panel (4 vectors of 16 lanes) */
#define MR 6       /* rows of x a tile: 6 x 4 accumulators */
#define PAIRS 128  /* input pairs a panel: one super-block */

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
#if defined(__AVX512F__)
#define KEEP16(v) __asm__("" : "+v"(v)) /* a 16-float vector taken as computed */
#else
#define KEEP16(v) __asm__("" : "+m"(v))
#endif

/* fp32 -> bf16, round to nearest even, denormals to (signed) zero: as vcvtne2ps2bf16 */
static inline uint16_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if (!(b & 0x7F800000u)) return (uint16_t)((b >> 16) & 0x8000u);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* x's rows [r0, r1) in bf16: xb [m, in] */
static void round_rows(const float *x, int64_t ldx, int64_t in, int64_t r0, int64_t r1, uint16_t *xb) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * ldx;
        uint16_t *out = xb + r * in;
        int64_t i = 0;
#if defined(__AVX512BF16__)
        for (; i + 32 <= in; i += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i));
            _mm512_storeu_si512(out + i, (__m512i)v);
        }
#endif
        for (; i < in; i++) out[i] = to_bf16(xr[i]);
    }
}

#if defined(__AVX512BF16__)
/* 32 widened values (lo: the first 16) as 16 words of bf16 pairs */
static inline __m512i pairs_of(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

/* q (16 int32) * d - m, the product rounded first (as ggml: no fused multiply-add) */
static inline __m512 scaled16(__m512i q, float d, float m) {
    __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d));
    KEEP16(p);
    return _mm512_sub_ps(p, _mm512_set1_ps(m));
}

/* one super-block of a weight row (blk) -> its 128 words of bf16 pairs, as dequant_row widens it */
static void widen_words(int type, const uint8_t *blk, uint32_t *words) {
    if (type == Q4_K || type == Q5_K) {
        const uint8_t *qh = blk + 16, *qs = blk + (type == Q4_K ? 16 : 48);
        uint8_t sc[8], mn[8];
        scale_min_k4(blk + 4, sc, mn);
        const float d = f16(blk), dmin = f16(blk + 2);
        const __m256i hbits = type == Q5_K ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            float d1 = d * (float)sc[j], m1 = dmin * (float)mn[j];
            KEEP(d1);
            KEEP(m1);
            const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
            __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(15));
            if (type == Q5_K) { /* bit j of qh's byte l: bit 4 of value l */
                const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hbits, j), _mm256_set1_epi8(1));
                q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
            }
            const __m512 lo = scaled16(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)), d1, m1);
            const __m512 hi = scaled16(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)), d1, m1);
            _mm512_storeu_si512(words + 16 * j, pairs_of(lo, hi));
        }
    } else if (type == Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16(blk + 208);
        for (int n = 0; n < 2; n++)
            for (int k = 0; k < 4; k++) {
                const __m256i lb = _mm256_loadu_si256((const __m256i *)(ql + 64 * n + (k & 1) * 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
                const __m256i low = _mm256_and_si256(k < 2 ? lb : _mm256_srli_epi16(lb, 4), _mm256_set1_epi8(15));
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), _mm256_set1_epi8(3));
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
                const int e = 128 * n + 32 * k;
                float ds0 = d * (float)sc[e / 16], ds1 = d * (float)sc[e / 16 + 1];
                KEEP(ds0);
                KEEP(ds1);
                const __m512 lo = scaled16(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)), ds0, 0.0f);
                const __m512 hi = scaled16(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)), ds1, 0.0f);
                _mm512_storeu_si512(words + e / 2, pairs_of(lo, hi));
            }
    } else {
        for (int k = 0; k < 8; k++) {
            const uint8_t *b = blk + 34 * k;
            const float d = f16(b);
            const __m512 lo = scaled16(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))), d, 0.0f);
            const __m512 hi = scaled16(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))), d, 0.0f);
            _mm512_storeu_si512(words + 16 * k, pairs_of(lo, hi));
        }
    }
}

/* t[i] = 16 words of row i -> t[p] = word p of the 16 rows */
static inline __attribute__((always_inline)) void transpose16(__m512i t[16]) {
    __m512i u[16];
    for (int i = 0; i < 16; i += 2) { /* words of rows i, i + 1 interleaved */
        u[i] = _mm512_unpacklo_epi32(t[i], t[i + 1]);
        u[i + 1] = _mm512_unpackhi_epi32(t[i], t[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* of rows i .. i + 3 */
        t[i] = _mm512_unpacklo_epi64(u[i], u[i + 2]);
        t[i + 1] = _mm512_unpackhi_epi64(u[i], u[i + 2]);
        t[i + 2] = _mm512_unpacklo_epi64(u[i + 1], u[i + 3]);
        t[i + 3] = _mm512_unpackhi_epi64(u[i + 1], u[i + 3]);
    }
    for (int h = 0; h < 16; h += 8) /* 128-bit lanes of rows h .. h + 7 */
        for (int i = 0; i < 4; i++) {
            u[h + i] = _mm512_shuffle_i32x4(t[h + i], t[h + 4 + i], 0x88);
            u[h + 4 + i] = _mm512_shuffle_i32x4(t[h + i], t[h + 4 + i], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        t[i] = _mm512_shuffle_i32x4(u[i], u[8 + i], 0x88);
        t[8 + i] = _mm512_shuffle_i32x4(u[i], u[8 + i], 0xDD);
    }
}
#endif

/* panel [PAIRS][NR] words (bf16 inputs 2p | 2p + 1 << 16) of weight rows n0 .. n0 + rows (rows <= NR;
 * the rest zero), super-block kb; scratch: NR * QK floats */
static void widen_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int rows, int64_t kb,
                        float *scratch_f32, uint32_t *panel) {
    const int64_t sbb = sb_bytes(type);
#if defined(__AVX512BF16__)
    uint32_t *words = (uint32_t *)scratch_f32; /* [16][PAIRS] a group of rows */
    for (int g = 0; g < NR; g += 16) {
        for (int i = 0; i < 16; i++) {
            if (g + i < rows)
                widen_words(type, w + (n0 + g + i) * row_bytes + kb * sbb, words + i * PAIRS);
            else
                memset(words + i * PAIRS, 0, PAIRS * sizeof(uint32_t));
        }
        for (int c = 0; c < PAIRS; c += 16) {
            __m512i t[16];
            for (int i = 0; i < 16; i++) t[i] = _mm512_loadu_si512(words + i * PAIRS + c);
            transpose16(t);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(panel + (c + p) * NR + g, t[p]);
        }
    }
#else
    float *f32 = scratch_f32;
    for (int n = 0; n < rows; n++) dequant_row(type, w + (n0 + n) * row_bytes + kb * sbb, 1, f32 + n * QK);
    if (rows < NR) memset(f32 + rows * QK, 0, (size_t)(NR - rows) * QK * sizeof(float));
    for (int n = 0; n < NR; n++)
        for (int p = 0; p < PAIRS; p++)
            panel[p * NR + n] =
                (uint32_t)to_bf16(f32[n * QK + 2 * p]) | (uint32_t)to_bf16(f32[n * QK + 2 * p + 1]) << 16;
#endif
}

/* acc[r][j] (+)= rows r < rn of xb (at the panel's super-block, rows ldx elements apart) . the
 * panel's outputs 16j..16j+15, over its PAIRS pairs */
static inline __attribute__((always_inline)) void tile(const int rn, const uint16_t *xb, int64_t ldx,
                                                       const uint32_t *panel, v16f acc[MR][4]) {
    for (int p = 0; p < PAIRS; p++) {
        const uint32_t *bp = panel + p * NR;
#if defined(__AVX512BF16__)
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 16),
                       b2 = (__m512bh)_mm512_loadu_si512(bp + 32), b3 = (__m512bh)_mm512_loadu_si512(bp + 48);
        for (int r = 0; r < rn; r++) {
            int32_t word;
            memcpy(&word, xb + r * ldx + 2 * p, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(word);
            acc[r][0] = (v16f)_mm512_dpbf16_ps((__m512)acc[r][0], a, b0);
            acc[r][1] = (v16f)_mm512_dpbf16_ps((__m512)acc[r][1], a, b1);
            acc[r][2] = (v16f)_mm512_dpbf16_ps((__m512)acc[r][2], a, b2);
            acc[r][3] = (v16f)_mm512_dpbf16_ps((__m512)acc[r][3], a, b3);
        }
#else
        v16f odd[4], even[4];
        for (int j = 0; j < 4; j++) {
            v16u b;
            memcpy(&b, bp + 16 * j, sizeof b);
            const v16u hi = b & 0xFFFF0000u, lo = b << 16;
            memcpy(&odd[j], &hi, sizeof hi);
            memcpy(&even[j], &lo, sizeof lo);
        }
        for (int r = 0; r < rn; r++) {
            const uint32_t xo = (uint32_t)xb[r * ldx + 2 * p + 1] << 16, xe = (uint32_t)xb[r * ldx + 2 * p] << 16;
            float fo, fe;
            memcpy(&fo, &xo, 4);
            memcpy(&fe, &xe, 4);
            for (int j = 0; j < 4; j++) { /* each product exact: one rounding a sum, odd input first */
                v16f s = acc[r][j] + fo * odd[j];
                KEEP16(s);
                s = s + fe * even[j];
                KEEP16(s);
                acc[r][j] = s;
            }
        }
#endif
    }
}

/* A tile's rn rows (xb and y from its first) of the panel's outputs n0 .. n0 + cols: super-block
 * kb's share added (kb 0: from zero; the last: then the bias) */
static inline __attribute__((always_inline)) void tile_rows(const int rn, const uint16_t *xb, int64_t in,
                                                            const uint32_t *panel, int64_t kb, int64_t nsb,
                                                            const float *bias, float *y, int64_t ldy, int64_t n0,
                                                            int cols) {
    v16f acc[MR][4];
#if defined(__AVX512F__)
    __mmask16 mask[4];
    for (int j = 0; j < 4; j++) {
        const int c = cols - 16 * j < 0 ? 0 : cols - 16 * j > 16 ? 16 : cols - 16 * j;
        mask[j] = (__mmask16)((1u << c) - 1);
    }
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = kb == 0 ? (v16f){0} : (v16f)_mm512_maskz_loadu_ps(mask[j], y + r * ldy + n0 + 16 * j);
    tile(rn, xb + kb * QK, in, panel, acc);
    const int last = kb == nsb - 1 && bias;
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < 4; j++) {
            __m512 v = (__m512)acc[r][j];
            if (last) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[j], bias + n0 + 16 * j));
            _mm512_mask_storeu_ps(y + r * ldy + n0 + 16 * j, mask[j], v);
        }
#else
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < 4; j++) {
            float tmp[16] = {0};
            const int c0 = 16 * j, c = cols - c0 < 16 ? (cols - c0 > 0 ? cols - c0 : 0) : 16;
            if (kb) memcpy(tmp, y + r * ldy + n0 + c0, (size_t)c * sizeof(float));
            memcpy(&acc[r][j], tmp, sizeof tmp);
        }
    tile(rn, xb + kb * QK, in, panel, acc);
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < 4; j++) {
            const int c0 = 16 * j, c = cols - c0 < 16 ? (cols - c0 > 0 ? cols - c0 : 0) : 16;
            float tmp[16];
            memcpy(tmp, &acc[r][j], sizeof tmp);
            if (kb == nsb - 1 && bias)
                for (int i = 0; i < c; i++) tmp[i] += bias[n0 + c0 + i];
            memcpy(y + r * ldy + n0 + c0, tmp, (size_t)c * sizeof(float));
        }
#endif
}

/* 1: this build multiplies on the CPU's bf16 instructions; 0: in fp32 multiply-adds (the same bits) */
int block_bf16_native(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, out] (rows ldy floats apart) = bf16(x) [m, in] (rows ldx floats apart) . bf16(dequant(w))^T
 * (+ bias; may be NULL); w [out, in / 256 super-blocks' bytes] of `type`. Returns 0, -1 for a bad
 * argument, -2 when out of memory. */
int block_gemm_bf16(const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y, int64_t ldy,
                    int64_t m, int64_t in, int64_t out, int type, int nthreads) {
    if (!sb_bytes(type) || in % QK || m < 1 || out < 1 || ldy < out) return -1;
    const int64_t nsb = in / QK, row_bytes = nsb * sb_bytes(type), panels = (out + NR - 1) / NR;
    uint16_t *xb = aligned_alloc(64, ((size_t)(m * in) * 2 + 63) / 64 * 64);
    if (!xb) return -2;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > panels) nthreads = (int)panels;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) round_rows(x, ldx, in, r, r + 1, xb);
        float *f32 = scratch(NR * QK * sizeof(float) + PAIRS * NR * sizeof(uint32_t));
        if (!f32) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; pn++) {
            if (!f32) continue;
            uint32_t *panel = (uint32_t *)(f32 + NR * QK);
            const int64_t n0 = pn * NR;
            const int cols = out - n0 < NR ? (int)(out - n0) : NR;
            for (int64_t kb = 0; kb < nsb; kb++) {
                widen_panel(type, w, row_bytes, n0, cols, kb, f32, panel);
                for (int64_t r0 = 0; r0 < m; r0 += MR) {
                    const int rn = m - r0 < MR ? (int)(m - r0) : MR;
                    const uint16_t *xr = xb + r0 * in;
                    float *yr = y + r0 * ldy;
                    switch (rn) { /* one copy of the loop a tile height: accumulators in registers */
#define CASE(RN) \
    case RN: tile_rows(RN, xr, in, panel, kb, nsb, bias, yr, ldy, n0, cols); break;
                        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
                    }
                }
            }
        }
    }
    free(xb);
    return failed ? -2 : 0;
}
