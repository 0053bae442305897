/* bf16 projections of decode-sized steps, out = x · Wᵀ + bias, on one packed weight layout with
 * two engines: AMX tiles (up to a thousand rows: decode steps, and steps carrying a prompt beside
 * the decodes) and, on CPUs with AVX512-BF16 but no AMX, AVX-512 vectors (`vdpbf16ps`, decode
 * batches). The entry point, the weight layout, the prologues and the split of columns between
 * threads are shared; only the inner multiply differs (KERNEL_AMX / KERNEL_AVX512_BF16).
 *
 * AMX engine:
 *
 * Why: at up to ~100 rows a projection is a stream of its weight, 2 bytes per parameter read
 * once per step. oneDNN's kernels for these shapes read the bundled model's weights at 8-15
 * GB/s on the 2-core host (30 layers' distinct weights), well under what it can stream. Here
 * the weight is prepacked into the exact bytes of AMX B tiles, in the order they are used, so
 * each thread streams one contiguous range of memory and every 1 KiB it reads feeds two tile
 * multiplies per 16 rows at once (`kvfleet bench cpu-kernels`: 1.05-1.7x oneDNN up to 96 rows).
 * From ~128 rows the GEMM is compute-bound; at 300-1000 rows (a prompt of a few hundred tokens
 * beside a serving batch's decodes) oneDNN's kernels for our narrow shapes run at 0.8-1.4
 * TFLOP/s and this one is faster again, until ~2000 rows, where oneDNN's blocking wins
 * (cpu_gemm.MAX_ROWS draws the line). Since the input rows are copied into tile order anyway,
 * the op in front of the projection can be applied on the way (a "prologue": RMSNorm with its
 * residual add, or SiLU-and-mul), saving its call.
 *
 * Layout of the packed weight (cpu_gemm.pack): for column block nb (16 output features) and
 * K step kt (32 input features), one 16 x 64-byte B tile whose row r holds, for each of the 16
 * columns c, the pair W[nb*16+c][kt*32+2r .. +1] (AMX's "VNNI" pairs). Tiles go nb-major, so
 * one column block's whole K is contiguous.
 *
 * Rows are processed in panels of 32 (two A tiles) against pairs of column blocks: four C tiles
 * accumulate in registers over all of K and are written once, with the bias, as bf16. A thread
 * owns a contiguous range of column-block pairs and walks every row panel over it, so a pair's
 * weight comes from memory once and from cache for the other panels. While the first panel
 * multiplies, the lines two K steps ahead of both B streams are prefetched into L1: a tile load
 * that misses holds its tile register, and with it the multiplies behind it, for the whole
 * miss (2-17% faster at 1-96 rows in interleaved runs; prefetching into L2, further ahead, or
 * the A tiles too, gained nothing more). Tried and slower: four row tiles sharing each B tile
 * (more A loads per multiply), 16-row panels.
 *
 * Many rows: a pair's weight (36 KiB at K = 576) and the panel's A tiles passing through would
 * not both fit L1 (48 KiB), so A tiles are loaded with the streaming hint (TILELOADDT1), asking
 * the core not to keep them in place of the weight that the next panel reuses; and rows go in
 * chunks whose A tiles take at most CHUNK_A_BYTES, so that a chunk stays in L2 while every unit
 * of the thread passes over it, instead of all rows' tiles coming from L3 once per unit (2048
 * rows x K 1536 is 6 MiB). In interleaved timings while developing them, the two together took
 * 1.3-1.4x less time at 2048 rows and up to 1.2x at 1024, and made no difference at decode
 * sizes; neither changes a bit of the result.
 *
 * AVX512-BF16 engine (no AMX; Zen 4, Cooper Lake, or Sapphire Rapids with AMX masked), columns
 * in lanes: a row of a packed B tile is one 64-byte vector of 16 columns' pairs (W[c][2r],
 * W[c][2r+1]), so `vdpbf16ps` of it against x's pair (x[2r], x[2r+1]) broadcast to every lane
 * adds that pair's products to 16 outputs at once. The weight streams through in the order it
 * lies in memory (one contiguous stretch per thread, as the AMX engine reads it), no sums need
 * reducing across lanes, and x's rows stay in L1. A 32-column unit keeps, per row, two
 * accumulators per column block (even and odd tile rows: two dependency chains at one row) for
 * up to VECTOR_ROWS rows at a time; more rows take further passes over the unit's weight, from L2.
 * Steps of up to STREAM_MAX_ROWS rows take the unit's two blocks one after the other instead
 * (one stream per thread; see DOT_BLOCKS). Every row is summed in the same order whatever the
 * row count, so a sequence's results do not depend on what else is in the batch.
 * Measured on a 2-core Zen 4 host against the dot form on the plain weight (x and W rows both
 * contiguous along K, reduced across lanes at the end, cpu_gemm_f32.c's small-row form): 28 vs
 * 22 GB/s at 1 row, 25 vs 16 at 4; oneDNN's packed bf16 GEMM read 12-13 GB/s at 1-8 rows.
 * Software prefetch of both blocks' lines 1-8 KiB ahead, as the AMX engine does, was slower in
 * interleaved runs at 1, 4 and 16 rows (the hardware prefetchers follow one contiguous stream
 * per thread; the prefetches took load slots), so this engine has none. */
