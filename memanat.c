// memanat: the command-line tool over memanat.h.
//
//   memanat estimate [options]   where does the memory go, does it fit
//   memanat fit [options]        largest batch, longest sequence, a plan that fits
//   memanat models               the model presets and the GPU table
//   memanat replay FILE          replay an allocation trace through the caching allocator
//
// Bad input exits with status 2 and one line on stderr naming the problem.
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MEMANAT_IMPLEMENTATION
#include "memanat.h"

// ---- errors -------------------------------------------------------------------------------------

static char first_error[512];

static void capture_log(void *user, mn_log_level level, const char *msg) {
    (void)user;
    if (level == MN_LOG_ERROR && !first_error[0]) snprintf(first_error, sizeof first_error, "%s", msg);
}

static int fail(const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "memanat: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    return 2;
}

// Reports a failed library call with the logged reason when there is one.
static int fail_result(const char *what, mn_result r) {
    if (first_error[0]) return fail("%s", first_error);
    return fail("%s: %s", what, mn_result_str(r));
}

// ---- option parsing ----------------------------------------------------------------------------

// A count: digits with an optional fraction and exponent (7.5e9) or suffix K/M/B/T (10^3 steps).
static int parse_count(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
    char *end;
    double v;
    if (!s || !*s || *s == '-' || *s == '+' || *s == ' ') return 0;
    errno = 0;
    v = strtod(s, &end);
    if (end == s || errno) return 0;
    if (*end == 'K' || *end == 'k') v *= 1e3, end++;
    else if (*end == 'M' || *end == 'm') v *= 1e6, end++;
    else if (*end == 'B' || *end == 'b' || *end == 'G' || *end == 'g') v *= 1e9, end++;
    else if (*end == 'T' || *end == 't') v *= 1e12, end++;
    if (*end || !(v >= (double)lo) || !(v <= (double)hi) || v != floor(v)) return 0;
    *out = (uint64_t)v;
    return 1;
}

typedef struct cli {
    mn_model model;
    mn_setup setup;
    int have_model, json, parts;
    const char *model_src;
    uint64_t params;
    int head_set;
    mn_head head;
    const char *alloc_conf;
    const char *svg, *snapshot;  // estimate: write the predicted step's timeline / memory_viz JSON
} cli;

static const char *estimate_usage =
    "usage: memanat estimate [--model NAME | --config FILE|DIR | --params N] [options]\n"
    "  model:     --model NAME (see `memanat models`), --config config.json or model folder,\n"
    "             --params N (count only; shape guessed), --trainable-params N,\n"
    "             --head lm|classification|none\n"
    "  step:      --batch N --seq N --accum N --checkpointing none|full|selective\n"
    "             --precision fp32|fp16|bf16|fp16-pure|bf16-pure\n"
    "             --optim adamw|adamw-8bit|sgd|sgd-momentum|adafactor|lion|none\n"
    "             --attention eager|sdpa|flash --lora-rank R --lora-targets q,k,v,o,gate,up,down\n"
    "             --quant none|int8|nf4\n"
    "  framework: --framework hf|deepspeed|megatron|memanat --torch 1.10|2 --zero 0..3 --gpus N\n"
    "             --offload none|optimizer|all --zero-grad keep|none\n"
    "  device:    --gpu NAME --capacity SIZE --context SIZE --alloc-conf STR\n"
    "             (SIZE: 512MiB, 16GiB, 80GB; PYTORCH_CUDA_ALLOC_CONF is read when set)\n"
    "  inference: --infer --prompt N --new-tokens N --beams N\n"
    "  output:    --json (one JSON object, byte counts as integers)\n"
    "             --parts (activations each block keeps for backward)\n"
    "             --svg OUT (timeline of the predicted step, stacked by category)\n"
    "             --snapshot OUT (allocator snapshot for pytorch.org/memory_viz)\n";

static const char *fit_usage =
    "usage: memanat fit [same options as estimate]\n"
    "  prints the largest micro-batch and the longest sequence that fit the GPU, and a plan:\n"
    "  the cheapest combination of techniques (mixed precision, 8-bit or factored optimizers,\n"
    "  accumulation, checkpointing, LoRA/QLoRA, ZeRO offload) that fits, ranked by step time.\n";

