// >>hfconfig implementation ----------------------------------------------------------------------
//
// One reader per family. Each reads its keys through mn__hf_int/_bool/_prob/_str, which take the
// transformers default for an absent (or null) key and reject a mistyped or out-of-range value
// with a message naming the key. The defaults are those of transformers'
// models/<type>/configuration_<type>.py (v4.4x); the structural facts (biases, norms, heads) are
// those of the matching modeling_<type>.py.

#define MN__HF_REQUIRED UINT64_MAX
#define MN__HF_MAX_CONFIG (64ull << 20)

typedef struct mn__hf {
    const mn_json_value *root;
    const mn_logger *lg;
    const char *type;  // model_type
} mn__hf;

MN__PRIVATE mn_result mn__hf_fail(mn__hf *c, mn_result r, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    mn__log(c->lg, MN_LOG_ERROR, "config.json: %s", msg);
    return r;
}

// First of the '|'-separated keys present with a non-null value; *used gets its name (or the
// first name when none is present).
MN__PRIVATE const mn_json_value *mn__hf_find(mn__hf *c, const char *keys, char *used, size_t cap) {
    const char *k = keys;
    used[0] = 0;
    while (*k) {
        const char *e = strchr(k, '|');
        size_t n = e ? (size_t)(e - k) : strlen(k);
        char name[64];
        const mn_json_value *v;
        if (n >= sizeof name) n = sizeof name - 1;
        memcpy(name, k, n);
        name[n] = 0;
        if (!used[0]) snprintf(used, cap, "%s", name);
        v = mn_json_get(c->root, name);
        if (v && v->type != MN_JSON_NULL) {
            snprintf(used, cap, "%s", name);
            return v;
        }
        k += n;
        if (*k == '|') k++;
    }
    return NULL;
}

MN__PRIVATE mn_result mn__hf_int(mn__hf *c, const char *keys, uint64_t def, uint64_t lo,
                                 uint64_t hi, uint64_t *out) {
    char key[64];
    const mn_json_value *v = mn__hf_find(c, keys, key, sizeof key);
    uint64_t x;
    mn_result r;
    if (!v) {
        if (def == MN__HF_REQUIRED)
            return mn__hf_fail(c, MN_ERR_INVALID_ARG, "%s: missing key \"%s\"", c->type, key);
        *out = def;
        return MN_OK;
    }
    if (v->type != MN_JSON_NUMBER)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" must be an integer, not a %s", key,
                           mn_json_type_name(v->type));
    r = mn_json_u64(v, &x);
    if (r == MN_ERR_OVERFLOW || (r == MN_OK && (x < lo || x > hi)))
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" = %.40s is out of range [%llu, %llu]",
                           key, v->str, (unsigned long long)lo, (unsigned long long)hi);
    if (r != MN_OK)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" = %.40s is not a non-negative integer",
                           key, v->str);
    *out = x;
    return MN_OK;
}

MN__PRIVATE mn_result mn__hf_bool(mn__hf *c, const char *keys, int def, int *out) {
    char key[64];
    const mn_json_value *v = mn__hf_find(c, keys, key, sizeof key);
    if (!v) {
        *out = def;
        return MN_OK;
    }
    if (v->type != MN_JSON_TRUE && v->type != MN_JSON_FALSE)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" must be true or false, not a %s", key,
                           mn_json_type_name(v->type));
    *out = v->type == MN_JSON_TRUE;
    return MN_OK;
}

// A probability in [0, 1).
MN__PRIVATE mn_result mn__hf_prob(mn__hf *c, const char *keys, double def, float *out) {
    char key[64];
    const mn_json_value *v = mn__hf_find(c, keys, key, sizeof key);
    if (!v) {
        *out = (float)def;
        return MN_OK;
    }
    if (v->type != MN_JSON_NUMBER)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" must be a number, not a %s", key,
                           mn_json_type_name(v->type));
    if (!(v->num >= 0.0 && v->num < 1.0))
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" = %.40s is not a probability in [0, 1)",
                           key, v->str);
    *out = (float)v->num;
    return MN_OK;
}

// A string, or NULL when absent or null.
MN__PRIVATE mn_result mn__hf_str(mn__hf *c, const char *keys, const char **out) {
    char key[64];
    const mn_json_value *v = mn__hf_find(c, keys, key, sizeof key);
    *out = NULL;
    if (!v) return MN_OK;
    if (v->type != MN_JSON_STRING)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" must be a string, not a %s", key,
                           mn_json_type_name(v->type));
    *out = v->str;
    return MN_OK;
}

