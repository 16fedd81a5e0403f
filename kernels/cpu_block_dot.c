/* A linear whose weight is a GGUF file's blocks as the file stores them (Q4_K, Q5_K, Q6_K, Q8_0),
 * with int8 activations: y[m, out] = x[m, in] . dequant(W)^T. No copy of the weight is made: the
 * kernel reads the (memory-mapped) blocks, 4.5-8.5 bits a weight, as llama.cpp does, where the
 * group-wise format of cpu_quant_dot.c holds a K-quant in 1.3-1.5x its bytes (fp32 scales a group).
 *
 * x's rows are first quantized per 256 inputs (ggml's Q8_K: dx = max|x| / 127, xq = round(x / dx),
 * and the sum of xq per 16). A super-block's products are then integers, summed exactly (AVX2's
 * maddubs + madd; with AVX-512 BW the same on zmm, two sub-blocks an instruction, the K-quants'
 * halves then added; the scalar build the same integers):
 *   Q4_K, Q5_K: y += (d dx) sum_j sc_j (q_j . xq_j)  -  (dmin dx) sum_j mn_j (sum xq_j)   (8 sub-blocks of 32)
 *   Q6_K:       y += (d dx) sum_g sc_g (q_g . xq_g  -  32 sum xq_g)                     (16 groups of 16)
 *   Q8_0:       y += dx sum_b d_b (q_b . xq_b)                                           (8 blocks of 32)
 * so a super-block costs one or two fp32 multiply-adds where the group-wise kernel widens every
 * group of 32 to fp32.
 *
 * Order: every (output, row) pair sums its super-blocks in turn in 8 fp32 lanes (lane k: inputs
 * 4k..4k+3 of every 32, as AVX2's madd leaves them; each product rounded before it is added) and
 * then the lanes in order, on every build: a row's result depends neither on the other rows in the
 * call, nor on the thread count, nor on the instruction set (tests build the variants).
 * Threads (OpenMP) split output rows.
 *
 * Tiles: a weight row's super-block is decoded and unpacked once for a tile of x's rows (8; 16 for
 * the K-quants with AVX-512 BW, whose sums are then taken two rows to a zmm: the madd into int32
 * by VNNI's dpwssd where the CPU has it, two rows' lanes scaled and added side by side). Q8_0 on
 * AVX-512 BW takes two blocks an instruction (VNNI's dpbusd on |q| and x signed by q). Weight rows
 * come in blocks of 16 that meet a tile's rows 8 super-blocks at a time (more for fewer rows), so
 * the part of x a block reads stays in L1 at any row length (ffn_down's 8192 inputs too).
 *
 * `moe_int8x` runs a mixture's experts over a step in one call (x quantized once, the experts' three
 * products on these kernels, their outputs summed per token in expert order).
 *
 * `block_dequant_f32` widens rows to fp32 exactly as ggml (and the gguf package) dequantize them:
 * embedding lookups of a table kept as its blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_formats.h"
#include "thread_scratch.h"
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16 /* output rows ahead whose blocks are prefetched */
#endif

/* a weight row's bytes on their way from memory (a row the kernel reaches soon) */
static inline void prefetch_row(const uint8_t *row, int64_t nbytes) {
    for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch((const char *)row + b, 0, 0);
}


int64_t block_bytes_per_256(int type) { return sb_bytes(type); } /* kernels/block_gemm.py checks its table */

/* ---- x's rows quantized per 256 (Q8_K) ---- */

typedef struct {
    float d;
    int8_t q[QK];
    int16_t bsums[QK / 16]; /* sum of q per 16 */
} q8k;

static void quantize_row_q8k(const float *x, int64_t in, q8k *out) {
    for (int64_t b = 0; b < in / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f, c127 = 127.0f;
        KEEP(c127); /* true divisions, not a product by a rounded reciprocal (-ffast-math) */
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float id = amax > 0.0f ? c127 / amax : 0.0f;
        q8k *o = &out[b];
        o->d = amax / c127;
        for (int g = 0; g < QK / 16; g++) {
            int32_t s = 0;
            for (int i = 16 * g; i < 16 * g + 16; i++) {
                const int32_t q = (int32_t)nearbyintf(v[i] * id);
                o->q[i] = (int8_t)q;
                s += q;
            }
            o->bsums[g] = (int16_t)s;
        }
    }
}

/* ---- one super-block: integer sums in 8 int32 lanes ----
 * The AVX2 path's lanes, which the plain C path reproduces: a 32-input chunk's maddubs + madd puts
 * inputs 4k..4k+3 of the chunk into lane k. Each lane's integer is exact; it is widened to fp32 and
 * scaled once a super-block, into 8 fp32 lanes summed in order at the end of the row. */

typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64))); /* (AVX-512 paths) */
typedef int32_t v16i __attribute__((vector_size(64)));

/* a super-block's scales as the row loop needs them, decoded once for every row of x */
typedef struct {
    uint8_t sc[8], mn[8]; /* Q4_K / Q5_K: 6-bit scales and mins */
    float d, dmin;
} k4_scales;

static inline void k4_decode(const uint8_t *blk, k4_scales *s) {
    s->d = f16(blk);
    s->dmin = f16(blk + 2);
    scale_min_k4(blk + 4, s->sc, s->mn);
}

#if defined(__AVX2__)
static inline v8i to_v8i(__m256i v) { return (v8i)v; }

/* Q4_K / Q5_K's 256 values as 8 vectors of 32 bytes, sub-block j in q[j] (qh NULL for Q4_K):
 * unpacked once a super-block, for every row of x */
static inline void unpack_k4(const uint8_t *qs, const uint8_t *qh, __m256i q[8]) {
    const __m256i nib = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i hbits = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) { /* 64 inputs: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
        const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
        if (qh) { /* bit 2c of byte l is lo[l]'s fifth bit, bit 2c + 1 hi[l]'s */
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * c + 1), one), 4));
        }
        q[2 * c] = lo;
        q[2 * c + 1] = hi;
    }
}

