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

/* input 0 into ``call``: 1 when it cannot be read */
static inline int linear_input(OrtKernelContext *ctx, int mode, LinearCall *call) {
  void *x;
  memset(call, 0, sizeof *call);
  call->mode = mode;
  if (input_of_rank(ctx, 0, &x, call->dims, MAX_DIMS, &call->rank) || call->rank < 1) return 1;
  call->x = x;
  call->k = call->dims[call->rank - 1];
  call->rows = 1;
  for (size_t i = 0; i + 1 < call->rank; i++) call->rows *= call->dims[i];
  return 0;
}

/* the outputs' values, each (rows x its last dimension) */
static inline int64_t linear_values(const LinearCall *call) { return call->rows * call->dims[call->rank - 1]; }

/* zeros in every output (a shape the rewrite never makes) */
static inline void linear_zero(const LinearCall *call) {
  const int outputs = call->mode == SPLIT || call->mode == NORM ? 2 : 1;
  for (int o = 0; o < outputs; o++) memset(call->out[o], 0, (size_t)linear_values(call) * sizeof(float));
}

/* The outputs of a linear of ``n`` columns, and for NORM its inputs from ``norm_first``; ``fits``
 * is the kernel's verdict on its weights. 1: nothing to compute (an output could not be made, or
 * the outputs were zeroed because a shape does not fit, or there are no rows). */
static inline int linear_begin(OrtKernelContext *ctx, const Constants *constants, LinearCall *call, int64_t n,
                               size_t norm_first, int fits) {
  const int halves = call->mode == SPLIT || call->mode == GATED;
  const int outputs = call->mode == SPLIT || call->mode == NORM ? 2 : 1;
  call->n = n;
  call->dims[call->rank - 1] = halves ? n / 2 : n;
  if (float_outputs(ctx, outputs, call->dims, call->rank, call->out)) return 1;
  call->y = call->mode == NORM ? call->out[1] : call->out[0]; /* NORM: the linear's output is the sum (output 1) */
  call->y2 = call->mode == SPLIT ? call->out[1] : NULL;
  call->norm = (NormJob){call->y, NULL, NULL, 0.0f, n, call->out[0]};
  if (!fits || (halves && n % 32) || /* halves that would split a tile of 16 columns */
      (call->mode == NORM && norm_inputs(ctx, constants, norm_first, call->rows, n, &call->norm))) {
    linear_zero(call);
    return 1;
  }
  return call->rows == 0;
}

/* after the linear's columns: the NORM form's residual + RMSNorm, row by row */
static inline void linear_end(OrtKernelContext *ctx, LinearCall *call, size_t enough) {
  if (call->mode == NORM) parallel_for(ctx, norm_row, (size_t)call->rows, enough, &call->norm);
}

#endif
