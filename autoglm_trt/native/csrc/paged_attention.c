/* PagedAttention: a custom operator for ONNX Runtime's CPU execution provider.
 *
 * Attention of each sequence's new tokens over its past keys and values, read in place from
 * the paged pools by its block table, and over the new tokens themselves (causal). It does
 * what the engine graph's Gather + MatMul + mask + Softmax + MatMul nodes do, without copying
 * the past out of the pool: the graph form gathers every layer's past K/V into a fresh tensor
 * on every step, and that copy, not the arithmetic, is most of a decode step's attention.
 *
 * Inputs (float32 unless said):
 *   0 q             [B, T, Hq, D]   queries after RoPE, already scaled by 1/sqrt(D)
 *   1 k_new         [B, T, Hkv, D]  keys of the new tokens
 *   2 v_new         [B, T, Hkv, D]  values of the new tokens
 *   3 pool_k        [Hkv, NB, BS, D]
 *   4 pool_v        [Hkv, NB, BS, D]
 *   5 block_tables  [B, MB] int64
 *   6 context_lens  [B] int64       tokens of each sequence already in the pools
 *   7 query_lens    [B] int64       valid new tokens of each sequence (the rest is padding)
 * Output:
 *   0 attn          [B, T, Hq * D]  rows of padding tokens are zero
 * Query head j reads KV head j / (Hq / Hkv), as in the graph's grouped layout.
 *
 * PagedAttentionInt8KV: the same for an INT8 KV cache. Inputs 3 and 4 are int8 pools, and
 *   8 k_scales     [Hkv]           the pools' symmetric scales of each KV head (value = int8 * scale),
 *                  or [Hkv, NB, BS] a scale of each stored token and KV head (a per-token cache's
 *                  scale pools, laid out as the pools without their rows)
 *   9 v_scales     the same for V
 * The new tokens' K and V (inputs 1 and 2) stay float, as in the graph.
 *
 * Storing a decode step's new K/V (optional inputs, both operators): given ``slots`` (input 8, or
 * 10 for int8 pools: [B] int64, the flat pool slot block * BS + offset of each sequence's new
 * token, as vLLM's slot mapping), the operator also writes each sequence's new K and V there, so
 * the runner need not scatter them after the step (vLLM's kernels do the same). Only for one new
 * token a sequence (T = 1); a negative slot, or one past the pools, stores nothing. The pools are
 * written in place through their inputs: they are bound to the runner's own arrays, which nothing
 * else reads during the step; a new token's slot is past its sequence's context, which attention
 * reads, in a block no other sequence holds (the scheduler copies a shared block before a
 * sequence writes to it), so no other work item reads it either.
 * For int8 pools the values stored are inputs 11 and 12 ([B, 1, Hkv, D] int8: the graph's
 * quantized ``new_key.<i>``/``new_value.<i>``, what the runner stored before); with per-token
 * scales, inputs 13 and 14 ([B, 1, Hkv] float32: ``new_key_scale.<i>``, ``new_value_scale.<i>``)
 * go into the scale pools at the same slots.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "parallel.h"
#include "simd.h"

/* A past longer than this many positions (rounded down to whole blocks) is split into parts of
 * that size, each its own work item, and their outputs merged (flash-decoding's split of the
 * keys): a sequence's work spreads over more threads than it has KV heads (GLM-4.1V: 2). The
 * split depends on the context alone, so the output does not depend on the number of threads. */
#define PART_POSITIONS 1024

/* The vector kernels below ("turned" loops) reproduce the roundings of the plain loops further down
 * as GCC vectorizes them for the build's vector width, 512 bits (AVX-512) or 256 (AVX2); the test
 * builds the plain loops too (-DAUTOGLM_LOOP_DOT4) and compares the two builds bit for bit. */
#if SIMD_LANES && !defined(AUTOGLM_LOOP_DOT4)
#define TURNED SIMD_LANES /* lanes of a vector */
/* int8 key rows scored at once, their chains of lane adds overlapping; on AVX2 one: four keys' 64
 * sums would not fit its 16 registers */
#define I8_KEYS (TURNED == 16 ? 4 : 1)
#define MUL_ADD(acc, a, b) vf_add(acc, vf_mul(a, b)) /* two roundings, as the loop's */
#endif

#ifdef TURNED
#define F32_KEYS 1 /* float32 key rows scored at once (two, on AVX2, measured no faster) */

/* dot4 of float32 rows in vector registers, with the roundings of the plain loop as GCC vectorizes
 * it: lane l of each sum adds the products of elements l, l + TURNED, ... in order (a multiply,
 * then an add), the elements past the last full vector join lane 0, and the lanes are then added
 * in order to 0: 0 + l0 + l1 + .... GCC does that last step through the stack, one lane at a
 * time; here the four sums are transposed in registers, so each lane step is one add of four sums.
 * (For AVX-512 that is the loop's order where GCC vectorizes with 512-bit vectors, as for AMD's
 * AVX-512 cores; its tuning for Intel's prefers 256 bits, whose loop rounds otherwise.) KEYS key
 * rows at once (x, x + n, ...), each query row's vector loaded once for all; out[4 k + i] is row
 * i's sum with key k. */
