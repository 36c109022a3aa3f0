// Tests of the hfconfig section: config.json of each supported family -> mn_model, model
// folders with safetensors headers, and every error path. The sample configs in test/data/hf/
// are the published ones; the tiny model folders hold safetensors files of zeros whose headers
// are the test inputs.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "harness.h"
#include "../memanat.h"

static mn_result read_cfg(const char *path, mn_model *m, mnt_log *lc) {
    mn_hf_desc d;
    memset(&d, 0, sizeof d);
    memset(lc, 0, sizeof *lc);
    d.logger.log_fn = mnt_log_capture;
    d.logger.user_data = lc;
    memset(m, 0xab, sizeof *m);  // nothing may be left over
    return mn_hf_config_read(path, &d, m);
}

static mn_result parse_cfg(const char *text, mn_model *m, mnt_log *lc) {
    mn_hf_desc d;
    memset(&d, 0, sizeof d);
    memset(lc, 0, sizeof *lc);
    d.logger.log_fn = mnt_log_capture;
    d.logger.user_data = lc;
    memset(m, 0, sizeof *m);
    return mn_hf_config_parse(text, strlen(text), &d, m);
}

static void test_bert_large(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("../shared/validation/configs/bert-large-uncased.json", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_ENCODER);
    CHECK_EQ_U64(m.layers, 24);
    CHECK_EQ_U64(m.encoder_layers, 0);
    CHECK_EQ_U64(m.hidden, 1024);
    CHECK_EQ_U64(m.heads, 16);
    CHECK_EQ_U64(m.kv_heads, 16);
    CHECK_EQ_U64(m.head_dim, 0);
    CHECK_EQ_U64(m.ffn, 4096);
    CHECK_EQ_U64(m.vocab, 30522);
    CHECK_EQ_U64(m.max_positions, 512);
    CHECK_EQ_U64(m.type_vocab, 2);
    CHECK_EQ_INT(m.norm, MN_NORM_LAYERNORM);
    CHECK_EQ_INT(m.act, MN_ACT_GELU);
    CHECK_EQ_INT(m.posemb, MN_POS_LEARNED);
    CHECK_EQ_INT(m.head, MN_HEAD_LM);  // BertForMaskedLM
    CHECK_EQ_INT(m.gated_mlp, 0);
    CHECK_EQ_INT(m.tie_embeddings, 1);
    CHECK_EQ_INT(m.qkv_bias, 1);
    CHECK_EQ_INT(m.out_bias, 1);
    CHECK_EQ_INT(m.mlp_bias, 1);
    CHECK_EQ_INT(m.pooler, 0);
    CHECK_EQ_INT(m.final_norm, 0);
    CHECK_EQ_INT(m.embed_norm, 1);
    CHECK_EQ_INT(m.post_norm, 1);      // LayerNorm after each residual add
    CHECK_EQ_INT(m.lm_transform, 1);   // MLM head: dense + gelu + LayerNorm + decoder bias
    CHECK_NEAR(m.dropout, 0.1, 1e-7, 0);
    CHECK_NEAR(m.attn_dropout, 0.1, 1e-7, 0);
    CHECK_EQ_INT(m.dtype, MN_DTYPE_DEFAULT);
    CHECK_EQ_U64(m.params, 0);
    CHECK(m.stack == NULL && m.stack_len == 0);
    CHECK_STR(m.name, "bert-large-uncased");  // from the file name
    {
        uint64_t n = 0;  // BertForMaskedLM bert-large-uncased: 335,174,458 parameters
        CHECK_OK(mn_model_params(&m, &n));
        CHECK_EQ_U64(n, 335174458ull);
    }
}

static void test_gpt2_xl(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("../shared/validation/configs/gpt2-xl.json", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_DECODER);
    CHECK_EQ_U64(m.layers, 48);
    CHECK_EQ_U64(m.hidden, 1600);
    CHECK_EQ_U64(m.heads, 25);
    CHECK_EQ_U64(m.kv_heads, 25);
    CHECK_EQ_U64(m.ffn, 0);  // n_inner absent: 4 * hidden
    CHECK_EQ_U64(m.vocab, 50257);
    CHECK_EQ_U64(m.max_positions, 1024);
    CHECK_EQ_U64(m.type_vocab, 0);
    CHECK_EQ_INT(m.norm, MN_NORM_LAYERNORM);
    CHECK_EQ_INT(m.act, MN_ACT_GELU_NEW);
    CHECK_EQ_INT(m.posemb, MN_POS_LEARNED);
    CHECK_EQ_INT(m.head, MN_HEAD_LM);
    CHECK_EQ_INT(m.tie_embeddings, 1);
    CHECK_EQ_INT(m.qkv_bias && m.out_bias && m.mlp_bias, 1);
    CHECK_EQ_INT(m.final_norm, 1);
    CHECK_EQ_INT(m.embed_norm, 0);
    CHECK_EQ_INT(m.gated_mlp, 0);
    CHECK_NEAR(m.dropout, 0.1, 1e-7, 0);
    CHECK_NEAR(m.attn_dropout, 0.1, 1e-7, 0);
}

