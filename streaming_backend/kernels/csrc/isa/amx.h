/* AMX's primitives (isa.h; Xeons since Sapphire Rapids): the same block dots from tile multiplies.
 *
 * Where the CPU has AMX-INT8 and the kernel lets this process use it, the AVX-512 build computes
 * the block dots D = l . v of up to 16 activation rows against a tile's 16 weight rows with tile
 * multiplies, then sums the blocks in the same order with the same float operations as q4_tile /
 * q8_tile (isa/avx512.h): D is an exact integer either way, so the bits are the same (tested, AMX
 * against VNNI). The activation rows' blocks come from Quantized.halves, a tile of rows' block one
 * contiguous load.
 *
 * q4: one multiply a block, 64 deep: each activation row's q and r side by side against the
 * block's weights twice, times 2^V_SHIFT then as they are (a nibble times 16 is at most 240, still
 * a byte), so D = l . (2^V_SHIFT q + r) comes out of the tile whole. The q4 block is unpacked into
 * that weight tile: rows 0-3 its low nibbles times 16, rows 4-7 its high nibbles times 16, rows 8-15
 * the same nibbles as they are.
 * q8: the weights are signed and do not take the factor: two multiplies 32 deep (q, then r), the
 * block already being the weight tile AMX multiplies (8 rows of 16 weight rows' 4 inputs). */
#ifndef TS_ISA_AMX_H
#define TS_ISA_AMX_H

/* Included after isa/avx512.h (isa.h), whose tiles take the rows AMX leaves and whose emit_q4_rows,
 * emit_q8_rows and ask it uses; built with -mamx-tile -mamx-int8 besides AVX-512's flags. */
#include "avx512.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* the tile registers used (numbers: the tile intrinsics take literal ones) */
#define T_CQ 0  /* q8: the sums l . q */
#define T_CR 1  /* q8: the sums l . r */
#define T_AQ 2  /* q8: the activations' high halves q */
#define T_AR 3  /* q8: their low halves r */
#define T_B 4   /* q8: one block of a tile's weights */
#define T_C4 5  /* q4: the block dots D */
#define T_A4 6  /* q4: the activation rows' block, q and r side by side */
#define T_B4 7  /* q4: the block's weights, times 2^V_SHIFT and as they are */
#define Q4_TILE_BYTES (2 * Q8_BLOCK_BYTES)  /* T_B4's bytes: 16 rows of 64 */

_Static_assert(15 << V_SHIFT <= 255, "a nibble times 2^V_SHIFT fits a byte (the q4 weight tile)");

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

static int amx_state = -1;   /* -1 not asked yet, 0 unavailable, 1 available */
static int amx_wanted = 1;   /* ts_amx(0) turns it off (tests, benchmarks) */
static __thread int amx_rows_set;  /* the activation rows this thread's tiles are configured for */

/* Whether this CPU has AMX-INT8 and the kernel grants this process its tile state (asked once). */
static inline int amx_available(void) {
    if (amx_state < 0) {
        unsigned a, b, c, d;
        const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25));
        amx_state = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
}

/* This thread's tiles for M activation rows: q8's two sums, two activation and one weight tile;
 * q4's sums, activation and weight tile. */
static inline void amx_configure(int M) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = T_CQ; t <= T_CR; t++) config.rows[t] = (uint8_t)M, config.colsb[t] = TILE * 4;
    for (int t = T_AQ; t <= T_AR; t++) config.rows[t] = (uint8_t)M, config.colsb[t] = QK;
    config.rows[T_B] = QK / 4, config.colsb[T_B] = TILE * 4;
    config.rows[T_C4] = (uint8_t)M, config.colsb[T_C4] = TILE * 4;
    config.rows[T_A4] = (uint8_t)M, config.colsb[T_A4] = HALVES_BYTES;
    config.rows[T_B4] = HALVES_BYTES / 4, config.colsb[T_B4] = TILE * 4;
    _tile_loadconfig(&config);
    amx_rows_set = M;
}

/* Row j's block b in Quantized.halves (rows from there HALVES_BYTES apart). */
static inline const int8_t *amx_halves(const Matmul *c, int64_t b, int64_t row) {
    return c->xq.halves + (b * c->m + row) * HALVES_BYTES;
}

/* A q4 block (256 bytes at p) as T_B4's weight tile (Q4_TILE_BYTES at to): rows 0-3 its low
 * nibbles and rows 4-7 its high ones, times 2^V_SHIFT; rows 8-15 the same as they are. */
static inline void amx_unpack(uint8_t *to, const uint8_t *p) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8((char)(0x0f << V_SHIFT));
    for (int u = 0; u < 4; u++) {
        const __m512i raw = _mm512_loadu_si512(p + 64 * u);
        _mm512_store_si512(to + 64 * u, _mm512_and_si512(_mm512_slli_epi16(raw, V_SHIFT), high));
        _mm512_store_si512(to + 256 + 64 * u, _mm512_and_si512(_mm512_srli_epi16(raw, 4 - V_SHIFT), high));
        _mm512_store_si512(to + 512 + 64 * u, _mm512_and_si512(raw, nibble));
        _mm512_store_si512(to + 768 + 64 * u, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
    }
}

#define UNPACK_AHEAD 8  /* q4 blocks unpacked before their tile multiply (a power of 2): the stores
                         * are done before the tile load reads them */

/* q4_tile's sums for M activation rows (at most AMX_ROWS) from row, on AMX. Software-pipelined:
 * a block is unpacked UNPACK_AHEAD blocks before the tiles load it, and its sums are read back
 * one block after its multiply, so neither waits for the stores just made. */
