// Shared by the benchmark programs: clocks, the median of repeated runs, the CPU's name.
#ifndef MN_BENCH_H
#define MN_BENCH_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

// "model name" of /proc/cpuinfo and the number of logical CPUs.
static inline int bench_cpu_model(char *buf, size_t cap) {
    char line[256];
    FILE *f = fopen("/proc/cpuinfo", "r");
    int ncpu = 0;
    snprintf(buf, cap, "unknown CPU");
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon && ncpu == 1) {
            snprintf(buf, cap, "%s", colon + 2);
            buf[strcspn(buf, "\n")] = 0;
        }
        if (strncmp(line, "processor", 9) == 0) ncpu++;
    }
    fclose(f);
    return ncpu;
}

#endif
