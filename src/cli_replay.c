// `memanat replay FILE [--config STR] [--capacity SIZE] [--json] [--svg OUT]`: part of memanat.c
// (included by it). Replays an allocation trace through the caching allocator on the simulated
// device and prints PyTorch's statistics, memory_summary() and peak reserved / peak allocated.
//
// Inputs:
//   - RMM's logging_resource_adaptor CSV: header "Thread,Time,Action,Pointer,Size,Stream", actions
//     "allocate", "free" ("allocate failure" rows are skipped, as RMM's replay benchmark does).
//   - PyTorch snapshot JSON (torch.cuda.memory._snapshot() saved as JSON): device_traces of the
//     first device with entries; "alloc" allocates, "free_requested" (or "free") frees.
// The device is a bump allocator of fake addresses that are never reused, unlimited unless
// --capacity. An allocation that fails after the whole OOM ladder counts in num_ooms; the replay
// goes on and skips that pointer's free. The config defaults to $PYTORCH_CUDA_ALLOC_CONF
// (or $PYTORCH_ALLOC_CONF).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct mn_rp_event {
    uint64_t key;     // the pointer in the trace
    uint64_t size;    // bytes (allocations)
    uint32_t stream;  // dense stream number, 0 = the trace's default stream
    mn_category cat;  // from a memanat snapshot's "category", else other
    int is_alloc;
} mn_rp_event;

typedef struct mn_rp_trace {
    mn_rp_event *ev;
    size_t n, cap;
    uint64_t streams[64];  // trace stream values by dense number (index 0 is value 0)
    uint32_t nstreams;
    uint64_t skipped;      // rows that are not allocations or frees
} mn_rp_trace;

static int mn_rp_push(mn_rp_trace *t, uint64_t key, uint64_t size, uint64_t stream, int is_alloc) {
    uint32_t s = 0, k;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 4096;
        mn_rp_event *ev = (mn_rp_event *)realloc(t->ev, cap * sizeof *ev);
        if (!ev) return 0;
        t->ev = ev, t->cap = cap;
    }
    if (stream != 0) {
        for (k = 1; k < t->nstreams; k++)
            if (t->streams[k] == stream) break;
        if (k == t->nstreams) {
            if (t->nstreams == 0) t->nstreams = 1;
            k = t->nstreams < 64 ? t->nstreams++ : 63;  // beyond 63 streams: shared
            t->streams[k] = stream;
        }
        s = k;
    }
    t->ev[t->n].key = key, t->ev[t->n].size = size, t->ev[t->n].stream = s;
    t->ev[t->n].is_alloc = is_alloc;
    t->ev[t->n].cat = MN_CAT_OTHER;
    t->n++;
    return 1;
}