static void test_llama2_7b(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/llama-2-7b.json", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_DECODER);
    CHECK_EQ_U64(m.layers, 32);
    CHECK_EQ_U64(m.hidden, 4096);
    CHECK_EQ_U64(m.heads, 32);
    CHECK_EQ_U64(m.kv_heads, 32);
    CHECK_EQ_U64(m.head_dim, 0);
    CHECK_EQ_U64(m.ffn, 11008);
    CHECK_EQ_U64(m.vocab, 32000);
    CHECK_EQ_U64(m.max_positions, 4096);
    CHECK_EQ_INT(m.norm, MN_NORM_RMSNORM);
    CHECK_EQ_INT(m.act, MN_ACT_SILU);
    CHECK_EQ_INT(m.posemb, MN_POS_ROPE);
    CHECK_EQ_INT(m.head, MN_HEAD_LM);
    CHECK_EQ_INT(m.gated_mlp, 1);
    CHECK_EQ_INT(m.tie_embeddings, 0);
    CHECK_EQ_INT(m.qkv_bias + m.out_bias + m.mlp_bias, 0);
    CHECK_EQ_INT(m.final_norm, 1);
    CHECK_EQ_INT(m.embed_norm, 0);
    CHECK_EQ_INT(m.dtype, MN_FP16);
    CHECK(m.dropout == 0.0f && m.attn_dropout == 0.0f);
    CHECK_STR(m.name, "llama-2-7b");
}

static void test_llama3_8b(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/llama-3-8b.json", &m, &lc));
    CHECK_EQ_U64(m.layers, 32);
    CHECK_EQ_U64(m.hidden, 4096);
    CHECK_EQ_U64(m.heads, 32);
    CHECK_EQ_U64(m.kv_heads, 8);
    CHECK_EQ_U64(m.ffn, 14336);
    CHECK_EQ_U64(m.vocab, 128256);
    CHECK_EQ_U64(m.max_positions, 8192);
    CHECK_EQ_INT(m.tie_embeddings, 0);
    CHECK_EQ_INT(m.qkv_bias + m.out_bias + m.mlp_bias, 0);
    CHECK_EQ_INT(m.dtype, MN_BF16);
    CHECK_EQ_INT(m.gated_mlp, 1);
    CHECK_EQ_INT(m.posemb, MN_POS_ROPE);
}

static void test_qwen2_05b(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/qwen2-0.5b.json", &m, &lc));
    CHECK_EQ_U64(m.layers, 24);
    CHECK_EQ_U64(m.hidden, 896);
    CHECK_EQ_U64(m.heads, 14);
    CHECK_EQ_U64(m.kv_heads, 2);
    CHECK_EQ_U64(m.ffn, 4864);
    CHECK_EQ_U64(m.vocab, 151936);
    CHECK_EQ_U64(m.max_positions, 131072);
    CHECK_EQ_INT(m.tie_embeddings, 1);
    CHECK_EQ_INT(m.qkv_bias, 1);  // q, k, v biased, o and the MLP not
    CHECK_EQ_INT(m.out_bias, 0);
    CHECK_EQ_INT(m.mlp_bias, 0);
    CHECK_EQ_INT(m.norm, MN_NORM_RMSNORM);
    CHECK_EQ_INT(m.dtype, MN_BF16);
}

static void test_mistral_7b(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/mistral-7b.json", &m, &lc));
    CHECK_EQ_U64(m.layers, 32);
    CHECK_EQ_U64(m.hidden, 4096);
    CHECK_EQ_U64(m.heads, 32);
    CHECK_EQ_U64(m.kv_heads, 8);
    CHECK_EQ_U64(m.ffn, 14336);
    CHECK_EQ_U64(m.vocab, 32000);
    CHECK_EQ_U64(m.max_positions, 32768);
    CHECK_EQ_INT(m.tie_embeddings, 0);
    CHECK_EQ_INT(m.act, MN_ACT_SILU);
    CHECK_EQ_INT(m.gated_mlp, 1);
    CHECK_EQ_INT(m.dtype, MN_BF16);
}

static void test_starcoder(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/starcoder.json", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_DECODER);
    CHECK_EQ_U64(m.layers, 40);
    CHECK_EQ_U64(m.hidden, 6144);
    CHECK_EQ_U64(m.heads, 48);
    CHECK_EQ_U64(m.kv_heads, 1);  // multi-query
    CHECK_EQ_U64(m.ffn, 24576);
    CHECK_EQ_U64(m.vocab, 49152);
    CHECK_EQ_U64(m.max_positions, 8192);
    CHECK_EQ_INT(m.act, MN_ACT_GELU);
    CHECK_EQ_INT(m.posemb, MN_POS_LEARNED);
    CHECK_EQ_INT(m.norm, MN_NORM_LAYERNORM);
    CHECK_EQ_INT(m.qkv_bias && m.out_bias && m.mlp_bias, 1);
    CHECK_EQ_INT(m.tie_embeddings, 1);
    CHECK_EQ_INT(m.final_norm, 1);
    CHECK_EQ_INT(m.dtype, MN_FP32);
    CHECK_NEAR(m.dropout, 0.1, 1e-7, 0);
}

