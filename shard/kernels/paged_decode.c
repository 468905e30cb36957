/* Decode attention read straight through the block tables: one query per request, its keys and values read in
 * place from the paged cache, once each. The torch path gathers every request's blocks into a padded batch in
 * every layer, then reads that copy twice (scores, then values): three passes over the cache instead of one.
 *
 * Caches are head-major, [kv_heads, blocks, block_size, dim], float32 or bfloat16; queries and outputs are
 * [heads, tokens, dim] with any strides, in the same dtype as the cache. Scores, softmax and sums are float32.
 * Built by shard/paged_kernel.py with the machine's own compiler flags (-O3 -march=native -fopenmp). Where the
 * compiler targets AVX-512 the maths is written in its intrinsics (2x the plain loops, which it vectorised with a
 * horizontal sum per dot product and a scalar maximum), and with AVX512-BF16 a bf16 cache's scores are bf16 dot
 * products; elsewhere the plain loops run.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"
#include "paged.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define PREFETCH_KEYS 512  /* x dim x 2 caches: 128 KB of a bf16 cache at dim 64, well inside L2 */

#if defined(__AVX512F__)
#include <immintrin.h>

/* Sums of 16 vectors, one per lane of the result: r[j] = sum of x[j]'s lanes (a transpose-and-add tree, 45
 * shuffles and adds for 16 dot products instead of a full horizontal reduction for each). */
static inline __m512 sum16(__m512 *x) {
    __m512 y[8], z[4];
    for (int j = 0; j < 8; j++)
        y[j] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * j], x[2 * j + 1]), _mm512_unpackhi_ps(x[2 * j], x[2 * j + 1]));
    for (int j = 0; j < 4; j++)
        z[j] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}


/* attend_one's maths for dim a multiple of 16 (C = dim / 16 vectors a row): sixteen keys scored at once, the
 * running maximum kept from the scores, softmax in vectors, its 1/sum applied once to the output, and the next
 * block prefetched while this one is read (every block is its own 2 KB at dim 64, where the hardware prefetcher stops).
 * With `dp` (a bf16 cache, AVX512-BF16) the scores are dot products of the raw bf16 query `qb` ([group][dim / 32]
 * __m512bh) and keys, pairs multiplied exactly and summed in float32, no widening, scaled afterwards; else of the
 * float32 query `qf`, already scaled, and the widened keys. Inlined with constant C, bf16 and dp for the common
 * shapes. Writes acc normalised. */
static inline __attribute__((always_inline)) void attend_avx512(
    const float (*qf)[MAX_DIM], const void *qb, const int dp, const char *k_cache, const char *v_cache,
    long block_size, const int64_t *table, long head_base, long key_start, long first, long n, long group,
    const long C, int bf16, float scale, float *scores, float (*acc)[MAX_DIM]) {
    const long esize = bf16 ? 2 : 4, dim = C * 16;
    __m512 mx[MAX_GROUP];
    for (long g = 0; g < group; g++) mx[g] = _mm512_set1_ps(-INFINITY);
    for (long i = 0, take; i < n; i += take) {
        const char *kb = block_run(k_cache, block_size, table, head_base, key_start, first, i, n, dim * esize, &take);
        for (long j0 = 0; j0 < take; j0 += 16) {
            long m = take - j0 < 16 ? take - j0 : 16;
            for (long g = 0; g < group; g++) {
                __m512 x[16];
                for (long j = 0; j < 16; j++) {
                    __m512 s = _mm512_setzero_ps();
                    if (j < m) {
#if defined(__AVX512BF16__)
                        if (dp)
                            for (long c = 0; c < C / 2; c++)
                                s = _mm512_dpbf16_ps(s, ((const __m512bh (*)[MAX_DIM / 32])qb)[g][c],
                                    (__m512bh)_mm512_loadu_si512((const uint16_t *)kb + (j0 + j) * dim + 32 * c));
                        else
#endif
                            for (long c = 0; c < C; c++)
                                s = _mm512_fmadd_ps(_mm512_loadu_ps(qf[g] + 16 * c),
                                                    load16(kb, (j0 + j) * dim + 16 * c, bf16), s);
                    }
                    x[j] = s;
                }
                __mmask16 live = (__mmask16)((1u << m) - 1);
                __m512 r = dp ? _mm512_mul_ps(sum16(x), _mm512_set1_ps(scale)) : sum16(x);
                mx[g] = _mm512_mask_max_ps(mx[g], live, mx[g], r);
                _mm512_mask_storeu_ps(scores + g * n + i + j0, live, r);
            }
        }
    }
    float inv[MAX_GROUP];
    for (long g = 0; g < group; g++) {
        float *sg = scores + g * n;
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[g])), sum = _mm512_setzero_ps();
        for (long i = 0; i < n; i += 16) {
            __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            __m512 e = v_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + i), m));
            e = _mm512_maskz_mov_ps(live, e);
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(sg + i, live, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    __m512 a[MAX_GROUP][MAX_DIM / 16];
    for (long g = 0; g < group; g++)
        for (long c = 0; c < C; c++) a[g][c] = _mm512_setzero_ps();
    for (long i = 0, take; i < n; i += take) {
        const char *vb = block_run(v_cache, block_size, table, head_base, key_start, first, i, n, dim * esize, &take);
        for (long j = 0; j < take; j++)
            for (long c = 0; c < C; c++) {
                __m512 v = load16(vb, j * dim + 16 * c, bf16);
                for (long g = 0; g < group; g++)
                    a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + i + j]), v, a[g][c]);
            }
    }
    for (long g = 0; g < group; g++)
        for (long c = 0; c < C; c++)
            _mm512_storeu_ps(acc[g] + 16 * c, _mm512_mul_ps(a[g][c], _mm512_set1_ps(inv[g])));
}
#endif

