// Tests of the cache section: PyTorch's policy on worked examples, the consistency invariant on
// random workloads, failure injection (device and host), threads, outputs, and `memanat replay`.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
#include <pthread.h>
#include "harness.h"
#include "../memanat.h"

#define MIB (1024ull * 1024ull)
#define KIB 1024ull

// ---- helpers -------------------------------------------------------------------------------------

typedef mn_sim_cache tc_env;

static mnt_log tc_log;  // what the allocators under test logged (every message non-empty)

static mn_result tc_open(tc_env *e, uint64_t capacity, const char *config, uint32_t trace) {
    mn_simdev_desc dd;
    mn_cache_desc cd;
    memset(&dd, 0, sizeof dd);
    memset(&cd, 0, sizeof cd);
    dd.capacity = capacity;
    cd.config = config;
    cd.trace_entries = trace;
    cd.logger.log_fn = mnt_log_capture;
    cd.logger.user_data = &tc_log;
    return mn_sim_cache_init(e, &dd, &cd);
}

static void tc_close(tc_env *e) {
    mn_cache_free(&e->cache);
    CHECK_EQ_U64(e->dev.used, 0);  // every segment went back to the device
    CHECK_EQ_U64(e->dev.live, 0);
    mn_simdev_free(&e->dev);
}

static struct mn_cache_stats tc_stats(tc_env *e) {
    struct mn_cache_stats s;
    CHECK_OK(mn_cache_stats(&e->cache, &s));
    return s;
}

static void *tc_alloc(tc_env *e, uint64_t size, mn_stream stream) {
    void *p = NULL;
    CHECK_OK(mn_cache_alloc(&e->cache, size, stream, MN_CAT_ACTIVATIONS, "t", &p));
    return p;
}

static uint64_t tc_u(void *p) { return (uint64_t)(uintptr_t)p; }

// PyTorch's _check_memory_stat_consistency: statistics rebuilt from a snapshot equal the live
// ones; every byte of a segment belongs to exactly one block; segments do not overlap.
static void tc_consistent(tc_env *e) {
    mn_cache_snapshot s;
    struct mn_cache_stats w;
    uint64_t i, j;
    int t;
    CHECK_OK(mn_cache_check(&e->cache));
    if (mn_cache_snapshot_take(&e->cache, &s) != MN_OK) {
        CHECK(0);
        return;
    }
    memset(&w, 0, sizeof w);
    for (i = 0; i < s.segment_count; i++) {
        const mn_segment_info *g = &s.segments[i];
        uint64_t at = g->addr, sum = 0;
        t = g->is_small ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL;
        if (i + 1 < s.segment_count)
            CHECK_MSG(g->addr + g->total_size <= s.segments[i + 1].addr, "segments overlap");
        if (!g->is_expandable) w.segment[t].current++;
        w.reserved_bytes[t].current += g->total_size;
        for (j = 0; j < g->block_count; j++) {
            const mn_block_info *b = &s.blocks[g->first_block + j];
            CHECK_MSG(b->addr == at, "block %llx is not where the previous one ends",
                      (unsigned long long)b->addr);
            at += b->size, sum += b->size;
            if (b->state == MN_BLOCK_ACTIVE_ALLOCATED) {
                w.allocation[t].current++;
                w.allocated_bytes[t].current += b->size;
            }
            if (b->state != MN_BLOCK_INACTIVE) {
                w.active[t].current++;
                w.active_bytes[t].current += b->size;
                w.requested_bytes[t].current += b->requested;
            } else if (!g->is_expandable && g->block_count > 1) {
                w.inactive_split[t].current++;
                w.inactive_split_bytes[t].current += b->size;
            }
        }
        CHECK_EQ_U64(sum, g->total_size);
    }
    for (t = MN_STAT_SMALL_POOL; t < MN_STAT_TYPE_COUNT; t++) {
#define TC_CMP(f) do { CHECK_EQ_U64(s.stats.f[t].current, w.f[t].current); \
        w.f[MN_STAT_ALL].current += w.f[t].current; } while (0)
        TC_CMP(allocation); TC_CMP(segment); TC_CMP(active); TC_CMP(inactive_split);
        TC_CMP(allocated_bytes); TC_CMP(reserved_bytes); TC_CMP(active_bytes);
        TC_CMP(inactive_split_bytes); TC_CMP(requested_bytes);
#undef TC_CMP
    }
    CHECK_EQ_U64(s.stats.allocated_bytes[MN_STAT_ALL].current, w.allocated_bytes[MN_STAT_ALL].current);
    CHECK_EQ_U64(s.stats.reserved_bytes[MN_STAT_ALL].current, w.reserved_bytes[MN_STAT_ALL].current);
    CHECK_EQ_U64(s.stats.active_bytes[MN_STAT_ALL].current, w.active_bytes[MN_STAT_ALL].current);
    CHECK_EQ_U64(s.stats.allocation[MN_STAT_ALL].current, w.allocation[MN_STAT_ALL].current);
    CHECK_EQ_U64(s.stats.segment[MN_STAT_ALL].current, w.segment[MN_STAT_ALL].current);
    CHECK_EQ_U64(s.stats.requested_bytes[MN_STAT_ALL].current, w.requested_bytes[MN_STAT_ALL].current);
    CHECK_EQ_U64(s.stats.inactive_split_bytes[MN_STAT_ALL].current,
                 w.inactive_split_bytes[MN_STAT_ALL].current);
    if (s.trace_count || s.trace_dropped) {  // the history replays to the present state
        uint64_t cat[MN_CAT_COUNT], res = s.base_reserved, alloc = 0;
        memcpy(cat, s.base_cat_allocated, sizeof cat);
        for (i = 0; i < s.trace_count; i++) {
            const mn_trace_entry *te = &s.trace[i];
            if (te->action == MN_TRACE_ALLOC) cat[te->category] += te->block_size;
            if (te->action == MN_TRACE_FREE_REQUESTED) cat[te->category] -= te->block_size;
            if (te->action == MN_TRACE_SEGMENT_ALLOC || te->action == MN_TRACE_SEGMENT_MAP)
                res += te->size;
            if (te->action == MN_TRACE_SEGMENT_FREE || te->action == MN_TRACE_SEGMENT_UNMAP)
                res -= te->size;
        }
        for (t = 0; t < MN_CAT_COUNT; t++) {
            alloc += cat[t];
            CHECK_EQ_U64(cat[t], s.stats.cat_allocated_bytes[t].current);
        }
        CHECK_EQ_U64(alloc, s.stats.allocated_bytes[MN_STAT_ALL].current);
        CHECK_EQ_U64(res, s.stats.reserved_bytes[MN_STAT_ALL].current);
    }
    CHECK(s.stats.reserved_bytes[MN_STAT_ALL].current <= s.stats.reserved_bytes[MN_STAT_ALL].peak);
    CHECK(s.stats.allocated_bytes[MN_STAT_ALL].current <= s.stats.allocated_bytes[MN_STAT_ALL].peak);
    mn_cache_snapshot_free(&s);
}

// ---- the policy on worked examples ---------------------------------------------------------------

static void test_rounding_table(void) {
    // reference/allocator.md 1.2 and 1.3
    static const struct { uint64_t req, rounded, segment; } rows[] = {
        {1, 512, 2 * MIB}, {513, 1024, 2 * MIB}, {MIB, MIB, 2 * MIB},
        {MIB + 1, 1049088, 20 * MIB}, {5 * MIB, 5 * MIB, 20 * MIB}, {10 * MIB, 10 * MIB, 10 * MIB},
        {10 * MIB + 1, 10486272, 12 * MIB}, {512, 512, 2 * MIB}, {0, 512, 2 * MIB},
    };
    mn_cache_config cfg;
    size_t i;
    for (i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        uint64_t r = mn_cache_round_size(NULL, rows[i].req);
        CHECK_EQ_U64(r, rows[i].rounded);
        CHECK_EQ_U64(mn_cache_segment_size(NULL, r), rows[i].segment);
    }
    CHECK_OK(mn_cache_config_parse("roundup_power2_divisions:4", &cfg, NULL));
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 84 * MIB), 96 * MIB);  // 21M floats
    CHECK_EQ_U64(mn_cache_segment_size(&cfg, 96 * MIB), 96 * MIB);
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 1200), 1536);  // not 1280: needs size > 512 * 4
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 64 * MIB), 64 * MIB);  // powers of two stay
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 3000), 3072);
    CHECK_OK(mn_cache_config_parse("roundup_power2_divisions:[64:8,>:2]", &cfg, NULL));
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 84 * MIB), 88 * MIB);   // 64-128 MiB in 8 steps
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 40 * MIB), 40 * MIB);   // below 64: the first value too
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 400 * MIB), 512 * MIB); // ">" = 2 divisions
    CHECK_OK(mn_cache_config_parse("roundup_power2_divisions:2", &cfg, NULL));
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 400 * MIB), 512 * MIB);
    CHECK_OK(mn_cache_config_parse("roundup_power2_divisions:1", &cfg, NULL));
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 84 * MIB + 3), 84 * MIB + 512);  // 1 = plain 512
    CHECK_OK(mn_cache_config_parse("roundup_power2_divisions:0", &cfg, NULL));
    CHECK_EQ_U64(mn_cache_round_size(&cfg, 84 * MIB + 3), 84 * MIB + 512);
    for (i = 0; i < 2000; i++) {  // random sizes: multiple of 512, not below, less than 512 above
        uint64_t sz = mnt_rand_u64() >> (mnt_rand_u64() % 60 + 4), r = mn_cache_round_size(NULL, sz);
        CHECK(r % 512 == 0 && r >= sz && r - sz < 512 + (sz < 512 ? 512 : 0));
    }
}

static void test_config_parse(void) {
    static const char *const bad[] = {
        "foo:1,bar:2", "garbage_collection_threshold:1.2", "garbage_collection_threshold:0",
        "max_split_size_mb:2", "max_split_size_mb:20", "max_split_size_mb:x",
        "expandable_segments:yes", "expandable_segments:true", "roundup_power2_divisions:3",
        "roundup_power2_divisions:[3:4]", "roundup_power2_divisions:[64:3]",
        "roundup_power2_divisions:[64:4", "max_split_size_mb", "max_split_size_mb:", ":3",
        "max_split_size_mb:100 200", "backend:magic", "max_non_split_rounding_mb:10",
        "pinned_num_register_threads:3", "pinned_num_register_threads:256",
        "large_segment_size_mb:3", "large_segment_size_mb:0", "roundup_power2_divisions:[64]",
        "roundup_power2_divisions:[64:4:8]",
    };
    mn_cache_config cfg;
    mnt_log lc;
    mn_logger lg = {mnt_log_capture, &lc};
    size_t i;
    memset(&lc, 0, sizeof lc);
    CHECK_OK(mn_cache_config_parse(NULL, &cfg, &lg));
    CHECK_EQ_U64(cfg.max_split_size, 0);
    CHECK_OK(mn_cache_config_parse("", &cfg, &lg));
    CHECK_OK(mn_cache_config_parse(" max_split_size_mb : 128 , garbage_collection_threshold:0.6,"
                                   "expandable_segments:True,roundup_power2_divisions:[256:1,"
                                   "512:2,1024:4,>:8],release_lock_on_cudamalloc:False,"
                                   "max_non_split_rounding_mb:64,backend:native", &cfg, &lg));
    CHECK_EQ_U64(cfg.max_split_size, 128 * MIB);
    CHECK_EQ_U64(cfg.max_non_split_rounding, 64 * MIB);
    CHECK_NEAR(cfg.garbage_collection_threshold, 0.6, 1e-12, 0);
    CHECK_EQ_INT(cfg.expandable_segments, 1);
    CHECK_EQ_INT(cfg.roundup_power2_divisions[0], 1);   // below 256 MB: the first value
    CHECK_EQ_INT(cfg.roundup_power2_divisions[8], 1);   // 256 MB
    CHECK_EQ_INT(cfg.roundup_power2_divisions[9], 2);   // 512 MB
    CHECK_EQ_INT(cfg.roundup_power2_divisions[10], 4);  // 1 GB
    CHECK_EQ_INT(cfg.roundup_power2_divisions[15], 8);  // the rest
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&lc, 0, sizeof lc);
        CHECK_MSG(mn_cache_config_parse(bad[i], &cfg, &lg) == MN_ERR_CONFIG,
                  "\"%s\" was accepted", bad[i]);
        CHECK_MSG(lc.count != 0, "no message for \"%s\"", bad[i]);
    }
    CHECK_ERR(mn_cache_config_parse("foo:1,bar:2", &cfg, &lg), MN_ERR_CONFIG);
    CHECK(strstr(lc.last, "'foo'") != NULL);  // the message names the key
    CHECK_ERR(mn_cache_config_parse("max_split_size_mb:2", &cfg, &lg), MN_ERR_CONFIG);
    CHECK(strstr(lc.last, "max_split_size_mb") != NULL);
    CHECK_ERR(mn_cache_config_parse("backend:cudaMallocAsync", &cfg, &lg), MN_ERR_UNSUPPORTED);
    CHECK_OK(mn_cache_config_parse("large_segment_size_mb:64", &cfg, &lg));
    CHECK_EQ_U64(cfg.large_segment_size, 64 * MIB);
    {  // a setting string of more tokens than the lexer keeps: refused, and said so
        char many[2400];
        size_t k;
        for (k = 0; k + 22 < sizeof many; k += 22) memcpy(many + k, "max_split_size_mb:128,", 22);
        many[k] = 0;
        CHECK_ERR(mn_cache_config_parse(many, &cfg, &lg), MN_ERR_CONFIG);
        CHECK(strstr(lc.last, "tokens") != NULL);
    }
    {  // parsed settings given directly are checked as well
        mn_sim_cache sc;
        mn_cache_desc cd;
        memset(&cd, 0, sizeof cd);
        CHECK_OK(mn_cache_config_parse("", &cfg, &lg));
        cfg.garbage_collection_threshold = 1.5;
        cd.settings = &cfg, cd.logger = lg;
        CHECK_ERR(mn_sim_cache_init(&sc, NULL, &cd), MN_ERR_CONFIG);
        CHECK(strstr(lc.last, "out of range") != NULL);
        cfg.garbage_collection_threshold = 0.0, cfg.max_split_size = MIB;
        CHECK_ERR(mn_sim_cache_init(&sc, NULL, &cd), MN_ERR_CONFIG);
    }
    for (i = 0; i < 3000; i++) {  // fuzz: random bytes from the grammar's alphabet never crash
        static const char alpha[] = "max_split_size_mb:,[]>0123456789 .roundup_power2_divisionsTF";
        char s[40];
        size_t n = (size_t)(mnt_rand_u64() % 39), k;
        for (k = 0; k < n; k++) s[k] = alpha[mnt_rand_u64() % (sizeof alpha - 1)];
        s[n] = 0;
        (void)mn_cache_config_parse(s, &cfg, NULL);
    }
}

