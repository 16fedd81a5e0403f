/* Paged prefill attention for the CPU: the query chunks of prompts (bottom-right causal), K and V
 * read in place from the paged pool (this step's rows are already stored there), online softmax
 * over tiles of 16 keys, as in FlashAttention.
 *
 * Now the fallback of cpu_prefill_flash.c (~1.9x faster: full vector width, mask on the
 * diagonal tiles only), taking the fp32 shapes whose head_dim that kernel's vectors do not divide.
 *
 * Why not torch's SDPA: its CPU flash kernel ran a 512-token causal prompt (8 heads, 4 KV
 * heads, head_dim 64) at 5x the time its FLOPs take at the matmul rate (6.7 ms at two threads),
 * and a chunk with earlier context needed its KV gathered first.
 *
 * Built and loaded like cpu_decode_attention.c (kernels/cpu_native.py): fp32, head_dim a
 * multiple of 8 up to MAX_D, OpenMP threads from torch's own runtime.
 *
 * Work item: one sequence, one KV head, one tile of up to BQ query positions. Its rows are the
 * G = Hq/Hkv query heads of that KV head at each position (row r = position i * G + head g), so
 * each tile of keys is read once for all of them. The queries are transposed once per item
 * (qt[D][rows], pre-scaled), so every step below is vectorised over 8 rows. Per tile of 16 keys:
 *   st[16][rows] =  k_t . q_r, 8 keys x 16 rows a register tile; masked past each row's limit;
 *   m, l, acc    <- online softmax: p = exp(s - max), rescale acc by exp(m_old - m_new),
 *                   acc += p V (two rows share each load of a V row).
 * Scores over rows beat scores over keys (a transposed K tile per item and tile, then a softmax
 * across lanes), and 8 x 16 tiles beat 4 x 16 (docs/benchmarks/engine.md).
 * Heavy items (tiles late in long prompts) go first, so the threads finish together.
 *
 * Sliding window (`window` > 0, per layer): row at position p sees keys (p - window, p]; an item's
 * key tiles start at its first row's window (keys before it are never read), rows mask [lo, lim).
 * Soft-capping (`softcap` > 0): scores s -> softcap * tanh(s / softcap), before the mask.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_D 256
#define MAX_G 16       /* query heads per KV head */
#define BQ 32          /* query positions per work item, fewer when G x D is large */
#define ROW_FLOATS 16384 /* rows x D of one item's query and accumulator buffers (64 KiB each, on the stack) */
#define KT 16          /* keys per tile */
#define MAX_ROWS 256

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 sel(v8i mask, v8 a, v8 b) { /* mask ? a : b, lane by lane (C has no vector ?:) */
    v8i x, y;
    __builtin_memcpy(&x, &a, sizeof x);
    __builtin_memcpy(&y, &b, sizeof y);
    x = (x & mask) | (y & ~mask);
    v8 out;
    __builtin_memcpy(&out, &x, sizeof out);
    return out;
}

#define MASKED (-1e30f) /* a masked score; finite (-ffast-math assumes no infinities) */

/* exp(x) for x <= 0 (scores minus their running max), inlined: exp(x) = 2^n exp(r), r = x - n ln2,
 * exp(r) by Cephes' expf polynomial (about 1 ulp). Below -87 (masked scores): 0. */
static inline v8 exp8_nonpos(v8 x) {
    const v8 lo = splat8(-87.0f);
    const v8i under = x < lo;
    x = sel(under, lo, x);
    const v8i n = __builtin_convertvector(x * splat8(1.44269504088896341f) - splat8(0.5f), v8i); /* ~round */
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = (x - nf * splat8(0.693359375f)) - nf * splat8(-2.12194440e-4f);
    v8 p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * r * r + r + splat8(1.0f);
    const v8i bits = (n + 127) << 23;
    v8 scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    p = p * scale;
    return sel(under, splat8(0.0f), p);
}

typedef struct {
    const float *q;            /* [T, Hq, D] token rows q_stride floats apart */
    const float *k, *v;        /* [N*bs, Hkv, D] token rows of the pool */
    const int32_t *tables;     /* [B, table_stride] block ids */
    const int32_t *cu_q;       /* [B+1] query row offsets */
    const int32_t *ctx_lens;   /* [B] KV length, this step's rows included */
    float *out;                /* [T, Hq, D] dense */
    int64_t q_stride, table_stride;
    int hq, hkv, d, bs, bq;
    float scale;
    int window;    /* > 0: a row at position p sees keys > p - window (sliding window) */
    float softcap; /* > 0: scores s become softcap * tanh(s / softcap) */
} Job;

typedef struct { int seq, head, tile; int64_t cost; } Item;

