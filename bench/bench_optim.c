// bench_optim: host speed of the optimizer steps and the fp16/bf16 conversions (section >>optim).
//
//   make bench && ./build/bench_optim [elements] [reps]   default 6291456 elements, 7 reps
//
// Each optimizer steps one fp32 tensor of n elements shaped [n/1024, 1024] (Adafactor factors it)
// with fresh gradients. Per optimizer: the median of reps timed steps after one warm-up step, in
// ns per element and in GB/s of the bytes a step must move at least (read param, grad and state,
// write param and state), beside memcpy of the same bytes timed alternately in the same run (ratio:
// step GB/s / memcpy GB/s, higher is better), on one thread; then the step on two threads against
// one (ratio > 1: two threads win). Conversions: bulk arrays, GB/s of bytes read + written.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"
#include "bench.h"

#define now_ns bench_wall_ns

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float rnd_normalish(void) {  // sum of 4 uniforms, centred: cheap and good enough here
    float s = 0.0f;
    int i;
    for (i = 0; i < 4; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        s += (float)(rng >> 40) / 16777216.0f;
    }
    return s - 2.0f;
}


enum { REPS_MAX = 64 };
static int reps = 7;

static void set_threads(int t) {
#ifdef _OPENMP
    omp_set_num_threads(t);
#endif
    (void)t;
}

typedef enum { OPT_SGD, OPT_ADAMW, OPT_ADAMW8, OPT_ADAFACTOR, OPT_LION, OPT_COUNT } opt_kind;
static const char *const opt_names[OPT_COUNT] = {"sgd momentum", "adamw", "adamw 8-bit",
                                                 "adafactor", "lion"};

typedef struct opt_run {
    opt_kind k;
    mn_sgd sg;
    mn_adamw aw;
    mn_adamw8bit a8;
    mn_adafactor af;
    mn_lion li;
} opt_run;

static mn_result opt_init(opt_run *o, opt_kind k, uint64_t rows, uint64_t cols, uint64_t *state) {
    uint64_t dims[2];
    mn_sgd_params psg;
    mn_result r;
    dims[0] = rows, dims[1] = cols;
    memset(&psg, 0, sizeof psg);
    psg.momentum = 0.9f;
    o->k = k;
    switch (k) {
    case OPT_SGD: r = mn_sgd_init(&o->sg, dims, 2, &psg, NULL), *state = o->sg.state_bytes; break;
    case OPT_ADAMW:
        r = mn_adamw_init(&o->aw, dims, 2, NULL, NULL), *state = o->aw.state_bytes;
        break;
    case OPT_ADAMW8:
        r = mn_adamw8bit_init(&o->a8, dims, 2, NULL, NULL), *state = o->a8.state_bytes;
        break;
    case OPT_ADAFACTOR:
        r = mn_adafactor_init(&o->af, dims, 2, NULL, NULL), *state = o->af.state_bytes;
        break;
    default: r = mn_lion_init(&o->li, dims, 2, NULL, NULL), *state = o->li.state_bytes; break;
    }
    return r;
}

static mn_result opt_step(opt_run *o, float *p, const float *g) {
    switch (o->k) {
    case OPT_SGD: return mn_sgd_step(&o->sg, p, g, NULL);
    case OPT_ADAMW: return mn_adamw_step(&o->aw, p, g, NULL);
    case OPT_ADAMW8: return mn_adamw8bit_step(&o->a8, p, g, NULL);
    case OPT_ADAFACTOR: return mn_adafactor_step(&o->af, p, g, NULL);
    default: return mn_lion_step(&o->li, p, g, NULL);
    }
}

static void opt_free(opt_run *o) {
    switch (o->k) {
    case OPT_SGD: mn_sgd_free(&o->sg); break;
    case OPT_ADAMW: mn_adamw_free(&o->aw); break;
    case OPT_ADAMW8: mn_adamw8bit_free(&o->a8); break;
    case OPT_ADAFACTOR: mn_adafactor_free(&o->af); break;
    default: mn_lion_free(&o->li); break;
    }
}

// ns of memcpy of `bytes` from src to dst (both at least that large).
static double memcpy_ns(char *dst, const char *src, size_t bytes) {
    double t0 = now_ns();
    memcpy(dst, src, bytes);
    return now_ns() - t0;
}

