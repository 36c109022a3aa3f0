// GPU benchmark of memanat_cuda.cu: one table.
//   - memory-bound kernels: GB/s (bytes each must move / time) against the device-to-device
//     cudaMemcpy bandwidth measured in the same run (2 x bytes per copy: read + write);
//   - GEMMs: TFLOP/s (2 N C OC per GEMM) with each epilogue, fused and unfused, against a plain
//     cuBLASLt GEMM of the same shape; every algorithm cuBLASLt's heuristic offers for the plain
//     GEMMs and each epilogue, timed; the forward rows again on a context with desc.gemm_tune
//     (the fastest candidate kept); the fp32 GEMM in full precision and on TF32 tensor cores;
//   - the caching allocator: ns per cached malloc+free on the device backend against
//     cudaMalloc+cudaFree, and the order in which cudaMalloc hands out addresses.
// Training sizes of GPT-2 small in bf16: B*T = 8192 rows, C = 768, 4C = 3072, V = 50257, the
// B = 8 x 12-head 1024-token causal softmax and attention, AdamW, SGD, Lion, Adafactor over 124M
// parameters. Build: make gpu-bench (nvcc),
// run: build/bench_gpu (bench/gpu.sh does both); build/bench_gpu WORD... runs the rows and sections
// (GEMM, attention, allocator, address) whose names hold a WORD; `once` first: each memory-bound
// kernel launched once, untimed (for ncu); `--batch B` (before the words): B sequences of 1024
// instead of 8 (64 is llm.c's batch for this model on one GPU). Times: median of 20 runs after 3
// warm-ups, each run 10 launches in a row (time_ms).
#define MEMANAT_CUDA
#include "../memanat.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static mn_cuda ctx, ctx_unfused, ctx_tf32;  // the last: fp32 GEMMs on TF32 tensor cores
static mn_cuda ctx_tuned;  // desc.gemm_tune: a shape's first GEMM keeps the fastest candidate
static double copy_gbs;