static void test_t5_base(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/t5-base.json", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_ENCODER_DECODER);
    CHECK_EQ_U64(m.layers, 12);  // num_decoder_layers defaults to num_layers
    CHECK_EQ_U64(m.encoder_layers, 12);
    CHECK_EQ_U64(m.hidden, 768);
    CHECK_EQ_U64(m.heads, 12);
    CHECK_EQ_U64(m.kv_heads, 12);
    CHECK_EQ_U64(m.head_dim, 64);
    CHECK_EQ_U64(m.ffn, 3072);
    CHECK_EQ_U64(m.vocab, 32128);
    CHECK_EQ_U64(m.rel_buckets, 32);
    CHECK_EQ_U64(m.max_positions, 0);
    CHECK_EQ_INT(m.norm, MN_NORM_RMSNORM);
    CHECK_EQ_INT(m.posemb, MN_POS_RELATIVE);
    CHECK_EQ_INT(m.act, MN_ACT_RELU);
    CHECK_EQ_INT(m.gated_mlp, 0);
    CHECK_EQ_INT(m.tie_embeddings, 1);
    CHECK_EQ_INT(m.qkv_bias + m.out_bias + m.mlp_bias + m.embed_norm, 0);
    CHECK_EQ_INT(m.final_norm, 1);
    CHECK_EQ_INT(m.head, MN_HEAD_LM);
    CHECK_NEAR(m.dropout, 0.1, 1e-7, 0);
    CHECK_NEAR(m.attn_dropout, 0.1, 1e-7, 0);
}

static void test_flan_t5(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/flan-t5-base.json", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_ENCODER_DECODER);
    CHECK_EQ_U64(m.layers, 12);
    CHECK_EQ_U64(m.encoder_layers, 12);
    CHECK_EQ_U64(m.ffn, 2048);
    CHECK_EQ_INT(m.gated_mlp, 1);
    CHECK_EQ_INT(m.act, MN_ACT_GELU_NEW);  // gated-gelu is gelu_new
    CHECK_EQ_INT(m.tie_embeddings, 0);
    CHECK_EQ_INT(m.dtype, MN_FP32);
}

static void test_distilbert_classifier(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/distilbert-sst2.json", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_ENCODER);
    CHECK_EQ_U64(m.layers, 6);
    CHECK_EQ_U64(m.hidden, 768);
    CHECK_EQ_U64(m.heads, 12);
    CHECK_EQ_U64(m.ffn, 3072);
    CHECK_EQ_U64(m.type_vocab, 0);
    CHECK_EQ_INT(m.head, MN_HEAD_CLASSIFICATION);
    CHECK_EQ_U64(m.num_labels, 2);
    CHECK_EQ_INT(m.pooler, 1);  // pre_classifier
    CHECK_EQ_INT(m.embed_norm, 1);
}

static void test_gemma_2b(void) {
    mn_model m;
    mnt_log lc;
    CHECK_OK(read_cfg("test/data/hf/gemma-2b.json", &m, &lc));
    CHECK_EQ_U64(m.layers, 18);
    CHECK_EQ_U64(m.hidden, 2048);
    CHECK_EQ_U64(m.heads, 8);
    CHECK_EQ_U64(m.kv_heads, 1);
    CHECK_EQ_U64(m.head_dim, 256);
    CHECK_EQ_U64(m.ffn, 16384);
    CHECK_EQ_U64(m.vocab, 256000);
    CHECK_EQ_INT(m.tie_embeddings, 1);
    CHECK_EQ_INT(m.act, MN_ACT_GELU_TANH);  // hidden_activation unset: gelu_pytorch_tanh
    CHECK_EQ_INT(m.gated_mlp, 1);
}

