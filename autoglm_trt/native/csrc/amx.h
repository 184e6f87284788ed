/* Intel AMX for Int8Linear's batches (amx.c). */
#ifndef AUTOGLM_AMX_H
#define AUTOGLM_AMX_H

#include <stdint.h>

/* 1 where this build, this CPU and the kernel let AMX run (asked once; AUTOGLM_TRT_AMX=0: never) */
int amx_ready(void);

/* sums[r * 16 + i] = sum_k x[r * stride + k] * W[k, i] for rows r < rows (a multiple of 16) and
 * the 16 columns of one packed tile w ([kp / 4, 16, 4] bytes); kp a multiple of 64. Only where
 * amx_ready(). */
void amx_int8_sums(const uint8_t *x, int64_t stride, int64_t rows, const int8_t *w, int64_t kp, int32_t *sums);

#endif