static void test_small_and_large_pools(void) {
    tc_env e;
    struct mn_cache_stats s;
    void *a, *b, *c2, *d;
    if (tc_open(&e, 0, NULL, 0) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 1, 0);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.allocated_bytes[MN_STAT_ALL].current, 512);
    CHECK_EQ_U64(s.requested_bytes[MN_STAT_ALL].current, 1);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_SMALL_POOL].current, 2 * MIB);
    CHECK_EQ_U64(s.segment[MN_STAT_SMALL_POOL].current, 1);
    CHECK_EQ_U64(s.inactive_split[MN_STAT_SMALL_POOL].current, 1);  // the rest of the 2 MiB
    CHECK_EQ_U64(s.inactive_split_bytes[MN_STAT_SMALL_POOL].current, 2 * MIB - 512);
    b = tc_alloc(&e, MIB, 0);  // 1 MiB exactly is small: same segment, right after a
    CHECK_EQ_U64(tc_u(b), tc_u(a) + 512);
    c2 = tc_alloc(&e, MIB + 1, 0);  // large: a 20 MiB segment, split
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_LARGE_POOL].current, 20 * MIB);
    CHECK_EQ_U64(s.allocated_bytes[MN_STAT_LARGE_POOL].current, 1049088);
    CHECK_EQ_U64(s.inactive_split_bytes[MN_STAT_LARGE_POOL].current, 20 * MIB - 1049088);
    d = tc_alloc(&e, 10 * MIB + 1, 0);  // best fit: the rest of c2's segment, split again
    CHECK_EQ_U64(tc_u(d), tc_u(c2) + 1049088);
    CHECK_OK(mn_cache_release(&e.cache, d));
    d = tc_alloc(&e, 19 * MIB + 1, 0);  // >= 10 MiB: own 20 MiB segment, the < 1 MiB rest kept
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_LARGE_POOL].current, 40 * MIB);
    CHECK_EQ_U64(s.allocated_bytes[MN_STAT_LARGE_POOL].current, 1049088 + 20 * MIB);
    CHECK_EQ_U64(s.requested_bytes[MN_STAT_LARGE_POOL].current, MIB + 1 + 19 * MIB + 1);
    CHECK_EQ_U64(s.segment[MN_STAT_ALL].current, 3);
    tc_consistent(&e);
    CHECK_OK(mn_cache_release(&e.cache, c2));  // merges back: the segment is whole again
    s = tc_stats(&e);
    CHECK_EQ_U64(s.inactive_split[MN_STAT_LARGE_POOL].current, 0);
    CHECK_EQ_U64(s.active[MN_STAT_ALL].current, 3);
    // a cached block is reused at the same address on the same stream, not on another one
    c2 = tc_alloc(&e, 2 * MIB, 0);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.segment[MN_STAT_ALL].current, 3);
    CHECK_OK(mn_cache_release(&e.cache, c2));
    c2 = tc_alloc(&e, 2 * MIB, 1);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.segment[MN_STAT_ALL].current, 4);
    tc_consistent(&e);
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    CHECK_OK(mn_cache_release(&e.cache, c2));
    CHECK_OK(mn_cache_release(&e.cache, d));
    CHECK_ERR(mn_cache_release(&e.cache, d), MN_ERR_INVALID_ARG);  // double free
    s = tc_stats(&e);
    CHECK_EQ_U64(s.allocated_bytes[MN_STAT_ALL].current, 0);
    CHECK_EQ_U64(s.allocated_bytes[MN_STAT_ALL].peak, 512 + MIB + 2 * MIB + 20 * MIB);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 2 * MIB + 20 * MIB + 20 * MIB + 20 * MIB);
    CHECK_OK(mn_cache_empty(&e.cache));
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 0);
    CHECK_EQ_U64(s.num_device_alloc, 4);
    CHECK_EQ_U64(s.num_device_free, 4);
    CHECK_EQ_U64(s.allocation[MN_STAT_ALL].allocated, 7);
    CHECK_EQ_U64(s.allocation[MN_STAT_ALL].freed, 7);
    CHECK_EQ_U64(s.num_sync_all_streams, 1);
    CHECK_EQ_U64(e.dev.used, 0);
    {  // size 0 gives NULL without touching anything, as PyTorch
        void *z = &e;
        CHECK_OK(mn_cache_alloc(&e.cache, 0, 0, MN_CAT_OTHER, NULL, &z));
        CHECK(z == NULL);
        CHECK_OK(mn_cache_release(&e.cache, NULL));
    }
    tc_close(&e);
}

static void test_best_fit_and_split_rules(void) {
    tc_env e;
    void *p[8];
    struct mn_cache_stats s;
    if (tc_open(&e, 0, NULL, 0) != MN_OK) { CHECK(0); return; }
    // carve a 20 MiB segment into 3, 5, 7 MiB (+5 MiB rest), free 3 and 7: a 3 MiB request takes
    // the 3 MiB hole (best fit by size, then address), a 4 MiB request the 5 MiB rest
    p[0] = tc_alloc(&e, 3 * MIB, 0);
    p[1] = tc_alloc(&e, 5 * MIB, 0);
    p[2] = tc_alloc(&e, 7 * MIB, 0);
    CHECK_EQ_U64(tc_u(p[1]), tc_u(p[0]) + 3 * MIB);
    CHECK_EQ_U64(tc_u(p[2]), tc_u(p[0]) + 8 * MIB);
    CHECK_OK(mn_cache_release(&e.cache, p[0]));
    CHECK_OK(mn_cache_release(&e.cache, p[2]));  // merges with the 5 MiB rest: 12 MiB hole
    p[3] = tc_alloc(&e, 3 * MIB, 0);
    CHECK_EQ_U64(tc_u(p[3]), tc_u(p[0]));
    p[4] = tc_alloc(&e, 4 * MIB, 0);
    CHECK_EQ_U64(tc_u(p[4]), tc_u(p[0]) + 8 * MIB);
    tc_consistent(&e);
    // large pool: a remainder of exactly 1 MiB is not split off (needs > 1 MiB)
    CHECK_OK(mn_cache_release(&e.cache, p[3]));
    p[5] = tc_alloc(&e, 2 * MIB, 0);  // takes the 3 MiB hole whole
    s = tc_stats(&e);
    CHECK_EQ_U64(s.allocated_bytes[MN_STAT_LARGE_POOL].current, 3 * MIB + 5 * MIB + 4 * MIB);
    CHECK_EQ_U64(s.requested_bytes[MN_STAT_LARGE_POOL].current, 2 * MIB + 5 * MIB + 4 * MIB);
    tc_consistent(&e);
    CHECK_OK(mn_cache_release(&e.cache, p[1]));
    CHECK_OK(mn_cache_release(&e.cache, p[4]));
    CHECK_OK(mn_cache_release(&e.cache, p[5]));
    s = tc_stats(&e);
    CHECK_EQ_U64(s.inactive_split[MN_STAT_ALL].current, 0);
    CHECK_EQ_U64(s.segment[MN_STAT_ALL].current, 1);
    tc_consistent(&e);
    tc_close(&e);
}

static void test_oversize_rules(void) {
    tc_env e;
    void *a, *b;
    struct mn_cache_stats s;
    if (tc_open(&e, 0, "max_split_size_mb:100", 0) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 150 * MIB, 0);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.oversize_allocations.current, 1);
    CHECK_EQ_U64(s.oversize_segments.current, 1);
    CHECK_EQ_U64(s.max_split_size, 100 * MIB);
    CHECK_OK(mn_cache_release(&e.cache, a));
    b = tc_alloc(&e, 50 * MIB, 0);  // an oversize block never serves a small request
    CHECK(tc_u(b) != tc_u(a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    b = tc_alloc(&e, 120 * MIB, 0);  // 150 >= 120 + 20: too large to hand out
    CHECK(tc_u(b) != tc_u(a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    b = tc_alloc(&e, 140 * MIB, 0);  // within 20 MiB: reused whole, not split
    CHECK_EQ_U64(tc_u(b), tc_u(a));
    s = tc_stats(&e);
    CHECK_EQ_U64(s.allocated_bytes[MN_STAT_ALL].current, 150 * MIB);
    CHECK_EQ_U64(s.oversize_allocations.current, 1);
    CHECK_EQ_U64(s.oversize_allocations.peak, 1);
    CHECK_OK(mn_cache_release(&e.cache, b));
    tc_consistent(&e);
    tc_close(&e);
}

static void test_oom_ladder(void) {
    tc_env e;
    void *a, *b, *c2;
    struct mn_cache_stats s;
    char msg[1024];
    // 1. a miss that fails frees every unsplit cached segment and retries (num_alloc_retries)
    if (tc_open(&e, 100 * MIB, NULL, 64) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 60 * MIB, 0);
    CHECK_OK(mn_cache_release(&e.cache, a));
    b = tc_alloc(&e, 60 * MIB, 1);  // other stream: the cached block is not usable
    s = tc_stats(&e);
    CHECK(b != NULL);
    CHECK_EQ_U64(s.num_alloc_retries, 1);
    CHECK_EQ_U64(s.num_ooms, 0);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 60 * MIB);
    // 2. nothing to free: OOM with PyTorch's message, the allocator stays consistent
    c2 = &e;
    CHECK_ERR(mn_cache_alloc(&e.cache, 50 * MIB, 1, MN_CAT_ACTIVATIONS, NULL, &c2),
              MN_ERR_DEVICE_OOM);
    CHECK(c2 == NULL);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.num_ooms, 1);
    CHECK_EQ_U64(s.num_alloc_retries, 2);
    mn_cache_oom_message(&e.cache, msg, sizeof msg);
    CHECK_STR(msg, "CUDA out of memory. Tried to allocate 50.00 MiB. GPU 0 has a total capacity "
              "of 100.00 MiB of which 40.00 MiB is free. Of the allocated memory 60.00 MiB is "
              "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If "
              "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
              "expandable_segments:True to avoid fragmentation.  See documentation for Memory "
              "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)");
    // "Tried to allocate" is the segment size: a 4 MiB miss asks for 20 MiB
    c2 = tc_alloc(&e, 30 * MIB, 1);
    CHECK_ERR(mn_cache_alloc(&e.cache, 4 * MIB, 1, MN_CAT_OTHER, NULL, &a), MN_ERR_DEVICE_OOM);
    mn_cache_oom_message(&e.cache, msg, sizeof msg);
    CHECK(strstr(msg, "Tried to allocate 20.00 MiB. GPU 0 ") != NULL);
    CHECK(strstr(msg, "of which 10.00 MiB is free") != NULL);
    CHECK_ERR(mn_cache_alloc(&e.cache, 1ull << 60, 0, MN_CAT_OTHER, NULL, &a), MN_ERR_DEVICE_OOM);
    mn_cache_oom_message(&e.cache, msg, sizeof msg);
    CHECK_STR(msg, "Tried to allocate more than 1EB memory.");
    tc_consistent(&e);
    {  // the OOM entry is in the history with the free device bytes
        mn_cache_snapshot snap;
        uint64_t i, ooms = 0;
        CHECK_OK(mn_cache_snapshot_take(&e.cache, &snap));
        for (i = 0; i < snap.trace_count; i++)
            if (snap.trace[i].action == MN_TRACE_OOM) ooms++;
        CHECK_EQ_U64(ooms, 2);
        mn_cache_snapshot_free(&snap);
    }
    CHECK_OK(mn_cache_release(&e.cache, b));
    CHECK_OK(mn_cache_release(&e.cache, c2));
    tc_close(&e);
    // 3. with max_split_size: the smallest large-enough oversize block goes first, no full flush
    if (tc_open(&e, 300 * MIB, "max_split_size_mb:40", 0) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 100 * MIB, 0);
    b = tc_alloc(&e, 120 * MIB, 0);
    c2 = tc_alloc(&e, 50 * MIB, 0);
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    a = tc_alloc(&e, 160 * MIB, 0);  // frees 120 (smallest oversize >= 160? none) -> largest first
    s = tc_stats(&e);
    CHECK(a != NULL);
    CHECK_EQ_U64(s.num_alloc_retries, 0);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 50 * MIB + 160 * MIB);
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_release(&e.cache, c2));
    tc_consistent(&e);
    tc_close(&e);
}

static void test_record_stream_events(void) {
    tc_env e;
    void *a, *b;
    struct mn_cache_stats s;
    mn_cache_snapshot snap;
    if (tc_open(&e, 0, NULL, 0) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 4 * MIB, 0);
    CHECK_OK(mn_cache_record_stream(&e.cache, a, 0));  // the allocation stream: ignored
    CHECK_OK(mn_cache_record_stream(&e.cache, a, 1));
    CHECK_OK(mn_cache_record_stream(&e.cache, a, 1));
    CHECK_OK(mn_cache_record_stream(&e.cache, a, 2));
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_EQ_U64(mn_simdev_pending_events(&e.dev), 2);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.allocation[MN_STAT_ALL].current, 0);  // free requested
    CHECK_EQ_U64(s.active[MN_STAT_ALL].current, 1);      // not completed
    CHECK_OK(mn_cache_snapshot_take(&e.cache, &snap));
    CHECK_EQ_INT(snap.blocks[0].state, MN_BLOCK_ACTIVE_PENDING_FREE);
    mn_cache_snapshot_free(&snap);
    tc_consistent(&e);
    b = tc_alloc(&e, 4 * MIB, 0);  // the pending block is not reused
    CHECK(tc_u(b) != tc_u(a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    mn_simdev_sync_stream(&e.dev, 1);
    b = tc_alloc(&e, 4 * MIB, 0);  // one event still pending
    CHECK(tc_u(b) != tc_u(a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    mn_simdev_sync_stream(&e.dev, 2);
    b = tc_alloc(&e, 4 * MIB, 0);  // both done: the next malloc processes them; best fit by addr
    s = tc_stats(&e);
    CHECK_EQ_U64(s.active[MN_STAT_ALL].current, 1);
    CHECK_EQ_U64(mn_simdev_pending_events(&e.dev), 0);
    CHECK_EQ_U64(e.dev.event_count, 0);  // events were freed
    CHECK_OK(mn_cache_release(&e.cache, b));
    // empty_cache waits for outstanding events (synchronize_and_free_events)
    a = tc_alloc(&e, 4 * MIB, 0);
    CHECK_OK(mn_cache_record_stream(&e.cache, a, 3));
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_empty(&e.cache));
    s = tc_stats(&e);
    CHECK_EQ_U64(s.active[MN_STAT_ALL].current, 0);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 0);
    CHECK_EQ_U64(s.num_sync_all_streams, 1);
    // record_stream's delayed frees are reclaimed by the OOM ladder too
    a = tc_alloc(&e, 30 * MIB, 0);
    CHECK_OK(mn_cache_record_stream(&e.cache, a, 1));
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_ERR(mn_cache_record_stream(&e.cache, a, 1), MN_ERR_INVALID_ARG);  // not allocated
    tc_consistent(&e);
    tc_close(&e);
    if (tc_open(&e, 40 * MIB, NULL, 0) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 30 * MIB, 0);
    CHECK_OK(mn_cache_record_stream(&e.cache, a, 1));
    CHECK_OK(mn_cache_release(&e.cache, a));
    b = tc_alloc(&e, 30 * MIB, 1);  // needs the pending block's memory: ladder syncs and frees
    CHECK(b != NULL);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.num_alloc_retries, 1);
    CHECK_OK(mn_cache_release(&e.cache, b));
    tc_consistent(&e);
    tc_close(&e);
}

