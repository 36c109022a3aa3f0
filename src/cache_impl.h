// >>cache implementation ------------------------------------------------------------------------
//
// Invariant (PyTorch test_cuda.py, _check_memory_stat_consistency): the blocks of a segment tile
// it exactly (prev/next in address order, no gap, no overlap); every free mapped block is in its
// pool's tree keyed (stream, size, address), every unmapped block of an expandable segment in
// the pool's unmapped tree, every allocated block in the address map; and the statistics equal
// the sums over the blocks. Sources of the rules: c10/cuda/CUDACachingAllocator.cpp and
// c10/cuda/CUDAAllocatorConfig.cpp (reference/allocator.md has the facts).

#ifndef MEMANAT_NO_THREADS
#if defined(_WIN32) && !defined(__CYGWIN__)
// define MEMANAT_NO_THREADS to build the caching allocator without locking
#error "memanat: the caching allocator locks with pthreads (or define MEMANAT_NO_THREADS)"
#endif
#include <pthread.h>
#endif

// PyTorch CUDACachingAllocator.cpp constants.
#define MN__C_MIN_BLOCK 512ull              // kMinBlockSize
#define MN__C_SMALL_SIZE 1048576ull         // kSmallSize
#define MN__C_SMALL_BUFFER 2097152ull       // kSmallBuffer
#define MN__C_LARGE_BUFFER 20971520ull      // kLargeBuffer
#define MN__C_MIN_LARGE_ALLOC 10485760ull   // kMinLargeAlloc
#define MN__C_ROUND_LARGE 2097152ull        // kRoundLarge
#define MN__C_ONE_EXA 1152921504606846976ull  // one_exa_bytes
#define MN__C_MIB 1048576ull

// ---- simulated device --------------------------------------------------------------------------

MNIMPL mn_result mn_simdev_init(mn_simdev *dev, const mn_simdev_desc *desc) {
    if (!dev) return MN_ERR_INVALID_ARG;
    memset(dev, 0, sizeof *dev);
    if (desc) dev->desc = *desc;
    if (dev->desc.base == 0) dev->desc.base = 0x7f0000000000ull;
    if (dev->desc.base % MN__C_MIN_BLOCK) return MN_ERR_INVALID_ARG;
    dev->next_addr = dev->desc.base;
    dev->next_va = dev->desc.base + (1ull << 44);  // reserved ranges live above the physical ones
    dev->fail_at = dev->desc.fail_alloc_at;
    return MN_OK;
}

MNIMPL void mn_simdev_free(mn_simdev *dev) {
    if (!dev) return;
    mn__free(&dev->desc.allocator, dev->events);
    dev->events = NULL;
    dev->event_count = dev->event_cap = 0;
}

MNIMPL void mn_simdev_fail_alloc_at(mn_simdev *dev, uint64_t n) {
    dev->fail_at = n ? dev->alloc_calls + dev->map_calls + n : 0;
}

// Counts one device allocation and says whether it must fail (injection or capacity).
MN__PRIVATE mn_result mn__c_simdev_take(mn_simdev *dev, uint64_t size) {
    uint64_t calls = dev->alloc_calls + dev->map_calls;
    if (dev->fail_at && calls == dev->fail_at) {
        dev->fail_at = 0;
        dev->failed_calls++;
        return MN_ERR_DEVICE_OOM;
    }
    if (dev->desc.capacity && (size > dev->desc.capacity || dev->used > dev->desc.capacity - size)) {
        dev->failed_calls++;
        return MN_ERR_DEVICE_OOM;
    }
    dev->used += size;
    if (dev->used > dev->peak_used) dev->peak_used = dev->used;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_alloc(void *ud, uint64_t size, void **ptr_out) {
    mn_simdev *dev = (mn_simdev *)ud;
    uint64_t step;
    mn_result r;
    dev->alloc_calls++;
    // addresses advance by the size rounded to 2 MiB plus a 2 MiB gap: segments never touch
    if (size == 0 || size > (1ull << 62)) return MN_ERR_INVALID_ARG;
    r = mn__c_simdev_take(dev, size);
    if (r != MN_OK) return r;
    dev->live++;
    *ptr_out = (void *)(uintptr_t)dev->next_addr;
    step = (size + MN__C_ROUND_LARGE - 1) / MN__C_ROUND_LARGE * MN__C_ROUND_LARGE + MN__C_ROUND_LARGE;
    dev->next_addr += step;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_release(void *ud, void *ptr, uint64_t size) {
    mn_simdev *dev = (mn_simdev *)ud;
    (void)ptr;
    if (size > dev->used) return MN_ERR_INVALID_ARG;
    dev->used -= size;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_free_fn(void *ud, void *ptr, uint64_t size) {
    mn_simdev *dev = (mn_simdev *)ud;
    dev->free_calls++;
    if (dev->live == 0) return MN_ERR_INVALID_ARG;
    dev->live--;
    return mn__c_simdev_release(ud, ptr, size);
}

MN__PRIVATE mn_result mn__c_simdev_mem_info(void *ud, uint64_t *free_out, uint64_t *total_out) {
    mn_simdev *dev = (mn_simdev *)ud;
    uint64_t total = dev->desc.capacity ? dev->desc.capacity : (1ull << 50);
    *total_out = total;
    *free_out = total > dev->used ? total - dev->used : 0;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_event_record(void *ud, mn_stream stream, mn_event *out) {
    mn_simdev *dev = (mn_simdev *)ud;
    if (dev->event_count == dev->event_cap) {
        uint32_t cap = dev->event_cap ? dev->event_cap * 2 : 16;
        mn_simdev_event *ev = (mn_simdev_event *)mn__alloc_array(&dev->desc.allocator, cap,
                                                                 sizeof *ev);
        if (!ev) return MN_ERR_OUT_OF_MEMORY;
        if (dev->event_count) memcpy(ev, dev->events, dev->event_count * sizeof *ev);
        mn__free(&dev->desc.allocator, dev->events);
        dev->events = ev;
        dev->event_cap = cap;
    }
    dev->events[dev->event_count].id = ++dev->next_event;
    dev->events[dev->event_count].stream = stream;
    dev->events[dev->event_count].done = dev->desc.events_complete != 0;
    dev->event_count++;
    *out = dev->next_event;
    return MN_OK;
}

MN__PRIVATE mn_simdev_event *mn__c_simdev_find_event(mn_simdev *dev, mn_event e) {
    uint32_t i;
    for (i = 0; i < dev->event_count; i++)
        if (dev->events[i].id == e) return &dev->events[i];
    return NULL;
}

MN__PRIVATE int mn__c_simdev_event_query(void *ud, mn_event e) {
    mn_simdev_event *ev = mn__c_simdev_find_event((mn_simdev *)ud, e);
    return !ev || ev->done;
}

MN__PRIVATE mn_result mn__c_simdev_event_sync(void *ud, mn_event e) {
    mn_simdev_event *ev = mn__c_simdev_find_event((mn_simdev *)ud, e);
    if (ev) ev->done = 1;  // the simulated stream finishes its work
    return MN_OK;
}

MN__PRIVATE void mn__c_simdev_event_free(void *ud, mn_event e) {
    mn_simdev *dev = (mn_simdev *)ud;
    mn_simdev_event *ev = mn__c_simdev_find_event(dev, e);
    if (ev) *ev = dev->events[--dev->event_count];
}

MN__PRIVATE mn_result mn__c_simdev_reserve(void *ud, uint64_t size, void **base_out) {
    mn_simdev *dev = (mn_simdev *)ud;
    uint64_t step;
    if (size == 0 || size > (1ull << 56)) return MN_ERR_INVALID_ARG;
    step = (size + MN__C_LARGE_BUFFER - 1) / MN__C_LARGE_BUFFER * MN__C_LARGE_BUFFER;
    step += MN__C_LARGE_BUFFER;
    *base_out = (void *)(uintptr_t)dev->next_va;
    dev->next_va += step;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_unreserve(void *ud, void *base, uint64_t size) {
    (void)ud, (void)base, (void)size;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_map(void *ud, void *addr, uint64_t size) {
    mn_simdev *dev = (mn_simdev *)ud;
    (void)addr;
    dev->map_calls++;
    return mn__c_simdev_take(dev, size);
}

MN__PRIVATE mn_result mn__c_simdev_unmap(void *ud, void *addr, uint64_t size) {
    ((mn_simdev *)ud)->unmap_calls++;
    return mn__c_simdev_release(ud, addr, size);
}

MNIMPL mn_device mn_simdev_device(mn_simdev *dev) {
    mn_device d;
    memset(&d, 0, sizeof d);
    d.alloc_fn = mn__c_simdev_alloc;
    d.free_fn = mn__c_simdev_free_fn;
    d.mem_info_fn = mn__c_simdev_mem_info;
    d.event_record_fn = mn__c_simdev_event_record;
    d.event_query_fn = mn__c_simdev_event_query;
    d.event_sync_fn = mn__c_simdev_event_sync;
    d.event_free_fn = mn__c_simdev_event_free;
    d.reserve_fn = mn__c_simdev_reserve;
    d.unreserve_fn = mn__c_simdev_unreserve;
    d.map_fn = mn__c_simdev_map;
    d.unmap_fn = mn__c_simdev_unmap;
    d.user_data = dev;
    return d;
}

MNIMPL void mn_simdev_complete_event(mn_simdev *dev, mn_event e) {
    mn_simdev_event *ev = mn__c_simdev_find_event(dev, e);
    if (ev) ev->done = 1;
}

MNIMPL void mn_simdev_sync_stream(mn_simdev *dev, mn_stream stream) {
    uint32_t i;
    for (i = 0; i < dev->event_count; i++)
        if (dev->events[i].stream == stream) dev->events[i].done = 1;
}

MNIMPL void mn_simdev_sync(mn_simdev *dev) {
    uint32_t i;
    for (i = 0; i < dev->event_count; i++) dev->events[i].done = 1;
}

MNIMPL uint32_t mn_simdev_pending_events(const mn_simdev *dev) {
    uint32_t i, n = 0;
    for (i = 0; i < dev->event_count; i++) n += !dev->events[i].done;
    return n;
}

// ---- configuration -----------------------------------------------------------------------------

MN__PRIVATE int mn__c_is_pow2(uint64_t v) { return v && !(v & (v - 1)); }

MN__PRIVATE uint32_t mn__c_log2_floor(uint64_t v) {  // v > 0
#if defined(__GNUC__) || defined(__clang__)
    return 63u - (uint32_t)__builtin_clzll(v);
#else
    uint32_t r = 0;
    while (v >>= 1) r++;
    return r;
#endif
}

// Tokens as CUDAAllocatorConfig::lexArgs makes them: ',' ':' '[' ']' alone, spaces dropped.
typedef struct mn__c_cfg_tok {
    const char *s;
    size_t n;
} mn__c_cfg_tok;

MN__PRIVATE int mn__c_tok_is(const mn__c_cfg_tok *t, const char *w) {
    size_t n = strlen(w);
    return t->n == n && memcmp(t->s, w, n) == 0;
}

// Parses a whole token as an unsigned decimal.
MN__PRIVATE int mn__c_tok_u64(const mn__c_cfg_tok *t, uint64_t *out) {
    uint64_t v = 0;
    size_t i;
    if (t->n == 0 || t->n > 19) return 0;
    for (i = 0; i < t->n; i++) {
        if (t->s[i] < '0' || t->s[i] > '9') return 0;
        v = v * 10 + (uint64_t)(t->s[i] - '0');
    }
    *out = v;
    return 1;
}

MN__PRIVATE int mn__c_tok_double(const mn__c_cfg_tok *t, double *out) {
    char buf[64], *end = NULL;
    size_t i;
    int digits = 0;
    if (t->n == 0 || t->n >= sizeof buf) return 0;
    for (i = 0; i < t->n; i++) {
        char ch = t->s[i];
        if (!((ch >= '0' && ch <= '9') || ch == '.' || ch == 'e' || ch == 'E' || ch == '-' ||
              ch == '+'))
            return 0;
        digits += ch >= '0' && ch <= '9';
    }
    if (!digits) return 0;
    memcpy(buf, t->s, t->n);
    buf[t->n] = 0;
    *out = strtod(buf, &end);
    return end == buf + t->n;
}

MN__PRIVATE int mn__c_tok_bool(const mn__c_cfg_tok *t, int *out) {
    if (mn__c_tok_is(t, "True")) return *out = 1, 1;
    if (mn__c_tok_is(t, "False")) return *out = 0, 1;
    return 0;
}

#define MN__C_CFG_MAX_TOKENS 256

MNIMPL mn_result mn_cache_config_parse(const char *text, mn_cache_config *out,
                                       const mn_logger *lg) {
    mn__c_cfg_tok tok[MN__C_CFG_MAX_TOKENS];
    size_t nt = 0, i = 0;
    const char *p = text;
    mn_cache_config cfg;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(&cfg, 0, sizeof cfg);
    memset(out, 0, sizeof *out);
    if (!text) return MN_OK;
    // lexer: CUDAAllocatorConfig::lexArgs
    while (*p) {
        if (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') { p++; continue; }
        if (nt == MN__C_CFG_MAX_TOKENS) {
            mn__log(lg, MN_LOG_ERROR, "allocator config: more than %d tokens", MN__C_CFG_MAX_TOKENS);
            return MN_ERR_CONFIG;
        }
        tok[nt].s = p;
        if (*p == ',' || *p == ':' || *p == '[' || *p == ']') {
            tok[nt++].n = 1, p++;
            continue;
        }
        while (*p && *p != ',' && *p != ':' && *p != '[' && *p != ']' && *p != ' ' &&
               *p != '\t' && *p != '\n' && *p != '\r')
            p++;
        tok[nt].n = (size_t)(p - tok[nt].s);
        nt++;
    }
    while (i < nt) {
        const mn__c_cfg_tok *key = &tok[i];
        const mn__c_cfg_tok *val;
        char kname[48];
        uint64_t u = 0;
        double d = 0;
        int b = 0;
        size_t kn = key->n < sizeof kname - 1 ? key->n : sizeof kname - 1;
        memcpy(kname, key->s, kn);
        kname[kn] = 0;
        if (mn__c_tok_is(key, ",")) { i++; continue; }  // PyTorch tolerates empty pairs
        if (i + 1 >= nt || !mn__c_tok_is(&tok[i + 1], ":") || i + 2 >= nt) {
            mn__log(lg, MN_LOG_ERROR, "allocator config: key '%s' needs ':' and a value", kname);
            return MN_ERR_CONFIG;
        }
        val = &tok[i + 2];
        i += 3;
        if (mn__c_tok_is(key, "max_split_size_mb") || mn__c_tok_is(key, "max_non_split_rounding_mb") ||
            mn__c_tok_is(key, "large_segment_size_mb")) {
            int is_seg = mn__c_tok_is(key, "large_segment_size_mb");
            if (!mn__c_tok_u64(val, &u)) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: %s expects a whole number of MiB", kname);
                return MN_ERR_CONFIG;
            }
            // CUDAAllocatorConfig::parseMaxSplitSize: "too small, must be > 20"
            if (!is_seg && u <= MN__C_LARGE_BUFFER / MN__C_MIB) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: CachingAllocator option %s too small, "
                        "must be > 20", kname);
                return MN_ERR_CONFIG;
            }
            if (is_seg && (u == 0 || u % 2 != 0)) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: %s must be a positive multiple of 2",
                        kname);
                return MN_ERR_CONFIG;
            }
            if (u > (UINT64_MAX >> 20)) u = UINT64_MAX >> 20;  // clamped as PyTorch does
            if (mn__c_tok_is(key, "max_split_size_mb")) cfg.max_split_size = u << 20;
            else if (is_seg) cfg.large_segment_size = u << 20;
            else cfg.max_non_split_rounding = u << 20;
        } else if (mn__c_tok_is(key, "roundup_power2_divisions")) {
            // CUDAAllocatorConfig::parseRoundUpPower2Divisions
            if (mn__c_tok_is(val, "[")) {
                int first = 1;
                size_t last_index = 0, k;
                for (;;) {
                    const mn__c_cfg_tok *a, *v;
                    if (i >= nt) {
                        mn__log(lg, MN_LOG_ERROR, "allocator config: roundup_power2_divisions "
                                "misses ']'");
                        return MN_ERR_CONFIG;
                    }
                    if (mn__c_tok_is(&tok[i], "]")) { i++; break; }
                    if (mn__c_tok_is(&tok[i], ",")) { i++; continue; }
                    if (i + 2 >= nt || !mn__c_tok_is(&tok[i + 1], ":")) {
                        mn__log(lg, MN_LOG_ERROR, "allocator config: roundup_power2_divisions "
                                "expects [size_mb:divisions,...]");
                        return MN_ERR_CONFIG;
                    }
                    a = &tok[i], v = &tok[i + 2];
                    i += 3;
                    if (!mn__c_tok_u64(v, &u) || (u != 0 && !mn__c_is_pow2(u)) || u > (1u << 20)) {
                        mn__log(lg, MN_LOG_ERROR, "allocator config: roundup_power2_divisions: "
                                "the divisions have to be a power of 2 or 0 to disable roundup");
                        return MN_ERR_CONFIG;
                    }
                    if (mn__c_tok_is(a, ">")) {  // the intervals after the last one named
                        for (k = first ? 0 : last_index + 1; k < MN_CACHE_ROUNDUP_INTERVALS; k++)
                            cfg.roundup_power2_divisions[k] = (uint32_t)u;
                    } else {
                        uint64_t mb = 0;
                        size_t index;
                        if (!mn__c_tok_u64(a, &mb) || !mn__c_is_pow2(mb)) {
                            mn__log(lg, MN_LOG_ERROR, "allocator config: roundup_power2_divisions: "
                                    "the intervals have to be a power of 2");
                            return MN_ERR_CONFIG;
                        }
                        index = mn__c_log2_floor(mb);
                        if (index > MN_CACHE_ROUNDUP_INTERVALS - 1)
                            index = MN_CACHE_ROUNDUP_INTERVALS - 1;
                        if (first) {
                            for (k = 0; k < index; k++) cfg.roundup_power2_divisions[k] = (uint32_t)u;
                            first = 0;
                        }
                        cfg.roundup_power2_divisions[index] = (uint32_t)u;
                        last_index = index;
                    }
                }
            } else {
                size_t k;
                if (!mn__c_tok_u64(val, &u) || (u != 0 && !mn__c_is_pow2(u)) || u > (1u << 20)) {
                    mn__log(lg, MN_LOG_ERROR, "allocator config: roundup_power2_divisions: the "
                            "divisions have to be a power of 2 or 0 to disable roundup");
                    return MN_ERR_CONFIG;
                }
                for (k = 0; k < MN_CACHE_ROUNDUP_INTERVALS; k++)
                    cfg.roundup_power2_divisions[k] = (uint32_t)u;
            }
        } else if (mn__c_tok_is(key, "garbage_collection_threshold")) {
            // parseGarbageCollectionThreshold: 0 < t < 1
            if (!mn__c_tok_double(val, &d) || !(d > 0.0) || !(d < 1.0)) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: garbage_collection_threshold must be "
                        "in (0.0, 1.0), got '%.*s'", (int)val->n, val->s);
                return MN_ERR_CONFIG;
            }
            cfg.garbage_collection_threshold = d;
        } else if (mn__c_tok_is(key, "expandable_segments") ||
                   mn__c_tok_is(key, "release_lock_on_cudamalloc") ||
                   mn__c_tok_is(key, "pinned_use_cuda_host_register") ||
                   mn__c_tok_is(key, "pinned_use_background_threads") ||
                   mn__c_tok_is(key, "graph_capture_record_stream_reuse")) {
            if (!mn__c_tok_bool(val, &b)) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: expected a single True/False argument "
                        "for %s", kname);
                return MN_ERR_CONFIG;
            }
            if (mn__c_tok_is(key, "expandable_segments")) cfg.expandable_segments = b;
            if (mn__c_tok_is(key, "release_lock_on_cudamalloc")) cfg.release_lock_on_cudamalloc = b;
        } else if (mn__c_tok_is(key, "pinned_num_register_threads") ||
                   mn__c_tok_is(key, "pinned_reserve_segment_size_mb") ||
                   mn__c_tok_is(key, "pinned_max_round_threshold_mb") ||
                   mn__c_tok_is(key, "pinned_max_cached_size_mb")) {
            // host (pinned) allocator options: validated, no effect on device memory
            if (!mn__c_tok_u64(val, &u) ||
                (mn__c_tok_is(key, "pinned_num_register_threads") && (!mn__c_is_pow2(u) || u > 128))) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: bad value '%.*s' for %s",
                        (int)val->n, val->s, kname);
                return MN_ERR_CONFIG;
            }
        } else if (mn__c_tok_is(key, "backend")) {
            if (mn__c_tok_is(val, "cudaMallocAsync")) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: backend:cudaMallocAsync is not "
                        "modelled; only the native caching allocator is");
                return MN_ERR_UNSUPPORTED;
            }
            if (!mn__c_tok_is(val, "native")) {
                mn__log(lg, MN_LOG_ERROR, "allocator config: unknown allocator backend '%.*s', "
                        "options are native and cudaMallocAsync", (int)val->n, val->s);
                return MN_ERR_CONFIG;
            }
        } else {
            mn__log(lg, MN_LOG_ERROR, "allocator config: Unrecognized key '%s' in CUDA allocator "
                    "config.", kname);
            return MN_ERR_CONFIG;
        }
        if (i < nt && !mn__c_tok_is(&tok[i], ",")) {
            mn__log(lg, MN_LOG_ERROR, "allocator config: expected ',' after the value of '%s'",
                    kname);
            return MN_ERR_CONFIG;
        }
    }
    *out = cfg;
    return MN_OK;
}

