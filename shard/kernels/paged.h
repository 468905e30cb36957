/* What the paged attention kernels share (paged_decode.c, paged_prefill.c): bfloat16 conversions, a row's VW
 * elements widened to float32 (vec.h's lanes), and the walk through a request's block table. */
#ifndef CB_PAGED_H
#define CB_PAGED_H
#include <stdint.h>
#include <string.h>

#include "vec.h"

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

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load16(const char *base, long i, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}
#define v_row load16
#elif defined(CB_VECTOR)
/* eight elements i.. of a row, widened to float32 where bf16 */
static inline __attribute__((always_inline)) __m256 v_row(const char *base, long i, int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + i);
}
#endif

#if defined(CB_VECTOR)

/* Keys i.. of one cache up to the end of their block (or n): the first one's row, and how many (*take). The next
 * block is prefetched while this one is read. */
static inline const char *block_run(const char *cache, long block_size, const int64_t *table, long head_base,
                                    long key_start, long first, long i, long n, long row_bytes, long *take) {
    long p = first + i - key_start, off = p % block_size;
    *take = block_size - off < n - i ? block_size - off : n - i;
    if (i + *take < n) {
        const char *next = cache + (head_base + table[p / block_size + 1] * block_size) * row_bytes;
        for (long b = 0; b < block_size * row_bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
    return cache + (head_base + table[p / block_size] * block_size + off) * row_bytes;
}

/* Every key of one cache from `first` to first + n requested at once, so that their misses overlap. */
static inline void prefetch_run(const char *cache, long block_size, const int64_t *table, long head_base,
                                long key_start, long first, long n, long row_bytes) {
    for (long p = first - key_start, end = p + n; p < end;) {
        long off = p % block_size, take = block_size - off < end - p ? block_size - off : end - p;
        const char *row = cache + (head_base + table[p / block_size] * block_size + off) * row_bytes;
        for (long b = 0; b < take * row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
        p += take;
    }
}

#endif
#endif
