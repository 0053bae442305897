/* The AVX512-BF16 dot path of paged decode attention (cpu_attention.h lists the files): CPUs
 * with AVX512-BF16, bf16 caches, block_size a multiple of 16, head_dim a multiple of 32. A file
 * of its own because it is one instruction set's kernel: it compiles to nothing where the build
 * lacks AVX512-BF16, and its hot loop (attend_group_bf16 with scores16_bf16 and pv_bf16 inlined)
 * needs nothing from the float32 path but the scratch and head_result.
 *
 * Widening whole K/V blocks into float buffers cost about a quarter of the kernel's time; here
 * q · k runs on the bf16 K rows in place with vdpbf16ps (two bf16 products per float32 lane,
 * float32 accumulation), and V rows are widened in registers as they are read. The query is
 * rounded to bf16 once per task — exact when the model runs in bf16, whose query is a bf16
 * tensor — and the scale is applied to the float32 scores, not the bf16 query. P · V stays
 * float32 (probabilities are not rounded to bf16): the bf16-pair variant roughly halves the FMAs
 * but adds a 2^-9 relative error per probability. */

#include "cpu_attention.h"

#ifdef HAVE_BF16_DOT
#define MAX_HEADS_PER_PASS 4 /* heads whose scores are computed before one P · V pass */

/* The 16 scores q · k[t], k 16 bf16 rows of d (d a multiple of 32), q d bf16 values. */
static inline __m512 scores16_bf16(const uint16_t *q, const uint16_t *k, int d) {
    __m512 v[16];
    for (int t = 0; t < 16; t++) v[t] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 32) {
        const __m512bh qi = (__m512bh)_mm512_loadu_si512(q + i);
        for (int t = 0; t < 16; t++)
            v[t] = _mm512_dpbf16_ps(v[t], qi,
                                    (__m512bh)_mm512_loadu_si512(k + (size_t)t * d + i));
    }
    return reduce16(v);
}

/* acc[g] = acc[g] * corr[g] + sum_t p[g][t] * v[t] for G heads over two pieces of bf16 rows
 * (v0: n0 rows with probabilities p[g][0..15], v1: n1 rows with p[g][16..31]), W float vectors
 * (16 * W dims) at a time; G * W accumulators stay in registers across all the rows.
 * A row's 32 bf16 values are widened by interleaving them with zeros (unpacklo/hi_epi16),
 * which lays dims out per 128-bit lane as [0..3 | 8..11 | ...] and [4..7 | 12..15 | ...]:
 * acc is kept in that order, and attend_group_bf16 puts it back at the end. */
static inline __attribute__((always_inline)) void pv_bf16(float *acc, const __m512 *corr,
                                                          const float *p, const uint16_t *v0,
                                                          int n0, const uint16_t *v1, int n1,
                                                          int d, const int G, const int W) {
    const __m512i zero = _mm512_setzero_si512();
    for (int i = 0; i < d; i += 16 * W) {
        __m512 a[4][4];
        for (int g = 0; g < G; g++)
            for (int w = 0; w < W; w++)
                a[g][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)g * d + i + 16 * w), corr[g]);
        for (int piece = 0; piece < 2; piece++) {
            const uint16_t *v = piece ? v1 : v0;
            const int n = piece ? n1 : n0;
            for (int t = 0; t < n; t++) {
                __m512 row[4];
                for (int w = 0; w < W; w += 2) {
                    const __m512i raw = _mm512_loadu_si512(v + (size_t)t * d + i + 16 * w);
                    row[w] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw));
                    row[w + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw));
                }
                for (int g = 0; g < G; g++) {
                    const __m512 pt = _mm512_set1_ps(p[g * 32 + piece * 16 + t]);
                    for (int w = 0; w < W; w++) a[g][w] = _mm512_fmadd_ps(pt, row[w], a[g][w]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int w = 0; w < W; w++)
                _mm512_storeu_ps(acc + (size_t)g * d + i + 16 * w, a[g][w]);
    }
}

/* pv_bf16 for G <= MAX_HEADS_PER_PASS heads, with G and W as constants. */
static void pv_group_bf16(float *acc, const __m512 *corr, const float *p, const uint16_t *v0,
                          int n0, const uint16_t *v1, int n1, int d, int G) {
#define PV(g, w) pv_bf16(acc, corr, p, v0, n0, v1, n1, d, g, w)
    if (d % 64 == 0) {
        switch (G) {
        case 1: PV(1, 4); break;
        case 2: PV(2, 4); break;
        case 3: PV(3, 4); break;
        default: PV(4, 4); break;
        }
    } else {
        switch (G) {
        case 1: PV(1, 2); break;
        case 2: PV(2, 2); break;
        case 3: PV(3, 2); break;
        default: PV(4, 2); break;
        }
    }
#undef PV
}

