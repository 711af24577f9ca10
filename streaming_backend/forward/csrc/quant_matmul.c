/* Weight-only quantized matmuls: y [m, n] = x [m, k] . W^T for a W [n, k] stored in 4 or 8 bits.
 *
 * Built with exact_attention.c into one library by streaming_backend/forward/native.py and called
 * through ctypes with the tensors' data pointers; the GIL is released for the call.
 *
 * The activations are quantized first, each row on its own, in blocks of QK = 32 inputs, to
 * about 15 bits: v = round(x / d) with the block's step d = max|x| / 16256, so |v| <= 127 * 128,
 * kept as two int8 halves v = 128 * q + r (q in [-127, 127], r in [-64, 63]); s = d * sum(v).
 * Every block of a weight row then meets every block of an activation row in one exact integer
 * dot product D = l . v = 128 * (l . q) + l . r (|D| < 2^27), and the blocks are summed in
 * float32 one after the other, in the order of k:
 *
 *   int4 ("q4"): w = l * step + low per block of 32 inputs, l in [0, 15], step and low in float16
 *       acc = fma(float(D_b), d_b * step_b, acc) and lows = fma(low_b, s_b, lows) for b = 0, 1, ..
 *       y = acc + lows
 *   int8 ("q8"): w = l * scale, l in [-127, 127], one float32 scale per weight row
 *       acc = fma(float(D_b), d_b, acc) for b = 0, 1, ..;  y = acc * scale
 *
 * (One int8 half alone, as llama.cpp's Q8_0 / Q8_1 activations, flipped the default model's first
 * token on "What is the capital of France?" from "The" to "L": its weights are exact in int4, so
 * the activations' rounding was the whole difference from the unquantized model.)
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
 * Around the product, so a decoder layer is a few calls (forward/llama.py, native_layer):
 *   before it, each row of x can be RMS-normalised (x / rms(x) * norm, in float32, the squares
 *   summed in an order fixed by k) or taken as act(x[:, :k]) * x[:, k:] (an MLP's gate and up;
 *   act silu, or GELU's tanh approximation);
 *   after it, y = product + bias + residual, rounded once to the dtype (residual may be y).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "team.h"

#define QK 32            /* inputs per block, of the activations and of the int4 weights */
#define V_MAX 16256.0f   /* 127 * 128: the largest |v| of an activation block */
#define TILE 16          /* weight rows of a quantized tile (see the layouts above) */
#define Q4_BLOCK_BYTES (TILE * QK / 2)  /* a q4 tile's block: 256 bytes */
#define Q8_BLOCK_BYTES (TILE * QK)      /* a q8 tile's block: 512 bytes */
#define ROW_TILE 4       /* activation rows that share one read of a dense weight row */
#define COL_CHUNK 64     /* dense weight rows a thread takes at a time (they stay in its cache) */
/* threads split a call's weight rows in steps of this many (a quantized tile), so 576 rows go
 * 288 / 288 on two threads */
#define SPLIT_ROWS TILE
#ifndef WEIGHTS_AHEAD
/* how far on in its stream of tiles a quantized tile asks for weights as it reads its own */
#define WEIGHTS_AHEAD 2048
#endif
#define MIN_THREAD_WORK (1 << 16)  /* weight values worth a thread of their own (576 x 576: 2) */

enum { KIND_Q8 = 0, KIND_Q4 = 1, KIND_DENSE = 2 };  /* the weight formats */

/* The activation rows, quantized: row r's block b is v = 128 * q + r in q[r * k + b * QK ..] and
 * r[...], with step d[r * blocks + b] (x ~ v * d), s[...] = d * sum(v) and sv[...] = 128 * sum(v)
 * (an integer: the AVX-512 q8 tile's correction for its unsigned weights). */
typedef struct {
    int8_t *q, *r;
    float *d, *s;
    int32_t *sv;
} Quantized;

static inline float half_to_float(uint16_t h) {
#ifdef TS_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        exp = 113u;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* One row of x (k float32 values) as k / QK blocks: halves q and r in input order, steps d,
 * d * sum(v) s, 128 * sum(v) sv. */
static void quantize_row(int8_t *qs, int8_t *rs, float *ds, float *ss, int32_t *svs, const float *x, int64_t k) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *at = x + b * QK;
#ifdef TS_AVX2
        __m256 v[4];
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(at + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max = _mm_cvtss_f32(m4);
        const float d = max / V_MAX, id = max > 0.0f ? V_MAX / max : 0.0f;
        __m256i high[4], low[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i value = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            sum = _mm256_add_epi32(sum, value);  /* exact in int32 */
            high[i] = _mm256_srai_epi32(_mm256_add_epi32(value, _mm256_set1_epi32(64)), 7);
            low[i] = _mm256_sub_epi32(value, _mm256_slli_epi32(high[i], 7));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* packs interleave the 128-bit lanes; the permutation puts the 32 values back in order */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(high[0], high[1]), _mm256_packs_epi32(high[2], high[3]));
        const __m256i r8 = _mm256_packs_epi16(_mm256_packs_epi32(low[0], low[1]), _mm256_packs_epi32(low[2], low[3]));
        _mm256_storeu_si256((__m256i *)(qs + b * QK), _mm256_permutevar8x32_epi32(q8, order));
        _mm256_storeu_si256((__m256i *)(rs + b * QK), _mm256_permutevar8x32_epi32(r8, order));
        const int32_t sum_v = _mm_cvtsi128_si32(s4);
#else
        float max = 0.0f;
        for (int i = 0; i < QK; i++) max = fabsf(at[i]) > max ? fabsf(at[i]) : max;
        const float d = max / V_MAX, id = max > 0.0f ? V_MAX / max : 0.0f;
        int32_t sum_v = 0;
        for (int i = 0; i < QK; i++) {
            const int value = (int)nearbyintf(at[i] * id);
            const int high = (value + 64) >> 7;  /* floor: an arithmetic shift, as srai */
            qs[b * QK + i] = (int8_t)high;
            rs[b * QK + i] = (int8_t)(value - high * 128);
            sum_v += value;
        }
#endif
        ds[b] = d;
        ss[b] = d * (float)sum_v;
        svs[b] = 128 * sum_v;
    }
}

