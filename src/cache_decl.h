// >>cache ---------------------------------------------------------------------------------------
//
// A caching allocator for device memory whose default policy is PyTorch's native CUDA caching
// allocator (c10/cuda/CUDACachingAllocator.cpp), block for block: requests are rounded to 512 B
// (or to power-of-two divisions), served best-fit by (stream, size, address) from a small pool
// (<= 1 MiB, 2 MiB segments) or a large pool (20 MiB segments below 10 MiB, 2 MiB-rounded above),
// split and merged inside segments, and the device is asked for a new segment only on a miss,
// after which the out-of-memory ladder frees cached segments and retries.
//
// It runs over a device interface (mn_device). The header ships a simulated device (mn_simdev):
// deterministic fake addresses, a capacity, events completed by hand, injectable failures, and
// virtual-address reservation mapped in granules (for expandable segments), so every path is
// testable on the CPU.
//
// Observability: PyTorch's full statistics set plus statistics per memory category, the
// memory_summary() table, the OOM message, a history ring buffer, a snapshot whose JSON
// pytorch.org/memory_viz opens, and an SVG memory timeline stacked by category. Writers send
// their text to a callback (mn_cache_write_fn); pass fwrite-like glue to write to a FILE*.
//
// Thread safety: one mutex per allocator (pthreads). Define MEMANAT_NO_THREADS before the
// implementation to build without locking (then one thread at a time per allocator).
//
// Quick start (simulated 80 GiB device, PyTorch's defaults):
//   mn_simdev dev;  mn_simdev_desc dd = {0};  mn_cache cache;  mn_cache_desc cd = {0};
//   struct mn_cache_stats st;  void *p;
//   dd.capacity = 80ull << 30;  mn_simdev_init(&dev, &dd);
//   cd.device = mn_simdev_device(&dev);  cd.config = "expandable_segments:True";  // or NULL
//   mn_cache_init(&cache, &cd);
//   mn_cache_alloc(&cache, 4 << 20, 0, MN_CAT_ACTIVATIONS, "attn.qkv", &p);
//   mn_cache_release(&cache, p);
//   mn_cache_stats(&cache, &st);   // st.reserved_bytes[MN_STAT_ALL].peak, ...
//   mn_cache_free(&cache);  mn_simdev_free(&dev);

typedef uint32_t mn_stream;  // a device stream; 0 = the default stream
typedef uint64_t mn_event;   // a device event handle; 0 = none

// Device interface. Addresses are opaque; the allocator never dereferences them.
typedef struct mn_device {
    // Required. MN_ERR_DEVICE_OOM when the device is out of memory (the allocator then frees
    // cached segments and retries); any other error is returned to the caller at once.
    mn_result (*alloc_fn)(void *user_data, uint64_t size, void **ptr_out);
    mn_result (*free_fn)(void *user_data, void *ptr, uint64_t size);
    // Optional: free and total device bytes (the OOM message, the memory fraction).
    mn_result (*mem_info_fn)(void *user_data, uint64_t *free_out, uint64_t *total_out);
    // Optional events. Without them a cross-stream use needs no waiting and a block freed after
    // mn_cache_record_stream() is reusable at once.
    mn_result (*event_record_fn)(void *user_data, mn_stream stream, mn_event *event_out);
    int (*event_query_fn)(void *user_data, mn_event event);       // 1 = the work before it is done
    mn_result (*event_sync_fn)(void *user_data, mn_event event);  // waits until it is done
    void (*event_free_fn)(void *user_data, mn_event event);
    // Optional virtual memory, needed by expandable_segments:True (cuMemAddressReserve/cuMemMap).
    mn_result (*reserve_fn)(void *user_data, uint64_t size, void **base_out);
    mn_result (*unreserve_fn)(void *user_data, void *base, uint64_t size);
    mn_result (*map_fn)(void *user_data, void *addr, uint64_t size);  // MN_ERR_DEVICE_OOM if full
    mn_result (*unmap_fn)(void *user_data, void *addr, uint64_t size);
    void *user_data;
} mn_device;

// ---- simulated device ----
// A bump allocator of fake addresses that are never reused (RMM's simulated_memory_resource
// does the same), a capacity in bytes, events that complete only when told to, and failure
// injection. Not thread-safe by itself: the allocator calls it under its own lock.
typedef struct mn_simdev_desc {
    uint64_t capacity;       // bytes, 0 = unlimited (mem_info then reports 1 PiB total)
    uint64_t base;           // first fake address, 0 = 0x7f0000000000
    uint64_t fail_alloc_at;  // the N-th device allocation (alloc or map) fails, 0 = never
    int events_complete;     // 1: events complete as soon as recorded, 0 = when completed by hand
    mn_allocator allocator;  // host memory for the event table
} mn_simdev_desc;

