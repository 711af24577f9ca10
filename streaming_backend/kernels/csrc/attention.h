/* The exact attention's entry for the other kernels (attention.c). */
#ifndef TS_ATTENTION_H
#define TS_ATTENTION_H

#include <stdint.h>

#include "team.h"

#define HEADS_AT_ONCE 3  /* query heads that share each key and value row read (registers: 16) */

/* ts_rope_attention on a held team, which the decoder stack (stack.c) calls (arguments in
 * attention.c). */
int rope_attention(TeamCall *call, int dtype, int cache_dtype, const void *qkv, const void *cos,
                   const void *sin, int64_t positions_in_table, void *k, void *v, void *out, const int64_t *places,
                   const int64_t *positions, int64_t n, int64_t place_count, int64_t kv_heads, int64_t groups,
                   int64_t head_dim, int64_t rows, int64_t window, float scale, float cap);

#endif
