// Fuzz driver for every parser of untrusted input, one target each:
//   json         mn_json_parse (and the escaping helper read back)
//   safetensors  mn_safetensors_parse, the input as a file and as a header
//   config       mn_hf_config_parse, and the parameter count of an accepted model
//   index        mn_safetensors_read_dir with the input as model.safetensors.index.json
//   snapshot     the CLI's PyTorch snapshot JSON reader (memanat replay)
//   csv          the CLI's RMM log CSV reader (memanat replay), through a memory stream
//   allocconf    mn_cache_config_parse (PYTORCH_CUDA_ALLOC_CONF), then an allocator built on it
//   size         mn_size_parse and the CLI's count parser (--capacity, --params, --batch)
//   lengths      mn_seq_dist_parse (--seq-lengths FILE) and mn_seq_dist_range (MIN:MAX:MEAN)
// No libFuzzer needed:
//
//     ./build/fuzz [--seconds N] [--seed S] [--target NAME|all] DIR
//
// loads the files of DIR/NAME as seeds (make fuzz: test/fuzz/corpus), mutates them (bit flips,
// interesting bytes and tokens, inserts, deletes, duplications, splices, truncation,
// length-prefix rewrites) and runs the target on each input for N seconds (each target for N
// seconds with "all"). Inputs a target accepts join the pool, so mutations reach deeper. The
// library's readers get a counting allocator that also fails at random: a leak, a double free or
// a result other than success / the documented error codes aborts; crashes abort through the
// sanitizers. Prints executions per second and exits 0 when nothing went wrong.
//
// With clang -fsanitize=fuzzer -DMN_LIBFUZZER -DMN_FUZZ_TARGET=\"json\" the same checks run as
// LLVMFuzzerTestOneInput.
#if !defined(_WIN32)
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <unistd.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// The CLI's readers (replay's CSV and snapshot JSON, the count parser) with the library
// instantiated inside it; its main becomes an ordinary function.
#define main memanat_cli_main
#include "../../memanat.c"
#undef main

// ---- counting allocator with random failures ---------------------------------------------------

typedef struct fz_alloc {
    long live;
    uint64_t rng;
    uint32_t fail_one_in;  // 0 = never fail
} fz_alloc;

