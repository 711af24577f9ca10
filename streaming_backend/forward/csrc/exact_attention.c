/* Exact attention over a slot KV cache: every token attends over exactly its own positions.
 *
 * Built by streaming_backend/forward/native.py (gcc -O3 -fopenmp, -mavx2 -mfma on x86-64) and
 * called through ctypes with the tensors' data pointers; the GIL is released for the call.
 *
 * A token's result is computed by one thread, in an order fixed by its own position alone
 * (never by how many tokens share the call, nor by their positions): so a row's numbers are the
 * same alone or in a crowd, and a decode step gives the same bits as a prefill of that token.
 * The exponential is one polynomial, the same in the vector loop and its scalar tail, so where
 * the tail falls does not change a value either.
 *
 * Shapes (elements, row-major, contiguous):
 *   q     [n, kv_heads, groups, head_dim]  the queries, rotated; query heads sharing a K/V head
 *   k, v  [places, kv_heads, max_len, head_dim]  one layer's cache
 *   out   [n, kv_heads, groups, head_dim]  = [n, heads * head_dim]
 *   places, positions  [n] int64: each token's slot in the cache and its position there
 * dtype: 0 float32, 1 bfloat16 (q, k, v and out alike; sums in float32).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TS_AVX2 1
#endif

enum { TS_F32 = 0, TS_BF16 = 1 };
enum { TS_OK = 0, TS_BAD_ARGS = 1, TS_NO_MEMORY = 2 };

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
#endif

static inline float load1(const void *base, int64_t index, int dtype) {
    return dtype == TS_F32 ? ((const float *)base)[index] : bf16_to_f32(((const uint16_t *)base)[index]);
}

/* q . k over d values, in an order fixed by d alone. */
static float dot(const float *q, const void *k, int64_t k_at, int64_t d, int dtype) {
#ifdef TS_AVX2
    if (d % 16 == 0) {
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, k_at + i, dtype), a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k, k_at + i + 8, dtype), b);
        }
        return hsum8(_mm256_add_ps(a, b));
    }
#endif
    float sum = 0.0f;
    for (int64_t i = 0; i < d; i++) sum = fmaf(q[i], load1(k, k_at + i, dtype), sum);
    return sum;
}

#ifdef TS_AVX2
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
#endif

/* scores[j] = q . k_j for the count key rows from k_at; returns their maximum. Which way a
 * score is summed depends on j and count alone. */
static float scores_of(float *scores, const float *q, const void *k, int64_t k_at, int64_t count,
                       int64_t d, int dtype) {
    int64_t j = 0;
    float max = -INFINITY;
#ifdef TS_AVX2
    if (d % 8 == 0) {
        __m256 m = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= count; j += 8) {
            const __m256 s = dot8(q, k, k_at + j * d, d, dtype);
            _mm256_storeu_ps(scores + j, s);
            m = _mm256_max_ps(m, s);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int r = 0; r < 8; r++) max = lanes[r] > max ? lanes[r] : max;
    }
#endif
    for (; j < count; j++) {
        scores[j] = dot(q, k, k_at + j * d, d, dtype);
        max = scores[j] > max ? scores[j] : max;
    }
    return max;
}

/* out[i] = sum over j < count of p[j] * v_j[i], j ascending, one fused multiply-add at a time
 * whatever the width that computes element i (so every element is summed the same way). */
static void weighted_sum(float *out, const float *p, const void *v, int64_t v_at, int64_t count,
                         int64_t d, int dtype) {
    int64_t i = 0;
#ifdef TS_AVX2
    for (; i + 64 <= d; i += 64) {
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
        for (int64_t j = 0; j < count; j++) {
            const __m256 w = _mm256_set1_ps(p[j]);
            for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(w, load8(v, v_at + j * d + i + 8 * r, dtype), a[r]);
        }
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(out + i + 8 * r, a[r]);
    }
    for (; i + 8 <= d; i += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < count; j++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v, v_at + j * d + i, dtype), a);
        _mm256_storeu_ps(out + i, a);
    }
