/* Paged prefill attention for the CPU, flash-style, at the machine's full vector width: the query
 * chunks of prompts (bottom-right causal, any earlier context), K and V read in place from the
 * paged pool (this step's rows are already stored there), online softmax over tiles of KT keys.
 *
 * Successor of cpu_prefill_attention.c (same work items, same row layout), measured faster on
 * every case of `python -m pdserve.bench.prefill_attention` (docs/benchmarks/prefill_attention.md):
 *   - vectors of VW floats: 16 (one zmm) where the compiler targets AVX-512, else 8 (AVX2);
 *   - the causal mask only on the tiles that cross the diagonal (the rest skip the selects);
 *   - P V four rows at a time (each V load feeds four rows: 16 accumulators at head_dim 64);
 *   - a tile's row maxima in four independent chains of vector max (one compare-select chain over
 *     the tile's keys was latency-bound: 8% of the kernel's time, perf).
 *
 * Work item: one sequence, one KV head, one tile of up to `bq` query positions. Its rows are the
 * G = Hq/Hkv query heads of that KV head at each position (row r = position i * G + head g), so
 * each tile of keys is read once for the whole GQA group. Queries are transposed once per item
 * (qt[D][RP], pre-scaled), so scores are vectorised over rows:
 *
 *            keys t0 .. t0+KT-1 (pool rows, through the block table)
 *   st[KT][RP] = K_tile . qt       KU keys x 2 vectors of rows in registers, D deep
 *   m, l, acc <- online softmax    p = exp(s - max), acc *= exp(m_old - m_new)
 *   acc[R][D] += p^T V_tile        4 rows x up to 4 vectors of head_dim in registers
 *
 *   causal, query i of the chunk sees keys 0 .. past + i:
 *            | full tiles (no mask)      | diagonal tiles (masked) |
 *   keys     0 ..................... past + i0 ............... past + i0 + nq
 *
 * fp32 or bf16 (queries, pool and output all one type; bf16 K/V tiles are widened to fp32 once per
 * item and tile, into kbuf/vbuf, and all arithmetic is fp32; outputs rounded to nearest even), or
 * a quantized pool under fp32 queries and output (--kv-cache-dtype int8|fp8, kernels/kv_quant.h:
 * each row's D int8 or e4m3 values times its scale, widened the same way into kbuf/vbuf, where the
 * tile is reused by every row of the item);
 * head_dim a multiple of VW up to MAX_D; OpenMP threads from torch's own runtime
 * (kernels/cpu_native.py builds and loads it). Heavy items (late tiles of long prompts) go first.
 *
 * Sliding window (`window` > 0, per layer): row at position p sees keys (p - window, p]; an item's
 * key tiles start at its first row's window (keys before it are never read), rows mask [lo, lim).
 * Soft-capping (`softcap` > 0): scores s -> softcap * tanh(s / softcap), before the mask.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kv_quant.h"

#if defined(__AVX512F__)
#define VW 16
#define KU 8 /* keys per register tile of scores: 2 x KU accumulators of 32 registers */
#else
#define VW 8
#define KU 4 /* AVX2 has 16 registers */
#endif
#define MAX_D 256
#define MAX_G 16            /* query heads per KV head */
#define BQ 32               /* query positions per work item, fewer when G x D is large */
#define ROW_FLOATS 16384    /* RP x D of an item's query and accumulator buffers (64 KiB each) */
#define KT 32               /* keys per tile */
#define MAX_ROWS 256
#define RB (2 * VW)         /* rows per register tile of scores; RP is a multiple of it */
#define PV_ROWS 4           /* rows per register tile of P V */
#define PV_VECS 4           /* head_dim vectors per register tile of P V */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf x) { *(vfu *)p = x; }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vi splati(int32_t x) { return (vi){0} + x; }

static inline vf sel(vi mask, vf a, vf b) { /* mask ? a : b, lane by lane */
    vi x, y;
    __builtin_memcpy(&x, &a, sizeof x);
    __builtin_memcpy(&y, &b, sizeof y);
    x = (x & mask) | (y & ~mask);
    vf out;
    __builtin_memcpy(&out, &x, sizeof out);
    return out;
}