// Absent keys take the defaults of the transformers configuration classes.
static void test_defaults(void) {
    static const struct {
        const char *json;
        uint64_t layers, hidden, heads, kv_heads, head_dim, ffn, vocab;
        int tie;
    } cases[] = {
        {"{\"model_type\":\"bert\"}", 12, 768, 12, 12, 0, 3072, 30522, 1},
        {"{\"model_type\":\"roberta\"}", 12, 768, 12, 12, 0, 3072, 30522, 1},
        {"{\"model_type\":\"distilbert\"}", 6, 768, 12, 12, 0, 3072, 30522, 1},
        {"{\"model_type\":\"gpt2\"}", 12, 768, 12, 12, 0, 0, 50257, 1},
        {"{\"model_type\":\"gpt_bigcode\"}", 12, 768, 12, 1, 0, 0, 50257, 1},
        {"{\"model_type\":\"gpt_bigcode\",\"multi_query\":false}", 12, 768, 12, 12, 0, 0, 50257, 1},
        {"{\"model_type\":\"llama\"}", 32, 4096, 32, 32, 0, 11008, 32000, 0},
        {"{\"model_type\":\"llama\",\"num_key_value_heads\":null}", 32, 4096, 32, 32, 0, 11008,
         32000, 0},
        {"{\"model_type\":\"mistral\"}", 32, 4096, 32, 8, 0, 14336, 32000, 0},
        {"{\"model_type\":\"qwen2\"}", 32, 4096, 32, 32, 0, 22016, 151936, 0},
        {"{\"model_type\":\"qwen3\"}", 32, 4096, 32, 32, 128, 22016, 151936, 0},
        {"{\"model_type\":\"gemma\"}", 28, 3072, 16, 16, 256, 24576, 256000, 1},
        {"{\"model_type\":\"gemma2\"}", 26, 2304, 8, 4, 256, 9216, 256000, 1},
        {"{\"model_type\":\"phi3\"}", 32, 3072, 32, 32, 0, 8192, 32064, 0},
        {"{\"model_type\":\"starcoder2\"}", 30, 3072, 24, 2, 0, 12288, 49152, 1},
        {"{\"model_type\":\"t5\"}", 6, 512, 8, 8, 64, 2048, 32128, 1},
        {"{\"model_type\":\"mt5\"}", 8, 512, 6, 6, 64, 1024, 250112, 0},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mn_model m;
        mnt_log lc;
        int r = (int)parse_cfg(cases[k].json, &m, &lc);
        CHECK_MSG(r == MN_OK, "%s: result %d (%s)", cases[k].json, r, lc.last);
        CHECK_MSG(m.layers == cases[k].layers && m.hidden == cases[k].hidden &&
                      m.heads == cases[k].heads && m.kv_heads == cases[k].kv_heads &&
                      m.head_dim == cases[k].head_dim && m.ffn == cases[k].ffn &&
                      m.vocab == cases[k].vocab && m.tie_embeddings == cases[k].tie,
                  "%s: got L%llu h%llu a%llu kv%llu hd%llu ffn%llu V%llu tie%d", cases[k].json,
                  (unsigned long long)m.layers, (unsigned long long)m.hidden,
                  (unsigned long long)m.heads, (unsigned long long)m.kv_heads,
                  (unsigned long long)m.head_dim, (unsigned long long)m.ffn,
                  (unsigned long long)m.vocab, m.tie_embeddings);
    }
}

