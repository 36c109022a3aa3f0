// cache_ref.h: the caching allocator's decisions as memanat.h made them with one treap per pool
// (before the size-class bins), kept as the reference of test/test_cachediff.c. The code is the
// >>cache/alloc part of memanat.h at that version, with its names prefixed mr (mr_cache_alloc,
// mr__c_block, ...), so that both allocators live in one program; only the trees differ from
// the current header, every rule (rounding, best fit, splits, merges, the out-of-memory ladder,
// statistics, history) is the same code. Include it in one file after harness.h.
#ifndef MR_CACHE_REF_H
#define MR_CACHE_REF_H
#include <assert.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define MN__PRIVATE static __attribute__((unused))
#define MNIMPL static __attribute__((unused))
#define MN_ASSERT(c) assert(c)

typedef struct mr_cache {
    struct mr__c_cache *p;
} mr_cache;

MN__PRIVATE void *mr__alloc(const mn_allocator *a, size_t size) {
    if (a && a->alloc_fn) return a->alloc_fn(a->user_data, size);
    return mnt_malloc(size);  // counted like the header's own (test/main.c)
}

MN__PRIVATE void mr__free(const mn_allocator *a, void *p) {
    if (!p) return;
    if (a && a->free_fn) a->free_fn(a->user_data, p);
    else mnt_free(p);
}

MN__PRIVATE void *mr__alloc_array(const mn_allocator *a, size_t n, size_t size) {
    if (size != 0 && n > SIZE_MAX / size) return NULL;
    return mr__alloc(a, (n * size) != 0 ? n * size : 1);
}

MN__PRIVATE void mr__log(const mn_logger *lg, mn_log_level level, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    if (!lg || !lg->log_fn) return;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    lg->log_fn(lg->user_data, level, buf);
}

// PyTorch CUDACachingAllocator.cpp constants.
#define MR__C_MIN_BLOCK 512ull              // kMinBlockSize
#define MR__C_SMALL_SIZE 1048576ull         // kSmallSize
#define MR__C_SMALL_BUFFER 2097152ull       // kSmallBuffer
#define MR__C_LARGE_BUFFER 20971520ull      // kLargeBuffer
#define MR__C_MIN_LARGE_ALLOC 10485760ull   // kMinLargeAlloc
#define MR__C_ROUND_LARGE 2097152ull        // kRoundLarge
#define MR__C_ONE_EXA 1152921504606846976ull  // one_exa_bytes
#define MR__C_MIB 1048576ull

MN__PRIVATE int mr__c_is_pow2(uint64_t v) { return v && !(v & (v - 1)); }

MN__PRIVATE uint32_t mr__c_log2_floor(uint64_t v) {  // v > 0
#if defined(__GNUC__) || defined(__clang__)
    return 63u - (uint32_t)__builtin_clzll(v);
#else
    uint32_t r = 0;
    while (v >>= 1) r++;
    return r;
#endif
}


typedef struct mr__c_policy {
    uint64_t max_split;         // UINT64_MAX = unlimited
    uint64_t max_non_split;     // 20 MiB
    uint64_t large_segment;     // 20 MiB
    uint32_t div[MN_CACHE_ROUNDUP_INTERVALS];
} mr__c_policy;

MN__PRIVATE void mr__c_policy_resolve(const mn_cache_config *cfg, mr__c_policy *p) {
    memset(p, 0, sizeof *p);
    p->max_split = UINT64_MAX;
    p->max_non_split = MR__C_LARGE_BUFFER;
    p->large_segment = MR__C_LARGE_BUFFER;
    if (!cfg) return;
    if (cfg->max_split_size) p->max_split = cfg->max_split_size;
    if (cfg->max_non_split_rounding) p->max_non_split = cfg->max_non_split_rounding;
    if (cfg->large_segment_size) p->large_segment = cfg->large_segment_size;
    memcpy(p->div, cfg->roundup_power2_divisions, sizeof p->div);
}

// PyTorch round_size / roundup_power2_next_division / AllocatorConfig::roundup_power2_divisions.
MN__PRIVATE uint64_t mr__c_round_size(const mr__c_policy *p, uint64_t size) {
    uint32_t log_size, index, divisions;
    if (size < MR__C_MIN_BLOCK) return MR__C_MIN_BLOCK;
    log_size = mr__c_log2_floor(size);
    index = log_size > 20 ? log_size - 20 : 0;  // intervals start at 1 MiB = 2^20
    if (index > MN_CACHE_ROUNDUP_INTERVALS - 1) index = MN_CACHE_ROUNDUP_INTERVALS - 1;
    divisions = p->div[index];
    if (divisions > 1 && size > MR__C_MIN_BLOCK * divisions) {
        uint64_t floor2, step, f;
        if (mr__c_is_pow2(size)) return size;
        floor2 = 1ull << log_size;
        step = floor2 >> mr__c_log2_floor(divisions);
        if (step == 0) return floor2 << 1;
        f = size & ~(step - 1);
        return f == size ? size : f + step;
    }
    return (size + MR__C_MIN_BLOCK - 1) / MR__C_MIN_BLOCK * MR__C_MIN_BLOCK;
}

// PyTorch get_allocation_size.
MN__PRIVATE uint64_t mr__c_allocation_size(const mr__c_policy *p, uint64_t size) {
    if (size <= MR__C_SMALL_SIZE) return MR__C_SMALL_BUFFER;
    if (size < MR__C_MIN_LARGE_ALLOC) return p->large_segment;
    return (size + MR__C_ROUND_LARGE - 1) / MR__C_ROUND_LARGE * MR__C_ROUND_LARGE;
}



// ---- >>cache/alloc: blocks, segments, trees -----------------------------------------------------

typedef struct mr__c_segment mr__c_segment;

typedef struct mr__c_use {   // a stream the block was used on; later the event recorded there
    mn_stream stream;
    mn_event event;
    struct mr__c_block *block;
    struct mr__c_use *next;   // in the block's list, then in the pending-event queue
} mr__c_use;

typedef struct mr__c_block {
    // the fields a tree search touches come first (one cache line)
    struct mr__c_block *l, *r, *up;  // treap children and parent (pool tree)
    uint64_t addr, size;
    mn_stream stream;
    uint32_t prio;                  // treap priority (max-heap)
    struct mr__c_block *prev, *next;  // neighbours inside the segment, in address order
    struct mr__c_block *tmp;        // scratch list, and the spare list
    mr__c_segment *seg;
    mr__c_use *uses;                // streams recorded while allocated
    uint64_t requested;
    uint64_t gc_base;               // pool's get_free_block count when cached (GC age)
    uint32_t event_count;           // events to wait for before the block is free
    uint8_t allocated, mapped, small, cat;
    uint8_t in_tree;
    char label[MN_CACHE_LABEL_MAX];
} mr__c_block;

struct mr__c_segment {
    uint64_t addr, size;            // device range (expandable: the reserved range)
    mr__c_block *head;                // lowest block
    mr__c_segment *prev_seg, *next_seg;
    mn_stream stream;
    uint8_t small, expandable;
};

typedef struct mr__c_pool {
    mr__c_block *blocks;     // free mapped blocks, treap by (stream, size, addr)
    mr__c_block *last;       // the block inserted last: often the next best fit
    mr__c_block *gap_l, *gap_r;  // neighbours of the block erased last: often where it returns
    mr__c_block *unmapped;   // unmapped tails of expandable segments, by (stream, addr)
    uint64_t get_free_calls;
    uint64_t whole;          // blocks in `blocks` that are a whole fixed segment (releasable)
    int small;
} mr__c_pool;

typedef struct mr__c_cache {
    mn_device dev;
    mn_cache_config cfg;
    mr__c_policy pol;
    mn_allocator alloc;
    mn_logger logger;
    int device_index;
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_t mu;
#endif
    mr__c_pool small, large;
    mr__c_block **map;              // allocated and pending blocks by address, linear probing
    uint64_t map_cap, map_count;
    mr__c_segment *segs;            // every segment
    mr__c_segment *spare_seg;       // taken before a device allocation, so none is lost
    mr__c_block *spare;             // recycled block structs
    uint32_t spare_count;
    mr__c_use *spare_uses;
    mr__c_use *ev_head, *ev_tail;   // pending cross-stream frees, in record order
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
} mr__c_cache;

MN__PRIVATE void mr__c_lock(mr__c_cache *c) {
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_lock(&c->mu);
#else
    (void)c;
#endif
}

MN__PRIVATE void mr__c_unlock(mr__c_cache *c) {
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_unlock(&c->mu);
#else
    (void)c;
#endif
}

// Tree order, BlockComparatorSize: stream, then size, then address. The unmapped tree uses
// size 0 for every block, which makes it BlockComparatorAddress.
MN__PRIVATE uint64_t mr__c_tree_size(const mr__c_block *b, int by_addr) {
    return by_addr ? 0 : b->size;
}

