// Tests of trainer.c's GPU path (--device cuda) that need no GPU. trainer.c is included with
// MEMANAT_CUDA over a stand-in for memanat_cuda.cu defined below: its context hands out the
// simulated device (mn_simdev: fake addresses that are never dereferenced), its copies zero what
// they bring back to the host, and its launchers only check that every tensor they are given is
// device memory. What runs for real is the GPU path's allocation schedule through the caching
// allocator, which the estimator's memanat framework on a GPU must predict to the byte, and its
// flag handling. The kernels themselves are tested on a GPU by test/test_cuda.c.
#define MEMANAT_CUDA
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "../memanat.h"

#define TRAINER_TESTING
#include "../trainer.c"

// ---- the stand-in for memanat_cuda.cu -----------------------------------------------------------

#define TG_BASE 0x100000000000ull  // the simulated device's first address: far from host memory
#define TG_SPAN 0x100000000000ull

struct mn__cuda_priv {
    mn_simdev dev;
    uint64_t scratch;  // bytes of the caller's scratch (mn_cuda_scratch_set)
};

static int tg_devices = 1;  // what mn_cuda_device_count answers

// A device pointer (or NULL): inside the simulated device's range.
static int tg_dev(const void *p) {
    uint64_t a = (uint64_t)(uintptr_t)p;
    return !p || (a >= TG_BASE && a < TG_BASE + TG_SPAN);
}
#define TG_DEV2(a, b) (tg_dev(a) && tg_dev(b))
#define TG_DEV4(a, b, c, d) (TG_DEV2(a, b) && TG_DEV2(c, d))
#define TG_RET(ok) return (ok) ? MN_OK : MN_ERR_INVALID_ARG

mn_result mn_cuda_device_count(int *count, char *reason, size_t cap) {
    if (count) *count = tg_devices;
    if (reason && cap) snprintf(reason, cap, "%s", tg_devices ? "" : "stand-in: no device");
    return tg_devices ? MN_OK : MN_ERR_DEVICE;
}

mn_result mn_cuda_init(mn_cuda *ctx, const mn_cuda_desc *desc) {
    mn_simdev_desc dd;
    uint32_t i;
    memset(ctx, 0, sizeof *ctx);
    if (desc) ctx->desc = *desc;
    if (!(ctx->p = (struct mn__cuda_priv *)calloc(1, sizeof *ctx->p))) return MN_ERR_OUT_OF_MEMORY;
    memset(&dd, 0, sizeof dd);
    dd.base = TG_BASE, dd.events_complete = 1;
    dd.capacity = 81559ull << 20;  // an H100 80GB's total (the table entry h100-80gb)
    if (mn_simdev_init(&ctx->p->dev, &dd) != MN_OK) {
        free(ctx->p);
        ctx->p = NULL;
        return MN_ERR_DEVICE;
    }
    ctx->sm = 90, ctx->sm_count = 132;
    snprintf(ctx->name, sizeof ctx->name, "stand-in sm 90");
    for (i = 0; i < mn_gpu_count() && !ctx->workspace_bytes; i++)  // the rule of memanat_cuda.cu
        if (mn_gpu_get(i)->sm == 90) ctx->workspace_bytes = mn_gpu_get(i)->cublas_workspace;
    ctx->desc.workspace = ctx->workspace_bytes;
    ctx->stream = &ctx->p->dev;  // any non-NULL value
    return MN_OK;
}

static uint64_t tg_live_at_free;  // device allocations still live when the context went

void mn_cuda_free(mn_cuda *ctx) {
    if (!ctx || !ctx->p) return;
    tg_live_at_free = ctx->p->dev.live;
    mn_simdev_free(&ctx->p->dev);
    free(ctx->p);
    memset(ctx, 0, sizeof *ctx);
}

mn_result mn_cuda_sync(mn_cuda *ctx) { TG_RET(ctx && ctx->p); }

// The CUDA context's bytes the stand-in reports (cudaMemGetInfo's total - free before anything
// is allocated): taken from the free memory of the simulated device's answer.
static uint64_t tg_context;

static mn_result tg_mem_info(void *user_data, uint64_t *free_out, uint64_t *total_out) {
    mn_device d = mn_simdev_device((mn_simdev *)user_data);
    mn_result r = d.mem_info_fn(user_data, free_out, total_out);
    if (r == MN_OK) *free_out = *free_out > tg_context ? *free_out - tg_context : 0;
    return r;
}

