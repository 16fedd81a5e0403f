/* Paged decode attention for the CPU: one query token per sequence, KV read in place from the
 * paged pool (no gather), online softmax one block at a time.
 *
 * Built by kernels/cpu_native.py with the machine's C compiler at first use and loaded with
 * ctypes (no torch headers, so it compiles in about a second). fp32 only; head_dim a multiple
 * of 8. Vector code is GCC/Clang vector extensions (8 floats), so it builds on any target and
 * -march=native picks the instructions.
 *
 * Threads: OpenMP. The library is linked against libgomp by soname, and torch has already
 * loaded its own libgomp.so.1 when this loads, so both share one runtime and one thread pool:
 * no threads of ours competing with torch's on the same cores, and no thread start per call.
 *
 * Layout (one layer of the pool, contiguous): kv [2, N, bs, Hkv, D]; K rows at kv, V rows at
 * kv + N*bs*Hkv*D. A work item is one sequence and some of its KV heads (all of them unless the
 * batch is too small to feed every thread, or the query heads over MAX_H): each block of token
 * rows is read once, while hot, for all the query heads of the item (GQA: G = Hq/Hkv per KV
 * head). Each head's arithmetic is the same whichever item or thread it falls to, so results
 * do not depend on the thread count.
 *
 * Memory: K and V rows are read in token order, and engine/block_pool.py keeps a sequence's
 * blocks contiguous, so the hardware prefetcher streams them. Software prefetching was measured
 * and dropped: it helps only a pool scattered block by block and costs the contiguous one more.
 */
#include <math.h>
#include <stdint.h>

#define MAX_H 32   /* query heads in one work item */
#define MAX_D 256
#define MAX_BS 64

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* for loads and stores at any float address */

static inline v8 load8(const float *p) { return *(const v8u *)p; }
static inline void store8(float *p, v8 x) { *(v8u *)p = x; }
static inline float hsum8(v8 a) {
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += a[k];
    return s;
}

typedef struct {
    const float *q;            /* [n, Hq, D], rows q_stride floats apart */
    const float *k;            /* [N*bs, Hkv, D] token rows */
    const float *v;            /* [N*bs, Hkv, D] token rows */
    const int32_t *tables;     /* [n, table_stride] block ids */
    const int32_t *ctx_lens;   /* [n] tokens to attend, this step's included */
    float *out;                /* [n, Hq, D] */
    int64_t q_stride, table_stride;
    int hq, hkv, d, bs;
    float scale;
} Job;

/* One work item: sequence i, KV heads [h0, h0 + nh) and their G query heads each. D is a
 * compile-time constant in the specialised copies below, so the vector loops unroll and the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const Job *j, int i, int h0, int nh, const int D) {
    const int G = j->hq / j->hkv, bs = j->bs, H = nh * G; /* H query heads here */
    const int ctx = j->ctx_lens[i];
    const int64_t row = (int64_t)j->hkv * D; /* floats from one token's row to the next */
    const int32_t *table = j->tables + (int64_t)i * j->table_stride;
    float qs[MAX_H * MAX_D] __attribute__((aligned(32))), acc[MAX_H * MAX_D] __attribute__((aligned(32)));
    float s[MAX_H * MAX_BS], m[MAX_H], l[MAX_H], corr[MAX_H];

    const float *qh = j->q + (int64_t)i * j->q_stride + (int64_t)h0 * G * D; /* [H, D] */
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
        for (int t = 0; t < nt; t++) { /* scores s[g, t] = q_g . k_t for the G query heads of each KV head */
            const float *kt = kb + t * row;
            for (int h = 0; h < nh; h++) {
                v8 k8[MAX_D / 8]; /* the KV head's row, loaded once for its G query heads */
                for (int c = 0; c < D / 8; c++) k8[c] = load8(kt + h * D + 8 * c);
                for (int g = h * G; g < (h + 1) * G; g++) {
                    const float *qg = qs + g * D;
                    v8 a = {0}, b = {0}; /* two dependency chains */
                    int c = 0;
                    for (; c + 1 < D / 8; c += 2) {
                        a += load8(qg + 8 * c) * k8[c];
                        b += load8(qg + 8 * c + 8) * k8[c + 1];
                    }
                    if (c < D / 8) a += load8(qg + 8 * c) * k8[c];
                    s[g * bs + t] = hsum8(a + b);
                }
            }
        }
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
            const float *vt = vb + t * row;
            for (int g = 0; g < H; g++) {
                const float p = s[g * bs + t], *vr = vt + (g / G) * D;
                float *ag = acc + g * D;
                for (int c = 0; c < D / 8; c++) store8(ag + 8 * c, load8(ag + 8 * c) + p * load8(vr + 8 * c));
            }
        }
    }
    float *oh = j->out + ((int64_t)i * j->hq + (int64_t)h0 * G) * D; /* [H, D] */
    for (int g = 0; g < H; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int c = 0; c < D; c++) oh[g * D + c] = acc[g * D + c] * inv;
    }
}

static void attend_64(const Job *j, int i, int h0, int nh) { attend(j, i, h0, nh, 64); }
static void attend_128(const Job *j, int i, int h0, int nh) { attend(j, i, h0, nh, 128); }
static void attend_any(const Job *j, int i, int h0, int nh) { attend(j, i, h0, nh, j->d); }

/* Returns 0, or -1 when a shape is over this kernel's limits (the caller falls back). */
int paged_decode_attention_f32(const float *q, int64_t q_stride, const float *kv, int64_t num_tokens_in_pool,
                               const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens,
                               float *out, int n, int hq, int hkv, int d, int bs, float scale,
                               int nthreads) {
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > MAX_H || d > MAX_D || d % 8 || bs > MAX_BS) return -1;
    /* as many KV heads per item as fit, fewer when the batch alone cannot feed every thread */
    int per = hkv;
    while (per > 1 && (per * (hq / hkv) > MAX_H || (int64_t)n * (hkv / per) < nthreads || hkv % per))
        per--;
    const Job job = {q, kv, kv + num_tokens_in_pool * hkv * d, tables, ctx_lens, out, q_stride, table_stride,
                     hq, hkv, d, bs, scale};
    void (*fn)(const Job *, int, int, int) = d == 64 ? attend_64 : d == 128 ? attend_128 : attend_any;
    const int per_seq = hkv / per, items = n * per_seq;
    if (nthreads > items) nthreads = items;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (nthreads > 1)
    for (int item = 0; item < items; item++)
        fn(&job, item / per_seq, (item % per_seq) * per, per);
    return 0;
}
