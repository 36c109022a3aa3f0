// >>estimate implementation ---------------------------------------------------------------------
//
// The estimator runs a training step symbolically, as autograd runs it:
//   - every op allocates its output; a tensor lives while a Python-level reference or a saved-for-
//     backward reference holds it (reference counts), so forward frees exactly what eager
//     PyTorch frees;
//   - backward walks the tape in reverse: each op allocates the gradients of its inputs, the
//     gradients of its parameters (kept, or added and freed when they already exist), its own
//     transient buffers, then frees its gradient of the output and drops what it saved;
//   - checkpointed blocks keep only their input and are re-run (recorded) when backward reaches them;
//   - the optimizer allocates its state lazily at the first step, through the same
//     mn_optim_state_bytes() the optimizers use.
// Two steps are simulated (the first creates the optimizer state, the second is the steady state).
// The allocation sequence gives peak allocated; replayed through the caching allocator on a
// simulated device it gives peak reserved. Sources for the per-op rules are cited where they are
// used (PyTorch derivatives.yaml for what each op saves, autocast's op lists for dtypes).

// ---- names --------------------------------------------------------------------------------------

typedef struct mn__name { const char *name; int value; } mn__name;

static const mn__name mn__precision_names[] = {
    {"fp32", MN_PREC_FP32}, {"fp16", MN_PREC_FP16}, {"bf16", MN_PREC_BF16},
    {"fp16-pure", MN_PREC_FP16_PURE}, {"bf16-pure", MN_PREC_BF16_PURE}, {NULL, 0}};
static const mn__name mn__optim_names[] = {
    {"adamw", MN_OPTIM_ADAMW}, {"adamw-8bit", MN_OPTIM_ADAMW_8BIT}, {"sgd", MN_OPTIM_SGD},
    {"sgd-momentum", MN_OPTIM_SGD_MOMENTUM}, {"adafactor", MN_OPTIM_ADAFACTOR}, {"lion", MN_OPTIM_LION},
    {"none", MN_OPTIM_NONE}, {NULL, 0}};
static const mn__name mn__ckpt_names[] = {
    {"none", MN_CKPT_NONE}, {"full", MN_CKPT_FULL}, {"selective", MN_CKPT_SELECTIVE}, {NULL, 0}};
static const mn__name mn__attn_names[] = {
    {"eager", MN_ATTN_EAGER}, {"sdpa", MN_ATTN_SDPA}, {"flash", MN_ATTN_FLASH}, {NULL, 0}};
static const mn__name mn__framework_names[] = {
    {"hf", MN_FW_HF}, {"deepspeed", MN_FW_DEEPSPEED}, {"megatron", MN_FW_MEGATRON},
    {"memanat", MN_FW_MEMANAT}, {NULL, 0}};
static const mn__name mn__offload_names[] = {
    {"none", MN_OFFLOAD_NONE}, {"optimizer", MN_OFFLOAD_OPTIMIZER}, {"all", MN_OFFLOAD_ALL}, {NULL, 0}};
static const mn__name mn__quant_names[] = {
    {"none", MN_QUANT_NONE}, {"int8", MN_QUANT_INT8}, {"nf4", MN_QUANT_NF4}, {NULL, 0}};
static const mn__name mn__head_names[] = {
    {"lm", MN_HEAD_LM}, {"classification", MN_HEAD_CLASSIFICATION}, {"none", MN_HEAD_NONE}, {NULL, 0}};
static const mn__name mn__arch_names[] = {
    {"decoder", MN_ARCH_DECODER}, {"encoder", MN_ARCH_ENCODER},
    {"encoder-decoder", MN_ARCH_ENCODER_DECODER}, {"stack", MN_ARCH_STACK}, {NULL, 0}};

static const char *mn__name_of(const mn__name *t, int v, int dflt) {
    int i;
    if (v == 0) v = dflt;
    for (i = 0; t[i].name; i++)
        if (t[i].value == v) return t[i].name;
    return "unknown";
}

static mn_result mn__parse_name(const mn__name *t, const char *s, int *out) {
    int i;
    if (!s || !out) return MN_ERR_INVALID_ARG;
    for (i = 0; t[i].name; i++)
        if (mn__streq_nocase(s, t[i].name)) { *out = t[i].value; return MN_OK; }
    return MN_ERR_NOT_FOUND;
}

#define MN__NAMES(fn, type, table, dflt)                                                        \
    MNIMPL const char *mn_##fn##_name(type v) { return mn__name_of(table, (int)v, dflt); }        \
    MNIMPL mn_result mn_##fn##_parse(const char *s, type *out) {                                 \
        int v = 0;                                                                              \
        mn_result r = mn__parse_name(table, s, &v);                                             \
        if (r == MN_OK) *out = (type)v;                                                         \
        return r;                                                                               \
    }
MN__NAMES(precision, mn_precision, mn__precision_names, MN_PREC_FP32)
MN__NAMES(optim, mn_optim, mn__optim_names, MN_OPTIM_ADAMW)
MN__NAMES(ckpt, mn_ckpt, mn__ckpt_names, MN_CKPT_NONE)
MN__NAMES(attn, mn_attn, mn__attn_names, MN_ATTN_SDPA)
MN__NAMES(framework, mn_framework, mn__framework_names, MN_FW_HF)
MN__NAMES(offload, mn_offload, mn__offload_names, MN_OFFLOAD_NONE)
MN__NAMES(quant, mn_quant, mn__quant_names, MN_QUANT_NONE)
MN__NAMES(head, mn_head, mn__head_names, MN_HEAD_LM)
#undef MN__NAMES

MNIMPL const char *mn_arch_name(mn_arch a) { return mn__name_of(mn__arch_names, (int)a, MN_ARCH_DECODER); }

MNIMPL const char *mn_framework_describe(mn_framework f) {
    switch (f) {
    case MN_FW_DEFAULT:
    case MN_FW_HF:
        return "hf: HF Trainer + torch autocast. Parameters stay fp32 (they are the master weights); "
               "autocast caches 16-bit weight copies for the step; gradients fp32; optimizer state "
               "in the parameter dtype; gradients kept between steps (zero_grad in place); eager "
               "attention for encoders, sdpa otherwise; loss on fp32-upcast logits";
    case MN_FW_DEEPSPEED:
        return "deepspeed: 16-bit parameters and gradients; the fp32 master copy lives in the "
               "optimizer (ZeRO's K = 12: master + m + v), ZeRO-2 keeps fp16 and fp32 gradient "
               "partitions (2 + 18/N bytes per parameter), ZeRO-3 shards parameters too";
    case MN_FW_MEGATRON:
        return "megatron: 16-bit parameters, fp32 main gradients, fp32 master + Adam in the "
               "optimizer (18 bytes per parameter; 6 + 12/N with the distributed optimizer, "
               "--zero 1); flash attention, fused kernels";
    case MN_FW_MEMANAT:
        return "memanat: this project's trainer: 16-bit weights with fp32 master weights, fp32 "
               "gradients, fp32 optimizer state, flash-style attention";
    case MN_FW_COUNT: break;
    }
    return "unknown framework";
}

MNIMPL mn_result mn_lora_targets_parse(const char *s, uint32_t *out) {
    static const mn__name t[] = {{"q", MN_LORA_Q}, {"k", MN_LORA_K}, {"v", MN_LORA_V}, {"o", MN_LORA_O},
                                 {"gate", MN_LORA_GATE}, {"up", MN_LORA_UP}, {"down", MN_LORA_DOWN},
                                 {"all", MN_LORA_ALL}, {NULL, 0}};
    char word[16];
    uint32_t bits = 0;
    size_t n;
    int v;
    if (!s || !out || !*s) return MN_ERR_INVALID_ARG;
    while (*s) {
        n = strcspn(s, ",");
        if (n == 0 || n >= sizeof word) return MN_ERR_NOT_FOUND;
        memcpy(word, s, n);
        word[n] = 0;
        if (mn__parse_name(t, word, &v) != MN_OK) return MN_ERR_NOT_FOUND;
        bits |= (uint32_t)v;
        s += n;
        if (*s == ',') s++;
    }
    *out = bits;
    return MN_OK;
}

// ---- presets (shapes from the published config.json files) --------------------------------------

#define MN__KB(x) ((uint64_t)(x) << 10)
#define MN__MIB(x) ((uint64_t)(x) << 20)

// name, arch, layers, enc, hidden, heads, kv, head_dim, ffn, vocab, maxpos, types, buckets, labels,
// norm, act, pos, head, gated, tie, qkv_b, out_b, mlp_b, pooler, final_norm, embed_norm,
// dropout, attn_dropout, dtype
#define MN__BERT(nm, L, h, a, f) {nm, MN_ARCH_ENCODER, L, 0, h, a, 0, 0, f, 30522, 512, 2, 0, 0, \
    MN_NORM_LAYERNORM, MN_ACT_GELU, MN_POS_LEARNED, MN_HEAD_LM, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0.1f, 0.1f, \
    MN_FP32, 0, NULL, 0, 0}
#define MN__GPT2(nm, L, h, a) {nm, MN_ARCH_DECODER, L, 0, h, a, 0, 0, 0, 50257, 1024, 0, 0, 0, \
    MN_NORM_LAYERNORM, MN_ACT_GELU_NEW, MN_POS_LEARNED, MN_HEAD_LM, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0.1f, \
    0.1f, MN_FP32, 0, NULL, 0, 0}
#define MN__T5(nm, L, h, a, d, f, gated, tie) {nm, MN_ARCH_ENCODER_DECODER, L, L, h, a, 0, d, f, 32128, \
    0, 0, 32, 0, MN_NORM_RMSNORM, (gated) ? MN_ACT_GELU_NEW : MN_ACT_RELU, MN_POS_RELATIVE, MN_HEAD_LM, \
    gated, tie, 0, 0, 0, 0, 1, 0, 0, 0, 0.1f, 0.1f, (gated) ? MN_BF16 : MN_FP32, 0, NULL, 0, 0}
#define MN__LLAMA(nm, L, h, a, kv, d, f, V, tie, qkvb, dt) {nm, MN_ARCH_DECODER, L, 0, h, a, kv, d, f, V, \
    0, 0, 0, 0, MN_NORM_RMSNORM, MN_ACT_SILU, MN_POS_ROPE, MN_HEAD_LM, 1, tie, qkvb, 0, 0, 0, 1, 0, 0, 0, \
    0.0f, 0.0f, dt, 0, NULL, 0, 0}
#define MN__BIGCODE(nm, L, h, a, f) {nm, MN_ARCH_DECODER, L, 0, h, a, 1, 0, f, 49152, 8192, 0, 0, 0, \
    MN_NORM_LAYERNORM, MN_ACT_GELU_TANH, MN_POS_LEARNED, MN_HEAD_LM, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0.1f, \
    0.1f, MN_FP32, 0, NULL, 0, 0}

