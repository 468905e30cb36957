/* Prompt-chunk attention read straight through the block tables: each chunk's queries against the keys before
 * them (and their own, causally), the keys and values read in place from the paged cache. The torch path gathers
 * the chunks' blocks into a padded batch in every layer and runs SDPA over it, padding every chunk to the
 * longest; SDPA's CPU kernel reached 70-80 GFLOP/s of the causal work here at head size 64.
 *
 * A work item is up to TILE_ROWS (query, head) rows: a run of one chunk's queries times the query heads of one kv
 * head. Its keys and values are widened to float32 once (keys transposed, so that eight rows score sixteen keys
 * with one vector load and eight broadcast FMAs per dimension), scores and softmax are float32, and each row
 * stops at its own last key (and starts at its window's first). Caches, queries and outputs are laid out as in
 * paged_decode.c. Written once in vec.h's vectors: sixteen lanes with AVX-512, eight with AVX2 and FMA (on a
 * 2-core Zen 3 without AVX-512, SmolLM2's heads, a layer's 512-token chunk took 5.7 ms against the torch path's
 * 9.5, 2,048 tokens 82 against 134); without either it declines and the torch path runs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"
#include "paged.h"

#define TILE_ROWS 48
#define MAX_DIM 256

#if defined(CB_VECTOR)

typedef struct {
    float *qf;    /* [TILE_ROWS][dim] the rows' queries, scaled */
    float *s;     /* [TILE_ROWS][stride] scores, then probabilities */
} Buffers;

/* One chunk's keys for one kv head from its first visible one: transposed ([dim][stride]) and values ([stride][dim]),
 * float32, read once through the block table; the keys past the last zero up to stride. */
static void widen(const char *k_cache, const char *v_cache, long num_blocks, long block_size, const int64_t *table,
                  long h, long key_start, long lo, long n, long stride, long dim, int bf16, float *kt, float *vf) {
    const long esize = bf16 ? 2 : 4, C = dim / VW, head_base = h * num_blocks * block_size;
    for (long j = 0, take; j < n; j += take) {
        const char *kb = block_run(k_cache, block_size, table, head_base, key_start, lo, j, n, dim * esize, &take);
        const char *vb = block_run(v_cache, block_size, table, head_base, key_start, lo, j, n, dim * esize, &take);
        for (long t = 0; t < take; t++)
            for (long c = 0; c < C; c++) {
                float kv[VW];
                v_store(kv, v_row(kb, t * dim + VW * c, bf16));
                for (int e = 0; e < VW; e++) kt[(VW * c + e) * stride + j + t] = kv[e];
                v_store(vf + (j + t) * dim + VW * c, v_row(vb, t * dim + VW * c, bf16));
            }
    }
    for (long d = 0; d < dim; d++)
        for (long j = n; j < stride; j++) kt[d * stride + j] = 0.0f;
}

/* Scores of eight rows against keys [0, n) (n a multiple of 16 in kt), VW keys at a time; a row pointer repeated
 * for fewer rows. */
static inline __attribute__((always_inline)) void score8(const float *const *q, const float *kt, long stride,
                                                         long n, long dim, float *const *out) {
    for (long j = 0; j < n; j += VW) {
        vec a[8];
        for (int r = 0; r < 8; r++) a[r] = v_zero();
        for (long d = 0; d < dim; d++) {
            vec k = v_load(kt + d * stride + j);
            for (int r = 0; r < 8; r++) a[r] = v_fma(v_set1(q[r][d]), k, a[r]);
        }
        for (int r = 0; r < 8; r++) v_store(out[r] + j, a[r]);
    }
}

/* acc rows (RB of them, C vectors each) = sum over keys [lo, hi) of p[r][j] * v[j]. */
#define ACCUMULATORS (24 > MAX_DIM / VW ? 24 : MAX_DIM / VW)
static inline __attribute__((always_inline)) void weigh(const float *const *p, const float *vf, long lo, long hi,
                                                        const long C, const long RB, float *const *acc) {
    vec a[ACCUMULATORS];
    for (long x = 0; x < RB * C; x++) a[x] = v_zero();
    for (long j = lo; j < hi; j++) {
        const float *v = vf + j * C * VW;
        for (long c = 0; c < C; c++) {
            vec vv = v_load(v + VW * c);
            for (long r = 0; r < RB; r++) a[r * C + c] = v_fma(v_set1(p[r][j]), vv, a[r * C + c]);
        }
    }
    for (long r = 0; r < RB; r++)
        for (long c = 0; c < C; c++) v_store(acc[r] + VW * c, a[r * C + c]);
}

