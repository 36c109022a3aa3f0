// GPU tests of memanat_cuda.cu: every kernel and GEMM epilogue against the CPU reference ops on
// fresh random inputs (odd sizes: C not a multiple of 8, T = 1, V = 50257), in fp32, fp16 and
// bf16 storage; the caching allocator's invariants on the real device backend; a device OOM
// with PyTorch's message. Written outputs are poisoned with NaN (bytes 0xFF) before each run and
// every element is checked written (finite). Inputs are rounded to the storage type first, so
// the reference sees what the kernel reads; tolerance |got - want| <= tol (1 + |want|) with tol
// fp32 1e-4 (GEMMs with TF32 off), fp16 4e-3, bf16 1.6e-2, reported as max abs/rel error.
//
// Without a device it prints one line, "SKIP cuda: no CUDA device (<reason>)", and exits 0.
// Usage: build/test_cuda [name]   (a case's name runs that case alone, another string every case
// whose name contains it; MN_TEST_SEED=N repeats a run); build/test_cuda --list names the cases.
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MEMANAT_IMPLEMENTATION
#define MEMANAT_CUDA
#include "../memanat.h"

static mn_cuda ctx, ctx_unfused;  // fused epilogues allowed / never
static int cur_failed;
static uint64_t rng;

#define FAIL(...) do { printf("[FAIL] %s:%d ", __FILE__, __LINE__); printf(__VA_ARGS__); \
    printf("\n"); cur_failed++; } while (0)
