/* A decode step's whole decoder stack in one call, for small batches on the CPU.
 *
 * A bench-model decode step at batch 1 made ten calls a layer through nn.Module, ctypes and
 * torch.empty (norm, qkv, rope + KV store, attention, o_proj, add + norm, gate_up, silu * up,
 * down, the residual add); its C kernels took 4.6-5.1 ms of a 7.0-7.5 ms step (each call timed,
 * which adds to the step). Without them in Python the step is 0.3-1.9 ms shorter (bench-engine
 * A/B, docs/benchmarks/engine.md). This driver makes
 * the same calls, in the same order, on the same kernels, from C: it holds no arithmetic of its
 * own beyond the residual add, so its output is bit for bit the per-op path's (tests check).
 *
 * The kernels are not linked in: the caller passes the addresses of the functions already loaded
 * from their own libraries (kernels/decode_layers.py), so there is one copy of each.
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*rmsnorm_fn)(const float *x, int64_t ldx, const float *w, float *out, int64_t rows, int64_t n,
                          float eps, int nthreads);
typedef int (*add_rmsnorm_fn)(const float *x, const float *delta, int64_t ldd, const float *w, float *sum,
                              float *out, int64_t rows, int64_t n, float eps, int nthreads);
typedef int (*silu_mul_fn)(const float *gate_up, int64_t ld, float *out, int64_t rows, int64_t n, int nthreads);
typedef int (*rope_store_fn)(const float *qkv, int64_t ldq, const float *cos, const float *sin, float *q_out,
                             float *k_out, float *kv, int64_t slots, const int64_t *slot, int64_t rows, int hq,
                             int hkv, int d, int nthreads);
typedef int (*attention_fn)(const float *q, int64_t q_stride, const float *kv, int64_t num_tokens_in_pool,
                            const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens, float *out,
                            int n, int hq, int hkv, int d, int bs, float scale, int window, float softcap,
                            int nthreads);
typedef int (*gemm_fn)(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t m,
                       int64_t in, int64_t out, int nthreads);

typedef struct {  /* the kernels, loaded by their own modules */
    rmsnorm_fn rmsnorm;
    add_rmsnorm_fn add_rmsnorm;
    silu_mul_fn silu_mul;
    rope_store_fn rope_store;
    attention_fn attention;
    gemm_fn gemm;
} kernel_table;

typedef struct {  /* one decoder layer, as laid out after loading */
    const float *input_norm, *post_attention_norm;  /* [H] */
    const float *qkv, *qkv_bias;                    /* panels [P, H, 16]; bias [(hq + 2 hkv) d] or NULL */
    const float *o, *gate_up, *down;                /* panels */
    float *kv;                                      /* this layer's pool [2, slots, hkv, d] */
} layer_weights;

typedef struct {  /* the model's shapes */
    int64_t hidden, intermediate;
    int32_t hq, hkv, d, block_size;
    float eps, scale;
} stack_shape;

enum { OK = 0, SLOT_PAST_POOL = -1, ATTENTION_REFUSED = -2 };

/* Floats of scratch decode_layers_f32 needs for m rows (m times that of one). */
int64_t decode_layers_work_floats(const stack_shape *s, int64_t m) {
    const int64_t qkv = (int64_t)(s->hq + 2 * s->hkv) * s->d, q = (int64_t)s->hq * s->d;
    return m * (3 * s->hidden + qkv + q + (int64_t)s->hkv * s->d + q + 3 * s->intermediate);
}

/* x_in [m, H] (the embeddings) -> x_out [m, H] after all layers; each layer's K, V stored at
 * slot [m] (int64). cos, sin [m, d]; tables [m, W] int32 (table_stride apart); ctx_lens [m]
 * int32. Returns OK, SLOT_PAST_POOL (nothing written at that layer) or ATTENTION_REFUSED (the
 * attention kernel refused the shapes; the caller runs the per-op path, which stores the same
 * K, V again). */
int decode_layers_f32(const kernel_table *k, const layer_weights *layers, int num_layers, const stack_shape *s,
                      const float *x_in, float *x_out, int64_t m, const float *cos, const float *sin,
                      const int64_t *slot, int64_t slots, const int32_t *tables, int64_t table_stride,
                      const int32_t *ctx_lens, float *work, int nthreads) {
    const int64_t H = s->hidden, I = s->intermediate, d = s->d;
    const int64_t qkv_w = (s->hq + 2 * s->hkv) * d, q_w = s->hq * d;
    float *h = work, *sum = h + m * H, *o = sum + m * H;              /* [m, H] each */
    float *qkv = o + m * H, *q = qkv + m * qkv_w, *kr = q + m * q_w;  /* [m, qkv_w], [m, hq d], [m, hkv d] */
    float *attn = kr + m * s->hkv * d, *gate_up = attn + m * q_w;     /* [m, hq d], [m, 2 I] */
    float *act = gate_up + m * 2 * I, *dn = o;                        /* [m, I]; down reuses o */
    const float *x = x_in;
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *w = &layers[l];
        k->rmsnorm(x, H, w->input_norm, h, m, H, s->eps, nthreads);
        k->gemm(h, H, w->qkv, w->qkv_bias, qkv, m, H, qkv_w, nthreads);
        if (k->rope_store(qkv, qkv_w, cos, sin, q, kr, w->kv, slots, slot, m, s->hq, s->hkv, s->d, nthreads))
            return SLOT_PAST_POOL;
        if (k->attention(q, q_w, w->kv, slots, tables, table_stride, ctx_lens, attn, (int)m, s->hq, s->hkv, s->d,
                         s->block_size, s->scale, 0, 0.0f, nthreads)) /* full attention: no window, no softcap */
            return ATTENTION_REFUSED;
        k->gemm(attn, q_w, w->o, NULL, o, m, q_w, H, nthreads);
        k->add_rmsnorm(x, o, H, w->post_attention_norm, sum, h, m, H, s->eps, nthreads);  /* sum = x + o */
        k->gemm(h, H, w->gate_up, NULL, gate_up, m, H, 2 * I, nthreads);
        k->silu_mul(gate_up, 2 * I, act, m, I, nthreads);
        k->gemm(act, I, w->down, NULL, dn, m, I, H, nthreads);
        for (int64_t i = 0; i < m * H; i++) x_out[i] = sum[i] + dn[i];  /* the residual add */
        x = x_out;
    }
    return OK;
}
