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
 * A layer with q/k norm (Qwen3) normalises each head of q and k after the qkv linear, in place,
 * with the same RMSNorm kernel the per-op path calls on those rows.
 *
 * A linear is fp32 panels (the panel GEMM) or weight-only quantized row segments (the group-wise
 * quantized GEMM, or the block kernel on a GGUF file's blocks as stored; one call a segment, as models/quantized_linear.py makes them: one segment's bias added by
 * the kernel, several segments' after they are put side by side).
 *
 * The kernels are not linked in: the caller passes the addresses of the functions already loaded
 * from their own libraries (kernels/decode_layers.py), so there is one copy of each. The KV pool
 * is opaque here: an int8 pool (--kv-cache-dtype int8) gets the int8 store and attention entries
 * (rope_store_q8, paged_decode_attention_q8) in the same slots, with the same arguments, and an
 * fp8 pool (--kv-cache-dtype fp8, e4m3 rows) the fp8 ones (rope_store_f8, paged_decode_attention_f8).
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*rmsnorm_fn)(const float *x, int64_t ldx, const float *w, float *out, int64_t rows, int64_t n,
                          float eps, int nthreads);
typedef int (*add_rmsnorm_fn)(const float *x, const float *delta, int64_t ldd, const float *w, float *sum,
                              float *out, int64_t rows, int64_t n, float eps, int nthreads);
typedef int (*silu_mul_fn)(const float *gate_up, int64_t ld, float *out, int64_t rows, int64_t n, int nthreads);
typedef int (*rope_store_fn)(const float *qkv, int64_t ldq, const float *cos, const float *sin, float *q_out,
                             float *k_out, void *kv, int64_t slots, const int64_t *slot, int64_t rows, int hq,
                             int hkv, int d, int nthreads);
typedef int (*attention_fn)(const float *q, int64_t q_stride, const void *kv, int64_t num_tokens_in_pool,
                            const int32_t *tables, int64_t table_stride, const int32_t *ctx_lens, float *out,
                            int n, int hq, int hkv, int d, int bs, float scale, int window, float softcap,
                            int nthreads);
typedef int (*gemm_fn)(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t m,
                       int64_t in, int64_t out, int nthreads);
typedef int (*quant_gemm_fn)(const float *x, int64_t ldx, const uint8_t *q, const float *scales,
                             const float *offsets, const float *bias, float *y, int64_t m, int64_t in, int64_t out,
                             int bits, int sg, int nthreads);

typedef int (*block_gemm_fn)(const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y, int64_t m,
                             int64_t in, int64_t out, int type, int nthreads);

typedef struct {  /* the kernels, loaded by their own modules */
    rmsnorm_fn rmsnorm;
    add_rmsnorm_fn add_rmsnorm;
    silu_mul_fn silu_mul;
    rope_store_fn rope_store;
    attention_fn attention;
    gemm_fn gemm;
    quant_gemm_fn quant_gemm;       /* NULL when no layer has a quantized linear */
    quant_gemm_fn quant_gemm_int8x; /* the same, x quantized to int8 first (cpu_quant_dot.c); or NULL */
    block_gemm_fn block_gemm;       /* a GGUF file's blocks as stored (cpu_block_dot.c); or NULL */
} kernel_table;

typedef struct {  /* rows [out0, out0 + out) of a quantized linear, in one format */
    const uint8_t *q;              /* group-wise quants, or (qtype set) a GGUF file's blocks */
    const float *scales, *offsets; /* offsets NULL: symmetric */
    int64_t out0, out;
    int32_t bits, sg;
    int32_t qtype;                 /* ggml's type id of blocks as stored; 0: group-wise */
} quant_segment;

typedef struct {  /* a linear: fp32 panels [P, in, 16], or quantized row segments */
    const float *panels;            /* NULL: quantized */
    const float *bias;              /* [out] or NULL */
    const quant_segment *segments;  /* quantized: num_segments of them, in output order */
    int32_t num_segments;
    int32_t int8_activations;       /* quantized: through quant_gemm_int8x */
} linear_desc;

typedef struct {  /* one decoder layer, as laid out after loading */
    const float *input_norm, *post_attention_norm;  /* [H] */
    linear_desc qkv, o, gate_up, down;              /* qkv's bias [(hq + 2 hkv) d] or NULL */
    void *kv;                                       /* this layer's pool [2, slots, hkv, d] fp32 (or d + 4 int8 / e4m3) */
    const float *q_norm, *k_norm;                   /* [d] each (Qwen3's per-head RMSNorm), or NULL */
} layer_weights;

typedef struct {  /* the model's shapes */
    int64_t hidden, intermediate;
    int32_t hq, hkv, d, block_size;
    float eps, scale;
} stack_shape;

enum { OK = 0, SLOT_PAST_POOL = -1, ATTENTION_REFUSED = -2, LINEAR_REFUSED = -3 };

/* Floats of scratch decode_layers_f32 needs for m rows (m times that of one): the activations,
 * then one linear's output for segments put side by side. */
