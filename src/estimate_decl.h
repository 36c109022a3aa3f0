// >>estimate ------------------------------------------------------------------------------------
//
// A model is a list of layers; a transformer is built into that list from its shape. The
// estimator runs one training step (or a generation) symbolically, the way autograd runs it:
// every op allocates its output, keeps what its backward needs, and frees the rest. The
// resulting allocation sequence gives the peak allocated bytes and, replayed through the caching
// allocator on a simulated device, the peak reserved bytes.

typedef enum mn_arch {
    MN_ARCH_DEFAULT = 0,       // decoder
    MN_ARCH_DECODER,           // GPT-2, Llama, Mistral, Qwen, StarCoder
    MN_ARCH_ENCODER,           // BERT
    MN_ARCH_ENCODER_DECODER,   // T5
    MN_ARCH_STACK,             // a custom list of layers (mn_model.stack)
    MN_ARCH_COUNT
} mn_arch;

typedef enum mn_norm { MN_NORM_DEFAULT = 0, MN_NORM_LAYERNORM, MN_NORM_RMSNORM, MN_NORM_COUNT } mn_norm;
typedef enum mn_act {
    MN_ACT_DEFAULT = 0,  // gelu, or silu with a gated MLP
    MN_ACT_GELU,
    MN_ACT_GELU_TANH,
    MN_ACT_RELU,
    MN_ACT_SILU,
    MN_ACT_GELU_NEW,     // tanh approximation written as separate ops (HF "gelu_new": GPT-2, T5 v1.1)
    MN_ACT_COUNT
} mn_act;
typedef enum mn_posemb {
    MN_POS_DEFAULT = 0,  // learned
    MN_POS_LEARNED,      // absolute position table (BERT, GPT-2, StarCoder)
    MN_POS_ROPE,         // rotary, no parameters (Llama, Mistral, Qwen)
    MN_POS_RELATIVE,     // T5 relative attention bias (buckets x heads, first block of each stack)
    MN_POS_NONE,
    MN_POS_COUNT
} mn_posemb;
typedef enum mn_head {
    MN_HEAD_DEFAULT = 0,     // lm
    MN_HEAD_LM,              // vocabulary projection + cross-entropy over every token
    MN_HEAD_CLASSIFICATION,  // (pooler) + num_labels classifier on the first token
    MN_HEAD_NONE,            // bare model, loss on the hidden states
    MN_HEAD_COUNT
} mn_head;

// One layer of a custom stack.
typedef enum mn_layer_kind {
    MN_LAYER_DEFAULT = 0,
    MN_LAYER_LINEAR,      // y = x W^T (+ b): in -> out features
    MN_LAYER_EMBEDDING,   // rows = in, width = out
    MN_LAYER_NORM,        // layernorm over out features
    MN_LAYER_ACTIVATION,  // gelu over out features
    MN_LAYER_DROPOUT,     // keeps a 1-byte mask
    MN_LAYER_COUNT
} mn_layer_kind;

typedef struct mn_layer {
    mn_layer_kind kind;
    uint64_t in, out;      // features
    int bias;              // linear: has a bias
    uint32_t shared_with;  // 1-based index of an earlier layer whose weights this one reuses, 0 = own
} mn_layer;

typedef struct mn_model {
    char name[64];
    mn_arch arch;             // 0 = decoder
    uint64_t layers;          // transformer blocks (decoder blocks of an encoder-decoder)
    uint64_t encoder_layers;  // encoder-decoder: encoder blocks, 0 = layers
    uint64_t hidden;          // model width h
    uint64_t heads;           // attention heads a
    uint64_t kv_heads;        // key/value heads (GQA/MQA), 0 = heads
    uint64_t head_dim;        // 0 = hidden / heads
    uint64_t ffn;             // MLP inner width, 0 = 4 * hidden
    uint64_t vocab;
    uint64_t max_positions;   // rows of a learned position table
    uint64_t type_vocab;      // token-type embeddings (BERT), 0 = none
    uint64_t rel_buckets;     // T5 relative attention buckets, 0 = 32
    uint64_t num_labels;      // classification classes, 0 = 2
    mn_norm norm;             // 0 = layernorm
    mn_act act;               // 0 = gelu (silu when gated)
    mn_posemb posemb;         // 0 = learned
    mn_head head;             // 0 = lm
    int gated_mlp;            // gate, up and down projections (SwiGLU/GeGLU)
    int tie_embeddings;       // the LM head reuses the input embedding
    int qkv_bias;             // biases on q, k, v
    int out_bias;             // bias on the attention output projection
    int mlp_bias;             // biases on the MLP projections
    int pooler;               // BERT pooler (h x h dense + tanh) before a classification head
    int final_norm;           // a norm after the last block
    int embed_norm;           // a norm right after the embeddings (BERT)
    int lm_transform;         // the LM head has dense + act + norm before the projection (BERT MLM)
    int post_norm;            // norms after the residual adds (BERT) instead of before (GPT-2, Llama)
    float dropout;            // hidden dropout probability, 0 = none
    float attn_dropout;       // attention-probability dropout, 0 = none
    mn_dtype dtype;           // dtype of the published checkpoint, 0 = fp32
    uint64_t params;          // exact parameter count when known (--params, safetensors); 0 = shape
    const mn_layer *stack;    // MN_ARCH_STACK: the layers, applied in order
    uint32_t stack_len;
    uint64_t stack_in;        // MN_ARCH_STACK: input features per token (0 = first layer's in)
} mn_model;