// Zero fields mean PyTorch's defaults; this is the one place they are resolved.
typedef struct mn__c_policy {
    uint64_t max_split;         // UINT64_MAX = unlimited
    uint64_t max_non_split;     // 20 MiB
    uint64_t large_segment;     // 20 MiB
    uint32_t div[MN_CACHE_ROUNDUP_INTERVALS];
} mn__c_policy;

MN__PRIVATE void mn__c_policy_resolve(const mn_cache_config *cfg, mn__c_policy *p) {
    memset(p, 0, sizeof *p);
    p->max_split = UINT64_MAX;
    p->max_non_split = MN__C_LARGE_BUFFER;
    p->large_segment = MN__C_LARGE_BUFFER;
    if (!cfg) return;
    if (cfg->max_split_size) p->max_split = cfg->max_split_size;
    if (cfg->max_non_split_rounding) p->max_non_split = cfg->max_non_split_rounding;
    if (cfg->large_segment_size) p->large_segment = cfg->large_segment_size;
    memcpy(p->div, cfg->roundup_power2_divisions, sizeof p->div);
}

// PyTorch round_size / roundup_power2_next_division / AllocatorConfig::roundup_power2_divisions.
MN__PRIVATE uint64_t mn__c_round_size(const mn__c_policy *p, uint64_t size) {
    uint32_t log_size, index, divisions;
    if (size < MN__C_MIN_BLOCK) return MN__C_MIN_BLOCK;
    log_size = mn__c_log2_floor(size);
    index = log_size > 20 ? log_size - 20 : 0;  // intervals start at 1 MiB = 2^20
    if (index > MN_CACHE_ROUNDUP_INTERVALS - 1) index = MN_CACHE_ROUNDUP_INTERVALS - 1;
    divisions = p->div[index];
    if (divisions > 1 && size > MN__C_MIN_BLOCK * divisions) {
        uint64_t floor2, step, f;
        if (mn__c_is_pow2(size)) return size;
        floor2 = 1ull << log_size;
        step = floor2 >> mn__c_log2_floor(divisions);
        if (step == 0) return floor2 << 1;
        f = size & ~(step - 1);
        return f == size ? size : f + step;
    }
    return (size + MN__C_MIN_BLOCK - 1) / MN__C_MIN_BLOCK * MN__C_MIN_BLOCK;
}

// PyTorch get_allocation_size.
MN__PRIVATE uint64_t mn__c_allocation_size(const mn__c_policy *p, uint64_t size) {
    if (size <= MN__C_SMALL_SIZE) return MN__C_SMALL_BUFFER;
    if (size < MN__C_MIN_LARGE_ALLOC) return p->large_segment;
    return (size + MN__C_ROUND_LARGE - 1) / MN__C_ROUND_LARGE * MN__C_ROUND_LARGE;
}

MNIMPL uint64_t mn_cache_round_size(const mn_cache_config *cfg, uint64_t size) {
    mn__c_policy p;
    mn__c_policy_resolve(cfg, &p);
    if (size >= MN__C_ONE_EXA) return size;
    return mn__c_round_size(&p, size);
}

MNIMPL uint64_t mn_cache_segment_size(const mn_cache_config *cfg, uint64_t rounded_size) {
    mn__c_policy p;
    mn__c_policy_resolve(cfg, &p);
    if (rounded_size >= MN__C_ONE_EXA) return rounded_size;
    return mn__c_allocation_size(&p, rounded_size);
}

// ---- blocks, segments, trees -------------------------------------------------------------------

typedef struct mn__c_segment mn__c_segment;

typedef struct mn__c_use {   // a stream the block was used on; later the event recorded there
    mn_stream stream;
    mn_event event;
    struct mn__c_block *block;
    struct mn__c_use *next;   // in the block's list, then in the pending-event queue
} mn__c_use;

typedef struct mn__c_block {
    // the fields a tree search touches come first (one cache line)
    struct mn__c_block *l, *r, *up;  // treap children and parent (pool tree)
    uint64_t addr, size;
    mn_stream stream;
    uint32_t prio;                  // treap priority (max-heap)
    struct mn__c_block *prev, *next;  // neighbours inside the segment, in address order
    struct mn__c_block *tmp;        // scratch list, and the spare list
    mn__c_segment *seg;
    mn__c_use *uses;                // streams recorded while allocated
    uint64_t requested;
    uint64_t gc_base;               // pool's get_free_block count when cached (GC age)
    uint32_t event_count;           // events to wait for before the block is free
    uint8_t allocated, mapped, small, cat;
    uint8_t in_tree;
    char label[MN_CACHE_LABEL_MAX];
} mn__c_block;

struct mn__c_segment {
    uint64_t addr, size;            // device range (expandable: the reserved range)
    mn__c_block *head;                // lowest block
    mn__c_segment *prev_seg, *next_seg;
    mn_stream stream;
    uint8_t small, expandable;
};

typedef struct mn__c_pool {
    mn__c_block *blocks;     // free mapped blocks, treap by (stream, size, addr)
    mn__c_block *last;       // the block inserted last: often the next best fit
    mn__c_block *gap_l, *gap_r;  // neighbours of the block erased last: often where it returns
    mn__c_block *unmapped;   // unmapped tails of expandable segments, by (stream, addr)
    uint64_t get_free_calls;
    int small;
} mn__c_pool;

typedef struct mn__c_cache {
    mn_device dev;
    mn_cache_config cfg;
    mn__c_policy pol;
    mn_allocator alloc;
    mn_logger logger;
    int device_index;
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_t mu;
#endif
    mn__c_pool small, large;
    mn__c_block **map;              // allocated and pending blocks by address, linear probing
    uint64_t map_cap, map_count;
    mn__c_segment *segs;            // every segment
    mn__c_segment *spare_seg;       // taken before a device allocation, so none is lost
    mn__c_block *spare;             // recycled block structs
    uint32_t spare_count;
    mn__c_use *spare_uses;
    mn__c_use *ev_head, *ev_tail;   // pending cross-stream frees, in record order
    struct mn_cache_stats st;
    uint64_t total_allocated_memory;  // reserved bytes incl. expandable maps
    int set_fraction;
    uint64_t allowed_max;
    uint64_t clock;
    uint32_t rng;
    mn_result dev_error;          // first device error seen while freeing
    // history ring buffer
    mn_trace_entry *ring;
    uint64_t ring_cap, ring_head, ring_count, ring_dropped;
    uint64_t base_cat[MN_CAT_COUNT], base_reserved;
    char oom_msg[768];
} mn__c_cache;

MN__PRIVATE void mn__c_lock(mn__c_cache *c) {
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_lock(&c->mu);
#else
    (void)c;
#endif
}

MN__PRIVATE void mn__c_unlock(mn__c_cache *c) {
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_unlock(&c->mu);
#else
    (void)c;
#endif
}

// Tree order, BlockComparatorSize: stream, then size, then address. The unmapped tree uses
// size 0 for every block, which makes it BlockComparatorAddress.
MN__PRIVATE uint64_t mn__c_tree_size(const mn__c_block *b, int by_addr) {
    return by_addr ? 0 : b->size;
}

