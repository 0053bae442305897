/* Projections through 4-bit and 8-bit weights, dequantized in registers: y = x . W^T (+ bias), W
 * in the CPU's column-blocked form of the kernels' quantized layout (kernels/quant_weight.py:
 * `to_blocked` repacks each weight once, at load), any number of rows x.
 *
 * Why: a decode step streams every weight once per step, so its time is the bytes it reads. The
 * bundled model's Q4_1 file holds 0.6 bytes a weight; dequantized to float32 at start it streamed
 * 4 bytes a weight (bf16: 2). Here the packed bytes are read and widened to int16 words in
 * registers only, and the arithmetic is integer: each run of 32 activations is rounded to int16
 * with a scale (its largest magnitude maps to 32767), a run's 32 products are summed in int32
 * (at most 32 x 32767 x 128 in magnitude), and those sums are scaled into the float
 * accumulators by the activations' scale times the group's weight scale; an asymmetric
 * format's offsets add offset x (the group's float sum of x) once per group. The rounding of x
 * costs at most half an int16 step of its run's largest value per product: ~100x finer than
 * bf16 activations, coarser than float32 (tests/kernels/test_cpu_gemm_quant.py bounds it).
 *
 * Why blocks of columns: a vector holds BLOCK columns' weights for two consecutive k (one int32
 * lane per column, two int16 words in it), so one vpdpwssd (AVX-512 VNNI; vpmaddwd + vpaddd
 * elsewhere) adds 2 x BLOCK products into per-column int32 sums: a run of 32 k is 16 of them per
 * row, then one convert and one FMA for all BLOCK columns, whose sums are already in the lanes of
 * their outputs. With one column's run per vector instead, every run ended in a convert and an
 * FMA per column and every tile in a transpose: 2-3x the time of this form at 1-64 rows on a
 * Zen 4, 1.1-1.5x with AVX2 (all but 2 rows).
 *
 * The layout, per block of BLOCK columns (the last one padded with zero weights and scales) and
 * per run of 32 k:
 * - int4, 16 x BLOCK bytes: four loads of 4 x BLOCK bytes. In load i, the byte at
 *   (c / 4) * 16 + 2 * (c % 4) + e + 8 h is the row layout's byte j = 4i + 2h + e of column c
 *   (its low nibble weight k = j, its high one k = j + 16). Masking the nibbles and unpacking
 *   bytes to words within each 128-bit lane (h = 0: unpacklo, 1: unpackhi) gives the words of k
 *   pair 2i + h (low nibbles) and 2i + h + 8 (high ones), column c in int32 lane c.
 * - int8, 32 x BLOCK bytes: pair p (k = 2p, 2p + 1) at 2 x BLOCK p, column c's two values at
 *   2c and 2c + 1; one sign-extending load makes its words.
 * - Scales and offsets [blocks, groups, BLOCK]: a group's BLOCK values are one vector.
 *
 * One source for AVX-512 (BLOCK 16) and AVX2 + FMA (BLOCK 8): the vector type is the parameter.
 * Past the kernel policy's row limit (cpu_gemm_quant.max_rows), kvfleet_dequantize's float
 * weight into the float32 GEMM is faster (AVX2 past 8 rows).
 *
 * Layouts: x [m, k] float32 with row stride x_stride; out [m, n] with row stride out_stride;
 * bias [n] or NULL. k a multiple of the group size, itself a multiple of 32.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_entry_points.h"
#include "cpu_math.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_SIMD = 3, ERR_FORMAT = 5 };

/* Activation rows as the integer dot products read them: per run of 32 values, int16 values
 * x / scale rounded to nearest (scale = the run's largest magnitude / 32767, so the largest maps
 * to +-32767), the scale, and per weight group the float sum of x (for the offsets' term). */
#define RUN 32 /* weights per unpacking step: 16 packed int4 bytes, 32 int8 values */

typedef struct {
    int16_t *q;        /* [m, k] */
    float *scale;      /* [m, k / RUN] */
    float *group_sum;  /* [m, k / group] */
} Rows16;

