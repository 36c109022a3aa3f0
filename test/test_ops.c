// Tests of the >>ops section: every forward against a plain double-precision loop written here,
// every backward against central finite differences of L = sum(out * w) taken through that double
// forward, on fresh random inputs of several shapes (odd sizes included). Set MN_TEST_VERBOSE=1
// (or MN_OPS_VERBOSE=1) to print the error of every comparison. Tolerances are relative to the
// scale of each compared array: |got - want| <= tol * max(1, max |want|) (CHECK_CLOSE_SCALED).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "../memanat.h"
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif

// ---- helpers -------------------------------------------------------------------------------------

// Bitwise equality of two float arrays.
#define EXPECT_SAME(what, a, b, n) expect_same(__FILE__, __LINE__, what, a, b, n)
static void expect_same(const char *file, int line, const char *what, const float *a,
                        const float *b, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            mnt_fail(file, line, "%s: differ at [%zu]: %.9g vs %.9g", what, i, a[i], b[i]);
            return;
        }
    }
}

// A double-precision reference forward: y = f(x) with every differentiable input concatenated in
// x; the rest of the op's arguments in ctx.
typedef void (*ref_fn)(const void *ctx, const double *x, double *y);

// grad[i] = dL/dx[i] for L = sum_j w[j] y[j], central differences in double.
static void fd_grad(ref_fn f, const void *ctx, const float *x0, size_t nx, const float *w,
                    size_t ny, double *grad) {
    double *x = mnt_dvec(nx), *y = mnt_dvec(ny);
    size_t i, j;
    mnt_to_double(x0, x, nx);
    for (i = 0; i < nx; i++) {
        double h = 1e-5 * (1.0 + fabs(x[i])), xp = x[i] + h, xm = x[i] - h, lp = 0.0, lm = 0.0;
        x[i] = xp;
        f(ctx, x, y);
        for (j = 0; j < ny; j++) lp += (double)w[j] * y[j];
        x[i] = xm;
        f(ctx, x, y);
        for (j = 0; j < ny; j++) lm += (double)w[j] * y[j];
        x[i] = x0[i];
        grad[i] = (lp - lm) / (xp - xm);
    }
    free(x);
    free(y);
}

// Forward of the fp32 op (out, ny values) against the reference at x (nx values).
static void check_forward(const char *what, ref_fn f, const void *ctx, const float *x, size_t nx,
                          const float *out, size_t ny, double tol) {
    double *xd = mnt_dvec(nx), *y = mnt_dvec(ny);
    mnt_to_double(x, xd, nx);
    f(ctx, xd, y);
    CHECK_CLOSE_SCALED(what, out, y, ny, tol);
    free(xd);
    free(y);
}

// Gradient check: g1 - g0 (what the backward added) against finite differences, per input segment.
typedef struct seg {
    const char *name;
    size_t off, n;
} seg;

static void check_grad(const char *what, ref_fn f, const void *ctx, const float *x, size_t nx,
                       const float *w, size_t ny, const float *g0, const float *g1,
                       const seg *segs, int nseg, double tol) {
    double *fd = mnt_dvec(nx);
    float *added = mnt_fvec(nx);
    char name[128];
    size_t i;
    int s;
    fd_grad(f, ctx, x, nx, w, ny, fd);
    for (i = 0; i < nx; i++) added[i] = (float)((double)g1[i] - g0[i]);
    for (s = 0; s < nseg; s++) {
        snprintf(name, sizeof name, "%s d%s", what, segs[s].name);
        CHECK_CLOSE_SCALED(name, added + segs[s].off, fd + segs[s].off, segs[s].n, tol);
    }
    free(fd);
    free(added);
}

// Tolerances (relative to max(1, max |reference|)). fp32 has eps 6e-8; forwards of these sizes
// stay below ~1e-6 and so do the gradients (over many seeds: 8e-7 and 7e-7), so the bounds
// leave a margin of about 5x.
#define TOL_FWD 4e-6
#define TOL_GRAD 5e-6