// Lifts x above its parent, keeping the in-order sequence.
MN__PRIVATE void mn__c_tr_rotate_up(mn__c_block **root, mn__c_block *x) {
    mn__c_block *p = x->up, *g = p->up;
    if (p->l == x) {
        p->l = x->r;
        if (x->r) x->r->up = p;
        x->r = p;
    } else {
        p->r = x->l;
        if (x->l) x->l->up = p;
        x->l = p;
    }
    p->up = x;
    x->up = g;
    if (!g) *root = x;
    else if (g->l == p) g->l = x;
    else g->r = x;
}

MN__PRIVATE int mn__c_node_lt(const mn__c_block *a, const mn__c_block *b, int by_addr) {
    uint64_t as = mn__c_tree_size(a, by_addr), bs = mn__c_tree_size(b, by_addr);
    if (a->stream != b->stream) return a->stream < b->stream;
    if (as != bs) return as < bs;
    return a->addr < b->addr;
}

// Treap insert: a leaf in key order, then rotations up while its priority beats the parent's
// (expected O(log n) search, O(1) rotations).
MN__PRIVATE void mn__c_tr_insert(mn__c_block **root, mn__c_block *n, int by_addr) {
    mn__c_block *t = *root;
    n->l = n->r = NULL;
    if (!t) {
        n->up = NULL;
        *root = n;
        return;
    }
    for (;;) {
        mn__c_block **child = mn__c_node_lt(n, t, by_addr) ? &t->l : &t->r;
        if (!*child) {
            *child = n;
            break;
        }
        t = *child;
    }
    n->up = t;
    while (n->up && n->up->prio < n->prio) mn__c_tr_rotate_up(root, n);
}

// Treap erase without a search: rotate the node down to a leaf, then cut it off.
MN__PRIVATE void mn__c_tr_erase(mn__c_block **root, mn__c_block *n) {
    while (n->l || n->r) {
        mn__c_block *c = !n->l ? n->r : !n->r ? n->l : n->l->prio > n->r->prio ? n->l : n->r;
        mn__c_tr_rotate_up(root, c);
    }
    if (!n->up) *root = NULL;
    else if (n->up->l == n) n->up->l = NULL;
    else n->up->r = NULL;
    n->up = NULL;
}

// Smallest node not less than the key (std::set::lower_bound).
MN__PRIVATE mn__c_block *mn__c_tr_lower_bound(mn__c_block *t, mn_stream s, uint64_t size,
                                              uint64_t addr, int by_addr) {
    mn__c_block *best = NULL;
    while (t) {
        int lt = t->stream != s ? t->stream < s
               : mn__c_tree_size(t, by_addr) != size ? mn__c_tree_size(t, by_addr) < size
               : t->addr < addr;
        if (!lt) best = t, t = t->l;
        else t = t->r;
    }
    return best;
}

// Largest node less than the key.
MN__PRIVATE mn__c_block *mn__c_tr_before(mn__c_block *t, mn_stream s, uint64_t size, uint64_t addr,
                                     int by_addr) {
    mn__c_block *best = NULL;
    while (t) {
        int lt = t->stream != s ? t->stream < s
               : mn__c_tree_size(t, by_addr) != size ? mn__c_tree_size(t, by_addr) < size
               : t->addr < addr;
        if (lt) best = t, t = t->r;
        else t = t->l;
    }
    return best;
}

// In-order predecessor.
MN__PRIVATE mn__c_block *mn__c_tr_prev(mn__c_block *b) {
    if (b->l) {
        b = b->l;
        while (b->r) b = b->r;
        return b;
    }
    while (b->up && b->up->l == b) b = b->up;
    return b->up;
}

// In-order successor.
MN__PRIVATE mn__c_block *mn__c_tr_next(mn__c_block *b) {
    if (b->r) {
        b = b->r;
        while (b->l) b = b->l;
        return b;
    }
    while (b->up && b->up->r == b) b = b->up;
    return b->up;
}

// Collects a tree's nodes in order into a list linked through tmp (first node returned).
MN__PRIVATE mn__c_block *mn__c_tr_collect(mn__c_block *t, mn__c_block *tail_list) {
    if (!t) return tail_list;
    tail_list = mn__c_tr_collect(t->r, tail_list);
    t->tmp = tail_list;
    return mn__c_tr_collect(t->l, t);
}

MN__PRIVATE void mn__c_pool_insert(mn__c_pool *p, mn__c_block *b) {
    MN_ASSERT(!b->in_tree);
    b->l = b->r = NULL;
    b->in_tree = 1;
    if (b->mapped) {
        mn__c_block *gl = p->gap_l, *gr = p->gap_r;
        b->gc_base = p->get_free_calls;  // BlockPool::insert_into_blocks
        // where the last erased block was, when b still sorts there: a leaf without a search
        if ((gl || gr) && (!gl || (gl->in_tree && gl->mapped && mn__c_node_lt(gl, b, 0))) &&
            (!gr || (gr->in_tree && gr->mapped && mn__c_node_lt(b, gr, 0))) &&
            (gl ? mn__c_tr_next(gl) == gr : mn__c_tr_prev(gr) == NULL)) {
            b->l = b->r = NULL;
            if (gl && !gl->r) gl->r = b, b->up = gl;
            else gr->l = b, b->up = gr;
            while (b->up && b->up->prio < b->prio) mn__c_tr_rotate_up(&p->blocks, b);
        } else {
            mn__c_tr_insert(&p->blocks, b, 0);
        }
        p->last = b;
    } else {
        mn__c_tr_insert(&p->unmapped, b, 1);
    }
}

MN__PRIVATE void mn__c_pool_erase(mn__c_pool *p, mn__c_block *b) {
    MN_ASSERT(b->in_tree);
    if (b->mapped) {
        p->gap_l = mn__c_tr_prev(b);
        p->gap_r = mn__c_tr_next(b);
    }
    mn__c_tr_erase(b->mapped ? &p->blocks : &p->unmapped, b);
    b->in_tree = 0;
    b->l = b->r = NULL;
}

MN__PRIVATE mn__c_pool *mn__c_pool_of(mn__c_cache *c, const mn__c_block *b) {
    return b->small ? &c->small : &c->large;
}

// ---- address map -------------------------------------------------------------------------------

// Fibonacci hashing: the top bits of the product (cap is a power of two, at least 2).
MN__PRIVATE uint64_t mn__c_hash(uint64_t addr, uint64_t cap) {
    return ((addr >> 9) * 0x9E3779B97F4A7C15ull) >> (64 - mn__c_log2_floor(cap));
}

// Makes room for one more entry (the only host allocation on the alloc path, done first).
MN__PRIVATE mn_result mn__c_map_reserve(mn__c_cache *c) {
    uint64_t i, cap;
    mn__c_block **nm;
    if ((c->map_count + 1) * 2 <= c->map_cap) return MN_OK;
    cap = c->map_cap ? c->map_cap * 2 : 1024;
    nm = (mn__c_block **)mn__alloc_array(&c->alloc, (size_t)cap, sizeof *nm);
    if (!nm) return MN_ERR_OUT_OF_MEMORY;
    memset(nm, 0, (size_t)cap * sizeof *nm);
    for (i = 0; i < c->map_cap; i++) {
        mn__c_block *b = c->map[i];
        uint64_t h;
        if (!b) continue;
        h = mn__c_hash(b->addr, cap);
        while (nm[h]) h = (h + 1) & (cap - 1);
        nm[h] = b;
    }
    mn__free(&c->alloc, c->map);
    c->map = nm;
    c->map_cap = cap;
    return MN_OK;
}

MN__PRIVATE void mn__c_map_put(mn__c_cache *c, mn__c_block *b) {
    uint64_t h = mn__c_hash(b->addr, c->map_cap);
    while (c->map[h]) h = (h + 1) & (c->map_cap - 1);
    c->map[h] = b;
    c->map_count++;
}

MN__PRIVATE uint64_t mn__c_map_slot(const mn__c_cache *c, uint64_t addr) {
    uint64_t h;
    if (!c->map_cap) return UINT64_MAX;
    h = mn__c_hash(addr, c->map_cap);
    while (c->map[h]) {
        if (c->map[h]->addr == addr) return h;
        h = (h + 1) & (c->map_cap - 1);
    }
    return UINT64_MAX;
}

// Removes slot i, shifting later entries of the probe run back (no tombstones).
MN__PRIVATE void mn__c_map_del(mn__c_cache *c, uint64_t i) {
    uint64_t mask = c->map_cap - 1, j = i;
    c->map[i] = NULL;
    c->map_count--;
    for (;;) {
        uint64_t k;
        j = (j + 1) & mask;
        if (!c->map[j]) return;
        k = mn__c_hash(c->map[j]->addr, c->map_cap);
        // move j back to i if its home k is not cyclically in (i, j]
        if ((i <= j) ? (i < k && k <= j) : (i < k || k <= j)) continue;
        c->map[i] = c->map[j];
        c->map[j] = NULL;
        i = j;
    }
}

// ---- block structs -----------------------------------------------------------------------------

#define MN__C_SPARE_BLOCKS 4

MN__PRIVATE mn_result mn__c_spare_reserve(mn__c_cache *c, uint32_t n) {
    while (c->spare_count < n) {
        mn__c_block *b = (mn__c_block *)mn__alloc(&c->alloc, sizeof *b);
        if (!b) return MN_ERR_OUT_OF_MEMORY;
        b->tmp = c->spare;
        c->spare = b;
        c->spare_count++;
    }
    return MN_OK;
}

// A zeroed block struct from the spares (or the host), NULL when the host is out of memory.
MN__PRIVATE mn__c_block *mn__c_block_new(mn__c_cache *c) {
    mn__c_block *b;
    if (!c->spare && mn__c_spare_reserve(c, 1) != MN_OK) return NULL;
    b = c->spare;
    c->spare = b->tmp;
    c->spare_count--;
    memset(b, 0, sizeof *b);
    c->rng ^= c->rng << 13, c->rng ^= c->rng >> 17, c->rng ^= c->rng << 5;
    b->prio = c->rng;
    b->mapped = 1;
    return b;
}

MN__PRIVATE void mn__c_block_delete(mn__c_cache *c, mn__c_block *b) {
    int k;
    for (k = 0; k < 2; k++) {
        mn__c_pool *p = k ? &c->large : &c->small;
        if (p->last == b) p->last = NULL;
        if (p->gap_l == b) p->gap_l = NULL, p->gap_r = NULL;
        if (p->gap_r == b) p->gap_l = NULL, p->gap_r = NULL;
    }
    if (c->spare_count >= 64) {
        mn__free(&c->alloc, b);
        return;
    }
    b->tmp = c->spare;
    c->spare = b;
    c->spare_count++;
}

MN__PRIVATE void mn__c_fix_head(mn__c_block *b) {
    if (!b->prev) b->seg->head = b;
}

// ---- statistics ----------------------------------------------------------------------------------

MN__PRIVATE void mn__c_stat_inc(mn_stat *s, uint64_t n) {
    s->current += n;
    if (s->current > s->peak) s->peak = s->current;
    s->allocated += n;
}

MN__PRIVATE void mn__c_stat_dec(mn_stat *s, uint64_t n) {
    MN_ASSERT(s->current >= n);
    s->current -= n;
    s->freed += n;
}

// Applies to the aggregate and to the block's pool (get_stat_types_for_pool).
#define MN__C_STAT2(c, field, small, op, n) do { \
    op(&(c)->st.field[MN_STAT_ALL], (n)); \
    op(&(c)->st.field[(small) ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL], (n)); } while (0)

// ---- history -------------------------------------------------------------------------------------

MN__PRIVATE void mn__c_trace_apply(uint64_t *cat, uint64_t *reserved, const mn_trace_entry *e) {
    switch (e->action) {
    case MN_TRACE_ALLOC: cat[e->category] += e->block_size; break;
    case MN_TRACE_FREE_REQUESTED: cat[e->category] -= e->block_size; break;
    case MN_TRACE_SEGMENT_ALLOC: case MN_TRACE_SEGMENT_MAP: *reserved += e->size; break;
    case MN_TRACE_SEGMENT_FREE: case MN_TRACE_SEGMENT_UNMAP: *reserved -= e->size; break;
    default: break;
    }
}

MN__PRIVATE void mn__c_trace(mn__c_cache *c, mn_trace_action a, uint64_t addr, uint64_t size,
                           uint64_t block_size, mn_stream stream, uint8_t cat) {
    mn_trace_entry *e;
    if (!c->ring_cap) return;
    e = &c->ring[c->ring_head];
    if (c->ring_count == c->ring_cap) {  // the oldest entry folds into the base state
        mn__c_trace_apply(c->base_cat, &c->base_reserved, e);
        c->ring_dropped++;
    } else {
        c->ring_count++;
    }
    e->action = a;
    e->addr = addr;
    e->size = size;
    e->block_size = block_size;
    e->stream = stream;
    e->category = (mn_category)cat;
    e->time = c->clock;
    c->ring_head = c->ring_head + 1 == c->ring_cap ? 0 : c->ring_head + 1;
}

// ---- init / free -------------------------------------------------------------------------------

MNIMPL mn_result mn_cache_init(mn_cache *cache, const mn_cache_desc *desc) {
    mn__c_cache *c;
    mn_cache_config cfg;
    mn_result r;
    if (!cache) return MN_ERR_INVALID_ARG;
    cache->p = NULL;
    if (!desc) return MN_ERR_INVALID_ARG;
    if (!desc->device.alloc_fn || !desc->device.free_fn) {
        mn__log(&desc->logger, MN_LOG_ERROR, "cache: the device needs alloc_fn and free_fn");
        return MN_ERR_INVALID_ARG;
    }
    if (desc->settings) cfg = *desc->settings;
    else if ((r = mn_cache_config_parse(desc->config, &cfg, &desc->logger)) != MN_OK) return r;
    if (cfg.garbage_collection_threshold < 0.0 || cfg.garbage_collection_threshold >= 1.0 ||
        (cfg.max_split_size && cfg.max_split_size <= MN__C_LARGE_BUFFER) ||
        (cfg.max_non_split_rounding && cfg.max_non_split_rounding <= MN__C_LARGE_BUFFER)) {
        mn__log(&desc->logger, MN_LOG_ERROR, "cache: settings out of range");
        return MN_ERR_CONFIG;
    }
    if (cfg.expandable_segments && (!desc->device.reserve_fn || !desc->device.map_fn ||
                                    !desc->device.unmap_fn)) {
        mn__log(&desc->logger, MN_LOG_ERROR, "cache: expandable_segments:True needs a device "
                "with reserve_fn, map_fn and unmap_fn");
        return MN_ERR_UNSUPPORTED;
    }
    c = (mn__c_cache *)mn__alloc(&desc->allocator, sizeof *c);
    if (!c) return MN_ERR_OUT_OF_MEMORY;
    memset(c, 0, sizeof *c);
    c->dev = desc->device;
    c->cfg = cfg;
    mn__c_policy_resolve(&cfg, &c->pol);
    c->alloc = desc->allocator;
    c->logger = desc->logger;
    c->device_index = desc->device_index;
    c->small.small = 1;
    c->rng = 0x9E3779B9u;
    c->st.max_split_size = c->pol.max_split;
    if (desc->trace_entries) {
        c->ring = (mn_trace_entry *)mn__alloc_array(&c->alloc, desc->trace_entries,
                                                    sizeof *c->ring);
        if (!c->ring) goto fail_ring;
        c->ring_cap = desc->trace_entries;
    }
    if (mn__c_map_reserve(c) != MN_OK) goto fail_map;
#ifndef MEMANAT_NO_THREADS
    if (pthread_mutex_init(&c->mu, NULL) != 0) goto fail_mutex;
#endif
    cache->p = c;
    return MN_OK;
#ifndef MEMANAT_NO_THREADS
fail_mutex:
    mn__free(&c->alloc, c->map);
#endif
fail_map:
    mn__free(&c->alloc, c->ring);
fail_ring:
    mn__free(&desc->allocator, c);
    return MN_ERR_OUT_OF_MEMORY;
}