static inline void quantize_run(const float *x, int16_t *q, float *scale, float *sum) {
    float amax = 0.0f, total = 0.0f;
    for (int i = 0; i < RUN; i++) {
        const float a = x[i] < 0 ? -x[i] : x[i];
        amax = a > amax ? a : amax;
        total += x[i];
    }
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    /* rintf rounds as lrintf does (to nearest, ties to even) but compiles to an instruction
     * where lrintf is a libm call per value. */
    for (int i = 0; i < RUN; i++) q[i] = (int16_t)(int32_t)rintf(x[i] * inv);
    *scale = amax / 32767.0f;
    *sum = total;
}

/* Room for m rows of k values with groups of `group` (NULL when out of memory; free() it). */
static inline Rows16 rows16_alloc(int64_t m, int64_t k, int64_t group) {
    const int64_t runs = k / RUN, groups = k / group;
    char *buffer = malloc((size_t)m * (k * sizeof(int16_t) + (runs + groups) * sizeof(float)));
    Rows16 rows = {(int16_t *)buffer, NULL, NULL};
    if (buffer) {
        rows.scale = (float *)(rows.q + m * k);
        rows.group_sum = rows.scale + m * runs;
    }
    return rows;
}

/* Row i of x (row stride x_stride) into rows: shared by a team's threads where every thread
 * calls it (omp for), all on the caller outside a team. */
static inline void rows16_fill(Rows16 *rows, const float *x, int64_t x_stride, int64_t m,
                               int64_t k, int64_t group) {
    const int64_t runs = k / RUN, groups = k / group, runs_per_group = group / RUN;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t r = g * runs_per_group; r < (g + 1) * runs_per_group; r++) {
                float run_sum;
                quantize_run(x + i * x_stride + r * RUN, rows->q + i * k + r * RUN,
                             &rows->scale[i * runs + r], &run_sum);
                sum += run_sum;
            }
            rows->group_sum[i * groups + g] = sum;
        }
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
#define BLOCK 16
typedef __m512i ivec;
typedef __m512 fvec;
#define izero() _mm512_setzero_si512()
#define iload(p) _mm512_loadu_si512((const void *)(p))
#define iand(a, b) _mm512_and_si512(a, b)
#define isrl4(a) _mm512_srli_epi16(a, 4)
#define iset8(x) _mm512_set1_epi8(x)
#define iset32(x) _mm512_set1_epi32(x)
#define unpack_lo8(a, b) _mm512_unpacklo_epi8(a, b)
#define unpack_hi8(a, b) _mm512_unpackhi_epi8(a, b)
#define iadd32(a, b) _mm512_add_epi32(a, b)
#define words_int8(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define fzero() _mm512_setzero_ps()
#define fload(p) _mm512_loadu_ps(p)
#define fstore(p, v) _mm512_storeu_ps(p, v)
#define fset1(x) _mm512_set1_ps(x)
#define fmul(a, b) _mm512_mul_ps(a, b)
#define fadd(a, b) _mm512_add_ps(a, b)
#define ffma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define cvt_ps(a) _mm512_cvtepi32_ps(a)
#if defined(__AVX512VNNI__)
#define dot_add(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#define FUSED_DOT 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define BLOCK 8
typedef __m256i ivec;
typedef __m256 fvec;
#define izero() _mm256_setzero_si256()
#define iload(p) _mm256_loadu_si256((const __m256i *)(p))
#define iand(a, b) _mm256_and_si256(a, b)
#define isrl4(a) _mm256_srli_epi16(a, 4)
#define iset8(x) _mm256_set1_epi8(x)
#define iset32(x) _mm256_set1_epi32(x)
#define unpack_lo8(a, b) _mm256_unpacklo_epi8(a, b)
#define unpack_hi8(a, b) _mm256_unpackhi_epi8(a, b)
#define iadd32(a, b) _mm256_add_epi32(a, b)
#define words_int8(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define fzero() _mm256_setzero_ps()
#define fload(p) _mm256_loadu_ps(p)
#define fstore(p, v) _mm256_storeu_ps(p, v)
#define fset1(x) _mm256_set1_ps(x)
#define fmul(a, b) _mm256_mul_ps(a, b)
#define fadd(a, b) _mm256_add_ps(a, b)
#define ffma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define cvt_ps(a) _mm256_cvtepi32_ps(a)
#if defined(__AVXVNNI__)
#define dot_add(acc, w, x) _mm256_dpwssd_avx_epi32(acc, w, x)
#define FUSED_DOT 1
#endif
#endif

