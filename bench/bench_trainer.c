// bench_trainer: speed of trainer.c's optimizer step (tr_accumulate + tr_update) for the default
// tiny model and GPT-2 small's shape, next to the reference matmul at the same shapes.
//   make bench && ./build/bench_trainer [--steps N] [--models tiny,gpt2] [--threads 1,2]
//                                       [--parts step,matmul,cost] [--cost-threads T]
//                                       [--cost-steps N]
// Defaults take about 5 minutes on 2 cores (GPT-2 small: ~9 s a step on one Zen 5 core).
// step:   the median seconds of N timed optimizer steps after two warm-up steps (the first
//         creates the optimizer state), tokens/s = B*T*K / step, and the model FLOP/s.
// matmul: mn_matmul_forward (and _backward) GFLOP/s at the model's shapes, N = B*T rows:
//         C -> 3C (qkv), C -> C (attproj), C -> 4C (fc), 4C -> C (fcproj), C -> V (head); "mix"
//         weights them as a step does (L times each block shape, the head once). The step's
//         FLOP/s is printed as a percentage of the forward mix (and of the fwd+bwd mix).
// cost:   the step time with --checkpointing selective / full and --precision fp16 / bf16,
//         as ratios to the plain fp32 step (at --cost-threads threads, default the most listed;
//         median of --cost-steps steps, default 1, after the same two warm-up steps; the fp32
//         step is the one the step part measured at that thread count, when it did).
//
// Model FLOPs of one step (the llm.c / nanoGPT estimate_mfu / PaLM appendix B convention):
//   6 * Nc * tokens  +  6 * L * C * T * (T + 1) * (B * K)
// Nc = parameters that take part in a matmul-like product: every parameter except the position
// embedding wpe and, with an untied head, the token embedding wte (a lookup, not a product). With
// the tied head the V*C weights of wte are counted once, as the head's weights: the head matmul
// is real compute (2*V*C flops per token forward, 4*V*C backward = 6*V*C), the lookup is not.
// Biases and layernorm weights stay in Nc (< 0.1% of it at GPT-2 small).
// Attention: PaLM's 12*L*H*Q*T per token (H*Q = C) counts q k^T and p v forward (2*T*C each per
// token per layer) times 3 for forward + backward. mn_attention_forward/_backward skip key tiles
// past the diagonal (causal), so only the T*(T+1)/2 visible scores of a sequence are counted:
// 6 * L * C * T * (T + 1) per sequence, i.e. about 6*L*T^2*C (half of PaLM's, which is non-causal).
// The backward's extra work (recomputed scores, dp computed in two passes) is not counted.
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"
#define TRAINER_TESTING
#include "../trainer.c"
#include "bench.h"

#define BT_MAX_STEPS 32

static void bt_set_threads(int t) {
#ifdef _OPENMP
    omp_set_num_threads(t);
#else
    (void)t;
#endif
}