// transformers' ACT2FN names (activations.py) -> mn_act.
MN__PRIVATE mn_result mn__hf_act(mn__hf *c, const char *keys, const char *def, mn_act *out) {
    static const struct { const char *name; mn_act act; } acts[] = {
        {"gelu", MN_ACT_GELU}, {"gelu_python", MN_ACT_GELU}, {"gelu_new", MN_ACT_GELU_NEW},
        {"gelu_pytorch_tanh", MN_ACT_GELU_TANH}, {"gelu_fast", MN_ACT_GELU_TANH},
        {"gelu_accurate", MN_ACT_GELU_TANH}, {"relu", MN_ACT_RELU}, {"silu", MN_ACT_SILU},
        {"swish", MN_ACT_SILU}};
    const char *s;
    size_t k;
    char key[64];
    if (mn__hf_str(c, keys, &s) != MN_OK) return MN_ERR_INVALID_ARG;
    if (!s) s = def;
    for (k = 0; k < sizeof acts / sizeof acts[0]; k++) {
        if (strcmp(s, acts[k].name) == 0) {
            *out = acts[k].act;
            return MN_OK;
        }
    }
    mn__hf_find(c, keys, key, sizeof key);
    return mn__hf_fail(c, MN_ERR_UNSUPPORTED, "\"%s\" = \"%.40s\" is not a supported activation",
                       key, s);
}

// Shape limits: anything beyond these is a broken or hostile file, not a model.
#define MN__HF_MAX_LAYERS 10000ull
#define MN__HF_MAX_HIDDEN 1000000ull
#define MN__HF_MAX_HEADS 100000ull
#define MN__HF_MAX_FFN 100000000ull
#define MN__HF_MAX_VOCAB 100000000ull
#define MN__HF_MAX_POS 1000000000ull

// heads must divide hidden when the head size is derived from them; kv_heads must divide heads.
MN__PRIVATE mn_result mn__hf_heads(mn__hf *c, mn_model *m, const char *heads_key,
                                   const char *kv_key, int head_dim_given) {
    if (!head_dim_given && m->hidden % m->heads != 0)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"%s\" = %llu does not divide the width %llu",
                           heads_key, (unsigned long long)m->heads, (unsigned long long)m->hidden);
    if (m->kv_heads > m->heads || m->heads % m->kv_heads != 0)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG,
                           "\"%s\" = %llu does not divide the %llu attention heads", kv_key,
                           (unsigned long long)m->kv_heads, (unsigned long long)m->heads);
    return MN_OK;
}

#define MN__HF_TRY(expr) \
    do { \
        mn_result mn__r_ = (expr); \
        if (mn__r_ != MN_OK) return mn__r_; \
    } while (0)

// BERT (configuration_bert.py), RoBERTa / XLM-R (configuration_roberta.py: BERT's defaults),
// DistilBERT (configuration_distilbert.py). Post-norm encoder: embeddings (word, position,
// token type) + LayerNorm, blocks with biased q/k/v/o and MLP, no final norm.
MN__PRIVATE mn_result mn__hf_bert(mn__hf *c, mn_model *m, int distil) {
    m->arch = MN_ARCH_ENCODER;
    m->norm = MN_NORM_LAYERNORM;
    m->posemb = MN_POS_LEARNED;
    m->qkv_bias = m->out_bias = m->mlp_bias = 1;
    m->embed_norm = 1;
    m->final_norm = 0;
    m->post_norm = 1;
    if (distil) {
        MN__HF_TRY(mn__hf_int(c, "n_layers", 6, 1, MN__HF_MAX_LAYERS, &m->layers));
        MN__HF_TRY(mn__hf_int(c, "dim", 768, 1, MN__HF_MAX_HIDDEN, &m->hidden));
        MN__HF_TRY(mn__hf_int(c, "n_heads", 12, 1, MN__HF_MAX_HEADS, &m->heads));
        MN__HF_TRY(mn__hf_int(c, "hidden_dim", 3072, 1, MN__HF_MAX_FFN, &m->ffn));
        MN__HF_TRY(mn__hf_act(c, "activation", "gelu", &m->act));
        MN__HF_TRY(mn__hf_prob(c, "dropout", 0.1, &m->dropout));
        MN__HF_TRY(mn__hf_prob(c, "attention_dropout", 0.1, &m->attn_dropout));
        m->type_vocab = 0;
        m->kv_heads = m->heads;
        MN__HF_TRY(mn__hf_heads(c, m, "n_heads", "n_heads", 0));
    } else {
        MN__HF_TRY(mn__hf_int(c, "num_hidden_layers", 12, 1, MN__HF_MAX_LAYERS, &m->layers));
        MN__HF_TRY(mn__hf_int(c, "hidden_size", 768, 1, MN__HF_MAX_HIDDEN, &m->hidden));
        MN__HF_TRY(mn__hf_int(c, "num_attention_heads", 12, 1, MN__HF_MAX_HEADS, &m->heads));
        MN__HF_TRY(mn__hf_int(c, "intermediate_size", 3072, 1, MN__HF_MAX_FFN, &m->ffn));
        MN__HF_TRY(mn__hf_int(c, "type_vocab_size", 2, 0, 1000000, &m->type_vocab));
        MN__HF_TRY(mn__hf_act(c, "hidden_act", "gelu", &m->act));
        MN__HF_TRY(mn__hf_prob(c, "hidden_dropout_prob", 0.1, &m->dropout));
        MN__HF_TRY(mn__hf_prob(c, "attention_probs_dropout_prob", 0.1, &m->attn_dropout));
        m->kv_heads = m->heads;
        MN__HF_TRY(mn__hf_heads(c, m, "num_attention_heads", "num_attention_heads", 0));
    }
    MN__HF_TRY(mn__hf_int(c, "vocab_size", 30522, 1, MN__HF_MAX_VOCAB, &m->vocab));
    MN__HF_TRY(mn__hf_int(c, "max_position_embeddings", 512, 1, MN__HF_MAX_POS,
                          &m->max_positions));
    MN__HF_TRY(mn__hf_bool(c, distil ? "tie_weights_|tie_word_embeddings" : "tie_word_embeddings",
                           1, &m->tie_embeddings));
    return MN_OK;
}