static const mn_model mn__presets[] = {
    MN__BERT("bert-base-uncased", 12, 768, 12, 3072),
    MN__BERT("bert-large-uncased", 24, 1024, 16, 4096),
    MN__GPT2("gpt2", 12, 768, 12),
    MN__GPT2("gpt2-medium", 24, 1024, 16),
    MN__GPT2("gpt2-large", 36, 1280, 20),
    MN__GPT2("gpt2-xl", 48, 1600, 25),
    MN__T5("t5-small", 6, 512, 8, 64, 2048, 0, 1),
    MN__T5("t5-base", 12, 768, 12, 64, 3072, 0, 1),
    MN__T5("t5-large", 24, 1024, 16, 64, 4096, 0, 1),
    MN__T5("t5-3b", 24, 1024, 32, 128, 16384, 0, 1),
    MN__T5("t5-11b", 24, 1024, 128, 128, 65536, 0, 1),
    MN__T5("flan-t5-base", 12, 768, 12, 64, 2048, 1, 0),
    MN__T5("flan-t5-large", 24, 1024, 16, 64, 2816, 1, 0),
    MN__T5("flan-t5-xl", 24, 2048, 32, 64, 5120, 1, 0),
    MN__LLAMA("llama-2-7b", 32, 4096, 32, 32, 0, 11008, 32000, 0, 0, MN_FP16),
    MN__LLAMA("llama-2-13b", 40, 5120, 40, 40, 0, 13824, 32000, 0, 0, MN_FP16),
    MN__LLAMA("llama-2-70b", 80, 8192, 64, 8, 0, 28672, 32000, 0, 0, MN_FP16),
    MN__LLAMA("llama-3-8b", 32, 4096, 32, 8, 0, 14336, 128256, 0, 0, MN_BF16),
    MN__LLAMA("llama-3-70b", 80, 8192, 64, 8, 0, 28672, 128256, 0, 0, MN_BF16),
    MN__LLAMA("llama-3.1-8b", 32, 4096, 32, 8, 0, 14336, 128256, 0, 0, MN_BF16),
    MN__LLAMA("llama-3.1-70b", 80, 8192, 64, 8, 0, 28672, 128256, 0, 0, MN_BF16),
    MN__LLAMA("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, 1, 0, MN_BF16),
    MN__LLAMA("llama-3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, 1, 0, MN_BF16),
    MN__LLAMA("mistral-7b", 32, 4096, 32, 8, 0, 14336, 32000, 0, 0, MN_BF16),
    MN__LLAMA("mistral-7b-v0.3", 32, 4096, 32, 8, 0, 14336, 32768, 0, 0, MN_BF16),
    MN__LLAMA("qwen2-0.5b", 24, 896, 14, 2, 0, 4864, 151936, 1, 1, MN_BF16),
    MN__LLAMA("qwen2-1.5b", 28, 1536, 12, 2, 0, 8960, 151936, 1, 1, MN_BF16),
    MN__LLAMA("qwen2-7b", 28, 3584, 28, 4, 0, 18944, 152064, 0, 1, MN_BF16),
    MN__LLAMA("qwen2.5-0.5b", 24, 896, 14, 2, 0, 4864, 151936, 1, 1, MN_BF16),
    MN__LLAMA("qwen2.5-7b", 28, 3584, 28, 4, 0, 18944, 152064, 0, 1, MN_BF16),
    MN__LLAMA("qwen2.5-14b", 48, 5120, 40, 8, 0, 13824, 152064, 0, 1, MN_BF16),
    MN__BIGCODE("starcoderbase-1b", 24, 2048, 16, 8192),
    MN__BIGCODE("starcoderbase-7b", 42, 4096, 32, 16384),
    MN__BIGCODE("starcoder", 40, 6144, 48, 24576),
};

MNIMPL uint32_t mn_preset_count(void) { return (uint32_t)(sizeof mn__presets / sizeof mn__presets[0]); }

MNIMPL const mn_model *mn_preset_get(uint32_t i) { return i < mn_preset_count() ? &mn__presets[i] : NULL; }

MNIMPL mn_result mn_preset_find(const char *name, mn_model *out) {
    uint32_t i;
    const char *slash;
    if (!name || !out) return MN_ERR_INVALID_ARG;
    slash = strrchr(name, '/');  // accept hub ids such as "meta-llama/llama-2-7b"
    if (slash) name = slash + 1;
    for (i = 0; i < mn_preset_count(); i++) {
        if (mn__streq_nocase(name, mn__presets[i].name)) {
            *out = mn__presets[i];
            return MN_OK;
        }
    }
    return MN_ERR_NOT_FOUND;
}

// Capacity as nvidia-smi reports the total; context = CUDA context + kernels of a torch 2.x
// process with lazy module loading (ml-engineering measured 0.47 GiB on an A100; older torch
// with eager loading takes 0.9-1.8 GiB, e.g. the HF V100 runs' 1343 MiB: pass --context).
static const mn_gpu mn__gpus[] = {
    {"v100-16gb", "Tesla V100 16GB", MN__MIB(16160), MN__MIB(600), 0},
    {"v100-32gb", "Tesla V100 32GB", MN__MIB(32510), MN__MIB(600), 0},
    {"t4", "Tesla T4 16GB", MN__MIB(15360), MN__MIB(500), 0},
    {"a10g", "NVIDIA A10G 24GB", MN__MIB(23028), MN__MIB(500), 1},
    {"a10", "NVIDIA A10 24GB", MN__MIB(23028), MN__MIB(500), 1},
    {"l4", "NVIDIA L4 24GB", MN__MIB(23034), MN__MIB(500), 1},
    {"l40s", "NVIDIA L40S 48GB", MN__MIB(46068), MN__MIB(520), 1},
    {"rtx3090", "GeForce RTX 3090 24GB", MN__MIB(24576), MN__MIB(520), 1},
    {"rtx4090", "GeForce RTX 4090 24GB", MN__MIB(24564), MN__MIB(520), 1},
    {"a100-40gb", "NVIDIA A100 40GB", MN__MIB(40960), MN__MIB(481), 1},
    {"a100-80gb", "NVIDIA A100 80GB", MN__MIB(81920), MN__MIB(481), 1},
    {"h100-80gb", "NVIDIA H100 80GB", MN__MIB(81559), MN__MIB(530), 1},
    {"h200", "NVIDIA H200 141GB", MN__MIB(143771), MN__MIB(540), 1},
};

MNIMPL uint32_t mn_gpu_count(void) { return (uint32_t)(sizeof mn__gpus / sizeof mn__gpus[0]); }

MNIMPL const mn_gpu *mn_gpu_get(uint32_t i) { return i < mn_gpu_count() ? &mn__gpus[i] : NULL; }

MNIMPL mn_result mn_gpu_find(const char *name, mn_gpu *out) {
    static const mn__name alias[] = {{"v100", 0}, {"a100", 10}, {"h100", 11}, {"3090", 7},
                                     {"4090", 8}, {"h200-141gb", 12}, {NULL, 0}};
    uint32_t i;
    int v;
    if (!name || !out) return MN_ERR_INVALID_ARG;
    for (i = 0; i < mn_gpu_count(); i++)
        if (mn__streq_nocase(name, mn__gpus[i].name)) { *out = mn__gpus[i]; return MN_OK; }
    if (mn__parse_name(alias, name, &v) == MN_OK) { *out = mn__gpus[v]; return MN_OK; }
    return MN_ERR_NOT_FOUND;
}

MNIMPL const char *mn_phase_name(mn_phase p) {
    static const char *const n[MN_PHASE_COUNT] = {"none", "load", "forward", "backward", "optimizer",
                                                  "prefill", "decode"};
    return (unsigned)p < MN_PHASE_COUNT ? n[p] : "unknown";
}

// ---- the simulation state ----------------------------------------------------------------------

#define MN__NONE 0xffffffffu

typedef struct mn__ten {
    uint64_t bytes;
    uint32_t refs;   // Python-level references + saved-for-backward references
    uint32_t grad;   // tensor id of its gradient, MN__NONE
    uint8_t cat, rg, live, esz;
} mn__ten;

typedef struct mn__op {
    uint64_t bwd_temp;      // transient bytes of the backward beyond input gradients
    uint32_t in[3];         // activation inputs (gradients flow to those that require grad)
    uint32_t saved[8];      // tensors kept for backward
    uint32_t param[3];      // parameters whose gradients this op produces
    uint32_t out;           // output tensor
    uint32_t block;         // full checkpointing: block to re-run (MN__NONE otherwise)
    uint32_t recomp_block;  // the op is a checkpoint of this block
    uint8_t nin, nsaved, nparam, cast16;  // cast16: weight gradient first made in 16-bit (autocast)
} mn__op;

typedef struct mn__param {
    uint64_t numel, dims[2];
    uint32_t ndim, block;
    uint32_t w16;            // autocast cached 16-bit copy (tensor id) during a forward
    uint32_t grad;           // gradient tensor id
    uint8_t trainable, quant, is_embed, has_state;
} mn__param;

typedef struct mn__cfg {
    mn_model m;
    mn_setup s;
    uint64_t b, seq, ntok, d, qd, kvd, f, r;  // batch (x beams), tokens, head dim, widths, LoRA rank
    uint64_t enc_seq;      // encoder tokens per sequence (cross-attention keys)
    uint32_t a_esz;        // activations out of matmuls
    uint32_t w_esz;        // parameters as stored
    uint32_t g_esz;        // parameter gradients
    uint32_t n_esz;        // norm / residual stream outputs
    uint32_t kv_esz;
    int amp;               // torch autocast (casts per linear, cached 16-bit weights)
    int hf;                // HF modelling code (composite RMSNorm, upcast logits, ...)
    int fw_master;         // separate fp32 master copy: 1 = counted in optimizer, 2 = master_weights
    int grads_keep, grads_prealloc, state_half;
    mn_category param_cat; // category of the stored parameters
    mn_attn attn;
    uint32_t nblocks;      // encoder + decoder blocks
    uint32_t gpus, zero;
    int gpu_is_hopper;     // cuBLAS takes a 32 MiB workspace on sm90, 4 MiB before
} mn__cfg;

typedef struct mn__sim {
    const mn_allocator *al;
    mn__cfg *c;
    mn__ten *t;
    mn__op *ops;
    mn__param *p;
    mn_trace_event *ev;
    uint32_t *bstart;        // first parameter of each block
    uint64_t nt, ct, nops, cops, np, cp, nev, cev;
    uint64_t cur[MN_CAT_COUNT], total, peak, at_peak[MN_CAT_COUNT], cat_peak[MN_CAT_COUNT];
    mn_phase phase, peak_phase;
    int record, counting, events, training;
    uint32_t cursor, block;  // parameter cursor; block being built (counting pass)
    uint32_t cursor_emb;     // the word embedding (shared by a T5 decoder and tied heads)
    uint32_t hold;           // a tensor the caller holds until the end of the micro-batch
    uint32_t blk;            // block being run
    mn_result err;
} mn__sim;

// Grows *arr (elem bytes each) to hold at least need elements.
static int mn__grow(mn__sim *S, void **arr, uint64_t *cap, uint64_t need, size_t elem) {
    uint64_t nc;
    void *n;
    if (need <= *cap) return 1;
    nc = *cap ? *cap * 2 : 256;
    while (nc < need) nc *= 2;
    if (nc > (uint64_t)(SIZE_MAX / elem) || nc > 0xfffffff0u) { S->err = MN_ERR_OVERFLOW; return 0; }
    n = mn__alloc(S->al, (size_t)nc * elem);
    if (!n) { S->err = MN_ERR_OUT_OF_MEMORY; return 0; }
    if (*arr) memcpy(n, *arr, (size_t)*cap * elem);
    mn__free(S->al, *arr);
    *arr = n;
    *cap = nc;
    return 1;
}

// Checked product; an overflow sticks in S->err and yields 0.
static uint64_t mn__m(mn__sim *S, uint64_t a, uint64_t b) {
    uint64_t r;
    if (mn_mul_u64(a, b, &r) != MN_OK) { S->err = MN_ERR_OVERFLOW; return 0; }
    return r;
}

static uint64_t mn__m3(mn__sim *S, uint64_t a, uint64_t b, uint64_t c) { return mn__m(S, mn__m(S, a, b), c); }

static void mn__event(mn__sim *S, uint32_t id, int alloc) {
    mn_trace_event *e;
    if (!S->events) return;
    if (!mn__grow(S, (void **)&S->ev, &S->cev, S->nev + 1, sizeof *S->ev)) return;
    e = &S->ev[S->nev++];
    e->size = S->t[id].bytes;
    e->id = id;
    e->alloc = (uint8_t)alloc;
    e->category = S->t[id].cat;
    e->phase = (uint8_t)S->phase;
}

static uint32_t mn__alloc_t(mn__sim *S, uint64_t numel, uint32_t esz, mn_category cat) {
    mn__ten *t;
    uint32_t id;
    uint64_t bytes;
    int k;
    if (S->counting || S->err) return MN__NONE;
    bytes = mn__m(S, numel, esz);
    if (S->err) return MN__NONE;
    if (bytes == 0) bytes = 1;
    if (!mn__grow(S, (void **)&S->t, &S->ct, S->nt + 1, sizeof *S->t)) return MN__NONE;
    id = (uint32_t)S->nt++;
    t = &S->t[id];
    t->bytes = bytes, t->refs = 1, t->grad = MN__NONE, t->cat = (uint8_t)cat, t->rg = 0, t->live = 1;
    t->esz = (uint8_t)esz;
    S->cur[cat] += bytes;
    if (S->cur[cat] > S->cat_peak[cat]) S->cat_peak[cat] = S->cur[cat];
    if (mn_add_u64(S->total, bytes, &S->total) != MN_OK) { S->err = MN_ERR_OVERFLOW; return MN__NONE; }
    if (S->total > S->peak) {
        S->peak = S->total, S->peak_phase = S->phase;
        for (k = 0; k < MN_CAT_COUNT; k++) S->at_peak[k] = S->cur[k];
    }
    mn__event(S, id, 1);
    return id;
}

static void mn__drop(mn__sim *S, uint32_t id) {
    mn__ten *t;
    if (id == MN__NONE || S->counting || S->err) return;
    t = &S->t[id];
    MN_ASSERT(t->live && t->refs > 0);
    if (--t->refs) return;
    t->live = 0;
    S->cur[t->cat] -= t->bytes;
    S->total -= t->bytes;
    mn__event(S, id, 0);
}

static void mn__ref(mn__sim *S, uint32_t id) {
    if (id != MN__NONE && !S->counting && !S->err) S->t[id].refs++;
}

// A transient buffer: allocated and freed at once (its peak contribution is what counts).
static void mn__transient(mn__sim *S, uint64_t bytes, mn_category cat) {
    if (bytes) mn__drop(S, mn__alloc_t(S, bytes, 1, cat));
}

static uint64_t mn__tnumel(mn__sim *S, uint32_t id) {
    return (id == MN__NONE || S->counting || S->err) ? 0 : S->t[id].bytes / S->t[id].esz;
}

static uint32_t mn__esz(mn__sim *S, uint32_t id) {
    return (id == MN__NONE || S->counting || S->err) ? 4 : S->t[id].esz;
}

static int mn__rg(mn__sim *S, uint32_t id) { return id != MN__NONE && !S->counting && S->t[id].rg; }

// Records an op on the tape when autograd records (grad mode and something requires grad).
// saved[] gain a reference; the op's output must exist.
static void mn__op_rec(mn__sim *S, uint32_t out, const uint32_t *in, int nin, const uint32_t *saved,
                       int nsaved, const uint32_t *param, int nparam, uint64_t bwd_temp) {
    mn__op *o;
    int i, any = 0;
    if (S->counting || S->err || !S->record || out == MN__NONE) return;
    for (i = 0; i < nin; i++) any |= mn__rg(S, in[i]);
    for (i = 0; i < nparam; i++) any |= param[i] != MN__NONE && S->p[param[i]].trainable;
    if (!any) return;
    S->t[out].rg = 1;
    if (!mn__grow(S, (void **)&S->ops, &S->cops, S->nops + 1, sizeof *S->ops)) return;
    o = &S->ops[S->nops++];
    memset(o, 0, sizeof *o);
    o->out = out, o->block = MN__NONE, o->recomp_block = MN__NONE, o->bwd_temp = bwd_temp;
    for (i = 0; i < nin && i < 3; i++) if (in[i] != MN__NONE) o->in[o->nin++] = in[i];
    for (i = 0; i < nsaved && i < 8; i++)
        if (saved[i] != MN__NONE) { o->saved[o->nsaved++] = saved[i]; mn__ref(S, saved[i]); }
    for (i = 0; i < nparam && i < 3; i++) if (param[i] != MN__NONE) o->param[o->nparam++] = param[i];
}

// ---- parameters --------------------------------------------------------------------------------

// Counting pass: registers the next parameter tensor (cols 0 = a vector). Forward pass: returns the
// next parameter in the same order, so both passes walk one description of the model.
static uint32_t mn__w(mn__sim *S, uint64_t rows, uint64_t cols, int trainable, int quant, int embed) {
    mn__param *p;
    if (S->err) return MN__NONE;
    if (!S->counting) return S->cursor < S->np ? S->cursor++ : MN__NONE;
    if (!mn__grow(S, (void **)&S->p, &S->cp, S->np + 1, sizeof *S->p)) return MN__NONE;
    p = &S->p[S->np];
    memset(p, 0, sizeof *p);
    p->dims[0] = rows, p->dims[1] = cols, p->ndim = cols ? 2 : 1;
    p->numel = cols ? mn__m(S, rows, cols) : rows;
    p->block = S->block, p->trainable = (uint8_t)trainable, p->quant = (uint8_t)quant;
    p->is_embed = (uint8_t)embed, p->w16 = MN__NONE, p->grad = MN__NONE;
    return (uint32_t)S->np++;
}

static int mn__base_trainable(const mn__cfg *c) { return c->r == 0 && c->s.trainable_params == 0; }

// ---- layers ------------------------------------------------------------------------------------
// Each returns a new tensor holding one Python reference that the caller drops.

static uint32_t mn__identity(mn__sim *S, uint32_t x) { mn__ref(S, x); return x; }

// y = x W^T (+ b) [+ LoRA: y += (x A^T) B^T * scale]. x: [rows, in] -> y: [rows, out].
// Saves x when W trains (mm saves self for mat2's gradient, derivatives.yaml) and, under autocast,
// the cached 16-bit weight (for the input gradient). Autocast casts a fp32 input per call.
static uint32_t mn__linear(mn__sim *S, uint32_t x, uint64_t in, uint64_t out, int bias,
                           uint32_t lora_bit, int quantizable, uint32_t shared) {
    mn__cfg *c = S->c;
    int tr = mn__base_trainable(c), lora = c->r && (c->s.lora_targets & lora_bit);
    int quant = quantizable && c->s.quant > MN_QUANT_NONE;
    uint32_t w = shared != MN__NONE ? shared : mn__w(S, out, in, tr, quant, 0);
    uint32_t bb = bias ? mn__w(S, out, 0, tr, 0, 0) : MN__NONE;
    uint32_t la = lora ? mn__w(S, c->r, in, 1, 0, 0) : MN__NONE;
    uint32_t lb = lora ? mn__w(S, out, c->r, 1, 0, 0) : MN__NONE;
    uint32_t xin = x, w16 = MN__NONE, tmp = MN__NONE, y, sv[2], pr[2];
    uint64_t rows, bwd = 0;
    mn__param *P;
    if (S->counting || S->err || w == MN__NONE) return MN__NONE;
    P = &S->p[w];
    rows = mn__tnumel(S, x) / in;
    if (c->amp && mn__esz(S, x) == 4) {  // autocast: a fresh 16-bit copy of the input per linear
        xin = mn__alloc_t(S, rows * in, 2, MN_CAT_ACTIVATIONS);
        mn__op_rec(S, xin, &x, 1, NULL, 0, NULL, 0, 0);
    }
    if (c->amp && !P->quant) {  // autocast caches the 16-bit weight for the rest of the forward
        if (P->w16 == MN__NONE) P->w16 = mn__alloc_t(S, P->numel, 2, MN_CAT_WEIGHTS);
        w16 = P->w16;
    }
    if (P->quant || c->zero >= 3) {  // dequantized / gathered full weight, for the matmul only
        tmp = mn__alloc_t(S, P->numel, 2, MN_CAT_TEMPORARY);
        bwd = P->numel * 2;
    }
    y = mn__alloc_t(S, mn__m(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
    sv[0] = P->trainable ? xin : MN__NONE;
    sv[1] = mn__rg(S, xin) ? w16 : MN__NONE;
    pr[0] = w, pr[1] = bb;
    mn__op_rec(S, y, &xin, 1, sv, 2, pr, 2, bwd);
    if (S->nops && S->record && S->ops[S->nops - 1].out == y) S->ops[S->nops - 1].cast16 = (uint8_t)c->amp;
    mn__drop(S, tmp);
    if (lora) {  // PEFT LoRA: h = x A^T (saves x), z = h B^T (saves h), y = y + z * scale
        uint32_t h = mn__alloc_t(S, mn__m(S, rows, c->r), c->a_esz, MN_CAT_ACTIVATIONS), z, z2, y2, two[2];
        mn__op_rec(S, h, &xin, 1, &xin, 1, &la, 1, 0);
        z = mn__alloc_t(S, mn__m(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
        mn__op_rec(S, z, &h, 1, &h, 1, &lb, 1, 0);
        mn__drop(S, h);
        z2 = mn__alloc_t(S, mn__m(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
        mn__op_rec(S, z2, &z, 1, NULL, 0, NULL, 0, 0);
        mn__drop(S, z);
        y2 = mn__alloc_t(S, mn__m(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
        two[0] = y, two[1] = z2;
        mn__op_rec(S, y2, two, 2, NULL, 0, NULL, 0, 0);
        mn__drop(S, y), mn__drop(S, z2);
        y = y2;
    }
    if (xin != x) mn__drop(S, xin);
    return y;
}

// Dropout keeps a 1-byte mask (native_dropout, derivatives.yaml) and allocates its output.
static uint32_t mn__dropout(mn__sim *S, uint32_t x, float p) {
    uint32_t mask, y;
    uint64_t n;
    if (p <= 0.0f || !S->training) return mn__identity(S, x);
    if (S->counting || S->err) return MN__NONE;
    n = mn__tnumel(S, x);
    mask = mn__alloc_t(S, n, 1, MN_CAT_ACTIVATIONS);
    y = mn__alloc_t(S, n, mn__esz(S, x), MN_CAT_ACTIVATIONS);
    mn__op_rec(S, y, &x, 1, &mask, 1, NULL, 0, 0);
    mn__drop(S, mask);
    return y;
}

// Elementwise a + b; the result takes the wider dtype (type promotion); saves nothing.
static uint32_t mn__add(mn__sim *S, uint32_t a, uint32_t b) {
    uint32_t y, in[2];
    uint32_t ea = mn__esz(S, a), eb = mn__esz(S, b);
    if (S->counting || S->err) return MN__NONE;
    y = mn__alloc_t(S, mn__tnumel(S, a), ea > eb ? ea : eb, MN_CAT_ACTIVATIONS);
    in[0] = a, in[1] = b;
    mn__op_rec(S, y, in, 2, NULL, 0, NULL, 0, 0);
    return y;
}

// Layernorm / RMSNorm over the last `width` features.
// Fused kernels (native_layer_norm, apex) save the input and per-row statistics. HF's RMSNorm is
// written in Python ops: an fp32 copy of the input (saved by pow and mul), the normalized values
// cast back to the input dtype (saved by the weight multiply when the weight trains).
static uint32_t mn__norm(mn__sim *S, uint32_t x, uint64_t width) {
    mn__cfg *c = S->c;
    int tr = mn__base_trainable(c), ln = c->m.norm != MN_NORM_RMSNORM;
    uint32_t w = mn__w(S, width, 0, tr, 0, 0);
    uint32_t bb = ln ? mn__w(S, width, 0, tr, 0, 0) : MN__NONE;
    uint32_t y, st, sv[2], pr[2], ex = mn__esz(S, x);
    uint64_t n, rows;
    if (S->counting || S->err) return MN__NONE;
    n = mn__tnumel(S, x), rows = n / width;
    pr[0] = w, pr[1] = bb;
    if (ln || !c->hf) {
        uint32_t oe = c->amp ? 4 : ex;  // autocast runs layer_norm in fp32
        st = mn__alloc_t(S, rows * 2, 4, MN_CAT_ACTIVATIONS);
        y = mn__alloc_t(S, n, oe, MN_CAT_ACTIVATIONS);
        sv[0] = x, sv[1] = st;
        mn__op_rec(S, y, &x, 1, sv, 2, pr, 2, 0);
        mn__drop(S, st);
        return y;
    } else {
        uint32_t x32 = x, rs, h1, h16, out_e = ex;
        if (ex != 4) {
            x32 = mn__alloc_t(S, n, 4, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, x32, &x, 1, NULL, 0, NULL, 0, 0);
        }
        mn__transient(S, n * 4, MN_CAT_ACTIVATIONS);  // x32.pow(2) before the mean
        rs = mn__alloc_t(S, rows, 4, MN_CAT_ACTIVATIONS);
        sv[0] = x32, sv[1] = rs;
        mn__op_rec(S, rs, &x32, 1, sv, 2, NULL, 0, 0);
        h1 = mn__alloc_t(S, n, 4, MN_CAT_ACTIVATIONS);
        mn__op_rec(S, h1, &x32, 1, sv, 2, NULL, 0, 0);
        h16 = h1;
        if (ex != 4) {
            h16 = mn__alloc_t(S, n, ex, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, h16, &h1, 1, NULL, 0, NULL, 0, 0);
            mn__drop(S, h1);
        }
        if (c->w_esz == 4 && ex != 4) out_e = 4;  // fp32 weight * 16-bit values promotes
        y = mn__alloc_t(S, n, out_e, MN_CAT_ACTIVATIONS);
        sv[0] = tr ? h16 : MN__NONE;
        mn__op_rec(S, y, &h16, 1, sv, 1, &w, 1, 0);
        mn__drop(S, h16), mn__drop(S, rs);
        if (x32 != x) mn__drop(S, x32);
        return y;
    }
}

// Activations: relu/gelu/silu kernels save their input (derivatives.yaml). HF's "gelu_new" is
// 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))) in separate ops: it also keeps the tanh output,
// 0.5 x and 1 + tanh, and makes four more transient copies on the way.
static uint32_t mn__act(mn__sim *S, uint32_t x) {
    uint32_t y, e, sv[4];
    uint64_t n;
    if (S->counting || S->err) return MN__NONE;
    n = mn__tnumel(S, x), e = mn__esz(S, x);
    if (S->c->m.act == MN_ACT_GELU_NEW && S->c->hf) {
        uint32_t a1 = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS), a2, th, op1, half;
        a2 = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, a1);
        a1 = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, a2);
        th = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, a1);
        op1 = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        half = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        y = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        sv[0] = x, sv[1] = th, sv[2] = op1, sv[3] = half;
        mn__op_rec(S, y, &x, 1, sv, 4, NULL, 0, 3 * n * e);
        mn__drop(S, th), mn__drop(S, op1), mn__drop(S, half);
        return y;
    }
    y = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
    mn__op_rec(S, y, &x, 1, &x, 1, NULL, 0, 0);
    return y;
}

// a * b, saving both operands (mul's gradient needs the other factor).
static uint32_t mn__mul(mn__sim *S, uint32_t a, uint32_t b) {
    uint32_t y, in[2];
    if (S->counting || S->err) return MN__NONE;
    y = mn__alloc_t(S, mn__tnumel(S, a), mn__esz(S, a), MN_CAT_ACTIVATIONS);
    in[0] = a, in[1] = b;
    mn__op_rec(S, y, in, 2, in, 2, NULL, 0, 0);
    return y;
}

// Rotary embedding as HF writes it: q*cos + rotate_half(q)*sin (three transients, one result).
// Fused kernels (megatron, flash) write one output.
static uint32_t mn__rope(mn__sim *S, uint32_t x, uint64_t n) {
    uint32_t e = mn__esz(S, x), y, t1 = MN__NONE, t2, t3 = MN__NONE;
    if (S->counting || S->err) return MN__NONE;
    if (S->c->hf) {
        t1 = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        t2 = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        t3 = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, t2);
    }
    y = mn__alloc_t(S, n, e, MN_CAT_ACTIVATIONS);
    mn__op_rec(S, y, &x, 1, NULL, 0, NULL, 0, 0);
    mn__drop(S, t1), mn__drop(S, t3);
    return y;
}

// The attention core softmax(q k^T * scale + mask) v for b sequences, sq queries, skv keys.
// Eager (HF modelling code): bmm copies of q, k (repeated to all heads for GQA) and v are saved,
// the scores pass through scale and mask ops (new tensors), softmax saves its output (fp32 under
// autocast and in the Llama/T5 code), dropout saves a 1-byte mask and its output, a cast back to
// the value dtype is saved by the second bmm. Fused attention (sdpa, flash) saves q, k, v, the
// output and the log-sum-exp per row (FlashAttention-2 paper, backward pass).
// Selective checkpointing (Korthikanti et al. 2022) keeps only q, k, v and recomputes the rest.
static uint32_t mn__attn_core(mn__sim *S, uint32_t q, uint32_t k, uint32_t v, uint64_t sq,
                              uint64_t skv, int cross) {
    mn__cfg *c = S->c;
    uint32_t e = mn__esz(S, q), in[3], sv[8], y;
    uint64_t nq = mn__m3(S, c->b, sq, c->qd), nkv = mn__m3(S, c->b, skv, c->kvd);
    uint64_t ns = mn__m(S, mn__m3(S, c->b, c->m.heads, sq), skv);
    int sel = c->s.checkpointing == MN_CKPT_SELECTIVE && S->record;
    int nsv = 0, i;
    (void)cross;
    if (S->counting || S->err) return MN__NONE;
    in[0] = q, in[1] = k, in[2] = v;
    if (c->attn == MN_ATTN_EAGER) {
        int t5 = c->m.posemb == MN_POS_RELATIVE;
        uint32_t sm_e = (c->amp || t5 || c->m.posemb == MN_POS_ROPE) ? 4 : e;
        uint32_t mask_e = (c->amp && c->m.arch == MN_ARCH_ENCODER) ? 4 : e;  // fp32 extended mask
        uint64_t nrep = c->hf ? mn__m3(S, c->b, skv, c->qd) : nkv;         // repeat_kv for GQA
        uint32_t qc, kc, vc, s0, s1, P, mk = MN__NONE, Pd, P16, C, Cc;
        uint64_t kept = 0;
        qc = mn__alloc_t(S, nq, e, MN_CAT_ACTIVATIONS);
        kc = mn__alloc_t(S, nrep, e, MN_CAT_ACTIVATIONS);
        s0 = mn__alloc_t(S, ns, e, MN_CAT_ACTIVATIONS);
        if (!t5) {  // scores * scale, then + mask: two new tensors (T5 adds its bias in place)
            s1 = mn__alloc_t(S, ns, e, MN_CAT_ACTIVATIONS), mn__drop(S, s0), s0 = s1;
            s1 = mn__alloc_t(S, ns, mask_e, MN_CAT_ACTIVATIONS), mn__drop(S, s0), s0 = s1;
        }
        P = mn__alloc_t(S, ns, sm_e, MN_CAT_ACTIVATIONS);
        // torch <= 1.10: _softmax_backward_data took the softmax input, so autograd kept it too
        if (c->s.torch_version >= 111) mn__drop(S, s0), s0 = MN__NONE;
        Pd = P;
        if (c->m.attn_dropout > 0.0f && S->training) {
            mk = mn__alloc_t(S, ns, 1, MN_CAT_ACTIVATIONS);
            Pd = mn__alloc_t(S, ns, sm_e, MN_CAT_ACTIVATIONS);
        }
        P16 = Pd;
        if (sm_e != e) P16 = mn__alloc_t(S, ns, e, MN_CAT_ACTIVATIONS);
        vc = mn__alloc_t(S, nrep, e, MN_CAT_ACTIVATIONS);
        C = mn__alloc_t(S, nq, e, MN_CAT_ACTIVATIONS);
        Cc = mn__alloc_t(S, nq, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, C);
        sv[0] = qc, sv[1] = kc, sv[2] = P, sv[3] = mk, sv[4] = P16, sv[5] = vc, sv[6] = s0;
        for (i = 0; i < 7; i++) {
            int dup = 0, j;
            for (j = 0; j < i; j++) dup |= sv[j] == sv[i];
            if (sv[i] != MN__NONE && !dup) kept += S->t[sv[i]].bytes;
        }
        if (sel) {
            sv[0] = q, sv[1] = k, sv[2] = v, nsv = 3;
            mn__op_rec(S, Cc, in, 3, sv, nsv, NULL, 0, kept + 2 * ns * sm_e + 3 * nq * e);
        } else {
            nsv = 7;
            mn__op_rec(S, Cc, in, 3, sv, nsv, NULL, 0, 2 * ns * sm_e + 3 * nq * e);
        }
        mn__drop(S, qc), mn__drop(S, kc), mn__drop(S, vc), mn__drop(S, P), mn__drop(S, s0);
        if (Pd != P) mn__drop(S, Pd);
        if (P16 != Pd) mn__drop(S, P16);
        mn__drop(S, mk);
        y = Cc;
    } else {
        uint32_t O = mn__alloc_t(S, nq, e, MN_CAT_ACTIVATIONS);
        uint32_t lse = mn__alloc_t(S, mn__m3(S, c->b, c->m.heads, sq), 4, MN_CAT_ACTIVATIONS);
        sv[0] = q, sv[1] = k, sv[2] = v, sv[3] = O, sv[4] = lse;
        y = O;
        if (c->hf) {  // attn_output.transpose(1, 2).contiguous()
            y = mn__alloc_t(S, nq, e, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, O, in, 3, sv, 5, NULL, 0, nq * 4);
            mn__op_rec(S, y, &O, 1, NULL, 0, NULL, 0, 0);
            mn__drop(S, O);
        } else {
            mn__op_rec(S, O, in, 3, sv, 5, NULL, 0, nq * 4);
        }
        mn__drop(S, lse);
    }
    return y;
}

static uint32_t mn__attention(mn__sim *S, uint32_t xq, uint32_t xkv, uint64_t sq, uint64_t skv, int cross) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden;
    int fused = c->m.posemb == MN_POS_LEARNED && c->m.arch == MN_ARCH_DECODER;  // GPT-2 c_attn
    uint32_t q, k, v, ctx, o;
    if (c->m.posemb == MN_POS_RELATIVE && !cross &&
        (S->blk == 0 || (c->m.arch == MN_ARCH_ENCODER_DECODER && S->blk == c->m.encoder_layers)))
        mn__w(S, c->m.rel_buckets, c->m.heads, mn__base_trainable(c), 0, 1);  // T5 relative bias
    if (fused && !cross) {
        q = mn__linear(S, xq, h, c->qd + 2 * c->kvd, c->m.qkv_bias, MN_LORA_Q | MN_LORA_K | MN_LORA_V, 1, MN__NONE);
        k = mn__identity(S, q), v = mn__identity(S, q);
    } else {
        q = mn__linear(S, xq, h, c->qd, c->m.qkv_bias, MN_LORA_Q, 1, MN__NONE);
        k = mn__linear(S, xkv, h, c->kvd, c->m.qkv_bias, MN_LORA_K, 1, MN__NONE);
        v = mn__linear(S, xkv, h, c->kvd, c->m.qkv_bias, MN_LORA_V, 1, MN__NONE);
    }
    if (c->m.posemb == MN_POS_ROPE && !S->counting) {
        uint32_t q2 = mn__rope(S, q, mn__m3(S, c->b, sq, c->qd)), k2 = mn__rope(S, k, mn__m3(S, c->b, skv, c->kvd));
        mn__drop(S, q), mn__drop(S, k);
        q = q2, k = k2;
    }
    if (cross) skv = c->enc_seq;
    ctx = mn__attn_core(S, q, k, v, sq, skv, cross);
    o = mn__linear(S, ctx, c->qd, h, c->m.out_bias, MN_LORA_O, 1, MN__NONE);
    mn__drop(S, ctx), mn__drop(S, q), mn__drop(S, k), mn__drop(S, v);
    return o;
}

// MLP: act(x W1) W2, or act(x Wg) * (x Wu) Wd when gated; T5 applies dropout inside.
static uint32_t mn__mlp(mn__sim *S, uint32_t x) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden, f = c->f;
    uint32_t u, a, d, y, g;
    int t5 = c->m.posemb == MN_POS_RELATIVE;
    if (c->m.gated_mlp) {
        g = mn__linear(S, x, h, f, c->m.mlp_bias, MN_LORA_GATE, 1, MN__NONE);
        u = mn__linear(S, x, h, f, c->m.mlp_bias, MN_LORA_UP, 1, MN__NONE);
        a = mn__act(S, g);
        mn__drop(S, g);
        y = mn__mul(S, a, u);
        mn__drop(S, a), mn__drop(S, u);
    } else {
        u = mn__linear(S, x, h, f, c->m.mlp_bias, MN_LORA_UP, 1, MN__NONE);
        y = mn__act(S, u);
        mn__drop(S, u);
    }
    if (t5) {
        d = mn__dropout(S, y, c->m.dropout);
        mn__drop(S, y);
        y = d;
    }
    d = mn__linear(S, y, f, h, c->m.mlp_bias, MN_LORA_DOWN, 1, MN__NONE);
    mn__drop(S, y);
    return d;
}

// Residual: x + dropout(y); drops y.
static uint32_t mn__residual(mn__sim *S, uint32_t x, uint32_t y) {
    uint32_t d = mn__dropout(S, y, S->c->m.dropout), r;
    mn__drop(S, y);
    r = mn__add(S, d, x);
    mn__drop(S, d);
    return r;
}

static int mn__block_is_decoder(const mn__cfg *c, uint32_t blk) {
    return c->m.arch == MN_ARCH_DECODER || (c->m.arch == MN_ARCH_ENCODER_DECODER && blk >= c->m.encoder_layers);
}

// One transformer block: pre-norm (GPT-2, Llama, T5) or post-norm (BERT). mem: encoder output
// for the cross-attention of an encoder-decoder's decoder blocks.
static uint32_t mn__block(mn__sim *S, uint32_t x, uint32_t blk, uint32_t mem) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden, s = c->seq;
    uint32_t n, a, x1, x2;
    int cross = c->m.arch == MN_ARCH_ENCODER_DECODER && mn__block_is_decoder(c, blk);
    if (S->counting) S->block = blk + 1, S->bstart[blk] = (uint32_t)S->np;
    else S->cursor = S->bstart[blk];
    S->blk = blk;
    if (c->m.post_norm) {
        a = mn__attention(S, x, x, s, s, 0);
        x1 = mn__residual(S, x, a);
        n = mn__norm(S, x1, h);
        mn__drop(S, x1);
        a = mn__mlp(S, n);
        x2 = mn__residual(S, n, a);
        mn__drop(S, n);
        n = mn__norm(S, x2, h);
        mn__drop(S, x2);
        return n;
    }
    n = mn__norm(S, x, h);
    a = mn__attention(S, n, n, s, s, 0);
    mn__drop(S, n);
    x1 = mn__residual(S, x, a);
    if (cross) {
        n = mn__norm(S, x1, h);
        a = mn__attention(S, n, mem, s, s, 1);
        mn__drop(S, n);
        x2 = mn__residual(S, x1, a);
        mn__drop(S, x1);
        x1 = x2;
    }
    n = mn__norm(S, x1, h);
    a = mn__mlp(S, n);
    mn__drop(S, n);
    x2 = mn__residual(S, x1, a);
    mn__drop(S, x1);
    return x2;
}

// Drops the autocast weight cache (autocast exit); tensors saved for backward stay.
static void mn__amp_clear(mn__sim *S) {
    uint64_t i;
    if (S->counting) return;
    for (i = 0; i < S->np; i++)
        if (S->p[i].w16 != MN__NONE) mn__drop(S, S->p[i].w16), S->p[i].w16 = MN__NONE;
}

// A block under full checkpointing: run without recording, keep its input (and the encoder
// output), and record one op that re-runs the block when backward reaches it
// (torch.utils.checkpoint).
static uint32_t mn__block_ckpt(mn__sim *S, uint32_t x, uint32_t blk, uint32_t mem) {
    uint32_t y, sv[2];
    mn__op *o;
    if (S->counting || !S->record || S->c->s.checkpointing != MN_CKPT_FULL) return mn__block(S, x, blk, mem);
    S->record = 0;
    y = mn__block(S, x, blk, mem);
    S->record = 1;
    if (S->err || y == MN__NONE) return y;
    {  // autograd records the checkpoint only when something in it needs a gradient
        uint64_t i, end = blk + 1 < S->c->nblocks ? S->bstart[blk + 1] : S->np;
        int any = mn__rg(S, x) || mn__rg(S, mem);
        for (i = S->bstart[blk]; i < end && !any; i++) any = S->p[i].trainable;
        if (!any) return y;
    }
    if (!mn__grow(S, (void **)&S->ops, &S->cops, S->nops + 1, sizeof *S->ops)) return y;
    o = &S->ops[S->nops++];
    memset(o, 0, sizeof *o);
    o->out = y, o->block = MN__NONE, o->recomp_block = blk;
    sv[0] = x, sv[1] = mem;
    o->in[o->nin++] = x;
    o->saved[o->nsaved++] = x, mn__ref(S, x);
    if (mem != MN__NONE) o->in[o->nin++] = mem, o->saved[o->nsaved++] = mem, mn__ref(S, mem);
    (void)sv;
    S->t[y].rg = 1;
    return y;
}

// Token (+ position, + token type) embeddings, optional norm, dropout. ids: [ntok] int64.
static uint32_t mn__embeddings(mn__sim *S, uint32_t ids, int first) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden;
    int tr = mn__base_trainable(c);
    uint32_t w, y, e2, sum, pw, tw;
    if (first) S->block = 0;
    w = first ? mn__w(S, c->m.vocab, h, tr, 0, 1) : 0;
    if (first) S->cursor_emb = w;
    else w = S->cursor_emb;
    pw = (first && c->m.posemb == MN_POS_LEARNED) ? mn__w(S, c->m.max_positions, h, tr, 0, 1) : MN__NONE;
    tw = (first && c->m.type_vocab) ? mn__w(S, c->m.type_vocab, h, tr, 0, 1) : MN__NONE;
    if (S->counting || S->err) {
        if (first && c->m.embed_norm) mn__norm(S, MN__NONE, h);
        return MN__NONE;
    }
    y = mn__alloc_t(S, c->ntok * h, c->w_esz == 1 ? 2 : c->w_esz, MN_CAT_ACTIVATIONS);
    mn__op_rec(S, y, NULL, 0, &ids, 1, &w, 1, 0);
    if (pw != MN__NONE) {  // position_ids [1, s]: one row per position, broadcast over the batch
        e2 = mn__alloc_t(S, c->seq * h, mn__esz(S, y), MN_CAT_ACTIVATIONS);
        mn__op_rec(S, e2, NULL, 0, NULL, 0, &pw, 1, 0);
        sum = mn__add(S, y, e2);
        mn__drop(S, y), mn__drop(S, e2);
        y = sum;
    }
    if (tw != MN__NONE) {
        e2 = mn__alloc_t(S, c->ntok * h, mn__esz(S, y), MN_CAT_ACTIVATIONS);
        mn__op_rec(S, e2, NULL, 0, &ids, 1, &tw, 1, 0);
        sum = mn__add(S, y, e2);
        mn__drop(S, y), mn__drop(S, e2);
        y = sum;
    }
    if (first && c->m.embed_norm) {
        e2 = mn__norm(S, y, h);
        mn__drop(S, y);
        y = e2;
    }
    e2 = mn__dropout(S, y, c->m.dropout);
    mn__drop(S, y);
    return e2;
}

// Loss heads. LM (HF): logits in the compute dtype, upcast to fp32 (`logits.float()`), then
// cross_entropy = log_softmax (saves its fp32 output) + nll_loss, whose backward makes a dense
// [tokens, vocab] gradient. Classification: pooler + classifier on the first token (BERT), or a
// score layer on every token (decoders); both tiny, but the pooler keeps the last hidden states.
static uint32_t mn__head(mn__sim *S, uint32_t x, uint32_t labels) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden, V = c->m.vocab;
    int tr = mn__base_trainable(c);
    uint32_t y, t, lg, l32, lsm, loss, sv[2], pw, pb, cw, cb;
    if (c->m.head == MN_HEAD_CLASSIFICATION) {
        uint64_t L = c->m.num_labels;
        if (c->m.pooler) {
            pw = mn__w(S, h, h, tr, 0, 0), pb = mn__w(S, h, 0, tr, 0, 0);
            cw = mn__w(S, L, h, tr || c->r, 0, 0), cb = mn__w(S, L, 0, tr || c->r, 0, 0);
            if (S->counting || S->err) return MN__NONE;
            sv[0] = pw, sv[1] = pb;
            y = mn__alloc_t(S, c->b * h, c->a_esz, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, y, &x, 1, &x, 1, sv, 2, 0);  // the first-token view keeps x alive
            t = mn__act(S, y);
            mn__drop(S, y);
            y = mn__dropout(S, t, c->m.dropout);
            mn__drop(S, t);
            sv[0] = cw, sv[1] = cb;
            lg = mn__alloc_t(S, c->b * L, c->a_esz, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, lg, &y, 1, &y, 1, sv, 2, 0);
            mn__drop(S, y);
        } else {
            cw = mn__w(S, L, h, tr || c->r, 0, 0);
            if (S->counting || S->err) return MN__NONE;
            lg = mn__alloc_t(S, c->ntok * L, c->a_esz, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, lg, &x, 1, &x, 1, &cw, 1, 0);
        }
        loss = mn__alloc_t(S, 1, 4, MN_CAT_ACTIVATIONS);
        mn__op_rec(S, loss, &lg, 1, &lg, 1, NULL, 0, 0);
        mn__drop(S, lg);
        return loss;
    }
    if (c->m.head == MN_HEAD_NONE) {
        if (S->counting || S->err) return MN__NONE;
        loss = mn__alloc_t(S, 1, 4, MN_CAT_ACTIVATIONS);
        mn__op_rec(S, loss, &x, 1, NULL, 0, NULL, 0, 0);
        return loss;
    }
    y = mn__identity(S, x);
    if (c->m.lm_transform) {  // BERT MLM: dense + act + layernorm before the decoder
        t = mn__linear(S, y, h, h, 1, 0, 0, MN__NONE);
        mn__drop(S, y);
        y = mn__act(S, t);
        mn__drop(S, t);
        t = mn__norm(S, y, h);
        mn__drop(S, y);
        y = t;
    }
    if (c->m.tie_embeddings && c->m.posemb == MN_POS_RELATIVE && !S->counting) {  // T5: x * d^-0.5
        t = mn__alloc_t(S, mn__tnumel(S, y), mn__esz(S, y), MN_CAT_ACTIVATIONS);
        mn__op_rec(S, t, &y, 1, NULL, 0, NULL, 0, 0);
        mn__drop(S, y);
        y = t;
    }
    lg = mn__linear(S, y, h, V, 0, 0, 0, c->m.tie_embeddings ? S->cursor_emb : MN__NONE);
    if (c->m.lm_transform) cb = mn__w(S, V, 0, tr, 0, 0);  // decoder bias
    mn__drop(S, y);
    if (S->counting || S->err) return MN__NONE;
    l32 = lg;
    if (mn__esz(S, lg) != 4) {
        l32 = mn__alloc_t(S, mn__tnumel(S, lg), 4, MN_CAT_ACTIVATIONS);
        mn__op_rec(S, l32, &lg, 1, NULL, 0, NULL, 0, 0);
    }
    lsm = mn__alloc_t(S, mn__tnumel(S, l32), 4, MN_CAT_ACTIVATIONS);
    mn__op_rec(S, lsm, &l32, 1, &lsm, 1, NULL, 0, 0);
    loss = mn__alloc_t(S, 1, 4, MN_CAT_ACTIVATIONS);
    sv[0] = lsm, sv[1] = labels;
    mn__op_rec(S, loss, &lsm, 1, sv, 2, NULL, 0, 0);  // nll backward: the dense grad of lsm
    mn__drop(S, lsm);
    if (l32 != lg) mn__drop(S, l32);
    mn__drop(S, lg);
    return loss;
}