static void *bt_alloc(size_t n) {
    void *p = malloc(n);
    if (!p) {
        fprintf(stderr, "bench_trainer: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

// n floats, uniform in [-1, 1).
static float *bt_buf(size_t n) {
    float *p = (float *)bt_alloc(n * sizeof(float));
    uint64_t s = 0x9E3779B97F4A7C15ull ^ n;
    size_t i;
    for (i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((double)(s >> 11) * (2.0 / 9007199254740992.0) - 1.0);
    }
    return p;
}

// The two models: the trainer's default (tiny), GPT-2 small's shape at B4 T256.
static void bt_config(const char *model, tr_config *cfg) {
    tr_config_default(cfg);
    if (strcmp(model, "gpt2") == 0) {
        (void)tr_apply_size("gpt2", cfg);
        cfg->B = 4, cfg->T = 256;
    }
}

// Model FLOPs of one optimizer step (see the top of the file).
static double bt_step_flops(const tr_model *m) {
    const tr_config *c = &m->cfg;
    double nc = (double)m->num_params - (double)(c->T * c->C);  // minus wpe
    double seqs = (double)c->B * (double)c->K, tokens = seqs * (double)c->T;
    if (!c->tied) nc -= (double)(c->V * c->C);                   // minus the wte lookup
    return 6.0 * nc * tokens +
           6.0 * (double)c->L * (double)c->C * (double)c->T * ((double)c->T + 1.0) * seqs;
}

typedef struct bt_step {
    double seconds;        // median per optimizer step
    double tokens_per_s, flops;
    uint64_t params;
    double loss;
} bt_step;

// Median time of `steps` optimizer steps after two warm-up steps; MN_OK or the trainer's error.
static mn_result bt_time_steps(const tr_config *cfg, int steps, bt_step *out) {
    tr_model m;
    double t[BT_MAX_STEPS], loss = 0.0;
    float norm;
    int s, skipped;
    mn_result r = tr_model_init(&m, cfg);
    memset(out, 0, sizeof *out);
    // two warm-up steps: the first creates the optimizer state, which moves the cache's blocks,
    // so the second still faults in fresh pages (about 0.5 s at GPT-2 small); then steady state
    for (s = -2; r == MN_OK && s < steps; s++) {
        double t0 = bench_wall_ns();
        r = tr_accumulate(&m, &loss);
        if (r == MN_OK) r = tr_update(&m, cfg->lr, &norm, &skipped);
        if (s >= 0) t[s] = (bench_wall_ns() - t0) * 1e-9;
    }
    if (r == MN_OK) {
        out->seconds = bench_median(t, steps);
        out->tokens_per_s = (double)(cfg->B * cfg->T * cfg->K) / out->seconds;
        out->flops = bt_step_flops(&m);
        out->params = m.num_params;
        out->loss = loss;
    }
    if (tr_model_free(&m) != MN_OK && r == MN_OK) r = MN_ERR_STATE;
    return r;
}

// ---- the reference matmul at a model's shapes ---------------------------------------------------

typedef struct bt_mm {
    const char *name;
    size_t C, OC;
    double times;          // how often a step's forward runs it (L, or 1 for the head)
    double fwd_s, bwd_s;   // median seconds
} bt_mm;

// Median seconds of runs calls of mn_matmul_forward (bwd 0) or mn_matmul_backward (bwd 1).
static double bt_time_matmul(size_t N, size_t C, size_t OC, int bwd, int runs) {
    float *inp = bt_buf(N * C), *w = bt_buf(OC * C), *b = bt_buf(OC), *out = bt_buf(N * OC);
    float *dinp = bt_buf(N * C), *dw = bt_buf(OC * C), *db = bt_buf(OC);
    double t[16], t0;
    int r;
    if (runs > 16) runs = 16;
    for (r = -1; r < runs; r++) {  // r = -1: the warm-up
        t0 = bench_wall_ns();
        if (bwd) mn_matmul_backward(dinp, dw, db, out, inp, w, NULL, N, C, OC);
        else mn_matmul_forward(out, NULL, inp, w, b, N, C, OC);
        if (r >= 0) t[r] = (bench_wall_ns() - t0) * 1e-9;
    }
    free(inp), free(w), free(b), free(out), free(dinp), free(dw), free(db);
    return bench_median(t, runs);
}

// The five matmuls of cfg's model, timed; *fwd_rate, *all_rate: GFLOP/s of the step's mix of
// forwards, and of forwards and backwards together.
static void bt_matmuls(const tr_config *c, int runs, int threads, double *fwd_rate,
                       double *all_rate) {
    bt_mm mm[5];
    size_t N = c->B * c->T, i;
    double fl_f = 0.0, t_f = 0.0, t_b = 0.0;
    mm[0].name = "qkv", mm[0].C = c->C, mm[0].OC = 3 * c->C;
    mm[1].name = "attproj", mm[1].C = c->C, mm[1].OC = c->C;
    mm[2].name = "fc", mm[2].C = c->C, mm[2].OC = 4 * c->C;
    mm[3].name = "fcproj", mm[3].C = 4 * c->C, mm[3].OC = c->C;
    mm[4].name = "head", mm[4].C = c->C, mm[4].OC = c->V;
    for (i = 0; i < 5; i++) {
        double fl = 2.0 * (double)N * (double)mm[i].C * (double)mm[i].OC;
        mm[i].times = i < 4 ? (double)c->L : 1.0;
        mm[i].fwd_s = bt_time_matmul(N, mm[i].C, mm[i].OC, 0, runs);
        mm[i].bwd_s = bt_time_matmul(N, mm[i].C, mm[i].OC, 1, runs);
        printf("  matmul %-8s %5zu x %5zu -> %5zu  %d thr  fwd %8.2f ms %6.1f GFLOP/s   "
               "bwd %8.2f ms %6.1f GFLOP/s\n", mm[i].name, N, mm[i].C, mm[i].OC, threads,
               mm[i].fwd_s * 1e3, fl / mm[i].fwd_s * 1e-9, mm[i].bwd_s * 1e3,
               2.0 * fl / mm[i].bwd_s * 1e-9);
        fl_f += mm[i].times * fl;
        t_f += mm[i].times * mm[i].fwd_s;
        t_b += mm[i].times * mm[i].bwd_s;
    }
    *fwd_rate = fl_f / t_f * 1e-9;
    *all_rate = 3.0 * fl_f / (t_f + t_b) * 1e-9;
    printf("  matmul mix (as a step runs them)            %d thr  fwd %6.1f GFLOP/s, "
           "fwd+bwd %6.1f GFLOP/s\n", threads, *fwd_rate, *all_rate);
}

// ---- command line -------------------------------------------------------------------------------

// Comma-separated list membership: "tiny" in "tiny,gpt2".
static int bt_has(const char *list, const char *item) {
    size_t n = strlen(item);
    const char *p = list;
    while ((p = strstr(p, item)) != NULL) {
        if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return 1;
        p += n;
    }
    return 0;
}

// The load average: on a shared machine other processes take cores from the threads timed here.
static void bt_loadavg(const char *when) {
    char line[128] = "?";
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (!fgets(line, sizeof line, f)) line[0] = '\0';
        fclose(f);
    }
    line[strcspn(line, "\n")] = '\0';
    printf("load average %s: %s\n", when, line);
}

static void bt_machine(void) {
    char model[256];
    int ncpu = bench_cpu_model(model, sizeof model);
    const char *wp = getenv("OMP_WAIT_POLICY"), *sc = getenv("GOMP_SPINCOUNT");
    printf("machine: %s, %d logical CPUs", model, ncpu);
#ifdef _OPENMP
    printf(", OpenMP %d (max %d threads)", _OPENMP, omp_get_max_threads());
#else
    printf(", built without OpenMP (single thread)");
#endif
    printf("; OMP_WAIT_POLICY=%s GOMP_SPINCOUNT=%s\n", wp ? wp : "(unset)", sc ? sc : "(unset)");
}

int main(int argc, char **argv) {
    const char *models = "tiny,gpt2", *parts = "step,matmul,cost", *thr = "1,2";
    static const char *const names[2] = {"tiny", "gpt2"};
    int steps = 3, cost_steps = 1, cost_threads = 0, threads[2] = {1, 2}, nthr = 0, i, mi, ti;
    (void)tr_parse_args, (void)tr_run;  // the trainer's command line and run: not used here
    for (i = 1; i < argc; i++) {
        const char *a = i + 1 < argc ? argv[i + 1] : NULL;
        if (!a) { fprintf(stderr, "bench_trainer: %s needs a value\n", argv[i]); return 2; }
        if (strcmp(argv[i], "--steps") == 0) steps = atoi(a);
        else if (strcmp(argv[i], "--models") == 0) models = a;
        else if (strcmp(argv[i], "--threads") == 0) thr = a;
        else if (strcmp(argv[i], "--parts") == 0) parts = a;
        else if (strcmp(argv[i], "--cost-threads") == 0) cost_threads = atoi(a);
        else if (strcmp(argv[i], "--cost-steps") == 0) cost_steps = atoi(a);
        else { fprintf(stderr, "bench_trainer: unknown flag %s\n", argv[i]); return 2; }
        i++;
    }
    if (steps < 1) steps = 1;
    if (steps > BT_MAX_STEPS) steps = BT_MAX_STEPS;
    if (cost_steps < 1) cost_steps = 1;
    if (cost_steps > BT_MAX_STEPS) cost_steps = BT_MAX_STEPS;
    if (bt_has(thr, "1")) threads[nthr++] = 1;
    if (bt_has(thr, "2")) threads[nthr++] = 2;
#ifndef _OPENMP
    nthr = 1, threads[0] = 1;
#endif
    if (nthr == 0) { fprintf(stderr, "bench_trainer: --threads takes 1, 2 or 1,2\n"); return 2; }
    if (cost_threads < 1) cost_threads = threads[nthr - 1];
    bt_machine();
    bt_loadavg("at the start");
    printf("median of %d timed steps after 2 warm-up steps; model FLOPs = 6*Nc*tokens + "
           "6*L*C*T*(T+1)*sequences\n", steps);
    for (mi = 0; mi < 2; mi++) {
        tr_config cfg;
        double base = 0.0;  // the fp32 step at cost_threads, once measured
        if (!bt_has(models, names[mi])) continue;
        bt_config(names[mi], &cfg);
        printf("\n== %s: L=%zu C=%zu NH=%zu T=%zu V=%zu B=%zu K=%zu head=%s optim=%s\n",
               names[mi], cfg.L, cfg.C, cfg.NH, cfg.T, cfg.V, cfg.B, cfg.K,
               cfg.tied ? "tied" : "untied", mn_optim_name(cfg.optim));
        for (ti = 0; ti < nthr; ti++) {
            bt_step st;
            double mm_f = 0.0, mm_all = 0.0;
            mn_result r;
            bt_set_threads(threads[ti]);
            if (bt_has(parts, "matmul")) bt_matmuls(&cfg, steps < 3 ? 3 : steps, threads[ti],
                                                    &mm_f, &mm_all);
            if (!bt_has(parts, "step")) continue;
            r = bt_time_steps(&cfg, steps, &st);
            if (r != MN_OK) {
                fprintf(stderr, "bench_trainer: %s: %s\n", names[mi], mn_result_str(r));
                return 1;
            }
            printf("  step  %d thr: %9.2f ms  %9.1f tok/s  %7.1f GFLOP/s (%.3g GFLOP/step, "
                   "%llu params)", threads[ti], st.seconds * 1e3, st.tokens_per_s,
                   st.flops / st.seconds * 1e-9, st.flops * 1e-9,
                   (unsigned long long)st.params);
            if (threads[ti] == cost_threads) base = st.seconds;
            if (mm_f > 0.0)
                printf("  = %.0f%% of matmul fwd mix, %.0f%% of fwd+bwd mix",
                       100.0 * st.flops / st.seconds * 1e-9 / mm_f,
                       100.0 * st.flops / st.seconds * 1e-9 / mm_all);
            printf("\n");
        }
        if (bt_has(parts, "cost")) {
            // the step at each setting, ratio to fp32 without checkpointing
            static const struct { const char *name; int ckpt; mn_precision prec; } v[5] = {
                {"fp32, no checkpointing", TR_CKPT_NONE, MN_PREC_FP32},
                {"--checkpointing selective", TR_CKPT_SELECTIVE, MN_PREC_FP32},
                {"--checkpointing full", TR_CKPT_FULL, MN_PREC_FP32},
                {"--precision fp16", TR_CKPT_NONE, MN_PREC_FP16},
                {"--precision bf16", TR_CKPT_NONE, MN_PREC_BF16}};
            int k;
            bt_set_threads(cost_threads);
            if (base > 0.0)
                printf("  cost  %d thr: %-26s %9.2f ms  %9.1f tok/s  x1.000 (the step above)\n",
                       cost_threads, v[0].name, base * 1e3,
                       (double)(cfg.B * cfg.T * cfg.K) / base);
            for (k = base > 0.0 ? 1 : 0; k < 5; k++) {
                tr_config c2 = cfg;
                bt_step st;
                mn_result r;
                c2.checkpointing = v[k].ckpt, c2.precision = v[k].prec;
                r = bt_time_steps(&c2, cost_steps, &st);
                if (r != MN_OK) {
                    fprintf(stderr, "bench_trainer: %s %s: %s\n", names[mi], v[k].name,
                            mn_result_str(r));
                    return 1;
                }
                if (k == 0) base = st.seconds;
                printf("  cost  %d thr: %-26s %9.2f ms  %9.1f tok/s  x%.3f\n", cost_threads,
                       v[k].name, st.seconds * 1e3, st.tokens_per_s, st.seconds / base);
            }
        }
    }
    bt_loadavg("at the end");
    return 0;
}