#define DIE(...) do { fprintf(stderr, "bench_gpu: " __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)
#define CU(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) \
    DIE("%s: %s", #call, cudaGetErrorString(e_)); } while (0)
#define MN(call) do { mn_result r_ = (call); if (r_ != MN_OK) \
    DIE("%s: %s", #call, mn_result_str(r_)); } while (0)

// n values uniform in [lo, hi) (a fixed LCG), fp32 or truncated to bf16, copied to dst.
static void fill_vals(void *dst, size_t n, float lo, float hi, int bf16) {
    size_t es = bf16 ? 2 : 4, i;
    unsigned char *h = (unsigned char *)malloc(n * es);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    if (!h) DIE("out of host memory for %zu values", n);
    for (i = 0; i < n; i++) {
        float f;
        uint32_t u;
        uint16_t b;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        f = lo + (hi - lo) * (float)(s >> 40) / 16777216.0f;
        memcpy(&u, &f, 4);
        b = (uint16_t)(u >> 16);
        if (bf16) memcpy(h + 2 * i, &b, 2);
        else memcpy(h + 4 * i, &u, 4);
    }
    CU(cudaMemcpy(dst, h, n * es, cudaMemcpyHostToDevice));
    free(h);
}
static void fill_bf16(void *dst, size_t n, float lo, float hi) { fill_vals(dst, n, lo, hi, 1); }

static void *dalloc(size_t bytes) {
    void *p = NULL;
    MN(mn_cuda_mem_alloc(&ctx, bytes, &p));
    MN(mn_cuda_mem_set(&ctx, p, 0, bytes));
    return p;
}

static int cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

// Median milliseconds a launch of fn over 20 timed runs on ctx's stream, each run `reps` launches
// in a row between two events (as a training step queues its kernels), after 3 warm-up runs.
// cold: each run one launch, the L2 cache flushed before it outside the events, so that no input
// is served from the previous run's L2 lines. cold 1: a memset of twice the L2 (nvbench's and
// Triton's do_bench's flush); its lines are dirty, and their write-back during the kernel is in
// its time (a cost a kernel that moves less than the L2 feels). cold 2: a read of the same bytes
// (the global norm of them), which leaves clean lines, as ncu's invalidation does.
typedef void (*bench_fn)(void *);
static void *flush_buf, *flush_norm;
static size_t flush_bytes;
static float time_runs(bench_fn fn, void *arg, int reps, int cold) {
    cudaEvent_t a, b;
    float t[20];
    int i, j;
    cudaStream_t s = (cudaStream_t)ctx.stream;
    CU(cudaEventCreate(&a));
    CU(cudaEventCreate(&b));
    for (i = 0; i < 3; i++)
        for (j = 0; j < reps; j++) fn(arg);
    for (i = 0; i < 20; i++) {
        if (cold == 1) CU(cudaMemsetAsync(flush_buf, i & 1, flush_bytes, s));
        if (cold == 2)
            MN(mn_cuda_global_norm(&ctx, (float *)flush_norm, flush_buf, flush_bytes / 4, MN_FP32));
        CU(cudaEventRecord(a, s));
        for (j = 0; j < reps; j++) fn(arg);
        CU(cudaEventRecord(b, s));
        CU(cudaEventSynchronize(b));
        CU(cudaEventElapsedTime(&t[i], a, b));
        t[i] /= (float)reps;
    }
    CU(cudaEventDestroy(a));
    CU(cudaEventDestroy(b));
    qsort(t, 20, sizeof t[0], cmp_f);
    return t[10];
}
#define REPS 10
static float time_ms(bench_fn fn, void *arg) { return time_runs(fn, arg, REPS, 0); }

// A memory-bound row: the time of a launch alone with a cold L2 (memset flush), its GB/s and share
// of copy (the figure the targets take); beside it the share of copy alone after a clean flush,
// and of REPS launches in a row on the same buffers, where an input that fits in L2 (50 MB on an
// H100) comes back from it.
static int once;  // `bench_gpu once`: each memory-bound kernel launched once, untimed (for ncu)
static char **only;  // `bench_gpu [once] WORD...`: the rows and sections whose names hold a WORD
static int nonly;
static int wanted(const char *name) {
    int i;
    for (i = 0; i < nonly; i++)
        if (strstr(name, only[i])) return 1;
    return nonly == 0;
}
// The last column: the kernel's cold time against a cudaMemcpy of the same bytes (half read,
// half written) timed the same way, cold after the memset flush: what a kernel of that size can
// expect when launch, ramp-up and the flush's write-back weigh as much as the transfer. Past the
// copy buffers' size (200 MB a side) the copy's rate is flat: the copy of the buffers' size,
// scaled to the bytes.
static void *big_a, *big_b;
static size_t copy_bytes, copy_n;
static void f_copy(void *) {  // copy_n bytes from big_a to big_b
    CU(cudaMemcpyAsync(big_b, big_a, copy_n, cudaMemcpyDeviceToDevice, (cudaStream_t)ctx.stream));
}
static void row_bw(const char *name, double bytes, bench_fn fn, void *arg) {
    float ms, ms1, ms2, msc;
    if (!wanted(name)) return;
    if (once) {
        fn(arg);
        CU(cudaStreamSynchronize((cudaStream_t)ctx.stream));
        return;
    }
    ms = time_runs(fn, arg, 1, 1), ms2 = time_runs(fn, arg, 1, 2), ms1 = time_ms(fn, arg);
    copy_n = bytes / 2 < (double)copy_bytes ? (size_t)(bytes / 2) / 256 * 256 : copy_bytes;
    msc = time_runs(f_copy, NULL, 1, 1) * (float)(bytes / 2 / (double)copy_n);
    double gbs = bytes / (ms * 1e-3) / 1e9, gbs1 = bytes / (ms1 * 1e-3) / 1e9;
    double gbs2 = bytes / (ms2 * 1e-3) / 1e9;
    printf("| %-56s | %8.4f ms | %7.1f GB/s | %5.1f %% | %5.1f %% | %5.1f %% | %5.1f %% |\n", name,
           ms, gbs, 100.0 * gbs / copy_gbs, 100.0 * gbs2 / copy_gbs, 100.0 * gbs1 / copy_gbs,
           100.0 * msc / ms);
}

// ---- the benchmarks ------------------------------------------------------------------------------
enum { C = 768, C4 = 3072, V = 50257, NH = 12, T = 1024 };
static int BT = 8 * T;  // --batch B: B T rows
static void *x, *y, *w, *bias, *mean, *rstd, *logits, *targets, *losses;
static void *pre, *dres;
static size_t adam_n = 124000000ull;
static void *ap, *ag, *am, *av, *a16, *anorm;

static void f_ln_fwd(void *) { MN(mn_cuda_layernorm_forward(&ctx, y, (float *)mean, (float *)rstd, x, w, bias, BT, C, 1e-5f, MN_BF16)); }
static void f_resln_fwd(void *) { MN(mn_cuda_residual_layernorm_forward(&ctx, dres, y, (float *)mean, (float *)rstd, x, pre, w, bias, BT, C, 1e-5f, MN_BF16)); }
static void f_ln_bwd(void *) { MN(mn_cuda_layernorm_backward(&ctx, dres, w, bias, y, x, w, (const float *)mean, (const float *)rstd, BT, C, MN_BF16)); }
static void f_gelu_fwd(void *) { MN(mn_cuda_gelu_forward(&ctx, big_b, big_a, (size_t)BT * C4, MN_BF16)); }
static void f_gelu_bwd(void *) { MN(mn_cuda_gelu_backward(&ctx, big_b, pre, big_a, (size_t)BT * C4, MN_BF16)); }
static void f_sm_fwd(void *) { MN(mn_cuda_softmax_forward(&ctx, big_b, big_a, (size_t)BT * NH, T, 0.125f, 1, MN_BF16)); }
static void f_sm_bwd(void *) { MN(mn_cuda_softmax_backward(&ctx, big_b, pre, big_a, (size_t)BT * NH, T, 0.125f, 1, MN_BF16)); }
static void f_ce(void *) { MN(mn_cuda_crossentropy_forward_backward(&ctx, (float *)losses, logits, logits, (const int *)targets, 1.0f / BT, BT, V, MN_BF16)); }
static void f_norm(void *) { MN(mn_cuda_global_norm(&ctx, (float *)anorm, ag, adam_n, MN_BF16)); }
// The flat-buffer arguments every optimizer row shares: 124M fp32 master weights with a bf16
// copy and bf16 gradients, clipped by the global norm.
static mn_cuda_optim_flat bench_flat(uint64_t n, uint64_t step) {
    mn_cuda_optim_flat f;
    memset(&f, 0, sizeof f);
    f.param = (float *)ap, f.param16 = a16, f.param16_dtype = MN_BF16, f.grad = ag;
    f.grad_dtype = MN_BF16, f.n = n, f.step = step;
    f.grad_norm = (const float *)anorm, f.max_norm = 1.0f;
    return f;
}

static void f_adamw(void *) {
    mn_cuda_adamw_args a;
    a.flat = bench_flat(adam_n, 1), a.exp_avg = (float *)am, a.exp_avg_sq = (float *)av;
    MN(mn_cuda_adamw_step(&ctx, NULL, &a));
}

// 8-bit AdamW: codes in am (m then v, a byte each), block scales in av. *skip = 1: the tensors
// one element past 16-byte alignment, which the thread-block-per-block kernel serves (it also
// serves other block sizes; a warp a block otherwise).
static void f_adamw8bit(void *skip) {
    size_t s = *(const size_t *)skip;
    mn_cuda_adamw8bit_args a;
    memset(&a, 0, sizeof a);
    a.flat = bench_flat(adam_n - s, 1);
    a.flat.param += s, a.flat.grad = (const uint16_t *)ag + s;
    a.flat.param16 = (uint16_t *)a16 + s;
    a.code1 = (uint8_t *)am, a.code2 = (uint8_t *)am + adam_n;
    a.absmax1 = (float *)av, a.absmax2 = (float *)av + (adam_n + 255) / 256;
    MN(mn_cuda_adamw8bit_step(&ctx, NULL, &a));
}

static void f_sgd(void *) {
    mn_cuda_sgd_args a;
    mn_sgd_params p;
    memset(&p, 0, sizeof p);
    p.momentum = 0.9f;
    a.flat = bench_flat(adam_n, 2), a.momentum_buffer = (float *)am;
    MN(mn_cuda_sgd_step(&ctx, &p, &a));
}
static void f_lion(void *) {
    mn_cuda_lion_args a;
    a.flat = bench_flat(adam_n, 1), a.exp_avg = (float *)am;
    MN(mn_cuda_lion_step(&ctx, NULL, &a));
}

// Adafactor, factored [161458, 768] (about 124M): reads p once for RMS(p), g three times (rows,
// columns with the update's RMS, the update), p read+write and the 16-bit copy: 20 bytes per
// element.
static void *af_row, *af_col;
enum { AF_ROWS = 161458 };
static void f_adafactor(void *) {
    mn_cuda_adafactor_args a;
    memset(&a, 0, sizeof a);
    a.flat = bench_flat((uint64_t)AF_ROWS * C, 2);
    a.exp_avg_sq_row = (float *)af_row, a.exp_avg_sq_col = (float *)af_col;
    a.batch = 1, a.rows = AF_ROWS, a.cols = C;
    MN(mn_cuda_adafactor_step(&ctx, NULL, &a));
}

typedef struct gemm_arg {
    mn_cuda *c;
    int bias, gelu, backward;
} gemm_arg;
static void f_gemm(void *p) {
    gemm_arg *g = (gemm_arg *)p;
    if (g->backward)
        MN(mn_cuda_matmul_backward(g->c, x, w, g->bias ? bias : NULL, big_b, x, w,
                                   g->gelu ? pre : NULL, BT, C, C4, MN_BF16));
    else
        MN(mn_cuda_matmul_forward(g->c, big_b, g->gelu ? pre : NULL, x, w, g->bias ? bias : NULL,
                                  BT, C, C4, MN_BF16));
}

static void gemms(void) {
    static const struct {
        const char *name;
        int fused, bias, gelu, backward;  // fused 2: the tuned context (desc.gemm_tune)
    } rows[] = {
        {"GEMM fwd plain (no epilogue)", 1, 0, 0, 0},
        {"GEMM fwd + bias, fused (BIAS)", 1, 1, 0, 0},
        {"GEMM fwd + bias, unfused (GEMM + kernel)", 0, 1, 0, 0},
        {"GEMM fwd + bias + GELU, fused (GELU_AUX_BIAS)", 1, 1, 1, 0},
        {"GEMM fwd + bias + GELU, unfused", 0, 1, 1, 0},
        {"GEMM fwd plain, tuned (desc.gemm_tune)", 2, 0, 0, 0},
        {"GEMM fwd + bias, fused, tuned", 2, 1, 0, 0},
        {"GEMM fwd + bias + GELU, fused, tuned", 2, 1, 1, 0},
        {"GEMM bwd dinp+dweight (2 GEMMs)", 1, 0, 0, 1},
        {"GEMM bwd + dbias, fused (BGRADB)", 1, 1, 0, 1},
        {"GEMM bwd + dbias, unfused (column kernel)", 0, 1, 0, 1},
        {"GEMM bwd + dGELU + dbias (dGELU/dbias kernel + 2 GEMMs)", 1, 1, 1, 1},
    };
    double flops_f = 2.0 * BT * C * C4, plain_f = 0, plain_b = 0;
    size_t i;
    printf("\n| GEMM %dx%dx%d bf16 (fp32 accumulate)              |      time |     TFLOP/s | vs plain |\n",
           BT, C, C4);
    printf("|---|---|---|---|\n");
    for (i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        gemm_arg g = {rows[i].fused == 2 ? &ctx_tuned : rows[i].fused ? &ctx : &ctx_unfused,
                      rows[i].bias, rows[i].gelu, rows[i].backward};
        uint64_t f0 = g.c->gemm_fused;
        float ms = time_ms(f_gemm, &g);
        double fl = rows[i].backward ? 2 * flops_f : flops_f, tf = fl / (ms * 1e-3) / 1e12;
        if (i == 0) plain_f = tf;
        if (rows[i].backward && plain_b == 0) plain_b = tf;
        printf("| %-50s | %6.3f ms | %7.1f | %5.1f %% %s|\n", rows[i].name, ms, tf,
               100.0 * tf / (rows[i].backward ? plain_b : plain_f),
               // the backward with GELU has no epilogue to refuse: its kernel runs first
               rows[i].fused && (rows[i].bias || rows[i].gelu) && !(rows[i].backward && rows[i].gelu) &&
                       g.c->gemm_fused == f0
                   ? "(epilogue refused: fallback ran) " : "");
    }
}

// fp32 GEMM at the same shape, full fp32 (ctx) and TF32 (ctx_tf32): inputs in big_a (x, then
// the weight), the output in big_b.
static void f_gemm_fp32(void *p) {
    float *xa = (float *)big_a, *wa = xa + (size_t)BT * C;
    MN(mn_cuda_matmul_forward((mn_cuda *)p, big_b, NULL, xa, wa, NULL, BT, C, C4, MN_FP32));
}
static void gemm_fp32(void) {
    double fl = 2.0 * BT * C * C4;
    float full, tf;
    fill_vals(big_a, (size_t)BT * C + (size_t)C4 * C, -1.0f, 1.0f, 0);
    full = time_ms(f_gemm_fp32, &ctx), tf = time_ms(f_gemm_fp32, &ctx_tf32);
    printf("\n| GEMM %dx%dx%d fp32 inputs                      |      time |     TFLOP/s | vs full fp32 |\n",
           BT, C, C4);
    printf("|---|---|---|---|\n");
    printf("| %-50s | %6.3f ms | %7.1f | %5.1f %% |\n", "fp32, full precision", full,
           fl / (full * 1e-3) / 1e12, 100.0);
    printf("| %-50s | %6.3f ms | %7.1f | %5.1f %% |\n", "fp32 on TF32 tensor cores (desc.tf32)", tf,
           fl / (tf * 1e-3) / 1e12, 100.0 * full / tf);
}

// Attention at GPT-2 small training size: B = 8, T = 1024, 12 heads of 64, causal, bf16. FLOPs
// count the full T x T products the GEMMs compute (2 per forward, 4 per backward with att kept,
// 5 with att NULL), 2 B NH T^2 hs each; the permutes and the softmax are in the time.
static void *qkv, *qkv_d, *att_o, *att_p;
typedef struct att_arg {
    int backward, keep;
} att_arg;
static void f_att(void *p) {
    att_arg *a = (att_arg *)p;
    if (a->backward)
        MN(mn_cuda_attention_backward(&ctx, qkv_d, att_o, qkv, a->keep ? att_p : NULL, BT / T, T,
                                      C, NH, 1, MN_BF16));
    else
        MN(mn_cuda_attention_forward(&ctx, att_o, a->keep ? att_p : NULL, qkv, BT / T, T, C, NH,
                                     1, MN_BF16));
}

static void attention(void) {
    static const struct {
        const char *name;
        int backward, keep, gemms;
    } rows[] = {
        {"attention forward, att kept", 0, 1, 2},
        {"attention forward, att NULL", 0, 0, 2},
        {"attention backward, att kept", 1, 1, 4},
        {"attention backward, att NULL (recomputed)", 1, 0, 5},
    };
    double per_gemm = 2.0 * (BT / T) * NH * (double)T * T * (C / NH);
    size_t i;
    qkv = dalloc((size_t)BT * 3 * C * 2), qkv_d = dalloc((size_t)BT * 3 * C * 2);
    att_o = dalloc((size_t)BT * C * 2), att_p = dalloc((size_t)(BT / T) * NH * T * T * 2);
    fill_bf16(qkv, (size_t)BT * 3 * C, -1.0f, 1.0f);
    printf("\n| attention B=%d T=%d C=%d NH=%d causal bf16        |      time | TFLOP/s (full T x T) |\n",
           BT / T, T, C, NH);
    printf("|---|---|---|\n");
    for (i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        att_arg a = {rows[i].backward, rows[i].keep};
        float ms = time_ms(f_att, &a);
        printf("| %-50s | %6.3f ms | %7.1f |\n", rows[i].name, ms,
               rows[i].gemms * per_gemm / (ms * 1e-3) / 1e12);
    }
}

// cuBLASLt's candidates for a GEMM: every algorithm its heuristic offers (up to 32, in its
// order) timed at the shape, so that an epilogue's gap to the plain GEMM can be read as the
// heuristic's choice or as the best cuBLASLt has. The library runs the first.
typedef struct lt_gemm {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    const void *A, *B;
    void *D;
    float beta;
    cublasLtMatmulAlgo_t algo;
} lt_gemm;
#define LT(call) do { cublasStatus_t s_ = (call); if (s_ != CUBLAS_STATUS_SUCCESS) \
    DIE("%s: status %d", #call, (int)s_); } while (0)
static void f_lt(void *p) {
    lt_gemm *g = (lt_gemm *)p;
    float one = 1.0f;
    LT(cublasLtMatmul((cublasLtHandle_t)ctx.lt, g->op, &one, g->A, g->la, g->B, g->lb, &g->beta,
                      g->D, g->ld, g->D, g->ld, &g->algo, ctx.workspace, ctx.workspace_bytes,
                      (cudaStream_t)ctx.stream));
}
// forward: D (OC x N) = W^T-op . x (+ bias, GELU with aux); backward: dW (C x OC) += x . dout^T
// (BGRADB: the column sums of dout into a [OC] buffer).
static double gemm_candidates(const char *name, int backward, cublasLtEpilogue_t epi,
                              double plain_best) {
    lt_gemm g;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t res[32];
    cublasOperation_t tn = CUBLAS_OP_N, tt = CUBLAS_OP_T;
    uint64_t ws = ctx.workspace_bytes;
    int nres = 0, i, best = -1;
    float t_first = 0, t_best = 0;
    double fl = 2.0 * BT * C * C4;
    memset(&g, 0, sizeof g);
    LT(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, backward ? &tn : &tt,
                                      sizeof tn));
    LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, backward ? &tt : &tn,
                                      sizeof tn));
    LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (epi != CUBLASLT_EPILOGUE_DEFAULT) {
        void *b = backward ? dres : bias;  // BGRADB writes [OC]: dres has room
        LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof b));
    }
    if (epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
        int64_t ld = C4;
        LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &pre,
                                          sizeof pre));
        LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                          sizeof ld));
    }
    if (backward) {  // m = C, n = OC, k = N
        LT(cublasLtMatrixLayoutCreate(&g.la, CUDA_R_16BF, C, BT, C));
        LT(cublasLtMatrixLayoutCreate(&g.lb, CUDA_R_16BF, C4, BT, C4));
        LT(cublasLtMatrixLayoutCreate(&g.ld, CUDA_R_16BF, C, C4, C));
        g.A = x, g.B = big_a, g.D = w, g.beta = 1.0f;
    } else {  // m = OC, n = N, k = C
        LT(cublasLtMatrixLayoutCreate(&g.la, CUDA_R_16BF, C, C4, C));
        LT(cublasLtMatrixLayoutCreate(&g.lb, CUDA_R_16BF, C, BT, C));
        LT(cublasLtMatrixLayoutCreate(&g.ld, CUDA_R_16BF, C4, BT, C4));
        g.A = w, g.B = x, g.D = big_b, g.beta = 0.0f;
    }
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                            sizeof ws));
    if (cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)ctx.lt, g.op, g.la, g.lb, g.ld, g.ld,
                                       pref, 32, res, &nres) != CUBLAS_STATUS_SUCCESS)
        nres = 0;
    for (i = 0; i < nres; i++) {
        float ms;
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        g.algo = res[i].algo;
        ms = time_ms(f_lt, &g);
        if (i == 0) t_first = ms;
        if (best < 0 || ms < t_best) best = i, t_best = ms;
    }
    if (best < 0)
        printf("| %-36s | none |\n", name);
    else
        printf("| %-36s | %2d | %6.3f ms | %6.3f ms (#%d) | %7.1f | %5.1f %% |\n", name, nres,
               t_first, t_best, best + 1, fl / (t_best * 1e-3) / 1e12,
               plain_best > 0 ? 100.0 * fl / (t_best * 1e-3) / 1e12 / plain_best : 100.0);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(g.ld), cublasLtMatrixLayoutDestroy(g.lb);
    cublasLtMatrixLayoutDestroy(g.la), cublasLtMatmulDescDestroy(g.op);
    return best < 0 ? 0 : fl / (t_best * 1e-3) / 1e12;
}
static void gemm_sweep(void) {
    double pf, pb;
    printf("\n| cuBLASLt's candidates, %dx%dx%d bf16 | algos | the first | the fastest | TFLOP/s "
           "| vs fastest plain |\n", BT, C, C4);
    printf("|---|---|---|---|---|---|\n");
    pf = gemm_candidates("fwd plain", 0, CUBLASLT_EPILOGUE_DEFAULT, 0);
    gemm_candidates("fwd BIAS", 0, CUBLASLT_EPILOGUE_BIAS, pf);
    gemm_candidates("fwd GELU_AUX_BIAS", 0, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, pf);
    pb = gemm_candidates("bwd dweight plain (beta 1)", 1, CUBLASLT_EPILOGUE_DEFAULT, 0);
    gemm_candidates("bwd dweight BGRADB (beta 1)", 1, CUBLASLT_EPILOGUE_BGRADB, pb);
}

