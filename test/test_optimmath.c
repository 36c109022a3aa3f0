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
void test_optim_team_tune(void);

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

// The thread count of the optimizer steps (mn_team_tune), on made-up step times: the median of the
// kept times against a sort of them; the count with the lower median taken, the team every 16th
// step while one thread is the faster, one thread every 256th while the team is; one slow step
// (either count) not flipping the choice; the team taken again once its times drop below one
// thread's, and left once they rise above; a new team size timed afresh; one thread when the
// work gives no team.
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
// Steps with the team taking `team_sec` and one thread `one_sec`, the count picked noted each
// time; the number of steps that took the team.
static int tune_steps(mn_team_tune *t, int steps, double team_sec, double one_sec) {
    int s, took = 0;
    for (s = 0; s < steps; s++) {
        int k = mn__tune_pick(t, 2);
        took += k == 2;
        mn__tune_note(t, k, k == 2 ? team_sec : one_sec);
    }
    return took;
}
void test_optim_team_tune(void) {
    mn_team_tune t;
    double v[MN_TEAM_TUNE_KEEP], w[MN_TEAM_TUNE_KEEP];
    int i, r, k, took;
    for (r = 0; r < 1000; r++) {  // the median of 1..KEEP kept times (zeros are empty places)
        k = 1 + (int)(mnt_rand_u64() % MN_TEAM_TUNE_KEEP);
        for (i = 0; i < MN_TEAM_TUNE_KEEP; i++) v[i] = 0.0;
        for (i = 0; i < k; i++) {
            size_t at;
            do at = (size_t)(mnt_rand_u64() % MN_TEAM_TUNE_KEEP); while (v[at] > 0.0);
            v[at] = w[i] = 1e-3 * (double)(1 + mnt_rand_u64() % 50);
        }
        qsort(w, (size_t)k, sizeof w[0], cmp_double);
        CHECK_MSG(mn__tune_median(v) == w[(k - 1) / 2], "median of %d times", k);
    }
    memset(&t, 0, sizeof t);
    CHECK(mn__tune_median(t.sec[0]) == 0.0);
    CHECK_EQ_INT(mn__tune_pick(&t, 1), 1);  // no team by size: one thread, nothing to decide
    CHECK_EQ_INT(mn__tune_pick(&t, 2), 2);  // nothing timed: the team first
    mn__tune_note(&t, 2, 0.010);
    CHECK_EQ_INT(mn__tune_pick(&t, 2), 1);  // then one thread
    mn__tune_note(&t, 1, 0.004);
    took = tune_steps(&t, 64, 0.010, 0.004);  // team slower: one thread, the team every 16th
    CHECK_EQ_INT(took, 64 / 16);
    mn__tune_note(&t, 2, 1e-6);  // one fast team step among slow ones does not flip
    mn__tune_note(&t, 1, 1.0);   // nor one very slow step of one thread
    CHECK_EQ_INT(tune_steps(&t, 15, 0.010, 0.004), 0);
    took = tune_steps(&t, 16 * MN_TEAM_TUNE_KEEP, 0.002, 0.004);  // the team became faster
    CHECK_MSG(took >= 16 * MN_TEAM_TUNE_KEEP - 3 * 16 - MN_TEAM_TUNE_KEEP,
              "team taken %d of %d steps after it became faster", took, 16 * MN_TEAM_TUNE_KEEP);
    took = tune_steps(&t, 512, 0.002, 0.004);  // and kept: one thread every 256th step
    CHECK_EQ_INT(took, 512 - 512 / 256);
    took = tune_steps(&t, 16, 0.008, 0.004);  // the team slowed down: left after three steps
    CHECK_EQ_INT(took, 3);
    CHECK_EQ_INT(mn__tune_pick(&t, 4), 4);  // a new team size: timed afresh
    CHECK_EQ_INT(t.team, 4);
    CHECK(mn__tune_median(t.sec[1]) == 0.0);
    CHECK(mn__tune_median(t.sec[0]) == 0.004);
}
