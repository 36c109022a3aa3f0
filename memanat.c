// memanat: the command-line tool over memanat.h.
//
//   memanat estimate [options]   where does the memory go, does it fit
//   memanat fit [options]        largest batch, longest sequence, a plan that fits
//   memanat models               the model presets and the GPU table
//   memanat replay FILE          replay an allocation trace through the caching allocator
//
// Exit status: 0 ok, 1 does not fit (estimate) or no plan fits (fit), 2 bad input, with one line
// on stderr naming the problem (warnings, each once, start with "memanat: warning:").
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

// Warnings go to stderr as they come, each text once (fit runs many estimates of one setup);
// the first error is kept for the one line the command prints when it fails.
static void capture_log(void *user, mn_log_level level, const char *msg) {
    static unsigned long long seen[16];
    static unsigned nseen;
    unsigned long long h = 1469598103934665603ull;
    const char *p;
    unsigned i;
    (void)user;
    if (level == MN_LOG_ERROR && !first_error[0])
        snprintf(first_error, sizeof first_error, "%s", msg);
    if (level != MN_LOG_WARN) return;
    for (p = msg; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;  // FNV-1a
    for (i = 0; i < nseen; i++)
        if (seen[i] == h) return;
    if (nseen < sizeof seen / sizeof seen[0]) seen[nseen++] = h;
    fprintf(stderr, "memanat: warning: %s\n", msg);
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

// ---- options: one table for every command, one parser -------------------------------------------
//
// The CLI checks only what it must to fill a field (a count, a size, a name); the library checks
// every range and says why a value is refused, and the CLI prints that reason.

enum { CMD_ESTIMATE = 1, CMD_FIT = 2, CMD_REPLAY = 4, CMD_STEP = CMD_ESTIMATE | CMD_FIT };

typedef struct cli {
    mn_model model;
    mn_setup setup;              // replay uses setup.capacity
    int have_model, json, parts, explain, no_replay;
    const char *model_src;
    uint64_t params;
    int head_set;
    mn_head head;
    const char *alloc_conf;      // --alloc-conf, else from the environment (env_alloc_conf)
    const char *svg, *snapshot;  // the timeline picture / the memory_viz JSON to write
    const char *trace;           // replay: the trace file
    const char *seq_lengths;     // --seq-lengths FILE or MIN:MAX:MEAN
    uint32_t len_steps;          // --steps
    uint64_t len_seed;           // --seed
    double percentile;           // --percentile, 0 = the library's default
} cli;

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

static int opt_model(cli *c, const char *flag, const char *v) {
    mn_hf_desc d;
    mn_result r;
    if (c->have_model)
        return fail("give one of --model, --config, --params (got %s after %s)", flag,
                    c->model_src);
    c->have_model = 1, c->model_src = flag;
    if (!strcmp(flag, "--model")) {
        const char *near;
        if (mn_preset_find(v, &c->model) == MN_OK) return 0;
        near = mn_preset_closest(v);  // (only for a name not found: it looks the name up again)
        return fail("unknown model \"%s\"%s%s%s (see `memanat models`)", v,
                    near ? "; did you mean " : "", near ? near : "", near ? "?" : "");
    }
    if (!strcmp(flag, "--params")) {
        memset(&c->model, 0, sizeof c->model);
        if (!parse_count(v, 1, 1000000000000000000ull, &c->params))
            return fail("--params \"%s\": want a count such as 7e9 or 350M (1 .. 10^18)", v);
        c->model.params = c->params;
        return 0;
    }
    memset(&d, 0, sizeof d);
    d.logger.log_fn = capture_log;
    r = mn_hf_config_read(v, &d, &c->model);
    if (r == MN_OK) return 0;
    if (first_error[0])  // the reader's message names the file unless it is about the JSON
        return strstr(first_error, v) ? fail("%s", first_error) : fail("%s: %s", v, first_error);
    return fail("%s: %s", v, mn_result_str(r));
}

static int opt_head(cli *c, const char *flag, const char *v) {
    (void)flag;
    if (mn_head_parse(v, &c->head) != MN_OK)
        return fail("--head \"%s\": want lm, classification or none", v);
    c->head_set = 1;
    return 0;
}

static int opt_torch(cli *c, const char *flag, const char *v) {
    (void)flag;
    if (!strcmp(v, "1.10") || !strcmp(v, "1")) c->setup.torch_version = 110;
    else if (!strcmp(v, "2") || !strncmp(v, "2.", 2)) c->setup.torch_version = 200;
    else return fail("--torch \"%s\": want 1.10 or 2", v);
    return 0;
}

// X.Y.Z -> X * 10000 + Y * 100 + Z (0.43.1 -> 4301).
static int opt_bnb_version(cli *c, const char *flag, const char *v) {
    unsigned x, y, z;
    int n = 0;
    (void)flag;
    if (sscanf(v, "%3u.%2u.%2u%n", &x, &y, &z, &n) != 3 || v[n] || v[0] < '0' || v[0] > '9' ||
        x > 99 || (x == 0 && y == 0 && z == 0))
        return fail("--bnb-version \"%s\": want a bitsandbytes release such as 0.43.1", v);
    c->setup.bnb_version = x * 10000 + y * 100 + z;
    return 0;
}

static int opt_quant_head(cli *c, const char *flag, const char *v) {
    (void)flag;
    if (!strcmp(v, "yes")) c->setup.quant_head = 1;
    else if (!strcmp(v, "no")) c->setup.quant_head = 0;
    else return fail("--quant-head \"%s\": want yes or no", v);
    return 0;
}

static int opt_percentile(cli *c, const char *flag, const char *v) {
    char *end;
    double p;
    (void)flag;
    errno = 0;
    p = strtod(v, &end);
    if (end == v || *end || errno || !(p > 0 && p <= 100))
        return fail("--percentile \"%s\": want a number above 0, at most 100", v);
    c->percentile = p;
    return 0;
}

static int opt_lora_dropout(cli *c, const char *flag, const char *v) {
    char *end = NULL;
    double p = strtod(v, &end);
    (void)flag;
    if (!end || end == v || *end || !(p >= 0.0 && p < 1.0))
        return fail("--lora-dropout \"%s\": want a probability 0 <= p < 1", v);
    c->setup.lora_dropout = (float)p;
    return 0;
}

static int opt_zero_grad(cli *c, const char *flag, const char *v) {
    (void)flag;
    if (!strcmp(v, "keep")) c->setup.grads = MN_GRADS_KEEP;
    else if (!strcmp(v, "none")) c->setup.grads = MN_GRADS_RELEASE;
    else return fail("--zero-grad \"%s\": want keep or none", v);
    return 0;
}

// The library's name parsers, each behind one signature.
#define CHOICE(fn, type) \
    static int choice_##fn(const char *v, void *out) { return fn(v, (type *)out) == MN_OK; }
CHOICE(mn_precision_parse, mn_precision)
CHOICE(mn_optim_parse, mn_optim)
CHOICE(mn_ckpt_parse, mn_ckpt)
CHOICE(mn_attn_parse, mn_attn)
CHOICE(mn_framework_parse, mn_framework)
CHOICE(mn_offload_parse, mn_offload)
CHOICE(mn_quant_parse, mn_quant)
CHOICE(mn_optim_impl_parse, mn_optim_impl)
CHOICE(mn_loop_parse, mn_loop)
CHOICE(mn_lora_targets_parse, uint32_t)

typedef enum opt_kind {
    OPT_FLAG,    // int field = 1, no value
    OPT_U64,     // a count into a uint64_t field, at least min
    OPT_U32,     // a count into a uint32_t field, at least min
    OPT_SIZE,    // a byte size ("16GiB") into a uint64_t field, not 0
    OPT_TEXT,    // the value itself into a const char * field
    OPT_CHOICE,  // a name through a library parser
    OPT_FN       // a function of its own
} opt_kind;

typedef struct opt {
    const char *flag;
    unsigned commands;                        // CMD_* bits
    opt_kind kind;
    size_t field;                             // offsetof(cli, ...)
    uint64_t min;                             // OPT_U64, OPT_U32
    int (*choice)(const char *v, void *out);  // OPT_CHOICE
    int (*fn)(cli *c, const char *flag, const char *v);  // OPT_FN
} opt;

// One row per option; the macros name each row's kind.
#define F(member) offsetof(cli, member)
#define FN(flag, fn) {flag, CMD_STEP, OPT_FN, 0, 0, NULL, fn}
#define U64(flag, member, min) {flag, CMD_STEP, OPT_U64, F(member), min, NULL, NULL}
#define U32(flag, member, min) {flag, CMD_STEP, OPT_U32, F(member), min, NULL, NULL}
#define CHOOSE(flag, member, parse) {flag, CMD_STEP, OPT_CHOICE, F(member), 0, choice_##parse, NULL}
#define KIND(flag, commands, kind, member) {flag, commands, kind, F(member), 0, NULL, NULL}
static const opt options[] = {
    FN("--model", opt_model),
    FN("--config", opt_model),
    FN("--params", opt_model),
    FN("--head", opt_head),
    U64("--trainable-params", setup.trainable_params, 1),
    U64("--batch", setup.batch, 1),
    U64("--seq", setup.seq, 1),
    U64("--accum", setup.accum, 1),
    KIND("--seq-lengths", CMD_ESTIMATE, OPT_TEXT, seq_lengths),
    {"--steps", CMD_ESTIMATE, OPT_U32, F(len_steps), 2, NULL, NULL},
    {"--seed", CMD_ESTIMATE, OPT_U64, F(len_seed), 0, NULL, NULL},
    {"--percentile", CMD_ESTIMATE, OPT_FN, 0, 0, NULL, opt_percentile},
    CHOOSE("--precision", setup.precision, mn_precision_parse),
    CHOOSE("--optim", setup.optim, mn_optim_parse),
    CHOOSE("--checkpointing", setup.checkpointing, mn_ckpt_parse),
    CHOOSE("--attention", setup.attention, mn_attn_parse),
    U32("--lora-rank", setup.lora_rank, 1),
    FN("--lora-dropout", opt_lora_dropout),
    CHOOSE("--optim-impl", setup.optim_impl, mn_optim_impl_parse),
    CHOOSE("--loop", setup.loop, mn_loop_parse),
    CHOOSE("--lora-targets", setup.lora_targets, mn_lora_targets_parse),
    CHOOSE("--quant", setup.quant, mn_quant_parse),
    FN("--bnb-version", opt_bnb_version),
    FN("--quant-head", opt_quant_head),
    CHOOSE("--framework", setup.framework, mn_framework_parse),
    FN("--torch", opt_torch),
    U32("--zero", setup.zero_stage, 0),
    U32("--gpus", setup.gpus, 1),
    CHOOSE("--offload", setup.offload, mn_offload_parse),
    FN("--zero-grad", opt_zero_grad),
    KIND("--gpu", CMD_STEP, OPT_TEXT, setup.gpu),
    KIND("--context", CMD_STEP, OPT_SIZE, setup.context),
    KIND("--infer", CMD_STEP, OPT_FLAG, setup.infer),
    U64("--prompt", setup.prompt, 1),
    U64("--new-tokens", setup.new_tokens, 0),
    U32("--beams", setup.beams, 1),
    KIND("--no-replay", CMD_STEP, OPT_FLAG, no_replay),
    KIND("--parts", CMD_ESTIMATE, OPT_FLAG, parts),
    KIND("--explain", CMD_ESTIMATE, OPT_FLAG, explain),
    KIND("--snapshot", CMD_ESTIMATE, OPT_TEXT, snapshot),
    KIND("--config", CMD_REPLAY, OPT_TEXT, alloc_conf),  // replay's older name for --alloc-conf
    KIND("--alloc-conf", CMD_STEP | CMD_REPLAY, OPT_TEXT, alloc_conf),
    KIND("--capacity", CMD_STEP | CMD_REPLAY, OPT_SIZE, setup.capacity),
    KIND("--svg", CMD_ESTIMATE | CMD_REPLAY, OPT_TEXT, svg),
    KIND("--json", CMD_STEP | CMD_REPLAY, OPT_FLAG, json),
};
#undef F
#undef FN
#undef U64
#undef U32
#undef CHOOSE
#undef KIND

static const opt *find_option(unsigned command, const char *flag) {
    size_t i;
    for (i = 0; i < sizeof options / sizeof options[0]; i++)
        if ((options[i].commands & command) && !strcmp(options[i].flag, flag)) return &options[i];
    return NULL;
}

static const char *estimate_usage;

// Stores one value. 0, or the exit status after printing why the value is refused.
static int set_option(cli *c, const opt *o, const char *v) {
    char *field = (char *)c + o->field;
    uint64_t n = 0;
    switch (o->kind) {
    case OPT_FLAG: *(int *)(void *)field = 1; return 0;
    case OPT_TEXT: *(const char **)(void *)field = v; return 0;
    case OPT_FN: return o->fn(c, o->flag, v);
    case OPT_CHOICE:
        if (!o->choice(v, field)) {
            // the values as estimate's usage lists them after the flag (a|b|c, or a list a,b,c)
            size_t len = strlen(o->flag);
            const char *at = estimate_usage;
            int n = 0;
            while ((at = strstr(at, o->flag)) != NULL && at[len] != ' ') at += len;
            if (at) at += len + 1;
            while (at && at[n] && at[n] != ' ' && at[n] != '\n') n++;
            if (at && memchr(at, '|', (size_t)n))
                return fail("%s \"%s\": want one of %.*s", o->flag, v, n, at);
            if (at && memchr(at, ',', (size_t)n))
                return fail("%s \"%s\": want all, or a comma list of %.*s", o->flag, v, n, at);
            return fail("%s \"%s\" is not one of the accepted values (see --help)", o->flag, v);
        }
        return 0;
    case OPT_SIZE:
        if (mn_size_parse(v, &n) != MN_OK || n == 0)
            return fail("%s \"%s\": want a size such as 16GiB, 80GB or 1343MiB", o->flag, v);
        *(uint64_t *)(void *)field = n;
        return 0;
    case OPT_U64:
    case OPT_U32: {
        uint64_t hi = o->kind == OPT_U32 ? UINT32_MAX : 1000000000000000000ull;
        if (!parse_count(v, o->min, hi, &n))
            return fail("%s \"%s\": want a whole number from %llu to %llu", o->flag, v,
                        (unsigned long long)o->min, (unsigned long long)hi);
        if (o->kind == OPT_U32) *(uint32_t *)(void *)field = (uint32_t)n;
        else *(uint64_t *)(void *)field = n;
        return 0;
    }
    }
    return fail("%s: unhandled option kind", o->flag);
}

// PyTorch reads PYTORCH_ALLOC_CONF, and PYTORCH_CUDA_ALLOC_CONF as its older alias.
static const char *env_alloc_conf(void) {
    const char *v = getenv("PYTORCH_ALLOC_CONF");
    return v ? v : getenv("PYTORCH_CUDA_ALLOC_CONF");
}

// Fills c from argv (the words after the command). Returns 0, 1 after printing the usage for
// --help, or the exit status after printing why the arguments are refused.
static int parse_args(cli *c, unsigned command, int argc, char **argv, const char *usage) {
    int i, rc;
    memset(c, 0, sizeof *c);
    c->setup.logger.log_fn = capture_log;
    for (i = 0; i < argc; i++) {
        char key[64];
        const char *k = argv[i], *v = NULL, *eq = strchr(k, '=');
        const opt *o;
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) { fputs(usage, stdout); return 1; }
        if (k[0] == '-' && k[1] && k[1] != '-')
            return fail("unknown option \"%s\" (see --help)", k);
        if (strncmp(k, "--", 2) != 0) {
            if (command != CMD_REPLAY) return fail("unexpected argument \"%s\" (see --help)", k);
            if (c->trace)
                return fail("more than one trace file (\"%s\" after \"%s\")", k, c->trace);
            c->trace = k;
            continue;
        }
        if (eq) {  // --flag=value
            size_t n = (size_t)(eq - k);
            if (n >= sizeof key) return fail("unknown option \"%s\"", k);
            memcpy(key, k, n), key[n] = 0, k = key, v = eq + 1;
        }
        if (!(o = find_option(command, k))) return fail("unknown option \"%s\" (see --help)", k);
        if (o->kind == OPT_FLAG && v) return fail("option %s takes no value", k);
        if (o->kind != OPT_FLAG && !v) {
            if (i + 1 >= argc) return fail("option %s needs a value", k);
            v = argv[++i];
        }
        if ((rc = set_option(c, o, v)) != 0) return rc;
    }
    {  // the allocator settings, checked here so that the message names where they came from
        const char *src = c->alloc_conf ? "--alloc-conf"
                          : getenv("PYTORCH_ALLOC_CONF") ? "PYTORCH_ALLOC_CONF"
                                                         : "PYTORCH_CUDA_ALLOC_CONF";
        mn_cache_config cfg;
        mn_logger lg;
        if (!c->alloc_conf) c->alloc_conf = env_alloc_conf();
        lg.log_fn = capture_log, lg.user_data = NULL;
        if (c->alloc_conf && mn_cache_config_parse(c->alloc_conf, &cfg, &lg) != MN_OK)
            return fail("%s \"%s\": %s", src, c->alloc_conf,
                        first_error[0] ? first_error : "not an allocator setting");
    }
    c->setup.alloc_conf = c->alloc_conf;
    if (command == CMD_REPLAY) {
        if (!c->trace)
            return fail("missing trace FILE (usage: memanat replay FILE [options], see --help)");
        return 0;
    }
    if (!c->have_model)
        return fail("no model: give --model NAME, --config FILE or --params N (see --help)");
    if (c->head_set) {
        c->model.head = c->head;
        if (c->head == MN_HEAD_CLASSIFICATION) {
            c->model.lm_transform = 0;
            if (c->model.arch == MN_ARCH_ENCODER) c->model.pooler = 1;
        }
    }
    if (c->params && c->setup.trainable_params > c->params)
        return fail("--trainable-params exceeds --params");
    if (c->setup.lora_targets && !c->setup.lora_rank)
        return fail("--lora-targets without --lora-rank: give the adapters' rank (e.g. 16)");
    c->setup.no_replay = c->no_replay;
    return 0;
}

// A step of millions of allocations takes seconds to replay through the allocator: say so, and
// name the faster mode (peak reserved is then taken as peak allocated).
static void note_slow(const mn_estimate_result *r) {
    if (r->setup.no_replay || r->alloc_events < 1000000) return;
    fprintf(stderr, "memanat: note: the step makes %.1f M allocations; replaying them through the "
            "allocator takes most of the time (--no-replay skips it: peak reserved = peak "
            "allocated)\n", (double)r->alloc_events / 1e6);
}

// A fit runs 10 to 25 estimates of the whole step (the two searches, the plan's greedy pass, its
// pruning and its report), each through every block: on thousands of blocks that takes seconds.
// Say so before it starts, and name the faster answer (one estimate of the setup as given).
static void note_slow_fit(const mn_model *m) {
    uint64_t blocks = m->layers + m->encoder_layers;
    if (m->arch == MN_ARCH_ENCODER_DECODER && !m->encoder_layers) blocks += m->layers;  // 0 = same
    if (blocks < 2000) return;
    fprintf(stderr, "memanat: note: fit runs 10 to 25 estimates of the step, each through all "
            "%llu blocks: seconds at this depth (memanat estimate answers one setup in one)\n",
            (unsigned long long)blocks);
}

// ---- files ------------------------------------------------------------------------------------

typedef struct snapshot_file {
    const mn_cache_snapshot *snap;
    const char *svg_title;  // set: the timeline picture; NULL: the memory_viz JSON
} snapshot_file;

static mn_result snapshot_body(void *ctx, FILE *f) {
    const snapshot_file *s = (const snapshot_file *)ctx;
    return s->svg_title ? mn_cache_timeline_svg(s->snap, s->svg_title, mn_cache_write_file, f)
                        : mn_cache_snapshot_write_json(s->snap, mn_cache_write_file, f);
}

// Writes the snapshot's timeline picture (svg_title set) or its memory_viz JSON to path, so that
// a failed write loses nothing (mn_write_file_atomic).
static int write_snapshot_file(const char *path, const mn_cache_snapshot *snap,
                               const char *svg_title) {
    snapshot_file s;
    mn_result r;
    s.snap = snap, s.svg_title = svg_title;
    r = mn_write_file_atomic(path, snapshot_body, &s);
    return r == MN_OK ? 0 : fail("cannot write %s: %s", path, mn_result_str(r));
}

// Writes the timeline picture and/or the memory_viz snapshot of a cache that kept its history.
static int write_pictures(mn_cache *cache, const char *svg, const char *snapshot,
                          const char *title) {
    mn_cache_snapshot snap;
    mn_result r = mn_cache_snapshot_take(cache, &snap);
    int rc = 0;
    if (r != MN_OK) return fail("snapshot: %s", mn_result_str(r));
    if (svg) rc = write_snapshot_file(svg, &snap, title);
    if (!rc && snapshot) rc = write_snapshot_file(snapshot, &snap, NULL);
    mn_cache_snapshot_free(&snap);
    return rc;
}

// ---- estimate and fit ---------------------------------------------------------------------------

static const char *estimate_usage =
    "usage: memanat estimate [--model NAME | --config FILE|DIR | --params N] [options]\n"
    "  model:     --model NAME (see `memanat models`), --config config.json or model folder,\n"
    "             --params N (count only; shape guessed), --trainable-params N,\n"
    "             --head lm|classification|none\n"
    "  step:      --batch N --seq N --accum N --checkpointing none|full|selective\n"
    "             --precision fp32|fp16|bf16|fp16-pure|bf16-pure\n"
    "             --optim adamw|adamw-8bit|sgd|sgd-momentum|adafactor|lion|none\n"
    "             --attention eager|sdpa|flash --lora-rank R --lora-targets q,k,v,o,gate,up,down\n"
    "             --quant none|int8|nf4|nf4-dq|fp4|fp4-dq (bitsandbytes; -dq: double quant)\n"
    "             --bnb-version X.Y.Z (before 0.43.2 a 4-bit linear keeps its input)\n"
    "             --quant-head yes|no (quantize an untied LM head too; transformers: no)\n"
    "             --lora-dropout P --optim-impl foreach|fused|loop\n"
    "  lengths:   --seq-lengths FILE|MIN:MAX:MEAN (instead of --seq: FILE has lines LENGTH\n"
    "             or LENGTH COUNT) --steps N (32) --seed N (0) --percentile P (99)\n"
    "  framework: --framework hf|deepspeed|megatron|memanat --torch 1.10|2 --zero 0..3 --gpus N\n"
    "             --offload none|optimizer|all --zero-grad keep|none --loop plain|trainer\n"
    "  device:    --gpu NAME --capacity SIZE --context SIZE --alloc-conf STR\n"
    "             (SIZE: 512MiB, 16GiB, 80GB; PYTORCH_CUDA_ALLOC_CONF is read when set)\n"
    "  inference: --infer --prompt N --new-tokens N --beams N\n"
    "  output:    --json (one JSON object, byte counts as integers)\n"
    "             --parts (activations each block keeps for backward)\n"
    "             --explain (every buffer alive at the peak, by the mechanism that made it)\n"
    "             --svg OUT (timeline of the predicted step, stacked by category)\n"
    "             --snapshot OUT (allocator snapshot for pytorch.org/memory_viz)\n"
    "  speed:     --no-replay (skip the allocator replay: peak reserved = peak allocated)\n";

static const char *fit_usage =
    "usage: memanat fit [same options as estimate]\n"
    "  prints the largest micro-batch and the longest sequence that fit the GPU, and a plan:\n"
    "  the cheapest combination of techniques (mixed precision, 8-bit or factored optimizers,\n"
    "  accumulation, checkpointing, LoRA/QLoRA, ZeRO offload) that fits, ranked by step time.\n";

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
               (unsigned long long)s->new_tokens, mn_precision_name(s->precision),
               mn_attn_name(s->attention));
    else
        printf(
            "assumed: batch %llu x seq %llu, accum %llu, %s, %s, checkpointing %s, %s attention,\n"
            "         framework %s (torch %u.%u), zero %u over %u GPU(s), offload %s%s\n",
            (unsigned long long)s->batch, (unsigned long long)s->seq, (unsigned long long)s->accum,
            mn_precision_name(s->precision), mn_optim_name(s->optim),
            mn_ckpt_name(s->checkpointing), mn_attn_name(s->attention),
            mn_framework_name(s->framework), s->torch_version / 100, s->torch_version % 100,
            s->zero_stage, s->gpus, mn_offload_name(s->offload), s->lora_rank ? ", LoRA" : "");
    printf("device: %s, capacity %.0f MiB, context %.0f MiB\n\n", r->gpu.label,
           (double)r->capacity / 1048576.0, (double)r->context / 1048576.0);
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
    json_u64("peak_requested", r->peak_requested, f);
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
    json_str("optim_impl", mn_optim_impl_name(s->optim_impl), f);
    json_str("loop", mn_loop_name(s->loop), f);
    json_str("head", mn_head_name(r->model.head), f);
    if (s->quant > MN_QUANT_NONE) {  // bitsandbytes: the release modelled (0 = current), the head
        json_u64("bnb_version", s->bnb_version, f);
        printf(", \"quant_head\": %s", s->quant_head ? "true" : "false");
    }
    printf(", \"infer\": %s", s->infer ? "true" : "false");
    if (s->infer) {
        json_u64("prompt", s->prompt, f);
        json_u64("new_tokens", s->new_tokens, f);
        json_u64("beams", s->beams, f);
    }
}

