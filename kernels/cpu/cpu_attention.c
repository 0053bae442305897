/* Paged decode attention for kvfleet's CPU path: one query token per sequence against its
 * paged K/V context, read in place from the head-major cache.
 *
 * Why C: the torch reference gathers every sequence's blocks into a padded [kv_heads, seqs,
 * max_ctx, D] copy and runs tiny batched matmuls; on CPU that costs several times the bytes
 * the step must read. Here each (sequence, kv head) pair is one task that walks its block table,
 * reads each K/V block once for all query heads of its GQA group, and keeps an online softmax
 * (running max, running sum, float32 accumulator) so nothing is padded or materialised; a
 * context past SPLIT_KEYS keys is several tasks, combined at the end (see SPLIT_KEYS).
 *
 * Layout (see kernels/reference.py, allocate_kv_cache(head_major=True)):
 *   k_cache, v_cache  [num_kv_heads, num_blocks, block_size, head_dim], contiguous,
 *                     float32 or bfloat16 (bf16 stored as uint16: the top half of a float32),
 *                     or fp8 e4m3fn / e5m2 (one byte each, widened to float32 per block)
 *   query, out        [num_seqs, num_heads, head_dim], heads packed within a sequence's row,
 *                     rows q_stride / out_stride elements apart; float32, or bf16 (io_dtype
 *                     1) so a bf16 model's q needs no float32 copy and its output no cast:
 *                     each task widens its group's queries (exact) and rounds its outputs to
 *                     nearest even, the bits torch's .to() gives
 *   block_tables      int32, row s at block_tables + s * table_stride
 *   seq_lens          int32 [num_seqs]
 * Query head h reads kv head h / (num_heads / num_kv_heads), as in the reference.
 *
 * Three paths by what the CPU offers, each documented where it is defined: AMX tiles (bf16,
 * head_dim 64), AVX512-BF16 dot products (bf16), and the portable float32 widening path (every
 * dtype; its vectorised loops below).
 *
 * Vectorisation: inner loops run over LANES consecutive floats with independent accumulators,
 * a shape gcc -O3 vectorises without -ffast-math (a plain float sum reduction would stay
 * scalar, since reassociating it changes the result). head_dim must be a multiple of LANES.
 *
 * Built by kernels/cpu/cpu_library.py: gcc -O3 -march=native -fopenmp -shared -fPIC.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_entry_points.h"
#include "cpu_math.h"

#define LANES 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

static size_t dtype_size(int dtype) {
    return dtype == DTYPE_FLOAT32 ? 4 : dtype == DTYPE_BFLOAT16 ? 2 : 1;
}

/* n fp8 values → float32. With AVX-512, through IEEE half precision: e5m2 is a half's top
 * byte; e4m3fn's exponent and mantissa bits, moved into a half's fields as they stand, are read
 * with the half's exponent bias (15) instead of 7, and one multiply by 2^8 corrects it, for
 * subnormals too (they land on half subnormals, which vcvtph2ps converts exactly at full speed;
 * the same trick through float32's fields hit float32 subnormals, whose microcode assists made
 * the kernel 3x slower, and a 256-entry table lookup was as slow). NaN/inf encodings come out
 * as large finite numbers: writes saturate, so the cache never holds them. n is a multiple of
 * 16 (head_dim is). */
static void widen_fp8(float *restrict dst, const uint8_t *restrict src, int n, int dtype) {
    const int e4m3 = dtype == DTYPE_FP8_E4M3;
#ifdef __AVX512F__
    const __m256i sign = _mm256_set1_epi16((short)0x8000), low7 = _mm256_set1_epi16(0x7F);
    const __m512 rebias = _mm512_set1_ps(e4m3 ? 256.0f : 1.0f);
    for (int i = 0; i < n; i += 16) {
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m256i h =
            e4m3 ? _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(x, 8), sign),
                                   _mm256_slli_epi16(_mm256_and_si256(x, low7), 7))
                 : _mm256_slli_epi16(x, 8);
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), rebias));
    }
