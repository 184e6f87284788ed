/* The linear operators' one driver (Int8Linear, FloatLinear and their forms), around each
 * precision's kernels: the activations' shape, the outputs of the four forms, the residual + RMSNorm
 * of the SkipNorm form, and zeros in the outputs when a shape does not fit. A kernel file gives
 * ``linear_begin`` the linear's output columns and its weights' checks, then spreads its own work
 * items over the rows and tiles, then calls ``linear_end``.
 *
 *   PLAIN  y = x W                                   [..., N]
 *   SPLIT  y's two halves as two outputs              [..., N / 2] each (N a multiple of 32)
 *   GATED  SiLU(first half) * second half             [..., N / 2]
 *   NORM   (RMSNorm(x W + skip), x W + skip)          [..., N] each (skip_norm.h)
 */
#ifndef AUTOGLM_LINEAR_H
#define AUTOGLM_LINEAR_H

#include <string.h>

#include "ort_api.h"
#include "parallel.h"
#include "skip_norm.h"

#define MAX_DIMS 8

enum { PLAIN, SPLIT, GATED, NORM };

typedef struct {
  int mode;
  const void *x;       /* input 0, [..., K] */
  int64_t rows, k, n;  /* the activations' rows and features; the linear's output columns */
  size_t rank;
  int64_t dims[MAX_DIMS]; /* input 0's shape, then (from linear_begin on) each output's */
  float *out[2];
  float *y, *y2;       /* where the linear writes its columns: y (the sum, for NORM), y2 (SPLIT's second half) */
  NormJob norm;
} LinearCall;

/* input 0 into ``call``: NULL, or why it cannot be read */
static inline const char *linear_input(OrtKernelContext *ctx, int mode, LinearCall *call) {
  void *x;
  memset(call, 0, sizeof *call);
  call->mode = mode;
  if (input_of_rank(ctx, 0, &x, call->dims, MAX_DIMS, &call->rank) || call->rank < 1)
    return "input 0 is missing or has no dimensions (want [..., K])";
  call->x = x;
  call->k = call->dims[call->rank - 1];
  if (product_over(call->dims, call->rank - 1, INT64_MAX, &call->rows)) return "input 0 has too many rows";
  return NULL;
}

static const char linear_done[] = "no rows"; /* linear_begin's answer when there is nothing to compute */

/* The outputs of a linear of ``n`` columns, and for NORM its inputs from ``norm_first``, once
 * ``weights``, the kernel's verdict on its weights, is NULL (they fit): NULL when the kernel has
 * work to do, ``linear_done`` when there are no rows, else why the run fails. */
static inline const char *linear_begin(OrtKernelContext *ctx, const Constants *constants, LinearCall *call, int64_t n,
                                       size_t norm_first, const char *weights) {
  const int halves = call->mode == SPLIT || call->mode == GATED;
  const int outputs = call->mode == SPLIT || call->mode == NORM ? 2 : 1;
  if (weights != NULL) return weights;
  if (halves && n % 32) /* halves that would split a tile of 16 columns */
    return reason("%lld output columns do not split into two halves of whole 16-column tiles", (long long)n);
  call->n = n;
  call->dims[call->rank - 1] = halves ? n / 2 : n;
  if (float_outputs(ctx, outputs, call->dims, call->rank, call->out)) return "could not allocate the outputs";
  call->y = call->mode == NORM ? call->out[1] : call->out[0]; /* NORM: the linear's output is the sum (output 1) */
  call->y2 = call->mode == SPLIT ? call->out[1] : NULL;
  call->norm = (NormJob){call->y, NULL, NULL, 0.0f, n, call->out[0]};
  if (call->mode == NORM && norm_inputs(ctx, constants, norm_first, call->rows, n, &call->norm))
    return reason("the skip input must hold [rows %lld, %lld] values, gamma [%lld] and epsilon a scalar",
                  (long long)call->rows, (long long)n, (long long)n);
  return call->rows == 0 ? linear_done : NULL;
}

/* after the linear's columns: the NORM form's residual + RMSNorm, row by row */
static inline void linear_end(OrtKernelContext *ctx, LinearCall *call, size_t enough) {
  if (call->mode == NORM) parallel_for(ctx, norm_row, (size_t)call->rows, enough, &call->norm);
}

#endif
