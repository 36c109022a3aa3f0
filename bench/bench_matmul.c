// bench_matmul: the header's matmul in its three training forms next to a CBLAS in the same run.
//   make bench && ./build/bench_matmul [runs] [all | - | part of a shape's name, e.g. head]
//                                      [threads: 1 | 2 | 12] [dtypes: fp32 | bf16 | fp16 | all]
// ("-" is every default shape; threads 12, the default, runs 1 then 2; dtypes default fp32.)
// bf16 / fp16 rows: inp and weight stored in 16 bits (mn_matmul_forward_typed / _backward_typed,
// converted while packing), the peer the same OpenBLAS fp32 call on the same shape.
// Built against OpenBLAS when the Makefile finds it (BENCH_BLAS=openblas, the default when
// cblas.h and -lopenblas link; BENCH_BLAS= builds without a peer). Forms, for a linear layer
// x[N,C] -> y[N,OC] with weight w[OC,C]:
//   fwd    y  = x w^T           mn_matmul_forward (no bias)      cblas_sgemm(N, T), beta 0
//   dinp   dx += dy w            mn_matmul_backward (dinp only)   cblas_sgemm(N, N), beta 1
//   dw     dw += dy^T x          mn_matmul_backward (dweight only) cblas_sgemm(T, N), beta 1
// Each figure is 2*N*C*OC flops over the median of `runs` timings (default 7), memanat and the
// peer timed in alternating rounds so that both see the same load; ratio = memanat / peer.
// peak = the FMA throughput of this core measured at start (16 independent vector FMA chains),
// times the thread count. The load average (/proc/loadavg) is printed with the table: on a shared
// machine, read the ratios, not the absolute rates.
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef BENCH_OPENBLAS
#include <cblas.h>
#endif

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"
#include "bench.h"

static double now_s(void) { return bench_wall_ns() * 1e-9; }

static void set_threads(int t) {
#ifdef _OPENMP
    omp_set_num_threads(t);
#endif
#ifdef BENCH_OPENBLAS
    openblas_set_num_threads(t);
#endif
    (void)t;
}

static float *buf(size_t n, uint64_t seed) {
    return bench_floats(n, seed, "bench_matmul");
}

typedef struct mm {
    size_t N, C, OC;
    float *x, *w, *y, *dy, *dx, *dw;
    uint16_t *x16, *w16;  // x and w in the 16-bit type of dt
    mn_dtype dt;          // MN_FP32: x and w; MN_BF16 / MN_FP16: x16 and w16
} mm;

enum { F_FWD, F_DINP, F_DW, F_COUNT };
static const char *const form_names[F_COUNT] = {"fwd", "dinp", "dw"};

static void run_memanat(const mm *k, int form) {
    const void *x = k->dt == MN_FP32 ? (const void *)k->x : (const void *)k->x16;
    const void *w = k->dt == MN_FP32 ? (const void *)k->w : (const void *)k->w16;
    if (k->dt != MN_FP32) {
        if (form == F_FWD)
            mn_matmul_forward_typed(k->y, NULL, x, w, NULL, k->N, k->C, k->OC, k->dt);
        else if (form == F_DINP)
            mn_matmul_backward_typed(k->dx, NULL, NULL, k->dy, x, w, NULL, k->N, k->C, k->OC,
                                     k->dt);
        else
            mn_matmul_backward_typed(NULL, k->dw, NULL, k->dy, x, w, NULL, k->N, k->C, k->OC,
                                     k->dt);
        return;
    }
    if (form == F_FWD) mn_matmul_forward(k->y, NULL, k->x, k->w, NULL, k->N, k->C, k->OC);
    else if (form == F_DINP)
        mn_matmul_backward(k->dx, NULL, NULL, k->dy, k->x, k->w, NULL, k->N, k->C, k->OC);
    else mn_matmul_backward(NULL, k->dw, NULL, k->dy, k->x, k->w, NULL, k->N, k->C, k->OC);
}

#ifdef BENCH_OPENBLAS
static void run_blas(const mm *k, int form) {
    int N = (int)k->N, C = (int)k->C, OC = (int)k->OC;
    if (form == F_FWD)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, k->x, C, k->w, C,
                    0.0f, k->y, OC);
    else if (form == F_DINP)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, k->dy, OC, k->w,
                    C, 1.0f, k->dx, C);
    else
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, k->dy, OC, k->x, C,
                    1.0f, k->dw, C);
}
#endif

