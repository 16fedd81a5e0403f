/* Paged decode attention for the CPU: one query token per sequence, KV read in place from the
 * paged pool (no gather), online softmax one block at a time.
 *
 * Built by kernels/cpu_native.py with gcc at first use and loaded with ctypes (no torch
 * headers, so it compiles in about a second). fp32 only.
 *
 * Layout (one layer of the pool, contiguous): kv [2, N, bs, Hkv, D]; K rows at kv, V rows at
 * kv + N*bs*Hkv*D. A work item is one sequence and some of its KV heads (all of them unless the
 * batch is too small to feed every thread, or the query heads over MAX_H): each token's row is
 * read once, as one stretch, for all the query heads of the item (GQA: G = Hq/Hkv per KV head).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#define MAX_H 32   /* query heads in one work item */
#define MAX_D 256
#define MAX_BS 64
#define MAX_THREADS 64

typedef struct {
    const float *q;            /* [n, Hq, D] */
    const float *k;            /* [N*bs, Hkv, D] token rows */
    const float *v;            /* [N*bs, Hkv, D] token rows */
    const int32_t *tables;     /* [n, table_stride] block ids */
    const int32_t *ctx_lens;   /* [n] tokens to attend, this step's included */
    float *out;                /* [n, Hq, D] */
    int64_t table_stride;
    int hq, hkv, d, bs;
    int heads_per_item;        /* KV heads in one work item: all of them, or fewer to split a small batch */
    float scale;
    int begin, end;            /* work items [begin, end) */
} Job;

/* One work item: sequence i, KV heads [h0, h0 + nh) and their G query heads each. Token rows
 * are read once for all those heads (one contiguous stretch of nh*D floats per token). */
static void attend(const Job *j, int i, int h0, int nh) {
    const int G = j->hq / j->hkv, D = j->d, bs = j->bs, H = nh * G; /* H query heads here */
    const int ctx = j->ctx_lens[i];
    const int64_t row = (int64_t)j->hkv * D; /* floats from one token's row to the next */
    const int32_t *table = j->tables + (int64_t)i * j->table_stride;
    float qs[MAX_H * MAX_D], acc[MAX_H * MAX_D], s[MAX_H * MAX_BS], m[MAX_H], l[MAX_H];

    const float *qh = j->q + ((int64_t)i * j->hq + (int64_t)h0 * G) * D; /* [H, D] */
    for (int x = 0; x < H * D; x++) {
        qs[x] = qh[x] * j->scale;
        acc[x] = 0.0f;
    }
    for (int g = 0; g < H; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int t0 = 0; t0 < ctx; t0 += bs) {
        const int nt = ctx - t0 < bs ? ctx - t0 : bs;
        const int64_t base = (int64_t)table[t0 / bs] * bs * row + (int64_t)h0 * D;
        const float *kb = j->k + base, *vb = j->v + base;
        for (int t = 0; t < nt; t++) { /* scores s[g, t] = q_g . k_t (q head g reads KV head g / G) */
            const float *kt = kb + t * row;
            for (int g = 0; g < H; g++) {
                const float *qg = qs + g * D, *kr = kt + (g / G) * D;
                float dot = 0.0f;
                for (int c = 0; c < D; c++) dot += qg[c] * kr[c];
                s[g * bs + t] = dot;
            }
        }
        for (int g = 0; g < H; g++) { /* online softmax: rescale what came before */
            float *sg = s + g * bs;
            float mx = m[g];
            for (int t = 0; t < nt; t++) mx = sg[t] > mx ? sg[t] : mx;
            const float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
            float sum = 0.0f;
            for (int t = 0; t < nt; t++) {
                sg[t] = expf(sg[t] - mx);
                sum += sg[t];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mx;
            float *ag = acc + g * D;
            for (int c = 0; c < D; c++) ag[c] *= corr;
        }
        for (int t = 0; t < nt; t++) { /* acc[g] += p[g, t] * v_t */
            const float *vt = vb + t * row;
            for (int g = 0; g < H; g++) {
                const float p = s[g * bs + t], *vr = vt + (g / G) * D;
                float *ag = acc + g * D;
                for (int c = 0; c < D; c++) ag[c] += p * vr[c];
            }
        }
    }
    float *oh = j->out + ((int64_t)i * j->hq + (int64_t)h0 * G) * D; /* [H, D] */
    for (int g = 0; g < H; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int c = 0; c < D; c++) oh[g * D + c] = acc[g * D + c] * inv;
    }
}

static void *run_job(void *arg) {
    const Job *j = (const Job *)arg;
    const int per_seq = j->hkv / j->heads_per_item;
    for (int item = j->begin; item < j->end; item++)
        attend(j, item / per_seq, (item % per_seq) * j->heads_per_item, j->heads_per_item);
    return 0;
}

/* Returns 0, or -1 when a shape is over this kernel's limits (the caller falls back). */
int paged_decode_attention_f32(const float *q, const float *kv, int64_t num_tokens_in_pool,
                               const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens,
                               float *out, int n, int hq, int hkv, int d, int bs, float scale,
                               int nthreads) {
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > MAX_H || d > MAX_D || bs > MAX_BS) return -1;
    /* as many KV heads per item as fit, fewer when the batch alone cannot feed every thread */
    int per = hkv;
    while (per > 1 && (per * (hq / hkv) > MAX_H || (int64_t)n * (hkv / per) < nthreads || hkv % per))
        per--;
    Job proto = {q, kv, kv + num_tokens_in_pool * hkv * d, tables, ctx_lens, out,
                 table_stride, hq, hkv, d, bs, per, scale, 0, 0};
    const int items = n * (hkv / per);
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > items) nthreads = items;
    if (nthreads <= 1) {
        proto.end = items;
        run_job(&proto);
        return 0;
    }
    Job jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started = 0;
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = proto;
        jobs[t].begin = (int)((int64_t)items * t / nthreads);
        jobs[t].end = (int)((int64_t)items * (t + 1) / nthreads);
    }
    for (int t = 1; t < nthreads; t++) { /* thread 0's share runs here */
        if (pthread_create(&threads[t], 0, run_job, &jobs[t]) != 0) break;
        started = t;
    }
    run_job(&jobs[0]);
    for (int t = started + 1; t < nthreads; t++) run_job(&jobs[t]); /* any that failed to start */
    for (int t = 1; t <= started; t++) pthread_join(threads[t], 0);
    return 0;
}
