// bench_optim: host speed of the optimizer steps and the fp16/bf16 conversions (section >>optim).
//
//   make bench && ./build/bench_optim [elements]      default 4M elements (16 MiB of fp32)
//
// Each optimizer steps one fp32 tensor of n elements shaped [n/1024, 1024] (Adafactor factors it)
// with fresh gradients; the table gives the median of 7 timed steps after one warm-up step, in ns
// per element and in GB/s of the bytes a step must move at least (read param, grad and state,
// write param and state). Conversions: bulk arrays, GB/s of bytes read + written. One thread.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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


enum { REPS = 7 };

typedef enum { OPT_SGD, OPT_ADAMW, OPT_ADAMW8, OPT_ADAFACTOR, OPT_LION, OPT_COUNT } opt_kind;
static const char *const opt_names[OPT_COUNT] = {"sgd momentum", "adamw", "adamw 8-bit",
                                                 "adafactor", "lion"};

// Median ns of one step of optimizer k over [rows, cols]; *state receives its state bytes.
static double time_optimizer(opt_kind k, uint64_t rows, uint64_t cols, float *p, float *g,
                             uint64_t *state) {
    uint64_t dims[2], n = rows * cols;
    double t[REPS], t0;
    mn_sgd sg; mn_adamw aw; mn_adamw8bit a8; mn_adafactor af; mn_lion li;
    mn_sgd_params psg;
    mn_result r = MN_OK;
    int rep;
    dims[0] = rows, dims[1] = cols;
    memset(&psg, 0, sizeof psg);
    psg.momentum = 0.9f;
    switch (k) {
    case OPT_SGD: r = mn_sgd_init(&sg, dims, 2, &psg, NULL), *state = sg.state_bytes; break;
    case OPT_ADAMW: r = mn_adamw_init(&aw, dims, 2, NULL, NULL), *state = aw.state_bytes; break;
    case OPT_ADAMW8:
        r = mn_adamw8bit_init(&a8, dims, 2, NULL, NULL), *state = a8.state_bytes;
        break;
    case OPT_ADAFACTOR:
        r = mn_adafactor_init(&af, dims, 2, NULL, NULL), *state = af.state_bytes;
        break;
    default: r = mn_lion_init(&li, dims, 2, NULL, NULL), *state = li.state_bytes; break;
    }
    if (r != MN_OK) {
        fprintf(stderr, "bench_optim: %s init: %s\n", opt_names[k], mn_result_str(r));
        return -1.0;
    }
    for (rep = -1; rep < REPS; rep++) {
        uint64_t i;
        for (i = 0; i < n; i += 97) g[i] = rnd_normalish();  // touch the gradients between steps
        t0 = now_ns();
        switch (k) {
        case OPT_SGD: r = mn_sgd_step(&sg, p, g, NULL); break;
        case OPT_ADAMW: r = mn_adamw_step(&aw, p, g, NULL); break;
        case OPT_ADAMW8: r = mn_adamw8bit_step(&a8, p, g, NULL); break;
        case OPT_ADAFACTOR: r = mn_adafactor_step(&af, p, g, NULL); break;
        default: r = mn_lion_step(&li, p, g, NULL); break;
        }
        if (rep >= 0) t[rep] = now_ns() - t0;
    }
    switch (k) {
    case OPT_SGD: mn_sgd_free(&sg); break;
    case OPT_ADAMW: mn_adamw_free(&aw); break;
    case OPT_ADAMW8: mn_adamw8bit_free(&a8); break;
    case OPT_ADAFACTOR: mn_adafactor_free(&af); break;
    default: mn_lion_free(&li); break;
    }
    if (r != MN_OK) return -1.0;
    return bench_median(t, REPS);
}

static double time_conversion(int which, const float *f, uint16_t *h, float *back, uint64_t n) {
    double t[REPS], t0;
    int rep;
    for (rep = -1; rep < REPS; rep++) {
        t0 = now_ns();
        switch (which) {
        case 0: mn_fp32_to_fp16_array(f, h, n); break;
        case 1: mn_fp16_to_fp32_array(h, back, n); break;
        case 2: mn_fp32_to_bf16_array(f, h, n); break;
        default: mn_bf16_to_fp32_array(h, back, n); break;
        }
        if (rep >= 0) t[rep] = now_ns() - t0;
    }
    return bench_median(t, REPS);
}

int main(int argc, char **argv) {
    static const char *const conv_names[4] = {"fp32 -> fp16", "fp16 -> fp32", "fp32 -> bf16",
                                              "bf16 -> fp32"};
    uint64_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : (4ull << 20), cols = 1024, rows, i, state;
    float *p, *g, *back;
    uint16_t *h;
    char cpu[128] = "unknown CPU";
    FILE *fp = fopen("/proc/cpuinfo", "r");
    int k;
    if (fp) {
        char line[256];
        while (fgets(line, sizeof line, fp))
            if (strncmp(line, "model name", 10) == 0) {
                char *c = strchr(line, ':');
                if (c) snprintf(cpu, sizeof cpu, "%s", c + 2);
                cpu[strcspn(cpu, "\n")] = 0;
                break;
            }
        fclose(fp);
    }
    if (n < cols) n = cols;
    rows = n / cols, n = rows * cols;
    p = (float *)malloc(n * sizeof(float)), g = (float *)malloc(n * sizeof(float));
    back = (float *)malloc(n * sizeof(float)), h = (uint16_t *)malloc(n * sizeof(uint16_t));
    if (!p || !g || !back || !h) {
        fprintf(stderr, "bench_optim: out of memory for %llu elements\n", (unsigned long long)n);
        return 1;
    }
    for (i = 0; i < n; i++) p[i] = rnd_normalish(), g[i] = rnd_normalish();
    printf("bench_optim: %llu elements [%llu, %llu], one thread, %s\n", (unsigned long long)n,
           (unsigned long long)rows, (unsigned long long)cols, cpu);
    printf("%-14s %12s %10s %10s\n", "step", "state bytes", "ns/elem", "GB/s");
    for (k = 0; k < OPT_COUNT; k++) {
        double ns = time_optimizer((opt_kind)k, rows, cols, p, g, &state);
        double bytes = 12.0 * (double)n + 2.0 * (double)state;  // p r/w, g r, state r/w
        if (ns < 0) return 1;
        printf("%-14s %12llu %10.3f %10.2f\n", opt_names[k], (unsigned long long)state,
               ns / (double)n, bytes / ns);
    }
    printf("%-14s %12s %10s %10s\n", "conversion", "", "ns/elem", "GB/s");
    for (k = 0; k < 4; k++) {
        double ns = time_conversion(k, p, h, back, n);
        printf("%-14s %12s %10.3f %10.2f\n", conv_names[k], "", ns / (double)n,
               6.0 * (double)n / ns);
    }
    free(p), free(g), free(back), free(h);
    return 0;
}
