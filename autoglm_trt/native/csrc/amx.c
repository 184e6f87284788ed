/* Intel AMX for Int8Linear's batches (a prefill, a decode step of many sequences), and for
 * PrefillAttentionBf16's products (below).
 *
 * Int8Linear: the same
 * integer sums as the AVX-512 VNNI tile (unsigned 8-bit inputs times signed 8-bit weights, added
 * exactly into 32 bits), 16 rows x 16 columns x 64 inputs an instruction instead of 1 x 16 x 4.
 *
 * The weights' packed layout ([N16, K4, 16, 4], int8_linear.c) is already AMX's: for one tile of
 * 16 columns, 16 consecutive groups of 4 inputs are one 16 x 64-byte B tile. The quantized inputs
 * are rows of ``kp`` bytes, of which 16 rows x 64 bytes are one A tile. So a tile's product needs
 * no repacking: C (16 x 16 int32) += A B per 64 inputs.
 *
 * Compiled into the AVX-512 VNNI build with the AMX instructions enabled for these functions
 * alone, and used only where the CPU has them and Linux grants this process the tile data state
 * (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, asked once); ``AUTOGLM_TRT_AMX=0`` turns it off. */
#define _GNU_SOURCE /* syscall */
#include "amx.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct { /* LDTILECFG's 64-byte operand, palette 1 */
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

/* CPUID leaf 7's EDX bit ``bit`` (22: AMX-BF16, 24: AMX-TILE, 25: AMX-INT8), as the CPU reports it:
 * what ``__builtin_cpu_supports`` reads, for compilers that do not know these names (Clang 14) */
static int leaf7_edx(int bit) {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> bit & 1u);
}

int amx_ready(void) {
  static atomic_int state; /* 0: not asked yet, 1: ready, 2: not here */
  int s = atomic_load_explicit(&state, memory_order_acquire);
  if (s == 0) {
    const char *env = getenv("AUTOGLM_TRT_AMX");
    const int wanted = env == NULL || strcmp(env, "0") != 0;
    s = wanted && leaf7_edx(25) && leaf7_edx(24) &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
            ? 1
            : 2;
    atomic_store_explicit(&state, s, memory_order_release);
  }
  return s == 1;
}

int amx_bf16_ready(void) {
  static atomic_int state; /* 0: not asked yet, 1: ready, 2: not here */
  int s = atomic_load_explicit(&state, memory_order_acquire);
  if (s == 0) {
    s = amx_ready() && leaf7_edx(22) ? 1 : 2;
    atomic_store_explicit(&state, s, memory_order_release);
  }
  return s == 1;
}

/* tiles 0-1: C of two groups of 16 rows; 2-3: their A; 4: B. One tile configuration for all
 * the rows: loading it is not free. */
static const TileConfig INT8_TILES = {1, 0, {0}, {64, 64, 64, 64, 64}, {16, 16, 16, 16, 16}};
__attribute__((target("amx-tile,amx-int8"))) void amx_int8_sums(const uint8_t *x, int64_t stride, int64_t rows,
                                                                 const int8_t *w, int64_t kp, int32_t *sums) {
  _tile_loadconfig(&INT8_TILES);
  int64_t r = 0;
  for (; r + 32 <= rows; r += 32) {
    const uint8_t *x1 = x + r * stride, *x2 = x1 + 16 * stride;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < kp; k += 64) {
      _tile_loadd(4, w + 16 * k, 64);
      _tile_loadd(2, x1 + k, stride);
      _tile_loadd(3, x2 + k, stride);
      _tile_dpbusd(0, 2, 4);
      _tile_dpbusd(1, 3, 4);
    }
    _tile_stored(0, sums + 16 * r, 64);
    _tile_stored(1, sums + 16 * (r + 16), 64);
  }
  if (r < rows) { /* 16 left */
    _tile_zero(0);
    for (int64_t k = 0; k < kp; k += 64) {
      _tile_loadd(4, w + 16 * k, 64);
      _tile_loadd(2, x + r * stride + k, stride);
      _tile_dpbusd(0, 2, 4);
    }
    _tile_stored(0, sums + 16 * r, 64);
  }
  _tile_release();
}

/* 16 floats to bfloat16, rounded to nearest even (finite inputs) */
static inline __m256i bf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* tiles 1-3: A and B operands; 4-7: four 16 x 16 float sums. All 16 rows of 64 bytes. Like
 * INT8_TILES a constant in memory: GCC 12 dropped the stores of such a configuration built on the
 * stack before the load. */
static const TileConfig BF16_TILES = {1, 0, {0}, {0, 64, 64, 64, 64, 64, 64, 64}, {0, 16, 16, 16, 16, 16, 16, 16}};
__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_begin(void) { _tile_loadconfig(&BF16_TILES); }
__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_end(void) { _tile_release(); }

