/* Paged decode attention for the CPU: one query token per sequence, KV read in place from the
 * paged pool (no gather), online softmax one block at a time.
 *
 * Built by kernels/cpu_native.py with the machine's C compiler at first use and loaded with
 * ctypes (no torch headers, so it compiles in about a second). fp32, or bf16 (queries, pool and
 * output all bf16: K and V rows widened to fp32 as they are loaded, all arithmetic fp32, outputs
 * rounded to nearest even), or a quantized pool with fp32 queries and output (--kv-cache-dtype
 * int8|fp8: each row D int8 or e4m3 values and their fp32 scale, kernels/kv_quant.h; values widened
 * to fp32 in registers, exactly, q . k scaled by K's row scale, p by V's, all sums fp32); head_dim a
 * multiple of 8. Vector code is GCC/Clang vector extensions
 * (8 floats), so it builds on any target and -march=native picks the instructions.
 *
 * Threads: OpenMP. The library is linked against libgomp by soname, and torch has already
 * loaded its own libgomp.so.1 when this loads, so both share one runtime and one thread pool:
 * no threads of ours competing with torch's on the same cores, and no thread start per call.
 *
 * Layout (one layer of the pool, contiguous): kv [2, N, bs, Hkv, HS]; K rows at kv, V rows at
 * kv + N*bs*Hkv*HS, HS = D (int8, fp8: D + 4, the scale's bytes after the values). Work is split flash-decoding style: a work item is one sequence, one span of
 * its context and all its KV heads (fewer only when the query heads are over MAX_H), so each
 * token's row is read whole, once, while hot, for all the query heads of the item (GQA: G =
 * Hq/Hkv per KV head). Each item leaves its unnormalised output with its running max and sum; a
 * second pass merges a sequence's spans in span order (log-sum-exp). The span length follows
 * from the batch's context lengths alone, never from the thread count, so results are the same
 * at any thread count. A batch of one feeds every thread this way: splitting its KV heads
 * between threads instead read each row in pieces, and two threads ran slower than one (at one
 * sequence of 370 tokens, two threads: 173 us a layer split by heads, 76 us split by spans).
 * Each thread takes one run of consecutive items holding its share of the tokens and, as it
 * starts an item, pulls the first block of its next one into L2: a thread reading a cold
 * sequence's first rows (TLB walks, the prefetcher starting over) ran at ~9 GB/s, and items
 * handed out one at a time (dynamic) gave every thread cold starts. 32 x 370 tokens, two threads:
 * 1.28 -> 1.02 ms a layer; 8 x 370: 332 -> 261 us (A/B in one process).
 *
 * Memory: K and V rows are read in token order, and engine/block_pool.py keeps a sequence's
 * blocks contiguous, so the hardware prefetcher streams them. On top, each V row is prefetched
 * into L2 as its K row is read, and the next block's K rows as this block's V rows are summed:
 * at 32 sequences x 370 tokens, two threads, 1.66 -> 1.26 ms a layer (A/B in one process;
 * into L1 it gained little, the prefetches of a whole block at once none). Walking a block
 * head by head (eight tokens' scores summed at once, accumulators in registers) instead of
 * token by token was slower at every batch: rows 1 KB apart defeat the streams.
 *
 * Sliding window (`window` > 0, HF semantics): the query at position ctx - 1 sees keys at
 * positions > ctx - 1 - window. A sequence's spans start at the block holding its first visible
 * key (blocks before it are never read); the keys of that block before it are masked. Soft-capping
 * (`softcap` > 0, Gemma 2): each scaled score s becomes softcap * tanh(s / softcap).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kv_quant.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_H 32   /* query heads in one work item */
#define MAX_D 256
#define MAX_BS 64
#define SPAN_MIN 64    /* the least context per work item, in tokens (rounded up to whole blocks) */
#define SPAN_ITEMS 16  /* spans are cut to give the batch about this many items */

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* for loads and stores at any float address */

static inline v8 load8(const float *p) { return *(const v8u *)p; }

/* Element types of the pool (ET): fp32, bf16 (queries and output bf16 too), int8 rows, e4m3 rows
 * (queries and output fp32; a quantized row is D values + the scale's 4 bytes) */
