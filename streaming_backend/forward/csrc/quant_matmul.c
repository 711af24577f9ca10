/* Weight-only quantized matmuls: y [m, n] = x [m, k] . W^T for a W [n, k] stored in 4 or 8 bits.
 *
 * Built with exact_attention.c into one library by streaming_backend/forward/native.py and called
 * through ctypes with the tensors' data pointers; the GIL is released for the call.
 *
 * The activations are quantized first, each row on its own, in blocks of QK = 32 inputs, to
 * about 15 bits: v = round(x / d) with the block's step d = max|x| / 16256, so |v| <= 127 * 128,
 * kept as two int8 halves v = 128 * q + r (q in [-127, 127], r in [-64, 63]); s = d * sum(v).
 * Every block of a weight row then meets every block of an activation row in integer dot
 * products (exact: l . v = 128 * (l . q) + l . r), scaled and summed in float32:
 *
 *   int4 ("q4"): w = l * step + low per block of 32 inputs, l in [0, 15], step and low in float16
 *       y = sum over blocks of (d * step) * (l . v) + low * s
 *   int8 ("q8"): w = l * scale, l in [-127, 127], one float32 scale per weight row
 *       y = scale * sum over blocks of d * (l . v)
 *
 * (One int8 half alone, as llama.cpp's Q8_0 / Q8_1 activations, flipped the default model's first
 * token on "What is the capital of France?" from "The" to "L": its weights are exact in int4, so
 * the activations' rounding was the whole difference from the unquantized model.)
 *
 * One model whatever the load: the value of y[r, c] depends on row r of x and row c of W alone.
 * Its blocks are summed in an order fixed by k (q4: 16 lanes over groups of 4 blocks, see
 * q4_tile; q8: two chains, even and odd blocks, then added, then the 8 lanes in one fixed tree),
 * whatever m, n, the tile a row falls in or the thread that computes it. So a row's numbers are
 * the same alone, in a crowd, decoded or prefilled, and on any number of threads; and q4's are
 * the same from the AVX-512, AVX2 and portable builds (q8's from the first two).
 *
 * Layouts (row-major, contiguous):
 *   q4: packed [n, k / 2] uint8: byte j of a block holds input j in its low nibble and input
 *       j + 16 in its high one; steps, lows [n, k / 32] float16
 *   q8: weight [n, k] int8; scales [n] float32
 *   dense: weight [n, k] float32 or bfloat16, unquantized: the activations stay float32 and each
 *       y is x . w in 8 lanes of k, one chain, then the same fixed tree (`dense_tile`); any k
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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define QK 32            /* inputs per block, of the activations and of the int4 weights */
#define V_MAX 16256.0f   /* 127 * 128: the largest |v| of an activation block */
#define ROW_TILE 4       /* activation rows that share one read of a weight block */
#define COL_TILE 4       /* q4 weight rows that share one read of an activation block (AVX-512) */
#define COL_CHUNK 64     /* weight rows a thread takes at a time (they stay in its cache) */
/* threads split a call's weight rows in steps of this many, so 576 rows go 288 / 288 on two
 * threads where whole chunks of 64 went 256 / 320 */
#define SPLIT_ROWS 16
#define GROUP 4          /* blocks of a q4 group: 128 inputs, 16 lanes (see q4_tile) */
#define SCALE_GROUP 16   /* blocks whose q4 steps and lows are converted at once */
#ifndef PREFETCH_BYTES
/* how far ahead a thread asks for its weight rows: 4096 streamed the 1B shapes 3-8 % slower
 * from huge pages and 12-22 % slower from 4 KiB pages (docs/performance.md) */
#define PREFETCH_BYTES 1024
#endif
/* q4 rows of at least this many inputs are asked for a tile ahead into L2, shorter ones into L1
 * (a tile of 2048-input rows and their scales is 5 KiB): into L1, the 1B model's shapes (2048 and
 * 8192 inputs) streamed 3-4 % slower from memory than into L2, and the same from the L3 cache;
 * the default model's (576 and 1536) 4-5 % faster from the L3 cache. Its decode step still ran
 * 1-2.5 % slower than with 2048-input rows asked for whole (docs/performance.md). */
#define L2_ROW 2048
/* how far ahead a q8 tile asks for its weight rows as it reads them, where one tile of activation
 * rows reads them: 8 KiB (14 rows of the default model's head, 4 of the 1B model's) made both
 * heads 1.2x faster in a decode step than whole rows asked for when a tile starts, from 4 to 32
 * rows about the same (docs/performance.md) */
#define Q8_AHEAD_BYTES 8192
#define MIN_THREAD_WORK (1 << 16)  /* weight values worth a thread of their own (576 x 576: 2) */

enum { KIND_Q8 = 0, KIND_Q4 = 1, KIND_DENSE = 2 };  /* the weight formats */

/* The activation rows, quantized: row r's block b is v = 128 * q + r in q[r * q_stride + ...] and
 * r[...], with step d[r * ds_stride + b] (x ~ v * d) and s[r * ds_stride + b] = d * sum(v).
 * For q8 the halves lie in input order (q_stride = k, ds_stride = blocks); for q4 grouped as its
 * weights' nibbles are (`grouped_at`), each row padded with zeros to whole groups of 4 blocks
 * (q_stride) and its steps and sums to whole groups of 16 (ds_stride). */
typedef struct {
    int8_t *q, *r;
    float *d, *s;
    int64_t q_stride, ds_stride;
} Quantized;

/* Where block b's inputs 0..15 start in a grouped activation row; its inputs 16..31 lie 64 bytes
 * on. A group's 4 blocks thus give [inputs 0..15 of each | inputs 16..31 of each], as the low and
 * the high nibbles of its 64 packed weight bytes give them. */
static inline int64_t grouped_at(int64_t b) { return b / GROUP * 128 + b % GROUP * 16; }

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

/* One row of x (k values from x_at) as k / QK blocks: halves q and r (in input order, or
 * `grouped`), steps d, d * sum(v) s. */
