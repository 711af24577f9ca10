/* The portable primitives (isa.h): plain C, one value at a time, for any CPU; the other ISAs'
 * lanes compute what these compute, in their order. */
#ifndef TS_ISA_GENERIC_H
#define TS_ISA_GENERIC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../common.h"
#include "../matmul.h"

#define ROWS 1

static inline float half_to_float(uint16_t h) {
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
}

/* ---- matmul.c */

/* One block of QK floats at x as halves q and r (v = 2^V_SHIFT q + r = round(x / d)); returns the
 * block's step d = max|x| / V_MAX, sum(v) into *sum. */
static inline __attribute__((always_inline)) float quantize_block(const float *at, int8_t *qs, int8_t *rs,
                                                                  int32_t *sum) {
    float max = 0.0f;
    for (int i = 0; i < QK; i++) max = fabsf(at[i]) > max ? fabsf(at[i]) : max;
    const float d = max / V_MAX, id = max > 0.0f ? V_MAX / max : 0.0f;
    int32_t sum_v = 0;
    for (int i = 0; i < QK; i++) {
        const int value = (int)nearbyintf(at[i] * id);
        const int high = (value + V_BASE / 2) >> V_SHIFT;  /* floor: an arithmetic shift, as srai */
        qs[i] = (int8_t)high;
        rs[i] = (int8_t)(value - high * V_BASE);
        sum_v += value;
    }
    *sum = sum_v;
    return d;
}

/* sum of x[i]^2 over k values, in order. */
static __attribute__((unused)) float sum_squares(const void *x, int64_t at, int64_t k, int dtype) {
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum = fmaf(load1(x, at + i, dtype), load1(x, at + i, dtype), sum);
    return sum;
}

/* No lanes: every input goes through the driver's one-value loop. */
static inline int64_t silu_mul_lanes(float *a, const void *x, int64_t at, int64_t k, int dtype) {
    (void)a, (void)x, (void)at, (void)k, (void)dtype;
    return 0;
}

static inline int64_t scale_lanes(float *a, const void *x, int64_t at, int64_t k, int dtype, float by,
                                  const void *norm) {
    (void)a, (void)x, (void)at, (void)k, (void)dtype, (void)by, (void)norm;
    return 0;
}

/* The q4 sums (matmul.c's top), one weight row at a time. */
static inline void q4_tile(const Matmul *c, int64_t row, int R, int64_t col) {
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
                        dot += lo * (V_BASE * q[4 * u + i] + rest[4 * u + i]);
                        dot += hi * (V_BASE * q[16 + 4 * u + i] + rest[16 + 4 * u + i]);
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

/* The q8 sums, one weight row at a time. */
static inline void q8_tile(const Matmul *c, int64_t row, int R, int64_t col) {
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
                    for (int i = 0; i < 4; i++) dot += p[64 * u + i] * (V_BASE * q[4 * u + i] + rest[4 * u + i]);
                acc = fmaf((float)dot, c->xq.d[(row + r) * blocks + b], acc);
            }
            values[j] = acc * c->scales[col + j];
        }
        emit_tile(c, row + r, col, values);
    }
}

/* q4_tile / q8_tile for the one activation row a tile takes here. */
static __attribute__((noinline, unused)) void quant_tiles(const Matmul *c, int kind, int64_t row, int R, int64_t col) {
    (void)R;
    if (kind == KIND_Q4) q4_tile(c, row, 1, col);
    else q8_tile(c, row, 1, col);
}

/* y[r, c] for R rows from `row` and C float weight rows from `col` (dense): x . w one input at
 * a time, in order. */
static inline void dense_tile(const Matmul *c, int64_t row, int R, int64_t col, int C) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            float value = 0.0f;
            for (int64_t t = 0; t < c->k; t++)
                value = fmaf(c->xf[(row + r) * c->k + t], load1(c->wf, (col + j) * c->k + t, c->w_dtype), value);
            emit(c, row + r, col + j, value);
        }
}

/* ---- attention.c */

static __attribute__((unused)) float dot(const float *q, const void *k, int64_t k_at, int64_t d, int dtype) {
    return dot1(q, k, k_at, d, dtype);
}

/* No lanes: the driver's loops take every score, element and numerator, one head at a time. */
static inline int64_t scores_lanes(float *scores, const float *q, const void *k, int64_t k_at, int64_t count,
                                   int64_t d, int dtype, float *max) {
    (void)scores, (void)q, (void)k, (void)k_at, (void)count, (void)d, (void)dtype, (void)max;
    return 0;
}

static inline int64_t weighted_lanes(float *out, const float *p, const void *v, int64_t v_at, int64_t count,
                                     int64_t d, int dtype, int more) {
    (void)out, (void)p, (void)v, (void)v_at, (void)count, (void)d, (void)dtype, (void)more;
    return 0;
}

static inline int64_t softmax_lanes(float *p, int64_t count, float max, float *sum) {
    (void)p, (void)count, (void)max, (void)sum;
    return 0;
}

static inline int scores_together(float *scores, int64_t stride, const float *q, int G, const void *k,
                                  int64_t k_at, int64_t count, int64_t d, int dtype, float *max) {
    (void)scores, (void)stride, (void)q, (void)G, (void)k, (void)k_at, (void)count, (void)d, (void)dtype, (void)max;
    return 0;
}

static inline int values_together(float *out, const float *p, int64_t stride, int G, const void *v, int64_t v_at,
                                  int64_t count, int64_t d, int dtype, int more) {
    (void)out, (void)p, (void)stride, (void)G, (void)v, (void)v_at, (void)count, (void)d, (void)dtype, (void)more;
    return 0;
}

/* ---- greedy.c */

static inline int64_t greedy_lanes(const float *v, int64_t n, float *best, float *big, int *finite) {
    (void)v, (void)n, (void)best, (void)big, (void)finite;
    return 0;
}

static inline int64_t first_equal_lanes(const float *v, int64_t n, float best, int64_t *reached) {
    (void)v, (void)n, (void)best;
    *reached = 0;
    return -1;
}

#endif
