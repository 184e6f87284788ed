/* Int8Linear: an INT8 linear in one operator: the input's block-Hadamard rotation and uint8
 * quantization (as HadamardQuantize), the integer product with weights packed for the CPU's
 * dot-product instructions, and the dequantization (as MatMulIntegerToFloat, whose result it
 * equals: the integer sums are exact and the scaling is the same float product).
 *
 * When one row multiplies the weights (a batch-1 decode step, which an INT8 engine's time is
 * mostly made of), ONNX Runtime's quantization + MatMulIntegerToFloat were measured reading
 * them much more slowly than this operator does on this project's machines. The
 * packed layout lets one 64-byte load feed 16 outputs x 4 inputs; each thread takes runs of
 * adjacent tiles (``tile_runs.h``). A batch (a decode step of
 * several sequences, a prefill) goes 8 rows at a time with VNNI (2 with AVX2), a chain of
 * accumulation per row over each tile, the last group of rows prefetching the next tile: on the
 * SmolLM2 INT8 engine's linears that measured faster than 16 rows at a time, and than 4 without
 * the prefetch. The 32-bit sums hold any K up to MAX_K (|sum| <= 255 x 128 x K < 2^31).
 *
 * Inputs:
 *   0 x             float32 [..., K]
 *   1 hadamard      float32 [b, b]          only its size is read (as in HadamardQuantize)
 *   2 act_scale     float32 scalar          the input's quantization scale
 *   3 act_zero      uint8 scalar            and zero point
 *   4 weight        int8 [N16, K4, 16, 4]   W[k, n] at [n / 16, k / 4, n % 16, k % 4]; zero
 *                                           past N and past K (K4 = ceil(K / 4))
 *   5 col_sums      int32 [N16 * 16]        sum over k of W[k, n]
 *   6 weight_scale  float32 [N]
 * Output:
 *   0 y             float32 [..., N]        (sum_k (xq[k] - zero) W[k, n]) * (act_scale * weight_scale[n])
 * Shapes that do not fit together (the rewrite, passes/linears.py, never makes them) fail the run
 * with the reason.
 *
 * Int8LinearSplit: the same, with y's two halves as outputs of their own, [..., N / 2] each (a
 * fused gate/up projection and the Split that follows it; N a multiple of 32, so no tile of 16
 * columns straddles them). The values are Int8Linear's, bit for bit. Int8LinearSiluMul: one output,
 * [..., N / 2], SiLU(first half) * second half as ONNX Runtime's QuickGelu and Mul compute it
 * (``vec.h``): a gate/up projection and its activation. Int8LinearSkipNorm: inputs 7-9 (skip
 * [..., N], gamma [N], epsilon scalar) and outputs (normalized, sum), both [..., N]: the linear's
 * output plus skip, and its RMSNorm, as ONNX Runtime's SkipSimplifiedLayerNormalization computes
 * them (``skip_norm.h``).
 */
#define _POSIX_C_SOURCE 200809L /* sysconf, under -std=c11 */
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "chunks.h"
#include "linear.h"
#include "ort_api.h"
#include "parallel.h"
#include "rotate.h"
#include "tile_runs.h"
#include "vec.h"


#if defined(__AVX2__)
static inline int32_t quad(const uint8_t *x) { /* four input bytes as one 32-bit lane */
  int32_t v;
  memcpy(&v, x, 4);
  return v;
}
#endif

