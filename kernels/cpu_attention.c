/* Paged decode attention for kvfleet's CPU path: one query token per sequence against its
 * paged K/V context, read in place from the head-major cache.
 *
 * Why C: the torch reference gathers every sequence's blocks into a padded [kv_heads, seqs,
 * max_ctx, D] copy and runs tiny batched matmuls; on CPU that costs several times the bytes
 * the step must read. Here each (sequence, kv head) pair is one task that walks its block table,
 * reads each K/V block once for all query heads of its GQA group, and keeps an online softmax
 * (running max, running sum, float32 accumulator) so nothing is padded or materialised.
 *
 * Layout (see kernels/reference.py, allocate_kv_cache(head_major=True)):
 *   k_cache, v_cache  [num_kv_heads, num_blocks, block_size, head_dim], contiguous,
 *                     float32 or bfloat16 (bf16 stored as uint16: the top half of a float32)
 *   query, out        [num_seqs, num_heads, head_dim] float32, contiguous
 *   block_tables      int32, row s at block_tables + s * table_stride
 *   seq_lens          int32 [num_seqs]
 * Query head h reads kv head h / (num_heads / num_kv_heads), as in the reference.
 *
 * Vectorisation: inner loops run over LANES consecutive floats with independent accumulators,
 * a shape gcc -O3 vectorises without -ffast-math (a plain float sum reduction would stay
 * scalar, since reassociating it changes the result). head_dim must be a multiple of LANES.
 *
 * Built by kernels/cpu_attention.py: gcc -O3 -march=native -fopenmp -shared -fPIC.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

enum {
    OK = 0,
    ERR_SHAPE = 1, /* head_dim, block_size, head counts or dtype outside what this file handles */
    ERR_NOMEM = 2, /* per-thread scratch could not be allocated */
};

/* bf16 is the upper 16 bits of an IEEE float32: widening is a shift, exact. */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n bf16 values → float32 (n is a multiple of LANES; vectorises to widen + shift). */
static void widen_bf16(float *restrict dst, const uint16_t *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* The sum of LANES floats. gcc keeps a lane-by-lane loop scalar (16 dependent adds, the
 * dot's main cost at head_dim 64); with AVX-512 this is four shuffle + add steps. */
static inline float hsum(const float acc[LANES]) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps(_mm512_loadu_ps(acc));
#else
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += acc[l];
    return sum;
#endif
}

/* exp(x) for x <= 0 (scores minus their running max), within 2 ulp of expf. libm's expf is a
 * call per element, about a third of the kernel's time at head_dim 64; this is plain float and
 * integer arithmetic, so a loop over it vectorises. Cephes' method: x = n ln2 + r with
 * |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^n built in the exponent bits. */
static inline float exp_nonpositive(float x) {
    const float underflow = -87.0f; /* below this expf is subnormal or 0: return 0 */
    const float xc = x < underflow ? underflow : x;
    /* Round x / ln2 to the nearest integer by adding and subtracting 1.5 * 2^23. */
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < underflow ? 0.0f : p * scale;
}

/* a · b over d floats, d a multiple of LANES. */
static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float acc[LANES] = {0};
    for (int i = 0; i < d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    return hsum(acc);
}

#ifdef __AVX512F__
/* The 16 lane sums of v[0..15] as one vector: out[t] = sum of v[t]'s lanes. A transpose-and-add
 * tree (unpack within 128-bit lanes, then across them) costs 45 shuffles and adds for 16
 * sums, against 16 * 8 for a reduction per vector. Lanes never mix between tokens, so garbage
 * in rows past the valid ones only reaches their own (ignored) outputs. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [t0, t1, t0, t1], t = 2i, 2i+1 */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: [t0, t1, t2, t3], t = 4i.. */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* Sum the four 128-bit lanes of each quad, placing quad i in lane i. 0x88 picks lanes
     * (0, 2) of each operand, 0xDD lanes (1, 3). */
    const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88),
                         _mm512_shuffle_f32x4(q01, q23, 0xDD));
}

/* score[0..15] = q · k[t] for 16 rows of k (row stride d, d a multiple of 16). */
static inline void scores16(float *score, const float *restrict q, const float *restrict k,
                            int d) {
    __m512 v[16];
    for (int t = 0; t < 16; t++) v[t] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
        const __m512 qi = _mm512_loadu_ps(q + i);
        for (int t = 0; t < 16; t++)
            v[t] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(k + (size_t)t * d + i), v[t]);
    }
    _mm512_storeu_ps(score, reduce16(v));
}
#endif

