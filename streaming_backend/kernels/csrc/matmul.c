/* Weight-only quantized matmuls: y [m, n] = x [m, k] . W^T for a W [n, k] stored in 4 or 8 bits.
 *
 * Built with the other kernels into one library by streaming_backend/kernels/build.py and called
 * through ctypes with the tensors' data pointers; the GIL is released for the call. This file is
 * the driver, the same for every ISA: the prologue, the activations' quantization, the split into
 * chunks for the thread team and the order of the sums; the tiles and lanes are the ISA's
 * primitives (isa.h, isa/<name>.h).
 *
 * The activations are quantized first, each row on its own, in blocks of QK = 32 inputs, to
 * about 12 bits: v = round(x / d) with the block's step d = max|x| / V_MAX (2032), so
 * |v| <= 127 * 16, kept as two int8 halves v = 16 * q + r (q in [-127, 127], r in [-8, 7];
 * V_SHIFT = 4); s = d * sum(v). Every block of a weight row then meets every block of an
 * activation row in one exact integer dot product D = l . v = 16 * (l . q) + l . r (|D| < 2^24),
 * and the blocks are summed in float32 one after the other, in the order of k:
 *
 *   int4 ("q4"): w = l * step + low per block of 32 inputs, l in [0, 15], step and low in float16
 *       acc = fma(float(D_b), d_b * step_b, acc) and lows = fma(low_b, s_b, lows) for b = 0, 1, ..
 *       y = acc + lows
 *   int8 ("q8"): w = l * scale, l in [-127, 127], one float32 scale per weight row
 *       acc = fma(float(D_b), d_b, acc) for b = 0, 1, ..;  y = acc * scale
 *
 * (One int8 half alone, as llama.cpp's Q8_0 / Q8_1 activations, flipped the default model's first
 * token on "What is the capital of France?" from "The" to "L": its weights are exact in int4, so
 * the activations' rounding was the whole difference from the unquantized model. 12 bits pass the
 * quality gate as 15 did (docs/design.md); a factor of 16 rather than 128 lets AMX multiply a
 * q4 block's q and r halves in one tile multiply, the weights times 16 still bytes (isa/amx.h).)
 *
 * One model whatever the load: y[r, c] depends on row r of x and row c of W alone, summed as
 * above whatever m, n, the tile a row falls in or the thread that computes it; D is an integer,
 * exact in any order, and every float operation is the same in every build (an explicit fma,
 * products rounded before it, -ffp-contract=off). So a row's numbers are the same alone, in a
 * crowd, decoded or prefilled, on any number of threads, and from the AVX-512, AVX2 and portable
 * builds (tested).
 *
 * Weights lie in tiles of TILE = 16 weight rows, one register's lanes (AVX-512; two on AVX2), so
 * that an activation row's 4 inputs, broadcast, meet 16 weight rows in one instruction and a
 * block's 16 sums come out in lanes, with no horizontal sums: the work per activation row is the
 * dot products alone, and the unpacked weights are shared by every activation row of a call.
 * The weights of a last tile that n does not fill are zeros, their scales too: its padding rows are
 * computed, not written. Row-major, contiguous, tile t = weight rows 16t .. 16t + 15:
 *   q4: packed, block b of tile t at (t * blocks + b) * 256 bytes; byte 64 p + 4 c + j
 *       (p, j in 0..3, c in 0..15) holds input 4p + j of weight row 16t + c in its low nibble and
 *       input 16 + 4p + j in its high one; steps, lows float16 at (t * blocks + b) * 16 + c
 *   q8: int8, block b of tile t at (t * blocks + b) * 512 bytes; byte 64 u + 4 c + j (u in 0..7)
 *       holds input 4u + j of weight row 16t + c; scales [n] float32
 *   dense: weight [n, k] float32 or bfloat16, unquantized: the activations stay float32 and each
 *       y is x . w in 8 lanes of k, one chain, then a fixed tree (`dense_tile`); any k, any n
 *   x [m, k] (silu_mul, gelu_tanh_mul: [m, 2k]), y [m, n], norm [k], bias [n], residual [m, n]: one dtype,
 *   float32 or bfloat16 (codes as common.h)
 *
 * Around the product, so a decoder layer is a few calls (forward/llama.py, native_layer; stack.c):
 *   before it, each row of x can be RMS-normalised (x / rms(x) * norm, in float32, the squares
 *   summed in an order fixed by k) or taken as act(x[:, :k]) * x[:, k:] (an MLP's gate and up;
 *   act silu, or GELU's tanh approximation);
 *   after it, y = product + bias + residual, rounded once to the dtype (residual may be y).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

#define COL_CHUNK 64     /* dense weight rows a thread takes at a time (they stay in its cache) */
/* threads split a call's weight rows in steps of this many (a quantized tile), so 576 rows go
 * 288 / 288 on two threads */