/* A 16-column tile's dot products, mapped once onto the build's integer instructions: ``wtile`` a
 * step's 64 bytes of weights (16 columns x 4 inputs) as loaded, ``acc16`` one row's 16 column sums
 * as held, ``acc_dot`` adds one quad of inputs times a step's weights. The sums are exact integers
 * on every build, so every build and every order of accumulation gives the same bits. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ROWS 8
typedef __m512i wtile; /* vpdpbusd: 4 unsigned inputs x 4 signed weights into each column's lane */
typedef __m512i acc16;
#define w_load(p) _mm512_loadu_si512(p)
#define acc_zero() _mm512_setzero_si512()
#define acc_add(a, b) _mm512_add_epi32(a, b)
#define acc_dot(a, x, v) _mm512_dpbusd_epi32(a, _mm512_set1_epi32(quad(x)), v)
#define acc_store(sums, a) _mm512_storeu_si512(sums, a)
const char int8_linear_kernel[] = "avx512-vnni";
#elif defined(__AVX2__)
#include <immintrin.h>
#define ROWS 2
/* no 8-bit dot product: weights widened to int16 and pairs multiplied and added exactly
 * (vpmaddwd); each of a row's 4 vectors holds 4 columns x 2 partial sums */
typedef struct { __m256i c[4]; } wtile;
typedef struct { __m256i c[4]; } acc16;
static inline wtile w_load(const int8_t *p) {
  wtile v;
  for (int c = 0; c < 4; c++) v.c[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * c)));
  return v;
}
static inline acc16 acc_zero(void) { return (acc16){{_mm256_setzero_si256(), _mm256_setzero_si256(),
                                                     _mm256_setzero_si256(), _mm256_setzero_si256()}}; }
static inline acc16 acc_add(acc16 a, acc16 b) {
  for (int c = 0; c < 4; c++) a.c[c] = _mm256_add_epi32(a.c[c], b.c[c]);
  return a;
}
static inline acc16 acc_dot(acc16 a, const uint8_t *x, wtile v) {
  const __m256i q = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128(quad(x))));
  for (int c = 0; c < 4; c++) a.c[c] = _mm256_add_epi32(a.c[c], _mm256_madd_epi16(v.c[c], q));
  return a;
}
static inline void acc_store(int32_t *sums, acc16 a) {
  for (int c = 0; c < 4; c++) {
    int32_t part[8];
    _mm256_storeu_si256((__m256i *)part, a.c[c]);
    for (int i = 0; i < 4; i++) sums[4 * c + i] = part[2 * i] + part[2 * i + 1];
  }
}
const char int8_linear_kernel[] = "avx2";
#else
#define ROWS 1
typedef const int8_t *wtile;
typedef struct { int32_t s[16]; } acc16;
#define w_load(p) (p)
static inline acc16 acc_zero(void) { return (acc16){{0}}; }
static inline acc16 acc_add(acc16 a, acc16 b) {
  for (int i = 0; i < 16; i++) a.s[i] += b.s[i];
  return a;
}
static inline acc16 acc_dot(acc16 a, const uint8_t *x, wtile v) {
  for (int i = 0; i < 16; i++)
    for (int e = 0; e < 4; e++) a.s[i] += (int32_t)x[e] * (int32_t)v[4 * i + e];
  return a;
}
static inline void acc_store(int32_t *sums, acc16 a) { memcpy(sums, a.s, sizeof a.s); }
const char int8_linear_kernel[] = "portable C";
#endif

/* tile_R(): sums[r * 16 + i] = sum_k x[r][k] * W[k, 16 t + i] for rows r < rows <= R of one
 * 16-column tile w (K4 * 64 bytes): R chains of accumulation, each step's weights loaded once for
 * all of them; with ``pf`` (never for one row), each step also asks for one line of the next tile
 * ``pf`` into the second-level cache. Rows past ``rows`` repeat row 0 and are not stored. */
#define ROWS_TILE(R)                                                                                         \
  static inline void tile_##R(const uint8_t *const *x, int rows, const int8_t *w, int64_t k4, int32_t *sums, \
                              const int8_t *pf) {                                                            \
    acc16 a[R];                                                                                              \
    for (int r = 0; r < R; r++) a[r] = acc_zero();                                                           \
    for (int64_t k = 0; k < k4; k++) {                                                                       \
      const wtile v = w_load(w + 64 * k);                                                                    \
      if (pf != NULL) __builtin_prefetch(pf + 64 * k, 0, 2);                                                 \
      for (int r = 0; r < R; r++) a[r] = acc_dot(a[r], x[r] + 4 * k, v);                                     \
    }                                                                                                        \
    for (int r = 0; r < rows; r++) acc_store(sums + 16 * r, a[r]);                                           \
  }