mn_device mn_cuda_device(mn_cuda *ctx) {
    mn_device d = mn_simdev_device(&ctx->p->dev);
    d.mem_info_fn = tg_mem_info;
    return d;
}

// The caller's scratch; attention's launchers below check that it holds what memanat_cuda.cu's
// would ask for (mn_attention_scratch), so that no kernel takes memory outside the cache.
mn_result mn_cuda_scratch_set(mn_cuda *ctx, void *ptr, uint64_t bytes) {
    if (!ctx || !ctx->p || !tg_dev(ptr) || (!ptr) != (!bytes)) return MN_ERR_INVALID_ARG;
    ctx->p->scratch = bytes;
    return MN_OK;
}

mn_result mn_cuda_workspace_set(mn_cuda *ctx, void *ptr, uint64_t bytes) {
    if (!ctx || !ctx->p || !tg_dev(ptr) || (!ptr) != (!bytes)) return MN_ERR_INVALID_ARG;
    ctx->workspace = ptr, ctx->workspace_bytes = bytes, ctx->desc.workspace = bytes;
    return MN_OK;
}

// Host to device: nothing moves; device to host: zeros.
mn_result mn_cuda_mem_copy(mn_cuda *ctx, void *dst, const void *src, uint64_t bytes) {
    if (!ctx || !ctx->p || !dst || !src) return MN_ERR_INVALID_ARG;
    if (tg_dev(dst) && !tg_dev(src)) return MN_OK;
    if (!tg_dev(dst) && tg_dev(src) && bytes <= SIZE_MAX) {
        memset(dst, 0, (size_t)bytes);
        return MN_OK;
    }
    return MN_ERR_INVALID_ARG;  // the trainer copies only between host and device
}

mn_result mn_cuda_mem_set(mn_cuda *ctx, void *ptr, int byte, uint64_t bytes) {
    (void)byte;
    TG_RET(ctx && ptr && bytes && tg_dev(ptr));
}

mn_result mn_cuda_matmul_forward(mn_cuda *ctx, void *out, void *pre_gelu, const void *inp,
                                 const void *weight, const void *bias, size_t N, size_t C,
                                 size_t OC, mn_dtype dtype) {
    (void)ctx, (void)N, (void)dtype;
    TG_RET(out && inp && weight && C && OC && TG_DEV4(out, pre_gelu, inp, weight) && tg_dev(bias));
}

mn_result mn_cuda_matmul_backward(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                  void *dout, const void *inp, const void *weight,
                                  const void *pre_gelu, size_t N, size_t C, size_t OC,
                                  mn_dtype dtype) {
    (void)ctx, (void)N, (void)C, (void)OC, (void)dtype;
    TG_RET(dout && TG_DEV4(dinp, dweight, dbias, dout) && TG_DEV2(inp, weight) &&
           tg_dev(pre_gelu));
}

mn_result mn_cuda_layernorm_forward(mn_cuda *ctx, void *out, float *mean, float *rstd,
                                    const void *inp, const void *weight, const void *bias,
                                    size_t N, size_t C, float eps, mn_dtype dtype) {
    (void)ctx, (void)N, (void)C, (void)eps, (void)dtype;
    TG_RET(out && inp && weight && TG_DEV4(out, mean, rstd, inp) && TG_DEV2(weight, bias));
}

mn_result mn_cuda_residual_layernorm_forward(mn_cuda *ctx, void *residual, void *out, float *mean,
                                             float *rstd, const void *inp1, const void *inp2,
                                             const void *weight, const void *bias, size_t N,
                                             size_t C, float eps, mn_dtype dtype) {
    (void)ctx, (void)N, (void)C, (void)eps, (void)dtype;
    TG_RET(residual && out && inp1 && inp2 && weight && TG_DEV4(residual, out, mean, rstd) &&
           TG_DEV4(inp1, inp2, weight, bias));
}

mn_result mn_cuda_layernorm_backward(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                     const void *dout, const void *inp, const void *weight,
                                     const float *mean, const float *rstd, size_t N, size_t C,
                                     mn_dtype dtype) {
    (void)ctx, (void)N, (void)C, (void)dtype;
    TG_RET(dout && inp && weight && mean && rstd && TG_DEV4(dinp, dweight, dbias, dout) &&
           TG_DEV4(inp, weight, mean, rstd));
}