#define SPLIT_ROWS TILE
#define MIN_THREAD_WORK (1 << 16)  /* weight values worth a thread of their own (576 x 576: 2) */

/* One row of x (k float32 values) as k / QK blocks: halves q and r in input order, steps d,
 * d * sum(v) s, 128 * sum(v) sv (the q8 tiles' correction for weights offset by 128). */
static void quantize_row(int8_t *qs, int8_t *rs, float *ds, float *ss, int32_t *svs, const float *x, int64_t k) {
    for (int64_t b = 0; b < k / QK; b++) {
        int32_t sum_v;
        const float d = quantize_block(x + b * QK, qs + b * QK, rs + b * QK, &sum_v);
        ds[b] = d;
        ss[b] = d * (float)sum_v;
        svs[b] = 128 * sum_v;
    }
}

/* silu(g) * u = g * sigmoid(g) * u, sigmoid from exp(-|g|) (exact_attention's exponential). */
static inline float silu_mul(float g, float u) {
    const float e = exp_neg(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u;
}

/* gelu(g) * u with GELU's tanh approximation (Gemma's MLP): 0.5 g (1 + tanh(z)) u,
 * z = sqrt(2 / pi) (g + 0.044715 g^3), tanh(z) = sign(z) (1 - e) / (1 + e), e = exp(-2 |z|). */
static inline float gelu_tanh_mul(float g, float u) {
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = exp_neg(-2.0f * fabsf(z));
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * g * (1.0f + (z >= 0.0f ? t : -t)) * u;
}


/* Row r of what the matmul multiplies (k floats into a), from x by the prologue: the ISA's lanes
 * (isa.h) take the leading inputs they fit, one value at a time the rest, the same values. */
static void prologue_row(float *a, const void *x, int64_t r, int64_t k, int dtype, const Prologue *pre) {
    if (pre->kind == PRE_GELU_TANH_MUL) {  /* scalar: Gemma's MLP, not the hot path of any other */
        const int64_t at = r * 2 * k;
        for (int64_t i = 0; i < k; i++) a[i] = gelu_tanh_mul(load1(x, at + i, dtype), load1(x, at + k + i, dtype));
        return;
    }
    if (pre->kind == PRE_SILU_MUL) {
        const int64_t at = r * 2 * k;
        int64_t i = silu_mul_lanes(a, x, at, k, dtype);
        for (; i < k; i++) a[i] = silu_mul(load1(x, at + i, dtype), load1(x, at + k + i, dtype));
        return;
    }
    const int64_t at = r * k;
    float inverse = 1.0f;
    if (pre->kind == PRE_RMS_NORM) inverse = 1.0f / sqrtf(sum_squares(x, at, k, dtype) / (float)k + pre->eps);
    int64_t i = scale_lanes(a, x, at, k, dtype, inverse, pre->kind == PRE_RMS_NORM ? pre->norm : NULL);
    for (; i < k; i++) {
        const float v = load1(x, at + i, dtype);
        a[i] = pre->kind == PRE_RMS_NORM ? v * inverse * load1(pre->norm, i, dtype) : v;
    }
}

/* y[row, col] = value + bias + residual, rounded once. */
static inline void finish(const Matmul *c, int64_t row, int64_t col, float value) {
    const int64_t at = row * c->n + col;
    if (c->bias != NULL) value += load1(c->bias, col, c->dtype);
    if (c->residual != NULL) value = load1(c->residual, at, c->dtype) + value;
    store1(c->y, at, c->dtype, value);
}

/* Whether the quantized matmuls run their block dots on AMX: want 1 or 0 turns it on (where the
 * build, the CPU and kernel allow) or off, -1 only asks. The sums are the same bits either way. */
int ts_amx(int want) { return amx_use(want); }

/* Weight rows [first, last) against every activation row. Quantized: a tile of TILE weight rows
 * at a time against every ROWS activation rows (the tile is read from memory once, then from the
 * cache), or AMX's columns where the call runs on AMX; dense: a chunk of weight rows at a time
 * against every tile of activation rows. */
static __attribute__((noinline)) void columns(const Matmul *c, int kind, int64_t first, int64_t last) {
    if (kind != KIND_DENSE) {
        if (c->amx) {
            amx_columns(c, kind, first, last);
            return;
        }
        /* the rows in as few groups of at most ROWS as hold them, as even as they go (9: 5 and
         * 4, not 8 and 1): a group of one row is latency-bound, its dot chains one after the
         * other, where a group of several overlaps its rows' chains */
        const int64_t groups = (c->m + ROWS - 1) / ROWS, base = c->m / (groups ? groups : 1);
        const int64_t wider = c->m - base * groups;  /* the first `wider` groups take base + 1 */
        for (int64_t col = first; col < last && !team_taken(c->taken); col += TILE)
            for (int64_t g = 0, row = 0; g < groups; g++) {
                const int R = (int)(base + (g < wider));
                quant_tiles(c, kind, row, R, col);
                row += R;
            }
        return;
    }
    for (int64_t chunk = first; chunk < last && !team_taken(c->taken); chunk += COL_CHUNK) {
        const int64_t end = chunk + COL_CHUNK < last ? chunk + COL_CHUNK : last;
        for (int64_t row = 0; row < c->m; row += ROW_TILE) {
            const int R = c->m - row < ROW_TILE ? (int)(c->m - row) : ROW_TILE;
            for (int64_t col = chunk; col < end; col += 2) {  /* two weight rows share each read of x */
                const int C = end - col < 2 ? 1 : 2;
                switch (R * 2 + C - 1) {  /* constant R and C per call site: unrolled */
                case 9: dense_tile(c, row, 4, col, 2); break;
                case 8: dense_tile(c, row, 4, col, 1); break;
                case 7: dense_tile(c, row, 3, col, 2); break;
                case 6: dense_tile(c, row, 3, col, 1); break;
                case 5: dense_tile(c, row, 2, col, 2); break;
                case 4: dense_tile(c, row, 2, col, 1); break;
                case 3: dense_tile(c, row, 1, col, 2); break;
                default: dense_tile(c, row, 1, col, 1);
                }
            }
        }
    }
}

/* ---- a call on the thread team (team.h) ------------------------------------------------------
 *
 * Two jobs: x's rows through the prologue and quantized (dense: kept as float32) into the team's
 * buffer, a run of rows a chunk; then the weight rows, a run of tiles a chunk, each chunk's sums
 * into the thread's scratch and stored (bias, residual, rounding) by the thread that commits it.
 * The rows job reads x, which a parked worker could read after the caller freed it, so only the
 * decoder stack (whose x is the team's) runs it on the team; a call from outside quantizes its
 * rows on the calling thread alone. */


typedef struct {
    Matmul c;
    int kind;
    const void *x;
    Prologue pre;
    int64_t rows_per_chunk;
} RowsArgs;

typedef struct {
    Matmul c;
    int kind;
    int64_t units, chunks;  /* weight rows in steps of SPLIT_ROWS; the job's chunks */
    int64_t threads;        /* the call's: the chunks' sizes follow from them (chunk_columns) */
} ColumnsArgs;

_Static_assert(sizeof(RowsArgs) <= TEAM_PAYLOAD && sizeof(ColumnsArgs) <= TEAM_PAYLOAD, "a job's arguments");

static int64_t chunk_rows(const RowsArgs *a, int64_t chunk, int64_t *first) {
    *first = chunk * a->rows_per_chunk;
    const int64_t last = *first + a->rows_per_chunk;
    return (last < a->c.m ? last : a->c.m) - *first;
}

/* A quantized chunk's scratch: the prologue row, then its R rows' d, s, sv, q and r. */
static void rows_compute(const void *args, int64_t chunk, void *scratch, const TeamChunk *taken) {
    (void)taken;
    const RowsArgs *a = args;
    const Matmul *c = &a->c;
    int64_t first;
    const int64_t R = chunk_rows(a, chunk, &first), k = c->k, blocks = k / QK;
    float *row = scratch;
    if (a->kind == KIND_DENSE) {
        for (int64_t i = 0; i < R; i++) prologue_row(row + i * k, a->x, first + i, k, c->dtype, &a->pre);
        return;
    }
    float *d = row + k, *s = d + R * blocks;
    int32_t *sv = (int32_t *)(s + R * blocks);
    int8_t *q = (int8_t *)(sv + R * blocks), *r = q + R * k;
    for (int64_t i = 0; i < R; i++) {
        prologue_row(row, a->x, first + i, k, c->dtype, &a->pre);
        quantize_row(q + i * k, r + i * k, d + i * blocks, s + i * blocks, sv + i * blocks, row, k);
    }
}

static void rows_store(const void *args, int64_t chunk, const void *scratch) {
    const RowsArgs *a = args;
    const Matmul *c = &a->c;
    int64_t first;
    const int64_t R = chunk_rows(a, chunk, &first), k = c->k, blocks = k / QK;
    const float *row = scratch;
    if (a->kind == KIND_DENSE) {
        memcpy(c->xf + first * k, row, (size_t)(R * k) * sizeof(float));
        return;
    }
    const float *d = row + k, *s = d + R * blocks;
    const int32_t *sv = (const int32_t *)(s + R * blocks);
    const int8_t *q = (const int8_t *)(sv + R * blocks), *r = q + R * k;
    memcpy(c->xq.d + first * blocks, d, (size_t)(R * blocks) * sizeof(float));
    memcpy(c->xq.s + first * blocks, s, (size_t)(R * blocks) * sizeof(float));
    memcpy(c->xq.sv + first * blocks, sv, (size_t)(R * blocks) * sizeof(int32_t));
    memcpy(c->xq.q + first * k, q, (size_t)(R * k));
    memcpy(c->xq.r + first * k, r, (size_t)(R * k));
    if (c->xq.halves != NULL)
        for (int64_t i = 0; i < R; i++)
            for (int64_t b = 0; b < blocks; b++) {
                int8_t *to = c->xq.halves + (b * c->m + first + i) * HALVES_BYTES;
                memcpy(to, q + i * k + b * QK, QK);
                memcpy(to + QK, r + i * k + b * QK, QK);
            }
}

/* The weight rows go in chunks that shrink as the work does: each takes 1 / threads of the units
 * still left (two threads: a half, a quarter, an eighth, ... down to one unit). The master starts
 * on the first, the workers on the next, and whoever finishes takes the next, smaller one, so the
 * threads end within about the last, smallest chunk of each other, in few chunks (eight for 192
 * units). A chunk's sums stay within CHUNK_SUMS_BYTES of scratch: without that bound a prefill of
 * 512 rows summed half the gate/up columns (3 MB) before storing them, and prefilled at 0.89x.
 * Against four equal chunks a thread (a Xeon without AMX, same bits): the decode step 1.05x as
 * fast at one row and at 16 (kernel_ab), prefills of 128 and 512 tokens and of 8 x 64 tokens
 * 1.03x, 1.06x and 1.05x. A parked worker's chunk is taken over as before (team.c: the grace
 * counts from that chunk's start). */
#define CHUNK_SUMS_BYTES (256 * 1024)  /* at most this scratch a chunk: m x its columns' sums */

static int64_t chunk_units(int64_t left, int64_t threads, int64_t most) {
    const int64_t units = (left + threads - 1) / threads;
    return units < most ? units : most;
}

/* The most units a chunk of m rows takes: its sums within CHUNK_SUMS_BYTES, but never so few
 * that the job passes TEAM_MOST_CHUNKS (at most half of them at the most, the rest for the
 * shrinking tail). */
static int64_t most_units(int64_t m, int64_t units) {
    const int64_t most = CHUNK_SUMS_BYTES / ((m > 0 ? m : 1) * SPLIT_ROWS * (int64_t)sizeof(float));
    const int64_t fewest = (units + TEAM_MOST_CHUNKS / 2 - 1) / (TEAM_MOST_CHUNKS / 2);
    return most > fewest ? most : fewest > 1 ? fewest : 1;
}

static int64_t chunks_of(int64_t units, int64_t threads, int64_t most) {
    int64_t count = 0;
    for (int64_t left = units; left > 0; count++) left -= chunk_units(left, threads, most);
    return count;
}

/* A chunk's weight rows [first, last). */
static void chunk_columns(const ColumnsArgs *a, int64_t chunk, int64_t *first, int64_t *last) {
    const int64_t most = most_units(a->c.m, a->units);
    int64_t start = 0, size = chunk_units(a->units, a->threads, most);
    for (int64_t i = 0; i < chunk; i++) {
        start += size;
        size = chunk_units(a->units - start, a->threads, most);
    }
    *first = start * SPLIT_ROWS;
    const int64_t end = (start + size) * SPLIT_ROWS;
    *last = end < a->c.n ? end : a->c.n;  /* a quantized tile may pass n */
}

static void columns_compute(const void *args, int64_t chunk, void *scratch, const TeamChunk *taken) {
    const ColumnsArgs *a = args;
    Matmul c = a->c;
    int64_t first, last;
    chunk_columns(a, chunk, &first, &last);
    c.out = scratch;
    c.out_col0 = first;
    c.out_cols = last - first;
    c.taken = taken;
    columns(&c, a->kind, first, last);
}

/* finish for a float32 y's run of `count` columns from col of one row (sums: their products),
 * in one loop the compiler unswitches and puts in lanes: finish's additions in finish's order. */
static void finish_f32(const Matmul *c, int64_t row, int64_t col, int64_t count, const float *sums) {
    float *y = (float *)c->y + row * c->n + col;
    const float *bias = c->bias != NULL ? (const float *)c->bias + col : NULL;
    const float *residual = c->residual != NULL ? (const float *)c->residual + row * c->n + col : NULL;
    for (int64_t i = 0; i < count; i++) {
        float value = sums[i];
        if (bias != NULL) value += bias[i];
        if (residual != NULL) value = residual[i] + value;
        y[i] = value;
    }
}

static void columns_store(const void *args, int64_t chunk, const void *scratch) {
    const ColumnsArgs *a = args;
    const float *sums = scratch;
    int64_t first, last;
    chunk_columns(a, chunk, &first, &last);
    for (int64_t r = 0; r < a->c.m; r++) {
        const float *row = sums + r * (last - first);
        if (a->c.dtype == TS_F32) {
            finish_f32(&a->c, r, first, last - first, row);
            continue;
        }
        for (int64_t col = first; col < last; col++) finish(&a->c, r, col, row[col - first]);
    }
}

/* x's rows through the prologue and quantized (dense: kept as float32), then every y[r, c], on
 * the call's threads; fewer where the weight is small. x_owned: x is the team's (see above). */
int matmul_on_team(TeamCall *call, Matmul *c, int kind, const void *x, int x_owned, const Prologue *pre) {
    const int64_t blocks = c->k / QK;
    const int dense = kind == KIND_DENSE;
    if (c->m < 0 || c->n < 1 || c->k < (dense ? 1 : QK) || (!dense && c->k % QK) ||
        (c->dtype != TS_F32 && c->dtype != TS_BF16) || pre->kind < PRE_NONE || pre->kind > PRE_GELU_TANH_MUL ||
        (pre->kind == PRE_RMS_NORM && pre->norm == NULL) ||
        (dense && c->w_dtype != TS_F32 && c->w_dtype != TS_BF16))
        return TS_BAD_ARGS;
    if (c->m == 0) return TS_OK;
    c->amx = !dense && c->m >= AMX_MIN_ROWS && amx_use(-1);
    /* one buffer: the steps, sums and integer sums, then both halves; dense: the float rows */
    const size_t bytes = dense ? (size_t)(c->m * c->k) * sizeof(float)
                               : (c->amx ? 4 : 2) * (size_t)(c->m * c->k) + 3 * (size_t)(c->m * blocks) * sizeof(float);
    char *memory = team_buffer(call, BUF_X, bytes);
    if (memory == NULL) return TS_NO_MEMORY;
    if (dense) {
        c->xf = (float *)memory;
    } else {
        c->xq.d = (float *)memory;
        c->xq.s = c->xq.d + c->m * blocks;
        c->xq.sv = (int32_t *)(c->xq.s + c->m * blocks);
        c->xq.q = (int8_t *)(c->xq.sv + c->m * blocks);
        c->xq.r = c->xq.q + c->m * c->k;
        c->xq.halves = c->amx ? c->xq.r + c->m * c->k : NULL;
    }
    const int64_t work = c->n * c->k * (c->m < ROW_TILE ? 1 : c->m / ROW_TILE);
    int64_t most = work / MIN_THREAD_WORK, units = (c->n + SPLIT_ROWS - 1) / SPLIT_ROWS;
    if (most > units) most = units;
    const int64_t threads = most < team_threads(call) ? (most > 1 ? most : 1) : team_threads(call);

    TeamJob job = {.compute = rows_compute, .store = rows_store};
    RowsArgs rows = {.c = *c, .kind = kind, .x = x, .pre = *pre};
    const int64_t row_chunks = c->m < 2 * threads ? c->m : 2 * threads;
    rows.rows_per_chunk = (c->m + row_chunks - 1) / row_chunks;
    job.chunks = (c->m + rows.rows_per_chunk - 1) / rows.rows_per_chunk;
    job.alone = !x_owned || threads < 2;
    job.scratch_bytes = (size_t)c->k * sizeof(float) +
                        (size_t)rows.rows_per_chunk * (dense ? (size_t)c->k * sizeof(float)
                                                             : 2 * (size_t)c->k + 3 * (size_t)blocks * sizeof(float));
    memcpy(job.args, &rows, sizeof rows);
    int status = team_run(call, &job);
    if (status != TS_OK) return status;

    ColumnsArgs cols = {.c = *c, .kind = kind, .units = units, .threads = threads};
    cols.chunks = chunks_of(units, threads, most_units(c->m, units));
    job.compute = columns_compute;
    job.store = columns_store;
    job.chunks = cols.chunks;
    job.alone = threads < 2;
    const int64_t first_units = chunk_units(units, threads, most_units(c->m, units));  /* the largest */
    job.scratch_bytes = (size_t)c->m * (size_t)(first_units * SPLIT_ROWS) * sizeof(float);
    memcpy(job.args, &cols, sizeof cols);
    return team_run(call, &job);
}

/* A call from outside: the team held for it. */
static int matmul_call(Matmul *c, int kind, const void *x, const Prologue *pre, int threads) {
    if (threads < 1) return TS_BAD_ARGS;
    TeamCall *call = team_enter(threads);
    const int status = matmul_on_team(call, c, kind, x, 0, pre);
    team_leave(call);
    return status;
}

/* y = x . W^T for an int4 W (layout at the top), with the prologue and bias, residual around it.
 * Returns TS_OK, or TS_BAD_ARGS / TS_NO_MEMORY with nothing written. */
int ts_q4_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const uint8_t *packed,
                 const uint16_t *steps, const uint16_t *lows, int prologue, const void *norm, float eps,
                 const void *bias, const void *residual, int threads) {
    Matmul c = {.m = m, .k = k, .n = n, .w = packed, .steps = steps, .lows = lows, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul_call(&c, KIND_Q4, x, &pre, threads);
}

/* y = x . W^T for an int8 W with one scale per row, likewise. */
int ts_q8_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const int8_t *weight,
                 const float *scales, int prologue, const void *norm, float eps, const void *bias,
                 const void *residual, int threads) {
    Matmul c = {.m = m, .k = k, .n = n, .w = (const uint8_t *)weight, .scales = scales, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul_call(&c, KIND_Q8, x, &pre, threads);
}

/* y = x . W^T for a float32 or bfloat16 W [n, k] (w_dtype), likewise; any k. */
int ts_dense_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const void *weight,
                    int w_dtype, int prologue, const void *norm, float eps, const void *bias,
                    const void *residual, int threads) {
    Matmul c = {.m = m, .k = k, .n = n, .wf = weight, .w_dtype = w_dtype, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul_call(&c, KIND_DENSE, x, &pre, threads);
}