// ---- freeing blocks ------------------------------------------------------------------------------

MN__PRIVATE void *mn__c_ptr(uint64_t addr) { return (void *)(uintptr_t)addr; }

// try_merge_blocks: src joins dst when it is free, has no pending events or stream uses, and is
// mapped the same way. Returns the bytes taken over (0 = no merge).
MN__PRIVATE uint64_t mn__c_try_merge(mn__c_cache *c, mn__c_block *dst, mn__c_block *src) {
    uint64_t sub;
    if (!src || src->allocated || src->event_count > 0 || src->uses || dst->mapped != src->mapped)
        return 0;
    mn__c_pool_erase(mn__c_pool_of(c, src), src);
    if (dst->prev == src) {  // [src dst]
        dst->addr = src->addr;
        dst->prev = src->prev;
        if (dst->prev) dst->prev->next = dst;
        else dst->seg->head = dst;
    } else {  // [dst src]
        dst->next = src->next;
        if (dst->next) dst->next->prev = dst;
    }
    sub = src->size;
    dst->size += sub;
    mn__c_block_delete(c, src);
    return sub;
}

// free_block: the block becomes reusable; it merges with free neighbours and returns to its pool.
MN__PRIVATE void mn__c_free_block(mn__c_cache *c, mn__c_block *b) {
    mn__c_pool *p = mn__c_pool_of(c, b);
    uint64_t orig = b->size, req = b->requested, sub;
    int64_t net_blocks = 0, net_bytes = 0;
    int small = b->small;
    mn__c_trace(c, MN_TRACE_FREE_COMPLETED, b->addr, req, orig, b->stream, b->cat);
    sub = mn__c_try_merge(c, b, b->prev);
    if (sub) net_blocks--, net_bytes -= (int64_t)sub;
    sub = mn__c_try_merge(c, b, b->next);
    if (sub) net_blocks--, net_bytes -= (int64_t)sub;
    b->requested = 0;
    mn__c_pool_insert(p, b);
    if (b->prev || b->next) net_blocks++, net_bytes += (int64_t)b->size;
    // inactive_split leaves out expandable segments (PyTorch free_block)
    if (!b->seg->expandable) {
        uint64_t nb = (uint64_t)(net_blocks < 0 ? -net_blocks : net_blocks);
        uint64_t ns = (uint64_t)(net_bytes < 0 ? -net_bytes : net_bytes);
        if (net_blocks > 0) MN__C_STAT2(c, inactive_split, small, mn__c_stat_inc, nb);
        if (net_blocks < 0) MN__C_STAT2(c, inactive_split, small, mn__c_stat_dec, nb);
        if (net_bytes > 0) MN__C_STAT2(c, inactive_split_bytes, small, mn__c_stat_inc, ns);
        if (net_bytes < 0) MN__C_STAT2(c, inactive_split_bytes, small, mn__c_stat_dec, ns);
    }
    MN__C_STAT2(c, active, small, mn__c_stat_dec, 1);
    MN__C_STAT2(c, active_bytes, small, mn__c_stat_dec, orig);
    MN__C_STAT2(c, requested_bytes, small, mn__c_stat_dec, req);
}

MN__PRIVATE void mn__c_seg_unlink(mn__c_cache *c, mn__c_segment *s) {
    if (s->prev_seg) s->prev_seg->next_seg = s->next_seg;
    else c->segs = s->next_seg;
    if (s->next_seg) s->next_seg->prev_seg = s->prev_seg;
    mn__free(&c->alloc, s);
}

MN__PRIVATE void mn__c_seg_link(mn__c_cache *c, mn__c_segment *s) {
    s->prev_seg = NULL;
    s->next_seg = c->segs;
    if (c->segs) c->segs->prev_seg = s;
    c->segs = s;
}

MN__PRIVATE void mn__c_note_dev_error(mn__c_cache *c, mn_result r, const char *what) {
    if (r == MN_OK) return;
    if (c->dev_error == MN_OK) c->dev_error = r;
    mn__log(&c->logger, MN_LOG_ERROR, "cache: device %s failed: %s", what, mn_result_str(r));
}

// release_block: an unsplit free segment goes back to the device.
MN__PRIVATE void mn__c_release_block(mn__c_cache *c, mn__c_block *b) {
    mn__c_segment *s = b->seg;
    int small = b->small;
    MN_ASSERT(!s->expandable && !b->prev && !b->next && !b->allocated);
    c->st.num_device_free++;
    mn__c_trace(c, MN_TRACE_SEGMENT_FREE, b->addr, b->size, b->size, b->stream, 0);
    mn__c_note_dev_error(c, c->dev.free_fn(c->dev.user_data, mn__c_ptr(b->addr), b->size), "free");
    c->total_allocated_memory -= b->size;
    MN__C_STAT2(c, segment, small, mn__c_stat_dec, 1);
    MN__C_STAT2(c, reserved_bytes, small, mn__c_stat_dec, b->size);
    if (b->size >= c->pol.max_split) mn__c_stat_dec(&c->st.oversize_segments, 1);
    mn__c_pool_erase(mn__c_pool_of(c, b), b);
    mn__c_seg_unlink(c, s);
    mn__c_block_delete(c, b);
}

MN__PRIVATE uint64_t mn__c_page_size(const mn__c_cache *c, int small) {
    return small ? MN__C_SMALL_BUFFER : c->pol.large_segment;  // ExpandableSegment segment_size
}

// unmap_block: the whole pages inside a free block of an expandable segment are unmapped; the
// page-unaligned ends stay mapped as free blocks. A segment left fully unmapped is released.
MN__PRIVATE void mn__c_unmap_block(mn__c_cache *c, mn__c_block *b) {
    mn__c_segment *s = b->seg;
    mn__c_pool *p = mn__c_pool_of(c, b);
    uint64_t page = mn__c_page_size(c, b->small), off = b->addr - s->addr;
    uint64_t beg = (off + page - 1) / page * page, end = (off + b->size) / page * page;
    mn__c_block *bf = NULL, *af = NULL;
    if (beg >= end) return;
    if (s->addr + beg > b->addr && !(bf = mn__c_block_new(c))) return;
    if (s->addr + end < b->addr + b->size && !(af = mn__c_block_new(c))) {
        if (bf) mn__c_block_delete(c, bf);
        return;
    }
    mn__c_note_dev_error(c, c->dev.unmap_fn(c->dev.user_data, mn__c_ptr(s->addr + beg), end - beg),
                       "unmap");
    mn__c_pool_erase(p, b);
    if (bf) {  // prev? -> bf -> b
        bf->addr = b->addr, bf->size = s->addr + beg - b->addr;
        bf->stream = b->stream, bf->small = b->small, bf->seg = s;
        bf->prev = b->prev, bf->next = b;
        if (bf->prev) bf->prev->next = bf;
        b->prev = bf;
        mn__c_fix_head(bf);
        mn__c_pool_insert(p, bf);
    }
    if (af) {  // b -> af -> next?
        af->addr = s->addr + end, af->size = b->addr + b->size - (s->addr + end);
        af->stream = b->stream, af->small = b->small, af->seg = s;
        af->next = b->next, af->prev = b;
        if (af->next) af->next->prev = af;
        b->next = af;
        mn__c_pool_insert(p, af);
    }
    b->addr = s->addr + beg;
    b->size = end - beg;
    b->mapped = 0;
    c->total_allocated_memory -= b->size;
    MN__C_STAT2(c, reserved_bytes, b->small, mn__c_stat_dec, b->size);
    c->st.num_device_free++;
    mn__c_trace(c, MN_TRACE_SEGMENT_UNMAP, b->addr, b->size, b->size, b->stream, 0);
    mn__c_try_merge(c, b, b->prev);
    mn__c_try_merge(c, b, b->next);
    mn__c_pool_insert(p, b);
    if (!b->prev && !b->next) {  // release_expandable_segment
        if (c->dev.unreserve_fn)
            mn__c_note_dev_error(c, c->dev.unreserve_fn(c->dev.user_data, mn__c_ptr(s->addr), s->size),
                               "unreserve");
        mn__c_pool_erase(p, b);
        mn__c_seg_unlink(c, s);
        mn__c_block_delete(c, b);
    }
}

// release_blocks: every unsplit free segment of the pool goes back; free expandable pages unmap.
MN__PRIVATE void mn__c_release_blocks(mn__c_cache *c, mn__c_pool *p) {
    mn__c_block *b = mn__c_tr_collect(p->blocks, NULL), *next, *unmap = NULL, **tail = &unmap;
    for (; b; b = next) {
        next = b->tmp;
        if (b->seg->expandable) {
            *tail = b;
            tail = &b->tmp;
        } else if (!b->prev && !b->next) {
            mn__c_release_block(c, b);
        }
    }
    *tail = NULL;
    for (b = unmap; b; b = next) {
        next = b->tmp;
        mn__c_unmap_block(c, b);
    }
}

// ---- stream events -------------------------------------------------------------------------------

MN__PRIVATE void mn__c_use_recycle(mn__c_cache *c, mn__c_use *u) {
    u->next = c->spare_uses;
    c->spare_uses = u;
}

// An event has completed: the block waits for one event less.
MN__PRIVATE void mn__c_event_done(mn__c_cache *c, mn__c_use *u) {
    mn__c_block *b = u->block;
    if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, u->event);
    mn__c_use_recycle(c, u);
    if (--b->event_count == 0) mn__c_free_block(c, b);
}

// process_events: completed events release their blocks; per stream, in record order, stopping
// at the first event not yet done (events of one stream complete in order).
MN__PRIVATE void mn__c_process_events(mn__c_cache *c) {
    mn_stream blocked[32];
    uint32_t nb = 0, k;
    mn__c_use **pp = &c->ev_head, *u, *last = NULL;
    while ((u = *pp) != NULL) {
        int skip = 0;
        for (k = 0; k < nb; k++) skip |= blocked[k] == u->stream;
        if (!skip && !c->dev.event_query_fn(c->dev.user_data, u->event)) {
            skip = 1;
            blocked[nb++] = u->stream;
        }
        if (skip) {
            last = u;
            pp = &u->next;
            if (nb == 32) return;  // the tail is still further on
            continue;
        }
        *pp = u->next;
        mn__c_event_done(c, u);
    }
    c->ev_tail = last;
}

// synchronize_and_free_events: waits for every outstanding event.
MN__PRIVATE void mn__c_sync_and_free_events(mn__c_cache *c) {
    mn__c_use *u = c->ev_head, *next;
    c->st.num_sync_all_streams++;
    c->ev_head = c->ev_tail = NULL;
    for (; u; u = next) {
        next = u->next;
        if (c->dev.event_sync_fn)
            mn__c_note_dev_error(c, c->dev.event_sync_fn(c->dev.user_data, u->event), "event sync");
        mn__c_event_done(c, u);
    }
}

// release_cached_blocks (also emptyCache).
MN__PRIVATE void mn__c_release_cached(mn__c_cache *c) {
    mn__c_sync_and_free_events(c);
    mn__c_release_blocks(c, &c->large);
    mn__c_release_blocks(c, &c->small);
}

// ---- allocation ------------------------------------------------------------------------------------

// lower_bound((s, size, 0)) of the free tree. The block inserted last is the answer when it is
// not less than the key and its predecessor is: an O(1) check that skips the search when a
// freed block is asked for again (the common case in a training loop).
MN__PRIVATE mn__c_block *mn__c_pool_lower_bound(mn__c_pool *p, mn_stream s, uint64_t size) {
    mn__c_block *m = p->last, *q;
    if (m && m->in_tree && m->mapped && m->stream == s && m->size >= size) {
        q = mn__c_tr_prev(m);
        if (!q || q->stream != s || q->size < size) return m;
    }
    return mn__c_tr_lower_bound(p->blocks, s, size, 0, 0);
}

// get_free_block: best fit on the same stream, with the oversize rules.
MN__PRIVATE mn__c_block *mn__c_get_free_block(mn__c_cache *c, mn__c_pool *p, mn_stream s,
                                              uint64_t size) {
    mn__c_block *b;
    if (c->set_fraction && c->cfg.garbage_collection_threshold > 0.0) p->get_free_calls++;
    b = mn__c_pool_lower_bound(p, s, size);
    if (!b || b->stream != s) return NULL;
    if (b->seg->expandable) {
        // rank by the size the block can grow to (its unmapped successor included)
        mn__c_block *n = mn__c_tr_next(b);
        for (;;) {
            uint64_t be = b->size + (b->next && !b->next->mapped ? b->next->size : 0), ne;
            if (!b->seg->expandable || !n || n->stream != s) break;
            ne = n->size + (n->next && !n->next->mapped ? n->next->size : 0);
            if (!(ne < be)) break;
            b = n;
            n = mn__c_tr_next(n);
        }
    }
    // do not return an oversized block for a small request, nor a much larger one for a big one
    if (size < c->pol.max_split && b->size >= c->pol.max_split) return NULL;
    if (size >= c->pol.max_split && b->size >= size + c->pol.max_non_split) return NULL;
    mn__c_pool_erase(p, b);
    return b;
}

MN__PRIVATE int mn__c_allocatable(const mn__c_block *b) {
    return b && !b->allocated && b->event_count == 0 && !b->uses;
}