static void test_families(void) {
    mn_model m;
    mnt_log lc;
    // starcoder2: LayerNorm, plain biased MLP, rope
    CHECK_OK(parse_cfg("{\"model_type\":\"starcoder2\",\"use_bias\":true}", &m, &lc));
    CHECK_EQ_INT(m.norm, MN_NORM_LAYERNORM);
    CHECK_EQ_INT(m.gated_mlp, 0);
    CHECK_EQ_INT(m.posemb, MN_POS_ROPE);
    CHECK_EQ_INT(m.qkv_bias + m.out_bias + m.mlp_bias, 3);
    CHECK_EQ_INT(m.act, MN_ACT_GELU_TANH);
    // llama attention_bias / mlp_bias
    CHECK_OK(
        parse_cfg("{\"model_type\":\"llama\",\"attention_bias\":true,\"mlp_bias\":true}", &m, &lc));
    CHECK_EQ_INT(m.qkv_bias + m.out_bias + m.mlp_bias, 3);
    // explicit head_dim need not divide the width
    CHECK_OK(
        parse_cfg("{\"model_type\":\"mistral\",\"hidden_size\":5120,\"num_attention_heads\":32,"
                  "\"head_dim\":128}",
                  &m, &lc));
    CHECK_EQ_U64(m.head_dim, 128);
    // phi3 dropouts
    CHECK_OK(parse_cfg("{\"model_type\":\"phi3\",\"resid_pdrop\":0.1,\"attention_dropout\":0.2}",
                       &m, &lc));
    CHECK_NEAR(m.dropout, 0.1, 1e-7, 0);
    CHECK_NEAR(m.attn_dropout, 0.2, 1e-7, 0);
    // modeling_phi3.py: one qkv_proj and one gate_up_proj; RoPE concatenates the pass-through
    CHECK_EQ_INT(m.fused_proj, 1);
    CHECK_EQ_INT(m.rope_cat, 1);
    CHECK_OK(parse_cfg("{\"model_type\":\"llama\"}", &m, &lc));
    CHECK_EQ_INT(m.fused_proj + m.rope_cat, 0);
    // t5: num_decoder_layers apart, d_kv independent of d_model (t5-3b style)
    CHECK_OK(parse_cfg(
        "{\"model_type\":\"t5\",\"d_model\":1024,\"num_heads\":32,\"d_kv\":128,"
        "\"num_layers\":24,\"num_decoder_layers\":6,\"feed_forward_proj\":\"gated-silu\"}",
        &m, &lc));
    CHECK_EQ_U64(m.encoder_layers, 24);
    CHECK_EQ_U64(m.layers, 6);
    CHECK_EQ_U64(m.head_dim, 128);
    CHECK_EQ_INT(m.gated_mlp, 1);
    CHECK_EQ_INT(m.act, MN_ACT_SILU);
    // T5 encoder only
    CHECK_OK(parse_cfg("{\"model_type\":\"t5\",\"architectures\":[\"T5EncoderModel\"]}", &m, &lc));
    CHECK_EQ_INT(m.arch, MN_ARCH_ENCODER);
    CHECK_EQ_U64(m.layers, 6);
    CHECK_EQ_U64(m.encoder_layers, 0);
    CHECK_EQ_INT(m.head, MN_HEAD_NONE);
    // heads from architectures
    CHECK_OK(
        parse_cfg("{\"model_type\":\"bert\",\"architectures\":[\"BertForSequenceClassification\"],"
                  "\"id2label\":{\"0\":\"a\",\"1\":\"b\",\"2\":\"c\"}}",
                  &m, &lc));
    CHECK_EQ_INT(m.head, MN_HEAD_CLASSIFICATION);
    CHECK_EQ_U64(m.num_labels, 3);
    CHECK_EQ_INT(m.pooler, 1);
    CHECK_OK(
        parse_cfg("{\"model_type\":\"bert\",\"architectures\":[\"BertForSequenceClassification\"],"
                  "\"num_labels\":5}",
                  &m, &lc));
    CHECK_EQ_U64(m.num_labels, 5);
    CHECK_OK(parse_cfg(
        "{\"model_type\":\"roberta\",\"architectures\":[\"RobertaForSequenceClassification\"]}", &m,
        &lc));
    CHECK_EQ_U64(m.num_labels, 2);
    CHECK_EQ_INT(m.pooler, 1);
    CHECK_OK(parse_cfg("{\"model_type\":\"bert\",\"architectures\":[\"BertModel\"]}", &m, &lc));
    CHECK_EQ_INT(m.head, MN_HEAD_NONE);
    CHECK_OK(
        parse_cfg("{\"model_type\":\"gpt2\",\"architectures\":[\"GPT2ForSequenceClassification\"]}",
                  &m, &lc));
    CHECK_EQ_INT(m.head, MN_HEAD_CLASSIFICATION);
    CHECK_EQ_INT(m.pooler, 0);
    CHECK_OK(parse_cfg("{\"model_type\":\"llama\",\"architectures\":[\"LlamaModel\"]}", &m, &lc));
    CHECK_EQ_INT(m.head, MN_HEAD_NONE);
    CHECK_OK(parse_cfg(
        "{\"model_type\":\"llama\",\"architectures\":[\"LlamaForTokenClassification\"]}", &m, &lc));
    CHECK_EQ_INT(m.head, MN_HEAD_CLASSIFICATION);
    CHECK_EQ_INT(lc.warnings, 1);
    CHECK_OK(parse_cfg("{\"model_type\":\"llama\",\"architectures\":[]}", &m, &lc));
    CHECK_EQ_INT(m.head, MN_HEAD_LM);
    // dtype spellings, name
    CHECK_OK(parse_cfg(
        "{\"model_type\":\"llama\",\"dtype\":\"bfloat16\",\"_name_or_path\":\"x/y\"}", &m, &lc));
    CHECK_EQ_INT(m.dtype, MN_BF16);
    CHECK_STR(m.name, "x/y");
    // a long name is cut at a UTF-8 character boundary
    CHECK_OK(parse_cfg("{\"model_type\":\"llama\",\"_name_or_path\":"
                       "\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                       "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\u00e9\u00e9\"}",
                       &m, &lc));
    CHECK_EQ_U64(strlen(m.name), 62);
    CHECK_OK(parse_cfg("{\"model_type\":\"llama\",\"torch_dtype\":\"auto\"}", &m, &lc));
    CHECK_EQ_INT(m.dtype, MN_DTYPE_DEFAULT);
    CHECK_OK(parse_cfg("{\"model_type\":\"llama\",\"torch_dtype\":null}", &m, &lc));
    // integral floats are integers
    CHECK_OK(parse_cfg("{\"model_type\":\"llama\",\"num_hidden_layers\":4.0e1}", &m, &lc));
    CHECK_EQ_U64(m.layers, 40);
}

