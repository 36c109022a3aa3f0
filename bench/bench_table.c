// bench_table: one table of memanat's CPU speed beside a peer measured in the same run.
//
//   make bench && ./build/bench_table [reps [parts]]  (reps: timed runs per cell, default 5;
//                                                     parts: a comma list of matmul, memory,
//                                                     threads, alloc, fit; default all)
//
// At start: the core's fp32 FMA peak (independent FMA chains on the widest vector), the copy
// bandwidth (memcpy of 64 MiB, out of cache) and the latency of a load that misses every cache
// (what each block an allocation follows costs once its structures outgrow them). Rows (medians
// of reps, memanat and peer alternated):
//   matmul       GFLOP/s through mn_matmul_forward / mn_matmul_backward; peer cblas_sgemm when the
//                build has OpenBLAS (MN_BENCH_CBLAS), else the FMA peak (times the threads).
//   memory ops   GB/s of the bytes the op must move at least (each array read or written once);
//                peer: memcpy of the same number of bytes, out of cache, timed beside it.
//   adamw llm.c  mn_adamw_step beside llm.c's AdamW loop (bench/peer_llmc_adamw.c, built with
//                -O3 -ffast-math as llm.c builds it) on the same parameters, gradients and state.
//   2 threads    the op with 2 threads, idle and while a child process keeps a core busy; peer:
//                the same op with 1 thread under the same condition (ratio > 1: 2 threads win).
//   allocator    ns per mn_cache_alloc + mn_cache_release of mixed sizes with `live` blocks held,
//                and at 10^6 of each of its two size classes alone; peer: glibc malloc + free of
//                the sizes / 1024 (under its mmap threshold; not the same job, the scale to beat).
//   estimate/fit ms per call; peer: the 10 ms target.
// Ratio: memanat speed / peer speed (for times: peer time / memanat time); higher is better.
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef MN_BENCH_CBLAS
#include <cblas.h>
#endif

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"
#include "bench.h"

static int reps = 5;
static const char *parts = "all";  // the rows asked for (main)
#define PARTS "all,matmul,memory,threads,alloc,fit"

// Whether the comma list holds the n bytes at name as one of its items.
static int list_has(const char *list, const char *name, size_t n) {
    while (*list) {
        size_t len = strcspn(list, ",");
        if (len == n && strncmp(list, name, n) == 0) return 1;
        list += len + (list[len] == ',');
    }
    return 0;
}

// Whether the rows of part `name` were asked for.
static int want(const char *name) {
    return list_has(parts, "all", 3) || list_has(parts, name, strlen(name));
}

// OpenMP's threads for every row, OpenBLAS's as well during its own rows (blas_rows); the rows
// after them leave OpenBLAS on 1 thread. (Its workers spin after a call unless told not to, see
// main, on the core that a 2-thread row of the header's ops needs: layernorm forward on 2
// threads measured 0.22 of 1 thread with OpenBLAS's workers spinning, 1.8 to 1.9 without.)
static int blas_rows;

static void set_threads(int t) {
#ifdef _OPENMP
    omp_set_num_threads(t);
#endif
#ifdef MN_BENCH_CBLAS
    if (blas_rows) openblas_set_num_threads(t);
#endif
    (void)t;
}

static float *fbuf(size_t n) {
    return bench_floats(n, n, "bench_table");
}

// ---- machine figures ----------------------------------------------------------------------------

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

// GFLOP/s of one thread running 12 independent FMA chains (enough to fill two pipes of latency 4).
#if defined(__GNUC__) && !defined(__clang__)
#define CONTRACT __attribute__((optimize("fp-contract=fast")))  // GCC in ISO C mode: no FMA
#else
#define CONTRACT
#endif
CONTRACT static double fma_peak(void) {
    vf a[12], x, y;
    double t0, best = 0.0;
    long i, iters = 20000000;
    int k, r;
    memset(&x, 0, sizeof x), memset(&y, 0, sizeof y);
    for (k = 0; k < VW; k++) x[k] = 0.999999f, y[k] = 1e-7f;
    for (r = 0; r < 3; r++) {
        for (k = 0; k < 12; k++) a[k] = x * (float)k;
        t0 = bench_wall_ns();
        for (i = 0; i < iters; i++) {
#define F(k) a[k] = a[k] * x + y;
            F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
#undef F
            __asm__ volatile("" : "+x"(a[0]), "+x"(a[5]), "+x"(a[11]));
        }
        t0 = bench_wall_ns() - t0;
        for (k = 1; k < 12; k++) a[0] += a[k];
        if (a[0][0] == 12345.0f) printf(" ");
        if (2.0 * 12 * VW * (double)iters / t0 > best) best = 2.0 * 12 * VW * (double)iters / t0;
    }
    return best;
}

