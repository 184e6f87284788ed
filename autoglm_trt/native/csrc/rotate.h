/* The block-Hadamard rotation + uint8 quantization of an INT8 linear's input row, shared by
 * HadamardQuantize and Int8Linear (the graph's Reshape, MatMul by H, QuantizeLinear, Reshape;
 * graph/quant.py). A fast Walsh-Hadamard transform stands in for the b x b GEMM per block. */
#ifndef AUTOGLM_ROTATE_H
#define AUTOGLM_ROTATE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK 4096

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

/* 1 when b is a block size the operators take: a power of two up to MAX_BLOCK dividing n */
static inline int valid_block(int64_t b, int64_t n) { return b >= 1 && b <= MAX_BLOCK && !(b & (b - 1)) && n % b == 0; }

/* y[0:n] = saturate(round_half_even(fwht(x block) * factor) + zero), block by block of b;
 * factor = 1 / (sqrt(b) * scale) */
static inline void rotate_quantize(const float *x, uint8_t *y, int64_t n, int64_t b, float factor, float zero) {
  float buf[MAX_BLOCK];
  for (int64_t at = 0; at < n; at += b) {
    memcpy(buf, x + at, (size_t)b * sizeof(float));
    fwht(buf, b);
#pragma omp simd
    for (int64_t j = 0; j < b; j++) {
      const float q = rintf(buf[j] * factor) + zero;
      y[at + j] = (uint8_t)(q < 0.0f ? 0.0f : q > 255.0f ? 255.0f : q);
    }
  }
}

#endif
