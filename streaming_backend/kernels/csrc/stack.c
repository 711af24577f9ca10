/* A stack of decoder layers in one call.
 *
 * llama.native_layer's five calls for every layer, one layer after the other, on n tokens, for
 * the layers it runs with nothing between its calls (no head norms, post norms or experts). The
 * same functions in the same order as the five calls from Python, so the same bits; what goes is
 * the Python and ctypes between them (about 1 ms of a 6 ms step of the default model). Built with
 * the other kernels into one library (streaming_backend/kernels/build.py; kernels/stack.py binds
 * it). */
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "matmul.h"
#include "team.h"

/* A quantized linear weight [n, k] (kind KIND_Q4 or KIND_Q8, as ts_q4_matmul / ts_q8_matmul take
 * it) and its float32 bias or NULL. */
typedef struct {
    int64_t kind, n, k;
    const void *w, *steps, *lows, *scales, *bias;
} StackLinear;

/* One layer: its float32 norms, weights, RoPE tables (float32 [table_positions, head_dim]) and
 * sliding window. Its cache goes beside it, per call (k_caches, v_caches, cache_rows). */
typedef struct {
    const void *norm1, *norm2, *cos, *sin;
    int64_t table_positions, window;
    StackLinear qkv, o, gate_up, down;
} StackLayer;

static int stack_linear(TeamCall *call, const StackLinear *l, const float *x, float *y, int64_t m, int prologue,
                        const void *norm, float eps, const float *residual) {
    if (l->kind != KIND_Q4 && l->kind != KIND_Q8) return TS_BAD_ARGS;
    Matmul c = {.m = m, .k = l->k, .n = l->n, .w = l->w, .steps = l->steps, .lows = l->lows, .scales = l->scales,
              .y = y, .dtype = TS_F32, .bias = l->bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul_on_team(call, &c, (int)l->kind, x, 1, &pre);
}

/* x [n, hidden] float32 through `count` layers, in place. activation: PRE_SILU_MUL or
 * PRE_GELU_TANH_MUL (the MLP's); places, positions: each token's (as ts_rope_attention takes
 * them); k_caches, v_caches [count]: each layer's cache [place_count, kv_heads, cache_rows[i],
 * head_dim] in cache_dtype. Returns TS_OK, or the first failing call's status (x then holds
 * part of the way). The layers run on the team's copy of x and its buffers (team.h: what a
 * parked worker may read), x written back at the end. */
int ts_decoder_stack(const StackLayer *layers, int64_t count, float *x, int64_t n, int64_t hidden,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int activation, float eps, float scale,
                     float cap, int cache_dtype, void *const *k_caches, void *const *v_caches,
                     const int64_t *cache_rows, int64_t place_count, const int64_t *places,
                     const int64_t *positions, int threads) {
    if (count < 0 || n < 0 || hidden < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || threads < 1 ||
        (activation != PRE_SILU_MUL && activation != PRE_GELU_TANH_MUL))
        return TS_BAD_ARGS;
    if (n == 0 || count == 0) return TS_OK;
    int64_t widest = 0;  /* of q/k/v, the attention's output and gate/up */
    for (int64_t i = 0; i < count; i++) {
        const StackLayer *l = &layers[i];
        if (l->qkv.k != hidden || l->o.n != hidden || l->gate_up.k != hidden || l->down.n != hidden ||
            l->qkv.n != (heads + 2 * kv_heads) * head_dim || l->o.k != heads * head_dim ||
            l->gate_up.n != 2 * l->down.k)
            return TS_BAD_ARGS;
        const int64_t wide = l->qkv.n > l->gate_up.n ? l->qkv.n : l->gate_up.n;
        widest = wide > widest ? wide : widest;
    }
    TeamCall *call = team_enter(threads);
    float *h = team_buffer(call, BUF_HIDDEN, (size_t)(n * hidden) * sizeof(float));
    float *work = team_buffer(call, BUF_WORK, (size_t)(n * (widest + heads * head_dim)) * sizeof(float));
    if (h == NULL || work == NULL) {
        team_leave(call);
        return TS_NO_MEMORY;
    }
    memcpy(h, x, (size_t)(n * hidden) * sizeof(float));
    float *wide = work, *attended = work + n * widest;  /* [n, qkv or gate/up], [n, heads * d] */
    int status = TS_OK;
    for (int64_t i = 0; i < count && status == TS_OK; i++) {
        const StackLayer *l = &layers[i];
        status = stack_linear(call, &l->qkv, h, wide, n, PRE_RMS_NORM, l->norm1, eps, NULL);
        if (status == TS_OK)
            status = rope_attention(call, TS_F32, cache_dtype, wide, l->cos, l->sin, l->table_positions, k_caches[i],
                                    v_caches[i], attended, places, positions, n, place_count, kv_heads,
                                    heads / kv_heads, head_dim, cache_rows[i], l->window, scale, cap);
        if (status == TS_OK) status = stack_linear(call, &l->o, attended, h, n, PRE_NONE, NULL, 0.0f, h);
        if (status == TS_OK) status = stack_linear(call, &l->gate_up, h, wide, n, PRE_RMS_NORM, l->norm2, eps, NULL);
        if (status == TS_OK) status = stack_linear(call, &l->down, wide, h, n, activation, NULL, 0.0f, h);
    }
    memcpy(x, h, (size_t)(n * hidden) * sizeof(float));
    team_leave(call);
    return status;
}