// Replays the predicted step through the allocator with its history on, then writes the
// timeline picture and/or the snapshot.
static int write_step_pictures(const cli *c, const mn_estimate_result *r) {
    mn_sim_cache sc;
    mn_cache_desc cd;
    mn_result res;
    char title[160];
    int rc;
    memset(&cd, 0, sizeof cd);
    cd.config = c->setup.alloc_conf;
    cd.trace_entries = (uint32_t)(r->alloc_events * 6 + 64 < 8000000 ? r->alloc_events * 6 + 64
                                                                     : 8000000);
    if (r->alloc_events * 6 + 64 > 8000000)
        fprintf(stderr, "memanat: warning: the picture keeps the last 8 M of the step's %.1f M "
                "trace entries (its start is cut)\n", (double)(r->alloc_events * 6) / 1e6);
    cd.logger.log_fn = capture_log;
    if ((res = mn_sim_cache_init(&sc, NULL, &cd)) != MN_OK) return fail_result("allocator", res);
    res = mn_estimate_replay(&c->model, &c->setup, NULL, &sc.cache);
    snprintf(title, sizeof title, "%s: batch %llu x seq %llu, %s, %s (predicted)", r->model.name,
             (unsigned long long)r->setup.batch, (unsigned long long)r->setup.seq,
             mn_precision_name(r->setup.precision), mn_optim_name(r->setup.optim));
    rc = res == MN_OK ? write_pictures(&sc.cache, c->svg, c->snapshot, title)
                      : fail_result("replay", res);
    mn_sim_cache_free(&sc);
    return rc;
}