/* What is done to a row of x before it is quantized. */
enum { PRE_NONE = 0, PRE_RMS_NORM = 1, PRE_SILU_MUL = 2, PRE_GELU_TANH_MUL = 3 };

typedef struct {
    int kind;
    const void *norm;  /* PRE_RMS_NORM: [k] */
    float eps;
} Prologue;

/* sum of x[i]^2 over k values (k % 8 == 0 on the AVX2 path), in an order fixed by k. */
static float sum_squares(const void *x, int64_t at, int64_t k, int dtype) {
#ifdef TS_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        const __m256 v = load8(x, at + i, dtype);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return hsum8(acc);
#else
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum = fmaf(load1(x, at + i, dtype), load1(x, at + i, dtype), sum);
    return sum;
#endif
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

/* Row r of what the matmul multiplies (k floats into a), from x by the prologue. */
static void prologue_row(float *a, const void *x, int64_t r, int64_t k, int dtype, const Prologue *pre) {
    if (pre->kind == PRE_GELU_TANH_MUL) {  /* scalar: Gemma's MLP, not the hot path of any other */
        const int64_t at = r * 2 * k;
        for (int64_t i = 0; i < k; i++) a[i] = gelu_tanh_mul(load1(x, at + i, dtype), load1(x, at + k + i, dtype));
        return;
    }
    if (pre->kind == PRE_SILU_MUL) {
        const int64_t at = r * 2 * k;
        int64_t i = 0;
#ifdef TS_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= k; i += 8) {
            const __m256 g = load8(x, at + i, dtype), u = load8(x, at + k + i, dtype);
            const __m256 e = exp_neg8(_mm256_or_ps(g, sign));  /* exp(-|g|) */
            const __m256 positive = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
            const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
        }
#endif
        for (; i < k; i++) a[i] = silu_mul(load1(x, at + i, dtype), load1(x, at + k + i, dtype));
        return;
    }
    const int64_t at = r * k;
    float inverse = 1.0f;
    if (pre->kind == PRE_RMS_NORM) inverse = 1.0f / sqrtf(sum_squares(x, at, k, dtype) / (float)k + pre->eps);
    int64_t i = 0;
#ifdef TS_AVX2
    const __m256 by = _mm256_set1_ps(inverse);
    for (; i + 8 <= k; i += 8) {
        __m256 v = load8(x, at + i, dtype);
        if (pre->kind == PRE_RMS_NORM) v = _mm256_mul_ps(_mm256_mul_ps(v, by), load8(pre->norm, i, dtype));
        _mm256_storeu_ps(a + i, v);
    }
#endif
    for (; i < k; i++) {
        const float v = load1(x, at + i, dtype);
        a[i] = pre->kind == PRE_RMS_NORM ? v * inverse * load1(pre->norm, i, dtype) : v;
    }
}

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
} Call;

/* A sum of the chunk being computed, into the thread's scratch (store_columns finishes it). */
static inline void emit(const Call *c, int64_t row, int64_t col, float value) {
    c->out[row * c->out_cols + (col - c->out_col0)] = value;
}

/* y[row, col] = value + bias + residual, rounded once. */
static inline void finish(const Call *c, int64_t row, int64_t col, float value) {
    const int64_t at = row * c->n + col;
    if (c->bias != NULL) value += load1(c->bias, col, c->dtype);
    if (c->residual != NULL) value = load1(c->residual, at, c->dtype) + value;
    store1(c->y, at, c->dtype, value);
}

/* y for the TILE weight rows from col (those below n: a last tile's padding is not written) of
 * one activation row: emit for each of `values` (the tile's sums in weight row order). */
static inline void emit_tile(const Call *c, int64_t row, int64_t col, const float *values) {
    const int count = c->n - col < TILE ? (int)(c->n - col) : TILE;
    for (int j = 0; j < count; j++) emit(c, row, col + j, values[j]);
}

/* ---- the quantized tiles: R activation rows against TILE weight rows ---------------------------
 *
 * Each build defines q4_tile and q8_tile (the same sums, see the top) and ROWS, the most
 * activation rows a tile takes (its accumulators must fit the registers). */

