/* exp(x) for x <= 0 in plain arithmetic and in vec.h's lanes (AVX-512 or AVX2), shared by the CPU kernels
 * (paged_decode.c, paged_prefill.c, greedy.c). */
#ifndef CB_EXP_H
#define CB_EXP_H
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "vec.h"

/* exp(x) for x <= 0 to float32 precision (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r), written as
 * plain arithmetic so that the compiler vectorises the loops that call it; libm's expf would not be. */
static inline float exp_neg(float x) {
    x = x >= -87.0f ? x : -87.0f;  /* NaN too, as the lanes' max_ps makes it: an impossible token, never a NaN sum */
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

#if defined(CB_VECTOR)
/* exp_neg on VW lanes, the same polynomial. */
static inline vec v_exp(vec x) {
    x = v_max(x, v_set1(-87.0f));
    vec n = v_floor(v_fma(x, v_set1(1.44269504088896341f), v_set1(0.5f)));
    vec r = v_fnma(n, v_set1(0.693359375f), x);
    r = v_fma(n, v_set1(2.12194440e-4f), r);
    vec p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    p = v_fma(v_mul(p, r), r, v_add(r, v_set1(1.0f)));
    return v_mul(p, v_pow2(n));
}
#endif
#endif
