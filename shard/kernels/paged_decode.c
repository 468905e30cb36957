/* Decode attention read straight through the block tables: one query per request, its keys and values read in
 * place from the paged cache, once each. The torch path gathers every request's blocks into a padded batch in
 * every layer, then reads that copy twice (scores, then values): three passes over the cache instead of one.
 *
 * Caches are head-major, [kv_heads, blocks, block_size, dim], float32 or bfloat16; queries and outputs are
 * [heads, tokens, dim] with any strides, in the same dtype as the cache. Scores, softmax and sums are float32.
 * Built by shard/paged_kernel.py with the machine's own compiler flags (-O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 to float32 precision (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r), written as
 * plain arithmetic so that the compiler vectorises the loops that call it; libm's expf would not be. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#define MAX_GROUP 16
#define MAX_DIM 256

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