/* The 4 bytes at p, as one int32 (to be broadcast to every lane). */
static inline int32_t four(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#ifdef TS_AVX512
#define ROWS 8

/* Ask for the line at p into L1 (prefetches change no value). always_inline: gcc drops the calls
 * of a function of prefetches alone, which has no effect it sees (tested). */
static inline __attribute__((always_inline)) void ask(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

/* y for R activation rows from row and the tile at col: q4's sums (acc + lows), q8's (acc times
 * the weight rows' scales). */
static inline __attribute__((always_inline)) void emit_q4_rows(const Call *c, int64_t row, int R, int64_t col,
                                                               const __m512 *acc, const __m512 *low) {
    for (int r = 0; r < R; r++) {
        float values[TILE];
        _mm512_storeu_ps(values, _mm512_add_ps(acc[r], low[r]));
        emit_tile(c, row + r, col, values);
    }
}

static inline __attribute__((always_inline)) void emit_q8_rows(const Call *c, int64_t row, int R, int64_t col,
                                                               const __m512 *acc) {
    const __m512 scales = _mm512_loadu_ps(c->scales + col);
    for (int r = 0; r < R; r++) {
        float values[TILE];
        _mm512_storeu_ps(values, _mm512_mul_ps(acc[r], scales));
        emit_tile(c, row + r, col, values);
    }
}

/* The 16 weight rows' D = l . v of one block (l: 4 registers of low and high nibbles, as the
 * layout pairs them: lo[p] inputs 4p.., hi[p] inputs 16 + 4p..), exact int32 in lanes. */
static inline __m512i q4_dot(const __m512i lo[4], const __m512i hi[4], const int8_t *q, const int8_t *r) {
    /* four short chains (integers: exact in any order) rather than two long ones */
    const __m512i zero = _mm512_setzero_si512();
    __m512i a[4], e[4];
    for (int p = 0; p < 4; p += 2) {
        a[p] = _mm512_dpbusd_epi32(zero, lo[p], _mm512_set1_epi32(four(q + 4 * p)));
        a[p + 1] = _mm512_dpbusd_epi32(zero, hi[p], _mm512_set1_epi32(four(q + 16 + 4 * p)));
        e[p] = _mm512_dpbusd_epi32(zero, lo[p], _mm512_set1_epi32(four(r + 4 * p)));
        e[p + 1] = _mm512_dpbusd_epi32(zero, hi[p], _mm512_set1_epi32(four(r + 16 + 4 * p)));
    }
    for (int p = 0; p < 4; p += 2) {
        a[p] = _mm512_dpbusd_epi32(a[p], lo[p + 1], _mm512_set1_epi32(four(q + 4 * p + 4)));
        a[p + 1] = _mm512_dpbusd_epi32(a[p + 1], hi[p + 1], _mm512_set1_epi32(four(q + 20 + 4 * p)));
        e[p] = _mm512_dpbusd_epi32(e[p], lo[p + 1], _mm512_set1_epi32(four(r + 4 * p + 4)));
        e[p + 1] = _mm512_dpbusd_epi32(e[p + 1], hi[p + 1], _mm512_set1_epi32(four(r + 20 + 4 * p)));
    }
    const __m512i high = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
    const __m512i rest = _mm512_add_epi32(_mm512_add_epi32(e[0], e[1]), _mm512_add_epi32(e[2], e[3]));
    return _mm512_add_epi32(_mm512_slli_epi32(high, 7), rest);  /* 128 * (l . q) + l . r */
}

static inline __attribute__((always_inline)) void q4_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const uint8_t *w = c->w + col * (k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[ROWS], low[ROWS];
    for (int r = 0; r < R; r++) acc[r] = low[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * Q4_BLOCK_BYTES;
        for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
        if (b % 2 == 0) {
            ask(steps + b * TILE + WEIGHTS_AHEAD / 8);
            ask(lows + b * TILE + WEIGHTS_AHEAD / 8);
        }
        __m512i lo[4], hi[4];
        for (int u = 0; u < 4; u++) {
            const __m512i raw = _mm512_loadu_si512(p + 64 * u);
            lo[u] = _mm512_and_si512(raw, nibble);
            hi[u] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + b * TILE)));
        const __m512 low16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lows + b * TILE)));
        for (int r = 0; r < R; r++) {
            const int64_t at = (row + r) * k + b * QK, ds = (row + r) * blocks + b;
            const __m512 dot = _mm512_cvtepi32_ps(q4_dot(lo, hi, c->xq.q + at, c->xq.r + at));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(step, _mm512_set1_ps(c->xq.d[ds])), acc[r]);
            low[r] = _mm512_fmadd_ps(low16, _mm512_set1_ps(c->xq.s[ds]), low[r]);
        }
    }
    emit_q4_rows(c, row, R, col, acc, low);
}

/* q8 with VNNI's unsigned-by-signed products: the weights as l + 128 (unsigned), so each block's
 * dot product comes out 128 * sum(v) too large, taken off exactly (sv). */
static inline __attribute__((always_inline)) void q8_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const int8_t *w = (const int8_t *)c->w + col * k;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *p = w + b * Q8_BLOCK_BYTES;
        for (int line = 0; line < Q8_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
        __m512i u[8];
        for (int i = 0; i < 8; i++) u[i] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * i), flip);
        for (int r = 0; r < R; r++) {
            const int64_t at = (row + r) * k + b * QK, ds = (row + r) * blocks + b;
            const int8_t *q = c->xq.q + at, *rest = c->xq.r + at;
            const __m512i zero = _mm512_setzero_si512();
            __m512i a = zero, e = zero;
            for (int i = 0; i < 8; i += 2) {
                a = _mm512_dpbusd_epi32(a, u[i], _mm512_set1_epi32(four(q + 4 * i)));
                e = _mm512_dpbusd_epi32(e, u[i + 1], _mm512_set1_epi32(four(q + 4 * i + 4)));
            }
            a = _mm512_slli_epi32(_mm512_add_epi32(a, e), 7);
            e = _mm512_sub_epi32(zero, _mm512_set1_epi32(c->xq.sv[ds]));
            for (int i = 0; i < 8; i += 2) {
                a = _mm512_dpbusd_epi32(a, u[i], _mm512_set1_epi32(four(rest + 4 * i)));
                e = _mm512_dpbusd_epi32(e, u[i + 1], _mm512_set1_epi32(four(rest + 4 * i + 4)));
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a, e));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(c->xq.d[ds]), acc[r]);
        }
    }
    emit_q8_rows(c, row, R, col, acc);
}
#elif defined(TS_AVX2)
#define ROWS 2

