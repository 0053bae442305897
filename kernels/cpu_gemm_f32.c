/* float32 projections of decode-sized steps on AVX-512: y = x . W^T (+ bias) with W the plain
 * [N, K] weight, read in place.
 *
 * Why: float32 is the CPU default where the CPU lacks AVX512-BF16, and there MKL's GEMM (torch's
 * F.linear) ran the bundled model's projections at 0.10 TFLOP/s with 32 rows and 0.15 with 64,
 * against 0.28 with 2048: at few rows it spends as long repacking the weight as multiplying
 * by it. A serving batch's decode steps are such steps.
 *
 * Here nothing is repacked. Both x's rows and W's rows are contiguous along K, so a micro-tile
 * of MR rows by NR output columns keeps MR x NR vector accumulators of 16 partial sums along K,
 * and one transpose-and-add tree (cpu_math.h's reduce16) turns the 16 of them into the tile's
 * 16 outputs at the end. Columns are the outer loop, split between threads: each W row is read
 * from memory once per call, while x (a few hundred KiB at most) stays in L2. Results differ
 * from MKL's by float32 summation order.
 *
 * Layouts: x [m, k] with row stride x_stride elements; w [n, k] contiguous; bias [n] or NULL;
 * out [m, n] with row stride out_stride. Any m, n, k >= 1 (a partial last step along K is
 * masked; partial tiles repeat their last valid row or column and store only valid outputs).
 */

#include <stddef.h>
#include <stdint.h>

#include "cpu_math.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NO_AVX512 = 3 };

#define LANES 16
#define NR 4 /* output columns per micro-tile */
#define MR 4 /* rows per micro-tile: MR x NR = 16 accumulators, one reduce16 */

#ifdef __AVX512F__
/* One micro-tile: rows xr[0..MR) against weight rows wr[0..NR), each k long. The sums come
 * back in lane i * NR + j for row i, column j. */
static inline __m512 tile(const float *const *xr, const float *const *wr, int64_t k) {
    __m512 acc[MR * NR];
    for (int t = 0; t < MR * NR; t++) acc[t] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + LANES <= k; p += LANES) {
        __m512 xv[MR];
        for (int i = 0; i < MR; i++) xv[i] = _mm512_loadu_ps(xr[i] + p);
        for (int j = 0; j < NR; j++) {
            const __m512 wv = _mm512_loadu_ps(wr[j] + p);
            for (int i = 0; i < MR; i++) acc[i * NR + j] = _mm512_fmadd_ps(xv[i], wv, acc[i * NR + j]);
        }
    }
    if (p < k) {
        const __mmask16 tail = (__mmask16)((1u << (k - p)) - 1);
        __m512 xv[MR];
        for (int i = 0; i < MR; i++) xv[i] = _mm512_maskz_loadu_ps(tail, xr[i] + p);
        for (int j = 0; j < NR; j++) {
            const __m512 wv = _mm512_maskz_loadu_ps(tail, wr[j] + p);
            for (int i = 0; i < MR; i++) acc[i * NR + j] = _mm512_fmadd_ps(xv[i], wv, acc[i * NR + j]);
        }
    }
    return reduce16(acc);
}
#endif

int kvfleet_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias,
                       float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                       int num_threads) {
#ifndef __AVX512F__
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)m, (void)n;
    (void)k, (void)num_threads;
    return ERR_NO_AVX512;
#else
    if (m < 1 || n < 1 || k < 1 || x_stride < k || out_stride < n) return ERR_SHAPE;
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
            _mm512_storeu_ps(sums, tile(xr, wr, k));
            for (int i = 0; i < MR && m0 + i < m; i++)
                for (int j = 0; j < NR && n0 + j < n; j++)
                    out[(m0 + i) * out_stride + n0 + j] =
                        sums[i * NR + j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
    return OK;
#endif
}