// The whole forward of one micro-batch. Returns the loss tensor.
static uint32_t mn__forward(mn__sim *S, uint32_t ids, uint32_t labels) {
    mn__cfg *c = S->c;
    uint32_t x, y, mem = MN__NONE, blk, L = c->nblocks, E = 0;
    if (c->m.arch == MN_ARCH_STACK) return MN__NONE;  // handled by mn__stack_forward
    if (c->m.arch == MN_ARCH_ENCODER_DECODER) E = (uint32_t)c->m.encoder_layers;
    x = mn__embeddings(S, ids, 1);
    for (blk = 0; blk < L; blk++) {
        if (E && blk == E) {  // encoder done: final norm, then the decoder's embeddings
            if (c->m.final_norm) {
                y = mn__norm(S, x, c->m.hidden);
                mn__drop(S, x);
                x = y;
            }
            if (!S->counting) {
                y = mn__dropout(S, x, c->m.dropout);
                mn__drop(S, x);
                x = y;
            }
            mem = x;
            x = mn__embeddings(S, ids, 0);
        }
        y = mn__block_ckpt(S, x, blk, mem);
        mn__drop(S, x);
        x = y;
    }
    mn__drop(S, mem);
    if (c->m.final_norm) {
        y = mn__norm(S, x, c->m.hidden);
        mn__drop(S, x);
        x = y;
    }
    y = mn__head(S, x, labels);
    mn__drop(S, x);
    return y;
}

