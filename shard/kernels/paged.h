/* What the paged attention kernels share (paged_decode.c, paged_prefill.c): bfloat16 conversions; on AVX-512
 * sixteen elements widened to float32; the walk through a request's block table; and one float vector of the
 * machine's width (VW lanes: 16 with AVX-512, 8 with AVX2 and FMA) with the few operations paged_prefill.c needs,
 * so that its one algorithm runs on either. */
#ifndef CB_PAGED_H
#define CB_PAGED_H
#include <stdint.h>
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define CB_VECTOR 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load16(const char *base, long i, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

#define VW 16
typedef __m512 vec;
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_zero _mm512_setzero_ps
#define v_set1 _mm512_set1_ps
#define v_fma _mm512_fmadd_ps
#define v_max _mm512_max_ps
#define v_sub _mm512_sub_ps
#define v_add _mm512_add_ps
#define v_hmax _mm512_reduce_max_ps
#define v_hsum _mm512_reduce_add_ps
#define v_row load16
#define v_exp exp_neg16
#elif defined(CB_VECTOR)
#define VW 8
typedef __m256 vec;
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_zero _mm256_setzero_ps
#define v_set1 _mm256_set1_ps
#define v_fma _mm256_fmadd_ps
#define v_max _mm256_max_ps
#define v_sub _mm256_sub_ps
#define v_add _mm256_add_ps
#define v_exp exp_neg8

static inline float v_hmax(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float v_hsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

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