// Lifts x above its parent, keeping the in-order sequence.
MN__PRIVATE void mr__c_tr_rotate_up(mr__c_block **root, mr__c_block *x) {
    mr__c_block *p = x->up, *g = p->up;
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

MN__PRIVATE int mr__c_node_lt(const mr__c_block *a, const mr__c_block *b, int by_addr) {
    uint64_t as = mr__c_tree_size(a, by_addr), bs = mr__c_tree_size(b, by_addr);
    if (a->stream != b->stream) return a->stream < b->stream;
    if (as != bs) return as < bs;
    return a->addr < b->addr;
}

// Treap insert: a leaf in key order, then rotations up while its priority beats the parent's
// (expected O(log n) search, O(1) rotations).
MN__PRIVATE void mr__c_tr_insert(mr__c_block **root, mr__c_block *n, int by_addr) {
    mr__c_block *t = *root;
    n->l = n->r = NULL;
    if (!t) {
        n->up = NULL;
        *root = n;
        return;
    }
    for (;;) {
        mr__c_block **child = mr__c_node_lt(n, t, by_addr) ? &t->l : &t->r;
        if (!*child) {
            *child = n;
            break;
        }
        t = *child;
    }
    n->up = t;
    while (n->up && n->up->prio < n->prio) mr__c_tr_rotate_up(root, n);
}

// Treap erase without a search: rotate the node down to a leaf, then cut it off.
MN__PRIVATE void mr__c_tr_erase(mr__c_block **root, mr__c_block *n) {
    while (n->l || n->r) {
        mr__c_block *c = !n->l ? n->r : !n->r ? n->l : n->l->prio > n->r->prio ? n->l : n->r;
        mr__c_tr_rotate_up(root, c);
    }
    if (!n->up) *root = NULL;
    else if (n->up->l == n) n->up->l = NULL;
    else n->up->r = NULL;
    n->up = NULL;
}

// Smallest node not less than the key (std::set::lower_bound).
MN__PRIVATE mr__c_block *mr__c_tr_lower_bound(mr__c_block *t, mn_stream s, uint64_t size,
                                              uint64_t addr, int by_addr) {
    mr__c_block *best = NULL;
    while (t) {
        int lt = t->stream != s ? t->stream < s
               : mr__c_tree_size(t, by_addr) != size ? mr__c_tree_size(t, by_addr) < size
               : t->addr < addr;
        if (!lt) best = t, t = t->l;
        else t = t->r;
    }
    return best;
}

// Largest node less than the key.
MN__PRIVATE mr__c_block *mr__c_tr_before(mr__c_block *t, mn_stream s, uint64_t size, uint64_t addr,
                                     int by_addr) {
    mr__c_block *best = NULL;
    while (t) {
        int lt = t->stream != s ? t->stream < s
               : mr__c_tree_size(t, by_addr) != size ? mr__c_tree_size(t, by_addr) < size
               : t->addr < addr;
        if (lt) best = t, t = t->r;
        else t = t->l;
    }
    return best;
}

// In-order predecessor.
MN__PRIVATE mr__c_block *mr__c_tr_prev(mr__c_block *b) {
    if (b->l) {
        b = b->l;
        while (b->r) b = b->r;
        return b;
    }
    while (b->up && b->up->l == b) b = b->up;
    return b->up;
}

// In-order successor.
MN__PRIVATE mr__c_block *mr__c_tr_next(mr__c_block *b) {
    if (b->r) {
        b = b->r;
        while (b->l) b = b->l;
        return b;
    }
    while (b->up && b->up->r == b) b = b->up;
    return b->up;
}

// Collects a tree's nodes in order into a list linked through tmp (first node returned).
MN__PRIVATE mr__c_block *mr__c_tr_collect(mr__c_block *t, mr__c_block *tail_list) {
    if (!t) return tail_list;
    tail_list = mr__c_tr_collect(t->r, tail_list);
    t->tmp = tail_list;
    return mr__c_tr_collect(t->l, t);
}

// A free block that is its whole fixed-size segment: release_cached_blocks can give it back.
// A block's neighbours only change while it is out of its pool, so the count stays exact.
MN__PRIVATE int mr__c_whole(const mr__c_block *b) {
    return b->mapped && !b->prev && !b->next && !b->seg->expandable;
}

MN__PRIVATE void mr__c_pool_insert(mr__c_pool *p, mr__c_block *b) {
    MN_ASSERT(!b->in_tree);
    b->l = b->r = NULL;
    b->in_tree = 1;
    p->whole += (uint64_t)mr__c_whole(b);
    if (b->mapped) {
        mr__c_block *gl = p->gap_l, *gr = p->gap_r;
        b->gc_base = p->get_free_calls;  // BlockPool::insert_into_blocks
        // where the last erased block was, when b still sorts there: a leaf without a search
        if ((gl || gr) && (!gl || (gl->in_tree && gl->mapped && mr__c_node_lt(gl, b, 0))) &&
            (!gr || (gr->in_tree && gr->mapped && mr__c_node_lt(b, gr, 0))) &&
            (gl ? mr__c_tr_next(gl) == gr : mr__c_tr_prev(gr) == NULL)) {
            b->l = b->r = NULL;
            if (gl && !gl->r) gl->r = b, b->up = gl;
            else gr->l = b, b->up = gr;
            while (b->up && b->up->prio < b->prio) mr__c_tr_rotate_up(&p->blocks, b);
        } else {
            mr__c_tr_insert(&p->blocks, b, 0);
        }
        p->last = b;
    } else {
        mr__c_tr_insert(&p->unmapped, b, 1);
    }
}

MN__PRIVATE void mr__c_pool_erase(mr__c_pool *p, mr__c_block *b) {
    MN_ASSERT(b->in_tree);
    p->whole -= (uint64_t)mr__c_whole(b);
    if (b->mapped) {
        p->gap_l = mr__c_tr_prev(b);
        p->gap_r = mr__c_tr_next(b);
    }
    mr__c_tr_erase(b->mapped ? &p->blocks : &p->unmapped, b);
    b->in_tree = 0;
    b->l = b->r = NULL;
}

MN__PRIVATE mr__c_pool *mr__c_pool_of(mr__c_cache *c, const mr__c_block *b) {
    return b->small ? &c->small : &c->large;
}

// ---- address map --------------------------------------------------------------------------------

// Fibonacci hashing: the top bits of the product (cap is a power of two, at least 2).
MN__PRIVATE uint64_t mr__c_hash(uint64_t addr, uint64_t cap) {
    return ((addr >> 9) * 0x9E3779B97F4A7C15ull) >> (64 - mr__c_log2_floor(cap));
}

// Makes room for one more entry (the only host allocation on the alloc path, done first).
MN__PRIVATE mn_result mr__c_map_reserve(mr__c_cache *c) {
    uint64_t i, cap;
    mr__c_block **nm;
    if ((c->map_count + 1) * 2 <= c->map_cap) return MN_OK;
    cap = c->map_cap ? c->map_cap * 2 : 1024;
    nm = (mr__c_block **)mr__alloc_array(&c->alloc, (size_t)cap, sizeof *nm);
    if (!nm) return MN_ERR_OUT_OF_MEMORY;
    memset(nm, 0, (size_t)cap * sizeof *nm);
    for (i = 0; i < c->map_cap; i++) {
        mr__c_block *b = c->map[i];
        uint64_t h;
        if (!b) continue;
        h = mr__c_hash(b->addr, cap);
        while (nm[h]) h = (h + 1) & (cap - 1);
        nm[h] = b;
    }
    mr__free(&c->alloc, c->map);
    c->map = nm;
    c->map_cap = cap;
    return MN_OK;
}

MN__PRIVATE void mr__c_map_put(mr__c_cache *c, mr__c_block *b) {
    uint64_t h = mr__c_hash(b->addr, c->map_cap);
    while (c->map[h]) h = (h + 1) & (c->map_cap - 1);
    c->map[h] = b;
    c->map_count++;
}

MN__PRIVATE uint64_t mr__c_map_slot(const mr__c_cache *c, uint64_t addr) {
    uint64_t h;
    if (!c->map_cap) return UINT64_MAX;
    h = mr__c_hash(addr, c->map_cap);
    while (c->map[h]) {
        if (c->map[h]->addr == addr) return h;
        h = (h + 1) & (c->map_cap - 1);
    }
    return UINT64_MAX;
}

// Removes slot i, shifting later entries of the probe run back (no tombstones).
MN__PRIVATE void mr__c_map_del(mr__c_cache *c, uint64_t i) {
    uint64_t mask = c->map_cap - 1, j = i;
    c->map[i] = NULL;
    c->map_count--;
    for (;;) {
        uint64_t k;
        j = (j + 1) & mask;
        if (!c->map[j]) return;
        k = mr__c_hash(c->map[j]->addr, c->map_cap);
        // move j back to i if its home k is not cyclically in (i, j]
        if ((i <= j) ? (i < k && k <= j) : (i < k || k <= j)) continue;
        c->map[i] = c->map[j];
        c->map[j] = NULL;
        i = j;
    }
}

// ---- block structs ------------------------------------------------------------------------------

#define MR__C_SPARE_BLOCKS 4

MN__PRIVATE mn_result mr__c_spare_reserve(mr__c_cache *c, uint32_t n) {
    while (c->spare_count < n) {
        mr__c_block *b = (mr__c_block *)mr__alloc(&c->alloc, sizeof *b);
        if (!b) return MN_ERR_OUT_OF_MEMORY;
        b->tmp = c->spare;
        c->spare = b;
        c->spare_count++;
    }
    return MN_OK;
}

// A zeroed block struct from the spares (or the host), NULL when the host is out of memory.
MN__PRIVATE mr__c_block *mr__c_block_new(mr__c_cache *c) {
    mr__c_block *b;
    if (!c->spare && mr__c_spare_reserve(c, 1) != MN_OK) return NULL;
    b = c->spare;
    c->spare = b->tmp;
    c->spare_count--;
    memset(b, 0, sizeof *b);
    c->rng ^= c->rng << 13, c->rng ^= c->rng >> 17, c->rng ^= c->rng << 5;
    b->prio = c->rng;
    b->mapped = 1;
    return b;
}

MN__PRIVATE void mr__c_block_delete(mr__c_cache *c, mr__c_block *b) {
    int k;
    for (k = 0; k < 2; k++) {
        mr__c_pool *p = k ? &c->large : &c->small;
        if (p->last == b) p->last = NULL;
        if (p->gap_l == b) p->gap_l = NULL, p->gap_r = NULL;
        if (p->gap_r == b) p->gap_l = NULL, p->gap_r = NULL;
    }
    if (c->spare_count >= 64) {
        mr__free(&c->alloc, b);
        return;
    }
    b->tmp = c->spare;
    c->spare = b;
    c->spare_count++;
}

MN__PRIVATE void mr__c_fix_head(mr__c_block *b) {
    if (!b->prev) b->seg->head = b;
}

// ---- statistics ---------------------------------------------------------------------------------

MN__PRIVATE void mr__c_stat_inc(mn_stat *s, uint64_t n) {
    s->current += n;
    if (s->current > s->peak) s->peak = s->current;
    s->allocated += n;
}

MN__PRIVATE void mr__c_stat_dec(mn_stat *s, uint64_t n) {
    MN_ASSERT(s->current >= n);
    s->current -= n;
    s->freed += n;
}

// Applies to the aggregate and to the block's pool (get_stat_types_for_pool).
#define MR__C_STAT2(c, field, small, op, n) do { \
    op(&(c)->st.field[MN_STAT_ALL], (n)); \
    op(&(c)->st.field[(small) ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL], (n)); } while (0)