/* score[t] = q · k[t] for the n valid rows of a block of block_size rows (row stride d). */
static inline void block_scores(float *score, const float *restrict q, const float *restrict k,
                                int n, int block_size, int d) {
#ifdef __AVX512F__
    if (block_size % 16 == 0) {
        /* Whole groups of 16 rows: they lie inside the block even past row n. */
        for (int t = 0; t < n; t += 16) scores16(score + t, q, k + (size_t)t * d, d);
        return;
    }
#else
    (void)block_size;
#endif
    for (int t = 0; t < n; t++) score[t] = dot(q, k + (size_t)t * d, d);
}

/* The largest of score[0..n). */
static inline float block_max(const float *score, int n) {
#ifdef __AVX512F__
    /* A scalar max over the block is a serial chain of compares, as slow as the dots. */
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 valid = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, valid, score + t));
    }
    return _mm512_reduce_max_ps(m);
#else
    float m = -INFINITY;
    for (int t = 0; t < n; t++)
        if (score[t] > m) m = score[t];
    return m;
#endif
}

/* acc[0:d] = acc * corr + sum_t p[t] * v[t, 0:d], for n rows of v (row stride d). Each
 * LANES-wide slice of acc stays in registers across the n rows. */
static inline void accumulate_pv(float *restrict acc, float corr, const float *restrict p,
                                 const float *restrict v, int n, int d) {
    int i = 0;
#ifdef __AVX512F__
    /* Four 16-float slices at a time: four independent FMA chains instead of one, whose
     * 4-cycle latency per row otherwise bounds this loop. */
    const __m512 c = _mm512_set1_ps(corr);
    for (; i + 64 <= d; i += 64) {
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + i), c);
        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 16), c);
        __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 32), c);
        __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 48), c);
        for (int t = 0; t < n; t++) {
            const __m512 pt = _mm512_set1_ps(p[t]);
            const float *row = v + (size_t)t * d + i;
            a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(row), a0);
            a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(row + 16), a1);
            a2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(row + 32), a2);
            a3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(row + 48), a3);
        }
        _mm512_storeu_ps(acc + i, a0);
        _mm512_storeu_ps(acc + i + 16, a1);
        _mm512_storeu_ps(acc + i + 32, a2);
        _mm512_storeu_ps(acc + i + 48, a3);
    }
#endif
    for (; i < d; i += LANES) {
        float a[LANES];
        for (int l = 0; l < LANES; l++) a[l] = acc[i + l] * corr;
        for (int t = 0; t < n; t++) {
            const float pt = p[t];
            const float *row = v + (size_t)t * d + i;
            for (int l = 0; l < LANES; l++) a[l] += pt * row[l];
        }
        for (int l = 0; l < LANES; l++) acc[i + l] = a[l];
    }
}

/* Per-thread working memory, sized for one GQA group. */
typedef struct {
    float *q;      /* [group, D]  the group's queries, pre-multiplied by scale */
    float *acc;    /* [group, D]  unnormalised output */
    float *kf;     /* [block_size, D]  one K block widened to float32 (bf16 caches only) */
    float *vf;     /* [block_size, D]  one V block widened to float32 (bf16 caches only) */
    float *score;  /* [block_size]  one head's scores, then probabilities, for one block */
    float *m;      /* [group]  running max of the scores */
    float *l;      /* [group, block_size]  running sums of exp(score - m), one per block slot */
} Scratch;

static int scratch_alloc(Scratch *s, int group, int head_dim, int block_size) {
    const size_t gd = (size_t)group * head_dim, bd = (size_t)block_size * head_dim;
    const size_t floats = 2 * gd + 2 * bd + block_size + group + (size_t)group * block_size;
    /* Zeroed: rows of kf past a short last block are read (and their results ignored). */
    float *base = calloc(floats, sizeof(float));
    if (!base) return ERR_NOMEM;
    s->q = base;
    s->acc = s->q + gd;
    s->kf = s->acc + gd;
    s->vf = s->kf + bd;
    s->score = s->vf + bd;
    s->m = s->score + block_size;
    s->l = s->m + group;
    return OK;
}