#ifdef BLOCK
#ifndef FUSED_DOT
#define dot_add(acc, w, x) iadd32(acc, madd_words(w, x))
#if BLOCK == 16
#define madd_words(w, x) _mm512_madd_epi16(w, x)
#else
#define madd_words(w, x) _mm256_madd_epi16(w, x)
#endif
/* vpmaddwd + vpaddd: the add's one-cycle latency is the only chain. */
#define CHAINS(mr) 1
#else
/* A fused dot's latency (4-5 cycles) would bind a single chain of 16 per run: 4 independent
 * sums for one row, 2 per row while the rows' accumulators fit the registers, one for 8 rows
 * (their 128 dots a run outlast any chain). */
#define CHAINS(mr) ((mr) == 1 ? 4 : (mr) <= 4 ? 2 : 1)
#endif

/* Rows per tile: each tile unpacks a block's weights once for all its rows. AVX-512's 32
 * registers hold 8 rows' sums (a verify step of 4 drafts, 5 rows, is one tile, not 4 + 1);
 * AVX2's 16 hold 4. */
#if BLOCK == 16
enum { MAX_TILE_ROWS = 8 };
#else
enum { MAX_TILE_ROWS = 4 };
#endif
enum { ROW_CHUNK = 64, FILL_FIRST_ROWS = 8 };

/* Activation pair p of a run (its int16 values 2p and 2p + 1) as one int32, to broadcast. */
static inline int32_t pair_at(const int16_t *run, int p) {
    int32_t v;
    memcpy(&v, run + 2 * p, sizeof v);
    return v;
}

/* Rows m0 .. m0 + mr - 1 against column block cb of an int4 (or int8) weight: each row's BLOCK
 * sums (without bias) in sums[]. Inlined per format and mr so that the accumulators are
 * registers. */
