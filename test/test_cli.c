// Tests of the memanat CLI: every row of ../shared/validation/dev.tsv through `memanat estimate
// --json` within the row's tolerance, bad input (one line on stderr, non-zero exit), fit, models.
// They run ./memanat, which `make test` builds first.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "harness.h"
#include "../memanat.h"

#define DEV_TSV "../shared/validation/dev.tsv"

typedef struct run_out {
    char out[16384];
    char err[4096];
    int status;  // exit status, -1 if it did not exit normally
} run_out;

// Runs `memanat ARGS`, capturing stdout and stderr (stderr through a temporary file).
static int run(const char *args, run_out *r) {
    return mnt_cli_run(args, r->out, sizeof r->out, r->err, sizeof r->err, &r->status);
}

static int have_cli(void) { return access(mnt_cli_path(), X_OK) == 0; }

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

// Value of a numeric key in the CLI's JSON output, parsed with the header's strict reader.
static int json_number(const char *text, const char *key, double *out) {
    mn_json_doc doc;
    const mn_json_value *v;
    int ok = 0;
    if (mn_json_parse(text, strlen(text), NULL, &doc) != MN_OK) return 0;
    v = mn_json_get(doc.root, key);
    if (v && v->type == MN_JSON_NUMBER) *out = v->num, ok = 1;
    mn_json_free(&doc);
    return ok;
}

static double unit_bytes(const char *u) {
    if (!strcmp(u, "MiB")) return 1048576.0;
    if (!strcmp(u, "GiB")) return 1073741824.0;
    if (!strcmp(u, "GB")) return 1e9;
    if (!strcmp(u, "MB")) return 1e6;
    return 0.0;
}

// Each row: id, metric, unit, value, tol (relative), args, source.
static void test_dev_tsv(void) {
    FILE *f;
    char line[4096];
    int rows = 0;
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    f = fopen(DEV_TSV, "r");
    CHECK_MSG(f != NULL, "cannot open %s: the validation set lives in ../shared beside the checkout", DEV_TSV);
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char *col[7], *p = line, args[2048];
        int n = 0;
        double want, tol, got = 0, unit;
        run_out r;
        if (line[0] == '#' || line[0] == '\n') continue;
        line[strcspn(line, "\n")] = 0;
        while (n < 7 && p) {
            col[n++] = p;
            p = strchr(p, '\t');
            if (p) *p++ = 0;
        }
        CHECK_MSG(n >= 6, "malformed row: %s", line);
        if (n < 6) continue;
        want = atof(col[3]), tol = atof(col[4]), unit = unit_bytes(col[2]);
        CHECK_MSG(unit > 0, "row %s: unknown unit %s", col[0], col[2]);
        snprintf(args, sizeof args, "estimate %s --json", col[5]);
        CHECK(run(args, &r));
        // 1: the row's setup does not fit its device (the numbers are printed all the same)
        CHECK_MSG(r.status == 0 || r.status == 1, "row %s: exit %d: %s", col[0], r.status, r.err);
        if (r.status != 0 && r.status != 1) continue;
        CHECK_MSG(json_number(r.out, col[1], &got), "row %s: no numeric \"%s\" in the output", col[0], col[1]);
        got /= unit;
        printf("       %-22s %-13s want %9.1f got %11.2f %s (%+.2f%%, tol %.0f%%)\n", col[0], col[1], want, got,
               col[2], 100.0 * (got - want) / want, 100.0 * tol);
        CHECK_NEAR(got, want, 0.0, tol);
        rows++;
    }
    fclose(f);
    CHECK_MSG(rows >= 19, "only %d validation rows ran", rows);
}