/* One work item: queries [i0, i0 + nq) of a chunk whose first query sits at position pos0 and row row0, for the
 * `group` query heads of kv head h, against that head's widened keys kt/vf (from position lo0, `stride` of them).
 * Row r is query r / group, head r % group. */
static void tile(const char *q, long q_sh, long q_st, long row0, long pos0, long i0, long nq, long h, long group,
                 long dim, const float *kt_all, const float *vf_all, long lo0, long stride, long window, char *out,
                 long o_sh, long o_st, float scale, int bf16, Buffers *buf) {
    const long esize = bf16 ? 2 : 4, C = dim / VW, R = nq * group;
    const long first_pos = pos0 + i0, last_pos = first_pos + nq - 1;
    long lo = lo0;
    if (window > 0 && first_pos - window + 1 > lo) lo = first_pos - window + 1;
    const long n = last_pos + 1 - lo, n16 = (n + 15) & ~15L;
    const float *kt = kt_all + (lo - lo0), *vf = vf_all + (lo - lo0) * dim;
    for (long r = 0; r < R; r++) {
        const char *src = q + ((h * group + r % group) * q_sh + (row0 + i0 + r / group) * q_st) * esize;
        for (long d = 0; d < dim; d++)
            buf->qf[r * dim + d] = (bf16 ? from_bf16(((const uint16_t *)src)[d]) : ((const float *)src)[d]) * scale;
    }
    /* scores, eight rows at a time */
    for (long r0 = 0; r0 < R; r0 += 8) {
        const float *qs[8];
        float *ss[8];
        for (int r = 0; r < 8; r++) {
            long rr = r0 + r < R ? r0 + r : r0;  /* past the last row: row r0 again, written to itself */
            qs[r] = buf->qf + rr * dim;
            ss[r] = buf->s + rr * n16;
        }
        score8(qs, kt, stride, n16, dim, ss);
    }
    /* each row's softmax over its own keys [from, to): causal, and inside the window */
    float inv[TILE_ROWS];
    long from[TILE_ROWS], to[TILE_ROWS];
    for (long r = 0; r < R; r++) {
        long pos = first_pos + r / group;
        to[r] = pos + 1 - lo;
        from[r] = window > 0 && pos - window + 1 - lo > 0 ? pos - window + 1 - lo : 0;
        float *sr = buf->s + r * n16;
        vec mv = v_set1(-INFINITY);
        long j = from[r];
        for (; j + VW <= to[r]; j += VW) mv = v_max(mv, v_load(sr + j));
        float m = v_hmax(mv);
        for (; j < to[r]; j++) m = sr[j] > m ? sr[j] : m;
        vec mm = v_set1(m), sum = v_zero();
        for (j = from[r]; j + VW <= to[r]; j += VW) {
            vec e = v_exp(v_sub(v_load(sr + j), mm));
            sum = v_add(sum, e);
            v_store(sr + j, e);
        }
        float total = v_hsum(sum);
        for (; j < to[r]; j++) {
            sr[j] = exp_neg(sr[j] - m);
            total += sr[j];
        }
        inv[r] = 1.0f / total;
        for (long j = 0; j < from[r]; j++) sr[j] = 0.0f;
        for (long j = to[r]; j < n; j++) sr[j] = 0.0f;
    }
    /* values: for head size 64 on AVX-512 six rows at a time (24 of its 32 registers) over the keys any of them
     * sees, else (and the rows left over) one row at a time over its own keys */
    float acc[TILE_ROWS][MAX_DIM];
    long r0 = 0;
    if (VW == 16 && C == 4)
        for (; r0 + 6 <= R; r0 += 6) {
            const float *ps[6];
            float *as[6];
            long klo = from[r0], khi = to[r0];
            for (long r = 0; r < 6; r++) {
                ps[r] = buf->s + (r0 + r) * n16;
                as[r] = acc[r0 + r];
                klo = from[r0 + r] < klo ? from[r0 + r] : klo;
                khi = to[r0 + r] > khi ? to[r0 + r] : khi;
            }
            weigh(ps, vf, klo, khi, 4, 6, as);
        }
    for (; r0 < R; r0++) {
        const float *p = buf->s + r0 * n16;
        float *a = acc[r0];
        if (C == 8)  /* head size 64 on AVX2: its eight accumulators in registers, not on the stack */
            weigh(&p, vf, from[r0], to[r0], 8, 1, &a);
        else
            weigh(&p, vf, from[r0], to[r0], C, 1, &a);
    }
    for (long r = 0; r < R; r++) {
        char *dst = out + ((h * group + r % group) * o_sh + (row0 + i0 + r / group) * o_st) * esize;
        for (long d = 0; d < dim; d++) {
            float x = acc[r][d] * inv[r];
            if (bf16) ((uint16_t *)dst)[d] = to_bf16(x);
            else ((float *)dst)[d] = x;
        }
    }
}
#endif