static inline __attribute__((always_inline)) void dot4_f32_keys(const float *x, const float *const *q, int64_t n,
                                                                int keys, float *out) {
  vf s[F32_KEYS][4];
  for (int k = 0; k < keys; k++)
    for (int r = 0; r < 4; r++) s[k][r] = vf_zero();
  int64_t i = 0;
  for (; i + TURNED <= n; i += TURNED) {
    vf qv[4];
    for (int r = 0; r < 4; r++) qv[r] = vf_load(q[r] + i);
    for (int k = 0; k < keys; k++) {
      const vf v = vf_load(x + k * n + i);
      for (int r = 0; r < 4; r++) s[k][r] = MUL_ADD(s[k][r], qv[r], v);
    }
  }
  for (int k = 0; k < keys && i < n; k++) { /* the rest, one element at a time, into lane 0 */
    float rest[4];
    for (int r = 0; r < 4; r++) rest[r] = vf_first(s[k][r]);
    for (int64_t j = i; j < n; j++)
      for (int r = 0; r < 4; r++) rest[r] += q[r][j] * x[k * n + j];
    for (int r = 0; r < 4; r++) s[k][r] = vf_with_first(s[k][r], rest[r]);
  }
  for (int k = 0; k < keys; k++)
    _mm_storeu_ps(out + 4 * k, vf_add_lanes4(_mm_setzero_ps(), s[k][0], s[k][1], s[k][2], s[k][3]));
}

static inline __attribute__((always_inline)) void dot4_f32_vec(const float *x, const float *a, const float *b,
                                                               const float *c, const float *d, int64_t n,
                                                               float *out) {
  const float *q[4] = {a, b, c, d};
  dot4_f32_keys(x, q, n, 1, out);
}

static void dot4_i8(const int8_t *x, const float *a, const float *b, const float *c, const float *d, int64_t n,
                    float *out);

/* dot4 of int8 rows (an INT8 KV pool's keys) with the roundings of the loop as GCC vectorizes it
 * (read from its assembly): 4 TURNED elements a step, as four vectors of partial sums per sum
 * (lane l of vector v takes elements 4 TURNED j + TURNED v + l, a multiply and then an add), and at
 * the end the 4 TURNED lanes added in order to 0, vector 0's first. KEYS key rows at once (x,
 * x + n, ...): their chains of lane adds are independent, so more keys overlap more of them. n is a
 * multiple of 4 TURNED; out[4 k + i] is row i's sum with key k. */
static inline __attribute__((always_inline)) void dot4_i8_keys(const int8_t *x, const float *const *q, int64_t n,
                                                               int keys, float *out) {
  vf s[I8_KEYS][4][4]; /* key, row, vector */
  for (int k = 0; k < keys; k++)
    for (int r = 0; r < 4; r++)
      for (int v = 0; v < 4; v++) s[k][r][v] = vf_zero();
  for (int64_t i = 0; i < n; i += 4 * TURNED)
    for (int k = 0; k < keys; k++)
      for (int v = 0; v < 4; v++) {
        const vf xf = vf_load_i8(x + k * n + i + TURNED * v);
        for (int r = 0; r < 4; r++) s[k][r][v] = MUL_ADD(s[k][r][v], vf_load(q[r] + i + TURNED * v), xf);
      }
  __m128 sum[I8_KEYS];
  for (int k = 0; k < keys; k++) sum[k] = _mm_setzero_ps();
  for (int v = 0; v < 4; v++)
    for (int k = 0; k < keys; k++) sum[k] = vf_add_lanes4(sum[k], s[k][0][v], s[k][1][v], s[k][2][v], s[k][3][v]);
  for (int k = 0; k < keys; k++) _mm_storeu_ps(out + 4 * k, sum[k]);
}

/* one key; rows whose length is not a multiple of 4 TURNED (which GCC finishes one element at a
 * time) take the loop itself */
static inline __attribute__((always_inline)) void dot4_i8_vec(const int8_t *x, const float *a, const float *b,
                                                              const float *c, const float *d, int64_t n,
                                                              float *out) {
  if (n % (4 * TURNED)) {
    dot4_i8(x, a, b, c, d, n, out);
    return;
  }
  const float *q[4] = {a, b, c, d};
  dot4_i8_keys(x, q, n, 1, out);
}
#define DOT4_f32 dot4_f32_vec
#define DOT4_i8 dot4_i8_vec
#else
#define DOT4_f32 dot4_f32
#define DOT4_i8 dot4_i8
#endif

/* Row operations on a key or value row of element type T (float32, or int8 of an INT8 KV pool,
 * whose scale the caller applies): four dot products with one row x (four independent sums,
 * so they overlap in the pipeline), the scores of every query row against one key row, four
 * rows at a time, and out += w * x. */