#define TORCH2_TSV "test/validation/torch2.tsv"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// Each row of test/validation/torch2.tsv (the real transformers/peft code measured by
// tools/torchcheck.py): name, peak allocated bytes, 7 category columns, phase, sdpa backends,
// memanat estimate options. The measurement (MemTracker) sums live storages rounded to 512 B:
// memanat's peak_requested, the same count, less its cuBLAS workspace term (no dispatcher-level
// tool sees it). Every row within 3 %, the median within 1 %.
static void test_torch2_tsv(void) {
    FILE *f;
    char line[4096];
    double errs[256];
    int rows = 0;
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    f = fopen(TORCH2_TSV, "r");
    CHECK_MSG(f != NULL, "cannot open %s", TORCH2_TSV);
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char *col[12], *p = line, args[4096];
        int n = 0;
        double want, got = 0, ws = 0, err, tol;
        run_out r;
        if (line[0] == '#' || line[0] == '\n') continue;
        line[strcspn(line, "\n")] = 0;
        while (n < 12 && p) {
            col[n++] = p;
            p = strchr(p, '\t');
            if (p) *p++ = 0;
        }
        CHECK_MSG(n == 12, "malformed row: %s", line);
        if (n != 12) continue;
        want = atof(col[1]);
        snprintf(args, sizeof args, "estimate %s --json", col[11]);
        CHECK(run(args, &r));
        CHECK_MSG(r.status == 0, "row %s: exit %d: %s", col[0], r.status, r.err);
        if (r.status != 0) continue;
        CHECK(json_number(r.out, "peak_requested", &got));
        CHECK(json_number(r.out, "workspace", &ws));
        err = (got - ws - want) / want, tol = 0.03;
        printf("       %-38s want %8.1f MiB got %8.1f MiB (%+.2f%%, tol %.1f%%)\n", col[0],
               want / 1048576.0, (got - ws) / 1048576.0, 100.0 * err, 100.0 * tol);
        CHECK_NEAR(got - ws, want, 0.0, tol);
        if (rows < 256) errs[rows] = err < 0 ? -err : err;
        rows++;
    }
    fclose(f);
    CHECK_MSG(rows >= 40, "only %d torch2 rows ran", rows);
    if (rows >= 40 && rows <= 256) {
        double med;
        qsort(errs, (size_t)rows, sizeof errs[0], cmp_double);
        med = rows % 2 ? errs[rows / 2] : 0.5 * (errs[rows / 2 - 1] + errs[rows / 2]);
        printf("       median |error| %.2f%% over %d rows\n", 100.0 * med, rows);
        CHECK_MSG(med <= 0.01, "median |error| %.2f%% (want <= 1%%)", 100.0 * med);
    }
}

// Each bad invocation: non-zero exit, exactly one line on stderr, nothing on stdout.
static void test_bad_input(void) {
    static const char *bad[] = {
        "frobnicate",
        "estimate",
        "estimate --model bert-large-uncased --frobnicate 3",
        "estimate --model no-such-model",
        "estimate --model gpt2 --batch 0",
        "estimate --model gpt2 --batch -1",
        "estimate --model gpt2 --batch 1e30",
        "estimate --model gpt2 --batch 2.5",
        "estimate --model gpt2 --batch",
        "estimate --model gpt2 --seq 4096",
        "estimate --model gpt2 --precision fp8",
        "estimate --model gpt2 --gpu tpu",
        "estimate --model gpt2 --capacity lots",
        "estimate --model gpt2 --zero 7",
        "estimate --model gpt2 --lora-targets q,x",
        "estimate --model gpt2 --optim-impl turbo",
        "estimate --model gpt2 --loop accelerate",
        "estimate --model gpt2 --lora-rank 8 --lora-dropout 1",
        "estimate --model gpt2 --lora-rank 8 --lora-dropout x",
        "estimate --model gpt2 --quant nf4",
        "estimate --model gpt2 --params 7e9",
        "estimate --params 0",
        "estimate --params 1e19",
        "estimate --params 7e9 --trainable-params 8e9",
        "estimate --params 5e18",
        "estimate --config /nonexistent/config.json",
        "estimate --config test/data/bad_config.json",
        "estimate --model gpt2 --context 1TiB",
        "fit --model gpt2 --torch 3",
        "models extra",
    };
    size_t i;
    run_out r;
    FILE *f;
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    f = fopen("test/data/bad_config.json", "w");  // a hostile config: broken JSON
    CHECK(f != NULL);
    if (f) {
        fputs("{\"model_type\": \"llama\", \"hidden_size\": 4096, \"num_hidden_layers\": [}", f);
        fclose(f);
    }
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(run(bad[i], &r));
        CHECK_MSG(r.status != 0, "`memanat %s` exited 0", bad[i]);
        CHECK_MSG(count_lines(r.err) == 1,
                  "`memanat %s` printed %d lines on stderr: %s", bad[i], count_lines(r.err), r.err);
        CHECK_MSG(r.out[0] == 0, "`memanat %s` printed on stdout: %.80s", bad[i], r.out);
    }
    remove("test/data/bad_config.json");
    // a count past its range names the range, not only its low end
    CHECK(run("estimate --model gpt2 --seq 18446744073709551616", &r));
    CHECK_EQ_INT(r.status, 2);
    CHECK_MSG(strstr(r.err, "from 1 to 1000000000000000000") != NULL, "got: %s", r.err);
    CHECK(run("estimate --model gpt2 --lora-rank 4294967296", &r));
    CHECK_EQ_INT(r.status, 2);
    CHECK_MSG(strstr(r.err, "from 1 to 4294967295") != NULL, "got: %s", r.err);
    // a name one edit from a table name is answered with that name; names as the hub and
    // nvidia-smi write them are found
    CHECK(run("estimate --model llama-4-8b", &r));
    CHECK_EQ_INT(r.status, 2);
    CHECK_MSG(strstr(r.err, "unknown model \"llama-4-8b\"; did you mean llama-3-8b?") != NULL,
              "got: %s", r.err);
    CHECK(run("estimate --model gpt2 --gpu a100-40", &r));
    CHECK_EQ_INT(r.status, 2);
    CHECK_MSG(strstr(r.err, "unknown GPU \"a100-40\"; did you mean a100-40gb?") != NULL,
              "got: %s", r.err);
    CHECK_EQ_INT(count_lines(r.err), 1);
    CHECK(run("estimate --model meta-llama/Meta-Llama-3-8B-Instruct "
              "--gpu 'NVIDIA A100-SXM4-40GB' --json", &r));
    CHECK_EQ_INT(r.status, 1);  // (it does not fit)
    CHECK_MSG(strstr(r.out, "\"model\": \"llama-3-8b\"") != NULL, "got: %.600s", r.out);
    CHECK_MSG(strstr(r.out, "\"capacity\": 42949672960") != NULL, "got: %.400s", r.out);
}