/* acc[r] = lane k of sum_j sc_j (q_j . x row r's sub-block j) for the tile's rn rows of x (super-block
 * b of each): the sub-block outer and the rows inner, so q_j, its scale and the rows' integer sums
 * stay in registers and each row's inputs are read once (exact integers: the plain C path's
 * lanes_k4 / lanes_q6k give the same). */
static inline __attribute__((always_inline)) void tile_unpacked(const __m256i q[8], const __m256i sc16[8],
                                                                const q8k *x, int64_t nsb, int64_t b, const int rn,
                                                                __m256i acc[]) {
    for (int r = 0; r < rn; r++) acc[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i qj = q[j], sj = sc16[j];
        for (int r = 0; r < rn; r++) {
            const __m256i xj = _mm256_loadu_si256((const __m256i *)(x[r * nsb + b].q + 32 * j));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(qj, xj), sj));
        }
    }
}

/* Q4_K / Q5_K's scales broadcast as int16 vectors, one a sub-block */
static inline void k4_vectors(const k4_scales *s, __m256i out[8]) {
    uint64_t s8;
    memcpy(&s8, s->sc, 8);
    const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)s8)));
    for (int j = 0; j < 8; j++) /* int16 j of each 128-bit half, everywhere */
        out[j] = _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j)));
}

/* lane j = mn_j (bsum_2j + bsum_2j+1) */
static inline v8i lanes_mins(const uint8_t mn[8], const int16_t *bsums) {
    uint64_t m8;
    memcpy(&m8, mn, 8);
    const __m128i m = _mm_cvtsi64_si128((long long)m8);
    const __m256i dup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m)); /* mn0 mn0 mn1 mn1 ... */
    return to_v8i(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bsums), dup));
}

/* Q6_K's 256 stored values (0..63, before their -32) as 8 vectors: inputs 32c.. in u[c] */
static inline void unpack_q6k(const uint8_t *ql, const uint8_t *qh, __m256i u[8]) {
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++) { /* 128 inputs: ql[64], qh[32] */
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
        u[4 * n] = _mm256_or_si256(_mm256_and_si256(l0, nib), _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
        u[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, nib),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
        u[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4));
        u[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4));
    }
}

/* Q6_K: lane k of sum_g sc_g (u_g . xq_g) - 32 (lane j of sum sc bsum), from the first term's lanes */
static inline v8i lanes_q6k_from(__m256i unpacked, __m256i sc_all16, const int16_t *bsums) {
    const __m256i bias = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bsums), sc_all16);
    return to_v8i(_mm256_sub_epi32(unpacked, _mm256_slli_epi32(bias, 5)));
}

/* Q6_K's 16 int8 scales as int16 vectors: [sc_g x 8 | sc_g+1 x 8] for each chunk of 32, and all 16 */
static inline void q6k_vectors(const int8_t *sc, __m256i out[8], __m256i *all16) {
    const __m128i s = _mm_loadu_si128((const __m128i *)sc);
    for (int c = 0; c < 8; c++) {
        const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (2 * c + 1), 0x0101010101010101LL * (2 * c));
        out[c] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s, pick));
    }
    *all16 = _mm256_cvtepi8_epi16(s);
}

#if defined(__AVX512BW__)
/* The same integer sums two sub-blocks (64 inputs) an instruction, in zmm: inputs 64c.. in v[c],
 * lower half the first 32, upper half the next. A zmm lane k (k < 8) sums what ymm lane k would for
 * the even sub-blocks, lane 8 + k for the odd ones; their sum (exact integers) is the ymm lanes. */
static inline __m512i zmm_of(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* Q4_K / Q5_K: q[c] = [sub-block 2c | sub-block 2c + 1], as unpack_k4's q[2c], q[2c + 1] */
static inline void unpack_k4_zmm(const uint8_t *qs, const uint8_t *qh, __m512i q[4]) {
    const __m512i nib = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    __m512i hbits = _mm512_setzero_si512();
    if (qh) { /* [qh | qh >> 1]: the fifth bits of sub-blocks 2c and 2c + 1 at bit 2c of each half */
        const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        hbits = zmm_of(h, _mm256_srli_epi16(h, 1));
    }
    for (int c = 0; c < 4; c++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m512i v = _mm512_and_si512(zmm_of(b, _mm256_srli_epi16(b, 4)), nib);
        if (qh) v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hbits, 2 * c), one), 4));
        q[c] = v;
    }
}

/* Q6_K: u[j] = inputs 64j.. (unpack_q6k's u[2j], u[2j + 1]) */
static inline void unpack_q6k_zmm(const uint8_t *ql, const uint8_t *qh, __m512i u[4]) {
    const __m512i nib = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    for (int n = 0; n < 2; n++) { /* 128 inputs: ql[64] = [l0 | l1], qh[32] */
        const __m512i l = _mm512_loadu_si512((const void *)(ql + 64 * n));
        const __m256i h8 = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
        const __m512i h = zmm_of(h8, _mm256_srli_epi16(h8, 2)); /* l1's high bits sit 2 above l0's */
        u[2 * n] = _mm512_or_si512(_mm512_and_si512(l, nib), _mm512_slli_epi16(_mm512_and_si512(h, three), 4));
        u[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), nib),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4), three), 4));
    }
}

/* a + the int16 pairs of p times the scales s, summed in pairs into int32 (exact integers; one VNNI
 * instruction where the CPU has it) */
static inline __m512i madd_scaled(__m512i a, __m512i p, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(a, p, s);
#else
    return _mm512_add_epi32(a, _mm512_madd_epi16(p, s));
#endif
}

/* Two rows' 16 lanes folded to the ymm lanes, side by side: lanes 0-7 a's (lane k + lane 8 + k),
 * 8-15 b's */
static inline __m512i fold_pair(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
}

/* tile_unpacked on zmm for rn <= 8 rows: q[c] and sc16[c] cover inputs 64c..; acc[i] holds rows
 * 2i and 2i + 1's ymm lanes side by side (an odd last row beside itself) */
