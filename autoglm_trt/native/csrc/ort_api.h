/* The part of ONNX Runtime's C API these operators use, declared here, and helpers they share.
 *
 * No ONNX Runtime C headers can be installed on the machines this project targets (they are in
 * neither the PyPI wheels nor Debian 12), so the library declares the little it needs: the
 * positions of the functions it calls in the ``OrtApi`` table (those of ONNX Runtime's
 * ``onnxruntime_c_api.h``; the table only ever grows at its end, so a position never changes),
 * and version 16 of the custom operator struct (ONNX Runtime 1.16 and later), the first whose
 * compute function returns a status: an operator given inputs it cannot read safely (a crafted
 * engine directory's graph, say) fails the run with a one-line reason instead of computing.
 * The library is built at install time (``setup.py``), one build per instruction set.
 */
#ifndef AUTOGLM_ORT_API_H
#define AUTOGLM_ORT_API_H

#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

enum { OPTIONAL = 1 }; /* OrtCustomOpInputOutputCharacteristic: an input that may be absent */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 }; /* OrtErrorCode */
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT8 = 3, ELEM_INT32 = 6, ELEM_INT64 = 7, ELEM_FLOAT16 = 10 }; /* ONNXTensorElementDataType */

/* positions in ONNX Runtime's OrtApi function table */
enum {
  API_CREATE_STATUS = 0,
  API_CREATE_CUSTOM_OP_DOMAIN = 26,
  API_CUSTOM_OP_DOMAIN_ADD = 27,
  API_ADD_CUSTOM_OP_DOMAIN = 28,
  API_GET_TENSOR_MUTABLE_DATA = 51,
  API_GET_DIMENSIONS_COUNT = 61,
  API_GET_DIMENSIONS = 62,
  API_GET_TENSOR_TYPE_AND_SHAPE = 65,
  API_KERNEL_CONTEXT_GET_INPUT_COUNT = 88,
  API_KERNEL_CONTEXT_GET_INPUT = 90,
  API_KERNEL_CONTEXT_GET_OUTPUT = 91,
  API_RELEASE_STATUS = 93,
  API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
  API_KERNEL_INFO_GET_CONSTANT_INPUT = 249, /* from version 15 of the table */
  API_KERNEL_CONTEXT_PARALLEL_FOR = 274,    /* from version 18 */
};

typedef struct {
  const void *const *(*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} ApiBase;

/* version 16 of OrtCustomOp: ONNX Runtime reads no field past KernelComputeV2 for it, and calls
 * KernelComputeV2 (KernelCompute stays NULL) and CreateKernel (CreateKernelV2 stays NULL) */
typedef struct CustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct CustomOp *op, const void *api, const OrtKernelInfo *info);
  const char *(*GetName)(const struct CustomOp *op);
  const char *(*GetExecutionProviderType)(const struct CustomOp *op);
  int (*GetInputType)(const struct CustomOp *op, size_t index);
  size_t (*GetInputTypeCount)(const struct CustomOp *op);
  int (*GetOutputType)(const struct CustomOp *op, size_t index);
  size_t (*GetOutputTypeCount)(const struct CustomOp *op);
  void (*KernelCompute)(void *kernel, OrtKernelContext *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const struct CustomOp *op, size_t index);
  int (*GetOutputCharacteristic)(const struct CustomOp *op, size_t index);
  int (*GetInputMemoryType)(const struct CustomOp *op, size_t index); /* OrtMemTypeDefault (0): CPU memory */
  int (*GetVariadicInputMinArity)(const struct CustomOp *op);         /* for variadic inputs: none here */
  int (*GetVariadicInputHomogeneity)(const struct CustomOp *op);
  int (*GetVariadicOutputMinArity)(const struct CustomOp *op);
  int (*GetVariadicOutputHomogeneity)(const struct CustomOp *op);
  OrtStatus *(*CreateKernelV2)(const struct CustomOp *op, const void *api, const OrtKernelInfo *info, void **kernel);
  OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
} CustomOp;

/* set by RegisterCustomOps (register.c): version 18 of the table */
extern const void *const *api;