static void test_fraction_and_gc(void) {
    tc_env e;
    void *a, *b;
    struct mn_cache_stats s;
    char msg[1024];
    if (tc_open(&e, 1000 * MIB, NULL, 0) != MN_OK) { CHECK(0); return; }
    CHECK_OK(mn_cache_set_memory_fraction(&e.cache, 0.5));
    CHECK_ERR(mn_cache_set_memory_fraction(&e.cache, 1.5), MN_ERR_INVALID_ARG);
    a = tc_alloc(&e, 400 * MIB, 0);  // 0.4 of the device fits, 0.5 more does not
    CHECK_ERR(mn_cache_alloc(&e.cache, 200 * MIB, 0, MN_CAT_OTHER, NULL, &b), MN_ERR_DEVICE_OOM);
    mn_cache_oom_message(&e.cache, msg, sizeof msg);
    CHECK(strstr(msg, "500.00 MiB allowed; Of the allocated memory") != NULL);
    CHECK_OK(mn_cache_release(&e.cache, a));
    tc_close(&e);
    // garbage collection: above threshold * allowed, old unsplit large blocks are freed
    if (tc_open(&e, 1000 * MIB, "garbage_collection_threshold:0.5", 0) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 200 * MIB, 0);
    b = tc_alloc(&e, 200 * MIB, 0);
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    a = tc_alloc(&e, 300 * MIB, 0);  // no fraction set: GC does nothing (PyTorch issue 106660)
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 700 * MIB);
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_set_memory_fraction(&e.cache, 1.0));
    a = tc_alloc(&e, 30 * MIB, 0);  // a hit: split from the cached 200 MiB block, no GC
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 700 * MIB);
    CHECK_OK(mn_cache_release(&e.cache, a));
    // a miss above 0.5 * 1000 MiB: blocks at least as old as the average go first. Ages count
    // get_free_block calls since caching: the 200 MiB block just used is 1, the others 2.
    a = tc_alloc(&e, 350 * MIB, 0);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 200 * MIB + 350 * MIB);
    CHECK_EQ_U64(s.num_alloc_retries, 0);
    CHECK_OK(mn_cache_release(&e.cache, a));
    tc_consistent(&e);
    tc_close(&e);
}

static void test_summary_layout(void) {
    struct mn_cache_stats s;
    mnt_buf out = {NULL, 0, 0};
    const char *line;
    int lines = 0;
    memset(&s, 0, sizeof s);
    // the hand-made stats of reference/allocator.md 1.12
    s.allocated_bytes[0].current = s.allocated_bytes[0].peak = s.allocated_bytes[0].allocated =
        86017 * KIB;
    s.allocated_bytes[2].current = s.allocated_bytes[2].peak = s.allocated_bytes[2].allocated =
        86016 * KIB;
    s.allocated_bytes[1].current = s.allocated_bytes[1].peak = s.allocated_bytes[1].allocated = KIB;
    s.allocation[0].current = s.allocation[0].peak = s.allocation[0].allocated = 2;
    s.allocation[1].current = s.allocation[2].current = 1;
    s.active[0].current = 2000000;  // count prefixes: K from 750,000
    s.reserved_bytes[0].current = 3ull << 30;
    CHECK_OK(mn_cache_summary_write(&s, 0, 0, mnt_buf_write, &out));
    if (!out.p) { CHECK(0); return; }
    CHECK(strncmp(out.p,
        "|===========================================================================|\n"
        "|                  PyTorch CUDA memory summary, device ID 0                 |\n"
        "|---------------------------------------------------------------------------|\n"
        "|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |\n"
        "|===========================================================================|\n"
        "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n"
        "|---------------------------------------------------------------------------|\n"
        "| Allocated memory      |  86017 KiB |  86017 KiB |  86017 KiB |      0 B   |\n"
        "|       from large pool |  86016 KiB |  86016 KiB |  86016 KiB |      0 B   |\n"
        "|       from small pool |      1 KiB |      1 KiB |      1 KiB |      0 B   |\n", 
        77 * 10) == 0);
    CHECK(strstr(out.p, "| Allocations           |       2    |       2    |       2    |"
                        "       0    |\n") != NULL);
    CHECK(strstr(out.p, "| Active allocs         |    2000 K  |") != NULL);
    CHECK(strstr(out.p, "| GPU reserved memory   |   3072 MiB |") != NULL);
    CHECK(strstr(out.p, "| Oversize GPU segments |       0    |       0    |       0    |"
                        "       0    |\n|==================================================="
                        "========================|\n") != NULL);
    for (line = out.p; *line; lines++) {
        const char *nl = strchr(line, '\n');
        if (!nl) break;
        CHECK_EQ_INT(nl - line, 77);
        line = nl + 1;
    }
    CHECK_EQ_INT(lines, 6 + 9 * 4 + 4 + 1);
    free(out.p);
    out.p = NULL, out.n = out.cap = 0;
    CHECK_OK(mn_cache_summary_write(&s, 3, 1, mnt_buf_write, &out));  // abbreviated: no pool rows
    CHECK(out.p && strstr(out.p, "from large pool") == NULL);
    CHECK(out.p && strstr(out.p, "device ID 3   ") != NULL);
    free(out.p);
    {
        char buf[32];
        mn_cache_format_size(1024, buf, sizeof buf);
        CHECK_STR(buf, "1024 bytes");
        mn_cache_format_size(1025, buf, sizeof buf);
        CHECK_STR(buf, "1.00 KiB");
        mn_cache_format_size(MIB, buf, sizeof buf);
        CHECK_STR(buf, "1024.00 KiB");
        mn_cache_format_size(500ull << 30, buf, sizeof buf);
        CHECK_STR(buf, "500.00 GiB");
    }
}

// ---- random workloads: the invariant after every operation -----------------------------------

static uint64_t tc_rand_size(void) {
    uint64_t r = mnt_rand_u64() % 100;
    if (r < 55) return 1 + mnt_rand_u64() % (r < 30 ? 64 * KIB : MIB);
    if (r < 93) return MIB + 1 + mnt_rand_u64() % (24 * MIB);
    return 24 * MIB + mnt_rand_u64() % (160 * MIB);
}

static void tc_random_run(const char *config, uint64_t capacity, int steps, int check_every) {
    enum { LIVE = 96 };
    tc_env e;
    void *live[LIVE];
    int n = 0, i, ooms = 0;
    if (tc_open(&e, capacity, config, 256) != MN_OK) { CHECK_MSG(0, "open %s", config); return; }
    if (config && strstr(config, "garbage_collection_threshold"))  // GC acts only with a fraction
        CHECK_OK(mn_cache_set_memory_fraction(&e.cache, 0.9));
    for (i = 0; i < steps && !mnt_failed(); i++) {
        uint64_t op = mnt_rand_u64() % 100;
        if (op < 52 && n < LIVE) {
            void *p = NULL;
            mn_result r = mn_cache_alloc(&e.cache, tc_rand_size(), (mn_stream)(mnt_rand_u64() % 3),
                                         (mn_category)(mnt_rand_u64() % MN_CAT_COUNT), "r", &p);
            if (r == MN_OK) live[n++] = p;
            else {
                CHECK_ERR(r, MN_ERR_DEVICE_OOM);
                ooms++;
            }
        } else if (op < 95 && n > 0) {
            int k = (int)(mnt_rand_u64() % (uint64_t)n);
            if (mnt_rand_u64() % 8 == 0)
                CHECK_OK(mn_cache_record_stream(&e.cache, live[k],
                                                1 + (mn_stream)(mnt_rand_u64() % 3)));
            CHECK_OK(mn_cache_release(&e.cache, live[k]));
            live[k] = live[--n];
        } else if (op < 97) {
            mn_simdev_sync_stream(&e.dev, (mn_stream)(mnt_rand_u64() % 4));
        } else if (op < 98) {
            CHECK_OK(mn_cache_empty(&e.cache));
        } else if (op < 99) {
            mn_cache_reset_peak_stats(&e.cache);
        } else if (n > 0) {
            CHECK_OK(mn_cache_record_stream(&e.cache, live[0], 2));
        }
        if (i % check_every == 0) tc_consistent(&e);
    }
    tc_consistent(&e);
    while (n > 0) CHECK_OK(mn_cache_release(&e.cache, live[--n]));
    mn_simdev_sync(&e.dev);
    CHECK_OK(mn_cache_empty(&e.cache));
    {
        struct mn_cache_stats s = tc_stats(&e);
        CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 0);
        CHECK_EQ_U64(s.active[MN_STAT_ALL].current, 0);
        CHECK_EQ_U64(s.num_ooms, (uint64_t)ooms);
    }
    tc_close(&e);
}

static void test_random_invariant(void) {
    static const char *const configs[] = {
        NULL, "max_split_size_mb:40", "roundup_power2_divisions:4", "max_split_size_mb:64,"
        "roundup_power2_divisions:[1:2,16:4,>:8],max_non_split_rounding_mb:30",
        "garbage_collection_threshold:0.6"};
    size_t k;
    int seed;
    for (seed = 0; seed < 4; seed++)
        for (k = 0; k < sizeof configs / sizeof configs[0]; k++) {
            tc_random_run(configs[k], 0, 2000, 1);              // unlimited device
            tc_random_run(configs[k], 600 * MIB, 2000, 1);      // tight: OOM ladder often
        }
}

static void test_expandable_segments(void) {
    tc_env e;
    void *a, *b, *c2;
    struct mn_cache_stats s;
    mn_cache_snapshot snap;
    uint64_t i, maps = 0;
    int seed;
    if (tc_open(&e, 0, "expandable_segments:True", 64) != MN_OK) { CHECK(0); return; }
    a = tc_alloc(&e, 5 * MIB, 0);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 20 * MIB);  // one 20 MiB page mapped
    CHECK_EQ_U64(s.segment[MN_STAT_ALL].current, 0);               // maps are not segments
    CHECK_EQ_U64(s.num_device_alloc, 1);
    b = tc_alloc(&e, 30 * MIB, 0);  // grows the same segment: contiguous with a
    CHECK_EQ_U64(tc_u(b), tc_u(a) + 5 * MIB);
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 40 * MIB);
    c2 = tc_alloc(&e, 100, 0);  // small pool: its own segment with 2 MiB pages
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_SMALL_POOL].current, 2 * MIB);
    tc_consistent(&e);
    CHECK_OK(mn_cache_snapshot_take(&e.cache, &snap));
    CHECK_EQ_U64(snap.segment_count, 2);
    CHECK_EQ_INT(snap.segments[0].is_expandable, 1);
    for (i = 0; i < snap.trace_count; i++) maps += snap.trace[i].action == MN_TRACE_SEGMENT_MAP;
    CHECK_EQ_U64(maps, 3);
    mn_cache_snapshot_free(&snap);
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_empty(&e.cache));  // only whole free pages unmap: a's page holds b's start
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_LARGE_POOL].current, 40 * MIB);
    CHECK_OK(mn_cache_release(&e.cache, b));
    CHECK_OK(mn_cache_release(&e.cache, c2));
    CHECK_OK(mn_cache_empty(&e.cache));
    s = tc_stats(&e);
    CHECK_EQ_U64(s.reserved_bytes[MN_STAT_ALL].current, 0);
    CHECK_EQ_U64(s.num_device_free, 2);  // one unmap per free range
    tc_consistent(&e);
    tc_close(&e);
    for (seed = 0; seed < 3; seed++) {
        tc_random_run("expandable_segments:True", 0, 1500, 1);
        tc_random_run("expandable_segments:True", 700 * MIB, 1500, 1);
    }
}

// ---- failure injection -----------------------------------------------------------------------

// A scripted workload; returns the number of device allocations it made.
static uint64_t tc_script(tc_env *e, int *ooms) {
    static const uint64_t sizes[] = {100, 3 * MIB, 200 * KIB, 25 * MIB, MIB, 12 * MIB, 700,
                                     5 * MIB, 90 * MIB, 64 * KIB, 2 * MIB, 40 * MIB};
    void *live[32];
    int n = 0, i;
    for (i = 0; i < 48; i++) {
        void *p = NULL;
        mn_result r = mn_cache_alloc(&e->cache, sizes[i % 12] + (uint64_t)i * 4096,
                                     (mn_stream)(i % 5 == 0), MN_CAT_WEIGHTS, "w", &p);
        if (r == MN_OK) {
            live[n++] = p;
        } else {
            char msg[1024];
            CHECK_ERR(r, MN_ERR_DEVICE_OOM);
            mn_cache_oom_message(&e->cache, msg, sizeof msg);
            CHECK(strncmp(msg, "CUDA out of memory. Tried to allocate ", 38) == 0);
            (*ooms)++;
        }
        if (i % 3 == 2 && n > 0) {
            CHECK_OK(mn_cache_release(&e->cache, live[0]));
            live[0] = live[--n];
        }
        if (i == 30) CHECK_OK(mn_cache_empty(&e->cache));
        tc_consistent(e);
        if (n == 32) break;
    }
    {
        struct mn_cache_stats s = tc_stats(e);
        CHECK_EQ_U64(s.allocation[MN_STAT_ALL].current, (uint64_t)n);  // no live block lost
        CHECK_EQ_U64(s.num_ooms, (uint64_t)*ooms);
    }
    while (n > 0) CHECK_OK(mn_cache_release(&e->cache, live[--n]));
    tc_consistent(e);
    return e->dev.alloc_calls + e->dev.map_calls;
}

