/* Exact attention over a slot KV cache: every token attends over exactly its own positions.
 *
 * Built with the other kernels into one library by streaming_backend/kernels/build.py and called
 * through ctypes with the tensors' data pointers (kernels/attention.py); the GIL is released for
 * the call. This file is the same for every ISA; the lanes are the ISA's primitives (isa.h).
 *
 * A token's result is computed by one thread, in an order fixed by its own position alone
 * (never by how many tokens share the call, nor by their positions): so a row's numbers are the
 * same alone or in a crowd, and a decode step gives the same bits as a prefill of that token.
 * The exponential is one polynomial, the same in the vector loop and its scalar tail, so where
 * the tail falls does not change a value either. The AVX-512 build takes two key rows, or 16
 * values of a head, a register where the AVX2 build takes one or 8 (its own dot4_heads and
 * weighted_heads): every lane adds what an AVX2 lane adds, in its order, so both builds give the
 * same bits (tested).
 *
 * Shapes (elements, row-major, contiguous):
 *   q     [n, kv_heads, groups, head_dim]  the queries, rotated; query heads sharing a K/V head
 *   k, v  [places, kv_heads, rows, head_dim]  one layer's cache: position p in row p mod rows
 *         (a sliding-window layer's ring; full attention: rows cover every position)
 *   out   [n, kv_heads, groups, head_dim]  = [n, heads * head_dim]
 *   places, positions  [n] int64: each token's slot in the cache and its position there
 * A token attends over min(position + 1, window) positions, which must fit in the rows. Where
 * they wrap around the ring's end they are read in two pieces, in position order; a token's
 * pieces depend on its position alone, so its numbers still do not depend on the call.
 * dtype: 0 float32, 1 bfloat16 (q, k, v and out alike; sums in float32).
 * A score is q . k times `scale`; with `cap` > 0 it is then soft-capped, cap * tanh(score / cap)
 * (Gemma 2), before the softmax.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "isa.h"
#include "team.h"

/* scores[j] = q . k_j for the count key rows from k_at; returns their maximum. Which way a
 * score is summed depends on j and count alone. */
static float scores_of(float *scores, const float *q, const void *k, int64_t k_at, int64_t count,
                       int64_t d, int dtype) {
    float max = -INFINITY;
    int64_t j = scores_lanes(scores, q, k, k_at, count, d, dtype, &max);
    for (; j < count; j++) {
        scores[j] = dot(q, k, k_at + j * d, d, dtype);
        max = scores[j] > max ? scores[j] : max;
    }
    return max;
}

/* out[i] = sum over j < count of p[j] * v_j[i], j ascending, one fused multiply-add at a time
 * whatever the width that computes element i (so every element is summed the same way); with
 * `more`, the sum goes on from out[i] (a ring's second piece continues the first's). */
static void weighted_sum(float *out, const float *p, const void *v, int64_t v_at, int64_t count,
                         int64_t d, int dtype, int more) {
    int64_t i = weighted_lanes(out, p, v, v_at, count, d, dtype, more);
    for (; i < d; i++) {
        float a = more ? out[i] : 0.0f;
        for (int64_t j = 0; j < count; j++) a = fmaf(p[j], load1(v, v_at + j * d + i, dtype), a);
        out[i] = a;
    }
}

/* p[i] = exp(p[i] - max) for i < count; returns their sum, in an order fixed by count alone. */
static float softmax_numerators(float *p, int64_t count, float max) {
    float sum = 0.0f;
    int64_t i = softmax_lanes(p, count, max, &sum);
    for (; i < count; i++) {
        p[i] = exp_neg(p[i] - max);
        sum += p[i];
    }
    return sum;
}

typedef struct {
    int dtype, q_dtype, out_dtype;  /* of the cache; of q; of out */
    const void *q, *k, *v;
    void *out;
    const int64_t *places, *positions;
    int64_t kv_heads, groups, head_dim, rows, window;
    float scale, cap;
    int64_t place_count, limit;  /* the cache's places; positions below limit */
} Call;