static void quantize_row(int8_t *qs, int8_t *rs, float *ds, float *ss, const void *x, int64_t x_at,
                         int64_t k, int dtype, int grouped) {
    for (int64_t b = 0; b < k / QK; b++) {
        const int64_t at = x_at + b * QK;
        const int64_t first = grouped ? grouped_at(b) : b * QK, second = grouped ? first + 64 : first + 16;
#ifdef TS_AVX2
        __m256 v[4];
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = load8(x, at + 8 * i, dtype);
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
        const __m256i q_in_order = _mm256_permutevar8x32_epi32(q8, order);
        const __m256i r_in_order = _mm256_permutevar8x32_epi32(r8, order);
        _mm_storeu_si128((__m128i *)(qs + first), _mm256_castsi256_si128(q_in_order));
        _mm_storeu_si128((__m128i *)(qs + second), _mm256_extracti128_si256(q_in_order, 1));
        _mm_storeu_si128((__m128i *)(rs + first), _mm256_castsi256_si128(r_in_order));
        _mm_storeu_si128((__m128i *)(rs + second), _mm256_extracti128_si256(r_in_order, 1));
        ds[b] = d;
        ss[b] = d * (float)_mm_cvtsi128_si32(s4);
#else
        float max = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float a = fabsf(load1(x, at + i, dtype));
            max = a > max ? a : max;
        }
        const float d = max / V_MAX, id = max > 0.0f ? V_MAX / max : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int value = (int)nearbyintf(load1(x, at + i, dtype) * id);
            const int high = (value + 64) >> 7;  /* floor: an arithmetic shift, as srai */
            const int64_t to = i < 16 ? first + i : second + i - 16;
            qs[to] = (int8_t)high;
            rs[to] = (int8_t)(value - high * 128);
            sum += value;
        }
        ds[b] = d;
        ss[b] = d * (float)sum;
#endif
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
} Call;

/* y[row, col] = value + bias + residual, rounded once. */
static inline void emit(const Call *c, int64_t row, int64_t col, float value) {
    const int64_t at = row * c->n + col;
    if (c->bias != NULL) value += load1(c->bias, col, c->dtype);
    if (c->residual != NULL) value = load1(c->residual, at, c->dtype) + value;
    store1(c->y, at, c->dtype, value);
}

#ifdef TS_AVX2
/* y for the R * C <= 4 (row, weight row) pairs from (row, col) whose values a four-way tree
 * (hsum8x4, tree16x4) left in `values`: pair r * C + j in lane 0, 4, 1 or 5. */
static inline void emit_pairs(const Call *c, int64_t row, int R, int64_t col, int C, __m256 values) {
    static const int lane[4] = {0, 4, 1, 5};
    float v[8];
    _mm256_storeu_ps(v, values);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) emit(c, row + r, col + j, v[lane[r * C + j]]);
}

/* The 8 int32 sums of u . s over 4 bytes each (u unsigned, s signed, both below 128 in size, so
 * AVX2's 16-bit pair sums cannot saturate): exact, so VNNI's one instruction gives the same. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef TS_AVX512
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The same for a signed weight block l: its magnitude meets the halves with l's sign. */
static inline __m256i dot_v_signed(__m256i l, __m256i magnitude, const int8_t *q, const int8_t *r) {
    const __m256i high = dot_u8s8(magnitude, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)q), l));
    const __m256i low = dot_u8s8(magnitude, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)r), l));
    return _mm256_add_epi32(_mm256_slli_epi32(high, 7), low);
}

/* Blocks b .. blocks - 1 of a q8 weight row one by one into the two chains, then y. */
static inline void q8_finish(const Call *c, int64_t row, int R, int64_t col, int64_t b, __m256 acc[][2]) {
    const int64_t blocks = c->k / QK;
    const int8_t *w = (const int8_t *)c->w + col * c->k;
    for (; b < blocks; b++) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i magnitude = _mm256_sign_epi8(l, l);  /* |l|; the sign moves to q and r */
        for (int r = 0; r < R; r++) {
            const int64_t v_at = (row + r) * c->k + b * QK;
            const __m256 f = _mm256_cvtepi32_ps(dot_v_signed(l, magnitude, c->xq.q + v_at, c->xq.r + v_at));
            const float *d = c->xq.d + (row + r) * blocks + b;
            acc[r][b & 1] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(d), acc[r][b & 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        const float value = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) * c->scales[col];
        emit(c, row + r, col, value);
    }
}

#ifdef TS_AVX512
/* q8 on AVX-512 with VNNI: two blocks at a time, even block in lanes 0-7 and odd in 8-15, which
 * are the AVX2 build's two chains; every product and sum is the AVX2 build's, so both builds give
 * the same bits (tested). */

static inline void split(__m512 wide, __m256 acc[2]) {
    acc[0] = _mm512_castps512_ps256(wide);
    acc[1] = _mm512_extractf32x8_ps(wide, 1);
}

static inline __attribute__((always_inline)) void q8_tile(const Call *c, int64_t row, int R, int64_t col, int64_t ahead,
                                                          int64_t until) {
    const int64_t blocks = c->k / QK;
    const int8_t *w = (const int8_t *)c->w + col * c->k;
    const int ask = ahead > 0 && col + ahead < until;  /* the row `ahead` on, as this one is read */
    __m512 wide[ROW_TILE];
    __m256 acc[ROW_TILE][2];
    for (int r = 0; r < R; r++) wide[r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        if (ask) _mm_prefetch((const char *)(w + b * QK + ahead * c->k), _MM_HINT_T0);
        const __m512i l = _mm512_loadu_si512(w + b * QK);
        const __m512i magnitude = _mm512_abs_epi8(l);
        const __mmask64 negative = _mm512_movepi8_mask(l);  /* the sign moves to q */
        for (int r = 0; r < R; r++) {
            const int64_t v_at = (row + r) * c->k + b * QK;
            const __m512i q = _mm512_loadu_si512(c->xq.q + v_at), rest = _mm512_loadu_si512(c->xq.r + v_at);
            const __m512i zero = _mm512_setzero_si512();
            const __m512i high = _mm512_dpbusd_epi32(zero, magnitude, _mm512_mask_sub_epi8(q, negative, zero, q));
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 7), magnitude,
                                                    _mm512_mask_sub_epi8(rest, negative, zero, rest));
            const float *d = c->xq.d + (row + r) * blocks + b;
            const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(d[0]), _mm256_set1_ps(d[1]), 1);
            wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, wide[r]);
        }
    }
    for (int r = 0; r < R; r++) split(wide[r], acc[r]);
    q8_finish(c, row, R, col, b, acc);
}
#else
/* The same for q8: y = scale * sum over blocks of d * (l . q). (Its rows are asked for whole:
 * `ahead` is 0.) */
