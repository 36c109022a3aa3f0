// bench_ops: speed of the CPU reference ops for trainer-sized shapes (a tiny GPT: B*T rows
// 256..1024, C 128..512, MLP 4C, byte vocabulary 256).
//   make bench && ./build/bench_ops [runs]        (OMP_NUM_THREADS is overridden per row)
// Matmul rows give GFLOP/s (2*N*C*OC per product; backward = dinp + dweight + dbias = 2 products),
// next to a naive triple loop. Layernorm and softmax rows give GB/s counting each array read or
// written once (forward: read x, write y; backward: read dy and x (or y), read and write dx).
// Attention rows (causal) give GFLOP/s over the useful products: forward q k^T and p v,
// 4*B*NH*hs*T*(T+1)/2 flops; backward twice that (dp, dq, dk, dv).
// Every figure is the median of several timed runs after a warm-up.
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
#include "bench.h"

static double now_s(void) { return bench_wall_ns() * 1e-9; }

static void set_threads(int t) {
#ifdef _OPENMP
    omp_set_num_threads(t);
#else
    (void)t;
#endif
}

static float *buf(size_t n) {
    return bench_floats(n, n, "bench_ops");
}

// The workloads, one argument struct for all.
typedef struct work {
    int N, C, OC, B, T, NH;
    float *inp, *w, *b, *out, *pre, *dout, *dinp, *dw, *db, *mean, *rstd, *att;
} work;

static void naive_matmul(const work *k) {
    int n, o, c;
    for (n = 0; n < k->N; n++)
        for (o = 0; o < k->OC; o++) {
            const float *x = k->inp + (size_t)n * k->C, *w = k->w + (size_t)o * k->C;
            float s = k->b[o];
            for (c = 0; c < k->C; c++) s += x[c] * w[c];
            k->out[(size_t)n * k->OC + o] = s;
        }
}
static void mm_fwd(const work *k) {
    mn_matmul_forward(k->out, NULL, k->inp, k->w, k->b, k->N, k->C, k->OC);
}
static void mm_fwd_gelu(const work *k) {
    mn_matmul_forward(k->out, k->pre, k->inp, k->w, k->b, k->N, k->C, k->OC);
}
static void mm_bwd(const work *k) {
    mn_matmul_backward(k->dinp, k->dw, k->db, k->dout, k->inp, k->w, NULL, k->N, k->C, k->OC);
}
static void ln_fwd(const work *k) {
    mn_layernorm_forward(k->out, k->mean, k->rstd, k->inp, k->w, k->b, k->N, k->C, 1e-5f);
}
static void ln_bwd(const work *k) {
    mn_layernorm_backward(k->dinp, k->dw, k->db, k->dout, k->inp, k->w, k->mean, k->rstd, k->N,
                          k->C);
}
static void sm_fwd(const work *k) { mn_softmax_forward(k->out, k->inp, k->N, k->C, 0.125f, 0); }
static void sm_bwd(const work *k) {
    mn_softmax_backward(k->dinp, k->dout, k->out, k->N, k->C, 0.125f, 0);
}
static void at_fwd_kept(const work *k) {
    mn_attention_forward(k->out, k->att, k->inp, k->B, k->T, k->C, k->NH, 1);
}
static void at_fwd_recompute(const work *k) {
    mn_attention_forward(k->out, NULL, k->inp, k->B, k->T, k->C, k->NH, 1);
}
static void at_bwd_kept(const work *k) {
    mn_attention_backward(k->dinp, k->dout, k->inp, k->att, k->B, k->T, k->C, k->NH, 1);
}
static void at_bwd_recompute(const work *k) {
    mn_attention_backward(k->dinp, k->dout, k->inp, NULL, k->B, k->T, k->C, k->NH, 1);
}

static void row(const char *op, const char *shape, int threads, double t, double rate,
                const char *unit) {
    printf("%-24s %-20s %7d %10.3f %8.1f %s\n", op, shape, threads, t * 1e3, rate, unit);
}

// Median seconds per call over `runs` timed runs, each long enough (>= 20 ms) to time well.
static double time_op(void (*fn)(const work *), const work *k, int runs) {
    double t[64], t0, one;
    int r, reps = 1, i;
    fn(k);  // warm-up, and an estimate of one call
    t0 = now_s();
    fn(k);
    one = now_s() - t0;
    if (one < 0.02) reps = (int)(0.02 / (one > 1e-7 ? one : 1e-7)) + 1;
    if (runs > 64) runs = 64;
    for (r = 0; r < runs; r++) {
        t0 = now_s();
        for (i = 0; i < reps; i++) fn(k);
        t[r] = (now_s() - t0) / reps;
    }
    return bench_median(t, runs);
}

// One timed op per row: work is the flops or bytes of one call in units of the group's base.
typedef struct timed {
    const char *label;
    void (*fn)(const work *);
    double work;
} timed;

static void time_rows(const timed *ops, size_t n, const work *k, int runs, const char *shape,
                      int threads, double base, const char *unit) {
    size_t j;
    for (j = 0; j < n; j++) {
        double t = time_op(ops[j].fn, k, runs);
        row(ops[j].label, shape, threads, t, ops[j].work * base / t * 1e-9, unit);
    }
}

static void machine(void) {
    char model[256];
    int ncpu = bench_cpu_model(model, sizeof model);
    printf("machine: %s, %d logical CPUs", model, ncpu);
#ifdef _OPENMP
    printf(", OpenMP %d (max %d threads)\n", _OPENMP, omp_get_max_threads());
#else
    printf(", built without OpenMP (single thread)\n");
#endif
}

