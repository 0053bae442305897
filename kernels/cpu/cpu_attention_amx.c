/* The AMX path of paged decode attention (cpu_attention.h lists the files): bf16 caches,
 * head_dim 64, blocks of a multiple of 16 tokens, GQA groups of up to 16 heads. A file of its own
 * because it is one instruction set's kernel: it compiles to nothing where the build lacks AMX,
 * and its hot loop (attend_group_amx with vnni_pair) shares nothing with the other paths but
 * broadcast_max. The driver (cpu_attention.c) asks for the tiles and configures them.
 *
 * On the dot path (cpu_attention_bf16.c), q . k (vdpbf16ps plus a 16-way transpose-and-add per
 * head) and P . V (four FMAs per key and head) took longer than the memory stream they sit on,
 * and did not overlap it. Here both are tile multiplies per 32 keys:
 *   S^T [16 keys x 16 heads] = K piece (A tile, the cache's rows in place) . Q^T (B tile, VNNI)
 *   O [16 heads x 64 dims]  += P (A tile: each head's 32 bf16 probabilities) . V (four B tiles:
 *                               pairs of rows interleaved, the VNNI layout)
 * O stays in tiles 4..7 across the whole context; the running max moves only when a head's
 * scores pass it by more than RESCALE_SLACK (as in cpu_prefill.c), so O is rescaled in memory
 * rarely. P is rounded to bf16 for P . V, as FlashAttention and our Triton kernels do.
 * `kvfleet bench cpu-kernels` (128 sequences of 100-700 tokens, GQA 3, 30 layers' caches): 2.28
 * ms per layer against 2.65 on the dot path, 17 GB/s of a 28 GB/s read rate. Still short of the
 * memory stream: each step waits for its tile stores before the gathers and for its vector
 * stores before the tile loads. Issuing the next step's S^T multiplies before this step's
 * softmax was slower (4.4 ms per layer in an ad-hoc loop). */

#include "cpu_attention.h"

#ifdef HAVE_AMX
/* Rows t and t+1 of a V piece (64 bf16 each; NULL = zeros) as row `pair` of the four B tiles:
 * tile j, row pair = (v[t][d], v[t+1][d]) for d = 16j .. 16j+15. */
static inline void vnni_pair(uint16_t *vt, int pair, const uint16_t *r0, const uint16_t *r1) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int half = 0; half < 2; half++) { /* dims 32 * half .. + 31 */
        const __m512i a = r0 ? _mm512_loadu_si512(r0 + 32 * half) : zero;
        const __m512i b = r1 ? _mm512_loadu_si512(r1 + 32 * half) : zero;
        /* unpack interleaves within 128-bit lanes: lo holds dims {0-3, 8-11, 16-19, 24-27}
         * of this half, hi {4-7, 12-15, 20-23, 28-31}; the permutes put them in order. */
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
        _mm512_storeu_si512(vt + ((2 * half) * 16 + pair) * 32, _mm512_permutex2var_epi64(lo, first, hi));
        _mm512_storeu_si512(vt + ((2 * half + 1) * 16 + pair) * 32,
                            _mm512_permutex2var_epi64(lo, second, hi));
    }
}

