/* FloatLinear: y = x W for float32 weights repacked as 16-column tiles, summed in the order ONNX
 * Runtime's own MatMul sums (MLAS's SGEMM over a constant, prepacked B): for each output, the
 * products of each block of 256 inputs accumulated from zero by fused multiply-adds in input
 * order, and the blocks' sums added to the output in order. So the outputs equal MatMul's bit for
 * bit where MLAS uses fused multiply-adds (its AVX2/FMA3 and AVX-512 kernels);
 * ``tests/test_float_linear.py`` checks that against ONNX Runtime on the machine it runs on, and
 * the rewrite (``passes/linears.py``) uses this operator only where the library was built with FMA.
 *
 * Batch-1 decode steps read each weight once: one 64-byte load feeds 16 outputs, and the tiles
 * stream front to back. With more rows, each block of 256 inputs is read from cache for every
 * group of rows: 32 columns (32 KiB) at once up to PAIRED_ROWS rows, 16 (16 KiB) past them; while
 * the last group passes over a block, the next block is prefetched into the second-level cache
 * (measured faster on the SmolLM2 fp32 engine's linears at 16 rows), and in a decode batch (up
 * to PAIRED_ROWS rows) the first group asks for it too (measured faster on a 16-sequence decode
 * step of that engine; asking two blocks ahead was not).
 *
 * Inputs:
 *   0 x       float32 [..., K]
 *   1 weight  float32 [N16, K, 16]   W[k, n] at [n / 16, k, n % 16]; N = 16 N16
 * Output:
 *   0 y       float32 [..., N]
 * FloatLinearSplit: the same, with y's two halves as outputs of their own, [..., N / 2] each (N a
 * multiple of 32); FloatLinearSiluMul: one output, [..., N / 2], SiLU(first half) * second half as
 * ONNX Runtime's QuickGelu and Mul compute it (``vec.h``). Shapes that do not fit together (the
 * rewrite never makes them) fail the run with the reason. FloatLinearSkipNorm: inputs 2-4 (skip [..., N], gamma [N],
 * epsilon scalar) and outputs (normalized, sum), both [..., N]: the linear's output plus skip,
 * and its RMSNorm, as ONNX Runtime's SkipSimplifiedLayerNormalization computes them
 * (``skip_norm.h``).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunks.h"
#include "linear.h"
#include "ort_api.h"
#include "parallel.h"
#include "simd.h"
#include "vec.h"

#define BLOCK 256 /* MLAS_SGEMM_STRIDEK: the inputs one partial sum covers */
#define PAIRED_ROWS 32 /* up to this many rows, two tiles are computed together */
#define GATED_ROWS 64  /* FloatLinearSiluMul's rows at a time */

#if SIMD_LANES > 0 && SIMD_FMA
#define PER_TILE (16 / SIMD_LANES) /* vectors per tile of 16 columns */
/* R rows x T tiles of 16 columns over inputs [k0, k1): the block's sums, stored (first block) or
 * added to y[t][r]; rows past ``rows`` repeat the first and are not stored. Each row's input is
 * broadcast once for the T tiles. With ``pf`` (more than one row), each step also asks for the
 * tiles' next block into the second-level cache (a 64-byte line per step: 1 input). */
#define BLOCK_TILES(R, T)                                                                              \
  static void float_tiles_##R##x##T(const float *const *x, int rows, const float *const *w, int64_t k0,  \
                                    int64_t k1, float *const (*y)[ROWS], int first, const float *const *pf) { \
    vf a[T][PER_TILE][R];                                                                             \
    for (int t = 0; t < T; t++)                                                                       \
      for (int h = 0; h < PER_TILE; h++)                                                              \
        for (int r = 0; r < R; r++) a[t][h][r] = vf_zero();                                           \
    for (int64_t k = k0; k < k1; k++) {                                                               \
      vf v[T][PER_TILE];                                                                              \
      for (int t = 0; t < T; t++)                                                                     \
        for (int h = 0; h < PER_TILE; h++) v[t][h] = vf_load(w[t] + 16 * k + SIMD_LANES * h);         \
      if (R > 1 && pf != NULL)                                                                        \
        for (int t = 0; t < T; t++) __builtin_prefetch(pf[t] + 16 * (k - k0), 0, 2); /* prefetcht1 */ \
      for (int r = 0; r < R; r++) {                                                                   \
        const vf xr = vf_set1(x[r][k]);                                                               \
        for (int t = 0; t < T; t++)                                                                   \
          for (int h = 0; h < PER_TILE; h++) a[t][h][r] = vf_fma(xr, v[t][h], a[t][h][r]);            \
      }                                                                                               \
    }                                                                                                 \
    for (int t = 0; t < T; t++)                                                                       \
      for (int r = 0; r < rows; r++)                                                                  \
        for (int h = 0; h < PER_TILE; h++) {                                                          \
          float *out = y[t][r] + SIMD_LANES * h;                                                      \
          vf_store(out, first ? a[t][h][r] : vf_add(vf_load(out), a[t][h][r]));                       \
        }                                                                                             \
  }
