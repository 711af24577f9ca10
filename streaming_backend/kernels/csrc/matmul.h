/* The quantized matmuls' layout and operands (matmul.c has the whole story at its top): what the
 * matmul driver, the decoder stack and each ISA's tiles (isa/) share. */
#ifndef TS_MATMUL_H
#define TS_MATMUL_H

#include <stdint.h>

#include "common.h"
#include "team.h"

#define QK 32            /* inputs per block, of the activations and of the int4 weights */
#define V_SHIFT 4        /* v = (q << V_SHIFT) + r: the bits of the low half r */
#define V_BASE (1 << V_SHIFT)
#define V_MAX (127.0f * V_BASE)  /* the largest |v| of an activation block */
#define TILE 16          /* weight rows of a quantized tile (see the layouts in matmul.c) */
#define Q4_BLOCK_BYTES (TILE * QK / 2)  /* a q4 tile's block: 256 bytes */
#define Q8_BLOCK_BYTES (TILE * QK)      /* a q8 tile's block: 512 bytes */
#define ROW_TILE 4       /* activation rows that share one read of a dense weight row */
#ifndef WEIGHTS_AHEAD
/* how far on in its stream of tiles a quantized tile asks for weights as it reads its own */
#define WEIGHTS_AHEAD 2048
#endif
#define HALVES_BYTES (2 * QK)  /* a block of an activation row in Quantized.halves: q, then r */
#define AMX_ROWS 16     /* activation rows of one AMX tile multiply (isa/amx.h) */
#define AMX_MIN_ROWS 8  /* fewer take the AVX-512 tiles: faster there (kernel_bench, --amx both) */

enum { KIND_Q8 = 0, KIND_Q4 = 1, KIND_DENSE = 2 };  /* the weight formats */

/* The activation rows, quantized: row r's block b is v = 2^V_SHIFT q + r in q[r * k + b * QK ..] and
 * r[...], with step d[r * blocks + b] (x ~ v * d), s[...] = d * sum(v) and sv[...] = 128 * sum(v)
 * (an integer: the AVX-512 q8 tile's correction for its unsigned weights). */
typedef struct {
    int8_t *q, *r;
    float *d, *s;
    int32_t *sv;
    int8_t *halves;  /* AMX calls (Matmul.amx): both halves again, blocks first, HALVES_BYTES a row's
                      * block: row r's block b at halves[(b * m + r) * HALVES_BYTES], its q then its r,
                      * so a tile of rows' block is one contiguous load (isa/amx.h) */
} Quantized;

/* What is done to a row of x before it is quantized. */
enum { PRE_NONE = 0, PRE_RMS_NORM = 1, PRE_SILU_MUL = 2, PRE_GELU_TANH_MUL = 3 };

typedef struct {
    int kind;
    const void *norm;  /* PRE_RMS_NORM: [k] */
    float eps;
} Prologue;

/* A call's operands. */
typedef struct {
    Quantized xq;
    float *xf;              /* dense: the rows after the prologue, [m, k] float32 */
    int64_t m, k, n;
    const void *wf;         /* dense: the float weight [n, k] */
    int w_dtype;            /* dense: its dtype */
    const uint8_t *w;       /* q4: packed nibbles; q8: int8 values */
    const uint16_t *steps;  /* q4 */
    const uint16_t *lows;   /* q4 */
    const float *scales;    /* q8 */
    void *y;
    int dtype;
    const void *bias;      /* [n] or NULL */
    const void *residual;  /* [m, n] or NULL */
    int amx;               /* quantized: the block dots on AMX (ts_amx) */
    /* a chunk's computing thread: its sums go to out[row, col - out_col0] (out_cols a row) */
    float *out;
    int64_t out_col0, out_cols;
    const TeamChunk *taken;  /* whether another thread committed the chunk (stop early) */
} Matmul;

/* A sum of the chunk being computed, into the thread's scratch (store_columns finishes it). */
static inline void emit(const Matmul *c, int64_t row, int64_t col, float value) {
    c->out[row * c->out_cols + (col - c->out_col0)] = value;
}

/* y for the TILE weight rows from col (those below n: a last tile's padding is not written) of
 * one activation row: emit for each of `values` (the tile's sums in weight row order). */
static inline void emit_tile(const Matmul *c, int64_t row, int64_t col, const float *values) {
    const int count = c->n - col < TILE ? (int)(c->n - col) : TILE;
    for (int j = 0; j < count; j++) emit(c, row, col + j, values[j]);
}

/* The 4 bytes at p, as one int32 (to be broadcast to every lane). */
static inline int32_t four(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x's rows through the prologue and quantized (dense: kept as float32), then every y[r, c], on
 * the call's threads (matmul.c); x_owned: x is the team's. The decoder stack's linears. */
int matmul_on_team(TeamCall *call, Matmul *c, int kind, const void *x, int x_owned, const Prologue *pre)
    __attribute__((visibility("hidden")));

#endif