static int load_model(cli *c, const char *kind, const char *v) {
    mn_result r;
    if (c->have_model) return fail("give one of --model, --config, --params (got %s after %s)", kind, c->model_src);
    c->have_model = 1, c->model_src = kind;
    if (!strcmp(kind, "--model")) {
        if (mn_preset_find(v, &c->model) != MN_OK) return fail("unknown model \"%s\" (see `memanat models`)", v);
    } else if (!strcmp(kind, "--config")) {
        mn_hf_desc d;
        memset(&d, 0, sizeof d);
        d.logger.log_fn = capture_log;
        r = mn_hf_config_read(v, &d, &c->model);
        if (r != MN_OK) {
            if (first_error[0]) return fail("%s: %s", v, first_error);
            return fail("%s: %s", v, mn_result_str(r));
        }
    } else {
        memset(&c->model, 0, sizeof c->model);
        if (!parse_count(v, 1, 1000000000000000000ull, &c->params))
            return fail("--params \"%s\": want a count such as 7e9 or 350M (1 .. 10^18)", v);
        c->model.params = c->params;
    }
    return 0;
}

#define ENUM_OPT(flag, fn, field) \
    if (!strcmp(k, flag)) { \
        if (fn(v, &field) != MN_OK) return fail("%s \"%s\" is not one of the accepted values (see --help)", flag, v); \
        continue; \
    }
#define COUNT_OPT(flag, lo, hi, field, type) \
    if (!strcmp(k, flag)) { \
        uint64_t n_; \
        if (!parse_count(v, lo, hi, &n_)) return fail("%s \"%s\": want a whole number in %llu..%llu", flag, v, \
                                                      (unsigned long long)(lo), (unsigned long long)(hi)); \
        field = (type)n_; \
        continue; \
    }
#define SIZE_OPT(flag, field) \
    if (!strcmp(k, flag)) { \
        if (mn_size_parse(v, &field) != MN_OK || field == 0) \
            return fail("%s \"%s\": want a size such as 16GiB, 80GB or 1343MiB", flag, v); \
        continue; \
    }

