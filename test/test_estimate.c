// Tests of the estimator through the public API: exact parameter counts, the seeds' worked
// numbers, properties (monotonic, checkpointing, accumulation, ZeRO, fit), bad input, failures.
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "../memanat.h"

#define MiB (1024.0 * 1024.0)

static mn_model preset(const char *name) {
    mn_model m;
    memset(&m, 0, sizeof m);
    CHECK_OK(mn_preset_find(name, &m));
    return m;
}

static mn_setup setup0(void) {
    mn_setup s;
    memset(&s, 0, sizeof s);
    return s;
}

// Published parameter counts (the models' own reports / model cards).
static void test_param_counts(void) {
    static const struct { const char *name; uint64_t want; } t[] = {
        {"bert-base-uncased", 109514298ull},   // BertForMaskedLM
        {"gpt2", 124439808ull},
        {"gpt2-xl", 1557611200ull},
        {"t5-base", 222903552ull},
        {"t5-3b", 2851598336ull},             // DeepSpeed docs: "t5-3b (2851M)"
        {"llama-2-7b", 6738415616ull},
        {"llama-3-8b", 8030261248ull},
        {"mistral-7b", 7241732096ull},
        {"qwen2-0.5b", 494032768ull},
        {"llama-3.2-1b", 1235814400ull},
    };
    size_t i;
    uint64_t n;
    mn_model m;
    for (i = 0; i < sizeof t / sizeof t[0]; i++) {
        m = preset(t[i].name);
        CHECK_OK(mn_model_params(&m, &n));
        CHECK_MSG(n == t[i].want, "%s: %llu parameters, want %llu", t[i].name, (unsigned long long)n,
                  (unsigned long long)t[i].want);
    }
    // bert-large with the 2-label classification head of the HF series: 335,143,938
    m = preset("bert-large-uncased");
    m.head = MN_HEAD_CLASSIFICATION, m.pooler = 1, m.lm_transform = 0;
    CHECK_OK(mn_model_params(&m, &n));
    CHECK_EQ_U64(n, 335143938ull);
}

// Preset rows against the published config.json files. gpt2: n_layer 12, n_embd 768, n_head 12,
// vocab_size 50257, n_positions 1024, a tied LM head; Meta-Llama-3-8B: num_key_value_heads 8,
// intermediate_size 14336, vocab_size 128256, torch_dtype bfloat16. The presets whose config.json
// is in the test data have the shape mn_hf_config_read makes of it (both resolved by mn_estimate).
// Not compared: the activation (starcoder's config says "gelu", its preset the tanh GELU) and the
// dtype (flan-t5-base's config says float32, its preset bf16); neither changes an estimate.
static void test_preset_fields(void) {
    static const struct { const char *name, *config; } cfg[] = {
        {"gpt2-xl", "../shared/validation/configs/gpt2-xl.json"},
        {"bert-large-uncased", "../shared/validation/configs/bert-large-uncased.json"},
        {"t5-base", "test/data/hf/t5-base.json"},
        {"flan-t5-base", "test/data/hf/flan-t5-base.json"},
        {"llama-2-7b", "test/data/hf/llama-2-7b.json"},
        {"llama-3-8b", "test/data/hf/llama-3-8b.json"},
        {"mistral-7b", "test/data/hf/mistral-7b.json"},
        {"qwen2-0.5b", "test/data/hf/qwen2-0.5b.json"},
        {"starcoder", "test/data/hf/starcoder.json"},
    };
    mn_model m = preset("gpt2");
    size_t k;
    CHECK_EQ_U64(m.layers, 12);
    CHECK_EQ_U64(m.hidden, 768);
    CHECK_EQ_U64(m.heads, 12);
    CHECK_EQ_U64(m.vocab, 50257);
    CHECK_EQ_U64(m.max_positions, 1024);
    CHECK(m.tie_embeddings);
    m = preset("llama-3-8b");
    CHECK_EQ_U64(m.layers, 32);
    CHECK_EQ_U64(m.hidden, 4096);
    CHECK_EQ_U64(m.heads, 32);
    CHECK_EQ_U64(m.kv_heads, 8);
    CHECK_EQ_U64(m.ffn, 14336);
    CHECK_EQ_U64(m.vocab, 128256);
    CHECK_EQ_INT(m.dtype, MN_BF16);
    CHECK(!m.tie_embeddings);
    for (k = 0; k < sizeof cfg / sizeof cfg[0]; k++) {
        mn_model p = preset(cfg[k].name), h;
        mn_hf_desc d;
        mn_setup s = setup0();
        mn_estimate_result a, b;
        memset(&d, 0, sizeof d);
        CHECK_OK(mn_hf_config_read(cfg[k].config, &d, &h));
        s.seq = 8, s.no_replay = 1;
        CHECK_OK(mn_estimate(&p, &s, &a));
        CHECK_OK(mn_estimate(&h, &s, &b));
#define SAME(f) CHECK_MSG(a.model.f == b.model.f, "%s: " #f " is %llu, config.json %llu",       \
                          cfg[k].name, (unsigned long long)a.model.f, (unsigned long long)b.model.f)
        SAME(arch); SAME(layers); SAME(encoder_layers); SAME(hidden); SAME(heads); SAME(kv_heads);
        SAME(head_dim); SAME(ffn); SAME(vocab); SAME(type_vocab); SAME(rel_buckets); SAME(norm);
        SAME(posemb); SAME(head); SAME(gated_mlp); SAME(tie_embeddings); SAME(qkv_bias);
        SAME(out_bias); SAME(mlp_bias); SAME(pooler); SAME(final_norm); SAME(embed_norm);
        SAME(lm_transform); SAME(post_norm); SAME(dropout); SAME(attn_dropout);
        if (a.model.posemb == MN_POS_LEARNED) SAME(max_positions);
#undef SAME
        CHECK_EQ_U64(a.params, b.params);
    }
}

// Bytes per parameter of the model states (seeds: 18 for mixed AdamW, 6 for mixed inference,
// 16 = 2 + 2 + 12 for ZeRO's mixed Adam, 16 for fp32 AdamW).
static void test_bytes_per_param(void) {
    mn_model m = preset("llama-2-7b");
    mn_setup s = setup0();
    mn_estimate_result r;
    s.no_replay = 1, s.seq = 128;
    s.precision = MN_PREC_FP16;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.model_states, 18 * r.params);
    CHECK_EQ_U64(r.weights, 2 * r.params);
    CHECK_EQ_U64(r.master_weights, 4 * r.params);
    CHECK_EQ_U64(r.gradients, 4 * r.params);
    CHECK_EQ_U64(r.optimizer, 8 * r.params);
    s.infer = 1;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.model_states, 6 * r.params);
    s.infer = 0, s.framework = MN_FW_DEEPSPEED;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.model_states, 16 * r.params);
    CHECK_EQ_U64(r.optimizer, 12 * r.params);
    s.framework = MN_FW_HF, s.precision = MN_PREC_FP32;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.model_states, 16 * r.params);
    s.precision = MN_PREC_BF16_PURE;  // torch keeps Adam state in the parameter dtype
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.model_states, 8 * r.params);
    s.precision = MN_PREC_BF16, s.framework = MN_FW_MEGATRON;  // 2 + 4 + 12
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.model_states, 18 * r.params);
}

// Seeds: AdamW on a 3B model needs 24 GB of state, 8-bit states 2 bytes per parameter (6 GB);
// the PEFT example: 7B full fine-tune 12 x 7 = 84 GB of optimizer state, 0.2B adapters 2.4 GB.
static void test_seed_optimizer_figures(void) {
    mn_model m;
    mn_setup s = setup0();
    mn_estimate_result r;
    memset(&m, 0, sizeof m);
    m.params = 3000000000ull;
    s.no_replay = 1;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.params, 3000000000ull);
    CHECK_EQ_U64(r.optimizer, 24000000000ull);
    s.optim = MN_OPTIM_ADAMW_8BIT;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_NEAR(r.optimizer, 6e9, 0, 0.02);  // 2 bytes + one fp32 absmax per 256-element block
    CHECK(r.optimizer > 6000000000ull);
    m.params = 7000000000ull;
    s.optim = MN_OPTIM_ADAMW, s.precision = MN_PREC_FP16, s.framework = MN_FW_DEEPSPEED;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.optimizer, 84000000000ull);
    s.trainable_params = 200000000ull;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.optimizer, 2400000000ull);
    CHECK_EQ_U64(r.trainable_params, 200000000ull);
    // Adafactor on t5-3b's real shapes: factored second moments are a tiny fraction of a byte
    m = preset("t5-3b");
    s = setup0();
    s.no_replay = 1, s.optim = MN_OPTIM_ADAFACTOR, s.seq = 64;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK(r.optimizer > 0 && r.optimizer < r.params / 20);
}

// ZeRO paper figure 1: 7.5B parameters on 64 GPUs: 120 GB, 31.4 GB, 16.6 GB (DeepSpeed's code keeps
// fp32 gradient partitions in stage 2: 2 + 18/N), 1.9 GB.
static void test_zero_stages(void) {
    mn_model m;
    mn_setup s = setup0();
    mn_estimate_result r;
    double want[4] = {120e9, 4 * 7.5e9 + 16 * 7.5e9 / 64, 2 * 7.5e9 + 18 * 7.5e9 / 64, 16 * 7.5e9 / 64};
    uint32_t z;
    uint64_t prev = UINT64_MAX;
    memset(&m, 0, sizeof m);
    m.params = 7500000000ull;
    s.no_replay = 1, s.precision = MN_PREC_FP16, s.framework = MN_FW_DEEPSPEED, s.gpus = 64, s.seq = 128;
    for (z = 0; z <= 3; z++) {
        s.zero_stage = z;
        CHECK_OK(mn_estimate(&m, &s, &r));
        CHECK_NEAR(r.model_states, want[z], 0, 1e-3);
        CHECK(r.model_states <= prev);
        prev = r.model_states;
    }
}

// Seed 004: one fp16 Linear(1024, 1024, bias=False) applied repeatedly to a 10240 x 1024 input.
// Weights 2 MiB, input 20 MiB, Adam state 4 MiB (fp16 exp_avg + exp_avg_sq); each application
// keeps its input for backward and the caller holds the output: 20 MiB per application. The
// printed run (40 MiB of outputs, 44 MiB after backward) is what two applications give.
static void live_at_backward(const mn_model *m, const mn_setup *s, uint64_t *cat_live) {
    mn_trace_event *ev = NULL;
    uint64_t n = 0, i;
    memset(cat_live, 0, sizeof(uint64_t) * MN_CAT_COUNT);
    CHECK_OK(mn_estimate_trace(m, s, NULL, &ev, &n));
    for (i = 0; i < n && ev[i].phase != MN_PHASE_BACKWARD; i++) {
        if (ev[i].alloc) cat_live[ev[i].category] += ev[i].size;
        else cat_live[ev[i].category] -= ev[i].size;
    }
    CHECK(i < n);
    mn_trace_free(NULL, ev);
}