static inline __attribute__((always_inline)) void ask(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

/* Sum of the int16 pair sums of 8 u8-by-s8 products each (every sum below 2^15 for nibbles
 * against |q| <= 127: 16 * 15 * 127), widened to int32 in 8 lanes: l . q of 8 weight rows. */
static inline __m256i q4_half_dot(const __m256i lo[4], const __m256i hi[4], const int8_t *q) {
    __m256i sum = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(four(q)));
    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(four(q + 16))));
    for (int p = 1; p < 4; p++) {
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(lo[p], _mm256_set1_epi32(four(q + 4 * p))));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi[p], _mm256_set1_epi32(four(q + 16 + 4 * p))));
    }
    return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

/* q4 for 8 weight rows at a time (the tile's halves; the same sums, lane for lane). */
static inline __attribute__((always_inline)) void q4_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    float values[ROWS][TILE];
    for (int half = 0; half < 2; half++) {
        const uint8_t *w = c->w + col * (k / 2) + 32 * half;
        const uint16_t *steps = c->steps + col * blocks + 8 * half, *lows = c->lows + col * blocks + 8 * half;
        __m256 acc[ROWS], low[ROWS];
        for (int r = 0; r < R; r++) acc[r] = low[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *p = w + b * Q4_BLOCK_BYTES;
            if (half == 0)
                for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
            __m256i lo[4], hi[4];
            for (int u = 0; u < 4; u++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 64 * u));
                lo[u] = _mm256_and_si256(raw, nibble);
                hi[u] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
            }
            const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(steps + b * TILE)));
            const __m256 low8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(lows + b * TILE)));
            for (int r = 0; r < R; r++) {
                const int64_t at = (row + r) * k + b * QK, ds = (row + r) * blocks + b;
                const __m256i high = q4_half_dot(lo, hi, c->xq.q + at), rest = q4_half_dot(lo, hi, c->xq.r + at);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(high, 7), rest));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(step, _mm256_set1_ps(c->xq.d[ds])), acc[r]);
                low[r] = _mm256_fmadd_ps(low8, _mm256_set1_ps(c->xq.s[ds]), low[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(values[r] + 8 * half, _mm256_add_ps(acc[r], low[r]));
    }
    for (int r = 0; r < R; r++) emit_tile(c, row + r, col, values[r]);
}

/* l . a of 8 weight rows for one 4-input unit, exact: |l| meets a with l's sign (each pair sum
 * at most 2 * 127 * 127, below 2^15). */
static inline __m256i q8_unit(__m256i l, __m256i magnitude, const int8_t *a) {
    const __m256i signed_a = _mm256_sign_epi8(_mm256_set1_epi32(four(a)), l);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_a), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void q8_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    float values[ROWS][TILE];
    for (int half = 0; half < 2; half++) {
        const int8_t *w = (const int8_t *)c->w + col * k + 32 * half;
        __m256 acc[ROWS];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *p = w + b * Q8_BLOCK_BYTES;
            if (half == 0)
                for (int line = 0; line < Q8_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
            __m256i high[ROWS], rest[ROWS];
            for (int r = 0; r < R; r++) high[r] = rest[r] = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                const __m256i l = _mm256_loadu_si256((const __m256i *)(p + 64 * i));
                const __m256i magnitude = _mm256_sign_epi8(l, l);
                for (int r = 0; r < R; r++) {
                    const int64_t at = (row + r) * k + b * QK + 4 * i;
                    high[r] = _mm256_add_epi32(high[r], q8_unit(l, magnitude, c->xq.q + at));
                    rest[r] = _mm256_add_epi32(rest[r], q8_unit(l, magnitude, c->xq.r + at));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(high[r], 7), rest[r]));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(c->xq.d[(row + r) * blocks + b]), acc[r]);
            }
        }
        const __m256 scales = _mm256_loadu_ps(c->scales + col + 8 * half);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(values[r] + 8 * half, _mm256_mul_ps(acc[r], scales));
    }
    for (int r = 0; r < R; r++) emit_tile(c, row + r, col, values[r]);
}
#else
#define ROWS 1

/* Portable: the same sums, one weight row at a time. */
static inline void q4_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    for (int r = 0; r < R; r++) {
        float values[TILE];
        for (int j = 0; j < TILE; j++) {
            float acc = 0.0f, low = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *p = c->w + col * (k / 2) + b * Q4_BLOCK_BYTES + 4 * j;
                const int8_t *q = c->xq.q + (row + r) * k + b * QK, *rest = c->xq.r + (q - c->xq.q);
                int32_t dot = 0;
                for (int u = 0; u < 4; u++)
                    for (int i = 0; i < 4; i++) {
                        const int lo = p[64 * u + i] & 0x0f, hi = p[64 * u + i] >> 4;
                        dot += lo * (128 * q[4 * u + i] + rest[4 * u + i]);
                        dot += hi * (128 * q[16 + 4 * u + i] + rest[16 + 4 * u + i]);
                    }
                const int64_t at = col * blocks + b * TILE + j, ds = (row + r) * blocks + b;
                const float scale = c->xq.d[ds] * half_to_float(c->steps[at]);
                acc = fmaf((float)dot, scale, acc);
                low = fmaf(half_to_float(c->lows[at]), c->xq.s[ds], low);
            }
            values[j] = acc + low;
        }
        emit_tile(c, row + r, col, values);
    }
}

static inline void q8_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    for (int r = 0; r < R; r++) {
        float values[TILE];
        for (int j = 0; j < TILE; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *p = (const int8_t *)c->w + col * k + b * Q8_BLOCK_BYTES + 4 * j;
                const int8_t *q = c->xq.q + (row + r) * k + b * QK, *rest = c->xq.r + (q - c->xq.q);
                int32_t dot = 0;
                for (int u = 0; u < 8; u++)
                    for (int i = 0; i < 4; i++) dot += p[64 * u + i] * (128 * q[4 * u + i] + rest[4 * u + i]);
                acc = fmaf((float)dot, c->xq.d[(row + r) * blocks + b], acc);
            }
            values[j] = acc * c->scales[col + j];
        }
        emit_tile(c, row + r, col, values);
    }
}
#endif

