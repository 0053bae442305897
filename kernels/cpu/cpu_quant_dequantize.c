/* The float32 weight a quantized weight in the CPU's blocked layout (cpu_quant_block.h) stands
 * for: what steps past the quantized GEMM's row limit multiply in the float32 GEMM. */

#include <stdint.h>

#include "cpu_quant_block.h"

#ifdef BLOCK
/* A run's 16 pair vectors (k pair p in vector p, column c in int32 lane c), as the GEMM reads
 * them. */
static inline void run_pairs(const uint8_t *run, int int4, ivec pairs[RUN / 2]) {
    for (int i = 0; i < 4; i++) {
        ivec words[4];
        int at[4];
        four_words(run, int4, i, words, at);
        for (int v = 0; v < 4; v++) pairs[at[v]] = words[v];
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
 * for the quantized GEMM: their GEMM then runs on the float paths). Per run, the block's pair
 * vectors are transposed so that a vector holds one column's pairs, i.e. its weights in k
 * order, then widened and scaled: scale x q + offset in one FMA, the same values as
 * kernels/quant_weight.dequantize. */
int kvfleet_dequantize(const QuantWeight *w, float *out, int64_t n, int64_t k, int num_threads) {
    if (!quant_block_valid(w, n, k)) return ERR_FORMAT;
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
int kvfleet_dequantize(const QuantWeight *w, float *out, int64_t n, int64_t k, int num_threads) {
    (void)w, (void)out, (void)n, (void)k, (void)num_threads;
    return ERR_NO_SIMD;
}
#endif