static void test_device_failure_injection(void) {
    static const char *const configs[] = {NULL, "max_split_size_mb:30", "expandable_segments:True"};
    size_t k;
    for (k = 0; k < 3; k++) {
        tc_env e;
        int ooms = 0;
        uint64_t calls, n;
        if (tc_open(&e, 0, configs[k], 0) != MN_OK) { CHECK(0); return; }
        calls = tc_script(&e, &ooms);
        CHECK_EQ_INT(ooms, 0);
        tc_close(&e);
        for (n = 1; n <= calls + 1 && !mnt_failed(); n++) {
            if (tc_open(&e, 0, configs[k], 0) != MN_OK) { CHECK(0); return; }
            mn_simdev_fail_alloc_at(&e.dev, n);
            ooms = 0;
            tc_script(&e, &ooms);
            // the ladder's retry succeeds unless the retry is the failing call itself
            CHECK(ooms <= 1);
            tc_close(&e);
        }
    }
}

static void test_host_failure_injection(void) {
    long n;
    int done = 0;
    for (n = 1; !done && n < 400 && !mnt_failed(); n++) {
        tc_env e;
        void *p[40];
        int k, got = 0;
        mn_result r;
        mnt_fail_alloc_after(n);
        r = tc_open(&e, 0, "expandable_segments:False", 16);
        if (r != MN_OK) {
            CHECK_ERR(r, MN_ERR_OUT_OF_MEMORY);
            continue;
        }
        for (k = 0; k < 40; k++) {
            r = mn_cache_alloc(&e.cache, (uint64_t)(k + 1) * 300 * KIB, (mn_stream)(k % 2),
                               MN_CAT_OTHER, NULL, &p[got]);
            if (r == MN_OK) {
                if (k % 4 == 0) {
                    r = mn_cache_record_stream(&e.cache, p[got], 7);
                    if (r != MN_OK) CHECK_ERR(r, MN_ERR_OUT_OF_MEMORY);
                }
                got++;
            } else {
                CHECK_ERR(r, MN_ERR_OUT_OF_MEMORY);
            }
            if (k % 3 == 0 && got) {
                r = mn_cache_release(&e.cache, p[--got]);
                if (r != MN_OK) {  // recording the event failed: still allocated
                    CHECK_ERR(r, MN_ERR_OUT_OF_MEMORY);
                    got++;
                }
            }
        }
        {
            mn_cache_snapshot s;
            r = mn_cache_snapshot_take(&e.cache, &s);
            if (r == MN_OK) mn_cache_snapshot_free(&s);
            else CHECK_ERR(r, MN_ERR_OUT_OF_MEMORY);
        }
        mnt_fail_alloc_after(0);
        CHECK_OK(mn_cache_check(&e.cache));
        tc_consistent(&e);
        while (got > 0) CHECK_OK(mn_cache_release(&e.cache, p[--got]));
        mn_simdev_sync(&e.dev);
        done = mnt_total_allocs() > 0 && n > 60;
        tc_close(&e);
    }
    mnt_fail_alloc_after(0);
}

// Block structs come from slabs (64 structs, then twice as many each time, up to 16384): each
// host allocation of a call (a slab, the table of slabs, a segment record, the address map) in
// turn fails with nothing changed, at every slab boundary of 50000 blocks; the blocks carved from
// the slabs stay apart (the check and the snapshot at the end).
static void test_slab_failure_injection(void) {
    enum { N = 50000 };
    tc_env e;
    void **p = (void **)malloc(N * sizeof *p);
    int i, fails = 0;
    CHECK(p != NULL);
    if (!p) return;
    CHECK_OK(tc_open(&e, 0, "", 0));
    for (i = 0; i < N; i++) {
        uint64_t size = 512 * (uint64_t)(1 + i % 7);
        mn_stream s = (mn_stream)(i % 3 == 0);
        long n;
        for (n = 1; n < 8; n++) {
            struct mn_cache_stats before = tc_stats(&e), after;
            mn_result r;
            mnt_fail_alloc_after(n);
            r = mn_cache_alloc(&e.cache, size, s, MN_CAT_OTHER, NULL, &p[i]);
            mnt_fail_alloc_after(0);
            if (r == MN_OK) break;
            CHECK_ERR(r, MN_ERR_OUT_OF_MEMORY);
            CHECK(p[i] == NULL);
            after = tc_stats(&e);  // (what was reserved before the failure stays reserved)
            CHECK_EQ_U64(after.allocation[MN_STAT_ALL].current,
                         before.allocation[MN_STAT_ALL].current);
            CHECK_EQ_U64(after.segment[MN_STAT_ALL].current, before.segment[MN_STAT_ALL].current);
            CHECK_EQ_U64(after.inactive_split[MN_STAT_ALL].current,
                         before.inactive_split[MN_STAT_ALL].current);
            fails++;
        }
        CHECK(n < 8);
        if (i % 5 == 4) {
            CHECK_OK(mn_cache_release(&e.cache, p[i - 2]));
            p[i - 2] = NULL;
        }
    }
    // 40000 live blocks and their free neighbours: 11 slabs, 2 growths of their table
    CHECK(fails >= 13);
    CHECK_OK(mn_cache_check(&e.cache));
    tc_consistent(&e);
    for (i = 0; i < N; i++) CHECK_OK(mn_cache_release(&e.cache, p[i]));
    CHECK_OK(mn_cache_empty(&e.cache));
    CHECK_EQ_U64(tc_stats(&e).segment[MN_STAT_ALL].current, 0);
    tc_close(&e);
    free(p);
}

// The tables of 2 MiB or more (full slabs of 16384 block structs, the address map from 2^18
// slots) sit on 2 MiB boundaries inside larger host allocations (mn__c_table_alloc): 140000 live
// blocks, each with its own label, so that full slabs, their labels and a 2 MiB map are written
// and read back (under AddressSanitizer: every byte inside what the host handed out). Labels,
// sizes and addresses come back through the snapshot; every block is found by its pointer, half
// of them released in random order and allocated again, then all released.
static void test_huge_tables(void) {
    enum { N = 140000 };
    tc_env e;
    void **p = (void **)malloc(N * sizeof *p);
    uint32_t *len = (uint32_t *)malloc(N * sizeof *len);
    mn_cache_snapshot snap;
    uint64_t i, seen = 0;
    char lb[MN_CACHE_LABEL_MAX];
    if (!p || !len || tc_open(&e, 0, "", 0) != MN_OK) {
        free(p), free(len);
        CHECK(0);
        return;
    }
    for (i = 0; i < N; i++) {
        len[i] = 1 + (uint32_t)(mnt_rand_u64() % 8);  // 512 B units: small pool, 2 MiB segments
        snprintf(lb, sizeof lb, "b%llu", (unsigned long long)i);
        CHECK_OK(mn_cache_alloc(&e.cache, 512u * len[i], 0, MN_CAT_ACTIVATIONS, lb, &p[i]));
    }
    CHECK_OK(mn_cache_snapshot_take(&e.cache, &snap));
    for (i = 0; i < snap.block_count; i++) {
        const mn_block_info *b = &snap.blocks[i];
        unsigned long long k;
        if (b->state != MN_BLOCK_ACTIVE_ALLOCATED) continue;
        seen++;
        if (sscanf(b->label, "b%llu", &k) != 1 || k >= N) {
            CHECK(0);
            break;
        }
        CHECK_EQ_U64(b->addr, tc_u(p[k]));
        CHECK_EQ_U64(b->size, 512u * len[k]);
    }
    CHECK_EQ_U64(seen, N);
    mn_cache_snapshot_free(&snap);
    for (i = N - 1; i > 0; i--) {  // release half in random order
        uint64_t k = mnt_rand_u64() % (i + 1);
        void *t = p[k];
        uint32_t u = len[k];
        p[k] = p[i], p[i] = t, len[k] = len[i], len[i] = u;
    }
    for (i = 0; i < N / 2; i++) CHECK_OK(mn_cache_release(&e.cache, p[i]));
    for (i = 0; i < N / 2; i++) p[i] = tc_alloc(&e, 512u * len[i], 0);
    tc_consistent(&e);
    CHECK_EQ_U64(tc_stats(&e).allocation[MN_STAT_ALL].current, N);
    for (i = 0; i < N; i++) CHECK_OK(mn_cache_release(&e.cache, p[i]));
    CHECK_OK(mn_cache_empty(&e.cache));
    CHECK_EQ_U64(tc_stats(&e).segment[MN_STAT_ALL].current, 0);
    tc_close(&e);
    free(p), free(len);
}

// ---- threads -----------------------------------------------------------------------------------

typedef struct tc_thread {
    mn_cache *cache;
    mn_stream stream;
    uint64_t seed;
    int errors;
} tc_thread;

static void *tc_thread_main(void *arg) {
    tc_thread *t = (tc_thread *)arg;
    void *live[16] = {0};
    uint64_t x = t->seed;
    int i, k;
    for (i = 0; i < 4000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        k = (int)(x % 16);
        if (live[k]) {
            t->errors += mn_cache_release(t->cache, live[k]) != MN_OK;
            live[k] = NULL;
        } else {
            t->errors += mn_cache_alloc(t->cache, 1 + (x >> 20) % (3 * MIB), t->stream,
                                        MN_CAT_TEMPORARY, NULL, &live[k]) != MN_OK;
        }
    }
    for (k = 0; k < 16; k++) t->errors += mn_cache_release(t->cache, live[k]) != MN_OK;
    return NULL;
}

// Observes while the others allocate: statistics, invariants, empty_cache, snapshots.
static void *tc_observer_main(void *arg) {
    tc_thread *t = (tc_thread *)arg;
    int i;
    for (i = 0; i < 200; i++) {
        struct mn_cache_stats s;
        mn_cache_snapshot snap;
        t->errors += mn_cache_stats(t->cache, &s) != MN_OK;
        t->errors += s.allocated_bytes[MN_STAT_ALL].current > s.reserved_bytes[MN_STAT_ALL].current;
        t->errors += mn_cache_check(t->cache) != MN_OK;
        if (i % 10 == 0) t->errors += mn_cache_empty(t->cache) != MN_OK;
        if (i % 25 == 0 && mn_cache_snapshot_take(t->cache, &snap) == MN_OK)
            mn_cache_snapshot_free(&snap);
    }
    return NULL;
}

static void test_threads(void) {
    tc_env e;
    pthread_t th[5];
    tc_thread arg[5];
    int i;
    struct mn_cache_stats s;
    if (tc_open(&e, 0, NULL, 128) != MN_OK) { CHECK(0); return; }
    arg[4].cache = &e.cache, arg[4].errors = 0;
    CHECK(pthread_create(&th[4], NULL, tc_observer_main, &arg[4]) == 0);
    for (i = 0; i < 4; i++) {
        arg[i].cache = &e.cache, arg[i].stream = (mn_stream)(i % 2), arg[i].errors = 0;
        arg[i].seed = mnt_rand_u64() | 1;
        CHECK(pthread_create(&th[i], NULL, tc_thread_main, &arg[i]) == 0);
    }
    for (i = 0; i < 5; i++) {
        pthread_join(th[i], NULL);
        CHECK_EQ_INT(arg[i].errors, 0);
    }
    s = tc_stats(&e);
    CHECK_EQ_U64(s.allocation[MN_STAT_ALL].current, 0);
    CHECK_EQ_U64(s.allocation[MN_STAT_ALL].allocated, s.allocation[MN_STAT_ALL].freed);
    tc_consistent(&e);
    tc_close(&e);
}

// ---- outputs -----------------------------------------------------------------------------------

static void test_snapshot_json_and_svg(void) {
    tc_env e;
    void *a, *b, *c2;
    mnt_buf out = {NULL, 0, 0};
    mn_cache_snapshot s;
    struct mn_cache_stats st;
    if (tc_open(&e, 0, NULL, 8) != MN_OK) { CHECK(0); return; }
    a = NULL;
    CHECK_OK(mn_cache_alloc(&e.cache, 311 * 411 * 4, 0, MN_CAT_WEIGHTS, "wte \"q\"", &a));
    b = tc_alloc(&e, 3000, 0);
    c2 = tc_alloc(&e, 25 * MIB, 0);
    CHECK_OK(mn_cache_release(&e.cache, b));
    b = tc_alloc(&e, 5 * MIB, 0);
    CHECK_OK(mn_cache_release(&e.cache, c2));
    CHECK_OK(mn_cache_snapshot_take(&e.cache, &s));
    CHECK_EQ_U64(s.trace_count, 8);  // ring buffer keeps the newest 8 entries
    CHECK_EQ_U64(s.trace_dropped, 3);
    CHECK_EQ_INT(s.trace[7].action, MN_TRACE_FREE_COMPLETED);
    CHECK_EQ_U64(s.blocks[0].requested, 311 * 411 * 4);  // the tensor's block, at its address
    CHECK_EQ_U64(s.blocks[0].addr, tc_u(a));
    CHECK_STR(s.blocks[0].label, "wte \"q\"");
    CHECK_OK(mn_cache_snapshot_write_json(&s, mnt_buf_write, &out));
    CHECK(out.p && strncmp(out.p, "{\"segments\":[", 13) == 0);
    CHECK(out.p && strstr(out.p, "\"name\":\"wte \\\"q\\\"\"") != NULL);
    CHECK(out.p && strstr(out.p, "\"device_traces\":[[") != NULL);
    CHECK(out.p && strstr(out.p, "\"state\":\"active_allocated\"") != NULL);
    CHECK(out.p && strstr(out.p, "\"action\":\"free_completed\"") != NULL);
    {
        mn_json_doc doc;
        const mn_json_value *segs, *tr;
        if (out.p && mn_json_parse(out.p, out.n, NULL, &doc) == MN_OK) {
            segs = mn_json_get(doc.root, "segments");
            tr = mn_json_get(doc.root, "device_traces");
            CHECK(segs && segs->type == MN_JSON_ARRAY && segs->len == s.segment_count);
            CHECK(tr && tr->type == MN_JSON_ARRAY && tr->len == 1 && tr->items[0].len == 8);
            mn_json_free(&doc);
        } else {
            CHECK_MSG(0, "snapshot JSON does not parse");
        }
    }
    free(out.p);
    out.p = NULL, out.n = out.cap = 0;
    CHECK_OK(mn_cache_timeline_svg(&s, "test <timeline>", mnt_buf_write, &out));
    CHECK(out.p && strncmp(out.p, "<svg ", 5) == 0);
    CHECK(out.p && strstr(out.p, "weights") && strstr(out.p, "activations"));
    CHECK(out.p && strstr(out.p, "test &lt;timeline&gt;") != NULL);
    CHECK(out.p && strstr(out.p, "</svg>\n") != NULL);
    free(out.p);
    mn_cache_snapshot_free(&s);
    // per-category statistics and the breakdown at the allocated peak
    st = tc_stats(&e);
    CHECK_EQ_U64(st.cat_allocated_bytes[MN_CAT_WEIGHTS].current, 311 * 411 * 4 / 512 * 512 + 512);
    CHECK_EQ_U64(st.cat_allocated_bytes[MN_CAT_ACTIVATIONS].current, 5 * MIB);
    CHECK_EQ_U64(st.cat_at_peak[MN_CAT_ACTIVATIONS], 26 * MIB + 5 * MIB);  // 25 MiB -> 26 whole
    CHECK_EQ_U64(st.cat_allocation[MN_CAT_ACTIVATIONS].allocated, 3);
    {
        mnt_buf tab = {NULL, 0, 0};
        CHECK_OK(mn_cache_category_summary_write(&st, mnt_buf_write, &tab));
        CHECK(tab.p && strstr(tab.p, "activations") && strstr(tab.p, "31.00 MiB"));
        CHECK(tab.p && strstr(tab.p, "gradients") == NULL);  // unused categories are left out
        free(tab.p);
    }
    mn_cache_reset_peak_stats(&e.cache);
    st = tc_stats(&e);
    CHECK_EQ_U64(st.allocated_bytes[MN_STAT_ALL].peak, st.allocated_bytes[MN_STAT_ALL].current);
    CHECK_EQ_U64(st.cat_at_peak[MN_CAT_ACTIVATIONS], 5 * MIB);
    mn_cache_reset_accumulated_stats(&e.cache);
    st = tc_stats(&e);
    CHECK_EQ_U64(st.allocation[MN_STAT_ALL].allocated, 0);
    CHECK_EQ_U64(st.num_device_alloc, 0);
    CHECK_OK(mn_cache_release(&e.cache, a));
    CHECK_OK(mn_cache_release(&e.cache, b));
    tc_close(&e);
}