// A custom stack: layers applied in order to [tokens, stack_in] inputs (which do not require
// grad, like data). Shared layers reuse an earlier layer's parameters.
static uint32_t mn__stack_forward(mn__sim *S, uint32_t x) {
    mn__cfg *c = S->c;
    const mn_layer *ly = c->m.stack;
    uint32_t i, y, *pidx = NULL, loss;
    if (!S->counting) pidx = S->bstart;  // parameter index of each layer, filled while counting
    mn__ref(S, x);                       // the caller keeps its reference to the input
    for (i = 0; i < c->m.stack_len && !S->err; i++) {
        uint32_t w = MN__NONE;
        if (S->counting) {
            if (ly[i].shared_with) w = S->bstart[ly[i].shared_with - 1];
            else if (ly[i].kind == MN_LAYER_LINEAR) {
                w = mn__w(S, ly[i].out, ly[i].in, 1, 0, 0);
                if (ly[i].bias) mn__w(S, ly[i].out, 0, 1, 0, 0);
            } else if (ly[i].kind == MN_LAYER_EMBEDDING) {
                w = mn__w(S, ly[i].in, ly[i].out, 1, 0, 1);
            } else if (ly[i].kind == MN_LAYER_NORM) {
                w = mn__w(S, ly[i].out, 0, 1, 0, 0);
                mn__w(S, ly[i].out, 0, 1, 0, 0);
            }
            S->bstart[i] = w;
            continue;
        }
        w = pidx[i];
        switch (ly[i].kind) {
        case MN_LAYER_LINEAR: {
            uint32_t pr[2], sv;
            uint64_t rows = mn__tnumel(S, x) / ly[i].in;
            pr[0] = w, pr[1] = ly[i].bias ? w + 1 : MN__NONE;
            y = mn__alloc_t(S, mn__m(S, rows, ly[i].out), c->a_esz, MN_CAT_ACTIVATIONS);
            sv = x;
            mn__op_rec(S, y, &x, 1, &sv, 1, pr, 2, 0);
            break;
        }
        case MN_LAYER_EMBEDDING:
            y = mn__alloc_t(S, mn__m(S, c->ntok, ly[i].out), c->a_esz, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, y, NULL, 0, &x, 1, &w, 1, 0);
            break;
        case MN_LAYER_NORM: {
            uint32_t pr[2], sv[2], st = mn__alloc_t(S, c->ntok * 2, 4, MN_CAT_ACTIVATIONS);
            pr[0] = w, pr[1] = w + 1, sv[0] = x, sv[1] = st;
            y = mn__alloc_t(S, mn__tnumel(S, x), mn__esz(S, x), MN_CAT_ACTIVATIONS);
            mn__op_rec(S, y, &x, 1, sv, 2, pr, 2, 0);
            mn__drop(S, st);
            break;
        }
        case MN_LAYER_ACTIVATION: y = mn__act(S, x); break;
        case MN_LAYER_DROPOUT: y = mn__dropout(S, x, 0.1f); break;
        default: y = mn__identity(S, x); break;
        }
        mn__drop(S, x);
        x = y;
    }
    if (S->counting || S->err) return MN__NONE;
    loss = mn__alloc_t(S, 1, 4, MN_CAT_ACTIVATIONS);  // loss = out.sum(); the caller holds out
    mn__op_rec(S, loss, &x, 1, NULL, 0, NULL, 0, 0);
    S->hold = x;
    return loss;
}