// Each error path: the result code and a logged message naming the key or value.
static void test_errors(void) {
    static const struct {
        const char *json;
        int r;
        const char *names;
    } bad[] = {
        {"{\"model_type\":\"bert\"", MN_ERR_PARSE, "line 1"},
        {"{\"model_type\":\"bert\",}", MN_ERR_PARSE, "trailing comma"},
        {"[]", MN_ERR_INVALID_ARG, "object"},
        {"{}", MN_ERR_INVALID_ARG, "model_type"},
        {"{\"model_type\":7}", MN_ERR_INVALID_ARG, "model_type"},
        {"{\"model_type\":\"bloom\"}", MN_ERR_UNSUPPORTED, "bloom"},
        {"{\"model_type\":\"mixtral\"}", MN_ERR_UNSUPPORTED, "MoE"},
        {"{\"model_type\":\"qwen2_moe\"}", MN_ERR_UNSUPPORTED, "MoE"},
        {"{\"model_type\":\"llama\",\"num_local_experts\":8}", MN_ERR_UNSUPPORTED, "MoE"},
        {"{\"model_type\":\"llama\",\"num_hidden_layers\":0}", MN_ERR_INVALID_ARG,
         "num_hidden_layers"},
        {"{\"model_type\":\"llama\",\"num_hidden_layers\":10001}", MN_ERR_INVALID_ARG,
         "num_hidden_layers"},
        {"{\"model_type\":\"llama\",\"num_hidden_layers\":-2}", MN_ERR_INVALID_ARG,
         "num_hidden_layers"},
        {"{\"model_type\":\"llama\",\"num_hidden_layers\":2.5}", MN_ERR_INVALID_ARG,
         "num_hidden_layers"},
        {"{\"model_type\":\"llama\",\"num_hidden_layers\":\"32\"}", MN_ERR_INVALID_ARG,
         "num_hidden_layers"},
        {"{\"model_type\":\"llama\",\"num_hidden_layers\":1e30}", MN_ERR_INVALID_ARG,
         "num_hidden_layers"},
        {"{\"model_type\":\"llama\",\"hidden_size\":2000000}", MN_ERR_INVALID_ARG, "hidden_size"},
        {"{\"model_type\":\"llama\",\"hidden_size\":4001}", MN_ERR_INVALID_ARG,
         "num_attention_heads"},
        {"{\"model_type\":\"llama\",\"num_key_value_heads\":5}", MN_ERR_INVALID_ARG,
         "num_key_value_heads"},
        {"{\"model_type\":\"llama\",\"num_key_value_heads\":64}", MN_ERR_INVALID_ARG,
         "num_key_value_heads"},
        {"{\"model_type\":\"llama\",\"num_key_value_heads\":0}", MN_ERR_INVALID_ARG,
         "num_key_value_heads"},
        {"{\"model_type\":\"llama\",\"vocab_size\":0}", MN_ERR_INVALID_ARG, "vocab_size"},
        {"{\"model_type\":\"llama\",\"intermediate_size\":0}", MN_ERR_INVALID_ARG,
         "intermediate_size"},
        {"{\"model_type\":\"llama\",\"head_dim\":0}", MN_ERR_INVALID_ARG, "head_dim"},
        {"{\"model_type\":\"llama\",\"hidden_act\":\"tanh\"}", MN_ERR_UNSUPPORTED, "hidden_act"},
        {"{\"model_type\":\"llama\",\"hidden_act\":1}", MN_ERR_INVALID_ARG, "hidden_act"},
        {"{\"model_type\":\"llama\",\"tie_word_embeddings\":1}", MN_ERR_INVALID_ARG,
         "tie_word_embeddings"},
        {"{\"model_type\":\"llama\",\"attention_dropout\":1.5}", MN_ERR_INVALID_ARG,
         "attention_dropout"},
        {"{\"model_type\":\"llama\",\"attention_dropout\":-0.1}", MN_ERR_INVALID_ARG,
         "attention_dropout"},
        {"{\"model_type\":\"llama\",\"torch_dtype\":\"float64\"}", MN_ERR_UNSUPPORTED, "float64"},
        {"{\"model_type\":\"llama\",\"torch_dtype\":16}", MN_ERR_INVALID_ARG, "torch_dtype"},
        {"{\"model_type\":\"llama\",\"architectures\":\"LlamaForCausalLM\"}", MN_ERR_INVALID_ARG,
         "architectures"},
        {"{\"model_type\":\"llama\",\"architectures\":[3]}", MN_ERR_INVALID_ARG, "architectures"},
        {"{\"model_type\":\"bert\",\"architectures\":[\"BertForSequenceClassification\"],\"num_"
         "labels\":0}",
         MN_ERR_INVALID_ARG, "num_labels"},
        {"{\"model_type\":\"bert\",\"hidden_dropout_prob\":\"0.1\"}", MN_ERR_INVALID_ARG,
         "hidden_dropout_prob"},
        {"{\"model_type\":\"bert\",\"num_attention_heads\":7}", MN_ERR_INVALID_ARG,
         "num_attention_heads"},
        {"{\"model_type\":\"gpt2\",\"n_head\":0}", MN_ERR_INVALID_ARG, "n_head"},
        {"{\"model_type\":\"gpt2\",\"n_inner\":0}", MN_ERR_INVALID_ARG, "n_inner"},
        {"{\"model_type\":\"gpt_bigcode\",\"multi_query\":\"yes\"}", MN_ERR_INVALID_ARG,
         "multi_query"},
        {"{\"model_type\":\"t5\",\"feed_forward_proj\":\"gated-gelu-x\"}", MN_ERR_INVALID_ARG,
         "feed_forward_proj"},
        {"{\"model_type\":\"t5\",\"feed_forward_proj\":\"ungated-gelu\"}", MN_ERR_INVALID_ARG,
         "feed_forward_proj"},
        {"{\"model_type\":\"t5\",\"feed_forward_proj\":\"tanh\"}", MN_ERR_UNSUPPORTED,
         "feed_forward_proj"},
        {"{\"model_type\":\"t5\",\"num_decoder_layers\":0}", MN_ERR_INVALID_ARG,
         "num_decoder_layers"},
        {"{\"model_type\":\"t5\",\"d_kv\":0}", MN_ERR_INVALID_ARG, "d_kv"},
        {"{\"model_type\":\"t5\",\"dropout_rate\":1}", MN_ERR_INVALID_ARG, "dropout_rate"},
        {"{\"model_type\":\"distilbert\",\"n_layers\":100000}", MN_ERR_INVALID_ARG, "n_layers"},
        {"{\"model_type\":\"llama\",\"model_type\":\"bert\"}", MN_ERR_PARSE, "model_type"},
    };
    size_t k;
    for (k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        mn_model m;
        mnt_log lc;
        int r;
        memset(&m, 0x5a, sizeof m);
        r = (int)parse_cfg(bad[k].json, &m, &lc);
        CHECK_MSG(r == bad[k].r, "%s: result %d want %d (%s)", bad[k].json, r, bad[k].r, lc.last);
        CHECK_MSG(lc.errors == 1 && strstr(lc.last, bad[k].names) != NULL,
                  "%s: message does not name %s: %s", bad[k].json, bad[k].names, lc.last);
    }
    {
        mn_model m;
        CHECK_ERR(mn_hf_config_parse("{}", 2, NULL, NULL), MN_ERR_INVALID_ARG);
        CHECK_ERR(mn_hf_config_parse(NULL, 2, NULL, &m), MN_ERR_INVALID_ARG);
        CHECK_ERR(mn_hf_config_parse("{}", 2, NULL, &m), MN_ERR_INVALID_ARG);  // silent: no logger
    }
}