typedef enum mn_precision {
    MN_PREC_DEFAULT = 0,  // fp32
    MN_PREC_FP32,
    MN_PREC_FP16,         // mixed: autocast fp16 compute, fp32 weights/master, loss scaling
    MN_PREC_BF16,         // mixed: autocast bf16 compute, fp32 weights/master
    MN_PREC_FP16_PURE,    // weights, grads and activations in fp16
    MN_PREC_BF16_PURE,    // weights, grads and activations in bf16
    MN_PREC_COUNT
} mn_precision;

typedef enum mn_optim {
    MN_OPTIM_DEFAULT = 0,  // adamw
    MN_OPTIM_ADAMW,
    MN_OPTIM_ADAMW_8BIT,
    MN_OPTIM_SGD,
    MN_OPTIM_SGD_MOMENTUM,
    MN_OPTIM_ADAFACTOR,
    MN_OPTIM_LION,
    MN_OPTIM_NONE,         // no optimizer (frozen model, or inference)
    MN_OPTIM_COUNT
} mn_optim;

typedef enum mn_ckpt {
    MN_CKPT_DEFAULT = 0,  // none
    MN_CKPT_NONE,
    MN_CKPT_FULL,         // keep each block's input, recompute the block in backward
    MN_CKPT_SELECTIVE,    // recompute only the attention core (scores, softmax, dropout)
    MN_CKPT_COUNT
} mn_ckpt;

typedef enum mn_attn {
    MN_ATTN_DEFAULT = 0,  // the framework's default (hf: eager for encoders, sdpa otherwise)
    MN_ATTN_EAGER,        // scores (s x s per head) are materialised and kept for backward
    MN_ATTN_SDPA,         // fused attention (memory-efficient / flash): no s x s tensor kept
    MN_ATTN_FLASH,
    MN_ATTN_COUNT
} mn_attn;

// Memory conventions of the frameworks people train with (see mn_framework_describe()).
typedef enum mn_framework {
    MN_FW_DEFAULT = 0,  // hf
    MN_FW_HF,           // HF Trainer + torch autocast: fp32 params are the master, fp16 casts cached
    MN_FW_DEEPSPEED,    // 16-bit params and grads, fp32 master inside the optimizer (ZeRO's K = 12)
    MN_FW_MEGATRON,     // 16-bit params, fp32 main grads, fp32 master + Adam (18 B/param)
    MN_FW_MEMANAT,      // this project's trainer
    MN_FW_COUNT
} mn_framework;

typedef enum mn_offload { MN_OFFLOAD_DEFAULT = 0, MN_OFFLOAD_NONE, MN_OFFLOAD_OPTIMIZER, MN_OFFLOAD_ALL, MN_OFFLOAD_COUNT } mn_offload;
typedef enum mn_quant { MN_QUANT_DEFAULT = 0, MN_QUANT_NONE, MN_QUANT_INT8, MN_QUANT_NF4, MN_QUANT_COUNT } mn_quant;

// When gradients are released: kept between steps and zeroed in place (torch < 2.0 zero_grad)
// or set to None after each optimizer step (torch >= 2.0 default).
typedef enum mn_grads { MN_GRADS_DEFAULT = 0, MN_GRADS_KEEP, MN_GRADS_RELEASE, MN_GRADS_COUNT } mn_grads;