// ns per load of a chain of dependent loads, each at a random cache line of a 256 MiB buffer
// (one cycle through every line in a random order, Sattolo's shuffle): the time a structure
// far larger than the caches pays for each pointer it follows (TLB misses included).
static double load_latency_ns(void) {
    const size_t lines = (size_t)4 << 20, loads = (size_t)1 << 20;  // 256 MiB of 64-byte lines
    size_t *buf = (size_t *)malloc(lines * 64), i, j, p = 0;
    uint32_t *perm = (uint32_t *)malloc(lines * sizeof *perm);
    uint64_t s = 0x2545F4914F6CDD1Dull;
    double t[64], t0;
    int r;
    if (!buf || !perm) return 0.0;
    for (i = 0; i < lines; i++) perm[i] = (uint32_t)i;
    for (i = lines - 1; i > 0; i--) {  // Sattolo: a single cycle
        uint32_t x;
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        j = (size_t)(s % i);
        x = perm[i], perm[i] = perm[j], perm[j] = x;
    }
    for (i = 0; i < lines; i++) buf[(size_t)perm[i] * 8] = (size_t)perm[(i + 1) % lines] * 8;
    free(perm);
    for (r = 0; r < reps; r++) {
        t0 = bench_wall_ns();
        for (i = 0; i < loads; i++) p = buf[p];
        t[r] = (bench_wall_ns() - t0) / (double)loads;
    }
    if (p == 1) printf(" ");  // (p is used: the loads stay)
    free(buf);
    return bench_median(t, reps);
}

static char *cpy_src, *cpy_dst;
static const size_t cpy_cap = (size_t)64 << 20;

// ns of memcpy of `bytes` (at most 64 MiB) from a buffer whose head was not touched just before.
static double memcpy_ns(size_t bytes) {
    static size_t off = 0;
    double t0;
    if (bytes > cpy_cap) bytes = cpy_cap;
    off = (off + ((size_t)8 << 20)) % cpy_cap;  // rotate the start: the data is not all in cache
    t0 = bench_wall_ns();
    if (off + bytes <= cpy_cap) memcpy(cpy_dst + off, cpy_src + off, bytes);
    else {
        memcpy(cpy_dst + off, cpy_src + off, cpy_cap - off);
        memcpy(cpy_dst, cpy_src, bytes - (cpy_cap - off));
    }
    return bench_wall_ns() - t0;
}

// ---- timing -------------------------------------------------------------------------------------

typedef void (*work_fn)(void *);

static double time_once(work_fn f, void *arg) {
    double t0 = bench_wall_ns();
    f(arg);
    return bench_wall_ns() - t0;
}

// Medians of reps runs of f (threads tf) and g (threads tg), alternated, after one warm-up each.
static void time_pair(work_fn f, void *fa, int tf, work_fn g, void *ga, int tg, double *mf,
                      double *mg) {
    double a[64], b[64];
    int r;
    set_threads(tf), f(fa);
    set_threads(tg), g(ga);
    for (r = 0; r < reps; r++) {
        set_threads(tf), a[r] = time_once(f, fa);
        set_threads(tg), b[r] = time_once(g, ga);
    }
    *mf = bench_median(a, reps), *mg = bench_median(b, reps);
}

static void row(const char *op, const char *shape, const char *dt, const char *thr, const char *mn,
                const char *peer, double ratio) {
    printf("%-18s %-18s %-5s %-7s %-22s %-26s %6.2f\n", op, shape, dt, thr, mn, peer, ratio);
    fflush(stdout);
}

// ---- the ops ------------------------------------------------------------------------------------

