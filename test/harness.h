// Tiny test harness: one line per test ([ OK ], [FAIL] file:line got X want Y, [SKIP] reason),
// tests registered in explicit tables, last line "N passed, N failed", exit 1 on any failure.
// Every test also checks that the library freed every host allocation it made. Below the runner:
// helpers the suites share (host arrays, random fills, array comparison, allocation-failure walks,
// a counting allocator, log capture, a text buffer).
#ifndef MN_TEST_HARNESS_H
#define MN_TEST_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../memanat.h"  // declarations only; test/main.c instantiates it

typedef struct mnt_case {
    const char *name;
    void (*fn)(void);
} mnt_case;

// Results of the running test.
void mnt_fail(const char *file, int line, const char *fmt, ...);
void mnt_skip(const char *reason);
// A skip that MN_TEST_STRICT (CI) accepts: a test of an optional toolchain (Python, a browser)
// that this machine or this pass does not have. Every other skip fails a strict run.
void mnt_skip_optional(const char *reason);
int mnt_failed(void);

// Host allocation accounting: the library's MN_MALLOC/MN_FREE go through these in the test
// build. mnt_fail_alloc_after(n) makes the n-th following allocation fail (n >= 1); 0 turns it off.
void *mnt_malloc(size_t size);
void mnt_free(void *p);
void mnt_fail_alloc_after(long n);
long mnt_live_allocs(void);
long mnt_total_allocs(void);

// The CLI under test: ./memanat, or $MEMANAT_BIN (the sanitizer build runs its own).
const char *mnt_cli_path(void);
// Runs `<cli> ARGS`: stdout into out, stderr (through a temporary file) into err, both
// NUL-terminated and cut at their capacity; *status the exit status, -1 if it did not exit
// normally. 0 when the command could not be started.
int mnt_cli_run(const char *args, char *out, size_t out_cap, char *err, size_t err_cap,
                int *status);

// Fresh random numbers for every run; MN_TEST_SEED=N repeats a run. Printed on the first line.
uint64_t mnt_rand_u64(void);
double mnt_rand_uniform(void);  // [0, 1)
double mnt_rand_normal(void);
uint64_t mnt_seed(void);

// MN_TEST_VERBOSE=1 (or the older MN_OPS_VERBOSE=1): print the error of every close comparison.
int mnt_verbose(void);

// ---- shared helpers ------------------------------------------------------------------------------

// Zeroed host arrays of n elements (1 when n is 0, so the pointer is always valid), for the test's
// own data: release with free(). Out of host memory aborts the run.
float *mnt_fvec(size_t n);
double *mnt_dvec(size_t n);

// x[i] = scale * N(0, 1), from the run's random stream.
void mnt_fill_normal(float *x, size_t n, double scale);

// y[i] = x[i], the fp32 values widened for a double-precision reference.
void mnt_to_double(const float *x, double *y, size_t n);

// The Adafactor step's fixed summation order over its 16 double lanes (lane l holds the terms of
// the columns j % 16 == l in row order): lane w added to lane l for w = 8, 4, 2, 1, so
// ((l0 + l8) + (l4 + l12)) + ... Tests that must give the step's bits sum in this order.
double mnt_lanes_total(const double *lane);

// fp32 results against a double reference: every element must satisfy
//     |got[i] - want[i]| <= abs_tol + rel_tol * |want[i]|      (NaN fails)
// One failure line per call: how many elements are off, the worst one (largest excess over its
// bound) with its index, got and want, and over the whole array the max abs error, the max rel
// error |got - want| / |want| and max |want|. With mnt_verbose() passing checks print the errors.
void mnt_check_close(const char *file, int line, const char *what, const float *got,
                     const double *want, size_t n, double abs_tol, double rel_tol);
// The same with a tolerance relative to the array's scale: |got[i] - want[i]| <= tol * max(1,
// max |want|) for every i (abs_tol = tol * max(1, max |want|), rel_tol = 0 above).
void mnt_check_close_scaled(const char *file, int line, const char *what, const float *got,
                            const double *want, size_t n, double tol);
#define CHECK_CLOSE(what, got, want, n, abs_tol, rel_tol) \
    mnt_check_close(__FILE__, __LINE__, what, got, want, n, abs_tol, rel_tol)
#define CHECK_CLOSE_SCALED(what, got, want, n, tol) \
    mnt_check_close_scaled(__FILE__, __LINE__, what, got, want, n, tol)