// LoRA target modules (bit set).
enum {
    MN_LORA_Q = 1u << 0, MN_LORA_K = 1u << 1, MN_LORA_V = 1u << 2, MN_LORA_O = 1u << 3,
    MN_LORA_GATE = 1u << 4, MN_LORA_UP = 1u << 5, MN_LORA_DOWN = 1u << 6,
    MN_LORA_ALL = 0x7f
};

typedef struct mn_setup {
    uint64_t batch;            // micro-batch per GPU, 0 = 1
    uint64_t seq;              // tokens per sequence, 0 = min(512, max_positions) or 512
    uint64_t accum;            // gradient accumulation steps, 0 = 1
    mn_precision precision;    // 0 = fp32
    mn_optim optim;            // 0 = adamw
    mn_ckpt checkpointing;     // 0 = none
    mn_attn attention;         // 0 = framework default
    mn_framework framework;    // 0 = hf
    mn_grads grads;            // 0 = keep with torch < 2.0, release with torch >= 2.0
    uint32_t torch_version;    // 110 = 1.10, 200 = 2.x (op and zero_grad semantics); 0 = 110 with
                               // --framework hf (the published HF measurements), 200 otherwise
    uint32_t lora_rank;        // 0 = no LoRA
    uint32_t lora_targets;     // MN_LORA_* bits, 0 = q|v
    mn_quant quant;            // frozen base weights quantized (QLoRA), 0 = none
    uint32_t zero_stage;       // 0..3
    uint32_t gpus;             // data-parallel GPUs, 0 = 1
    mn_offload offload;        // 0 = none
    uint64_t trainable_params; // only this many parameters train (adapters), 0 = all / LoRA's
    const char *gpu;           // GPU table name, NULL = "a100-80gb"
    uint64_t capacity;         // device bytes, 0 = the GPU's
    uint64_t context;          // CUDA context bytes, 0 = the GPU's typical value
    int infer;                 // inference (generation) instead of training
    uint64_t prompt;           // inference: prompt tokens, 0 = seq
    uint64_t new_tokens;       // inference: generated tokens, 0 = 0
    uint32_t beams;            // inference: beam width, 0 = 1
    const char *alloc_conf;    // PYTORCH_CUDA_ALLOC_CONF for the allocator replay, NULL = defaults
    int no_replay;             // 1: skip the allocator replay (peak_reserved = peak_allocated)
    mn_logger logger;
} mn_setup;

// The simulated step as an allocation trace (for the allocator's replay and benchmarks).
typedef enum mn_phase {
    MN_PHASE_DEFAULT = 0, MN_PHASE_LOAD, MN_PHASE_FORWARD, MN_PHASE_BACKWARD, MN_PHASE_OPTIMIZER,
    MN_PHASE_PREFILL, MN_PHASE_DECODE, MN_PHASE_COUNT
} mn_phase;
typedef struct mn_trace_event {
    uint64_t size;      // bytes
    uint32_t id;        // tensor id: an allocation and its free share it
    uint8_t alloc;      // 1 = allocate, 0 = free
    uint8_t category;   // mn_category
    uint8_t phase;      // mn_phase
} mn_trace_event;

MNDEF const char *mn_phase_name(mn_phase p);

typedef struct mn_gpu {
    const char *name;      // "a100-80gb"
    const char *label;     // "NVIDIA A100 80GB"
    uint64_t capacity;     // bytes the driver reports as total
    uint64_t context;      // typical CUDA context + kernels (torch 2.x, lazy loading)
    int bf16;              // supports bf16
} mn_gpu;

typedef struct mn_estimate_result {
    // bytes per GPU, in the shared vocabulary of categories
    uint64_t weights, master_weights, gradients, optimizer, model_states;
    uint64_t activations;       // kept for backward at the peak
    uint64_t temporary;         // transient buffers live at the peak
    uint64_t kv_cache, workspace;
    uint64_t peak_allocated;    // what torch.cuda.max_memory_allocated() would report
    uint64_t peak_reserved;     // what torch.cuda.max_memory_reserved() would report
    uint64_t context, device_used, capacity;  // device_used = context + peak_reserved
    int fits;
    uint64_t cpu_bytes;         // offloaded states in host memory
    uint64_t params, trainable_params;
    uint64_t at_peak[MN_CAT_COUNT];  // bytes per category at the peak-allocated moment
    uint64_t cat_peak[MN_CAT_COUNT]; // the highest bytes of each category at any moment
    mn_phase peak_phase;        // when peak allocated happens
    uint64_t alloc_events;      // allocations in the simulated step
    // the resolved settings (defaults filled in)
    mn_setup setup;
    mn_model model;
    mn_gpu gpu;
} mn_estimate_result;


