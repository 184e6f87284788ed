/* Intel AMX for Int8Linear's batches and PrefillAttentionBf16's products (amx.c). */
#ifndef AUTOGLM_AMX_H
#define AUTOGLM_AMX_H

#include <stdint.h>
#include <string.h>

/* 1 where this build, this CPU and the kernel let AMX run (asked once; AUTOGLM_TRT_AMX=0: never) */
int amx_ready(void);

/* and AMX's bfloat16 products too */
int amx_bf16_ready(void);

/* sums[r * 16 + i] = sum_k x[r * stride + k] * W[k, i] for rows r < rows (a multiple of 16) and
 * the 16 columns of one packed tile w ([kp / 4, 16, 4] bytes); kp a multiple of 64. Only where
 * amx_ready(). */
void amx_int8_sums(const uint8_t *x, int64_t stride, int64_t rows, const int8_t *w, int64_t kp, int32_t *sums);

/* PrefillAttentionBf16's steps of AMX_KEYS keys (prefill_attention.c), only where amx_bf16_ready():
 * between amx_bf16_begin() and amx_bf16_end() on one thread, with queries qb [rows, d], weights
 * and sums s [rows, AMX_KEYS] and pb, rows a multiple of 16 and d of 64, and a step's keys kb
 * [d / 2, AMX_KEYS, 2] and values vb [AMX_KEYS / 2, d, 2] in bfloat16:
 *   amx_bf16_scores: s = qb kb (float32 sums)
 *   amx_bf16_weigh:  o [rows, d] += p vb, p rounded to bfloat16 into pb first */
#define AMX_KEYS 64
void amx_bf16_begin(void);
void amx_bf16_end(void);
void amx_bf16_scores(const uint16_t *qb, int rows, const uint16_t *kb, int64_t d, float *s);
void amx_bf16_weigh(float *o, int rows, const float *p, const uint16_t *vb, int64_t d, uint16_t *pb);

/* x rounded to bfloat16 (to nearest even; finite x) */
static inline uint16_t bf16_round(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif
