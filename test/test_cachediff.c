// Differential test of the caching allocator: long random traces run through memanat.h's
// allocator and through the reference copy of its earlier algorithm (test/cache_ref.h: one treap
// per pool, keyed (stream, size, address) like PyTorch's std::set), each over a simulated device
// of its own. Every returned address and result code, every statistic after every call, every
// out-of-memory message and, every few calls, the whole snapshot (segments, blocks, history)
// must be the same: the free-block index may change, the decisions may not.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "../memanat.h"
#include "cache_ref.h"

#define MIB (1024ull * 1024ull)

typedef struct cd_pair {
    mn_simdev dev_a, dev_b;  // a: memanat.h, b: the reference
    mn_cache a;
    mr_cache b;
    int open;
} cd_pair;

// memanat.h's host memory comes filled with a pattern, as reused memory can be: what its
// allocator reads must have been set by it (the bins of a pool are set as they are first used).
static void *cd_dirty_alloc(void *user_data, size_t n) {
    void *q = malloc(n);
    (void)user_data;
    if (q) memset(q, 0xA5, n);
    return q;
}

static void cd_dirty_free(void *user_data, void *q) {
    (void)user_data;
    free(q);
}

static mn_result cd_open(cd_pair *p, uint64_t capacity, const char *config, uint32_t trace) {
    mn_simdev_desc dd;
    mn_cache_desc cd;
    mn_result r;
    memset(p, 0, sizeof *p);
    memset(&dd, 0, sizeof dd);
    dd.capacity = capacity;
    if ((r = mn_simdev_init(&p->dev_a, &dd)) != MN_OK) return r;
    if ((r = mn_simdev_init(&p->dev_b, &dd)) != MN_OK) return r;
    memset(&cd, 0, sizeof cd);
    cd.config = config;
    cd.trace_entries = trace;
    cd.device = mn_simdev_device(&p->dev_a);
    cd.allocator.alloc_fn = cd_dirty_alloc, cd.allocator.free_fn = cd_dirty_free;
    if ((r = mn_cache_init(&p->a, &cd)) != MN_OK) return r;
    memset(&cd.allocator, 0, sizeof cd.allocator);
    cd.device = mn_simdev_device(&p->dev_b);
    if ((r = mr_cache_init(&p->b, &cd)) != MN_OK) return r;
    p->open = 1;
    return MN_OK;
}

static void cd_close(cd_pair *p) {
    mn_cache_free(&p->a);
    mr_cache_free(&p->b);
    CHECK_EQ_U64(p->dev_a.used, 0);
    CHECK_EQ_U64(p->dev_b.used, 0);
    mn_simdev_free(&p->dev_a);
    mn_simdev_free(&p->dev_b);
}

// Statistics, device counters and the OOM message: equal after every call.
static int cd_same_state(cd_pair *p) {
    struct mn_cache_stats sa, sb;
    char ma[768], mb[768];
    int same = 1;
    CHECK_OK(mn_cache_stats(&p->a, &sa));
    CHECK_OK(mr_cache_stats(&p->b, &sb));
    same &= memcmp(&sa, &sb, sizeof sa) == 0;
    mn_cache_oom_message(&p->a, ma, sizeof ma);
    mr_cache_oom_message(&p->b, mb, sizeof mb);
    same &= strcmp(ma, mb) == 0;
    same &= p->dev_a.used == p->dev_b.used && p->dev_a.alloc_calls == p->dev_b.alloc_calls &&
            p->dev_a.free_calls == p->dev_b.free_calls &&
            p->dev_a.map_calls == p->dev_b.map_calls &&
            p->dev_a.unmap_calls == p->dev_b.unmap_calls &&
            p->dev_a.event_count == p->dev_b.event_count;
    return same;
}

