/* Causal prefill attention in float32 arithmetic on AVX-512 for kvfleet's CPU path: one
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
 * bf16 inputs (kvfleet_prefill_attention_bf16_avx512): where the CPU has AVX-512 but no AMX, the
 * AMX kernel cannot run and torch's SDPA flash kernel took 4.7 ms a layer for a 512-token prompt
 * of the bundled model (a third of that prompt's TTFT on a 2-core AVX512-BF16 host). The same
 * kernel takes bf16: each step's K and V rows are widened to float32 once (exact: a shift) into
 * the task's working memory, the query once per tile, so the inner loops are the float32 ones
 * above, and the output is rounded to bf16 (nearest even) as it is written.
 *
 * Layouts: query [q_len, num_heads, head_dim] float32 with token stride q_stride elements, heads
 * packed; out the same shape, token stride out_stride; k_cache/v_cache the head-major storage
 * [num_kv_heads, num_blocks, block_size, head_dim] float32; block_table int32 for this
 * sequence. head_dim a multiple of 16 up to MAX_HEAD_DIM, any block size. Query head h reads
 * kv head h / (num_heads / num_kv_heads).
 *
 * Built with the other CPU kernels by kernels/cpu/cpu_library.py. Without AVX-512 the entry point
 * answers ERR_NO_AVX512 and the caller keeps SDPA.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_AVX512 = 3 };

#define LANES 16
#define VECS 2              /* row vectors per tile */
#define TILE (LANES * VECS) /* rows per task */
#define KEYS 32             /* keys per softmax update */
#define KEY_GROUP 8         /* keys whose scores are accumulated in registers together */
#define D_CHUNK 8           /* O^T dims held in registers per pass over a step's keys */
#define MAX_HEAD_DIM 256

#ifdef __AVX512F__
/* Per-thread working memory (66 KiB with MAX_HEAD_DIM 256: heap, not a worker's stack). */
typedef struct {
    float qt[MAX_HEAD_DIM][TILE]; /* Q^T of the tile, times scale (0 in padding rows) */
    float ot[MAX_HEAD_DIM][TILE]; /* O^T, unnormalised */
    float p[KEYS][TILE];          /* one step's scores, then its probabilities */
    float kw[KEYS][MAX_HEAD_DIM]; /* bf16 inputs: the step's K rows, widened */
    float vw[KEYS][MAX_HEAD_DIM]; /* ... and its V rows */
} Work;

/* dst[0 .. D) = the bf16 row src widened to float32 (D a multiple of 16). */
static inline void widen_row(float *dst, const uint16_t *src, int D) {
    for (int d = 0; d < D; d += LANES) {
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
        _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
    }
}

/* p[j][:] = K[j] . Q^T for KEY_GROUP keys (rows krow[j] of head_dim floats). */
static inline void scores(float (*p)[TILE], const float *const *krow, const Work *w, int D) {
    __m512 acc[KEY_GROUP][VECS];
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < VECS; v++) acc[j][v] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 q[VECS];
        for (int v = 0; v < VECS; v++) q[v] = _mm512_load_ps(&w->qt[d][v * LANES]);
        for (int j = 0; j < KEY_GROUP; j++) {
            const __m512 k = _mm512_set1_ps(krow[j][d]);
            for (int v = 0; v < VECS; v++) acc[j][v] = _mm512_fmadd_ps(k, q[v], acc[j][v]);
        }
    }
    for (int j = 0; j < KEY_GROUP; j++)
        for (int v = 0; v < VECS; v++) _mm512_store_ps(&p[j][v * LANES], acc[j][v]);
}