// map_block: maps whole pages at the front of an unmapped block and merges with its neighbours.
MN__PRIVATE mn_result mn__c_map_block(mn__c_cache *c, mn__c_block *to_map, uint64_t size) {
    mn__c_pool *p = mn__c_pool_of(c, to_map);
    uint64_t page = mn__c_page_size(c, to_map->small), m = (size + page - 1) / page * page, at;
    mn__c_block *rem = NULL;
    mn_result r;
    MN_ASSERT(!to_map->mapped && size <= to_map->size);
    if (m > to_map->size) m = to_map->size;
    if (m < to_map->size && !(rem = mn__c_block_new(c))) return MN_ERR_OUT_OF_MEMORY;
    r = c->dev.map_fn(c->dev.user_data, mn__c_ptr(to_map->addr), m);
    if (r != MN_OK) {
        if (rem) mn__c_block_delete(c, rem);
        return r;
    }
    mn__c_pool_erase(p, to_map);
    to_map->mapped = 1;
    at = to_map->addr;
    if (rem) {  // to_map -> rem -> next?
        rem->addr = to_map->addr + m, rem->size = to_map->size - m, rem->mapped = 0;
        rem->stream = to_map->stream, rem->small = to_map->small, rem->seg = to_map->seg;
        rem->prev = to_map, rem->next = to_map->next;
        if (rem->next) rem->next->prev = rem;
        to_map->next = rem;
        to_map->size = m;
        mn__c_pool_insert(p, rem);
    }
    mn__c_try_merge(c, to_map, to_map->prev);
    mn__c_try_merge(c, to_map, to_map->next);
    mn__c_pool_insert(p, to_map);
    c->total_allocated_memory += m;
    MN__C_STAT2(c, reserved_bytes, to_map->small, mn__c_stat_inc, m);
    c->st.num_device_alloc++;
    mn__c_trace(c, MN_TRACE_SEGMENT_MAP, at, m, m, to_map->stream, 0);
    return MN_OK;
}

// find_expandable_block: free address space of this stream's segment (a free block right before
// an unmapped one counts), or a new segment reserving 9/8 of the device.
MN__PRIVATE mn_result mn__c_find_expandable(mn__c_cache *c, mn__c_pool *p, mn_stream s, uint64_t size,
                                          mn__c_block **out) {
    mn__c_block *it, *b;
    mn__c_segment *seg;
    uint64_t total = 0, fr = 0, va, page = mn__c_page_size(c, p->small);
    void *base = NULL;
    mn_result r;
    for (it = mn__c_tr_lower_bound(p->unmapped, s, 0, 0, 1); it && it->stream == s;
         it = mn__c_tr_next(it)) {
        mn__c_block *cand = mn__c_allocatable(it->prev) ? it->prev : it, *w = cand;
        uint64_t bytes = 0;
        while (bytes < size && mn__c_allocatable(w)) bytes += w->size, w = w->next;
        if (bytes >= size) {
            *out = cand;
            return MN_OK;
        }
    }
    if (!c->dev.mem_info_fn || c->dev.mem_info_fn(c->dev.user_data, &fr, &total) != MN_OK ||
        total == 0)
        total = 1ull << 40;
    va = total + total / 8;
    if (va < size) va = size;
    va = (va + page - 1) / page * page;
    if (!(b = mn__c_block_new(c))) return MN_ERR_OUT_OF_MEMORY;
    r = c->dev.reserve_fn(c->dev.user_data, va, &base);
    if (r != MN_OK) {
        mn__c_block_delete(c, b);
        return r == MN_ERR_OUT_OF_MEMORY ? r : MN_ERR_DEVICE_OOM;
    }
    seg = c->spare_seg;
    c->spare_seg = NULL;
    memset(seg, 0, sizeof *seg);
    seg->addr = (uint64_t)(uintptr_t)base, seg->size = va, seg->stream = s;
    seg->small = (uint8_t)p->small, seg->expandable = 1, seg->head = b;
    mn__c_seg_link(c, seg);
    b->addr = seg->addr, b->size = va, b->mapped = 0, b->stream = s, b->small = seg->small;
    b->seg = seg;
    mn__c_pool_insert(p, b);
    *out = b;
    return MN_OK;
}

// try_allocate_expandable_block
MN__PRIVATE mn_result mn__c_alloc_expandable(mn__c_cache *c, mn__c_pool *p, mn_stream s, uint64_t size,
                                           mn__c_block **out) {
    mn__c_block *cand = NULL;
    mn_result r = mn__c_find_expandable(c, p, s, size, &cand);
    if (r != MN_OK) return r;
    if (!cand->mapped) {
        r = mn__c_map_block(c, cand, cand->size < size ? cand->size : size);
        if (r != MN_OK) return r;
    }
    while (cand->size < size) {  // free -> unmapped -> ...: map more and merge
        mn__c_block *n = cand->next;
        uint64_t rem = size - cand->size;
        MN_ASSERT(n && !n->mapped);
        r = mn__c_map_block(c, n, rem < n->size ? rem : n->size);
        if (r != MN_OK) return r;
        cand = n;
    }
    mn__c_pool_erase(p, cand);
    *out = cand;
    return MN_OK;
}

// alloc_block: a new segment from the device (or mapped pages of an expandable segment).
MN__PRIVATE mn_result mn__c_alloc_block(mn__c_cache *c, mn__c_pool *p, mn_stream s, uint64_t size,
                                      uint64_t alloc_size, int is_retry, mn__c_block **out) {
    mn__c_segment *seg;
    mn__c_block *b;
    void *ptr = NULL;
    mn_result r;
    if (is_retry) c->st.num_alloc_retries++;
    if (c->set_fraction && (alloc_size > c->allowed_max ||
                            c->total_allocated_memory > c->allowed_max - alloc_size))
        return MN_ERR_DEVICE_OOM;
    if (c->cfg.expandable_segments) return mn__c_alloc_expandable(c, p, s, size, out);
    r = c->dev.alloc_fn(c->dev.user_data, alloc_size, &ptr);
    if (r != MN_OK) return r;
    c->total_allocated_memory += alloc_size;
    seg = c->spare_seg;
    c->spare_seg = NULL;
    memset(seg, 0, sizeof *seg);
    seg->addr = (uint64_t)(uintptr_t)ptr, seg->size = alloc_size, seg->stream = s;
    seg->small = (uint8_t)p->small;
    mn__c_seg_link(c, seg);
    b = mn__c_block_new(c);  // reserved by the caller, cannot fail
    b->addr = seg->addr, b->size = alloc_size, b->stream = s, b->small = seg->small, b->seg = seg;
    seg->head = b;
    MN__C_STAT2(c, segment, p->small, mn__c_stat_inc, 1);
    MN__C_STAT2(c, reserved_bytes, p->small, mn__c_stat_inc, alloc_size);
    if (alloc_size >= c->pol.max_split) mn__c_stat_inc(&c->st.oversize_segments, 1);
    c->st.num_device_alloc++;
    mn__c_trace(c, MN_TRACE_SEGMENT_ALLOC, b->addr, alloc_size, alloc_size, s, 0);
    *out = b;
    return MN_OK;
}

// release_available_cached_blocks: with max_split_size set, frees the smallest oversize block of
// this stream that is large enough, or else oversize blocks from the largest down.
MN__PRIVATE int mn__c_release_available(mn__c_cache *c, mn__c_pool *p, mn_stream s, uint64_t size) {
    uint64_t key, released = 0;
    mn__c_block *b;
    if (c->pol.max_split == UINT64_MAX) return 0;
    key = size < c->pol.max_split ? c->pol.max_split : size;
    b = mn__c_tr_lower_bound(p->blocks, s, key, 0, 0);
    if (!b || b->stream != s || b->seg->expandable) {
        b = mn__c_tr_before(p->blocks, s, key, 0, 0);
        while (b && released < key && b->size >= c->pol.max_split && b->stream == s) {
            mn__c_block *cur = b;
            b = mn__c_tr_before(p->blocks, cur->stream, cur->size, cur->addr, 0);
            if (!cur->seg->expandable && !cur->prev && !cur->next) {
                released += cur->size;
                mn__c_release_block(c, cur);
            }
        }
        return released >= key;
    }
    if (b->prev || b->next) return 0;
    mn__c_release_block(c, b);
    return 1;
}

// garbage_collect_cached_blocks: above threshold * allowed memory, frees unsplit large-pool
// blocks whose age (get_free_block calls since they were cached) is at least the average.
MN__PRIVATE void mn__c_garbage_collect(mn__c_cache *c) {
    uint64_t thr = (uint64_t)(c->cfg.garbage_collection_threshold * (double)c->allowed_max);
    uint64_t target, reclaimed = 0, total_age = 0, count = 0;
    mn__c_block *b, *next;
    int freed = 1;
    if (c->total_allocated_memory <= thr) return;
    target = c->total_allocated_memory - thr;
    for (b = mn__c_tr_collect(c->large.blocks, NULL); b; b = b->tmp) {
        if (b->prev || b->next) continue;
        total_age += c->large.get_free_calls - b->gc_base;
        count++;
    }
    while (reclaimed < target && freed && count > 0) {
        double age_thr = (double)total_age / (double)count;
        freed = 0;
        for (b = mn__c_tr_collect(c->large.blocks, NULL); b; b = next) {
            uint64_t age = c->large.get_free_calls - b->gc_base;
            next = b->tmp;
            if (b->prev || b->next || b->seg->expandable || (double)age < age_thr) continue;
            freed = 1;
            reclaimed += b->size;
            total_age -= age;
            count--;
            mn__c_release_block(c, b);
        }
    }
}

// should_split
MN__PRIVATE int mn__c_should_split(const mn__c_cache *c, const mn__c_block *b, uint64_t size) {
    uint64_t remaining = b->size - size;
    if (b->small || c->cfg.expandable_segments) return remaining >= MN__C_MIN_BLOCK;
    return size < c->pol.max_split && remaining > MN__C_SMALL_SIZE;
}

// alloc_found_block: splits off the front when asked and hands the block out.
MN__PRIVATE mn__c_block *mn__c_alloc_found(mn__c_cache *c, mn__c_block *b, uint64_t size,
                                           uint64_t orig, int split, mn_category cat,
                                           const char *label) {
    mn__c_pool *p = mn__c_pool_of(c, b);
    int already_split = b->prev || b->next, exp = b->seg->expandable, small = b->small;
    if (split) {
        mn__c_block *rem = b;
        b = mn__c_block_new(c);  // reserved by the caller
        b->addr = rem->addr, b->size = size, b->stream = rem->stream, b->small = rem->small;
        b->seg = rem->seg;
        b->prev = rem->prev;
        if (b->prev) b->prev->next = b;
        b->next = rem;
        rem->prev = b;
        rem->addr += size;
        rem->size -= size;
        mn__c_fix_head(b);
        mn__c_pool_insert(p, rem);
        if (already_split && !exp) {
            MN__C_STAT2(c, inactive_split_bytes, small, mn__c_stat_dec, size);
        } else if (!exp) {
            MN__C_STAT2(c, inactive_split_bytes, small, mn__c_stat_inc, rem->size);
            MN__C_STAT2(c, inactive_split, small, mn__c_stat_inc, 1);
        }
    } else if (already_split && !exp) {
        MN__C_STAT2(c, inactive_split_bytes, small, mn__c_stat_dec, b->size);
        MN__C_STAT2(c, inactive_split, small, mn__c_stat_dec, 1);
    }
    b->allocated = 1;
    b->requested = orig;
    b->cat = (uint8_t)cat;
    if (label) {
        size_t n = 0;
        while (n < MN_CACHE_LABEL_MAX - 1 && label[n]) b->label[n] = label[n], n++;
        b->label[n] = 0;
    } else {
        b->label[0] = 0;
    }
    mn__c_trace(c, MN_TRACE_ALLOC, b->addr, orig, b->size, b->stream, b->cat);
    mn__c_map_put(c, b);
    MN__C_STAT2(c, allocation, small, mn__c_stat_inc, 1);
    MN__C_STAT2(c, allocated_bytes, small, mn__c_stat_inc, b->size);
    MN__C_STAT2(c, active, small, mn__c_stat_inc, 1);
    MN__C_STAT2(c, active_bytes, small, mn__c_stat_inc, b->size);
    MN__C_STAT2(c, requested_bytes, small, mn__c_stat_inc, orig);
    mn__c_stat_inc(&c->st.cat_allocation[cat], 1);
    mn__c_stat_inc(&c->st.cat_allocated_bytes[cat], b->size);
    mn__c_stat_inc(&c->st.cat_requested_bytes[cat], orig);
    if (c->st.allocated_bytes[MN_STAT_ALL].current == c->st.allocated_bytes[MN_STAT_ALL].peak) {
        int k;
        for (k = 0; k < MN_CAT_COUNT; k++) c->st.cat_at_peak[k] = c->st.cat_allocated_bytes[k].current;
    }
    if (b->size >= c->pol.max_split) mn__c_stat_inc(&c->st.oversize_allocations, 1);
    return b;
}

MNIMPL void mn_cache_format_size(uint64_t n, char *buf, size_t cap) {
    // PyTorch format_size: inclusive comparisons, 1024-based units, two decimals
    if (!buf || !cap) return;
    if (n <= 1024) snprintf(buf, cap, "%llu bytes", (unsigned long long)n);
    else if (n <= 1048576ull) snprintf(buf, cap, "%.2f KiB", (double)n / 1024.0);
    else if (n <= 1073741824ull) snprintf(buf, cap, "%.2f MiB", (double)n / 1048576.0);
    else snprintf(buf, cap, "%.2f GiB", (double)n / 1073741824.0);
}

// The OOM message of CUDACachingAllocator.cpp malloc(), current wording (no NVML process list).
MN__PRIVATE void mn__c_oom_message(mn__c_cache *c, uint64_t alloc_size, uint64_t dev_free,
                                 uint64_t dev_total) {
    char a[32], t[32], f[32], al[32], ub[32], allowed[64];
    uint64_t allocated = c->st.allocated_bytes[MN_STAT_ALL].current;
    uint64_t reserved = c->st.reserved_bytes[MN_STAT_ALL].current;
    mn_cache_format_size(alloc_size, a, sizeof a);
    mn_cache_format_size(dev_total, t, sizeof t);
    mn_cache_format_size(dev_free, f, sizeof f);
    mn_cache_format_size(allocated, al, sizeof al);
    mn_cache_format_size(reserved - allocated, ub, sizeof ub);
    allowed[0] = 0;
    if (c->set_fraction) {
        mn_cache_format_size(c->allowed_max, allowed, sizeof allowed - 12);
        strcat(allowed, " allowed; ");
    }
    snprintf(c->oom_msg, sizeof c->oom_msg,
             "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of "
             "which %s is free. %sOf the allocated memory %s is allocated by PyTorch, and %s is "
             "reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
             "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
             "fragmentation.  See documentation for Memory Management  "
             "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
             a, c->device_index, t, f, allowed, al, ub);
}