typedef struct opw {
    size_t N, C, OC, V, B, T;
    float *inp, *w, *b, *out, *dout, *dinp, *dw, *db, *mean, *rstd, *p, *g;
    int *tok;
    uint16_t *h16;
    size_t cpy;  // bytes for the memcpy peer
    mn_adamw aw;
    mn_sgd sg;
    mn_lion li;
    mn_adamw8bit a8;
    mn_adafactor af;
} opw;

static void w_memcpy(void *a) { memcpy_ns(((opw *)a)->cpy); }
static void w_mm_fwd(void *a) {
    opw *k = (opw *)a;
    mn_matmul_forward(k->out, NULL, k->inp, k->w, k->b, k->N, k->C, k->OC);
}
static void w_mm_bwd(void *a) {
    opw *k = (opw *)a;
    mn_matmul_backward(k->dinp, k->dw, k->db, k->dout, k->inp, k->w, NULL, k->N, k->C, k->OC);
}
#ifdef MN_BENCH_CBLAS
static void w_blas_fwd(void *a) {
    opw *k = (opw *)a;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)k->N, (int)k->OC, (int)k->C, 1.0f,
                k->inp, (int)k->C, k->w, (int)k->C, 0.0f, k->out, (int)k->OC);
}
static void w_blas_bwd(void *a) {
    opw *k = (opw *)a;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)k->N, (int)k->C, (int)k->OC, 1.0f,
                k->dout, (int)k->OC, k->w, (int)k->C, 1.0f, k->dinp, (int)k->C);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)k->OC, (int)k->C, (int)k->N, 1.0f,
                k->dout, (int)k->OC, k->inp, (int)k->C, 1.0f, k->dw, (int)k->C);
}
#endif
static void w_ln(void *a) {
    opw *k = (opw *)a;
    mn_layernorm_forward(k->out, k->mean, k->rstd, k->inp, k->w, k->b, k->N, k->C, 1e-5f);
}
static void w_rms(void *a) {
    opw *k = (opw *)a;
    mn_rmsnorm_forward(k->out, k->rstd, k->inp, k->w, k->N, k->C, 1e-5f);
}
static void w_sm(void *a) {
    opw *k = (opw *)a;
    mn_softmax_forward(k->out, k->inp, k->N, k->C, 1.0f, 0);
}
static void w_gelu(void *a) {
    opw *k = (opw *)a;
    mn_gelu_forward(k->out, k->inp, k->N * k->C);
}
static void w_ce(void *a) {
    opw *k = (opw *)a;
    mn_crossentropy_forward(k->mean, k->out, k->inp, k->tok, k->N, k->V);
}
// The backward rows reuse the forward rows' buffers (only the time matters): dout from p, the
// gradients accumulate into g (out for the cross-entropy's [256, V] dlogits, with probs from inp).
static void w_rms_bwd(void *a) {
    opw *k = (opw *)a;
    mn_rmsnorm_backward(k->g, k->dw, k->p, k->inp, k->w, k->rstd, k->N, k->C);
}
static void w_ln_bwd(void *a) {
    opw *k = (opw *)a;
    mn_layernorm_backward(k->g, k->dw, k->db, k->p, k->inp, k->w, k->mean, k->rstd, k->N, k->C);
}
static void w_sm_bwd(void *a) {
    opw *k = (opw *)a;
    mn_softmax_backward(k->g, k->p, k->out, k->N, k->C, 1.0f, 0);
}
static void w_gelu_bwd(void *a) {
    opw *k = (opw *)a;
    mn_gelu_backward(k->g, k->p, k->inp, k->N * k->C);
}
static void w_ce_bwd(void *a) {
    opw *k = (opw *)a;
    mn_crossentropy_backward(k->out, k->rstd, k->inp, NULL, k->tok, k->N, k->V);
}
static void w_emb(void *a) {
    opw *k = (opw *)a;
    mn_embedding_forward(k->out, k->tok, k->inp, k->w, k->B, k->T, k->C, k->V);
}
static void w_adamw(void *a) { mn_adamw_step(&((opw *)a)->aw, ((opw *)a)->p, ((opw *)a)->g, NULL); }
void peer_llmc_adamw(float *param, const float *grad, float *m_mem, float *v_mem, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int t);
static void w_llmc_adamw(void *a) {  // the same hyperparameters and step count as memanat's
    opw *k = (opw *)a;
    const mn_adamw_params *q = &k->aw.params;
    peer_llmc_adamw(k->p, k->g, k->aw.exp_avg, k->aw.exp_avg_sq, (size_t)k->aw.n, q->lr, q->beta1,
                    q->beta2, q->eps, q->weight_decay, (int)k->aw.step + 1);
}
static void w_sgd(void *a) { mn_sgd_step(&((opw *)a)->sg, ((opw *)a)->p, ((opw *)a)->g, NULL); }
static void w_lion(void *a) { mn_lion_step(&((opw *)a)->li, ((opw *)a)->p, ((opw *)a)->g, NULL); }
static void w_a8(void *a) {
    opw *k = (opw *)a;
    mn_adamw8bit_step(&k->a8, k->p, k->g, NULL);
}
static void w_af(void *a) {
    opw *k = (opw *)a;
    mn_adafactor_step(&k->af, k->p, k->g, NULL);
}
static void w_tobf16(void *a) {
    opw *k = (opw *)a;
    mn_fp32_to_bf16_array(k->p, k->h16, k->N * k->C);
}
static void w_frombf16(void *a) {
    opw *k = (opw *)a;
    mn_bf16_to_fp32_array(k->h16, k->p, k->N * k->C);
}

