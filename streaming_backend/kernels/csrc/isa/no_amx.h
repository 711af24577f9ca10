/* AMX's primitives (isa.h) where the build has no AMX: never on, so the matmul driver never asks
 * for AMX's columns. */
#ifndef TS_ISA_NO_AMX_H
#define TS_ISA_NO_AMX_H

#include "../matmul.h"

static inline int amx_use(int want) {
    (void)want;
    return 0;
}

/* Not reached: Matmul.amx is set only where amx_use says yes. */
static inline void amx_columns(const Matmul *c, int kind, int64_t first, int64_t last) {
    (void)c, (void)kind, (void)first, (void)last;
}

#endif