MNIMPL mn_result mn_cache_alloc(mn_cache *cache, uint64_t orig, mn_stream stream,
                                mn_category cat, const char *label, void **ptr_out) {
    mn__c_cache *c;
    mn__c_pool *p;
    mn__c_block *b;
    uint64_t size, alloc_size;
    mn_result r;
    if (!cache || !cache->p || !ptr_out || (unsigned)cat >= MN_CAT_COUNT) return MN_ERR_INVALID_ARG;
    c = cache->p;
    *ptr_out = NULL;
    if (orig == 0) return MN_OK;  // PyTorch hands out nullptr for empty tensors
    mn__c_lock(c);
    c->clock++;
    if (orig >= MN__C_ONE_EXA) {
        snprintf(c->oom_msg, sizeof c->oom_msg, "Tried to allocate more than 1EB memory.");
        mn__c_unlock(c);
        return MN_ERR_DEVICE_OOM;
    }
    // host memory first, so that nothing below fails half-way
    if ((r = mn__c_map_reserve(c)) != MN_OK) goto done;
    if ((r = mn__c_spare_reserve(c, MN__C_SPARE_BLOCKS)) != MN_OK) goto done;
    if (c->ev_head) mn__c_process_events(c);
    size = mn__c_round_size(&c->pol, orig);
    p = size <= MN__C_SMALL_SIZE ? &c->small : &c->large;
    alloc_size = mn__c_allocation_size(&c->pol, size);
    b = mn__c_get_free_block(c, p, stream, size);
    if (!b) {
        if (!c->spare_seg) {
            c->spare_seg = (mn__c_segment *)mn__alloc(&c->alloc, sizeof *c->spare_seg);
            if (!c->spare_seg) {
                r = MN_ERR_OUT_OF_MEMORY;
                goto done;
            }
        }
        if (c->set_fraction && c->cfg.garbage_collection_threshold > 0.0) mn__c_garbage_collect(c);
        r = mn__c_alloc_block(c, p, stream, size, alloc_size, 0, &b);
        if (r == MN_ERR_DEVICE_OOM && mn__c_release_available(c, p, stream, size))
            r = mn__c_alloc_block(c, p, stream, size, alloc_size, 0, &b);
        if (r == MN_ERR_DEVICE_OOM) {
            mn__c_release_cached(c);
            r = mn__c_alloc_block(c, p, stream, size, alloc_size, 1, &b);
        }
        if (r == MN_ERR_DEVICE_OOM) {
            uint64_t fr = 0, total = 0;
            if (!c->dev.mem_info_fn || c->dev.mem_info_fn(c->dev.user_data, &fr, &total) != MN_OK)
                fr = total = 0;
            mn__c_trace(c, MN_TRACE_OOM, fr, size, size, stream, (uint8_t)cat);
            c->st.num_ooms++;
            mn__c_oom_message(c, alloc_size, fr, total);
            mn__log(&c->logger, MN_LOG_WARN, "%s", c->oom_msg);
            goto done;
        }
        if (r != MN_OK) goto done;
    }
    b = mn__c_alloc_found(c, b, size, orig, mn__c_should_split(c, b, size), cat, label);
    *ptr_out = mn__c_ptr(b->addr);
    r = MN_OK;
done:
    mn__c_unlock(c);
    return r;
}

MN__PRIVATE mn__c_block *mn__c_lookup(mn__c_cache *c, void *ptr, uint64_t *slot) {
    uint64_t i = mn__c_map_slot(c, (uint64_t)(uintptr_t)ptr);
    if (i == UINT64_MAX) return NULL;
    if (slot) *slot = i;
    return c->map[i];
}

MNIMPL mn_result mn_cache_release(mn_cache *cache, void *ptr) {
    mn__c_cache *c;
    mn__c_block *b;
    mn__c_use *u;
    uint64_t slot = 0;
    uint32_t n = 0;
    int small;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    if (!ptr) return MN_OK;
    c = cache->p;
    mn__c_lock(c);
    b = mn__c_lookup(c, ptr, &slot);
    if (!b) {
        mn__c_unlock(c);
        mn__log(&c->logger, MN_LOG_ERROR, "cache: release of %p, which is not allocated", ptr);
        return MN_ERR_INVALID_ARG;
    }
    c->clock++;
    if (b->uses && c->dev.event_record_fn) {  // insert_events: one event per use stream
        for (u = b->uses; u; u = u->next) {
            mn_result r = c->dev.event_record_fn(c->dev.user_data, u->stream, &u->event);
            if (r != MN_OK) {
                mn__c_use *v;
                for (v = b->uses; v != u; v = v->next)
                    if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, v->event);
                mn__c_unlock(c);
                return r;
            }
            u->block = b;
            n++;
        }
    }
    small = b->small;
    mn__c_map_del(c, slot);
    b->allocated = 0;
    MN__C_STAT2(c, allocation, small, mn__c_stat_dec, 1);
    MN__C_STAT2(c, allocated_bytes, small, mn__c_stat_dec, b->size);
    mn__c_stat_dec(&c->st.cat_allocation[b->cat], 1);
    mn__c_stat_dec(&c->st.cat_allocated_bytes[b->cat], b->size);
    mn__c_stat_dec(&c->st.cat_requested_bytes[b->cat], b->requested);
    mn__c_trace(c, MN_TRACE_FREE_REQUESTED, b->addr, b->requested, b->size, b->stream, b->cat);
    if (b->size >= c->pol.max_split) mn__c_stat_dec(&c->st.oversize_allocations, 1);
    if (n) {
        mn__c_use *first = b->uses, *last = b->uses;
        while (last->next) last = last->next;
        b->uses = NULL;
        b->event_count = n;
        if (c->ev_tail) c->ev_tail->next = first;
        else c->ev_head = first;
        c->ev_tail = last;
    } else {
        while ((u = b->uses) != NULL) {
            b->uses = u->next;
            mn__c_use_recycle(c, u);
        }
        mn__c_free_block(c, b);
    }
    mn__c_unlock(c);
    return MN_OK;
}

MNIMPL mn_result mn_cache_record_stream(mn_cache *cache, void *ptr, mn_stream stream) {
    mn__c_cache *c;
    mn__c_block *b;
    mn__c_use *u;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mn__c_lock(c);
    b = mn__c_lookup(c, ptr, NULL);
    if (!b) {
        mn__c_unlock(c);
        return MN_ERR_INVALID_ARG;
    }
    if (stream != b->stream) {  // uses on the allocation stream need no synchronization
        for (u = b->uses; u; u = u->next)
            if (u->stream == stream) break;
        if (!u) {
            u = c->spare_uses;
            if (u) c->spare_uses = u->next;
            else u = (mn__c_use *)mn__alloc(&c->alloc, sizeof *u);
            if (!u) {
                mn__c_unlock(c);
                return MN_ERR_OUT_OF_MEMORY;
            }
            memset(u, 0, sizeof *u);
            u->stream = stream;
            u->block = b;
            u->next = b->uses;
            b->uses = u;
        }
    }
    mn__c_unlock(c);
    return MN_OK;
}

MNIMPL mn_result mn_cache_empty(mn_cache *cache) {
    mn__c_cache *c;
    mn_result r;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mn__c_lock(c);
    c->clock++;
    c->dev_error = MN_OK;
    mn__c_release_cached(c);
    r = c->dev_error;
    mn__c_unlock(c);
    return r;
}

MNIMPL mn_result mn_cache_set_memory_fraction(mn_cache *cache, double fraction) {
    mn__c_cache *c;
    uint64_t fr = 0, total = 0;
    mn_result r;
    if (!cache || !cache->p || !(fraction > 0.0) || fraction > 1.0) return MN_ERR_INVALID_ARG;
    c = cache->p;
    if (!c->dev.mem_info_fn) return MN_ERR_UNSUPPORTED;
    mn__c_lock(c);
    r = c->dev.mem_info_fn(c->dev.user_data, &fr, &total);
    if (r == MN_OK) {
        c->allowed_max = (uint64_t)(fraction * (double)total);
        c->set_fraction = 1;
    }
    mn__c_unlock(c);
    return r;
}

MNIMPL mn_result mn_cache_stats(mn_cache *cache, struct mn_cache_stats *out) {
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    mn__c_lock(cache->p);
    *out = cache->p->st;
    mn__c_unlock(cache->p);
    return MN_OK;
}

MN__PRIVATE void mn__c_reset_peak(mn_stat *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) s[i].peak = s[i].current;
}

MN__PRIVATE void mn__c_reset_acc(mn_stat *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) s[i].allocated = s[i].freed = 0;
}

#define MN__C_STAT_ARRAYS(X, st) \
    X((st).allocation, MN_STAT_TYPE_COUNT); X((st).segment, MN_STAT_TYPE_COUNT); \
    X((st).active, MN_STAT_TYPE_COUNT); X((st).inactive_split, MN_STAT_TYPE_COUNT); \
    X((st).allocated_bytes, MN_STAT_TYPE_COUNT); X((st).reserved_bytes, MN_STAT_TYPE_COUNT); \
    X((st).active_bytes, MN_STAT_TYPE_COUNT); X((st).inactive_split_bytes, MN_STAT_TYPE_COUNT); \
    X((st).requested_bytes, MN_STAT_TYPE_COUNT); X(&(st).oversize_allocations, 1); \
    X(&(st).oversize_segments, 1); X((st).cat_allocation, MN_CAT_COUNT); \
    X((st).cat_allocated_bytes, MN_CAT_COUNT); X((st).cat_requested_bytes, MN_CAT_COUNT)

MNIMPL void mn_cache_reset_peak_stats(mn_cache *cache) {
    mn__c_cache *c;
    int k;
    if (!cache || !cache->p) return;
    c = cache->p;
    mn__c_lock(c);
    MN__C_STAT_ARRAYS(mn__c_reset_peak, c->st);
    for (k = 0; k < MN_CAT_COUNT; k++) c->st.cat_at_peak[k] = c->st.cat_allocated_bytes[k].current;
    mn__c_unlock(c);
}

MNIMPL void mn_cache_reset_accumulated_stats(mn_cache *cache) {
    mn__c_cache *c;
    if (!cache || !cache->p) return;
    c = cache->p;
    mn__c_lock(c);
    MN__C_STAT_ARRAYS(mn__c_reset_acc, c->st);
    c->st.num_alloc_retries = c->st.num_ooms = c->st.num_sync_all_streams = 0;
    c->st.num_device_alloc = c->st.num_device_free = 0;
    mn__c_unlock(c);
}

MNIMPL mn_result mn_cache_config_get(mn_cache *cache, mn_cache_config *out) {
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    *out = cache->p->cfg;
    return MN_OK;
}

MNIMPL void mn_cache_oom_message(mn_cache *cache, char *buf, size_t cap) {
    if (!buf || !cap) return;
    buf[0] = 0;
    if (!cache || !cache->p) return;
    mn__c_lock(cache->p);
    snprintf(buf, cap, "%s", cache->p->oom_msg);
    mn__c_unlock(cache->p);
}

MNIMPL void mn_cache_free(mn_cache *cache) {
    mn__c_cache *c;
    mn__c_segment *s, *sn;
    mn__c_use *u, *un;
    mn__c_block *b, *bn;
    if (!cache || !cache->p) return;
    c = cache->p;
    for (u = c->ev_head; u; u = un) {  // pending events: nothing waits any more
        un = u->next;
        if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, u->event);
        mn__free(&c->alloc, u);
    }
    for (s = c->segs; s; s = sn) {
        sn = s->next_seg;
        if (!s->expandable) {
            c->dev.free_fn(c->dev.user_data, mn__c_ptr(s->addr), s->size);
        }
        for (b = s->head; b; b = bn) {
            bn = b->next;
            if (s->expandable && b->mapped)
                c->dev.unmap_fn(c->dev.user_data, mn__c_ptr(b->addr), b->size);
            for (u = b->uses; u; u = un) un = u->next, mn__free(&c->alloc, u);
            mn__free(&c->alloc, b);
        }
        if (s->expandable && c->dev.unreserve_fn)
            c->dev.unreserve_fn(c->dev.user_data, mn__c_ptr(s->addr), s->size);
        mn__free(&c->alloc, s);
    }
    for (b = c->spare; b; b = bn) bn = b->tmp, mn__free(&c->alloc, b);
    for (u = c->spare_uses; u; u = un) un = u->next, mn__free(&c->alloc, u);
    mn__free(&c->alloc, c->spare_seg);
    mn__free(&c->alloc, c->map);
    mn__free(&c->alloc, c->ring);
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_destroy(&c->mu);
#endif
    {
        mn_allocator a = c->alloc;
        mn__free(&a, c);
    }
    cache->p = NULL;
}

// ---- invariant check -------------------------------------------------------------------------------

MN__PRIVATE uint64_t mn__c_tree_check(const mn__c_block *t, uint64_t *count, int by_addr,
                                      const mn__c_block **prev, int *bad) {
    if (!t) return 0;
    if ((t->l && (t->l->prio > t->prio || t->l->up != t)) ||
        (t->r && (t->r->prio > t->prio || t->r->up != t)))
        *bad = 1;
    mn__c_tree_check(t->l, count, by_addr, prev, bad);
    if (*prev && !mn__c_node_lt(*prev, t, by_addr)) *bad = 1;
    if (!t->in_tree || (t->mapped != !by_addr) || t->allocated) *bad = 1;
    *prev = t;
    (*count)++;
    mn__c_tree_check(t->r, count, by_addr, prev, bad);
    return *count;
}

#define MN__C_FAIL(...) do { mn__log(&c->logger, MN_LOG_ERROR, __VA_ARGS__); r = MN_ERR_STATE; \
    goto done; } while (0)