static void test_seed_linear_stack(void) {
    mn_layer layers[10];
    mn_model m;
    mn_setup s = setup0();
    mn_estimate_result r;
    uint64_t live[MN_CAT_COUNT];
    uint32_t i, apps;
    memset(layers, 0, sizeof layers);
    for (i = 0; i < 10; i++) {
        layers[i].kind = MN_LAYER_LINEAR, layers[i].in = 1024, layers[i].out = 1024;
        layers[i].shared_with = i ? 1 : 0;
    }
    memset(&m, 0, sizeof m);
    m.arch = MN_ARCH_STACK, m.stack = layers;
    s.batch = 10240, s.seq = 1, s.precision = MN_PREC_FP16_PURE, s.no_replay = 1;
    for (apps = 2; apps <= 10; apps += 8) {
        m.stack_len = apps;
        CHECK_OK(mn_estimate(&m, &s, &r));
        CHECK_EQ_U64(r.params, 1048576);
        CHECK_EQ_U64(r.weights, 2 * 1048576);
        CHECK_EQ_U64(r.optimizer, 4 * 1048576);
        CHECK_EQ_U64(r.gradients, 2 * 1048576);
        live_at_backward(&m, &s, live);
        CHECK_EQ_U64(live[MN_CAT_WEIGHTS], 2 * 1048576);
        // input (20 MiB) + one 20 MiB tensor per application + the fp32 loss scalar (the seed's
        // 62.00048828125 MB is that 4-byte loss after the allocator's 512-byte rounding)
        CHECK_EQ_U64(live[MN_CAT_ACTIVATIONS], 20ull * 1048576 * (1 + apps) + 4);
    }
    s.infer = 1;  // a stack has no generation: refused, not divided by a zero width
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_UNSUPPORTED);
}

// KV cache per token = 2 (K, V) x layers x kv_heads x head_dim x bytes (Llama-3-8B bf16: 128 KiB).
static void test_kv_cache(void) {
    mn_model m = preset("llama-3-8b");
    mn_setup s = setup0();
    mn_estimate_result r;
    s.infer = 1, s.precision = MN_PREC_BF16_PURE, s.prompt = 1000, s.new_tokens = 24, s.batch = 3, s.beams = 2;
    s.no_replay = 1;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.kv_cache, 2ull * 32 * 8 * 128 * 2 * 1024 * 6);
    CHECK_EQ_U64(r.weights, 2 * r.params);
    CHECK_EQ_U64(r.gradients + r.optimizer, 0);
    CHECK(r.peak_allocated >= r.weights + r.kv_cache);
}

static mn_model random_model(void) {
    static const char *names[] = {"gpt2", "bert-base-uncased", "llama-3.2-1b", "qwen2-0.5b", "t5-small",
                                  "starcoderbase-1b", "flan-t5-base"};
    mn_model m = preset(names[mnt_rand_u64() % (sizeof names / sizeof names[0])]);
    m.layers = 1 + mnt_rand_u64() % 3;
    if (m.encoder_layers) m.encoder_layers = 1 + mnt_rand_u64() % 2;
    return m;
}

static mn_setup random_setup(void) {
    mn_setup s = setup0();
    s.batch = 1 + mnt_rand_u64() % 3;
    s.seq = 16 + mnt_rand_u64() % 100;
    s.precision = (mn_precision)(1 + mnt_rand_u64() % 5);
    s.optim = (mn_optim)(1 + mnt_rand_u64() % 6);
    s.attention = (mn_attn)(1 + mnt_rand_u64() % 3);
    // hf, deepspeed, megatron: memanat models trainer.c's GPT only (test_trainer.c tests it)
    s.framework = (mn_framework)(1 + mnt_rand_u64() % 3);
    if (mnt_rand_u64() % 3 == 0) s.lora_rank = 8, s.lora_targets = (uint32_t)(1 + mnt_rand_u64() % 127);
    return s;
}

// What a step needs (the bytes it requests) never decreases with batch or sequence; checkpointing
// never adds activation bytes; accumulation at micro-batch b (gradients kept between micro-batches)
// never needs more than the batch b x k in one go. These are checked on the requested bytes:
// what the caching allocator hands out and reserves can dip by its rounding and split decisions,
// as PyTorch's max_memory_allocated does, so the replayed numbers are only checked to cover the need.
static void test_properties(void) {
    int it;
    for (it = 0; it < 40; it++) {
        mn_model m = random_model();
        mn_setup s = random_setup(), t;
        mn_estimate_result a, b, c;
        s.no_replay = 1;
        // a random target set can name only projections this architecture lacks (refused)
        if (s.lora_rank && mn_estimate(&m, &s, &a) == MN_ERR_INVALID_ARG)
            s.lora_targets = MN_LORA_ALL;
        CHECK_OK(mn_estimate(&m, &s, &a));
        t = s, t.batch++;
        CHECK_OK(mn_estimate(&m, &t, &b));
        CHECK_MSG(b.peak_allocated >= a.peak_allocated, "%s: batch %llu -> %llu lowered the need %llu -> %llu",
                  m.name, (unsigned long long)s.batch, (unsigned long long)t.batch,
                  (unsigned long long)a.peak_allocated, (unsigned long long)b.peak_allocated);
        t = s, t.seq += 1 + mnt_rand_u64() % 50;
        CHECK_OK(mn_estimate(&m, &t, &b));
        CHECK_MSG(b.peak_allocated >= a.peak_allocated, "%s: longer sequence lowered the need", m.name);
        t = s, t.checkpointing = MN_CKPT_FULL;
        CHECK_OK(mn_estimate(&m, &t, &b));
        t.checkpointing = MN_CKPT_SELECTIVE;
        CHECK_OK(mn_estimate(&m, &t, &c));
        CHECK_MSG(b.cat_peak[MN_CAT_ACTIVATIONS] <= a.cat_peak[MN_CAT_ACTIVATIONS] &&
                  c.cat_peak[MN_CAT_ACTIVATIONS] <= a.cat_peak[MN_CAT_ACTIVATIONS],
                  "%s: checkpointing raised activations (full %llu, selective %llu > none %llu) L %llu E %llu b %llu s %llu prec %d optim %d attn %d fw %d lora %u/%u", m.name,
                  (unsigned long long)b.cat_peak[MN_CAT_ACTIVATIONS], (unsigned long long)c.cat_peak[MN_CAT_ACTIVATIONS],
                  (unsigned long long)a.cat_peak[MN_CAT_ACTIVATIONS], (unsigned long long)m.layers, (unsigned long long)m.encoder_layers,
                  (unsigned long long)s.batch, (unsigned long long)s.seq, s.precision, s.optim, s.attention, s.framework, s.lora_rank, s.lora_targets);
        t = s, t.grads = MN_GRADS_KEEP;
        CHECK_OK(mn_estimate(&m, &t, &a));
        t.accum = 2 + mnt_rand_u64() % 3;
        CHECK_OK(mn_estimate(&m, &t, &b));
        t.batch *= t.accum, t.accum = 1;
        CHECK_OK(mn_estimate(&m, &t, &c));
        CHECK_MSG(b.peak_allocated <= c.peak_allocated, "%s: accumulation needed more than the big batch (%llu > %llu)",
                  m.name, (unsigned long long)b.peak_allocated, (unsigned long long)c.peak_allocated);
        {  // torch 2's plain loop (`out = model(...)`) keeps the previous micro-batch's outputs
           // (logits, the training KV cache) alive through the next forward
            uint64_t held = 0, lesz = s.precision == MN_PREC_FP32 ? 4 : 2;
            if (a.setup.framework == MN_FW_HF && a.setup.torch_version >= 200)
                held = s.batch * a.setup.seq * (a.model.head == MN_HEAD_LM ? a.model.vocab : 1024) *
                       lesz + a.cat_peak[MN_CAT_KV_CACHE];
            CHECK_MSG(b.peak_allocated <= a.peak_allocated + a.peak_allocated / 100 + held,
                      "%s: accumulation needed more than one micro-batch (%llu > %llu)", m.name,
                      (unsigned long long)b.peak_allocated, (unsigned long long)a.peak_allocated);
        }
        s.no_replay = 0;
        CHECK_OK(mn_estimate(&m, &s, &c));
        CHECK(c.peak_reserved >= c.peak_allocated);
        CHECK(c.peak_allocated >= c.cat_peak[MN_CAT_WEIGHTS]);
        CHECK_EQ_U64(c.device_used, c.context + c.peak_reserved);
    }
}

// ZeRO stages never increase per-GPU memory: the model states and the bytes a step needs. As in
// test_properties, the replayed peak is only checked to cover the need: the allocator's rounding
// and split decisions can move it by a block either way (SGD, with no state to shard, needs the
// same bytes at stages 0 and 1 and may replay a few hundred KiB higher at 1).
static void test_zero_monotonic(void) {
    int it;
    for (it = 0; it < 8; it++) {
        mn_model m = random_model();
        mn_setup s = random_setup(), q;
        mn_estimate_result r, replayed;
        uint64_t prev_states = UINT64_MAX, prev_need = UINT64_MAX;
        uint32_t z;
        s.gpus = 2 + (uint32_t)(mnt_rand_u64() % 15);
        s.framework = MN_FW_DEEPSPEED, s.lora_rank = 0;
        for (z = 0; z <= 3; z++) {
            s.zero_stage = z;
            q = s, q.no_replay = 1;
            CHECK_OK(mn_estimate(&m, &q, &r));
            CHECK_MSG(r.model_states <= prev_states, "zero %u raised model states", z);
            CHECK_MSG(r.peak_allocated <= prev_need, "zero %u raised the bytes needed", z);
            CHECK_OK(mn_estimate(&m, &s, &replayed));
            CHECK_MSG(replayed.peak_allocated >= r.peak_allocated, "zero %u: the replay %llu does "
                      "not cover the need %llu", z, (unsigned long long)replayed.peak_allocated,
                      (unsigned long long)r.peak_allocated);
            CHECK_EQ_U64(replayed.model_states, r.model_states);
            prev_states = r.model_states, prev_need = r.peak_allocated;
        }
    }
}