#define API(index, type) ((type)api[index])
typedef OrtStatus *(*InputCountFn)(const OrtKernelContext *, size_t *);
typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef OrtStatus *(*MutableDataFn)(OrtValue *, void **);
typedef OrtStatus *(*TypeAndShapeFn)(const OrtValue *, OrtTensorTypeAndShapeInfo **);
typedef OrtStatus *(*DimsCountFn)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*DimsFn)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t);
typedef void (*ReleaseInfoFn)(OrtTensorTypeAndShapeInfo *);
typedef void (*ReleaseStatusFn)(OrtStatus *);
typedef OrtStatus *(*CreateDomainFn)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*DomainAddFn)(OrtCustomOpDomain *, const CustomOp *);
typedef OrtStatus *(*AddDomainFn)(OrtSessionOptions *, OrtCustomOpDomain *);
typedef OrtStatus *(*ConstantInputFn)(const OrtKernelInfo *, size_t, int *, const OrtValue **);
typedef OrtStatus *(*CreateStatusFn)(int, const char *);
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);

/* 1 when the call failed (its status is released) */
static inline int failed(OrtStatus *status) {
  if (status == NULL) return 0;
  API(API_RELEASE_STATUS, ReleaseStatusFn)(status);
  return 1;
}

/* "<op>: <why>" as an ONNX Runtime error status (INVALID_ARGUMENT), or NULL when ``why`` is NULL:
 * what an operator's compute function returns (``register.c``) */
OrtStatus *op_status(const char *op, const char *why);
/* a reason with numbers in it, formatted into a buffer of the calling thread (valid until its next call) */
const char *reason(const char *format, ...) __attribute__((format(printf, 1, 2)));

/* *out = the product of ``count`` sizes; 1 when one is negative or the product passes ``limit`` */
static inline int product_over(const int64_t *sizes, size_t count, int64_t limit, int64_t *out) {
  int64_t p = 1;
  for (size_t i = 0; i < count; i++)
    if (sizes[i] < 0 || __builtin_mul_overflow(p, sizes[i], &p) || p > limit) return 1;
  *out = p;
  return 0;
}

/* an input's data, its shape (at most ``most`` dims) and its rank; 1 on failure */
static inline int input_of_rank(OrtKernelContext *ctx, size_t index, void **data, int64_t *dims, size_t most,
                                size_t *rank) {
  const OrtValue *value = NULL;
  OrtTensorTypeAndShapeInfo *info = NULL;
  if (failed(API(API_KERNEL_CONTEXT_GET_INPUT, GetInputFn)(ctx, index, &value)) || value == NULL) return 1;
  if (failed(API(API_GET_TENSOR_TYPE_AND_SHAPE, TypeAndShapeFn)(value, &info))) return 1;
  int bad = failed(API(API_GET_DIMENSIONS_COUNT, DimsCountFn)(info, rank)) || *rank > most ||
            failed(API(API_GET_DIMENSIONS, DimsFn)(info, dims, *rank));
  API(API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseInfoFn)(info);
  return bad || failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)((OrtValue *)value, data));
}

/* an input's data and its shape, which must have ``want`` dims; 1 on failure */
static inline int input(OrtKernelContext *ctx, size_t index, void **data, int64_t *dims, size_t want) {
  size_t rank = 0;
  return input_of_rank(ctx, index, data, dims, want, &rank) || rank != want;
}

/* A linear operator's kernel: its inputs that are constant initializers (weights, scales, norm
 * weights), their data and shapes read once, when ONNX Runtime creates the kernel for a node,
 * rather than through five API calls an input on every run (measured faster on a SmolLM2 INT8
 * decode step, the library instrumented with the time-stamp counter). ONNX Runtime keeps a session's constant initializers, so the pointers
 * stay valid for as long as the kernel. Input 0 (the activations) is never among them. */
#define MAX_CONSTANTS 10
typedef struct {
  int known[MAX_CONSTANTS];
  void *data[MAX_CONSTANTS];
  int64_t dims[MAX_CONSTANTS][4];
  size_t rank[MAX_CONSTANTS];
} Constants;

