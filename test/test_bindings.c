// Tests of the header where it is compiled for other places: the JSON entry point the Python
// package and the web page share (bind/memanat_api.c) against the library's own calls, the
// address shift that lets the simulated device serve 32-bit pointers (wasm32), and, when their
// tools are present, the Python package's tests (python/tests, pytest) and the page's tests in
// headless Chromium (web/test_web.py); each of those is one line here, SKIP without its tools.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "harness.h"

// The implementation comes from test/main.c; here only the entry point's own code.
#define MEMANAT_API_NO_IMPL
#include "../bind/memanat_api.c"

// ---- the JSON entry point -----------------------------------------------------------------------

static double api_number(const char *json, const char *key) {
    mn_json_doc doc;
    const mn_json_value *v;
    double out = -1.0;
    if (mn_json_parse(json, strlen(json), NULL, &doc) != MN_OK) return -1.0;
    v = mn_json_get(doc.root, key);
    if (v && v->type == MN_JSON_NUMBER) out = v->num;
    mn_json_free(&doc);
    return out;
}

// A fresh random setup through mn_api_call and through mn_estimate: the same bytes.
static void test_api_estimate(void) {
    static const char *models[] = {"gpt2", "bert-base-uncased", "llama-3-8b", "t5-base"};
    static const char *precisions[] = {"fp32", "fp16", "bf16"};
    static const char *ckpts[] = {"none", "full", "selective"};
    int round;
    for (round = 0; round < 4; round++) {
        const char *model = models[mnt_rand_u64() % 4];
        unsigned batch = (unsigned)(1 + mnt_rand_u64() % 8);
        unsigned seq = 64u << (mnt_rand_u64() % 4);
        uint32_t pi = (uint32_t)(mnt_rand_u64() % 3), ci = (uint32_t)(mnt_rand_u64() % 3);
        char req[512], *out = NULL;
        size_t n = 0;
        mn_model m;
        mn_setup s;
        mn_estimate_result r;
        const char *gpu = pi == 2 ? "a10g" : "t4";  // bf16 needs sm 80: the T4 refuses it
        snprintf(req, sizeof req, "{\"model\": \"%s\", \"batch\": %u, \"seq\": \"%u\", "
                 "\"precision\": \"%s\", \"checkpointing\": \"%s\", \"gpu\": \"%s\"}", model,
                 batch, seq, precisions[pi], ckpts[ci], gpu);
        CHECK_OK(mn_api_call("estimate", req, strlen(req), &out, &n));
        CHECK(out != NULL && n == strlen(out));
        memset(&s, 0, sizeof s);
        CHECK_OK(mn_preset_find(model, &m));
        s.batch = batch, s.seq = seq, s.gpu = gpu;
        CHECK_OK(mn_precision_parse(precisions[pi], &s.precision));
        CHECK_OK(mn_ckpt_parse(ckpts[ci], &s.checkpointing));
        CHECK_OK(mn_estimate(&m, &s, &r));
        if (out) {
            CHECK_EQ_U64(api_number(out, "weights"), r.weights);
            CHECK_EQ_U64(api_number(out, "activations"), r.activations);
            CHECK_EQ_U64(api_number(out, "peak_reserved"), r.peak_reserved);
            CHECK_EQ_U64(api_number(out, "device_used"), r.device_used);
        }
        mn_api_free(out);
    }
}

// Refused requests: a negative result and one line that names the setting.
static void test_api_errors(void) {
    static const struct { const char *op, *req, *word; int code; } bad[] = {
        {"estimate", "{\"model\": \"gpt2\", \"batch\": 0}", "batch", MN_ERR_INVALID_ARG},
        {"estimate", "{\"model\": \"gpt2\", \"batch\": 2.5}", "batch", MN_ERR_INVALID_ARG},
        {"estimate", "{\"model\": \"gpt2\", \"precision\": \"fp8\"}", "precision",
         MN_ERR_INVALID_ARG},
        {"estimate", "{\"model\": \"nope\"}", "nope", MN_ERR_NOT_FOUND},
        {"estimate", "{\"model\": \"gtp2\"}", "did you mean gpt2?", MN_ERR_NOT_FOUND},
        {"estimate", "{\"model\": \"gpt2\", \"gpu\": \"a100-40\"}", "did you mean a100-40gb?",
         MN_ERR_NOT_FOUND},
        {"estimate", "{\"model\": \"gpt2\", \"frobnicate\": 1}", "frobnicate", MN_ERR_NOT_FOUND},
        {"estimate", "{\"batch\": 2}", "model", MN_ERR_INVALID_ARG},
        {"estimate", "{\"model\": \"gpt2\", \"params\": 7e9}", "params", MN_ERR_INVALID_ARG},
        {"estimate", "{\"config_json\": \"{\\\"model_type\\\": [}\"}", "line", MN_ERR_PARSE},
        {"estimate", "[1, 2]", "object", MN_ERR_PARSE},
        {"estimate", "{\"model\": ", "request", MN_ERR_PARSE},
        {"fit", "{\"model\": \"gpt2\", \"context\": \"lots\"}", "context", MN_ERR_INVALID_ARG},
        {"replay", "{\"segments\": []}", "device_traces", MN_ERR_INVALID_ARG},
        {"frobnicate", "{}", "frobnicate", MN_ERR_NOT_FOUND},
    };
    size_t i;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *out = NULL;
        size_t n = 0;
        int rc = mn_api_call(bad[i].op, bad[i].req, strlen(bad[i].req), &out, &n);
        CHECK_MSG(rc == bad[i].code, "%s %s: got %d want %d (%s)", bad[i].op, bad[i].req, rc,
                  bad[i].code, out ? out : "");
        CHECK_MSG(out && strstr(out, bad[i].word) && !strchr(out, '\n'),
                  "%s %s: message \"%s\" does not name %s", bad[i].op, bad[i].req,
                  out ? out : "", bad[i].word);
        mn_api_free(out);
    }
}

