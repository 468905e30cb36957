/* One float vector of the machine's width, VW lanes (16 with AVX-512, 8 with AVX2 and FMA; CB_VECTOR is defined
 * where either is), with the operations the kernels' shared code needs (exp.h's v_exp, paged_prefill.c), so that
 * one algorithm is written once for both. */
#ifndef CB_VEC_H
#define CB_VEC_H

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define CB_VECTOR 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vec;
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_zero _mm512_setzero_ps
#define v_set1 _mm512_set1_ps
#define v_fma _mm512_fmadd_ps
#define v_fnma _mm512_fnmadd_ps
#define v_mul _mm512_mul_ps
#define v_max _mm512_max_ps
#define v_sub _mm512_sub_ps
#define v_add _mm512_add_ps
#define v_floor(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define v_hmax _mm512_reduce_max_ps
#define v_hsum _mm512_reduce_add_ps

/* 2^n for whole n in float lanes: n + 127 shifted into the exponent */
static inline __m512 v_pow2(__m512 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(CB_VECTOR)
#define VW 8
typedef __m256 vec;
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_zero _mm256_setzero_ps
#define v_set1 _mm256_set1_ps
#define v_fma _mm256_fmadd_ps
#define v_fnma _mm256_fnmadd_ps
#define v_mul _mm256_mul_ps
#define v_max _mm256_max_ps
#define v_sub _mm256_sub_ps
#define v_add _mm256_add_ps
#define v_floor _mm256_floor_ps

static inline __m256 v_pow2(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

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
#endif
#endif
