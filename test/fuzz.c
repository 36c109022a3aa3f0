// Fuzz driver for the readers of untrusted files: the JSON reader, the safetensors header reader
// and the config.json mapper. No libFuzzer needed:
//
//     ./build/fuzz [--seconds N] [--seed S] DIR     (make fuzz builds it with ASan + UBSan)
//
// loads every file of DIR as a seed, mutates seeds (bit flips, interesting bytes and tokens,
// inserts, deletes, duplications, splices, truncation, length-prefix rewrites) and runs every
// reader on each input for N seconds. Inputs that a reader accepts join the pool, so mutations
// reach deeper. Every run uses a counting allocator that also fails at random: a leak, a double
// free or a result other than success / the documented error codes aborts. Crashes abort through
// the sanitizers. Prints executions per second and exits 0 when nothing went wrong.
//
// With clang -fsanitize=fuzzer -DMN_LIBFUZZER the same checks run as LLVMFuzzerTestOneInput.
#if !defined(_WIN32)
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"

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
    fprintf(stderr, "fuzz: %s (input saved to fuzz-crash.bin, %zu bytes)\n", what, len);
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
    uint64_t execs, json_ok, st_ok, st_wrapped_ok, hf_ok, oom;
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

enum { FZ_JSON = 1, FZ_ST = 2, FZ_CONFIG = 4 };