#define MASKED (-1e30f) /* a masked score; finite (-ffast-math assumes no infinities) */

/* Lane-wise max (exact, so the order of a reduction does not change its result). */
static inline vf vmax(vf a, vf b) {
#if VW == 16
    return _mm512_max_ps(a, b);
#elif defined(__AVX__)
    return _mm256_max_ps(a, b);
#else
    return sel(a > b, a, b);
#endif
}

#define MAX_CHAINS 4 /* independent running maxima over a tile's keys: a compare-select chain of
                        KT steps was latency-bound (~8% of the kernel's time) */

/* exp(x) for x <= 0 (scores minus their running max): exp(x) = 2^n exp(r), r = x - n ln2, exp(r)
 * by Cephes' expf polynomial (about 1 ulp). Below -87 (masked scores): 0. */
static inline vf exp_nonpos(vf x) {
    const vf lo = splat(-87.0f);
    const vi under = x < lo;
    x = sel(under, lo, x);
    const vi n = __builtin_convertvector(x * splat(1.44269504088896341f) - splat(0.5f), vi); /* ~round */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = (x - nf * splat(0.693359375f)) - nf * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const vi bits = (n + 127) << 23;
    vf scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return sel(under, splat(0.0f), p * scale);
}

/* Element i of a fp32 (bf16 == 0) or bf16 array, as fp32. */
static inline float elt(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Element types of the pool (ET): fp32, bf16 (queries and output bf16 too), int8 rows, e4m3 rows
 * (queries and output fp32; a quantized head's row is D values + the scale's 4 bytes) */
#define ET_F32 0
#define ET_BF16 1
#define ET_Q8 2
#define ET_F8 3

static inline int quantized(const int ET) { return ET == ET_Q8 || ET == ET_F8; }

/* 8 values of a quantized row (ET_Q8 or ET_F8) from byte `c`, as floats, unscaled */
static inline __attribute__((always_inline)) kv_f32x8 widen8(const void *row, int c, const int ET) {
    return ET == ET_F8 ? f8_widen8((const uint8_t *)row + c) : q8_widen8((const int8_t *)row + c);
}

typedef struct {
    const void *q;           /* [T, Hq, D] token rows q_stride elements apart */
    const void *k, *v;       /* [N*bs, Hkv, HS] token rows of the pool (HS = D; int8, fp8: D + 4) */
    const int32_t *tables;   /* [B, table_stride] block ids */
    const int32_t *cu_q;     /* [B+1] query row offsets */
    const int32_t *ctx_lens; /* [B] KV length, this step's rows included */
    void *out;               /* [T, Hq, D] dense */
    int64_t q_stride, table_stride;
    int hq, hkv, d, bs, bq;
    float scale;
    int window;    /* > 0: a row at position p sees keys > p - window (sliding window) */
    float softcap; /* > 0: scores s become softcap * tanh(s / softcap) */
} Job;

typedef struct { int seq, head, tile; int64_t cost; } Item;

/* st[t][r] = qt[:, r] . k_t for the tile's keys [0, nt) and all RP rows. */
static inline __attribute__((always_inline)) void scores(const float *qt, const float *const *krow, int nt, int RP,
                                                         float *st, const int D) {
    for (int r = 0; r < RP; r += RB)
        for (int t = 0; t < nt; t += KU) {
            vf a[KU][2];
            for (int u = 0; u < KU; u++) a[u][0] = a[u][1] = splat(0.0f);
            for (int c = 0; c < D; c++) {
                const vf x0 = loadv(qt + c * RP + r), x1 = loadv(qt + c * RP + r + VW);
                for (int u = 0; u < KU; u++) {
                    const vf k = splat(krow[t + u][c]);
                    a[u][0] += k * x0;
                    a[u][1] += k * x1;
                }
            }
            for (int u = 0; u < KU; u++) {
                storev(st + (t + u) * RP + r, a[u][0]);
                storev(st + (t + u) * RP + r + VW, a[u][1]);
            }
        }
}

/* Online softmax of one tile, VW rows a vector: st becomes p = exp(s - m_new); corr the factor the
 * accumulators are rescaled by. `masked`: a diagonal tile or one before a row's window (keys
 * outside a row's [lo, lim), or past nt, are masked); else every key of the tile is visible to every row. */
static inline __attribute__((always_inline)) void softmax_tile(float *st, int RP, int t0, int nt, int masked,
                                                               const int32_t *lim, const int32_t *lo, float *m, float *l,
                                                               float *corr) {
    for (int r = 0; r < RP; r += VW) {
        vf mc[MAX_CHAINS], sum = splat(0.0f);
        for (int c = 0; c < MAX_CHAINS; c++) mc[c] = loadv(m + r);
        if (masked) {
            vi limv, lov;
            __builtin_memcpy(&limv, lim + r, sizeof limv);
            __builtin_memcpy(&lov, lo + r, sizeof lov);
            for (int t = 0; t < KT; t++) {
                const vi seen = (splati(t0 + t) < limv) & (splati(t0 + t) >= lov) & splati(t < nt ? -1 : 0);
                const vf x = sel(seen, loadv(st + t * RP + r), splat(MASKED));
                storev(st + t * RP + r, x);
                mc[t % MAX_CHAINS] = vmax(mc[t % MAX_CHAINS], x);
            }
        } else {
            for (int t = 0; t < KT; t++) mc[t % MAX_CHAINS] = vmax(mc[t % MAX_CHAINS], loadv(st + t * RP + r));
        }
        vf mx = mc[0];
        for (int c = 1; c < MAX_CHAINS; c++) mx = vmax(mx, mc[c]);
        for (int t = 0; t < KT; t++) {
            const vf p = exp_nonpos(loadv(st + t * RP + r) - mx);
            storev(st + t * RP + r, p);
            sum += p;
        }
        const vf c = exp_nonpos(loadv(m + r) - mx); /* 0 on the first tile, 1 while the max holds */
        storev(corr + r, c);
        storev(l + r, loadv(l + r) * c + sum);
        storev(m + r, mx);
    }
}

/* acc[r] = acc[r] * corr[r] + sum_t p[t][r] v_t for rows [0, R4) (R4 a multiple of PV_ROWS). */
static inline __attribute__((always_inline)) void accumulate(float *acc, const float *st, const float *corr,
                                                             const float *const *vrow, int nt, int RP, int R4,
                                                             const int D) {
    for (int c0 = 0; c0 < D; c0 += PV_VECS * VW) {
        const int w = D - c0 < PV_VECS * VW ? (D - c0) / VW : PV_VECS;
        for (int r = 0; r < R4; r += PV_ROWS) {
            vf o[PV_ROWS][PV_VECS];
            for (int y = 0; y < PV_ROWS; y++)
                for (int c = 0; c < w; c++) o[y][c] = loadv(acc + (r + y) * D + c0 + c * VW) * corr[r + y];
            for (int t = 0; t < nt; t++) {
                const float *vr = vrow[t] + c0;
                vf v[PV_VECS];
                for (int c = 0; c < w; c++) v[c] = loadv(vr + c * VW);
                for (int y = 0; y < PV_ROWS; y++) {
                    const vf p = splat(st[t * RP + r + y]);
                    for (int c = 0; c < w; c++) o[y][c] += p * v[c];
                }
            }
            for (int y = 0; y < PV_ROWS; y++)
                for (int c = 0; c < w; c++) storev(acc + (r + y) * D + c0 + c * VW, o[y][c]);
        }
    }
}

/* Item (b, h, tile): query positions [i0, i0 + nq) of sequence b, KV head h. */
static inline __attribute__((always_inline)) void attend(const Job *j, const Item *it, const int D, const int ET) {
    const int b = it->seq, h = it->head, G = j->hq / j->hkv, bs = j->bs;
    const int bf16 = ET == ET_BF16, HS = quantized(ET) ? D + KV_SCALE_BYTES : D;
    const int q0 = j->cu_q[b], q_len = j->cu_q[b + 1] - q0, ctx = j->ctx_lens[b];
    const int i0 = it->tile * j->bq, nq = q_len - i0 < j->bq ? q_len - i0 : j->bq;
    const int R = nq * G, RP = (R + RB - 1) / RB * RB, R4 = (R + PV_ROWS - 1) / PV_ROWS * PV_ROWS;
    const int past = ctx - q_len;       /* query i sees keys 0 .. past + i */
    const int kend = past + i0 + nq;
    /* keys [kstart, kend): with a window, none before the first row's */
    const int kstart = j->window > 0 && past + i0 + 1 > j->window ? past + i0 + 1 - j->window : 0;    /* keys this item reads */
    const int kfull = past + i0 + 1;    /* keys [0, kfull) are seen by every row */
    const int64_t row = (int64_t)j->hkv * HS; /* elements between a pool token's rows */
    const int32_t *table = j->tables + (int64_t)b * j->table_stride;

    float qt[ROW_FLOATS] __attribute__((aligned(64)));  /* [D, RP]: queries transposed, pre-scaled */
    float acc[ROW_FLOATS] __attribute__((aligned(64))); /* [RP, D] */
    float st[KT * MAX_ROWS] __attribute__((aligned(64))); /* [KT, RP]: scores, then p */
    float m[MAX_ROWS] __attribute__((aligned(64))), l[MAX_ROWS] __attribute__((aligned(64)));
    float corr[MAX_ROWS] __attribute__((aligned(64)));
    int32_t lim[MAX_ROWS] __attribute__((aligned(64))); /* keys [lo, lim) of the sequence visible to the row */
    int32_t lo[MAX_ROWS] __attribute__((aligned(64)));
    const int kwin = j->window > 0 ? kend - j->window : 0; /* keys before it are hidden from some row */
    const float *krow[KT], *vrow[KT];
    float kbuf[ET != ET_F32 ? KT * MAX_D : 1] __attribute__((aligned(64))); /* [KT, D]: a bf16/int8/fp8 tile widened */
    float vbuf[ET != ET_F32 ? KT * MAX_D : 1] __attribute__((aligned(64)));

    for (int r = 0; r < RP; r++) {
        const int i = r / G, g = r % G;
        if (r < R) {
            const int64_t src = (int64_t)(q0 + i0 + i) * j->q_stride + (int64_t)(h * G + g) * D;
            for (int c = 0; c < D; c++) qt[c * RP + r] = elt(j->q, src + c, bf16) * j->scale;
            lim[r] = past + i0 + i + 1;
            lo[r] = j->window > 0 && lim[r] > j->window ? lim[r] - j->window : 0;
        } else { /* padding rows: zero queries that see key 0 only, so they stay finite; never written out */
            for (int c = 0; c < D; c++) qt[c * RP + r] = 0.0f;
            lim[r] = kstart + 1; /* key kstart only */
            lo[r] = kstart;
        }
        m[r] = MASKED;
        l[r] = 0.0f;
    }
    for (int x = 0; x < RP * D; x++) acc[x] = 0.0f;

    for (int t0 = kstart; t0 < kend; t0 += KT) {
        const int nt = kend - t0 < KT ? kend - t0 : KT;
        for (int t = 0; t < nt; t++) {
            const int64_t at = ((int64_t)table[(t0 + t) / bs] * bs + (t0 + t) % bs) * row + (int64_t)h * HS;
            if (quantized(ET)) { /* values times their row's scale */
                const char *kq = (const char *)j->k + at, *vq = (const char *)j->v + at;
                const float ks = kv_row_scale(kq, D), vs = kv_row_scale(vq, D);
                for (int c = 0; c < D; c += 8) {
                    const kv_f32x8 k8 = widen8(kq, c, ET) * ks, v8 = widen8(vq, c, ET) * vs;
                    __builtin_memcpy(kbuf + t * D + c, &k8, sizeof k8);
                    __builtin_memcpy(vbuf + t * D + c, &v8, sizeof v8);
                }
                krow[t] = kbuf + t * D;
                vrow[t] = vbuf + t * D;
            } else if (bf16) {
                for (int c = 0; c < D; c++) kbuf[t * D + c] = elt(j->k, at + c, 1);
                for (int c = 0; c < D; c++) vbuf[t * D + c] = elt(j->v, at + c, 1);
                krow[t] = kbuf + t * D;
                vrow[t] = vbuf + t * D;
            } else {
                krow[t] = (const float *)j->k + at;
                vrow[t] = (const float *)j->v + at;
            }
        }
        for (int t = nt; t < (nt + KU - 1) / KU * KU; t++) krow[t] = krow[0]; /* finite filler, masked */
        scores(qt, krow, nt, RP, st, D);
        if (j->softcap > 0.0f)
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < RP; r++) st[t * RP + r] = j->softcap * tanhf(st[t * RP + r] / j->softcap);
        softmax_tile(st, RP, t0, nt, t0 + KT > kfull || t0 < kwin, lim, lo, m, l, corr);
        accumulate(acc, st, corr, vrow, nt, RP, R4, D);
    }
    for (int r = 0; r < R; r++) {
        const int i = r / G, g = r % G;
        const float inv = 1.0f / l[r]; /* l >= 1: the row's max term contributes exp(0) */
        const int64_t dst = ((int64_t)(q0 + i0 + i) * j->hq + h * G + g) * D;
        if (bf16)
            for (int c = 0; c < D; c++) ((uint16_t *)j->out)[dst + c] = f32_to_bf16(acc[r * D + c] * inv);
        else
            for (int c = 0; c < D; c++) ((float *)j->out)[dst + c] = acc[r * D + c] * inv;
    }
}

static void attend_64(const Job *j, const Item *it) { attend(j, it, 64, ET_F32); }
static void attend_128(const Job *j, const Item *it) { attend(j, it, 128, ET_F32); }
static void attend_any(const Job *j, const Item *it) { attend(j, it, j->d, ET_F32); }
static void attend_64_bf16(const Job *j, const Item *it) { attend(j, it, 64, ET_BF16); }
static void attend_128_bf16(const Job *j, const Item *it) { attend(j, it, 128, ET_BF16); }
static void attend_any_bf16(const Job *j, const Item *it) { attend(j, it, j->d, ET_BF16); }
static void attend_64_q8(const Job *j, const Item *it) { attend(j, it, 64, ET_Q8); }
static void attend_128_q8(const Job *j, const Item *it) { attend(j, it, 128, ET_Q8); }
static void attend_any_q8(const Job *j, const Item *it) { attend(j, it, j->d, ET_Q8); }
static void attend_64_f8(const Job *j, const Item *it) { attend(j, it, 64, ET_F8); }
static void attend_128_f8(const Job *j, const Item *it) { attend(j, it, 128, ET_F8); }
static void attend_any_f8(const Job *j, const Item *it) { attend(j, it, j->d, ET_F8); }

static int heavier_first(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->cost, y = ((const Item *)b)->cost;
    return (x < y) - (x > y);
}

static int padded_rows(int bq, int g) { return (bq * g + RB - 1) / RB * RB; }

/* Sequences [first, first + n) of the batch; q, kv and out fp32 (et ET_F32) or bf16 (ET_BF16), or
 * q and out fp32 over int8 rows (ET_Q8) or e4m3 rows (ET_F8). Returns 0, or -1 when a shape is over this kernel's limits
 * or memory runs out (the caller falls back). */
static int prefill_flash(const void *q, int64_t q_stride, const void *kv, int64_t num_tokens_in_pool,
                         const int32_t *tables, int64_t table_stride, const int32_t *cu_q, const int32_t *ctx_lens,
                         void *out, int first, int n, int hq, int hkv, int d, int bs, float scale, int window,
                         float softcap, int nthreads, int et) {
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > MAX_G || d <= 0 || d > MAX_D || d % VW || bs <= 0) return -1;
    const int g = hq / hkv;
    int bq = BQ; /* rows (bq x G, padded) must fit the item's buffers */
    while (bq > 1 && (padded_rows(bq, g) * d > ROW_FLOATS || padded_rows(bq, g) > MAX_ROWS)) bq--;
    int64_t items = 0;
    for (int b = first; b < first + n; b++) items += (int64_t)hkv * ((cu_q[b + 1] - cu_q[b] + bq - 1) / bq);
    if (items == 0) return 0;
    Item *list = malloc(sizeof(Item) * items);
    if (!list) return -1;
    int64_t x = 0;
    for (int b = first; b < first + n; b++) {
        const int q_len = cu_q[b + 1] - cu_q[b], past = ctx_lens[b] - q_len;
        for (int tile = 0; tile * bq < q_len; tile++)
            for (int h = 0; h < hkv; h++) list[x++] = (Item){b, h, tile, past + (int64_t)tile * bq + bq};
    }
    qsort(list, items, sizeof(Item), heavier_first);
    const int64_t row_bytes = quantized(et) ? d + KV_SCALE_BYTES : (int64_t)d * (et == ET_BF16 ? 2 : 4);
    const Job job = {q,    kv,           (const char *)kv + num_tokens_in_pool * hkv * row_bytes,
                     tables, cu_q, ctx_lens, out, q_stride, table_stride, hq, hkv, d, bs, bq, scale, window, softcap};
    void (*fn)(const Job *, const Item *) =
        et == ET_BF16 ? (d == 64 ? attend_64_bf16 : d == 128 ? attend_128_bf16 : attend_any_bf16)
        : et == ET_Q8 ? (d == 64 ? attend_64_q8 : d == 128 ? attend_128_q8 : attend_any_q8)
        : et == ET_F8 ? (d == 64 ? attend_64_f8 : d == 128 ? attend_128_f8 : attend_any_f8)
                      : (d == 64 ? attend_64 : d == 128 ? attend_128 : attend_any);
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (nthreads > 1)
    for (int64_t i = 0; i < items; i++) fn(&job, &list[i]);
    free(list);
    return 0;
}