// GPT-2 (configuration_gpt2.py) and GPTBigCode / StarCoder (configuration_gpt_bigcode.py, which
// adds multi_query = true: one key/value head). Pre-norm decoder with biases everywhere, learned
// positions, final LayerNorm, LM head tied to the embedding.
MN__PRIVATE mn_result mn__hf_gpt2(mn__hf *c, mn_model *m, int bigcode) {
    int mq = 0;
    m->arch = MN_ARCH_DECODER;
    m->norm = MN_NORM_LAYERNORM;
    m->posemb = MN_POS_LEARNED;
    m->qkv_bias = m->out_bias = m->mlp_bias = 1;
    m->final_norm = 1;
    MN__HF_TRY(mn__hf_int(c, "n_layer|num_hidden_layers", 12, 1, MN__HF_MAX_LAYERS, &m->layers));
    MN__HF_TRY(mn__hf_int(c, "n_embd|hidden_size", 768, 1, MN__HF_MAX_HIDDEN, &m->hidden));
    MN__HF_TRY(mn__hf_int(c, "n_head|num_attention_heads", 12, 1, MN__HF_MAX_HEADS, &m->heads));
    MN__HF_TRY(mn__hf_int(c, "n_inner", 0, 1, MN__HF_MAX_FFN, &m->ffn));  // null: 4 * hidden
    MN__HF_TRY(mn__hf_int(c, "vocab_size", 50257, 1, MN__HF_MAX_VOCAB, &m->vocab));
    MN__HF_TRY(mn__hf_int(c, "n_positions|max_position_embeddings", 1024, 1, MN__HF_MAX_POS,
                          &m->max_positions));
    MN__HF_TRY(mn__hf_act(c, "activation_function", bigcode ? "gelu_pytorch_tanh" : "gelu_new",
                          &m->act));
    MN__HF_TRY(mn__hf_prob(c, "resid_pdrop", 0.1, &m->dropout));
    MN__HF_TRY(mn__hf_prob(c, "attn_pdrop", 0.1, &m->attn_dropout));
    MN__HF_TRY(mn__hf_bool(c, "tie_word_embeddings", 1, &m->tie_embeddings));
    if (bigcode) MN__HF_TRY(mn__hf_bool(c, "multi_query", 1, &mq));
    m->kv_heads = mq ? 1 : m->heads;
    return mn__hf_heads(c, m, "n_head", "multi_query", 0);
}

// The Llama family: pre-norm decoders with RMSNorm, rotary positions, a gated MLP and a final
// norm; they differ in defaults and biases. Starcoder2 keeps LayerNorm, a plain biased MLP.
typedef struct mn__hf_llama_defaults {
    const char *type;
    uint64_t vocab, hidden, ffn, layers, heads, kv_heads;  // kv_heads 0: = heads
    uint64_t head_dim;                                     // 0: hidden / heads
    uint64_t max_pos;
    const char *act;
    int tie;
    int qkv_bias;    // -1: "attention_bias" (q, k, v and o), default false
    int layernorm;   // LayerNorm with a non-gated MLP (Starcoder2)
} mn__hf_llama_defaults;

