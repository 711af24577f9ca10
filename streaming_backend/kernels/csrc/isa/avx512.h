/* The AVX-512 primitives (isa.h), with VNNI: the shared 256-bit lanes (isa/avx2_lanes.h), a
 * quantized tile's 16 weight rows in one register's lanes (integer dot products two blocks an
 * instruction), the attention's two key rows or 16 values a register, the greedy pick's 16-lane
 * scan. Built with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512vnni (and AVX2's flags).
 * The same sums as the AVX2 build's, lane for lane (tested). */
#ifndef TS_ISA_AVX512_H
#define TS_ISA_AVX512_H

#include "avx2_lanes.h"

/* ---- matmul.c */

#define ROWS 8

/* y for R activation rows from row and the tile at col: q4's sums (acc + lows), q8's (acc times
 * the weight rows' scales). */
static inline __attribute__((always_inline)) void emit_q4_rows(const Matmul *c, int64_t row, int R, int64_t col,
                                                               const __m512 *acc, const __m512 *low) {
    for (int r = 0; r < R; r++) {
        float values[TILE];
        _mm512_storeu_ps(values, _mm512_add_ps(acc[r], low[r]));
        emit_tile(c, row + r, col, values);
    }
}

static inline __attribute__((always_inline)) void emit_q8_rows(const Matmul *c, int64_t row, int R, int64_t col,
                                                               const __m512 *acc) {
    const __m512 scales = _mm512_loadu_ps(c->scales + col);
    for (int r = 0; r < R; r++) {
        float values[TILE];
        _mm512_storeu_ps(values, _mm512_mul_ps(acc[r], scales));
        emit_tile(c, row + r, col, values);
    }
}

/* acc + the dot products of w's bytes (unsigned) with the 4 activation bytes at p (signed),
 * broadcast from memory by the instruction itself ({1to16}): one fused micro-op, where gcc turns
 * _mm512_dpbusd_epi32 of _mm512_set1_epi32 into a vpbroadcastd and a vpdpbusd. With 16 dot products
 * a row and block, the separate broadcasts were a third of a tile's instructions: at 8 and 16 rows
 * the q4 tiles take 1.06-1.15x and the q8 ones 1.26-1.32x less time (one thread, in-process A/B).
 * The same products and sums. */
static inline __attribute__((always_inline)) __m512i dot_at(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* The 16 weight rows' D = l . v = 16 (l . q) + l . r of one block, exact int32 in lanes, from l
 * (lo[p]: inputs 4p.., hi[p]: inputs 16 + 4p.., as the layout pairs them) and 16 l (lo16, hi16:
 * bytes up to 240, still unsigned bytes): 16 l . q and l . r go into the same integer sums, so
 * the factor of 16 costs no shift or add per activation row, only one per weight register. Two
 * chains of eight (integers: exact in any order); the rows of a tile overlap their latency. */
static inline __m512i q4_dot(const __m512i lo[4], const __m512i hi[4], const __m512i lo16[4],
                             const __m512i hi16[4], const int8_t *q, const int8_t *r) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i a[4];
    for (int p = 0; p < 4; p += 2) {
        a[p] = dot_at(zero, lo16[p], q + 4 * p);
        a[p + 1] = dot_at(zero, hi16[p], q + 16 + 4 * p);
    }
    for (int p = 0; p < 4; p += 2) {
        a[p] = dot_at(a[p], lo16[p + 1], q + 4 * p + 4);
        a[p + 1] = dot_at(a[p + 1], hi16[p + 1], q + 20 + 4 * p);
    }
    for (int p = 0; p < 4; p += 2) {
        a[p] = dot_at(a[p], lo[p], r + 4 * p);
        a[p + 1] = dot_at(a[p + 1], hi[p], r + 16 + 4 * p);
    }
    for (int p = 0; p < 4; p += 2) {
        a[p] = dot_at(a[p], lo[p + 1], r + 4 * p + 4);
        a[p + 1] = dot_at(a[p + 1], hi[p + 1], r + 20 + 4 * p);
    }
    return _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
}