// fit's largest batch fits and one more does not; likewise the longest sequence.
static void test_fit(void) {
    mn_model m = preset("gpt2-medium");
    mn_setup s = setup0();
    mn_fit_result f;
    mn_estimate_result r;
    s.seq = 1024, s.gpu = "t4";
    CHECK_OK(mn_fit(&m, &s, &f));
    CHECK(f.max_batch >= 1);
    s.batch = f.max_batch;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK(r.fits);
    s.batch = f.max_batch + 1;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK(!r.fits);
    m = preset("llama-2-7b");
    s = setup0();
    s.gpu = "a10g", s.batch = 2, s.seq = 512;
    CHECK_OK(mn_fit(&m, &s, &f));
    CHECK(f.plan_found && f.plan_len > 0);
    CHECK(f.plan_estimate.fits);
    CHECK_OK(mn_estimate(&m, &f.plan_setup, &r));
    CHECK(r.fits);
    m = preset("llama-3.2-1b");
    s = setup0();
    s.gpu = "a100-40gb", s.precision = MN_PREC_BF16;
    CHECK_OK(mn_fit(&m, &s, &f));
    CHECK(f.max_seq > 512);
    s.seq = f.max_seq;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK(r.fits);
    s.seq = f.max_seq + 1;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK(!r.fits);
}

// A small random model for the fit tests: a custom stack of linear/norm/activation/dropout
// layers, or a decoder, encoder or encoder-decoder of a few narrow blocks.
static mn_model fit_random_model(mn_layer *L, uint32_t cap) {
    mn_model m;
    memset(&m, 0, sizeof m);
    if (mnt_rand_u64() % 3 == 0) {
        uint32_t n = 2 + (uint32_t)(mnt_rand_u64() % (cap - 1)), i;
        uint64_t w = 16 + mnt_rand_u64() % 200;
        m.arch = MN_ARCH_STACK, m.stack = L, m.stack_len = n;
        for (i = 0; i < n; i++) {
            memset(&L[i], 0, sizeof L[i]);
            L[i].kind = i == 0 ? MN_LAYER_LINEAR : (mn_layer_kind)(1 + mnt_rand_u64() % 5);
            if (L[i].kind == MN_LAYER_EMBEDDING) L[i].kind = MN_LAYER_LINEAR;
            L[i].in = w, L[i].out = w, L[i].bias = (int)(mnt_rand_u64() % 2);
        }
    } else {
        static const mn_arch arch[] = {MN_ARCH_DECODER, MN_ARCH_ENCODER, MN_ARCH_ENCODER_DECODER};
        m.arch = arch[mnt_rand_u64() % 3];
        m.layers = 1 + mnt_rand_u64() % 4, m.heads = 1 + mnt_rand_u64() % 4;
        m.hidden = m.heads * (8 + mnt_rand_u64() % 24), m.vocab = 100 + mnt_rand_u64() % 2000;
        m.max_positions = 1u << 16, m.gated_mlp = (int)(mnt_rand_u64() % 2);
        m.posemb = (mn_posemb)(mnt_rand_u64() % MN_POS_COUNT);
    }
    return m;
}

// Fits the device, by its own mn_estimate? (batch or sequence length set to v)
static int fit_check(const mn_model *m, const mn_setup *s, int seq, uint64_t v) {
    mn_setup u = *s;
    mn_estimate_result r;
    if (seq) u.seq = v;
    else u.batch = v;
    return mn_estimate(m, &u, &r) == MN_OK && r.fits;
}

// Brute force: every batch (seq: sequence length) from 1 up to limit checked by its own
// mn_estimate. The answer is the last value before the first that does not fit (0 if 1 does
// not); *monotonic is cleared when a value above that fits again. A limit that fits fails.
static uint64_t fit_brute(const mn_model *m, const mn_setup *s, int seq, uint64_t limit,
                          int *monotonic) {
    uint64_t v, answer = 0;
    int failed = 0;
    *monotonic = 1;
    for (v = 1; v <= limit; v++) {
        int ok = fit_check(m, s, seq, v);
        if (ok && failed) *monotonic = 0;
        if (!ok && !failed) failed = 1, answer = v - 1;
    }
    CHECK_MSG(failed, "%s %llu still fits", seq ? "seq" : "batch", (unsigned long long)limit);
    return answer;
}

// mn_fit's answers against brute force on random small models, the budget a little above the
// setup's need: the largest batch and the longest sequence equal the brute-force answers (with
// the allocator replay, whose reserved bytes may dip as the batch grows, where fitting is
// monotonic; else the answer fits and one more does not). The plan's estimate equals a fresh
// estimate of the plan's setup: what the fit keeps between its estimates changes no answer.
static void test_fit_brute_force(void) {
    int it;
    for (it = 0; it < 12; it++) {
        mn_layer L[10];
        mn_model m = fit_random_model(L, 10);
        mn_setup s = setup0();
        mn_estimate_result one, r, fresh;
        mn_fit_result f;
        uint64_t want;
        int mono, k;
        s.batch = 2 + mnt_rand_u64() % 16, s.seq = 8 + mnt_rand_u64() % 120;
        s.precision = (mn_precision)(mnt_rand_u64() % 3);
        s.checkpointing = (mn_ckpt)(mnt_rand_u64() % 3);
        s.no_replay = (int)(mnt_rand_u64() % 2);
        s.context = 1 << 20, s.capacity = 1ull << 40;
        CHECK_OK(mn_estimate(&m, &s, &r));
        s.batch = 1;
        CHECK_OK(mn_estimate(&m, &s, &one));
        s.batch = r.setup.batch;
        // room for the setup (replayed, when it is) and up to as much again as its batch adds.
        // (The replay's peak allocated adds the unsplit remainders of blocks that serve requests
        // whole, which a larger batch can lose: peak_requested grows with the batch, but
        // peak_allocated may be the lower one.)
        s.capacity = r.device_used;
        if (r.peak_allocated > one.peak_allocated)
            s.capacity += (r.peak_allocated - one.peak_allocated) * (mnt_rand_u64() % 100) / 100;
        {
            mnt_log lg;
            mn_result e;
            memset(&lg, 0, sizeof lg);
            s.logger.log_fn = mnt_log_capture, s.logger.user_data = &lg;
            e = mn_fit(&m, &s, &f);
            CHECK_MSG(e == MN_OK, "model %d (arch %d): fit failed: %s", it, (int)m.arch, lg.last);
            s.logger.log_fn = NULL, s.logger.user_data = NULL;
            if (e != MN_OK) continue;
        }
        for (k = 0; k < 2; k++) {
            uint64_t got = k ? f.max_seq : f.max_batch;
            uint64_t limit = (k ? 4 * s.seq + 256 : 4 * s.batch + 64);
            if (got + 1 > limit) limit = got + 1;  // (a replay's 20 MiB segment leaves room)
            if (limit > 1000) {  // brute force would take long: the answer's edge alone
                CHECK(fit_check(&m, &s, k, got) && !fit_check(&m, &s, k, got + 1));
                continue;
            }
            want = fit_brute(&m, &s, k, limit, &mono);
            if (mono) {
                CHECK_EQ_U64(got, want);
            } else {
                CHECK(got == 0 || fit_check(&m, &s, k, got));
                CHECK(!fit_check(&m, &s, k, got + 1));
            }
        }
        CHECK_EQ_INT(f.plan_found, 1);
        CHECK_OK(mn_estimate(&m, &f.plan_setup, &fresh));
        CHECK_EQ_U64(f.plan_estimate.peak_allocated, fresh.peak_allocated);
        CHECK_EQ_U64(f.plan_estimate.peak_reserved, fresh.peak_reserved);
        CHECK_EQ_U64(f.plan_estimate.device_used, fresh.device_used);
        CHECK_EQ_U64(f.plan_estimate.activations, fresh.activations);
        CHECK_EQ_U64(f.plan_estimate.alloc_events, fresh.alloc_events);
        CHECK_EQ_INT(f.plan_estimate.fits, 1);
    }
}

// A fit whose setup as given does not fit replays that setup only if its estimate is the answer
// (no technique helped), and reuses the replay of equal allocation events. On random small models with a budget below the setup's need, half with
// every technique already applied (inference, 4-bit weights, fused attention): the fit's estimate
// equals a fresh estimate of its setup, field by field, its largest batch and longest sequence
// fit, and they are 0 only when the setup's batch 1 (sequence 1) does not fit by itself.
static void test_fit_given_deferred(void) {
    int it, deferred = 0;
    // 16 setups, then more until one is deferred (about 1 in 3 is; 16 without one came up once
    // in some 300 seeds): the check below then fails only if none of 256 is
    for (it = 0; it < 16 || (deferred == 0 && it < 256); it++) {
        mn_layer L[10];
        mn_model m = fit_random_model(L, 10);
        mn_setup s = setup0();
        mn_estimate_result r, fresh;
        mn_fit_result f;
        int k;
        s.batch = 1 + mnt_rand_u64() % 8, s.seq = 8 + mnt_rand_u64() % 120;
        s.precision = (mn_precision)(mnt_rand_u64() % 3);
        if (mnt_rand_u64() % 2 && m.arch != MN_ARCH_STACK) {
            s.infer = 1, s.prompt = s.seq, s.new_tokens = 1 + mnt_rand_u64() % 8;
            s.attention = MN_ATTN_SDPA, s.quant = MN_QUANT_NF4_DQ;
        } else if (mnt_rand_u64() % 2) {  // states on the host: setups the device cannot tell
            s.framework = MN_FW_DEEPSPEED, s.zero_stage = 3, s.offload = MN_OFFLOAD_ALL;
            s.optim = (mn_optim)(mnt_rand_u64() % 3);  // apart (the fit reuses their replays)
        }
        s.context = 1 << 20, s.capacity = 1ull << 40;
        if (mn_estimate(&m, &s, &r) != MN_OK) continue;  // (a setup this model cannot take)
        s.capacity = s.context + r.peak_allocated * (mnt_rand_u64() % 100) / 100;
        CHECK_OK(mn_estimate(&m, &s, &r));
        CHECK(!r.fits);
        CHECK_OK(mn_fit(&m, &s, &f));
        if (!f.plan_found && f.plan_len > 0) continue;  // (then the estimate is the step alone)
        deferred += f.plan_len == 0;
        CHECK_OK(mn_estimate(&m, &f.plan_setup, &fresh));
        CHECK_EQ_U64(f.plan_estimate.peak_allocated, fresh.peak_allocated);
        CHECK_EQ_U64(f.plan_estimate.peak_requested, fresh.peak_requested);
        CHECK_EQ_U64(f.plan_estimate.peak_reserved, fresh.peak_reserved);
        CHECK_EQ_U64(f.plan_estimate.device_used, fresh.device_used);
        CHECK_EQ_U64(f.plan_estimate.alloc_events, fresh.alloc_events);
        CHECK_EQ_INT(f.plan_estimate.fits, fresh.fits);
        CHECK_EQ_INT(f.plan_estimate.setup.no_replay, 0);
        for (k = 0; k < MN_CAT_COUNT; k++)
            CHECK_EQ_U64(f.plan_estimate.at_peak[k], fresh.at_peak[k]);
        // (Reserved bytes need not grow with the batch: the allocator's rounding can make
        // batch 1 reserve more than batch 2. The answer is a value that fits, not necessarily
        // the first.)
        if (f.max_batch) CHECK(fit_check(&m, &s, 0, f.max_batch));
        else CHECK(!fit_check(&m, &s, 0, 1));
        if (!s.infer && f.max_seq) CHECK(fit_check(&m, &s, 1, f.max_seq));
        else if (!s.infer) CHECK(!fit_check(&m, &s, 1, 1));
    }
    CHECK_MSG(deferred > 0, "no fit kept the setup as given");
}