static void allocator(void) {
    mn_cache c;
    mn_cache_desc cd;
    cudaEvent_t a, b;
    void *p;
    float ms_cache, ms_raw;
    int i, n = 20000, nr = 2000;
    memset(&cd, 0, sizeof cd);
    cd.device = mn_cuda_device(&ctx);
    MN(mn_cache_init(&c, &cd));
    MN(mn_cache_alloc(&c, 1 << 20, 0, MN_CAT_ACTIVATIONS, "warm", &p));
    MN(mn_cache_release(&c, p));
    CU(cudaEventCreate(&a));
    CU(cudaEventCreate(&b));
    CU(cudaEventRecord(a, 0));
    for (i = 0; i < n; i++) {
        MN(mn_cache_alloc(&c, 1 << 20, 0, MN_CAT_ACTIVATIONS, "x", &p));
        MN(mn_cache_release(&c, p));
    }
    CU(cudaEventRecord(b, 0));
    CU(cudaEventSynchronize(b));
    CU(cudaEventElapsedTime(&ms_cache, a, b));
    CU(cudaEventRecord(a, 0));
    for (i = 0; i < nr; i++) {
        CU(cudaMalloc(&p, 1 << 20));
        CU(cudaFree(p));
    }
    CU(cudaEventRecord(b, 0));
    CU(cudaEventSynchronize(b));
    CU(cudaEventElapsedTime(&ms_raw, a, b));
    printf("\n| allocator, 1 MiB blocks                        | ns per malloc+free |\n|---|---|\n");
    printf("| mn_cache on mn_cuda_device (cached)            | %10.0f |\n", ms_cache * 1e6 / n);
    printf("| cudaMalloc + cudaFree                          | %10.0f |\n", ms_raw * 1e6 / nr);
    mn_cache_free(&c);
}