static inline __attribute__((always_inline)) void q8_tile(const Call *c, int64_t row, int R, int64_t col, int64_t ahead,
                                                          int64_t until) {
    (void)ahead, (void)until;
    __m256 acc[ROW_TILE][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    q8_finish(c, row, R, col, 0, acc);
}
#endif
#else
/* Portable q8: the same sums, one value at a time (their own numbers, as named by the build's
 * variant). */
static inline __attribute__((always_inline)) void q8_tile(const Call *c, int64_t row, int R, int64_t col, int64_t ahead,
                                                          int64_t until) {
    (void)ahead, (void)until;
    const int64_t blocks = c->k / QK;
    const int8_t *w = (const int8_t *)c->w + col * c->k;
    for (int r = 0; r < R; r++) {
        float acc[2] = {0.0f, 0.0f};
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *q = c->xq.q + (row + r) * c->k + b * QK, *rest = c->xq.r + (row + r) * c->k + b * QK;
            int32_t dot = 0;
            for (int j = 0; j < QK; j++) dot += w[b * QK + j] * (128 * q[j] + rest[j]);
            acc[b & 1] = fmaf((float)dot, c->xq.d[(row + r) * blocks + b], acc[b & 1]);
        }
        emit(c, row + r, col, (acc[0] + acc[1]) * c->scales[col]);
    }
}
#endif

/* ---- int4 weights: y = sum over groups of 4 blocks, in 16 lanes, then one fixed tree --------
 *
 * A group of 4 blocks (128 inputs) is 64 packed bytes. Its low nibbles are inputs 0..15 of each
 * block and its high nibbles inputs 16..31, 16 bytes a block, so they meet the activations as
 * they lie, with no shuffle: the activation rows are stored grouped to match (`grouped_at`).
 * Lane L (0..15) of a group holds the exact int32 partial of block j = L / 4 over its inputs
 * 4i .. 4i + 3 and 16 + 4i .. 16 + 4i + 3 (i = L % 4):
 *
 *   P = 128 * (l . q) + l . r   over those 8 inputs (|P| < 2^21: exact in float32)
 *   acc[L] = fma(float(P), d_b * step_b, acc[L])            group after group (b = 4g + j)
 *   low[L] = fma(low_b, s_b, low[L])                        b = 16h + L, 16 blocks at a time
 *   y = tree(acc) + tree(low), tree(v) = hsum8(v[0..7] + v[8..15])
 *
 * Blocks past k / 32 count as zeros (zero weights, steps and activations), which leave every
 * lane as it was. The AVX-512 build computes a group in one register, the AVX2 build in two
 * (lanes 0..7 and 8..15) and the portable build lane by lane: the same integers, products and
 * sums in the same order, so the same bits from all three (tested). */

#ifdef TS_AVX512
#define Q4_WIDE 1
static inline float tree16(__m512 v) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* tree16 of four registers at once, each value summed as tree16 sums it (the same additions of
 * the same pairs, in the same order): lanes 0, 4, 1, 5 of the result hold a's, b's, c's, d's. */
static inline __m256 tree16x4(__m512 a, __m512 b, __m512 c, __m512 d) {
    return hsum8x4(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)),
                   _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1)),
                   _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1)),
                   _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1)));
}

/* noinline here: gcc then builds one copy per constant R, as it did before q4_tile_wide came
 * beside it; inlined into `columns` with it, R = 3 and 4 ran 3-4 % slower */
static __attribute__((noinline)) void q4_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t blocks = c->k / QK;
    const uint8_t *w = c->w + col * (c->k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[ROW_TILE], low[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = low[r] = _mm512_setzero_ps();
    for (int64_t h = 0; h < blocks; h += SCALE_GROUP) {
        const int64_t count = blocks - h < SCALE_GROUP ? blocks - h : SCALE_GROUP;
        const __mmask16 present = (__mmask16)((1u << count) - 1u);
        const __m512 step = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(present, steps + h));
        const __m512 low16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(present, lows + h));
        __m512 scale[ROW_TILE];
        for (int r = 0; r < R; r++) {
            const int64_t at = (row + r) * c->xq.ds_stride + h;
            scale[r] = _mm512_mul_ps(_mm512_loadu_ps(c->xq.d + at), step);
            low[r] = _mm512_fmadd_ps(low16, _mm512_loadu_ps(c->xq.s + at), low[r]);
        }
        for (int64_t g = 0; g * GROUP < count; g++) {
            const int64_t first = h + g * GROUP, bytes = (blocks - first) * (QK / 2);
            const uint8_t *p = w + first * (QK / 2);
            const __m512i raw = bytes >= 64 ? _mm512_loadu_si512(p)
                                            : _mm512_maskz_loadu_epi8((__mmask64)((1ull << bytes) - 1ull), p);
            const __m512i lo = _mm512_and_si512(raw, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            /* lane L takes the scale of block 4g + L / 4 */
            const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32((int)(4 * g)),
                                                  _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2));
            for (int r = 0; r < R; r++) {
                const int64_t at = (row + r) * c->xq.q_stride + grouped_at(first);
                const int8_t *q = c->xq.q + at, *rest = c->xq.r + at;
                __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q));
                high = _mm512_dpbusd_epi32(high, hi, _mm512_loadu_si512(q + 64));
                __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 7), lo, _mm512_loadu_si512(rest));
                dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(rest + 64));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale[r]), acc[r]);
            }
        }
    }
    if (R == 1) {
        emit(c, row, col, tree16(acc[0]) + tree16(low[0]));
        return;
    }
    /* the rows' trees four at a time (tree16x4: each row's sums as tree16 adds them, so the same
     * bits; a missing row's registers are zeros, its lanes unused): a prefill's tile of four
     * rows of 576 inputs spent about a third of its instructions in eight tree16 */
    const __m512 zero = _mm512_setzero_ps();
    emit_pairs(c, row, R, col, 1,
               _mm256_add_ps(tree16x4(acc[0], acc[1], R > 2 ? acc[2] : zero, R > 3 ? acc[3] : zero),
                             tree16x4(low[0], low[1], R > 2 ? low[2] : zero, R > 3 ? low[3] : zero)));
}
/* Ask for the line at p into L1 (into 1) or L2 (into 2); nothing for 0 (a constant per caller). */
static inline __attribute__((always_inline)) void ask_into(const void *p, int into) {
    if (into == 1) _mm_prefetch((const char *)p, _MM_HINT_T0);
    if (into == 2) _mm_prefetch((const char *)p, _MM_HINT_T1);
}