// Walks every host allocation failure of one operation. For n = 1, 2, ..., max it makes the n-th
// allocation fail (mnt_fail_alloc_after(n)) and calls fn(ctx), which runs the operation once,
// checks its outputs when it succeeds, frees them and returns the operation's result. Asserts that
// each attempt that does not succeed returns MN_ERR_OUT_OF_MEMORY, that every attempt leaves the
// live host allocations where they were, and that an attempt succeeds within max. The failure stays
// armed while fn runs, so what fn does after the operation must not allocate through the library.
// Returns the attempt that succeeded (the operation's allocation count + 1), 0 when none did.
typedef mn_result (*mnt_alloc_fn)(void *ctx);
long mnt_walk_alloc_failures(const char *file, int line, mnt_alloc_fn fn, void *ctx, long max);
#define WALK_ALLOC_FAILURES(fn, ctx, max) mnt_walk_alloc_failures(__FILE__, __LINE__, fn, ctx, max)

// A caller's allocator (mn_allocator) that counts what the library asks for. It allocates through
// mnt_malloc, so the harness's accounting and failure injection reach it. bytes and allocs count
// successful allocations, frees every call of the free function.
typedef struct mnt_counting {
    uint64_t bytes;
    long allocs, frees;
} mnt_counting;
mn_allocator mnt_counting_allocator(mnt_counting *c);  // zeroes *c

// A logger (mn_logger) that keeps the last message and counts them by level; every message must be
// non-empty. Zero the struct before the call whose messages you want to see.
typedef struct mnt_log {
    char last[512];
    int count, errors, warnings;
} mnt_log;
void mnt_log_capture(void *user_data, mn_log_level level, const char *msg);

// Growable NUL-terminated text, starting from {NULL, 0, 0}; release b.p with free(). Out of host
// memory aborts the run. mnt_buf_write, an mn_cache_write_fn, appends to the mnt_buf it is given.
typedef struct mnt_buf {
    char *p;
    size_t n, cap;
} mnt_buf;
void mnt_buf_put(mnt_buf *b, const char *s, size_t n);
void mnt_buf_str(mnt_buf *b, const char *s);
mn_result mnt_buf_write(void *user_data, const char *data, size_t len);

#define CHECK(c) do { if (!(c)) mnt_fail(__FILE__, __LINE__, "%s is false", #c); } while (0)
#define CHECK_MSG(c, ...) do { if (!(c)) mnt_fail(__FILE__, __LINE__, __VA_ARGS__); } while (0)
#define CHECK_OK(expr) do { int mnt_r_ = (int)(expr); \
    if (mnt_r_ != 0) mnt_fail(__FILE__, __LINE__, "%s got result %d want 0", #expr, mnt_r_); } while (0)
#define CHECK_ERR(expr, want) do { int mnt_r_ = (int)(expr); \
    if (mnt_r_ != (int)(want)) mnt_fail(__FILE__, __LINE__, "%s got result %d want %d", #expr, mnt_r_, (int)(want)); } while (0)
#define CHECK_EQ_U64(got, want) do { unsigned long long mnt_g_ = (unsigned long long)(got), mnt_w_ = (unsigned long long)(want); \
    if (mnt_g_ != mnt_w_) mnt_fail(__FILE__, __LINE__, "%s got %llu want %llu", #got, mnt_g_, mnt_w_); } while (0)
#define CHECK_EQ_INT(got, want) do { long long mnt_g_ = (long long)(got), mnt_w_ = (long long)(want); \
    if (mnt_g_ != mnt_w_) mnt_fail(__FILE__, __LINE__, "%s got %lld want %lld", #got, mnt_g_, mnt_w_); } while (0)
#define CHECK_STR(got, want) do { const char *mnt_g_ = (got), *mnt_w_ = (want); \
    if (!mnt_g_ || strcmp(mnt_g_, mnt_w_) != 0) mnt_fail(__FILE__, __LINE__, "%s got \"%s\" want \"%s\"", #got, mnt_g_ ? mnt_g_ : "(null)", mnt_w_); } while (0)
// |got - want| <= abs_tol + rel_tol * |want|
#define CHECK_NEAR(got, want, abs_tol, rel_tol) do { double mnt_g_ = (double)(got), mnt_w_ = (double)(want); \
    double mnt_d_ = mnt_g_ - mnt_w_; if (mnt_d_ < 0) mnt_d_ = -mnt_d_; \
    if (!(mnt_d_ <= (abs_tol) + (rel_tol) * (mnt_w_ < 0 ? -mnt_w_ : mnt_w_))) \
        mnt_fail(__FILE__, __LINE__, "%s got %.9g want %.9g (diff %.3g)", #got, mnt_g_, mnt_w_, mnt_d_); } while (0)
#define SKIP(reason) do { mnt_skip(reason); return; } while (0)
#define SKIP_OPTIONAL(reason) do { mnt_skip_optional(reason); return; } while (0)

#endif
