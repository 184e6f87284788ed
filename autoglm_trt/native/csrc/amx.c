/* Intel AMX for Int8Linear's batches (a prefill, a decode step of many sequences): the same
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

int amx_ready(void) {
  static atomic_int state; /* 0: not asked yet, 1: ready, 2: not here */
  int s = atomic_load_explicit(&state, memory_order_acquire);
  if (s == 0) {
    const char *env = getenv("AUTOGLM_TRT_AMX");
    __builtin_cpu_init();
    const int wanted = env == NULL || strcmp(env, "0") != 0;
    s = wanted && __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-tile") &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
            ? 1
            : 2;
    atomic_store_explicit(&state, s, memory_order_release);
  }
  return s == 1;
}

/* tiles 0-1: C of two groups of 16 rows; 2-3: their A; 4: B. One tile configuration for all
 * the rows: loading it is not free. */
__attribute__((target("amx-tile,amx-int8"))) void amx_int8_sums(const uint8_t *x, int64_t stride, int64_t rows,
                                                                 const int8_t *w, int64_t kp, int32_t *sums) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 5; i++) c.rows[i] = 16, c.colsb[i] = 64;
  _tile_loadconfig(&c);
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
#else
int amx_ready(void) { return 0; }

void amx_int8_sums(const uint8_t *x, int64_t stride, int64_t rows, const int8_t *w, int64_t kp, int32_t *sums) {
  (void)x, (void)stride, (void)rows, (void)w, (void)kp, (void)sums;
  abort(); /* never called: amx_ready() is 0 */
}
#endif
