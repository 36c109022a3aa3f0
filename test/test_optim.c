// Tests of the optim section. Every optimizer step is compared with a reference written here in
// double precision from the published formulas (torch.optim docs, transformers Adafactor,
// bitsandbytes, the Lion paper); conversions with an independent rounding (nearest value found
// by search over decoded tables); the loss scaler with hand-derived GradScaler sequences.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "../memanat.h"
#ifdef _OPENMP
#include <omp.h>
#endif

void test_optim_divc_bits(void);  // test_optimmath.c
void test_optim_team_tune(void);  // test_optimmath.c

// --- AdamW ---------------------------------------------------------------------------------------

// torch.optim.AdamW docs, algorithm box (the moment form, not the implementation's rearrangement).
typedef struct adam_ref {
    double lr, b1, b2, eps, wd;
    int amsgrad, maximize;
} adam_ref;

static void adamw_ref_step(const adam_ref *h, double *p, double *m, double *v, double *vmax,
                           const float *grad, uint64_t n, uint64_t t) {
    uint64_t i;
    for (i = 0; i < n; i++) {
        double g = h->maximize ? -(double)grad[i] : (double)grad[i], mhat, vhat;
        p[i] -= h->lr * h->wd * p[i];
        m[i] = h->b1 * m[i] + (1.0 - h->b1) * g;
        v[i] = h->b2 * v[i] + (1.0 - h->b2) * g * g;
        if (h->amsgrad) vmax[i] = v[i] > vmax[i] ? v[i] : vmax[i];
        mhat = m[i] / (1.0 - pow(h->b1, (double)t));
        vhat = (h->amsgrad ? vmax[i] : v[i]) / (1.0 - pow(h->b2, (double)t));
        p[i] -= h->lr * mhat / (sqrt(vhat) + h->eps);
    }
}

static void run_adamw_case(const mn_adamw_params *prm, double gscale, uint64_t n) {
    mn_adamw s;
    adam_ref h;
    float *p = mnt_fvec(n), *g = mnt_fvec(n);
    double *rp = mnt_dvec(n), *rm = mnt_dvec(n), *rv = mnt_dvec(n), *rvmax = mnt_dvec(n);
    uint64_t dims[1], k, t = 0;
    dims[0] = n;
    CHECK_OK(mn_adamw_init(&s, dims, 1, prm, NULL));
    h.lr = s.params.lr, h.b1 = s.params.beta1, h.b2 = s.params.beta2, h.eps = s.params.eps;
    h.wd = s.params.weight_decay, h.amsgrad = s.params.amsgrad, h.maximize = s.params.maximize;
    mnt_fill_normal(p, n, 1.0);
    mnt_to_double(p, rp, n);
    for (k = 0; k < 8; k++) {
        if (k == 4) s.step = 996, t = 996;  // jump to the bias corrections of steps 997..1000
        mnt_fill_normal(g, n, gscale);
        t++;
        CHECK_OK(mn_adamw_step(&s, p, g, NULL));
        CHECK_EQ_U64(s.step, t);
        adamw_ref_step(&h, rp, rm, rv, rvmax, g, n, t);
        CHECK_CLOSE("adamw param", p, rp, n, 1e-6, 2e-6);
        // m cancels towards 0: absolute tolerance in units of the gradient scale
        CHECK_CLOSE("adamw exp_avg", s.exp_avg, rm, n, 1e-6 * gscale, 1e-5);
        CHECK_CLOSE("adamw exp_avg_sq", s.exp_avg_sq, rv, n, 1e-6 * gscale * gscale, 1e-5);
        if (h.amsgrad)
            CHECK_CLOSE("adamw max_exp_avg_sq", s.max_exp_avg_sq, rvmax, n, 1e-6 * gscale * gscale,
                      1e-5);
    }
    mn_adamw_free(&s);
    free(p), free(g), free(rp), free(rm), free(rv), free(rvmax);
}

static void test_adamw_steps(void) {
    mn_adamw_params prm;
    memset(&prm, 0, sizeof prm);
    run_adamw_case(&prm, 1.0, 1037);  // torch defaults, weight decay 1e-2
    prm.lr = 1e-2f, prm.beta1 = 0.8f, prm.beta2 = 0.95f, prm.eps = 1e-3f, prm.weight_decay = 0.1f;
    run_adamw_case(&prm, 1e-3, 513);  // eps near sqrt(v_hat): checks that it sits outside the root
    prm.amsgrad = 1;
    run_adamw_case(&prm, 1e-2, 301);
    memset(&prm, 0, sizeof prm);
    // beta1 = 0 takes torch.lerp's second branch (weight 1)
    prm.maximize = 1, prm.weight_decay = MN_OPTIM_ZERO, prm.beta1 = MN_OPTIM_ZERO;
    run_adamw_case(&prm, 3.0, 77);
}

// Step 1 by hand: m_hat = g, v_hat = g^2, so θ1 = θ0 (1 − γλ) − γ g / (|g| + ε).
static void test_adamw_first_step_closed_form(void) {
    mn_adamw s;
    float p[5] = {1.0f, -2.0f, 0.5f, 3.0f, 0.0f}, g[5] = {0.5f, -1e-3f, 2.0f, 0.0f, -4.0f};
    double want[5];
    uint64_t dims[1] = {5};
    int i;
    for (i = 0; i < 5; i++)
        want[i] = p[i] * (1.0 - 1e-3 * 1e-2) - 1e-3 * g[i] / (fabs((double)g[i]) + 1e-8);
    CHECK_OK(mn_adamw_init(&s, dims, 1, NULL, NULL));
    CHECK_NEAR(s.params.weight_decay, 1e-2, 1e-9, 0);
    CHECK_OK(mn_adamw_step(&s, p, g, NULL));
    CHECK_CLOSE("adamw step 1", p, want, 5, 1e-7, 1e-6);
    mn_adamw_free(&s);
}

// A whole run of 1000 steps against the reference run alongside.
static void test_adamw_1000_steps(void) {
    enum { N = 64 };
    mn_adamw s;
    mn_adamw_params prm;
    adam_ref h;
    float p[N], g[N];
    double rp[N], rm[N] = {0}, rv[N] = {0};
    uint64_t dims[1] = {N}, t;
    memset(&prm, 0, sizeof prm);
    prm.lr = 1e-3f, prm.beta2 = 0.99f, prm.weight_decay = 0.05f;
    CHECK_OK(mn_adamw_init(&s, dims, 1, &prm, NULL));
    h.lr = s.params.lr, h.b1 = s.params.beta1, h.b2 = s.params.beta2, h.eps = s.params.eps;
    h.wd = s.params.weight_decay, h.amsgrad = 0, h.maximize = 0;
    mnt_fill_normal(p, N, 1.0);
    mnt_to_double(p, rp, N);
    for (t = 1; t <= 1000; t++) {
        int i;
        for (i = 0; i < N; i++) g[i] = (float)(0.3 * p[i] + mnt_rand_normal());  // noisy pull to 0
        CHECK_OK(mn_adamw_step(&s, p, g, NULL));
        adamw_ref_step(&h, rp, rm, rv, NULL, g, N, t);
    }
    CHECK_CLOSE("adamw after 1000 steps", p, rp, N, 2e-5, 2e-5);
    mn_adamw_free(&s);
}

// --- SGD -----------------------------------------------------------------------------------------

// torch.optim.SGD docs, algorithm box.
static void sgd_ref_step(const mn_sgd_params *h, double *p, double *b, const float *grad,
                         uint64_t n, uint64_t t) {
    uint64_t i;
    for (i = 0; i < n; i++) {
        double g = h->maximize ? -(double)grad[i] : (double)grad[i];
        g += (double)h->weight_decay * p[i];
        if (h->momentum != 0.0f) {
            b[i] = t == 1 ? g : (double)h->momentum * b[i] + (1.0 - (double)h->dampening) * g;
            g = h->nesterov ? g + (double)h->momentum * b[i] : b[i];
        }
        p[i] -= (double)h->lr * g;
    }
}

static void run_sgd_case(const mn_sgd_params *prm, uint64_t n, uint64_t want_bytes_per_elem) {
    mn_sgd s;
    float *p = mnt_fvec(n), *g = mnt_fvec(n);
    double *rp = mnt_dvec(n), *rb = mnt_dvec(n);
    uint64_t dims[1], t;
    dims[0] = n;
    CHECK_OK(mn_sgd_init(&s, dims, 1, prm, NULL));
    CHECK_EQ_U64(s.state_bytes, want_bytes_per_elem * n);
    mnt_fill_normal(p, n, 1.0);
    mnt_to_double(p, rp, n);
    for (t = 1; t <= 6; t++) {
        mnt_fill_normal(g, n, 1.0);
        CHECK_OK(mn_sgd_step(&s, p, g, NULL));
        sgd_ref_step(&s.params, rp, rb, g, n, t);
        CHECK_CLOSE("sgd param", p, rp, n, 1e-6, 1e-6);
        if (s.momentum_buffer)
            CHECK_CLOSE("sgd momentum_buffer", s.momentum_buffer, rb, n, 1e-6, 1e-6);
    }
    mn_sgd_free(&s);
    free(p), free(g), free(rp), free(rb);
}

static void test_sgd_steps(void) {
    mn_sgd_params prm;
    memset(&prm, 0, sizeof prm);
    run_sgd_case(&prm, 101, 0);  // plain SGD keeps no state
    prm.lr = 0.1f, prm.weight_decay = 0.01f;
    run_sgd_case(&prm, 257, 0);
    prm.momentum = 0.9f, prm.dampening = 0.1f;
    run_sgd_case(&prm, 999, 4);
    prm.dampening = 0.0f, prm.nesterov = 1;
    run_sgd_case(&prm, 33, 4);
    prm.maximize = 1, prm.weight_decay = 0.0f;
    run_sgd_case(&prm, 7, 4);
}

// Step 1 by hand: the momentum buffer starts as the gradient (no dampening on step 1).
static void test_sgd_first_step_closed_form(void) {
    mn_sgd s;
    mn_sgd_params prm;
    float p[3] = {1.0f, -1.0f, 2.0f}, g[3] = {0.5f, 0.25f, -1.0f};
    uint64_t dims[1] = {3};
    memset(&prm, 0, sizeof prm);
    prm.lr = 0.5f, prm.momentum = 0.5f, prm.dampening = 0.5f, prm.weight_decay = 0.5f;
    CHECK_OK(mn_sgd_init(&s, dims, 1, &prm, NULL));
    CHECK_OK(mn_sgd_step(&s, p, g, NULL));
    // g' = g + 0.5 p = {1, -0.25, 0}; b = g'; p -= 0.5 b
    CHECK_NEAR(s.momentum_buffer[0], 1.0, 0, 0);
    CHECK_NEAR(p[0], 0.5, 0, 0);
    CHECK_NEAR(p[1], -0.875, 0, 0);
    CHECK_NEAR(p[2], 2.0, 0, 0);
    g[0] = 1.0f, g[1] = 0.0f, g[2] = 0.0f;
    CHECK_OK(mn_sgd_step(&s, p, g, NULL));
    // g' = 1 + 0.25 = 1.25; b = 0.5*1 + 0.5*1.25 = 1.125; p = 0.5 - 0.5625
    CHECK_NEAR(s.momentum_buffer[0], 1.125, 0, 0);
    CHECK_NEAR(p[0], -0.0625, 0, 0);
    mn_sgd_free(&s);
}

// --- Adafactor -----------------------------------------------------------------------------------

// transformers Adafactor, written with the full V_hat = R C^T / mean(R) of the paper.
typedef struct af_ref {
    double lr, eps1, eps2, clip, decay, beta1, wd;
    int scale_param, warmup;
} af_ref;

static int adafactor_ref_step(const af_ref *h, double *p, double *R, double *C, double *V,
                              double *M, const float *grad, const uint64_t *dims, uint32_t ndim,
                              uint64_t t, double *u, double *alpha_out) {
    uint64_t n = 1, i, j, b, B = 1, r = 1, c, k;
    double ss = 0.0, rho, alpha, b2, rms_u, div;
    for (k = 0; k < ndim; k++) n *= dims[k];
    for (i = 0; i < n; i++) ss += p[i] * p[i];
    rho = h->lr > 0 ? h->lr : fmin(h->warmup ? 1e-6 * (double)t : 1e-2, 1.0 / sqrt((double)t));
    alpha = h->scale_param ? fmax(h->eps2, sqrt(ss / (double)n)) * rho : rho;
    b2 = 1.0 - pow((double)t, h->decay);
    *alpha_out = alpha;
    c = dims[ndim - 1];
    if (ndim >= 2) {
        r = dims[ndim - 2];
        B = n / (r * c);
        for (b = 0; b < B; b++) {
            const float *gb = grad + b * r * c;
            double meanR = 0.0;
            for (i = 0; i < r; i++) {
                double s = 0.0;
                for (j = 0; j < c; j++) s += (double)gb[i * c + j] * gb[i * c + j] + h->eps1;
                R[b * r + i] = b2 * R[b * r + i] + (1.0 - b2) * s / (double)c;
            }
            for (j = 0; j < c; j++) {
                double s = 0.0;
                for (i = 0; i < r; i++) s += (double)gb[i * c + j] * gb[i * c + j] + h->eps1;
                C[b * c + j] = b2 * C[b * c + j] + (1.0 - b2) * s / (double)r;
            }
            for (i = 0; i < r; i++) meanR += R[b * r + i] / (double)r;
            for (i = 0; i < r; i++)
                for (j = 0; j < c; j++) {
                    double vhat = R[b * r + i] * C[b * c + j] / meanR;
                    u[b * r * c + i * c + j] = gb[i * c + j] / sqrt(vhat);
                }
        }
    } else {
        for (i = 0; i < n; i++) {
            V[i] = b2 * V[i] + (1.0 - b2) * ((double)grad[i] * grad[i] + h->eps1);
            u[i] = grad[i] / sqrt(V[i]);
        }
    }
    for (ss = 0.0, i = 0; i < n; i++) ss += u[i] * u[i];
    rms_u = sqrt(ss / (double)n);
    div = fmax(1.0, rms_u / h->clip);
    for (i = 0; i < n; i++) {
        double upd = u[i] / div * alpha;
        if (h->beta1 > 0) upd = M[i] = h->beta1 * M[i] + (1.0 - h->beta1) * upd;
        p[i] -= h->wd * alpha * p[i];
        p[i] -= upd;
    }
    return div > 1.0;
}

static void run_adafactor_case(const mn_adafactor_params *prm, const uint64_t *dims, uint32_t ndim,
                               int want_clipped) {
    mn_adafactor s;
    af_ref h;
    uint64_t n = 1, k, t = 0, nr, nc, j, bad = 0;
    float *p, *g;
    double *rp, *R, *C, *V, *M, *u, *p0, alpha;
    int clipped = 0;
    for (k = 0; k < ndim; k++) n *= dims[k];
    nr = ndim >= 2 ? n / dims[ndim - 1] : 1;
    nc = ndim >= 2 ? n / dims[ndim - 2] : 1;
    p = mnt_fvec(n), g = mnt_fvec(n);
    rp = mnt_dvec(n), R = mnt_dvec(nr), C = mnt_dvec(nc), V = mnt_dvec(n), M = mnt_dvec(n);
    u = mnt_dvec(n), p0 = mnt_dvec(n);
    CHECK_OK(mn_adafactor_init(&s, dims, ndim, prm, NULL));
    CHECK_EQ_INT(s.factored, ndim >= 2);
    h.lr = s.params.lr, h.eps1 = s.params.eps1, h.eps2 = s.params.eps2;
    h.clip = s.params.clip_threshold;
    h.decay = s.params.decay_rate, h.beta1 = s.params.beta1, h.wd = s.params.weight_decay;
    h.scale_param = !s.params.no_scale_parameter, h.warmup = s.params.warmup_init;
    mnt_fill_normal(p, n, 0.5);
    mnt_to_double(p, rp, n);
    for (k = 0; k < 7; k++) {
        if (k == 4) s.step = 997, t = 997;  // steps 998..1000
        mnt_fill_normal(g, n, 1.0);
        if (k == 1) g[0] = 0.0f;  // a zero gradient: only eps1 keeps the moments positive
        t++;
        mnt_to_double(p, p0, n);
        CHECK_OK(mn_adafactor_step(&s, p, g, NULL));
        clipped |= adafactor_ref_step(&h, rp, R, C, V, M, g, dims, ndim, t, u, &alpha);
        CHECK_NEAR(s.alpha, alpha, 0, 1e-6);
        for (j = 0; j < n; j++) {  // the update, to two fp32 ulps of the parameter
            double got = (double)p[j] - p0[j], want = rp[j] - p0[j];
            rp[j] = p[j];  // continue from the same parameters
            double ulps = 2.5e-7 * fmax(fabs(p0[j]), fabs((double)p[j]));  // two fp32 roundings
            // (exp_avg cancels towards 0: the last term is relative to the step size alpha)
            if (!(fabs(got - want) <= ulps + 2e-6 * fabs(want) + 1e-6 * alpha)) bad++;
        }
        CHECK_MSG(bad == 0, "adafactor step %llu: %llu updates off", (unsigned long long)t,
                  (unsigned long long)bad);
        if (s.factored) {
            CHECK_CLOSE("adafactor row", s.exp_avg_sq_row, R, nr, 1e-30, 1e-5);
            CHECK_CLOSE("adafactor col", s.exp_avg_sq_col, C, nc, 1e-30, 1e-5);
        } else {
            CHECK_CLOSE("adafactor exp_avg_sq", s.exp_avg_sq, V, n, 1e-30, 1e-5);
        }
        if (s.exp_avg) CHECK_CLOSE("adafactor exp_avg", s.exp_avg, M, n, 1e-8, 1e-5);
    }
    if (want_clipped >= 0) CHECK_EQ_INT(clipped, want_clipped);
    mn_adafactor_free(&s);
    free(p), free(g), free(rp), free(R), free(C), free(V), free(M), free(u), free(p0);
}