static inline __attribute__((always_inline)) void q4_tile(const Matmul *c, int64_t row, int R, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const uint8_t *w = c->w + col * (k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    const __m512i nibble = _mm512_set1_epi8(0x0f), upper = _mm512_set1_epi8((char)0xf0);
    __m512 acc[ROWS], low[ROWS];
    for (int r = 0; r < R; r++) acc[r] = low[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w + b * Q4_BLOCK_BYTES;
        for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
        if (b % 2 == 0) {
            ask(steps + b * TILE + WEIGHTS_AHEAD / 8);
            ask(lows + b * TILE + WEIGHTS_AHEAD / 8);
        }
        __m512i lo[4], hi[4], lo16[4], hi16[4];
        for (int u = 0; u < 4; u++) {
            const __m512i raw = _mm512_loadu_si512(p + 64 * u);
            lo[u] = _mm512_and_si512(raw, nibble);
            hi16[u] = _mm512_and_si512(raw, upper);
            /* shifts of 16-bit lanes: each byte's nibble moves within its byte */
            lo16[u] = _mm512_slli_epi16(lo[u], V_SHIFT);
            hi[u] = _mm512_srli_epi16(hi16[u], V_SHIFT);
        }
        const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + b * TILE)));
        const __m512 low16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lows + b * TILE)));
        for (int r = 0; r < R; r++) {
            const int64_t at = (row + r) * k + b * QK, ds = (row + r) * blocks + b;
            const __m512 dot = _mm512_cvtepi32_ps(q4_dot(lo, hi, lo16, hi16, c->xq.q + at, c->xq.r + at));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(step, _mm512_set1_ps(c->xq.d[ds])), acc[r]);
            low[r] = _mm512_fmadd_ps(low16, _mm512_set1_ps(c->xq.s[ds]), low[r]);
        }
    }
    emit_q4_rows(c, row, R, col, acc, low);
}

/* q8 with VNNI's unsigned-by-signed products: the weights as l + 128 (unsigned), so each block's
 * dot product comes out 128 * sum(v) too large, taken off exactly (sv). */
static inline __attribute__((always_inline)) void q8_tile(const Matmul *c, int64_t row, int R, int64_t col) {
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
                a = dot_at(a, u[i], q + 4 * i);
                e = dot_at(e, u[i + 1], q + 4 * i + 4);
            }
            a = _mm512_slli_epi32(_mm512_add_epi32(a, e), V_SHIFT);
            e = _mm512_sub_epi32(zero, _mm512_set1_epi32(c->xq.sv[ds]));
            for (int i = 0; i < 8; i += 2) {
                a = dot_at(a, u[i], rest + 4 * i);
                e = dot_at(e, u[i + 1], rest + 4 * i + 4);
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a, e));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(c->xq.d[ds]), acc[r]);
        }
    }
    emit_q8_rows(c, row, R, col, acc);
}

/* q4_tile / q8_tile for R activation rows, a constant R per call site (so each is unrolled). */
static __attribute__((noinline, unused)) void quant_tiles(const Matmul *c, int kind, int64_t row, int R, int64_t col) {
#define TILE_CASE(n) \
    case n: \
        if (kind == KIND_Q4) q4_tile(c, row, n, col); \
        else q8_tile(c, row, n, col); \
        break;
    switch (R) {
    TILE_CASE(8)
    TILE_CASE(7)
    TILE_CASE(6)
    TILE_CASE(5)
    TILE_CASE(4)
    TILE_CASE(3)
    TILE_CASE(2)
    default:
        if (kind == KIND_Q4) q4_tile(c, row, 1, col);
        else q8_tile(c, row, 1, col);
    }
#undef TILE_CASE
}

/* ---- attention.c: dot4_heads and weighted_heads (as isa/avx2_lanes.h describes them) */

/* The same on AVX-512: key rows 0 and 1 side by side in one register, 2 and 3 in another, each
 * head's 8 values of q in both halves; every lane adds the products the AVX2 build's lane adds,
 * in its order, and the halves go through its tree: the same scores, bit for bit, for half the
 * multiply-adds and widenings. */