/* q4_tile for C (2 or 4) weight rows from `col` at once, R * C <= 4: each activation block is
 * read once for the C weight rows, their chains run side by side and four rows' sums are added
 * up together (tree16x4); every (row, weight row) pair is computed as q4_tile computes it, so the
 * same bits. A row's fixed cost (its scales, the last group, the sums' tree) is what bounds short
 * rows: one row of 576 inputs took 19 ns here against 24 alone (docs/performance.md).
 * `stream` (not 0): each step also asks for the same place in the rows C on, those before
 * `until` (the next tile's), so the requests go out as fast as the tile reads; into L1 (stream 1)
 * or L2 (stream 2). A constant per copy (q4_wide picks one): tested at run time in the loop, it
 * made the tiles 15 % slower. */
static inline __attribute__((always_inline)) void q4_tile_wide(const Call *c, int64_t row, int R, int64_t col,
                                                               int C, int stream, int64_t until) {
    const int64_t blocks = c->k / QK;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[ROW_TILE][COL_TILE], low[ROW_TILE][COL_TILE];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) acc[r][j] = low[r][j] = _mm512_setzero_ps();
    for (int64_t h = 0; h < blocks; h += SCALE_GROUP) {
        const int64_t count = blocks - h < SCALE_GROUP ? blocks - h : SCALE_GROUP;
        const __mmask16 present = (__mmask16)((1u << count) - 1u);
        __m512 scale[ROW_TILE][COL_TILE];
        for (int j = 0; j < C; j++) {
            const int64_t at = (col + j) * blocks + h;
            if (stream && col + j + C < until) {
                ask_into(c->steps + at + C * blocks, stream);
                ask_into(c->lows + at + C * blocks, stream);
            }
            const __m512 step = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(present, c->steps + at));
            const __m512 low16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(present, c->lows + at));
            for (int r = 0; r < R; r++) {
                const int64_t x_at = (row + r) * c->xq.ds_stride + h;
                scale[r][j] = _mm512_mul_ps(_mm512_loadu_ps(c->xq.d + x_at), step);
                low[r][j] = _mm512_fmadd_ps(low16, _mm512_loadu_ps(c->xq.s + x_at), low[r][j]);
            }
        }
        for (int64_t g = 0; g * GROUP < count; g++) {
            const int64_t first = h + g * GROUP, bytes = (blocks - first) * (QK / 2);
            const __mmask64 part = bytes >= 64 ? ~0ull : (1ull << bytes) - 1ull;
            __m512i lo[COL_TILE], hi[COL_TILE];
            for (int j = 0; j < C; j++) {
                const uint8_t *p = c->w + (col + j) * (c->k / 2) + first * (QK / 2);
                if (stream && col + j + C < until) ask_into(p + C * (c->k / 2), stream);
                const __m512i raw = bytes >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(part, p);
                lo[j] = _mm512_and_si512(raw, nibble);
                hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            }
            /* lane L takes the scale of block 4g + L / 4 */
            const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32((int)(4 * g)),
                                                  _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2));
            for (int r = 0; r < R; r++) {
                const int64_t at = (row + r) * c->xq.q_stride + grouped_at(first);
                const int8_t *q = c->xq.q + at, *rest = c->xq.r + at;
                const __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 64);
                const __m512i r0 = _mm512_loadu_si512(rest), r1 = _mm512_loadu_si512(rest + 64);
                for (int j = 0; j < C; j++) {
                    __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], q0);
                    high = _mm512_dpbusd_epi32(high, hi[j], q1);
                    __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 7), lo[j], r0);
                    dot = _mm512_dpbusd_epi32(dot, hi[j], r1);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale[r][j]), acc[r][j]);
                }
            }
        }
    }
    /* the pairs' trees four at a time (tree16x4, the same bits as tree16 each): R * C <= 4 */
    const __m512 zero = _mm512_setzero_ps();
    __m512 sums[4] = {zero, zero, zero, zero}, lows[4] = {zero, zero, zero, zero};
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) sums[r * C + j] = acc[r][j], lows[r * C + j] = low[r][j];
    emit_pairs(c, row, R, col, C,
               _mm256_add_ps(tree16x4(sums[0], sums[1], sums[2], sums[3]),
                             tree16x4(lows[0], lows[1], lows[2], lows[3])));
}

/* q4_tile_wide's copies, each one per constant R and C: tiles that ask for no rows, and tiles
 * that ask for the next tile's into L1 or L2 (see L2_ROW); q4_wide picks one */
static __attribute__((noinline)) void q4_wide_asking_none(const Call *c, int64_t row, int R, int64_t col, int C) {
    q4_tile_wide(c, row, R, col, C, 0, 0);
}

static __attribute__((noinline)) void q4_wide_to_l1(const Call *c, int64_t row, int R, int64_t col, int C,
                                                    int64_t until) {
    q4_tile_wide(c, row, R, col, C, 1, until);
}

static __attribute__((noinline)) void q4_wide_to_l2(const Call *c, int64_t row, int R, int64_t col, int C,
                                                    int64_t until) {
    q4_tile_wide(c, row, R, col, C, 2, until);
}