static const mn__hf_llama_defaults mn__hf_llamas[] = {
    // configuration_llama.py
    {"llama", 32000, 4096, 11008, 32, 32, 0, 0, 2048, "silu", 0, -1, 0},
    // configuration_mistral.py
    {"mistral", 32000, 4096, 14336, 32, 32, 8, 0, 4096 * 32, "silu", 0, 0, 0},
    // configuration_qwen2.py: q, k, v biased, o not (modeling_qwen2.py)
    {"qwen2", 151936, 4096, 22016, 32, 32, 32, 0, 32768, "silu", 0, 1, 0},
    // configuration_qwen3.py: head_dim 128, attention_bias
    {"qwen3", 151936, 4096, 22016, 32, 32, 32, 128, 32768, "silu", 0, -1, 0},
    // configuration_gemma.py: head_dim 256, hidden_activation gelu_pytorch_tanh, tied
    {"gemma", 256000, 3072, 24576, 28, 16, 16, 256, 8192, "gelu_pytorch_tanh", 1, -1, 0},
    // configuration_gemma2.py
    {"gemma2", 256000, 2304, 9216, 26, 8, 4, 256, 8192, "gelu_pytorch_tanh", 1, -1, 0},
    // configuration_phi3.py
    {"phi3", 32064, 3072, 8192, 32, 32, 0, 0, 4096, "silu", 0, 0, 0},
    // configuration_starcoder2.py: use_bias true, LayerNorm, c_fc/c_proj MLP
    {"starcoder2", 49152, 3072, 12288, 30, 24, 2, 0, 4096, "gelu_pytorch_tanh", 1, 0, 1},
};

MN__PRIVATE mn_result mn__hf_llama(mn__hf *c, mn_model *m, const mn__hf_llama_defaults *f) {
    uint64_t experts = 0;
    int bias = 0, given_head_dim;
    const int gemma = strncmp(f->type, "gemma", 5) == 0;
    MN__HF_TRY(mn__hf_int(c, "num_local_experts|num_experts|n_routed_experts", 0, 0, 1u << 20,
                          &experts));
    if (experts > 1)
        return mn__hf_fail(c, MN_ERR_UNSUPPORTED, "%s with %llu experts: MoE not supported",
                           f->type, (unsigned long long)experts);
    m->arch = MN_ARCH_DECODER;
    m->norm = f->layernorm ? MN_NORM_LAYERNORM : MN_NORM_RMSNORM;
    m->posemb = MN_POS_ROPE;
    m->gated_mlp = !f->layernorm;
    m->final_norm = 1;
    MN__HF_TRY(mn__hf_int(c, "num_hidden_layers", f->layers, 1, MN__HF_MAX_LAYERS, &m->layers));
    MN__HF_TRY(mn__hf_int(c, "hidden_size", f->hidden, 1, MN__HF_MAX_HIDDEN, &m->hidden));
    MN__HF_TRY(mn__hf_int(c, "num_attention_heads", f->heads, 1, MN__HF_MAX_HEADS, &m->heads));
    MN__HF_TRY(mn__hf_int(c, "num_key_value_heads", f->kv_heads ? f->kv_heads : m->heads, 1,
                          MN__HF_MAX_HEADS, &m->kv_heads));
    // head_dim: given, or the family's fixed default, or derived from hidden / heads
    given_head_dim = mn_json_get(c->root, "head_dim") != NULL &&
                     mn_json_get(c->root, "head_dim")->type != MN_JSON_NULL;
    MN__HF_TRY(mn__hf_int(c, "head_dim", f->head_dim, 1, 65536, &m->head_dim));
    given_head_dim = given_head_dim || f->head_dim != 0;
    MN__HF_TRY(mn__hf_int(c, "intermediate_size", f->ffn, 1, MN__HF_MAX_FFN, &m->ffn));
    MN__HF_TRY(mn__hf_int(c, "vocab_size", f->vocab, 1, MN__HF_MAX_VOCAB, &m->vocab));
    MN__HF_TRY(mn__hf_int(c, "max_position_embeddings", f->max_pos, 1, MN__HF_MAX_POS,
                          &m->max_positions));
    MN__HF_TRY(mn__hf_act(c, gemma ? "hidden_activation" : "hidden_act", f->act,
                          &m->act));
    MN__HF_TRY(mn__hf_bool(c, "tie_word_embeddings", f->tie, &m->tie_embeddings));
    MN__HF_TRY(mn__hf_prob(c, "attention_dropout", 0.0, &m->attn_dropout));
    if (f->layernorm) {
        MN__HF_TRY(mn__hf_bool(c, "use_bias", 1, &bias));
        m->qkv_bias = m->out_bias = m->mlp_bias = bias;
        MN__HF_TRY(mn__hf_prob(c, "residual_dropout", 0.0, &m->dropout));
    } else if (f->qkv_bias < 0) {
        MN__HF_TRY(mn__hf_bool(c, "attention_bias", 0, &bias));
        m->qkv_bias = m->out_bias = bias;
        MN__HF_TRY(mn__hf_bool(c, "mlp_bias", 0, &m->mlp_bias));
    } else {
        m->qkv_bias = f->qkv_bias;
    }
    if (strcmp(f->type, "phi3") == 0) MN__HF_TRY(mn__hf_prob(c, "resid_pdrop", 0.0, &m->dropout));
    return mn__hf_heads(c, m, "num_attention_heads", "num_key_value_heads", given_head_dim);
}