/* ---- AMX (Xeons since Sapphire Rapids): the same block dots from tile multiplies ---------------
 *
 * Where the CPU has AMX-INT8 and the kernel lets this process use it, the AVX-512 build computes
 * a block's D = 128 * (l . q) + l . r for up to 16 activation rows and a tile's 16 weight rows with
 * two tile multiplies (q and r halves against the block's weights), then sums the blocks in the
 * same order with the same float operations as q4_tile / q8_tile above: D is an exact integer
 * either way, so the bits are the same (tested, AMX against VNNI). A q8 block is already the
 * weight tile AMX multiplies (8 rows of 16 weight rows' 4 inputs); a q4 block is unpacked into
 * one: its low nibbles are rows 0-3, its high nibbles rows 4-7. */
#if defined(TS_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TS_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16     /* activation rows of one tile multiply */
#define AMX_MIN_ROWS 8  /* fewer take the AVX-512 tiles: faster there (kernel_bench, --amx both) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* the tile registers used (numbers: the tile intrinsics take literal ones) */
#define T_CQ 0  /* the sums l . q */
#define T_CR 1  /* the sums l . r */
#define T_AQ 2  /* the activations' high halves q */
#define T_AR 3  /* their low halves r */
#define T_B 4   /* one block of a tile's weights */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

static int amx_state = -1;   /* -1 not asked yet, 0 unavailable, 1 available */
static int amx_wanted = 1;   /* ts_amx(0) turns it off (tests, benchmarks) */
static __thread int amx_rows_set;  /* the activation rows this thread's tiles are configured for */

/* Whether this CPU has AMX-INT8 and the kernel grants this process its tile state (asked once). */
static int amx_available(void) {
    if (amx_state < 0) {
        unsigned a, b, c, d;
        const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25));
        amx_state = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
}

/* This thread's tiles for M activation rows: two sums tiles, two activation tiles, one weight tile. */
static void amx_configure(int M) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = T_CQ; t <= T_CR; t++) config.rows[t] = (uint8_t)M, config.colsb[t] = TILE * 4;
    for (int t = T_AQ; t <= T_AR; t++) config.rows[t] = (uint8_t)M, config.colsb[t] = QK;
    config.rows[T_B] = QK / 4, config.colsb[T_B] = TILE * 4;
    _tile_loadconfig(&config);
    amx_rows_set = M;
}

/* D of one block for M activation rows (their halves at q and r, rows `stride` bytes apart)
 * against a weight tile b (signed or unsigned bytes), in int32 lanes: dq + 16 j holds row j's
 * l . q, dr + 16 j its l . r. */
static inline __attribute__((always_inline)) void amx_block(int signed_weights, const void *b, const int8_t *q,
                                                            const int8_t *r, int64_t stride, int32_t *dq,
                                                            int32_t *dr) {
    _tile_loadd(T_B, b, TILE * 4);
    _tile_loadd(T_AQ, q, stride);
    _tile_loadd(T_AR, r, stride);
    _tile_zero(T_CQ);
    _tile_zero(T_CR);
    if (signed_weights) {
        _tile_dpbssd(T_CQ, T_AQ, T_B);
        _tile_dpbssd(T_CR, T_AR, T_B);
    } else {
        _tile_dpbsud(T_CQ, T_AQ, T_B);
        _tile_dpbsud(T_CR, T_AR, T_B);
    }
    _tile_stored(T_CQ, dq, TILE * 4);
    _tile_stored(T_CR, dr, TILE * 4);
}

/* Row j's D of a block, from amx_block's sums: 128 * (l . q) + l . r, exact. */
static inline __m512i amx_dot(const int32_t *dq, const int32_t *dr, int j) {
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dq + TILE * j), 7), _mm512_load_si512(dr + TILE * j));
}

/* A q4 block (256 bytes at p) as a weight tile (512 bytes at to): rows 0-3 its low nibbles,
 * rows 4-7 its high ones. */
static inline void amx_unpack(uint8_t *to, const uint8_t *p) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int u = 0; u < 4; u++) {
        const __m512i raw = _mm512_loadu_si512(p + 64 * u);
        _mm512_store_si512(to + 64 * u, _mm512_and_si512(raw, nibble));
        _mm512_store_si512(to + 256 + 64 * u, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
    }
}

#define UNPACK_AHEAD 4  /* q4 blocks unpacked before their tile multiply (a power of 2) */

/* q4_tile's sums for M activation rows (at most AMX_ROWS) from row, on AMX. Software-pipelined:
 * a block is unpacked UNPACK_AHEAD blocks before the tiles load it, and its sums are read back
 * one block after its multiplies, so neither waits for the stores just made. */
