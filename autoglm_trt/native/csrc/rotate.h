/* The block-Hadamard rotation + uint8 quantization of an INT8 linear's input row, shared by
 * HadamardQuantize and Int8Linear (the graph's Reshape, MatMul by H, QuantizeLinear, Reshape;
 * graph/quant.py). A fast Walsh-Hadamard transform stands in for the b x b GEMM per block. */
#ifndef AUTOGLM_ROTATE_H
#define AUTOGLM_ROTATE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK 4096

#include "vec.h"

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