// T5 (configuration_t5.py) and mT5 (configuration_mt5.py): encoder-decoder, T5LayerNorm (RMS,
// no bias), relative attention bias in the first block of each stack, no biases anywhere, a final
// norm per stack, head width d_kv independent of d_model.
MN__PRIVATE mn_result mn__hf_t5(mn__hf *c, mn_model *m, int mt5, int encoder_only) {
    const char *proj, *dash;
    char act[32];
    size_t n;
    mn_act a = MN_ACT_DEFAULT;
    m->arch = encoder_only ? MN_ARCH_ENCODER : MN_ARCH_ENCODER_DECODER;
    m->norm = MN_NORM_RMSNORM;
    m->posemb = MN_POS_RELATIVE;
    m->final_norm = 1;
    MN__HF_TRY(mn__hf_int(c, "vocab_size", mt5 ? 250112 : 32128, 1, MN__HF_MAX_VOCAB, &m->vocab));
    MN__HF_TRY(mn__hf_int(c, "d_model", 512, 1, MN__HF_MAX_HIDDEN, &m->hidden));
    MN__HF_TRY(mn__hf_int(c, "d_kv", 64, 1, 65536, &m->head_dim));
    MN__HF_TRY(mn__hf_int(c, "d_ff", mt5 ? 1024 : 2048, 1, MN__HF_MAX_FFN, &m->ffn));
    MN__HF_TRY(mn__hf_int(c, "num_layers", mt5 ? 8 : 6, 1, MN__HF_MAX_LAYERS, &m->encoder_layers));
    MN__HF_TRY(mn__hf_int(c, "num_decoder_layers", m->encoder_layers, 1, MN__HF_MAX_LAYERS,
                          &m->layers));
    if (encoder_only) m->layers = m->encoder_layers, m->encoder_layers = 0;
    MN__HF_TRY(mn__hf_int(c, "num_heads", mt5 ? 6 : 8, 1, MN__HF_MAX_HEADS, &m->heads));
    m->kv_heads = m->heads;
    MN__HF_TRY(mn__hf_int(c, "relative_attention_num_buckets", 32, 1, 1000000, &m->rel_buckets));
    MN__HF_TRY(mn__hf_prob(c, "dropout_rate", 0.1, &m->dropout));
    m->attn_dropout = m->dropout;
    MN__HF_TRY(mn__hf_bool(c, "tie_word_embeddings", mt5 ? 0 : 1, &m->tie_embeddings));
    MN__HF_TRY(mn__hf_str(c, "feed_forward_proj", &proj));
    if (!proj) proj = mt5 ? "gated-gelu" : "relu";
    // "ACT" or "gated-ACT"; "gated-gelu" means gelu_new (T5Config.__init__)
    dash = strchr(proj, '-');
    if (dash && (dash - proj != 5 || strncmp(proj, "gated", 5) != 0 || strchr(dash + 1, '-')))
        return mn__hf_fail(c, MN_ERR_INVALID_ARG,
                           "\"feed_forward_proj\" = \"%.40s\" is not ACT or gated-ACT", proj);
    m->gated_mlp = dash != NULL;
    n = strlen(dash ? dash + 1 : proj);
    if (n >= sizeof act) n = sizeof act - 1;
    memcpy(act, dash ? dash + 1 : proj, n);
    act[n] = 0;
    if (strcmp(proj, "gated-gelu") == 0) {  // transformers maps gated-gelu to "gelu_new"
        a = MN_ACT_GELU_NEW;
    } else {
        static const struct { const char *name; mn_act act; } acts[] = {
            {"relu", MN_ACT_RELU}, {"gelu", MN_ACT_GELU}, {"gelu_new", MN_ACT_GELU_NEW},
            {"silu", MN_ACT_SILU}, {"swish", MN_ACT_SILU}};
        size_t k;
        for (k = 0; k < sizeof acts / sizeof acts[0]; k++)
            if (strcmp(act, acts[k].name) == 0) a = acts[k].act;
        if (a == MN_ACT_DEFAULT)
            return mn__hf_fail(c, MN_ERR_UNSUPPORTED,
                               "\"feed_forward_proj\" = \"%.40s\": unsupported activation", proj);
    }
    m->act = a;
    return MN_OK;
}