// ---- history ------------------------------------------------------------------------------------

MN__PRIVATE void mr__c_trace_apply(uint64_t *cat, uint64_t *reserved, const mn_trace_entry *e) {
    switch (e->action) {
    case MN_TRACE_ALLOC: cat[e->category] += e->block_size; break;
    case MN_TRACE_FREE_REQUESTED: cat[e->category] -= e->block_size; break;
    case MN_TRACE_SEGMENT_ALLOC: case MN_TRACE_SEGMENT_MAP: *reserved += e->size; break;
    case MN_TRACE_SEGMENT_FREE: case MN_TRACE_SEGMENT_UNMAP: *reserved -= e->size; break;
    default: break;
    }
}

MN__PRIVATE void mr__c_trace(mr__c_cache *c, mn_trace_action a, uint64_t addr, uint64_t size,
                           uint64_t block_size, mn_stream stream, uint8_t cat) {
    mn_trace_entry *e;
    if (!c->ring_cap) return;
    e = &c->ring[c->ring_head];
    if (c->ring_count == c->ring_cap) {  // the oldest entry folds into the base state
        mr__c_trace_apply(c->base_cat, &c->base_reserved, e);
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

// ---- init / free --------------------------------------------------------------------------------

MNIMPL mn_result mr_cache_init(mr_cache *cache, const mn_cache_desc *desc) {
    mr__c_cache *c;
    mn_cache_config cfg;
    mn_result r;
    if (!cache) return MN_ERR_INVALID_ARG;
    cache->p = NULL;
    if (!desc) return MN_ERR_INVALID_ARG;
    if (!desc->device.alloc_fn || !desc->device.free_fn) {
        mr__log(&desc->logger, MN_LOG_ERROR, "cache: the device needs alloc_fn and free_fn");
        return MN_ERR_INVALID_ARG;
    }
    if (desc->settings) cfg = *desc->settings;
    else if ((r = mn_cache_config_parse(desc->config, &cfg, &desc->logger)) != MN_OK) return r;
    if (cfg.garbage_collection_threshold < 0.0 || cfg.garbage_collection_threshold >= 1.0 ||
        (cfg.max_split_size && cfg.max_split_size <= MR__C_LARGE_BUFFER) ||
        (cfg.max_non_split_rounding && cfg.max_non_split_rounding <= MR__C_LARGE_BUFFER)) {
        mr__log(&desc->logger, MN_LOG_ERROR, "cache: settings out of range");
        return MN_ERR_CONFIG;
    }
    if (cfg.expandable_segments && (!desc->device.reserve_fn || !desc->device.map_fn ||
                                    !desc->device.unmap_fn)) {
        mr__log(&desc->logger, MN_LOG_ERROR, "cache: expandable_segments:True needs a device "
                "with reserve_fn, map_fn and unmap_fn");
        return MN_ERR_UNSUPPORTED;
    }
    c = (mr__c_cache *)mr__alloc(&desc->allocator, sizeof *c);
    if (!c) return MN_ERR_OUT_OF_MEMORY;
    memset(c, 0, sizeof *c);
    c->dev = desc->device;
    c->cfg = cfg;
    mr__c_policy_resolve(&cfg, &c->pol);
    c->alloc = desc->allocator;
    c->logger = desc->logger;
    c->device_index = desc->device_index;
    c->small.small = 1;
    c->rng = 0x9E3779B9u;
    c->st.max_split_size = c->pol.max_split;
    if (desc->trace_entries) {
        c->ring = (mn_trace_entry *)mr__alloc_array(&c->alloc, desc->trace_entries,
                                                    sizeof *c->ring);
        if (!c->ring) goto fail_ring;
        c->ring_cap = desc->trace_entries;
    }
    if (mr__c_map_reserve(c) != MN_OK) goto fail_map;
#ifndef MEMANAT_NO_THREADS
    if (pthread_mutex_init(&c->mu, NULL) != 0) goto fail_mutex;
#endif
    cache->p = c;
    return MN_OK;
#ifndef MEMANAT_NO_THREADS
fail_mutex:
    mr__free(&c->alloc, c->map);
#endif
fail_map:
    mr__free(&c->alloc, c->ring);
fail_ring:
    mr__free(&desc->allocator, c);
    return MN_ERR_OUT_OF_MEMORY;
}

// ---- freeing blocks -----------------------------------------------------------------------------

// Device pointer <-> address (mn_device.addr_shift).
MN__PRIVATE void *mr__c_ptr(const mr__c_cache *c, uint64_t addr) {
    return (void *)(uintptr_t)(addr >> c->dev.addr_shift);
}
MN__PRIVATE uint64_t mr__c_addr(const mr__c_cache *c, const void *ptr) {
    return (uint64_t)(uintptr_t)ptr << c->dev.addr_shift;
}

// try_merge_blocks: src joins dst when it is free, has no pending events or stream uses, and is
// mapped the same way. Returns the bytes taken over (0 = no merge).
MN__PRIVATE uint64_t mr__c_try_merge(mr__c_cache *c, mr__c_block *dst, mr__c_block *src) {
    uint64_t sub;
    if (!src || src->allocated || src->event_count > 0 || src->uses || dst->mapped != src->mapped)
        return 0;
    mr__c_pool_erase(mr__c_pool_of(c, src), src);
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
    mr__c_block_delete(c, src);
    return sub;
}

// free_block: the block becomes reusable; it merges with free neighbours and returns to its pool.
MN__PRIVATE void mr__c_free_block(mr__c_cache *c, mr__c_block *b) {
    mr__c_pool *p = mr__c_pool_of(c, b);
    uint64_t orig = b->size, req = b->requested, sub;
    int64_t net_blocks = 0, net_bytes = 0;
    int small = b->small;
    mr__c_trace(c, MN_TRACE_FREE_COMPLETED, b->addr, req, orig, b->stream, b->cat);
    sub = mr__c_try_merge(c, b, b->prev);
    if (sub) net_blocks--, net_bytes -= (int64_t)sub;
    sub = mr__c_try_merge(c, b, b->next);
    if (sub) net_blocks--, net_bytes -= (int64_t)sub;
    b->requested = 0;
    mr__c_pool_insert(p, b);
    if (b->prev || b->next) net_blocks++, net_bytes += (int64_t)b->size;
    // inactive_split leaves out expandable segments (PyTorch free_block)
    if (!b->seg->expandable) {
        uint64_t nb = (uint64_t)(net_blocks < 0 ? -net_blocks : net_blocks);
        uint64_t ns = (uint64_t)(net_bytes < 0 ? -net_bytes : net_bytes);
        if (net_blocks > 0) MR__C_STAT2(c, inactive_split, small, mr__c_stat_inc, nb);
        if (net_blocks < 0) MR__C_STAT2(c, inactive_split, small, mr__c_stat_dec, nb);
        if (net_bytes > 0) MR__C_STAT2(c, inactive_split_bytes, small, mr__c_stat_inc, ns);
        if (net_bytes < 0) MR__C_STAT2(c, inactive_split_bytes, small, mr__c_stat_dec, ns);
    }
    MR__C_STAT2(c, active, small, mr__c_stat_dec, 1);
    MR__C_STAT2(c, active_bytes, small, mr__c_stat_dec, orig);
    MR__C_STAT2(c, requested_bytes, small, mr__c_stat_dec, req);
}

MN__PRIVATE void mr__c_seg_unlink(mr__c_cache *c, mr__c_segment *s) {
    if (s->prev_seg) s->prev_seg->next_seg = s->next_seg;
    else c->segs = s->next_seg;
    if (s->next_seg) s->next_seg->prev_seg = s->prev_seg;
    mr__free(&c->alloc, s);
}

MN__PRIVATE void mr__c_seg_link(mr__c_cache *c, mr__c_segment *s) {
    s->prev_seg = NULL;
    s->next_seg = c->segs;
    if (c->segs) c->segs->prev_seg = s;
    c->segs = s;
}

MN__PRIVATE void mr__c_note_dev_error(mr__c_cache *c, mn_result r, const char *what) {
    if (r == MN_OK) return;
    if (c->dev_error == MN_OK) c->dev_error = r;
    mr__log(&c->logger, MN_LOG_ERROR, "cache: device %s failed: %s", what, mn_result_str(r));
}

// release_block: an unsplit free segment goes back to the device.
MN__PRIVATE void mr__c_release_block(mr__c_cache *c, mr__c_block *b) {
    mr__c_segment *s = b->seg;
    int small = b->small;
    MN_ASSERT(!s->expandable && !b->prev && !b->next && !b->allocated);
    c->st.num_device_free++;
    mr__c_trace(c, MN_TRACE_SEGMENT_FREE, b->addr, b->size, b->size, b->stream, 0);
    mr__c_note_dev_error(c, c->dev.free_fn(c->dev.user_data, mr__c_ptr(c, b->addr), b->size),
                         "free");
    c->total_allocated_memory -= b->size;
    MR__C_STAT2(c, segment, small, mr__c_stat_dec, 1);
    MR__C_STAT2(c, reserved_bytes, small, mr__c_stat_dec, b->size);
    if (b->size >= c->pol.max_split) mr__c_stat_dec(&c->st.oversize_segments, 1);
    mr__c_pool_erase(mr__c_pool_of(c, b), b);
    mr__c_seg_unlink(c, s);
    mr__c_block_delete(c, b);
}

MN__PRIVATE uint64_t mr__c_page_size(const mr__c_cache *c, int small) {
    return small ? MR__C_SMALL_BUFFER : c->pol.large_segment;  // ExpandableSegment segment_size
}

// unmap_block: the whole pages inside a free block of an expandable segment are unmapped; the
// page-unaligned ends stay mapped as free blocks. A segment left fully unmapped is released.
MN__PRIVATE void mr__c_unmap_block(mr__c_cache *c, mr__c_block *b) {
    mr__c_segment *s = b->seg;
    mr__c_pool *p = mr__c_pool_of(c, b);
    uint64_t page = mr__c_page_size(c, b->small), off = b->addr - s->addr;
    uint64_t beg = (off + page - 1) / page * page, end = (off + b->size) / page * page;
    mr__c_block *bf = NULL, *af = NULL;
    if (beg >= end) return;
    if (s->addr + beg > b->addr && !(bf = mr__c_block_new(c))) return;
    if (s->addr + end < b->addr + b->size && !(af = mr__c_block_new(c))) {
        if (bf) mr__c_block_delete(c, bf);
        return;
    }
    mr__c_note_dev_error(
        c, c->dev.unmap_fn(c->dev.user_data, mr__c_ptr(c, s->addr + beg), end - beg), "unmap");
    mr__c_pool_erase(p, b);
    if (bf) {  // prev? -> bf -> b
        bf->addr = b->addr, bf->size = s->addr + beg - b->addr;
        bf->stream = b->stream, bf->small = b->small, bf->seg = s;
        bf->prev = b->prev, bf->next = b;
        if (bf->prev) bf->prev->next = bf;
        b->prev = bf;
        mr__c_fix_head(bf);
        mr__c_pool_insert(p, bf);
    }
    if (af) {  // b -> af -> next?
        af->addr = s->addr + end, af->size = b->addr + b->size - (s->addr + end);
        af->stream = b->stream, af->small = b->small, af->seg = s;
        af->next = b->next, af->prev = b;
        if (af->next) af->next->prev = af;
        b->next = af;
        mr__c_pool_insert(p, af);
    }
    b->addr = s->addr + beg;
    b->size = end - beg;
    b->mapped = 0;
    c->total_allocated_memory -= b->size;
    MR__C_STAT2(c, reserved_bytes, b->small, mr__c_stat_dec, b->size);
    c->st.num_device_free++;
    mr__c_trace(c, MN_TRACE_SEGMENT_UNMAP, b->addr, b->size, b->size, b->stream, 0);
    mr__c_try_merge(c, b, b->prev);
    mr__c_try_merge(c, b, b->next);
    mr__c_pool_insert(p, b);
    if (!b->prev && !b->next) {  // release_expandable_segment
        if (c->dev.unreserve_fn)
            mr__c_note_dev_error(c,
                                 c->dev.unreserve_fn(c->dev.user_data, mr__c_ptr(c, s->addr),
                                                     s->size),
                                 "unreserve");
        mr__c_pool_erase(p, b);
        mr__c_seg_unlink(c, s);
        mr__c_block_delete(c, b);
    }
}

// release_blocks: every unsplit free segment of the pool goes back; free expandable pages unmap.
MN__PRIVATE void mr__c_release_blocks(mr__c_cache *c, mr__c_pool *p) {
    mr__c_block *b, *next, *unmap = NULL, **tail = &unmap;
    // Nothing to give back: skip the walk over every cached block (it made each out-of-memory
    // retry of a long trace cost the whole pool, quadratic over the trace).
    if (p->whole == 0 && !c->cfg.expandable_segments) return;
    for (b = mr__c_tr_collect(p->blocks, NULL); b; b = next) {
        next = b->tmp;
        if (b->seg->expandable) {
            *tail = b;
            tail = &b->tmp;
        } else if (!b->prev && !b->next) {
            mr__c_release_block(c, b);
        }
    }
    *tail = NULL;
    for (b = unmap; b; b = next) {
        next = b->tmp;
        mr__c_unmap_block(c, b);
    }
}

// ---- stream events ------------------------------------------------------------------------------

MN__PRIVATE void mr__c_use_recycle(mr__c_cache *c, mr__c_use *u) {
    u->next = c->spare_uses;
    c->spare_uses = u;
}

// An event has completed: the block waits for one event less.
MN__PRIVATE void mr__c_event_done(mr__c_cache *c, mr__c_use *u) {
    mr__c_block *b = u->block;
    if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, u->event);
    mr__c_use_recycle(c, u);
    if (--b->event_count == 0) mr__c_free_block(c, b);
}

// process_events: completed events release their blocks; per stream, in record order, stopping
// at the first event not yet done (events of one stream complete in order).
MN__PRIVATE void mr__c_process_events(mr__c_cache *c) {
    mn_stream blocked[32];
    uint32_t nb = 0, k;
    mr__c_use **pp = &c->ev_head, *u, *last = NULL;
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
        mr__c_event_done(c, u);
    }
    c->ev_tail = last;
}