static inline __attribute__((always_inline)) void amx_q4_tile(const Call *c, int64_t row, int M, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const uint8_t *w = c->w + col * (k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    _Alignas(64) uint8_t unpacked[UNPACK_AHEAD][Q8_BLOCK_BYTES];
    _Alignas(64) int32_t dq[2][AMX_ROWS * TILE], dr[2][AMX_ROWS * TILE];
    __m512 acc[AMX_ROWS];
    for (int j = 0; j < M; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks && b < UNPACK_AHEAD; b++) amx_unpack(unpacked[b], w + b * Q4_BLOCK_BYTES);
    for (int64_t b = 0; b <= blocks; b++) {
        if (b < blocks) {
            amx_block(0, unpacked[b % UNPACK_AHEAD], c->xq.q + row * k + b * QK, c->xq.r + row * k + b * QK, k,
                      dq[b & 1], dr[b & 1]);
            const uint8_t *next = w + (b + UNPACK_AHEAD) * Q4_BLOCK_BYTES;
            for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) ask(next + WEIGHTS_AHEAD + line);
            if (b + UNPACK_AHEAD < blocks) amx_unpack(unpacked[b % UNPACK_AHEAD], next);
        }
        if (b == 0) continue;
        const int64_t a = b - 1;  /* the block whose sums are read now */
        const int32_t *q = dq[a & 1], *r = dr[a & 1];
        const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + a * TILE)));
        for (int j = 0; j < M; j++) {
            const __m512 dot = _mm512_cvtepi32_ps(amx_dot(q, r, j));
            const __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(c->xq.d[(row + j) * blocks + a]));
            acc[j] = _mm512_fmadd_ps(dot, scale, acc[j]);
        }
    }
    /* the lows' chain, as q4_tile sums it, in a pass of its own (fewer live registers) */
    __m512 low[AMX_ROWS];
    for (int j = 0; j < M; j++) low[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m512 low16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lows + b * TILE)));
        for (int j = 0; j < M; j++)
            low[j] = _mm512_fmadd_ps(low16, _mm512_set1_ps(c->xq.s[(row + j) * blocks + b]), low[j]);
    }
    emit_q4_rows(c, row, M, col, acc, low);
}

/* q8_tile's sums for M activation rows from row, on AMX: the weights multiply as they lie; a
 * block's sums are read back one block after its multiplies. */
