/* The linears whose weights come in blocks of 32 inputs and whose activations are quantized at
 * run time, per row and block of 32 inputs, to int8 (as ONNX Runtime's MatMulNBits does at
 * accuracy level 4) or to int16: each block's products summed exactly in integers, then scaled in
 * float.
 *
 * Int4WeightLinear: 4-bit weights, one scale and one 4-bit zero point per block of each output
 * (4-bit MatMulNBits). Int8BlockLinear: 8-bit weights, symmetric, one scale per block (8-bit
 * MatMulNBits, whose zero point 128 is taken off). Int8WeightLinear: the same weights, activations
 * in 16 bits (L = 32767 below, L = 127 for the others): what an ``int8-wo`` engine runs, whose
 * activations' rounding (2^-16 of each block's largest) is far below its weights' (2^-8 of each
 * block's largest weight) and below float16's. Every scale is a float16, turned into float32
 * exactly before use: the quantizers round each block's scale to a float16 value
 * (``graph/int4.py``'s ``half_scales``), so the graph's float32 scales are the same numbers.
 *
 * For row x and output n, with xq[b] = rint(x[b] * L / max|x[b]|) (sx[b] = max|x[b]| / L,
 * xs[b] = sum xq[b]; all zero where the block is) and the weights' q[b][n], zero[b][n] (0 for
 * 8 bits), scale[b][n]:
 *
 *     y[n] = sum over blocks b in order of  (float)(q[b][n] . xq[b] - zero[b][n] xs[b]) * (scale[b][n] * sx[b])
 *
 * each product rounded, then added to the sum (no fused multiply-add): every build of the library
 * (AVX2, AVX-512, portable C) gives the same bits, and ``tests/native/test_block_linear.py`` checks
 * them against numpy's. The integer dot products are exact on every instruction set: 4-bit
 * weights (0..15) times int8 inputs (-127..127) never saturate vpmaddubsw's 16-bit pair sums, and
 * 8-bit weights are widened to 16 bits for vpmaddwd (AVX2; the AVX-512 build without VNNI runs
 * these kernels too); VNNI's vpdpbusd adds four products into 32 bits, which nothing here can
 * overflow (docs/native.md has what the VNNI kernels gained). 16-bit inputs times 8-bit
 * weights go pairwise into 32 bits (vpmaddwd, or VNNI's vpdpwssd): a block's sum is at most
 * 32 x 128 x 32767 < 2^31.
 *
 * At batch 1 Int4WeightLinear reads 4.625 bits a weight (4, and the scale's 16 bits and the zero
 * point's 4 over 32 inputs), the 8-bit ones 8.5, Int8Linear 8 (a float32 scale per output).
 *
 * Inputs:
 *   0 x      float32 [..., K]
 *   1 tiles  Int4WeightLinear: uint8 [N16, KB, 8, 32], KB = ceil(K / 32), tile t's block b at
 *            [t, b] (``nibble_of``, ``block_tiles_c.h``); the 8-bit ones: int8 [N16, KB, 16, 32], tile t's block
 *            b at [t, b], pair of inputs p at [t, b, p], byte 2 c + e the weight of output 16 t + c
 *            and input 32 b + 2 p + e. Past K anything (x is 0 there).
 *   2 scales float16 [N16, KB, 16]
 *   3 zeros  uint8 [N16, KB, 8] (Int4WeightLinear only): byte i of tile t's block b holds the zero
 *            points (0..15) of outputs 16 t + 2 i (low nibble) and 16 t + 2 i + 1 (high nibble)
 * Output:
 *   0 y      float32 [..., 16 N16]
 * The Split, SiluMul and SkipNorm forms (their skip, gamma and epsilon inputs after the weights')
 * are Int8Linear's (``int8_linear.c``, ``linear.h``).
 */
#define _POSIX_C_SOURCE 200809L /* sysconf, under -std=c11 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"
#include "ort_api.h"
#include "parallel.h"
#include "tile_runs.h"
#include "vec.h"

#define QBLOCK 32            /* inputs per scale, zero point and activation block */
#define TILE_BLOCK (16 * 16)  /* bytes of one tile's block of 4-bit weights: 16 outputs x 32 inputs */
#define TILE8_BLOCK (16 * 32) /* and of 8-bit weights */