// ---- backward, optimizer, the step -------------------------------------------------------------

// Produces the gradient of a parameter in backward: a new tensor that becomes .grad when there
// is none (AccumulateGrad steals it) or is added and freed; partitioned and preallocated buffers
// receive the produced gradient and free it (megatron accumulates in place).
static void mn__param_grad(mn__sim *S, uint32_t pi, int cast16) {
    mn__cfg *c = S->c;
    mn__param *P = &S->p[pi];
    uint32_t h16 = MN__NONE;
    uint64_t full;
    if (!P->trainable) return;
    if (cast16) h16 = mn__alloc_t(S, P->numel, 2, MN_CAT_TEMPORARY);  // grad of the 16-bit copy
    full = mn__m(S, P->numel, c->g_esz);
    if (c->grads_prealloc || c->zero >= 2 || c->s.offload > MN_OFFLOAD_NONE) {
        if (c->s.framework != MN_FW_MEGATRON) mn__transient(S, mn__m(S, P->numel, cast16 ? 2 : c->g_esz), MN_CAT_TEMPORARY);
        if (P->grad == MN__NONE && !c->grads_prealloc && c->s.offload <= MN_OFFLOAD_NONE)
            P->grad = mn__alloc_t(S, (full + c->gpus - 1) / c->gpus, 1, MN_CAT_GRADIENTS);
    } else if (P->grad == MN__NONE) {
        P->grad = mn__alloc_t(S, P->numel, c->g_esz, MN_CAT_GRADIENTS);
    } else {
        mn__transient(S, full, MN_CAT_TEMPORARY);
    }
    mn__drop(S, h16);
}

static void mn__backward(mn__sim *S, uint64_t lo);

// Backward of one recorded op (see the section comment).
static void mn__backward_op(mn__sim *S, mn__op op) {
    mn__cfg *c = S->c;
    int i;
    if (op.recomp_block != MN__NONE) {  // re-run a checkpointed block, recording, then its backward
        uint64_t mark = S->nops;
        uint32_t y2, cur = S->cursor;
        y2 = mn__block(S, op.in[0], op.recomp_block, op.nin > 1 ? op.in[1] : MN__NONE);
        if (c->amp) mn__amp_clear(S);
        S->cursor = cur;
        if (S->err || y2 == MN__NONE) return;
        S->t[y2].grad = S->t[op.out].grad;
        S->t[op.out].grad = MN__NONE;
        mn__drop(S, y2);
        mn__backward(S, mark);
        for (i = 0; i < op.nsaved; i++) mn__drop(S, op.saved[i]);
        return;
    }
    for (i = 0; i < op.nin; i++) {
        mn__ten *t = &S->t[op.in[i]];
        if (!t->rg) continue;
        if (t->grad == MN__NONE) {
            uint32_t g = mn__alloc_t(S, t->bytes / t->esz, t->esz, MN_CAT_TEMPORARY);
            S->t[op.in[i]].grad = g;
        } else {
            mn__transient(S, t->bytes, MN_CAT_TEMPORARY);
        }
    }
    for (i = 0; i < op.nparam; i++) mn__param_grad(S, op.param[i], op.cast16);
    mn__transient(S, op.bwd_temp, MN_CAT_TEMPORARY);
    if (S->t[op.out].grad != MN__NONE) {
        mn__drop(S, S->t[op.out].grad);
        S->t[op.out].grad = MN__NONE;
    }
    for (i = 0; i < op.nsaved; i++) mn__drop(S, op.saved[i]);
}

static void mn__backward(mn__sim *S, uint64_t lo) {
    uint64_t i;
    for (i = S->nops; i-- > lo && !S->err;) {
        mn__op op = S->ops[i];  // by value: a recompute may grow the tape
        S->nops = i + 1;
        mn__backward_op(S, op);
    }
    if (!S->err) S->nops = lo;
}

// Bytes of a parameter as stored on one GPU (quantized base weights: bitsandbytes nf4 with
// double quantization, 4 + 0.127 bits per parameter (QLoRA paper); int8 with an fp32 scale per row).
static uint64_t mn__weight_bytes(mn__sim *S, const mn__param *P) {
    const mn__cfg *c = S->c;
    uint64_t b;
    if (P->quant && c->s.quant == MN_QUANT_NF4) b = mn__m(S, P->numel, 4127) / 8000;
    else if (P->quant) b = P->numel + P->dims[0] * 4;
    else b = mn__m(S, P->numel, c->w_esz);
    if (c->zero >= 3) b = (b + c->gpus - 1) / c->gpus;
    return b;
}

static uint64_t mn__state_bytes(mn__sim *S, const mn__param *P) {
    const mn__cfg *c = S->c;
    mn_optim_desc d;
    uint64_t b = 0;
    memset(&d, 0, sizeof d);
    d.kind = c->s.optim;
    if (mn_optim_state_bytes(&d, P->dims, P->ndim, &b) != MN_OK) { S->err = MN_ERR_OVERFLOW; return 0; }
    if (c->state_half && c->s.optim != MN_OPTIM_ADAMW_8BIT) b /= 2;  // zeros_like(16-bit param)
    if (c->zero >= 1) b = (b + c->gpus - 1) / c->gpus;
    return b;
}

// Largest per-tensor temporary of the optimizer step (fused kernels need none): AdamW's
// denominator sqrt(v)/... , Adafactor's squared gradient and update, Lion's update.
static uint64_t mn__optim_temp(mn__sim *S, const mn__param *P) {
    const mn__cfg *c = S->c;
    uint64_t e = c->state_half ? 2 : 4;
    if (c->s.framework != MN_FW_HF || c->s.offload > MN_OFFLOAD_NONE) return 0;  // fused optimizers
    switch (c->s.optim) {
    case MN_OPTIM_ADAMW: case MN_OPTIM_LION: return mn__m(S, P->numel, e);
    case MN_OPTIM_ADAFACTOR: return mn__m3(S, P->numel, e, 2);
    default: return 0;
    }
}

static void mn__alloc_states(mn__sim *S, uint64_t i) {
    mn__param *P = &S->p[i];
    uint64_t b;
    if (!P->trainable || P->has_state) return;
    P->has_state = 1;
    b = mn__state_bytes(S, P);
    if (b == 0 || S->c->s.offload > MN_OFFLOAD_NONE) return;
    if (S->c->s.optim == MN_OPTIM_ADAMW || S->c->s.optim == MN_OPTIM_ADAMW_8BIT) {
        mn__alloc_t(S, b / 2, 1, MN_CAT_OPTIMIZER);  // exp_avg, exp_avg_sq: two tensors
        mn__alloc_t(S, b - b / 2, 1, MN_CAT_OPTIMIZER);
    } else {
        mn__alloc_t(S, b, 1, MN_CAT_OPTIMIZER);
    }
}

// Persistent allocations at load time, in module order.
static void mn__load(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t i;
    S->phase = MN_PHASE_LOAD;
    for (i = 0; i < S->np; i++)
        if (c->s.offload != MN_OFFLOAD_ALL)
            mn__alloc_t(S, mn__weight_bytes(S, &S->p[i]), 1, S->p[i].trainable ? c->param_cat : MN_CAT_WEIGHTS);
    if (c->s.infer) return;
    for (i = 0; i < S->np; i++) {
        mn__param *P = &S->p[i];
        if (!P->trainable) continue;
        if (c->fw_master && c->s.offload <= MN_OFFLOAD_NONE) {
            uint64_t b = mn__m(S, P->numel, 4);
            if (c->zero >= 1) b = (b + c->gpus - 1) / c->gpus;
            mn__alloc_t(S, b, 1, c->fw_master == 1 ? MN_CAT_OPTIMIZER : MN_CAT_MASTER_WEIGHTS);
        }
        if (c->grads_prealloc && c->s.offload <= MN_OFFLOAD_NONE) {
            uint64_t b = mn__m(S, P->numel, c->g_esz);
            if (c->zero >= 2) b = (b + c->gpus - 1) / c->gpus;
            if (c->s.framework == MN_FW_DEEPSPEED && c->fw_master && (c->zero == 1 || c->zero == 2))
                b += (mn__m(S, P->numel, 4) + c->gpus - 1) / c->gpus;  // fp32 gradient partition
            P->grad = mn__alloc_t(S, b, 1, MN_CAT_GRADIENTS);
        }
        if (c->grads_prealloc) mn__alloc_states(S, i);  // engines create state at init
    }
}

static void mn__optimizer(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t i;
    S->phase = MN_PHASE_OPTIMIZER;
    if (c->s.optim == MN_OPTIM_NONE) return;
    for (i = 0; i < S->np; i++) mn__alloc_states(S, i);
    for (i = 0; i < S->np; i++)
        if (S->p[i].trainable) mn__transient(S, mn__optim_temp(S, &S->p[i]), MN_CAT_TEMPORARY);
    if (!c->grads_keep && !c->grads_prealloc)
        for (i = 0; i < S->np; i++)
            if (S->p[i].grad != MN__NONE) mn__drop(S, S->p[i].grad), S->p[i].grad = MN__NONE;
}

