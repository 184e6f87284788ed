/* ImageAttentionBf16: the vision encoder's attention (every patch of one image attends to every
 * other, no mask) with its two products in bfloat16 on AVX512-BF16 (``vdpbf16ps``: 16 float32
 * sums of 2 bfloat16 products an instruction), FlashAttention's online softmax in float32
 * (Dao et al. 2022), so the [patches x patches] scores are never held.
 *
 * ONNX Runtime's MultiHeadAttention (what the float32 encoder runs) computes a screenshot's
 * attention in float32 at about the CPU's float32 peak; bfloat16 products double the work an
 * instruction does (``benchmarks.vision_forms`` measures both: docs/benchmarks.md, section "The
 * vision encoder's fast forms"). The rounding is PrefillAttentionBf16's: the queries (scaled by log2(e) / sqrt(D)),
 * the keys, the values and each step's weights rounded to bfloat16 (to nearest, ties to even),
 * the scores, their maximum, the sums and the output in float32, and the exponential a degree-5
 * polynomial of 2^f. Each row's weights are summed as rounded, so the weights the values get sum
 * to one. ``tests/native/test_image_attention.py`` checks it against numpy in float64.
 *
 * A work item takes RB query rows of one head and walks the keys KB at a time: the scores of
 * RG rows x KB keys in 16 accumulators, the rows' running maximum and sum, the weights rounded
 * to bfloat16, and the rows' outputs (kept in the item's scratch) rescaled and added to. The
 * keys, values and queries are packed once a call: keys as [H, KP / 16, D / 2, 16 keys, 2],
 * values as [H, KP / 2, D, 2 keys], queries as [H, KP, D / 2, 2], where KP is the patch count
 * rounded up to KB; the padding keys' scores are masked.
 *
 * Inputs:  0 q, 1 k, 2 v  float32 [T, H, D]   D one of 16, 32, 64, 128
 * Output:  0 context      float32 [T, H, D]   softmax(q k^T / sqrt(D)) v per head
 * Builds without AVX-512, and CPUs without AVX512-BF16, fail the run with the reason (the
 * runtime uses the operator only where ``AutoglmImageAttentionBf16`` says it runs).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"
#include "parallel.h"

#define KB 64 /* keys a step */
#define RG 4  /* rows whose scores are computed together */
#define RB 64 /* rows a work item takes */

typedef struct {
  const float *q, *k, *v;
  float *out;
  int64_t t, kp, h, d;
  uint32_t *qp, *kpk, *vp; /* packed queries, keys, values (bfloat16 pairs) */
  int failed;
} Job;

static inline uint16_t to_bf16(float f) { /* to nearest, ties to even (NaN stays NaN) */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline uint32_t pair(float lo, float hi) { return (uint32_t)to_bf16(lo) | (uint32_t)to_bf16(hi) << 16; }

/* one head's queries, keys and values into their packed forms (zeros past T) */
static void pack(void *data, size_t item) {
  const Job *j = data;
  const int64_t h = (int64_t)item, d = j->d, d2 = d / 2, row = j->h * d;
  const float scale = 1.4426950408889634f / sqrtf((float)d);
  uint32_t *qp = j->qp + h * j->kp * d2, *kp = j->kpk + h * j->kp * d2, *vp = j->vp + h * j->kp * d2;
  uint16_t *vh = (uint16_t *)vp;
  memset(qp, 0, (size_t)(j->kp * d2) * 4);
  memset(kp, 0, (size_t)(j->kp * d2) * 4);
  memset(vp, 0, (size_t)(j->kp * d2) * 4);
  for (int64_t t = 0; t < j->t; t++) {
    const float *q = j->q + t * row + h * d, *k = j->k + t * row + h * d, *v = j->v + t * row + h * d;
    for (int64_t p = 0; p < d2; p++) {
      qp[t * d2 + p] = pair(q[2 * p] * scale, q[2 * p + 1] * scale);
      kp[((t / 16) * d2 + p) * 16 + t % 16] = pair(k[2 * p], k[2 * p + 1]);
    }
    for (int64_t i = 0; i < d; i++) vh[((t / 2) * d + i) * 2 + t % 2] = to_bf16(v[i]);
  }
}

#if defined(__AVX512F__) && defined(__x86_64__)
#include <immintrin.h>
#define BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

int image_attention_ready(void) {
  static atomic_int state; /* 0: not asked yet, 1: here, 2: not here */
  int s = atomic_load_explicit(&state, memory_order_acquire);
  if (s == 0) {
    __builtin_cpu_init();
    s = __builtin_cpu_supports("avx512bf16") ? 1 : 2;
    atomic_store_explicit(&state, s, memory_order_release);
  }
  return s == 1;
}

/* 2^x for x <= 0 (below -126: 2^-126) */
BF16 static inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f); /* (ln 2)^i / i!, i = 5 .. 0 */
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/* o[r] = o[r] * alpha[r] + sum over the step's KB keys of w[r][key] v[key], for the RG rows of D = 16 NV
 * columns, CV columns of 16 at a time (RG x CV accumulators; each load of values serves the RG rows) */