#include "cpu_amx.h"
#include "cpu_entry_points.h"
#include "cpu_math.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_AMX = 3, ERR_NO_AVX512_BF16 = 4 };
/* What is done to each input row as it is packed (cpu_gemm.py names the same numbers). */
enum { PROLOGUE_NONE = 0, PROLOGUE_RMS_NORM = 1, PROLOGUE_SILU_AND_MUL = 2 };
/* Which engine multiplies (cpu_gemm.py's KERNEL_*). */
enum { KERNEL_AMX = 0, KERNEL_AVX512_BF16 = 1 };

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#endif

#define TILE_ROWS 16
#define TILE_K 32                             /* bf16 input features per tile row */
#define TILE_COLS 16                          /* output features per tile (float32 lanes) */
#define TILE_ELEMS (TILE_ROWS * TILE_K)       /* bf16 elements in an A or B tile */
#define PAIR_COLS (2 * TILE_COLS)             /* a thread's unit: two column blocks */
#define PANEL_ROWS (2 * TILE_ROWS)            /* rows of a panel: two A tiles */
#define PARALLEL_PROLOGUE_ELEMS 65536         /* input values from which rows pack in parallel */
#define PREFETCH_BYTES 2048                   /* how far ahead of each B stream: two K steps */
#define CHUNK_A_BYTES (512 * 1024)            /* a row chunk's A tiles: a quarter of L2 here */
#define VECTOR_ROWS 6 /* rows per pass of the vector engine: 24 accumulators in 32 registers */

