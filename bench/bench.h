// Shared by the benchmark programs: clocks, the median of repeated runs, the CPU's name.
#ifndef MN_BENCH_H
#define MN_BENCH_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// n floats uniform in [-1, 1) from a 64-bit LCG seeded with seed (64 bytes of slack after them);
// exits naming prog when the host is out of memory (a benchmark, not the library).
static inline float *bench_floats(size_t n, uint64_t seed, const char *prog) {
    float *p = (float *)malloc(n * sizeof(float) + 64);
    uint64_t s = 0x9E3779B97F4A7C15ull ^ seed;
    size_t i;
    if (!p) {
        fprintf(stderr, "%s: out of memory (%zu floats)\n", prog, n);
        exit(1);
    }
    for (i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((double)(s >> 11) * (2.0 / 9007199254740992.0) - 1.0);
    }
    return p;
}

// Wall-clock nanoseconds.
static inline double bench_wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

// CPU time of this thread: time spent descheduled on a shared machine does not count.
static inline double bench_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// Median of v[0..n) (sorts v).
static inline double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// "model name" of /proc/cpuinfo with the first CPU's family and model, and the number of
// logical CPUs.
static inline int bench_cpu_model(char *buf, size_t cap) {
    char line[256], name[128] = "unknown CPU";
    FILE *f = fopen("/proc/cpuinfo", "r");
    int ncpu = 0, family = -1, model = -1;
    snprintf(buf, cap, "%s", name);
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "processor", 9) == 0) ncpu++;
        if (!colon || ncpu != 1) continue;
        if (strncmp(line, "model name", 10) == 0) {
            snprintf(name, sizeof name, "%s", colon + 2);
            name[strcspn(name, "\n")] = 0;
        } else if (strncmp(line, "cpu family", 10) == 0) {
            family = atoi(colon + 1);
        } else if (strncmp(line, "model", 5) == 0 && (line[5] == '\t' || line[5] == ' ')) {
            model = atoi(colon + 1);
        }
    }
    fclose(f);
    // the name alone ("AMD EPYC" under a hypervisor) does not tell the core's generation
    if (family >= 0 && model >= 0) snprintf(buf, cap, "%s, family %d model %d", name, family, model);
    else snprintf(buf, cap, "%s", name);
    return ncpu;
}

#endif