// Every allocated block is found by its address and a released one is not, whichever index holds
// it (the 8 blocks handed out last stay out of the address map): random allocations and releases
// around 40 live blocks (the map grows and its probe runs shift back), each release of a random
// live block, the newest or one of the last few handed out, followed by a second one that must
// fail, an address inside a block refused, record_stream (a lookup) on a live block, the cache
// checked after every step of the first 1000 and as it goes.
static void test_address_lookup(void) {
    enum { N = 200 };
    tc_env e;
    void *live[N];
    int n = 0, step;
    if (tc_open(&e, 0, NULL, 16) != MN_OK) {
        CHECK(0);
        return;
    }
    for (step = 0; step < 4000; step++) {
        uint64_t r = mnt_rand_u64() % 100;
        if (n == N || (n > 0 && r < (uint64_t)(n > 40 ? 60 : 35))) {
            // live[] is in the order of allocation: a random one, the newest, or one of the 12 last
            uint64_t w = mnt_rand_u64() % 3, back = mnt_rand_u64() % 12;
            int k = w == 0 ? (int)(mnt_rand_u64() % (uint64_t)n) : w == 1 ? n - 1
                    : back < (uint64_t)n ? n - 1 - (int)back : 0;
            if (r % 5 == 0)  // (blocks start on 512-byte boundaries: no block starts there)
                CHECK_ERR(mn_cache_release(&e.cache, (char *)live[k] + 256), MN_ERR_INVALID_ARG);
            if (r % 7 == 0) CHECK_OK(mn_cache_record_stream(&e.cache, live[k], 0));
            CHECK_OK(mn_cache_release(&e.cache, live[k]));
            CHECK_ERR(mn_cache_release(&e.cache, live[k]), MN_ERR_INVALID_ARG);
            memmove(&live[k], &live[k + 1], (size_t)(--n - k) * sizeof live[0]);
        } else {
            live[n++] = tc_alloc(&e, 512 + mnt_rand_u64() % (4 * MIB), 0);
        }
        if (step < 1000) CHECK_OK(mn_cache_check(&e.cache));
        if (step % 250 == 0) tc_consistent(&e);
    }
    while (n > 0) CHECK_OK(mn_cache_release(&e.cache, live[--n]));
    tc_consistent(&e);
    CHECK_EQ_U64(tc_stats(&e).allocation[MN_STAT_ALL].current, 0);
    tc_close(&e);
}

static void test_many_blocks_and_plain_device(void) {
    enum { N = 3000 };
    tc_env e;
    void **p = (void **)malloc(N * sizeof *p);
    mn_cache c2;
    mn_cache_desc cd;
    mn_cache_config cfg;
    mn_cache_snapshot snap;
    struct mn_cache_stats s;
    void *a, *b;
    int i;
    mn_event ev = 0;
    if (!p || tc_open(&e, 0, "max_split_size_mb:200", 16) != MN_OK) { free(p); CHECK(0); return; }
    for (i = 0; i < N; i++) p[i] = tc_alloc(&e, 512 + (mnt_rand_u64() % 16) * 512, 0);  // map grows
    tc_consistent(&e);
    for (i = N - 1; i > 0; i--) {  // free in random order
        int k = (int)(mnt_rand_u64() % (uint64_t)(i + 1));
        void *t = p[k];
        p[k] = p[i], p[i] = t;
    }
    for (i = 0; i < N; i++) CHECK_OK(mn_cache_release(&e.cache, p[i]));
    s = tc_stats(&e);
    CHECK_EQ_U64(s.inactive_split[MN_STAT_ALL].current, 0);  // every segment merged back whole
    tc_consistent(&e);
    CHECK_OK(mn_cache_config_get(&e.cache, &cfg));
    CHECK_EQ_U64(cfg.max_split_size, 200 * MIB);
    mnt_fail_alloc_after(1);  // a snapshot without host memory fails cleanly
    CHECK_ERR(mn_cache_snapshot_take(&e.cache, &snap), MN_ERR_OUT_OF_MEMORY);
    mnt_fail_alloc_after(0);
    CHECK_OK(mn_cache_snapshot_take(&e.cache, &snap));
    {
        mnt_buf out = {NULL, 0, 0};
        CHECK_OK(mn_cache_snapshot_write_json(&snap, mnt_buf_write, &out));
        CHECK(out.p && strstr(out.p, "\"max_split_size\":209715200") != NULL);
        free(out.p);
    }
    mn_cache_snapshot_free(&snap);
    // events completed one by one by hand
    CHECK_OK(mn_simdev_device(&e.dev).event_record_fn(&e.dev, 5, &ev));
    CHECK_EQ_U64(mn_simdev_pending_events(&e.dev), 1);
    mn_simdev_complete_event(&e.dev, ev);
    CHECK_EQ_U64(mn_simdev_pending_events(&e.dev), 0);
    mn_simdev_device(&e.dev).event_free_fn(&e.dev, ev);
    tc_close(&e);
    free(p);
    // a device without events: a block used on another stream is reusable at once
    {
        mn_simdev_desc dd;
        memset(&dd, 0, sizeof dd);
        dd.capacity = 30 * MIB;
        CHECK_OK(mn_simdev_init(&e.dev, &dd));
    }
    memset(&cd, 0, sizeof cd);
    cd.device = mn_simdev_device(&e.dev);
    cd.device.event_record_fn = NULL, cd.device.event_query_fn = NULL;
    cd.device.event_sync_fn = NULL, cd.device.event_free_fn = NULL;
    cd.device.mem_info_fn = NULL;
    CHECK_OK(mn_cache_init(&c2, &cd));
    CHECK_OK(mn_cache_alloc(&c2, 4 * MIB, 0, MN_CAT_OTHER, NULL, &a));
    CHECK_OK(mn_cache_record_stream(&c2, a, 1));
    CHECK_OK(mn_cache_release(&c2, a));
    CHECK_OK(mn_cache_alloc(&c2, 4 * MIB, 0, MN_CAT_OTHER, NULL, &b));
    CHECK(a == b);
    CHECK_ERR(mn_cache_set_memory_fraction(&c2, 0.5), MN_ERR_UNSUPPORTED);  // no mem_info
    CHECK_ERR(mn_cache_alloc(&c2, 40 * MIB, 0, MN_CAT_OTHER, NULL, &a), MN_ERR_DEVICE_OOM);
    {
        char msg[1024];
        mn_cache_oom_message(&c2, msg, sizeof msg);  // no mem_info: zeros, still the wording
        CHECK(strstr(msg, "has a total capacity of 0 bytes of which 0 bytes is free") != NULL);
    }
    CHECK_OK(mn_cache_release(&c2, b));
    CHECK_OK(mn_cache_check(&c2));
    mn_cache_free(&c2);
    CHECK_EQ_U64(e.dev.used, 0);
    mn_simdev_free(&e.dev);
}

static void test_bad_arguments(void) {
    mn_cache c;
    mn_cache_desc d;
    mn_simdev dev;
    void *p;
    memset(&d, 0, sizeof d);
    CHECK_ERR(mn_cache_init(&c, &d), MN_ERR_INVALID_ARG);  // no device
    CHECK_ERR(mn_cache_init(&c, NULL), MN_ERR_INVALID_ARG);
    CHECK_OK(mn_simdev_init(&dev, NULL));
    d.device = mn_simdev_device(&dev);
    d.config = "bogus:1";
    CHECK_ERR(mn_cache_init(&c, &d), MN_ERR_CONFIG);
    d.device.map_fn = NULL;
    d.config = "expandable_segments:True";
    CHECK_ERR(mn_cache_init(&c, &d), MN_ERR_UNSUPPORTED);
    d.device = mn_simdev_device(&dev);
    d.config = NULL;
    CHECK_OK(mn_cache_init(&c, &d));
    CHECK_ERR(mn_cache_alloc(&c, 10, 0, MN_CAT_COUNT, NULL, &p), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_cache_release(&c, (void *)(uintptr_t)0x1234), MN_ERR_INVALID_ARG);
    mn_cache_free(&c);
    mn_cache_free(&c);  // twice is harmless
    mn_simdev_free(&dev);
}

// ---- memanat replay, end to end ---------------------------------------------------------------

static int tc_run(const char *cmd, char *out, size_t cap) {
    FILE *f = popen(cmd, "r");
    size_t n = 0;
    int st;
    if (!f) return -1;
    while (n + 1 < cap) {
        size_t k = fread(out + n, 1, cap - 1 - n, f);
        if (k == 0) break;
        n += k;
    }
    out[n] = 0;
    st = pclose(f);
    return st;
}