#else
    for (int i = 0; i < n; i++) { /* the formats' definitions, one value at a time */
        const int x = src[i];
        const int e = e4m3 ? (x >> 3) & 0xF : (x >> 2) & 0x1F, m = e4m3 ? x & 7 : x & 3;
        const int bias = e4m3 ? 7 : 15, mbits = e4m3 ? 3 : 2;
        const float mag = e ? ldexpf(1.0f + (float)m / (float)(1 << mbits), e - bias)
                            : ldexpf((float)m, 1 - bias - mbits);
        dst[i] = (x & 0x80) ? -mag : mag;
    }
#endif
}

enum {
    OK = 0,
    ERR_SHAPE = 1, /* head_dim, block_size, head counts or dtype outside what this file handles */
    ERR_NOMEM = 2, /* per-thread scratch could not be allocated */
};

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

/* a · b over d floats, d a multiple of LANES. */
static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float acc[LANES] = {0};
    for (int i = 0; i < d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    return hsum(acc);
}

/* score[0..W) = q · k[t] for W rows of k (row stride d, d a multiple of W): the W keys'
 * partial sums stay in vectors and one transpose-and-add tree (REDUCE) sums them all, where
 * per key `dot` ends in a serial chain of scalar adds (on AVX2 that chain took half of a decode
 * step's attention). One body for both vector widths. */
#define DEFINE_SCORE_KEYS(W, VEC, MM, REDUCE)                                                  \
    static inline void score_keys(float *score, const float *restrict q,                      \
                                  const float *restrict k, int d) {                            \
        VEC v[W];                                                                              \
        for (int t = 0; t < W; t++) v[t] = MM##_setzero_ps();                                  \
        for (int i = 0; i < d; i += W) {                                                       \
            const VEC qi = MM##_loadu_ps(q + i);                                               \
            for (int t = 0; t < W; t++)                                                        \
                v[t] = MM##_fmadd_ps(qi, MM##_loadu_ps(k + (size_t)t * d + i), v[t]);          \
        }                                                                                      \
        MM##_storeu_ps(score, REDUCE(v));                                                      \
    }
#ifdef __AVX512F__
#define SCORE_KEYS 16
DEFINE_SCORE_KEYS(16, __m512, _mm512, reduce16)
#elif defined(__AVX2__) && defined(__FMA__)
#define SCORE_KEYS 8
DEFINE_SCORE_KEYS(8, __m256, _mm256, reduce8)
#endif

/* score[t] = q · k[t] for the n valid rows of a block of block_size rows (row stride d). */
static inline void block_scores(float *score, const float *restrict q, const float *restrict k,
                                int n, int block_size, int d) {
#ifdef SCORE_KEYS
    if (block_size % SCORE_KEYS == 0) {
        /* Whole groups of SCORE_KEYS rows: they lie inside the block even past row n. */
        for (int t = 0; t < n; t += SCORE_KEYS) score_keys(score + t, q, k + (size_t)t * d, d);
        return;
    }
#else
    (void)block_size;
#endif
    for (int t = 0; t < n; t++) score[t] = dot(q, k + (size_t)t * d, d);
}

/* The largest of score[0..n). A scalar max over the block is a serial chain of compares, as
 * slow as the dots; max is exact, so the vector forms give the scalar's result. */
static inline float block_max(const float *score, int n) {
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 valid = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, valid, score + t));
    }
    return _mm512_reduce_max_ps(m);
#else
    float m = -INFINITY;
    int t = 0;
#ifdef SCORE_KEYS
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(score);
        for (t = 8; t + 8 <= n; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(score + t));
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        for (int l = 0; l < 8; l++)
            if (lanes[l] > m) m = lanes[l];
    }
#endif
    for (; t < n; t++)
        if (score[t] > m) m = score[t];
    return m;
#endif
}

/* score[t] = exp(score[t] - m) for t < n; whole vectors may write up to SCORE_PAD entries past
 * n (the scratch has room; those entries are never read). exp16 gives exp_nonpositive's bits;
 * exp8 may differ from it in the last place, so an AVX2 build differs from a scalar one there. */