// Activations kept per part of the model (*parts is malloc'ed, *n entries; none for inference).
static int compute_parts(const cli *c, const mn_estimate_result *r, uint64_t **parts, uint32_t *n) {
    uint32_t blocks =
        (uint32_t)(r->model.arch == MN_ARCH_STACK ? r->model.stack_len
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
static void print_parts(const cli *c, const mn_estimate_result *r, const uint64_t *parts,
                        uint32_t n) {
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
        if (j - i == 1)
            snprintf(label, sizeof label, "%s %u",
                     r->model.arch == MN_ARCH_STACK ? "layer" : "block", i);
        else
            snprintf(label, sizeof label, "%s %u-%u, each",
                     r->model.arch == MN_ARCH_STACK ? "layers" : "blocks", i, j - 1);
        printf("  %-28s %12s  (%s)\n", label, a, b);
    }
    mn_size_format(parts[n - 1], a, sizeof a);
    printf("  %-28s %12s\n", r->model.arch == MN_ARCH_STACK ? "loss" : "final norm and head", a);
}

// --seq-lengths: MIN:MAX:MEAN when it has that form, else a file.
static int load_lengths(const cli *c, mn_seq_dist *d) {
    mn_logger lg;
    mn_result r;
    const char *v = c->seq_lengths;
    size_t digits = strspn(v, "0123456789");
    memset(&lg, 0, sizeof lg);
    lg.log_fn = capture_log;
    if (digits && v[digits] == ':') r = mn_seq_dist_range(v, &lg, d);
    else r = mn_seq_dist_read_file(v, NULL, &lg, d);
    if (r == MN_OK) return 0;
    return first_error[0] ? fail("--seq-lengths %s", first_error)
                          : fail("--seq-lengths: %s", mn_result_str(r));
}

static void print_lengths(const cli *c, const mn_lengths_result *l) {
    char buf[48];
    uint32_t i;
    if (c->json) {
        printf(", \"seq_lengths\": {\"longest\": %llu, \"mean\": %.1f, \"steps\": %u, "
               "\"seed\": %llu, \"percentile\": %g, \"peak_allocated\": %llu, \"reserved\": "
               "%llu, \"reserved_percentile\": %llu, \"device_used\": %llu, \"fits\": %s",
               (unsigned long long)l->longest_len, l->mean_len, l->steps,
               (unsigned long long)c->len_seed, l->percentile,
               (unsigned long long)l->peak_allocated, (unsigned long long)l->reserved,
               (unsigned long long)l->reserved_pct, (unsigned long long)l->device_used,
               l->fits ? "true" : "false");
        printf(", \"step_len\": [");
        for (i = 0; i < l->steps; i++)
            printf("%s%llu", i ? ", " : "", (unsigned long long)l->step_len[i]);
        printf("], \"step_peak_allocated\": [");
        for (i = 0; i < l->steps; i++)
            printf("%s%llu", i ? ", " : "", (unsigned long long)l->step_peak[i]);
        printf("], \"step_reserved\": [");
        for (i = 0; i < l->steps; i++)
            printf("%s%llu", i ? ", " : "", (unsigned long long)l->step_reserved[i]);
        printf("]}");
        return;
    }
    printf("\nsequence lengths: %u steps (seed %llu), padded length mean %.0f, longest %llu\n",
           l->steps, (unsigned long long)c->len_seed, l->mean_len,
           (unsigned long long)l->longest_len);
    put_size("peak_allocated", l->peak_allocated, l->longest.capacity);
    put_size("reserved max", l->reserved, l->longest.capacity);
    snprintf(buf, sizeof buf, "reserved p%g", l->percentile);
    put_size(buf, l->reserved_pct, l->longest.capacity);
    put_size("device_used", l->device_used, l->longest.capacity);
    printf("  (peak_allocated: the longest steps; reserved max: the most during the steps, with\n"
           "  device_used = context + it; reserved p%g: of the reserved at each step's end)\n",
           l->percentile);
    printf("\nover the steps: %s (the table above is one length, the longest)\n",
           l->fits ? "FITS" : "DOES NOT FIT");
}

// estimate --seq-lengths: the plain estimate at the longest length, then the steps' replay.
static int cmd_estimate_lengths(cli *c) {
    mn_seq_dist d;
    mn_lengths_desc desc;
    mn_lengths_result *l;
    uint64_t *parts = NULL;
    uint32_t nparts = 0;
    int rc = 0, f = 1;
    mn_result res;
    if (c->setup.seq) return fail("give --seq or --seq-lengths, not both");
    if ((rc = load_lengths(c, &d)) != 0) return rc;
    l = (mn_lengths_result *)malloc(sizeof *l);
    if (!l) {
        mn_seq_dist_free(NULL, &d);
        return fail("out of memory");
    }
    memset(&desc, 0, sizeof desc);
    desc.dist = &d, desc.steps = c->len_steps, desc.seed = c->len_seed;
    desc.percentile = c->percentile;
    res = mn_estimate_lengths(&c->model, &c->setup, &desc, l);
    mn_seq_dist_free(NULL, &d);
    if (res != MN_OK) rc = fail_result("estimate", res);
    if (!rc) c->setup.seq = l->longest_len;  // pictures and parts: the longest step
    if (!rc && (c->svg || c->snapshot)) rc = write_step_pictures(c, &l->longest);
    if (!rc) rc = compute_parts(c, &l->longest, &parts, &nparts);
    if (!rc && c->json) {
        printf("{");
        print_json_fields(&l->longest, &f);
        print_parts(c, &l->longest, parts, nparts);
        print_lengths(c, l);
        printf("}\n");
    } else if (!rc) {
        print_table(&l->longest);
        print_parts(c, &l->longest, parts, nparts);
        print_lengths(c, l);
    }
    free(parts);
    free(l);
    return rc;
}

// --explain: the buffers alive at the peak, one line per mechanism, category and size (with
// --json: an "explain" array of {mechanism, category, count, bytes_each, bytes}).
static int print_explain(const cli *c) {
    mn_explain_item it[64];
    uint32_t n = 0, i;
    uint64_t peak = 0;
    char a[32], b[32];
    mn_result res = mn_estimate_explain(&c->model, &c->setup, it, 64, &n, &peak);
    if (res != MN_OK) return fail_result("explain", res);
    if (c->json) {
        printf(", \"explain_peak\": %llu, \"explain\": [", (unsigned long long)peak);
        for (i = 0; i < n && i < 64; i++) {
            int f = 1;
            printf("%s{", i ? ", " : "");
            json_str("mechanism", it[i].mechanism, &f);
            json_str("category", mn_category_name(it[i].category), &f);
            json_u64("count", it[i].count, &f);
            json_u64("bytes_each", it[i].bytes_each, &f);
            json_u64("bytes", it[i].bytes, &f);
            printf("}");
        }
        printf("]");
        return 0;
    }
    mn_size_format(peak, a, sizeof a);
    printf("\nalive at the peak (%s before rounding), by mechanism:\n", a);
    printf("  %-66s %-15s %6s %10s %10s\n", "mechanism", "category", "count", "each", "total");
    for (i = 0; i < n && i < 64; i++) {
        mn_size_format(it[i].bytes_each, a, sizeof a);
        mn_size_format(it[i].bytes, b, sizeof b);
        printf("  %-66s %-15s %6llu %10s %10s\n", it[i].mechanism,
               mn_category_name(it[i].category), (unsigned long long)it[i].count, a, b);
    }
    if (n > 64) printf("  (%u smaller groups not shown)\n", n - 64);
    return 0;
}

static int cmd_estimate(int argc, char **argv) {
    cli c;
    mn_estimate_result r;
    mn_result res;
    uint64_t *parts = NULL;
    uint32_t nparts = 0;
    int rc = parse_args(&c, CMD_ESTIMATE, argc, argv, estimate_usage), f = 1;
    if (rc) return rc == 1 ? 0 : rc;
    if (c.seq_lengths) return cmd_estimate_lengths(&c);
    if (c.len_steps || c.len_seed || c.percentile)
        return fail("--steps, --seed and --percentile go with --seq-lengths");
    res = mn_estimate(&c.model, &c.setup, &r);
    if (res != MN_OK) return fail_result("estimate", res);
    note_slow(&r);
    if ((c.svg || c.snapshot) && (rc = write_step_pictures(&c, &r)) != 0) return rc;
    if ((rc = compute_parts(&c, &r, &parts, &nparts)) != 0) {
        free(parts);
        return rc;
    }
    if (c.json) {
        printf("{");
        print_json_fields(&r, &f);
        print_parts(&c, &r, parts, nparts);
        if (c.explain && (rc = print_explain(&c)) != 0) {
            free(parts);
            return rc;
        }
        printf("}\n");
    } else {
        print_table(&r);
        print_parts(&c, &r, parts, nparts);
        if (c.explain && (rc = print_explain(&c)) != 0) {
            free(parts);
            return rc;
        }
    }
    free(parts);
    return r.fits ? 0 : 1;  // 1: does not fit (the answer is printed all the same)
}

static int cmd_fit(int argc, char **argv) {
    cli c;
    mn_fit_result fr;
    mn_result res;
    uint32_t i;
    int rc = parse_args(&c, CMD_FIT, argc, argv, fit_usage), f = 1;
    if (rc) return rc == 1 ? 0 : rc;
    note_slow_fit(&c.model);
    res = mn_fit(&c.model, &c.setup, &fr);
    if (res != MN_OK) return fail_result("fit", res);
    note_slow(&fr.plan_estimate);
    if (c.json) {
        printf("{\"max_batch\": %llu, \"max_seq\": %llu, \"plan_found\": %s, \"plan_slowdown\": "
               "%.3f, \"plan\": [",
               (unsigned long long)fr.max_batch, (unsigned long long)fr.max_seq,
               fr.plan_found ? "true" : "false", fr.plan_slowdown);
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
        return fr.plan_found ? 0 : 1;
    }
    printf("%s on %s (%.0f MiB):\n", fr.plan_estimate.model.name, fr.plan_estimate.gpu.label,
           (double)fr.plan_estimate.capacity / 1048576.0);
    printf("  largest micro-batch at seq %llu: %llu\n",
           (unsigned long long)c.setup.seq ? (unsigned long long)c.setup.seq
                                           : (unsigned long long)fr.plan_estimate.setup.seq,
           (unsigned long long)fr.max_batch);
    printf("  longest sequence at batch %llu: %llu\n",
           (unsigned long long)(c.setup.batch ? c.setup.batch : 1), (unsigned long long)fr.max_seq);
    if (fr.plan_len == 0 && fr.plan_found) printf("  the setup fits as given: no change needed\n");
    else if (fr.plan_len) printf("  plan (cheapest in speed first):\n");
    for (i = 0; i < fr.plan_len; i++)
        printf("    %u. %-45s %s\n", i + 1, fr.plan[i].what, fr.plan[i].why);
    if (!fr.plan_found) printf("  no combination of the techniques fits this device\n");
    else if (fr.plan_len)
        printf("  estimated step time x%.2f of the setup as given\n", fr.plan_slowdown);
    printf("\n");
    print_table(&fr.plan_estimate);
    return fr.plan_found ? 0 : 1;  // 1: nothing fits this device
}

static int cmd_models(int argc, char **argv) {
    uint32_t i;
    (void)argv;
    if (argc > 0 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
        printf("usage: memanat models\n"
               "  lists the model presets (for --model) and the GPUs (for --gpu)\n");
        return 0;
    }
    if (argc > 0) return fail("models takes no arguments (got \"%s\")", argv[0]);
    printf("%-20s %-16s %7s %7s %6s %5s %8s %9s\n", "model", "architecture", "params", "layers",
           "hidden", "heads", "kv_heads", "vocab");
    for (i = 0; i < mn_preset_count(); i++) {
        const mn_model *m = mn_preset_get(i);
        uint64_t n = 0;
        mn_model_params(m, &n);
        printf("%-20s %-16s %6.2fB %7llu %6llu %5llu %8llu %9llu\n", m->name, mn_arch_name(m->arch),
               (double)n / 1e9, (unsigned long long)m->layers, (unsigned long long)m->hidden,
               (unsigned long long)m->heads,
               (unsigned long long)(m->kv_heads ? m->kv_heads : m->heads),
               (unsigned long long)m->vocab);
    }
    printf("\n%-12s %-24s %10s %12s %4s %5s %15s\n", "gpu", "name", "capacity", "context", "sm",
           "bf16", "cuBLAS work");
    for (i = 0; i < mn_gpu_count(); i++) {
        const mn_gpu *g = mn_gpu_get(i);
        printf("%-12s %-24s %6.0f MiB %8.0f MiB %4u %5s %11.0f MiB\n", g->name, g->label,
               (double)g->capacity / 1048576.0, (double)g->context / 1048576.0, g->sm,
               g->bf16 ? "yes" : "no", (double)g->cublas_workspace / 1048576.0);
    }
    return 0;
}

// ---- replay: reading traces -------------------------------------------------------------------
//
// Two formats, told apart by the first non-blank byte:
//   - RMM's logging_resource_adaptor CSV: header "Thread,Time,Action,Pointer,Size,Stream", actions
//     "allocate" and "free" ("allocate failure" rows are skipped, as RMM's replay benchmark does);
//   - a PyTorch snapshot saved as JSON (torch.cuda.memory._snapshot()): device_traces of the
//     first device with entries; "alloc" allocates, "free_requested" (or "free") frees.
// Events of a null pointer are dropped. Streams are numbered densely in order of appearance.
// Limits, each an error that names it: a CSV row of TRACE_MAX_LINE bytes or TRACE_MAX_FIELDS
// fields, TRACE_MAX_EVENTS events, a snapshot of TRACE_MAX_JSON bytes (the JSON reader's own
// default, with its nesting limit); the CSV is read a row at a time, so an endless input (a pipe,
// /dev/zero) ends at its first overlong row. An allocation of 1 EiB or more is refused as input:
// no allocator grants it (PyTorch's one_exa_bytes check), so no trace can hold one.

#define TRACE_MAX_LINE 4096
#define TRACE_MAX_FIELDS 64
#define TRACE_MAX_EVENTS 100000000ull
#define TRACE_MAX_JSON (256ull << 20)
#define TRACE_ONE_EXA (1ull << 60)

typedef struct trace {
    mn_trace_event *ev;
    size_t n, cap;
    uint64_t streams[64];  // trace stream values by dense number (index 0 is value 0)
    uint32_t nstreams;
    uint64_t skipped;      // rows that are neither allocations nor frees
    const char *file;
    int streams_shared;    // more than 63 streams were seen (warned once)
} trace;

static int trace_push(trace *t, uint64_t ptr, uint64_t size, uint64_t stream, int is_alloc,
                      mn_category cat) {
    mn_trace_event *e;
    uint32_t s = 0, k;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 4096;
        mn_trace_event *ev;
        if (t->n >= TRACE_MAX_EVENTS)
            return fail("%s: more than %llu events, the most memanat replays", t->file,
                        (unsigned long long)TRACE_MAX_EVENTS);
        ev = (mn_trace_event *)realloc(t->ev, cap * sizeof *ev);
        if (!ev) return fail("%s: out of memory after %zu events", t->file, t->n);
        t->ev = ev, t->cap = cap;
    }
    if (stream != 0) {
        for (k = 1; k < t->nstreams && t->streams[k] != stream; k++) continue;
        if (k == t->nstreams) {
            if (t->nstreams == 0) t->nstreams = 1;
            if (t->nstreams == 64 && !t->streams_shared) {
                t->streams_shared = 1;
                fprintf(stderr, "memanat: warning: %s: more than 63 streams; the later ones "
                        "share the 63rd\n", t->file);
            }
            k = t->nstreams < 64 ? t->nstreams++ : 63;  // beyond 63 streams: shared
            t->streams[k] = stream;
        }
        s = k;
    }
    if (ptr == 0) return 0;  // a null pointer: nothing to allocate or free
    e = &t->ev[t->n++];
    memset(e, 0, sizeof *e);
    e->id = ptr, e->size = size, e->stream = s, e->alloc = (uint8_t)is_alloc;
    e->category = (uint8_t)cat;
    return 0;
}

