/* How the integer linears (Int8Linear, Int4WeightLinear) spread their column tiles over threads.
 *
 * A batch-1 step's work items are runs of adjacent tiles, RUNS_PER_CPU runs per processor, so
 * that each thread reads the weights in long runs front to back, which the processor's
 * prefetchers follow, rather than every other tile as the threads claim them one at a time (a
 * tile of SmolLM2's K = 576 is 9 KiB at INT8). It made the INT8 engine's batch-1 decode step
 * faster on this project's 2-processor machines, more with RUNS_PER_CPU runs than with longer or
 * shorter ones (it changed nothing at larger batches, nor for the float linears' tile pairs at
 * batch 1, which are 8 times longer). Per processor, so that a machine with many keeps them all
 * busy (the processors online: in a container allowed fewer of them, runs are shorter than they
 * need be). With more rows, each item is one tile for one chunk of rows (``chunks.h``). */
#ifndef AUTOGLM_TILE_RUNS_H
#define AUTOGLM_TILE_RUNS_H

#include <stdatomic.h>
#include <stdint.h>
#include <unistd.h>

#include "chunks.h"
#include "parallel.h"

#define RUNS_PER_CPU 8

static inline size_t runs_wanted(void) {
  static atomic_long cpus; /* the processors online, asked once */
  long n = atomic_load_explicit(&cpus, memory_order_relaxed);
  if (n <= 0) {
    n = sysconf(_SC_NPROCESSORS_ONLN);
    n = n > 2 ? n : 2;
    atomic_store_explicit(&cpus, n, memory_order_relaxed);
  }
  return (size_t)(RUNS_PER_CPU * n);
}

/* one tile's outputs for rows [r0, r1): the kernel's job, the tile */
typedef void (*TileFn)(const void *job, int64_t tile, int64_t r0, int64_t r1);

typedef struct {
  const void *job;
  TileFn tile;
  int64_t rows, tiles, per, runs, chunk; /* tiles in all, in a run, runs a chunk of ``chunk`` rows */
} Runs;

static inline void tile_run(void *data, size_t i) {
  const Runs *r = data;
  int64_t r0, r1;
  const int64_t run = chunk_item(i, r->runs, r->chunk, r->rows, &r0, &r1);
  const int64_t end = (run + 1) * r->per < r->tiles ? (run + 1) * r->per : r->tiles;
  for (int64_t t = run * r->per; t < end; t++) r->tile(r->job, t, r0, r1);
}

/* ``tile`` over tiles [0, tiles) and rows [0, rows), on ONNX Runtime's threads */
static inline void run_tiles(OrtKernelContext *ctx, const void *job, TileFn tile, int64_t tiles, int64_t rows) {
  const int64_t want = (int64_t)runs_wanted(), per = rows == 1 && tiles > want ? (tiles + want - 1) / want : 1;
  const int64_t chunk = chunk_rows(rows), runs = (tiles + per - 1) / per; /* runs of tiles a chunk */
  Runs r = {job, tile, rows, tiles, per, runs, chunk};
  parallel_for(ctx, tile_run, (size_t)(runs * ((rows + chunk - 1) / chunk)), 2, &r);
}

#endif