#define ET_F32 0
#define ET_BF16 1
#define ET_Q8 2
#define ET_F8 3

static inline int esize(const int ET) { return ET == ET_F32 ? 4 : ET == ET_BF16 ? 2 : 1; }
static inline int quantized(const int ET) { return ET == ET_Q8 || ET == ET_F8; }

/* 8 elements of a pool array of type ET from element `i`, as floats (int8, fp8: unscaled) */
static inline __attribute__((always_inline)) v8 ld8(const void *p, int64_t i, const int ET) {
    return ET == ET_BF16 ? bf16_widen8((const uint16_t *)p + i)
           : ET == ET_Q8 ? q8_widen8((const int8_t *)p + i)
           : ET == ET_F8 ? f8_widen8((const uint8_t *)p + i)
                         : load8((const float *)p + i);
}

/* the cache line holding element `i` of a pool array of type ET, into L2 */
static inline __attribute__((always_inline)) void pf(const void *p, int64_t i, const int ET) {
    __builtin_prefetch((const char *)p + i * esize(ET), 0, 2);
}
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }
static inline float hsum8(v8 a) {
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += a[k];
    return s;
}

typedef struct {               /* arrays of fp32, or all of bf16 (uint16), or an int8 / fp8 pool */
    const void *q;             /* [n, Hq, D], rows q_stride elements apart */
    const void *k;             /* [N*bs, Hkv, HS] token rows */
    const void *v;             /* [N*bs, Hkv, HS] token rows */
    const int32_t *tables;     /* [n, table_stride] block ids */
    const int32_t *ctx_lens;   /* [n] tokens to attend, this step's included */
    const int *starts;         /* [n] the first key each sequence sees (0 without a window) */
    void *out;                 /* [n, Hq, D] */
    int64_t q_stride, table_stride;
    int hq, hkv, d, hs, bs;    /* hs: a head's row in the pool, in elements (d; int8, fp8: d + 4) */
    float scale, softcap;      /* softcap 0: none */
} Job;

#define MASKED (-1e30f) /* a masked score; finite (-ffast-math assumes no infinities) */

