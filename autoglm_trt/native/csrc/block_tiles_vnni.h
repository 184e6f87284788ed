/* Int4WeightLinear's, Int8BlockLinear's and Int8WeightLinear's tiles with AVX-512 VNNI (vpdpbusd,
 * vpdpwssd).
 * Included once by block_linear.c, after its Job, QBLOCK and helpers; defines ROWS, XP_WORDS,
 * pack_inputs, tile and block_linear_kernel. */
/* a block's 16 float16 scales as float32 (vcvtph2ps, exact) */
static inline __m512 scales16(const uint16_t *s) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s)); }
/* vpdpbusd multiplies 4 unsigned bytes by 4 signed ones and adds the 4 products into a 32-bit
 * lane: one lane per output, no horizontal sums, and no overflow (at most 255 x 127 x 32 a block).
 * 4-bit weights: a vector's low plane (AND 0x0F) against inputs 8i..8i+3, its high plane left in
 * place (AND 0xF0, 16 times each weight) against 8i+4..8i+7 in a sum of its own that is shifted
 * right by 4 at the block's end, exactly (every product in it is a multiple of 16, and at most
 * 240 x 127 x 16 in size). 8-bit weights: two pairs' 64 bytes with their 16-bit words
 * interleaved make output c's lane of 4 inputs in order; they are signed, so they go in as
 * w + 128 (w xor 0x80) and 128 times the inputs' sum comes off. */
#define XP_WORDS(four) ((void)(four), 0)
static void pack_inputs(const int8_t *q, int32_t *xp) { (void)q, (void)xp; } /* never called */
/* one block's float terms added to each row's sums: (d - zero xs) * (scale * sx), in that order,
 * d the sum of the row's C chains of dot products */
static inline void add_block(const Job *j, int64_t b, const int64_t *row, int R, int C, __m512i zero, __m512 scale,
                             __m512i (*d)[2], __m512 *a) {
  for (int r = 0; r < R; r++) {
    const int64_t at = row[r] * j->blocks + b;
    const __m512i dot = C == 2 ? _mm512_add_epi32(d[r][0], d[r][1]) : d[r][0];
    /* zero x xs in one vpmaddwd: each lane's low word times xs (|xs| <= 32 x 127 fits 16 bits), high word 0 */
    const __m512i dz = _mm512_sub_epi32(dot, _mm512_madd_epi16(zero, _mm512_set1_epi32(j->xs[at])));
    a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(_mm512_cvtepi32_ps(dz), _mm512_mul_ps(scale, _mm512_set1_ps(j->sx[at]))));
  }
}
/* R rows (rows past ``rows`` repeat the first, not stored) x the 16 outputs of tile t into sums;
 * each row's products in C chains (C = 2: even and odd steps), so that enough dot products overlap */