/* attend_one's maths in plain loops, for any dim: scores, softmax, weighted values into acc (normalised). */
static void attend_plain(const float (*qf)[MAX_DIM], const char *k_cache, const char *v_cache, long block_size,
                         const int64_t *table, long head_base, long key_start, long first, long n, long group,
                         long dim, int bf16, float *scores, float (*acc)[MAX_DIM]) {
    /* scores */
    for (long i = 0; i < n; i++) {
        long p = first + i - key_start;
        long slot = head_base + table[p / block_size] * block_size + p % block_size;
        if (bf16) {
            const uint16_t *kr = (const uint16_t *)k_cache + slot * dim;
            float kf[MAX_DIM];
            for (long d = 0; d < dim; d++) kf[d] = from_bf16(kr[d]);
            for (long g = 0; g < group; g++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (long d = 0; d < dim; d++) s += qf[g][d] * kf[d];
                scores[g * n + i] = s;
            }
        } else {
            const float *kr = (const float *)k_cache + slot * dim;
            for (long g = 0; g < group; g++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (long d = 0; d < dim; d++) s += qf[g][d] * kr[d];
                scores[g * n + i] = s;
            }
        }
    }
    /* softmax */
    for (long g = 0; g < group; g++) {
        float *sg = scores + g * n, m = -INFINITY, sum = 0.0f;
        for (long i = 0; i < n; i++) m = sg[i] > m ? sg[i] : m;
#pragma omp simd reduction(+ : sum)
        for (long i = 0; i < n; i++) {
            sg[i] = exp_neg(sg[i] - m);
            sum += sg[i];
        }
        float inv = 1.0f / sum;
        for (long i = 0; i < n; i++) sg[i] *= inv;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    /* weighted values */
    for (long i = 0; i < n; i++) {
        long p = first + i - key_start;
        long slot = head_base + table[p / block_size] * block_size + p % block_size;
        float vf[MAX_DIM];
        if (bf16) {
            const uint16_t *vr = (const uint16_t *)v_cache + slot * dim;
            for (long d = 0; d < dim; d++) vf[d] = from_bf16(vr[d]);
        } else {
            memcpy(vf, (const float *)v_cache + slot * dim, sizeof(float) * dim);
        }
        for (long g = 0; g < group; g++) {
            float w = scores[g * n + i];
            for (long d = 0; d < dim; d++) acc[g][d] += w * vf[d];
        }
    }
}

/* One (request, kv head): its `group` query heads against the keys visible to it. */
static void attend_one(const char *q, long q_sh, long q_st, long row, const char *k_cache, const char *v_cache,
                       long num_blocks, long block_size, const int64_t *table, long key_start, long kv_len,
                       long window, char *out, long o_sh, long o_st, long h, long group, long dim, float scale,
                       int bf16, float *scores) {
    long esize = bf16 ? 2 : 4;
    long first = key_start;
    if (window > 0 && kv_len - window > first) first = kv_len - window;  /* the query sits at kv_len - 1 */
    long n = kv_len - first;
    float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM];
    for (long g = 0; g < group; g++) {
        const char *src = q + ((h * group + g) * q_sh + row * q_st) * esize;
        for (long d = 0; d < dim; d++)
            qf[g][d] = (bf16 ? from_bf16(((const uint16_t *)src)[d]) : ((const float *)src)[d]) * scale;
    }
    const long head_base = h * num_blocks * block_size;
#if defined(__AVX512F__)
    /* all of its keys and values asked for at once (up to PREFETCH_KEYS), so that their misses overlap: a request's
     * blocks lie anywhere in the cache, where the hardware prefetcher does not follow (~1.4x on a cold cache) */
    prefetch_run(k_cache, block_size, table, head_base, key_start, first, n < PREFETCH_KEYS ? n : PREFETCH_KEYS,
                 dim * esize);
    prefetch_run(v_cache, block_size, table, head_base, key_start, first, n < PREFETCH_KEYS ? n : PREFETCH_KEYS,
                 dim * esize);
#endif
#if defined(__AVX512BF16__)
    if (bf16 && dim % 32 == 0) {
        __m512bh qb[MAX_GROUP][MAX_DIM / 32];
        for (long g = 0; g < group; g++) {
            const uint16_t *src = (const uint16_t *)(q + ((h * group + g) * q_sh + row * q_st) * esize);
            for (long c = 0; c < dim / 32; c++) qb[g][c] = (__m512bh)_mm512_loadu_si512(src + 32 * c);
        }
        if (dim == 64)
            attend_avx512(qf, qb, 1, k_cache, v_cache, block_size, table, head_base, key_start, first, n, group, 4,
                          1, scale, scores, acc);
        else
            attend_avx512(qf, qb, 1, k_cache, v_cache, block_size, table, head_base, key_start, first, n, group,
                          dim / 16, 1, scale, scores, acc);
    } else
#endif
#if defined(__AVX512F__)
    if (dim == 64 && bf16)
        attend_avx512(qf, NULL, 0, k_cache, v_cache, block_size, table, head_base, key_start, first, n, group, 4, 1,
                      scale, scores, acc);
    else if (dim == 64)
        attend_avx512(qf, NULL, 0, k_cache, v_cache, block_size, table, head_base, key_start, first, n, group, 4, 0,
                      scale, scores, acc);
    else if (dim % 16 == 0)
        attend_avx512(qf, NULL, 0, k_cache, v_cache, block_size, table, head_base, key_start, first, n, group,
                      dim / 16, bf16, scale, scores, acc);
    else
#endif
        attend_plain(qf, k_cache, v_cache, block_size, table, head_base, key_start, first, n, group, dim, bf16,
                     scores, acc);
    for (long g = 0; g < group; g++) {
        char *dst = out + ((h * group + g) * o_sh + row * o_st) * esize;
        for (long d = 0; d < dim; d++) {
            if (bf16) ((uint16_t *)dst)[d] = to_bf16(acc[g][d]);
            else ((float *)dst)[d] = acc[g][d];
        }
    }
}

/* Returns 0, or -1 when a shape is beyond the fixed limits (the caller then takes the torch path). */
int paged_decode(const void *q, long q_sh, long q_st, const int64_t *rows, const void *k_cache, const void *v_cache,
                 long num_blocks, long block_size, const int64_t *tables, long table_width,
                 const int64_t *key_start, const int64_t *kv_len, long window, void *out, long o_sh, long o_st,
                 long batch, long kv_heads, long group, long dim, float scale, int bf16, int threads) {
    if (group > MAX_GROUP || dim > MAX_DIM) return -1;
    long most = 0;
    for (long b = 0; b < batch; b++) most = kv_len[b] - key_start[b] > most ? kv_len[b] - key_start[b] : most;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * (most > 0 ? most : 1)));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 4)
        for (long w = 0; w < batch * kv_heads; w++) {
            if (!scores) continue;
            long b = w / kv_heads, h = w % kv_heads;
            attend_one((const char *)q, q_sh, q_st, rows[b], (const char *)k_cache, (const char *)v_cache,
                       num_blocks, block_size, tables + b * table_width, key_start[b], kv_len[b], window,
                       (char *)out, o_sh, o_st, h, group, dim, scale, bf16, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