// A value a choice flag does not take is answered with the values it takes, as the usage lists
// them: exactly the library's names of that setting (so the usage cannot fall behind it).
#define NAME_OF(fn, type) \
    static const char *name_##fn(int v) { return mn_##fn##_name((type)v); }
NAME_OF(precision, mn_precision)
NAME_OF(optim, mn_optim)
NAME_OF(ckpt, mn_ckpt)
NAME_OF(attn, mn_attn)
NAME_OF(framework, mn_framework)
NAME_OF(offload, mn_offload)
NAME_OF(quant, mn_quant)
NAME_OF(optim_impl, mn_optim_impl)
NAME_OF(loop, mn_loop)
#undef NAME_OF
static void test_choice_values(void) {
    static const struct { const char *flag; const char *(*name)(int); int count; } flags[] = {
        {"--precision", name_precision, MN_PREC_COUNT},
        {"--optim", name_optim, MN_OPTIM_COUNT},
        {"--checkpointing", name_ckpt, MN_CKPT_COUNT},
        {"--attention", name_attn, MN_ATTN_COUNT},
        {"--framework", name_framework, MN_FW_COUNT},
        {"--offload", name_offload, MN_OFFLOAD_COUNT},
        {"--quant", name_quant, MN_QUANT_COUNT},
        {"--optim-impl", name_optim_impl, MN_OPTIM_IMPL_COUNT},
        {"--loop", name_loop, MN_LOOP_COUNT},
    };
    size_t i;
    run_out r;
    char cmd[128], want[256];
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    for (i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        const char *list;
        int v, listed = 0;
        snprintf(cmd, sizeof cmd, "estimate --model gpt2 %s bogus", flags[i].flag);
        CHECK(run(cmd, &r));
        CHECK_EQ_INT(r.status, 2);
        CHECK_EQ_INT(count_lines(r.err), 1);
        snprintf(want, sizeof want, "%s \"bogus\": want one of ", flags[i].flag);
        list = strstr(r.err, want);
        CHECK_MSG(list != NULL, "%s: got %s", flags[i].flag, r.err);
        if (!list) continue;
        list += strlen(want);
        for (v = 1; v < flags[i].count; v++) {  // each name once, between | or the ends
            const char *n = flags[i].name(v), *at = list;
            size_t len = strlen(n);
            int found = 0;
            while ((at = strstr(at, n)) != NULL) {
                found |= (at == list || at[-1] == '|') && (at[len] == '|' || at[len] == '\n');
                at += len;
            }
            CHECK_MSG(found, "%s: %s not in %s", flags[i].flag, n, list);
            listed++;
        }
        for (v = 1; list[0] && list[0] != '\n'; list++) v += list[0] == '|';
        CHECK_MSG(v == listed, "%s: %d values listed, the library names %d", flags[i].flag, v,
                  listed);
    }
    CHECK(run("estimate --model gpt2 --lora-targets q,x", &r));
    CHECK_EQ_INT(r.status, 2);
    CHECK_MSG(strstr(r.err, "want all, or a comma list of q,k,v,o,gate,up,down") != NULL,
              "got %s", r.err);
}