#define WEIGHTED_VALUES(NV, CV)                                                                            \
  BF16 static void values_##NV(float *o, const __m512 *alpha, const uint16_t (*w)[KB], const uint32_t *v) {  \
    for (int c0 = 0; c0 < NV; c0 += CV) {                                                                  \
      __m512 acc[RG][CV];                                                                                  \
      for (int r = 0; r < RG; r++)                                                                         \
        for (int i = 0; i < CV; i++) acc[r][i] = _mm512_mul_ps(_mm512_loadu_ps(o + r * 16 * NV + 16 * (c0 + i)), \
                                                               alpha[r]);                                  \
      for (int p = 0; p < KB / 2; p++) {                                                                   \
        __m512bh vv[CV];                                                                                   \
        for (int i = 0; i < CV; i++) vv[i] = (__m512bh)_mm512_loadu_si512(v + p * 16 * NV + 16 * (c0 + i)); \
        for (int r = 0; r < RG; r++) {                                                                     \
          uint32_t both;                                                                                   \
          memcpy(&both, w[r] + 2 * p, 4);                                                                  \
          const __m512bh wr = (__m512bh)_mm512_set1_epi32((int)both);                                      \
          for (int i = 0; i < CV; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wr, vv[i]);                 \
        }                                                                                                  \
      }                                                                                                    \
      for (int r = 0; r < RG; r++)                                                                         \
        for (int i = 0; i < CV; i++) _mm512_storeu_ps(o + r * 16 * NV + 16 * (c0 + i), acc[r][i]);         \
    }                                                                                                      \
  }
WEIGHTED_VALUES(1, 1)
WEIGHTED_VALUES(2, 2)
WEIGHTED_VALUES(4, 4)
WEIGHTED_VALUES(8, 4)

/* RB rows of one head (item = head * row blocks + block) */
BF16 static void attend(void *data, size_t item) {
  Job *j = data;
  const int64_t blocks = j->kp / RB, h = (int64_t)item / blocks, row0 = (int64_t)item % blocks * RB;
  const int64_t d = j->d, d2 = d / 2, nv = d / 16;
  float *o = thread_scratch((size_t)(RB * d + 17 * RB) * sizeof(float));
  if (o == NULL) {
    j->failed = 1;
    return;
  }
  float *m = o + RB * d, *l = m + RB; /* l: each row's sum, 16 lanes of it, added up at the end */
  uint16_t w[RG][KB] __attribute__((aligned(64)));
  memset(o, 0, (size_t)(RB * d) * sizeof(float));
  for (int r = 0; r < RB; r++) m[r] = -INFINITY;
  memset(l, 0, (size_t)(16 * RB) * sizeof(float));
  const uint32_t *qh = j->qp + h * j->kp * d2, *kh = j->kpk + h * j->kp * d2, *vh = j->vp + h * j->kp * d2;
  for (int64_t k0 = 0; k0 < j->kp; k0 += KB) {
    const uint32_t *keys = kh + k0 * d2, *values = vh + k0 / 2 * d;
    const int64_t valid = j->t - k0 < KB ? j->t - k0 : KB;
    for (int64_t g = 0; g < RB; g += RG) {
      __m512 s[RG][4], alpha[RG];
      for (int r = 0; r < RG; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
      const uint32_t *q = qh + (row0 + g) * d2;
      for (int64_t p = 0; p < d2; p++) {
        __m512bh kv[4];
        for (int c = 0; c < 4; c++) kv[c] = (__m512bh)_mm512_loadu_si512(keys + (c * d2 + p) * 16);
        for (int r = 0; r < RG; r++) {
          const __m512bh qr = (__m512bh)_mm512_set1_epi32((int)q[r * d2 + p]);
          for (int c = 0; c < 4; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], qr, kv[c]);
        }
      }
      for (int c = 0; c < 4 && valid < KB; c++) { /* the padding keys of the last step */
        const int64_t left = valid - 16 * c;
        const __mmask16 keep = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < RG; r++) s[r][c] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), s[r][c]);
      }
      for (int r = 0; r < RG; r++) {
        const __m512 most = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
        const float top = _mm512_reduce_max_ps(most), before = m[g + r];
        const float now = top > before ? top : before;
        const float shrink = now == before ? 1.0f : before == -INFINITY ? 0.0f : exp2f(before - now);
        const __m512 at = _mm512_set1_ps(now);
        for (int c = 0; c < 4; c++) s[r][c] = exp2_nonpositive(_mm512_sub_ps(s[r][c], at));
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]);
        const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(s[r][3], s[r][2]);
        _mm512_store_si512(w[r], lo);
        _mm512_store_si512(w[r] + 32, hi);
        /* the sum of the weights as rounded, which the values are weighted by: they sum to one */
        const __m512i upper = _mm512_set1_epi32((int)0xFFFF0000u);
        const __m512 sum = _mm512_add_ps(
            _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)), _mm512_castsi512_ps(_mm512_and_si512(lo, upper))),
            _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)), _mm512_castsi512_ps(_mm512_and_si512(hi, upper))));
        m[g + r] = now;
        _mm512_store_ps(l + 16 * (g + r), _mm512_fmadd_ps(_mm512_load_ps(l + 16 * (g + r)), _mm512_set1_ps(shrink), sum));
        alpha[r] = _mm512_set1_ps(shrink);
      }
      float *og = o + g * d;
      if (nv == 1) values_1(og, alpha, (const uint16_t(*)[KB])w, values);
      else if (nv == 2) values_2(og, alpha, (const uint16_t(*)[KB])w, values);
      else if (nv == 4) values_4(og, alpha, (const uint16_t(*)[KB])w, values);
      else values_8(og, alpha, (const uint16_t(*)[KB])w, values);
    }
  }
  for (int64_t r = 0; r < RB && row0 + r < j->t; r++) {
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(l + 16 * r));
    float *out = j->out + ((row0 + r) * j->h + h) * d;
    for (int64_t i = 0; i < d; i++) out[i] = o[r * d + i] * inv;
  }
}
#else
int image_attention_ready(void) { return 0; }
static void attend(void *data, size_t item) { (void)data, (void)item; }
#endif