#define SCORE_PAD 16
static inline void block_exp(float *score, int n, float m) {
#ifdef __AVX512F__
    const __m512 mv = _mm512_set1_ps(m);
    for (int t = 0; t < n; t += 16)
        _mm512_storeu_ps(score + t, exp16(_mm512_sub_ps(_mm512_loadu_ps(score + t), mv)));
#elif defined(SCORE_KEYS)
    const __m256 mv = _mm256_set1_ps(m);
    for (int t = 0; t < n; t += 8)
        _mm256_storeu_ps(score + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(score + t), mv)));
#else
    for (int t = 0; t < n; t++) score[t] = exp_nonpositive(score[t] - m);
#endif
}

/* acc[0:d] = acc * corr + sum_t p[t] * v[t, 0:d], for n rows of v (row stride d). NV vectors of
 * W floats (64 floats: four on AVX-512, eight on AVX2) stay in registers across the n rows:
 * NV independent FMA chains, where one or two would leave each row waiting on the FMA's
 * 4-cycle latency (on AVX2 that wait was a third of a decode step's attention). Starts at float
 * i and returns how far it covered; the caller's portable loop does the rest, with the same
 * operations per element (gcc contracts its multiply-add into the same FMA), so the bits do
 * not depend on which loop a slice took. One body for both vector widths. */
#define DEFINE_PV_SLICES(NAME, NV, W, VEC, MM)                                                  \
    static inline int NAME(float *restrict acc, float corr, const float *restrict p,           \
                           const float *restrict v, int n, int d, int i) {                      \
        const VEC c = MM##_set1_ps(corr);                                                       \
        for (; i + NV * W <= d; i += NV * W) {                                                  \
            VEC a[NV];                                                                          \
            for (int j = 0; j < NV; j++) a[j] = MM##_mul_ps(MM##_loadu_ps(acc + i + j * W), c); \
            for (int t = 0; t < n; t++) {                                                       \
                const VEC pt = MM##_set1_ps(p[t]);                                              \
                const float *row = v + (size_t)t * d + i;                                       \
                for (int j = 0; j < NV; j++)                                                    \
                    a[j] = MM##_fmadd_ps(pt, MM##_loadu_ps(row + j * W), a[j]);                 \
            }                                                                                   \
            for (int j = 0; j < NV; j++) MM##_storeu_ps(acc + i + j * W, a[j]);                 \
        }                                                                                       \
        return i;                                                                               \
    }
#ifdef __AVX512F__
DEFINE_PV_SLICES(pv_slices, 4, 16, __m512, _mm512)
#elif defined(SCORE_KEYS)
DEFINE_PV_SLICES(pv_slices, 8, 8, __m256, _mm256)
/* What is left of d past the 64-float slices (head_dim 80, 96, 112, ...), LANES floats at a
 * time. The portable loop's vector form on AVX2 hung on gcc's numbering of its temporaries:
 * half its lanes vectorised in one build, none in another of the same source (16 scalar FMAs a
 * row); this form is the same two FMAs a row in every build. */
DEFINE_PV_SLICES(pv_lanes, 2, 8, __m256, _mm256)
#else
static inline int pv_slices(float *acc, float corr, const float *p, const float *v, int n, int d,
                            int i) {
    (void)acc, (void)corr, (void)p, (void)v, (void)n, (void)d;
    return i;
}
#endif