static void test_adafactor_steps(void) {
    mn_adafactor_params prm;
    uint64_t mat[2] = {7, 13}, cube[3] = {2, 5, 6}, vec[1] = {37}, tall[2] = {65, 3};
    memset(&prm, 0, sizeof prm);
    run_adafactor_case(&prm, mat, 2, -1);   // transformers defaults: relative step, parameter scale
    prm.clip_threshold = 0.25f, prm.weight_decay = 0.1f;
    run_adafactor_case(&prm, tall, 2, 1);   // update clipping active, decay scaled by alpha_t
    memset(&prm, 0, sizeof prm);
    prm.lr = 1e-2f, prm.no_scale_parameter = 1, prm.beta1 = 0.9f, prm.weight_decay = 0.01f;
    run_adafactor_case(&prm, cube, 3, -1);  // HF fine-tuning setting plus first moment and decay
    memset(&prm, 0, sizeof prm);
    prm.warmup_init = 1;
    run_adafactor_case(&prm, vec, 1, -1);   // unfactored, warmup relative step 1e-6 t
}

// --- Lion ----------------------------------------------------------------------------------------

static void test_lion_steps(void) {
    enum { N = 1001 };
    mn_lion s;
    mn_lion_params prm;
    float p[N], g[N];
    double rp[N], rm[N] = {0};
    uint64_t dims[2] = {7, 143}, t;
    int i;
    memset(&prm, 0, sizeof prm);
    prm.lr = 3e-4f, prm.weight_decay = 0.1f;
    CHECK_OK(mn_lion_init(&s, dims, 2, &prm, NULL));
    CHECK_NEAR(s.params.beta1, 0.9, 1e-7, 0);
    CHECK_NEAR(s.params.beta2, 0.99, 1e-7, 0);
    mnt_fill_normal(p, N, 1.0);
    mnt_to_double(p, rp, N);
    for (t = 1; t <= 5; t++) {
        mnt_fill_normal(g, N, 1.0);
        if (t == 1) g[3] = 0.0f;  // sign(0) = 0: no move but the decay
        CHECK_OK(mn_lion_step(&s, p, g, NULL));
        for (i = 0; i < N; i++) {  // Chen et al. 2023, Algorithm 2
            double c = 0.9 * rm[i] + 0.1 * g[i], sg = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
            double scale = fabs(rm[i]) + fabs((double)g[i]);
            rp[i] = rp[i] - 3e-4 * (sg + 0.1 * rp[i]);
            rm[i] = 0.99 * rm[i] + 0.01 * g[i];
            if (fabs(c) < 1e-6 * scale && c != 0) rp[i] = p[i];  // sign too close to call
        }
        CHECK_CLOSE("lion param", p, rp, N, 1e-6, 1e-6);
        CHECK_CLOSE("lion exp_avg", s.exp_avg, rm, N, 1e-7, 1e-5);
    }
    mn_lion_free(&s);
}

// --- 8-bit AdamW ---------------------------------------------------------------------------------

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// bitsandbytes functional.create_dynamic_map(signed, 7, 8), literally, in double.
static void ref_dynamic_map(int is_signed, double *out) {
    int i, k, cnt = 0;
    for (i = 0; i < 7; i++) {
        int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
        for (k = 0; k + 1 < items; k++) {
            double b0 = 0.1 + 0.9 * k / (items - 1), b1 = 0.1 + 0.9 * (k + 1) / (items - 1);
            double v = pow(10.0, i - 6) * (b0 + b1) / 2.0;
            out[cnt++] = v;
            if (is_signed) out[cnt++] = -v;
        }
    }
    out[cnt++] = 0.0;
    out[cnt++] = 1.0;
    CHECK_EQ_INT(cnt, 256);
    qsort(out, 256, sizeof(double), cmp_double);
}

static void test_dynamic_map(void) {
    float map[256];
    double ref[256];
    int s, i, neg, zero;
    for (s = 0; s < 2; s++) {
        mn_dynamic_map(s, map);
        ref_dynamic_map(s, ref);
        for (i = 0; i < 256; i++) CHECK_NEAR(map[i], ref[i], 0, 1e-6);
        for (i = 1; i < 256; i++) CHECK(map[i] > map[i - 1]);
        for (neg = 0, zero = 0, i = 0; i < 256; i++) neg += map[i] < 0, zero += map[i] == 0;
        CHECK_EQ_INT(neg, s ? 127 : 0);
        CHECK_EQ_INT(zero, 1);
        CHECK_NEAR(map[255], 1.0, 0, 0);
        CHECK_NEAR(map[s ? 128 : 1], s ? 5.5e-7 : 3.25e-7, 1e-13, 0);  // smallest magnitudes
        if (s) CHECK_NEAR(map[0], -map[254], 0, 0);
    }
}

// Distance between the map entries around y (the spacing that bounds the rounding error). Outside
// the map (the signed map ends at -0.993 but +1) twice the distance to the end entry.
static double map_gap(const float *map, double y) {
    int i;
    if (y <= map[0]) return 2.0 * ((double)map[0] - y);
    for (i = 1; i < 256; i++)
        if (y <= map[i]) return (double)map[i] - map[i - 1];
    return 2.0 * (y - (double)map[255]);
}

static void test_quantize_blockwise(void) {
    static const uint32_t blocks[3] = {64, 256, 2048};
    enum { N = 10007 };
    float map[256], *x = mnt_fvec(N), *y = mnt_fvec(N), absmax[N / 64 + 1];
    uint8_t *codes = (uint8_t *)malloc(N);
    double worst = 0.0, max_half_gap = 0.0;
    int bi, s, i;
    uint64_t k;
    for (s = 0; s < 2; s++) {
        mn_dynamic_map(s, map);
        for (i = 1; i < 256; i++)
            max_half_gap = fmax(max_half_gap, 0.5 * ((double)map[i] - map[i - 1]));
        for (bi = 0; bi < 3; bi++) {
            uint32_t B = blocks[bi];
            uint64_t nb = (N + B - 1) / B, b;
            for (b = 0; b < nb; b++) {  // every block at its own scale, one block all zero
                double scale = pow(10.0, -8.0 + 11.0 * mnt_rand_uniform());
                for (k = b * B; k < (b + 1) * B && k < N; k++) {
                    double v = b == 1 ? 0.0 : mnt_rand_normal() * scale;
                    x[k] = (float)(s ? v : fabs(v));
                    if (mnt_rand_uniform() < 0.01) x[k] = 0.0f;
                }
            }
            CHECK_OK(mn_quantize_blockwise(map, x, N, B, codes, absmax));
            CHECK_OK(mn_dequantize_blockwise(map, codes, absmax, N, B, y));
            for (b = 0; b < nb; b++) {
                float am = 0.0f;
                for (k = b * B; k < (b + 1) * B && k < N; k++) am = fmaxf(am, fabsf(x[k]));
                CHECK_NEAR(absmax[b], am, 0, 0);
            }
            for (k = 0; k < N; k++) {
                double am = absmax[k / B], yn = am > 0 ? x[k] / am : 0.0, best = 1e300;
                double err = fabs((double)y[k] - x[k]);
                int j;
                CHECK_NEAR(y[k], (double)map[codes[k]] * am, 0, 1e-7);
                // error within half the local spacing of the map, in units of the block absmax
                CHECK_MSG(err <= (0.5 * map_gap(map, yn) + 1e-6) * am, "x %.9g y %.9g absmax %.9g",
                          (double)x[k], (double)y[k], am);
                // and the code is the nearest entry (brute force over the map)
                for (j = 0; j < 256; j++) best = fmin(best, fabs((double)map[j] - yn));
                CHECK_MSG(fabs((double)map[codes[k]] - yn) <= best + 1e-6, "code %d not nearest",
                          codes[k]);
                if (am > 0) worst = fmax(worst, err / am);
            }
        }
    }
    // overall: |deq - x| <= absmax * max half spacing (about 0.0070 for the top of the map)
    CHECK(worst <= max_half_gap + 1e-6);
    CHECK(max_half_gap < 0.0071);
    CHECK_ERR(mn_quantize_blockwise(map, x, N, 0, codes, absmax), MN_ERR_INVALID_ARG);
    free(x), free(y), free(codes);
}

// bitsandbytes 8-bit blockwise Adam, one step in double from the dequantized state.
static void adam8_ref_step(const mn_adamw8bit_params *h, double *p, double *m, double *v,
                           const float *g, uint64_t n, uint64_t t) {
    double c1 = 1.0 - pow(h->beta1, (double)t), c2 = sqrt(1.0 - pow(h->beta2, (double)t));
    uint64_t i;
    for (i = 0; i < n; i++) {
        if (!isfinite(g[i])) {
            m[i] = v[i] = 0.0;
            continue;
        }
        m[i] = h->beta1 * m[i] + (1.0 - h->beta1) * g[i];
        v[i] = h->beta2 * v[i] + (1.0 - h->beta2) * (double)g[i] * g[i];
        p[i] += -(double)h->lr * c2 / c1 * m[i] / (sqrt(v[i]) + (double)h->eps * c2);
        p[i] *= 1.0 - (double)h->lr * h->weight_decay;
    }
}

static void test_adamw8bit_steps(void) {
    enum { N = 5000 };  // 19 full blocks of 256 and one of 136
    mn_adamw8bit s;
    float *p = mnt_fvec(N), *g = mnt_fvec(N);
    double *rp = mnt_dvec(N), *rm = mnt_dvec(N), *rv = mnt_dvec(N), m1[256], m2[256];
    float map1[256], map2[256];
    uint64_t dims[2] = {40, 125}, t = 0, i, b;
    int k;
    ref_dynamic_map(1, m1);
    ref_dynamic_map(0, m2);
    mn_dynamic_map(1, map1);
    mn_dynamic_map(0, map2);
    CHECK_OK(mn_adamw8bit_init(&s, dims, 2, NULL, NULL));
    CHECK(s.quantized);
    CHECK_EQ_U64(s.blocks, 20);
    CHECK_NEAR(s.params.weight_decay, 1e-2, 1e-9, 0);
    mnt_fill_normal(p, N, 1.0);
    mnt_to_double(p, rp, N);
    for (k = 0; k < 6; k++) {
        if (k == 3) s.step = 997, t = 997;  // steps 998..1000
        mnt_fill_normal(g, N, 1.0);
        if (k == 2) g[5] = INFINITY, g[4000] = NAN;
        for (i = 0; i < N; i++) {  // the reference starts from the dequantized state
            rm[i] = m1[s.code1[i]] * s.absmax1[i / 256];
            rv[i] = m2[s.code2[i]] * s.absmax2[i / 256];
        }
        t++;
        CHECK_OK(mn_adamw8bit_step(&s, p, g, NULL));
        adam8_ref_step(&s.params, rp, rm, rv, g, N, t);
        CHECK_CLOSE("adamw8bit param", p, rp, N, 1e-6, 5e-7);
        for (b = 0; b < s.blocks; b++) {
            double a1 = 0, a2 = 0;
            for (i = b * 256; i < (b + 1) * 256 && i < N; i++)
                a1 = fmax(a1, fabs(rm[i])), a2 = fmax(a2, rv[i]);
            CHECK_NEAR(s.absmax1[b], a1, 0, 1e-5);
            CHECK_NEAR(s.absmax2[b], a2, 0, 1e-5);
        }
        for (i = 0; i < N; i++) {
            double a1 = s.absmax1[i / 256], a2 = s.absmax2[i / 256];
            double q1 = map1[s.code1[i]] * a1, q2 = map2[s.code2[i]] * a2;
            // m: the sign is kept, so up to one full spacing; v: nearest, half a spacing
            CHECK_MSG(fabs(q1 - rm[i]) <= (map_gap(map1, rm[i] / a1) + 1e-5) * a1,
                      "m[%llu] %.9g vs %.9g", (unsigned long long)i, q1, rm[i]);
            CHECK_MSG(fabs(q2 - rv[i]) <= (0.5 * map_gap(map2, rv[i] / a2) + 1e-5) * a2,
                      "v[%llu] %.9g vs %.9g", (unsigned long long)i, q2, rv[i]);
            if (rm[i] < -1e-5 * a1) CHECK(q1 < 0);
            if (rm[i] > 1e-5 * a1) CHECK(q1 > 0);
        }
        if (k == 2) {
            // a non-finite gradient resets m and v
            CHECK_NEAR(map1[s.code1[5]] * s.absmax1[0], 0.0, 0, 0);
            CHECK_NEAR(map2[s.code2[4000]] * s.absmax2[4000 / 256], 0.0, 0, 0);
        }
        mnt_to_double(p, rp, N);  // keep the reference on the same parameters
    }
    mn_adamw8bit_free(&s);
    free(p), free(g), free(rp), free(rm), free(rv);
}

// A tiny negative m keeps its sign (bitsandbytes forces the code's sign); a tiny positive one may
// round to 0. One block with absmax(m) = 1 after step 1.
static void test_adamw8bit_keeps_sign(void) {
    enum { N = 4096 };
    mn_adamw8bit s;
    float *p = mnt_fvec(N), *g = mnt_fvec(N), map1[256];
    uint64_t dims[1] = {N};
    mn_dynamic_map(1, map1);
    CHECK_OK(mn_adamw8bit_init(&s, dims, 1, NULL, NULL));
    g[0] = 10.0f;     // m = 1
    g[1] = -1e-6f;    // m = -1e-7: nearest entry is 0, the sign rule moves it to -5.5e-7
    g[2] = 1e-6f;     // m = 1e-7: rounds to 0
    g[3] = -4e-6f;    // m = -4e-7: nearest is -5.5e-7 already
    CHECK_OK(mn_adamw8bit_step(&s, p, g, NULL));
    CHECK_NEAR(s.absmax1[0], 1.0, 0, 1e-6);
    CHECK_NEAR(map1[s.code1[0]], 1.0, 0, 0);
    CHECK_NEAR(map1[s.code1[1]], -5.5e-7, 1e-12, 0);
    CHECK_NEAR(map1[s.code1[2]], 0.0, 0, 0);
    CHECK_NEAR(map1[s.code1[3]], -5.5e-7, 1e-12, 0);
    CHECK_NEAR(map1[s.code1[4]], 0.0, 0, 0);
    mn_adamw8bit_free(&s);
    free(p), free(g);
}

// Tensors below min_8bit_size keep fp32 state with the same (bitsandbytes) update.
static void test_adamw8bit_small_tensor(void) {
    enum { N = 1000 };
    mn_adamw8bit s;
    mn_adamw8bit_params prm;
    float p[N], g[N];
    double rp[N], rm[N] = {0}, rv[N] = {0};
    uint64_t dims[1] = {N}, t = 0;
    int k;
    memset(&prm, 0, sizeof prm);
    prm.lr = 1e-2f, prm.weight_decay = 0.1f;
    CHECK_OK(mn_adamw8bit_init(&s, dims, 1, &prm, NULL));
    CHECK(!s.quantized);
    CHECK_EQ_U64(s.state_bytes, 8 * N);
    mnt_fill_normal(p, N, 1.0);
    mnt_to_double(p, rp, N);
    for (k = 0; k < 5; k++) {
        if (k == 3) s.step = 998, t = 998;
        mnt_fill_normal(g, N, 1.0);
        t++;
        CHECK_OK(mn_adamw8bit_step(&s, p, g, NULL));
        adam8_ref_step(&s.params, rp, rm, rv, g, N, t);
        CHECK_CLOSE("adamw8bit small param", p, rp, N, 1e-6, 1e-6);
        CHECK_CLOSE("adamw8bit small exp_avg_sq", s.exp_avg_sq, rv, N, 1e-9, 1e-5);
    }
    mn_adamw8bit_free(&s);
}

// Stochastic least squares: min ½ E‖(W − W*) x‖² over the rows x of X, W [64 x 64] (4096
// elements: the 8-bit path), minibatches of 32 rows, gradient (W − W*) X_b^T X_b / 32. 400 steps
// from W = 0 with a linearly decaying step size; both optimizers see the same minibatches.
// Minibatch noise matters: with full-batch gradients an element whose gradient is tiny two steps
// running can take a huge step in 8-bit (its v, below ~1.6e-7 of the block absmax, is stored as 0
// and the next v is tiny again); about 1% of seeds showed that, as bitsandbytes would.
enum { LSQ_D = 64, LSQ_ROWS = 512, LSQ_BATCH = 32, LSQ_STEPS = 400 };