static const char *run(OrtKernelContext *ctx) {
  int64_t qd[3], kd[3], vd[3];
  void *in[3];
  if (input(ctx, 0, &in[0], qd, 3) || input(ctx, 1, &in[1], kd, 3) || input(ctx, 2, &in[2], vd, 3))
    return "an input is missing or not of rank 3 (q, k, v: [T, H, D])";
  const int64_t t = qd[0], h = qd[1], d = qd[2];
  if (memcmp(qd, kd, sizeof qd) || memcmp(qd, vd, sizeof qd) || (d != 16 && d != 32 && d != 64 && d != 128) ||
      t > ((int64_t)1 << 24) || h > 4096)
    return reason("q [%lld, %lld, %lld], k [%lld, %lld, %lld] and v [%lld, %lld, %lld] do not fit (want one shape "
                  "[T, H, D], D one of 16, 32, 64, 128, T up to 2^24, H up to 4096)",
                  (long long)qd[0], (long long)qd[1], (long long)qd[2], (long long)kd[0], (long long)kd[1],
                  (long long)kd[2], (long long)vd[0], (long long)vd[1], (long long)vd[2]);
  if (!image_attention_ready())
    return "this build of the native library or this CPU has no AVX512-BF16 (the runtime keeps MultiHeadAttention there)";
  float *out;
  if (float_outputs(ctx, 1, qd, 3, &out)) return "could not allocate the output";
  if (t * h == 0) return NULL;
  const int64_t kp = (t + RB - 1) / RB * RB, each = h * kp * d / 2;
  uint32_t *packed = malloc((size_t)(3 * each) * sizeof(uint32_t));
  if (packed == NULL) return "out of memory for the packed queries, keys and values";
  Job job = {in[0], in[1], in[2], out, t, kp, h, d, packed, packed + each, packed + 2 * each, 0};
  parallel_for(ctx, pack, (size_t)h, 2, &job);
  parallel_for(ctx, attend, (size_t)(h * (kp / RB)), 2, &job);
  free(packed);
  return job.failed ? "out of memory for a work item" : NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  return op_status("ImageAttentionBf16", run(ctx));
}
static const char *op_name(const CustomOp *op) { (void)op; return "ImageAttentionBf16"; }
static int input_type(const CustomOp *op, size_t i) { (void)op, (void)i; return ELEM_FLOAT; }
static size_t three_inputs(const CustomOp *op) { (void)op; return 3; }

const CustomOp image_attention_bf16 = CUSTOM_OP(stateless_kernel, destroy_kernel, op_name, input_type, three_inputs,
                                                float_output, one_output, required, compute);
