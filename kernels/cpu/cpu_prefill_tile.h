/* The prefill kernel's tile (kernels/cpu/cpu_prefill_f32.c): its sizes, its per-thread working
 * memory and the inner products over one step of KEYS keys, in float32 (scores, accumulate) and
 * with AVX512-BF16's pair products (scores_bf16, accumulate_bf16 and their inputs). The online
 * softmax around them, the work split and the entry points stay in the .c file, the only one
 * that includes this header.
 *
 * The inner products take the tile's width nv (row vectors: 1 or VECS) as a constant of their
 * caller, which is always inlined, so each width compiles to its own register-held loops. */
#ifndef KVFLEET_CPU_PREFILL_TILE_H
#define KVFLEET_CPU_PREFILL_TILE_H

#include <stdint.h>
#include <string.h>

#include "cpu_vec_f32.h"

#define KEYS 32             /* keys per softmax update */
#define MAX_HEAD_DIM 256
/* The inner products and attend() are inlined into attend_narrow and attend_wide (the .c). */
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* One source for AVX-512 and AVX2 + FMA (float32 on CPUs without AVX-512): the vector width
 * and operations come from cpu_vec_f32.h; the register-held blocks shrink with the register
 * file (16 vector registers on AVX2 against 32). */
#define PREFILL_SIMD VEC_F32
#if defined(__AVX512F__)
#define VECS 2      /* row vectors per tile */
#define KEY_GROUP 8 /* keys whose scores are accumulated in registers together */
#define D_CHUNK 8   /* O^T dims held in registers per pass over a step's keys */
#elif PREFILL_SIMD /* AVX2 + FMA */
#define VECS 1 /* 16 registers: one row vector, 8 keys or dims (AVX2 measured 2.5 vs 3.7 ms at 2x4) */
#define KEY_GROUP 8
#define D_CHUNK 8
#endif
#define TILE (LANES * VECS) /* rows per task */

#if PREFILL_SIMD
/* Per-thread working memory (66 KiB with MAX_HEAD_DIM 256: heap, not a worker's stack). */
typedef struct {
    float qt[MAX_HEAD_DIM][TILE]; /* Q^T of the tile, times scale (0 in padding rows) */
    float ot[MAX_HEAD_DIM][TILE]; /* O^T, unnormalised */
    float p[KEYS][TILE];          /* one step's scores, then its probabilities */
    float kw[KEYS][MAX_HEAD_DIM]; /* bf16 inputs: the step's K rows, widened */
    float vw[KEYS][MAX_HEAD_DIM]; /* ... and its V rows */
    uint32_t qp[MAX_HEAD_DIM / 2][TILE]; /* bf16 inputs with AVX512-BF16: Q^T as (d, d+1) pairs */
    uint32_t pp[KEYS / 2][TILE];         /* ... and P^T as (key, key + 1) pairs */
} Work;

/* dst[0 .. D) = the bf16 row src widened to float32 (D a multiple of 16). */
static inline void widen_row(float *dst, const uint16_t *src, int D) {
    for (int d = 0; d < D; d += 16) {
#ifdef __AVX512F__
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
        _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
#else
        for (int h = 0; h < 16; h += 8) {
            const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d + h)));
            _mm256_storeu_ps(dst + d + h, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
#endif
    }
}

/* p[j][:] = K[j] . Q^T for KEY_GROUP keys (rows krow[j] of head_dim floats). */
static ALWAYS_INLINE void scores(float (*p)[TILE], const float *const *krow, const Work *w, int D,
                                 const int nv) {
    vec acc[KEY_GROUP][VECS];
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = vzero();
    for (int d = 0; d < D; d++) {
        vec q[VECS];
        for (int v = 0; v < nv; v++) q[v] = vload(&w->qt[d][v * LANES]);
        for (int j = 0; j < KEY_GROUP; j++) {
            const vec k = vset1(krow[j][d]);
            for (int v = 0; v < nv; v++) acc[j][v] = vfma(k, q[v], acc[j][v]);
        }
    }
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < nv; v++) vstore(&p[j][v * LANES], acc[j][v]);
}

#ifdef __AVX512BF16__
/* scores() on bf16 rows with vdpbf16ps: each lane (a row) multiplies a (d, d+1) pair of its
 * query by the key's pair, read in place from the cache, and adds both products in float32: half
 * the instructions of the widened float32 products, the same bf16 inputs. The scale is applied
 * to the sums (Q^T holds the raw query). */
static ALWAYS_INLINE void scores_bf16(float (*p)[TILE], const uint16_t *const *krow,
                                      const Work *w, int D, float scale, const int nv) {
    __m512 acc[KEY_GROUP][VECS];
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < D / 2; d2++) {
        __m512bh q[VECS];
        for (int v = 0; v < nv; v++) q[v] = (__m512bh)_mm512_load_si512(&w->qp[d2][v * LANES]);
        for (int j = 0; j < KEY_GROUP; j++) {
            uint32_t pair;
            memcpy(&pair, krow[j] + 2 * d2, sizeof pair);
            const __m512bh k = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < nv; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], k, q[v]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < nv; v++) _mm512_store_ps(&p[j][v * LANES], _mm512_mul_ps(acc[j][v], s));
}