// The order of the addresses cudaMalloc hands out. The cache serves the lowest-addressed of equal
// free blocks (as PyTorch's), so the order decides which segment a request splits; the replay of
// the estimator's simulated device takes it to be ascending. Six allocations of a size in a row,
// then two of them freed and one more asked for: where it lands.
static void address_order(void) {
    static const size_t sizes[] = {(size_t)1 << 20,  (size_t)2 << 20,   (size_t)4 << 20,
                                   (size_t)6 << 20,  (size_t)8 << 20,   (size_t)10 << 20,
                                   (size_t)12 << 20, (size_t)20 << 20,  (size_t)32 << 20,
                                   (size_t)64 << 20, (size_t)256 << 20, (size_t)1024 << 20};
    size_t s;
    printf("\n| cudaMalloc, 6 in a row       | steps up / down | after freeing the 3rd and 4th, the next |\n"
           "|---|---|---|\n");
    for (s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        char *p[6], *q;
        int i, up = 0, down = 0;
        const char *where;
        for (i = 0; i < 6; i++) CU(cudaMalloc((void **)&p[i], sizes[s]));
        for (i = 1; i < 6; i++) up += p[i] > p[i - 1], down += p[i] < p[i - 1];
        CU(cudaFree(p[2]));
        CU(cudaFree(p[3]));
        CU(cudaMalloc((void **)&q, sizes[s]));
        where = q == p[2] ? "the 3rd's address" : q == p[3] ? "the 4th's address"
                : q > p[5] && q > p[0] ? "above all six" : q < p[5] && q < p[0] ? "below all six"
                                                                             : "elsewhere";
        printf("| %4zu MiB                       | %d / %d | %s |\n", sizes[s] >> 20, up, down,
               where);
        p[2] = q;
        for (i = 0; i < 6; i++)
            if (i != 3) CU(cudaFree(p[i]));
    }
}

