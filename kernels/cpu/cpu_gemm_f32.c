/* float32 projections of decode-sized steps on AVX-512 or AVX2 + FMA: y = x . W^T (+ bias) with
 * W the plain [N, K] weight, read in place.
 *
 * Why: float32 is the CPU default where the CPU lacks AVX512-BF16, and there MKL's GEMM (torch's
 * F.linear) ran the bundled model's projections at 0.10 TFLOP/s with 32 rows and 0.15 with 64,
 * against 0.28 with 2048: at few rows it spends as long repacking the weight as multiplying
 * by it. A serving batch's decode steps are such steps.
 *
 * Here the weight is never repacked, and each W row is read from memory once per call: columns
 * are the outer loop, split between threads. Two forms, by row count:
 * - Up to DOT_MAX_ROWS rows (16 on AVX-512, 1 on AVX2), dot form: a micro-tile of MR rows by
 *   NR columns keeps MR x NR vector accumulators of 16 partial sums along K (x's and W's rows
 *   are both contiguous along K), and one transpose-and-add tree (cpu_math.h's reduce16) turns
 *   them into the tile's 16 outputs. x's few rows stay in L1.
 * - Above, rows in lanes: x is transposed once per call into xT [K, rows padded to 16], and a
 *   panel of PR columns keeps MV x PR accumulators, each 16 rows of one column. Per k it loads
 *   MV vectors of xT and broadcasts PR scalars of W straight from the weight rows, so no sums
 *   need reducing and x's traffic from L2 is MV vectors per MV x PR FMAs; in the dot form it is
 *   a vector per NR FMAs, which at 32 rows (x no longer in L1) held it to MKL's speed.
 *   Each panel's rows are prefetched into L1 ahead of use and the next panel's into L2, since
 *   PR interleaved row streams are more than the hardware prefetcher follows.
 * Results differ from MKL's by float32 summation order.
 *
 * One source for both instruction sets: the vector width (LANES: 16 on AVX-512, 8 on AVX2) and
 * a handful of operations are macros below, and the tile and panel shapes follow from the
 * register count (32 vector registers on AVX-512, 16 on AVX2). AVX2-only CPUs (AMD before Zen
 * 4, many Intel parts) pick float32, and there MKL's GEMM at 4 rows ran at ~22 GFLOP/s, twice
 * a one-row step's time for what should cost the same weight stream.
 *
 * Layouts: x [m, k] with row stride x_stride elements; w [n, k] contiguous; bias [n] or NULL;
 * out [m, n] with row stride out_stride. Any m, n, k >= 1 (dot form: a partial last step along K
 * is masked, partial tiles repeat their last valid row or column; rows in lanes: padded rows are
 * zeros and a partial panel repeats its last column; only valid outputs are stored).
 */

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_entry_points.h"
#include "cpu_math.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_SIMD = 3 };

#define NR 4 /* output columns per micro-tile */
#define PREFETCH_AHEAD 128 /* elements along a W row fetched into L1 ahead of use (8 lines) */
#define LINE_FLOATS 16     /* floats per 64-byte cache line */

#if defined(__AVX512F__)
#define GEMM_SIMD 1
#define LANES 16
#define MR 4 /* rows per micro-tile: MR x NR = LANES accumulators, one reduce */
#define DOT_MAX_ROWS 16 /* the dot form's last row count; measured in `kvfleet bench cpu-kernels` */
typedef __m512 vec;
typedef __m512i veci;
#define vzero() _mm512_setzero_ps()
#define vloadu(p) _mm512_loadu_ps(p)
#define vstoreu(p, v) _mm512_storeu_ps(p, v)
#define vstore(p, v) _mm512_store_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vset1(x) _mm512_set1_ps(x)
#define reduce_lanes reduce16
/* The first n (< LANES) floats at p, zeros after. */
static inline vec vload_first(const float *p, int64_t n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline veci lane_offsets_of(int64_t stride) {
    return _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
}
/* The first `valid` lanes gathered from base + offsets[i], zeros after. */
static inline vec gather_first(const float *base, veci offsets, int64_t valid) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), (__mmask16)((1u << valid) - 1), offsets,
                                    base, 4);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_SIMD 1
