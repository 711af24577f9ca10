/* The 256-bit lanes that the AVX2 and AVX-512 builds share (not an ISA of its own: isa/avx2.h and
 * isa/avx512.h include it, then define what differs, dot4_heads and weighted_heads among it).
 * Built with -mavx2 -mfma -mf16c. Every lane adds what the portable code adds, in its order, or a
 * fixed tree named here; both builds then sum alike (tested). */
#ifndef TS_ISA_AVX2_LANES_H
#define TS_ISA_AVX2_LANES_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../attention.h"
#include "../common.h"
#include "../matmul.h"

static inline __m256 load8(const void *base, int64_t index, int dtype) {
    if (dtype == TS_F32) return _mm256_loadu_ps((const float *)base + index);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* hsum8 of four registers at once, each value summed as hsum8 sums it (the same additions of the
 * same pairs, in the same order): lanes 0, 4, 1, 5 of the result hold a's, b's, c's, d's. */
static inline __m256 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    /* hsum8's first step, lo128 + hi128: [a's 4 | b's 4], [c's 4 | d's 4] */
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    /* its second, s0 + s2 and s1 + s3: [a a c c | b b d d] */
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    /* its last, (s0 + s2) + (s1 + s3) */
    return _mm256_add_ps(_mm256_shuffle_ps(z, z, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(z, z, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp_neg (common.h) in 8 lanes: the same polynomial, so the same values. */
static inline __m256 exp_neg8(__m256 x) {
    __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LOW), _CMP_LT_OQ);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(P0), r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    /* n is clamped so that lanes below EXP_LOW (zeroed next) do not overflow the exponent */
    __m256i e = _mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.0f)));
    __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(low, _mm256_mul_ps(p, scale));
}

/* Ask for the line at p into L1 (prefetches change no value). always_inline: gcc drops the calls
 * of a function of prefetches alone, which has no effect it sees (tested). */
static inline __attribute__((always_inline)) void ask(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

/* ---- matmul.c */

/* quantize_block (isa/generic.h) in 8 lanes: the largest size by a max tree, the values rounded
 * alike, their sum exact in int32. */
static inline __attribute__((always_inline)) float quantize_block(const float *at, int8_t *qs, int8_t *rs,
                                                                  int32_t *sum_out) {
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
        high[i] = _mm256_srai_epi32(_mm256_add_epi32(value, _mm256_set1_epi32(V_BASE / 2)), V_SHIFT);
        low[i] = _mm256_sub_epi32(value, _mm256_slli_epi32(high[i], V_SHIFT));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    /* packs interleave the 128-bit lanes; the permutation puts the 32 values back in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(high[0], high[1]), _mm256_packs_epi32(high[2], high[3]));
    const __m256i r8 = _mm256_packs_epi16(_mm256_packs_epi32(low[0], low[1]), _mm256_packs_epi32(low[2], low[3]));
    _mm256_storeu_si256((__m256i *)qs, _mm256_permutevar8x32_epi32(q8, order));
    _mm256_storeu_si256((__m256i *)rs, _mm256_permutevar8x32_epi32(r8, order));
    *sum_out = _mm_cvtsi128_si32(s4);
    return d;
}

/* sum of x[i]^2 over k values: the whole eights in 8 lane chains, then hsum8's tree, then the last
 * k % 8 values one by one (an order fixed by k; nothing read past the row's k values). */
static __attribute__((unused)) float sum_squares(const void *x, int64_t at, int64_t k, int dtype) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 v = load8(x, at + i, dtype);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum8(acc);
    for (; i < k; i++) sum = fmaf(load1(x, at + i, dtype), load1(x, at + i, dtype), sum);
    return sum;
}

/* silu(g) * u (matmul.c's silu_mul) for whole eights of inputs, g at x[at..], u k further. */
static inline __attribute__((always_inline)) int64_t silu_mul_lanes(float *a, const void *x, int64_t at, int64_t k,
                                                                    int dtype) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= k; i += 8) {
        const __m256 g = load8(x, at + i, dtype), u = load8(x, at + k + i, dtype);
        const __m256 e = exp_neg8(_mm256_or_ps(g, sign));  /* exp(-|g|) */
        const __m256 positive = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
    return i;
}