// One micro-batch: inputs, forward, backward.
static void mn__micro_batch(mn__sim *S) {
    mn__cfg *c = S->c;
    uint32_t ids, labels, mask = MN__NONE, loss;
    S->phase = MN_PHASE_FORWARD;
    S->record = 1, S->training = 1, S->hold = MN__NONE;
    if (c->m.arch == MN_ARCH_STACK) {
        ids = mn__alloc_t(S, mn__m(S, c->ntok, c->m.stack_in), c->a_esz, MN_CAT_ACTIVATIONS);
        labels = MN__NONE;
        loss = mn__stack_forward(S, ids);
    } else {
        ids = mn__alloc_t(S, c->ntok, 8, MN_CAT_ACTIVATIONS);
        labels = mn__alloc_t(S, c->m.head == MN_HEAD_CLASSIFICATION ? c->b : c->ntok, 8, MN_CAT_ACTIVATIONS);
        if (c->m.arch == MN_ARCH_ENCODER) mask = mn__alloc_t(S, c->ntok, 8, MN_CAT_ACTIVATIONS);
        loss = mn__forward(S, ids, labels);
    }
    if (c->amp) mn__amp_clear(S);
    if (S->err || loss == MN__NONE) return;
    S->phase = MN_PHASE_BACKWARD;
    {
        uint32_t g = mn__alloc_t(S, 1, 4, MN_CAT_TEMPORARY);  // (S->t may move while allocating)
        if (g != MN__NONE) S->t[loss].grad = g;
    }
    mn__backward(S, 0);
    mn__drop(S, loss), mn__drop(S, S->hold);
    mn__drop(S, ids), mn__drop(S, labels), mn__drop(S, mask);
}

// Inference: weights, a KV cache for prompt + new tokens (preallocated, like a static cache),
// and the prefill forward without autograd; logits only for the last position.
static void mn__generate(mn__sim *S) {
    mn__cfg *c = S->c;
    uint32_t ids, x, y, blk, dec0 = 0, mem = MN__NONE;
    uint64_t len, per;
    S->phase = MN_PHASE_PREFILL;
    S->record = 0, S->training = 0;
    len = c->s.prompt + c->s.new_tokens;
    per = mn__m3(S, mn__m(S, c->b, len), c->kvd, c->kv_esz);
    if (c->m.arch == MN_ARCH_ENCODER_DECODER) dec0 = (uint32_t)c->m.encoder_layers;
    for (blk = dec0; blk < c->nblocks && c->m.arch != MN_ARCH_ENCODER; blk++) {
        mn__alloc_t(S, per, 1, MN_CAT_KV_CACHE);
        mn__alloc_t(S, per, 1, MN_CAT_KV_CACHE);
    }
    ids = mn__alloc_t(S, c->ntok, 8, MN_CAT_ACTIVATIONS);
    x = mn__embeddings(S, ids, 1);
    for (blk = 0; blk < c->nblocks && !S->err; blk++) {
        if (dec0 && blk == dec0) {  // encoder done: the decoder starts from one token per sequence
            mem = x;
            c->seq = 1, c->ntok = c->b;
            x = mn__embeddings(S, ids, 0);
        }
        y = mn__block(S, x, blk, mem);
        mn__drop(S, x);
        x = y;
    }
    mn__drop(S, mem);
    if (c->amp) mn__amp_clear(S);
    if (c->m.head == MN_HEAD_LM && !S->err) {
        uint32_t lg = mn__alloc_t(S, mn__m(S, c->b, c->m.vocab), c->a_esz, MN_CAT_ACTIVATIONS);
        mn__transient(S, mn__m3(S, c->b, c->m.vocab, 4), MN_CAT_ACTIVATIONS);
        mn__drop(S, lg);
    }
    mn__drop(S, x), mn__drop(S, ids);
}

// ---- resolving the inputs ----------------------------------------------------------------------

#define MN__BAD(lg, ...) do { mn__log(lg, MN_LOG_ERROR, __VA_ARGS__); return MN_ERR_INVALID_ARG; } while (0)

// Exact parameter count of a Llama-like shape (used to size a model known only by --params).
static uint64_t mn__guess_count(uint64_t L, uint64_t h, uint64_t V) { return L * 12 * h * h + 2 * V * h; }

static mn_result mn__resolve_model(const mn_model *in, const mn_logger *lg, mn_model *m) {
    *m = *in;
    if (m->arch == MN_ARCH_DEFAULT) m->arch = MN_ARCH_DECODER;
    if ((unsigned)m->arch >= MN_ARCH_COUNT) MN__BAD(lg, "model: unknown architecture %d", (int)m->arch);
    if (m->arch == MN_ARCH_STACK) {
        uint32_t i;
        if (!m->stack || m->stack_len == 0) MN__BAD(lg, "model: a custom stack needs at least one layer");
        for (i = 0; i < m->stack_len; i++) {
            const mn_layer *l = &m->stack[i];
            if (l->shared_with > i) MN__BAD(lg, "model: layer %u shares weights with a later layer %u", i + 1, l->shared_with);
            if (l->out == 0 || l->out > (1ull << 24) || l->in > (1ull << 24))
                MN__BAD(lg, "model: layer %u has width %llu (want 1..16777216)", i + 1, (unsigned long long)l->out);
            if (l->kind == MN_LAYER_LINEAR && l->in == 0) MN__BAD(lg, "model: linear layer %u has no input width", i + 1);
        }
        if (m->stack_in == 0) m->stack_in = m->stack[0].kind == MN_LAYER_EMBEDDING ? 1 : m->stack[0].in;
        if (m->stack_in == 0) m->stack_in = m->stack[0].out;
        if (!m->name[0]) snprintf(m->name, sizeof m->name, "custom stack of %u layers", m->stack_len);
        if (m->dtype == MN_DTYPE_DEFAULT) m->dtype = MN_FP32;
        return MN_OK;
    }
    if (m->layers == 0 && m->hidden == 0 && m->params) {  // only a count: a Llama-like shape
        uint64_t N = m->params, L, h, V = 32000;
        double l3 = cbrt((double)N / (12.0 * 128.0 * 128.0));
        L = l3 < 1.0 ? 1 : l3 > 4096.0 ? 4096 : (uint64_t)l3;  // beyond that: the rest is one matrix
        h = 128 * L;
        if (N < 2000000000ull) V = 8192;
        while (h > 128 && mn__guess_count(L, h, V) > N) h -= 128;
        m->arch = MN_ARCH_DECODER, m->layers = L, m->hidden = h, m->heads = h / 128, m->kv_heads = 0;
        m->head_dim = 128, m->ffn = h * 8 / 3, m->vocab = V, m->norm = MN_NORM_RMSNORM, m->act = MN_ACT_SILU;
        m->posemb = MN_POS_ROPE, m->gated_mlp = 1, m->final_norm = 1, m->tie_embeddings = 0;
        if (!m->name[0]) snprintf(m->name, sizeof m->name, "%.3gB parameters (shape guessed)", (double)N / 1e9);
    }
    if (m->layers == 0 || m->layers > 10000) MN__BAD(lg, "model: layers %llu (want 1..10000)", (unsigned long long)m->layers);
    if (m->hidden == 0 || m->hidden > (1ull << 20)) MN__BAD(lg, "model: hidden size %llu (want 1..1048576)", (unsigned long long)m->hidden);
    if (m->heads == 0 || m->heads > m->hidden) MN__BAD(lg, "model: %llu attention heads for hidden size %llu", (unsigned long long)m->heads, (unsigned long long)m->hidden);
    if (m->kv_heads == 0) m->kv_heads = m->heads;
    if (m->kv_heads > m->heads || m->heads % m->kv_heads) MN__BAD(lg, "model: %llu key/value heads do not divide %llu heads", (unsigned long long)m->kv_heads, (unsigned long long)m->heads);
    if (m->head_dim == 0) {
        if (m->hidden % m->heads) MN__BAD(lg, "model: hidden size %llu is not a multiple of %llu heads", (unsigned long long)m->hidden, (unsigned long long)m->heads);
        m->head_dim = m->hidden / m->heads;
    }
    if (m->head_dim > 65536) MN__BAD(lg, "model: head dimension %llu (want 1..65536)", (unsigned long long)m->head_dim);
    if (m->ffn == 0) m->ffn = 4 * m->hidden;
    if (m->ffn > (1ull << 24)) MN__BAD(lg, "model: MLP width %llu (want up to 16777216)", (unsigned long long)m->ffn);
    if (m->vocab == 0 || m->vocab > (1ull << 26)) MN__BAD(lg, "model: vocabulary %llu (want 1..67108864)", (unsigned long long)m->vocab);
    if (m->arch == MN_ARCH_ENCODER_DECODER && m->encoder_layers == 0) m->encoder_layers = m->layers;
    if (m->encoder_layers > 10000) MN__BAD(lg, "model: encoder layers %llu (want up to 10000)", (unsigned long long)m->encoder_layers);
    if (m->posemb == MN_POS_DEFAULT) m->posemb = MN_POS_LEARNED;
    if (m->posemb == MN_POS_LEARNED && m->max_positions == 0) m->max_positions = 512;
    if (m->max_positions > (1ull << 24)) MN__BAD(lg, "model: %llu positions (want up to 16777216)", (unsigned long long)m->max_positions);
    if (m->type_vocab > (1ull << 20)) MN__BAD(lg, "model: %llu token types", (unsigned long long)m->type_vocab);
    if (m->rel_buckets == 0) m->rel_buckets = 32;
    if (m->num_labels == 0) m->num_labels = 2;
    if (m->num_labels > (1ull << 24)) MN__BAD(lg, "model: %llu labels", (unsigned long long)m->num_labels);
    if (m->norm == MN_NORM_DEFAULT) m->norm = MN_NORM_LAYERNORM;
    if (m->act == MN_ACT_DEFAULT) m->act = m->gated_mlp ? MN_ACT_SILU : MN_ACT_GELU;
    if (m->head == MN_HEAD_DEFAULT) m->head = MN_HEAD_LM;
    if (m->dtype == MN_DTYPE_DEFAULT) m->dtype = MN_FP32;
    if ((unsigned)m->norm >= MN_NORM_COUNT || (unsigned)m->act >= MN_ACT_COUNT || (unsigned)m->posemb >= MN_POS_COUNT ||
        (unsigned)m->head >= MN_HEAD_COUNT || (unsigned)m->dtype >= MN_DTYPE_COUNT)
        MN__BAD(lg, "model: an enum field is out of range");
    if (!(m->dropout >= 0.0f && m->dropout < 1.0f) || !(m->attn_dropout >= 0.0f && m->attn_dropout < 1.0f))
        MN__BAD(lg, "model: dropout probabilities must be in [0, 1)");
    if (m->arch == MN_ARCH_ENCODER) m->tie_embeddings = m->head == MN_HEAD_LM ? m->tie_embeddings : 0;
    if (!m->name[0]) snprintf(m->name, sizeof m->name, "custom %s", mn_arch_name(m->arch));
    return MN_OK;
}

