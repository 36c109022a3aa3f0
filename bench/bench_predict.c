// The estimator against the trainer: for a grid of trainer configurations (model sizes, tied and
// untied heads, batch, accumulation, checkpointing none/selective/full, precision
// fp32/fp16/bf16, every optimizer), memanat's prediction (mn_estimate with --framework memanat,
// trainer.c's tr_predict) beside what the trainer's caching allocator measured over a few steps:
// the peak of each memory category, peak allocated and peak reserved. One row per configuration,
// cells "predicted/measured" in MiB, then the worst relative error of the row; the worst case of
// the grid last.
//   make bench && ./build/bench_predict
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"
#define TRAINER_TESTING
#if defined(__GNUC__) && !defined(__clang__)
// Inlined into this one caller, gcc's truncation analysis flags the trainer's deliberate
// "%.120s" error messages; they cannot overflow (snprintf), so the warning is off for it alone.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-truncation"
#endif
#include "../trainer.c"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include "bench.h"

typedef struct bp_case {
    size_t L, C, NH, T, V;
    int tied;
    size_t B, K;
    int ckpt;  // TR_CKPT_*
    mn_precision prec;
    mn_optim optim;
} bp_case;

#define FP32 MN_PREC_FP32
#define FP16 MN_PREC_FP16
#define BF16 MN_PREC_BF16
static const bp_case bp_grid[] = {
    // tiny: L 2, C 64, NH 4, T 64 (the trainer's default)
    {2, 64, 4, 64, 256, 1, 8, 1, TR_CKPT_NONE, FP32, MN_OPTIM_ADAMW},
    {2, 64, 4, 64, 256, 1, 8, 1, TR_CKPT_SELECTIVE, FP32, MN_OPTIM_ADAMW},
    {2, 64, 4, 64, 256, 1, 8, 1, TR_CKPT_FULL, FP32, MN_OPTIM_ADAMW},
    {2, 64, 4, 64, 256, 1, 8, 1, TR_CKPT_NONE, FP16, MN_OPTIM_ADAMW},
    {2, 64, 4, 64, 256, 1, 8, 1, TR_CKPT_NONE, BF16, MN_OPTIM_ADAMW},
    {2, 64, 4, 64, 256, 1, 8, 1, TR_CKPT_FULL, BF16, MN_OPTIM_SGD},
    {2, 64, 4, 64, 256, 1, 4, 2, TR_CKPT_NONE, FP32, MN_OPTIM_SGD_MOMENTUM},
    {2, 64, 4, 64, 256, 1, 2, 4, TR_CKPT_SELECTIVE, FP16, MN_OPTIM_LION},
    {2, 64, 4, 64, 256, 0, 1, 1, TR_CKPT_NONE, FP32, MN_OPTIM_ADAFACTOR},
    {2, 64, 4, 64, 256, 0, 16, 1, TR_CKPT_FULL, FP16, MN_OPTIM_ADAMW_8BIT},
    // small: L 4, C 128, NH 4, T 128
    {4, 128, 4, 128, 256, 1, 4, 1, TR_CKPT_NONE, FP32, MN_OPTIM_ADAMW},
    {4, 128, 4, 128, 256, 1, 4, 1, TR_CKPT_SELECTIVE, BF16, MN_OPTIM_ADAMW_8BIT},
    {4, 128, 4, 128, 256, 1, 4, 3, TR_CKPT_FULL, FP32, MN_OPTIM_ADAMW},
    {4, 128, 4, 128, 256, 0, 2, 2, TR_CKPT_NONE, FP16, MN_OPTIM_SGD},
    {4, 128, 4, 128, 256, 0, 8, 1, TR_CKPT_FULL, BF16, MN_OPTIM_ADAFACTOR},
    {4, 128, 4, 128, 256, 1, 1, 1, TR_CKPT_SELECTIVE, FP32, MN_OPTIM_LION},
    {4, 128, 4, 128, 256, 1, 6, 2, TR_CKPT_NONE, BF16, MN_OPTIM_SGD_MOMENTUM},
    // odd shapes: L 3, C 96, NH 3, T 48, a vocabulary of 300, untied
    {3, 96, 3, 48, 300, 0, 5, 1, TR_CKPT_NONE, FP32, MN_OPTIM_ADAMW_8BIT},
    {3, 96, 3, 48, 300, 0, 5, 2, TR_CKPT_SELECTIVE, FP16, MN_OPTIM_ADAMW},
    {3, 96, 3, 48, 300, 0, 3, 1, TR_CKPT_FULL, BF16, MN_OPTIM_LION},
    {1, 32, 2, 16, 256, 1, 3, 3, TR_CKPT_NONE, FP16, MN_OPTIM_ADAFACTOR},
    {1, 32, 2, 16, 256, 0, 1, 1, TR_CKPT_FULL, FP32, MN_OPTIM_SGD},
    // wider: L 2, C 256, NH 8, T 128, a vocabulary of 1024
    {2, 256, 8, 128, 1024, 0, 4, 1, TR_CKPT_NONE, BF16, MN_OPTIM_ADAMW},
    {2, 256, 8, 128, 1024, 1, 4, 2, TR_CKPT_FULL, FP16, MN_OPTIM_ADAMW_8BIT},
    {2, 256, 8, 128, 1024, 0, 8, 1, TR_CKPT_SELECTIVE, FP32, MN_OPTIM_SGD_MOMENTUM},
    // medium: L 6, C 384, NH 6, T 256
    {6, 384, 6, 256, 256, 1, 2, 1, TR_CKPT_NONE, BF16, MN_OPTIM_ADAMW},
    {6, 384, 6, 256, 256, 0, 2, 2, TR_CKPT_FULL, FP32, MN_OPTIM_ADAFACTOR},
    {6, 384, 6, 256, 256, 1, 1, 1, TR_CKPT_SELECTIVE, FP16, MN_OPTIM_LION},
};
#define BP_STEPS 3