// synchronize_and_free_events: waits for every outstanding event.
MN__PRIVATE void mr__c_sync_and_free_events(mr__c_cache *c) {
    mr__c_use *u = c->ev_head, *next;
    c->st.num_sync_all_streams++;
    c->ev_head = c->ev_tail = NULL;
    for (; u; u = next) {
        next = u->next;
        if (c->dev.event_sync_fn)
            mr__c_note_dev_error(c, c->dev.event_sync_fn(c->dev.user_data, u->event), "event sync");
        mr__c_event_done(c, u);
    }
}

// release_cached_blocks (also emptyCache).
MN__PRIVATE void mr__c_release_cached(mr__c_cache *c) {
    mr__c_sync_and_free_events(c);
    mr__c_release_blocks(c, &c->large);
    mr__c_release_blocks(c, &c->small);
}

// ---- allocation ---------------------------------------------------------------------------------

// lower_bound((s, size, 0)) of the free tree. The block inserted last is the answer when it is
// not less than the key and its predecessor is: an O(1) check that skips the search when a
// freed block is asked for again (the common case in a training loop).
MN__PRIVATE mr__c_block *mr__c_pool_lower_bound(mr__c_pool *p, mn_stream s, uint64_t size) {
    mr__c_block *m = p->last, *q;
    if (m && m->in_tree && m->mapped && m->stream == s && m->size >= size) {
        q = mr__c_tr_prev(m);
        if (!q || q->stream != s || q->size < size) return m;
    }
    return mr__c_tr_lower_bound(p->blocks, s, size, 0, 0);
}

