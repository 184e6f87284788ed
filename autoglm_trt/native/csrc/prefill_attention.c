/* PrefillAttention: a prefill's attention in one operator, without the [tokens x context] score
 * and probability tensors the graph's nodes write and read back (FlashAttention's online softmax,
 * Dao et al. 2022, on the CPU).
 *
 * The graph's prefill attention (``graph/decoder.py``) computes each layer's scores over the past
 * and the new keys, joins them, adds the mask bias, takes the softmax, splits it and multiplies
 * the two parts by the past and new values: over a 1,000-token prompt each of those passes moves
 * a 36 MB tensor a layer (SmolLM2), and they took most of the INT8 engine's prefill. Here a
 * work item takes up to QROWS query rows (tokens) of one query head and walks the keys KEYS at a
 * time: their scores (the queries times the keys, transposed once per call so that a step's keys
 * lie in one run of memory), the bias added, the rows' running maximum, sum and weighted values
 * rescaled as the maximum grows, the weighted values added; the sums divide at the end. The bias
 * is read once a call, each block of QROWS rows x KEYS keys classed as all 0, all masked or mixed
 * (at 4,000 tokens it is 64 MB: read by every head, it cost more than the arithmetic): a step
 * whose bias masks every key for every row of the item (the keys after the last query, in a
 * causal prefill) is skipped, those keys' weights being exp(-1e9) = 0 in float32 anyway, and a
 * block of zeros is not added. The result is the graph's to float32's rounding, not bit for bit
 * (another order of sums, another exp), which ``tests/native/test_prefill_attention.py`` checks
 * against numpy in float64.
 *
 * PrefillAttentionBf16 is the same operator with the two products in bfloat16 on Intel AMX
 * (``tdpbf16ps``: 16 rows x 16 columns x 32 pairs an instruction, float32 sums) where the CPU has
 * AMX-BF16 and Linux grants it (``amx.c``; ``AUTOGLM_TRT_AMX=0`` turns it off), else exactly
 * PrefillAttention: the queries, the keys and the values and each step's weights rounded to
 * bfloat16 (8 bits of mantissa), the softmax in float32. The keys and values are copied once a call
 * into AMX's B-tile layouts. The rewrite gives it to the engines whose activations are rounded to
 * 8 bits anyway (``passes/prefill_attention.py``).
 *
 * Inputs (Hkv KV heads, G query heads per KV head, B sequences, T new tokens, P past slots, D the
 * head's size, a multiple of 64):
 *   0 q       float32 [B, T, Hkv, G, D]   queries (the softmax's scale already in them)
 *   1 k_past  float32 [Hkv, B, 1, P, D]
 *   2 k_new   float32 [Hkv, B, 1, T, D]
 *   3 v_past  float32 [Hkv, B, 1, P, D]
 *   4 v_new   float32 [Hkv, B, 1, T, D]
 *   5 bias    float32 [1, B, 1, T, P + T]  0 where a query may attend, at most MASKED elsewhere
 * Output:
 *   0 context float32 [Hkv, B, G, T, D]
 * A row whose keys are all masked gets zeros (the graph: a uniform average; the runtime never
 * asks for such a row but in padding). Builds without fused multiply-add fail the run (the
 * rewrite, ``passes/prefill_attention.py``, uses the operator only where they have it).
 */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "ort_api.h"
#include "parallel.h"
#include "simd.h"

#define QROWS 32          /* query rows a work item takes */
#define MASKED (-1.0e8f)  /* a bias at or below this masks its key */

enum { OPEN, MIXED, SHUT }; /* a block of the bias: 0 everywhere, anything, at or below MASKED everywhere */

typedef struct {
  const float *q, *k_past, *k_new, *v_past, *v_new, *bias;
  float *out;
  float *kt; /* [Hkv, B, KP / KEYS, D, KEYS]: each head's and sequence's keys (past then new, zeros to
              * KP) transposed block by block, so that a step's keys are in one run of memory */
  int64_t hkv, b, g, t, p, d, kp;
  int failed; /* a work item found no memory */
  uint8_t *kind; /* [B, row tiles, key steps]: each block of the bias, OPEN, MIXED or SHUT */
  uint16_t *kb, *vb; /* bfloat16 (AMX): [Hkv, B, KP / KEYS, D / 2, KEYS, 2] keys and
                      * [Hkv, B, KP / KEYS, KEYS / 2, D, 2] values, AMX's B tiles; NULL: float32 */
} Job;

