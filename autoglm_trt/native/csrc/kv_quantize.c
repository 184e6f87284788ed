/* QuantizeKVRows: an INT8 KV cache's per-token quantization (graph/kv_int8.py) in one operator.
 *
 * The graph quantizes each new K or V row (one token, one KV head) with seven nodes: Abs,
 * ReduceMax, Max with a floor, Div by 127, Div, QuantizeLinear, Squeeze. In a decode step of
 * SmolLM2 those are 420 nodes of a few hundred bytes each (a static per-head cache has one
 * QuantizeLinear per tensor, 60). This operator does the same arithmetic, element for element,
 * in one pass per row, so that it gives the graph's bits.
 *
 * Input:
 *   0 x      float32 [..., D]
 * Outputs:
 *   0 q      int8 [..., D]     saturate(round_half_even(x / scale)) to [-128, 127]
 *   1 scale  float32 [...]     max(max |x|, 1e-6) / 127, in float32
 */
#include <math.h>

#include "ort_api.h"
#include "parallel.h"

#define MAX_DIMS 8
#define AMAX_FLOOR 1e-6f /* graph/kv_int8.py: AMAX_FLOOR */

typedef struct {
  const float *x;
  int8_t *q;
  float *scale;
  int64_t d;
} Rows;

/* row i: its scale, then its values divided by it, rounded half to even and saturated */
static void quantize_row(void *data, size_t i) {
  const Rows *r = data;
  const float *x = r->x + (int64_t)i * r->d;
  int8_t *q = r->q + (int64_t)i * r->d;
  float top = 0.0f;
  for (int64_t k = 0; k < r->d; k++) top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
  const float s = (top > AMAX_FLOOR ? top : AMAX_FLOOR) / 127.0f;
  r->scale[i] = s;
  for (int64_t k = 0; k < r->d; k++) {
    const float v = nearbyintf(x[k] / s);
    q[k] = (int8_t)(v >= 127.0f ? 127 : v <= -128.0f ? -128 : v == v ? (int)v : 0);
  }
}

static const char *run(OrtKernelContext *ctx) {
  size_t rank = 0;
  int64_t dims[MAX_DIMS];
  void *x;
  if (input_of_rank(ctx, 0, &x, dims, MAX_DIMS, &rank) || rank < 1)
    return "the input is missing or has more than 8 dimensions (x [..., D])";
  if (dims[rank - 1] < 1) /* else its rows could be 2^40 scales of nothing */
    return reason("rows of %lld elements: a K or V row has at least one", (long long)dims[rank - 1]);
  int64_t rows = 1; /* an empty input has none; else no more than its elements, which exist */
  for (size_t i = 0; i + 1 < rank; i++) rows = dims[i] == 0 ? 0 : rows;
  for (size_t i = 0; rows != 0 && i + 1 < rank; i++) rows *= dims[i];
  OrtValue *q_value = NULL, *s_value = NULL;
  int8_t *q = NULL;
  float *scale = NULL;
  if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, 0, dims, rank, &q_value)) ||
      failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(q_value, (void **)&q)) ||
      failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, 1, dims, rank - 1, &s_value)) ||
      failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(s_value, (void **)&scale)))
    return "could not allocate the outputs";
  if (rows == 0) return NULL;
  Rows job = {x, q, scale, dims[rank - 1]};
  parallel_for(ctx, quantize_row, (size_t)rows, 64, &job);
  return NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) { (void)kernel; return op_status("QuantizeKVRows", run(ctx)); }
static const char *op_name(const CustomOp *op) { (void)op; return "QuantizeKVRows"; }
static int input_type(const CustomOp *op, size_t i) { (void)op, (void)i; return ELEM_FLOAT; }
static size_t input_count(const CustomOp *op) { (void)op; return 1; }
static int output_type(const CustomOp *op, size_t i) { (void)op; return i == 0 ? ELEM_INT8 : ELEM_FLOAT; }
static size_t output_count(const CustomOp *op) { (void)op; return 2; }

const CustomOp quantize_kv_rows = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name, input_type, input_count,
                                            output_type, output_count, required, compute);