#define DEFINE_ROW_OPS(SUFFIX, T)                                                                          \
  __attribute__((unused)) static void dot4_##SUFFIX(const T *x, const float *a, const float *b,            \
                                                    const float *c, const float *d, int64_t n, float *out) { \
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                                      \
    _Pragma("omp simd reduction(+ : s0, s1, s2, s3)") for (int64_t i = 0; i < n; i++) {                   \
      const float v = (float)x[i];                                                                         \
      s0 += a[i] * v;                                                                                      \
      s1 += b[i] * v;                                                                                      \
      s2 += c[i] * v;                                                                                      \
      s3 += d[i] * v;                                                                                      \
    }                                                                                                      \
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;                                                    \
  }                                                                                                        \
  static void key_scores_##SUFFIX(const float *const *qr, int64_t rows, const T *key, int64_t D,          \
                                  float *scores, int64_t width) {                                          \
    int64_t r = 0;                                                                                         \
    for (; r + 4 <= rows; r += 4) {                                                                        \
      float s[4];                                                                                          \
      DOT4_##SUFFIX(key, qr[r], qr[r + 1], qr[r + 2], qr[r + 3], D, s);                                    \
      for (int i = 0; i < 4; i++) scores[(r + i) * width] = s[i];                                          \
    }                                                                                                      \
    if (r < rows) { /* the last 1..3 rows, the missing ones repeating the last */                          \
      float s[4];                                                                                          \
      const float *last = qr[rows - 1];                                                                    \
      DOT4_##SUFFIX(key, qr[r], r + 1 < rows ? qr[r + 1] : last, r + 2 < rows ? qr[r + 2] : last, last, D, \
                    s);                                                                                    \
      for (int64_t i = 0; r + i < rows; i++) scores[(r + i) * width] = s[i];                               \
    }                                                                                                      \
  }                                                                                                        \
  static void axpy_##SUFFIX(float *out, float w, const T *x, int64_t n) {                                  \
    _Pragma("omp simd") for (int64_t d = 0; d < n; d++) out[d] += w * (float)x[d];                         \
  }
DEFINE_ROW_OPS(f32, float)
DEFINE_ROW_OPS(i8, int8_t)

#ifdef TURNED
/* The two passes with their loops turned (head_dim 64 and 128, either pool): for the scores, keys
 * inner, so that one call scores a whole block and the out-of-order core overlaps one key's sums
 * with the next's; for the values, each query row's output kept in registers across positions,
 * rather than loaded and stored for each. Each score and each output element gets the operations
 * of key_scores_*, axpy_f32 and axpy_i8, in the same order. */

/* scores[r * width + s] = q_r . keys[s], s < n, every query row r < rows, for key rows of type T
 * (float32, or an INT8 KV pool's int8 before its scale: D a multiple of 4 TURNED), several keys
 * at a time (dot4_f32_keys, dot4_i8_keys) */
#define DEFINE_BLOCK_SCORES(SUFFIX, T, KEYS)                                                               \
  static void block_scores_##SUFFIX(const float *const *qr, int64_t rows, const T *keys, int64_t n, int64_t D, \
                                    float *scores, int64_t width) {                                        \
    const float *last = qr[rows - 1];                                                                      \
    for (int64_t r = 0; r < rows; r += 4) {                                                                \
      const float *q[4] = {qr[r], r + 1 < rows ? qr[r + 1] : last, r + 2 < rows ? qr[r + 2] : last,        \
                           r + 3 < rows ? qr[r + 3] : last};                                               \
      const int64_t k = rows - r < 4 ? rows - r : 4;                                                       \
      for (int64_t s = 0; s < n;) {                                                                        \
        const int keys_now = n - s >= KEYS ? KEYS : 1;                                                     \
        float out[4 * KEYS];                                                                               \
        if (keys_now == KEYS)                                                                              \
          dot4_##SUFFIX##_keys(keys + s * D, q, D, KEYS, out);                                             \
        else                                                                                               \
          dot4_##SUFFIX##_keys(keys + s * D, q, D, 1, out);                                                \
        for (int j = 0; j < keys_now; j++)                                                                 \
          for (int64_t i = 0; i < k; i++) scores[(r + i) * width + s + j] = out[4 * j + i];                \
        s += keys_now;                                                                                     \
      }                                                                                                    \
    }                                                                                                      \
  }
DEFINE_BLOCK_SCORES(f32, float, F32_KEYS)
DEFINE_BLOCK_SCORES(i8, int8_t, I8_KEYS)

/* orow[r][col ..] += w * V[p][col ..] for the positions p < ctx in order, w = scores[r * width + p]
 * (times the pool's scale v_scale for an int8 pool, as axpy_i8's caller computes it), for ROWS
 * query rows (exactly: a row computed for nothing costs a quarter more at three query heads per KV
 * head), each row's CHUNKS vectors from column col held in registers; V's rows are D long */
#define DEFINE_VALUES(SUFFIX, T, LOAD, WEIGHT, ROWS, CHUNKS)                                               \
  static void values_##SUFFIX##_##ROWS##x##CHUNKS(float *const *orow, const float *scores, int64_t width,  \
                                                   const void *pool_v, float v_scale, const int64_t *table, \
                                                   int64_t ctx, int64_t BS, int64_t D, int64_t col) {      \
    (void)v_scale; /* float32 pools have none */                                                           \
    vf acc[ROWS][CHUNKS];                                                                                  \
    for (int r = 0; r < ROWS; r++)                                                                         \
      for (int c = 0; c < CHUNKS; c++) acc[r][c] = vf_load(orow[r] + col + TURNED * c);                    \
    for (int64_t m = 0; m * BS < ctx; m++) {                                                               \
      const int64_t block = table[m];                                                                      \
      const int64_t n = ctx - m * BS < BS ? ctx - m * BS : BS;                                             \
      for (int64_t s = 0; s < n; s++) {                                                                    \
        const T *v = (const T *)pool_v + (block * BS + s) * D + col;                                       \
        vf w[ROWS];                                                                                        \
        for (int r = 0; r < ROWS; r++) w[r] = vf_set1(WEIGHT(scores[r * width + m * BS + s], v_scale));    \
        for (int c = 0; c < CHUNKS; c++) {                                                                 \
          const vf vc = LOAD(v + TURNED * c);                                                              \
          for (int r = 0; r < ROWS; r++) acc[r][c] = MUL_ADD(acc[r][c], w[r], vc);                      \
        }                                                                                                  \
      }                                                                                                    \
    }                                                                                                      \
    for (int r = 0; r < ROWS; r++)                                                                         \
      for (int c = 0; c < CHUNKS; c++) vf_store(orow[r] + col + TURNED * c, acc[r][c]);                    \
  }