#define LANES 8
#define MR 2
/* Built for AVX2, rows in lanes took 1.3-1.9x less time than the dot form at 2-16 rows (a step's
 * projections of the bundled model, `kvfleet bench cpu-kernels` emulated on a Zen 4 host,
 * docs/benchmarks.md): the dot form's 2 x 4 micro-tiles pass over each weight tile once per 2
 * rows, rows in lanes once. At 1 row the two were within noise, and the dot form needs no
 * transpose. */
#define DOT_MAX_ROWS 1
typedef __m256 vec;
typedef __m256i veci;
#define vzero() _mm256_setzero_ps()
#define vloadu(p) _mm256_loadu_ps(p)
#define vstoreu(p, v) _mm256_storeu_ps(p, v)
#define vstore(p, v) _mm256_store_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vset1(x) _mm256_set1_ps(x)
#define reduce_lanes reduce8
static inline veci first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec vload_first(const float *p, int64_t n) {
    return _mm256_maskload_ps(p, first_lanes(n));
}
static inline veci lane_offsets_of(int64_t stride) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                              _mm256_set1_epi32((int)stride));
}
static inline vec gather_first(const float *base, veci offsets, int64_t valid) {
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, offsets,
                                    _mm256_castsi256_ps(first_lanes(valid)), 4);
}
#else
#define GEMM_SIMD 0
#endif

#if GEMM_SIMD
/* One micro-tile: rows xr[0..MR) against weight rows wr[0..NR), each k long. The sums come
 * back in lane i * NR + j for row i, column j. */
static inline vec tile(const float *const *xr, const float *const *wr, int64_t k) {
    vec acc[MR * NR];
    for (int t = 0; t < MR * NR; t++) acc[t] = vzero();
    int64_t p = 0;
    for (; p + LANES <= k; p += LANES) {
        vec xv[MR];
        for (int i = 0; i < MR; i++) xv[i] = vloadu(xr[i] + p);
        for (int j = 0; j < NR; j++) {
            const vec wv = vloadu(wr[j] + p);
            for (int i = 0; i < MR; i++) acc[i * NR + j] = vfma(xv[i], wv, acc[i * NR + j]);
        }
    }
    if (p < k) {
        vec xv[MR];
        for (int i = 0; i < MR; i++) xv[i] = vload_first(xr[i] + p, k - p);
        for (int j = 0; j < NR; j++) {
            const vec wv = vload_first(wr[j] + p, k - p);
            for (int i = 0; i < MR; i++) acc[i * NR + j] = vfma(xv[i], wv, acc[i * NR + j]);
        }
    }
    return reduce_lanes(acc);
}

/* `tile` with the weight rows read one after the other, each from start to end, so that a
 * thread's columns are one stream through memory; each sum runs along K in the same order, so
 * the same bits. For steps of up to STREAM_MAX_ROWS rows: read side by side (NR streams 4k
 * bytes apart, each ending after k floats) a one-row step's projections streamed at 21-28 GB/s
 * where the same bytes touched in order read 34-38, this way at 34-38 (2-core Zen 4, the
 * AVX-512 and AVX2 builds alike), and at 3 rows 3% less time. At 4-16 rows, where x's MR
 * loads per weight vector cost more than the streams, it took 4-18% longer. */
#define STREAM_MAX_ROWS 3
static inline vec tile_streamed(const float *const *xr, const float *const *wr, int64_t k) {
    vec acc[MR * NR];
    for (int j = 0; j < NR; j++) {
        vec a[MR];
        for (int i = 0; i < MR; i++) a[i] = vzero();
        int64_t p = 0;
        for (; p + LANES <= k; p += LANES) {
            const vec wv = vloadu(wr[j] + p);
            for (int i = 0; i < MR; i++) a[i] = vfma(vloadu(xr[i] + p), wv, a[i]);
        }
        if (p < k) {
            const vec wv = vload_first(wr[j] + p, k - p);
            for (int i = 0; i < MR; i++) a[i] = vfma(vload_first(xr[i] + p, k - p), wv, a[i]);
        }
        for (int i = 0; i < MR; i++) acc[i * NR + j] = a[i];
    }
    return reduce_lanes(acc);
}

/* A panel of PR columns n0.. for the MV row vectors v0.. of xT (rows padded to mp): MV x PR
 * accumulators, each holding LANES rows of one column. A macro per (MV, PR) so that the
 * accumulators are registers: at most 24 of them on AVX-512 (32 registers) and 12 on AVX2 (16)
 * leave room for the MV xT vectors and a broadcast. */