ROWS_TILE(2)
ROWS_TILE(4)
ROWS_TILE(8)
static void tile(const uint8_t *const *x, int rows, const int8_t *w, int64_t k4, int32_t *sums, const int8_t *pf) {
  if (rows == 1) { /* a decode step: two chains over alternate steps, so that the loads overlap */
    acc16 a = acc_zero(), b = acc_zero();
    int64_t k = 0;
    for (; k + 2 <= k4; k += 2) {
      a = acc_dot(a, x[0] + 4 * k, w_load(w + 64 * k));
      b = acc_dot(b, x[0] + 4 * k + 4, w_load(w + 64 * k + 64));
    }
    if (k < k4) a = acc_dot(a, x[0] + 4 * k, w_load(w + 64 * k));
    acc_store(sums, acc_add(a, b));
  } else if (rows <= 2 || ROWS < 4) { /* no tile reads past x[ROWS - 1] */
    tile_2(x, rows, w, k4, sums, pf);
  } else if (rows <= 4 || ROWS < 8) {
    tile_4(x, rows, w, k4, sums, pf);
  } else {
    tile_8(x, rows, w, k4, sums, pf);
  }
}

#define MAX_K 65536  /* inputs whose integer sums fit 32 bits on every build */
#define SUM_ROWS CHUNK_ROWS /* AMX takes a work item's rows at once, at most a chunk (chunks.h) */

typedef struct {
  const float *x;
  uint8_t *xq; /* rows x kp quantized inputs */
  int64_t rows, k, kp, b;
  float factor, zero;
  const int8_t *w;
  const int32_t *col_sums;
  const float *w_scale;
  float a_scale;
  int64_t n;
  float *y;
  float *y2; /* Int8LinearSplit: columns from n / 2 on go here, and each output row has n / 2 */
  int amx;   /* groups of 16 rows go through AMX (amx.c) */
} Job;

static void quantize_row(void *data, size_t i) {
  const Job *j = data;
  uint8_t *row = j->xq + (int64_t)i * j->kp;
  rotate_quantize(j->x + (int64_t)i * j->k, row, j->k, j->b, j->factor, j->zero);
  memset(row + j->k, 0, (size_t)(j->kp - j->k)); /* the weights are zero there */
}

/* the rows' ``tile`` sums (of rows x 16) rows r.. of columns first.. dequantized: ``count`` floats
 * per row, row i at y + i * stride */
static void dequantize(const Job *j, const int32_t *sums, int rows, int64_t first, int64_t count, float *y,
                       int64_t stride) {
  const int32_t zero = (int32_t)j->zero;
#if defined(__AVX512F__)
  if (count == 16) { /* the same integer difference, conversion and products, 16 at a time */
    const __m512i offset = _mm512_mullo_epi32(_mm512_set1_epi32(zero), _mm512_loadu_si512(j->col_sums + first));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(j->a_scale), _mm512_loadu_ps(j->w_scale + first));
    for (int i = 0; i < rows; i++)
      _mm512_storeu_ps(y + i * stride,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums + 16 * i), offset)), scale));
    return;
  }
#endif
  for (int i = 0; i < rows; i++) /* the difference wraps, as the vector instructions' does */
    for (int64_t c = 0; c < count; c++)
      y[i * stride + c] = (float)(int32_t)((uint32_t)sums[16 * i + c] - (uint32_t)zero * (uint32_t)j->col_sums[first + c]) *
                          (j->a_scale * j->w_scale[first + c]);
}