static inline void accumulate_pv(float *restrict acc, float corr, const float *restrict p,
                                 const float *restrict v, int n, int d) {
    int i = pv_slices(acc, corr, p, v, n, d, 0);
#if defined(SCORE_KEYS) && !defined(__AVX512F__)
    i = pv_lanes(acc, corr, p, v, n, d, i);
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
    float *kf;     /* [block_size, D]  one K block widened to float32 (bf16, fp8 caches) */
    float *vf;     /* [block_size, D]  one V block widened to float32 (bf16, fp8 caches) */
    float *score;  /* [block_size + SCORE_PAD]  one head's scores, then probabilities, for one
                    * block (block_exp's whole vectors may run past the block) */
    float *m;      /* [group]  running max of the scores */
    float *l;      /* [group, block_size]  running sums of exp(score - m), one per block slot */
    float *p;      /* [group, 32]  probabilities of two 16-row pieces per head (bf16 dot path) */
    uint16_t *qb;  /* [group, D]  the group's queries rounded to bf16, unscaled (bf16 dot path) */
    float *qio;    /* [group, D]  a bf16 query widened (bf16 I/O) */
    float *oio;    /* [group, D]  the output before it is rounded to bf16 (bf16 I/O) */
} Scratch;

static int scratch_alloc(Scratch *s, int group, int head_dim, int block_size) {
    const size_t gd = (size_t)group * head_dim, bd = (size_t)block_size * head_dim;
    /* + p (group * 32), qb (group * D bf16 = group * D / 2 floats, rounded up), qio, oio. */
    const size_t floats = 2 * gd + 2 * bd + block_size + SCORE_PAD + group +
                          (size_t)group * block_size + (size_t)group * 32 + (gd + 1) / 2 + 2 * gd;
    /* Zeroed: rows of kf past a short last block are read (and their results ignored). */
    float *base = calloc(floats, sizeof(float));
    if (!base) return ERR_NOMEM;
    s->q = base;
    s->acc = s->q + gd;
    s->kf = s->acc + gd;
    s->vf = s->kf + bd;
    s->score = s->vf + bd;
    s->m = s->score + block_size + SCORE_PAD;
    s->l = s->m + group;
    s->p = s->l + (size_t)group * block_size;
    s->qb = (uint16_t *)(s->p + (size_t)group * 32);
    s->qio = s->p + (size_t)group * 32 + (gd + 1) / 2;
    s->oio = s->qio + gd;
    return OK;
}

/* Where a task's result for one head goes: `out` normalised (the whole context was the
 * task's), or, for one split of a long context, `part` [D + 2]: the unnormalised accumulator,
 * then the running max and sum, for combine_splits. Returns the destination of the D values
 * and sets *inv to what they are multiplied by. */
static inline float *head_result(float *out, float *part, int g, int D, float m, float l,
                                 float *inv) {
    if (part) {
        float *dst = part + (size_t)g * (D + 2);
        dst[D] = m;
        dst[D + 1] = l;
        *inv = 1.0f;
        return dst;
    }
    /* len == 0 (no context) leaves l = 0: write zeros rather than 0/0. */
    *inv = l > 0.0f ? 1.0f / l : 0.0f;
    return out + (size_t)g * D;
}

/* One task: all `group` query heads that share kv head `kvh`, over the sequence's keys
 * [start, end) (start a multiple of the block size); results as head_result says. */