#if SIMD_LANES && SIMD_FMA
const int prefill_attention_built = 1;
#define VL SIMD_LANES
/* keys a step takes: more keys share each row's softmax bookkeeping (with 8-wide vectors more ran
 * no faster, docs/native.md) */
#define KEYS (VL == 16 ? 64 : 16)
#define KV (KEYS / VL)       /* vectors of a step's keys */
#define SROWS ((VL == 16 ? 256 : 64) / KEYS) /* rows of scores in registers at a time: 16 or 8 accumulators */
#define PAD (SROWS > 4 ? SROWS : 4) /* rows are padded to a multiple of this (weigh takes 4 at a time) */
#define DV (VL == 16 ? 4 : 2)     /* vectors of values a row keeps in registers at a time */

/* s[r][c] = q[r] . key c, for rows [0, rows) (q: rows x D; rows a multiple of SROWS, so that
 * the accumulators are registers) over a step's transposed keys kt [D, KEYS] */
static void scores(const float *q, int rows, const float *kt, int64_t d, float (*s)[KEYS]) {
  for (int r0 = 0; r0 < rows; r0 += SROWS) {
    vf acc[SROWS][KV];
    for (int r = 0; r < SROWS; r++)
      for (int v = 0; v < KV; v++) acc[r][v] = vf_zero();
    for (int64_t i = 0; i < d; i++) {
      vf k[KV];
      for (int v = 0; v < KV; v++) k[v] = vf_load(kt + i * KEYS + v * VL);
      for (int r = 0; r < SROWS; r++)
        for (int v = 0; v < KV; v++) acc[r][v] = vf_fma(vf_set1(q[(r0 + r) * d + i]), k[v], acc[r][v]);
    }
    for (int r = 0; r < SROWS; r++)
      for (int v = 0; v < KV; v++) vf_store(s[r0 + r] + v * VL, acc[r][v]);
  }
}

/* o[r] += sum over keys c < count of p[r][c] values[c], rows [0, rows) (a multiple of 4) 4 at a
 * time, DV vectors of D at a time */
static void weigh(float *o, int rows, const float (*p)[KEYS], const float *const *values, int count, int64_t d) {
  for (int r0 = 0; r0 < rows; r0 += 4)
    for (int64_t i = 0; i < d; i += DV * VL) {
      vf acc[4][DV];
      for (int r = 0; r < 4; r++)
        for (int v = 0; v < DV; v++) acc[r][v] = vf_load(o + (r0 + r) * d + i + v * VL);
      for (int c = 0; c < count; c++) {
        vf x[DV];
        for (int v = 0; v < DV; v++) x[v] = vf_load(values[c] + i + v * VL);
        for (int r = 0; r < 4; r++)
          for (int v = 0; v < DV; v++) acc[r][v] = vf_fma(vf_set1(p[r0 + r][c]), x[v], acc[r][v]);
      }
      for (int r = 0; r < 4; r++)
        for (int v = 0; v < DV; v++) vf_store(o + (r0 + r) * d + i + v * VL, acc[r][v]);
    }
}

/* key or value ``key`` (past then new) of head h and sequence b */
static const float *row_of(const Job *j, const float *past, const float *fresh, int64_t h, int64_t b, int64_t key) {
  return key < j->p ? past + ((h * j->b + b) * j->p + key) * j->d : fresh + ((h * j->b + b) * j->t + key - j->p) * j->d;
}

/* the keys of head h and sequence b (item h B + b), transposed */
static void transpose_keys(void *data, size_t item) {
  const Job *j = data;
  const int64_t h = (int64_t)item / j->b, b = (int64_t)item % j->b, width = j->p + j->t;
  float *kt = j->kt + (int64_t)item * j->d * j->kp;
  for (int64_t key = 0; key < j->kp; key++) {
    const float *k = key < width ? row_of(j, j->k_past, j->k_new, h, b, key) : NULL;
    float *to = kt + key / KEYS * j->d * KEYS + key % KEYS;
    for (int64_t i = 0; i < j->d; i++) to[i * KEYS] = k != NULL ? k[i] : 0.0f;
  }
}

/* the kind of each block of the bias, QROWS rows by KEYS keys, of the item's sequence and rows
 * (item b tiles + tb): read once a call, not once a head (at 4,000 tokens the bias is 64 MB) */