// One memory-bound row: op moving `bytes`, against memcpy of the same bytes.
static void mem_row(const char *op, const char *shape, opw *k, work_fn f, double bytes,
                    double elems) {
    double tm, tp;
    char a[64], b[64];
    k->cpy = (size_t)(bytes / 2);
    time_pair(f, k, 1, w_memcpy, k, 1, &tm, &tp);
    if (elems > 0) snprintf(a, sizeof a, "%.1f GB/s %.2f ns/el", bytes / tm, tm / elems);
    else snprintf(a, sizeof a, "%.1f GB/s", bytes / tm);
    snprintf(b, sizeof b, "memcpy %.1f GB/s", bytes / tp);
    row(op, shape, "fp32", "1", a, b, tp / tm);
}

static pid_t busy_start(void) {
    pid_t p = fork();
    if (p == 0) {
        volatile unsigned long x = 0;
        for (;;) x++;
    }
    {
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
    }
    return p;
}
static void busy_stop(pid_t p) {
    if (p > 0) kill(p, SIGKILL), waitpid(p, NULL, 0);
}

// 2 threads against 1 for op f, idle and with one core kept busy by a child process.
static void thr_rows(const char *op, const char *shape, opw *k, work_fn f) {
    double t1, t2;
    char a[64], b[64];
    int busy;
    for (busy = 0; busy < 2; busy++) {
        pid_t p = busy ? busy_start() : 0;
        time_pair(f, k, 2, f, k, 1, &t2, &t1);
        busy_stop(p);
        snprintf(a, sizeof a, "%.3f ms", t2 / 1e6);
        snprintf(b, sizeof b, "1 thread %.3f ms", t1 / 1e6);
        row(op, shape, "fp32", busy ? "2 busy" : "2", a, b, t1 / t2);
    }
}

static uint64_t rng_s = 88172645463325252ull;
static uint64_t rnd(void) {
    rng_s ^= rng_s << 13, rng_s ^= rng_s >> 7, rng_s ^= rng_s << 17;
    return rng_s;
}
// Mostly small, as tensors are (as bench_cache). part 0: all; 1: only the small ones (under 64
// KiB: the 70 % the caller draws from the small pool's bins of one size each); 2: only the others
// (1 to 50 MiB, the large pool's bins).
static uint64_t class_size(int part) {
    uint64_t r = part == 0 ? rnd() % 100 : part == 1 ? 0 : 70 + rnd() % 30;
    if (r < 70) return 512 + rnd() % (64 << 10);
    if (r < 95) return (1 << 20) + rnd() % (8 << 20);
    return (10 << 20) + rnd() % (40 << 20);
}
static uint64_t mixed_size(void) { return class_size(0); }