static mn_result mn__resolve(const mn_model *model, const mn_setup *setup, mn__cfg *c, mn_gpu *gpu) {
    const mn_logger *lg = &setup->logger;
    mn_setup *s = &c->s;
    mn_model *m = &c->m;
    mn_result r;
    int mixed, pure;
    memset(c, 0, sizeof *c);
    *s = *setup;
    r = mn__resolve_model(model, lg, m);
    if (r != MN_OK) return r;
    if (s->batch == 0) s->batch = 1;
    if (s->batch > (1ull << 32)) MN__BAD(lg, "--batch %llu is absurd (want 1..4294967296)", (unsigned long long)s->batch);
    if (s->seq == 0) s->seq = m->arch == MN_ARCH_STACK ? 1 : (m->posemb == MN_POS_LEARNED && m->max_positions < 512 ? m->max_positions : 512);
    if (s->seq > (1ull << 26)) MN__BAD(lg, "--seq %llu is absurd (want 1..67108864)", (unsigned long long)s->seq);
    if (m->posemb == MN_POS_LEARNED && m->arch != MN_ARCH_STACK && s->seq > m->max_positions && !s->infer)
        MN__BAD(lg, "--seq %llu exceeds the model's %llu positions", (unsigned long long)s->seq, (unsigned long long)m->max_positions);
    if (s->accum == 0) s->accum = 1;
    if (s->accum > (1ull << 20)) MN__BAD(lg, "--accum %llu is absurd", (unsigned long long)s->accum);
    if (s->precision == MN_PREC_DEFAULT) s->precision = MN_PREC_FP32;
    if (s->optim == MN_OPTIM_DEFAULT) s->optim = s->infer ? MN_OPTIM_NONE : MN_OPTIM_ADAMW;
    if (s->checkpointing == MN_CKPT_DEFAULT) s->checkpointing = MN_CKPT_NONE;
    if (s->framework == MN_FW_DEFAULT) s->framework = MN_FW_HF;
    if (s->offload == MN_OFFLOAD_DEFAULT) s->offload = MN_OFFLOAD_NONE;
    if (s->quant == MN_QUANT_DEFAULT) s->quant = MN_QUANT_NONE;
    if ((unsigned)s->precision >= MN_PREC_COUNT || (unsigned)s->optim >= MN_OPTIM_COUNT ||
        (unsigned)s->checkpointing >= MN_CKPT_COUNT || (unsigned)s->attention >= MN_ATTN_COUNT ||
        (unsigned)s->framework >= MN_FW_COUNT || (unsigned)s->offload >= MN_OFFLOAD_COUNT ||
        (unsigned)s->quant >= MN_QUANT_COUNT || (unsigned)s->grads >= MN_GRADS_COUNT)
        MN__BAD(lg, "setup: an enum field is out of range");
    if (s->attention == MN_ATTN_DEFAULT)
        s->attention = s->framework == MN_FW_HF || s->framework == MN_FW_DEEPSPEED
                           ? (m->arch == MN_ARCH_ENCODER || m->arch == MN_ARCH_ENCODER_DECODER ? MN_ATTN_EAGER : MN_ATTN_SDPA)
                           : MN_ATTN_FLASH;
    if (s->torch_version == 0) s->torch_version = s->framework == MN_FW_HF ? 110 : 200;
    if (s->torch_version < 100 || s->torch_version > 999) MN__BAD(lg, "--torch %u.%u is not a torch version", s->torch_version / 100, s->torch_version % 100);
    // torch 2.0 made zero_grad(set_to_none=True) the default (torch.nn.Module.zero_grad docs)
    if (s->grads == MN_GRADS_DEFAULT) s->grads = s->torch_version < 200 ? MN_GRADS_KEEP : MN_GRADS_RELEASE;
    if (s->zero_stage > 3) MN__BAD(lg, "--zero %u (want 0..3)", s->zero_stage);
    if (s->gpus == 0) s->gpus = 1;
    if (s->gpus > (1u << 20)) MN__BAD(lg, "--gpus %u is absurd", s->gpus);
    if (s->lora_rank > 65536) MN__BAD(lg, "--lora-rank %u (want 1..65536)", s->lora_rank);
    if (s->lora_rank && s->lora_targets == 0) s->lora_targets = MN_LORA_Q | MN_LORA_V;
    if (s->quant > MN_QUANT_NONE && !s->lora_rank && !s->infer)
        MN__BAD(lg, "--quant %s freezes the base weights: add --lora-rank, or --infer", mn_quant_name(s->quant));
    if (s->offload == MN_OFFLOAD_ALL && s->zero_stage < 3) MN__BAD(lg, "--offload all needs --zero 3");
    if (s->beams == 0) s->beams = 1;
    if (s->beams > 4096) MN__BAD(lg, "--beams %u is absurd", s->beams);
    if (s->infer) {
        if (s->prompt == 0) s->prompt = s->seq;
        if (s->prompt > (1ull << 26) || s->new_tokens > (1ull << 26)) MN__BAD(lg, "--prompt/--new-tokens are absurd");
        s->seq = s->prompt, s->accum = 1, s->optim = MN_OPTIM_NONE, s->checkpointing = MN_CKPT_NONE;
    }
    if (!s->gpu) s->gpu = "a100-80gb";
    if (mn_gpu_find(s->gpu, gpu) != MN_OK) {
        mn__log(lg, MN_LOG_ERROR, "unknown GPU \"%s\" (see `memanat models`)", s->gpu);
        return MN_ERR_NOT_FOUND;
    }
    s->gpu = gpu->name;
    if (s->capacity == 0) s->capacity = gpu->capacity;
    if (s->context == 0) s->context = gpu->context;
    if (s->capacity > (1ull << 50)) MN__BAD(lg, "--capacity is absurd (over 1 PiB)");
    if (s->context > s->capacity) MN__BAD(lg, "--context is larger than the device capacity");

    c->b = s->batch * (s->infer ? s->beams : 1);
    c->seq = s->seq;
    c->ntok = c->b * c->seq;
    c->enc_seq = c->seq;
    if (c->ntok > (1ull << 36)) MN__BAD(lg, "batch x sequence = %llu tokens is absurd", (unsigned long long)c->ntok);
    c->d = m->head_dim, c->qd = m->heads * m->head_dim, c->kvd = m->kv_heads * m->head_dim, c->f = m->ffn;
    c->r = s->lora_rank;
    c->gpus = s->gpus, c->zero = s->zero_stage;
    c->attn = s->attention;
    mixed = s->precision == MN_PREC_FP16 || s->precision == MN_PREC_BF16;
    pure = s->precision == MN_PREC_FP16_PURE || s->precision == MN_PREC_BF16_PURE;
    c->a_esz = (mixed || pure) ? 2 : 4;
    c->w_esz = c->g_esz = 4;
    c->param_cat = MN_CAT_WEIGHTS;
    c->hf = s->framework == MN_FW_HF || s->framework == MN_FW_DEEPSPEED;
    c->grads_keep = s->grads == MN_GRADS_KEEP;
    switch (s->framework) {
    case MN_FW_DEFAULT:
    case MN_FW_HF:
        if (mixed) c->amp = 1, c->param_cat = MN_CAT_MASTER_WEIGHTS;
        if (pure) c->w_esz = c->g_esz = 2, c->state_half = 1;
        break;
    case MN_FW_DEEPSPEED:
        if (mixed || pure) c->w_esz = c->g_esz = 2, c->fw_master = 1;
        c->grads_prealloc = 1;
        break;
    case MN_FW_MEGATRON:
        if (mixed || pure) c->w_esz = 2, c->fw_master = 1;
        c->grads_prealloc = 1;
        break;
    case MN_FW_MEMANAT:
        if (mixed) c->w_esz = 2, c->fw_master = 2;
        if (pure) c->w_esz = c->g_esz = 2, c->state_half = 1;
        break;
    case MN_FW_COUNT: break;
    }
    if (s->infer) c->fw_master = 0, c->grads_prealloc = 0;  // autocast inference keeps fp32 + 16-bit
    c->n_esz = c->amp ? 4 : c->a_esz;
    c->kv_esz = c->a_esz;
    c->nblocks = (uint32_t)(m->arch == MN_ARCH_STACK ? m->stack_len : m->layers + m->encoder_layers);
    if (m->arch == MN_ARCH_ENCODER_DECODER) c->nblocks = (uint32_t)(m->layers + m->encoder_layers);
    else if (m->arch != MN_ARCH_STACK) c->nblocks = (uint32_t)m->layers;
    return MN_OK;
}

// ---- the estimate ------------------------------------------------------------------------------

static void mn__sim_free(mn__sim *S) {
    mn__free(S->al, S->t), mn__free(S->al, S->ops), mn__free(S->al, S->p);
    mn__free(S->al, S->ev), mn__free(S->al, S->bstart);
    memset(S, 0, sizeof *S);
}

// Counting pass: the parameter list, plus the exact count a caller gave (--params, safetensors)
// and adapters (--trainable-params).
static mn_result mn__build_params(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t counted = 0, i, want = c->m.params;
    uint32_t nb = c->nblocks + 1;
    S->bstart = (uint32_t *)mn__alloc_array(S->al, nb, sizeof *S->bstart);
    if (!S->bstart) return MN_ERR_OUT_OF_MEMORY;
    memset(S->bstart, 0, (size_t)nb * sizeof *S->bstart);
    S->counting = 1;
    S->cursor = 0;
    if (c->m.arch == MN_ARCH_STACK) mn__stack_forward(S, MN__NONE);
    else mn__forward(S, MN__NONE, MN__NONE);
    if (S->err) return S->err;
    for (i = 0; i < S->np; i++) counted += S->p[i].numel;
    S->block = 0;
    if (want > counted) {  // the rest as frozen-or-trainable matrices of the model's width
        uint64_t rest = want - counted, h = c->m.hidden ? c->m.hidden : 1024;
        if (rest / h) mn__w(S, rest / h, h, mn__base_trainable(c), 0, 0);
        if (rest % h) mn__w(S, rest % h, 0, mn__base_trainable(c), 0, 0);
    }
    if (c->s.trainable_params) {
        uint64_t total = 0, T = c->s.trainable_params, h = c->m.hidden ? c->m.hidden : 1024;
        for (i = 0; i < S->np; i++) total += S->p[i].numel;
        if (T > total) {
            mn__log(&c->s.logger, MN_LOG_ERROR, "--trainable-params %llu exceeds the model's %llu parameters",
                    (unsigned long long)T, (unsigned long long)total);
            return MN_ERR_INVALID_ARG;
        }
        if (T / h) mn__w(S, T / h, h, 1, 0, 0);
        if (T % h) mn__w(S, T % h, 0, 1, 0, 0);
    }
    S->counting = 0;
    return S->err;
}

// Model states per GPU, from the parameter list.
static void mn__states(mn__sim *S, mn_estimate_result *out) {
    mn__cfg *c = S->c;
    uint64_t i, g, st, mw, total = 0, trainable = 0;
    int off = c->s.offload > MN_OFFLOAD_NONE;
    for (i = 0; i < S->np; i++) {
        mn__param *P = &S->p[i];
        total += P->numel;
        if (c->amp) {  // fp32 storage of trained parameters is the master; autocast adds 16-bit casts
            if (P->trainable) out->master_weights += mn__weight_bytes(S, P);
            else out->weights += mn__weight_bytes(S, P);
            if (!P->quant) out->weights += mn__m(S, P->numel, 2) / (c->zero >= 3 ? c->gpus : 1);
        } else if (c->s.offload != MN_OFFLOAD_ALL) {
            out->weights += mn__weight_bytes(S, P);
        } else {
            out->cpu_bytes += mn__weight_bytes(S, P);
        }
        if (!P->trainable || c->s.infer) continue;
        trainable += P->numel;
        g = mn__m(S, P->numel, c->g_esz);
        if (c->zero >= 2) g = (g + c->gpus - 1) / c->gpus;
        if (c->s.framework == MN_FW_DEEPSPEED && c->fw_master && (c->zero == 1 || c->zero == 2))
            g += (mn__m(S, P->numel, 4) + c->gpus - 1) / c->gpus;  // fp32 gradient partition
        st = mn__state_bytes(S, P);
        mw = 0;
        if (c->fw_master) {
            mw = mn__m(S, P->numel, 4);
            if (c->zero >= 1) mw = (mw + c->gpus - 1) / c->gpus;
        }
        if (off) {
            out->cpu_bytes += g + st + mw;
            continue;
        }
        out->gradients += g;
        out->optimizer += st + (c->fw_master == 1 ? mw : 0);
        out->master_weights += c->fw_master == 2 ? mw : 0;
    }
    if (c->s.optim == MN_OPTIM_NONE) out->optimizer = 0;
    out->params = total;
    out->trainable_params = c->s.infer ? 0 : trainable;
    out->model_states = out->weights + out->master_weights + out->gradients + out->optimizer;
}

// Runs load + two training steps (or a generation), recording allocation events.
static void mn__run(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t step, mb, nmb = c->s.accum < 2 ? 1 : 2;
    mn__load(S);
    if (S->err) return;
    if (c->s.infer) {
        S->cursor = 0;
        mn__generate(S);
        return;
    }
    mn__alloc_t(S, MN__MIB(c->gpu_is_hopper ? 32 : 4), 1, MN_CAT_WORKSPACE);  // cuBLAS workspace
    for (step = 0; step < 2 && !S->err; step++) {
        for (mb = 0; mb < nmb && !S->err; mb++) {
            S->cursor = 0;
            mn__micro_batch(S);
        }
        if (!S->err) mn__optimizer(S);
    }
}

// Feeds recorded events to a caching allocator. An allocation that fails even after the OOM
// ladder is counted by the allocator (num_ooms) and its free is skipped.
static mn_result mn__replay_into(const mn_allocator *al, const mn_trace_event *ev, uint64_t n, uint64_t ntensors,
                                 mn_cache *cache) {
    void **ptr = (void **)mn__alloc_array(al, (size_t)ntensors + 1, sizeof *ptr);
    uint64_t i;
    mn_result r = MN_OK;
    if (!ptr) return MN_ERR_OUT_OF_MEMORY;
    memset(ptr, 0, ((size_t)ntensors + 1) * sizeof *ptr);
    for (i = 0; i < n && r == MN_OK; i++) {
        const mn_trace_event *e = &ev[i];
        if (e->id > ntensors) { r = MN_ERR_INVALID_ARG; break; }
        if (e->alloc) {
            ptr[e->id] = NULL;
            r = mn_cache_alloc(cache, e->size, 0, (mn_category)e->category, mn_phase_name((mn_phase)e->phase), &ptr[e->id]);
            if (r == MN_ERR_DEVICE_OOM) r = MN_OK;
        } else if (ptr[e->id]) {
            r = mn_cache_release(cache, ptr[e->id]);
            ptr[e->id] = NULL;
        }
    }
    mn__free(al, ptr);
    return r;
}

// Replays the events through the caching allocator on a simulated device. capacity 0 = unlimited.
static mn_result mn__replay(mn__sim *S, uint64_t capacity, mn_cache_statistics *st) {
    mn_simdev dev;
    mn_simdev_desc dd;
    mn_cache cache;
    mn_cache_desc cd;
    mn_result r;
    memset(&dd, 0, sizeof dd);
    dd.capacity = capacity;
    if (S->al) dd.allocator = *S->al;
    r = mn_simdev_init(&dev, &dd);
    if (r != MN_OK) return r;
    memset(&cd, 0, sizeof cd);
    cd.device = mn_simdev_device(&dev);
    cd.config = S->c->s.alloc_conf;
    cd.logger = S->c->s.logger;
    if (S->al) cd.allocator = *S->al;
    r = mn_cache_init(&cache, &cd);
    if (r != MN_OK) { mn_simdev_free(&dev); return r; }
    r = mn__replay_into(S->al, S->ev, S->nev, S->nt, &cache);
    if (r == MN_OK) r = mn_cache_stats(&cache, st);
    mn_cache_free(&cache);
    mn_simdev_free(&dev);
    return r;
}