static inline __attribute__((always_inline)) void block_tile(const Rows16 *x, int64_t k,
                                                             const QuantWeight *w, int64_t cb,
                                                             int64_t m0, const int int4,
                                                             const int mr,
                                                             fvec sums[MAX_TILE_ROWS]) {
    const int chains = CHAINS(mr);
    const int64_t runs = k / RUN, groups = k / w->group, runs_per_group = w->group / RUN;
    const int64_t run_bytes = (int4 ? RUN / 2 : RUN) * BLOCK;
    const uint8_t *q = w->q + cb * runs * run_bytes;
    const float *scales = w->scales + cb * groups * BLOCK;
    const float *offsets = w->offsets ? w->offsets + cb * groups * BLOCK : NULL;
    const ivec mask = iset8(0x0F), zero = izero();
    fvec acc[MAX_TILE_ROWS];
    for (int j = 0; j < mr; j++) acc[j] = fzero();
    for (int64_t g = 0; g < groups; g++) {
        const fvec scale = fload(scales + g * BLOCK);
        for (int64_t r = g * runs_per_group; r < (g + 1) * runs_per_group; r++) {
            const uint8_t *p = q + r * run_bytes;
            const int16_t *xr[MAX_TILE_ROWS];
            ivec dots[MAX_TILE_ROWS][4];
            for (int j = 0; j < mr; j++) {
                xr[j] = x->q + (m0 + j) * k + r * RUN;
                for (int c = 0; c < chains; c++) dots[j][c] = zero;
            }
            /* Four word vectors at a time: int4's load i (pairs 2i, 2i + 1 from its low
             * nibbles, 2i + 8, 2i + 9 from its high ones), int8's pairs 4i .. 4i + 3. Spelled
             * out per format: a shared loop over an array of pair indices timed slower for
             * int8 in one ad-hoc run (its broadcasts spilled), on a host whose speed drifts. */
            if (int4) {
                for (int i = 0; i < 4; i++) {
                    const ivec bytes = iload(p + i * 4 * BLOCK);
                    const ivec lo = iand(bytes, mask), hi = iand(isrl4(bytes), mask);
                    const ivec w0 = unpack_lo8(lo, zero), w1 = unpack_hi8(lo, zero);
                    const ivec w2 = unpack_lo8(hi, zero), w3 = unpack_hi8(hi, zero);
                    for (int j = 0; j < mr; j++) {
                        ivec d = dots[j][i % chains];
                        d = dot_add(d, w0, iset32(pair_at(xr[j], 2 * i)));
                        d = dot_add(d, w1, iset32(pair_at(xr[j], 2 * i + 1)));
                        d = dot_add(d, w2, iset32(pair_at(xr[j], 2 * i + 8)));
                        d = dot_add(d, w3, iset32(pair_at(xr[j], 2 * i + 9)));
                        dots[j][i % chains] = d;
                    }
                }
            } else {
                for (int i = 0; i < 4; i++) {
                    const uint8_t *at = p + 4 * i * 2 * BLOCK;
                    const ivec w0 = words_int8(at), w1 = words_int8(at + 2 * BLOCK);
                    const ivec w2 = words_int8(at + 4 * BLOCK), w3 = words_int8(at + 6 * BLOCK);
                    for (int j = 0; j < mr; j++) {
                        ivec d = dots[j][i % chains];
                        d = dot_add(d, w0, iset32(pair_at(xr[j], 4 * i)));
                        d = dot_add(d, w1, iset32(pair_at(xr[j], 4 * i + 1)));
                        d = dot_add(d, w2, iset32(pair_at(xr[j], 4 * i + 2)));
                        d = dot_add(d, w3, iset32(pair_at(xr[j], 4 * i + 3)));
                        dots[j][i % chains] = d;
                    }
                }
            }
            for (int j = 0; j < mr; j++) {
                ivec d = dots[j][0];
                for (int c = 1; c < chains; c++) d = iadd32(d, dots[j][c]);
                const fvec step = fmul(scale, fset1(x->scale[(m0 + j) * runs + r]));
                acc[j] = ffma(cvt_ps(d), step, acc[j]);
            }
        }
        if (offsets) {
            const fvec offset = fload(offsets + g * BLOCK);
            for (int j = 0; j < mr; j++)
                acc[j] = ffma(offset, fset1(x->group_sum[(m0 + j) * groups + g]), acc[j]);
        }
    }
    for (int j = 0; j < mr; j++) sums[j] = acc[j];
}

/* A tile's rows into out, with bias, for the columns of block cb below n. */
static void store_tile(const Rows16 *x, const QuantWeight *w, const float *bias, float *out,
                       int64_t out_stride, int64_t m0, int mr, int64_t cb, int64_t n, int64_t k) {
    fvec sums[MAX_TILE_ROWS];
    /* One copy per format and row count: each keeps its own registers. */
#define TILE_CASE(R)                                                      \
    case R:                                                               \
        if (w->format == QUANT_INT4)                                      \
            block_tile(x, k, w, cb, m0, 1, (R) <= MAX_TILE_ROWS ? R : 1, sums); \
        else                                                              \
            block_tile(x, k, w, cb, m0, 0, (R) <= MAX_TILE_ROWS ? R : 1, sums); \
        break;
    switch (mr) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
#if BLOCK == 16
        TILE_CASE(5)
        TILE_CASE(6)
        TILE_CASE(7)
        TILE_CASE(8)
#endif
    }