#define AS_IS(score, scale) (score)
#define SCALED(score, scale) ((score) * (scale))
typedef void (*ValuesFn)(float *const *, const float *, int64_t, const void *, float, const int64_t *, int64_t,
                         int64_t, int64_t, int64_t);
#if TURNED == 16 /* head_dim 64: groups of up to four rows, each a whole row of 4 vectors; 128: up to two */
#define MORE_VALUES(SUFFIX, T, LOAD, WEIGHT)                                                               \
  DEFINE_VALUES(SUFFIX, T, LOAD, WEIGHT, 4, 4)                                                             \
  DEFINE_VALUES(SUFFIX, T, LOAD, WEIGHT, 1, 8)                                                             \
  DEFINE_VALUES(SUFFIX, T, LOAD, WEIGHT, 2, 8)
#else /* 16 registers: groups of up to three rows, 4 vectors (32 columns) of each */
#define MORE_VALUES(SUFFIX, T, LOAD, WEIGHT)
#endif
#define DEFINE_VALUES_OF(SUFFIX, T, LOAD, WEIGHT)                                                          \
  DEFINE_VALUES(SUFFIX, T, LOAD, WEIGHT, 1, 4)                                                             \
  DEFINE_VALUES(SUFFIX, T, LOAD, WEIGHT, 2, 4)                                                             \
  DEFINE_VALUES(SUFFIX, T, LOAD, WEIGHT, 3, 4)                                                             \
  MORE_VALUES(SUFFIX, T, LOAD, WEIGHT)
DEFINE_VALUES_OF(f32, float, vf_load, AS_IS)
DEFINE_VALUES_OF(i8, int8_t, vf_load_i8, SCALED)

/* the functions for a group of g rows (fns[g - 1]), the most rows a group takes, the columns one
 * call covers (span), and the positions one call covers (0: all; AVX2: one block, so that a
 * block's values stay in the first-level cache across the groups and column spans) */
static const ValuesFn *values_fns(int int8, int64_t D, int64_t *most, int64_t *span, int64_t *per_call) {
#if TURNED == 16
  static const ValuesFn f32_d64[] = {values_f32_1x4, values_f32_2x4, values_f32_3x4, values_f32_4x4},
                        f32_d128[] = {values_f32_1x8, values_f32_2x8},
                        i8_d64[] = {values_i8_1x4, values_i8_2x4, values_i8_3x4, values_i8_4x4},
                        i8_d128[] = {values_i8_1x8, values_i8_2x8};
  *most = D == 64 ? 4 : 2, *span = D, *per_call = 0;
  return D == 64 ? (int8 ? i8_d64 : f32_d64) : (int8 ? i8_d128 : f32_d128);
#else
  static const ValuesFn f32[] = {values_f32_1x4, values_f32_2x4, values_f32_3x4},
                        i8[] = {values_i8_1x4, values_i8_2x4, values_i8_3x4};
  (void)D;
  *most = 3, *span = 4 * TURNED, *per_call = 1;
  return int8 ? i8 : f32;
#endif
}

/* the values pass of every row, in groups; head_dim D is 64 or 128 */
static void values_pass(float *const *orow, int64_t rows, const float *scores, int64_t width, const void *pool_v,
                        int int8, float v_scale, const int64_t *table, int64_t ctx, int64_t BS, int64_t D) {
  int64_t most, span, per_call;
  const ValuesFn *fns = values_fns(int8, D, &most, &span, &per_call);
  const int64_t step = per_call ? per_call * BS : ctx;
  for (int64_t p = 0; p < ctx; p += step) {
    const int64_t n = ctx - p < step ? ctx - p : step;
    for (int64_t r = 0; r < rows; r += most) {
      const int64_t g = rows - r < most ? rows - r : most;
      for (int64_t col = 0; col < D; col += span)
        fns[g - 1](orow + r, scores + r * width + p, width, pool_v, v_scale, table + p / BS, n, BS, D, col);
    }
  }
}
#endif

/* scores[r * width + p] *= the scale of past position p, for every row r < rows: the head's
 * ``scale`` where ``token_scales`` is NULL, else the scale stored with position p (this head's
 * part of a scale pool, read through the block table) */
static void scale_past(float *scores, int64_t rows, int64_t width, const float *token_scales, float scale,
                       const int64_t *table, int64_t ctx, int64_t BS) {
  for (int64_t r = 0; r < rows; r++) {
    float *row = scores + r * width;
    if (token_scales == NULL) {
      for (int64_t p = 0; p < ctx; p++) row[p] *= scale;
      continue;
    }
    for (int64_t m = 0; m * BS < ctx; m++) { /* block by block: its scales are contiguous */
      const float *s = token_scales + table[m] * BS;
      const int64_t n = ctx - m * BS < BS ? ctx - m * BS : BS;
      for (int64_t k = 0; k < n; k++) row[m * BS + k] *= s[k];
    }
  }
}