/* the quantized inputs of rows r.. (at most ROWS, below r1; past ``rows`` they repeat row r) */
static int row_group(const Job *j, int64_t r, int64_t r1, const uint8_t **x) {
  const int rows = (int)(r1 - r < ROWS ? r1 - r : ROWS);
  for (int i = 0; i < ROWS; i++) x[i] = j->xq + (r + (i < rows ? i : 0)) * j->kp;
  return rows;
}

/* the tile after tile t, if below tile ``end``, while the last group of rows r.. (below r1)
 * passes over tile t (the next tile is where this thread most likely goes next); NULL for one
 * row, which only streams, and there a prefetch slowed it */
static const int8_t *next_tile(const Job *j, int64_t r, int64_t r1, int64_t t, int64_t end) {
  return j->rows > 1 && r + ROWS >= r1 && t + 1 < end ? j->w + (t + 1) * (j->kp * 16) : NULL;
}

/* the integer sums of column tile t (of ``end``) for rows r.. (below r1): with AMX all whole
 * groups of 16 of them, else at most ROWS; returns how many rows */
static int64_t tile_sums(const Job *j, int64_t r, int64_t r1, int64_t t, int64_t end, int32_t *sums) {
  const int8_t *w = j->w + t * (j->kp * 16);
  if (j->amx && r1 - r >= 16) {
    const int64_t rows = (r1 - r) / 16 * 16;
    amx_int8_sums(j->xq + r * j->kp, j->kp, rows, w, j->kp, sums);
    return rows;
  }
  const uint8_t *x[ROWS];
  const int rows = row_group(j, r, r1, x);
  tile(x, rows, w, j->kp / 4, sums, next_tile(j, r, r1, t, end));
  return rows;
}

/* rows [r0, r1)'s 16 outputs of column tile t */
static void column_tile(const void *job, int64_t t, int64_t r0, int64_t r1) {
  const Job *j = job;
  int32_t sums[SUM_ROWS * 16];
  const int64_t first = (int64_t)t * 16, count = j->n - first < 16 ? j->n - first : 16;
  const int64_t width = j->y2 != NULL ? j->n / 2 : j->n; /* an output row */
  float *const out = j->y2 != NULL && first >= width ? j->y2 : j->y;
  const int64_t col = out == j->y ? first : first - width;
  for (int64_t r = r0, rows; r < r1; r += rows) {
    rows = tile_sums(j, r, r1, t, (j->n + 15) / 16, sums);
    dequantize(j, sums, (int)rows, first, count, out + r * width + col, width);
  }
}

/* Int8LinearSiluMul: rows [r0, r1)'s 16 outputs of gate tile t and of the up tile n / 32 tiles
 * on, as SiLU(gate) * up */
static void gated_tile(const void *job, int64_t t, int64_t r0, int64_t r1) {
  const Job *j = job;
  const int64_t half = j->n / 2, first = t * 16;
  int32_t sums[SUM_ROWS * 16];
  float gate[SUM_ROWS * 16], up[SUM_ROWS * 16];
  for (int64_t r = r0, rows; r < r1; r += rows) {
    rows = tile_sums(j, r, r1, t, half / 16, sums);
    dequantize(j, sums, (int)rows, first, 16, gate, 16);
    tile_sums(j, r, r1, half / 16 + t, j->n / 16, sums);
    dequantize(j, sums, (int)rows, half + first, 16, up, 16);
    for (int64_t i = 0; i < rows; i++) silu_mul(gate + 16 * i, up + 16 * i, j->y + (r + i) * half + first, 16);
  }
}

