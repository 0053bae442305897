/* Causal prefill attention in float32 arithmetic on AVX-512 or AVX2 + FMA for kvfleet's CPU path: one
 * sequence's query tokens (the last q_len of its seq_len positions) against its K/V read in place
 * from the paged cache, float32 or bf16.
 *
 * Why: float32 is the CPU default where the CPU lacks AVX512-BF16, and there torch's SDPA flash
 * kernel ran at 0.065-0.1 TFLOP/s with head_dim 64 on a 2-core AVX-512 host, a quarter to a
 * third of that host's float32 GEMM rate: 7.9 s of an 85 s standard-workload run.
 *
 * As kernels/cpu/cpu_prefill.c does on AMX tiles, the computation is transposed so that no step
 * needs a horizontal reduction. The 16 lanes of a vector hold 16 rows, a row being one (query
 * token, query head) pair of a kv head's GQA group (row r: token r / G, head r % G), so the G
 * heads that share a K/V row use each of its loads together. A task is one kv head and a tile of
 * TILE rows:
 *   S^T [KEYS keys x TILE rows] = K (each element broadcast from the cache) x Q^T (times scale)
 *   online softmax per lane      (running max and sum; -inf where a key is past a row's position)
 *   O^T [D x TILE rows]          = O^T * correction + V^T (each element broadcast) x P^T
 * Everything stays float32. Results differ from SDPA's by summation order and exp's
 * approximation (within 2 ulp).
 *
 * bf16 inputs (kvfleet_prefill_attention_bf16_vec): where the CPU has AVX-512 but no AMX, the
 * AMX kernel cannot run and torch's SDPA flash kernel took 4.4 ms a layer for a 512-token prompt
 * of the bundled model (a third of that prompt's TTFT on a 2-core AVX512-BF16 host). The same
 * tiles and online softmax take bf16, the output rounded to bf16 (nearest even) as written:
 *   with AVX512-BF16, both products run on vdpbf16ps, two bf16 products summed in float32 per
 *   lane: S^T from the query as (d, d+1) pairs against the key's pair read in place from the
 *   cache; O^T from the probabilities rounded to bf16 as (key, key+1) pairs against V, which
 *   is rearranged into key pairs once per call for all tiles (values_as_pairs). 1.32 ms a
 *   layer there for a 512-token prompt, 3.4x SDPA (`kvfleet bench cpu-kernels`).
 *   without it, each step's K and V rows are widened to float32 (exact) into the task's
 *   working memory and the float32 loops run.
 *
 * Layouts: query [q_len, num_heads, head_dim] float32 (or bf16) with token stride q_stride, heads
 * packed; out the same shape, token stride out_stride; k_cache/v_cache the head-major storage
 * [num_kv_heads, num_blocks, block_size, head_dim] of the same type; block_table int32 for this
 * sequence. head_dim a multiple of 16 up to MAX_HEAD_DIM, any block size. Query head h reads
 * kv head h / (num_heads / num_kv_heads).
 *
 * Built with the other CPU kernels by kernels/cpu/cpu_library.py, for AVX-512 or, on CPUs
 * without it, AVX2 + FMA (kvfleet_prefill_f32_lanes says which); with neither the entry points
 * answer ERR_NO_SIMD and the caller keeps SDPA.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_entry_points.h"
#include "cpu_math.h"
#include "cpu_vec_f32.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_SIMD = 3 };

#define KEYS 32             /* keys per softmax update */
#define MAX_HEAD_DIM 256

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
static inline void scores(float (*p)[TILE], const float *const *krow, const Work *w, int D) {
    vec acc[KEY_GROUP][VECS];
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < VECS; v++) acc[j][v] = vzero();
    for (int d = 0; d < D; d++) {
        vec q[VECS];
        for (int v = 0; v < VECS; v++) q[v] = vload(&w->qt[d][v * LANES]);
        for (int j = 0; j < KEY_GROUP; j++) {
            const vec k = vset1(krow[j][d]);
            for (int v = 0; v < VECS; v++) acc[j][v] = vfma(k, q[v], acc[j][v]);
        }
    }
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < VECS; v++) vstore(&p[j][v * LANES], acc[j][v]);
}

#ifdef __AVX512BF16__
/* scores() on bf16 rows with vdpbf16ps: each lane (a row) multiplies a (d, d+1) pair of its
 * query by the key's pair, read in place from the cache, and adds both products in float32: half
 * the instructions of the widened float32 products, the same bf16 inputs. The scale is applied
 * to the sums (Q^T holds the raw query). */