/* one sequence, one KV head: ``rows`` query rows (valid new token t = r / G, query head
 * h * G + r % G) at qr[r], their outputs at orow[r]; scores is [rows, ctx + qlen] scratch.
 * The pools hold float32, or int8 with this head's scales k_scale and v_scale, or with the
 * per-token scales k_ts and v_ts (this head's part of the scale pools; NULL for static scales).
 * ``stats`` NULL: the outputs are attention's; else each row's weights are left unnormalized,
 * e^(score - top), and stats[2 r], stats[2 r + 1] get the row's top score and the weights' sum
 * (a part of the past, merged with the others' by merge_parts). qlen 0: no new tokens. */
static void attend(const float *const *qr, float *const *orow, int64_t rows, int64_t G, const float *k_new,
                   const float *v_new, int64_t new_stride, const void *pool_k, const void *pool_v, int int8,
                   float k_scale, float v_scale, const float *k_ts, const float *v_ts, const int64_t *table,
                   int64_t ctx, int64_t qlen, int64_t BS, int64_t D, float *scores, float *stats) {
  const int64_t width = ctx + qlen;
#ifdef TURNED
  const int turned = D == 64 || D == 128;
#else
  const int turned = 0;
#endif
  for (int64_t m = 0; m * BS < ctx; m++) {
    const int64_t block = table[m]; /* inside the pool: check_sequences */
    const int64_t n = ctx - m * BS < BS ? ctx - m * BS : BS;
#ifdef TURNED
    if (turned) {
      if (int8)
        block_scores_i8(qr, rows, (const int8_t *)pool_k + block * BS * D, n, D, scores + m * BS, width);
      else
        block_scores_f32(qr, rows, (const float *)pool_k + block * BS * D, n, D, scores + m * BS, width);
      continue;
    }
#endif
    for (int64_t s = 0; s < n; s++) {
      const int64_t at = (block * BS + s) * D;
      if (int8)
        key_scores_i8(qr, rows, (const int8_t *)pool_k + at, D, scores + m * BS + s, width);
      else
        key_scores_f32(qr, rows, (const float *)pool_k + at, D, scores + m * BS + s, width);
    }
  }
  if (int8) scale_past(scores, rows, width, k_ts, k_scale, table, ctx, BS);
  for (int64_t j = 0; j < qlen; j++) /* rows of tokens t >= j */
    key_scores_f32(qr + j * G, rows - j * G, k_new + j * new_stride, D, scores + j * G * width + ctx + j, width);
  for (int64_t r = 0; r < rows; r++) {
    const int64_t len = qlen ? ctx + r / G + 1 : ctx; /* a row sees the new tokens up to its own */
    if (stats == NULL)
      vec_softmax(scores + r * width, len);
    else
      stats[2 * r + 1] = vec_exps(scores + r * width, len, &stats[2 * r]);
  }
  if (v_ts != NULL) { /* each past probability takes its value row's scale, and the values pass none */
    scale_past(scores, rows, width, v_ts, 1.0f, table, ctx, BS);
    v_scale = 1.0f;
  }
#ifdef TURNED
  if (turned) values_pass(orow, rows, scores, width, pool_v, int8, v_scale, table, ctx, BS, D);
#endif
  for (int64_t m = 0; !turned && m * BS < ctx; m++) {
    const int64_t block = table[m];
    const int64_t n = ctx - m * BS < BS ? ctx - m * BS : BS;
    for (int64_t s = 0; s < n; s++) {
      const int64_t at = (block * BS + s) * D, p = m * BS + s;
      for (int64_t r = 0; r < rows; r++) {
        if (int8)
          axpy_i8(orow[r], scores[r * width + p] * v_scale, (const int8_t *)pool_v + at, D);
        else
          axpy_f32(orow[r], scores[r * width + p], (const float *)pool_v + at, D);
      }
    }
  }
  for (int64_t j = 0; j < qlen; j++)
    for (int64_t r = j * G; r < rows; r++) axpy_f32(orow[r], scores[r * width + ctx + j], v_new + j * new_stride, D);
}

typedef struct {
  const float *q, *k_new, *v_new;
  const void *pool_k, *pool_v;
  float *out;
  const int64_t *tables, *ctx_lens, *q_lens;
  int64_t T, Hq, Hkv, D, NB, BS, MB;
  const float *k_scales, *v_scales; /* per KV head, for int8 pools; NULL for float32 pools */
  float *k_ts, *v_ts;               /* per-token scale pools [Hkv, NB, BS], or NULL */
  const int64_t *slots;             /* each sequence's slot for its new K/V, or NULL: none stored */
  const void *k_store, *v_store;    /* the new K/V to store, [B, 1, Hkv, D] of the pools' type */
  const float *ks_store, *vs_store; /* their per-token scales [B, 1, Hkv] (per-token pools) */
  int64_t part;                     /* past positions a work item takes (a multiple of BS) */
  const int64_t *items;             /* each work item's sequence, KV head, part of the past and where
                                       its part's rows are (-1: none); after the count of them, each
                                       sequence's and KV head's first item */
  int64_t count;                    /* work items */
  float *parts;                     /* split items' outputs and stats, at items[4 i + 3] (-1: none) */
  int failed;                       /* a work item found no memory for its scratch */
} Job;

/* the parts a sequence's past of ``ctx`` positions is split into */
static int64_t parts_of(const Job *j, int64_t ctx) { return ctx > j->part ? (ctx + j->part - 1) / j->part : 1; }