/* The count scores soft-capped in place, cap * tanh(score / cap); returns their new maximum. */
static float soft_cap(float *scores, int64_t count, float cap) {
    float max = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
        scores[j] = cap * tanhf(scores[j] / cap);
        max = scores[j] > max ? scores[j] : max;
    }
    return max;
}

/* The scores of query heads g .. g + G - 1 (G <= HEADS_AT_ONCE) over the n key rows from `at`,
 * into their score rows from `offset`, each head's maximum folded into max[g + i]: the G heads
 * together where the build and head_dim allow (scores_heads), else one by one (scores_of); the
 * same scores either way. */
static void scores_group(const Call *c, float *scores, const float *query, int64_t g, int G, int64_t at, int64_t n,
                         int64_t offset, float *max) {
    const int64_t d = c->head_dim;
    float *p = scores + g * c->rows + offset;
    const float *q = query + g * d;
    if (scores_together(p, c->rows, q, G, c->k, at, n, d, c->dtype, max + g)) return;
    for (int i = 0; i < G; i++) {
        const float m = scores_of(p + i * c->rows, q + i * d, c->k, at, n, d, c->dtype);
        max[g + i] = m > max[g + i] ? m : max[g + i];
    }
}

/* Their values over the same rows, weighted by the score rows from `offset`, into acc (going on
 * from what it holds when `more`): together (weighted_heads) or one by one (weighted_sum), the
 * same sums either way. */
static void values_group(const Call *c, float *acc, const float *scores, int64_t g, int G, int64_t at, int64_t n,
                         int64_t offset, int more) {
    const int64_t d = c->head_dim;
    const float *p = scores + g * c->rows + offset;
    float *out = acc + g * d;
    if (values_together(out, p, c->rows, G, c->v, at, n, d, c->dtype, more)) return;
    for (int i = 0; i < G; i++) weighted_sum(out + i * d, p + i * c->rows, c->v, at, n, d, c->dtype, more);
}

/* One (token, key/value head): its query heads g_first .. g_last - 1 (of `groups`) over positions
 * [first, position], up to HEADS_AT_ONCE of them reading each key and value row together, into
 * result (float32, as out is laid out, from out's element `result_at`). work: groups * (rows + 2
 * * head_dim) floats of this thread's own. The positions lie in rows [first mod rows, ...): up to
 * the ring's end, then (if they wrap) on from row 0. A query head's result is computed alone, the
 * same whichever heads share the call. A place or position the call could not have (a parked
 * worker reading the team's buffer after its call: team.h) computes nothing. */
static void attend_one(const Call *c, int64_t token, int64_t head, int64_t g_first, int64_t g_last, float *work,
                       float *result, int64_t result_at) {
    const int64_t d = c->head_dim, groups = c->groups, position = c->positions[token], place = c->places[token];
    if (place < 0 || place >= c->place_count || position < 0 || position >= c->limit ||
        (position + 1 < c->window ? position + 1 : c->window) > c->rows)
        return;
    const int64_t first = position + 1 > c->window ? position + 1 - c->window : 0;
    const int64_t count = position + 1 - first, start = first % c->rows;
    const int64_t head_at = (place * c->kv_heads + head) * c->rows * d;
    const int64_t before_end = count < c->rows - start ? count : c->rows - start, wrapped = count - before_end;
    const int64_t q_at = (token * c->kv_heads + head) * groups * d;
    /* the pieces: rows from the start to the ring's end, then those wrapped to its beginning */
    const int64_t piece_at[2] = {head_at + start * d, head_at}, piece_rows[2] = {before_end, wrapped};
    float *scores = work, *query = work + groups * c->rows, *acc = query + groups * d;
    float inverse[groups], max[groups];
    for (int64_t i = g_first * d; i < g_last * d; i++) query[i] = load1(c->q, q_at + i, c->q_dtype) * c->scale;
    for (int64_t g = g_first; g < g_last; g++) max[g] = -INFINITY;
    for (int64_t g = g_first; g < g_last; g += HEADS_AT_ONCE) {
        const int G = g_last - g < HEADS_AT_ONCE ? (int)(g_last - g) : HEADS_AT_ONCE;
        for (int piece = 0; piece < 2 && piece_rows[piece] > 0; piece++)
            scores_group(c, scores, query, g, G, piece_at[piece], piece_rows[piece], piece ? before_end : 0, max);
    }
    for (int64_t g = g_first; g < g_last; g++) {
        float *p = scores + g * c->rows;
        if (c->cap > 0.0f) max[g] = soft_cap(p, count, c->cap);
        inverse[g] = 1.0f / softmax_numerators(p, count, max[g]);
    }
    for (int64_t g = g_first; g < g_last; g += HEADS_AT_ONCE) {
        const int G = g_last - g < HEADS_AT_ONCE ? (int)(g_last - g) : HEADS_AT_ONCE;
        for (int piece = 0; piece < 2 && piece_rows[piece] > 0; piece++)
            values_group(c, acc, scores, g, G, piece_at[piece], piece_rows[piece], piece ? before_end : 0, piece);
    }
    for (int64_t g = g_first; g < g_last; g++)
        for (int64_t i = g * d; i < (g + 1) * d; i++) result[q_at + i - result_at] = acc[i] * inverse[g];
}