static double gelu_tanh_d(double x) {
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

// ---- matmul --------------------------------------------------------------------------------------

typedef struct mm_ctx {
    int N, C, OC, bias, gelu;
} mm_ctx;

static void ref_matmul(const void *vctx, const double *x, double *y) {
    const mm_ctx *c = (const mm_ctx *)vctx;
    const double *inp = x, *w = x + (size_t)c->N * c->C, *b = w + (size_t)c->OC * c->C;
    int n, o, i;
    for (n = 0; n < c->N; n++)
        for (o = 0; o < c->OC; o++) {
            double s = c->bias ? b[o] : 0.0;
            for (i = 0; i < c->C; i++) s += inp[(size_t)n * c->C + i] * w[(size_t)o * c->C + i];
            y[(size_t)n * c->OC + o] = c->gelu ? gelu_tanh_d(s) : s;
        }
}

static void run_matmul(int N, int C, int OC, int bias, int gelu, int fd) {
    mm_ctx ctx;
    size_t ni = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
    size_t nx = ni + nw + (size_t)OC;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx), *w = mnt_fvec(ny);
    float *out = mnt_fvec(ny), *pre = gelu ? mnt_fvec(ny) : NULL, *dout = mnt_fvec(ny);
    char what[96];
    seg segs[3];
    ctx.N = N, ctx.C = C, ctx.OC = OC, ctx.bias = bias, ctx.gelu = gelu;
    mnt_fill_normal(x, nx, 1.0);
    if (!bias) memset(x + ni + nw, 0, (size_t)OC * sizeof(float));
    mnt_fill_normal(w, ny, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    snprintf(what, sizeof what, "matmul N=%d C=%d OC=%d bias=%d gelu=%d", N, C, OC, bias, gelu);
    mn_matmul_forward(out, pre, x, x + ni, bias ? x + ni + nw : NULL, N, C, OC);
    check_forward(what, ref_matmul, &ctx, x, nx, out, ny, TOL_FWD);
    if (gelu) {  // the kept pre-activation is the plain matmul
        ctx.gelu = 0;
        check_forward("matmul pre_gelu", ref_matmul, &ctx, x, nx, pre, ny, TOL_FWD);
        ctx.gelu = 1;
    }
    memcpy(dout, w, ny * sizeof(float));
    mn_matmul_backward(g1, g1 + ni, bias ? g1 + ni + nw : NULL, dout, x, x + ni, pre, N, C, OC);
    segs[0].name = "inp", segs[0].off = 0, segs[0].n = ni;
    segs[1].name = "weight", segs[1].off = ni, segs[1].n = nw;
    segs[2].name = "bias", segs[2].off = ni + nw, segs[2].n = (size_t)OC;
    if (fd) {
        check_grad(what, ref_matmul, &ctx, x, nx, w, ny, g0, g1, segs, bias ? 3 : 2, TOL_GRAD);
    } else {
        // larger shapes: the analytic gradient formulas in double instead of finite differences
        double *want = mnt_dvec(nx), *dpre = mnt_dvec(ny);
        float *added = mnt_fvec(nx);
        int n, o, i;
        size_t k;
        mnt_to_double(w, dpre, ny);
        if (gelu) {
            for (k = 0; k < ny; k++) {  // d gelu / d pre through the double reference, centrally
                double p = pre[k], h = 1e-6 * (1.0 + fabs(p));
                dpre[k] *= (gelu_tanh_d(p + h) - gelu_tanh_d(p - h)) / (2 * h);
            }
        }
        for (n = 0; n < N; n++)
            for (o = 0; o < OC; o++) {
                double d = dpre[(size_t)n * OC + o];
                for (i = 0; i < C; i++) {
                    want[(size_t)n * C + i] += d * x[ni + (size_t)o * C + i];
                    want[ni + (size_t)o * C + i] += d * x[(size_t)n * C + i];
                }
                want[ni + nw + o] += d;
            }
        for (k = 0; k < nx; k++) added[k] = (float)((double)g1[k] - g0[k]);
        snprintf(what, sizeof what, "matmul N=%d C=%d OC=%d dinp", N, C, OC);
        CHECK_CLOSE_SCALED(what, added, want, ni, TOL_GRAD);
        snprintf(what, sizeof what, "matmul N=%d C=%d OC=%d dweight", N, C, OC);
        CHECK_CLOSE_SCALED(what, added + ni, want + ni, nw, TOL_GRAD);
        if (bias) {
            snprintf(what, sizeof what, "matmul N=%d C=%d OC=%d dbias", N, C, OC);
            CHECK_CLOSE_SCALED(what, added + ni + nw, want + ni + nw, (size_t)OC, TOL_GRAD);
        }
        free(want), free(dpre), free(added);
    }
    free(x), free(g0), free(g1), free(w), free(out), free(pre), free(dout);
}

static void test_matmul(void) {
    run_matmul(5, 7, 9, 1, 0, 1);
    run_matmul(4, 3, 2, 0, 0, 1);
    run_matmul(1, 1, 1, 1, 0, 1);
    run_matmul(13, 17, 19, 1, 0, 1);
}

static void test_matmul_gelu(void) {
    run_matmul(5, 7, 9, 1, 1, 1);
    run_matmul(6, 11, 4, 0, 1, 1);
}

static void test_matmul_blocked(void) {
    // shapes that cross every block edge: rows past a task, depth past a packed block, columns
    // past a task and not a multiple of the register tile
    run_matmul(101, 300, 150, 1, 0, 0);
    run_matmul(64, 64, 64, 0, 1, 0);
    run_matmul(7, 513, 33, 1, 1, 0);
}

// Sizes that are multiples of no block of the GEMM (register tile rows 4/6/8 and columns 8/16/32,
// the 512-deep packed slice, the 128-column and 256-row tasks), large enough that two threads
// split the rows of every product into tasks: all three products against the double loops, and
// one thread against two bit for bit.
static void test_matmul_odd_shapes(void) {
    enum { N = 531, C = 263, OC = 291 };
    run_matmul(N, C, OC, 1, 0, 0);
    run_matmul(OC, N, C, 0, 1, 0);
#ifdef _OPENMP
    {
        size_t ni = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
        float *x = mnt_fvec(ni + nw), *dy = mnt_fvec(ny), *y[2], *g[2];
        int saved = omp_get_max_threads(), r;
        mnt_fill_normal(x, ni + nw, 1.0);
        mnt_fill_normal(dy, ny, 1.0);
        for (r = 0; r < 2; r++) {
            omp_set_num_threads(r + 1);
            y[r] = mnt_fvec(ny), g[r] = mnt_fvec(ni + nw);
            memset(g[r], 0, (ni + nw) * sizeof(float));
            mn_matmul_forward(y[r], NULL, x, x + ni, NULL, N, C, OC);
            mn_matmul_backward(g[r], g[r] + ni, NULL, dy, x, x + ni, NULL, N, C, OC);
        }
        omp_set_num_threads(saved);
        EXPECT_SAME("odd shapes, one vs two threads: forward", y[0], y[1], ny);
        EXPECT_SAME("odd shapes, one vs two threads: dinp", g[0], g[1], ni);
        EXPECT_SAME("odd shapes, one vs two threads: dweight", g[0] + ni, g[1] + ni, nw);
        free(x), free(dy);
        for (r = 0; r < 2; r++) free(y[r]), free(g[r]);
    }
#endif
}

// ---- matmul with 16-bit inp and weight ----------------------------------------------------------
// mn_matmul_forward_typed / mn_matmul_backward_typed with bf16 and fp16 operands: fresh random
// inputs rounded by the public converters, all three products (forward, and the transposed forms
// of the input and weight gradients) against double loops over the rounded values; the same bits
// as the fp32 calls on the rounded arrays (native kernel builds), and one thread as two.

static void to16(mn_dtype dt, const float *x, uint16_t *h, size_t n) {
    if (dt == MN_BF16) mn_fp32_to_bf16_array(x, h, n);
    else mn_fp32_to_fp16_array(x, h, n);
}
static void from16(mn_dtype dt, const uint16_t *h, float *x, size_t n) {
    if (dt == MN_BF16) mn_bf16_to_fp32_array(h, x, n);
    else mn_fp16_to_fp32_array(h, x, n);
}

// y[n,o] = b[o] + sum_c x[n,c] w[o,c] in double.
static void ref_mm_plain(const float *x, const float *w, const float *b, double *y, int N, int C,
                         int OC) {
    int n, o, i;
    for (n = 0; n < N; n++)
        for (o = 0; o < OC; o++) {
            double acc = b ? b[o] : 0.0;
            for (i = 0; i < C; i++) acc += (double)x[(size_t)n * C + i] * w[(size_t)o * C + i];
            y[(size_t)n * OC + o] = acc;
        }
}

// want[o, c] = start[o, c] + sum_n dy[n, o] x[n, c] in double, n ascending (the weight gradient).
static void ref_dweight(double *want, const float *start, const float *dy, const float *x, int N,
                        int C, int OC) {
    size_t k;
    int n, o, i;
    for (k = 0; k < (size_t)OC * C; k++) want[k] = start[k];
    for (n = 0; n < N; n++)
        for (o = 0; o < OC; o++)
            for (i = 0; i < C; i++)
                want[(size_t)o * C + i] += (double)dy[(size_t)n * OC + o] * x[(size_t)n * C + i];
}

static void run_matmul16(mn_dtype dt, int N, int C, int OC) {
    size_t ni = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC, k;
    float *x = mnt_fvec(ni), *w = mnt_fvec(nw), *b = mnt_fvec((size_t)OC), *xr = mnt_fvec(ni);
    float *wr = mnt_fvec(nw), *dy = mnt_fvec(ny), *y = mnt_fvec(ny), *pre = mnt_fvec(ny);
    float *y32 = mnt_fvec(ny), *pre32 = mnt_fvec(ny), *dx = mnt_fvec(ni), *dw = mnt_fvec(nw);
    float *db = mnt_fvec((size_t)OC), *dx32 = mnt_fvec(ni), *dw32 = mnt_fvec(nw);
    float *db32 = mnt_fvec((size_t)OC), *dy32 = mnt_fvec(ny);
    uint16_t *xh = (uint16_t *)malloc(ni * 2), *wh = (uint16_t *)malloc(nw * 2);
    double *want = mnt_dvec(ny > nw ? (ny > ni ? ny : ni) : (nw > ni ? nw : ni));
    double *unround = mnt_dvec(ny), diff = 0.0, scale = 1.0;
    char what[96];
    int n, o, i;
    CHECK(xh && wh);
    mnt_fill_normal(x, ni, 1.0), mnt_fill_normal(w, nw, 1.0), mnt_fill_normal(b, (size_t)OC, 1.0);
    mnt_fill_normal(dy, ny, 1.0);
    to16(dt, x, xh, ni), to16(dt, w, wh, nw);
    from16(dt, xh, xr, ni), from16(dt, wh, wr, nw);
    // forward with bias and the GELU epilogue: pre_gelu against the double loop over the rounded
    // values; the loop over the unrounded ones must differ (else the rounding went unchecked)
    snprintf(what, sizeof what, "matmul %s N=%d C=%d OC=%d", mn_dtype_name(dt), N, C, OC);
    CHECK_OK(mn_matmul_forward_typed(y, pre, xh, wh, b, N, C, OC, dt));
    ref_mm_plain(xr, wr, b, want, N, C, OC);
    CHECK_CLOSE_SCALED(what, pre, want, ny, TOL_FWD);
    ref_mm_plain(x, w, b, unround, N, C, OC);
    for (k = 0; k < ny; k++) {
        double d = fabs(unround[k] - want[k]);
        diff = d > diff ? d : diff, scale = fabs(want[k]) > scale ? fabs(want[k]) : scale;
    }
    CHECK_MSG(diff > 20 * TOL_FWD * scale, "%s: rounding changed the result by only %g", what,
              diff);
    for (k = 0; k < ny; k++) want[k] = gelu_tanh_d(want[k]);
    CHECK_CLOSE_SCALED(what, y, want, ny, TOL_FWD);
    CHECK_OK(mn_matmul_forward(y32, pre32, xr, wr, b, N, C, OC));
#ifndef MEMANAT_CBLAS  // there the fp32 call is the CBLAS's, the 16-bit one the native kernel
    EXPECT_SAME("16-bit forward vs fp32 on the rounded values", y, y32, ny);
    EXPECT_SAME("16-bit pre_gelu vs fp32 on the rounded values", pre, pre32, ny);
#endif
    // backward without the epilogue: dinp (dout @ weight) and dweight (dout^T @ inp), added to
    // random starting values
    mnt_fill_normal(dx, ni, 1.0), mnt_fill_normal(dw, nw, 1.0);
    mnt_fill_normal(db, (size_t)OC, 1.0);
    memcpy(dx32, dx, ni * sizeof(float)), memcpy(dw32, dw, nw * sizeof(float));
    memcpy(db32, db, (size_t)OC * sizeof(float)), memcpy(dy32, dy, ny * sizeof(float));
    CHECK_OK(mn_matmul_backward_typed(dx, dw, db, dy, xh, wh, NULL, N, C, OC, dt));
    for (k = 0; k < ni; k++) want[k] = dx32[k];
    for (n = 0; n < N; n++)
        for (i = 0; i < C; i++)
            for (o = 0; o < OC; o++)
                want[(size_t)n * C + i] += (double)dy[(size_t)n * OC + o] * wr[(size_t)o * C + i];
    snprintf(what, sizeof what, "matmul %s N=%d C=%d OC=%d dinp", mn_dtype_name(dt), N, C, OC);
    CHECK_CLOSE_SCALED(what, dx, want, ni, TOL_GRAD);
    ref_dweight(want, dw32, dy, xr, N, C, OC);
    snprintf(what, sizeof what, "matmul %s N=%d C=%d OC=%d dweight", mn_dtype_name(dt), N, C, OC);
    CHECK_CLOSE_SCALED(what, dw, want, nw, TOL_GRAD);
    CHECK_OK(mn_matmul_backward(dx32, dw32, db32, dy32, xr, wr, NULL, N, C, OC));
#ifndef MEMANAT_CBLAS
    EXPECT_SAME("16-bit dinp vs fp32 on the rounded values", dx, dx32, ni);
    EXPECT_SAME("16-bit dweight vs fp32 on the rounded values", dw, dw32, nw);
#endif
    EXPECT_SAME("16-bit dbias vs fp32", db, db32, (size_t)OC);
#ifdef _OPENMP
    {  // two threads: the same bits as the one above (run with the default team first)
        int saved = omp_get_max_threads();
        omp_set_num_threads(saved > 1 ? 1 : 2);
        CHECK_OK(mn_matmul_forward_typed(y32, NULL, xh, wh, b, N, C, OC, dt));
        memcpy(dx32, dx, ni * sizeof(float)), memcpy(dw32, dw, nw * sizeof(float));
        CHECK_OK(mn_matmul_backward_typed(dx, dw, NULL, dy, xh, wh, NULL, N, C, OC, dt));
        omp_set_num_threads(saved);
        CHECK_OK(mn_matmul_backward_typed(dx32, dw32, NULL, dy, xh, wh, NULL, N, C, OC, dt));
        EXPECT_SAME("16-bit forward, thread counts", pre, y32, ny);
        EXPECT_SAME("16-bit dinp, thread counts", dx, dx32, ni);
        EXPECT_SAME("16-bit dweight, thread counts", dw, dw32, nw);
    }
#endif
    free(x), free(w), free(b), free(xr), free(wr), free(dy), free(y), free(pre), free(y32);
    free(pre32), free(dx), free(dw), free(db), free(dx32), free(dw32), free(db32), free(dy32);
    free(xh), free(wh), free(want), free(unround);
}

// Sizes off every block of the GEMM (register tile, the 512-deep slice, the 128-column task),
// one past a 512-deep slice, and one large enough for two threads to split it.
static void test_matmul_16bit(void) {
    static const int shapes[][3] = {{5, 7, 9}, {37, 45, 29}, {7, 600, 33}, {300, 263, 291}};
    static const mn_dtype dts[2] = {MN_BF16, MN_FP16};
    size_t s;
    int d;
    for (d = 0; d < 2; d++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            run_matmul16(dts[d], shapes[s][0], shapes[s][1], shapes[s][2]);
}

// Every finite fp16 and bf16 value through the packing conversion: the forward with an identity
// weight returns inp, the forward with an identity inp returns the weight's transpose, and the
// input gradient with an identity dout returns the weight (each output one exact product plus
// zeros), against the public scalar converters.
static void test_matmul_16bit_values(void) {
    enum { W = 16 };
    static const mn_dtype dts[2] = {MN_BF16, MN_FP16};
    uint16_t *v = (uint16_t *)malloc(65536 * 2), *eye = (uint16_t *)malloc(W * W * 2);
    float *out = mnt_fvec(65536), *want = mnt_fvec(65536), *eyef = mnt_fvec(W * W);
    size_t rows, r, k;
    int d, i, j;
    CHECK(v && eye);
    for (d = 0; d < 2; d++) {
        mn_dtype dt = dts[d];
        uint16_t one = dt == MN_BF16 ? 0x3f80 : 0x3c00, e = dt == MN_BF16 ? 0x7f80 : 0x7c00;
        size_t nv = 0;
        for (k = 0; k < 65536; k++)
            if ((k & e) != e) v[nv++] = (uint16_t)k;  // finite: exponent not all ones
        rows = nv / W;
        for (k = 0; k < rows * W; k++)
            want[k] = dt == MN_BF16 ? mn_bf16_to_fp32(v[k]) : mn_fp16_to_fp32(v[k]);
        for (i = 0; i < W; i++)
            for (j = 0; j < W; j++) eye[i * W + j] = i == j ? one : 0, eyef[i * W + j] = i == j;
        CHECK_OK(mn_matmul_forward_typed(out, NULL, v, eye, NULL, rows, W, W, dt));
        for (k = 0; k < rows * W && out[k] == want[k]; k++) {}
        CHECK_MSG(k == rows * W, "%s inp value %zu: got %g want %g", mn_dtype_name(dt), k,
                  (double)out[k], (double)want[k]);
        CHECK_OK(mn_matmul_forward_typed(out, NULL, eye, v, NULL, W, W, rows, dt));
        for (r = 0; r < rows * W; r++)
            if (out[(r % W) * rows + r / W] != want[r]) break;
        CHECK_MSG(r == rows * W, "%s weight value %zu (transposed)", mn_dtype_name(dt), r);
        memset(out, 0, rows * W * sizeof(float));
        CHECK_OK(mn_matmul_backward_typed(out, NULL, NULL, eyef, eye, v, NULL, W, rows, W, dt));
        for (k = 0; k < rows * W; k++)  // dinp[n, c] = sum_o eye[n, o] v[o, c] = v[n, c]
            if (out[k] != want[k]) break;
        CHECK_MSG(k == rows * W, "%s weight value %zu (dinp)", mn_dtype_name(dt), k);
    }
    free(v), free(eye), free(out), free(want), free(eyef);
}

// ---- matmul weight gradient: dout read across its rows ------------------------------------------
// dweight[o, c] += sum_n dout[n, o] inp[n, c] reads dout along n with a stride of OC floats. Where
// that stride is 1 KiB or more, and inp is wider than two column panels or the stride is a page
// or more, blocks of dout's columns are packed while the tiles of the block before run; else
// dout is read in place (the last shape here, and the 2-column task of the third). Column counts
// that leave a partial strip, a partial block, a next block of one row, a two-thread task of
// fewer rows than a strip (the third shape), and 1024 (rows of dout 4096 bytes apart, a multiple
// of the page); depths past a 512-deep slice; inp widths off the 128-column task; fp32 and
// 16-bit inp (dout rounded to the type as well); one thread and two. Added to random starting
// values, against the double loop; from zero, bit for bit the forward product on explicitly
// transposed copies (inp = dout^T, weight = inp^T: the same sums through the row-contiguous A
// and the transposed B packing of the forward).
static void transpose16(mn_dtype dt, const float *x, uint16_t *h, float *t, int R, int C) {
    int r, c;
    for (r = 0; r < R; r++)
        for (c = 0; c < C; c++) t[(size_t)c * R + r] = x[(size_t)r * C + c];
    if (dt != MN_FP32) to16(dt, t, h, (size_t)R * C);
}

static void run_matmul_dw(mn_dtype dt, int N, int C, int OC) {
    size_t ni = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
    float *x = mnt_fvec(ni), *dy = mnt_fvec(ny), *dw = mnt_fvec(nw), *dw0 = mnt_fvec(nw);
    float *fw = mnt_fvec(nw), *xt = mnt_fvec(ni), *dyt = mnt_fvec(ny);
    uint16_t *xh = (uint16_t *)malloc(ni * 2), *xth = (uint16_t *)malloc(ni * 2);
    uint16_t *dyth = (uint16_t *)malloc(ny * 2), *tmp = (uint16_t *)malloc(ny * 2);
    double *want = mnt_dvec(nw);
    const void *xin = dt == MN_FP32 ? (const void *)x : (const void *)xh;
    const void *fin = dt == MN_FP32 ? (const void *)dyt : (const void *)dyth;
    const void *fwt = dt == MN_FP32 ? (const void *)xt : (const void *)xth;
    char what[96];
    int t;
    CHECK(xh && xth && dyth && tmp);
    mnt_fill_normal(x, ni, 1.0), mnt_fill_normal(dy, ny, 1.0), mnt_fill_normal(dw, nw, 1.0);
    if (dt != MN_FP32) {  // the values of the type, so that the forward sees the same ones
        to16(dt, x, xh, ni), from16(dt, xh, x, ni);
        to16(dt, dy, tmp, ny), from16(dt, tmp, dy, ny);
    }
    memcpy(dw0, dw, nw * sizeof(float));
    CHECK_OK(mn_matmul_backward_typed(NULL, dw, NULL, dy, xin, NULL, NULL, N, C, OC, dt));
    ref_dweight(want, dw0, dy, x, N, C, OC);
    snprintf(what, sizeof what, "matmul %s N=%d C=%d OC=%d dweight", mn_dtype_name(dt), N, C, OC);
    CHECK_CLOSE_SCALED(what, dw, want, nw, TOL_GRAD);
    transpose16(dt, dy, dyth, dyt, N, OC), transpose16(dt, x, xth, xt, N, C);
    for (t = 1; t <= 2; t++) {
#ifdef _OPENMP
        int saved = omp_get_max_threads();
        omp_set_num_threads(t);
#endif
        memset(dw, 0, nw * sizeof(float));
        CHECK_OK(mn_matmul_backward_typed(NULL, dw, NULL, dy, xin, NULL, NULL, N, C, OC, dt));
        CHECK_OK(mn_matmul_forward_typed(fw, NULL, fin, fwt, NULL, OC, N, C, dt));
#ifdef _OPENMP
        omp_set_num_threads(saved);
#endif
#ifndef MEMANAT_CBLAS  // there the fp32 products are the CBLAS's
        snprintf(what, sizeof what, "%s N=%d C=%d OC=%d dweight vs transposed forward, %d thr",
                 mn_dtype_name(dt), N, C, OC, t);
        EXPECT_SAME(what, dw, fw, nw);
#endif
    }
    free(x), free(dy), free(dw), free(dw0), free(fw), free(xt), free(dyt), free(xh), free(xth);
    free(dyth), free(tmp), free(want);
}

static void test_matmul_dweight(void) {
    static const int shapes[][3] = {{600, 40, 1024}, {531, 37, 1037}, {200, 130, 773},
                                    {70, 100, 300},  {9, 97, 257},    {300, 40, 83}};
    static const mn_dtype dts[3] = {MN_FP32, MN_BF16, MN_FP16};
    size_t s;
    int d;
    for (d = 0; d < 3; d++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            run_matmul_dw(dts[d], shapes[s][0], shapes[s][1], shapes[s][2]);
}

// ---- matmul forward: the output set, never read, in the wide-column blocks ------------------------
// The forward writes out = bias + inp @ weight^T without reading out (the first 512-deep slice
// stores, the later ones add) and packs the weight in 256-column blocks from the heap when OC is
// past 128. Fresh random shapes with out filled with NaN first (a read would show), sizes off the
// register tile, the 256-column block and the 512-deep slice, fp32 and both 16-bit forms: against
// the double loop over the rounded values, and bit for bit against the input-gradient product
// (dinp += dout @ weight, weight row-major: another packing path) started from the bias rows,
// which is the fill-then-accumulate order the forward replaces. C = 0 gives the bias (or zeros)
// exactly; a failed allocation returns MN_ERR_OUT_OF_MEMORY with out untouched.
static void run_matmul_init(mn_dtype dt, int N, int C, int OC, int bias) {
    size_t ni = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC, k;
    float *x = mnt_fvec(ni), *w = mnt_fvec(nw), *b = mnt_fvec((size_t)OC), *wt = mnt_fvec(nw);
    float *y = mnt_fvec(ny), *yb = mnt_fvec(ny), *pre = mnt_fvec(ny);
    uint16_t *xh = (uint16_t *)malloc(ni * 2 + 2), *wh = (uint16_t *)malloc(nw * 2 + 2);
    uint16_t *wth = (uint16_t *)malloc(nw * 2 + 2);
    double *want = mnt_dvec(ny);
    const void *xa = x, *wa = w, *wta = wt;
    char what[112];
    int n, o, i, same_kernel = 1;
    CHECK(xh && wh && wth);
    mnt_fill_normal(x, ni, 1.0), mnt_fill_normal(w, nw, 1.0), mnt_fill_normal(b, (size_t)OC, 1.0);
    if (dt != MN_FP32) {  // the operands rounded to the 16-bit type, and read back
        to16(dt, x, xh, ni), to16(dt, w, wh, nw);
        from16(dt, xh, x, ni), from16(dt, wh, w, nw);
        xa = xh, wa = wh, wta = wth;
    }
    for (o = 0; o < OC; o++)
        for (i = 0; i < C; i++) wt[(size_t)i * OC + o] = w[(size_t)o * C + i];
    if (dt != MN_FP32) to16(dt, wt, wth, nw);
    snprintf(what, sizeof what, "matmul forward %s N=%d C=%d OC=%d bias=%d", mn_dtype_name(dt), N,
             C, OC, bias);
    for (k = 0; k < ny; k++) y[k] = pre[k] = NAN;
    CHECK_OK(mn_matmul_forward_typed(y, NULL, xa, wa, bias ? b : NULL, N, C, OC, dt));
    ref_mm_plain(x, w, bias ? b : NULL, want, N, C, OC);
    if (C == 0) {
        for (k = 0; k < ny && y[k] == (bias ? b[k % (size_t)OC] : 0.0f); k++) {}
        CHECK_MSG(k == ny, "%s: out[%zu] = %g, not the bias", what, k, k < ny ? y[k] : 0.0);
    } else {
        CHECK_CLOSE_SCALED(what, y, want, ny, TOL_FWD);
    }
    // the GELU epilogue: pre_gelu is the same product, out its GELU
    CHECK_OK(mn_matmul_forward_typed(yb, pre, xa, wa, bias ? b : NULL, N, C, OC, dt));
    EXPECT_SAME("forward pre_gelu vs plain", pre, y, ny);
    for (k = 0; k < ny; k++) want[k] = gelu_tanh_d(pre[k]);
    CHECK_CLOSE_SCALED(what, yb, want, ny, TOL_FWD);
#ifdef MEMANAT_CBLAS
    same_kernel = dt != MN_FP32;  // the fp32 products are the CBLAS's there
#endif
    if (same_kernel) {
        for (n = 0; n < N; n++)
            for (o = 0; o < OC; o++) yb[(size_t)n * OC + o] = bias ? b[o] : 0.0f;
        // dinp[N, OC] += dout[N, C] @ weight[C, OC]: dout = x (fp32), weight = w^T
        CHECK_OK(mn_matmul_backward_typed(yb, NULL, NULL, x, NULL, wta, NULL, N, OC, C, dt));
        EXPECT_SAME("forward vs bias rows + the input-gradient product", y, yb, ny);
    }
    if (OC > 128 && N > 0) {  // the wide blocks come from the heap: a failure is reported
        for (k = 0; k < ny; k++) y[k] = NAN;
        mnt_fail_alloc_after(1);
        // (no depth, or a CBLAS serving fp32: nothing to pack, nothing allocated; depth 1: the
        // weight's column stride is 1, the untransposed case, whose 128-column blocks are packed
        // on the stack)
        int heap = C > 1 && same_kernel;
        CHECK_ERR(mn_matmul_forward_typed(y, NULL, xa, wa, bias ? b : NULL, N, C, OC, dt),
                  heap ? MN_ERR_OUT_OF_MEMORY : MN_OK);
        mnt_fail_alloc_after(0);
        for (k = 0; k < ny && (!heap || isnan(y[k])); k++) {}
        CHECK_MSG(k == ny, "%s: out[%zu] written by a call that failed", what, k);
    }
    free(x), free(w), free(b), free(wt), free(y), free(yb), free(pre), free(xh), free(wh);
    free(wth), free(want);
}

static void test_matmul_forward_init(void) {
    static const mn_dtype dts[3] = {MN_FP32, MN_BF16, MN_FP16};
    int d, r;
    for (d = 0; d < 3; d++) {
        run_matmul_init(dts[d], 9, 0, 300, 1);  // no depth: out = bias, exactly
        run_matmul_init(dts[d], 3, 0, 40, 0);
        run_matmul_init(dts[d], 70, 600, 531, (int)(mnt_rand_u64() & 1));  // two slices, 3 blocks
        for (r = 0; r < 3; r++)  // fresh sizes: rows 1..80, depth 1..700, columns 1..700
            run_matmul_init(dts[d], 1 + (int)(mnt_rand_u64() % 80),
                            1 + (int)(mnt_rand_u64() % 700), 1 + (int)(mnt_rand_u64() % 700),
                            (int)(mnt_rand_u64() & 1));
    }
}

// ---- layernorm, RMSNorm -------------------------------------------------------------------------

typedef struct ln_ctx {
    int N, C, bias;
    double eps;
} ln_ctx;

static void ref_layernorm(const void *vctx, const double *x, double *y) {
    const ln_ctx *c = (const ln_ctx *)vctx;
    const double *w = x + (size_t)c->N * c->C, *b = w + c->C;
    int n, i;
    for (n = 0; n < c->N; n++) {
        const double *r = x + (size_t)n * c->C;
        double m = 0.0, v = 0.0, s;
        for (i = 0; i < c->C; i++) m += r[i];
        m /= c->C;
        for (i = 0; i < c->C; i++) v += (r[i] - m) * (r[i] - m);
        v /= c->C;
        s = 1.0 / sqrt(v + c->eps);
        for (i = 0; i < c->C; i++)
            y[(size_t)n * c->C + i] = (r[i] - m) * s * w[i] + (c->bias ? b[i] : 0.0);
    }
}

static void run_layernorm(int N, int C, int bias) {
    ln_ctx ctx;
    size_t ni = (size_t)N * C, nx = ni + 2 * (size_t)C, ny = ni;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx);
    float *w = mnt_fvec(ny), *out = mnt_fvec(ny);
    float *mean = mnt_fvec((size_t)N), *rstd = mnt_fvec((size_t)N);
    double *want = mnt_dvec((size_t)N);
    char what[80];
    seg segs[3];
    int n, i;
    ctx.N = N, ctx.C = C, ctx.bias = bias, ctx.eps = 1e-5;
    mnt_fill_normal(x, nx, 1.0);
    for (n = 0; n < N; n++)  // a per-row offset, as real activations have
        for (i = 0; i < C; i++) x[(size_t)n * C + i] += (float)(n - N / 2);
    if (!bias) memset(x + ni + C, 0, (size_t)C * sizeof(float));
    mnt_fill_normal(w, ny, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    snprintf(what, sizeof what, "layernorm N=%d C=%d bias=%d", N, C, bias);
    mn_layernorm_forward(out, mean, rstd, x, x + ni, bias ? x + ni + C : NULL, N, C, 1e-5f);
    check_forward(what, ref_layernorm, &ctx, x, nx, out, ny, TOL_FWD);
    for (n = 0; n < N; n++) {
        double m = 0.0;
        for (i = 0; i < C; i++) m += x[(size_t)n * C + i];
        want[n] = m / C;
    }
    CHECK_CLOSE_SCALED("layernorm mean", mean, want, (size_t)N, TOL_FWD);
    mn_layernorm_backward(g1, g1 + ni, bias ? g1 + ni + C : NULL, w, x, x + ni, mean, rstd, N, C);
    segs[0].name = "inp", segs[0].off = 0, segs[0].n = ni;
    segs[1].name = "weight", segs[1].off = ni, segs[1].n = (size_t)C;
    segs[2].name = "bias", segs[2].off = ni + C, segs[2].n = (size_t)C;
    check_grad(what, ref_layernorm, &ctx, x, nx, w, ny, g0, g1, segs, bias ? 3 : 2, TOL_GRAD);
    free(x), free(g0), free(g1), free(w), free(out), free(mean), free(rstd), free(want);
}

static void test_layernorm(void) {
    run_layernorm(5, 7, 1);
    run_layernorm(3, 16, 0);
    run_layernorm(4, 1, 1);
    run_layernorm(2, 129, 1);
}

static void ref_rmsnorm(const void *vctx, const double *x, double *y) {
    const ln_ctx *c = (const ln_ctx *)vctx;
    const double *w = x + (size_t)c->N * c->C;
    int n, i;
    for (n = 0; n < c->N; n++) {
        const double *r = x + (size_t)n * c->C;
        double ss = 0.0, s;
        for (i = 0; i < c->C; i++) ss += r[i] * r[i];
        s = 1.0 / sqrt(ss / c->C + c->eps);
        for (i = 0; i < c->C; i++) y[(size_t)n * c->C + i] = r[i] * s * w[i];
    }
}

static void run_rmsnorm(int N, int C) {
    ln_ctx ctx;
    size_t ni = (size_t)N * C, nx = ni + (size_t)C, ny = ni;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx);
    float *w = mnt_fvec(ny), *out = mnt_fvec(ny);
    float *rstd = mnt_fvec((size_t)N);
    char what[64];
    seg segs[2];
    ctx.N = N, ctx.C = C, ctx.bias = 0, ctx.eps = 1e-6;
    mnt_fill_normal(x, nx, 1.0);
    mnt_fill_normal(w, ny, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    snprintf(what, sizeof what, "rmsnorm N=%d C=%d", N, C);
    mn_rmsnorm_forward(out, rstd, x, x + ni, N, C, 1e-6f);
    check_forward(what, ref_rmsnorm, &ctx, x, nx, out, ny, TOL_FWD);
    mn_rmsnorm_backward(g1, g1 + ni, w, x, x + ni, rstd, N, C);
    segs[0].name = "inp", segs[0].off = 0, segs[0].n = ni;
    segs[1].name = "weight", segs[1].off = ni, segs[1].n = (size_t)C;
    check_grad(what, ref_rmsnorm, &ctx, x, nx, w, ny, g0, g1, segs, 2, TOL_GRAD);
    free(x), free(g0), free(g1), free(w), free(out), free(rstd);
}

static void test_rmsnorm(void) {
    run_rmsnorm(5, 7);
    run_rmsnorm(3, 32);
    run_rmsnorm(4, 3);
}

// ---- softmax ------------------------------------------------------------------------------------

typedef struct sm_ctx {
    int N, L, causal;
    double scale;
} sm_ctx;

static void ref_softmax(const void *vctx, const double *x, double *y) {
    const sm_ctx *c = (const sm_ctx *)vctx;
    int n, j;
    for (n = 0; n < c->N; n++) {
        int len = c->causal ? n % c->L + 1 : c->L;
        double mx = -1e300, s = 0.0;
        for (j = 0; j < len; j++) mx = fmax(mx, c->scale * x[(size_t)n * c->L + j]);
        for (j = 0; j < len; j++) s += exp(c->scale * x[(size_t)n * c->L + j] - mx);
        for (j = 0; j < c->L; j++)
            y[(size_t)n * c->L + j] =
                j < len ? exp(c->scale * x[(size_t)n * c->L + j] - mx) / s : 0.0;
    }
}

static void run_softmax(int N, int L, double scale, int causal) {
    sm_ctx ctx;
    size_t nx = (size_t)N * L;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx);
    float *w = mnt_fvec(nx), *out = mnt_fvec(nx);
    char what[80];
    seg s0;
    int n, j;
    ctx.N = N, ctx.L = L, ctx.causal = causal, ctx.scale = scale;
    mnt_fill_normal(x, nx, 2.0);
    x[0] += 50.0f;  // a large logit: the max subtraction has to work
    mnt_fill_normal(w, nx, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    snprintf(what, sizeof what, "softmax N=%d L=%d scale=%g causal=%d", N, L, scale, causal);
    mn_softmax_forward(out, x, N, L, (float)scale, causal);
    check_forward(what, ref_softmax, &ctx, x, nx, out, nx, TOL_FWD);
    if (causal)
        for (n = 0; n < N; n++)
            for (j = n % L + 1; j < L; j++) CHECK(out[(size_t)n * L + j] == 0.0f);
    mn_softmax_backward(g1, w, out, N, L, (float)scale, causal);
    s0.name = "inp", s0.off = 0, s0.n = nx;
    check_grad(what, ref_softmax, &ctx, x, nx, w, nx, g0, g1, &s0, 1, TOL_GRAD);
    free(x), free(g0), free(g1), free(w), free(out);
}

static void test_softmax(void) {
    run_softmax(5, 7, 1.0, 0);
    run_softmax(10, 5, 0.37, 1);
    run_softmax(3, 1, 1.0, 1);
    run_softmax(4, 33, 0.125, 0);
}

// ---- attention ----------------------------------------------------------------------------------

typedef struct at_ctx {
    int B, T, C, NH, causal;
} at_ctx;

static void ref_attention(const void *vctx, const double *x, double *y) {
    const at_ctx *c = (const at_ctx *)vctx;
    int hs = c->C / c->NH, b, h, t, j, i;
    size_t C3 = (size_t)3 * c->C;
    double *s = mnt_dvec((size_t)c->T);
    for (b = 0; b < c->B; b++)
        for (h = 0; h < c->NH; h++)
            for (t = 0; t < c->T; t++) {
                const double *q = x + ((size_t)b * c->T + t) * C3 + (size_t)h * hs;
                double *o = y + ((size_t)b * c->T + t) * c->C + (size_t)h * hs;
                int len = c->causal ? t + 1 : c->T;
                double mx = -1e300, sum = 0.0;
                for (j = 0; j < len; j++) {
                    const double *k = x + ((size_t)b * c->T + j) * C3 + c->C + (size_t)h * hs;
                    double d = 0.0;
                    for (i = 0; i < hs; i++) d += q[i] * k[i];
                    s[j] = d / sqrt((double)hs);
                    mx = fmax(mx, s[j]);
                }
                for (j = 0; j < len; j++) sum += exp(s[j] - mx);
                for (i = 0; i < hs; i++) o[i] = 0.0;
                for (j = 0; j < len; j++) {
                    const double *v = x + ((size_t)b * c->T + j) * C3 + 2 * c->C + (size_t)h * hs;
                    double p = exp(s[j] - mx) / sum;
                    for (i = 0; i < hs; i++) o[i] += p * v[i];
                }
            }
    free(s);
}

static void run_attention(int B, int T, int C, int NH, int causal) {
    at_ctx ctx;
    size_t nx = (size_t)B * T * 3 * C, ny = (size_t)B * T * C, na = (size_t)B * NH * T * T;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx), *g2 = mnt_fvec(nx);
    float *w = mnt_fvec(ny), *out = mnt_fvec(ny), *out2 = mnt_fvec(ny), *att = mnt_fvec(na);
    char what[80];
    seg s0;
    int b, h, t, j;
    ctx.B = B, ctx.T = T, ctx.C = C, ctx.NH = NH, ctx.causal = causal;
    mnt_fill_normal(x, nx, 1.0);
    mnt_fill_normal(w, ny, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    memcpy(g2, g0, nx * sizeof(float));
    snprintf(what, sizeof what, "attention B=%d T=%d C=%d NH=%d causal=%d", B, T, C, NH, causal);
    mn_attention_forward(out, att, x, B, T, C, NH, causal);
    check_forward(what, ref_attention, &ctx, x, nx, out, ny, TOL_FWD);
    mn_attention_forward(out2, NULL, x, B, T, C, NH, causal);
    EXPECT_SAME("attention out, kept vs recomputed", out, out2, ny);
    for (b = 0; b < B; b++)  // rows of probabilities sum to 1; causal entries are exactly 0
        for (h = 0; h < NH; h++)
            for (t = 0; t < T; t++) {
                const float *row = att + (((size_t)b * NH + h) * T + t) * T;
                double s = 0.0;
                for (j = 0; j < T; j++) s += row[j];
                CHECK_NEAR(s, 1.0, 1e-6, 0.0);
                if (causal)
                    for (j = t + 1; j < T; j++) CHECK(row[j] == 0.0f);
            }
    mn_attention_backward(g1, w, x, att, B, T, C, NH, causal);
    mn_attention_backward(g2, w, x, NULL, B, T, C, NH, causal);
    EXPECT_SAME("attention dqkv, kept vs recomputed", g1, g2, nx);
    s0.name = "qkv", s0.off = 0, s0.n = nx;
    check_grad(what, ref_attention, &ctx, x, nx, w, ny, g0, g1, &s0, 1, TOL_GRAD);
    if (causal && T > 1) {
        // changing the last position's k and v leaves every earlier output bit for bit
        for (b = 0; b < B; b++)
            for (j = C; j < 3 * C; j++) x[((size_t)b * T + T - 1) * 3 * C + j] += 1.0f;
        mn_attention_forward(out2, NULL, x, B, T, C, NH, causal);
        for (b = 0; b < B; b++)
            EXPECT_SAME("causal: earlier outputs", out + (size_t)b * T * C,
                        out2 + (size_t)b * T * C, (size_t)(T - 1) * C);
    }
    free(x), free(g0), free(g1), free(g2), free(w), free(out), free(out2), free(att);
}

static void test_attention(void) {
    run_attention(2, 5, 9, 3, 1);  // head size 3
    run_attention(2, 5, 9, 3, 0);
    run_attention(1, 7, 8, 2, 1);
    run_attention(3, 4, 5, 1, 1);
    run_attention(1, 1, 4, 4, 1);  // head size 1, one position
    run_attention(1, 12, 32, 2, 1);  // head size 16
    run_attention(1, 70, 6, 2, 1);   // more queries and keys than one tile holds
    run_attention(1, 70, 6, 2, 0);
    run_attention(1, 20, 66, 1, 0);  // head size past one packed channel chunk
}

// ---- elementwise --------------------------------------------------------------------------------

typedef struct uni_ctx {
    int kind;  // 0 gelu tanh, 1 gelu erf, 2 silu, 3 swiglu, 4 residual
    size_t n;
} uni_ctx;

static void ref_unary(const void *vctx, const double *x, double *y) {
    const uni_ctx *c = (const uni_ctx *)vctx;
    size_t i;
    for (i = 0; i < c->n; i++) {
        double v = x[i], sg = 1.0 / (1.0 + exp(-v));
        switch (c->kind) {
        case 0: y[i] = gelu_tanh_d(v); break;
        case 1: y[i] = 0.5 * v * (1.0 + erf(v / sqrt(2.0))); break;
        case 2: y[i] = v * sg; break;
        case 3: y[i] = v * sg * x[c->n + i]; break;
        default: y[i] = v + x[c->n + i]; break;
        }
    }
}

static void run_elementwise(int kind, size_t n) {
    static const char *const names[] = {"gelu", "gelu_erf", "silu", "swiglu", "residual"};
    uni_ctx ctx;
    size_t nx = kind >= 3 ? 2 * n : n, i;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx);
    float *w = mnt_fvec(n), *out = mnt_fvec(n);
    char what[64];
    seg segs[2];
    ctx.kind = kind, ctx.n = n;
    mnt_fill_normal(x, nx, 2.0);
    if (n > 4) x[0] = 9.0f, x[1] = -9.0f, x[2] = 0.0f, x[3] = -30.0f;  // tails and zero
    mnt_fill_normal(w, n, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    switch (kind) {
    case 0: mn_gelu_forward(out, x, n), mn_gelu_backward(g1, w, x, n); break;
    case 1: mn_gelu_erf_forward(out, x, n), mn_gelu_erf_backward(g1, w, x, n); break;
    case 2: mn_silu_forward(out, x, n), mn_silu_backward(g1, w, x, n); break;
    case 3:
        mn_swiglu_forward(out, x, x + n, n), mn_swiglu_backward(g1, g1 + n, w, x, x + n, n);
        break;
    default: mn_residual_forward(out, x, x + n, n), mn_residual_backward(g1, g1 + n, w, n); break;
    }
    snprintf(what, sizeof what, "%s n=%zu", names[kind], n);
    check_forward(what, ref_unary, &ctx, x, nx, out, n, TOL_FWD);
    segs[0].name = kind >= 3 ? (kind == 3 ? "gate" : "a") : "inp", segs[0].off = 0, segs[0].n = n;
    segs[1].name = kind == 3 ? "up" : "b", segs[1].off = n, segs[1].n = n;
    check_grad(what, ref_unary, &ctx, x, nx, w, n, g0, g1, segs, kind >= 3 ? 2 : 1, TOL_GRAD);
    if (kind <= 2) {  // in place: out may equal inp
        float *y = mnt_fvec(n);
        memcpy(y, x, n * sizeof(float));
        if (kind == 0) mn_gelu_forward(y, y, n);
        else if (kind == 1) mn_gelu_erf_forward(y, y, n);
        else mn_silu_forward(y, y, n);
        EXPECT_SAME("in place", y, out, n);
        free(y);
    }
    for (i = 0; i < n; i++) CHECK(out[i] == out[i]);
    free(x), free(g0), free(g1), free(w), free(out);
}

static void test_elementwise(void) {
    int k;
    for (k = 0; k < 5; k++) {
        run_elementwise(k, 37);
        run_elementwise(k, 1);
    }
}

// Activations on a dense grid over their whole range, element by element against double. The
// bound is relative, a few ulp plus the conditioning of exp(z) in its argument (|z| ulp: the
// float argument itself is rounded), measured against |want| + 1e-30 (exp underflow flushes
// values far below fp32 resolution to zero).
static void test_activation_grid(void) {
    enum { n = 15360 };
    float *x = mnt_fvec(n), *y = mnt_fvec(n), *g = mnt_fvec(n), *one = mnt_fvec(n);
    double worst_f[3] = {0, 0, 0}, worst_b[3] = {0, 0, 0};
    const double S = 0.7978845608028654, A = 0.044715, ulp = 5.96e-8;
    int i, k;
    for (i = 0; i < n; i++) x[i] = (float)(-110.0 + 210.0 * i / (n - 1)), one[i] = 1.0f;
    x[n / 2] = 0.0f;
    for (k = 0; k < 3; k++) {
        int fails = 0;
        memset(g, 0, n * sizeof(float));
        if (k == 0) mn_gelu_forward(y, x, n), mn_gelu_backward(g, one, x, n);
        else if (k == 1) mn_gelu_erf_forward(y, x, n), mn_gelu_erf_backward(g, one, x, n);
        else mn_silu_forward(y, x, n), mn_silu_backward(g, one, x, n);
        for (i = 0; i < n; i++) {
            double v = x[i], f, d, da, db, z, ef, eb;  // d = da + db
            if (k == 0) {  // 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)), which does not cancel
                double u = S * (v + A * v * v * v), s = 1.0 / (1.0 + exp(-2.0 * u));
                f = v * s;
                da = s, db = 2.0 * v * s * (1.0 / (1.0 + exp(2.0 * u))) * S * (1.0 + 3.0 * A * v * v);
                z = fabs(2.0 * u);
            } else if (k == 1) {
                f = 0.5 * v * erfc(-v / sqrt(2.0));
                da = 0.5 * erfc(-v / sqrt(2.0));
                db = v * exp(-0.5 * v * v) / sqrt(2.0 * 3.141592653589793);
                z = 0.5 * v * v;
            } else {
                double s = 1.0 / (1.0 + exp(-v));
                f = v * s;
                da = s, db = v * s * (1.0 / (1.0 + exp(v)));
                z = fabs(v);
            }
            // error in units of ulp * (1 + |z|), relative to the value (the derivative: to the sum
            // of its two terms' magnitudes, since they cancel where it crosses zero)
            d = da + db;
            ef = fabs(y[i] - f) / (fabs(f) + 1e-30) / (ulp * (1.0 + z));
            eb = fabs(g[i] - d) / (fabs(da) + fabs(db) + 1e-30) / (ulp * (1.0 + z));
            if (ef > worst_f[k]) worst_f[k] = ef;
            if (eb > worst_b[k]) worst_b[k] = eb;
            if (!(ef < 8.0 && eb < 8.0) && fails++ < 4)
                mnt_fail(__FILE__, __LINE__, "activation %d at x=%.9g: y %.9g want %.9g, dy %.9g "
                         "want %.9g", k, v, y[i], f, g[i], d);
        }
        if (mnt_verbose())
            printf("  %-34s n=%-5d max err fwd %.3g, bwd %.3g ulp*(1+|z|)\n",
                   k == 0 ? "gelu grid" : k == 1 ? "gelu_erf grid" : "silu grid", n, worst_f[k],
                   worst_b[k]);
    }
    free(x), free(y), free(g), free(one);
}

// ---- embedding ----------------------------------------------------------------------------------

typedef struct emb_ctx {
    int B, T, C, V, pos;
    const int *tok;
} emb_ctx;

static void ref_embedding(const void *vctx, const double *x, double *y) {
    const emb_ctx *c = (const emb_ctx *)vctx;
    const double *wpe = x + (size_t)c->V * c->C;
    int n, i;
    for (n = 0; n < c->B * c->T; n++)
        for (i = 0; i < c->C; i++)
            y[(size_t)n * c->C + i] = x[(size_t)c->tok[n] * c->C + i] +
                                      (c->pos ? wpe[(size_t)(n % c->T) * c->C + i] : 0.0);
}

static void run_embedding(int B, int T, int C, int V, int pos) {
    emb_ctx ctx;
    size_t nte = (size_t)V * C, nx = nte + (size_t)T * C, ny = (size_t)B * T * C;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx);
    float *w = mnt_fvec(ny), *out = mnt_fvec(ny);
    int *tok = (int *)calloc((size_t)B * T, sizeof(int));
    char what[64];
    seg segs[2];
    int n;
    for (n = 0; n < B * T; n++) tok[n] = (int)(mnt_rand_u64() % (uint64_t)V);
    tok[0] = V - 1;
    if (B * T > 1) tok[B * T - 1] = tok[0];  // a repeated token: the scatter-add must add up
    ctx.B = B, ctx.T = T, ctx.C = C, ctx.V = V, ctx.pos = pos, ctx.tok = tok;
    mnt_fill_normal(x, nx, 1.0);
    if (!pos) memset(x + nte, 0, (size_t)T * C * sizeof(float));
    mnt_fill_normal(w, ny, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    snprintf(what, sizeof what, "embedding B=%d T=%d C=%d V=%d pos=%d", B, T, C, V, pos);
    CHECK_OK(mn_embedding_forward(out, tok, x, pos ? x + nte : NULL, B, T, C, V));
    check_forward(what, ref_embedding, &ctx, x, nx, out, ny, TOL_FWD);
    CHECK_OK(mn_embedding_backward(g1, pos ? g1 + nte : NULL, w, tok, B, T, C, V));
    segs[0].name = "wte", segs[0].off = 0, segs[0].n = nte;
    segs[1].name = "wpe", segs[1].off = nte, segs[1].n = (size_t)T * C;
    check_grad(what, ref_embedding, &ctx, x, nx, w, ny, g0, g1, segs, pos ? 2 : 1, TOL_GRAD);
    // a token outside [0, V) is refused and nothing is written
    memcpy(g1, g0, nx * sizeof(float));
    memset(out, 0, ny * sizeof(float));
    tok[B * T - 1] = V;
    CHECK_ERR(mn_embedding_forward(out, tok, x, NULL, B, T, C, V), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_embedding_backward(g1, NULL, w, tok, B, T, C, V), MN_ERR_INVALID_ARG);
    tok[B * T - 1] = -1;
    CHECK_ERR(mn_embedding_forward(out, tok, x, NULL, B, T, C, V), MN_ERR_INVALID_ARG);
    CHECK(out[0] == 0.0f);
    EXPECT_SAME("embedding: nothing written on error", g1, g0, nx);
    free(x), free(g0), free(g1), free(w), free(out), free(tok);
}

static void test_embedding(void) {
    run_embedding(2, 5, 7, 11, 1);
    run_embedding(3, 4, 3, 2, 0);
    run_embedding(1, 1, 70, 3, 1);
}

// ---- cross-entropy ------------------------------------------------------------------------------

typedef struct ce_ctx {
    int N, V;
    const int *tgt;
} ce_ctx;

static void ref_ce(const void *vctx, const double *x, double *y) {
    const ce_ctx *c = (const ce_ctx *)vctx;
    int n, j;
    for (n = 0; n < c->N; n++) {
        const double *r = x + (size_t)n * c->V;
        double mx = -1e300, s = 0.0;
        for (j = 0; j < c->V; j++) mx = fmax(mx, r[j]);
        for (j = 0; j < c->V; j++) s += exp(r[j] - mx);
        y[n] = c->tgt[n] < 0 ? 0.0 : mx + log(s) - r[c->tgt[n]];
    }
}

static void run_ce(int N, int V) {
    ce_ctx ctx;
    size_t nx = (size_t)N * V, j;
    float *x = mnt_fvec(nx), *g0 = mnt_fvec(nx), *g1 = mnt_fvec(nx), *g2 = mnt_fvec(nx);
    float *w = mnt_fvec((size_t)N);
    float *loss = mnt_fvec((size_t)N), *probs = mnt_fvec(nx);
    double *pwant = mnt_dvec(nx);
    int *tgt = (int *)calloc((size_t)N, sizeof(int));
    char what[64];
    seg s0;
    int n;
    for (n = 0; n < N; n++) tgt[n] = (int)(mnt_rand_u64() % (uint64_t)V);
    if (N > 2) tgt[1] = -1;  // an ignored row
    ctx.N = N, ctx.V = V, ctx.tgt = tgt;
    mnt_fill_normal(x, nx, 3.0);
    x[0] = 80.0f;  // exp(80) overflows fp32 without the max subtraction
    mnt_fill_normal(w, (size_t)N, 1.0);
    mnt_fill_normal(g0, nx, 1.0);
    memcpy(g1, g0, nx * sizeof(float));
    memcpy(g2, g0, nx * sizeof(float));
    snprintf(what, sizeof what, "crossentropy N=%d V=%d", N, V);
    CHECK_OK(mn_crossentropy_forward(loss, probs, x, tgt, N, V));
    check_forward(what, ref_ce, &ctx, x, nx, loss, (size_t)N, TOL_FWD);
    for (n = 0; n < N; n++) {
        double mx = -1e300, s = 0.0;
        for (j = 0; j < (size_t)V; j++) mx = fmax(mx, x[(size_t)n * V + j]);
        for (j = 0; j < (size_t)V; j++) s += exp(x[(size_t)n * V + j] - mx);
        for (j = 0; j < (size_t)V; j++) pwant[(size_t)n * V + j] = exp(x[(size_t)n * V + j] - mx) / s;
    }
    CHECK_CLOSE_SCALED("crossentropy probs", probs, pwant, nx, TOL_FWD);
    CHECK_OK(mn_crossentropy_backward(g1, w, probs, x, tgt, N, V));
    CHECK_OK(mn_crossentropy_backward(g2, w, NULL, x, tgt, N, V));
    s0.name = "logits", s0.off = 0, s0.n = nx;
    check_grad(what, ref_ce, &ctx, x, nx, w, (size_t)N, g0, g1, &s0, 1, TOL_GRAD);
    check_grad("crossentropy (recomputed probs)", ref_ce, &ctx, x, nx, w, (size_t)N, g0, g2, &s0, 1,
               TOL_GRAD);
    // a target >= V is refused and nothing is written
    memcpy(g1, g0, nx * sizeof(float));
    tgt[N - 1] = V;
    CHECK_ERR(mn_crossentropy_forward(loss, probs, x, tgt, N, V), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_crossentropy_backward(g1, w, probs, x, tgt, N, V), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_crossentropy_backward(g1, w, NULL, NULL, tgt, N, V), MN_ERR_INVALID_ARG);
    EXPECT_SAME("crossentropy: nothing written on error", g1, g0, nx);
    free(x), free(g0), free(g1), free(g2), free(w), free(loss), free(probs), free(pwant), free(tgt);
}

static void test_crossentropy(void) {
    run_ce(5, 7);
    run_ce(4, 256);
    run_ce(1, 1);
}

// ---- dropout ------------------------------------------------------------------------------------

static void test_philox(void) {
    // known-answer vectors of Random123 (kat_vectors, philox4x32_10)
    static const struct { uint32_t ctr[4]; uint64_t key; uint32_t want[4]; } kat[] = {
        {{0, 0, 0, 0}, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
        {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffffffffffull,
         {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
        {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0x299f31d0a4093822ull,
         {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
    };
    uint32_t out[4];
    size_t i;
    int j;
    for (i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        mn_philox4x32(kat[i].ctr, kat[i].key, out);
        for (j = 0; j < 4; j++) CHECK_EQ_U64(out[j], kat[i].want[j]);
    }
}

static void test_dropout(void) {
    enum { n = 100003 };
    const float p = 0.1f;
    uint64_t seed = mnt_rand_u64(), off = mnt_rand_u64() >> 20;
    uint8_t *m1 = (uint8_t *)malloc(n), *m2 = (uint8_t *)malloc(n), *m3 = (uint8_t *)malloc(n);
    float *x = mnt_fvec(n), *y = mnt_fvec(n), *g1 = mnt_fvec(n);
    float *g2 = mnt_fvec(n), *dy = mnt_fvec(n);
    size_t i, kept = 0, differ = 0;
    double mean, sd;
    mnt_fill_normal(x, n, 1.0);
    mnt_fill_normal(dy, n, 1.0);
    // same seed and offset, same mask; the mask of a slice is the slice of the mask
    CHECK_OK(mn_dropout_mask(m1, n, p, seed, off));
    CHECK_OK(mn_dropout_mask(m2, 777, p, seed, off));
    CHECK_OK(mn_dropout_mask(m2 + 777, n - 777, p, seed, off + 777));
    CHECK(memcmp(m1, m2, n) == 0);
    CHECK_OK(mn_dropout_mask(m3, n, p, seed + 1, off));
    for (i = 0; i < n; i++) kept += m1[i], differ += m1[i] != m3[i];
    // kept ~ Binomial(n, 1 - p): within 6 standard deviations
    mean = n * (1.0 - p), sd = sqrt(n * p * (1.0 - p));
    CHECK_MSG(fabs((double)kept - mean) < 6.0 * sd, "kept %zu of %d, want %.0f +- %.0f", kept, n, mean,
              6.0 * sd);
    // another seed: masks independent, disagreement ~ 2 p (1 - p)
    mean = n * 2.0 * p * (1.0 - p), sd = sqrt(mean);
    CHECK_MSG(fabs((double)differ - mean) < 8.0 * sd, "seeds differ at %zu, want %.0f", differ, mean);
    // forward: y = x mask / (1 - p), its mask output equals the recomputed mask
    memset(m2, 7, n);
    CHECK_OK(mn_dropout_forward(y, m2, x, n, p, seed, off));
    CHECK(memcmp(m1, m2, n) == 0);
    for (i = 0; i < n; i++)
        if (y[i] != (m1[i] ? x[i] * (1.0f / (1.0f - p)) : 0.0f)) break;
    CHECK_EQ_U64(i, n);
    // backward with the stored mask equals backward regenerating it, and both add dy mask/(1-p)
    memcpy(g2, g1, n * sizeof(float));
    CHECK_OK(mn_dropout_backward(g1, dy, m2, n, p, seed, off));
    CHECK_OK(mn_dropout_backward(g2, dy, NULL, n, p, seed, off));
    EXPECT_SAME("dropout backward, stored vs regenerated mask", g1, g2, n);
    for (i = 0; i < n; i++)
        if (g1[i] != (m1[i] ? dy[i] * (1.0f / (1.0f - p)) : 0.0f)) break;
    CHECK_EQ_U64(i, n);
    // in place, p = 0 keeps everything, p = 1 drops everything, other p refused
    memcpy(g1, x, n * sizeof(float));
    CHECK_OK(mn_dropout_forward(g1, NULL, g1, n, p, seed, off));
    EXPECT_SAME("dropout in place", g1, y, n);
    CHECK_OK(mn_dropout_forward(y, m2, x, n, 0.0f, seed, off));
    EXPECT_SAME("dropout p=0", y, x, n);
    for (i = 0; i < n; i++) CHECK(m2[i] == 1);
    CHECK_OK(mn_dropout_forward(y, m2, x, n, 1.0f, seed, off));
    for (i = 0; i < n; i++) CHECK(y[i] == 0.0f && m2[i] == 0);
    CHECK_ERR(mn_dropout_forward(y, NULL, x, n, -0.1f, seed, off), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_dropout_forward(y, NULL, x, n, 1.5f, seed, off), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_dropout_mask(m1, n, (float)NAN, seed, off), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_dropout_backward(g1, dy, NULL, n, 2.0f, seed, off), MN_ERR_INVALID_ARG);
    free(m1), free(m2), free(m3), free(x), free(y), free(g1), free(g2), free(dy);
}

// With OpenMP, one thread and two threads give the same bits (threads own disjoint outputs and
// every sum keeps its order); without it, two runs give the same bits (nothing depends on
// uninitialized memory or on state kept between calls).
#ifdef _OPENMP
#define SET_THREADS(k) omp_set_num_threads(k)
#else
#define SET_THREADS(k) (void)(k)
#endif
static void test_thread_invariance(void) {
    enum { N = 70, C = 300, OC = 150, B = 2, T = 40, CA = 48, NH = 3 };
    size_t nx = (size_t)N * C + (size_t)OC * C + OC, nq = (size_t)B * T * 3 * CA;
    float *x = mnt_fvec(nx), *w = mnt_fvec((size_t)N * OC), *out[2], *g[2], *d[2];
    int r;
#ifdef _OPENMP
    int saved = omp_get_max_threads();
#endif
    mnt_fill_normal(x, nx, 1.0);
    mnt_fill_normal(w, (size_t)N * OC, 1.0);
    for (r = 0; r < 2; r++) {
        float *mean = mnt_fvec(N), *rstd = mnt_fvec(N);
        SET_THREADS(r + 1);
        out[r] = mnt_fvec((size_t)N * OC), g[r] = mnt_fvec(nx), d[r] = mnt_fvec((size_t)N * OC);
        memcpy(d[r], w, (size_t)N * OC * sizeof(float));
        mn_matmul_forward(out[r], NULL, x, x + (size_t)N * C, x + nx - OC, N, C, OC);
        mn_matmul_backward(g[r], g[r] + (size_t)N * C, g[r] + nx - OC, d[r], x, x + (size_t)N * C,
                           NULL, N, C, OC);
        mn_layernorm_forward(d[r], mean, rstd, x, x + (size_t)N * C, x + nx - OC, N, OC, 1e-5f);
        mn_layernorm_backward(g[r], g[r] + (size_t)N * C, g[r] + nx - OC, w, x, x + (size_t)N * C,
                              mean, rstd, N, OC);
        mn_attention_forward(out[r], NULL, x, B, T, CA, NH, 1);
        mn_attention_backward(g[r] + 1000, w, x, NULL, B, T, CA, NH, 1);
        free(mean), free(rstd);
    }
#ifdef _OPENMP
    omp_set_num_threads(saved);
#endif
    EXPECT_SAME("one vs two threads: outputs", out[0], out[1], (size_t)N * OC);
    EXPECT_SAME("one vs two threads: gradients", g[0], g[1], nx);
    EXPECT_SAME("one vs two threads: layernorm", d[0], d[1], (size_t)N * OC);
    CHECK(nq + 1000 < nx);
    free(x), free(w);
    for (r = 0; r < 2; r++) free(out[r]), free(g[r]), free(d[r]);
}
// The row-wise and element-wise ops at sizes where teams form (N * C above four times
// MN__OMP_MIN_ELEMS): one thread, two and four give the same bits (four: the layernorm and
// RMSNorm backwards then take their team path, rows then columns; up to two threads, one pass).
// The shapes are drawn fresh; C is odd so rows end in a scalar tail.
static void test_thread_invariance_large(void) {
    size_t C = 2 * (200 + mnt_rand_u64() % 200) + 1, N = 1100000 / C + 1, n = N * C, V = 50257;
    size_t NV = n / V + 1, nmax = NV * V > n ? NV * V : n;
    float *x = mnt_fvec(nmax), *dy = mnt_fvec(nmax), *w = mnt_fvec(C), *b = mnt_fvec(C);
    float *y[3], *g[3], *pw[3], *loss = mnt_fvec(NV), *dl = mnt_fvec(NV), *mean = mnt_fvec(N);
    float *rstd = mnt_fvec(N);
    int *tgt = (int *)calloc(NV, sizeof(int)), r, op;
    static const int threads[3] = {1, 2, 4};
    size_t i;
#ifdef _OPENMP
    int saved = omp_get_max_threads();
#endif
    if (!tgt) {
        mnt_fail(__FILE__, __LINE__, "out of memory");
        return;
    }
    mnt_fill_normal(x, nmax, 2.0);
    mnt_fill_normal(dy, nmax, 1.0);
    mnt_fill_normal(w, C, 1.0);
    mnt_fill_normal(b, C, 1.0);
    for (i = 0; i < NV; i++) tgt[i] = (int)(mnt_rand_u64() % V), dl[i] = 1.0f / (float)NV;
    for (r = 0; r < 3; r++) y[r] = mnt_fvec(nmax), g[r] = mnt_fvec(nmax), pw[r] = mnt_fvec(2 * C);
    for (op = 0; op < 5; op++) {
        static const char *const names[] = {"layernorm", "softmax", "gelu", "crossentropy",
                                            "rmsnorm"};
        char what[64];
        size_t cnt = op == 3 ? NV * V : n;
        for (r = 0; r < 3; r++) {
            SET_THREADS(threads[r]);
            memset(g[r], 0, nmax * sizeof(float));
            for (i = 0; i < 2 * C; i++) pw[r][i] = 0.5f;
            if (op == 0) {
                mn_layernorm_forward(y[r], mean, rstd, x, w, b, N, C, 1e-5f);
                mn_layernorm_backward(g[r], pw[r], pw[r] + C, dy, x, w, mean, rstd, N, C);
            } else if (op == 1) {
                mn_softmax_forward(y[r], x, N, C, 0.3f, 0);
                mn_softmax_backward(g[r], dy, y[r], N, C, 0.3f, 0);
            } else if (op == 2) {
                mn_gelu_forward(y[r], x, n);
                mn_gelu_backward(g[r], dy, x, n);
            } else if (op == 3) {
                mn_crossentropy_forward(loss, y[r], x, tgt, NV, V);
                mn_crossentropy_backward(g[r], dl, NULL, x, tgt, NV, V);
            } else {
                mn_rmsnorm_forward(y[r], rstd, x, w, N, C, 1e-5f);
                mn_rmsnorm_backward(g[r], pw[r], dy, x, w, rstd, N, C);
            }
        }
        for (r = 1; r < 3; r++) {
            snprintf(what, sizeof what, "%s forward, 1 vs %d threads", names[op], threads[r]);
            EXPECT_SAME(what, y[0], y[r], cnt);
            snprintf(what, sizeof what, "%s backward, 1 vs %d threads", names[op], threads[r]);
            EXPECT_SAME(what, g[0], g[r], cnt);
            snprintf(what, sizeof what, "%s parameter gradients, 1 vs %d threads", names[op],
                     threads[r]);
            if (op == 0 || op == 4) EXPECT_SAME(what, pw[0], pw[r], 2 * C);
        }
    }
#ifdef _OPENMP
    omp_set_num_threads(saved);
#endif
    for (r = 0; r < 3; r++) free(y[r]), free(g[r]), free(pw[r]);
    free(x), free(dy), free(w), free(b), free(loss), free(dl), free(mean), free(rstd), free(tgt);
}

// A team that shares the cores with a thread that never stops (as another process keeping a core
// busy would): its members lose their cores at any point of a run, and take the iterations in a
// different order from run to run. Each op with two threads, three times over, gives the bits of
// one thread; the optimizer steps (fresh state: the first step takes the team, the others the
// count that their timing picks) give the bits of one thread for the parameters and the state.
// Without OpenMP, two runs beside the spinning thread give the same bits (the optimizer steps'
// timing decides nothing then).
static volatile int busy_stop;
static void *busy_spin(void *arg) {
    volatile unsigned long x = 0;
    (void)arg;
    while (!busy_stop) x++;
    return NULL;
}
static void test_thread_busy_core(void) {
    size_t C = 2 * (200 + mnt_rand_u64() % 200) + 1, N = 1100000 / C + 1, n = N * C;
    size_t no = 2 * 524288 + 1 + mnt_rand_u64() % 100000, i;
    float *x = mnt_fvec(n), *dy = mnt_fvec(n), *w = mnt_fvec(C), *b = mnt_fvec(C);
    float *mean = mnt_fvec(N), *rstd = mnt_fvec(N), *y[2], *g[2], *pw[2], *p[2], *st[2];
    float *grad = mnt_fvec(no);
    uint8_t *codes[2];
    uint64_t dims[1];
    pthread_t spin;
    int r, rep, spinning;
#ifdef _OPENMP
    int saved = omp_get_max_threads();
#endif
    mnt_fill_normal(x, n, 2.0);
    mnt_fill_normal(dy, n, 1.0);
    mnt_fill_normal(w, C, 1.0);
    mnt_fill_normal(b, C, 1.0);
    mnt_fill_normal(grad, no, 1.0);
    dims[0] = no;
    for (r = 0; r < 2; r++) {
        y[r] = mnt_fvec(n), g[r] = mnt_fvec(n), pw[r] = mnt_fvec(2 * C);
        p[r] = mnt_fvec(3 * no), st[r] = mnt_fvec(5 * no);
        codes[r] = (uint8_t *)calloc(2 * no, 1);
    }
    busy_stop = 0;
    spinning = pthread_create(&spin, NULL, busy_spin, NULL) == 0;
    CHECK(spinning);
    for (rep = 0; rep < 3; rep++) {
        for (r = 0; r < 2; r++) {
            mn_adamw aw;
            mn_sgd sg;
            mn_adamw8bit a8;
            mn_sgd_params sp;
            int k;
            SET_THREADS(r + 1);
            memset(g[r], 0, n * sizeof(float));
            for (i = 0; i < 2 * C; i++) pw[r][i] = 0.5f;
            mn_layernorm_forward(y[r], mean, rstd, x, w, b, N, C, 1e-5f);
            mn_layernorm_backward(g[r], pw[r], pw[r] + C, dy, x, w, mean, rstd, N, C);
            mn_softmax_backward(g[r], dy, y[r], N, C, 0.3f, 0);
            mn_softmax_forward(y[r], x, N, C, 0.3f, 0);
            mn_gelu_backward(g[r], dy, y[r], n);
            mn_gelu_forward(y[r], y[r], n);
            memcpy(p[r], grad, no * sizeof(float));
            memcpy(p[r] + no, grad, no * sizeof(float));
            memcpy(p[r] + 2 * no, grad, no * sizeof(float));
            memset(&sp, 0, sizeof sp);
            sp.momentum = 0.9f;
            CHECK_OK(mn_adamw_init(&aw, dims, 1, NULL, NULL));
            CHECK_OK(mn_sgd_init(&sg, dims, 1, &sp, NULL));
            CHECK_OK(mn_adamw8bit_init(&a8, dims, 1, NULL, NULL));
            for (k = 0; k < 3; k++) {
                CHECK_OK(mn_adamw_step(&aw, p[r], grad, NULL));
                CHECK_OK(mn_sgd_step(&sg, p[r] + no, grad, NULL));
                CHECK_OK(mn_adamw8bit_step(&a8, p[r] + 2 * no, grad, NULL));
            }
            memcpy(st[r], aw.exp_avg, no * sizeof(float));
            memcpy(st[r] + no, aw.exp_avg_sq, no * sizeof(float));
            memcpy(st[r] + 2 * no, sg.momentum_buffer, no * sizeof(float));
            memcpy(st[r] + 3 * no, a8.absmax1, a8.blocks * sizeof(float));
            memcpy(st[r] + 4 * no, a8.absmax2, a8.blocks * sizeof(float));
            CHECK(a8.quantized);
            if (a8.quantized && codes[r]) {
                memcpy(codes[r], a8.code1, no), memcpy(codes[r] + no, a8.code2, no);
            }
            mn_adamw_free(&aw), mn_sgd_free(&sg), mn_adamw8bit_free(&a8);
        }
        EXPECT_SAME("busy core: layernorm, softmax and gelu forwards", y[0], y[1], n);
        EXPECT_SAME("busy core: their backwards", g[0], g[1], n);
        EXPECT_SAME("busy core: layernorm parameter gradients", pw[0], pw[1], 2 * C);
        EXPECT_SAME("busy core: adamw, sgd and 8-bit adamw parameters", p[0], p[1], 3 * no);
        EXPECT_SAME("busy core: adamw and sgd state", st[0], st[1], 3 * no);
        EXPECT_SAME("busy core: 8-bit adamw scales", st[0] + 3 * no, st[1] + 3 * no,
                    (no + 255) / 256);
        EXPECT_SAME("busy core: 8-bit adamw scales (v)", st[0] + 4 * no, st[1] + 4 * no,
                    (no + 255) / 256);
        CHECK(codes[0] && codes[1] && memcmp(codes[0], codes[1], 2 * no) == 0);
    }
    busy_stop = 1;
    if (spinning) pthread_join(spin, NULL);
#ifdef _OPENMP
    omp_set_num_threads(saved);
#endif
    for (r = 0; r < 2; r++) free(y[r]), free(g[r]), free(pw[r]), free(p[r]), free(st[r]);
    for (r = 0; r < 2; r++) free(codes[r]);
    free(x), free(dy), free(w), free(b), free(mean), free(rstd), free(grad);
}

// Large calls (an output of 16 MiB or more, the ops' streaming threshold) write their output with
// streaming stores and ask for rows ahead (>>ops streaming stores); the values must be those of
// small calls, bit for bit. Each op runs once on a large shape of odd widths, its output a random
// 1 to 15 floats past malloc's alignment (so rows start unaligned and the heads and tails take
// ordinary stores) and poisoned with NaN first, against the same op called on pieces below the
// threshold (rows one by one, or L rows at a time where the causal mask counts rows); the float
// after the output must keep its poison.
static float nt_poison(void) {
    uint32_t u = 0x7fc0dead;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void nt_check(const char *what, const float *got, const float *want, size_t n) {
    float p = nt_poison();
    EXPECT_SAME(what, got, want, n);
    CHECK_MSG(memcmp(&got[n], &p, sizeof p) == 0, "%s: the float after the output was written",
              what);
}

static void test_streaming_stores(void) {
    size_t C = 2 * (300 + mnt_rand_u64() % 200) + 1, N = 4300000 / C + 1 + mnt_rand_u64() % 7;
    size_t n = N * C, V = 50001 + 2 * (mnt_rand_u64() % 100), NV = 4300000 / V + 1;
    size_t cap = (n > NV * V ? n : NV * V) + 32, off = 1 + mnt_rand_u64() % 15, i, r;
    float *x = mnt_fvec(cap), *w = mnt_fvec(C), *b = mnt_fvec(C), *ybuf = mnt_fvec(cap);
    float *want = mnt_fvec(cap), *st = mnt_fvec(4 * N + 4 * NV + 8), *y = ybuf + off;
    float *mean = st, *rstd = st + N, *mean1 = st + 2 * N, *rstd1 = st + 3 * N;
    float *loss = st + 4 * N, *loss1 = loss + NV;
    int *tgt = (int *)malloc(NV * sizeof(int)), variant;
    if (!tgt) {
        mnt_fail(__FILE__, __LINE__, "out of memory");
        return;
    }
    mnt_fill_normal(x, cap, 2.0);
    mnt_fill_normal(w, C, 1.0);
    mnt_fill_normal(b, C, 1.0);
    for (i = 0; i < NV; i++) tgt[i] = (int)(mnt_rand_u64() % V) - (i == 1);  // one ignored
#define NT_POISON(cnt) for (i = 0; i < (cnt) + 1; i++) y[i] = nt_poison()
    for (variant = 0; variant < 2; variant++) {  // with and without bias
        const float *bias = variant ? NULL : b;
        NT_POISON(n);
        CHECK_OK(mn_layernorm_forward(y, mean, rstd, x, w, bias, N, C, 1e-5f));
        for (r = 0; r < N; r++)
            CHECK_OK(mn_layernorm_forward(want + r * C, mean1 + r, rstd1 + r, x + r * C, w, bias,
                                          1, C, 1e-5f));
        want[n] = nt_poison();
        nt_check(variant ? "layernorm forward, no bias" : "layernorm forward", y, want, n);
        EXPECT_SAME("layernorm mean", mean, mean1, N);
        EXPECT_SAME("layernorm rstd", rstd, rstd1, N);
    }
    NT_POISON(n);
    CHECK_OK(mn_rmsnorm_forward(y, rstd, x, w, N, C, 1e-5f));
    for (r = 0; r < N; r++)
        CHECK_OK(mn_rmsnorm_forward(want + r * C, rstd1 + r, x + r * C, w, 1, C, 1e-5f));
    want[n] = nt_poison();
    nt_check("rmsnorm forward", y, want, n);
    EXPECT_SAME("rmsnorm rstd", rstd, rstd1, N);
    for (variant = 0; variant < 2; variant++) {  // plain and causal
        NT_POISON(n);
        CHECK_OK(mn_softmax_forward(y, x, N, C, 0.7f, variant));
        for (r = 0; r < N; r += C)
            CHECK_OK(mn_softmax_forward(want + r * C, x + r * C, N - r < C ? N - r : C, C, 0.7f,
                                        variant));
        want[n] = nt_poison();
        nt_check(variant ? "softmax forward, causal" : "softmax forward", y, want, n);
    }
    NT_POISON(n);
    CHECK_OK(mn_gelu_forward(y, x, n));
    for (r = 0; r < n; r += 100003)
        CHECK_OK(mn_gelu_forward(want + r, x + r, n - r < 100003 ? n - r : 100003));
    want[n] = nt_poison();
    nt_check("gelu forward", y, want, n);
    NT_POISON(NV * V);
    CHECK_OK(mn_crossentropy_forward(loss, y, x, tgt, NV, V));
    for (r = 0; r < NV; r++)
        CHECK_OK(mn_crossentropy_forward(loss1 + r, want + r * V, x + r * V, tgt + r, 1, V));
    want[NV * V] = nt_poison();
    nt_check("crossentropy probs", y, want, NV * V);
    EXPECT_SAME("crossentropy losses", loss, loss1, NV);
#undef NT_POISON
    free(x), free(w), free(b), free(ybuf), free(want), free(st), free(tgt);
}

// The large softmax forward without the mask and the large cross-entropy forward with probs go
// through their rows in one pass per row, which finds the max of the row after and streams the
// output of the row before from a buffer that the two rows share (>>ops streaming stores); the
// values must be those of the rows one by one (small calls: the loop row by row, ordinary
// stores), bit for bit. Widths: shorter than a step of the pass, 16k + 3, 16k + 8, a multiple of
// 16 (every row at the same offset in a line), past an L1 chunk (the softmax row by row), and a
// fresh odd vocabulary-sized one; N * V just past the threshold (and once just below it); one
// and two threads; x and the output each a fresh 0 to 15 floats past malloc's alignment; normal
// inputs with some far below their row's max (the scalar lanes of the exp). The cross-entropy
// once more with its scratch allocation failing (the call goes row by row, the same values).
int test_ops_streams(void);  // test/test_opsmath.c
static void test_streaming_rows(void) {
    size_t widths[] = {17, 16 * 4 + 3, 16 * 62 + 8, 1024, 4099, 0}, nw = 6, k, i, r;
    size_t thr = ((size_t)16 << 20) / sizeof(float), cap = thr + 70000 * 3;
    float *x0 = mnt_fvec(cap + 16), *y0 = mnt_fvec(cap + 17), *want = mnt_fvec(cap + 1);
    float *loss = mnt_fvec(thr + 1), *loss1 = mnt_fvec(thr + 1), p = nt_poison();
    int *tgt = (int *)malloc((thr + 1) * sizeof(int)), th;
    long allocs;
#ifdef _OPENMP
    int saved = omp_get_max_threads();
#endif
    widths[nw - 1] = 2 * (15000 + mnt_rand_u64() % 20000) + 1;
    if (!tgt) {
        mnt_fail(__FILE__, __LINE__, "out of memory");
        return;
    }
    for (k = 0; k <= nw; k++)
        for (th = 1; th <= 2; th++) {
            size_t V = widths[k < nw ? k : 0], N = thr / V + 1 + mnt_rand_u64() % 3, n;
            float *x = x0 + mnt_rand_u64() % 16, *y = y0 + mnt_rand_u64() % 16;
            char what[96];
            if (k == nw) N = (thr - 1) / V;  // below the threshold: row by row either way
            n = N * V;
            SET_THREADS(th);
            mnt_fill_normal(x, n, 3.0);
            for (i = mnt_rand_u64() % 50; i < n; i += 1 + mnt_rand_u64() % 5000) x[i] = -150.0f;
            for (i = 0; i < N; i++) tgt[i] = i % 7 == 3 ? -1 : (int)(mnt_rand_u64() % V);
            for (i = 0; i <= n; i++) y[i] = p;
            snprintf(what, sizeof what, "crossentropy N=%zu V=%zu, %d thread(s)", N, V, th);
            allocs = mnt_total_allocs();
            CHECK_OK(mn_crossentropy_forward(loss, y, x, tgt, N, V));
            CHECK_MSG(mnt_total_allocs() - allocs == (k < nw && test_ops_streams()),
                      "%s: %ld allocations", what, mnt_total_allocs() - allocs);
            for (r = 0; r < N; r++)
                CHECK_OK(mn_crossentropy_forward(loss1 + r, want + r * V, x + r * V, tgt + r, 1,
                                                 V));
            want[n] = p;
            nt_check(what, y, want, n);
            EXPECT_SAME(what, loss, loss1, N);
            if (k == 0 || k == nw - 1) {  // the scratch rows not to be had
                long live = mnt_live_allocs();
                for (i = 0; i <= n; i++) y[i] = p;
                mnt_fail_alloc_after(1);
                CHECK_OK(mn_crossentropy_forward(loss, y, x, tgt, N, V));
                mnt_fail_alloc_after(0);
                nt_check(what, y, want, n);
                EXPECT_SAME(what, loss, loss1, N);
                CHECK(mnt_live_allocs() == live);
            }
            for (i = 0; i <= n; i++) y[i] = p;
            snprintf(what, sizeof what, "softmax N=%zu L=%zu, %d thread(s)", N, V, th);
            CHECK_OK(mn_softmax_forward(y, x, N, V, 0.7f, 0));
            for (r = 0; r < N; r++)
                CHECK_OK(mn_softmax_forward(want + r * V, x + r * V, 1, V, 0.7f, 0));
            nt_check(what, y, want, n);
        }
#ifdef _OPENMP
    omp_set_num_threads(saved);
#endif
    free(x0), free(y0), free(want), free(loss), free(loss1), free(tgt);
}

// The layernorm and RMSNorm backwards on a large call (N * C past MN__NT_MIN_BYTES: the
// one-thread loop asks for rows ahead), with a fresh odd C (rows end in a scalar tail), for each
// choice of outputs (dinp, dweight and the layernorm's dbias, each given or NULL). One thread (one
// fused pass over each row with vector lanes) against four (with OpenMP, the team's path: rows
// for dinp, then columns), bit for bit; against a double loop on sampled rows of dinp and on every
// column of dweight and dbias; and each output the same bits whichever other outputs the call
// computes. The RMSNorm forward's large call (streamed rows) is checked on the sampled rows too.
static void norm_backward_paths(int rms) {
    enum { S = 8 };  // sampled rows
    size_t C = 2 * (300 + mnt_rand_u64() % 200) + 1, N = 4300000 / C + 1, n = N * C, i, j;
    float *x = mnt_fvec(n), *dy = mnt_fvec(n), *w = mnt_fvec(C), *mean = mnt_fvec(N);
    float *rstd = mnt_fvec(N), *dx[2], *pw[2], *all = mnt_fvec(2 * C + S * C);
    double *want = mnt_dvec(2 * C), *g = mnt_dvec(C), *xh = mnt_dvec(C);
    const char *op = rms ? "rmsnorm" : "layernorm";
    size_t rows[S];
    static const int threads[2] = {1, 4};
    int mask, t, k, full = rms ? 3 : 7;  // every output of the op
#ifdef _OPENMP
    int saved = omp_get_max_threads();
#endif
    rows[0] = 0, rows[1] = 1, rows[2] = N - 2, rows[3] = N - 1;
    for (k = 4; k < S; k++) rows[k] = mnt_rand_u64() % N;
    mnt_fill_normal(x, n, 2.0);
    mnt_fill_normal(dy, n, 1.0);
    mnt_fill_normal(w, C, 1.0);
    for (t = 0; t < 2; t++) dx[t] = mnt_fvec(n), pw[t] = mnt_fvec(2 * C);
    for (i = 0; i < n; i++) x[i] += (float)(i / C % 7);  // per-row offsets
    if (rms) {  // mean 0: xh = x r below for both
        CHECK_OK(mn_rmsnorm_forward(dx[0], rstd, x, w, N, C, 1e-5f));
        for (j = 0; j < N; j++) mean[j] = 0.0f;
        for (k = 0; k < S; k++) {  // y = x r w, r = 1 / sqrt(mean(x^2) + eps), in double
            const float *xr = x + rows[k] * C;
            double ss = 0.0, r;
            char what[96];
            for (i = 0; i < C; i++) ss += (double)xr[i] * xr[i];
            r = 1.0 / sqrt(ss / (double)C + 1e-5);
            CHECK_MSG(fabs(rstd[rows[k]] - r) <= 1e-6 * r, "rmsnorm rstd row %zu: %g, want %g",
                      rows[k], (double)rstd[rows[k]], r);
            for (i = 0; i < C; i++) g[i] = (double)xr[i] * r * w[i];
            snprintf(what, sizeof what, "rmsnorm forward C=%zu row %zu", C, rows[k]);
            CHECK_CLOSE_SCALED(what, dx[0] + rows[k] * C, g, C, 2e-6);
            for (i = 0; i < C; i++) all[i] = xr[i] * rstd[rows[k]] * w[i];  // the float form
            EXPECT_SAME(what, dx[0] + rows[k] * C, all, C);
        }
    } else {
        CHECK_OK(mn_layernorm_forward(dx[0], mean, rstd, x, w, NULL, N, C, 1e-5f));
    }
    // the parameter gradients in double: 0.5 + sum over the rows
    for (i = 0; i < 2 * C; i++) want[i] = 0.5;
    for (j = 0; j < N; j++)
        for (i = 0; i < C; i++) {
            double d = dy[j * C + i];
            want[i] += d * (((double)x[j * C + i] - mean[j]) * rstd[j]), want[C + i] += d;
        }
    for (mask = full; mask >= 0; mask--) {  // every output first: the bits the others must give
        char what[96];
        for (t = 0; t < 2; t++) {
            float *dinp = mask & 1 ? dx[t] : NULL, *dw = mask & 2 ? pw[t] : NULL;
            SET_THREADS(threads[t]);
            for (i = 0; i < n; i++) dx[t][i] = (float)(i % 5) * 0.25f;  // added to
            for (i = 0; i < 2 * C; i++) pw[t][i] = 0.5f;
            if (rms) CHECK_OK(mn_rmsnorm_backward(dinp, dw, dy, x, w, rstd, N, C));
            else CHECK_OK(mn_layernorm_backward(dinp, dw, mask & 4 ? pw[t] + C : NULL, dy, x, w,
                                                mean, rstd, N, C));
        }
        snprintf(what, sizeof what, "%s backward C=%zu outputs %d, 1 vs 4 threads", op, C, mask);
        EXPECT_SAME(what, dx[0], dx[1], n);
        EXPECT_SAME(what, pw[0], pw[1], 2 * C);
        if (mask == full) {
            snprintf(what, sizeof what, "%s backward C=%zu dweight, dbias", op, C);
            CHECK_CLOSE_SCALED(what, pw[0], want, rms ? C : 2 * C, 3e-5);
            memcpy(all, pw[0], 2 * C * sizeof(float));
        }
        snprintf(what, sizeof what, "%s backward C=%zu outputs %d: dweight", op, C, mask);
        if (mask & 2) EXPECT_SAME(what, pw[0], all, C);
        else for (i = 0; i < C; i++) CHECK(pw[0][i] == 0.5f);
        snprintf(what, sizeof what, "%s backward C=%zu outputs %d: dbias", op, C, mask);
        if (mask & 4) EXPECT_SAME(what, pw[0] + C, all + C, C);
        else for (i = 0; i < C; i++) CHECK(pw[0][C + i] == 0.5f);
        if (!(mask & 1)) continue;
        for (k = 0; k < S; k++) {  // dx += r (g - mean(g) - xh mean(g xh)) (RMSNorm: no mean(g))
            const float *xr = x + rows[k] * C, *dyr = dy + rows[k] * C;
            float *got = dx[0] + rows[k] * C;
            double gm = 0.0, gxm = 0.0, m = mean[rows[k]], r = rstd[rows[k]];
            for (i = 0; i < C; i++) {
                g[i] = (double)w[i] * dyr[i], xh[i] = ((double)xr[i] - m) * r;
                gm += g[i], gxm += g[i] * xh[i];
            }
            gm = rms ? 0.0 : gm / (double)C, gxm /= (double)C;
            for (i = 0; i < C; i++)
                g[i] = (double)((rows[k] * C + i) % 5) * 0.25 + r * (g[i] - gm - xh[i] * gxm);
            snprintf(what, sizeof what, "%s backward C=%zu outputs %d: dinp row %zu", op, C,
                     mask, rows[k]);
            CHECK_CLOSE_SCALED(what, got, g, C, 2e-6);
            if (mask == full) memcpy(all + 2 * C + k * C, got, C * sizeof(float));
            else EXPECT_SAME(what, got, all + 2 * C + k * C, C);
        }
    }
#ifdef _OPENMP
    omp_set_num_threads(saved);
#endif
    for (t = 0; t < 2; t++) free(dx[t]), free(pw[t]);
    free(x), free(dy), free(w), free(mean), free(rstd), free(all), free(want), free(g), free(xh);
}
static void test_layernorm_backward_paths(void) { norm_backward_paths(0); }
static void test_rmsnorm_backward_paths(void) { norm_backward_paths(1); }

#undef SET_THREADS

// Bad arguments: every op refuses with MN_ERR_INVALID_ARG and leaves its outputs untouched;
// none asserts or crashes, with or without NDEBUG (make sanitize runs this under ASan both ways).
// NULL for a needed array, a zero width that divides, and shapes whose element counts overflow
// size_t (the arrays are never reached: the check comes first).
static void test_bad_arguments(void) {
    const size_t N = 1 + mnt_rand_u64() % 5, C = 2 * (1 + mnt_rand_u64() % 4), NH = 2;
    const size_t huge = (size_t)-1 / 2 + 1, big = (size_t)1 << (sizeof(size_t) * 4);
    float *x = mnt_fvec(3 * N * C * N), *w = mnt_fvec(C * C), *y = mnt_fvec(3 * N * C * N);
    float *m = mnt_fvec(N), *r = mnt_fvec(N), *keep = mnt_fvec(3 * N * C * N);
    uint16_t *h = (uint16_t *)calloc(N * C, sizeof *h);
    size_t i, n = 3 * N * C * N;
    mnt_fill_normal(x, n, 1.0);
    mnt_fill_normal(w, C * C, 1.0);
    mnt_fill_normal(y, n, 1.0);
    memcpy(keep, y, n * sizeof *y);
#define BAD(call) CHECK_ERR(call, MN_ERR_INVALID_ARG)
    BAD(mn_matmul_forward(NULL, NULL, x, w, NULL, N, C, C));
    BAD(mn_matmul_forward(y, NULL, NULL, w, NULL, N, C, C));
    BAD(mn_matmul_forward(y, NULL, x, NULL, NULL, N, C, C));
    BAD(mn_matmul_forward(y, NULL, x, w, NULL, huge, 4, C));
    BAD(mn_matmul_forward(y, NULL, x, w, NULL, big, big, C));
    BAD(mn_matmul_backward(y, NULL, NULL, NULL, x, w, NULL, N, C, C));
    BAD(mn_matmul_backward(y, NULL, NULL, x, x, NULL, NULL, N, C, C));  // dinp needs weight
    BAD(mn_matmul_backward(NULL, y, NULL, x, NULL, w, NULL, N, C, C));  // dweight needs inp
    BAD(mn_matmul_forward_typed(y, NULL, x, w, NULL, N, C, C, MN_INT8));  // not a matmul dtype
    BAD(mn_matmul_backward_typed(y, NULL, NULL, x, x, w, NULL, N, C, C, MN_DTYPE_COUNT));
    BAD(mn_layernorm_forward(y, m, r, x, w, NULL, N, 0, 1e-5f));
    BAD(mn_layernorm_forward(y, m, r, NULL, w, NULL, N, C, 1e-5f));
    BAD(mn_layernorm_forward(y, m, r, x, NULL, NULL, N, C, 1e-5f));
    BAD(mn_layernorm_forward(y, m, r, x, w, NULL, big, big, 1e-5f));
    BAD(mn_layernorm_backward(y, NULL, NULL, x, x, w, NULL, r, N, C));
    BAD(mn_layernorm_backward(y, NULL, NULL, x, x, NULL, m, r, N, C));
    BAD(mn_rmsnorm_forward(y, r, x, w, N, 0, 1e-5f));
    BAD(mn_rmsnorm_forward(NULL, r, x, w, N, C, 1e-5f));
    BAD(mn_rmsnorm_backward(y, NULL, x, x, w, NULL, N, C));
    BAD(mn_rmsnorm_backward(y, NULL, x, x, NULL, r, N, C));
    BAD(mn_softmax_forward(y, x, N, 0, 1.0f, 0));
    BAD(mn_softmax_forward(y, NULL, N, C, 1.0f, 1));
    BAD(mn_softmax_forward(y, x, huge, 4, 1.0f, 0));
    BAD(mn_softmax_backward(NULL, x, x, N, C, 1.0f, 0));
    BAD(mn_attention_forward(y, NULL, x, 1, N, C, 0, 1));
    BAD(mn_attention_forward(y, NULL, x, 1, N, C, C + 1, 1));  // heads do not divide C
    BAD(mn_attention_forward(y, NULL, x, 1, N, 0, NH, 1));
    BAD(mn_attention_forward(NULL, NULL, x, 1, N, C, NH, 1));
    BAD(mn_attention_forward(y, y, x, big, big, C, NH, 1));
    BAD(mn_attention_forward(y, y, x, 1, big, C, NH, 1));  // the [B,NH,T,T] probabilities
    BAD(mn_attention_backward(y, NULL, x, NULL, 1, N, C, NH, 1));
    BAD(mn_attention_backward(y, x, x, NULL, 1, N, C, C + 1, 0));
    BAD(mn_gelu_forward(NULL, x, n));
    BAD(mn_gelu_backward(y, NULL, x, n));
    BAD(mn_gelu_erf_forward(y, NULL, n));
    BAD(mn_gelu_erf_backward(y, x, NULL, n));
    BAD(mn_silu_forward(NULL, x, n));
    BAD(mn_silu_backward(y, x, NULL, n));
    BAD(mn_swiglu_forward(y, x, NULL, n));
    BAD(mn_swiglu_backward(y, y, NULL, x, x, n));
    BAD(mn_residual_forward(y, x, NULL, n));
    BAD(mn_residual_backward(y, y, NULL, n));
    BAD(mn_fp32_to_fp16_array(x, NULL, N * C));
    BAD(mn_fp16_to_fp32_array(NULL, y, N * C));
    BAD(mn_fp32_to_bf16_array(NULL, h, N * C));
    BAD(mn_bf16_to_fp32_array(h, NULL, N * C));
    {  // shapes whose offsets wrap: refused before any memory is read (ASan), nothing written
        const size_t q = (size_t)-1 / sizeof(float) + 1;  // elements whose bytes do not fit
        int tok[4] = {0, 0, 0, 0};
        uint8_t mk[4];
        BAD(mn_embedding_forward(y, tok, x, NULL, big, big, 1, 2));    // B*T wraps to 0
        BAD(mn_embedding_forward(y, tok, x, NULL, 1, 2, huge + 1, 2));  // V*C wraps to 2
        BAD(mn_embedding_forward(y, tok, x, NULL, huge + 1, 1, 2, 2));  // B*T*C wraps to 2
        BAD(mn_embedding_backward(y, NULL, x, tok, 1, 2, huge + 1, 2));
        BAD(mn_embedding_backward(y, NULL, x, tok, huge + 1, 1, 2, 2));
        BAD(mn_crossentropy_forward(m, NULL, x, tok, big, big));
        BAD(mn_crossentropy_forward(m, NULL, x, tok, huge + 1, 2));
        BAD(mn_crossentropy_backward(y, m, x, NULL, tok, 2, huge + 1));
        BAD(mn_gelu_forward(y, x, q));
        BAD(mn_gelu_forward(y, x, (size_t)-1));
        BAD(mn_gelu_backward(y, x, x, q));
        BAD(mn_gelu_erf_forward(y, x, q));
        BAD(mn_silu_forward(y, x, q));
        BAD(mn_swiglu_forward(y, x, x, q));
        BAD(mn_residual_forward(y, x, x, q));
        BAD(mn_fp32_to_bf16_array(x, h, q));
        BAD(mn_dropout_forward(y, NULL, x, q, 0.1f, 1, 0));
        BAD(mn_dropout_mask(mk, (size_t)-1, 0.1f, 1, 0));
    }
#undef BAD
    for (i = 0; i < n && memcmp(&y[i], &keep[i], sizeof *y) == 0; i++) continue;
    CHECK_MSG(i == n, "a refused op wrote its output at [%zu]", i);
    // empty shapes are fine and touch nothing; valid calls succeed
    CHECK_OK(mn_gelu_forward(NULL, NULL, 0));
    CHECK_OK(mn_residual_backward(NULL, NULL, NULL, 0));
    CHECK_OK(mn_matmul_forward(y, NULL, x, w, NULL, 0, C, C));
    CHECK_OK(mn_softmax_forward(y, x, N, C, 1.0f, 0));
    CHECK_OK(mn_attention_forward(y, NULL, x, 1, N, C, NH, 1));
    free(x), free(w), free(y), free(m), free(r), free(keep), free(h);
}

// In test/test_opsmath.c (the inline math of the ops, against libm in double).
void test_ops_expf_range(void);
void test_ops_exp_edge_inputs(void);
void test_ops_exp_vector_lanes(void);
void test_ops_reduce_vector_lanes(void);
void test_ops_row_pass(void);

const mnt_case test_ops_cases[] = {
    {"matmul", test_matmul},
    {"matmul_gelu_epilogue", test_matmul_gelu},
    {"matmul_blocked_shapes", test_matmul_blocked},
    {"matmul_odd_shapes", test_matmul_odd_shapes},
    {"matmul_16bit", test_matmul_16bit},
    {"matmul_16bit_values", test_matmul_16bit_values},
    {"matmul_dweight", test_matmul_dweight},
    {"matmul_forward_init", test_matmul_forward_init},
    {"layernorm", test_layernorm},
    {"rmsnorm", test_rmsnorm},
    {"softmax", test_softmax},
    {"attention", test_attention},
    {"elementwise", test_elementwise},
    {"activation_grid", test_activation_grid},
    {"expf_range", test_ops_expf_range},
    {"exp_edge_inputs", test_ops_exp_edge_inputs},
    {"exp_vector_lanes", test_ops_exp_vector_lanes},
    {"reduce_vector_lanes", test_ops_reduce_vector_lanes},
    {"row_pass", test_ops_row_pass},
    {"embedding", test_embedding},
    {"crossentropy", test_crossentropy},
    {"philox_known_answers", test_philox},
    {"dropout", test_dropout},
    {"thread_count_invariance", test_thread_invariance},
    {"thread_count_invariance_large", test_thread_invariance_large},
    {"thread_busy_core", test_thread_busy_core},
    {"streaming_stores", test_streaming_stores},
    {"streaming_rows", test_streaming_rows},
    {"layernorm_backward_paths", test_layernorm_backward_paths},
    {"rmsnorm_backward_paths", test_rmsnorm_backward_paths},
    {"bad_arguments", test_bad_arguments},
};
const size_t test_ops_count = sizeof test_ops_cases / sizeof test_ops_cases[0];