// Where blocks go after a large one: a k MiB cudaMalloc, then 12 of 2 MiB, each printed in MiB
// from the large block (a range the large one opened shows as +k, +k+2, ...).
static void address_fill(void) {
    static const int ks[] = {20, 40, 100};
    size_t s;
    for (s = 0; s < sizeof ks / sizeof ks[0]; s++) {
        char *big, *q[12];
        int i;
        CU(cudaMalloc((void **)&big, (size_t)ks[s] << 20));
        printf("cudaMalloc of %d MiB, then 2 MiB blocks at MiB from it:", ks[s]);
        for (i = 0; i < 12; i++) {
            CU(cudaMalloc((void **)&q[i], (size_t)2 << 20));
            printf(" %+.0f", (double)(q[i] - big) / 1048576.0);
        }
        printf("\n");
        for (i = 0; i < 12; i++) CU(cudaFree(q[i]));
        CU(cudaFree(big));
    }
}

// A mixed sequence, as a training run's segments come: each address in MiB from the first's.
static void address_mix(void) {
    static const int mib[] = {20, 2, 2, 40, 20, 2, 100, 2, 20, 8};
    enum { NM = sizeof mib / sizeof mib[0] };
    char *p[NM];
    int i;
    printf("\ncudaMalloc of");
    for (i = 0; i < NM; i++) {
        CU(cudaMalloc((void **)&p[i], (size_t)mib[i] << 20));
        printf(" %d", mib[i]);
    }
    printf(" MiB in turn: MiB from the first:");
    for (i = 0; i < NM; i++) printf(" %+.0f", (double)(p[i] - p[0]) / 1048576.0);
    printf("\n");
    for (i = 0; i < NM; i++) CU(cudaFree(p[i]));
}