static inline void scores_bf16(float (*p)[TILE], const uint16_t *const *krow, const Work *w,
                               int D, float scale) {
    __m512 acc[KEY_GROUP][VECS];
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < VECS; v++) acc[j][v] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < D / 2; d2++) {
        __m512bh q[VECS];
        for (int v = 0; v < VECS; v++) q[v] = (__m512bh)_mm512_load_si512(&w->qp[d2][v * LANES]);
        for (int j = 0; j < KEY_GROUP; j++) {
            uint32_t pair;
            memcpy(&pair, krow[j] + 2 * d2, sizeof pair);
            const __m512bh k = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < VECS; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], k, q[v]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < VECS; v++) _mm512_store_ps(&p[j][v * LANES], _mm512_mul_ps(acc[j][v], s));
}

/* accumulate() with vdpbf16ps: each lane multiplies its (key, key + 1) pair of probabilities,
 * rounded to bf16, by the pair of V values broadcast from vt, the step's V^T as pairs
 * [D][KEYS / 2] (values_as_pairs). */
static inline void accumulate_bf16(Work *w, const uint32_t *vt, int n, const __m512 *corr, int D) {
    const int pairs = (n + 1) / 2;
    for (int d0 = 0; d0 < D; d0 += D_CHUNK) {
        __m512 o[D_CHUNK][VECS];
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < VECS; v++)
                o[c][v] = _mm512_mul_ps(_mm512_load_ps(&w->ot[d0 + c][v * LANES]), corr[v]);
        for (int jp = 0; jp < pairs; jp++) {
            __m512bh p[VECS];
            for (int v = 0; v < VECS; v++) p[v] = (__m512bh)_mm512_load_si512(&w->pp[jp][v * LANES]);
            for (int c = 0; c < D_CHUNK; c++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)vt[(d0 + c) * (KEYS / 2) + jp]);
                for (int v = 0; v < VECS; v++) o[c][v] = _mm512_dpbf16_ps(o[c][v], x, p[v]);
            }
        }
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < VECS; v++) _mm512_store_ps(&w->ot[d0 + c][v * LANES], o[c][v]);
    }
}

/* pp[jp] = the step's probabilities of keys 2 jp and 2 jp + 1 as bf16 pairs (0 past key n). */
static inline void probability_pairs(Work *w, int n) {
    for (int jp = 0; jp < (n + 1) / 2; jp++)
        for (int v = 0; v < VECS; v++) {
            const __m512 lo = _mm512_load_ps(&w->p[2 * jp][v * LANES]);
            const __m512 hi = 2 * jp + 1 < n ? _mm512_load_ps(&w->p[2 * jp + 1][v * LANES])
                                             : _mm512_setzero_ps();
            const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
            const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
            _mm512_store_si512(&w->pp[jp][v * LANES], _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
        }
}

/* One kv head's V for keys [k0, k0 + KEYS) as pairs: vt[d][jp] = V[k0 + 2 jp][d] in the low
 * half, V[k0 + 2 jp + 1][d] in the high half, 0 past seq_len. Built once per call and shared
 * by every tile of the head. */
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
        for (int d = 0; d < D; d++)
            vt[d * (KEYS / 2) + jp] =
                (row[0] ? row[0][d] : 0u) | (uint32_t)(row[1] ? row[1][d] : 0u) << 16;
    }
}
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

/* O^T[d] = O^T[d] * corr + sum_j V[j][d] * P^T[j] for the n keys of a step (rows vrow[j]). */
static inline void accumulate(Work *w, const float *const *vrow, int n, const vec *corr,
                              int D) {
    for (int d0 = 0; d0 < D; d0 += D_CHUNK) {
        vec o[D_CHUNK][VECS];
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < VECS; v++) o[c][v] = vmul(vload(&w->ot[d0 + c][v * LANES]), corr[v]);
        for (int j = 0; j < n; j++) {
            vec p[VECS];
            for (int v = 0; v < VECS; v++) p[v] = vload(&w->p[j][v * LANES]);
            for (int c = 0; c < D_CHUNK; c++) {
                const vec x = vset1(vrow[j][d0 + c]);
                for (int v = 0; v < VECS; v++) o[c][v] = vfma(x, p[v], o[c][v]);
            }
        }
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < VECS; v++) vstore(&w->ot[d0 + c][v * LANES], o[c][v]);
    }
}

/* One task: kv head kvh's rows r0 .. r0 + rows - 1 (of q_len * group). query, out, k_head and
 * v_head hold float32, or bf16 where `bf16` is set. */