// Bad input returns an error code and one log line; huge models report instead of wrapping.
static void test_bad_input(void) {
    mn_model m = preset("gpt2"), b;
    mn_setup s = setup0();
    mn_estimate_result r;
    mnt_log lg;
    memset(&lg, 0, sizeof lg);
    s.logger.log_fn = mnt_log_capture, s.logger.user_data = &lg;
    b = m, b.heads = 0;
    CHECK_ERR(mn_estimate(&b, &s, &r), MN_ERR_INVALID_ARG);
    CHECK_EQ_INT(lg.count, 1);
    b = m, b.heads = 12, b.kv_heads = 5;
    CHECK_ERR(mn_estimate(&b, &s, &r), MN_ERR_INVALID_ARG);
    b = m, b.hidden = 770;
    CHECK_ERR(mn_estimate(&b, &s, &r), MN_ERR_INVALID_ARG);
    b = m, b.layers = 1000000;
    CHECK_ERR(mn_estimate(&b, &s, &r), MN_ERR_INVALID_ARG);
    s.seq = 4096;  // gpt2 has 1024 positions
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    s.seq = 0, s.zero_stage = 4;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    s.zero_stage = 0, s.gpu = "tpu-v9";
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_NOT_FOUND);
    s.gpu = NULL, s.precision = (mn_precision)99;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    s.precision = MN_PREC_DEFAULT, s.quant = MN_QUANT_NF4;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    s.quant = MN_QUANT_DEFAULT, s.context = 1ull << 40;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_estimate(NULL, &s, &r), MN_ERR_INVALID_ARG);
    // 10^15 parameters: a real (enormous) answer, no wrap-around
    memset(&b, 0, sizeof b);
    b.params = 1000000000000000ull;
    s = setup0();
    s.no_replay = 1, s.seq = 8;
    CHECK_OK(mn_estimate(&b, &s, &r));
    CHECK_EQ_U64(r.params, 1000000000000000ull);
    CHECK_EQ_U64(r.weights, 4000000000000000ull);
    CHECK_EQ_U64(r.model_states, 16000000000000000ull);
    CHECK(!r.fits);
    b.params = 5000000000000000000ull;  // 5 * 10^18 x 16 bytes does not fit 64 bits
    memset(&lg, 0, sizeof lg);
    s.logger.log_fn = mnt_log_capture, s.logger.user_data = &lg;
    CHECK_ERR(mn_estimate(&b, &s, &r), MN_ERR_OVERFLOW);
    CHECK_EQ_INT(lg.count, 1);
}

// Each bound the library checks on a setup: one past it is MN_ERR_INVALID_ARG with one log line
// (the library is the single source of these bounds), the bound itself is accepted.
static void test_setup_bounds(void) {
    mn_model m = preset("gpt2");
    mn_setup s = setup0(), b;
    mn_estimate_result r;
    mnt_log lg;
    s.logger.log_fn = mnt_log_capture, s.logger.user_data = &lg, s.no_replay = 1, s.seq = 64;
    s.gpus = 2;  // (ZeRO over one GPU is accepted with a warning)
#define REJECTS(field, value) do { b = s, b.field = value, memset(&lg, 0, sizeof lg); \
    CHECK_ERR(mn_estimate(&m, &b, &r), MN_ERR_INVALID_ARG); CHECK_EQ_INT(lg.count, 1); } while (0)
#define ACCEPTS(field, value) do { b = s, b.field = value, memset(&lg, 0, sizeof lg); \
    CHECK_OK(mn_estimate(&m, &b, &r)); CHECK_EQ_INT(lg.count, 0); } while (0)
    REJECTS(batch, (1ull << 32) + 1);
    REJECTS(seq, (1ull << 26) + 1);
    REJECTS(seq, 1025);  // gpt2 has 1024 positions
    ACCEPTS(seq, 1024);
    REJECTS(accum, (1ull << 20) + 1);
    ACCEPTS(accum, 1ull << 20);
    REJECTS(torch_version, 99);
    REJECTS(torch_version, 1000);
    REJECTS(zero_stage, 4);
    ACCEPTS(zero_stage, 3);
    REJECTS(gpus, (1u << 20) + 1);
    ACCEPTS(gpus, 1u << 20);
    REJECTS(lora_rank, 65537);
    REJECTS(beams, 2);  // generation only
    REJECTS(prompt, 64);
    REJECTS(new_tokens, 1);
    REJECTS(capacity, (1ull << 50) + 1);
    ACCEPTS(capacity, 1ull << 50);
    REJECTS(context, (80ull << 30) + 1);  // a100-80gb: more than the capacity
    s.infer = 1;
    REJECTS(beams, 4097);
    ACCEPTS(beams, 4096);
    REJECTS(prompt, (1ull << 26) + 1);
    REJECTS(new_tokens, (1ull << 26) + 1);
    ACCEPTS(new_tokens, 1024 - 64);  // the prompt (= seq, 64) and new tokens fill the positions
    REJECTS(new_tokens, 1024 - 64 + 1);
    REJECTS(optim, MN_OPTIM_ADAMW);   // contradicts --infer
    ACCEPTS(optim, MN_OPTIM_NONE);
    REJECTS(accum, 2);
    REJECTS(checkpointing, MN_CKPT_FULL);
#undef REJECTS
#undef ACCEPTS
}

// Random shapes and settings: every call either succeeds with consistent numbers or fails cleanly.
static void test_random_setups(void) {
    int it;
    for (it = 0; it < 60; it++) {
        mn_model m = random_model();
        mn_setup s = random_setup();
        mn_estimate_result r;
        mn_result res;
        if (mnt_rand_u64() % 4 == 0) s.checkpointing = (mn_ckpt)(1 + mnt_rand_u64() % 3);
        if (mnt_rand_u64() % 4 == 0) s.zero_stage = (uint32_t)(mnt_rand_u64() % 4), s.gpus = 4;
        if (mnt_rand_u64() % 5 == 0) s.infer = 1, s.new_tokens = mnt_rand_u64() % 64;
        if (mnt_rand_u64() % 6 == 0) s.accum = 1 + mnt_rand_u64() % 4;
        res = mn_estimate(&m, &s, &r);
        if (res != MN_OK) {
            CHECK_ERR(res, MN_ERR_INVALID_ARG);  // e.g. quantization without LoRA
            continue;
        }
        CHECK(r.peak_allocated >= r.weights / 2);
        CHECK(r.peak_reserved >= r.peak_allocated);
        CHECK_EQ_U64(r.model_states, r.weights + r.master_weights + r.gradients + r.optimizer);
    }
}

// Without events or explain, an estimate reuses a dead tensor's id once no op on the tape names
// it; with them it never does. The step must be the same either way: the peak of the no-replay
// estimate equals the running maximum of the live bytes in the trace (events on), and explain's
// peak, on random models and setups (checkpointing, accumulation, ZeRO, generation).
static void test_id_reuse(void) {
    int it;
    for (it = 0; it < 60; it++) {
        mn_model m = random_model();
        mn_setup s = random_setup();
        mn_estimate_result r;
        mn_trace_event *ev = NULL;
        uint64_t n = 0, i, live = 0, peak = 0, xpeak = 0;
        uint32_t cnt = 0;
        if (mnt_rand_u64() % 2 == 0) s.checkpointing = (mn_ckpt)(1 + mnt_rand_u64() % 3);
        if (mnt_rand_u64() % 4 == 0) s.zero_stage = (uint32_t)(mnt_rand_u64() % 4), s.gpus = 4;
        if (mnt_rand_u64() % 5 == 0) s.infer = 1, s.new_tokens = mnt_rand_u64() % 64;
        if (mnt_rand_u64() % 3 == 0) s.accum = 1 + mnt_rand_u64() % 4;
        s.no_replay = 1;
        if (mn_estimate(&m, &s, &r) != MN_OK) continue;  // e.g. quantization without LoRA
        CHECK_OK(mn_estimate_trace(&m, &s, NULL, &ev, &n));
        for (i = 0; i < n; i++) {
            live = ev[i].alloc ? live + ev[i].size : live - ev[i].size;
            if (live > peak) peak = live;
        }
        mn_trace_free(NULL, ev);
        CHECK_EQ_U64(r.peak_allocated, peak);
        CHECK_OK(mn_estimate_explain(&m, &s, NULL, 0, &cnt, &xpeak));
        CHECK_EQ_U64(r.peak_allocated, xpeak);
    }
}

// Every allocation of the trace is freed at most once, after it was made.
static void test_trace_consistency(void) {
    mn_model m = preset("llama-3.2-1b");
    mn_setup s = setup0();
    mn_trace_event *ev = NULL;
    uint64_t n = 0, i, live = 0, max_id = 0;
    unsigned char *state;
    m.layers = 3;
    s.precision = MN_PREC_BF16, s.checkpointing = MN_CKPT_FULL, s.accum = 2;
    CHECK_OK(mn_estimate_trace(&m, &s, NULL, &ev, &n));
    CHECK(n > 100);
    for (i = 0; i < n; i++) if (ev[i].id > max_id) max_id = ev[i].id;
    state = (unsigned char *)calloc(max_id + 1, 1);
    for (i = 0; i < n && state; i++) {
        if (ev[i].alloc) {
            CHECK(state[ev[i].id] == 0);
            state[ev[i].id] = 1, live += ev[i].size;
        } else {
            CHECK(state[ev[i].id] == 1);
            state[ev[i].id] = 2, live -= ev[i].size;
        }
    }
    free(state);
    mn_trace_free(NULL, ev);
}

