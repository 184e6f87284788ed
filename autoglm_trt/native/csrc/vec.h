/* The vector routines the operators share: exps (1, 8 and 16 lanes) and softmaxes, SiLU * up, and the
 * fast Walsh-Hadamard transform, each written once. The two softmaxes differ on purpose:
 * ``vec_softmax`` (the decode attention's) is a plain loop the compiler vectorizes (AVX2: intrinsics);
 * ``mlas_softmax`` (the prefill's MaskedSoftmax, AVX-512F builds) repeats MLAS's exp and order of
 * sums to give ONNX Runtime's Softmax bit for bit. */
#ifndef AUTOGLM_VEC_H
#define AUTOGLM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* e^x for x <= 0, in a form the compiler vectorizes: x = (n + f) ln 2 with n an integer and
 * |f| <= 1/2, 2^f from its Taylor series to degree 7 (relative error below 1e-7 there),
 * times 2^n built in the exponent bits. Below -87 (2^-126) the result is 0. */
static inline float exp_nonpositive(float x) {
  const float t = x * 1.4426950408889634f;
  const float n = __builtin_rintf(t), f = (t - n) * 0.6931471805599453f;
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  union { int32_t i; float f; } scale;
  /* n past the exponent's range (x below -87, where the result is 0 anyway, or x = NaN, where p is
   * NaN) is clamped first, so that the conversion and the shift stay defined */
  const float e = n >= -127.0f ? (n <= 128.0f ? n : 128.0f) : -127.0f;
  scale.i = ((int32_t)e + 127) * (1 << 23);
  return t < -126.0f ? 0.0f : p * scale.f;
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp_nonpositive of 8 floats, the same steps with AVX2 intrinsics (PrefillAttention's AVX2
 * softmax bookkeeping: measured faster than the loops GCC made of the scalar form, docs/native.md) */
static inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  /* n clamped as in the scalar form (maxps gives -127 for a NaN n) */
  const __m256 e = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(128.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23);
  const __m256 below = _mm256_cmp_ps(t, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

static inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

/* row[p] = e^(row[p] - top) in place, top the largest of row[0:len] (into *top_out); returns their sum */
static inline float vec_exps(float *row, int64_t len, float *top_out) {
  float top = row[0], sum = 0.0f;
#pragma omp simd reduction(max : top)
  for (int64_t p = 0; p < len; p++) top = row[p] > top ? row[p] : top;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  /* 8 at a time: GCC leaves the loop below scalar where the decode attention inlines it ("control
   * flow in loop"), and there it was a large share of that operator's time at long contexts */
  int64_t p = 0;
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  for (; p + 8 <= len; p += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + p), top8));
    _mm256_storeu_ps(row + p, e);
    sums = _mm256_add_ps(sums, e);
  }
  sum = hsum8(sums);
  for (; p < len; p++) {
    row[p] = exp_nonpositive(row[p] - top);
    sum += row[p];
  }
#else
#pragma omp simd reduction(+ : sum)
  for (int64_t p = 0; p < len; p++) {
    row[p] = exp_nonpositive(row[p] - top);
    sum += row[p];
  }
#endif
  *top_out = top;
  return sum;
}

/* softmax of row[0:len] in place */
static inline void vec_softmax(float *row, int64_t len) {
  float top;
  const float inv = 1.0f / vec_exps(row, len, &top);
#pragma omp simd
  for (int64_t p = 0; p < len; p++) row[p] *= inv;
}

#if defined(__AVX512F__)
/* e^v of 16 floats as MLAS's AVX-512F kernel computes it */
static inline __m512 mlas_exp16(__m512 v) {
  /* MLAS's exp constants (MlasExpConstants) */
  const float LOWER = -103.9720840454f, BIAS = 12582912.f, LOG2E = 1.44269504088896341f, LN2_HIGH = -6.93145752e-1f,
              LN2_LOW = -1.42860677e-6f, P0 = 0x1.694000p-10f, P1 = 0x1.125edcp-7f, P2 = 0x1.555b5ap-5f,
              P3 = 0x1.555450p-3f, P4 = 0x1.fffff6p-2f, P56 = 0x1.000000p+0f;
  __m512 x = _mm512_max_ps(_mm512_set1_ps(LOWER), v);
  const __m512 biased = _mm512_fmadd_ps(_mm512_set1_ps(LOG2E), x, _mm512_set1_ps(BIAS));
  const __m512 m = _mm512_sub_ps(biased, _mm512_set1_ps(BIAS));
  x = _mm512_fmadd_ps(m, _mm512_set1_ps(LN2_HIGH), x);
  x = _mm512_fmadd_ps(m, _mm512_set1_ps(LN2_LOW), x);
  __m512 p = _mm512_set1_ps(P0);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(P1));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(P2));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(P3));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(P4));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(P56));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(P56));
  return _mm512_scalef_ps(p, m);
}