#define ROWS_TILE(R, C)                                                                                             \
  static void tile4_##R(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {                      \
    __m512 a[R];                                                                                                   \
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();                                                        \
    const uint8_t *w = (const uint8_t *)j->w + t * j->blocks * TILE_BLOCK;                                        \
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);                               \
    for (int64_t b = 0; b < j->blocks; b++) {                                                                      \
      __m512i d[R][2], h[R][2];                                                                                    \
      for (int r = 0; r < R; r++) /* [r][1] unused at C = 1 */                                                    \
        d[r][0] = d[r][1] = h[r][0] = h[r][1] = _mm512_setzero_si512();                                            \
      for (int i = 0; i < 4; i++) {                                                                                \
        const __m512i v = _mm512_loadu_si512(w + b * TILE_BLOCK + 64 * i);                                         \
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(v, high);                               \
        for (int r = 0; r < R; r++) {                                                                              \
          const int8_t *x = j->xq + (row[r] * j->blocks + b) * QBLOCK + 8 * i;                                    \
          d[r][i % C] = _mm512_dpbusd_epi32(d[r][i % C], lo, _mm512_set1_epi32(quad(x)));                          \
          h[r][i % C] = _mm512_dpbusd_epi32(h[r][i % C], hi, _mm512_set1_epi32(quad(x + 4)));                      \
        }                                                                                                          \
      }                                                                                                            \
      for (int r = 0; r < R; r++)                                                                                  \
        for (int c = 0; c < C; c++) d[r][c] = _mm512_add_epi32(d[r][c], _mm512_srai_epi32(h[r][c], 4));           \
      add_block(j, b, row, R, C, _mm512_cvtepu8_epi32(zeros16(j->zero + (t * j->blocks + b) * 8)),                \
                scales16(j->scale + (t * j->blocks + b) * 16), d, a);                                             \
    }                                                                                                              \
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums + 16 * r, a[r]);                                          \
  }                                                                                                                \
  static void tile8_##R(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {                      \
    __m512 a[R];                                                                                                   \
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();                                                        \
    const int8_t *w = (const int8_t *)j->w + t * j->blocks * TILE8_BLOCK;                                          \
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,          \
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);               \
    const __m512i sign = _mm512_set1_epi8(-128);                                                                   \
    for (int64_t b = 0; b < j->blocks; b++) {                                                                      \
      __m512i d[R][2];                                                                                             \
      for (int r = 0; r < R; r++) d[r][0] = d[r][1] = _mm512_setzero_si512(); /* d[r][1] unused at C = 1 */      \
      for (int i = 0; i < 8; i++) {                                                                                \
        const __m512i v = _mm512_loadu_si512(w + b * TILE8_BLOCK + 64 * i);                                        \
        const __m512i q = _mm512_permutexvar_epi16(order, _mm512_xor_si512(v, sign));                              \
        for (int r = 0; r < R; r++)                                                                                \
          d[r][i % C] = _mm512_dpbusd_epi32(d[r][i % C], q, _mm512_set1_epi32(quad(j->xq + (row[r] * j->blocks + b) * QBLOCK + 4 * i))); \
      }                                                                                                            \
      add_block(j, b, row, R, C, _mm512_set1_epi32(128), scales16(j->scale + (t * j->blocks + b) * 16), d, a);     \
    }                                                                                                              \
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums + 16 * r, a[r]);                                          \
  }
/* 16-bit inputs: each pair of inputs' 32 bytes widened to 16 bits a weight is 16 outputs x 2
 * inputs, one vpdpwssd per broadcast pair */
#define WIDE_TILE(R, C)                                                                                             \
  static void tilew_##R(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {                      \
    __m512 a[R];                                                                                                   \
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();                                                        \
    const int8_t *w = (const int8_t *)j->w + t * j->blocks * TILE8_BLOCK;                                          \
    for (int64_t b = 0; b < j->blocks; b++) {                                                                      \
      __m512i d[R][2];                                                                                             \
      for (int r = 0; r < R; r++) d[r][0] = d[r][1] = _mm512_setzero_si512(); /* d[r][1] unused at C = 1 */      \
      for (int p = 0; p < QBLOCK / 2; p++) {                                                                       \
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + b * TILE8_BLOCK + 32 * p));                \
        const __m512i v = _mm512_cvtepi8_epi16(bytes);                                                             \
        for (int r = 0; r < R; r++) {                                                                              \
          const int32_t pair = j->xp[(row[r] * j->blocks + b) * (QBLOCK / 2) + p];                                 \
          d[r][p % C] = _mm512_dpwssd_epi32(d[r][p % C], v, _mm512_set1_epi32(pair));                              \
        }                                                                                                          \
      }                                                                                                            \
      const __m512 scale = scales16(j->scale + (t * j->blocks + b) * 16);                                          \
      for (int r = 0; r < R; r++) {                                                                                \
        const __m512i dot = C == 2 ? _mm512_add_epi32(d[r][0], d[r][1]) : d[r][0];                                 \
        const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(j->sx[row[r] * j->blocks + b]));                      \
        a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(_mm512_cvtepi32_ps(dot), s));                                     \
      }                                                                                                            \
    }                                                                                                              \
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums + 16 * r, a[r]);                                          \
  }
#define ROWS 8
ROWS_TILE(1, 2)
ROWS_TILE(4, 2)
ROWS_TILE(8, 1)
WIDE_TILE(1, 2)
WIDE_TILE(4, 2)
WIDE_TILE(8, 1)
static void tile(const Job *j, int64_t t, const int64_t *row, int rows, float *sums) {
  if (j->zero != NULL)
    (rows == 1 ? tile4_1 : rows <= 4 ? tile4_4 : tile4_8)(j, t, row, rows, sums);
  else if (j->wide)
    (rows == 1 ? tilew_1 : rows <= 4 ? tilew_4 : tilew_8)(j, t, row, rows, sums);
  else
    (rows == 1 ? tile8_1 : rows <= 4 ? tile8_4 : tile8_8)(j, t, row, rows, sums);
}
const char block_linear_kernel[] = "avx512-vnni";
