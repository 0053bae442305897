/* Float32 vectors of the build's width behind one set of names, for CPU kernels written once for
 * AVX-512 (16 lanes) and AVX2 + FMA (8 lanes, float32 on CPUs without AVX-512): the types vec
 * and veci (its lanes as int32), LANES, the operations v*() and mask_past. VEC_F32 is 1 where
 * the build has either instruction set; where it has neither it is 0 and nothing else is
 * defined. Used by cpu_prefill_f32.c, whose file keeps the algorithm and its register blocking
 * while this one holds the instruction set it runs on. */
#ifndef KVFLEET_CPU_VEC_F32_H
#define KVFLEET_CPU_VEC_F32_H

#include "cpu_math.h" /* exp16, exp8 and <immintrin.h> */

#if defined(__AVX512F__)
#define VEC_F32 1
#define LANES 16
typedef __m512 vec;
typedef __m512i veci;
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vload(p) _mm512_load_ps(p)
#define vstore(p, v) _mm512_store_ps(p, v)
#define vstoreu(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vdiv(a, b) _mm512_div_ps(a, b)
#define vexp(x) exp16(x)
#define vloadi(p) _mm512_loadu_si512(p)
/* s with -inf in the lanes whose position is before `key` (a key past the row's own). */
static inline vec mask_past(vec s, int key, veci pos) {
    return _mm512_mask_mov_ps(s, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(key), pos),
                              _mm512_set1_ps(-INFINITY));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_F32 1
#define LANES 8
typedef __m256 vec;
typedef __m256i veci;
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vload(p) _mm256_load_ps(p)
#define vstore(p, v) _mm256_store_ps(p, v)
#define vstoreu(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vdiv(a, b) _mm256_div_ps(a, b)
#define vexp(x) exp8(x)
#define vloadi(p) _mm256_loadu_si256((const __m256i *)(p))
static inline vec mask_past(vec s, int key, veci pos) {
    const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(key), pos));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), past);
}
#else
#define VEC_F32 0
#endif

#endif