// A CSV field without surrounding blanks and quotes.
static void csv_trim(const char **s, size_t *n) {
    while (*n && ((*s)[0] == ' ' || (*s)[0] == '"')) (*s)++, (*n)--;
    while (*n && ((*s)[*n - 1] == ' ' || (*s)[*n - 1] == '"' || (*s)[*n - 1] == '\r')) (*n)--;
}

static int csv_is(const char *s, size_t n, const char *word) {
    csv_trim(&s, &n);
    return n == strlen(word) && memcmp(s, word, n) == 0;
}

// An unsigned number: hex with 0x (or by default), "(nil)" = 0, else decimal; the whole field.
static int csv_num(const char *s, size_t n, int hex_default, uint64_t *out) {
    uint64_t v = 0;
    size_t i = 0;
    int base = hex_default ? 16 : 10, digits = 0;
    csv_trim(&s, &n);
    if (n == 5 && memcmp(s, "(nil)", 5) == 0) return *out = 0, 1;
    if (n > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) i = 2, base = 16;
    for (; i < n; i++, digits++) {
        int d;
        char ch = s[i];
        if (ch >= '0' && ch <= '9') d = ch - '0';
        else if (base == 16 && ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
        else if (base == 16 && ch >= 'A' && ch <= 'F') d = ch - 'A' + 10;
        else return 0;
        if (v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base) return 0;
        v = v * (uint64_t)base + (uint64_t)d;
    }
    *out = v;
    return digits > 0;
}

enum { COL_ACTION, COL_POINTER, COL_SIZE, COL_STREAM, COL_COUNT };
static const char *const col_names[COL_COUNT] = {"Action", "Pointer", "Size", "Stream"};

// The header row names the columns. 0, or the exit status.
static int csv_header(const char *const *f, const size_t *fl, int nf, const char *file,
                      int col[COL_COUNT]) {
    int k, j;
    for (k = 0; k < nf; k++)
        for (j = 0; j < COL_COUNT; j++)
            if (csv_is(f[k], fl[k], col_names[j])) col[j] = k;
    for (j = 0; j < COL_COUNT; j++)
        if (col[j] < 0)
            return fail("%s: line 1 is not an RMM log header (Thread,Time,Action,Pointer,Size,"
                        "Stream): no column '%s'", file, col_names[j]);
    return 0;
}

// One number field of a data row. 0, or the exit status.
static int csv_field(const char *const *f, const size_t *fl, const int col[COL_COUNT], int which,
                     int hex, const char *file, uint64_t line, uint64_t *out) {
    const char *v = f[col[which]];
    size_t n = fl[col[which]];
    if (csv_num(v, n, hex, out)) return 0;
    csv_trim(&v, &n);
    return fail("%s: line %llu, column %d (%s): '%.*s' is not %s", file, (unsigned long long)line,
                col[which] + 1, col_names[which], (int)(n < 40 ? n : 40), v,
                hex ? "a hex number (0x...) or (nil)" : "a decimal byte count below 2^64");
}

// One data row. 0, or the exit status.
static int csv_row(const char *const *f, const size_t *fl, int nf, int header_nf,
                   const int col[COL_COUNT], const char *file, uint64_t line, trace *t) {
    const char *act = f[col[COL_ACTION]];
    size_t actn = fl[col[COL_ACTION]];
    uint64_t ptr = 0, size = 0, stream = 0;
    int is_alloc, rc;
    if (nf != header_nf)
        return fail("%s: line %llu has %d fields, the header %d", file, (unsigned long long)line,
                    nf, header_nf);
    if (csv_is(act, actn, "allocate failure")) return t->skipped++, 0;
    if (csv_is(act, actn, "allocate")) is_alloc = 1;
    else if (csv_is(act, actn, "free")) is_alloc = 0;
    else {
        csv_trim(&act, &actn);
        return fail("%s: line %llu, column %d (Action): '%.*s' is not allocate, free or allocate "
                    "failure", file, (unsigned long long)line, col[COL_ACTION] + 1,
                    (int)(actn < 40 ? actn : 40), act);
    }
    if ((rc = csv_field(f, fl, col, COL_POINTER, 1, file, line, &ptr)) != 0 ||
        (rc = csv_field(f, fl, col, COL_SIZE, 0, file, line, &size)) != 0 ||
        (rc = csv_field(f, fl, col, COL_STREAM, 1, file, line, &stream)) != 0)
        return rc;
    if (is_alloc && size >= TRACE_ONE_EXA)
        return fail("%s: line %llu, column %d (Size): %llu bytes is 1 EiB or more, which no "
                    "allocator grants (want less than %llu)", file, (unsigned long long)line,
                    col[COL_SIZE] + 1, (unsigned long long)size,
                    (unsigned long long)TRACE_ONE_EXA);
    return trace_push(t, ptr, size, stream, is_alloc, MN_CAT_OTHER);
}

// Rows of a stream, at most TRACE_MAX_LINE bytes each, through one fixed buffer.
typedef struct row_reader {
    FILE *f;
    char buf[2 * TRACE_MAX_LINE + 2];
    size_t beg, end;
    int eof;
} row_reader;

// The next row (without its newline) in *row, *len. 1: a row, 0: the end, -1: a row longer than
// TRACE_MAX_LINE, -2: a read error.
static int next_row(row_reader *r, const char **row, size_t *len) {
    for (;;) {
        char *nl = (char *)memchr(r->buf + r->beg, '\n', r->end - r->beg);
        size_t got;
        if (nl || (r->eof && r->end > r->beg)) {
            size_t n = nl ? (size_t)(nl - (r->buf + r->beg)) : r->end - r->beg;
            if (n > TRACE_MAX_LINE) return -1;
            *row = r->buf + r->beg, *len = n;
            r->beg += n + (nl ? 1 : 0);
            return 1;
        }
        if (r->eof) return 0;
        if (r->end - r->beg > TRACE_MAX_LINE) return -1;
        memmove(r->buf, r->buf + r->beg, r->end - r->beg);
        r->end -= r->beg, r->beg = 0;
        got = fread(r->buf + r->end, 1, sizeof r->buf - r->end, r->f);
        r->end += got;
        if (got == 0) {
            if (ferror(r->f)) return -2;
            r->eof = 1;
        }
    }
}

static int read_csv(FILE *f, uint64_t line, trace *t) {
    static row_reader rr;
    int col[COL_COUNT] = {-1, -1, -1, -1}, header_nf = 0, rc, got;
    const char *p, *file = t->file;
    size_t n;
    memset(&rr, 0, sizeof rr);
    rr.f = f;
    while ((got = next_row(&rr, &p, &n)) == 1) {
        const char *eol = p + n, *q, *fld[TRACE_MAX_FIELDS];
        size_t fl[TRACE_MAX_FIELDS];
        int nf = 0;
        line++;
        if (n == 0 || (n == 1 && *p == '\r')) continue;  // a blank line
        if ((q = (const char *)memchr(p, 0, n)) != NULL)
            return fail("%s: line %llu, byte %zu of the row: a NUL byte (not a CSV text file)",
                        file, (unsigned long long)line, (size_t)(q - p) + 1);
        for (q = p;;) {  // fields between commas
            const char *comma = (const char *)memchr(q, ',', (size_t)(eol - q));
            if (nf == TRACE_MAX_FIELDS)
                return fail("%s: line %llu has more than %d fields", file,
                            (unsigned long long)line, TRACE_MAX_FIELDS);
            fld[nf] = q, fl[nf] = (size_t)((comma ? comma : eol) - q), nf++;
            if (!comma) break;
            q = comma + 1;
        }
        if (col[0] < 0) rc = csv_header(fld, fl, nf, file, col), header_nf = nf;
        else rc = csv_row(fld, fl, nf, header_nf, col, file, line, t);
        if (rc) return rc;
    }
    if (got == -1)
        return fail("%s: line %llu is longer than %d bytes (an RMM log row is about 80; not a "
                    "trace?)", file, (unsigned long long)line + 1, TRACE_MAX_LINE);
    if (got == -2) return fail("%s: read error after line %llu", file, (unsigned long long)line);
    if (col[0] < 0) return fail("%s: empty file (want an RMM log CSV or a snapshot JSON)", file);
    return 0;
}

// The rest of f into *text (NUL-terminated), at most max bytes. 0, or the exit status.
static int read_rest(FILE *f, const char *path, uint64_t max, char **text, size_t *len) {
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        size_t got;
        if (n == cap) {
            char *nb;
            if (cap > max) {
                free(buf);
                return fail("%s: larger than %llu bytes, the most memanat reads as a snapshot",
                            path, (unsigned long long)max);
            }
            cap = cap ? cap * 2 : 1 << 16;
            if (!(nb = (char *)realloc(buf, cap + 1))) {
                free(buf);
                return fail("%s: out of memory after %zu bytes", path, n);
            }
            buf = nb;
        }
        got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        free(buf);
        return fail("%s: read error after %zu bytes", path, n);
    }
    if (n > max) {
        free(buf);
        return fail("%s: larger than %llu bytes, the most memanat reads as a snapshot", path,
                    (unsigned long long)max);
    }
    buf[n] = 0;
    *text = buf, *len = n;
    return 0;
}