typedef struct mn_simdev_event {
    mn_event id;
    mn_stream stream;
    int done;
} mn_simdev_event;

typedef struct mn_simdev {  // fields are read-only for callers
    mn_simdev_desc desc;     // resolved
    uint64_t used, peak_used;                // bytes allocated or mapped
    uint64_t next_addr, next_va;             // bump pointers (physical, reserved ranges)
    uint64_t alloc_calls, free_calls, map_calls, unmap_calls, failed_calls;
    uint64_t live;                           // live device allocations (not maps)
    uint64_t fail_at;                        // alloc_calls + map_calls value that fails, 0 = none
    mn_event next_event;
    mn_simdev_event *events;                 // recorded and not yet freed
    uint32_t event_count, event_cap;
} mn_simdev;

MNDEF mn_result mn_simdev_init(mn_simdev *dev, const mn_simdev_desc *desc);
MNDEF void mn_simdev_free(mn_simdev *dev);
MNDEF mn_device mn_simdev_device(mn_simdev *dev);
// The n-th device allocation (alloc or map) from now on fails with MN_ERR_DEVICE_OOM; 0 = never.
MNDEF void mn_simdev_fail_alloc_at(mn_simdev *dev, uint64_t n);
MNDEF void mn_simdev_complete_event(mn_simdev *dev, mn_event event);
MNDEF void mn_simdev_sync_stream(mn_simdev *dev, mn_stream stream);  // completes its events
MNDEF void mn_simdev_sync(mn_simdev *dev);                           // completes every event
MNDEF uint32_t mn_simdev_pending_events(const mn_simdev *dev);

// ---- configuration (PYTORCH_CUDA_ALLOC_CONF) ----
#define MN_CACHE_ROUNDUP_INTERVALS 16  // power-of-two intervals from 1 MiB to 64 GiB

typedef struct mn_cache_config {
    uint64_t max_split_size;          // bytes, 0 = unlimited (max_split_size_mb, must be > 20 MiB)
    uint64_t max_non_split_rounding;  // bytes, 0 = 20 MiB (max_non_split_rounding_mb)
    uint64_t large_segment_size;      // bytes, 0 = 20 MiB (large_segment_size_mb)
    uint32_t roundup_power2_divisions[MN_CACHE_ROUNDUP_INTERVALS];  // 0 = plain 512 B rounding
    double garbage_collection_threshold;  // (0, 1), 0 = off; acts only with a memory fraction
    int expandable_segments;          // 1 = one growing segment per (stream, pool)
    int release_lock_on_cudamalloc;   // accepted; the simulated device is synchronous anyway
} mn_cache_config;

// Parses "<key>:<value>,<key>:<value>..." as PyTorch does (CUDAAllocatorConfig::parseArgs);
// NULL or "" gives the defaults (all zero). Unknown keys and bad values: MN_ERR_CONFIG and one
// message through the logger naming the key; backend:cudaMallocAsync is MN_ERR_UNSUPPORTED.
MNDEF mn_result mn_cache_config_parse(const char *text, mn_cache_config *out, const mn_logger *lg);

// The policy as pure functions (PyTorch round_size, get_allocation_size). cfg NULL = defaults.
MNDEF uint64_t mn_cache_round_size(const mn_cache_config *cfg, uint64_t size);
MNDEF uint64_t mn_cache_segment_size(const mn_cache_config *cfg, uint64_t rounded_size);

// ---- the allocator ----
typedef struct mn_cache_desc {
    mn_device device;        // required: alloc_fn and free_fn
    const char *config;      // PYTORCH_CUDA_ALLOC_CONF grammar, NULL or "" = defaults
    const mn_cache_config *settings;  // already parsed settings, NULL = parse config
    uint32_t trace_entries;  // history ring buffer (snapshot device_traces, SVG), 0 = no history
    int device_index;        // the "GPU N" / "device ID N" printed in messages, 0 = 0
    mn_allocator allocator;  // host memory
    mn_logger logger;
} mn_cache_desc;

typedef struct mn_cache {
    struct mn__c_cache *p;  // private state; the caller owns this struct
} mn_cache;

typedef struct mn_stat {
    uint64_t current, peak, allocated, freed;
} mn_stat;

