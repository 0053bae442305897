/* Causal prefill attention for kvfleet's CPU path on AMX tiles: one sequence's query tokens (the
 * last q_len of its seq_len positions) against its K/V read from the paged bf16 cache.
 *
 * Why: torch's SDPA flash kernel on this path runs at about 0.35 TFLOP/s with head_dim 64 (its
 * vector dot products and per-row softmax reductions), an eighth of the machine's bf16 GEMM
 * rate; a prompt over a cached prefix spent as long in it as in all the projections.
 *
 * The computation is transposed so that the 16 query rows of a tile sit in the 16 float32 lanes
 * of a vector and no step needs a horizontal reduction:
 *   S^T [32 keys x 16 queries]  = K (A tiles, read from the cache in place: a 16-key piece of a
 *                                 block is 16 rows of head_dim bf16) x Q^T (B tiles, VNNI pairs)
 *   online softmax per lane      (running max m, running sum l; a key's scores are one vector)
 *   O^T [D x 16 queries]        += V^T (A tiles, transposed from the cache once per call) x P^T
 *                                 (B tile: the bf16 probabilities in VNNI pairs)
 * The probabilities are rounded to bf16 for P . V, as FlashAttention does on GPUs; scores,
 * softmax and accumulation stay float32.
 *
 * Layouts: query [q_len, num_heads, head_dim] bf16 with token stride q_stride elements; out the
 * same shape, token stride out_stride; k_cache/v_cache the head-major storage
 * [num_kv_heads, num_blocks, block_size, head_dim] bf16; block_table int32 for this sequence.
 * head_dim a multiple of 32 up to 256, block_size a multiple of 16. Query head h reads kv head
 * h / (num_heads / num_kv_heads).
 *
 * Built with the other CPU kernels by kernels/cpu/cpu_library.py. Without AMX (the compiler's
 * target or the kernel's permission), the entry point answers ERR_NO_AMX and the caller keeps
 * SDPA.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_entry_points.h"
#include "cpu_math.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_AMX = 3 };

#define TILE_ROWS 16    /* queries per tile, keys per A tile, dims per V^T tile */
#define KEYS_PER_STEP 32 /* keys per softmax update: two S^T tiles, one P^T tile */
#define MAX_HEAD_DIM 256

#ifdef HAVE_AMX
/* Tiles (configure_tiles): 0, 1 = S^T halves; 2 = A operand; 3 = B operand; 4..7 = O^T (a
 * 64-dim O^T stays there) or four 16-dim slices of its increment. */

/* V^T of one kv head in 32-key chunks: vt[chunk][d][k] = V[chunk * 32 + k][d] (zero past
 * seq_len: a stale row would otherwise meet a probability of 0 and could still make NaN). */
static void transpose_values(uint16_t *vt, const uint16_t *v_head, const int32_t *table,
                             int seq_len, int chunk, int head_dim, int block_size) {
    uint16_t *dst = vt + (size_t)chunk * head_dim * KEYS_PER_STEP;
    for (int k = 0; k < KEYS_PER_STEP; k++) {
        const int key = chunk * KEYS_PER_STEP + k;
        if (key >= seq_len) {
            for (int d = 0; d < head_dim; d++) dst[(size_t)d * KEYS_PER_STEP + k] = 0;
            continue;
        }
        const uint16_t *row =
            v_head + ((size_t)table[key / block_size] * block_size + key % block_size) * head_dim;
        for (int d = 0; d < head_dim; d++) dst[(size_t)d * KEYS_PER_STEP + k] = row[d];
    }
}

typedef struct {
    uint16_t *qt;    /* [head_dim / 32][16 pairs][16 queries][2]: Q^T as B tiles */
    float *s;        /* [32 keys][16 queries]: S^T of one step */
    uint16_t *pt;    /* [16 key pairs][16 queries][2]: P^T as a B tile */
    float *inc;      /* [head_dim][16 queries]: O^T's increment from one step */
    float *ot;       /* [head_dim][16 queries]: O^T, unnormalised */
} Scratch;

