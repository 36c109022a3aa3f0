// Test runner: ./build/test_all [substring]  runs every test whose "suite/name" contains it.
// MN_TEST_STRICT=1 (CI) counts a skipped test as failed: every test must run in every pass, but
// for the tests of optional toolchains (SKIP_OPTIONAL: the Python and browser bindings).
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

// harness.h brought in the declarations; here the implementation, allocating through the harness.
#define MN_MALLOC(sz) mnt_malloc(sz)
#define MN_FREE(p) mnt_free(p)
#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"

typedef struct mnt_suite {
    const char *name;
    const mnt_case *cases;
    const size_t *count;
} mnt_suite;

#define MNT_DECLARE(s) extern const mnt_case test_##s##_cases[]; extern const size_t test_##s##_count;
MNT_DECLARE(types)
MNT_DECLARE(json)
MNT_DECLARE(estimate)
MNT_DECLARE(quantseq)
MNT_DECLARE(hfconfig)
MNT_DECLARE(cli)
MNT_DECLARE(cache)
MNT_DECLARE(cachediff)
MNT_DECLARE(optim)
MNT_DECLARE(ops)
MNT_DECLARE(trainer)
MNT_DECLARE(cudamath)
MNT_DECLARE(gpu_trainer)
MNT_DECLARE(bindings)

static const mnt_suite suites[] = {
    {"types", test_types_cases, &test_types_count},
    {"json", test_json_cases, &test_json_count},
    {"estimate", test_estimate_cases, &test_estimate_count},
    {"quantseq", test_quantseq_cases, &test_quantseq_count},
    {"hfconfig", test_hfconfig_cases, &test_hfconfig_count},
    {"cli", test_cli_cases, &test_cli_count},
    {"cache", test_cache_cases, &test_cache_count},
    {"cachediff", test_cachediff_cases, &test_cachediff_count},
    {"optim", test_optim_cases, &test_optim_count},
    {"ops", test_ops_cases, &test_ops_count},
    {"trainer", test_trainer_cases, &test_trainer_count},
    {"cudamath", test_cudamath_cases, &test_cudamath_count},
    {"gpu_trainer", test_gpu_trainer_cases, &test_gpu_trainer_count},
    {"bindings", test_bindings_cases, &test_bindings_count},
};

static int cur_failed, cur_skipped, cur_skip_optional;
static char cur_skip_reason[256];
static long live_allocs, total_allocs, fail_after;
static uint64_t rng_state, seed_value;

void mnt_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    if (cur_failed < 8) {
        printf("[FAIL] %s:%d ", file, line);
        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
        printf("\n");
    }
    cur_failed++;
}

void mnt_skip(const char *reason) {
    cur_skipped = 1;
    snprintf(cur_skip_reason, sizeof cur_skip_reason, "%s", reason);
}

void mnt_skip_optional(const char *reason) {
    mnt_skip(reason);
    cur_skip_optional = 1;
}

int mnt_failed(void) { return cur_failed; }

// Counting host allocator; fail_after injects a failure into the n-th allocation.
void *mnt_malloc(size_t size) {
    if (fail_after > 0 && --fail_after == 0) return NULL;
    live_allocs++, total_allocs++;
    return malloc(size ? size : 1);
}

void mnt_free(void *p) {
    if (!p) return;
    live_allocs--;
    free(p);
}

void mnt_fail_alloc_after(long n) { fail_after = n; }

const char *mnt_cli_path(void) {
    const char *p = getenv("MEMANAT_BIN");
    return p && *p ? p : "./memanat";
}
int mnt_cli_run(const char *args, char *out, size_t out_cap, char *err, size_t err_cap,
                int *status) {
    char cmd[2048], errpath[] = "/tmp/memanat_cli_XXXXXX";
    FILE *p, *e;
    size_t n;
    int fd = mkstemp(errpath), st;
    out[0] = err[0] = 0, *status = -1;
    if (fd < 0) return 0;
    close(fd);
    snprintf(cmd, sizeof cmd, "%s %s 2>%s", mnt_cli_path(), args, errpath);
    if (!(p = popen(cmd, "r"))) {
        remove(errpath);
        return 0;
    }
    n = fread(out, 1, out_cap - 1, p);
    out[n] = 0;
    st = pclose(p);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if ((e = fopen(errpath, "r")) != NULL) {
        n = fread(err, 1, err_cap - 1, e);
        err[n] = 0;
        fclose(e);
    }
    remove(errpath);
    return 1;
}
long mnt_live_allocs(void) { return live_allocs; }
long mnt_total_allocs(void) { return total_allocs; }