#if SIMD_LANES == 16
#define ROWS 8
const char float_linear_kernel[] = "avx512";
BLOCK_TILES(1, 1)
BLOCK_TILES(1, 2)
BLOCK_TILES(4, 1)
BLOCK_TILES(4, 2)
BLOCK_TILES(8, 1)
BLOCK_TILES(8, 2)
/* groups of 8 rows where there are more than 4 (a batch), of 4 where more than 1, else one row
 * (a decode step), so that few rows are not computed for nothing */
static void float_tiles(const float *const *x, int rows, int tiles, const float *const *w, int64_t k0, int64_t k1,
                        float *const (*y)[ROWS], int first, const float *const *pf) {
  if (rows > 4) (tiles == 2 ? float_tiles_8x2 : float_tiles_8x1)(x, rows, w, k0, k1, y, first, pf);
  else if (rows > 1) (tiles == 2 ? float_tiles_4x2 : float_tiles_4x1)(x, rows, w, k0, k1, y, first, pf);
  else (tiles == 2 ? float_tiles_1x2 : float_tiles_1x1)(x, rows, w, k0, k1, y, first, pf);
}
#else
#define ROWS 2
const char float_linear_kernel[] = "avx2-fma";
BLOCK_TILES(2, 1)
/* AVX2's 16 registers: two rows of one tile at a time, each tile in turn, no prefetch */
static void float_tiles(const float *const *x, int rows, int tiles, const float *const *w, int64_t k0, int64_t k1,
                        float *const (*y)[ROWS], int first, const float *const *pf) {
  (void)pf;
  for (int t = 0; t < tiles; t++) float_tiles_2x1(x, rows, w + t, k0, k1, y + t, first, NULL);
}
#endif
#else
#define ROWS 1
const char float_linear_kernel[] = "portable C"; /* fmaf: the same sums, slowly; the rewrite skips it */
static void float_tiles(const float *const *x, int rows, int tiles, const float *const *w, int64_t k0, int64_t k1,
                        float *const (*y)[ROWS], int first, const float *const *pf) {
  (void)rows, (void)pf;
  for (int t = 0; t < tiles; t++)
    for (int i = 0; i < 16; i++) {
      float a = 0.0f;
      for (int64_t k = k0; k < k1; k++) a = fmaf(x[0][k], w[t][16 * k + i], a);
      y[t][0][i] = first ? a : y[t][0][i] + a;
    }
}
#endif

typedef struct {
  const float *x;
  int64_t rows, k, n;
  const float *w; /* the tiles */
  float *y, *y2; /* FloatLinearSplit: columns from n / 2 on go to y2, and each output row has n / 2 */
  int64_t chunk, items; /* rows a work item computes (``chunks.h``); work items a chunk */
} Job;

/* rows [r0, r1) of ``tiles`` (1 or 2) column tiles, tile t's outputs of row r at
 * out[t] + (r - r0) * width, block by block of inputs (the tiles' block, 16 or 32 KiB, stays in
 * cache while the row groups pass over it) */
static void tiles_into(const Job *j, const int64_t *tile, int tiles, int64_t r0, int64_t r1, float *const *out,
                       int64_t width) {
  const float *w[2];
  for (int t = 0; t < 2; t++) w[t] = j->w + tile[t < tiles ? t : 0] * j->k * 16;
  /* a decode batch's few rows: both tiles at once, each input broadcast once for both; many rows
   * (a prefill): one tile after the other, whose block alone stays in the first-level cache */
  const int together = r1 - r0 <= PAIRED_ROWS ? tiles : 1;
  for (int t0 = 0; t0 < tiles; t0 += together)
    for (int64_t k0 = 0; k0 < j->k; k0 += BLOCK) {
      const int64_t k1 = j->k - k0 < BLOCK ? j->k : k0 + BLOCK;
      for (int64_t r = r0; r < r1; r += ROWS) {
        const int rows = (int)(r1 - r < ROWS ? r1 - r : ROWS);
        const float *x[ROWS];
        float *y[2][ROWS];
        for (int i = 0; i < ROWS; i++) { /* rows past ``rows`` repeat the first and are not stored */
          const int64_t row = r + (i < rows ? i : 0);
          x[i] = j->x + row * j->k;
          for (int t = 0; t < together; t++) y[t][i] = out[t0 + t] + (row - r0) * width;
        }
        /* while the last row group passes over a block, the next block comes into the second-level
         * cache: with more than one row the weights are otherwise read from memory only while the
         * first group passes, and memory waits while the others compute (not for one row, which
         * only streams; there a prefetch slowed it). In a decode batch's few groups the first group
         * asks for it too, a block earlier: measured faster than either group asking alone (why
         * the last group's requests still help is not known; perhaps some of the first's dropped) */
        const float *next[2] = {w[t0] + 16 * k1, w[t0 + together - 1] + 16 * k1};
        const int ask = r + ROWS >= r1 || (r == r0 && r1 - r0 <= PAIRED_ROWS);
        const int prefetch = ask && k1 < j->k;
        float_tiles(x, rows, together, w + t0, k0, k1, (float *const(*)[ROWS])y, k0 == 0, prefetch ? next : NULL);
      }
    }
}

