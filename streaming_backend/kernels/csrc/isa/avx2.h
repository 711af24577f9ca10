/* The AVX2 primitives (isa.h): the shared 256-bit lanes (isa/avx2_lanes.h), a quantized tile as
 * two halves of 8 weight rows (q4 for one activation row: both halves at once), and the greedy
 * pick's 8-lane scan. Built with -mavx2 -mfma -mf16c. */
#ifndef TS_ISA_AVX2_H
#define TS_ISA_AVX2_H

#include "avx2_lanes.h"

/* ---- matmul.c */

#define ROWS 2

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
static inline __attribute__((always_inline)) void q4_tile(const Matmul *c, int64_t row, int R, int64_t col) {
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
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(high, V_SHIFT), rest));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(step, _mm256_set1_ps(c->xq.d[ds])), acc[r]);
                low[r] = _mm256_fmadd_ps(low8, _mm256_set1_ps(c->xq.s[ds]), low[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(values[r] + 8 * half, _mm256_add_ps(acc[r], low[r]));
    }
    for (int r = 0; r < R; r++) emit_tile(c, row + r, col, values[r]);
}

/* q4 for the tile's 16 weight rows at once, two registers of 8, against one activation row (a
 * call of one row: a single stream's step, or the last row of an odd count). Each unit of 4
 * inputs (its q or r half), broadcast once, meets both registers' nibbles, so a broadcast serves
 * 16 weight rows and a block is read in one pass: 1.3x q4_tile's speed for one row on a Zen 3;
 * for two rows the sums do not fit the 16 registers, and q4_tile is faster. A block's u8-by-s8
 * pair sums add up in int16 per register (every sum below 2^15: 8 * 2 * 15 * 127), then widen to
 * int32: l . q and l . r of 16 weight rows, exact, so the order of the integer additions changes
 * nothing; the float sums after are q4_tile's, block after block. */
static inline __attribute__((always_inline)) void q4_tile_wide(const Matmul *c, int64_t row, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const uint8_t *w = c->w + col * (k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, low[2] = {acc[0], acc[1]};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * Q4_BLOCK_BYTES;
        for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
        __m256i high[2], rest[2];
        high[0] = high[1] = rest[0] = rest[1] = _mm256_setzero_si256();
        for (int u = 0; u < 4; u++) {
            const int64_t at = row * k + b * QK + 4 * u;
            const __m256i q_lo = _mm256_set1_epi32(four(c->xq.q + at)), q_hi = _mm256_set1_epi32(four(c->xq.q + at + 16));
            const __m256i r_lo = _mm256_set1_epi32(four(c->xq.r + at)), r_hi = _mm256_set1_epi32(four(c->xq.r + at + 16));
            for (int half = 0; half < 2; half++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 64 * u + 32 * half));
                const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
                high[half] = _mm256_add_epi16(high[half], _mm256_add_epi16(_mm256_maddubs_epi16(lo, q_lo), _mm256_maddubs_epi16(hi, q_hi)));
                rest[half] = _mm256_add_epi16(rest[half], _mm256_add_epi16(_mm256_maddubs_epi16(lo, r_lo), _mm256_maddubs_epi16(hi, r_hi)));
            }
        }
        const int64_t ds = row * blocks + b;
        for (int half = 0; half < 2; half++) {
            const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(steps + b * TILE + 8 * half)));
            const __m256 low8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(lows + b * TILE + 8 * half)));
            const __m256i h = _mm256_madd_epi16(high[half], ones), l = _mm256_madd_epi16(rest[half], ones);
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(h, V_SHIFT), l));
            acc[half] = _mm256_fmadd_ps(dot, _mm256_mul_ps(step, _mm256_set1_ps(c->xq.d[ds])), acc[half]);
            low[half] = _mm256_fmadd_ps(low8, _mm256_set1_ps(c->xq.s[ds]), low[half]);
        }
    }
    float values[TILE];
    for (int half = 0; half < 2; half++) _mm256_storeu_ps(values + 8 * half, _mm256_add_ps(acc[half], low[half]));
    emit_tile(c, row, col, values);
}

/* l . a of 8 weight rows for one 4-input unit, exact: |l| meets a with l's sign (each pair sum
 * at most 2 * 127 * 127, below 2^15). */
static inline __m256i q8_unit(__m256i l, __m256i magnitude, const int8_t *a) {
    const __m256i signed_a = _mm256_sign_epi8(_mm256_set1_epi32(four(a)), l);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_a), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void q8_tile(const Matmul *c, int64_t row, int R, int64_t col) {
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
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(high[r], V_SHIFT), rest[r]));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(c->xq.d[(row + r) * blocks + b]), acc[r]);
            }
        }
        const __m256 scales = _mm256_loadu_ps(c->scales + col + 8 * half);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(values[r] + 8 * half, _mm256_mul_ps(acc[r], scales));
    }
    for (int r = 0; r < R; r++) emit_tile(c, row + r, col, values[r]);
}

