/* Residual add + RMSNorm after a linear, as ONNX Runtime's CPU kernel of
 * SkipSimplifiedLayerNormalization computes it for float32: each row's sum = linear + skip
 * element by element, its mean square accumulated in order, one product and one sum rounded at
 * a time (this library is built as ISO C, so GCC neither contracts nor reorders them), then
 * rms = sqrt(mean square / n + epsilon) and normalized = sum / rms * gamma. The same operations
 * in the same order give the same floats; ``tests/test_int8_linear.py`` and
 * ``tests/test_float_linear.py`` compare them with ONNX Runtime's node on this machine.
 */
#ifndef AUTOGLM_SKIP_NORM_H
#define AUTOGLM_SKIP_NORM_H

#include <math.h>
#include <stdint.h>

#include "ort_api.h"

/* ``sum`` holds a row of the linear's output on entry and linear + skip on return */
static inline void skip_rms_norm(float *sum, const float *skip, const float *gamma, float epsilon, int64_t n,
                                 float *normalized) {
  float square = 0.0f;
  for (int64_t h = 0; h < n; h++) {
    const float v = sum[h] + skip[h];
    sum[h] = v;
    square += v * v;
  }
  const float rms = sqrtf(square / (float)n + epsilon);
  for (int64_t h = 0; h < n; h++) normalized[h] = sum[h] / rms * gamma[h];
}

/* the norm of each row of an operator's output: its extra inputs and where it writes */
typedef struct {
  float *sum; /* rows x n: the linear's output, then the sums */
  const float *skip, *gamma;
  float epsilon;
  int64_t n;
  float *normalized;
} NormJob;

static inline void norm_row(void *data, size_t r) {
  const NormJob *j = data;
  const int64_t at = (int64_t)r * j->n;
  skip_rms_norm(j->sum + at, j->skip + at, j->gamma, j->epsilon, j->n, j->normalized + at);
}

/* inputs first.. (skip, of rows x n values; gamma [n]; epsilon, a float scalar) into ``job``; 1
 * when they are missing or do not fit */
static inline int norm_inputs(OrtKernelContext *ctx, const Constants *constants, size_t first, int64_t rows, int64_t n,
                              NormJob *job) {
  int64_t sd[8], gd[1], none[1];
  size_t rank = 0;
  void *skip, *gamma, *epsilon;
  if (input_of_rank(ctx, first, &skip, sd, 8, &rank) || fixed_input(ctx, constants, first + 1, &gamma, gd, 1) ||
      fixed_input(ctx, constants, first + 2, &epsilon, none, 0) || gd[0] != n)
    return 1;
  int64_t count = 1;
  for (size_t i = 0; i < rank; i++) count *= sd[i];
  job->skip = skip, job->gamma = gamma, job->epsilon = *(const float *)epsilon, job->n = n;
  return count != rows * n;
}

#endif
