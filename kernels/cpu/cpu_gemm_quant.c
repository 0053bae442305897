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
 * The layout, and the vector primitives shared with the dequantize pass: cpu_quant_block.h.
 * Past the kernel policy's row limit (cpu_gemm_quant.max_rows), kvfleet_dequantize's float
 * weight (cpu_quant_dequantize.c) into the float32 GEMM is faster (AVX2 past 8 rows).
 *
 * Layouts: x [m, k] float32 with row stride x_stride; out [m, n] with row stride out_stride;
 * bias [n] or NULL. k a multiple of the group size, itself a multiple of 32.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_quant_block.h"

/* Activation rows as the integer dot products read them: per run of 32 values, int16 values
 * x / scale rounded to nearest (scale = the run's largest magnitude / 32767, so the largest maps
 * to +-32767), the scale, and per weight group the float sum of x (for the offsets' term). */
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

#ifdef BLOCK
#ifndef FUSED_DOT
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
    const ivec zero = izero();
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
            for (int i = 0; i < 4; i++) {
                ivec words[4];
                int pairs[4];
                four_words(p, int4, i, words, pairs);
                for (int j = 0; j < mr; j++) {
                    ivec d = dots[j][i % chains];
                    for (int v = 0; v < 4; v++)
                        d = dot_add(d, words[v], iset32(pair_at(xr[j], pairs[v])));
                    dots[j][i % chains] = d;
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

int kvfleet_linear_quant(const float *x, int64_t x_stride, const QuantWeight *w,
                         const float *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                         int64_t k, int num_threads) {
    if (m < 1 || x_stride < k || out_stride < n) return ERR_SHAPE;
    if (!quant_block_valid(w, n, k)) return ERR_FORMAT;
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
#endif