// Host allocation failures: every failing point returns MN_ERR_OUT_OF_MEMORY and leaks nothing.
typedef struct estimate_ctx {
    mn_model m;
    mn_setup s;
} estimate_ctx;

static mn_result estimate_once(void *ctx) {
    estimate_ctx *c = (estimate_ctx *)ctx;
    mn_estimate_result r;
    return mn_estimate(&c->m, &c->s, &r);
}

static void test_alloc_failures(void) {
    estimate_ctx c;
    c.m = preset("gpt2"), c.s = setup0();
    c.m.layers = 2, c.s.seq = 64;
    WALK_ALLOC_FAILURES(estimate_once, &c, 399);
}

// mn_estimate_replay: the simulated step replayed through a cache the caller set up. It must be
// the trace of mn_estimate_trace replayed by mn_cache_replay with the blocks left live (the same
// statistics and the same blocks, each labelled with the name of its phase), and, through a
// cache of the estimate's own settings, give the estimate's peaks.
static mn_result replay_into(const char *conf, const mn_model *m, const mn_setup *s,
                             const mn_trace_event *ev, uint64_t n, struct mn_cache_stats *st,
                             mn_cache_snapshot *snap) {
    mn_sim_cache sc;
    mn_cache_desc cd;
    mn_replay_counts counts;
    mn_result r;
    memset(&cd, 0, sizeof cd);
    cd.config = conf;
    if ((r = mn_sim_cache_init(&sc, NULL, &cd)) != MN_OK) return r;
    if (ev) {
        r = mn_cache_replay(&sc.cache, ev, n, 0, &counts);
        if (r == MN_OK) CHECK_EQ_U64(counts.failed + counts.unmatched_frees, 0);
    } else {
        r = mn_estimate_replay(m, s, NULL, &sc.cache);
    }
    if (r == MN_OK) r = mn_cache_check(&sc.cache);
    if (r == MN_OK) r = mn_cache_stats(&sc.cache, st);
    if (r == MN_OK) r = mn_cache_snapshot_take(&sc.cache, snap);
    mn_sim_cache_free(&sc);
    return r;
}

static void test_estimate_replay(void) {
    static const char *names[] = {"gpt2", "bert-base-uncased", "qwen2-0.5b", "t5-small"};
    static const char *confs[] = {"", "expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4"};
    int round;
    for (round = 0; round < 6; round++) {
        mn_model m = preset(names[mnt_rand_u64() % 4]);
        mn_setup s = setup0();
        mn_estimate_result res;
        mn_trace_event *ev = NULL;
        uint64_t n = 0, i, labelled = 0, nallocs = 0;
        struct mn_cache_stats a, b;
        mn_cache_snapshot sa, sb;
        const char *conf = confs[round < 2 ? 0 : mnt_rand_u64() % 4];
        mn_stat_item *ia = (mn_stat_item *)malloc(sizeof *ia * MN_CACHE_STATS_ITEMS);
        mn_stat_item *ib = (mn_stat_item *)malloc(sizeof *ib * MN_CACHE_STATS_ITEMS);
        uint32_t na, nb, k;
        CHECK(ia && ib);
        if (!ia || !ib) {
            free(ia), free(ib);
            return;
        }
        s.batch = 1 + mnt_rand_u64() % 4, s.seq = 64u << (mnt_rand_u64() % 3);
        s.precision = (mn_precision)(mnt_rand_u64() % (MN_PREC_BF16 + 1));
        s.checkpointing = (mn_ckpt)(mnt_rand_u64() % MN_CKPT_COUNT);
        s.alloc_conf = *conf ? conf : NULL;
        memset(&sa, 0, sizeof sa), memset(&sb, 0, sizeof sb);
        CHECK_OK(mn_estimate(&m, &s, &res));
        CHECK_OK(mn_estimate_trace(&m, &s, NULL, &ev, &n));
        CHECK_OK(replay_into(conf, &m, &s, NULL, 0, &a, &sa));
        CHECK_OK(replay_into(conf, &m, &s, ev, n, &b, &sb));
        for (i = 0; i < n; i++) nallocs += ev[i].alloc;  // the estimate counts the allocations
        CHECK_EQ_U64(res.alloc_events, nallocs);
        mn_trace_free(NULL, ev);
        // the estimate's peaks (its replay: the same trace through a cache of its settings)
        CHECK_EQ_U64(a.allocated_bytes[0].peak, res.peak_allocated);
        CHECK_EQ_U64(a.reserved_bytes[0].peak, res.peak_reserved);
        // every statistic, and block for block the same cache as the trace's replay
        na = mn_cache_stats_items(&a, ia, MN_CACHE_STATS_ITEMS);
        nb = mn_cache_stats_items(&b, ib, MN_CACHE_STATS_ITEMS);
        CHECK_EQ_INT(na, nb);
        for (k = 0; k < na && k < nb; k++)
            CHECK_MSG(ia[k].value == ib[k].value, "%s: %s %lld, the trace's replay %lld",
                      m.name, ia[k].key, (long long)ia[k].value, (long long)ib[k].value);
        CHECK_EQ_U64(sa.block_count, sb.block_count);
        CHECK(sa.block_count > 0);  // the weights at least stay live
        for (i = 0; i < sa.block_count && i < sb.block_count; i++) {
            const mn_block_info *x = &sa.blocks[i], *y = &sb.blocks[i];
            int ph, known = x->label[0] == 0;
            CHECK(x->addr == y->addr && x->size == y->size && x->requested == y->requested);
            CHECK(x->state == y->state && x->category == y->category);
            CHECK_STR(x->label, y->label);
            for (ph = 1; ph < MN_PHASE_COUNT; ph++)
                known |= strcmp(x->label, mn_phase_name((mn_phase)ph)) == 0;
            CHECK_MSG(known, "block label \"%s\" is no phase", x->label);
            labelled += x->state == MN_BLOCK_ACTIVE_ALLOCATED && x->label[0];
        }
        CHECK(labelled > 0);
        mn_cache_snapshot_free(&sa), mn_cache_snapshot_free(&sb);
        free(ia), free(ib);
    }
}

// mn_estimate_replay's arguments, and its host allocation failures (the cache's own included).
static mn_result replay_once(void *ctx) {
    estimate_ctx *c = (estimate_ctx *)ctx;
    mn_sim_cache sc;
    mn_result r = mn_sim_cache_init(&sc, NULL, NULL);
    if (r != MN_OK) return r;
    r = mn_estimate_replay(&c->m, &c->s, NULL, &sc.cache);
    if (r == MN_OK) CHECK_OK(mn_cache_check(&sc.cache));
    mn_sim_cache_free(&sc);
    return r;
}

static void test_estimate_replay_errors(void) {
    estimate_ctx c;
    mn_sim_cache sc;
    mn_setup bad;
    c.m = preset("gpt2"), c.s = setup0();
    c.m.layers = 2, c.s.seq = 64;
    CHECK_OK(mn_sim_cache_init(&sc, NULL, NULL));
    CHECK_ERR(mn_estimate_replay(&c.m, NULL, NULL, &sc.cache), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_estimate_replay(&c.m, &c.s, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_estimate_replay(NULL, &c.s, NULL, &sc.cache), MN_ERR_INVALID_ARG);
    bad = c.s, bad.precision = MN_PREC_COUNT;  // a bad setup: refused, nothing replayed
    CHECK_ERR(mn_estimate_replay(&c.m, &bad, NULL, &sc.cache), MN_ERR_INVALID_ARG);
    {
        struct mn_cache_stats st;
        CHECK_OK(mn_cache_stats(&sc.cache, &st));
        CHECK_EQ_U64(st.allocation[0].allocated + st.reserved_bytes[0].peak, 0);
    }
    mn_sim_cache_free(&sc);
    WALK_ALLOC_FAILURES(replay_once, &c, 999);
}

// Each model field out of its range: MN_ERR_INVALID_ARG and one error that names the field;
// the same field at the end of its range is taken.
typedef struct bad_field {
    const char *what;  // in the message
    int field;
    uint64_t bad, good;
} bad_field;

enum { BF_LAYERS, BF_HIDDEN, BF_HEADS, BF_KV, BF_HEAD_DIM, BF_FFN, BF_VOCAB, BF_ENC, BF_POS,
       BF_TYPES, BF_LABELS };

static void set_field(mn_model *m, int f, uint64_t v) {
    switch (f) {
    case BF_LAYERS: m->layers = v; break;
    case BF_HIDDEN: m->hidden = v, m->heads = 16, m->kv_heads = 0, m->head_dim = 0; break;
    case BF_HEADS: m->heads = v, m->kv_heads = 0, m->head_dim = 0; break;
    case BF_KV: m->kv_heads = v; break;
    case BF_HEAD_DIM: m->head_dim = v; break;
    case BF_FFN: m->ffn = v; break;
    case BF_VOCAB: m->vocab = v; break;
    case BF_ENC: m->arch = MN_ARCH_ENCODER_DECODER, m->encoder_layers = v; break;
    case BF_POS: m->max_positions = v; break;
    case BF_TYPES: m->type_vocab = v; break;
    default: m->head = MN_HEAD_CLASSIFICATION, m->num_labels = v; break;
    }
}

static mn_result estimate_logged(const mn_model *m, mnt_log *lg) {
    mn_setup s = setup0();
    mn_estimate_result r;
    memset(lg, 0, sizeof *lg);
    s.logger.log_fn = mnt_log_capture, s.logger.user_data = lg;
    s.seq = 16, s.no_replay = 1;
    return mn_estimate(m, &s, &r);
}

static void test_bad_model_fields(void) {
    static const bad_field t[] = {
        {"layers", BF_LAYERS, 0, 1},           {"layers", BF_LAYERS, 10001, 3},
        {"hidden size", BF_HIDDEN, 0, 64},     {"hidden size", BF_HIDDEN, (1ull << 20) + 1, 1 << 20},
        {"attention heads", BF_HEADS, 0, 12},  {"attention heads", BF_HEADS, 769, 768},
        {"key/value heads", BF_KV, 5, 4},      {"key/value heads", BF_KV, 24, 12},
        {"not a multiple", BF_HEADS, 7, 8},    {"head dimension", BF_HEAD_DIM, 65537, 65536},
        {"MLP width", BF_FFN, (1ull << 24) + 1, 1ull << 24},
        {"vocabulary", BF_VOCAB, (1ull << 26) + 1, 1ull << 26},
        {"encoder layers", BF_ENC, 10001, 2},  {"positions", BF_POS, (1ull << 24) + 1, 1ull << 24},
        {"token types", BF_TYPES, (1ull << 20) + 1, 1ull << 20},
        {"labels", BF_LABELS, (1ull << 24) + 1, 1ull << 24},
    };
    static const float drop[] = {1.0f, -0.25f, 2.0f};
    mn_layer stack[2];
    mn_model m;
    mnt_log lg;
    size_t i;
    for (i = 0; i < sizeof t / sizeof t[0]; i++) {
        m = preset("gpt2"), m.layers = 2;
        set_field(&m, t[i].field, t[i].bad);
        CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
        CHECK_MSG(lg.errors == 1 && strstr(lg.last, t[i].what), "%s %llu: \"%s\"", t[i].what,
                  (unsigned long long)t[i].bad, lg.last);
        m = preset("gpt2"), m.layers = 2;
        set_field(&m, t[i].field, t[i].good);
        CHECK_MSG(estimate_logged(&m, &lg) == MN_OK, "%s %llu refused: \"%s\"", t[i].what,
                  (unsigned long long)t[i].good, lg.last);
    }
    for (i = 0; i < sizeof drop / sizeof drop[0]; i++) {
        m = preset("gpt2"), m.layers = 2, m.dropout = drop[i];
        CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
        CHECK(strstr(lg.last, "dropout") != NULL);
        m = preset("gpt2"), m.layers = 2, m.attn_dropout = drop[i] > 1.0f ? (float)NAN : drop[i];
        CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
    }
    m = preset("gpt2"), m.arch = MN_ARCH_COUNT;
    CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
    CHECK(strstr(lg.last, "architecture") != NULL);
    m = preset("gpt2"), m.norm = MN_NORM_COUNT;
    CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
    CHECK(strstr(lg.last, "enum") != NULL);
    // a custom stack: no layers, a layer sharing a later one's weights, widths
    memset(&m, 0, sizeof m), memset(stack, 0, sizeof stack);
    m.arch = MN_ARCH_STACK, m.stack = stack;
    stack[0].kind = MN_LAYER_LINEAR, stack[0].in = 64, stack[0].out = 64;
    stack[1] = stack[0];
    CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);  // stack_len 0
    CHECK(strstr(lg.last, "at least one layer") != NULL);
    m.stack_len = 2;
    CHECK_OK(estimate_logged(&m, &lg));
    stack[1].shared_with = 1;  // the first layer's weights: taken
    CHECK_OK(estimate_logged(&m, &lg));
    stack[0].shared_with = 2;
    CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
    CHECK(strstr(lg.last, "later layer") != NULL);
    stack[0].shared_with = 0, stack[1].out = (1ull << 24) + 1;
    CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
    CHECK(strstr(lg.last, "width") != NULL);
    stack[1].out = 64, stack[1].in = 0;
    CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
    CHECK(strstr(lg.last, "no input width") != NULL);
    stack[1].in = 64, m.stack_len = (1u << 20) + 1;  // refused before the array is read
    CHECK_ERR(estimate_logged(&m, &lg), MN_ERR_INVALID_ARG);
    CHECK(strstr(lg.last, "1048576") != NULL);
}