static mn_result mn__estimate(const mn_model *model, const mn_setup *setup, const mn_allocator *al,
                              mn_estimate_result *out, mn__sim *S, int keep_events) {
    mn__cfg c;
    mn_gpu gpu;
    mn_result r;
    int k;
    if (!model || !setup || !out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(S, 0, sizeof *S);
    r = mn__resolve(model, setup, &c, &gpu);
    if (r != MN_OK) return r;
    c.gpu_is_hopper = strncmp(gpu.name, "h1", 2) == 0 || strncmp(gpu.name, "h2", 2) == 0;
    S->al = al, S->c = &c;
    r = mn__build_params(S);
    if (r == MN_OK) {
        mn__states(S, out);
        r = S->err;
    }
    if (r == MN_OK) {
        S->events = keep_events || !c.s.no_replay;
        mn__run(S);
        r = S->err;
    }
    if (r == MN_ERR_OVERFLOW) mn__log(&c.s.logger, MN_LOG_ERROR, "the model or setup is too large: a size overflows 64 bits");
    if (r != MN_OK) return r;
    out->peak_allocated = S->peak;
    out->peak_phase = S->peak_phase;
    for (k = 0; k < MN_CAT_COUNT; k++) out->at_peak[k] = S->at_peak[k], out->cat_peak[k] = S->cat_peak[k];
    out->activations = S->at_peak[MN_CAT_ACTIVATIONS];
    out->temporary = S->at_peak[MN_CAT_TEMPORARY];
    out->workspace = S->at_peak[MN_CAT_WORKSPACE];
    out->kv_cache = S->at_peak[MN_CAT_KV_CACHE];
    out->alloc_events = S->nev / 2;
    out->peak_reserved = S->peak;
    out->context = c.s.context, out->capacity = c.s.capacity;
    if (!c.s.no_replay) {
        mn_cache_statistics st;
        uint64_t limit = c.s.capacity - c.s.context;
        r = mn__replay(S, 0, &st);
        if (r != MN_OK) return r;
        out->peak_allocated = st.allocated_bytes[MN_STAT_ALL].peak;
        out->peak_reserved = st.reserved_bytes[MN_STAT_ALL].peak;
        if (out->peak_reserved > limit && out->peak_allocated <= limit) {
            // PyTorch frees cached blocks and retries before it gives up: replay at the real size
            r = mn__replay(S, limit, &st);
            if (r != MN_OK) return r;
            if (st.num_ooms == 0) out->peak_reserved = st.reserved_bytes[MN_STAT_ALL].peak;
        }
    }
    out->device_used = out->context + out->peak_reserved;
    out->fits = out->device_used <= out->capacity;
    out->setup = c.s;
    out->model = c.m;
    out->gpu = gpu;
    out->setup.logger.log_fn = NULL, out->setup.logger.user_data = NULL;
    return MN_OK;
}

MNIMPL mn_result mn_estimate(const mn_model *model, const mn_setup *setup, mn_estimate_result *out) {
    mn__sim S;
    mn_result r = mn__estimate(model, setup, NULL, out, &S, 0);
    mn__sim_free(&S);
    return r;
}

MNIMPL mn_result mn_estimate_trace(const mn_model *model, const mn_setup *setup, const mn_allocator *allocator,
                                   mn_trace_event **events, uint64_t *count) {
    mn__sim S;
    mn_estimate_result res;
    mn_setup s2;
    mn_result r;
    if (!events || !count || !setup) return MN_ERR_INVALID_ARG;
    *events = NULL, *count = 0;
    s2 = *setup;
    s2.no_replay = 1;
    r = mn__estimate(model, &s2, allocator, &res, &S, 1);
    if (r == MN_OK) {
        *events = S.ev, *count = S.nev;
        S.ev = NULL;
    }
    mn__sim_free(&S);
    return r;
}

MNIMPL void mn_trace_free(const mn_allocator *allocator, mn_trace_event *events) { mn__free(allocator, events); }

MNIMPL mn_result mn_estimate_replay(const mn_model *model, const mn_setup *setup, const mn_allocator *allocator,
                                    mn_cache *cache) {
    mn__sim S;
    mn_estimate_result res;
    mn_setup s2;
    mn_result r;
    if (!setup || !cache) return MN_ERR_INVALID_ARG;
    s2 = *setup;
    s2.no_replay = 1;
    r = mn__estimate(model, &s2, allocator, &res, &S, 1);
    if (r == MN_OK) r = mn__replay_into(allocator, S.ev, S.nev, S.nt, cache);
    mn__sim_free(&S);
    return r;
}

MNIMPL mn_result mn_model_params(const mn_model *model, uint64_t *out) {
    mn__sim S;
    mn__cfg c;
    mn_setup s;
    mn_gpu gpu;
    mn_result r;
    uint64_t i, n = 0;
    if (!model || !out) return MN_ERR_INVALID_ARG;
    memset(&s, 0, sizeof s);
    r = mn__resolve(model, &s, &c, &gpu);
    if (r != MN_OK) return r;
    memset(&S, 0, sizeof S);
    S.c = &c;
    r = mn__build_params(&S);
    for (i = 0; r == MN_OK && i < S.np; i++) n += S.p[i].numel;
    mn__sim_free(&S);
    if (r == MN_OK) *out = n;
    return r;
}

// ---- fit: the largest micro-batch, the longest sequence, and a plan ---------------------------

// The step alone (no allocator replay): microseconds. Its device_used counts peak allocated.
static mn_result mn__quick(const mn_model *m, const mn_setup *s, mn_fit_result *out, mn_estimate_result *r) {
    mn_setup q = *s;
    q.no_replay = 1;
    out->estimates_run++;
    return mn_estimate(m, &q, r);
}

// Fits the device? The replay never lowers the peak below what is allocated, so a setup whose
// allocated peak does not fit is rejected without replaying it.
static int mn__fits(const mn_model *m, const mn_setup *s, mn_fit_result *out, mn_estimate_result *r, mn_result *err) {
    mn_result e = mn__quick(m, s, out, r);
    if (e == MN_OK && r->fits && !s->no_replay) {
        e = mn_estimate(m, s, r);
        out->estimates_run++;
    }
    if (e != MN_OK) { *err = e; return 0; }
    return r->fits;
}

// Largest value in [1, cap] for which fits(value) holds, 0 if none: doubling, then bisection
// (memory grows with batch and sequence, so fitting is monotonic in both). quick: judge by the
// step alone (peak allocated), else with the allocator replay.
static uint64_t mn__bisect(const mn_model *m, mn_setup *s, uint64_t *field, uint64_t lo, uint64_t hi, int quick,
                           mn_fit_result *out, mn_result *err) {
    mn_estimate_result r;
    while (hi - lo > 1 && *err == MN_OK) {  // fits(lo) (or lo == 0), !fits(hi)
        uint64_t mid = lo + (hi - lo) / 2;
        int ok;
        *field = mid;
        ok = quick ? (mn__quick(m, s, out, &r) == MN_OK && r.fits) : mn__fits(m, s, out, &r, err);
        if (ok) lo = mid;
        else hi = mid;
    }
    return lo;
}

static uint64_t mn__search(const mn_model *m, mn_setup *s, uint64_t *field, uint64_t cap, mn_fit_result *out,
                           mn_result *err) {
    mn_estimate_result r;
    uint64_t hi = 1, lo = 0, bound, step;
    // 1. the bound from the step alone (reserved >= allocated, so nothing above it fits)
    for (;;) {
        *field = hi;
        if ((*err = mn__quick(m, s, out, &r)) != MN_OK) return 0;
        if (!r.fits) break;
        lo = hi;
        if (hi >= cap) break;
        hi = hi * 2 > cap ? cap : hi * 2;
    }
    bound = lo == cap ? cap : mn__bisect(m, s, field, lo, hi, 1, out, err);
    if (bound == 0 || *err != MN_OK) return 0;
    // 2. with the allocator: gallop down from the bound, then bisect
    *field = bound;
    if (mn__fits(m, s, out, &r, err)) return bound;
    hi = bound, step = 1;
    for (;;) {
        uint64_t cand = bound > step ? bound - step : 0;
        if (cand == 0 || *err != MN_OK) return 0;
        *field = cand;
        if (mn__fits(m, s, out, &r, err)) return mn__bisect(m, s, field, cand, hi, 0, out, err);
        hi = cand, step *= 2;
    }
}

// The techniques of the plan, cheapest in step time first. Step-time factors from the HF
// bert-large series on a V100 (fp16 0.47x, 8-bit Adam 0.97x, Adafactor 1.11x, batch 4 -> 1 x 4
// accumulation 1.14x, + checkpointing 1.29x), Korthikanti et al. 2022 (selective recompute
// 1.03x), and typical LoRA / QLoRA / ZeRO-offload slowdowns.
typedef enum mn__tech {
    MN__T_SDPA, MN__T_MIXED, MN__T_ADAM8, MN__T_HALVE, MN__T_SELECTIVE, MN__T_FULL, MN__T_ADAFACTOR,
    MN__T_LORA, MN__T_NF4, MN__T_OFFLOAD, MN__T_COUNT
} mn__tech;

static const struct { double factor; const char *note; } mn__techs[MN__T_COUNT] = {
    {0.85, "fused attention keeps no s x s scores"},
    {0.50, "16-bit activations, fp32 master weights kept"},
    {0.97, "Adam states 8 -> 2 bytes per parameter"},
    {1.07, "same effective batch, half the activations"},
    {1.03, "recompute the attention scores in backward"},
    {1.29, "keep block inputs only, recompute each block in backward"},
    {1.11, "factored second moment, no first moment"},
    {0.80, "train adapters only: no gradients or optimizer state for the base"},
    {1.30, "4-bit base weights (QLoRA)"},
    {2.00, "parameters, gradients and optimizer state in host memory"},
};

// Applies technique k to s if it applies; 0 when it does not.
static int mn__tech_apply(mn__tech k, mn_setup *s, int bf16) {
    switch (k) {
    case MN__T_SDPA: if (s->attention != MN_ATTN_EAGER) return 0; s->attention = MN_ATTN_SDPA; return 1;
    case MN__T_MIXED:
        if (s->precision != MN_PREC_FP32 || s->infer) return 0;
        s->precision = bf16 ? MN_PREC_BF16 : MN_PREC_FP16;
        return 1;
    case MN__T_ADAM8: if (s->optim != MN_OPTIM_ADAMW || s->infer) return 0; s->optim = MN_OPTIM_ADAMW_8BIT; return 1;
    case MN__T_HALVE: if (s->batch < 2 || s->infer) return 0; s->batch = (s->batch + 1) / 2, s->accum *= 2; return 1;
    case MN__T_SELECTIVE:
        if (s->checkpointing != MN_CKPT_NONE || s->attention != MN_ATTN_EAGER || s->infer) return 0;
        s->checkpointing = MN_CKPT_SELECTIVE;
        return 1;
    case MN__T_FULL: if (s->checkpointing == MN_CKPT_FULL || s->infer) return 0; s->checkpointing = MN_CKPT_FULL; return 1;
    case MN__T_ADAFACTOR:
        if (s->optim == MN_OPTIM_ADAFACTOR || s->optim == MN_OPTIM_SGD || s->optim == MN_OPTIM_NONE || s->lora_rank || s->infer) return 0;
        s->optim = MN_OPTIM_ADAFACTOR;
        return 1;
    case MN__T_LORA:
        if (s->lora_rank || s->infer) return 0;
        s->lora_rank = 16, s->lora_targets = MN_LORA_ALL;
        return 1;
    case MN__T_NF4: if (s->quant > MN_QUANT_NONE || (!s->lora_rank && !s->infer)) return 0; s->quant = MN_QUANT_NF4; return 1;
    case MN__T_OFFLOAD:
        if (s->zero_stage >= 3 || s->infer) return 0;
        s->framework = MN_FW_DEEPSPEED, s->zero_stage = 3, s->offload = MN_OFFLOAD_ALL;
        return 1;
    case MN__T_COUNT: break;
    }
    return 0;
}

static void mn__tech_describe(mn__tech k, const mn_setup *s, char *buf, size_t cap) {
    switch (k) {
    case MN__T_SDPA: snprintf(buf, cap, "--attention sdpa"); break;
    case MN__T_MIXED: snprintf(buf, cap, "--precision %s", mn_precision_name(s->precision)); break;
    case MN__T_ADAM8: snprintf(buf, cap, "--optim adamw-8bit"); break;
    case MN__T_HALVE:
        snprintf(buf, cap, "--batch %llu --accum %llu", (unsigned long long)s->batch, (unsigned long long)s->accum);
        break;
    case MN__T_SELECTIVE: snprintf(buf, cap, "--checkpointing selective"); break;
    case MN__T_FULL: snprintf(buf, cap, "--checkpointing full"); break;
    case MN__T_ADAFACTOR: snprintf(buf, cap, "--optim adafactor"); break;
    case MN__T_LORA: snprintf(buf, cap, "--lora-rank 16 --lora-targets all"); break;
    case MN__T_NF4: snprintf(buf, cap, "--quant nf4"); break;
    case MN__T_OFFLOAD: snprintf(buf, cap, "--framework deepspeed --zero 3 --offload all"); break;
    case MN__T_COUNT: buf[0] = 0; break;
    }
}

// The setup after applying steps[0..n) to base, skipping index `skip`.
static mn_setup mn__plan_setup(const mn_setup *base, const uint8_t *steps, uint32_t n, uint32_t skip, int bf16) {
    mn_setup s = *base;
    uint32_t i;
    for (i = 0; i < n; i++)
        if (i != skip) mn__tech_apply((mn__tech)steps[i], &s, bf16);
    return s;
}

MNIMPL mn_result mn_fit(const mn_model *model, const mn_setup *setup, mn_fit_result *out) {
    mn_estimate_result cur, next;
    mn_setup base, s, t;
    mn_result err = MN_OK;
    uint64_t cap_seq;
    uint8_t steps[32];
    uint32_t n = 0, i, k;
    int bf16, progress = 1;
    if (!model || !setup || !out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    out->plan_slowdown = 1.0;
    err = mn_estimate(model, setup, &cur);
    if (err != MN_OK) return err;
    out->estimates_run = 1;
    base = cur.setup;
    base.logger = setup->logger;
    bf16 = cur.gpu.bf16;
    t = base;
    out->max_batch = mn__search(model, &t, &t.batch, 1ull << 20, out, &err);
    if (err != MN_OK) return err;
    t = base;
    cap_seq = cur.model.posemb == MN_POS_LEARNED && cur.model.arch != MN_ARCH_STACK ? cur.model.max_positions : (1ull << 22);
    if (base.infer) out->max_seq = mn__search(model, &t, &t.prompt, cap_seq, out, &err);
    else out->max_seq = mn__search(model, &t, &t.seq, cap_seq, out, &err);
    if (err != MN_OK) return err;

    // Greedy: add the cheapest technique that lowers the memory need until the setup fits
    // (compared on the step alone, confirmed with the allocator replay).
    s = base;
    if (!cur.fits) {
        mn_estimate_result q, qn;
        if ((err = mn__quick(model, &s, out, &q)) != MN_OK) return err;
        while (!cur.fits && progress && n < sizeof steps) {
            progress = 0;
            for (k = 0; k < MN__T_COUNT && !progress; k++) {
                t = s;
                if (!mn__tech_apply((mn__tech)k, &t, bf16)) continue;
                if ((err = mn__quick(model, &t, out, &qn)) != MN_OK) return err;
                if (qn.peak_allocated >= q.peak_allocated) continue;  // no help here
                steps[n++] = (uint8_t)k, s = t, q = qn, progress = 1;
                mn__fits(model, &s, out, &cur, &err);
                if (err != MN_OK) return err;
            }
        }
    }
    // Prune: drop each step, the slowest first, whose removal still fits.
    for (k = MN__T_COUNT; cur.fits && k-- > 0;) {
        for (i = n; i-- > 0;) {
            if (steps[i] != k) continue;
            t = mn__plan_setup(&base, steps, n, i, bf16);
            if (!mn__fits(model, &t, out, &next, &err)) {
                if (err != MN_OK) return err;
                continue;
            }
            memmove(&steps[i], &steps[i + 1], (n - i - 1) * sizeof steps[0]);
            n--, s = t, cur = next;
        }
    }
    // Report the kept steps with the peak each one saves (the step alone: what is allocated).
    t = base;
    if ((err = mn__quick(model, &t, out, &next)) != MN_OK) return err;
    for (i = 0; i < n && out->plan_len < sizeof out->plan / sizeof out->plan[0]; i++) {
        mn_estimate_result after;
        mn_plan_step *p = &out->plan[out->plan_len++];
        char a[32], b[32];
        mn__tech_apply((mn__tech)steps[i], &t, bf16);
        if ((err = mn__quick(model, &t, out, &after)) != MN_OK) return err;
        mn__tech_describe((mn__tech)steps[i], &t, p->what, sizeof p->what);
        mn_size_format(next.peak_allocated, a, sizeof a);
        mn_size_format(after.peak_allocated, b, sizeof b);
        snprintf(p->why, sizeof p->why, "%s: peak %s -> %s, step time x%.2f", mn__techs[steps[i]].note, a, b,
                 mn__techs[steps[i]].factor);
        out->plan_slowdown *= mn__techs[steps[i]].factor;
        next = after;
    }
    out->plan_found = cur.fits;
    out->plan_setup = s;
    out->plan_setup.logger.log_fn = NULL, out->plan_setup.logger.user_data = NULL;
    out->plan_estimate = cur;
    return MN_OK;
}