#define ROWS_IN_LANES_PANEL(MV, PR)                                                             \
    static void panel_##MV##x##PR(const float *xT, int64_t mp, int64_t v0, const float *w,     \
                                  int64_t n0, int64_t n, int64_t k, const float *bias,         \
                                  float *out, int64_t out_stride, int64_t m) {                 \
        const float *wr[PR];                                                                   \
        for (int j = 0; j < PR; j++) wr[j] = w + (n0 + j < n ? n0 + j : n - 1) * k;            \
        /* The next panel's rows are contiguous: fetch a line of it per row and 16 k into L2, \
         * which covers it exactly by the time this panel ends (byte offsets into w). */       \
        const int64_t next = (n0 + PR) * k * (int64_t)sizeof(float);                           \
        const int64_t end = n * k * (int64_t)sizeof(float);                                    \
        vec acc[MV][PR];                                                                       \
        _Pragma("GCC unroll 32") for (int v = 0; v < MV; v++)                                  \
            _Pragma("GCC unroll 32") for (int j = 0; j < PR; j++) acc[v][j] = vzero();         \
        const float *xp = xT + v0 * LANES;                                                     \
        for (int64_t p = 0; p < k; p++, xp += mp) {                                            \
            if ((p & (LINE_FLOATS - 1)) == 0) {                                                \
                _Pragma("GCC unroll 32") for (int j = 0; j < PR; j++)                          \
                    _mm_prefetch((const char *)(wr[j] + p + PREFETCH_AHEAD), _MM_HINT_T0);     \
                const int64_t line = next + (p / LINE_FLOATS) * PR * 64;                       \
                if (line + PR * 64 <= end)                                                     \
                    _Pragma("GCC unroll 32") for (int j = 0; j < PR; j++)                      \
                        _mm_prefetch((const char *)w + line + j * 64, _MM_HINT_T1);            \
            }                                                                                  \
            vec xv[MV];                                                                        \
            _Pragma("GCC unroll 32") for (int v = 0; v < MV; v++)                              \
                xv[v] = vloadu(xp + v * LANES);                                                \
            _Pragma("GCC unroll 32") for (int j = 0; j < PR; j++) {                            \
                const vec wb = vset1(wr[j][p]);                                                \
                _Pragma("GCC unroll 32") for (int v = 0; v < MV; v++)                          \
                    acc[v][j] = vfma(xv[v], wb, acc[v][j]);                                    \
            }                                                                                  \
        }                                                                                      \
        for (int v = 0; v < MV; v++) {                                                         \
            float cols[PR][LANES];                                                             \
            _Pragma("GCC unroll 32") for (int j = 0; j < PR; j++)                              \
                vstoreu(cols[j], acc[v][j]);                                                   \
            for (int r = 0; r < LANES && (v0 + v) * LANES + r < m; r++) {                      \
                float *row = out + ((v0 + v) * LANES + r) * out_stride;                        \
                for (int j = 0; j < PR && n0 + j < n; j++)                                     \
                    row[n0 + j] = cols[j][r] + (bias ? bias[n0 + j] : 0.0f);                   \
            }                                                                                  \
        }                                                                                      \
    }
ROWS_IN_LANES_PANEL(1, 12)
#if LANES == 16
ROWS_IN_LANES_PANEL(2, 12)
ROWS_IN_LANES_PANEL(3, 8)
ROWS_IN_LANES_PANEL(4, 6)
/* More than 4 row vectors: passes of two over each panel, an odd last one alone. */
#define PAIR_PANEL panel_2x12
#define TAIL_PANEL panel_1x12
#else
ROWS_IN_LANES_PANEL(1, 6)
ROWS_IN_LANES_PANEL(2, 6)
#define PAIR_PANEL panel_2x6
#define TAIL_PANEL panel_1x6 /* an odd last vector over the same 6 columns */
#endif

/* Column p of x as row p of xT: m values x_stride apart gathered LANES rows at a time, rows
 * past m zeroed. A scalar transpose (one strided load per element, on one thread) took 13-17%
 * of a 32-64-row call; gathers on both threads cost a fraction of that. */