// Rows: the mixed workload with 10^3 to 10^6 live blocks, then at 10^6 its two parts alone (the
// small sizes, and the 1 to 50 MiB ones: the second costs more than a load that misses every
// cache, the first far less).
static void alloc_rows(void) {
    static const struct { uint64_t live; int part; const char *name; } rows[] = {
        {1000, 0, "mixed"}, {10000, 0, "mixed"}, {100000, 0, "mixed"}, {1000000, 0, "mixed"},
        {1000000, 1, "<64K"}, {1000000, 2, "1-50M"}};
    size_t li;
    for (li = 0; li < sizeof rows / sizeof rows[0]; li++) {
        mn_sim_cache sc;
        mn_simdev_desc dd;
        int part = rows[li].part;
        uint64_t n = rows[li].live, i, iters = 20000;
        void **live = (void **)malloc(n * sizeof *live), **h = (void **)malloc(n * sizeof *h);
        double tm[64], th[64], t0;
        char a[64], b[64], s[32];
        int r;
        memset(&dd, 0, sizeof dd);
        dd.capacity = 0;
        if (!live || !h || mn_sim_cache_init(&sc, &dd, NULL) != MN_OK) exit(1);
        for (i = 0; i < n; i++) {
            mn_cache_alloc(&sc.cache, mixed_size(), 0, MN_CAT_ACTIVATIONS, NULL, &live[i]);
            h[i] = malloc((size_t)(mixed_size() >> 10) + 16);
        }
        for (i = 0; i < n; i += 4) {  // holes: the free trees hold n/4 blocks
            mn_cache_release(&sc.cache, live[i]), live[i] = NULL;
            free(h[i]), h[i] = NULL;
        }
        for (r = 0; r < reps; r++) {
            uint64_t save = rng_s;
            t0 = bench_wall_ns();
            for (i = 0; i < iters; i++) {
                void *p = NULL;
                mn_cache_alloc(&sc.cache, class_size(part), 0, MN_CAT_ACTIVATIONS, NULL, &p);
                mn_cache_release(&sc.cache, p);
            }
            tm[r] = (bench_wall_ns() - t0) / (double)iters;
            rng_s = save;
            t0 = bench_wall_ns();
            for (i = 0; i < iters; i++) {
                void *p = malloc((size_t)(class_size(part) >> 10) + 16);
                *(volatile char *)p = 1;
                free(p);
            }
            th[r] = (bench_wall_ns() - t0) / (double)iters;
        }
        for (i = 0; i < n; i++) mn_cache_release(&sc.cache, live[i]), free(h[i]);
        mn_sim_cache_free(&sc);
        free(live), free(h);
        snprintf(s, sizeof s, "%llu live, %s", (unsigned long long)n, rows[li].name);
        t0 = bench_median(tm, reps);
        snprintf(a, sizeof a, "%.0f ns/pair", t0);
        snprintf(b, sizeof b, "glibc %.0f ns/pair", bench_median(th, reps));
        row("malloc+free", s, "-", "1", a, b, bench_median(th, reps) / t0);
    }
}

// estimate and fit of Llama-3-70B on an H100 at bf16 and seq 8192, and fit of the setup the CLI
// takes when given only the model and GPU (fp32, batch 1, seq 512: it does not fit, so the fit
// searches a plan, and confirms each step of it with the allocator replay).
static void est_rows(void) {
    mn_model m;
    mn_setup s, d;
    mn_estimate_result r;
    mn_fit_result f, fd;
    double te[64], tf[64], td[64], t0;
    char a[64];
    int i;
    memset(&s, 0, sizeof s);
    if (mn_preset_find("llama-3-70b", &m) != MN_OK) return;
    s.gpu = "h100-80gb", d = s;
    s.precision = MN_PREC_BF16, s.batch = 1, s.seq = 8192;
    for (i = 0; i < reps; i++) {
        t0 = bench_wall_ns();
        mn_estimate(&m, &s, &r);
        te[i] = (bench_wall_ns() - t0) / 1e6;
        t0 = bench_wall_ns();
        mn_fit(&m, &s, &f);
        tf[i] = (bench_wall_ns() - t0) / 1e6;
        t0 = bench_wall_ns();
        mn_fit(&m, &d, &fd);
        td[i] = (bench_wall_ns() - t0) / 1e6;
    }
    t0 = bench_median(te, reps);
    snprintf(a, sizeof a, "%.2f ms", t0);
    row("estimate", "llama-3-70b 8192", "bf16", "1", a, "target 10 ms", 10.0 / t0);
    t0 = bench_median(tf, reps);
    snprintf(a, sizeof a, "%.2f ms (%llu runs)", t0, (unsigned long long)f.estimates_run);
    row("fit", "llama-3-70b 8192", "bf16", "1", a, "target 10 ms", 10.0 / t0);
    t0 = bench_median(td, reps);
    snprintf(a, sizeof a, "%.2f ms (%llu runs)", t0, (unsigned long long)fd.estimates_run);
    row("fit, plan", "llama-3-70b 512", "fp32", "1", a, "target 10 ms", 10.0 / t0);
}

