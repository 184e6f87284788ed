/* A prefill's work items in the linears (FloatLinear, Int8Linear): past CHUNK_ROWS rows, an item
 * computes its tiles for one chunk of CHUNK_ROWS rows, not for all, and the items of a chunk come
 * one after another, so that chunk's inputs stay in the second-level cache while the threads
 * pass over every tile, rather than coming from the third level for every tile (768 rows of
 * K = 1536 floats are 4.7 MB). That brought FloatLinear's 1536 x 576 (SmolLM2's down projection)
 * up to about ONNX Runtime's MatMul, and the SmolLM2 engines' prefill measured faster with it.
 * A multiple of FloatLinear's GATED_ROWS. */
#ifndef AUTOGLM_CHUNKS_H
#define AUTOGLM_CHUNKS_H

#include <stddef.h>
#include <stdint.h>

#define CHUNK_ROWS 128

/* the rows each work item computes: CHUNK_ROWS past that many, else all */
static inline int64_t chunk_rows(int64_t rows) { return rows > CHUNK_ROWS ? CHUNK_ROWS : rows; }

/* work item i, of ``items`` in each chunk of ``chunk`` rows out of ``rows``: its rows [r0, r1),
 * and its place in the chunk (i % items) */
static inline int64_t chunk_item(size_t i, int64_t items, int64_t chunk, int64_t rows, int64_t *r0, int64_t *r1) {
  *r0 = (int64_t)i / items * chunk;
  *r1 = rows - *r0 < chunk ? rows : *r0 + chunk;
  return (int64_t)i % items;
}

#endif