/* row[0:len] = its softmax, as MLAS computes it in place */
static inline void mlas_softmax(float *row, int64_t len) {
  float top = -3.402823466e+38f;
  for (int64_t i = 0; i < len; i++) top = row[i] > top ? row[i] : top;
  const __m512 negative = _mm512_set1_ps(-top);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 e = mlas_exp16(_mm512_add_ps(negative, _mm512_loadu_ps(row + i)));
    acc = _mm512_add_ps(acc, e);
    _mm512_storeu_ps(row + i, e);
  }
  if (i < len) {
    const __mmask16 k = (__mmask16)((1u << (len - i)) - 1);
    const __m512 e = mlas_exp16(_mm512_maskz_add_ps(k, negative, _mm512_maskz_loadu_ps(k, row + i)));
    acc = _mm512_mask_add_ps(acc, k, acc, e);
    _mm512_mask_storeu_ps(row + i, k, e);
  }
  __m256 t = _mm256_add_ps(_mm512_extractf32x8_ps(acc, 1), _mm512_castps512_ps256(acc));
  t = _mm256_hadd_ps(t, t);
  t = _mm256_hadd_ps(t, t);
  const float sum = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  const float scale = 1.0f / sum;
  const __m512 s = _mm512_set1_ps(scale);
  for (i = 0; i + 16 <= len; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(s, _mm512_loadu_ps(row + i)));
  for (; i < len; i++) row[i] *= scale;
}
#endif

/* SiLU(gate) * up as ONNX Runtime computes it: its QuickGelu (alpha 1: gate * logistic(gate),
 * the logistic from MLAS, which evaluates it as a ratio of two polynomials in gate^2 by fused
 * multiply-adds, on gate clamped to [-18, 18], and clamps the result to [0, 1]) and then its Mul.
 * Every step is one correctly rounded operation, so written out one by one (this library is
 * built as ISO C, where GCC contracts no multiply and add on its own) the result is the same
 * float; ``tests/test_float_linear.py`` compares it with ONNX Runtime on this machine. The
 * coefficients are MLAS's (``MlasLogisticConstants``, which credits Eigen's). Without hardware
 * fused multiply-add MLAS rounds each product first, so the rewrite uses this only where the
 * library has it (``native.float_kernel``). MLAS's AVX-512F kernel clamps the result to [0, 1];
 * its FMA3 kernel, which an x86 CPU without AVX-512F runs, clamps it below only, so just above
 * 17.8 it returns 1 + 2^-23 where the other returns 1 (``clamp_one``).
 */
static inline int mlas_logistic_clamps_one(void) {
#if defined(__x86_64__) || defined(__i386__)
  static int known = -1; /* the CPU cannot change: asked once */
  if (known < 0) {
    __builtin_cpu_init();
    known = __builtin_cpu_supports("avx512f") != 0;
  }
  return known;
#else
  return 1;
#endif
}

static inline float mlas_logistic(float x, int clamp_one) {
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
  return clamp_one && 1.0f < low ? 1.0f : low;
}

/* y[i] = (gate[i] * logistic(gate[i])) * up[i] */
static inline void silu_mul(const float *gate, const float *up, float *y, int64_t n) {
  const int clamp_one = mlas_logistic_clamps_one();
  for (int64_t i = 0; i < n; i++) y[i] = gate[i] * mlas_logistic(gate[i], clamp_one) * up[i];
}

/* in-place fast Walsh-Hadamard transform of v[0:b] (Sylvester order), unnormalized: at each
 * stage h every pair (a, c) = (v[j], v[j + h]) becomes (a + c, a - c). The stages whose pairs
 * lie within one vector register run as a permutation and a masked add/subtract, which
 * computes the same sums and differences, so every build gives the same bits. */
static inline void fwht(float *v, int64_t b) {
  int64_t h = 1;
#if defined(__AVX512F__)
  if (b >= 16) {
    for (int64_t i = 0; i < b; i += 16) {
      __m512 x = _mm512_loadu_ps(v + i);
      for (int s = 0; s < 4; s++) { /* h = 1, 2, 4, 8 */
        const int step = 1 << s;
        const __m512i partner = _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(step));
        const __mmask16 upper = (__mmask16)(s == 0 ? 0xAAAA : s == 1 ? 0xCCCC : s == 2 ? 0xF0F0 : 0xFF00);
        const __m512 p = _mm512_permutexvar_ps(partner, x); /* p[l] = x[l ^ h] */
        x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), upper, p, x); /* lower lane a + c, upper a - c */
      }
      _mm512_storeu_ps(v + i, x);
    }
    h = 16;
  }
#elif defined(__AVX2__)
  if (b >= 8) {
    for (int64_t i = 0; i < b; i += 8) {
      __m256 x = _mm256_loadu_ps(v + i);
      for (int s = 0; s < 3; s++) { /* h = 1, 2, 4 */
        const int step = 1 << s;
        const __m256i partner = _mm256_xor_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(step));
        const __m256 p = _mm256_permutevar8x32_ps(x, partner);
        const int upper = s == 0 ? 0xAA : s == 1 ? 0xCC : 0xF0;
        const __m256 mask = _mm256_castsi256_ps(_mm256_setr_epi32(
            -(upper & 1), -((upper >> 1) & 1), -((upper >> 2) & 1), -((upper >> 3) & 1), -((upper >> 4) & 1),
            -((upper >> 5) & 1), -((upper >> 6) & 1), -((upper >> 7) & 1)));
        x = _mm256_blendv_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), mask);
      }
      _mm256_storeu_ps(v + i, x);
    }
    h = 8;
  }
#endif
  for (; h < b; h *= 2)
    for (int64_t i = 0; i < b; i += 2 * h)
#pragma omp simd
      for (int64_t j = i; j < i + h; j++) {
        const float a = v[j], c = v[j + h];
        v[j] = a + c;
        v[j + h] = a - c;
      }
}

#endif
