// Tests of the optimizer steps' private arithmetic (>>optim implementation) that the bit-for-bit
// tests of the steps reach only on a few values: AdamW's division by sqrt(1 - beta2^t) through the
// divisor's double reciprocal (mn__ov_divc) against the division itself. This file builds its own
// static copy of the implementation (MEMANAT_STATIC), as test_opsmath.c does; its case runs in
// the optim suite (test/test_optim.c).
#define MEMANAT_STATIC
#include "harness.h"
#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"

#include <float.h>
#include <math.h>
#include <string.h>

void test_optim_divc_bits(void);

#ifdef MN__OVD
static float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

// Divisors: AdamW's own at random steps and betas, then any normal positive float. Dividends:
// random bit patterns (both signs, zeros, subnormals, inf, NaN). Compared wherever the quotient is
// 0, inf, NaN or of normal size (the function's stated domain), which covers every AdamW quotient.
void test_optim_divc_bits(void) {
#ifdef MN__OVD
    uint64_t bad = 0, checked = 0;
    int q;
    for (q = 0; q < 128; q++) {
        float c;
        double rc;
        uint32_t k;
        if (q < 64) {
            float b2 = q % 2 ? 0.999f : (float)(1.0 - pow(10.0, -1.0 - 6.0 * mnt_rand_uniform()));
            double t = (double)(1 + mnt_rand_u64() % 1000000);
            c = (float)sqrt(1.0 - pow((double)b2, t));
        } else {
            c = bits_float(0x00800000u + (uint32_t)(mnt_rand_u64() % (0x7f800000u - 0x00800000u)));
        }
        rc = 1.0 / (double)c;
        for (k = 0; k < 32768; k += MN__OW) {
            mn__ovf x, y;
            int l;
            for (l = 0; l < MN__OW; l++) x[l] = bits_float((uint32_t)mnt_rand_u64());
            if (q < 64)
                for (l = 0; l < MN__OW; l++) x[l] = sqrtf(fabsf(x[l]));  // AdamW divides sqrt(v)
            y = mn__ov_divc(x, rc);
            for (l = 0; l < MN__OW; l++) {
                float want = x[l] / c, got = y[l];
                if (want == want && want != 0.0f && fabsf(want) < FLT_MIN) continue;
                checked++;
                bad += !(want != want ? got != got : memcmp(&want, &got, sizeof want) == 0);
            }
        }
    }
    CHECK_MSG(bad == 0 && checked > 3000000, "%llu of %llu quotients differ from x / c",
              (unsigned long long)bad, (unsigned long long)checked);
#else
    SKIP("no double-vector conversion in this build (MEMANAT_NO_SIMD or no vector lanes)");
#endif
}