static void attend_group(Scratch *s, const float *query, float *out, float *part,
                         const void *k_cache, const void *v_cache, int dtype,
                         const int32_t *table, int start, int end, int kvh, int group,
                         int head_dim, int block_size, int64_t num_blocks, float scale) {
    const int D = head_dim;
    const size_t block_elems = (size_t)block_size * D;
    const size_t block_bytes = block_elems * dtype_size(dtype);

    for (int g = 0; g < group; g++) {
        for (int i = 0; i < D; i++) s->q[g * D + i] = query[(size_t)g * D + i] * scale;
        memset(s->acc + (size_t)g * D, 0, sizeof(float) * D);
        s->m[g] = -INFINITY;
    }
    memset(s->l, 0, sizeof(float) * (size_t)group * block_size);

    const int nblocks = (end + block_size - 1) / block_size;
    for (int b = start / block_size; b < nblocks; b++) {
        const int n = (b == nblocks - 1) ? end - b * block_size : block_size; /* valid rows */
        const size_t offset = ((size_t)kvh * num_blocks + (size_t)table[b]) * block_elems;
        /* Blocks are scattered in memory, so the hardware prefetcher cannot run ahead across
         * them: while this block is computed, the next block's K and V lines are asked into L1
         * and the two after it into L2 (locality 1: prefetcht2), a slice of their lines before
         * each head's work. A core holds few outstanding L1 misses: all of the next block's
         * lines asked at once stalled on that queue before any computing started, and went no
         * further ahead; L2's queue is deeper. 96 sequences of 300-700 tokens, float32 cache,
         * Zen 4 (AVX-512 build), in turns: 123-130 -> 82-84 ms a step with shuffled blocks,
         * 96-104 -> 75 ms with consecutive ones. (The bf16 dot path keeps to L1: L2 prefetches
         * there ran slower with shuffled blocks, 72 -> 93 ms, though faster with consecutive
         * ones, 62 -> 47 ms.) The last line of a slice may be asked twice, which costs nothing. */
        const float *k, *v;
        if (dtype == DTYPE_BFLOAT16) {
            widen_bf16(s->kf, (const uint16_t *)k_cache + offset, n * D);
            widen_bf16(s->vf, (const uint16_t *)v_cache + offset, n * D);
            k = s->kf;
            v = s->vf;
        } else if (dtype == DTYPE_FP8_E4M3 || dtype == DTYPE_FP8_E5M2) {
            widen_fp8(s->kf, (const uint8_t *)k_cache + offset, n * D, dtype);
            widen_fp8(s->vf, (const uint8_t *)v_cache + offset, n * D, dtype);
            k = s->kf;
            v = s->vf;
        } else {
            k = (const float *)k_cache + offset;
            v = (const float *)v_cache + offset;
        }

        /* K and V blocks now sit in L1: every head of the group reuses them. */
        for (int g = 0; g < group; g++) {
            const size_t lo = block_bytes * g / group / 64 * 64;
            const size_t hi = block_bytes * (g + 1) / group;
            for (int ahead = 1; ahead <= 3 && b + ahead < nblocks; ahead++) {
                const size_t at =
                    ((size_t)kvh * num_blocks + (size_t)table[b + ahead]) * block_bytes;
                const char *ka = (const char *)k_cache + at, *va = (const char *)v_cache + at;
                for (size_t line = lo; line < hi; line += 64) {
                    if (ahead == 1) { /* the locality must be a constant: a call per level */
                        __builtin_prefetch(ka + line);
                        __builtin_prefetch(va + line);
                    } else {
                        __builtin_prefetch(ka + line, 0, 1);
                        __builtin_prefetch(va + line, 0, 1);
                    }
                }
            }
            const float *qg = s->q + (size_t)g * D;
            block_scores(s->score, qg, k, n, block_size, D);
            const float bmax = block_max(s->score, n);
            /* Online softmax: rescale what was accumulated under the old max. The first block
             * has m = -inf, so corr = exp(-inf) = 0 against an all-zero accumulator. Most
             * blocks leave the max where it was, and exp_nonpositive(0) is exactly 1: the
             * test skips a serial chain of ~40 cycles a head (15% of the kernel) for the same
             * bits. */
            const float m_new = s->m[g] > bmax ? s->m[g] : bmax;
            const float corr = m_new == s->m[g] ? 1.0f : exp_nonpositive(s->m[g] - m_new);
            block_exp(s->score, n, m_new);
            /* The softmax denominator is kept per block slot and summed once at the end: a
             * running scalar sum would be a serial chain of adds. */
            float *lg = s->l + (size_t)g * block_size;
            for (int t = 0; t < block_size; t++) lg[t] = lg[t] * corr + (t < n ? s->score[t] : 0.0f);
            s->m[g] = m_new;
            accumulate_pv(s->acc + (size_t)g * D, corr, s->score, v, n, D);
        }
    }

    for (int g = 0; g < group; g++) {
        float l = 0.0f, inv;
        for (int t = 0; t < block_size; t++) l += s->l[(size_t)g * block_size + t];
        float *dst = head_result(out, part, g, D, s->m[g], l, &inv);
        for (int i = 0; i < D; i++) dst[i] = s->acc[(size_t)g * D + i] * inv;
    }
}