static int read_snapshot(const char *text, size_t len, trace *t) {
    mn_json_doc doc;
    mn_json_desc jd;
    const mn_json_value *dt, *tr = NULL;
    const char *file = t->file;
    size_t i;
    int rc = 0;
    mn_result r;
    memset(&jd, 0, sizeof jd);
    jd.max_bytes = TRACE_MAX_JSON;
    r = mn_json_parse(text, len, &jd, &doc);
    if (r != MN_OK) return fail("%s: not valid JSON (%s)", file, doc.error);
    dt = mn_json_get(doc.root, "device_traces");
    if (!dt || dt->type != MN_JSON_ARRAY)
        rc = fail("%s: no \"device_traces\" array (a PyTorch memory snapshot saved as JSON is "
                  "expected)", file);
    for (i = 0; !rc && !tr && i < dt->len; i++)
        if (dt->items[i].type == MN_JSON_ARRAY && dt->items[i].len > 0) tr = &dt->items[i];
    for (i = 0; !rc && tr && i < tr->len; i++) {
        const mn_json_value *e = &tr->items[i], *a = mn_json_get(e, "action");
        const mn_json_value *cat = mn_json_get(e, "category");  // memanat's own snapshots
        uint64_t addr = 0, size = 0, stream = 0;
        mn_category c = MN_CAT_OTHER;
        int is_alloc, k;
        if (!a || a->type != MN_JSON_STRING) {
            rc = fail("%s: device_traces entry %zu has no \"action\" string", file, i);
            break;
        }
        if (strcmp(a->str, "alloc") == 0) is_alloc = 1;
        else if (strcmp(a->str, "free_requested") == 0 || strcmp(a->str, "free") == 0) is_alloc = 0;
        else {
            t->skipped++;
            continue;
        }
        if (mn_json_u64(mn_json_get(e, "addr"), &addr) != MN_OK ||
            (is_alloc && mn_json_u64(mn_json_get(e, "size"), &size) != MN_OK)) {
            rc = fail("%s: device_traces entry %zu (\"%s\"): \"addr\"%s must be integers from 0 "
                      "to 2^64-1", file, i, a->str, is_alloc ? " and \"size\"" : "");
            break;
        }
        if (is_alloc && size >= TRACE_ONE_EXA) {
            rc = fail("%s: device_traces entry %zu: \"size\" %llu is 1 EiB or more, which no "
                      "allocator grants (want less than %llu)", file, i,
                      (unsigned long long)size, (unsigned long long)TRACE_ONE_EXA);
            break;
        }
        if (mn_json_get(e, "stream") &&
            mn_json_u64(mn_json_get(e, "stream"), &stream) != MN_OK) {
            rc = fail("%s: device_traces entry %zu: \"stream\" must be an integer from 0 to "
                      "2^64-1", file, i);
            break;
        }
        for (k = 0; cat && cat->type == MN_JSON_STRING && k < MN_CAT_COUNT; k++)
            if (strcmp(cat->str, mn_category_name((mn_category)k)) == 0) c = (mn_category)k;
        rc = trace_push(t, addr, size, stream, is_alloc, c);
    }
    mn_json_free(&doc);
    return rc;
}

