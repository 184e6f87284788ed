/* HadamardQuantize: an INT8 linear's input rotation and quantization in one operator.
 *
 * The engine graph rotates the input of each INT8 linear by a block Hadamard matrix and then
 * quantizes it (graph/quant.py): Reshape to blocks of b, MatMul by the normalized Sylvester
 * matrix H (b x b), QuantizeLinear, Reshape back: four nodes, and a b x b GEMM per block.
 * This operator does the same with a fast Walsh-Hadamard transform (b log2 b additions per
 * block instead of b * b multiply-adds) and writes the quantized bytes directly.
 *
 * Inputs:
 *   0 x           float32 [..., n]   n a multiple of b
 *   1 hadamard    float32 [b, b]     the graph's H; only its size is read (H is Sylvester's,
 *                                    normalized by 1/sqrt(b): graph/hadamard.py)
 *   2 scale       float32 scalar     QuantizeLinear's
 *   3 zero_point  uint8 scalar
 * Output:
 *   0 y           uint8 [..., n]     saturate(round_half_even((x R) / scale) + zero_point)
 */
#include <math.h>
#include <string.h>

#include "ort_api.h"
#include "parallel.h"
#include "rotate.h"

#define MAX_DIMS 8

typedef struct {
  const float *x;
  uint8_t *y;
  int64_t n, b;
  float factor; /* 1 / (sqrt(b) * scale) */
  float zero;
} Rows;

/* row i: every block rotated, then quantized */
static void rotate_row(void *data, size_t i) {
  const Rows *r = data;
  rotate_quantize(r->x + (int64_t)i * r->n, r->y + (int64_t)i * r->n, r->n, r->b, r->factor, r->zero);
}

static const char *run(OrtKernelContext *ctx) {
  size_t rank = 0;
  int64_t dims[MAX_DIMS], hd[2], none[1];
  void *x, *h, *scale, *zero;
  if (input_of_rank(ctx, 0, &x, dims, MAX_DIMS, &rank) || rank < 1 || input(ctx, 1, &h, hd, 2) ||
      input(ctx, 2, &scale, none, 0) || input(ctx, 3, &zero, none, 0))
    return "an input is missing or has the wrong rank (x [..., n], hadamard [b, b], scalar scale and zero)";
  const int64_t n = dims[rank - 1], b = hd[0];
  const float s = *(const float *)scale;
  if (n < 1 || !valid_block(b, n) || hd[1] != b) /* rows of nothing could be 2^40 rows */
    return reason("a Hadamard block of %lld x %lld for rows of %lld: it must be square, a power of two up to %d "
                  "and divide the rows", (long long)hd[0], (long long)hd[1], (long long)n, MAX_BLOCK);
  if (!(s > 0.0f)) return "the scale must be positive";
  OrtValue *out_value = NULL;
  uint8_t *y = NULL;
  if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, 0, dims, rank, &out_value)) ||
      failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(out_value, (void **)&y)))
    return "could not allocate the output";
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
  Rows job = {x, y, n, b, 1.0f / (sqrtf((float)b) * s), (float)*(const uint8_t *)zero};
  parallel_for(ctx, rotate_row, (size_t)rows, 16, &job);
  return NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) { (void)kernel; return op_status("HadamardQuantize", run(ctx)); }
static const char *op_name(const CustomOp *op) { (void)op; return "HadamardQuantize"; }
static int input_type(const CustomOp *op, size_t i) { (void)op; return i == 3 ? ELEM_UINT8 : ELEM_FLOAT; }
static size_t input_count(const CustomOp *op) { (void)op; return 4; }
static int uint8_output(const CustomOp *op, size_t i) { (void)op, (void)i; return ELEM_UINT8; }

const CustomOp hadamard_quantize = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name, input_type, input_count,
                                             uint8_output, one_output, required, compute);
