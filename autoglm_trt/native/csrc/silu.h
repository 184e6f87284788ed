/* SiLU(gate) * up as ONNX Runtime computes it: its QuickGelu (alpha 1: gate * logistic(gate),
 * the logistic from MLAS, which evaluates it as a ratio of two polynomials in gate^2 by fused
 * multiply-adds, on gate clamped to [-18, 18], and clamps the result to [0, 1]) and then its Mul.
 * Every step is one correctly rounded operation, so written out one by one (this library is
 * built as ISO C, where GCC contracts no multiply and add on its own) the result is the same
 * float; ``tests/test_float_linear.py`` compares it with ONNX Runtime on this machine. The
 * coefficients are MLAS's (``MlasLogisticConstants``, which credits Eigen's). Without hardware
 * fused multiply-add MLAS rounds each product first, so the rewrite uses this only where the
 * library has it (``native.float_kernel``).
 */
#ifndef AUTOGLM_SILU_H
#define AUTOGLM_SILU_H

#include <math.h>
#include <stdint.h>

static inline float mlas_logistic(float x) {
  x = -18.0f > x ? -18.0f : x; /* max, then min, keeping a NaN as MLAS's vmaxps/vminps do */
  x = 18.0f < x ? 18.0f : x;
  const float x2 = x * x;
  float p = fmaf(x2, 4.37031012579801e-11f, 1.15627324459942e-07f);
  p = fmaf(x2, p, 6.08574864600143e-05f);
  p = fmaf(x2, p, 8.51377133304701e-03f);
  p = fmaf(x2, p, 2.48287947061529e-01f);
  float q = fmaf(x2, 6.10247389755681e-13f, 5.76102136993427e-09f);
  q = fmaf(x2, q, 6.29106785017040e-06f);
  q = fmaf(x2, q, 1.70198817374094e-03f);
  q = fmaf(x2, q, 1.16817656904453e-01f);
  q = fmaf(x2, q, 9.93151921023180e-01f);
  const float r = x * p / q + 0.5f;
  const float low = 0.0f > r ? 0.0f : r;
  return 1.0f < low ? 1.0f : low;
}

/* y[i] = (gate[i] * logistic(gate[i])) * up[i] */
static inline void silu_mul(const float *gate, const float *up, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = gate[i] * mlas_logistic(gate[i]) * up[i];
}

#endif
