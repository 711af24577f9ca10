/* What the compact forward's C kernels share: dtype and status codes, bfloat16 conversions, the
 * AVX2 helpers, the exponential. Included by every C file beside it; they are compiled into one library
 * (forward/native.py). */
#ifndef TS_COMMON_H
#define TS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TS_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TS_AVX512 1  /* with VNNI: the quantized matmuls' integer dot products */
#endif
#endif

enum { TS_F32 = 0, TS_BF16 = 1 };
enum { TS_OK = 0, TS_BAD_ARGS = 1, TS_NO_MEMORY = 2 };

/* exact_attention.c's ts_rope_attention on a held team (team.h), which quant_matmul.c's decoder
 * stack calls (arguments there) */
struct TeamCall;
int rope_attention(struct TeamCall *call, int dtype, int cache_dtype, const void *qkv, const void *cos,
                   const void *sin, int64_t positions_in_table, void *k, void *v, void *out, const int64_t *places,
                   const int64_t *positions, int64_t n, int64_t place_count, int64_t kv_heads, int64_t groups,
                   int64_t head_dim, int64_t rows, int64_t window, float scale, float cap);

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch converts float32 to bfloat16 (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float load1(const void *base, int64_t index, int dtype) {
    return dtype == TS_F32 ? ((const float *)base)[index] : bf16_to_f32(((const uint16_t *)base)[index]);
}

static inline void store1(void *base, int64_t index, int dtype, float value) {
    if (dtype == TS_F32)
        ((float *)base)[index] = value;
    else
        ((uint16_t *)base)[index] = f32_to_bf16(value);
}

#ifdef TS_AVX2
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
#endif

/* exp(x) for x <= 0 (a score minus the row's maximum): 2^n * p(r), x = n ln2 + r, |r| <= ln2/2,
 * p a degree-6 polynomial (relative error below 2e-7); below -87 it is 0. */
#define EXP_LOW -87.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline float exp_neg(float x) {
    if (x < EXP_LOW) return 0.0f;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = fmaf(P0, r, P1);
    p = fmaf(p, r, P2);
    p = fmaf(p, r, P3);
    p = fmaf(p, r, P4);
    p = fmaf(p, r, P5);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef TS_AVX2
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
#endif

#endif