/* One (kv head, query tile, query head) task: rows queries starting at query index q0. */
static void attend_tile(Scratch *w, const uint16_t *query, int64_t q_stride, uint16_t *out,
                        int64_t out_stride, const uint16_t *k_head, const uint16_t *vt,
                        const int32_t *table, int seq_len, int q_len, int q0, int rows, int head,
                        int head_dim, int block_size, float scale) {
    const int D = head_dim, dim_tiles = D / 32;
    const int p0 = seq_len - q_len + q0; /* position of the tile's first query */

    /* Q^T in VNNI pairs: qt[c][r][n][j] = Q[q0 + n][head][32c + 2r + j]; missing rows are 0. */
    for (int c = 0; c < dim_tiles; c++)
        for (int n = 0; n < TILE_ROWS; n++) {
            const uint16_t *q =
                n < rows ? query + (int64_t)(q0 + n) * q_stride + (int64_t)head * D + 32 * c : NULL;
            for (int r = 0; r < 16; r++) {
                uint16_t *dst = w->qt + ((size_t)(c * 16 + r) * TILE_ROWS + n) * 2;
                dst[0] = q ? q[2 * r] : 0;
                dst[1] = q ? q[2 * r + 1] : 0;
            }
        }
    /* A 64-dim O^T fits the four tiles 4..7 and stays there; wider heads go through memory. */
    const int resident = D == 64;
    memset(w->ot, 0, sizeof(float) * (size_t)D * TILE_ROWS);
    if (resident) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    }
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    const __m512 slack = _mm512_set1_ps(RESCALE_SLACK);
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* bf16 words of [p_2r | p_2r+1] → pairs (p_2r[n], p_2r+1[n]) for each query n. */
    static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_loadu_si512(order);
    const int64_t k_stride = (int64_t)D * 2; /* bytes between a block's rows */

    const int last_key = p0 + rows - 1; /* the tile's last query sees keys 0..last_key */
    const int chunks = last_key / KEYS_PER_STEP + 1;
    for (int chunk = 0; chunk < chunks; chunk++) {
        const int key0 = chunk * KEYS_PER_STEP;
        /* S^T = K . Q^T: two 16-key pieces, each one block's rows (or part of a block). */
        _tile_zero(0);
        _tile_zero(1);
        const int second = key0 + TILE_ROWS < seq_len;
        const uint16_t *k0 =
            k_head + ((size_t)table[key0 / block_size] * block_size + key0 % block_size) * D;
        const int key1 = key0 + TILE_ROWS;
        const uint16_t *k1 =
            second ? k_head + ((size_t)table[key1 / block_size] * block_size + key1 % block_size) * D
                   : k0;
        for (int c = 0; c < dim_tiles; c++) {
            _tile_loadd(3, w->qt + (size_t)c * 16 * TILE_ROWS * 2, 64);
            _tile_loadd(2, k0 + 32 * c, k_stride);
            _tile_dpbf16ps(0, 2, 3);
            if (second) {
                _tile_loadd(2, k1 + 32 * c, k_stride);
                _tile_dpbf16ps(1, 2, 3);
            }
        }
        _tile_stored(0, w->s, 64);
        _tile_stored(1, w->s + TILE_ROWS * TILE_ROWS, 64);

        /* Online softmax, one vector per key, lanes = queries. A key is visible to query n when
         * it is below seq_len and at most at the query's position p0 + n. */
        __m512 sk[KEYS_PER_STEP];
        __m512 block_max = _mm512_set1_ps(-INFINITY);
        const int needs_mask = key0 + KEYS_PER_STEP - 1 > p0 || key0 + KEYS_PER_STEP > seq_len;
        for (int k = 0; k < KEYS_PER_STEP; k++) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w->s + k * TILE_ROWS), vscale);
            if (needs_mask) {
                const int key = key0 + k;
                const __mmask16 visible =
                    key < seq_len
                        ? _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32(key - p0), _MM_CMPINT_NLT)
                        : 0;
                x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible, x);
            }
            sk[k] = x;
            block_max = _mm512_max_ps(block_max, x);
        }
        /* The running max moves only when some query's scores pass it by more than
         * RESCALE_SLACK (FlashAttention-4's conditional rescaling): short of that, exp(s - m)
         * stays below e^8 and the sums keep accumulating against the stale max, which cancels
         * in the final division. After the first steps a rescale is rare, which lets a 64-dim
         * O^T stay in tile registers from step to step. Key 0 is visible to every query, so
         * the first step sets a finite m in every lane; its corr, exp(-inf), zeroes the sums. */
        if (_mm512_cmp_ps_mask(block_max, _mm512_add_ps(m, slack), _CMP_GT_OQ)) {
            const __m512 m_new = _mm512_max_ps(m, block_max);
            const __m512 corr = exp16(_mm512_sub_ps(m, m_new));
            m = m_new;
            l = _mm512_mul_ps(l, corr);
            if (resident && chunk > 0) {
                _tile_stored(4, w->ot, 64);
                _tile_stored(5, w->ot + 16 * TILE_ROWS, 64);
                _tile_stored(6, w->ot + 32 * TILE_ROWS, 64);
                _tile_stored(7, w->ot + 48 * TILE_ROWS, 64);
            }
            if (!resident || chunk > 0)
                for (int d = 0; d < D; d++) {
                    float *o = w->ot + (size_t)d * TILE_ROWS;
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), corr));
                }
            if (resident && chunk > 0) {
                _tile_loadd(4, w->ot, 64);
                _tile_loadd(5, w->ot + 16 * TILE_ROWS, 64);
                _tile_loadd(6, w->ot + 32 * TILE_ROWS, 64);
                _tile_loadd(7, w->ot + 48 * TILE_ROWS, 64);
            }
        }
        __m512 sum = _mm512_setzero_ps();
        for (int k = 0; k < KEYS_PER_STEP; k += 2) {
            const __m512 pa = exp16(_mm512_sub_ps(sk[k], m));
            const __m512 pb = exp16(_mm512_sub_ps(sk[k + 1], m));
            sum = _mm512_add_ps(sum, _mm512_add_ps(pa, pb));
            const __m512i pair =
                _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
            _mm512_storeu_si512(w->pt + (size_t)(k / 2) * TILE_ROWS * 2, pair);
        }
        l = _mm512_add_ps(l, sum);

        /* O^T += V^T . P^T: in tiles 4..7 when resident, else 64 dims (four C tiles) at a time
         * through memory. */
        _tile_loadd(3, w->pt, 64);
        const uint16_t *vchunk = vt + (size_t)chunk * D * KEYS_PER_STEP;
        if (resident) {
            _tile_loadd(2, vchunk, 64);
            _tile_dpbf16ps(4, 2, 3);
            _tile_loadd(2, vchunk + 16 * KEYS_PER_STEP, 64);
            _tile_dpbf16ps(5, 2, 3);
            _tile_loadd(2, vchunk + 32 * KEYS_PER_STEP, 64);
            _tile_dpbf16ps(6, 2, 3);
            _tile_loadd(2, vchunk + 48 * KEYS_PER_STEP, 64);
            _tile_dpbf16ps(7, 2, 3);
            continue;
        }
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int slices = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            _tile_loadd(2, vchunk + (size_t)d0 * KEYS_PER_STEP, 64);
            _tile_dpbf16ps(4, 2, 3);
            _tile_loadd(2, vchunk + (size_t)(d0 + 16) * KEYS_PER_STEP, 64);
            _tile_dpbf16ps(5, 2, 3);
            _tile_stored(4, w->inc + (size_t)d0 * TILE_ROWS, 64);
            _tile_stored(5, w->inc + (size_t)(d0 + 16) * TILE_ROWS, 64);
            if (slices == 4) {
                _tile_loadd(2, vchunk + (size_t)(d0 + 32) * KEYS_PER_STEP, 64);
                _tile_dpbf16ps(6, 2, 3);
                _tile_loadd(2, vchunk + (size_t)(d0 + 48) * KEYS_PER_STEP, 64);
                _tile_dpbf16ps(7, 2, 3);
                _tile_stored(6, w->inc + (size_t)(d0 + 32) * TILE_ROWS, 64);
                _tile_stored(7, w->inc + (size_t)(d0 + 48) * TILE_ROWS, 64);
            }
            for (int d = d0; d < d0 + 16 * slices; d++) {
                float *o = w->ot + (size_t)d * TILE_ROWS;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o),
                                                  _mm512_loadu_ps(w->inc + (size_t)d * TILE_ROWS)));
            }
        }
    }
    if (resident) {
        _tile_stored(4, w->ot, 64);
        _tile_stored(5, w->ot + 16 * TILE_ROWS, 64);
        _tile_stored(6, w->ot + 32 * TILE_ROWS, 64);
        _tile_stored(7, w->ot + 48 * TILE_ROWS, 64);
    }

    float inv[TILE_ROWS];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int n = 0; n < rows; n++) {
        uint16_t *o = out + (int64_t)(q0 + n) * out_stride + (int64_t)head * D;
        for (int d = 0; d < D; d++) o[d] = f32_to_bf16(w->ot[(size_t)d * TILE_ROWS + n] * inv[n]);
    }
}
#endif