static int read_trace(const char *path, trace *t) {
    FILE *f = fopen(path, "rb");
    uint64_t lines = 0;
    int ch, rc;
    t->file = path;
    if (!f) return fail("cannot open %s: %s", path, strerror(errno));
    while ((ch = getc(f)) != EOF && strchr(" \n\r\t", ch) && ch) lines += ch == '\n';
    if (ch == '{') {
        char *text = NULL;
        size_t len = 0;
        ungetc(ch, f);
        rc = read_rest(f, path, TRACE_MAX_JSON, &text, &len);
        if (!rc) rc = read_snapshot(text, len, t);
        free(text);
    } else {
        if (ch != EOF) ungetc(ch, f);
        rc = read_csv(f, lines, t);
    }
    fclose(f);
    return rc;
}

// ---- replay -----------------------------------------------------------------------------------

static const char *replay_usage =
    "usage: memanat replay FILE [--alloc-conf STR] [--capacity SIZE] [--json] [--svg OUT]\n"
    "  replays an allocation trace through the caching allocator on a simulated device and\n"
    "  prints PyTorch's statistics, memory_summary() and peak reserved over peak allocated.\n"
    "  FILE: RMM log CSV (logging_resource_adaptor) or PyTorch snapshot JSON\n"
    "  --alloc-conf STR   allocator settings (PYTORCH_ALLOC_CONF grammar; --config is the same)\n"
    "  --capacity SIZE    device size (default unlimited); failed allocations are counted\n"
    "  --svg OUT          the memory timeline, stacked by category\n";