static int parse_args(cli *c, int argc, char **argv, const char *usage) {
    int i, rc;
    memset(c, 0, sizeof *c);
    c->setup.logger.log_fn = capture_log;
    for (i = 0; i < argc; i++) {
        char key[64];
        const char *k = argv[i], *v = NULL, *eq;
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) { fputs(usage, stdout); return 1; }
        if (!strcmp(k, "--json")) { c->json = 1; continue; }
        if (!strcmp(k, "--infer")) { c->setup.infer = 1; continue; }
        if (!strcmp(k, "--parts")) { c->parts = 1; continue; }
        if (strncmp(k, "--", 2) != 0) return fail("unexpected argument \"%s\" (see --help)", k);
        eq = strchr(k, '=');
        if (eq) {
            size_t n = (size_t)(eq - k);
            if (n >= sizeof key) return fail("unknown option \"%s\"", k);
            memcpy(key, k, n), key[n] = 0, k = key, v = eq + 1;
        } else {
            if (i + 1 >= argc) return fail("option %s needs a value", k);
            v = argv[++i];
        }
        if (!strcmp(k, "--model") || !strcmp(k, "--config") || !strcmp(k, "--params")) {
            if ((rc = load_model(c, k, v)) != 0) return rc;
            continue;
        }
        COUNT_OPT("--trainable-params", 1, 1000000000000000000ull, c->setup.trainable_params, uint64_t)
        COUNT_OPT("--batch", 1, 1ull << 32, c->setup.batch, uint64_t)
        COUNT_OPT("--seq", 1, 1ull << 26, c->setup.seq, uint64_t)
        COUNT_OPT("--accum", 1, 1ull << 20, c->setup.accum, uint64_t)
        COUNT_OPT("--lora-rank", 1, 65536, c->setup.lora_rank, uint32_t)
        COUNT_OPT("--zero", 0, 3, c->setup.zero_stage, uint32_t)
        COUNT_OPT("--gpus", 1, 1u << 20, c->setup.gpus, uint32_t)
        COUNT_OPT("--prompt", 1, 1ull << 26, c->setup.prompt, uint64_t)
        COUNT_OPT("--new-tokens", 0, 1ull << 26, c->setup.new_tokens, uint64_t)
        COUNT_OPT("--beams", 1, 4096, c->setup.beams, uint32_t)
        ENUM_OPT("--precision", mn_precision_parse, c->setup.precision)
        ENUM_OPT("--optim", mn_optim_parse, c->setup.optim)
        ENUM_OPT("--checkpointing", mn_ckpt_parse, c->setup.checkpointing)
        ENUM_OPT("--attention", mn_attn_parse, c->setup.attention)
        ENUM_OPT("--framework", mn_framework_parse, c->setup.framework)
        ENUM_OPT("--offload", mn_offload_parse, c->setup.offload)
        ENUM_OPT("--quant", mn_quant_parse, c->setup.quant)
        SIZE_OPT("--capacity", c->setup.capacity)
        SIZE_OPT("--context", c->setup.context)
        if (!strcmp(k, "--head")) {
            if (mn_head_parse(v, &c->head) != MN_OK) return fail("--head \"%s\": want lm, classification or none", v);
            c->head_set = 1;
            continue;
        }
        if (!strcmp(k, "--lora-targets")) {
            if (mn_lora_targets_parse(v, &c->setup.lora_targets) != MN_OK)
                return fail("--lora-targets \"%s\": want a comma list of q,k,v,o,gate,up,down (or all)", v);
            continue;
        }
        if (!strcmp(k, "--gpu")) {
            mn_gpu g;
            if (mn_gpu_find(v, &g) != MN_OK) return fail("unknown GPU \"%s\" (see `memanat models`)", v);
            c->setup.gpu = g.name;
            continue;
        }
        if (!strcmp(k, "--torch")) {
            if (!strcmp(v, "1.10") || !strcmp(v, "1")) c->setup.torch_version = 110;
            else if (!strcmp(v, "2") || !strncmp(v, "2.", 2)) c->setup.torch_version = 200;
            else return fail("--torch \"%s\": want 1.10 or 2", v);
            continue;
        }
        if (!strcmp(k, "--zero-grad")) {
            if (!strcmp(v, "keep")) c->setup.grads = MN_GRADS_KEEP;
            else if (!strcmp(v, "none")) c->setup.grads = MN_GRADS_RELEASE;
            else return fail("--zero-grad \"%s\": want keep or none", v);
            continue;
        }
        if (!strcmp(k, "--alloc-conf")) { c->alloc_conf = v; continue; }
        if (!strcmp(k, "--svg")) { c->svg = v; continue; }
        if (!strcmp(k, "--snapshot")) { c->snapshot = v; continue; }
        return fail("unknown option \"%s\" (see --help)", k);
    }
    if (!c->have_model) return fail("no model: give --model NAME, --config FILE or --params N (see --help)");
    if (c->head_set) {
        c->model.head = c->head;
        if (c->head == MN_HEAD_CLASSIFICATION) {
            c->model.lm_transform = 0;
            if (c->model.arch == MN_ARCH_ENCODER) c->model.pooler = 1;
        }
    }
    if (c->params && c->setup.trainable_params > c->params)
        return fail("--trainable-params exceeds --params");
    c->setup.alloc_conf = c->alloc_conf ? c->alloc_conf : getenv("PYTORCH_CUDA_ALLOC_CONF");
    return 0;
}

// ---- output -------------------------------------------------------------------------------------

static void put_size(const char *label, uint64_t bytes, uint64_t of) {
    char buf[32];
    mn_size_format(bytes, buf, sizeof buf);
    if (of) printf("  %-18s %12s  %5.1f%%\n", label, buf, 100.0 * (double)bytes / (double)of);
    else printf("  %-18s %12s\n", label, buf);
}