static void test_presets_and_gpus(void) {
    uint32_t i;
    mn_gpu g;
    for (i = 0; i < mn_preset_count(); i++) {
        mn_model m = *mn_preset_get(i);
        mn_setup s = setup0();
        mn_estimate_result r;
        s.seq = 128, s.precision = MN_PREC_BF16, s.no_replay = 1;
        CHECK_MSG(mn_estimate(&m, &s, &r) == MN_OK, "preset %s", m.name);
    }
    CHECK(mn_preset_count() >= 30);
    CHECK_OK(mn_gpu_find("h100", &g));
    CHECK_STR(g.name, "h100-80gb");
    CHECK_OK(mn_gpu_find("v100-16gb", &g));
    CHECK_EQ_U64(g.capacity, 16160ull << 20);
    CHECK_ERR(mn_preset_find("llama-9-900b", NULL), MN_ERR_INVALID_ARG);
}

// The GPU table cannot contradict itself: bf16 from sm 80 (Ampere) on, and the cuBLAS workspace
// the cuBLAS docs recommend (32 MiB on Hopper, sm 90; 4 MiB before). A training step books the
// workspace of the GPU it runs on. The host row (sm 0, the CPU trainer's) has neither a context
// nor a workspace.
static void test_gpu_table(void) {
    static const struct { const char *name; uint32_t sm; } known[] = {
        {"v100-16gb", 70}, {"t4", 75}, {"a10g", 86}, {"rtx3090", 86}, {"l4", 89},
        {"rtx4090", 89}, {"a100-80gb", 80}, {"h100-80gb", 90}, {"h200", 90},
    };
    mn_model m = preset("gpt2");
    mn_setup s = setup0();
    mn_estimate_result r;
    mn_gpu g;
    uint32_t i;
    for (i = 0; i < mn_gpu_count(); i++) {
        const mn_gpu *p = mn_gpu_get(i);
        if (p->sm == 0) {
            CHECK_STR(p->name, "cpu");
            CHECK_EQ_U64(p->context, 0);
            CHECK_EQ_U64(p->capacity, 1ull << 50);
        }
        CHECK_MSG(p->sm == 0 || (p->sm >= 70 && p->sm <= 90), "%s: sm %u", p->name, p->sm);
        CHECK_MSG(p->bf16 == (p->sm == 0 || p->sm >= 80), "%s: bf16 %d at sm %u", p->name,
                  p->bf16, p->sm);
        CHECK_MSG(p->cublas_workspace == (p->sm == 0 ? 0 : p->sm >= 90 ? 32ull : 4ull) << 20,
                  "%s: cuBLAS workspace %llu at sm %u", p->name,
                  (unsigned long long)p->cublas_workspace, p->sm);
        s.gpu = p->name, s.seq = 64, s.no_replay = 1;
        CHECK_OK(mn_estimate(&m, &s, &r));
        CHECK_EQ_U64(r.workspace, p->cublas_workspace);
        CHECK_EQ_U64(r.gpu.cublas_workspace, p->cublas_workspace);
    }
    for (i = 0; i < sizeof known / sizeof known[0]; i++) {
        CHECK_OK(mn_gpu_find(known[i].name, &g));
        CHECK_EQ_INT(g.sm, known[i].sm);
    }
}

// Names as people write them. A table name respelled (random case, separators added and taken
// out, a hub organization, the words hub repositories and nvidia-smi add) finds its own entry, so
// no two entries share a key; one letter changed finds nothing, or an entry; then the "did you
// mean" names an entry within one edit of it (edit distance by a full matrix here).
static void name_key(const char *s, char *k, size_t cap) {
    size_t n = 0;
    for (; *s && n + 1 < cap; s++)
        if (isalnum((unsigned char)*s)) k[n++] = (char)tolower((unsigned char)*s);
    k[n] = 0;
}
static int edits(const char *a, const char *b) {
    int d[64][64], i, j, na = (int)strlen(a), nb = (int)strlen(b);
    if (na > 63 || nb > 63) return 99;
    for (i = 0; i <= na; i++)
        for (j = 0; j <= nb; j++) {
            int v = i == 0 ? j : j == 0 ? i : d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (i && d[i - 1][j] + 1 < v) v = d[i - 1][j] + 1;
            if (j && d[i][j - 1] + 1 < v) v = d[i][j - 1] + 1;
            d[i][j] = v;
        }
    return d[na][nb];
}
// name with random case, separators dropped and added between characters
static void respell(const char *name, char *out, size_t cap) {
    static const char seps[] = " -_.";
    size_t n = 0;
    for (; *name && n + 3 < cap; name++) {
        int c = (unsigned char)*name;
        if (!isalnum(c)) {
            if (mnt_rand_u64() % 2) out[n++] = seps[mnt_rand_u64() % 4];
            continue;
        }
        out[n++] = (char)(mnt_rand_u64() % 2 ? toupper(c) : c);
        if (mnt_rand_u64() % 5 == 0) out[n++] = seps[mnt_rand_u64() % 4];
    }
    out[n] = 0;
}
static void test_names(void) {
    static const char *model_wrap[][2] = {{"", ""}, {"org/", ""}, {"meta-llama/Meta-", "-hf"},
                                          {"Meta-", "-Instruct"}, {"x/", "-chat-hf"}};
    static const char *gpu_wrap[][2] = {{"", ""}, {"NVIDIA ", ""}, {"Tesla ", " PCIe"},
                                        {"NVIDIA GeForce ", "-SXM4"}, {"nvidia ", " HBM3"}};
    static const struct { int gpu; const char *as, *name; } seen[] = {
        {1, "NVIDIA A100-SXM4-40GB", "a100-40gb"}, {1, "Tesla V100-SXM2-32GB", "v100-32gb"},
        {1, "NVIDIA H100 80GB HBM3", "h100-80gb"}, {1, "NVIDIA GeForce RTX 4090", "rtx4090"},
        {0, "mistralai/Mistral-7B-v0.1", "mistral-7b"},
        {0, "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b"},
    };
    char sp[160], v[192], k[64], kq[64];
    uint32_t i, rep;
    mn_model m;
    mn_gpu g;
    for (i = 0; i < mn_preset_count(); i++) {
        const char *name = mn_preset_get(i)->name;
        name_key(name, k, sizeof k);  // the bare key
        CHECK_OK(mn_preset_find(k, &m));
        CHECK_MSG(!strcmp(m.name, name), "%s: key %s found %s", name, k, m.name);
        for (rep = 0; rep < 20; rep++) {
            size_t w = mnt_rand_u64() % 5;
            respell(name, sp, sizeof sp);
            snprintf(v, sizeof v, "%s%s%s", model_wrap[w][0], sp, model_wrap[w][1]);
            CHECK_OK(mn_preset_find(v, &m));
            CHECK_MSG(!strcmp(m.name, name), "%s: \"%s\" found %s", name, v, m.name);
            CHECK(mn_preset_closest(v) == NULL);
        }
        for (rep = 0; rep < 10; rep++) {  // one letter or digit past the first changed
            const char *near;
            size_t at = 1 + mnt_rand_u64() % (strlen(k) - 1);
            char c = (char)("abcdefghijklmnopqrstuvwxyz0123456789"[mnt_rand_u64() % 36]);
            if (c == k[at]) continue;
            memcpy(kq, k, sizeof kq), kq[at] = c;
            near = mn_preset_closest(kq);
            if (mn_preset_find(kq, &m) == MN_OK) {
                CHECK(near == NULL);
                continue;
            }
            CHECK_MSG(near != NULL, "%s: no suggestion for %s", name, kq);
            if (near) {
                name_key(near, v, sizeof v);
                CHECK_MSG(edits(kq, v) <= 1, "%s: %s suggested %s", name, kq, near);
            }
        }
    }
    for (i = 0; i < mn_gpu_count(); i++) {
        const mn_gpu *p = mn_gpu_get(i);
        const char *spell[2];
        int s;
        spell[0] = p->name, spell[1] = p->label;
        for (s = 0; s < 2; s++)
            for (rep = 0; rep < 20; rep++) {
                size_t w = mnt_rand_u64() % 5;
                respell(spell[s], sp, sizeof sp);
                snprintf(v, sizeof v, "%s%s%s", gpu_wrap[w][0], sp, gpu_wrap[w][1]);
                CHECK_OK(mn_gpu_find(v, &g));
                CHECK_MSG(!strcmp(g.name, p->name), "%s: \"%s\" found %s", p->name, v, g.name);
            }
    }
    for (i = 0; i < sizeof seen / sizeof seen[0]; i++) {  // as nvidia-smi and the hub write them
        if (seen[i].gpu) {
            CHECK_OK(mn_gpu_find(seen[i].as, &g));
            CHECK_STR(g.name, seen[i].name);
        } else {
            CHECK_OK(mn_preset_find(seen[i].as, &m));
            CHECK_STR(m.name, seen[i].name);
        }
    }
    // not found, and not close: no suggestion; a different first letter is not close
    CHECK_ERR(mn_gpu_find("b200", &g), MN_ERR_NOT_FOUND);
    CHECK(mn_gpu_closest("b200") == NULL);
    CHECK(mn_gpu_closest("h100") == NULL);  // found
    CHECK_STR(mn_gpu_closest("a100-40"), "a100-40gb");
    CHECK_ERR(mn_preset_find("qwen3-7b", &m), MN_ERR_NOT_FOUND);
    CHECK_ERR(mn_preset_find("", &m), MN_ERR_NOT_FOUND);
    CHECK(mn_preset_closest("") == NULL && mn_preset_closest("zzzzzzzz") == NULL);
    CHECK(mn_preset_closest(NULL) == NULL && mn_gpu_closest(NULL) == NULL);
    // past 63 letters and digits: a key no name has
    memset(v, 'a', 100), v[100] = 0;
    CHECK_ERR(mn_preset_find(v, &m), MN_ERR_NOT_FOUND);
    CHECK(mn_preset_closest(v) == NULL);
    for (rep = 0; rep < 300; rep++) {  // any bytes: found, or not found (the sanitizers watch)
        size_t n = mnt_rand_u64() % (sizeof v - 1), j;
        const char *near;
        for (j = 0; j < n; j++) v[j] = (char)(1 + mnt_rand_u64() % 255);
        v[n] = 0;
        near = mn_preset_closest(v);  // a suggestion only for a name not found, and found itself
        CHECK(!near || (mn_preset_find(v, &m) == MN_ERR_NOT_FOUND &&
                        mn_preset_find(near, &m) == MN_OK));
        near = mn_gpu_closest(v);
        CHECK(!near || (mn_gpu_find(v, &g) == MN_ERR_NOT_FOUND && mn_gpu_find(near, &g) == MN_OK));
    }
}

