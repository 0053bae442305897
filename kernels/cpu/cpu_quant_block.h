/* The CPU's column-blocked form of the kernels' quantized layout (kernels/quant_weight.py:
 * `to_blocked` repacks each int4/int8 weight once, at load), and the vector primitives that
 * read it: shared by the quantized GEMM (cpu_gemm_quant.c) and its dequantize pass
 * (cpu_quant_dequantize.c). A vector holds BLOCK columns' weights for two consecutive k: one
 * int32 lane per column, two int16 words in it.
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
 *
 * One source for AVX-512 (BLOCK 16) and AVX2 + FMA (BLOCK 8): the vector type is the parameter;
 * without either, BLOCK is undefined and the entry points report ERR_NO_SIMD.
 */
#ifndef KVFLEET_CPU_QUANT_BLOCK_H
#define KVFLEET_CPU_QUANT_BLOCK_H

#include <stdint.h>

#include "cpu_entry_points.h"
#include "cpu_math.h" /* <immintrin.h> */

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_SIMD = 3, ERR_FORMAT = 5 };

#define RUN 32 /* weights per unpacking step: 16 packed int4 bytes, 32 int8 values */

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

#if defined(BLOCK) && !defined(FUSED_DOT)
#define dot_add(acc, w, x) iadd32(acc, madd_words(w, x))
#if BLOCK == 16
#define madd_words(w, x) _mm512_madd_epi16(w, x)
#else
#define madd_words(w, x) _mm256_madd_epi16(w, x)
#endif
#endif

#ifdef BLOCK
/* Whether w, n and k describe a weight in this build's blocked layout. */
static inline int quant_block_valid(const QuantWeight *w, int64_t n, int64_t k) {
    return w && w->q && w->scales && n >= 1 && k >= 1 && w->group >= RUN &&
           w->group % RUN == 0 && k % w->group == 0 && w->block == BLOCK &&
           (w->format == QUANT_INT4 || (w->format == QUANT_INT8 && !w->offsets));
}

/* Step i (0..3) of unpacking a run at `run`: four word vectors and the k pairs they hold (pair
 * p: k = 2p, 2p + 1). int4: load i's low nibbles give pairs 2i, 2i + 1 and its high ones
 * 2i + 8, 2i + 9; int8: pairs 4i .. 4i + 3, one sign-extending load each. */
static inline __attribute__((always_inline)) void four_words(const uint8_t *run, const int int4,
                                                             const int i, ivec words[4],
                                                             int pairs[4]) {
    if (int4) {
        const ivec mask = iset8(0x0F), zero = izero();
        const ivec bytes = iload(run + i * 4 * BLOCK);
        const ivec lo = iand(bytes, mask), hi = iand(isrl4(bytes), mask);
        words[0] = unpack_lo8(lo, zero), words[1] = unpack_hi8(lo, zero);
        words[2] = unpack_lo8(hi, zero), words[3] = unpack_hi8(hi, zero);
        pairs[0] = 2 * i, pairs[1] = 2 * i + 1, pairs[2] = 2 * i + 8, pairs[3] = 2 * i + 9;
    } else {
        for (int v = 0; v < 4; v++) {
            words[v] = words_int8(run + (4 * i + v) * 2 * BLOCK);
            pairs[v] = 4 * i + v;
        }
    }
}
#endif

#endif