static inline __attribute__((always_inline)) void q4_wide(const Call *c, int64_t row, int R, int64_t col, int C,
                                                          int into, int64_t until) {
    if (into == 1) q4_wide_to_l1(c, row, R, col, C, until);
    else if (into == 2) q4_wide_to_l2(c, row, R, col, C, until);
    else q4_wide_asking_none(c, row, R, col, C);
}
#elif defined(TS_AVX2)
#define Q4_WIDE 0
/* 8 lanes of P (see above) for two blocks: lo, hi their nibbles (32 bytes each), q and r the
 * halves at their grouped places (their inputs 16.. 64 bytes on). */
static inline __m256i q4_partials(__m256i lo, __m256i hi, const int8_t *q, const int8_t *r) {
    const __m256i high = _mm256_add_epi32(dot_u8s8(lo, _mm256_loadu_si256((const __m256i *)q)),
                                          dot_u8s8(hi, _mm256_loadu_si256((const __m256i *)(q + 64))));
    const __m256i rest = _mm256_add_epi32(dot_u8s8(lo, _mm256_loadu_si256((const __m256i *)r)),
                                          dot_u8s8(hi, _mm256_loadu_si256((const __m256i *)(r + 64))));
    return _mm256_add_epi32(_mm256_slli_epi32(high, 7), rest);
}

/* Leading ones: a load from FIRST_ONES + 64 - n masks all but the first n bytes. */
static const uint8_t FIRST_ONES[128] = {
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255};

/* `width` (32 or 64) bytes from p into `to`, of which only the first n (< width) are a row's:
 * where the array holds `room` bytes from p, the rest are read too (the next rows') and masked
 * off; else the n are copied, as nothing past the array may be read. Zeros after the n. */
static inline void q4_tail(uint8_t *to, const uint8_t *p, int64_t n, int width, int64_t room) {
    if (room < width) {
        memset(to, 0, (size_t)width);
        memcpy(to, p, (size_t)n);
        return;
    }
    for (int i = 0; i < width; i += 32) {
        const __m256i keep = _mm256_loadu_si256((const __m256i *)(FIRST_ONES + 64 - n + i));
        _mm256_storeu_si256((__m256i *)(to + i), _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), keep));
    }
}

static inline void q4_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t blocks = c->k / QK;
    const uint8_t *w = c->w + col * (c->k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    const int64_t rows_left = c->n - col;  /* this weight row and those after it */
    __m256 acc[ROW_TILE][2], low[ROW_TILE][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = low[r][0] = low[r][1] = _mm256_setzero_ps();
    for (int64_t h = 0; h < blocks; h += SCALE_GROUP) {
        const int64_t count = blocks - h < SCALE_GROUP ? blocks - h : SCALE_GROUP;
        const uint16_t *step_bits = steps + h, *low_bits = lows + h;
        uint16_t step_tail[SCALE_GROUP], low_tail[SCALE_GROUP];  /* the last blocks, zero-padded */
        if (count < SCALE_GROUP) {
            const int64_t room = 2 * (rows_left * blocks - h);
            q4_tail((uint8_t *)step_tail, (const uint8_t *)step_bits, 2 * count, 32, room);
            q4_tail((uint8_t *)low_tail, (const uint8_t *)low_bits, 2 * count, 32, room);
            step_bits = step_tail, low_bits = low_tail;
        }
        const __m256 step[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)step_bits)),
                                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(step_bits + 8)))};
        for (int half = 0; half < 2; half++) {
            const __m256 low8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(low_bits + 8 * half)));
            for (int r = 0; r < R; r++) {
                const float *s = c->xq.s + (row + r) * c->xq.ds_stride + h + 8 * half;
                low[r][half] = _mm256_fmadd_ps(low8, _mm256_loadu_ps(s), low[r][half]);
            }
        }
        for (int64_t g = 0; g * GROUP < count; g++) {
            const int64_t first = h + g * GROUP, bytes = (blocks - first) * (QK / 2);
            uint8_t tail[64];  /* the last group's blocks, zero-padded */
            const uint8_t *p = w + first * (QK / 2);
            if (bytes < 64) {
                q4_tail(tail, p, bytes, 64, rows_left * (c->k / 2) - first * (QK / 2));
                p = tail;
            }
            const __m256i raw0 = _mm256_loadu_si256((const __m256i *)p), raw1 = _mm256_loadu_si256((const __m256i *)(p + 32));
            const __m256i lo0 = _mm256_and_si256(raw0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), nibble);
            const __m256i lo1 = _mm256_and_si256(raw1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), nibble);
            /* blocks 4g .. 4g + 3 are lanes o .. o + 3 of the scales of half g / 2 */
            const int o = (int)(4 * (g % 2));
            const __m256i pick0 = _mm256_setr_epi32(o, o, o, o, o + 1, o + 1, o + 1, o + 1);
            const __m256i pick1 = _mm256_setr_epi32(o + 2, o + 2, o + 2, o + 2, o + 3, o + 3, o + 3, o + 3);
            for (int r = 0; r < R; r++) {
                const float *d = c->xq.d + (row + r) * c->xq.ds_stride + h + 8 * (g / 2);
                const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(d), step[g / 2]);
                const int64_t at = (row + r) * c->xq.q_stride + grouped_at(first);
                const int8_t *q = c->xq.q + at, *rest = c->xq.r + at;
                const __m256 f0 = _mm256_cvtepi32_ps(q4_partials(lo0, hi0, q, rest));
                const __m256 f1 = _mm256_cvtepi32_ps(q4_partials(lo1, hi1, q + 32, rest + 32));
                acc[r][0] = _mm256_fmadd_ps(f0, _mm256_permutevar8x32_ps(scale, pick0), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(f1, _mm256_permutevar8x32_ps(scale, pick1), acc[r][1]);
            }
        }
    }
    if (R == 1) {
        emit(c, row, col, hsum8(_mm256_add_ps(acc[0][0], acc[0][1])) + hsum8(_mm256_add_ps(low[0][0], low[0][1])));
        return;
    }
    /* the rows' sums four at a time (hsum8x4: the same bits as hsum8 each; a missing row's
     * registers are zeros, its lanes unused), as the AVX-512 build's tiles take them */
    const __m256 zero = _mm256_setzero_ps();
    __m256 sums[ROW_TILE] = {zero, zero, zero, zero}, low_sums[ROW_TILE] = {zero, zero, zero, zero};
    for (int r = 0; r < R; r++) {
        sums[r] = _mm256_add_ps(acc[r][0], acc[r][1]);
        low_sums[r] = _mm256_add_ps(low[r][0], low[r][1]);
    }
    emit_pairs(c, row, R, col, 1,
               _mm256_add_ps(hsum8x4(sums[0], sums[1], sums[2], sums[3]),
                             hsum8x4(low_sums[0], low_sums[1], low_sums[2], low_sums[3])));
}
#else
#define Q4_WIDE 0
/* hsum8(v[0..7] + v[8..15]) one value at a time, in hsum8's order. */
static inline float tree16(const float *v) {
    float e[8];
    for (int i = 0; i < 8; i++) e[i] = v[i] + v[i + 8];
    const float a = e[0] + e[4], b = e[1] + e[5], c = e[2] + e[6], d = e[3] + e[7];
    return (a + c) + (b + d);
}