static void print_table(const mn_estimate_result *r) {
    const mn_setup *s = &r->setup;
    const mn_model *m = &r->model;
    char cap[32], used[32];
    printf("%s: %.3g B parameters (%.3g B trainable), %s\n", m->name, (double)r->params / 1e9,
           (double)r->trainable_params / 1e9, s->infer ? "inference" : "training");
    if (s->infer)
        printf("assumed: batch %llu x beams %u, prompt %llu + %llu new tokens, %s, %s attention\n",
               (unsigned long long)s->batch, s->beams, (unsigned long long)s->prompt,
               (unsigned long long)s->new_tokens, mn_precision_name(s->precision), mn_attn_name(s->attention));
    else
        printf("assumed: batch %llu x seq %llu, accum %llu, %s, %s, checkpointing %s, %s attention,\n"
               "         framework %s (torch %u.%u), zero %u over %u GPU(s), offload %s%s\n",
               (unsigned long long)s->batch, (unsigned long long)s->seq, (unsigned long long)s->accum,
               mn_precision_name(s->precision), mn_optim_name(s->optim), mn_ckpt_name(s->checkpointing),
               mn_attn_name(s->attention), mn_framework_name(s->framework), s->torch_version / 100,
               s->torch_version % 100, s->zero_stage, s->gpus, mn_offload_name(s->offload),
               s->lora_rank ? ", LoRA" : "");
    printf("device: %s, capacity %.0f MiB, context %.0f MiB\n\n", r->gpu.label, (double)r->capacity / 1048576.0,
           (double)r->context / 1048576.0);
    printf("memory per GPU                   size  of device\n");
    put_size("weights", r->weights, r->capacity);
    put_size("master_weights", r->master_weights, r->capacity);
    put_size("gradients", r->gradients, r->capacity);
    put_size("optimizer", r->optimizer, r->capacity);
    put_size("= model_states", r->model_states, r->capacity);
    put_size("activations", r->activations, r->capacity);
    put_size("temporary", r->temporary, r->capacity);
    put_size("kv_cache", r->kv_cache, r->capacity);
    put_size("workspace", r->workspace, r->capacity);
    put_size("peak_allocated", r->peak_allocated, r->capacity);
    put_size("allocator slack", r->peak_reserved - r->peak_allocated, r->capacity);
    put_size("peak_reserved", r->peak_reserved, r->capacity);
    put_size("context", r->context, r->capacity);
    put_size("device_used", r->device_used, r->capacity);
    if (r->cpu_bytes) put_size("host (offloaded)", r->cpu_bytes, 0);
    mn_size_format(r->capacity, cap, sizeof cap);
    mn_size_format(r->device_used, used, sizeof used);
    printf("\npeak during %s; %s of %s: %s\n", mn_phase_name(r->peak_phase), used, cap,
           r->fits ? "FITS" : "DOES NOT FIT");
}

static void json_u64(const char *k, uint64_t v, int *first) {
    printf("%s\"%s\": %llu", *first ? "" : ", ", k, (unsigned long long)v);
    *first = 0;
}

static void json_str(const char *k, const char *v, int *first) {
    printf("%s\"%s\": ", *first ? "" : ", ", k);
    mn_json_fputs_escaped(stdout, v);
    *first = 0;
}

static void print_json_fields(const mn_estimate_result *r, int *f) {
    const mn_setup *s = &r->setup;
    json_u64("weights", r->weights, f);
    json_u64("master_weights", r->master_weights, f);
    json_u64("gradients", r->gradients, f);
    json_u64("optimizer", r->optimizer, f);
    json_u64("model_states", r->model_states, f);
    json_u64("activations", r->activations, f);
    json_u64("temporary", r->temporary, f);
    json_u64("kv_cache", r->kv_cache, f);
    json_u64("workspace", r->workspace, f);
    json_u64("peak_allocated", r->peak_allocated, f);
    json_u64("peak_reserved", r->peak_reserved, f);
    json_u64("context", r->context, f);
    json_u64("device_used", r->device_used, f);
    json_u64("capacity", r->capacity, f);
    printf(", \"fits\": %s", r->fits ? "true" : "false");
    json_u64("cpu_bytes", r->cpu_bytes, f);
    json_u64("params", r->params, f);
    json_u64("trainable_params", r->trainable_params, f);
    json_str("peak_phase", mn_phase_name(r->peak_phase), f);
    json_str("model", r->model.name, f);
    json_str("gpu", r->gpu.name, f);
    json_u64("batch", s->batch, f);
    json_u64("seq", s->seq, f);
    json_u64("accum", s->accum, f);
    json_str("precision", mn_precision_name(s->precision), f);
    json_str("optim", mn_optim_name(s->optim), f);
    json_str("checkpointing", mn_ckpt_name(s->checkpointing), f);
    json_str("attention", mn_attn_name(s->attention), f);
    json_str("framework", mn_framework_name(s->framework), f);
    json_u64("torch_version", s->torch_version, f);
    json_u64("zero", s->zero_stage, f);
    json_u64("gpus", s->gpus, f);
    json_str("offload", mn_offload_name(s->offload), f);
    json_u64("lora_rank", s->lora_rank, f);
    json_str("quant", mn_quant_name(s->quant), f);
    json_str("head", mn_head_name(r->model.head), f);
    printf(", \"infer\": %s", s->infer ? "true" : "false");
    if (s->infer) {
        json_u64("prompt", s->prompt, f);
        json_u64("new_tokens", s->new_tokens, f);
        json_u64("beams", s->beams, f);
    }
}