// Whether the caller's scratch holds what memanat_cuda.cu's attention asks for.
static int tg_scratch_holds(mn_cuda *ctx, size_t B, size_t T, size_t C, size_t NH,
                            mn_dtype dtype, int backward, const void *att) {
    uint64_t need;
    return mn_attention_scratch(B, T, C, NH, dtype == MN_FP16 || dtype == MN_BF16 ? 2 : 4,
                                backward, att != NULL, &need) == MN_OK &&
           need <= ctx->p->scratch;
}

mn_result mn_cuda_attention_forward(mn_cuda *ctx, void *out, void *att, const void *qkv, size_t B,
                                    size_t T, size_t C, size_t NH, int causal, mn_dtype dtype) {
    (void)causal;
    TG_RET(out && qkv && TG_DEV2(out, att) && tg_dev(qkv) &&
           tg_scratch_holds(ctx, B, T, C, NH, dtype, 0, att));
}

mn_result mn_cuda_attention_backward(mn_cuda *ctx, void *dqkv, const void *dout, const void *qkv,
                                     const void *att, size_t B, size_t T, size_t C, size_t NH,
                                     int causal, mn_dtype dtype) {
    (void)causal;
    TG_RET(dqkv && dout && qkv && TG_DEV4(dqkv, dout, qkv, att) &&
           tg_scratch_holds(ctx, B, T, C, NH, dtype, 1, att));
}

mn_result mn_cuda_residual_forward(mn_cuda *ctx, void *out, const void *inp1, const void *inp2,
                                   size_t n, mn_dtype dtype) {
    (void)ctx, (void)n, (void)dtype;
    TG_RET(out && inp1 && inp2 && TG_DEV2(out, inp1) && tg_dev(inp2));
}

mn_result mn_cuda_crossentropy_forward_backward(mn_cuda *ctx, float *losses, void *dlogits,
                                                const void *logits, const int *targets,
                                                float dloss, size_t N, size_t V, mn_dtype dtype) {
    (void)ctx, (void)dloss, (void)N, (void)V, (void)dtype;
    TG_RET(losses && logits && targets && TG_DEV4(losses, dlogits, logits, targets));
}

mn_result mn_cuda_embedding_forward(mn_cuda *ctx, void *out, const int *tokens, const void *wte,
                                    const void *wpe, size_t B, size_t T, size_t C, size_t V,
                                    mn_dtype dtype) {
    (void)ctx, (void)B, (void)T, (void)C, (void)V, (void)dtype;
    TG_RET(out && tokens && wte && TG_DEV4(out, tokens, wte, wpe));
}

mn_result mn_cuda_embedding_backward(mn_cuda *ctx, void *dwte, void *dwpe, const void *dout,
                                     const int *tokens, size_t B, size_t T, size_t C, size_t V,
                                     mn_dtype dtype) {
    (void)ctx, (void)B, (void)T, (void)C, (void)V, (void)dtype;
    TG_RET(dout && tokens && TG_DEV4(dwte, dwpe, dout, tokens));
}

mn_result mn_cuda_global_norm(mn_cuda *ctx, float *norm_out, const void *grad, uint64_t n,
                              mn_dtype dtype) {
    (void)ctx, (void)n, (void)dtype;
    TG_RET(norm_out && grad && TG_DEV2(norm_out, grad));
}

// The flat-buffer conventions every optimizer step shares.
static int tg_flat(const mn_cuda_optim_flat *f) {
    return f->param && f->grad && f->n && TG_DEV4(f->param, f->param16, f->grad, f->grad_norm) &&
           f->step >= 1;
}

mn_result mn_cuda_adamw_step(mn_cuda *ctx, const struct mn_adamw_params *p,
                             const mn_cuda_adamw_args *a) {
    (void)ctx, (void)p;
    TG_RET(tg_flat(&a->flat) && a->exp_avg && TG_DEV2(a->exp_avg, a->exp_avg_sq) &&
           a->exp_avg_sq == a->exp_avg + a->flat.n);
}

mn_result mn_cuda_adamw8bit_step(mn_cuda *ctx, const struct mn_adamw8bit_params *p,
                                 const mn_cuda_adamw8bit_args *a) {
    (void)ctx, (void)p;
    TG_RET(tg_flat(&a->flat) && (a->code1 ? a->code2 == a->code1 + a->flat.n &&
                                            TG_DEV4(a->code1, a->code2, a->absmax1, a->absmax2)
                                          : a->exp_avg && TG_DEV2(a->exp_avg, a->exp_avg_sq)));
}