static void attend_rows(Work *w, const void *query, int64_t q_stride, void *out,
                        int64_t out_stride, const void *k_head, const void *v_head,
                        const uint32_t *vt, const int32_t *table, int seq_len, int q_len,
                        int group, int kvh, int r0, int rows, int D, int block_size, float scale,
                        int bf16) {
    const int first_pos = seq_len - q_len;
    int pos[TILE];
    for (int r = 0; r < TILE; r++) {
        /* Padding rows repeat the last row's position and have Q = 0: their outputs are
         * computed like any other and never written. */
        const int row = r0 + (r < rows ? r : rows - 1);
        pos[r] = first_pos + row / group;
        const int64_t q = (int64_t)(row / group) * q_stride + (int64_t)(kvh * group + row % group) * D;
        if (bf16 && BF16_DOT) {
            const uint16_t *qb = (const uint16_t *)query + q;
            for (int d = 0; d < D; d += 2)
                w->qp[d / 2][r] = r < rows ? (uint32_t)qb[d] | (uint32_t)qb[d + 1] << 16 : 0;
        } else {
            for (int d = 0; d < D; d++)
                w->qt[d][r] = r < rows ? load_act(query, q + d, bf16) * scale : 0.0f;
        }
    }
    memset(w->ot, 0, sizeof(float) * (size_t)D * TILE);
    veci posv[VECS];
    vec m[VECS], l[VECS];
    for (int v = 0; v < VECS; v++) {
        posv[v] = vloadi(pos + v * LANES);
        m[v] = vset1(-INFINITY);
        l[v] = vzero();
    }
    const int last_key = pos[TILE - 1]; /* the tile's last row sees keys 0 .. last_key */
    const int diagonal = pos[0];        /* keys up to here are visible to every row */

    for (int k0 = 0; k0 <= last_key; k0 += KEYS) {
        const int n = last_key + 1 - k0 < KEYS ? last_key + 1 - k0 : KEYS;
        /* Scores come KEY_GROUP keys at a time: the tile's last step scores only the groups
         * its n keys reach. */
        const int scored = (n + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
        const float *krow[KEYS], *vrow[KEYS];
        const uint16_t *kraw[KEYS]; /* bf16 with AVX512-BF16: K rows in place */
        for (int j = 0; j < scored; j++) {
            /* Keys past last_key (never read in P . V) score a valid row, then are masked. */
            const int key = k0 + (j < n ? j : 0);
            const int64_t offset = ((int64_t)table[key / block_size] * block_size +
                                    key % block_size) * D;
            if (bf16) {
                if (BF16_DOT) {
                    kraw[j] = (const uint16_t *)k_head + offset;
                } else {
                    widen_row(w->kw[j], (const uint16_t *)k_head + offset, D);
                    krow[j] = w->kw[j];
                }
                if (!BF16_DOT) {
                    widen_row(w->vw[j], (const uint16_t *)v_head + offset, D);
                    vrow[j] = w->vw[j];
                }
            } else {
                krow[j] = (const float *)k_head + offset;
                vrow[j] = (const float *)v_head + offset;
            }
        }
#if BF16_DOT
        if (bf16)
            for (int j = 0; j < scored; j += KEY_GROUP) scores_bf16(w->p + j, kraw + j, w, D, scale);
        else
#endif
            for (int j = 0; j < scored; j += KEY_GROUP) scores(w->p + j, krow + j, w, D);

        vec step_max[VECS];
        for (int v = 0; v < VECS; v++) step_max[v] = vset1(-INFINITY);
        const int masked = k0 + scored - 1 > diagonal;
        for (int j = 0; j < scored; j++)
            for (int v = 0; v < VECS; v++) {
                vec s = vload(&w->p[j][v * LANES]);
                if (masked) s = mask_past(s, k0 + j, posv[v]);
                vstore(&w->p[j][v * LANES], s);
                step_max[v] = vmax(step_max[v], s);
            }
        /* Online softmax. Key 0 is visible to every row, so m is finite from the first step on
         * and corr = exp(-inf) = 0 there, against an all-zero O^T. */
        vec corr[VECS];
        for (int v = 0; v < VECS; v++) {
            const vec m_new = vmax(m[v], step_max[v]);
            corr[v] = vexp(vsub(m[v], m_new));
            l[v] = vmul(l[v], corr[v]);
            m[v] = m_new;
        }
        for (int j = 0; j < n; j++)
            for (int v = 0; v < VECS; v++) {
                const vec e = vexp(vsub(vload(&w->p[j][v * LANES]), m[v]));
                vstore(&w->p[j][v * LANES], e);
                l[v] = vadd(l[v], e);
            }
#if !BF16_DOT
        (void)vt, (void)kraw;
#else
        if (bf16) {
            probability_pairs(w, n);
            accumulate_bf16(w, vt + (size_t)(k0 / KEYS) * D * (KEYS / 2), n, corr, D);
        } else
#endif
            accumulate(w, vrow, n, corr, D);
    }

    float inv[TILE];
    for (int v = 0; v < VECS; v++) vstoreu(inv + v * LANES, vdiv(vset1(1.0f), l[v]));
    for (int r = 0; r < rows; r++) {
        const int row = r0 + r;
        const int64_t o = (int64_t)(row / group) * out_stride + (int64_t)(kvh * group + row % group) * D;
        for (int d = 0; d < D; d++) store_act(out, o + d, w->ot[d][r] * inv[r], bf16);
    }
}
#endif

/* The vector width this build's kernel runs at: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (none). */
int kvfleet_prefill_f32_lanes(void) {
#if PREFILL_SIMD
    return LANES;
#else
    return 0;
#endif
}

/* Both entry points (layouts in the header comment; bf16 names the element type of query, out
 * and the caches). */
static int prefill(const void *query, int64_t q_stride, void *out, int64_t out_stride,
                   const void *k_cache, const void *v_cache, const int32_t *block_table,
                   int seq_len, int q_len, int num_heads, int num_kv_heads, int head_dim,
                   int block_size, int64_t num_blocks, float scale, int num_threads, int bf16) {
#if !PREFILL_SIMD
    (void)query, (void)q_stride, (void)out, (void)out_stride, (void)k_cache, (void)v_cache;
    (void)block_table, (void)seq_len, (void)q_len, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)block_size, (void)num_blocks, (void)scale, (void)num_threads;
    (void)bf16;
    return ERR_NO_SIMD;
#else
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || q_len <= 0 || q_len > seq_len)
        return ERR_SHAPE;
    const int group = num_heads / num_kv_heads;
    const int64_t head_elems = num_blocks * block_size * head_dim; /* one kv head's cache */
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int rows = q_len * group, tiles = (rows + TILE - 1) / TILE;
    /* bf16 with AVX512-BF16: every kv head's V as key pairs, steps of KEYS keys. */
    const int steps = (seq_len + KEYS - 1) / KEYS;
    const size_t vt_head = (size_t)steps * head_dim * (KEYS / 2);
    uint32_t *vt = NULL;
    if (bf16 && BF16_DOT) {
        vt = aligned_alloc(64, ((vt_head * num_kv_heads * sizeof(uint32_t) + 63) / 64) * 64);
        if (!vt) return ERR_NOMEM;
    }
    int status = OK;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