static mn_result write_file(void *user, const char *data, size_t len) {
    return fwrite(data, 1, len, (FILE *)user) == len ? MN_OK : MN_ERR_IO;
}

// Replays the predicted step through the allocator with its history on, then writes the
// timeline picture and/or the snapshot. Files are written to a temporary name and renamed.
static int write_pictures(const cli *c, const mn_estimate_result *r) {
    const char *paths[2] = {c->svg, c->snapshot};
    mn_simdev dev;
    mn_simdev_desc dd;
    mn_cache cache;
    mn_cache_desc cd;
    mn_cache_snapshot snap;
    mn_result res;
    int i, rc = 0, have_snap = 0;
    char title[160], tmp[4096];
    memset(&dd, 0, sizeof dd);
    memset(&cd, 0, sizeof cd);
    if ((res = mn_simdev_init(&dev, &dd)) != MN_OK) return fail_result("simulated device", res);
    cd.device = mn_simdev_device(&dev);
    cd.config = c->setup.alloc_conf;
    cd.trace_entries = (uint32_t)(r->alloc_events * 6 + 64 < 8000000 ? r->alloc_events * 6 + 64 : 8000000);
    cd.logger.log_fn = capture_log;
    if ((res = mn_cache_init(&cache, &cd)) != MN_OK) {
        mn_simdev_free(&dev);
        return fail_result("allocator", res);
    }
    res = mn_estimate_replay(&c->model, &c->setup, NULL, &cache);
    if (res == MN_OK) res = mn_cache_snapshot_take(&cache, &snap);
    if (res == MN_OK) have_snap = 1;
    else rc = fail_result("replay", res);
    snprintf(title, sizeof title, "%s: batch %llu x seq %llu, %s, %s (predicted)", r->model.name,
             (unsigned long long)r->setup.batch, (unsigned long long)r->setup.seq,
             mn_precision_name(r->setup.precision), mn_optim_name(r->setup.optim));
    for (i = 0; i < 2 && rc == 0; i++) {
        FILE *f;
        if (!paths[i]) continue;
        snprintf(tmp, sizeof tmp, "%s.tmp", paths[i]);
        f = fopen(tmp, "wb");
        if (!f) { rc = fail("cannot write %s: %s", tmp, strerror(errno)); break; }
        res = i == 0 ? mn_cache_timeline_svg(&snap, title, write_file, f) : mn_cache_snapshot_write_json(&snap, write_file, f);
        if (fclose(f) != 0 && res == MN_OK) res = MN_ERR_IO;
        if (res != MN_OK || rename(tmp, paths[i]) != 0) {
            remove(tmp);
            rc = fail("cannot write %s: %s", paths[i], mn_result_str(res == MN_OK ? MN_ERR_IO : res));
        }
    }
    if (have_snap) mn_cache_snapshot_free(&snap);
    mn_cache_free(&cache);
    mn_simdev_free(&dev);
    return rc;
}