static void classify(void *data, size_t item) {
  const Job *j = data;
  const int64_t width = j->p + j->t, tiles = (j->t + QROWS - 1) / QROWS, steps = (width + KEYS - 1) / KEYS;
  const int64_t b = (int64_t)item / tiles, t0 = (int64_t)item % tiles * QROWS;
  const int64_t rows = j->t - t0 < QROWS ? j->t - t0 : QROWS;
  const float *bias = j->bias + (b * j->t + t0) * width;
  for (int64_t k0 = 0; k0 < width; k0 += KEYS) {
    const int64_t count = width - k0 < KEYS ? width - k0 : KEYS;
    int open = 1, shut = 1;
    for (int64_t r = 0; r < rows && (open || shut); r++) {
      const float *row = bias + r * width + k0;
#pragma omp simd reduction(& : open, shut)
      for (int64_t c = 0; c < count; c++) {
        open &= row[c] == 0.0f;
        shut &= row[c] <= MASKED;
      }
    }
    j->kind[(int64_t)item * steps + k0 / KEYS] = (uint8_t)(open ? OPEN : shut ? SHUT : MIXED);
  }
}

/* the scores s of rows [0, rows) and keys [k0, k0 + count) with their bias (row r's at bias + r
 * width; NULL: 0 everywhere), as weights (0 for rows [rows, padded)): the rows' maxima m, sums l
 * and weighted values o rescaled to the new maxima */