/* accumulate() with vdpbf16ps: each lane multiplies its (key, key + 1) pair of probabilities,
 * rounded to bf16, by the pair of V values broadcast from vt, the step's V as pairs
 * [KEYS / 2][D] (values_as_pairs). */
static ALWAYS_INLINE void accumulate_bf16(Work *w, const uint32_t *vt, int n, const __m512 *corr,
                                          int D, const int nv) {
    const int pairs = (n + 1) / 2;
    for (int d0 = 0; d0 < D; d0 += D_CHUNK) {
        __m512 o[D_CHUNK][VECS];
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < nv; v++)
                o[c][v] = _mm512_mul_ps(_mm512_load_ps(&w->ot[d0 + c][v * LANES]), corr[v]);
        for (int jp = 0; jp < pairs; jp++) {
            __m512bh p[VECS];
            for (int v = 0; v < nv; v++) p[v] = (__m512bh)_mm512_load_si512(&w->pp[jp][v * LANES]);
            for (int c = 0; c < D_CHUNK; c++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)vt[jp * D + d0 + c]);
                for (int v = 0; v < nv; v++) o[c][v] = _mm512_dpbf16_ps(o[c][v], x, p[v]);
            }
        }
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < nv; v++) _mm512_store_ps(&w->ot[d0 + c][v * LANES], o[c][v]);
    }
}

/* pp[jp] = the step's probabilities of keys 2 jp and 2 jp + 1 as bf16 pairs (0 past key n). */
static ALWAYS_INLINE void probability_pairs(Work *w, int n, const int nv) {
    for (int jp = 0; jp < (n + 1) / 2; jp++)
        for (int v = 0; v < nv; v++) {
            const __m512 lo = _mm512_load_ps(&w->p[2 * jp][v * LANES]);
            const __m512 hi = 2 * jp + 1 < n ? _mm512_load_ps(&w->p[2 * jp + 1][v * LANES])
                                             : _mm512_setzero_ps();
            const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
            const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
            _mm512_store_si512(&w->pp[jp][v * LANES], _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
        }
}

/* One kv head's V for keys [k0, k0 + KEYS) as pairs: vt[jp][d] = V[k0 + 2 jp][d] in the low
 * half, V[k0 + 2 jp + 1][d] in the high half, 0 past seq_len. Built once per call and shared
 * by every tile of the head; two rows' dims widen and interleave 16 at a time, so a short
 * query's call spends little beside its tiles on it. */
static void values_as_pairs(uint32_t *vt, const uint16_t *v_head, const int32_t *table,
                            int seq_len, int k0, int D, int block_size) {
    for (int jp = 0; jp < KEYS / 2; jp++) {
        const uint16_t *row[2] = {NULL, NULL};
        for (int h = 0; h < 2; h++) {
            const int key = k0 + 2 * jp + h;
            if (key < seq_len)
                row[h] = v_head + ((int64_t)table[key / block_size] * block_size +
                                   key % block_size) * D;
        }
        for (int d = 0; d < D; d += 16) {
            __m512i half[2];
            for (int h = 0; h < 2; h++)
                half[h] = row[h] ? _mm512_cvtepu16_epi32(
                                       _mm256_loadu_si256((const __m256i *)(row[h] + d)))
                                 : _mm512_setzero_si512();
            const __m512i pair = _mm512_or_si512(half[0], _mm512_slli_epi32(half[1], 16));
            _mm512_storeu_si512(vt + jp * D + d, pair);
        }
    }
}
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

/* O^T[d] = O^T[d] * corr + sum_j V[j][d] * P^T[j] for the n keys of a step (rows vrow[j]). */
static ALWAYS_INLINE void accumulate(Work *w, const float *const *vrow, int n, const vec *corr,
                                     int D, const int nv) {
    for (int d0 = 0; d0 < D; d0 += D_CHUNK) {
        vec o[D_CHUNK][VECS];
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < nv; v++) o[c][v] = vmul(vload(&w->ot[d0 + c][v * LANES]), corr[v]);
        for (int j = 0; j < n; j++) {
            vec p[VECS];
            for (int v = 0; v < nv; v++) p[v] = vload(&w->p[j][v * LANES]);
            for (int c = 0; c < D_CHUNK; c++) {
                const vec x = vset1(vrow[j][d0 + c]);
                for (int v = 0; v < nv; v++) o[c][v] = vfma(x, p[v], o[c][v]);
            }
        }
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < nv; v++) vstore(&w->ot[d0 + c][v * LANES], o[c][v]);
    }
}

#endif /* PREFILL_SIMD */
#endif /* KVFLEET_CPU_PREFILL_TILE_H */