/* Every (token, key/value head, query head) of c on the call's threads, a contiguous run of
 * them a chunk, as even as whole query heads allow (a lone stream's 9 query heads over 3
 * key/value heads go 5 / 4 on 2 chunks); a chunk's query heads of one key/value head are
 * computed together (attend_one), into the thread's scratch, then stored into out. */
typedef struct {
    Call c;
    int64_t items, chunks;
} AttendArgs;

_Static_assert(sizeof(AttendArgs) <= TEAM_PAYLOAD, "a job's arguments");

static int64_t per_thread(const Call *c) { return c->groups * (c->rows + 2 * c->head_dim); }

static void attend_compute(const void *args, int64_t chunk, void *scratch, const TeamChunk *taken) {
    const AttendArgs *a = args;
    const Call *c = &a->c;
    const int64_t first = a->items * chunk / a->chunks, last = a->items * (chunk + 1) / a->chunks;
    float *work = scratch, *result = work + per_thread(c);
    for (int64_t item = first; item < last && !team_taken(taken);) {
        const int64_t pair = item / c->groups, g = item % c->groups;  /* (token, kv head), query head */
        const int64_t g_last = c->groups < g + (last - item) ? c->groups : g + (last - item);
        attend_one(c, pair / c->kv_heads, pair % c->kv_heads, g, g_last, work, result, first * c->head_dim);
        item += g_last - g;
    }
}

static void attend_store(const void *args, int64_t chunk, const void *scratch) {
    const AttendArgs *a = args;
    const Call *c = &a->c;
    const int64_t d = c->head_dim, first = a->items * chunk / a->chunks, last = a->items * (chunk + 1) / a->chunks;
    const float *result = (const float *)scratch + per_thread(c);
    for (int64_t i = first * d; i < last * d; i++) store1(c->out, i, c->out_dtype, result[i - first * d]);
}

#define ATTEND_CHUNKS_PER_THREAD 4

static int attend_all(TeamCall *call, const Call *c, int64_t n) {
    AttendArgs a = {.c = *c, .items = n * c->kv_heads * c->groups};
    if (a.items == 0) return TS_OK;
    const int64_t most = ATTEND_CHUNKS_PER_THREAD * (int64_t)team_threads(call);
    a.chunks = team_threads(call) < 2 ? 1 : a.items < most ? a.items : most;
    TeamJob job = {.chunks = a.chunks, .compute = attend_compute, .store = attend_store};
    job.scratch_bytes = (size_t)(per_thread(c) + (a.items + a.chunks - 1) / a.chunks * c->head_dim) * sizeof(float);
    memcpy(job.args, &a, sizeof a);
    return team_run(call, &job);
}

/* A position past `limit`, a place below 0, or more positions attended than the rows hold. */
static int bad_positions(const int64_t *places, const int64_t *positions, int64_t n, int64_t limit,
                         int64_t rows, int64_t window) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t attended = positions[t] + 1 < window ? positions[t] + 1 : window;
        if (positions[t] < 0 || positions[t] >= limit || places[t] < 0 || attended > rows) return 1;
    }
    return 0;
}