static inline __attribute__((always_inline)) void tile_unpacked_zmm(const __m512i q[4], const __m512i sc16[4],
                                                                    const q8k *x, int64_t nsb, int64_t b,
                                                                    const int rn, __m512i acc[]) {
    __m512i a[8];
    for (int r = 0; r < rn; r++) a[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i qc = q[c], sc = sc16[c];
        for (int r = 0; r < rn; r++) {
            const __m512i xc = _mm512_loadu_si512((const void *)(x[r * nsb + b].q + 64 * c));
            a[r] = madd_scaled(a[r], _mm512_maddubs_epi16(qc, xc), sc);
        }
    }
    for (int r = 0; r < rn; r += 2) acc[r / 2] = fold_pair(a[r], a[r + 1 < rn ? r + 1 : r]);
}

/* int16 lane i of out[c] = v16[idx(c, i)], v16 the int16s of a zmm's low 128 bits: one vpermw each */
#define SCALE_PICKS(IDX)                                                                                \
    for (int c = 0; c < 4; c++) {                                                                       \
        short ix[32];                                                                                   \
        for (int i = 0; i < 32; i++) ix[i] = (short)(IDX);                                              \
        out[c] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)ix), v16);                    \
    }

/* Q4_K / Q5_K's scales for tile_unpacked_zmm: sub-block 2c's in lanes 0-15, 2c + 1's in 16-31 */
static inline void k4_vectors_zmm(const k4_scales *s, __m512i out[4]) {
    uint64_t s8;
    memcpy(&s8, s->sc, 8);
    const __m512i v16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)s8)));
    SCALE_PICKS(2 * c + i / 16)
}

/* Q6_K's 16 scales for tile_unpacked_zmm: group g's (16 inputs) in the 8 lanes of its 4 madd sums */
static inline void q6k_vectors_zmm(const int8_t *sc, __m512i out[4], __m256i *all16) {
    *all16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    const __m512i v16 = _mm512_castsi256_si512(*all16);
    SCALE_PICKS(4 * c + i / 8)
}
#undef SCALE_PICKS
#endif

/* Q8_0: lane k of q . xq over one block of 32 */
static inline v8i lanes_q8_0(const int8_t *q, const int8_t *xq) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)q), x = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); /* |q| . x sign(q) */
    return to_v8i(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#else
static inline v8i lanes_k4(const uint8_t *qs, const uint8_t *qh, const k4_scales *s, const int8_t *xq) {
    v8i acc = {0};
    for (int c = 0; c < 4; c++)
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 8; k++) {
                int32_t t = 0; /* maddubs + madd: inputs 4k..4k+3 of the chunk, then the scale */
                for (int l = 4 * k; l < 4 * k + 4; l++) {
                    int q = h ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
                    if (qh) q |= ((qh[l] >> (2 * c + h)) & 1) << 4;
                    t += q * xq[64 * c + 32 * h + l];
                }
                acc[k] += s->sc[2 * c + h] * t;
            }
    return acc;
}

static inline v8i lanes_mins(const uint8_t mn[8], const int16_t *bsums) {
    v8i out;
    for (int j = 0; j < 8; j++) out[j] = mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return out;
}

static inline v8i lanes_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *xq,
                            const int16_t *bsums) {
    v8i acc = {0};
    for (int n = 0; n < 2; n++)
        for (int k = 0; k < 4; k++)
            for (int lane = 0; lane < 8; lane++) {
                int32_t t = 0;
                for (int l = 4 * lane; l < 4 * lane + 4; l++) {
                    const uint8_t lb = ql[64 * n + l + (k & 1) * 32];
                    const int u = ((k < 2 ? lb : lb >> 4) & 15) | (((qh[32 * n + l] >> (2 * k)) & 3) << 4);
                    t += u * xq[128 * n + 32 * k + l];
                }
                acc[lane] += sc[8 * n + 2 * k + lane / 4] * t;
            }
    for (int j = 0; j < 8; j++) acc[j] -= 32 * (bsums[2 * j] * sc[2 * j] + bsums[2 * j + 1] * sc[2 * j + 1]);
    return acc;
}

static inline v8i lanes_q8_0(const int8_t *q, const int8_t *xq) {
    v8i out;
    for (int k = 0; k < 8; k++) {
        int32_t t = 0;
        for (int l = 4 * k; l < 4 * k + 4; l++) t += q[l] * xq[l];
        out[k] = t;
    }
    return out;
}
#endif

#if defined(__AVX512BW__)
/* A Q8_0 super-block (8 blocks of 32, blk) against the tile's rn rows of x, two blocks an
 * instruction: |q| times x with q's sign (a masked negation: AVX-512 has no vpsignb), summed four
 * products a lane (VNNI's dpbusd, else maddubs + madd: |q| <= 128, |x| <= 127, no pair saturates),
 * so lanes 0-7 are block 2c's lanes_q8_0 and 8-15 block 2c + 1's; each block's lanes scaled by its
 * d dx and added to the row's 8 lanes in block order, as the ymm path does. */