/* One work item: sequence i, tokens [t_lo, t_hi) of its context (t_lo on a block edge), KV heads
 * [h0, h0 + nh) and their G query heads each. Leaves the unnormalised output [H, D] in part and
 * each query head's running max and sum in ml [2, H]. D is a compile-time constant in the
 * specialised copies below, so the vector loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const Job *j, int i, int t_lo, int t_hi, int h0, int nh,
                                                         float *part, float *ml, const int D, const int ET) {
    const int G = j->hq / j->hkv, bs = j->bs, H = nh * G; /* H query heads here */
    const int HS = quantized(ET) ? D + KV_SCALE_BYTES : D; /* a head's row, in elements */
    const int64_t row = (int64_t)j->hkv * HS; /* elements from one token's row to the next */
    const int PF = 64 / esize(ET);            /* elements a cache line */
    const int BF = ET == ET_BF16;
    const int32_t *table = j->tables + (int64_t)i * j->table_stride;
    float qs[MAX_H * MAX_D] __attribute__((aligned(32)));
    float *acc = part; /* [H, D] */
    float s[MAX_H * MAX_BS], *m = ml, *l = ml + H, corr[MAX_H];

    const int64_t qh = (int64_t)i * j->q_stride + (int64_t)h0 * G * D; /* [H, D] from here */
    for (int x = 0; x < H * D; x++) {
        qs[x] = (BF ? bf16_to_f32(((const uint16_t *)j->q)[qh + x]) : ((const float *)j->q)[qh + x]) * j->scale;
        acc[x] = 0.0f;
    }
    for (int g = 0; g < H; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int t0 = t_lo; t0 < t_hi; t0 += bs) {
        const int nt = t_hi - t0 < bs ? t_hi - t0 : bs;
        const int64_t base = (int64_t)table[t0 / bs] * bs * row + (int64_t)h0 * HS; /* element of K and of V */
        /* the next block's K, prefetched while this block's V is summed (-1: none) */
        const int64_t kn = t0 + bs < t_hi ? (int64_t)table[t0 / bs + 1] * bs * row + (int64_t)h0 * HS : -1;
        for (int t = 0; t < nt; t++) { /* scores s[g, t] = q_g . k_t for the G query heads of each KV head */
            const int64_t kt = base + t * row;
            for (int x = 0; x < nh * HS; x += PF) pf(j->v, kt + x, ET); /* this V row, needed next */
            for (int h = 0; h < nh; h++) {
                v8 k8[MAX_D / 8]; /* the KV head's row, loaded once for its G query heads */
                for (int c = 0; c < D / 8; c++) k8[c] = ld8(j->k, kt + h * HS + 8 * c, ET);
                /* int8, fp8: q . k in units of the row's scale, scaled once */
                const float ks = quantized(ET) ? kv_row_scale((const int8_t *)j->k + kt + h * HS, D) : 1.0f;
                for (int g = h * G; g < (h + 1) * G; g++) {
                    const float *qg = qs + g * D;
                    v8 a = {0}, b = {0}; /* two dependency chains */
                    int c = 0;
                    for (; c + 1 < D / 8; c += 2) {
                        a += load8(qg + 8 * c) * k8[c];
                        b += load8(qg + 8 * c + 8) * k8[c + 1];
                    }
                    if (c < D / 8) a += load8(qg + 8 * c) * k8[c];
                    s[g * bs + t] = quantized(ET) ? hsum8(a + b) * ks : hsum8(a + b);
                }
            }
        }
        if (j->softcap > 0.0f)
            for (int g = 0; g < H; g++)
                for (int t = 0; t < nt; t++) s[g * bs + t] = j->softcap * tanhf(s[g * bs + t] / j->softcap);
        const int hidden = j->starts[i] - t0; /* keys before the window in this block (first block only) */
        if (hidden > 0)
            for (int g = 0; g < H; g++)
                for (int t = 0; t < hidden && t < nt; t++) s[g * bs + t] = MASKED;
        for (int g = 0; g < H; g++) { /* online softmax: p = exp(s - max), rescale what came before */
            float *sg = s + g * bs;
            float mx = m[g];
            for (int t = 0; t < nt; t++) mx = sg[t] > mx ? sg[t] : mx;
            corr[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
            float sum = 0.0f;
            for (int t = 0; t < nt; t++) {
                sg[t] = expf(sg[t] - mx);
                sum += sg[t];
            }
            l[g] = l[g] * corr[g] + sum;
            m[g] = mx;
        }
        for (int g = 0; g < H; g++) /* rescale what came before */
            if (corr[g] != 1.0f)
                for (int c = 0; c < D / 8; c++) store8(acc + g * D + 8 * c, load8(acc + g * D + 8 * c) * corr[g]);
        for (int t = 0; t < nt; t++) { /* acc[g] += p[g, t] * v_t: V read row by row, in order */
            const int64_t vt = base + t * row;
            if (kn >= 0)
                for (int x = 0; x < nh * HS; x += PF) pf(j->k, kn + t * row + x, ET);
            if (ET == ET_F8) { /* each KV head's row widened once for its G query heads (more work than int8's) */
                for (int h = 0; h < nh; h++) {
                    const int64_t vr = vt + h * HS;
                    const float vs = kv_row_scale((const uint8_t *)j->v + vr, D);
                    v8 v[MAX_D / 8];
                    for (int c = 0; c < D / 8; c++) v[c] = ld8(j->v, vr + 8 * c, ET);
                    for (int g = h * G; g < (h + 1) * G; g++) {
                        const float p = s[g * bs + t] * vs;
                        float *ag = acc + g * D;
                        for (int c = 0; c < D / 8; c++) store8(ag + 8 * c, load8(ag + 8 * c) + p * v[c]);
                    }
                }
                continue;
            }
            for (int g = 0; g < H; g++) {
                const int64_t vr = vt + (g / G) * HS;
                /* int8: p times V's row scale, so the unscaled values are summed as they are */
                const float p = ET == ET_Q8 ? s[g * bs + t] * kv_row_scale((const int8_t *)j->v + vr, D) : s[g * bs + t];
                float *ag = acc + g * D;
                for (int c = 0; c < D / 8; c++) store8(ag + 8 * c, load8(ag + 8 * c) + p * ld8(j->v, vr + 8 * c, ET));
            }
        }
    }
}