// Seconds of one call: `reps` calls timed together (enough for >= 30 ms). With one thread the
// clock is this thread's CPU time (both libraries then compute on the calling thread), so time
// spent descheduled on a shared machine does not count; with more, the wall clock.
static int g_cpu_clock;
static double clock_s(void) { return g_cpu_clock ? bench_cpu_ns() * 1e-9 : now_s(); }
static double time_calls(void (*fn)(const mm *, int), const mm *k, int form, int reps) {
    double t0 = clock_s();
    int i;
    for (i = 0; i < reps; i++) fn(k, form);
    return (clock_s() - t0) / reps;
}

static int reps_for(void (*fn)(const mm *, int), const mm *k, int form) {
    double one;
    fn(k, form);  // warm-up
    one = time_calls(fn, k, form, 1);
    return one < 0.03 ? (int)(0.03 / (one > 1e-7 ? one : 1e-7)) + 1 : 1;
}

// FMA throughput of one core in GFLOP/s: 16 independent chains of vector FMAs.
static double fma_peak_one(void) {
    double t0, t;
    long it, n = 20000000;
    float sink = 0.0f;
#if defined(__AVX512F__)
    __m512 acc[16], m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-7f);
    const int w = 16;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[16], m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-7f);
    const int w = 8;
#else
    const int w = 0;
#endif
    int i;
    if (w == 0) return 0.0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    for (i = 0; i < 16; i++)  // distinct chains (equal ones would fold into one)
#if defined(__AVX512F__)
        acc[i] = _mm512_set1_ps(1e-7f * (float)(i + 1));
#else
        acc[i] = _mm256_set1_ps(1e-7f * (float)(i + 1));
#endif
    t0 = bench_cpu_ns() * 1e-9;
    for (it = 0; it < n; it++)
        for (i = 0; i < 16; i++)
#if defined(__AVX512F__)
            acc[i] = _mm512_fmadd_ps(acc[i], m, a);
#else
            acc[i] = _mm256_fmadd_ps(acc[i], m, a);
#endif
    t = bench_cpu_ns() * 1e-9 - t0;
    for (i = 0; i < 16; i++) {
        float v[16];
        memcpy(v, &acc[i], sizeof(float) * (size_t)w);
        sink += v[0] + v[w - 1];
    }
    if (sink == 12345.0f) printf(" ");
    return 2.0 * w * 16.0 * (double)n / t * 1e-9;
#else
    (void)t0, (void)t, (void)it, (void)n, (void)sink, (void)i;
    return 0.0;
#endif
}

static void loadavg(char *out, size_t cap) {
    FILE *f = fopen("/proc/loadavg", "r");
    snprintf(out, cap, "?");
    if (f) {
        if (fgets(out, (int)cap, f)) out[strcspn(out, "\n")] = 0;
        fclose(f);
    }
}

int main(int argc, char **argv) {
    // GPT-2 small (C 768, MLP 3072, vocabulary 50257) at B*T = 1024 and 4096 rows, and the
    // trainer's default tiny model (B 8, T 64, C 64, vocabulary 256); "all" adds 4096-row heads
    static const struct { const char *name; size_t N, C, OC; int all; } shapes[] = {
        {"gpt2 qkv", 1024, 768, 2304, 0},    {"gpt2 attproj", 1024, 768, 768, 0},
        {"gpt2 fc", 1024, 768, 3072, 0},     {"gpt2 fcproj", 1024, 3072, 768, 0},
        {"gpt2 head", 1024, 768, 50257, 0},  {"gpt2 qkv", 4096, 768, 2304, 0},
        {"gpt2 fc", 4096, 768, 3072, 0},     {"gpt2 fcproj", 4096, 3072, 768, 0},
        {"gpt2 head", 4096, 768, 50257, 1},  {"tiny qkv", 512, 64, 192, 0},
        {"tiny fc", 512, 64, 256, 0},        {"tiny fcproj", 512, 256, 64, 0},
        {"tiny head", 512, 64, 256, 0},
    };
    int runs = argc > 1 ? atoi(argv[1]) : 7, all = argc > 2 && strcmp(argv[2], "all") == 0;
    const char *only = argc > 2 && !all && strcmp(argv[2], "-") ? argv[2] : NULL;  // name part
    const char *tsel = argc > 3 ? argv[3] : "12", *dsel = argc > 4 ? argv[4] : "fp32";
    static const mn_dtype dts[3] = {MN_FP32, MN_BF16, MN_FP16};
    int threads[2] = {1, 2}, nthr = 2, ti, form, r, di;
    size_t i, maxx = 0, maxw = 0, maxy = 0;
    double peak1 = fma_peak_one(), tm[64], tb[64];
    char model[256], load[128];
    mm k;
    (void)tb;
    if (runs < 1) runs = 1;
    if (runs > 64) runs = 64;
#ifndef _OPENMP
    nthr = 1;
#endif
    for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        size_t x = shapes[i].N * shapes[i].C, w = shapes[i].OC * shapes[i].C;
        size_t y = shapes[i].N * shapes[i].OC;
        if (shapes[i].all && !all) continue;
        maxx = x > maxx ? x : maxx, maxw = w > maxw ? w : maxw, maxy = y > maxy ? y : maxy;
    }
    k.x = buf(maxx, 1), k.w = buf(maxw, 2), k.y = buf(maxy, 3), k.dy = buf(maxy, 4);
    k.dx = buf(maxx, 5), k.dw = buf(maxw, 6);
    k.x16 = (uint16_t *)malloc(maxx * 2 + 64), k.w16 = (uint16_t *)malloc(maxw * 2 + 64);
    if (!k.x16 || !k.w16) return 1;
    bench_cpu_model(model, sizeof model);
    loadavg(load, sizeof load);
    printf("machine: %s; FMA peak %.1f GFLOP/s per core (measured); load at start: %s\n", model,
           peak1, load);
