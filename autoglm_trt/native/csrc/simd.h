/* One mapping of the vector operations the kernels use onto the build's instruction set, so that a
 * kernel written over ``vf`` is written once for AVX-512F (16 lanes) and AVX2 (8 lanes); where
 * neither is compiled in, SIMD_LANES is 0 and a kernel takes its plain loops. Each name maps to the
 * one intrinsic (or the one short sequence) the kernels used before, so their roundings do not
 * change: a build of this header computes the same bits as the per-instruction-set code it
 * replaced. ``vf_fma`` and ``vf_exp_nonpositive`` need FMA on AVX2 builds (SIMD_FMA). */
#ifndef AUTOGLM_SIMD_H
#define AUTOGLM_SIMD_H

#include <stdint.h>

#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define SIMD_LANES 16
#if defined(__FMA__)
#define SIMD_FMA 1
#else
#define SIMD_FMA 0
#endif
typedef __m512 vf;
typedef __mmask16 vmask;
#define vf_zero() _mm512_setzero_ps()
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_sub(a, b) _mm512_sub_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_max(a, b) _mm512_max_ps(a, b)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_first(v) _mm512_cvtss_f32(v)
#define vf_with_first(v, x) _mm512_mask_mov_ps(v, 1, _mm512_set1_ps(x)) /* x in lane 0 */
#define vf_load_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define vf_hmax(v) _mm512_reduce_max_ps(v)
#define vf_hsum(v) _mm512_reduce_add_ps(v)
#define vf_exp_nonpositive(v) mlas_exp16(v) /* MLAS's exp: what the AVX-512 kernels were checked against */
/* the lanes below n (none for n <= 0, all for n >= 16) */
static inline vmask vmask_first(int n) {
  return n >= SIMD_LANES ? (vmask)0xFFFF : n > 0 ? (vmask)((1u << n) - 1) : (vmask)0;
}
#define vf_maskz_load(m, p) _mm512_maskz_loadu_ps(m, p) /* 0 in the lanes outside m, which are not read */
#define vf_select(m, outside, inside) _mm512_mask_blend_ps(m, outside, inside)
/* sum + (s0, s1, s2, s3)'s lanes 0, 1, ..., 15, added in that order: the four sums are transposed
 * so that t[k] holds lanes k, k + 4, k + 8, k + 12 of all four, one per 128-bit part, and each
 * lane step is one add of four sums */
static inline __attribute__((always_inline)) __m128 vf_add_lanes4(__m128 sum, vf s0, vf s1, vf s2, vf s3) {
  const vf lo01 = _mm512_unpacklo_ps(s0, s1), hi01 = _mm512_unpackhi_ps(s0, s1);
  const vf lo23 = _mm512_unpacklo_ps(s2, s3), hi23 = _mm512_unpackhi_ps(s2, s3);
  const vf t[4] = {_mm512_shuffle_ps(lo01, lo23, 0x44), _mm512_shuffle_ps(lo01, lo23, 0xEE),
                   _mm512_shuffle_ps(hi01, hi23, 0x44), _mm512_shuffle_ps(hi01, hi23, 0xEE)};
#define LANES(part) /* lanes 4 part .. 4 part + 3, in order */                                               \
  sum = _mm_add_ps(sum, _mm512_extractf32x4_ps(t[0], part));                                                \
  sum = _mm_add_ps(sum, _mm512_extractf32x4_ps(t[1], part));                                                \
  sum = _mm_add_ps(sum, _mm512_extractf32x4_ps(t[2], part));                                                \
  sum = _mm_add_ps(sum, _mm512_extractf32x4_ps(t[3], part));
  LANES(0) LANES(1) LANES(2) LANES(3)
#undef LANES
  return sum;
}
#elif defined(__AVX2__)
#include <immintrin.h>
#define SIMD_LANES 8
#if defined(__FMA__)
#define SIMD_FMA 1
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_exp_nonpositive(v) exp8_nonpositive(v)
#else
#define SIMD_FMA 0
#endif
typedef __m256 vf;
typedef __m256i vmask;
#define vf_zero() _mm256_setzero_ps()
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_sub(a, b) _mm256_sub_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_max(a, b) _mm256_max_ps(a, b)
#define vf_first(v) _mm256_cvtss_f32(v)
#define vf_with_first(v, x) _mm256_blend_ps(v, _mm256_set1_ps(x), 1)
#define vf_load_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define vf_hmax(v) hmax8(v)
#define vf_hsum(v) hsum8(v)
/* the lanes below n, as all-ones words (a lane number compared with n) */
static inline vmask vmask_first(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define vf_maskz_load(m, p) _mm256_maskload_ps(p, m)
#define vf_select(m, outside, inside) _mm256_blendv_ps(outside, inside, _mm256_castsi256_ps(m))
/* sum + (s0, s1, s2, s3)'s lanes 0, 1, ..., 7 in that order: t[k] holds lanes k and k + 4 of all four,
 * one per 128-bit half */
static inline __attribute__((always_inline)) __m128 vf_add_lanes4(__m128 sum, vf s0, vf s1, vf s2, vf s3) {
  const vf lo01 = _mm256_unpacklo_ps(s0, s1), hi01 = _mm256_unpackhi_ps(s0, s1);
  const vf lo23 = _mm256_unpacklo_ps(s2, s3), hi23 = _mm256_unpackhi_ps(s2, s3);
  const vf t[4] = {_mm256_shuffle_ps(lo01, lo23, 0x44), _mm256_shuffle_ps(lo01, lo23, 0xEE),
                   _mm256_shuffle_ps(hi01, hi23, 0x44), _mm256_shuffle_ps(hi01, hi23, 0xEE)};
  for (int k = 0; k < 4; k++) sum = _mm_add_ps(sum, _mm256_castps256_ps128(t[k]));
  for (int k = 0; k < 4; k++) sum = _mm_add_ps(sum, _mm256_extractf128_ps(t[k], 1));
  return sum;
}
#else
#define SIMD_LANES 0
#define SIMD_FMA 0
#endif

#endif