/* One (sequence, kv head) task: all `group` query heads that share kv head `kvh`. */
static void attend_group(Scratch *s, const float *query, float *out, const void *k_cache,
                         const void *v_cache, int dtype, const int32_t *table, int len,
                         int kvh, int group, int head_dim, int block_size, int64_t num_blocks,
                         float scale) {
    const int D = head_dim;
    const size_t block_elems = (size_t)block_size * D;
    const size_t block_bytes = block_elems * (dtype == DTYPE_BFLOAT16 ? 2 : 4);

    for (int g = 0; g < group; g++) {
        for (int i = 0; i < D; i++) s->q[g * D + i] = query[(size_t)g * D + i] * scale;
        memset(s->acc + (size_t)g * D, 0, sizeof(float) * D);
        s->m[g] = -INFINITY;
    }
    memset(s->l, 0, sizeof(float) * (size_t)group * block_size);

    const int nblocks = (len + block_size - 1) / block_size;
    for (int b = 0; b < nblocks; b++) {
        const int n = (b == nblocks - 1) ? len - b * block_size : block_size; /* valid rows */
        const size_t offset = ((size_t)kvh * num_blocks + (size_t)table[b]) * block_elems;
        if (b + 1 < nblocks) {
            /* Blocks are scattered in memory, so the hardware prefetcher cannot run ahead
             * across them: ask for the next block's K and V while this one is computed. */
            const size_t next = ((size_t)kvh * num_blocks + (size_t)table[b + 1]) * block_bytes;
            for (size_t line = 0; line < block_bytes; line += 64) {
                __builtin_prefetch((const char *)k_cache + next + line);
                __builtin_prefetch((const char *)v_cache + next + line);
            }
        }
        const float *k, *v;
        if (dtype == DTYPE_BFLOAT16) {
            widen_bf16(s->kf, (const uint16_t *)k_cache + offset, n * D);
            widen_bf16(s->vf, (const uint16_t *)v_cache + offset, n * D);
            k = s->kf;
            v = s->vf;
        } else {
            k = (const float *)k_cache + offset;
            v = (const float *)v_cache + offset;
        }

        /* K and V blocks now sit in L1: every head of the group reuses them. */
        for (int g = 0; g < group; g++) {
            const float *qg = s->q + (size_t)g * D;
            block_scores(s->score, qg, k, n, block_size, D);
            const float bmax = block_max(s->score, n);
            /* Online softmax: rescale what was accumulated under the old max. The first block
             * has m = -inf, so corr = exp(-inf) = 0 against an all-zero accumulator. */
            const float m_new = s->m[g] > bmax ? s->m[g] : bmax;
            const float corr = exp_nonpositive(s->m[g] - m_new);
            for (int t = 0; t < n; t++) s->score[t] = exp_nonpositive(s->score[t] - m_new);
            /* The softmax denominator is kept per block slot and summed once at the end: a
             * running scalar sum would be a serial chain of adds. */
            float *lg = s->l + (size_t)g * block_size;
            for (int t = 0; t < block_size; t++) lg[t] = lg[t] * corr + (t < n ? s->score[t] : 0.0f);
            s->m[g] = m_new;
            accumulate_pv(s->acc + (size_t)g * D, corr, s->score, v, n, D);
        }
    }

    for (int g = 0; g < group; g++) {
        float l = 0.0f;
        for (int t = 0; t < block_size; t++) l += s->l[(size_t)g * block_size + t];
        /* len == 0 (no context) leaves l = 0: write zeros rather than 0/0. */
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int i = 0; i < D; i++) out[(size_t)g * D + i] = s->acc[(size_t)g * D + i] * inv;
    }
}

/* Entry point (see the header comment for layouts). Returns OK, ERR_SHAPE or ERR_NOMEM; on an
 * error `out` is left partly unwritten and the caller must not use it. */
int kvfleet_decode_attention(const float *query, float *out, const void *k_cache,
                             const void *v_cache, int dtype, const int32_t *block_tables,
                             int64_t table_stride, const int32_t *seq_lens, int num_seqs,
                             int num_heads, int num_kv_heads, int head_dim, int block_size,
                             int64_t num_blocks, float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 ||
        head_dim % LANES != 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        block_size > MAX_BLOCK_SIZE || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16))
        return ERR_SHAPE;
    const int group = num_heads / num_kv_heads;
    const int tasks = num_seqs * num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > tasks) num_threads = tasks > 0 ? tasks : 1;
    int status = OK;

#pragma omp parallel num_threads(num_threads)
    {
        Scratch s;
        const int mine = scratch_alloc(&s, group, head_dim, block_size);
        if (mine != OK) {
#pragma omp atomic write
            status = mine;
        }
        /* Ragged lengths make tasks uneven: hand them out one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            if (mine != OK) continue;
            const int seq = task / num_kv_heads, kvh = task % num_kv_heads;
            const size_t first = ((size_t)seq * num_heads + (size_t)kvh * group) * head_dim;
            attend_group(&s, query + first, out + first, k_cache, v_cache, dtype,
                         block_tables + (size_t)seq * table_stride, seq_lens[seq], kvh, group,
                         head_dim, block_size, num_blocks, scale);
        }
        if (mine == OK) free(s.q);
    }
    return status;
}