static uint64_t fz_next(uint64_t *s) {  // splitmix64
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void *fz_malloc(void *user, size_t n) {
    fz_alloc *a = (fz_alloc *)user;
    void *p;
    if (a->fail_one_in && fz_next(&a->rng) % a->fail_one_in == 0) return NULL;
    p = malloc(n ? n : 1);
    if (p) a->live++;
    return p;
}

static void fz_free(void *user, void *p) {
    fz_alloc *a = (fz_alloc *)user;
    if (!p) return;
    a->live--;
    free(p);
}

static void fz_die(const char *what, const uint8_t *data, size_t len) {
    FILE *f = fopen("fuzz-crash.bin", "wb");
    if (f) {
        fwrite(data, 1, len, f);
        fclose(f);
    }
    printf("fuzz: %s (input saved to fuzz-crash.bin, %zu bytes)\n", what, len);
    fflush(stdout);
    abort();
}

// ---- checks on what the readers return ---------------------------------------------------------

static volatile uint64_t fz_sink;

// Touches every value of a tree and checks its invariants.
static void fz_walk(const mn_json_value *v, int depth, const uint8_t *data, size_t len) {
    uint32_t k;
    uint64_t u;
    double f;
    if (depth > 4096) fz_die("tree deeper than the limit", data, len);
    switch (v->type) {
    case MN_JSON_NULL: case MN_JSON_TRUE: case MN_JSON_FALSE: break;
    case MN_JSON_NUMBER:
        if (!v->str || !v->str[0]) fz_die("number without literal", data, len);
        if (mn_json_f64(v, &f) != MN_OK || f != f) fz_die("number is not a number", data, len);
        if (mn_json_u64(v, &u) == MN_OK) fz_sink += u;
        break;
    case MN_JSON_STRING:
        if (!v->str || v->str[v->len] != 0) fz_die("string not terminated", data, len);
        fz_sink += (unsigned char)v->str[0];
        break;
    case MN_JSON_ARRAY:
        for (k = 0; k < v->len; k++) fz_walk(&v->items[k], depth + 1, data, len);
        break;
    case MN_JSON_OBJECT:
        for (k = 0; k < v->len; k++) {
            if (v->items[2 * k].type != MN_JSON_STRING) fz_die("key is not a string", data, len);
            fz_walk(&v->items[2 * k + 1], depth + 1, data, len);
            if (strlen(v->items[2 * k].str) == v->items[2 * k].len &&
                mn_json_get(v, v->items[2 * k].str) != &v->items[2 * k + 1])
                fz_die("mn_json_get finds another member", data, len);
        }
        break;
    default: fz_die("invalid value type", data, len);
    }
}

static void fz_check_alloc(fz_alloc *a, mn_result r, const uint8_t *data, size_t len,
                           const char *who) {
    char msg[96];
    if (a->live != 0) {
        snprintf(msg, sizeof msg, "%s leaked %ld allocations (result %d)", who, a->live, (int)r);
        fz_die(msg, data, len);
    }
    if (r > 0 || r < MN_ERR_STATE) {
        snprintf(msg, sizeof msg, "%s returned %d", who, (int)r);
        fz_die(msg, data, len);
    }
}

typedef struct fz_stats {
    uint64_t execs, accepted, oom;
} fz_stats;

// The largest data_offsets end in a header-like object (0 when none), so that a mutated header
// can be given a data section of the size it describes.
static uint64_t fz_data_end(const mn_json_value *root) {
    uint64_t best = 0, e;
    uint32_t k;
    if (!root || root->type != MN_JSON_OBJECT) return 0;
    for (k = 0; k < root->len; k++) {
        const mn_json_value *o = mn_json_get(&root->items[2 * k + 1], "data_offsets");
        if (o && o->type == MN_JSON_ARRAY && o->len == 2 &&
            mn_json_u64(&o->items[1], &e) == MN_OK && e > best && e < (1u << 20))
            best = e;
    }
    return best;
}

// ---- targets: each returns 1 when its parser accepted the input ---------------------------------

typedef struct fz_ctx {
    fz_alloc a;
    mn_allocator al;
    uint64_t seed;
    fz_stats *st;
} fz_ctx;

static void fz_ctx_init(fz_ctx *c, uint64_t seed, fz_stats *st) {
    memset(c, 0, sizeof *c);
    c->a.rng = seed;
    c->a.fail_one_in = seed % 8 == 0 ? 3 : 0;  // one run in eight with failing allocations
    c->al.alloc_fn = fz_malloc, c->al.free_fn = fz_free, c->al.user_data = &c->a;
    c->seed = seed, c->st = st;
}

static int fz_json(const uint8_t *data, size_t len, fz_ctx *c) {
    mn_json_desc jd;
    mn_json_doc doc;
    mn_result r;
    int ok = 0;
    memset(&jd, 0, sizeof jd);
    jd.allocator = c->al;
    jd.max_depth = (uint32_t)(c->seed >> 8) % 4 == 0 ? 8 : 0;
    r = mn_json_parse((const char *)data, len, &jd, &doc);
    if (r == MN_OK) {
        fz_walk(doc.root, 0, data, len);
        ok = 1;
        if (doc.root->type == MN_JSON_STRING && strlen(doc.root->str) == doc.root->len) {
            // escaping and reading back gives the same bytes
            size_t n = mn_json_escape(NULL, 0, doc.root->str);
            char *buf = (char *)malloc(n + 1);
            mn_json_doc back;
            mn_json_escape(buf, n + 1, doc.root->str);
            if (mn_json_parse(buf, n, NULL, &back) != MN_OK || back.root->len != doc.root->len ||
                memcmp(back.root->str, doc.root->str, doc.root->len) != 0)
                fz_die("escape round trip differs", data, len);
            mn_json_free(&back);
            free(buf);
        }
    } else if (r != MN_ERR_PARSE && r != MN_ERR_OUT_OF_MEMORY) {
        fz_die("mn_json_parse: unexpected result", data, len);
    } else if (r == MN_ERR_PARSE && !doc.error[0]) {
        fz_die("mn_json_parse: error without a message", data, len);
    }
    if (r == MN_ERR_OUT_OF_MEMORY) c->st->oom++;
    mn_json_free(&doc);
    {
        // any bytes, escaped, read back as a JSON string
        char *text = (char *)malloc(len + 1), *esc;
        size_t n;
        mn_json_doc back;
        if (len) memcpy(text, data, len);
        text[len] = 0;
        n = mn_json_escape(NULL, 0, text);
        esc = (char *)malloc(n + 1);
        if (mn_json_escape(esc, n + 1, text) != n || strlen(esc) != n ||
            mn_json_parse(esc, n, NULL, &back) != MN_OK || back.root->type != MN_JSON_STRING)
            fz_die("escaped bytes do not read back as a JSON string", data, len);
        mn_json_free(&back);
        free(esc);
        free(text);
    }
    fz_check_alloc(&c->a, r, data, len, "mn_json_parse");
    return ok;
}

static int fz_safetensors(const uint8_t *data, size_t len, fz_ctx *c) {
    mn_safetensors_desc sd;
    mn_safetensors_info info;
    mn_json_doc doc;
    mn_result r;
    uint64_t k, data_end = 0;
    uint8_t *wrapped;
    int ok = 0;
    if (mn_json_parse((const char *)data, len, NULL, &doc) == MN_OK)
        data_end = fz_data_end(doc.root);
    mn_json_free(&doc);
    memset(&sd, 0, sizeof sd);
    sd.allocator = c->al;
    sd.keep_tensors = (int)(c->seed >> 16) & 1;
    r = mn_safetensors_parse(data, len, 0, &sd, &info);  // the input as a whole file
    if (r == MN_OK) {
        ok = 1;
        if (info.tensor) {
            for (k = 0; k < info.tensors; k++)
                fz_sink += info.tensor[k].elements + (unsigned char)info.tensor[k].name[0];
        }
        if (info.data_bytes + info.header_bytes + 8 != len) fz_die("safetensors sizes", data, len);
    }
    mn_safetensors_free(&info);
    fz_check_alloc(&c->a, r, data, len, "mn_safetensors_parse");
    // the input as the header of a file with a data section of plausible size
    wrapped = (uint8_t *)malloc(len + 8);
    for (k = 0; k < 8; k++) wrapped[k] = (uint8_t)((uint64_t)len >> (8 * k));
    if (len) memcpy(wrapped + 8, data, len);
    r = mn_safetensors_parse(wrapped, len + 8,
                             len + 8 + ((c->seed >> 20) % 8 == 0 ? (c->seed >> 24) % 4096
                                                                 : data_end),
                             &sd, &info);
    if (r == MN_OK) ok = 1;
    mn_safetensors_free(&info);
    free(wrapped);
    fz_check_alloc(&c->a, r, data, len, "mn_safetensors_parse (wrapped)");
    return ok;
}

static int fz_config(const uint8_t *data, size_t len, fz_ctx *c) {
    mn_hf_desc hd;
    mn_model m;
    mn_result r;
    uint64_t n = 0;
    memset(&hd, 0, sizeof hd);
    hd.allocator = c->al;
    r = mn_hf_config_parse((const char *)data, len, &hd, &m);
    fz_check_alloc(&c->a, r, data, len, "mn_hf_config_parse");
    if (r != MN_OK) return 0;
    if (m.layers == 0 || m.hidden == 0 || m.heads == 0 || m.kv_heads == 0 || m.vocab == 0 ||
        m.heads % m.kv_heads != 0)
        fz_die("config accepted with an impossible shape", data, len);
    if (m.layers <= 64 && m.hidden <= 4096) {  // the count of an accepted model, checked
        r = mn_model_params(&m, &n);
        if (r != MN_OK && r != MN_ERR_INVALID_ARG && r != MN_ERR_OVERFLOW &&
            r != MN_ERR_UNSUPPORTED)
            fz_die("mn_model_params: unexpected result", data, len);
    }
    return 1;
}

// index: the input is model.safetensors.index.json in a folder whose two shards (copies of a
// seed safetensors file) are the ones the seed index names.
static char fz_dir[64];

static int fz_index(const uint8_t *data, size_t len, fz_ctx *c) {
    mn_safetensors_desc sd;
    mn_safetensors_info info;
    char path[128];
    FILE *f;
    mn_result r;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", fz_dir);
    if (!(f = fopen(path, "wb"))) fz_die("cannot write the index", data, len);
    if (len) fwrite(data, 1, len, f);
    fclose(f);
    memset(&sd, 0, sizeof sd);
    sd.allocator = c->al;
    r = mn_safetensors_read_dir(fz_dir, &sd, &info);
    mn_safetensors_free(&info);
    if (r != MN_OK && r != MN_ERR_PARSE && r != MN_ERR_IO && r != MN_ERR_OUT_OF_MEMORY &&
        r != MN_ERR_OVERFLOW && r != MN_ERR_NOT_FOUND)
        fz_die("mn_safetensors_read_dir: unexpected result", data, len);
    fz_check_alloc(&c->a, r, data, len, "mn_safetensors_read_dir");
    return r == MN_OK;
}

static int fz_snapshot(const uint8_t *data, size_t len, fz_ctx *c) {
    trace t;
    char *text = (char *)malloc(len + 1);
    int rc;
    (void)c;
    if (len) memcpy(text, data, len);
    text[len] = 0;
    memset(&t, 0, sizeof t);
    t.file = "fuzz";
    rc = read_snapshot(text, len, &t);
    if (rc != 0 && rc != 2) fz_die("snapshot reader: exit status other than 0 or 2", data, len);
    if (!rc) {
        size_t i;
        for (i = 0; i < t.n; i++)
            if (t.ev[i].alloc && t.ev[i].size >= TRACE_ONE_EXA)
                fz_die("snapshot reader kept an allocation of 1 EiB", data, len);
    }
    free(t.ev);
    free(text);
    return rc == 0;
}

static int fz_csv(const uint8_t *data, size_t len, fz_ctx *c) {
    trace t;
    FILE *f;
    int rc;
    (void)c;
    if (len == 0) return 0;  // fmemopen of nothing is not portable
    f = fmemopen((void *)(uintptr_t)data, len, "rb");
    if (!f) return 0;
    memset(&t, 0, sizeof t);
    t.file = "fuzz";
    rc = read_csv(f, 0, &t);
    fclose(f);
    if (rc != 0 && rc != 2) fz_die("CSV reader: exit status other than 0 or 2", data, len);
    if (!rc) {  // what was kept replays through an allocator without an error of its own
        mn_sim_cache sc;
        mn_replay_counts n;
        mn_result r;
        size_t i;
        for (i = 0; i < t.n; i++)
            if (t.ev[i].alloc && t.ev[i].size >= TRACE_ONE_EXA)
                fz_die("CSV reader kept an allocation of 1 EiB", data, len);
        if (mn_sim_cache_init(&sc, NULL, NULL) == MN_OK) {
            r = mn_cache_replay(&sc.cache, t.ev, t.n, 1, &n);
            if (r != MN_OK && r != MN_ERR_OUT_OF_MEMORY)
                fz_die("replay of a read trace", data, len);
            if (mn_cache_check(&sc.cache) != MN_OK)
                fz_die("allocator check after replay", data, len);
            mn_sim_cache_free(&sc);
        }
    }
    free(t.ev);
    return rc == 0;
}

static int fz_allocconf(const uint8_t *data, size_t len, fz_ctx *c) {
    char *text = (char *)malloc(len + 1);
    mn_cache_config cfg;
    mn_result r;
    int ok;
    if (len) memcpy(text, data, len);
    text[len] = 0;
    r = mn_cache_config_parse(text, &cfg, NULL);
    if (r != MN_OK && r != MN_ERR_CONFIG && r != MN_ERR_INVALID_ARG)
        fz_die("mn_cache_config_parse: unexpected result", data, len);
    ok = r == MN_OK;
    if (ok && strlen(text) == len) {  // an allocator on it serves a few sizes and stays sound
        mn_sim_cache sc;
        mn_cache_desc cd;
        void *p[8];
        int k;
        memset(&cd, 0, sizeof cd);
        cd.config = text, cd.allocator = c->al;
        r = mn_sim_cache_init(&sc, NULL, &cd);
        if (r == MN_OK) {
            for (k = 0; k < 8; k++) {
                uint64_t sz = (uint64_t)1 << (fz_next(&c->seed) % 27);
                if (mn_cache_alloc(&sc.cache, sz, 0, MN_CAT_OTHER, NULL, &p[k]) != MN_OK) p[k] = 0;
            }
            for (k = 0; k < 8; k += 2) mn_cache_release(&sc.cache, p[k]);
            if (mn_cache_check(&sc.cache) != MN_OK) fz_die("allocator check", data, len);
            mn_sim_cache_free(&sc);
        } else if (r != MN_ERR_OUT_OF_MEMORY) {
            fz_die("an accepted config string refused by the allocator", data, len);
        }
        fz_check_alloc(&c->a, r, data, len, "mn_sim_cache_init");
    }
    free(text);
    return ok && !memchr(data, 0, len);  // a NUL ends the string: not a new input
}

static int fz_size(const uint8_t *data, size_t len, fz_ctx *c) {
    char *text = (char *)malloc(len + 1), buf[32];
    uint64_t v = 0, n = 0;
    int ok = 0;
    (void)c;
    if (len) memcpy(text, data, len);
    text[len] = 0;
    if (mn_size_parse(text, &v) == MN_OK) {
        ok = 1;
        mn_size_format(v, buf, sizeof buf);
        if (!buf[0] || strlen(buf) >= sizeof buf) fz_die("mn_size_format", data, len);
    }
    if (parse_count(text, 1, 1000000000000000000ull, &n)) {
        ok = 1;
        if (n < 1 || n > 1000000000000000000ull) fz_die("parse_count out of its range", data, len);
    }
    free(text);
    return ok && !memchr(data, 0, len);
}

// lengths: a sequence-lengths file (sorted distinct lengths, positive counts) or a clean
// refusal; the same text as a MIN:MAX:MEAN range.
static int fz_lengths(const uint8_t *data, size_t len, fz_ctx *c) {
    mn_seq_dist sq;
    char *text = (char *)malloc(len + 1);
    mn_result r;
    uint64_t k;
    int ok = 0;
    r = mn_seq_dist_parse((const char *)data, len, &c->al, NULL, &sq);
    if (r == MN_OK) {
        ok = 1;
        for (k = 0; k < sq.n; k++)
            if (sq.count[k] == 0 || sq.len[k] == 0 || (k && sq.len[k] <= sq.len[k - 1]))
                fz_die("lengths accepted out of order or empty", data, len);
        if (sq.n == 0) fz_die("lengths accepted with no entry", data, len);
    } else if (r != MN_ERR_PARSE && r != MN_ERR_INVALID_ARG && r != MN_ERR_OUT_OF_MEMORY) {
        fz_die("mn_seq_dist_parse: unexpected result", data, len);
    }
    if (r == MN_ERR_OUT_OF_MEMORY) c->st->oom++;
    mn_seq_dist_free(&c->al, &sq);
    fz_check_alloc(&c->a, r, data, len, "mn_seq_dist_parse");
    if (len) memcpy(text, data, len);
    text[len] = 0;
    r = mn_seq_dist_range(text, NULL, &sq);
    if (r == MN_OK && (sq.min < 1 || sq.max < sq.min || !(sq.mean >= (double)sq.min) ||
                       !(sq.mean <= (double)sq.max)))
        fz_die("a range accepted out of order", data, len);
    free(text);
    return ok;
}

typedef struct fz_target {
    const char *name;
    int (*fn)(const uint8_t *data, size_t len, fz_ctx *c);
} fz_target;

static const fz_target fz_targets[] = {
    {"json", fz_json}, {"safetensors", fz_safetensors}, {"config", fz_config},
    {"index", fz_index}, {"snapshot", fz_snapshot}, {"csv", fz_csv},
    {"allocconf", fz_allocconf}, {"size", fz_size}, {"lengths", fz_lengths},
};
#define FZ_NTARGETS (sizeof fz_targets / sizeof fz_targets[0])

static int fz_one(const fz_target *t, const uint8_t *data, size_t len, uint64_t seed,
                  fz_stats *st) {
    fz_ctx c;
    int ok;
    fz_ctx_init(&c, seed, st);
    ok = t->fn(data, len, &c);
    if (c.a.live != 0) fz_die("a reader leaked an allocation", data, len);
    st->execs++;
    st->accepted += (uint64_t)ok;
    return ok;
}

// The index target's folder: two shards the seed index names (empty safetensors files).
static int fz_index_setup(void) {
    static const uint8_t empty[] = {2, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    const char *names[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    int k;
    snprintf(fz_dir, sizeof fz_dir, "/tmp/memanat_fuzz_XXXXXX");
    if (!mkdtemp(fz_dir)) return 0;
    for (k = 0; k < 2; k++) {
        char path[160];
        FILE *f;
        snprintf(path, sizeof path, "%s/%s", fz_dir, names[k]);
        if (!(f = fopen(path, "wb"))) return 0;
        fwrite(empty, 1, sizeof empty, f);
        fclose(f);
    }
    return 1;
}

static void fz_index_cleanup(void) {
    char path[160];
    const char *names[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json"};
    int k;
    for (k = 0; k < 3; k++) {
        snprintf(path, sizeof path, "%s/%s", fz_dir, names[k]);
        remove(path);
    }
    rmdir(fz_dir);
}

#ifdef MN_LIBFUZZER
#ifndef MN_FUZZ_TARGET
#define MN_FUZZ_TARGET "json"
#endif
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fz_stats st;
    static uint64_t seed = 1;
    size_t k;
    if (!fz_dir[0] && !fz_index_setup()) abort();
    for (k = 0; k < FZ_NTARGETS; k++)
        if (strcmp(fz_targets[k].name, MN_FUZZ_TARGET) == 0)
            fz_one(&fz_targets[k], data, size, fz_next(&seed), &st);
    return 0;
}
#else

// ---- mutation ----------------------------------------------------------------------------------

#define FZ_MAX_LEN 65536
#define FZ_MAX_POOL 4096

typedef struct fz_input {
    uint8_t *data;
    size_t len;
    int kind;  // FZ_* bits of the readers that accept it
} fz_input;

static const char *const fz_tokens[] = {
    "\"", "\\", "{", "}", "[", "]", ",", ":", "null", "true", "false", "-", "0", "-0", "1e999",
    "1e-999", "18446744073709551615", "18446744073709551616", "9007199254740993", "-1", "2.5",
    "4294967296", "\\u", "\\ud800", "\\udc00", "\\ud83d\\ude00", "\\u0000", "\xc3\xa9",
    "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xc0\x80", "\xff", "\x00",
    "\"model_type\":\"llama\",", "\"model_type\":\"t5\",", "\"num_hidden_layers\":",
    "\"hidden_size\":", "\"num_key_value_heads\":", "\"head_dim\":", "\"dtype\":\"F32\",",
    "\"dtype\":\"BF16\",", "\"shape\":[", "\"data_offsets\":[", "\"__metadata__\":",
    "\"architectures\":[\"BertForSequenceClassification\"],",
    "\"feed_forward_proj\":\"gated-gelu\",", "[[[[[[[[[[[[[[[[", "]]]]]]]]]]]]]]]]",
    "{\"a\":{\"a\":{\"a\":", "\"a\":1,\"a\":2", " ", "\n", "/*",
    "NaN", "Infinity", "1.", ".5", "01", "1e", "\"\\x\"",
};

static size_t fz_rand(uint64_t *s, size_t n) { return n ? (size_t)(fz_next(s) % n) : 0; }

// Applies one mutation in place; buf has room for FZ_MAX_LEN bytes.
static size_t fz_mutate(uint8_t *buf, size_t len, uint64_t *s, const fz_input *pool, size_t npool) {
    size_t pos = fz_rand(s, len + 1), n, k;
    switch (fz_rand(s, 11)) {
    case 0:  // bit flip
        if (len) buf[fz_rand(s, len)] ^= (uint8_t)(1u << fz_rand(s, 8));
        break;
    case 1:  // random byte
        if (len) buf[fz_rand(s, len)] = (uint8_t)fz_next(s);
        break;
    case 2: case 3: {  // insert a token
        const char *t = fz_tokens[fz_rand(s, sizeof fz_tokens / sizeof fz_tokens[0])];
        n = strlen(t);
        if (n == 0) n = 1;  // "\x00" is one NUL byte
        if (len + n > FZ_MAX_LEN) break;
        memmove(buf + pos + n, buf + pos, len - pos);
        memcpy(buf + pos, t, n);
        len += n;
        break;
    }
    case 4: {  // overwrite with a token
        const char *t = fz_tokens[fz_rand(s, sizeof fz_tokens / sizeof fz_tokens[0])];
        n = strlen(t);
        for (k = 0; k < n && pos + k < len; k++) buf[pos + k] = (uint8_t)t[k];
        break;
    }
    case 5:  // delete a range
        if (len) {
            n = 1 + fz_rand(s, len - pos < 16 ? len - pos : 16);
            if (pos + n > len) n = len - pos;
            memmove(buf + pos, buf + pos + n, len - pos - n);
            len -= n;
        }
        break;
    case 6: {  // duplicate a range
        size_t from = fz_rand(s, len);
        n = 1 + fz_rand(s, 64);
        if (from + n > len) n = len - from;
        if (len + n > FZ_MAX_LEN || n == 0) break;
        memmove(buf + pos + n, buf + pos, len - pos);
        memmove(buf + pos, buf + (from >= pos ? from + n : from), n);
        len += n;
        break;
    }
    case 7: {  // splice: our head, another input's tail
        const fz_input *o = &pool[fz_rand(s, npool)];
        size_t from = fz_rand(s, o->len + 1);
        n = o->len - from;
        if (pos + n > FZ_MAX_LEN) n = FZ_MAX_LEN - pos;
        memcpy(buf + pos, o->data + from, n);
        len = pos + n;
        break;
    }
    case 8:  // truncate
        len = pos;
        break;
    case 9:  // rewrite the safetensors length prefix
        if (len >= 8) {
            static const uint64_t v[] = {0, 1, 2, 7, 8, 100000000, 100000001, 0x7fffffffffffffffull,
                                         0xffffffffffffffffull, 1ull << 32};
            uint64_t x = fz_rand(s, 2) ? v[fz_rand(s, sizeof v / sizeof v[0])]
                                       : (uint64_t)len - 8 - fz_rand(s, 16);
            for (k = 0; k < 8; k++) buf[k] = (uint8_t)(x >> (8 * k));
        }
        break;
    default: {  // a digit run turned into an interesting number
        static const char *const nums[] = {"0", "1", "4096", "100000000", "18446744073709551615",
                                           "99999999999999999999", "-1", "1e3", "3.0"};
        const char *t = nums[fz_rand(s, sizeof nums / sizeof nums[0])];
        size_t end = pos;
        while (end < len && buf[end] >= '0' && buf[end] <= '9') end++;
        n = strlen(t);
        if (len - (end - pos) + n > FZ_MAX_LEN) break;
        memmove(buf + pos + n, buf + end, len - end);
        memcpy(buf + pos, t, n);
        len = len - (end - pos) + n;
        break;
    }
    }
    return len;
}

// Adds an input to the pool; a full pool replaces an entry other than the first keep (the seeds).
static void fz_add(fz_input *pool, size_t *npool, size_t keep, const uint8_t *data, size_t len,
                   int kind, uint64_t *s) {
    uint8_t *copy;
    size_t at = *npool;
    if (len > FZ_MAX_LEN) return;
    if (at >= FZ_MAX_POOL) {
        if (keep >= FZ_MAX_POOL) return;
        at = keep + fz_rand(s, FZ_MAX_POOL - keep);
    }
    copy = (uint8_t *)malloc(len ? len : 1);
    if (!copy) return;
    if (len) memcpy(copy, data, len);
    if (at < *npool) free(pool[at].data);
    else (*npool)++;
    pool[at].data = copy, pool[at].len = len, pool[at].kind = kind;
}

// A base input: half the picks among the inputs the target accepted, when there are any.
static const fz_input *fz_pick(const fz_input *pool, size_t npool, uint64_t *s) {
    size_t k, at = fz_rand(s, npool);
    for (k = 0; k < 32 && fz_rand(s, 2); k++) {
        size_t i = fz_rand(s, npool);
        if (pool[i].kind) return &pool[i];
    }
    return &pool[at];
}

static int fz_load(const char *dir, fz_input *pool, size_t *npool) {
#if !defined(_WIN32)
    DIR *d = opendir(dir);
    struct dirent *e;
    static uint8_t buf[FZ_MAX_LEN];
    if (!d) return 0;
    while ((e = readdir(d)) != NULL) {
        char path[1536];
        FILE *f;
        size_t n;
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        f = fopen(path, "rb");
        if (!f) continue;
        n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        fz_add(pool, npool, FZ_MAX_POOL, buf, n, 0, NULL);
    }
    closedir(d);
    return 1;
#else
    (void)dir, (void)pool, (void)npool;
    return 0;
#endif
}

// One target for the given seconds from the seeds in dir. 0 when nothing went wrong.
static int fz_run(const fz_target *t, const char *dir, double seconds, uint64_t rng) {
    static fz_input pool[FZ_MAX_POOL];
    static uint8_t buf[FZ_MAX_LEN];
    size_t npool = 0, seeds, len, k;
    time_t start, now;
    fz_stats st;
    memset(&st, 0, sizeof st);
    if (!fz_load(dir, pool, &npool) || npool == 0) {
        fprintf(stderr, "fuzz %s: no seed files in %s\n", t->name, dir);
        return 2;
    }
    seeds = npool;
    for (k = 0; k < seeds; k++)
        pool[k].kind = fz_one(t, pool[k].data, pool[k].len, fz_next(&rng), &st);
    start = time(NULL);
    for (;;) {
        const fz_input *base = fz_pick(pool, npool, &rng);
        size_t muts = 1 + fz_rand(&rng, fz_rand(&rng, 2) ? 2 : 8);
        if ((st.execs & 63) == 0) {
            now = time(NULL);
            if (difftime(now, start) >= seconds) break;
        }
        len = base->len;
        memcpy(buf, base->data, len);
        for (k = 0; k < muts; k++) len = fz_mutate(buf, len, &rng, pool, npool);
        // one in 8 accepted inputs is kept, to reach deeper states
        if (fz_one(t, buf, len, fz_next(&rng), &st) && fz_rand(&rng, 8) == 0)
            fz_add(pool, &npool, seeds, buf, len, 1, &rng);
    }
    now = time(NULL);
    {
        double el = difftime(now, start) > 0 ? difftime(now, start) : 1;
        printf("fuzz %-11s %zu seeds, %llu executions in %.0f s (%.0f exec/s), %llu accepted, "
               "pool %zu, allocation failures %llu: no crash\n", t->name, seeds,
               (unsigned long long)st.execs, el, (double)st.execs / el,
               (unsigned long long)st.accepted, npool, (unsigned long long)st.oom);
        fflush(stdout);
    }
    for (k = 0; k < npool; k++) free(pool[k].data);
    return 0;
}

int main(int argc, char **argv) {
    double seconds = 10;
    uint64_t rng = (uint64_t)time(NULL);
    const char *dir = NULL, *target = "all";
    size_t k;
    int i, rc = 0, found = 0;
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            rng = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--target") == 0 && i + 1 < argc) target = argv[++i];
        else if (argv[i][0] != '-') dir = argv[i];
        else {
            fprintf(stderr, "usage: fuzz [--seconds N] [--seed S] [--target NAME|all] DIR\n");
            return 2;
        }
    }
    if (!dir) {
        fprintf(stderr, "usage: fuzz [--seconds N] [--seed S] [--target NAME|all] DIR\n");
        return 2;
    }
    if (!fz_index_setup()) {
        fprintf(stderr, "fuzz: cannot make a temporary folder\n");
        return 2;
    }
    // the CLI readers report refused input on stderr: keep the run's output to the summary
    if (!freopen("/dev/null", "w", stderr)) return 2;
    printf("fuzz: seed %llu (--seed repeats it), %.0f s per target\n", (unsigned long long)rng,
           seconds);
    for (k = 0; k < FZ_NTARGETS && !rc; k++) {
        char sub[1024];
        if (strcmp(target, "all") != 0 && strcmp(target, fz_targets[k].name) != 0) continue;
        found = 1;
        snprintf(sub, sizeof sub, "%s/%s", dir, fz_targets[k].name);
        rc = fz_run(&fz_targets[k], sub, seconds, fz_next(&rng));
    }
    fz_index_cleanup();
    if (!found) printf("fuzz: no target \"%s\"\n", target), rc = 2;
    return rc;
}
#endif