#define OK(expr) do { mn_result r_ = (expr); if (r_ != MN_OK) { \
    FAIL("%s got %d (%s)", #expr, (int)r_, mn_result_str(r_)); return; } } while (0)
#define CHECK(c) do { if (!(c)) FAIL("%s is false", #c); } while (0)

static void log_stderr(void *u, mn_log_level l, const char *msg) {
    (void)u, (void)l;
    fprintf(stderr, "  log: %s\n", msg);
}

static double urand(void) {
    uint64_t z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
}
static float nrand(void) {
    double u1 = urand(), u2 = urand();
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static const mn_dtype dts[3] = {MN_FP32, MN_FP16, MN_BF16};
static const double dt_tol[3] = {1e-4, 4e-3, 1.6e-2};
static size_t esz(mn_dtype dt) { return dt == MN_FP32 ? 4 : 2; }

static float stf(mn_dtype dt, float x) {
    if (dt == MN_FP16) return mn_fp16_to_fp32(mn_fp32_to_fp16(x));
    if (dt == MN_BF16) return mn_bf16_to_fp32(mn_fp32_to_bf16(x));
    return x;
}

static float *hvec(size_t n) {
    float *p = (float *)calloc(n ? n : 1, sizeof(float));
    if (!p) abort();
    return p;
}
static float *hrand(mn_dtype dt, size_t n, float scale) {
    float *p = hvec(n);
    size_t i;
    for (i = 0; i < n; i++) p[i] = stf(dt, scale * nrand());
    return p;
}

// Device copies in a storage type.
static void *dev(mn_dtype dt, const float *h, size_t n) {
    void *d = NULL, *tmp = malloc(n * esz(dt) + 1);
    size_t i;
    if (!tmp) abort();
    if (dt == MN_FP32) memcpy(tmp, h, n * 4);
    else
        for (i = 0; i < n; i++)
            ((uint16_t *)tmp)[i] = dt == MN_FP16 ? mn_fp32_to_fp16(h[i]) : mn_fp32_to_bf16(h[i]);
    if (mn_cuda_mem_alloc(&ctx, n * esz(dt), &d) != MN_OK ||
        mn_cuda_mem_copy(&ctx, d, tmp, n * esz(dt)) != MN_OK) {
        printf("[FAIL] device allocation or copy of %zu elements\n", n);
        exit(1);
    }
    free(tmp);
    return d;
}
static void *dev_poisoned(mn_dtype dt, size_t n) {
    void *d = NULL;
    if (mn_cuda_mem_alloc(&ctx, n * esz(dt), &d) != MN_OK ||
        mn_cuda_mem_set(&ctx, d, 0xFF, n * esz(dt)) != MN_OK) {
        printf("[FAIL] device allocation of %zu elements\n", n);
        exit(1);
    }
    return d;
}
static float *down(mn_dtype dt, const void *d, size_t n) {
    float *h = hvec(n);
    void *tmp = malloc(n * esz(dt) + 1);
    size_t i;
    if (!tmp) abort();
    if (mn_cuda_mem_copy(&ctx, tmp, d, n * esz(dt)) != MN_OK) {
        printf("[FAIL] device copy\n");
        exit(1);
    }
    for (i = 0; i < n; i++)
        h[i] = dt == MN_FP32 ? ((float *)tmp)[i]
             : dt == MN_FP16 ? mn_fp16_to_fp32(((uint16_t *)tmp)[i])
                             : mn_bf16_to_fp32(((uint16_t *)tmp)[i]);
    free(tmp);
    return h;
}
static void release(void *d) { (void)mn_cuda_mem_release(&ctx, d); }

// Every element written (finite) and within tol (1 + |want|); prints the errors with -v.
static int verbose;
// compare_some: at most `allowed` elements past tol, none past cap (absolute).
static void compare_some(const char *what, mn_dtype dt, double tol, size_t allowed, double cap,
                         const void *d, const float *want, size_t n) {
    float *got = down(dt, d, n);
    double max_abs = 0, max_rel = 0;
    size_t i, bad = 0, unwritten = 0, worst = 0;
    for (i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        if (got[i] != got[i] || isinf(got[i])) {
            unwritten++;
            continue;
        }
        if (e > max_abs) max_abs = e, worst = i;
        if (want[i] != 0 && e / fabs(want[i]) > max_rel) max_rel = e / fabs(want[i]);
        if (e > tol * (1.0 + fabs(want[i]))) bad++;
    }
    if (bad > allowed || unwritten || max_abs > cap)
        FAIL("%s (%s, n=%zu): %zu off, %zu not written (NaN/inf); worst [%zu] got %.7g want %.7g; "
             "max abs %.3g max rel %.3g tol %.1e", what, mn_dtype_name(dt), n, bad, unwritten,
             worst, got[worst], want[worst], max_abs, max_rel, tol);
    else if (verbose)
        printf("  %-34s %-4s n=%-9zu max abs %.3g  max rel %.3g  (tol %.1e)%s\n", what,
               mn_dtype_name(dt), n, max_abs, max_rel, tol, bad ? " (some past tol: allowed)" : "");
    free(got);
}
static void compare(const char *what, mn_dtype dt, double tol, const void *d, const float *want,
                    size_t n) {
    compare_some(what, dt, tol, 0, INFINITY, d, want, n);
}

// ---- kernels ------------------------------------------------------------------------------------

static void test_gelu(void) {
    static const size_t sizes[] = {1, 1001, 1 << 20};
    size_t s;
    int d;
    for (d = 0; d < 3; d++)
        for (s = 0; s < 3; s++) {
            mn_dtype dt = dts[d];
            size_t n = sizes[s];
            float *x = hrand(dt, n, 3), *dy = hrand(dt, n, 1), *dx = hrand(dt, n, 1);
            float *ref = hvec(n);
            void *dx_d = dev(dt, x, n), *dout = dev_poisoned(dt, n), *ddy = dev(dt, dy, n);
            void *ddx = dev(dt, dx, n);
            mn_gelu_forward(ref, x, n);
            OK(mn_cuda_gelu_forward(&ctx, dout, dx_d, n, dt));
            compare("gelu forward", dt, dt_tol[d], dout, ref, n);
            mn_gelu_backward(dx, dy, x, n);
            OK(mn_cuda_gelu_backward(&ctx, ddx, ddy, dx_d, n, dt));
            compare("gelu backward", dt, dt_tol[d], ddx, dx, n);
            release(dx_d), release(dout), release(ddy), release(ddx);
            free(x), free(dy), free(dx), free(ref);
        }
}

// Residual add, out = inp1 + inp2 and in place (out = inp1), against mn_residual_forward; the
// sizes take both the 16-byte and the element path (1001 is not a multiple of the pack; a pointer
// one element in is not 16-byte aligned).
static void test_residual(void) {
    static const size_t sizes[] = {1, 1001, 1 << 20};
    size_t s;
    int d;
    for (d = 0; d < 3; d++)
        for (s = 0; s < 3; s++) {
            mn_dtype dt = dts[d];
            size_t n = sizes[s], i;
            float *a = hrand(dt, n + 1, 1), *b = hrand(dt, n + 1, 1), *ref = hvec(n + 1);
            void *da = dev(dt, a, n + 1), *db = dev(dt, b, n + 1), *dout = dev_poisoned(dt, n);
            mn_residual_forward(ref, a, b, n);
            for (i = 0; i < n; i++) ref[i] = stf(dt, ref[i]);
            OK(mn_cuda_residual_forward(&ctx, dout, da, db, n, dt));
            compare("residual", dt, dt_tol[d], dout, ref, n);
            mn_residual_forward(ref, a + 1, b + 1, n);  // misaligned by one element
            for (i = 0; i < n; i++) ref[i] = stf(dt, ref[i]);
            OK(mn_cuda_residual_forward(&ctx, dout, (char *)da + esz(dt), (char *)db + esz(dt), n,
                                        dt));
            compare("residual (unaligned)", dt, dt_tol[d], dout, ref, n);
            mn_residual_forward(ref, a, b, n);
            for (i = 0; i < n; i++) ref[i] = stf(dt, ref[i]);
            OK(mn_cuda_residual_forward(&ctx, da, da, db, n, dt));  // in place
            compare("residual in place", dt, dt_tol[d], da, ref, n);
            release(da), release(db), release(dout);
            free(a), free(b), free(ref);
        }
}

// The cuBLASLt workspace from the caller (mn_cuda_workspace_set): a GEMM with a bias epilogue on a
// context whose workspace is a block of its own caching allocator, then with none, against
// mn_matmul_forward; a misaligned workspace is refused.
static void test_workspace(void) {
    mn_cuda c2;
    mn_cuda_desc desc;
    mn_cache cache;
    mn_cache_desc cd;
    size_t N = 64, C = 768, OC = 3072, pass;
    float *x = hrand(MN_FP32, N * C, 1), *w = hrand(MN_FP32, OC * C, 0.05f);
    float *b = hrand(MN_FP32, OC, 1), *ref = hvec(N * OC);
    void *dx = dev(MN_FP32, x, N * C), *dw = dev(MN_FP32, w, OC * C), *db = dev(MN_FP32, b, OC);
    void *dout = dev_poisoned(MN_FP32, N * OC), *ws = NULL;
    uint64_t bytes;
    memset(&desc, 0, sizeof desc), memset(&cd, 0, sizeof cd);
    desc.logger.log_fn = log_stderr;
    OK(mn_cuda_init(&c2, &desc));
    bytes = c2.workspace_bytes;
    cd.device = mn_cuda_device(&c2);
    OK(mn_cache_init(&cache, &cd));
    OK(mn_cache_alloc(&cache, bytes, 0, MN_CAT_WORKSPACE, "workspace", &ws));
    mn_matmul_forward(ref, NULL, x, w, b, N, C, OC);
    for (pass = 0; pass < 2; pass++) {
        OK(mn_cuda_workspace_set(&c2, pass ? NULL : ws, pass ? 0 : bytes));
        CHECK(c2.workspace == (pass ? NULL : ws) && c2.workspace_bytes == (pass ? 0 : bytes));
        OK(mn_cuda_mem_set(&ctx, dout, 0xFF, N * OC * 4));
        OK(mn_cuda_sync(&ctx));
        OK(mn_cuda_matmul_forward(&c2, dout, NULL, dx, dw, db, N, C, OC, MN_FP32));
        OK(mn_cuda_sync(&c2));
        compare(pass ? "matmul without workspace" : "matmul, workspace from the cache", MN_FP32,
                dt_tol[0], dout, ref, N * OC);
    }
    CHECK(mn_cuda_workspace_set(&c2, (char *)ws + 4, 1024) == MN_ERR_INVALID_ARG);
    CHECK(mn_cuda_workspace_set(&c2, ws, 0) == MN_ERR_INVALID_ARG);
    OK(mn_cache_release(&cache, ws));
    mn_cache_free(&cache);
    mn_cuda_free(&c2);
    release(dx), release(dw), release(db), release(dout);
    free(x), free(w), free(b), free(ref);
}

// LayerNorm forward (plain and fused with the residual add) and backward against the CPU ops.
// Shapes {N, C, off}: the register paths with every pack count (fp32 / 16-bit: 64 -> 1 / 1,
// 200 -> 2 / 1 with a partial last pack, 512 -> 4 / 2, 768 -> 6 / 3, 1024 -> 8 / 4; 1600 and
// 2048 forward only, 8 packs a lane at 16 bits), the backward's grid-stride rows (4096), and the
// fallbacks: C not a multiple of the pack (1, 37, 769, 4100), past the registers (fp32 1600,
// 2048), inputs one element off 16-byte alignment (off = 1). Odd shapes run the backward as two
// calls, dinp alone and then dweight and dbias alone (weight NULL).
static void test_layernorm(void) {
    static const size_t shapes[][3] = {{1, 1, 0},    {3, 37, 0},   {4096, 768, 0}, {64, 769, 0},
                                       {5, 1600, 0}, {33, 200, 0}, {7, 64, 0},     {9, 512, 0},
                                       {300, 1024, 0}, {6, 1024, 0}, {2, 2048, 0}, {7, 4100, 0},
                                       {9, 512, 1},  {5, 768, 1}};
    size_t s, i;
    int d, fused;
    for (d = 0; d < 3; d++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (fused = 0; fused < 2; fused++) {
                mn_dtype dt = dts[d];
                size_t N = shapes[s][0], C = shapes[s][1], off = shapes[s][2], n = N * C + off;
                float *a = hrand(dt, n, 2), *b = hrand(dt, n, 1), *w = hrand(dt, C, 1);
                float *bias = hrand(dt, C, 1), *dy = hrand(dt, n, 1), *x = hvec(N * C);
                float *out = hvec(N * C), *mu = hvec(N), *rs = hvec(N), *dx = hrand(dt, N * C, 1);
                float *dw = hrand(dt, C, 1), *db = hrand(dt, C, 1);
                void *da = dev(dt, a, n), *dbb = dev(dt, b, n), *dwt = dev(dt, w, C);
                void *dbias = dev(dt, bias, C), *ddy = dev(dt, dy, n);
                void *dout = dev_poisoned(dt, N * C), *dres = dev_poisoned(dt, N * C);
                void *dmu = dev_poisoned(MN_FP32, N), *drs = dev_poisoned(MN_FP32, N);
                void *ddx = dev(dt, dx, N * C), *ddw = dev(dt, dw, C), *ddb = dev(dt, db, C);
                void *da_off = (char *)da + off * esz(dt), *dbb_off = (char *)dbb + off * esz(dt);
                void *ddy_off = (char *)ddy + off * esz(dt);
                if (fused) {
                    for (i = 0; i < N * C; i++) x[i] = stf(dt, a[off + i] + b[off + i]);
                    OK(mn_cuda_residual_layernorm_forward(&ctx, dres, dout, (float *)dmu,
                                                          (float *)drs, da_off, dbb_off, dwt,
                                                          dbias, N, C, 1e-5f, dt));
                    compare("residual (fused)", dt, dt_tol[d], dres, x, N * C);
                } else {
                    memcpy(x, a + off, N * C * sizeof *x);
                    OK(mn_cuda_layernorm_forward(&ctx, dout, (float *)dmu, (float *)drs, da_off,
                                                 dwt, dbias, N, C, 1e-5f, dt));
                }
                mn_layernorm_forward(out, mu, rs, x, w, bias, N, C, 1e-5f);
                compare(fused ? "residual+layernorm out" : "layernorm out", dt, dt_tol[d], dout,
                        out, N * C);
                compare("layernorm mean", MN_FP32, dt_tol[d], dmu, mu, N);
                compare("layernorm rstd", MN_FP32, dt_tol[d], drs, rs, N);
                if (!fused) {  // backward from the reference statistics (uploaded)
                    void *rmu = dev(MN_FP32, mu, N), *rrs = dev(MN_FP32, rs, N);
                    mn_layernorm_backward(dx, dw, db, dy + off, x, w, mu, rs, N, C);
                    if (s % 2 == 0) {
                        OK(mn_cuda_layernorm_backward(&ctx, ddx, ddw, ddb, ddy_off, da_off, dwt,
                                                      (float *)rmu, (float *)rrs, N, C, dt));
                    } else {
                        OK(mn_cuda_layernorm_backward(&ctx, ddx, NULL, NULL, ddy_off, da_off, dwt,
                                                      (float *)rmu, (float *)rrs, N, C, dt));
                        OK(mn_cuda_layernorm_backward(&ctx, NULL, ddw, ddb, ddy_off, da_off, NULL,
                                                      (float *)rmu, (float *)rrs, N, C, dt));
                    }
                    compare("layernorm backward dinp", dt, dt_tol[d], ddx, dx, N * C);
                    // parameter gradients sum N rows: the tolerance grows with sqrt(N)
                    compare("layernorm backward dweight", dt, dt_tol[d] * sqrt((double)N), ddw, dw, C);
                    compare("layernorm backward dbias", dt, dt_tol[d] * sqrt((double)N), ddb, db, C);
                    release(rmu), release(rrs);
                }
                release(da), release(dbb), release(dwt), release(dbias), release(ddy);
                release(dout), release(dres), release(dmu), release(drs), release(ddx);
                release(ddw), release(ddb);
                free(a), free(b), free(w), free(bias), free(dy), free(x), free(out), free(mu);
                free(rs), free(dx), free(dw), free(db);
            }
}

// Row in registers with NP = 1, 2, 4, 8 packs per lane ({96,32} {300,200} {50,264} {24,520}
// {1024,1024} {16,2000}, fp32 and 16-bit reach different NP), the 16-byte streaming fallback
// past the register row ({8,4096}; fp32 {16,2000}), single elements (odd L). N % L != 0 causal.
static void test_softmax(void) {
    static const size_t shapes[][2] = {{4, 1}, {6, 5}, {3, 77}, {1024, 1024}, {2, 50257},
                                       {96, 32}, {300, 200}, {50, 264}, {24, 520}, {16, 2000},
                                       {8, 4096}};
    size_t s;
    int d, causal;
    for (d = 0; d < 3; d++)
        for (causal = 0; causal < 2; causal++)
            for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                mn_dtype dt = dts[d];
                size_t N = shapes[s][0], L = shapes[s][1];
                float scale = 1.0f / sqrtf((float)L), *x = hrand(dt, N * L, 3);
                float *dy = hrand(dt, N * L, 1), *dx = hrand(dt, N * L, 1), *y = hvec(N * L);
                void *dxin = dev(dt, x, N * L), *dyo = dev_poisoned(dt, N * L);
                void *ddy = dev(dt, dy, N * L), *ddx = dev(dt, dx, N * L), *dys;
                size_t i;
                mn_softmax_forward(y, x, N, L, scale, causal);
                OK(mn_cuda_softmax_forward(&ctx, dyo, dxin, N, L, scale, causal, dt));
                compare(causal ? "softmax forward causal" : "softmax forward", dt, dt_tol[d], dyo,
                        y, N * L);
                for (i = 0; i < N * L; i++) y[i] = stf(dt, y[i]);
                dys = dev(dt, y, N * L);
                mn_softmax_backward(dx, dy, y, N, L, scale, causal);
                OK(mn_cuda_softmax_backward(&ctx, ddx, ddy, dys, N, L, scale, causal, dt));
                compare(causal ? "softmax backward causal" : "softmax backward", dt, dt_tol[d],
                        ddx, dx, N * L);
                release(dxin), release(dyo), release(ddy), release(ddx), release(dys);
                free(x), free(dy), free(dx), free(y);
            }
}

// Attention (batched GEMMs + fused softmax) against mn_attention_forward / _backward: T = 1, odd
// T, head sizes not a multiple of 8, att kept and NULL (recomputed), causal and not. The scores,
// probabilities, dp and ds are stored in the dtype between the kernels, so the 16-bit tolerance
// is twice the kernels' (test_cudamath's host emulation of the same sequence stays within half
// of it); fp32 keeps 1e-4 (TF32 off).
static void test_attention_ctx(mn_cuda *c, const char *tag) {
    static const size_t shapes[][4] = {{1, 1, 8, 2}, {2, 7, 60, 4}, {1, 33, 48, 3},
                                       {1, 257, 120, 5}, {4, 64, 768, 12}};
    static const double tol_att[3] = {1e-4, 8e-3, 3.2e-2};
    size_t s;
    int d, causal, keep;
    char what[96];
    for (d = 0; d < 3; d++)
        for (causal = 0; causal < 2; causal++)
            for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                for (keep = 0; keep < 2; keep++) {
                    mn_dtype dt = dts[d];
                    size_t B = shapes[s][0], T = shapes[s][1], C = shapes[s][2];
                    size_t NH = shapes[s][3], nq = B * T * 3 * C, no = B * T * C;
                    size_t na = B * NH * T * T;
                    float *qkv = hrand(dt, nq, 1), *dy = hrand(dt, no, 1), *dq = hrand(dt, nq, 1);
                    float *out = hvec(no), *att = hvec(na);
                    void *dqkv_in = dev(dt, qkv, nq), *ddy = dev(dt, dy, no), *ddq = dev(dt, dq, nq);
                    void *dout = dev_poisoned(dt, no), *datt = keep ? dev_poisoned(dt, na) : NULL;
                    mn_attention_forward(out, att, qkv, B, T, C, NH, causal);
                    mn_attention_backward(dq, dy, qkv, keep ? att : NULL, B, T, C, NH, causal);
                    OK(mn_cuda_attention_forward(c, dout, datt, dqkv_in, B, T, C, NH, causal, dt));
                    snprintf(what, sizeof what, "%sattention fwd %zux%zux%zux%zu%s%s", tag, B, T,
                             C, NH, causal ? " causal" : "", keep ? " att" : "");
                    compare(what, dt, tol_att[d], dout, out, no);
                    if (keep) compare("attention att", dt, tol_att[d], datt, att, na);
                    OK(mn_cuda_attention_backward(c, ddq, ddy, dqkv_in, datt, B, T, C, NH, causal,
                                                  dt));
                    snprintf(what, sizeof what, "%sattention bwd %zux%zux%zux%zu%s%s", tag, B, T,
                             C, NH, causal ? " causal" : "", keep ? " att" : "");
                    compare(what, dt, tol_att[d], ddq, dq, nq);
                    release(dqkv_in), release(ddy), release(ddq), release(dout), release(datt);
                    free(qkv), free(dy), free(dq), free(out), free(att);
                }
}
static void test_attention(void) { test_attention_ctx(&ctx, ""); }

// The kernels' scratch from the caller (mn_cuda_scratch_set): attention forward and backward
// (B 2, T 1024, C 256, 4 heads, bf16, att kept: 39 MiB of scratch) on a fresh context whose
// scratch is a block of a cache give the same bits as the shared context with its own, and the
// device's free memory does not drop by the scratch (the context took none of its own); then a
// misaligned or empty block is refused.
static void test_scratch(void) {
    const size_t B = 2, T = 1024, C = 256, NH = 4, nq = B * T * 3 * C, no = B * T * C;
    const size_t na = B * NH * T * T;
    uint64_t need = 0, free0 = 0, free1 = 0, total = 0;
    float *qkv = hrand(MN_BF16, nq, 1), *dy = hrand(MN_BF16, no, 1);
    void *dqkv_in = dev(MN_BF16, qkv, nq), *ddy = dev(MN_BF16, dy, no);
    void *o1 = dev_poisoned(MN_BF16, no), *o2 = dev_poisoned(MN_BF16, no);
    void *a1 = dev_poisoned(MN_BF16, na), *a2 = dev_poisoned(MN_BF16, na);
    void *g1 = dev_poisoned(MN_BF16, nq), *g2 = dev_poisoned(MN_BF16, nq), *scr = NULL;
    float *want_o, *want_g;
    mn_cuda c2;
    mn_cuda_desc desc;
    mn_cache cache;
    mn_cache_desc cd;
    mn_device dv;
    OK(mn_attention_scratch(B, T, C, NH, 2, 1, 1, &need));
    CHECK(need > (32u << 20));
    memset(&desc, 0, sizeof desc), memset(&cd, 0, sizeof cd);
    desc.logger.log_fn = log_stderr;
    OK(mn_cuda_init(&c2, &desc));
    cd.device = dv = mn_cuda_device(&c2);
    OK(mn_cache_init(&cache, &cd));
    OK(mn_cache_alloc(&cache, need, 0, MN_CAT_WORKSPACE, "kernel_scratch", &scr));
    OK(mn_cuda_scratch_set(&c2, scr, need));
    OK(mn_cuda_mem_set(&ctx, g1, 0, nq * 2));
    OK(mn_cuda_mem_set(&ctx, g2, 0, nq * 2));
    // the shared context first: its run also loads every kernel the second one launches (lazy
    // module loading takes device memory too), so that the free memory around c2's run moves by
    // c2's own allocations alone
    OK(mn_cuda_attention_forward(&ctx, o1, a1, dqkv_in, B, T, C, NH, 1, MN_BF16));
    OK(mn_cuda_attention_backward(&ctx, g1, ddy, dqkv_in, a1, B, T, C, NH, 1, MN_BF16));
    OK(mn_cuda_sync(&ctx));
    OK(dv.mem_info_fn(dv.user_data, &free0, &total));
    OK(mn_cuda_attention_forward(&c2, o2, a2, dqkv_in, B, T, C, NH, 1, MN_BF16));
    OK(mn_cuda_attention_backward(&c2, g2, ddy, dqkv_in, a2, B, T, C, NH, 1, MN_BF16));
    OK(mn_cuda_sync(&c2));
    OK(dv.mem_info_fn(dv.user_data, &free1, &total));
    if (free1 + need / 2 <= free0)
        FAIL("free memory dropped by %llu bytes (scratch %llu)",
             (unsigned long long)(free0 - free1), (unsigned long long)need);
    want_o = down(MN_BF16, o1, no), want_g = down(MN_BF16, g1, nq);
    compare("attention fwd, scratch from a cache", MN_BF16, 0.0, o2, want_o, no);
    compare("attention bwd, scratch from a cache", MN_BF16, 0.0, g2, want_g, nq);
    CHECK(mn_cuda_scratch_set(&c2, (char *)scr + 16, 1024) == MN_ERR_INVALID_ARG);
    CHECK(mn_cuda_scratch_set(&c2, scr, 0) == MN_ERR_INVALID_ARG);
    OK(mn_cuda_scratch_set(&c2, NULL, 0));
    OK(mn_cache_release(&cache, scr));
    mn_cache_free(&cache);
    mn_cuda_free(&c2);
    release(dqkv_in), release(ddy), release(o1), release(o2), release(a1), release(a2);
    release(g1), release(g2);
    free(qkv), free(dy), free(want_o), free(want_g);
}

// Shapes: 50257 starts consecutive rows at every 16-byte offset (scalar head, packs, tail), 3 is
// under one pack, 120001 does not fit the shared-memory row cache (second read). Modes: out of
// place (and loss only), in place, in place one element past a 16-byte boundary (scalar path).
static void test_crossentropy(void) {
    static const size_t shapes[][2] = {{1, 50257}, {7, 50257}, {33, 37}, {5, 3}, {3, 120001}};
    static const char *mode_name[3] = {"crossentropy dlogits", "crossentropy dlogits (in place)",
                                       "crossentropy dlogits (in place, unaligned)"};
    size_t s, n;
    int d, mode;
    for (d = 0; d < 3; d++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (mode = 0; mode < 3; mode++) {
                mn_dtype dt = dts[d];
                size_t N = shapes[s][0], V = shapes[s][1], off = mode == 2 ? 1 : 0;
                float dloss = 1.0f / (float)N, *x = hrand(dt, N * V + off, 4), *loss = hvec(N);
                float *dx = hvec(N * V), *dl = hvec(N);
                int *tg = (int *)malloc(N * sizeof(int));
                void *dbase = dev(dt, x, N * V + off), *dlog, *dgrad, *dtg;
                void *dlossd = dev_poisoned(MN_FP32, N);
                if (!tg) abort();
                dlog = (char *)dbase + off * esz(dt);
                for (n = 0; n < N; n++) tg[n] = (int)(urand() * (double)V), dl[n] = dloss;
                if (N > 2) tg[2] = -1;  // ignored row
                if (N > 3) tg[3] = (int)V - 1;  // the last element (a tail or a pack's end)
                if (mn_cuda_mem_alloc(&ctx, N * sizeof(int), &dtg) != MN_OK ||
                    mn_cuda_mem_copy(&ctx, dtg, tg, N * sizeof(int)) != MN_OK) {
                    FAIL("targets upload");
                    return;
                }
                dgrad = mode ? dlog : dev_poisoned(dt, N * V);
                if (mn_crossentropy_forward(loss, NULL, x + off, tg, N, V) != MN_OK ||
                    mn_crossentropy_backward(dx, dl, NULL, x + off, tg, N, V) != MN_OK)
                    FAIL("reference crossentropy");
                if (mode == 0) {  // loss only
                    OK(mn_cuda_crossentropy_forward_backward(&ctx, (float *)dlossd, NULL, dlog,
                                                             (const int *)dtg, dloss, N, V, dt));
                    compare("crossentropy loss (no dlogits)", MN_FP32, dt_tol[d], dlossd, loss, N);
                    OK(mn_cuda_mem_set(&ctx, dlossd, 0xFF, N * 4));
                }
                OK(mn_cuda_crossentropy_forward_backward(&ctx, (float *)dlossd, dgrad, dlog,
                                                         (const int *)dtg, dloss, N, V, dt));
                compare("crossentropy loss", MN_FP32, dt_tol[d], dlossd, loss, N);
                compare(mode_name[mode], dt, dt_tol[d] * dloss, dgrad, dx, N * V);
                if (!mode) release(dgrad);
                release(dbase), release(dlossd), release(dtg);
                free(x), free(loss), free(dx), free(dl), free(tg);
            }
}

// The global norm against a double sum of squares, at 16-byte aligned and unaligned starts (a
// scalar head), with and without a tail; two runs give the same bits. 2^24 + 3 elements take
// several unrolled grid-stride rounds on a large GPU, 2^20 + 5 only the last, partial one.
static void test_global_norm(void) {
    static const size_t sizes[] = {1, 7, 1003, (1 << 20) + 5, (1 << 24) + 3};
    static const size_t offs[] = {0, 1, 3};
    size_t s, o, i;
    int d;
    for (d = 0; d < 3; d++)
        for (s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (o = 0; o < sizeof offs / sizeof offs[0]; o++) {
                mn_dtype dt = dts[d];
                size_t n = sizes[s], off = offs[o];
                float *g = hrand(dt, n + off, 1), *got1, *got2;
                void *dg = dev(dt, g, n + off), *dn = dev_poisoned(MN_FP32, 2);
                double want = 0.0;
                for (i = 0; i < n; i++) want += (double)g[off + i] * g[off + i];
                want = sqrt(want);
                OK(mn_cuda_global_norm(&ctx, (float *)dn, (char *)dg + off * esz(dt), n, dt));
                OK(mn_cuda_global_norm(&ctx, (float *)dn + 1, (char *)dg + off * esz(dt), n, dt));
                got1 = down(MN_FP32, dn, 2), got2 = got1 + 1;
                if (!(fabs(got1[0] - want) <= 1e-5 * want))
                    FAIL("global norm %s n=%zu offset %zu: got %.9g want %.9g",
                         mn_dtype_name(dt), n, off, got1[0], want);
                if (memcmp(got1, got2, 4) != 0)
                    FAIL("global norm %s n=%zu offset %zu: %.9g then %.9g", mn_dtype_name(dt), n,
                         off, got1[0], got2[0]);
                release(dg), release(dn);
                free(g), free(got1);
            }
}

static void test_embedding(void) {
    static const size_t shapes[][4] = {{2, 1, 37, 11}, {4, 64, 768, 50257}, {3, 17, 5, 3}};
    size_t s, i;
    int d;
    for (d = 0; d < 3; d++)
        for (s = 0; s < 3; s++) {
            mn_dtype dt = dts[d];
            size_t B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], V = shapes[s][3];
            float *wte = hrand(dt, V * C, 1), *wpe = hrand(dt, T * C, 1), *out = hvec(B * T * C);
            float *dy = hrand(dt, B * T * C, 1), *dwte = hrand(dt, V * C, 1);
            float *dwpe = hrand(dt, T * C, 1), *first, *second;
            int *tok = (int *)malloc(B * T * sizeof(int));
            void *dwt, *dwp, *dout, *ddy, *ddwte, *ddwpe, *dtok;
            if (!tok) abort();
            for (i = 0; i < B * T; i++) tok[i] = (int)(urand() * (double)(V < 5 ? V : 5));  // repeats
            dwt = dev(dt, wte, V * C), dwp = dev(dt, wpe, T * C), dout = dev_poisoned(dt, B * T * C);
            ddy = dev(dt, dy, B * T * C), ddwte = dev(dt, dwte, V * C), ddwpe = dev(dt, dwpe, T * C);
            if (mn_cuda_mem_alloc(&ctx, B * T * sizeof(int), &dtok) != MN_OK ||
                mn_cuda_mem_copy(&ctx, dtok, tok, B * T * sizeof(int)) != MN_OK) {
                FAIL("tokens upload");
                return;
            }
            if (mn_embedding_forward(out, tok, wte, wpe, B, T, C, V) != MN_OK) FAIL("reference");
            OK(mn_cuda_embedding_forward(&ctx, dout, (const int *)dtok, dwt, dwp, B, T, C, V, dt));
            compare("embedding forward", dt, dt_tol[d], dout, out, B * T * C);
            if (mn_embedding_backward(dwte, dwpe, dy, tok, B, T, C, V) != MN_OK) FAIL("reference");
            OK(mn_cuda_embedding_backward(&ctx, ddwte, ddwpe, ddy, (const int *)dtok, B, T, C, V, dt));
            compare("embedding backward dwte", dt, dt_tol[d] * sqrt((double)(B * T)), ddwte, dwte,
                    V * C);
            compare("embedding backward dwpe", dt, dt_tol[d] * sqrt((double)B), ddwpe, dwpe, T * C);
            // deterministic: the same call twice from the same start gives the same bits
            first = down(dt, ddwte, V * C);
            OK(mn_cuda_embedding_backward(&ctx, ddwte, NULL, ddy, (const int *)dtok, B, T, C, V, dt));
            release(ddwte);
            ddwte = dev(dt, first, V * C);
            OK(mn_cuda_embedding_backward(&ctx, ddwte, NULL, ddy, (const int *)dtok, B, T, C, V, dt));
            second = down(dt, ddwte, V * C);
            OK(mn_cuda_sync(&ctx));
            {
                float *third;
                release(ddwte);
                ddwte = dev(dt, first, V * C);
                OK(mn_cuda_embedding_backward(&ctx, ddwte, NULL, ddy, (const int *)dtok, B, T, C, V,
                                              dt));
                third = down(dt, ddwte, V * C);
                CHECK(memcmp(second, third, V * C * sizeof(float)) == 0);
                free(third);
            }
            // a token outside [0, V) is refused
            tok[0] = (int)V;
            if (mn_cuda_mem_copy(&ctx, dtok, tok, sizeof(int)) == MN_OK) {
                mn_result r = mn_cuda_embedding_backward(&ctx, ddwte, NULL, ddy, (const int *)dtok,
                                                         B, T, C, V, dt);
                CHECK(r == MN_ERR_INVALID_ARG);
            }
            release(dwt), release(dwp), release(dout), release(ddy), release(ddwte);
            release(ddwpe), release(dtok);
            free(wte), free(wpe), free(out), free(dy), free(dwte), free(dwpe), free(first);
            free(second), free(tok);
        }
}

// ---- optimizer steps ----------------------------------------------------------------------------
// Every step test shares one setup (opt_case): fp32 parameters p, gradients gs in the gradient
// type scaled by 256 (as a loss scale of 256 leaves them), their device copies, a poisoned norm and
// 16-bit copy. Each step the host reference unscales and clips gs into g (mn_unscale_grads_to_fp32
// + mn_clip_grad_norm) while the device takes the global norm (mn_cuda_global_norm) that the step
// fuses the same work from; opt_case_flat gives the step's shared arguments.
typedef struct opt_case {
    uint64_t n;
    mn_dtype gdt, dt16;          // gradient type, 16-bit copy type
    float inv_scale, max_norm;   // 1/256; 1 when clipping, else 0
    float *p, *gs, *g;           // [n] host: parameters (the reference's), scaled and plain grads
    void *dp, *dg, *dn, *d16;    // device: parameters, gradients, norm [1], 16-bit copy
    float norm;                  // the reference's global norm of the last step
} opt_case;

static void opt_case_init(opt_case *c, uint64_t n, mn_dtype gdt, mn_dtype dt16, int clip) {
    memset(c, 0, sizeof *c);
    c->n = n, c->gdt = gdt, c->dt16 = dt16;
    c->inv_scale = 1.0f / 256.0f, c->max_norm = clip ? 1.0f : 0.0f;
    c->p = hrand(MN_FP32, n, 1), c->gs = hrand(gdt, n, 256), c->g = hvec(n);
    c->dp = dev(MN_FP32, c->p, n), c->dg = dev(gdt, c->gs, n);
    c->dn = dev_poisoned(MN_FP32, 1), c->d16 = dev_poisoned(dt16, n);
}

// The reference's g for this step, and the device's norm; MN_OK or the first failure.
static mn_result opt_case_grads(opt_case *c) {
    float *gp[1];
    uint64_t sz[1];
    int found_inf = 0;
    mn_result r = mn_unscale_grads_to_fp32(MN_FP32, c->gs, c->g, c->n, c->inv_scale, &found_inf);
    gp[0] = c->g, sz[0] = c->n;
    if (r == MN_OK) r = mn_clip_grad_norm(gp, sz, 1, c->max_norm > 0.0f ? c->max_norm : 1e30f,
                                          2.0f, &c->norm);
    return r != MN_OK ? r : mn_cuda_global_norm(&ctx, (float *)c->dn, c->dg, c->n, c->gdt);
}

static mn_cuda_optim_flat opt_case_flat(const opt_case *c, uint64_t step) {
    mn_cuda_optim_flat f;
    memset(&f, 0, sizeof f);
    f.param = (float *)c->dp, f.param16 = c->d16, f.param16_dtype = c->dt16;
    f.grad = c->dg, f.grad_dtype = c->gdt, f.n = c->n, f.step = step;
    f.grad_norm = (const float *)c->dn, f.inv_scale = c->inv_scale, f.max_norm = c->max_norm;
    return f;
}

// The device's parameters against the reference's (tol), and the 16-bit copy against them.
// (allowed elements may be past tol, up to cap.)
static void opt_case_check_some(opt_case *c, const char *what, double tol, size_t allowed,
                                double cap) {
    char name[96];
    size_t i;
    snprintf(name, sizeof name, "%s param", what);
    compare_some(name, MN_FP32, tol, allowed, cap, c->dp, c->p, c->n);
    for (i = 0; i < c->n; i++) c->p[i] = stf(c->dt16, c->p[i]);
    snprintf(name, sizeof name, "%s param16", what);
    compare_some(name, c->dt16, c->dt16 == MN_FP16 ? 4e-3 : 1.6e-2, allowed, cap, c->d16, c->p,
                 c->n);
}
static void opt_case_check(opt_case *c, const char *what, double tol) {
    opt_case_check_some(c, what, tol, 0, INFINITY);
}

// Found inf: a gradient with an inf makes the norm inf, and step (run with *f pointing at it)
// leaves the parameters alone.
typedef mn_result (*opt_step_fn)(void *args);
static void opt_case_inf(opt_case *c, const char *what, mn_cuda_optim_flat *f, opt_step_fn step,
                         void *args) {
    float *before = down(MN_FP32, c->dp, c->n), inf = INFINITY;
    void *ginf = dev(MN_FP32, c->gs, c->n);
    char name[96];
    snprintf(name, sizeof name, "%s skipped on inf", what);
    OK(mn_cuda_mem_copy(&ctx, ginf, &inf, 4));
    OK(mn_cuda_global_norm(&ctx, (float *)c->dn, ginf, c->n, MN_FP32));
    f->grad = ginf, f->grad_dtype = MN_FP32, f->step++;
    OK(step(args));
    compare(name, MN_FP32, 0.0, c->dp, before, c->n);
    free(before);
    release(ginf);
}

static void opt_case_free(opt_case *c) {
    release(c->dp), release(c->dg), release(c->dn), release(c->d16);
    free(c->p), free(c->gs), free(c->g);
}

static const uint64_t opt_sizes[] = {1, 1003, 1 << 20};

typedef struct adamw_call {
    const mn_adamw_params *p;
    mn_cuda_adamw_args a;
} adamw_call;
static mn_result adamw_run(void *u) {
    adamw_call *c = (adamw_call *)u;
    return mn_cuda_adamw_step(&ctx, c->p, &c->a);
}

// Global norm + AdamW against mn_adamw_step, 3 steps.
static void test_adamw(void) {
    size_t s;
    int d, clip, t;
    for (d = 0; d < 3; d++)
        for (s = 0; s < 3; s++)
            for (clip = 0; clip < 2; clip++) {
                uint64_t n = opt_sizes[s], dims[1];
                opt_case c;
                mn_adamw st;
                mn_adamw_params prm;
                adamw_call call;
                void *dm, *dv;
                opt_case_init(&c, n, dts[d], MN_BF16, clip);
                dm = dev_poisoned(MN_FP32, n), dv = dev_poisoned(MN_FP32, n);
                OK(mn_cuda_mem_set(&ctx, dm, 0, n * 4));
                OK(mn_cuda_mem_set(&ctx, dv, 0, n * 4));
                memset(&prm, 0, sizeof prm);
                prm.lr = 1e-2f, prm.weight_decay = 0.1f;
                dims[0] = n;
                OK(mn_adamw_init(&st, dims, 1, &prm, NULL));
                call.p = &prm;
                call.a.exp_avg = (float *)dm, call.a.exp_avg_sq = (float *)dv;
                for (t = 1; t <= 3; t++) {
                    OK(opt_case_grads(&c));
                    OK(mn_adamw_step(&st, c.p, c.g, NULL));
                    call.a.flat = opt_case_flat(&c, (uint64_t)t);
                    OK(adamw_run(&call));
                }
                {
                    float *gn = down(MN_FP32, c.dn, 1);
                    if (fabsf(gn[0] * c.inv_scale - c.norm) > 1e-4f * c.norm)
                        FAIL("global norm %g want %g", gn[0] * c.inv_scale, c.norm);
                    free(gn);
                }
                compare("adamw exp_avg", MN_FP32, 1e-5, dm, st.exp_avg, n);
                compare("adamw exp_avg_sq", MN_FP32, 1e-5, dv, st.exp_avg_sq, n);
                opt_case_check(&c, "adamw", 1e-5);
                if (s == 1) opt_case_inf(&c, "adamw", &call.a.flat, adamw_run, &call);
                mn_adamw_free(&st);
                release(dm), release(dv);
                opt_case_free(&c);
            }
}

typedef struct adamw8bit_call {
    const mn_adamw8bit_params *p;
    mn_cuda_adamw8bit_args a;
} adamw8bit_call;
static mn_result adamw8bit_run(void *u) {
    adamw8bit_call *c = (adamw8bit_call *)u;
    return mn_cuda_adamw8bit_step(&ctx, c->p, &c->a);
}

// Codes against the host's: each may be one map entry off (the device contracts a multiply-add
// where the host rounds twice, which can move a value across a midpoint), for at most 1 + n / 1000
// elements; every other code equal.
static void compare_codes(const char *what, const void *d, const uint8_t *want, size_t n) {
    uint8_t *got = (uint8_t *)malloc(n + 1);
    size_t i, off1 = 0, bad = 0;
    if (!got) abort();
    if (mn_cuda_mem_copy(&ctx, got, d, n) != MN_OK) {
        FAIL("%s: device copy", what);
        free(got);
        return;
    }
    for (i = 0; i < n; i++) {
        int e = (int)got[i] - (int)want[i];
        if (e == 0) continue;
        if (e == 1 || e == -1) off1++;
        else bad++;
    }
    if (bad || off1 > 1 + n / 1000)
        FAIL("%s (n=%zu): %zu codes off by more than one entry, %zu by one", what, n, bad, off1);
    else if (verbose)
        printf("  %-34s n=%-9zu %zu codes one entry off\n", what, n, off1);
    free(got);
}

// 8-bit AdamW against mn_adamw8bit_step, 3 steps: quantized tensors (block sizes 256 and 2048,
// n not a multiple of the block) and a small tensor with fp32 moments; the state starts from the
// host's zeroed state and is compared after (scales within 1e-5; codes within one entry, at most
// 1 + n / 1000 of them one entry off, where the device's fused multiply-adds round m or v apart
// from the host's; the count is printed with MN_TEST_VERBOSE). The
// last size has more 256-element blocks (11719) than any device holds warps of the warp kernel at
// once, so each warp walks several blocks.
static void test_adamw8bit(void) {
    static const uint64_t sizes[] = {1003, 5000, 1 << 20, 3000017};
    static const uint32_t blocks[] = {256, 256, 2048, 256};
    size_t s;
    int d, clip, t;
    for (d = 0; d < 3; d++)
        for (s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (clip = 0; clip < 2; clip++) {
                uint64_t n = sizes[s], dims[1];
                opt_case c;
                mn_adamw8bit st;
                mn_adamw8bit_params prm;
                adamw8bit_call call;
                void *dstate;
                opt_case_init(&c, n, dts[d], MN_FP16, clip);
                memset(&prm, 0, sizeof prm);
                prm.lr = 1e-2f, prm.weight_decay = 0.1f, prm.block_size = blocks[s];
                dims[0] = n;
                OK(mn_adamw8bit_init(&st, dims, 1, &prm, NULL));
                memset(st.quantized ? (void *)st.absmax1 : (void *)st.exp_avg, 0,
                       (size_t)st.state_bytes);
                dstate = dev_poisoned(MN_FP32, (size_t)(st.state_bytes + 3) / 4);
                OK(mn_cuda_mem_set(&ctx, dstate, 0, st.state_bytes));
                memset(&call, 0, sizeof call);
                call.p = &prm;
                if (st.quantized) {  // the host's layout: [absmax1 | absmax2 | code1 | code2]
                    call.a.absmax1 = (float *)dstate, call.a.absmax2 = call.a.absmax1 + st.blocks;
                    call.a.code1 = (uint8_t *)(call.a.absmax2 + st.blocks);
                    call.a.code2 = call.a.code1 + n;
                } else {
                    call.a.exp_avg = (float *)dstate, call.a.exp_avg_sq = call.a.exp_avg + n;
                }
                for (t = 1; t <= 3; t++) {
                    float dn;
                    OK(opt_case_grads(&c));
                    OK(mn_adamw8bit_step(&st, c.p, c.g, NULL));
                    // the step reads the host's norm (of the scaled gradients: x 256, exact), so
                    // that both clip by the same coefficient: the device's own norm, summed in
                    // fp32 in another order, is some ulps apart, which moves every g and turned
                    // 670 + 869 of 2^20 codes into their neighbours on an H200
                    dn = c.norm / c.inv_scale;
                    OK(mn_cuda_mem_copy(&ctx, c.dn, &dn, sizeof dn));
                    call.a.flat = opt_case_flat(&c, (uint64_t)t);
                    OK(adamw8bit_run(&call));
                }
                if (st.quantized) {
                    compare("adamw8bit absmax1", MN_FP32, 1e-5, call.a.absmax1, st.absmax1,
                            st.blocks);
                    compare("adamw8bit absmax2", MN_FP32, 1e-5, call.a.absmax2, st.absmax2,
                            st.blocks);
                    compare_codes("adamw8bit code1", call.a.code1, st.code1, n);
                    compare_codes("adamw8bit code2", call.a.code2, st.code2, n);
                } else {
                    compare("adamw8bit exp_avg", MN_FP32, 1e-5, call.a.exp_avg, st.exp_avg, n);
                    compare("adamw8bit exp_avg_sq", MN_FP32, 1e-5, call.a.exp_avg_sq,
                            st.exp_avg_sq, n);
                }
                // a code one entry off moves m by up to a map step: the parameters within 1e-4,
                // except those whose codes were one entry off in an earlier step (as many as
                // compare_codes allows): a v code off next to 0 changes sqrt(v) by a large
                // factor, so such an element may move by up to a step of lr (1e-2) or so; never
                // by more than 20 lr
                opt_case_check_some(&c, "adamw8bit", 1e-4, 1 + n / 1000, 0.2);
                if (s == 1) opt_case_inf(&c, "adamw8bit", &call.a.flat, adamw8bit_run, &call);
                mn_adamw8bit_free(&st);
                release(dstate);
                opt_case_free(&c);
            }
}

// SGD and Lion against mn_sgd_step / mn_lion_step, 3 steps. Lion moves each parameter by
// lr sign(c): where c is within an ulp of 0 the device's contracted multiply-adds or its clip
// coefficient (the norm summed in another order) may flip the sign, so up to 1 + n / 10^5
// elements may be off by at most 2 lr per step; every other element is within 1e-5.
static void compare_lion(const char *what, const void *d, const float *want, size_t n,
                         float lr, int steps) {
    float *got = down(MN_FP32, d, n);
    size_t i, flips = 0, bad = 0;
    for (i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        if (e <= 1e-5 * (1.0 + fabs(want[i]))) continue;
        if (e <= 2.0 * lr * steps + 1e-5 * (1.0 + fabs(want[i]))) flips++;
        else bad++;
    }
    if (bad || flips > 1 + n / 100000)
        FAIL("%s (n=%zu): %zu off, %zu sign flips", what, n, bad, flips);
    free(got);
}

typedef struct sgd_lion_call {
    const mn_sgd_params *sp;
    const mn_lion_params *lp;
    mn_cuda_sgd_args sgd;
    mn_cuda_lion_args lion;
    int is_lion;
    mn_cuda_optim_flat *flat;  // the one in use
} sgd_lion_call;
static mn_result sgd_lion_run(void *u) {
    sgd_lion_call *c = (sgd_lion_call *)u;
    return c->is_lion ? mn_cuda_lion_step(&ctx, c->lp, &c->lion)
                      : mn_cuda_sgd_step(&ctx, c->sp, &c->sgd);
}

static void test_sgd_lion(void) {
    size_t s;
    int d, clip, opt, t;
    for (opt = 0; opt < 4; opt++)  // 0 SGD, 1 SGD momentum+dampening, 2 SGD nesterov, 3 Lion
        for (d = 0; d < 3; d++)
            for (s = 0; s < 3; s++)
                for (clip = 0; clip < 2; clip++) {
                    uint64_t n = opt_sizes[s], dims[1];
                    opt_case c;
                    mn_sgd sgd;
                    mn_sgd_params sp;
                    mn_lion lion;
                    mn_lion_params lp;
                    sgd_lion_call call;
                    void *dst;
                    opt_case_init(&c, n, dts[d], MN_FP16, clip);
                    dst = dev_poisoned(MN_FP32, n);
                    memset(&sp, 0, sizeof sp), memset(&lp, 0, sizeof lp);
                    sp.lr = 1e-2f, sp.weight_decay = 0.01f;
                    sp.momentum = opt == 0 ? MN_OPTIM_ZERO : 0.9f;
                    sp.dampening = opt == 1 ? 0.1f : 0.0f, sp.nesterov = opt == 2;
                    sp.maximize = opt == 2;
                    lp.lr = 1e-3f, lp.weight_decay = 0.1f;
                    dims[0] = n;
                    memset(&call, 0, sizeof call);
                    call.sp = &sp, call.lp = &lp, call.is_lion = opt == 3;
                    call.flat = call.is_lion ? &call.lion.flat : &call.sgd.flat;
                    call.lion.exp_avg = (float *)dst;
                    call.sgd.momentum_buffer = opt ? (float *)dst : NULL;
                    if (opt == 3) {
                        OK(mn_lion_init(&lion, dims, 1, &lp, NULL));
                        OK(mn_cuda_mem_set(&ctx, dst, 0, n * 4));  // m starts at 0
                    } else {
                        OK(mn_sgd_init(&sgd, dims, 1, &sp, NULL));  // b: step 1 writes it
                    }
                    for (t = 1; t <= 3; t++) {
                        OK(opt_case_grads(&c));
                        if (opt == 3) OK(mn_lion_step(&lion, c.p, c.g, NULL));
                        else OK(mn_sgd_step(&sgd, c.p, c.g, NULL));
                        *call.flat = opt_case_flat(&c, (uint64_t)t);
                        OK(sgd_lion_run(&call));
                    }
                    if (opt == 3) {
                        compare_lion("lion param", c.dp, c.p, n, lp.lr, 3);
                        compare("lion exp_avg", MN_FP32, 1e-5, dst, lion.exp_avg, n);
                    } else {
                        if (opt) compare("sgd momentum_buffer", MN_FP32, 1e-5, dst,
                                         sgd.momentum_buffer, n);
                        opt_case_check(&c, "sgd", 1e-5);
                    }
                    if (s == 1)
                        opt_case_inf(&c, opt == 3 ? "lion" : "sgd", call.flat, sgd_lion_run, &call);
                    if (opt == 3) mn_lion_free(&lion);
                    else mn_sgd_free(&sgd);
                    release(dst);
                    opt_case_free(&c);
                }
    {  // validation: nesterov needs momentum and no dampening; momentum needs its buffer
        mn_sgd_params sp;
        mn_cuda_sgd_args a;
        float x = 0.0f;
        memset(&sp, 0, sizeof sp), memset(&a, 0, sizeof a);
        a.flat.param = &x, a.flat.grad = &x, a.flat.n = 1, a.flat.step = 1;
        sp.nesterov = 1;
        CHECK(mn_cuda_sgd_step(&ctx, &sp, &a) == MN_ERR_INVALID_ARG);
        sp.nesterov = 0, sp.momentum = 0.9f;
        CHECK(mn_cuda_sgd_step(&ctx, &sp, &a) == MN_ERR_INVALID_ARG);
    }
}

typedef struct adafactor_call {
    const mn_adafactor_params *p;
    mn_cuda_adafactor_args a;
} adafactor_call;
static mn_result adafactor_run(void *u) {
    adafactor_call *c = (adafactor_call *)u;
    return mn_cuda_adafactor_step(&ctx, c->p, &c->a);
}

// Adafactor against mn_adafactor_step, 3 steps: factored [3,5,37] (the update element by element),
// [768,3072] and [2,33,136] (in packs of 8), [70,1001] (a row at a time), not factored [1003]
// and [2^20]; relative step, fixed lr with beta1 and weight decay, no_scale_parameter with
// warmup_init. Found inf also leaves the row statistics alone.
static void test_adafactor(void) {
    static const uint64_t shapes[][3] = {{3, 5, 37}, {1, 768, 3072}, {2, 33, 136}, {1, 70, 1001},
                                         {1, 1, 1003}, {1, 1, 1 << 20}};
    size_t s;
    int d, clip, mode, t;
    for (s = 0; s < 6; s++)
        for (mode = 0; mode < 3; mode++)
            for (d = 0; d < 3; d++)
                for (clip = 0; clip < 2; clip++) {
                    uint64_t B = shapes[s][0], R = shapes[s][1], Cc = shapes[s][2], n = B * R * Cc;
                    uint64_t dims[3];
                    uint32_t ndim;
                    int factored = s < 4;
                    opt_case c;
                    mn_adafactor st;
                    mn_adafactor_params prm;
                    adafactor_call call;
                    void *drow = NULL, *dcol = NULL, *dv = NULL, *dm = NULL;
                    char what[96];
                    opt_case_init(&c, n, dts[d], MN_BF16, clip);
                    if (factored) {
                        drow = dev_poisoned(MN_FP32, B * R), dcol = dev_poisoned(MN_FP32, B * Cc);
                        OK(mn_cuda_mem_set(&ctx, drow, 0, B * R * 4));
                        OK(mn_cuda_mem_set(&ctx, dcol, 0, B * Cc * 4));
                    } else {
                        dv = dev_poisoned(MN_FP32, n);
                        OK(mn_cuda_mem_set(&ctx, dv, 0, n * 4));
                    }
                    if (B > 1) dims[0] = B, dims[1] = R, dims[2] = Cc, ndim = 3;
                    else if (factored) dims[0] = R, dims[1] = Cc, ndim = 2;
                    else dims[0] = n, ndim = 1;
                    memset(&prm, 0, sizeof prm);
                    if (mode == 1) prm.lr = 1e-2f, prm.beta1 = 0.9f, prm.weight_decay = 0.01f;
                    if (mode == 2) prm.no_scale_parameter = 1, prm.warmup_init = 1;
                    if (mode == 1) {
                        dm = dev_poisoned(MN_FP32, n);
                        OK(mn_cuda_mem_set(&ctx, dm, 0, n * 4));
                    }
                    OK(mn_adafactor_init(&st, dims, ndim, &prm, NULL));
                    memset(&call, 0, sizeof call);
                    call.p = &prm;
                    call.a.exp_avg_sq_row = (float *)drow, call.a.exp_avg_sq_col = (float *)dcol;
                    call.a.exp_avg_sq = (float *)dv, call.a.exp_avg = (float *)dm;
                    call.a.batch = B, call.a.rows = R, call.a.cols = Cc;
                    for (t = 1; t <= 3; t++) {
                        OK(opt_case_grads(&c));
                        OK(mn_adafactor_step(&st, c.p, c.g, NULL));
                        call.a.flat = opt_case_flat(&c, (uint64_t)t);
                        OK(adafactor_run(&call));
                    }
                    if (factored) {
                        compare("adafactor exp_avg_sq_row", MN_FP32, 1e-5, drow, st.exp_avg_sq_row,
                                B * R);
                        compare("adafactor exp_avg_sq_col", MN_FP32, 1e-5, dcol, st.exp_avg_sq_col,
                                B * Cc);
                    } else {
                        compare("adafactor exp_avg_sq", MN_FP32, 1e-5, dv, st.exp_avg_sq, n);
                    }
                    if (dm) compare("adafactor exp_avg", MN_FP32, 1e-5, dm, st.exp_avg, n);
                    snprintf(what, sizeof what, "adafactor [%llu,%llu,%llu] mode %d",
                             (unsigned long long)B, (unsigned long long)R,
                             (unsigned long long)Cc, mode);
                    opt_case_check(&c, what, 1e-5);
                    if (s == 0 && d == 0 && clip) {  // found inf: nothing written
                        float *rbefore = down(MN_FP32, drow, B * R);
                        opt_case_inf(&c, what, &call.a.flat, adafactor_run, &call);
                        compare("adafactor row kept on inf", MN_FP32, 0.0, drow, rbefore, B * R);
                        free(rbefore);
                    }
                    mn_adafactor_free(&st);
                    release(drow), release(dcol), release(dv), release(dm);
                    opt_case_free(&c);
                }
}

// ---- GEMM and epilogues -------------------------------------------------------------------------

// tf32: fp32 only, on TF32 tensor cores: operands rounded to 10 mantissa bits (up to 2^-11 each,
// so a product to about 2^-10), summed over the depth of each product (C for out, OC for dinp, N
// for dweight) with random signs: 6 x 2^-10 sqrt(depth) times the operands' scales (x and dout
// 1, weight 0.05). On an H200 the largest errors were 0.28 to 0.57 of 4 x 2^-10 sqrt(depth).
static void test_matmul_ctx(mn_cuda *c, const char *tag, int tf32) {
    // dgelu/dbias column kernel: 16-byte packs for OC 3072, 40, 1000 (a partial last block of
    // packs, 60-row chunks), single elements for OC 11 and 50257
    static const size_t shapes[][3] = {{1, 37, 11}, {64, 768, 3072}, {129, 77, 40},
                                       {256, 64, 50257}, {300, 24, 1000}};
    size_t s;
    int d, mode;  // mode 0 plain, 1 bias, 2 bias + gelu, 3 gelu without bias
    char what[96];
    for (d = 0; d < (tf32 ? 1 : 3); d++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (mode = 0; mode < 4; mode++) {
                mn_dtype dt = dts[d];
                size_t N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2], i;
                double tol = dt_tol[d] * (d == 0 ? 1.0 : 2.0), tol_f = tol, tol_dx = tol;
                double tol_dw = tol * sqrt((double)N);
                int has_bias = mode == 1 || mode == 2, gelu = mode >= 2;
                float *x = hrand(dt, N * C, 1), *w = hrand(dt, OC * C, 0.05f);
                float *b = hrand(dt, OC, 1), *out = hvec(N * OC), *pre = hvec(N * OC);
                float *dy = hrand(dt, N * OC, 1), *dx = hrand(dt, N * C, 1);
                float *dw = hrand(dt, OC * C, 1), *db = hrand(dt, OC, 1);
                void *dxin, *dwt, *dbias, *dout, *dpre, *ddy, *ddx, *ddw, *ddb;
                if (tf32)
                    tol_f = 6.0 / 1024 * sqrt((double)C) * 0.05,
                    tol_dx = 6.0 / 1024 * sqrt((double)OC) * 0.05,
                    tol_dw = 6.0 / 1024 * sqrt((double)N);
                if (N * OC > 4000000 && d > 0) {  // the large-vocabulary shape once, in fp32
                    free(x), free(w), free(b), free(out), free(pre), free(dy), free(dx), free(dw);
                    free(db);
                    continue;
                }
                dxin = dev(dt, x, N * C), dwt = dev(dt, w, OC * C), dbias = dev(dt, b, OC);
                dout = dev_poisoned(dt, N * OC), dpre = gelu ? dev_poisoned(dt, N * OC) : NULL;
                OK(mn_cuda_matmul_forward(c, dout, dpre, dxin, dwt, has_bias ? dbias : NULL, N, C,
                                          OC, dt));
                mn_matmul_forward(out, gelu ? pre : NULL, x, w, has_bias ? b : NULL, N, C, OC);
                snprintf(what, sizeof what, "%s matmul fwd mode %d %zux%zux%zu", tag, mode, N, C, OC);
                if (gelu) {
                    compare(what, dt, tol_f, dpre, pre, N * OC);
                    // out = gelu(stored pre-activation)
                    for (i = 0; i < N * OC; i++) out[i] = (float)0, pre[i] = stf(dt, pre[i]);
                    mn_gelu_forward(out, pre, N * OC);
                }
                compare(what, dt, tol_f, dout, out, N * OC);
                // backward (gelu: from the stored pre-activation, dout rewritten to dpre)
                ddy = dev(dt, dy, N * OC), ddx = dev(dt, dx, N * C), ddw = dev(dt, dw, OC * C);
                ddb = dev(dt, db, OC);
                if (gelu) {
                    release(dpre);
                    dpre = dev(dt, pre, N * OC);
                }
                mn_matmul_backward(dx, dw, has_bias ? db : NULL, dy, x, w, gelu ? pre : NULL, N, C,
                                   OC);
                OK(mn_cuda_matmul_backward(c, ddx, ddw, has_bias ? ddb : NULL, ddy, dxin, dwt,
                                           gelu ? dpre : NULL, N, C, OC, dt));
                snprintf(what, sizeof what, "%s matmul bwd mode %d %zux%zux%zu", tag, mode, N, C, OC);
                compare(what, dt, tol_dx, ddx, dx, N * C);
                compare(what, dt, tol_dw, ddw, dw, OC * C);
                if (has_bias) compare(what, dt, tol_dw, ddb, db, OC);
                if (gelu) compare(what, dt, tol, ddy, dy, N * OC);  // dpre over dout
                release(dxin), release(dwt), release(dbias), release(dout), release(dpre);
                release(ddy), release(ddx), release(ddw), release(ddb);
                free(x), free(w), free(b), free(out), free(pre), free(dy), free(dx), free(dw);
                free(db);
            }
}

static void test_matmul(void) {
    test_matmul_ctx(&ctx, "fused", 0);
    test_matmul_ctx(&ctx_unfused, "unfused", 0);
    if (verbose)
        printf("  GEMMs: %llu fused epilogues, %llu fallbacks (fused context); %llu fallbacks "
               "(unfused context)\n", (unsigned long long)ctx.gemm_fused,
               (unsigned long long)ctx.gemm_unfused, (unsigned long long)ctx_unfused.gemm_unfused);
    CHECK(ctx_unfused.gemm_fused == 0);
}

// mn_cuda_desc.gemm_tune: the GEMMs and the attention against the CPU on a context that times
// cuBLASLt's candidates on the calls' own buffers. Only the beta-0 GEMMs may be tuned: a backward
// one (dinp and dweight accumulate) would be added to several times over. Then a fresh shape's
// first call (tuned) and its second (the kept choice) give the same bits, the second timing
// nothing.
static void test_matmul_tune(void) {
    mn_cuda c;
    mn_cuda_desc desc;
    const size_t N = 96, C = 320, OC = 1216;  // a shape no other case here uses
    float *x = hrand(MN_BF16, N * C, 1), *w = hrand(MN_BF16, OC * C, 0.05f);
    float *b = hrand(MN_BF16, OC, 1), *o1, *o2, *p1, *p2;
    void *dx, *dw, *db, *dout, *dpre;
    uint64_t before;
    memset(&desc, 0, sizeof desc);
    desc.logger.log_fn = log_stderr;
    desc.gemm_tune = 1, desc.stream = ctx.stream;
    if (mn_cuda_init(&c, &desc) != MN_OK) {
        FAIL("mn_cuda_init (gemm_tune)");
        free(x), free(w), free(b);
        return;
    }
    test_matmul_ctx(&c, "tuned", 0);
    CHECK(c.gemm_tuned > 0);
    test_attention_ctx(&c, "tuned ");
    dx = dev(MN_BF16, x, N * C), dw = dev(MN_BF16, w, OC * C), db = dev(MN_BF16, b, OC);
    dout = dev_poisoned(MN_BF16, N * OC), dpre = dev_poisoned(MN_BF16, N * OC);
    before = c.gemm_tuned;
    OK(mn_cuda_matmul_forward(&c, dout, dpre, dx, dw, db, N, C, OC, MN_BF16));
    CHECK(c.gemm_tuned <= before + 1);  // one GEMM: its candidates timed once (if several)
    o1 = down(MN_BF16, dout, N * OC), p1 = down(MN_BF16, dpre, N * OC);
    OK(mn_cuda_mem_set(&ctx, dout, 0xFF, N * OC * 2));
    OK(mn_cuda_mem_set(&ctx, dpre, 0xFF, N * OC * 2));
    before = c.gemm_tuned;
    OK(mn_cuda_matmul_forward(&c, dout, dpre, dx, dw, db, N, C, OC, MN_BF16));
    CHECK(c.gemm_tuned == before);
    o2 = down(MN_BF16, dout, N * OC), p2 = down(MN_BF16, dpre, N * OC);
    CHECK(!memcmp(o1, o2, N * OC * sizeof *o1) && !memcmp(p1, p2, N * OC * sizeof *p1));
    if (verbose)
        printf("  tuned: %llu GEMM shapes timed their candidates\n",
               (unsigned long long)c.gemm_tuned);
    release(dx), release(dw), release(db), release(dout), release(dpre);
    free(x), free(w), free(b), free(o1), free(o2), free(p1), free(p2);
    OK(mn_cuda_sync(&c));
    mn_cuda_free(&c);
}

// fp32 GEMMs with mn_cuda_desc.tf32 (TF32 tensor cores), fused and unfused epilogues.
static void test_matmul_tf32(void) {
    mn_cuda c;
    mn_cuda_desc desc;
    int unfused;
    for (unfused = 0; unfused < 2; unfused++) {
        memset(&desc, 0, sizeof desc);
        desc.logger.log_fn = log_stderr;
        desc.tf32 = 1, desc.no_fused_epilogues = unfused, desc.stream = ctx.stream;
        if (mn_cuda_init(&c, &desc) != MN_OK) {
            FAIL("mn_cuda_init (tf32)");
            return;
        }
        test_matmul_ctx(&c, unfused ? "tf32 unfused" : "tf32 fused", 1);
        CHECK(unfused ? c.gemm_fused == 0 : c.gemm_fused > 0);
        OK(mn_cuda_sync(&c));
        mn_cuda_free(&c);
    }
}

// ---- the caching allocator on the device --------------------------------------------------------

static void cache_workout(const char *config) {
    mn_cache c;
    mn_cache_desc cd;
    void *ptrs[64];
    int i, k;
    memset(&cd, 0, sizeof cd);
    memset(ptrs, 0, sizeof ptrs);
    cd.device = mn_cuda_device(&ctx);
    cd.config = config;
    cd.logger.log_fn = log_stderr;
    OK(mn_cache_init(&c, &cd));
    for (k = 0; k < 2000; k++) {
        i = (int)(urand() * 64);
        if (ptrs[i]) {
            OK(mn_cache_release(&c, ptrs[i]));
            ptrs[i] = NULL;
        } else {
            uint64_t size = urand() < 0.7 ? (uint64_t)(urand() * (1 << 20)) + 1
                                          : (uint64_t)(urand() * (64u << 20)) + 1;
            OK(mn_cache_alloc(&c, size, 0, MN_CAT_ACTIVATIONS, "t", &ptrs[i]));
            OK(mn_cuda_mem_set(&ctx, ptrs[i], 0x5a, size));  // the memory is real and writable
        }
        if (k % 100 == 0) OK(mn_cache_check(&c));
    }
    OK(mn_cuda_sync(&ctx));
    for (i = 0; i < 64; i++) OK(mn_cache_release(&c, ptrs[i]));
    OK(mn_cache_check(&c));
    OK(mn_cache_empty(&c));
    {
        struct mn_cache_stats st;
        OK(mn_cache_stats(&c, &st));
        CHECK(st.allocated_bytes[MN_STAT_ALL].current == 0);
        CHECK(st.reserved_bytes[MN_STAT_ALL].current == 0);
    }
    mn_cache_free(&c);
}

static void test_cache(void) {
    cache_workout(NULL);
    if (mn_cuda_device(&ctx).reserve_fn) cache_workout("expandable_segments:True");
    else printf("  (expandable segments: the driver's virtual memory entry points are missing)\n");
}

// Cross-stream use: a block freed after use on a second stream waits for an event.
static void test_cache_streams(void) {
    mn_cache c;
    mn_cache_desc cd;
    mn_stream s1;
    void *p = NULL, *q = NULL;
    memset(&cd, 0, sizeof cd);
    cd.device = mn_cuda_device(&ctx);
    OK(mn_cuda_stream_create(&ctx, &s1));
    OK(mn_cache_init(&c, &cd));
    OK(mn_cache_alloc(&c, 1 << 20, 0, MN_CAT_TEMPORARY, "x", &p));
    OK(mn_cache_record_stream(&c, p, s1));
    OK(mn_cache_release(&c, p));
    OK(mn_cache_check(&c));
    OK(mn_cuda_sync(&ctx));
    OK(mn_cache_alloc(&c, 1 << 20, 0, MN_CAT_TEMPORARY, "y", &q));
    OK(mn_cache_release(&c, q));
    OK(mn_cache_check(&c));
    mn_cache_free(&c);
}

// A context on another's stream (mn_cuda_desc.stream): its work is ordered with the owner's, and
// freeing it leaves the stream to its owner.
static void test_shared_stream(void) {
    mn_cuda c2;
    mn_cuda_desc d;
    float h[1000], *back;
    void *a = NULL, *b = NULL;
    size_t i;
    memset(&d, 0, sizeof d);
    d.logger.log_fn = log_stderr;
    d.stream = ctx.stream;
    for (i = 0; i < 1000; i++) h[i] = nrand();
    OK(mn_cuda_init(&c2, &d));
    CHECK(c2.stream == ctx.stream);
    a = dev(MN_FP32, h, 1000);
    b = dev_poisoned(MN_FP32, 1000);  // an asynchronous fill on ctx's stream
    OK(mn_cuda_gelu_forward(&c2, b, a, 1000, MN_FP32));  // queued after it on the same stream
    mn_cuda_free(&c2);
    OK(mn_cuda_sync(&ctx));  // the stream outlives the context that borrowed it
    back = down(MN_FP32, b, 1000);
    for (i = 0; i < 1000; i++) {
        float want;
        mn_gelu_forward(&want, &h[i], 1);
        if (!(fabsf(back[i] - want) <= 1e-5f * (1.0f + fabsf(want)))) {
            FAIL("shared stream: [%zu] got %g want %g", i, back[i], want);
            break;
        }
    }
    free(back);
    release(a), release(b);
}

// An allocation larger than the device: PyTorch's message with the real free and total bytes.
static void test_cache_oom(void) {
    mn_cache c;
    mn_cache_desc cd;
    void *p = NULL;
    char msg[2048];
    mn_result r;
    memset(&cd, 0, sizeof cd);
    cd.device = mn_cuda_device(&ctx);
    OK(mn_cache_init(&c, &cd));
    r = mn_cache_alloc(&c, ctx.total_bytes + (1ull << 30), 0, MN_CAT_ACTIVATIONS, "huge", &p);
    CHECK(r == MN_ERR_DEVICE_OOM);
    mn_cache_oom_message(&c, msg, sizeof msg);
    CHECK(strstr(msg, "CUDA out of memory") != NULL);
    {  // the device's real total, as PyTorch formats it
        char total[64], want[96];
        mn_cache_format_size(ctx.total_bytes, total, sizeof total);
        snprintf(want, sizeof want, "total capacity of %s of which", total);
        CHECK(strstr(msg, want) != NULL);
    }
    if (verbose) printf("  OOM message: %s\n", msg);
    OK(mn_cache_check(&c));
    mn_cache_free(&c);
}

// Shapes whose element counts or offsets wrap are refused on the host before any launch, and
// nothing is written (the buffer keeps its poison); B = 0 is still an empty call.
static void test_shape_overflow(void) {
    const size_t big = (size_t)1 << 32, q = (size_t)-1 / sizeof(float) + 1;
    float *buf = (float *)dev_poisoned(MN_FP32, 1024), *h;
    int *tok = (int *)dev_poisoned(MN_FP32, 16);
    size_t i;
#define REFUSED(call) CHECK((call) == MN_ERR_INVALID_ARG)
    REFUSED(mn_cuda_embedding_forward(&ctx, buf, tok, buf, NULL, big, big, 8, 100, MN_FP32));
    REFUSED(mn_cuda_embedding_forward(&ctx, buf, tok, buf, NULL, 1, 2, q / 2 + 1, 2, MN_FP32));
    REFUSED(mn_cuda_embedding_backward(&ctx, buf, NULL, buf, tok, big, big, 8, 100, MN_FP32));
    REFUSED(mn_cuda_crossentropy_forward_backward(&ctx, buf, buf, buf, tok, 1.0f, 2, q, MN_FP32));
    REFUSED(mn_cuda_layernorm_forward(&ctx, buf, buf, buf, buf, buf, NULL, big, big, 1e-5f,
                                      MN_FP32));
    REFUSED(mn_cuda_softmax_forward(&ctx, buf, buf, big, big, 1.0f, 0, MN_FP32));
    REFUSED(mn_cuda_gelu_forward(&ctx, buf, buf, q, MN_BF16));
    REFUSED(mn_cuda_global_norm(&ctx, buf, buf, (uint64_t)q, MN_FP32));
    REFUSED(mn_cuda_matmul_forward(&ctx, buf, NULL, buf, buf, NULL, big, big, 8, MN_FP32));
    REFUSED(mn_cuda_attention_forward(&ctx, buf, NULL, buf, big, 2, big, 2, 1, MN_FP32));
#undef REFUSED
    OK(mn_cuda_embedding_forward(&ctx, buf, tok, buf, NULL, 0, big, 8, 100, MN_FP32));
    OK(mn_cuda_sync(&ctx));
    h = down(MN_FP32, buf, 1024);
    for (i = 0; i < 1024 && h[i] != h[i]; i++) continue;
    CHECK(i == 1024);  // every element still the NaN poison
    free(h);
    release(buf), release(tok);
}

typedef struct tcase {
    const char *name;
    void (*fn)(void);
} tcase;

static const tcase cases[] = {
    {"gelu", test_gelu},
    {"shape_overflow", test_shape_overflow},
    {"residual", test_residual},
    {"workspace", test_workspace},
    {"scratch", test_scratch},
    {"layernorm", test_layernorm},
    {"softmax", test_softmax},
    {"attention", test_attention},
    {"crossentropy", test_crossentropy},
    {"global_norm", test_global_norm},
    {"embedding", test_embedding},
    {"adamw", test_adamw},
    {"adamw8bit", test_adamw8bit},
    {"sgd_lion", test_sgd_lion},
    {"adafactor", test_adafactor},
    {"matmul", test_matmul},
    {"matmul_tf32", test_matmul_tf32},
    {"matmul_tune", test_matmul_tune},
    {"cache", test_cache},
    {"cache_streams", test_cache_streams},
    {"cache_oom", test_cache_oom},
    {"shared_stream", test_shared_stream},
};

int main(int argc, char **argv) {
    char reason[256];
    int count = 0, passed = 0, failed = 0, exact = 0;
    size_t i;
    const char *seed = getenv("MN_TEST_SEED");
    mn_cuda_desc desc;
    if (argc > 1 && !strcmp(argv[1], "--list")) {  // the cases' names, a line each (no device)
        for (i = 0; i < sizeof cases / sizeof cases[0]; i++) printf("%s\n", cases[i].name);
        return 0;
    }
    if (mn_cuda_device_count(&count, reason, sizeof reason) != MN_OK) {
        printf("SKIP cuda: no CUDA device (%s)\n", reason);
        return 0;
    }
    verbose = getenv("MN_TEST_VERBOSE") && *getenv("MN_TEST_VERBOSE") != '0';
    for (i = 0; argc > 1 && i < sizeof cases / sizeof cases[0]; i++)
        exact |= !strcmp(cases[i].name, argv[1]);  // a case's own name runs that case alone
    rng = seed ? strtoull(seed, NULL, 10) : (uint64_t)time(NULL);
    memset(&desc, 0, sizeof desc);
    desc.logger.log_fn = log_stderr;
    if (mn_cuda_init(&ctx, &desc) != MN_OK) {
        printf("[FAIL] mn_cuda_init\n0 passed, 1 failed\n");
        return 1;
    }
    desc.no_fused_epilogues = 1;
    desc.stream = ctx.stream;  // one stream: the unfused GEMMs are ordered with ctx's copies
    if (mn_cuda_init(&ctx_unfused, &desc) != MN_OK) {
        printf("[FAIL] mn_cuda_init (unfused)\n0 passed, 1 failed\n");
        return 1;
    }
    printf("cuda tests on %s (sm %d, %llu MiB, cuBLASLt workspace %llu MiB), seed %llu\n",
           ctx.name, ctx.sm, (unsigned long long)(ctx.total_bytes >> 20),
           (unsigned long long)(ctx.workspace_bytes >> 20), (unsigned long long)rng);
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (argc > 1 && (exact ? strcmp(cases[i].name, argv[1]) : !strstr(cases[i].name, argv[1])))
            continue;
        cur_failed = 0;
        cases[i].fn();
        if (mn_cuda_sync(&ctx) != MN_OK) FAIL("stream error after the test");
        printf("%s cuda/%s\n", cur_failed ? "[FAIL]" : "[ OK ]", cases[i].name);
        if (cur_failed) failed++;
        else passed++;
    }
    mn_cuda_free(&ctx_unfused);
    mn_cuda_free(&ctx);
    printf("cuda: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
