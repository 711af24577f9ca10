/* What the C kernels share whatever the ISA: dtype and status codes, bfloat16 conversions, one
 * value's load and store, the exponential. Included by every C file beside it; they are compiled
 * into one library (streaming_backend/kernels/build.py), with one ISA's primitives (isa.h). */
#ifndef TS_COMMON_H
#define TS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

static inline float load1(const void *base, int64_t index, int dtype) {
    return dtype == TS_F32 ? ((const float *)base)[index] : bf16_to_f32(((const uint16_t *)base)[index]);
}

static inline void store1(void *base, int64_t index, int dtype, float value) {
    if (dtype == TS_F32)
        ((float *)base)[index] = value;
    else
        ((uint16_t *)base)[index] = f32_to_bf16(value);
}

/* q . k over d values one at a time, in order (every ISA's dot where its lanes do not fit d). */
static inline float dot1(const float *q, const void *k, int64_t k_at, int64_t d, int dtype) {
    float sum = 0.0f;
    for (int64_t i = 0; i < d; i++) sum = fmaf(q[i], load1(k, k_at + i, dtype), sum);
    return sum;
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

#endif