/* a = x * by * norm (x alone where norm is NULL) for whole eights of inputs. */
static inline __attribute__((always_inline)) int64_t scale_lanes(float *a, const void *x, int64_t at, int64_t k,
                                                                 int dtype, float by_value, const void *norm) {
    int64_t i = 0;
    const __m256 by = _mm256_set1_ps(by_value);
    for (; i + 8 <= k; i += 8) {
        __m256 v = load8(x, at + i, dtype);
        if (norm != NULL) v = _mm256_mul_ps(_mm256_mul_ps(v, by), load8(norm, i, dtype));
        _mm256_storeu_ps(a + i, v);
    }
    return i;
}

/* y[r, c] for R rows from `row` and C (1 or 2) float weight rows from `col` (dense): x . w in 8
 * lanes of k, one accumulator per (r, c), then the lanes added in a fixed order and the last
 * k % 8 inputs one by one. Which way a value is summed depends on k alone, so a row's numbers
 * do not depend on the rows or columns beside it; the AVX-512 build runs this same code. */
static inline void dense_tile(const Matmul *c, int64_t row, int R, int64_t col, int C) {
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

/* ---- attention.c */

/* q . k over d values, in an order fixed by d alone: two 8-lane chains and hsum8 where d % 16
 * == 0, else one value at a time. */
static __attribute__((unused)) float dot(const float *q, const void *k, int64_t k_at, int64_t d, int dtype) {
    if (d % 16 == 0) {
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, k_at + i, dtype), a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k, k_at + i + 8, dtype), b);
        }
        return hsum8(_mm256_add_ps(a, b));
    }
    return dot1(q, k, k_at, d, dtype);
}

/* q . k_r for the 8 key rows r at k_at, k_at + d, ... (d % 8 == 0): each row's products summed
 * in one lane chain, then the 8 rows' lanes added in one transpose -> the 8 scores. */
static inline __m256 dot8(const float *q, const void *k, int64_t k_at, int64_t d, int dtype) {
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qv, load8(k, k_at + r * d + i, dtype), a[r]);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* scores[j] = q . k_j for whole eights of the count key rows from k_at (dot8; d % 8 == 0, else
 * none), their maximum folded into *max; returns how many. */
static inline __attribute__((always_inline)) int64_t scores_lanes(float *scores, const float *q, const void *k,
                                                                  int64_t k_at, int64_t count, int64_t d, int dtype,
                                                                  float *max) {
    int64_t j = 0;
    if (d % 8 == 0) {
        __m256 m = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= count; j += 8) {
            const __m256 s = dot8(q, k, k_at + j * d, d, dtype);
            _mm256_storeu_ps(scores + j, s);
            m = _mm256_max_ps(m, s);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int r = 0; r < 8; r++) *max = lanes[r] > *max ? lanes[r] : *max;
    }
    return j;
}

/* out[i] = sum over j < count of p[j] * v_j[i] for the leading whole eights of elements, one
 * fused multiply-add at a time in j's order (going on from out[i] with `more`); returns how many. */
static inline __attribute__((always_inline)) int64_t weighted_lanes(float *out, const float *p, const void *v,
                                                                    int64_t v_at, int64_t count, int64_t d, int dtype,
                                                                    int more) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = more ? _mm256_loadu_ps(out + i + 8 * r) : _mm256_setzero_ps();
        for (int64_t j = 0; j < count; j++) {
            const __m256 w = _mm256_set1_ps(p[j]);
            for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(w, load8(v, v_at + j * d + i + 8 * r, dtype), a[r]);
        }
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(out + i + 8 * r, a[r]);
    }
    for (; i + 8 <= d; i += 8) {
        __m256 a = more ? _mm256_loadu_ps(out + i) : _mm256_setzero_ps();
        for (int64_t j = 0; j < count; j++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v, v_at + j * d + i, dtype), a);
        _mm256_storeu_ps(out + i, a);
    }
    return i;
}

/* p[i] = exp(p[i] - max) for whole eights of the count scores, their sum (8 lane chains, then
 * hsum8) into *sum; returns how many. */