/* O^T[d] = O^T[d] * corr + sum_j V[j][d] * P^T[j] for the n keys of a step (rows vrow[j]). */
static inline void accumulate(Work *w, const float *const *vrow, int n, const __m512 *corr,
                              int D) {
    for (int d0 = 0; d0 < D; d0 += D_CHUNK) {
        __m512 o[D_CHUNK][VECS];
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < VECS; v++)
                o[c][v] = _mm512_mul_ps(_mm512_load_ps(&w->ot[d0 + c][v * LANES]), corr[v]);
        for (int j = 0; j < n; j++) {
            __m512 p[VECS];
            for (int v = 0; v < VECS; v++) p[v] = _mm512_load_ps(&w->p[j][v * LANES]);
            for (int c = 0; c < D_CHUNK; c++) {
                const __m512 x = _mm512_set1_ps(vrow[j][d0 + c]);
                for (int v = 0; v < VECS; v++) o[c][v] = _mm512_fmadd_ps(x, p[v], o[c][v]);
            }
        }
        for (int c = 0; c < D_CHUNK; c++)
            for (int v = 0; v < VECS; v++) _mm512_store_ps(&w->ot[d0 + c][v * LANES], o[c][v]);
    }
}

/* One task: kv head kvh's rows r0 .. r0 + rows - 1 (of q_len * group). query, out, k_head and
 * v_head hold float32, or bf16 where `bf16` is set. */
static void attend_rows(Work *w, const void *query, int64_t q_stride, void *out,
                        int64_t out_stride, const void *k_head, const void *v_head,
                        const int32_t *table, int seq_len, int q_len, int group, int kvh, int r0,
                        int rows, int D, int block_size, float scale, int bf16) {
    const int first_pos = seq_len - q_len;
    int pos[TILE];
    for (int r = 0; r < TILE; r++) {
        /* Padding rows repeat the last row's position and have Q = 0: their outputs are
         * computed like any other and never written. */
        const int row = r0 + (r < rows ? r : rows - 1);
        pos[r] = first_pos + row / group;
        const int64_t q = (int64_t)(row / group) * q_stride + (int64_t)(kvh * group + row % group) * D;
        for (int d = 0; d < D; d++) w->qt[d][r] = r < rows ? load_act(query, q + d, bf16) * scale : 0.0f;
    }
    memset(w->ot, 0, sizeof(float) * (size_t)D * TILE);
    __m512i posv[VECS];
    __m512 m[VECS], l[VECS];
    for (int v = 0; v < VECS; v++) {
        posv[v] = _mm512_loadu_si512(pos + v * LANES);
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
    }
    const int last_key = pos[TILE - 1]; /* the tile's last row sees keys 0 .. last_key */
    const int diagonal = pos[0];        /* keys up to here are visible to every row */

    for (int k0 = 0; k0 <= last_key; k0 += KEYS) {
        const int n = last_key + 1 - k0 < KEYS ? last_key + 1 - k0 : KEYS;
        /* Scores come KEY_GROUP keys at a time: the tile's last step scores only the groups
         * its n keys reach. */
        const int scored = (n + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
        const float *krow[KEYS], *vrow[KEYS];
        for (int j = 0; j < scored; j++) {
            /* Keys past last_key (never read in P . V) score a valid row, then are masked. */
            const int key = k0 + (j < n ? j : 0);
            const int64_t offset = ((int64_t)table[key / block_size] * block_size +
                                    key % block_size) * D;
            if (bf16) {
                widen_row(w->kw[j], (const uint16_t *)k_head + offset, D);
                widen_row(w->vw[j], (const uint16_t *)v_head + offset, D);
                krow[j] = w->kw[j];
                vrow[j] = w->vw[j];
            } else {
                krow[j] = (const float *)k_head + offset;
                vrow[j] = (const float *)v_head + offset;
            }
        }
        for (int j = 0; j < scored; j += KEY_GROUP) scores(w->p + j, krow + j, w, D);

        __m512 step_max[VECS];
        for (int v = 0; v < VECS; v++) step_max[v] = _mm512_set1_ps(-INFINITY);
        const int masked = k0 + scored - 1 > diagonal;
        for (int j = 0; j < scored; j++)
            for (int v = 0; v < VECS; v++) {
                __m512 s = _mm512_load_ps(&w->p[j][v * LANES]);
                if (masked) {
                    const __mmask16 past =
                        _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(k0 + j), posv[v]);
                    s = _mm512_mask_mov_ps(s, past, _mm512_set1_ps(-INFINITY));
                }
                _mm512_store_ps(&w->p[j][v * LANES], s);
                step_max[v] = _mm512_max_ps(step_max[v], s);
            }
        /* Online softmax. Key 0 is visible to every row, so m is finite from the first step on
         * and corr = exp(-inf) = 0 there, against an all-zero O^T. */
        __m512 corr[VECS];
        for (int v = 0; v < VECS; v++) {
            const __m512 m_new = _mm512_max_ps(m[v], step_max[v]);
            corr[v] = exp16(_mm512_sub_ps(m[v], m_new));
            l[v] = _mm512_mul_ps(l[v], corr[v]);
            m[v] = m_new;
        }
        for (int j = 0; j < n; j++)
            for (int v = 0; v < VECS; v++) {
                const __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(&w->p[j][v * LANES]), m[v]));
                _mm512_store_ps(&w->p[j][v * LANES], e);
                l[v] = _mm512_add_ps(l[v], e);
            }
        accumulate(w, vrow, n, corr, D);
    }

    float inv[TILE];
    for (int v = 0; v < VECS; v++)
        _mm512_storeu_ps(inv + v * LANES, _mm512_div_ps(_mm512_set1_ps(1.0f), l[v]));
    for (int r = 0; r < rows; r++) {
        const int row = r0 + r;
        const int64_t o = (int64_t)(row / group) * out_stride + (int64_t)(kvh * group + row % group) * D;
        for (int d = 0; d < D; d++) store_act(out, o + d, w->ot[d][r] * inv[r], bf16);
    }
}
#endif