mn_result mn_cuda_sgd_step(mn_cuda *ctx, const struct mn_sgd_params *p, const mn_cuda_sgd_args *a) {
    TG_RET(ctx && tg_flat(&a->flat) && tg_dev(a->momentum_buffer) &&
           (p->momentum == 0.0f) == (a->momentum_buffer == NULL));
}

mn_result mn_cuda_lion_step(mn_cuda *ctx, const struct mn_lion_params *p,
                            const mn_cuda_lion_args *a) {
    (void)ctx, (void)p;
    TG_RET(tg_flat(&a->flat) && a->exp_avg && tg_dev(a->exp_avg));
}

mn_result mn_cuda_adafactor_step(mn_cuda *ctx, const struct mn_adafactor_params *p,
                                 const mn_cuda_adafactor_args *a) {
    (void)ctx, (void)p;
    TG_RET(tg_flat(&a->flat) && a->flat.n == a->batch * a->rows * a->cols && a->exp_avg_sq_row &&
           a->exp_avg_sq_col == a->exp_avg_sq_row + a->batch * a->rows &&
           TG_DEV2(a->exp_avg_sq_row, a->exp_avg_sq_col));
}

// ---- tests --------------------------------------------------------------------------------------

// The bytes of the file at path, NUL-terminated (malloc'ed, *len bytes), or NULL.
static char *tg_read(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    char *text = NULL;
    *len = 0;
    if (f && fseek(f, 0, SEEK_END) == 0 && (*len = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (text = (char *)calloc((size_t)*len + 1, 1)) != NULL &&
        fread(text, 1, (size_t)*len, f) != (size_t)*len)
        free(text), text = NULL;
    if (f) fclose(f);
    return text;
}

static tr_config tg_config(void) {
    tr_config c;
    tr_config_default(&c);
    c.L = 2, c.C = 32, c.NH = 2, c.T = 16, c.B = 2, c.K = 1, c.steps = 3;
    c.seed = mnt_rand_u64();
    c.device = TR_DEVICE_CUDA;
    return c;
}

// The GPU trainer's allocation schedule, measured by its cache over the simulated device, against
// the estimator's memanat framework on the GPU table entry the trainer chose: every category's
// peak, peak allocated, peak reserved and the categories at the peak equal to the byte, over 3
// steps (the estimator's steady state), on a grid drawn with fresh seeds. The first draws force
// fp16 with full checkpointing and SGD, bf16 with selective checkpointing, accumulation, an untied
// head and Lion, fp32 with momentum, 8-bit AdamW, Adafactor. The schedule differs from the CPU
// trainer's (a cuBLASLt workspace, 16-bit gradients, no views), so the CPU prediction must not
// match it.
static void test_gpu_prediction_exact(void) {
    static const mn_precision precs[] = {MN_PREC_FP32, MN_PREC_FP16, MN_PREC_BF16};
    static const mn_optim optims[] = {MN_OPTIM_ADAMW, MN_OPTIM_SGD, MN_OPTIM_SGD_MOMENTUM,
                                      MN_OPTIM_LION, MN_OPTIM_ADAMW_8BIT, MN_OPTIM_ADAFACTOR};
    long live = mnt_live_allocs();
    int draw, k;
    for (draw = 0; draw < 10; draw++) {
        tr_config cfg = tg_config(), cpu;
        tr_model m;
        tr_step_info st;
        struct mn_cache_stats stats;
        mn_estimate_result pred, cpu_pred;
        uint64_t held = 0, want = 0;
        long s;
        cfg.L = 1 + mnt_rand_u64() % 3, cfg.NH = 1 + mnt_rand_u64() % 4;
        cfg.C = cfg.NH * (8 + 8 * (mnt_rand_u64() % 3)), cfg.T = 4 + mnt_rand_u64() % 29;
        cfg.V = mnt_rand_u64() % 2 ? 256 : 256 + mnt_rand_u64() % 200;
        cfg.B = 1 + mnt_rand_u64() % 4, cfg.K = 1 + mnt_rand_u64() % 3;
        cfg.tied = (int)(mnt_rand_u64() % 2);
        cfg.precision = precs[mnt_rand_u64() % 3];
        cfg.checkpointing = (int)(mnt_rand_u64() % 3);
        cfg.optim = optims[mnt_rand_u64() % 6];
        if (draw == 0) {
            cfg.precision = MN_PREC_FP16, cfg.checkpointing = TR_CKPT_FULL;
            cfg.optim = MN_OPTIM_SGD;
        }
        if (draw == 1) {
            cfg.precision = MN_PREC_BF16, cfg.checkpointing = TR_CKPT_SELECTIVE, cfg.K = 3;
            cfg.tied = 0, cfg.optim = MN_OPTIM_LION;
        }
        if (draw == 2) cfg.precision = MN_PREC_FP32, cfg.optim = MN_OPTIM_SGD_MOMENTUM;
        if (draw == 3) {  // 8-bit blocks: tensors of 4096 elements and more
            cfg.optim = MN_OPTIM_ADAMW_8BIT, cfg.C = 64, cfg.NH = 4;
        }
        if (draw == 4) cfg.optim = MN_OPTIM_ADAFACTOR, cfg.precision = MN_PREC_BF16;
        cfg.gemm_tune = draw & 1;  // --gemm-tune on reaches the context and takes no memory
        CHECK_OK(tr_model_init(&m, &cfg));
        CHECK_EQ_INT(m.cuda.desc.gemm_tune, cfg.gemm_tune);
        for (s = 0; s < cfg.steps && !mnt_failed(); s++) CHECK_OK(tr_step(&m, &st));
        CHECK_OK(mn_cache_stats(&m.cache, &stats));
        CHECK_OK(tr_optim_bytes(&m, &held, &want));
        CHECK_EQ_U64(held, want);
        CHECK(m.cfg.gpu != NULL);
        CHECK_OK(tr_predict(&m.cfg, &pred));
        for (k = 0; k < MN_CAT_COUNT; k++)
            CHECK_MSG(pred.cat_peak[k] == stats.cat_allocated_bytes[k].peak,
                      "draw %d L %zu C %zu NH %zu T %zu V %zu B %zu K %zu %s %s %s %s: %s "
                      "predicted %llu, measured %llu", draw, cfg.L, cfg.C, cfg.NH, cfg.T, cfg.V,
                      cfg.B, cfg.K, cfg.tied ? "tied" : "untied", mn_precision_name(cfg.precision),
                      tr_ckpt_names[cfg.checkpointing], mn_optim_name(cfg.optim),
                      mn_category_name((mn_category)k), (unsigned long long)pred.cat_peak[k],
                      (unsigned long long)stats.cat_allocated_bytes[k].peak);
        CHECK_EQ_U64(pred.peak_allocated, stats.allocated_bytes[MN_STAT_ALL].peak);
        CHECK_EQ_U64(pred.peak_reserved, stats.reserved_bytes[MN_STAT_ALL].peak);
        for (k = 0; k < MN_CAT_COUNT; k++) CHECK_EQ_U64(pred.at_peak[k], stats.cat_at_peak[k]);
        // the workspace category: cuBLASLt's and the kernels' scratch (each block rounded up to
        // the cache's 512 bytes), which the stand-in's attention checked against what
        // memanat_cuda.cu asks for
        CHECK(m.workspace_bytes > 0 && m.scratch_bytes > 0);
        CHECK(pred.workspace >= m.workspace_bytes + m.scratch_bytes &&
              pred.workspace < m.workspace_bytes + m.scratch_bytes + 1024);
        CHECK_EQ_U64(pred.optimizer, held);
        // gradients: 2 bytes a parameter with 16-bit storage, 4 in fp32
        CHECK_EQ_U64(stats.cat_allocated_bytes[MN_CAT_GRADIENTS].peak >= m.num_params *
                     (cfg.precision == MN_PREC_FP32 ? 4u : 2u), 1);
        cpu = m.cfg, cpu.gpu = NULL;  // the CPU trainer's schedule for the same configuration
        CHECK_OK(tr_predict(&cpu, &cpu_pred));
        CHECK(cpu_pred.peak_allocated != stats.allocated_bytes[MN_STAT_ALL].peak);
        CHECK_OK(tr_model_free(&m));
        CHECK_EQ_U64(tg_live_at_free, 0);  // every segment went back to the device
    }
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// The GPU path's flags: --device takes cpu or cuda, --gemm-tune on or off and on only with cuda;
// what it does not have yet is refused with one line; a machine whose cudaGetDeviceCount fails is
// refused by tr_check_device.
static void test_gpu_flags(void) {
    static const char *bad[][4] = {
        {"--device", "tpu", NULL, NULL},
        {"--device", "cuda", "--budget", "-1G"},
        {"--gemm-tune", "on", NULL, NULL},
        {"--device", "cpu", "--gemm-tune", "on"},
        {"--device", "cuda", "--gemm-tune", "1"},
    };
    tr_config cfg;
    char err[256], *argv[6];
    size_t i;
    int argc;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        argv[0] = (char *)"trainer";
        for (argc = 1; argc < 5 && bad[i][argc - 1]; argc++) argv[argc] = (char *)bad[i][argc - 1];
        err[0] = '\0';
        CHECK_ERR(tr_parse_args(argc, argv, &cfg, err, sizeof err), MN_ERR_INVALID_ARG);
        CHECK(err[0] != '\0' && strchr(err, '\n') == NULL);
    }
    argv[1] = (char *)"--gemm-tune", argv[2] = (char *)"off";
    CHECK_OK(tr_parse_args(3, argv, &cfg, err, sizeof err));
    CHECK_EQ_INT(cfg.gemm_tune, 0);
    argv[3] = (char *)"--device", argv[4] = (char *)"cuda", argv[2] = (char *)"on";
    CHECK_OK(tr_parse_args(5, argv, &cfg, err, sizeof err));
    CHECK_EQ_INT(cfg.gemm_tune, 1);
    argv[1] = (char *)"--device", argv[2] = (char *)"cuda";
    CHECK_OK(tr_parse_args(3, argv, &cfg, err, sizeof err));
    CHECK_EQ_INT(cfg.device, TR_DEVICE_CUDA);
    CHECK_EQ_INT(cfg.gemm_tune, 0);
    tg_devices = 0;
    err[0] = '\0';
    CHECK_ERR(tr_check_device(&cfg, err, sizeof err), MN_ERR_INVALID_ARG);
    CHECK(err[0] != '\0');
    cfg.device = TR_DEVICE_CPU;
    CHECK_OK(tr_check_device(&cfg, err, sizeof err));  // the CPU needs no GPU
    tg_devices = 1;
    cfg.device = TR_DEVICE_CUDA;
    CHECK_OK(tr_check_device(&cfg, err, sizeof err));
}

// --budget on the GPU: the plan is made for the GPU's schedule with the CUDA context counted in
// the budget. A budget the GPU setup fits leaves it as it is; a tighter one gets a plan the run
// keeps to (context + reserved peak, measured on the device's cache, within the budget, and
// predicted to the byte); a budget below the context, or one nothing fits, is refused.
static void test_gpu_budget(void) {
    tr_config cfg = tg_config(), c, p;
    tr_result res;
    mn_estimate_result pred;
    char err[256];
    uint64_t need, var;
    long live = mnt_live_allocs();
    cfg.steps = 2, cfg.B = 8, cfg.T = 32, cfg.C = 64, cfg.NH = 4;
    tg_context = (1 + mnt_rand_u64() % 64) << 16;  // 64 KiB .. 4 MiB
    c = cfg;
    CHECK_OK(tr_gpu_probe(&c, err, sizeof err));
    CHECK_EQ_U64(c.gpu_context, tg_context);
    CHECK(c.gpu != NULL && strcmp(c.gpu, "h100-80gb") == 0);
    CHECK_OK(tr_predict(&c, &pred));
    need = pred.context + pred.peak_reserved;
    CHECK_EQ_U64(pred.context, tg_context);
    c = cfg, c.budget = need;
    CHECK_OK(tr_run(&c, NULL, &res));  // fits as given: the measured peak is the predicted one
    CHECK_EQ_U64(res.stats.reserved_bytes[MN_STAT_ALL].peak, pred.peak_reserved);
    var = pred.peak_reserved - pred.workspace;  // (the cuBLASLt workspace stays)
    CHECK(pred.workspace > 0 && var > 0);
    c = cfg, c.budget = tg_context + pred.workspace + var / 2 + mnt_rand_u64() % (var / 4);
    p = c;  // the plan tr_run makes
    CHECK_OK(tr_gpu_probe(&p, err, sizeof err));
    CHECK_OK(tr_plan(&p, NULL, err, sizeof err));
    CHECK(p.B < cfg.B || p.precision != cfg.precision || p.optim != cfg.optim ||
          p.checkpointing != cfg.checkpointing);
    CHECK_EQ_U64((uint64_t)p.B * p.K, (uint64_t)cfg.B * cfg.K);
    CHECK_EQ_U64(p.capacity, c.budget);
    CHECK_OK(tr_predict(&p, &pred));
    CHECK(pred.context + pred.peak_reserved <= c.budget);
    CHECK_OK(tr_run(&c, NULL, &res));
    CHECK_MSG(tg_context + res.stats.reserved_bytes[MN_STAT_ALL].peak <= c.budget,
              "context %llu B + reserved %llu B over the budget %llu B",
              (unsigned long long)tg_context,
              (unsigned long long)res.stats.reserved_bytes[MN_STAT_ALL].peak,
              (unsigned long long)c.budget);
    CHECK_EQ_U64(res.stats.reserved_bytes[MN_STAT_ALL].peak, pred.peak_reserved);
    c = cfg, c.budget = tg_context - mnt_rand_u64() % (tg_context / 2);  // below the context
    CHECK_EQ_INT(tr_run(&c, NULL, &res), MN_ERR_INVALID_ARG);
    CHECK_MSG(strstr(res.error, "nothing this trainer can do fits --budget") != NULL, "\"%s\"",
              res.error);
    tg_context = 0;
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// Every tensor allocation of a GPU run failing in turn (--fail-alloc-at): the run reports an
// out-of-memory, and the model gives every segment back to the device and every host byte back.
static void test_gpu_alloc_failures(void) {
    long live = mnt_live_allocs();
    uint64_t n;
    int failed = 0;
    for (n = 1; n < 400; n += 1 + n / 8) {
        tr_config cfg = tg_config();
        tr_result res;
        mn_result r;
        cfg.precision = n % 2 ? MN_PREC_BF16 : MN_PREC_FP32, cfg.steps = 2, cfg.fail_alloc_at = n;
        r = tr_run(&cfg, NULL, &res);
        CHECK(r == MN_OK || r == MN_ERR_DEVICE_OOM);
        failed += r == MN_ERR_DEVICE_OOM;
        CHECK_EQ_U64(tg_live_at_free, 0);
    }
    CHECK(failed > 10);
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// --save and --resume on the GPU path: a run stopped after step 2 of 4 saves a checkpoint of the
// size the format gives (tr_ckpt_size, optimizer state included, copied down from the device),
// the GPU run resumes it to the end, and so does the CPU trainer (the layouts are the host's), for
// AdamW, 8-bit AdamW and Adafactor, fp32 and bf16.
static void test_gpu_checkpoint(void) {
    static const mn_optim optims[] = {MN_OPTIM_ADAMW, MN_OPTIM_ADAMW_8BIT, MN_OPTIM_ADAFACTOR};
    char path[64];
    long live = mnt_live_allocs();
    int k;
    snprintf(path, sizeof path, "/tmp/mn_gpu_ckpt_%llu.bin",
             (unsigned long long)(mnt_rand_u64() % 1000000));
    for (k = 0; k < 6; k++) {
        tr_config cfg = tg_config();
        tr_result res;
        tr_model m;
        char *text;
        long len = -1;
        cfg.optim = optims[k % 3], cfg.precision = k < 3 ? MN_PREC_FP32 : MN_PREC_BF16;
        cfg.C = 64, cfg.NH = 4;  // 8-bit blocks: tensors of 4096 elements and more
        cfg.steps = 4, cfg.stop_after = 2, cfg.save = path;
        CHECK_OK(tr_run(&cfg, NULL, &res));
        CHECK_EQ_INT(res.steps_run, 2);
        CHECK_OK(tr_model_init(&m, &cfg));
        text = tg_read(path, &len);
        free(text);
        CHECK_EQ_U64((uint64_t)len, tr_ckpt_size(&m, 1));
        CHECK_OK(tr_model_free(&m));
        cfg.stop_after = 0, cfg.save = NULL, cfg.resume = path;
        CHECK_OK(tr_run(&cfg, NULL, &res));
        CHECK_EQ_INT(res.steps_run, 2);
        cfg.device = TR_DEVICE_CPU;
        CHECK_OK(tr_run(&cfg, NULL, &res));
        CHECK_EQ_INT(res.steps_run, 2);
    }
    remove(path);
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// --memory-svg, --snapshot and --json of a GPU run: all three written, the snapshot holding the
// trainer's blocks (its cuBLASLt workspace among them, by its label), the JSON naming the device
// and the GPU table entry.
static void test_gpu_history(void) {
    char svg[64], snap[64], json[64], *text;
    tr_config cfg = tg_config();
    tr_result res;
    mn_json_doc doc;
    const mn_json_value *v;
    long live = mnt_live_allocs(), len;
    unsigned long long tag = (unsigned long long)(mnt_rand_u64() % 1000000);
    snprintf(svg, sizeof svg, "/tmp/mn_gpu_hist_%llu.svg", tag);
    snprintf(snap, sizeof snap, "/tmp/mn_gpu_hist_%llu.json", tag);
    snprintf(json, sizeof json, "/tmp/mn_gpu_hist_%llu.run.json", tag);
    cfg.memory_svg = svg, cfg.snapshot = snap, cfg.json = json, cfg.precision = MN_PREC_FP16;
    CHECK_OK(tr_run(&cfg, mnt_verbose() ? stdout : NULL, &res));  // -v: the GPU run's log
    text = tg_read(svg, &len);
    CHECK(text && strstr(text, "<svg") != NULL);
    free(text);
    text = tg_read(snap, &len);
    CHECK(text && strstr(text, "cublaslt_workspace") != NULL);
    free(text);
    text = tg_read(json, &len);
    if (text && mn_json_parse(text, (size_t)len, NULL, &doc) == MN_OK) {
        v = mn_json_get(mn_json_get(doc.root, "config"), "device");
        CHECK(v && v->type == MN_JSON_STRING && strcmp(v->str, "cuda") == 0);
        v = mn_json_get(mn_json_get(doc.root, "config"), "gpu");
        CHECK(v && v->type == MN_JSON_STRING && strcmp(v->str, "h100-80gb") == 0);
        mn_json_free(&doc);
    } else {
        CHECK(!"the --json file parses");
    }
    free(text);
    remove(svg), remove(snap), remove(json);
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// The GPU table entry of a device: its SM's entry with the nearest capacity. Each entry's own
// capacity, moved by less than half the gap to the next other capacity of its SM, finds an entry
// of that SM and capacity; the totals cudaMemGetInfo gave on an H200 (143156 MiB) and an H100
// 80GB (81559 MiB) find h200 and h100-80gb; an SM the table lacks falls back by generation.
static void test_gpu_entry(void) {
    uint32_t i, j, n = mn_gpu_count();
    int draw;
    CHECK(strcmp(tr_gpu_entry(90, 143156ull << 20), "h200") == 0);
    CHECK(strcmp(tr_gpu_entry(90, 81559ull << 20), "h100-80gb") == 0);
    CHECK(strcmp(tr_gpu_entry(100, 192ull << 30), "h100-80gb") == 0);
    CHECK(strcmp(tr_gpu_entry(61, 8ull << 30), "a100-80gb") == 0);
    for (draw = 0; draw < 200; draw++) {
        const mn_gpu *e = mn_gpu_get((uint32_t)(mnt_rand_u64() % n)), *r = NULL;
        uint64_t gap = 1ull << 30, total, move;
        const char *name;
        if (e->sm == 0) continue;  // the host entry
        for (j = 0; j < n; j++) {
            const mn_gpu *o = mn_gpu_get(j);
            uint64_t d = o->capacity > e->capacity ? o->capacity - e->capacity
                                                   : e->capacity - o->capacity;
            if (o->sm == e->sm && d > 0 && d < gap) gap = d;
        }
        move = mnt_rand_u64() % (gap / 2);
        total = mnt_rand_u64() % 2 ? e->capacity + move : e->capacity - move;
        name = tr_gpu_entry((int)e->sm, total);
        for (i = 0; i < n; i++)
            if (strcmp(mn_gpu_get(i)->name, name) == 0) r = mn_gpu_get(i);
        CHECK(r != NULL);
        if (!r) continue;
        CHECK_EQ_INT(r->sm, e->sm);
        CHECK(r->capacity == e->capacity);
    }
}

const mnt_case test_gpu_trainer_cases[] = {
    {"gpu_entry", test_gpu_entry},
    {"history", test_gpu_history},
    {"checkpoint", test_gpu_checkpoint},
    {"prediction_exact", test_gpu_prediction_exact},
    {"flags", test_gpu_flags},
    {"budget", test_gpu_budget},
    {"alloc_failures", test_gpu_alloc_failures},
};
const size_t test_gpu_trainer_count =
    sizeof test_gpu_trainer_cases / sizeof test_gpu_trainer_cases[0];