static inline __attribute__((always_inline)) int64_t softmax_lanes(float *p, int64_t count, float max, float *sum) {
    int64_t i = 0;
    __m256 m = _mm256_set1_ps(max), acc = _mm256_setzero_ps();
    for (; i + 8 <= count; i += 8) {
        __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
        _mm256_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    *sum = hsum8(acc);
    return i;
}

/* What each build including these lanes defines its own way (isa/avx2.h, isa/avx512.h):
 * dot4_heads: scores of G query heads (q, G rows of d) against the 4 key rows at k_at, k_at + d,
 * ... (d % 8 == 0), each key row read once for the G heads: out[g] holds head g's 4 scores, each
 * summed as dot8 sums it (one lane chain over d, then the same pairs of lanes added).
 * weighted_heads: weighted_lanes for G query heads at once (out[g], d apart; p[g], stride apart),
 * each value row read once for them (d % 16 == 0): every element's products added in position
 * order, as weighted_lanes adds them. */
static inline __attribute__((always_inline)) void dot4_heads(__m128 *out, const float *q, int G, const void *k,
                                                            int64_t k_at, int64_t d, int dtype);
static inline __attribute__((always_inline)) void weighted_heads(float *out, const float *p, int64_t stride, int G,
                                                                const void *v, int64_t v_at, int64_t count, int64_t d,
                                                                int dtype, int more);

/* scores of G query heads at once (scores[g], stride apart; q, d apart), each key row read once
 * for them: the same scores as scores_lanes and dot (whole eights of keys by dot4_heads, the rest
 * by dot) and each head's maximum folded into max[g]. */
static inline __attribute__((always_inline)) void scores_heads(float *scores, int64_t stride, const float *q, int G,
                                                              const void *k, int64_t k_at, int64_t count, int64_t d,
                                                              int dtype, float *max) {
    int64_t j = 0;
    __m128 m[HEADS_AT_ONCE];
    for (int g = 0; g < G; g++) m[g] = _mm_set1_ps(-INFINITY);
    for (; j + 8 <= count; j += 8)  /* dot8's eights, as two fours */
        for (int64_t four = j; four < j + 8; four += 4) {
            __m128 s[HEADS_AT_ONCE];
            dot4_heads(s, q, G, k, k_at + four * d, d, dtype);
            for (int g = 0; g < G; g++) {
                _mm_storeu_ps(scores + g * stride + four, s[g]);
                m[g] = _mm_max_ps(m[g], s[g]);
            }
        }
    for (int g = 0; g < G; g++) {
        float lanes[4];
        _mm_storeu_ps(lanes, m[g]);
        for (int r = 0; r < 4; r++) max[g] = lanes[r] > max[g] ? lanes[r] : max[g];
        for (int64_t t = j; t < count; t++) {
            scores[g * stride + t] = dot(q + g * d, k, k_at + t * d, d, dtype);
            max[g] = scores[g * stride + t] > max[g] ? scores[g * stride + t] : max[g];
        }
    }
}

/* scores_heads for G (<= HEADS_AT_ONCE) heads where d % 16 == 0 (a constant G per call site);
 * 0 where d does not fit: the driver takes them one by one. */
static inline __attribute__((always_inline)) int scores_together(float *p, int64_t stride, const float *q, int G,
                                                                 const void *k, int64_t at, int64_t n, int64_t d,
                                                                 int dtype, float *max) {
    if (d % 16 != 0) return 0;
    switch (G) {
    case 3: scores_heads(p, stride, q, 3, k, at, n, d, dtype, max); return 1;
    case 2: scores_heads(p, stride, q, 2, k, at, n, d, dtype, max); return 1;
    default: scores_heads(p, stride, q, 1, k, at, n, d, dtype, max); return 1;
    }
}

/* weighted_heads likewise. */
static inline __attribute__((always_inline)) int values_together(float *out, const float *p, int64_t stride, int G,
                                                                 const void *v, int64_t at, int64_t n, int64_t d,
                                                                 int dtype, int more) {
    if (d % 16 != 0) return 0;
    switch (G) {
    case 3: weighted_heads(out, p, stride, 3, v, at, n, d, dtype, more); return 1;
    case 2: weighted_heads(out, p, stride, 2, v, at, n, d, dtype, more); return 1;
    default: weighted_heads(out, p, stride, 1, v, at, n, d, dtype, more); return 1;
    }
}

#endif
