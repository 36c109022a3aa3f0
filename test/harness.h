// Tiny test harness: one line per test ([ OK ], [FAIL] file:line got X want Y, [SKIP] reason),
// tests registered in explicit tables, last line "N passed, N failed", exit 1 on any failure.
// Every test also checks that the library freed every host allocation it made.
#ifndef MN_TEST_HARNESS_H
#define MN_TEST_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct mnt_case {
    const char *name;
    void (*fn)(void);
} mnt_case;

// Results of the running test.
void mnt_fail(const char *file, int line, const char *fmt, ...);
void mnt_skip(const char *reason);
int mnt_failed(void);

// Host allocation accounting: the library's MN_MALLOC/MN_FREE go through these in the test
// build. mnt_fail_alloc_after(n) makes the n-th following allocation fail (n >= 1); 0 turns it off.
void *mnt_malloc(size_t size);
void mnt_free(void *p);
void mnt_fail_alloc_after(long n);
long mnt_live_allocs(void);
long mnt_total_allocs(void);

// Fresh random numbers for every run; MN_TEST_SEED=N repeats a run. Printed on the first line.
uint64_t mnt_rand_u64(void);
double mnt_rand_uniform(void);  // [0, 1)
double mnt_rand_normal(void);
uint64_t mnt_seed(void);

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

#endif
