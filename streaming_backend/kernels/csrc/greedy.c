/* A greedy step's pick.
 *
 * For each row of x [rows, n] float32 (sampling/logits.py, the greedy rows of a step):
 * ids[r] = the first index of its largest value, and sure[r] = 1 when every value is finite and
 * 2 n max|x| < FLT_MAX, so that no order of summing the row can overflow: the pipeline's finite
 * check (the row's sum is finite) then holds for certain. Else sure[r] = 0 and ids[r] = 0: the
 * pipeline decides. One pass for the largest, its size and finiteness, one to find its first
 * place (a max of finite values is exact in any order, so the lanes may take it apart: the ISA's
 * greedy_lanes and first_equal_lanes, isa.h). Built with the other kernels into one library
 * (streaming_backend/kernels/build.py; kernels/greedy.py binds it). */
#include <math.h>
#include <stdint.h>

#include "isa.h"

#define FLOAT_LIMIT 3.40282347e38f

static int64_t first_equal(const float *v, int64_t n, float best) {
    int64_t i = 0;
    const int64_t hit = first_equal_lanes(v, n, best, &i);
    if (hit >= 0) return hit;
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
        int64_t i = greedy_lanes(v, n, &best, &big, &finite);
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