// What each block keeps for backward, against arithmetic done by hand from the ops' saved
// tensors (derivatives.yaml, autocast, the HF modelling code):
// BERT-large fp32, eager attention, per layer: 16 fp32 [b,s,h] tensors (input, q, k, v, context,
// two layernorm inputs, the MLP input, GELU input and output at 4h) + two 1-byte dropout masks =
// 66 sbh; per score element softmax output 4 + dropout mask 1 + dropout output 4 (+ the softmax
// input 4 with torch 1.10) = 9 or 13 as^2b; layernorm mean and rstd 2 x 2 x 4 bytes per token.
// Llama-3-8B bf16, sdpa, per token: two HF RMSNorms (fp32 copy 4h, normalized 2h, output 2h),
// rotated q, the attention output (flash lays it out [b, s, heads, d]: HF's contiguous() is a
// view), log-sum-exp (4 per head), gate, up, silu(gate) and the product at 2f each, and 2 rstd
// values; k and v are kept as the training-time KV cache's copies (counted as kv_cache).
static void test_parts_by_hand(void) {
    mn_model m = preset("bert-large-uncased");
    mn_setup s = setup0();
    uint64_t parts[64], sbh, as2b, bs, tok;
    uint32_t n = 0, i;
    m.head = MN_HEAD_CLASSIFICATION, m.pooler = 1, m.lm_transform = 0;
    s.batch = 1 + mnt_rand_u64() % 3, s.seq = 64 * (1 + mnt_rand_u64() % 8), s.attention = MN_ATTN_EAGER;
    sbh = s.batch * s.seq * 1024, as2b = 16 * s.batch * s.seq * s.seq, bs = s.batch * s.seq;
    s.torch_version = 110;
    CHECK_OK(mn_estimate_parts(&m, &s, parts, 64, &n));
    CHECK_EQ_U64(n, 26);
    for (i = 1; i <= 24; i++) CHECK_EQ_U64(parts[i], 66 * sbh + 13 * as2b + 16 * bs);
    s.torch_version = 200;
    CHECK_OK(mn_estimate_parts(&m, &s, parts, 64, &n));
    for (i = 1; i <= 24; i++) CHECK_EQ_U64(parts[i], 66 * sbh + 9 * as2b + 16 * bs);
    m = preset("llama-3-8b");
    s = setup0();
    s.batch = 1 + mnt_rand_u64() % 2, s.seq = 100 + mnt_rand_u64() % 900, s.precision = MN_PREC_BF16_PURE;
    s.torch_version = 200;
    tok = s.batch * s.seq;
    CHECK_OK(mn_estimate_parts(&m, &s, parts, 64, &n));
    CHECK_EQ_U64(n, 34);
    CHECK_EQ_U64(parts[0], tok * 4096 * 2);  // the embedding output
    // block 1 also holds the embedding output, which LlamaModel.forward keeps in its local
    // inputs_embeds until it returns (no op saves it: RMSNorm saves its fp32 copy)
    for (i = 1; i <= 32; i++)
        CHECK_EQ_U64(parts[i], tok * (16 * 4096 + 4 * 4096 + 8 * 14336 + 4 * 32 + 8 +
                                      (i == 1 ? 2 * 4096 : 0)));
    CHECK(parts[33] >= tok * 128256 * 4);  // log_softmax keeps fp32 [tokens, vocab]
    s.checkpointing = MN_CKPT_FULL;  // a checkpointed block keeps its input alone
    CHECK_OK(mn_estimate_parts(&m, &s, parts, 64, &n));
    for (i = 1; i <= 32; i++) CHECK_EQ_U64(parts[i], tok * 4096 * 2);
    s.infer = 1;
    CHECK_ERR(mn_estimate_parts(&m, &s, parts, 64, &n), MN_ERR_UNSUPPORTED);
}

// Inputs that used to give a silently wrong answer: each is refused with one error line, or
// answered with one warning that says what was assumed.
static void test_no_silent_answers(void) {
    mn_model m = preset("gpt2"), big;
    mn_setup s = setup0(), b;
    mn_estimate_result r;
    mnt_log lg;
    uint64_t shape = 0;
    s.logger.log_fn = mnt_log_capture, s.logger.user_data = &lg, s.seq = 64;
#define REFUSED(what, expr) do { b = s; what; memset(&lg, 0, sizeof lg); \
    CHECK_ERR(expr, MN_ERR_INVALID_ARG); CHECK_EQ_INT(lg.errors, 1); } while (0)
    REFUSED(b.lora_rank = 8; b.lora_targets = MN_LORA_GATE, mn_estimate(&m, &b, &r));
    REFUSED(b.precision = MN_PREC_BF16; b.gpu = "v100", mn_estimate(&m, &b, &r));
    REFUSED(b.precision = MN_PREC_BF16_PURE; b.gpu = "t4", mn_estimate(&m, &b, &r));
    REFUSED(b.capacity = 1, mn_estimate(&m, &b, &r));  // below the GPU's context
    REFUSED(b.infer = 1; b.prompt = 1000; b.new_tokens = 25, mn_estimate(&m, &b, &r));
    // bf16 where the GPU has it, and fp16 on a V100, are fine
    b = s, b.precision = MN_PREC_FP16, b.gpu = "v100", memset(&lg, 0, sizeof lg);
    CHECK_OK(mn_estimate(&m, &b, &r));
    CHECK_EQ_INT(lg.count, 0);
    // ZeRO over one GPU: answered, with a warning
    b = s, b.zero_stage = 2, b.framework = MN_FW_DEEPSPEED, memset(&lg, 0, sizeof lg);
    CHECK_OK(mn_estimate(&m, &b, &r));
    CHECK_EQ_INT(lg.warnings, 1);
    // a count below the shape's: the shape's count, with a warning naming both
    memset(&big, 0, sizeof big);
    big.params = 1;
    b = s, b.no_replay = 1, memset(&lg, 0, sizeof lg);
    CHECK_OK(mn_estimate(&big, &b, &r));
    CHECK_EQ_INT(lg.warnings, 1);
    big = r.model, big.params = 0;
    CHECK_OK(mn_model_params(&big, &shape));
    CHECK_EQ_U64(r.params, shape);
    CHECK(r.params > 1);
    // 10^18 parameters: every byte count is either right or refused. A single tensor of 1 EiB or
    // more is refused by any allocator, so the replayed peak cannot be given: an error, where the
    // peak used to come out below the model's own states.
    memset(&big, 0, sizeof big);
    big.params = 1000000000000000000ull;
    b = s, memset(&lg, 0, sizeof lg);
    CHECK_ERR(mn_estimate(&big, &b, &r), MN_ERR_OVERFLOW);
    CHECK_EQ_INT(lg.errors, 1);
    b.no_replay = 1;  // the step alone: exact, and at least the model states
    CHECK_OK(mn_estimate(&big, &b, &r));
    CHECK_EQ_U64(r.weights, 4 * r.params);
    CHECK(r.peak_allocated >= r.model_states);
    CHECK(!r.fits);