uint64_t mnt_rand_u64(void) {  // splitmix64
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double mnt_rand_uniform(void) { return (double)(mnt_rand_u64() >> 11) * (1.0 / 9007199254740992.0); }

double mnt_rand_normal(void) {
    double u1 = mnt_rand_uniform(), u2 = mnt_rand_uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t mnt_seed(void) { return seed_value; }

static int env_on(const char *name) {
    const char *v = getenv(name);
    return v && *v && *v != '0';
}

int mnt_verbose(void) { return env_on("MN_TEST_VERBOSE") || env_on("MN_OPS_VERBOSE"); }

// ---- shared helpers ------------------------------------------------------------------------------

static void *host_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) {
        fprintf(stderr, "test harness: out of host memory for %zu elements\n", n);
        abort();
    }
    return p;
}

float *mnt_fvec(size_t n) { return (float *)host_calloc(n, sizeof(float)); }
double *mnt_dvec(size_t n) { return (double *)host_calloc(n, sizeof(double)); }

void mnt_fill_normal(float *x, size_t n, double scale) {
    size_t i;
    for (i = 0; i < n; i++) x[i] = (float)(scale * mnt_rand_normal());
}

void mnt_to_double(const float *x, double *y, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) y[i] = x[i];
}

double mnt_lanes_total(const double *lane) {
    double t[16];
    int w, l;
    for (l = 0; l < 16; l++) t[l] = lane[l];
    for (w = 8; w >= 1; w /= 2)
        for (l = 0; l < w; l++) t[l] = t[l] + t[l + w];
    return t[0];
}

// A NaN, once seen, stays the maximum (so it shows in the report).
static double max_nan(double m, double v) { return m != m || v <= m ? m : v; }

void mnt_check_close(const char *file, int line, const char *what, const float *got,
                     const double *want, size_t n, double abs_tol, double rel_tol) {
    double max_abs = 0.0, max_rel = 0.0, max_want = 0.0, worst_excess = 0.0;
    size_t i, bad = 0, worst = 0;
    for (i = 0; i < n; i++) {
        double w = fabs(want[i]), d = fabs((double)got[i] - want[i]), lim = abs_tol + rel_tol * w;
        if (w > max_want) max_want = w;
        max_abs = max_nan(max_abs, d);
        if (!(d == 0.0)) max_rel = max_nan(max_rel, d / w);  // want 0: inf
        if (!(d <= lim)) {  // NaN is off too; the worst is the largest excess, a NaN first
            double excess = d - lim;
            if (bad == 0 || (worst_excess == worst_excess && !(excess <= worst_excess)))
                worst_excess = excess, worst = i;
            bad++;
        }
    }
    if (mnt_verbose())
        printf("  %-34s n=%-5zu max abs err %.3g, max rel err %.3g, max|want| %.3g\n", what, n,
               max_abs, max_rel, max_want);
    if (bad)
        mnt_fail(file, line, "%s: %zu of %zu off, worst [%zu] got %.9g want %.9g; max abs err "
                 "%.3g, max rel err %.3g, max|want| %.3g; tol abs %.3g rel %.3g", what, bad, n,
                 worst, (double)got[worst], want[worst], max_abs, max_rel, max_want, abs_tol,
                 rel_tol);
}

void mnt_check_close_scaled(const char *file, int line, const char *what, const float *got,
                            const double *want, size_t n, double tol) {
    double scale = 1.0;
    size_t i;
    for (i = 0; i < n; i++) scale = fabs(want[i]) > scale ? fabs(want[i]) : scale;
    mnt_check_close(file, line, what, got, want, n, tol * scale, 0.0);
}