/* Two groups of 16 rows share each B tile (a step's keys or values, read from the second-level
 * cache): sums 4 and 6 are two 16-column tiles of rows r0, 5 and 7 the same of rows r0 + 16; A
 * tiles 1 (rows r0) and 3 (r0 + 16), B tile 2. A lone group of 16 rows (rows an odd multiple of
 * 16) runs with its second A tile a copy of its first, not stored. Sharing halves the B tiles
 * loaded from the second-level cache, which bound this kernel (docs/native.md). */
#define PAIR_OF_TILES(b0, b1, stride)                                                                          \
  do {                                                                                                          \
    _tile_loadd(2, b0, stride);                                                                                 \
    _tile_dpbf16ps(4, 1, 2);                                                                                    \
    _tile_dpbf16ps(5, 3, 2);                                                                                    \
    _tile_loadd(2, b1, stride);                                                                                 \
    _tile_dpbf16ps(6, 1, 2);                                                                                    \
    _tile_dpbf16ps(7, 3, 2);                                                                                    \
  } while (0)

/* sums 4-7 into out (rows r0 and r0 + 16 as above, 32 columns from column c) */
__attribute__((target("amx-tile,amx-bf16"))) static void store_pair(float *out, int64_t stride, int lone) {
  _tile_stored(4, out, stride * 4);
  _tile_stored(6, out + 16, stride * 4);
  if (!lone) {
    _tile_stored(5, out + 16 * stride, stride * 4);
    _tile_stored(7, out + 16 * stride + 16, stride * 4);
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_scores(const uint16_t *qb, int rows, const uint16_t *kb,
                                                                   int64_t d, float *s) {
  for (int r0 = 0; r0 < rows; r0 += 32) {
    const int lone = rows - r0 == 16, second = lone ? r0 : r0 + 16;
    for (int c = 0; c < AMX_KEYS; c += 32) { /* keys c .. c + 31: 16 keys are 32 bfloat16 of kb's rows */
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t i = 0; i < d; i += 32) {
        const uint16_t *k = kb + i / 2 * AMX_KEYS * 2 + 2 * c; /* pairs i / 2 ..: 16 rows of AMX_KEYS x 2 */
        _tile_loadd(1, qb + r0 * d + i, d * 2);
        _tile_loadd(3, qb + second * d + i, d * 2);
        PAIR_OF_TILES(k, k + 32, AMX_KEYS * 4);
      }
      store_pair(s + r0 * AMX_KEYS + c, AMX_KEYS, lone);
    }
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_weigh(float *o, int rows, const float *p, const uint16_t *vb,
                                                                  int64_t d, uint16_t *pb) {
  float sums[32][32];
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < AMX_KEYS; c += 16)
      _mm256_storeu_si256((__m256i *)(pb + r * AMX_KEYS + c), bf16x16(_mm512_loadu_ps(p + r * AMX_KEYS + c)));
  for (int r0 = 0; r0 < rows; r0 += 32) {
    const int lone = rows - r0 == 16, second = lone ? r0 : r0 + 16, count = lone ? 16 : 32;
    for (int64_t i = 0; i < d; i += 32) { /* dimensions i .. i + 31 */
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int half = 0; half < 2; half++) { /* keys 32 half .. 32 half + 31 */
        const uint16_t *v = vb + half * 16 * d * 2 + i * 2;
        _tile_loadd(1, pb + r0 * AMX_KEYS + 32 * half, AMX_KEYS * 2);
        _tile_loadd(3, pb + second * AMX_KEYS + 32 * half, AMX_KEYS * 2);
        PAIR_OF_TILES(v, v + 32, d * 4);
      }
      store_pair(sums[0], 32, lone);
      for (int r = 0; r < count; r++)
        for (int c = 0; c < 32; c += 16) {
          float *to = o + (r0 + r) * d + i + c;
          _mm512_storeu_ps(to, _mm512_add_ps(_mm512_loadu_ps(to), _mm512_loadu_ps(sums[r] + c)));
        }
    }
  }
}
#else
int amx_ready(void) { return 0; }
int amx_bf16_ready(void) { return 0; }
void amx_bf16_begin(void) { abort(); } /* never called: amx_bf16_ready() is 0 */
void amx_bf16_end(void) { abort(); }
void amx_bf16_scores(const uint16_t *qb, int rows, const uint16_t *kb, int64_t d, float *s) {
  (void)qb, (void)rows, (void)kb, (void)d, (void)s;
  abort();
}
void amx_bf16_weigh(float *o, int rows, const float *p, const uint16_t *vb, int64_t d, uint16_t *pb) {
  (void)o, (void)rows, (void)p, (void)vb, (void)d, (void)pb;
  abort();
}

void amx_int8_sums(const uint8_t *x, int64_t stride, int64_t rows, const int8_t *w, int64_t kp, int32_t *sums) {
  (void)x, (void)stride, (void)rows, (void)w, (void)kp, (void)sums;
  abort(); /* never called: amx_ready() is 0 */
}
#endif
