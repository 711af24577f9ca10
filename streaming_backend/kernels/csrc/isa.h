/* The build's ISA: one header of isa/ with the primitives below, all static inline, chosen by the
 * build (streaming_backend/kernels/build.py, VARIANTS: -DTS_ISA_HEADER="isa/<name>.h"), and AMX's
 * tiles or their absence (-DTS_AMX_HEADER: isa/amx.h where the AVX-512 build's compiler has AMX,
 * else isa/no_amx.h). The C files beside this one include it and hold no ISA conditional: a new
 * ISA is one header defining the same primitives plus one row of VARIANTS.
 *
 * Every ISA header computes the same bits (each primitive's comment says in which order it sums;
 * an ISA's lanes add what the portable code adds, in its order). Its primitives:
 *
 *   matmul.c
 *     ROWS                 the most activation rows a quantized tile takes
 *     quantize_block       one block of QK floats -> halves q and r; returns its step d, sum(v) out
 *     sum_squares          sum of x[i]^2 over k values, in an order fixed by k
 *     silu_mul_lanes       silu(g) * u over the leading inputs it takes; returns how many
 *     scale_lanes          x * by * norm (or x, norm NULL) likewise
 *     quant_tiles          q4 / q8 sums of R <= ROWS activation rows against one tile of TILE
 *                          weight rows, emitted (not inlined: a constant R per call site inside)
 *     dense_tile           y of R activation rows and C float weight rows, emitted
 *   attention.c
 *     dot                  q . k over d values, in an order fixed by d alone
 *     scores_lanes         the leading scores of a run of key rows it takes; returns how many
 *     weighted_lanes       the leading elements of sum_j p[j] v_j it takes; returns how many
 *     softmax_lanes        exp(p - max) of the leading scores it takes, their sum; returns how many
 *     scores_together      G query heads' scores sharing each key row read; 0: not taken
 *     values_together      G query heads' value sums sharing each value row read; 0: not taken
 *   greedy.c
 *     greedy_lanes         largest value, largest size and finiteness of the leading values
 *     first_equal_lanes    the first index of a value among the leading ones; -1: none there
 *   AMX (isa/amx.h, isa/no_amx.h)
 *     amx_use              ts_amx: whether the quantized tiles run on AMX (want 1 / 0 / -1: ask)
 *     amx_columns          a chunk's quantized weight rows against every activation row on AMX */
#ifndef TS_ISA_H
#define TS_ISA_H

#include "attention.h"
#include "common.h"
#include "matmul.h"
#include "team.h"

#include TS_ISA_HEADER
#include TS_AMX_HEADER

#endif
