/* The block linears' tiles in portable C: the sums every other build must equal.
 * Included once by block_linear.c, after its Job, QBLOCK and helpers; defines ROWS, XP_WORDS,
 * pack_inputs, tile and block_linear_kernel. */
#define ROWS 4
/* the weight of output c and input ``input`` in a tile's block of 4-bit weights, laid
 * out as block_linear.c says */
static inline int nibble_of(const uint8_t *block, int c, int input) {
  const int byte = block[64 * (input / 8) + 4 * c + input % 4];
  return input % 8 < 4 ? byte & 0x0F : byte >> 4;
}
/* float16 to float32, exactly (zero, subnormals, infinities, NaN included) */
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h >> 10 & 0x1F, man = h & 0x3FF;
  if (exp == 0) { /* zero or subnormal: man x 2^-24, exact in float32 */
    const float v = ldexpf((float)man, -24);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | man << 13;
  float v;
  memcpy(&v, &bits, 4);
  return v;
}
/* output c's zero point in a block's 8 bytes of them */
static inline int zero_of(const uint8_t *zeros, int c) { return zeros[c / 2] >> 4 * (c % 2) & 0x0F; }
#define XP_WORDS(four) ((void)(four), 0)
static void pack_inputs(const int8_t *q, int32_t *xp) { (void)q, (void)xp; } /* never called */
static void tile(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {
  const int four = j->zero != NULL;
  const uint8_t *w = (const uint8_t *)j->w + t * j->blocks * (four ? TILE_BLOCK : TILE8_BLOCK);
  const uint16_t *scale = j->scale + t * j->blocks * 16;
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < 16; c++) {
      float acc = 0.0f;
      for (int64_t b = 0; b < j->blocks; b++) {
        const int64_t at = row[r] * j->blocks + b;
        int32_t d = 0;
        for (int p = 0; p < QBLOCK; p++) {
          const uint32_t pair = j->wide ? (uint32_t)j->xp[at * (QBLOCK / 2) + p / 2] : 0;
          const int32_t x = j->wide ? (int16_t)(uint16_t)(p % 2 ? pair >> 16 : pair & 0xFFFF) : j->xq[at * QBLOCK + p];
          d += (four ? nibble_of(w + b * TILE_BLOCK, c, p)
                     : (int8_t)w[b * TILE8_BLOCK + (p / 2) * 32 + 2 * c + p % 2]) * x;
        }
        if (four) d -= (int32_t)zero_of(j->zero + (t * j->blocks + b) * 8, c) * j->xs[at];
        const float s = half_to_float(scale[b * 16 + c]) * j->sx[at];
        acc = acc + (float)d * s;
      }
      sums[16 * r + c] = acc;
    }
}
const char block_linear_kernel[] = "portable C";