// 10^15 parameters: a real answer (4 PB of fp32 weights) that does not fit, not a wrapped number.
static void test_huge_model(void) {
    run_out r;
    double w = 0, used = 0;
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    CHECK(run("estimate --params 1e15 --seq 16 --json", &r));
    CHECK_EQ_INT(r.status, 1);  // does not fit
    CHECK(json_number(r.out, "weights", &w));
    CHECK_NEAR(w, 4e15, 0, 1e-9);
    CHECK(json_number(r.out, "device_used", &used));
    CHECK(used > 4e15);
    CHECK(strstr(r.out, "\"fits\": false") != NULL);
}

static int temp_file(const char *text, char *path, size_t cap);

// fit: the largest batch fits and one more does not, through the CLI.
static void test_fit_cli(void) {
    run_out r;
    double b = 0, used = 0, cap = 0;
    char args[256];
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    CHECK(run("fit --model gpt2 --seq 1024 --gpu t4 --json", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK(json_number(r.out, "max_batch", &b));
    CHECK(b >= 1);
    snprintf(args, sizeof args, "estimate --model gpt2 --seq 1024 --gpu t4 --batch %.0f --json", b);
    CHECK(run(args, &r));
    CHECK(strstr(r.out, "\"fits\": true") != NULL);
    snprintf(args, sizeof args, "estimate --model gpt2 --seq 1024 --gpu t4 --batch %.0f --json", b + 1);
    CHECK(run(args, &r));
    CHECK(strstr(r.out, "\"fits\": false") != NULL);
    CHECK(json_number(r.out, "device_used", &used) && json_number(r.out, "capacity", &cap));
    CHECK(used > cap);
    CHECK(run("fit --model llama-2-7b --gpu a10g --batch 4 --seq 1024", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK(strstr(r.out, "plan") != NULL);
    CHECK(strstr(r.err, "note: fit runs") == NULL);  // 32 blocks: no note
}

// fit on thousands of blocks says before it starts that it takes seconds, naming the blocks.
static void test_fit_slow_note(void) {
    char path[64], args[160];
    run_out r;
    uint64_t layers = 1000 + mnt_rand_u64() % 200;  // encoder + decoder: over 2000 blocks
    char cfg[320];
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    snprintf(cfg, sizeof cfg, "{\"model_type\": \"t5\", \"d_model\": 64, \"d_ff\": 128, "
             "\"d_kv\": 16, \"num_layers\": %llu, \"num_heads\": 4, \"vocab_size\": 512}",
             (unsigned long long)layers);
    CHECK(temp_file(cfg, path, sizeof path));
    snprintf(args, sizeof args, "fit --config %s --no-replay --seq 64 --json", path);
    CHECK(run(args, &r));
    remove(path);
    CHECK(r.status == 0 || r.status == 1);
    snprintf(cfg, sizeof cfg, "all %llu blocks", (unsigned long long)(2 * layers));
    CHECK_MSG(strstr(r.err, cfg) != NULL, "stderr: %s", r.err);
    CHECK_EQ_INT(count_lines(r.err), 1);
}

static void test_models_and_help(void) {
    run_out r;
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    CHECK(run("models", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK(strstr(r.out, "llama-3-8b") && strstr(r.out, "bert-large-uncased") && strstr(r.out, "h100-80gb"));
    CHECK(run("estimate --help", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK(strstr(r.out, "--checkpointing") != NULL);
    CHECK(run("fit --help", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK(run("estimate --model bert-large-uncased", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK(strstr(r.out, "activations") && strstr(r.out, "FITS"));
    // --parts: one entry per block plus the embeddings and the head, equal for equal blocks
    CHECK(run("estimate --model gpt2 --parts --json", &r));
    CHECK_EQ_INT(r.status, 0);
    {
        mn_json_doc doc;
        const mn_json_value *p;
        CHECK_OK(mn_json_parse(r.out, strlen(r.out), NULL, &doc));
        p = doc.root ? mn_json_get(doc.root, "parts") : NULL;
        CHECK(p && p->type == MN_JSON_ARRAY && p->len == 14);
        if (p && p->len == 14) CHECK(p->items[1].num > 0 && p->items[1].num == p->items[12].num);
        mn_json_free(&doc);
    }
    // the flag=value spelling and PYTORCH_CUDA_ALLOC_CONF-style allocator settings
    CHECK(run("estimate --model=gpt2 --batch=2 --alloc-conf=expandable_segments:True --json", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK(run("estimate --model gpt2 --alloc-conf bogus_key:1", &r));
    CHECK(r.status != 0 && count_lines(r.err) == 1);
}

// --svg and --snapshot write the predicted step: an SVG picture and a memory_viz snapshot whose
// device trace holds as many allocations as the estimate simulated.
static void test_pictures(void) {
    char dir[] = "/tmp/memanat_pic_XXXXXX", args[1024], svg[64], snap[64];
    run_out r;
    FILE *f;
    static char buf[1 << 22];
    size_t n;
    mn_json_doc doc;
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    CHECK(mkdtemp(dir) != NULL);
    snprintf(svg, sizeof svg, "%s/step.svg", dir);
    snprintf(snap, sizeof snap, "%s/step.json", dir);
    snprintf(args, sizeof args, "estimate --model gpt2 --batch 2 --seq 256 --svg %s --snapshot %s --json", svg, snap);
    CHECK(run(args, &r));
    CHECK_EQ_INT(r.status, 0);
    f = fopen(svg, "rb");
    CHECK(f != NULL);
    if (f) {
        n = fread(buf, 1, sizeof buf - 1, f);
        buf[n] = 0;
        fclose(f);
        CHECK(strncmp(buf, "<svg", 4) == 0 && strstr(buf, "</svg>") && strstr(buf, "activations"));
    }
    f = fopen(snap, "rb");
    CHECK(f != NULL);
    if (f) {
        n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        CHECK(n < sizeof buf - 1);
        CHECK_OK(mn_json_parse(buf, n, NULL, &doc));
        if (doc.root) {
            CHECK(mn_json_get(doc.root, "segments") != NULL);
            CHECK(mn_json_get(doc.root, "device_traces") != NULL);
        }
        mn_json_free(&doc);
    }
    remove(svg), remove(snap), rmdir(dir);
    snprintf(args, sizeof args, "estimate --model gpt2 --svg /nonexistent/dir/x.svg");
    CHECK(run(args, &r));
    CHECK(r.status != 0 && count_lines(r.err) == 1);
}

// Writes text to a fresh temporary file whose path goes to path (cap bytes).
static int temp_file(const char *text, char *path, size_t cap) {
    FILE *f;
    int fd;
    snprintf(path, cap, "/tmp/memanat_in_XXXXXX");
    fd = mkstemp(path);
    if (fd < 0) return 0;
    f = fdopen(fd, "w");
    if (!f) return close(fd), 0;
    fputs(text, f);
    fclose(f);
    return 1;
}

// Inputs that were once answered silently and wrongly, read without end, or not placed: each
// exits 2 with one line on stderr that says where (line, column, field), and prints nothing.
static void test_reliability(void) {
    static const struct { const char *file, *args, *where; } bad[] = {
        // an allocation of 2^63 bytes (RMM CSV), which a replay once dropped silently (peak 0)
        {"Thread,Time,Action,Pointer,Size,Stream\n1,1,allocate,0x10,9223372036854775808,0x0\n",
         "replay", "line 2, column 5"},
        // a row with more fields than the header
        {"Thread,Time,Action,Pointer,Size,Stream\n1,1,allocate,0x10,8,0x0\n"
         "1,2,free,0x10,8,0x0,x,y,z,1,2,3,4,5,6,7,8,9,10,11,12,13\n", "replay", "line 3"},
        {"Thread,Time,Action,Pointer,Size,Stream\n1,1,allocate,0x10,12z,0x0\n", "replay",
         "column 5"},
        {"Thread,Time,Action,Pointer,Size,Stream\n1,1,borrow,0x10,8,0x0\n", "replay",
         "column 3"},
        {"{\"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1, \"size\": "
         "1152921504606846976}]]}", "replay", "entry 0"},
        {"{\"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1,", "replay", "column 51"},
        // a stream that is not an integer, once read as stream 0
        {"{\"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1, \"size\": 8, "
         "\"stream\": -1}]]}", "replay", "entry 0"},
        {"{\"model_type\": \"llama\",\n\"hidden_size\": [}", "estimate --config", "line 2"},
    };
    static const char *const refused[] = {  // contradicting or empty options: one line, exit 2
        "estimate --params 1e18",              // a 4 EiB tensor: no allocator grants it
        "estimate --model gpt2 --infer --optim adamw",
        "estimate --model gpt2 --infer --accum 4",
        "estimate --model gpt2 --prompt 100",  // generation only
        "estimate --model gpt2 --lora-rank 8 --lora-targets gate",  // GPT-2 has no gate
        "estimate --model gpt2 --lora-targets q",
        "estimate --model gpt2 --precision bf16 --gpu v100",
        "estimate --model gpt2 --infer --prompt 1000 --new-tokens 1000",  // 1024 positions
        "estimate --model gpt2 --capacity 1B",
        "fit --model gpt2 --infer --checkpointing full",
        "replay /dev/zero",  // endless: ends at the first overlong row
    };
    size_t i;
    char path[64], args[256];
    run_out r;
    if (!have_cli()) SKIP("./memanat not built (make test builds it)");
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(temp_file(bad[i].file, path, sizeof path));
        snprintf(args, sizeof args, "%s %s", bad[i].args, path);
        CHECK(run(args, &r));
        CHECK_MSG(r.status == 2, "`memanat %s` (%.40s) exited %d", args, bad[i].file, r.status);
        CHECK_MSG(count_lines(r.err) == 1 && strstr(r.err, bad[i].where),
                  "`memanat %s` (%.40s): want one line naming %s, got: %s", args, bad[i].file,
                  bad[i].where, r.err);
        CHECK_MSG(r.out[0] == 0, "`memanat %s` printed on stdout: %.80s", args, r.out);
        remove(path);
    }
    for (i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        CHECK(run(refused[i], &r));
        CHECK_MSG(r.status == 2, "`memanat %s` exited %d", refused[i], r.status);
        CHECK_MSG(count_lines(r.err) == 1, "`memanat %s`: %d lines on stderr: %s", refused[i],
                  count_lines(r.err), r.err);
        CHECK_MSG(r.out[0] == 0, "`memanat %s` printed on stdout: %.80s", refused[i], r.out);
    }
    // answered, with one warning line that says what was assumed
    CHECK(run("estimate --params 1 --json", &r));  // below the smallest guessed shape
    CHECK_EQ_INT(r.status, 0);
    CHECK_EQ_INT(count_lines(r.err), 1);
    CHECK(strstr(r.err, "warning") != NULL);
    CHECK(run("estimate --model gpt2 --zero 2 --framework deepspeed --json", &r));
    CHECK_EQ_INT(r.status, 0);
    CHECK_EQ_INT(count_lines(r.err), 1);
    // exit 1: the step does not fit (the answer is printed all the same)
    CHECK(run("estimate --model llama-2-7b --gpu t4 --json", &r));
    CHECK_EQ_INT(r.status, 1);
    CHECK(strstr(r.out, "\"fits\": false") != NULL);
}

const mnt_case test_cli_cases[] = {
    {"pictures", test_pictures},
    {"dev_tsv", test_dev_tsv},
    {"torch2_tsv", test_torch2_tsv},
    {"bad_input", test_bad_input},
    {"choice_values", test_choice_values},
    {"huge_model", test_huge_model},
    {"fit_slow_note", test_fit_slow_note},
    {"fit", test_fit_cli},
    {"models_and_help", test_models_and_help},
    {"reliability", test_reliability},
};
const size_t test_cli_count = sizeof test_cli_cases / sizeof test_cli_cases[0];