/* attend with head_dim D (0: the job's) and the pool's element type ET fixed at compile time */
#define ATTEND(name, D, ET)                                                                      \
    static void name(const Job *j, int i, int lo, int hi, int h0, int nh, float *p, float *ml) { \
        attend(j, i, lo, hi, h0, nh, p, ml, (D) ? (D) : j->d, ET);                               \
    }
ATTEND(attend_64, 64, ET_F32)
ATTEND(attend_128, 128, ET_F32)
ATTEND(attend_any, 0, ET_F32)
ATTEND(attend_64_bf16, 64, ET_BF16)
ATTEND(attend_128_bf16, 128, ET_BF16)
ATTEND(attend_any_bf16, 0, ET_BF16)
ATTEND(attend_64_q8, 64, ET_Q8)
ATTEND(attend_128_q8, 128, ET_Q8)
ATTEND(attend_any_q8, 0, ET_Q8)
ATTEND(attend_64_f8, 64, ET_F8)
ATTEND(attend_128_f8, 128, ET_F8)
ATTEND(attend_any_f8, 0, ET_F8)

/* Sequence i's spans in order, head group h0 (H query heads): span sp's output [H, D] at
 * part + sp * part_step and its max and sum [2, H] at ml + sp * ml_step. out = sum_s e^(m_s - M)
 * acc_s / sum_s e^(m_s - M) l_s, M the largest m_s, summed in span order. */