/* a chunk's outputs of column tiles 2p and 2p + 1 (the last pair may have one) */
static void tile_pair(void *data, size_t i) {
  const Job *j = data;
  int64_t r0, r1;
  const int64_t p = chunk_item(i, j->items, j->chunk, j->rows, &r0, &r1);
  const int64_t width = j->y2 != NULL ? j->n / 2 : j->n, tile[2] = {2 * p, 2 * p + 1};
  float *out[2];
  for (int t = 0; t < 2; t++) { /* where each tile's outputs of row r0 go */
    const int64_t col = 16 * tile[t];
    out[t] = (j->y2 != NULL && col >= width ? j->y2 + (col - width) : j->y + col) + r0 * width;
  }
  tiles_into(j, tile, j->n / 16 - tile[0] < 2 ? 1 : 2, r0, r1, out, width);
}

/* FloatLinearSiluMul: a chunk's outputs of gate tile t and of the up tile n / 32 tiles on, as
 * SiLU(gate) * up, GATED_ROWS rows at a time (the two tiles' sums wait on the stack) */
static void gated_pair(void *data, size_t i) {
  const Job *j = data;
  int64_t c0, c1;
  const int64_t t = chunk_item(i, j->items, j->chunk, j->rows, &c0, &c1);
  const int64_t half = j->n / 2, tile[2] = {t, half / 16 + t};
  float sums[GATED_ROWS * 32];
  float *const out[2] = {sums, sums + 16};
  for (int64_t r0 = c0; r0 < c1; r0 += GATED_ROWS) {
    const int64_t r1 = c1 - r0 < GATED_ROWS ? c1 : r0 + GATED_ROWS;
    tiles_into(j, tile, 2, r0, r1, out, 32);
    for (int64_t r = r0; r < r1; r++)
      silu_mul(sums + 32 * (r - r0), sums + 32 * (r - r0) + 16, j->y + r * half + 16 * t, 16);
  }
}

static const char *run_linear(OrtKernelContext *ctx, const Constants *constants, int mode) {
  LinearCall call;
  int64_t wd[3];
  void *w;
  const char *why = linear_input(ctx, mode, &call);
  if (why != NULL) return why;
  if (fixed_input(ctx, constants, 1, &w, wd, 3)) return "the weights (input 1) are missing or not of rank 3";
  const int64_t k = call.k, rows = call.rows;
  const char *weights = wd[1] == k && wd[2] == 16 && k >= 1 && wd[0] <= INT64_MAX / 16 ? NULL
                        : reason("weights [%lld, %lld, %lld] do not fit inputs of %lld features (want [N / 16, K, 16])",
                                 (long long)wd[0], (long long)wd[1], (long long)wd[2], (long long)k);
  if ((why = linear_begin(ctx, constants, &call, weights == NULL ? 16 * wd[0] : 0, 2, weights)) != NULL)
    return why == linear_done ? NULL : why;
  const int64_t chunk = chunk_rows(rows), chunks = (rows + chunk - 1) / chunk;
  const int64_t items = mode == GATED ? wd[0] / 2 : (wd[0] + 1) / 2; /* gate tiles, or tile pairs */
  Job job = {call.x, rows, k, call.n, w, call.y, call.y2, chunk, items};
  parallel_for(ctx, mode == GATED ? gated_pair : tile_pair, (size_t)(items * chunks), 2, &job);
  linear_end(ctx, &call, 2);
  return NULL;
}

static int input_type(const CustomOp *op, size_t i) { (void)op, (void)i; return ELEM_FLOAT; }

LINEAR_OP(float_linear, "FloatLinear", input_type, 2, 1, run_linear(ctx, constants, PLAIN))
LINEAR_OP(float_linear_split, "FloatLinearSplit", input_type, 2, 2, run_linear(ctx, constants, SPLIT))
LINEAR_OP(float_linear_silu_mul, "FloatLinearSiluMul", input_type, 2, 1, run_linear(ctx, constants, GATED))
LINEAR_OP(float_linear_skip_norm, "FloatLinearSkipNorm", input_type, 5, 2, run_linear(ctx, constants, NORM))