#ifdef BENCH_OPENBLAS
    printf("peer: OpenBLAS %s (%s)\n", OPENBLAS_VERSION, openblas_get_config());
#else
    printf("peer: none (built without OpenBLAS: BENCH_BLAS=openblas with libopenblas-dev)\n");
#endif
    printf("median of %d runs; GFLOP/s = 2*N*C*OC / time (1 thread: its CPU time; 2: wall "
           "clock); ratio = memanat / peer\n\n", runs);
    printf("%-13s %-17s %-4s %-5s %3s %9s %9s %6s %6s\n", "shape", "N x C x OC", "form", "dtype",
           "thr", "memanat", "peer", "ratio", "%peak");
    for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        double fl = 2.0 * (double)shapes[i].N * (double)shapes[i].C * (double)shapes[i].OC;
        char dims[64];
        if ((shapes[i].all && !all) || (only && !strstr(shapes[i].name, only))) continue;
        k.N = shapes[i].N, k.C = shapes[i].C, k.OC = shapes[i].OC;
        snprintf(dims, sizeof dims, "%zux%zux%zu", k.N, k.C, k.OC);
        for (ti = 0; ti < nthr; ti++) for (di = 0; di < 3; di++) {
            if (!strchr(tsel, '0' + threads[ti])) continue;
            if (strcmp(dsel, "all") && strcmp(dsel, mn_dtype_name(dts[di]))) continue;
            k.dt = dts[di];
            if (k.dt == MN_BF16)
                mn_fp32_to_bf16_array(k.x, k.x16, k.N * k.C),
                    mn_fp32_to_bf16_array(k.w, k.w16, k.OC * k.C);
            if (k.dt == MN_FP16)
                mn_fp32_to_fp16_array(k.x, k.x16, k.N * k.C),
                    mn_fp32_to_fp16_array(k.w, k.w16, k.OC * k.C);
            set_threads(threads[ti]);
            g_cpu_clock = threads[ti] == 1;
            for (form = 0; form < F_COUNT; form++) {
                int rm = reps_for(run_memanat, &k, form), rb = 1;
                double gm, gb = 0.0;
#ifdef BENCH_OPENBLAS
                rb = reps_for(run_blas, &k, form);
#endif
                for (r = 0; r < runs; r++) {  // alternating rounds
                    tm[r] = time_calls(run_memanat, &k, form, rm);
#ifdef BENCH_OPENBLAS
                    tb[r] = time_calls(run_blas, &k, form, rb);
#endif
                }
                gm = fl / bench_median(tm, runs) * 1e-9;
#ifdef BENCH_OPENBLAS
                gb = fl / bench_median(tb, runs) * 1e-9;
#endif
                (void)rb;
                printf("%-13s %-17s %-4s %-5s %3d %9.1f %9.1f %6.2f %5.0f%%\n", shapes[i].name,
                       dims, form_names[form], mn_dtype_name(k.dt), threads[ti], gm, gb,
                       gb > 0 ? gm / gb : 0.0,
                       peak1 > 0 ? 100.0 * gm / (peak1 * threads[ti]) : 0.0);
                fflush(stdout);
            }
        }
    }
    loadavg(load, sizeof load);
    printf("\nload at end: %s\n", load);
    free(k.x), free(k.w), free(k.y), free(k.dy), free(k.dx), free(k.dw), free(k.x16), free(k.w16);
    return 0;
}