static void merge(const Job *j, int i, int h0, int H, const float *part, int64_t part_step, const float *ml,
                  int64_t ml_step, int spans, int bf16) {
    const int D = j->d, G = j->hq / j->hkv;
    const int64_t oh = ((int64_t)i * j->hq + (int64_t)h0 * G) * D; /* [H, D] of out from here */
    float o[MAX_D];
    for (int g = 0; g < H; g++) {
        float mx = -INFINITY, l = 0.0f;
        for (int sp = 0; sp < spans; sp++) mx = ml[sp * ml_step + g] > mx ? ml[sp * ml_step + g] : mx;
        for (int c = 0; c < D; c++) o[c] = 0.0f;
        for (int sp = 0; sp < spans; sp++) {
            const float *msp = ml + sp * ml_step; /* every span holds a token: its max is finite */
            const float w = expf(msp[g] - mx), *a = part + sp * part_step + g * D;
            l += msp[H + g] * w;
            for (int c = 0; c < D; c++) o[c] += a[c] * w;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        if (bf16)
            for (int c = 0; c < D; c++) ((uint16_t *)j->out)[oh + g * D + c] = f32_to_bf16(o[c] * inv);
        else
            for (int c = 0; c < D; c++) ((float *)j->out)[oh + g * D + c] = o[c] * inv;
    }
}

/* The batch's spans: sequence i's are first[i] .. first[i + 1] - 1, each `len` tokens but its
 * last, from begin[i] (its first visible key's block edge); seq[sp] is span sp's sequence. */
typedef struct {
    const int *first, *seq, *begin;
    int64_t len;
} Spans;

/* Span sp: its sequence *i and tokens [*lo, *hi) of that sequence's context. */
static inline void span_range(const Job *j, const Spans *spans, int64_t sp, int *i, int *lo, int *hi) {
    *i = spans->seq[sp];
    *lo = spans->begin[*i] + (int)((sp - spans->first[*i]) * spans->len);
    *hi = *lo + spans->len < j->ctx_lens[*i] ? *lo + (int)spans->len : j->ctx_lens[*i];
}

static inline int64_t span_tokens(const Job *j, const Spans *spans, int64_t sp) {
    int i, lo, hi;
    span_range(j, spans, sp, &i, &lo, &hi);
    return hi - lo;
}

/* Span sp's first block of K and V rows into L2 (`esz`: bytes of a pool element). */
static inline void prefetch_first_block(const Job *j, const Spans *spans, int64_t sp, int esz) {
    int i, lo, hi;
    span_range(j, spans, sp, &i, &lo, &hi);
    const int64_t row = (int64_t)j->hkv * j->hs * esz; /* bytes */
    const int64_t base = (int64_t)j->tables[(int64_t)i * j->table_stride + lo / j->bs] * j->bs * row;
    const int64_t n = (hi - lo < j->bs ? hi - lo : j->bs) * row;
    for (int64_t x = 0; x < n; x += 64) {
        __builtin_prefetch((const char *)j->k + base + x, 0, 2);
        __builtin_prefetch((const char *)j->v + base + x, 0, 2);
    }
}

/* q, kv and out fp32 (et ET_F32) or bf16 (ET_BF16), or q and out fp32 and kv int8 rows (ET_Q8) or
 * e4m3 rows (ET_F8).
 * Returns 0, or -1 when a shape is over this kernel's limits (the caller falls back) or scratch
 * memory is short. */
static int decode_attention(const void *q, int64_t q_stride, const void *kv, int64_t num_tokens_in_pool,
                            const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens, void *out, int n,
                            int hq, int hkv, int d, int bs, float scale, int window, float softcap, int nthreads,
                            int et) {
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > MAX_H || d > MAX_D || d % 8 || bs > MAX_BS || bs <= 0) return -1;
    if (n <= 0) return 0;
    int per = hkv; /* KV heads per item: all of them, unless their query heads are over MAX_H */
    while (per > 1 && (per * (hq / hkv) > MAX_H || hkv % per)) per--;
    const int groups = hkv / per, H = per * (hq / hkv);
    /* the span: the batch's context over SPAN_ITEMS, at least SPAN_MIN, in whole blocks. A batch
     * of long sequences keeps one item per sequence (one long stream each for the prefetcher;
     * cutting them was 30% slower at 32 x 370 tokens), a small batch is cut to feed the threads. */
    int *starts = malloc(sizeof(int) * (size_t)(2 * n + 1)), *begin = starts + n; /* first key seen, its block edge */
    if (!starts) return -1;
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        starts[i] = window > 0 && ctx_lens[i] > window ? ctx_lens[i] - window : 0;
        begin[i] = starts[i] / bs * bs;
        total += ctx_lens[i] - begin[i];
    }
    int64_t span = (total + SPAN_ITEMS - 1) / SPAN_ITEMS;
    if (span < SPAN_MIN) span = SPAN_MIN;
    span = (span + bs - 1) / bs * bs;
    if (span > (1 << 30)) span = 1 << 30;
    /* work items: sequence i's spans first_span[i] .. first_span[i + 1] - 1, each for every head group */
    int *first_span = malloc(sizeof(int) * (size_t)(n + 1));
    if (!first_span) {
        free(starts);
        return -1;
    }
    first_span[0] = 0;
    for (int i = 0; i < n; i++) first_span[i + 1] = first_span[i] + (int)((ctx_lens[i] - begin[i] + span - 1) / span);
    const int64_t spans = first_span[n], items = spans * groups;
    const int64_t part_step = (int64_t)H * d, ml_step = 2 * (int64_t)H; /* floats per item */
    float *part = malloc(sizeof(float) * (size_t)(items * (part_step + ml_step) + 1));
    int *span_seq = malloc(sizeof(int) * (size_t)(spans + 1));
    if (!part || !span_seq) {
        free(first_span);
        free(part);
        free(span_seq);
        free(starts);
        return -1;
    }
    float *ml = part + items * part_step;
    for (int i = 0; i < n; i++)
        for (int sp = first_span[i]; sp < first_span[i + 1]; sp++) span_seq[sp] = i;
    const int hs = quantized(et) ? d + KV_SCALE_BYTES : d, esz = esize(et), bf16 = et == ET_BF16;
    const void *v = (const char *)kv + num_tokens_in_pool * hkv * hs * esz;
    const Job job = {q, kv, v, tables, ctx_lens, starts, out, q_stride, table_stride, hq, hkv, d, hs, bs, scale, softcap};
    void (*fn)(const Job *, int, int, int, int, int, float *, float *) =
        et == ET_BF16 ? (d == 64 ? attend_64_bf16 : d == 128 ? attend_128_bf16 : attend_any_bf16)
        : et == ET_Q8 ? (d == 64 ? attend_64_q8 : d == 128 ? attend_128_q8 : attend_any_q8)
        : et == ET_F8 ? (d == 64 ? attend_64_f8 : d == 128 ? attend_128_f8 : attend_any_f8)
                      : (d == 64 ? attend_64 : d == 128 ? attend_128 : attend_any);
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        /* each thread takes a run of items holding about its share of the tokens, in order, and
         * pulls the first block of its next item into L2 as it starts one: a cold item's first
         * reads (TLB walks, the prefetcher's start) are what kept a thread to ~9 GB/s */
        int tid = 0, team = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        const Spans spans = {first_span, span_seq, begin, span};
        const int64_t total_tokens = total * groups;
        int64_t it = 0, seen = 0, end;
        for (; it < items && seen * team < total_tokens * tid; it++) seen += span_tokens(&job, &spans, it / groups);
        for (end = it; end < items && seen * team < total_tokens * (tid + 1); end++)
            seen += span_tokens(&job, &spans, end / groups);
        for (; it < end; it++) { /* item = span * groups + group */
            const int gi = (int)(it % groups);
            int i, lo, hi;
            span_range(&job, &spans, it / groups, &i, &lo, &hi);
            if (it + 1 < end) prefetch_first_block(&job, &spans, (it + 1) / groups, esz);
            fn(&job, i, lo, hi, gi * per, per, part + it * part_step, ml + it * ml_step);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t w = 0; w < (int64_t)n * groups; w++) { /* merge each sequence's spans, in order */
            const int i = (int)(w / groups), gi = (int)(w % groups);
            const int64_t it0 = (int64_t)first_span[i] * groups + gi;
            merge(&job, i, gi * per, H, part + it0 * part_step, groups * part_step, ml + it0 * ml_step,
                  groups * ml_step, first_span[i + 1] - first_span[i], bf16);
        }
    }
    free(first_span);
    free(part);
    free(span_seq);
    free(starts);
    return 0;
}