MNIMPL mn_result mn_cache_check(mn_cache *cache) {
    mn__c_cache *c;
    mn__c_segment *s;
    mn__c_block *b;
    struct mn_cache_stats want;
    uint64_t in_tree[2] = {0, 0}, counted[2] = {0, 0}, unm[2] = {0, 0}, allocated = 0, total = 0;
    mn_result r = MN_OK;
    int bad = 0, k, t;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mn__c_lock(c);
    memset(&want, 0, sizeof want);
    for (s = c->segs; s; s = s->next_seg) {
        uint64_t sum = 0, at = s->addr;
        int split;
        if (!s->head || s->head->prev)
            MN__C_FAIL("cache check: segment %llx head", (unsigned long long)s->addr);
        split = s->head->next != NULL;
        if (!s->expandable) {
            t = s->small ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL;
            want.segment[t].current++;
            want.reserved_bytes[t].current += s->size;
        }
        for (b = s->head; b; b = b->next) {
            int pool = b->small ? 0 : 1;
            t = b->small ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL;
            if (b->seg != s || b->addr != at || b->size == 0 || (b->next && b->next->prev != b) ||
                b->small != s->small || b->stream != s->stream)
                MN__C_FAIL("cache check: block %llx does not tile its segment",
                           (unsigned long long)b->addr);
            if (b->next && !b->allocated && !b->next->allocated && !b->event_count &&
                !b->next->event_count && !b->uses && !b->next->uses &&
                b->mapped == b->next->mapped)
                MN__C_FAIL("cache check: free blocks %llx and its successor were not merged",
                           (unsigned long long)b->addr);
            at += b->size, sum += b->size;
            if (s->expandable && b->mapped) want.reserved_bytes[t].current += b->size;
            if (b->allocated) {
                if (b->in_tree || mn__c_lookup(c, mn__c_ptr(b->addr), NULL) != b || b->event_count)
                    MN__C_FAIL("cache check: allocated block %llx not in the map",
                               (unsigned long long)b->addr);
                allocated++;
                want.allocation[t].current++;
                want.allocated_bytes[t].current += b->size;
                want.cat_allocation[b->cat].current++;
                want.cat_allocated_bytes[b->cat].current += b->size;
                want.cat_requested_bytes[b->cat].current += b->requested;
                if (b->size >= c->pol.max_split) want.oversize_allocations.current++;
            } else if (b->event_count) {
                if (b->in_tree) MN__C_FAIL("cache check: pending block in a pool");
            } else {
                if (!b->in_tree) MN__C_FAIL("cache check: free block %llx not in its pool",
                                            (unsigned long long)b->addr);
                if (b->mapped) in_tree[pool]++;
                else unm[pool]++;
                if (split && !s->expandable) {
                    want.inactive_split[t].current++;
                    want.inactive_split_bytes[t].current += b->size;
                }
            }
            if (b->allocated || b->event_count) {
                want.active[t].current++;
                want.active_bytes[t].current += b->size;
                want.requested_bytes[t].current += b->requested;
            }
        }
        if (sum != s->size) MN__C_FAIL("cache check: segment %llx blocks sum to %llu, not %llu",
                                       (unsigned long long)s->addr, (unsigned long long)sum,
                                       (unsigned long long)s->size);
        if (!s->expandable && s->size >= c->pol.max_split) want.oversize_segments.current++;
    }
    for (k = 0; k < 2; k++) {
        mn__c_pool *p = k ? &c->large : &c->small;
        const mn__c_block *prev = NULL;
        uint64_t n = 0;
        mn__c_tree_check(p->blocks, &n, 0, &prev, &bad);
        counted[k] = n;
        n = 0, prev = NULL;
        mn__c_tree_check(p->unmapped, &n, 1, &prev, &bad);
        if (bad) MN__C_FAIL("cache check: pool tree out of order");
        if (counted[k] != in_tree[k] || n != unm[k])
            MN__C_FAIL("cache check: pool holds %llu blocks, %llu are free",
                       (unsigned long long)counted[k], (unsigned long long)in_tree[k]);
    }
    if (allocated != c->map_count) MN__C_FAIL("cache check: address map size");
    for (t = 1; t < MN_STAT_TYPE_COUNT; t++) {
        want.allocation[0].current += want.allocation[t].current;
        want.segment[0].current += want.segment[t].current;
        want.active[0].current += want.active[t].current;
        want.inactive_split[0].current += want.inactive_split[t].current;
        want.allocated_bytes[0].current += want.allocated_bytes[t].current;
        want.reserved_bytes[0].current += want.reserved_bytes[t].current;
        want.active_bytes[0].current += want.active_bytes[t].current;
        want.inactive_split_bytes[0].current += want.inactive_split_bytes[t].current;
        want.requested_bytes[0].current += want.requested_bytes[t].current;
    }
    total = want.reserved_bytes[0].current;
    if (total != c->total_allocated_memory) MN__C_FAIL("cache check: total_allocated_memory");
    for (t = 0; t < MN_STAT_TYPE_COUNT; t++) {
#define MN__C_CMP(f) if (want.f[t].current != c->st.f[t].current) \
        MN__C_FAIL("cache check: " #f "[%d] is %llu, blocks say %llu", t, \
                   (unsigned long long)c->st.f[t].current, (unsigned long long)want.f[t].current)
        MN__C_CMP(allocation); MN__C_CMP(segment); MN__C_CMP(active); MN__C_CMP(inactive_split);
        MN__C_CMP(allocated_bytes); MN__C_CMP(reserved_bytes); MN__C_CMP(active_bytes);
        MN__C_CMP(inactive_split_bytes); MN__C_CMP(requested_bytes);
    }
    for (t = 0; t < MN_CAT_COUNT; t++) {
        MN__C_CMP(cat_allocation); MN__C_CMP(cat_allocated_bytes); MN__C_CMP(cat_requested_bytes);
#undef MN__C_CMP
    }
    if (want.oversize_allocations.current != c->st.oversize_allocations.current ||
        want.oversize_segments.current != c->st.oversize_segments.current)
        MN__C_FAIL("cache check: oversize counts");
done:
    mn__c_unlock(c);
    return r;
}
#undef MN__C_FAIL

// ---- snapshot ------------------------------------------------------------------------------------

MNIMPL const char *mn_trace_action_name(mn_trace_action a) {
    static const char *const names[MN_TRACE_ACTION_COUNT] = {
        "unknown", "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
        "segment_map", "segment_unmap", "oom"};
    return (unsigned)a < MN_TRACE_ACTION_COUNT ? names[a] : "unknown";
}

MNIMPL const char *mn_block_state_name(mn_block_state s) {
    static const char *const names[MN_BLOCK_STATE_COUNT] = {
        "unknown", "active_allocated", "active_pending_free", "inactive"};
    return (unsigned)s < MN_BLOCK_STATE_COUNT ? names[s] : "unknown";
}

MN__PRIVATE int mn__c_seg_cmp(const void *a, const void *b) {
    const mn_segment_info *x = (const mn_segment_info *)a, *y = (const mn_segment_info *)b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

MNIMPL mn_result mn_cache_snapshot_take(mn_cache *cache, mn_cache_snapshot *out) {
    mn__c_cache *c;
    mn__c_segment *s;
    mn__c_block *b;
    uint64_t nseg = 0, nblk = 0, i, bi = 0, si = 0;
    mn_block_info *tmpb = NULL;
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    c = cache->p;
    memset(out, 0, sizeof *out);
    out->allocator = c->alloc;
    mn__c_lock(c);
    for (s = c->segs; s; s = s->next_seg)
        for (b = s->head; b; b = b->next) {
            if (!b->mapped) continue;
            nblk++;
            if (!b->prev || !b->prev->mapped) nseg++;
        }
    out->segments = (mn_segment_info *)mn__alloc_array(&c->alloc, (size_t)nseg, sizeof *out->segments);
    out->blocks = (mn_block_info *)mn__alloc_array(&c->alloc, (size_t)nblk, sizeof *out->blocks);
    tmpb = (mn_block_info *)mn__alloc_array(&c->alloc, (size_t)nblk, sizeof *tmpb);
    out->trace = (mn_trace_entry *)mn__alloc_array(&c->alloc, (size_t)c->ring_count,
                                                   sizeof *out->trace);
    if (!out->segments || !out->blocks || !tmpb || !out->trace) {
        mn__c_unlock(c);
        mn__free(&c->alloc, tmpb);
        mn_cache_snapshot_free(out);
        return MN_ERR_OUT_OF_MEMORY;
    }
    for (s = c->segs; s; s = s->next_seg) {
        for (b = s->head; b; b = b->next) {
            mn_segment_info *g;
            mn_block_info *x;
            if (!b->mapped) continue;
            if (!b->prev || !b->prev->mapped) {
                g = &out->segments[si++];
                memset(g, 0, sizeof *g);
                g->addr = b->addr, g->stream = s->stream, g->is_small = s->small;
                g->is_expandable = s->expandable, g->first_block = bi;
            }
            g = &out->segments[si - 1];
            x = &tmpb[bi++];
            memset(x, 0, sizeof *x);
            x->addr = b->addr, x->size = b->size;
            x->state = b->allocated ? MN_BLOCK_ACTIVE_ALLOCATED
                     : b->event_count ? MN_BLOCK_ACTIVE_PENDING_FREE : MN_BLOCK_INACTIVE;
            x->requested = x->state == MN_BLOCK_INACTIVE ? 0 : b->requested;
            x->category = (mn_category)b->cat;
            memcpy(x->label, b->label, sizeof x->label);
            g->total_size += b->size;
            g->block_count++;
            if (b->allocated) g->allocated_size += b->size;
            if (x->state != MN_BLOCK_INACTIVE) {
                g->active_size += b->size;
                g->requested_size += b->requested;
            }
        }
    }
    out->segment_count = nseg;
    out->block_count = nblk;
    for (i = 0; i < c->ring_count; i++) {
        uint64_t j = (c->ring_head + c->ring_cap - c->ring_count + i) % c->ring_cap;
        out->trace[i] = c->ring[j];
    }
    out->trace_count = c->ring_count;
    out->trace_dropped = c->ring_dropped;
    memcpy(out->base_cat_allocated, c->base_cat, sizeof c->base_cat);
    out->base_reserved = c->base_reserved;
    out->config = c->cfg;
    out->device_index = c->device_index;
    out->stats = c->st;
    mn__c_unlock(c);
    // segments by address, their blocks gathered in the same order
    qsort(out->segments, (size_t)nseg, sizeof *out->segments, mn__c_seg_cmp);
    for (i = 0, bi = 0; i < nseg; i++) {
        mn_segment_info *g = &out->segments[i];
        memcpy(&out->blocks[bi], &tmpb[g->first_block], (size_t)g->block_count * sizeof *tmpb);
        g->first_block = bi;
        bi += g->block_count;
    }
    mn__free(&c->alloc, tmpb);
    return MN_OK;
}

MNIMPL void mn_cache_snapshot_free(mn_cache_snapshot *s) {
    if (!s) return;
    mn__free(&s->allocator, s->segments);
    mn__free(&s->allocator, s->blocks);
    mn__free(&s->allocator, s->trace);
    s->segments = NULL, s->blocks = NULL, s->trace = NULL;
    s->segment_count = s->block_count = s->trace_count = 0;
}

// ---- text writers ----------------------------------------------------------------------------------

typedef struct mn__c_out {
    mn_cache_write_fn fn;
    void *ud;
    mn_result r;
} mn__c_out;

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
MN__PRIVATE void mn__c_printf(mn__c_out *o, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    int n;
    if (o->r != MN_OK) return;
    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0) {
        o->r = MN_ERR_IO;
        return;
    }
    if ((size_t)n >= sizeof buf) n = (int)sizeof buf - 1;
    o->r = o->fn(o->ud, buf, (size_t)n);
}