static inline void q4_tile(const Call *c, int64_t row, int R, int64_t col) {
    const int64_t blocks = c->k / QK;
    const uint8_t *w = c->w + col * (c->k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    for (int r = 0; r < R; r++) {
        float acc[16] = {0.0f}, low[16] = {0.0f};
        const float *d = c->xq.d + (row + r) * c->xq.ds_stride, *s = c->xq.s + (row + r) * c->xq.ds_stride;
        for (int64_t h = 0; h < blocks; h += SCALE_GROUP) {
            for (int64_t lane = 0; lane < 16 && h + lane < blocks; lane++)
                low[lane] = fmaf(half_to_float(lows[h + lane]), s[h + lane], low[lane]);
            for (int64_t b0 = h; b0 < h + SCALE_GROUP && b0 < blocks; b0 += GROUP) {
                for (int lane = 0; lane < 16; lane++) {
                    const int64_t b = b0 + lane / 4, i = lane % 4;
                    if (b >= blocks) continue;
                    const int8_t *q = c->xq.q + (row + r) * c->xq.q_stride + grouped_at(b), *rest = c->xq.r + (q - c->xq.q);
                    const uint8_t *p = w + b * (QK / 2);
                    int32_t high = 0, low_part = 0;
                    for (int t = 4 * (int)i; t < 4 * (int)i + 4; t++) {
                        high += (p[t] & 0x0f) * q[t] + (p[t] >> 4) * q[64 + t];
                        low_part += (p[t] & 0x0f) * rest[t] + (p[t] >> 4) * rest[64 + t];
                    }
                    const float scale = d[b] * half_to_float(steps[b]);
                    acc[lane] = fmaf((float)(high * 128 + low_part), scale, acc[lane]);
                }
            }
        }
        emit(c, row + r, col, tree16(acc) + tree16(low));
    }
}
#endif

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

/* Weight row col of a quantized kind (its values, and a q4 row's steps and lows) asked into the
 * cache ahead of its use. Left to the hardware's prefetchers the cores wait on memory: the 1B
 * model's gate/up projection streamed 13.5 GB/s from memory on 2 threads without this and 21 with
 * it (docs/performance.md). A prefetch changes no value. always_inline: gcc drops the calls of a
 * function of prefetches alone, which has no effect it sees (tested). */
static inline __attribute__((always_inline)) void prefetch_row(const Call *c, int kind, int64_t col) {
#ifdef TS_AVX2
    const int64_t bytes = kind == KIND_Q4 ? c->k / 2 : c->k;
    const char *w = (const char *)c->w + col * bytes;
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(w + at, _MM_HINT_T0);
    if (kind == KIND_Q4) {
        const int64_t blocks = c->k / QK;
        const char *steps = (const char *)(c->steps + col * blocks), *lows = (const char *)(c->lows + col * blocks);
        for (int64_t at = 0; at < blocks * 2; at += 64) {
            _mm_prefetch(steps + at, _MM_HINT_T0);
            _mm_prefetch(lows + at, _MM_HINT_T0);
        }
    }
#else
    (void)c, (void)kind, (void)col;
#endif
}

/* q8_tile for R activation rows, a constant R per call site (so the compiler unrolls each). */
static inline __attribute__((always_inline)) void q8_rows(const Call *c, int64_t row, int R, int64_t col,
                                                          int64_t ahead, int64_t until) {
    switch (R) {
    case 4: q8_tile(c, row, 4, col, ahead, until); break;
    case 3: q8_tile(c, row, 3, col, ahead, until); break;
    case 2: q8_tile(c, row, 2, col, ahead, until); break;
    default: q8_tile(c, row, 1, col, ahead, until);
    }
}

/* The tiles that ask for their rows `ahead` on (R <= ROW_TILE), kept out of `columns`, so the
 * others' loop tests nothing. (q8_tile is always_inline and `columns` noinline: with these copies
 * beside them gcc had left q8_tile and dense_tile out of line, and the tiles of 8 activation rows
 * ran 4-10 % slower.) */
static __attribute__((noinline)) void q8_asking(const Call *c, int64_t row, int R, int64_t col, int64_t ahead,
                                                int64_t until) {
    q8_rows(c, row, R, col, ahead, until);
}

/* How many weight rows on the tiles of a call ask for theirs as they read them (0: none):
 * AVX-512 only, where all of the call's activation rows are one tile. q4's wide tiles, the next
 * tile's; q8's, Q8_AHEAD_BYTES on. Against whole rows asked for PREFETCH_BYTES ahead as each tile
 * starts, q4 (docs/performance.md): the 1B model's 8192-input rows 20 -> 29-30 GB/s from memory,
 * its 2048-input ones about the same (asked into L2, L2_ROW); every one of its shapes from the L3
 * cache 1.17x; the default model's shapes 1.06-1.09x from the L3 cache, 1.03-1.04x from memory. */
static int64_t rows_ahead(const Call *c, int kind) {
#ifdef TS_AVX512
    if (kind == KIND_Q4 && c->m <= 2) return c->m == 1 ? 4 : 2;  /* C */
    if (kind == KIND_Q8 && c->m <= ROW_TILE) return (Q8_AHEAD_BYTES + c->k - 1) / c->k;
#endif
    (void)c, (void)kind;
    return 0;
}

/* Weight rows [first, last) against every activation row: a chunk of weight rows at a time,
 * each chunk against every tile of activation rows (so the chunk is read from memory once).
 * A quantized kind's rows are asked into the cache by the tiles as they read (rows_ahead), after
 * the first ones asked for here; else whole, PREFETCH_BYTES ahead, as each tile starts. */
static __attribute__((noinline)) void columns(const Call *c, int kind, int64_t first, int64_t last) {
    const int64_t row_bytes = kind == KIND_Q4 ? c->k / 2 + c->k / QK * 4 : c->k;
    const int64_t in_tile = kind == KIND_DENSE ? 0 : rows_ahead(c, kind);
    const int64_t ahead = kind == KIND_DENSE || in_tile ? 0 : (PREFETCH_BYTES + row_bytes - 1) / row_bytes;
#if Q4_WIDE
    const int into = !in_tile ? 0 : c->k < L2_ROW ? 1 : 2;  /* where q4's wide tiles ask for rows */
#endif
    for (int64_t col = first; col < first + (in_tile ? in_tile : ahead) && col < last; col++) prefetch_row(c, kind, col);
    for (int64_t chunk = first; chunk < last; chunk += COL_CHUNK) {
        const int64_t end = chunk + COL_CHUNK < last ? chunk + COL_CHUNK : last;
        for (int64_t row = 0; row < c->m; row += ROW_TILE) {
            const int R = c->m - row < ROW_TILE ? (int)(c->m - row) : ROW_TILE;
            if (kind == KIND_DENSE) {  /* two weight rows at a time share each read of x */
                for (int64_t col = chunk; col < end; col += 2) {
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
                continue;
            }
            for (int64_t col = chunk; col < end;) {
                /* weight rows taken together: q4 on AVX-512, 4 against one activation row and 2
                 * against two (their accumulators fill the registers), else one */
                const int wide = kind == KIND_Q4 && Q4_WIDE ? (R == 1 ? 4 : R == 2 ? 2 : 1) : 1;
                const int C = end - col >= wide ? wide : 1;
                for (int j = 0; j < C; j++)
                    if (row == 0 && ahead > 0 && col + j + ahead < last) prefetch_row(c, kind, col + j + ahead);
                /* a constant R (and C) per call site, so the compiler unrolls each */
                if (kind == KIND_Q4) {
#if Q4_WIDE
                    if (C == 4) {
                        q4_wide(c, row, 1, col, 4, into, last);
                    } else if (C == 2) {
                        q4_wide(c, row, 2, col, 2, into, last);
                    } else
#endif
                    switch (R) {
                    case 4: q4_tile(c, row, 4, col); break;
                    case 3: q4_tile(c, row, 3, col); break;
                    case 2: q4_tile(c, row, 2, col); break;
                    default: q4_tile(c, row, 1, col);
                    }
                } else {
                    if (in_tile) q8_asking(c, row, R, col, in_tile, last);
                    else q8_rows(c, row, R, col, 0, 0);  /* `ahead` 0: no test in the loop */
                }
                col += C;
            }
        }
    }
}

/* x's rows through the prologue and quantized (dense: kept as float32), then every y[r, c], on
 * up to `threads` OpenMP threads (torch's own runtime when torch is loaded first); fewer where
 * the weight is small. */
static int matmul(Call *c, int kind, const void *x, const Prologue *pre, int threads) {
    const int64_t blocks = c->k / QK;
    const int dense = kind == KIND_DENSE;
    if (c->m < 0 || c->n < 1 || c->k < (dense ? 1 : QK) || (!dense && c->k % QK) || threads < 1 ||
        (c->dtype != TS_F32 && c->dtype != TS_BF16) || pre->kind < PRE_NONE || pre->kind > PRE_GELU_TANH_MUL ||
        (pre->kind == PRE_RMS_NORM && pre->norm == NULL) ||
        (dense && c->w_dtype != TS_F32 && c->w_dtype != TS_BF16))
        return TS_BAD_ARGS;
    if (c->m == 0) return TS_OK;
    /* one allocation: both halves, then the steps and sums (float-aligned: strides are multiples
     * of 32 bytes); dense: the float rows */
    const int grouped = kind == KIND_Q4;
    c->xq.q_stride = grouped ? (blocks + GROUP - 1) / GROUP * 128 : c->k;
    c->xq.ds_stride = grouped ? (blocks + SCALE_GROUP - 1) / SCALE_GROUP * SCALE_GROUP : blocks;
    const size_t bytes = dense ? (size_t)(c->m * c->k) * sizeof(float)
                               : 2 * (size_t)(c->m * c->xq.q_stride) + 2 * (size_t)(c->m * c->xq.ds_stride) * sizeof(float);
    char *memory = aligned_alloc(64, (bytes + 63) / 64 * 64);  /* whole cache lines: no load splits */
    if (memory == NULL) return TS_NO_MEMORY;
    if (dense) {
        c->xf = (float *)memory;
    } else {
        c->xq.q = (int8_t *)memory;
        c->xq.r = c->xq.q + c->m * c->xq.q_stride;
        c->xq.d = (float *)(memory + 2 * c->m * c->xq.q_stride);
        c->xq.s = c->xq.d + c->m * c->xq.ds_stride;
    }
    const int64_t work = c->n * c->k * (c->m < ROW_TILE ? 1 : c->m / ROW_TILE);
    int64_t most = work / MIN_THREAD_WORK, chunks = (c->n + COL_CHUNK - 1) / COL_CHUNK;
    if (most > chunks) most = chunks;
    if (threads > most) threads = most > 1 ? (int)most : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *row = malloc((size_t)c->k * sizeof(float));  /* this thread's prologue row */
        if (row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < c->m; r++) {
            if (row == NULL) continue;
            if (dense) {
                prologue_row(c->xf + r * c->k, x, r, c->k, c->dtype, pre);
                continue;
            }
            prologue_row(row, x, r, c->k, c->dtype, pre);
            int8_t *q = c->xq.q + r * c->xq.q_stride, *rest = c->xq.r + r * c->xq.q_stride;
            float *d = c->xq.d + r * c->xq.ds_stride, *s = c->xq.s + r * c->xq.ds_stride;
            if (grouped) {  /* the padding: zeros, which leave every lane as it was (q4_tile) */
                const int64_t last = blocks / GROUP * 128;
                memset(q + last, 0, (size_t)(c->xq.q_stride - last));
                memset(rest + last, 0, (size_t)(c->xq.q_stride - last));
                for (int64_t b = blocks; b < c->xq.ds_stride; b++) d[b] = s[b] = 0.0f;
            }
            quantize_row(q, rest, d, s, row, 0, c->k, TS_F32, grouped);
        }
        free(row);
        int stop;
#pragma omp atomic read
        stop = failed;
        if (!stop) {  /* contiguous runs of weight rows per thread, in steps of SPLIT_ROWS */
            const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
            const int64_t units = (c->n + SPLIT_ROWS - 1) / SPLIT_ROWS;
            const int64_t first = units * t / count * SPLIT_ROWS, last = units * (t + 1) / count * SPLIT_ROWS;
            columns(c, kind, first, last < c->n ? last : c->n);
        }
    }
    free(memory);
    return failed ? TS_NO_MEMORY : TS_OK;
}

/* y = x . W^T for an int4 W (layout at the top), with the prologue and bias, residual around it.
 * Returns TS_OK, or TS_BAD_ARGS / TS_NO_MEMORY with nothing written. */
int ts_q4_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const uint8_t *packed,
                 const uint16_t *steps, const uint16_t *lows, int prologue, const void *norm, float eps,
                 const void *bias, const void *residual, int threads) {
    Call c = {.m = m, .k = k, .n = n, .w = packed, .steps = steps, .lows = lows, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul(&c, KIND_Q4, x, &pre, threads);
}

/* y = x . W^T for an int8 W with one scale per row, likewise. */
int ts_q8_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const int8_t *weight,
                 const float *scales, int prologue, const void *norm, float eps, const void *bias,
                 const void *residual, int threads) {
    Call c = {.m = m, .k = k, .n = n, .w = (const uint8_t *)weight, .scales = scales, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul(&c, KIND_Q8, x, &pre, threads);
}

/* y = x . W^T for a float32 or bfloat16 W [n, k] (w_dtype), likewise; any k. */
int ts_dense_matmul(const void *x, void *y, int dtype, int64_t m, int64_t k, int64_t n, const void *weight,
                    int w_dtype, int prologue, const void *norm, float eps, const void *bias,
                    const void *residual, int threads) {
    Call c = {.m = m, .k = k, .n = n, .wf = weight, .w_dtype = w_dtype, .y = y, .dtype = dtype,
              .bias = bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul(&c, KIND_DENSE, x, &pre, threads);
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

static int stack_linear(const StackLinear *l, const float *x, float *y, int64_t m, int prologue, const void *norm,
                        float eps, const float *residual, int threads) {
    if (l->kind != KIND_Q4 && l->kind != KIND_Q8) return TS_BAD_ARGS;
    Call c = {.m = m, .k = l->k, .n = l->n, .w = l->w, .steps = l->steps, .lows = l->lows, .scales = l->scales,
              .y = y, .dtype = TS_F32, .bias = l->bias, .residual = residual};
    const Prologue pre = {prologue, norm, eps};
    return matmul(&c, (int)l->kind, x, &pre, threads);
}

/* x [n, hidden] float32 through `count` layers, in place. activation: PRE_SILU_MUL or
 * PRE_GELU_TANH_MUL (the MLP's); places, positions: each token's (as ts_rope_attention takes
 * them); k_caches, v_caches [count]: each layer's cache [place_count, kv_heads, cache_rows[i],
 * head_dim] in cache_dtype. Returns TS_OK, or the first failing call's status (x then holds
 * part of the way). */
int ts_decoder_stack(const StackLayer *layers, int64_t count, float *x, int64_t n, int64_t hidden,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int activation, float eps, float scale,
                     float cap, int cache_dtype, void *const *k_caches, void *const *v_caches,
                     const int64_t *cache_rows, int64_t place_count, const int64_t *places,
                     const int64_t *positions, int threads) {
    if (count < 0 || n < 0 || hidden < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads ||
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
    float *work = malloc((size_t)(n * (widest + heads * head_dim)) * sizeof(float));
    if (work == NULL) return TS_NO_MEMORY;
    float *wide = work, *attended = work + n * widest;  /* [n, qkv or gate/up], [n, heads * d] */
    int status = TS_OK;
    for (int64_t i = 0; i < count && status == TS_OK; i++) {
        const StackLayer *l = &layers[i];
        status = stack_linear(&l->qkv, x, wide, n, PRE_RMS_NORM, l->norm1, eps, NULL, threads);
        if (status == TS_OK)
            status = ts_rope_attention(TS_F32, cache_dtype, wide, l->cos, l->sin, l->table_positions, k_caches[i],
                                       v_caches[i], attended, places, positions, n, place_count, kv_heads,
                                       heads / kv_heads, head_dim, cache_rows[i], l->window, scale, cap, threads);
        if (status == TS_OK) status = stack_linear(&l->o, attended, x, n, PRE_NONE, NULL, 0.0f, x, threads);
        if (status == TS_OK) status = stack_linear(&l->gate_up, x, wide, n, PRE_RMS_NORM, l->norm2, eps, NULL, threads);
        if (status == TS_OK) status = stack_linear(&l->down, wide, x, n, activation, NULL, 0.0f, x, threads);
    }
    free(work);
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