// Mixture-of-experts model types: their expert MLPs are outside mn_model.
static const char *const mn__hf_moe_types[] = {
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "olmoe",
    "granitemoe", "phimoe", "switch_transformers", "nllb_moe", "gpt_oss", "llama4"};

MN__PRIVATE int mn__ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

// The head from architectures[0] (the class the checkpoint was saved from).
MN__PRIVATE mn_result mn__hf_head(mn__hf *c, mn_model *m, const char **arch_out) {
    const mn_json_value *a = mn_json_get(c->root, "architectures");
    const char *arch;
    *arch_out = "";
    m->head = MN_HEAD_LM;
    if (!a || a->type == MN_JSON_NULL) return MN_OK;
    if (a->type != MN_JSON_ARRAY || (a->len > 0 && a->items[0].type != MN_JSON_STRING))
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "\"architectures\" must be an array of strings");
    if (a->len == 0) return MN_OK;
    arch = *arch_out = a->items[0].str;
    if (mn__ends_with(arch, "ForSequenceClassification")) {
        m->head = MN_HEAD_CLASSIFICATION;
    } else if (mn__ends_with(arch, "ForTokenClassification") ||
               mn__ends_with(arch, "ForQuestionAnswering")) {
        m->head = MN_HEAD_CLASSIFICATION;
        mn__log(c->lg, MN_LOG_WARN, "config.json: %s: per-token head read as a classification head",
                arch);
    } else if (mn__ends_with(arch, "ForCausalLM") || mn__ends_with(arch, "LMHeadModel") ||
               mn__ends_with(arch, "ForConditionalGeneration") ||
               mn__ends_with(arch, "ForMaskedLM") || mn__ends_with(arch, "ForPreTraining") ||
               mn__ends_with(arch, "WithLMHead") || mn__ends_with(arch, "DoubleHeadsModel")) {
        m->head = MN_HEAD_LM;
    } else if (mn__ends_with(arch, "Model")) {
        m->head = MN_HEAD_NONE;
    } else {
        mn__log(c->lg, MN_LOG_WARN, "config.json: architecture %s: head read as an LM head", arch);
    }
    if (m->head == MN_HEAD_CLASSIFICATION) {
        const mn_json_value *labels = mn_json_get(c->root, "id2label");
        if (labels && labels->type == MN_JSON_OBJECT && labels->len > 0) {
            m->num_labels = labels->len;
        } else {
            MN__HF_TRY(mn__hf_int(c, "num_labels", 2, 1, 10000000, &m->num_labels));
        }
    }
    return MN_OK;
}

MN__PRIVATE mn_result mn__hf_dtype(mn__hf *c, mn_model *m) {
    static const struct { const char *name; mn_dtype t; } types[] = {
        {"float32", MN_FP32}, {"float", MN_FP32}, {"float16", MN_FP16}, {"half", MN_FP16},
        {"bfloat16", MN_BF16}, {"int8", MN_INT8}, {"uint8", MN_INT8}};
    const char *s;
    char key[64];
    size_t k;
    MN__HF_TRY(mn__hf_str(c, "torch_dtype|dtype", &s));
    m->dtype = MN_DTYPE_DEFAULT;
    if (!s || strcmp(s, "auto") == 0) return MN_OK;
    if (strncmp(s, "torch.", 6) == 0) s += 6;
    for (k = 0; k < sizeof types / sizeof types[0]; k++) {
        if (strcmp(s, types[k].name) == 0) {
            m->dtype = types[k].t;
            return MN_OK;
        }
    }
    mn__hf_find(c, "torch_dtype|dtype", key, sizeof key);
    return mn__hf_fail(c, MN_ERR_UNSUPPORTED, "\"%s\" = \"%.40s\" is not a supported dtype", key,
                       s);
}

