/* Calibration's per-batch statistics work (calib/native_stats.py), called through ctypes: not
 * an ONNX Runtime operator. Per histogram and batch:
 *   AutoglmTakeRows  the token rows a histogram takes, times the SmoothQuant vector, into a
 *                    scratch array, made absolute (and their max returned) unless a rotation
 *                    follows: numpy's GEMM by the Hadamard blocks (the same call as numpy's
 *                    path, so the same bits), then AutoglmAbsMax
 *   AutoglmBinCount  those values' fine-bin counts added to the histogram
 * numpy's path (calib/collect.py, calib/histogram.py) does the same in more passes over memory,
 * on one core; the values and counts are equal. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

/* |a[0:n]| in place; returns the max (NaN when a value is NaN) */
EXPORT float AutoglmAbsMax(float *a, int64_t n) {
  float m = 0.0f;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; i++) {
    const float v = fabsf(a[i]);
    a[i] = v;
    m = v > m ? v : m;
    nan |= v != v;
  }
  return nan ? NAN : m;
}

/* Window w (counted from window0 over all batches) takes the rows t = (window0 + w) mod stride,
 * that + stride, ... (tokens / stride rows); with stride 1, or windows shorter than stride,
 * every row. Row t of window w starts at x + w * window_pitch + t * token_pitch. out gets
 * windows x rows_taken x channels values, times scale[c] when scale is not NULL; with absolute,
 * their absolute values, and the return value is their max (else 0). */
EXPORT float AutoglmTakeRows(const float *x, int64_t windows, int64_t tokens, int64_t channels, int64_t token_pitch,
                             int64_t window_pitch, int64_t stride, int64_t window0, const float *scale, int absolute,
                             float *out) {
  if (stride < 1 || tokens < stride) stride = 1;
  const int64_t taken = tokens / stride;
  float m = 0.0f;
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
      if (absolute) {
        const float row = AutoglmAbsMax(dst, channels);
        m = row != row || row > m ? row : m; /* a NaN stays */
        if (m != m) return m;
      }
    }
  }
  return m;
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