// get_free_block: best fit on the same stream, with the oversize rules.
MN__PRIVATE mr__c_block *mr__c_get_free_block(mr__c_cache *c, mr__c_pool *p, mn_stream s,
                                              uint64_t size) {
    mr__c_block *b;
    if (c->set_fraction && c->cfg.garbage_collection_threshold > 0.0) p->get_free_calls++;
    b = mr__c_pool_lower_bound(p, s, size);
    if (!b || b->stream != s) return NULL;
    if (b->seg->expandable) {
        // rank by the size the block can grow to (its unmapped successor included)
        mr__c_block *n = mr__c_tr_next(b);
        for (;;) {
            uint64_t be = b->size + (b->next && !b->next->mapped ? b->next->size : 0), ne;
            if (!b->seg->expandable || !n || n->stream != s) break;
            ne = n->size + (n->next && !n->next->mapped ? n->next->size : 0);
            if (!(ne < be)) break;
            b = n;
            n = mr__c_tr_next(n);
        }
    }
    // do not return an oversized block for a small request, nor a much larger one for a big one
    if (size < c->pol.max_split && b->size >= c->pol.max_split) return NULL;
    if (size >= c->pol.max_split && b->size >= size + c->pol.max_non_split) return NULL;
    mr__c_pool_erase(p, b);
    return b;
}

MN__PRIVATE int mr__c_allocatable(const mr__c_block *b) {
    return b && !b->allocated && b->event_count == 0 && !b->uses;
}

// map_block: maps whole pages at the front of an unmapped block and merges with its neighbours.
MN__PRIVATE mn_result mr__c_map_block(mr__c_cache *c, mr__c_block *to_map, uint64_t size) {
    mr__c_pool *p = mr__c_pool_of(c, to_map);
    uint64_t page = mr__c_page_size(c, to_map->small), m = (size + page - 1) / page * page, at;
    mr__c_block *rem = NULL;
    mn_result r;
    MN_ASSERT(!to_map->mapped && size <= to_map->size);
    if (m > to_map->size) m = to_map->size;
    if (m < to_map->size && !(rem = mr__c_block_new(c))) return MN_ERR_OUT_OF_MEMORY;
    r = c->dev.map_fn(c->dev.user_data, mr__c_ptr(c, to_map->addr), m);
    if (r != MN_OK) {
        if (rem) mr__c_block_delete(c, rem);
        return r;
    }
    mr__c_pool_erase(p, to_map);
    to_map->mapped = 1;
    at = to_map->addr;
    if (rem) {  // to_map -> rem -> next?
        rem->addr = to_map->addr + m, rem->size = to_map->size - m, rem->mapped = 0;
        rem->stream = to_map->stream, rem->small = to_map->small, rem->seg = to_map->seg;
        rem->prev = to_map, rem->next = to_map->next;
        if (rem->next) rem->next->prev = rem;
        to_map->next = rem;
        to_map->size = m;
        mr__c_pool_insert(p, rem);
    }
    mr__c_try_merge(c, to_map, to_map->prev);
    mr__c_try_merge(c, to_map, to_map->next);
    mr__c_pool_insert(p, to_map);
    c->total_allocated_memory += m;
    MR__C_STAT2(c, reserved_bytes, to_map->small, mr__c_stat_inc, m);
    c->st.num_device_alloc++;
    mr__c_trace(c, MN_TRACE_SEGMENT_MAP, at, m, m, to_map->stream, 0);
    return MN_OK;
}