// The snapshots: every segment, block (address, size, state, requested bytes, category, label)
// and history entry.
static int cd_same_snapshot(cd_pair *p) {
    mn_cache_snapshot sa, sb;
    int same = 1;
    uint64_t i;
    CHECK_OK(mn_cache_snapshot_take(&p->a, &sa));
    CHECK_OK(mr_cache_snapshot_take(&p->b, &sb));
    same &= sa.segment_count == sb.segment_count && sa.block_count == sb.block_count &&
            sa.trace_count == sb.trace_count && sa.trace_dropped == sb.trace_dropped;
    for (i = 0; same && i < sa.segment_count; i++) {  // field by field: structs have padding
        const mn_segment_info *x = &sa.segments[i], *y = &sb.segments[i];
        same &= x->addr == y->addr && x->total_size == y->total_size &&
                x->allocated_size == y->allocated_size && x->active_size == y->active_size &&
                x->requested_size == y->requested_size && x->stream == y->stream &&
                x->is_small == y->is_small && x->is_expandable == y->is_expandable &&
                x->first_block == y->first_block && x->block_count == y->block_count;
    }
    for (i = 0; same && i < sa.block_count; i++)
        same &= memcmp(&sa.blocks[i], &sb.blocks[i], sizeof sa.blocks[i]) == 0;
    for (i = 0; same && i < sa.trace_count; i++) {
        const mn_trace_entry *x = &sa.trace[i], *y = &sb.trace[i];
        same &= x->action == y->action && x->category == y->category && x->stream == y->stream &&
                x->addr == y->addr && x->size == y->size && x->block_size == y->block_size &&
                x->time == y->time;
    }
    same &= memcmp(sa.base_cat_allocated, sb.base_cat_allocated, sizeof sa.base_cat_allocated) ==
            0 && sa.base_reserved == sb.base_reserved;
    same &= memcmp(&sa.stats, &sb.stats, sizeof sa.stats) == 0;
    mn_cache_snapshot_free(&sa);
    mn_cache_snapshot_free(&sb);
    return same;
}

// Sizes of every kind: small-pool blocks, large-pool blocks below and above 10 MiB (one segment
// each), oversize ones, sizes that are not multiples of 512 and a few tiny ones.
static uint64_t cd_size(void) {
    uint64_t r = mnt_rand_u64() % 100;
    if (r < 3) return 1 + mnt_rand_u64() % 600;
    if (r < 55) return 512 + mnt_rand_u64() % (1 * MIB);
    if (r < 80) return MIB + mnt_rand_u64() % (9 * MIB);
    if (r < 95) return 10 * MIB + mnt_rand_u64() % (60 * MIB);
    return 64 * MIB + mnt_rand_u64() % (200 * MIB);
}

// Streams: a few, among them ids far apart (the free-block order is stream first).
static mn_stream cd_stream(void) {
    static const mn_stream s[6] = {0, 1, 2, 7, 1000, 0xFFFFFFFFu};
    uint64_t r = mnt_rand_u64() % 10;
    return r < 5 ? 0 : s[mnt_rand_u64() % 6];
}

#define CD_LIVE 512