// Activations kept per part of the model (*parts is malloc'ed, *n entries; none for inference).
static int compute_parts(const cli *c, const mn_estimate_result *r, uint64_t **parts, uint32_t *n) {
    uint32_t blocks = (uint32_t)(r->model.arch == MN_ARCH_STACK ? r->model.stack_len
                                                                 : r->model.layers + r->model.encoder_layers);
    mn_result res;
    *parts = NULL, *n = 0;
    if (!c->parts || r->setup.infer) return 0;
    *parts = (uint64_t *)calloc((size_t)blocks + 2, sizeof **parts);
    if (!*parts) return fail("out of memory");
    res = mn_estimate_parts(&c->model, &c->setup, *parts, blocks + 2, n);
    if (res != MN_OK) return fail_result("parts", res);
    return 0;
}

// Equal neighbouring blocks are printed as one row.
static void print_parts(const cli *c, const mn_estimate_result *r, const uint64_t *parts, uint32_t n) {
    uint32_t i, j;
    char a[32], b[32];
    if (!parts) return;
    if (c->json) {
        printf(", \"parts\": [");
        for (i = 0; i < n; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)parts[i]);
        printf("]");
        return;
    }
    printf("\nactivations kept for backward (second step, first micro-batch):\n");
    mn_size_format(parts[0], a, sizeof a);
    printf("  %-28s %12s\n", r->model.arch == MN_ARCH_STACK ? "input" : "embeddings", a);
    for (i = 1; i + 1 < n; i = j) {
        char label[64];
        for (j = i + 1; j + 1 < n && parts[j] == parts[i]; j++) continue;
        mn_size_format(parts[i], a, sizeof a);
        mn_size_format(parts[i] * (j - i), b, sizeof b);
        if (j - i == 1) snprintf(label, sizeof label, "%s %u", r->model.arch == MN_ARCH_STACK ? "layer" : "block", i);
        else snprintf(label, sizeof label, "%s %u-%u, each", r->model.arch == MN_ARCH_STACK ? "layers" : "blocks", i, j - 1);
        printf("  %-28s %12s  (%s)\n", label, a, b);
    }
    mn_size_format(parts[n - 1], a, sizeof a);
    printf("  %-28s %12s\n", r->model.arch == MN_ARCH_STACK ? "loss" : "final norm and head", a);
}

static int cmd_estimate(int argc, char **argv) {
    cli c;
    mn_estimate_result r;
    mn_result res;
    uint64_t *parts = NULL;
    uint32_t nparts = 0;
    int rc = parse_args(&c, argc, argv, estimate_usage), f = 1;
    if (rc) return rc == 1 ? 0 : rc;
    res = mn_estimate(&c.model, &c.setup, &r);
    if (res != MN_OK) return fail_result("estimate", res);
    if ((c.svg || c.snapshot) && (rc = write_pictures(&c, &r)) != 0) return rc;
    if ((rc = compute_parts(&c, &r, &parts, &nparts)) != 0) {
        free(parts);
        return rc;
    }
    if (c.json) {
        printf("{");
        print_json_fields(&r, &f);
        print_parts(&c, &r, parts, nparts);
        printf("}\n");
    } else {
        print_table(&r);
        print_parts(&c, &r, parts, nparts);
    }
    free(parts);
    return 0;
}