typedef enum mn_stat_type {  // PyTorch StatType
    MN_STAT_ALL = 0,         // aggregate
    MN_STAT_SMALL_POOL,
    MN_STAT_LARGE_POOL,
    MN_STAT_TYPE_COUNT
} mn_stat_type;

// PyTorch's DeviceStats (c10/cuda/CUDACachingAllocator.h), plus statistics per category.
// The typedef name differs from the tag so that mn_cache_stats() can keep its name, like
// POSIX struct stat and stat().
typedef struct mn_cache_stats {
    mn_stat allocation[MN_STAT_TYPE_COUNT];      // blocks handed to callers
    mn_stat segment[MN_STAT_TYPE_COUNT];         // device allocations (not expandable maps)
    mn_stat active[MN_STAT_TYPE_COUNT];          // allocated or waiting for stream events
    mn_stat inactive_split[MN_STAT_TYPE_COUNT];  // free blocks inside split segments
    mn_stat allocated_bytes[MN_STAT_TYPE_COUNT]; // rounded block sizes
    mn_stat reserved_bytes[MN_STAT_TYPE_COUNT];  // device bytes held (free and used)
    mn_stat active_bytes[MN_STAT_TYPE_COUNT];
    mn_stat inactive_split_bytes[MN_STAT_TYPE_COUNT];  // "non-releasable memory"
    mn_stat requested_bytes[MN_STAT_TYPE_COUNT];       // unrounded sizes asked for
    uint64_t num_alloc_retries;   // cache flushes after a failed device allocation
    uint64_t num_ooms;            // allocations that failed after the whole ladder
    uint64_t num_sync_all_streams;
    uint64_t num_device_alloc;    // device allocations + maps
    uint64_t num_device_free;     // device frees + unmaps
    mn_stat oversize_allocations; // blocks >= max_split_size handed out
    mn_stat oversize_segments;    // segments >= max_split_size allocated
    uint64_t max_split_size;      // UINT64_MAX = unlimited
    // per memory category (memanat)
    mn_stat cat_allocation[MN_CAT_COUNT];
    mn_stat cat_allocated_bytes[MN_CAT_COUNT];
    mn_stat cat_requested_bytes[MN_CAT_COUNT];
    uint64_t cat_at_peak[MN_CAT_COUNT];  // allocated bytes per category at the allocated peak
} mn_cache_statistics;

MNDEF mn_result mn_cache_init(mn_cache *c, const mn_cache_desc *desc);
MNDEF void mn_cache_free(mn_cache *c);  // returns every segment to the device
// Allocates size bytes for use on stream. size 0 gives NULL and MN_OK (as PyTorch). label is an
// optional short name kept with the block (truncated to MN_CACHE_LABEL_MAX - 1 bytes).
// MN_ERR_DEVICE_OOM after the whole out-of-memory ladder; mn_cache_oom_message() explains it.
MNDEF mn_result mn_cache_alloc(mn_cache *c, uint64_t size, mn_stream stream, mn_category cat,
                               const char *label, void **ptr_out);
MNDEF mn_result mn_cache_release(mn_cache *c, void *ptr);  // NULL is a no-op
// The block is used on another stream (PyTorch recordStream): its memory is not reused until
// an event recorded on that stream at release time has completed.
MNDEF mn_result mn_cache_record_stream(mn_cache *c, void *ptr, mn_stream stream);
MNDEF mn_result mn_cache_empty(mn_cache *c);  // torch.cuda.empty_cache()
// torch.cuda.set_per_process_memory_fraction: the device's total (mem_info_fn) times fraction
// (0, 1] bounds the reserved bytes. Needed for garbage_collection_threshold to act.
MNDEF mn_result mn_cache_set_memory_fraction(mn_cache *c, double fraction);
MNDEF mn_result mn_cache_stats(mn_cache *c, struct mn_cache_stats *out);
MNDEF void mn_cache_reset_peak_stats(mn_cache *c);         // peak = current
MNDEF void mn_cache_reset_accumulated_stats(mn_cache *c);  // allocated = freed = 0, counters 0
MNDEF mn_result mn_cache_config_get(mn_cache *c, mn_cache_config *out);
// Copies the message of the last out-of-memory failure ("" if none) into buf.
MNDEF void mn_cache_oom_message(mn_cache *c, char *buf, size_t cap);
// Checks the internal invariants (block lists tile segments, pools hold exactly the free
// blocks, statistics equal the sums over blocks). MN_OK or MN_ERR_STATE, reason to the logger.
MNDEF mn_result mn_cache_check(mn_cache *c);