static double lsq_run(int eight_bit, const double *X, const double *Wstar, const int *batches) {
    enum { D = LSQ_D };
    mn_adamw s32;
    mn_adamw8bit s8;
    mn_adamw_params p32;
    mn_adamw8bit_params p8;
    float *W = mnt_fvec(D * D), *G = mnt_fvec(D * D);
    double *E = mnt_dvec(D * D), y[LSQ_D], err = 0.0, norm = 0.0;
    uint64_t dims[2] = {D, D};
    int t, o, i, b;
    memset(&s32, 0, sizeof s32);
    memset(&s8, 0, sizeof s8);
    memset(&p32, 0, sizeof p32);
    memset(&p8, 0, sizeof p8);
    p32.lr = p8.lr = 0.02f;
    p32.weight_decay = p8.weight_decay = MN_OPTIM_ZERO;
    if (eight_bit) CHECK_OK(mn_adamw8bit_init(&s8, dims, 2, &p8, NULL));
    else CHECK_OK(mn_adamw_init(&s32, dims, 2, &p32, NULL));
    if (eight_bit) CHECK(s8.quantized);
    for (t = 0; t < LSQ_STEPS; t++) {
        float lr = 0.02f * (1.0f - (float)t / LSQ_STEPS);
        for (i = 0; i < D * D; i++) E[i] = (double)W[i] - Wstar[i], G[i] = 0.0f;
        for (b = 0; b < LSQ_BATCH; b++) {
            const double *x = X + batches[t * LSQ_BATCH + b] * D;
            for (o = 0; o < D; o++) {  // y = E x, G += y x^T / batch
                double acc = 0.0;
                for (i = 0; i < D; i++) acc += E[o * D + i] * x[i];
                y[o] = acc / LSQ_BATCH;
            }
            for (o = 0; o < D; o++)
                for (i = 0; i < D; i++) G[o * D + i] += (float)(y[o] * x[i]);
        }
        if (eight_bit) {
            s8.params.lr = lr;
            CHECK_OK(mn_adamw8bit_step(&s8, W, G, NULL));
        } else {
            s32.params.lr = lr;
            CHECK_OK(mn_adamw_step(&s32, W, G, NULL));
        }
    }
    for (i = 0; i < D * D; i++)
        err += (W[i] - Wstar[i]) * (W[i] - Wstar[i]), norm += Wstar[i] * Wstar[i];
    if (eight_bit) mn_adamw8bit_free(&s8);
    else mn_adamw_free(&s32);
    free(W), free(G), free(E);
    return sqrt(err / norm);
}

static void test_adamw8bit_converges(void) {
    double *X = mnt_dvec(LSQ_ROWS * LSQ_D), *Wstar = mnt_dvec(LSQ_D * LSQ_D), e32, e8;
    int *batches = (int *)malloc(LSQ_STEPS * LSQ_BATCH * sizeof(int)), i;
    for (i = 0; i < LSQ_ROWS * LSQ_D; i++) X[i] = mnt_rand_normal();
    for (i = 0; i < LSQ_D * LSQ_D; i++) Wstar[i] = mnt_rand_normal() * 0.5;
    for (i = 0; i < LSQ_STEPS * LSQ_BATCH; i++) batches[i] = (int)(mnt_rand_u64() % LSQ_ROWS);
    e32 = lsq_run(0, X, Wstar, batches);
    e8 = lsq_run(1, X, Wstar, batches);
    // From a relative error of 1 at W = 0, both reach < 2% (means over 300 seeds: 0.48% and
    // 0.57%, largest 8-bit 1.06%), and 8-bit ends within 1.5x + 0.2% of 32-bit (largest ratio
    // seen 1.32).
    CHECK_MSG(e32 < 0.02, "32-bit AdamW relative error %.4g", e32);
    CHECK_MSG(e8 < 0.02, "8-bit AdamW relative error %.4g", e8);
    CHECK_MSG(e8 <= 1.5 * e32 + 0.002, "8-bit %.4g vs 32-bit %.4g", e8, e32);
    free(X), free(Wstar), free(batches);
}

// --- 16-bit parameters with fp32 master copies ---------------------------------------------------

static void test_half_params(void) {
    enum { N = 4099 };
    static const mn_dtype dts[2] = {MN_FP16, MN_BF16};
    float *p = mnt_fvec(N), *g = mnt_fvec(N);
    uint16_t *h = (uint16_t *)malloc(N * sizeof(uint16_t));
    uint64_t dims[2] = {1, N}, i;
    int d, o, bad;
    for (d = 0; d < 2; d++) {
        for (o = 0; o < 5; o++) {
            mn_dtype dt = dts[d];
            mn_sgd sg; mn_adamw aw; mn_adamw8bit a8; mn_adafactor af; mn_lion li;
            mn_sgd_params psg; mn_adamw_params paw; mn_adamw8bit_params pa8;
            mn_adafactor_params paf; mn_lion_params pli;
            mn_result r = MN_OK, r2 = MN_OK;
            memset(&psg, 0, sizeof psg), memset(&paw, 0, sizeof paw), memset(&pa8, 0, sizeof pa8);
            memset(&paf, 0, sizeof paf), memset(&pli, 0, sizeof pli);
            psg.dtype = paw.dtype = pa8.dtype = paf.dtype = pli.dtype = dt;
            psg.momentum = 0.9f;
            mnt_fill_normal(p, N, 1.0);
            mnt_fill_normal(g, N, 1.0);
            memset(h, 0, N * sizeof(uint16_t));
            switch (o) {
            case 0: CHECK_OK(mn_sgd_init(&sg, dims, 2, &psg, NULL));
                r2 = mn_sgd_step(&sg, p, g, NULL), r = mn_sgd_step(&sg, p, g, h);
                mn_sgd_free(&sg); break;
            case 1: CHECK_OK(mn_adamw_init(&aw, dims, 2, &paw, NULL));
                r2 = mn_adamw_step(&aw, p, g, NULL), r = mn_adamw_step(&aw, p, g, h);
                mn_adamw_free(&aw); break;
            case 2: CHECK_OK(mn_adamw8bit_init(&a8, dims, 2, &pa8, NULL));
                r2 = mn_adamw8bit_step(&a8, p, g, NULL), r = mn_adamw8bit_step(&a8, p, g, h);
                mn_adamw8bit_free(&a8); break;
            case 3: CHECK_OK(mn_adafactor_init(&af, dims, 2, &paf, NULL));
                r2 = mn_adafactor_step(&af, p, g, NULL), r = mn_adafactor_step(&af, p, g, h);
                mn_adafactor_free(&af); break;
            default: CHECK_OK(mn_lion_init(&li, dims, 2, &pli, NULL));
                r2 = mn_lion_step(&li, p, g, NULL), r = mn_lion_step(&li, p, g, h);
                mn_lion_free(&li); break;
            }
            CHECK_ERR(r2, MN_ERR_INVALID_ARG);  // a 16-bit model needs its 16-bit tensor
            CHECK_OK(r);
            for (bad = 0, i = 0; i < N; i++)
                bad += h[i] != (dt == MN_FP16 ? mn_fp32_to_fp16(p[i]) : mn_fp32_to_bf16(p[i]));
            CHECK_MSG(bad == 0, "optimizer %d dtype %d: %d 16-bit copies differ from the master",
                      o, (int)dt, bad);
        }
    }
    free(p), free(g), free(h);
}

// --- state sizes, allocation, arguments ----------------------------------------------------------

static void test_state_bytes_match_allocation(void) {
    static const uint64_t shapes[][4] = {
        {1, 1}, {1, 7}, {1, 4095}, {1, 4096}, {1, 4097}, {2, 3, 5}, {2, 64, 64}, {3, 2, 3, 5},
        {2, 1, 4096}, {2, 4096, 1}, {2, 17, 257}, {3, 2, 2, 1031}, {2, 1000, 3}, {1, 70001},
    };
    size_t k;
    for (k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const uint64_t *dims = shapes[k] + 1;
        uint32_t nd = (uint32_t)shapes[k][0];
        uint64_t want, want2;
        mnt_counting c;
        mn_allocator a;
        mn_optim_desc d;
        int v;
        for (v = 0; v < 2; v++) {  // SGD without / with momentum
            mn_sgd s; mn_sgd_params prm;
            memset(&prm, 0, sizeof prm);
            prm.momentum = v ? 0.9f : 0.0f;
            a = mnt_counting_allocator(&c);
            CHECK_OK(mn_sgd_init(&s, dims, nd, &prm, &a));
            CHECK_OK(mn_sgd_state_bytes(dims, nd, v, &want));
            memset(&d, 0, sizeof d), d.kind = v ? MN_OPTIM_SGD_MOMENTUM : MN_OPTIM_SGD;
            CHECK_OK(mn_optim_state_bytes(&d, dims, nd, &want2));
            CHECK_EQ_U64(c.bytes, want);
            CHECK_EQ_U64(want2, want);
            CHECK_EQ_U64(s.state_bytes, want);
            CHECK_EQ_INT(c.allocs, want ? 1 : 0);
            mn_sgd_free(&s);
        }
        for (v = 0; v < 2; v++) {  // AdamW, plain and amsgrad
            mn_adamw s; mn_adamw_params prm;
            memset(&prm, 0, sizeof prm);
            prm.amsgrad = v;
            a = mnt_counting_allocator(&c);
            CHECK_OK(mn_adamw_init(&s, dims, nd, &prm, &a));
            memset(&d, 0, sizeof d), d.kind = MN_OPTIM_ADAMW, d.amsgrad = v;
            CHECK_OK(mn_optim_state_bytes(&d, dims, nd, &want));
            CHECK_OK(mn_adamw_state_bytes(dims, nd, &want2));
            CHECK_EQ_U64(c.bytes, want);
            CHECK_EQ_U64(s.state_bytes, want);
            CHECK_EQ_U64(want, v ? want2 / 2 * 3 : want2);
            mn_adamw_free(&s);
        }
        for (v = 0; v < 3; v++) {  // 8-bit: defaults, block 64, min_8bit_size 100
            mn_adamw8bit s; mn_adamw8bit_params prm;
            memset(&prm, 0, sizeof prm);
            if (v == 1) prm.block_size = 64;
            if (v == 2) prm.min_8bit_size = 100, prm.block_size = 2048;
            a = mnt_counting_allocator(&c);
            CHECK_OK(mn_adamw8bit_init(&s, dims, nd, &prm, &a));
            CHECK_OK(mn_adamw8bit_state_bytes(dims, nd, prm.block_size, prm.min_8bit_size, &want));
            memset(&d, 0, sizeof d), d.kind = MN_OPTIM_ADAMW_8BIT;
            d.block_size = prm.block_size, d.min_8bit_size = prm.min_8bit_size;
            CHECK_OK(mn_optim_state_bytes(&d, dims, nd, &want2));
            CHECK_EQ_U64(c.bytes, want);
            CHECK_EQ_U64(want2, want);
            CHECK_EQ_U64(s.state_bytes, want);
            mn_adamw8bit_free(&s);
        }
        for (v = 0; v < 2; v++) {  // Adafactor without / with first moment
            mn_adafactor s; mn_adafactor_params prm;
            memset(&prm, 0, sizeof prm);
            prm.beta1 = v ? 0.9f : 0.0f;
            a = mnt_counting_allocator(&c);
            CHECK_OK(mn_adafactor_init(&s, dims, nd, &prm, &a));
            CHECK_OK(mn_adafactor_state_bytes(dims, nd, v, &want));
            memset(&d, 0, sizeof d), d.kind = MN_OPTIM_ADAFACTOR, d.adafactor_beta1 = v;
            CHECK_OK(mn_optim_state_bytes(&d, dims, nd, &want2));
            CHECK_EQ_U64(c.bytes, want);
            CHECK_EQ_U64(want2, want);
            CHECK_EQ_U64(s.state_bytes, want);
            mn_adafactor_free(&s);
        }
        {
            mn_lion s;
            a = mnt_counting_allocator(&c);
            CHECK_OK(mn_lion_init(&s, dims, nd, NULL, &a));
            CHECK_OK(mn_lion_state_bytes(dims, nd, &want));
            memset(&d, 0, sizeof d), d.kind = MN_OPTIM_LION;
            CHECK_OK(mn_optim_state_bytes(&d, dims, nd, &want2));
            CHECK_EQ_U64(c.bytes, want);
            CHECK_EQ_U64(want2, want);
            CHECK_EQ_U64(s.state_bytes, want);
            mn_lion_free(&s);
        }
    }
}

