// Test runner: ./build/test_all [substring]  runs every test whose "suite/name" contains it.
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

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
MNT_DECLARE(hfconfig)
MNT_DECLARE(cli)
MNT_DECLARE(cache)
MNT_DECLARE(optim)
MNT_DECLARE(ops)

static const mnt_suite suites[] = {
    {"types", test_types_cases, &test_types_count},
    {"json", test_json_cases, &test_json_count},
    {"estimate", test_estimate_cases, &test_estimate_count},
    {"hfconfig", test_hfconfig_cases, &test_hfconfig_count},
    {"cli", test_cli_cases, &test_cli_count},
    {"cache", test_cache_cases, &test_cache_count},
    {"optim", test_optim_cases, &test_optim_count},
    {"ops", test_ops_cases, &test_ops_count},
};

static int cur_failed, cur_skipped;
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

int main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    const char *env = getenv("MN_TEST_SEED");
    int passed = 0, failed = 0, skipped = 0;
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
            cur_failed = 0, cur_skipped = 0, fail_after = 0;
            rng_state = seed_value ^ (uint64_t)(s * 1000003u + i * 7919u);
            live_before = live_allocs;
            c->fn();
            fail_after = 0;
            if (live_allocs != live_before) {
                mnt_fail(__FILE__, __LINE__, "host allocations got %ld live want %ld", live_allocs, live_before);
                live_allocs = live_before;
            }
            if (cur_failed) {
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
    if (skipped) printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