// Copies a UTF-8 name, cut at a character boundary when it does not fit.
MN__PRIVATE void mn__hf_copy_name(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) {
        n = cap - 1;
        while (n > 0 && ((unsigned char)src[n] & 0xc0) == 0x80) n--;  // not inside a sequence
    }
    memcpy(dst, src, n);
    dst[n] = 0;
}

// name: "_name_or_path", else the caller's fallback (a file or folder name), else model_type.
MN__PRIVATE mn_result mn__hf_map(mn__hf *c, mn_model *m, const char *fallback) {
    const char *type, *name, *arch;
    size_t k;
    mn_result r = MN_ERR_UNSUPPORTED;
    if (c->root->type != MN_JSON_OBJECT)
        return mn__hf_fail(c, MN_ERR_INVALID_ARG, "not a JSON object");
    c->type = "config";
    MN__HF_TRY(mn__hf_str(c, "model_type", &type));
    if (!type) return mn__hf_fail(c, MN_ERR_INVALID_ARG, "missing key \"model_type\"");
    c->type = type;
    for (k = 0; k < sizeof mn__hf_moe_types / sizeof mn__hf_moe_types[0]; k++) {
        if (strcmp(type, mn__hf_moe_types[k]) == 0)
            return mn__hf_fail(c, MN_ERR_UNSUPPORTED,
                               "model_type \"%s\" is a mixture of experts: MoE not supported",
                               type);
    }
    MN__HF_TRY(mn__hf_head(c, m, &arch));
    if (strcmp(type, "bert") == 0 || strcmp(type, "roberta") == 0 ||
        strcmp(type, "xlm-roberta") == 0) {
        r = mn__hf_bert(c, m, 0);
        m->pooler = m->head == MN_HEAD_CLASSIFICATION || m->head == MN_HEAD_NONE;
        m->lm_transform = m->head == MN_HEAD_LM;  // BertForMaskedLM: dense + act + LayerNorm + bias
    } else if (strcmp(type, "distilbert") == 0) {
        r = mn__hf_bert(c, m, 1);
        m->pooler = m->head == MN_HEAD_CLASSIFICATION;  // pre_classifier: a pooler-sized dense
        m->lm_transform = m->head == MN_HEAD_LM;        // vocab_transform + vocab_layer_norm
    } else if (strcmp(type, "gpt2") == 0 || strcmp(type, "gpt_bigcode") == 0) {
        r = mn__hf_gpt2(c, m, type[3] == '_');
    } else if (strcmp(type, "t5") == 0 || strcmp(type, "mt5") == 0) {
        r = mn__hf_t5(c, m, type[0] == 'm', mn__ends_with(arch, "EncoderModel"));
    } else {
        for (k = 0; k < sizeof mn__hf_llamas / sizeof mn__hf_llamas[0]; k++) {
            if (strcmp(type, mn__hf_llamas[k].type) == 0) break;
        }
        if (k == sizeof mn__hf_llamas / sizeof mn__hf_llamas[0])
            return mn__hf_fail(c, MN_ERR_UNSUPPORTED,
                               "model_type \"%.40s\" is not supported (bert, roberta, distilbert, "
                               "gpt2, gpt_bigcode, llama, mistral, qwen2, qwen3, gemma, gemma2, "
                               "phi3, starcoder2, t5, mt5)", type);
        r = mn__hf_llama(c, m, &mn__hf_llamas[k]);
    }
    if (r != MN_OK) return r;
    MN__HF_TRY(mn__hf_dtype(c, m));
    MN__HF_TRY(mn__hf_str(c, "_name_or_path", &name));
    mn__hf_copy_name(m->name, sizeof m->name,
                     name && name[0] ? name : fallback && fallback[0] ? fallback : type);
    return MN_OK;
}