#if BF16_DOT
        if (vt) {
#pragma omp for schedule(static)
            for (int task = 0; task < num_kv_heads * steps; task++) {
                const int kvh = task / steps, step = task % steps;
                values_as_pairs(vt + kvh * vt_head + (size_t)step * head_dim * (KEYS / 2),
                                (const uint16_t *)v_cache + kvh * head_elems, block_table,
                                seq_len, step * KEYS, head_dim, block_size);
            }
        }
#endif
        /* the loop's implicit barrier: every V pair exists before any tile reads it */
        Work *w = aligned_alloc(64, sizeof(Work));
        if (!w) {
#pragma omp atomic write
            status = ERR_NOMEM;
        }
        /* Later tiles see more keys (causal): hand tasks out one at a time, longest first. */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_kv_heads * tiles; task++) {
            if (!w) continue;
            const int tile = tiles - 1 - task / num_kv_heads, kvh = task % num_kv_heads;
            const int r0 = tile * TILE, n = rows - r0 < TILE ? rows - r0 : TILE;
            attend_rows(w, query, q_stride, out, out_stride,
                        (const char *)k_cache + kvh * head_elems * elem,
                        (const char *)v_cache + kvh * head_elems * elem,
                        vt ? vt + kvh * vt_head : NULL, block_table, seq_len, q_len, group, kvh,
                        r0, n, head_dim, block_size, scale, bf16);
        }
        free(w);
    }
    free(vt);
    return status;
#endif
}

int kvfleet_prefill_attention_f32(const float *query, int64_t q_stride, float *out,
                                  int64_t out_stride, const float *k_cache, const float *v_cache,
                                  const int32_t *block_table, int seq_len, int q_len,
                                  int num_heads, int num_kv_heads, int head_dim, int block_size,
                                  int64_t num_blocks, float scale, int num_threads) {
    return prefill(query, q_stride, out, out_stride, k_cache, v_cache, block_table, seq_len,
                   q_len, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                   num_threads, 0);
}

int kvfleet_prefill_attention_bf16_vec(const uint16_t *query, int64_t q_stride, uint16_t *out,
                                          int64_t out_stride, const uint16_t *k_cache,
                                          const uint16_t *v_cache, const int32_t *block_table,
                                          int seq_len, int q_len, int num_heads,
                                          int num_kv_heads, int head_dim, int block_size,
                                          int64_t num_blocks, float scale, int num_threads) {
    return prefill(query, q_stride, out, out_stride, k_cache, v_cache, block_table, seq_len,
                   q_len, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                   num_threads, 1);
}