static const char *run_linear(OrtKernelContext *ctx, const Constants *constants, int mode) {
  LinearCall call;
  int64_t hd[2], none[1], wd[4], cd[1], sd[1];
  void *h, *scale, *zero, *w, *col_sums, *w_scale;
  const char *why = linear_input(ctx, mode, &call);
  if (why != NULL) return why;
  if (fixed_input(ctx, constants, 1, &h, hd, 2) || fixed_input(ctx, constants, 2, &scale, none, 0) ||
      fixed_input(ctx, constants, 3, &zero, none, 0) || fixed_input(ctx, constants, 4, &w, wd, 4) ||
      fixed_input(ctx, constants, 5, &col_sums, cd, 1) || fixed_input(ctx, constants, 6, &w_scale, sd, 1))
    return "an input is missing or has the wrong rank (hadamard [b, b], scalar scale and zero, weight "
           "[N16, K4, 16, 4], col_sums [16 N16], weight_scale [N])";
  const int64_t k = call.k, rows = call.rows, n = sd[0], b = hd[0];
  const int packed = wd[0] >= 1 && wd[1] >= 1 && wd[2] == 16 && wd[3] == 4; /* then its sizes are bounded */
  const int64_t kp = packed ? 4 * wd[1] : 0;
  const float s = *(const float *)scale;
  const char *weights =
      k > MAX_K ? reason("inputs of %lld features are more than %d, past which the integer sums could overflow",
                         (long long)k, MAX_K)
      : k < 1 || !valid_block(b, k) || hd[1] != b
          ? reason("a Hadamard block of %lld x %lld does not fit inputs of %lld features", (long long)hd[0],
                   (long long)hd[1], (long long)k)
      : !(s > 0.0f) ? "the activation scale must be positive"
      : !packed || kp < k || kp - k >= 4 || n > 16 * wd[0] || n <= 16 * (wd[0] - 1) || cd[0] != 16 * wd[0]
          ? reason("weight [%lld, %lld, %lld, %lld], col_sums [%lld] and weight_scale [%lld] do not fit inputs of "
                   "%lld features (want [ceil(N / 16), ceil(K / 4), 16, 4], [16 ceil(N / 16)] and [N])",
                   (long long)wd[0], (long long)wd[1], (long long)wd[2], (long long)wd[3], (long long)cd[0],
                   (long long)n, (long long)k)
          : NULL;
  if ((why = linear_begin(ctx, constants, &call, n, 7, weights)) != NULL) return why == linear_done ? NULL : why;
  uint8_t *xq = malloc((size_t)(rows * kp));
  if (xq == NULL) return "out of memory for the quantized inputs";
  Job job = {call.x, xq, rows, k, kp, b, 1.0f / (sqrtf((float)b) * s), (float)*(const uint8_t *)zero,
             w, col_sums, w_scale, s, n, call.y, call.y2, rows >= 16 && kp % 64 == 0 && amx_ready()};
  parallel_for(ctx, quantize_row, (size_t)rows, 4, &job);
  /* gated: the gate tiles */
  run_tiles(ctx, &job, mode == GATED ? gated_tile : column_tile, mode == GATED ? wd[0] / 2 : wd[0], rows);
  linear_end(ctx, &call, 4);
  free(xq);
  return NULL;
}

static int input_type(const CustomOp *op, size_t i) {
  (void)op; /* Int8LinearSkipNorm's skip, gamma and epsilon (inputs 7-9) are float too */
  static const int types[] = {ELEM_FLOAT, ELEM_FLOAT, ELEM_FLOAT, ELEM_UINT8, ELEM_INT8, ELEM_INT32, ELEM_FLOAT};
  return i < 7 ? types[i] : ELEM_FLOAT;
}

LINEAR_OP(int8_linear, "Int8Linear", input_type, 7, 1, run_linear(ctx, constants, PLAIN))
LINEAR_OP(int8_linear_split, "Int8LinearSplit", input_type, 7, 2, run_linear(ctx, constants, SPLIT))
LINEAR_OP(int8_linear_silu_mul, "Int8LinearSiluMul", input_type, 7, 1, run_linear(ctx, constants, GATED))
LINEAR_OP(int8_linear_skip_norm, "Int8LinearSkipNorm", input_type, 10, 2, run_linear(ctx, constants, NORM))