// find_expandable_block: free address space of this stream's segment (a free block right before
// an unmapped one counts), or a new segment reserving 9/8 of the device.
MN__PRIVATE mn_result mr__c_find_expandable(mr__c_cache *c, mr__c_pool *p, mn_stream s,
                                            uint64_t size, mr__c_block **out) {
    mr__c_block *it, *b;
    mr__c_segment *seg;
    uint64_t total = 0, fr = 0, va, page = mr__c_page_size(c, p->small);
    void *base = NULL;
    mn_result r;
    for (it = mr__c_tr_lower_bound(p->unmapped, s, 0, 0, 1); it && it->stream == s;
         it = mr__c_tr_next(it)) {
        mr__c_block *cand = mr__c_allocatable(it->prev) ? it->prev : it, *w = cand;
        uint64_t bytes = 0;
        while (bytes < size && mr__c_allocatable(w)) bytes += w->size, w = w->next;
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
    if (!(b = mr__c_block_new(c))) return MN_ERR_OUT_OF_MEMORY;
    r = c->dev.reserve_fn(c->dev.user_data, va, &base);
    if (r != MN_OK) {
        mr__c_block_delete(c, b);
        return r == MN_ERR_OUT_OF_MEMORY ? r : MN_ERR_DEVICE_OOM;
    }
    seg = c->spare_seg;
    c->spare_seg = NULL;
    memset(seg, 0, sizeof *seg);
    seg->addr = mr__c_addr(c, base), seg->size = va, seg->stream = s;
    seg->small = (uint8_t)p->small, seg->expandable = 1, seg->head = b;
    mr__c_seg_link(c, seg);
    b->addr = seg->addr, b->size = va, b->mapped = 0, b->stream = s, b->small = seg->small;
    b->seg = seg;
    mr__c_pool_insert(p, b);
    *out = b;
    return MN_OK;
}

// try_allocate_expandable_block
MN__PRIVATE mn_result mr__c_alloc_expandable(mr__c_cache *c, mr__c_pool *p, mn_stream s,
                                             uint64_t size, mr__c_block **out) {
    mr__c_block *cand = NULL;
    mn_result r = mr__c_find_expandable(c, p, s, size, &cand);
    if (r != MN_OK) return r;
    if (!cand->mapped) {
        r = mr__c_map_block(c, cand, cand->size < size ? cand->size : size);
        if (r != MN_OK) return r;
    }
    while (cand->size < size) {  // free -> unmapped -> ...: map more and merge
        mr__c_block *n = cand->next;
        uint64_t rem = size - cand->size;
        MN_ASSERT(n && !n->mapped);
        r = mr__c_map_block(c, n, rem < n->size ? rem : n->size);
        if (r != MN_OK) return r;
        cand = n;
    }
    mr__c_pool_erase(p, cand);
    *out = cand;
    return MN_OK;
}

// alloc_block: a new segment from the device (or mapped pages of an expandable segment).
MN__PRIVATE mn_result mr__c_alloc_block(mr__c_cache *c, mr__c_pool *p, mn_stream s, uint64_t size,
                                      uint64_t alloc_size, int is_retry, mr__c_block **out) {
    mr__c_segment *seg;
    mr__c_block *b;
    void *ptr = NULL;
    mn_result r;
    if (is_retry) c->st.num_alloc_retries++;
    if (c->set_fraction && (alloc_size > c->allowed_max ||
                            c->total_allocated_memory > c->allowed_max - alloc_size))
        return MN_ERR_DEVICE_OOM;
    if (c->cfg.expandable_segments) return mr__c_alloc_expandable(c, p, s, size, out);
    r = c->dev.alloc_fn(c->dev.user_data, alloc_size, &ptr);
    if (r != MN_OK) return r;
    c->total_allocated_memory += alloc_size;
    seg = c->spare_seg;
    c->spare_seg = NULL;
    memset(seg, 0, sizeof *seg);
    seg->addr = mr__c_addr(c, ptr), seg->size = alloc_size, seg->stream = s;
    seg->small = (uint8_t)p->small;
    mr__c_seg_link(c, seg);
    b = mr__c_block_new(c);  // reserved by the caller, cannot fail
    b->addr = seg->addr, b->size = alloc_size, b->stream = s, b->small = seg->small, b->seg = seg;
    seg->head = b;
    MR__C_STAT2(c, segment, p->small, mr__c_stat_inc, 1);
    MR__C_STAT2(c, reserved_bytes, p->small, mr__c_stat_inc, alloc_size);
    if (alloc_size >= c->pol.max_split) mr__c_stat_inc(&c->st.oversize_segments, 1);
    c->st.num_device_alloc++;
    mr__c_trace(c, MN_TRACE_SEGMENT_ALLOC, b->addr, alloc_size, alloc_size, s, 0);
    *out = b;
    return MN_OK;
}

// release_available_cached_blocks: with max_split_size set, frees the smallest oversize block of
// this stream that is large enough, or else oversize blocks from the largest down.
MN__PRIVATE int mr__c_release_available(mr__c_cache *c, mr__c_pool *p, mn_stream s, uint64_t size) {
    uint64_t key, released = 0;
    mr__c_block *b;
    if (c->pol.max_split == UINT64_MAX) return 0;
    key = size < c->pol.max_split ? c->pol.max_split : size;
    b = mr__c_tr_lower_bound(p->blocks, s, key, 0, 0);
    if (!b || b->stream != s || b->seg->expandable) {
        b = mr__c_tr_before(p->blocks, s, key, 0, 0);
        while (b && released < key && b->size >= c->pol.max_split && b->stream == s) {
            mr__c_block *cur = b;
            b = mr__c_tr_before(p->blocks, cur->stream, cur->size, cur->addr, 0);
            if (!cur->seg->expandable && !cur->prev && !cur->next) {
                released += cur->size;
                mr__c_release_block(c, cur);
            }
        }
        return released >= key;
    }
    if (b->prev || b->next) return 0;
    mr__c_release_block(c, b);
    return 1;
}

// garbage_collect_cached_blocks: above threshold * allowed memory, frees unsplit large-pool
// blocks whose age (get_free_block calls since they were cached) is at least the average.
MN__PRIVATE void mr__c_garbage_collect(mr__c_cache *c) {
    uint64_t thr = (uint64_t)(c->cfg.garbage_collection_threshold * (double)c->allowed_max);
    uint64_t target, reclaimed = 0, total_age = 0, count = 0;
    mr__c_block *b, *next;
    int freed = 1;
    if (c->total_allocated_memory <= thr) return;
    target = c->total_allocated_memory - thr;
    for (b = mr__c_tr_collect(c->large.blocks, NULL); b; b = b->tmp) {
        if (b->prev || b->next) continue;
        total_age += c->large.get_free_calls - b->gc_base;
        count++;
    }
    while (reclaimed < target && freed && count > 0) {
        double age_thr = (double)total_age / (double)count;
        freed = 0;
        for (b = mr__c_tr_collect(c->large.blocks, NULL); b; b = next) {
            uint64_t age = c->large.get_free_calls - b->gc_base;
            next = b->tmp;
            if (b->prev || b->next || b->seg->expandable || (double)age < age_thr) continue;
            freed = 1;
            reclaimed += b->size;
            total_age -= age;
            count--;
            mr__c_release_block(c, b);
        }
    }
}

// should_split
MN__PRIVATE int mr__c_should_split(const mr__c_cache *c, const mr__c_block *b, uint64_t size) {
    uint64_t remaining = b->size - size;
    if (b->small || c->cfg.expandable_segments) return remaining >= MR__C_MIN_BLOCK;
    return size < c->pol.max_split && remaining > MR__C_SMALL_SIZE;
}

// alloc_found_block: splits off the front when asked and hands the block out.
MN__PRIVATE mr__c_block *mr__c_alloc_found(mr__c_cache *c, mr__c_block *b, uint64_t size,
                                           uint64_t orig, int split, mn_category cat,
                                           const char *label) {
    mr__c_pool *p = mr__c_pool_of(c, b);
    int already_split = b->prev || b->next, exp = b->seg->expandable, small = b->small;
    if (split) {
        mr__c_block *rem = b;
        b = mr__c_block_new(c);  // reserved by the caller
        b->addr = rem->addr, b->size = size, b->stream = rem->stream, b->small = rem->small;
        b->seg = rem->seg;
        b->prev = rem->prev;
        if (b->prev) b->prev->next = b;
        b->next = rem;
        rem->prev = b;
        rem->addr += size;
        rem->size -= size;
        mr__c_fix_head(b);
        mr__c_pool_insert(p, rem);
        if (already_split && !exp) {
            MR__C_STAT2(c, inactive_split_bytes, small, mr__c_stat_dec, size);
        } else if (!exp) {
            MR__C_STAT2(c, inactive_split_bytes, small, mr__c_stat_inc, rem->size);
            MR__C_STAT2(c, inactive_split, small, mr__c_stat_inc, 1);
        }
    } else if (already_split && !exp) {
        MR__C_STAT2(c, inactive_split_bytes, small, mr__c_stat_dec, b->size);
        MR__C_STAT2(c, inactive_split, small, mr__c_stat_dec, 1);
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
    mr__c_trace(c, MN_TRACE_ALLOC, b->addr, orig, b->size, b->stream, b->cat);
    mr__c_map_put(c, b);
    MR__C_STAT2(c, allocation, small, mr__c_stat_inc, 1);
    MR__C_STAT2(c, allocated_bytes, small, mr__c_stat_inc, b->size);
    MR__C_STAT2(c, active, small, mr__c_stat_inc, 1);
    MR__C_STAT2(c, active_bytes, small, mr__c_stat_inc, b->size);
    MR__C_STAT2(c, requested_bytes, small, mr__c_stat_inc, orig);
    mr__c_stat_inc(&c->st.cat_allocation[cat], 1);
    mr__c_stat_inc(&c->st.cat_allocated_bytes[cat], b->size);
    mr__c_stat_inc(&c->st.cat_requested_bytes[cat], orig);
    if (c->st.allocated_bytes[MN_STAT_ALL].current == c->st.allocated_bytes[MN_STAT_ALL].peak) {
        int k;
        for (k = 0; k < MN_CAT_COUNT; k++)
            c->st.cat_at_peak[k] = c->st.cat_allocated_bytes[k].current;
    }
    if (b->size >= c->pol.max_split) mr__c_stat_inc(&c->st.oversize_allocations, 1);
    return b;
}


// The OOM message of CUDACachingAllocator.cpp malloc(), current wording (no NVML process list).
MN__PRIVATE void mr__c_oom_message(mr__c_cache *c, uint64_t alloc_size, uint64_t dev_free,
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

MNIMPL mn_result mr_cache_alloc(mr_cache *cache, uint64_t orig, mn_stream stream,
                                mn_category cat, const char *label, void **ptr_out) {
    mr__c_cache *c;
    mr__c_pool *p;
    mr__c_block *b;
    uint64_t size, alloc_size;
    mn_result r;
    if (!cache || !cache->p || !ptr_out || (unsigned)cat >= MN_CAT_COUNT) return MN_ERR_INVALID_ARG;
    c = cache->p;
    *ptr_out = NULL;
    if (orig == 0) return MN_OK;  // PyTorch hands out nullptr for empty tensors
    mr__c_lock(c);
    c->clock++;
    if (orig >= MR__C_ONE_EXA) {
        snprintf(c->oom_msg, sizeof c->oom_msg, "Tried to allocate more than 1EB memory.");
        mr__c_unlock(c);
        return MN_ERR_DEVICE_OOM;
    }
    // host memory first, so that nothing below fails half-way
    if ((r = mr__c_map_reserve(c)) != MN_OK) goto done;
    if ((r = mr__c_spare_reserve(c, MR__C_SPARE_BLOCKS)) != MN_OK) goto done;
    if (c->ev_head) mr__c_process_events(c);
    size = mr__c_round_size(&c->pol, orig);
    p = size <= MR__C_SMALL_SIZE ? &c->small : &c->large;
    alloc_size = mr__c_allocation_size(&c->pol, size);
    b = mr__c_get_free_block(c, p, stream, size);
    if (!b) {
        if (!c->spare_seg) {
            c->spare_seg = (mr__c_segment *)mr__alloc(&c->alloc, sizeof *c->spare_seg);
            if (!c->spare_seg) {
                r = MN_ERR_OUT_OF_MEMORY;
                goto done;
            }
        }
        if (c->set_fraction && c->cfg.garbage_collection_threshold > 0.0) mr__c_garbage_collect(c);
        r = mr__c_alloc_block(c, p, stream, size, alloc_size, 0, &b);
        if (r == MN_ERR_DEVICE_OOM && mr__c_release_available(c, p, stream, size))
            r = mr__c_alloc_block(c, p, stream, size, alloc_size, 0, &b);
        if (r == MN_ERR_DEVICE_OOM) {
            mr__c_release_cached(c);
            r = mr__c_alloc_block(c, p, stream, size, alloc_size, 1, &b);
        }
        if (r == MN_ERR_DEVICE_OOM) {
            uint64_t fr = 0, total = 0;
            if (!c->dev.mem_info_fn || c->dev.mem_info_fn(c->dev.user_data, &fr, &total) != MN_OK)
                fr = total = 0;
            mr__c_trace(c, MN_TRACE_OOM, fr, size, size, stream, (uint8_t)cat);
            c->st.num_ooms++;
            mr__c_oom_message(c, alloc_size, fr, total);
            mr__log(&c->logger, MN_LOG_WARN, "%s", c->oom_msg);
            goto done;
        }
        if (r != MN_OK) goto done;
    }
    b = mr__c_alloc_found(c, b, size, orig, mr__c_should_split(c, b, size), cat, label);
    *ptr_out = mr__c_ptr(c, b->addr);
    r = MN_OK;
done:
    mr__c_unlock(c);
    return r;
}

MN__PRIVATE mr__c_block *mr__c_lookup(mr__c_cache *c, void *ptr, uint64_t *slot) {
    uint64_t i = mr__c_map_slot(c, mr__c_addr(c, ptr));
    if (i == UINT64_MAX) return NULL;
    if (slot) *slot = i;
    return c->map[i];
}

MNIMPL mn_result mr_cache_release(mr_cache *cache, void *ptr) {
    mr__c_cache *c;
    mr__c_block *b;
    mr__c_use *u;
    uint64_t slot = 0;
    uint32_t n = 0;
    int small;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    if (!ptr) return MN_OK;
    c = cache->p;
    mr__c_lock(c);
    b = mr__c_lookup(c, ptr, &slot);
    if (!b) {
        mr__c_unlock(c);
        mr__log(&c->logger, MN_LOG_ERROR, "cache: release of %p, which is not allocated", ptr);
        return MN_ERR_INVALID_ARG;
    }
    c->clock++;
    if (b->uses && c->dev.event_record_fn) {  // insert_events: one event per use stream
        for (u = b->uses; u; u = u->next) {
            mn_result r = c->dev.event_record_fn(c->dev.user_data, u->stream, &u->event);
            if (r != MN_OK) {
                mr__c_use *v;
                for (v = b->uses; v != u; v = v->next)
                    if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, v->event);
                mr__c_unlock(c);
                return r;
            }
            u->block = b;
            n++;
        }
    }
    small = b->small;
    mr__c_map_del(c, slot);
    b->allocated = 0;
    MR__C_STAT2(c, allocation, small, mr__c_stat_dec, 1);
    MR__C_STAT2(c, allocated_bytes, small, mr__c_stat_dec, b->size);
    mr__c_stat_dec(&c->st.cat_allocation[b->cat], 1);
    mr__c_stat_dec(&c->st.cat_allocated_bytes[b->cat], b->size);
    mr__c_stat_dec(&c->st.cat_requested_bytes[b->cat], b->requested);
    mr__c_trace(c, MN_TRACE_FREE_REQUESTED, b->addr, b->requested, b->size, b->stream, b->cat);
    if (b->size >= c->pol.max_split) mr__c_stat_dec(&c->st.oversize_allocations, 1);
    if (n) {
        mr__c_use *first = b->uses, *last = b->uses;
        while (last->next) last = last->next;
        b->uses = NULL;
        b->event_count = n;
        if (c->ev_tail) c->ev_tail->next = first;
        else c->ev_head = first;
        c->ev_tail = last;
    } else {
        while ((u = b->uses) != NULL) {
            b->uses = u->next;
            mr__c_use_recycle(c, u);
        }
        mr__c_free_block(c, b);
    }
    mr__c_unlock(c);
    return MN_OK;
}

MNIMPL mn_result mr_cache_record_stream(mr_cache *cache, void *ptr, mn_stream stream) {
    mr__c_cache *c;
    mr__c_block *b;
    mr__c_use *u;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mr__c_lock(c);
    b = mr__c_lookup(c, ptr, NULL);
    if (!b) {
        mr__c_unlock(c);
        return MN_ERR_INVALID_ARG;
    }
    if (stream != b->stream) {  // uses on the allocation stream need no synchronization
        for (u = b->uses; u; u = u->next)
            if (u->stream == stream) break;
        if (!u) {
            u = c->spare_uses;
            if (u) c->spare_uses = u->next;
            else u = (mr__c_use *)mr__alloc(&c->alloc, sizeof *u);
            if (!u) {
                mr__c_unlock(c);
                return MN_ERR_OUT_OF_MEMORY;
            }
            memset(u, 0, sizeof *u);
            u->stream = stream;
            u->block = b;
            u->next = b->uses;
            b->uses = u;
        }
    }
    mr__c_unlock(c);
    return MN_OK;
}

MNIMPL mn_result mr_cache_empty(mr_cache *cache) {
    mr__c_cache *c;
    mn_result r;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mr__c_lock(c);
    c->clock++;
    c->dev_error = MN_OK;
    mr__c_release_cached(c);
    r = c->dev_error;
    mr__c_unlock(c);
    return r;
}

MNIMPL mn_result mr_cache_set_memory_fraction(mr_cache *cache, double fraction) {
    mr__c_cache *c;
    uint64_t fr = 0, total = 0;
    mn_result r;
    if (!cache || !cache->p || !(fraction > 0.0) || fraction > 1.0) return MN_ERR_INVALID_ARG;
    c = cache->p;
    if (!c->dev.mem_info_fn) return MN_ERR_UNSUPPORTED;
    mr__c_lock(c);
    r = c->dev.mem_info_fn(c->dev.user_data, &fr, &total);
    if (r == MN_OK) {
        c->allowed_max = (uint64_t)(fraction * (double)total);
        c->set_fraction = 1;
    }
    mr__c_unlock(c);
    return r;
}

MNIMPL mn_result mr_cache_stats(mr_cache *cache, struct mn_cache_stats *out) {
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    mr__c_lock(cache->p);
    *out = cache->p->st;
    mr__c_unlock(cache->p);
    return MN_OK;
}

MN__PRIVATE void mr__c_reset_peak(mn_stat *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) s[i].peak = s[i].current;
}

MN__PRIVATE void mr__c_reset_acc(mn_stat *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) s[i].allocated = s[i].freed = 0;
}