// memory_summary _format_size: divide by 1024 while the reference (the "all" row) >= 768 KiB.
MN__PRIVATE void mn__c_fmt_size(char *buf, uint64_t sz, uint64_t ref) {
    static const char *const pre[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double pref = (double)ref;
    int i = 0;
    while (i < 5 && !(pref < 768.0 * 1024.0)) sz /= 1024, pref /= 1024.0, i++;
    sprintf(buf, "%6llu %s", (unsigned long long)sz, pre[i]);
}

// _format_count: divide by 1000 while the reference >= 750,000.
MN__PRIVATE void mn__c_fmt_count(char *buf, uint64_t n, uint64_t ref) {
    static const char *const pre[] = {" ", "K", "M"};
    double pref = (double)ref;
    int i = 0;
    while (i < 2 && !(pref < 750.0 * 1000.0)) n /= 1000, pref /= 1000.0, i++;
    sprintf(buf, "%7llu %s ", (unsigned long long)n, pre[i]);
}

MN__PRIVATE void mn__c_summary_row(mn__c_out *o, const char *name, const mn_stat *v,
                                   const mn_stat *ref, int bytes) {
    char cell[4][48];
    const uint64_t val[4] = {v->current, v->peak, v->allocated, v->freed};
    const uint64_t rv[4] = {ref->current, ref->peak, ref->allocated, ref->freed};
    int i;
    for (i = 0; i < 4; i++) {
        if (bytes) mn__c_fmt_size(cell[i], val[i], rv[i]);
        else mn__c_fmt_count(cell[i], val[i], rv[i]);
    }
    mn__c_printf(o, "| %-21s | %s | %s | %s | %s |\n", name, cell[0], cell[1], cell[2], cell[3]);
}

MNIMPL mn_result mn_cache_summary_write(const struct mn_cache_stats *s, int device_index,
                                        int abbreviated, mn_cache_write_fn fn, void *user_data) {
    // torch/cuda/memory.py memory_summary(): 75-character box, rows "all", large, small pool
    static const char *const eq =
        "===========================================================================";
    static const char *const dash =
        "---------------------------------------------------------------------------";
    const struct { const mn_stat *st; const char *name; int bytes; } m[9] = {
        {s->allocated_bytes, "Allocated memory", 1}, {s->active_bytes, "Active memory", 1},
        {s->requested_bytes, "Requested memory", 1}, {s->reserved_bytes, "GPU reserved memory", 1},
        {s->inactive_split_bytes, "Non-releasable memory", 1}, {s->allocation, "Allocations", 0},
        {s->active, "Active allocs", 0}, {s->segment, "GPU reserved segments", 0},
        {s->inactive_split, "Non-releasable allocs", 0}};
    mn__c_out o;
    int i;
    if (!s || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    mn__c_printf(&o, "|%s|\n", eq);
    mn__c_printf(&o, "| %16s PyTorch CUDA memory summary, device ID %-17d |\n", "", device_index);
    mn__c_printf(&o, "|%s|\n", dash);
    mn__c_printf(&o, "|  %9s CUDA OOMs: %-12llu | %6s cudaMalloc retries: %-8llu  |\n", "",
                 (unsigned long long)s->num_ooms, "", (unsigned long long)s->num_alloc_retries);
    mn__c_printf(&o, "|%s|\n", eq);
    mn__c_printf(&o, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | "
                 "Tot Freed  |\n");
    for (i = 0; i < 9; i++) {
        mn__c_printf(&o, "|%s|\n", dash);
        mn__c_summary_row(&o, m[i].name, &m[i].st[MN_STAT_ALL], &m[i].st[MN_STAT_ALL], m[i].bytes);
        if (abbreviated) continue;
        mn__c_summary_row(&o, "      from large pool", &m[i].st[MN_STAT_LARGE_POOL],
                          &m[i].st[MN_STAT_ALL], m[i].bytes);
        mn__c_summary_row(&o, "      from small pool", &m[i].st[MN_STAT_SMALL_POOL],
                          &m[i].st[MN_STAT_ALL], m[i].bytes);
    }
    mn__c_printf(&o, "|%s|\n", dash);
    mn__c_summary_row(&o, "Oversize allocations", &s->oversize_allocations,
                      &s->oversize_allocations, 0);
    mn__c_printf(&o, "|%s|\n", dash);
    mn__c_summary_row(&o, "Oversize GPU segments", &s->oversize_segments, &s->oversize_segments, 0);
    mn__c_printf(&o, "|%s|\n", eq);
    return o.r;
}

MNIMPL mn_result mn_cache_category_summary_write(const struct mn_cache_stats *s,
                                                 mn_cache_write_fn fn, void *user_data) {
    mn__c_out o;
    int k;
    if (!s || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    mn__c_printf(&o, "%-15s %12s %12s %14s %12s\n", "category", "current", "peak",
                 "at alloc peak", "allocations");
    for (k = 0; k < MN_CAT_COUNT; k++) {
        char cur[32], peak[32], at[32];
        if (!s->cat_allocation[k].allocated && !s->cat_allocation[k].current) continue;
        mn_size_format(s->cat_allocated_bytes[k].current, cur, sizeof cur);
        mn_size_format(s->cat_allocated_bytes[k].peak, peak, sizeof peak);
        mn_size_format(s->cat_at_peak[k], at, sizeof at);
        mn__c_printf(&o, "%-15s %12s %12s %14s %12llu\n", mn_category_name((mn_category)k), cur,
                     peak, at, (unsigned long long)s->cat_allocation[k].allocated);
    }
    return o.r;
}

// JSON string body: quotes, backslashes and control bytes escaped.
MN__PRIVATE void mn__c_json_str(mn__c_out *o, const char *s) {
    char buf[2 * MN_CACHE_LABEL_MAX * 4 + 8];
    size_t n = 0;
    buf[n++] = '"';
    for (; *s && n < sizeof buf - 8; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') buf[n++] = '\\', buf[n++] = (char)ch;
        else if (ch < 0x20) n += (size_t)sprintf(buf + n, "\\u%04x", ch);
        else buf[n++] = (char)ch;
    }
    buf[n++] = '"';
    buf[n] = 0;
    mn__c_printf(o, "%s", buf);
}

MN__PRIVATE void mn__c_json_frames(mn__c_out *o, mn_category cat, const char *label) {
    // memory_viz shows frames as the allocation's stack: one frame names category and label
    mn__c_printf(o, "\"frames\":[{\"filename\":\"%s\",\"line\":0,\"name\":", mn_category_name(cat));
    mn__c_json_str(o, label && label[0] ? label : mn_category_name(cat));
    mn__c_printf(o, "}],\"category\":\"%s\"", mn_category_name(cat));
}

MNIMPL mn_result mn_cache_snapshot_write_json(const mn_cache_snapshot *s, mn_cache_write_fn fn,
                                              void *user_data) {
    mn__c_out o;
    uint64_t i, j;
    int k;
    if (!s || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    mn__c_printf(&o, "{\"segments\":[");
    for (i = 0; i < s->segment_count && o.r == MN_OK; i++) {
        const mn_segment_info *g = &s->segments[i];
        mn__c_printf(&o, "%s\n{\"device\":%d,\"address\":%llu,\"total_size\":%llu,"
                     "\"allocated_size\":%llu,\"active_size\":%llu,\"requested_size\":%llu,"
                     "\"stream\":%u,\"segment_type\":\"%s\",\"segment_pool_id\":[0,0],"
                     "\"is_expandable\":%s,\"frames\":[],\"blocks\":[",
                     i ? "," : "", s->device_index, (unsigned long long)g->addr,
                     (unsigned long long)g->total_size, (unsigned long long)g->allocated_size,
                     (unsigned long long)g->active_size, (unsigned long long)g->requested_size,
                     (unsigned)g->stream, g->is_small ? "small" : "large",
                     g->is_expandable ? "true" : "false");
        for (j = 0; j < g->block_count; j++) {
            const mn_block_info *b = &s->blocks[g->first_block + j];
            mn__c_printf(&o, "%s{\"address\":%llu,\"size\":%llu,\"requested_size\":%llu,"
                         "\"state\":\"%s\",", j ? "," : "", (unsigned long long)b->addr,
                         (unsigned long long)b->size, (unsigned long long)b->requested,
                         mn_block_state_name(b->state));
            if (b->state == MN_BLOCK_INACTIVE) mn__c_printf(&o, "\"frames\":[]}");
            else mn__c_json_frames(&o, b->category, b->label), mn__c_printf(&o, "}");
        }
        mn__c_printf(&o, "]}");
    }
    mn__c_printf(&o, "],\n\"device_traces\":[");
    for (k = 0; k < s->device_index; k++) mn__c_printf(&o, "[],");
    mn__c_printf(&o, "[");
    for (i = 0; i < s->trace_count && o.r == MN_OK; i++) {
        const mn_trace_entry *e = &s->trace[i];
        mn__c_printf(&o, "%s\n{\"action\":\"%s\",\"%s\":%llu,\"size\":%llu,\"stream\":%u,"
                     "\"time_us\":%llu,", i ? "," : "", mn_trace_action_name(e->action),
                     e->action == MN_TRACE_OOM ? "device_free" : "addr",
                     (unsigned long long)e->addr, (unsigned long long)e->size,
                     (unsigned)e->stream, (unsigned long long)e->time);
        if (e->action == MN_TRACE_ALLOC || e->action == MN_TRACE_FREE_REQUESTED ||
            e->action == MN_TRACE_FREE_COMPLETED || e->action == MN_TRACE_OOM)
            mn__c_json_frames(&o, e->category, NULL), mn__c_printf(&o, "}");
        else mn__c_printf(&o, "\"frames\":[]}");
    }
    mn__c_printf(&o, "]],\n\"allocator_settings\":{\"PYTORCH_CUDA_ALLOC_CONF\":\"\","
                 "\"max_split_size\":%lld,\"garbage_collection_threshold\":%g,"
                 "\"expandable_segments\":%s,\"roundup_power2_divisions\":[",
                 s->config.max_split_size ? (long long)s->config.max_split_size : -1LL,
                 s->config.garbage_collection_threshold,
                 s->config.expandable_segments ? "true" : "false");
    for (k = 0; k < MN_CACHE_ROUNDUP_INTERVALS; k++)
        mn__c_printf(&o, "%s%u", k ? "," : "", s->config.roundup_power2_divisions[k]);
    mn__c_printf(&o, "]}}\n");
    return o.r;
}

// ---- SVG timeline ----------------------------------------------------------------------------------

MN__PRIVATE void mn__c_svg_bytes(char *buf, size_t cap, double v) {
    if (v >= 1073741824.0) snprintf(buf, cap, "%.1f GiB", v / 1073741824.0);
    else if (v >= 1048576.0) snprintf(buf, cap, "%.1f MiB", v / 1048576.0);
    else if (v >= 1024.0) snprintf(buf, cap, "%.1f KiB", v / 1024.0);
    else snprintf(buf, cap, "%.0f B", v);
}

#define MN__C_SVG_COLS 600

MNIMPL mn_result mn_cache_timeline_svg(const mn_cache_snapshot *s, const char *title,
                                       mn_cache_write_fn fn, void *user_data) {
    // columns: the state at the moment of largest allocated total within each slice of events
    static const char *const colors[MN_CAT_COUNT] = {"#9e9e9e", "#1f77b4", "#17becf", "#ff7f0e",
                                                     "#d62728", "#2ca02c", "#bcbd22", "#9467bd",
                                                     "#8c564b"};
    const double W = 960, H = 480, L = 80, R = 200, T = 40, B = 50;
    double pw = W - L - R, ph = H - T - B, ymax = 1;
    uint64_t cat[MN_CAT_COUNT], reserved, ncols, i, col;
    uint64_t (*colcat)[MN_CAT_COUNT] = NULL;
    uint64_t *colres = NULL, *coltot = NULL;
    char lab[48];
    mn__c_out o;
    int k, seen;
    if (!s || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    ncols = s->trace_count + 1 < MN__C_SVG_COLS ? s->trace_count + 1 : MN__C_SVG_COLS;
    colcat = (uint64_t(*)[MN_CAT_COUNT])mn__alloc_array(&s->allocator, (size_t)ncols, sizeof *colcat);
    colres = (uint64_t *)mn__alloc_array(&s->allocator, (size_t)ncols, sizeof *colres);
    coltot = (uint64_t *)mn__alloc_array(&s->allocator, (size_t)ncols, sizeof *coltot);
    if (!colcat || !colres || !coltot) {
        o.r = MN_ERR_OUT_OF_MEMORY;
        goto done;
    }
    memset(coltot, 0, (size_t)ncols * sizeof *coltot);
    memset(colres, 0, (size_t)ncols * sizeof *colres);
    memset(colcat, 0, (size_t)ncols * sizeof *colcat);
    memcpy(cat, s->base_cat_allocated, sizeof cat);
    reserved = s->base_reserved;
    for (i = 0; i <= s->trace_count; i++) {  // point i = state after i entries
        uint64_t tot = 0;
        if (i) mn__c_trace_apply(cat, &reserved, &s->trace[i - 1]);
        for (k = 0; k < MN_CAT_COUNT; k++) tot += cat[k];
        col = i * ncols / (s->trace_count + 1);
        if (tot >= coltot[col] || i == 0) {
            coltot[col] = tot;
            memcpy(colcat[col], cat, sizeof cat);
        }
        if (reserved > colres[col]) colres[col] = reserved;
        if ((double)reserved > ymax) ymax = (double)reserved;
        if ((double)tot > ymax) ymax = (double)tot;
    }
    mn__c_printf(&o, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                 "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n"
                 "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H, W, H);
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"24\" font-size=\"16\">", L);
    {
        const char *t = title ? title : "memory timeline";
        char esc[256];
        size_t n = 0;
        for (; *t && n < sizeof esc - 8; t++) {
            if (*t == '<') memcpy(esc + n, "&lt;", 4), n += 4;
            else if (*t == '>') memcpy(esc + n, "&gt;", 4), n += 4;
            else if (*t == '&') memcpy(esc + n, "&amp;", 5), n += 5;
            else esc[n++] = *t;
        }
        esc[n] = 0;
        mn__c_printf(&o, "%s</text>\n", esc);
    }
    for (k = 0; k <= 4; k++) {  // y axis grid and labels
        double y = T + ph - ph * k / 4.0;
        mn__c_svg_bytes(lab, sizeof lab, ymax * k / 4.0);
        mn__c_printf(&o, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                     "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                     L, y, L + pw, y, L - 6, y + 4, lab);
    }
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">allocator events "
                 "(%llu)</text>\n", L + pw / 2, H - 15, (unsigned long long)s->trace_count);
    // stacked areas, category 0 at the bottom
    for (k = 0, seen = 0; k < MN_CAT_COUNT; k++) {
        uint64_t c2;
        int any = 0;
        for (c2 = 0; c2 < ncols; c2++) any |= colcat[c2][k] != 0;
        if (!any) continue;
        mn__c_printf(&o, "<polygon fill=\"%s\" fill-opacity=\"0.85\" points=\"", colors[k]);
        for (c2 = 0; c2 < ncols; c2++) {  // upper edge left to right
            double top = 0;
            int j;
            for (j = 0; j <= k; j++) top += (double)colcat[c2][j];
            mn__c_printf(&o, "%.1f,%.1f ", L + pw * (double)c2 / (double)(ncols > 1 ? ncols - 1 : 1),
                         T + ph - ph * top / ymax);
        }
        for (c2 = ncols; c2-- > 0;) {  // lower edge right to left
            double bot = 0;
            int j;
            for (j = 0; j < k; j++) bot += (double)colcat[c2][j];
            mn__c_printf(&o, "%.1f,%.1f ", L + pw * (double)c2 / (double)(ncols > 1 ? ncols - 1 : 1),
                         T + ph - ph * bot / ymax);
        }
        mn__c_printf(&o, "\"/>\n");
        mn__c_printf(&o, "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                     "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n", L + pw + 16, T + 18.0 * seen,
                     colors[k], L + pw + 34, T + 18.0 * seen + 10, mn_category_name((mn_category)k));
        seen++;
    }
    mn__c_printf(&o, "<polyline fill=\"none\" stroke=\"black\" stroke-width=\"1.5\" points=\"");
    for (col = 0; col < ncols; col++)
        mn__c_printf(&o, "%.1f,%.1f ", L + pw * (double)col / (double)(ncols > 1 ? ncols - 1 : 1),
                     T + ph - ph * (double)colres[col] / ymax);
    mn__c_printf(&o, "\"/>\n<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\" "
                 "stroke-width=\"1.5\"/><text x=\"%.0f\" y=\"%.0f\">reserved</text>\n",
                 L + pw + 16, T + 18.0 * seen + 6, L + pw + 28, T + 18.0 * seen + 6, L + pw + 34,
                 T + 18.0 * seen + 10);
    mn__c_svg_bytes(lab, sizeof lab, (double)s->stats.allocated_bytes[MN_STAT_ALL].peak);
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"%.0f\">peak allocated %s</text>\n", L + pw + 16,
                 T + 18.0 * (seen + 2), lab);
    mn__c_svg_bytes(lab, sizeof lab, (double)s->stats.reserved_bytes[MN_STAT_ALL].peak);
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"%.0f\">peak reserved %s</text>\n", L + pw + 16,
                 T + 18.0 * (seen + 3), lab);
    mn__c_printf(&o, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
                 "stroke=\"black\"/>\n</svg>\n", L, T, pw, ph);
done:
    mn__free(&s->allocator, colcat);
    mn__free(&s->allocator, colres);
    mn__free(&s->allocator, coltot);
    return o.r;
}