#undef TILE_CASE
    const int64_t n0 = cb * BLOCK;
    for (int j = 0; j < mr; j++) {
        float *row = out + (m0 + j) * out_stride + n0;
        if (n0 + BLOCK <= n) {
            fstore(row, bias ? fadd(sums[j], fload(bias + n0)) : sums[j]);
        } else {
            float lanes[BLOCK];
            fstore(lanes, sums[j]);
            for (int64_t c = 0; c < n - n0; c++) row[c] = lanes[c] + (bias ? bias[n0 + c] : 0.0f);
        }
    }
}

int kvfleet_quant_block(void) { return BLOCK; }

#ifdef FUSED_DOT
int kvfleet_quant_fused_dot(void) { return 1; }
#else
int kvfleet_quant_fused_dot(void) { return 0; }
#endif

/* Whether w and k describe a weight this kernel reads. */
static int valid(const QuantWeight *w, int64_t n, int64_t k) {
    return w && w->q && w->scales && n >= 1 && k >= 1 && w->group >= RUN &&
           w->group % RUN == 0 && k % w->group == 0 && w->block == BLOCK &&
           (w->format == QUANT_INT4 || (w->format == QUANT_INT8 && !w->offsets));
}

int kvfleet_linear_quant(const float *x, int64_t x_stride, const QuantWeight *w,
                         const float *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                         int64_t k, int num_threads) {
    if (m < 1 || x_stride < k || out_stride < n) return ERR_SHAPE;
    if (!valid(w, n, k)) return ERR_FORMAT;
    Rows16 rows = rows16_alloc(m, k, w->group);
    if (!rows.q) return ERR_NOMEM;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    /* A decode step's few rows are quantized before the team forks (rows16_fill's loop then
     * runs on this thread alone): sharing them costs a barrier, which one thread would spend
     * waiting for the other's row. */
    const int fill_first = m <= FILL_FIRST_ROWS;
    if (fill_first) rows16_fill(&rows, x, x_stride, m, k, w->group);
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        if (!fill_first) rows16_fill(&rows, x, x_stride, m, k, w->group);
        /* Threads split the column blocks; a block's weights stay in L1 while up to ROW_CHUNK
         * rows (their int16 values in L2) pass over them, four at a time. */
        for (int64_t lo = 0; lo < m; lo += ROW_CHUNK) {
            const int64_t hi = lo + ROW_CHUNK < m ? lo + ROW_CHUNK : m;
#pragma omp for schedule(static)
            for (int64_t cb = 0; cb < blocks; cb++)
                for (int64_t m0 = lo; m0 < hi;) {
                    const int mr = hi - m0 < MAX_TILE_ROWS ? (int)(hi - m0) : MAX_TILE_ROWS;
                    store_tile(&rows, w, bias, out, out_stride, m0, mr, cb, n, k);
                    m0 += mr;
                }
        }
    }
    free(rows.q);
    return OK;
}

/* A run's 16 pair vectors (k pair p in vector p, column c in int32 lane c), as the GEMM reads
 * them. */
static inline void run_pairs(const uint8_t *p, int int4, ivec pairs[RUN / 2]) {
    if (int4) {
        const ivec mask = iset8(0x0F), zero = izero();
        for (int i = 0; i < 4; i++) {
            const ivec bytes = iload(p + i * 4 * BLOCK);
            const ivec lo = iand(bytes, mask), hi = iand(isrl4(bytes), mask);
            pairs[2 * i] = unpack_lo8(lo, zero), pairs[2 * i + 1] = unpack_hi8(lo, zero);
            pairs[2 * i + 8] = unpack_lo8(hi, zero), pairs[2 * i + 9] = unpack_hi8(hi, zero);
        }
    } else {
        for (int pair = 0; pair < RUN / 2; pair++) pairs[pair] = words_int8(p + pair * 2 * BLOCK);
    }
}

#if BLOCK == 16
/* m[i] lane j <-> m[j] lane i for 16 x 16 int32: in-lane unpacks make 4 x 4 blocks, two 128-bit
 * lane shuffles put them in place. */
