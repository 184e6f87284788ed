/* The one way the operators spread work over threads: ONNX Runtime's own intra-op pool
 * (KernelContext_ParallelFor, version 18 of the API), so the library starts no threads of its
 * own. Fewer than ``enough`` items, or a call that fails: the items run here, in
 * order. Each item must be independent of the others. */
#ifndef AUTOGLM_PARALLEL_H
#define AUTOGLM_PARALLEL_H

#include <stdlib.h>

#include "ort_api.h"

static inline void parallel_for(OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t count, size_t enough,
                                void *job) {
  if (count >= enough &&
      !failed(API(API_KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(ctx, fn, count, 0, job)))
    return;
  for (size_t i = 0; i < count; i++) fn(job, i);
}

/* Scratch memory of the calling thread, at least ``bytes``, 64-byte aligned: each thread keeps one
 * buffer as large as the largest its work items have asked for (a work item runs on one thread,
 * start to end), so a step's items allocate nothing once the threads have warmed up. NULL when
 * memory runs out; the buffer lives as long as the thread. */
static inline void *thread_scratch(size_t bytes) {
  static _Thread_local void *data;
  static _Thread_local size_t size;
  if (bytes > size) {
    const size_t want = (bytes + 63) / 64 * 64;
    void *grown = aligned_alloc(64, want);
    if (grown == NULL) return NULL;
    free(data);
    data = grown;
    size = want;
  }
  return data;
}

#endif
