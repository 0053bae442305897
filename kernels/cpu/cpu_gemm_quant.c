/* Projections of decode-sized steps through 4-bit and 8-bit weights, dequantized in registers:
 * y = x . W^T (+ bias), W the kernels' quantized layout (kernels/quant_weight.py: 32-weight runs
 * of packed nibbles or int8 values, a float32 scale and an optional float32 offset per group).
 *
 * Why: a decode step streams every weight once per step, so its time is the bytes it reads. The
 * bundled model's Q4_1 file holds 0.6 bytes a weight; dequantized to float32 at start it streamed
 * 4 bytes a weight (bf16: 2). Here the packed bytes are read and widened to int16 words in
 * registers only. Converting each weight to float (a widen, a convert and an FMA per 8 weights
 * on AVX2) was no faster in an ad-hoc timing and keeps more work per weight, so the arithmetic
 * is integer instead: each run of 32 activations is rounded to int16 with a scale (its largest
 * magnitude maps to 32767), a run's dot product is one or two vpmaddwd, and its int32 sum is scaled into the float
 * accumulator by the activations' scale times the group's weight scale; an asymmetric format's
 * offsets add offset x (the group's float sum of x) once per group. The rounding of x costs at
 * most half an int16 step of its run's largest value per product: ~100x finer than bf16
 * activations, coarser than float32 (tests/kernels/test_cpu_gemm_quant.py bounds it).
 *
 * Shape of the work: columns (weight rows) are split between threads in tiles of NR; a tile's
 * NR weight rows are adjacent in memory (one contiguous stream). A micro-tile of MR rows by NR
 * columns keeps MR x NR = LANES vector accumulators (one transpose-and-add, cpu_math.h's reduce8
 * or reduce16, ends it); each run of 32 weights is widened once per micro-tile and used by its
 * MR rows: 4 x LANES/4 while four rows are left, then 2 x LANES/2 and 1 x LANES for the rest
 * (the tiles of a block of LANES columns). Past the kernel policy's quant_gemm_max_rows (8),
 * dequantizing the weight once per call (kvfleet_dequantize, the float form) into the float32
 * GEMM is faster.
 *
 * One source for AVX-512 (16 lanes) and AVX2 + FMA (8 lanes); the widening and the word dot are
 * the only instruction-set-specific parts.
 *
 * Layouts: x [m, k] float32 with row stride x_stride; W as described, [n, k]; bias [n] or NULL;
 * out [m, n] with row stride out_stride. k a multiple of the group size, itself a multiple of 32.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_entry_points.h"
#include "cpu_math.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_SIMD = 3, ERR_FORMAT = 5 };

#define RUN 32 /* weights per unpacking step: 16 packed int4 bytes, 32 int8 values */

#if defined(__AVX512F__)
#define QGEMM_SIMD 1
#define LANES 16
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vloadu(p) _mm512_loadu_ps(p)
#define vstoreu(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define reduce_lanes reduce16
/* A run of 32 int4 weights (16 bytes at p) as two vectors of floats 0..15: the low nibbles are
 * weights 0..15, the high ones 16..31. */
static inline void unpack_int4(const uint8_t *p, vec out[RUN / LANES]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    out[1] = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}
static inline void unpack_int8(const uint8_t *p, vec out[RUN / LANES]) {
    for (int v = 0; v < RUN / LANES; v++)
        out[v] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + v * LANES))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define QGEMM_SIMD 1
#define LANES 8
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vloadu(p) _mm256_loadu_ps(p)
#define vstoreu(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define reduce_lanes reduce8
static inline void unpack_int4(const uint8_t *p, vec out[RUN / LANES]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
}
static inline void unpack_int8(const uint8_t *p, vec out[RUN / LANES]) {
    for (int v = 0; v < RUN / LANES; v++)
        out[v] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + v * LANES))));
}
#else
#define QGEMM_SIMD 0
#endif

#if QGEMM_SIMD
#if LANES == 16
/* A run's 32 weights as int16 words in weight order (one vector), and its dot with the run's
 * 32 int16 activations: 16 int32 lanes of pair sums. */