// Hand-computed sizes, and the 64-bit overflow edges.
static void test_state_bytes_values(void) {
    uint64_t v, d1[1] = {5000}, d2[2] = {1000, 3}, d3[3] = {4, 6, 10}, big[1], bigf[3];
    mn_optim_desc d;
    CHECK_OK(mn_adamw8bit_state_bytes(d1, 1, 0, 0, &v));
    CHECK_EQ_U64(v, 2 * 5000 + 8 * 20);  // ceil(5000/256) = 20 blocks
    CHECK_OK(mn_adamw8bit_state_bytes(d1, 1, 0, 5001, &v));
    CHECK_EQ_U64(v, 8 * 5000);
    CHECK_OK(mn_adamw8bit_state_bytes(d1, 1, 4096, 0, &v));  // the largest block init takes
    CHECK_EQ_U64(v, 2 * 5000 + 8 * 2);
    CHECK_ERR(mn_adamw8bit_state_bytes(d1, 1, 4097, 0, &v), MN_ERR_INVALID_ARG);  // as init
    memset(&d, 0, sizeof d);
    d.kind = MN_OPTIM_ADAMW_8BIT, d.block_size = 8192;
    CHECK_ERR(mn_optim_state_bytes(&d, d1, 1, &v), MN_ERR_INVALID_ARG);
    CHECK_OK(mn_adafactor_state_bytes(d2, 2, 0, &v));
    CHECK_EQ_U64(v, 4 * (1000 + 3));
    CHECK_OK(mn_adafactor_state_bytes(d3, 3, 1, &v));
    CHECK_EQ_U64(v, 4 * (24 + 40 + 240));
    CHECK_OK(mn_sgd_state_bytes(d3, 3, 1, &v));
    CHECK_EQ_U64(v, 960);
    memset(&d, 0, sizeof d);
    d.kind = MN_OPTIM_NONE;
    CHECK_OK(mn_optim_state_bytes(&d, d3, 3, &v));
    CHECK_EQ_U64(v, 0);
    CHECK_OK(mn_optim_state_bytes(NULL, d3, 3, &v));  // default: AdamW
    CHECK_EQ_U64(v, 8 * 240);
    big[0] = (1ull << 61) + 1;  // 2n + 8n with block_size 1 exceeds 2^64
    CHECK_ERR(mn_adamw8bit_state_bytes(big, 1, 1, 0, &v), MN_ERR_OVERFLOW);
    bigf[0] = (1ull << 61) - 1, bigf[1] = 1, bigf[2] = 1;  // rows n + cols n + m n, 12n bytes
    CHECK_ERR(mn_adafactor_state_bytes(bigf, 3, 1, &v), MN_ERR_OVERFLOW);
    CHECK_OK(mn_adafactor_state_bytes(bigf, 3, 0, &v));
    CHECK_EQ_U64(v, 8 * bigf[0]);
    CHECK_ERR(mn_adamw_state_bytes(d1, 1, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_lion_state_bytes(d1, 0, &v), MN_ERR_INVALID_ARG);
}

static void test_init_out_of_memory(void) {
    uint64_t dims[2] = {70, 80};
    float p[1] = {0}, g[1] = {0};
    int o, pass;
    for (pass = 0; pass < 2; pass++) {  // the default allocator, then a caller's allocator
        for (o = 0; o < 5; o++) {
            mn_sgd sg; mn_adamw aw; mn_adamw8bit a8; mn_adafactor af; mn_lion li;
            mn_sgd_params psg;
            mnt_counting c;
            mn_allocator a = mnt_counting_allocator(&c);
            const mn_allocator *ap = pass ? &a : NULL;
            memset(&psg, 0, sizeof psg);
            psg.momentum = 0.5f;
            mnt_fail_alloc_after(1);
            switch (o) {
            case 0: CHECK_ERR(mn_sgd_init(&sg, dims, 2, &psg, ap), MN_ERR_OUT_OF_MEMORY);
                CHECK_EQ_U64(sg.n, 0); CHECK_ERR(mn_sgd_step(&sg, p, g, NULL), MN_ERR_STATE);
                mn_sgd_free(&sg); break;
            case 1: CHECK_ERR(mn_adamw_init(&aw, dims, 2, NULL, ap), MN_ERR_OUT_OF_MEMORY);
                CHECK(aw.exp_avg == NULL); CHECK_ERR(mn_adamw_step(&aw, p, g, NULL), MN_ERR_STATE);
                mn_adamw_free(&aw); break;
            case 2: CHECK_ERR(mn_adamw8bit_init(&a8, dims, 2, NULL, ap), MN_ERR_OUT_OF_MEMORY);
                CHECK_ERR(mn_adamw8bit_step(&a8, p, g, NULL), MN_ERR_STATE);
                mn_adamw8bit_free(&a8); break;
            case 3: CHECK_ERR(mn_adafactor_init(&af, dims, 2, NULL, ap), MN_ERR_OUT_OF_MEMORY);
                CHECK_ERR(mn_adafactor_step(&af, p, g, NULL), MN_ERR_STATE);
                mn_adafactor_free(&af); break;
            default: CHECK_ERR(mn_lion_init(&li, dims, 2, NULL, ap), MN_ERR_OUT_OF_MEMORY);
                CHECK_ERR(mn_lion_step(&li, p, g, NULL), MN_ERR_STATE);
                mn_lion_free(&li); break;
            }
            mnt_fail_alloc_after(0);
            CHECK_EQ_U64(c.bytes, 0);
        }
    }
}

static void test_bad_arguments(void) {
    uint64_t dims[2] = {3, 4}, zero[2] = {3, 0}, nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    float p[12] = {0}, g[12] = {0};
    mn_sgd sg; mn_adamw aw; mn_adamw8bit a8; mn_adafactor af; mn_lion li;
    mn_sgd_params psg; mn_adamw_params paw; mn_adamw8bit_params pa8; mn_adafactor_params paf;
    mn_lion_params pli;
    CHECK_ERR(mn_adamw_init(NULL, dims, 2, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_adamw_init(&aw, dims, 0, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_adamw_init(&aw, zero, 2, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_adamw_init(&aw, nine, 9, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_adamw_init(&aw, NULL, 2, NULL, NULL), MN_ERR_INVALID_ARG);
    memset(&paw, 0, sizeof paw);
    paw.beta1 = 1.0f;
    CHECK_ERR(mn_adamw_init(&aw, dims, 2, &paw, NULL), MN_ERR_INVALID_ARG);
    paw.beta1 = 0.0f, paw.lr = -0.5f;
    CHECK_ERR(mn_adamw_init(&aw, dims, 2, &paw, NULL), MN_ERR_INVALID_ARG);
    paw.lr = NAN;
    CHECK_ERR(mn_adamw_init(&aw, dims, 2, &paw, NULL), MN_ERR_INVALID_ARG);
    paw.lr = 0.0f, paw.dtype = MN_INT8;
    CHECK_ERR(mn_adamw_init(&aw, dims, 2, &paw, NULL), MN_ERR_INVALID_ARG);
    paw.dtype = MN_DTYPE_DEFAULT, paw.weight_decay = MN_OPTIM_ZERO, paw.lr = MN_OPTIM_ZERO;
    CHECK_OK(mn_adamw_init(&aw, dims, 2, &paw, NULL));  // [z] fields resolve to a real zero
    CHECK_NEAR(aw.params.weight_decay, 0.0, 0, 0);
    CHECK_NEAR(aw.params.lr, 0.0, 0, 0);
    CHECK_NEAR(aw.params.beta2, 0.999, 1e-7, 0);
    CHECK_EQ_INT(aw.params.dtype, MN_FP32);
    CHECK_ERR(mn_adamw_step(&aw, NULL, g, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_adamw_step(&aw, p, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_adamw_step(NULL, p, g, NULL), MN_ERR_INVALID_ARG);
    CHECK_OK(mn_adamw_step(&aw, p, g, NULL));
    mn_adamw_free(&aw);
    mn_adamw_free(&aw);  // twice is harmless
    mn_adamw_free(NULL);
    CHECK_ERR(mn_adamw_step(&aw, p, g, NULL), MN_ERR_STATE);
    memset(&psg, 0, sizeof psg);
    psg.nesterov = 1;  // needs momentum
    CHECK_ERR(mn_sgd_init(&sg, dims, 2, &psg, NULL), MN_ERR_INVALID_ARG);
    psg.momentum = 0.9f, psg.dampening = 0.1f;  // and zero dampening
    CHECK_ERR(mn_sgd_init(&sg, dims, 2, &psg, NULL), MN_ERR_INVALID_ARG);
    memset(&pa8, 0, sizeof pa8);
    pa8.block_size = 8192;
    CHECK_ERR(mn_adamw8bit_init(&a8, dims, 2, &pa8, NULL), MN_ERR_INVALID_ARG);
    memset(&paf, 0, sizeof paf);
    paf.decay_rate = 0.5f;
    CHECK_ERR(mn_adafactor_init(&af, dims, 2, &paf, NULL), MN_ERR_INVALID_ARG);
    paf.decay_rate = 0.0f, paf.beta1 = 1.5f;
    CHECK_ERR(mn_adafactor_init(&af, dims, 2, &paf, NULL), MN_ERR_INVALID_ARG);
    memset(&pli, 0, sizeof pli);
    pli.weight_decay = -2.0f;
    CHECK_ERR(mn_lion_init(&li, dims, 2, &pli, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_lion_step(NULL, p, g, NULL), MN_ERR_INVALID_ARG);
}

// --- gradient clipping ---------------------------------------------------------------------------

static void test_clip_grad_norm(void) {
    static const uint64_t sizes[3] = {7, 1000, 33};
    float *g[3], norm = 0.0f;
    double *orig[3], want_norm, coef;
    static const float types[4] = {2.0f, 1.0f, 3.0f, INFINITY};
    int k, ti, below;
    uint64_t i;
    for (k = 0; k < 3; k++) g[k] = mnt_fvec(sizes[k]), orig[k] = mnt_dvec(sizes[k]);
    for (ti = 0; ti < 4; ti++) {
        for (below = 0; below < 2; below++) {
            double pn = types[ti], acc = 0.0;
            float max_norm;
            for (k = 0; k < 3; k++) {
                mnt_fill_normal(g[k], sizes[k], 1.0 + k);
                mnt_to_double(g[k], orig[k], sizes[k]);
                for (i = 0; i < sizes[k]; i++) {
                    double a = fabs(orig[k][i]);
                    if (isinf(pn)) acc = fmax(acc, a);
                    else acc += pow(a, pn);
                }
            }
            want_norm = isinf(pn) ? acc : pow(acc, 1.0 / pn);
            max_norm = (float)(below ? 2.0 * want_norm : 0.3 * want_norm);
            CHECK_OK(mn_clip_grad_norm(g, sizes, 3, max_norm, types[ti], &norm));
            CHECK_NEAR(norm, want_norm, 0, 1e-6);
            coef = fmin(1.0, max_norm / (want_norm + 1e-6));
            for (k = 0; k < 3; k++) {
                double *w = mnt_dvec(sizes[k]);
                for (i = 0; i < sizes[k]; i++) w[i] = orig[k][i] * coef;
                CHECK_CLOSE("clipped gradient", g[k], w, sizes[k], 0, below ? 0 : 1e-6);
                free(w);
            }
        }
    }
    CHECK_OK(mn_clip_grad_norm(g, sizes, 3, 1.0f, 0.0f, &norm));  // 0 = the 2-norm
    CHECK_OK(mn_clip_grad_norm(g, sizes, 3, 1.0f, 0.0f, &norm));  // clipped to 1 by the first call
    CHECK_NEAR(norm, 1.0, 0, 1e-5);
    g[1][10] = NAN;  // a NaN norm spreads to every gradient, as in torch
    CHECK_OK(mn_clip_grad_norm(g, sizes, 3, 1.0f, 2.0f, &norm));
    CHECK(isnan(norm));
    CHECK(isnan(g[0][0]) && isnan(g[2][32]));
    for (k = 0; k < 3; k++) mnt_fill_normal(g[k], sizes[k], 1.0);
    g[1][10] = NAN;  // also for the max norm, whatever follows the NaN
    CHECK_OK(mn_clip_grad_norm(g, sizes, 3, 1.0f, INFINITY, &norm));
    CHECK(isnan(norm));
    CHECK_OK(mn_clip_grad_norm(NULL, NULL, 0, 1.0f, 2.0f, &norm));
    CHECK_NEAR(norm, 0.0, 0, 0);
    CHECK_ERR(mn_clip_grad_norm(g, sizes, 3, NAN, 2.0f, &norm), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_clip_grad_norm(g, sizes, 3, 1.0f, -1.0f, &norm), MN_ERR_INVALID_ARG);
    for (k = 0; k < 3; k++) free(g[k]), free(orig[k]);
}

// --- loss scaling --------------------------------------------------------------------------------

// Runs `count` updates with the same found_inf; returns the skips.
static int scaler_run(mn_loss_scaler *s, int found_inf, int count) {
    int i, skip = 0, skips = 0;
    for (i = 0; i < count; i++) {
        CHECK_OK(mn_loss_scaler_update(s, found_inf, &skip));
        skips += skip;
    }
    return skips;
}

static void test_loss_scaler_sequence(void) {
    mn_loss_scaler s;
    mn_loss_scaler_params prm;
    // GradScaler defaults, hand-derived from its update rule
    CHECK_OK(mn_loss_scaler_init(&s, NULL));
    CHECK_NEAR(s.scale, 65536.0, 0, 0);
    CHECK_NEAR(mn_loss_scaler_inv_scale(&s), 1.0 / 65536.0, 0, 0);
    CHECK_EQ_INT(scaler_run(&s, 1, 1), 1);
    CHECK_NEAR(s.scale, 32768.0, 0, 0);
    CHECK_EQ_INT(scaler_run(&s, 1, 1), 1);
    CHECK_NEAR(s.scale, 16384.0, 0, 0);
    CHECK_EQ_INT(scaler_run(&s, 0, 1999), 0);
    CHECK_NEAR(s.scale, 16384.0, 0, 0);  // 1999 clean steps: no growth yet
    CHECK_EQ_U64(s.growth_tracker, 1999);
    scaler_run(&s, 0, 1);
    CHECK_NEAR(s.scale, 32768.0, 0, 0);  // the 2000th clean step grows
    CHECK_EQ_U64(s.growth_tracker, 0);
    scaler_run(&s, 0, 1500);
    CHECK_EQ_INT(scaler_run(&s, 1, 1), 1);  // an overflow resets the count
    CHECK_NEAR(s.scale, 16384.0, 0, 0);
    scaler_run(&s, 0, 1999);
    CHECK_NEAR(s.scale, 16384.0, 0, 0);
    scaler_run(&s, 0, 2);
    CHECK_NEAR(s.scale, 32768.0, 0, 0);
    CHECK_EQ_U64(s.growth_tracker, 1);
    scaler_run(&s, 0, 3999);
    CHECK_NEAR(s.scale, 131072.0, 0, 0);  // grows at tracker 2000 twice more
    CHECK_EQ_U64(s.steps, 2 + 1999 + 1 + 1500 + 1 + 1999 + 2 + 3999);
    CHECK_EQ_U64(s.skipped, 3);
    // a short interval, step by step: F F I F F F F I I F F F
    {
        static const int inf[12] = {0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0};
        static const float want[12] = {4, 8, 4, 4, 4, 8, 8, 4, 2, 2, 2, 4};
        int i, skip;
        memset(&prm, 0, sizeof prm);
        prm.init_scale = 4.0f, prm.growth_interval = 3;
        CHECK_OK(mn_loss_scaler_init(&s, &prm));
        scaler_run(&s, 0, 1);  // tracker 1 before the table
        for (i = 0; i < 12; i++) {
            CHECK_OK(mn_loss_scaler_update(&s, inf[i], &skip));
            CHECK_EQ_INT(skip, inf[i]);
            CHECK_NEAR(s.scale, want[i], 0, 0);
        }
    }
    // growth that would overflow fp32 is not applied; the tracker still resets
    memset(&prm, 0, sizeof prm);
    prm.init_scale = 1.7014118e38f;  // 2^127
    prm.growth_interval = 2;
    CHECK_OK(mn_loss_scaler_init(&s, &prm));
    scaler_run(&s, 0, 2);
    CHECK_NEAR(s.scale, 1.7014118e38, 0, 1e-7);
    CHECK_EQ_U64(s.growth_tracker, 0);
    prm.backoff_factor = 1.5f;
    CHECK_ERR(mn_loss_scaler_init(&s, &prm), MN_ERR_INVALID_ARG);
    prm.backoff_factor = 0.0f, prm.growth_factor = 0.5f;
    CHECK_ERR(mn_loss_scaler_init(&s, &prm), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_loss_scaler_update(NULL, 0, NULL), MN_ERR_INVALID_ARG);
}

// Nearest fp16 / bf16 by search over values decoded with ldexp (independent of the library).
static double ref_fp16_value(uint32_t h) {  // h <= 0x7c00 (0x7c00 stands for 2^16, the next binade)
    uint32_t e = h >> 10, m = h & 0x3ff;
    return e == 0 ? ldexp((double)m, -24) : ldexp(1.0 + m / 1024.0, (int)e - 15);
}

static double ref_bf16_value(uint32_t b) {  // b <= 0x7f80 (0x7f80 stands for 2^128)
    uint32_t e = b >> 7, m = b & 0x7f;
    return e == 0 ? ldexp((double)m, -133) : ldexp(1.0 + m / 128.0, (int)e - 127);
}

// Round |x| to the nearest entry of the ascending table v(0..top), ties to the even pattern.
static uint32_t ref_round(double a, double (*value)(uint32_t), uint32_t top) {
    uint32_t lo = 0, hi = top, mid;
    double dl, dh;
    if (a >= value(top)) return top;
    while (hi - lo > 1) {  // value(lo) <= a < value(hi)
        mid = (lo + hi) / 2;
        if (value(mid) <= a) lo = mid;
        else hi = mid;
    }
    dl = a - value(lo), dh = value(hi) - a;
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (lo & 1) ? hi : lo;
}

static uint16_t ref_to_half(float f, int bf16) {
    uint32_t sign = signbit(f) ? 0x8000u : 0u;
    double a = fabs((double)f);
    if (isnan(f)) return 0xffff;  // NaN is checked separately
    return (uint16_t)(sign | ref_round(a, bf16 ? ref_bf16_value : ref_fp16_value,
                                       bf16 ? 0x7f80u : 0x7c00u));
}

// Every 16-bit pattern: the decoded fp32 equals the ldexp reference (infinities and signs kept,
// NaN stays NaN with its sign and is quieted), and encoding it gives the pattern back (NaN:
// quieted). fp16: 10 mantissa bits, 5 exponent bits; bf16: 7 and 8; quiet bit = top mantissa bit.
static void check_half_exhaustive(int bf16) {
    const uint32_t mbits = bf16 ? 7 : 10, emax = bf16 ? 0xff : 0x1f, qbit = 1u << (mbits - 1);
    double (*value)(uint32_t) = bf16 ? ref_bf16_value : ref_fp16_value;
    uint32_t h;
    long bad = 0, bad_rt = 0;
    for (h = 0; h < 65536; h++) {
        float f = bf16 ? mn_bf16_to_fp32((uint16_t)h) : mn_fp16_to_fp32((uint16_t)h);
        uint32_t e = (h >> mbits) & emax, m = h & ((1u << mbits) - 1);
        uint16_t back = bf16 ? mn_fp32_to_bf16(f) : mn_fp32_to_fp16(f);
        if (e == emax && m) {  // NaN: stays NaN, same sign and payload, quieted
            uint32_t bits;
            memcpy(&bits, &f, 4);
            bad += !isnan(f) || (signbit(f) != 0) != ((h & 0x8000) != 0) || !(bits & 0x400000u);
            bad_rt += back != (h | qbit);
            continue;
        }
        if (e == emax) bad += !isinf(f) || (f < 0) != ((h & 0x8000) != 0);
        else bad += (double)f != ((h & 0x8000) ? -1.0 : 1.0) * value(h & 0x7fff) ||
                    (signbit(f) != 0) != ((h & 0x8000) != 0);
        bad_rt += back != h;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(bad_rt, 0);
}

static void test_fp16_exhaustive(void) { check_half_exhaustive(0); }
static void test_bf16_exhaustive(void) { check_half_exhaustive(1); }

static float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Float order as unsigned order (-0 just below +0), and back.
static uint32_t float_okey(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u >> 31) ? ~u : u | 0x80000000u;
}
static float okey_float(uint32_t k) { return bits_to_float((k >> 31) ? k & 0x7fffffffu : ~k); }

// One random fp32: uniform bit patterns, values near the 16-bit ranges, exact ties and neighbours.
static float random_probe(int bf16) {
    uint64_t r = mnt_rand_u64();
    float f;
    switch (r % 4) {
    case 0: return bits_to_float((uint32_t)(r >> 32));
    case 1:
        if (bf16) return bits_to_float((uint32_t)(r >> 32));
        f = (float)ldexp((double)((r >> 8) & 0xffffff) / 16777216.0 + 1.0,
                         (int)((r >> 40) % 46) - 28);
        return (r >> 63) ? -f : f;
    default: {  // midpoint between two neighbours, then maybe one fp32 ulp off it
        uint32_t k = (uint32_t)((r >> 16) % (bf16 ? 0x7f80u : 0x7c00u));
        double mid = bf16 ? (ref_bf16_value(k) + ref_bf16_value(k + 1)) / 2
                          : (ref_fp16_value(k) + ref_fp16_value(k + 1)) / 2;
        f = (float)mid;
        if ((r >> 40) % 3 == 1) f = nextafterf(f, 0.0f);
        if ((r >> 40) % 3 == 2) f = nextafterf(f, INFINITY);
        return (r >> 63) ? -f : f;
    }
    }
}

static void test_fp32_to_half_random(void) {
    enum { COUNT = 1000000 };
    int bf16, i;
    for (bf16 = 0; bf16 < 2; bf16++) {
        long bad = 0;
        for (i = 0; i < COUNT; i++) {
            float f = random_probe(bf16);
            uint16_t got = bf16 ? mn_fp32_to_bf16(f) : mn_fp32_to_fp16(f);
            if (isnan(f)) {
                uint16_t qbit = bf16 ? 0x40 : 0x200, emask = bf16 ? 0x7f80 : 0x7c00;
                bad += (got & emask) != emask || !(got & qbit);
                bad += ((got & 0x8000) != 0) != (signbit(f) != 0);
                continue;
            }
            if (got != ref_to_half(f, bf16)) {
                if (bad < 3) mnt_fail(__FILE__, __LINE__, "%s(%.9g) got 0x%04x want 0x%04x",
                                      bf16 ? "bf16" : "fp16", (double)f, got, ref_to_half(f, bf16));
                bad++;
            }
        }
        CHECK_EQ_INT(bad, 0);
    }
}

static void test_fp32_to_half_edges(void) {
    static const struct { float f; uint16_t h; } fp16[] = {
        {65504.0f, 0x7bff}, {65519.996f, 0x7bff}, {65520.0f, 0x7c00}, {1e10f, 0x7c00},
        {-65520.0f, 0xfc00}, {5.9604645e-8f, 0x0001} /* 2^-24 */,
        {2.9802322e-8f, 0x0000} /* 2^-25 tie */,
        {2.9802326e-8f, 0x0001}, {8.9406967e-8f, 0x0002} /* 1.5 * 2^-24 tie to even */,
        {6.1035156e-5f, 0x0400} /* 2^-14 */, {6.1005354e-5f, 0x0400} /* 2^-14 - 2^-25 tie */,
        {1.00048828125f, 0x3c00} /* 1 + 2^-11 tie */, {1.00146484375f, 0x3c02} /* 1 + 3 * 2^-11 */,
        {-0.0f, 0x8000}, {0.0f, 0x0000}, {1.4e-45f, 0x0000}, {-1.0f, 0xbc00}, {0.1f, 0x2e66},
    };
    static const struct { float f; uint16_t h; } bf16[] = {
        {3.3895314e38f, 0x7f7f} /* max finite bf16 */,
        {3.40282347e38f, 0x7f80} /* FLT_MAX rounds up */,
        {1.00390625f, 0x3f80} /* 1 + 2^-8 tie */, {1.01171875f, 0x3f82} /* 1 + 3 * 2^-8 */,
        {-0.0f, 0x8000}, {1.4e-45f, 0x0000}, {9.2e-41f, 0x0001}, {1.0f, 0x3f80}, {0.1f, 0x3dcd},
    };
    size_t i;
    for (i = 0; i < sizeof fp16 / sizeof fp16[0]; i++) {
        CHECK_MSG(mn_fp32_to_fp16(fp16[i].f) == fp16[i].h, "fp16(%.9g) got 0x%04x want 0x%04x",
                  (double)fp16[i].f, mn_fp32_to_fp16(fp16[i].f), fp16[i].h);
        CHECK_EQ_INT(ref_to_half(fp16[i].f, 0), fp16[i].h);  // the reference agrees
    }
    for (i = 0; i < sizeof bf16 / sizeof bf16[0]; i++) {
        CHECK_MSG(mn_fp32_to_bf16(bf16[i].f) == bf16[i].h, "bf16(%.9g) got 0x%04x want 0x%04x",
                  (double)bf16[i].f, mn_fp32_to_bf16(bf16[i].f), bf16[i].h);
        CHECK_EQ_INT(ref_to_half(bf16[i].f, 1), bf16[i].h);
    }
    CHECK_EQ_INT(mn_fp32_to_fp16(INFINITY), 0x7c00);
    CHECK_EQ_INT(mn_fp32_to_fp16(-INFINITY), 0xfc00);
    CHECK_EQ_INT(mn_fp32_to_bf16(-INFINITY), 0xff80);
    CHECK_EQ_INT(mn_fp32_to_fp16(bits_to_float(0x7fc00000u)), 0x7e00);   // quiet NaN
    CHECK_EQ_INT(mn_fp32_to_fp16(bits_to_float(0x7f800001u)), 0x7e00);   // signaling NaN, quieted
    CHECK_EQ_INT(mn_fp32_to_bf16(bits_to_float(0xff800001u)), 0xffc0);   // keeps the sign
    CHECK(isnan(mn_fp16_to_fp32(0x7c01)));
    CHECK(isnan(mn_bf16_to_fp32(0xff81)));
}

// The array conversions at every start within a cache line of either array (they run a scalar
// head up to the fp32 array's first 64-byte boundary, then their vector loop) and at lengths
// below, at and above that head; elements outside [0, n) keep their poison.
static void test_conversion_arrays(void) {
    enum { N = 4097, PAD = 40 };
    float *x = mnt_fvec(N + PAD), *y = mnt_fvec(N + PAD);
    uint16_t *h = (uint16_t *)malloc((N + PAD) * 2);
    int i, bad = 0, o, q, k;
    for (i = 0; i < N + PAD; i++) x[i] = random_probe(i & 1);
    for (o = 0; o < 17; o++) {
        for (k = 0; k < 4; k++) {
            int n = k == 0 ? N : k == 1 ? (int)(mnt_rand_uniform() * 20.0) : k == 2 ? 16 - o : 1 + o;
            float *xs = x + o, *ys = y + (o * 7) % 17;
            uint16_t *hs = h + (o * 5 + k) % 17;
            if (n < 0) n = 0;
            q = (int)(hs - h);
            for (i = 0; i < N + PAD; i++) h[i] = 0xabcd;
            mn_fp32_to_fp16_array(xs, hs, (uint64_t)n);
            for (i = 0; i < n; i++) bad += hs[i] != mn_fp32_to_fp16(xs[i]);
            for (i = 0; i < N + PAD; i++) bad += (i < q || i >= q + n) && h[i] != 0xabcd;
            for (i = 0; i < N + PAD; i++) y[i] = 7.0f;
            mn_fp16_to_fp32_array(hs, ys, (uint64_t)n);
            for (i = 0; i < n; i++) bad += !isnan(ys[i]) && ys[i] != mn_fp16_to_fp32(hs[i]);
            for (i = 0; i < N + PAD; i++) bad += (y + i < ys || y + i >= ys + n) && y[i] != 7.0f;
            mn_fp32_to_bf16_array(xs, hs, (uint64_t)n);
            for (i = 0; i < n; i++) bad += hs[i] != mn_fp32_to_bf16(xs[i]);
            mn_bf16_to_fp32_array(hs, ys, (uint64_t)n);
            for (i = 0; i < n; i++) bad += !isnan(ys[i]) && ys[i] != mn_bf16_to_fp32(hs[i]);
            for (i = 0; i < N + PAD; i++) bad += (y + i < ys || y + i >= ys + n) && y[i] != 7.0f;
        }
    }
    CHECK_EQ_INT(bad, 0);
    mn_fp32_to_fp16_array(x, h, 0);  // n = 0 touches nothing
    free(x), free(y), free(h);
}

// The array conversions are written apart from the scalar ones (branch-free, to vectorize): the
// same bits for every 16-bit value, and for fp32 values on a stride over all 2^32 bit patterns
// plus every value within 2^14 ulps of fp16's edges (subnormal and normal range, overflow, zero,
// inf and NaN), both signs. (Checked exhaustively over all 2^32 when the arrays were rewritten.)
static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static void test_conversion_arrays_bits(void) {
    enum { N = 65536 };
    static const uint32_t edges[] = {0x00000000u, 0x33000000u, 0x38800000u, 0x3f800000u,
                                     0x477fe000u, 0x47800000u, 0x7f800000u, 0x7fc00000u};
    float *x = mnt_fvec(N), *y = mnt_fvec(N);
    uint16_t *h = (uint16_t *)malloc(N * 2);
    uint64_t bad = 0, u, k;
    size_t e;
    int i;
    for (i = 0; i < N; i++) h[i] = (uint16_t)i;
    mn_fp16_to_fp32_array(h, y, N);
    for (i = 0; i < N; i++) bad += float_bits(y[i]) != float_bits(mn_fp16_to_fp32(h[i]));
    mn_bf16_to_fp32_array(h, y, N);
    for (i = 0; i < N; i++) bad += float_bits(y[i]) != float_bits(mn_bf16_to_fp32(h[i]));
    for (k = 0; k < 2 * (sizeof edges / sizeof edges[0]) + 64; k++) {
        // a chunk of N patterns: around an edge (either sign), or a stride over all of them
        e = (size_t)(k / 2);
        for (i = 0; i < N; i++) {
            if (e < sizeof edges / sizeof edges[0])
                u = (uint64_t)edges[e] - N / 2 + (uint64_t)i + (k & 1 ? 0x80000000u : 0u);
            else
                u = ((uint64_t)(k - 16) * N + (uint64_t)i) * 1031u;
            x[i] = bits_to_float((uint32_t)u);
        }
        mn_fp32_to_fp16_array(x, h, N);
        for (i = 0; i < N; i++) bad += h[i] != mn_fp32_to_fp16(x[i]);
        mn_fp32_to_bf16_array(x, h, N);
        for (i = 0; i < N; i++) bad += h[i] != mn_fp32_to_bf16(x[i]);
    }
    CHECK_MSG(bad == 0, "%llu conversions differ from the scalar ones", (unsigned long long)bad);
    free(x), free(y), free(h);
}

// Unscale + found-inf over fp32, fp16 and bf16 arrays, against products in double.
static void test_unscale(void) {
    enum { N = 1000 };
    float *g = mnt_fvec(N), *dst = mnt_fvec(N);
    uint16_t *h = (uint16_t *)malloc(N * 2), *h0 = (uint16_t *)malloc(N * 2);
    float inv = 1.0f / 3000.0f;
    int found = 0, i, d, bad;
    mnt_fill_normal(g, N, 100.0);
    memcpy(dst, g, N * sizeof(float));
    CHECK_OK(mn_unscale_grads(MN_FP32, dst, N, inv, &found));
    CHECK_EQ_INT(found, 0);
    for (bad = 0, i = 0; i < N; i++) bad += dst[i] != (float)((double)g[i] * inv);
    CHECK_EQ_INT(bad, 0);
    dst[17] = INFINITY;
    CHECK_OK(mn_unscale_grads(MN_DTYPE_DEFAULT, dst, N, inv, &found));
    CHECK_EQ_INT(found, 1);
    CHECK_OK(mn_unscale_grads(MN_FP32, g, N, 1.0f, &found));  // a clean tensor leaves the flag set
    CHECK_EQ_INT(found, 1);
    for (d = 0; d < 2; d++) {  // fp16, bf16
        mn_dtype dt = d ? MN_BF16 : MN_FP16;
        for (i = 0; i < N; i++) h0[i] = d ? mn_fp32_to_bf16(g[i]) : mn_fp32_to_fp16(g[i]);
        memcpy(h, h0, N * 2);
        found = 0;
        CHECK_OK(mn_unscale_grads(dt, h, N, inv, &found));
        CHECK_EQ_INT(found, 0);
        for (bad = 0, i = 0; i < N; i++) {
            double v = (d ? mn_bf16_to_fp32(h0[i]) : mn_fp16_to_fp32(h0[i])) * (double)inv;
            bad += h[i] != ref_to_half((float)v, d);
        }
        CHECK_EQ_INT(bad, 0);
        CHECK_OK(mn_unscale_grads_to_fp32(dt, h0, dst, N, inv, &found));
        for (bad = 0, i = 0; i < N; i++)
            bad += dst[i] != (float)((d ? mn_bf16_to_fp32(h0[i]) : mn_fp16_to_fp32(h0[i])) *
                                     (double)inv);
        CHECK_EQ_INT(bad, 0);
        CHECK_EQ_INT(found, 0);
        h0[500] = d ? 0x7fc0 : 0x7e00;  // NaN
        CHECK_OK(mn_unscale_grads_to_fp32(dt, h0, dst, N, inv, &found));
        CHECK_EQ_INT(found, 1);
        found = 0;
        h0[500] = d ? 0xff80 : 0xfc00;  // -inf
        CHECK_OK(mn_unscale_grads(dt, h0, N, inv, &found));
        CHECK_EQ_INT(found, 1);
    }
    CHECK_ERR(mn_unscale_grads(MN_INT8, h, N, inv, &found), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_unscale_grads(MN_FP32, g, N, inv, NULL), MN_ERR_INVALID_ARG);
    free(g), free(dst), free(h), free(h0);
}

// fp16 training loop in miniature: scaled gradients overflow fp16 until the scaler has backed off.
static void test_loss_scaler_with_fp16_grads(void) {
    enum { N = 64 };
    mn_loss_scaler s;
    float g[N], un[N];
    uint16_t h[N];
    int i, step, skip, found, bad;
    static const float want_scale[4] = {32768.0f, 16384.0f, 16384.0f, 16384.0f};
    static const int want_skip[4] = {1, 1, 0, 0};
    for (i = 0; i < N; i++) g[i] = (float)ldexp((double)(i - 32), -5);  // 2^16 |g| overflows
    g[0] = -2.0f;  // 2 * 32768 = 65536 overflows too; 2 * 16384 fits
    CHECK_OK(mn_loss_scaler_init(&s, NULL));
    for (step = 0; step < 4; step++) {
        for (i = 0; i < N; i++) h[i] = mn_fp32_to_fp16(g[i] * s.scale);  // "backward" in fp16
        found = 0;
        CHECK_OK(mn_unscale_grads_to_fp32(MN_FP16, h, un, N, mn_loss_scaler_inv_scale(&s), &found));
        CHECK_OK(mn_loss_scaler_update(&s, found, &skip));
        CHECK_EQ_INT(skip, want_skip[step]);
        CHECK_NEAR(s.scale, want_scale[step], 0, 0);
        if (!skip) {
            for (bad = 0, i = 0; i < N; i++) bad += un[i] != g[i];  // powers of two: exact
            CHECK_EQ_INT(bad, 0);
        }
    }
}

// AdamW's common case (no maximize, no amsgrad) runs a loop of its own, threaded for large
// tensors: it must give the same bits as the general loop, reached here through maximize with
// the gradient negated (the same g). Sizes on both sides of the threading threshold, 3 steps.
static void test_adamw_fast_path_bits(void) {
    static const uint64_t sizes[] = {1, 1000, 65535, 65536, 200003};
    size_t q;
    for (q = 0; q < sizeof sizes / sizeof sizes[0]; q++) {
        uint64_t n = sizes[q], dims[1], k;
        float *pa = mnt_fvec(n), *pb = mnt_fvec(n), *g = mnt_fvec(n), *ng = mnt_fvec(n);
        mn_adamw a, b;
        mn_adamw_params prm;
        int step;
        dims[0] = n;
        memset(&prm, 0, sizeof prm);
        prm.lr = 1e-2f, prm.weight_decay = 0.1f;
        CHECK_OK(mn_adamw_init(&a, dims, 1, &prm, NULL));
        prm.maximize = 1;
        CHECK_OK(mn_adamw_init(&b, dims, 1, &prm, NULL));
        mnt_fill_normal(pa, n, 1.0);
        memcpy(pb, pa, n * sizeof(float));
        for (step = 0; step < 3; step++) {
            mnt_fill_normal(g, n, 1e-2);
            for (k = 0; k < n; k++) ng[k] = -g[k];
            CHECK_OK(mn_adamw_step(&a, pa, g, NULL));
            CHECK_OK(mn_adamw_step(&b, pb, ng, NULL));
        }
        CHECK_MSG(memcmp(pa, pb, n * sizeof(float)) == 0 &&
                  memcmp(a.exp_avg, b.exp_avg, n * sizeof(float)) == 0 &&
                  memcmp(a.exp_avg_sq, b.exp_avg_sq, n * sizeof(float)) == 0,
                  "n %llu: the common-case loop differs from the general one",
                  (unsigned long long)n);
        mn_adamw_free(&a);
        mn_adamw_free(&b);
        free(pa), free(pb), free(g), free(ng);
    }
}


// ---- the fast paths against the plain loops, bit for bit ---------------------------------------
//
// Each optimizer's step written as one plain scalar loop per element, in the order of operations
// of its comment block in memanat.h (torch, bitsandbytes, transformers, the Lion paper): the
// header's step (vector lanes, tables, threads) must give the same bits for the parameters, the
// 16-bit copy and the state, on fresh random inputs of odd sizes.

// Number of entries of an ascending map below x, at most 255, then the nearer of the two entries
// around x (ties to the larger): the search of bitsandbytes' quantize (kernels.cu, dQuantize).
static uint8_t ref_nearest(const float *map, float x) {
    uint32_t i = 0;
    while (i < 255 && map[i] < x) i++;
    if (i == 0) return 0;
    return (uint8_t)(x - map[i - 1] < map[i] - x ? i - 1 : i);
}

static void ref_store16(mn_dtype dt, const float *p, uint16_t *h, uint64_t n) {
    uint64_t i;
    for (i = 0; i < n && dt != MN_FP32; i++)
        h[i] = dt == MN_FP16 ? mn_fp32_to_fp16(p[i]) : mn_fp32_to_bf16(p[i]);
}

static int same_bits(const void *a, const void *b, uint64_t bytes) {
    return bytes == 0 || memcmp(a, b, (size_t)bytes) == 0;
}

// A parameter, a gradient and fresh normal values; a few gradients 0, tiny or huge.
static void fill_case(float *x, uint64_t n, double scale) {
    uint64_t i;
    mnt_fill_normal(x, n, scale);
    for (i = 0; i < n; i += 1 + mnt_rand_u64() % 97) {
        double r = mnt_rand_uniform();
        x[i] = r < 0.3 ? 0.0f : r < 0.6 ? x[i] * 1e-20f : x[i] * 1e3f;
    }
}

static const mn_dtype bit_dtypes[3] = {MN_FP32, MN_FP16, MN_BF16};

static void test_adamw_bits_vs_plain_loop(void) {
    static const uint64_t sizes[] = {1, 17, 1031, 40009};
    size_t q;
    for (q = 0; q < 4 * 3; q++) {
        uint64_t n = sizes[q % 4], dims[1], i;
        mn_dtype dt = bit_dtypes[q / 4];
        float *p = mnt_fvec(n), *g = mnt_fvec(n), *rp = mnt_fvec(n), *rm = mnt_fvec(n);
        float *rv = mnt_fvec(n);
        uint16_t *h = (uint16_t *)malloc(n * 2), *rh = (uint16_t *)malloc(n * 2);
        mn_adamw s;
        mn_adamw_params prm;
        int t;
        dims[0] = n;
        memset(&prm, 0, sizeof prm);
        prm.lr = (float)(1e-3 * (1.0 + mnt_rand_uniform()));
        prm.weight_decay = q % 2 ? 0.1f : MN_OPTIM_ZERO;
        prm.beta1 = q % 3 ? 0.9f : 0.3f;  // lerp's two branches (weight 1 - beta1 below 0.5 or not)
        prm.dtype = dt;
        CHECK_OK(mn_adamw_init(&s, dims, 1, &prm, NULL));
        fill_case(p, n, 1.0);
        memcpy(rp, p, n * 4), memset(rm, 0, n * 4), memset(rv, 0, n * 4);
        for (t = 1; t <= 4; t++) {  // torch adam.py _single_tensor_adam, decoupled decay
            const mn_adamw_params *a = &s.params;
            double bc1 = 1.0 - pow((double)a->beta1, t), bc2 = 1.0 - pow((double)a->beta2, t);
            float decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
            float step = (float)((double)a->lr / bc1), bc2s = (float)sqrt(bc2);
            float w1 = 1.0f - a->beta1;
            fill_case(g, n, 1e-2);
            CHECK_OK(mn_adamw_step(&s, p, g, h));
            for (i = 0; i < n; i++) {
                float th = rp[i] * decay, m = rm[i], gi = g[i];
                m = w1 < 0.5f ? m + w1 * (gi - m) : gi - (gi - m) * (1.0f - w1);  // torch.lerp
                rm[i] = m;
                rv[i] = rv[i] * a->beta2 + (1.0f - a->beta2) * gi * gi;
                rp[i] = th - step * (m / (sqrtf(rv[i]) / bc2s + a->eps));
            }
            ref_store16(dt, rp, rh, n);
        }
        CHECK_MSG(same_bits(p, rp, n * 4) && same_bits(s.exp_avg, rm, n * 4) &&
                      same_bits(s.exp_avg_sq, rv, n * 4) &&
                      (dt == MN_FP32 || same_bits(h, rh, n * 2)),
                  "adamw n %llu dtype %d: not the plain loop's bits", (unsigned long long)n,
                  (int)dt);
        mn_adamw_free(&s);
        free(p), free(g), free(rp), free(rm), free(rv), free(h), free(rh);
    }
}

static void test_sgd_lion_bits_vs_plain_loop(void) {
    static const uint64_t sizes[] = {3, 1029, 40007};
    size_t q;
    for (q = 0; q < 3 * 3; q++) {
        uint64_t n = sizes[q % 3], dims[1], i;
        mn_dtype dt = bit_dtypes[q / 3];
        float *p = mnt_fvec(n), *g = mnt_fvec(n), *rp = mnt_fvec(n), *rb = mnt_fvec(n);
        float *lp = mnt_fvec(n), *rlp = mnt_fvec(n), *rlm = mnt_fvec(n);
        uint16_t *h = (uint16_t *)malloc(n * 2), *rh = (uint16_t *)malloc(n * 2);
        mn_sgd s;
        mn_sgd_params sp;
        mn_lion l;
        mn_lion_params lpr;
        int t, ok = 1;
        dims[0] = n;
        memset(&sp, 0, sizeof sp), memset(&lpr, 0, sizeof lpr);
        sp.lr = 0.05f, sp.momentum = 0.9f, sp.weight_decay = q % 2 ? 1e-2f : MN_OPTIM_ZERO;
        sp.dampening = q % 2 ? MN_OPTIM_ZERO : 0.1f, sp.nesterov = q % 2, sp.dtype = dt;
        sp.maximize = q % 3 == 2;
        lpr.lr = 1e-3f, lpr.weight_decay = q % 2 ? 0.1f : MN_OPTIM_ZERO, lpr.dtype = dt;
        CHECK_OK(mn_sgd_init(&s, dims, 1, &sp, NULL));
        CHECK_OK(mn_lion_init(&l, dims, 1, &lpr, NULL));
        fill_case(p, n, 1.0);
        memcpy(rp, p, n * 4), memcpy(lp, p, n * 4), memcpy(rlp, p, n * 4);
        memset(rb, 0, n * 4), memset(rlm, 0, n * 4);
        for (t = 1; t <= 4; t++) {
            const mn_sgd_params *a = &s.params;
            const mn_lion_params *b = &l.params;
            float decay = (float)(1.0 - (double)b->lr * (double)b->weight_decay);
            fill_case(g, n, 1.0);
            CHECK_OK(mn_sgd_step(&s, p, g, h));
            for (i = 0; i < n; i++) {  // torch.optim.SGD's algorithm box
                float gi = a->maximize ? -g[i] : g[i];
                if (a->weight_decay != 0.0f) gi = gi + a->weight_decay * rp[i];
                rb[i] = t == 1 ? gi : rb[i] * a->momentum + (1.0f - a->dampening) * gi;
                gi = a->nesterov ? gi + a->momentum * rb[i] : rb[i];
                rp[i] = rp[i] - a->lr * gi;
            }
            ref_store16(dt, rp, rh, n);
            ok &= same_bits(p, rp, n * 4) && same_bits(s.momentum_buffer, rb, n * 4) &&
                  (dt == MN_FP32 || same_bits(h, rh, n * 2));
            CHECK_OK(mn_lion_step(&l, lp, g, h));
            for (i = 0; i < n; i++) {  // Chen et al. 2023, Algorithm 2
                float m = rlm[i], c = m * b->beta1 + (1.0f - b->beta1) * g[i];
                float sg = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
                rlp[i] = rlp[i] * decay - b->lr * sg;
                rlm[i] = m * b->beta2 + (1.0f - b->beta2) * g[i];
            }
            ref_store16(dt, rlp, rh, n);
            ok &= same_bits(lp, rlp, n * 4) && same_bits(l.exp_avg, rlm, n * 4) &&
                  (dt == MN_FP32 || same_bits(h, rh, n * 2));
        }
        CHECK_MSG(ok, "sgd/lion n %llu dtype %d: not the plain loop's bits",
                  (unsigned long long)n, (int)dt);
        mn_sgd_free(&s), mn_lion_free(&l);
        free(p), free(g), free(rp), free(rb), free(lp), free(rlp), free(rlm), free(h), free(rh);
    }
}

// bitsandbytes kOptimizerStatic8bit2StateBlockwise (ADAM) per element, as memanat.h describes it.
static void ref_adamw8bit_step(const mn_adamw8bit_params *a, uint64_t t, float *p, const float *g,
                               uint64_t n, uint8_t *c1, uint8_t *c2, float *am1, float *am2) {
    float map1[256], map2[256], *mb = (float *)malloc(a->block_size * 4);
    float *vb = (float *)malloc(a->block_size * 4);
    double bc1 = 1.0 - pow((double)a->beta1, (double)t);
    double bc2 = sqrt(1.0 - pow((double)a->beta2, (double)t));
    float step = (float)(-(double)a->lr * bc2 / bc1), eps = (float)((double)a->eps * bc2);
    float decay = (float)(1.0 - (double)a->lr * (double)a->weight_decay);
    uint64_t b, i0, j, len;
    mn_dynamic_map(1, map1), mn_dynamic_map(0, map2);
    for (b = 0, i0 = 0; i0 < n; b++, i0 += a->block_size) {
        float n1 = 0.0f, n2 = 0.0f, inv1, inv2;
        len = n - i0 < a->block_size ? n - i0 : a->block_size;
        for (j = 0; j < len; j++) {
            float gi = g[i0 + j], m = 0.0f, v = 0.0f;
            if (isfinite(gi)) {
                m = map1[c1[i0 + j]] * am1[b] * a->beta1 + (1.0f - a->beta1) * gi;
                v = map2[c2[i0 + j]] * am2[b] * a->beta2 + (1.0f - a->beta2) * gi * gi;
            }
            mb[j] = m, vb[j] = v;
            if (fabsf(m) > n1) n1 = fabsf(m);
            if (v > n2) n2 = v;
        }
        am1[b] = n1, am2[b] = n2;
        inv1 = n1 > 0.0f ? 1.0f / n1 : 0.0f;
        inv2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
        for (j = 0; j < len; j++) {
            uint8_t q;
            if (isfinite(g[i0 + j])) {
                p[i0 + j] = p[i0 + j] + step * (mb[j] / (sqrtf(vb[j]) + eps));
                if (a->weight_decay > 0.0f) p[i0 + j] = p[i0 + j] * decay;
            }
            q = ref_nearest(map1, mb[j] * inv1);
            if (mb[j] < 0.0f && map1[q] >= 0.0f) q--;
            c1[i0 + j] = q;
            c2[i0 + j] = ref_nearest(map2, vb[j] * inv2);
        }
    }
    free(mb), free(vb);
}

static void test_adamw8bit_bits_vs_plain_loop(void) {
    static const uint64_t sizes[] = {4099, 16411, 140009};  // the last on threads
    static const uint32_t blocks[] = {256, 129, 2048};
    size_t q;
    for (q = 0; q < 3 * 3; q++) {
        uint64_t n = sizes[q % 3], dims[1], nb;
        mn_dtype dt = bit_dtypes[q / 3];
        float *p = mnt_fvec(n), *g = mnt_fvec(n), *rp = mnt_fvec(n);
        uint16_t *h = (uint16_t *)malloc(n * 2), *rh = (uint16_t *)malloc(n * 2);
        uint8_t *c1 = (uint8_t *)calloc(n, 1), *c2 = (uint8_t *)calloc(n, 1);
        float *am1, *am2;
        mn_adamw8bit s;
        mn_adamw8bit_params prm;
        int t, ok = 1;
        dims[0] = n;
        memset(&prm, 0, sizeof prm);
        prm.block_size = blocks[(q + q / 3) % 3];
        prm.weight_decay = q % 2 ? 0.1f : MN_OPTIM_ZERO;
        prm.dtype = dt;
        CHECK_OK(mn_adamw8bit_init(&s, dims, 1, &prm, NULL));
        CHECK(s.quantized);
        nb = s.blocks;
        am1 = (float *)calloc(nb, 4), am2 = (float *)calloc(nb, 4);
        fill_case(p, n, 1.0);
        memcpy(rp, p, n * 4);
        for (t = 1; t <= 5; t++) {
            fill_case(g, n, t % 2 ? 1e-3 : 1.0);
            if (t == 3) g[n / 2] = NAN, g[n / 3] = INFINITY;  // left alone, moments 0
            // v overflows: its block's absmax is inf, then 0 * inf gives NaN moments and NaN
            // parameters in the block at step 3; the block maxima skip the NaN
            if (t == 2) g[n / 5] = 1e30f, g[n / 5 + 7] = -3e25f;
            CHECK_OK(mn_adamw8bit_step(&s, p, g, h));
            ref_adamw8bit_step(&s.params, (uint64_t)t, rp, g, n, c1, c2, am1, am2);
            ref_store16(dt, rp, rh, n);
            ok &= same_bits(p, rp, n * 4) && same_bits(s.code1, c1, n) &&
                  same_bits(s.code2, c2, n) && same_bits(s.absmax1, am1, nb * 4) &&
                  same_bits(s.absmax2, am2, nb * 4) && (dt == MN_FP32 || same_bits(h, rh, n * 2));
        }
        CHECK_MSG(ok, "adamw8bit n %llu block %u dtype %d: not the plain loop's bits",
                  (unsigned long long)n, prm.block_size, (int)dt);
        mn_adamw8bit_free(&s);
        free(p), free(g), free(rp), free(h), free(rh), free(c1), free(c2), free(am1), free(am2);
    }
}

// The code of g's moment at the first step (state 0: m = (1 - beta1) g, v = (1 - beta2) g g, in
// the plain loop's order) in a block whose maxima come from g = 1; v for map2, else m.
static uint8_t first_step_code(const mn_adamw8bit_params *a, const float *map, int v, float g) {
    float w = v ? 1.0f - a->beta2 : 1.0f - a->beta1, x = v ? w * g * g : w * g;
    return ref_nearest(map, x * (1.0f / w));
}

// Gradients for the first step that put moments on both sides of every threshold of both maps
// (the smallest float g whose code reaches k, found by bisection over the floats in order, and
// the float below it): the lanes next to the quantizer's windows. Each block of bs opens with
// g = 1, its maxima. Fills g from element `from` on; returns the end.
static uint64_t put_threshold_lanes(const mn_adamw8bit_params *a, float *g, uint64_t from,
                                    uint64_t n, uint32_t bs) {
    float map[256];
    uint64_t i = from;
    int v, k;
    for (v = 0; v < 2; v++) {
        mn_dynamic_map(!v, map);
        for (k = 1; k < 256; k++) {
            uint32_t lo = float_okey(v ? 0.0f : -1.0f), hi = float_okey(1.0f), j;
            while (hi - lo > 1) {  // code(lo) < k <= code(hi)
                uint32_t mid = lo + (hi - lo) / 2;
                if (first_step_code(a, map, v, okey_float(mid)) >= k) hi = mid;
                else lo = mid;
            }
            for (j = 0; j < 2 && i < n; j++) {
                if (i % bs == 0) g[i++] = 1.0f;
                if (i < n) g[i++] = okey_float(j ? lo : hi);
            }
        }
    }
    return i;
}

// The quantized step on tensors large enough for the quantizer's arithmetic form (65536 elements
// and up), where AVX-512 builds take whole blocks of a multiple of 64 elements through their own
// loop (memanat.h, mn__opt_a8_whole), against the plain loop bit for bit: block sizes 64 to 4096
// (192: not a power of 2), last blocks of a multiple of 64 or not, decay on and off, 1 and 2
// threads, 6 steps of fresh gradients at several scales with zeros, tiny and huge values, one
// block of zeros (scales 0), runs of denormal negatives (m < 0 whose scaled value is -0), NaN and
// inf, and an overflowing v (an inf scale, then NaN moments).
static void test_adamw8bit_whole_blocks_bits(void) {
    static const uint64_t sizes[] = {65893, 70016, 81984, 69999, 66000, 65600};
    static const uint32_t blocks[] = {256, 256, 2048, 4096, 192, 64};
    size_t q;
    for (q = 0; q < 6; q++) {
        uint64_t n = sizes[q], dims[1], nb, i, k;
        float *p = mnt_fvec(n), *g = mnt_fvec(n), *rp = mnt_fvec(n);
        uint8_t *c1 = (uint8_t *)calloc(n, 1), *c2 = (uint8_t *)calloc(n, 1);
        float *am1, *am2;
        mn_adamw8bit s;
        mn_adamw8bit_params prm;
        int t, ok = 1;
#ifdef _OPENMP
        int saved = omp_get_max_threads();
        omp_set_num_threads(1 + (int)(q % 2));
#endif
        dims[0] = n;
        memset(&prm, 0, sizeof prm);
        prm.block_size = blocks[q];
        prm.weight_decay = q % 3 == 1 ? MN_OPTIM_ZERO : 0.1f;
        prm.lr = 1e-2f;
        CHECK_OK(mn_adamw8bit_init(&s, dims, 1, &prm, NULL));
        nb = s.blocks;
        am1 = (float *)calloc(nb, 4), am2 = (float *)calloc(nb, 4);
        fill_case(p, n, 1.0);
        memcpy(rp, p, n * 4);
        for (t = 1; t <= 6; t++) {
            fill_case(g, n, t % 3 == 0 ? 1e3 : t % 3 == 1 ? 1.0 : 1e-3);
            for (i = 0; i < 5; i++)  // runs of denormal negatives
                for (k = mnt_rand_u64() % (n - 40); k % 40 != 39; k++)
                    g[k] = -1e-45f * (float)(1 + k % 9);  // (-0 moments at the first step)
            if (t == 1) {
                memset(g + blocks[q], 0, blocks[q] * sizeof *g);  // block 1: scales 0
                k = put_threshold_lanes(&s.params, g, 2 * (uint64_t)blocks[q], n, blocks[q]);
                CHECK(k < n);
                for (; k < n && k % blocks[q] != 0; k++) g[k] = 0.0f;  // (|g| <= 1 there)
            }
            if (t == 3) g[n / 2] = NAN, g[n / 3] = -INFINITY, g[n / 4] = INFINITY;
            if (t == 4) g[n / 5] = 1e30f, g[n / 7] = -3e25f;  // v inf: an inf scale
            CHECK_OK(mn_adamw8bit_step(&s, p, g, NULL));
            ref_adamw8bit_step(&s.params, (uint64_t)t, rp, g, n, c1, c2, am1, am2);
            ok &= same_bits(p, rp, n * 4) && same_bits(s.code1, c1, n) &&
                  same_bits(s.code2, c2, n) && same_bits(s.absmax1, am1, nb * 4) &&
                  same_bits(s.absmax2, am2, nb * 4);
        }
        CHECK_MSG(ok, "adamw8bit n %llu block %u: not the plain loop's bits", (unsigned long long)n,
                  prm.block_size);
#ifdef _OPENMP
        omp_set_num_threads(saved);
#endif
        mn_adamw8bit_free(&s);
        free(p), free(g), free(rp), free(c1), free(c2), free(am1), free(am2);
    }
}

// The pieces of Adafactor's sums (memanat.h, MN__OPT_AF_PIECE): a batch of at most 65536
// elements goes whole, bp = 65536 / (rows * cols) batches to a piece; rows of at most 65536
// columns go rp = 65536 / cols at a time; wider rows 65536 columns at a time (sp).
enum { AF_PIECE = 65536 };
typedef struct af_geo {
    uint64_t bp, rp, sp, rows, cols;
} af_geo;
static af_geo af_pieces(uint64_t rows, uint64_t cols) {
    af_geo q;
    q.rows = rows, q.cols = cols, q.bp = 0, q.rp = 1, q.sp = cols;
    if (cols > AF_PIECE) q.sp = AF_PIECE;
    else if (rows * cols <= AF_PIECE) q.bp = AF_PIECE / (rows * cols), q.rp = rows;
    else q.rp = AF_PIECE / cols;
    return q;
}
// The piece of flat element e (pieces are runs of consecutive elements, numbered in order).
static uint64_t af_piece_of(const af_geo *q, uint64_t e) {
    uint64_t j = e % q->cols, i = e / q->cols % q->rows, b = e / q->cols / q->rows;
    uint64_t spr = (q->cols + q->sp - 1) / q->sp, rpb = (q->rows + q->rp - 1) / q->rp;
    if (q->bp) return b / q->bp;
    return (b * rpb + i / q->rp) * spr + j / q->sp;
}
// lane[l] += piece[l], then piece zeroed: a piece's lanes added to the total in piece order.
static void af_flush(double *lane, double *piece) {
    int l;
    for (l = 0; l < 16; l++) lane[l] += piece[l], piece[l] = 0.0;
}

// transformers Adafactor.step per element (memanat.h's comment block): second moment, RMS(param)
// and RMS(u) summed in double in the step's order, then the update. The order: a row's sum of
// g² + eps1 in 16 lanes by column (lane l takes the columns j % 16 == l), span by span of the
// row's pieces, added by mnt_lanes_total; a column's sum rp rows at a time, the partials added in
// order; the sum of p² (and the unfactored u²) in 16 lanes by column, each piece's lanes (in flat
// order) added to the total in piece order; the factored u² through the column sums of g² / R_i.
static void ref_adafactor_step(const mn_adafactor_params *a, uint64_t t, float *p, const float *g,
                               const uint64_t *dims, uint32_t nd, float *R, float *C, float *V,
                               float *M) {
    uint64_t n = 1, rows, cols, batch, b, i, j, k, e, pc;
    double sum, part, rho, beta2t, rms, clip, su, lane[16] = {0}, ss[16] = {0}, pl[16] = {0};
    float b2t, w2t, alpha, clip_div, decay;
    uint32_t d;
    af_geo q;
    for (d = 0; d < nd; d++) n *= dims[d];
    cols = dims[nd - 1], rows = nd >= 2 ? dims[nd - 2] : 1, batch = n / (rows * cols);
    q = af_pieces(rows, cols);
    for (pc = 0, e = 0; e < n; e++) {
        if (af_piece_of(&q, e) != pc) af_flush(lane, pl), pc = af_piece_of(&q, e);
        pl[e % cols % 16] += (double)p[e] * p[e];
    }
    af_flush(lane, pl);
    rms = (float)sqrt(mnt_lanes_total(lane) / (double)n);
    rho = a->lr > 0.0f ? a->lr : fmin(a->warmup_init ? 1e-6 * (double)t : 1e-2, 1.0 / sqrt(t));
    alpha = (float)(a->no_scale_parameter ? rho : fmax((double)a->eps2, rms) * rho);
    beta2t = 1.0 - pow((double)t, (double)a->decay_rate);
    b2t = (float)beta2t, w2t = (float)(1.0 - beta2t);
    for (b = 0; b < batch && nd >= 2; b++) {
        const float *gb = g + b * rows * cols;
        for (i = 0; i < rows; i++) {
            memset(lane, 0, sizeof lane);
            for (j = 0; j < cols; j++) {
                if (j % q.sp == 0) af_flush(lane, pl);
                pl[j % 16] += (double)(gb[i * cols + j] * gb[i * cols + j] + a->eps1);
            }
            af_flush(lane, pl);
            R[b * rows + i] =
                R[b * rows + i] * b2t + w2t * (float)(mnt_lanes_total(lane) / (double)cols);
        }
        for (j = 0; j < cols; j++) {
            for (sum = 0.0, i = 0; i < rows; i += q.rp) {
                for (part = 0.0, k = i; k < i + q.rp && k < rows; k++)
                    part += (double)(gb[k * cols + j] * gb[k * cols + j] + a->eps1);
                sum = i == 0 ? part : sum + part;
            }
            C[b * cols + j] = C[b * cols + j] * b2t + w2t * (float)(sum / (double)rows);
        }
    }
    for (i = 0; i < n && nd < 2; i++) V[i] = V[i] * b2t + w2t * (g[i] * g[i] + a->eps1);
    // factored Σu² = Σ_b mean(R) Σ_j (Σ_i g² / R_i) / C_j: the column's sum of g² (1 / R_i) rp
    // rows at a time as C's, Σ_j in 16 lanes by column, the batches in order
    for (su = 0.0, b = 0; b < batch && nd >= 2; b++) {
        const float *gb = g + b * rows * cols;
        float rmean;
        for (sum = 0.0, i = 0; i < rows; i++) sum += R[b * rows + i];
        rmean = (float)(sum / (double)rows);
        memset(lane, 0, sizeof lane);
        for (j = 0; j < cols; j++) {
            for (sum = 0.0, i = 0; i < rows; i += q.rp) {
                for (part = 0.0, k = i; k < i + q.rp && k < rows; k++) {
                    double t = (double)gb[k * cols + j] * gb[k * cols + j] *
                               (1.0 / (double)R[b * rows + k]);
                    part += t;
                }
                sum = i == 0 ? part : sum + part;
            }
            lane[j % 16] += sum / (double)C[b * cols + j];
        }
        su += (double)rmean * mnt_lanes_total(lane);
    }
    decay = -a->weight_decay * alpha;
    for (clip_div = 1.0f, k = 0; k < 2; k++) {
        for (pc = 0, b = 0; b < batch; b++) {
            float rmean = 1.0f;
            if (nd >= 2) {
                for (sum = 0.0, i = 0; i < rows; i++) sum += R[b * rows + i];
                rmean = (float)(sum / (double)rows);
            }
            for (i = 0; i < rows; i++) {
                float rf = nd >= 2 ? 1.0f / sqrtf(R[b * rows + i] / rmean) : 1.0f;
                for (j = 0; j < cols; j++) {
                    float u;
                    e = (b * rows + i) * cols + j;
                    u = nd >= 2 ? rf * (1.0f / sqrtf(C[b * cols + j])) * g[e]
                                : (1.0f / sqrtf(V[e])) * g[e];
                    if (k == 0 && nd >= 2) break;  // (Σu² above)
                    if (k == 0) {
                        if (af_piece_of(&q, e) != pc) af_flush(ss, pl), pc = af_piece_of(&q, e);
                        pl[j % 16] += (double)u * u;
                        continue;
                    }
                    u = u / clip_div * alpha;
                    if (M) u = M[e] = M[e] * a->beta1 + (1.0f - a->beta1) * u;
                    if (a->weight_decay != 0.0f) p[e] = p[e] + decay * p[e];
                    p[e] = p[e] - u;
                }
            }
        }
        af_flush(ss, pl);
        if (nd < 2) su = mnt_lanes_total(ss);
        clip = sqrt(su / (double)n) / (double)a->clip_threshold;
        clip_div = (float)(clip > 1.0 ? clip : 1.0);
    }
}

static void test_adafactor_bits_vs_plain_loop(void) {
    static const uint64_t shapes[4][3] = {{37, 1031, 0}, {5003, 0, 0}, {3, 17, 523}, {129, 33, 0}};
    static const uint32_t nds[4] = {2, 1, 3, 2};
    size_t q;
    for (q = 0; q < 4 * 3; q++) {
        const uint64_t *dims = shapes[q % 4];
        uint32_t nd = nds[q % 4], d;
        uint64_t n = 1, nr, nc;
        mn_dtype dt = bit_dtypes[q / 4];
        float *p, *g, *rp, *R, *C, *V, *M;
        uint16_t *h, *rh;
        mn_adafactor s;
        mn_adafactor_params prm;
        int t, ok = 1;
        for (d = 0; d < nd; d++) n *= dims[d];
        nr = nd >= 2 ? n / dims[nd - 1] : 1, nc = nd >= 2 ? n / dims[nd - 2] : 1;
        p = mnt_fvec(n), g = mnt_fvec(n), rp = mnt_fvec(n), V = mnt_fvec(n), M = mnt_fvec(n);
        R = mnt_fvec(nr), C = mnt_fvec(nc);
        h = (uint16_t *)malloc(n * 2), rh = (uint16_t *)malloc(n * 2);
        memset(&prm, 0, sizeof prm);
        if (q % 2) prm.beta1 = 0.9f, prm.weight_decay = 0.01f;
        if (q % 3 == 1) prm.lr = 1e-3f, prm.no_scale_parameter = 1;
        if (q % 3 == 2) prm.clip_threshold = 0.05f, prm.warmup_init = 1;
        prm.dtype = dt;
        CHECK_OK(mn_adafactor_init(&s, dims, nd, &prm, NULL));
        memset(R, 0, nr * 4), memset(C, 0, nc * 4), memset(V, 0, n * 4), memset(M, 0, n * 4);
        fill_case(p, n, 1.0);
        memcpy(rp, p, n * 4);
        for (t = 1; t <= 4; t++) {
            mnt_fill_normal(g, n, t % 2 ? 1e-2 : 1.0);
            CHECK_OK(mn_adafactor_step(&s, p, g, h));
            ref_adafactor_step(&s.params, (uint64_t)t, rp, g, dims, nd, R, C, V,
                               s.exp_avg ? M : NULL);
            ref_store16(dt, rp, rh, n);
            ok &= same_bits(p, rp, n * 4) && (dt == MN_FP32 || same_bits(h, rh, n * 2));
            ok &= nd >= 2 ? same_bits(s.exp_avg_sq_row, R, nr * 4) &&
                                same_bits(s.exp_avg_sq_col, C, nc * 4)
                          : same_bits(s.exp_avg_sq, V, n * 4);
            ok &= !s.exp_avg || same_bits(s.exp_avg, M, n * 4);
        }
        CHECK_MSG(ok, "adafactor case %d dtype %d: not the plain loop's bits", (int)(q % 4),
                  (int)dt);
        mn_adafactor_free(&s);
        free(p), free(g), free(rp), free(R), free(C), free(V), free(M), free(h), free(rh);
    }
}

// Adafactor with rows wider than the 2048 columns whose scratch (column sums and factors) the step
// keeps on its stack (it allocates it beyond), at 2048, and a wide shape whose scratch allocation
// fails (the column sums then take a second read of the gradient, the factors are recomputed per
// row): the plain loop's bits over 3 steps, with the first moment and clipping on some shapes.
static void test_adafactor_wide_bits_vs_plain_loop(void) {
    static const uint64_t shapes[4][2] = {{11, 2053}, {2, 4099}, {21, 2048}, {13, 2085}};
    size_t q;
    for (q = 0; q < 4; q++) {
        const uint64_t *dims = shapes[q];
        uint64_t n = dims[0] * dims[1];
        float *p = mnt_fvec(n), *g = mnt_fvec(n), *rp = mnt_fvec(n), *M = mnt_fvec(n);
        float *R = mnt_fvec(dims[0]), *C = mnt_fvec(dims[1]);
        mn_adafactor s;
        mn_adafactor_params prm;
        int t, ok = 1;
        memset(&prm, 0, sizeof prm);
        if (q != 1) prm.beta1 = 0.9f, prm.clip_threshold = 0.05f;
        CHECK_OK(mn_adafactor_init(&s, dims, 2, &prm, NULL));
        memset(R, 0, dims[0] * 4), memset(C, 0, dims[1] * 4), memset(M, 0, n * 4);
        fill_case(p, n, 1.0);
        memcpy(rp, p, n * 4);
        for (t = 1; t <= 3; t++) {
            long before = mnt_total_allocs();
            mnt_fill_normal(g, n, t % 2 ? 1e-2 : 1.0);
            if (q == 3) mnt_fail_alloc_after(1);  // the scratch
            CHECK_OK(mn_adafactor_step(&s, p, g, NULL));
            mnt_fail_alloc_after(0);
            CHECK(mnt_total_allocs() - before == (q < 2));  // q = 3: the one that failed
            ref_adafactor_step(&s.params, (uint64_t)t, rp, g, dims, 2, R, C, NULL,
                               s.exp_avg ? M : NULL);
            ok &= same_bits(p, rp, n * 4) && same_bits(s.exp_avg_sq_row, R, dims[0] * 4) &&
                  same_bits(s.exp_avg_sq_col, C, dims[1] * 4);
            ok &= !s.exp_avg || same_bits(s.exp_avg, M, n * 4);
        }
        CHECK_MSG(ok, "adafactor [%llu, %llu]: not the plain loop's bits",
                  (unsigned long long)dims[0], (unsigned long long)dims[1]);
        mn_adafactor_free(&s);
        free(p), free(g), free(rp), free(M), free(R), free(C);
    }
}

// Adafactor on shapes of several pieces of its sums (pieces of whole batches, of rows, of
// row spans, a vector of spans), ragged last pieces, one of them wider than the stacked scratch
// and one whose scratch allocation fails (the column sums then take a second read, rp rows at a
// time): the plain loop's bits over 3 steps, then the steps that a team of two threads takes
// (from shapes large enough for one) against one thread's and the plain loop's, bit for bit.
static void test_adafactor_pieces_bits(void) {
    static const uint64_t shapes[][3] = {
        {40, 50, 40}, {300, 700, 0}, {3, 70001, 0}, {150001, 0, 0}, {90, 3001, 0},
        {1100, 1000, 0}, {2, 1030, 1031}, {400, 3000, 0}, {17, 70001, 0}, {1100017, 0, 0}};
    static const uint32_t nds[] = {3, 2, 2, 1, 2, 2, 3, 2, 2, 1};
    size_t q;
    for (q = 0; q < sizeof nds / sizeof nds[0]; q++) {
        const uint64_t *dims = shapes[q];
        uint32_t nd = nds[q], d;
        uint64_t n = 1, nr, nc;
        int big = q >= 5, runs = 1, run, t, ok = 1;
        float *p, *g, *rp, *R, *C, *V, *M;
        mn_adafactor s[2];
        mn_adafactor_params prm;
        for (d = 0; d < nd; d++) n *= dims[d];
        nr = nd >= 2 ? n / dims[nd - 1] : 1, nc = nd >= 2 ? n / dims[nd - 2] : 1;
        p = mnt_fvec(2 * n), g = mnt_fvec(n), rp = mnt_fvec(n), V = mnt_fvec(n), M = mnt_fvec(n);
        R = mnt_fvec(nr), C = mnt_fvec(nc);
        memset(&prm, 0, sizeof prm);
        if (q % 2) prm.beta1 = 0.9f, prm.weight_decay = 0.01f;
        if (q % 3 == 2) prm.clip_threshold = 0.05f;
#ifdef _OPENMP
        if (big) runs = 2;
#endif
        for (run = 0; run < runs; run++) CHECK_OK(mn_adafactor_init(&s[run], dims, nd, &prm, NULL));
        memset(R, 0, nr * 4), memset(C, 0, nc * 4), memset(V, 0, n * 4), memset(M, 0, n * 4);
        fill_case(p, n, 1.0);
        memcpy(rp, p, n * 4), memcpy(p + n, p, n * 4);
        for (t = 1; t <= 3; t++) {
            mnt_fill_normal(g, n, t % 2 ? 1e-2 : 1.0);
            for (run = 0; run < runs; run++) {
#ifdef _OPENMP
                int saved = omp_get_max_threads();
                omp_set_num_threads(run + 1);
                memset(&s[run].tune, 0, sizeof s[run].tune);  // untimed: the team runs the step
#endif
                if (q == 4 && t == 2) mnt_fail_alloc_after(1);  // the scratch of 3001 columns
                CHECK_OK(mn_adafactor_step(&s[run], p + run * n, g, NULL));
                mnt_fail_alloc_after(0);
#ifdef _OPENMP
                omp_set_num_threads(saved);
#endif
            }
            ref_adafactor_step(&s[0].params, (uint64_t)t, rp, g, dims, nd, R, C, V,
                               s[0].exp_avg ? M : NULL);
            for (run = 0; run < runs; run++) {
                ok &= same_bits(p + run * n, rp, n * 4);
                ok &= nd >= 2 ? same_bits(s[run].exp_avg_sq_row, R, nr * 4) &&
                                    same_bits(s[run].exp_avg_sq_col, C, nc * 4)
                              : same_bits(s[run].exp_avg_sq, V, n * 4);
                ok &= !s[run].exp_avg || same_bits(s[run].exp_avg, M, n * 4);
            }
        }
        CHECK_MSG(ok, "adafactor shape %d (%d runs): not the plain loop's bits", (int)q, runs);
        for (run = 0; run < runs; run++) mn_adafactor_free(&s[run]);
        free(p), free(g), free(rp), free(R), free(C), free(V), free(M);
        (void)big;
    }
}

// Data on which the order of Adafactor's sums shows in the floats, at [1024, 1040] (17 pieces:
// 16 of 63 rows, one of 16; 65 columns of each lane in a row): g = p = 1 but g[0][0] = 2^27,
// g[1][0] = 2^15 and p[0][0] = y. Column 0's terms are 2^54, 2^30 and ones: each one added
// alone to 2^54 + 2^30 vanishes (half an ulp is 2), so in one sequence the sum stays 2^54 + 2^30,
// whose mean (/ 1024) is halfway between two floats and rounds down (to even), while the later
// pieces' ones, summed first, count and round it up. RMS(p): lane 0 holds y² (>= 2^54) and
// ones the same way; y is found where the two orders give different floats.
static float af_order_rms(float y, int pieces) {
    double lane[16];
    int k, l;
    for (l = 0; l < 16; l++) lane[l] = 1024.0 * 65;
    lane[0] = (double)y * y;
    for (k = 1; pieces && k < 17; k++) lane[0] += (k < 16 ? 63.0 : 16.0) * 65;
    return (float)sqrt(mnt_lanes_total(lane) / (1024.0 * 1040));
}

static void test_adafactor_pieces_order(void) {
    uint64_t dims[2] = {1024, 1040}, n = 1024 * 1040, i;
    float y = 134217728.0f, cp = (float)((18014398509481984.0 + 1073741824.0) / 1024.0);  // 2^27
    float *p = mnt_fvec(2 * n), *g = mnt_fvec(n), *rp = mnt_fvec(n), *R = mnt_fvec(1024);
    float *C = mnt_fvec(1040);
    int run, runs = 1, tries;
    for (tries = 0; tries < 1 << 20 && af_order_rms(y, 1) == af_order_rms(y, 0); tries++)
        y = nextafterf(y, INFINITY);
    CHECK(af_order_rms(y, 1) != af_order_rms(y, 0));  // the data tells the orders apart
#ifdef _OPENMP
    runs = 2;
#endif
    for (i = 0; i < n; i++) g[i] = 1.0f, rp[i] = 1.0f;
    g[0] = 134217728.0f, g[1040] = 32768.0f, rp[0] = y;
    memset(R, 0, 1024 * 4), memset(C, 0, 1040 * 4);
    memcpy(p, rp, n * 4), memcpy(p + n, rp, n * 4);
    for (run = 0; run < runs; run++) {
        mn_adafactor s;
        CHECK_OK(mn_adafactor_init(&s, dims, 2, NULL, NULL));
        if (run == 0) ref_adafactor_step(&s.params, 1, rp, g, dims, 2, R, C, NULL, NULL);
        CHECK(C[0] > cp);  // rounded up: one sequence would give cp
#ifdef _OPENMP
        {
            int saved = omp_get_max_threads();
            omp_set_num_threads(run + 1);  // a fresh state: the team takes the first step
            CHECK_OK(mn_adafactor_step(&s, p + run * n, g, NULL));
            omp_set_num_threads(saved);
        }
#else
        CHECK_OK(mn_adafactor_step(&s, p + run * n, g, NULL));
#endif
        CHECK(s.exp_avg_sq_col[0] == C[0] && s.rms == af_order_rms(y, 1));
        CHECK(same_bits(p + run * n, rp, n * 4) && same_bits(s.exp_avg_sq_row, R, 1024 * 4) &&
              same_bits(s.exp_avg_sq_col, C, 1040 * 4));
        mn_adafactor_free(&s);
    }
    free(p), free(g), free(rp), free(R), free(C);
}

// Adafactor's update divisor max(1, RMS(u) / d) (mn_adafactor.clip_div) against the double
// formula on the state the step leaves, u_ij = g_ij / sqrt(R_i C_j / mean(R)), to 2.4e-7 relative
// (2 to 4 float ulps, for the float mean(R) of the step's factors and the double sums' rounding):
// shapes of one piece, of pieces of rows (odd columns), of whole batches, of row spans (cols >
// 65536), with allocated scratch, and one that a team of two takes; clipping active (d = 0.05)
// and not (d = 1000, the divisor 1). The update to fp32 rounding of the double one, and 1 and 2
// threads bit for bit.
static void test_adafactor_clip_sum(void) {
    static const uint64_t shapes[][3] = {{1, 37, 41},  {1, 300, 333},  {4, 7, 517},
                                         {1, 3, 70001}, {1, 97, 2049}, {1, 1100, 1001}};
    size_t q;
    int clip;
    for (q = 0; q < sizeof shapes / sizeof shapes[0]; q++)
        for (clip = 0; clip < 2; clip++) {
            uint64_t B = shapes[q][0], R = shapes[q][1], Cc = shapes[q][2], n = B * R * Cc;
            uint64_t dims[3], b, i, j, e, bad = 0;
            uint32_t nd = B > 1 ? 3 : 2;
            float *p = mnt_fvec(2 * n), *g = mnt_fvec(n);
            double *p0 = mnt_dvec(n), *ud = mnt_dvec(n), su, mr, div;
            mn_adafactor s[2];
            mn_adafactor_params prm;
            int run, runs = 1, t, same = 1;
#ifdef _OPENMP
            runs = 2;
#endif
            if (nd == 3) dims[0] = B, dims[1] = R, dims[2] = Cc;
            else dims[0] = R, dims[1] = Cc;
            memset(&prm, 0, sizeof prm);
            prm.clip_threshold = clip ? 0.05f : 1000.0f;
            for (run = 0; run < runs; run++)
                CHECK_OK(mn_adafactor_init(&s[run], dims, nd, &prm, NULL));
            fill_case(p, n, 1.0);
            memcpy(p + n, p, n * 4);
            for (t = 1; t <= 3; t++) {
                mnt_fill_normal(g, n, t == 2 ? 1e-3 : 1.0);
                mnt_to_double(p, p0, n);
                for (run = 0; run < runs; run++) {
#ifdef _OPENMP
                    int saved = omp_get_max_threads();
                    omp_set_num_threads(run + 1);
                    memset(&s[run].tune, 0, sizeof s[run].tune);  // untimed: the team runs it
#endif
                    CHECK_OK(mn_adafactor_step(&s[run], p + run * n, g, NULL));
#ifdef _OPENMP
                    omp_set_num_threads(saved);
#endif
                }
                for (su = 0.0, b = 0; b < B; b++) {
                    const float *Rb = s[0].exp_avg_sq_row + b * R;
                    const float *Cb = s[0].exp_avg_sq_col + b * Cc;
                    for (mr = 0.0, i = 0; i < R; i++) mr += Rb[i];
                    for (mr /= (double)R, i = 0; i < R; i++)
                        for (j = 0; j < Cc; j++) {
                            e = (b * R + i) * Cc + j;
                            ud[e] = g[e] / sqrt((double)Rb[i] * Cb[j] / mr);
                            su += ud[e] * ud[e];
                        }
                }
                div = fmax(1.0, sqrt(su / (double)n) / prm.clip_threshold);
                CHECK_NEAR(s[0].clip_div, div, 0, 2.4e-7);
                // (at t = 2, g 1e-3 against the moments of t = 1: |u| small, no clipping)
                CHECK(clip && t != 2 ? s[0].clip_div > 1.0f : s[0].clip_div == 1.0f);
                for (e = 0; e < n; e++) {
                    double upd = s[0].alpha * ud[e] / div, got = (double)p[e] - p0[e];
                    double ulps = 2.5e-7 * fmax(fabs(p0[e]), fabs((double)p[e]));
                    if (!(fabs(got + upd) <= ulps + 2e-6 * fabs(upd))) bad++;
                }
                for (run = 1; run < runs; run++)
                    same &= same_bits(p + run * n, p, n * 4) && s[run].clip_div == s[0].clip_div &&
                            same_bits(s[run].exp_avg_sq_row, s[0].exp_avg_sq_row, B * R * 4) &&
                            same_bits(s[run].exp_avg_sq_col, s[0].exp_avg_sq_col, B * Cc * 4);
            }
            CHECK_MSG(bad == 0, "adafactor [%llu,%llu,%llu] clip %d: %llu updates off",
                      (unsigned long long)B, (unsigned long long)R, (unsigned long long)Cc, clip,
                      (unsigned long long)bad);
            CHECK_MSG(same, "adafactor [%llu,%llu,%llu]: 2 threads not 1 thread's bits",
                      (unsigned long long)B, (unsigned long long)R, (unsigned long long)Cc);
            for (run = 0; run < runs; run++) mn_adafactor_free(&s[run]);
            free(p), free(g), free(p0), free(ud);
        }
}

// Checks the codes of mn_quantize_blockwise for x [n] (blocks of bs) against the search.
static uint64_t quantize_mismatches(const float *map, const float *x, uint64_t n, uint32_t bs,
                                    uint8_t *codes, float *absmax) {
    uint64_t i, bad = 0;
    if (mn_quantize_blockwise(map, x, n, bs, codes, absmax) != MN_OK) return n;
    for (i = 0; i < n; i++) {
        float am = absmax[i / bs], inv = am > 0.0f ? 1.0f / am : 0.0f;
        if (codes[i] != ref_nearest(map, x[i] * inv)) bad++;
    }
    return bad;
}

typedef struct qsweep {
    const float *map;
    float *x, absmax[128];  // blocks of at least 1021 in QSWEEP_CH values
    uint8_t *codes;
    uint64_t fill, bad, checked;
} qsweep;
enum { QSWEEP_CH = 1 << 16 };

// Quantizes what was put so far (at least 16384 values, so that the tables are used).
static void qsweep_flush(qsweep *q) {
    while (q->fill < 16384) q->x[q->fill++] = 0.5f;
    q->bad += quantize_mismatches(q->map, q->x, q->fill, 1024, q->codes, q->absmax);
    q->checked += q->fill, q->fill = 0;
}

// Puts v in a block of 1024 whose first value is 1.0: absmax 1, so the code is that of v itself.
static void qsweep_put(qsweep *q, float v) {
    if (q->fill % 1024 == 0) q->x[q->fill++] = 1.0f;
    q->x[q->fill++] = v;
    if (q->fill == QSWEEP_CH) qsweep_flush(q);
}

// The table that replaces the search (large tensors) against the search itself. Every float at a
// bucket's edge (sign, exponent from 2^-30 to 4, top 7 mantissa bits), 16 floats on each side of
// every midpoint of two neighbouring entries, NaN, infinities, zeros, and a sweep over the floats
// of [-1, 1] with a random stride (MN_TEST_EXHAUSTIVE=1: every float of [-1, 1], minutes); then
// random tensors at other scales, where x / absmax rounds and may land just above 1.
static void test_quantize_table_vs_search(void) {
    const char *env = getenv("MN_TEST_EXHAUSTIVE");
    int exhaustive = env && env[0] == '1';
    float map[256];
    uint32_t stride = exhaustive ? 1u : 89u + (uint32_t)(mnt_rand_u64() % 64), u, e, k;
    qsweep q;
    int s, sg, d;
    memset(&q, 0, sizeof q);
    q.x = mnt_fvec(QSWEEP_CH), q.codes = (uint8_t *)malloc(QSWEEP_CH), q.map = map;
    for (s = 0; s < 2; s++) {
        mn_dynamic_map(s, map);
        for (sg = 0; sg < 2; sg++)
            for (e = 97; e <= 129; e++)
                for (k = 0; k < 128; k++) {
                    u = (e << 23) | (k << 16) | (sg ? 0x80000000u : 0u);
                    qsweep_put(&q, bits_to_float(u));
                    qsweep_put(&q, bits_to_float(u + 0xffffu));
                    qsweep_put(&q, bits_to_float(u - 1u));
                }
        for (k = 1; k < 256; k++) {
            float mid = map[k - 1] + (map[k] - map[k - 1]) / 2.0f, v = mid, w = mid;
            for (d = 0; d < 16; d++) {
                qsweep_put(&q, v), qsweep_put(&q, w);
                v = nextafterf(v, -2.0f), w = nextafterf(w, 2.0f);
            }
        }
        qsweep_put(&q, NAN), qsweep_put(&q, -NAN), qsweep_put(&q, 0.0f), qsweep_put(&q, -0.0f);
        qsweep_put(&q, 1e-45f), qsweep_put(&q, -1e-45f), qsweep_put(&q, -1.0f);
        qsweep_put(&q, 0.99999994f), qsweep_put(&q, -0.99999994f);
        for (u = (uint32_t)(mnt_rand_u64() % stride); u <= 0x3f800000u; u += stride)
            qsweep_put(&q, bits_to_float(u)), qsweep_put(&q, bits_to_float(u | 0x80000000u));
        qsweep_flush(&q);
        q.x[0] = INFINITY;  // absmax inf: x * 0 is NaN or 0
        for (k = 0; k < 4; k++) {
            double sc = k == 0 ? 3.0 : k == 1 ? 1e-3 : k == 2 ? 7e5 : 0.1;
            if (k > 0) mnt_fill_normal(q.x, QSWEEP_CH, sc);
            q.bad += quantize_mismatches(map, q.x, QSWEEP_CH, k == 3 ? 1021 : 1024, q.codes,
                                         q.absmax);
            q.checked += QSWEEP_CH;
        }
    }
    if (mnt_verbose()) printf("  %llu values checked\n", (unsigned long long)q.checked);
    CHECK_MSG(q.bad == 0, "%llu of %llu codes differ from the search", (unsigned long long)q.bad,
              (unsigned long long)q.checked);
    free(q.x), free(q.codes);
}

static int cmp_float_asc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

// mn_quantize_blockwise against the search on maps of several shapes, so that the quantizer's
// arithmetic form (memanat.h, mn__opt_qarith) meets maps it takes and maps it turns down: the
// dynamic maps with entries moved by up to 3 floats (0 and 1 kept), evenly spaced signed (0 at
// 127, 1 at 255) and unsigned maps, sorted random maps. Values: at and next to every midpoint,
// mirrored, and at random; one block whose absmax is 1, so that the values quantize unscaled.
static void test_quantize_maps_vs_search(void) {
    enum { N = 1 << 16 };
    float map[256], *x = mnt_fvec(N), absmax[1];
    uint8_t *codes = (uint8_t *)malloc(N);
    uint64_t bad = 0;
    int f, k, d, n;
    for (f = 0; f < 7; f++) {
        if (f < 4) {
            mn_dynamic_map(f % 2, map);
            for (k = 0; k < 255 && f >= 2; k++) {
                if (map[k] == 0.0f) continue;
                for (d = (int)(mnt_rand_u64() % 4); d > 0; d--)
                    map[k] = nextafterf(map[k], mnt_rand_u64() % 2 ? 2.0f : -2.0f);
            }
        } else if (f == 4) {
            for (k = 0; k < 255; k++) map[k] = (float)(k - 127) / 128.0f;
            map[255] = 1.0f;
        } else if (f == 5) {
            for (k = 0; k < 256; k++) map[k] = (float)k / 255.0f;
        } else {
            for (k = 0; k < 256; k++) map[k] = 2.0f * (float)(mnt_rand_u64() % 1000000) / 1e6f - 1.0f;
            qsort(map, 256, sizeof map[0], cmp_float_asc);
            for (k = 1; k < 256; k++)
                if (map[k] <= map[k - 1]) map[k] = nextafterf(map[k - 1], 2.0f);
        }
        n = 0;
        x[n++] = 1.0f;
        for (k = 1; k < 256; k++) {
            float mid = map[k - 1] + (map[k] - map[k - 1]) / 2.0f, v = mid, w = mid;
            for (d = 0; d < 6; d++) {
                x[n++] = v, x[n++] = w, x[n++] = -v, x[n++] = -w;
                v = nextafterf(v, -2.0f), w = nextafterf(w, 2.0f);
            }
        }
        for (; n < N; n++) x[n] = 2.0f * (float)(mnt_rand_u64() % 16777216) / 16777216.0f - 1.0f;
        for (k = 0; k < N; k++)  // (|x| <= 1: the block's absmax is 1)
            if (!(fabsf(x[k]) <= 1.0f)) x[k] = 0.5f;
        bad += quantize_mismatches(map, x, N, N, codes, absmax);
        CHECK_NEAR(absmax[0], 1.0, 0, 0);
    }
    CHECK_MSG(bad == 0, "%llu codes differ from the search", (unsigned long long)bad);
    free(x), free(codes);
}

const mnt_case test_optim_cases[] = {
    {"adamw_steps", test_adamw_steps},
    {"adamw_first_step_closed_form", test_adamw_first_step_closed_form},
    {"adamw_1000_steps", test_adamw_1000_steps},
    {"adamw_fast_path_bits", test_adamw_fast_path_bits},
    {"sgd_steps", test_sgd_steps},
    {"sgd_first_step_closed_form", test_sgd_first_step_closed_form},
    {"adafactor_steps", test_adafactor_steps},
    {"lion_steps", test_lion_steps},
    {"dynamic_map", test_dynamic_map},
    {"quantize_blockwise", test_quantize_blockwise},
    {"adamw8bit_steps", test_adamw8bit_steps},
    {"adamw8bit_keeps_sign", test_adamw8bit_keeps_sign},
    {"adamw8bit_small_tensor", test_adamw8bit_small_tensor},
    {"adamw8bit_converges", test_adamw8bit_converges},
    {"half_params", test_half_params},
    {"state_bytes_match_allocation", test_state_bytes_match_allocation},
    {"state_bytes_values", test_state_bytes_values},
    {"init_out_of_memory", test_init_out_of_memory},
    {"bad_arguments", test_bad_arguments},
    {"clip_grad_norm", test_clip_grad_norm},
    {"loss_scaler_sequence", test_loss_scaler_sequence},
    {"loss_scaler_with_fp16_grads", test_loss_scaler_with_fp16_grads},
    {"unscale", test_unscale},
    {"fp16_exhaustive", test_fp16_exhaustive},
    {"bf16_exhaustive", test_bf16_exhaustive},
    {"fp32_to_half_random", test_fp32_to_half_random},
    {"fp32_to_half_edges", test_fp32_to_half_edges},
    {"conversion_arrays", test_conversion_arrays},
    {"conversion_arrays_bits", test_conversion_arrays_bits},
    {"adamw_bits_vs_plain_loop", test_adamw_bits_vs_plain_loop},
    {"sgd_lion_bits_vs_plain_loop", test_sgd_lion_bits_vs_plain_loop},
    {"adamw8bit_bits_vs_plain_loop", test_adamw8bit_bits_vs_plain_loop},
    {"adamw8bit_whole_blocks_bits", test_adamw8bit_whole_blocks_bits},
    {"quantize_maps_vs_search", test_quantize_maps_vs_search},
    {"adafactor_bits_vs_plain_loop", test_adafactor_bits_vs_plain_loop},
    {"adafactor_wide_bits_vs_plain_loop", test_adafactor_wide_bits_vs_plain_loop},
    {"adafactor_pieces_bits", test_adafactor_pieces_bits},
    {"adafactor_pieces_order", test_adafactor_pieces_order},
    {"adafactor_clip_sum", test_adafactor_clip_sum},
    {"divc_bits", test_optim_divc_bits},
    {"team_tune", test_optim_team_tune},
    {"quantize_table_vs_search", test_quantize_table_vs_search},
};
const size_t test_optim_count = sizeof test_optim_cases / sizeof test_optim_cases[0];