// uses_from: the step from which blocks get uses on other streams (before it, no release waits
// for an event: the allocator keeps the active statistics as copies of the allocated ones);
// every: the statistics are compared every this many steps (reading them is no step between).
static void cd_run(const char *config, uint64_t capacity, double fraction, int steps,
                   int uses_from, int every) {
    cd_pair p;
    void *live[CD_LIVE];
    char name[48];
    uint64_t nlive = 0;
    int i, diverged = 0, ooms = 0;
    CHECK_OK(cd_open(&p, capacity, config, 300));
    if (!p.open) return;
    if (fraction > 0.0) {
        CHECK_OK(mn_cache_set_memory_fraction(&p.a, fraction));
        CHECK_OK(mr_cache_set_memory_fraction(&p.b, fraction));
    }
    for (i = 0; i < steps && !diverged; i++) {
        uint64_t r = mnt_rand_u64() % 1000;
        if (r < 520 || nlive == 0) {  // allocate
            uint64_t size = cd_size();
            mn_stream s = cd_stream();
            mn_category cat = (mn_category)(mnt_rand_u64() % MN_CAT_COUNT);
            // a label of its own for each block, some cut short: a block shown with another
            // block's label fails
            const char *stem = mnt_rand_u64() % 4 ? "h." : "h.0.mlp.c_fc.output.grad:";
            const char *label = mnt_rand_u64() % 2 ? name : NULL;
            void *pa = NULL, *pb = NULL;
            snprintf(name, sizeof name, "%s%d", stem, i);
            mn_result ra = mn_cache_alloc(&p.a, size, s, cat, label, &pa);
            mn_result rb = mr_cache_alloc(&p.b, size, s, cat, label, &pb);
            if (ra != rb || pa != pb) {
                CHECK_MSG(0, "%s step %d: alloc of %llu on stream %u: %d %p, reference %d %p",
                          config, i, (unsigned long long)size, s, (int)ra, pa, (int)rb, pb);
                diverged = 1;
            }
            if (ra == MN_ERR_DEVICE_OOM) ooms++;
            if (ra == MN_OK && pa) {
                if (nlive < CD_LIVE) {
                    live[nlive++] = pa;
                } else {  // full: the oldest goes
                    CHECK_OK(mn_cache_release(&p.a, live[0]));
                    CHECK_OK(mr_cache_release(&p.b, live[0]));
                    live[0] = pa;
                }
            }
        } else if (r < 940) {  // release a random live block
            uint64_t k = mnt_rand_u64() % nlive;
            CHECK_OK(mn_cache_release(&p.a, live[k]));
            CHECK_OK(mr_cache_release(&p.b, live[k]));
            live[k] = live[--nlive];
        } else if (r < 965) {  // a use on another stream: the release waits for an event
            uint64_t k = mnt_rand_u64() % nlive;
            if (i < uses_from) continue;
            mn_stream s = cd_stream();
            CHECK_OK(mn_cache_record_stream(&p.a, live[k], s));
            CHECK_OK(mr_cache_record_stream(&p.b, live[k], s));
        } else if (r < 980) {  // some recorded events complete
            mn_stream s = cd_stream();
            mn_simdev_sync_stream(&p.dev_a, s);
            mn_simdev_sync_stream(&p.dev_b, s);
        } else if (r < 988) {  // the device fails one of the next allocations
            uint64_t n = 1 + mnt_rand_u64() % 3;
            mn_simdev_fail_alloc_at(&p.dev_a, n);
            mn_simdev_fail_alloc_at(&p.dev_b, n);
        } else if (r < 994) {
            CHECK_OK(mn_cache_empty(&p.a));
            CHECK_OK(mr_cache_empty(&p.b));
        } else if (r < 997) {
            mn_cache_reset_peak_stats(&p.a);
            mr_cache_reset_peak_stats(&p.b);
        } else {
            mn_cache_reset_accumulated_stats(&p.a);
            mr_cache_reset_accumulated_stats(&p.b);
        }
        if (!diverged && i % every == 0 && !cd_same_state(&p)) {
            CHECK_MSG(0, "%s step %d: statistics, device counters or OOM message differ", config,
                      i);
            diverged = 1;
        }
        if (!diverged && (i % 97 == 0 || i == steps - 1)) {
            if (!cd_same_snapshot(&p)) {
                CHECK_MSG(0, "%s step %d: snapshots differ", config, i);
                diverged = 1;
            }
            CHECK_OK(mn_cache_check(&p.a));
        }
    }
    if (diverged) {  // the two hold different blocks now: just give everything back
        mn_cache_free(&p.a);
        mr_cache_free(&p.b);
        mn_simdev_free(&p.dev_a);
        mn_simdev_free(&p.dev_b);
        return;
    }
    if (capacity) CHECK_MSG(ooms > 0, "%s: the trace never ran out of memory", config);
    while (nlive) {
        nlive--;
        CHECK_OK(mn_cache_release(&p.a, live[nlive]));
        CHECK_OK(mr_cache_release(&p.b, live[nlive]));
    }
    mn_simdev_sync(&p.dev_a);
    mn_simdev_sync(&p.dev_b);
    CHECK_OK(mn_cache_empty(&p.a));
    CHECK_OK(mr_cache_empty(&p.b));
    CHECK(cd_same_state(&p));
    CHECK(cd_same_snapshot(&p));
    CHECK_OK(mn_cache_check(&p.a));
    cd_close(&p);
}

static void test_random_traces(void) {
    static const struct {
        const char *config;
        uint64_t capacity;
        double fraction;
    } cases[] = {
        {"", 0, 0.0},
        {"", 3072 * MIB, 0.0},
        {"expandable_segments:True", 0, 0.0},
        {"expandable_segments:True", 3072 * MIB, 0.0},
        {"max_split_size_mb:40", 3072 * MIB, 0.0},
        {"max_split_size_mb:24,max_non_split_rounding_mb:30", 2048 * MIB, 0.0},
        {"roundup_power2_divisions:4", 3072 * MIB, 0.0},
        {"roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", 3072 * MIB, 0.0},
        {"garbage_collection_threshold:0.6", 4096 * MIB, 0.8},
        {"garbage_collection_threshold:0.5,max_split_size_mb:64", 4096 * MIB, 0.9},
        {"expandable_segments:True,roundup_power2_divisions:2", 2048 * MIB, 0.0},
        {"expandable_segments:True,large_segment_size_mb:64", 3072 * MIB, 0.0},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++)
        cd_run(cases[k].config, cases[k].capacity, cases[k].fraction, 20000, 0, 1);
    // the first use on another stream after a long trace without one (resets before it), the
    // statistics read now and then
    cd_run("", 0, 0.0, 20000, 10000, 97);
    cd_run("expandable_segments:True", 3072 * MIB, 0.0, 20000, 10000, 97);
    cd_run("max_split_size_mb:40", 3072 * MIB, 0.0, 20000, 20000, 97);
}

