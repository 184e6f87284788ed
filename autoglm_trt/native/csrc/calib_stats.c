/* Calibration's per-batch statistics work (calib/native_stats.py), called through ctypes: not
 * an ONNX Runtime operator. Per histogram and batch:
 *   AutoglmTakeRows   the token rows a histogram takes, times the SmoothQuant vector, into a
 *                     scratch array; rotated by the Hadamard blocks when asked (as
 *                     AutoglmRotateRows does); made absolute, and their max returned
 *   AutoglmBinCount   those values' fine-bin counts added to the histogram
 *   AutoglmRotateRows rows times the block-diagonal Hadamard matrix: each block's fast
 *                     Walsh-Hadamard transform in double, times H's entry, rounded once to float
 * numpy's path (calib/collect.py, calib/histogram.py, quant/hadamard.rotate_rows) does the same
 * in more passes over memory, on one core, with the same operations in the same order: the values
 * and counts are equal bit for bit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

/* |a[0:n]| in place; returns the max (NaN when a value is NaN) */
static float abs_max(float *a, int64_t n) {
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

/* Vectors of 8 in GCC's vector extensions: each build lowers them to its own registers (one
 * AVX-512 register, two AVX2 ones, four SSE2 ones), lane by lane the same IEEE operations. */
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int64_t v8i __attribute__((vector_size(64)));

/* v's lanes in the order given (Clang's builtin, or GCC's, which has it only from GCC 12 on) */
#if defined(__clang__)
#define LANES8(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define LANES8(v, ...) __builtin_shuffle(v, (v8i){__VA_ARGS__})
#endif

/* One round of sums and differences of the lanes h apart (h = 1, 2, 4) in place: lane j gets
 * v[j] + v[j + h] where j has no bit h, else v[j - h] - v[j], written v[j - h] + (-1 * v[j]),
 * which IEEE arithmetic rounds identically; the lanes after ``sign`` are each lane's partner. */
#define WITHIN8(v, sign, ...) (*(v) = LANES8(*(v), __VA_ARGS__) + *(v) * (v8d)sign)

/* the rounds of sums and differences of the entries h = 1, 2, 4, ... apart over w[0:n], of type T
 * (doubles, or vectors of 8 doubles whose rounds within a vector are done) */
#define ROUNDS(T, w, n)                                \
  for (int64_t h = 1; h < (n); h *= 2)                 \
    for (int64_t i = 0; i < (n); i += 2 * h)           \
      for (int64_t j = i; j < i + h; j++) {            \
        const T a_ = (w)[j], c_ = (w)[j + h];          \
        (w)[j] = a_ + c_;                              \
        (w)[j + h] = a_ - c_;                          \
      }

/* v[0:b] times the b x b Sylvester Hadamard matrix, then times scale, in place: log2(b) rounds of
 * sums and differences of pairs h apart (h = 1, 2, 4, ...) in double, and one rounding to float at
 * the end. For b >= 8 the rounds h < 8 run within each vector of 8 (WITHIN8) and the later ones
 * between vectors; work holds b doubles, 64-byte aligned. */
static void rotate_block(float *v, int64_t b, double scale, double *work) {
  if (b < 8) {
    for (int64_t j = 0; j < b; j++) work[j] = v[j];
    ROUNDS(double, work, b);
    for (int64_t j = 0; j < b; j++) v[j] = (float)(work[j] * scale);
    return;
  }
  v8d *w = (v8d *)work;
  const int64_t n = b / 8;
  for (int64_t i = 0; i < n; i++) {
    v8f f;
    memcpy(&f, v + 8 * i, sizeof f);
    w[i] = __builtin_convertvector(f, v8d);
    WITHIN8(w + i, ((v8d){1, -1, 1, -1, 1, -1, 1, -1}), 1, 0, 3, 2, 5, 4, 7, 6);
    WITHIN8(w + i, ((v8d){1, 1, -1, -1, 1, 1, -1, -1}), 2, 3, 0, 1, 6, 7, 4, 5);
    WITHIN8(w + i, ((v8d){1, 1, 1, 1, -1, -1, -1, -1}), 4, 5, 6, 7, 0, 1, 2, 3);
  }
  ROUNDS(v8d, w, n);
  for (int64_t i = 0; i < n; i++) {
    const v8f f = __builtin_convertvector(w[i] * scale, v8f);
    memcpy(v + 8 * i, &f, sizeof f);
  }
}

/* b doubles, 64-byte aligned (NULL when there is no memory) */
static double *rotation_work(int64_t b) { return aligned_alloc(64, (size_t)((b + 7) / 8 * 8) * sizeof(double)); }

/* out[0:n] = x[0:n] rotated block by block (n a multiple of block, a power of two; out may be x,
 * which is then rotated in place); returns 0, -1
 * when the work buffer cannot be had, -2 when block is not a power of two dividing n (out is then
 * untouched) */
EXPORT int AutoglmRotateRows(const float *x, int64_t n, int64_t block, double scale, float *out) {
  if (block < 1 || (block & (block - 1)) != 0 || n % block != 0) return -2;
  double *work = rotation_work(block);
  if (work == NULL) return -1;
  for (int64_t at = 0; at < n; at += block) {
    if (out != x) memcpy(out + at, x + at, (size_t)block * sizeof(float));
    rotate_block(out + at, block, scale, work);
  }
  free(work);
  return 0;
}

/* Window w (counted from window0 over all batches) takes the rows t = (window0 + w) mod stride,
 * that + stride, ... (tokens / stride rows); with stride 1, or windows shorter than stride,
 * every row. Row t of window w starts at x + w * window_pitch + t * token_pitch. out gets
 * windows x rows_taken x channels values, times scale[c] when scale is not NULL, each row then
 * rotated by Hadamard blocks of `block` channels (times `rotation`, H's entry) when block > 1, then
 * made absolute; returns their max (-1 when the rotation's work buffer cannot be had, -2 when
 * block is not a power of two dividing channels). */
EXPORT float AutoglmTakeRows(const float *x, int64_t windows, int64_t tokens, int64_t channels, int64_t token_pitch,
                             int64_t window_pitch, int64_t stride, int64_t window0, const float *scale, int64_t block,
                             double rotation, float *out) {
  if (stride < 1 || tokens < stride) stride = 1;
  const int64_t taken = tokens / stride;
  double *work = NULL;
  if (block > 1 && ((block & (block - 1)) != 0 || channels % block != 0)) return -2.0f;
  if (block > 1 && (work = rotation_work(block)) == NULL) return -1.0f;
  float m = 0.0f;
  for (int64_t w = 0; w < windows && m == m; w++) {
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
      for (int64_t at = 0; work != NULL && at < channels; at += block) rotate_block(dst + at, block, rotation, work);
      const float row = abs_max(dst, channels);
      m = row != row || row > m ? row : m; /* a NaN stays, and ends the loops */
      if (m != m) break;
    }
  }
  free(work);
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