static inline __attribute__((always_inline)) void amx_q8_tile(const Call *c, int64_t row, int M, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const int8_t *w = (const int8_t *)c->w + col * k;
    _Alignas(64) int32_t dq[2][AMX_ROWS * TILE], dr[2][AMX_ROWS * TILE];
    __m512 acc[AMX_ROWS];
    for (int j = 0; j < M; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= blocks; b++) {
        if (b < blocks) {
            const int8_t *p = w + b * Q8_BLOCK_BYTES;
            for (int line = 0; line < Q8_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
            amx_block(1, p, c->xq.q + row * k + b * QK, c->xq.r + row * k + b * QK, k, dq[b & 1], dr[b & 1]);
        }
        if (b == 0) continue;
        const int64_t a = b - 1;
        const int32_t *q = dq[a & 1], *r = dr[a & 1];
        for (int j = 0; j < M; j++) {
            const __m512 dot = _mm512_cvtepi32_ps(amx_dot(q, r, j));
            acc[j] = _mm512_fmadd_ps(dot, _mm512_set1_ps(c->xq.d[(row + j) * blocks + a]), acc[j]);
        }
    }
    emit_q8_rows(c, row, M, col, acc);
}

/* amx_q4_tile / amx_q8_tile for M rows: a constant 16 (unrolled) or any other count. */
static __attribute__((noinline)) void amx_rows(const Call *c, int kind, int64_t row, int M, int64_t col) {
    if (amx_rows_set != M) amx_configure(M);
    if (M == AMX_ROWS) {
        if (kind == KIND_Q4) amx_q4_tile(c, row, AMX_ROWS, col);
        else amx_q8_tile(c, row, AMX_ROWS, col);
    } else {
        if (kind == KIND_Q4) amx_q4_tile(c, row, M, col);
        else amx_q8_tile(c, row, M, col);
    }
}

/* quantized_rows(), defined below: the AVX-512 tiles */
static void quantized_rows(const Call *c, int kind, int64_t row, int R, int64_t col);

/* columns() for a quantized weight on AMX: each tile against every AMX_ROWS activation rows, and
 * the last fewer than AMX_MIN_ROWS on the AVX-512 tiles, which are faster there (the same sums);
 * the tiles given back after (a thread holding tile state costs every switch of it). */
static void amx_columns(const Call *c, int kind, int64_t first, int64_t last) {
    for (int64_t col = first; col < last && !team_taken(c->taken); col += TILE) {
        int64_t row = 0;
        for (; c->m - row >= AMX_MIN_ROWS; row += AMX_ROWS)
            amx_rows(c, kind, row, c->m - row < AMX_ROWS ? (int)(c->m - row) : AMX_ROWS, col);
        for (; row < c->m; row += ROWS)
            quantized_rows(c, kind, row, c->m - row < ROWS ? (int)(c->m - row) : ROWS, col);
    }
    _tile_release();
    amx_rows_set = 0;
}
#endif

/* Whether the quantized matmuls run their block dots on AMX: want 1 or 0 turns it on (where the
 * CPU and kernel allow) or off, -1 only asks. The sums are the same bits either way. */
int ts_amx(int want) {
#ifdef TS_AMX
    if (want >= 0) amx_wanted = want != 0;
    return amx_wanted && amx_available();
#else
    (void)want;
    return 0;
#endif
}

/* y[r, c] for R rows from `row` and C (1 or 2) float weight rows from `col` (dense): x . w in 8
 * lanes of k, one accumulator per (r, c), then the lanes added in a fixed order and the last
 * k % 8 inputs one by one. Which way a value is summed depends on k alone, so a row's numbers
 * do not depend on the rows or columns beside it; the AVX-512 build runs this same code. */
#ifdef TS_AVX2
static inline void dense_tile(const Call *c, int64_t row, int R, int64_t col, int C) {
    const int64_t k = c->k;
    __m256 acc[ROW_TILE][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 w[2];
        for (int j = 0; j < C; j++) w[j] = load8(c->wf, (col + j) * k + i, c->w_dtype);
        for (int r = 0; r < R; r++) {
            const __m256 x = _mm256_loadu_ps(c->xf + (row + r) * k + i);
            for (int j = 0; j < C; j++) acc[r][j] = _mm256_fmadd_ps(x, w[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            float value = hsum8(acc[r][j]);
            for (int64_t t = i; t < k; t++)
                value = fmaf(c->xf[(row + r) * k + t], load1(c->wf, (col + j) * k + t, c->w_dtype), value);
            emit(c, row + r, col + j, value);
        }
}
#else
static inline void dense_tile(const Call *c, int64_t row, int R, int64_t col, int C) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            float value = 0.0f;
            for (int64_t t = 0; t < c->k; t++)
                value = fmaf(c->xf[(row + r) * c->k + t], load1(c->wf, (col + j) * c->k + t, c->w_dtype), value);
            emit(c, row + r, col + j, value);
        }
}
#endif

/* q4_tile / q8_tile for R activation rows, a constant R per call site (so each is unrolled). */
static __attribute__((noinline)) void quantized_rows(const Call *c, int kind, int64_t row, int R, int64_t col) {
#define TILE_CASE(n) \
    case n: \
        if (kind == KIND_Q4) q4_tile(c, row, n, col); \
        else q8_tile(c, row, n, col); \
        break;
    switch (R) {
#if ROWS >= 8
    TILE_CASE(8)
    TILE_CASE(7)
    TILE_CASE(6)
    TILE_CASE(5)
    TILE_CASE(4)
    TILE_CASE(3)
#endif
#if ROWS >= 2
    TILE_CASE(2)
#endif
    default:
        if (kind == KIND_Q4) q4_tile(c, row, 1, col);
        else q8_tile(c, row, 1, col);
    }
#undef TILE_CASE
}

/* Weight rows [first, last) against every activation row. Quantized: a tile of TILE weight rows
 * at a time against every ROWS activation rows (the tile is read from memory once, then from the
 * cache); dense: a chunk of weight rows at a time against every tile of activation rows. */
static __attribute__((noinline)) void columns(const Call *c, int kind, int64_t first, int64_t last) {
    if (kind != KIND_DENSE) {
#ifdef TS_AMX
        if (c->amx) {
            amx_columns(c, kind, first, last);
            return;
        }
#endif
        for (int64_t col = first; col < last && !team_taken(c->taken); col += TILE)
            for (int64_t row = 0; row < c->m; row += ROWS)
                quantized_rows(c, kind, row, c->m - row < ROWS ? (int)(c->m - row) : ROWS, col);
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

#define CHUNKS_PER_THREAD 4  /* a job's chunks per thread: what a parked worker leaves is small */

typedef struct {
    Call c;
    int kind;
    const void *x;
    Prologue pre;
    int64_t rows_per_chunk;
} RowsArgs;

typedef struct {
    Call c;
    int kind;
    int64_t units, chunks;  /* weight rows in steps of SPLIT_ROWS; the job's chunks */
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
    const Call *c = &a->c;
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
    const Call *c = &a->c;
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
}

/* A chunk's weight rows [first, last). */
static void chunk_columns(const ColumnsArgs *a, int64_t chunk, int64_t *first, int64_t *last) {
    *first = a->units * chunk / a->chunks * SPLIT_ROWS;
    const int64_t end = a->units * (chunk + 1) / a->chunks * SPLIT_ROWS;
    *last = end < a->c.n ? end : a->c.n;  /* a quantized tile may pass n */
}

static void columns_compute(const void *args, int64_t chunk, void *scratch, const TeamChunk *taken) {
    const ColumnsArgs *a = args;
    Call c = a->c;
    int64_t first, last;
    chunk_columns(a, chunk, &first, &last);
    c.out = scratch;
    c.out_col0 = first;
    c.out_cols = last - first;
    c.taken = taken;
    columns(&c, a->kind, first, last);
}

static void columns_store(const void *args, int64_t chunk, const void *scratch) {
    const ColumnsArgs *a = args;
    const float *sums = scratch;
    int64_t first, last;
    chunk_columns(a, chunk, &first, &last);
    for (int64_t r = 0; r < a->c.m; r++)
        for (int64_t col = first; col < last; col++) finish(&a->c, r, col, sums[r * (last - first) + col - first]);
}

/* x's rows through the prologue and quantized (dense: kept as float32), then every y[r, c], on
 * the call's threads; fewer where the weight is small. x_owned: x is the team's (see above). */
static int matmul(TeamCall *call, Call *c, int kind, const void *x, int x_owned, const Prologue *pre) {
    const int64_t blocks = c->k / QK;
    const int dense = kind == KIND_DENSE;
    if (c->m < 0 || c->n < 1 || c->k < (dense ? 1 : QK) || (!dense && c->k % QK) ||
        (c->dtype != TS_F32 && c->dtype != TS_BF16) || pre->kind < PRE_NONE || pre->kind > PRE_GELU_TANH_MUL ||
        (pre->kind == PRE_RMS_NORM && pre->norm == NULL) ||
        (dense && c->w_dtype != TS_F32 && c->w_dtype != TS_BF16))
        return TS_BAD_ARGS;
    if (c->m == 0) return TS_OK;
#ifdef TS_AMX
    c->amx = !dense && c->m >= AMX_MIN_ROWS && ts_amx(-1);
#endif
    /* one buffer: the steps, sums and integer sums, then both halves; dense: the float rows */
    const size_t bytes = dense ? (size_t)(c->m * c->k) * sizeof(float)
                               : 2 * (size_t)(c->m * c->k) + 3 * (size_t)(c->m * blocks) * sizeof(float);
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

    ColumnsArgs cols = {.c = *c, .kind = kind, .units = units};
    cols.chunks = units < CHUNKS_PER_THREAD * threads ? units : CHUNKS_PER_THREAD * threads;
    job.compute = columns_compute;
    job.store = columns_store;
    job.chunks = cols.chunks;
    job.alone = threads < 2;
    job.scratch_bytes = (size_t)c->m * (size_t)((units + cols.chunks - 1) / cols.chunks * SPLIT_ROWS) * sizeof(float);
    memcpy(job.args, &cols, sizeof cols);
    return team_run(call, &job);
}

/* A call from outside: the team held for it. */
static int matmul_call(Call *c, int kind, const void *x, const Prologue *pre, int threads) {
    if (threads < 1) return TS_BAD_ARGS;
    TeamCall *call = team_enter(threads);
    const int status = matmul(call, c, kind, x, 0, pre);
    team_leave(call);
    return status;
}

/* y = x . W^T for an int4 W (layout at the top), with the prologue and bias, residual around it.
 * Returns TS_OK, or TS_BAD_ARGS / TS_NO_MEMORY with nothing written. */
int ts_q4_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const uint8_t *packed,
                 const uint16_t *steps, const uint16_t *lows, int prologue, const void *norm, float eps,
                 const void *bias, const void *residual, int threads) {
    Call c = {.m = m, .k = k, .n = n, .w = packed, .steps = steps, .lows = lows, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul_call(&c, KIND_Q4, x, &pre, threads);
}

/* y = x . W^T for an int8 W with one scale per row, likewise. */
int ts_q8_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const int8_t *weight,
                 const float *scales, int prologue, const void *norm, float eps, const void *bias,
                 const void *residual, int threads) {
    Call c = {.m = m, .k = k, .n = n, .w = (const uint8_t *)weight, .scales = scales, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul_call(&c, KIND_Q8, x, &pre, threads);
}

/* y = x . W^T for a float32 or bfloat16 W [n, k] (w_dtype), likewise; any k. */
int ts_dense_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const void *weight,
                    int w_dtype, int prologue, const void *norm, float eps, const void *bias,
                    const void *residual, int threads) {
    Call c = {.m = m, .k = k, .n = n, .wf = weight, .w_dtype = w_dtype, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul_call(&c, KIND_DENSE, x, &pre, threads);
}

/* ---- a stack of decoder layers in one call ---------------------------------------------------
 *
 * llama.native_layer's five calls for every layer, one layer after the other, on n tokens, for
 * the layers it runs with nothing between its calls (no head norms, post norms or experts). The
 * same functions in the same order as the five calls from Python, so the same bits; what goes is
 * the Python and ctypes between them (about 1 ms of a 6 ms step of the default model). */

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
    Call c = {.m = m, .k = l->k, .n = l->n, .w = l->w, .steps = l->steps, .lows = l->lows, .scales = l->scales,
              .y = y, .dtype = TS_F32, .bias = l->bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul(call, &c, (int)l->kind, x, 1, &pre);
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

/* ---- a greedy step's pick ----------------------------------------------------------------------
 *
 * For each row of x [rows, n] float32 (sampling/logits.py, the greedy rows of a step):
 * ids[r] = the first index of its largest value, and sure[r] = 1 when every value is finite and
 * 2 n max|x| < FLT_MAX, so that no order of summing the row can overflow: the pipeline's finite
 * check (the row's sum is finite) then holds for certain. Else sure[r] = 0 and ids[r] = 0: the
 * pipeline decides. One pass for the largest, its size and finiteness, one to find its first
 * place (a max of finite values is exact in any order, so the lanes may take it apart). */
#define FLOAT_LIMIT 3.40282347e38f

static int64_t first_equal(const float *v, int64_t n, float best) {
    int64_t i = 0;
#if defined(TS_AVX512)
    const __m512 want = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), want, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(TS_AVX2)
    const __m256 want = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (v[i] == best) return i;
    return 0;  /* not reached: best is one of the values */
}

int ts_greedy_rows(const float *x, int64_t rows, int64_t n, int64_t *ids, int32_t *sure) {
    if (rows < 0 || n < 1) return TS_BAD_ARGS;
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        float best = -INFINITY, big = 0.0f;
        int finite = 1;
        int64_t i = 0;
#if defined(TS_AVX512)
        __m512 top = _mm512_set1_ps(-INFINITY), size = _mm512_setzero_ps();
        __mmask16 odd = 0;  /* lanes that met a NaN or an infinity */
        for (; i + 16 <= n; i += 16) {
            const __m512 value = _mm512_loadu_ps(v + i);
            odd |= _mm512_fpclass_ps_mask(value, 0x99);  /* QNaN, SNaN, +inf, -inf */
            top = _mm512_max_ps(top, value);
            size = _mm512_max_ps(size, _mm512_abs_ps(value));
        }
        finite = odd == 0;
        best = _mm512_reduce_max_ps(top);
        big = _mm512_reduce_max_ps(size);
#elif defined(TS_AVX2)
        __m256 top = _mm256_set1_ps(-INFINITY), size = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= n; i += 8) {
            const __m256 value = _mm256_loadu_ps(v + i);
            odd = _mm256_or_ps(odd, _mm256_cmp_ps(_mm256_sub_ps(value, value), _mm256_setzero_ps(), _CMP_NEQ_UQ));
            top = _mm256_max_ps(top, value);
            size = _mm256_max_ps(size, _mm256_andnot_ps(sign, value));
        }
        float lanes[8], sizes[8];
        _mm256_storeu_ps(lanes, top);
        _mm256_storeu_ps(sizes, size);
        finite = _mm256_movemask_ps(odd) == 0;
        for (int l = 0; l < 8; l++) {
            best = lanes[l] > best ? lanes[l] : best;
            big = sizes[l] > big ? sizes[l] : big;
        }
#endif
        for (; i < n; i++) {
            finite &= isfinite(v[i]) != 0;
            best = v[i] > best ? v[i] : best;
            big = fabsf(v[i]) > big ? fabsf(v[i]) : big;
        }
        const int ok = finite && big < FLOAT_LIMIT / (2.0f * (float)n);  /* room for rounding */
        sure[r] = ok;
        ids[r] = ok ? first_equal(v, n, best) : 0;
    }
    return TS_OK;
}