/* sequence b's new K and V of KV head h into its slot, if that is inside the pools */
static void store(const Job *j, int64_t b, int64_t h) {
  const int64_t slot = j->slots[b], D = j->D;
  if (slot < 0 || slot >= j->NB * j->BS) return;
  const size_t size = j->k_scales != NULL || j->k_ts != NULL ? sizeof(int8_t) : sizeof(float);
  const size_t to = (size_t)((h * j->NB * j->BS + slot) * D) * size, from = (size_t)((b * j->Hkv + h) * D) * size;
  memcpy((char *)j->pool_k + to, (const char *)j->k_store + from, (size_t)D * size);
  memcpy((char *)j->pool_v + to, (const char *)j->v_store + from, (size_t)D * size);
  if (j->k_ts != NULL) {
    j->k_ts[h * j->NB * j->BS + slot] = j->ks_store[b * j->Hkv + h];
    j->v_ts[h * j->NB * j->BS + slot] = j->vs_store[b * j->Hkv + h];
  }
}

/* work item i: sequence b, KV head h and part c of its past (items[4 i ..]), with scratch of its
 * own. A past of one part is attended whole into the output; each part of a longer one (its last
 * part with the new tokens) into the item's rows of ``parts``, unnormalized, with its stats. */
static void run_item(void *data, size_t i) {
  Job *j = data;
  const int64_t *item = j->items + 4 * i, b = item[0], h = item[1], c = item[2];
  const int64_t G = j->Hq / j->Hkv, T = j->T, D = j->D, ctx = j->ctx_lens[b], n = j->q_lens[b];
  const int64_t parts = parts_of(j, ctx), p0 = parts > 1 ? c * j->part : 0;
  const int64_t past = parts > 1 && ctx - p0 > j->part ? j->part : ctx - p0, qlen = c == parts - 1 ? n : 0;
  if (n > 0) { /* a sequence of no new tokens (padding) has nothing to attend */
    /* scratch: the scores [n G, past + qlen] (bounded by check_sequences), then the query and output row pointers */
    const size_t score_bytes = ((size_t)(n * G * (past + qlen)) * sizeof(float) + 63) / 64 * 64;
    char *scratch = thread_scratch(score_bytes + 2 * (size_t)(n * G) * sizeof(float *));
    if (scratch == NULL) {
      __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
      return;
    }
    float *scores = (float *)scratch, *part = parts > 1 ? j->parts + item[3] : NULL;
    const float **qr = (const float **)(scratch + score_bytes);
    float **orow = (float **)(qr + n * G);
    for (int64_t r = 0; r < n * G; r++) {
      const int64_t at = ((b * T + r / G) * j->Hq + h * G + r % G) * D;
      qr[r] = j->q + at;
      orow[r] = part != NULL ? part + r * D : j->out + at;
    }
    if (part != NULL) memset(part, 0, (size_t)(n * G * D) * sizeof(float));
    const int int8 = j->k_scales != NULL || j->k_ts != NULL, per_head = j->k_scales != NULL;
    const size_t pool = (size_t)(h * j->NB * j->BS * D) * (int8 ? sizeof(int8_t) : sizeof(float));
    const int64_t step = (b * T * j->Hkv + h) * D, head_scales = h * j->NB * j->BS;
    attend(qr, orow, n * G, G, j->k_new + step, j->v_new + step, j->Hkv * D, (const char *)j->pool_k + pool,
           (const char *)j->pool_v + pool, int8, per_head ? j->k_scales[h] : 1.0f, per_head ? j->v_scales[h] : 1.0f,
           j->k_ts != NULL ? j->k_ts + head_scales : NULL, j->v_ts != NULL ? j->v_ts + head_scales : NULL,
           j->tables + b * j->MB + p0 / j->BS, past, qlen, j->BS, D, scores, part != NULL ? part + n * G * D : NULL);
  }
  if (j->slots != NULL && c == 0) store(j, b, h); /* its slot is past every part's positions */
}

/* item i's sequence and KV head, where its past was split: the parts' outputs into the output.
 * Each part's rows were weighted by e^(score - top_c); with top the largest top_c, part c's rows
 * count e^(top_c - top) / sum over parts of e^(top_c - top) sum_c, added in the parts' order. */
static void merge_parts(void *data, size_t i) {
  const Job *j = data;
  const int64_t b = (int64_t)i / j->Hkv, h = (int64_t)i % j->Hkv, G = j->Hq / j->Hkv, D = j->D;
  const int64_t ctx = j->ctx_lens[b], n = j->q_lens[b], parts = parts_of(j, ctx);
  if (parts == 1 || n == 0) return;
  const int64_t *first = j->items + 4 * j->items[4 * j->count + i]; /* KV head h's parts, in order */
  for (int64_t r = 0; r < n * G; r++) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < parts; c++) {
      const float *stats = j->parts + first[4 * c + 3] + n * G * D;
      top = stats[2 * r] > top ? stats[2 * r] : top;
    }
    for (int64_t c = 0; c < parts; c++) {
      const float *stats = j->parts + first[4 * c + 3] + n * G * D;
      total += exp_nonpositive(stats[2 * r] - top) * stats[2 * r + 1];
    }
    float *out = j->out + ((b * j->T + r / G) * j->Hq + h * G + r % G) * D;
    for (int64_t c = 0; c < parts; c++) {
      const float *part = j->parts + first[4 * c + 3], *stats = part + n * G * D;
      const float w = exp_nonpositive(stats[2 * r] - top) / total;
      for (int64_t d = 0; d < D; d++) out[d] += w * part[r * D + d];
    }
  }
}