int prefill_flash_f32(const float *q, int64_t q_stride, const float *kv, int64_t num_tokens_in_pool,
                      const int32_t *tables, int64_t table_stride, const int32_t *cu_q, const int32_t *ctx_lens,
                      float *out, int first, int n, int hq, int hkv, int d, int bs, float scale, int window,
                      float softcap, int nthreads) {
    return prefill_flash(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, cu_q, ctx_lens, out, first, n,
                         hq, hkv, d, bs, scale, window, softcap, nthreads, ET_F32);
}

int prefill_flash_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kv, int64_t num_tokens_in_pool,
                       const int32_t *tables, int64_t table_stride, const int32_t *cu_q, const int32_t *ctx_lens,
                       uint16_t *out, int first, int n, int hq, int hkv, int d, int bs, float scale, int window,
                       float softcap, int nthreads) {
    return prefill_flash(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, cu_q, ctx_lens, out, first, n,
                         hq, hkv, d, bs, scale, window, softcap, nthreads, ET_BF16);
}

/* fp32 queries and output over an int8 pool [2, N, bs, Hkv, D + 4] (kernels/kv_quant.h) */
int prefill_flash_q8(const float *q, int64_t q_stride, const int8_t *kv, int64_t num_tokens_in_pool,
                     const int32_t *tables, int64_t table_stride, const int32_t *cu_q, const int32_t *ctx_lens,
                     float *out, int first, int n, int hq, int hkv, int d, int bs, float scale, int window,
                     float softcap, int nthreads) {
    return prefill_flash(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, cu_q, ctx_lens, out, first, n,
                         hq, hkv, d, bs, scale, window, softcap, nthreads, ET_Q8);
}

/* fp32 queries and output over an fp8 (e4m3) pool [2, N, bs, Hkv, D + 4], dtype uint8 (kernels/kv_quant.h) */
int prefill_flash_f8(const float *q, int64_t q_stride, const uint8_t *kv, int64_t num_tokens_in_pool,
                     const int32_t *tables, int64_t table_stride, const int32_t *cu_q, const int32_t *ctx_lens,
                     float *out, int first, int n, int hq, int hkv, int d, int bs, float scale, int window,
                     float softcap, int nthreads) {
    return prefill_flash(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, cu_q, ctx_lens, out, first, n,
                         hq, hkv, d, bs, scale, window, softcap, nthreads, ET_F8);
}