int main(int argc, char **argv) {
    char cpu[128], shape[64], a[64], b[64];
    double peak, bw, tm, tp, fl;
    int ncpu, th;
    opw k;
    uint64_t dims[2];
    size_t i, n;
    FILE *f;
    // Threads that spin after their work, on the cores that the next rows use; both variables
    // are read as the libraries load, so the program runs itself again with them set (unless the
    // user set them; no exec: on as it is).
    // - libgomp's, by default, as trainer.c avoids: with a child keeping a core busy, the member
    //   on that core spins between loops, and each 2-thread loop waited milliseconds for it to
    //   start (gelu backward and softmax forward on 2 threads 0.17 to 0.5 of 1 thread; with
    //   OMP_WAIT_POLICY=passive 0.97 to 1.8, and OpenBLAS's 2-thread matmul 1.2 to 1.4x faster).
    // - OpenBLAS's workers, for 2^28 cycles after each call (the header's 2-thread matmul read
    //   0.8 to 2.5 of OpenBLAS's from run to run): 2^4 cycles, asleep at once.
    {
        int again = 0;
#ifdef _OPENMP
        if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT"))
            again |= setenv("OMP_WAIT_POLICY", "passive", 1) == 0;
#endif
#ifdef MN_BENCH_CBLAS
        if (!getenv("OPENBLAS_THREAD_TIMEOUT"))
            again |= setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1) == 0;
#endif
        if (again) execv("/proc/self/exe", argv);
    }
    if (argc > 1) reps = atoi(argv[1]);
    if (reps < 1 || reps > 64) reps = 5;
    if (argc > 2) parts = argv[2];
    {
        const char *q = parts;
        while (*q) {
            size_t len = strcspn(q, ",");
            if (!list_has(PARTS, q, len)) {
                fprintf(stderr, "bench_table: unknown part '%.*s' (%s)\n", (int)len, q, PARTS);
                return 2;
            }
            q += len + (q[len] == ',');
        }
    }
    ncpu = bench_cpu_model(cpu, sizeof cpu);
    cpy_src = (char *)malloc(cpy_cap), cpy_dst = (char *)malloc(cpy_cap);
    if (!cpy_src || !cpy_dst) return 1;
    memset(cpy_src, 1, cpy_cap), memset(cpy_dst, 2, cpy_cap);
    f = fopen("/proc/loadavg", "r");
    if (f && fgets(a, sizeof a, f)) a[strcspn(a, "\n")] = 0;
    else snprintf(a, sizeof a, "?");
    if (f) fclose(f);
    set_threads(1);
    peak = fma_peak();
    {
        double t[64];
        int r;
        for (r = 0; r < reps; r++) t[r] = memcpy_ns(cpy_cap);
        bw = 2.0 * (double)cpy_cap / bench_median(t, reps);
    }
    printf("memanat %s CPU table on %s (%d CPUs), load %s, medians of %d runs\n", MEMANAT_VERSION,
           cpu, ncpu, a, reps);
    printf("OMP_WAIT_POLICY=%s\n", getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "-");
    printf("fp32 FMA peak, 1 thread: %.1f GFLOP/s; copy bandwidth (memcpy 64 MiB, bytes read + "
           "written): %.1f GB/s\n",
           peak, bw);
    printf("load latency (dependent loads at random lines of 256 MiB): %.0f ns\n",
           load_latency_ns());