/* the optional store inputs of a decode step (T = 1) into ``job`` (NULL), or why they do not fit */
static const char *store_inputs(OrtKernelContext *ctx, int int8, Job *job, int64_t B) {
  const size_t at = int8 ? 10 : 8;
  size_t count = 0;
  void *slots, *k_store = (void *)job->k_new, *v_store = (void *)job->v_new;
  int64_t sd[1], kd[4], vd[4];
  const int64_t want[4] = {B, 1, job->Hkv, job->D};
  if (job->T != 1 || failed(API(API_KERNEL_CONTEXT_GET_INPUT_COUNT, InputCountFn)(ctx, &count)) || count <= at)
    return NULL; /* a prefill step's new K/V are stored by the runner, whatever these inputs hold */
  if (input(ctx, at, &slots, sd, 1) || sd[0] != B) return reason("slots must be [B = %lld]", (long long)B);
  if (int8 && (count <= 12 || input(ctx, 11, &k_store, kd, 4) || input(ctx, 12, &v_store, vd, 4) ||
               memcmp(kd, want, sizeof kd) || memcmp(vd, want, sizeof vd)))
    return reason("with slots, the int8 K and V to store must be [%lld, 1, %lld, %lld]", (long long)B,
                  (long long)job->Hkv, (long long)job->D);
  if (job->k_ts != NULL) {
    void *ks, *vs;
    int64_t ksd[3], vsd[3];
    if (count <= 14 || input(ctx, 13, &ks, ksd, 3) || input(ctx, 14, &vs, vsd, 3) || memcmp(ksd, want, sizeof ksd) ||
        memcmp(vsd, want, sizeof vsd))
      return reason("with slots and per-token scale pools, the scales to store must be [%lld, 1, %lld]",
                    (long long)B, (long long)job->Hkv);
    job->ks_store = ks, job->vs_store = vs;
  }
  job->slots = slots, job->k_store = k_store, job->v_store = v_store;
  return NULL;
}

/* NULL when every sequence's lengths and the blocks its table names fit the pools and the table,
 * and its scratch is of a sane size; else why not */
static const char *check_sequences(const Job *j, int64_t B) {
  const int64_t G = j->Hq / j->Hkv;
  for (int64_t b = 0; b < B; b++) {
    const int64_t c = j->ctx_lens[b], n = j->q_lens[b];
    if (n < 0 || n > j->T)
      return reason("query_lens[%lld] = %lld is outside [0, %lld]", (long long)b, (long long)n, (long long)j->T);
    if (c < 0 || c > INT64_MAX / 2 || c / j->BS + (c % j->BS != 0) > j->MB) /* c + n stays in range */
      return reason("context_lens[%lld] = %lld does not fit a block table of %lld blocks of %lld", (long long)b,
                    (long long)c, (long long)j->MB, (long long)j->BS);
    const int64_t sizes[3] = {n > 0 ? n : 1, G, c + n + 1}, *table = j->tables + b * j->MB;
    int64_t scores;
    if (product_over(sizes, 3, ((int64_t)1 << 40) / (int64_t)sizeof(float), &scores))
      return reason("sequence %lld's scores (%lld x %lld queries over %lld keys) are too many", (long long)b,
                    (long long)n, (long long)G, (long long)(c + n));
    for (int64_t m = 0; m * j->BS < c; m++)
      if (table[m] < 0 || table[m] >= j->NB)
        return reason("block_tables[%lld][%lld] = %lld is outside the pool of %lld blocks", (long long)b,
                      (long long)m, (long long)table[m], (long long)j->NB);
  }
  return NULL;
}

/* job->items: every sequence's KV heads and their parts of the past, in that order, and room in
 * job->parts for the outputs and stats of each part of a split past; NULL, or why not */
static const char *plan_items(Job *job, int64_t B) {
  const int64_t G = job->Hq / job->Hkv;
  int64_t count = 0, floats = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t parts = parts_of(job, job->ctx_lens[b]);
    count += job->Hkv * parts;
    if (parts > 1) floats += job->Hkv * parts * job->q_lens[b] * G * (job->D + 2);
  }
  int64_t *items = malloc((size_t)(4 * count + B * job->Hkv + 1) * sizeof(int64_t));
  float *room = floats > 0 ? malloc((size_t)floats * sizeof(float)) : NULL;
  if (items == NULL || (floats > 0 && room == NULL)) {
    free(items), free(room);
    return "out of memory for attention's work items";
  }
  int64_t *firsts = items + 4 * count, i = 0, at = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t parts = parts_of(job, job->ctx_lens[b]), size = job->q_lens[b] * G * (job->D + 2);
    for (int64_t h = 0; h < job->Hkv; h++)
      for (int64_t c = 0; c < parts; c++, i++) {
        if (c == 0) firsts[b * job->Hkv + h] = i;
        int64_t *item = items + 4 * i;
        item[0] = b, item[1] = h, item[2] = c, item[3] = parts > 1 ? at : -1;
        at += parts > 1 ? size : 0;
      }
  }
  job->items = items, job->parts = room, job->count = count;
  return NULL;
}

/* both operators: inputs 0..7 as documented at the top; with int8 pools, 8 and 9 are the K and V
 * scales of each KV head; then the optional store inputs. NULL, or why the inputs do not fit. */
