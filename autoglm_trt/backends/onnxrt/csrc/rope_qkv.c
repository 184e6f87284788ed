/* RopeQKV: a layer's fused QKV projection split into heads, with rotary position embedding on
 * the query and key heads, in one operator.
 *
 * The engine graph does it in eight nodes (graph/decoder.py ``layer``): Split of qkv into the
 * query+key part and the value part, Reshape to heads, x * cos + (x @ R) * sin (Mul, MatMul,
 * Mul, Add; R the head_dim x head_dim "rotate half" matrix), Split into queries and keys,
 * Reshape of the values. This operator computes the same products and sums, each rounded
 * as the graph's nodes round them (the file is compiled without floating-point contraction:
 * -std=c11), so its outputs equal the graph's.
 *
 * Inputs:
 *   0 qkv    float32 [B, T, (Hq + 2 Hkv) D]
 *   1 cos    float32 [B, T, 1, D]      the rope tables gathered at each token's position
 *   2 sin    float32 [B, T, 1, D]
 *   3 rotate float32 [D, D]            R
 *   4 heads  int64 [2]                 Hq, Hkv
 * Outputs:
 *   0 q      float32 [B, T, Hq, D]
 *   1 k      float32 [B, T, Hkv, D]
 *   2 v      float32 [B, T, Hkv, D]
 * Shapes that do not fit together (the rewrite never makes them) give zeros.
 */
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"

#define MAX_HEAD 1024

typedef struct {
  int32_t from, to; /* R[from, to] */
  float value;
} Entry;

typedef struct {
  const float *qkv, *cos, *sin;
  const Entry *entries; /* R's nonzero entries, row by row */
  int64_t count;
  float *q, *k, *v;
  int64_t hq, hkv, d;
} Job;

/* x @ R for one head, over R's nonzero entries in the order a row-by-row product adds them
 * (the zero entries add zeros, which change no sum): for every family's rope each column of R
 * has one entry, 1 or -1, so every sum is exact */
static void turn(const float *x, const Entry *entries, int64_t count, int64_t d, float *out) {
  memset(out, 0, (size_t)d * sizeof(float));
  for (int64_t e = 0; e < count; e++) out[entries[e].to] += x[entries[e].from] * entries[e].value;
}

static void token(void *data, size_t at) {
  const Job *j = data;
  const int64_t d = j->d, width = (j->hq + 2 * j->hkv) * d;
  const float *x = j->qkv + (int64_t)at * width, *cos = j->cos + (int64_t)at * d, *sin = j->sin + (int64_t)at * d;
  float turned[MAX_HEAD];
  for (int64_t h = 0; h < j->hq + j->hkv; h++) {
    const float *xh = x + h * d;
    float *out = h < j->hq ? j->q + ((int64_t)at * j->hq + h) * d : j->k + ((int64_t)at * j->hkv + h - j->hq) * d;
    turn(xh, j->entries, j->count, d, turned);
#pragma omp simd
    for (int64_t e = 0; e < d; e++) out[e] = xh[e] * cos[e] + turned[e] * sin[e];
  }
  memcpy(j->v + (int64_t)at * j->hkv * d, x + (j->hq + j->hkv) * d, (size_t)(j->hkv * d) * sizeof(float));
}

static void compute(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  int64_t xd[3], cd[4], sd[4], rd[2], hd[1];
  void *qkv, *cos, *sin, *rotate, *heads;
  if (input(ctx, 0, &qkv, xd, 3) || input(ctx, 1, &cos, cd, 4) || input(ctx, 2, &sin, sd, 4) ||
      input(ctx, 3, &rotate, rd, 2) || input(ctx, 4, &heads, hd, 1) || hd[0] != 2)
    return;
  const int64_t hq = ((const int64_t *)heads)[0], hkv = ((const int64_t *)heads)[1], d = rd[0];
  const int64_t tokens = xd[0] * xd[1];
  float *out[3];
  const int64_t counts[3] = {hq, hkv, hkv};
  for (size_t i = 0; i < 3; i++) {
    const int64_t dims[4] = {xd[0], xd[1], counts[i] > 0 ? counts[i] : 0, d > 0 ? d : 0};
    OrtValue *value = NULL;
    if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, i, dims, 4, &value)) ||
        failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(value, (void **)&out[i])))
      return;
  }
  int fits = d >= 1 && d <= MAX_HEAD && rd[1] == d && hq >= 1 && hkv >= 1 && xd[2] == (hq + 2 * hkv) * d;
  for (int i = 0; i < 4 && fits; i++) {
    const int64_t want = i == 0 ? xd[0] : i == 1 ? xd[1] : i == 2 ? 1 : d;
    fits = cd[i] == want && sd[i] == want;
  }
  if (!fits) {
    for (size_t i = 0; i < 3; i++)
      if (counts[i] > 0 && d > 0) memset(out[i], 0, (size_t)(tokens * counts[i] * d) * sizeof(float));
    return;
  }
  Entry *entries = malloc((size_t)(d * d) * sizeof(Entry));
  if (entries == NULL) return;
  int64_t count = 0;
  const float *r = rotate;
  for (int64_t i = 0; i < d; i++)
    for (int64_t c = 0; c < d; c++)
      if (r[i * d + c] != 0.0f) entries[count++] = (Entry){(int32_t)i, (int32_t)c, r[i * d + c]};
  Job job = {qkv, cos, sin, entries, count, out[0], out[1], out[2], hq, hkv, d};
  if (!has_parallel_for || tokens < 16 ||
      failed(API(API_KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(ctx, token, (size_t)tokens, 0, &job)))
    for (int64_t t = 0; t < tokens; t++) token(&job, (size_t)t);
  free(entries);
}

static const char *op_name(const CustomOp *op) { (void)op; return "RopeQKV"; }
static int input_type(const CustomOp *op, size_t i) { (void)op; return i == 4 ? ELEM_INT64 : ELEM_FLOAT; }
static size_t input_count(const CustomOp *op) { (void)op; return 5; }
static size_t three_outputs(const CustomOp *op) { (void)op; return 3; }

const CustomOp rope_qkv = {8,            stateless_kernel, op_name, cpu_provider, input_type, input_count,
                           float_output, three_outputs,    compute, destroy_kernel, required, required};