static inline __attribute__((always_inline)) void amx_q4_tile(const Matmul *c, int64_t row, int M, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const uint8_t *w = c->w + col * (k / 2);
    const uint16_t *steps = c->steps + col * blocks, *lows = c->lows + col * blocks;
    _Alignas(64) uint8_t unpacked[UNPACK_AHEAD][Q4_TILE_BYTES];
    _Alignas(64) int32_t dots[2][AMX_ROWS * TILE];
    __m512 acc[AMX_ROWS];
    for (int j = 0; j < M; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks && b < UNPACK_AHEAD; b++) amx_unpack(unpacked[b], w + b * Q4_BLOCK_BYTES);
    for (int64_t b = 0; b <= blocks; b++) {
        if (b < blocks) {
            _tile_loadd(T_B4, unpacked[b % UNPACK_AHEAD], TILE * 4);
            _tile_loadd(T_A4, amx_halves(c, b, row), HALVES_BYTES);
            _tile_zero(T_C4);
            _tile_dpbsud(T_C4, T_A4, T_B4);
            _tile_stored(T_C4, dots[b & 1], TILE * 4);
            const uint8_t *next = w + (b + UNPACK_AHEAD) * Q4_BLOCK_BYTES;
            for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) ask(next + WEIGHTS_AHEAD + line);
            if (b + UNPACK_AHEAD < blocks) amx_unpack(unpacked[b % UNPACK_AHEAD], next);
        }
        if (b == 0) continue;
        const int64_t a = b - 1;  /* the block whose sums are read now */
        const int32_t *dot = dots[a & 1];
        const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + a * TILE)));
        for (int j = 0; j < M; j++) {
            const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(dot + TILE * j));
            const __m512 scale = _mm512_mul_ps(step, _mm512_set1_ps(c->xq.d[(row + j) * blocks + a]));
            acc[j] = _mm512_fmadd_ps(d, scale, acc[j]);
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

/* q8's two multiplies of one block for M activation rows (their halves in Quantized.halves)
 * against the weight tile b (signed bytes), in int32 lanes: dq + 16 j holds row j's l . q,
 * dr + 16 j its l . r. */
static inline __attribute__((always_inline)) void amx_block(const void *b, const int8_t *halves, int32_t *dq,
                                                            int32_t *dr) {
    _tile_loadd(T_B, b, TILE * 4);
    _tile_loadd(T_AQ, halves, HALVES_BYTES);
    _tile_loadd(T_AR, halves + QK, HALVES_BYTES);
    _tile_zero(T_CQ);
    _tile_zero(T_CR);
    _tile_dpbssd(T_CQ, T_AQ, T_B);
    _tile_dpbssd(T_CR, T_AR, T_B);
    _tile_stored(T_CQ, dq, TILE * 4);
    _tile_stored(T_CR, dr, TILE * 4);
}

/* Row j's D of a block, from amx_block's sums: 2^V_SHIFT * (l . q) + l . r, exact. */
static inline __m512i amx_dot(const int32_t *dq, const int32_t *dr, int j) {
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dq + TILE * j), V_SHIFT), _mm512_load_si512(dr + TILE * j));
}

/* q8_tile's sums for M activation rows from row, on AMX: the weights multiply as they lie; a
 * block's sums are read back one block after its multiplies. */
static inline __attribute__((always_inline)) void amx_q8_tile(const Matmul *c, int64_t row, int M, int64_t col) {
    const int64_t k = c->k, blocks = k / QK;
    const int8_t *w = (const int8_t *)c->w + col * k;
    _Alignas(64) int32_t dq[2][AMX_ROWS * TILE], dr[2][AMX_ROWS * TILE];
    __m512 acc[AMX_ROWS];
    for (int j = 0; j < M; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= blocks; b++) {
        if (b < blocks) {
            const int8_t *p = w + b * Q8_BLOCK_BYTES;
            for (int line = 0; line < Q8_BLOCK_BYTES; line += 64) ask(p + WEIGHTS_AHEAD + line);
            amx_block(p, amx_halves(c, b, row), dq[b & 1], dr[b & 1]);
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
static __attribute__((noinline, unused)) void amx_rows(const Matmul *c, int kind, int64_t row, int M, int64_t col) {
    if (amx_rows_set != M) amx_configure(M);
    if (M == AMX_ROWS) {
        if (kind == KIND_Q4) amx_q4_tile(c, row, AMX_ROWS, col);
        else amx_q8_tile(c, row, AMX_ROWS, col);
    } else {
        if (kind == KIND_Q4) amx_q4_tile(c, row, M, col);
        else amx_q8_tile(c, row, M, col);
    }
}

/* matmul.c's columns() for a quantized weight on AMX: each tile against every AMX_ROWS activation rows, and
 * the last fewer than AMX_MIN_ROWS on the AVX-512 tiles, which are faster there (the same sums);
 * the tiles given back after (a thread holding tile state costs every switch of it). */
static __attribute__((noinline, unused)) void amx_columns(const Matmul *c, int kind, int64_t first, int64_t last) {
    for (int64_t col = first; col < last && !team_taken(c->taken); col += TILE) {
        int64_t row = 0;
        for (; c->m - row >= AMX_MIN_ROWS; row += AMX_ROWS)
            amx_rows(c, kind, row, c->m - row < AMX_ROWS ? (int)(c->m - row) : AMX_ROWS, col);
        for (; row < c->m; row += ROWS)
            quant_tiles(c, kind, row, c->m - row < ROWS ? (int)(c->m - row) : ROWS, col);
    }
    _tile_release();
    amx_rows_set = 0;
}

/* Whether the quantized matmuls run their block dots on AMX: want 1 or 0 turns it on (where the
 * CPU and kernel allow) or off, -1 only asks (ts_amx). */
static inline int amx_use(int want) {
    if (want >= 0) amx_wanted = want != 0;
    return amx_wanted && amx_available();
}

#endif