#ifdef __AVX512BF16__
/* The bf16 dot path (CPUs with AVX512-BF16, bf16 caches, block_size a multiple of 16, head_dim
 * a multiple of 32). Widening whole K/V blocks into float buffers cost about a quarter of the
 * kernel's time; here q · k runs on the bf16 K rows in place with vdpbf16ps (two bf16 products
 * per float32 lane, float32 accumulation), and V rows are widened in registers as they are
 * read. The query is rounded to bf16 once per task — exact when the model runs in bf16, whose
 * query is a bf16 tensor — and the scale is applied to the float32 scores, not the bf16 query.
 * P · V stays float32 (probabilities are not rounded to bf16): the bf16-pair variant roughly
 * halves the FMAs but adds a 2^-9 relative error per probability. */
#define HAVE_BF16_DOT 1
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

/* The maximum of v's lanes, in every lane (stays in vector registers: a scalar max, exp and
 * broadcast per head and chunk was a serial chain as long as the dot products). */
static inline __m512 broadcast_max(__m512 v) {
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));
    return _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
}

static void attend_group_bf16(Scratch *s, const float *query, float *out, float *part,
                              const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *table, int start, int end, int kvh, int group,
                              int head_dim, int block_size, int64_t num_blocks, float scale) {
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
        /* As in attend_group: blocks are scattered, so the next one(s) are fetched ahead, a
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

#ifdef HAVE_AMX
/* The AMX path (bf16 caches, head_dim 64, blocks of a multiple of 16 tokens, GQA groups of up
 * to 16 heads). On the dot path above, q . k (vdpbf16ps plus a 16-way transpose-and-add per
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
#define AMX_HEAD_DIM 64

typedef struct {
    uint16_t qt[2 * 16 * 16 * 2]; /* Q^T as two B tiles (dims 0-31, 32-63) */
    float s[32 * 16];             /* S^T of 32 keys */
    uint16_t p[16 * 32];          /* P: one row of 32 bf16 probabilities per head */
    uint16_t vt[4 * 16 * 16 * 2]; /* V of 32 keys as four B tiles (16 dims each) */
    float o[16 * AMX_HEAD_DIM];   /* O when it leaves the tiles */
} AmxScratch;

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

static void attend_group_amx(AmxScratch *w, const float *query, float *out,
                             const uint16_t *k_cache, const uint16_t *v_cache,
                             const int32_t *table, int len, int kvh, int group, int block_size,
                             int64_t num_blocks, float scale) {
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

/* Contexts longer than SPLIT_KEYS keys are cut into ranges of SPLIT_KEYS, one task each, and
 * their partial results combined after (flash-decoding). Why: a decode step of one sequence has
 * one task per KV head (3 for the bundled model), so on 2 threads one of them idled a third of
 * the time, and a long context's task ran on one core's share of memory bandwidth. The cut
 * depends on a sequence's own length only, never on the batch, so a sequence's output does not
 * depend on what else is in the step; contexts up to SPLIT_KEYS keep one task and the same
 * bits as before. A multiple of 32 keys, as the bf16 path takes its pieces in pairs. The AMX
 * path keeps whole contexts (no AMX host to measure it on yet).
 * Measured (2-core Zen 4, bf16 caches, GQA 9/3, head_dim 64, medians of 60 alternating calls
 * against the same code without splits): one sequence 55.6 -> 52.0 us at 2048 keys, 111.7 ->
 * 101.2 at 4096, 213.8 -> 182.3 at 8000 (in another run 20% less at 2048-4096); 2 and 8
 * sequences within +-2%. 512 keys gained up to 16% at 1024 keys alone but cost 3-6% at 4. */
#define SPLIT_KEYS 1024

/* A task's output rows rounded to bf16 (round to nearest even, the bits torch's .to() gives). */
static void store_bf16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

static int splits_of(int len, int block_size, int whole) {
    if (whole || len <= SPLIT_KEYS || SPLIT_KEYS % block_size) return 1;
    return (len + SPLIT_KEYS - 1) / SPLIT_KEYS;
}

/* The sequence whose tasks include `task`: first_task[seq] <= task < first_task[seq + 1]. */
static int seq_of_task(const int *first_task, int num_seqs, int task) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_task[mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* One (sequence, kv head) pair's output from its `splits` partial results (head_result's
 * layout, split after split): each split's accumulator and sum rescaled to the largest max. */
static void combine_splits(const float *parts, int splits, int group, int D, float *out) {
    const size_t stride = (size_t)group * (D + 2);
    for (int g = 0; g < group; g++) {
        const float *first = parts + (size_t)g * (D + 2);
        float m = -INFINITY, l = 0.0f;
        for (int i = 0; i < splits; i++)
            m = first[i * stride + D] > m ? first[i * stride + D] : m;
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] = 0.0f;
        for (int i = 0; i < splits; i++) {
            const float *part = first + i * stride;
            /* A split whose scores were all -inf (m = -inf) adds nothing. */
            const float w = m == -INFINITY ? 0.0f : exp_nonpositive(part[D] - m);
            l += w * part[D + 1];
            for (int d = 0; d < D; d++) out[(size_t)g * D + d] += w * part[d];
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] *= inv;
    }
}

