// Fuzz driver for the request reader of bind/memanat_api.c (mn_api_call): the settings table of
// estimate and fit (read_settings, config_json included) and the replay request with its trace
// entries (read_replay_request, read_events). Self-contained, no libFuzzer needed:
//
//     ./build/fuzz_api [--seconds N] [--seed S]     (make fuzz builds it with ASan + UBSan)
//
// mutates a few built-in requests (bit flips, interesting bytes and tokens, inserts, deletes,
// splices, truncation) and runs the readers on each input for N seconds; an input they accept
// joins the pool. A result other than success or a negative mn_result with a message aborts, and
// so does a reader that accepts what it must refuse; crashes and leaks abort through the
// sanitizers. Requests naming "config" (a file path) are skipped: they would read the file system.
//
// With clang -fsanitize=fuzzer -DMN_LIBFUZZER the same checks run as LLVMFuzzerTestOneInput.
#include "../../bind/memanat_api.c"

#include <time.h>

static const char *const seeds[] = {
    "{\"model\": \"gpt2\", \"batch\": 4, \"seq\": 1024}",
    "{\"model\": \"llama-3-8b\", \"batch\": \"2\", \"seq\": \"2K\", \"precision\": \"bf16\", "
    "\"optim\": \"adamw-8bit\", \"checkpointing\": \"selective\", \"lora_rank\": 16, "
    "\"lora_targets\": \"q,k,v,o\", \"quant\": \"nf4-dq\", \"bnb_version\": \"0.43.1\", "
    "\"quant_head\": \"yes\", \"lora_dropout\": 0.05, \"optim_impl\": \"fused\"}",
    "{\"params\": \"7e9\", \"trainable_params\": 2e8, \"framework\": \"deepspeed\", \"zero\": 3, "
    "\"gpus\": 8, \"offload\": \"optimizer\", \"zero_grad\": \"none\", \"torch\": \"1.10\", "
    "\"gpu\": \"a100-80gb\", \"capacity\": \"40GiB\", \"context\": 1073741824}",
    "{\"config_json\": \"{\\\"model_type\\\": \\\"llama\\\", \\\"hidden_size\\\": 256, "
    "\\\"intermediate_size\\\": 512, \\\"num_hidden_layers\\\": 2, \\\"num_attention_heads\\\": 4,"
    " \\\"vocab_size\\\": 1000}\", \"head\": \"classification\", \"explain\": true}",
    "{\"model\": \"t5-base\", \"seq_lengths\": \"16:512:100\", \"steps\": 8, \"seed\": 3, "
    "\"percentile\": 90, \"loop\": \"trainer\", \"alloc_conf\": \"max_split_size_mb:128\"}",
    "{\"model\": \"gpt2\", \"infer\": true, \"prompt\": 100, \"new_tokens\": 50, \"beams\": 2, "
    "\"svg\": false, \"parts\": true, \"attention\": null}",
    "{\"device_traces\": [[{\"action\": \"alloc\", \"addr\": 140000000000, \"size\": 512, "
    "\"stream\": 0, \"category\": \"activations\"}, {\"action\": \"free_requested\", "
    "\"addr\": 140000000000, \"size\": 512, \"stream\": 7}]], \"capacity\": \"16GiB\", "
    "\"title\": \"t\", \"svg\": true, \"alloc_conf\": \"expandable_segments:False\"}",
};

static const char *const tokens[] = {
    "null", "true", "false", "-1", "0", "1e309", "18446744073709551616", "\"\"", "[]", "{}",
    "\"7e9\"", "\"16GiB\"", "\"x\"", ",", ":", "\"", "\\u0000", "\"model\"", "\"batch\"",
    "\"params\"", "\"config_json\"", "\"seq_lengths\"", "\"device_traces\"", "\"alloc\"",
};