// The resets, generated from MN_CACHE_STATS: peaks fall to the current values; accumulated
// totals and event counters fall to zero; settings stay.
#define MR__C_PEAK_POOL(name) mr__c_reset_peak(c->st.name, MN_STAT_TYPE_COUNT);
#define MR__C_PEAK_ONE(name) mr__c_reset_peak(&c->st.name, 1);
#define MR__C_PEAK_CAT(name) mr__c_reset_peak(c->st.name, MN_CAT_COUNT);
#define MR__C_PEAK_COUNT(name)
#define MR__C_PEAK_VALUE(name)
#define MR__C_PEAK_CATV(name)
#define MR__C_PEAK(kind, name, unit, label) MR__C_PEAK_##kind(name)
#define MR__C_ACC_POOL(name) mr__c_reset_acc(c->st.name, MN_STAT_TYPE_COUNT);
#define MR__C_ACC_ONE(name) mr__c_reset_acc(&c->st.name, 1);
#define MR__C_ACC_CAT(name) mr__c_reset_acc(c->st.name, MN_CAT_COUNT);
#define MR__C_ACC_COUNT(name) c->st.name = 0;
#define MR__C_ACC_VALUE(name)
#define MR__C_ACC_CATV(name)
#define MR__C_ACC(kind, name, unit, label) MR__C_ACC_##kind(name)

MNIMPL void mr_cache_reset_peak_stats(mr_cache *cache) {
    mr__c_cache *c;
    int k;
    if (!cache || !cache->p) return;
    c = cache->p;
    mr__c_lock(c);
    MN_CACHE_STATS(MR__C_PEAK)
    for (k = 0; k < MN_CAT_COUNT; k++) c->st.cat_at_peak[k] = c->st.cat_allocated_bytes[k].current;
    mr__c_unlock(c);
}

MNIMPL void mr_cache_reset_accumulated_stats(mr_cache *cache) {
    mr__c_cache *c;
    if (!cache || !cache->p) return;
    c = cache->p;
    mr__c_lock(c);
    MN_CACHE_STATS(MR__C_ACC)
    mr__c_unlock(c);
}

MNIMPL mn_result mr_cache_config_get(mr_cache *cache, mn_cache_config *out) {
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    *out = cache->p->cfg;
    return MN_OK;
}

MNIMPL void mr_cache_oom_message(mr_cache *cache, char *buf, size_t cap) {
    if (!buf || !cap) return;
    buf[0] = 0;
    if (!cache || !cache->p) return;
    mr__c_lock(cache->p);
    snprintf(buf, cap, "%s", cache->p->oom_msg);
    mr__c_unlock(cache->p);
}

MNIMPL void mr_cache_free(mr_cache *cache) {
    mr__c_cache *c;
    mr__c_segment *s, *sn;
    mr__c_use *u, *un;
    mr__c_block *b, *bn;
    if (!cache || !cache->p) return;
    c = cache->p;
    for (u = c->ev_head; u; u = un) {  // pending events: nothing waits any more
        un = u->next;
        if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, u->event);
        mr__free(&c->alloc, u);
    }
    for (s = c->segs; s; s = sn) {
        sn = s->next_seg;
        if (!s->expandable) {
            c->dev.free_fn(c->dev.user_data, mr__c_ptr(c, s->addr), s->size);
        }
        for (b = s->head; b; b = bn) {
            bn = b->next;
            if (s->expandable && b->mapped)
                c->dev.unmap_fn(c->dev.user_data, mr__c_ptr(c, b->addr), b->size);
            for (u = b->uses; u; u = un) un = u->next, mr__free(&c->alloc, u);
            mr__free(&c->alloc, b);
        }
        if (s->expandable && c->dev.unreserve_fn)
            c->dev.unreserve_fn(c->dev.user_data, mr__c_ptr(c, s->addr), s->size);
        mr__free(&c->alloc, s);
    }
    for (b = c->spare; b; b = bn) bn = b->tmp, mr__free(&c->alloc, b);
    for (u = c->spare_uses; u; u = un) un = u->next, mr__free(&c->alloc, u);
    mr__free(&c->alloc, c->spare_seg);
    mr__free(&c->alloc, c->map);
    mr__free(&c->alloc, c->ring);
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_destroy(&c->mu);
#endif
    {
        mn_allocator a = c->alloc;
        mr__free(&a, c);
    }
    cache->p = NULL;
}