// Mangled requests (bytes flipped, cut short, doubled): every answer is a result code and a
// text, never a crash or a leak (the sanitizer build runs this too).
static void test_api_mangled(void) {
    static const char *valid[] = {
        "{\"model\": \"gpt2\", \"batch\": 2, \"seq\": \"256\", \"precision\": \"bf16\", "
        "\"lora_rank\": 8, \"alloc_conf\": \"expandable_segments:True\", \"parts\": true}",
        "{\"config_json\": \"{\\\"model_type\\\": \\\"gpt2\\\", \\\"n_layer\\\": 2, "
        "\\\"n_embd\\\": 64, \\\"n_head\\\": 2}\", \"batch\": 3, \"seq\": 64}",
        "{\"device_traces\": [[{\"action\": \"alloc\", \"addr\": 4096, \"size\": 1000}, "
        "{\"action\": \"free_requested\", \"addr\": 4096, \"size\": 1000}]]}",
    };
    static const char *ops[] = {"estimate", "estimate", "replay"};
    char buf[512];
    int round, ok = 0;
    for (round = 0; round < 3; round++) {  // the unmangled requests are answered
        char *out = NULL;
        size_t len = 0;
        CHECK_OK(mn_api_call(ops[round], valid[round], strlen(valid[round]), &out, &len));
        mn_api_free(out);
    }
    for (round = 0; round < 300; round++) {
        size_t k = mnt_rand_u64() % 3, n = strlen(valid[k]), j, flips;
        char *out = NULL;
        size_t len = 0;
        int rc;
        memcpy(buf, valid[k], n + 1);
        flips = 1 + mnt_rand_u64() % 4;
        for (j = 0; j < flips; j++) {
            size_t at = mnt_rand_u64() % n;
            if (round % 2 == 0)  // any byte: mostly broken JSON
                buf[at] = (char)(32 + mnt_rand_u64() % 95);
            else if (buf[at] >= '0' && buf[at] <= '9')  // a digit: valid JSON, other values
                buf[at] = (char)('0' + mnt_rand_u64() % 10);
        }
        if (round % 2 == 0 && mnt_rand_u64() % 4 == 0) n = mnt_rand_u64() % n;  // cut short
        rc = mn_api_call(ops[k], buf, n, &out, &len);
        CHECK_MSG(out != NULL && (rc == 0 || rc < 0), "round %d: rc %d", round, rc);
        if (out) CHECK(strlen(out) == len);
        ok += rc == 0;
        mn_api_free(out);
    }
    if (mnt_verbose()) printf("       %d of 300 mangled requests answered\n", ok);
}

// ---- the address shift of the simulated device -------------------------------------------------

// Replays an estimated step on a simulated device whose pointers carry address >> shift; the
// statistics (every memory_stats() item) and the block addresses must not depend on the shift.
static void replay_with_shift(const mn_trace_event *ev, uint64_t n, const char *conf,
                              uint32_t shift, mn_stat_item *items, uint32_t *count) {
    mn_sim_cache sc;
    mn_simdev_desc dd;
    mn_cache_desc cd;
    struct mn_cache_stats st;
    memset(&dd, 0, sizeof dd), memset(&cd, 0, sizeof cd);
    dd.addr_shift = shift, dd.events_complete = 1;
    cd.config = conf;
    CHECK_OK(mn_sim_cache_init(&sc, &dd, &cd));
    CHECK_EQ_U64(sc.dev.desc.addr_shift, shift);
    CHECK_OK(mn_cache_replay(&sc.cache, ev, n, 1, NULL));
    CHECK_OK(mn_cache_check(&sc.cache));
    CHECK_OK(mn_cache_stats(&sc.cache, &st));
    *count = mn_cache_stats_items(&st, items, MN_CACHE_STATS_ITEMS);
    mn_sim_cache_free(&sc);
}