#ifdef MN_BENCH_CBLAS
    printf("matmul peer: OpenBLAS cblas_sgemm\n\n");
#else
    printf("matmul peer: the FMA peak (built without OpenBLAS)\n\n");
#endif
    printf("%-18s %-18s %-5s %-7s %-22s %-26s %6s\n", "op", "shape", "dtype", "threads",
           "memanat", "peer", "ratio");

    memset(&k, 0, sizeof k);
    // matmul: GPT-2 small MLP up-projection, 1024 rows (B*T)
    k.N = 1024, k.C = 768, k.OC = 3072, k.V = 50304, k.B = 8, k.T = 1024;
    n = 8 * 1024 * 768;  // memory ops: [B*T, C] = 6.3M floats
    k.inp = fbuf(256 * k.V > n ? 256 * k.V : n), k.w = fbuf(k.OC * k.C);
    k.b = fbuf(k.OC), k.out = fbuf(256 * k.V > n ? 256 * k.V : n);
    k.dout = fbuf(k.N * k.OC), k.dinp = fbuf(k.N * k.C), k.dw = fbuf(k.OC * k.C);
    k.db = fbuf(k.OC), k.mean = fbuf(n), k.rstd = fbuf(n), k.p = fbuf(n), k.g = fbuf(n);
    k.tok = (int *)malloc(n * sizeof(int)), k.h16 = (uint16_t *)malloc(n * 2);
    if (!k.tok || !k.h16) return 1;
    for (i = 0; i < n; i++) k.tok[i] = (int)(rnd() % 50257);
    blas_rows = 1;
    for (th = 1; th <= 2 && want("matmul"); th++) {
        char ts[8];
        snprintf(ts, sizeof ts, "%d", th);
        snprintf(shape, sizeof shape, "%zux%zux%zu", k.N, k.C, k.OC);
        fl = 2.0 * (double)k.N * (double)k.C * (double)k.OC;
#ifdef MN_BENCH_CBLAS
        time_pair(w_mm_fwd, &k, th, w_blas_fwd, &k, th, &tm, &tp);
        snprintf(b, sizeof b, "openblas %.1f GFLOP/s", fl / tp);
#else
        tm = 0, time_pair(w_mm_fwd, &k, th, w_mm_fwd, &k, th, &tm, &tp);
        tp = fl / (peak * th), snprintf(b, sizeof b, "peak %.1f GFLOP/s", peak * th);
#endif
        snprintf(a, sizeof a, "%.1f GFLOP/s", fl / tm);
        row("matmul fwd", shape, "fp32", ts, a, b, tp / tm);
#ifdef MN_BENCH_CBLAS
        time_pair(w_mm_bwd, &k, th, w_blas_bwd, &k, th, &tm, &tp);
        snprintf(b, sizeof b, "openblas %.1f GFLOP/s", 2 * fl / tp);
#else
        time_pair(w_mm_bwd, &k, th, w_mm_bwd, &k, th, &tm, &tp);
        tp = 2 * fl / (peak * th), snprintf(b, sizeof b, "peak %.1f GFLOP/s", peak * th);
#endif
        snprintf(a, sizeof a, "%.1f GFLOP/s", 2 * fl / tm);
        row("matmul bwd (dx+dw)", shape, "fp32", ts, a, b, tp / tm);
    }
    set_threads(1), blas_rows = 0;
    if (want("matmul")) {  // (time for OpenBLAS's workers to go idle where they still spin)
        struct timespec ts = {0, 500000000};
        nanosleep(&ts, NULL);
    }

    dims[0] = 8 * 1024, dims[1] = 768;  // the optimizers' parameters (memory, threads)
    if (mn_adamw_init(&k.aw, dims, 2, NULL, NULL) != MN_OK) return 1;
    if (want("memory")) {
        k.N = 8 * 1024, k.C = 768;
        snprintf(shape, sizeof shape, "%zux%zu", k.N, k.C);
        mem_row("layernorm fwd", shape, &k, w_ln, 8.0 * (double)n, 0);
        mem_row("layernorm bwd", shape, &k, w_ln_bwd, 16.0 * (double)n, 0);
        mem_row("rmsnorm fwd", shape, &k, w_rms, 8.0 * (double)n, 0);
        mem_row("rmsnorm bwd", shape, &k, w_rms_bwd, 16.0 * (double)n, 0);
        mem_row("softmax fwd", shape, &k, w_sm, 8.0 * (double)n, 0);
        mem_row("softmax bwd", shape, &k, w_sm_bwd, 16.0 * (double)n, 0);
        mem_row("gelu fwd", shape, &k, w_gelu, 8.0 * (double)n, 0);
        mem_row("gelu bwd", shape, &k, w_gelu_bwd, 16.0 * (double)n, 0);
        k.N = 256, k.V = 50257;
        snprintf(shape, sizeof shape, "%zux%zu", k.N, k.V);
        mem_row("crossentropy fwd", shape, &k, w_ce, 8.0 * (double)(k.N * k.V), 0);
        mem_row("crossentropy bwd", shape, &k, w_ce_bwd, 12.0 * (double)(k.N * k.V), 0);
        k.N = 8 * 1024, k.C = 768, k.B = 8, k.T = 1024;
        snprintf(shape, sizeof shape, "%zux%zux%zu", k.B, k.T, k.C);
        mem_row("embedding fwd", shape, &k, w_emb, 12.0 * (double)n, 0);
        snprintf(shape, sizeof shape, "%zu params", n);
        mem_row("adamw", shape, &k, w_adamw, 28.0 * (double)n, (double)n);
        time_pair(w_adamw, &k, 1, w_llmc_adamw, &k, 1, &tm, &tp);
        snprintf(a, sizeof a, "%.2f ns/el", tm / (double)n);
        snprintf(b, sizeof b, "llm.c -Ofast %.2f ns/el", tp / (double)n);
        row("adamw vs llm.c", shape, "fp32", "1", a, b, tp / tm);
        {
            mn_sgd_params sp;
            memset(&sp, 0, sizeof sp);
            sp.momentum = 0.9f;
            if (mn_sgd_init(&k.sg, dims, 2, &sp, NULL) != MN_OK) return 1;
        }
        mem_row("sgd momentum", shape, &k, w_sgd, 20.0 * (double)n, (double)n);
        if (mn_lion_init(&k.li, dims, 2, NULL, NULL) != MN_OK) return 1;
        mem_row("lion", shape, &k, w_lion, 20.0 * (double)n, (double)n);
        if (mn_adamw8bit_init(&k.a8, dims, 2, NULL, NULL) != MN_OK) return 1;
        mem_row("adamw 8-bit", shape, &k, w_a8, 16.0 * (double)n, (double)n);
        if (mn_adafactor_init(&k.af, dims, 2, NULL, NULL) != MN_OK) return 1;
        mem_row("adafactor", shape, &k, w_af, 12.0 * (double)n, (double)n);
        snprintf(shape, sizeof shape, "%zu", n);
        mem_row("cast fp32->bf16", shape, &k, w_tobf16, 6.0 * (double)n, 0);
        mem_row("cast bf16->fp32", shape, &k, w_frombf16, 6.0 * (double)n, 0);
    }

    // threads: trainer-sized and training-sized ops, 2 threads against 1
    if (want("threads")) {
        k.N = 256, k.C = 64, k.OC = 256;
        thr_rows("matmul fwd", "256x64x256", &k, w_mm_fwd);
        k.N = 1024, k.C = 768, k.OC = 3072;
        thr_rows("matmul fwd", "1024x768x3072", &k, w_mm_fwd);
        k.N = 256, k.C = 64;
        thr_rows("layernorm fwd", "256x64", &k, w_ln);
        k.N = 8 * 1024, k.C = 768;
        thr_rows("layernorm fwd", "8192x768", &k, w_ln);
        thr_rows("layernorm bwd", "8192x768", &k, w_ln_bwd);
        thr_rows("softmax fwd", "8192x768", &k, w_sm);
        thr_rows("gelu bwd", "8192x768", &k, w_gelu_bwd);
        thr_rows("adamw", "6291456 params", &k, w_adamw);
    }

    if (want("alloc")) alloc_rows();
    if (want("fit")) est_rows();
    set_threads(1);
    return 0;
}