static inline __attribute__((always_inline)) void q8_0_superblock_zmm(const uint8_t *blk, const q8k *x, int64_t nsb,
                                                                      int64_t b, const int rn, v8f acc[]) {
    __m512i aq[4];
    __mmask64 neg[4];
    __m512 d2[4]; /* [d_2c x 8 | d_2c+1 x 8] */
    for (int c = 0; c < 4; c++) {
        const uint8_t *b0 = blk + 68 * c, *b1 = b0 + 34;
        const __m512i q = zmm_of(_mm256_loadu_si256((const __m256i *)(b0 + 2)), _mm256_loadu_si256((const __m256i *)(b1 + 2)));
        aq[c] = _mm512_abs_epi8(q);
        neg[c] = _mm512_movepi8_mask(q);
        d2[c] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(f16(b0))),
                                                    _mm256_castps_pd(_mm256_set1_ps(f16(b1))), 1));
    }
    for (int r = 0; r < rn; r++) {
        const q8k *xb = &x[r * nsb + b];
        const __m512 dx = _mm512_set1_ps(xb->d);
        v8f a = acc[r];
        for (int c = 0; c < 4; c++) {
            const __m512i xc = _mm512_loadu_si512((const void *)(xb->q + 64 * c));
            const __m512i xs = _mm512_mask_sub_epi8(xc, neg[c], _mm512_setzero_si512(), xc); /* x sign(q) */
#if defined(__AVX512VNNI__)
            const __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aq[c], xs);
#else
            const __m512i lanes = _mm512_madd_epi16(_mm512_maddubs_epi16(aq[c], xs), _mm512_set1_epi16(1));
#endif
            v16f dd = (v16f)_mm512_mul_ps(d2[c], dx); /* d_k dx, rounded as the scalar product */
            KEEPV(dd);
            v16f pr = __builtin_convertvector((v16i)lanes, v16f) * dd;
            KEEPV(pr);
            a = a + (v8f)_mm512_castps512_ps256((__m512)pr);
            KEEPV(a);
            a = a + (v8f)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)pr), 1));
            KEEPV(a);
        }
        acc[r] = a;
    }
}
#endif

/* lanes's widened integers times f, added to acc: the product rounded first (no FMA on any build) */
static inline __attribute__((always_inline)) v8f add_scaled(v8f acc, v8i lanes, float f) {
    v8f p = __builtin_convertvector(lanes, v8f) * f;
    KEEPV(p);
    v8f t = acc + p;
    KEEPV(t);
    return t;
}

static inline float lanes_sum(v8f acc) {
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) {
        sum += acc[i];
        KEEP(sum);
    }
    return sum;
}

#if defined(__AVX512BW__)
#define ROWS 16 /* rows of x a weight row's super-block is decoded once for (the K-quants; Q8_0: 8) */
#else
#define ROWS 8
#endif
#define OUT_BLOCK 16 /* weight rows a tile of x's rows meets before the next tile */

/* out[r] = weight row w . quantized x rows x[r * nsb ...] in 8 lanes, r < rn (a constant: the
 * accumulators stay in registers) */
static inline __attribute__((always_inline)) void row_tile(const int type, const uint8_t *w, const q8k *x,
                                                           int64_t nsb, const int rn, v8f out[ROWS]) {
    v8f acc[ROWS];
    for (int r = 0; r < rn; r++) acc[r] = (v8f){0};
    for (int64_t b = 0; b < nsb; b++) {
        if (type == Q4_K || type == Q5_K) {
            const uint8_t *blk = w + b * (type == Q4_K ? 144 : 176);
            const uint8_t *qs = blk + (type == Q4_K ? 16 : 48);
            k4_scales s;
            k4_decode(blk, &s);
#if defined(__AVX2__)
            __m256i sv[8], q[8], sums[ROWS];
            k4_vectors(&s, sv);
            unpack_k4(qs, type == Q4_K ? NULL : blk + 16, q);
            tile_unpacked(q, sv, x, nsb, b, rn, sums);
#endif
            for (int r = 0; r < rn; r++) {
                const q8k *xb = &x[r * nsb + b];
                float da = s.d * xb->d, dm = -(s.dmin * xb->d);
                KEEP(da);
                KEEP(dm);
#if defined(__AVX2__)
                const v8i lanes = to_v8i(sums[r]);
#else
                const v8i lanes = lanes_k4(qs, type == Q4_K ? NULL : blk + 16, &s, xb->q);
#endif
                acc[r] = add_scaled(acc[r], lanes, da);
                acc[r] = add_scaled(acc[r], lanes_mins(s.mn, xb->bsums), dm);
            }
        } else if (type == Q6_K) {
            const uint8_t *blk = w + b * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = f16(blk + 208);
#if defined(__AVX2__)
            __m256i sv[8], all16, u[8], sums[ROWS];
            q6k_vectors(sc, sv, &all16);
            unpack_q6k(blk, blk + 128, u);
            tile_unpacked(u, sv, x, nsb, b, rn, sums);
#endif
            for (int r = 0; r < rn; r++) {
                const q8k *xb = &x[r * nsb + b];
                float da = d * xb->d;
                KEEP(da);
#if defined(__AVX2__)
                acc[r] = add_scaled(acc[r], lanes_q6k_from(sums[r], all16, xb->bsums), da);
#else
                acc[r] = add_scaled(acc[r], lanes_q6k(blk, blk + 128, sc, xb->q, xb->bsums), da);
#endif
            }
        } else { /* Q8_0: 8 blocks of 32, each its own scale */
            const uint8_t *blk = w + b * 8 * 34;
#if defined(__AVX512BW__)
            q8_0_superblock_zmm(blk, x, nsb, b, rn, acc);
            continue;
#endif
            for (int k = 0; k < 8; k++) {
                const float d = f16(blk + 34 * k);
                for (int r = 0; r < rn; r++) {
                    const q8k *xb = &x[r * nsb + b];
                    float dd = d * xb->d;
                    KEEP(dd);
                    acc[r] = add_scaled(acc[r], lanes_q8_0((const int8_t *)(blk + 34 * k + 2), xb->q + 32 * k), dd);
                }
            }
        }
    }
    for (int r = 0; r < rn; r++) out[r] = acc[r];
}

#if defined(__AVX512BW__)

/* add_scaled for two rows side by side (lanes 0-7 one row's, 8-15 the other's, each half its own
 * factor): per lane the same operations, so the same bits */
static inline __attribute__((always_inline)) v16f add_scaled2(v16f acc, __m512i lanes, float f0, float f1) {
    const v16f f = (v16f)_mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(f0)), _mm256_castps_pd(_mm256_set1_ps(f1)), 1));
    v16f p = __builtin_convertvector((v16i)lanes, v16f) * f;
    KEEPV(p);
    v16f t = acc + p;
    KEEPV(t);
    return t;
}