/* Item (b, h, tile): query positions [i0, i0 + nq) of sequence b, KV head h. */
static inline __attribute__((always_inline)) void attend(const Job *j, const Item *it, const int D) {
    const int b = it->seq, h = it->head, G = j->hq / j->hkv, bs = j->bs;
    const int q0 = j->cu_q[b], q_len = j->cu_q[b + 1] - q0, ctx = j->ctx_lens[b];
    const int i0 = it->tile * j->bq, nq = q_len - i0 < j->bq ? q_len - i0 : j->bq;
    const int R = nq * G, RP = (R + 15) & ~15; /* rows, padded to whole pairs of vectors */
    const int past = ctx - q_len;             /* query i sees keys 0 .. past + i */
    const int kend = past + i0 + nq;
    /* keys [kstart, kend): with a window, none before the first row's */
    const int kstart = j->window > 0 && past + i0 + 1 > j->window ? past + i0 + 1 - j->window : 0;          /* keys this item reads */
    const int64_t row = (int64_t)j->hkv * D;  /* floats between a pool token's rows */
    const int32_t *table = j->tables + (int64_t)b * j->table_stride;

    float qt[ROW_FLOATS] __attribute__((aligned(32)));  /* [D, RP]: queries transposed, pre-scaled */
    float acc[ROW_FLOATS] __attribute__((aligned(32))); /* [R, D] */
    float st[KT * MAX_ROWS] __attribute__((aligned(32))); /* [KT, RP]: scores, then p */
    float m[MAX_ROWS] __attribute__((aligned(32))), l[MAX_ROWS] __attribute__((aligned(32)));
    float corr[MAX_ROWS] __attribute__((aligned(32)));
    int32_t lim[MAX_ROWS] __attribute__((aligned(32))); /* keys [lo, lim) of the sequence visible to the row */
    int32_t lo[MAX_ROWS] __attribute__((aligned(32)));
    const float *krow[KT], *vrow[KT];
    static const float zeros[MAX_D] __attribute__((aligned(32))) = {0};

    for (int r = 0; r < RP; r++) {
        const int i = r / G, g = r % G;
        if (r < R) {
            const float *src = j->q + (int64_t)(q0 + i0 + i) * j->q_stride + (int64_t)(h * G + g) * D;
            for (int c = 0; c < D; c++) qt[c * RP + r] = src[c] * j->scale;
            lim[r] = past + i0 + i + 1;
            lo[r] = j->window > 0 && lim[r] > j->window ? lim[r] - j->window : 0;
        } else { /* padding rows: see key 0 only, so they stay finite; never written out */
            for (int c = 0; c < D; c++) qt[c * RP + r] = 0.0f;
            lim[r] = kstart + 1; /* key kstart only */
            lo[r] = kstart;
        }
        m[r] = MASKED;
        l[r] = 0.0f;
    }
    for (int x = 0; x < R * D; x++) acc[x] = 0.0f;

    for (int t0 = kstart; t0 < kend; t0 += KT) {
        const int nt = kend - t0 < KT ? kend - t0 : KT;
        for (int t = 0; t < KT; t++) {
            if (t < nt) {
                const int64_t tok = (int64_t)table[(t0 + t) / bs] * bs + (t0 + t) % bs;
                krow[t] = j->k + tok * row + (int64_t)h * D;
                vrow[t] = j->v + tok * row + (int64_t)h * D;
            } else {
                krow[t] = vrow[t] = zeros;
            }
        }
        for (int r = 0; r < RP; r += 16) /* st[t, r] = q_r . k_t: 8 keys x 16 rows in 16 accumulators */
            for (int t = 0; t < KT; t += 8) {
                v8 a[8][2];
                for (int u = 0; u < 8; u++) a[u][0] = a[u][1] = splat8(0.0f);
                for (int c = 0; c < D; c++) {
                    const v8 x0 = load8(qt + c * RP + r), x1 = load8(qt + c * RP + r + 8);
                    for (int u = 0; u < 8; u++) {
                        const v8 k = splat8(krow[t + u][c]);
                        a[u][0] += k * x0;
                        a[u][1] += k * x1;
                    }
                }
                for (int u = 0; u < 8; u++) {
                    store8(st + (t + u) * RP + r, a[u][0]);
                    store8(st + (t + u) * RP + r + 8, a[u][1]);
                }
            }
        if (j->softcap > 0.0f)
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < RP; r++) st[t * RP + r] = j->softcap * tanhf(st[t * RP + r] / j->softcap);
        /* online softmax, 8 rows a vector: mask outside each row's [lo, lim), p = exp(s - max) */
        for (int r = 0; r < RP; r += 8) {
            v8 mxv = load8(m + r), sumv = {0};
            v8i limv, lov;
            __builtin_memcpy(&limv, lim + r, sizeof limv);
            __builtin_memcpy(&lov, lo + r, sizeof lov);
            for (int t = 0; t < KT; t++) {
                const v8i seen = (t0 + t < limv) & (t0 + t >= lov) & (t < nt ? -1 : 0);
                const v8 x = sel(seen, load8(st + t * RP + r), splat8(MASKED));
                store8(st + t * RP + r, x);
                mxv = sel(x > mxv, x, mxv);
            }
            for (int t = 0; t < KT; t++) {
                const v8 p = exp8_nonpos(load8(st + t * RP + r) - mxv);
                store8(st + t * RP + r, p);
                sumv += p;
            }
            const v8 c = exp8_nonpos(load8(m + r) - mxv); /* 0 on the first tile, 1 while the max holds */
            store8(corr + r, c);
            store8(l + r, load8(l + r) * c + sumv);
            store8(m + r, mxv);
        }
        for (int r = 0; r < R; r += 2) { /* acc[r] = acc[r] * corr + sum_t p[r, t] v_t: 2 rows share each V load */
            const int two = r + 1 < R;
            for (int c0 = 0; c0 < D; c0 += 64) {
                const int w = D - c0 < 64 ? (D - c0) / 8 : 8;
                float *a = acc + r * D + c0, *a2 = a + D;
                v8 o[8], o2[8];
                for (int c = 0; c < w; c++) {
                    o[c] = load8(a + 8 * c) * corr[r];
                    o2[c] = two ? load8(a2 + 8 * c) * corr[r + 1] : (v8){0};
                }
                for (int t = 0; t < KT; t++) {
                    const v8 p = splat8(st[t * RP + r]), p2 = splat8(st[t * RP + r + 1]);
                    const float *vr = vrow[t] + c0;
                    for (int c = 0; c < w; c++) {
                        const v8 v = load8(vr + 8 * c);
                        o[c] += p * v;
                        o2[c] += p2 * v;
                    }
                }
                for (int c = 0; c < w; c++) {
                    store8(a + 8 * c, o[c]);
                    if (two) store8(a2 + 8 * c, o2[c]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const int i = r / G, g = r % G;
        const float inv = 1.0f / l[r]; /* l >= 1: the row's max term contributes exp(0) */
        float *dst = j->out + ((int64_t)(q0 + i0 + i) * j->hq + h * G + g) * D;
        for (int c = 0; c < D; c++) dst[c] = acc[r * D + c] * inv;
    }
}

static void attend_64(const Job *j, const Item *it) { attend(j, it, 64); }
static void attend_128(const Job *j, const Item *it) { attend(j, it, 128); }
static void attend_any(const Job *j, const Item *it) { attend(j, it, j->d); }

static int heavier_first(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->cost, y = ((const Item *)b)->cost;
    return (x < y) - (x > y);
}

/* Sequences [first, first + n) of the batch. Returns 0, or -1 when a shape is over this
 * kernel's limits or memory runs out (the caller falls back). */
int paged_prefill_attention_f32(const float *q, int64_t q_stride, const float *kv, int64_t num_tokens_in_pool,
                                const int32_t *tables, int64_t table_stride, const int32_t *cu_q,
                                const int32_t *ctx_lens, float *out, int first, int n, int hq, int hkv, int d,
                                int bs, float scale, int window, float softcap, int nthreads) {
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > MAX_G || d > MAX_D || d % 8 || bs <= 0) return -1;
    int bq = BQ; /* rows (bq x G, padded to 16) must fit the item's buffers */
    while (bq > 1 && ((((bq * (hq / hkv) + 15) & ~15) * d > ROW_FLOATS) || ((bq * (hq / hkv) + 15) & ~15) > MAX_ROWS))
        bq--;
    int64_t items = 0;
    for (int b = first; b < first + n; b++) items += (int64_t)hkv * ((cu_q[b + 1] - cu_q[b] + bq - 1) / bq);
    if (items == 0) return 0;
    Item *list = malloc(sizeof(Item) * items);
    if (!list) return -1;
    int64_t x = 0;
    for (int b = first; b < first + n; b++) {
        const int q_len = cu_q[b + 1] - cu_q[b], past = ctx_lens[b] - q_len;
        for (int tile = 0; tile * bq < q_len; tile++)
            for (int h = 0; h < hkv; h++)
                list[x++] = (Item){b, h, tile, past + (int64_t)tile * bq + bq};
    }
    qsort(list, items, sizeof(Item), heavier_first);
    const Job job = {q, kv, kv + num_tokens_in_pool * hkv * d, tables, cu_q, ctx_lens, out, q_stride,
                     table_stride, hq, hkv, d, bs, bq, scale, window, softcap};
    void (*fn)(const Job *, const Item *) = d == 64 ? attend_64 : d == 128 ? attend_128 : attend_any;
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (nthreads > 1)
    for (int64_t i = 0; i < items; i++) fn(&job, &list[i]);
    free(list);
    return 0;
}