#endif
    for (; i < d; i++) {
        float a = 0.0f;
        for (int64_t j = 0; j < count; j++) a = fmaf(p[j], load1(v, v_at + j * d + i, dtype), a);
        out[i] = a;
    }
}

/* p[i] = exp(p[i] - max) for i < count; returns their sum, in an order fixed by count alone. */
static float softmax_numerators(float *p, int64_t count, float max) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef TS_AVX2
    __m256 m = _mm256_set1_ps(max), acc = _mm256_setzero_ps();
    for (; i + 8 <= count; i += 8) {
        __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
        _mm256_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
#endif
    for (; i < count; i++) {
        p[i] = exp_neg(p[i] - max);
        sum += p[i];
    }
    return sum;
}

typedef struct {
    int dtype;
    const void *q, *k, *v;
    void *out;
    const int64_t *places, *positions;
    int64_t kv_heads, groups, head_dim, max_len, window;
    float scale;
} Call;

/* One (token, key/value head): its `groups` query heads over positions [first, position], each
 * key and value row read once for all of them. work: groups * (max_len + 2 * head_dim) floats of
 * this thread's own. */
static void attend_one(const Call *c, int64_t token, int64_t head, float *work) {
    const int64_t d = c->head_dim, groups = c->groups, position = c->positions[token];
    const int64_t first = position + 1 > c->window ? position + 1 - c->window : 0;
    const int64_t count = position + 1 - first;
    const int64_t cache_at = ((c->places[token] * c->kv_heads + head) * c->max_len + first) * d;
    const int64_t q_at = (token * c->kv_heads + head) * groups * d;
    float *scores = work, *query = work + groups * c->max_len, *acc = query + groups * d;
    float inverse[groups];
    for (int64_t i = 0; i < groups * d; i++) query[i] = load1(c->q, q_at + i, c->dtype) * c->scale;
    for (int64_t g = 0; g < groups; g++) {  /* the key and value rows stay in cache across g */
        float *p = scores + g * c->max_len;
        const float max = scores_of(p, query + g * d, c->k, cache_at, count, d, c->dtype);
        inverse[g] = 1.0f / softmax_numerators(p, count, max);
        weighted_sum(acc + g * d, p, c->v, cache_at, count, d, c->dtype);
    }
    for (int64_t i = 0; i < groups * d; i++) {
        const float value = acc[i] * inverse[i / d];
        if (c->dtype == TS_F32)
            ((float *)c->out)[q_at + i] = value;
        else
            ((uint16_t *)c->out)[q_at + i] = f32_to_bf16(value);
    }
}

/* Attention of n tokens (see the top of this file) on `threads` OpenMP threads (torch's own
 * runtime when torch is loaded first). Returns TS_OK, or TS_BAD_ARGS / TS_NO_MEMORY with
 * nothing written. */
int ts_exact_attention(int dtype, const void *q, const void *k, const void *v, void *out,
                       const int64_t *places, const int64_t *positions, int64_t n,
                       int64_t kv_heads, int64_t groups, int64_t head_dim, int64_t max_len,
                       int64_t window, float scale, int threads) {
    if ((dtype != TS_F32 && dtype != TS_BF16) || n < 0 || kv_heads < 1 || groups < 1 ||
        head_dim < 1 || max_len < 1 || window < 1 || threads < 1)
        return TS_BAD_ARGS;
    for (int64_t t = 0; t < n; t++)
        if (positions[t] < 0 || positions[t] >= max_len || places[t] < 0) return TS_BAD_ARGS;
    const Call c = {dtype, q, k, v, out, places, positions, kv_heads, groups, head_dim, max_len,
                    window, scale};
    const int64_t items = n * kv_heads, per_thread = groups * (max_len + 2 * head_dim);
    if (threads > items) threads = items > 0 ? (int)items : 1;
    float *work = malloc((size_t)threads * (size_t)per_thread * sizeof(float));
    if (work == NULL) return TS_NO_MEMORY;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t item = 0; item < items; item++)
        attend_one(&c, item / kv_heads, item % kv_heads, work + (int64_t)omp_get_thread_num() * per_thread);
    free(work);
    return TS_OK;
}