/* Both entry points (layouts in the header comment; bf16 names the element type of query, out
 * and the caches). */
static int prefill(const void *query, int64_t q_stride, void *out, int64_t out_stride,
                   const void *k_cache, const void *v_cache, const int32_t *block_table,
                   int seq_len, int q_len, int num_heads, int num_kv_heads, int head_dim,
                   int block_size, int64_t num_blocks, float scale, int num_threads, int bf16) {
#ifndef __AVX512F__
    (void)query, (void)q_stride, (void)out, (void)out_stride, (void)k_cache, (void)v_cache;
    (void)block_table, (void)seq_len, (void)q_len, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)block_size, (void)num_blocks, (void)scale, (void)num_threads;
    (void)bf16;
    return ERR_NO_AVX512;
#else
    if (head_dim <= 0 || head_dim % LANES != 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || q_len <= 0 || q_len > seq_len)
        return ERR_SHAPE;
    const int group = num_heads / num_kv_heads;
    const int64_t head_elems = num_blocks * block_size * head_dim; /* one kv head's cache */
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int rows = q_len * group, tiles = (rows + TILE - 1) / TILE;
    int status = OK;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
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
                        (const char *)v_cache + kvh * head_elems * elem, block_table, seq_len,
                        q_len, group, kvh, r0, n, head_dim, block_size, scale, bf16);
        }
        free(w);
    }
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

int kvfleet_prefill_attention_bf16_avx512(const uint16_t *query, int64_t q_stride, uint16_t *out,
                                          int64_t out_stride, const uint16_t *k_cache,
                                          const uint16_t *v_cache, const int32_t *block_table,
                                          int seq_len, int q_len, int num_heads,
                                          int num_kv_heads, int head_dim, int block_size,
                                          int64_t num_blocks, float scale, int num_threads) {
    return prefill(query, q_stride, out, out_stride, k_cache, v_cache, block_table, seq_len,
                   q_len, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                   num_threads, 1);
}