// Deep bins: 30000 live blocks of a few sizes (so thousands share each exact bin), every third
// freed, then random allocations and releases: the best fit is a bin's lowest address, taken
// from deep in a bin's order, a split's remainder joins a crowded bin, and the block structs span
// many slabs. Addresses and statistics are compared after every call, snapshots now and then.
static void test_deep_bins(void) {
    enum { N = 30000 };
    static const uint64_t sizes[] = {512, 1024, 1536, 4096, 8192, 65536, 1536 * 1024,
                                     3 * MIB, 12 * MIB};
    cd_pair p;
    void **live = (void **)malloc(N * sizeof *live);
    uint64_t nlive = 0, i;
    int diverged = 0;
    CHECK(live != NULL);
    if (!live) return;
    CHECK_OK(cd_open(&p, 0, "", 0));
    if (!p.open) {
        free(live);
        return;
    }
    for (i = 0; i < 3 * (uint64_t)N && !diverged; i++) {
        uint64_t r = mnt_rand_u64() % 100;
        if (i < N || (r < 50 && nlive < N) || nlive == 0) {
            uint64_t size = sizes[mnt_rand_u64() % (sizeof sizes / sizeof sizes[0])];
            mn_stream s = (mn_stream)(mnt_rand_u64() % 8 == 0);
            void *pa = NULL, *pb = NULL;
            mn_result ra = mn_cache_alloc(&p.a, size, s, MN_CAT_OTHER, NULL, &pa);
            mn_result rb = mr_cache_alloc(&p.b, size, s, MN_CAT_OTHER, NULL, &pb);
            if (ra != rb || pa != pb) {
                CHECK_MSG(0, "step %llu: alloc of %llu: %d %p, reference %d %p",
                          (unsigned long long)i, (unsigned long long)size, (int)ra, pa, (int)rb,
                          pb);
                diverged = 1;
            }
            if (ra == MN_OK) live[nlive++] = pa;
        } else {
            uint64_t k = mnt_rand_u64() % nlive;
            CHECK_OK(mn_cache_release(&p.a, live[k]));
            CHECK_OK(mr_cache_release(&p.b, live[k]));
            live[k] = live[--nlive];
        }
        if (i == N - 1) {  // holes: every third block
            uint64_t k, n = 0;
            for (k = 0; k < nlive; k++) {
                if (k % 3 == 0) {
                    CHECK_OK(mn_cache_release(&p.a, live[k]));
                    CHECK_OK(mr_cache_release(&p.b, live[k]));
                } else {
                    live[n++] = live[k];
                }
            }
            nlive = n;
        }
        if (!diverged && !cd_same_state(&p)) {
            CHECK_MSG(0, "step %llu: statistics differ", (unsigned long long)i);
            diverged = 1;
        }
        if (!diverged && i % 9973 == 0 && !cd_same_snapshot(&p)) {
            CHECK_MSG(0, "step %llu: snapshots differ", (unsigned long long)i);
            diverged = 1;
        }
    }
    if (!diverged) {
        CHECK(cd_same_snapshot(&p));
        CHECK_OK(mn_cache_check(&p.a));
    }
    while (nlive) {
        nlive--;
        CHECK_OK(mn_cache_release(&p.a, live[nlive]));
        CHECK_OK(mr_cache_release(&p.b, live[nlive]));
    }
    CHECK_OK(mn_cache_empty(&p.a));
    CHECK_OK(mr_cache_empty(&p.b));
    if (!diverged) CHECK(cd_same_state(&p));
    cd_close(&p);
    free(live);
}

const mnt_case test_cachediff_cases[] = {
    {"random_traces", test_random_traces},
    {"deep_bins", test_deep_bins},
};
const size_t test_cachediff_count = sizeof test_cachediff_cases / sizeof test_cachediff_cases[0];