static int cmd_fit(int argc, char **argv) {
    cli c;
    mn_fit_result fr;
    mn_result res;
    uint32_t i;
    int rc = parse_args(&c, argc, argv, fit_usage), f = 1;
    if (rc) return rc == 1 ? 0 : rc;
    res = mn_fit(&c.model, &c.setup, &fr);
    if (res != MN_OK) return fail_result("fit", res);
    if (c.json) {
        printf("{\"max_batch\": %llu, \"max_seq\": %llu, \"plan_found\": %s, \"plan_slowdown\": %.3f, \"plan\": [",
               (unsigned long long)fr.max_batch, (unsigned long long)fr.max_seq, fr.plan_found ? "true" : "false",
               fr.plan_slowdown);
        for (i = 0; i < fr.plan_len; i++) {
            printf("%s{\"what\": ", i ? ", " : "");
            mn_json_fputs_escaped(stdout, fr.plan[i].what);
            printf(", \"why\": ");
            mn_json_fputs_escaped(stdout, fr.plan[i].why);
            printf("}");
        }
        printf("], \"estimate\": {");
        print_json_fields(&fr.plan_estimate, &f);
        printf("}}\n");
        return 0;
    }
    printf("%s on %s (%.0f MiB):\n", fr.plan_estimate.model.name, fr.plan_estimate.gpu.label,
           (double)fr.plan_estimate.capacity / 1048576.0);
    printf("  largest micro-batch at seq %llu: %llu\n", (unsigned long long)c.setup.seq ? (unsigned long long)c.setup.seq : (unsigned long long)fr.plan_estimate.setup.seq,
           (unsigned long long)fr.max_batch);
    printf("  longest sequence at batch %llu: %llu\n", (unsigned long long)(c.setup.batch ? c.setup.batch : 1),
           (unsigned long long)fr.max_seq);
    if (fr.plan_len == 0 && fr.plan_found) printf("  the setup fits as given: no change needed\n");
    else if (fr.plan_len) printf("  plan (cheapest in speed first):\n");
    for (i = 0; i < fr.plan_len; i++) printf("    %u. %-45s %s\n", i + 1, fr.plan[i].what, fr.plan[i].why);
    if (!fr.plan_found) printf("  no combination of the techniques fits this device\n");
    else if (fr.plan_len) printf("  estimated step time x%.2f of the setup as given\n", fr.plan_slowdown);
    printf("\n");
    print_table(&fr.plan_estimate);
    return 0;
}

static int cmd_models(int argc, char **argv) {
    uint32_t i;
    (void)argv;
    if (argc > 0 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
        printf("usage: memanat models\n  lists the model presets (for --model) and the GPUs (for --gpu)\n");
        return 0;
    }
    if (argc > 0) return fail("models takes no arguments (got \"%s\")", argv[0]);
    printf("%-20s %-16s %7s %7s %6s %5s %8s %9s\n", "model", "architecture", "params", "layers", "hidden", "heads",
           "kv_heads", "vocab");
    for (i = 0; i < mn_preset_count(); i++) {
        const mn_model *m = mn_preset_get(i);
        uint64_t n = 0;
        mn_model_params(m, &n);
        printf("%-20s %-16s %6.2fB %7llu %6llu %5llu %8llu %9llu\n", m->name, mn_arch_name(m->arch), (double)n / 1e9,
               (unsigned long long)m->layers, (unsigned long long)m->hidden, (unsigned long long)m->heads,
               (unsigned long long)(m->kv_heads ? m->kv_heads : m->heads), (unsigned long long)m->vocab);
    }
    printf("\n%-12s %-24s %10s %12s %5s\n", "gpu", "name", "capacity", "context", "bf16");
    for (i = 0; i < mn_gpu_count(); i++) {
        const mn_gpu *g = mn_gpu_get(i);
        printf("%-12s %-24s %6.0f MiB %8.0f MiB %5s\n", g->name, g->label, (double)g->capacity / 1048576.0,
               (double)g->context / 1048576.0, g->bf16 ? "yes" : "no");
    }
    return 0;
}

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

int main(int argc, char **argv) {
    static const char *usage =
        "usage: memanat COMMAND [options]   (memanat COMMAND --help for each)\n"
        "  estimate   memory breakdown of a training step or a generation, and whether it fits\n"
        "  fit        largest batch, longest sequence, and a plan that fits the GPU\n"
        "  models     model presets and GPUs\n"
        "  replay     replay an allocation trace (RMM CSV, PyTorch snapshot) through the allocator\n";
    if (argc < 2) {
        fputs(usage, stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        fputs(usage, stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("memanat %s\n", MEMANAT_VERSION);
        return 0;
    }
    if (!strcmp(argv[1], "estimate")) return cmd_estimate(argc - 2, argv + 2);
    if (!strcmp(argv[1], "fit")) return cmd_fit(argc - 2, argv + 2);
    if (!strcmp(argv[1], "models")) return cmd_models(argc - 2, argv + 2);
    if (!strcmp(argv[1], "replay")) return mn_cli_replay(argc - 2, argv + 2);
    return fail("unknown command \"%s\" (estimate, fit, models, replay)", argv[1]);
}