int64_t decode_layers_work_floats(const stack_shape *s, int64_t m) {
    const int64_t qkv = (int64_t)(s->hq + 2 * s->hkv) * s->d, q = (int64_t)s->hq * s->d;
    int64_t widest = qkv > 2 * s->intermediate ? qkv : 2 * s->intermediate;
    if (widest < s->hidden) widest = s->hidden;
    return m * (3 * s->hidden + qkv + q + (int64_t)s->hkv * s->d + q + 3 * s->intermediate + widest);
}

/* one segment's rows: y [m, g->out] (+ bias, may be NULL) */
static int segment(const kernel_table *k, const linear_desc *w, const quant_segment *g, const float *x, int64_t ldx,
                   const float *bias, float *y, int64_t m, int64_t in, int nthreads) {
    if (g->qtype) {
        if (!k->block_gemm) return LINEAR_REFUSED;
        return k->block_gemm(x, ldx, g->q, bias, y, m, in, g->out, g->qtype, nthreads);
    }
    const quant_gemm_fn quant_gemm = w->int8_activations ? k->quant_gemm_int8x : k->quant_gemm;
    if (!quant_gemm) return LINEAR_REFUSED;
    return quant_gemm(x, ldx, g->q, g->scales, g->offsets, bias, y, m, in, g->out, g->bits, g->sg, nthreads);
}

/* y [m, out] = x [m, in] (ldx apart) through linear `w`; seg_y: scratch of m * out floats */
static int linear(const kernel_table *k, const linear_desc *w, const float *x, int64_t ldx, float *y, int64_t m,
                  int64_t in, int64_t out, float *seg_y, int nthreads) {
    if (w->panels) return k->gemm(x, ldx, w->panels, w->bias, y, m, in, out, nthreads);
    if (w->num_segments == 1) return segment(k, w, &w->segments[0], x, ldx, w->bias, y, m, in, nthreads);
    for (int32_t i = 0; i < w->num_segments; i++) {
        const quant_segment *g = &w->segments[i];
        int rc = segment(k, w, g, x, ldx, NULL, seg_y, m, in, nthreads);
        if (rc) return rc;
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < g->out; c++) y[r * out + g->out0 + c] = seg_y[r * g->out + c];
    }
    if (w->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < out; c++) y[r * out + c] += w->bias[c];
    return 0;
}

/* x_in [m, H] (the embeddings) -> x_out [m, H] after all layers; each layer's K, V stored at
 * slot [m] (int64). cos, sin [m, d]; tables [m, W] int32 (table_stride apart); ctx_lens [m]
 * int32. Returns OK, SLOT_PAST_POOL (nothing written at that layer) or ATTENTION_REFUSED (the
 * attention kernel refused the shapes; the caller runs the per-op path, which stores the same
 * K, V again) or LINEAR_REFUSED (a quantized GEMM refused its arguments: likewise). */
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
    float *seg_y = act + m * I;                                       /* one linear's segments */
    const float *x = x_in;
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *w = &layers[l];
        k->rmsnorm(x, H, w->input_norm, h, m, H, s->eps, nthreads);
        if (linear(k, &w->qkv, h, H, qkv, m, H, qkv_w, seg_y, nthreads)) return LINEAR_REFUSED;
        if (w->q_norm && w->k_norm) /* each q and k head normalised before RoPE (models/qk_norm.py), in place */
            for (int64_t r = 0; r < m; r++) {
                float *row = qkv + r * qkv_w;
                k->rmsnorm(row, d, w->q_norm, row, s->hq, d, s->eps, 1);
                k->rmsnorm(row + q_w, d, w->k_norm, row + q_w, s->hkv, d, s->eps, 1);
            }
        if (k->rope_store(qkv, qkv_w, cos, sin, q, kr, w->kv, slots, slot, m, s->hq, s->hkv, s->d, nthreads))
            return SLOT_PAST_POOL;
        if (k->attention(q, q_w, w->kv, slots, tables, table_stride, ctx_lens, attn, (int)m, s->hq, s->hkv, s->d,
                         s->block_size, s->scale, 0, 0.0f, nthreads)) /* full attention: no window, no softcap */
            return ATTENTION_REFUSED;
        if (linear(k, &w->o, attn, q_w, o, m, q_w, H, seg_y, nthreads)) return LINEAR_REFUSED;
        k->add_rmsnorm(x, o, H, w->post_attention_norm, sum, h, m, H, s->eps, nthreads);  /* sum = x + o */
        if (linear(k, &w->gate_up, h, H, gate_up, m, H, 2 * I, seg_y, nthreads)) return LINEAR_REFUSED;
        k->silu_mul(gate_up, 2 * I, act, m, I, nthreads);
        if (linear(k, &w->down, act, I, dn, m, I, H, seg_y, nthreads)) return LINEAR_REFUSED;
        for (int64_t i = 0; i < m * H; i++) x_out[i] = sum[i] + dn[i];  /* the residual add */
        x = x_out;
    }
    return OK;
}