// ---- invariant check ----------------------------------------------------------------------------

MN__PRIVATE uint64_t mr__c_tree_check(const mr__c_block *t, uint64_t *count, int by_addr,
                                      const mr__c_block **prev, int *bad) {
    if (!t) return 0;
    if ((t->l && (t->l->prio > t->prio || t->l->up != t)) ||
        (t->r && (t->r->prio > t->prio || t->r->up != t)))
        *bad = 1;
    mr__c_tree_check(t->l, count, by_addr, prev, bad);
    if (*prev && !mr__c_node_lt(*prev, t, by_addr)) *bad = 1;
    if (!t->in_tree || (t->mapped != !by_addr) || t->allocated) *bad = 1;
    *prev = t;
    (*count)++;
    mr__c_tree_check(t->r, count, by_addr, prev, bad);
    return *count;
}

#define MR__C_FAIL(...) do { mr__log(&c->logger, MN_LOG_ERROR, __VA_ARGS__); r = MN_ERR_STATE; \
    goto done; } while (0)

// mn_cache_check's use of MN_CACHE_STATS: the pools add up to the aggregate, and every current
// value recounted from the blocks equals the one kept.
#define MR__C_SUM_POOL(name) want.name[0].current += want.name[t].current;
#define MR__C_SUM(kind, name, unit, label) MR__C_SUM_##kind(name)
#define MR__C_SUM_ONE(name)
#define MR__C_SUM_COUNT(name)
#define MR__C_SUM_VALUE(name)
#define MR__C_SUM_CAT(name)
#define MR__C_SUM_CATV(name)
#define MR__C_CMP_ARRAY(name, n) \
    for (t = 0; t < (int)(n); t++) \
        if (want.name[t].current != c->st.name[t].current) \
            MR__C_FAIL("cache check: " #name "[%d] is %llu, blocks say %llu", t, \
                       (unsigned long long)c->st.name[t].current, \
                       (unsigned long long)want.name[t].current);
#define MR__C_CMP_POOL(name) MR__C_CMP_ARRAY(name, MN_STAT_TYPE_COUNT)
#define MR__C_CMP_CAT(name) MR__C_CMP_ARRAY(name, MN_CAT_COUNT)
#define MR__C_CMP_ONE(name) \
    if (want.name.current != c->st.name.current) MR__C_FAIL("cache check: " #name " count");
#define MR__C_CMP_COUNT(name)
#define MR__C_CMP_VALUE(name)
#define MR__C_CMP_CATV(name)
#define MR__C_CMP(kind, name, unit, label) MR__C_CMP_##kind(name)

MNIMPL mn_result mr_cache_check(mr_cache *cache) {
    mr__c_cache *c;
    mr__c_segment *s;
    mr__c_block *b;
    struct mn_cache_stats want;
    uint64_t in_tree[2] = {0, 0}, counted[2] = {0, 0}, unm[2] = {0, 0}, allocated = 0, total = 0;
    uint64_t whole[2] = {0, 0};
    mn_result r = MN_OK;
    int bad = 0, k, t;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mr__c_lock(c);
    memset(&want, 0, sizeof want);
    for (s = c->segs; s; s = s->next_seg) {
        uint64_t sum = 0, at = s->addr;
        int split;
        if (!s->head || s->head->prev)
            MR__C_FAIL("cache check: segment %llx head", (unsigned long long)s->addr);
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
                MR__C_FAIL("cache check: block %llx does not tile its segment",
                           (unsigned long long)b->addr);
            if (b->next && !b->allocated && !b->next->allocated && !b->event_count &&
                !b->next->event_count && !b->uses && !b->next->uses &&
                b->mapped == b->next->mapped)
                MR__C_FAIL("cache check: free blocks %llx and its successor were not merged",
                           (unsigned long long)b->addr);
            at += b->size, sum += b->size;
            if (s->expandable && b->mapped) want.reserved_bytes[t].current += b->size;
            if (b->allocated) {
                if (b->in_tree || mr__c_lookup(c, mr__c_ptr(c, b->addr), NULL) != b ||
                    b->event_count)
                    MR__C_FAIL("cache check: allocated block %llx not in the map",
                               (unsigned long long)b->addr);
                allocated++;
                want.allocation[t].current++;
                want.allocated_bytes[t].current += b->size;
                want.cat_allocation[b->cat].current++;
                want.cat_allocated_bytes[b->cat].current += b->size;
                want.cat_requested_bytes[b->cat].current += b->requested;
                if (b->size >= c->pol.max_split) want.oversize_allocations.current++;
            } else if (b->event_count) {
                if (b->in_tree) MR__C_FAIL("cache check: pending block in a pool");
            } else {
                if (!b->in_tree) MR__C_FAIL("cache check: free block %llx not in its pool",
                                            (unsigned long long)b->addr);
                if (b->mapped) in_tree[pool]++;
                else unm[pool]++;
                whole[pool] += (uint64_t)mr__c_whole(b);
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
        if (sum != s->size) MR__C_FAIL("cache check: segment %llx blocks sum to %llu, not %llu",
                                       (unsigned long long)s->addr, (unsigned long long)sum,
                                       (unsigned long long)s->size);
        if (!s->expandable && s->size >= c->pol.max_split) want.oversize_segments.current++;
    }
    for (k = 0; k < 2; k++) {
        mr__c_pool *p = k ? &c->large : &c->small;
        const mr__c_block *prev = NULL;
        uint64_t n = 0;
        mr__c_tree_check(p->blocks, &n, 0, &prev, &bad);
        counted[k] = n;
        n = 0, prev = NULL;
        mr__c_tree_check(p->unmapped, &n, 1, &prev, &bad);
        if (bad) MR__C_FAIL("cache check: pool tree out of order");
        if (counted[k] != in_tree[k] || n != unm[k])
            MR__C_FAIL("cache check: pool holds %llu blocks, %llu are free",
                       (unsigned long long)counted[k], (unsigned long long)in_tree[k]);
        if (p->whole != whole[k])
            MR__C_FAIL("cache check: pool counts %llu whole free segments, %llu are",
                       (unsigned long long)p->whole, (unsigned long long)whole[k]);
    }
    if (allocated != c->map_count) MR__C_FAIL("cache check: address map size");
    for (t = 1; t < MN_STAT_TYPE_COUNT; t++) {
        MN_CACHE_STATS(MR__C_SUM)
    }
    total = want.reserved_bytes[0].current;
    if (total != c->total_allocated_memory) MR__C_FAIL("cache check: total_allocated_memory");
    MN_CACHE_STATS(MR__C_CMP)
done:
    mr__c_unlock(c);
    return r;
}
#undef MR__C_FAIL

MN__PRIVATE int mr__c_seg_cmp(const void *a, const void *b) {
    const mn_segment_info *x = (const mn_segment_info *)a, *y = (const mn_segment_info *)b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

MNIMPL mn_result mr_cache_snapshot_take(mr_cache *cache, mn_cache_snapshot *out) {
    mr__c_cache *c;
    mr__c_segment *s;
    mr__c_block *b;
    uint64_t nseg = 0, nblk = 0, i, bi = 0, si = 0;
    mn_block_info *tmpb = NULL;
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    c = cache->p;
    memset(out, 0, sizeof *out);
    out->allocator = c->alloc;
    mr__c_lock(c);
    for (s = c->segs; s; s = s->next_seg)
        for (b = s->head; b; b = b->next) {
            if (!b->mapped) continue;
            nblk++;
            if (!b->prev || !b->prev->mapped) nseg++;
        }
    out->segments =
        (mn_segment_info *)mr__alloc_array(&c->alloc, (size_t)nseg, sizeof *out->segments);
    out->blocks = (mn_block_info *)mr__alloc_array(&c->alloc, (size_t)nblk, sizeof *out->blocks);
    tmpb = (mn_block_info *)mr__alloc_array(&c->alloc, (size_t)nblk, sizeof *tmpb);
    out->trace = (mn_trace_entry *)mr__alloc_array(&c->alloc, (size_t)c->ring_count,
                                                   sizeof *out->trace);
    if (!out->segments || !out->blocks || !tmpb || !out->trace) {
        mr__c_unlock(c);
        mr__free(&c->alloc, tmpb);
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
    mr__c_unlock(c);
    // segments by address, their blocks gathered in the same order
    qsort(out->segments, (size_t)nseg, sizeof *out->segments, mr__c_seg_cmp);
    for (i = 0, bi = 0; i < nseg; i++) {
        mn_segment_info *g = &out->segments[i];
        memcpy(&out->blocks[bi], &tmpb[g->first_block], (size_t)g->block_count * sizeof *tmpb);
        g->first_block = bi;
        bi += g->block_count;
    }
    mr__free(&c->alloc, tmpb);
    return MN_OK;
}

#endif  // MR_CACHE_REF_H
