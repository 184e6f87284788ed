/* Calibration's per-batch statistics work (calib/native_stats.py), called through ctypes: not
 * an ONNX Runtime operator. Two steps per histogram and batch:
 *   AutoglmAbsRows   the token rows a histogram takes, times the SmoothQuant vector, block-
 *                    rotated, absolute, into a scratch array; returns their max
 *   AutoglmBinCount  those values' fine-bin counts added to the histogram
 * numpy does the same (calib/collect.py, calib/histogram.py) in several passes over memory;
 * here each is one. The rotation is the fast Walsh-Hadamard transform of rotate.h times
 * 1/sqrt(b), so it differs from numpy's b x b GEMM by float rounding only. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rotate.h"

#define EXPORT __attribute__((visibility("default")))

/* Window w (counted from window0 over all batches) takes the rows t = (window0 + w) mod stride,
 * that + stride, ... (tokens / stride rows); with stride 1, or windows shorter than stride,
 * every row. Row t of window w starts at x + w * window_pitch + t * token_pitch. out holds
 * windows x rows_taken x channels values; the return value is their max (NaN when one is NaN). */
EXPORT float AutoglmAbsRows(const float *x, int64_t windows, int64_t tokens, int64_t channels, int64_t token_pitch,
                            int64_t window_pitch, int64_t stride, int64_t window0, const float *scale,
                            int64_t block, float *out) {
  if (stride < 1 || tokens < stride) stride = 1;
  const int64_t taken = tokens / stride;
  const int rotate = block > 1 && valid_block(block, channels);
  const float norm = rotate ? (float)(1.0 / sqrt((double)block)) : 1.0f;
  float m = 0.0f;
  int nan = 0;
  for (int64_t w = 0; w < windows; w++) {
    const int64_t first = stride == 1 ? 0 : (window0 + w) % stride;
    for (int64_t r = 0; r < taken; r++) {
      const float *src = x + w * window_pitch + (first + r * stride) * token_pitch;
      float *dst = out + (w * taken + r) * channels;
      if (scale != NULL) {
#pragma omp simd
        for (int64_t c = 0; c < channels; c++) dst[c] = src[c] * scale[c];
      } else {
        memcpy(dst, src, (size_t)channels * sizeof(float));
      }
      if (rotate) {
        for (int64_t at = 0; at < channels; at += block) fwht(dst + at, block);
#pragma omp simd
        for (int64_t c = 0; c < channels; c++) dst[c] *= norm;
      }
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t c = 0; c < channels; c++) {
        const float v = fabsf(dst[c]);
        dst[c] = v;
        m = v > m ? v : m;
        nan |= v != v;
      }
    }
  }
  return nan ? NAN : m;
}

/* fine[min(trunc(a[i] * inv_width), bins - 1)] += 1 for a[0:n] (all >= 0 and finite): what
 * numpy's multiply, truncating cast and bincount do, the top ones folded into the last bin. The
 * bin indices of a chunk are computed first, in vector registers, then counted. */
EXPORT void AutoglmBinCount(const float *a, int64_t n, float inv_width, int64_t *fine, int64_t bins) {
  const float top = (float)(bins - 1);
  int64_t index[1024];
  for (int64_t at = 0; at < n; at += 1024) {
    const int64_t m = n - at < 1024 ? n - at : 1024;
#pragma omp simd
    for (int64_t j = 0; j < m; j++) {
      const float v = a[at + j] * inv_width;
      index[j] = (int64_t)(v < top ? v : top);
    }
    for (int64_t j = 0; j < m; j++) fine[index[j]]++;
  }
}