static inline void pack_column(float *xT_row, const float *x_col, int64_t x_stride, int64_t m,
                               int64_t mv, veci lane_offsets) {
    for (int64_t v = 0; v < mv; v++) {
        const int64_t r0 = v * LANES, valid = m - r0 < LANES ? m - r0 : LANES;
        vstore(xT_row + r0, gather_first(x_col + r0 * x_stride, lane_offsets, valid));
    }
}

/* Rows in lanes for m > DOT_MAX_ROWS. On AVX-512 up to 4 row vectors run as one panel shape;
 * more run as 2-vector passes (and a 1-vector tail) over each 12-column panel, which the first
 * pass left in L1 or L2. On AVX2 (8 rows a vector) the passes are of 2 vectors over 6-column
 * panels, and one vector alone takes 12 columns. */
static int rows_in_lanes(const float *x, int64_t x_stride, const float *w, const float *bias,
                         float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                         int num_threads) {
    const int64_t mv = (m + LANES - 1) / LANES, mp = mv * LANES;
    if (x_stride > INT32_MAX / LANES) return ERR_SHAPE; /* gather offsets are 32-bit */
    float *xT = aligned_alloc(64, (size_t)(k * mp) * sizeof(float));
    if (!xT) return ERR_NOMEM;
    const veci lane_offsets = lane_offsets_of(x_stride);
#if LANES == 16
    const int pr = mv == 3 ? 8 : mv == 4 ? 6 : 12;
#else
    const int pr = mv == 1 ? 12 : 6;
#endif
    const int64_t panels = (n + pr - 1) / pr;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < k; p++) pack_column(xT + p * mp, x + p, x_stride, m, mv, lane_offsets);
        /* (the loop's implicit barrier: every panel reads all of xT) */
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            const int64_t n0 = pi * pr;
#if LANES == 16
            if (mv == 3) { panel_3x8(xT, mp, 0, w, n0, n, k, bias, out, out_stride, m); continue; }
            if (mv == 4) { panel_4x6(xT, mp, 0, w, n0, n, k, bias, out, out_stride, m); continue; }
#else
            if (mv == 1) { panel_1x12(xT, mp, 0, w, n0, n, k, bias, out, out_stride, m); continue; }
#endif
            int64_t v0 = 0;
            for (; v0 + 2 <= mv; v0 += 2) PAIR_PANEL(xT, mp, v0, w, n0, n, k, bias, out, out_stride, m);
            if (v0 < mv) TAIL_PANEL(xT, mp, v0, w, n0, n, k, bias, out, out_stride, m);
        }
    }
    free(xT);
    return OK;
}
#endif

/* The vector width this build's kernel runs at: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (none:
 * kvfleet_linear_f32 answers ERR_NO_SIMD). */
int kvfleet_linear_f32_lanes(void) {
#if GEMM_SIMD
    return LANES;
#else
    return 0;
#endif
}

int kvfleet_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias,
                       float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                       int num_threads) {
#if !GEMM_SIMD
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)m, (void)n;
    (void)k, (void)num_threads;
    return ERR_NO_SIMD;
#else
    if (m < 1 || n < 1 || k < 1 || x_stride < k || out_stride < n) return ERR_SHAPE;
    if (m > DOT_MAX_ROWS)
        return rows_in_lanes(x, x_stride, w, bias, out, out_stride, m, n, k, num_threads);
    const int64_t col_tiles = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t ct = 0; ct < col_tiles; ct++) {
        const int64_t n0 = ct * NR;
        const float *wr[NR];
        for (int j = 0; j < NR; j++) wr[j] = w + (n0 + j < n ? n0 + j : n - 1) * k;
        for (int64_t m0 = 0; m0 < m; m0 += MR) {
            const float *xr[MR];
            for (int i = 0; i < MR; i++) xr[i] = x + (m0 + i < m ? m0 + i : m - 1) * x_stride;
            float sums[MR * NR];
            vstoreu(sums, m <= STREAM_MAX_ROWS ? tile_streamed(xr, wr, k) : tile(xr, wr, k));
            for (int i = 0; i < MR && m0 + i < m; i++)
                for (int j = 0; j < NR && n0 + j < n; j++)
                    out[(m0 + i) * out_stride + n0 + j] =
                        sums[i * NR + j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
    return OK;
#endif
}