static void replay_print_json(const struct mn_cache_stats *st, double ratio,
                              const mn_replay_counts *n) {
    mn_stat_item items[MN_CACHE_STATS_ITEMS];
    uint32_t count = mn_cache_stats_items(st, items, MN_CACHE_STATS_ITEMS), i;
    printf("{");
    for (i = 0; i < count; i++)
        printf("%s\"%s\": %lld", i ? ", " : "", items[i].key, (long long)items[i].value);
    printf(", \"peak_reserved_over_peak_allocated\": %.6f, \"replay.allocations\": %llu, "
           "\"replay.frees\": %llu, \"replay.unmatched_frees\": %llu, \"replay.failed\": %llu}\n",
           ratio, (unsigned long long)n->allocations, (unsigned long long)n->frees,
           (unsigned long long)n->unmatched_frees, (unsigned long long)n->failed);
}

static void replay_print_text(const cli *c, const trace *t, mn_cache *cache,
                              const struct mn_cache_stats *st, double ratio,
                              const mn_replay_counts *n) {
    char pa[32], pr[32], cs[32];
    mn_size_format(st->allocated_bytes[MN_STAT_ALL].peak, pa, sizeof pa);
    mn_size_format(st->reserved_bytes[MN_STAT_ALL].peak, pr, sizeof pr);
    mn_size_format(c->setup.capacity, cs, sizeof cs);
    printf("memanat replay: %s: %llu allocations (%llu refused), %llu frees (%llu unmatched), "
           "%llu rows skipped, %u streams\n", c->trace, (unsigned long long)n->allocations,
           (unsigned long long)n->failed, (unsigned long long)n->frees,
           (unsigned long long)n->unmatched_frees, (unsigned long long)t->skipped,
           t->nstreams ? t->nstreams : 1);
    printf("config: %s; device capacity: %s\n",
           c->alloc_conf && c->alloc_conf[0] ? c->alloc_conf : "(defaults)",
           c->setup.capacity ? cs : "unlimited");
    mn_cache_summary_write(st, 0, 0, mn_cache_write_file, stdout);
    if (st->cat_allocation[MN_CAT_OTHER].allocated != st->allocation[MN_STAT_ALL].allocated)
        mn_cache_category_summary_write(st, mn_cache_write_file, stdout);  // has categories
    printf("peak allocated: %llu B (%s)\n",
           (unsigned long long)st->allocated_bytes[MN_STAT_ALL].peak, pa);
    printf("peak reserved:  %llu B (%s)\n",
           (unsigned long long)st->reserved_bytes[MN_STAT_ALL].peak, pr);
    printf("peak reserved / peak allocated: %.4f\n", ratio);
    printf("out-of-memory failures: %llu, device allocations: %llu, cache flushes: %llu\n",
           (unsigned long long)st->num_ooms, (unsigned long long)st->num_device_alloc,
           (unsigned long long)st->num_alloc_retries);
    if (st->num_ooms) {
        char msg[1024];
        mn_cache_oom_message(cache, msg, sizeof msg);
        printf("last OOM: %s\n", msg);
    }
}

