/* The library's entry point, and the callbacks its operators share. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "amx.h"
#include "ort_api.h"

const void *const *api;

OrtStatus *op_status(const char *op, const char *why) {
  if (why == NULL) return NULL;
  char message[320];
  snprintf(message, sizeof message, "%s: %s", op, why);
  return API(API_CREATE_STATUS, CreateStatusFn)(ORT_INVALID_ARGUMENT, message);
}

const char *reason(const char *format, ...) {
  static _Thread_local char text[256];
  va_list args;
  va_start(args, format);
  vsnprintf(text, sizeof text, format, args);
  va_end(args);
  return text;
}

int default_memory(const CustomOp *op, size_t index) { (void)op, (void)index; return 0; }
int no_variadic(const CustomOp *op) { (void)op; return 0; }

void *stateless_kernel(const CustomOp *op, const void *ort_api, const OrtKernelInfo *info) {
  (void)op, (void)ort_api, (void)info;
  return (void *)1; /* the operators keep no state: any non-null kernel */
}
/* the inputs past the first that are constant initializers; where memory runs out, a kernel that
 * knows none, whose inputs are all read on every run */
static const Constants none;
void *constants_kernel(const CustomOp *op, const void *ort_api, const OrtKernelInfo *info) {
  (void)ort_api;
  Constants *c = calloc(1, sizeof *c);
  if (c == NULL) return (void *)&none;
  const size_t count = op->GetInputTypeCount(op);
  for (size_t i = 1; i < count && i < MAX_CONSTANTS; i++) {
    int constant = 0;
    const OrtValue *value = NULL;
    OrtTensorTypeAndShapeInfo *shape = NULL;
    if (failed(API(API_KERNEL_INFO_GET_CONSTANT_INPUT, ConstantInputFn)(info, i, &constant, &value)) || !constant ||
        value == NULL || failed(API(API_GET_TENSOR_TYPE_AND_SHAPE, TypeAndShapeFn)(value, &shape)))
      continue;
    c->known[i] = !failed(API(API_GET_DIMENSIONS_COUNT, DimsCountFn)(shape, &c->rank[i])) && c->rank[i] <= 4 &&
                  !failed(API(API_GET_DIMENSIONS, DimsFn)(shape, c->dims[i], c->rank[i])) &&
                  !failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)((OrtValue *)value, &c->data[i]));
    API(API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseInfoFn)(shape);
  }
  return c;
}
void release_constants(void *kernel) {
  if (kernel != &none) free(kernel);
}
const char *cpu_provider(const CustomOp *op) { (void)op; return "CPUExecutionProvider"; }
void destroy_kernel(void *kernel) { (void)kernel; }
int required(const CustomOp *op, size_t i) { (void)op, (void)i; return 0; /* every input and output */ }
size_t one_output(const CustomOp *op) { (void)op; return 1; }
int float_output(const CustomOp *op, size_t i) { (void)op, (void)i; return ELEM_FLOAT; }

/* the entry point ``SessionOptions.register_custom_ops_library`` calls */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                  const ApiBase *base) {
  static OrtCustomOpDomain *domain; /* ONNX Runtime keeps using the domain: it is never freed */
  api = base->GetApi(18); /* KernelContext_ParallelFor and KernelInfoGetConstantInput_tensor are in it */
  if (api == NULL) {
    const void *const *oldest = base->GetApi(1);
    return ((CreateStatusFn)oldest[API_CREATE_STATUS])(ORT_FAIL, "autoglm-trt's native library needs ONNX Runtime "
                                                                 "1.18 or later; upgrade onnxruntime");
  }
  static const CustomOp *const ops[] = {
#define OPERATOR(var) &var,
#include "operators.h"
#undef OPERATOR
  };
  if (domain == NULL) {
    OrtStatus *status = API(API_CREATE_CUSTOM_OP_DOMAIN, CreateDomainFn)("autoglm.trt", &domain);
    for (size_t i = 0; status == NULL && i < sizeof ops / sizeof ops[0]; i++)
      status = API(API_CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, ops[i]);
    if (status != NULL) return status;
  }
  return API(API_ADD_CUSTOM_OP_DOMAIN, AddDomainFn)(options, domain);
}

/* which instructions the INT8 GEMM was built for ("avx512-vnni", "avx2" or "portable C"), for doctor */
__attribute__((visibility("default"))) const char *AutoglmInt8Kernel(void) { return int8_linear_kernel; }

/* 1 where Int8Linear runs its batches of 16 rows and more on AMX (amx.c) */
__attribute__((visibility("default"))) int AutoglmInt8Amx(void) { return amx_ready(); }

/* 1 where PrefillAttentionBf16 takes its bfloat16 path on AMX (prefill_attention.c) */
__attribute__((visibility("default"))) int AutoglmAttentionBf16(void) { return amx_bf16_ready(); }

/* 1 where ImageAttentionBf16 runs (image_attention.c), else 0 */
__attribute__((visibility("default"))) int AutoglmImageAttentionBf16(void) { return image_attention_ready(); }

/* which instructions Int4WeightLinear's and Int8BlockLinear's dot products use ("avx2" or "portable C") */
__attribute__((visibility("default"))) const char *AutoglmBlockKernel(void) { return block_linear_kernel; }

/* which instructions FloatLinear's multiply-adds use ("avx512", "avx2-fma" or "portable C") */
__attribute__((visibility("default"))) const char *AutoglmFloatKernel(void) { return float_linear_kernel; }

/* 1 where MaskedSoftmax computes ONNX Runtime's Softmax bit for bit (built for AVX-512F), else 0 */
__attribute__((visibility("default"))) int AutoglmSoftmaxExact(void) { return masked_softmax_exact; }