#ifdef HAVE_AVX512_BF16 /* both engines (AMX-BF16 implies AVX512-BF16) */
/* Round-to-nearest-even float32 -> bf16 of 16 sums plus their bias, stored to `dst`. */
static inline void store16(uint16_t *dst, __m512 v, const float *bias) {
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

#ifdef HAVE_AMX
static inline void store_row(uint16_t *dst, const float *acc, const float *bias) {
    store16(dst, _mm512_loadu_ps(acc), bias);
}

/* A C tile stored to scratch (16 x 16 float32) -> its first `rows` rows of out, as bf16. */
static void write_tile(float *scratch, uint16_t *out, int64_t out_stride, int rows,
                       const float *bias) {
    for (int r = 0; r < rows; r++)
        store_row(out + r * out_stride, scratch + r * TILE_COLS, bias);
}

/* Ask for the B tiles' lines PREFETCH_BYTES past `at` in both streams. Past a column block's
 * end they are the next block's first tiles (a thread's units are contiguous, so it reads them
 * next or soon); past the buffer's end a prefetch is dropped, never a fault. */
static inline void prefetch_b(const uint16_t *w, const uint16_t *w1, int64_t at) {
    const char *p0 = (const char *)(w + at) + PREFETCH_BYTES;
    const char *p1 = (const char *)(w1 + at) + PREFETCH_BYTES;
    for (int line = 0; line < TILE_ELEMS * 2; line += 64) {
        _mm_prefetch(p0 + line, _MM_HINT_T0);
        _mm_prefetch(p1 + line, _MM_HINT_T0);
    }
}

/* One 32-column unit (column blocks b0 = packed tiles at w, b1 = w + ksteps tiles) for a panel
 * of `rows` <= 32 rows of the input in A-tile order (a: this panel's first row tile, its K
 * steps' tiles contiguous, then the second row tile's). `stream`: the weight comes from memory
 * (the unit's first panel), so prefetch it. */
static void panel(const uint16_t *a, int rows, const uint16_t *w, int64_t ksteps,
                  uint16_t *out, int64_t out_stride, const float *bias, float *scratch,
                  int stream) {
    const uint16_t *w1 = w + ksteps * TILE_ELEMS, *a1 = a + ksteps * TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    if (rows > TILE_ROWS) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kt = 0; kt < ksteps; kt++) {
            const int64_t at = kt * TILE_ELEMS;
            if (stream) prefetch_b(w, w1, at);
            _tile_stream_loadd(4, a + at, 64);
            _tile_loadd(6, w + at, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, w1 + at, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_stream_loadd(5, a1 + at, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t kt = 0; kt < ksteps; kt++) {
            const int64_t at = kt * TILE_ELEMS;
            if (stream) prefetch_b(w, w1, at);
            _tile_loadd(6, w + at, 64);
            _tile_loadd(7, w1 + at, 64);
            _tile_loadd(4, a + at, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    const int top = rows < TILE_ROWS ? rows : TILE_ROWS;
    _tile_stored(0, scratch, 64);
    write_tile(scratch, out, out_stride, top, bias);
    _tile_stored(1, scratch, 64);
    write_tile(scratch, out + TILE_COLS, out_stride, top, bias ? bias + TILE_COLS : NULL);
    if (rows > TILE_ROWS) {
        uint16_t *low = out + TILE_ROWS * out_stride;
        _tile_stored(2, scratch, 64);
        write_tile(scratch, low, out_stride, rows - TILE_ROWS, bias);
        _tile_stored(3, scratch, 64);
        write_tile(scratch, low + TILE_COLS, out_stride, rows - TILE_ROWS,
                   bias ? bias + TILE_COLS : NULL);
    }
}

/* Row `row` (k bf16 values) into its place in A-tile order: row tile row / 16, one 64-byte
 * tile row per K step. Each A tile is then 1 KiB of consecutive lines, where loading A tiles
 * straight from x's rows touched 16 lines a row apart, which measured slower beside the weight
 * streams. */
static void place_row(uint16_t *a, int64_t ksteps, int64_t row, const uint16_t *values) {
    uint16_t *first = a + (row / TILE_ROWS * ksteps * TILE_ROWS + row % TILE_ROWS) * TILE_K;
    for (int64_t kt = 0; kt < ksteps; kt++)
        memcpy(first + kt * TILE_ELEMS, values + kt * TILE_K, TILE_K * sizeof(uint16_t));
}

/* The A tiles of m rows, for the caller to place its rows in. A ragged last row tile's rows
 * past m stay uninitialised: a C tile row depends only on its own A row, and write_tile never
 * stores rows past m. */
static uint16_t *alloc_a(int64_t m, int64_t ksteps) {
    const int64_t row_tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    return aligned_alloc(64, (size_t)(row_tiles * ksteps * TILE_ELEMS * sizeof(uint16_t)));
}

/* out = A · Wᵀ + bias for the rows already placed in a (freed here). */
static int multiply_amx(uint16_t *a, const uint16_t *packed, const float *bias, uint16_t *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t ksteps, int num_threads) {
    const int64_t units = n / PAIR_COLS;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > units) num_threads = (int)units;
    /* Rows in chunks of whole panels whose A tiles take at most CHUNK_A_BYTES. */
    const int64_t panel_bytes = PANEL_ROWS * ksteps * TILE_K * (int64_t)sizeof(uint16_t);
    const int64_t chunk = (CHUNK_A_BYTES / panel_bytes > 1 ? CHUNK_A_BYTES / panel_bytes : 1) *
                          PANEL_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        float scratch[TILE_ROWS * TILE_COLS] __attribute__((aligned(64)));
        configure_tiles();
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
            const int64_t c1 = c0 + chunk < m ? c0 + chunk : m;
            /* Contiguous unit ranges: each thread streams one stretch of the packed weight. The
             * same static split for every chunk, so no thread waits for another between them. */
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                const uint16_t *w = packed + u * 2 * ksteps * TILE_ELEMS;
                const float *b = bias ? bias + u * PAIR_COLS : NULL;
                for (int64_t r0 = c0; r0 < c1; r0 += PANEL_ROWS) {
                    const int rows = (int)(c1 - r0 < PANEL_ROWS ? c1 - r0 : PANEL_ROWS);
                    panel(a + r0 / TILE_ROWS * ksteps * TILE_ELEMS, rows, w, ksteps,
                          out + r0 * out_stride + u * PAIR_COLS, out_stride, b, scratch,
                          r0 == c0);
                }
            }
        }
        _tile_release();
    }
    free(a);
    return OK;
}
#endif