// ---- observability ----
typedef mn_result (*mn_cache_write_fn)(void *user_data, const char *data, size_t len);

#define MN_CACHE_LABEL_MAX 24

typedef enum mn_trace_action {  // snapshot device_traces "action"
    MN_TRACE_DEFAULT = 0,
    MN_TRACE_ALLOC,
    MN_TRACE_FREE_REQUESTED,
    MN_TRACE_FREE_COMPLETED,
    MN_TRACE_SEGMENT_ALLOC,
    MN_TRACE_SEGMENT_FREE,
    MN_TRACE_SEGMENT_MAP,
    MN_TRACE_SEGMENT_UNMAP,
    MN_TRACE_OOM,
    MN_TRACE_ACTION_COUNT
} mn_trace_action;

typedef struct mn_trace_entry {
    mn_trace_action action;
    mn_category category;
    mn_stream stream;
    uint64_t addr;        // oom: free device bytes (PyTorch "device_free")
    uint64_t size;        // as PyTorch: requested size for alloc/free, segment size, oom: rounded
    uint64_t block_size;  // rounded block size for alloc/free entries
    uint64_t time;        // operation counter of the allocator
} mn_trace_entry;

typedef enum mn_block_state {
    MN_BLOCK_DEFAULT = 0,
    MN_BLOCK_ACTIVE_ALLOCATED,
    MN_BLOCK_ACTIVE_PENDING_FREE,  // released, waiting for stream events
    MN_BLOCK_INACTIVE,
    MN_BLOCK_STATE_COUNT
} mn_block_state;

typedef struct mn_block_info {
    uint64_t addr, size, requested;
    mn_block_state state;
    mn_category category;
    char label[MN_CACHE_LABEL_MAX];
} mn_block_info;

typedef struct mn_segment_info {
    uint64_t addr, total_size, allocated_size, active_size, requested_size;
    mn_stream stream;
    int is_small, is_expandable;
    uint64_t first_block, block_count;  // range in mn_cache_snapshot.blocks
} mn_segment_info;

typedef struct mn_cache_snapshot {
    mn_segment_info *segments;  // sorted by address; an expandable segment gives one entry per
    uint64_t segment_count;     // mapped range (unmapped address space is not listed)
    mn_block_info *blocks;
    uint64_t block_count;
    mn_trace_entry *trace;      // oldest first
    uint64_t trace_count;
    uint64_t trace_dropped;     // entries overwritten in the ring buffer
    uint64_t base_cat_allocated[MN_CAT_COUNT];  // state before trace[0]: allocated per category
    uint64_t base_reserved;                     // and reserved bytes
    mn_cache_config config;
    int device_index;
    struct mn_cache_stats stats;
    mn_allocator allocator;
} mn_cache_snapshot;

MNDEF mn_result mn_cache_snapshot_take(mn_cache *c, mn_cache_snapshot *out);
MNDEF void mn_cache_snapshot_free(mn_cache_snapshot *s);
MNDEF const char *mn_trace_action_name(mn_trace_action a);   // "alloc", "free_requested", ...
MNDEF const char *mn_block_state_name(mn_block_state s);     // "active_allocated", ...

// torch.cuda.memory_summary(): PyTorch's table, byte for byte.
MNDEF mn_result mn_cache_summary_write(const struct mn_cache_stats *s, int device_index,
                                       int abbreviated, mn_cache_write_fn fn, void *user_data);
// memanat's table per memory category: current, peak and at-the-allocated-peak bytes, and
// allocation counts, for the categories that were used.
MNDEF mn_result mn_cache_category_summary_write(const struct mn_cache_stats *s,
                                                mn_cache_write_fn fn, void *user_data);
// Snapshot in the JSON form of torch.cuda.memory._snapshot() (segments, device_traces,
// allocator_settings); blocks and trace entries carry their category and label as a frame.
MNDEF mn_result mn_cache_snapshot_write_json(const mn_cache_snapshot *s, mn_cache_write_fn fn,
                                             void *user_data);
// SVG picture: allocated bytes over time stacked by category, reserved bytes as a line.
MNDEF mn_result mn_cache_timeline_svg(const mn_cache_snapshot *s, const char *title,
                                      mn_cache_write_fn fn, void *user_data);
// PyTorch's format_size(): "512 bytes", "1.50 KiB", "20.00 MiB", "1.25 GiB".
MNDEF void mn_cache_format_size(uint64_t bytes, char *buf, size_t cap);