/* Entry point (see the header comment for layouts). Returns OK, ERR_SHAPE or ERR_NOMEM; on an
 * error `out` is left partly unwritten and the caller must not use it. */
int kvfleet_decode_attention(const void *query_io, int64_t q_stride, void *out_io,
                             int64_t out_stride, int io_dtype, const void *k_cache,
                             const void *v_cache, int dtype, const int32_t *block_tables,
                             int64_t table_stride, const int32_t *seq_lens, int num_seqs,
                             int num_heads, int num_kv_heads, int head_dim, int block_size,
                             int64_t num_blocks, float scale, int num_threads, int allow_amx) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 ||
        head_dim % LANES != 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        block_size > MAX_BLOCK_SIZE || dtype < DTYPE_FLOAT32 || dtype > DTYPE_FP8_E5M2 ||
        (io_dtype != DTYPE_FLOAT32 && io_dtype != DTYPE_BFLOAT16) || num_seqs < 0)
        return ERR_SHAPE;
    const int group = num_heads / num_kv_heads;
#ifdef HAVE_AMX
    const int use_amx = allow_amx && dtype == DTYPE_BFLOAT16 && block_size % 16 == 0 &&
                        head_dim == AMX_HEAD_DIM && group <= 16 && amx_permitted();
#else
    (void)allow_amx;
    const int use_amx = 0;
#endif
    /* Tasks: per sequence, per kv head, per split (the AMX path takes whole contexts). */
    int *first_task = malloc(((size_t)num_seqs + 1) * sizeof(int));
    if (!first_task) return ERR_NOMEM;
    first_task[0] = 0;
    int any_split = 0;
    for (int seq = 0; seq < num_seqs; seq++) {
        const int n = splits_of(seq_lens[seq], block_size, use_amx);
        any_split |= n > 1;
        first_task[seq + 1] = first_task[seq] + n * num_kv_heads;
    }
    const int tasks = first_task[num_seqs];
    const size_t part_floats = (size_t)group * (head_dim + 2);
    float *parts = any_split ? malloc((size_t)tasks * part_floats * sizeof(float)) : NULL;
    if (any_split && !parts) {
        free(first_task);
        return ERR_NOMEM;
    }
    if (num_threads < 1) num_threads = 1;
    if (num_threads > tasks) num_threads = tasks > 0 ? tasks : 1;
    int status = OK;

