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
 *   3 index  int32 [E, 2]              R's nonzero entries (row, column), row by row
 *   4 value  float32 [E]               and their values (rope_op.turn_entries: R is the
 *                                      head_dim x head_dim matrix above, a constant, so its
 *                                      entries are listed once, when the engine loads)
 *   5 heads  int64 [2]                 Hq, Hkv; D is the qkv width over Hq + 2 Hkv
 * Outputs:
 *   0 q      float32 [B, T, Hq, D]
 *   1 k      float32 [B, T, Hkv, D]
 *   2 v      float32 [B, T, Hkv, D]
 * Shapes that do not fit together (the rewrite never makes them) fail the run with the reason.
 */
#include <string.h>

#include "ort_api.h"
#include "parallel.h"

#define MAX_HEAD 1024

typedef struct {
  const float *qkv, *cos, *sin;
  const int32_t *index; /* R's nonzero entries, row by row: (row, column) */
  const float *value;
  int64_t count;
  float *q, *k, *v;
  int64_t hq, hkv, d;
  /* where each column of R has one entry (every family's rope: 1 or -1), its row and value */
  int single;
  int32_t *row;
  float *sign;
} Job;

/* x @ R for one head, over R's nonzero entries in the order a row-by-row product adds them
 * (the zero entries add zeros, which change no sum). With one entry a column, each output is
 * that one product added to zero, read straight from the entry's row: the same value (0 + p, so
 * a product of -0 gives +0 as before) without the pass over the entries that stores each sum
 * and reads it back, which measured faster on SmolLM2's heads in prefill and decode steps */
static void turn(const Job *j, const float *x, float *out) {
  if (j->single) {
#pragma omp simd
    for (int64_t e = 0; e < j->d; e++) out[e] = 0.0f + x[j->row[e]] * j->sign[e];
    return;
  }
  memset(out, 0, (size_t)j->d * sizeof(float));
  for (int64_t e = 0; e < j->count; e++) out[j->index[2 * e + 1]] += x[j->index[2 * e]] * j->value[e];
}

/* fill ``row`` and ``sign`` and set ``single`` where each of R's d columns has exactly one entry */
static void single_entries(Job *j) {
  int32_t seen[MAX_HEAD];
  memset(seen, 0, (size_t)j->d * sizeof seen[0]);
  j->single = j->count == j->d;
  for (int64_t e = 0; e < j->count && j->single; e++) {
    const int32_t col = j->index[2 * e + 1];
    j->single = !seen[col]++;
    j->row[col] = j->index[2 * e];
    j->sign[col] = j->value[e];
  }
}

static void token(void *data, size_t at) {
  const Job *j = data;
  const int64_t d = j->d, width = (j->hq + 2 * j->hkv) * d;
  const float *x = j->qkv + (int64_t)at * width, *cos = j->cos + (int64_t)at * d, *sin = j->sin + (int64_t)at * d;
  float turned[MAX_HEAD];
  for (int64_t h = 0; h < j->hq + j->hkv; h++) {
    const float *xh = x + h * d;
    float *out = h < j->hq ? j->q + ((int64_t)at * j->hq + h) * d : j->k + ((int64_t)at * j->hkv + h - j->hq) * d;
    turn(j, xh, turned);
#pragma omp simd
    for (int64_t e = 0; e < d; e++) out[e] = xh[e] * cos[e] + turned[e] * sin[e];
  }
  memcpy(j->v + (int64_t)at * j->hkv * d, x + (j->hq + j->hkv) * d, (size_t)(j->hkv * d) * sizeof(float));
}

static const char *run(OrtKernelContext *ctx, const Constants *constants) {
  int64_t xd[3], cd[4], sd[4], id[2], vd[1], hd[1];
  void *qkv, *cos, *sin, *index, *value, *heads;
  if (input(ctx, 0, &qkv, xd, 3) || input(ctx, 1, &cos, cd, 4) || input(ctx, 2, &sin, sd, 4) ||
      fixed_input(ctx, constants, 3, &index, id, 2) || fixed_input(ctx, constants, 4, &value, vd, 1) ||
      fixed_input(ctx, constants, 5, &heads, hd, 1) || hd[0] != 2)
    return "an input is missing or has the wrong rank (qkv [B, T, W], cos and sin [B, T, 1, D], index [E, 2], "
           "value [E], heads [2])";
  const int64_t hq = ((const int64_t *)heads)[0], hkv = ((const int64_t *)heads)[1];
  if (hq < 1 || hkv < 1 || hq > xd[2] || hkv > (xd[2] - hq) / 2 || xd[2] % (hq + 2 * hkv))
    return reason("heads (%lld, %lld) do not divide a qkv width of %lld", (long long)hq, (long long)hkv,
                  (long long)xd[2]);
  const int64_t d = xd[2] / (hq + 2 * hkv), tokens = xd[0] * xd[1];
  if (d > MAX_HEAD) return reason("a head of %lld is over the %d this operator takes", (long long)d, MAX_HEAD);
  if (id[1] != 2 || vd[0] != id[0]) return "index must be [E, 2] and value [E]";
  for (int64_t e = 0; e < id[0]; e++) /* an entry outside the head would write past it */
    for (int c = 0; c < 2; c++)
      if (((const int32_t *)index)[2 * e + c] < 0 || ((const int32_t *)index)[2 * e + c] >= d)
        return reason("index[%lld] is outside a head of %lld", (long long)e, (long long)d);
  for (int i = 0; i < 4; i++) {
    const int64_t want = i == 0 ? xd[0] : i == 1 ? xd[1] : i == 2 ? 1 : d;
    if (cd[i] != want || sd[i] != want)
      return reason("cos and sin must be [%lld, %lld, 1, %lld]", (long long)xd[0], (long long)xd[1], (long long)d);
  }
  float *out[3];
  const int64_t counts[3] = {hq, hkv, hkv};
  for (size_t i = 0; i < 3; i++) {
    const int64_t dims[4] = {xd[0], xd[1], counts[i], d};
    OrtValue *out_value = NULL;
    if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, i, dims, 4, &out_value)) ||
        failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(out_value, (void **)&out[i])))
      return "could not allocate the outputs";
  }
  int32_t row[MAX_HEAD];
  float sign[MAX_HEAD];
  Job job = {qkv, cos, sin, index, value, id[0], out[0], out[1], out[2], hq, hkv, d, 0, row, sign};
  single_entries(&job);
  parallel_for(ctx, token, (size_t)tokens, 16, &job);
  return NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) { return op_status("RopeQKV", run(ctx, kernel)); }
static const char *op_name(const CustomOp *op) { (void)op; return "RopeQKV"; }
static int input_type(const CustomOp *op, size_t i) {
  (void)op;
  return i == 3 ? ELEM_INT32 : i == 5 ? ELEM_INT64 : ELEM_FLOAT;
}
static size_t input_count(const CustomOp *op) { (void)op; return 6; }
static size_t three_outputs(const CustomOp *op) { (void)op; return 3; }

const CustomOp rope_qkv = CUSTOM_OP(constants_kernel, release_constants, op_name, input_type, input_count,
                                    float_output, three_outputs, required, compute);