static void test_folders(void) {
    mn_model m;
    mnt_log lc;
    mn_hf_desc d;
    CHECK_OK(read_cfg("test/data/hf/tiny-llama", &m, &lc));
    CHECK_EQ_U64(m.params, 6736);
    CHECK_EQ_INT(m.dtype, MN_BF16);  // from the weights, not torch_dtype
    CHECK_EQ_U64(m.layers, 2);
    CHECK_EQ_U64(m.kv_heads, 2);
    CHECK_STR(m.name, "tiny-llama");
    CHECK_OK(read_cfg("test/data/hf/tiny-llama/", &m, &lc));
    CHECK_EQ_U64(m.params, 6736);
    CHECK_STR(m.name, "tiny-llama");
    CHECK_OK(read_cfg("test/data/hf/tiny-llama/config.json", &m, &lc));
    CHECK_EQ_INT(lc.errors + lc.warnings, 0);
    CHECK_STR(m.name, "tiny-llama");
    CHECK_EQ_U64(m.params, 0);
    CHECK_EQ_INT(m.dtype, MN_FP32);
    CHECK_OK(read_cfg("test/data/hf/tiny-gpt2", &m, &lc));
    CHECK_EQ_U64(m.params, 1272);  // attention-mask buffer not counted
    CHECK_EQ_INT(m.dtype, MN_FP32);
    memset(&d, 0, sizeof d);
    d.no_safetensors = 1;
    CHECK_OK(mn_hf_config_read("test/data/hf/tiny-gpt2", &d, &m));
    CHECK_EQ_U64(m.params, 0);
    CHECK_OK(read_cfg("test/data/hf/config-only", &m, &lc));
    CHECK_EQ_U64(m.params, 0);
    CHECK_EQ_U64(m.hidden, 64);
    CHECK_STR(m.name, "config-only");
    CHECK_EQ_INT(lc.errors + lc.warnings, 0);  // no weights is not an error
    CHECK_OK(read_cfg("test/data/hf/tiny-quant", &m, &lc));
    CHECK_EQ_U64(m.params, 0);  // packed weights: the shape gives the count
    CHECK_EQ_INT(lc.warnings, 1);
    CHECK_ERR(read_cfg("test/data/hf/bad-shard", &m, &lc), MN_ERR_PARSE);
    CHECK(lc.errors >= 1);
    CHECK_ERR(read_cfg("test/data/hf/missing-shard", &m, &lc), MN_ERR_IO);
    CHECK_EQ_INT(lc.errors, 1);
    CHECK(strstr(lc.last, "model-00001-of-00001.safetensors") != NULL);
    CHECK_ERR(read_cfg("test/data/hf/nonexistent", &m, &lc), MN_ERR_NOT_FOUND);
    CHECK(strstr(lc.last, "nonexistent") != NULL);
    CHECK_ERR(read_cfg("test/data/hf/missing.json", &m, &lc), MN_ERR_NOT_FOUND);
    CHECK_ERR(read_cfg("test/data/hf/tiny-gpt2/model.safetensors", &m, &lc), MN_ERR_PARSE);
    CHECK_ERR(mn_hf_config_read(NULL, NULL, &m), MN_ERR_INVALID_ARG);
}