#pragma omp parallel num_threads(num_threads)
    {
        Scratch s;
        int mine = scratch_alloc(&s, group, head_dim, block_size);
#ifdef HAVE_AMX
        AmxScratch *amx = NULL;
        if (mine == OK && use_amx) {
            amx = aligned_alloc(64, (sizeof(AmxScratch) + 63) / 64 * 64);
            if (amx) configure_tiles();
            else mine = ERR_NOMEM;
        }
#endif
        if (mine != OK) {
#pragma omp atomic write
            status = mine;
        }
        /* Ragged lengths make tasks uneven: hand them out one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            if (mine != OK) continue;
            const int seq = seq_of_task(first_task, num_seqs, task);
            const int splits = (first_task[seq + 1] - first_task[seq]) / num_kv_heads;
            const int kvh = (task - first_task[seq]) / splits;
            const int split = (task - first_task[seq]) % splits;
            const int len = seq_lens[seq], start = split * SPLIT_KEYS;
            const int end = splits == 1 ? len : (len - start < SPLIT_KEYS ? len : start + SPLIT_KEYS);
            float *part = splits > 1 ? parts + (size_t)task * part_floats : NULL;
            const size_t head0 = (size_t)kvh * group * head_dim, gd = (size_t)group * head_dim;
            const float *query;
            float *out;
            if (io_dtype == DTYPE_BFLOAT16) {
                const uint16_t *qb = (const uint16_t *)query_io + seq * q_stride + head0;
                for (size_t i = 0; i < gd; i++) s.qio[i] = bf16_to_f32(qb[i]);
                query = s.qio;
                out = s.oio;
            } else {
                query = (const float *)query_io + seq * q_stride + head0;
                out = (float *)out_io + seq * out_stride + head0;
            }
            const int32_t *table = block_tables + (size_t)seq * table_stride;
#ifdef HAVE_AMX
            if (amx)
                attend_group_amx(amx, query, out, k_cache, v_cache, table, len, kvh, group,
                                 block_size, num_blocks, scale);
            else
#endif
#ifdef HAVE_BF16_DOT
            if (dtype == DTYPE_BFLOAT16 && block_size % 16 == 0 && head_dim % 32 == 0)
                attend_group_bf16(&s, query, out, part, k_cache, v_cache, table, start, end, kvh,
                                  group, head_dim, block_size, num_blocks, scale);
            else
#endif
                attend_group(&s, query, out, part, k_cache, v_cache, dtype, table, start, end,
                             kvh, group, head_dim, block_size, num_blocks, scale);
            if (io_dtype == DTYPE_BFLOAT16 && !part)
                store_bf16((uint16_t *)out_io + seq * out_stride + head0, s.oio, gd);
        }
        /* (The loop's barrier:) every split's part is written. */
        if (any_split) {
#pragma omp for schedule(dynamic, 1)
            for (int pair = 0; pair < num_seqs * num_kv_heads; pair++) {
                const int seq = pair / num_kv_heads, kvh = pair % num_kv_heads;
                const int splits = (first_task[seq + 1] - first_task[seq]) / num_kv_heads;
                if (splits == 1 || mine != OK || status != OK) continue;
                const size_t head0 = (size_t)kvh * group * head_dim, gd = (size_t)group * head_dim;
                const float *own = parts + (size_t)(first_task[seq] + kvh * splits) * part_floats;
                if (io_dtype == DTYPE_BFLOAT16) {
                    combine_splits(own, splits, group, head_dim, s.oio);
                    store_bf16((uint16_t *)out_io + seq * out_stride + head0, s.oio, gd);
                } else {
                    combine_splits(own, splits, group, head_dim,
                                   (float *)out_io + seq * out_stride + head0);
                }
            }
        }
#ifdef HAVE_AMX
        if (amx) {
            _tile_release();
            free(amx);
        }
#endif
        if (mine == OK) free(s.q);
    }
    free(parts);
    free(first_task);
    return status;
}

/* Which attention path this build uses for bf16 caches: 1 the AVX512-BF16 dot path, 0 the
 * widening path. Lets the tests check that a machine with AVX512-BF16 really runs it. */
int kvfleet_cpu_attention_bf16_dot(void) {
#ifdef HAVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* Whether bf16 caches with head_dim 64 (blocks of a multiple of 16) take the AMX path here: the
 * build targets AMX and the process got the tiles. */
int kvfleet_cpu_attention_amx(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}