// Relative error of p against m, in percent (0 when both are 0).
static double bp_err(uint64_t p, uint64_t m) {
    if (m == 0) return p ? 100.0 : 0.0;
    return 100.0 * ((double)p - (double)m) / (double)m;
}

int main(void) {
    static const mn_category cats[] = {MN_CAT_WEIGHTS, MN_CAT_MASTER_WEIGHTS, MN_CAT_GRADIENTS,
                                       MN_CAT_OPTIMIZER, MN_CAT_ACTIVATIONS, MN_CAT_TEMPORARY,
                                       MN_CAT_OTHER};
    static const char *const heads[] = {"weights", "master", "grads", "optim", "acts", "temp",
                                        "other", "peak alloc", "peak reserved"};
    enum { NCAT = sizeof cats / sizeof cats[0], NCOL = NCAT + 2 };
    size_t n = sizeof bp_grid / sizeof bp_grid[0], i;
    double worst = -1.0, t0 = bench_wall_ns();
    char cpu[128], worst_name[128] = "", worst_col[32] = "";
    uint64_t worst_bytes = 0, exact = 0;
    int j;
    (void)tr_parse_args;  // the trainer's command line is not used here
    bench_cpu_model(cpu, sizeof cpu);
    printf("memanat %s: the estimator (--framework memanat) against trainer.c, %d steps per "
           "configuration, on %s\ncells: predicted/measured MiB (peaks); err: the row's largest "
           "|predicted - measured| / measured\n\n", MEMANAT_VERSION, BP_STEPS, cpu);
    printf("%-3s %-50s", "#", "L C NH T V head | B K ckpt prec optim");
    for (j = 0; j < NCOL; j++) printf(" %17s", heads[j]);
    printf(" %9s\n", "err");
    for (i = 0; i < n; i++) {
        const bp_case *k = &bp_grid[i];
        tr_config cfg;
        tr_result res;
        mn_estimate_result pred;
        uint64_t p[NCOL], m[NCOL];
        double row = 0.0;
        char name[96];
        int col = 0;
        mn_result r;
        tr_config_default(&cfg);
        cfg.L = k->L, cfg.C = k->C, cfg.NH = k->NH, cfg.T = k->T, cfg.V = k->V;
        cfg.tied = k->tied, cfg.B = k->B, cfg.K = k->K, cfg.checkpointing = k->ckpt;
        cfg.precision = k->prec, cfg.optim = k->optim, cfg.steps = BP_STEPS;
        snprintf(name, sizeof name, "%zu %zu %zu %zu %zu %s | %zu %zu %s %s %s", k->L, k->C, k->NH,
                 k->T, k->V, k->tied ? "tied" : "untied", k->B, k->K, tr_ckpt_names[k->ckpt],
                 mn_precision_name(k->prec), mn_optim_name(k->optim));
        if ((r = tr_predict(&cfg, &pred)) != MN_OK || (r = tr_run(&cfg, NULL, &res)) != MN_OK) {
            printf("%-3zu %-50s failed: %s\n", i + 1, name, mn_result_str(r));
            return 1;
        }
        for (j = 0; j < NCAT; j++)
            p[j] = pred.cat_peak[cats[j]], m[j] = res.stats.cat_allocated_bytes[cats[j]].peak;
        p[NCAT] = pred.peak_allocated, m[NCAT] = res.stats.allocated_bytes[MN_STAT_ALL].peak;
        p[NCAT + 1] = pred.peak_reserved, m[NCAT + 1] = res.stats.reserved_bytes[MN_STAT_ALL].peak;
        printf("%-3zu %-50s", i + 1, name);
        for (j = 0; j < NCOL; j++) {
            double e = fabs(bp_err(p[j], m[j]));
            printf(" %8.3f/%8.3f", (double)p[j] / 1048576.0, (double)m[j] / 1048576.0);
            if (e > row) row = e, col = j;
        }
        printf(" %8.4f%%%s\n", row, res.skipped ? " (fp16 skipped a step)" : "");
        exact += row == 0.0;
        if (row > worst) {
            worst = row;
            snprintf(worst_name, sizeof worst_name, "#%zu (%s)", i + 1, name);
            snprintf(worst_col, sizeof worst_col, "%s", heads[col]);
            worst_bytes = p[col] > m[col] ? p[col] - m[col] : m[col] - p[col];
        }
    }
    printf("\n%llu of %zu configurations predicted to the byte in every column; %.1f s\n",
           (unsigned long long)exact, n, (bench_wall_ns() - t0) / 1e9);
    printf("worst case: %s, %s off by %.4f%% (%llu bytes)\n", worst_name, worst_col, worst,
           (unsigned long long)worst_bytes);
    return 0;
}
