// memanat_api.c: the JSON entry point of memanat_api.h over memanat.h's public API. Compiled as
// one translation unit that also holds the header's implementation (static, so nothing clashes
// with other libraries in a Python process), into the Python extension and the WebAssembly
// module alike.
//
// A request is read with the header's strict JSON reader; each setting goes through one table
// (the CLI's option table in memanat.c, without the dashes) into the mn_model / mn_setup the
// CLI would build, and mn_estimate / mn_fit / mn_cache_replay answer. Messages name the setting
// and the value; the library's own reasons come through a logger whose state lives on the
// caller's stack.
#ifndef MEMANAT_API_NO_IMPL
#define MEMANAT_STATIC
#define MEMANAT_IMPLEMENTATION
#endif
#include "../memanat.h"
#include "memanat_api.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

// ---- the answer: a growing text buffer ----------------------------------------------------------

typedef struct api_buf {
    char *p;
    size_t n, cap;
    int oom;  // an allocation failed; the text is incomplete
} api_buf;

static void buf_put(api_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        char *q;
        while (cap < b->n + n + 1) cap *= 2;
        q = (char *)realloc(b->p, cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

// A string literal, its length counted by the compiler.
#define BUF_LIT(b, lit) buf_put((b), (lit), sizeof(lit) - 1)

static void buf_str(api_buf *b, const char *s) { buf_put(b, s, strlen(s)); }

static void buf_printf(api_buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    buf_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static mn_result buf_write(void *user, const char *data, size_t len) {
    api_buf *b = (api_buf *)user;
    buf_put(b, data, len);
    return b->oom ? MN_ERR_OUT_OF_MEMORY : MN_OK;
}

// A JSON string (quotes included), escaped by the header.
static void buf_json_str(api_buf *b, const char *s) {
    size_t need = mn_json_escape(NULL, 0, s);
    char small[256], *tmp = need < sizeof small ? small : (char *)malloc(need + 1);
    if (!tmp) {
        b->oom = 1;
        return;
    }
    mn_json_escape(tmp, need + 1, s);
    buf_put(b, tmp, need);
    if (tmp != small) free(tmp);
}

static void buf_key(api_buf *b, const char *k, int *first) {
    if (!*first) BUF_LIT(b, ", ");
    *first = 0;
    buf_json_str(b, k);
    BUF_LIT(b, ": ");
}

static void put_u64(api_buf *b, const char *k, uint64_t v, int *first) {
    buf_key(b, k, first);
    buf_printf(b, "%llu", (unsigned long long)v);
}

static void put_str(api_buf *b, const char *k, const char *v, int *first) {
    buf_key(b, k, first);
    buf_json_str(b, v);
}

static void put_bool(api_buf *b, const char *k, int v, int *first) {
    buf_key(b, k, first);
    buf_printf(b, "%s", v ? "true" : "false");
}

// ---- one call's state: the request, the settings built from it, the first error -----------------

typedef struct api_call {
    mn_json_doc doc;
    mn_model model;
    mn_setup setup;
    int have_model, head_set, want_svg, want_parts, want_explain;
    const char *model_src;
    uint64_t params;
    mn_head head;
    const char *seq_lengths, *seq_lengths_text;  // a file or MIN:MAX:MEAN; a file's text
    const mn_json_value *st_shards;  // safetensors: [{name, size, header_base64}]
    const char *st_index;            // safetensors_index: model.safetensors.index.json's text
    mn_safetensors_info st;          // their totals, when given (st.files > 0)
    uint32_t len_steps;
    uint64_t len_seed;
    double percentile;  // 0 = the library's default
    char error[512];  // the first message (a failed check here or the library's logger)
} api_call;

static void capture_log(void *user, mn_log_level level, const char *msg) {
    api_call *c = (api_call *)user;
    if (level == MN_LOG_ERROR && !c->error[0]) snprintf(c->error, sizeof c->error, "%s", msg);
}

// Records the first message and returns code.
static int failf(api_call *c, int code, const char *fmt, ...) {
    va_list ap;
    if (c->error[0]) return code;
    va_start(ap, fmt);
    vsnprintf(c->error, sizeof c->error, fmt, ap);
    va_end(ap);
    return code;
}

// A count the way the CLI reads one (memanat.c parse_count): digits with an optional fraction and
// exponent, or a suffix K/M/B/G/T in 10^3 steps; a whole number within [lo, hi].
static int parse_count_text(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
    char *end;
    double v;
    if (!s || !*s || *s == '-' || *s == '+' || *s == ' ') return 0;
    v = strtod(s, &end);
    if (end == s) return 0;
    if (*end == 'K' || *end == 'k') v *= 1e3, end++;
    else if (*end == 'M' || *end == 'm') v *= 1e6, end++;
    else if (*end == 'B' || *end == 'b' || *end == 'G' || *end == 'g') v *= 1e9, end++;
    else if (*end == 'T' || *end == 't') v *= 1e12, end++;
    if (*end || !(v >= (double)lo) || !(v <= (double)hi) || v != floor(v)) return 0;
    *out = (uint64_t)v;
    return 1;
}

// A count from a JSON number (whole, exact below 2^53 or given as an integer literal) or text.
static int read_count(const mn_json_value *v, uint64_t lo, uint64_t hi, uint64_t *out) {
    uint64_t n;
    if (v->type == MN_JSON_STRING) return parse_count_text(v->str, lo, hi, out);
    if (v->type != MN_JSON_NUMBER) return 0;
    if (mn_json_u64(v, &n) != MN_OK) {  // 7.5e9 and friends: through the text reader
        if (!parse_count_text(v->str, lo, hi, &n)) return 0;
    }
    if (n < lo || n > hi) return 0;
    *out = n;
    return 1;
}

static const char *value_text(const mn_json_value *v, char *buf, size_t cap) {
    switch (v->type) {
    case MN_JSON_STRING: snprintf(buf, cap, "\"%.60s\"", v->str); return buf;
    case MN_JSON_NUMBER: snprintf(buf, cap, "%.60s", v->str); return buf;
    default: return mn_json_type_name(v->type);
    }
}

// ---- settings: one table, named like the CLI's flags --------------------------------------------

typedef enum opt_kind {
    OPT_MODEL,   // model / config / config_json / params
    OPT_HEAD,
    OPT_TORCH,
    OPT_ZERO_GRAD,
    OPT_BNB_VERSION,  // X.Y.Z
    OPT_QUANT_HEAD,   // true/false or "yes"/"no"
    OPT_PROB,         // [0, 1) into a float
    OPT_PERCENTILE,   // (0, 100]
    OPT_U64,     // a count into a uint64_t field, at least min
    OPT_U32,     // a count into a uint32_t field, at least min
    OPT_SIZE,    // bytes into a uint64_t field, not 0
    OPT_TEXT,    // a string kept as const char * (it lives in the request's document)
    OPT_ARRAY,   // an array kept as const mn_json_value *
    OPT_FLAG,    // a boolean into an int field
    OPT_CHOICE   // a name through a library parser
} opt_kind;

typedef struct api_opt {
    const char *name;
    opt_kind kind;
    size_t field;  // offsetof(api_call, ...)
    uint64_t min;
    int (*choice)(const char *v, void *out);
    const char *accepts;  // for messages
} api_opt;

#define CHOICE(fn, type) \
    static int choice_##fn(const char *v, void *out) { return fn(v, (type *)out) == MN_OK; }
CHOICE(mn_precision_parse, mn_precision)
CHOICE(mn_optim_parse, mn_optim)
CHOICE(mn_ckpt_parse, mn_ckpt)
CHOICE(mn_attn_parse, mn_attn)
CHOICE(mn_framework_parse, mn_framework)
CHOICE(mn_offload_parse, mn_offload)
CHOICE(mn_quant_parse, mn_quant)
CHOICE(mn_lora_targets_parse, uint32_t)
CHOICE(mn_optim_impl_parse, mn_optim_impl)
CHOICE(mn_loop_parse, mn_loop)
#undef CHOICE

#define F(member) offsetof(api_call, member)
#define OPT(name, kind, member, min) {name, kind, F(member), min, NULL, NULL}
#define CHOOSE(name, member, parse, accepts) \
    {name, OPT_CHOICE, F(member), 0, choice_##parse, accepts}
static const api_opt options[] = {
    OPT("model", OPT_MODEL, model, 0),
    OPT("config", OPT_MODEL, model, 0),
    OPT("config_json", OPT_MODEL, model, 0),
    OPT("params", OPT_MODEL, model, 0),
    OPT("safetensors", OPT_ARRAY, st_shards, 0),
    OPT("safetensors_index", OPT_TEXT, st_index, 0),
    OPT("head", OPT_HEAD, head, 0),
    OPT("trainable_params", OPT_U64, setup.trainable_params, 1),
    OPT("batch", OPT_U64, setup.batch, 1),
    OPT("seq", OPT_U64, setup.seq, 1),
    OPT("accum", OPT_U64, setup.accum, 1),
    OPT("seq_lengths", OPT_TEXT, seq_lengths, 0),
    OPT("seq_lengths_text", OPT_TEXT, seq_lengths_text, 0),
    OPT("steps", OPT_U32, len_steps, 2),
    OPT("seed", OPT_U64, len_seed, 0),
    OPT("percentile", OPT_PERCENTILE, percentile, 0),
    CHOOSE("precision", setup.precision, mn_precision_parse,
           "fp32, fp16, bf16, fp16-pure, bf16-pure"),
    CHOOSE("optim", setup.optim, mn_optim_parse,
           "adamw, adamw-8bit, sgd, sgd-momentum, adafactor, lion, none"),
    CHOOSE("checkpointing", setup.checkpointing, mn_ckpt_parse, "none, full, selective"),
    CHOOSE("attention", setup.attention, mn_attn_parse, "eager, sdpa, flash"),
    OPT("lora_rank", OPT_U32, setup.lora_rank, 1),
    CHOOSE("lora_targets", setup.lora_targets, mn_lora_targets_parse,
           "a comma list of q, k, v, o, gate, up, down"),
    CHOOSE("quant", setup.quant, mn_quant_parse, "none, int8, nf4, nf4-dq, fp4, fp4-dq"),
    OPT("bnb_version", OPT_BNB_VERSION, setup.bnb_version, 0),
    OPT("quant_head", OPT_QUANT_HEAD, setup.quant_head, 0),
    OPT("lora_dropout", OPT_PROB, setup.lora_dropout, 0),
    CHOOSE("optim_impl", setup.optim_impl, mn_optim_impl_parse, "foreach, fused, loop"),
    CHOOSE("loop", setup.loop, mn_loop_parse, "plain, trainer"),
    CHOOSE("framework", setup.framework, mn_framework_parse, "hf, deepspeed, megatron, memanat"),
    OPT("torch", OPT_TORCH, setup.torch_version, 0),
    OPT("zero", OPT_U32, setup.zero_stage, 0),
    OPT("gpus", OPT_U32, setup.gpus, 1),
    CHOOSE("offload", setup.offload, mn_offload_parse, "none, optimizer, all"),
    OPT("zero_grad", OPT_ZERO_GRAD, setup.grads, 0),
    OPT("gpu", OPT_TEXT, setup.gpu, 0),
    OPT("context", OPT_SIZE, setup.context, 0),
    OPT("capacity", OPT_SIZE, setup.capacity, 0),
    OPT("alloc_conf", OPT_TEXT, setup.alloc_conf, 0),
    OPT("infer", OPT_FLAG, setup.infer, 0),
    OPT("prompt", OPT_U64, setup.prompt, 1),
    OPT("new_tokens", OPT_U64, setup.new_tokens, 0),
    OPT("beams", OPT_U32, setup.beams, 1),
    OPT("no_replay", OPT_FLAG, setup.no_replay, 0),
    OPT("parts", OPT_FLAG, want_parts, 0),
    OPT("explain", OPT_FLAG, want_explain, 0),
    OPT("svg", OPT_FLAG, want_svg, 0),
};
#undef F
#undef OPT
#undef CHOOSE

static int set_model(api_call *c, const char *name, const mn_json_value *v) {
    mn_hf_desc d;
    mn_result r;
    if (c->have_model)
        return failf(c, MN_ERR_INVALID_ARG, "give one of model, config, config_json, params "
                     "(got %s after %s)", name, c->model_src);
    c->have_model = 1, c->model_src = name;
    if (!strcmp(name, "params")) {
        char t[80];
        memset(&c->model, 0, sizeof c->model);
        if (!read_count(v, 1, 1000000000000000000ull, &c->params))
            return failf(c, MN_ERR_INVALID_ARG, "params=%s: want a count such as 7e9 or \"350M\" "
                         "(1 .. 10^18)", value_text(v, t, sizeof t));
        c->model.params = c->params;
        return MN_OK;
    }
    if (v->type != MN_JSON_STRING)
        return failf(c, MN_ERR_INVALID_ARG, "%s: want a string, got %s", name,
                     mn_json_type_name(v->type));
    if (!strcmp(name, "model")) {
        const char *near;
        if (mn_preset_find(v->str, &c->model) == MN_OK) return MN_OK;
        near = mn_preset_closest(v->str);  // (only for a name not found: it looks it up again)
        return failf(c, MN_ERR_NOT_FOUND, "unknown model \"%s\"%s%s%s (see models())", v->str,
                     near ? "; did you mean " : "", near ? near : "", near ? "?" : "");
    }
    memset(&d, 0, sizeof d);
    d.logger.log_fn = capture_log, d.logger.user_data = c;
    if (!strcmp(name, "config")) r = mn_hf_config_read(v->str, &d, &c->model);
    else r = mn_hf_config_parse(v->str, v->len, &d, &c->model);
    if (r == MN_OK) return MN_OK;
    if (!strcmp(name, "config")) {  // the path first, as the CLI prints it
        char msg[sizeof c->error];
        snprintf(msg, sizeof msg, "%.200s: %.300s", v->str,
                 c->error[0] ? c->error : mn_result_str(r));
        memcpy(c->error, msg, sizeof msg);
        return r;
    }
    return failf(c, r, "config.json: %s", mn_result_str(r));
}

// Stores one setting. MN_OK, or an error with c->error naming the setting and the value.
static int set_option(api_call *c, const api_opt *o, const mn_json_value *v) {
    char *field = (char *)c + o->field, t[80];
    uint64_t n = 0;
    switch (o->kind) {
    case OPT_MODEL: return set_model(c, o->name, v);
    case OPT_FLAG:
        if (v->type != MN_JSON_TRUE && v->type != MN_JSON_FALSE)
            return failf(c, MN_ERR_INVALID_ARG, "%s: want true or false, got %s", o->name,
                         value_text(v, t, sizeof t));
        *(int *)(void *)field = v->type == MN_JSON_TRUE;
        return MN_OK;
    case OPT_TEXT:
        if (v->type != MN_JSON_STRING)
            return failf(c, MN_ERR_INVALID_ARG, "%s: want a string, got %s", o->name,
                         value_text(v, t, sizeof t));
        *(const char **)(void *)field = v->str;
        return MN_OK;
    case OPT_ARRAY:
        if (v->type != MN_JSON_ARRAY)
            return failf(c, MN_ERR_INVALID_ARG, "%s: want an array, got %s", o->name,
                         value_text(v, t, sizeof t));
        *(const mn_json_value **)(void *)field = v;
        return MN_OK;
    case OPT_CHOICE:
        if (v->type != MN_JSON_STRING || !o->choice(v->str, field))
            return failf(c, MN_ERR_INVALID_ARG, "%s=%s is not one of %s", o->name,
                         value_text(v, t, sizeof t), o->accepts);
        return MN_OK;
    case OPT_HEAD:
        if (v->type != MN_JSON_STRING || mn_head_parse(v->str, &c->head) != MN_OK)
            return failf(c, MN_ERR_INVALID_ARG, "head=%s: want lm, classification or none",
                         value_text(v, t, sizeof t));
        c->head_set = 1;
        return MN_OK;
    case OPT_TORCH: {  // "1.10" / "1" / 1.1 -> 1.10; "2" / "2.x" / 2 -> 2.x (memanat.c opt_torch)
        const char *s = v->type == MN_JSON_STRING || v->type == MN_JSON_NUMBER ? v->str : "";
        if (!strcmp(s, "1.10") || !strcmp(s, "1.1") || !strcmp(s, "1"))
            c->setup.torch_version = 110;
        else if (!strcmp(s, "2") || !strncmp(s, "2.", 2)) c->setup.torch_version = 200;
        else return failf(c, MN_ERR_INVALID_ARG, "torch=%s: want \"1.10\" or \"2\"",
                          value_text(v, t, sizeof t));
        return MN_OK;
    }
    case OPT_BNB_VERSION: {  // X.Y.Z -> X * 10000 + Y * 100 + Z (memanat.c opt_bnb_version)
        unsigned x, y, z;
        int k = 0;
        const char *str = v->type == MN_JSON_STRING ? v->str : "";
        if (sscanf(str, "%3u.%2u.%2u%n", &x, &y, &z, &k) != 3 || str[k] || str[0] < '0' ||
            str[0] > '9' || x > 99 || (x == 0 && y == 0 && z == 0))
            return failf(c, MN_ERR_INVALID_ARG, "bnb_version=%s: want a bitsandbytes release "
                         "such as \"0.43.1\"", value_text(v, t, sizeof t));
        c->setup.bnb_version = x * 10000 + y * 100 + z;
        return MN_OK;
    }
    case OPT_QUANT_HEAD:
        if (v->type == MN_JSON_TRUE || (v->type == MN_JSON_STRING && !strcmp(v->str, "yes")))
            c->setup.quant_head = 1;
        else if (v->type == MN_JSON_FALSE || (v->type == MN_JSON_STRING && !strcmp(v->str, "no")))
            c->setup.quant_head = 0;
        else return failf(c, MN_ERR_INVALID_ARG, "quant_head=%s: want true or false",
                          value_text(v, t, sizeof t));
        return MN_OK;
    case OPT_PROB: {  // memanat.c opt_lora_dropout
        char *end = NULL;
        double p = v->type == MN_JSON_NUMBER ? v->num
                   : v->type == MN_JSON_STRING ? strtod(v->str, &end) : -1.0;
        if ((end && (end == v->str || *end)) || !(p >= 0.0 && p < 1.0))
            return failf(c, MN_ERR_INVALID_ARG, "%s=%s: want a probability 0 <= p < 1", o->name,
                         value_text(v, t, sizeof t));
        *(float *)(void *)field = (float)p;
        return MN_OK;
    }
    case OPT_PERCENTILE: {
        char *end = NULL;
        double p = v->type == MN_JSON_NUMBER ? v->num
                   : v->type == MN_JSON_STRING ? strtod(v->str, &end) : -1.0;
        if ((end && (end == v->str || *end)) || !(p > 0 && p <= 100))
            return failf(c, MN_ERR_INVALID_ARG, "percentile=%s: want a number above 0, at most "
                         "100", value_text(v, t, sizeof t));
        c->percentile = p;
        return MN_OK;
    }
    case OPT_ZERO_GRAD:
        if (v->type == MN_JSON_STRING && !strcmp(v->str, "keep")) c->setup.grads = MN_GRADS_KEEP;
        else if (v->type == MN_JSON_STRING && !strcmp(v->str, "none"))
            c->setup.grads = MN_GRADS_RELEASE;
        else return failf(c, MN_ERR_INVALID_ARG, "zero_grad=%s: want \"keep\" or \"none\"",
                          value_text(v, t, sizeof t));
        return MN_OK;
    case OPT_SIZE:
        if (v->type == MN_JSON_STRING) {
            if (mn_size_parse(v->str, &n) != MN_OK) n = 0;
        } else if (v->type != MN_JSON_NUMBER || mn_json_u64(v, &n) != MN_OK) {
            n = 0;
        }
        if (n == 0)
            return failf(c, MN_ERR_INVALID_ARG, "%s=%s: want bytes (an integer) or a size such as "
                         "\"16GiB\", \"80GB\", \"1343MiB\"", o->name, value_text(v, t, sizeof t));
        *(uint64_t *)(void *)field = n;
        return MN_OK;
    case OPT_U64:
    case OPT_U32: {
        uint64_t hi = o->kind == OPT_U32 ? UINT32_MAX : 1000000000000000000ull;
        if (!read_count(v, o->min, hi, &n))
            return failf(c, MN_ERR_INVALID_ARG, "%s=%s: want a whole number from %llu to %llu",
                         o->name, value_text(v, t, sizeof t), (unsigned long long)o->min,
                         (unsigned long long)hi);
        if (o->kind == OPT_U32) *(uint32_t *)(void *)field = (uint32_t)n;
        else *(uint64_t *)(void *)field = n;
        return MN_OK;
    }
    }
    return failf(c, MN_ERR_INVALID_ARG, "%s: unhandled setting", o->name);
}

// ---- safetensors headers sent with a config.json ------------------------------------------------
//
// Where no file system can be read (the page), the shards' headers come in the request: each
// shard as {"name", "size" (the file's bytes), "header_base64" (its first 8 + N bytes: the length
// and the JSON header)}, and optionally the index's text. They count as mn_hf_config_read counts a
// model folder's (mn_safetensors_read_dir): with an index, the shards its weight_map names, each
// of which must be present (others are not read); without one, every shard given. The sum of
// their parameters and the dtype holding the most of them replace the config's shape count and
// dtype, unless the config has a quantization_config (packed weights: the shape is kept).

static int b64_value(int ch) {
    if (ch >= 'A' && ch <= 'Z') return ch - 'A';
    if (ch >= 'a' && ch <= 'z') return ch - 'a' + 26;
    if (ch >= '0' && ch <= '9') return ch - '0' + 52;
    if (ch == '+') return 62;
    if (ch == '/') return 63;
    return -1;
}

// Decodes standard base64 (RFC 4648, '=' padding optional) into a new buffer; NULL when the text
// is not base64 (*bad = 1) or memory runs out (*bad = 0).
static uint8_t *b64_decode(const char *s, size_t n, size_t *out_len, int *bad) {
    uint8_t *out;
    size_t i, k = 0;
    uint32_t acc = 0;
    int bits = 0;
    *bad = 0;
    while (n && s[n - 1] == '=') n--;
    if (n % 4 == 1) return *bad = 1, (uint8_t *)NULL;
    out = (uint8_t *)malloc(n / 4 * 3 + 3);
    if (!out) return NULL;
    for (i = 0; i < n; i++) {
        int v = b64_value((unsigned char)s[i]);
        if (v < 0) {
            free(out);
            return *bad = 1, (uint8_t *)NULL;
        }
        acc = (acc << 6) | (uint32_t)v, bits += 6;
        if (bits >= 8) bits -= 8, out[k++] = (uint8_t)(acc >> bits);
    }
    *out_len = k;
    return out;
}

static int index_names(const mn_json_value *map, const char *name) {
    uint32_t k;
    for (k = 0; k < map->len; k++) {
        const mn_json_value *v = &map->items[2 * k + 1];
        if (v->type == MN_JSON_STRING && !strcmp(v->str, name)) return 1;
    }
    return 0;
}

// Adds one shard to c->st (mn__st_add_shard's totals).
static int add_shard(api_call *c, const mn_json_value *sh, uint32_t i) {
    const mn_json_value *name = mn_json_get(sh, "name"), *hdr = mn_json_get(sh, "header_base64");
    mn_safetensors_info one;
    uint64_t size = 0;
    uint8_t *bytes;
    size_t len = 0;
    int bad, t;
    mn_result r;
    if (sh->type != MN_JSON_OBJECT || !name || name->type != MN_JSON_STRING || !hdr ||
        hdr->type != MN_JSON_STRING || mn_json_u64(mn_json_get(sh, "size"), &size) != MN_OK)
        return failf(c, MN_ERR_INVALID_ARG, "safetensors[%u]: want {\"name\", \"size\", "
                     "\"header_base64\"}", (unsigned)i);
    bytes = b64_decode(hdr->str, hdr->len, &len, &bad);
    if (!bytes)
        return failf(c, bad ? MN_ERR_INVALID_ARG : MN_ERR_OUT_OF_MEMORY,
                     "safetensors: %.60s: header_base64 %s", name->str,
                     bad ? "is not base64" : "does not fit in memory");
    memset(&one, 0, sizeof one);
    r = mn_safetensors_parse(bytes, len, size, NULL, &one);
    free(bytes);
    if (r != MN_OK) {
        failf(c, r, "safetensors: %.60s: %s", name->str, one.error);
        mn_safetensors_free(&one);
        return r;
    }
    c->st.files++;
    if (mn_add_u64(c->st.header_bytes, one.header_bytes, &c->st.header_bytes) != MN_OK ||
        mn_add_u64(c->st.data_bytes, one.data_bytes, &c->st.data_bytes) != MN_OK ||
        mn_add_u64(c->st.tensors, one.tensors, &c->st.tensors) != MN_OK ||
        mn_add_u64(c->st.params, one.params, &c->st.params) != MN_OK)
        r = MN_ERR_OVERFLOW;
    for (t = 0; t < MN_ST_DTYPE_COUNT && r == MN_OK; t++)
        if (mn_add_u64(c->st.params_by_dtype[t], one.params_by_dtype[t],
                       &c->st.params_by_dtype[t]) != MN_OK)
            r = MN_ERR_OVERFLOW;
    mn_safetensors_free(&one);
    return r == MN_OK ? MN_OK : failf(c, r, "safetensors: totals overflow 64 bits");
}

static int read_safetensors(api_call *c, const char *config_text, size_t config_len) {
    mn_json_doc idx, cfg;
    const mn_json_value *map = NULL;
    uint32_t i, j, k;
    uint64_t best = 0;
    int rc = MN_OK, quantized;
    if (!c->st_shards && !c->st_index) return MN_OK;
    if (!c->model_src || strcmp(c->model_src, "config_json"))
        return failf(c, MN_ERR_INVALID_ARG, "safetensors: send them with config_json (the "
                     "checkpoint's config.json)");
    if (!c->st_shards || c->st_shards->len == 0)
        return failf(c, MN_ERR_INVALID_ARG, "safetensors_index: give the shards it names "
                     "(safetensors)");
    memset(&idx, 0, sizeof idx);
    if (c->st_index) {
        if (mn_json_parse(c->st_index, strlen(c->st_index), NULL, &idx) != MN_OK) {
            rc = failf(c, MN_ERR_PARSE, "model.safetensors.index.json: %s", idx.error);
            goto done;
        }
        map = mn_json_get(idx.root, "weight_map");
        if (!map || map->type != MN_JSON_OBJECT) {
            rc = failf(c, MN_ERR_PARSE, "model.safetensors.index.json has no \"weight_map\" "
                       "object");
            goto done;
        }
        for (k = 0; k < map->len; k++) {  // every shard named must be there
            const mn_json_value *v = &map->items[2 * k + 1];
            int found = 0;
            if (v->type != MN_JSON_STRING || v->len == 0) {
                rc = failf(c, MN_ERR_PARSE, "weight_map: \"%.60s\" does not name a file",
                           map->items[2 * k].str);
                goto done;
            }
            for (i = 0; i < c->st_shards->len && !found; i++) {
                const mn_json_value *n = mn_json_get(&c->st_shards->items[i], "name");
                found = n && n->type == MN_JSON_STRING && !strcmp(n->str, v->str);
            }
            if (!found) {
                rc = failf(c, MN_ERR_IO, "safetensors: %.60s: listed in the index, missing",
                           v->str);
                goto done;
            }
        }
    }
    for (i = 0; i < c->st_shards->len; i++) {
        const mn_json_value *sh = &c->st_shards->items[i], *n = mn_json_get(sh, "name");
        if (n && n->type == MN_JSON_STRING) {
            if (map && !index_names(map, n->str)) continue;  // not part of this checkpoint
            for (j = 0; j < i; j++) {
                const mn_json_value *m = mn_json_get(&c->st_shards->items[j], "name");
                if (m && m->type == MN_JSON_STRING && !strcmp(m->str, n->str)) {
                    rc = failf(c, MN_ERR_INVALID_ARG, "safetensors: %.60s given twice", n->str);
                    goto done;
                }
            }
        }
        if ((rc = add_shard(c, sh, i)) != MN_OK) goto done;
    }
    for (k = 1; k < MN_ST_DTYPE_COUNT; k++)  // mn_safetensors_read_dir: the dominant dtype
        if (c->st.params_by_dtype[k] > best)
            best = c->st.params_by_dtype[k], c->st.st_dtype = (mn_st_dtype)k;
    c->st.dtype = mn_st_dtype_to_dtype(c->st.st_dtype);
    // mn_hf_config_read: a quantized checkpoint keeps the shape's count
    memset(&cfg, 0, sizeof cfg);
    quantized = mn_json_parse(config_text, config_len, NULL, &cfg) == MN_OK &&
                mn_json_get(cfg.root, "quantization_config") != NULL;
    mn_json_free(&cfg);
    if (c->st.params > 0 && !quantized) {
        c->model.params = c->st.params;
        if (c->st.dtype != MN_DTYPE_DEFAULT) c->model.dtype = c->st.dtype;
    }
done:
    mn_json_free(&idx);
    return rc;
}

// Parses the request and fills c the way memanat.c parse_args fills its struct.
static int read_settings(api_call *c, const char *req, size_t len, int need_model) {
    const mn_json_value *root;
    uint32_t i;
    size_t k;
    int rc;
    c->setup.logger.log_fn = capture_log, c->setup.logger.user_data = c;
    if (mn_json_parse(req, len, NULL, &c->doc) != MN_OK)
        return failf(c, MN_ERR_PARSE, "request: %s", c->doc.error);
    root = c->doc.root;
    if (root->type != MN_JSON_OBJECT) return failf(c, MN_ERR_PARSE, "request: want an object");
    for (i = 0; i < root->len; i++) {
        const mn_json_value *key = &root->items[2 * i], *v = &root->items[2 * i + 1];
        const api_opt *o = NULL;
        for (k = 0; k < sizeof options / sizeof options[0] && !o; k++)
            if (!strcmp(options[k].name, key->str)) o = &options[k];
        if (!o) return failf(c, MN_ERR_NOT_FOUND, "unknown setting \"%s\"", key->str);
        if (v->type == MN_JSON_NULL) continue;
        if ((rc = set_option(c, o, v)) != MN_OK) return rc;
    }
    if (!need_model) return MN_OK;
    if (!c->have_model)
        return failf(c, MN_ERR_INVALID_ARG, "no model: give model, config, config_json or params");
    if (c->st_shards || c->st_index) {
        const mn_json_value *cj = mn_json_get(root, "config_json");
        rc = read_safetensors(c, cj && cj->type == MN_JSON_STRING ? cj->str : "",
                              cj && cj->type == MN_JSON_STRING ? cj->len : 0);
        if (rc != MN_OK) return rc;
    }
    if (c->head_set) {  // memanat.c parse_args: a classification head has no MLM transform
        c->model.head = c->head;
        if (c->head == MN_HEAD_CLASSIFICATION) {
            c->model.lm_transform = 0;
            if (c->model.arch == MN_ARCH_ENCODER) c->model.pooler = 1;
        }
    }
    if (c->params && c->setup.trainable_params > c->params)
        return failf(c, MN_ERR_INVALID_ARG, "trainable_params exceeds params");
    return MN_OK;
}

// ---- estimate -----------------------------------------------------------------------------------

// Where pointers have 32 bits (wasm32) the simulated device addresses 1 TiB (mn_simdev_desc
// addr_shift: block addresses are multiples of 512 B only, so no wider shift is lossless); a step
// that runs past it reserves about that much: no GPU holds it.
static int failed_step(api_call *c, const char *what, int rc) {
    if (rc == MN_ERR_UNSUPPORTED && UINTPTR_MAX < UINT64_MAX && !c->error[0])
        return failf(c, rc, "%s: the step needs more device memory than this 32-bit build "
                     "simulates (about 1 TiB, beyond any single GPU); the CLI and the Python "
                     "package give the figure", what);
    return failf(c, rc, "%s: %s", what, mn_result_str((mn_result)rc));
}

// The keys of `memanat estimate --json` (memanat.c print_json_fields), in its order, then what
// the CLI prints only as a table: bytes per category at the peak and each category's own peak.
static void put_estimate(api_buf *b, const mn_estimate_result *r) {
    const mn_setup *s = &r->setup;
    int f = 1, k;
    BUF_LIT(b, "{");
    put_u64(b, "weights", r->weights, &f);
    put_u64(b, "master_weights", r->master_weights, &f);
    put_u64(b, "gradients", r->gradients, &f);
    put_u64(b, "optimizer", r->optimizer, &f);
    put_u64(b, "model_states", r->model_states, &f);
    put_u64(b, "activations", r->activations, &f);
    put_u64(b, "temporary", r->temporary, &f);
    put_u64(b, "kv_cache", r->kv_cache, &f);
    put_u64(b, "workspace", r->workspace, &f);
    put_u64(b, "peak_allocated", r->peak_allocated, &f);
    put_u64(b, "peak_requested", r->peak_requested, &f);
    put_u64(b, "peak_reserved", r->peak_reserved, &f);
    put_u64(b, "context", r->context, &f);
    put_u64(b, "device_used", r->device_used, &f);
    put_u64(b, "capacity", r->capacity, &f);
    put_bool(b, "fits", r->fits, &f);
    put_u64(b, "cpu_bytes", r->cpu_bytes, &f);
    put_u64(b, "params", r->params, &f);
    put_u64(b, "trainable_params", r->trainable_params, &f);
    put_str(b, "peak_phase", mn_phase_name(r->peak_phase), &f);
    put_str(b, "model", r->model.name, &f);
    put_str(b, "gpu", r->gpu.name, &f);
    put_u64(b, "batch", s->batch, &f);
    put_u64(b, "seq", s->seq, &f);
    put_u64(b, "accum", s->accum, &f);
    put_str(b, "precision", mn_precision_name(s->precision), &f);
    put_str(b, "optim", mn_optim_name(s->optim), &f);
    put_str(b, "checkpointing", mn_ckpt_name(s->checkpointing), &f);
    put_str(b, "attention", mn_attn_name(s->attention), &f);
    put_str(b, "framework", mn_framework_name(s->framework), &f);
    put_u64(b, "torch_version", s->torch_version, &f);
    put_u64(b, "zero", s->zero_stage, &f);
    put_u64(b, "gpus", s->gpus, &f);
    put_str(b, "offload", mn_offload_name(s->offload), &f);
    put_u64(b, "lora_rank", s->lora_rank, &f);
    put_str(b, "quant", mn_quant_name(s->quant), &f);
    put_str(b, "optim_impl", mn_optim_impl_name(s->optim_impl), &f);
    put_str(b, "loop", mn_loop_name(s->loop), &f);
    put_str(b, "head", mn_head_name(r->model.head), &f);
    if (s->quant > MN_QUANT_NONE) {  // bitsandbytes: the release modelled (0 = current), the head
        put_u64(b, "bnb_version", s->bnb_version, &f);
        put_bool(b, "quant_head", s->quant_head, &f);
    }
    put_bool(b, "infer", s->infer, &f);
    if (s->infer) {
        put_u64(b, "prompt", s->prompt, &f);
        put_u64(b, "new_tokens", s->new_tokens, &f);
        put_u64(b, "beams", s->beams, &f);
    }
    put_str(b, "gpu_label", r->gpu.label, &f);
    put_u64(b, "alloc_events", r->alloc_events, &f);
    buf_key(b, "at_peak", &f);
    BUF_LIT(b, "{");
    for (k = 0; k < MN_CAT_COUNT; k++)
        buf_printf(b, "%s\"%s\": %llu", k ? ", " : "", mn_category_name((mn_category)k),
                   (unsigned long long)r->at_peak[k]);
    BUF_LIT(b, "}");
    buf_key(b, "cat_peak", &f);
    BUF_LIT(b, "{");
    for (k = 0; k < MN_CAT_COUNT; k++)
        buf_printf(b, "%s\"%s\": %llu", k ? ", " : "", mn_category_name((mn_category)k),
                   (unsigned long long)r->cat_peak[k]);
    BUF_LIT(b, "}");
}

// The timeline picture of a cache that kept its history, as a JSON string value.
static int put_cache_svg(api_call *c, api_buf *b, mn_cache *cache, const char *title) {
    mn_cache_snapshot snap;
    api_buf svg;
    mn_result r = mn_cache_snapshot_take(cache, &snap);
    if (r != MN_OK) return failf(c, r, "snapshot: %s", mn_result_str(r));
    memset(&svg, 0, sizeof svg);
    r = mn_cache_timeline_svg(&snap, title, buf_write, &svg);
    mn_cache_snapshot_free(&snap);
    if (r == MN_OK && !svg.oom) buf_json_str(b, svg.p ? svg.p : "");
    free(svg.p);
    if (svg.oom) return failf(c, MN_ERR_OUT_OF_MEMORY, "svg: out of memory");
    return r == MN_OK ? MN_OK : failf(c, r, "svg: %s", mn_result_str(r));
}

// Replays the predicted step with the allocator's history on (memanat.c write_step_pictures).
static int put_step_svg(api_call *c, api_buf *b, const mn_estimate_result *r) {
    mn_sim_cache sc;
    mn_cache_desc cd;
    mn_result res;
    char title[160];
    int rc;
    memset(&cd, 0, sizeof cd);
    cd.config = c->setup.alloc_conf;
    cd.trace_entries = (uint32_t)(r->alloc_events * 6 + 64 < 8000000 ? r->alloc_events * 6 + 64
                                                                     : 8000000);
    cd.logger = c->setup.logger;
    if ((res = mn_sim_cache_init(&sc, NULL, &cd)) != MN_OK)
        return failf(c, res, "allocator: %s", mn_result_str(res));
    res = mn_estimate_replay(&c->model, &c->setup, NULL, &sc.cache);
    snprintf(title, sizeof title, "%s: batch %llu x seq %llu, %s, %s (predicted)", r->model.name,
             (unsigned long long)r->setup.batch, (unsigned long long)r->setup.seq,
             mn_precision_name(r->setup.precision), mn_optim_name(r->setup.optim));
    rc = res == MN_OK ? put_cache_svg(c, b, &sc.cache, title)
                      : failf(c, res, "replay: %s", mn_result_str(res));
    mn_sim_cache_free(&sc);
    return rc;
}

static int put_parts(api_call *c, api_buf *b, const mn_estimate_result *r) {
    uint32_t blocks = (uint32_t)(r->model.arch == MN_ARCH_STACK
                                     ? r->model.stack_len
                                     : r->model.layers + r->model.encoder_layers);
    uint32_t n = 0, i;
    uint64_t *parts;
    mn_result res;
    if (r->setup.infer) return MN_OK;
    parts = (uint64_t *)calloc((size_t)blocks + 2, sizeof *parts);
    if (!parts) return failf(c, MN_ERR_OUT_OF_MEMORY, "parts: out of memory");
    res = mn_estimate_parts(&c->model, &c->setup, parts, blocks + 2, &n);
    if (res == MN_OK) {
        BUF_LIT(b, ", \"parts\": [");
        for (i = 0; i < n; i++)
            buf_printf(b, "%s%llu", i ? ", " : "", (unsigned long long)parts[i]);
        BUF_LIT(b, "]");
    }
    free(parts);
    return res == MN_OK ? MN_OK : failf(c, res, "parts: %s", mn_result_str(res));
}

// The "seq_lengths" member of `memanat estimate --seq-lengths ... --json` (memanat.c
// print_lengths).
static void put_lengths(api_call *c, api_buf *b, const mn_lengths_result *l) {
    uint32_t i;
    buf_printf(b, ", \"seq_lengths\": {\"longest\": %llu, \"mean\": %.1f, \"steps\": %u, "
               "\"seed\": %llu, \"percentile\": %g, \"peak_allocated\": %llu, \"reserved\": "
               "%llu, \"reserved_percentile\": %llu, \"device_used\": %llu, \"fits\": %s",
               (unsigned long long)l->longest_len, l->mean_len, l->steps,
               (unsigned long long)c->len_seed, l->percentile,
               (unsigned long long)l->peak_allocated, (unsigned long long)l->reserved,
               (unsigned long long)l->reserved_pct, (unsigned long long)l->device_used,
               l->fits ? "true" : "false");
    BUF_LIT(b, ", \"step_len\": [");
    for (i = 0; i < l->steps; i++)
        buf_printf(b, "%s%llu", i ? ", " : "", (unsigned long long)l->step_len[i]);
    BUF_LIT(b, "], \"step_peak_allocated\": [");
    for (i = 0; i < l->steps; i++)
        buf_printf(b, "%s%llu", i ? ", " : "", (unsigned long long)l->step_peak[i]);
    BUF_LIT(b, "], \"step_reserved\": [");
    for (i = 0; i < l->steps; i++)
        buf_printf(b, "%s%llu", i ? ", " : "", (unsigned long long)l->step_reserved[i]);
    BUF_LIT(b, "]}");
}

// "explain_peak" and "explain" as `memanat estimate --explain --json` (memanat.c print_explain).
static int put_explain(api_call *c, api_buf *b) {
    mn_explain_item it[64];
    uint32_t n = 0, i;
    uint64_t peak = 0;
    mn_result res = mn_estimate_explain(&c->model, &c->setup, it, 64, &n, &peak);
    if (res != MN_OK) return failf(c, res, "explain: %s", mn_result_str(res));
    buf_printf(b, ", \"explain_peak\": %llu, \"explain\": [", (unsigned long long)peak);
    for (i = 0; i < n && i < 64; i++) {
        int f = 1;
        buf_printf(b, "%s{", i ? ", " : "");
        put_str(b, "mechanism", it[i].mechanism, &f);
        put_str(b, "category", mn_category_name(it[i].category), &f);
        put_u64(b, "count", it[i].count, &f);
        put_u64(b, "bytes_each", it[i].bytes_each, &f);
        put_u64(b, "bytes", it[i].bytes, &f);
        BUF_LIT(b, "}");
    }
    BUF_LIT(b, "]");
    return MN_OK;
}

static int put_outputs(api_call *c, api_buf *b, const mn_estimate_result *r) {
    int rc;
    if (c->want_parts && (rc = put_parts(c, b, r)) != MN_OK) return rc;
    if (c->want_explain && (rc = put_explain(c, b)) != MN_OK) return rc;
    if (c->want_svg) {
        BUF_LIT(b, ", \"svg\": ");
        if ((rc = put_step_svg(c, b, r)) != MN_OK) return rc;
    }
    return MN_OK;
}

// A distribution of sequence lengths (memanat.c cmd_estimate_lengths): the plain estimate at the
// longest length, the replay of the steps, and the outputs at the longest length.
static int op_estimate_lengths(api_call *c, api_buf *b) {
    mn_seq_dist d;
    mn_lengths_desc desc;
    mn_lengths_result *l;
    const char *v = c->seq_lengths;
    int rc;
    if (c->setup.seq) return failf(c, MN_ERR_INVALID_ARG, "give seq or seq_lengths, not both");
    if (c->seq_lengths && c->seq_lengths_text)
        return failf(c, MN_ERR_INVALID_ARG, "give seq_lengths or seq_lengths_text, not both");
    if (c->seq_lengths_text)
        rc = mn_seq_dist_parse(c->seq_lengths_text, strlen(c->seq_lengths_text), NULL,
                               &c->setup.logger, &d);
    else if (strspn(v, "0123456789") && v[strspn(v, "0123456789")] == ':')
        rc = mn_seq_dist_range(v, &c->setup.logger, &d);
    else rc = mn_seq_dist_read_file(v, NULL, &c->setup.logger, &d);
    if (rc != MN_OK) return failf(c, rc, "seq_lengths: %s", mn_result_str((mn_result)rc));
    l = (mn_lengths_result *)malloc(sizeof *l);
    if (!l) {
        mn_seq_dist_free(NULL, &d);
        return failf(c, MN_ERR_OUT_OF_MEMORY, "seq_lengths: out of memory");
    }
    memset(&desc, 0, sizeof desc);
    desc.dist = &d, desc.steps = c->len_steps, desc.seed = c->len_seed;
    desc.percentile = c->percentile;
    rc = mn_estimate_lengths(&c->model, &c->setup, &desc, l);
    mn_seq_dist_free(NULL, &d);
    if (rc == MN_OK) {
        c->setup.seq = l->longest_len;  // parts and the picture: the longest step
        put_estimate(b, &l->longest);
        rc = put_outputs(c, b, &l->longest);
        if (rc == MN_OK) put_lengths(c, b, l);
        BUF_LIT(b, "}");
    } else {
        rc = failed_step(c, "estimate", rc);
    }
    free(l);
    return rc;
}

// A step the 32-bit build cannot replay (failed_step): the estimate without the allocator replay
// (mn_setup.no_replay, as mn_fit judges a setup by its step alone), kept only when its allocated
// peak already exceeds the device, which makes "does not fit" certain (the replay never lowers
// the peak below what is allocated). Every number but peak_reserved and device_used is the
// replayed estimate's; those two are then lower bounds (reserved = allocated), and the answer
// says "replayed": false. 1 when r holds such an estimate.
static int unreplayed_estimate(api_call *c, int rc, mn_estimate_result *r) {
    mn_setup s = c->setup;
    char kept[sizeof c->error];
    if (rc != MN_ERR_UNSUPPORTED || UINTPTR_MAX >= UINT64_MAX) return 0;
    memcpy(kept, c->error, sizeof kept);
    s.no_replay = 1;
    if (mn_estimate(&c->model, &s, r) == MN_OK && !r->fits) {
        c->error[0] = 0;
        return 1;
    }
    memcpy(c->error, kept, sizeof kept);
    return 0;
}

static int op_estimate(api_call *c, api_buf *b) {
    mn_estimate_result r;
    int rc, replayed = 1;
    if (c->seq_lengths || c->seq_lengths_text) return op_estimate_lengths(c, b);
    if (c->len_steps || c->len_seed || c->percentile > 0)
        return failf(c, MN_ERR_INVALID_ARG, "steps, seed and percentile go with seq_lengths");
    rc = mn_estimate(&c->model, &c->setup, &r);
    if (rc != MN_OK && unreplayed_estimate(c, rc, &r)) rc = MN_OK, replayed = 0;
    if (rc != MN_OK) return failed_step(c, "estimate", rc);
    put_estimate(b, &r);
    if (c->st.files)  // what the headers gave (the shape's count and dtype replaced)
        buf_printf(b, ", \"safetensors\": {\"files\": %u, \"tensors\": %llu, \"params\": "
                   "%llu, \"dtype\": \"%s\"}", c->st.files, (unsigned long long)c->st.tensors,
                   (unsigned long long)c->st.params, mn_st_dtype_name(c->st.st_dtype));
    if (!replayed) {  // no timeline: the picture is the replay's
        BUF_LIT(b, ", \"replayed\": false");
        c->want_svg = 0;
    }
    if ((rc = put_outputs(c, b, &r)) != MN_OK) return rc;
    BUF_LIT(b, "}");
    return MN_OK;
}

// ---- fit ----------------------------------------------------------------------------------------

static int op_fit(api_call *c, api_buf *b) {
    mn_fit_result *fr = (mn_fit_result *)malloc(sizeof *fr);  // large: off the stack (wasm)
    uint32_t i;
    int rc;
    if (!fr) return failf(c, MN_ERR_OUT_OF_MEMORY, "fit: out of memory");
    if (c->seq_lengths || c->seq_lengths_text || c->len_steps || c->len_seed || c->percentile) {
        free(fr);  // as the CLI: fit takes one sequence length
        return failf(c, MN_ERR_INVALID_ARG, "seq_lengths, steps, seed and percentile go with "
                     "estimate");
    }
    rc = mn_fit(&c->model, &c->setup, fr);
    if (rc != MN_OK) {
        free(fr);
        return failed_step(c, "fit", rc);
    }
    // memanat.c cmd_fit --json
    buf_printf(b, "{\"max_batch\": %llu, \"max_seq\": %llu, \"plan_found\": %s, "
               "\"plan_slowdown\": %.3f, \"plan\": [", (unsigned long long)fr->max_batch,
               (unsigned long long)fr->max_seq, fr->plan_found ? "true" : "false",
               fr->plan_slowdown);
    for (i = 0; i < fr->plan_len; i++) {
        buf_str(b, i ? ", {\"what\": " : "{\"what\": ");
        buf_json_str(b, fr->plan[i].what);
        BUF_LIT(b, ", \"why\": ");
        buf_json_str(b, fr->plan[i].why);
        BUF_LIT(b, "}");
    }
    BUF_LIT(b, "], \"estimate\": ");
    put_estimate(b, &fr->plan_estimate);
    BUF_LIT(b, "}}");
    free(fr);
    return MN_OK;
}

// ---- replay -------------------------------------------------------------------------------------
//
// A torch snapshot's device_traces, read as memanat.c read_snapshot reads them: the first
// device with entries; "alloc" allocates, "free_requested" (or "free") frees, other actions are
// skipped; null addresses dropped; streams numbered densely in order of appearance (63 and up
// shared).

typedef struct replay_req {
    const mn_json_value *traces;
    const char *alloc_conf, *title;
    uint64_t capacity;
    int want_svg;
} replay_req;

static int read_replay_request(api_call *c, const char *req, size_t len, replay_req *q) {
    const mn_json_value *root;
    uint32_t i;
    char t[80];
    memset(q, 0, sizeof *q);
    if (mn_json_parse(req, len, NULL, &c->doc) != MN_OK)
        return failf(c, MN_ERR_PARSE, "request: %s", c->doc.error);
    root = c->doc.root;
    if (root->type != MN_JSON_OBJECT) return failf(c, MN_ERR_PARSE, "request: want an object");
    for (i = 0; i < root->len; i++) {
        const char *k = root->items[2 * i].str;
        const mn_json_value *v = &root->items[2 * i + 1];
        if (v->type == MN_JSON_NULL) continue;
        if (!strcmp(k, "device_traces")) q->traces = v;
        else if (!strcmp(k, "alloc_conf") && v->type == MN_JSON_STRING) q->alloc_conf = v->str;
        else if (!strcmp(k, "title") && v->type == MN_JSON_STRING) q->title = v->str;
        else if (!strcmp(k, "svg") && (v->type == MN_JSON_TRUE || v->type == MN_JSON_FALSE))
            q->want_svg = v->type == MN_JSON_TRUE;
        else if (!strcmp(k, "capacity")) {
            if (!(v->type == MN_JSON_STRING ? mn_size_parse(v->str, &q->capacity) == MN_OK
                                            : mn_json_u64(v, &q->capacity) == MN_OK))
                return failf(c, MN_ERR_INVALID_ARG, "capacity=%s: want bytes or a size such as "
                             "\"16GiB\"", value_text(v, t, sizeof t));
        } else if (!strcmp(k, "alloc_conf") || !strcmp(k, "title") || !strcmp(k, "svg")) {
            return failf(c, MN_ERR_INVALID_ARG, "replay: %s=%s: wrong type", k,
                         value_text(v, t, sizeof t));
        }  // other members of a whole snapshot (segments, allocator_settings) are not needed
    }
    if (!q->traces || q->traces->type != MN_JSON_ARRAY)
        return failf(c, MN_ERR_INVALID_ARG, "replay: no \"device_traces\" array (a PyTorch memory "
                     "snapshot is expected)");
    return MN_OK;
}

static int read_events(api_call *c, const mn_json_value *dt, mn_trace_event **out, size_t *count) {
    const mn_json_value *tr = NULL;
    uint64_t streams[64];
    uint32_t nstreams = 0, k;
    mn_trace_event *ev;
    size_t i, n = 0;
    for (i = 0; !tr && i < dt->len; i++)
        if (dt->items[i].type == MN_JSON_ARRAY && dt->items[i].len > 0) tr = &dt->items[i];
    *out = NULL, *count = 0;
    if (!tr) return MN_OK;
    ev = (mn_trace_event *)calloc(tr->len, sizeof *ev);
    if (!ev) return failf(c, MN_ERR_OUT_OF_MEMORY, "replay: out of memory");
    for (i = 0; i < tr->len; i++) {
        const mn_json_value *e = &tr->items[i], *a = mn_json_get(e, "action");
        const mn_json_value *cat = mn_json_get(e, "category");
        uint64_t addr = 0, size = 0, stream = 0;
        uint32_t s = 0;
        int is_alloc, j;
        if (!a || a->type != MN_JSON_STRING) {
            free(ev);
            return failf(c, MN_ERR_PARSE, "replay: trace entry %zu has no \"action\"", i);
        }
        if (!strcmp(a->str, "alloc")) is_alloc = 1;
        else if (!strcmp(a->str, "free_requested") || !strcmp(a->str, "free")) is_alloc = 0;
        else continue;
        if (mn_json_u64(mn_json_get(e, "addr"), &addr) != MN_OK ||
            (is_alloc && mn_json_u64(mn_json_get(e, "size"), &size) != MN_OK)) {
            free(ev);
            return failf(c, MN_ERR_PARSE, "replay: trace entry %zu needs integer \"addr\" and "
                         "\"size\"", i);
        }
        if (mn_json_u64(mn_json_get(e, "stream"), &stream) != MN_OK) stream = 0;
        if (stream != 0) {
            for (k = 1; k < nstreams && streams[k] != stream; k++) continue;
            if (k == nstreams) {
                if (nstreams == 0) nstreams = 1;
                k = nstreams < 64 ? nstreams++ : 63;
                streams[k] = stream;
            }
            s = k;
        }
        if (addr == 0) continue;
        ev[n].id = addr, ev[n].size = size, ev[n].stream = s, ev[n].alloc = (uint8_t)is_alloc;
        ev[n].category = MN_CAT_OTHER;
        for (j = 0; cat && cat->type == MN_JSON_STRING && j < MN_CAT_COUNT; j++)
            if (!strcmp(cat->str, mn_category_name((mn_category)j))) ev[n].category = (uint8_t)j;
        n++;
    }
    *out = ev, *count = n;
    return MN_OK;
}

static int op_replay(api_call *c, const char *req, size_t len, api_buf *b) {
    replay_req q;
    mn_trace_event *ev = NULL;
    size_t n = 0;
    mn_sim_cache sc;
    mn_simdev_desc dd;
    mn_cache_desc cd;
    mn_replay_counts counts;
    struct mn_cache_stats st;
    mn_stat_item *items;
    uint32_t count, i;
    double ratio;
    int rc;
    if ((rc = read_replay_request(c, req, len, &q)) != MN_OK) return rc;
    if ((rc = read_events(c, q.traces, &ev, &n)) != MN_OK) return rc;
    memset(&dd, 0, sizeof dd);
    memset(&cd, 0, sizeof cd);
    dd.capacity = q.capacity;
    dd.events_complete = 1;
    cd.config = q.alloc_conf;
    cd.logger.log_fn = capture_log, cd.logger.user_data = c;
    if (q.want_svg) cd.trace_entries = n * 2 + 64 < (1u << 22) ? (uint32_t)(n * 2 + 64) : 1u << 22;
    if ((rc = mn_sim_cache_init(&sc, &dd, &cd)) != MN_OK) {
        free(ev);
        return failf(c, rc, "allocator: %s", mn_result_str((mn_result)rc));
    }
    rc = mn_cache_replay(&sc.cache, ev, n, 0, &counts);
    free(ev);
    if (rc != MN_OK) {
        mn_sim_cache_free(&sc);
        return failf(c, rc, "replay: event %llu: %s",
                     (unsigned long long)(counts.allocations + counts.frees),
                     mn_result_str((mn_result)rc));
    }
    mn_cache_stats(&sc.cache, &st);
    ratio = st.allocated_bytes[MN_STAT_ALL].peak ? (double)st.reserved_bytes[MN_STAT_ALL].peak /
                                                       (double)st.allocated_bytes[MN_STAT_ALL].peak
                                                 : 0.0;
    items = (mn_stat_item *)malloc(sizeof *items * MN_CACHE_STATS_ITEMS);
    if (!items) {
        mn_sim_cache_free(&sc);
        return failf(c, MN_ERR_OUT_OF_MEMORY, "replay: out of memory");
    }
    count = mn_cache_stats_items(&st, items, MN_CACHE_STATS_ITEMS);
    BUF_LIT(b, "{");  // memanat.c replay_print_json
    for (i = 0; i < count; i++)
        buf_printf(b, "%s\"%s\": %lld", i ? ", " : "", items[i].key, (long long)items[i].value);
    free(items);
    buf_printf(b, ", \"peak_reserved_over_peak_allocated\": %.6f, \"replay.allocations\": %llu, "
               "\"replay.frees\": %llu, \"replay.unmatched_frees\": %llu, \"replay.failed\": %llu",
               ratio, (unsigned long long)counts.allocations, (unsigned long long)counts.frees,
               (unsigned long long)counts.unmatched_frees, (unsigned long long)counts.failed);
    if (q.want_svg) {
        BUF_LIT(b, ", \"svg\": ");
        rc = put_cache_svg(c, b, &sc.cache, q.title ? q.title : "replay");
    }
    BUF_LIT(b, "}");
    mn_sim_cache_free(&sc);
    return rc;
}

// ---- tables -------------------------------------------------------------------------------------

static int op_models(api_call *c, api_buf *b) {
    uint32_t i;
    (void)c;
    BUF_LIT(b, "{\"models\": [");
    for (i = 0; i < mn_preset_count(); i++) {
        const mn_model *m = mn_preset_get(i);
        uint64_t n = 0;
        int f = 1;
        mn_model_params(m, &n);
        buf_str(b, i ? ", {" : "{");
        put_str(b, "name", m->name, &f);
        put_str(b, "arch", mn_arch_name(m->arch), &f);
        put_u64(b, "params", n, &f);
        put_u64(b, "layers", m->layers, &f);
        put_u64(b, "hidden", m->hidden, &f);
        put_u64(b, "heads", m->heads, &f);
        put_u64(b, "kv_heads", m->kv_heads ? m->kv_heads : m->heads, &f);
        put_u64(b, "vocab", m->vocab, &f);
        put_u64(b, "max_positions", m->max_positions, &f);
        BUF_LIT(b, "}");
    }
    BUF_LIT(b, "], \"gpus\": [");
    for (i = 0; i < mn_gpu_count(); i++) {
        const mn_gpu *g = mn_gpu_get(i);
        int f = 1;
        buf_str(b, i ? ", {" : "{");
        put_str(b, "name", g->name, &f);
        put_str(b, "label", g->label, &f);
        put_u64(b, "capacity", g->capacity, &f);
        put_u64(b, "context", g->context, &f);
        put_u64(b, "sm", g->sm, &f);
        put_bool(b, "bf16", g->bf16, &f);
        BUF_LIT(b, "}");
    }
    BUF_LIT(b, "], \"version\": \"" MEMANAT_VERSION "\"}");
    return MN_OK;
}

static int op_options(api_call *c, api_buf *b) {
    size_t k;
    (void)c;
    BUF_LIT(b, "{\"options\": [");
    for (k = 0; k < sizeof options / sizeof options[0]; k++) {
        if (k) BUF_LIT(b, ", ");
        buf_json_str(b, options[k].name);
    }
    BUF_LIT(b, "]}");
    return MN_OK;
}

// ---- the entry point ----------------------------------------------------------------------------

int mn_api_call(const char *op, const char *request, size_t len, char **out, size_t *out_len) {
    api_call *c = (api_call *)calloc(1, sizeof *c);
    api_buf b;
    int rc;
    memset(&b, 0, sizeof b);
    *out = NULL, *out_len = 0;
    if (!c) return MN_ERR_OUT_OF_MEMORY;
    if (!op || !request) rc = failf(c, MN_ERR_INVALID_ARG, "no operation or no request");
    else if (!strcmp(op, "estimate") || !strcmp(op, "fit")) {
        rc = read_settings(c, request, len, 1);
        if (rc == MN_OK) rc = op[0] == 'e' ? op_estimate(c, &b) : op_fit(c, &b);
    } else if (!strcmp(op, "replay")) rc = op_replay(c, request, len, &b);
    else if (!strcmp(op, "models")) rc = op_models(c, &b);
    else if (!strcmp(op, "options")) rc = op_options(c, &b);
    else rc = failf(c, MN_ERR_NOT_FOUND, "unknown operation \"%s\" (estimate, fit, replay, "
                    "models, options)", op);
    if (rc == MN_OK && b.oom) rc = failf(c, MN_ERR_OUT_OF_MEMORY, "out of memory");
    if (rc != MN_OK) {  // the message replaces a partial answer
        if (!c->error[0]) snprintf(c->error, sizeof c->error, "%s", mn_result_str((mn_result)rc));
        b.n = 0, b.oom = 0;
        buf_put(&b, c->error, strlen(c->error));
    }
    mn_json_free(&c->doc);
    free(c);
    *out = b.p, *out_len = b.p ? b.n : 0;
    return rc;
}

void mn_api_free(char *p) { free(p); }