/* Attention of n tokens (see the top of this file). Returns TS_OK, or TS_BAD_ARGS /
 * TS_NO_MEMORY with nothing written. */
int ts_exact_attention(int dtype, const void *q, const void *k, const void *v, void *out,
                       const int64_t *places, const int64_t *positions, int64_t n, int64_t place_count,
                       int64_t kv_heads, int64_t groups, int64_t head_dim, int64_t rows,
                       int64_t window, float scale, float cap, int threads) {
    if ((dtype != TS_F32 && dtype != TS_BF16) || n < 0 || kv_heads < 1 || groups < 1 ||
        head_dim < 1 || rows < 1 || window < 1 || threads < 1 ||
        bad_positions(places, positions, n, INT64_MAX, rows, window))
        return TS_BAD_ARGS;
    for (int64_t t = 0; t < n; t++)
        if (places[t] >= place_count) return TS_BAD_ARGS;
    TeamCall *call = team_enter(threads);
    const size_t q_bytes = (size_t)(n * kv_heads * groups * head_dim) * (dtype == TS_F32 ? 4 : 2);
    void *q_copy = team_buffer(call, BUF_Q, q_bytes);
    int64_t *placed = team_buffer(call, BUF_PLACES, (size_t)(2 * n) * sizeof(int64_t));
    int status = TS_NO_MEMORY;
    if (q_copy != NULL && placed != NULL) {
        memcpy(q_copy, q, q_bytes);
        memcpy(placed, places, (size_t)n * sizeof(int64_t));
        memcpy(placed + n, positions, (size_t)n * sizeof(int64_t));
        const Call c = {dtype, dtype, dtype, q_copy, k, v, out, placed, placed + n, kv_heads, groups, head_dim,
                        rows, window, scale, cap, place_count, INT64_MAX};
        status = attend_all(call, &c, n);
    }
    team_leave(call);
    return status;
}