#ifdef HAVE_AVX512_BF16
/* `rows` <= MV rows of x (row stride x_stride) against NB column blocks of 16 (the first at w,
 * the next ksteps tiles on): per row, block and parity of the tile row, one accumulator of 16
 * columns. A macro per (MV, NB) so that the accumulators are registers.
 * - NB 2 (unit_MV): a 32-column unit, its two blocks read side by side, each x pair loaded once
 *   for both.
 * - NB 1 (block_MV): one block, its weight read as one stream. The same arithmetic per block,
 *   so the same bits. Why: a thread that streams its units' two blocks side by side (two
 *   streams 18 KiB apart at K 576) read 49-52 GB/s where one stream read 56-61, in the host's
 *   fast phases; a decode step's 120 projections and LM head at 1-4 rows took 16-22% less time
 *   then, 2-6% less in its slow phases (alternating runs in one process, 2-core Zen 4). Steps
 *   of more than STREAM_MAX_ROWS rows keep units: at 6 and 8 rows (compute, not memory, sets
 *   the pace there) block passes took 2-13% and 7-30% longer. */
#define DOT_BLOCKS(NAME, MV, NB)                                                               \
    static void NAME(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *w,         \
                     int64_t ksteps, const float *bias, uint16_t *out, int64_t out_stride) {   \
        const uint16_t *xr[MV];                                                                \
        for (int i = 0; i < MV; i++) xr[i] = x + (i < rows ? i : rows - 1) * x_stride;         \
        __m512 even[NB][MV], odd[NB][MV];                                                      \
        _Pragma("GCC unroll 2") for (int b = 0; b < NB; b++)                                   \
            _Pragma("GCC unroll 8") for (int i = 0; i < MV; i++) even[b][i] = odd[b][i] =      \
                _mm512_setzero_ps();                                                           \
        for (int64_t kt = 0; kt < ksteps; kt++) {                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < TILE_ROWS; r += 2) {                   \
                __m512bh be[NB], bo[NB];                                                       \
                _Pragma("GCC unroll 2") for (int b = 0; b < NB; b++) {                         \
                    const uint16_t *t = w + (b * ksteps + kt) * TILE_ELEMS;                    \
                    be[b] = (__m512bh)_mm512_loadu_si512(t + r * TILE_K);                      \
                    bo[b] = (__m512bh)_mm512_loadu_si512(t + (r + 1) * TILE_K);                \
                }                                                                              \
                _Pragma("GCC unroll 8") for (int i = 0; i < MV; i++) {                         \
                    int32_t pe, po; /* x's pairs (2r, 2r + 1) and (2r + 2, 2r + 3) */          \
                    memcpy(&pe, xr[i] + kt * TILE_K + 2 * r, sizeof pe);                       \
                    memcpy(&po, xr[i] + kt * TILE_K + 2 * r + 2, sizeof po);                   \
                    const __m512bh xe = (__m512bh)_mm512_set1_epi32(pe);                       \
                    const __m512bh xo = (__m512bh)_mm512_set1_epi32(po);                       \
                    _Pragma("GCC unroll 2") for (int b = 0; b < NB; b++) {                     \
                        even[b][i] = _mm512_dpbf16_ps(even[b][i], be[b], xe);                  \
                        odd[b][i] = _mm512_dpbf16_ps(odd[b][i], bo[b], xo);                    \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < rows; i++)                                                         \
            for (int b = 0; b < NB; b++)                                                       \
                store16(out + i * out_stride + b * TILE_COLS,                                  \
                        _mm512_add_ps(even[b][i], odd[b][i]),                                  \
                        bias ? bias + b * TILE_COLS : NULL);                                   \
    }
DOT_BLOCKS(unit_1, 1, 2)
DOT_BLOCKS(unit_2, 2, 2)
DOT_BLOCKS(unit_4, 4, 2)
DOT_BLOCKS(unit_6, 6, 2)
DOT_BLOCKS(block_1, 1, 1)
DOT_BLOCKS(block_2, 2, 1)
DOT_BLOCKS(block_4, 4, 1)
#define STREAM_MAX_ROWS 4 /* the most rows of a step that runs on block_MV */

/* out = x · Wᵀ + bias on the vector engine: x [m, k] bf16 with row stride x_stride. Threads take
 * contiguous unit ranges, as in multiply_amx; each runs all rows over its unit, VECTOR_ROWS at a
 * time. */
static int multiply_vectors(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                            const float *bias, uint16_t *out, int64_t out_stride, int64_t m,
                            int64_t n, int64_t ksteps, int num_threads) {
    const int64_t units = n / PAIR_COLS;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > units) num_threads = (int)units;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t u = 0; u < units; u++) {
        const uint16_t *w = packed + u * 2 * ksteps * TILE_ELEMS;
        const float *b = bias ? bias + u * PAIR_COLS : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += VECTOR_ROWS) {
            const int rows = (int)(m - r0 < VECTOR_ROWS ? m - r0 : VECTOR_ROWS);
            const uint16_t *xr = x + r0 * x_stride;
            uint16_t *o = out + r0 * out_stride + u * PAIR_COLS;
            if (m <= STREAM_MAX_ROWS) { /* m, not rows: later passes read from cache */
                for (int blk = 0; blk < 2; blk++) { /* the unit's blocks one after the other */
                    const uint16_t *wb = w + blk * ksteps * TILE_ELEMS;
                    const float *bb = b ? b + blk * TILE_COLS : NULL;
                    uint16_t *ob = o + blk * TILE_COLS;
                    if (rows == 1) block_1(xr, x_stride, rows, wb, ksteps, bb, ob, out_stride);
                    else if (rows == 2) block_2(xr, x_stride, rows, wb, ksteps, bb, ob, out_stride);
                    else block_4(xr, x_stride, rows, wb, ksteps, bb, ob, out_stride);
                }
            } else if (rows == 1) unit_1(xr, x_stride, rows, w, ksteps, b, o, out_stride);
            else if (rows == 2) unit_2(xr, x_stride, rows, w, ksteps, b, o, out_stride);
            else if (rows <= 4) unit_4(xr, x_stride, rows, w, ksteps, b, o, out_stride);
            else unit_6(xr, x_stride, rows, w, ksteps, b, o, out_stride);
        }
    }
    return OK;
}
#endif