// Unsigned number: hex with 0x, "(nil)" = 0, else decimal. The whole field must be used.
static int mn_rp_num(const char *s, size_t n, int hex_default, uint64_t *out) {
    uint64_t v = 0;
    size_t i = 0;
    int base = hex_default ? 16 : 10, digits = 0;
    while (n && (s[0] == ' ' || s[0] == '"')) s++, n--;
    while (n && (s[n - 1] == ' ' || s[n - 1] == '"' || s[n - 1] == '\r')) n--;
    if (n == 5 && memcmp(s, "(nil)", 5) == 0) return *out = 0, 1;
    if (n > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) i = 2, base = 16;
    for (; i < n; i++) {
        int d;
        char ch = s[i];
        if (ch >= '0' && ch <= '9') d = ch - '0';
        else if (base == 16 && ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
        else if (base == 16 && ch >= 'A' && ch <= 'F') d = ch - 'A' + 10;
        else return 0;
        if (v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base) return 0;
        v = v * (uint64_t)base + (uint64_t)d;
        digits++;
    }
    if (!digits) return 0;
    *out = v;
    return 1;
}

static int mn_rp_field_is(const char *s, size_t n, const char *w) {
    size_t k = strlen(w);
    while (n && (s[0] == ' ' || s[0] == '"')) s++, n--;
    while (n && (s[n - 1] == ' ' || s[n - 1] == '"' || s[n - 1] == '\r')) n--;
    return n == k && memcmp(s, w, k) == 0;
}

// RMM CSV. Returns 0 after printing one line on stderr.
static int mn_rp_read_csv(const char *text, size_t len, const char *file, mn_rp_trace *t) {
    enum { C_ACTION, C_POINTER, C_SIZE, C_STREAM, C_COUNT };
    static const char *const names[C_COUNT] = {"Action", "Pointer", "Size", "Stream"};
    int col[C_COUNT] = {-1, -1, -1, -1};
    const char *p = text, *end = text + len;
    uint64_t line = 0;
    while (p < end) {
        const char *eol = (const char *)memchr(p, '\n', (size_t)(end - p));
        const char *f[16];
        size_t fl[16];
        int nf = 0, k;
        const char *q;
        if (!eol) eol = end;
        line++;
        for (q = p; nf < 16;) {  // split on commas
            const char *c = (const char *)memchr(q, ',', (size_t)(eol - q));
            f[nf] = q;
            fl[nf] = (size_t)((c ? c : eol) - q);
            nf++;
            if (!c) break;
            q = c + 1;
        }
        if (eol == p || (eol == p + 1 && *p == '\r')) {  // blank line
            p = eol + 1;
            continue;
        }
        if (col[0] < 0) {  // the header names the columns
            for (k = 0; k < nf; k++) {
                int j;
                for (j = 0; j < C_COUNT; j++)
                    if (mn_rp_field_is(f[k], fl[k], names[j])) col[j] = k;
            }
            for (k = 0; k < C_COUNT; k++) {
                if (col[k] < 0) {
                    fprintf(stderr, "memanat replay: %s: line 1 is not an RMM log header "
                            "(Thread,Time,Action,Pointer,Size,Stream): no column '%s'\n", file,
                            names[k]);
                    return 0;
                }
            }
        } else {
            uint64_t ptr = 0, size = 0, stream = 0;
            int is_alloc;
            for (k = 0; k < C_COUNT; k++) {
                if (col[k] >= nf) {
                    fprintf(stderr, "memanat replay: %s: line %llu has %d fields, want %d\n",
                            file, (unsigned long long)line, nf, col[k] + 1);
                    return 0;
                }
            }
            if (mn_rp_field_is(f[col[C_ACTION]], fl[col[C_ACTION]], "allocate failure")) {
                t->skipped++;
                p = eol + 1;
                continue;
            }
            if (mn_rp_field_is(f[col[C_ACTION]], fl[col[C_ACTION]], "allocate")) is_alloc = 1;
            else if (mn_rp_field_is(f[col[C_ACTION]], fl[col[C_ACTION]], "free")) is_alloc = 0;
            else {
                fprintf(stderr, "memanat replay: %s: line %llu: unknown action '%.*s' (want "
                        "allocate or free)\n", file, (unsigned long long)line,
                        (int)fl[col[C_ACTION]], f[col[C_ACTION]]);
                return 0;
            }
            if (!mn_rp_num(f[col[C_POINTER]], fl[col[C_POINTER]], 1, &ptr) ||
                !mn_rp_num(f[col[C_SIZE]], fl[col[C_SIZE]], 0, &size) ||
                !mn_rp_num(f[col[C_STREAM]], fl[col[C_STREAM]], 1, &stream)) {
                fprintf(stderr, "memanat replay: %s: line %llu: bad pointer, size or stream\n",
                        file, (unsigned long long)line);
                return 0;
            }
            if (!mn_rp_push(t, ptr, size, stream, is_alloc)) {
                fprintf(stderr, "memanat replay: out of memory\n");
                return 0;
            }
        }
        p = eol + 1;
    }
    if (col[0] < 0) {
        fprintf(stderr, "memanat replay: %s: empty file\n", file);
        return 0;
    }
    return 1;
}

// PyTorch snapshot JSON: device_traces of the first device that has entries.
static int mn_rp_read_snapshot(const char *text, size_t len, const char *file, mn_rp_trace *t) {
    mn_json_doc doc;
    const mn_json_value *dt, *tr = NULL;
    size_t i;
    mn_result r = mn_json_parse(text, len, NULL, &doc);
    if (r != MN_OK) {
        fprintf(stderr, "memanat replay: %s: not valid JSON (%s)\n", file, mn_result_str(r));
        return 0;
    }
    dt = mn_json_get(doc.root, "device_traces");
    if (!dt || dt->type != MN_JSON_ARRAY) {
        fprintf(stderr, "memanat replay: %s: no \"device_traces\" array (a PyTorch memory "
                "snapshot saved as JSON is expected)\n", file);
        mn_json_free(&doc);
        return 0;
    }
    for (i = 0; i < dt->len; i++)
        if (dt->items[i].type == MN_JSON_ARRAY && dt->items[i].len > 0) {
            tr = &dt->items[i];
            break;
        }
    for (i = 0; tr && i < tr->len; i++) {
        const mn_json_value *e = &tr->items[i], *a = mn_json_get(e, "action");
        uint64_t addr = 0, size = 0, stream = 0;
        int is_alloc;
        if (!a || a->type != MN_JSON_STRING) {
            fprintf(stderr, "memanat replay: %s: trace entry %zu has no \"action\"\n", file, i);
            mn_json_free(&doc);
            return 0;
        }
        if (strcmp(a->str, "alloc") == 0) is_alloc = 1;
        else if (strcmp(a->str, "free_requested") == 0 || strcmp(a->str, "free") == 0) is_alloc = 0;
        else {
            t->skipped++;
            continue;
        }
        if (mn_json_u64(mn_json_get(e, "addr"), &addr) != MN_OK ||
            (is_alloc && mn_json_u64(mn_json_get(e, "size"), &size) != MN_OK)) {
            fprintf(stderr, "memanat replay: %s: trace entry %zu needs integer \"addr\" and "
                    "\"size\"\n", file, i);
            mn_json_free(&doc);
            return 0;
        }
        if (mn_json_u64(mn_json_get(e, "stream"), &stream) != MN_OK) stream = 0;
        if (!mn_rp_push(t, addr, size, stream, is_alloc)) {
            fprintf(stderr, "memanat replay: out of memory\n");
            mn_json_free(&doc);
            return 0;
        }
        a = mn_json_get(e, "category");  // written by memanat's own snapshots
        if (a && a->type == MN_JSON_STRING) {
            int c;
            for (c = 0; c < MN_CAT_COUNT; c++)
                if (strcmp(a->str, mn_category_name((mn_category)c)) == 0)
                    t->ev[t->n - 1].cat = (mn_category)c;
        }
    }
    mn_json_free(&doc);
    return 1;
}

// Trace pointer -> replayed pointer, open addressing (key 0 is never stored).
typedef struct mn_rp_map {
    uint64_t *key;
    void **val;
    size_t cap;
} mn_rp_map;

static size_t mn_rp_slot(const mn_rp_map *m, uint64_t key) {
    size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (m->cap - 1);
    while (m->key[h] && m->key[h] != key) h = (h + 1) & (m->cap - 1);
    return h;
}

static mn_result mn_rp_write_file(void *ud, const char *data, size_t len) {
    return fwrite(data, 1, len, (FILE *)ud) == len ? MN_OK : MN_ERR_IO;
}

typedef struct mn_rp_kv {
    char key[48];
    long long val;
} mn_rp_kv;

static int mn_rp_kv_cmp(const void *a, const void *b) {
    return strcmp(((const mn_rp_kv *)a)->key, ((const mn_rp_kv *)b)->key);
}

static void mn_rp_print_json(const struct mn_cache_stats *s, double ratio, uint64_t allocs,
                             uint64_t frees, uint64_t unmatched) {
    static const char *const pools[3] = {"all", "small_pool", "large_pool"};
    static const char *const fields[4] = {"current", "peak", "allocated", "freed"};
    const struct { const char *name; const mn_stat *st; } arr[9] = {
        {"allocation", s->allocation}, {"segment", s->segment}, {"active", s->active},
        {"inactive_split", s->inactive_split}, {"allocated_bytes", s->allocated_bytes},
        {"reserved_bytes", s->reserved_bytes}, {"active_bytes", s->active_bytes},
        {"inactive_split_bytes", s->inactive_split_bytes}, {"requested_bytes", s->requested_bytes}};
    mn_rp_kv kv[9 * 3 * 4 + 16];
    size_t n = 0, i;
    int p, f;
    for (i = 0; i < 9; i++)
        for (p = 0; p < 3; p++)
            for (f = 0; f < 4; f++) {
                const mn_stat *st = &arr[i].st[p];
                const uint64_t v[4] = {st->current, st->peak, st->allocated, st->freed};
                snprintf(kv[n].key, sizeof kv[n].key, "%s.%s.%s", arr[i].name, pools[p], fields[f]);
                kv[n++].val = (long long)v[f];
            }
    for (f = 0; f < 4; f++) {
        const uint64_t a[4] = {s->oversize_allocations.current, s->oversize_allocations.peak,
                               s->oversize_allocations.allocated, s->oversize_allocations.freed};
        const uint64_t g[4] = {s->oversize_segments.current, s->oversize_segments.peak,
                               s->oversize_segments.allocated, s->oversize_segments.freed};
        snprintf(kv[n].key, sizeof kv[n].key, "oversize_allocations.%s", fields[f]);
        kv[n++].val = (long long)a[f];
        snprintf(kv[n].key, sizeof kv[n].key, "oversize_segments.%s", fields[f]);
        kv[n++].val = (long long)g[f];
    }
#define MN_RP_KV(k, v) (snprintf(kv[n].key, sizeof kv[n].key, "%s", k), kv[n++].val = (long long)(v))
    MN_RP_KV("num_alloc_retries", s->num_alloc_retries);
    MN_RP_KV("num_ooms", s->num_ooms);
    MN_RP_KV("num_sync_all_streams", s->num_sync_all_streams);
    MN_RP_KV("num_device_alloc", s->num_device_alloc);
    MN_RP_KV("num_device_free", s->num_device_free);
    MN_RP_KV("max_split_size", s->max_split_size == UINT64_MAX ? -1 : (long long)s->max_split_size);
#undef MN_RP_KV
    qsort(kv, n, sizeof kv[0], mn_rp_kv_cmp);
    printf("{");
    for (i = 0; i < n; i++) printf("%s\"%s\": %lld", i ? ", " : "", kv[i].key, kv[i].val);
    printf(", \"peak_reserved_over_peak_allocated\": %.6f, \"replay.allocations\": %llu, "
           "\"replay.frees\": %llu, \"replay.unmatched_frees\": %llu}\n", ratio,
           (unsigned long long)allocs, (unsigned long long)frees, (unsigned long long)unmatched);
}

static void mn_rp_log(void *ud, mn_log_level level, const char *msg) {
    (void)ud;
    if (level == MN_LOG_ERROR) fprintf(stderr, "memanat replay: %s\n", msg);
}

static int mn_cli_replay(int argc, char **argv) {
    const char *file = NULL, *config = NULL, *svg = NULL;
    uint64_t capacity = 0, allocs = 0, frees = 0, unmatched = 0;
    int json = 0, i = 0, rc = 1;
    char *text = NULL;
    size_t len = 0, k;
    mn_rp_trace t;
    mn_rp_map m;
    mn_simdev dev;
    mn_simdev_desc dd;
    mn_cache cache;
    mn_cache_desc cd;
    struct mn_cache_stats st;
    FILE *f;
    mn_result r;
    memset(&t, 0, sizeof t);
    memset(&m, 0, sizeof m);
    // argv holds the arguments after "replay"; tolerate the command word itself in front
    if (argc > 0 && strcmp(argv[0], "replay") == 0) i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--json") == 0) json = 1;
        else if (strcmp(a, "--config") == 0 && i + 1 < argc) config = argv[++i];
        else if (strcmp(a, "--svg") == 0 && i + 1 < argc) svg = argv[++i];
        else if (strcmp(a, "--capacity") == 0 && i + 1 < argc) {
            if (mn_size_parse(argv[++i], &capacity) != MN_OK || capacity == 0) {
                fprintf(stderr, "memanat replay: bad --capacity '%s' (want a size such as 80GiB)\n",
                        argv[i]);
                return 2;
            }
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: memanat replay FILE [--config STR] [--capacity SIZE] [--json] "
                   "[--svg OUT]\n  FILE: RMM log CSV or PyTorch snapshot JSON\n");
            return 0;
        } else if (a[0] == '-' && a[1] != 0) {
            fprintf(stderr, "memanat replay: unknown or incomplete option '%s'\n", a);
            return 2;
        } else if (!file) file = a;
        else {
            fprintf(stderr, "memanat replay: more than one trace file ('%s')\n", a);
            return 2;
        }
    }
    if (!file) {
        fprintf(stderr, "memanat replay: missing trace FILE (usage: memanat replay FILE "
                "[--config STR] [--capacity SIZE] [--json] [--svg OUT])\n");
        return 2;
    }
    if (!config) config = getenv("PYTORCH_CUDA_ALLOC_CONF");
    if (!config) config = getenv("PYTORCH_ALLOC_CONF");
    // read the whole file
    f = fopen(file, "rb");
    if (!f) {
        fprintf(stderr, "memanat replay: cannot open '%s'\n", file);
        return 1;
    }
    for (;;) {
        size_t cap = len ? len * 2 : 1 << 16, got;
        char *nt = (char *)realloc(text, cap + 1);
        if (!nt) {
            fprintf(stderr, "memanat replay: out of memory reading '%s'\n", file);
            goto fail_read;
        }
        text = nt;
        got = fread(text + len, 1, cap - len, f);
        len += got;
        if (len < cap) break;
    }
    if (ferror(f)) {
        fprintf(stderr, "memanat replay: cannot read '%s'\n", file);
        goto fail_read;
    }
    fclose(f);
    f = NULL;
    text[len] = 0;
    for (k = 0; k < len && (text[k] == ' ' || text[k] == '\n' || text[k] == '\r' || text[k] == '\t');)
        k++;
    if (k < len && text[k] == '{') {
        if (!mn_rp_read_snapshot(text, len, file, &t)) goto fail_parse;
    } else if (!mn_rp_read_csv(text, len, file, &t)) {
        goto fail_parse;
    }
    free(text);
    text = NULL;
    // the device and the allocator
    memset(&dd, 0, sizeof dd);
    dd.capacity = capacity;
    dd.events_complete = 1;
    if (mn_simdev_init(&dev, &dd) != MN_OK) goto fail_parse;
    memset(&cd, 0, sizeof cd);
    cd.device = mn_simdev_device(&dev);
    cd.config = config;
    cd.logger.log_fn = mn_rp_log;
    if (svg) cd.trace_entries = t.n * 2 + 64 < (1u << 22) ? (uint32_t)(t.n * 2 + 64) : (1u << 22);
    r = mn_cache_init(&cache, &cd);
    if (r != MN_OK) {
        if (r != MN_ERR_CONFIG && r != MN_ERR_UNSUPPORTED)
            fprintf(stderr, "memanat replay: cannot start the allocator: %s\n", mn_result_str(r));
        goto fail_dev;
    }
    m.cap = 1024;
    while (m.cap < t.n * 2 + 2) m.cap *= 2;
    m.key = (uint64_t *)calloc(m.cap, sizeof *m.key);
    m.val = (void **)calloc(m.cap, sizeof *m.val);
    if (!m.key || !m.val) {
        fprintf(stderr, "memanat replay: out of memory\n");
        goto fail_cache;
    }
    for (k = 0; k < t.n; k++) {
        const mn_rp_event *e = &t.ev[k];
        size_t h;
        if (e->key == 0) continue;  // a null pointer: nothing to allocate or free
        h = mn_rp_slot(&m, e->key);
        if (e->is_alloc) {
            void *p = NULL;
            allocs++;
            if (m.key[h]) {  // the trace reuses a live pointer: the old one was freed unlogged
                (void)mn_cache_release(&cache, m.val[h]);
                m.key[h] = 0;
                h = mn_rp_slot(&m, e->key);
            }
            r = mn_cache_alloc(&cache, e->size, e->stream, e->cat, NULL, &p);
            if (r == MN_ERR_DEVICE_OOM) continue;  // counted in num_ooms; its free is skipped
            if (r != MN_OK) {
                fprintf(stderr, "memanat replay: event %zu: %s\n", k, mn_result_str(r));
                goto fail_cache;
            }
            if (!p) continue;  // size 0
            m.key[h] = e->key;
            m.val[h] = p;
        } else {
            size_t j, g;
            frees++;
            if (!m.key[h]) {
                unmatched++;
                continue;
            }
            if (mn_cache_release(&cache, m.val[h]) != MN_OK) unmatched++;
            // remove with backward shift
            m.key[h] = 0;
            for (j = (h + 1) & (m.cap - 1); m.key[j]; j = (j + 1) & (m.cap - 1)) {
                uint64_t kk = m.key[j];
                void *vv = m.val[j];
                m.key[j] = 0;
                g = mn_rp_slot(&m, kk);
                m.key[g] = kk;
                m.val[g] = vv;
            }
        }
    }
    mn_cache_stats(&cache, &st);
    {
        double ratio = st.allocated_bytes[MN_STAT_ALL].peak
                           ? (double)st.reserved_bytes[MN_STAT_ALL].peak /
                                 (double)st.allocated_bytes[MN_STAT_ALL].peak
                           : 0.0;
        char pa[32], pr[32];
        if (json) {
            mn_rp_print_json(&st, ratio, allocs, frees, unmatched);
        } else {
            mn_size_format(st.allocated_bytes[MN_STAT_ALL].peak, pa, sizeof pa);
            mn_size_format(st.reserved_bytes[MN_STAT_ALL].peak, pr, sizeof pr);
            printf("memanat replay: %s: %llu allocations, %llu frees (%llu unmatched), %llu rows "
                   "skipped, %u streams\n", file, (unsigned long long)allocs,
                   (unsigned long long)frees, (unsigned long long)unmatched,
                   (unsigned long long)t.skipped, t.nstreams ? t.nstreams : 1);
            printf("config: %s; device capacity: ", config && config[0] ? config : "(defaults)");
            if (capacity) {
                char cs[32];
                mn_size_format(capacity, cs, sizeof cs);
                printf("%s\n", cs);
            } else {
                printf("unlimited\n");
            }
            mn_cache_summary_write(&st, 0, 0, mn_rp_write_file, stdout);
            if (st.cat_allocation[MN_CAT_OTHER].allocated != st.allocation[MN_STAT_ALL].allocated)
                mn_cache_category_summary_write(&st, mn_rp_write_file, stdout);  // has categories
            printf("peak allocated: %llu B (%s)\n",
                   (unsigned long long)st.allocated_bytes[MN_STAT_ALL].peak, pa);
            printf("peak reserved:  %llu B (%s)\n",
                   (unsigned long long)st.reserved_bytes[MN_STAT_ALL].peak, pr);
            printf("peak reserved / peak allocated: %.4f\n", ratio);
            printf("out-of-memory failures: %llu, device allocations: %llu, cache flushes: %llu\n",
                   (unsigned long long)st.num_ooms, (unsigned long long)st.num_device_alloc,
                   (unsigned long long)st.num_alloc_retries);
            if (st.num_ooms) {
                char msg[1024];
                mn_cache_oom_message(&cache, msg, sizeof msg);
                printf("last OOM: %s\n", msg);
            }
        }
    }
    if (svg) {
        mn_cache_snapshot snap;
        FILE *out;
        if (mn_cache_snapshot_take(&cache, &snap) != MN_OK) {
            fprintf(stderr, "memanat replay: out of memory taking the snapshot\n");
            goto fail_cache;
        }
        out = fopen(svg, "wb");
        if (!out) {
            fprintf(stderr, "memanat replay: cannot write '%s'\n", svg);
            mn_cache_snapshot_free(&snap);
            goto fail_cache;
        }
        r = mn_cache_timeline_svg(&snap, file, mn_rp_write_file, out);
        mn_cache_snapshot_free(&snap);
        if (fclose(out) != 0 || r != MN_OK) {
            fprintf(stderr, "memanat replay: cannot write '%s'\n", svg);
            goto fail_cache;
        }
    }
    rc = 0;
fail_cache:
    free(m.key);
    free(m.val);
    mn_cache_free(&cache);
fail_dev:
    mn_simdev_free(&dev);
fail_parse:
    free(t.ev);
    free(text);
    return rc;
fail_read:
    fclose(f);
    free(text);
    return 1;
}