// Runs every reader on one input. Returns the FZ_* bits of the readers that accepted it.
static int fz_one(const uint8_t *data, size_t len, uint64_t seed, fz_stats *st) {
    fz_alloc a;
    mn_json_desc jd;
    mn_json_doc doc;
    mn_safetensors_desc sd;
    mn_safetensors_info info;
    mn_hf_desc hd;
    mn_model m;
    mn_result r;
    int accepted = 0;
    uint64_t k, data_end = 0;
    uint8_t *wrapped;
    memset(&a, 0, sizeof a);
    a.rng = seed;
    a.fail_one_in = seed % 8 == 0 ? 3 : 0;  // one run in eight with failing allocations
    // JSON
    memset(&jd, 0, sizeof jd);
    jd.allocator.alloc_fn = fz_malloc, jd.allocator.free_fn = fz_free, jd.allocator.user_data = &a;
    jd.max_depth = (uint32_t)(seed >> 8) % 4 == 0 ? 8 : 0;
    r = mn_json_parse((const char *)data, len, &jd, &doc);
    if (r == MN_OK) {
        fz_walk(doc.root, 0, data, len);
        st->json_ok++, accepted |= FZ_JSON;
        data_end = fz_data_end(doc.root);
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
    if (r == MN_ERR_OUT_OF_MEMORY) st->oom++;
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
    fz_check_alloc(&a, r, data, len, "mn_json_parse");
    // safetensors, the input as a whole file
    memset(&sd, 0, sizeof sd);
    sd.allocator = jd.allocator;
    sd.keep_tensors = (int)(seed >> 16) & 1;
    r = mn_safetensors_parse(data, len, 0, &sd, &info);
    if (r == MN_OK) {
        st->st_ok++, accepted |= FZ_ST;
        if (info.tensor) {
            for (k = 0; k < info.tensors; k++)
                fz_sink += info.tensor[k].elements + (unsigned char)info.tensor[k].name[0];
        }
        if (info.data_bytes + info.header_bytes + 8 != len) fz_die("safetensors sizes", data, len);
    }
    mn_safetensors_free(&info);
    fz_check_alloc(&a, r, data, len, "mn_safetensors_parse");
    // safetensors, the input as the header of a file with a data section of plausible size
    wrapped = (uint8_t *)malloc(len + 8);
    for (k = 0; k < 8; k++) wrapped[k] = (uint8_t)((uint64_t)len >> (8 * k));
    if (len) memcpy(wrapped + 8, data, len);
    r = mn_safetensors_parse(wrapped, len + 8,
                             len + 8 + ((seed >> 20) % 8 == 0 ? (seed >> 24) % 4096 : data_end),
                             &sd, &info);
    if (r == MN_OK) st->st_wrapped_ok++, accepted |= FZ_ST;
    mn_safetensors_free(&info);
    free(wrapped);
    fz_check_alloc(&a, r, data, len, "mn_safetensors_parse (wrapped)");
    // config.json
    memset(&hd, 0, sizeof hd);
    hd.allocator = jd.allocator;
    r = mn_hf_config_parse((const char *)data, len, &hd, &m);
    if (r == MN_OK) {
        st->hf_ok++, accepted |= FZ_CONFIG;
        if (m.layers == 0 || m.hidden == 0 || m.heads == 0 || m.kv_heads == 0 || m.vocab == 0 ||
            m.heads % m.kv_heads != 0)
            fz_die("config accepted with an impossible shape", data, len);
    }
    fz_check_alloc(&a, r, data, len, "mn_hf_config_parse");
    {  // a sequence-lengths file: sorted distinct lengths, positive counts, or a clean refusal
        mn_seq_dist sq;
        char *text = (char *)malloc(len + 1);
        r = mn_seq_dist_parse((const char *)data, len, &jd.allocator, NULL, &sq);
        if (r == MN_OK) {
            for (k = 0; k < sq.n; k++)
                if (sq.count[k] == 0 || sq.len[k] == 0 || (k && sq.len[k] <= sq.len[k - 1]))
                    fz_die("lengths accepted out of order or empty", data, len);
            if (sq.n == 0) fz_die("lengths accepted with no entry", data, len);
        } else if (r != MN_ERR_PARSE && r != MN_ERR_INVALID_ARG && r != MN_ERR_OUT_OF_MEMORY) {
            fz_die("mn_seq_dist_parse: unexpected result", data, len);
        }
        mn_seq_dist_free(&jd.allocator, &sq);
        fz_check_alloc(&a, r, data, len, "mn_seq_dist_parse");
        if (len) memcpy(text, data, len);
        text[len] = 0;
        r = mn_seq_dist_range(text, NULL, &sq);
        if (r == MN_OK && (sq.min < 1 || sq.max < sq.min || !(sq.mean >= (double)sq.min) ||
                           !(sq.mean <= (double)sq.max)))
            fz_die("a range accepted out of order", data, len);
        free(text);
    }
    st->execs++;
    return accepted;
}

#ifdef MN_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fz_stats st;
    static uint64_t seed = 1;
    fz_one(data, size, fz_next(&seed), &st);
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

// A base input: each reader's accepted inputs get an equal share of the picks.
static const fz_input *fz_pick(const fz_input *pool, size_t npool, uint64_t *s) {
    static const int kinds[] = {FZ_JSON, FZ_ST, FZ_CONFIG, 0};
    int want = kinds[fz_rand(s, 4)];
    size_t k, at = fz_rand(s, npool);
    for (k = 0; k < 32 && want; k++) {
        size_t i = fz_rand(s, npool);
        if (pool[i].kind & want) return &pool[i];
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
        char path[1024];
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

int main(int argc, char **argv) {
    static fz_input pool[FZ_MAX_POOL];
    static uint8_t buf[FZ_MAX_LEN];
    size_t npool = 0, seeds, len, k;
    double seconds = 10;
    uint64_t rng = (uint64_t)time(NULL), seed0;
    const char *dir = NULL;
    time_t start, now;
    fz_stats st;
    int i;
    memset(&st, 0, sizeof st);
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            rng = strtoull(argv[++i], NULL, 10);
        else if (argv[i][0] != '-') dir = argv[i];
        else {
            fprintf(stderr, "usage: fuzz [--seconds N] [--seed S] DIR\n");
            return 2;
        }
    }
    if (!dir || !fz_load(dir, pool, &npool) || npool == 0) {
        fprintf(stderr, "fuzz: no seed files in %s\n", dir ? dir : "(no DIR given)");
        return 2;
    }
    seeds = npool;
    seed0 = rng;
    printf("fuzz: %zu seeds from %s, %.0f s, seed %llu (--seed repeats it)\n", seeds, dir, seconds,
           (unsigned long long)seed0);
    fflush(stdout);
    for (k = 0; k < seeds; k++)
        pool[k].kind = fz_one(pool[k].data, pool[k].len, fz_next(&rng), &st);
    start = time(NULL);
    for (;;) {
        const fz_input *base = fz_pick(pool, npool, &rng);
        size_t muts = 1 + fz_rand(&rng, fz_rand(&rng, 2) ? 2 : 8);
        if ((st.execs & 255) == 0) {
            now = time(NULL);
            if (difftime(now, start) >= seconds) break;
        }
        len = base->len;
        memcpy(buf, base->data, len);
        for (k = 0; k < muts; k++) len = fz_mutate(buf, len, &rng, pool, npool);
        // one in 8 accepted inputs is kept, to reach deeper states
        {
            int acc = fz_one(buf, len, fz_next(&rng), &st);
            if (acc && fz_rand(&rng, 8) == 0) fz_add(pool, &npool, seeds, buf, len, acc, &rng);
        }
    }
    now = time(NULL);
    {
        double el = difftime(now, start) > 0 ? difftime(now, start) : 1;
        printf("fuzz: %llu executions in %.0f s (%.0f exec/s), pool %zu; accepted: json %llu, "
               "safetensors %llu + %llu wrapped, config %llu; allocation failures %llu\n",
               (unsigned long long)st.execs, el, (double)st.execs / el, npool,
               (unsigned long long)st.json_ok, (unsigned long long)st.st_ok,
               (unsigned long long)st.st_wrapped_ok, (unsigned long long)st.hf_ok,
               (unsigned long long)st.oom);
    }
    for (k = 0; k < npool; k++) free(pool[k].data);
    printf("fuzz: no crash\n");
    return 0;
}
#endif