static void test_replay_cli(void) {
    char dir[] = "/tmp/memanat_cache_XXXXXX", path[128], jpath[128], spath[128], cmd[512];
    static char out[65536], out_big[65536];
    FILE *f;
    int i;
    const char *cli = mnt_cli_path();
    if (access(cli, X_OK) != 0) SKIP("the CLI is not built (make test builds it)");
    snprintf(cmd, sizeof cmd, "%s replay 2>&1", cli);  // no file: the usage, and exit 2
    CHECK_EQ_INT(WEXITSTATUS(tc_run(cmd, out, sizeof out)), 2);
    CHECK(strstr(out, "memanat replay FILE") != NULL);
    {  // the samples in the repository
        snprintf(cmd, sizeof cmd, "%s replay test/data/cache_rmm_sample.csv --json 2>&1", cli);
        CHECK_EQ_INT(tc_run(cmd, out, sizeof out), 0);
        // 4 MiB and 12 MiB share one 20 MiB segment, 1000 B a small one, stream 0x55d0c0a0 its own
        CHECK(strstr(out, "\"allocated_bytes.all.peak\": 19923968,") != NULL);
        CHECK(strstr(out, "\"reserved_bytes.all.peak\": 44040192,") != NULL);
        CHECK(strstr(out, "\"segment.all.current\": 3,") != NULL);
        CHECK(strstr(out, "\"replay.allocations\": 5, \"replay.frees\": 5, "
                          "\"replay.unmatched_frees\": 0, \"replay.failed\": 0}") != NULL);
        snprintf(cmd, sizeof cmd, "%s replay test/data/cache_snapshot_sample.json --capacity 40MiB"
                 " 2>&1", cli);
        CHECK_EQ_INT(tc_run(cmd, out, sizeof out), 0);
        CHECK(strstr(out, "CUDA OOMs: 1 ") != NULL);
        CHECK(strstr(out, "Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 40.00 MiB of "
                          "which 0 bytes is free.") != NULL);
        CHECK(strstr(out, "peak allocated: 20971520 B") != NULL);  // the 128 KiB one failed
    }
    if (!mkdtemp(dir)) SKIP("mkdtemp failed");
    snprintf(path, sizeof path, "%s/trace.csv", dir);
    f = fopen(path, "w");
    if (!f) SKIP("cannot write a temporary file");
    fprintf(f, "Thread,Time,Action,Pointer,Size,Stream\n");
    // 10 x 5 MiB live at once in a 20 MiB-segment world: peaks known exactly
    for (i = 0; i < 10; i++)
        fprintf(f, "140,10:00:00.%06d,allocate,0x7f00%04x0000,%llu,0x0\n", i, i,
                (unsigned long long)(5 * MIB));
    for (i = 0; i < 10; i++) fprintf(f, "140,10:00:01.%06d,free,0x7f00%04x0000,%llu,0x0\n", i, i,
                                     (unsigned long long)(5 * MIB));
    fprintf(f, "140,10:00:02.000000,allocate failure,(nil),123,0x0\n");
    fprintf(f, "140,10:00:02.000001,allocate,0x1000,100,0x0\n");
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s replay %s --json 2>&1", cli, path);
    CHECK_EQ_INT(tc_run(cmd, out, sizeof out), 0);
    CHECK(strstr(out, "\"allocated_bytes.all.peak\": 52428800") != NULL);
    CHECK(strstr(out, "\"reserved_bytes.large_pool.peak\": 62914560") != NULL);  // 3 x 20 MiB
    CHECK(strstr(out, "\"reserved_bytes.all.peak\": 65011712") != NULL);  // + 2 MiB small
    CHECK(strstr(out, "\"segment.all.peak\": 4") != NULL);
    CHECK(strstr(out, "\"num_ooms\": 0") != NULL);
    // with a capacity of 50 MiB only two segments fit: OOMs are counted and the replay goes on
    snprintf(spath, sizeof spath, "%s/t.svg", dir);
    snprintf(cmd, sizeof cmd, "%s replay %s --capacity 50MiB --svg %s 2>&1", cli, path, spath);
    CHECK_EQ_INT(tc_run(cmd, out, sizeof out), 0);
    CHECK(strstr(out, "PyTorch CUDA memory summary") != NULL);
    CHECK(strstr(out, "CUDA OOMs: 2 ") != NULL);
    f = fopen(spath, "r");
    CHECK(f != NULL);
    if (f) fclose(f);
    remove(spath);
    // PyTorch snapshot JSON device_traces
    snprintf(jpath, sizeof jpath, "%s/snap.json", dir);
    f = fopen(jpath, "w");
    if (f) {
        fprintf(f, "{\"segments\": [], \"device_traces\": [[\n"
                   "{\"action\": \"segment_alloc\", \"addr\": 1000, \"size\": 2097152, \"stream\": 0},\n"
                   "{\"action\": \"alloc\", \"addr\": 1000, \"size\": 4000, \"stream\": 0},\n"
                   "{\"action\": \"alloc\", \"addr\": 5096, \"size\": 3000000, \"stream\": 7},\n"
                   "{\"action\": \"free_requested\", \"addr\": 1000, \"size\": 4000, \"stream\": 0},\n"
                   "{\"action\": \"free_completed\", \"addr\": 1000, \"size\": 4000, \"stream\": 0}\n"
                   "]]}\n");
        fclose(f);
        snprintf(cmd, sizeof cmd, "%s replay %s --json --config max_split_size_mb:64 2>&1",
                 cli, jpath);
        CHECK_EQ_INT(tc_run(cmd, out, sizeof out), 0);
        CHECK(strstr(out, "\"allocated_bytes.all.peak\": 3004416") != NULL);  // 4096 + 3000320
        CHECK(strstr(out, "\"reserved_bytes.all.current\": 23068672") != NULL);
        CHECK(strstr(out, "\"max_split_size\": 67108864") != NULL);
        remove(jpath);
    }
    {  // round trip: our own snapshot's device_traces replay to the same peaks
        tc_env e;
        void *live[64];
        int n = 0, k;
        struct mn_cache_stats st;
        mn_cache_snapshot snap;
        char want[96];
        if (tc_open(&e, 0, NULL, 4096) == MN_OK) {
            for (k = 0; k < 600; k++) {
                if (n < 64 && mnt_rand_u64() % 2) {
                    CHECK_OK(mn_cache_alloc(&e.cache, tc_rand_size(), (mn_stream)(mnt_rand_u64() % 2),
                                            MN_CAT_OTHER, NULL, &live[n]));
                    n++;
                } else if (n > 0) {
                    int j = (int)(mnt_rand_u64() % (uint64_t)n);
                    CHECK_OK(mn_cache_release(&e.cache, live[j]));
                    live[j] = live[--n];
                }
            }
            st = tc_stats(&e);
            CHECK_OK(mn_cache_snapshot_take(&e.cache, &snap));
            CHECK_EQ_U64(snap.trace_dropped, 0);
            f = fopen(jpath, "w");
            if (f) {
                mnt_buf out = {NULL, 0, 0};
                CHECK_OK(mn_cache_snapshot_write_json(&snap, mnt_buf_write, &out));
                if (out.p) fwrite(out.p, 1, out.n, f);
                fclose(f);
                free(out.p);
                snprintf(cmd, sizeof cmd, "%s replay %s --json 2>&1", cli, jpath);
                CHECK_EQ_INT(tc_run(cmd, out_big, sizeof out_big), 0);
                snprintf(want, sizeof want, "\"allocated_bytes.all.peak\": %llu,",
                         (unsigned long long)st.allocated_bytes[MN_STAT_ALL].peak);
                CHECK_MSG(strstr(out_big, want) != NULL, "replay lacks %s", want);
                snprintf(want, sizeof want, "\"reserved_bytes.all.peak\": %llu,",
                         (unsigned long long)st.reserved_bytes[MN_STAT_ALL].peak);
                CHECK_MSG(strstr(out_big, want) != NULL, "replay lacks %s", want);
                snprintf(want, sizeof want, "\"requested_bytes.all.current\": %llu,",
                         (unsigned long long)st.requested_bytes[MN_STAT_ALL].current);
                CHECK_MSG(strstr(out_big, want) != NULL, "replay lacks %s", want);
                remove(jpath);
            }
            mn_cache_snapshot_free(&snap);
            while (n > 0) CHECK_OK(mn_cache_release(&e.cache, live[--n]));
            tc_close(&e);
        }
    }
    // bad input: one line on stderr, non-zero exit
    snprintf(cmd, sizeof cmd, "%s replay %s --config bogus:1 2>&1", cli, path);
    CHECK(tc_run(cmd, out, sizeof out) != 0);
    CHECK(strstr(out, "bogus") != NULL);
    snprintf(cmd, sizeof cmd, "%s replay %s/missing.csv 2>&1", cli, dir);
    CHECK(tc_run(cmd, out, sizeof out) != 0);
    f = fopen(path, "w");
    if (f) {
        fprintf(f, "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,12x,0x0\n");
        fclose(f);
    }
    snprintf(cmd, sizeof cmd, "%s replay %s 2>&1", cli, path);
    CHECK(tc_run(cmd, out, sizeof out) != 0);
    CHECK(strstr(out, "line 2") != NULL);
    remove(path);
    rmdir(dir);
}

// ---- shared pieces: mn_sim_cache, mn_cache_replay, mn_cache_write_file, stats items ------------

// A random trace over nids ids: fresh ids of any value (0 and UINT64_MAX included), frees of
// ids never allocated, allocations of ids still live, several streams and categories; an event
// allocates with probability alloc_pct percent.
static mn_trace_event *tc_random_trace_ids(size_t n, size_t nids, unsigned alloc_pct) {
    mn_trace_event *ev = (mn_trace_event *)calloc(n, sizeof *ev);
    uint64_t *ids = (uint64_t *)malloc(nids * sizeof *ids);
    size_t i;
    if (!ev || !ids) {
        free(ev), free(ids);
        return NULL;
    }
    for (i = 0; i < nids; i++) ids[i] = mnt_rand_u64();
    ids[0] = 0, ids[1] = UINT64_MAX;
    for (i = 0; i < n; i++) {
        ev[i].id = mnt_rand_u64() % 50 == 0 ? mnt_rand_u64() : ids[mnt_rand_u64() % nids];
        ev[i].alloc = (uint8_t)(mnt_rand_u64() % 100 < alloc_pct);
        ev[i].size = ev[i].alloc ? tc_rand_size() : 0;
        ev[i].stream = (uint32_t)(mnt_rand_u64() % 3);
        ev[i].category = (uint8_t)(mnt_rand_u64() % MN_CAT_COUNT);
        ev[i].phase = (uint8_t)(mnt_rand_u64() % MN_PHASE_COUNT);
    }
    free(ids);
    return ev;
}

static mn_trace_event *tc_random_trace(size_t n) { return tc_random_trace_ids(n, 16, 50); }

// The replay's rules written out the slow way: a list of live (id, block) pairs. Returns the
// most blocks live at once.
static size_t tc_replay_reference(mn_cache *c, const mn_trace_event *ev, size_t n,
                                  mn_replay_counts *cnt) {
    uint64_t *live_id = (uint64_t *)malloc((n + 1) * sizeof *live_id);
    void **live = (void **)malloc((n + 1) * sizeof *live);
    size_t nlive = 0, most = 0, i, k;
    memset(cnt, 0, sizeof *cnt);
    CHECK(live_id && live);
    if (!live_id || !live) n = 0;
    for (i = 0; i < n; i++) {
        void *p = NULL;
        mn_result r;
        for (k = 0; k < nlive && live_id[k] != ev[i].id; k++) continue;
        if (ev[i].alloc) cnt->allocations++;
        else cnt->frees++;
        if (k < nlive) {  // a free, or an allocation of a live id: the old block goes
            CHECK_OK(mn_cache_release(c, live[k]));
            live[k] = live[nlive - 1], live_id[k] = live_id[nlive - 1], nlive--;
        } else if (!ev[i].alloc) {
            cnt->unmatched_frees++;
        }
        if (!ev[i].alloc) continue;
        r = mn_cache_alloc(c, ev[i].size, ev[i].stream, (mn_category)ev[i].category,
                           ev[i].phase ? mn_phase_name((mn_phase)ev[i].phase) : NULL, &p);
        if (r == MN_ERR_DEVICE_OOM) {
            cnt->failed++;
            continue;
        }
        CHECK_OK(r);
        if (p) live_id[nlive] = ev[i].id, live[nlive++] = p;
        most = nlive > most ? nlive : most;
    }
    free(live_id), free(live);
    return most;
}

static void test_replay_matches_reference(void) {
    const uint64_t capacities[2] = {0, 200 * MIB};
    int round;
    for (round = 0; round < 2; round++) {
        size_t n = 3000;
        mn_trace_event *ev = tc_random_trace(n);
        tc_env a, b;
        mn_replay_counts got, want;
        struct mn_cache_stats sa, sb;
        CHECK(ev != NULL);
        if (!ev) return;
        CHECK_OK(tc_open(&a, capacities[round], NULL, 0));
        CHECK_OK(tc_open(&b, capacities[round], NULL, 0));
        CHECK_OK(mn_cache_replay(&a.cache, ev, n, 0, &got));
        tc_replay_reference(&b.cache, ev, n, &want);
        CHECK_EQ_U64(got.allocations, want.allocations);
        CHECK_EQ_U64(got.frees, want.frees);
        CHECK_EQ_U64(got.unmatched_frees, want.unmatched_frees);
        CHECK_EQ_U64(got.failed, want.failed);
        CHECK(got.unmatched_frees > 0);
        sa = tc_stats(&a), sb = tc_stats(&b);
        CHECK(memcmp(&sa, &sb, sizeof sa) == 0);
        CHECK_EQ_U64(sa.num_ooms, got.failed);
        if (round == 1) CHECK(got.failed > 0);
        CHECK_OK(mn_cache_check(&a.cache));
        tc_close(&a);
        // release_live: nothing is left, the peak is the same, and the trace replays again
        CHECK_OK(tc_open(&a, capacities[round], NULL, 0));
        CHECK_OK(mn_cache_replay(&a.cache, ev, n, 1, NULL));
        sa = tc_stats(&a);
        CHECK_EQ_U64(sa.allocation[MN_STAT_ALL].current, 0);
        CHECK_EQ_U64(sa.allocated_bytes[MN_STAT_ALL].peak, sb.allocated_bytes[MN_STAT_ALL].peak);
        mn_cache_reset_peak_stats(&a.cache);
        CHECK_OK(mn_cache_replay(&a.cache, ev, n, 1, NULL));
        sa = tc_stats(&a);
        CHECK_EQ_U64(sa.allocation[MN_STAT_ALL].current, 0);
        if (round == 0)  // unlimited: nothing fails, so the bytes asked for peak as before (the
                         // block sizes may not: a cached block is handed out whole, unsplit)
            CHECK_EQ_U64(sa.requested_bytes[MN_STAT_ALL].peak,
                         sb.requested_bytes[MN_STAT_ALL].peak);
        tc_close(&a);
        tc_close(&b);
        free(ev);
    }
}

typedef struct tc_idx { uint64_t id; size_t at; } tc_idx;
static int tc_idx_cmp(const void *x, const void *y) {
    const tc_idx *a = (const tc_idx *)x, *b = (const tc_idx *)y;
    if (a->id != b->id) return a->id < b->id ? -1 : 1;
    return a->at < b->at ? -1 : a->at > b->at;
}

// Thousands of blocks live at once under ids of any value: the replay's hash table grows (and
// removes with its probe runs) many times; the same cache as the slow list's, and as the same
// trace with its ids renamed 0, 1, 2, ... (the plain array the replay takes for dense ids).
static void test_replay_many_live_ids(void) {
    size_t n = 20000, most, i, j;
    mn_trace_event *ev = tc_random_trace_ids(n, 6000, 70), *dense;
    tc_idx *ix;
    tc_env a, b, d;
    mn_replay_counts got, want, got_d;
    struct mn_cache_stats sa, sb, sd;
    CHECK(ev != NULL);
    if (!ev) return;
    dense = (mn_trace_event *)malloc(n * sizeof *dense);
    ix = (tc_idx *)malloc(n * sizeof *ix);
    CHECK(dense && ix);
    if (!dense || !ix) {
        free(ev), free(dense), free(ix);
        return;
    }
    for (i = 0; i < n; i++) dense[i] = ev[i], ix[i].id = ev[i].id, ix[i].at = i;
    qsort(ix, n, sizeof *ix, tc_idx_cmp);
    for (i = 0; i < n; i = j)  // an id is named by the event where it first appears
        for (j = i; j < n && ix[j].id == ix[i].id; j++) dense[ix[j].at].id = ix[i].at;
    CHECK_OK(tc_open(&a, 0, NULL, 0));
    CHECK_OK(tc_open(&b, 0, NULL, 0));
    CHECK_OK(tc_open(&d, 0, NULL, 0));
    CHECK_OK(mn_cache_replay(&a.cache, ev, n, 0, &got));
    most = tc_replay_reference(&b.cache, ev, n, &want);
    CHECK_OK(mn_cache_replay(&d.cache, dense, n, 0, &got_d));
    CHECK_MSG(most > 2048, "only %zu blocks live at once", most);
    CHECK(memcmp(&got, &want, sizeof got) == 0 && memcmp(&got, &got_d, sizeof got) == 0);
    sa = tc_stats(&a), sb = tc_stats(&b), sd = tc_stats(&d);
    CHECK(memcmp(&sa, &sb, sizeof sa) == 0 && memcmp(&sa, &sd, sizeof sa) == 0);
    CHECK_OK(mn_cache_check(&a.cache));
    tc_close(&a), tc_close(&b), tc_close(&d);
    free(ev), free(dense), free(ix);
}

static mn_result tc_replay_once(void *ctx) {
    tc_env e;
    mn_result r = tc_open(&e, 0, NULL, 0);
    if (r != MN_OK) return r;
    r = mn_cache_replay(&e.cache, (const mn_trace_event *)ctx, 500, 1, NULL);
    mn_sim_cache_free(&e);
    return r;
}