// The model's name from a path: "a/llama-2-7b.json" -> "llama-2-7b", "a/llama/config.json" and
// "a/llama/" -> "llama". Writes "" when there is none.
MN__PRIVATE void mn__hf_path_name(const char *path, char *out, size_t cap) {
    const char *end = path + strlen(path), *start;
    size_t n;
    int k;
    out[0] = 0;
    for (k = 0; k < 2; k++) {
        while (end > path && (end[-1] == '/' || end[-1] == '\\')) end--;
        start = end;
        while (start > path && start[-1] != '/' && start[-1] != '\\') start--;
        n = (size_t)(end - start);
        if (n >= 5 && memcmp(end - 5, ".json", 5) == 0) n -= 5;
        if (n == 6 && memcmp(start, "config", 6) == 0) {  // take the folder's name
            end = start;
            continue;
        }
        if (n == 0 || (n <= 2 && memcmp(start, "..", n) == 0)) return;  // "", ".", ".."
        if (n >= cap) n = cap - 1;
        memcpy(out, start, n);
        out[n] = 0;
        return;
    }
}

// *quantized (optional) is set when the config has a "quantization_config" (packed weights).
MN__PRIVATE mn_result mn__hf_parse(const char *text, size_t len, const mn_hf_desc *desc,
                                   const char *fallback, mn_model *out, int *quantized) {
    mn_hf_desc d;
    mn_json_desc jd;
    mn_json_doc doc;
    mn__hf c;
    mn_model m;
    mn_result r;
    if (!out || (!text && len)) return MN_ERR_INVALID_ARG;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    memset(&jd, 0, sizeof jd);
    jd.allocator = d.allocator;
    jd.max_bytes = MN__HF_MAX_CONFIG;
    memset(&c, 0, sizeof c);
    c.lg = &d.logger;
    c.type = "config";
    r = mn_json_parse(text, len, &jd, &doc);
    if (r != MN_OK) {
        mn__hf_fail(&c, r, "%s", doc.error[0] ? doc.error : mn_result_str(r));
        mn_json_free(&doc);
        return r;
    }
    c.root = doc.root;
    memset(&m, 0, sizeof m);
    r = mn__hf_map(&c, &m, fallback);
    if (r == MN_OK) *out = m;
    if (quantized) *quantized = mn_json_get(doc.root, "quantization_config") != NULL;
    mn_json_free(&doc);
    return r;
}

MNIMPL mn_result mn_hf_config_parse(const char *text, size_t len, const mn_hf_desc *desc,
                                    mn_model *out) {
    return mn__hf_parse(text, len, desc, NULL, out, NULL);
}

MNIMPL mn_result mn_hf_config_read(const char *path, const mn_hf_desc *desc, mn_model *out) {
    mn_hf_desc d;
    char *text = NULL, *cfg, name[64];
    size_t len, n;
    int folder = 0, quantized = 0;
    mn_result r;
    mn_model m;
    if (!path || !out) return MN_ERR_INVALID_ARG;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    n = strlen(path);
    // a folder holds config.json; anything else is read as the config file itself
    if (!(n >= 5 && strcmp(path + n - 5, ".json") == 0)) {
        cfg = mn__path_join(&d.allocator, path, "config.json");
        if (!cfg) return MN_ERR_OUT_OF_MEMORY;
        r = mn__read_file(&d.allocator, cfg, MN__HF_MAX_CONFIG, &text, &len);
        mn__free(&d.allocator, cfg);
        if (r == MN_OK) folder = 1;
        else if (r == MN_ERR_OUT_OF_MEMORY) return r;
    }
    if (!folder) {
        r = mn__read_file(&d.allocator, path, MN__HF_MAX_CONFIG, &text, &len);
        if (r != MN_OK) {
            mn__log(&d.logger, MN_LOG_ERROR, "%s: %s", path,
                    r == MN_ERR_NOT_FOUND ? "no such file or folder with a config.json"
                                          : "cannot read the file");
            return r;
        }
    }
    mn__hf_path_name(path, name, sizeof name);
    r = mn__hf_parse(text, len, &d, name, &m, &quantized);
    if (r == MN_OK && folder && !d.no_safetensors) {
        mn_safetensors_desc sd;
        mn_safetensors_info info;
        mn_result rs;
        memset(&sd, 0, sizeof sd);
        sd.allocator = d.allocator;
        sd.logger = d.logger;
        rs = mn_safetensors_read_dir(path, &sd, &info);
        if (rs == MN_OK && info.params > 0) {
            if (quantized) {
                mn__log(&d.logger, MN_LOG_WARN,
                        "%s: quantized checkpoint: parameter count taken from the shape", path);
            } else {
                m.params = info.params;
                if (info.dtype != MN_DTYPE_DEFAULT) m.dtype = info.dtype;
            }
        } else if (rs != MN_OK && rs != MN_ERR_NOT_FOUND) {
            r = rs;
        }
        mn_safetensors_free(&info);
    }
    mn__free(&d.allocator, text);
    if (r == MN_OK) *out = m;
    return r;
}