void attend_group_bf16(Scratch *s, const float *query, float *out, float *part,
                       const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                       int start, int end, int kvh, int group, int head_dim, int block_size,
                       int64_t num_blocks, float scale) {
    const int D = head_dim;
    const size_t block_elems = (size_t)block_size * D;
    float *lv = s->l; /* [group, 16]: per-lane running sums (block_size >= 16) */

    for (int g = 0; g < group; g++) {
        for (int i = 0; i < D; i += 32) {
            const float *qg = query + (size_t)g * D + i;
            const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + 16), _mm512_loadu_ps(qg));
            _mm512_storeu_si512(s->qb + (size_t)g * D + i, (__m512i)b);
        }
        memset(s->acc + (size_t)g * D, 0, sizeof(float) * D);
        memset(lv + (size_t)g * 16, 0, sizeof(float) * 16);
        s->m[g] = -INFINITY;
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);

    /* The context as 16-row pieces (a block holds block_size / 16), taken two at a time: one
     * softmax update per 32 keys halves the max / rescale work per key. */
    const int pieces_per_block = block_size / 16;
    const int pieces = (end + 15) / 16; /* start is a multiple of 32: pairs stay aligned */
    for (int c = start / 16; c < pieces; c += 2) {
        const uint16_t *kp[2], *vp[2];
        int n[2];
        __mmask16 valid[2];
        for (int j = 0; j < 2; j++) {
            const int piece = c + j, b = piece / pieces_per_block;
            n[j] = piece < pieces ? (end - piece * 16 < 16 ? end - piece * 16 : 16) : 0;
            valid[j] = n[j] == 16 ? 0xFFFF : (__mmask16)((1u << n[j]) - 1);
            const size_t offset = ((size_t)kvh * num_blocks + (size_t)table[piece < pieces ? b : 0]) *
                                      block_elems + (size_t)(piece % pieces_per_block) * 16 * D;
            /* A missing second piece points at the first's rows: read, and fully masked. */
            kp[j] = k_cache + (piece < pieces ? offset : 0);
            vp[j] = v_cache + (piece < pieces ? offset : 0);
            if (n[j] == 0) kp[j] = kp[0];
        }
        /* As in attend_group_f32: blocks are scattered, so the next one(s) are fetched ahead, a
         * slice of their lines before each head's scores. */
        size_t next[2];
        int num_next = 0;
        if (c + 2 < pieces && (c + 2) % pieces_per_block == 0) {
            const int next_last = ((c + 3 < pieces ? c + 3 : c + 2)) / pieces_per_block;
            for (int b = (c + 2) / pieces_per_block; b <= next_last; b++)
                next[num_next++] = ((size_t)kvh * num_blocks + (size_t)table[b]) * block_elems;
        }
        for (int g0 = 0; g0 < group; g0 += MAX_HEADS_PER_PASS) {
            const int G = group - g0 < MAX_HEADS_PER_PASS ? group - g0 : MAX_HEADS_PER_PASS;
            __m512 corr[MAX_HEADS_PER_PASS];
            for (int j = 0; j < G; j++) {
                const int g = g0 + j;
                for (int b = 0; b < num_next; b++) {
                    const size_t lo = block_elems * g / group / 32 * 32;
                    for (size_t e = lo; e < block_elems * (g + 1) / group; e += 32) {
                        __builtin_prefetch(k_cache + next[b] + e);
                        __builtin_prefetch(v_cache + next[b] + e);
                    }
                }
                const uint16_t *q = s->qb + (size_t)g * D;
                const __m512 s0 = _mm512_mul_ps(scores16_bf16(q, kp[0], D), vscale);
                const __m512 s1 = _mm512_mul_ps(scores16_bf16(q, kp[1], D), vscale);
                const __m512 m_old = _mm512_set1_ps(s->m[g]);
                const __m512 both = _mm512_max_ps(_mm512_mask_mov_ps(ninf, valid[0], s0),
                                                  _mm512_mask_mov_ps(ninf, valid[1], s1));
                const __m512 m_new = _mm512_max_ps(m_old, broadcast_max(both));
                /* The first update has m_old = -inf: corr = exp(-inf) = 0 against zeros. */
                corr[j] = exp16(_mm512_sub_ps(m_old, m_new));
                const __m512 p0 = _mm512_maskz_mov_ps(valid[0], exp16(_mm512_sub_ps(s0, m_new)));
                const __m512 p1 = _mm512_maskz_mov_ps(valid[1], exp16(_mm512_sub_ps(s1, m_new)));
                _mm512_storeu_ps(s->p + (size_t)j * 32, p0);
                _mm512_storeu_ps(s->p + (size_t)j * 32 + 16, p1);
                float *l = lv + (size_t)g * 16;
                _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), corr[j],
                                                    _mm512_add_ps(p0, p1)));
                s->m[g] = _mm512_cvtss_f32(m_new);
            }
            pv_group_bf16(s->acc + (size_t)g0 * D, corr, s->p, vp[0], n[0], vp[1], n[1], D, G);
        }
    }

    /* Undo pv_bf16's dim order: output 16-float half h of each 32 dims takes 128-bit lanes
     * 2h, 2h+1 of the "lo" vector interleaved with those of the "hi" vector. */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < group; g++) {
        float scalar_inv;
        float *dst = head_result(out, part, g, D, s->m[g],
                                 _mm512_reduce_add_ps(_mm512_loadu_ps(lv + (size_t)g * 16)),
                                 &scalar_inv);
        const __m512 inv = _mm512_set1_ps(scalar_inv);
        for (int i = 0; i < D; i += 32) {
            const __m512 lo = _mm512_loadu_ps(s->acc + (size_t)g * D + i);
            const __m512 hi = _mm512_loadu_ps(s->acc + (size_t)g * D + i + 16);
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
            _mm512_storeu_ps(dst + i + 16,
                             _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
        }
    }
}
#endif