static void to_weights(float (*s)[KEYS], int rows, int padded, int count, const float *bias, int64_t width,
                       int64_t k0, float *m, float *l, float *o, int64_t d) {
  float top[QROWS], alpha[QROWS + VL];
  memset(s[rows], 0, (size_t)(padded - rows) * sizeof s[0]);
  for (int r = 0; r < rows; r++) { /* the scores with their bias, and the rows' new maxima */
    vf high = vf_set1(m[r]);
    for (int u = 0; u < KV; u++) {
      const vmask open = vmask_first(count - u * VL);
      vf v = vf_load(s[r] + u * VL);
      if (bias != NULL) v = vf_add(v, vf_maskz_load(open, bias + r * width + k0 + u * VL));
      v = vf_select(open, vf_set1(-FLT_MAX), v);
      vf_store(s[r] + u * VL, v);
      high = vf_max(high, v);
    }
    top[r] = vf_hmax(high);
  }
  for (int r = 0; r < rows; r += VL) { /* the old sums' factors, VL rows at a time (past rows: e^0) */
    const vmask here = vmask_first(rows - r);
    const vf old = vf_maskz_load(here, m + r), high = vf_maskz_load(here, top + r);
    vf_store(alpha + r, vf_exp_nonpositive(vf_sub(old, high)));
  }
  for (int r = 0; r < rows; r++) {
    vf sum = vf_zero();
    for (int u = 0; u < KV; u++) {
      const vf e = vf_exp_nonpositive(vf_sub(vf_load(s[r] + u * VL), vf_set1(top[r])));
      vf_store(s[r] + u * VL, e);
      sum = vf_add(sum, e);
    }
    if (alpha[r] != 1.0f)
      for (int64_t i = 0; i < d; i += VL) vf_store(o + r * d + i, vf_mul(vf_load(o + r * d + i), vf_set1(alpha[r])));
    l[r] = l[r] * alpha[r] + vf_hsum(sum);
    m[r] = top[r];
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__x86_64__) && defined(__linux__)
#define BF16_TILES 1 /* AMX is compiled into this build (amx.c) */
_Static_assert(KEYS == AMX_KEYS, "a step of keys is amx.c's");
/* the keys and values of head h and sequence b (item h B + b) as bfloat16 B tiles: per step, keys
 * [D / 2, KEYS, 2] (pairs of the head's dimensions by key), values [KEYS / 2, D, 2] (pairs of keys
 * by dimension); zeros past the last key */
static void bf16_keys_values(void *data, size_t item) {
  const Job *j = data;
  const int64_t h = (int64_t)item / j->b, b = (int64_t)item % j->b, width = j->p + j->t, d = j->d;
  uint16_t *kb = j->kb + (int64_t)item * j->kp * d, *vb = j->vb + (int64_t)item * j->kp * d;
  for (int64_t key = 0; key < j->kp; key++) {
    const float *k = key < width ? row_of(j, j->k_past, j->k_new, h, b, key) : NULL;
    const float *v = key < width ? row_of(j, j->v_past, j->v_new, h, b, key) : NULL;
    uint16_t *ks = kb + key / KEYS * d * KEYS, *vs = vb + key / KEYS * d * KEYS;
    const int64_t c = key % KEYS;
    for (int64_t i = 0; i < d; i++) {
      ks[i / 2 * KEYS * 2 + c * 2 + i % 2] = k != NULL ? bf16_round(k[i]) : 0;
      vs[c / 2 * d * 2 + i * 2 + c % 2] = v != NULL ? bf16_round(v[i]) : 0;
    }
  }
}

#else
#define BF16_TILES 0 /* the bfloat16 path is never taken (Job.kb NULL): stubs */
static void bf16_keys_values(void *data, size_t item) { (void)data, (void)item; }
#endif

/* query rows (tokens) [QROWS tb, ...) of query head (h, g) and sequence b: item ((h B + b) G + g)
 * tiles + tb */
static void attend(void *data, size_t item) {
  const Job *j = data;
  const int64_t tiles = (j->t + QROWS - 1) / QROWS, tb = (int64_t)item % tiles, rest = (int64_t)item / tiles;
  const int64_t g = rest % j->g, b = rest / j->g % j->b, h = rest / j->g / j->b, d = j->d, width = j->p + j->t;
  const int64_t t0 = tb * QROWS;
  const int bf16 = j->kb != NULL, pad = bf16 ? 16 : PAD; /* bfloat16 tiles take 16 rows */
  const int rows = (int)(j->t - t0 < QROWS ? j->t - t0 : QROWS), padded = (rows + pad - 1) / pad * pad;
  float *q = thread_scratch((size_t)(2 * QROWS * d) * sizeof(float) + (size_t)(QROWS * (d + KEYS)) * sizeof(uint16_t));
  float *o = q + QROWS * d;
  uint16_t *qb = (uint16_t *)(o + QROWS * d), *pb = qb + QROWS * d; /* bfloat16 queries and weights */
  if (q == NULL) {
    __atomic_store_n(&((Job *)data)->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  float m[QROWS], l[QROWS], s[QROWS][KEYS];
  for (int r = 0; r < rows; r++) {
    memcpy(q + r * d, j->q + (((b * j->t + t0 + r) * j->hkv + h) * j->g + g) * d, (size_t)d * sizeof(float));
    m[r] = -FLT_MAX, l[r] = 0.0f;
  }
  memset(q + rows * d, 0, (size_t)((padded - rows) * d) * sizeof(float)); /* rows that pad the last group */
  memset(o, 0, (size_t)(padded * d) * sizeof(float));
  const int64_t head = (h * j->b + b) * d * j->kp; /* this head's and sequence's keys, transposed */
  const float *bias = j->bias + b * j->t * width;
  if (bf16) {
    for (int64_t i = 0; i < padded * d; i++) qb[i] = bf16_round(q[i]);
    amx_bf16_begin();
  }
  const uint8_t *kinds = j->kind + (b * tiles + tb) * ((width + KEYS - 1) / KEYS);
  for (int64_t k0 = 0; k0 < width; k0 += KEYS) {
    const int count = (int)(width - k0 < KEYS ? width - k0 : KEYS), kind = kinds[k0 / KEYS];
    if (kind == SHUT) continue; /* every key masked for every row: weights exp(-1e9) = 0 */
    if (bf16)
      amx_bf16_scores(qb, padded, j->kb + head + k0 * d, d, s[0]);
    else
      scores(q, padded, j->kt + head + k0 * d, d, s);
    to_weights(s, rows, padded, count, kind == MIXED ? bias + t0 * width : NULL, width, k0, m, l, o, d);
    if (bf16) {
      amx_bf16_weigh(o, padded, s[0], j->vb + head + k0 * d, d, pb);
      continue;
    }
    const float *values[KEYS];
    for (int c = 0; c < count; c++) values[c] = row_of(j, j->v_past, j->v_new, h, b, k0 + c);
    weigh(o, padded, (const float(*)[KEYS])s, values, count, d);
  }
  if (bf16) amx_bf16_end();
  for (int r = 0; r < rows; r++) {
    float *out = j->out + (((h * j->b + b) * j->g + g) * j->t + t0 + r) * d;
    const float inv = m[r] > MASKED ? 1.0f / l[r] : 0.0f; /* else no key was unmasked */
    for (int64_t i = 0; i < d; i++) out[i] = o[r * d + i] * inv;
  }
}
#else
#define KEYS 16
#define BF16_TILES 0
const int prefill_attention_built = 0;
static void transpose_keys(void *data, size_t item) { (void)data, (void)item; }
static void bf16_keys_values(void *data, size_t item) { (void)data, (void)item; }
static void classify(void *data, size_t item) { (void)data, (void)item; }
static void attend(void *data, size_t item) { (void)data, (void)item; }
#endif

/* ``bf16_wanted``: PrefillAttentionBf16, which takes the bfloat16 path where AMX has it */
static const char *run(OrtKernelContext *ctx, int bf16_wanted) {
  int64_t qd[5], kd[5], nd[5], vd[5], wd[5], bd[5];
  void *in[6];
  if (input(ctx, 0, &in[0], qd, 5) || input(ctx, 1, &in[1], kd, 5) || input(ctx, 2, &in[2], nd, 5) ||
      input(ctx, 3, &in[3], vd, 5) || input(ctx, 4, &in[4], wd, 5) || input(ctx, 5, &in[5], bd, 5))
    return "an input is missing or not of rank 5 (q, k_past, k_new, v_past, v_new, bias)";
  if (!prefill_attention_built) return "this build of the native library has no PrefillAttention (it needs FMA)";
  const int64_t b = qd[0], t = qd[1], hkv = qd[2], g = qd[3], d = qd[4], p = kd[3];
  const int64_t past[5] = {hkv, b, 1, p, d}, fresh[5] = {hkv, b, 1, t, d}, bias[5] = {1, b, 1, t, p + t};
  if (memcmp(kd, past, sizeof past) || memcmp(vd, past, sizeof past) || memcmp(nd, fresh, sizeof fresh) ||
      memcmp(wd, fresh, sizeof fresh) || memcmp(bd, bias, sizeof bias) || d % 64 != 0 || d > 4096 || p + t < 1)
    return reason("q [%lld, %lld, %lld, %lld, %lld], past K/V [.., %lld, ..] and bias [.., %lld] do not fit (want "
                  "K/V [Hkv, B, 1, P or T, D], bias [1, B, 1, T, P + T], D a multiple of 64)",
                  (long long)qd[0], (long long)qd[1], (long long)qd[2], (long long)qd[3], (long long)qd[4],
                  (long long)kd[3], (long long)bd[4]);
  const int64_t out_dims[5] = {hkv, b, g, t, d};
  OrtValue *value = NULL;
  float *out;
  if (failed(API(API_KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, 0, out_dims, 5, &value)) ||
      failed(API(API_GET_TENSOR_MUTABLE_DATA, MutableDataFn)(value, (void **)&out)))
    return "could not allocate the output";
  if (hkv * b * g * t == 0) return NULL;
  const int64_t kp = (p + t + KEYS - 1) / KEYS * KEYS;
  const int bf16 = BF16_TILES && bf16_wanted && amx_bf16_ready();
  const int64_t tiles = (t + QROWS - 1) / QROWS;
  float *kt = bf16 ? NULL : malloc((size_t)(hkv * b * d * kp) * sizeof(float));
  uint16_t *kb = bf16 ? malloc((size_t)(2 * hkv * b * d * kp) * sizeof(uint16_t)) : NULL;
  uint8_t *kind = malloc((size_t)(b * tiles * (kp / KEYS)));
  if ((kt == NULL && kb == NULL) || kind == NULL) {
    free(kt), free(kb), free(kind);
    return "out of memory for the transposed keys";
  }
  Job job = {in[0], in[1], in[2], in[3], in[4], in[5], out, kt, hkv, b, g, t, p, d, kp, 0, kind, kb,
             kb != NULL ? kb + hkv * b * d * kp : NULL};
  parallel_for(ctx, classify, (size_t)(b * tiles), 2, &job);
  parallel_for(ctx, bf16 ? bf16_keys_values : transpose_keys, (size_t)(hkv * b), 2, &job);
  parallel_for(ctx, attend, (size_t)(hkv * b * g * tiles), 2, &job);
  free(kt), free(kb), free(kind);
  return job.failed ? "out of memory for a work item" : NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  return op_status("PrefillAttention", run(ctx, 0));
}
static OrtStatus *compute_bf16(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  return op_status("PrefillAttentionBf16", run(ctx, 1));
}
static const char *op_name(const CustomOp *op) { (void)op; return "PrefillAttention"; }
static const char *op_name_bf16(const CustomOp *op) { (void)op; return "PrefillAttentionBf16"; }
static int input_type(const CustomOp *op, size_t i) { (void)op, (void)i; return ELEM_FLOAT; }
static size_t six_inputs(const CustomOp *op) { (void)op; return 6; }

const CustomOp prefill_attention = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name, input_type, six_inputs,
                                             float_output, one_output, required, compute);
const CustomOp prefill_attention_bf16 = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name_bf16, input_type,
                                                  six_inputs, float_output, one_output, required, compute_bf16);