// Resolve defaults, run the symbolic step, fill out. MN_ERR_INVALID_ARG names the bad field
// through setup->logger; MN_ERR_OVERFLOW when a size does not fit 64 bits.
MNDEF mn_result mn_estimate(const mn_model *model, const mn_setup *setup, mn_estimate_result *out);

// The allocation sequence mn_estimate() simulates. *events is allocated with `allocator` (NULL =
// default) and released with mn_trace_free().
MNDEF mn_result mn_estimate_trace(const mn_model *model, const mn_setup *setup,
                                  const mn_allocator *allocator, mn_trace_event **events,
                                  uint64_t *count);
MNDEF void mn_trace_free(const mn_allocator *allocator, mn_trace_event *events);
// Replays the simulated step through a caching allocator the caller set up (any configuration,
// a history ring for snapshots and timelines). Each block is labelled with its phase.
struct mn_cache;
MNDEF mn_result mn_estimate_replay(const mn_model *model, const mn_setup *setup,
                                   const mn_allocator *allocator, struct mn_cache *cache);

// Parameter count of a model (exact from the shape, or model->params when set).
MNDEF mn_result mn_model_params(const mn_model *model, uint64_t *out);

// A plan step: one technique applied to reach the budget, in order of its cost in speed.
typedef struct mn_plan_step {
    char what[64];     // "--checkpointing full"
    char why[160];     // "keeps one block's activations: -6.1 GiB, about +33% compute"
} mn_plan_step;

typedef struct mn_fit_result {
    uint64_t max_batch;     // largest micro-batch that fits at setup->seq, 0 = none
    uint64_t max_seq;       // longest sequence that fits at setup->batch, 0 = none
    int plan_found;         // a plan reaches the budget
    uint32_t plan_len;
    mn_plan_step plan[12];
    double plan_slowdown;   // estimated step time relative to the setup as given
    mn_setup plan_setup;    // the setup the plan arrives at
    mn_estimate_result plan_estimate;
    uint64_t estimates_run;
} mn_fit_result;

MNDEF mn_result mn_fit(const mn_model *model, const mn_setup *setup, mn_fit_result *out);

// Presets and GPUs.
MNDEF uint32_t mn_preset_count(void);
MNDEF const mn_model *mn_preset_get(uint32_t i);
MNDEF mn_result mn_preset_find(const char *name, mn_model *out);
MNDEF uint32_t mn_gpu_count(void);
MNDEF const mn_gpu *mn_gpu_get(uint32_t i);
MNDEF mn_result mn_gpu_find(const char *name, mn_gpu *out);

// Names used by the CLI and the JSON output, and their inverse (MN_ERR_NOT_FOUND).
MNDEF const char *mn_precision_name(mn_precision p);
MNDEF const char *mn_optim_name(mn_optim o);
MNDEF const char *mn_ckpt_name(mn_ckpt c);
MNDEF const char *mn_attn_name(mn_attn a);
MNDEF const char *mn_framework_name(mn_framework f);
MNDEF const char *mn_framework_describe(mn_framework f);
MNDEF const char *mn_offload_name(mn_offload o);
MNDEF const char *mn_quant_name(mn_quant q);
MNDEF const char *mn_head_name(mn_head h);
MNDEF const char *mn_arch_name(mn_arch a);
MNDEF mn_result mn_precision_parse(const char *s, mn_precision *out);
MNDEF mn_result mn_optim_parse(const char *s, mn_optim *out);
MNDEF mn_result mn_ckpt_parse(const char *s, mn_ckpt *out);
MNDEF mn_result mn_attn_parse(const char *s, mn_attn *out);
MNDEF mn_result mn_framework_parse(const char *s, mn_framework *out);
MNDEF mn_result mn_offload_parse(const char *s, mn_offload *out);
MNDEF mn_result mn_quant_parse(const char *s, mn_quant *out);
MNDEF mn_result mn_head_parse(const char *s, mn_head *out);
MNDEF mn_result mn_lora_targets_parse(const char *s, uint32_t *out);  // "q,k,v,o,gate,up,down"
