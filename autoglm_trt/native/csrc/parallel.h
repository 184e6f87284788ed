/* The one way the operators spread work over threads: ONNX Runtime's own intra-op pool
 * (KernelContext_ParallelFor, version 18 of the API), so the library starts no threads of its
 * own. Fewer than ``enough`` items, no such call, or a call that fails: the items run here, in
 * order. Each item must be independent of the others. */
#ifndef AUTOGLM_PARALLEL_H
#define AUTOGLM_PARALLEL_H

#include "ort_api.h"

static inline void parallel_for(OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t count, size_t enough,
                                void *job) {
  if (count >= enough && has_parallel_for &&
      !failed(API(API_KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(ctx, fn, count, 0, job)))
    return;
  for (size_t i = 0; i < count; i++) fn(job, i);
}

#endif