/* two rows' int16 bsums [16] side by side */
static inline __m512i bsums2(const q8k *x0, const q8k *x1) {
    return zmm_of(_mm256_loadu_si256((const __m256i *)x0->bsums), _mm256_loadu_si256((const __m256i *)x1->bsums));
}

/* row_tile for the K-quants on zmm, rn <= 16 rows, super-blocks [b0, b1) added to acc: a super-block
 * is decoded and unpacked once for all the rows, its integer sums taken 8 rows at a time, and two
 * rows' lanes scaled and added in one zmm (rows 2i and 2i + 1 in acc[i]; an odd last row beside
 * itself). Bits as row_tile's. */
static inline __attribute__((always_inline)) void row_tile_zmm(const int type, const uint8_t *w, const q8k *x,
                                                               int64_t nsb, int64_t b0, int64_t b1, const int rn,
                                                               v16f acc_io[ROWS / 2]) {
    v16f acc[ROWS / 2]; /* in registers: the blocks (char) may alias acc_io as far as the compiler knows */
    for (int i = 0; i < (rn + 1) / 2; i++) acc[i] = acc_io[i];
    v8f acc1 = (v8f)_mm512_castsi512_si256((__m512i)acc[0]); /* (rn == 1) */
    for (int64_t b = b0; b < b1; b++) {
        __m512i q[4], sz[4], sums[4];
        if (type == Q4_K || type == Q5_K) {
            const uint8_t *blk = w + b * (type == Q4_K ? 144 : 176);
            k4_scales s;
            k4_decode(blk, &s);
            k4_vectors_zmm(&s, sz);
            unpack_k4_zmm(blk + (type == Q4_K ? 16 : 48), type == Q4_K ? NULL : blk + 16, q);
            uint64_t m8;
            memcpy(&m8, s.mn, 8);
            const __m128i m = _mm_cvtsi64_si128((long long)m8); /* mn0 mn0 mn1 mn1 ...: lane j of a row's madd */
            const __m512i dup = _mm512_broadcast_i64x4(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m)));
            for (int h = 0; h < rn; h += 8) { /* 8 rows' integer sums at a time */
                const int hn = rn - h < 8 ? rn - h : 8;
                tile_unpacked_zmm(q, sz, x + h * nsb, nsb, b, hn, sums);
                if (rn == 1) { /* one row: row_tile's 8-lane steps, fewer instructions */
                    const q8k *x0 = &x[b];
                    float da = s.d * x0->d, dm = -(s.dmin * x0->d);
                    KEEP(da);
                    KEEP(dm);
                    const v8i mins = to_v8i(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x0->bsums),
                                                              _mm512_castsi512_si256(dup)));
                    acc1 = add_scaled(add_scaled(acc1, to_v8i(_mm512_castsi512_si256(sums[0])), da), mins, dm);
                    continue;
                }
                for (int i = 0; i < (hn + 1) / 2; i++) {
                    const int r0 = h + 2 * i, r1 = r0 + 1 < rn ? r0 + 1 : r0;
                    const q8k *x0 = &x[r0 * nsb + b], *x1 = &x[r1 * nsb + b];
                    float da0 = s.d * x0->d, da1 = s.d * x1->d, dm0 = -(s.dmin * x0->d), dm1 = -(s.dmin * x1->d);
                    KEEP(da0);
                    KEEP(da1);
                    KEEP(dm0);
                    KEEP(dm1);
                    v16f a = add_scaled2(acc[r0 / 2], sums[i], da0, da1);
                    acc[r0 / 2] = add_scaled2(a, _mm512_madd_epi16(bsums2(x0, x1), dup), dm0, dm1);
                }
            }
        } else { /* Q6_K */
            const uint8_t *blk = w + b * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = f16(blk + 208);
            __m256i all16;
            q6k_vectors_zmm(sc, sz, &all16);
            unpack_q6k_zmm(blk, blk + 128, q);
            const __m512i sc2 = _mm512_broadcast_i64x4(all16);
            for (int h = 0; h < rn; h += 8) {
                const int hn = rn - h < 8 ? rn - h : 8;
                tile_unpacked_zmm(q, sz, x + h * nsb, nsb, b, hn, sums);
                if (rn == 1) {
                    float da = d * x[b].d;
                    KEEP(da);
                    acc1 = add_scaled(acc1, lanes_q6k_from(_mm512_castsi512_si256(sums[0]), all16, x[b].bsums), da);
                    continue;
                }
                for (int i = 0; i < (hn + 1) / 2; i++) {
                    const int r0 = h + 2 * i, r1 = r0 + 1 < rn ? r0 + 1 : r0;
                    const q8k *x0 = &x[r0 * nsb + b], *x1 = &x[r1 * nsb + b];
                    float da0 = d * x0->d, da1 = d * x1->d;
                    KEEP(da0);
                    KEEP(da1);
                    const __m512i bias = _mm512_madd_epi16(bsums2(x0, x1), sc2);
                    acc[r0 / 2] = add_scaled2(acc[r0 / 2], _mm512_sub_epi32(sums[i], _mm512_slli_epi32(bias, 5)), da0, da1);
                }
            }
        }
    }
    if (rn == 1) acc[0] = (v16f)_mm512_castsi256_si512((__m256i)acc1);
    for (int i = 0; i < (rn + 1) / 2; i++) acc_io[i] = acc[i];
}

/* row r's 8 lanes of a row_tile_zmm accumulator */
static inline v8f row_lanes(const v16f acc[], int r) {
    const __m512i v = (__m512i)acc[r / 2];
    return (v8f)(r % 2 ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v));
}

#define K_CHUNK 8 /* super-blocks of x's tile a weight block meets at a time: 16 rows' 37 KB, in L1 */

/* gemm_rows' tile of rn rows (xr) over weight rows [ob, oe) on zmm (K-quants), super-blocks in
 * chunks so that the tile's part stays in L1 at any row length; each (weight row, row) pair still
 * adds its super-blocks in order */