static uint64_t fa_rng;
static uint64_t fa_next(void) {  // splitmix64
    uint64_t z = (fa_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void fa_die(const char *what, const uint8_t *data, size_t len) {
    FILE *f = fopen("fuzz-api-crash.bin", "wb");
    if (f) {
        fwrite(data, 1, len, f);
        fclose(f);
    }
    fprintf(stderr, "fuzz_api: %s (input saved to fuzz-api-crash.bin, %zu bytes)\n", what, len);
    abort();
}

// 1 when the request names a key "config" anywhere (after unescaping): a file path to read.
static int names_a_path(const uint8_t *data, size_t len) {
    mn_json_doc doc;
    uint32_t i;
    int found = 0;
    if (mn_json_parse((const char *)data, len, NULL, &doc) != MN_OK) {
        mn_json_free(&doc);
        return 0;
    }
    if (doc.root->type == MN_JSON_OBJECT)
        for (i = 0; i < doc.root->len; i++)
            if (!strcmp(doc.root->items[2 * i].str, "config")) found = 1;
    mn_json_free(&doc);
    return found;
}

// Runs the readers on one input; 1 when the settings reader accepted it.
static int fa_one(const uint8_t *data, size_t len) {
    api_call *c;
    replay_req q;
    mn_trace_event *ev = NULL;
    size_t n = 0;
    int rc, ok;
    if (names_a_path(data, len)) return 0;
    c = (api_call *)calloc(1, sizeof *c);
    if (!c) return 0;
    rc = read_settings(c, (const char *)data, len, 1);
    if (rc > 0 || (rc < 0 && !c->error[0])) fa_die("settings: a refusal without a message", data,
                                                  len);
    if (rc == MN_OK && !c->have_model) fa_die("settings: accepted without a model", data, len);
    ok = rc == MN_OK;
    mn_json_free(&c->doc);
    memset(c, 0, sizeof *c);
    rc = read_replay_request(c, (const char *)data, len, &q);
    if (rc == MN_OK) {
        if (!q.traces || q.traces->type != MN_JSON_ARRAY)
            fa_die("replay: accepted without a trace array", data, len);
        rc = read_events(c, q.traces, &ev, &n);
        if (rc == MN_OK && n && !ev) fa_die("replay: events counted but none kept", data, len);
        free(ev);
    }
    if (rc > 0 || (rc < 0 && !c->error[0])) fa_die("replay: a refusal without a message", data,
                                                  len);
    mn_json_free(&c->doc);
    free(c);
    return ok;
}

#ifdef MN_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fa_one(data, size);
    return 0;
}
#else

#define FA_MAX 4096
#define FA_POOL 256

static size_t fa_mutate(uint8_t *buf, size_t len, uint8_t *const *pool, const size_t *plen,
                        size_t npool) {
    uint32_t k, rounds = 1 + (uint32_t)(fa_next() % 4);
    for (k = 0; k < rounds; k++) {
        size_t at = len ? (size_t)(fa_next() % len) : 0;
        switch (fa_next() % 7) {
        case 0: if (len) buf[at] ^= (uint8_t)(1u << (fa_next() % 8)); break;
        case 1: if (len) buf[at] = "\"{}[]:,\\0-9e.\x80\xff"[fa_next() % 16]; break;
        case 2: {  // insert a token
            const char *t = tokens[fa_next() % (sizeof tokens / sizeof tokens[0])];
            size_t tl = strlen(t);
            if (len + tl > FA_MAX) break;
            memmove(buf + at + tl, buf + at, len - at);
            memcpy(buf + at, t, tl);
            len += tl;
            break;
        }
        case 3: {  // delete a run
            size_t d = len > at ? (size_t)(fa_next() % (len - at) % 16) : 0;
            memmove(buf + at, buf + at + d, len - at - d);
            len -= d;
            break;
        }
        case 4: len = at; break;  // truncate
        case 5: {  // splice a piece of another input
            size_t j = (size_t)(fa_next() % npool), from, m;
            if (!plen[j]) break;
            from = (size_t)(fa_next() % plen[j]);
            m = (size_t)(fa_next() % (plen[j] - from) % 64);
            if (len + m > FA_MAX) break;
            memmove(buf + at + m, buf + at, len - at);
            memcpy(buf + at, pool[j] + from, m);
            len += m;
            break;
        }
        default: if (len) buf[at] = (uint8_t)fa_next(); break;
        }
    }
    return len;
}

int main(int argc, char **argv) {
    static uint8_t pool_data[FA_POOL][FA_MAX];
    uint8_t *pool[FA_POOL];
    size_t plen[FA_POOL], npool = 0, i;
    double seconds = 10;
    unsigned long long runs = 0, accepted = 0;
    time_t start;
    uint8_t buf[FA_MAX];
    fa_rng = (uint64_t)time(NULL);
    for (i = 1; i + 1 < (size_t)argc; i += 2) {
        if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) fa_rng = strtoull(argv[i + 1], NULL, 10);
        else break;
    }
    if (i < (size_t)argc) {
        fprintf(stderr, "usage: fuzz_api [--seconds N] [--seed S]\n");
        return 2;
    }
    printf("fuzz_api: seed %llu\n", (unsigned long long)fa_rng);
    for (i = 0; i < FA_POOL; i++) pool[i] = pool_data[i];
    for (i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        plen[npool] = strlen(seeds[i]);
        memcpy(pool[npool], seeds[i], plen[npool]);
        if (!fa_one(pool[npool], plen[npool]) && i != 6)  // the replay seed has no model
            fa_die("a seed request is refused", pool[npool], plen[npool]);
        npool++;
    }
    start = time(NULL);
    while (difftime(time(NULL), start) < seconds) {
        size_t j = (size_t)(fa_next() % npool), len = plen[j];
        memcpy(buf, pool[j], len);
        len = fa_mutate(buf, len, pool, plen, npool);
        runs++;
        if (fa_one(buf, len)) {
            accepted++;
            j = npool < FA_POOL ? npool++ : (size_t)(fa_next() % FA_POOL);
            memcpy(pool[j], buf, len);
            plen[j] = len;
        }
    }
    printf("fuzz_api: %llu inputs in %.0f s, %llu accepted, pool %zu: no failure\n", runs,
           seconds, accepted, npool);
    return 0;
}
#endif