/* d float32 values into `to` at to_at, as to_dtype (the cache's bfloat16 rounded as store1 rounds). */
static void put_floats(void *to, int64_t to_at, int to_dtype, const float *values, int64_t d) {
    if (to_dtype == TS_F32) {
        memcpy((float *)to + to_at, values, (size_t)d * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)to + to_at;
    for (int64_t i = 0; i < d; i++) out[i] = f32_to_bf16(values[i]);
}

/* x rotated by RoPE (Hugging Face's rotate_half: the first half pairs with the second) into `to`
 * at to_at, d values; cos and sin rows of the position at cs_at (in x's dtype). In float32,
 * rounded once to to_dtype: x * cos + turned * sin, both products rounded, then their sum. Float32
 * inputs (every forward on this CPU path) in loops the compiler puts in lanes, the same operations
 * on each value; others one value at a time. */
static void rotate(void *to, int64_t to_at, int to_dtype, const void *x, int64_t x_at, const void *cos,
                   const void *sin, int64_t cs_at, int64_t d, int dtype) {
    const int64_t half = d / 2;
    float value[d];
    if (dtype == TS_F32) {
        const float *xs = (const float *)x + x_at, *c = (const float *)cos + cs_at, *s = (const float *)sin + cs_at;
        for (int64_t i = 0; i < half; i++) value[i] = xs[i] * c[i] + -xs[i + half] * s[i];
        for (int64_t i = half; i < d; i++) value[i] = xs[i] * c[i] + xs[i - half] * s[i];
    } else {
        for (int64_t i = 0; i < d; i++) {
            const float partner = load1(x, x_at + (i < half ? i + half : i - half), dtype);
            const float turned = i < half ? -partner : partner;
            value[i] = load1(x, x_at + i, dtype) * load1(cos, cs_at + i, dtype) + turned * load1(sin, cs_at + i, dtype);
        }
    }
    put_floats(to, to_at, to_dtype, value, d);
}

/* One decoder layer's attention from its q/k/v projection: RoPE on each token's query and key
 * heads, every token's key and value written into the cache at (place, position mod rows), then
 * each token's attention over exactly its own positions (so a chunk's tokens see each other).
 * All are written before any attends: in a ring, a call's tokens of one place must span at most
 * rows - window + 1 positions (SlotForward splits longer chunks; forward/slots.py).
 *
 *   qkv   [n, (heads + 2 kv_heads) * head_dim]  the projection: query heads, key heads, value heads
 *   cos, sin  [positions, head_dim]  RoPE tables, the rows indexed by position
 *   out   [n, heads * head_dim]
 * dtype: of qkv, cos, sin and out; cache_dtype: of k and v (the queries stay float32). Returns
 * TS_OK, or TS_BAD_ARGS / TS_NO_MEMORY with nothing written. */
int rope_attention(TeamCall *call, int dtype, int cache_dtype, const void *qkv, const void *cos, const void *sin,
                   int64_t positions_in_table, void *k, void *v, void *out, const int64_t *places,
                   const int64_t *positions, int64_t n, int64_t place_count, int64_t kv_heads, int64_t groups,
                   int64_t head_dim, int64_t rows, int64_t window, float scale, float cap) {
    if ((dtype != TS_F32 && dtype != TS_BF16) || (cache_dtype != TS_F32 && cache_dtype != TS_BF16) || n < 0 ||
        kv_heads < 1 || groups < 1 || head_dim < 2 || head_dim % 2 || rows < 1 || window < 1 ||
        bad_positions(places, positions, n, positions_in_table, rows, window))
        return TS_BAD_ARGS;
    for (int64_t t = 0; t < n; t++)  /* it writes there: a place past the cache is refused */
        if (places[t] >= place_count) return TS_BAD_ARGS;
    const int64_t d = head_dim, heads = kv_heads * groups, width = (heads + 2 * kv_heads) * d;
    /* the rotated queries [n, heads, d], and the places and positions, in the team's buffers */
    float *q = team_buffer(call, BUF_Q, (size_t)(n * heads * d) * sizeof(float));
    int64_t *placed = team_buffer(call, BUF_PLACES, (size_t)(2 * n) * sizeof(int64_t));
    if (q == NULL || placed == NULL) return TS_NO_MEMORY;
    memcpy(placed, places, (size_t)n * sizeof(int64_t));
    memcpy(placed + n, positions, (size_t)n * sizeof(int64_t));
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = t * width, cs_at = positions[t] * d;
        for (int64_t h = 0; h < heads; h++)
            rotate(q, (t * heads + h) * d, TS_F32, qkv, at + h * d, cos, sin, cs_at, d, dtype);
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t cache_at = ((places[t] * kv_heads + h) * rows + positions[t] % rows) * d;
            rotate(k, cache_at, cache_dtype, qkv, at + (heads + h) * d, cos, sin, cs_at, d, dtype);
            const int64_t v_at = at + (heads + kv_heads + h) * d;
            if (dtype == TS_F32)
                put_floats(v, cache_at, cache_dtype, (const float *)qkv + v_at, d);
            else
                for (int64_t i = 0; i < d; i++) store1(v, cache_at + i, cache_dtype, load1(qkv, v_at + i, dtype));
        }
    }
    const Call c = {cache_dtype, TS_F32, dtype, q, k, v, out, placed, placed + n, kv_heads, groups, head_dim,
                    rows, window, scale, cap, place_count, positions_in_table};
    return attend_all(call, &c, n);
}

int ts_rope_attention(int dtype, int cache_dtype, const void *qkv, const void *cos, const void *sin,
                      int64_t positions_in_table, void *k, void *v, void *out, const int64_t *places,
                      const int64_t *positions, int64_t n, int64_t place_count, int64_t kv_heads, int64_t groups,
                      int64_t head_dim, int64_t rows, int64_t window, float scale, float cap, int threads) {
    if (threads < 1) return TS_BAD_ARGS;
    TeamCall *call = team_enter(threads);
    const int status = rope_attention(call, dtype, cache_dtype, qkv, cos, sin, positions_in_table, k, v, out, places,
                                      positions, n, place_count, kv_heads, groups, head_dim, rows, window, scale, cap);
    team_leave(call);
    return status;
}
