/* Greedy sampling's two reductions over a batch of float32 logits rows: each row's first largest value (the token
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

static int greedy_row(const float *x, long vocab, int64_t *token, float *logprob) {
    float best = -INFINITY;
    long at = 0, i = 0;
#if defined(__AVX512F__)
    if (vocab >= 16) {
        __m512 bv = _mm512_set1_ps(-INFINITY);
        __m512i bi = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                                                     15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= vocab; i += 16) {  /* per lane: its largest value and where it first appeared */
            __m512 v = _mm512_loadu_ps(x + i);
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
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
    if (!(best > -INFINITY && best < INFINITY)) return -1;
    float sum = 0.0f;
    i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), m = _mm512_set1_ps(best);
    for (; i + 16 <= vocab; i += 16) acc = _mm512_add_ps(acc, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m)));
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < vocab; i++) sum += exp_neg(x[i] - best);
    if (!(sum >= 1.0f && sum < INFINITY)) return -1;  /* a NaN in the plain loop's share of the row */
    *token = at;
    *logprob = -logf(sum);
    return 0;
}

/* logits [rows, vocab] with row stride `stride` (elements); writes tokens[rows] and logprobs[rows]. */
int greedy_rows(const float *logits, long rows, long vocab, long stride, int64_t *tokens, float *logprobs,
                int threads) {
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (long r = 0; r < rows; r++) failed |= greedy_row(logits + r * stride, vocab, tokens + r, logprobs + r) != 0;
    return failed ? -1 : 0;
}