static inline __attribute__((always_inline)) void dot4_heads(__m128 *out, const float *q, int G, const void *k,
                                                            int64_t k_at, int64_t d, int dtype) {
    __m512 a[HEADS_AT_ONCE][2];
    for (int g = 0; g < G; g++) a[g][0] = a[g][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m512 key[2];
        for (int h = 0; h < 2; h++) {
            const int64_t first = k_at + 2 * h * d + i, second = first + d;
            if (dtype == TS_F32) {
                const float *base = (const float *)k;
                key[h] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(base + first)),
                                            _mm256_loadu_ps(base + second), 1);
            } else {
                const uint16_t *base = (const uint16_t *)k;
                const __m256i both = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(base + first))),
                    _mm_loadu_si128((const __m128i *)(base + second)), 1);
                key[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
            }
        }
        for (int g = 0; g < G; g++) {
            const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * d + i));
            a[g][0] = _mm512_fmadd_ps(qv, key[0], a[g][0]);
            a[g][1] = _mm512_fmadd_ps(qv, key[1], a[g][1]);
        }
    }
    for (int g = 0; g < G; g++) {
        const __m256 r0 = _mm512_castps512_ps256(a[g][0]), r1 = _mm512_extractf32x8_ps(a[g][0], 1);
        const __m256 r2 = _mm512_castps512_ps256(a[g][1]), r3 = _mm512_extractf32x8_ps(a[g][1], 1);
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(r0, r1), _mm256_hadd_ps(r2, r3));
        out[g] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    }
}

/* 16 values from base[index] (float32 or bfloat16) as float32. */
static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == TS_F32) return _mm512_loadu_ps((const float *)base + index);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* The AVX2 build's weighted_heads sums for elements [i, i + 16 W) of G heads, 16 lanes a
 * register: each element still takes its products one fused multiply-add at a time in position
 * order, so the same bits; each value row is read and widened once for the G heads, each weight
 * broadcast once for the W registers. */
static inline __attribute__((always_inline)) void weighted_block(float *out, const float *p, int64_t stride, int G,
                                                                int W, const void *v, int64_t v_at, int64_t count,
                                                                int64_t d, int64_t i, int dtype, int more) {
    __m512 a[HEADS_AT_ONCE][4];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < W; r++) a[g][r] = more ? _mm512_loadu_ps(out + g * d + i + 16 * r) : _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j++) {
        __m512 row[4];
        for (int r = 0; r < W; r++) row[r] = load16(v, v_at + j * d + i + 16 * r, dtype);
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(p[g * stride + j]);
            for (int r = 0; r < W; r++) a[g][r] = _mm512_fmadd_ps(w, row[r], a[g][r]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < W; r++) _mm512_storeu_ps(out + g * d + i + 16 * r, a[g][r]);
}

/* weighted_heads on AVX-512 (d % 16 == 0): 64 elements of each head at a time, then 16. */
static inline __attribute__((always_inline)) void weighted_heads(float *out, const float *p, int64_t stride, int G,
                                                                const void *v, int64_t v_at, int64_t count, int64_t d,
                                                                int dtype, int more) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) weighted_block(out, p, stride, G, 4, v, v_at, count, d, i, dtype, more);
    for (; i < d; i += 16) weighted_block(out, p, stride, G, 1, v, v_at, count, d, i, dtype, more);
}

/* ---- greedy.c */

/* The largest value, largest size and finiteness of whole sixteens of v's n values (a max of
 * finite values is exact in any order); returns how many it took. */
static inline int64_t greedy_lanes(const float *v, int64_t n, float *best, float *big, int *finite) {
    int64_t i = 0;
    __m512 top = _mm512_set1_ps(-INFINITY), size = _mm512_setzero_ps();
    __mmask16 odd = 0;  /* lanes that met a NaN or an infinity */
    for (; i + 16 <= n; i += 16) {
        const __m512 value = _mm512_loadu_ps(v + i);
        odd |= _mm512_fpclass_ps_mask(value, 0x99);  /* QNaN, SNaN, +inf, -inf */
        top = _mm512_max_ps(top, value);
        size = _mm512_max_ps(size, _mm512_abs_ps(value));
    }
    *finite = odd == 0;
    *best = _mm512_reduce_max_ps(top);
    *big = _mm512_reduce_max_ps(size);
    return i;
}

/* The first index of `best` among whole sixteens of v's n values, -1 where none holds it; how
 * far it looked into *reached. */
static inline int64_t first_equal_lanes(const float *v, int64_t n, float best, int64_t *reached) {
    int64_t i = 0;
    const __m512 want = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), want, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    *reached = i;
    return -1;
}

#endif
