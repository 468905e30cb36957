/* Greedy sampling's two reductions over a batch of float32 or bfloat16 logits rows: each row's first largest value (the token
 * torch.argmax picks) and that token's log-probability, -log(sum exp(x - max)), as log_softmax computes it. In
 * torch these were three passes of ~3 ms each over 64 rows of a 49k vocabulary on 2 cores (argmax and
 * log_softmax are not vectorised there the way amax is); here two vectorised passes per row, rows in parallel.
 *
 * A NaN counts as an impossible token, as sampling.finite makes it (never the largest; its exp clamps to ~1e-38,
 * nothing beside the largest value's 1). A row whose largest value is infinite, or with no finite value, is
 * refused (-1): the caller then takes the torch path, which gives such rows their defined meaning
 * (shard/sampling.py).
 */
#include <math.h>
#include <stdint.h>

#include "exp.h"

/* x[i] widened to float32 (bfloat16 is float32's upper half, so widening is exact). */
static inline __attribute__((always_inline)) float at_(const void *x, long i, int bf16) {
    if (!bf16) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load16_(const void *x, long i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* Inlined twice, bf16 a constant in each copy. */
static inline __attribute__((always_inline)) int greedy_row(const void *x, long vocab, int bf16, int64_t *token,
                                                            float *logprob) {
    float best = -INFINITY;
    long at = 0, i = 0;
#if defined(__AVX512F__)
    if (vocab >= 16) {
        __m512 bv = _mm512_set1_ps(-INFINITY);
        __m512i bi = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                                                     15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= vocab; i += 16) {  /* per lane: its largest value and where it first appeared */
            __m512 v = load16_(x, i, bf16);
            __mmask16 up = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
            bv = _mm512_mask_mov_ps(bv, up, v);
            bi = _mm512_mask_mov_epi32(bi, up, idx);
            idx = _mm512_add_epi32(idx, step);
        }
        best = _mm512_reduce_max_ps(bv);
        __mmask16 top = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
        at = _mm512_mask_reduce_min_epi32(top, bi);  /* ties: the first index among the lanes holding the max */
    }
#endif
    for (; i < vocab; i++)
        if (at_(x, i, bf16) > best) {
            best = at_(x, i, bf16);
            at = i;
        }
    if (!(best > -INFINITY && best < INFINITY)) return -1;
    float sum = 0.0f;
    i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), m = _mm512_set1_ps(best);
    for (; i + 16 <= vocab; i += 16) acc = _mm512_add_ps(acc, v_exp(_mm512_sub_ps(load16_(x, i, bf16), m)));
    sum = _mm512_reduce_add_ps(acc);
#else
    float part[16] = {0};  /* sixteen running sums, as the lanes keep: one sum over 49k terms drifts by ~1e-4 */
    for (; i + 16 <= vocab; i += 16)
        for (int l = 0; l < 16; l++) part[l] += exp_neg(at_(x, i + l, bf16) - best);
    for (int l = 0; l < 16; l++) sum += part[l];
#endif
    for (; i < vocab; i++) sum += exp_neg(at_(x, i, bf16) - best);
    if (!(sum >= 1.0f && sum < INFINITY)) return -1;  /* a NaN in the plain loop's share of the row */
    *token = at;
    *logprob = -logf(sum);
    return 0;
}

/* logits [rows, vocab] (float32, or bfloat16 when bf16) with row stride `stride` (elements); writes tokens[rows]
 * and logprobs[rows]. */
int greedy_rows(const void *logits, long rows, long vocab, long stride, int bf16, int64_t *tokens, float *logprobs,
                int threads) {
    int failed = 0;
    const long esize = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (long r = 0; r < rows; r++) {
        const char *row = (const char *)logits + r * stride * esize;
        failed |= (bf16 ? greedy_row(row, vocab, 1, tokens + r, logprobs + r)
                        : greedy_row(row, vocab, 0, tokens + r, logprobs + r)) != 0;
    }
    return failed ? -1 : 0;
}