static int cmd_replay(int argc, char **argv) {
    cli c;
    trace t;
    mn_sim_cache sc;
    mn_simdev_desc dd;
    mn_cache_desc cd;
    mn_replay_counts n;
    struct mn_cache_stats st;
    mn_result r;
    double ratio;
    int rc = parse_args(&c, CMD_REPLAY, argc, argv, replay_usage);
    if (rc) return rc == 1 ? 0 : rc;
    memset(&t, 0, sizeof t);
    if ((rc = read_trace(c.trace, &t)) != 0) goto done;
    memset(&dd, 0, sizeof dd);
    memset(&cd, 0, sizeof cd);
    dd.capacity = c.setup.capacity;
    dd.events_complete = 1;
    cd.config = c.alloc_conf;
    cd.logger.log_fn = capture_log;
    if (c.svg) cd.trace_entries = t.n * 2 + 64 < (1u << 22) ? (uint32_t)(t.n * 2 + 64) : (1u << 22);
    if (c.svg && t.n * 2 + 64 > (1u << 22))
        fprintf(stderr, "memanat: warning: the picture keeps the last %u of %.1f M trace entries "
                "(its start is cut)\n", 1u << 22, (double)(t.n * 2) / 1e6);
    if ((r = mn_sim_cache_init(&sc, &dd, &cd)) != MN_OK) {
        rc = fail_result("allocator", r);
        goto done;
    }
    r = mn_cache_replay(&sc.cache, t.ev, t.n, 0, &n);
    if (r != MN_OK) rc = fail("%s: event %llu: %s", c.trace,
                              (unsigned long long)(n.allocations + n.frees), mn_result_str(r));
    if (!rc) {
        mn_cache_stats(&sc.cache, &st);
        ratio = st.allocated_bytes[MN_STAT_ALL].peak
                    ? (double)st.reserved_bytes[MN_STAT_ALL].peak /
                          (double)st.allocated_bytes[MN_STAT_ALL].peak
                    : 0.0;
        if (c.json) replay_print_json(&st, ratio, &n);
        else replay_print_text(&c, &t, &sc.cache, &st, ratio, &n);
        if (c.svg) rc = write_pictures(&sc.cache, c.svg, NULL, c.trace);
    }
    mn_sim_cache_free(&sc);
done:
    free(t.ev);
    return rc;
}

int main(int argc, char **argv) {
    static const char *usage =
        "usage: memanat COMMAND [options]   (memanat COMMAND --help for each)\n"
        "  estimate   memory breakdown of a training step or a generation, and whether it fits\n"
        "  fit        largest batch, longest sequence, and a plan that fits the GPU\n"
        "  models     model presets and GPUs\n"
        "  replay     an allocation trace (RMM CSV, PyTorch snapshot) through the allocator\n";
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
    if (!strcmp(argv[1], "replay")) return cmd_replay(argc - 2, argv + 2);
    return fail("unknown command \"%s\" (estimate, fit, models, replay)", argv[1]);
}
