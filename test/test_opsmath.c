// Tests of the ops' inline math (>>ops implementation: mn__expf and the loops built on it)
// against double-precision libm, over the whole float range the ops feed it, and of the ops'
// edge inputs that go through it: masked (-inf) scores, huge logits, subnormal probabilities,
// NaN. This file builds its own static copy of the implementation (MEMANAT_STATIC), so the
// private helpers can be called directly; its cases run in the ops suite (test/test_ops.c).
#define MEMANAT_STATIC
#include "harness.h"
#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void test_ops_expf_range(void);
void test_ops_exp_edge_inputs(void);
void test_ops_exp_vector_lanes(void);
void test_ops_row_pass(void);
int test_ops_streams(void);

// A NaN with a payload that no computation here makes (marks floats that must stay unwritten).
static float nt_poison_f(void) {
    uint32_t u = 0x7fc0dead;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// The spacing of floats at |w| (subnormal spacing 2^-149 below FLT_MIN); 2^104 past FLT_MAX,
// where a float result can only be inf.
static double ulp_at(double w) {
    int e;
    w = fabs(w);
    if (w < FLT_MIN) return ldexp(1.0, -149);
    if (w > FLT_MAX) return ldexp(1.0, 104);
    frexp(w, &e);
    return ldexp(1.0, e - 24);
}

// |got - want| in units of the float spacing at want; inf against an overflowing want is 0.
static double ulp_err(float got, double want) {
    if (isinf(got) && got > 0 && want > FLT_MAX) return 0.0;
    if (isinf(got) || isnan(got)) return 1e30;
    return fabs((double)got - want) / ulp_at(want);
}

// One chunk of arguments through the loop that softmax uses (mn__exp_store_sum, vectorized where
// the compiler does) and through the scalar helper: the same bits, within the bounds of
// test_ops_expf_range.
static void exp_chunk(const float *xs, float *ys, size_t k, double *worst, double *worst_sub,
                      int *fails) {
    size_t i;
    mn__exp_store_sum(ys, xs, 1.0f, 0.0f, k, NULL);
    for (i = 0; i < k; i++) {
        double want = exp((double)xs[i]), e = ulp_err(ys[i], want);
        float one = mn__expf(xs[i]);
        int sub = want < FLT_MIN;
        if (memcmp(&one, &ys[i], sizeof one) != 0 && (*fails)++ < 4)
            mnt_fail(__FILE__, __LINE__, "exp(%.9g): loop %.9g, scalar %.9g", xs[i], ys[i], one);
        if (sub && e > *worst_sub) *worst_sub = e;
        if (!sub && e > *worst) *worst = e;
        if ((sub ? e > 1.0 : e > 1.5) && (*fails)++ < 4)
            mnt_fail(__FILE__, __LINE__, "exp(%.9g) = %.9g, want %.17g (%.3g ulp)", xs[i], ys[i],
                     want, e);
    }
}

// exp over every 4099th float bit pattern of [-104, 89] (about 540k arguments, both signs, every
// binade, the subnormal and the overflowing ends), then a chunk of fresh random arguments.
// Bounds: 1.5 ulp for normal results (measured: 1.01 with FMA, 0.98 without), 1 unit of 2^-149
// for subnormal ones, inf exactly where exp(x) > FLT_MAX (and within 1.5 ulp of it).
void test_ops_expf_range(void) {
    enum { CHUNK = 4096 };
    float *xs = mnt_fvec(CHUNK), *ys = mnt_fvec(CHUNK);
    double worst = 0.0, worst_sub = 0.0;
    uint64_t b;
    size_t k = 0, i;
    int fails = 0;
    for (b = 0; b < 0xFF800000u; b += 4099) {
        uint32_t u = (uint32_t)b;
        float x;
        memcpy(&x, &u, sizeof x);
        if (!(x > -104.0f && x < 89.0f)) continue;
        xs[k++] = x;
        if (k == CHUNK) exp_chunk(xs, ys, k, &worst, &worst_sub, &fails), k = 0;
    }
    if (k > 0) exp_chunk(xs, ys, k, &worst, &worst_sub, &fails);
    for (i = 0; i < CHUNK; i++) xs[i] = (float)(-104.0 + 193.0 * mnt_rand_uniform());
    exp_chunk(xs, ys, CHUNK, &worst, &worst_sub, &fails);
    // the ends and the special values
    {
        static const float sp[] = {-0.0f, 0.0f, -104.0f, -103.97f, -87.33f, -87.34f, -100.0f,
                                   -149.0f * 0.6931472f, 88.72f, 88.73f, 89.0f, 1000.0f, -1000.0f};
        for (i = 0; i < sizeof sp / sizeof sp[0]; i++) {
            float g = mn__expf(sp[i]);
            double e = ulp_err(g, exp((double)sp[i]));
            CHECK_MSG(e <= 1.5, "exp(%.9g) = %.9g, want %.9g", sp[i], g, exp((double)sp[i]));
        }
        CHECK(mn__expf(-0.0f) == 1.0f && mn__expf(0.0f) == 1.0f);
        CHECK(mn__expf(-INFINITY) == 0.0f);
        CHECK(isinf(mn__expf(INFINITY)) && mn__expf(INFINITY) > 0);
        CHECK(isnan(mn__expf(NAN)));
        CHECK(mn__expf(-1000.0f) == 0.0f);
        CHECK(mn__expf(-100.0f) > 0.0f && mn__expf(-100.0f) < FLT_MIN);  // subnormal, not flushed
    }
    if (mnt_verbose())
        printf("  %-34s max err %.3g ulp (normal results), %.3g x 2^-149 (subnormal)\n",
               "expf sweep", worst, worst_sub);
    free(xs), free(ys);
}

// The ops where exp meets edge inputs, against double: softmax rows with -inf masks (their
// probabilities exactly 0), huge logits (max subtraction keeps them finite), probabilities below
// FLT_MIN (subnormal, not flushed), NaN (the row becomes NaN, as torch.softmax's does); causal
// masking; cross-entropy of huge logits; GELU at arguments where exp underflows and overflows.
void test_ops_exp_edge_inputs(void) {
    enum { L = 37 };
    float x[4 * L], y[4 * L], loss[2], probs[2 * L];
    int tgt[2] = {3, 30}, r, j, rep;
    for (j = 0; j < 4 * L; j++) x[j] = (float)(4.0 * mnt_rand_normal());
    for (j = 0; j < L; j += 3) x[j] = -INFINITY;             // row 0: masked entries
    x[L + 5] = 3.0e38f, x[L + 6] = -3.0e38f, x[L + 7] = 1.0e30f;  // row 1: huge logits
    x[2 * L] = 0.0f;                                         // row 2: one entry ~e^-100 of another
    for (j = 1; j < L; j++) x[2 * L + j] = (float)(-100.0 - 3.0 * mnt_rand_uniform());
    x[3 * L + 11] = NAN;                                      // row 3: a NaN
    CHECK_OK(mn_softmax_forward(y, x, 4, L, 1.0f, 0));
    for (r = 0; r < 3; r++) {
        double mx = -INFINITY, sum = 0.0;
        for (j = 0; j < L; j++) mx = fmax(mx, (double)x[r * L + j]);
        for (j = 0; j < L; j++) sum += exp((double)x[r * L + j] - mx);
        for (j = 0; j < L; j++) {
            double want = exp((double)x[r * L + j] - mx) / sum, got = y[r * L + j];
            if (isinf(x[r * L + j]) && x[r * L + j] < 0) {
                CHECK_MSG(got == 0.0, "softmax row %d: masked [%d] = %g, want 0", r, j, got);
                continue;
            }
            // normal probabilities: a few ulp plus the rounding of the float argument x - max
            // (|x - max| ulp, as in ops/activation_grid); subnormal ones: 2 units of 2^-149
            CHECK_MSG(fabs(got - want) <=
                          (want < FLT_MIN ? 2.0 * ldexp(1.0, -149)
                                          : (4.0 + fabs(x[r * L + j] - mx)) * ulp_at(want)),
                      "softmax row %d [%d] = %.9g, want %.17g", r, j, got, want);
        }
    }
    CHECK(y[2 * L + 1] > 0.0f && y[2 * L + 1] < FLT_MIN);
    for (j = 0; j < L; j++) CHECK_MSG(isnan(y[3 * L + j]), "NaN row [%d] = %g", j, y[3 * L + j]);
    // causal: row t of a block sees columns 0..t; the rest are exactly 0
    for (rep = 0; rep < 3; rep++) {
        float blk[3 * 3], out[3 * 3];
        for (j = 0; j < 9; j++) blk[j] = (float)(30.0 * mnt_rand_normal());
        CHECK_OK(mn_softmax_forward(out, blk, 3, 3, 2.0f, 1));
        for (r = 0; r < 3; r++) {
            double mx = -INFINITY, sum = 0.0;
            for (j = 0; j <= r; j++) mx = fmax(mx, 2.0 * blk[r * 3 + j]);
            for (j = 0; j <= r; j++) sum += exp(2.0 * blk[r * 3 + j] - mx);
            for (j = 0; j < 3; j++) {
                double want = j <= r ? exp(2.0 * blk[r * 3 + j] - mx) / sum : 0.0;
                double z = j <= r ? fabs(2.0 * blk[r * 3 + j] - mx) : 0.0;
                CHECK_MSG(fabs(out[r * 3 + j] - want) <=
                              (4.0 + z) * ulp_at(want) + 2.0 * ldexp(1.0, -149),
                          "causal softmax [%d][%d] = %.9g, want %.17g", r, j, out[r * 3 + j], want);
            }
        }
    }
    // cross-entropy with huge logits stays finite and right
    CHECK_OK(mn_crossentropy_forward(loss, probs, x + L, tgt, 2, L));
    for (r = 0; r < 2; r++) {
        const float *row = x + L + r * L;
        double mx = -INFINITY, sum = 0.0, want;
        for (j = 0; j < L; j++) mx = fmax(mx, (double)row[j]);
        for (j = 0; j < L; j++) sum += exp((double)row[j] - mx);
        want = log(sum) - ((double)row[tgt[r]] - mx);
        CHECK_MSG(isfinite(loss[r]) && fabs(loss[r] - want) <= 1e-6 * fmax(1.0, fabs(want)),
                  "crossentropy row %d: %.9g, want %.17g", r, loss[r], want);
    }
    // GELU where exp(-2|u|) underflows (|x| large) and at the extremes (where x^2 overflows:
    // the derivative is 0 or 1 there, not NaN)
    {
        static const float gx[] = {-1e30f, -40.0f, -12.0f, -9.5f, 9.5f, 40.0f, 1e30f, -1e15f};
        float gy[8], gd[8], one[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        memset(gd, 0, sizeof gd);
        CHECK_OK(mn_gelu_forward(gy, gx, 8));
        CHECK_OK(mn_gelu_backward(gd, one, gx, 8));
        for (j = 0; j < 8; j++) {
            double v = gx[j], u = 0.7978845608028654 * (v + 0.044715 * v * v * v);
            double s = u >= 0 ? 1.0 / (1.0 + exp(-2.0 * u)) : exp(2.0 * u) / (1.0 + exp(2.0 * u));
            double want = v * s;
            // as ops/activation_grid: 8 ulp times (1 + |2u|), the conditioning of exp(-2|u|)
            CHECK_MSG(isfinite(gy[j]) &&
                          fabs(gy[j] - want) <= 8.0 * (1.0 + fabs(2.0 * u)) * ulp_at(want) + 1e-38,
                      "gelu(%g) = %.9g, want %.17g", v, gy[j], want);
            CHECK_MSG(isfinite(gd[j]), "gelu'(%g) = %g", v, gd[j]);
            if (fabs(v) >= 40.0)
                CHECK_MSG(gd[j] == (v > 0 ? 1.0f : 0.0f), "gelu'(%g) = %g", v, gd[j]);
        }
        gy[0] = NAN, gd[0] = 0.0f;
        CHECK_OK(mn_gelu_forward(gy + 1, gy, 1));
        CHECK_OK(mn_gelu_backward(gd, one, gy, 1));
        CHECK(isnan(gy[1]) && isnan(gd[0]));
    }
}

// An argument for the lane tests: mostly the ops' usual range, else one of the tails that the
// vector exp hands to the scalar form (subnormal results, overflow, +-inf, NaN) or a value at the
// edge of its fast range.
static float lane_arg(void) {
    static const float edge[] = {-86.5f, -86.49f, 88.0f, 87.99f, -87.34f, 88.73f};
    double u = mnt_rand_uniform();
    if (u < 0.80) return (float)(-20.0 + 22.0 * mnt_rand_uniform());
    if (u < 0.88) return (float)(-104.0 + 17.5 * mnt_rand_uniform());
    if (u < 0.92) return (float)(88.0 + 2.0 * mnt_rand_uniform());
    if (u < 0.94) return -INFINITY;
    if (u < 0.95) return INFINITY;
    if (u < 0.96) return NAN;
    return edge[mnt_rand_u64() % (sizeof edge / sizeof edge[0])];
}

// The vector loops of exp (mn__exp_store_sum, mn__sumexp) and of GELU (mn_gelu_forward) give the
// bits of the plain C form, element by element and sum by sum, on rows whose vectors mix lanes of
// the fast range with lanes of the tails, at lengths and offsets that are not multiples of the
// vector width. The plain form here: mn__expf / mn__gelu per element, the sums in MN__LN float
// lanes folded in double, as the header states them.
void test_ops_exp_vector_lanes(void) {
    enum { CAP = 1000 };
    float *x = mnt_fvec(CAP + 1), *y = mnt_fvec(CAP + 1), *g = mnt_fvec(CAP + 1);
    int trial, bad = 0;
    for (trial = 0; trial < 300; trial++) {
        size_t n = 1 + (size_t)(mnt_rand_u64() % CAP), off = (size_t)(mnt_rand_u64() % 2), i;
        float m = trial % 3 == 0 ? 0.0f : (float)(4.0 * mnt_rand_normal());
        float acc[MN__LN] = {0};
        double want = 0.0, got, got2;
        size_t full = n - n % MN__LN;
        for (i = 0; i < n; i++) x[off + i] = trial % 4 == 0 ? (float)(-3.0 * mnt_rand_uniform())
                                                         : lane_arg();
        got = mn__exp_store_sum(y + off, x + off, 1.0f, m, n, trial % 2 ? x : NULL);
        got2 = mn__sumexp(x + off, m, n);
        for (i = 0; i < n; i++) {
            float e = mn__expf(x[off + i] - m);
            if (memcmp(&e, &y[off + i], sizeof e) != 0 && bad++ < 4)
                mnt_fail(__FILE__, __LINE__, "exp(%.9g - %.9g): loop %.9g, scalar %.9g",
                         x[off + i], m, y[off + i], e);
            if (i < full) acc[i % MN__LN] += e;
            else want += e;
        }
        for (i = 0; i < MN__LN; i++) want += acc[i];
        CHECK_MSG(memcmp(&got, &want, sizeof got) == 0 || (isnan(got) && isnan(want)),
                  "exp_store_sum n=%zu: %.17g, want %.17g", n, got, want);
        CHECK_MSG(memcmp(&got2, &want, sizeof got) == 0 || (isnan(got2) && isnan(want)),
                  "sumexp n=%zu: %.17g, want %.17g", n, got2, want);
        // GELU: -2|u| leaves the fast range for |x| above about 9.5, and NaN / inf inputs
        for (i = 0; i < n; i++) x[off + i] = lane_arg() * 0.2f;
        CHECK_OK(mn_gelu_forward(g + off, x + off, n));
        for (i = 0; i < n; i++) {
            float e = mn__gelu(x[off + i]);
            if (memcmp(&e, &g[off + i], sizeof e) != 0 && !(isnan(e) && isnan(g[off + i])) &&
                bad++ < 4)
                mnt_fail(__FILE__, __LINE__, "gelu(%.9g): loop %.9g, scalar %.9g", x[off + i],
                         g[off + i], e);
        }
    }
    CHECK(bad == 0);
    free(x), free(y), free(g);
}

// The vector forms of the row reductions (mn__max_scaled, mn__sumsq_centered) and of the GELU
// derivative (mn_gelu_backward, in stages over chunks) give the bits of the plain C form: the
// same MN__LN lanes written out here, mn__gelu_grad per element, on lengths and offsets that are
// not multiples of the vector width or of the chunk.
void test_ops_reduce_vector_lanes(void) {
    enum { CAP = 1300 };
    float *x = mnt_fvec(CAP + 1), *g = mnt_fvec(CAP + 1), *dy = mnt_fvec(CAP + 1);
    float *want = mnt_fvec(CAP + 1);
    int trial, bad = 0;
    for (trial = 0; trial < 300; trial++) {
        size_t n = 1 + (size_t)(mnt_rand_u64() % CAP), off = (size_t)(mnt_rand_u64() % 2), i;
        size_t full = n - n % MN__LN;
        float scale = trial % 3 == 0 ? 1.0f : (float)mnt_rand_normal();
        float m = (float)mnt_rand_normal();
        float acc[MN__LN], mx = -INFINITY, got, fss;
        double ss = 0.0;
        for (i = 0; i < n; i++) x[off + i] = trial % 5 == 0 ? lane_arg() : (float)mnt_rand_normal();
        for (i = 0; i < MN__LN; i++) acc[i] = -INFINITY;
        for (i = 0; i < full; i++) {
            float v = scale * x[off + i];
            acc[i % MN__LN] = v > acc[i % MN__LN] ? v : acc[i % MN__LN];
        }
        for (; i < n; i++) mx = scale * x[off + i] > mx ? scale * x[off + i] : mx;
        for (i = 0; i < MN__LN; i++) mx = acc[i] > mx ? acc[i] : mx;
        got = mn__max_scaled(x + off, scale, n);
        CHECK_MSG(memcmp(&got, &mx, sizeof got) == 0, "max_scaled n=%zu: %.9g, want %.9g", n,
                  got, mx);
        for (i = 0; i < MN__LN; i++) acc[i] = 0.0f;
        for (i = 0; i < full; i++) {
            float d = x[off + i] - m;
            acc[i % MN__LN] = MN__FMA(d, d, acc[i % MN__LN]);
        }
        for (; i < n; i++) ss += (double)(x[off + i] - m) * (x[off + i] - m);
        for (i = 0; i < MN__LN; i++) ss += acc[i];
        got = mn__sumsq_centered(x + off, m, n), fss = (float)ss;
        CHECK_MSG(memcmp(&got, &fss, sizeof got) == 0 || (isnan(got) && isnan(fss)),
                  "sumsq_centered n=%zu: %.9g, want %.9g", n, got, fss);
        for (i = 0; i < n; i++) x[off + i] = lane_arg() * 0.2f;
        mnt_fill_normal(dy, CAP + 1, 1.0);
        mnt_fill_normal(g, CAP + 1, 1.0);
        for (i = 0; i < n; i++) want[i] = g[off + i] + dy[off + i] * mn__gelu_grad(x[off + i]);
        CHECK_OK(mn_gelu_backward(g + off, dy + off, x + off, n));
        for (i = 0; i < n; i++)
            if (memcmp(&want[i], &g[off + i], sizeof want[i]) != 0 &&
                !(isnan(want[i]) && isnan(g[off + i])) && bad++ < 4)
                mnt_fail(__FILE__, __LINE__, "gelu backward at x = %.9g: %.9g, want %.9g",
                         x[off + i], g[off + i], want[i]);
    }
    CHECK(bad == 0);
    free(x), free(g), free(dy), free(want);
}

// Whether this build streams large outputs (vector lanes with streaming stores).
int test_ops_streams(void) { return MN__NT; }

// mn__nt_row_pass against the passes it joins (mn__exp_store_sum, mn__nt_copy, mn__max_scaled),
// bit for bit, for rows shorter and longer than its steps, each of its three parts present or
// absent, fresh offsets of y and of the next row's output (every placement that
// mn__nt_row_at gives), and the stored row and the exponentials in one buffer as the row
// loops keep them (the stores must read the old row before the new one overwrites it).
void test_ops_row_pass(void) {
    enum { CAP = 5200 };
    float *x = mnt_fvec(CAP + 16), *xn = mnt_fvec(CAP + 2100), *src = mnt_fvec(CAP);
    float *y = mnt_fvec(CAP + 17), *buf = mnt_fvec(CAP + 16), *e0 = mnt_fvec(CAP);
    float *ywant = mnt_fvec(CAP);
    int trial;
    for (trial = 0; trial < 400; trial++) {
        static const size_t sizes[] = {1, 15, 16, 17, 63, 64, 65, 79, 80, 81, 128, 1000, 4099};
        size_t n = trial % 3 ? 1 + mnt_rand_u64() % CAP : sizes[trial / 3 % 13], i;
        size_t oy = mnt_rand_u64() % 16, on = mnt_rand_u64() % 16, ox = mnt_rand_u64() % 16;
        size_t pf = n + mnt_rand_u64() % 2100;
        int parts = 1 + trial % 7;  // bits: exponentials, stores, max
        float scale = trial % 2 ? 1.0f : (float)(0.5 + mnt_rand_uniform()), c, mx, mgot = 0.0f;
        float *yo = y + oy, *xo = x + ox, *s = NULL, *e = e0;
        double want = 0.0, got;
        for (i = 0; i < n; i++)
            xo[i] = trial % 5 == 0 ? lane_arg() : (float)(4 * mnt_rand_normal());
        for (i = 0; i < pf; i++) xn[i] = (float)(4 * mnt_rand_normal());
        for (i = 0; i < n; i++) src[i] = (float)mnt_rand_uniform();
        for (i = 0; i <= n; i++) yo[i] = nt_poison_f();
        c = (float)mnt_rand_uniform(), mx = (float)mnt_rand_normal();
        if (parts & 1) want = mn__exp_store_sum(ywant, xo, scale, mx, n, NULL);
        if (parts & 2) {  // the row before in the shared buffer, at its place for yo
            s = mn__nt_row_at(buf, yo, n);
            memcpy(s, src, n * sizeof(float));
            e = mn__nt_row_at(buf, y + on, n);
        }
        got = mn__nt_row_pass(parts & 1 ? e : NULL, parts & 1 ? xo : NULL, scale, mx,
                              parts & 2 ? yo : NULL, s, c, parts & 4 ? xn : NULL, pf, &mgot, n);
        mn__nt_fence();
        CHECK_MSG(memcmp(&got, &want, sizeof got) == 0 || (isnan(got) && isnan(want)),
                  "row pass n=%zu parts %d: sum %.17g, want %.17g", n, parts, got, want);
        if (parts & 1)
            CHECK_MSG(memcmp(e, ywant, n * sizeof(float)) == 0,
                      "row pass n=%zu parts %d: exponentials differ", n, parts);
        if (parts & 2) {
            for (i = 0; i < n; i++) ywant[i] = src[i] * c;
            CHECK_MSG(memcmp(yo, ywant, n * sizeof(float)) == 0,
                      "row pass n=%zu parts %d oy %zu on %zu: stores differ", n, parts, oy, on);
        }
        CHECK_MSG(memcmp(&yo[n], &(float){nt_poison_f()}, sizeof(float)) == 0,
                  "row pass n=%zu: the float after the row was written", n);
        if (parts & 4) {
            float m = mn__max_scaled(xn, scale, n);
            CHECK_MSG(memcmp(&mgot, &m, sizeof m) == 0, "row pass n=%zu: max %.9g, want %.9g", n,
                      mgot, m);
        }
    }
    free(x), free(xn), free(src), free(y), free(buf), free(e0), free(ywant);
}