#ifdef HAVE_AVX512_BF16
/* The m input rows made from x by `prologue` (PROLOGUE_NONE: copied), each placed by the engine's
 * layout: into A tiles (a, AMX) or as plain contiguous rows of k values (the vector engine).
 * Returns OK or ERR_NOMEM. */
static int make_rows(const uint16_t *x, int64_t x_stride, int prologue, float *residual,
                     int has_residual, const uint16_t *norm_weight, float eps, int64_t m,
                     int64_t k, int tiles, uint16_t *dst, int num_threads) {
    /* Rows are made on the calling thread unless there are many: waking the team costs more
     * than a decode step's rows (the elementwise kernels draw the same line). */
    const int team = m * k * (prologue == PROLOGUE_SILU_AND_MUL ? 2 : 1) >= PARALLEL_PROLOGUE_ELEMS
                         ? (num_threads < 1 ? 1 : num_threads)
                         : 1;
    const int64_t ksteps = k / TILE_K;
    int failed = 0;
#pragma omp parallel num_threads(team)
    {
        uint16_t *row_buf = prologue == PROLOGUE_NONE ? NULL : malloc((size_t)k * sizeof(uint16_t));
        if (prologue != PROLOGUE_NONE && !row_buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < m; row++) {
            const uint16_t *values = x + row * x_stride;
            if (prologue != PROLOGUE_NONE) {
                if (!row_buf) continue;
                if (prologue == PROLOGUE_RMS_NORM)
                    add_rms_norm_row(values, residual + row * k, has_residual, norm_weight,
                                     row_buf, (int)k, eps);
                else
                    silu_and_mul_row(values, row_buf, (int)k);
                values = row_buf;
            }
#ifdef HAVE_AMX
            if (tiles) {
                place_row(dst, ksteps, row, values);
                continue;
            }
#endif
            (void)ksteps, (void)tiles;
            memcpy(dst + row * k, values, (size_t)k * sizeof(uint16_t));
        }
        free(row_buf);
    }
    return failed ? ERR_NOMEM : OK;
}
#endif