/* Returns 0, or -1 when the kernel declines (neither AVX-512 nor AVX2 with FMA, a head size it does not take, no
 * memory): the caller then takes the torch path. Per chunk b: its first query's row `rows[b]`, its `count[b]`
 * queries from position pos[b], its block table, and its first key's position key_start[b] (0 but in a
 * sliding-window pool). */
int paged_prefill(const void *q, long q_sh, long q_st, const int64_t *rows, const int64_t *count, const int64_t *pos,
                  const void *k_cache, const void *v_cache, long num_blocks, long block_size, const int64_t *tables,
                  long table_width, const int64_t *key_start, long window, void *out, long o_sh, long o_st,
                  long batch, long kv_heads, long group, long dim, float scale, int bf16, int threads) {
#if defined(CB_VECTOR)
    if (dim % 16 || dim > MAX_DIM || group > TILE_ROWS) return -1;
    const long per = TILE_ROWS / group;  /* queries a work item takes */
    /* per chunk b: work items before it, its first visible key, its widened keys' row width and where they start */
    long *first = malloc(sizeof(long) * (size_t)(4 * batch + 1));
    if (!first) return -1;
    long *lo = first + batch + 1, *width = lo + batch, *offset = width + batch, total = 0, most = 16;
    first[0] = 0;
    for (long b = 0; b < batch; b++) {
        first[b + 1] = first[b] + kv_heads * ((count[b] + per - 1) / per);
        lo[b] = window > 0 && pos[b] - window + 1 > key_start[b] ? pos[b] - window + 1 : key_start[b];
        width[b] = ((pos[b] + count[b] - lo[b] + 15) & ~15L) + 16;
        offset[b] = total;  /* floats before chunk b's kv head 0 in the widened keys (as many in the values) */
        total += kv_heads * width[b] * dim;
        most = width[b] > most ? width[b] : most;
    }
    float *kt = malloc(sizeof(float) * (size_t)total), *vf = malloc(sizeof(float) * (size_t)total);
    int failed = !kt || !vf;
#pragma omp parallel num_threads(threads) if (!failed)
    {
        Buffers buf = {malloc(sizeof(float) * TILE_ROWS * dim), malloc(sizeof(float) * TILE_ROWS * most)};
        int ok = !failed && buf.qf && buf.s;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < batch * kv_heads; w++) {
            long b = w / kv_heads, h = w % kv_heads;
            long at = offset[b] + h * width[b] * dim;
            if (kt && vf)
                widen((const char *)k_cache, (const char *)v_cache, num_blocks, block_size, tables + b * table_width,
                      h, key_start[b], lo[b], pos[b] + count[b] - lo[b], width[b], dim, bf16, kt + at, vf + at);
        }
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < first[batch]; w++) {
            if (!ok) continue;
            long b = 0;
            while (first[b + 1] <= w) b++;
            long k = w - first[b], tiles = (count[b] + per - 1) / per, h = k / tiles, t = k % tiles;
            long i0 = t * per, nq = count[b] - i0 < per ? count[b] - i0 : per;
            long at = offset[b] + h * width[b] * dim;
            tile((const char *)q, q_sh, q_st, rows[b], pos[b], i0, nq, h, group, dim, kt + at, vf + at, lo[b],
                 width[b], window, (char *)out, o_sh, o_st, scale, bf16, &buf);
        }
        free(buf.qf);
        free(buf.s);
    }
    free(kt);
    free(vf);
    free(first);
    return failed ? -1 : 0;
#else
    (void)q; (void)q_sh; (void)q_st; (void)rows; (void)count; (void)pos; (void)k_cache; (void)v_cache;
    (void)num_blocks; (void)block_size; (void)tables; (void)table_width; (void)key_start; (void)window; (void)out;
    (void)o_sh; (void)o_st; (void)batch; (void)kv_heads; (void)group; (void)dim; (void)scale; (void)bf16;
    (void)threads;
    return -1;
#endif
}