typedef __m512i wvec;
#define INT4_X_ORDER(i) (i)
static inline wvec words_int4(const uint8_t *p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(high, low));
}
static inline wvec words_int8(const uint8_t *p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline vec run_dot(wvec w, const int16_t *x) {
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x)));
}
#else
/* AVX2: a run's words as two vectors. int4 widens each 128-bit lane in place (cheaper than a
 * cross-lane widen): lo holds weights 0..7 and 16..23, hi 8..15 and 24..31, and the run's
 * int16 activations are stored in that order (INT4_X_ORDER) so that pair sums meet their
 * weights. int8 is widened across lanes (lo 0..15, hi 16..31): a load-and-widen is cheaper
 * there than the in-lane form. */
typedef struct { __m256i lo, hi; } wvec;
#define INT4_X_ORDER(i) (((i) & 7) | ((i) & 8) << 1 | ((i) & 16) >> 1)
static inline wvec words_int4(const uint8_t *p) {
    /* Both lanes hold the 16 bytes; the upper lane's shift by 4 leaves the high nibbles. */
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i shift = _mm256_set_epi64x(4, 4, 0, 0), mask = _mm256_set1_epi8(0x0F);
    const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi64(bytes, shift), mask);
    const __m256i zero = _mm256_setzero_si256();
    return (wvec){_mm256_unpacklo_epi8(nibbles, zero), _mm256_unpackhi_epi8(nibbles, zero)};
}
static inline wvec words_int8(const uint8_t *p) {
    return (wvec){_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline vec run_dot(wvec w, const int16_t *x) {
    const __m256i a = _mm256_madd_epi16(w.lo, _mm256_loadu_si256((const __m256i *)x));
    const __m256i b = _mm256_madd_epi16(w.hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}
#endif

/* The rows of x as the integer dot products read them: per run of 32 values, int16 values
 * x / scale rounded to nearest (scale = the run's largest magnitude / 32767, so the largest
 * maps to +-32767) in the order the weights' words take (INT4_X_ORDER for int4), the scale,
 * and per group the float sum of x (for the offsets' term). */
typedef struct {
    int16_t *q;        /* [m, k] */
    float *scale;      /* [m, k / RUN] */
    float *group_sum;  /* [m, k / group] */
} Rows16;

static void quantize_run(const float *x, int16_t *q, float *scale, float *sum, int int4) {
    float amax = 0.0f, total = 0.0f;
    for (int i = 0; i < RUN; i++) {
        const float a = x[i] < 0 ? -x[i] : x[i];
        amax = a > amax ? a : amax;
        total += x[i];
    }
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int i = 0; i < RUN; i++)
        q[int4 ? INT4_X_ORDER(i) : i] = (int16_t)__builtin_lrintf(x[i] * inv);
    *scale = amax / 32767.0f;
    *sum = total;
}

/* One micro-tile: MR rows (indices rows[]) against NR = LANES / MR weight rows cols[]. Sums
 * come back in lane i * NR + j for row i, column j. Per run the weights become int16 words once
 * and serve the tile's MR rows: one multiply-add of words per 16 (AVX2) or 32 (AVX-512)
 * weights, its int32 sums scaled into float by the activations' and the group's scales. A
 * macro per (format, MR) so that the accumulators are registers. */
#define QUANT_TILE(FMT, MR, BYTES_PER_RUN)                                                     \
    static vec tile_##FMT##_##MR(const Rows16 *x, const int64_t *rows, const QuantWeight *w, \
                                 const int64_t *cols, int64_t k) {                            \
        enum { NR = LANES / (MR) };                                                            \
        const int64_t runs = k / RUN, groups = k / w->group, runs_per_group = w->group / RUN;  \
        const int64_t row_bytes = runs * (BYTES_PER_RUN);                                     \
        vec acc[LANES];                                                                        \
        _Pragma("GCC unroll 16") for (int t = 0; t < LANES; t++) acc[t] = vzero();             \
        for (int64_t r = 0; r < runs; r++) {                                                   \
            const int64_t g = r / runs_per_group;                                              \
            _Pragma("GCC unroll 16") for (int j = 0; j < NR; j++) {                            \
                const wvec wv = words_##FMT(w->q + cols[j] * row_bytes + r * (BYTES_PER_RUN)); \
                const float ws = w->scales[cols[j] * groups + g];                              \
                _Pragma("GCC unroll 4") for (int i = 0; i < (MR); i++) {                       \
                    const int64_t row = rows[i];                                               \
                    const vec dot = run_dot(wv, x->q + row * k + r * RUN);                     \
                    acc[i * NR + j] =                                                          \
                        vfma(dot, vset1(ws * x->scale[row * runs + r]), acc[i * NR + j]);      \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        return reduce_lanes(acc);                                                              \
    }

QUANT_TILE(int4, 1, 16)
QUANT_TILE(int4, 2, 16)
QUANT_TILE(int4, 4, 16)
QUANT_TILE(int8, 1, 32)
QUANT_TILE(int8, 2, 32)
QUANT_TILE(int8, 4, 32)

typedef vec (*tile_fn)(const Rows16 *, const int64_t *, const QuantWeight *, const int64_t *,
                       int64_t);

/* The micro-tile's rows for the `left` rows not yet done: more rows share each unpacked run,
 * and a step's last rows take a smaller tile rather than padding one (5 rows are 4 + 1, not
 * 4 + 4: a verify step of speculative decoding is such a step). */
static inline int rows_per_tile(int64_t left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }

static tile_fn pick_tile(int format, int mr) {
    if (format == QUANT_INT4) return mr == 1 ? tile_int4_1 : mr == 2 ? tile_int4_2 : tile_int4_4;
    return mr == 1 ? tile_int8_1 : mr == 2 ? tile_int8_2 : tile_int8_4;
}

/* Row `row`'s offset term for column `col`: sum over groups of offset * the group's x sum. */
static inline float offset_term(const QuantWeight *w, const Rows16 *x, int64_t row, int64_t col,
                                int64_t groups) {
    float total = 0.0f;
    const float *o = w->offsets + col * groups, *s = x->group_sum + row * groups;
    for (int64_t g = 0; g < groups; g++) total += o[g] * s[g];
    return total;
}
/* Rows m0 .. m0 + mr - 1 of out, columns n0 .. n0 + LANES / mr - 1 (those below n): one
 * micro-tile, its bias and its offsets' term. */
static void quant_tile(const Rows16 *x, const QuantWeight *w, const float *bias, float *out,
                       int64_t out_stride, int64_t m0, int mr, int64_t n0, int64_t n, int64_t k) {
    const int nr = LANES / mr;
    int64_t rows[4], cols[LANES];
    for (int i = 0; i < mr; i++) rows[i] = m0 + i;
    for (int j = 0; j < nr; j++) cols[j] = n0 + j < n ? n0 + j : n - 1;
    float sums[LANES];
    vstoreu(sums, pick_tile(w->format, mr)(x, rows, w, cols, k));
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr && n0 + j < n; j++) {
            float y = sums[i * nr + j] + (bias ? bias[n0 + j] : 0.0f);
            if (w->offsets) y += offset_term(w, x, m0 + i, n0 + j, k / w->group);
            out[(m0 + i) * out_stride + n0 + j] = y;
        }
}
#endif

/* Whether w and k describe a weight this kernel reads. */
static int valid(const QuantWeight *w, int64_t n, int64_t k) {
    return w && w->q && w->scales && n >= 1 && k >= 1 && w->group >= RUN &&
           w->group % RUN == 0 && k % w->group == 0 &&
           (w->format == QUANT_INT4 || (w->format == QUANT_INT8 && !w->offsets));
}

int kvfleet_linear_quant(const float *x, int64_t x_stride, const QuantWeight *w,
                         const float *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                         int64_t k, int num_threads) {
#if !QGEMM_SIMD
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)m, (void)n;
    (void)k, (void)num_threads;
    return ERR_NO_SIMD;
#else
    if (m < 1 || x_stride < k || out_stride < n) return ERR_SHAPE;
    if (!valid(w, n, k)) return ERR_FORMAT;
    const int64_t runs = k / RUN, groups = k / w->group, runs_per_group = w->group / RUN;
    char *buffer = malloc((size_t)m * (k * sizeof(int16_t) + (runs + groups) * sizeof(float)));
    if (!buffer) return ERR_NOMEM;
    Rows16 rows16 = {(int16_t *)buffer, NULL, NULL};
    rows16.scale = (float *)(rows16.q + m * k);
    rows16.group_sum = rows16.scale + m * runs;
    const int team = num_threads < 1 ? 1 : num_threads;
    /* A block of LANES columns (weight rows) per thread step; each pass of rows over it unpacks
     * the block's weights once (they stay in L1 between passes). */
    const int64_t col_blocks = (n + LANES - 1) / LANES;
#pragma omp parallel num_threads(team)
    {
        /* A few dozen runs a row: one thread's work unless the step is large. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            for (int64_t g = 0; g < groups; g++) {
                float sum = 0.0f;
                for (int64_t r = g * runs_per_group; r < (g + 1) * runs_per_group; r++) {
                    float run_sum;
                    quantize_run(x + i * x_stride + r * RUN, rows16.q + i * k + r * RUN,
                                 &rows16.scale[i * runs + r], &run_sum, w->format == QUANT_INT4);
                    sum += run_sum;
                }
                rows16.group_sum[i * groups + g] = sum;
            }
        }
#pragma omp for schedule(static)
        for (int64_t cb = 0; cb < col_blocks; cb++) {
            const int64_t lo = cb * LANES, hi = lo + LANES < n ? lo + LANES : n, m4 = m / 4 * 4;
            /* Four-row passes a few columns at a time (each column's runs stay in L1 from pass
             * to pass), then the last rows over the whole block. */
            for (int64_t n0 = lo; n0 < hi && m4; n0 += LANES / 4)
                for (int64_t m0 = 0; m0 < m4; m0 += 4)
                    quant_tile(&rows16, w, bias, out, out_stride, m0, 4, n0, n, k);
            for (int64_t m0 = m4; m0 < m; m0 += rows_per_tile(m - m0))
                for (int64_t n0 = lo; n0 < hi; n0 += LANES / rows_per_tile(m - m0))
                    quant_tile(&rows16, w, bias, out, out_stride, m0, rows_per_tile(m - m0), n0,
                               n, k);
        }
    }
    free(buffer);
    return OK;
#endif
}

/* The float32 [n, k] weight w stands for, row by row into out (for steps too large for the
 * kernel above: their GEMM then runs on the float paths). The same FMA as the GEMM's, so the
 * same values as kernels/quant_weight.dequantize. */
int kvfleet_dequantize(const QuantWeight *w, float *out, int64_t n, int64_t k, int num_threads) {
#if !QGEMM_SIMD
    (void)w, (void)out, (void)n, (void)k, (void)num_threads;
    return ERR_NO_SIMD;
#else
    if (!valid(w, n, k)) return ERR_FORMAT;
    const int64_t groups = k / w->group, runs_per_group = w->group / RUN;
    const int64_t run_bytes = w->format == QUANT_INT4 ? 16 : 32, row_bytes = k / RUN * run_bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t row = 0; row < n; row++) {
        for (int64_t g = 0; g < groups; g++) {
            const vec scale = vset1(w->scales[row * groups + g]);
            const vec offset = w->offsets ? vset1(w->offsets[row * groups + g]) : vzero();
            for (int64_t r = 0; r < runs_per_group; r++) {
                const int64_t run = g * runs_per_group + r;
                const uint8_t *p = w->q + row * row_bytes + run * run_bytes;
                vec q[RUN / LANES];
                if (w->format == QUANT_INT4)
                    unpack_int4(p, q);
                else
                    unpack_int8(p, q);
                for (int v = 0; v < RUN / LANES; v++)
                    vstoreu(out + row * k + run * RUN + v * LANES, vfma(q[v], scale, offset));
            }
        }
    }
    return OK;
#endif
}
