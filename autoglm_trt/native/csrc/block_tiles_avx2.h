/* The block linears' tiles with AVX2 and F16C (vpmaddubsw, vpmaddwd), for every x86-64 build
 * without VNNI.
 * Included once by block_linear.c, after its Job, QBLOCK and helpers; defines ROWS, XP_WORDS,
 * pack_inputs, tile and block_linear_kernel. */
#define ROWS 4
/* 8 float16 scales as float32 (F16C's vcvtph2ps, exact) */
static inline __m256 scales8(const uint16_t *s) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)); }
/* 8-bit weights: each pair of quantized inputs widened to two int16 (vpmaddwd's operand) */
#define XP_WORDS(four) ((four) ? 0 : QBLOCK / 2)
static void pack_inputs(const int8_t *q, int32_t *xp) { /* for 8-bit weights (XP_WORDS) */
  for (int p = 0; p < QBLOCK / 2; p++)
    xp[p] = (int32_t)((uint32_t)(uint16_t)(int16_t)q[2 * p] | (uint32_t)(uint16_t)(int16_t)q[2 * p + 1] << 16);
}
/* R rows (rows past ``rows`` repeat the first, not stored) x the 16 outputs of tile t into sums,
 * 8 outputs (half of each 64-byte vector) at a time. vpmaddubsw puts a pair of products in each
 * 16-bit lane, two lanes an output: a block's 8 such pairs a lane (each at most 15 x 127 x 2 =
 * 3810 in size) summed in 16 bits cannot overflow (30480), and one vpmaddwd by 1s adds each
 * output's two lanes into 32 bits; no horizontal sums. */
#define ROWS_TILE(R)                                                                                               \
  static void tile4_##R(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {                      \
    __m256 a[R][2];                                                                                                \
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();                                           \
    const uint8_t *w = (const uint8_t *)j->w + t * j->blocks * TILE_BLOCK;                                        \
    const uint8_t *zero = j->zero + t * j->blocks * 8;                                                             \
    const uint16_t *scale = j->scale + t * j->blocks * 16;                                                         \
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);                                      \
    for (int64_t b = 0; b < j->blocks; b++) {                                                                      \
      const int8_t *x[R];                                                                                          \
      for (int r = 0; r < R; r++) x[r] = j->xq + (row[r] * j->blocks + b) * QBLOCK;                                \
      const __m128i zb = zeros16(zero + b * 8);                                                                    \
      for (int h = 0; h < 2; h++) {                                                                                \
        __m256i s[R];                                                                                              \
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();                                                 \
        for (int i = 0; i < 4; i++) {                                                                              \
          const __m256i c = _mm256_loadu_si256((const __m256i *)(w + b * TILE_BLOCK + 64 * i + 32 * h));          \
          const __m256i lo = _mm256_and_si256(c, low), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);       \
          for (int r = 0; r < R; r++) {                                                                            \
            s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad(x[r] + 8 * i))));        \
            s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad(x[r] + 8 * i + 4))));    \
          }                                                                                                        \
        }                                                                                                          \
        const __m256i z = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(zb, 8) : zb);                                    \
        const __m256 sc = scales8(scale + b * 16 + 8 * h);                                                         \
        for (int r = 0; r < R; r++) {                                                                              \
          const int64_t at = row[r] * j->blocks + b;                                                               \
          const __m256i dz = _mm256_sub_epi32(_mm256_madd_epi16(s[r], ones), _mm256_mullo_epi32(z, _mm256_set1_epi32(j->xs[at]))); \
          a[r][h] = _mm256_add_ps(a[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(dz), _mm256_mul_ps(sc, _mm256_set1_ps(j->sx[at])))); \
        }                                                                                                          \
      }                                                                                                            \
    }                                                                                                              \
    for (int r = 0; r < rows; r++)                                                                                 \
      for (int h = 0; h < 2; h++) _mm256_storeu_ps(sums + 16 * r + 8 * h, a[r][h]);                                \
  }
ROWS_TILE(1)
ROWS_TILE(4)
/* the same for 8-bit weights: each pair of inputs' 16 outputs widened to 16 bits, two vpmaddwd
 * of 8 outputs each, summed in 32 bits; the inputs are int16 pairs, of int8 values or 16-bit ones */
#define ROWS_TILE8(R)                                                                                              \
  static void tile8_##R(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {                      \
    __m256 a[R][2];                                                                                                \
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();                                           \
    const int8_t *w = (const int8_t *)j->w + t * j->blocks * TILE8_BLOCK;                                          \
    const uint16_t *scale = j->scale + t * j->blocks * 16;                                                         \
    for (int64_t b = 0; b < j->blocks; b++) {                                                                      \
      const int32_t *x[R];                                                                                         \
      __m256i d[R][2];                                                                                             \
      for (int r = 0; r < R; r++) {                                                                                \
        x[r] = j->xp + (row[r] * j->blocks + b) * (QBLOCK / 2);                                                    \
        d[r][0] = d[r][1] = _mm256_setzero_si256();                                                                \
      }                                                                                                            \
      for (int p = 0; p < QBLOCK / 2; p++) {                                                                       \
        const __m128i *src = (const __m128i *)(w + b * TILE8_BLOCK + p * 32);                                     \
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(src)), hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(src + 1)); \
        for (int r = 0; r < R; r++) {                                                                              \
          const __m256i xp = _mm256_set1_epi32(x[r][p]);                                                           \
          d[r][0] = _mm256_add_epi32(d[r][0], _mm256_madd_epi16(lo, xp));                                          \
          d[r][1] = _mm256_add_epi32(d[r][1], _mm256_madd_epi16(hi, xp));                                          \
        }                                                                                                          \
      }                                                                                                            \
      for (int h = 0; h < 2; h++) {                                                                                \
        const __m256 s = scales8(scale + b * 16 + 8 * h);                                                          \
        for (int r = 0; r < R; r++)                                                                                \
          a[r][h] = _mm256_add_ps(a[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(d[r][h]),                              \
                                                         _mm256_mul_ps(s, _mm256_set1_ps(j->sx[row[r] * j->blocks + b])))); \
      }                                                                                                            \
    }                                                                                                              \
    for (int r = 0; r < rows; r++)                                                                                 \
      for (int h = 0; h < 2; h++) _mm256_storeu_ps(sums + 16 * r + 8 * h, a[r][h]);                                \
  }
ROWS_TILE8(1)
ROWS_TILE8(4)
static void tile(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {
  if (j->zero != NULL)
    (rows == 1 ? tile4_1 : tile4_4)(j, t, row, rows, sums);
  else
    (rows == 1 ? tile8_1 : tile8_4)(j, t, row, rows, sums);
}
const char block_linear_kernel[] = "avx2";
