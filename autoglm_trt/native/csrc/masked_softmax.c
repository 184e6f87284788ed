/* MaskedSoftmax: a prefill's attention probabilities from its two blocks of scores, in one pass.
 *
 * The engine graph joins a layer's scores over the past and over the new tokens along the keys
 * (Concat), adds the mask bias (Add), takes the Softmax over the keys and slices the result back
 * into its past and new parts (two Slices): five passes over a [T, P + T] tensor per query row
 * group. This operator reads the two blocks and the bias once and writes the two parts once, and
 * computes each row's softmax as ONNX Runtime's does on a CPU with AVX-512F (MLAS): the row's
 * maximum; exp(x - max) by MLAS's AVX-512F kernel (clamp to -103.97, range reduction by ln 2 in
 * two parts, a degree-6 polynomial by fused multiply-adds, vscalefps), each 16 of them added to
 * one 16-lane sum in order (a last partial vector masked), the lanes reduced as its kernel does
 * (upper 8 + lower 8, two horizontal adds, the two halves); then each exp times 1 / sum. So the
 * outputs equal the graph's bit for bit (``tests/test_masked_softmax.py`` checks it against
 * ONNX Runtime's own nodes); the rewrite (``passes/prefill_scores.py``) uses it only where the library
 * is built for AVX-512F, as MLAS then is. Other builds fail the run (the rewrite never uses them).
 *
 * Inputs:
 *   0 past   float32 [H, B, G, T, P]       scores over the past keys
 *   1 new    float32 [H, B, G, T, N]       scores over the new keys
 *   2 bias   float32 [1, B, 1, T, P + N]   0 where a query may attend, a large negative elsewhere
 * Outputs:
 *   0 probs_past  float32 [H, B, G, T, P]
 *   1 probs_new   float32 [H, B, G, T, N]
 */
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "parallel.h"
#include "vec.h"

#define ROWS_PER_ITEM 32 /* rows one parallel work item takes */

typedef struct {
  const float *past, *fresh, *bias;
  float *out_past, *out_new;
  int64_t rows, b_count, t_count, p, n; /* rows = H * B * G * T */
  int64_t group;                        /* G * T: rows of one (head, batch) pair */
  int failed;                           /* a work item found no memory for its row */
} Job;

#if defined(__AVX512F__)
const int masked_softmax_exact = 1;

/* rows [ROWS_PER_ITEM * item, ...) */
static void rows_item(void *data, size_t item) {
  const Job *j = data;
  const int64_t width = j->p + j->n, first = (int64_t)item * ROWS_PER_ITEM;
  const int64_t last = first + ROWS_PER_ITEM < j->rows ? first + ROWS_PER_ITEM : j->rows;
  float *row = thread_scratch((size_t)width * sizeof(float));
  if (row == NULL) { /* the run fails */
    __atomic_store_n(&((Job *)data)->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  for (int64_t r = first; r < last; r++) {
    const int64_t b = r / j->group % j->b_count, t = r % j->t_count; /* r = ((h B + b) G + g) T + t */
    const float *bias = j->bias + (b * j->t_count + t) * width;
    for (int64_t i = 0; i < j->p; i++) row[i] = j->past[r * j->p + i] + bias[i];
    for (int64_t i = 0; i < j->n; i++) row[j->p + i] = j->fresh[r * j->n + i] + bias[j->p + i];
    mlas_softmax(row, width);
    if (j->p) memcpy(j->out_past + r * j->p, row, (size_t)j->p * sizeof(float)); /* an empty output has no data */
    if (j->n) memcpy(j->out_new + r * j->n, row + j->p, (size_t)j->n * sizeof(float));
  }
}
#else
const int masked_softmax_exact = 0;
static void rows_item(void *data, size_t item) { (void)data, (void)item; }
#endif

static const char *run(OrtKernelContext *ctx) {
  int64_t pd[5], nd[5], bd[5];
  void *past, *fresh, *bias;
  if (input(ctx, 0, &past, pd, 5) || input(ctx, 1, &fresh, nd, 5) || input(ctx, 2, &bias, bd, 5))
    return "an input is missing or not of rank 5 (past, new and bias scores)";
  if (!masked_softmax_exact) return "this build of the native library has no MaskedSoftmax (it needs AVX-512F)";
  if (memcmp(pd, nd, 4 * sizeof(int64_t)) || bd[0] != 1 || bd[1] != pd[1] || bd[2] != 1 || bd[3] != pd[3] ||
      bd[4] != pd[4] + nd[4] || pd[4] + nd[4] < 1)
    return reason("scores [%lld, %lld, %lld, %lld, %lld] and [.., %lld] do not fit a bias of [%lld, %lld, %lld, %lld, "
                  "%lld]", (long long)pd[0], (long long)pd[1], (long long)pd[2], (long long)pd[3], (long long)pd[4],
                  (long long)nd[4], (long long)bd[0], (long long)bd[1], (long long)bd[2], (long long)bd[3],
                  (long long)bd[4]);
  float *out[2];
  for (int o = 0; o < 2; o++) {
    OrtValue *value = NULL;
    if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, (size_t)o, o ? nd : pd, 5, &value)) ||
        failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(value, (void **)&out[o])))
      return "could not allocate the outputs";
  }
  const int64_t rows = pd[0] * pd[1] * pd[2] * pd[3];
  if (rows == 0) return NULL;
  Job job = {past, fresh, bias, out[0], out[1], rows, pd[1], pd[3], pd[4], nd[4], pd[2] * pd[3], 0};
  const size_t items = (size_t)((rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM);
  parallel_for(ctx, rows_item, items, 2, &job);
  return job.failed ? "out of memory for a row of scores" : NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) { (void)kernel; return op_status("MaskedSoftmax", run(ctx)); }
static const char *op_name(const CustomOp *op) { (void)op; return "MaskedSoftmax"; }
static int input_type(const CustomOp *op, size_t i) { (void)op, (void)i; return ELEM_FLOAT; }
static size_t three_inputs(const CustomOp *op) { (void)op; return 3; }
static size_t two_outputs(const CustomOp *op) { (void)op; return 2; }

const CustomOp masked_softmax = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name, input_type, three_inputs,
                                          float_output, two_outputs, required, compute);