long mnt_walk_alloc_failures(const char *file, int line, mnt_alloc_fn fn, void *ctx, long max) {
    long n;
    for (n = 1; n <= max; n++) {
        long live = live_allocs;
        mn_result r;
        fail_after = n;
        r = fn(ctx);
        fail_after = 0;
        if (r != MN_OK && r != MN_ERR_OUT_OF_MEMORY)
            mnt_fail(file, line, "attempt %ld (allocation %ld fails): got result %d want %d", n, n,
                     (int)r, (int)MN_ERR_OUT_OF_MEMORY);
        if (live_allocs != live)
            mnt_fail(file, line, "attempt %ld (result %d): host allocations got %ld live want %ld", n,
                     (int)r, live_allocs, live);
        if (r == MN_OK) return n;
    }
    mnt_fail(file, line, "no success within %ld attempts", max);
    return 0;
}

static void *counting_alloc(void *user_data, size_t size) {
    mnt_counting *c = (mnt_counting *)user_data;
    void *p = mnt_malloc(size);
    if (p) c->bytes += size, c->allocs++;
    return p;
}

static void counting_free(void *user_data, void *p) {
    ((mnt_counting *)user_data)->frees++;
    mnt_free(p);
}

mn_allocator mnt_counting_allocator(mnt_counting *c) {
    mn_allocator a;
    memset(c, 0, sizeof *c);
    a.alloc_fn = counting_alloc;
    a.free_fn = counting_free;
    a.user_data = c;
    return a;
}

void mnt_log_capture(void *user_data, mn_log_level level, const char *msg) {
    mnt_log *lg = (mnt_log *)user_data;
    CHECK(msg && msg[0]);
    snprintf(lg->last, sizeof lg->last, "%s", msg ? msg : "");
    lg->count++;
    if (level == MN_LOG_ERROR) lg->errors++;
    if (level == MN_LOG_WARN) lg->warnings++;
}

void mnt_buf_put(mnt_buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *q = (char *)realloc(b->p, cap);
        if (!q) {
            fprintf(stderr, "test harness: out of host memory for %zu bytes of text\n", cap);
            abort();
        }
        b->p = q, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void mnt_buf_str(mnt_buf *b, const char *s) { mnt_buf_put(b, s, strlen(s)); }

mn_result mnt_buf_write(void *user_data, const char *data, size_t len) {
    mnt_buf_put((mnt_buf *)user_data, data, len);
    return MN_OK;
}

int main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    const char *env = getenv("MN_TEST_SEED");
    int passed = 0, failed = 0, skipped = 0, strict = env_on("MN_TEST_STRICT");
    size_t s, i;
    char full[160];
    seed_value = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    printf("memanat tests, seed %llu (MN_TEST_SEED=%llu repeats it)\n",
           (unsigned long long)seed_value, (unsigned long long)seed_value);
    for (s = 0; s < sizeof suites / sizeof suites[0]; s++) {
        for (i = 0; i < *suites[s].count; i++) {
            const mnt_case *c = &suites[s].cases[i];
            long live_before;
            snprintf(full, sizeof full, "%s/%s", suites[s].name, c->name);
            if (filter && !strstr(full, filter)) continue;
            cur_failed = 0, cur_skipped = 0, cur_skip_optional = 0, fail_after = 0;
            rng_state = seed_value ^ (uint64_t)(s * 1000003u + i * 7919u);
            live_before = live_allocs;
            c->fn();
            fail_after = 0;
            if (live_allocs != live_before) {
                mnt_fail(__FILE__, __LINE__, "host allocations got %ld live want %ld", live_allocs, live_before);
                live_allocs = live_before;
            }
            if (cur_skipped && strict && !cur_skip_optional) {  // CI: a test that cannot run
                printf("[FAIL] %s: skipped under MN_TEST_STRICT: %s\n", full, cur_skip_reason);
                failed++;
            } else if (cur_failed) {
                printf("[FAIL] %s\n", full);
                failed++;
            } else if (cur_skipped) {
                printf("[SKIP] %s: %s\n", full, cur_skip_reason);
                skipped++;
            } else {
                printf("[ OK ] %s\n", full);
                passed++;
            }
            fflush(stdout);
        }
    }
    if (skipped) printf("%d skipped (the [SKIP] lines above say why)\n", skipped);
    printf("%d passed, %d failed\n", passed, failed);  // always the last line
    return failed ? 1 : 0;
}