static inline void transpose_pairs(ivec m[16]) {
    ivec t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(m[2 * i], m[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(m[2 * i], m[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const ivec even_a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        const ivec odd_a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        const ivec even_b = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const ivec odd_b = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        m[j] = _mm512_shuffle_i32x4(even_a, even_b, 0x88);
        m[8 + j] = _mm512_shuffle_i32x4(even_a, even_b, 0xDD);
        m[4 + j] = _mm512_shuffle_i32x4(odd_a, odd_b, 0x88);
        m[12 + j] = _mm512_shuffle_i32x4(odd_a, odd_b, 0xDD);
    }
}
#define widen_lo(v) _mm512_cvtepi16_epi32(_mm512_castsi512_si256(v))
#define widen_hi(v) _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1))
#else
/* The same for each 8 x 8 half of 16 x 8 int32 (m[0..7], m[8..15]). */
static inline void transpose_pairs(ivec m[16]) {
    for (int h = 0; h < 16; h += 8) {
        ivec *r = m + h, t[8], u[8];
        for (int i = 0; i < 4; i++) {
            t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 2; i++) {
            u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for (int j = 0; j < 4; j++) {
            r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
            r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
        }
    }
}
#define widen_lo(v) _mm256_cvtepi16_epi32(_mm256_castsi256_si128(v))
#define widen_hi(v) _mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1))
#endif

/* The float32 [n, k] weight w stands for, row by row into out (for steps past the policy's rows
 * for the kernel above: their GEMM then runs on the float paths). Per run, the block's pair
 * vectors are transposed so that a vector holds one column's pairs, i.e. its weights in k
 * order, then widened and scaled: scale x q + offset in one FMA, the same values as
 * kernels/quant_weight.dequantize. */
int kvfleet_dequantize(const QuantWeight *w, float *out, int64_t n, int64_t k, int num_threads) {
    if (!valid(w, n, k)) return ERR_FORMAT;
    const int int4 = w->format == QUANT_INT4;
    const int64_t runs = k / RUN, groups = k / w->group, blocks = (n + BLOCK - 1) / BLOCK;
    const int64_t run_bytes = (int4 ? RUN / 2 : RUN) * BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t cb = 0; cb < blocks; cb++) {
        const int64_t cols = n - cb * BLOCK < BLOCK ? n - cb * BLOCK : BLOCK;
        for (int64_t r = 0; r < runs; r++) {
            const int64_t at = (cb * groups + r / (w->group / RUN)) * BLOCK;
            ivec pairs[RUN / 2];
            run_pairs(w->q + (cb * runs + r) * run_bytes, int4, pairs);
            transpose_pairs(pairs);
            for (int64_t c = 0; c < cols; c++) {
                const fvec scale = fset1(w->scales[at + c]);
                const fvec offset = fset1(w->offsets ? w->offsets[at + c] : 0.0f);
                float *row = out + (cb * BLOCK + c) * k + r * RUN;
                /* Vector v * BLOCK + c holds the column's pairs v * BLOCK.., k 2 v BLOCK... */
                for (int v = 0; v < RUN / 2 / BLOCK; v++) {
                    const ivec words = pairs[v * BLOCK + c];
                    fstore(row + 2 * v * BLOCK, ffma(cvt_ps(widen_lo(words)), scale, offset));
                    fstore(row + (2 * v + 1) * BLOCK,
                           ffma(cvt_ps(widen_hi(words)), scale, offset));
                }
            }
        }
    }
    return OK;
}
#else
int kvfleet_quant_block(void) { return 0; }
int kvfleet_quant_fused_dot(void) { return 0; }

int kvfleet_linear_quant(const float *x, int64_t x_stride, const QuantWeight *w,
                         const float *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                         int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)m, (void)n;
    (void)k, (void)num_threads;
    return ERR_NO_SIMD;
}

int kvfleet_dequantize(const QuantWeight *w, float *out, int64_t n, int64_t k, int num_threads) {
    (void)w, (void)out, (void)n, (void)k, (void)num_threads;
    return ERR_NO_SIMD;
}
#endif