static void test_replay_edges(void) {
    mn_trace_event ev[4];
    mn_replay_counts cnt;
    mn_cache_snapshot snap;
    tc_env e;
    long before = mnt_live_allocs(), k;
    int n_bare, n_opt;
    mn_trace_event *big = tc_random_trace(500);
    memset(ev, 0, sizeof ev);
    ev[0].id = 7, ev[0].alloc = 1, ev[0].size = 1000, ev[0].phase = MN_PHASE_BACKWARD;
    ev[1].id = 7, ev[1].alloc = 1, ev[1].size = 3000;  // live id: the first block is released
    ev[2].id = 8;                                       // never allocated
    ev[3].id = 9, ev[3].alloc = 1, ev[3].size = 0;      // size 0: no block, so its id stays free
    CHECK_OK(tc_open(&e, 0, NULL, 64));
    CHECK_OK(mn_cache_replay(&e.cache, ev, 4, 0, &cnt));
    CHECK_EQ_U64(cnt.allocations, 3);
    CHECK_EQ_U64(cnt.frees, 1);
    CHECK_EQ_U64(cnt.unmatched_frees, 1);
    CHECK_EQ_U64(tc_stats(&e).allocation[MN_STAT_ALL].current, 1);
    CHECK_EQ_U64(tc_stats(&e).allocated_bytes[MN_STAT_ALL].current, 3072);
    // a second replay has a map of its own: the first replay's block stays, the new one is
    // labelled with its phase
    ev[1].phase = MN_PHASE_OPTIMIZER;
    CHECK_OK(mn_cache_replay(&e.cache, ev, 2, 0, NULL));
    CHECK_OK(mn_cache_snapshot_take(&e.cache, &snap));
    for (k = 0, n_bare = 0, n_opt = 0; k < (long)snap.block_count; k++) {
        if (snap.blocks[k].state != MN_BLOCK_ACTIVE_ALLOCATED) continue;
        n_bare += snap.blocks[k].label[0] == 0;
        n_opt += strcmp(snap.blocks[k].label, "optimizer") == 0;
    }
    CHECK_EQ_INT(n_bare, 1);
    CHECK_EQ_INT(n_opt, 1);
    mn_cache_snapshot_free(&snap);
    CHECK_ERR(mn_cache_replay(NULL, ev, 4, 0, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_cache_replay(&e.cache, NULL, 4, 0, NULL), MN_ERR_INVALID_ARG);
    CHECK_OK(mn_cache_replay(&e.cache, NULL, 0, 1, NULL));  // releases only its own blocks
    CHECK_EQ_U64(tc_stats(&e).allocation[MN_STAT_ALL].current, 2);
    tc_close(&e);
    // host allocation failures: an error and no leak, then success
    for (k = 1; big; k++) {
        mn_result r;
        mnt_fail_alloc_after(k);
        r = tc_replay_once(big);
        mnt_fail_alloc_after(0);
        CHECK_EQ_INT(mnt_live_allocs(), before);
        if (r == MN_OK) break;
        CHECK_ERR(r, MN_ERR_OUT_OF_MEMORY);
        if (k > 100) {
            CHECK_MSG(0, "replay still failing after %ld injected failures", k);
            break;
        }
    }
    free(big);
}

static void test_sim_cache(void) {
    mn_sim_cache sc;
    mn_simdev_desc dd;
    mn_cache_desc cd;
    void *p = NULL;
    long before = mnt_live_allocs();
    memset(&dd, 0, sizeof dd);
    memset(&cd, 0, sizeof cd);
    CHECK_OK(mn_sim_cache_init(&sc, NULL, NULL));  // unlimited, PyTorch's defaults
    CHECK_OK(mn_cache_alloc(&sc.cache, 5 * MIB, 0, MN_CAT_WEIGHTS, NULL, &p));
    CHECK_EQ_U64(sc.dev.used, 20 * MIB);
    CHECK_OK(mn_cache_release(&sc.cache, p));
    mn_sim_cache_free(&sc);
    dd.capacity = 64 * MIB;
    cd.config = "expandable_segments:True";
    CHECK_OK(mn_sim_cache_init(&sc, &dd, &cd));
    CHECK_OK(mn_cache_alloc(&sc.cache, 5 * MIB, 0, MN_CAT_WEIGHTS, NULL, &p));
    CHECK_EQ_U64(sc.dev.used, 20 * MIB);  // the large pool maps 20 MiB pages
    CHECK_ERR(mn_cache_alloc(&sc.cache, 65 * MIB, 0, MN_CAT_WEIGHTS, NULL, &p), MN_ERR_DEVICE_OOM);
    mn_sim_cache_free(&sc);
    CHECK_EQ_INT(mnt_live_allocs(), before);
    cd.config = "expandable_segments:Maybe";
    CHECK_ERR(mn_sim_cache_init(&sc, &dd, &cd), MN_ERR_CONFIG);  // nothing left to free
    CHECK_EQ_INT(mnt_live_allocs(), before);
    CHECK_ERR(mn_sim_cache_init(NULL, &dd, NULL), MN_ERR_INVALID_ARG);
    mn_sim_cache_free(NULL);
}

static void test_write_file(void) {
    tc_env e;
    struct mn_cache_stats st;
    mnt_buf want = {NULL, 0, 0};
    char got[8192];
    size_t n;
    FILE *f = tmpfile();
    CHECK_OK(tc_open(&e, 0, NULL, 0));
    tc_alloc(&e, 3 * MIB, 0);
    st = tc_stats(&e);
    CHECK_OK(mn_cache_summary_write(&st, 0, 0, mnt_buf_write, &want));
    CHECK(f != NULL && want.p != NULL);
    if (f && want.p) {
        CHECK_OK(mn_cache_summary_write(&st, 0, 0, mn_cache_write_file, f));
        rewind(f);
        n = fread(got, 1, sizeof got, f);
        CHECK_EQ_U64(n, want.n);
        CHECK(n == want.n && memcmp(got, want.p, n) == 0);
    }
    if (f) fclose(f);
    free(want.p);
    f = fopen("/dev/null", "rb");  // a stream that cannot be written
    if (f) {
        setvbuf(f, NULL, _IONBF, 0);
        CHECK_ERR(mn_cache_write_file(f, "x", 1), MN_ERR_IO);
        fclose(f);
    }
    CHECK_ERR(mn_cache_write_file(NULL, "x", 1), MN_ERR_INVALID_ARG);
    tc_close(&e);
}

static mn_result tc_body_text(void *ctx, FILE *f) {
    return fputs((const char *)ctx, f) < 0 ? MN_ERR_IO : MN_OK;
}

static mn_result tc_body_fail(void *ctx, FILE *f) {
    (void)ctx;
    fputs("partial", f);
    return MN_ERR_DEVICE;
}

static void tc_expect_file(const char *path, const char *want) {
    char got[64] = {0};
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    if (!f) return;
    CHECK(fread(got, 1, sizeof got - 1, f) == strlen(want));
    fclose(f);
    CHECK_STR(got, want);
}

// mn_write_file_atomic: the content arrives whole, or an earlier file stays and no temporary is
// left behind.
static void test_write_file_atomic(void) {
    char dir[] = "/tmp/memanat_atomic_XXXXXX", path[96], tmp[112], bad[112];
    char text[] = "first";
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/out.txt", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK_OK(mn_write_file_atomic(path, tc_body_text, text));
    tc_expect_file(path, "first");
    CHECK_ERR(mn_write_file_atomic(path, tc_body_fail, NULL), MN_ERR_DEVICE);  // body's result
    tc_expect_file(path, "first");
    CHECK(access(tmp, F_OK) != 0);
    snprintf(bad, sizeof bad, "%s/missing/out.txt", dir);
    CHECK_ERR(mn_write_file_atomic(bad, tc_body_text, text), MN_ERR_IO);
    CHECK_ERR(mn_write_file_atomic(dir, tc_body_text, text), MN_ERR_IO);  // rename over a folder
    snprintf(bad, sizeof bad, "%s.tmp", dir);
    CHECK(access(bad, F_OK) != 0);
    CHECK_ERR(mn_write_file_atomic(NULL, tc_body_text, text), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_write_file_atomic(path, NULL, text), MN_ERR_INVALID_ARG);
    CHECK_EQ_INT(remove(path), 0);
    CHECK_EQ_INT(rmdir(dir), 0);
}

static int64_t tc_item(const mn_stat_item *it, uint32_t n, const char *key) {
    uint32_t i;
    for (i = 0; i < n; i++)
        if (strcmp(it[i].key, key) == 0) return it[i].value;
    CHECK_MSG(0, "memory_stats has no key %s", key);
    return -2;
}

static void test_stats_items(void) {
    static const char *const pools[3] = {"all", "small_pool", "large_pool"};
    mn_stat_item it[MN_CACHE_STATS_ITEMS + 1];
    struct mn_cache_stats st;
    tc_env e;
    uint32_t n, i;
    int t;
    char key[64];
    CHECK_EQ_U64(MN_CACHE_STATS_ITEMS, 9 * 3 * 4 + 2 * 4 + 5 + 1);  // the PyTorch set
    CHECK_OK(tc_open(&e, 0, "max_split_size_mb:64", 0));
    for (i = 0; i < 200; i++) {
        void *p = tc_alloc(&e, tc_rand_size(), (mn_stream)(i % 2));
        if (i % 3) CHECK_OK(mn_cache_release(&e.cache, p));
    }
    st = tc_stats(&e);
    memset(it, 0x5a, sizeof it);
    CHECK_EQ_U64(mn_cache_stats_items(&st, it, MN_CACHE_STATS_ITEMS - 1), MN_CACHE_STATS_ITEMS);
    CHECK(it[0].key[0] == 0x5a);  // too small: nothing written
    n = mn_cache_stats_items(&st, it, MN_CACHE_STATS_ITEMS + 1);
    CHECK_EQ_U64(n, MN_CACHE_STATS_ITEMS);
    for (i = 1; i < n; i++) CHECK_MSG(strcmp(it[i - 1].key, it[i].key) < 0, "%s before %s",
                                      it[i - 1].key, it[i].key);
    for (t = 0; t < 3; t++) {  // each value is its field
        snprintf(key, sizeof key, "allocated_bytes.%s.peak", pools[t]);
        CHECK_EQ_INT(tc_item(it, n, key), (int64_t)st.allocated_bytes[t].peak);
        snprintf(key, sizeof key, "inactive_split.%s.current", pools[t]);
        CHECK_EQ_INT(tc_item(it, n, key), (int64_t)st.inactive_split[t].current);
        snprintf(key, sizeof key, "requested_bytes.%s.freed", pools[t]);
        CHECK_EQ_INT(tc_item(it, n, key), (int64_t)st.requested_bytes[t].freed);
        snprintf(key, sizeof key, "segment.%s.allocated", pools[t]);
        CHECK_EQ_INT(tc_item(it, n, key), (int64_t)st.segment[t].allocated);
    }
    CHECK_EQ_INT(tc_item(it, n, "oversize_allocations.peak"),
                 (int64_t)st.oversize_allocations.peak);
    CHECK_EQ_INT(tc_item(it, n, "num_device_alloc"), (int64_t)st.num_device_alloc);
    CHECK_EQ_INT(tc_item(it, n, "max_split_size"), 64 * (int64_t)MIB);
    tc_close(&e);
    CHECK_OK(tc_open(&e, 0, NULL, 0));
    st = tc_stats(&e);
    n = mn_cache_stats_items(&st, it, MN_CACHE_STATS_ITEMS);
    CHECK_EQ_INT(tc_item(it, n, "max_split_size"), -1);  // unlimited, as PyTorch reports it
    CHECK_EQ_U64(mn_cache_stats_items(NULL, it, MN_CACHE_STATS_ITEMS), 0);
    tc_close(&e);
}

// ---- the host-memory device -------------------------------------------------------------------

static void test_hostdev(void) {
    mn_hostdev dev;
    mn_hostdev_desc hd;
    mn_cache cache;
    mn_cache_desc cd;
    mnt_counting cnt;
    void *p[64];
    uint64_t sizes[64];
    struct mn_cache_stats st;
    int i, k;
    memset(&cnt, 0, sizeof cnt);
    memset(&hd, 0, sizeof hd);
    hd.capacity = 256 * MIB;
    hd.allocator = mnt_counting_allocator(&cnt);
    CHECK_OK(mn_hostdev_init(&dev, &hd));
    memset(&cd, 0, sizeof cd);
    cd.device = mn_hostdev_device(&dev);
    CHECK_OK(mn_cache_init(&cache, &cd));
    // real, aligned, writable blocks of the sizes asked for (ASan checks every byte written)
    for (i = 0; i < 64; i++) {
        sizes[i] = tc_rand_size() % (3 * MIB) + 1;
        CHECK_OK(mn_cache_alloc(&cache, sizes[i], 0, (mn_category)(i % MN_CAT_COUNT), NULL, &p[i]));
        CHECK_EQ_U64((uintptr_t)p[i] % MN_HOSTDEV_ALIGN, 0);
        memset(p[i], i, (size_t)sizes[i]);
    }
    for (i = 0; i < 64; i++) {  // no block overlaps another: each still holds its own byte
        const unsigned char *b = (const unsigned char *)p[i];
        for (k = 0; k < 4; k++) CHECK_EQ_INT(b[(size_t)(sizes[i] - 1) * (size_t)k / 3], i);
    }
    CHECK_OK(mn_cache_stats(&cache, &st));
    CHECK_EQ_U64(st.reserved_bytes[MN_STAT_ALL].current, dev.used);
    CHECK_EQ_U64(st.segment[MN_STAT_ALL].current, dev.live);
    CHECK_EQ_U64(cnt.allocs - cnt.frees, dev.live);  // one host allocation per segment
    // the capacity holds: more than is left fails after the ladder, and is counted
    CHECK_ERR(mn_cache_alloc(&cache, 300 * MIB, 0, MN_CAT_OTHER, NULL, &p[0]), MN_ERR_DEVICE_OOM);
    CHECK_EQ_U64(dev.failed_calls >= 1, 1);
    {
        char msg[1024];
        mn_cache_oom_message(&cache, msg, sizeof msg);
        CHECK(strstr(msg, "Tried to allocate 300.00 MiB") != NULL);
        CHECK(strstr(msg, "total capacity of 256.00 MiB") != NULL);
    }
    CHECK_ERR(mn_hostdev_free(&dev), MN_ERR_STATE);  // segments are live: refused
    for (i = 1; i < 64; i++) CHECK_OK(mn_cache_release(&cache, p[i]));
    CHECK_OK(mn_cache_check(&cache));
    mn_cache_free(&cache);
    CHECK_EQ_U64(dev.used, 0);
    CHECK_EQ_U64(dev.live, 0);
    CHECK_EQ_U64(dev.alloc_calls - dev.failed_calls, dev.free_calls);
    CHECK_OK(mn_hostdev_free(&dev));
    CHECK_EQ_U64(cnt.allocs, cnt.frees);
    // an injected failure at the 2nd device allocation: the cache flushes and retries, as
    // PyTorch does after a failed cudaMalloc, and the retry gets real memory
    hd.capacity = 0, hd.fail_alloc_at = 2;
    CHECK_OK(mn_hostdev_init(&dev, &hd));
    cd.device = mn_hostdev_device(&dev);
    CHECK_OK(mn_cache_init(&cache, &cd));
    CHECK_OK(mn_cache_alloc(&cache, 4 * MIB, 0, MN_CAT_WEIGHTS, NULL, &p[0]));
    CHECK_OK(mn_cache_alloc(&cache, 40 * MIB, 0, MN_CAT_WEIGHTS, NULL, &p[1]));
    memset(p[1], 0xab, 40 * MIB);
    CHECK_EQ_U64(dev.failed_calls, 1);
    CHECK_OK(mn_cache_stats(&cache, &st));
    CHECK_EQ_U64(st.num_alloc_retries, 1);
    {
        uint64_t fr = 0, total = 0;
        CHECK_OK(cd.device.mem_info_fn(cd.device.user_data, &fr, &total));
        CHECK_EQ_U64(total, 1ull << 50);  // unlimited
        CHECK_EQ_U64(total - fr, dev.used);
    }
    mn_cache_free(&cache);
    CHECK_OK(mn_hostdev_free(&dev));
    CHECK_EQ_U64(cnt.allocs, cnt.frees);
    // expandable segments need virtual memory the host device does not offer
    CHECK_OK(mn_hostdev_init(&dev, NULL));
    cd.device = mn_hostdev_device(&dev);
    cd.config = "expandable_segments:True";
    CHECK_ERR(mn_cache_init(&cache, &cd), MN_ERR_UNSUPPORTED);
    CHECK_OK(mn_hostdev_free(&dev));
    hd.allocator.free_fn = NULL;  // half an allocator
    CHECK_ERR(mn_hostdev_init(&dev, &hd), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_hostdev_init(NULL, NULL), MN_ERR_INVALID_ARG);
}

// ---- property test: the allocator against a reference model of the policy --------------------
//
// The model below is written from PyTorch's CUDACachingAllocator.cpp rules alone, as plainly as
// possible (linear scans, no trees, no maps): round_size (512-byte multiples), the small pool for
// at most 1 MiB, get_allocation_size (2 MiB / 20 MiB / 2 MiB multiples), get_free_block (best fit
// by size, then address, in the request's pool), should_split (small: >= 512 left; large: more
// than 1 MiB left), free_block (merge with free neighbours), and the out-of-memory ladder
// (alloc_block; release_cached_blocks, which frees every whole free segment; one retry). The
// simulated device places segments at increasing addresses (size rounded to 2 MiB plus a 2 MiB
// gap), which the model repeats. Random traces with a random capacity and device failures
// injected at random allocations must give the same pointers, the same failures and the same
// statistics as the allocator; at the end every block is returned and nothing is lost.

enum { PM_MAX_BLOCKS = 4096, PM_MAX_SEGS = 1024 };

typedef struct pm_block {
    uint64_t addr, size;
    int seg, allocated, used;  // used: the slot holds a block
} pm_block;

typedef struct pm_seg {
    uint64_t addr, size;
    int small, used;
} pm_seg;

typedef struct pm_model {
    pm_block b[PM_MAX_BLOCKS];
    pm_seg s[PM_MAX_SEGS];
    uint64_t next_addr, capacity, used, calls, fail_call, num_ooms, retries;
} pm_model;

static uint64_t pm_round(uint64_t n) { return n < 512 ? 512 : (n + 511) / 512 * 512; }

static uint64_t pm_alloc_size(uint64_t r) {
    if (r <= MIB) return 2 * MIB;
    if (r < 10 * MIB) return 20 * MIB;
    return (r + 2 * MIB - 1) / (2 * MIB) * (2 * MIB);
}

// A device allocation: the injected failure, the capacity, then the next address.
static int pm_device_alloc(pm_model *m, uint64_t size, uint64_t *addr) {
    m->calls++;
    if (m->fail_call && m->calls == m->fail_call) return m->fail_call = 0, 0;
    if (m->capacity && m->used + size > m->capacity) return 0;
    m->used += size;
    *addr = m->next_addr;
    m->next_addr += (size + 2 * MIB - 1) / (2 * MIB) * (2 * MIB) + 2 * MIB;
    return 1;
}

static int pm_free_slot_block(pm_model *m) {
    int i;
    for (i = 0; i < PM_MAX_BLOCKS; i++)
        if (!m->b[i].used) return i;
    return -1;
}

static int pm_new_segment(pm_model *m, uint64_t size, int small) {
    uint64_t addr;
    int i, k;
    if (!pm_device_alloc(m, size, &addr)) return -1;
    for (i = 0; i < PM_MAX_SEGS && m->s[i].used; i++) continue;
    k = pm_free_slot_block(m);
    if (i == PM_MAX_SEGS || k < 0) return -1;
    m->s[i].addr = addr, m->s[i].size = size, m->s[i].small = small, m->s[i].used = 1;
    m->b[k].addr = addr, m->b[k].size = size, m->b[k].seg = i, m->b[k].allocated = 0;
    m->b[k].used = 1;
    return k;
}

static int pm_whole(const pm_model *m, int k) {
    return m->b[k].addr == m->s[m->b[k].seg].addr && m->b[k].size == m->s[m->b[k].seg].size;
}

// release_cached_blocks: every free block that is a whole segment goes back to the device.
static void pm_release_cached(pm_model *m) {
    int k;
    for (k = 0; k < PM_MAX_BLOCKS; k++)
        if (m->b[k].used && !m->b[k].allocated && pm_whole(m, k)) {
            m->used -= m->s[m->b[k].seg].size;
            m->s[m->b[k].seg].used = 0;
            m->b[k].used = 0;
        }
}

// The address of the new block, or 0 when the allocation fails.
static uint64_t pm_malloc(pm_model *m, uint64_t size) {
    uint64_t r = pm_round(size);
    int small = r <= MIB, best = -1, k;
    for (k = 0; k < PM_MAX_BLOCKS; k++) {  // best fit: smallest size, then lowest address
        pm_block *b = &m->b[k];
        if (!b->used || b->allocated || m->s[b->seg].small != small || b->size < r) continue;
        if (best < 0 || b->size < m->b[best].size ||
            (b->size == m->b[best].size && b->addr < m->b[best].addr))
            best = k;
    }
    if (best < 0) {
        best = pm_new_segment(m, pm_alloc_size(r), small);
        if (best < 0) {
            pm_release_cached(m);
            m->retries++;
            best = pm_new_segment(m, pm_alloc_size(r), small);
        }
        if (best < 0) return m->num_ooms++, 0;
    }
    if (small ? m->b[best].size - r >= 512 : m->b[best].size - r > MIB) {  // split the front off
        int rest = pm_free_slot_block(m);
        if (rest < 0) return 0;
        m->b[rest] = m->b[best];
        m->b[rest].addr += r, m->b[rest].size -= r;
        m->b[best].size = r;
    }
    m->b[best].allocated = 1;
    return m->b[best].addr;
}

static void pm_free(pm_model *m, uint64_t addr) {
    int k, j, merged = 1;
    for (k = 0; k < PM_MAX_BLOCKS && !(m->b[k].used && m->b[k].addr == addr); k++) continue;
    CHECK(k < PM_MAX_BLOCKS && m->b[k].allocated);
    if (k == PM_MAX_BLOCKS) return;
    m->b[k].allocated = 0;
    while (merged) {  // free neighbours in the same segment join it
        merged = 0;
        for (j = 0; j < PM_MAX_BLOCKS; j++) {
            pm_block *o = &m->b[j];
            if (j == k || !o->used || o->allocated || o->seg != m->b[k].seg) continue;
            if (o->addr + o->size == m->b[k].addr) {
                m->b[k].addr = o->addr, m->b[k].size += o->size, o->used = 0, merged = 1;
            } else if (m->b[k].addr + m->b[k].size == o->addr) {
                m->b[k].size += o->size, o->used = 0, merged = 1;
            }
        }
    }
}

static void pm_totals(const pm_model *m, uint64_t *alloc_bytes, uint64_t *reserved,
                      uint64_t *segments, uint64_t *allocations) {
    int k;
    *alloc_bytes = *reserved = *segments = *allocations = 0;
    for (k = 0; k < PM_MAX_BLOCKS; k++)
        if (m->b[k].used && m->b[k].allocated) *alloc_bytes += m->b[k].size, (*allocations)++;
    for (k = 0; k < PM_MAX_SEGS; k++)
        if (m->s[k].used) *reserved += m->s[k].size, (*segments)++;
}

static void test_policy_model(void) {
    static pm_model m;
    int round;
    for (round = 0; round < 6; round++) {
        mn_sim_cache sc;
        mn_simdev_desc dd;
        struct mn_cache_stats st;
        void *live[256];
        uint64_t n_live = 0, op, ops = 300 + mnt_rand_u64() % 300, faults = 0;
        uint64_t ab, rv, sg, na;
        memset(&m, 0, sizeof m);
        memset(&dd, 0, sizeof dd);
        dd.capacity = (64 + mnt_rand_u64() % 448) * MIB;  // 64 MiB .. 512 MiB: OOMs happen
        dd.events_complete = 1;
        m.capacity = dd.capacity, m.next_addr = 0x7f0000000000ull;
        CHECK_OK(mn_sim_cache_init(&sc, &dd, NULL));
        for (op = 0; op < ops && !mnt_failed(); op++) {
            if (n_live < 256 && (n_live == 0 || mnt_rand_u64() % 5 < 3)) {
                uint64_t size, want;
                void *p = NULL;
                mn_result r;
                switch (mnt_rand_u64() % 3) {
                case 0: size = 1 + mnt_rand_u64() % MIB; break;          // small pool
                case 1: size = MIB + 1 + mnt_rand_u64() % (9 * MIB); break;  // 20 MiB segments
                default: size = 10 * MIB + mnt_rand_u64() % (40 * MIB); break;
                }
                if (mnt_rand_u64() % 16 == 0) {  // the device fails its next allocation
                    mn_simdev_fail_alloc_at(&sc.dev, 1);
                    m.fail_call = m.calls + 1;
                    faults++;
                }
                want = pm_malloc(&m, size);
                r = mn_cache_alloc(&sc.cache, size, 0, MN_CAT_ACTIVATIONS, NULL, &p);
                CHECK_MSG((r == MN_OK) == (want != 0), "op %llu: alloc of %llu: result %d, the "
                          "model %s", (unsigned long long)op, (unsigned long long)size, (int)r,
                          want ? "succeeds" : "fails");
                if (r == MN_OK) {
                    CHECK_EQ_U64((uint64_t)(uintptr_t)p, want);
                    live[n_live++] = p;
                } else {
                    CHECK_ERR(r, MN_ERR_DEVICE_OOM);
                    m.fail_call = 0;  // the injected failure was used (or never reached)
                    mn_simdev_fail_alloc_at(&sc.dev, 0);
                }
            } else {
                uint64_t i = mnt_rand_u64() % n_live;
                pm_free(&m, (uint64_t)(uintptr_t)live[i]);
                CHECK_OK(mn_cache_release(&sc.cache, live[i]));
                live[i] = live[--n_live];
            }
            if (m.fail_call && m.fail_call <= m.calls) m.fail_call = 0;
            CHECK_OK(mn_cache_check(&sc.cache));
            CHECK_OK(mn_cache_stats(&sc.cache, &st));
            pm_totals(&m, &ab, &rv, &sg, &na);
            CHECK_EQ_U64(st.allocated_bytes[MN_STAT_ALL].current, ab);
            CHECK_EQ_U64(st.reserved_bytes[MN_STAT_ALL].current, rv);
            CHECK_EQ_U64(st.segment[MN_STAT_ALL].current, sg);
            CHECK_EQ_U64(st.allocation[MN_STAT_ALL].current, na);
            CHECK_EQ_U64(st.num_ooms, m.num_ooms);
            CHECK_EQ_U64(sc.dev.used, m.used);
        }
        // nothing is lost: every block goes back, the cache empties, the device holds nothing
        while (n_live) CHECK_OK(mn_cache_release(&sc.cache, live[--n_live]));
        CHECK_OK(mn_cache_empty(&sc.cache));
        CHECK_OK(mn_cache_stats(&sc.cache, &st));
        CHECK_EQ_U64(st.allocated_bytes[MN_STAT_ALL].current, 0);
        CHECK_EQ_U64(st.reserved_bytes[MN_STAT_ALL].current, 0);
        CHECK_EQ_U64(sc.dev.used, 0);
        CHECK_EQ_U64(st.allocated_bytes[MN_STAT_ALL].allocated,
                     st.allocated_bytes[MN_STAT_ALL].freed);
        CHECK(faults > 0 || ops < 400);
        mn_sim_cache_free(&sc);
    }
}

// In test/test_fitpaths.c (a white-box copy of the implementation).
void test_cache_check_detects(void);

const mnt_case test_cache_cases[] = {
    {"policy_model", test_policy_model},
    {"rounding_table", test_rounding_table},
    {"config_parse", test_config_parse},
    {"small_and_large_pools", test_small_and_large_pools},
    {"best_fit_and_split_rules", test_best_fit_and_split_rules},
    {"oversize_rules", test_oversize_rules},
    {"oom_ladder", test_oom_ladder},
    {"record_stream_events", test_record_stream_events},
    {"fraction_and_gc", test_fraction_and_gc},
    {"summary_layout", test_summary_layout},
    {"random_invariant", test_random_invariant},
    {"expandable_segments", test_expandable_segments},
    {"device_failure_injection", test_device_failure_injection},
    {"host_failure_injection", test_host_failure_injection},
    {"slab_failure_injection", test_slab_failure_injection},
    {"huge_tables", test_huge_tables},
    {"threads", test_threads},
    {"snapshot_json_and_svg", test_snapshot_json_and_svg},
    {"address_lookup", test_address_lookup},
    {"many_blocks_and_plain_device", test_many_blocks_and_plain_device},
    {"bad_arguments", test_bad_arguments},
    {"replay_cli", test_replay_cli},
    {"replay_matches_reference", test_replay_matches_reference},
    {"replay_many_live_ids", test_replay_many_live_ids},
    {"check_detects_damage", test_cache_check_detects},
    {"replay_edges", test_replay_edges},
    {"sim_cache", test_sim_cache},
    {"write_file", test_write_file},
    {"write_file_atomic", test_write_file_atomic},
    {"stats_items", test_stats_items},
    {"hostdev", test_hostdev},
};
const size_t test_cache_count = sizeof test_cache_cases / sizeof test_cache_cases[0];