/* Entry point (layouts in the header comment). Returns OK, ERR_SHAPE, ERR_NOMEM or ERR_NO_AMX;
 * on an error `out` may be partly written and the caller must not use it. */
int kvfleet_prefill_attention_bf16(const uint16_t *query, int64_t q_stride, uint16_t *out,
                                   int64_t out_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int32_t *block_table,
                                   int seq_len, int q_len, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, int64_t num_blocks, float scale,
                                   int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 ||
        head_dim % 32 != 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        block_size % TILE_ROWS != 0 || q_len <= 0 || seq_len < q_len)
        return ERR_SHAPE;
#ifndef HAVE_AMX
    (void)query, (void)q_stride, (void)out, (void)out_stride, (void)k_cache, (void)v_cache;
    (void)block_table, (void)num_blocks, (void)scale, (void)num_threads;
    return ERR_NO_AMX;
#else
    if (!amx_permitted()) return ERR_NO_AMX;
    const int group = num_heads / num_kv_heads, D = head_dim;
    const int chunks = (seq_len + KEYS_PER_STEP - 1) / KEYS_PER_STEP;
    const size_t head_elems = (size_t)num_blocks * block_size * D;
    const size_t vt_head = (size_t)chunks * D * KEYS_PER_STEP;
    uint16_t *vt = aligned_alloc(64, ((vt_head * num_kv_heads * 2 + 63) / 64) * 64);
    if (!vt) return ERR_NOMEM;
    if (num_threads < 1) num_threads = 1;
    int status = OK;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int task = 0; task < num_kv_heads * chunks; task++) {
            const int kvh = task / chunks, chunk = task % chunks;
            transpose_values(vt + (size_t)kvh * vt_head, v_cache + (size_t)kvh * head_elems,
                             block_table, seq_len, chunk, D, block_size);
        }
        /* the implicit barrier of the loop above: every V^T chunk exists from here on */
        Scratch w;
        const size_t floats = (size_t)D * TILE_ROWS / 2 /* qt */ + KEYS_PER_STEP * TILE_ROWS +
                              KEYS_PER_STEP * TILE_ROWS / 2 /* pt */ +
                              2 * (size_t)D * TILE_ROWS /* inc, ot */;
        float *base = aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64);
        if (!base) {
#pragma omp atomic write
            status = ERR_NOMEM;
        } else {
            w.qt = (uint16_t *)base;
            w.s = base + (size_t)D * TILE_ROWS / 2;
            w.pt = (uint16_t *)(w.s + KEYS_PER_STEP * TILE_ROWS);
            w.inc = (float *)(w.pt) + KEYS_PER_STEP * TILE_ROWS / 2;
            w.ot = w.inc + (size_t)D * TILE_ROWS;
            configure_tiles();
        }
        const int q_tiles = (q_len + TILE_ROWS - 1) / TILE_ROWS;
        /* Later query tiles see more keys (causal): hand tasks out one at a time, longest
         * first. */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_kv_heads * q_tiles * group; task++) {
            if (!base) continue;
            const int tile = q_tiles - 1 - task / (num_kv_heads * group);
            const int rest = task % (num_kv_heads * group);
            const int kvh = rest / group, head = kvh * group + rest % group;
            const int q0 = tile * TILE_ROWS;
            const int rows = q_len - q0 < TILE_ROWS ? q_len - q0 : TILE_ROWS;
            attend_tile(&w, query, q_stride, out, out_stride, k_cache + (size_t)kvh * head_elems,
                        vt + (size_t)kvh * vt_head, block_table, seq_len, q_len, q0, rows, head,
                        D, block_size, scale);
        }
        if (base) {
            _tile_release();
            free(base);
        }
    }
    free(vt);
    return status;
#endif
}

/* 1 when this build and process can run the AMX kernel, else 0 (lets the tests tell a machine
 * without AMX, where the entry point refuses, from a broken kernel). */
int kvfleet_prefill_attention_amx(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}