int main(int argc, char **argv) {
    char reason[256];
    int count;
    mn_cuda_desc d;
    size_t eb = 2;  // bf16
    char nm[128];
    int a = 1;
    once = argc > a && strcmp(argv[a], "once") == 0;
    a += once;
    if (argc > a + 1 && strcmp(argv[a], "--batch") == 0) {
        char *end;
        long b = strtol(argv[a + 1], &end, 10);
        if (*end || b < 1 || b > 256) DIE("--batch takes 1 to 256 sequences of %d, not %s", T, argv[a + 1]);
        BT = (int)b * T, a += 2;
    }
    only = argv + a, nonly = argc - a;
    if (nonly > 0 && argv[a][0] == '-') DIE("usage: bench_gpu [once] [--batch B] [WORD...]");
    if (mn_cuda_device_count(&count, reason, sizeof reason) != MN_OK)
        DIE("no CUDA device (%s)", reason);
    memset(&d, 0, sizeof d);
    MN(mn_cuda_init(&ctx, &d));
    d.no_fused_epilogues = 1;
    d.stream = ctx.stream;  // timed by events on ctx's stream: the unfused rows run there too
    MN(mn_cuda_init(&ctx_unfused, &d));
    d.no_fused_epilogues = 0, d.tf32 = 1;
    MN(mn_cuda_init(&ctx_tf32, &d));
    d.tf32 = 0, d.gemm_tune = 1;
    MN(mn_cuda_init(&ctx_tuned, &d));
    printf("bench_gpu on %s (sm %d, %d SMs, %.1f GiB), cuBLASLt workspace %llu MiB\n\n", ctx.name,
           ctx.sm, ctx.sm_count, ctx.total_bytes / 1073741824.0,
           (unsigned long long)(ctx.workspace_bytes >> 20));
    copy_bytes = (size_t)BT * C4 * eb * 4;  // 200 MB
    big_a = dalloc(copy_bytes);
    big_b = dalloc(copy_bytes);
    x = dalloc((size_t)BT * C * eb), y = dalloc((size_t)BT * C * eb), dres = dalloc((size_t)BT * C * eb);
    w = dalloc((size_t)C4 * C * eb), bias = dalloc((size_t)C4 * eb);
    mean = dalloc(BT * 4), rstd = dalloc(BT * 4), pre = dalloc((size_t)BT * C4 * eb * 4);
    logits = dalloc((size_t)BT * V * eb), targets = dalloc(BT * 4), losses = dalloc(BT * 4);
    ap = dalloc(adam_n * 4), ag = dalloc(adam_n * 2), am = dalloc(adam_n * 4), av = dalloc(adam_n * 4);
    a16 = dalloc(adam_n * 2), anorm = dalloc(4);
    // the optimizers step on random weights and gradients, their state from the warm-up steps on:
    // on zeros every v is 0, and the exact square root of 0 takes its slow path (8-bit AdamW
    // measured 0.87 ms on zeros, 0.75 on this)
    fill_vals(ap, adam_n, -0.1f, 0.1f, 0), fill_bf16(ag, adam_n, -1e-2f, 1e-2f);
    // random inputs: a GEMM on constant or zero data runs faster than on real values
    fill_bf16(w, (size_t)C4 * C, -0.05f, 0.05f), fill_bf16(x, (size_t)BT * C, -1.0f, 1.0f);
    // GELU's and the softmax's inputs vary (tanhf's time depends on its argument)
    fill_bf16(big_a, copy_bytes / 2, -4.0f, 4.0f), fill_bf16(pre, copy_bytes / 2, -1.0f, 1.0f);
    MN(mn_cuda_sync(&ctx));

    {
        int l2 = 0;
        CU(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, ctx.desc.device));
        flush_bytes = 2 * (size_t)(l2 > 0 ? l2 : 64 << 20);
        flush_buf = dalloc(flush_bytes), flush_norm = dalloc(4);
    }
    copy_n = copy_bytes;
    copy_gbs = 2.0 * copy_bytes / (time_ms(f_copy, NULL) * 1e-3) / 1e9;
    printf("| kernel (bf16 storage, GPT-2 small sizes, B %4d)         | time, cold  | bandwidth    | of copy | clean L2 | %d in a row | same-size copy |\n",
           BT / T, REPS);
    printf("|---|---|---|---|---|---|---|\n");
    printf("| cudaMemcpy device-to-device, %4zu MB                     |             | %7.1f GB/s | 100.0 %% |          |       |       |\n",
           copy_bytes >> 20, copy_gbs);
    {
        double nc = (double)BT * C * eb;
#define ROW(fmt, ...) (snprintf(nm, sizeof nm, fmt, __VA_ARGS__), nm)
        row_bw(ROW("layernorm forward %dx%d", BT, C), 2 * nc + BT * 8.0, f_ln_fwd, NULL);
        row_bw(ROW("residual + layernorm forward %dx%d", BT, C), 4 * nc + BT * 8.0, f_resln_fwd,
               NULL);
        row_bw(ROW("layernorm backward %dx%d (dx, dw, db)", BT, C), 4 * nc + BT * 8.0, f_ln_bwd,
               NULL);
        row_bw(ROW("GELU forward %dx%d", BT, C4), 2.0 * BT * C4 * eb, f_gelu_fwd, NULL);
        row_bw(ROW("GELU backward %dx%d", BT, C4), 4.0 * BT * C4 * eb, f_gelu_bwd, NULL);
        // causal: a row reads its visible columns (T (T + 1) / 2 per head in all) and the forward
        // writes every column (masked ones 0); the backward reads out, dout, dinp and writes dinp
        // over the visible columns only
        double vis = (double)(BT / T) * NH * T * (T + 1) / 2.0;
        row_bw(ROW("softmax forward causal %dx%dx%dx%d", BT / T, NH, T, T),
               (vis + (double)BT * NH * T) * eb, f_sm_fwd, NULL);
        row_bw(ROW("softmax backward causal %dx%dx%dx%d", BT / T, NH, T, T), 4.0 * vis * eb,
               f_sm_bwd, NULL);
        row_bw(ROW("cross-entropy fused %dx%d (in place)", BT, V), 2.0 * BT * V * eb, f_ce, NULL);
#undef ROW
        row_bw("global norm 124M bf16", adam_n * 2.0, f_norm, NULL);
        row_bw("AdamW 124M (fp32 master, m, v; bf16 g, copy)", adam_n * (4 * 2 + 2 + 4 * 4 + 2.0),
               f_adamw, NULL);
        static const size_t aligned = 0, unaligned = 1;
        row_bw("AdamW 8-bit 124M (fp32 master, 8-bit m, v; bf16 g, copy)",
               adam_n * (4 * 2 + 2 + 2 * 2 + 2.0), f_adamw8bit, (void *)&aligned);
        row_bw("AdamW 8-bit, unaligned (a thread block a block)",
               (adam_n - 1) * (4 * 2 + 2 + 2 * 2 + 2.0), f_adamw8bit, (void *)&unaligned);
        row_bw("SGD momentum 124M (fp32 master, b; bf16 g, copy)", adam_n * (4 * 4 + 2 + 2.0),
               f_sgd, NULL);
        row_bw("Lion 124M (fp32 master, m; bf16 g, copy)", adam_n * (4 * 4 + 2 + 2.0),
               f_lion, NULL);
        af_row = dalloc(AF_ROWS * 4), af_col = dalloc(C * 4);
        row_bw("Adafactor 161458x768 (factored; bf16 g x3, copy)", (double)AF_ROWS * C * 20.0,
               f_adafactor, NULL);
    }
    if (once) {
        mn_cuda_free(&ctx_tuned), mn_cuda_free(&ctx_tf32), mn_cuda_free(&ctx_unfused);
        mn_cuda_free(&ctx);
        return 0;
    }
    if (wanted("GEMM")) gemms(), gemm_sweep(), gemm_fp32();
    if (wanted("attention")) attention();
    if (wanted("allocator")) allocator();
    if (wanted("address")) address_order(), address_mix(), address_fill();
    printf("\nGEMM epilogue counters: fused %llu, fallback %llu (fused context)\n",
           (unsigned long long)ctx.gemm_fused, (unsigned long long)ctx.gemm_unfused);
    mn_cuda_free(&ctx_tuned);
    mn_cuda_free(&ctx_tf32);
    mn_cuda_free(&ctx_unfused);
    mn_cuda_free(&ctx);
    return 0;
}