// Medians of reps steps of optimizer k over [rows, cols] with `threads` threads, alternated with
// the peer: memcpy of cpy bytes (cpy > 0) or the same step on one thread (cpy == 0).
static int time_optimizer(opt_kind k, uint64_t rows, uint64_t cols, float *p, float *g,
                          int threads, char *cdst, const char *csrc, size_t cpy, double *t_step,
                          double *t_peer, uint64_t *state) {
    uint64_t n = rows * cols;
    double a[REPS_MAX], b[REPS_MAX], t0;
    opt_run o;
    mn_result r;
    int rep;
    if ((r = opt_init(&o, k, rows, cols, state)) != MN_OK) {
        fprintf(stderr, "bench_optim: %s init: %s\n", opt_names[k], mn_result_str(r));
        return 1;
    }
    for (rep = -1; rep < reps; rep++) {
        uint64_t i;
        for (i = 0; i < n; i += 97) g[i] = rnd_normalish();  // touch the gradients between steps
        set_threads(threads);
        t0 = now_ns();
        r = opt_step(&o, p, g);
        if (rep >= 0) a[rep] = now_ns() - t0;
        if (cpy > 0) {
            t0 = memcpy_ns(cdst, csrc, cpy);
        } else {
            set_threads(1);
            t0 = now_ns();
            r = r != MN_OK ? r : opt_step(&o, p, g);
            t0 = now_ns() - t0;
        }
        if (rep >= 0) b[rep] = t0;
        if (r != MN_OK) break;
    }
    opt_free(&o);
    set_threads(1);
    if (r != MN_OK) return 1;
    *t_step = bench_median(a, reps), *t_peer = bench_median(b, reps);
    return 0;
}

static double time_conversion(int which, const float *f, uint16_t *h, float *back, uint64_t n) {
    double t[REPS_MAX], t0;
    int rep;
    for (rep = -1; rep < reps; rep++) {
        t0 = now_ns();
        switch (which) {
        case 0: mn_fp32_to_fp16_array(f, h, n); break;
        case 1: mn_fp16_to_fp32_array(h, back, n); break;
        case 2: mn_fp32_to_bf16_array(f, h, n); break;
        default: mn_bf16_to_fp32_array(h, back, n); break;
        }
        if (rep >= 0) t[rep] = now_ns() - t0;
    }
    return bench_median(t, reps);
}

int main(int argc, char **argv) {
    static const char *const conv_names[4] = {"fp32 -> fp16", "fp16 -> fp32", "fp32 -> bf16",
                                              "bf16 -> fp32"};
    uint64_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 6291456ull, cols = 1024, rows, i, state;
    float *p, *g, *back;
    uint16_t *h;
    char cpu[128], *csrc, *cdst;
    size_t cap;
    int k;
    if (argc > 2) reps = atoi(argv[2]);
    if (reps < 1 || reps > REPS_MAX) reps = 7;
    bench_cpu_model(cpu, sizeof cpu);
    if (n < cols) n = cols;
    rows = n / cols, n = rows * cols;
    cap = (size_t)n * 28;  // the most bytes a step moves (AdamW: 28 per element)
    p = (float *)malloc(n * sizeof(float)), g = (float *)malloc(n * sizeof(float));
    back = (float *)malloc(n * sizeof(float)), h = (uint16_t *)malloc(n * sizeof(uint16_t));
    csrc = (char *)malloc(cap / 2), cdst = (char *)malloc(cap / 2);
    if (!p || !g || !back || !h || !csrc || !cdst) {
        fprintf(stderr, "bench_optim: out of memory for %llu elements\n", (unsigned long long)n);
        return 1;
    }
    memset(csrc, 1, cap / 2), memset(cdst, 2, cap / 2);
    for (i = 0; i < n; i++) p[i] = rnd_normalish(), g[i] = rnd_normalish();
    printf("bench_optim: %llu elements [%llu, %llu], %s, medians of %d\n", (unsigned long long)n,
           (unsigned long long)rows, (unsigned long long)cols, cpu, reps);
    printf("%-14s %12s %9s %9s %11s %7s\n", "step, 1 thread", "state bytes", "ns/elem", "GB/s",
           "memcpy GB/s", "ratio");
    for (k = 0; k < OPT_COUNT; k++) {
        double ts, tp, bytes;
        if (time_optimizer((opt_kind)k, rows, cols, p, g, 1, cdst, csrc, 1, &ts, &tp, &state))
            return 1;
        bytes = 12.0 * (double)n + 2.0 * (double)state;  // p r/w, g r, state r/w
        if (time_optimizer((opt_kind)k, rows, cols, p, g, 1, cdst, csrc, (size_t)(bytes / 2), &ts,
                           &tp, &state))
            return 1;
        printf("%-14s %12llu %9.3f %9.2f %11.2f %7.2f\n", opt_names[k],
               (unsigned long long)state, ts / (double)n, bytes / ts, bytes / tp, tp / ts);
    }
    printf("%-14s %12s %9s %9s %11s %7s\n", "step, 2 threads", "", "ns/elem", "", "1 thread",
           "ratio");
    for (k = 0; k < OPT_COUNT; k++) {
        double ts, tp;
        if (time_optimizer((opt_kind)k, rows, cols, p, g, 2, cdst, csrc, 0, &ts, &tp, &state))
            return 1;
        printf("%-14s %12s %9.3f %9s %11.3f %7.2f\n", opt_names[k], "", ts / (double)n, "",
               tp / (double)n, tp / ts);
    }
    printf("%-14s %12s %9s %9s\n", "conversion", "", "ns/elem", "GB/s");
    for (k = 0; k < 4; k++) {
        double ns = time_conversion(k, p, h, back, n);
        printf("%-14s %12s %9.3f %9.2f\n", conv_names[k], "", ns / (double)n,
               6.0 * (double)n / ns);
    }
    free(p), free(g), free(back), free(h), free(csrc), free(cdst);
    return 0;
}