typedef struct {
  const float *x;
  int64_t rows, k, blocks;
  int8_t *xq;       /* rows x blocks x 32 quantized inputs (0 past K); NULL when they are 16-bit */
  int32_t *xs;      /* rows x blocks: their sums */
  float *sx;        /* rows x blocks: their scales */
  int32_t *xp;      /* rows x blocks x XP_WORDS: the quantized inputs as the kernel reads them, or NULL;
                       16-bit inputs are only here, rows x blocks x 16 words of two (input 2p low) */
  const void *w;    /* the tiles */
  const uint16_t *scale; /* float16 */
  const uint8_t *zero;   /* 4-bit weights' zero points, two to a byte; NULL for 8-bit weights */
  int64_t n;
  float *y, *y2; /* the Split forms: columns from n / 2 on go to y2, and each output row has n / 2 */
  int wide;      /* Int8WeightLinear: 16-bit inputs */
} Job;

/* a tile's block, 256 bytes: 4 vectors of 64; vector i's byte 4 c + e holds in its low nibble the
 * weight of output c (of the tile) and input 8 i + e (of the block), in its high nibble that of
 * input 8 i + 4 + e: each nibble plane of a vector is 16 outputs' 32-bit lanes of 4 inputs' weights,
 * in the inputs' own order, the operand vpdpbusd multiplies by a broadcast quad of inputs; one AND
 * takes each plane out (``nibble_of`` in ``block_tiles_c.h`` reads one weight) */