static __attribute__((noinline)) void tile_block_zmm(const int type, const uint8_t *w, int64_t row_bytes,
                                                     const q8k *xr, int64_t nsb, const int rn, int64_t ob, int64_t oe,
                                                     int64_t prefetch_below, const float *bias, float *y, int64_t ldy) {
    v16f acc[OUT_BLOCK][ROWS / 2];
    for (int64_t o = ob; o < oe; o++)
        for (int i = 0; i < (rn + 1) / 2; i++) acc[o - ob][i] = (v16f){0};
    const int64_t chunk = K_CHUNK * (ROWS / rn); /* the tile's part of x about the same bytes at any rn */
    for (int64_t b0 = 0; b0 < nsb; b0 += chunk) {
        const int64_t b1 = b0 + chunk < nsb ? b0 + chunk : nsb;
        for (int64_t o = ob; o < oe; o++) {
            if (b0 == 0 && o + PREFETCH_ROWS < prefetch_below) /* (gemm_rows: the first tile only) */
                prefetch_row(w + (o + PREFETCH_ROWS) * row_bytes, row_bytes);
            const uint8_t *wr = w + o * row_bytes;
            v16f *a = acc[o - ob];
            switch (type * 32 + rn) { /* one copy of the loop a type and tile: accumulators in registers */
#define CASE(T, RN) \
    case T * 32 + RN: row_tile_zmm(T, wr, xr, nsb, b0, b1, RN, a); break;
#define CASES(T) CASE(T, 1) CASE(T, 2) CASE(T, 4) CASE(T, 8) CASE(T, 16)
                CASES(Q4_K)
                CASES(Q5_K)
                CASES(Q6_K)
#undef CASES
#undef CASE
            }
        }
    }
    for (int64_t o = ob; o < oe; o++)
        for (int r = 0; r < rn; r++) {
            float v = lanes_sum(row_lanes(acc[o - ob], r));
            if (bias) v += bias[o];
            y[r * ldy + o] = v;
        }
}
#endif


/* Output rows [o0, o1) of y [m, ldy] = xq [m rows of nsb super-blocks] . dequant(w)^T (+ bias). */
static void gemm_rows(const q8k *xq, int64_t m, int64_t nsb, const uint8_t *w, int type, const float *bias, float *y,
                      int64_t ldy, int64_t o0, int64_t o1) {
    const int64_t row_bytes = nsb * sb_bytes(type);
    for (int64_t ob = o0; ob < o1; ob += OUT_BLOCK) { /* a block of weight rows, kept in cache over all of x */
        const int64_t oe = ob + OUT_BLOCK < o1 ? ob + OUT_BLOCK : o1;
        for (int64_t r0 = 0; r0 < m;) { /* a tile of x's rows, kept in L1 over the block */
            const int most = type == Q8_0 ? 8 : ROWS;
            const int rn = m - r0 >= most ? most : m - r0 >= 8 ? 8 : m - r0 >= 4 ? 4 : m - r0 >= 2 ? 2 : 1;
            const q8k *xr = xq + r0 * nsb;
#if defined(__AVX512BW__)
            if (type != Q8_0) { /* the K-quants, any rn */
                tile_block_zmm(type, w, row_bytes, xr, nsb, rn, ob, oe, r0 == 0 ? o1 : 0, bias, y + r0 * ldy, ldy);
                r0 += rn;
                continue;
            }
#endif
            for (int64_t o = ob; o < oe; o++) {
                if (r0 == 0 && o + PREFETCH_ROWS < o1) /* the weights on their way from memory */
                    prefetch_row(w + (o + PREFETCH_ROWS) * row_bytes, row_bytes);
                v8f acc[ROWS];
                const uint8_t *wr = w + o * row_bytes;
                switch (type * 32 + rn) { /* one copy of the loop a type and tile: accumulators in registers */
#define CASE(T, RN) \
    case T * 32 + RN: row_tile(T, wr, xr, nsb, RN, acc); break;
#define CASES(T) CASE(T, 1) CASE(T, 2) CASE(T, 4) CASE(T, 8)
#if !defined(__AVX512BW__)
                CASES(Q4_K)
                CASES(Q5_K)
                CASES(Q6_K)
#endif
                CASES(Q8_0)
#undef CASES
#undef CASE
                }
                for (int r = 0; r < rn; r++) {
                    float v = lanes_sum(acc[r]);
                    if (bias) v += bias[o];
                    y[(r0 + r) * ldy + o] = v;
                }
            }
            r0 += rn;
        }
    }
}

/* The share [o0, o1) of `out` rows that part t of `parts` takes. */
static inline void share(int64_t out, int parts, int t, int64_t *o0, int64_t *o1) {
    const int64_t per = (out + parts - 1) / parts;
    *o0 = t * per < out ? t * per : out;
    *o1 = *o0 + per < out ? *o0 + per : out;
}

static inline int parts_for(int64_t out, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    const int64_t per = (out + nthreads - 1) / nthreads;
    return (int)((out + per - 1) / per);
}

/* y [m, out] = x [m, in] (rows ldx floats apart) . dequant(w)^T (+ bias; may be NULL); w [out, in
 * / 256 super-blocks' bytes] of `type`. Returns 0, -1 for a bad argument, -2 when out of memory. */
int block_gemm_int8x(const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y, int64_t m,
                     int64_t in, int64_t out, int type, int nthreads) {
    if (!sb_bytes(type) || in % QK || m < 1 || out < 1) return -1;
    const int64_t nsb = in / QK;
    q8k *xq = scratch((size_t)(m * nsb) * sizeof(q8k));
    if (!xq) return -2;
    const int parts = parts_for(out, nthreads);
    /* a prompt's rows are quantized by the same team (each row alone: the same bytes); a few rows
     * by the caller first (a barrier inside the region would cost more than they do) */
    const int shared_quantize = parts > 1 && m * in >= (1 << 15);
    if (!shared_quantize)
        for (int64_t r = 0; r < m; r++) quantize_row_q8k(x + r * ldx, in, xq + r * nsb);
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
        const int t = THREAD_NUM();
        if (shared_quantize) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) quantize_row_q8k(x + r * ldx, in, xq + r * nsb);
        }
        int64_t o0, o1;
        share(out, parts, t, &o0, &o1);
        gemm_rows(xq, m, nsb, w, type, bias, y, out, o0, o1);
    }
    return 0;
}

