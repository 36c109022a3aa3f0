// >>hfconfig ------------------------------------------------------------------------------------
//
// Hugging Face config.json -> mn_model. Each supported model_type is mapped with the defaults of
// its transformers configuration class (configuration_<type>.py) for absent keys, so a config
// that relies on a default reads the same as the Python library builds it. Supported types:
// bert, roberta, xlm-roberta, distilbert, gpt2, gpt_bigcode, llama, mistral, qwen2, qwen3,
// gemma, gemma2, phi3, starcoder2, t5, mt5. Mixture-of-experts types (mixtral, qwen2_moe, ...)
// give MN_ERR_UNSUPPORTED.

typedef struct mn_hf_desc {
    mn_allocator allocator;
    mn_logger logger;      // errors name the key and the value; warnings for approximations
    int no_safetensors;    // 1 = a model folder's safetensors headers are not read
} mn_hf_desc;

// out->name is "_name_or_path" when the config has one, else the file or folder name
// (mn_hf_config_read), else model_type. Heads come from architectures[0]: *ForCausalLM,
// *LMHeadModel, *ForConditionalGeneration, *ForMaskedLM -> MN_HEAD_LM, *ForSequenceClassification
// -> MN_HEAD_CLASSIFICATION (num_labels from id2label or num_labels, default 2), *Model ->
// MN_HEAD_NONE; no architectures -> MN_HEAD_LM.
//
// mn_hf_config_parse maps the text of a config.json. Unknown model_type or MoE:
// MN_ERR_UNSUPPORTED; missing or mistyped keys, zero/negative/absurd values: MN_ERR_INVALID_ARG;
// broken JSON: MN_ERR_PARSE; each with one logger line naming the problem. out is written only
// on success.
MNDEF mn_result mn_hf_config_parse(const char *text, size_t len, const mn_hf_desc *desc,
                                   mn_model *out);
// path is a config.json file or a model folder. A folder gives its config.json, and when
// safetensors headers are present (model.safetensors.index.json or model.safetensors), the exact
// parameter count (out->params) and the dominant dtype (out->dtype). MN_ERR_NOT_FOUND /
// MN_ERR_IO when the config cannot be read.
MNDEF mn_result mn_hf_config_read(const char *path, const mn_hf_desc *desc, mn_model *out);