#undef REFUSED
}

// torch 2 mechanisms against arithmetic from the libraries' source:
// - foreach AdamW (torch/optim/adam.py, _multi_tensor_adam): torch._foreach_sqrt of every
//   exp_avg_sq of the group at once, 4 bytes per trainable parameter; the per-tensor loop
//   (_single_tensor_adam) holds sqrt and the quotient of one tensor, 8 bytes per element of the
//   largest; fused none.
// - a tied embedding's two gradients summed out of place (autograd's input buffer): at that
//   moment every gradient, plus the sum, is alive: 4 bytes per parameter + 4 V h.
// - the training-time KV cache (transformers 5 DynamicCache): per layer k and v, [b, s, kv
//   width], in the key's dtype: fp32 after RoPE under autocast, the compute dtype for GPT-2;
//   none with gradient checkpointing or torch 1.10.
static void test_torch2_by_hand(void) {
    mn_model m = preset("gpt2");
    mn_setup s = setup0();
    mn_estimate_result r;
    uint64_t P = 0, V = m.vocab, h = m.hidden, tok, biggest = V * h, fused_temp, kvw;
    CHECK_OK(mn_model_params(&m, &P));
    s.batch = 1, s.seq = 8 + mnt_rand_u64() % 24, s.no_replay = 1;
    s.optim_impl = MN_OPTIM_IMPL_FOREACH;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.cat_peak[MN_CAT_TEMPORARY], 4 * P);
    CHECK_EQ_U64(r.cat_peak[MN_CAT_GRADIENTS], 4 * P + 4 * V * h);
    CHECK_EQ_INT(r.setup.optim_impl, MN_OPTIM_IMPL_FOREACH);
    {  // the plain loop holds out.logits and out.past_key_values through the step; the
       // Trainer does not: at the step's peak they differ by B S V and L x 2 x B S h fp32
        mn_estimate_result t;
        uint64_t S1 = s.batch * s.seq;
        s.loop = MN_LOOP_TRAINER;
        CHECK_OK(mn_estimate(&m, &s, &t));
        s.loop = MN_LOOP_DEFAULT;
        CHECK_EQ_INT(r.setup.loop, MN_LOOP_PLAIN);
        CHECK_EQ_INT(r.peak_phase, MN_PHASE_OPTIMIZER);
        CHECK_EQ_INT(t.peak_phase, MN_PHASE_OPTIMIZER);
        CHECK_EQ_U64(r.peak_allocated - t.peak_allocated, 4 * S1 * V + m.layers * 2 * S1 * h * 4);
    }
    s.optim_impl = MN_OPTIM_IMPL_LOOP;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.cat_peak[MN_CAT_TEMPORARY], 8 * biggest);
    s.optim_impl = MN_OPTIM_IMPL_FUSED;
    CHECK_OK(mn_estimate(&m, &s, &r));
    fused_temp = r.cat_peak[MN_CAT_TEMPORARY];  // backward's own temporaries only
    CHECK(fused_temp < 4 * P && fused_temp < 8 * biggest);
    s.optim_impl = MN_OPTIM_IMPL_DEFAULT;  // torch 2 on CUDA: foreach
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_INT(r.setup.optim_impl, MN_OPTIM_IMPL_FOREACH);
    s.torch_version = 110;  // torch 1.10: the loop, and no training-time cache
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_INT(r.setup.optim_impl, MN_OPTIM_IMPL_LOOP);
    CHECK_EQ_U64(r.cat_peak[MN_CAT_KV_CACHE], 0);
    // KV cache: GPT-2 under bf16 autocast keeps it in bf16; Llama (RoPE) in fp32
    s = setup0();
    s.batch = 1 + mnt_rand_u64() % 3, s.seq = 16 + mnt_rand_u64() % 200, s.no_replay = 1;
    s.precision = MN_PREC_BF16;
    tok = s.batch * s.seq;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.cat_peak[MN_CAT_KV_CACHE], m.layers * 2 * tok * h * 2);
    m = preset("llama-3-8b");
    m.layers = 2;  // a shorter stack of the same blocks
    kvw = m.kv_heads * m.head_dim;
    if (kvw == 0) kvw = (m.kv_heads ? m.kv_heads : m.heads) * (m.hidden / m.heads);
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.cat_peak[MN_CAT_KV_CACHE], 2 * 2 * tok * kvw * 4);
    s.checkpointing = MN_CKPT_FULL;
    CHECK_OK(mn_estimate(&m, &s, &r));
    CHECK_EQ_U64(r.cat_peak[MN_CAT_KV_CACHE], 0);
}

// peft's lora_dropout (p > 0): each LoRA module keeps a 1-byte mask and the dropped fp32 copy
// instead of its input. Llama fp32, LoRA on q and v, both reading the norm's output x, which no
// other op saves (the frozen base layers keep only their weights): per block and token the
// kept bytes change by 2 x (1 + 4) h - 4 h = 6 h. In the first block nothing upstream requires
// grad (frozen embedding), so autograd records no dropout and keeps no mask: 2 x 4 h - 4 h.
static void test_lora_dropout_by_hand(void) {
    mn_model m = preset("llama-3-8b");
    mn_setup s = setup0();
    uint64_t a[8], b[8], tok;
    uint32_t n = 0;
    m.layers = 2;
    s.batch = 1 + mnt_rand_u64() % 2, s.seq = 32 + mnt_rand_u64() % 200, s.no_replay = 1;
    s.lora_rank = 8 << (mnt_rand_u64() % 3);
    tok = s.batch * s.seq;
    CHECK_OK(mn_estimate_parts(&m, &s, a, 8, &n));
    s.lora_dropout = 0.05f + 0.5f * (float)(mnt_rand_u64() % 8) / 8.0f;
    CHECK_OK(mn_estimate_parts(&m, &s, b, 8, &n));
    CHECK_EQ_U64(n, 4);
    CHECK_EQ_U64(b[1] - a[1], 4 * tok * m.hidden);
    CHECK_EQ_U64(b[2] - a[2], 6 * tok * m.hidden);
    s.lora_dropout = 1.0f;
    CHECK_ERR(mn_estimate_parts(&m, &s, b, 8, &n), MN_ERR_INVALID_ARG);
}

// mn_estimate_explain: the groups add up to the simulated peak (the no-replay peak_allocated),
// sorted largest first, each group's bytes = count x bytes_each; a tiny cap truncates only.
static void test_explain(void) {
    int it;
    for (it = 0; it < 12; it++) {
        mn_model m = random_model();
        mn_setup s = random_setup();
        mn_estimate_result r;
        mn_explain_item items[256], few[2];
        uint32_t n = 0, n2 = 0, i;
        uint64_t peak = 0, peak2 = 0, sum = 0;
        s.no_replay = 1;
        // a random target set can name only projections this architecture lacks (refused)
        if (s.lora_rank && mn_estimate(&m, &s, &r) == MN_ERR_INVALID_ARG)
            s.lora_targets = MN_LORA_ALL;
        CHECK_OK(mn_estimate(&m, &s, &r));
        CHECK_OK(mn_estimate_explain(&m, &s, items, 256, &n, &peak));
        CHECK_EQ_U64(peak, r.peak_allocated);
        CHECK(n > 0 && n <= 256);
        for (i = 0; i < n && i < 256; i++) {
            sum += items[i].bytes;
            CHECK_EQ_U64(items[i].bytes, items[i].count * items[i].bytes_each);
            CHECK(items[i].mechanism != NULL);
            if (i) CHECK(items[i].bytes <= items[i - 1].bytes);
        }
        CHECK_EQ_U64(sum, peak);
        CHECK_OK(mn_estimate_explain(&m, &s, few, 2, &n2, &peak2));
        CHECK_EQ_U64(n2, n);
        CHECK_EQ_U64(few[0].bytes, items[0].bytes);
    }
    {
        mn_model m = preset("gpt2");
        mn_setup s = setup0();
        uint32_t n;
        uint64_t peak;
        CHECK_ERR(mn_estimate_explain(&m, &s, NULL, 4, &n, &peak), MN_ERR_INVALID_ARG);
        CHECK_ERR(mn_estimate_explain(NULL, &s, NULL, 0, &n, &peak), MN_ERR_INVALID_ARG);
    }
}

// In test/test_fitpaths.c (mn_fit's shortcuts against whole estimates).
void test_fit_decide_replay(void);
void test_fit_shortcuts_whole(void);
void test_fit_entry_below(void);
void test_fit_entry_cut(void);
void test_fit_plan_reference(void);
void test_estimate_retry(void);
void test_cache_direct(void);

const mnt_case test_estimate_cases[] = {
    {"explain", test_explain},
    {"torch2_by_hand", test_torch2_by_hand},
    {"lora_dropout_by_hand", test_lora_dropout_by_hand},
    {"parts_by_hand", test_parts_by_hand},
    {"param_counts", test_param_counts},
    {"estimate_replay", test_estimate_replay},
    {"bad_model_fields", test_bad_model_fields},
    {"estimate_replay_errors", test_estimate_replay_errors},
    {"preset_fields", test_preset_fields},
    {"bytes_per_param", test_bytes_per_param},
    {"seed_optimizer_figures", test_seed_optimizer_figures},
    {"zero_stages", test_zero_stages},
    {"seed_linear_stack", test_seed_linear_stack},
    {"kv_cache", test_kv_cache},
    {"properties", test_properties},
    {"zero_monotonic", test_zero_monotonic},
    {"fit", test_fit},
    {"fit_brute_force", test_fit_brute_force},
    {"fit_given_deferred", test_fit_given_deferred},
    {"fit_decide_replay", test_fit_decide_replay},
    {"fit_shortcuts_whole", test_fit_shortcuts_whole},
    {"fit_entry_below", test_fit_entry_below},
    {"fit_entry_cut", test_fit_entry_cut},
    {"fit_plan_reference", test_fit_plan_reference},
    {"estimate_retry", test_estimate_retry},
    {"cache_direct", test_cache_direct},
    {"bad_input", test_bad_input},
    {"setup_bounds", test_setup_bounds},
    {"random_setups", test_random_setups},
    {"trace_consistency", test_trace_consistency},
    {"id_reuse", test_id_reuse},
    {"alloc_failures", test_alloc_failures},
    {"presets_and_gpus", test_presets_and_gpus},
    {"gpu_table", test_gpu_table},
    {"names", test_names},
    {"no_silent_answers", test_no_silent_answers},
};
const size_t test_estimate_count = sizeof test_estimate_cases / sizeof test_estimate_cases[0];