// The mapped shapes give the published parameter counts (model cards / num_parameters()).
static void test_published_counts(void) {
    static const struct {
        const char *path;
        uint64_t params;
    } cases[] = {
        {"test/data/hf/llama-2-7b.json", 6738415616ull},
        {"test/data/hf/llama-3-8b.json", 8030261248ull},
        {"test/data/hf/mistral-7b.json", 7241732096ull},
        {"test/data/hf/qwen2-0.5b.json", 494032768ull},
        {"test/data/hf/gemma-2b.json", 2506172416ull},
        {"test/data/hf/starcoder.json", 15517456384ull},
        {"test/data/hf/t5-base.json", 222903552ull},
        {"test/data/hf/flan-t5-base.json", 247577856ull},
        {"test/data/hf/distilbert-sst2.json", 66955010ull},
        {"../shared/validation/configs/gpt2-xl.json", 1557611200ull},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mn_model m;
        mnt_log lc;
        uint64_t n = 0;
        CHECK_OK(read_cfg(cases[k].path, &m, &lc));
        CHECK_OK(mn_model_params(&m, &n));
        CHECK_MSG(n == cases[k].params, "%s: %llu parameters, published %llu", cases[k].path,
                  (unsigned long long)n, (unsigned long long)cases[k].params);
    }
    {
        // classification heads: bert-base-uncased and roberta-base with a 2-label head
        mn_model m;
        mnt_log lc;
        uint64_t n = 0;
        CHECK_OK(parse_cfg("{\"model_type\":\"bert\","
                           "\"architectures\":[\"BertForSequenceClassification\"]}",
                           &m, &lc));
        CHECK_OK(mn_model_params(&m, &n));
        CHECK_EQ_U64(n, 109483778ull);
        CHECK_OK(parse_cfg("{\"model_type\":\"roberta\",\"vocab_size\":50265,"
                           "\"max_position_embeddings\":514,\"type_vocab_size\":1,"
                           "\"architectures\":[\"RobertaForSequenceClassification\"]}",
                           &m, &lc));
        CHECK_OK(mn_model_params(&m, &n));
        CHECK_EQ_U64(n, 124647170ull);
    }
}

// A folder whose safetensors files disagree with its config.json: tiny-gpt2's weights (1272
// parameters) beside a config of two layers (more than the files hold: the shape's count is
// used) or a wider vocabulary... each case is said in one warning, never silently.
static void copy_file(const char *from, const char *to) {
    static char buf[1 << 16];
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    size_t n;
    CHECK(a && b);
    while (a && b && (n = fread(buf, 1, sizeof buf, a)) > 0) CHECK(fwrite(buf, 1, n, b) == n);
    if (a) fclose(a);
    if (b) fclose(b);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) fputs(text, f), fclose(f);
}

static void test_count_disagrees(void) {
    char dir[] = "/tmp/memanat_hf_XXXXXX", cfg[128], st[128];
    mn_model m;
    mnt_log lc;
    uint64_t shape = 0;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    copy_file("test/data/hf/tiny-gpt2/model.safetensors", st);
    // two layers: the shape holds more than the 1272 parameters in the file
    write_text(cfg, "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2,"
                    " \"n_positions\": 16, \"vocab_size\": 32}");
    CHECK_OK(read_cfg(dir, &m, &lc));
    CHECK_EQ_INT(lc.warnings, 1);
    CHECK_EQ_U64(m.params, 0);  // the shape's count
    CHECK_OK(mn_model_params(&m, &shape));
    CHECK(shape > 1272);
    // the matching config: no warning, the file's count
    copy_file("test/data/hf/tiny-gpt2/config.json", cfg);
    CHECK_OK(read_cfg(dir, &m, &lc));
    CHECK_EQ_INT(lc.warnings, 0);
    CHECK_EQ_U64(m.params, 1272);
    // a smaller vocabulary: the file holds more than the shape; the extra is said and kept
    write_text(cfg, "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_layer\": 1, \"n_head\": 2,"
                    " \"n_positions\": 16, \"vocab_size\": 8}");
    CHECK_OK(read_cfg(dir, &m, &lc));
    CHECK_EQ_INT(lc.warnings, 1);
    CHECK_EQ_U64(m.params, 1272);
    remove(cfg), remove(st), rmdir(dir);
}

static mn_result read_tiny_llama(void *ctx) {
    mn_model m;
    mn_result r = mn_hf_config_read("test/data/hf/tiny-llama", NULL, &m);
    (void)ctx;
    if (r == MN_OK) CHECK_EQ_U64(m.params, 6736);
    return r;
}

static void test_alloc_failure(void) { WALK_ALLOC_FAILURES(read_tiny_llama, NULL, 199); }

const mnt_case test_hfconfig_cases[] = {
    {"bert_large_uncased", test_bert_large},
    {"gpt2_xl", test_gpt2_xl},
    {"llama_2_7b", test_llama2_7b},
    {"llama_3_8b", test_llama3_8b},
    {"qwen2_0_5b", test_qwen2_05b},
    {"mistral_7b", test_mistral_7b},
    {"starcoder", test_starcoder},
    {"t5_base", test_t5_base},
    {"flan_t5_base", test_flan_t5},
    {"distilbert_classifier", test_distilbert_classifier},
    {"gemma_2b", test_gemma_2b},
    {"defaults", test_defaults},
    {"families_and_heads", test_families},
    {"errors", test_errors},
    {"model_folders", test_folders},
    {"count_disagrees", test_count_disagrees},
    {"published_param_counts", test_published_counts},
    {"alloc_failure", test_alloc_failure},
};
const size_t test_hfconfig_count = sizeof test_hfconfig_cases / sizeof test_hfconfig_cases[0];