static void test_addr_shift(void) {
    static const char *confs[] = {"", "expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4"};
    mn_model m;
    mn_setup s;
    mn_trace_event *ev = NULL;
    uint64_t n = 0;
    mn_stat_item *a = (mn_stat_item *)malloc(sizeof *a * MN_CACHE_STATS_ITEMS);
    mn_stat_item *b = (mn_stat_item *)malloc(sizeof *b * MN_CACHE_STATS_ITEMS);
    uint32_t na = 0, nb = 0, i, k;
    mn_simdev dev;
    mn_simdev_desc dd;
    mn_device d;
    void *p = NULL;
    CHECK(a && b);
    if (!a || !b) goto done;
    memset(&s, 0, sizeof s);
    CHECK_OK(mn_preset_find(mnt_rand_u64() % 2 ? "gpt2" : "bert-base-uncased", &m));
    s.batch = 1 + mnt_rand_u64() % 6, s.seq = 128u << (mnt_rand_u64() % 3);
    CHECK_OK(mn_estimate_trace(&m, &s, NULL, &ev, &n));
    for (k = 0; k < 4 && ev; k++) {
        replay_with_shift(ev, n, confs[k], 0, a, &na);
        replay_with_shift(ev, n, confs[k], 9, b, &nb);
        CHECK_EQ_INT(na, nb);
        for (i = 0; i < na && i < nb; i++)
            CHECK_MSG(a[i].value == b[i].value, "%s: %s got %lld with shift 9, %lld without",
                      confs[k], a[i].key, (long long)b[i].value, (long long)a[i].value);
    }
    mn_trace_free(NULL, ev);
    // the pointer is the address shifted; a shift above 9 would cut block addresses
    memset(&dd, 0, sizeof dd);
    dd.addr_shift = 9;
    CHECK_OK(mn_simdev_init(&dev, &dd));
    d = mn_simdev_device(&dev);
    CHECK_EQ_INT(d.addr_shift, 9);
    CHECK_OK(d.alloc_fn(d.user_data, 1 << 20, &p));
    CHECK_EQ_U64((uint64_t)(uintptr_t)p << 9, dev.desc.base);
    CHECK_OK(d.free_fn(d.user_data, p, 1 << 20));
    mn_simdev_free(&dev);
    dd.addr_shift = 10;
    CHECK_ERR(mn_simdev_init(&dev, &dd), MN_ERR_INVALID_ARG);
done:
    free(a), free(b);
}

// ---- the Python package and the page, through their own test runners ---------------------------

static int sh(const char *cmd) {
    int st = system(cmd);
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static const char *python(void) {
    const char *p = getenv("PYTHON");
    return p && *p ? p : "python3";
}

static void print_last_line(const char *log) {
    char line[512], last[512] = "";
    FILE *f = fopen(log, "r");
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (line[0] != '\n') snprintf(last, sizeof last, "%s", line);
    fclose(f);
    printf("       %s", last);
}

// Runs pytest on a test path with the package built in place (make test builds it) and the
// CLI of this run; the log goes to build/.
static void run_pytest(const char *what, const char *log) {
    char cmd[1024];
    int rc;
    snprintf(cmd, sizeof cmd, "PYTHONPATH=python MEMANAT_BIN=%s %s -m pytest -q "
             "-p no:cacheprovider "
             "%s > %s 2>&1", mnt_cli_path(), python(), what, log);
    rc = sh(cmd);
    print_last_line(log);
    CHECK_MSG(rc == 0, "pytest %s exited %d: see %s", what, rc, log);
}

static int python_has(const char *module) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "PYTHONPATH=python %s -c 'import %s' >/dev/null 2>&1", python(),
             module);
    return sh(cmd) == 0;
}

static void test_python(void) {
    if (getenv("MN_TEST_NO_BINDINGS")) SKIP_OPTIONAL("MN_TEST_NO_BINDINGS is set");
    if (access(mnt_cli_path(), X_OK) != 0) SKIP("./memanat not built (make test builds it)");
    if (!python_has("pytest")) SKIP_OPTIONAL("python3 with pytest not found (pip install pytest)");
    if (!python_has("memanat._native"))
        SKIP_OPTIONAL("the extension is not built: make python-ext (needs setuptools and "
                      "Python.h)");
    run_pytest("python/tests", "build/pytest-python.log");
}

static void test_web(void) {
    if (getenv("MN_TEST_NO_BINDINGS")) SKIP_OPTIONAL("MN_TEST_NO_BINDINGS is set");
    if (access(mnt_cli_path(), X_OK) != 0) SKIP("./memanat not built (make test builds it)");
    if (access("web/index.html", R_OK) != 0)
        SKIP_OPTIONAL("web/index.html not built: make web (apt-get install clang lld wasi-libc "
                      "libclang-rt-14-dev-wasm32)");
    if (sh("command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1"))
        SKIP_OPTIONAL("no browser: apt-get install chromium chromium-driver");
    if (!python_has("pytest") || !python_has("selenium"))
        SKIP_OPTIONAL("python3 with pytest and selenium not found (pip install pytest selenium)");
    run_pytest("web/test_web.py", "build/pytest-web.log");
}

const mnt_case test_bindings_cases[] = {
    {"api_estimate", test_api_estimate},
    {"api_errors", test_api_errors},
    {"api_mangled", test_api_mangled},
    {"addr_shift", test_addr_shift},
    {"python", test_python},
    {"web", test_web},
};
const size_t test_bindings_count = sizeof test_bindings_cases / sizeof test_bindings_cases[0];