/* out[m, n] (bf16, row stride out_stride) = rows · Wᵀ + bias (float32 or NULL), W packed by
 * cpu_gemm.pack, on `kernel`'s engine (KERNEL_AMX or KERNEL_AVX512_BF16), where row r is made
 * from x's row r (bf16, row stride x_stride) by `prologue` on its way into the engine's input,
 * instead of through a tensor and another call:
 * - PROLOGUE_NONE: x's row itself (k values);
 * - PROLOGUE_RMS_NORM: RMSNorm with its residual add, kvfleet_add_rms_norm's arithmetic in bf16
 *   (residual float32 [m, k], contiguous, becomes x + residual, or x when has_residual is 0;
 *   norm_weight [k], eps);
 * - PROLOGUE_SILU_AND_MUL: silu(x[:k]) * x[k:2k], kvfleet_silu_and_mul's arithmetic in bf16.
 * The same bits as the separate kernels then this GEMM on the same engine. */
int kvfleet_linear_bf16(const uint16_t *x, int64_t x_stride, int prologue, float *residual,
                        int has_residual, const uint16_t *norm_weight, float eps,
                        const uint16_t *packed, const float *bias, uint16_t *out,
                        int64_t out_stride, int64_t m, int64_t n, int64_t k, int kernel,
                        int num_threads) {
    if (n % PAIR_COLS || k % TILE_K || m < 1) return ERR_SHAPE;
    if (prologue < PROLOGUE_NONE || prologue > PROLOGUE_SILU_AND_MUL) return ERR_SHAPE;
    if (kernel == KERNEL_AMX) {
#ifdef HAVE_AMX
        if (!amx_permitted()) return ERR_NO_AMX;
        uint16_t *a = alloc_a(m, k / TILE_K);
        if (!a) return ERR_NOMEM;
        const int status = make_rows(x, x_stride, prologue, residual, has_residual,
                                     norm_weight, eps, m, k, 1, a, num_threads);
        if (status != OK) {
            free(a);
            return status;
        }
        return multiply_amx(a, packed, bias, out, out_stride, m, n, k / TILE_K, num_threads);
#else
        return ERR_NO_AMX;
#endif
    }
    if (kernel != KERNEL_AVX512_BF16) return ERR_SHAPE;
#ifdef HAVE_AVX512_BF16
    if (prologue == PROLOGUE_NONE) /* x's rows are read in place */
        return multiply_vectors(x, x_stride, packed, bias, out, out_stride, m, n, k / TILE_K,
                                num_threads);
    uint16_t *rows = malloc((size_t)(m * k) * sizeof(uint16_t));
    if (!rows) return ERR_NOMEM;
    int status = make_rows(x, x_stride, prologue, residual, has_residual, norm_weight, eps, m,
                           k, 0, rows, num_threads);
    if (status == OK)
        status = multiply_vectors(rows, k, packed, bias, out, out_stride, m, n, k / TILE_K,
                                  num_threads);
    free(rows);
    return status;
#else
    (void)x, (void)x_stride, (void)residual, (void)has_residual, (void)norm_weight, (void)eps,
        (void)packed, (void)bias, (void)out, (void)out_stride, (void)num_threads;
    return ERR_NO_AVX512_BF16;
#endif
}

/* 1 where kvfleet_linear_bf16's AMX engine runs here: built for AMX and granted the tile state. */
int kvfleet_linear_amx(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* 1 where its vector engine runs here: built for AVX512-BF16. */
int kvfleet_linear_avx512_bf16(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