static const char *run(OrtKernelContext *ctx, int int8) {
  void *p[10];
  int64_t qd[4], kd[4], vd[4], pk[4], pv[4], bt[2], cl[1], ql[1], ks[3] = {0}, vs[3] = {0};
  size_t ks_rank = 1, vs_rank = 1;
  if (input(ctx, 0, &p[0], qd, 4) || input(ctx, 1, &p[1], kd, 4) || input(ctx, 2, &p[2], vd, 4) ||
      input(ctx, 3, &p[3], pk, 4) || input(ctx, 4, &p[4], pv, 4) || input(ctx, 5, &p[5], bt, 2) ||
      input(ctx, 6, &p[6], cl, 1) || input(ctx, 7, &p[7], ql, 1) ||
      (int8 && (input_of_rank(ctx, 8, &p[8], ks, 3, &ks_rank) || input_of_rank(ctx, 9, &p[9], vs, 3, &vs_rank) ||
                (ks_rank != 1 && ks_rank != 3) || vs_rank != ks_rank)))
    return "an input is missing or has the wrong rank (q, k, v [B, T, H, D], pools [Hkv, NB, BS, D], "
           "block_tables [B, MB], context_lens and query_lens [B], int8 pools' scales [Hkv] or [Hkv, NB, BS])";
  const int per_token = int8 && ks_rank == 3;
  const int64_t B = qd[0], T = qd[1], Hq = qd[2], D = qd[3], Hkv = pk[0], NB = pk[1], BS = pk[2], MB = bt[1];
  if (Hq < 1 || Hkv < 1 || Hq % Hkv || D < 1 || NB < 1 || BS < 1)
    return reason("%lld query heads, %lld KV heads, head size %lld, %lld blocks of %lld: each must be at least 1, "
                  "and the KV heads divide the query heads", (long long)Hq, (long long)Hkv, (long long)D,
                  (long long)NB, (long long)BS);
  if (kd[0] != B || kd[1] != T || kd[2] != Hkv || kd[3] != D || memcmp(vd, kd, sizeof kd) ||
      memcmp(pv, pk, sizeof pk) || pk[3] != D || bt[0] != B || cl[0] != B || ql[0] != B ||
      (int8 && (ks[0] != Hkv || vs[0] != Hkv)) ||
      (per_token && (ks[1] != NB || ks[2] != BS || vs[1] != NB || vs[2] != BS)))
    return reason("shapes do not fit q [%lld, %lld, %lld, %lld] and pools [%lld, %lld, %lld, %lld]", (long long)B,
                  (long long)T, (long long)Hq, (long long)D, (long long)Hkv, (long long)NB, (long long)BS,
                  (long long)D);
  Job job = {.q = p[0], .k_new = p[1], .v_new = p[2], .pool_k = p[3], .pool_v = p[4], .tables = p[5],
             .ctx_lens = p[6], .q_lens = p[7], .T = T, .Hq = Hq, .Hkv = Hkv, .D = D, .NB = NB, .BS = BS, .MB = MB,
             .k_scales = int8 && !per_token ? p[8] : NULL, .v_scales = int8 && !per_token ? p[9] : NULL,
             .k_ts = per_token ? p[8] : NULL, .v_ts = per_token ? p[9] : NULL};
  const char *why = check_sequences(&job, B);
  if (why == NULL) why = store_inputs(ctx, int8, &job, B);
  if (why != NULL) return why;
  int64_t out_dims[3] = {B, T, Hq * D};
  OrtValue *out_value = NULL;
  if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, 0, out_dims, 3, &out_value)) ||
      failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(out_value, (void **)&job.out)))
    return "could not allocate the output";
  if (B * T > 0) memset(job.out, 0, (size_t)(B * T * Hq * D) * sizeof(float)); /* an empty output has no data */
  job.part = PART_POSITIONS / BS > 0 ? PART_POSITIONS / BS * BS : BS;
  if ((why = plan_items(&job, B)) != NULL) return why;
  parallel_for(ctx, run_item, (size_t)job.count, 2, &job);
  if (!job.failed && job.parts != NULL) parallel_for(ctx, merge_parts, (size_t)(B * Hkv), 2, &job);
  free((void *)job.items), free(job.parts);
  return job.failed ? "out of memory for attention scores" : NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) { (void)kernel; return op_status("PagedAttention", run(ctx, 0)); }
static OrtStatus *compute_int8(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  return op_status("PagedAttentionInt8KV", run(ctx, 1));
}

static const char *op_name(const CustomOp *op) { (void)op; return "PagedAttention"; }
static const char *op_name_int8(const CustomOp *op) { (void)op; return "PagedAttentionInt8KV"; }
static int input_type(const CustomOp *op, size_t i) { (void)op; return i >= 5 ? ELEM_INT64 : ELEM_FLOAT; }
static size_t input_count(const CustomOp *op) { (void)op; return 9; }
static int optional_store(const CustomOp *op, size_t i) { (void)op; return i >= 8 ? OPTIONAL : 0; }
static int input_type_int8(const CustomOp *op, size_t i) {
  (void)op;
  return i == 3 || i == 4 || i == 11 || i == 12 ? ELEM_INT8 : (i >= 5 && i <= 7) || i == 10 ? ELEM_INT64 : ELEM_FLOAT;
}
static size_t input_count_int8(const CustomOp *op) { (void)op; return 15; }
static int optional_store_int8(const CustomOp *op, size_t i) { (void)op; return i >= 10 ? OPTIONAL : 0; }

const CustomOp paged_attention = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name, input_type, input_count,
                                           float_output, one_output, optional_store, compute);
const CustomOp paged_attention_int8 = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name_int8, input_type_int8,
                                                input_count_int8, float_output, one_output, optional_store_int8,
                                                compute_int8);