/* One expert's rows of a mixture (rows [0, n) of its gathered tokens): y [n, hidden] =
 * down(silu(gate xe) * up xe), output rows [o0, o1) of each product when `split` (the threads share
 * one expert), all of them otherwise. xe [n, nsb_h] is x's quantized rows; gu [n, 2 inter] and
 * aq [n, nsb_i] scratch. The silu and quantization of the intermediate run on the caller. */
typedef struct {
    int64_t hidden, inter, nsb_h, nsb_i;
    const uint8_t *const *gate, *const *up, *const *down;
    int gate_type, up_type, down_type;
} moe_shape;

static void expert_gate_up(const moe_shape *m, int64_t e, const q8k *xe, int64_t n, float *gu, int64_t o0, int64_t o1) {
    const int64_t inter = m->inter; /* [o0, o1) of gate's rows then up's, side by side in gu */
    if (o0 < inter) gemm_rows(xe, n, m->nsb_h, m->gate[e], m->gate_type, NULL, gu, 2 * inter, o0, o1 < inter ? o1 : inter);
    if (o1 > inter) gemm_rows(xe, n, m->nsb_h, m->up[e], m->up_type, NULL, gu + inter, 2 * inter, o0 > inter ? o0 - inter : 0, o1 - inter);
}

static void expert_activations(const moe_shape *m, float *gu, int64_t n, q8k *aq) {
    for (int64_t j = 0; j < n; j++) { /* silu(gate) * up (as cpu_layer_ops.c's), quantized per 256 */
        float *g = gu + j * 2 * m->inter;
        const float *u = g + m->inter;
        for (int64_t i = 0; i < m->inter; i++) {
            const float ex = expf(-fabsf(g[i]));
            g[i] = (g[i] >= 0.f ? g[i] : g[i] * ex) / (1.0f + ex) * u[i];
        }
        quantize_row_q8k(g, m->inter, aq + j * m->nsb_i);
    }
}

/* A mixture of experts over one step (engine/models/moe.py), in one call:
 *   out [T, hidden] = sum over each token's experts, in ascending expert order, of
 *                     weight * down_e(silu(gate_e x) * up_e x)
 * The (token, expert) pairs come grouped by expert: expert e's are tokens[starts[e] .. starts[e+1])
 * with their routing weights beside them. An expert whose blocks are NULL (another rank holds it)
 * is skipped. x's rows are quantized once (not once a linear), each expert's intermediate rows
 * once. Threads take whole experts when at least two a thread are hit (a decode step's 8 of 128:
 * one parallel region a call, each thread streaming its experts' blocks), else share each
 * product's output rows. Every pair's output is kept, then each token's sum is added in expert
 * order (threads split the hidden columns), so a token's result depends on neither the other
 * tokens of the step nor the thread count. gate/up [E] blocks [inter, hidden/256], down [E] blocks
 * [hidden, inter/256]. */
int moe_int8x(const float *x, int64_t T, int64_t hidden, int64_t inter, int64_t n_experts, const int64_t *starts,
              const int64_t *tokens, const float *weights, const uint8_t *const *gate, const uint8_t *const *up,
              const uint8_t *const *down, int gate_type, int up_type, int down_type, float *out, int nthreads) {
    if (!sb_bytes(gate_type) || !sb_bytes(up_type) || !sb_bytes(down_type) || hidden % QK || inter % QK || T < 1)
        return -1;
    if (nthreads < 1) nthreads = 1;
    const moe_shape m = {hidden, inter, hidden / QK, inter / QK, gate, up, down, gate_type, up_type, down_type};
    int64_t most = 0, hit = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        const int64_t n = starts[e + 1] - starts[e];
        if (n > 0 && gate[e] && up[e] && down[e]) hit++, most = n > most ? n : most;
    }
    const int by_expert = nthreads > 1 && hit >= 2 * nthreads;
    const int lanes = by_expert ? nthreads : 1; /* private scratch: one a thread, or one shared */
    const int64_t pairs = starts[n_experts];
    /* one scratch block: x quantized [T], every pair's output [pairs], and per lane an expert's rows
     * of x, their gate | up and the activations quantized */
    const size_t xq_b = (size_t)(T * m.nsb_h) * sizeof(q8k), y_b = (size_t)(pairs * hidden) * sizeof(float);
    const size_t xe_b = (size_t)(most * m.nsb_h) * sizeof(q8k), gu_b = (size_t)(most * 2 * inter) * sizeof(float);
    const size_t aq_b = (size_t)(most * m.nsb_i) * sizeof(q8k);
    const size_t lane_b = (xe_b + 63) / 64 * 64 + (gu_b + 63) / 64 * 64 + (aq_b + 63) / 64 * 64;
    char *mem = scratch((xq_b + 63) / 64 * 64 + (y_b + 63) / 64 * 64 + lanes * lane_b + 64);
    if (!mem) return -2;
    q8k *xq = (q8k *)mem;
    float *ys = (float *)(mem + (xq_b + 63) / 64 * 64);
    char *lane_mem = (char *)ys + (y_b + 63) / 64 * 64;
    for (int64_t r = 0; r < T; r++) quantize_row_q8k(x + r * hidden, hidden, xq + r * m.nsb_h);
    if (by_expert) {
#pragma omp parallel num_threads(nthreads)
        {
            char *mine = lane_mem + THREAD_NUM() * lane_b;
            q8k *xe = (q8k *)mine;
            float *gu = (float *)(mine + (xe_b + 63) / 64 * 64);
            q8k *aq = (q8k *)((char *)gu + (gu_b + 63) / 64 * 64);
#pragma omp for schedule(dynamic, 1)
            for (int64_t e = 0; e < n_experts; e++) {
                const int64_t s0 = starts[e], n = starts[e + 1] - s0;
                if (n < 1 || !gate[e] || !up[e] || !down[e]) continue;
                for (int64_t j = 0; j < n; j++) memcpy(xe + j * m.nsb_h, xq + tokens[s0 + j] * m.nsb_h, m.nsb_h * sizeof(q8k));
                expert_gate_up(&m, e, xe, n, gu, 0, 2 * inter);
                expert_activations(&m, gu, n, aq);
                gemm_rows(aq, n, m.nsb_i, down[e], down_type, NULL, ys + s0 * hidden, hidden, 0, hidden);
            }
        }
    } else {
        q8k *xe = (q8k *)lane_mem;
        float *gu = (float *)(lane_mem + (xe_b + 63) / 64 * 64);
        q8k *aq = (q8k *)((char *)gu + (gu_b + 63) / 64 * 64);
        for (int64_t e = 0; e < n_experts; e++) {
            const int64_t s0 = starts[e], n = starts[e + 1] - s0;
            if (n < 1 || !gate[e] || !up[e] || !down[e]) continue;
            for (int64_t j = 0; j < n; j++) memcpy(xe + j * m.nsb_h, xq + tokens[s0 + j] * m.nsb_h, m.nsb_h * sizeof(q8k));
            const int parts = parts_for(2 * inter, nthreads);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
            for (int t = 0; t < parts; t++) {
                int64_t o0, o1;
                share(2 * inter, parts, t, &o0, &o1);
                expert_gate_up(&m, e, xe, n, gu, o0, o1);
            }
            expert_activations(&m, gu, n, aq);
            const int dparts = parts_for(hidden, nthreads);
#pragma omp parallel for num_threads(dparts) schedule(static, 1) if (dparts > 1)
            for (int t = 0; t < dparts; t++) {
                int64_t o0, o1;
                share(hidden, dparts, t, &o0, &o1);
                gemm_rows(aq, n, m.nsb_i, down[e], down_type, NULL, ys + s0 * hidden, hidden, o0, o1);
            }
        }
    }
    memset(out, 0, (size_t)(T * hidden) * sizeof(float));
    const int cparts = parts_for(hidden, T * hidden >= (1 << 16) ? nthreads : 1);