void attend_group_amx(AmxScratch *w, const float *query, float *out, const uint16_t *k_cache,
                      const uint16_t *v_cache, const int32_t *table, int len, int kvh, int group,
                      int block_size, int64_t num_blocks, float scale) {
    /* The driver allocates it with aligned_alloc(64, ...), which gcc cannot see from this file:
     * said here, the scratch's stores are aligned moves. */
    w = __builtin_assume_aligned(w, 64);
    const int D = AMX_HEAD_DIM;
    const size_t block_elems = (size_t)block_size * D;
    const uint16_t *k_head = k_cache + (size_t)kvh * num_blocks * block_elems;
    const uint16_t *v_head = v_cache + (size_t)kvh * num_blocks * block_elems;

    /* Q^T in VNNI pairs: qt[c][r][g][j] = bf16(q[g][32c + 2r + j]); heads past the group 0. */
    memset(w->qt, 0, sizeof w->qt);
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 2; c++)
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 2; j++)
                    w->qt[((c * 16 + r) * 16 + g) * 2 + j] =
                        f32_to_bf16(query[(size_t)g * D + 32 * c + 2 * r + j]);
    memset(w->p, 0, sizeof w->p);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);

    __m512 m[16], l[16];
    for (int g = 0; g < group; g++) {
        m[g] = _mm512_set1_ps(-INFINITY);
        l[g] = _mm512_setzero_ps();
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 slack = _mm512_set1_ps(RESCALE_SLACK);
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                             192, 208, 224, 240);
    const int64_t k_stride = (int64_t)D * 2;
    const int steps = (len + 31) / 32;
    for (int step = 0; step < steps; step++) {
        const int key0 = 32 * step, n0 = len - key0 < 16 ? len - key0 : 16;
        const int n1 = len - key0 - 16 < 0 ? 0 : (len - key0 - 16 < 16 ? len - key0 - 16 : 16);
        const uint16_t *piece[2], *vpiece[2];
        for (int j = 0; j < 2; j++) {
            const int key = key0 + 16 * j;
            piece[j] = vpiece[j] = NULL;
            if (j == 0 || n1 > 0) { /* a piece past len may lie past the block table's end */
                const size_t row = (size_t)table[key / block_size] * block_size + key % block_size;
                piece[j] = k_head + row * D;
                vpiece[j] = v_head + row * D;
            }
        }
        /* No software prefetch of the next step's K and V, unlike the other paths: a
         * sequence's blocks are mostly consecutive in memory (75-97% of a block table's
         * neighbours in the standard workload), which the hardware prefetcher follows, and
         * the 128 prefetches per step measured within 3% either way on shuffled and on
         * consecutive blocks (five interleaved series, 128 sequences x 30 layers; one read
         * 18% slower with them on consecutive blocks). */

        /* S^T = K . Q^T for the two 16-key pieces. */
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < 2; c++) {
            _tile_loadd(3, w->qt + c * 16 * 16 * 2, 64);
            _tile_loadd(2, piece[0] + 32 * c, k_stride);
            _tile_dpbf16ps(0, 2, 3);
            if (piece[1]) {
                _tile_loadd(2, piece[1] + 32 * c, k_stride);
                _tile_dpbf16ps(1, 2, 3);
            }
        }
        _tile_stored(0, w->s, 64);
        _tile_stored(1, w->s + 256, 64);

        /* V of these 32 keys in VNNI pairs, zero past len (a stale row times a probability of
         * 0 could still make NaN). */
        for (int pair = 0; pair < 16; pair++) {
            const int t = 2 * pair, j = t / 16, r = t % 16, n = j ? n1 : n0;
            const uint16_t *base = vpiece[j];
            vnni_pair(w->vt, pair, base && r < n ? base + (size_t)r * D : NULL,
                      base && r + 1 < n ? base + (size_t)(r + 1) * D : NULL);
        }

        /* Each head's scores as two 16-key vectors (a column of S^T each), online softmax. */
        const __mmask16 valid0 = n0 >= 16 ? 0xFFFF : (__mmask16)((1u << n0) - 1);
        const __mmask16 valid1 = n1 >= 16 ? 0xFFFF : (__mmask16)((1u << n1) - 1);
        __m512 corr[16];
        int rescale = 0;
        for (int g = 0; g < group; g++) {
            const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(g));
            const __m512 s0 = _mm512_mask_mov_ps(
                ninf, valid0, _mm512_mul_ps(_mm512_i32gather_ps(at, w->s, 4), vscale));
            const __m512 s1 = _mm512_mask_mov_ps(
                ninf, valid1, _mm512_mul_ps(_mm512_i32gather_ps(at, w->s + 256, 4), vscale));
            const __m512 bmax = broadcast_max(_mm512_max_ps(s0, s1));
            corr[g] = _mm512_set1_ps(1.0f);
            if (_mm512_cmp_ps_mask(bmax, _mm512_add_ps(m[g], slack), _CMP_GT_OQ)) {
                const __m512 m_new = _mm512_max_ps(m[g], bmax);
                corr[g] = exp16(_mm512_sub_ps(m[g], m_new));
                m[g] = m_new;
                l[g] = _mm512_mul_ps(l[g], corr[g]);
                rescale = 1;
            }
            const __m512 p0 = exp16(_mm512_sub_ps(s0, m[g]));
            const __m512 p1 = exp16(_mm512_sub_ps(s1, m[g]));
            l[g] = _mm512_add_ps(l[g], _mm512_add_ps(p0, p1));
            _mm512_storeu_si512(w->p + g * 32, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        if (rescale && step > 0) {
            /* A head's max moved: scale its row of O (in memory for the moment). */
            _tile_stored(4, w->o, 256);
            _tile_stored(5, w->o + 16, 256);
            _tile_stored(6, w->o + 32, 256);
            _tile_stored(7, w->o + 48, 256);
            for (int g = 0; g < group; g++)
                for (int d = 0; d < D; d += 16)
                    _mm512_storeu_ps(w->o + g * D + d,
                                     _mm512_mul_ps(_mm512_loadu_ps(w->o + g * D + d), corr[g]));
            _tile_loadd(4, w->o, 256);
            _tile_loadd(5, w->o + 16, 256);
            _tile_loadd(6, w->o + 32, 256);
            _tile_loadd(7, w->o + 48, 256);
        }

        /* O += P . V */
        _tile_loadd(2, w->p, 64);
        _tile_loadd(3, w->vt, 64);
        _tile_dpbf16ps(4, 2, 3);
        _tile_loadd(3, w->vt + 16 * 32, 64);
        _tile_dpbf16ps(5, 2, 3);
        _tile_loadd(3, w->vt + 2 * 16 * 32, 64);
        _tile_dpbf16ps(6, 2, 3);
        _tile_loadd(3, w->vt + 3 * 16 * 32, 64);
        _tile_dpbf16ps(7, 2, 3);
    }

    _tile_stored(4, w->o, 256);
    _tile_stored(5, w->o + 16, 256);
    _tile_stored(6, w->o + 32, 256);
    _tile_stored(7, w->o + 48, 256);
    for (int g = 0; g < group; g++) {
        const float sum = _mm512_reduce_add_ps(l[g]);
        /* len == 0 (no context) leaves l = 0: write zeros rather than 0/0. */
        const __m512 inv = _mm512_set1_ps(sum > 0.0f ? 1.0f / sum : 0.0f);
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(out + (size_t)g * D + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + g * D + d), inv));
    }
}
#endif