/* q8_tile for one activation row with both halves at once, as q4_tile_wide: each unit's
 * broadcast serves 16 weight rows and a block is read in one pass; the same sums. */
static inline __attribute__((always_inline)) void q8_tile_wide(const Matmul *c, int64_t row, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const int8_t *w = (const int8_t *)c->w + col * k;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *p = w + b * Q8_BLOCK_BYTES;
        for (int line = 0; line < Q8_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
        __m256i high[2], rest[2];
        high[0] = high[1] = rest[0] = rest[1] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            const int64_t at = row * k + b * QK + 4 * i;
            const __m256i q = _mm256_set1_epi32(four(c->xq.q + at)), r = _mm256_set1_epi32(four(c->xq.r + at));
            for (int half = 0; half < 2; half++) {
                const __m256i l = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * half));
                const __m256i magnitude = _mm256_sign_epi8(l, l), one = _mm256_set1_epi16(1);
                high[half] = _mm256_add_epi32(high[half], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, l)), one));
                rest[half] = _mm256_add_epi32(rest[half], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(r, l)), one));
            }
        }
        const __m256 d = _mm256_set1_ps(c->xq.d[row * blocks + b]);
        for (int half = 0; half < 2; half++) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(high[half], V_SHIFT), rest[half]));
            acc[half] = _mm256_fmadd_ps(dot, d, acc[half]);
        }
    }
    float values[TILE];
    for (int half = 0; half < 2; half++)
        _mm256_storeu_ps(values + 8 * half, _mm256_mul_ps(acc[half], _mm256_loadu_ps(c->scales + col + 8 * half)));
    emit_tile(c, row, col, values);
}

/* q4_tile / q8_tile for R activation rows, a constant R per call site (so each is unrolled); one
 * row: q4_tile_wide / q8_tile_wide. */
static __attribute__((noinline, unused)) void quant_tiles(const Matmul *c, int kind, int64_t row, int R, int64_t col) {
    if (R == 2) {
        if (kind == KIND_Q4) q4_tile(c, row, 2, col);
        else q8_tile(c, row, 2, col);
    } else {
        if (kind == KIND_Q4) q4_tile_wide(c, row, col);
        else q8_tile_wide(c, row, col);
    }
}

/* ---- attention.c: dot4_heads and weighted_heads (as isa/avx2_lanes.h describes them) */

static inline __attribute__((always_inline)) void dot4_heads(__m128 *out, const float *q, int G, const void *k,
                                                            int64_t k_at, int64_t d, int dtype) {
    __m256 a[HEADS_AT_ONCE][4];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < 4; r++) a[g][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 key[4];
        for (int r = 0; r < 4; r++) key[r] = load8(k, k_at + r * d + i, dtype);
        for (int g = 0; g < G; g++) {
            const __m256 qv = _mm256_loadu_ps(q + g * d + i);
            for (int r = 0; r < 4; r++) a[g][r] = _mm256_fmadd_ps(qv, key[r], a[g][r]);
        }
    }
    for (int g = 0; g < G; g++) {
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
        out[g] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    }
}

static inline __attribute__((always_inline)) void weighted_heads(float *out, const float *p, int64_t stride, int G,
                                                                const void *v, int64_t v_at, int64_t count, int64_t d,
                                                                int dtype, int more) {
    for (int64_t i = 0; i < d; i += 16) {
        __m256 a[HEADS_AT_ONCE][2];
        for (int g = 0; g < G; g++)
            for (int r = 0; r < 2; r++) a[g][r] = more ? _mm256_loadu_ps(out + g * d + i + 8 * r) : _mm256_setzero_ps();
        for (int64_t j = 0; j < count; j++) {
            const __m256 v0 = load8(v, v_at + j * d + i, dtype), v1 = load8(v, v_at + j * d + i + 8, dtype);
            for (int g = 0; g < G; g++) {
                const __m256 w = _mm256_set1_ps(p[g * stride + j]);
                a[g][0] = _mm256_fmadd_ps(w, v0, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(w, v1, a[g][1]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int r = 0; r < 2; r++) _mm256_storeu_ps(out + g * d + i + 8 * r, a[g][r]);
    }
}

/* ---- greedy.c */

/* The largest value, largest size and finiteness of whole eights of v's n values (a max of
 * finite values is exact in any order); returns how many it took. */
static inline int64_t greedy_lanes(const float *v, int64_t n, float *best_out, float *big_out, int *finite) {
    int64_t i = 0;
    float best = *best_out, big = *big_out;
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
    *finite = _mm256_movemask_ps(odd) == 0;
    for (int l = 0; l < 8; l++) {
        best = lanes[l] > best ? lanes[l] : best;
        big = sizes[l] > big ? sizes[l] : big;
    }
    *best_out = best, *big_out = big;
    return i;
}

/* The first index of `best` among whole eights of v's n values, -1 where none holds it; how far
 * it looked into *reached. */
static inline int64_t first_equal_lanes(const float *v, int64_t n, float best, int64_t *reached) {
    int64_t i = 0;
    const __m256 want = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    *reached = i;
    return -1;
}

#endif