#pragma omp parallel for num_threads(cparts) schedule(static, 1) if (cparts > 1)
    for (int t = 0; t < cparts; t++) { /* out[token] += weight * y in expert order: the product rounded, then added */
        int64_t c0, c1;
        share(hidden, cparts, t, &c0, &c1);
        for (int64_t e = 0; e < n_experts; e++) {
            if (!gate[e] || !up[e] || !down[e]) continue;
            for (int64_t pr = starts[e]; pr < starts[e + 1]; pr++) {
                float *o = out + tokens[pr] * hidden;
                const float *y = ys + pr * hidden, wgt = weights[pr];
                for (int64_t i = c0; i < c1; i++) {
                    float p = wgt * y[i];
                    KEEP(p);
                    o[i] += p;
                }
            }
        }
    }
    return 0;
}

/* `moe_int8x` from the router's choices as they come: chosen [T, k] experts and their weights,
 * grouped here by expert (a stable counting sort: within an expert, tokens ascending). */
int moe_routed_int8x(const float *x, int64_t T, int64_t hidden, int64_t inter, int64_t n_experts, int64_t k,
                     const int64_t *chosen, const float *route_w, const uint8_t *const *gate,
                     const uint8_t *const *up, const uint8_t *const *down, int gate_type, int up_type, int down_type,
                     float *out, int nthreads) {
    if (T < 1 || k < 1 || n_experts < 1) return -1;
    const int64_t pairs = T * k;
    int64_t *starts = calloc((size_t)(n_experts + 1), sizeof(int64_t));
    int64_t *tokens = malloc((size_t)pairs * sizeof(int64_t));
    float *weights = malloc((size_t)pairs * sizeof(float));
    int rc = -2;
    if (starts && tokens && weights) {
        rc = 0;
        for (int64_t p = 0; p < pairs; p++) {
            if (chosen[p] < 0 || chosen[p] >= n_experts) rc = -1;
            else starts[chosen[p] + 1]++;
        }
        if (rc == 0) {
            for (int64_t e = 0; e < n_experts; e++) starts[e + 1] += starts[e];
            int64_t *fill = malloc((size_t)n_experts * sizeof(int64_t));
            if (!fill) rc = -2;
            else {
                memcpy(fill, starts, (size_t)n_experts * sizeof(int64_t));
                for (int64_t p = 0; p < pairs; p++) { /* (token, slot) order: stable */
                    const int64_t at = fill[chosen[p]]++;
                    tokens[at] = p / k;
                    weights[at] = route_w[p];
                }
                free(fill);
                rc = moe_int8x(x, T, hidden, inter, n_experts, starts, tokens, weights, gate, up, down, gate_type,
                               up_type, down_type, out, nthreads);
            }
        }
    }
    free(starts);
    free(tokens);
    free(weights);
    return rc;
}


/* dense [n, in] = the rows ids[i] (ids NULL: o0 + i) of w, widened to fp32. Returns 0 or -1. */
int block_dequant_f32(const uint8_t *w, const int64_t *ids, int64_t o0, int64_t n, int64_t in, int type, float *dense,
                      int nthreads) {
    const int64_t sbb = sb_bytes(type);
    if (!sbb || in % QK || n < 0) return -1;
    const int64_t nsb = in / QK, row_bytes = nsb * sbb;
    if (nthreads < 1 || n < 64) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t i = 0; i < n; i++) dequant_row(type, w + (ids ? ids[i] : o0 + i) * row_bytes, nsb, dense + i * in);
    return 0;
}