/* input ``index`` as ``input`` gives it, from ``constants`` where it is one of them */
static inline int fixed_input(OrtKernelContext *ctx, const Constants *constants, size_t index, void **data,
                              int64_t *dims, size_t want) {
  if (index >= MAX_CONSTANTS || !constants->known[index]) return input(ctx, index, data, dims, want);
  for (size_t i = 0; i < want; i++) dims[i] = constants->dims[index][i];
  *data = constants->data[index];
  return constants->rank[index] != want;
}

/* the data of outputs 0..count-1, each of shape ``dims`` (rank ``rank``), into ``out``; 1 on failure */
static inline int float_outputs(OrtKernelContext *ctx, int count, const int64_t *dims, size_t rank, float **out) {
  for (int o = 0; o < count; o++) {
    OrtValue *value = NULL;
    if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, (size_t)o, dims, rank, &value)) ||
        failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(value, (void **)&out[o])))
      return 1;
  }
  return 0;
}

/* the callbacks every operator here shares */
int default_memory(const CustomOp *op, size_t index);
int no_variadic(const CustomOp *op);

/* an operator's struct: its kernel's creation and release, name, input types and count, output
 * types and count, the inputs' characteristics, and its compute function */
#define CUSTOM_OP(create, destroy, name, in_types, in_count, out_types, out_count, in_kinds, compute)            \
  {.version = 16, .CreateKernel = create, .GetName = name, .GetExecutionProviderType = cpu_provider,           \
   .GetInputType = in_types, .GetInputTypeCount = in_count, .GetOutputType = out_types,                        \
   .GetOutputTypeCount = out_count, .KernelCompute = NULL, .KernelDestroy = destroy,                            \
   .GetInputCharacteristic = in_kinds, .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory, \
   .GetVariadicInputMinArity = no_variadic, .GetVariadicInputHomogeneity = no_variadic,                        \
   .GetVariadicOutputMinArity = no_variadic, .GetVariadicOutputHomogeneity = no_variadic, .CreateKernelV2 = NULL, \
   .KernelComputeV2 = compute}

/* the trivial callbacks every operator here shares */
void *stateless_kernel(const CustomOp *op, const void *ort_api, const OrtKernelInfo *info);
const char *cpu_provider(const CustomOp *op);
void destroy_kernel(void *kernel);
int required(const CustomOp *op, size_t index);
size_t one_output(const CustomOp *op);
int float_output(const CustomOp *op, size_t index);

/* a ``Constants`` kernel for a node (``register.c``), and its release */
void *constants_kernel(const CustomOp *op, const void *ort_api, const OrtKernelInfo *info);
void release_constants(void *kernel);

/* one operator of the linear family (float outputs, a ``Constants`` kernel): its variable, name,
 * input types, input and output counts, and the call that computes it, which gives NULL or why it
 * could not (``ctx`` is the kernel context, ``constants`` the kernel) */
#define LINEAR_OP(var, name, types, inputs, outputs, call)                                                      \
  static const char *var##_name(const CustomOp *op) { (void)op; return name; }                                  \
  static size_t var##_inputs(const CustomOp *op) { (void)op; return inputs; }                                   \
  static size_t var##_outputs(const CustomOp *op) { (void)op; return outputs; }                                 \
  static OrtStatus *var##_compute(void *kernel, OrtKernelContext *ctx) {                                        \
    const Constants *constants = kernel;                                                                        \
    return op_status(name, call);                                                                               \
  }                                                                                                             \
  const CustomOp var = CUSTOM_OP(constants_kernel, release_constants, var##_name, types, var##_inputs,           \
                                 float_output, var##_outputs, required, var##_compute);

#define OPERATOR(var) extern const CustomOp var;
#include "operators.h"
#undef OPERATOR
int image_attention_ready(void); /* ImageAttentionBf16 runs here (an AVX-512 build on a CPU with AVX512-BF16) */
extern const char int8_linear_kernel[]; /* which dot-product instructions Int8Linear was built for */
extern const char block_linear_kernel[]; /* and Int4WeightLinear's and Int8BlockLinear's */
extern const char float_linear_kernel[]; /* and FloatLinear's multiply-adds */
extern const int masked_softmax_exact;    /* MaskedSoftmax gives Softmax's bits (AVX-512F builds) */

#endif