int main(int argc, char **argv) {
    // matmul shapes of a tiny GPT: qkv (C -> 3C), fc (C -> 4C), fcproj (4C -> C), head (C -> 256)
    static const struct { const char *name; int N, C, OC; } mm[] = {
        {"qkv    C=128", 256, 128, 384},   {"fc     C=128", 256, 128, 512},
        {"fc     C=256", 512, 256, 1024},  {"fcproj C=256", 512, 1024, 256},
        {"fc     C=512", 1024, 512, 2048}, {"fcproj C=512", 1024, 2048, 512},
        {"head   V=256", 1024, 512, 256},
    };
    static const struct { const char *name; int N, L; } rows[] = {
        {"C=128", 256, 128}, {"C=512", 1024, 512}, {"attention scores T=256", 4096, 256},
    };
    // attention of the same tiny GPT, causal (B*NH*T*T probabilities kept: 4 MiB at T=256)
    static const struct { int B, T, C, NH; } att[] = {{4, 64, 256, 4}, {4, 256, 256, 4}};
    // per group, each op's flops or bytes in units of the group's base (2*N*C*OC, N*L*4 bytes,
    // the attention flops): a backward does twice the products of a forward
    static const timed matmuls[3] = {
        {"matmul fwd", mm_fwd, 1.0}, {"matmul fwd +gelu", mm_fwd_gelu, 1.0},
        {"matmul bwd", mm_bwd, 2.0}};
    static const timed rowwise[4] = {
        {"layernorm fwd", ln_fwd, 2.0}, {"layernorm bwd", ln_bwd, 4.0},
        {"softmax fwd", sm_fwd, 2.0}, {"softmax bwd", sm_bwd, 4.0}};
    static const timed attention[4] = {
        {"attention fwd (keep p)", at_fwd_kept, 1.0},
        {"attention fwd (no p)", at_fwd_recompute, 1.0},
        {"attention bwd (kept p)", at_bwd_kept, 2.0},
        {"attention bwd (recomp.)", at_bwd_recompute, 2.0}};
    int runs = argc > 1 ? atoi(argv[1]) : 7;
    int threads[2] = {1, 2}, nthr = 2, ti;
    size_t i, maxn = (size_t)1 << 22;
    work k;
    if (runs < 1) runs = 1;
#ifndef _OPENMP
    nthr = 1;
#endif
    memset(&k, 0, sizeof k);
    k.inp = buf(maxn), k.w = buf(maxn), k.b = buf(8192), k.out = buf(maxn), k.pre = buf(maxn);
    k.dout = buf(maxn), k.dinp = buf(maxn), k.dw = buf(maxn), k.db = buf(8192);
    k.mean = buf(1 << 16), k.rstd = buf(1 << 16), k.att = buf(maxn);
    machine();
    printf("median of %d runs; GFLOP/s = 2*N*C*OC per product; GB/s = fp32 arrays moved\n\n", runs);
    printf("%-24s %-20s %7s %10s %8s\n", "op", "shape", "threads", "ms", "rate");
    for (i = 0; i < sizeof mm / sizeof mm[0]; i++) {
        double fl = 2.0 * mm[i].N * mm[i].C * mm[i].OC, t;
        char shape[64];
        k.N = mm[i].N, k.C = mm[i].C, k.OC = mm[i].OC;
        snprintf(shape, sizeof shape, "%dx%dx%d", k.N, k.C, k.OC);
        printf("-- %s: N=%d C=%d OC=%d\n", mm[i].name, k.N, k.C, k.OC);
        set_threads(1);
        t = time_op(naive_matmul, &k, runs < 3 ? runs : 3);
        row("matmul naive loop", shape, 1, t, fl / t * 1e-9, "GFLOP/s");
        for (ti = 0; ti < nthr; ti++) {
            set_threads(threads[ti]);
            time_rows(matmuls, 3, &k, runs, shape, threads[ti], fl, "GFLOP/s");
        }
    }
    printf("\n");
    for (i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        double bytes = 4.0 * rows[i].N * rows[i].L;
        char shape[64];
        k.N = rows[i].N, k.C = rows[i].L, k.OC = 0;
        snprintf(shape, sizeof shape, "%dx%d", rows[i].N, rows[i].L);
        printf("-- rows of %s: N=%d L=%d\n", rows[i].name, rows[i].N, rows[i].L);
        for (ti = 0; ti < nthr; ti++) {
            set_threads(threads[ti]);
            time_rows(rowwise, 4, &k, runs, shape, threads[ti], bytes, "GB/s");
        }
    }
    printf("\n");
    for (i = 0; i < sizeof att / sizeof att[0]; i++) {
        double fl = 4.0 * att[i].B * att[i].C * (double)att[i].T * (att[i].T + 1) / 2.0;
        char shape[64];
        k.B = att[i].B, k.T = att[i].T, k.C = att[i].C, k.NH = att[i].NH;
        snprintf(shape, sizeof shape, "B%d T%d C%d NH%d", k.B, k.T, k.C, k.NH);
        for (ti = 0; ti < nthr; ti++) {
            set_threads(threads[ti]);
            time_rows(attention, 4, &k, runs, shape, threads[ti], fl, "GFLOP/s");
        }
    }
    free(k.inp), free(k.w), free(k.b), free(k.out), free(k.pre);
    free(k.dout), free(k.dinp), free(k.dw), free(k.db), free(k.mean), free(k.rstd), free(k.att);
    return 0;
}