int paged_decode_attention_f32(const float *q, int64_t q_stride, const float *kv, int64_t num_tokens_in_pool,
                               const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens,
                               float *out, int n, int hq, int hkv, int d, int bs, float scale, int window,
                               float softcap, int nthreads) {
    return decode_attention(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, ctx_lens, out, n, hq, hkv, d,
                            bs, scale, window, softcap, nthreads, ET_F32);
}

int paged_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kv, int64_t num_tokens_in_pool,
                                const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens,
                                uint16_t *out, int n, int hq, int hkv, int d, int bs, float scale, int window,
                                float softcap, int nthreads) {
    return decode_attention(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, ctx_lens, out, n, hq, hkv, d,
                            bs, scale, window, softcap, nthreads, ET_BF16);
}

/* fp32 queries and output over an int8 pool [2, N, bs, Hkv, D + 4] (kernels/kv_quant.h) */
int paged_decode_attention_q8(const float *q, int64_t q_stride, const int8_t *kv, int64_t num_tokens_in_pool,
                              const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens, float *out, int n,
                              int hq, int hkv, int d, int bs, float scale, int window, float softcap, int nthreads) {
    return decode_attention(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, ctx_lens, out, n, hq, hkv, d,
                            bs, scale, window, softcap, nthreads, ET_Q8);
}

/* fp32 queries and output over an fp8 (e4m3) pool [2, N, bs, Hkv, D + 4], dtype uint8 (kernels/kv_quant.h) */
int paged_decode_attention_f8(const float *q, int64_t q_stride, const uint8_t *kv, int64_t num_tokens_in_pool,
                              const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens, float *out, int n,
                              int hq, int hkv, int d, int bs, float scale, int window, float softcap, int nthreads) {
    return decode_attention(q, q_stride, kv, num_tokens_in_pool, tables, table_stride, ctx_lens, out, n, hq, hkv, d,
                            bs, scale, window, softcap, nthreads, ET_F8);
}