#if defined(__AVX2__)
#include <immintrin.h>
/* a block's 8 bytes of zero points as 16 bytes, one an output */
static inline __m128i zeros16(const uint8_t *zeros) {
  const __m128i p = _mm_loadl_epi64((const __m128i *)zeros), low = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(p, low), _mm_and_si128(_mm_srli_epi16(p, 4), low));
}
/* four inputs as one 32-bit lane */
static inline int32_t quad(const int8_t *x) {
  int32_t v;
  memcpy(&v, x, 4);
  return v;
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "block_tiles_vnni.h"
#elif defined(__AVX2__)
#include "block_tiles_avx2.h"
#else
#include "block_tiles_c.h"
#endif

static void quantize_row(void *data, size_t i) {
  const Job *j = data;
  const float *x = j->x + (int64_t)i * j->k;
  for (int64_t b = 0; b < j->blocks; b++) {
    const int64_t k0 = b * QBLOCK, len = j->k - k0 < QBLOCK ? j->k - k0 : QBLOCK;
    float top = 0.0f;
    for (int64_t p = 0; p < len; p++) top = fabsf(x[k0 + p]) > top ? fabsf(x[k0 + p]) : top;
    const float limit = j->wide ? 32767.0f : 127.0f, inv = top > 0.0f ? limit / top : 0.0f;
    const int64_t at = (int64_t)i * j->blocks + b;
    int32_t v[QBLOCK], sum = 0;
    for (int64_t p = 0; p < QBLOCK; p++) {
      const float r = p < len ? rintf(x[k0 + p] * inv) : 0.0f;
      v[p] = r >= -limit && r <= limit ? (int32_t)r : 0; /* NaN (an input inf or NaN): 0 */
      sum += v[p];
    }
    if (j->wide) {
      for (int p = 0; p < QBLOCK / 2; p++)
        j->xp[at * (QBLOCK / 2) + p] = (int32_t)((uint32_t)(uint16_t)v[2 * p] | (uint32_t)(uint16_t)v[2 * p + 1] << 16);
    } else {
      int8_t *q = j->xq + at * QBLOCK;
      for (int p = 0; p < QBLOCK; p++) q[p] = (int8_t)v[p];
      if (j->xp != NULL) pack_inputs(q, j->xp + at * XP_WORDS(j->zero != NULL));
    }
    j->xs[at] = sum;
    j->sx[at] = top / limit;
  }
}

/* the rows r.. (at most ROWS, below r1) as indices; past ``rows`` they repeat row r */
static int row_group(int64_t r, int64_t r1, int64_t *row) {
  const int rows = (int)(r1 - r < ROWS ? r1 - r : ROWS);
  for (int i = 0; i < ROWS; i++) row[i] = r + (i < rows ? i : 0);
  return rows;
}

/* rows [r0, r1)'s 16 outputs of column tile t */
static void column_tile(const void *job, int64_t t, int64_t r0, int64_t r1) {
  const Job *j = job;
  const int64_t width = j->y2 != NULL ? j->n / 2 : j->n, first = 16 * t; /* an output row */
  float *const out = j->y2 != NULL && first >= width ? j->y2 : j->y;
  const int64_t col = out == j->y ? first : first - width;
  float sums[ROWS * 16];
  for (int64_t r = r0; r < r1; r += ROWS) {
    int64_t row[ROWS];
    const int rows = row_group(r, r1, row);
    tile(j, t, row, rows, sums);
    for (int i = 0; i < rows; i++) memcpy(out + (r + i) * width + col, sums + 16 * i, 16 * sizeof(float));
  }
}

/* the SiluMul forms: rows [r0, r1)'s 16 outputs of gate tile t and of the up tile n / 32
 * tiles on, as SiLU(gate) * up */
static void gated_tile(const void *job, int64_t t, int64_t r0, int64_t r1) {
  const Job *j = job;
  const int64_t half = j->n / 2;
  float gate[ROWS * 16], up[ROWS * 16];
  for (int64_t r = r0; r < r1; r += ROWS) {
    int64_t row[ROWS];
    const int rows = row_group(r, r1, row);
    tile(j, t, row, rows, gate);
    tile(j, half / 16 + t, row, rows, up);
    for (int i = 0; i < rows; i++) silu_mul(gate + 16 * i, up + 16 * i, j->y + (r + i) * half + 16 * t, 16);
  }
}

enum { BYTES, NIBBLES, WIDE }; /* Int8BlockLinear, Int4WeightLinear, Int8WeightLinear */

/* ``kind``'s forms: NIBBLES has zeros at input 3 (the SkipNorm form's inputs from 4), the others
 * their SkipNorm inputs from 3 */
static const char *run_linear(OrtKernelContext *ctx, const Constants *constants, int mode, int kind) {
  const int four = kind == NIBBLES, wide = kind == WIDE;
  LinearCall call;
  int64_t wd[4], sd[3], zd[3] = {0, 0, 8};
  void *w, *scale, *zero = NULL;
  const char *why = linear_input(ctx, mode, &call);
  if (why != NULL) return why;
  if (fixed_input(ctx, constants, 1, &w, wd, 4) || fixed_input(ctx, constants, 2, &scale, sd, 3) ||
      (four && fixed_input(ctx, constants, 3, &zero, zd, 3)))
    return four ? "an input is missing or has the wrong rank (tiles [N16, KB, 8, 32], scales [N16, KB, 16], zeros [N16, KB, 8])"
                : "an input is missing or has the wrong rank (tiles [N16, KB, 16, 32], scales [N16, KB, 16])";
  const int64_t k = call.k, rows = call.rows, blocks = k / QBLOCK + (k % QBLOCK != 0);
  if (!four) zd[0] = wd[0], zd[1] = blocks;
  const int fits = k >= 1 && wd[0] >= 1 && wd[0] <= INT64_MAX / 16 && wd[1] == blocks && wd[2] == (four ? 8 : 16) &&
                   wd[3] == 32 && sd[0] == wd[0] && sd[1] == blocks && sd[2] == 16 && zd[0] == wd[0] &&
                   zd[1] == blocks && zd[2] == 8;
  const char *weights =
      fits ? NULL
           : reason("tiles [%lld, %lld, %lld, %lld], scales [%lld, %lld, %lld]%s do not fit inputs of %lld features "
                    "(want tiles [N16, ceil(K / 32), %d, 32], scales [N16, ceil(K / 32), 16]%s)",
                    (long long)wd[0], (long long)wd[1], (long long)wd[2], (long long)wd[3], (long long)sd[0],
                    (long long)sd[1], (long long)sd[2], four ? " and zeros" : "", (long long)k, four ? 8 : 16,
                    four ? ", zeros [N16, ceil(K / 32), 8]" : "");
  if ((why = linear_begin(ctx, constants, &call, fits ? 16 * wd[0] : 0, four ? 4 : 3, weights)) != NULL)
    return why == linear_done ? NULL : why;
  if (rows > INT64_MAX / (blocks * QBLOCK)) return "input 0 has too many rows";
  const int64_t words = wide ? QBLOCK / 2 : XP_WORDS(four);
  int8_t *xq = wide ? NULL : malloc((size_t)(rows * blocks * QBLOCK));
  int32_t *xs = malloc((size_t)(rows * blocks) * sizeof *xs);
  float *sx = malloc((size_t)(rows * blocks) * sizeof *sx);
  int32_t *xp = words ? malloc((size_t)(rows * blocks * words) * sizeof *xp) : NULL;
  if ((xq == NULL && !wide) || xs == NULL || sx == NULL || (words && xp == NULL)) {
    free(xq), free(xs), free(sx), free(xp);
    return "out of memory for the quantized inputs";
  }
  Job job = {call.x, rows, k, blocks, xq, xs, sx, xp, w, scale, zero, call.n, call.y, call.y2, wide};
  parallel_for(ctx, quantize_row, (size_t)rows, 4, &job);
  run_tiles(ctx, &job, mode == GATED ? gated_tile : column_tile, mode == GATED ? wd[0] / 2 : wd[0], rows);
  linear_end(ctx, &call, 4);
  free(xq), free(xs), free(sx), free(xp);
  return NULL;
}

static int int4_type(const CustomOp *op, size_t i) {
  (void)op; /* the SkipNorm form's skip, gamma and epsilon (inputs 4-6) are float */
  return i == 1 || i == 3 ? ELEM_UINT8 : i == 2 ? ELEM_FLOAT16 : ELEM_FLOAT;
}
static int int8_type(const CustomOp *op, size_t i) { (void)op; return i == 1 ? ELEM_INT8 : i == 2 ? ELEM_FLOAT16 : ELEM_FLOAT; }

LINEAR_OP(int4_weight_linear, "Int4WeightLinear", int4_type, 4, 1, run_linear(ctx, constants, PLAIN, NIBBLES))
LINEAR_OP(int4_weight_linear_split, "Int4WeightLinearSplit", int4_type, 4, 2,
          run_linear(ctx, constants, SPLIT, NIBBLES))
LINEAR_OP(int4_weight_linear_silu_mul, "Int4WeightLinearSiluMul", int4_type, 4, 1,
          run_linear(ctx, constants, GATED, NIBBLES))
LINEAR_OP(int4_weight_linear_skip_norm, "Int4WeightLinearSkipNorm", int4_type, 7, 2,
          run_linear(ctx, constants, NORM, NIBBLES))
LINEAR_OP(int8_block_linear, "Int8BlockLinear", int8_type, 3, 1, run_linear(ctx, constants, PLAIN, BYTES))
LINEAR_OP(int8_block_linear_split, "Int8BlockLinearSplit", int8_type, 3, 2, run_linear(ctx, constants, SPLIT, BYTES))
LINEAR_OP(int8_block_linear_silu_mul, "Int8BlockLinearSiluMul", int8_type, 3, 1,
          run_linear(ctx, constants, GATED, BYTES))
LINEAR_OP(int8_block_linear_skip_norm, "Int8BlockLinearSkipNorm", int8_type, 6, 2,
          run_linear(ctx, constants, NORM, BYTES))
LINEAR_OP(int8_weight_linear, "Int8WeightLinear", int8_type, 3, 1, run_linear(ctx, constants, PLAIN, WIDE))
LINEAR_OP(int8_weight_linear_split, "Int8WeightLinearSplit", int8_type, 3, 2, run_linear(ctx, constants, SPLIT, WIDE))
LINEAR_OP(int8_weight_linear_silu_mul, "Int8WeightLinearSiluMul", int8_type, 3, 1,
          run_linear(ctx, constants, GATED, WIDE))
LINEAR_OP(int8_weight_linear_skip_norm, "Int8WeightLinearSkipNorm", int8_type, 6, 2,
          run_linear(ctx, constants, NORM, WIDE))
