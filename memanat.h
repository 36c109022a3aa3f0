// memanat.h - memory anatomy for transformer training, v0.1.0
//
// One stb-style header: a memory-budget estimator for training and inference of transformers,
// a caching allocator with PyTorch's policy and its statistics, optimizer-state math, loss
// scaling and CPU reference ops. C99, no dependency beyond libc, libm and pthreads.
//
// INSTANTIATE
//   In exactly one C or C++ file:
//       #define MEMANAT_IMPLEMENTATION
//       #include "memanat.h"
//   Every other file includes it without the define.
//
// OPTIONS (define before the implementation include)
//   MEMANAT_STATIC         make every function static to that file
//   MN_MALLOC(sz), MN_FREE(p)   host allocation used when a descriptor gives no allocator
//                          (define both or neither; default malloc/free)
//   MN_ASSERT(c)           check of an internal invariant (default assert); never used on
//                          arguments or input: those get an mn_result, with or without NDEBUG
//   MEMANAT_NO_THREADS     build the caching allocator without its mutex (one thread per cache)
//   MEMANAT_NO_SIMD        plain C instead of GCC/clang vector extensions and intrinsics in the
//                          matmul register tile and the optimizer steps' lanes (slower; the
//                          optimizer steps give the same bits, and the tests pass either way)
//   MEMANAT_CBLAS          mn_matmul_forward and mn_matmul_backward (and the _typed forms with
//                          fp32 operands; 16-bit ones keep the native kernel) call cblas_sgemm of
//                          any CBLAS (OpenBLAS, MKL, BLIS, ...) instead of the native kernel: put
//                          cblas.h on the include path and link the library (e.g. -lopenblas). Results
//                          then follow that library (its threads, its order of summation).
//                          Nothing else uses it; without it the header needs no BLAS.
//   MEMANAT_PREFETCH=0|1   whether the large memory-bound ops ask for their input ahead of the
//                          loads (mn__pf_ahead); default: by the CPU, read once (off on AMD
//                          family 19h, where those requests cost; on elsewhere)
// Link with -lm -lpthread. OpenMP (-fopenmp), when enabled, parallelizes the reference ops and
// the optimizer steps but Lion's (these time themselves and keep one thread while a team is not
// faster, as on cores that other processes keep busy: mn_team_tune). On a machine whose cores
// other processes use, run with OMP_WAIT_POLICY=passive: with libgomp's default a team member
// spins between loops on the shared core, and each loop waited milliseconds for it to start.
// With GCC at -O2 the implementation asks for -O3 (#pragma GCC optimize), so the ops' loops
// vectorize as at -O3, with the same bits, and the allocator and estimator inline as at -O3.
//
// CONVENTIONS
//   A function that can fail returns mn_result: MN_OK (0) or a negative error. A NULL where a
//   pointer is required is MN_ERR_INVALID_ARG, or nothing done by a function that returns nothing.
//   A NULL descriptor or parameter struct (desc, p, d) selects every default, a NULL allocator
//   MN_MALLOC/MN_FREE, a NULL logger silence; each declaration names its other optional pointers.
//
// QUICK START
//   mn_model model;  mn_setup setup = {0};  mn_estimate_result r;
//   mn_preset_find("llama-3-8b", &model);        // or a shape in mn_model, or mn_hf_config_read()
//   setup.batch = 4; setup.seq = 2048;           // zero means default everywhere
//   setup.precision = MN_PREC_BF16;  setup.optim = MN_OPTIM_ADAMW;
//   setup.gpu = "h100-80gb";
//   if (mn_estimate(&model, &setup, &r) == MN_OK)
//       printf("peak %.1f GiB, fits: %d\n", r.peak_reserved / 1073741824.0, r.fits);
//   mn_fit() answers the largest micro-batch, the longest sequence and a plan that fits.
//
// SHARED PIECES (what the CLI, the trainer, the benchmarks and the tests are built from)
//   mn_sim_cache: a caching allocator on a simulated device, from an allocator config string
//       mn_sim_cache sc;  mn_cache_desc cd = {0};  void *p;
//       cd.config = "expandable_segments:True";  mn_sim_cache_init(&sc, NULL, &cd);
//       mn_cache_alloc(&sc.cache, 1 << 20, 0, MN_CAT_ACTIVATIONS, "x", &p); mn_sim_cache_free(&sc);
//   mn_cache_replay: an allocation trace (mn_trace_event[], e.g. from mn_estimate_trace())
//       mn_replay_counts n;  struct mn_cache_stats st;
//       mn_cache_replay(&sc.cache, events, count, 0, &n);  // n.failed: refused allocations
//       mn_cache_stats(&sc.cache, &st);                    // st.reserved_bytes[MN_STAT_ALL].peak
//   mn_cache_write_file: the writer callback for a FILE*
//       mn_cache_summary_write(&st, 0, 0, mn_cache_write_file, stdout);
//       mn_cache_timeline_svg(&snapshot, "step", mn_cache_write_file, svg_file);
//       mn_cache_snapshot_write_json(&snapshot, mn_cache_write_file, json_file);
//   MN_CACHE_STATS(X): every statistic once, X(kind, name, unit, label); a report from it
//       #define ROW_POOL(n) printf("%s %llu\n", #n, (unsigned long long)st.n[MN_STAT_ALL].peak);
//       #define ROW_ONE(n)  /* and ROW_COUNT, ROW_VALUE, ROW_CAT, ROW_CATV: empty */
//       #define ROW(kind, name, unit, label) ROW_##kind(name)      MN_CACHE_STATS(ROW)
//   mn_cache_stats_items: torch.cuda.memory_stats() as flat keys in PyTorch's sorted order
//       mn_stat_item it[MN_CACHE_STATS_ITEMS];
//       uint32_t i, n = mn_cache_stats_items(&st, it, MN_CACHE_STATS_ITEMS);
//       for (i = 0; i < n; i++) printf("%s %lld\n", it[i].key, (long long)it[i].value);
//
// CONTENTS (grep for the tag; the implementation repeats this order; a sub-tag such as
// >>cache/config marks the declarations and the implementation of one part)
//   >>types          results, dtypes, memory categories, host allocator, logger, checked arithmetic
//   >>json           strict JSON reader (DOM), JSON writing helpers
//   >>safetensors    safetensors header reader (single files and sharded model folders)
//   >>estimate       the estimator:
//     /inputs          the model (a shape or a custom layer stack) and the setup; their resolution
//     /step            the symbolic training step or generation, its trace and its result
//     /lengths         training over a distribution of sequence lengths, steps replayed
//     /fit             the largest micro-batch, the longest sequence, a plan that fits
//     /tables          model presets, the GPU table (capacity, context, SM, cuBLAS space, bf16
//                      peak), names
//     /gpt             the model of memanat's own trainer (CPU or --device cuda): its tensor
//                      tables, shared with trainer.c
//   >>cuda           the CUDA backend: kernel math (always), memanat_cuda.cu API (MEMANAT_CUDA)
//   >>hfconfig       Hugging Face config.json and model-folder reader
//   >>cache          the caching allocator with PyTorch's policy:
//     /simdev          the simulated device
//     /hostdev         host memory as a device (real buffers for CPU programs)
//     /config          PYTORCH_ALLOC_CONF parsing and the rounding policy
//     /alloc           blocks, segments, pools, allocation, freeing, events, statistics, check
//     /observe         snapshot, memory_summary(), memory_stats() items, JSON, SVG timeline
//     /helpers         mn_sim_cache, mn_cache_write_file, mn_write_file_atomic, mn_cache_replay,
//                      mn_cache_replay_marked
//   >>optim          optimizer steps and state sizes, gradient clipping, loss scaling, fp16/bf16
//   >>ops            CPU reference ops, forward and backward
//
// HISTORY
//   0.1.0  estimator, CLI, caching allocator, optimizers and reference ops; the CUDA backend
//          (allocator device, cuBLASLt GEMMs, fused kernels and optimizer steps, 8-bit AdamW)
//          and the trainer on a GPU
//
// LICENSE: MIT, see the end of this file.

#ifndef MEMANAT_H
#define MEMANAT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>  // FILE, for the JSON writing helper

#ifdef MEMANAT_STATIC
#define MNDEF static
#else
#define MNDEF extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define MEMANAT_VERSION "0.1.0"

// >>types -----------------------------------------------------------------------------------------

typedef enum mn_result {
    MN_OK = 0,
    MN_ERR_INVALID_ARG = -1,    // a parameter is out of range or inconsistent
    MN_ERR_OUT_OF_MEMORY = -2,  // host allocation failed
    MN_ERR_OVERFLOW = -3,       // a size does not fit 64 bits
    MN_ERR_PARSE = -4,          // malformed input text (JSON, config string, trace)
    MN_ERR_IO = -5,             // a file could not be read or written
    MN_ERR_NOT_FOUND = -6,      // unknown name (model, GPU, key)
    MN_ERR_UNSUPPORTED = -7,    // valid request the library cannot serve
    MN_ERR_DEVICE_OOM = -8,     // the device (real or simulated) is out of memory
    MN_ERR_DEVICE = -9,         // any other device failure
    MN_ERR_CONFIG = -10,        // bad allocator configuration string
    MN_ERR_STATE = -11,         // call not allowed in the object's current state
} mn_result;

MNDEF const char *mn_result_str(mn_result r);

// Element types. Bits per element: fp32 32, fp16/bf16 16, int8 8, nf4 4 (+ quantization constants).
typedef enum mn_dtype {
    MN_DTYPE_DEFAULT = 0,
    MN_FP32,
    MN_FP16,
    MN_BF16,
    MN_INT8,
    MN_NF4,
    MN_DTYPE_COUNT
} mn_dtype;

MNDEF const char *mn_dtype_name(mn_dtype t);
MNDEF uint32_t mn_dtype_bits(mn_dtype t);  // 0 for MN_DTYPE_DEFAULT

// One vocabulary of memory, shared by the estimator, the allocator tags and the trainer.
typedef enum mn_category {
    MN_CAT_OTHER = 0,
    MN_CAT_WEIGHTS,
    MN_CAT_MASTER_WEIGHTS,
    MN_CAT_GRADIENTS,
    MN_CAT_OPTIMIZER,
    MN_CAT_ACTIVATIONS,
    MN_CAT_TEMPORARY,
    MN_CAT_KV_CACHE,
    MN_CAT_WORKSPACE,
    MN_CAT_COUNT
} mn_category;

MNDEF const char *mn_category_name(mn_category c);  // "weights", "master_weights", ...

// Host allocator. All-zero means MN_MALLOC/MN_FREE. user_data is passed to both functions.
typedef struct mn_allocator {
    void *(*alloc_fn)(void *user_data, size_t size);
    void (*free_fn)(void *user_data, void *ptr);
    void *user_data;
} mn_allocator;

// Optional logger: the library is silent without one. Messages name the bad value.
typedef enum mn_log_level {
    MN_LOG_DEFAULT = 0,
    MN_LOG_ERROR,
    MN_LOG_WARN,
    MN_LOG_INFO,
    MN_LOG_COUNT
} mn_log_level;
typedef struct mn_logger {
    void (*log_fn)(void *user_data, mn_log_level level, const char *msg);
    void *user_data;
} mn_logger;

// Checked 64-bit arithmetic: MN_OK or MN_ERR_OVERFLOW, result through the last pointer.
MNDEF mn_result mn_mul_u64(uint64_t a, uint64_t b, uint64_t *out);
MNDEF mn_result mn_add_u64(uint64_t a, uint64_t b, uint64_t *out);

// Sizes for humans and for command lines. mn_size_parse accepts "123", "4B", "1.5GB" (10^9),
// "16GiB" (2^30), "512MiB", "2KB", "2KiB" (case-insensitive units, no sign), exactly, rounded
// to the nearest byte (a half up); MN_ERR_OVERFLOW above 2^64 - 1.
MNDEF mn_result mn_size_parse(const char *s, uint64_t *out);
MNDEF void mn_size_format(uint64_t bytes, char *buf, size_t cap);  // "1.25 GiB", "512 B"

// >>json ------------------------------------------------------------------------------------------
//
// A strict JSON reader (RFC 8259) that builds a read-only tree in one arena, small JSON-writing
// helpers, and a reader for safetensors headers. Both readers take untrusted files: every rule of
// the grammar is enforced, every size is checked, and the fuzz driver (test/fuzz/fuzz.c) runs them.

typedef enum mn_json_type {
    MN_JSON_INVALID = 0,
    MN_JSON_NULL,
    MN_JSON_FALSE,
    MN_JSON_TRUE,
    MN_JSON_NUMBER,
    MN_JSON_STRING,
    MN_JSON_ARRAY,
    MN_JSON_OBJECT,
    MN_JSON_TYPE_COUNT
} mn_json_type;

typedef struct mn_json_value {
    mn_json_type type;
    uint32_t len;                       // STRING: bytes; ARRAY: elements; OBJECT: members
    const char *str;                    // STRING: unescaped UTF-8, NUL-terminated (a \u0000
                                        // escape gives an inner NUL: use len);
                                        // NUMBER: the literal text, NUL-terminated
    double num;                         // NUMBER
    const struct mn_json_value *items;  // ARRAY: len values; OBJECT: 2*len values, key then value
} mn_json_value;

typedef struct mn_json_desc {
    mn_allocator allocator;
    uint32_t max_depth;  // nesting of arrays and objects, 0 = 128, at most 4096
    uint64_t max_bytes;  // longest accepted document, 0 = 256 MiB
} mn_json_desc;

typedef struct mn_json_doc {
    const mn_json_value *root;  // NULL after a failure
    char error[160];            // what went wrong and where ("" on success)
    uint64_t error_offset;      // byte offset of the error in the text
    void *mem_;                 // private: the arena
    mn_allocator alloc_;        // private: the allocator that made it
} mn_json_doc;

// Parses len bytes of text (no NUL terminator needed). Rejects, with MN_ERR_PARSE and doc->error
// naming what and where: trailing commas, comments, leading zeros, NaN/Infinity, control
// characters in strings, bad escapes, lone surrogates, invalid UTF-8, duplicate keys (named),
// nesting deeper than max_depth, trailing garbage, NUL bytes, a byte order mark, numbers outside
// the double range. MN_ERR_OUT_OF_MEMORY when an allocation fails. Free with mn_json_free (also
// safe after a failure).
MNDEF mn_result mn_json_parse(const char *text, size_t len, const mn_json_desc *desc,
                              mn_json_doc *doc);
MNDEF void mn_json_free(mn_json_doc *doc);

// The member value of an object, NULL if absent or obj is not an object.
MNDEF const mn_json_value *mn_json_get(const mn_json_value *obj, const char *key);
// Exact non-negative integer from the literal: "4096", "4.096e3" and "-0" are accepted, "2.5"
// and "-1" give MN_ERR_INVALID_ARG, values above 2^64-1 MN_ERR_OVERFLOW, non-numbers
// MN_ERR_INVALID_ARG.
MNDEF mn_result mn_json_u64(const mn_json_value *v, uint64_t *out);
MNDEF mn_result mn_json_f64(const mn_json_value *v, double *out);  // INVALID_ARG: not a number
MNDEF const char *mn_json_type_name(mn_json_type t);               // "null", "number", ...

// Writing. Both emit s as a quoted JSON string: '"' '\\' and control characters escaped
// (\n \t ... or \u00XX), well-formed UTF-8 copied, each ill-formed byte written as \ufffd (the
// output is always valid JSON). mn_json_escape works like snprintf: it writes at
// most cap bytes including the NUL and returns the length of the full escaped text.
MNDEF size_t mn_json_escape(char *buf, size_t cap, const char *s);
MNDEF void mn_json_fputs_escaped(FILE *f, const char *s);

// >>safetensors -----------------------------------------------------------------------------------
//
// File layout (safetensors format spec, huggingface/safetensors README "Format"): 8 bytes
// little-endian header length N, N bytes of UTF-8 JSON, then the data section. The JSON maps
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} with offsets relative to
// the data section, plus an optional "__metadata__" object of string values.

typedef enum mn_st_dtype {
    MN_ST_UNKNOWN = 0,
    MN_ST_BOOL,
    MN_ST_U8,
    MN_ST_I8,
    MN_ST_F8_E4M3,
    MN_ST_F8_E5M2,
    MN_ST_F8_E8M0,
    MN_ST_I16,
    MN_ST_U16,
    MN_ST_F16,
    MN_ST_BF16,
    MN_ST_I32,
    MN_ST_U32,
    MN_ST_F32,
    MN_ST_I64,
    MN_ST_U64,
    MN_ST_F64,
    MN_ST_DTYPE_COUNT
} mn_st_dtype;

MNDEF const char *mn_st_dtype_name(mn_st_dtype t);  // "F32", "BF16", ...; "unknown"
MNDEF uint32_t mn_st_dtype_bytes(mn_st_dtype t);    // 0 for MN_ST_UNKNOWN
MNDEF mn_dtype mn_st_dtype_to_dtype(mn_st_dtype t); // F32 -> MN_FP32, I8/U8 -> MN_INT8, else 0

typedef struct mn_safetensors_tensor {
    const char *name;        // NUL-terminated
    mn_st_dtype dtype;
    uint32_t rank;
    const uint64_t *shape;   // rank dimensions
    uint64_t elements;       // product of shape (1 for rank 0)
    uint64_t begin, end;     // data_offsets, relative to the data section
} mn_safetensors_tensor;

typedef struct mn_safetensors_desc {
    mn_allocator allocator;
    mn_logger logger;        // errors and warnings, silent without one
    int keep_tensors;        // 1 = fill info->tensor (single files only)
    uint64_t max_header;     // largest header length N accepted, 0 = 100,000,000 (the spec's)
} mn_safetensors_desc;

typedef struct mn_safetensors_info {
    uint32_t files;                              // shards read
    uint64_t header_bytes;                       // N, summed over shards
    uint64_t data_bytes;                         // data sections, summed over shards
    uint64_t tensors;                            // tensor count
    uint64_t params;                             // sum of elements, buffers excluded
    uint64_t buffers;                            // elements of saved non-parameter buffers
                                                 // (names ending in "position_ids",
                                                 // "rotary_emb.inv_freq", ".attn.bias",
                                                 // ".attn.masked_bias": masks and tables)
    uint64_t params_by_dtype[MN_ST_DTYPE_COUNT];
    uint64_t bytes_by_dtype[MN_ST_DTYPE_COUNT];
    mn_st_dtype st_dtype;                        // dtype holding the most parameters
    mn_dtype dtype;                              // the same mapped, 0 when it has no mn_dtype
    uint32_t metadata_count;                     // "__metadata__" entries
    const mn_safetensors_tensor *tensor;         // keep_tensors: the tensors in offset order
    char error[160];                             // what went wrong ("" on success)
    void *mem_;                                  // private
    mn_allocator alloc_;                         // private
} mn_safetensors_info;

// Parses the header in data[0..len) (the first 8 + N bytes of the file at least) and validates
// it against file_size (0 = len): N within limits and the file, offsets inside the data section,
// begin <= end, byte length == elements * dtype size (overflow-checked), tensors covering the
// data section exactly, without gaps or overlaps (as the reference implementation requires).
// MN_ERR_PARSE names the problem in out->error; MN_ERR_UNSUPPORTED for a dtype this reader does
// not size (F4, F6_*, C64); MN_ERR_OVERFLOW for a shape whose size overflows 64 bits.
// Free with mn_safetensors_free (also safe after a failure).
MNDEF mn_result mn_safetensors_parse(const uint8_t *data, size_t len, uint64_t file_size,
                                     const mn_safetensors_desc *desc, mn_safetensors_info *out);
// Reads only the header of one file. MN_ERR_IO when it cannot be opened or read.
MNDEF mn_result mn_safetensors_read_file(const char *path, const mn_safetensors_desc *desc,
                                         mn_safetensors_info *out);
// Sums the shards of a model folder: the files named in model.safetensors.index.json
// ("weight_map") when present, else model.safetensors. MN_ERR_NOT_FOUND (not logged) when
// neither exists; MN_ERR_IO when a shard the index names is missing.
MNDEF mn_result mn_safetensors_read_dir(const char *dir, const mn_safetensors_desc *desc,
                                        mn_safetensors_info *out);
MNDEF void mn_safetensors_free(mn_safetensors_info *info);
// >>estimate --------------------------------------------------------------------------------------
//
// A model is a list of layers; a transformer is built into that list from its shape. The
// estimator runs one training step (or a generation) symbolically, the way autograd runs it:
// every op allocates its output, keeps what its backward needs, and frees the rest. The
// resulting allocation sequence gives the peak allocated bytes and, replayed through the caching
// allocator on a simulated device, the peak reserved bytes.

// ---- >>estimate/inputs: the model and the setup -------------------------------------------------
typedef enum mn_arch {
    MN_ARCH_DEFAULT = 0,       // decoder
    MN_ARCH_DECODER,           // GPT-2, Llama, Mistral, Qwen, StarCoder
    MN_ARCH_ENCODER,           // BERT
    MN_ARCH_ENCODER_DECODER,   // T5
    MN_ARCH_STACK,             // a custom list of layers (mn_model.stack)
    MN_ARCH_COUNT
} mn_arch;

typedef enum mn_norm {
    MN_NORM_DEFAULT = 0, MN_NORM_LAYERNORM, MN_NORM_RMSNORM, MN_NORM_COUNT
} mn_norm;
typedef enum mn_act {
    MN_ACT_DEFAULT = 0,  // gelu, or silu with a gated MLP
    MN_ACT_GELU,
    MN_ACT_GELU_TANH,
    MN_ACT_RELU,
    MN_ACT_SILU,
    MN_ACT_GELU_NEW,     // tanh approximation in separate ops (HF "gelu_new": GPT-2, T5 v1.1)
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
    uint32_t shared_with;  // 1-based index of an earlier layer whose weights it reuses, 0 = own
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
    int post_norm;            // norms after the residual adds (BERT), not before (GPT-2, Llama)
    int fused_proj;           // q, k, v in one projection and gate, up in one (Phi-3's qkv_proj,
                              // gate_up_proj); GPT-2's c_attn is fused whatever this says
    int rope_cat;             // RoPE rotates a slice and concatenates the rest (Phi-3): the
                              // rotated q, k are new contiguous [b, heads, s, d] tensors
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
    MN_FW_HF,           // HF Trainer + autocast: fp32 params are the master, fp16 casts cached
    MN_FW_DEEPSPEED,    // 16-bit params and grads, fp32 master inside the optimizer (ZeRO's K = 12)
    MN_FW_MEGATRON,     // 16-bit params, fp32 main grads, fp32 master + Adam (18 B/param)
    MN_FW_MEMANAT,      // this project's trainer
    MN_FW_COUNT
} mn_framework;

typedef enum mn_offload {
    MN_OFFLOAD_DEFAULT = 0, MN_OFFLOAD_NONE, MN_OFFLOAD_OPTIMIZER, MN_OFFLOAD_ALL, MN_OFFLOAD_COUNT
} mn_offload;
// Frozen base weights quantized by bitsandbytes (transformers' BitsAndBytesConfig). nf4 and fp4
// without "-dq" keep one fp32 absmax per 64 weights, as BitsAndBytesConfig does by default
// (bnb_4bit_use_double_quant=False); "-dq" is double quantization, QLoRA's recipe.
typedef enum mn_quant {
    MN_QUANT_DEFAULT = 0, MN_QUANT_NONE,
    MN_QUANT_INT8,     // LLM.int8 (Linear8bitLt): int8 weight + fp32 scale per output row
    MN_QUANT_NF4,      // Linear4bit quant_type nf4, fp32 absmax per block of 64
    MN_QUANT_NF4_DQ,   // nf4 with double quantization (8-bit absmax, blocks of 256)
    MN_QUANT_FP4,      // Linear4bit quant_type fp4 (BitsAndBytesConfig's default type)
    MN_QUANT_FP4_DQ,   // fp4 with double quantization
    MN_QUANT_COUNT
} mn_quant;

// How a torch optimizer runs its step (torch/optim/optimizer.py, _default_to_fused_or_foreach):
// foreach (_multi_tensor_*: whole-group temporaries, torch's default for CUDA parameters), fused
// (one kernel per group, no temporaries; AdamW(fused=True)), loop (_single_tensor_*: one tensor's
// temporaries at a time). Optimizers outside torch (8-bit AdamW, Adafactor, Lion) ignore it.
typedef enum mn_optim_impl {
    MN_OPTIM_IMPL_DEFAULT = 0, MN_OPTIM_IMPL_FOREACH, MN_OPTIM_IMPL_FUSED, MN_OPTIM_IMPL_LOOP,
    MN_OPTIM_IMPL_COUNT
} mn_optim_impl;

// The training loop around the model (what keeps the model's outputs alive): a plain loop
// (`out = model(**batch); out.loss.backward(); opt.step(); opt.zero_grad()`) holds `out` (logits,
// the KV cache) until the next iteration; HF's Trainer drops them before backward
// (Trainer.compute_loss returns the loss alone).
typedef enum mn_loop {
    MN_LOOP_DEFAULT = 0, MN_LOOP_PLAIN, MN_LOOP_TRAINER, MN_LOOP_COUNT
} mn_loop;

// When gradients are released: kept between steps and zeroed in place (torch < 2.0 zero_grad)
// or set to None after each optimizer step (torch >= 2.0 default).
typedef enum mn_grads {
    MN_GRADS_DEFAULT = 0, MN_GRADS_KEEP, MN_GRADS_RELEASE, MN_GRADS_COUNT
} mn_grads;

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
    uint32_t torch_version;    // 110 = 1.10, 200 = 2.x (op and zero_grad semantics); 0 = 200
    mn_optim_impl optim_impl;  // 0 = what torch picks on CUDA: foreach for --framework hf
    float lora_dropout;        // PEFT lora_dropout, 0 = none (identity)
    mn_loop loop;              // 0 = plain
    uint32_t lora_rank;        // 0 = no LoRA
    uint32_t lora_targets;     // MN_LORA_* bits, 0 = q|v
    mn_quant quant;            // frozen base weights quantized (QLoRA), 0 = none
    uint32_t zero_stage;       // 0..3
    uint32_t gpus;             // data-parallel GPUs, 0 = 1
    mn_offload offload;        // 0 = none
    uint32_t bnb_version;      // bitsandbytes as major*10000 + minor*100 + patch (4301 = 0.43.1),
                               // 0 = current; before 0.43.2 MatMul4Bit keeps its 16-bit input
    int quant_head;            // 1: the LM head is quantized too; 0 = kept 16-bit (transformers)
    uint64_t trainable_params; // only this many parameters train (adapters), 0 = all / LoRA's
    const char *gpu;           // GPU table name, NULL = "a100-80gb" ("cpu" for --framework memanat;
                               // memanat on a GPU models trainer.c --device cuda)
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

// ---- >>estimate/step: the simulated step and its result -----------------------------------------
// The simulated step as an allocation trace (for the allocator's replay and benchmarks).
typedef enum mn_phase {
    MN_PHASE_DEFAULT = 0, MN_PHASE_LOAD, MN_PHASE_FORWARD, MN_PHASE_BACKWARD, MN_PHASE_OPTIMIZER,
    MN_PHASE_PREFILL, MN_PHASE_DECODE, MN_PHASE_COUNT
} mn_phase;
typedef struct mn_trace_event {
    uint64_t size;      // bytes (allocations)
    uint64_t id;        // tensor id or pointer: an allocation and its free share it
    uint32_t stream;    // mn_stream, 0 = the default stream
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
    uint32_t sm;           // compute capability x 10: 70 = V100 (sm_70), 80 = A100, 90 = H100
    int bf16;              // supports bf16 (sm >= 80)
    uint64_t cublas_workspace;  // bytes of the cuBLAS workspace a training step holds
    double bf16_tflops;    // dense bf16 tensor-core peak (MFU's denominator), 0 = not known
} mn_gpu;

typedef struct mn_estimate_result {
    // bytes per GPU, in the shared vocabulary of categories
    uint64_t weights, master_weights, gradients, optimizer, model_states;
    uint64_t activations;       // kept for backward at the peak
    uint64_t temporary;         // transient buffers live at the peak
    uint64_t kv_cache, workspace;
    uint64_t peak_allocated;    // what torch.cuda.max_memory_allocated() would report
    uint64_t peak_reserved;     // what torch.cuda.max_memory_reserved() would report
    uint64_t peak_requested;    // the most bytes of live tensors, each rounded up to 512 B: what
                                // a per-tensor tracker (torch's MemTracker) reports; allocated
                                // adds the blocks' unsplit remainders (CUDACachingAllocator)
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

// Activation bytes each part of the model keeps for backward in a steady-state training forward
// (the second step): parts[0] the embeddings, parts[1..blocks] the blocks (layers of a custom
// stack), parts[blocks + 1] the final norm and head. *count = blocks + 2; at most cap written.
MNDEF mn_result mn_estimate_parts(const mn_model *model, const mn_setup *setup, uint64_t *parts,
                                  uint32_t cap, uint32_t *count);

// ---- >>estimate/lengths: training over a distribution of sequence lengths ----------------------
// Fine-tuning data has a length distribution: each micro-batch is padded to its longest sequence
// (transformers' DataCollatorWithPadding, padding="longest"), so each step allocates differently
// and the caching allocator fragments across steps. mn_estimate_lengths draws the padded length
// of every micro-batch, simulates the steps and replays them through the allocator.
//
// A distribution: a histogram (len[i] seen count[i] times, lengths ascending and distinct), or,
// when n == 0, min:max:mean: a truncated exponential over [min, max + 1) whose mean is mean + 1/2,
// rounded down to whole tokens (mean (min + max) / 2 is the uniform distribution; real data, mean
// near min, is skewed towards short sequences as exponentials are).
typedef struct mn_seq_dist {
    uint64_t *len, *count;  // n entries (mn_seq_dist_parse allocates them)
    uint32_t n;
    uint64_t min, max;      // n == 0: the range, 1 <= min <= max
    double mean;            // n == 0: min <= mean <= max
} mn_seq_dist;

// A lengths file: one entry a line, "LENGTH" (one sequence of that length) or "LENGTH COUNT" (a
// histogram line), mixed freely; blank lines and lines starting with '#' are skipped; a length
// given twice adds up. LENGTH 1..67108864, COUNT 1..10^12, at most 1048576 entries, lines of at
// most 255 bytes. Errors name the line ("line 12: ...") through logger. Release with
// mn_seq_dist_free and the same allocator (NULL = default).
MNDEF mn_result mn_seq_dist_parse(const char *text, size_t len, const mn_allocator *allocator,
                                  const mn_logger *logger, mn_seq_dist *out);
// The same from a file of at most 64 MiB; messages start with the path.
MNDEF mn_result mn_seq_dist_read_file(const char *path, const mn_allocator *allocator,
                                      const mn_logger *logger, mn_seq_dist *out);
// "MIN:MAX:MEAN" (whole MIN and MAX, MEAN may have a fraction).
MNDEF mn_result mn_seq_dist_range(const char *spec, const mn_logger *logger, mn_seq_dist *out);
MNDEF void mn_seq_dist_free(const mn_allocator *allocator, mn_seq_dist *d);

#define MN_LENGTHS_MAX_STEPS 256
typedef struct mn_lengths_desc {
    const mn_seq_dist *dist;
    uint32_t steps;     // optimizer steps replayed, 0 = 32 (2..MN_LENGTHS_MAX_STEPS)
    uint64_t seed;      // of the draws (splitmix64); 0 is a seed like any other
    double percentile;  // of the per-step reserved bytes, 0 = 99 (PEFT's method comparison
                        // reports the 99th percentile of memory_reserved() over steps)
} mn_lengths_desc;

typedef struct mn_lengths_result {
    mn_estimate_result longest;  // the plain estimate (two steps) at the longest length
    uint64_t longest_len;        // the distribution's longest length
    uint64_t peak_allocated;     // the highest allocated during the steps of that length (every
                                 // micro-batch at it; the replay's block sizes, as
                                 // torch.cuda.max_memory_allocated() counts them)
    uint64_t reserved;           // the most reserved during the steps (max_memory_reserved();
                                 // fragmentation included): with no block given back, the
                                 // reserved bytes after the last step
    uint64_t reserved_pct;       // the percentile of step_reserved (nearest rank)
    uint64_t device_used;        // longest.context + reserved
    int fits;                    // device_used <= longest.capacity
    double percentile, mean_len; // the percentile used; the mean padded length of the steps
    uint32_t steps;
    uint64_t step_len[MN_LENGTHS_MAX_STEPS];       // each step's longest padded micro-batch
    uint64_t step_peak[MN_LENGTHS_MAX_STEPS];      // allocated peak during each step
    uint64_t step_reserved[MN_LENGTHS_MAX_STEPS];  // reserved at the end of each step
                                                   // (memory_reserved() after it)
    // The most bytes each step's live tensors ask for (no allocator rounding, no block reuse):
    // independent of the cache's history, equal to mn_estimate's peak with no_replay set.
    uint64_t step_live[MN_LENGTHS_MAX_STEPS];
    uint64_t peak_live;          // the highest step_live of the steps of the longest length
} mn_lengths_result;

// The draws, for reproducing them: micro-batch j of step k (nmb = 1, or 2 with accum > 1: the
// second stands for the accumulation's later micro-batches) gets the quantile u^(1/b) of the
// distribution, u uniform in [0, 1) from splitmix64(seed) in that order (53 bits), b = batch for
// the first micro-batch of a step and batch * (accum - 1) for the second: the longest of b
// draws. When no step after the first drew the longest length for all its micro-batches, the
// last step gets it for all of them, so the replay contains the worst step in the steady state
// (peak_allocated and peak_live are those of such steps). As mn_estimate does, when the reserved
// bytes pass the device (capacity - context) and a replay at the device's size refuses nothing,
// that replay gives the numbers (PyTorch frees its cached blocks and retries), and step_reserved
// may then fall from step to step. setup->seq plays no part. Training only
// (not --infer, not --framework memanat, whose sequence is its position table).
MNDEF mn_result mn_estimate_lengths(const mn_model *model, const mn_setup *setup,
                                    const mn_lengths_desc *desc, mn_lengths_result *out);

// What is alive at the simulated step's peak allocated moment, grouped by the mechanism that
// made each buffer, its category and its size: items[] sorted by total bytes, largest first
// (at most cap written, *count = the number of groups); *peak = the bytes alive then (before
// the allocator's 512-byte rounding). mechanism points to a static string.
typedef struct mn_explain_item {
    const char *mechanism;
    mn_category category;
    uint64_t bytes_each, count, bytes;
} mn_explain_item;
MNDEF mn_result mn_estimate_explain(const mn_model *model, const mn_setup *setup,
                                    mn_explain_item *items, uint32_t cap, uint32_t *count,
                                    uint64_t *peak);

// Parameter count of a model (exact from the shape, or model->params when set).
MNDEF mn_result mn_model_params(const mn_model *model, uint64_t *out);

// The device tensors of one weight [rows, cols] (numel = rows * cols) quantized by bitsandbytes,
// in bytes as requested (the allocator rounds each on its own). 4-bit (functional.py
// quantize_4bit, blocksize 64): data packs two codes a byte; absmax one fp32 per block, or with
// double quantization one uint8 per block plus offset (fp32 scalar), absmax2 (fp32 per 256
// blocks) and code2 (the 256-entry fp32 map); code the 16-entry fp32 map. int8 (Linear8bitLt):
// data the int8 weight, absmax one fp32 scale per row. bnb_version as in mn_setup.
typedef struct mn_quant_tensors {
    uint64_t data, absmax, code, offset, absmax2, code2;
    uint64_t total;  // the sum
    uint32_t count;  // tensors allocated (those of nonzero size)
} mn_quant_tensors;
MNDEF mn_result mn_quant_storage(mn_quant q, uint64_t rows, uint64_t cols, uint32_t bnb_version,
                                 mn_quant_tensors *out);

// ---- >>estimate/fit: the largest batch, the longest sequence, a plan ----------------------------
// A plan step: one technique applied to reach the budget, in order of its cost in speed.
typedef struct mn_plan_step {
    char what[64];     // "--checkpointing full"
    char why[160];     // "keeps one block's activations: -6.1 GiB, about +33% compute"
} mn_plan_step;

typedef struct mn_fit_result {
    uint64_t max_batch;     // largest micro-batch that fits at setup->seq, 0 = none
    uint64_t max_seq;       // longest sequence that fits at setup->batch, 0 = none (or not
                            // searched: memanat's sequence is its model's position table)
    int plan_found;         // a plan reaches the budget
    uint32_t plan_len;
    mn_plan_step plan[12];
    double plan_slowdown;   // estimated step time relative to the setup as given
    mn_setup plan_setup;    // the setup the plan arrives at
    mn_estimate_result plan_estimate;
    uint64_t estimates_run;
} mn_fit_result;

MNDEF mn_result mn_fit(const mn_model *model, const mn_setup *setup, mn_fit_result *out);

// ---- >>estimate/tables: presets, GPUs, names ----------------------------------------------------
// Presets and GPUs.
MNDEF uint32_t mn_preset_count(void);
MNDEF const mn_model *mn_preset_get(uint32_t i);
MNDEF mn_result mn_preset_find(const char *name, mn_model *out);
MNDEF uint32_t mn_gpu_count(void);
MNDEF const mn_gpu *mn_gpu_get(uint32_t i);
MNDEF mn_result mn_gpu_find(const char *name, mn_gpu *out);
// Lookups ignore case and every character but letters and digits ("RTX 4090" is rtx4090), take
// a hub id's organization off ("meta-llama/Meta-Llama-3-8B-Instruct" is llama-3-8b: "Meta-",
// "-hf", "-Instruct" and "-chat" are dropped where nothing matches with them) and nvidia-smi's
// words ("NVIDIA A100-SXM4-40GB" is a100-40gb). For a name that is not found: the table name
// closest to it (two edits at most, the same first letter or digit) for a "did you mean"; NULL
// when the name is found or none is close.
MNDEF const char *mn_preset_closest(const char *name);
MNDEF const char *mn_gpu_closest(const char *name);

// Names used by the CLI and the JSON output, and their inverse (MN_ERR_NOT_FOUND).
MNDEF const char *mn_precision_name(mn_precision p);
MNDEF const char *mn_optim_name(mn_optim o);
MNDEF const char *mn_ckpt_name(mn_ckpt c);
MNDEF const char *mn_attn_name(mn_attn a);
MNDEF const char *mn_framework_name(mn_framework f);
MNDEF const char *mn_optim_impl_name(mn_optim_impl i);
MNDEF const char *mn_loop_name(mn_loop l);
MNDEF mn_result mn_loop_parse(const char *s, mn_loop *out);
MNDEF mn_result mn_optim_impl_parse(const char *s, mn_optim_impl *out);
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
// ---- >>estimate/gpt: the model of memanat's own trainer ------------------------------------------
// trainer.c trains a GPT-2-style decoder: learned positions, pre-norm blocks (layernorm, qkv,
// causal attention, projection, residual; layernorm, fc + GELU, projection, residual), a final
// layernorm and a head tied to the token embedding or its own. Its tensors are listed here once,
// for the trainer (which allocates them) and the estimator's memanat framework (which predicts
// them). Shapes use the locals L (layers), C (width), NH (heads), T (sequence = positions),
// V (vocabulary), HV (V for an untied head, 0 for a tied one), B (micro-batch), N = B * T.
//
// Parameters, X(name, rows, cols, init); per-layer tensors are stacked along the rows (layer l
// starts at row l * rows / L). A tensor of 0 rows does not exist.
enum { MN_GPT_INIT_NORMAL, MN_GPT_INIT_RESID, MN_GPT_INIT_ONE, MN_GPT_INIT_ZERO };
#define MN_GPT_PARAMS(X) \
    X(wte,      V,         C,     MN_GPT_INIT_NORMAL)  /* token embedding (and a tied head) */ \
    X(wpe,      T,         C,     MN_GPT_INIT_NORMAL)  /* position embedding */ \
    X(ln1w,     L,         C,     MN_GPT_INIT_ONE) \
    X(ln1b,     L,         C,     MN_GPT_INIT_ZERO) \
    X(qkvw,     L * 3 * C, C,     MN_GPT_INIT_NORMAL) \
    X(qkvb,     L,         3 * C, MN_GPT_INIT_ZERO) \
    X(attprojw, L * C,     C,     MN_GPT_INIT_RESID) \
    X(attprojb, L,         C,     MN_GPT_INIT_ZERO) \
    X(ln2w,     L,         C,     MN_GPT_INIT_ONE) \
    X(ln2b,     L,         C,     MN_GPT_INIT_ZERO) \
    X(fcw,      L * 4 * C, C,     MN_GPT_INIT_NORMAL) \
    X(fcb,      L,         4 * C, MN_GPT_INIT_ZERO) \
    X(fcprojw,  L * C,     4 * C, MN_GPT_INIT_RESID) \
    X(fcprojb,  L,         C,     MN_GPT_INIT_ZERO) \
    X(lnfw,     1,         C,     MN_GPT_INIT_ONE) \
    X(lnfb,     1,         C,     MN_GPT_INIT_ZERO) \
    X(lmw,      HV,        C,     MN_GPT_INIT_NORMAL)  /* an untied head */

// The activations one block keeps for its backward, X(name, numel, fp32): fp32 = 1 for the
// layernorm statistics, kept in fp32 at every precision; 0 for tensors stored in the precision's
// dtype (2 bytes with fp16/bf16). The block's input and output are the residual stream.
#define MN_GPT_ACTS(X) \
    X(ln1,      N * C,          0)  /* layernorm 1 output */ \
    X(ln1_mean, N,              1) \
    X(ln1_rstd, N,              1) \
    X(qkv,      N * 3 * C,      0) \
    X(att,      B * NH * T * T, 0)  /* attention probabilities */ \
    X(atty,     N * C,          0)  /* attention output, heads concatenated */ \
    X(res2,     N * C,          0)  /* x + attention projection */ \
    X(ln2,      N * C,          0) \
    X(ln2_mean, N,              1) \
    X(ln2_rstd, N,              1) \
    X(fch,      N * 4 * C,      0)  /* fc output before GELU */ \
    X(fch_gelu, N * 4 * C,      0)

// The mn_model of that GPT: layers, width, heads, sequence (= positions), vocabulary, tied head.
// MN_ERR_INVALID_ARG when a size is 0 or heads do not divide the width.
MNDEF mn_result mn_gpt_model(uint64_t layers, uint64_t dim, uint64_t heads, uint64_t seq,
                             uint64_t vocab, int tied, mn_model *out);

// >>cuda ------------------------------------------------------------------------------------------
//
// The CUDA backend (memanat_cuda.cu, built when nvcc is present) in two parts.
//
// 1. The kernels' math, always compiled: per-element and per-row functions that the kernels of
//    memanat_cuda.cu call on the device and the host tests call on the CPU, so the formulas the
//    GPU runs are checked against the reference ops (>>ops, >>optim) in every build, GPU or not.
//    MN_HD is `static inline` in C and C++, `static __host__ __device__ inline` under nvcc. All
//    math is fp32; storage conversion (fp16/bf16, round to nearest even) happens in the kernels.
//
// 2. The C API of memanat_cuda.cu (define MEMANAT_CUDA before including this header): a context
//    (mn_cuda: device, stream, cuBLASLt handle and workspace), the caching allocator's device
//    backend over cudaMalloc with pooled events and CUDA virtual memory for expandable segments,
//    GEMMs through cuBLASLt with fused epilogues, and fused kernels whose launchers take the
//    arguments of the CPU ops (>>ops) in the same order, plus the context and a storage dtype.
//    Pointers given to the launchers are device pointers; every call runs on ctx->stream and is
//    asynchronous unless it says otherwise. Every entry point returns mn_result: MN_ERR_DEVICE
//    (MN_ERR_DEVICE_OOM when cudaMalloc is refused) with the CUDA or cuBLAS error text sent to
//    the context's logger.
#include <math.h>
#include <string.h>  // memcpy (mn_hd_bits on the host)
#if defined(__CUDACC__)
#define MN_HD static __host__ __device__ inline
#else
#define MN_HD static inline
#endif
#define MN_HD_GELU_K 0.7978845608028654f   // sqrt(2 / pi)
#define MN_HD_GELU_C 0.044715f
#define MN_HD_NEG_MAX (-3.402823466e+38f)  // -FLT_MAX: the start of a running max

// GELU, tanh approximation: 0.5 x (1 + tanh(k (x + c x^3))) and its derivative
// 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 c x^2), u = k (x + c x^3).
MN_HD float mn_hd_gelu(float x) {
    float u = MN_HD_GELU_K * (x + MN_HD_GELU_C * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}
// GELU as the kernels for 16-bit storage compute it: 0.5 x (1 + tanh u) = x / (1 + exp(-2u)),
// the same function (1 + tanh u = 2 / (1 + exp(-2u))) without tanhf's dozens of instructions
// and without the cancellation of 1 + tanh u for x << 0. On the device the fast exp and divide
// (a few fp32 ulp), on the host expf and a division. Limits: exp(-2u) overflows to inf for
// x << 0 and x / inf is -0 (0.5 x (1 + tanhf u) is -0 there too); x = -inf gives NaN, as
// mn_hd_gelu does.
MN_HD float mn_hd_gelu_fast(float x) {
    float u = MN_HD_GELU_K * (x + MN_HD_GELU_C * x * x * x);
#ifdef __CUDA_ARCH__
    return __fdividef(x, 1.0f + __expf(-2.0f * u));
#else
    return x / (1.0f + expf(-2.0f * u));
#endif
}
MN_HD float mn_hd_gelu_grad(float x) {
    float u = MN_HD_GELU_K * (x + MN_HD_GELU_C * x * x * x), t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * MN_HD_GELU_K *
                                   (1.0f + 3.0f * MN_HD_GELU_C * x * x);
}

// LayerNorm, per element: y = (x - mu) r w + b with r = 1/sqrt(var + eps); backward, with
// g = w dy and xh = (x - mu) r: dx = r (g - mean(g) - xh mean(g xh)).
MN_HD float mn_hd_rstd(float var, float eps) { return 1.0f / sqrtf(var + eps); }
MN_HD float mn_hd_layernorm_out(float x, float mu, float r, float w, float b) {
    return (x - mu) * r * w + b;
}
MN_HD float mn_hd_layernorm_dinp(float g, float xh, float g_mean, float gxh_mean, float r) {
    return r * (g - g_mean - xh * gxh_mean);
}

// Running max and sum of exp for softmax and cross-entropy (one pass, "online softmax",
// Milakov & Gimelshein 2018): after adding x_1..x_k, sum = sum_i exp(x_i - max). Start from
// mn_hd_maxsum_init(); merge partial states of a split row with mn_hd_maxsum_merge.
typedef struct mn_hd_maxsum {
    float max, sum;
} mn_hd_maxsum;
MN_HD mn_hd_maxsum mn_hd_maxsum_init(void) {
    mn_hd_maxsum s;
    s.max = MN_HD_NEG_MAX, s.sum = 0.0f;
    return s;
}
MN_HD mn_hd_maxsum mn_hd_maxsum_add(mn_hd_maxsum s, float x) {
    if (x > s.max) s.sum = s.sum * expf(s.max - x) + 1.0f, s.max = x;
    else s.sum += expf(x - s.max);
    return s;
}
MN_HD mn_hd_maxsum mn_hd_maxsum_merge(mn_hd_maxsum a, mn_hd_maxsum b) {
    mn_hd_maxsum r;
    r.max = a.max > b.max ? a.max : b.max;
    r.sum = a.sum * expf(a.max - r.max) + b.sum * expf(b.max - r.max);
    return r;
}
// Softmax of row n of [N,L] rows: the columns that take part (causal: row n is query position
// t = n % L and sees keys 0..t), the probability of one (already scaled) input, the backward.
MN_HD uint64_t mn_hd_softmax_len(uint64_t n, uint64_t L, int causal) {
    return causal ? n % L + 1 : L;
}
// Causal rows in pairs: row t of an L x L matrix sees t + 1 columns and row L - 1 - t sees L - t,
// L + 1 together, so a warp that takes both moves the same bytes whatever t. Work item w of
// mn_hd_softmax_pairs(N, L): pair w % H of matrix w / H (H = (L + 1) / 2), then the rows of a last,
// partial matrix (N % L of them) one an item. *ra and *rb get the rows (rb == ra: one row).
MN_HD uint64_t mn_hd_softmax_pairs(uint64_t N, uint64_t L) {
    return N / L * ((L + 1) / 2) + N % L;
}
MN_HD void mn_hd_softmax_pair(uint64_t w, uint64_t N, uint64_t L, uint64_t *ra, uint64_t *rb) {
    uint64_t H = (L + 1) / 2, full = N / L * H;
    if (w < full) *ra = w / H * L + w % H, *rb = w / H * L + L - 1 - w % H;
    else *ra = *rb = N / L * L + (w - full);
}
// exp(a x - m) as the row loops of the softmax and cross-entropy kernels compute it for 16-bit
// storage: 2^(x a log2 e - m log2 e), one FMA with al = a log2 e and ml = m log2 e taken once a
// row, then the device's hardware exp2 (exp2f on the host). Relative error about
// (|a x| + |m|) 2^-24 from the rounding of the argument, far below a half ulp of fp16 or bf16.
#define MN_HD_LOG2E 1.4426950408889634f
MN_HD float mn_hd_exp_fma(float x, float al, float ml) {
#ifdef __CUDA_ARCH__
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(x, al, -ml)));
    return y;
#else
    return exp2f(fmaf(x, al, -ml));
#endif
}
MN_HD float mn_hd_softmax_prob(float scaled_x, mn_hd_maxsum s) {
    return expf(scaled_x - s.max) / s.sum;
}
MN_HD float mn_hd_softmax_dinp(float out, float dout, float dot, float scale) {
    return scale * out * (dout - dot);  // dot = sum_j out_j dout_j over the row
}

// Cross-entropy from a row's running max/sum: loss = log(sum) + max - logit[target], and the
// fused gradient dlogit = (p - onehot) dloss with p = exp(logit - max) / sum.
MN_HD float mn_hd_ce_loss(mn_hd_maxsum s, float logit_target) {
    return logf(s.sum) + s.max - logit_target;
}
MN_HD float mn_hd_ce_dlogit(float logit, mn_hd_maxsum s, int is_target, float dloss) {
    return (expf(logit - s.max) / s.sum - (is_target ? 1.0f : 0.0f)) * dloss;
}

// Gradient clipping coefficient from the global norm (torch clip_grad_norm_): min(1, max / (norm
// + 1e-6)); 1 when max_norm is 0 (no clipping).
MN_HD float mn_hd_clip_coef(float norm, float max_norm) {
    float c;
    if (max_norm == 0.0f) return 1.0f;
    c = max_norm / (norm + 1e-6f);
    return c < 1.0f ? c : 1.0f;
}
MN_HD int mn_hd_isfinite(float x) { return x - x == 0.0f; }  // false for inf and NaN

// AdamW per element, the arithmetic of mn_adamw_step (torch.optim.AdamW, decoupled decay):
//   g *= grad_scale;  th = p (1 - lr wd);  m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2;
//   p = th - step_size m / (sqrt(v) / sqrt(1 - b2^t) + eps),  step_size = lr / (1 - b1^t).
// The coefficients depend on the step only: mn_hd_adamw_coef computes them in double as the host
// step does. grad_scale folds the loss scaler's 1/scale and the clipping coefficient.
typedef struct mn_hd_adamw_coef {
    float decay;      // 1 - lr * weight_decay
    float step_size;  // lr / (1 - beta1^t)
    float bc2_sqrt;   // sqrt(1 - beta2^t)
    float w1;         // 1 - beta1: the lerp weight
    float beta2, eps;
    int maximize;
} mn_hd_adamw_coef;
MN_HD mn_hd_adamw_coef mn_hd_adamw_coefs(float lr, float beta1, float beta2, float eps,
                                         float weight_decay, int maximize,
                                         uint64_t t) {
    mn_hd_adamw_coef k;
    double bc1 = 1.0 - pow((double)beta1, (double)t), bc2 = 1.0 - pow((double)beta2, (double)t);
    k.decay = (float)(1.0 - (double)lr * (double)weight_decay);
    k.step_size = (float)((double)lr / bc1);
    k.bc2_sqrt = (float)sqrt(bc2);
    k.w1 = 1.0f - beta1, k.beta2 = beta2, k.eps = eps, k.maximize = maximize;
    return k;
}
MN_HD void mn_hd_adamw(float *p, float *m, float *v, float g, float grad_scale,
                       const mn_hd_adamw_coef *k) {
    float th, mm, vv, denom;
    g *= grad_scale;
    if (k->maximize) g = -g;
    th = *p * k->decay;
    mm = k->w1 < 0.5f ? *m + k->w1 * (g - *m) : g - (g - *m) * (1.0f - k->w1);  // torch lerp
    vv = *v * k->beta2 + (1.0f - k->beta2) * g * g;
    denom = sqrtf(vv) / k->bc2_sqrt + k->eps;
    *m = mm, *v = vv;
    *p = th - k->step_size * (mm / denom);
}

// 8-bit AdamW, the arithmetic of mn_adamw8bit_step (bitsandbytes AdamW8bit, csrc/kernels.cu
// kOptimizerStatic8bit2StateBlockwise): the step's scalars from t in double as the host step; per
// element the moments from the dequantized state (map[code] * absmax; 0 where g is not finite),
// the update from the fp32 moments with the decay after it, and the new codes: the nearest map
// entry (ties to the larger), a negative m never coded at 0 or above (its sign is kept).
typedef struct mn_hd_adamw8bit_coef {
    float beta1, beta2;
    float step_size;  // -lr sqrt(1 - beta2^t) / (1 - beta1^t)
    float eps_c;      // eps sqrt(1 - beta2^t)
    float decay;      // 1 - lr weight_decay, applied when decay_on
    int decay_on;     // weight_decay > 0
} mn_hd_adamw8bit_coef;
MN_HD mn_hd_adamw8bit_coef mn_hd_adamw8bit_coefs(float lr, float beta1, float beta2, float eps,
                                                 float weight_decay, uint64_t t) {
    mn_hd_adamw8bit_coef k;
    double c1 = 1.0 - pow((double)beta1, (double)t);
    double c2 = sqrt(1.0 - pow((double)beta2, (double)t));
    k.beta1 = beta1, k.beta2 = beta2;
    k.step_size = (float)(-(double)lr * c2 / c1);
    k.eps_c = (float)((double)eps * c2);
    k.decay = (float)(1.0 - (double)lr * (double)weight_decay);
    k.decay_on = weight_decay > 0.0f;
    return k;
}
// m = b1 m_old + (1 - b1) g, v = b2 v_old + (1 - b2) g^2 (m_old, v_old dequantized or fp32);
// 0 when g is not finite (returns 0 then, 1 otherwise).
MN_HD int mn_hd_adamw8bit_moments(float *m, float *v, float g, float m_old, float v_old,
                                  const mn_hd_adamw8bit_coef *k) {
    if (!mn_hd_isfinite(g)) {
        *m = 0.0f, *v = 0.0f;
        return 0;
    }
    *m = m_old * k->beta1 + (1.0f - k->beta1) * g;
    *v = v_old * k->beta2 + (1.0f - k->beta2) * g * g;
    return 1;
}
MN_HD void mn_hd_adamw8bit_param(float *p, float m, float v, const mn_hd_adamw8bit_coef *k) {
    *p = *p + k->step_size * (m / (sqrtf(v) + k->eps_c));
    if (k->decay_on) *p = *p * k->decay;
}
// Index of the entry of map[256] (ascending) nearest to x, ties to the larger: a branch-free
// binary search (i ends as the number of entries below x).
MN_HD uint32_t mn_hd_q8_nearest(const float *map, float x) {
    uint32_t i = 0, step;
    for (step = 128; step > 0; step >>= 1) i += step & (0u - (uint32_t)(map[i + step - 1] < x));
    if (i == 0) return 0;
    return i - (uint32_t)(x - map[i - 1] < map[i] - x);
}
// The same index from a table of the map's thresholds (mn_q8_table), without the search: the
// floats are cut into MN_Q8_TAB buckets by sign, exponent and the top 7 mantissa bits, each
// holding at most one threshold (the float from which the search gives the next index); a
// bucket's word is its first index shifted up by 17 plus 2^17 minus the low 16 bits of the
// threshold's order key, so adding those bits of x carries exactly when x reaches it.
#define MN_Q8_TAB 6400u  // 2 signs x 25 exponents (2^-24 .. 1) x 128
// The bits of x (also the host optimizers'); x's magnitude's place among the buckets of one sign
// (exponent and 7 mantissa bits from 2^-24, biased exponent 103, clamped to the table); a table
// lookup's code c, 0 for a NaN (as the search).
MN_HD uint32_t mn_hd_bits(float x) {
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(x);
#else
    memcpy(&u, &x, sizeof u);
#endif
    return u;
}
MN_HD uint32_t mn_hd_q8_mag(uint32_t u) {
    uint32_t q = (u & 0x7fffffffu) >> 16;
    q = q < (103u << 7) ? 0u : q - (103u << 7);
    return q < MN_Q8_TAB / 2 - 1 ? q : MN_Q8_TAB / 2 - 1;
}
MN_HD uint32_t mn_hd_q8_nan0(uint32_t u, uint32_t c) {
    return c & (0u - (uint32_t)((u & 0x7fffffffu) <= 0x7f800000u));
}
// The bucket of the float with bits u: the magnitudes in order, the negative half backwards
// (MN_Q8_TAB / 2 - 1 - j is MN_Q8_TAB / 2 + ~j: the sign's mask flips j, no branch).
MN_HD uint32_t mn_hd_q8_bucket(uint32_t u) {
    return MN_Q8_TAB / 2 + (mn_hd_q8_mag(u) ^ (0u - (u >> 31)));
}
MN_HD uint32_t mn_hd_q8_nearest_tab(const uint32_t *tab, float x) {
    uint32_t u = mn_hd_bits(x);
    return mn_hd_q8_nan0(u, (tab[mn_hd_q8_bucket(u)] + ((u ^ (0u - (u >> 31))) & 0xffffu)) >> 17);
}
// The same for x not negative (v / absmax in the unsigned map; NaN too) from the table's upper
// half alone, half = tab + MN_Q8_TAB / 2: the bucket is j, the low bits are x's own.
MN_HD uint32_t mn_hd_q8_nearest_tab_pos(const uint32_t *half, float x) {
    uint32_t u = mn_hd_bits(x);
    return mn_hd_q8_nan0(u, (half[mn_hd_q8_mag(u)] + (u & 0xffffu)) >> 17);
}
// The code of m in the signed map at scale inv = 1 / absmax (0 when absmax is 0).
MN_HD uint32_t mn_hd_q8_code_signed(const float *map, float m, float inv) {
    uint32_t c = mn_hd_q8_nearest(map, m * inv);
    if (m < 0.0f && map[c] >= 0.0f) c--;
    return c;
}
// One quantization block of len elements, serially: the order of operations the device kernel
// keeps per element (its block maxima are order-free). g = grad * grad_scale; mbuf, vbuf [len].
MN_HD void mn_hd_adamw8bit_block(float *param, uint8_t *code1, uint8_t *code2, float *absmax1,
                                 float *absmax2, const float *grad, uint64_t len,
                                 float grad_scale, const float *map1, const float *map2,
                                 const mn_hd_adamw8bit_coef *k, float *mbuf, float *vbuf) {
    float a1 = *absmax1, a2 = *absmax2, n1 = 0.0f, n2 = 0.0f, inv1, inv2;
    uint64_t j;
    for (j = 0; j < len; j++) {
        mn_hd_adamw8bit_moments(&mbuf[j], &vbuf[j], grad[j] * grad_scale, map1[code1[j]] * a1,
                                map2[code2[j]] * a2, k);
        if (fabsf(mbuf[j]) > n1) n1 = fabsf(mbuf[j]);
        if (vbuf[j] > n2) n2 = vbuf[j];
    }
    *absmax1 = n1, *absmax2 = n2;
    inv1 = n1 > 0.0f ? 1.0f / n1 : 0.0f;
    inv2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
    for (j = 0; j < len; j++) {
        if (mn_hd_isfinite(grad[j] * grad_scale))
            mn_hd_adamw8bit_param(&param[j], mbuf[j], vbuf[j], k);
        code1[j] = (uint8_t)mn_hd_q8_code_signed(map1, mbuf[j], inv1);
        code2[j] = (uint8_t)mn_hd_q8_nearest(map2, vbuf[j] * inv2);
    }
}

// Serial row versions, the order of operations a single device thread uses; the host tests run
// them against the reference ops. LayerNorm of one row x[C] (two-pass variance): y[C], *mu, *r.
MN_HD void mn_hd_layernorm_row(float *y, float *mu, float *r, const float *x, const float *w,
                               const float *b, uint64_t C, float eps) {
    uint64_t i;
    float s = 0.0f, m, v = 0.0f, rs;
    for (i = 0; i < C; i++) s += x[i];
    m = s / (float)C;
    for (i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
    rs = mn_hd_rstd(v / (float)C, eps);
    for (i = 0; i < C; i++) y[i] = mn_hd_layernorm_out(x[i], m, rs, w[i], b ? b[i] : 0.0f);
    *mu = m, *r = rs;
}
// Softmax of one row (n is the row index, for the causal mask): y[L] = softmax(scale x[L]),
// masked columns exactly 0.
MN_HD void mn_hd_softmax_row(float *y, const float *x, uint64_t n, uint64_t L,
                             float scale, int causal) {
    uint64_t j, len = mn_hd_softmax_len(n, L, causal);
    mn_hd_maxsum s = mn_hd_maxsum_init();
    for (j = 0; j < len; j++) s = mn_hd_maxsum_add(s, scale * x[j]);
    for (j = 0; j < L; j++) y[j] = j < len ? mn_hd_softmax_prob(scale * x[j], s) : 0.0f;
}
// Fused cross-entropy of one row: *loss, and dlogit[V] = (p - onehot) dloss (may equal logit).
// target < 0: an ignored row, loss 0 and zero gradient. The sum of exp runs in 64 partial states
// over j = k, k + 64, ... merged in order, as a block's threads split a row: one fp32 running sum
// over a vocabulary of 50257 drifts by about 1e-4 of itself, a 64th of the terms each far less.
MN_HD void mn_hd_crossentropy_row(float *loss, float *dlogit, const float *logit, int target,
                                  uint64_t V, float dloss) {
    enum { K = 64 };
    uint64_t j;
    mn_hd_maxsum part[K], s = mn_hd_maxsum_init();
    if (target < 0) {
        *loss = 0.0f;
        for (j = 0; j < V; j++) dlogit[j] = 0.0f;
        return;
    }
    for (j = 0; j < K; j++) part[j] = mn_hd_maxsum_init();
    for (j = 0; j < V; j++) part[j % K] = mn_hd_maxsum_add(part[j % K], logit[j]);
    for (j = 0; j < K; j++) s = mn_hd_maxsum_merge(s, part[j]);
    *loss = mn_hd_ce_loss(s, logit[target]);
    for (j = 0; j < V; j++) dlogit[j] = mn_hd_ce_dlogit(logit[j], s, (long long)j == target, dloss);
}

// Attention on the device (mn_cuda_attention_*): q, k, v (and dout) are gathered into per-head
// buffers [B,NH,T,hsp] so that the score and value GEMMs are uniformly strided batches over the
// B*NH heads; hsp = hs rounded up to 8 elements keeps every head row 16-byte aligned (the padding
// is never read). Element i of a [B,T,parts*C] tensor (parts 3: qkv, 1: out/dout) goes to element
// mn_hd_head_index(...) of head buffer *part (0 = q, 1 = k, 2 = v).
MN_HD uint64_t mn_hd_head_ld(uint64_t hs) { return (hs + 7) / 8 * 8; }
MN_HD uint64_t mn_hd_head_index(uint64_t i, uint64_t T, uint64_t C, uint64_t NH, uint64_t hsp,
                                uint64_t parts, uint64_t *part) {
    uint64_t hs = C / NH, bt = i / (parts * C), r = i % (parts * C), c = r % C;
    *part = r / C;
    return ((bt / T * NH + c / hs) * T + bt % T) * hsp + c % hs;
}

// The attention GEMMs per head in cuBLAS's column-major view (a row-major [T,hs] head buffer is
// the hs x T matrix with ld hsp, a row-major [T,T] score buffer the T x T matrix with ld T), and
// causal attention's split into query blocks so that the masked half is not computed: block c of
// nb holds query rows [r0, r1) (multiples of 8 but the end) and sees keys [0, r1):
//   QKT  S^T[keys 0..r1, queries r0..r1] = k . q^T      (also dP^T from v and dy)
//   PV   y^T[:, queries r0..r1] = v^T[:, keys 0..r1] . P^T[keys 0..r1, queries r0..r1]
//                                                       (also dq^T from k and dS)
//   PTV  dk^T[:, keys r0..r1] = q^T[:, queries r0..T] . dS[queries r0..T, keys r0..r1]
//                                                       (also dv^T from dy and P; rows = keys)
// Scores right of a block's keys are never computed; the softmax reads none of them and writes
// them 0. Without causal one block covers all: the plain T x T products.
enum { MN_HD_ATT_QKT, MN_HD_ATT_PV, MN_HD_ATT_PTV };
typedef struct mn_hd_att_gemm {
    int ta, tb;                   // op(A), op(B) transposed
    uint64_t m, n, k;             // D is m x n = op(A) (m x k) . op(B) (k x n)
    uint64_t lda, ldb, ldd;
    uint64_t a, b, d;             // element offsets of A, B and D within a head's buffers
} mn_hd_att_gemm;
// Query blocks of causal attention over T positions: 4 from T = 256 on, else 1.
MN_HD uint64_t mn_hd_att_blocks(uint64_t T, int causal) { return causal && T >= 256 ? 4 : 1; }
MN_HD void mn_hd_att_block_rows(uint64_t T, uint64_t nb, uint64_t c, uint64_t *r0, uint64_t *r1) {
    uint64_t step = ((T + nb - 1) / nb + 7) / 8 * 8;
    *r0 = c * step < T ? c * step : T;
    *r1 = (c + 1) * step < T && c + 1 < nb ? (c + 1) * step : T;
}
MN_HD mn_hd_att_gemm mn_hd_att_gemm_block(int form, uint64_t T, uint64_t hs, uint64_t hsp,
                                          uint64_t r0, uint64_t r1) {
    mn_hd_att_gemm g;
    g.lda = hsp, g.ldb = form == MN_HD_ATT_QKT ? hsp : T, g.ldd = form == MN_HD_ATT_QKT ? T : hsp;
    g.n = r1 - r0;
    if (form == MN_HD_ATT_QKT) {
        g.ta = 1, g.tb = 0, g.m = r1, g.k = hs;
        g.a = 0, g.b = r0 * hsp, g.d = r0 * T;
    } else if (form == MN_HD_ATT_PV) {
        g.ta = 0, g.tb = 0, g.m = hs, g.k = r1;
        g.a = 0, g.b = r0 * T, g.d = r0 * hsp;
    } else {
        g.ta = 0, g.tb = 1, g.m = hs, g.k = T - r0;
        g.a = r0 * hsp, g.b = r0 * T + r0, g.d = r0 * hsp;
    }
    return g;
}

// SGD per element, the arithmetic of mn_sgd_step (torch.optim.SGD):
//   g *= grad_scale;  g = -g (maximize);  g += wd p;  b = g (first step) or mu b + (1 - damp) g;
//   g = g + mu b (nesterov) or b;  p -= lr g.  b may be NULL when momentum is 0.
typedef struct mn_hd_sgd_coef {
    float lr, momentum, dampening, weight_decay;
    int nesterov, maximize, first;  // first: step 1, the buffer starts as the gradient
} mn_hd_sgd_coef;
MN_HD void mn_hd_sgd(float *p, float *b, float g, float grad_scale, const mn_hd_sgd_coef *k) {
    g *= grad_scale;
    if (k->maximize) g = -g;
    if (k->weight_decay != 0.0f) g = g + k->weight_decay * *p;
    if (k->momentum != 0.0f) {
        *b = k->first ? g : *b * k->momentum + (1.0f - k->dampening) * g;
        g = k->nesterov ? g + k->momentum * *b : *b;
    }
    *p = *p - k->lr * g;
}

// Lion per element, the arithmetic of mn_lion_step (Chen et al. 2023):
//   g *= grad_scale;  c = b1 m + (1 - b1) g;  p = p decay - lr sign(c) (sign(0) = 0);
//   m = b2 m + (1 - b2) g;  decay = 1 - lr wd computed in double as the host step does.
typedef struct mn_hd_lion_coef {
    float lr, beta1, beta2, decay;
} mn_hd_lion_coef;
MN_HD mn_hd_lion_coef mn_hd_lion_coefs(float lr, float beta1, float beta2, float weight_decay) {
    mn_hd_lion_coef k;
    k.lr = lr, k.beta1 = beta1, k.beta2 = beta2;
    k.decay = (float)(1.0 - (double)lr * (double)weight_decay);
    return k;
}
MN_HD void mn_hd_lion(float *p, float *m, float g, float grad_scale, const mn_hd_lion_coef *k) {
    float mm = *m, c, sg;
    g *= grad_scale;
    c = mm * k->beta1 + (1.0f - k->beta1) * g;
    sg = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
    *p = *p * k->decay - k->lr * sg;
    *m = mm * k->beta2 + (1.0f - k->beta2) * g;
}

// Adafactor per element, the arithmetic of mn_adafactor_step (transformers Adafactor): the step's
// scalars from t (rho, beta2_t in double as the host step) and, on the device, alpha from RMS(p);
// the update before clipping u = g rsqrt(R_i / mean(R)) rsqrt(C_j) (factored) or g rsqrt(V);
// then u = u / clip_div alpha, m = b1 m + (1 - b1) u (u = m), p += -wd alpha p, p -= u.
typedef struct mn_hd_adafactor_coef {
    double rho;               // the relative or fixed step
    float b2t, w2t;           // beta2_t = 1 - t^decay_rate and 1 - beta2_t
    float eps1, eps2, beta1, weight_decay;
    int no_scale_parameter;
} mn_hd_adafactor_coef;
MN_HD mn_hd_adafactor_coef mn_hd_adafactor_coefs(float lr, float eps1, float eps2,
                                                 float decay_rate, float beta1, float weight_decay,
                                                 int no_scale_parameter, int warmup_init,
                                                 uint64_t step) {
    mn_hd_adafactor_coef k;
    double t = (double)step, beta2t = 1.0 - pow(t, (double)decay_rate);
    k.rho = lr > 0.0f ? (double)lr : fmin(warmup_init ? 1e-6 * t : 1e-2, 1.0 / sqrt(t));
    k.b2t = (float)beta2t, k.w2t = (float)(1.0 - beta2t);
    k.eps1 = eps1, k.eps2 = eps2, k.beta1 = beta1, k.weight_decay = weight_decay;
    k.no_scale_parameter = no_scale_parameter;
    return k;
}
// alpha_t from the parameter's RMS (rms = (float)sqrt(sum p^2 / n), the sum in double).
MN_HD float mn_hd_adafactor_alpha(const mn_hd_adafactor_coef *k, float rms) {
    return (float)(k->no_scale_parameter ? k->rho : fmax((double)k->eps2, (double)rms) * k->rho);
}
// A moment's running mean: x = b2t x + w2t mean, mean = (sum of g^2 + eps1 in double) / count.
MN_HD float mn_hd_adafactor_moment(float x, double sum, uint64_t count,
                                   const mn_hd_adafactor_coef *k) {
    return x * k->b2t + k->w2t * (float)(sum / (double)count);
}
// u's factors: rsqrt(R_i / mean(R)) of a row, rsqrt(C_j) of a column (a kernel that walks rows
// or columns takes each once; the product below is the same bits).
MN_HD float mn_hd_adafactor_row_factor(float row, float row_mean) {
    return 1.0f / sqrtf(row / row_mean);
}
MN_HD float mn_hd_adafactor_col_factor(float col) { return 1.0f / sqrtf(col); }
MN_HD float mn_hd_adafactor_u(float g, float row, float row_mean, float col) {
    return mn_hd_adafactor_row_factor(row, row_mean) * mn_hd_adafactor_col_factor(col) * g;
}
MN_HD float mn_hd_adafactor_u_vec(float g, float v) { return (1.0f / sqrtf(v)) * g; }
// clip_div = max(1, RMS(u) / d) from the sum of u^2 (double) over n elements.
MN_HD float mn_hd_adafactor_clip_div(double sum_u2, uint64_t n, float clip_threshold) {
    double c = sqrt(sum_u2 / (double)n) / (double)clip_threshold;
    return (float)(c > 1.0 ? c : 1.0);
}
MN_HD void mn_hd_adafactor_apply(float *p, float *m, float u, float clip_div, float alpha,
                                 const mn_hd_adafactor_coef *k) {
    u = (clip_div == 1.0f ? u : u / clip_div) * alpha;  // (u / 1 is u: no division then)
    if (m) u = *m = *m * k->beta1 + (1.0f - k->beta1) * u;
    if (k->weight_decay != 0.0f) *p = *p + (-k->weight_decay * alpha) * *p;
    *p = *p - u;
}

// The device scratch memanat_cuda.cu's attention takes (mn_cuda_attention_forward / _backward):
// per-head buffers of B*NH*T*hsp elements of esz bytes (forward q, k, v, y; backward q, k, v, dy,
// dq, dk, dv), and B*NH*T*T ones for the probabilities where the caller keeps no att (forward)
// and for dP, dS and, without att, the recomputed probabilities (backward), each rounded up to
// 256 bytes, in *out. trainer.c --device cuda holds the backward's as a block of its cache, and
// the estimator's memanat framework on a GPU predicts that block. MN_ERR_OVERFLOW where the count
// passes 64 bits.
MNDEF mn_result mn_attention_scratch(uint64_t B, uint64_t T, uint64_t C, uint64_t NH,
                                     uint64_t esz, int backward, int att_kept, uint64_t *out);

#ifdef MEMANAT_CUDA
// This block precedes >>cache and >>optim (its place in the file), so it names their types by
// struct tag: struct mn_device is mn_device, struct mn_adamw_params is mn_adamw_params (likewise
// mn_adamw8bit_params, mn_sgd_params, mn_lion_params and mn_adafactor_params), and a stream is an
// mn_stream (uint32_t).
struct mn_device;
struct mn_adamw_params;
struct mn_adamw8bit_params;
struct mn_sgd_params;
struct mn_lion_params;
struct mn_adafactor_params;
#define MN_CUDA_MAX_STREAMS 8  // streams a context hands out (mn_stream 0 is ctx->stream)
#define MN_CUDA_TUNE_CANDIDATES 8  // cuBLASLt candidates mn_cuda_desc.gemm_tune times a shape

typedef struct mn_cuda_desc {
    int device;                // CUDA device index, 0 = device 0
    int tf32;                  // 1 = fp32 GEMMs on TF32 tensor cores, 0 = full fp32
    int no_fused_epilogues;    // 1 = GEMMs never use cuBLASLt epilogues (the unfused kernels run)
    int gemm_tune;             // 1 = the first GEMM of each shape that overwrites its output
                               // (beta 0: the forward's and attention's GEMMs) times up to
                               // MN_CUDA_TUNE_CANDIDATES of cuBLASLt's candidates on the call's
                               // own buffers (no memory of its own; one stream sync a shape) and
                               // keeps the fastest; accumulating GEMMs keep the heuristic's first.
                               // Which candidate wins can differ between runs, and with it the
                               // last bits; 0 = the heuristic's first, bit-reproducible
    uint64_t workspace;        // cuBLASLt workspace bytes, 0 = the GPU table's cublas_workspace
                               // for the device's SM (32 MiB on sm 90+, 4 MiB otherwise)
    mn_allocator allocator;    // host memory for the private state, all-zero = malloc/free
    mn_logger logger;          // CUDA / cuBLAS failures: the call, the error name and text
    void *stream;              // a cudaStream_t of the caller's that every call runs on (kept:
                               // never destroyed; e.g. another context's ctx->stream, so both
                               // are ordered), NULL = the context creates a non-blocking stream
} mn_cuda_desc;

typedef struct mn_cuda {       // fields are read-only for callers
    mn_cuda_desc desc;         // resolved
    int sm;                    // compute capability x 10 (90 = H100)
    int sm_count;              // streaming multiprocessors
    char name[256];            // cudaDeviceProp.name
    uint64_t total_bytes;      // device memory (cudaMemGetInfo)
    uint64_t workspace_bytes;  // the resolved cuBLASLt workspace, held for the context's life
    void *stream;              // cudaStream_t (non-blocking) every call runs on
    void *lt;                  // cublasLtHandle_t
    void *workspace;           // [workspace_bytes] device memory
    uint64_t gemm_fused, gemm_unfused;  // GEMMs served with a fused epilogue / by the fallback
    uint64_t gemm_tuned;       // GEMM shapes whose candidates were timed (desc.gemm_tune)
    struct mn__cuda_priv *p;   // streams, event pool, GEMM heuristics cache, scratch, driver API
} mn_cuda;

// Whether a device answers: *count CUDA devices, MN_OK; MN_ERR_DEVICE with the reason in
// reason[cap] (e.g. "cudaGetDeviceCount: no CUDA-capable device is detected") when none does.
MNDEF mn_result mn_cuda_device_count(int *count, char *reason, size_t cap);
MNDEF mn_result mn_cuda_init(mn_cuda *ctx, const mn_cuda_desc *desc);
MNDEF void mn_cuda_free(mn_cuda *ctx);   // waits for the stream, releases everything
MNDEF mn_result mn_cuda_sync(mn_cuda *ctx);  // waits for ctx->stream
// Another stream for the caching allocator's cross-stream tests and programs: *out is the
// mn_stream number (1..MN_CUDA_MAX_STREAMS-1); mn_cuda_stream_get gives its cudaStream_t.
MNDEF mn_result mn_cuda_stream_create(mn_cuda *ctx, uint32_t *out);
MNDEF mn_result mn_cuda_stream_get(mn_cuda *ctx, uint32_t s, void **cuda_stream_out);

// Plain device memory and copies (tests, benchmarks). Copies are synchronous (cudaMemcpyDefault
// on ctx->stream, then a wait); mem_set is asynchronous.
MNDEF mn_result mn_cuda_mem_alloc(mn_cuda *ctx, uint64_t bytes, void **ptr_out);
MNDEF mn_result mn_cuda_mem_release(mn_cuda *ctx, void *ptr);
MNDEF mn_result mn_cuda_mem_copy(mn_cuda *ctx, void *dst, const void *src, uint64_t bytes);
MNDEF mn_result mn_cuda_mem_set(mn_cuda *ctx, void *ptr, int byte, uint64_t bytes);
// The cuBLASLt workspace from the caller: ptr [bytes] device memory (16-byte aligned) the caller
// keeps alive while the context uses it, e.g. a block of its caching allocator, so that the
// allocator's statistics include it. The context's own workspace is freed (after a wait) and the
// heuristics cache emptied; ptr NULL with bytes 0: GEMMs run without a workspace.
MNDEF mn_result mn_cuda_workspace_set(mn_cuda *ctx, void *ptr, uint64_t bytes);
// The kernels' scratch from the caller: ptr [bytes] device memory (256-byte aligned) kept alive
// while the context uses it, e.g. a block of its caching allocator sized by
// mn_attention_scratch, so that the allocator's statistics include it. A kernel that needs
// more takes the context's own scratch (cudaMalloc, grown, never shrunk) as without one; ptr NULL
// with bytes 0: the context's own alone.
MNDEF mn_result mn_cuda_scratch_set(mn_cuda *ctx, void *ptr, uint64_t bytes);

// (mn_cuda_device, the caching allocator's device over this context, is declared after mn_device
// in >>cache.)

// >>ops on the device. dtype (0 = MN_FP32, MN_FP16, MN_BF16) is the storage type of every
// float tensor argument except those marked fp32; the math is fp32. Same semantics as the CPU
// op of the same name unless a comment says otherwise (backwards accumulate +=).

// out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (bias may be NULL); pre_gelu [N,OC] non-NULL:
// pre_gelu = inp @ weight^T + bias and out = gelu(pre_gelu). cuBLASLt's BIAS / GELU_AUX_BIAS
// epilogue when it accepts the shape, else the plain GEMM and a bias/GELU kernel.
MNDEF mn_result mn_cuda_matmul_forward(mn_cuda *ctx, void *out, void *pre_gelu, const void *inp,
                                       const void *weight, const void *bias, size_t N, size_t C,
                                       size_t OC, mn_dtype dtype);
// dinp[N,C] += dpre @ weight, dweight[OC,C] += dpre^T @ inp, dbias[OC] += sum_n dpre (any of the
// three may be NULL); dpre = dout, or dout * gelu'(pre_gelu) written over dout when pre_gelu is
// non-NULL. dbias through the BGRADB epilogue of the dweight GEMM when accepted, else a
// deterministic column-sum kernel (fused with the GELU backward when pre_gelu is given).
MNDEF mn_result mn_cuda_matmul_backward(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                        void *dout, const void *inp, const void *weight,
                                        const void *pre_gelu, size_t N, size_t C, size_t OC,
                                        mn_dtype dtype);

// LayerNorm: out[N,C], mean[N] and rstd[N] fp32 (may be NULL), inp[N,C], weight[C], bias[C] or
// NULL. One warp per row.
MNDEF mn_result mn_cuda_layernorm_forward(mn_cuda *ctx, void *out, float *mean, float *rstd,
                                          const void *inp, const void *weight, const void *bias,
                                          size_t N, size_t C, float eps, mn_dtype dtype);
// Residual add fused with the LayerNorm that follows it: residual[N,C] = inp1 + inp2 (stored in
// dtype), then out = layernorm(residual) as above (computed from the stored residual).
MNDEF mn_result mn_cuda_residual_layernorm_forward(mn_cuda *ctx, void *residual, void *out,
                                                   float *mean, float *rstd, const void *inp1,
                                                   const void *inp2, const void *weight,
                                                   const void *bias, size_t N, size_t C,
                                                   float eps, mn_dtype dtype);
// dinp[N,C] +=, dweight[C] +=, dbias[C] += (either may be NULL; deterministic: per-block partial
// sums in fp32, then a fixed-order reduction); mean, rstd fp32 from the forward.
MNDEF mn_result mn_cuda_layernorm_backward(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                           const void *dout, const void *inp, const void *weight,
                                           const float *mean, const float *rstd, size_t N,
                                           size_t C, mn_dtype dtype);

// Softmax over rows of L: out[N,L] = softmax(scale inp[N,L]), causal as the CPU op (masked 0).
MNDEF mn_result mn_cuda_softmax_forward(mn_cuda *ctx, void *out, const void *inp, size_t N,
                                        size_t L, float scale, int causal, mn_dtype dtype);
MNDEF mn_result mn_cuda_softmax_backward(mn_cuda *ctx, void *dinp, const void *dout,
                                         const void *out, size_t N, size_t L, float scale,
                                         int causal, mn_dtype dtype);

// Multi-head attention over a fused qkv [B,T,3C] as mn_attention_forward: out[B,T,C]; att
// [B,NH,T,T] receives the probabilities (masked entries 0) or is NULL (the backward recomputes
// them). Two strided-batched cuBLASLt GEMMs over the B*NH heads (scores = q k^T, out = p v, the
// full T x T product even when causal) around the fused scaled causal softmax of
// mn_cuda_softmax_forward, run in place on the scores. q, k, v are first gathered into per-head
// [B,NH,T,hsp] buffers (mn_hd_head_index) in the context's device scratch, because no single
// batch stride walks the heads of a [B,T,3C] buffer (b moves by T*3C, h by hs); the scratch also
// holds the scores when att is NULL and the per-head output: 4 B*NH*T*hsp + (att ? 0 :
// B*NH*T*T) elements of dtype, grown on demand (the call then waits for the stream). Scores and
// probabilities are stored in dtype between the kernels, as att is. Causal: the softmax reads
// only the t + 1 visible scores of row t (forward) and touches no masked entry (backward); from
// T = 256 on every GEMM runs as 4 query blocks, each against only the keys it sees (a cuBLASLt
// batch has one shape for all its members and no triangular product, so the blocks are separate
// launches; k blocks save (k - 1) / 2k of the FLOPs, 37.5 % at 4), mn_hd_att_gemm_block. The
// masked scores are then not written by the GEMMs; att's masked entries are 0 all the same.
MNDEF mn_result mn_cuda_attention_forward(mn_cuda *ctx, void *out, void *att, const void *qkv,
                                          size_t B, size_t T, size_t C, size_t NH, int causal,
                                          mn_dtype dtype);
// dqkv[B,T,3C] += the gradient, dout[B,T,C], qkv[B,T,3C], att [B,NH,T,T] from the forward or NULL
// (recomputed into scratch). dp = dout v^T, ds = softmax backward (scaled), dq = ds k,
// dk = ds^T q, dv = p^T dout: four batched GEMMs (five with att NULL), written into per-head
// scratch and added into dqkv by one kernel. Scratch: 7 B*NH*T*hsp + (att ? 2 : 3) B*NH*T*T elements of dtype.
MNDEF mn_result mn_cuda_attention_backward(mn_cuda *ctx, void *dqkv, const void *dout,
                                           const void *qkv, const void *att, size_t B, size_t T,
                                           size_t C, size_t NH, int causal, mn_dtype dtype);

// Residual: out[n] = inp1[n] + inp2[n] (out may equal either input), as mn_residual_forward.
MNDEF mn_result mn_cuda_residual_forward(mn_cuda *ctx, void *out, const void *inp1,
                                         const void *inp2, size_t n, mn_dtype dtype);

// GELU (tanh): out[n] = gelu(inp[n]) (out may equal inp); dinp[n] += dout * gelu'(inp).
MNDEF mn_result mn_cuda_gelu_forward(mn_cuda *ctx, void *out, const void *inp, size_t n,
                                     mn_dtype dtype);
MNDEF mn_result mn_cuda_gelu_backward(mn_cuda *ctx, void *dinp, const void *dout, const void *inp,
                                      size_t n, mn_dtype dtype);

// The LM head's softmax + cross-entropy + gradient in one kernel, probabilities never stored:
// losses[N] fp32 = -log softmax(logits[n,:])[targets[n]]; dlogits[N,V] = (softmax - onehot) *
// dloss, WRITTEN (not accumulated; dlogits may equal logits, as llm.c's fused classifier).
// dlogits NULL: the loss only. targets[N] int32 on the device; a negative target is an ignored row
// (loss 0, zero gradient); a target >= V is not checked on the device and gives a NaN loss.
MNDEF mn_result mn_cuda_crossentropy_forward_backward(mn_cuda *ctx, float *losses, void *dlogits,
                                                      const void *logits, const int *targets,
                                                      float dloss, size_t N, size_t V,
                                                      mn_dtype dtype);

// Embedding: out[B,T,C] = wte[tokens[b,t],:] + wpe[t,:] (wpe may be NULL); tokens[B,T] int32 on
// the device; a token outside [0,V) gives a NaN row (not an error: it is not checked on the host).
MNDEF mn_result mn_cuda_embedding_forward(mn_cuda *ctx, void *out, const int *tokens,
                                          const void *wte, const void *wpe, size_t B, size_t T,
                                          size_t C, size_t V, mn_dtype dtype);
// Deterministic scatter-add: dwte[tokens[b,t],:] += dout[b,t,:], dwpe[t,:] += dout[b,t,:]
// (either may be NULL). The tokens are copied to the host and bucketed there (a stable counting
// sort), so every row of dwte sums its positions in order, without atomics: the call waits for
// the stream. MN_ERR_INVALID_ARG for a token outside [0,V), nothing written.
MNDEF mn_result mn_cuda_embedding_backward(mn_cuda *ctx, void *dwte, void *dwpe, const void *dout,
                                           const int *tokens, size_t B, size_t T, size_t C,
                                           size_t V, mn_dtype dtype);

// Global gradient norm: norm_out [1] fp32 on the device = sqrt(sum grad[i]^2) over grad[n]
// (deterministic two-pass sum); inf or NaN when any element is non-finite (the found-inf check).
MNDEF mn_result mn_cuda_global_norm(mn_cuda *ctx, float *norm_out, const void *grad, uint64_t n,
                                    mn_dtype dtype);

// The optimizer steps over flat buffers share these fields (each args struct embeds them first as
// .flat): fp32 master weights updated in place, a 16-bit copy rewritten from them, the gradients
// read in their own type, and the loss scaler's found-inf check, unscale and the clipping by the
// global norm fused into the step.
typedef struct mn_cuda_optim_flat {
    float *param;              // [n] fp32 master weights, updated
    void *param16;             // [n] 16-bit copy rewritten from param (param16_dtype), or NULL
    const void *grad;          // [n] gradients (grad_dtype), read only
    uint64_t n;                // elements (Adafactor: batch * rows * cols)
    mn_dtype grad_dtype;       // 0 = fp32
    mn_dtype param16_dtype;    // MN_FP16 or MN_BF16 when param16 is given
    uint64_t step;             // t, 1 for the first step (bias corrections; unused by Lion)
    const float *grad_norm;    // [1] on the device from mn_cuda_global_norm over the (scaled)
                               // gradients, or NULL. Non-finite: the step is skipped on the
                               // device (found inf; nothing written, read it back for the scaler)
    float inv_scale;           // the loss scaler's 1/scale, 0 = 1 (the unscale, fused)
    float max_norm;            // clip by the unscaled global norm (needs grad_norm), 0 = none
} mn_cuda_optim_flat;

// AdamW step over flat buffers, mn_adamw_step's arithmetic per element (mn_hd_adamw).
typedef struct mn_cuda_adamw_args {
    mn_cuda_optim_flat flat;
    float *exp_avg;            // [n] m
    float *exp_avg_sq;         // [n] v
} mn_cuda_adamw_args;
// p: lr, betas, eps, weight_decay, maximize as mn_adamw_params with its defaults (0 = default,
// MN_OPTIM_ZERO = exactly zero); amsgrad is MN_ERR_UNSUPPORTED here.
MNDEF mn_result mn_cuda_adamw_step(mn_cuda *ctx, const struct mn_adamw_params *p,
                                   const mn_cuda_adamw_args *a);

// 8-bit AdamW over flat buffers, mn_adamw8bit_step's arithmetic (mn_hd_adamw8bit_*): the state of
// mn_adamw8bit (its layout: quantized, the per-block scales absmax1, absmax2 [blocks] and the
// codes code1, code2 [n] into the signed and unsigned dynamic maps; else fp32 exp_avg and
// exp_avg_sq [n]). Per quantization block: dequantize, the moments, the block's new scales
// (max |m|, max v), the parameter update from the fp32 moments, re-quantize; a warp a block for
// the default block size 256 (16-byte aligned param, grad and param16, 8-byte aligned codes; its
// update's square root and divide are the hardware's approximations, within 2 ulp), else a
// thread block a block. The two maps (mn_dynamic_map) are uploaded once per context. An element
// with a non-finite gradient is left unchanged, as on the host.
typedef struct mn_cuda_adamw8bit_args {
    mn_cuda_optim_flat flat;
    uint8_t *code1, *code2;    // [n] quantized m and v, or NULL for a small tensor
    float *absmax1, *absmax2;  // [ceil(n / block_size)] their block scales
    float *exp_avg, *exp_avg_sq;  // [n] fp32 m and v of a small tensor (codes NULL)
} mn_cuda_adamw8bit_args;
// p: mn_adamw8bit_params with its defaults (block_size 256, up to 4096); min_8bit_size is not
// read: the codes being given or not decide.
MNDEF mn_result mn_cuda_adamw8bit_step(mn_cuda *ctx, const struct mn_adamw8bit_params *p,
                                       const mn_cuda_adamw8bit_args *a);

// SGD with momentum over flat buffers, mn_sgd_step's arithmetic per element (mn_hd_sgd).
typedef struct mn_cuda_sgd_args {
    mn_cuda_optim_flat flat;
    float *momentum_buffer;    // [n] b, NULL when momentum is 0 (step 1 writes it whole)
} mn_cuda_sgd_args;
// p: mn_sgd_params with its defaults (lr 1e-3, momentum/dampening/weight_decay 0); nesterov
// needs momentum > 0 and dampening 0 (MN_ERR_INVALID_ARG otherwise, as mn_sgd_init).
MNDEF mn_result mn_cuda_sgd_step(mn_cuda *ctx, const struct mn_sgd_params *p,
                                 const mn_cuda_sgd_args *a);

// Lion over flat buffers, mn_lion_step's arithmetic per element (mn_hd_lion).
typedef struct mn_cuda_lion_args {
    mn_cuda_optim_flat flat;
    float *exp_avg;            // [n] m (zero before the first step)
} mn_cuda_lion_args;
// p: mn_lion_params with its defaults (lr 1e-4, betas 0.9 / 0.99, weight_decay 0).
MNDEF mn_result mn_cuda_lion_step(mn_cuda *ctx, const struct mn_lion_params *p,
                                  const mn_cuda_lion_args *a);

// Adafactor over one parameter tensor, mn_adafactor_step's arithmetic (mn_hd_adafactor_*). The
// tensor is [batch, rows, cols] (mn_adafactor's batch, rows, cols; flat.n their product):
// factored when exp_avg_sq_row is given (R [batch, rows], C [batch, cols]), else V [n] with
// batch = rows = 1, cols = n. Kernels in order: RMS(param) and alpha_t; factored, the row means
// (a warp per row), mean(R) (a block per batch), the column means with the sums of g^2 / R_i
// beside them (partial sums per 64-row chunk, then the chunks in order), the update's RMS from
// those (u^2 = g^2 mean(R) / (R_i C_j), as the host step sums it), the update (a thread a pack of
// 8 where cols is a multiple of 8 and the tensors 16-byte aligned, else a thread block a row, or
// an element a thread for rows under 128 columns); not factored, V with the update's RMS, then
// the update. Every sum in double, in a fixed order (deterministic). Scratch: 16 bytes x batch x
// cols x min(512, rows / 64), 8 x batch x rows, 12 x batch x cols and a few KiB.
typedef struct mn_cuda_adafactor_args {
    mn_cuda_optim_flat flat;
    float *exp_avg_sq_row;     // [batch, rows] R (zero before the first step), NULL: not factored
    float *exp_avg_sq_col;     // [batch, cols] C, factored
    float *exp_avg_sq;         // [n] V, not factored
    float *exp_avg;            // [n] m when beta1 is set, else NULL
    uint64_t batch, rows, cols;  // n = batch * rows * cols
} mn_cuda_adafactor_args;
// p: mn_adafactor_params with its defaults (relative step when lr is 0); beta1 set needs exp_avg.
MNDEF mn_result mn_cuda_adafactor_step(mn_cuda *ctx, const struct mn_adafactor_params *p,
                                       const mn_cuda_adafactor_args *a);
#endif  // MEMANAT_CUDA

// >>hfconfig --------------------------------------------------------------------------------------
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
// >>cache -----------------------------------------------------------------------------------------
//
// A caching allocator for device memory whose default policy is PyTorch's native CUDA caching
// allocator (c10/cuda/CUDACachingAllocator.cpp), block for block: requests are rounded to 512 B
// (or to power-of-two divisions), served best-fit by (stream, size, address) from a small pool
// (<= 1 MiB, 2 MiB segments) or a large pool (20 MiB segments below 10 MiB, 2 MiB-rounded above),
// split and merged inside segments, and the device is asked for a new segment only on a miss,
// after which the out-of-memory ladder frees cached segments and retries.
//
// It runs over a device interface (mn_device). The header ships a simulated device (mn_simdev):
// deterministic fake addresses, a capacity, events completed by hand, injectable failures, and
// virtual-address reservation mapped in granules (for expandable segments), so every path is
// testable on the CPU.
//
// Observability: PyTorch's full statistics set plus statistics per memory category, the
// memory_summary() table, the OOM message, a history ring buffer, a snapshot whose JSON
// pytorch.org/memory_viz opens, and an SVG memory timeline stacked by category. Writers send
// their text to a callback (mn_cache_write_fn); mn_cache_write_file writes to a FILE*.
//
// Thread safety: one mutex per allocator (pthreads). Define MEMANAT_NO_THREADS before the
// implementation to build without locking (then one thread at a time per allocator).
//
// Quick start (simulated 80 GiB device):
//   mn_sim_cache sc;  mn_simdev_desc dd = {0};  mn_cache_desc cd = {0};
//   struct mn_cache_stats st;  void *p;
//   dd.capacity = 80ull << 30;  cd.config = "expandable_segments:True";  // NULL: PyTorch's
//   mn_sim_cache_init(&sc, &dd, &cd);
//   mn_cache_alloc(&sc.cache, 4 << 20, 0, MN_CAT_ACTIVATIONS, "attn.qkv", &p);
//   mn_cache_release(&sc.cache, p);
//   mn_cache_stats(&sc.cache, &st);   // st.reserved_bytes[MN_STAT_ALL].peak, ...
//   mn_sim_cache_free(&sc);
// Over a device of your own: fill mn_cache_desc.device and call mn_cache_init / mn_cache_free.

typedef uint32_t mn_stream;  // a device stream; 0 = the default stream
typedef uint64_t mn_event;   // a device event handle; 0 = none

// Device interface. Addresses are opaque; the allocator never dereferences them.
typedef struct mn_device {
    // Required. MN_ERR_DEVICE_OOM when the device is out of memory (the allocator then frees
    // cached segments and retries); any other error is returned to the caller at once.
    mn_result (*alloc_fn)(void *user_data, uint64_t size, void **ptr_out);
    mn_result (*free_fn)(void *user_data, void *ptr, uint64_t size);
    // Optional: free and total device bytes (the OOM message, the memory fraction).
    mn_result (*mem_info_fn)(void *user_data, uint64_t *free_out, uint64_t *total_out);
    // Optional events. Without them a cross-stream use needs no waiting and a block freed after
    // mn_cache_record_stream() is reusable at once.
    mn_result (*event_record_fn)(void *user_data, mn_stream stream, mn_event *event_out);
    int (*event_query_fn)(void *user_data, mn_event event);       // 1 = the work before it is done
    mn_result (*event_sync_fn)(void *user_data, mn_event event);  // waits until it is done
    void (*event_free_fn)(void *user_data, mn_event event);
    // Optional virtual memory, needed by expandable_segments:True (cuMemAddressReserve/cuMemMap).
    mn_result (*reserve_fn)(void *user_data, uint64_t size, void **base_out);
    mn_result (*unreserve_fn)(void *user_data, void *base, uint64_t size);
    mn_result (*map_fn)(void *user_data, void *addr, uint64_t size);  // MN_ERR_DEVICE_OOM if full
    mn_result (*unmap_fn)(void *user_data, void *addr, uint64_t size);
    void *user_data;
    // Device pointers are addresses >> addr_shift (0..9): a simulated device on a host whose
    // pointers have 32 bits reaches 2 TiB this way (block addresses are multiples of 512).
    // 0 = pointers are byte addresses.
    uint32_t addr_shift;
} mn_device;

#ifdef MEMANAT_CUDA
// >>cuda's device for the caching allocator: cudaMalloc/cudaFree/cudaMemGetInfo, events from a
// pool (cudaEventDisableTiming) recorded on the context's streams, and reserve/map through the
// CUDA virtual memory API (cuMemAddressReserve, cuMemCreate + cuMemMap + cuMemSetAccess per 2 MiB
// granule, the driver entry points resolved at init through cudaGetDriverEntryPointByVersion;
// reserve_fn is NULL when the driver lacks them). The mn_device refers to ctx: keep ctx alive
// and at the same address while the cache lives.
MNDEF mn_device mn_cuda_device(mn_cuda *ctx);
#endif

// ---- >>cache/simdev: simulated device -----------------------------------------------------------
// A bump allocator of fake addresses that are never reused (RMM's simulated_memory_resource
// does the same), a capacity in bytes, events that complete only when told to, and failure
// injection. Not thread-safe by itself: the allocator calls it under its own lock.
typedef struct mn_simdev_desc {
    uint64_t capacity;       // bytes, 0 = unlimited (mem_info then reports 1 PiB total)
    uint64_t base;           // first fake address, 0 = 0x7f0000000000
    uint64_t fail_alloc_at;  // the N-th device allocation (alloc or map) fails, 0 = never
    int events_complete;     // 1: events complete as soon as recorded, 0 = when completed by hand
    mn_allocator allocator;  // host memory for the event table
    uint32_t addr_shift;     // pointers carry addresses >> addr_shift (0..9, see mn_device);
                             // 0 = 9 where pointers have fewer than 64 bits, else none
} mn_simdev_desc;

typedef struct mn_simdev_event {
    mn_event id;
    mn_stream stream;
    int done;
} mn_simdev_event;

typedef struct mn_simdev {  // fields are read-only for callers
    mn_simdev_desc desc;     // resolved
    uint64_t used, peak_used;                // bytes allocated or mapped
    uint64_t next_addr, next_va;             // bump pointers (physical, reserved ranges)
    uint64_t end_addr, end_va;               // where each range ends
    uint64_t alloc_calls, free_calls, map_calls, unmap_calls, failed_calls;
    uint64_t live;                           // live device allocations (not maps)
    uint64_t fail_at;                        // alloc_calls + map_calls value that fails, 0 = none
    mn_event next_event;
    mn_simdev_event *events;                 // recorded and not yet freed
    uint32_t event_count, event_cap;
} mn_simdev;

MNDEF mn_result mn_simdev_init(mn_simdev *dev, const mn_simdev_desc *desc);
MNDEF void mn_simdev_free(mn_simdev *dev);
MNDEF mn_device mn_simdev_device(mn_simdev *dev);
// The n-th device allocation (alloc or map) from now on fails with MN_ERR_DEVICE_OOM; 0 = never.
MNDEF void mn_simdev_fail_alloc_at(mn_simdev *dev, uint64_t n);
MNDEF void mn_simdev_complete_event(mn_simdev *dev, mn_event event);
MNDEF void mn_simdev_sync_stream(mn_simdev *dev, mn_stream stream);  // completes its events
MNDEF void mn_simdev_sync(mn_simdev *dev);                           // completes every event
MNDEF uint32_t mn_simdev_pending_events(const mn_simdev *dev);

// ---- >>cache/hostdev: host memory as a device ---------------------------------------------------
// Real memory from the host allocator, each segment aligned to MN_HOSTDEV_ALIGN bytes, under an
// optional capacity, so a caching allocator hands out real buffers whose statistics are
// measurements: the memory of a CPU program (the trainer's tensors) seen as PyTorch would see
// device memory. Host work is synchronous, so the device has no events; it has no virtual memory
// either (expandable_segments:True is MN_ERR_UNSUPPORTED at mn_cache_init). Not thread-safe by
// itself: the allocator calls it under its own lock.
#define MN_HOSTDEV_ALIGN 512  // the allocator's block rounding, a multiple of every SIMD width

typedef struct mn_hostdev_desc {
    uint64_t capacity;       // bytes, 0 = unlimited (mem_info then reports 1 PiB total)
    uint64_t fail_alloc_at;  // the N-th device allocation fails with MN_ERR_DEVICE_OOM, 0 = never
    mn_allocator allocator;  // where the memory comes from, all-zero = MN_MALLOC/MN_FREE
} mn_hostdev_desc;

typedef struct mn_hostdev {  // fields are read-only for callers
    mn_hostdev_desc desc;     // resolved
    uint64_t used, peak_used; // bytes handed out as segments
    uint64_t alloc_calls, free_calls, failed_calls;
    uint64_t live;            // segments not yet returned
} mn_hostdev;

MNDEF mn_result mn_hostdev_init(mn_hostdev *dev, const mn_hostdev_desc *desc);
// MN_OK, or MN_ERR_STATE when segments are still live (they are not freed: their owner, the
// caching allocator, returns them in mn_cache_free, which must come first).
MNDEF mn_result mn_hostdev_free(mn_hostdev *dev);
MNDEF mn_device mn_hostdev_device(mn_hostdev *dev);

// ---- >>cache/config: configuration (PYTORCH_ALLOC_CONF) -----------------------------------------
#define MN_CACHE_ROUNDUP_INTERVALS 16  // power-of-two intervals from 1 MiB to 64 GiB

typedef struct mn_cache_config {
    uint64_t max_split_size;          // bytes, 0 = unlimited (max_split_size_mb, must be > 20 MiB)
    uint64_t max_non_split_rounding;  // bytes, 0 = 20 MiB (max_non_split_rounding_mb)
    uint64_t large_segment_size;      // bytes, 0 = 20 MiB (large_segment_size_mb)
    uint32_t roundup_power2_divisions[MN_CACHE_ROUNDUP_INTERVALS];  // 0 = plain 512 B rounding
    double garbage_collection_threshold;  // (0, 1), 0 = off; acts only with a memory fraction
    int expandable_segments;          // 1 = one growing segment per (stream, pool)
    int release_lock_on_cudamalloc;   // accepted; the simulated device is synchronous anyway
} mn_cache_config;

// Parses "<key>:<value>,<key>:<value>..." as PyTorch does (CUDAAllocatorConfig::parseArgs);
// NULL or "" gives the defaults (all zero). Unknown keys and bad values: MN_ERR_CONFIG and one
// message through the logger naming the key; backend:cudaMallocAsync is MN_ERR_UNSUPPORTED.
MNDEF mn_result mn_cache_config_parse(const char *text, mn_cache_config *out, const mn_logger *lg);

// The policy as pure functions (PyTorch round_size, get_allocation_size). cfg NULL = defaults.
MNDEF uint64_t mn_cache_round_size(const mn_cache_config *cfg, uint64_t size);
MNDEF uint64_t mn_cache_segment_size(const mn_cache_config *cfg, uint64_t rounded_size);

// ---- >>cache/alloc: the allocator ---------------------------------------------------------------
typedef struct mn_cache_desc {
    mn_device device;        // required: alloc_fn and free_fn
    const char *config;      // PYTORCH_CUDA_ALLOC_CONF grammar, NULL or "" = defaults
    const mn_cache_config *settings;  // already parsed settings, NULL = parse config
    uint32_t trace_entries;  // history ring buffer (snapshot device_traces, SVG), 0 = no history
    int device_index;        // the "GPU N" / "device ID N" printed in messages, 0 = 0
    mn_allocator allocator;  // host memory
    mn_logger logger;
} mn_cache_desc;

typedef struct mn_cache {
    struct mn__c_cache *p;  // private state; the caller owns this struct
} mn_cache;

typedef struct mn_stat {
    uint64_t current, peak, allocated, freed;
} mn_stat;

typedef enum mn_stat_type {  // PyTorch StatType
    MN_STAT_ALL = 0,         // aggregate
    MN_STAT_SMALL_POOL,
    MN_STAT_LARGE_POOL,
    MN_STAT_TYPE_COUNT
} mn_stat_type;

// The statistics: PyTorch's DeviceStats (c10/cuda/CUDACachingAllocator.h) plus statistics per
// memory category, one row each: X(kind, name, unit, label). Every use is generated from this
// list: the struct, the resets, mn_cache_check, memory_summary() and the flat memory_stats()
// items; a program's own report can use it the same way.
//   kind  POOL   mn_stat name[MN_STAT_TYPE_COUNT]   all, small pool, large pool
//         ONE    mn_stat name
//         COUNT  uint64_t name                      an event counter (an accumulated statistic)
//         VALUE  uint64_t name                      a setting (UINT64_MAX = unlimited)
//         CAT    mn_stat name[MN_CAT_COUNT]         memanat: per memory category
//         CATV   uint64_t name[MN_CAT_COUNT]
//   unit  BYTES or COUNT;  label: the row of memory_summary(), "" for none.
// POOL rows are in the order memory_summary() prints them.
#define MN_CACHE_STATS(X) \
    X(POOL, allocated_bytes, BYTES, "Allocated memory")      /* rounded block sizes */ \
    X(POOL, active_bytes, BYTES, "Active memory")                                     \
    X(POOL, requested_bytes, BYTES, "Requested memory")      /* unrounded sizes asked for */ \
    X(POOL, reserved_bytes, BYTES, "GPU reserved memory")    /* device bytes held */ \
    X(POOL, inactive_split_bytes, BYTES, "Non-releasable memory")                     \
    X(POOL, allocation, COUNT, "Allocations")                /* blocks handed to callers */ \
    X(POOL, active, COUNT, "Active allocs")                  /* allocated or awaiting events */ \
    X(POOL, segment, COUNT, "GPU reserved segments")         /* device allocations, not maps */ \
    X(POOL, inactive_split, COUNT, "Non-releasable allocs")  /* free blocks in split segments */ \
    X(ONE, oversize_allocations, COUNT, "Oversize allocations")  /* blocks >= max_split_size */ \
    X(ONE, oversize_segments, COUNT, "Oversize GPU segments")    /* segments >= max_split_size */ \
    X(COUNT, num_alloc_retries, COUNT, "")     /* cache flushes after a failed device alloc */ \
    X(COUNT, num_ooms, COUNT, "")              /* allocations failed after the whole ladder */ \
    X(COUNT, num_sync_all_streams, COUNT, "")                                         \
    X(COUNT, num_device_alloc, COUNT, "")      /* device allocations + maps */        \
    X(COUNT, num_device_free, COUNT, "")       /* device frees + unmaps */            \
    X(VALUE, max_split_size, BYTES, "")        /* UINT64_MAX = unlimited */           \
    X(CAT, cat_allocation, COUNT, "")                                                 \
    X(CAT, cat_allocated_bytes, BYTES, "")                                            \
    X(CAT, cat_requested_bytes, BYTES, "")                                            \
    X(CATV, cat_at_peak, BYTES, "")            /* allocated bytes at the allocated peak */

#define MN__STAT_FIELD_POOL(name) mn_stat name[MN_STAT_TYPE_COUNT];
#define MN__STAT_FIELD_ONE(name) mn_stat name;
#define MN__STAT_FIELD_COUNT(name) uint64_t name;
#define MN__STAT_FIELD_VALUE(name) uint64_t name;
#define MN__STAT_FIELD_CAT(name) mn_stat name[MN_CAT_COUNT];
#define MN__STAT_FIELD_CATV(name) uint64_t name[MN_CAT_COUNT];
#define MN__STAT_FIELD(kind, name, unit, label) MN__STAT_FIELD_##kind(name)

// The typedef name differs from the tag so that mn_cache_stats() can keep its name, like POSIX
// struct stat and stat().
typedef struct mn_cache_stats {
    MN_CACHE_STATS(MN__STAT_FIELD)
} mn_cache_statistics;

MNDEF mn_result mn_cache_init(mn_cache *c, const mn_cache_desc *desc);
MNDEF void mn_cache_free(mn_cache *c);  // returns every segment to the device
// Allocates size bytes for use on stream. size 0 gives NULL and MN_OK (as PyTorch). label is an
// optional short name kept with the block (truncated to MN_CACHE_LABEL_MAX - 1 bytes).
// MN_ERR_DEVICE_OOM after the whole out-of-memory ladder; mn_cache_oom_message() explains it.
MNDEF mn_result mn_cache_alloc(mn_cache *c, uint64_t size, mn_stream stream, mn_category cat,
                               const char *label, void **ptr_out);
MNDEF mn_result mn_cache_release(mn_cache *c, void *ptr);  // NULL is a no-op
// The block is used on another stream (PyTorch recordStream): its memory is not reused until
// an event recorded on that stream at release time has completed.
MNDEF mn_result mn_cache_record_stream(mn_cache *c, void *ptr, mn_stream stream);
MNDEF mn_result mn_cache_empty(mn_cache *c);  // torch.cuda.empty_cache()
// torch.cuda.set_per_process_memory_fraction: the device's total (mem_info_fn) times fraction
// (0, 1] bounds the reserved bytes. Needed for garbage_collection_threshold to act.
MNDEF mn_result mn_cache_set_memory_fraction(mn_cache *c, double fraction);
MNDEF mn_result mn_cache_stats(mn_cache *c, struct mn_cache_stats *out);
MNDEF void mn_cache_reset_peak_stats(mn_cache *c);         // peak = current
MNDEF void mn_cache_reset_accumulated_stats(mn_cache *c);  // allocated = freed = 0, counters 0
MNDEF mn_result mn_cache_config_get(mn_cache *c, mn_cache_config *out);
// Copies the message of the last out-of-memory failure ("" if none) into buf.
MNDEF void mn_cache_oom_message(mn_cache *c, char *buf, size_t cap);
// Checks the internal invariants (block lists tile segments, pools hold exactly the free
// blocks, statistics equal the sums over blocks). MN_OK or MN_ERR_STATE, reason to the logger.
MNDEF mn_result mn_cache_check(mn_cache *c);

// ---- >>cache/observe: observability -------------------------------------------------------------
typedef mn_result (*mn_cache_write_fn)(void *user_data, const char *data, size_t len);

#define MN_CACHE_LABEL_MAX 24

typedef enum mn_trace_action {  // snapshot device_traces "action"
    MN_TRACE_DEFAULT = 0,
    MN_TRACE_ALLOC,
    MN_TRACE_FREE_REQUESTED,
    MN_TRACE_FREE_COMPLETED,
    MN_TRACE_SEGMENT_ALLOC,
    MN_TRACE_SEGMENT_FREE,
    MN_TRACE_SEGMENT_MAP,
    MN_TRACE_SEGMENT_UNMAP,
    MN_TRACE_OOM,
    MN_TRACE_ACTION_COUNT
} mn_trace_action;

typedef struct mn_trace_entry {
    mn_trace_action action;
    mn_category category;
    mn_stream stream;
    uint64_t addr;        // oom: free device bytes (PyTorch "device_free")
    uint64_t size;        // as PyTorch: requested size for alloc/free, segment size, oom: rounded
    uint64_t block_size;  // rounded block size for alloc/free entries
    uint64_t time;        // operation counter of the allocator
} mn_trace_entry;

typedef enum mn_block_state {
    MN_BLOCK_DEFAULT = 0,
    MN_BLOCK_ACTIVE_ALLOCATED,
    MN_BLOCK_ACTIVE_PENDING_FREE,  // released, waiting for stream events
    MN_BLOCK_INACTIVE,
    MN_BLOCK_STATE_COUNT
} mn_block_state;

typedef struct mn_block_info {
    uint64_t addr, size, requested;
    mn_block_state state;
    mn_category category;
    char label[MN_CACHE_LABEL_MAX];
} mn_block_info;

typedef struct mn_segment_info {
    uint64_t addr, total_size, allocated_size, active_size, requested_size;
    mn_stream stream;
    int is_small, is_expandable;
    uint64_t first_block, block_count;  // range in mn_cache_snapshot.blocks
} mn_segment_info;

typedef struct mn_cache_snapshot {
    mn_segment_info *segments;  // sorted by address; an expandable segment gives one entry per
    uint64_t segment_count;     // mapped range (unmapped address space is not listed)
    mn_block_info *blocks;
    uint64_t block_count;
    mn_trace_entry *trace;      // oldest first
    uint64_t trace_count;
    uint64_t trace_dropped;     // entries overwritten in the ring buffer
    uint64_t base_cat_allocated[MN_CAT_COUNT];  // state before trace[0]: allocated per category
    uint64_t base_reserved;                     // and reserved bytes
    mn_cache_config config;
    int device_index;
    struct mn_cache_stats stats;
    mn_allocator allocator;
} mn_cache_snapshot;

MNDEF mn_result mn_cache_snapshot_take(mn_cache *c, mn_cache_snapshot *out);
MNDEF void mn_cache_snapshot_free(mn_cache_snapshot *s);
MNDEF const char *mn_trace_action_name(mn_trace_action a);   // "alloc", "free_requested", ...
MNDEF const char *mn_block_state_name(mn_block_state s);     // "active_allocated", ...

// torch.cuda.memory_summary(): PyTorch's table, byte for byte.
MNDEF mn_result mn_cache_summary_write(const struct mn_cache_stats *s, int device_index,
                                       int abbreviated, mn_cache_write_fn fn, void *user_data);
// torch.cuda.memory_stats(): every statistic of the PyTorch set under its flat key
// ("allocated_bytes.all.peak", "num_ooms", "max_split_size"; UINT64_MAX values as -1), sorted by
// key as PyTorch sorts them. Returns the number of items (MN_CACHE_STATS_ITEMS); writes them
// only when cap is at least that.
typedef struct mn_stat_item {
    char key[48];
    int64_t value;
} mn_stat_item;
#define MN__STAT_ITEMS_POOL (4 * MN_STAT_TYPE_COUNT)
#define MN__STAT_ITEMS_ONE 4
#define MN__STAT_ITEMS_COUNT 1
#define MN__STAT_ITEMS_VALUE 1
#define MN__STAT_ITEMS_CAT 0
#define MN__STAT_ITEMS_CATV 0
#define MN__STAT_ITEMS(kind, name, unit, label) + MN__STAT_ITEMS_##kind
enum { MN_CACHE_STATS_ITEMS = 0 MN_CACHE_STATS(MN__STAT_ITEMS) };
MNDEF uint32_t mn_cache_stats_items(const struct mn_cache_stats *s, mn_stat_item *items,
                                    uint32_t cap);
// memanat's table per memory category: current, peak and at-the-allocated-peak bytes, and
// allocation counts, for the categories that were used.
MNDEF mn_result mn_cache_category_summary_write(const struct mn_cache_stats *s,
                                                mn_cache_write_fn fn, void *user_data);
// Snapshot in the JSON form of torch.cuda.memory._snapshot() (segments, device_traces,
// allocator_settings); blocks and trace entries carry their category and label as a frame.
MNDEF mn_result mn_cache_snapshot_write_json(const mn_cache_snapshot *s, mn_cache_write_fn fn,
                                             void *user_data);
// SVG picture: allocated bytes over time stacked by category, reserved bytes as a line; title
// NULL: "memory timeline". A snapshot with an array missing for its count: MN_ERR_INVALID_ARG.
MNDEF mn_result mn_cache_timeline_svg(const mn_cache_snapshot *s, const char *title,
                                      mn_cache_write_fn fn, void *user_data);
// PyTorch's format_size(): "512 bytes", "1.50 KiB", "20.00 MiB", "1.25 GiB".
MNDEF void mn_cache_format_size(uint64_t bytes, char *buf, size_t cap);

// ---- >>cache/helpers: a cache on a simulated device, a FILE* writer, trace replay ---------------

// A caching allocator over a simulated device of its own: what the estimator, the CLI, the
// benchmarks and the tests run on the CPU. The allocator points into the struct, so it must not
// move between init and free.
typedef struct mn_sim_cache {
    mn_simdev dev;
    mn_cache cache;
} mn_sim_cache;

// dd: the device (NULL = unlimited capacity, events completed by hand); cd: the allocator
// (NULL = PyTorch's defaults; its device field is ignored). The device uses cd's host allocator
// when dd gives none. On failure nothing is left to free.
MNDEF mn_result mn_sim_cache_init(mn_sim_cache *sc, const mn_simdev_desc *dd,
                                  const mn_cache_desc *cd);
MNDEF void mn_sim_cache_free(mn_sim_cache *sc);

// A mn_cache_write_fn for a FILE* passed as user_data: MN_ERR_IO when fwrite writes less.
MNDEF mn_result mn_cache_write_file(void *file, const char *data, size_t len);

// Writes a file so that a failure loses nothing: body(ctx, f) writes the content to path + ".tmp",
// which is flushed, closed and renamed over path. On any failure (body's result, or MN_ERR_IO)
// the temporary is removed and an earlier file at path stays as it was. MN_ERR_INVALID_ARG for a
// NULL or overlong path.
typedef mn_result (*mn_file_body_fn)(void *ctx, FILE *f);
MNDEF mn_result mn_write_file_atomic(const char *path, mn_file_body_fn body, void *ctx);

typedef struct mn_replay_counts {
    uint64_t allocations;      // allocation events
    uint64_t frees;            // free events
    uint64_t unmatched_frees;  // frees of an id with no live block (its allocation failed, or
                               // the trace never allocated it)
    uint64_t failed;           // allocations refused after the out-of-memory ladder (num_ooms)
} mn_replay_counts;

// Replays an allocation trace (mn_trace_event, the form mn_estimate_trace() writes) through c,
// in order. An allocation of id gets a block of size bytes on its stream with its category,
// labelled with its phase name when phase is set; a free releases the block of that id; any id
// value may be used. An allocation of a live id first releases the old block (the trace did
// not record its free). An allocation that fails after the whole out-of-memory ladder is counted
// and the replay goes on. release_live 1 releases the blocks still live at the end, so the
// trace can be replayed again. counts may be NULL. The id map takes host memory from c's
// allocator (MN_ERR_OUT_OF_MEMORY); any other allocator error stops the replay and is returned.
MNDEF mn_result mn_cache_replay(mn_cache *c, const mn_trace_event *events, uint64_t count,
                                int release_live, mn_replay_counts *counts);
// mn_cache_replay that stops at marks: after the events [0, marks[k]) it calls at_mark(user_data,
// k, c), which reads what it wants (mn_cache_stats), and then resets the peak statistics, so the
// peaks seen at mark k cover the events since mark k - 1. marks ascend, each at most count; an
// error from at_mark stops the replay and is returned. Blocks stay live at the end.
typedef mn_result (*mn_replay_mark_fn)(void *user_data, uint64_t mark, mn_cache *c);
MNDEF mn_result mn_cache_replay_marked(mn_cache *c, const mn_trace_event *events, uint64_t count,
                                       const uint64_t *marks, uint64_t nmarks,
                                       mn_replay_mark_fn at_mark, void *user_data,
                                       mn_replay_counts *counts);
// >>optim -----------------------------------------------------------------------------------------
//
// Optimizers on host arrays, one state struct per parameter tensor (init / step / free), the state
// sizes the estimator uses, gradient clipping by global norm, dynamic loss scaling, and fp16/bf16
// conversion. The state an optimizer allocates is exactly what its *_state_bytes function reports
// for the same shape and settings, so predicted and real state sizes are one number.
//
// Conventions shared by every optimizer:
//   - param [n] is fp32 and updated in place; grad [n] is fp32 and read only. With a 16-bit model
//     (params.dtype MN_FP16 or MN_BF16) param is the fp32 master copy and step also rewrites the
//     16-bit tensor param16 [n] from it, rounding to nearest even.
//   - Hyperparameters: zero selects the default written beside the field. A field marked [z]
//     accepts MN_OPTIM_ZERO to request a real zero where zero itself means "default". After init,
//     s->params holds the resolved values; s->params.lr may be changed between steps (schedules).
//   - s->step counts the steps taken; the bias corrections use t = s->step after the increment.
//   - State memory comes from the allocator given to init (NULL = MN_MALLOC/MN_FREE) in a single
//     block of s->state_bytes bytes; free releases it and zeroes the struct.

// Value for a [z] field: "exactly zero", where 0 selects the default.
#define MN_OPTIM_ZERO (-1.0f)

typedef struct mn_optim_desc {
    mn_optim kind;            // 0 = adamw
    int adafactor_beta1;      // Adafactor keeps a first moment (beta1 set), 0 = no (transformers)
    uint32_t block_size;      // 8-bit: elements per absmax block, 0 = 256 (bitsandbytes blockwise)
    uint64_t min_8bit_size;   // 8-bit: tensors with fewer elements keep 32-bit state, 0 = 4096
    int amsgrad;              // AdamW keeps the running max of v (one more fp32 array), 0 = no
} mn_optim_desc;

// Bytes of optimizer state kept for one parameter tensor of the given shape (dims[0..ndim-1],
// ndim 1..8, the last dimension the fastest), for 32-bit master parameters.
MNDEF mn_result mn_optim_state_bytes(const mn_optim_desc *d, const uint64_t *dims, uint32_t ndim,
                                     uint64_t *out);
MNDEF mn_result mn_sgd_state_bytes(const uint64_t *dims, uint32_t ndim, int momentum,
                                   uint64_t *out);
MNDEF mn_result mn_adamw_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out);
// (block_size 0 = 256, up to 4096 as mn_adamw8bit_init takes)
MNDEF mn_result mn_adamw8bit_state_bytes(const uint64_t *dims, uint32_t ndim, uint32_t block_size,
                                         uint64_t min_8bit_size, uint64_t *out);
MNDEF mn_result mn_adafactor_state_bytes(const uint64_t *dims, uint32_t ndim, int beta1,
                                         uint64_t *out);
MNDEF mn_result mn_lion_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out);

// The thread count of an optimizer step (SGD, AdamW, 8-bit AdamW, Adafactor) in an OpenMP build. A
// team is not faster than one thread while other processes keep the cores busy (a member that loses
// its core holds the step up until it runs again), and only the step's own time shows that: each
// step is timed, with one thread or with its team, and the count whose last five times have the
// lower median runs the next step. The team's times show at once when it gets slower; while one
// thread is the faster, every 16th step takes the team to see if it has become the faster again
// (and every 256th step one thread, while the team is). Set to zero by the init call; the caller
// never needs to touch it.
#define MN_TEAM_TUNE_KEEP 5
typedef struct mn_team_tune {
    double sec[2][MN_TEAM_TUNE_KEEP];  // the last step times, seconds: [0] one thread, [1] the
                                       // team; 0 = no time yet
    uint32_t next[2];                  // where the next time of each goes (a ring)
    int team;                          // the team size that sec[1] was timed with
    int best;                          // the count that was the faster at the last step
    uint32_t since;                    // steps since then, or since the other count last ran
} mn_team_tune;

// ---- SGD (torch.optim.SGD) ----------------------------------------------------------------------
typedef struct mn_sgd_params {
    float lr;             // 0 = 1e-3 [z]
    float momentum;       // 0 = none: plain SGD, no state [z]
    float dampening;      // 0 = 0 [z]
    float weight_decay;   // L2 penalty added to the gradient, 0 = none [z]
    int nesterov;         // Nesterov momentum; needs momentum > 0 and dampening 0
    int maximize;         // ascend the objective
    mn_dtype dtype;       // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_sgd_params;

typedef struct mn_sgd {
    mn_sgd_params params;     // resolved
    uint64_t n;               // elements
    uint64_t step;            // steps taken
    float *momentum_buffer;   // [n], NULL without momentum
    uint64_t state_bytes;     // == mn_sgd_state_bytes(dims, ndim, momentum != 0)
    mn_allocator alloc;
    mn_team_tune tune;        // thread count of the step
} mn_sgd;

MNDEF mn_result mn_sgd_init(mn_sgd *s, const uint64_t *dims, uint32_t ndim, const mn_sgd_params *p,
                            const mn_allocator *alloc);
MNDEF mn_result mn_sgd_step(mn_sgd *s, float *param, const float *grad, uint16_t *param16);
MNDEF void mn_sgd_free(mn_sgd *s);

// ---- AdamW (torch.optim.AdamW) ------------------------------------------------------------------
typedef struct mn_adamw_params {
    float lr;             // 0 = 1e-3 [z]
    float beta1;          // 0 = 0.9 [z]
    float beta2;          // 0 = 0.999 [z]
    float eps;            // added to sqrt(v_hat), 0 = 1e-8 [z]
    float weight_decay;   // decoupled: param *= 1 - lr * weight_decay, 0 = 1e-2 [z]
    int amsgrad;          // use the running max of v (one more [n] fp32 array)
    int maximize;         // ascend the objective
    mn_dtype dtype;       // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_adamw_params;

typedef struct mn_adamw {
    mn_adamw_params params;   // resolved
    uint64_t n, step;
    float *exp_avg;           // [n] m
    float *exp_avg_sq;        // [n] v
    float *max_exp_avg_sq;    // [n] amsgrad only, else NULL
    uint64_t state_bytes;     // == mn_optim_state_bytes({ADAMW, .amsgrad}, dims, ndim)
    mn_allocator alloc;
    mn_team_tune tune;        // thread count of the step
} mn_adamw;

MNDEF mn_result mn_adamw_init(mn_adamw *s, const uint64_t *dims, uint32_t ndim,
                              const mn_adamw_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_adamw_step(mn_adamw *s, float *param, const float *grad, uint16_t *param16);
MNDEF void mn_adamw_free(mn_adamw *s);

// ---- 8-bit AdamW (bitsandbytes AdamW8bit, block-wise dynamic quantization) ----------------------
typedef struct mn_adamw8bit_params {
    float lr;               // 0 = 1e-3 [z]
    float beta1;            // 0 = 0.9 [z]
    float beta2;            // 0 = 0.999 [z]
    float eps;              // 0 = 1e-8 [z]
    float weight_decay;     // param *= 1 - lr * weight_decay after the Adam step, 0 = 1e-2 [z]
    uint32_t block_size;    // elements per absmax block, 1..4096, 0 = 256 (step: 32 KiB stack)
    uint64_t min_8bit_size; // tensors with fewer elements keep fp32 m and v, 0 = 4096
    mn_dtype dtype;         // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_adamw8bit_params;

typedef struct mn_adamw8bit {
    mn_adamw8bit_params params;  // resolved
    uint64_t n, step;
    uint64_t blocks;             // ceil(n / block_size) when quantized, else 0
    int quantized;               // n >= min_8bit_size: m and v are 8-bit codes
    uint8_t *code1;              // [n] m as indices into the signed dynamic map
    uint8_t *code2;              // [n] v as indices into the unsigned dynamic map
    float *absmax1, *absmax2;    // [blocks] per-block scale of m and v
    float *exp_avg, *exp_avg_sq; // [n] fp32 m and v of a small tensor (quantized == 0)
    uint64_t state_bytes;        // == mn_adamw8bit_state_bytes(dims, ndim, block, min_8bit)
    mn_allocator alloc;
    mn_team_tune tune;           // thread count of the step
} mn_adamw8bit;

MNDEF mn_result mn_adamw8bit_init(mn_adamw8bit *s, const uint64_t *dims, uint32_t ndim,
                                  const mn_adamw8bit_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_adamw8bit_step(mn_adamw8bit *s, float *param, const float *grad,
                                  uint16_t *param16);
MNDEF void mn_adamw8bit_free(mn_adamw8bit *s);

// The 256-entry dynamic quantization map of bitsandbytes create_dynamic_map(signed, 7, 8), sorted
// ascending: signed = 127 negatives down to -0.993, 0, 128 positives up to 1.0 (smallest
// magnitude 5.5e-7); unsigned = 0 and 255 positives up to 1.0 (smallest 3.25e-7).
MNDEF mn_result mn_dynamic_map(int is_signed, float map[256]);  // INVALID_ARG: map NULL
// The table of mn_hd_q8_nearest_tab for map [256]: MN_OK with tab [MN_Q8_TAB] filled when the map
// is strictly ascending and finite, with at most one threshold a bucket and none in the first or
// last bucket of a sign (true of both dynamic maps); MN_ERR_UNSUPPORTED otherwise (use the
// search, mn_hd_q8_nearest). The two give the same index for every float.
MNDEF mn_result mn_q8_table(const float *map, uint32_t *tab);
// Block-wise quantization: absmax[b] = max |x| over block b, codes[i] = index of the map entry
// nearest to x[i] / absmax[b]. map [256] ascending, x [n], codes [n], absmax [ceil(n/block)].
MNDEF mn_result mn_quantize_blockwise(const float *map, const float *x, uint64_t n,
                                      uint32_t block_size, uint8_t *codes, float *absmax);
// x[i] = map[codes[i]] * absmax[i / block_size].
MNDEF mn_result mn_dequantize_blockwise(const float *map, const uint8_t *codes,
                                        const float *absmax, uint64_t n, uint32_t block_size,
                                        float *x);

// ---- Adafactor (transformers.optimization.Adafactor) --------------------------------------------
typedef struct mn_adafactor_params {
    float lr;               // > 0: fixed step (relative_step=False); 0 = relative step
    float eps1;             // added to g^2, 0 = 1e-30
    float eps2;             // floor of the parameter scale RMS(param), 0 = 1e-3
    float clip_threshold;   // update clipping threshold d, 0 = 1.0
    float decay_rate;       // beta2_t = 1 - t^decay_rate, 0 = -0.8
    float beta1;            // first moment decay, 0 = no first moment (transformers beta1=None)
    float weight_decay;     // param -= weight_decay * alpha_t * param, 0 = none
    int no_scale_parameter; // 1: alpha_t = rho_t (transformers scale_parameter=False)
    int warmup_init;        // relative step min(1e-6 t, 1/sqrt t) instead of min(1e-2, 1/sqrt t)
    mn_dtype dtype;         // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_adafactor_params;

typedef struct mn_adafactor {
    mn_adafactor_params params;  // resolved
    uint64_t n, step;
    int factored;                // ndim >= 2: second moment kept as row and column means
    uint64_t batch, rows, cols;  // factored [batch, rows, cols] = [prod(dims[:-2]), d[-2], d[-1]]
    float *exp_avg_sq_row;       // [batch, rows] factored
    float *exp_avg_sq_col;       // [batch, cols] factored
    float *exp_avg_sq;           // [n] not factored
    float *exp_avg;              // [n] with beta1
    float rms;                   // RMS(param) before the last step (transformers state["RMS"])
    float alpha;                 // step size alpha_t of the last step
    float clip_div;              // the last step's update divisor max(1, RMS(u) / clip_threshold)
    uint64_t state_bytes;        // == mn_adafactor_state_bytes(dims, ndim, beta1 != 0)
    mn_allocator alloc;
    mn_team_tune tune;           // thread count of the step
} mn_adafactor;

MNDEF mn_result mn_adafactor_init(mn_adafactor *s, const uint64_t *dims, uint32_t ndim,
                                  const mn_adafactor_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_adafactor_step(mn_adafactor *s, float *param, const float *grad,
                                  uint16_t *param16);
MNDEF void mn_adafactor_free(mn_adafactor *s);

// ---- Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") -------------------
typedef struct mn_lion_params {
    float lr;             // 0 = 1e-4 [z]
    float beta1;          // interpolation for the update sign, 0 = 0.9 [z]
    float beta2;          // momentum decay, 0 = 0.99 [z]
    float weight_decay;   // decoupled: param *= 1 - lr * weight_decay, 0 = none [z]
    mn_dtype dtype;       // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_lion_params;

typedef struct mn_lion {
    mn_lion_params params;  // resolved
    uint64_t n, step;
    float *exp_avg;         // [n] momentum m
    uint64_t state_bytes;   // == mn_lion_state_bytes(dims, ndim)
    mn_allocator alloc;
} mn_lion;

MNDEF mn_result mn_lion_init(mn_lion *s, const uint64_t *dims, uint32_t ndim,
                             const mn_lion_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_lion_step(mn_lion *s, float *param, const float *grad, uint16_t *param16);
MNDEF void mn_lion_free(mn_lion *s);

// ---- Gradient clipping by global norm (torch.nn.utils.clip_grad_norm_) --------------------------
// grads[k] [sizes[k]] for k < count. total = (sum over all elements |g|^p)^(1/p) (max |g| for
// p = INFINITY); every gradient is multiplied by min(1, max_norm / (total + 1e-6)).
// norm_type 0 = 2.
// *total_norm (may be NULL) receives the norm before clipping; a non-finite norm makes the
// gradients non-finite, as in torch.
MNDEF mn_result mn_clip_grad_norm(float *const *grads, const uint64_t *sizes, uint32_t count,
                                  float max_norm, float norm_type, float *total_norm);

// ---- Dynamic loss scaling (torch.amp.GradScaler) ------------------------------------------------
typedef struct mn_loss_scaler_params {
    float init_scale;          // 0 = 65536 (2^16)
    float growth_factor;       // > 1, 0 = 2.0
    float backoff_factor;      // in (0, 1), 0 = 0.5
    uint32_t growth_interval;  // clean steps before growth, 0 = 2000
} mn_loss_scaler_params;

typedef struct mn_loss_scaler {
    mn_loss_scaler_params params;  // resolved
    float scale;                   // multiply the loss by this before backward
    uint32_t growth_tracker;       // consecutive clean steps since the last change
    uint64_t steps, skipped;       // updates seen, steps skipped for inf/NaN gradients
} mn_loss_scaler;

MNDEF mn_result mn_loss_scaler_init(mn_loss_scaler *s, const mn_loss_scaler_params *p);
// 1 / scale, rounded to fp32 from double as GradScaler does; the argument of the unscale calls.
MNDEF float mn_loss_scaler_inv_scale(const mn_loss_scaler *s);
// Once per step, after the found-inf check: found_inf -> scale *= backoff, tracker = 0, skip the
// step; else tracker += 1 and at growth_interval scale *= growth (when finite), tracker = 0.
// *skip_step (may be NULL) is 1 when the optimizer step must be skipped.
MNDEF mn_result mn_loss_scaler_update(mn_loss_scaler *s, int found_inf, int *skip_step);

// Unscale in place: grad [n] of dtype (0/MN_FP32, MN_FP16, MN_BF16) *= inv_scale, computed in fp32.
// *found_inf is set to 1 when any input is inf or NaN and left as it was otherwise, so one flag
// can collect every tensor of a step (zero it once per step).
MNDEF mn_result mn_unscale_grads(mn_dtype dtype, void *grad, uint64_t n, float inv_scale,
                                 int *found_inf);
// The same into an fp32 array: dst [n] = src [n] (dtype) * inv_scale.
MNDEF mn_result mn_unscale_grads_to_fp32(mn_dtype dtype, const void *src, float *dst, uint64_t n,
                                         float inv_scale, int *found_inf);

// ---- fp16 / bf16 conversion ---------------------------------------------------------------------
// fp32 -> 16 bits rounds to nearest even, overflows to inf, keeps subnormals; NaN stays NaN with
// its sign and top payload bits, quieted. 16 bits -> fp32 is exact (NaN quieted).
MNDEF uint16_t mn_fp32_to_fp16(float f);
MNDEF float mn_fp16_to_fp32(uint16_t h);
MNDEF uint16_t mn_fp32_to_bf16(float f);
MNDEF float mn_bf16_to_fp32(uint16_t b);
// Bulk versions: src [n] -> dst [n].
MNDEF mn_result mn_fp32_to_fp16_array(const float *src, uint16_t *dst, uint64_t n);
MNDEF mn_result mn_fp16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n);
MNDEF mn_result mn_fp32_to_bf16_array(const float *src, uint16_t *dst, uint64_t n);
MNDEF mn_result mn_bf16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n);
// >>ops -------------------------------------------------------------------------------------------
//
// CPU reference ops, forward and backward, on caller-owned fp32 host arrays with fp32 (or double)
// accumulation. They are the ground truth for the CUDA kernels and the compute of the CPU trainer.
// The layout follows llm.c's train_gpt2.c: row-major, the last dimension the fastest.
//
// Shapes used in the comments below:
//   B batch, T sequence length, C channels, OC output channels, NH heads, hs = C / NH head size,
//   V vocabulary, N = B * T rows (any number of rows for the row-wise ops), n elements.
// Every shape argument is a size_t: the number of elements along one dimension of caller-owned
// host arrays. Products (N * C, B * T * 3C, ...) are formed in size_t inside the ops, so no shape
// is limited to int. Token ids and targets are int values, not shapes.
//
// Conventions:
//   - Every backward ACCUMULATES (+=) into its gradient buffers, as llm.c does, so gradients of a
//     tensor used twice add up and gradient accumulation over micro-batches needs no extra pass.
//     Zero the gradient buffers before the first backward.
//   - Output buffers do not alias inputs unless a comment says so.
//   - Every op returns mn_result and writes nothing when it fails: MN_ERR_INVALID_ARG for a
//     NULL array that is needed, a zero width that divides (C of the norms, L of softmax, NH of
//     attention, C % NH), a shape whose element count overflows size_t, or bad data (token ids,
//     targets, probabilities). No op asserts or exits, with or without NDEBUG. What cannot be
//     checked from inside - array lengths, aliasing not allowed below - is the caller's part.
//   - With OpenMP (-fopenmp) the heavy loops run in parallel; threads own disjoint outputs and
//     every sum runs in a fixed order, so results do not depend on the thread count. Every op
//     also builds and runs without OpenMP. Matmul and attention keep their packed tiles on the
//     stack (about 360 KiB per thread); the matmul forward with more than 128 output columns
//     packs its weight blocks into MN_MALLOC memory instead (512 KiB per thread, freed before
//     it returns; MN_ERR_OUT_OF_MEMORY, nothing written, when that fails). No other op
//     allocates memory.
//   - exp (softmax, attention, cross-entropy, GELU, SiLU) is computed inline (after Cephes expf)
//     so the loops vectorize: within 1.5 ulp of exp over the whole float range (about 1 ulp
//     measured), subnormal results rounded, not flushed; exp(NaN) is NaN, exp(-inf) is 0.

// Matmul: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC], cache-blocked and register-tiled.
// pre_gelu: [N,OC] or NULL. Non-NULL selects the fused GELU (tanh) epilogue: pre_gelu receives
//   inp @ weight^T + bias and out = gelu(pre_gelu). bias may be NULL. out (and pre_gelu) are
//   only written, never read. OC > 128 allocates (see the notes above): MN_ERR_OUT_OF_MEMORY.
MNDEF mn_result mn_matmul_forward(float *out, float *pre_gelu, const float *inp,
                                  const float *weight, const float *bias, size_t N, size_t C,
                                  size_t OC);
// dinp[N,C] += dpre @ weight;  dweight[OC,C] += dpre^T @ inp;  dbias[OC] += sum_n dpre[n,:],
// where dpre = dout, or dout * gelu'(pre_gelu) when pre_gelu is non-NULL. In that case dout [N,OC]
// is overwritten in place with dpre (as cuBLASLt's DGELU epilogue does). dinp, dweight and dbias
// may each be NULL to skip that gradient.
MNDEF mn_result mn_matmul_backward(float *dinp, float *dweight, float *dbias, float *dout,
                                   const float *inp, const float *weight, const float *pre_gelu,
                                   size_t N, size_t C, size_t OC);
// The same two with inp and weight stored as dtype: MN_FP16 or MN_BF16 (uint16_t arrays), or
// MN_FP32 / 0 (float arrays: the calls above). Each value is converted to fp32 exactly as the
// operands are packed and the products sum in fp32, so the results are bit for bit those of the
// fp32 calls on the converted arrays (mn_bf16_to_fp32_array, ...), without a converted copy.
// out, pre_gelu, bias, dout and every gradient stay fp32. Another dtype: MN_ERR_INVALID_ARG.
// MEMANAT_CBLAS serves only the fp32 form; 16-bit operands always take the native kernel.
MNDEF mn_result mn_matmul_forward_typed(float *out, float *pre_gelu, const void *inp,
                                        const void *weight, const float *bias, size_t N, size_t C,
                                        size_t OC, mn_dtype dtype);
MNDEF mn_result mn_matmul_backward_typed(float *dinp, float *dweight, float *dbias, float *dout,
                                         const void *inp, const void *weight,
                                         const float *pre_gelu, size_t N, size_t C, size_t OC,
                                         mn_dtype dtype);

// LayerNorm over the last dimension (Ba, Kiros & Hinton 2016), biased variance, eps e.g. 1e-5.
// out[N,C], mean[N] and rstd[N] (saved for backward, may be NULL), inp[N,C], weight[C],
// bias[C] or NULL.
MNDEF mn_result mn_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                     const float *weight, const float *bias, size_t N, size_t C,
                                     float eps);
// dinp[N,C] +=, dweight[C] +=, dbias[C] += (each may be NULL: not computed); dout[N,C],
// inp[N,C], weight[C], mean[N] and rstd[N] from the forward. dweight and dbias take each row's
// terms in row order (llm.c's order); up to two threads read every row once for all three
// gradients.
MNDEF mn_result mn_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                      const float *inp, const float *weight, const float *mean,
                                      const float *rstd, size_t N, size_t C);

// RMSNorm (Zhang & Sennrich 2019): out = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps).
// out[N,C], rstd[N] (saved for backward, may be NULL), inp[N,C], weight[C].
MNDEF mn_result mn_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                                   size_t N, size_t C, float eps);
// dinp[N,C] +=, dweight[C] += (either may be NULL: not computed); dout[N,C], inp[N,C], weight[C],
// rstd[N] from the forward.
MNDEF mn_result mn_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                                    const float *inp, const float *weight, const float *rstd,
                                    size_t N, size_t C);

// Softmax over rows of length L: out[n,:] = softmax(scale * inp[n,:]). With causal non-zero the
// rows form square [L,L] blocks (row n is query position t = n % L) and columns j > t are masked:
// their probability is exactly 0. out[N,L], inp[N,L].
MNDEF mn_result mn_softmax_forward(float *out, const float *inp, size_t N, size_t L, float scale,
                                   int causal);
// dinp[N,L] += scale * out * (dout - sum_j out_j * dout_j); dout[N,L], out[N,L] from the forward.
MNDEF mn_result mn_softmax_backward(float *dinp, const float *dout, const float *out, size_t N,
                                    size_t L, float scale, int causal);

// Multi-head scaled dot-product attention (Vaswani et al. 2017) over a fused qkv buffer
// [B,T,3C]: q = qkv[..., 0:C], k = qkv[..., C:2C], v = qkv[..., 2C:3C], head h uses channels
// h*hs .. h*hs+hs-1 of each; scores are scaled by 1/sqrt(hs); causal non-zero masks keys after
// the query. out[B,T,C]. att [B,NH,T,T] receives the probabilities (masked entries 0) for the
// backward, or is NULL to keep nothing: the backward then recomputes them (no O(T^2) activation,
// like FlashAttention; the same gradients, bit for bit). Either way the work is tiled and needs
// no T x T scratch.
MNDEF mn_result mn_attention_forward(float *out, float *att, const float *qkv, size_t B, size_t T,
                                     size_t C, size_t NH, int causal);
// dqkv[B,T,3C] +=; dout[B,T,C], qkv[B,T,3C], att [B,NH,T,T] from the forward or NULL.
MNDEF mn_result mn_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                      const float *att, size_t B, size_t T, size_t C, size_t NH,
                                      int causal);

// GELU, tanh approximation (Hendrycks & Gimpel 2016; GPT-2, llm.c, cuBLASLt's GELU epilogue):
// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). out[n], inp[n]; out may equal inp.
MNDEF mn_result mn_gelu_forward(float *out, const float *inp, size_t n);
// dinp[n] += dout * gelu'(inp).
MNDEF mn_result mn_gelu_backward(float *dinp, const float *dout, const float *inp, size_t n);
// Exact GELU (Hendrycks & Gimpel 2016; torch.nn.GELU() default): out = 0.5 x (1 + erf(x/sqrt 2)).
MNDEF mn_result mn_gelu_erf_forward(float *out, const float *inp, size_t n);
MNDEF mn_result mn_gelu_erf_backward(float *dinp, const float *dout, const float *inp, size_t n);

// SiLU / swish (Elfwing, Uchibe & Doya 2018; Ramachandran et al. 2017): out = x * sigmoid(x).
// out[n], inp[n]; out may equal inp. Backward: dinp[n] += dout * silu'(inp).
MNDEF mn_result mn_silu_forward(float *out, const float *inp, size_t n);
MNDEF mn_result mn_silu_backward(float *dinp, const float *dout, const float *inp, size_t n);
// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): out = silu(gate) * up.
// out[n], gate[n], up[n]. Backward: dgate[n] +=, dup[n] += (either may be NULL).
MNDEF mn_result mn_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
MNDEF mn_result mn_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                                   const float *up, size_t n);

// Residual add: out[n] = a[n] + b[n] (out may equal a or b). Backward: da[n] += dout,
// db[n] += dout (either may be NULL).
MNDEF mn_result mn_residual_forward(float *out, const float *a, const float *b, size_t n);
MNDEF mn_result mn_residual_backward(float *da, float *db, const float *dout, size_t n);

// Embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. out[B,T,C], tokens[B,T] in [0,V),
// wte[V,C], wpe[T,C] or NULL (no position embedding). MN_ERR_INVALID_ARG for a token outside
// [0,V) (nothing written).
MNDEF mn_result mn_embedding_forward(float *out, const int *tokens, const float *wte,
                                     const float *wpe, size_t B, size_t T, size_t C, size_t V);
// Scatter-add: dwte[tokens[b,t],:] += dout[b,t,:], dwpe[t,:] += dout[b,t,:] (either may be NULL).
MNDEF mn_result mn_embedding_backward(float *dwte, float *dwpe, const float *dout,
                                      const int *tokens, size_t B, size_t T, size_t C, size_t V);

// Cross-entropy fused with softmax: losses[n] = -log softmax(logits[n,:])[targets[n]].
// losses[N], probs[N,V] (kept for the backward, or NULL), logits[N,V], targets[N].
// A negative target marks an ignored row (loss 0, no gradient), like PyTorch's ignore_index;
// a target >= V is MN_ERR_INVALID_ARG (nothing written).
MNDEF mn_result mn_crossentropy_forward(float *losses, float *probs, const float *logits,
                                        const int *targets, size_t N, size_t V);
// dlogits[N,V] += (probs - onehot(targets)) * dlosses[n]; dlosses[N] (e.g. 1/N for a mean loss).
// probs [N,V] from the forward, or NULL to recompute them from logits[N,V] (then logits is
// read; otherwise it may be NULL).
MNDEF mn_result mn_crossentropy_backward(float *dlogits, const float *dlosses, const float *probs,
                                         const float *logits, const int *targets, size_t N,
                                         size_t V);

// Dropout (Srivastava et al. 2014), inverted: out = inp * keep / (1 - p), keep with probability
// 1 - p. The decision for element i is a function of (seed, offset + i) only, drawn from the
// counter-based Philox-4x32-10 generator (Salmon et al. 2011, Random123; the generator of
// PyTorch's CUDA dropout): no mask has to be stored, the backward and a recompute agree with the
// forward. Split a tensor across calls by advancing offset by the elements already done.
// p in [0,1], p = 1 drops everything; anything else is MN_ERR_INVALID_ARG.
// out[n] (may equal inp), mask[n] or NULL: receives 1 (kept) or 0 (dropped), inp[n].
MNDEF mn_result mn_dropout_forward(float *out, uint8_t *mask, const float *inp, size_t n,
                                   float p, uint64_t seed, uint64_t offset);
// dinp[n] += dout * keep / (1 - p); mask [n] from the forward or NULL to regenerate it.
MNDEF mn_result mn_dropout_backward(float *dinp, const float *dout, const uint8_t *mask, size_t n,
                                    float p, uint64_t seed, uint64_t offset);
// The keep mask alone: mask[n] = 1 where element offset + i is kept.
MNDEF mn_result mn_dropout_mask(uint8_t *mask, size_t n, float p, uint64_t seed, uint64_t offset);
// Philox-4x32-10 block: four 32-bit words for a 128-bit counter and a 64-bit key (a NULL array:
// nothing done).
MNDEF void mn_philox4x32(const uint32_t ctr[4], uint64_t key, uint32_t out[4]);

#ifdef __cplusplus
}
#endif
#endif  // MEMANAT_H

// ===============================================================================================
#ifdef MEMANAT_IMPLEMENTATION
#ifndef MEMANAT_IMPLEMENTED
#define MEMANAT_IMPLEMENTED

#include <errno.h>
#include <float.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef MEMANAT_CBLAS
#include <cblas.h>  // the matmuls through cblas_sgemm (see OPTIONS)
#endif
#ifndef MEMANAT_NO_THREADS
#if defined(_WIN32) && !defined(__CYGWIN__)
// define MEMANAT_NO_THREADS to build the caching allocator without locking
#error "memanat: the caching allocator locks with pthreads (or define MEMANAT_NO_THREADS)"
#endif
#include <pthread.h>
#endif
#ifdef __linux__
#include <sys/mman.h>  // madvise(MADV_HUGEPAGE) for the caching allocator's large tables
#ifdef MADV_HUGEPAGE
#define MN__MADV_HUGEPAGE MADV_HUGEPAGE
#elif defined(__x86_64__) || defined(__aarch64__) || defined(__riscv)
// hidden by strict feature macros (-std=c99 without _DEFAULT_SOURCE); the kernel's value on these
// (asm-generic/mman-common.h)
int madvise(void *addr, size_t len, int advice);
#define MN__MADV_HUGEPAGE 14
#endif
#endif

#if defined(MN_MALLOC) && !defined(MN_FREE) || !defined(MN_MALLOC) && defined(MN_FREE)
#error "memanat: define both MN_MALLOC and MN_FREE, or neither"
#endif
#ifndef MN_MALLOC
#define MN_MALLOC(sz) malloc(sz)
#define MN_FREE(p) free(p)
#define MN__REALLOC(p, sz) realloc(p, sz)  // (the C library's pair only: see mn__grow)
#endif
#ifndef MN_ASSERT
#include <assert.h>
#define MN_ASSERT(c) assert(c)
#endif

// GCC vectorizes a loop at -O2 only when the vector code needs no scalar remainder and no test
// that the arrays do not overlap (-fvect-cost-model=very-cheap, GCC 12; before 12, not at all):
// nearly no loop whose length comes from the caller. Built into a program at -O2, the ops that
// leave their loops to the vectorizer ran up to 5 times as long as at -O3 (layernorm forward,
// GELU backward, cross-entropy, embedding, Lion, the casts). -O2 also inlines less: the small
// steps of the allocator and of the step simulation stayed calls, and a fit took 8 to 12 % longer
// (Llama-3-70B 9.25 against 8.27 ms, GPT-2 XL 10.8 against 10.0). The implementation asks for
// -O3; the results are the same bits (the vector loops do each element's operations in the
// scalar order, and no float sum is reordered without -ffast-math). Clang vectorizes at -O2 by
// default.
#if defined(__GNUC__) && !defined(__clang__) && defined(__OPTIMIZE__) && \
    !defined(__OPTIMIZE_SIZE__)
#define MN__VECT_PUSHED
#pragma GCC push_options
#pragma GCC optimize("O3")
#endif

#if defined(MEMANAT_STATIC) && (defined(__GNUC__) || defined(__clang__))
#define MNIMPL static __attribute__((unused))  // a file need not call every function
#elif defined(MEMANAT_STATIC)
#define MNIMPL static
#else
#define MNIMPL
#endif

// Private helpers are static; some go unused in a given translation unit.
#if defined(__GNUC__) || defined(__clang__)
#define MN__PRIVATE static __attribute__((unused))
#else
#define MN__PRIVATE static
#endif

// >>types implementation --------------------------------------------------------------------------

MNIMPL const char *mn_result_str(mn_result r) {
    switch (r) {
    case MN_OK: return "ok";
    case MN_ERR_INVALID_ARG: return "invalid argument";
    case MN_ERR_OUT_OF_MEMORY: return "out of host memory";
    case MN_ERR_OVERFLOW: return "size overflows 64 bits";
    case MN_ERR_PARSE: return "parse error";
    case MN_ERR_IO: return "I/O error";
    case MN_ERR_NOT_FOUND: return "not found";
    case MN_ERR_UNSUPPORTED: return "unsupported";
    case MN_ERR_DEVICE_OOM: return "device out of memory";
    case MN_ERR_DEVICE: return "device error";
    case MN_ERR_CONFIG: return "bad allocator configuration";
    case MN_ERR_STATE: return "call not allowed in this state";
    }
    return "unknown result";
}

MNIMPL const char *mn_dtype_name(mn_dtype t) {
    static const char *const names[MN_DTYPE_COUNT] = {"default", "fp32", "fp16", "bf16", "int8",
                                                      "nf4"};
    return (unsigned)t < MN_DTYPE_COUNT ? names[t] : "unknown";
}

MNIMPL uint32_t mn_dtype_bits(mn_dtype t) {
    static const uint32_t bits[MN_DTYPE_COUNT] = {0, 32, 16, 16, 8, 4};
    return (unsigned)t < MN_DTYPE_COUNT ? bits[t] : 0;
}

MNIMPL const char *mn_category_name(mn_category c) {
    static const char *const names[MN_CAT_COUNT] = {
        "other", "weights", "master_weights", "gradients", "optimizer", "activations", "temporary",
        "kv_cache", "workspace"};
    return (unsigned)c < MN_CAT_COUNT ? names[c] : "unknown";
}

MNIMPL mn_result mn_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (!out) return MN_ERR_INVALID_ARG;
    if (a != 0 && b > UINT64_MAX / a) return MN_ERR_OVERFLOW;
    *out = a * b;
    return MN_OK;
}

MNIMPL mn_result mn_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (!out) return MN_ERR_INVALID_ARG;
    if (b > UINT64_MAX - a) return MN_ERR_OVERFLOW;
    *out = a + b;
    return MN_OK;
}

// n elements of up to 4 bytes have a byte count that fits size_t: the element count of a host
// array an op may be given (more would wrap its offsets; the ops refuse it).
#define MN__FLOATS_MAX ((size_t)-1 / sizeof(float))
MN__PRIVATE int mn__floats_fit(uint64_t n) { return n <= (uint64_t)MN__FLOATS_MAX; }

MNIMPL mn_result mn_attention_scratch(uint64_t B, uint64_t T, uint64_t C, uint64_t NH,
                                      uint64_t esz, int backward, int att_kept, uint64_t *out) {
    uint64_t nh = backward ? 7 : 4, ns = backward ? (att_kept ? 2 : 3) : (att_kept ? 0 : 1);
    uint64_t hsp, rows, hb, sb = 0;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    *out = 0;
    if (!B || !T || !C || !NH || !esz) return MN_OK;
    // hsp = mn_hd_head_ld(C / NH): the head's row, a multiple of 8 elements
    if ((r = mn_add_u64(C / NH, 7, &hsp)) != MN_OK || (r = mn_mul_u64(B, NH, &rows)) != MN_OK ||
        (r = mn_mul_u64(rows, T, &rows)) != MN_OK ||
        (r = mn_mul_u64(rows, hsp / 8 * 8, &hb)) != MN_OK ||
        (r = mn_mul_u64(hb, esz, &hb)) != MN_OK || (r = mn_add_u64(hb, 255, &hb)) != MN_OK ||
        (r = mn_mul_u64(hb / 256 * 256, nh, &hb)) != MN_OK)
        return r;
    if (ns && ((r = mn_mul_u64(rows, T, &sb)) != MN_OK || (r = mn_mul_u64(sb, esz, &sb)) != MN_OK ||
               (r = mn_add_u64(sb, 255, &sb)) != MN_OK ||
               (r = mn_mul_u64(sb / 256 * 256, ns, &sb)) != MN_OK))
        return r;  // (no T x T buffer: its size cannot overflow the count)
    return mn_add_u64(hb, sb, out);
}

// Host allocation through the caller's allocator, or MN_MALLOC/MN_FREE when it is all-zero.
MN__PRIVATE void *mn__alloc(const mn_allocator *a, size_t size) {
    if (a && a->alloc_fn) return a->alloc_fn(a->user_data, size);
    return MN_MALLOC(size);
}

MN__PRIVATE void mn__free(const mn_allocator *a, void *p) {
    if (!p) return;
    if (a && a->free_fn) a->free_fn(a->user_data, p);
    else MN_FREE(p);
}

// Allocates n * size bytes, or NULL when the product overflows or the allocator fails.
MN__PRIVATE void *mn__alloc_array(const mn_allocator *a, size_t n, size_t size) {
    if (size != 0 && n > SIZE_MAX / size) return NULL;
    return mn__alloc(a, (n * size) != 0 ? n * size : 1);
}

MN__PRIVATE void mn__log(const mn_logger *lg, mn_log_level level, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    if (!lg || !lg->log_fn) return;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    lg->log_fn(lg->user_data, level, buf);
}

MN__PRIVATE int mn__tolower(int c) { return (c >= 'A' && c <= 'Z') ? c + ('a' - 'A') : c; }

MN__PRIVATE int mn__streq_nocase(const char *a, const char *b) {
    while (*a && *b && mn__tolower((unsigned char)*a) == mn__tolower((unsigned char)*b)) a++, b++;
    return *a == 0 && *b == 0;
}

MNIMPL mn_result mn_size_parse(const char *s, uint64_t *out) {
    // digits[.digits] followed by an optional unit, rounded to the nearest byte (a half up), in
    // integers: the fraction 0.d1..dk times the unit's bytes M is (d1..dk * M) / 10^k, and the
    // long multiplication of the digits by M from the last one leaves floor of that as its carry
    // and d1's place as its last digit, which says whether the rest is a half or more (the
    // carry stays below M, so nothing overflows for any number of digits)
    static const struct { const char *unit; uint64_t mult; } units[] = {
        {"", 1}, {"b", 1}, {"kb", 1000}, {"mb", 1000000}, {"gb", 1000000000},
        {"tb", 1000000000000ull}, {"kib", 1ull << 10}, {"mib", 1ull << 20}, {"gib", 1ull << 30},
        {"tib", 1ull << 40}, {"k", 1ull << 10}, {"m", 1ull << 20}, {"g", 1ull << 30}};
    const char *p = s, *f0 = NULL, *f1 = NULL;
    uint64_t ip = 0, whole, carry, last = 0;
    int digits = 0;
    size_t i;
    if (!s || !out) return MN_ERR_INVALID_ARG;
    while (*p >= '0' && *p <= '9') {
        uint64_t d = (uint64_t)(*p - '0');
        if (ip > (UINT64_MAX - d) / 10) return MN_ERR_OVERFLOW;
        ip = ip * 10 + d;
        p++, digits++;
    }
    if (*p == '.') {
        f0 = ++p;
        while (*p >= '0' && *p <= '9') p++, digits++;
        f1 = p;
    }
    if (digits == 0) return MN_ERR_PARSE;
    while (*p == ' ') p++;
    for (i = 0; i < sizeof units / sizeof units[0]; i++) {
        const char *q;
        if (!mn__streq_nocase(p, units[i].unit)) continue;
        if (mn_mul_u64(ip, units[i].mult, &whole) != MN_OK) return MN_ERR_OVERFLOW;
        for (carry = 0, q = f1; f0 && q > f0;) {
            uint64_t t = (uint64_t)(*--q - '0') * units[i].mult + carry;
            last = t % 10, carry = t / 10;
        }
        if (mn_add_u64(whole, carry + (last >= 5), out) != MN_OK) return MN_ERR_OVERFLOW;
        return MN_OK;
    }
    return MN_ERR_PARSE;
}

MNIMPL void mn_size_format(uint64_t bytes, char *buf, size_t cap) {
    static const char *const u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)bytes;
    int i = 0;
    if (!buf || cap == 0) return;
    while (v >= 1024.0 && i < 6) v /= 1024.0, i++;
    if (i == 0) snprintf(buf, cap, "%llu B", (unsigned long long)bytes);
    else snprintf(buf, cap, "%.2f %s", v, u[i]);
}

// >>json implementation ---------------------------------------------------------------------------
//
// The reader makes three passes over the text with one iterative walker (no recursion, so a
// hostile document cannot exhaust the C stack):
//   pass 0 validates the grammar (RFC 8259) and counts values, containers and arena bytes;
//   pass 1 counts the direct children of every container (in pre-order);
//   pass 2 builds: each container reserves its children as one contiguous run of the value pool,
//          strings are unescaped and number literals copied into the byte arena, object keys are
//          sorted to find duplicates.
// Memory: one block (values, frames, child counts, bytes) plus one buffer for the key sort.

#define MN__JSON_DEPTH_CAP 4096u
#define MN__JSON_DEFAULT_DEPTH 128u
#define MN__JSON_DEFAULT_BYTES (256ull << 20)

typedef struct mn__jframe {
    uint64_t cidx;          // pass 1: pre-order index of the container
    mn_json_value *self;    // pass 2: the container's value
    mn_json_value *next;    // pass 2: slot of its next child
} mn__jframe;

typedef struct mn__jp {
    const char *s;
    size_t n, i;
    int pass;
    uint32_t max_depth, depth;
    uint64_t nvalues, ncontainers, nbytes;
    uint64_t max_members;     // largest object, in members (pass 1)
    mn_json_value *pool;
    uint64_t pool_next;
    uint64_t *counts;
    uint64_t cidx;
    mn__jframe *frames;
    char *arena;
    uint64_t arena_next;
    uint32_t *sortbuf;
    mn_json_doc *doc;
    unsigned char is_obj[MN__JSON_DEPTH_CAP / 8];
} mn__jp;

MN__PRIVATE mn_result mn__json_fail(mn__jp *p, size_t at, const char *fmt, ...) {
    va_list ap;
    char what[112];
    uint64_t line = 1, col = 1;
    size_t k;
    if (p->doc->error[0]) return MN_ERR_PARSE;  // keep the first error
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (at > p->n) at = p->n;
    for (k = 0; k < at; k++) {
        if (p->s[k] == '\n') line++, col = 1;
        else col++;
    }
    snprintf(p->doc->error, sizeof p->doc->error, "%s at line %llu, column %llu", what,
             (unsigned long long)line, (unsigned long long)col);
    p->doc->error_offset = at;
    return MN_ERR_PARSE;
}

MN__PRIVATE void mn__json_ws(mn__jp *p) {
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->i++;
    }
}

// Describes the byte at i for an error message.
MN__PRIVATE const char *mn__json_what(mn__jp *p, size_t i, char *buf, size_t cap) {
    unsigned char c;
    if (i >= p->n) return "end of input";
    c = (unsigned char)p->s[i];
    if (c == 0) return "NUL byte";
    if (c == '/') return "'/' (comments are not JSON)";
    if (c >= 0x21 && c < 0x7f) snprintf(buf, cap, "'%c'", c);
    else snprintf(buf, cap, "byte 0x%02x", c);
    return buf;
}

MN__PRIVATE int mn__json_hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Length of a well-formed UTF-8 sequence at s[0..n) (Unicode 15, table 3-7), 0 if ill-formed.
MN__PRIVATE size_t mn__utf8_len(const unsigned char *s, size_t n) {
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    size_t len, k;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) len = 3;
    else if (c >= 0xf0 && c <= 0xf4) len = 4;
    else return 0;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;  // no UTF-16 surrogates
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;  // nothing above U+10FFFF
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (k = 2; k < len; k++)
        if (s[k] < 0x80 || s[k] > 0xbf) return 0;
    return len;
}

MN__PRIVATE size_t mn__utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) {
        if (out) out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        if (out) out[0] = (char)(0xc0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        if (out) {
            out[0] = (char)(0xe0 | (cp >> 12));
            out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
            out[2] = (char)(0x80 | (cp & 0x3f));
        }
        return 3;
    }
    if (out) {
        out[0] = (char)(0xf0 | (cp >> 18));
        out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[3] = (char)(0x80 | (cp & 0x3f));
    }
    return 4;
}

MN__PRIVATE mn_result mn__json_u4(mn__jp *p, size_t at, uint32_t *cp) {
    int k, h;
    *cp = 0;
    if (p->n - at < 6) return mn__json_fail(p, at, "truncated \\u escape");
    for (k = 2; k < 6; k++) {
        h = mn__json_hex(p->s[at + (size_t)k]);
        if (h < 0) return mn__json_fail(p, at, "\\u escape needs four hex digits");
        *cp = *cp * 16 + (uint32_t)h;
    }
    return MN_OK;
}

// String at p->i (the opening quote). Writes the unescaped bytes to out when out is not NULL;
// *len receives their count. Leaves p->i after the closing quote.
MN__PRIVATE mn_result mn__json_string(mn__jp *p, char *out, uint64_t *len) {
    size_t start = p->i;
    uint64_t n = 0;
    p->i++;
    for (;;) {
        unsigned char c;
        if (p->i >= p->n) return mn__json_fail(p, start, "unterminated string");
        c = (unsigned char)p->s[p->i];
        if (c == '"') break;
        if (c < 0x20) {
            return mn__json_fail(p, p->i, c == 0 ? "NUL byte in string"
                                              : "unescaped control character 0x%02x in string", c);
        }
        if (c == '\\') {
            char e;
            uint32_t cp;
            if (p->i + 1 >= p->n) return mn__json_fail(p, start, "unterminated string");
            e = p->s[p->i + 1];
            if (e == 'u') {
                if (mn__json_u4(p, p->i, &cp) != MN_OK) return MN_ERR_PARSE;
                if (cp >= 0xdc00 && cp <= 0xdfff)
                    return mn__json_fail(p, p->i, "lone low surrogate \\u%04X", (unsigned)cp);
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    uint32_t lo;
                    if (p->n - p->i < 12 || p->s[p->i + 6] != '\\' || p->s[p->i + 7] != 'u')
                        return mn__json_fail(p, p->i, "lone high surrogate \\u%04X", (unsigned)cp);
                    if (mn__json_u4(p, p->i + 6, &lo) != MN_OK) return MN_ERR_PARSE;
                    if (lo < 0xdc00 || lo > 0xdfff)
                        return mn__json_fail(p, p->i, "high surrogate \\u%04X without a low one",
                                             (unsigned)cp);
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    p->i += 6;
                }
                n += mn__utf8_put(cp, out ? out + n : NULL);
                p->i += 6;
                continue;
            }
            switch (e) {
            case '"': c = '"'; break;
            case '\\': c = '\\'; break;
            case '/': c = '/'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            default: {
                char buf[16];
                return mn__json_fail(p, p->i, "invalid escape \\%s",
                                     mn__json_what(p, p->i + 1, buf, sizeof buf));
            }
            }
            if (out) out[n] = (char)c;
            n++;
            p->i += 2;
            continue;
        }
        if (c < 0x80) {
            if (out) out[n] = (char)c;
            n++;
            p->i++;
        } else {
            size_t k = mn__utf8_len((const unsigned char *)p->s + p->i, p->n - p->i);
            if (k == 0) return mn__json_fail(p, p->i, "invalid UTF-8 in string");
            if (out) memcpy(out + n, p->s + p->i, k);
            n += k;
            p->i += k;
        }
    }
    p->i++;
    if (n > UINT32_MAX - 1) return mn__json_fail(p, start, "string longer than 4 GiB");
    *len = n;
    return MN_OK;
}

// Number at p->i: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? (RFC 8259 section 6).
MN__PRIVATE mn_result mn__json_number(mn__jp *p, size_t *start) {
    const char *s = p->s;
    size_t i = p->i;
    *start = i;
    if (i < p->n && s[i] == '-') i++;
    if (i >= p->n || s[i] < '0' || s[i] > '9') {
        if (i < p->n && (s[i] == 'I' || s[i] == 'N'))
            return mn__json_fail(p, *start, "NaN and Infinity are not JSON");
        return mn__json_fail(p, *start, "'-' must be followed by a digit");
    }
    if (s[i] == '0') {
        i++;
        if (i < p->n && s[i] >= '0' && s[i] <= '9')
            return mn__json_fail(p, *start, "leading zero in number");
    } else {
        while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < p->n && s[i] == '.') {
        i++;
        if (i >= p->n || s[i] < '0' || s[i] > '9')
            return mn__json_fail(p, i, "digit expected after '.'");
        while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < p->n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < p->n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= p->n || s[i] < '0' || s[i] > '9')
            return mn__json_fail(p, i, "digit expected in exponent");
        while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
    }
    p->i = i;
    return MN_OK;
}

// strtod on a NUL-terminated, validated literal; tolerates a locale whose decimal point is not '.'.
MN__PRIVATE int mn__json_strtod(const char *lit, size_t n, double *out) {
    char buf[512], *end = NULL;
    size_t k;
    const struct lconv *lc;
    *out = strtod(lit, &end);
    if (end == lit + n) return 1;
    lc = localeconv();
    if (n >= sizeof buf || !lc || !lc->decimal_point || !lc->decimal_point[0]) return 0;
    for (k = 0; k < n; k++) buf[k] = lit[k] == '.' ? lc->decimal_point[0] : lit[k];
    buf[n] = 0;
    *out = strtod(buf, &end);
    return end == buf + n;
}

// Adds one value: counts it (pass 0), counts it as a child (pass 1) or returns its slot (pass 2).
MN__PRIVATE mn_json_value *mn__json_emit(mn__jp *p) {
    if (p->pass == 0) {
        p->nvalues++;
        return NULL;
    }
    if (p->pass == 1) {
        if (p->depth > 0) p->counts[p->frames[p->depth - 1].cidx]++;
        return NULL;
    }
    if (p->depth == 0) return &p->pool[p->pool_next++];
    return p->frames[p->depth - 1].next++;
}

MN__PRIVATE int mn__json_key_cmp(const mn_json_value *a, const mn_json_value *b) {
    uint32_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->str, b->str, n);
    if (c != 0) return c;
    return a->len < b->len ? -1 : a->len > b->len ? 1 : 0;
}

// Heap sort of member indices by key (no recursion, O(n log n)), then adjacent keys compared.
MN__PRIVATE mn_result mn__json_dupkeys(mn__jp *p, const mn_json_value *obj, size_t at) {
    const mn_json_value *it = obj->items;
    uint32_t *a = p->sortbuf, n = obj->len, k, end, root, child, t;
    if (n < 2) return MN_OK;
    for (k = 0; k < n; k++) a[k] = k;
    for (k = n / 2; k-- > 0;) {
        for (root = k; (child = 2 * root + 1) < n; root = child) {
            if (child + 1 < n && mn__json_key_cmp(&it[2 * a[child]], &it[2 * a[child + 1]]) < 0)
                child++;
            if (mn__json_key_cmp(&it[2 * a[root]], &it[2 * a[child]]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
    for (end = n - 1; end > 0; end--) {
        t = a[0], a[0] = a[end], a[end] = t;
        for (root = 0; (child = 2 * root + 1) < end; root = child) {
            if (child + 1 < end && mn__json_key_cmp(&it[2 * a[child]], &it[2 * a[child + 1]]) < 0)
                child++;
            if (mn__json_key_cmp(&it[2 * a[root]], &it[2 * a[child]]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
    for (k = 1; k < n; k++) {
        if (mn__json_key_cmp(&it[2 * a[k - 1]], &it[2 * a[k]]) == 0)
            return mn__json_fail(p, at, "duplicate key \"%.60s\" in the object ending here",
                                 it[2 * a[k]].str);
    }
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_open(mn__jp *p, int obj) {
    mn_json_value *v = mn__json_emit(p);
    uint32_t d = p->depth;
    if (d >= p->max_depth)
        return mn__json_fail(p, p->i, "nesting deeper than %u", (unsigned)p->max_depth);
    if (obj) p->is_obj[d / 8] |= (unsigned char)(1u << (d % 8));
    else p->is_obj[d / 8] &= (unsigned char)~(1u << (d % 8));
    if (p->pass == 0) {
        p->ncontainers++;
    } else if (p->pass == 1) {
        p->frames[d].cidx = p->cidx++;
    } else {
        uint32_t c = (uint32_t)p->counts[p->cidx++];
        v->type = obj ? MN_JSON_OBJECT : MN_JSON_ARRAY;
        v->len = obj ? c / 2 : c;
        v->items = p->pool + p->pool_next;
        p->frames[d].self = v;
        p->frames[d].next = p->pool + p->pool_next;
        p->pool_next += c;
    }
    p->depth++;
    p->i++;
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_close(mn__jp *p) {
    uint32_t d = --p->depth;
    int obj = (p->is_obj[d / 8] >> (d % 8)) & 1;
    if (p->pass == 1) {
        uint64_t c = p->counts[p->frames[d].cidx];
        if (c > UINT32_MAX - 1) return mn__json_fail(p, p->i, "container with over 2^32 items");
        if (obj && c / 2 > p->max_members) p->max_members = c / 2;
    } else if (p->pass == 2 && obj) {
        if (mn__json_dupkeys(p, p->frames[d].self, p->i) != MN_OK) return MN_ERR_PARSE;
    }
    p->i++;
    return MN_OK;
}

// A string value (or key) at p->i.
MN__PRIVATE mn_result mn__json_str_value(mn__jp *p) {
    mn_json_value *v = mn__json_emit(p);
    uint64_t len = 0;
    if (p->pass == 2) {
        char *out = p->arena + p->arena_next;
        if (mn__json_string(p, out, &len) != MN_OK) return MN_ERR_PARSE;
        out[len] = 0;
        v->type = MN_JSON_STRING;
        v->len = (uint32_t)len;
        v->str = out;
        p->arena_next += len + 1;
        return MN_OK;
    }
    if (mn__json_string(p, NULL, &len) != MN_OK) return MN_ERR_PARSE;
    if (p->pass == 0) p->nbytes += len + 1;
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_key(mn__jp *p) {
    char buf[16];
    mn__json_ws(p);
    if (p->i >= p->n || p->s[p->i] != '"')
        return mn__json_fail(p, p->i, "expected a string key, found %s",
                             mn__json_what(p, p->i, buf, sizeof buf));
    if (mn__json_str_value(p) != MN_OK) return MN_ERR_PARSE;
    mn__json_ws(p);
    if (p->i >= p->n || p->s[p->i] != ':')
        return mn__json_fail(p, p->i, "expected ':' after key, found %s",
                             mn__json_what(p, p->i, buf, sizeof buf));
    p->i++;
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_scalar(mn__jp *p) {
    static const struct { const char *lit; size_t n; mn_json_type t; } lits[] = {
        {"null", 4, MN_JSON_NULL}, {"true", 4, MN_JSON_TRUE}, {"false", 5, MN_JSON_FALSE}};
    char c = p->s[p->i], buf[16];
    size_t k, start;
    if (c == '"') return mn__json_str_value(p);
    for (k = 0; k < 3; k++) {
        if (c != lits[k].lit[0]) continue;
        if (p->n - p->i < lits[k].n || memcmp(p->s + p->i, lits[k].lit, lits[k].n) != 0)
            return mn__json_fail(p, p->i, "invalid literal (expected %s)", lits[k].lit);
        {
            mn_json_value *v = mn__json_emit(p);
            if (v) v->type = lits[k].t;
        }
        p->i += lits[k].n;
        return MN_OK;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        mn_json_value *v;
        size_t n;
        if (mn__json_number(p, &start) != MN_OK) return MN_ERR_PARSE;
        n = p->i - start;
        v = mn__json_emit(p);
        if (p->pass == 0) p->nbytes += n + 1;
        if (p->pass == 2) {
            char *out = p->arena + p->arena_next;
            memcpy(out, p->s + start, n);
            out[n] = 0;
            p->arena_next += n + 1;
            v->type = MN_JSON_NUMBER;
            v->len = 0;
            v->str = out;
            if (!mn__json_strtod(out, n, &v->num) || v->num > DBL_MAX || v->num < -DBL_MAX)
                return mn__json_fail(p, start, "number %.40s out of the double range", out);
        }
        return MN_OK;
    }
    if (c == 'N' || c == 'I') return mn__json_fail(p, p->i, "NaN and Infinity are not JSON");
    return mn__json_fail(p, p->i, "expected a value, found %s",
                         mn__json_what(p, p->i, buf, sizeof buf));
}

// One pass over the whole text.
MN__PRIVATE mn_result mn__json_walk(mn__jp *p) {
    char buf[16];
    p->i = 0;
    p->depth = 0;
    p->cidx = 0;
    for (;;) {
        // a value is expected
        mn__json_ws(p);
        if (p->i >= p->n) {
            if (p->depth == 0 && p->nvalues == 0 && p->pass == 0)
                return mn__json_fail(p, p->i, "empty document");
            return mn__json_fail(p, p->i, "unexpected end of input, expected a value");
        }
        if (p->s[p->i] == '[' || p->s[p->i] == '{') {
            int obj = p->s[p->i] == '{';
            if (mn__json_open(p, obj) != MN_OK) return MN_ERR_PARSE;
            mn__json_ws(p);
            if (p->i < p->n && p->s[p->i] == (obj ? '}' : ']')) {
                if (mn__json_close(p) != MN_OK) return MN_ERR_PARSE;
            } else {
                if (obj && mn__json_key(p) != MN_OK) return MN_ERR_PARSE;
                continue;
            }
        } else if (mn__json_scalar(p) != MN_OK) {
            return MN_ERR_PARSE;
        }
        // after a value: ',' or a closing bracket, or the end of the document
        for (;;) {
            int obj;
            char c;
            mn__json_ws(p);
            if (p->depth == 0) {
                if (p->i < p->n)
                    return mn__json_fail(p, p->i, "trailing %s after the document",
                                         mn__json_what(p, p->i, buf, sizeof buf));
                return MN_OK;
            }
            obj = (p->is_obj[(p->depth - 1) / 8] >> ((p->depth - 1) % 8)) & 1;
            c = p->i < p->n ? p->s[p->i] : 0;
            if (c == ',') {
                p->i++;
                mn__json_ws(p);
                if (p->i < p->n && (p->s[p->i] == ']' || p->s[p->i] == '}'))
                    return mn__json_fail(p, p->i, "trailing comma");
                if (obj && mn__json_key(p) != MN_OK) return MN_ERR_PARSE;
                break;
            }
            if (c == (obj ? '}' : ']') && p->i < p->n) {
                if (mn__json_close(p) != MN_OK) return MN_ERR_PARSE;
                continue;
            }
            return mn__json_fail(p, p->i, obj ? "expected ',' or '}', found %s"
                                              : "expected ',' or ']', found %s",
                                 mn__json_what(p, p->i, buf, sizeof buf));
        }
    }
}

MNIMPL mn_result mn_json_parse(const char *text, size_t len, const mn_json_desc *desc,
                               mn_json_doc *doc) {
    mn__jp p;
    mn_json_desc d;
    uint64_t sz_values, sz_frames, sz_counts, total;
    unsigned char *block;
    mn_result r;
    if (!doc) return MN_ERR_INVALID_ARG;
    memset(doc, 0, sizeof *doc);
    if (!text && len) return MN_ERR_INVALID_ARG;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.max_depth == 0) d.max_depth = MN__JSON_DEFAULT_DEPTH;
    if (d.max_depth > MN__JSON_DEPTH_CAP) d.max_depth = MN__JSON_DEPTH_CAP;
    if (d.max_bytes == 0) d.max_bytes = MN__JSON_DEFAULT_BYTES;
    doc->alloc_ = d.allocator;
    memset(&p, 0, sizeof p);
    p.s = text ? text : "";
    p.n = len;
    p.doc = doc;
    p.max_depth = d.max_depth;
    if ((uint64_t)len > d.max_bytes) {
        snprintf(doc->error, sizeof doc->error,
                 "document of %llu bytes exceeds the %llu-byte limit", (unsigned long long)len,
                 (unsigned long long)d.max_bytes);
        return MN_ERR_PARSE;
    }
    if (len >= 3 && (unsigned char)text[0] == 0xef && (unsigned char)text[1] == 0xbb &&
        (unsigned char)text[2] == 0xbf)
        return mn__json_fail(&p, 0, "byte order mark before the document");
    // pass 0: validate and count
    if (mn__json_walk(&p) != MN_OK) return MN_ERR_PARSE;
    // one block: values | frames | child counts | bytes
    sz_frames = (uint64_t)(p.max_depth + 1) * sizeof(mn__jframe);
    if (mn_mul_u64(p.nvalues, sizeof(mn_json_value), &sz_values) != MN_OK ||
        mn_mul_u64(p.ncontainers, sizeof(uint64_t), &sz_counts) != MN_OK ||
        mn_add_u64(sz_values, sz_frames, &total) != MN_OK ||
        mn_add_u64(total, sz_counts, &total) != MN_OK ||
        mn_add_u64(total, p.nbytes, &total) != MN_OK || total > (uint64_t)SIZE_MAX) {
        snprintf(doc->error, sizeof doc->error, "document too large for this host");
        return MN_ERR_OUT_OF_MEMORY;
    }
    block = (unsigned char *)mn__alloc(&d.allocator, (size_t)total);
    if (!block) {
        snprintf(doc->error, sizeof doc->error, "out of memory (%llu bytes for the tree)",
                 (unsigned long long)total);
        return MN_ERR_OUT_OF_MEMORY;
    }
    memset(block, 0, (size_t)(sz_values + sz_frames + sz_counts));
    doc->mem_ = block;
    p.pool = (mn_json_value *)(void *)block;
    p.frames = (mn__jframe *)(void *)(block + sz_values);
    p.counts = (uint64_t *)(void *)(block + sz_values + sz_frames);
    p.arena = (char *)(block + sz_values + sz_frames + sz_counts);
    // pass 1: children per container
    p.pass = 1;
    if (mn__json_walk(&p) != MN_OK) goto fail_parse;
    // pass 2: build
    if (p.max_members > 1) {
        p.sortbuf = (uint32_t *)mn__alloc_array(&d.allocator, (size_t)p.max_members,
                                                sizeof(uint32_t));
        if (!p.sortbuf) {
            snprintf(doc->error, sizeof doc->error, "out of memory (key sort)");
            r = MN_ERR_OUT_OF_MEMORY;
            goto fail;
        }
    }
    p.pass = 2;
    r = mn__json_walk(&p);
    mn__free(&d.allocator, p.sortbuf);
    if (r != MN_OK) goto fail_parse;
    doc->root = p.pool;
    return MN_OK;
fail_parse:
    r = MN_ERR_PARSE;
fail:
    mn__free(&d.allocator, block);
    doc->mem_ = NULL;
    doc->root = NULL;
    return r;
}

MNIMPL void mn_json_free(mn_json_doc *doc) {
    if (!doc) return;
    mn__free(&doc->alloc_, doc->mem_);
    doc->mem_ = NULL;
    doc->root = NULL;
}

MNIMPL const mn_json_value *mn_json_get(const mn_json_value *obj, const char *key) {
    size_t n;
    uint32_t k;
    if (!obj || !key || obj->type != MN_JSON_OBJECT) return NULL;
    n = strlen(key);
    for (k = 0; k < obj->len; k++) {
        const mn_json_value *kv = &obj->items[2 * k];
        if (kv->len == n && memcmp(kv->str, key, n) == 0) return &obj->items[2 * k + 1];
    }
    return NULL;
}

MNIMPL mn_result mn_json_u64(const mn_json_value *v, uint64_t *out) {
    // value = digits * 10^(exp - fraction digits), computed exactly on the literal's digits
    const char *s, *digits, *p;
    int neg = 0, nonzero = 0, seen_dot = 0;
    uint64_t ndig = 0, nfrac = 0, exp = 0, acc = 0, k;
    int exp_neg = 0;
    int64_t shift;
    if (!v || !out || v->type != MN_JSON_NUMBER || !v->str) return MN_ERR_INVALID_ARG;
    s = v->str;
    if (*s == '-') neg = 1, s++;
    digits = s;
    for (p = s; *p && *p != 'e' && *p != 'E'; p++) {
        if (*p == '.') {
            seen_dot = 1;
            continue;
        }
        if (*p < '0' || *p > '9') return MN_ERR_INVALID_ARG;
        if (*p != '0') nonzero = 1;
        ndig++;
        if (seen_dot) nfrac++;
    }
    if (ndig == 0) return MN_ERR_INVALID_ARG;
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-') exp_neg = *p == '-', p++;
        for (; *p >= '0' && *p <= '9'; p++) {
            if (exp < 100000000) exp = exp * 10 + (uint64_t)(*p - '0');
        }
    }
    if (!nonzero) {
        *out = 0;
        return MN_OK;
    }
    if (neg) return MN_ERR_INVALID_ARG;
    // shift = exponent - fraction digits (both bounded by 10^8 and the document size)
    shift = (exp_neg ? -(int64_t)exp : (int64_t)exp) - (int64_t)nfrac;
    // digits dropped by a negative shift must be zeros
    k = 0;
    for (p = digits; *p && *p != 'e' && *p != 'E'; p++) {
        if (*p == '.') continue;
        k++;
        if (shift < 0 && (int64_t)(ndig - k) < -shift) {
            if (*p != '0') return MN_ERR_INVALID_ARG;
            continue;
        }
        if (acc > (UINT64_MAX - (uint64_t)(*p - '0')) / 10) return MN_ERR_OVERFLOW;
        acc = acc * 10 + (uint64_t)(*p - '0');
    }
    for (; shift > 0; shift--) {
        if (acc > UINT64_MAX / 10) return MN_ERR_OVERFLOW;
        acc *= 10;
    }
    *out = acc;
    return MN_OK;
}

MNIMPL mn_result mn_json_f64(const mn_json_value *v, double *out) {
    if (!v || !out || v->type != MN_JSON_NUMBER) return MN_ERR_INVALID_ARG;
    *out = v->num;
    return MN_OK;
}

MNIMPL const char *mn_json_type_name(mn_json_type t) {
    static const char *const names[MN_JSON_TYPE_COUNT] = {"invalid", "null", "false", "true",
                                                          "number", "string", "array", "object"};
    return (unsigned)t < MN_JSON_TYPE_COUNT ? names[t] : "invalid";
}

// Escape of the character at *u into e (at most 6 bytes); returns its length and advances *u.
// A well-formed UTF-8 sequence is copied whole, an ill-formed byte becomes \ufffd, so the output
// is always valid JSON.
MN__PRIVATE size_t mn__json_esc(const unsigned char **u, char *e) {
    static const char hex[] = "0123456789abcdef";
    unsigned char c = **u;
    size_t n, k;
    switch (c) {
    case '"': e[0] = '\\', e[1] = '"'; break;
    case '\\': e[0] = '\\', e[1] = '\\'; break;
    case '\b': e[0] = '\\', e[1] = 'b'; break;
    case '\f': e[0] = '\\', e[1] = 'f'; break;
    case '\n': e[0] = '\\', e[1] = 'n'; break;
    case '\r': e[0] = '\\', e[1] = 'r'; break;
    case '\t': e[0] = '\\', e[1] = 't'; break;
    default:
        if (c < 0x20 || c == 0x7f) {
            e[0] = '\\', e[1] = 'u', e[2] = '0', e[3] = '0', e[4] = hex[c >> 4];
            e[5] = hex[c & 15];
            (*u)++;
            return 6;
        }
        for (n = 0; n < 4 && (*u)[n]; n++) {}  // bytes available before the NUL
        k = mn__utf8_len(*u, n);
        if (k == 0) {
            memcpy(e, "\\ufffd", 6);
            (*u)++;
            return 6;
        }
        memcpy(e, *u, k);
        *u += k;
        return k;
    }
    (*u)++;
    return 2;
}

MNIMPL size_t mn_json_escape(char *buf, size_t cap, const char *s) {
    // pieces are written whole while they fit; the returned length counts them all
    size_t n = 0, w = 0, m;
    int full = buf == NULL || cap == 0, state = 0;  // 0 opening quote, 1 body, 2 done
    char e[8];
    const unsigned char *u = (const unsigned char *)(s ? s : "");
    while (state < 2) {
        if (state == 0) e[0] = '"', m = 1, state = 1;
        else if (*u) m = mn__json_esc(&u, e);
        else e[0] = '"', m = 1, state = 2;
        if (!full && w + m < cap) memcpy(buf + w, e, m), w += m;
        else full = 1;
        n += m;
    }
    if (buf && cap) buf[w] = 0;
    return n;
}

MNIMPL void mn_json_fputs_escaped(FILE *f, const char *s) {
    char e[8];
    const unsigned char *u = (const unsigned char *)(s ? s : "");
    if (!f) return;
    fputc('"', f);
    while (*u) {
        size_t m = mn__json_esc(&u, e);
        fwrite(e, 1, m, f);
    }
    fputc('"', f);
}

// Size of an open file from its end (64-bit offsets on Windows, where long has 32 bits).
MN__PRIVATE int mn__file_size(FILE *f, uint64_t *size) {
#if defined(_WIN32) && defined(_MSC_VER)
    __int64 n;
    if (_fseeki64(f, 0, SEEK_END) != 0 || (n = _ftelli64(f)) < 0 || _fseeki64(f, 0, SEEK_SET) != 0)
        return 0;
#else
    long n;
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) return 0;
#endif
    *size = (uint64_t)n;
    return 1;
}

// Reads a whole file of at most max bytes into a fresh buffer (NUL-terminated for convenience).
// MN_ERR_NOT_FOUND when it does not exist, MN_ERR_IO when it cannot be read or is too long.
MN__PRIVATE mn_result mn__read_file(const mn_allocator *a, const char *path, uint64_t max,
                                    char **data, size_t *len) {
    FILE *f;
    uint64_t size;
    char *buf;
    *data = NULL, *len = 0;
    f = fopen(path, "rb");
    if (!f) return errno == ENOENT ? MN_ERR_NOT_FOUND : MN_ERR_IO;
    if (!mn__file_size(f, &size) || size > max || size >= (uint64_t)SIZE_MAX) {
        fclose(f);
        return MN_ERR_IO;
    }
    buf = (char *)mn__alloc(a, (size_t)size + 1);
    if (!buf) {
        fclose(f);
        return MN_ERR_OUT_OF_MEMORY;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size || ferror(f)) {
        mn__free(a, buf);
        fclose(f);
        return MN_ERR_IO;
    }
    fclose(f);
    buf[size] = 0;
    *data = buf, *len = (size_t)size;
    return MN_OK;
}

// >>safetensors implementation --------------------------------------------------------------------
//
// Invariants checked (safetensors format spec and the reference crate's validate()): the header
// length N is at most 100,000,000 and 8 + N <= file size; the header is a JSON object starting
// with '{'; each tensor's byte length equals prod(shape) * dtype size; sorted by offsets, the
// tensors tile the data section [0, file size - 8 - N) exactly: the first begins at 0, each
// begins where the previous ends, the last ends at the end of the file.

#define MN__ST_MAX_HEADER 100000000ull

static const struct {
    const char *name;
    uint32_t bytes;
    mn_dtype dtype;
} mn__st_dtypes[MN_ST_DTYPE_COUNT] = {
    {"unknown", 0, MN_DTYPE_DEFAULT}, {"BOOL", 1, MN_DTYPE_DEFAULT}, {"U8", 1, MN_INT8},
    {"I8", 1, MN_INT8}, {"F8_E4M3", 1, MN_DTYPE_DEFAULT}, {"F8_E5M2", 1, MN_DTYPE_DEFAULT},
    {"F8_E8M0", 1, MN_DTYPE_DEFAULT}, {"I16", 2, MN_DTYPE_DEFAULT}, {"U16", 2, MN_DTYPE_DEFAULT},
    {"F16", 2, MN_FP16}, {"BF16", 2, MN_BF16}, {"I32", 4, MN_DTYPE_DEFAULT},
    {"U32", 4, MN_DTYPE_DEFAULT}, {"F32", 4, MN_FP32}, {"I64", 8, MN_DTYPE_DEFAULT},
    {"U64", 8, MN_DTYPE_DEFAULT}, {"F64", 8, MN_DTYPE_DEFAULT}};

MNIMPL const char *mn_st_dtype_name(mn_st_dtype t) {
    return (unsigned)t < MN_ST_DTYPE_COUNT ? mn__st_dtypes[t].name : "unknown";
}

MNIMPL uint32_t mn_st_dtype_bytes(mn_st_dtype t) {
    return (unsigned)t < MN_ST_DTYPE_COUNT ? mn__st_dtypes[t].bytes : 0;
}

MNIMPL mn_dtype mn_st_dtype_to_dtype(mn_st_dtype t) {
    return (unsigned)t < MN_ST_DTYPE_COUNT ? mn__st_dtypes[t].dtype : MN_DTYPE_DEFAULT;
}

MN__PRIVATE mn_result mn__st_fail(mn_safetensors_info *out, const mn_logger *lg, mn_result r,
                                  const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->error, sizeof out->error, fmt, ap);
    va_end(ap);
    mn__log(lg, MN_LOG_ERROR, "safetensors: %s", out->error);
    return r;
}

typedef struct mn__st_range {
    uint64_t begin, end;
    uint32_t member;  // index of the tensor in the header object
} mn__st_range;

MN__PRIVATE int mn__st_less(const mn__st_range *a, const mn__st_range *b) {
    return a->begin < b->begin || (a->begin == b->begin && a->end < b->end);
}

MN__PRIVATE void mn__st_sort(mn__st_range *r, uint64_t n) {  // heap sort by (begin, end)
    uint64_t k, end, root, child;
    mn__st_range t;
    if (n < 2) return;
    for (k = n / 2; k-- > 0;) {
        for (root = k; (child = 2 * root + 1) < n; root = child) {
            if (child + 1 < n && mn__st_less(&r[child], &r[child + 1])) child++;
            if (!mn__st_less(&r[root], &r[child])) break;
            t = r[root], r[root] = r[child], r[child] = t;
        }
    }
    for (end = n - 1; end > 0; end--) {
        t = r[0], r[0] = r[end], r[end] = t;
        for (root = 0; (child = 2 * root + 1) < end; root = child) {
            if (child + 1 < end && mn__st_less(&r[child], &r[child + 1])) child++;
            if (!mn__st_less(&r[root], &r[child])) break;
            t = r[root], r[root] = r[child], r[child] = t;
        }
    }
}

// One tensor entry: dtype, element count and offsets, validated against the data section.
MN__PRIVATE mn_result mn__st_tensor(mn_safetensors_info *out, const mn_logger *lg,
                                    const mn_json_value *key, const mn_json_value *v,
                                    uint64_t data_bytes, mn_st_dtype *dt, uint64_t *elements,
                                    mn__st_range *range) {
    static const char *const unsized[] = {"F4", "F6_E2M3", "F6_E3M2", "C64"};
    const mn_json_value *dtype = mn_json_get(v, "dtype"), *shape = mn_json_get(v, "shape");
    const mn_json_value *offs = mn_json_get(v, "data_offsets");
    const char *name = key->str;
    uint64_t n = 1, bytes, b, e;
    uint32_t k;
    int t;
    if (v->type != MN_JSON_OBJECT)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\" is not an object", name);
    if (!dtype || dtype->type != MN_JSON_STRING)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\" has no \"dtype\" string", name);
    if (!shape || shape->type != MN_JSON_ARRAY)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\" has no \"shape\" array", name);
    if (!offs || offs->type != MN_JSON_ARRAY || offs->len != 2)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\" needs \"data_offsets\": [begin, end]", name);
    *dt = MN_ST_UNKNOWN;
    for (t = 1; t < MN_ST_DTYPE_COUNT; t++)
        if (strcmp(dtype->str, mn__st_dtypes[t].name) == 0) *dt = (mn_st_dtype)t;
    if (*dt == MN_ST_UNKNOWN) {
        for (k = 0; k < sizeof unsized / sizeof unsized[0]; k++) {
            if (strcmp(dtype->str, unsized[k]) == 0)
                return mn__st_fail(out, lg, MN_ERR_UNSUPPORTED,
                                   "tensor \"%.60s\": dtype %s is not supported", name, unsized[k]);
        }
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\": unknown dtype \"%.20s\"", name,
                           dtype->str);
    }
    for (k = 0; k < shape->len; k++) {
        uint64_t d;
        mn_result r = mn_json_u64(&shape->items[k], &d);
        if (r == MN_ERR_OVERFLOW || (r == MN_OK && mn_mul_u64(n, d, &n) != MN_OK))
            return mn__st_fail(out, lg, MN_ERR_OVERFLOW,
                               "tensor \"%.60s\": shape overflows 64 bits", name);
        if (r != MN_OK)
            return mn__st_fail(out, lg, MN_ERR_PARSE,
                               "tensor \"%.60s\": shape[%u] is not a non-negative integer", name,
                               (unsigned)k);
    }
    if (mn_mul_u64(n, mn__st_dtypes[*dt].bytes, &bytes) != MN_OK)
        return mn__st_fail(out, lg, MN_ERR_OVERFLOW, "tensor \"%.60s\": size overflows 64 bits",
                           name);
    if (mn_json_u64(&offs->items[0], &b) != MN_OK || mn_json_u64(&offs->items[1], &e) != MN_OK)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets are not non-negative integers", name);
    if (b > e)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets begin %llu > end %llu", name,
                           (unsigned long long)b, (unsigned long long)e);
    if (e > data_bytes)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets end %llu past the %llu-byte data",
                           name, (unsigned long long)e, (unsigned long long)data_bytes);
    if (e - b != bytes)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets span %llu bytes, shape needs %llu",
                           name, (unsigned long long)(e - b), (unsigned long long)bytes);
    *elements = n;
    range->begin = b, range->end = e;
    return MN_OK;
}

// Tensors that checkpoints save but that are not parameters: position-id tables, rotary
// frequency tables and GPT-2's causal-mask buffers.
MN__PRIVATE int mn__st_is_buffer(const mn_json_value *key) {
    static const char *const suffix[] = {"position_ids", "rotary_emb.inv_freq", ".attn.bias",
                                         ".attn.masked_bias"};
    size_t k, n;
    for (k = 0; k < sizeof suffix / sizeof suffix[0]; k++) {
        n = strlen(suffix[k]);
        if (key->len >= n && memcmp(key->str + key->len - n, suffix[k], n) == 0) return 1;
    }
    return 0;
}

// The 8-byte little-endian header length N, checked against the limit and the file.
MN__PRIVATE mn_result mn__st_header_length(const uint8_t *data, size_t len, uint64_t file_size,
                                           const mn_safetensors_desc *d, mn_safetensors_info *out,
                                           uint64_t *n_header) {
    const mn_logger *lg = &d->logger;
    uint64_t n = 0, k;
    if (file_size < len)
        return mn__st_fail(out, lg, MN_ERR_INVALID_ARG, "file_size %llu < %llu bytes given",
                           (unsigned long long)file_size, (unsigned long long)len);
    if (len < 8)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "%llu bytes: shorter than the 8-byte header "
                           "length", (unsigned long long)len);
    for (k = 0; k < 8; k++) n |= (uint64_t)data[k] << (8 * k);
    if (n > d->max_header)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "header length %llu exceeds the limit %llu",
                           (unsigned long long)n, (unsigned long long)d->max_header);
    if (n > file_size - 8)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "header length %llu runs past the end of the "
                           "%llu-byte file", (unsigned long long)n, (unsigned long long)file_size);
    if (n > len - 8)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "header truncated: %llu of %llu bytes given",
                           (unsigned long long)(len - 8), (unsigned long long)n);
    if (n < 2 || data[8] != '{')
        return mn__st_fail(out, lg, MN_ERR_PARSE, "header does not start with '{'");
    *n_header = n;
    return MN_OK;
}

MN__PRIVATE mn_result mn__st_metadata(mn_safetensors_info *out, const mn_logger *lg,
                                      const mn_json_value *v) {
    uint32_t j;
    if (v->type != MN_JSON_OBJECT)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "__metadata__ is not an object");
    for (j = 0; j < v->len; j++)
        if (v->items[2 * j + 1].type != MN_JSON_STRING)
            return mn__st_fail(out, lg, MN_ERR_PARSE, "__metadata__ value \"%.60s\" is not a "
                               "string", v->items[2 * j].str);
    out->metadata_count = v->len;
    return MN_OK;
}

// Every member of the header object: the metadata, or a tensor whose range goes to ranges[] and
// whose elements are summed into the parameters (or the buffers) by dtype.
MN__PRIVATE mn_result mn__st_members(mn_safetensors_info *out, const mn_logger *lg,
                                     const mn_json_value *root, uint64_t data_bytes,
                                     mn__st_range *ranges, uint64_t *ntensors) {
    uint32_t m;
    for (m = 0; m < root->len; m++) {
        const mn_json_value *key = &root->items[2 * m], *v = &root->items[2 * m + 1];
        mn_st_dtype dt = MN_ST_UNKNOWN;
        uint64_t elements = 0, nbytes;
        mn_result r;
        if (strcmp(key->str, "__metadata__") == 0 && key->len == 12) {
            if ((r = mn__st_metadata(out, lg, v)) != MN_OK) return r;
            continue;
        }
        r = mn__st_tensor(out, lg, key, v, data_bytes, &dt, &elements, &ranges[*ntensors]);
        if (r != MN_OK) return r;
        ranges[(*ntensors)++].member = m;
        nbytes = mn_st_dtype_bytes(dt) * elements;  // checked in mn__st_tensor
        if (mn__st_is_buffer(key)) {
            if (mn_add_u64(out->buffers, elements, &out->buffers) != MN_OK)
                return mn__st_fail(out, lg, MN_ERR_OVERFLOW, "buffer count overflows 64 bits");
            continue;
        }
        if (mn_add_u64(out->params, elements, &out->params) != MN_OK ||
            mn_add_u64(out->params_by_dtype[dt], elements, &out->params_by_dtype[dt]) != MN_OK ||
            mn_add_u64(out->bytes_by_dtype[dt], nbytes, &out->bytes_by_dtype[dt]) != MN_OK)
            return mn__st_fail(out, lg, MN_ERR_OVERFLOW, "parameter count overflows 64 bits");
    }
    return MN_OK;
}

// The tensors tile the data section: no gap, no overlap, nothing after the last.
MN__PRIVATE mn_result mn__st_check_tiling(mn_safetensors_info *out, const mn_logger *lg,
                                          const mn_json_value *root, mn__st_range *ranges,
                                          uint64_t ntensors, uint64_t data_bytes) {
    uint64_t prev_end = 0, k;
    mn__st_sort(ranges, ntensors);
    for (k = 0; k < ntensors; k++) {
        const char *name = root->items[2 * ranges[k].member].str;
        if (ranges[k].begin != prev_end)
            return mn__st_fail(out, lg, MN_ERR_PARSE,
                               ranges[k].begin < prev_end
                                   ? "tensor \"%.60s\" at offset %llu overlaps the previous one"
                                   : "tensor \"%.60s\" at offset %llu leaves a gap before it",
                               name, (unsigned long long)ranges[k].begin);
        prev_end = ranges[k].end;
    }
    if (prev_end != data_bytes)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensors cover %llu of the %llu bytes of the "
                           "data section", (unsigned long long)prev_end,
                           (unsigned long long)data_bytes);
    return MN_OK;
}

// keep_tensors: the validated tensors copied out of the JSON tree in offset order, into one
// block laid out as tensors | shapes | names.
MN__PRIVATE mn_result mn__st_keep(mn_safetensors_info *out, const mn_safetensors_desc *d,
                                  const mn_json_value *root, const mn__st_range *ranges,
                                  uint64_t ntensors) {
    uint64_t dims = 0, names = 0, total, k;
    unsigned char *block;
    mn_safetensors_tensor *t;
    uint64_t *shape;
    char *name;
    for (k = 0; k < ntensors; k++) {
        const mn_json_value *v = &root->items[2 * ranges[k].member + 1];
        dims += mn_json_get(v, "shape")->len;
        names += root->items[2 * ranges[k].member].len + 1;
    }
    total = ntensors * sizeof(mn_safetensors_tensor) + dims * sizeof(uint64_t) + names;
    block = (unsigned char *)mn__alloc(&d->allocator, (size_t)total);  // < 50 * n_header
    if (!block) return mn__st_fail(out, &d->logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
    t = (mn_safetensors_tensor *)(void *)block;
    shape = (uint64_t *)(void *)(block + ntensors * sizeof(mn_safetensors_tensor));
    name = (char *)(shape + dims);
    for (k = 0; k < ntensors; k++) {
        const mn_json_value *key = &root->items[2 * ranges[k].member];
        const mn_json_value *v = key + 1, *sh = mn_json_get(v, "shape");
        const mn_json_value *dt = mn_json_get(v, "dtype");
        uint32_t j;
        int s;
        memcpy(name, key->str, (size_t)key->len + 1);
        t[k].name = name;
        name += key->len + 1;
        t[k].rank = sh->len;
        t[k].shape = shape;
        t[k].elements = 1;
        for (j = 0; j < sh->len; j++) {
            mn_json_u64(&sh->items[j], &shape[j]);
            t[k].elements *= shape[j];  // checked in mn__st_tensor
        }
        shape += sh->len;
        t[k].dtype = MN_ST_UNKNOWN;
        for (s = 1; s < MN_ST_DTYPE_COUNT; s++)
            if (strcmp(dt->str, mn__st_dtypes[s].name) == 0) t[k].dtype = (mn_st_dtype)s;
        t[k].begin = ranges[k].begin, t[k].end = ranges[k].end;
    }
    out->mem_ = block;
    out->tensor = t;
    return MN_OK;
}

MNIMPL mn_result mn_safetensors_parse(const uint8_t *data, size_t len, uint64_t file_size,
                                      const mn_safetensors_desc *desc, mn_safetensors_info *out) {
    mn_safetensors_desc d;
    mn_json_desc jd;
    mn_json_doc doc;
    mn__st_range *ranges = NULL;
    uint64_t n_header = 0, data_bytes, ntensors = 0, best = 0;
    uint32_t m;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.max_header == 0) d.max_header = MN__ST_MAX_HEADER;
    out->alloc_ = d.allocator;
    if (!data && len) return MN_ERR_INVALID_ARG;
    if (file_size == 0) file_size = len;
    if ((r = mn__st_header_length(data, len, file_size, &d, out, &n_header)) != MN_OK) return r;
    data_bytes = file_size - 8 - n_header;
    memset(&jd, 0, sizeof jd);
    jd.allocator = d.allocator;
    jd.max_bytes = n_header;
    r = mn_json_parse((const char *)data + 8, (size_t)n_header, &jd, &doc);
    if (r != MN_OK) {
        mn__st_fail(out, &d.logger, r, "header JSON: %s", doc.error);
        goto done;
    }
    if (doc.root->type != MN_JSON_OBJECT) {
        r = mn__st_fail(out, &d.logger, MN_ERR_PARSE, "header is not a JSON object");
        goto done;
    }
    ranges = (mn__st_range *)mn__alloc_array(&d.allocator, doc.root->len, sizeof *ranges);
    if (!ranges) {
        r = mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
        goto done;
    }
    r = mn__st_members(out, &d.logger, doc.root, data_bytes, ranges, &ntensors);
    if (r == MN_OK)
        r = mn__st_check_tiling(out, &d.logger, doc.root, ranges, ntensors, data_bytes);
    if (r == MN_OK && d.keep_tensors && ntensors > 0)
        r = mn__st_keep(out, &d, doc.root, ranges, ntensors);
    if (r != MN_OK) goto done;
    out->files = 1;
    out->header_bytes = n_header;
    out->data_bytes = data_bytes;
    out->tensors = ntensors;
    for (m = 1; m < MN_ST_DTYPE_COUNT; m++) {
        if (out->params_by_dtype[m] > best)
            best = out->params_by_dtype[m], out->st_dtype = (mn_st_dtype)m;
    }
    out->dtype = mn_st_dtype_to_dtype(out->st_dtype);
done:
    mn__free(&d.allocator, ranges);
    mn_json_free(&doc);
    return r;
}

MNIMPL void mn_safetensors_free(mn_safetensors_info *info) {
    if (!info) return;
    mn__free(&info->alloc_, info->mem_);
    info->mem_ = NULL;
    info->tensor = NULL;
}

MNIMPL mn_result mn_safetensors_read_file(const char *path, const mn_safetensors_desc *desc,
                                          mn_safetensors_info *out) {
    mn_safetensors_desc d;
    FILE *f;
    uint64_t size;
    unsigned char pre[8];
    uint8_t *buf;
    uint64_t n = 0, max;
    size_t want;
    int k;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    out->alloc_ = d.allocator;
    if (!path) return MN_ERR_INVALID_ARG;
    max = d.max_header ? d.max_header : MN__ST_MAX_HEADER;
    f = fopen(path, "rb");
    if (!f)
        return mn__st_fail(out, &d.logger, errno == ENOENT ? MN_ERR_NOT_FOUND : MN_ERR_IO,
                           "%.100s: cannot open", path);
    if (!mn__file_size(f, &size) || fread(pre, 1, 8, f) != 8) {
        fclose(f);
        return mn__st_fail(out, &d.logger, MN_ERR_IO, "%.100s: cannot read the header length",
                           path);
    }
    for (k = 0; k < 8; k++) n |= (uint64_t)pre[k] << (8 * k);
    if (n > max || n > size - 8 || n > (uint64_t)SIZE_MAX - 8) {
        fclose(f);
        return mn_safetensors_parse(pre, 8, size, &d, out);  // reports the bad length
    }
    want = (size_t)(8 + n);
    buf = (uint8_t *)mn__alloc(&d.allocator, want);
    if (!buf) {
        fclose(f);
        return mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
    }
    memcpy(buf, pre, 8);
    if (fread(buf + 8, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        mn__free(&d.allocator, buf);
        return mn__st_fail(out, &d.logger, MN_ERR_IO, "%.100s: cannot read the header", path);
    }
    fclose(f);
    r = mn_safetensors_parse(buf, want, size, &d, out);
    mn__free(&d.allocator, buf);
    return r;
}

// Heap sort of strings (no recursion, O(n log n) even on hostile input).
MN__PRIVATE void mn__sort_strs(const char **a, size_t n) {
    size_t k, end, root, child;
    const char *t;
    if (n < 2) return;
    for (k = n / 2; k-- > 0;) {
        for (root = k; (child = 2 * root + 1) < n; root = child) {
            if (child + 1 < n && strcmp(a[child], a[child + 1]) < 0) child++;
            if (strcmp(a[root], a[child]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
    for (end = n - 1; end > 0; end--) {
        t = a[0], a[0] = a[end], a[end] = t;
        for (root = 0; (child = 2 * root + 1) < end; root = child) {
            if (child + 1 < end && strcmp(a[child], a[child + 1]) < 0) child++;
            if (strcmp(a[root], a[child]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
}

// "dir/name" in a fresh buffer.
MN__PRIVATE char *mn__path_join(const mn_allocator *a, const char *dir, const char *name) {
    size_t nd = strlen(dir), nn = strlen(name);
    char *p = (char *)mn__alloc(a, nd + nn + 2);
    if (!p) return NULL;
    memcpy(p, dir, nd);
    p[nd] = '/';
    memcpy(p + nd + 1, name, nn + 1);
    return p;
}

MN__PRIVATE mn_result mn__st_add_shard(const char *dir, const char *name,
                                       const mn_safetensors_desc *d, mn_safetensors_info *out) {
    mn_safetensors_info one;
    mn_safetensors_desc d1 = *d;
    char *path = mn__path_join(&d->allocator, dir, name);
    mn_result r;
    int t;
    if (!path) return mn__st_fail(out, &d->logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
    d1.keep_tensors = 0;
    d1.logger.log_fn = NULL;
    r = mn_safetensors_read_file(path, &d1, &one);
    mn__free(&d->allocator, path);
    if (r != MN_OK) {
        // a missing file is the caller's to judge (no weights at all, or a missing shard)
        if (r == MN_ERR_NOT_FOUND) snprintf(out->error, sizeof out->error, "%.60s: missing", name);
        else r = mn__st_fail(out, &d->logger, r, "%.60s: %s", name, one.error);
        mn_safetensors_free(&one);
        return r;
    }
    out->files++;
    if (mn_add_u64(out->header_bytes, one.header_bytes, &out->header_bytes) != MN_OK ||
        mn_add_u64(out->data_bytes, one.data_bytes, &out->data_bytes) != MN_OK ||
        mn_add_u64(out->tensors, one.tensors, &out->tensors) != MN_OK ||
        mn_add_u64(out->params, one.params, &out->params) != MN_OK ||
        mn_add_u64(out->buffers, one.buffers, &out->buffers) != MN_OK)
        return mn__st_fail(out, &d->logger, MN_ERR_OVERFLOW, "totals overflow 64 bits");
    for (t = 0; t < MN_ST_DTYPE_COUNT; t++) {
        if (mn_add_u64(out->params_by_dtype[t], one.params_by_dtype[t], &out->params_by_dtype[t]) ||
            mn_add_u64(out->bytes_by_dtype[t], one.bytes_by_dtype[t], &out->bytes_by_dtype[t]))
            return mn__st_fail(out, &d->logger, MN_ERR_OVERFLOW, "totals overflow 64 bits");
    }
    out->metadata_count += one.metadata_count;
    mn_safetensors_free(&one);
    return MN_OK;
}

MNIMPL mn_result mn_safetensors_read_dir(const char *dir, const mn_safetensors_desc *desc,
                                         mn_safetensors_info *out) {
    mn_safetensors_desc d;
    mn_json_desc jd;
    mn_json_doc doc;
    const mn_json_value *map;
    const char **shards = NULL;
    char *path, *text = NULL;
    size_t len;
    uint32_t k, j, nshards = 0;
    uint64_t best = 0;
    int t;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(&doc, 0, sizeof doc);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    out->alloc_ = d.allocator;
    if (!dir) return MN_ERR_INVALID_ARG;
    path = mn__path_join(&d.allocator, dir, "model.safetensors.index.json");
    if (!path) return mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
    r = mn__read_file(&d.allocator, path, 256ull << 20, &text, &len);
    mn__free(&d.allocator, path);
    if (r == MN_ERR_NOT_FOUND) {
        r = mn__st_add_shard(dir, "model.safetensors", &d, out);
        if (r == MN_ERR_NOT_FOUND)  // not an error in itself: logged by callers that need weights
            snprintf(out->error, sizeof out->error, "%.100s: no model.safetensors[.index.json]",
                     dir);
        goto totals;
    }
    if (r != MN_OK) {
        return mn__st_fail(out, &d.logger, r, "%.100s: cannot read model.safetensors.index.json",
                           dir);
    }
    memset(&jd, 0, sizeof jd);
    jd.allocator = d.allocator;
    r = mn_json_parse(text, len, &jd, &doc);
    if (r != MN_OK) {
        mn__st_fail(out, &d.logger, r, "model.safetensors.index.json: %s", doc.error);
        goto done;
    }
    map = mn_json_get(doc.root, "weight_map");
    if (!map || map->type != MN_JSON_OBJECT) {
        r = mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                        "model.safetensors.index.json has no \"weight_map\" object");
        goto done;
    }
    shards = (const char **)mn__alloc_array(&d.allocator, map->len, sizeof *shards);
    if (!shards) {
        r = mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
        goto done;
    }
    for (k = 0; k < map->len; k++) {
        const mn_json_value *v = &map->items[2 * k + 1];
        if (v->type != MN_JSON_STRING || v->len == 0 || strlen(v->str) != v->len ||
            strchr(v->str, '/') || strchr(v->str, '\\') || v->str[0] == '.') {
            r = mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                            "weight_map: \"%.60s\" does not name a file in the folder",
                            map->items[2 * k].str);
            goto done;
        }
        shards[k] = v->str;
    }
    // the distinct shard names, in order
    mn__sort_strs(shards, map->len);
    for (k = 0; k < map->len; k++) {
        if (nshards == 0 || strcmp(shards[nshards - 1], shards[k]) != 0)
            shards[nshards++] = shards[k];
    }
    for (j = 0; j < nshards; j++) {
        r = mn__st_add_shard(dir, shards[j], &d, out);
        if (r == MN_ERR_NOT_FOUND)  // named by the index: missing is an error, not "no weights"
            r = mn__st_fail(out, &d.logger, MN_ERR_IO, "%.60s: listed in the index, missing",
                            shards[j]);
        if (r != MN_OK) goto done;
    }
    if (out->tensors != map->len)
        mn__log(&d.logger, MN_LOG_WARN,
                "safetensors: weight_map lists %u tensors, shards hold %llu", (unsigned)map->len,
                (unsigned long long)out->tensors);
totals:
    if (r == MN_OK) {
        for (t = 1; t < MN_ST_DTYPE_COUNT; t++) {
            if (out->params_by_dtype[t] > best)
                best = out->params_by_dtype[t], out->st_dtype = (mn_st_dtype)t;
        }
        out->dtype = mn_st_dtype_to_dtype(out->st_dtype);
    }
done:
    mn__free(&d.allocator, (void *)shards);
    mn_json_free(&doc);
    mn__free(&d.allocator, text);
    return r;
}
// >>estimate implementation -----------------------------------------------------------------------
//
// The estimator runs a training step symbolically, as autograd runs it:
//   - every op allocates its output; a tensor lives while a Python-level reference or a saved-for-
//     backward reference holds it (reference counts), so forward frees exactly what eager
//     PyTorch frees;
//   - backward walks the tape in reverse: each op allocates the gradients of its inputs, the
//     gradients of its parameters (kept, or added and freed when they already exist), its own
//     transient buffers, then frees its gradient of the output and drops what it saved;
//   - checkpointed blocks keep only their input and are re-run (recorded) when backward reaches
//     them;
//   - the optimizer allocates its state lazily at the first step, through the same
//     mn_optim_state_bytes() the optimizers use.
// Two steps are simulated (the first creates the optimizer state, the second is the steady state).
// The allocation sequence gives peak allocated; replayed through the caching allocator on a
// simulated device it gives peak reserved. Sources for the per-op rules are cited where they are
// used (PyTorch derivatives.yaml for what each op saves, autocast's op lists for dtypes).

// ---- >>estimate/tables: names -------------------------------------------------------------------

typedef struct mn__name { const char *name; int value; } mn__name;

static const mn__name mn__precision_names[] = {
    {"fp32", MN_PREC_FP32}, {"fp16", MN_PREC_FP16}, {"bf16", MN_PREC_BF16},
    {"fp16-pure", MN_PREC_FP16_PURE}, {"bf16-pure", MN_PREC_BF16_PURE}, {NULL, 0}};
static const mn__name mn__optim_names[] = {
    {"adamw", MN_OPTIM_ADAMW}, {"adamw-8bit", MN_OPTIM_ADAMW_8BIT}, {"sgd", MN_OPTIM_SGD},
    {"sgd-momentum", MN_OPTIM_SGD_MOMENTUM}, {"adafactor", MN_OPTIM_ADAFACTOR},
    {"lion", MN_OPTIM_LION}, {"none", MN_OPTIM_NONE}, {NULL, 0}};
static const mn__name mn__ckpt_names[] = {
    {"none", MN_CKPT_NONE}, {"full", MN_CKPT_FULL}, {"selective", MN_CKPT_SELECTIVE}, {NULL, 0}};
static const mn__name mn__attn_names[] = {
    {"eager", MN_ATTN_EAGER}, {"sdpa", MN_ATTN_SDPA}, {"flash", MN_ATTN_FLASH}, {NULL, 0}};
static const mn__name mn__framework_names[] = {
    {"hf", MN_FW_HF}, {"deepspeed", MN_FW_DEEPSPEED}, {"megatron", MN_FW_MEGATRON},
    {"memanat", MN_FW_MEMANAT}, {NULL, 0}};
static const mn__name mn__offload_names[] = {
    {"none", MN_OFFLOAD_NONE}, {"optimizer", MN_OFFLOAD_OPTIMIZER}, {"all", MN_OFFLOAD_ALL},
    {NULL, 0}};
static const mn__name mn__quant_names[] = {
    {"none", MN_QUANT_NONE}, {"int8", MN_QUANT_INT8}, {"nf4", MN_QUANT_NF4},
    {"nf4-dq", MN_QUANT_NF4_DQ}, {"fp4", MN_QUANT_FP4}, {"fp4-dq", MN_QUANT_FP4_DQ}, {NULL, 0}};
static const mn__name mn__optim_impl_names[] = {
    {"foreach", MN_OPTIM_IMPL_FOREACH}, {"fused", MN_OPTIM_IMPL_FUSED},
    {"loop", MN_OPTIM_IMPL_LOOP}, {NULL, 0}};
static const mn__name mn__loop_names[] = {
    {"plain", MN_LOOP_PLAIN}, {"trainer", MN_LOOP_TRAINER}, {NULL, 0}};
static const mn__name mn__head_names[] = {
    {"lm", MN_HEAD_LM}, {"classification", MN_HEAD_CLASSIFICATION}, {"none", MN_HEAD_NONE},
    {NULL, 0}};
static const mn__name mn__arch_names[] = {
    {"decoder", MN_ARCH_DECODER}, {"encoder", MN_ARCH_ENCODER},
    {"encoder-decoder", MN_ARCH_ENCODER_DECODER}, {"stack", MN_ARCH_STACK}, {NULL, 0}};

MN__PRIVATE const char *mn__name_of(const mn__name *t, int v, int dflt) {
    int i;
    if (v == 0) v = dflt;
    for (i = 0; t[i].name; i++)
        if (t[i].value == v) return t[i].name;
    return "unknown";
}

MN__PRIVATE mn_result mn__parse_name(const mn__name *t, const char *s, int *out) {
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
        mn_result r = out ? mn__parse_name(table, s, &v) : MN_ERR_INVALID_ARG;                  \
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
MN__NAMES(optim_impl, mn_optim_impl, mn__optim_impl_names, MN_OPTIM_IMPL_FOREACH)
MN__NAMES(loop, mn_loop, mn__loop_names, MN_LOOP_PLAIN)
#undef MN__NAMES

MNIMPL const char *mn_arch_name(mn_arch a) {
    return mn__name_of(mn__arch_names, (int)a, MN_ARCH_DECODER);
}

MNIMPL const char *mn_framework_describe(mn_framework f) {
    switch (f) {
    case MN_FW_DEFAULT:
    case MN_FW_HF:
        return "hf: HF Trainer + torch autocast. Parameters stay fp32 (they are the master "
               "weights); autocast caches 16-bit weight copies for the step; gradients fp32; "
               "optimizer state in the parameter dtype; gradients kept between steps (zero_grad in "
               "place); eager attention for encoders, sdpa otherwise; loss on fp32-upcast logits";
    case MN_FW_DEEPSPEED:
        return "deepspeed: 16-bit parameters and gradients; the fp32 master copy lives in the "
               "optimizer (ZeRO's K = 12: master + m + v), ZeRO-2 keeps fp16 and fp32 gradient "
               "partitions (2 + 18/N bytes per parameter), ZeRO-3 shards parameters too";
    case MN_FW_MEGATRON:
        return "megatron: 16-bit parameters, fp32 main gradients, fp32 master + Adam in the "
               "optimizer (18 bytes per parameter; 6 + 12/N with the distributed optimizer, "
               "--zero 1); flash attention, fused kernels";
    case MN_FW_MEMANAT:
        return "memanat: this project's CPU trainer (trainer.c), its GPT only (mn_gpt_model): its "
               "exact allocation sequence through one caching allocator in host memory (no "
               "context, no cuBLAS workspace). fp32, or fp16/bf16 weights and activations (2 B) "
               "with fp32 master weights; fp32 gradients kept between steps; optimizer state made "
               "at the first step, one block per stacked parameter tensor; attention "
               "probabilities kept (selective: none, recomputed); fp32 views of 16-bit tensors "
               "and the gradients of the backward as short-lived temporaries. With --gpu naming a "
               "GPU: trainer --device cuda (no fp32 views, 16-bit gradients with 16-bit storage, "
               "logits kept and overwritten by dlogits, the cuBLASLt workspace and attention's "
               "scratch from the cache)";
    case MN_FW_COUNT: break;
    }
    return "unknown framework";
}

MNIMPL mn_result mn_lora_targets_parse(const char *s, uint32_t *out) {
    static const mn__name t[] = {
        {"q", MN_LORA_Q}, {"k", MN_LORA_K}, {"v", MN_LORA_V}, {"o", MN_LORA_O},
        {"gate", MN_LORA_GATE}, {"up", MN_LORA_UP}, {"down", MN_LORA_DOWN}, {"all", MN_LORA_ALL},
        {NULL, 0}};
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
        if (*s == ',' && !*++s) return MN_ERR_NOT_FOUND;  // "q," names nothing after its comma
    }
    *out = bits;
    return MN_OK;
}

// "q,v" for the target bits (a message's text).
MN__PRIVATE void mn__lora_targets_str(uint32_t bits, char *buf, size_t cap) {
    static const char *const names[] = {"q", "k", "v", "o", "gate", "up", "down"};
    static const uint32_t flags[] = {MN_LORA_Q, MN_LORA_K, MN_LORA_V, MN_LORA_O, MN_LORA_GATE,
                                     MN_LORA_UP, MN_LORA_DOWN};
    size_t i, n = 0;
    buf[0] = 0;
    for (i = 0; i < sizeof flags / sizeof flags[0] && n < cap; i++)
        if (bits & flags[i]) {
            int w = snprintf(buf + n, cap - n, "%s%s", n ? "," : "", names[i]);
            if (w < 0) break;
            n += (size_t)w;
        }
}

// ---- >>estimate/tables: presets (shapes from the published config.json files) -------------------

#define MN__KB(x) ((uint64_t)(x) << 10)
#define MN__MIB(x) ((uint64_t)(x) << 20)

// The presets are written with designated initializers, so each row says what each number is:
// the non-zero fields only, in the order mn_model declares them. That form is C99, and C++20 with
// the same rule (declaration order, no field named twice); g++ and clang++ take it in C++11..17
// as an extension and warn. The pragmas around the table silence those warnings when the header
// is compiled as C++: g++ 12 reports the extension as -Wc++20-extensions (g++ 8..10 as -Wpedantic,
// and they do not know the newer option: -Wpragmas) and the omitted fields, in C++20 too, as
// -Wmissing-field-initializers; clang 14 reports the extension alone. A family macro is a run of
// consecutive fields, so a row that uses it keeps the declaration order.

// BERT (bert-*-uncased): vocab .. dtype.
#define MN__BERT_TAIL                                                                              \
    .vocab = 30522, .max_positions = 512, .type_vocab = 2, .norm = MN_NORM_LAYERNORM,              \
    .act = MN_ACT_GELU, .posemb = MN_POS_LEARNED, .head = MN_HEAD_LM, .tie_embeddings = 1,         \
    .qkv_bias = 1, .out_bias = 1, .mlp_bias = 1, .embed_norm = 1, .lm_transform = 1,               \
    .post_norm = 1, .dropout = 0.1f, .attn_dropout = 0.1f, .dtype = MN_FP32
// GPT-2: vocab .. dtype.
#define MN__GPT2_TAIL                                                                              \
    .vocab = 50257, .max_positions = 1024, .norm = MN_NORM_LAYERNORM, .act = MN_ACT_GELU_NEW,      \
    .posemb = MN_POS_LEARNED, .head = MN_HEAD_LM, .tie_embeddings = 1, .qkv_bias = 1,              \
    .out_bias = 1, .mlp_bias = 1, .final_norm = 1, .dropout = 0.1f, .attn_dropout = 0.1f,          \
    .dtype = MN_FP32
// T5 v1.0 (t5-*): ReLU MLP, tied LM head; vocab .. dtype.
#define MN__T5_TAIL                                                                                \
    .vocab = 32128, .rel_buckets = 32, .norm = MN_NORM_RMSNORM, .act = MN_ACT_RELU,                \
    .posemb = MN_POS_RELATIVE, .head = MN_HEAD_LM, .tie_embeddings = 1, .final_norm = 1,           \
    .dropout = 0.1f, .attn_dropout = 0.1f, .dtype = MN_FP32
// T5 v1.1 (flan-t5-*): gated-GELU MLP, untied LM head, bf16 checkpoints; vocab .. dtype.
#define MN__FLAN_T5_TAIL                                                                           \
    .vocab = 32128, .rel_buckets = 32, .norm = MN_NORM_RMSNORM, .act = MN_ACT_GELU_NEW,            \
    .posemb = MN_POS_RELATIVE, .head = MN_HEAD_LM, .gated_mlp = 1, .final_norm = 1,                \
    .dropout = 0.1f, .attn_dropout = 0.1f, .dtype = MN_BF16
// Llama-style blocks (Llama, Mistral, Qwen2): RMSNorm, SwiGLU MLP, rotary positions; norm ..
// gated_mlp. The rows go on with tie_embeddings, qkv_bias, final_norm and dtype.
#define MN__LLAMA_STYLE                                                                            \
    .norm = MN_NORM_RMSNORM, .act = MN_ACT_SILU, .posemb = MN_POS_ROPE, .head = MN_HEAD_LM,        \
    .gated_mlp = 1
// BigCode (StarCoder): multi-query attention (kv_heads = 1 in the rows); vocab .. dtype.
#define MN__BIGCODE_TAIL                                                                           \
    .vocab = 49152, .max_positions = 8192, .norm = MN_NORM_LAYERNORM, .act = MN_ACT_GELU_TANH,     \
    .posemb = MN_POS_LEARNED, .head = MN_HEAD_LM, .tie_embeddings = 1, .qkv_bias = 1,              \
    .out_bias = 1, .mlp_bias = 1, .final_norm = 1, .dropout = 0.1f, .attn_dropout = 0.1f,          \
    .dtype = MN_FP32

#if defined(__cplusplus) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wpedantic"
#pragma GCC diagnostic ignored "-Wc++20-extensions"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif
static const mn_model mn__presets[] = {
    {.name = "bert-base-uncased", .arch = MN_ARCH_ENCODER, .layers = 12, .hidden = 768,
     .heads = 12, .ffn = 3072, MN__BERT_TAIL},
    {.name = "bert-large-uncased", .arch = MN_ARCH_ENCODER, .layers = 24, .hidden = 1024,
     .heads = 16, .ffn = 4096, MN__BERT_TAIL},
    {.name = "gpt2", .arch = MN_ARCH_DECODER, .layers = 12, .hidden = 768, .heads = 12,
     MN__GPT2_TAIL},
    {.name = "gpt2-medium", .arch = MN_ARCH_DECODER, .layers = 24, .hidden = 1024, .heads = 16,
     MN__GPT2_TAIL},
    {.name = "gpt2-large", .arch = MN_ARCH_DECODER, .layers = 36, .hidden = 1280, .heads = 20,
     MN__GPT2_TAIL},
    {.name = "gpt2-xl", .arch = MN_ARCH_DECODER, .layers = 48, .hidden = 1600, .heads = 25,
     MN__GPT2_TAIL},
    {.name = "t5-small", .arch = MN_ARCH_ENCODER_DECODER, .layers = 6, .encoder_layers = 6,
     .hidden = 512, .heads = 8, .head_dim = 64, .ffn = 2048, MN__T5_TAIL},
    {.name = "t5-base", .arch = MN_ARCH_ENCODER_DECODER, .layers = 12, .encoder_layers = 12,
     .hidden = 768, .heads = 12, .head_dim = 64, .ffn = 3072, MN__T5_TAIL},
    {.name = "t5-large", .arch = MN_ARCH_ENCODER_DECODER, .layers = 24, .encoder_layers = 24,
     .hidden = 1024, .heads = 16, .head_dim = 64, .ffn = 4096, MN__T5_TAIL},
    {.name = "t5-3b", .arch = MN_ARCH_ENCODER_DECODER, .layers = 24, .encoder_layers = 24,
     .hidden = 1024, .heads = 32, .head_dim = 128, .ffn = 16384, MN__T5_TAIL},
    {.name = "t5-11b", .arch = MN_ARCH_ENCODER_DECODER, .layers = 24, .encoder_layers = 24,
     .hidden = 1024, .heads = 128, .head_dim = 128, .ffn = 65536, MN__T5_TAIL},
    {.name = "flan-t5-base", .arch = MN_ARCH_ENCODER_DECODER, .layers = 12, .encoder_layers = 12,
     .hidden = 768, .heads = 12, .head_dim = 64, .ffn = 2048, MN__FLAN_T5_TAIL},
    {.name = "flan-t5-large", .arch = MN_ARCH_ENCODER_DECODER, .layers = 24, .encoder_layers = 24,
     .hidden = 1024, .heads = 16, .head_dim = 64, .ffn = 2816, MN__FLAN_T5_TAIL},
    {.name = "flan-t5-xl", .arch = MN_ARCH_ENCODER_DECODER, .layers = 24, .encoder_layers = 24,
     .hidden = 2048, .heads = 32, .head_dim = 64, .ffn = 5120, MN__FLAN_T5_TAIL},
    {.name = "llama-2-7b", .arch = MN_ARCH_DECODER, .layers = 32, .hidden = 4096, .heads = 32,
     .kv_heads = 32, .ffn = 11008, .vocab = 32000, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_FP16},
    {.name = "llama-2-13b", .arch = MN_ARCH_DECODER, .layers = 40, .hidden = 5120, .heads = 40,
     .kv_heads = 40, .ffn = 13824, .vocab = 32000, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_FP16},
    {.name = "llama-2-70b", .arch = MN_ARCH_DECODER, .layers = 80, .hidden = 8192, .heads = 64,
     .kv_heads = 8, .ffn = 28672, .vocab = 32000, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_FP16},
    {.name = "llama-3-8b", .arch = MN_ARCH_DECODER, .layers = 32, .hidden = 4096, .heads = 32,
     .kv_heads = 8, .ffn = 14336, .vocab = 128256, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_BF16},
    {.name = "llama-3-70b", .arch = MN_ARCH_DECODER, .layers = 80, .hidden = 8192, .heads = 64,
     .kv_heads = 8, .ffn = 28672, .vocab = 128256, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_BF16},
    {.name = "llama-3.1-8b", .arch = MN_ARCH_DECODER, .layers = 32, .hidden = 4096, .heads = 32,
     .kv_heads = 8, .ffn = 14336, .vocab = 128256, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_BF16},
    {.name = "llama-3.1-70b", .arch = MN_ARCH_DECODER, .layers = 80, .hidden = 8192, .heads = 64,
     .kv_heads = 8, .ffn = 28672, .vocab = 128256, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_BF16},
    {.name = "llama-3.2-1b", .arch = MN_ARCH_DECODER, .layers = 16, .hidden = 2048, .heads = 32,
     .kv_heads = 8, .head_dim = 64, .ffn = 8192, .vocab = 128256, MN__LLAMA_STYLE,
     .tie_embeddings = 1, .final_norm = 1, .dtype = MN_BF16},
    {.name = "llama-3.2-3b", .arch = MN_ARCH_DECODER, .layers = 28, .hidden = 3072, .heads = 24,
     .kv_heads = 8, .head_dim = 128, .ffn = 8192, .vocab = 128256, MN__LLAMA_STYLE,
     .tie_embeddings = 1, .final_norm = 1, .dtype = MN_BF16},
    {.name = "mistral-7b", .arch = MN_ARCH_DECODER, .layers = 32, .hidden = 4096, .heads = 32,
     .kv_heads = 8, .ffn = 14336, .vocab = 32000, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_BF16},
    {.name = "mistral-7b-v0.3", .arch = MN_ARCH_DECODER, .layers = 32, .hidden = 4096,
     .heads = 32, .kv_heads = 8, .ffn = 14336, .vocab = 32768, MN__LLAMA_STYLE, .final_norm = 1,
     .dtype = MN_BF16},
    {.name = "qwen2-0.5b", .arch = MN_ARCH_DECODER, .layers = 24, .hidden = 896, .heads = 14,
     .kv_heads = 2, .ffn = 4864, .vocab = 151936, MN__LLAMA_STYLE, .tie_embeddings = 1,
     .qkv_bias = 1, .final_norm = 1, .dtype = MN_BF16},
    {.name = "qwen2-1.5b", .arch = MN_ARCH_DECODER, .layers = 28, .hidden = 1536, .heads = 12,
     .kv_heads = 2, .ffn = 8960, .vocab = 151936, MN__LLAMA_STYLE, .tie_embeddings = 1,
     .qkv_bias = 1, .final_norm = 1, .dtype = MN_BF16},
    {.name = "qwen2-7b", .arch = MN_ARCH_DECODER, .layers = 28, .hidden = 3584, .heads = 28,
     .kv_heads = 4, .ffn = 18944, .vocab = 152064, MN__LLAMA_STYLE, .qkv_bias = 1,
     .final_norm = 1, .dtype = MN_BF16},
    {.name = "qwen2.5-0.5b", .arch = MN_ARCH_DECODER, .layers = 24, .hidden = 896, .heads = 14,
     .kv_heads = 2, .ffn = 4864, .vocab = 151936, MN__LLAMA_STYLE, .tie_embeddings = 1,
     .qkv_bias = 1, .final_norm = 1, .dtype = MN_BF16},
    {.name = "qwen2.5-7b", .arch = MN_ARCH_DECODER, .layers = 28, .hidden = 3584, .heads = 28,
     .kv_heads = 4, .ffn = 18944, .vocab = 152064, MN__LLAMA_STYLE, .qkv_bias = 1,
     .final_norm = 1, .dtype = MN_BF16},
    {.name = "qwen2.5-14b", .arch = MN_ARCH_DECODER, .layers = 48, .hidden = 5120, .heads = 40,
     .kv_heads = 8, .ffn = 13824, .vocab = 152064, MN__LLAMA_STYLE, .qkv_bias = 1,
     .final_norm = 1, .dtype = MN_BF16},
    {.name = "starcoderbase-1b", .arch = MN_ARCH_DECODER, .layers = 24, .hidden = 2048,
     .heads = 16, .kv_heads = 1, .ffn = 8192, MN__BIGCODE_TAIL},
    {.name = "starcoderbase-7b", .arch = MN_ARCH_DECODER, .layers = 42, .hidden = 4096,
     .heads = 32, .kv_heads = 1, .ffn = 16384, MN__BIGCODE_TAIL},
    {.name = "starcoder", .arch = MN_ARCH_DECODER, .layers = 40, .hidden = 6144, .heads = 48,
     .kv_heads = 1, .ffn = 24576, MN__BIGCODE_TAIL},
};
#if defined(__cplusplus) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC diagnostic pop
#endif
#undef MN__BERT_TAIL
#undef MN__GPT2_TAIL
#undef MN__T5_TAIL
#undef MN__FLAN_T5_TAIL
#undef MN__LLAMA_STYLE
#undef MN__BIGCODE_TAIL

MNIMPL uint32_t mn_preset_count(void) {
    return (uint32_t)(sizeof mn__presets / sizeof mn__presets[0]);
}

MNIMPL const mn_model *mn_preset_get(uint32_t i) {
    return i < mn_preset_count() ? &mn__presets[i] : NULL;
}

// Capacity as nvidia-smi reports the total; context = CUDA context + kernels of a torch 2.x
// process with lazy module loading (ml-engineering measured 0.47 GiB on an A100; older torch
// with eager loading takes 0.9-1.8 GiB, e.g. the HF V100 runs' 1343 MiB: pass --context).
// sm = compute capability x 10 (NVIDIA's CUDA GPUs page); bf16 needs sm >= 80. cublas_workspace
// is the cuBLAS documentation's recommendation for cublasSetWorkspace, as quoted in PyTorch PR
// #120925: 32 MiB on Hopper (sm 90), 4 MiB on earlier GPUs. bf16_tflops is the dense bf16 peak of
// llm.c's llmc/mfu.h (A100 312; H100 SXM 989, derived there from the PCIe card's 756 by tensor
// cores x clock; H200 has the H100 SXM's SMs and clocks), 0 where that table has none.
// Columns: name, label, capacity, context, sm, bf16, cublas_workspace, bf16_tflops.
static const mn_gpu mn__gpus[] = {
    {"v100-16gb", "Tesla V100 16GB",       MN__MIB(16160),  MN__MIB(600), 70, 0, MN__MIB(4), 0.0},
    {"v100-32gb", "Tesla V100 32GB",       MN__MIB(32510),  MN__MIB(600), 70, 0, MN__MIB(4), 0.0},
    {"t4",        "Tesla T4 16GB",         MN__MIB(15360),  MN__MIB(500), 75, 0, MN__MIB(4), 0.0},
    {"a10g",      "NVIDIA A10G 24GB",      MN__MIB(23028),  MN__MIB(500), 86, 1, MN__MIB(4), 0.0},
    {"a10",       "NVIDIA A10 24GB",       MN__MIB(23028),  MN__MIB(500), 86, 1, MN__MIB(4), 0.0},
    {"l4",        "NVIDIA L4 24GB",        MN__MIB(23034),  MN__MIB(500), 89, 1, MN__MIB(4), 0.0},
    {"l40s",      "NVIDIA L40S 48GB",      MN__MIB(46068),  MN__MIB(520), 89, 1, MN__MIB(4), 0.0},
    {"rtx3090",   "GeForce RTX 3090 24GB", MN__MIB(24576),  MN__MIB(520), 86, 1, MN__MIB(4), 0.0},
    {"rtx4090",   "GeForce RTX 4090 24GB", MN__MIB(24564),  MN__MIB(520), 89, 1, MN__MIB(4), 0.0},
    {"a100-40gb", "NVIDIA A100 40GB",      MN__MIB(40960),  MN__MIB(481), 80, 1, MN__MIB(4), 312.0},
    {"a100-80gb", "NVIDIA A100 80GB",      MN__MIB(81920),  MN__MIB(481), 80, 1, MN__MIB(4), 312.0},
    {"h100-80gb", "NVIDIA H100 80GB",      MN__MIB(81559),  MN__MIB(530), 90, 1, MN__MIB(32), 989},
    {"h200",      "NVIDIA H200 141GB",     MN__MIB(143771), MN__MIB(540), 90, 1, MN__MIB(32), 989},
    // host memory for CPU programs (--framework memanat's default): no context, no cuBLAS
    // workspace, and no known size (1 PiB, what mn_hostdev reports when unlimited)
    {"cpu",       "host memory (CPU)",     1ull << 50,      0,            0,  1, 0, 0.0},
};

MNIMPL uint32_t mn_gpu_count(void) { return (uint32_t)(sizeof mn__gpus / sizeof mn__gpus[0]); }

MNIMPL const mn_gpu *mn_gpu_get(uint32_t i) { return i < mn_gpu_count() ? &mn__gpus[i] : NULL; }

// ---- names as people write them ----------------------------------------------------------------
// A name is looked up by its key: its letters and digits in lower case, so that "RTX 4090",
// "rtx-4090" and "RTX4090" are one name, and "Llama-3.1-8B" is "llama-3.1-8b" (no two presets,
// and no two GPUs, share a key: test_names). Failing that, with the words a source adds around a
// name taken off both sides: a hub repository's "Meta-" and "-hf", and "-Instruct" and "-chat"
// (fine-tunes of the same shapes); nvidia-smi's "NVIDIA", "Tesla" and "GeForce", and the form
// factor ("SXM4", "PCIe", "HBM3"), so that "NVIDIA A100-SXM4-40GB" is a100-40gb. A name that
// matches nothing gets the closest key within two edits that starts with the same character, for
// the error message (a B200 is no H200).
#define MN__KEY_MAX 64

// s's key in key[MN__KEY_MAX]; 0 when it is longer (it then matches no table name).
MN__PRIVATE int mn__name_key(const char *s, char *key) {
    size_t n = 0;
    for (; *s; s++) {
        int c = mn__tolower((unsigned char)*s);
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) continue;
        if (n + 1 >= MN__KEY_MAX) return 0;
        key[n++] = (char)c;
    }
    key[n] = 0;
    return 1;
}

// Takes the words of pre off the front of key and those of suf off its end while one is there
// and something is left, then those of mid (longest first) wherever they are. Lists end at NULL.
MN__PRIVATE void mn__key_strip(char *key, const char *const *pre, const char *const *mid,
                               const char *const *suf) {
    size_t n = strlen(key), w;
    const char *const *t;
    char *at;
    int again = 1;
    while (again) {
        again = 0;
        for (t = pre; *t; t++)
            if ((w = strlen(*t)) < n && !memcmp(key, *t, w))
                memmove(key, key + w, n - w + 1), n -= w, again = 1;
        for (t = suf; *t; t++)
            if ((w = strlen(*t)) < n && !memcmp(key + n - w, *t, w)) key[n -= w] = 0, again = 1;
    }
    for (t = mid; *t; t++)
        for (w = strlen(*t); w < n && (at = strstr(key, *t)) != NULL; n -= w)
            memmove(at, at + w, strlen(at + w) + 1);
}

// Edits (insert, delete, replace) from key a to key b, 3 for three or more.
MN__PRIVATE int mn__key_distance(const char *a, const char *b) {
    int row[MN__KEY_MAX], i, j, na = (int)strlen(a), nb = (int)strlen(b);
    if (na - nb >= 3 || nb - na >= 3) return 3;
    for (j = 0; j <= nb; j++) row[j] = j;
    for (i = 1; i <= na; i++) {
        int diag = row[0], least = i;
        row[0] = i;
        for (j = 1; j <= nb; j++) {
            int v = diag + (a[i - 1] != b[j - 1]);
            if (row[j] + 1 < v) v = row[j] + 1;
            if (row[j - 1] + 1 < v) v = row[j - 1] + 1;
            diag = row[j], row[j] = v;
            if (v < least) least = v;
        }
        if (least >= 3) return 3;  // (no entry of a later row is below its row's least)
    }
    return row[nb] < 3 ? row[nb] : 3;
}

static const char *const mn__model_pre[] = {"meta", NULL};
static const char *const mn__model_suf[] = {"hf", "instruct", "chat", NULL};
static const char *const mn__gpu_pre[] = {"nvidia", "tesla", "geforce", NULL};
static const char *const mn__gpu_mid[] = {"hbm3e", "hbm3", "sxm2", "sxm4", "sxm5", "pcie", "sxm",
                                          NULL};
static const char *const mn__no_words[] = {NULL};

// Other spellings of table names: a family's short name (the card it has always meant: a100 the
// 80 GB one, v100 the 16 GB one), and hub repository names that no key reaches.
static const struct { const char *alias, *name; } mn__aliases[] = {
    {"v100", "v100-16gb"}, {"a100", "a100-80gb"}, {"h100", "h100-80gb"}, {"3090", "rtx3090"},
    {"4090", "rtx4090"}, {"h200-141gb", "h200"}, {"mistral-7b-v0.1", "mistral-7b"},
};

// Spelling k of entry i of the presets (gpu 0) or the GPUs (1): its name, then its label (GPUs),
// then the aliases of its name; NULL past the last.
MN__PRIVATE const char *mn__spelling(int gpu, uint32_t i, uint32_t k) {
    const char *name = gpu ? mn__gpus[i].name : mn__presets[i].name;
    size_t j;
    if (k == 0) return name;
    if (gpu && --k == 0) return mn__gpus[i].label;
    for (j = 0; j < sizeof mn__aliases / sizeof mn__aliases[0]; j++)
        if (!strcmp(mn__aliases[j].name, name) && --k == 0) return mn__aliases[j].alias;
    return NULL;
}

// s's key (mn__name_key), with the words of a GPU's (gpu 1) or a model's source taken off where
// strip; 0 when s is too long.
MN__PRIVATE int mn__table_key(const char *s, int gpu, int strip, char *key) {
    if (!mn__name_key(s, key)) return 0;
    if (strip)
        mn__key_strip(key, gpu ? mn__gpu_pre : mn__model_pre, gpu ? mn__gpu_mid : mn__no_words,
                      gpu ? mn__no_words : mn__model_suf);
    return 1;
}

// The table entry that name is (UINT32_MAX: none); where none, *closest gets the entry whose
// spelling is the fewest edits away, within two, by key (UINT32_MAX: none).
MN__PRIVATE uint32_t mn__name_find(int gpu, const char *name, uint32_t *closest) {
    uint32_t i, k, count = gpu ? mn_gpu_count() : mn_preset_count();
    int strip, more, d, best = 3;
    char q[MN__KEY_MAX], t[MN__KEY_MAX];
    const char *sp, *slash;
    *closest = UINT32_MAX;
    if (!gpu && (slash = strrchr(name, '/')) != NULL) name = slash + 1;  // a hub id: org/name
    for (i = 0; i < count; i++)
        for (k = 0; (sp = mn__spelling(gpu, i, k)) != NULL; k++)
            if (mn__streq_nocase(name, sp)) return i;
    for (strip = 0; strip < 2; strip++) {
        if (!mn__table_key(name, gpu, strip, q)) return UINT32_MAX;
        for (k = 0, more = 1; more; k++)  // names first: of two as close, the name is suggested
            for (more = 0, i = 0; i < count; i++) {
                if ((sp = mn__spelling(gpu, i, k)) == NULL) continue;
                more = 1;
                if (!mn__table_key(sp, gpu, strip, t)) continue;
                if (!strcmp(q, t)) return i;
                if (q[0] == t[0] && (d = mn__key_distance(q, t)) < best) best = d, *closest = i;
            }
    }
    return UINT32_MAX;
}

MNIMPL mn_result mn_preset_find(const char *name, mn_model *out) {
    uint32_t i, near;
    if (!name || !out) return MN_ERR_INVALID_ARG;
    if ((i = mn__name_find(0, name, &near)) == UINT32_MAX) return MN_ERR_NOT_FOUND;
    *out = mn__presets[i];
    return MN_OK;
}

MNIMPL mn_result mn_gpu_find(const char *name, mn_gpu *out) {
    uint32_t i, near;
    if (!name || !out) return MN_ERR_INVALID_ARG;
    if ((i = mn__name_find(1, name, &near)) == UINT32_MAX) return MN_ERR_NOT_FOUND;
    *out = mn__gpus[i];
    return MN_OK;
}

MNIMPL const char *mn_preset_closest(const char *name) {
    uint32_t near;
    if (!name || mn__name_find(0, name, &near) != UINT32_MAX || near == UINT32_MAX) return NULL;
    return mn__presets[near].name;
}

MNIMPL const char *mn_gpu_closest(const char *name) {
    uint32_t near;
    if (!name || mn__name_find(1, name, &near) != UINT32_MAX || near == UINT32_MAX) return NULL;
    return mn__gpus[near].name;
}

// The GPT of trainer.c (>>estimate/gpt): GPT-2's layout without dropout, the fused tanh GELU.
MNIMPL mn_result mn_gpt_model(uint64_t layers, uint64_t dim, uint64_t heads, uint64_t seq,
                              uint64_t vocab, int tied, mn_model *out) {
    if (!out || !layers || !dim || !heads || !seq || !vocab || dim % heads)
        return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "memanat-gpt-%llul-%llud",
             (unsigned long long)layers, (unsigned long long)dim);
    out->arch = MN_ARCH_DECODER;
    out->layers = layers, out->hidden = dim, out->heads = heads, out->ffn = 4 * dim;
    out->vocab = vocab, out->max_positions = seq;
    out->norm = MN_NORM_LAYERNORM, out->act = MN_ACT_GELU_TANH, out->posemb = MN_POS_LEARNED;
    out->head = MN_HEAD_LM, out->tie_embeddings = tied != 0;
    out->qkv_bias = out->out_bias = out->mlp_bias = out->final_norm = 1;
    out->dtype = MN_FP32;
    return MN_OK;
}

MNIMPL const char *mn_phase_name(mn_phase p) {
    static const char *const n[MN_PHASE_COUNT] = {"none", "load", "forward", "backward",
                                                  "optimizer", "prefill", "decode"};
    return (unsigned)p < MN_PHASE_COUNT ? n[p] : "unknown";
}

// ---- >>estimate/step: the simulation state ------------------------------------------------------

#define MN__NONE 0xffffffffu

typedef struct mn__tensor {
    uint64_t bytes;
    uint32_t refs;          // Python-level references + saved-for-backward references
    uint32_t grad;          // tensor id of its gradient, MN__NONE
    uint8_t category;       // mn_category
    uint8_t requires_grad;  // produced by a recorded op (autograd will reach it)
    uint8_t live;           // allocated and not yet freed
    uint8_t elem_size;      // bytes per element
    uint32_t tape;          // ops on the tape that name it (in or out): its id stays its own
} mn__tensor;

// What only --explain reads of a tensor, kept apart (S->history) so that the records every
// estimate touches stay 24 bytes.
typedef struct mn__tensor_hist {
    const char *why;        // the mechanism that made it
    uint64_t born, died;    // allocation and free sequence numbers (died 0 = alive)
} mn__tensor_hist;

typedef struct mn__op {
    uint64_t bwd_temp;      // transient bytes of the backward beyond input gradients
    uint32_t in[3];         // activation inputs (gradients flow to those that require grad)
    uint32_t saved[8];      // tensors kept for backward
    uint32_t param[3];      // parameters whose gradients this op produces
    uint32_t out;           // output tensor
    uint32_t recomp_block;  // full checkpointing: the block this op re-runs (MN__NONE otherwise)
    uint8_t nin, nsaved, nparam, cast16;  // cast16: weight gradient first made in 16-bit (autocast)
} mn__op;

typedef struct mn__param {
    uint64_t numel, dims[2];
    uint32_t ndim;
    uint32_t w16;            // autocast cached 16-bit copy (tensor id) during a forward; made
                             // by mn__w16_new only, which records it for mn__amp_clear
    uint32_t grad;           // gradient tensor id
    uint64_t grad_pass;      // the backward pass that made .grad (tied weights: see param_grad)
    uint8_t trainable, quant, has_state;
} mn__param;

typedef struct mn__cfg {
    mn_model m;
    mn_setup s;
    uint64_t batch;        // sequences per micro-batch (batch x beams when generating)
    uint64_t seq, ntok;    // tokens per sequence, tokens per micro-batch (batch x seq)
    uint64_t q_width;      // query projection width: heads x head_dim
    uint64_t kv_width;     // key (and value) projection width: kv_heads x head_dim
    uint64_t ffn;          // MLP inner width
    uint64_t lora_rank;    // 0 = no LoRA
    uint64_t enc_seq;      // encoder tokens per sequence (cross-attention keys)
    // element sizes in bytes (esz):
    uint32_t a_esz;        // activations out of matmuls
    uint32_t w_esz;        // parameters as stored
    uint32_t g_esz;        // parameter gradients
    uint32_t kv_esz;       // the KV cache
    int amp;               // torch autocast (casts per linear, cached 16-bit weights)
    int hf;                // HF modelling code (composite RMSNorm, upcast logits, ...)
    int t2;                // torch 2 with today's HF code (transformers 5, peft 0.2x): --torch 2
    int kv_train;          // the decoder builds a KV cache in training (use_cache left on)
    mn_optim_impl impl;    // how the optimizer step runs
    int fw_master;         // a separate fp32 master copy: 1 = in optimizer, 2 = in master_weights
    int memanat_gpu;       // --framework memanat on a GPU: trainer.c --device cuda's schedule
    int grads_keep;        // gradients stay between steps (zeroed in place), else freed after it
    int grads_prealloc;    // grads and optimizer state made at load (deepspeed, megatron)
    int state_half;        // optimizer state in 16-bit (zeros_like of a 16-bit parameter)
    mn_category param_cat; // category of the stored parameters
    mn_attn attn;
    uint32_t nblocks;      // encoder + decoder blocks
    uint32_t gpus, zero;
    uint64_t cublas_workspace;  // bytes, from the GPU table
    uint32_t sm;           // the GPU's compute capability x 10 (SDPA backend choice)
} mn__cfg;

struct mn__replay_memo;

// An allocation event as the simulation keeps it: mn_trace_event less its stream (the simulation
// has only the default one) and with the tensor id in 32 bits, 16 bytes instead of 24 (a fit
// writes hundreds of thousands; mn__events_public gives them their public form).
typedef struct mn__ev {
    uint64_t size;    // bytes (allocations)
    uint32_t id;      // tensor id
    uint8_t alloc;    // 1 = allocate, 0 = free
    uint8_t category; // mn_category
    uint8_t phase;    // mn_phase
    uint8_t zero;     // 0 (events compare as bytes)
} mn__ev;

typedef struct mn__sim {
    const mn_allocator *al;
    mn__cfg *c;
    struct mn__replay_memo *rmemo;  // earlier replays to reuse (mn_fit's), or NULL
    // growing arrays: n* elements in use, c* allocated
    mn__tensor *tensors;     // nt, ct; a tensor id indexes it
    uint32_t *free_ids;      // ids free for reuse (reuse on): nfree, cfree
    mn__tensor_hist *hist;   // each tensor's history when kept (history on): ch allocated
    mn__op *ops;             // the autograd tape: nops, cops
    mn__param *params;       // np, cp
    mn__ev *ev;              // allocation events: nev, cev
    uint64_t nalloc;         // the allocations among them
    uint32_t *block_start;   // first parameter of each block (stack: of each layer)
    uint64_t nt, ct, nops, cops, np, cp, nev, cev, nfree, cfree, ch;
    int history;             // keep each tensor's history (hist)
    int reuse;               // a dead tensor's id is reused once no op names it (no explain:
                             // nothing reads a dead tensor's history; no events kept for the
                             // caller: the replay pairs an id's allocation with its free, and
                             // a reused id was freed before, so its statistics are the same)
    int unique_ids;          // 1: no reuse (the tests compare the replays with and without)
    uint64_t cur[MN_CAT_COUNT];       // bytes live per category
    uint64_t total, peak;             // bytes live, and the most at any moment
    uint64_t total_r, peak_r;         // the same with each tensor rounded up to 512 bytes
    uint64_t at_peak[MN_CAT_COUNT];   // cur at that moment
    uint64_t cat_peak[MN_CAT_COUNT];  // the most bytes of each category at any moment
    mn_phase phase, peak_phase;
    const char *why;                  // label of the tensors made now (mn__tensor_hist.why)
    uint64_t seq, peak_seq;           // allocation/free events so far; seq at the peak
    int record;              // autograd records ops (grad mode)
    int counting;            // the counting pass: parameters are registered, nothing is allocated
    int events;              // keep the allocation events (for the replay)
    int training;            // dropout is active
    uint32_t cursor;         // parameter cursor of the forward pass
    uint32_t cursor_emb;     // the word embedding (shared by a T5 decoder and tied heads)
    uint32_t hold;           // a tensor the caller holds until the end of the micro-batch
    uint32_t ffn_out;        // BERT: the MLP's inner activation, held by a Python local
    uint32_t emb_out;        // the embeddings' output, held by the base model's forward
    uint32_t attn_w;         // eager attention's returned weights, held by the layer's locals
    uint32_t *outs;          // model outputs the training loop holds until zero_grad: nouts, couts
    uint64_t nouts, couts;
    uint64_t bw_pass;        // backward passes run so far
    uint32_t blk;            // block being run
    uint64_t *parts;         // mn_estimate_parts: activation bytes kept per part, or NULL
    int parts_on;            // record into parts during this forward
    uint64_t w16_lo, w16_hi; // parameters [lo, hi) that may hold an autocast copy (amp_clear)
    // mn_estimate_lengths: steps run (0 = 2), each micro-batch's sequence length (NULL = the
    // setup's), and the event count at the start of the first step and the end of each step
    uint64_t steps;
    const uint64_t *mb_seq;
    uint64_t *step_marks;
    // mn_fit: only whether the step fits is asked (decide); the replay at the device's size met
    // an allocation it could not grant and stopped there (unsettled: the result holds the step
    // alone and fits 0)
    int decide, unsettled;
    // mn_fit: where the simulated step alone goes as well (what the estimate with no_replay set
    // gives), the replay then skipped when the step alone does not fit; set once written
    mn_estimate_result *alone;
    int alone_set, alone_replay;  // alone_replay: the replay ran after it
    uint64_t alone_above;    // 0, or the replay only when the step alone's device_used exceeds it
    uint64_t alone_below;    // 0, or the replay only when the step alone's peak allocated is
                             // below it
    // mn_fit: where the step does not fit, only that is asked, of the step alone too (cut): the
    // run stops once its peak allocated passes the device, which it does not leave (over set; the
    // result's numbers are then those of the run so far, and it does not fit)
    int cut, over;
    mn_result err;
} mn__sim;

// Grows *arr (elem bytes each) to hold at least need elements.
MN__PRIVATE int mn__grow(mn__sim *S, void **arr, uint64_t *cap, uint64_t need, size_t elem) {
    uint64_t nc;
    void *n;
    if (need <= *cap) return 1;
    nc = *cap ? *cap * 2 : 256;
    while (nc < need) nc *= 2;
    if (nc > (uint64_t)(SIZE_MAX / elem) || nc > 0xfffffff0u) {
        S->err = MN_ERR_OVERFLOW;
        return 0;
    }
#ifdef MN__REALLOC
    // With the C library's allocator, realloc: glibc moves a large block's pages (mremap) where
    // a new block would fault every page in again for the copy (a fit's CLI run: 1,407 -> 1,218
    // page faults).
    if (!S->al || (!S->al->alloc_fn && !S->al->free_fn)) {
        n = MN__REALLOC(*arr, (size_t)nc * elem);
        if (!n) { S->err = MN_ERR_OUT_OF_MEMORY; return 0; }  // (*arr kept, freed with S)
        *arr = n;
        *cap = nc;
        return 1;
    }
#endif
    n = mn__alloc(S->al, (size_t)nc * elem);
    if (!n) { S->err = MN_ERR_OUT_OF_MEMORY; return 0; }
    if (*arr) memcpy(n, *arr, (size_t)*cap * elem);
    mn__free(S->al, *arr);
    *arr = n;
    *cap = nc;
    return 1;
}

// Checked product; an overflow sticks in S->err and yields 0.
MN__PRIVATE uint64_t mn__prod(mn__sim *S, uint64_t a, uint64_t b) {
    uint64_t r;
    if (mn_mul_u64(a, b, &r) != MN_OK) { S->err = MN_ERR_OVERFLOW; return 0; }
    return r;
}

MN__PRIVATE uint64_t mn__prod3(mn__sim *S, uint64_t a, uint64_t b, uint64_t c) {
    return mn__prod(S, mn__prod(S, a, b), c);
}

MN__PRIVATE void mn__event(mn__sim *S, uint32_t id, int alloc) {
    mn__ev *e;
    if (!S->events) return;
    if (S->nev >= S->cev && !mn__grow(S, (void **)&S->ev, &S->cev, S->nev + 1, sizeof *S->ev))
        return;
    e = &S->ev[S->nev++];
    S->nalloc += alloc != 0;
    e->size = S->tensors[id].bytes;
    e->id = id;
    e->alloc = (uint8_t)alloc;
    e->category = S->tensors[id].category;
    e->phase = (uint8_t)S->phase;
    e->zero = 0;
}

// The simulation's events in their public form, allocated with al (NULL: none, or no memory).
MN__PRIVATE mn_trace_event *mn__events_public(const mn_allocator *al, const mn__ev *ev,
                                              uint64_t n) {
    mn_trace_event *t;
    uint64_t i;
    if (n == 0 || n > SIZE_MAX / sizeof *t) return NULL;
    t = (mn_trace_event *)mn__alloc_array(al, (size_t)n, sizeof *t);
    if (!t) return NULL;
    for (i = 0; i < n; i++) {
        t[i].size = ev[i].size, t[i].id = ev[i].id, t[i].stream = 0;
        t[i].alloc = ev[i].alloc, t[i].category = ev[i].category, t[i].phase = ev[i].phase;
    }
    return t;
}

MN__PRIVATE uint32_t mn__tensor_new(mn__sim *S, uint64_t numel, uint32_t esz, mn_category cat) {
    mn__tensor *t;
    uint32_t id;
    uint64_t bytes;
    int k;
    if (S->counting || S->err) return MN__NONE;
    bytes = mn__prod(S, numel, esz);
    if (S->err) return MN__NONE;
    if (bytes == 0) bytes = 1;
    if (S->nfree) {
        id = S->free_ids[--S->nfree];
    } else {
        if (S->nt >= S->ct &&
            !mn__grow(S, (void **)&S->tensors, &S->ct, S->nt + 1, sizeof *S->tensors))
            return MN__NONE;
        id = (uint32_t)S->nt++;
    }
    t = &S->tensors[id];
    t->bytes = bytes, t->refs = 1, t->grad = MN__NONE, t->category = (uint8_t)cat;
    t->requires_grad = 0, t->live = 1, t->elem_size = (uint8_t)esz, t->tape = 0;
    ++S->seq;
    if (S->history) {
        mn__tensor_hist *h;
        if (!mn__grow(S, (void **)&S->hist, &S->ch, (uint64_t)id + 1, sizeof *S->hist))
            return MN__NONE;
        h = &S->hist[id];
        h->why = S->why ? S->why : "other", h->born = S->seq, h->died = 0;
    }
    S->cur[cat] += bytes;
    if (S->cur[cat] > S->cat_peak[cat]) S->cat_peak[cat] = S->cur[cat];
    if (mn_add_u64(S->total, bytes, &S->total) != MN_OK) {
        S->err = MN_ERR_OVERFLOW;
        return MN__NONE;
    }
    S->total_r += (bytes + 511) / 512 * 512;
    if (S->total_r > S->peak_r) S->peak_r = S->total_r;
    if (S->total > S->peak) {
        S->peak = S->total, S->peak_phase = S->phase, S->peak_seq = S->seq;
        for (k = 0; k < MN_CAT_COUNT; k++) S->at_peak[k] = S->cur[k];
        // (mn_fit: a step alone that will not fit, or not below alone_below, is not replayed;
        // the peak only grows, so no event from here on would be read: none is kept)
        if (S->alone && S->events && (S->peak > S->c->s.capacity - S->c->s.context ||
                                      (S->alone_below && S->peak >= S->alone_below)))
            S->events = 0;
        if (S->cut && S->peak > S->c->s.capacity - S->c->s.context)
            S->over = 1, S->err = MN_ERR_DEVICE_OOM;  // (every op of the run ends at an error)
    }
    mn__event(S, id, 1);
    return id;
}

// Id reuse (S->reuse): a tensor's record is what autograd's nodes keep of it (size, dtype,
// requires_grad, the gradient flowing into it), so its id stays taken while it is alive or an
// op on the tape names it; then it goes on the free list, and the next new tensor takes it.
// Every other holder of an id (a parameter's w16 and grad, a tensor's grad, S->hold, outs, ...)
// holds a reference and sets its field to MN__NONE when it drops it. Without reuse a fit's
// estimate of a 20,000-block model writes 15 M records (700 MB); with it, those alive at once.
MN__PRIVATE void mn__id_free(mn__sim *S, uint32_t id) {
    if (!S->reuse) return;
    if (S->nfree >= S->cfree &&
        !mn__grow(S, (void **)&S->free_ids, &S->cfree, S->nfree + 1, sizeof *S->free_ids))
        return;
    S->free_ids[S->nfree++] = id;
}

// The free of mn__drop, once no reference is left.
MN__PRIVATE void mn__drop_last(mn__sim *S, uint32_t id) {
    mn__tensor *t = &S->tensors[id];
    t->live = 0;
    ++S->seq;
    if (S->history) S->hist[id].died = S->seq;
    S->cur[t->category] -= t->bytes;
    S->total -= t->bytes;
    S->total_r -= (t->bytes + 511) / 512 * 512;
    mn__event(S, id, 0);
    if (!t->tape) mn__id_free(S, id);
}

// Drops a reference; the last one frees the tensor. (Most drops leave references: the test and
// the decrement are inlined, the free is a call.)
static inline void mn__drop(mn__sim *S, uint32_t id) {
    mn__tensor *t;
    if (id == MN__NONE || S->counting || S->err) return;
    t = &S->tensors[id];
    MN_ASSERT(t->live && t->refs > 0);
    if (!--t->refs) mn__drop_last(S, id);
}

// An op on the tape names id (pin) or has left the tape (unpin).
MN__PRIVATE void mn__pin(mn__sim *S, uint32_t id) {
    if (id != MN__NONE) S->tensors[id].tape++;
}

MN__PRIVATE void mn__unpin(mn__sim *S, uint32_t id) {
    mn__tensor *t;
    if (id == MN__NONE) return;
    t = &S->tensors[id];
    MN_ASSERT(t->tape > 0);
    if (!--t->tape && !t->live) mn__id_free(S, id);
}

MN__PRIVATE void mn__ref(mn__sim *S, uint32_t id) {
    if (id != MN__NONE && !S->counting && !S->err) S->tensors[id].refs++;
}

// A transient buffer: allocated and freed at once (its peak contribution is what counts).
MN__PRIVATE void mn__transient(mn__sim *S, uint64_t bytes, mn_category cat) {
    if (bytes) mn__drop(S, mn__tensor_new(S, bytes, 1, cat));
}

MN__PRIVATE uint64_t mn__tensor_numel(mn__sim *S, uint32_t id) {
    if (id == MN__NONE || S->counting || S->err) return 0;
    return S->tensors[id].bytes / S->tensors[id].elem_size;
}

MN__PRIVATE uint32_t mn__elem_size(mn__sim *S, uint32_t id) {
    return (id == MN__NONE || S->counting || S->err) ? 4 : S->tensors[id].elem_size;
}

MN__PRIVATE int mn__requires_grad(mn__sim *S, uint32_t id) {
    return id != MN__NONE && !S->counting && S->tensors[id].requires_grad;
}

// What an op records on the tape. mn__op_desc_of(out) leaves every slot MN__NONE (unused); a
// call site fills the slots it needs: d.in[0] = x, d.saved[0] = x, d.param[0] = w.
typedef struct mn__op_desc {
    uint32_t out;        // output tensor
    uint32_t in[3];      // activation inputs (gradients flow to those that require grad)
    uint32_t saved[8];   // tensors kept for backward
    uint32_t param[3];   // parameters whose gradients the op produces
    uint64_t bwd_temp;   // transient bytes of the backward beyond input gradients, 0 = none
    int cast16;          // the weight gradient is first made in 16-bit (autocast)
} mn__op_desc;

// (A copy of one constant: filled slot by slot, the struct was then read back in wider loads
// that waited on the narrow stores, a sixth of an estimate's time.)
static const mn__op_desc mn__op_desc_empty = {
    MN__NONE, {MN__NONE, MN__NONE, MN__NONE},
    {MN__NONE, MN__NONE, MN__NONE, MN__NONE, MN__NONE, MN__NONE, MN__NONE, MN__NONE},
    {MN__NONE, MN__NONE, MN__NONE}, 0, 0};

MN__PRIVATE mn__op_desc mn__op_desc_of(uint32_t out) {
    mn__op_desc d = mn__op_desc_empty;
    d.out = out;
    return d;
}

// Records an op on the tape when autograd records (grad mode and something requires grad).
// saved[] gain a reference; the op's output must exist.
MN__PRIVATE void mn__op_rec(mn__sim *S, const mn__op_desc *d) {
    mn__op *o;
    int i, any = 0;
    if (S->counting || S->err || !S->record || d->out == MN__NONE) return;
    for (i = 0; i < 3; i++) any |= mn__requires_grad(S, d->in[i]);
    for (i = 0; i < 3; i++) any |= d->param[i] != MN__NONE && S->params[d->param[i]].trainable;
    if (!any) return;
    S->tensors[d->out].requires_grad = 1;
    if (S->nops >= S->cops && !mn__grow(S, (void **)&S->ops, &S->cops, S->nops + 1, sizeof *S->ops))
        return;
    o = &S->ops[S->nops++];
    memset(o, 0, sizeof *o);
    o->out = d->out, o->recomp_block = MN__NONE, o->bwd_temp = d->bwd_temp;
    o->cast16 = (uint8_t)d->cast16;
    mn__pin(S, d->out);
    for (i = 0; i < 3; i++)
        if (d->in[i] != MN__NONE) o->in[o->nin++] = d->in[i], mn__pin(S, d->in[i]);
    for (i = 0; i < 8; i++) {
        if (d->saved[i] == MN__NONE) continue;
        o->saved[o->nsaved++] = d->saved[i];
        mn__ref(S, d->saved[i]);
    }
    for (i = 0; i < 3; i++) if (d->param[i] != MN__NONE) o->param[o->nparam++] = d->param[i];
}

// Records out = f(in) for an op that saves nothing for backward (a cast, a copy, a scale).
MN__PRIVATE void mn__op_rec_from(mn__sim *S, uint32_t out, uint32_t in) {
    mn__op_desc d = mn__op_desc_of(out);
    d.in[0] = in;
    mn__op_rec(S, &d);
}

// ---- parameters ---------------------------------------------------------------------------------

// Counting pass: registers the next parameter tensor (cols 0 = a vector). Forward pass: returns
// the next parameter in the same order, so both passes walk one description of the model.
MN__PRIVATE uint32_t mn__next_param(mn__sim *S, uint64_t rows, uint64_t cols, int trainable,
                                    int quant) {
    mn__param *p;
    if (S->err) return MN__NONE;
    if (!S->counting) return S->cursor < S->np ? S->cursor++ : MN__NONE;
    if (!mn__grow(S, (void **)&S->params, &S->cp, S->np + 1, sizeof *S->params)) return MN__NONE;
    p = &S->params[S->np];
    memset(p, 0, sizeof *p);
    p->dims[0] = rows, p->dims[1] = cols, p->ndim = cols ? 2 : 1;
    p->numel = cols ? mn__prod(S, rows, cols) : rows;
    p->trainable = (uint8_t)trainable, p->quant = (uint8_t)quant;
    p->w16 = MN__NONE, p->grad = MN__NONE;
    return (uint32_t)S->np++;
}

// The base weights train (no LoRA, no --trainable-params adapters).
MN__PRIVATE int mn__base_trainable(const mn__cfg *c) {
    return c->lora_rank == 0 && c->s.trainable_params == 0;
}

// ---- layers -------------------------------------------------------------------------------------
// Each returns a new tensor holding one Python reference that the caller drops.

MN__PRIVATE uint32_t mn__identity(mn__sim *S, uint32_t x) { mn__ref(S, x); return x; }

// x.to(dtype): a new tensor of esz-byte elements (its backward saves nothing), or x itself.
MN__PRIVATE uint32_t mn__cast(mn__sim *S, uint32_t x, uint32_t esz) {
    uint32_t y;
    if (S->counting || S->err || x == MN__NONE || mn__elem_size(S, x) == esz)
        return mn__identity(S, x);
    y = mn__tensor_new(S, mn__tensor_numel(S, x), esz, MN_CAT_ACTIVATIONS);
    mn__op_rec_from(S, y, x);
    return y;
}

// A copy of n elements that makes x contiguous (a reshape of a permuted view inside matmul; n
// is less than x's size for GPT-2's q, k, v, views into one c_attn output), or x itself.
MN__PRIVATE uint32_t mn__contig(mn__sim *S, uint32_t x, uint64_t n, int permuted) {
    uint32_t y;
    if (!permuted || S->counting || S->err) return mn__identity(S, x);
    y = mn__tensor_new(S, n, mn__elem_size(S, x), MN_CAT_ACTIVATIONS);
    mn__op_rec_from(S, y, x);
    return y;
}

// A model output the training loop keeps referencing (`out = model(**batch)`): the logits and,
// with use_cache on, the KV cache in out.past_key_values stay alive through backward and
// optimizer.step() until the loop drops `out` (after zero_grad). Takes over the reference.
MN__PRIVATE void mn__hold_output(mn__sim *S, uint32_t id) {
    if (id == MN__NONE || S->counting || S->err) return;
    if (!mn__grow(S, (void **)&S->outs, &S->couts, S->nouts + 1, sizeof *S->outs)) return;
    S->outs[S->nouts++] = id;
}

MN__PRIVATE void mn__release_outputs(mn__sim *S) {
    uint64_t i;
    for (i = 0; i < S->nouts; i++) mn__drop(S, S->outs[i]);
    S->nouts = 0;
}

MN__PRIVATE uint32_t mn__dropout(mn__sim *S, uint32_t x, float p);
MN__PRIVATE uint32_t mn__add(mn__sim *S, uint32_t a, uint32_t b);

// Autocast's cached 16-bit copy of parameter i, made once per forward; the range of parameters
// holding one is recorded, so that mn__amp_clear visits those alone (a checkpointed block's re-run
// casts its own weights: clearing after it costs that block, not the whole model).
MN__PRIVATE void mn__w16_new(mn__sim *S, uint32_t i) {
    if (S->counting || S->err || i == MN__NONE || S->params[i].w16 != MN__NONE) return;
    S->params[i].w16 = mn__tensor_new(S, S->params[i].numel, 2, MN_CAT_WEIGHTS);
    if (S->w16_hi == 0 || i < S->w16_lo) S->w16_lo = i;
    if ((uint64_t)i + 1 > S->w16_hi) S->w16_hi = (uint64_t)i + 1;
}

// LoRA as peft 0.2x runs it (peft/tuners/lora/layer.py, Linear.forward): the adapters are kept
// in fp32 (get_peft_model's autocast_adapter_dtype=True upcasts bf16/fp16 adapter weights), so
// x = _cast_input_dtype(x, lora_A.weight.dtype) makes an fp32 copy of a 16-bit input;
// lora_dropout (p > 0) keeps a bool mask and a dropped copy; lora_A's matmul saves its input
// (under autocast, a 16-bit cast of its own: autocast caches only leaf weights, so the base
// layer's cast of x is not reused); lora_B saves h; result + z * scaling promotes to the wider
// dtype and `result.to(torch_result_dtype)` casts back. Returns the new result; y stays.
MN__PRIVATE uint32_t mn__lora_t2(mn__sim *S, uint32_t x, uint32_t y, uint64_t in, uint64_t out,
                                 uint32_t la, uint32_t lb) {
    S->why = "peft LoRA: fp32 adapters, their input casts and products";
    mn__cfg *c = S->c;
    uint64_t rows = mn__tensor_numel(S, x) / in, r = c->lora_rank;
    // xa: the fp32 input; xd: after lora_dropout; x16: autocast's cast for lora_A; h, z: the
    // adapter's two products; zs = z * scaling; y2 = y + zs; y3: y2 back in y's dtype
    uint32_t xa, xd, x16, h, z, zs, y2, y3, he = c->amp ? 2 : 4, ye = mn__elem_size(S, y);
    mn__op_desc d;
    xa = mn__cast(S, x, 4);
    xd = mn__dropout(S, xa, c->s.lora_dropout);
    S->why = "peft LoRA: fp32 adapters, their input casts and products";
    mn__drop(S, xa);
    x16 = c->amp ? mn__cast(S, xd, 2) : mn__identity(S, xd);
    mn__drop(S, xd);
    h = mn__tensor_new(S, mn__prod(S, rows, r), he, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(h);
    d.in[0] = x16, d.saved[0] = x16, d.param[0] = la, d.cast16 = c->amp;
    mn__op_rec(S, &d);
    mn__drop(S, x16);
    if (c->amp) {  // autocast's cached 16-bit adapter weights
        mn__w16_new(S, la);
        mn__w16_new(S, lb);
    }
    z = mn__tensor_new(S, mn__prod(S, rows, out), he, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(z);
    d.in[0] = h, d.saved[0] = h, d.param[0] = lb, d.cast16 = c->amp;
    mn__op_rec(S, &d);
    mn__drop(S, h);
    zs = mn__tensor_new(S, mn__prod(S, rows, out), he, MN_CAT_ACTIVATIONS);
    mn__op_rec_from(S, zs, z);
    mn__drop(S, z);
    y2 = mn__add(S, y, zs);
    mn__drop(S, zs);
    y3 = mn__cast(S, y2, ye);
    mn__drop(S, y2);
    return y3;
}

// y = x W^T (+ b) [+ LoRA: y += (x A^T) B^T * scale]. x: [rows, in] -> y: [rows, out].
// Saves x when W trains (mm saves self for mat2's gradient, derivatives.yaml) and, under autocast,
// the cached 16-bit weight (for the input gradient). Autocast casts a fp32 input per call.
MN__PRIVATE uint32_t mn__linear(mn__sim *S, uint32_t x, uint64_t in, uint64_t out, int bias,
                                uint32_t lora_bit, int quantizable, uint32_t shared) {
    S->why = "linear: outputs and autocast input casts";
    mn__cfg *c = S->c;
    int tr = mn__base_trainable(c), lora = c->lora_rank && (c->s.lora_targets & lora_bit);
    int quant = quantizable && c->s.quant > MN_QUANT_NONE;
    // w, bb: weight and bias; la, lb: LoRA's A and B; xin: the input the matmul reads (a 16-bit
    // copy under autocast); w16: autocast's cached 16-bit weight; tmp: a dequantized weight
    uint32_t w = shared != MN__NONE ? shared : mn__next_param(S, out, in, tr, quant);
    uint32_t bb = bias ? mn__next_param(S, out, 0, tr, 0) : MN__NONE;
    uint32_t la = lora ? mn__next_param(S, c->lora_rank, in, 1, 0) : MN__NONE;
    uint32_t lb = lora ? mn__next_param(S, out, c->lora_rank, 1, 0) : MN__NONE;
    uint32_t xin = x, w16 = MN__NONE, tmp = MN__NONE, y;
    uint64_t rows, bwd = 0;
    // bitsandbytes autograd/_functions.py: MatMul4Bit.forward keeps ctx.tensors = (A, B), its
    // input A, before 0.43.2 and (None, B) from 0.43.2 (read in both releases); MatMul8bitLt keeps
    // (CAt, subA, A) in every release read (0.43.1 to 0.50.2): A whenever a gradient flows (CAt
    // only for a trained weight; subA, the outlier columns, depends on the data: not counted)
    int keep_a = quant && (c->s.quant == MN_QUANT_INT8 ||
                           (c->s.bnb_version && c->s.bnb_version < 4302));
    mn__op_desc d;
    mn__param *P;
    if (S->counting || S->err || w == MN__NONE) return MN__NONE;
    P = &S->params[w];
    rows = mn__tensor_numel(S, x) / in;
    if (c->amp && mn__elem_size(S, x) == 4) {  // autocast: a fresh 16-bit copy of the input
        xin = mn__tensor_new(S, rows * in, 2, MN_CAT_ACTIVATIONS);
        mn__op_rec_from(S, xin, x);
    }
    if (c->amp && !P->quant) {  // autocast caches the 16-bit weight for the rest of the forward
        S->why = "autocast: cached 16-bit weight copies";
        mn__w16_new(S, w);
        S->why = "linear: outputs and autocast input casts";
        w16 = P->w16;
    }
    if (P->quant || c->zero >= 3) {  // dequantized / gathered full weight, for the matmul only
        tmp = mn__tensor_new(S, P->numel, 2, MN_CAT_TEMPORARY);
        bwd = P->numel * 2;
    }
    y = mn__tensor_new(S, mn__prod(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(y);
    d.in[0] = xin;
    d.saved[0] = P->trainable || keep_a ? xin : MN__NONE;
    d.saved[1] = mn__requires_grad(S, xin) ? w16 : MN__NONE;
    d.param[0] = w, d.param[1] = bb;
    d.bwd_temp = bwd, d.cast16 = c->amp;
    mn__op_rec(S, &d);
    mn__drop(S, tmp);
    if (lora && c->t2) {
        uint32_t y2 = mn__lora_t2(S, x, y, in, out, la, lb);
        mn__drop(S, y);
        y = y2;
    } else if (lora) {  // PEFT LoRA: h = x A^T (saves x), z = h B^T (saves h), y = y + z * scale
        uint32_t h, z, z2, y2, xd = mn__dropout(S, xin, c->s.lora_dropout);  // lora_dropout(x)
        h = mn__tensor_new(S, mn__prod(S, rows, c->lora_rank), c->a_esz, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(h);
        d.in[0] = xd, d.saved[0] = xd, d.param[0] = la;
        mn__op_rec(S, &d);
        mn__drop(S, xd);
        z = mn__tensor_new(S, mn__prod(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(z);
        d.in[0] = h, d.saved[0] = h, d.param[0] = lb;
        mn__op_rec(S, &d);
        mn__drop(S, h);
        z2 = mn__tensor_new(S, mn__prod(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
        mn__op_rec_from(S, z2, z);
        mn__drop(S, z);
        y2 = mn__tensor_new(S, mn__prod(S, rows, out), c->a_esz, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(y2);
        d.in[0] = y, d.in[1] = z2;
        mn__op_rec(S, &d);
        mn__drop(S, y), mn__drop(S, z2);
        y = y2;
    }
    if (xin != x) mn__drop(S, xin);
    return y;
}

// Dropout keeps a 1-byte mask (native_dropout, derivatives.yaml) and allocates its output.
MN__PRIVATE uint32_t mn__dropout(mn__sim *S, uint32_t x, float p) {
    S->why = "dropout: bool mask and output";
    uint32_t mask, y;
    uint64_t n;
    mn__op_desc d;
    if (p <= 0.0f || !S->training) return mn__identity(S, x);
    if (S->counting || S->err) return MN__NONE;
    n = mn__tensor_numel(S, x);
    mask = mn__tensor_new(S, n, 1, MN_CAT_ACTIVATIONS);
    y = mn__tensor_new(S, n, mn__elem_size(S, x), MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(y);
    d.in[0] = x, d.saved[0] = mask;
    mn__op_rec(S, &d);
    mn__drop(S, mask);
    return y;
}

// Elementwise a + b; the result takes the wider dtype (type promotion); saves nothing.
MN__PRIVATE uint32_t mn__add(mn__sim *S, uint32_t a, uint32_t b) {
    S->why = "residual and adds";
    uint32_t y;
    uint32_t ea = mn__elem_size(S, a), eb = mn__elem_size(S, b);
    mn__op_desc d;
    if (S->counting || S->err) return MN__NONE;
    y = mn__tensor_new(S, mn__tensor_numel(S, a), ea > eb ? ea : eb, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(y);
    d.in[0] = a, d.in[1] = b;
    mn__op_rec(S, &d);
    return y;
}

// Layernorm / RMSNorm over the last `width` features.
// Fused kernels (native_layer_norm, apex) save the input and per-row statistics. HF's RMSNorm is
// written in Python ops: an fp32 copy of the input (saved by pow and mul), the normalized values
// cast back to the input dtype (saved by the weight multiply when the weight trains).
MN__PRIVATE uint32_t mn__norm(mn__sim *S, uint32_t x, uint64_t width) {
    S->why = "norms: layer_norm, HF RMSNorm's fp32 upcast";
    mn__cfg *c = S->c;
    int tr = mn__base_trainable(c), ln = c->m.norm != MN_NORM_RMSNORM;
    uint32_t w = mn__next_param(S, width, 0, tr, 0);
    uint32_t bb = ln ? mn__next_param(S, width, 0, tr, 0) : MN__NONE;
    uint32_t y, st, ex = mn__elem_size(S, x);
    uint64_t n, rows;
    mn__op_desc d;
    if (S->counting || S->err) return MN__NONE;
    n = mn__tensor_numel(S, x), rows = n / width;
    if (ln || !c->hf) {
        uint32_t oe = c->amp ? 4 : ex;  // autocast runs layer_norm in fp32
        st = mn__tensor_new(S, rows * 2, 4, MN_CAT_ACTIVATIONS);
        y = mn__tensor_new(S, n, oe, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(y);
        d.in[0] = x, d.saved[0] = x, d.saved[1] = st, d.param[0] = w, d.param[1] = bb;
        mn__op_rec(S, &d);
        mn__drop(S, st);
        return y;
    } else {
        // x32: the fp32 input; rs: rsqrt(mean(x32^2) + eps) per row; h1 = x32 * rs; h16: h1
        // cast back to the input dtype; out_e: the output's element size
        uint32_t x32 = x, rs, h1, h16, out_e = ex;
        if (ex != 4) {
            x32 = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS);
            mn__op_rec_from(S, x32, x);
        }
        mn__transient(S, n * 4, MN_CAT_ACTIVATIONS);  // x32.pow(2) before the mean
        rs = mn__tensor_new(S, rows, 4, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(rs);
        d.in[0] = x32, d.saved[0] = x32, d.saved[1] = rs;
        mn__op_rec(S, &d);
        h1 = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS);
        d.out = h1;  // x32 * rs, saving both
        mn__op_rec(S, &d);
        h16 = h1;
        if (ex != 4) {
            h16 = mn__tensor_new(S, n, ex, MN_CAT_ACTIVATIONS);
            mn__op_rec_from(S, h16, h1);
            mn__drop(S, h1);
        }
        if (c->w_esz == 4 && ex != 4) out_e = 4;  // fp32 weight * 16-bit values promotes
        y = mn__tensor_new(S, n, out_e, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(y);
        d.in[0] = h16, d.saved[0] = tr ? h16 : MN__NONE, d.param[0] = w;
        mn__op_rec(S, &d);
        mn__drop(S, h16), mn__drop(S, rs);
        if (x32 != x) mn__drop(S, x32);
        return y;
    }
}

// Activations: relu/gelu/silu kernels save their input (derivatives.yaml). HF's "gelu_new" is
// 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))) in separate ops: it also keeps the tanh output,
// 0.5 x and 1 + tanh, and makes four more transient copies on the way.
MN__PRIVATE uint32_t mn__activation(mn__sim *S, uint32_t x) {
    S->why = "MLP activation (gelu_new: fp32 pow under autocast)";
    uint32_t y, e;
    uint64_t n;
    mn__op_desc d;
    if (S->counting || S->err) return MN__NONE;
    n = mn__tensor_numel(S, x), e = mn__elem_size(S, x);
    if (S->c->m.act == MN_ACT_GELU_NEW && S->c->hf && S->c->t2 && S->c->amp) {
        // transformers' NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 *
        // torch.pow(x, 3)))). CUDA autocast runs pow in fp32 (its fp32 op list), so pow casts x
        // to fp32 and saves that copy; every later op promotes to fp32: the tanh output and
        // 1 + tanh are fp32, 0.5 * x stays 16-bit, the product is fp32.
        uint32_t x32 = mn__cast(S, x, 4), p, th, op1, half;
        p = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS);           // pow(x32, 3)
        th = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS), mn__drop(S, p), p = th;  // 0.044715 *
        th = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS), mn__drop(S, p), p = th;  // x + ...
        th = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS), mn__drop(S, p), p = th;  // sqrt(2/pi) *
        th = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS), mn__drop(S, p);          // tanh
        op1 = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS);
        half = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        y = mn__tensor_new(S, n, 4, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(y);
        d.in[0] = x, d.saved[0] = x32, d.saved[1] = th, d.saved[2] = op1, d.saved[3] = half;
        d.bwd_temp = 3 * n * 4;
        mn__op_rec(S, &d);
        mn__drop(S, x32), mn__drop(S, th), mn__drop(S, op1), mn__drop(S, half);
        return y;
    }
    if (S->c->m.act == MN_ACT_GELU_NEW && S->c->hf) {
        // a1, a2: transients of the polynomial inside tanh; th: the tanh; op1 = 1 + th;
        // half = 0.5 x; y = half * op1
        uint32_t a1 = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS), a2, th, op1, half;
        a2 = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, a1);
        a1 = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, a2);
        th = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, a1);
        op1 = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        half = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        y = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(y);
        d.in[0] = x, d.saved[0] = x, d.saved[1] = th, d.saved[2] = op1, d.saved[3] = half;
        d.bwd_temp = 3 * n * e;
        mn__op_rec(S, &d);
        mn__drop(S, th), mn__drop(S, op1), mn__drop(S, half);
        return y;
    }
    y = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(y);
    d.in[0] = x, d.saved[0] = x;
    mn__op_rec(S, &d);
    return y;
}

// a * b, saving both operands (mul's gradient needs the other factor).
MN__PRIVATE uint32_t mn__mul(mn__sim *S, uint32_t a, uint32_t b) {
    S->why = "gated MLP product";
    uint32_t y;
    mn__op_desc d;
    if (S->counting || S->err) return MN__NONE;
    y = mn__tensor_new(S, mn__tensor_numel(S, a), mn__elem_size(S, a), MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(y);
    d.in[0] = a, d.in[1] = b, d.saved[0] = a, d.saved[1] = b;
    mn__op_rec(S, &d);
    return y;
}

// Rotary embedding as HF writes it: q*cos + rotate_half(q)*sin (three transients, one result).
// Fused kernels (megatron, flash) write one output.
MN__PRIVATE uint32_t mn__rope(mn__sim *S, uint32_t x, uint64_t n) {
    S->why = "RoPE (fp32 q, k under autocast)";
    uint32_t e = mn__elem_size(S, x), y, t1 = MN__NONE, t2, t3 = MN__NONE;
    if (S->counting || S->err) return MN__NONE;
    if (S->c->hf && S->c->t2) {
        // transformers' apply_rotary_pos_emb: q * cos + rotate_half(q) * sin. The rotary module
        // returns cos and sin in the dtype of the hidden states (fp32 under autocast, whose op
        // lists do not hold mul or add), so a 16-bit q promotes: the result is fp32. The muls
        // save cos and sin only (q * cos needs no gradient for cos). rotate_half: -x2 (half the
        // width) and a cat.
        uint32_t oe = S->c->amp ? 4 : e, neg, rot, a, b;
        a = mn__tensor_new(S, n, oe, MN_CAT_ACTIVATIONS);
        neg = mn__tensor_new(S, n / 2, e, MN_CAT_ACTIVATIONS);
        rot = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, neg);
        b = mn__tensor_new(S, n, oe, MN_CAT_ACTIVATIONS);
        mn__drop(S, rot);
        y = mn__tensor_new(S, n, oe, MN_CAT_ACTIVATIONS);
        mn__op_rec_from(S, y, x);
        mn__drop(S, a), mn__drop(S, b);
        if (S->c->m.rope_cat) {  // Phi-3: torch.cat([q_rot * cos + ..., q_pass], dim=-1)
            a = mn__tensor_new(S, n, oe, MN_CAT_ACTIVATIONS);
            mn__op_rec_from(S, a, y);
            mn__drop(S, y);
            y = a;
        }
        return y;
    }
    if (S->c->hf) {
        t1 = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        t2 = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        t3 = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, t2);
    }
    y = mn__tensor_new(S, n, e, MN_CAT_ACTIVATIONS);
    mn__op_rec_from(S, y, x);
    mn__drop(S, t1), mn__drop(S, t3);
    return y;
}

// torch.nn.functional.scaled_dot_product_attention as torch 2 runs it for HF's sdpa path
// (transformers/integrations/sdpa_attention.py: GQA through enable_gqa when there is no mask).
// Autocast casts fp32 inputs (RoPE's fp32 q, k) to 16 bits. The backend is the first that
// accepts the inputs in torch's priority order (ATen/Context.h, sdp_priority_order: flash,
// efficient, math, cudnn in torch 2.15, so cuDNN attention is never the default choice; it
// would keep what flash keeps): flash for 16-bit inputs without a mask on sm80+, head dim
// <= 256, GQA allowed; memory-efficient for fp32/16-bit, not for GQA; math otherwise. Flash and
// memory-efficient save q, k, v, the output and the log-sum-exp per query row; their output is
// laid out [b, s, heads, d], so HF's transpose(1, 2).contiguous() is a view. The math backend
// (_scaled_dot_product_attention_math) scales q, repeats k and v to every head for GQA, keeps
// the softmax probabilities, and returns a contiguous copy of its output.
MN__PRIVATE uint32_t mn__sdpa_t2(mn__sim *S, uint32_t q, uint32_t k, uint32_t v, uint64_t nq,
                                 uint64_t nkv, uint64_t ns, uint64_t sq) {
    S->why = "SDPA: saved q/k/v casts, output, logsumexp (math: probabilities)";
    mn__cfg *c = S->c;
    uint32_t e = c->amp ? 2 : mn__elem_size(S, q), qc, kc, vc, y;
    int gqa = c->m.kv_heads != c->m.heads;
    int flash = e == 2 && c->m.head_dim <= 256 && c->sm >= 80;  // no padding mask assumed
    mn__op_desc d;
    qc = mn__cast(S, q, e), kc = mn__cast(S, k, e), vc = mn__cast(S, v, e);
    if (flash || !gqa) {
        uint32_t lse = mn__tensor_new(S, mn__prod3(S, c->batch, c->m.heads, sq), 4,
                                      MN_CAT_ACTIVATIONS);
        y = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(y);
        d.in[0] = q, d.in[1] = k, d.in[2] = v;
        d.saved[0] = qc, d.saved[1] = kc, d.saved[2] = vc, d.saved[3] = y, d.saved[4] = lse;
        d.bwd_temp = nq * 4;
        mn__op_rec(S, &d);
        mn__drop(S, lse);
        if (c->m.rope_cat) {
            // the kernels allocate the output like q (empty_like of q.transpose(1, 2)); a
            // contiguous [b, heads, s, d] q (Phi-3's cat) gives an output whose transpose back
            // is not contiguous, so HF's .contiguous() copies it
            uint32_t yc = mn__contig(S, y, nq, 1);
            mn__drop(S, y);
            y = yc;
        }
    } else {  // math: qs = q * scale, kr/vr repeated, P = softmax(qs kr^T), y = (P vr).clone()
        uint64_t nrep = nkv / c->m.kv_heads * c->m.heads;  // k, v repeated to every head
        uint32_t qs, kr, vr, sc, P, O;
        qs = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        kr = gqa ? mn__tensor_new(S, nrep, e, MN_CAT_ACTIVATIONS) : mn__identity(S, kc);
        vr = gqa ? mn__tensor_new(S, nrep, e, MN_CAT_ACTIVATIONS) : mn__identity(S, vc);
        sc = mn__tensor_new(S, ns, e, MN_CAT_ACTIVATIONS);
        P = mn__tensor_new(S, ns, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, sc);
        O = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        y = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, O);
        d = mn__op_desc_of(y);
        d.in[0] = q, d.in[1] = k, d.in[2] = v;
        d.saved[0] = qs, d.saved[1] = kr, d.saved[2] = vr, d.saved[3] = P;
        d.bwd_temp = 2 * ns * e;
        mn__op_rec(S, &d);
        mn__drop(S, qs), mn__drop(S, kr), mn__drop(S, vr), mn__drop(S, P);
    }
    mn__drop(S, qc), mn__drop(S, kc), mn__drop(S, vc);
    return y;
}

// k or v as eager attention's matmul reads it: repeat_kv's copy at every head (GQA; n_rep
// elements), autocast's cast to ce bytes, then matmul's reshape copy when the tensor is still a
// permuted view (straight from a linear: not cached, not repeated).
MN__PRIVATE uint32_t mn__eager_kv(mn__sim *S, uint32_t x, uint64_t n_rep, uint64_t n, uint32_t ce,
                                  int gqa, int cached) {
    uint32_t r, t, xc;
    if (gqa) {
        r = mn__tensor_new(S, n_rep, mn__elem_size(S, x), MN_CAT_ACTIVATIONS);
        mn__op_rec_from(S, r, x);
    } else {
        r = mn__identity(S, x);
    }
    t = mn__cast(S, r, ce);
    mn__drop(S, r);
    xc = mn__contig(S, t, n, !cached && !gqa);
    mn__drop(S, t);
    return xc;
}

// HF's eager_attention_forward in transformers 5 (models/llama, gpt2, bert modeling files):
// matmul(q, k^T) * scaling (+ mask), softmax, dropout, matmul(p, v), transpose(1, 2).contiguous().
// - matmul folds the batch dims with reshape: q (and k, v straight from a linear) are permuted
//   views [b, s, heads, d] -> [b, heads, s, d], so reshape copies them; the KV cache's cat
//   outputs and repeat_kv's copies (GQA) are contiguous and are saved as they are.
// - under autocast matmul casts its fp32 inputs to 16 bits first (RoPE's q, the fp32 cache, the
//   fp32 probabilities); the causal mask is fp32, so the masked scores promote to fp32.
// - Llama-family code: softmax(dtype=float32).to(query.dtype); GPT-2: softmax (fp32 under
//   autocast) then .type(value.dtype); BERT: softmax, and dropout on its output.
// Saved: q's copy, k (or its cast), the softmax output, the dropout mask, the probabilities the
// second matmul reads, v (or its cast); the output's contiguous copy is the next linear's input.
MN__PRIVATE uint32_t mn__eager_t2(mn__sim *S, uint32_t q, uint32_t k, uint32_t v, uint64_t nq,
                                  uint64_t nkv, uint64_t ns, int sel) {
    mn__cfg *c = S->c;
    int rope = c->m.posemb == MN_POS_ROPE, gqa = c->m.kv_heads != c->m.heads;
    int cached = c->kv_train, dec = c->m.arch == MN_ARCH_DECODER;
    uint64_t nrep = nkv / c->m.kv_heads * c->m.heads;
    uint32_t ce = c->amp ? 2 : mn__elem_size(S, q), pe, t, y;
    // qc, kc, vc: what the matmuls save; s0..: the scores;
    // P: softmax output; Pq: P in the dtype the code casts to; mk, Pd: dropout; Pm: the
    // probabilities the second matmul reads; C, Cc: its output and the contiguous copy
    uint32_t qc, kc, vc, s0, s1, P, Pq, mk = MN__NONE, Pd, Pm, C, Cc;
    mn__op_desc d;
    t = mn__cast(S, q, ce);
    qc = mn__contig(S, t, nq, !c->m.rope_cat);  // Phi-3's rotated q is already contiguous
    mn__drop(S, t);
    kc = mn__eager_kv(S, k, nrep, nkv, ce, gqa, cached);
    s0 = mn__tensor_new(S, ns, ce, MN_CAT_ACTIVATIONS);
    s1 = mn__tensor_new(S, ns, ce, MN_CAT_ACTIVATIONS);  // * scaling
    mn__drop(S, s0), s0 = s1;
    if (dec) {  // + the causal mask, fp32 with fp32 weights (the hidden states' dtype)
        s1 = mn__tensor_new(S, ns, c->w_esz > ce ? c->w_esz : ce, MN_CAT_ACTIVATIONS);
        mn__drop(S, s0), s0 = s1;
    }
    pe = rope ? 4 : c->amp ? 4 : mn__elem_size(S, s0);
    P = mn__tensor_new(S, ns, pe, MN_CAT_ACTIVATIONS);
    mn__drop(S, s0);
    Pq = rope ? mn__cast(S, P, mn__elem_size(S, q))
         : dec ? mn__cast(S, P, mn__elem_size(S, v)) : mn__identity(S, P);
    Pd = Pq;
    if (c->m.attn_dropout > 0.0f && S->training) {
        mk = mn__tensor_new(S, ns, 1, MN_CAT_ACTIVATIONS);
        Pd = mn__tensor_new(S, ns, mn__elem_size(S, Pq), MN_CAT_ACTIVATIONS);
    } else {
        mn__ref(S, Pd);
    }
    mn__drop(S, Pq);
    Pm = mn__cast(S, Pd, ce);
    // eager_attention_forward returns (attn_output, attn_weights): the layer keeps the weights
    // (the dropout output) in a local until it returns (BertLayer's `outputs`, the decoder
    // layers' `_`), after its MLP
    if (S->attn_w == MN__NONE) S->attn_w = Pd;
    else mn__drop(S, Pd);
    vc = mn__eager_kv(S, v, nrep, nkv, ce, gqa, cached);
    C = mn__tensor_new(S, nq, ce, MN_CAT_ACTIVATIONS);
    Cc = mn__tensor_new(S, nq, ce, MN_CAT_ACTIVATIONS);
    mn__drop(S, C);
    y = Cc;
    d = mn__op_desc_of(y);
    d.in[0] = q, d.in[1] = k, d.in[2] = v;
    d.saved[0] = qc, d.saved[1] = kc, d.saved[2] = P, d.saved[3] = mk, d.saved[4] = Pm;
    d.saved[5] = vc;
    d.bwd_temp = ns * pe;  // the probabilities' gradient (the inputs' gradients come first)
    if (sel) {  // selective recomputation keeps q, k, v; backward remakes the rest
        int i, j, dup;
        for (i = 0; i < 6; i++) {
            for (dup = 0, j = 0; j < i; j++) dup |= d.saved[j] == d.saved[i];
            if (d.saved[i] != MN__NONE && !dup) d.bwd_temp += S->tensors[d.saved[i]].bytes;
            d.saved[i] = MN__NONE;
        }
        // the contiguous q, k, v that enter core attention (Megatron checkpoints that region)
        d.saved[0] = qc, d.saved[1] = kc, d.saved[2] = vc;
    }
    mn__op_rec(S, &d);
    mn__drop(S, qc), mn__drop(S, kc), mn__drop(S, P), mn__drop(S, mk), mn__drop(S, Pm);
    mn__drop(S, vc);
    return y;
}

// The attention core softmax(q k^T * scale + mask) v for b sequences, sq queries, skv keys.
// Eager (HF modelling code): bmm copies of q, k (repeated to all heads for GQA) and v are saved,
// the scores pass through scale and mask ops (new tensors), softmax saves its output (fp32 under
// autocast and in the Llama/T5 code), dropout saves a 1-byte mask and its output, a cast back to
// the value dtype is saved by the second bmm. Fused attention (sdpa, flash) saves q, k, v, the
// output and the log-sum-exp per row (FlashAttention-2 paper, backward pass).
// Selective checkpointing (Korthikanti et al. 2022) keeps only q, k, v and recomputes the rest.
MN__PRIVATE uint32_t mn__attn_core(mn__sim *S, uint32_t q, uint32_t k, uint32_t v, uint64_t sq,
                                   uint64_t skv) {
    S->why = "attention core (eager: scores and probabilities)";
    mn__cfg *c = S->c;
    uint32_t e = mn__elem_size(S, q), y;
    uint64_t nq = mn__prod3(S, c->batch, sq, c->q_width);
    uint64_t nkv = mn__prod3(S, c->batch, skv, c->kv_width);
    uint64_t ns = mn__prod(S, mn__prod3(S, c->batch, c->m.heads, sq), skv);
    int sel = c->s.checkpointing == MN_CKPT_SELECTIVE && S->record;
    int i;
    mn__op_desc d;
    if (S->counting || S->err) return MN__NONE;
    if (c->attn == MN_ATTN_EAGER && c->t2 && c->hf && c->m.posemb != MN_POS_RELATIVE) {
        y = mn__eager_t2(S, q, k, v, nq, nkv, ns, sel);
    } else if (c->attn == MN_ATTN_EAGER) {
        int t5 = c->m.posemb == MN_POS_RELATIVE;
        uint32_t sm_e = (c->amp || t5 || c->m.posemb == MN_POS_ROPE) ? 4 : e;
        uint32_t mask_e = (c->amp && c->m.arch == MN_ARCH_ENCODER) ? 4 : e;  // fp32 extended mask
        uint64_t nrep = c->hf ? mn__prod3(S, c->batch, skv, c->q_width) : nkv;  // repeat_kv (GQA)
        // qc, kc, vc: the bmm's copies of q, k, v; s0, s1: scores; P = softmax; mk, Pd: dropout
        // mask and output; P16: P cast to the value dtype; C = P16 v; Cc: its contiguous copy
        uint32_t qc, kc, vc, s0, s1, P, mk = MN__NONE, Pd, P16, C, Cc;
        uint64_t kept = 0;
        qc = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        kc = mn__tensor_new(S, nrep, e, MN_CAT_ACTIVATIONS);
        s0 = mn__tensor_new(S, ns, e, MN_CAT_ACTIVATIONS);
        if (!t5) {  // scores * scale, then + mask: two new tensors (T5 adds its bias in place)
            s1 = mn__tensor_new(S, ns, e, MN_CAT_ACTIVATIONS), mn__drop(S, s0), s0 = s1;
            s1 = mn__tensor_new(S, ns, mask_e, MN_CAT_ACTIVATIONS), mn__drop(S, s0), s0 = s1;
        }
        P = mn__tensor_new(S, ns, sm_e, MN_CAT_ACTIVATIONS);
        // torch <= 1.10: _softmax_backward_data took the softmax input, so autograd kept it too
        if (c->s.torch_version >= 111) mn__drop(S, s0), s0 = MN__NONE;
        Pd = P;
        if (c->m.attn_dropout > 0.0f && S->training) {
            mk = mn__tensor_new(S, ns, 1, MN_CAT_ACTIVATIONS);
            Pd = mn__tensor_new(S, ns, sm_e, MN_CAT_ACTIVATIONS);
        }
        P16 = Pd;
        if (sm_e != e) P16 = mn__tensor_new(S, ns, e, MN_CAT_ACTIVATIONS);
        vc = mn__tensor_new(S, nrep, e, MN_CAT_ACTIVATIONS);
        C = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        Cc = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        mn__drop(S, C);
        d = mn__op_desc_of(Cc);
        d.in[0] = q, d.in[1] = k, d.in[2] = v;
        d.saved[0] = qc, d.saved[1] = kc, d.saved[2] = P, d.saved[3] = mk, d.saved[4] = P16;
        d.saved[5] = vc, d.saved[6] = s0;
        for (i = 0; i < 7; i++) {
            int dup = 0, j;
            for (j = 0; j < i; j++) dup |= d.saved[j] == d.saved[i];
            if (d.saved[i] != MN__NONE && !dup) kept += S->tensors[d.saved[i]].bytes;
        }
        d.bwd_temp = 2 * ns * sm_e + 3 * nq * e;
        if (sel) {  // keep q, k, v; backward recomputes what the others held
            for (i = 3; i < 7; i++) d.saved[i] = MN__NONE;
            d.saved[0] = q, d.saved[1] = k, d.saved[2] = v;
            d.bwd_temp += kept;
        }
        mn__op_rec(S, &d);
        mn__drop(S, qc), mn__drop(S, kc), mn__drop(S, vc), mn__drop(S, P), mn__drop(S, s0);
        if (Pd != P) mn__drop(S, Pd);
        if (P16 != Pd) mn__drop(S, P16);
        mn__drop(S, mk);
        y = Cc;
    } else if (c->t2 && c->hf) {
        y = mn__sdpa_t2(S, q, k, v, nq, nkv, ns, sq);
    } else {
        uint32_t O = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
        uint64_t rows = mn__prod3(S, c->batch, c->m.heads, sq);
        uint32_t lse = mn__tensor_new(S, rows, 4, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(O);
        d.in[0] = q, d.in[1] = k, d.in[2] = v;
        d.saved[0] = q, d.saved[1] = k, d.saved[2] = v, d.saved[3] = O, d.saved[4] = lse;
        d.bwd_temp = nq * 4;
        y = O;
        if (c->hf) {  // attn_output.transpose(1, 2).contiguous()
            y = mn__tensor_new(S, nq, e, MN_CAT_ACTIVATIONS);
            mn__op_rec(S, &d);
            mn__op_rec_from(S, y, O);
            mn__drop(S, O);
        } else {
            mn__op_rec(S, &d);
        }
        mn__drop(S, lse);
    }
    return y;
}

MN__PRIVATE uint32_t mn__attention(mn__sim *S, uint32_t xq, uint32_t xkv, uint64_t sq,
                                   uint64_t skv, int cross) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden;
    int fused = (c->m.posemb == MN_POS_LEARNED && c->m.arch == MN_ARCH_DECODER) ||  // GPT-2
                c->m.fused_proj;
    uint32_t q, k, v, ctx, o;
    if (c->m.posemb == MN_POS_RELATIVE && !cross &&
        (S->blk == 0 || (c->m.arch == MN_ARCH_ENCODER_DECODER && S->blk == c->m.encoder_layers)))
        mn__next_param(S, c->m.rel_buckets, c->m.heads, mn__base_trainable(c), 0);  // T5 bias
    if (fused && !cross) {
        q = mn__linear(S, xq, h, c->q_width + 2 * c->kv_width, c->m.qkv_bias,
                       MN_LORA_Q | MN_LORA_K | MN_LORA_V, 1, MN__NONE);
        k = mn__identity(S, q), v = mn__identity(S, q);
    } else {
        q = mn__linear(S, xq, h, c->q_width, c->m.qkv_bias, MN_LORA_Q, 1, MN__NONE);
        k = mn__linear(S, xkv, h, c->kv_width, c->m.qkv_bias, MN_LORA_K, 1, MN__NONE);
        v = mn__linear(S, xkv, h, c->kv_width, c->m.qkv_bias, MN_LORA_V, 1, MN__NONE);
    }
    if (c->m.posemb == MN_POS_ROPE && !S->counting) {
        uint32_t q2 = mn__rope(S, q, mn__prod3(S, c->batch, sq, c->q_width));
        uint32_t k2 = mn__rope(S, k, mn__prod3(S, c->batch, skv, c->kv_width));
        mn__drop(S, q), mn__drop(S, k);
        q = q2, k = k2;
    }
    if (c->kv_train && !cross && !S->counting && S->record) {
        // transformers 5: LlamaModel.forward (and the other decoders) makes a DynamicCache when
        // use_cache is on, in training too (gradient checkpointing turns it off). Its first
        // update (cache_utils.py, DynamicLayer.lazy_initialization + update) is torch.cat onto an
        // empty tensor of the key's dtype: new copies of k and v (v promoted to the key's dtype,
        // fp32 after RoPE under autocast) that attention then reads, and that out.past_key_values
        // keeps until the loop drops the outputs.
        uint32_t ke = mn__elem_size(S, k), ve = mn__elem_size(S, v), kc, vc;
        uint64_t n = mn__prod3(S, c->batch, skv, c->kv_width);
        S->why = "KV cache built in training (use_cache on)";
        kc = mn__tensor_new(S, n, ke, MN_CAT_KV_CACHE);
        mn__op_rec_from(S, kc, k);
        vc = mn__tensor_new(S, n, ke > ve ? ke : ve, MN_CAT_KV_CACHE);
        mn__op_rec_from(S, vc, v);
        mn__drop(S, k), mn__drop(S, v);
        mn__ref(S, kc), mn__ref(S, vc);
        mn__hold_output(S, kc), mn__hold_output(S, vc);
        k = kc, v = vc;
    }
    if (cross) skv = c->enc_seq;
    ctx = mn__attn_core(S, q, k, v, sq, skv);
    o = mn__linear(S, ctx, c->q_width, h, c->m.out_bias, MN_LORA_O, 1, MN__NONE);
    mn__drop(S, ctx), mn__drop(S, q), mn__drop(S, k), mn__drop(S, v);
    return o;
}

// MLP: act(x W1) W2, or act(x Wg) * (x Wu) Wd when gated; T5 applies dropout inside.
MN__PRIVATE uint32_t mn__mlp(mn__sim *S, uint32_t x) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden, f = c->ffn;
    uint32_t u, a, d, y, g;
    int t5 = c->m.posemb == MN_POS_RELATIVE;
    if (c->m.gated_mlp) {
        // fused gate_up_proj (Phi-3): one matmul, so autocast casts x once; its output's two
        // halves are the gate and up tensors
        uint32_t xg = c->m.fused_proj && c->amp ? mn__cast(S, x, 2) : mn__identity(S, x);
        g = mn__linear(S, xg, h, f, c->m.mlp_bias, MN_LORA_GATE, 1, MN__NONE);
        u = mn__linear(S, xg, h, f, c->m.mlp_bias, MN_LORA_UP, 1, MN__NONE);
        mn__drop(S, xg);
        a = mn__activation(S, g);
        mn__drop(S, g);
        y = mn__mul(S, a, u);
        mn__drop(S, a), mn__drop(S, u);
    } else {
        u = mn__linear(S, x, h, f, c->m.mlp_bias, MN_LORA_UP, 1, MN__NONE);
        y = mn__activation(S, u);
        mn__drop(S, u);
    }
    if (t5) {
        d = mn__dropout(S, y, c->m.dropout);
        mn__drop(S, y);
        y = d;
    }
    d = mn__linear(S, y, f, h, c->m.mlp_bias, MN_LORA_DOWN, 1, MN__NONE);
    // transformers 5 BertLayer.feed_forward_chunk keeps intermediate_output (this y) in a local
    // until BertOutput's dense, dropout, residual add and LayerNorm have run
    if (c->t2 && c->hf && c->m.post_norm && !S->counting) S->ffn_out = y;
    else mn__drop(S, y);
    return d;
}

// Residual: x + dropout(y); drops y.
MN__PRIVATE uint32_t mn__residual(mn__sim *S, uint32_t x, uint32_t y) {
    uint32_t d = mn__dropout(S, y, S->c->m.dropout), r;
    mn__drop(S, y);
    r = mn__add(S, d, x);
    mn__drop(S, d);
    return r;
}

MN__PRIVATE int mn__block_is_decoder(const mn__cfg *c, uint32_t blk) {
    return c->m.arch == MN_ARCH_DECODER ||
           (c->m.arch == MN_ARCH_ENCODER_DECODER && blk >= c->m.encoder_layers);
}

// One transformer block: pre-norm (GPT-2, Llama, T5) or post-norm (BERT). mem: encoder output
// for the cross-attention of an encoder-decoder's decoder blocks.
MN__PRIVATE uint32_t mn__block(mn__sim *S, uint32_t x, uint32_t blk, uint32_t mem) {
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden, s = c->seq;
    uint32_t n, a, x1, x2;
    int cross = c->m.arch == MN_ARCH_ENCODER_DECODER && mn__block_is_decoder(c, blk);
    if (S->counting) S->block_start[blk] = (uint32_t)S->np;
    else S->cursor = S->block_start[blk];
    S->blk = blk;
    S->attn_w = MN__NONE;
    if (c->m.post_norm) {
        a = mn__attention(S, x, x, s, s, 0);
        x1 = mn__residual(S, x, a);
        n = mn__norm(S, x1, h);
        mn__drop(S, x1);
        S->ffn_out = MN__NONE;
        a = mn__mlp(S, n);
        x2 = mn__residual(S, n, a);
        mn__drop(S, n);
        n = mn__norm(S, x2, h);
        mn__drop(S, x2);
        mn__drop(S, S->ffn_out), mn__drop(S, S->attn_w);
        S->ffn_out = S->attn_w = MN__NONE;
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
    mn__drop(S, S->attn_w);
    S->attn_w = MN__NONE;
    return x2;
}

// Drops the autocast weight cache (autocast exit); tensors saved for backward stay.
// Only the parameters in [w16_lo, w16_hi) can hold a copy (mn__w16_new).
MN__PRIVATE void mn__amp_clear(mn__sim *S) {
    uint64_t i;
    if (S->counting) return;
    for (i = S->w16_lo; i < S->w16_hi && i < S->np; i++) {
        if (S->params[i].w16 == MN__NONE) continue;
        mn__drop(S, S->params[i].w16);
        S->params[i].w16 = MN__NONE;
    }
    S->w16_lo = S->w16_hi = 0;
}

// A block under full checkpointing: run without recording, keep its input (and the encoder
// output), and record one op that re-runs the block when backward reaches it
// (torch.utils.checkpoint).
MN__PRIVATE uint32_t mn__block_ckpt(mn__sim *S, uint32_t x, uint32_t blk, uint32_t mem) {
    uint32_t y;
    mn__op *o;
    if (S->counting || !S->record || S->c->s.checkpointing != MN_CKPT_FULL)
        return mn__block(S, x, blk, mem);
    S->record = 0;
    y = mn__block(S, x, blk, mem);
    S->record = 1;
    if (S->err || y == MN__NONE) return y;
    {  // autograd records the checkpoint only when something in it needs a gradient
        uint64_t i, end = blk + 1 < S->c->nblocks ? S->block_start[blk + 1] : S->np;
        int any = mn__requires_grad(S, x) || mn__requires_grad(S, mem);
        for (i = S->block_start[blk]; i < end && !any; i++) any = S->params[i].trainable;
        if (!any) return y;
    }
    if (!mn__grow(S, (void **)&S->ops, &S->cops, S->nops + 1, sizeof *S->ops)) return y;
    o = &S->ops[S->nops++];
    memset(o, 0, sizeof *o);
    o->out = y, o->recomp_block = blk;
    o->in[o->nin++] = x;
    o->saved[o->nsaved++] = x, mn__ref(S, x);
    if (mem != MN__NONE) o->in[o->nin++] = mem, o->saved[o->nsaved++] = mem, mn__ref(S, mem);
    mn__pin(S, y), mn__pin(S, x), mn__pin(S, mem);
    S->tensors[y].requires_grad = 1;
    return y;
}

// Token (+ position, + token type) embeddings, optional norm, dropout. ids: [ntok] int64.
MN__PRIVATE uint32_t mn__embeddings(mn__sim *S, uint32_t ids, int first) {
    S->why = "embeddings";
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden;
    int tr = mn__base_trainable(c);
    uint32_t w, y, e2, sum, pw, tw;
    mn__op_desc d;
    w = first ? mn__next_param(S, c->m.vocab, h, tr, 0) : 0;
    if (first) S->cursor_emb = w;
    else w = S->cursor_emb;
    pw = tw = MN__NONE;
    if (first && c->m.posemb == MN_POS_LEARNED)
        pw = mn__next_param(S, c->m.max_positions, h, tr, 0);
    if (first && c->m.type_vocab) tw = mn__next_param(S, c->m.type_vocab, h, tr, 0);
    if (S->counting || S->err) {
        if (first && c->m.embed_norm) mn__norm(S, MN__NONE, h);
        return MN__NONE;
    }
    y = mn__tensor_new(S, c->ntok * h, c->w_esz == 1 ? 2 : c->w_esz, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(y);
    d.saved[0] = ids, d.param[0] = w;
    mn__op_rec(S, &d);
    // transformers 5: GPT2Model.forward keeps inputs_embeds (the token embedding) in a local
    // until it returns; LlamaModel (and the other decoders) its inputs_embeds, the output here
    if (first && c->t2 && c->hf && S->emb_out == MN__NONE)
        S->emb_out = mn__identity(S, y);
    if (pw != MN__NONE) {  // position_ids [1, s]: one row per position, broadcast over the batch
        e2 = mn__tensor_new(S, c->seq * h, mn__elem_size(S, y), MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(e2);
        d.param[0] = pw;
        mn__op_rec(S, &d);
        sum = mn__add(S, y, e2);
        mn__drop(S, y), mn__drop(S, e2);
        y = sum;
    }
    if (tw != MN__NONE) {
        e2 = mn__tensor_new(S, c->ntok * h, mn__elem_size(S, y), MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(e2);
        d.saved[0] = ids, d.param[0] = tw;
        mn__op_rec(S, &d);
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
    if (first && c->t2 && c->hf && c->m.arch == MN_ARCH_ENCODER) {
        // BertModel.forward's embedding_output: the embeddings module's output
        mn__drop(S, S->emb_out);
        S->emb_out = mn__identity(S, e2);
    }
    return e2;
}

// Loss heads. LM (HF): logits in the compute dtype, upcast to fp32 (`logits.float()`), then
// cross_entropy = log_softmax (saves its fp32 output) + nll_loss, whose backward makes a dense
// [tokens, vocab] gradient. Classification: pooler + classifier on the first token (BERT), or a
// score layer on every token (decoders); both tiny, but the pooler keeps the last hidden states.
MN__PRIVATE uint32_t mn__head(mn__sim *S, uint32_t x, uint32_t labels) {
    S->why = "LM head and loss: logits, fp32 upcast, log_softmax";
    mn__cfg *c = S->c;
    uint64_t h = c->m.hidden, V = c->m.vocab;
    int tr = mn__base_trainable(c);
    // lg: logits, l32: fp32 logits, lsm = log_softmax(l32); pw, pb: pooler weight and bias;
    // cw, cb: classifier (or LM decoder) weight and bias
    uint32_t y, t, lg, l32, lsm, loss, pw, pb, cw, cb;
    mn__op_desc d;
    if (c->m.head == MN_HEAD_CLASSIFICATION) {
        uint64_t L = c->m.num_labels;
        if (c->m.pooler) {
            pw = mn__next_param(S, h, h, tr, 0), pb = mn__next_param(S, h, 0, tr, 0);
            cw = mn__next_param(S, L, h, tr || c->lora_rank, 0);
            cb = mn__next_param(S, L, 0, tr || c->lora_rank, 0);
            if (S->counting || S->err) return MN__NONE;
            y = mn__tensor_new(S, c->batch * h, c->a_esz, MN_CAT_ACTIVATIONS);
            d = mn__op_desc_of(y);
            d.in[0] = x, d.saved[0] = x, d.param[0] = pw, d.param[1] = pb;
            mn__op_rec(S, &d);  // the first-token view keeps x alive
            t = mn__activation(S, y);
            mn__drop(S, y);
            y = mn__dropout(S, t, c->m.dropout);
            mn__drop(S, t);
            lg = mn__tensor_new(S, c->batch * L, c->a_esz, MN_CAT_ACTIVATIONS);
            d = mn__op_desc_of(lg);
            d.in[0] = y, d.saved[0] = y, d.param[0] = cw, d.param[1] = cb;
            mn__op_rec(S, &d);
            mn__drop(S, y);
        } else {
            cw = mn__next_param(S, L, h, tr || c->lora_rank, 0);
            if (S->counting || S->err) return MN__NONE;
            lg = mn__tensor_new(S, c->ntok * L, c->a_esz, MN_CAT_ACTIVATIONS);
            d = mn__op_desc_of(lg);
            d.in[0] = x, d.saved[0] = x, d.param[0] = cw;
            mn__op_rec(S, &d);
        }
        loss = mn__tensor_new(S, 1, 4, MN_CAT_ACTIVATIONS);
        d = mn__op_desc_of(loss);
        d.in[0] = lg, d.saved[0] = lg;
        mn__op_rec(S, &d);
        if (c->t2) mn__hold_output(S, lg);  // out.logits
        else mn__drop(S, lg);
        return loss;
    }
    if (c->m.head == MN_HEAD_NONE) {
        if (S->counting || S->err) return MN__NONE;
        loss = mn__tensor_new(S, 1, 4, MN_CAT_ACTIVATIONS);
        mn__op_rec_from(S, loss, x);
        return loss;
    }
    y = mn__identity(S, x);
    if (c->m.lm_transform) {  // BERT MLM: dense + act + layernorm before the decoder
        t = mn__linear(S, y, h, h, 1, 0, 0, MN__NONE);
        mn__drop(S, y);
        y = mn__activation(S, t);
        mn__drop(S, t);
        t = mn__norm(S, y, h);
        mn__drop(S, y);
        y = t;
    }
    if (c->m.tie_embeddings && c->m.posemb == MN_POS_RELATIVE && !S->counting) {  // T5: x * d^-0.5
        t = mn__tensor_new(S, mn__tensor_numel(S, y), mn__elem_size(S, y), MN_CAT_ACTIVATIONS);
        mn__op_rec_from(S, t, y);
        mn__drop(S, y);
        y = t;
    }
    // transformers keeps the output embedding 16-bit (quantizers/base.py get_keys_to_not_convert
    // skips the output embeddings, the last module and tied weights); --quant-head yes models
    // code that quantizes it too (an untied head: resolution refuses a tied one)
    lg = mn__linear(S, y, h, V, 0, 0, c->s.quant_head,
                    c->m.tie_embeddings ? S->cursor_emb : MN__NONE);
    S->why = "LM head and loss: logits, fp32 upcast, log_softmax";
    if (c->m.lm_transform) cb = mn__next_param(S, V, 0, tr, 0);  // decoder bias
    mn__drop(S, y);
    if (S->counting || S->err) return MN__NONE;
    l32 = lg;
    if (mn__elem_size(S, lg) != 4) {
        l32 = mn__tensor_new(S, mn__tensor_numel(S, lg), 4, MN_CAT_ACTIVATIONS);
        mn__op_rec_from(S, l32, lg);
    }
    lsm = mn__tensor_new(S, mn__tensor_numel(S, l32), 4, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(lsm);
    d.in[0] = l32, d.saved[0] = lsm;
    mn__op_rec(S, &d);
    loss = mn__tensor_new(S, 1, 4, MN_CAT_ACTIVATIONS);
    d = mn__op_desc_of(loss);
    d.in[0] = lsm, d.saved[0] = lsm, d.saved[1] = labels;
    mn__op_rec(S, &d);  // nll backward: the dense grad of lsm
    mn__drop(S, lsm);
    if (l32 != lg) mn__drop(S, l32);
    if (c->t2) mn__hold_output(S, lg);  // out.logits
    else mn__drop(S, lg);
    return loss;
}

// Part i of the model kept (activation bytes now) - (at the previous mark) for backward.
MN__PRIVATE void mn__part_mark(mn__sim *S, uint32_t i, uint64_t *mark) {
    if (!S->parts_on || S->counting) return;
    S->parts[i] = S->cur[MN_CAT_ACTIVATIONS] - *mark;
    *mark = S->cur[MN_CAT_ACTIVATIONS];
}

// The whole forward of one micro-batch. Returns the loss tensor.
MN__PRIVATE uint32_t mn__forward(mn__sim *S, uint32_t ids, uint32_t labels) {
    mn__cfg *c = S->c;
    uint32_t x, y, mem = MN__NONE, blk, L = c->nblocks, E = 0;
    uint64_t mark = S->cur[MN_CAT_ACTIVATIONS];
    if (c->m.arch == MN_ARCH_STACK) return MN__NONE;  // handled by mn__stack_forward
    if (c->m.arch == MN_ARCH_ENCODER_DECODER) E = (uint32_t)c->m.encoder_layers;
    x = mn__embeddings(S, ids, 1);
    mn__part_mark(S, 0, &mark);
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
        mn__part_mark(S, blk + 1, &mark);
    }
    mn__drop(S, mem);
    if (c->m.final_norm) {
        y = mn__norm(S, x, c->m.hidden);
        mn__drop(S, x);
        x = y;
    }
    mn__drop(S, S->emb_out);  // the base model returns
    S->emb_out = MN__NONE;
    y = mn__head(S, x, labels);
    mn__drop(S, x);
    mn__part_mark(S, L + 1, &mark);
    return y;
}

// A custom stack: layers applied in order to [tokens, stack_in] inputs (which do not require
// grad, like data). Shared layers reuse an earlier layer's parameters.
MN__PRIVATE uint32_t mn__stack_forward(mn__sim *S, uint32_t x) {
    mn__cfg *c = S->c;
    const mn_layer *ly = c->m.stack;
    uint32_t i, y, *pidx = NULL, loss;
    uint64_t mark = S->cur[MN_CAT_ACTIVATIONS];
    mn__op_desc d;
    if (!S->counting) pidx = S->block_start;  // parameter index of each layer, made while counting
    mn__ref(S, x);                       // the caller keeps its reference to the input
    mn__part_mark(S, 0, &mark);
    for (i = 0; i < c->m.stack_len && !S->err; i++) {
        uint32_t w = MN__NONE;
        if (S->counting) {
            if (ly[i].shared_with) w = S->block_start[ly[i].shared_with - 1];
            else if (ly[i].kind == MN_LAYER_LINEAR) {
                w = mn__next_param(S, ly[i].out, ly[i].in, 1, 0);
                if (ly[i].bias) mn__next_param(S, ly[i].out, 0, 1, 0);
            } else if (ly[i].kind == MN_LAYER_EMBEDDING) {
                w = mn__next_param(S, ly[i].in, ly[i].out, 1, 0);
            } else if (ly[i].kind == MN_LAYER_NORM) {
                w = mn__next_param(S, ly[i].out, 0, 1, 0);
                mn__next_param(S, ly[i].out, 0, 1, 0);
            }
            S->block_start[i] = w;
            continue;
        }
        w = pidx[i];
        switch (ly[i].kind) {
        case MN_LAYER_LINEAR: {
            uint64_t rows = mn__tensor_numel(S, x) / ly[i].in;
            y = mn__tensor_new(S, mn__prod(S, rows, ly[i].out), c->a_esz, MN_CAT_ACTIVATIONS);
            d = mn__op_desc_of(y);
            d.in[0] = x, d.saved[0] = x, d.param[0] = w, d.param[1] = ly[i].bias ? w + 1 : MN__NONE;
            mn__op_rec(S, &d);
            break;
        }
        case MN_LAYER_EMBEDDING:
            y = mn__tensor_new(S, mn__prod(S, c->ntok, ly[i].out), c->a_esz, MN_CAT_ACTIVATIONS);
            d = mn__op_desc_of(y);
            d.saved[0] = x, d.param[0] = w;
            mn__op_rec(S, &d);
            break;
        case MN_LAYER_NORM: {
            uint32_t st = mn__tensor_new(S, c->ntok * 2, 4, MN_CAT_ACTIVATIONS);
            y = mn__tensor_new(S, mn__tensor_numel(S, x), mn__elem_size(S, x), MN_CAT_ACTIVATIONS);
            d = mn__op_desc_of(y);
            d.in[0] = x, d.saved[0] = x, d.saved[1] = st, d.param[0] = w, d.param[1] = w + 1;
            mn__op_rec(S, &d);
            mn__drop(S, st);
            break;
        }
        case MN_LAYER_ACTIVATION: y = mn__activation(S, x); break;
        case MN_LAYER_DROPOUT: y = mn__dropout(S, x, 0.1f); break;
        default: y = mn__identity(S, x); break;
        }
        mn__drop(S, x);
        x = y;
        mn__part_mark(S, i + 1, &mark);
    }
    if (S->counting || S->err) return MN__NONE;
    loss = mn__tensor_new(S, 1, 4, MN_CAT_ACTIVATIONS);  // loss = out.sum(); the caller holds out
    mn__op_rec_from(S, loss, x);
    S->hold = x;
    mn__part_mark(S, c->m.stack_len + 1, &mark);
    return loss;
}

// ---- backward, optimizer, the step --------------------------------------------------------------

// Bytes per GPU of a state that ZeRO shards over the GPUs from `stage` on.
MN__PRIVATE uint64_t mn__shard(const mn__cfg *c, uint64_t bytes, uint32_t stage) {
    return c->zero >= stage ? (bytes + c->gpus - 1) / c->gpus : bytes;
}

// Persistent gradient bytes per GPU. DeepSpeed ZeRO 1/2 also keep an fp32 gradient partition
// (its estimator's 2 + 18/N bytes per parameter for stage 2).
MN__PRIVATE uint64_t mn__grad_bytes(mn__sim *S, const mn__param *P) {
    const mn__cfg *c = S->c;
    uint64_t g = mn__shard(c, mn__prod(S, P->numel, c->g_esz), 2);
    if (c->s.framework == MN_FW_DEEPSPEED && c->fw_master && (c->zero == 1 || c->zero == 2))
        g += mn__shard(c, mn__prod(S, P->numel, 4), 1);
    return g;
}

// The separate fp32 master copy per GPU (deepspeed, megatron, memanat mixed precision), 0 if none.
MN__PRIVATE uint64_t mn__master_bytes(mn__sim *S, const mn__param *P) {
    return S->c->fw_master ? mn__shard(S->c, mn__prod(S, P->numel, 4), 1) : 0;
}

// Produces the gradient of a parameter in backward: a new tensor that becomes .grad when there
// is none (AccumulateGrad steals it) or is added and freed; partitioned and preallocated buffers
// receive the produced gradient and free it (megatron accumulates in place).
MN__PRIVATE void mn__param_grad(mn__sim *S, uint32_t pi, int cast16) {
    S->why = "parameter gradients (tied weights summed out of place)";
    mn__cfg *c = S->c;
    mn__param *P = &S->params[pi];
    uint32_t h16 = MN__NONE;
    uint64_t full;
    if (!P->trainable) return;
    if (cast16) h16 = mn__tensor_new(S, P->numel, 2, MN_CAT_TEMPORARY);  // grad of the 16-bit copy
    full = mn__prod(S, P->numel, c->g_esz);
    if (c->grads_prealloc || c->zero >= 2 || c->s.offload > MN_OFFLOAD_NONE) {
        if (c->s.framework != MN_FW_MEGATRON)
            mn__transient(S, mn__prod(S, P->numel, cast16 ? 2 : c->g_esz), MN_CAT_TEMPORARY);
        if (P->grad == MN__NONE && !c->grads_prealloc && c->s.offload <= MN_OFFLOAD_NONE)
            P->grad = mn__tensor_new(S, mn__shard(c, full, 2), 1, MN_CAT_GRADIENTS);
    } else if (P->grad == MN__NONE) {
        P->grad = mn__tensor_new(S, P->numel, c->g_esz, MN_CAT_GRADIENTS);
        P->grad_pass = S->bw_pass;
    } else if (c->t2 && P->grad_pass == S->bw_pass) {
        // a weight used twice in one graph (tied embedding and LM head): both gradients meet in
        // the AccumulateGrad node's input buffer, which sums them out of place
        // (torch/csrc/autograd/input_buffer.cpp, InputBuffer::add; the first gradient is a
        // transposed view, so it cannot be accumulated in place): old, new and the sum are alive
        // together, then the sum becomes .grad.
        uint32_t g2 = mn__tensor_new(S, P->numel, c->g_esz, MN_CAT_TEMPORARY);
        uint32_t sum = mn__tensor_new(S, P->numel, c->g_esz, MN_CAT_GRADIENTS);
        mn__drop(S, g2), mn__drop(S, P->grad);
        P->grad = sum;
    } else {
        mn__transient(S, full, MN_CAT_TEMPORARY);
    }
    mn__drop(S, h16);
}

MN__PRIVATE void mn__backward(mn__sim *S, uint64_t lo);

// Backward of one recorded op (see the section comment); op points to the caller's copy, not
// into the tape, which a recompute may grow (and move).
MN__PRIVATE void mn__backward_op(mn__sim *S, const mn__op *op) {
    S->why = "backward: activation gradients and temporaries";
    mn__cfg *c = S->c;
    int i;
    if (op->recomp_block != MN__NONE) {  // re-run a checkpointed block, recording, then its backward
        uint64_t mark = S->nops;
        uint32_t y2, cur = S->cursor;
        y2 = mn__block(S, op->in[0], op->recomp_block, op->nin > 1 ? op->in[1] : MN__NONE);
        if (c->amp) mn__amp_clear(S);
        S->cursor = cur;
        if (S->err || y2 == MN__NONE) return;
        S->tensors[y2].grad = S->tensors[op->out].grad;
        S->tensors[op->out].grad = MN__NONE;
        mn__drop(S, y2);
        mn__backward(S, mark);
        for (i = 0; i < op->nsaved; i++) mn__drop(S, op->saved[i]);
        return;
    }
    for (i = 0; i < op->nin; i++) {
        mn__tensor *t = &S->tensors[op->in[i]];
        if (!t->requires_grad) continue;
        if (t->grad == MN__NONE) {
            uint32_t g = mn__tensor_new(S, t->bytes / t->elem_size, t->elem_size, MN_CAT_TEMPORARY);
            S->tensors[op->in[i]].grad = g;
        } else {
            mn__transient(S, t->bytes, MN_CAT_TEMPORARY);
        }
    }
    for (i = 0; i < op->nparam; i++) mn__param_grad(S, op->param[i], op->cast16);
    mn__transient(S, op->bwd_temp, MN_CAT_TEMPORARY);
    if (S->tensors[op->out].grad != MN__NONE) {
        mn__drop(S, S->tensors[op->out].grad);
        S->tensors[op->out].grad = MN__NONE;
    }
    for (i = 0; i < op->nsaved; i++) mn__drop(S, op->saved[i]);
}

MN__PRIVATE void mn__backward(mn__sim *S, uint64_t lo) {
    uint64_t i;
    for (i = S->nops; i-- > lo && !S->err;) {
        mn__op op = S->ops[i];  // by value: a recompute may grow the tape
        uint32_t k;
        S->nops = i + 1;
        mn__backward_op(S, &op);
        if (S->err) break;
        mn__unpin(S, op.out);  // the op leaves the tape
        for (k = 0; k < op.nin; k++) mn__unpin(S, op.in[k]);
    }
    if (!S->err) S->nops = lo;
}

// One backward pass from the loss (mn__backward recurses for checkpointed blocks).
MN__PRIVATE void mn__backward_pass(mn__sim *S) {
    S->bw_pass++;
    mn__backward(S, 0);
}

// bitsandbytes storage, tensor by tensor, as its sources make them:
//   4-bit: bitsandbytes/functional.py quantize_4bit (read in 0.43.1, 0.43.2 and 0.50.2): blocksize
//     64 (Params4bit and quantize_4bit default); out = (n + 1) // 2 uint8 (two codes a byte,
//     quant_storage uint8); absmax fp32 [ceil(n / 64)] (the "bitsandbytes::quantize_4bit" fake in
//     _ops.py: blocks = -(n // -blocksize)); code = get_4bit_type(), a fresh 16-entry fp32 tensor
//     per weight. compress_statistics (double quantization): offset = absmax.mean() (fp32 scalar),
//     quantize_blockwise(absmax - offset, blocksize=256) -> uint8 [ceil(n / 64)] and state2 with
//     absmax fp32 [ceil(blocks / 256)] and code: 0.50.2 copies the 256-entry fp32 dynamic map per
//     weight (code.to(device, copy=True)); 0.43.1 and 0.43.2 share one map (not counted). The
//     release between them that started copying is not known here: from 0.44 it is counted.
//     Per weight: 4 + 32/64 = 4.5 bits (+ small tensors); double-quantized 4 + 8/64 + 32/16384 =
//     4.127 bits, the QLoRA paper's 0.127 bit of constants.
//   int8: bitsandbytes/nn/modules.py Int8Params / autograd MatMul8bitLt (int8_vectorwise_quant):
//     CB int8 [rows, cols] and SCB fp32 [rows].
MNIMPL mn_result mn_quant_storage(mn_quant q, uint64_t rows, uint64_t cols, uint32_t bnb_version,
                                  mn_quant_tensors *out) {
    uint64_t n, nb, *f[6];
    int i;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    if (rows == 0 || cols == 0 || q <= MN_QUANT_NONE || q >= MN_QUANT_COUNT)
        return MN_ERR_INVALID_ARG;
    if (mn_mul_u64(rows, cols, &n) != MN_OK) return MN_ERR_OVERFLOW;
    if (q == MN_QUANT_INT8) {
        out->data = n;
        if (mn_mul_u64(rows, 4, &out->absmax) != MN_OK) return MN_ERR_OVERFLOW;
    } else {
        int dq = q == MN_QUANT_NF4_DQ || q == MN_QUANT_FP4_DQ;
        out->data = n / 2 + n % 2;
        nb = n / 64 + (n % 64 != 0);
        out->code = 16 * 4;
        if (!dq && mn_mul_u64(nb, 4, &out->absmax) != MN_OK) return MN_ERR_OVERFLOW;
        if (dq) {
            out->absmax = nb, out->offset = 4;
            out->absmax2 = (nb / 256 + (nb % 256 != 0)) * 4;
            out->code2 = bnb_version == 0 || bnb_version >= 4400 ? 256 * 4 : 0;
        }
    }
    f[0] = &out->data, f[1] = &out->absmax, f[2] = &out->code;
    f[3] = &out->offset, f[4] = &out->absmax2, f[5] = &out->code2;
    for (i = 0; i < 6; i++) {
        if (mn_add_u64(out->total, *f[i], &out->total) != MN_OK) return MN_ERR_OVERFLOW;
        out->count += *f[i] != 0;
    }
    return MN_OK;
}

MN__PRIVATE mn_quant_tensors mn__quant_tensors(mn__sim *S, const mn__param *P) {
    mn_quant_tensors t;
    if (mn_quant_storage(S->c->s.quant, P->dims[0], P->dims[1], S->c->s.bnb_version, &t) != MN_OK)
        S->err = MN_ERR_OVERFLOW;
    return t;
}

// Bytes of a parameter as stored on one GPU (quantized base weights: mn_quant_storage).
MN__PRIVATE uint64_t mn__weight_bytes(mn__sim *S, const mn__param *P) {
    const mn__cfg *c = S->c;
    uint64_t b;
    if (P->quant) b = mn__quant_tensors(S, P).total;
    else b = mn__prod(S, P->numel, c->w_esz);
    return mn__shard(c, b, 3);
}

MN__PRIVATE uint64_t mn__state_bytes(mn__sim *S, const mn__param *P) {
    const mn__cfg *c = S->c;
    mn_optim_desc d;
    uint64_t b = 0;
    memset(&d, 0, sizeof d);
    d.kind = c->s.optim;
    if (mn_optim_state_bytes(&d, P->dims, P->ndim, &b) != MN_OK) {
        S->err = MN_ERR_OVERFLOW;
        return 0;
    }
    if (c->state_half && c->s.optim != MN_OPTIM_ADAMW_8BIT) b /= 2;  // zeros_like(16-bit param)
    return mn__shard(c, b, 1);
}

// Per-tensor temporary of the optimizer step: Adafactor's squared gradient and update, Lion's
// update (both loops over tensors); AdamW's per-tensor loop (torch/optim/adam.py,
// _single_tensor_adam): denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps) holds
// the sqrt and the quotient at once. Fused kernels (8-bit AdamW, --optim-impl fused, the
// engines) need none; SGD updates in place (_single_tensor_sgd: param.add_(grad)).
MN__PRIVATE uint64_t mn__optim_temp(mn__sim *S, const mn__param *P) {
    const mn__cfg *c = S->c;
    uint64_t e = c->state_half ? 2 : 4;
    if (c->s.framework != MN_FW_HF || c->s.offload > MN_OFFLOAD_NONE) return 0;  // fused optimizers
    switch (c->s.optim) {
    case MN_OPTIM_ADAMW:
        if (c->impl != MN_OPTIM_IMPL_LOOP) return 0;
        return mn__prod(S, P->numel, 2 * e);  // torch 1.10 _functional.adam: the same two
    case MN_OPTIM_LION: return mn__prod(S, P->numel, e);
    case MN_OPTIM_ADAFACTOR: return mn__prod3(S, P->numel, e, 2);
    default: return 0;
    }
}

// Whole-group temporaries of a foreach step (torch/optim/adam.py, _multi_tensor_adam): after
// the in-place moment updates, exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs) makes
// one buffer per parameter of the group (all trainable parameters of one device and dtype),
// alive together until _foreach_addcdiv_ has updated the parameters. SGD's foreach step
// (_multi_tensor_sgd, no nesterov) works in place.
MN__PRIVATE uint64_t mn__optim_group_temp(mn__sim *S) {
    const mn__cfg *c = S->c;
    uint64_t i, b = 0;
    if (c->s.framework != MN_FW_HF || c->s.offload > MN_OFFLOAD_NONE) return 0;
    if (c->impl != MN_OPTIM_IMPL_FOREACH || c->s.optim != MN_OPTIM_ADAMW) return 0;
    for (i = 0; i < S->np; i++)
        if (S->params[i].trainable)
            b += mn__prod(S, S->params[i].numel, c->state_half ? 2 : 4);
    return b;
}

MN__PRIVATE void mn__alloc_states(mn__sim *S, uint64_t i) {
    mn__param *P = &S->params[i];
    uint64_t b;
    if (!P->trainable || P->has_state) return;
    P->has_state = 1;
    b = mn__state_bytes(S, P);
    if (b == 0 || S->c->s.offload > MN_OFFLOAD_NONE) return;
    if (S->c->s.optim == MN_OPTIM_ADAMW || S->c->s.optim == MN_OPTIM_ADAMW_8BIT) {
        mn__tensor_new(S, b / 2, 1, MN_CAT_OPTIMIZER);  // exp_avg, exp_avg_sq: two tensors
        mn__tensor_new(S, b - b / 2, 1, MN_CAT_OPTIMIZER);
    } else {
        mn__tensor_new(S, b, 1, MN_CAT_OPTIMIZER);
    }
}

// Persistent allocations at load time, in module order.
MN__PRIVATE void mn__load(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t i;
    S->phase = MN_PHASE_LOAD;
    S->why = "parameters, master weights, preallocated state";
    for (i = 0; i < S->np; i++) {
        mn_category cat = S->params[i].trainable ? c->param_cat : MN_CAT_WEIGHTS;
        if (S->params[i].quant && c->zero < 3) {  // each quant_state tensor on its own
            mn_quant_tensors t = mn__quant_tensors(S, &S->params[i]);
            uint64_t part[6];
            int k;
            part[0] = t.data, part[1] = t.absmax, part[2] = t.code;
            part[3] = t.offset, part[4] = t.absmax2, part[5] = t.code2;
            for (k = 0; k < 6; k++)
                if (part[k]) mn__tensor_new(S, part[k], 1, MN_CAT_WEIGHTS);
        } else if (c->s.offload != MN_OFFLOAD_ALL) {
            mn__tensor_new(S, mn__weight_bytes(S, &S->params[i]), 1, cat);
        }
    }
    if (c->s.infer) return;
    for (i = 0; i < S->np; i++) {
        mn__param *P = &S->params[i];
        if (!P->trainable) continue;
        if (c->fw_master && c->s.offload <= MN_OFFLOAD_NONE)
            mn__tensor_new(S, mn__master_bytes(S, P), 1,
                           c->fw_master == 1 ? MN_CAT_OPTIMIZER : MN_CAT_MASTER_WEIGHTS);
        if (c->grads_prealloc && c->s.offload <= MN_OFFLOAD_NONE)
            P->grad = mn__tensor_new(S, mn__grad_bytes(S, P), 1, MN_CAT_GRADIENTS);
        if (c->grads_prealloc) mn__alloc_states(S, i);  // engines create state at init
    }
}

MN__PRIVATE void mn__optimizer_step(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t i;
    S->phase = MN_PHASE_OPTIMIZER;
    if (c->s.optim == MN_OPTIM_NONE) return;
    S->why = "optimizer state";
    for (i = 0; i < S->np; i++) mn__alloc_states(S, i);
    S->why = "optimizer step temporaries (foreach: whole group; loop: per tensor)";
    for (i = 0; i < S->np; i++)
        if (S->params[i].trainable)
            mn__transient(S, mn__optim_temp(S, &S->params[i]), MN_CAT_TEMPORARY);
    mn__transient(S, mn__optim_group_temp(S), MN_CAT_TEMPORARY);
    if (!c->grads_keep && !c->grads_prealloc) {
        for (i = 0; i < S->np; i++) {  // zero_grad(set_to_none=True)
            if (S->params[i].grad == MN__NONE) continue;
            mn__drop(S, S->params[i].grad);
            S->params[i].grad = MN__NONE;
        }
    }
    mn__release_outputs(S);  // the loop drops `out` after zero_grad
}

// One micro-batch: inputs, forward, backward.
MN__PRIVATE void mn__micro_batch(mn__sim *S) {
    mn__cfg *c = S->c;
    uint32_t ids, labels, mask = MN__NONE, loss;
    uint64_t prev = S->nouts;
    S->phase = MN_PHASE_FORWARD;
    S->why = "input ids, labels, loss";
    S->record = 1, S->training = 1, S->hold = MN__NONE, S->emb_out = S->ffn_out = MN__NONE;
    if (c->m.arch == MN_ARCH_STACK) {
        ids = mn__tensor_new(S, mn__prod(S, c->ntok, c->m.stack_in), c->a_esz, MN_CAT_ACTIVATIONS);
        labels = MN__NONE;
        loss = mn__stack_forward(S, ids);
    } else {
        ids = mn__tensor_new(S, c->ntok, 8, MN_CAT_ACTIVATIONS);
        labels = mn__tensor_new(S, c->m.head == MN_HEAD_CLASSIFICATION ? c->batch : c->ntok, 8,
                                MN_CAT_ACTIVATIONS);
        if (c->m.arch == MN_ARCH_ENCODER) mask = mn__tensor_new(S, c->ntok, 8, MN_CAT_ACTIVATIONS);
        loss = mn__forward(S, ids, labels);
    }
    if (prev && !S->err) {  // `out = model(...)` replaced the previous micro-batch's outputs
        uint64_t i;
        for (i = 0; i < prev; i++) mn__drop(S, S->outs[i]);
        memmove(S->outs, S->outs + prev, (size_t)(S->nouts - prev) * sizeof *S->outs);
        S->nouts -= prev;
    }
    if (c->s.loop == MN_LOOP_TRAINER) mn__release_outputs(S);  // compute_loss returns the loss
    if (c->amp) mn__amp_clear(S);
    if (S->err || loss == MN__NONE) return;
    S->phase = MN_PHASE_BACKWARD;
    {
        uint32_t g = mn__tensor_new(S, 1, 4, MN_CAT_TEMPORARY);  // first: S->tensors may move
        if (g != MN__NONE) S->tensors[loss].grad = g;
    }
    mn__backward_pass(S);
    mn__drop(S, loss), mn__drop(S, S->hold);
    mn__drop(S, ids), mn__drop(S, labels), mn__drop(S, mask);
}

// Inference: weights, a KV cache for prompt + new tokens (preallocated, like a static cache),
// and the prefill forward without autograd; logits only for the last position.
MN__PRIVATE void mn__generate(mn__sim *S) {
    mn__cfg *c = S->c;
    uint32_t ids, x, y, blk, dec0 = 0, mem = MN__NONE;
    uint64_t len, per;
    S->phase = MN_PHASE_PREFILL;
    S->record = 0, S->training = 0;
    len = c->s.prompt + c->s.new_tokens;
    per = mn__prod3(S, mn__prod(S, c->batch, len), c->kv_width, c->kv_esz);
    if (c->m.arch == MN_ARCH_ENCODER_DECODER) dec0 = (uint32_t)c->m.encoder_layers;
    for (blk = dec0; blk < c->nblocks && c->m.arch != MN_ARCH_ENCODER; blk++) {
        mn__tensor_new(S, per, 1, MN_CAT_KV_CACHE);
        mn__tensor_new(S, per, 1, MN_CAT_KV_CACHE);
    }
    ids = mn__tensor_new(S, c->ntok, 8, MN_CAT_ACTIVATIONS);
    x = mn__embeddings(S, ids, 1);
    for (blk = 0; blk < c->nblocks && !S->err; blk++) {
        if (dec0 && blk == dec0) {  // encoder done: the decoder starts from one token per sequence
            mem = x;
            c->seq = 1, c->ntok = c->batch;
            x = mn__embeddings(S, ids, 0);
        }
        y = mn__block(S, x, blk, mem);
        mn__drop(S, x);
        x = y;
    }
    mn__drop(S, mem);
    if (c->amp) mn__amp_clear(S);
    if (c->m.head == MN_HEAD_LM && !S->err) {
        uint64_t n = mn__prod(S, c->batch, c->m.vocab);
        uint32_t lg = mn__tensor_new(S, n, c->a_esz, MN_CAT_ACTIVATIONS);
        mn__transient(S, mn__prod3(S, c->batch, c->m.vocab, 4), MN_CAT_ACTIVATIONS);
        mn__drop(S, lg);
    }
    mn__drop(S, x), mn__drop(S, ids);
}

// ---- the memanat framework: trainer.c's allocation sequence -------------------------------------
// trainer.c takes every tensor from one caching allocator, so its statistics are reproduced by
// emitting its allocations and frees in its own order and replaying them through a cache with
// the same (default) configuration. Each function below mirrors one trainer function, named in
// its comment, call for call; the sizes come from the shared tables MN_GPT_PARAMS and
// MN_GPT_ACTS. Storage: fp32 4 bytes; with --precision fp16|bf16 the weights and the activations
// take 2 bytes (MN_GPT_ACTS rows marked fp32 and the probabilities stay fp32), every op computes
// on an fp32 view of what it reads (a temporary), and the block's weights are converted into one
// fp32 temporary while the block runs. Gradients, master weights and optimizer state are fp32.
// On a GPU (trainer.c --device cuda, c->memanat_gpu) the kernels read and write the storage type
// directly: no fp32 views, no weight temporaries; the gradients and the backward's temporaries
// are in the storage type too; the LM head keeps its logits (an activation) and the fused
// cross-entropy overwrites them with dlogits in the forward, so no probabilities are stored; the
// model holds a small buffer of per-tensor gradient norms (MN_CAT_OTHER) and takes the cuBLASLt
// workspace (the GPU table's cublas_workspace) and then the kernels' scratch, sized for
// attention's backward (mn_attention_scratch), from its cache (MN_CAT_WORKSPACE) after its
// parameters.

#define MN__GP_ENUM(name, rows, cols, init) MN__GP_##name,
enum { MN_GPT_PARAMS(MN__GP_ENUM) MN__GP_COUNT };
#undef MN__GP_ENUM
#define MN__GA_ENUM(name, numel, fp32) MN__GA_##name,
enum { MN_GPT_ACTS(MN__GA_ENUM) MN__GA_COUNT };
#undef MN__GA_ENUM
enum { MN__G_BLOCK, MN__G_EMBED, MN__G_HEAD };  // the trainer's weight groups (TR_G_*)

typedef struct mn__gt {  // tr_tensor: the storage and its fp32 view, tensor ids (MN__NONE: none)
    uint32_t data, f;
    uint64_t n;          // elements
    int half;            // stored in 16 bits (the view is then a temporary of its own)
} mn__gt;

typedef struct mn__gpt {  // tr_model, as far as memory goes
    mn__sim *S;
    uint64_t L, C, NH, T, V, B, N, HV;  // HV: rows of an untied head, 0 when tied
    uint64_t pn[MN__GP_COUNT];          // elements of each parameter tensor (stacked per layer)
    uint64_t an[MN__GA_COUNT];          // elements of each activation a block keeps
    int af[MN__GA_COUNT];               // the activation is stored in fp32 at every precision
    int half, ckpt;                     // 16-bit storage; MN_CKPT_NONE, _SELECTIVE, _FULL
    int gpu;                            // trainer.c --device cuda: no views, 16-bit gradients
    uint32_t tesz;                      // bytes per element of a backward temporary
    uint32_t wview;                     // tr_model.wview: the fp32 weights one part reads
    mn__gt *x;                          // [L + 1] the residual stream
    mn__gt *acts;                       // [L][MN__GA_COUNT] what each block keeps
    mn__gt lnf, lnf_mean, lnf_rstd, probs;
    uint32_t logits, losses, dlosses, dlogits, dx, dln, dfch, datty, dqkv;  // tr_temps
} mn__gpt;

// Shapes and table sizes. The tables' largest products (the attention probabilities
// B*NH*T*T, the MLP activations N*4C, the logits N*V, the stacked MLP weights L*4C*C and the
// embedding V*C, in bytes) are checked once; every other entry divides one of them, so the
// tables' plain expressions cannot wrap.
MN__PRIVATE void mn__gpt_shapes(mn__gpt *G, mn__sim *S) {
    const mn__cfg *c = S->c;
    uint64_t L, C, NH, T, V, B, N, HV;
    G->S = S;
    L = G->L = c->m.layers, C = G->C = c->m.hidden, NH = G->NH = c->m.heads;
    T = G->T = c->seq, V = G->V = c->m.vocab, B = G->B = c->batch, N = G->N = c->ntok;
    HV = G->HV = c->m.tie_embeddings ? 0 : V;
    G->half = c->a_esz == 2, G->ckpt = c->s.checkpointing;
    G->gpu = c->memanat_gpu, G->tesz = G->gpu && G->half ? 2 : 4;
    G->wview = MN__NONE;
    mn__prod(S, mn__prod(S, mn__prod3(S, B, NH, T), T), 4);
    mn__prod3(S, N, 4 * C, 4);
    mn__prod3(S, N, V, 4);
    mn__prod3(S, mn__prod3(S, L, 4 * C, C), 4, 1);
    mn__prod3(S, V, C, 4);
    if (S->err) return;
#define MN__GP_SIZE(name, rows, cols, init) G->pn[MN__GP_##name] = (rows) * (cols);
    MN_GPT_PARAMS(MN__GP_SIZE)
#undef MN__GP_SIZE
#define MN__GA_SIZE(name, numel, fp32) G->an[MN__GA_##name] = (numel), G->af[MN__GA_##name] = fp32;
    MN_GPT_ACTS(MN__GA_SIZE)
#undef MN__GA_SIZE
    G->lnf.data = G->lnf_mean.data = G->lnf_rstd.data = G->probs.data = MN__NONE;
    G->lnf.f = G->lnf_mean.f = G->lnf_rstd.f = G->probs.f = MN__NONE;
    G->logits = G->losses = G->dlosses = G->dlogits = G->dx = MN__NONE;
    G->dln = G->dfch = G->datty = G->dqkv = MN__NONE;
}

// tr_new: a new activation of n elements (fp32 set: fp32 at every precision), opened. On a GPU
// the storage is its own view (half stays 0: nothing to open or close).
MN__PRIVATE void mn__gpt_new(mn__gpt *G, mn__gt *t, uint64_t n, int fp32) {
    int half = G->half && !fp32;
    t->n = n, t->half = half && !G->gpu;
    t->data = mn__tensor_new(G->S, n, half ? 2 : 4, MN_CAT_ACTIVATIONS);
    t->f = t->half ? mn__tensor_new(G->S, n, 4, MN_CAT_TEMPORARY) : t->data;
}

// tr_open: the fp32 view of a stored tensor, a temporary copy for a 16-bit one.
MN__PRIVATE void mn__gpt_open(mn__gpt *G, mn__gt *t) {
    if (t->f == MN__NONE && t->n) t->f = mn__tensor_new(G->S, t->n, 4, MN_CAT_TEMPORARY);
}

// tr_close: releases a 16-bit tensor's view.
MN__PRIVATE void mn__gpt_close(mn__gpt *G, mn__gt *t) {
    if (!t->half) return;
    mn__drop(G->S, t->f);
    t->f = MN__NONE;
}

// tr_free: the view, then the storage.
MN__PRIVATE void mn__gpt_free(mn__gpt *G, mn__gt *t) {
    mn__gpt_close(G, t);
    mn__drop(G->S, t->data);
    t->data = t->f = MN__NONE, t->n = 0, t->half = 0;
}

// tr_temp and tr_release: fp32 temporaries (on a GPU: in the storage type, tr_gpu_temp).
MN__PRIVATE uint32_t mn__gpt_temp(mn__gpt *G, uint64_t n) {
    return mn__tensor_new(G->S, n, G->tesz, MN_CAT_TEMPORARY);
}
MN__PRIVATE void mn__gpt_release(mn__gpt *G, uint32_t *id) {
    mn__drop(G->S, *id);
    *id = MN__NONE;
}

// tr_in_group: the parameters one part of the model reads.
MN__PRIVATE int mn__gpt_in_group(const mn__gpt *G, int i, int group) {
    if (group == MN__G_BLOCK) return i >= MN__GP_ln1w && i <= MN__GP_fcprojb;
    if (group == MN__G_EMBED) return i == MN__GP_wte || i == MN__GP_wpe;
    return i == MN__GP_lnfw || i == MN__GP_lnfb || i == (G->HV ? MN__GP_lmw : MN__GP_wte);
}

// tr_weights_open, tr_weights_close: with 16-bit weights, one fp32 temporary holding the
// group's weights (one layer's rows of the stacked block tensors).
MN__PRIVATE void mn__gpt_weights_open(mn__gpt *G, int group) {
    uint64_t total = 0;
    int i;
    if (!G->half || G->gpu) return;
    for (i = 0; i < MN__GP_COUNT; i++)
        if (mn__gpt_in_group(G, i, group))
            total += group == MN__G_BLOCK ? G->pn[i] / G->L : G->pn[i];  // layer l's rows
    G->wview = mn__gpt_temp(G, total);
}
MN__PRIVATE void mn__gpt_weights_close(mn__gpt *G) { mn__gpt_release(G, &G->wview); }

// tr_model_init: per parameter its 16-bit copy (half), its fp32 weights (the master when half)
// and its gradient (fp32; 16-bit on a GPU when half); then the input batch, tokens and targets
// int[B,T]; on a GPU (tr_gpu_init) one fp32 gradient norm per parameter tensor.
MN__PRIVATE void mn__gpt_model_init(mn__gpt *G) {
    mn__sim *S = G->S;
    uint64_t i;
    for (i = 0; i < S->np; i++) {
        uint64_t n = S->params[i].numel;
        if (G->half) mn__tensor_new(S, n, 2, MN_CAT_WEIGHTS);
        mn__tensor_new(S, n, 4, G->half ? MN_CAT_MASTER_WEIGHTS : MN_CAT_WEIGHTS);
        mn__tensor_new(S, n, G->tesz, MN_CAT_GRADIENTS);
    }
    mn__tensor_new(S, G->N, 4, MN_CAT_OTHER);
    mn__tensor_new(S, G->N, 4, MN_CAT_OTHER);
    if (G->gpu) mn__tensor_new(S, S->np, 4, MN_CAT_OTHER);
}

// tr_block_forward: block l's activations from x[l] (recompute: checkpointing's re-run, which
// makes no x[l + 1]); every view of a 16-bit model is released at the end of the block.
MN__PRIVATE void mn__gpt_block_forward(mn__gpt *G, uint64_t l, int recompute) {
    mn__gt *a = &G->acts[l * MN__GA_COUNT];
    int i;
    mn__gpt_weights_open(G, MN__G_BLOCK);
    mn__gpt_open(G, &G->x[l]);
    for (i = 0; i < MN__GA_COUNT; i++)
        if (i != MN__GA_att || G->ckpt != MN_CKPT_SELECTIVE)  // selective: no probabilities
            mn__gpt_new(G, &a[i], G->an[i], G->af[i]);
    if (!recompute) {
        mn__gpt_new(G, &G->x[l + 1], G->N * G->C, 0);
        mn__gpt_close(G, &G->x[l + 1]);
    }
    for (i = 0; i < MN__GA_COUNT; i++) mn__gpt_close(G, &a[i]);
    mn__gpt_close(G, &G->x[l]);
    mn__gpt_weights_close(G);
}

// tr_block_backward: the gradient temporaries of block l, each saved activation opened right
// before its first use and freed after its last.
MN__PRIVATE void mn__gpt_block_backward(mn__gpt *G, uint64_t l) {
    mn__gt *a = &G->acts[l * MN__GA_COUNT];
    uint64_t N = G->N, C = G->C;
    int i;
    mn__gpt_free(G, &G->x[l + 1]);
    if (G->ckpt == MN_CKPT_FULL) mn__gpt_block_forward(G, l, 1);
    mn__gpt_weights_open(G, MN__G_BLOCK);
    G->dfch = mn__gpt_temp(G, N * 4 * C);  // fc projection
    mn__gpt_open(G, &a[MN__GA_fch_gelu]);
    mn__gpt_free(G, &a[MN__GA_fch_gelu]);
    G->dln = mn__gpt_temp(G, N * C);  // fc with the GELU
    mn__gpt_open(G, &a[MN__GA_ln2]);
    mn__gpt_open(G, &a[MN__GA_fch]);
    mn__gpt_release(G, &G->dfch);
    mn__gpt_free(G, &a[MN__GA_fch]);
    mn__gpt_free(G, &a[MN__GA_ln2]);
    mn__gpt_open(G, &a[MN__GA_res2]);  // layernorm 2
    mn__gpt_free(G, &a[MN__GA_res2]);
    mn__gpt_free(G, &a[MN__GA_ln2_mean]);
    mn__gpt_free(G, &a[MN__GA_ln2_rstd]);
    G->datty = mn__gpt_temp(G, N * C);  // attention projection
    mn__gpt_open(G, &a[MN__GA_atty]);
    mn__gpt_free(G, &a[MN__GA_atty]);
    G->dqkv = mn__gpt_temp(G, N * 3 * C);  // attention
    mn__gpt_open(G, &a[MN__GA_qkv]);
    if (a[MN__GA_att].data != MN__NONE) mn__gpt_open(G, &a[MN__GA_att]);
    mn__gpt_release(G, &G->datty);
    mn__gpt_free(G, &a[MN__GA_att]);
    mn__gpt_free(G, &a[MN__GA_qkv]);
    mn__gpt_open(G, &a[MN__GA_ln1]);  // qkv
    mn__gpt_release(G, &G->dqkv);
    mn__gpt_free(G, &a[MN__GA_ln1]);
    mn__gpt_open(G, &G->x[l]);  // layernorm 1
    mn__gpt_close(G, &G->x[l]);
    mn__gpt_release(G, &G->dln);
    for (i = 0; i < MN__GA_COUNT; i++) mn__gpt_free(G, &a[i]);  // tr_acts_free: the statistics
    mn__gpt_weights_close(G);
}

// tr_forward, the embedding: x[0] = wte[tokens] + wpe.
MN__PRIVATE void mn__gpt_embedding_forward(mn__gpt *G) {
    mn__gpt_weights_open(G, MN__G_EMBED);
    mn__gpt_new(G, &G->x[0], G->N * G->C, 0);
    mn__gpt_close(G, &G->x[0]);
    mn__gpt_weights_close(G);
}

// tr_forward, the head: final layernorm, logits (a temporary), probabilities (kept, fp32). On a
// GPU (tr_gpu_head_forward): the logits are kept (they become dlogits in place), losses fp32.
MN__PRIVATE void mn__gpt_head_forward(mn__gpt *G) {
    uint64_t N = G->N;
    mn__gpt_weights_open(G, MN__G_HEAD);
    mn__gpt_new(G, &G->lnf, N * G->C, 0);
    mn__gpt_new(G, &G->lnf_mean, N, 1);
    mn__gpt_new(G, &G->lnf_rstd, N, 1);
    if (G->gpu) {
        mn__gpt_new(G, &G->probs, N * G->V, 0);  // the logits, then dlogits
        G->losses = mn__tensor_new(G->S, N, 4, MN_CAT_TEMPORARY);
        mn__gpt_release(G, &G->losses);
        return;
    }
    mn__gpt_open(G, &G->x[G->L]);
    mn__gpt_close(G, &G->x[G->L]);
    G->logits = mn__gpt_temp(G, N * G->V);
    mn__gpt_close(G, &G->lnf);
    mn__gpt_weights_close(G);
    mn__gpt_new(G, &G->probs, N * G->V, 1);
    G->losses = mn__gpt_temp(G, N);
    mn__gpt_release(G, &G->logits);
    mn__gpt_release(G, &G->losses);
}

// tr_backward, the head: dlogits, the head's and the final layernorm's backward, leaving dx.
// On a GPU (tr_gpu_head_backward) dlogits exist already (G->probs).
MN__PRIVATE void mn__gpt_head_backward(mn__gpt *G) {
    uint64_t N = G->N;
    if (G->gpu) {
        G->dln = mn__gpt_temp(G, N * G->C);
        mn__gpt_free(G, &G->probs);
        mn__gpt_free(G, &G->lnf);
        G->dx = mn__gpt_temp(G, N * G->C);
        mn__gpt_release(G, &G->dln);
        mn__gpt_free(G, &G->lnf_mean);
        mn__gpt_free(G, &G->lnf_rstd);
        return;
    }
    G->dlosses = mn__gpt_temp(G, N);
    G->dlogits = mn__gpt_temp(G, N * G->V);
    mn__gpt_release(G, &G->dlosses);
    mn__gpt_free(G, &G->probs);
    mn__gpt_weights_open(G, MN__G_HEAD);
    G->dln = mn__gpt_temp(G, N * G->C);
    mn__gpt_open(G, &G->lnf);
    mn__gpt_release(G, &G->dlogits);
    mn__gpt_free(G, &G->lnf);
    G->dx = mn__gpt_temp(G, N * G->C);
    mn__gpt_open(G, &G->x[G->L]);
    mn__gpt_close(G, &G->x[G->L]);
    mn__gpt_weights_close(G);
    mn__gpt_release(G, &G->dln);
    mn__gpt_free(G, &G->lnf_mean);
    mn__gpt_free(G, &G->lnf_rstd);
}

// tr_backward, the embedding: its gradients go straight into dwte, dwpe.
MN__PRIVATE void mn__gpt_embedding_backward(mn__gpt *G) {
    mn__gpt_release(G, &G->dx);
    mn__gpt_free(G, &G->x[0]);
}

// tr_forward: embedding, blocks (full checkpointing keeps x[l] only), head. Records the
// activation bytes of each part for mn_estimate_parts.
MN__PRIVATE void mn__gpt_forward(mn__gpt *G) {
    mn__sim *S = G->S;
    uint64_t l, mark = S->cur[MN_CAT_ACTIVATIONS];
    mn__gpt_embedding_forward(G);
    mn__part_mark(S, 0, &mark);
    for (l = 0; l < G->L && !S->err; l++) {
        mn__gpt_block_forward(G, l, 0);
        if (G->ckpt == MN_CKPT_FULL) {
            int i;
            for (i = 0; i < MN__GA_COUNT; i++) mn__gpt_free(G, &G->acts[l * MN__GA_COUNT + i]);
        }
        mn__part_mark(S, (uint32_t)l + 1, &mark);
    }
    mn__gpt_head_forward(G);
    mn__part_mark(S, (uint32_t)G->L + 1, &mark);
}

// tr_backward: head, blocks in reverse, embedding.
MN__PRIVATE void mn__gpt_backward(mn__gpt *G) {
    uint64_t l;
    mn__gpt_head_backward(G);
    for (l = G->L; l-- > 0 && !G->S->err;) mn__gpt_block_backward(G, l);
    mn__gpt_embedding_backward(G);
}

// tr_update at the first step: tr_optim_state_init makes one block of mn_optim_state_bytes()
// per parameter tensor (its stacked shape; none for plain SGD), after that step's backward.
MN__PRIVATE void mn__gpt_optim_init(mn__gpt *G) {
    mn__sim *S = G->S;
    uint64_t i, b;
    for (i = 0; i < S->np && !S->err; i++)
        if ((b = mn__state_bytes(S, &S->params[i])) != 0) mn__tensor_new(S, b, 1, MN_CAT_OPTIMIZER);
}

// The run: tr_model_init, then steps of K micro-batches (tr_accumulate) and the update. A
// micro-batch releases everything it allocates, so the allocated peaks are those of any
// micro-batch with the optimizer state present (from the first update on); the cache's
// segments settle within two micro-batches of the same allocations, so the trace holds
// min(K, 2) micro-batches, the state, then two more (the first two steps, or three when K = 1).
MN__PRIVATE void mn__gpt_run(mn__sim *S) {
    mn__cfg *c = S->c;
    mn__gpt G;
    uint64_t i, mb, nmb;
    memset(&G, 0, sizeof G);
    mn__gpt_shapes(&G, S);
    if (S->err) return;
    G.x = (mn__gt *)mn__alloc_array(S->al, (size_t)G.L + 1, sizeof *G.x);
    G.acts = (mn__gt *)mn__alloc_array(S->al, (size_t)G.L * MN__GA_COUNT, sizeof *G.acts);
    if (!G.x || !G.acts) {
        S->err = MN_ERR_OUT_OF_MEMORY;
        goto free_arrays;
    }
    for (i = 0; i <= G.L; i++) G.x[i].data = G.x[i].f = MN__NONE, G.x[i].n = 0, G.x[i].half = 0;
    for (i = 0; i < G.L * MN__GA_COUNT; i++)
        G.acts[i].data = G.acts[i].f = MN__NONE, G.acts[i].n = 0, G.acts[i].half = 0;
    S->phase = MN_PHASE_LOAD;
    mn__gpt_model_init(&G);
    if (c->cublas_workspace) mn__tensor_new(S, c->cublas_workspace, 1, MN_CAT_WORKSPACE);
    if (G.gpu) {  // tr_gpu_init_rest: the kernels' scratch, sized for attention's backward
        uint64_t scratch = 0;
        mn_result r = mn_attention_scratch(G.B, G.T, G.C, G.NH, G.half ? 2 : 4, 1,
                                           G.ckpt != MN_CKPT_SELECTIVE, &scratch);
        if (r != MN_OK) S->err = r;
        mn__tensor_new(S, scratch, 1, MN_CAT_WORKSPACE);
    }
    nmb = c->s.accum < 2 ? 1 : 2;
    for (mb = 0; mb < nmb + 2 && !S->err; mb++) {
        if (mb == nmb) {
            S->phase = MN_PHASE_OPTIMIZER;
            mn__gpt_optim_init(&G);
        }
        S->parts_on = S->parts && mb == nmb;  // the steady state
        S->phase = MN_PHASE_FORWARD;
        mn__gpt_forward(&G);
        S->phase = MN_PHASE_BACKWARD;
        mn__gpt_backward(&G);
        S->parts_on = 0;
    }
free_arrays:
    mn__free(S->al, G.x);
    mn__free(S->al, G.acts);
}

// ---- >>estimate/inputs: resolving the inputs ----------------------------------------------------

// Logs the reason and returns MN_ERR_INVALID_ARG.
#define MN__INVALID(lg, ...)                                                                       \
    do {                                                                                           \
        mn__log(lg, MN_LOG_ERROR, __VA_ARGS__);                                                    \
        return MN_ERR_INVALID_ARG;                                                                 \
    } while (0)

// Exact parameter count of a Llama-like shape (used to size a model known only by --params).
MN__PRIVATE uint64_t mn__guess_count(uint64_t L, uint64_t h, uint64_t V) {
    return L * 12 * h * h + 2 * V * h;
}

MN__PRIVATE mn_result mn__resolve_model(const mn_model *in, const mn_logger *lg, mn_model *m) {
    *m = *in;
    if (m->arch == MN_ARCH_DEFAULT) m->arch = MN_ARCH_DECODER;
    if ((unsigned)m->arch >= MN_ARCH_COUNT)
        MN__INVALID(lg, "model: unknown architecture %d", (int)m->arch);
    if (m->arch == MN_ARCH_STACK) {
        uint32_t i;
        if (!m->stack || m->stack_len == 0)
            MN__INVALID(lg, "model: a custom stack needs at least one layer");
        if (m->stack_len > (1u << 20))
            MN__INVALID(lg, "model: a custom stack of %u layers (want up to 1048576)",
                        m->stack_len);
        for (i = 0; i < m->stack_len; i++) {
            const mn_layer *l = &m->stack[i];
            if (l->shared_with > i)
                MN__INVALID(lg, "model: layer %u shares weights with a later layer %u", i + 1,
                            l->shared_with);
            if (l->out == 0 || l->out > (1ull << 24) || l->in > (1ull << 24))
                MN__INVALID(lg, "model: layer %u has width %llu (want 1..16777216)", i + 1,
                            (unsigned long long)l->out);
            if (l->kind == MN_LAYER_LINEAR && l->in == 0)
                MN__INVALID(lg, "model: linear layer %u has no input width", i + 1);
        }
        if (m->stack_in == 0)
            m->stack_in = m->stack[0].kind == MN_LAYER_EMBEDDING ? 1 : m->stack[0].in;
        if (m->stack_in == 0) m->stack_in = m->stack[0].out;
        if (!m->name[0])
            snprintf(m->name, sizeof m->name, "custom stack of %u layers", m->stack_len);
        if (m->dtype == MN_DTYPE_DEFAULT) m->dtype = MN_FP32;
        return MN_OK;
    }
    if (m->layers == 0 && m->hidden == 0 && m->params) {  // only a count: a Llama-like shape
        uint64_t N = m->params, L, h, V = 32000;
        double l3 = cbrt((double)N / (12.0 * 128.0 * 128.0));
        L = l3 < 1.0 ? 1 : l3 > 4096.0 ? 4096 : (uint64_t)l3;  // beyond: the rest is one matrix
        h = 128 * L;
        if (N < 2000000000ull) V = 8192;
        while (h > 128 && mn__guess_count(L, h, V) > N) h -= 128;
        m->arch = MN_ARCH_DECODER, m->layers = L, m->hidden = h, m->heads = h / 128;
        m->kv_heads = 0, m->head_dim = 128, m->ffn = h * 8 / 3, m->vocab = V;
        m->norm = MN_NORM_RMSNORM, m->act = MN_ACT_SILU, m->posemb = MN_POS_ROPE;
        m->gated_mlp = 1, m->final_norm = 1, m->tie_embeddings = 0;
        if (!m->name[0])
            snprintf(m->name, sizeof m->name, "%.3gB parameters (shape guessed)", (double)N / 1e9);
    }
    if (m->layers == 0 || m->layers > 10000)
        MN__INVALID(lg, "model: layers %llu (want 1..10000)", (unsigned long long)m->layers);
    if (m->hidden == 0 || m->hidden > (1ull << 20))
        MN__INVALID(lg, "model: hidden size %llu (want 1..1048576)", (unsigned long long)m->hidden);
    if (m->heads == 0 || m->heads > m->hidden)
        MN__INVALID(lg, "model: %llu attention heads for hidden size %llu",
                    (unsigned long long)m->heads, (unsigned long long)m->hidden);
    if (m->kv_heads == 0) m->kv_heads = m->heads;
    if (m->kv_heads > m->heads || m->heads % m->kv_heads)
        MN__INVALID(lg, "model: %llu key/value heads do not divide %llu heads",
                    (unsigned long long)m->kv_heads, (unsigned long long)m->heads);
    if (m->head_dim == 0) {
        if (m->hidden % m->heads)
            MN__INVALID(lg, "model: hidden size %llu is not a multiple of %llu heads",
                        (unsigned long long)m->hidden, (unsigned long long)m->heads);
        m->head_dim = m->hidden / m->heads;
    }
    if (m->head_dim > 65536)
        MN__INVALID(lg, "model: head dimension %llu (want 1..65536)",
                    (unsigned long long)m->head_dim);
    if (m->ffn == 0) m->ffn = 4 * m->hidden;
    if (m->ffn > (1ull << 24))
        MN__INVALID(lg, "model: MLP width %llu (want up to 16777216)", (unsigned long long)m->ffn);
    if (m->vocab == 0 || m->vocab > (1ull << 26))
        MN__INVALID(lg, "model: vocabulary %llu (want 1..67108864)", (unsigned long long)m->vocab);
    if (m->arch == MN_ARCH_ENCODER_DECODER && m->encoder_layers == 0) m->encoder_layers = m->layers;
    if (m->encoder_layers > 10000)
        MN__INVALID(lg, "model: encoder layers %llu (want up to 10000)",
                    (unsigned long long)m->encoder_layers);
    if (m->posemb == MN_POS_DEFAULT) m->posemb = MN_POS_LEARNED;
    if (m->posemb == MN_POS_LEARNED && m->max_positions == 0) m->max_positions = 512;
    if (m->max_positions > (1ull << 24))
        MN__INVALID(lg, "model: %llu positions (want up to 16777216)",
                    (unsigned long long)m->max_positions);
    if (m->type_vocab > (1ull << 20))
        MN__INVALID(lg, "model: %llu token types (want up to 1048576)",
                    (unsigned long long)m->type_vocab);
    if (m->rel_buckets == 0) m->rel_buckets = 32;
    if (m->num_labels == 0) m->num_labels = 2;
    if (m->num_labels > (1ull << 24))
        MN__INVALID(lg, "model: %llu labels (want 1..16777216)", (unsigned long long)m->num_labels);
    if (m->norm == MN_NORM_DEFAULT) m->norm = MN_NORM_LAYERNORM;
    if (m->act == MN_ACT_DEFAULT) m->act = m->gated_mlp ? MN_ACT_SILU : MN_ACT_GELU;
    if (m->head == MN_HEAD_DEFAULT) m->head = MN_HEAD_LM;
    if (m->dtype == MN_DTYPE_DEFAULT) m->dtype = MN_FP32;
    if ((unsigned)m->norm >= MN_NORM_COUNT || (unsigned)m->act >= MN_ACT_COUNT ||
        (unsigned)m->posemb >= MN_POS_COUNT || (unsigned)m->head >= MN_HEAD_COUNT ||
        (unsigned)m->dtype >= MN_DTYPE_COUNT)
        MN__INVALID(lg, "model: an enum field is out of range");
    if (!(m->dropout >= 0.0f && m->dropout < 1.0f) ||
        !(m->attn_dropout >= 0.0f && m->attn_dropout < 1.0f))
        MN__INVALID(lg, "model: dropout probabilities must be in [0, 1)");
    if (m->arch == MN_ARCH_ENCODER && m->head != MN_HEAD_LM) m->tie_embeddings = 0;
    if (!m->name[0]) snprintf(m->name, sizeof m->name, "custom %s", mn_arch_name(m->arch));
    return MN_OK;
}

// Logs the reason and returns MN_ERR_UNSUPPORTED.
#define MN__UNSUPPORTED(lg, ...)                                                                   \
    do {                                                                                           \
        mn__log(lg, MN_LOG_ERROR, __VA_ARGS__);                                                    \
        return MN_ERR_UNSUPPORTED;                                                                 \
    } while (0)

// --framework memanat predicts trainer.c, which trains one model on one device: the GPT of
// mn_gpt_model() at its own sequence length, in fp32 or mixed fp16/bf16, with an optimizer, no
// adapters, no sharding. Anything else is MN_ERR_UNSUPPORTED, with the first difference logged.
MN__PRIVATE mn_result mn__resolve_memanat(const mn_model *m, const mn_setup *s,
                                          const mn_logger *lg) {
    mn_model raw, g;
    if (m->arch != MN_ARCH_DECODER || m->head_dim * m->heads != m->hidden ||
        mn_gpt_model(m->layers, m->hidden, m->heads, m->max_positions ? m->max_positions : 1,
                     m->vocab, m->tie_embeddings, &raw) != MN_OK ||
        mn__resolve_model(&raw, lg, &g) != MN_OK)
        MN__UNSUPPORTED(lg, "--framework memanat models trainer.c's GPT (a decoder whose heads "
                        "split the width), not %s", m->name);
    // field, what the trainer has
#define MN__GPT_FIELDS(X) \
    X(kv_heads, "as many key/value heads as heads", 1) X(ffn, "an MLP of 4 x the width", 1) \
    X(max_positions, "learned positions", 1) X(type_vocab, "no token types", 1) \
    X(norm, "layernorm", 0) X(act, "the tanh GELU", 0) X(posemb, "learned positions", 0) \
    X(head, "a language-model head", 0) X(gated_mlp, "no gated MLP", 0) \
    X(qkv_bias, "biases", 0) X(out_bias, "biases", 0) X(mlp_bias, "biases", 0) \
    X(pooler, "no pooler", 0) X(final_norm, "a final layernorm", 0) \
    X(embed_norm, "no embedding norm", 0) X(lm_transform, "no head transform", 0) \
    X(post_norm, "pre-norm blocks", 0) X(params, "exactly its table's parameters", 1)
#define MN__GPT_FIELD(f, what, count) \
    if ((uint64_t)m->f != (uint64_t)g.f) { \
        if (count) \
            MN__UNSUPPORTED(lg, "--framework memanat models trainer.c's GPT, which has %s: " \
                            "%s's " #f " is %llu (the trainer's %llu)", what, m->name, \
                            (unsigned long long)m->f, (unsigned long long)g.f); \
        MN__UNSUPPORTED(lg, "--framework memanat models trainer.c's GPT, which has %s; %s " \
                        "differs in its " #f, what, m->name); \
    }
    if (m->posemb != MN_POS_LEARNED) g.max_positions = 0;  // reported as posemb below
    MN__GPT_FIELDS(MN__GPT_FIELD)
#undef MN__GPT_FIELD
#undef MN__GPT_FIELDS
    if (m->dropout != 0.0f || m->attn_dropout != 0.0f)
        MN__UNSUPPORTED(lg, "--framework memanat: trainer.c's GPT has no dropout (%s has %g, %g)",
                        m->name, (double)m->dropout, (double)m->attn_dropout);
    if (s->seq != m->max_positions)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer's sequence is its position table "
                        "(--seq %llu with %llu positions)", (unsigned long long)s->seq,
                        (unsigned long long)m->max_positions);
    if (s->infer)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer has no generation (--infer)");
    if (s->precision != MN_PREC_FP32 && s->precision != MN_PREC_FP16 &&
        s->precision != MN_PREC_BF16)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer keeps fp32 master weights, gradients "
                        "and state (--precision fp32, fp16 or bf16, not %s)",
                        mn_precision_name(s->precision));
    if (s->optim == MN_OPTIM_NONE)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer always steps an optimizer");
    if (s->lora_rank || s->quant > MN_QUANT_NONE || s->trainable_params)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer trains every weight (no LoRA, "
                        "quantization or adapters)");
    if (s->zero_stage || s->gpus > 1 || s->offload > MN_OFFLOAD_NONE)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer runs on one device (no ZeRO, "
                        "data parallelism or offload)");
    if (s->attention != MN_ATTN_EAGER)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer keeps the attention probabilities "
                        "(eager), not --attention %s", mn_attn_name(s->attention));
    if (s->grads != MN_GRADS_KEEP)
        MN__UNSUPPORTED(lg, "--framework memanat: the trainer keeps its gradients and zeroes them "
                        "in place");
    return MN_OK;
}

// The bitsandbytes fields: a version needs bitsandbytes quantization; a quantized head needs a
// head of its own (bitsandbytes replaces nn.Linear modules, never the embedding a tied head uses).
MN__PRIVATE mn_result mn__resolve_quant(const mn_setup *s, const mn_model *m,
                                        const mn_logger *lg) {
    if (s->bnb_version > 999999)
        MN__INVALID(lg, "--bnb-version %u is out of range (want major*10000 + minor*100 + patch)",
                    s->bnb_version);
    if (s->bnb_version && s->quant <= MN_QUANT_NONE)
        MN__INVALID(lg, "--bnb-version %u.%u.%u applies to bitsandbytes quantization: add --quant",
                    s->bnb_version / 10000, s->bnb_version / 100 % 100, s->bnb_version % 100);
    if (s->quant_head && s->quant <= MN_QUANT_NONE)
        MN__INVALID(lg, "--quant-head yes needs --quant");
    if (s->quant_head && (m->head != MN_HEAD_LM || m->tie_embeddings || m->arch == MN_ARCH_STACK))
        MN__INVALID(lg, "--quant-head yes: the model has no LM head of its own (%s)",
                    m->tie_embeddings ? "tied to the embedding, which bitsandbytes never quantizes"
                                      : "not an LM head");
    return MN_OK;
}

MN__PRIVATE mn_result mn__resolve(const mn_model *model, const mn_setup *setup, mn__cfg *c,
                                  mn_gpu *gpu) {
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
    if (s->batch > (1ull << 32))
        MN__INVALID(lg, "--batch %llu is out of range (want 1..4294967296)",
                    (unsigned long long)s->batch);
    if (s->seq == 0 && m->arch == MN_ARCH_STACK) s->seq = 1;
    if (s->seq == 0 && s->framework == MN_FW_MEMANAT) s->seq = m->max_positions;  // the trainer's T
    if (s->seq == 0)  // 512, or fewer positions of a learned table
        s->seq = m->posemb == MN_POS_LEARNED && m->max_positions < 512 ? m->max_positions : 512;
    if (s->seq > (1ull << 26))
        MN__INVALID(lg, "--seq %llu is out of range (want 1..67108864)",
                    (unsigned long long)s->seq);
    if (m->posemb == MN_POS_LEARNED && m->arch != MN_ARCH_STACK && s->seq > m->max_positions &&
        !s->infer)
        MN__INVALID(lg, "--seq %llu is out of range (want 1..%llu, the model's positions)",
                    (unsigned long long)s->seq, (unsigned long long)m->max_positions);
    if (s->accum == 0) s->accum = 1;
    if (s->accum > (1ull << 20))
        MN__INVALID(lg, "--accum %llu is out of range (want 1..1048576)",
                    (unsigned long long)s->accum);
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
        MN__INVALID(lg, "setup: an enum field is out of range");
    if (s->attention == MN_ATTN_DEFAULT) {  // hf, deepspeed: eager for encoders, sdpa otherwise
        int enc = m->arch == MN_ARCH_ENCODER || m->arch == MN_ARCH_ENCODER_DECODER;
        if (s->framework == MN_FW_HF || s->framework == MN_FW_DEEPSPEED)
            s->attention = enc ? MN_ATTN_EAGER : MN_ATTN_SDPA;
        else if (s->framework == MN_FW_MEMANAT)  // the trainer keeps the probabilities
            s->attention = MN_ATTN_EAGER;
        else
            s->attention = MN_ATTN_FLASH;
    }
    if (s->torch_version == 0) s->torch_version = 200;  // 1.10 only when asked (--torch 1.10)
    if ((unsigned)s->optim_impl >= MN_OPTIM_IMPL_COUNT)
        MN__INVALID(lg, "setup: optim_impl %d is out of range", (int)s->optim_impl);
    if (s->loop == MN_LOOP_DEFAULT) s->loop = MN_LOOP_PLAIN;
    if ((unsigned)s->loop >= MN_LOOP_COUNT)
        MN__INVALID(lg, "setup: loop %d is out of range", (int)s->loop);
    // torch 2's optimizers take foreach for CUDA parameters when neither foreach nor fused is
    // given (torch/optim/optimizer.py, _default_to_fused_or_foreach with use_fused=False);
    // torch 1.10 ran the per-tensor loop; the engines (deepspeed, megatron) and the trainer fuse
    if (s->optim_impl == MN_OPTIM_IMPL_DEFAULT)
        s->optim_impl = s->framework != MN_FW_HF ? MN_OPTIM_IMPL_FUSED
                        : s->torch_version >= 200 ? MN_OPTIM_IMPL_FOREACH : MN_OPTIM_IMPL_LOOP;
    if (!(s->lora_dropout >= 0.0f && s->lora_dropout < 1.0f))
        MN__INVALID(lg, "--lora-dropout %g is out of range (want 0 <= p < 1)",
                    (double)s->lora_dropout);
    if (s->torch_version < 100 || s->torch_version > 999)
        MN__INVALID(lg, "--torch %u.%02u is out of range (want 1.00..9.99, torch_version 100..999)",
                    s->torch_version / 100, s->torch_version % 100);
    // torch 2.0 made zero_grad(set_to_none=True) the default (torch.nn.Module.zero_grad docs)
    if (s->grads == MN_GRADS_DEFAULT)  // the trainer zeroes its gradients in place
        s->grads = s->torch_version < 200 || s->framework == MN_FW_MEMANAT ? MN_GRADS_KEEP
                                                                          : MN_GRADS_RELEASE;
    if (s->zero_stage > 3) MN__INVALID(lg, "--zero %u is out of range (want 0..3)", s->zero_stage);
    if (s->gpus == 0) s->gpus = 1;
    if (s->gpus > (1u << 20))
        MN__INVALID(lg, "--gpus %u is out of range (want 1..1048576)", s->gpus);
    if (s->lora_rank > 65536)
        MN__INVALID(lg, "--lora-rank %u is out of range (want 1..65536, 0 = no LoRA)",
                    s->lora_rank);
    if (s->lora_rank && s->lora_targets == 0) s->lora_targets = MN_LORA_Q | MN_LORA_V;
    if (s->quant > MN_QUANT_NONE && !s->lora_rank && !s->infer)
        MN__INVALID(lg, "--quant %s freezes the base weights: add --lora-rank, or --infer",
                    mn_quant_name(s->quant));
    if ((r = mn__resolve_quant(s, m, lg)) != MN_OK) return r;
    if (s->offload == MN_OFFLOAD_ALL && s->zero_stage < 3)
        MN__INVALID(lg, "--offload all needs --zero 3");
    if (s->beams == 0) s->beams = 1;
    if (s->beams > 4096) MN__INVALID(lg, "--beams %u is out of range (want 1..4096)", s->beams);
    if (s->infer && m->arch == MN_ARCH_STACK) {  // generation runs attention blocks
        mn__log(lg, MN_LOG_ERROR, "--infer: a custom layer stack has no generation to model");
        return MN_ERR_UNSUPPORTED;
    }
    // Options that contradict --infer or do nothing without it are refused, not dropped.
    if (s->infer && s->optim != MN_OPTIM_DEFAULT && s->optim != MN_OPTIM_NONE)
        MN__INVALID(lg, "--optim %s with --infer: generation keeps no optimizer state (drop one)",
                    mn_optim_name(s->optim));
    if (s->infer && s->accum > 1)
        MN__INVALID(lg, "--accum %llu with --infer: generation accumulates no gradients (drop one)",
                    (unsigned long long)s->accum);
    if (s->infer && s->checkpointing > MN_CKPT_NONE)
        MN__INVALID(lg, "--checkpointing %s with --infer: generation keeps no activations for a "
                    "backward (drop one)", mn_ckpt_name(s->checkpointing));
    if (!s->infer && (s->prompt || s->new_tokens || s->beams > 1))
        MN__INVALID(lg, "--%s applies to generation only: add --infer, or use --seq for training",
                    s->prompt ? "prompt" : s->new_tokens ? "new-tokens" : "beams");
    if (s->infer) {
        if (s->prompt == 0) s->prompt = s->seq;
        if (s->prompt > (1ull << 26))
            MN__INVALID(lg, "--prompt %llu is out of range (want 1..67108864)",
                        (unsigned long long)s->prompt);
        if (s->new_tokens > (1ull << 26))
            MN__INVALID(lg, "--new-tokens %llu is out of range (want 0..67108864)",
                        (unsigned long long)s->new_tokens);
        s->seq = s->prompt, s->accum = 1, s->optim = MN_OPTIM_NONE, s->checkpointing = MN_CKPT_NONE;
        // a learned position table has max_positions rows: generating past it indexes beyond
        // the table (transformers' GPT-2 / BERT embeddings); rotary models extrapolate
        if (m->posemb == MN_POS_LEARNED && s->prompt + s->new_tokens > m->max_positions)
            MN__INVALID(lg, "--prompt %llu + --new-tokens %llu = %llu positions is beyond the "
                        "model's %llu (a learned position table)", (unsigned long long)s->prompt,
                        (unsigned long long)s->new_tokens,
                        (unsigned long long)(s->prompt + s->new_tokens),
                        (unsigned long long)m->max_positions);
        if (m->posemb != MN_POS_LEARNED && m->max_positions &&
            s->prompt + s->new_tokens > m->max_positions)
            mn__log(lg, MN_LOG_WARN, "--prompt %llu + --new-tokens %llu goes beyond the model's "
                    "%llu positions: estimated as asked, though quality past them is not assured",
                    (unsigned long long)s->prompt, (unsigned long long)s->new_tokens,
                    (unsigned long long)m->max_positions);
    }
    if (s->zero_stage > 0 && s->gpus == 1 && s->offload == MN_OFFLOAD_NONE)
        mn__log(lg, MN_LOG_WARN, "--zero %u over 1 GPU shards nothing: the model states stay "
                "whole on the GPU (give --gpus N, or --offload)", s->zero_stage);
    if (s->framework == MN_FW_MEMANAT && (r = mn__resolve_memanat(m, s, lg)) != MN_OK) return r;
    // the trainer runs on the CPU: host memory, no context, no cuBLAS workspace
    if (!s->gpu) s->gpu = s->framework == MN_FW_MEMANAT ? "cpu" : "a100-80gb";
    if (mn_gpu_find(s->gpu, gpu) != MN_OK) {
        const char *near = mn_gpu_closest(s->gpu);
        mn__log(lg, MN_LOG_ERROR, "unknown GPU \"%s\"%s%s%s (see `memanat models`)", s->gpu,
                near ? "; did you mean " : "", near ? near : "", near ? "?" : "");
        return MN_ERR_NOT_FOUND;
    }
    s->gpu = gpu->name;
    // bf16 needs sm 80 or newer: transformers' TrainingArguments refuses --bf16 without it
    // (is_torch_bf16_gpu_available), and autocast has no bf16 kernels there
    if (!gpu->bf16 && (s->precision == MN_PREC_BF16 || s->precision == MN_PREC_BF16_PURE))
        MN__INVALID(lg, "--precision %s on the %s (sm %u): bf16 needs sm 80 or newer; use fp16",
                    mn_precision_name(s->precision), gpu->label, gpu->sm);
    if (s->capacity == 0) s->capacity = gpu->capacity;
    if (s->context == 0) s->context = gpu->context;
    if (s->capacity > (1ull << 50))
        MN__INVALID(lg, "--capacity %llu bytes is out of range (want up to 1125899906842624)",
                    (unsigned long long)s->capacity);
    if (s->context > s->capacity && setup->context == 0)
        MN__INVALID(lg, "--capacity %llu bytes is below the %s's context of %llu bytes (CUDA "
                    "context and kernels): give a larger --capacity, or --context",
                    (unsigned long long)s->capacity, gpu->label, (unsigned long long)s->context);
    if (s->context > s->capacity)
        MN__INVALID(lg, "--context %llu bytes is out of range (want up to the capacity, %llu)",
                    (unsigned long long)s->context, (unsigned long long)s->capacity);

    c->batch = s->batch * (s->infer ? s->beams : 1);
    c->seq = s->seq;
    c->ntok = c->batch * c->seq;
    c->enc_seq = c->seq;
    if (c->ntok > (1ull << 36))
        MN__INVALID(lg, "batch x sequence = %llu tokens is out of range (want up to 68719476736)",
                    (unsigned long long)c->ntok);
    c->q_width = m->heads * m->head_dim, c->kv_width = m->kv_heads * m->head_dim;
    c->ffn = m->ffn;
    c->lora_rank = s->lora_rank;
    c->gpus = s->gpus, c->zero = s->zero_stage;
    c->cublas_workspace = gpu->cublas_workspace;
    c->sm = gpu->sm;
    c->attn = s->attention;
    mixed = s->precision == MN_PREC_FP16 || s->precision == MN_PREC_BF16;
    pure = s->precision == MN_PREC_FP16_PURE || s->precision == MN_PREC_BF16_PURE;
    c->a_esz = (mixed || pure) ? 2 : 4;
    c->w_esz = c->g_esz = 4;
    c->param_cat = MN_CAT_WEIGHTS;
    c->hf = s->framework == MN_FW_HF || s->framework == MN_FW_DEEPSPEED;
    c->t2 = s->framework == MN_FW_HF && s->torch_version >= 200 && !s->infer;
    // transformers 5 decoders build a DynamicCache in training unless gradient checkpointing
    // is on (GradientCheckpointingLayer sets use_cache=False); encoders have none
    c->kv_train = c->t2 && m->arch == MN_ARCH_DECODER && s->checkpointing != MN_CKPT_FULL;
    c->impl = s->optim_impl;
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
    case MN_FW_MEMANAT:  // 16-bit weights beside fp32 master weights (pure: refused above)
        if (mixed) c->w_esz = 2, c->fw_master = 2;
        // on a GPU (any table entry but "cpu"): trainer.c --device cuda, whose kernels take one
        // storage type, so the gradients are 16-bit too (llm.c train_gpt2.cu keeps them so)
        c->memanat_gpu = gpu->sm != 0;
        if (mixed && c->memanat_gpu) c->g_esz = 2;
        break;
    case MN_FW_COUNT: break;
    }
    if (s->infer) c->fw_master = 0, c->grads_prealloc = 0;  // autocast inference: fp32 + 16-bit
    c->kv_esz = c->a_esz;
    c->nblocks = (uint32_t)(m->arch == MN_ARCH_STACK ? m->stack_len
                                                      : m->layers + m->encoder_layers);
    if (m->arch == MN_ARCH_ENCODER_DECODER) c->nblocks = (uint32_t)(m->layers + m->encoder_layers);
    else if (m->arch != MN_ARCH_STACK) c->nblocks = (uint32_t)m->layers;
    return MN_OK;
}

// ---- the estimate -------------------------------------------------------------------------------

MN__PRIVATE void mn__sim_free(mn__sim *S) {
    mn__free(S->al, S->tensors), mn__free(S->al, S->ops), mn__free(S->al, S->params);
    mn__free(S->al, S->free_ids), mn__free(S->al, S->hist);
    mn__free(S->al, S->ev), mn__free(S->al, S->block_start), mn__free(S->al, S->outs);
    memset(S, 0, sizeof *S);
}

// Counting pass: the parameter list, plus the exact count a caller gave (--params, safetensors)
// and adapters (--trainable-params).
MN__PRIVATE mn_result mn__build_params(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t counted = 0, i, want = c->m.params;
    uint32_t nb = c->nblocks + 1;
    S->block_start = (uint32_t *)mn__alloc_array(S->al, nb, sizeof *S->block_start);
    if (!S->block_start) return MN_ERR_OUT_OF_MEMORY;
    memset(S->block_start, 0, (size_t)nb * sizeof *S->block_start);
    S->counting = 1;
    S->cursor = 0;
    if (c->s.framework == MN_FW_MEMANAT) {  // the trainer's tensors, per-layer ones stacked
        uint64_t L = c->m.layers, C = c->m.hidden, T = c->seq, V = c->m.vocab;
        uint64_t HV = c->m.tie_embeddings ? 0 : V;
#define MN__GP_REG(name, rows, cols, init) \
        if ((rows) != 0) mn__next_param(S, rows, cols, 1, 0);
        MN_GPT_PARAMS(MN__GP_REG)
#undef MN__GP_REG
        S->counting = 0;
        return S->err;
    }
    if (c->m.arch == MN_ARCH_STACK) mn__stack_forward(S, MN__NONE);
    else mn__forward(S, MN__NONE, MN__NONE);
    if (S->err) return S->err;
    for (i = 0; i < S->np; i++) counted += S->params[i].numel;
    if (want && want < counted)  // a count can add to a shape, never take from it
        mn__log(&c->s.logger, MN_LOG_WARN,
                "model: the given count of %llu parameters is below the %llu that the shape "
                "(%llu layers, hidden %llu, vocabulary %llu) implies; the shape's count is used",
                (unsigned long long)want, (unsigned long long)counted,
                (unsigned long long)c->m.layers, (unsigned long long)c->m.hidden,
                (unsigned long long)c->m.vocab);
    if (want > counted) {  // the rest as frozen-or-trainable matrices of the model's width
        uint64_t rest = want - counted, h = c->m.hidden ? c->m.hidden : 1024;
        if (rest / h) mn__next_param(S, rest / h, h, mn__base_trainable(c), 0);
        if (rest % h) mn__next_param(S, rest % h, 0, mn__base_trainable(c), 0);
    }
    if (c->s.trainable_params) {
        uint64_t total = 0, T = c->s.trainable_params, h = c->m.hidden ? c->m.hidden : 1024;
        for (i = 0; i < S->np; i++) total += S->params[i].numel;
        if (T > total) {
            mn__log(&c->s.logger, MN_LOG_ERROR,
                    "--trainable-params %llu exceeds the model's %llu parameters",
                    (unsigned long long)T, (unsigned long long)total);
            return MN_ERR_INVALID_ARG;
        }
        if (T / h) mn__next_param(S, T / h, h, 1, 0);
        if (T % h) mn__next_param(S, T % h, 0, 1, 0);
    }
    S->counting = 0;
    return S->err;
}

// *acc += v, checked: an overflow sticks in S->err.
MN__PRIVATE void mn__acc(mn__sim *S, uint64_t *acc, uint64_t v) {
    if (mn_add_u64(*acc, v, acc) != MN_OK) S->err = MN_ERR_OVERFLOW;
}

// Model states per GPU, from the parameter list.
MN__PRIVATE void mn__model_states(mn__sim *S, mn_estimate_result *out) {
    mn__cfg *c = S->c;
    uint64_t i, g, st, mw, total = 0, trainable = 0;
    int off = c->s.offload > MN_OFFLOAD_NONE;
    for (i = 0; i < S->np; i++) {
        mn__param *P = &S->params[i];
        mn__acc(S, &total, P->numel);
        if (c->amp) {  // fp32 storage of trained parameters is the master; autocast adds casts
            if (P->trainable) mn__acc(S, &out->master_weights, mn__weight_bytes(S, P));
            else mn__acc(S, &out->weights, mn__weight_bytes(S, P));
            if (!P->quant)
                mn__acc(S, &out->weights, mn__prod(S, P->numel, 2) / (c->zero >= 3 ? c->gpus : 1));
        } else if (c->s.offload != MN_OFFLOAD_ALL) {
            mn__acc(S, &out->weights, mn__weight_bytes(S, P));
        } else {
            mn__acc(S, &out->cpu_bytes, mn__weight_bytes(S, P));
        }
        if (!P->trainable || c->s.infer) continue;
        mn__acc(S, &trainable, P->numel);
        g = mn__grad_bytes(S, P);
        st = mn__state_bytes(S, P);
        mw = mn__master_bytes(S, P);
        if (off) {
            mn__acc(S, &out->cpu_bytes, g), mn__acc(S, &out->cpu_bytes, st);
            mn__acc(S, &out->cpu_bytes, mw);
            continue;
        }
        mn__acc(S, &out->gradients, g);
        mn__acc(S, &out->optimizer, st), mn__acc(S, &out->optimizer, c->fw_master == 1 ? mw : 0);
        mn__acc(S, &out->master_weights, c->fw_master == 2 ? mw : 0);
    }
    if (c->s.optim == MN_OPTIM_NONE) out->optimizer = 0;
    out->params = total;
    out->trainable_params = c->s.infer ? 0 : trainable;
    out->model_states = out->weights;
    mn__acc(S, &out->model_states, out->master_weights);
    mn__acc(S, &out->model_states, out->gradients);
    mn__acc(S, &out->model_states, out->optimizer);
}

// The sequence length of the next micro-batch (mn_estimate_lengths; resolution checked the
// longest).
MN__PRIVATE void mn__set_seq(mn__cfg *c, uint64_t seq) {
    c->s.seq = c->seq = c->enc_seq = seq;
    c->ntok = c->batch * seq;
}

// Runs load + two training steps (or a generation), recording allocation events.
MN__PRIVATE void mn__run(mn__sim *S) {
    mn__cfg *c = S->c;
    uint64_t step, mb, nmb = c->s.accum < 2 ? 1 : 2;
    if (c->s.framework == MN_FW_MEMANAT) {  // resolution made sure this is a training step
        mn__gpt_run(S);
        return;
    }
    mn__load(S);
    if (S->err) return;
    if (c->s.infer) {
        S->cursor = 0;
        mn__generate(S);
        return;
    }
    S->why = "cuBLAS workspace";
    if (c->cublas_workspace) mn__tensor_new(S, c->cublas_workspace, 1, MN_CAT_WORKSPACE);
    if (S->step_marks) S->step_marks[0] = S->nev;
    for (step = 0; step < (S->steps ? S->steps : 2) && !S->err; step++) {
        for (mb = 0; mb < nmb && !S->err; mb++) {
            if (S->mb_seq) mn__set_seq(c, S->mb_seq[step * nmb + mb]);
            S->cursor = 0;
            S->parts_on = S->parts && step == 1 && mb == 0;  // the steady state
            mn__micro_batch(S);
            S->parts_on = 0;
        }
        if (!S->err) mn__optimizer_step(S);
        if (S->step_marks) S->step_marks[step + 1] = S->nev;
    }
}

// The replay's logger passes errors on (a bad allocator config) and keeps the out-of-memory
// warnings of the real-size replay, which are part of the answer, from the caller's log.
MN__PRIVATE void mn__replay_log(void *user_data, mn_log_level level, const char *msg) {
    const mn_logger *lg = (const mn_logger *)user_data;
    if (level == MN_LOG_ERROR) mn__log(lg, level, "%s", msg);
}

// A fit's setups often differ only where the device never sees it (the optimizer of offloaded
// states, a technique that changes no buffer): their allocation events are then the same, and so
// is every statistic of their replay, which depends on the events, the device size, the
// allocator config and the allocator alone. mn_fit keeps the events last replayed and the
// replays made of them, and reuses one whose inputs are all equal (a replay stopped at its first
// out-of-memory only where a stopped one is asked for). The events are not copied: the memo's
// buffer and the simulation's trade places when the next estimate starts (mn__sim_reset), so
// the fit writes its events into two buffers, each grown once.
#define MN__REPLAY_KEPT 2  // replays kept of one set of events (unlimited, at the device's size)

typedef struct mn__replay_kept {
    uint64_t capacity;
    mn_cache_statistics st;
    uint64_t failed;     // device allocations refused (mn_simdev.failed_calls)
    int stopped;         // stopped at its first out-of-memory: st and failed are partial
} mn__replay_kept;

// Host memory of the replays of one fit: a replay's cache and simulated device ask for the same
// sizes as the replay before (block slabs, address maps, their growth steps), so the large
// blocks one frees are kept for the next, whose pages are then not faulted in again (a host's
// malloc maps blocks of this size afresh and returns them when freed; a fresh page costs about
// a microsecond, and a replay of 20 k events touches hundreds). Small blocks go back to the
// host's heap, which keeps their pages warm for the simulation as well. Each block carries its
// size in a header in front of it.
#define MN__POOL_KEPT 32
#define MN__POOL_MIN 131072  // bytes: smaller blocks are not kept (glibc's first mmap threshold)

typedef union mn__pool_head {  // (as aligned as malloc's blocks: the header keeps it)
    size_t size;
    long double ld;
    uint64_t u;
    void *p;
} mn__pool_head;

typedef struct mn__host_pool {
    void *kept[MN__POOL_KEPT];  // blocks freed, to be handed out again (header included)
    size_t size[MN__POOL_KEPT];
    uint32_t n;
} mn__host_pool;

MN__PRIVATE void *mn__pool_alloc(void *user, size_t size) {
    mn__host_pool *P = (mn__host_pool *)user;
    mn__pool_head *h;
    uint32_t i;
    for (i = P->n; i-- > 0;)
        if (P->size[i] == size) {
            h = (mn__pool_head *)P->kept[i];
            P->n--, P->kept[i] = P->kept[P->n], P->size[i] = P->size[P->n];
            return h + 1;
        }
    if (size > SIZE_MAX - sizeof *h) return NULL;
    h = (mn__pool_head *)mn__alloc(NULL, size + sizeof *h);
    if (!h) return NULL;
    h->size = size;
    return h + 1;
}

MN__PRIVATE void mn__pool_free(void *user, void *ptr) {
    mn__host_pool *P = (mn__host_pool *)user;
    mn__pool_head *h;
    if (!ptr) return;
    h = (mn__pool_head *)ptr - 1;
    if (h->size < MN__POOL_MIN) {
        mn__free(NULL, h);
        return;
    }
    if (P->n == MN__POOL_KEPT) {  // (full: the first kept goes)
        mn__free(NULL, P->kept[0]);
        memmove(&P->kept[0], &P->kept[1], (MN__POOL_KEPT - 1) * sizeof P->kept[0]);
        memmove(&P->size[0], &P->size[1], (MN__POOL_KEPT - 1) * sizeof P->size[0]);
        P->n--;
    }
    P->kept[P->n] = h, P->size[P->n++] = h->size;
}

MN__PRIVATE void mn__pool_clear(mn__host_pool *P) {
    uint32_t i;
    for (i = 0; i < P->n; i++) mn__free(NULL, P->kept[i]);
    P->n = 0;
}

typedef struct mn__replay_memo {
    mn__host_pool pool;  // host memory of the fit's replays
    mn__ev *ev;          // the events last replayed (nev; cev allocated), not the simulation's
    uint64_t nev, cev;
    const char *alloc_conf, *cur_conf;  // the allocator config of ev; of S->ev
    mn__replay_kept last[MN__REPLAY_KEPT], cur[MN__REPLAY_KEPT];  // replays of ev; of S->ev
    uint32_t nlast, ncur;
    int same;            // S->ev equals ev (a replay found it so)
} mn__replay_memo;

MN__PRIVATE void mn__replay_memo_free(mn__replay_memo *M) {
    mn__pool_clear(&M->pool);
    mn__free(NULL, M->ev);
    memset(M, 0, sizeof *M);
}

// The replay of the simulation's events with these inputs, or NULL (a stopped one only when stop
// is set): one made in this estimate, or one of the events last replayed when they are equal.
MN__PRIVATE const mn__replay_kept *mn__replay_memo_find(const mn__sim *S, uint64_t capacity,
                                                        int stop) {
    mn__replay_memo *M = S->rmemo;
    const char *conf = S->c->s.alloc_conf;
    uint32_t i;
    if (S->al) return NULL;  // (a caller's allocator: not kept)
    for (i = 0; i < M->ncur; i++)
        if (M->cur[i].capacity == capacity && (stop || !M->cur[i].stopped)) return &M->cur[i];
    if (M->nev != S->nev || (M->alloc_conf == NULL) != (conf == NULL) ||
        (conf && strcmp(M->alloc_conf, conf)))
        return NULL;
    for (i = 0; i < M->nlast; i++)
        if (M->last[i].capacity == capacity && (stop || !M->last[i].stopped)) break;
    if (i == M->nlast) return NULL;
    if (!M->same) {  // (every byte of an event is a field, its padding field 0)
        if (S->nev && memcmp(M->ev, S->ev, (size_t)S->nev * sizeof *S->ev)) return NULL;
        M->same = 1;
    }
    return &M->last[i];
}

// Keeps a successful replay of the simulation's events.
MN__PRIVATE void mn__replay_memo_add(mn__sim *S, uint64_t capacity,
                                     const mn_cache_statistics *st, uint64_t failed,
                                     int stopped) {
    mn__replay_memo *M = S->rmemo;
    mn__replay_kept *k;
    uint32_t i;
    if (S->al) return;
    for (i = 0; i < M->ncur && M->cur[i].capacity != capacity; i++) {}
    if (i == MN__REPLAY_KEPT) i = 0;
    k = &M->cur[i];
    if (i == M->ncur) M->ncur++;
    M->cur_conf = S->c->s.alloc_conf;
    k->capacity = capacity, k->st = *st, k->failed = failed, k->stopped = stopped;
}

// At the start of the next estimate: the events just replayed become the events last replayed
// (the buffers trade places), with their replays and, when they equal the earlier ones, those
// replays of the earlier ones that were not made again.
MN__PRIVATE void mn__replay_memo_turn(mn__sim *S) {
    mn__replay_memo *M = S->rmemo;
    mn__ev *ev = M->ev;
    uint64_t cev = M->cev;
    uint32_t i, j;
    if (!M->ncur) {
        M->same = 0;
        return;
    }
    if (M->same) {  // (the same events: the earlier replays hold for them too)
        for (i = 0; i < M->nlast && M->ncur < MN__REPLAY_KEPT; i++) {
            for (j = 0; j < M->ncur && M->cur[j].capacity != M->last[i].capacity; j++) {}
            if (j == M->ncur) M->cur[M->ncur++] = M->last[i];
        }
    }
    if (!ev && S->cev) {  // (the first turn: a buffer as large, so the next one grows no more)
        ev = (mn__ev *)mn__alloc_array(NULL, (size_t)S->cev, sizeof *ev);
        cev = ev ? S->cev : 0;
    }
    M->ev = S->ev, M->cev = S->cev, M->nev = S->nev;
    M->alloc_conf = M->cur_conf;
    for (i = 0; i < M->ncur; i++) M->last[i] = M->cur[i];
    M->nlast = M->ncur, M->ncur = 0, M->same = 0;
    S->ev = ev, S->cev = cev;
}

MN__PRIVATE void mn__c_solo(mn_cache *cache);
MN__PRIVATE void mn__c_direct(mn_cache *cache);
MN__PRIVATE void mn__c_lean(mn_cache *cache);
MN__PRIVATE void *mn__c_last_block(mn_cache *cache);
MN__PRIVATE mn_result mn__c_release_direct(mn_cache *cache, void *block);

// mn_cache_replay's loop (an allocation of a live id first releases the old block, a free of an
// id with no live block is skipped, *failed counts the allocations refused after the whole
// out-of-memory ladder) on the simulation's events; with stop set it stops at the first one
// refused (*stopped 1). The ids index an array of the blocks handed out (the cache keeps no
// address map then: mn__c_direct): the estimator's tensor ids are below a few times the event
// count; other ids, or no host memory for the array, replay whole through mn_cache_replay.
MN__PRIVATE mn_result mn__replay_events(mn__sim *S, mn_cache *c, int stop, int *stopped,
                                        uint64_t *failed) {
    const mn__ev *ev = S->ev;
    mn__host_pool *pool = S->rmemo && !S->al ? &S->rmemo->pool : NULL;
    uint64_t i, top = 0, nb = 512;
    void **blk = NULL;
    mn_result r = MN_OK;
    *stopped = 0, *failed = 0;
    for (i = 0; i < S->nev; i++) top = ev[i].id > top ? ev[i].id : top;
    if (top < 4 * S->nev + 4096) {
        while (nb <= top) nb *= 2;  // (a fit's replays: sizes that repeat, kept in its pool)
        if (nb <= SIZE_MAX / sizeof *blk)
            blk = pool ? (void **)mn__pool_alloc(pool, (size_t)nb * sizeof *blk)
                       : (void **)mn__alloc_array(NULL, (size_t)top + 1, sizeof *blk);
    }
    if (!blk) {
        mn_trace_event *t = mn__events_public(S->al, ev, S->nev);
        mn_replay_counts n;
        memset(&n, 0, sizeof n);
        if (!t && S->nev) return MN_ERR_OUT_OF_MEMORY;
        r = mn_cache_replay(c, t, S->nev, 0, &n);
        mn__free(S->al, t);
        *failed = n.failed;
        return r;
    }
    memset(blk, 0, ((size_t)top + 1) * sizeof *blk);
    mn__c_direct(c), mn__c_lean(c);
    for (i = 0; i < S->nev && r == MN_OK; i++) {
        const mn__ev *e = &ev[i];
        void *p = NULL;
        if (blk[e->id]) r = mn__c_release_direct(c, blk[e->id]), blk[e->id] = NULL;
        if (!e->alloc || r != MN_OK) continue;
        r = mn_cache_alloc(c, e->size, 0, (mn_category)e->category, NULL, &p);  // (no labels:
                                                                                 // no snapshot)
        if (r == MN_ERR_DEVICE_OOM) {
            ++*failed, r = MN_OK;
            if (!stop) continue;
            *stopped = 1;
            break;
        }
        if (r == MN_OK && p) blk[e->id] = mn__c_last_block(c);
    }
    if (pool) mn__pool_free(pool, blk);
    else mn__free(NULL, blk);
    return r;
}

// Replays the events through the caching allocator on a simulated device. capacity 0 = unlimited.
// *failed: the device allocations the device refused (failed may be NULL). stop (a capacity
// set): stop at the first allocation refused after the out-of-memory ladder (*stopped 1; st and
// *failed then count what was replayed up to it); stopped may be NULL when stop is 0.
static mn_result mn__replay(mn__sim *S, uint64_t capacity, int stop, mn_cache_statistics *st,
                            uint64_t *failed, int *stopped) {
    mn_sim_cache sc;
    mn_simdev_desc dd;
    mn_cache_desc cd;
    mn_result r;
    uint64_t refused, nfailed = 0;
    int stp = 0;
    if (stopped) *stopped = 0;
    if (S->rmemo) {
        const mn__replay_kept *e = mn__replay_memo_find(S, capacity, stop);
        if (e) {
            *st = e->st;
            if (failed) *failed = e->failed;
            if (stopped) *stopped = e->stopped;
            return MN_OK;
        }
    }
    memset(&dd, 0, sizeof dd);
    memset(&cd, 0, sizeof cd);
    dd.capacity = capacity;
    cd.config = S->c->s.alloc_conf;
    cd.logger.log_fn = mn__replay_log, cd.logger.user_data = (void *)&S->c->s.logger;
    if (S->al) {
        cd.allocator = *S->al;
    } else if (S->rmemo) {  // (a fit: host memory kept from replay to replay)
        cd.allocator.alloc_fn = mn__pool_alloc, cd.allocator.free_fn = mn__pool_free;
        cd.allocator.user_data = &S->rmemo->pool;
    }
    if ((r = mn_sim_cache_init(&sc, &dd, &cd)) != MN_OK) return r;
    mn__c_solo(&sc.cache);  // (nothing else sees this cache: no lock)
    r = mn__replay_events(S, &sc.cache, stop && capacity, &stp, &nfailed);
    if (r == MN_OK) r = mn_cache_stats(&sc.cache, st);
    refused = sc.dev.failed_calls;
    mn_sim_cache_free(&sc);
    if (failed) *failed = refused;
    if (stopped) *stopped = stp;
    if (r == MN_OK && capacity == 0 && nfailed) {
        // unlimited device: only a tensor of 1 EiB or more is refused (PyTorch's one_exa_bytes)
        uint64_t i, big = 0;
        for (i = 0; i < S->nev; i++)
            if (S->ev[i].alloc && S->ev[i].size > big) big = S->ev[i].size;
        mn__log(&S->c->s.logger, MN_LOG_ERROR,
                "the model or setup is too large: one tensor needs %llu bytes, and no allocator "
                "grants 1 EiB or more (PyTorch refuses it as out of memory)",
                (unsigned long long)big);
        r = MN_ERR_OVERFLOW;
    }
    if (r == MN_OK && S->rmemo) mn__replay_memo_add(S, capacity, st, refused, stp);
    return r;
}

// Empties S for the next estimate but keeps its arrays and their capacity (mn_fit runs many
// estimates of one model: reusing the arrays saves their fresh pages and regrowth copies).
MN__PRIVATE void mn__sim_reset(mn__sim *S) {
    mn__sim k;
    if (S->rmemo) mn__replay_memo_turn(S);
    k = *S;
    mn__free(S->al, S->block_start);
    memset(S, 0, sizeof *S);
    S->al = k.al, S->rmemo = k.rmemo;
    S->tensors = k.tensors, S->ct = k.ct, S->ops = k.ops, S->cops = k.cops;
    S->free_ids = k.free_ids, S->cfree = k.cfree, S->hist = k.hist, S->ch = k.ch;
    S->params = k.params, S->cp = k.cp, S->ev = k.ev, S->cev = k.cev;
    S->outs = k.outs, S->couts = k.couts;
}

// What an estimate keeps beyond its result (mn__estimate_in's keep): the allocation events, or
// every tensor's record with its history (why, born, died) for mn_estimate_explain.
#define MN__KEEP_EVENTS 1
#define MN__KEEP_HISTORY 2

// One estimate in S, which is empty (fresh or reset; its allocator set).
// parts: NULL, or room for the activation bytes of each part (mn_estimate_parts).
MN__PRIVATE mn_result mn__estimate_in(const mn_model *model, const mn_setup *setup,
                                      mn_estimate_result *out, mn__sim *S, int keep,
                                      uint64_t *parts) {
    mn__cfg c;
    mn_gpu gpu;
    mn_result r;
    int k;
    if (!model || !setup || !out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    S->parts = parts;
    r = mn__resolve(model, setup, &c, &gpu);
    if (r != MN_OK) return r;
    S->c = &c;
    r = mn__build_params(S);
    if (r == MN_OK) {
        mn__model_states(S, out);
        r = S->err;
    }
    if (r == MN_OK && c.lora_rank && !c.s.infer && !c.s.trainable_params &&
        out->trainable_params == 0) {  // every base weight frozen, no adapter placed
        char t[64];
        mn__lora_targets_str(c.s.lora_targets, t, sizeof t);
        mn__log(&c.s.logger, MN_LOG_ERROR, "--lora-targets %s: %s has none of these projections, "
                "so nothing would train (q,k,v,o,gate,up,down; gate needs a gated MLP)", t,
                c.m.name);
        return MN_ERR_INVALID_ARG;
    }
    if (r == MN_OK) {
        S->events = (keep & MN__KEEP_EVENTS) || !c.s.no_replay;
        S->history = (keep & MN__KEEP_HISTORY) != 0;
        S->reuse = !(keep & MN__KEEP_EVENTS) && !S->history && !S->unique_ids &&
                   c.s.framework != MN_FW_MEMANAT;
        mn__run(S);
        r = S->over ? MN_OK : S->err;
    }
#ifndef NDEBUG
    // id reuse's books: every dead record that no op on the tape names is on the free list, once;
    // an empty tape names none (a run cut short ends mid-step)
    if (r == MN_OK && S->reuse && !S->over) {
        uint64_t i, dead = 0;
        for (i = 0; i < S->nt; i++) {
            MN_ASSERT(S->nops || !S->tensors[i].tape);
            dead += !S->tensors[i].live && !S->tensors[i].tape;
        }
        MN_ASSERT(dead == S->nfree);
    }
#endif
    if (r == MN_ERR_OVERFLOW)
        mn__log(&c.s.logger, MN_LOG_ERROR,
                "the model or setup is too large: a byte count overflows 64 bits (%llu parameters "
                "counted, batch %llu x seq %llu)", (unsigned long long)out->params,
                (unsigned long long)c.s.batch, (unsigned long long)c.s.seq);
    if (r != MN_OK) return r;
    out->peak_allocated = S->peak;
    out->peak_requested = S->peak_r;
    out->peak_phase = S->peak_phase;
    for (k = 0; k < MN_CAT_COUNT; k++)
        out->at_peak[k] = S->at_peak[k], out->cat_peak[k] = S->cat_peak[k];
    out->activations = S->at_peak[MN_CAT_ACTIVATIONS];
    out->temporary = S->at_peak[MN_CAT_TEMPORARY];
    out->workspace = S->at_peak[MN_CAT_WORKSPACE];
    out->kv_cache = S->at_peak[MN_CAT_KV_CACHE];
    out->alloc_events = S->nalloc;
    out->peak_reserved = S->peak;
    out->context = c.s.context, out->capacity = c.s.capacity;
    if (S->alone && !c.s.no_replay) {  // (no replay: no events either, alloc_events 0)
        mn_estimate_result *q = S->alone;
        *q = *out;
        q->alloc_events = 0;
        q->device_used = q->context + q->peak_reserved;
        q->fits = q->device_used <= q->capacity;
        q->setup = c.s, q->setup.no_replay = 1;
        q->model = c.m, q->gpu = gpu;
        q->setup.logger.log_fn = NULL, q->setup.logger.user_data = NULL;
        S->alone_set = 1;
        if (!q->fits || (S->alone_below && q->peak_allocated >= S->alone_below) ||
            (S->alone_above && q->device_used <= S->alone_above) || !S->events)
            return MN_OK;  // (out is not read)
        S->alone_replay = 1;
    }
    if (!c.s.no_replay && !S->over) {  // (over: the step alone's peak does not fit)
        // The replay on an unlimited device gives the peaks; when its reserved peak exceeds the
        // device, PyTorch frees cached blocks and retries before it gives up, so the replay at
        // the real size decides: without an out-of-memory there the step fits, and its peaks are
        // what the device shows (max_memory_allocated and max_memory_reserved there; the blocks
        // it hands out can differ from the unlimited replay's after a retry, and so can the
        // allocated peak). It is run where the step's own peak, a lower bound of every replay's
        // allocated peak, fits the device. When only whether the step fits is asked (S->decide),
        // the replay at the real size runs first: while the device grants every allocation it is
        // the unlimited one, step for step (with no allocator config, the allocator reads the
        // device's size only from a refused allocation), so when none is refused it is the answer
        // alone; when some are and every allocation is granted after the retries, the unlimited
        // replay's reserved peak exceeded the device (the first refusal is where it does), so it
        // is the answer too; an out-of-memory means the step does not fit either way, and the
        // replay stops.
        mn_cache_statistics st, st2;
        uint64_t limit = c.s.capacity - c.s.context, failed = 0;
        int stopped = 0;
        // (not where the unlimited replay could fail, refusing a tensor of 1 EiB or running out
        // of simulated addresses: see mn__fit_given)
        int plain = !(S->decide && limit && !c.s.alloc_conf && S->peak < (1ull << 59) &&
                      UINTPTR_MAX >= UINT64_MAX);
        if (!plain) {
            r = mn__replay(S, limit, 1, &st2, &failed, &stopped);
            if (r == MN_ERR_UNSUPPORTED) plain = 1;  // (simulated addresses ran out: as before)
            else if (r != MN_OK) return r;
        }
        if (!plain) {
            if (stopped || st2.num_ooms) S->unsettled = 1;
            else st = st2;
        } else {
            r = mn__replay(S, 0, 0, &st, NULL, NULL);
            if (r != MN_OK) return r;
            if (st.reserved_bytes[MN_STAT_ALL].peak > limit && S->peak <= limit) {
                r = mn__replay(S, limit, 0, &st2, NULL, NULL);
                if (r != MN_OK) return r;
                if (st2.num_ooms == 0) st = st2;
            }
        }
        if (!S->unsettled) {  // (else the result keeps the step alone's peaks)
            out->peak_allocated = st.allocated_bytes[MN_STAT_ALL].peak;
            out->peak_reserved = st.reserved_bytes[MN_STAT_ALL].peak;
        }
        if (!S->unsettled && c.s.framework == MN_FW_MEMANAT) {
            // The trainer reports its cache's block sizes (rounded, unsplit remainders included):
            // the replay's statistics are the prediction, category by category.
            for (k = 0; k < MN_CAT_COUNT; k++)
                out->at_peak[k] = st.cat_at_peak[k],
                out->cat_peak[k] = st.cat_allocated_bytes[k].peak;
            out->activations = out->at_peak[MN_CAT_ACTIVATIONS];
            out->temporary = out->at_peak[MN_CAT_TEMPORARY];
            out->workspace = out->at_peak[MN_CAT_WORKSPACE];
            out->kv_cache = out->at_peak[MN_CAT_KV_CACHE];
        }
    }
    out->device_used = out->context + out->peak_reserved;
    out->fits = !S->unsettled && out->device_used <= out->capacity;
    out->setup = c.s;
    out->model = c.m;
    out->gpu = gpu;
    out->setup.logger.log_fn = NULL, out->setup.logger.user_data = NULL;
    return MN_OK;
}

MN__PRIVATE mn_result mn__estimate(const mn_model *model, const mn_setup *setup,
                                   const mn_allocator *al, mn_estimate_result *out, mn__sim *S,
                                   int keep, uint64_t *parts) {
    memset(S, 0, sizeof *S);
    S->al = al;
    return mn__estimate_in(model, setup, out, S, keep, parts);
}

MNIMPL mn_result mn_estimate(const mn_model *model, const mn_setup *setup,
                             mn_estimate_result *out) {
    mn__sim S;
    mn_result r = mn__estimate(model, setup, NULL, out, &S, 0, NULL);
    mn__sim_free(&S);
    return r;
}

MNIMPL mn_result mn_estimate_trace(const mn_model *model, const mn_setup *setup,
                                   const mn_allocator *allocator, mn_trace_event **events,
                                   uint64_t *count) {
    mn__sim S;
    mn_estimate_result res;
    mn_setup s2;
    mn_result r;
    if (!events || !count || !setup) return MN_ERR_INVALID_ARG;
    *events = NULL, *count = 0;
    s2 = *setup;
    s2.no_replay = 1;
    r = mn__estimate(model, &s2, allocator, &res, &S, MN__KEEP_EVENTS, NULL);
    if (r == MN_OK && S.nev) {
        *events = mn__events_public(allocator, S.ev, S.nev);
        if (*events) *count = S.nev;
        else r = MN_ERR_OUT_OF_MEMORY;
    }
    mn__sim_free(&S);
    return r;
}

MNIMPL void mn_trace_free(const mn_allocator *allocator, mn_trace_event *events) {
    mn__free(allocator, events);
}

MNIMPL mn_result mn_estimate_replay(const mn_model *model, const mn_setup *setup,
                                    const mn_allocator *allocator, mn_cache *cache) {
    mn__sim S;
    mn_estimate_result res;
    mn_setup s2;
    mn_result r;
    if (!setup || !cache) return MN_ERR_INVALID_ARG;
    s2 = *setup;
    s2.no_replay = 1;
    r = mn__estimate(model, &s2, allocator, &res, &S, MN__KEEP_EVENTS, NULL);
    if (r == MN_OK && S.nev) {
        mn_trace_event *t = mn__events_public(allocator, S.ev, S.nev);
        r = t ? mn_cache_replay(cache, t, S.nev, 0, NULL) : MN_ERR_OUT_OF_MEMORY;
        mn__free(allocator, t);
    }
    mn__sim_free(&S);
    return r;
}

MNIMPL mn_result mn_estimate_parts(const mn_model *model, const mn_setup *setup, uint64_t *parts,
                                   uint32_t cap, uint32_t *count) {
    mn__sim S;
    mn_estimate_result res;
    mn_setup s2;
    mn_result r;
    mn_model m;
    uint64_t *buf;
    uint32_t n, i;
    if (!model || !setup || !count || (cap && !parts)) return MN_ERR_INVALID_ARG;
    if (setup->infer) return MN_ERR_UNSUPPORTED;  // nothing is kept for backward in generation
    if ((r = mn__resolve_model(model, &setup->logger, &m)) != MN_OK) return r;
    n = (uint32_t)(m.arch == MN_ARCH_STACK ? m.stack_len : m.layers + m.encoder_layers) + 2;
    buf = (uint64_t *)mn__alloc_array(NULL, n, sizeof *buf);
    if (!buf) return MN_ERR_OUT_OF_MEMORY;
    memset(buf, 0, (size_t)n * sizeof *buf);
    s2 = *setup;
    s2.no_replay = 1;
    r = mn__estimate(model, &s2, NULL, &res, &S, 0, buf);
    if (r == MN_OK) {
        *count = n;
        for (i = 0; i < n && i < cap; i++) parts[i] = buf[i];
    }
    S.parts = NULL;  // the caller's buffer, not the simulation's
    mn__sim_free(&S);
    mn__free(NULL, buf);
    return r;
}

// ---- >>estimate/lengths implementation ----------------------------------------------------------
// The draws are inverse-CDF samples of the longest of b sequences (quantile u^(1/b)); the steps
// run through the same simulation as mn_estimate with each micro-batch's length set before its
// forward, and the events replay once through a simulated cache that stops at each step's end.

#define MN__SEQ_MAX (1ull << 26)
#define MN__SEQ_MAX_ENTRIES (1u << 20)

typedef struct mn__seq_pair { uint64_t len, count; } mn__seq_pair;

MN__PRIVATE int mn__seq_pair_cmp(const void *a, const void *b) {
    uint64_t x = ((const mn__seq_pair *)a)->len, y = ((const mn__seq_pair *)b)->len;
    return x < y ? -1 : x > y;
}

// A whole number of at most 19 digits at *p (advanced past it); 0 when there is none.
MN__PRIVATE int mn__seq_number(const char **p, const char *end, uint64_t *out) {
    const char *q = *p;
    uint64_t v = 0;
    int digits = 0;
    while (q < end && *q >= '0' && *q <= '9' && digits < 20)
        v = v * 10 + (uint64_t)(*q++ - '0'), digits++;
    if (digits == 0 || digits > 19) return 0;
    *p = q, *out = v;
    return 1;
}

MN__PRIVATE const char *mn__seq_skip_blank(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r')) p++;
    return p;
}

// One line [p, end): *n = 0 (nothing), 1 (a length) or 2 (length and count). 0 when malformed.
MN__PRIVATE int mn__seq_line(const char *p, const char *end, uint64_t v[2], int *n) {
    *n = 0;
    for (;;) {
        p = mn__seq_skip_blank(p, end);
        if (p == end || *p == '#') return 1;
        if (*n == 2 || (*n && p[-1] != ' ' && p[-1] != '\t')) return 0;
        if (!mn__seq_number(&p, end, &v[*n])) return 0;
        ++*n;
    }
}

MN__PRIVATE mn_result mn__seq_parse(const char *text, size_t len, const mn_allocator *al,
                                    const mn_logger *lg, const char *who, mn_seq_dist *out) {
    mn__seq_pair *pairs = NULL;
    uint64_t cap = 0, np = 0, line = 0, i;
    size_t at = 0;
    mn_result r = MN_OK;
    char pre[160];
    snprintf(pre, sizeof pre, "%.140s%s", who ? who : "", who ? ": " : "");
    memset(out, 0, sizeof *out);
    while (at < len && r == MN_OK) {
        const char *b = text + at, *e = (const char *)memchr(b, '\n', len - at);
        uint64_t v[2] = {0, 1};
        int n;
        size_t ll = e ? (size_t)(e - b) : len - at;
        line++;
        at += ll + (e != NULL);
        if (ll > 255) {
            mn__log(lg, MN_LOG_ERROR, "%sline %llu: longer than 255 bytes", pre,
                    (unsigned long long)line);
            r = MN_ERR_PARSE;
        } else if (memchr(b, 0, ll)) {
            mn__log(lg, MN_LOG_ERROR, "%sline %llu: a NUL byte (not a text file)", pre,
                    (unsigned long long)line);
            r = MN_ERR_PARSE;
        } else if (!mn__seq_line(b, b + ll, v, &n)) {
            mn__log(lg, MN_LOG_ERROR, "%sline %llu: \"%.*s\": want LENGTH or LENGTH COUNT (whole "
                    "numbers)", pre, (unsigned long long)line, (int)(ll > 60 ? 60 : ll), b);
            r = MN_ERR_PARSE;
        } else if (n && (v[0] < 1 || v[0] > MN__SEQ_MAX)) {
            mn__log(lg, MN_LOG_ERROR, "%sline %llu: length %llu is out of range (want 1..%llu)",
                    pre, (unsigned long long)line, (unsigned long long)v[0], MN__SEQ_MAX);
            r = MN_ERR_INVALID_ARG;
        } else if (n == 2 && (v[1] < 1 || v[1] > 1000000000000ull)) {
            mn__log(lg, MN_LOG_ERROR, "%sline %llu: count %llu is out of range (want 1..10^12)",
                    pre, (unsigned long long)line, (unsigned long long)v[1]);
            r = MN_ERR_INVALID_ARG;
        } else if (n && np == MN__SEQ_MAX_ENTRIES) {
            mn__log(lg, MN_LOG_ERROR, "%sline %llu: more than %u entries", pre,
                    (unsigned long long)line, MN__SEQ_MAX_ENTRIES);
            r = MN_ERR_INVALID_ARG;
        } else if (n) {
            if (np == cap) {
                mn__seq_pair *g;
                cap = cap ? cap * 2 : 256;
                g = (mn__seq_pair *)mn__alloc_array(al, (size_t)cap, sizeof *g);
                if (!g) { r = MN_ERR_OUT_OF_MEMORY; break; }
                if (np) memcpy(g, pairs, (size_t)np * sizeof *g);
                mn__free(al, pairs);
                pairs = g;
            }
            pairs[np].len = v[0], pairs[np].count = v[1], np++;
        }
    }
    if (r == MN_OK && np == 0) {
        mn__log(lg, MN_LOG_ERROR, "%sno lengths (want lines of LENGTH or LENGTH COUNT)", pre);
        r = MN_ERR_INVALID_ARG;
    }
    if (r != MN_OK) goto free_pairs;
    qsort(pairs, (size_t)np, sizeof *pairs, mn__seq_pair_cmp);
    out->len = (uint64_t *)mn__alloc_array(al, (size_t)np, sizeof *out->len);
    out->count = (uint64_t *)mn__alloc_array(al, (size_t)np, sizeof *out->count);
    if (!out->len || !out->count) {
        r = MN_ERR_OUT_OF_MEMORY;
        mn_seq_dist_free(al, out);
        goto free_pairs;
    }
    for (i = 0; i < np; i++) {  // counts of at most 10^12 over 2^20 entries: no overflow
        if (out->n && out->len[out->n - 1] == pairs[i].len) {
            out->count[out->n - 1] += pairs[i].count;
            continue;
        }
        out->len[out->n] = pairs[i].len, out->count[out->n] = pairs[i].count, out->n++;
    }
    out->min = out->len[0], out->max = out->len[out->n - 1];
free_pairs:
    mn__free(al, pairs);
    return r;
}

MNIMPL mn_result mn_seq_dist_parse(const char *text, size_t len, const mn_allocator *allocator,
                                   const mn_logger *logger, mn_seq_dist *out) {
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    if (!text && len) return MN_ERR_INVALID_ARG;
    return mn__seq_parse(text, len, allocator, logger, NULL, out);
}

MNIMPL mn_result mn_seq_dist_read_file(const char *path, const mn_allocator *allocator,
                                       const mn_logger *logger, mn_seq_dist *out) {
    char *text;
    size_t len;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    if (!path) return MN_ERR_INVALID_ARG;
    r = mn__read_file(allocator, path, 64ull << 20, &text, &len);
    if (r == MN_ERR_NOT_FOUND) mn__log(logger, MN_LOG_ERROR, "%s: no such file", path);
    else if (r == MN_ERR_IO)
        mn__log(logger, MN_LOG_ERROR, "%s: cannot be read, or larger than 64 MiB", path);
    if (r != MN_OK) return r;
    r = mn__seq_parse(text, len, allocator, logger, path, out);
    mn__free(allocator, text);
    return r;
}

MNIMPL mn_result mn_seq_dist_range(const char *spec, const mn_logger *logger, mn_seq_dist *out) {
    const char *p = spec, *end;
    char *fend;
    uint64_t lo = 0, hi = 0;
    double mean;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    if (!spec) return MN_ERR_INVALID_ARG;
    end = spec + strlen(spec);
    if (!mn__seq_number(&p, end, &lo) || *p++ != ':' || !mn__seq_number(&p, end, &hi) ||
        *p++ != ':' || !(*p >= '0' && *p <= '9')) {
        mn__log(logger, MN_LOG_ERROR, "\"%.60s\": want MIN:MAX:MEAN such as 32:2048:400", spec);
        return MN_ERR_PARSE;
    }
    mean = strtod(p, &fend);
    if (*fend || !(mean == mean)) {
        mn__log(logger, MN_LOG_ERROR, "\"%.60s\": want MIN:MAX:MEAN such as 32:2048:400", spec);
        return MN_ERR_PARSE;
    }
    if (lo < 1 || hi < lo || hi > MN__SEQ_MAX || mean < (double)lo || mean > (double)hi) {
        mn__log(logger, MN_LOG_ERROR, "\"%.60s\": want 1 <= MIN <= MEAN <= MAX <= %llu", spec,
                MN__SEQ_MAX);
        return MN_ERR_INVALID_ARG;
    }
    out->min = lo, out->max = hi, out->mean = mean;
    return MN_OK;
}

MNIMPL void mn_seq_dist_free(const mn_allocator *allocator, mn_seq_dist *d) {
    if (!d) return;
    mn__free(allocator, d->len);
    mn__free(allocator, d->count);
    d->len = d->count = NULL, d->n = 0;
}

MN__PRIVATE uint64_t mn__splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Mean / width of an exponential density exp(-a t / W) truncated to [0, W): 1/a - 1/(e^a - 1).
MN__PRIVATE double mn__texp_mean(double a) {
    if (a > -1e-6 && a < 1e-6) return 0.5 - a / 12.0;
    if (a > 700.0) return 1.0 / a;
    if (a < -700.0) return 1.0 + 1.0 / a;
    return 1.0 / a - 1.0 / expm1(a);
}

// The rate a (per width) whose truncated mean / width is m, 0 < m < 1 (bisection; the mean falls
// as a grows).
MN__PRIVATE double mn__texp_rate(double m) {
    double lo = -1e6, hi = 1e6;
    int i;
    for (i = 0; i < 200; i++) {
        double mid = 0.5 * (lo + hi);
        if (mn__texp_mean(mid) > m) lo = mid;
        else hi = mid;
    }
    return 0.5 * (lo + hi);
}

// Quantile q in [0, 1] of the truncated exponential of rate a, as a fraction of the width.
MN__PRIVATE double mn__texp_quantile(double q, double a) {
    if (a > -1e-9 && a < 1e-9) return q;
    if (a < 0) return 1.0 - mn__texp_quantile(1.0 - q, -a);
    return -log1p(-q * -expm1(-a)) / a;
}

// The length at quantile q of d (cum: the histogram's running counts; a: the range's rate).
MN__PRIVATE uint64_t mn__seq_quantile(const mn_seq_dist *d, const uint64_t *cum, double a,
                                      double q) {
    if (d->n) {
        double t = q * (double)cum[d->n - 1];
        uint32_t lo = 0, hi = d->n - 1;
        while (lo < hi) {  // first entry whose running count exceeds t
            uint32_t mid = lo + (hi - lo) / 2;
            if ((double)cum[mid] > t) hi = mid;
            else lo = mid + 1;
        }
        return d->len[lo];
    } else {
        double w = (double)(d->max - d->min + 1), x = floor(mn__texp_quantile(q, a) * w);
        uint64_t l = d->min + (x > 0 ? (uint64_t)x : 0);
        return l > d->max ? d->max : l;
    }
}

MN__PRIVATE mn_result mn__seq_dist_check(const mn_seq_dist *d, const mn_logger *lg) {
    uint32_t i;
    if (d->n == 0) {
        if (d->min < 1 || d->max < d->min || d->max > MN__SEQ_MAX || !(d->mean >= (double)d->min) ||
            !(d->mean <= (double)d->max))
            MN__INVALID(lg, "sequence lengths %llu:%llu:%g: want 1 <= MIN <= MEAN <= MAX <= %llu",
                        (unsigned long long)d->min, (unsigned long long)d->max, d->mean,
                        MN__SEQ_MAX);
        return MN_OK;
    }
    if (!d->len || !d->count || d->n > MN__SEQ_MAX_ENTRIES)
        MN__INVALID(lg, "sequence lengths: a histogram without arrays, or too long");
    for (i = 0; i < d->n; i++) {
        if (d->len[i] < 1 || d->len[i] > MN__SEQ_MAX || (i && d->len[i] <= d->len[i - 1]))
            MN__INVALID(lg, "sequence lengths: entry %u, length %llu (want 1..%llu, ascending)", i,
                        (unsigned long long)d->len[i], MN__SEQ_MAX);
        if (d->count[i] < 1 || d->count[i] > 1000000000000ull)
            MN__INVALID(lg, "sequence lengths: entry %u, count %llu (want 1..10^12)", i,
                        (unsigned long long)d->count[i]);
    }
    return MN_OK;
}

MN__PRIVATE int mn__u64_cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

// Messages of the estimate at the longest length say where that length came from.
typedef struct mn__lengths_log {
    const mn_logger *inner;
    uint64_t longest;
} mn__lengths_log;

MN__PRIVATE void mn__lengths_log_fn(void *user, mn_log_level level, const char *msg) {
    const mn__lengths_log *x = (const mn__lengths_log *)user;
    mn__log(x->inner, level, "the longest sequence length (%llu): %s",
            (unsigned long long)x->longest, msg);
}

typedef struct mn__lengths_ctx {
    mn_lengths_result *out;
    uint64_t reserved_peak;  // the most reserved during the steps
} mn__lengths_ctx;

MN__PRIVATE mn_result mn__lengths_mark(void *user, uint64_t mark, mn_cache *cache) {
    mn__lengths_ctx *x = (mn__lengths_ctx *)user;
    mn_cache_statistics st;
    mn_result r;
    if (mark == 0) return MN_OK;  // the load: its peaks are reset after this mark
    if ((r = mn_cache_stats(cache, &st)) != MN_OK) return r;
    x->out->step_peak[mark - 1] = st.allocated_bytes[MN_STAT_ALL].peak;
    x->out->step_reserved[mark - 1] = st.reserved_bytes[MN_STAT_ALL].current;
    if (st.reserved_bytes[MN_STAT_ALL].peak > x->reserved_peak)
        x->reserved_peak = st.reserved_bytes[MN_STAT_ALL].peak;
    return MN_OK;
}

// Replays the steps on a simulated device of capacity bytes (0 = unlimited); *ooms: refusals.
MN__PRIVATE mn_result mn__lengths_replay(mn__sim *S, const uint64_t *marks, uint64_t capacity,
                                         mn_lengths_result *out, uint64_t *ooms) {
    mn_sim_cache sc;
    mn_simdev_desc dd;
    mn_cache_desc cd;
    mn_replay_counts n;
    mn__lengths_ctx x;
    mn_trace_event *t;
    mn_result r;
    t = mn__events_public(S->al, S->ev, S->nev);  // (NULL: no events, or no memory)
    if (!t && S->nev) return MN_ERR_OUT_OF_MEMORY;
    memset(&dd, 0, sizeof dd);
    memset(&cd, 0, sizeof cd);
    dd.capacity = capacity;
    cd.config = S->c->s.alloc_conf;
    cd.logger = S->c->s.logger;
    x.out = out, x.reserved_peak = 0;
    memset(&n, 0, sizeof n);
    if ((r = mn_sim_cache_init(&sc, &dd, &cd)) != MN_OK) goto free_events;
    r = mn_cache_replay_marked(&sc.cache, t, S->nev, marks, S->steps + 1, mn__lengths_mark,
                               &x, &n);
    *ooms = n.failed;
    out->reserved = x.reserved_peak;
    mn_sim_cache_free(&sc);
free_events:
    mn__free(S->al, t);
    return r;
}

MNIMPL mn_result mn_estimate_lengths(const mn_model *model, const mn_setup *setup,
                                     const mn_lengths_desc *desc, mn_lengths_result *out) {
    const mn_logger *lg;
    const mn_seq_dist *d;
    mn_setup s2;
    mn__cfg c;
    mn_gpu gpu;
    mn__sim S;
    mn_result r;
    uint64_t *cum = NULL, *sched = NULL, marks[MN_LENGTHS_MAX_STEPS + 1], rng, lmax, nmb, k, j;
    uint64_t ooms = 0, sum = 0;
    double a = 0, pct;
    uint32_t steps, i;
    int found = 0;
    if (!model || !setup || !desc || !desc->dist || !out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(&S, 0, sizeof S);
    lg = &setup->logger, d = desc->dist;
    if ((r = mn__seq_dist_check(d, lg)) != MN_OK) return r;
    steps = desc->steps ? desc->steps : 32;
    if (steps < 2 || steps > MN_LENGTHS_MAX_STEPS)
        MN__INVALID(lg, "--steps %u is out of range (want 2..%u)", steps, MN_LENGTHS_MAX_STEPS);
    pct = desc->percentile != 0 ? desc->percentile : 99.0;
    if (!(pct > 0 && pct <= 100))
        MN__INVALID(lg, "--percentile %g is out of range (want more than 0, at most 100)", pct);
    if (setup->infer)
        MN__UNSUPPORTED(lg, "--seq-lengths describes training data (not --infer)");
    if (setup->framework == MN_FW_MEMANAT)
        MN__UNSUPPORTED(lg, "--seq-lengths: --framework memanat trains on its position table");
    lmax = d->n ? d->len[d->n - 1] : d->max;
    s2 = *setup;
    s2.seq = lmax;
    {
        mn__lengths_log wrap;
        wrap.inner = lg, wrap.longest = lmax;
        s2.logger.log_fn = lg->log_fn ? mn__lengths_log_fn : NULL, s2.logger.user_data = &wrap;
        r = mn_estimate(model, &s2, &out->longest);
        s2.logger = setup->logger;
        if (r != MN_OK) return r;
    }
    nmb = out->longest.setup.accum < 2 ? 1 : 2;
    if (d->n) {
        cum = (uint64_t *)mn__alloc_array(NULL, d->n, sizeof *cum);
        if (!cum) return MN_ERR_OUT_OF_MEMORY;
        for (i = 0; i < d->n; i++) cum[i] = (i ? cum[i - 1] : 0) + d->count[i];
    } else if (d->max > d->min) {  // the floor of x in [min, max + 1) has about the mean
        a = mn__texp_rate((d->mean + 0.5 - (double)d->min) / (double)(d->max - d->min + 1));
    }
    sched = (uint64_t *)mn__alloc_array(NULL, steps * nmb, sizeof *sched);
    if (!sched) { r = MN_ERR_OUT_OF_MEMORY; goto free_cum; }
    rng = desc->seed;
    for (k = 0; k < steps; k++) {
        int all = 1;  // every micro-batch of step k at the longest length
        for (j = 0; j < nmb; j++) {
            double u = (double)(mn__splitmix64(&rng) >> 11) * (1.0 / 9007199254740992.0);
            double b = (double)out->longest.setup.batch *
                       (j ? (double)(out->longest.setup.accum - 1) : 1.0);
            sched[k * nmb + j] = mn__seq_quantile(d, cum, a, pow(u, 1.0 / b));
            all &= sched[k * nmb + j] == lmax;
        }
        found |= k > 0 && all;
    }
    for (j = 0; !found && j < nmb; j++) sched[(steps - 1) * nmb + j] = lmax;
    r = mn__resolve(model, &s2, &c, &gpu);
    if (r != MN_OK) goto free_sched;
    S.c = &c;
    if ((r = mn__build_params(&S)) != MN_OK) goto free_sim;
    S.events = 1, S.steps = steps, S.mb_seq = sched, S.step_marks = marks;
    mn__run(&S);
    if ((r = S.err) != MN_OK) goto free_sim;
    out->steps = steps;
    r = mn__lengths_replay(&S, marks, 0, out, &ooms);
    if (r == MN_OK && out->reserved > c.s.capacity - c.s.context) {
        // as mn_estimate: PyTorch frees its cached blocks and retries before it gives up
        mn_lengths_result lim = *out;
        r = mn__lengths_replay(&S, marks, c.s.capacity - c.s.context, &lim, &ooms);
        if (r == MN_OK && ooms == 0) *out = lim;
    }
    if (r != MN_OK) goto free_sim;
    {  // the live bytes the events ask for, step by step
        uint64_t e, live = 0, hi;
        for (e = 0; e < marks[0]; e++) live += S.ev[e].alloc ? S.ev[e].size : 0 - S.ev[e].size;
        for (k = 0; k < steps; k++) {
            for (hi = live; e < marks[k + 1]; e++) {
                live += S.ev[e].alloc ? S.ev[e].size : 0 - S.ev[e].size;
                if (live > hi) hi = live;
            }
            out->step_live[k] = hi;
        }
    }
    for (k = 0; k < steps; k++) {
        uint64_t l = sched[k * nmb];
        int all = nmb == 1 || sched[k * nmb] == sched[k * nmb + 1];  // and l == lmax: a worst step
        if (nmb > 1 && sched[k * nmb + 1] > l) l = sched[k * nmb + 1];
        out->step_len[k] = l, sum += l;
        if (l == lmax && all && out->step_peak[k] > out->peak_allocated)
            out->peak_allocated = out->step_peak[k];
        if (l == lmax && all && out->step_live[k] > out->peak_live)
            out->peak_live = out->step_live[k];
    }
    {  // nearest rank: the smallest value with at least pct % of the steps at or below it
        uint64_t sorted[MN_LENGTHS_MAX_STEPS], rank;
        memcpy(sorted, out->step_reserved, steps * sizeof *sorted);
        qsort(sorted, steps, sizeof *sorted, mn__u64_cmp);
        rank = (uint64_t)ceil(pct / 100.0 * steps);
        out->reserved_pct = sorted[(rank ? rank : 1) - 1];
    }
    out->longest_len = lmax;
    out->percentile = pct;
    out->mean_len = (double)sum / steps;
    out->device_used = out->longest.context + out->reserved;
    out->fits = out->device_used <= out->longest.capacity;
free_sim:
    mn__sim_free(&S);
free_sched:
    mn__free(NULL, sched);
free_cum:
    mn__free(NULL, cum);
    return r;
}

MNIMPL mn_result mn_estimate_explain(const mn_model *model, const mn_setup *setup,
                                     mn_explain_item *items, uint32_t cap, uint32_t *count,
                                     uint64_t *peak) {
    enum { MAXG = 256 };
    mn__sim S;
    mn_estimate_result res;
    mn_setup s2;
    mn_result r;
    mn_explain_item g[MAXG], t;
    uint32_t ng = 0, i, j;
    uint64_t k;
    if (!model || !setup || !count || !peak || (cap && !items)) return MN_ERR_INVALID_ARG;
    s2 = *setup;
    s2.no_replay = 1;
    r = mn__estimate(model, &s2, NULL, &res, &S, MN__KEEP_HISTORY, NULL);
    if (r == MN_OK) {
        for (k = 0; k < S.nt; k++) {
            const mn__tensor *T = &S.tensors[k];
            const mn__tensor_hist *H = &S.hist[k];
            if (H->born > S.peak_seq || (H->died && H->died <= S.peak_seq)) continue;
            for (i = 0; i < ng; i++)
                if (g[i].category == (mn_category)T->category && g[i].bytes_each == T->bytes &&
                    !strcmp(g[i].mechanism, H->why))
                    break;
            if (i == ng && ng == MAXG) i = MAXG - 1;  // beyond: merged into the last group
            if (i == ng) {
                g[ng].mechanism = H->why, g[ng].category = (mn_category)T->category;
                g[ng].bytes_each = T->bytes, g[ng].count = 0, g[ng].bytes = 0;
                ng++;
            }
            g[i].count++, g[i].bytes += T->bytes;
        }
        for (i = 1; i < ng; i++)  // insertion sort, largest total first
            for (j = i; j > 0 && g[j].bytes > g[j - 1].bytes; j--)
                t = g[j], g[j] = g[j - 1], g[j - 1] = t;
        for (i = 0; i < ng && i < cap; i++) items[i] = g[i];
        *count = ng, *peak = S.peak;
    }
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
    for (i = 0; r == MN_OK && i < S.np; i++) n += S.params[i].numel;
    mn__sim_free(&S);
    if (r == MN_OK) *out = n;
    return r;
}

// ---- >>estimate/fit: the largest micro-batch, the longest sequence, and a plan ------------------
// A fit runs many estimates of one model. They share one simulation whose arrays are reset, not
// freed, between estimates (no fresh pages, no regrowth copies), and the last few results are
// kept by setup, so that a setup asked again (the plan's report asks what the searches and the
// greedy pass saw) is not run again. Every answer is still decided by estimates alone.

#define MN__FIT_MEMO 32

typedef struct mn__fit_memo {
    mn_setup key;                    // the setup asked, no_replay set
    mn_estimate_result quick, full;  // the step alone; with the allocator replay (has_full)
    mn_result quick_err, full_err;
    int has_full;                    // 1: full; 2: full holds "does not fit" alone (mn__fits)
    int cut;                         // quick holds "does not fit" alone (its run was cut short)
} mn__fit_memo;

typedef struct mn__fit {
    const mn_model *m;
    mn_fit_result *out;
    mn__sim S;                        // the arrays every estimate of the fit reuses
    mn__fit_memo memo[MN__FIT_MEMO];
    uint32_t nmemo, next;             // entries in use; the entry replaced next
    mn__replay_memo rmemo;            // the last replays (mn__replay)
    int whole;                        // 1: every estimate whole, no replay stopped (the tests
                                      // compare the fit's answers with and without)
    uint64_t most_events;             // the most allocation events a run of this fit has made
    uint64_t defer_at;                // 0, or the runs' alone_above (mn__fit_in's deferred pass)
} mn__fit;

// Before a run that keeps its allocation events: where the buffer could not hold the most events
// a run of this fit has made (S->seq counts them whether kept or not), one of twice that, so that
// it is not regrown from 256 events by doubling, each size's fresh pages touched and copied. A
// new buffer's pages fault in again as they are written, so one is made only when the old is too
// small (made whenever the most grew, Llama-3-8B's fit took 980 page faults; now 230). Pages a
// run does not reach are never touched. Without host memory for it the run grows it as before.
MN__PRIVATE void mn__fit_reserve_events(mn__fit *F) {
    mn__sim *S = &F->S;
    uint64_t want = F->most_events * 2;
    if (F->most_events > 0x7ffffff8u || S->cev >= F->most_events) return;  // (mn__grow's limit)
    mn__free(S->al, S->ev);  // (reset: no event in it is read again)
    S->ev = (mn__ev *)mn__alloc_array(S->al, (size_t)want, sizeof *S->ev);
    S->cev = S->ev ? want : 0;
}

// One estimate run in the fit's simulation. decide: only whether it fits is asked (mn__sim);
// alone: where the step alone goes too, or NULL (mn__sim); cut: of a step that does not fit, only
// that (mn__sim).
MN__PRIVATE mn_result mn__fit_run(mn__fit *F, const mn_setup *s, mn_estimate_result *r,
                                  int decide, mn_estimate_result *alone, uint64_t below,
                                  int cut) {
    mn_result x;
    F->out->estimates_run++;
    mn__sim_reset(&F->S);
    if (!s->no_replay) mn__fit_reserve_events(F);
    F->S.decide = decide && !F->whole;
    F->S.cut = cut && !F->whole;
    F->S.unique_ids = F->whole;
    F->S.alone = alone, F->S.alone_below = below, F->S.alone_above = F->defer_at;
    x = mn__estimate_in(F->m, s, r, &F->S, 0, NULL);
    if (F->S.seq > F->most_events) F->most_events = F->S.seq;
    return x;
}

// The entry of setup s with its step-alone result, run now when no entry has it (the oldest
// entry makes room). replay (s is to be replayed when its step alone fits and, below set, its
// peak allocated is below it): one run gives both, the step alone from its simulation and the
// replay after it (decide as mn__fit_run's). cut: where the step does not fit, the caller reads
// only that (mn__fit_run's); an entry that holds only that is run again for other callers.
MN__PRIVATE mn__fit_memo *mn__fit_entry(mn__fit *F, const mn_setup *s, int replay, int decide,
                                        uint64_t below, int cut) {
    mn_setup q = *s;
    mn__fit_memo *e;
    uint32_t i;
    q.no_replay = 1;
    for (i = 0; i < F->nmemo && memcmp(&F->memo[i].key, &q, sizeof q); i++) {}
    if (i < F->nmemo && (cut || !F->memo[i].cut)) return &F->memo[i];
    if (i < F->nmemo) {  // (cut short before: run whole in its place)
        e = &F->memo[i];
    } else {
        e = &F->memo[F->next];
        F->next = (F->next + 1) % MN__FIT_MEMO;
        if (F->nmemo < MN__FIT_MEMO) F->nmemo++;
    }
    e->key = q, e->has_full = 0;
    if (replay && !s->no_replay && !F->whole) {
        mn_result x = mn__fit_run(F, s, &e->full, decide, &e->quick, below, cut);
        e->cut = F->S.over;
        if (!F->S.alone_set) {  // (failed before the replay: the step alone fails alike)
            e->quick = e->full, e->quick_err = x;
        } else if (e->quick_err = MN_OK, F->S.alone_replay) {
            e->full_err = x;
            e->has_full = x == MN_OK && F->S.unsettled ? 2 : 1;
        }
        return e;
    }
    e->quick_err = mn__fit_run(F, &q, &e->quick, 0, NULL, 0, cut);
    e->cut = F->S.over;
    return e;
}

// The entry of setup a, if any, kept for setup b as well when both resolve to the same inputs
// (the setup as given and its resolved form, from which the searches start): an estimate reads
// only what mn__resolve makes of its setup. (Resolved without a logger: nothing said twice.)
MN__PRIVATE void mn__fit_alias(mn__fit *F, const mn_setup *a, const mn_setup *b) {
    mn_setup x = *a, y = *b;
    mn__cfg *c = NULL;
    mn_gpu g[2];
    uint32_t i;
    if (F->whole) return;
    x.no_replay = y.no_replay = 1;
    for (i = 0; i < F->nmemo; i++)
        if (!memcmp(&F->memo[i].key, &y, sizeof y)) return;  // (b has one already)
    for (i = 0; i < F->nmemo; i++)
        if (!memcmp(&F->memo[i].key, &x, sizeof x)) break;
    if (i == F->nmemo) return;
    memset(&x.logger, 0, sizeof x.logger), memset(&y.logger, 0, sizeof y.logger);
    c = (mn__cfg *)mn__alloc_array(NULL, 2, sizeof *c);
    if (c && mn__resolve(F->m, &x, &c[0], &g[0]) == MN_OK &&
        mn__resolve(F->m, &y, &c[1], &g[1]) == MN_OK && !memcmp(&c[0], &c[1], sizeof *c) &&
        !memcmp(&g[0], &g[1], sizeof g[0])) {
        mn__fit_memo *e = &F->memo[F->next];
        if (e == &F->memo[i]) {  // (the oldest entry is a's own: the next one makes room)
            F->next = (F->next + 1) % MN__FIT_MEMO;
            e = &F->memo[F->next];
        }
        F->next = (F->next + 1) % MN__FIT_MEMO;
        if (F->nmemo < MN__FIT_MEMO) F->nmemo++;
        *e = F->memo[i];
        e->key = *b, e->key.no_replay = 1;
    }
    mn__free(NULL, c);
}

// The step alone (no allocator replay): milliseconds. Its device_used counts peak allocated.
// cut: where it does not fit, r says only that (mn__fit_entry).
MN__PRIVATE mn_result mn__quick_estimate(mn__fit *F, const mn_setup *s, mn_estimate_result *r,
                                         int cut) {
    mn__fit_memo *e = mn__fit_entry(F, s, 0, 0, 0, cut);
    *r = e->quick;
    return e->quick_err;
}

// Fits the device? The replay never lowers the peak below what is allocated, so a setup whose
// allocated peak does not fit is rejected without replaying it. full 0: a setup that does not
// fit may get a result that says only that (its replay stopped at an out-of-memory, or its step
// alone was cut short once its peak passed the device); full 1: the estimate whole.
MN__PRIVATE int mn__fits(mn__fit *F, const mn_setup *s, mn_estimate_result *r, mn_result *err,
                         int full) {
    mn__fit_memo *e = mn__fit_entry(F, s, 1, !full, 0, !full);
    mn_result x = e->quick_err;
    *r = e->quick;
    if (x == MN_OK && r->fits && !s->no_replay) {
        if (!e->has_full || (full && e->has_full == 2)) {
            e->full_err = mn__fit_run(F, s, &e->full, !full, NULL, 0, 0);
            e->has_full = e->full_err == MN_OK && F->S.unsettled ? 2 : 1;
        }
        *r = e->full, x = e->full_err;
    }
    if (x != MN_OK) { *err = x; return 0; }
    return r->fits;
}

// Largest value in [1, cap] whose step alone fits, 0 if none (memory grows with batch and
// sequence, so fitting is monotonic in both). The step's device_used is close to affine in batch
// and affine or quadratic in sequence: each value tried is the secant's guess through the two
// values tried last, kept inside the bracket (lo fits, hi does not). Doubling stands in while no
// upper end is known and no rising secant exists, bisection after a try that did not halve the
// bracket. The guesses only choose what to try: the answer is a value that fits, next to one
// that does not.
MN__PRIVATE uint64_t mn__bound(mn__fit *F, mn_setup *s, uint64_t *field, uint64_t cap,
                               mn_result *err) {
    mn_estimate_result r;
    uint64_t lo = 0, hi = cap + 1, v = 1, width = UINT64_MAX;  // hi = cap + 1: none known yet
    double x0 = 0, y0 = 0, x1 = 0, y1 = 0, room = 0;  // the last two points; the capacity
    int n = 0, slow = 0;
    for (;;) {
        double g = -1.0;
        mn_result e;
        *field = v;
        // (at 1 only "does not fit" is read where it does not: the answer is then 0)
        e = mn__quick_estimate(F, s, &r, v == 1);
        if (e != MN_OK && v == 1) return *err = e, 0;
        if (e != MN_OK) {  // a value out of range (a prompt beyond the positions) does not fit
            r.fits = 0, r.device_used = 0;
        } else {
            x0 = x1, y0 = y1, x1 = (double)v, y1 = (double)r.device_used, n++;
            room = (double)r.capacity;
        }
        if (r.fits) lo = v;
        else hi = v;
        if (hi - lo <= 1) return lo;
        slow = hi <= cap && hi - lo > width / 2;  // the bracket did not halve
        if (hi <= cap) width = hi - lo;
        if (n >= 2 && (y1 - y0) / (x1 - x0) > 0)
            g = x1 + (room - y1) / ((y1 - y0) / (x1 - x0));
        if (hi > cap && !(g >= (double)lo + 1)) v = lo > cap / 2 ? cap : lo * 2;
        else if (slow) v = lo + (hi - lo) / 2;
        else if (!(g < (double)(hi - 1))) v = hi - 1;  // (also a NaN guess)
        else if (g < (double)lo + 1) v = lo + 1;
        else v = (uint64_t)g;
    }
}

// Largest value in (lo, hi) that fits with the allocator replay, lo if none: bisection (fits(lo)
// or lo == 0, and !fits(hi)).
MN__PRIVATE uint64_t mn__bisect(mn__fit *F, mn_setup *s, uint64_t *field, uint64_t lo,
                                uint64_t hi, mn_result *err) {
    mn_estimate_result r;
    while (hi - lo > 1 && *err == MN_OK) {
        uint64_t mid = lo + (hi - lo) / 2;
        *field = mid;
        if (mn__fits(F, s, &r, err, 0)) lo = mid;
        else hi = mid;
    }
    return lo;
}

MN__PRIVATE uint64_t mn__search(mn__fit *F, mn_setup *s, uint64_t *field, uint64_t cap,
                                mn_result *err) {
    mn_estimate_result r;
    uint64_t hi, step;
    // 1. the bound from the step alone (reserved >= allocated, so nothing above it fits)
    uint64_t bound = mn__bound(F, s, field, cap, err);
    if (bound == 0 || *err != MN_OK) return 0;
    // 2. with the allocator: gallop down from the bound (allocator slack is a few percent, so
    //    the first step is 1/32 of it), then bisect
    *field = bound;
    if (mn__fits(F, s, &r, err, 0)) return bound;
    hi = bound, step = bound / 32 ? bound / 32 : 1;
    for (;;) {  // (1 is tried before the answer is 0)
        uint64_t cand = bound > step ? bound - step : 1;
        *field = cand;
        if (mn__fits(F, s, &r, err, 0)) return mn__bisect(F, s, field, cand, hi, err);
        if (cand == 1 || *err != MN_OK) return 0;
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
MN__PRIVATE int mn__tech_apply(mn__tech k, mn_setup *s, int bf16) {
    switch (k) {
    case MN__T_SDPA:
        if (s->attention != MN_ATTN_EAGER || s->framework == MN_FW_MEMANAT) return 0;
        s->attention = MN_ATTN_SDPA;
        return 1;
    case MN__T_MIXED:
        if (s->precision != MN_PREC_FP32 || s->infer) return 0;
        s->precision = bf16 ? MN_PREC_BF16 : MN_PREC_FP16;
        return 1;
    case MN__T_ADAM8:
        if (s->optim != MN_OPTIM_ADAMW || s->infer) return 0;
        s->optim = MN_OPTIM_ADAMW_8BIT;
        return 1;
    case MN__T_HALVE:
        if (s->batch < 2 || s->infer) return 0;
        s->batch = (s->batch + 1) / 2, s->accum *= 2;
        return 1;
    case MN__T_SELECTIVE:
        if (s->checkpointing != MN_CKPT_NONE || s->attention != MN_ATTN_EAGER || s->infer) return 0;
        s->checkpointing = MN_CKPT_SELECTIVE;
        return 1;
    case MN__T_FULL:
        if (s->checkpointing == MN_CKPT_FULL || s->infer) return 0;
        s->checkpointing = MN_CKPT_FULL;
        return 1;
    case MN__T_ADAFACTOR:
        if (s->optim == MN_OPTIM_ADAFACTOR || s->optim == MN_OPTIM_SGD ||
            s->optim == MN_OPTIM_NONE || s->lora_rank || s->infer)
            return 0;
        s->optim = MN_OPTIM_ADAFACTOR;
        return 1;
    case MN__T_LORA:  // (the memanat trainer has no adapters, no quantization, one device)
        if (s->lora_rank || s->infer || s->framework == MN_FW_MEMANAT) return 0;
        s->lora_rank = 16, s->lora_targets = MN_LORA_ALL;
        return 1;
    case MN__T_NF4:
        if (s->quant > MN_QUANT_NONE || (!s->lora_rank && !s->infer)) return 0;
        s->quant = MN_QUANT_NF4_DQ;  // QLoRA's recipe: nf4 with double quantization
        return 1;
    case MN__T_OFFLOAD:
        if (s->zero_stage >= 3 || s->infer || s->framework == MN_FW_MEMANAT) return 0;
        s->framework = MN_FW_DEEPSPEED, s->zero_stage = 3, s->offload = MN_OFFLOAD_ALL;
        return 1;
    case MN__T_COUNT: break;
    }
    return 0;
}

MN__PRIVATE void mn__tech_describe(mn__tech k, const mn_setup *s, char *buf, size_t cap) {
    switch (k) {
    case MN__T_SDPA: snprintf(buf, cap, "--attention sdpa"); break;
    case MN__T_MIXED: snprintf(buf, cap, "--precision %s", mn_precision_name(s->precision)); break;
    case MN__T_ADAM8: snprintf(buf, cap, "--optim adamw-8bit"); break;
    case MN__T_HALVE:
        snprintf(buf, cap, "--batch %llu --accum %llu", (unsigned long long)s->batch,
                 (unsigned long long)s->accum);
        break;
    case MN__T_SELECTIVE: snprintf(buf, cap, "--checkpointing selective"); break;
    case MN__T_FULL: snprintf(buf, cap, "--checkpointing full"); break;
    case MN__T_ADAFACTOR: snprintf(buf, cap, "--optim adafactor"); break;
    case MN__T_LORA: snprintf(buf, cap, "--lora-rank 16 --lora-targets all"); break;
    case MN__T_NF4: snprintf(buf, cap, "--quant nf4-dq"); break;
    case MN__T_OFFLOAD: snprintf(buf, cap, "--framework deepspeed --zero 3 --offload all"); break;
    case MN__T_COUNT: buf[0] = 0; break;
    }
}

// The setup after applying steps[0..n) to base, skipping index `skip`.
MN__PRIVATE mn_setup mn__plan_setup(const mn_setup *base, const uint8_t *steps, uint32_t n,
                                    uint32_t skip, int bf16) {
    mn_setup s = *base;
    uint32_t i;
    for (i = 0; i < n; i++)
        if (i != skip) mn__tech_apply((mn__tech)steps[i], &s, bf16);
    return s;
}

// The estimate of the setup as given, with the allocator replay.
MN__PRIVATE mn_result mn__fit_given(mn__fit *F, const mn_setup *setup, mn_estimate_result *cur) {
    mn_result err = mn__fit_run(F, setup, cur, 0, NULL, 0, 0);
    if (err == MN_ERR_UNSUPPORTED && UINTPTR_MAX < UINT64_MAX) {
        // Narrow pointers (wasm32): the simulated device addresses about 1 TiB (mn_simdev_init),
        // so a step needing more cannot be replayed. The step alone then decides: the replay
        // never lowers the peak below what is allocated, so a step whose allocated peak does not
        // fit does not fit replayed either, and the search below starts from it as from the
        // replayed one (it replays only setups whose allocated peak fits).
        mn_estimate_result q;
        if (mn__quick_estimate(F, setup, &q, 0) == MN_OK && !q.fits) {
            *cur = q, err = MN_OK;
            cur->setup.no_replay = setup->no_replay;  // the search replays what it asks after
        }
    }
    return err;
}

// The prune of mn__fit_in judged by the step alone where it can be: drops each step of
// steps[0..*n), the slowest technique first, whose removal still fits. The steps from `slack` on
// were added for the allocator's slack (the allocated peak fit before them), so their removal is
// replayed; the others' is judged by the allocated peak alone (a lower bound of the reserved
// one). *s gets the setup left, unchanged when none is dropped. Every step it keeps is needed:
// without it the replay does not fit, or even the allocated peak does not. The estimates it runs
// stay in the fit's memo for the replayed prune.
MN__PRIVATE void mn__prune_alone(mn__fit *F, const mn_setup *base, int bf16, uint8_t *steps,
                                 uint32_t *n, uint32_t slack, mn_setup *s, mn_result *err) {
    uint32_t i, k, tests = *n;  // (each step is tested once)
    for (k = MN__T_COUNT; k-- > 0;) {
        for (i = *n; i-- > 0;) {
            mn_estimate_result r;
            mn__fit_memo *e;
            mn_setup t;
            int fits;
            if (steps[i] != k) continue;
            t = mn__plan_setup(base, steps, *n, i, bf16);
            if (i >= slack) {
                fits = mn__fits(F, &t, &r, err, 0);
            } else {
                // (the last test: where its removal fits, its setup is the one the caller
                // replays, so the run that gives its step alone replays it too)
                e = mn__fit_entry(F, &t, tests == 1, 1, 0, 1);
                *err = e->quick_err, fits = e->quick.fits;
            }
            tests--;
            if (*err != MN_OK) return;
            if (!fits) continue;
            memmove(&steps[i], &steps[i + 1], (*n - i - 1) * sizeof steps[0]);
            --*n, *s = t;
            if (i < slack) slack--;
        }
    }
}

MN__PRIVATE mn_result mn__fit_in(mn__fit *F, const mn_setup *setup) {
    mn_fit_result *out = F->out;
    mn_estimate_result cur, next, cur0;
    mn_setup base, s, t;
    mn_result err = MN_OK;
    uint64_t cap_seq;
    uint8_t steps[32];
    uint32_t n = 0, i, k;
    int bf16, progress, given = 0, given0, replayed, defer, deferred;
    uint32_t slack;  // the steps from this one on were added for the allocator's slack
    out->plan_slowdown = 1.0;
    // The setup as given. Its step alone comes first: when its allocated peak does not fit, its
    // replay (the costliest part of an estimate) cannot fit either and changes no decision below,
    // so it is run only at the end, and only if this setup's estimate is then the answer.
    // Deferred only where that replay could not fail either: no allocator config to parse, no
    // tensor of 1 EiB or more (mn__replay refuses one; the peak holds every tensor).
    if (!setup->no_replay && !setup->alloc_conf) {
        (void)mn__quick_estimate(F, setup, &cur, 0);  // (the step alone first: events cost more)
        (void)mn__fits(F, setup, &cur, &err, 0);
        given = err == MN_OK && !cur.fits && cur.peak_allocated < (1ull << 60);
        if (given) cur.setup.no_replay = 0;  // cur is the step alone; the search replays
        else if (err == MN_OK && !cur.fits) err = mn__fit_given(F, setup, &cur);
    } else {
        err = mn__fit_given(F, setup, &cur);
    }
    if (err != MN_OK) return err;
    out->estimates_run = 1;
    base = cur.setup;
    base.logger = setup->logger;
    mn__fit_alias(F, setup, &base);
    bf16 = cur.gpu.bf16;
    t = base;
    out->max_batch = mn__search(F, &t, &t.batch, 1ull << 20, &err);
    if (err != MN_OK) return err;
    t = base;
    cap_seq = 1ull << 22;
    if (cur.model.posemb == MN_POS_LEARNED && cur.model.arch != MN_ARCH_STACK)
        cap_seq = cur.model.max_positions;
    if (base.infer) out->max_seq = mn__search(F, &t, &t.prompt, cap_seq, &err);
    else if (base.framework != MN_FW_MEMANAT)  // (memanat: T is the model's position table)
        out->max_seq = mn__search(F, &t, &t.seq, cap_seq, &err);
    if (err != MN_OK) return err;

    // Greedy: add the cheapest technique that lowers the memory need until the setup fits
    // (compared on the step alone, confirmed with the allocator replay). The first pass defers
    // that replay where the step alone leaves an eighth of the device free (the allocator's
    // slack is a few percent of it) and the plan has two steps or more (one step's removal is
    // the setup as given, which does not fit): the pass stops there, the prune judges the
    // removals as below, and the plan left is replayed (this setup itself where the prune drops
    // nothing). Where that replay does not fit, the search runs again, every step confirmed
    // (the estimates it has run are kept in the memo); where it fits, the greedy pass's own
    // replay, of a setup the plan does not keep, is saved.
    cur0 = cur, given0 = given;
    for (defer = 1;; defer = 0) {
        s = base, n = 0, slack = 32, progress = 1, replayed = 1, deferred = 0;
        cur = cur0, given = given0;
        if (!cur.fits) {
            mn_estimate_result q, qn;
            uint64_t room = defer ? cur.capacity - cur.capacity / 8 : 0;
            if ((err = mn__quick_estimate(F, &s, &q, 0)) != MN_OK) return err;
            if (q.fits) slack = 0;  // (the allocated peak fits already)
            while (!cur.fits && progress && n < sizeof steps) {
                progress = 0;
                for (k = 0; k < MN__T_COUNT && !progress; k++) {
                    mn__fit_memo *e;
                    t = s;
                    if (!mn__tech_apply((mn__tech)k, &t, bf16)) continue;
                    // (one run: its step alone, and the replay mn__fits asks below when it
                    // helps and is not deferred)
                    F->defer_at = n ? room : 0;
                    e = mn__fit_entry(F, &t, 1, 1, q.peak_allocated, 0);
                    F->defer_at = 0;
                    if ((err = e->quick_err) != MN_OK) return err;
                    qn = e->quick;
                    if (qn.peak_allocated >= q.peak_allocated) continue;  // no help here
                    steps[n++] = (uint8_t)k, s = t, q = qn, progress = 1, given = 0;
                    if (n > 1 && q.fits && q.device_used <= room) {
                        cur = q, deferred = 1;  // (the step alone: replayed after the prune)
                        break;
                    }
                    mn__fits(F, &s, &cur, &err, 0);
                    if (err != MN_OK) return err;
                    if (q.fits && !cur.fits && slack > n) slack = n;
                }
            }
            // no plan fits: the last setup tried is the answer, whole
            if (!cur.fits && n > 0 && (mn__fits(F, &s, &cur, &err, 1), err != MN_OK)) return err;
        }
        // Prune: drop each step, the slowest first, whose removal still fits. The replays cost
        // the most, so only the removal of a step added for the allocator's slack is replayed,
        // the others are judged by the step alone, and the plan left is replayed once; where
        // that replay does not fit, each removal is replayed.
        if (cur.fits && n > 0) {
            uint8_t kept[sizeof steps];
            uint32_t m = n;
            memcpy(kept, steps, n);
            t = s;
            mn__prune_alone(F, &base, bf16, kept, &m, slack, &t, &err);
            if (err == MN_OK && m < n && mn__fits(F, &t, &next, &err, 0))
                memcpy(steps, kept, m), n = m, s = t, cur = next, replayed = 0, deferred = 0;
            if (err != MN_OK) return err;
            if (m == n) replayed = 0;  // (no removal fits)
        }
        if (!deferred) break;   // (confirmed step by step, or the plan left fit replayed)
        if (replayed) continue;  // (the plan left does not fit replayed)
        if (mn__fits(F, &s, &cur, &err, 0)) break;  // (the prune dropped nothing: the pass's own)
        if (err != MN_OK) return err;
    }
    for (k = MN__T_COUNT; replayed && cur.fits && k-- > 0;) {
        for (i = n; i-- > 0;) {
            if (steps[i] != k) continue;
            t = mn__plan_setup(&base, steps, n, i, bf16);
            if (!mn__fits(F, &t, &next, &err, 0)) {
                if (err != MN_OK) return err;
                continue;
            }
            memmove(&steps[i], &steps[i + 1], (n - i - 1) * sizeof steps[0]);
            n--, s = t, cur = next;
        }
    }
    // Report the kept steps with the peak each one saves (the step alone: what is allocated).
    t = base;
    if ((err = mn__quick_estimate(F, &t, &next, 0)) != MN_OK) return err;
    for (i = 0; i < n && out->plan_len < sizeof out->plan / sizeof out->plan[0]; i++) {
        mn_estimate_result after;
        mn_plan_step *p = &out->plan[out->plan_len++];
        char a[32], b[32];
        mn__tech_apply((mn__tech)steps[i], &t, bf16);
        if ((err = mn__quick_estimate(F, &t, &after, 0)) != MN_OK) return err;
        mn__tech_describe((mn__tech)steps[i], &t, p->what, sizeof p->what);
        mn_size_format(next.peak_allocated, a, sizeof a);
        mn_size_format(after.peak_allocated, b, sizeof b);
        snprintf(p->why, sizeof p->why, "%s: peak %s -> %s, step time x%.2f",
                 mn__techs[steps[i]].note, a, b, mn__techs[steps[i]].factor);
        out->plan_slowdown *= mn__techs[steps[i]].factor;
        next = after;
    }
    if (given && (err = mn__fit_given(F, setup, &cur)) != MN_OK) return err;
    out->plan_found = cur.fits;
    out->plan_setup = s;
    out->plan_setup.logger.log_fn = NULL, out->plan_setup.logger.user_data = NULL;
    out->plan_estimate = cur;
    return MN_OK;
}

MN__PRIVATE mn_result mn__fit_with(const mn_model *model, const mn_setup *setup,
                                   mn_fit_result *out, int whole) {
    mn__fit *F;
    mn_result r;
    if (!model || !setup || !out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    F = (mn__fit *)mn__alloc(NULL, sizeof *F);
    if (!F) return MN_ERR_OUT_OF_MEMORY;
    memset(F, 0, sizeof *F);
    F->m = model, F->out = out, F->whole = whole;
    F->S.rmemo = whole ? NULL : &F->rmemo;
    r = mn__fit_in(F, setup);
    mn__sim_free(&F->S);
    mn__replay_memo_free(&F->rmemo);
    mn__free(NULL, F);
    return r;
}

MNIMPL mn_result mn_fit(const mn_model *model, const mn_setup *setup, mn_fit_result *out) {
    return mn__fit_with(model, setup, out, 0);
}
// >>hfconfig implementation -----------------------------------------------------------------------
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
    if (strcmp(f->type, "phi3") == 0) {  // modeling_phi3.py: qkv_proj and gate_up_proj
        MN__HF_TRY(mn__hf_prob(c, "resid_pdrop", 0.0, &m->dropout));
        m->fused_proj = 1, m->rope_cat = 1;  // apply_rotary_pos_emb: cat([rotated, pass])
    }
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
                uint64_t shape = 0;
                if (mn_model_params(&m, &shape) != MN_OK) shape = 0;
                if (shape && info.params < shape) {  // a missing shard, or a partial checkpoint
                    mn__log(&d.logger, MN_LOG_WARN,
                            "%s: the safetensors files hold %llu parameters, fewer than the %llu "
                            "of config.json's shape; the shape's count is used", path,
                            (unsigned long long)info.params, (unsigned long long)shape);
                } else {
                    if (shape && info.params - shape > shape / 100)
                        mn__log(&d.logger, MN_LOG_WARN,
                                "%s: the safetensors files hold %llu parameters, %llu more than "
                                "config.json's shape; they are counted as extra matrices", path,
                                (unsigned long long)info.params,
                                (unsigned long long)(info.params - shape));
                    m.params = info.params;
                }
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
// >>cache implementation --------------------------------------------------------------------------
//
// Invariant (PyTorch test_cuda.py, _check_memory_stat_consistency): the blocks of a segment tile
// it exactly (prev/next in address order, no gap, no overlap); every free mapped block is in its
// pool's bins in (stream, size, address) order, every unmapped block of an expandable segment in
// the pool's unmapped tree, every allocated block in the address map or the recent entries; and
// the statistics equal the sums over the blocks. Sources of the rules:
// c10/cuda/CUDACachingAllocator.cpp and c10/cuda/CUDAAllocatorConfig.cpp (reference/allocator.md
// has the facts).

// PyTorch CUDACachingAllocator.cpp constants.
#define MN__C_MIN_BLOCK 512ull              // kMinBlockSize
#define MN__C_SMALL_SIZE 1048576ull         // kSmallSize
#define MN__C_SMALL_BUFFER 2097152ull       // kSmallBuffer
#define MN__C_LARGE_BUFFER 20971520ull      // kLargeBuffer
#define MN__C_MIN_LARGE_ALLOC 10485760ull   // kMinLargeAlloc
#define MN__C_ROUND_LARGE 2097152ull        // kRoundLarge
#define MN__C_ONE_EXA 1152921504606846976ull  // one_exa_bytes
#define MN__C_MIB 1048576ull

// ---- >>cache/simdev: simulated device -----------------------------------------------------------

MNIMPL mn_result mn_simdev_init(mn_simdev *dev, const mn_simdev_desc *desc) {
    uint64_t span;
    if (!dev) return MN_ERR_INVALID_ARG;
    memset(dev, 0, sizeof *dev);
    if (desc) dev->desc = *desc;
    if (dev->desc.addr_shift == 0 && UINTPTR_MAX < UINT64_MAX) dev->desc.addr_shift = 9;
    if (dev->desc.addr_shift > 9) return MN_ERR_INVALID_ARG;
    // 64-bit pointers: reserved ranges 16 TiB above the physical ones, no end. Narrower ones:
    // the addresses they can carry (2 TiB with 32 bits), half physical, half reserved.
    span = ((uint64_t)UINTPTR_MAX >> 1) + 1;
    span = UINTPTR_MAX < UINT64_MAX ? span << dev->desc.addr_shift : 1ull << 44;
    if (dev->desc.base == 0)
        dev->desc.base = UINTPTR_MAX < UINT64_MAX ? 1ull << 21 : 0x7f0000000000ull;
    if (dev->desc.base % MN__C_MIN_BLOCK) return MN_ERR_INVALID_ARG;
    if (UINTPTR_MAX < UINT64_MAX && dev->desc.base >= span) return MN_ERR_INVALID_ARG;
    dev->next_addr = dev->desc.base;
    dev->next_va = UINTPTR_MAX < UINT64_MAX ? span : dev->desc.base + span;
    dev->end_addr = UINTPTR_MAX < UINT64_MAX ? span : UINT64_MAX;
    dev->end_va = UINTPTR_MAX < UINT64_MAX ? 2 * span : UINT64_MAX;
    dev->fail_at = dev->desc.fail_alloc_at;
    return MN_OK;
}

MNIMPL void mn_simdev_free(mn_simdev *dev) {
    if (!dev) return;
    mn__free(&dev->desc.allocator, dev->events);
    dev->events = NULL;
    dev->event_count = dev->event_cap = 0;
}

MNIMPL void mn_simdev_fail_alloc_at(mn_simdev *dev, uint64_t n) {
    if (dev) dev->fail_at = n ? dev->alloc_calls + dev->map_calls + n : 0;
}

// Counts one device allocation and says whether it must fail (injection or capacity).
MN__PRIVATE mn_result mn__c_simdev_take(mn_simdev *dev, uint64_t size) {
    uint64_t calls = dev->alloc_calls + dev->map_calls;
    if (dev->fail_at && calls == dev->fail_at) {
        dev->fail_at = 0;
        dev->failed_calls++;
        return MN_ERR_DEVICE_OOM;
    }
    if (dev->desc.capacity &&
        (size > dev->desc.capacity || dev->used > dev->desc.capacity - size)) {
        dev->failed_calls++;
        return MN_ERR_DEVICE_OOM;
    }
    dev->used += size;
    if (dev->used > dev->peak_used) dev->peak_used = dev->used;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_alloc(void *ud, uint64_t size, void **ptr_out) {
    mn_simdev *dev = (mn_simdev *)ud;
    uint64_t step;
    mn_result r;
    dev->alloc_calls++;
    // addresses advance by the size rounded to 2 MiB plus a 2 MiB gap: segments never touch
    if (size == 0 || size > (1ull << 62)) return MN_ERR_INVALID_ARG;
    step =
        (size + MN__C_ROUND_LARGE - 1) / MN__C_ROUND_LARGE * MN__C_ROUND_LARGE + MN__C_ROUND_LARGE;
    if (step > dev->end_addr - dev->next_addr) return MN_ERR_UNSUPPORTED;  // addresses run out
    r = mn__c_simdev_take(dev, size);
    if (r != MN_OK) return r;
    dev->live++;
    *ptr_out = (void *)(uintptr_t)(dev->next_addr >> dev->desc.addr_shift);
    dev->next_addr += step;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_release(void *ud, void *ptr, uint64_t size) {
    mn_simdev *dev = (mn_simdev *)ud;
    (void)ptr;
    if (size > dev->used) return MN_ERR_INVALID_ARG;
    dev->used -= size;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_free_fn(void *ud, void *ptr, uint64_t size) {
    mn_simdev *dev = (mn_simdev *)ud;
    dev->free_calls++;
    if (dev->live == 0) return MN_ERR_INVALID_ARG;
    dev->live--;
    return mn__c_simdev_release(ud, ptr, size);
}

MN__PRIVATE mn_result mn__c_simdev_mem_info(void *ud, uint64_t *free_out, uint64_t *total_out) {
    mn_simdev *dev = (mn_simdev *)ud;
    uint64_t total = dev->desc.capacity ? dev->desc.capacity : (1ull << 50);
    *total_out = total;
    *free_out = total > dev->used ? total - dev->used : 0;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_event_record(void *ud, mn_stream stream, mn_event *out) {
    mn_simdev *dev = (mn_simdev *)ud;
    if (dev->event_count == dev->event_cap) {
        uint32_t cap = dev->event_cap ? dev->event_cap * 2 : 16;
        mn_simdev_event *ev = (mn_simdev_event *)mn__alloc_array(&dev->desc.allocator, cap,
                                                                 sizeof *ev);
        if (!ev) return MN_ERR_OUT_OF_MEMORY;
        if (dev->event_count) memcpy(ev, dev->events, dev->event_count * sizeof *ev);
        mn__free(&dev->desc.allocator, dev->events);
        dev->events = ev;
        dev->event_cap = cap;
    }
    dev->events[dev->event_count].id = ++dev->next_event;
    dev->events[dev->event_count].stream = stream;
    dev->events[dev->event_count].done = dev->desc.events_complete != 0;
    dev->event_count++;
    *out = dev->next_event;
    return MN_OK;
}

MN__PRIVATE mn_simdev_event *mn__c_simdev_find_event(mn_simdev *dev, mn_event e) {
    uint32_t i;
    for (i = 0; i < dev->event_count; i++)
        if (dev->events[i].id == e) return &dev->events[i];
    return NULL;
}

MN__PRIVATE int mn__c_simdev_event_query(void *ud, mn_event e) {
    mn_simdev_event *ev = mn__c_simdev_find_event((mn_simdev *)ud, e);
    return !ev || ev->done;
}

MN__PRIVATE mn_result mn__c_simdev_event_sync(void *ud, mn_event e) {
    mn_simdev_event *ev = mn__c_simdev_find_event((mn_simdev *)ud, e);
    if (ev) ev->done = 1;  // the simulated stream finishes its work
    return MN_OK;
}

MN__PRIVATE void mn__c_simdev_event_free(void *ud, mn_event e) {
    mn_simdev *dev = (mn_simdev *)ud;
    mn_simdev_event *ev = mn__c_simdev_find_event(dev, e);
    if (ev) *ev = dev->events[--dev->event_count];
}

MN__PRIVATE mn_result mn__c_simdev_reserve(void *ud, uint64_t size, void **base_out) {
    mn_simdev *dev = (mn_simdev *)ud;
    uint64_t step;
    if (size == 0 || size > (1ull << 56)) return MN_ERR_INVALID_ARG;
    step = (size + MN__C_LARGE_BUFFER - 1) / MN__C_LARGE_BUFFER * MN__C_LARGE_BUFFER;
    step += MN__C_LARGE_BUFFER;
    if (step > dev->end_va - dev->next_va) return MN_ERR_UNSUPPORTED;  // addresses run out
    *base_out = (void *)(uintptr_t)(dev->next_va >> dev->desc.addr_shift);
    dev->next_va += step;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_unreserve(void *ud, void *base, uint64_t size) {
    (void)ud, (void)base, (void)size;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_simdev_map(void *ud, void *addr, uint64_t size) {
    mn_simdev *dev = (mn_simdev *)ud;
    (void)addr;
    dev->map_calls++;
    return mn__c_simdev_take(dev, size);
}

MN__PRIVATE mn_result mn__c_simdev_unmap(void *ud, void *addr, uint64_t size) {
    ((mn_simdev *)ud)->unmap_calls++;
    return mn__c_simdev_release(ud, addr, size);
}

// NULL: a device of no functions, which mn_cache_init refuses.
MNIMPL mn_device mn_simdev_device(mn_simdev *dev) {
    mn_device d;
    memset(&d, 0, sizeof d);
    if (!dev) return d;
    d.alloc_fn = mn__c_simdev_alloc;
    d.free_fn = mn__c_simdev_free_fn;
    d.mem_info_fn = mn__c_simdev_mem_info;
    d.event_record_fn = mn__c_simdev_event_record;
    d.event_query_fn = mn__c_simdev_event_query;
    d.event_sync_fn = mn__c_simdev_event_sync;
    d.event_free_fn = mn__c_simdev_event_free;
    d.reserve_fn = mn__c_simdev_reserve;
    d.unreserve_fn = mn__c_simdev_unreserve;
    d.map_fn = mn__c_simdev_map;
    d.unmap_fn = mn__c_simdev_unmap;
    d.user_data = dev;
    d.addr_shift = dev->desc.addr_shift;
    return d;
}

MNIMPL void mn_simdev_complete_event(mn_simdev *dev, mn_event e) {
    mn_simdev_event *ev = dev ? mn__c_simdev_find_event(dev, e) : NULL;
    if (ev) ev->done = 1;
}

MNIMPL void mn_simdev_sync_stream(mn_simdev *dev, mn_stream stream) {
    uint32_t i;
    for (i = 0; dev && i < dev->event_count; i++)
        if (dev->events[i].stream == stream) dev->events[i].done = 1;
}

MNIMPL void mn_simdev_sync(mn_simdev *dev) {
    uint32_t i;
    for (i = 0; dev && i < dev->event_count; i++) dev->events[i].done = 1;
}

MNIMPL uint32_t mn_simdev_pending_events(const mn_simdev *dev) {
    uint32_t i, n = 0;
    for (i = 0; dev && i < dev->event_count; i++) n += !dev->events[i].done;
    return n;
}

// ---- >>cache/hostdev: host memory as a device ---------------------------------------------------
// A segment is one host allocation of size + MN_HOSTDEV_ALIGN bytes: the returned address is the
// first aligned one past a pointer-sized slot, and the slot just below it keeps the pointer the
// host allocator gave, for the free.

MNIMPL mn_result mn_hostdev_init(mn_hostdev *dev, const mn_hostdev_desc *desc) {
    if (!dev) return MN_ERR_INVALID_ARG;
    memset(dev, 0, sizeof *dev);
    if (desc) dev->desc = *desc;
    if (!dev->desc.allocator.alloc_fn != !dev->desc.allocator.free_fn) return MN_ERR_INVALID_ARG;
    return MN_OK;
}

MNIMPL mn_result mn_hostdev_free(mn_hostdev *dev) {
    if (!dev) return MN_ERR_INVALID_ARG;
    return dev->live ? MN_ERR_STATE : MN_OK;
}

MN__PRIVATE mn_result mn__c_hostdev_alloc(void *ud, uint64_t size, void **ptr_out) {
    mn_hostdev *dev = (mn_hostdev *)ud;
    uint64_t calls = ++dev->alloc_calls;
    unsigned char *raw;
    uintptr_t at;
    if (size == 0 || size > (uint64_t)SIZE_MAX - MN_HOSTDEV_ALIGN) return MN_ERR_INVALID_ARG;
    if ((dev->desc.fail_alloc_at && calls == dev->desc.fail_alloc_at) ||
        (dev->desc.capacity &&
         (size > dev->desc.capacity || dev->used > dev->desc.capacity - size)))
        return dev->failed_calls++, MN_ERR_DEVICE_OOM;
    raw = (unsigned char *)mn__alloc(&dev->desc.allocator, (size_t)size + MN_HOSTDEV_ALIGN);
    if (!raw) return dev->failed_calls++, MN_ERR_DEVICE_OOM;  // the host is the device: it is full
    at = ((uintptr_t)raw + sizeof(void *) + MN_HOSTDEV_ALIGN - 1) &
         ~(uintptr_t)(MN_HOSTDEV_ALIGN - 1);
    memcpy((void *)(at - sizeof(void *)), &raw, sizeof raw);
    dev->used += size, dev->live++;
    if (dev->used > dev->peak_used) dev->peak_used = dev->used;
    *ptr_out = (void *)at;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_hostdev_release(void *ud, void *ptr, uint64_t size) {
    mn_hostdev *dev = (mn_hostdev *)ud;
    void *raw;
    if (!ptr || size > dev->used || dev->live == 0) return MN_ERR_INVALID_ARG;
    memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof raw);
    mn__free(&dev->desc.allocator, raw);
    dev->used -= size, dev->live--, dev->free_calls++;
    return MN_OK;
}

MN__PRIVATE mn_result mn__c_hostdev_mem_info(void *ud, uint64_t *free_out, uint64_t *total_out) {
    const mn_hostdev *dev = (const mn_hostdev *)ud;
    uint64_t total = dev->desc.capacity ? dev->desc.capacity : 1ull << 50;
    *total_out = total;
    *free_out = total - dev->used;
    return MN_OK;
}

MNIMPL mn_device mn_hostdev_device(mn_hostdev *dev) {  // NULL: as mn_simdev_device
    mn_device d;
    memset(&d, 0, sizeof d);
    if (!dev) return d;
    d.alloc_fn = mn__c_hostdev_alloc;
    d.free_fn = mn__c_hostdev_release;
    d.mem_info_fn = mn__c_hostdev_mem_info;
    d.user_data = dev;
    return d;
}

// ---- >>cache/config: configuration --------------------------------------------------------------

MN__PRIVATE int mn__c_is_pow2(uint64_t v) { return v && !(v & (v - 1)); }

MN__PRIVATE uint32_t mn__c_log2_floor(uint64_t v) {  // v > 0
#if defined(__GNUC__) || defined(__clang__)
    return 63u - (uint32_t)__builtin_clzll(v);
#else
    uint32_t r = 0;
    while (v >>= 1) r++;
    return r;
#endif
}

// Tokens as CUDAAllocatorConfig::lexArgs makes them: ',' ':' '[' ']' alone, spaces dropped.
typedef struct mn__c_cfg_tok {
    const char *s;
    size_t n;
} mn__c_cfg_tok;

MN__PRIVATE int mn__c_tok_is(const mn__c_cfg_tok *t, const char *w) {
    size_t n = strlen(w);
    return t->n == n && memcmp(t->s, w, n) == 0;
}

// Parses a whole token as an unsigned decimal.
MN__PRIVATE int mn__c_tok_u64(const mn__c_cfg_tok *t, uint64_t *out) {
    uint64_t v = 0;
    size_t i;
    if (t->n == 0 || t->n > 19) return 0;
    for (i = 0; i < t->n; i++) {
        if (t->s[i] < '0' || t->s[i] > '9') return 0;
        v = v * 10 + (uint64_t)(t->s[i] - '0');
    }
    *out = v;
    return 1;
}

MN__PRIVATE int mn__c_tok_double(const mn__c_cfg_tok *t, double *out) {
    char buf[64], *end = NULL;
    size_t i;
    int digits = 0;
    if (t->n == 0 || t->n >= sizeof buf) return 0;
    for (i = 0; i < t->n; i++) {
        char ch = t->s[i];
        if (!((ch >= '0' && ch <= '9') || ch == '.' || ch == 'e' || ch == 'E' || ch == '-' ||
              ch == '+'))
            return 0;
        digits += ch >= '0' && ch <= '9';
    }
    if (!digits) return 0;
    memcpy(buf, t->s, t->n);
    buf[t->n] = 0;
    *out = strtod(buf, &end);
    return end == buf + t->n;
}

MN__PRIVATE int mn__c_tok_bool(const mn__c_cfg_tok *t, int *out) {
    if (mn__c_tok_is(t, "True")) return *out = 1, 1;
    if (mn__c_tok_is(t, "False")) return *out = 0, 1;
    return 0;
}

#define MN__C_CFG_MAX_TOKENS 256

// The parser walks the token list as CUDAAllocatorConfig::parseArgs does: each key's parse
// function consumes its value (and, for a list, the tokens up to ']') and returns the index of
// the next token, or 0 after logging what is wrong.
typedef struct mn__c_cfg_parser {
    mn__c_cfg_tok tok[MN__C_CFG_MAX_TOKENS];
    size_t count;
    const mn_logger *lg;
    mn_cache_config cfg;
    mn_result err;       // MN_ERR_CONFIG, or MN_ERR_UNSUPPORTED for a valid but unmodelled value
    char key[48];        // the key being parsed, for messages
} mn__c_cfg_parser;

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
MN__PRIVATE size_t mn__c_cfg_fail(mn__c_cfg_parser *P, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    mn__log(P->lg, MN_LOG_ERROR, "allocator config: %s", msg);
    return 0;
}

// CUDAAllocatorConfig::lexArgs: ',' ':' '[' ']' are tokens of their own, white space separates.
MN__PRIVATE int mn__c_cfg_lex(mn__c_cfg_parser *P, const char *p) {
    while (*p) {
        mn__c_cfg_tok *t = &P->tok[P->count];
        if (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') { p++; continue; }
        if (P->count == MN__C_CFG_MAX_TOKENS)
            return (int)mn__c_cfg_fail(P, "more than %d tokens", MN__C_CFG_MAX_TOKENS);
        t->s = p;
        if (*p == ',' || *p == ':' || *p == '[' || *p == ']') {
            t->n = 1, p++;
        } else {
            while (*p && *p != ',' && *p != ':' && *p != '[' && *p != ']' && *p != ' ' &&
                   *p != '\t' && *p != '\n' && *p != '\r')
                p++;
            t->n = (size_t)(p - t->s);
        }
        P->count++;
    }
    return 1;
}

// parseMaxSplitSize and its siblings: a whole number of MiB.
MN__PRIVATE size_t mn__c_cfg_size_mb(mn__c_cfg_parser *P, size_t i) {
    const mn__c_cfg_tok *key = &P->tok[i - 2], *val = &P->tok[i];
    int is_seg = mn__c_tok_is(key, "large_segment_size_mb");
    uint64_t u = 0;
    if (!mn__c_tok_u64(val, &u))
        return mn__c_cfg_fail(P, "%s expects a whole number of MiB", P->key);
    // CUDAAllocatorConfig::parseMaxSplitSize: "too small, must be > 20"
    if (!is_seg && u <= MN__C_LARGE_BUFFER / MN__C_MIB)
        return mn__c_cfg_fail(P, "CachingAllocator option %s too small, must be > 20", P->key);
    if (is_seg && (u == 0 || u % 2 != 0))
        return mn__c_cfg_fail(P, "%s must be a positive multiple of 2", P->key);
    if (u > (UINT64_MAX >> 20)) u = UINT64_MAX >> 20;  // clamped as PyTorch does
    if (mn__c_tok_is(key, "max_split_size_mb")) P->cfg.max_split_size = u << 20;
    else if (is_seg) P->cfg.large_segment_size = u << 20;
    else P->cfg.max_non_split_rounding = u << 20;
    return i + 1;
}

MN__PRIVATE int mn__c_cfg_divisions(mn__c_cfg_parser *P, const mn__c_cfg_tok *val, uint32_t *out) {
    uint64_t u = 0;
    if (!mn__c_tok_u64(val, &u) || (u != 0 && !mn__c_is_pow2(u)) || u > (1u << 20))
        return (int)mn__c_cfg_fail(P, "roundup_power2_divisions: the divisions have to be a power "
                                   "of 2 or 0 to disable roundup");
    *out = (uint32_t)u;
    return 1;
}

// CUDAAllocatorConfig::parseRoundUpPower2Divisions: one number for every interval, or a list
// [size_mb:divisions, ..., >:divisions] whose first entry also covers the smaller intervals and
// whose '>' entry covers those after the last one named.
MN__PRIVATE size_t mn__c_cfg_roundup(mn__c_cfg_parser *P, size_t i) {
    uint32_t *div = P->cfg.roundup_power2_divisions, d = 0;
    size_t last_index = 0, k;
    int first = 1;
    if (!mn__c_tok_is(&P->tok[i], "[")) {
        if (!mn__c_cfg_divisions(P, &P->tok[i], &d)) return 0;
        for (k = 0; k < MN_CACHE_ROUNDUP_INTERVALS; k++) div[k] = d;
        return i + 1;
    }
    for (i++;;) {
        const mn__c_cfg_tok *interval;
        if (i >= P->count) return mn__c_cfg_fail(P, "roundup_power2_divisions misses ']'");
        if (mn__c_tok_is(&P->tok[i], "]")) return i + 1;
        if (mn__c_tok_is(&P->tok[i], ",")) { i++; continue; }
        if (i + 2 >= P->count || !mn__c_tok_is(&P->tok[i + 1], ":"))
            return mn__c_cfg_fail(P, "roundup_power2_divisions expects [size_mb:divisions,...]");
        interval = &P->tok[i];
        if (!mn__c_cfg_divisions(P, &P->tok[i + 2], &d)) return 0;
        i += 3;
        if (mn__c_tok_is(interval, ">")) {  // the intervals after the last one named
            for (k = first ? 0 : last_index + 1; k < MN_CACHE_ROUNDUP_INTERVALS; k++) div[k] = d;
        } else {
            uint64_t mb = 0;
            size_t index;
            if (!mn__c_tok_u64(interval, &mb) || !mn__c_is_pow2(mb))
                return mn__c_cfg_fail(P, "roundup_power2_divisions: the intervals have to be a "
                                      "power of 2");
            index = mn__c_log2_floor(mb);
            if (index > MN_CACHE_ROUNDUP_INTERVALS - 1) index = MN_CACHE_ROUNDUP_INTERVALS - 1;
            if (first) {
                for (k = 0; k < index; k++) div[k] = d;
                first = 0;
            }
            div[index] = d;
            last_index = index;
        }
    }
}

// parseGarbageCollectionThreshold: 0 < t < 1.
MN__PRIVATE size_t mn__c_cfg_gc_threshold(mn__c_cfg_parser *P, size_t i) {
    const mn__c_cfg_tok *val = &P->tok[i];
    double d = 0;
    if (!mn__c_tok_double(val, &d) || !(d > 0.0) || !(d < 1.0))
        return mn__c_cfg_fail(P, "garbage_collection_threshold must be in (0.0, 1.0), got '%.*s'",
                              (int)val->n, val->s);
    P->cfg.garbage_collection_threshold = d;
    return i + 1;
}

// The True/False options (parseExpandableSegments and the like). Options of the host (pinned)
// allocator are validated and have no effect on device memory.
MN__PRIVATE size_t mn__c_cfg_bool(mn__c_cfg_parser *P, size_t i) {
    const mn__c_cfg_tok *key = &P->tok[i - 2];
    int b = 0;
    if (!mn__c_tok_bool(&P->tok[i], &b))
        return mn__c_cfg_fail(P, "expected a single True/False argument for %s", P->key);
    if (mn__c_tok_is(key, "expandable_segments")) P->cfg.expandable_segments = b;
    if (mn__c_tok_is(key, "release_lock_on_cudamalloc")) P->cfg.release_lock_on_cudamalloc = b;
    return i + 1;
}

// The host (pinned) allocator's numeric options: validated, no effect on device memory.
MN__PRIVATE size_t mn__c_cfg_pinned(mn__c_cfg_parser *P, size_t i) {
    const mn__c_cfg_tok *val = &P->tok[i];
    uint64_t u = 0;
    if (!mn__c_tok_u64(val, &u) || (mn__c_tok_is(&P->tok[i - 2], "pinned_num_register_threads") &&
                                    (!mn__c_is_pow2(u) || u > 128)))
        return mn__c_cfg_fail(P, "bad value '%.*s' for %s", (int)val->n, val->s, P->key);
    return i + 1;
}

MN__PRIVATE size_t mn__c_cfg_backend(mn__c_cfg_parser *P, size_t i) {
    const mn__c_cfg_tok *val = &P->tok[i];
    if (mn__c_tok_is(val, "cudaMallocAsync")) {
        P->err = MN_ERR_UNSUPPORTED;
        return mn__c_cfg_fail(P, "backend:cudaMallocAsync is not modelled; only the native "
                              "caching allocator is");
    }
    if (!mn__c_tok_is(val, "native"))
        return mn__c_cfg_fail(P, "unknown allocator backend '%.*s', options are native and "
                              "cudaMallocAsync", (int)val->n, val->s);
    return i + 1;
}

MNIMPL mn_result mn_cache_config_parse(const char *text, mn_cache_config *out,
                                       const mn_logger *lg) {
    static const struct {
        const char *key;
        size_t (*parse)(mn__c_cfg_parser *P, size_t value_index);
    } keys[] = {
        {"max_split_size_mb", mn__c_cfg_size_mb},
        {"max_non_split_rounding_mb", mn__c_cfg_size_mb},
        {"large_segment_size_mb", mn__c_cfg_size_mb},
        {"roundup_power2_divisions", mn__c_cfg_roundup},
        {"garbage_collection_threshold", mn__c_cfg_gc_threshold},
        {"expandable_segments", mn__c_cfg_bool},
        {"release_lock_on_cudamalloc", mn__c_cfg_bool},
        {"pinned_use_cuda_host_register", mn__c_cfg_bool},
        {"pinned_use_background_threads", mn__c_cfg_bool},
        {"graph_capture_record_stream_reuse", mn__c_cfg_bool},
        {"pinned_num_register_threads", mn__c_cfg_pinned},
        {"pinned_reserve_segment_size_mb", mn__c_cfg_pinned},
        {"pinned_max_round_threshold_mb", mn__c_cfg_pinned},
        {"pinned_max_cached_size_mb", mn__c_cfg_pinned},
        {"backend", mn__c_cfg_backend},
    };
    mn__c_cfg_parser parser, *P = &parser;
    size_t i = 0;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    if (!text) return MN_OK;
    memset(P, 0, sizeof *P);
    P->lg = lg, P->err = MN_ERR_CONFIG;
    if (!mn__c_cfg_lex(P, text)) return P->err;
    while (i < P->count) {
        const mn__c_cfg_tok *key = &P->tok[i];
        size_t kn = key->n < sizeof P->key - 1 ? key->n : sizeof P->key - 1, k;
        if (mn__c_tok_is(key, ",")) { i++; continue; }  // PyTorch tolerates empty pairs
        memcpy(P->key, key->s, kn);
        P->key[kn] = 0;
        if (i + 2 >= P->count || !mn__c_tok_is(&P->tok[i + 1], ":")) {
            mn__c_cfg_fail(P, "key '%s' needs ':' and a value", P->key);
            return P->err;
        }
        for (k = 0; k < sizeof keys / sizeof keys[0] && !mn__c_tok_is(key, keys[k].key); k++)
            continue;
        if (k == sizeof keys / sizeof keys[0]) {
            mn__c_cfg_fail(P, "Unrecognized key '%s' in CUDA allocator config.", P->key);
            return P->err;
        }
        if ((i = keys[k].parse(P, i + 2)) == 0) return P->err;
        if (i < P->count && !mn__c_tok_is(&P->tok[i], ",")) {
            mn__c_cfg_fail(P, "expected ',' after the value of '%s'", P->key);
            return P->err;
        }
    }
    *out = P->cfg;
    return MN_OK;
}

// Zero fields mean PyTorch's defaults; this is the one place they are resolved.
typedef struct mn__c_policy {
    uint64_t max_split;         // UINT64_MAX = unlimited
    uint64_t max_non_split;     // 20 MiB
    uint64_t large_segment;     // 20 MiB
    uint32_t div[MN_CACHE_ROUNDUP_INTERVALS];
} mn__c_policy;

MN__PRIVATE void mn__c_policy_resolve(const mn_cache_config *cfg, mn__c_policy *p) {
    memset(p, 0, sizeof *p);
    p->max_split = UINT64_MAX;
    p->max_non_split = MN__C_LARGE_BUFFER;
    p->large_segment = MN__C_LARGE_BUFFER;
    if (!cfg) return;
    if (cfg->max_split_size) p->max_split = cfg->max_split_size;
    if (cfg->max_non_split_rounding) p->max_non_split = cfg->max_non_split_rounding;
    if (cfg->large_segment_size) p->large_segment = cfg->large_segment_size;
    memcpy(p->div, cfg->roundup_power2_divisions, sizeof p->div);
}

// PyTorch round_size / roundup_power2_next_division / AllocatorConfig::roundup_power2_divisions.
MN__PRIVATE uint64_t mn__c_round_size(const mn__c_policy *p, uint64_t size) {
    uint32_t log_size, index, divisions;
    if (size < MN__C_MIN_BLOCK) return MN__C_MIN_BLOCK;
    log_size = mn__c_log2_floor(size);
    index = log_size > 20 ? log_size - 20 : 0;  // intervals start at 1 MiB = 2^20
    if (index > MN_CACHE_ROUNDUP_INTERVALS - 1) index = MN_CACHE_ROUNDUP_INTERVALS - 1;
    divisions = p->div[index];
    if (divisions > 1 && size > MN__C_MIN_BLOCK * divisions) {
        uint64_t floor2, step, f;
        if (mn__c_is_pow2(size)) return size;
        floor2 = 1ull << log_size;
        step = floor2 >> mn__c_log2_floor(divisions);
        if (step == 0) return floor2 << 1;
        f = size & ~(step - 1);
        return f == size ? size : f + step;
    }
    return (size + MN__C_MIN_BLOCK - 1) / MN__C_MIN_BLOCK * MN__C_MIN_BLOCK;
}

// PyTorch get_allocation_size.
MN__PRIVATE uint64_t mn__c_allocation_size(const mn__c_policy *p, uint64_t size) {
    if (size <= MN__C_SMALL_SIZE) return MN__C_SMALL_BUFFER;
    if (size < MN__C_MIN_LARGE_ALLOC) return p->large_segment;
    return (size + MN__C_ROUND_LARGE - 1) / MN__C_ROUND_LARGE * MN__C_ROUND_LARGE;
}

MNIMPL uint64_t mn_cache_round_size(const mn_cache_config *cfg, uint64_t size) {
    mn__c_policy p;
    mn__c_policy_resolve(cfg, &p);
    if (size >= MN__C_ONE_EXA) return size;
    return mn__c_round_size(&p, size);
}

MNIMPL uint64_t mn_cache_segment_size(const mn_cache_config *cfg, uint64_t rounded_size) {
    mn__c_policy p;
    mn__c_policy_resolve(cfg, &p);
    if (rounded_size >= MN__C_ONE_EXA) return rounded_size;
    return mn__c_allocation_size(&p, rounded_size);
}

// ---- >>cache/alloc: blocks, segments, trees -----------------------------------------------------

// The steps of a cached allocation and release, inlined into the two calls (no saving and
// restoring of registers per step: a cached pair is a thousand instructions or so).
#if defined(__GNUC__) || defined(__clang__)
#define MN__C_STEP static inline __attribute__((always_inline, unused))
#else
#define MN__C_STEP static
#endif

typedef struct mn__c_segment mn__c_segment;

typedef struct mn__c_use {   // a stream the block was used on; later the event recorded there
    mn_stream stream;
    mn_event event;
    struct mn__c_block *block;
    struct mn__c_use *next;   // in the block's list, then in the pending-event queue
} mn__c_use;

typedef struct mn__c_block {
    // One cache line (blocks are 64-byte aligned): what a search, a treap rotation or a
    // neighbour's merge test reads of a block other than the one being handed out or freed.
    struct mn__c_block *l, *r, *up;  // treap children and parent (its bin, or the unmapped tree)
    uint64_t addr, size;
    mn_stream stream;
    uint32_t prio;                  // treap priority (max-heap)
    struct mn__c_use *uses;         // streams recorded while allocated
    unsigned event_count : 31;      // events to wait for before the block is free
    // 0 only while prev is in no pool, so that a release reads prev's line only when it may
    // merge: a split's remainder follows the block handed out (0), and the front takes the split
    // block's bit; a free block sets its unmerged next's bit (whose line the merge test read),
    // and every other change of neighbours sets 1. mn_cache_check verifies it. (A large pair
    // at 10^6 live blocks: 4.1 -> 3.4 lines from beyond L2, cachegrind.)
    unsigned prev_free : 1;
    uint8_t allocated, mapped, small, in_tree;
    // the rest
    struct mn__c_block *prev, *next;  // neighbours inside the segment, in address order
    mn__c_segment *seg;
    uint64_t requested;
    uint64_t gc_base;               // pool's get_free_block count when cached (GC age)
    uint32_t bin;                   // its size-class bin while in the pool (mn__c_bin_of)
    uint32_t id;                    // slab << MN__C_SLAB_LOG | index in the slab (fixed)
    uint8_t cat;
    uint8_t label_state;            // MN__C_LABEL_*: how its label reads (mn__c_label)
    struct mn__c_block *tmp;        // scratch list, and the spare list
} mn__c_block;

// A block's label as its bytes read (the snapshot copies all MN_CACHE_LABEL_MAX): zeros for a new
// struct, then each allocation's label written over it with its terminating zero, or only a zero
// first byte for no label. Held without touching the label's bytes (mn__c_label: apart from the
// structs) until a label is given.
#define MN__C_LABEL_ZERO 0     // all bytes zero (label not written since the struct was made)
#define MN__C_LABEL_SET 1      // label as written
#define MN__C_LABEL_CLEARED 2  // label as written, but a zero first byte

// Block structs are carved from slabs, each one host allocation: its header, then blocks at a
// stride of whole cache lines (two on 64-bit hosts), then their labels. A cache with many blocks
// keeps them dense (few pages for the searches and merges to walk, away from the program's other
// allocations); a new slab's structs are handed out in address order, each page first touched
// when a struct on it is, a freed struct goes to the spare list, and the slabs go back to the
// host with the cache. A block's 32-bit id names its slab and place, which is what the address
// map keeps. A slab starts on a 128-byte boundary, a full one (16384 structs, 2.4 MiB with the
// labels) on a 2 MiB one advised for huge pages (mn__c_table_alloc), and its structs one line
// further. (The bench table's mixed pairs at 10^6 live blocks, run back to back, were a fifth
// faster with the structs there than with them on the 2 MiB boundary; why that line matters was
// not found.)
typedef struct mn__c_slab {
    void *host;                     // the allocation the slab was aligned in
} mn__c_slab;

struct mn__c_segment {
    uint64_t addr, size;            // device range (expandable: the reserved range)
    mn__c_block *head;                // lowest block
    mn__c_segment *prev_seg, *next_seg;
    mn_stream stream;
    uint8_t small, expandable;
};

// Free mapped blocks sit in size-class bins, in PyTorch's order (BlockComparatorSize: stream,
// size, address) all the same: the bin of a size grows with the size (one bin per 512 B below
// 8 MiB, which covers every size of the small pool, then 1024 bins per power of two), each bin
// is a treap keyed (stream, size, address) whose first node is kept, and each stream of a pool
// has a bitmap of the bins holding its blocks (a bit per bin, a bit per word of those). The
// best fit, lower_bound((stream, size, 0)), is then the first node of the request's bin when
// that node is large enough, else a search of that one bin, else the first node of the stream's
// next bin (a bit scan): O(1) for the sizes that repeat in a training loop, O(log n) at worst,
// and the same block std::set::lower_bound finds. Above 8 MiB a bin spans 1/1024 of its power of
// two (8 KiB at 8 MiB): with 128 a bin, bench_table's free blocks of 10 to 50 MiB at 10^6 live
// blocks were some 40 a bin, and a search walked several treap nodes that missed every cache
// (the 1 to 50 MiB pairs 1.62 to 1.70 of glibc's speed, 1.70 to 2.02 with 1024; three alternated
// runs). The bins cost 17 bytes each (1 MB a pool, allocated with its first segment, untouched
// but for their `set` bytes until used) and the bitmaps 7.3 kB a stream.
#define MN__C_BIN_EXACT_LOG 14u  // bins of one size: units of 512 B below 2^14 (8 MiB)
#define MN__C_BIN_EXACT (1u << MN__C_BIN_EXACT_LOG)
#define MN__C_BIN_SUB 10u        // 2^10 bins per power of two above
#define MN__C_BINS \
    (MN__C_BIN_EXACT + (55u - MN__C_BIN_EXACT_LOG) * (1u << MN__C_BIN_SUB))  // units below 2^55
#define MN__C_BIN_WORDS ((MN__C_BINS + 63u) / 64u)      // the bitmap, one bit per bin
#define MN__C_BIN_WORDS1 ((MN__C_BIN_WORDS + 63u) / 64u)  // one bit per non-zero word

typedef struct mn__c_bin {
    mn__c_block *root, *first;  // treap by (stream, size, addr); its smallest node
} mn__c_bin;

typedef struct mn__c_sbin {  // one stream of a pool
    mn_stream stream;
    uint32_t segs;           // its segments in the pool; the entry lives while there are any
    struct mn__c_sbin *spare;  // the list of unused entries (their bits are all zero)
    uint64_t w1[MN__C_BIN_WORDS1];
    uint64_t w0[MN__C_BIN_WORDS];  // bins that hold free blocks of this stream
} mn__c_sbin;

typedef struct mn__c_pool {
    mn__c_bin *bins;         // MN__C_BINS, allocated with the pool's first segment; a bin's
                             // fields are set when it first takes a block (set)
    uint8_t *set;            // [MN__C_BINS] after the bins: 1 = the bin's fields are set
    mn__c_sbin **streams;    // sorted by stream
    mn__c_sbin *cur;         // the entry found last, NULL after a sweep
    uint32_t nstreams, cap_streams;
    mn__c_block *unmapped;   // unmapped tails of expandable segments, by (stream, addr)
    uint64_t get_free_calls;
    uint64_t whole;          // free mapped blocks that are a whole fixed segment (releasable)
    int small;
    int expandable;          // the cache's expandable_segments (mn__c_whole)
} mn__c_pool;

#define MN__C_RECENT 8u  // blocks handed out last, kept out of the address map until older
#define MN__C_SLOT_RECENT (1ull << 63)  // a lookup's slot: recent entry (slot - this), not map
typedef struct mn__c_slot {  // 8 bytes: a probe reads no block unless the tags agree
    uint32_t tag;            // the address's hash, top 32 bits (mn__c_hash64)
    uint32_t id1;            // the block's id + 1, 0 = empty
} mn__c_slot;

typedef struct mn__c_cache {
    mn_device dev;
    mn_cache_config cfg;
    mn__c_policy pol;
    mn_allocator alloc;
    mn_logger logger;
    int device_index;
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_t mu;
#endif
    int solo;                       // one caller only (an estimate's own replay): no lock
    int direct;                     // the caller holds the blocks (an estimate's own replay):
                                    // no address map; `last` is the block last handed out
    struct mn__c_block *last;
    int lean;                       // an estimate's own replay: only the statistics it reads
    int twin;                       // active stats not kept, equal to allocation (stats_sync)
    mn__c_pool small, large;
    mn__c_slot *map;                // allocated blocks by address (but the recent entries),
                                    // linear probing
    void *map_host;                 // the allocation that holds it (mn__c_table_alloc)
    uint64_t map_cap, map_count;    // map_cap: a power of two, at most 2^32
    // allocated blocks handed out last, not in the map (mn__c_recent_put): oldest first, their
    // addresses beside them so that a lookup compares without reading the blocks
    uint64_t recent_addr[MN__C_RECENT];
    struct mn__c_block *recent[MN__C_RECENT];
    uint32_t recent_count;
    mn__c_segment *segs;            // every segment
    mn__c_segment *spare_seg;       // taken before a device allocation, so none is lost
    mn__c_block *spare;             // unused block structs
    uint32_t spare_count;           // on that list, and the last slab's never handed out:
    uint32_t fresh_id, fresh_left;  // ids fresh_id .. + fresh_left (pages not touched yet)
    mn__c_slab **slabs;             // by id >> MN__C_SLAB_LOG
    uint32_t slab_count, slab_cap;
    mn__c_use *spare_uses;
    mn__c_use *ev_head, *ev_tail;   // pending cross-stream frees, in record order
    struct mn_cache_stats st;
    uint64_t total_allocated_memory;  // reserved bytes incl. expandable maps
    int set_fraction;
    uint64_t allowed_max;
    uint64_t clock;
    uint32_t rng;
    uint32_t idle_streams;        // stream entries of the pools without a segment
    mn__c_sbin *spare_sbins;        // entries of streams gone, kept for new ones
    mn_result dev_error;          // first device error seen while freeing
    // history ring buffer
    mn_trace_entry *ring;
    uint64_t ring_cap, ring_head, ring_count, ring_dropped;
    uint64_t base_cat[MN_CAT_COUNT], base_reserved;
    char oom_msg[768];
} mn__c_cache;

MN__PRIVATE void mn__c_lock(mn__c_cache *c) {
#ifndef MEMANAT_NO_THREADS
    if (!c->solo) pthread_mutex_lock(&c->mu);
#else
    (void)c;
#endif
}

MN__PRIVATE void mn__c_unlock(mn__c_cache *c) {
#ifndef MEMANAT_NO_THREADS
    if (!c->solo) pthread_mutex_unlock(&c->mu);
#else
    (void)c;
#endif
}

// A cache that one caller alone uses (an estimate's replay, freed before the estimate returns)
// takes no lock: a pair of uncontended mutex calls is a tenth of a cached allocation's time.
MN__PRIVATE void mn__c_solo(mn_cache *cache) {
    cache->p->solo = 1;
}

// A cache whose caller keeps each block it was handed (cache->p->last after mn_cache_alloc) and
// releases it by mn__c_release_direct: nothing looks a pointer up, so no address map is kept.
// Set before the first allocation.
MN__PRIVATE void mn__c_direct(mn_cache *cache) {
    cache->p->direct = 1;
}

// A cache whose statistics only an estimate reads (mn__replay: the allocated and reserved bytes,
// the categories' allocated bytes and their values at the peak, the out-of-memory count) keeps
// only those and the segment counts; the rest (allocation, active, requested and inactive-split
// counts and bytes, the categories' allocation and requested counts, oversize allocations) stay
// 0, a ninth of a replay's time. No decision reads them. Set before the first allocation.
MN__PRIVATE void mn__c_lean(mn_cache *cache) {
    cache->p->lean = 1;
}

// Tree order, BlockComparatorSize: stream, then size, then address. The unmapped tree uses
// size 0 for every block, which makes it BlockComparatorAddress.
MN__PRIVATE uint64_t mn__c_tree_size(const mn__c_block *b, int by_addr) {
    return by_addr ? 0 : b->size;
}

// Lifts x above its parent, keeping the in-order sequence.
MN__PRIVATE void mn__c_tr_rotate_up(mn__c_block **root, mn__c_block *x) {
    mn__c_block *p = x->up, *g = p->up;
    if (p->l == x) {
        p->l = x->r;
        if (x->r) x->r->up = p;
        x->r = p;
    } else {
        p->r = x->l;
        if (x->l) x->l->up = p;
        x->l = p;
    }
    p->up = x;
    x->up = g;
    if (!g) *root = x;
    else if (g->l == p) g->l = x;
    else g->r = x;
}

MN__PRIVATE int mn__c_node_lt(const mn__c_block *a, const mn__c_block *b, int by_addr) {
    uint64_t as = mn__c_tree_size(a, by_addr), bs = mn__c_tree_size(b, by_addr);
    if (a->stream != b->stream) return a->stream < b->stream;
    if (as != bs) return as < bs;
    return a->addr < b->addr;
}

// Treap insert: a leaf in key order, then rotations up while its priority beats the parent's
// (expected O(log n) search, O(1) rotations).
MN__PRIVATE void mn__c_tr_insert(mn__c_block **root, mn__c_block *n, int by_addr) {
    mn__c_block *t = *root;
    n->l = n->r = NULL;
    if (!t) {
        n->up = NULL;
        *root = n;
        return;
    }
    for (;;) {
        mn__c_block **child = mn__c_node_lt(n, t, by_addr) ? &t->l : &t->r;
        if (!*child) {
            *child = n;
            break;
        }
        t = *child;
    }
    n->up = t;
    while (n->up && n->up->prio < n->prio) mn__c_tr_rotate_up(root, n);
}

// Treap erase without a search: rotate the node down until it has one child at most, then splice
// that child into its place (the same treap as rotating it down to a leaf: a treap is unique for
// its keys and priorities). The bin minimum, the node taken most, has no left child: no rotation.
MN__PRIVATE void mn__c_tr_erase(mn__c_block **root, mn__c_block *n) {
    mn__c_block *c;
    while (n->l && n->r) mn__c_tr_rotate_up(root, n->l->prio > n->r->prio ? n->l : n->r);
    c = n->l ? n->l : n->r;
    if (c) c->up = n->up;
    if (!n->up) *root = c;
    else if (n->up->l == n) n->up->l = c;
    else n->up->r = c;
    n->up = NULL;
}

// Smallest node not less than the key (std::set::lower_bound).
MN__PRIVATE mn__c_block *mn__c_tr_lower_bound(mn__c_block *t, mn_stream s, uint64_t size,
                                              uint64_t addr, int by_addr) {
    mn__c_block *best = NULL;
    while (t) {
        int lt = t->stream != s ? t->stream < s
               : mn__c_tree_size(t, by_addr) != size ? mn__c_tree_size(t, by_addr) < size
               : t->addr < addr;
        if (!lt) best = t, t = t->l;
        else t = t->r;
    }
    return best;
}

// Largest node less than the key.
MN__PRIVATE mn__c_block *mn__c_tr_before(mn__c_block *t, mn_stream s, uint64_t size, uint64_t addr,
                                     int by_addr) {
    mn__c_block *best = NULL;
    while (t) {
        int lt = t->stream != s ? t->stream < s
               : mn__c_tree_size(t, by_addr) != size ? mn__c_tree_size(t, by_addr) < size
               : t->addr < addr;
        if (lt) best = t, t = t->r;
        else t = t->l;
    }
    return best;
}

// In-order predecessor.
MN__PRIVATE mn__c_block *mn__c_tr_prev(mn__c_block *b) {
    if (b->l) {
        b = b->l;
        while (b->r) b = b->r;
        return b;
    }
    while (b->up && b->up->l == b) b = b->up;
    return b->up;
}

// In-order successor.
MN__PRIVATE mn__c_block *mn__c_tr_next(mn__c_block *b) {
    if (b->r) {
        b = b->r;
        while (b->l) b = b->l;
        return b;
    }
    while (b->up && b->up->r == b) b = b->up;
    return b->up;
}

// ---- address map hashing ------------------------------------------------------------------------

// Fibonacci hashing: a slot's home is the top log2(cap) bits of the product, its tag the top 32
// (so the tag gives the home back while cap <= 2^32).
MN__PRIVATE uint64_t mn__c_hash64(uint64_t addr) { return (addr >> 9) * 0x9E3779B97F4A7C15ull; }

MN__PRIVATE uint64_t mn__c_home(uint32_t tag, uint64_t cap) {
    return (uint64_t)tag >> (32u - mn__c_log2_floor(cap));
}

// Asks for the line of addr's home slot (a hint: no effect on results; none without GCC/clang).
MN__PRIVATE void mn__c_map_prefetch(const mn__c_cache *c, uint64_t addr) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&c->map[mn__c_home((uint32_t)(mn__c_hash64(addr) >> 32), c->map_cap)], 1);
#else
    (void)c, (void)addr;
#endif
}

// Asks for the line at p (a hint, as above; p may be NULL).
MN__PRIVATE void mn__c_prefetch(const void *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p);
#else
    (void)p;
#endif
}

// ---- size-class bins ----------------------------------------------------------------------------

MN__PRIVATE uint32_t mn__c_bin_of(uint64_t size) {  // non-decreasing in size
    uint64_t u = size >> 9;
    uint32_t k;
    if (u < MN__C_BIN_EXACT) return (uint32_t)u;
    k = mn__c_log2_floor(u);
    return MN__C_BIN_EXACT + (k - MN__C_BIN_EXACT_LOG) * (1u << MN__C_BIN_SUB) +
           (uint32_t)((u >> (k - MN__C_BIN_SUB)) & ((1u << MN__C_BIN_SUB) - 1u));
}

MN__PRIVATE uint32_t mn__c_ctz(uint64_t m) { return mn__c_log2_floor(m & (~m + 1)); }  // m != 0

// The entry of stream s (NULL if none); *pos: where it is or would go.
MN__PRIVATE mn__c_sbin *mn__c_sbin_search(mn__c_pool *p, mn_stream s, uint32_t *pos) {
    uint32_t lo = 0, hi = p->nstreams;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (p->streams[mid]->stream < s) lo = mid + 1;
        else hi = mid;
    }
    if (pos) *pos = lo;
    if (lo < p->nstreams && p->streams[lo]->stream == s) return p->cur = p->streams[lo];
    return NULL;
}

// The entry of stream s, NULL if none, first trying the entry found last (a test inlined at the
// call; the entries of a sweep's streams are spares, so a sweep forgets it).
MN__PRIVATE mn__c_sbin *mn__c_sbin_find(mn__c_pool *p, mn_stream s) {
    mn__c_sbin *e = p->cur;
    if (e && e->stream == s) return e;
    return mn__c_sbin_search(p, s, NULL);
}

MN__PRIVATE int mn__c_bit_get(const mn__c_sbin *e, uint32_t i) {
    return (int)((e->w0[i >> 6] >> (i & 63u)) & 1u);
}

MN__PRIVATE void mn__c_bit_set(mn__c_sbin *e, uint32_t i) {
    e->w0[i >> 6] |= 1ull << (i & 63u);
    e->w1[i >> 12] |= 1ull << ((i >> 6) & 63u);
}

MN__PRIVATE void mn__c_bit_clear(mn__c_sbin *e, uint32_t i) {
    e->w0[i >> 6] &= ~(1ull << (i & 63u));
    if (!e->w0[i >> 6]) e->w1[i >> 12] &= ~(1ull << ((i >> 6) & 63u));
}

// The first bin >= i holding blocks of the stream, MN__C_BINS if none.
MN__PRIVATE uint32_t mn__c_bit_next(const mn__c_sbin *e, uint32_t i) {
    uint32_t w = i >> 6, w1;
    uint64_t m;
    if (i >= MN__C_BINS) return MN__C_BINS;
    m = e->w0[w] & (~0ull << (i & 63u));
    if (m) return (w << 6) + mn__c_ctz(m);
    if (++w >= MN__C_BIN_WORDS) return MN__C_BINS;
    w1 = w >> 6;
    m = e->w1[w1] & (~0ull << (w & 63u));
    while (!m) {
        if (++w1 >= MN__C_BIN_WORDS1) return MN__C_BINS;
        m = e->w1[w1];
    }
    w = (w1 << 6) + mn__c_ctz(m);
    return (w << 6) + mn__c_ctz(e->w0[w]);
}

// The last bin <= i (i < MN__C_BINS) holding blocks of the stream, UINT32_MAX if none.
MN__PRIVATE uint32_t mn__c_bit_prev(const mn__c_sbin *e, uint32_t i) {
    uint32_t w = i >> 6, w1;
    uint64_t m = e->w0[w] & (~0ull >> (63u - (i & 63u)));
    if (m) return (w << 6) + mn__c_log2_floor(m);
    if (w-- == 0) return UINT32_MAX;
    w1 = w >> 6;
    m = e->w1[w1] & (~0ull >> (63u - (w & 63u)));
    while (!m) {
        if (w1-- == 0) return UINT32_MAX;
        m = e->w1[w1];
    }
    w = (w1 << 6) + mn__c_log2_floor(m);
    return (w << 6) + mn__c_log2_floor(e->w0[w]);
}

// lower_bound((s, size, 0)) inside one bin: its first node when that is not less than the key.
MN__PRIVATE mn__c_block *mn__c_bin_lower(const mn__c_bin *bin, mn_stream s, uint64_t size) {
    mn__c_block *f = bin->first;
    if (f) mn__c_prefetch(&f->prev);  // its second line, read next when it is handed out
    if (f && (f->stream > s || (f->stream == s && f->size >= size))) return f;
    return mn__c_tr_lower_bound(bin->root, s, size, 0, 0);
}

// Makes sure pool p has its bins and an entry for stream s: done before a segment is made, so
// that moving blocks between bins never needs host memory.
MN__PRIVATE mn_result mn__c_sbin_reserve(mn__c_cache *c, mn__c_pool *p, mn_stream s) {
    uint32_t pos;
    mn__c_sbin *e;
    if (!p->bins) {
        p->bins = (mn__c_bin *)mn__alloc_array(&c->alloc, MN__C_BINS, sizeof *p->bins + 1);
        if (!p->bins) return MN_ERR_OUT_OF_MEMORY;  // (not zeroed: 1 MB, most never used)
        p->set = (uint8_t *)(p->bins + MN__C_BINS);
        memset(p->set, 0, MN__C_BINS);
    }
    if (mn__c_sbin_search(p, s, &pos)) return MN_OK;
    if (p->nstreams == p->cap_streams) {
        uint32_t cap = p->cap_streams ? p->cap_streams * 2 : 4;
        mn__c_sbin **ns = (mn__c_sbin **)mn__alloc_array(&c->alloc, cap, sizeof *ns);
        if (!ns) return MN_ERR_OUT_OF_MEMORY;
        if (p->nstreams) memcpy(ns, p->streams, p->nstreams * sizeof *ns);
        mn__free(&c->alloc, p->streams);
        p->streams = ns;
        p->cap_streams = cap;
    }
    if ((e = c->spare_sbins) != NULL) {  // zero bits, like a new one
        c->spare_sbins = e->spare;
    } else {
        e = (mn__c_sbin *)mn__alloc(&c->alloc, sizeof *e);
        if (!e) return MN_ERR_OUT_OF_MEMORY;
        memset(e, 0, sizeof *e);
    }
    e->stream = s;
    c->idle_streams++;  // no segment yet
    memmove(&p->streams[pos + 1], &p->streams[pos], (p->nstreams - pos) * sizeof *p->streams);
    p->streams[pos] = e;
    p->nstreams++;
    return MN_OK;
}

// Drops the entries of streams without segments (they hold no block either); at the end of a
// call, so that an entry reserved for the call stays while the out-of-memory ladder runs.
MN__PRIVATE void mn__c_sbin_sweep(mn__c_cache *c) {
    int k;
    if (!c->idle_streams) return;
    c->idle_streams = 0;
    for (k = 0; k < 2; k++) {
        mn__c_pool *p = k ? &c->large : &c->small;
        uint32_t i, n = 0;
        for (i = 0; i < p->nstreams; i++) {
            mn__c_sbin *e = p->streams[i];
            if (e->segs) {
                p->streams[n++] = e;
            } else {
                e->spare = c->spare_sbins;
                c->spare_sbins = e;
            }
        }
        p->nstreams = n;
        p->cur = NULL;
    }
}

// lower_bound((s, size, 0)) among the free blocks of stream s: the best fit, NULL if none.
MN__C_STEP mn__c_block *mn__c_pool_lower_bound(mn__c_pool *p, mn_stream s, uint64_t size) {
    mn__c_sbin *e;
    mn__c_block *b;
    uint32_t i;
    if (!p->bins || !(e = mn__c_sbin_find(p, s))) return NULL;
    i = mn__c_bin_of(size);
    if (mn__c_bit_get(e, i)) {
        b = mn__c_bin_lower(&p->bins[i], s, size);
        if (b && b->stream == s) return b;
    }
    i = mn__c_bit_next(e, i + 1);  // every block of a later bin is larger
    if (i >= MN__C_BINS) return NULL;
    return mn__c_bin_lower(&p->bins[i], s, 0);
}

// The free block after b in (stream, size, address) order, NULL if none of b's stream.
MN__PRIVATE mn__c_block *mn__c_pool_next(mn__c_pool *p, const mn__c_block *b) {
    mn__c_block *n = mn__c_tr_next((mn__c_block *)(uintptr_t)b);
    uint32_t i;
    if (n && n->stream == b->stream) return n;
    i = mn__c_bit_next(mn__c_sbin_find(p, b->stream), b->bin + 1);
    return i < MN__C_BINS ? mn__c_bin_lower(&p->bins[i], b->stream, 0) : NULL;
}

// The largest free block of stream s less than (s, size, addr), NULL if none.
MN__PRIVATE mn__c_block *mn__c_pool_before(mn__c_pool *p, mn_stream s, uint64_t size,
                                           uint64_t addr) {
    mn__c_sbin *e;
    mn__c_block *b;
    uint32_t i;
    if (!p->bins || !(e = mn__c_sbin_find(p, s))) return NULL;
    i = mn__c_bin_of(size);
    if (mn__c_bit_get(e, i)) {
        b = mn__c_tr_before(p->bins[i].root, s, size, addr, 0);
        if (b && b->stream == s) return b;
    }
    if (i == 0 || (i = mn__c_bit_prev(e, i - 1)) == UINT32_MAX) return NULL;
    return mn__c_tr_before(p->bins[i].root, s, UINT64_MAX, UINT64_MAX, 0);  // its last of s
}

// Every free mapped block of the pool in (stream, size, address) order, as a list through tmp.
MN__PRIVATE mn__c_block *mn__c_pool_collect(mn__c_pool *p) {
    mn__c_block *head = NULL, **tail = &head, *b;
    uint32_t k, i;
    for (k = 0; k < p->nstreams; k++) {
        const mn__c_sbin *e = p->streams[k];
        for (i = mn__c_bit_next(e, 0); i < MN__C_BINS; i = mn__c_bit_next(e, i + 1))
            for (b = mn__c_bin_lower(&p->bins[i], e->stream, 0); b && b->stream == e->stream;
                 b = mn__c_tr_next(b)) {
                *tail = b;
                tail = &b->tmp;
            }
    }
    *tail = NULL;
    return head;
}

// A free block that is its whole fixed-size segment: release_cached_blocks can give it back.
// A block's neighbours only change while it is out of its pool, so the count stays exact.
// Segments are expandable only where the cache's configuration says so (p->expandable, set once
// at init): without them the segment's line is not read, a load that misses every cache where the
// blocks outgrow them.
MN__C_STEP int mn__c_whole(const mn__c_pool *p, const mn__c_block *b) {
    return b->mapped && !b->prev && !b->next && (!p->expandable || !b->seg->expandable);
}

MN__C_STEP void mn__c_pool_insert(mn__c_pool *p, mn__c_block *b) {
    MN_ASSERT(!b->in_tree);
    b->l = b->r = NULL;
    b->in_tree = 1;
    p->whole += (uint64_t)mn__c_whole(p, b);
    if (b->mapped) {
        uint32_t i = b->bin = mn__c_bin_of(b->size);
        mn__c_bin *bin = &p->bins[i];
        mn__c_block *f;
        if (!p->set[i]) {  // its first block: fields not set yet
            p->set[i] = 1;
            bin->root = bin->first = NULL;
        }
        f = bin->first;
        b->gc_base = p->get_free_calls;  // BlockPool::insert_into_blocks
        if (f && mn__c_node_lt(b, f, 0)) {  // a new first node: the old one's left child (it had
            f->l = b, b->up = f;            // none), then up by priority
            while (b->up && b->up->prio < b->prio) mn__c_tr_rotate_up(&bin->root, b);
        } else {
            mn__c_tr_insert(&bin->root, b, 0);
        }
        if (!f || mn__c_node_lt(b, f, 0)) bin->first = b;
        mn__c_bit_set(mn__c_sbin_find(p, b->stream), b->bin);  // made with the segment
    } else {
        mn__c_tr_insert(&p->unmapped, b, 1);
    }
}

MN__C_STEP void mn__c_pool_erase(mn__c_pool *p, mn__c_block *b) {
    MN_ASSERT(b->in_tree);
    p->whole -= (uint64_t)mn__c_whole(p, b);
    if (b->mapped && p->bins[b->bin].first == b) {
        // The bin's first node, taken most: it has no left child and is its parent's left one,
        // so its successor is its right subtree's first node or else its parent, and the splice
        // writes the neighbours' links without reading their lines (with one stream in the pool
        // the successor's stream is b's too). A block taken and given back soon (a temporary)
        // finds those lines cached by the writes. (bench_table at 10^6 live blocks, alternated
        // three times: the 1 to 50 MiB pairs 1.64 to 1.86 of glibc's speed with the generic
        // successor and erase, which read the parent's line, 1.80 to 1.92 with these.)
        mn__c_bin *bin = &p->bins[b->bin];
        mn__c_block *c = b->r, *n = b->up;
        if (c)
            for (n = c; n->l;) n = n->l;
        if (!n || (p->nstreams != 1 && n->stream != b->stream))  // no block of b's stream left
            mn__c_bit_clear(mn__c_sbin_find(p, b->stream), b->bin);
        bin->first = n;
        if (c) c->up = b->up;
        if (!b->up) bin->root = c;
        else b->up->l = c;
        b->up = NULL;
    } else if (b->mapped) {
        mn__c_bin *bin = &p->bins[b->bin];
        mn__c_block *n = mn__c_tr_next(b), *v;  // (b is not the bin's first: it has a prev)
        int keep = n && n->stream == b->stream;  // the bin still holds blocks of b's stream
        if (!keep) keep = (v = mn__c_tr_prev(b)) != NULL && v->stream == b->stream;
        mn__c_tr_erase(&bin->root, b);
        if (!keep) mn__c_bit_clear(mn__c_sbin_find(p, b->stream), b->bin);
    } else {
        mn__c_tr_erase(&p->unmapped, b);
    }
    b->in_tree = 0;
    b->l = b->r = NULL;
}

MN__PRIVATE mn__c_pool *mn__c_pool_of(mn__c_cache *c, const mn__c_block *b) {
    return b->small ? &c->small : &c->large;
}

// ---- host memory for the large tables -----------------------------------------------------------

// A cache of a million blocks keeps 128 MiB of block structs and a 16 MiB address map, and its
// searches, merges and lookups read them at random: on 4 KiB pages nearly each of those loads also
// misses the TLB and walks the page table. Where the kernel offers huge pages on advice (Linux,
// MADV_HUGEPAGE, with transparent huge pages in "madvise" or "always" mode), a table of 2 MiB or
// more starts on a 2 MiB boundary and its whole 2 MiB pieces are advised, so that each is one TLB
// entry. The advice changes no byte; where it does not apply madvise fails and nothing changes.
// (bench_table's mixed pairs at 10^6 live blocks: 1.07 to 1.20 of glibc's speed before, 1.20 to
// 1.24 after, three alternated runs; run back to back, medians of 5: 140 ns a pair
// before, 107 after.)
#define MN__C_HUGE ((size_t)2 << 20)

// n bytes from the cache's host allocator, starting on a 2 MiB boundary where huge pages can be
// advised and n is 2 MiB or more (2 MiB - 1 more bytes asked for, never touched), else on a
// 128-byte boundary; *host gets what to free. NULL when the host is out of memory.
MN__PRIVATE unsigned char *mn__c_table_alloc(const mn__c_cache *c, size_t n, void **host) {
    size_t a = 128;
    unsigned char *h, *p;
#ifdef MN__MADV_HUGEPAGE
    if (n >= MN__C_HUGE) a = MN__C_HUGE;
#endif
    if (n > SIZE_MAX - a) return NULL;
    h = (unsigned char *)mn__alloc(&c->alloc, n + a - 1);
    if (!h) return NULL;
    p = (unsigned char *)(((uintptr_t)h + a - 1) & ~(uintptr_t)(a - 1));
#ifdef MN__MADV_HUGEPAGE
    if (a == MN__C_HUGE) (void)madvise(p, n & ~(MN__C_HUGE - 1), MN__MADV_HUGEPAGE);
#endif
    *host = h;
    return p;
}

// ---- block structs ------------------------------------------------------------------------------

#define MN__C_SPARE_BLOCKS 4
#define MN__C_BLOCK_STRIDE ((sizeof(mn__c_block) + 63u) / 64u * 64u)  // whole cache lines
#define MN__C_SLAB_LOG 14u     // a slab holds up to 2^14 blocks (2.4 MiB): 64 in the first, then
#define MN__C_SLAB_MIN 64u     // twice as many in each next one
#define MN__C_SLAB_LIMIT (1u << (32u - MN__C_SLAB_LOG))  // slabs a 32-bit id can name

MN__PRIVATE mn__c_block *mn__c_block_at(const mn__c_cache *c, uint32_t id) {
    unsigned char *base = (unsigned char *)c->slabs[id >> MN__C_SLAB_LOG] + 64;
    return (mn__c_block *)(void *)(base + (size_t)(id & ((1u << MN__C_SLAB_LOG) - 1u)) *
                                              MN__C_BLOCK_STRIDE);
}

// Blocks in slab s (slab numbers below 2^18).
MN__PRIVATE uint32_t mn__c_slab_blocks(uint32_t s) {
    return s < MN__C_SLAB_LOG - 6u ? MN__C_SLAB_MIN << s : 1u << MN__C_SLAB_LOG;
}

// The MN_CACHE_LABEL_MAX bytes of block b's label, after its slab's structs: a block without a
// label never touches them, and the structs take two cache lines, not three.
MN__PRIVATE char *mn__c_label(const mn__c_cache *c, const mn__c_block *b) {
    uint32_t s = b->id >> MN__C_SLAB_LOG;
    unsigned char *base = (unsigned char *)c->slabs[s] + 64;
    return (char *)(base + (size_t)mn__c_slab_blocks(s) * MN__C_BLOCK_STRIDE +
                    (size_t)(b->id & ((1u << MN__C_SLAB_LOG) - 1u)) * MN_CACHE_LABEL_MAX);
}

// Adds slabs until n structs are spare (host allocations: the slab, and the table of slabs when
// it grows; a failure changes nothing). Callers go through mn__c_spare_reserve.
MN__PRIVATE mn_result mn__c_spare_grow(mn__c_cache *c, uint32_t n) {
    while (c->spare_count < n) {
        uint32_t k = mn__c_slab_blocks(c->slab_count), i;
        void *host;
        mn__c_slab *sl;
        unsigned char *base;
        // ids stay below 2^32 - 1 (the map keeps id + 1): never reached, 2^32 blocks
        if (c->slab_count == MN__C_SLAB_LIMIT - 1u) return MN_ERR_OUT_OF_MEMORY;
        if (c->slab_count == c->slab_cap) {
            uint32_t cap = c->slab_cap ? c->slab_cap * 2 : 8;  // up to MN__C_SLAB_LIMIT
            mn__c_slab **t = (mn__c_slab **)mn__alloc_array(&c->alloc, cap, sizeof *t);
            if (!t) return MN_ERR_OUT_OF_MEMORY;
            if (c->slab_count) memcpy(t, c->slabs, c->slab_count * sizeof *t);
            mn__free(&c->alloc, c->slabs);
            c->slabs = t;
            c->slab_cap = cap;
        }
        // the header's line, then 2^14 strides of two lines and labels at most: 2.4 MiB
        base = mn__c_table_alloc(c, 64 + (size_t)k * (MN__C_BLOCK_STRIDE + MN_CACHE_LABEL_MAX),
                                 &host);
        if (!base) return MN_ERR_OUT_OF_MEMORY;
        sl = (mn__c_slab *)(void *)base;
        sl->host = host;
        for (i = c->fresh_left; i-- > 0;) {  // (the last slab's rest: to the list, lowest first)
            mn__c_block *b = mn__c_block_at(c, c->fresh_id + i);
            b->id = c->fresh_id + i;
            b->tmp = c->spare;
            c->spare = b;
        }
        // The new slab's structs are handed out in address order as they are first needed
        // (mn__c_block_new), so that pages no block reaches are never touched: a fit's replays
        // made slabs up to 8192 structs (1 MiB) for a few thousand blocks, and each fresh page
        // costs a fault of a microsecond or two.
        c->slabs[c->slab_count] = sl;
        c->fresh_id = c->slab_count++ << MN__C_SLAB_LOG, c->fresh_left = k;
        c->spare_count += k;  // at most 2^32 - 1 blocks in all slabs
    }
    return MN_OK;
}

// Makes sure n structs are spare (the check inline: on every allocation it holds).
MN__C_STEP mn_result mn__c_spare_reserve(mn__c_cache *c, uint32_t n) {
    return c->spare_count >= n ? MN_OK : mn__c_spare_grow(c, n);
}

// A zeroed block struct from the spares (or a new slab), NULL when the host is out of memory.
MN__PRIVATE mn__c_block *mn__c_block_new(mn__c_cache *c) {
    mn__c_block *b;
    if (mn__c_spare_reserve(c, 1) != MN_OK) return NULL;
    if (c->spare) {
        b = c->spare;
        c->spare = b->tmp;
    } else {  // (a struct the last slab has not handed out yet)
        b = mn__c_block_at(c, c->fresh_id);
        b->id = c->fresh_id++, c->fresh_left--;
    }
    c->spare_count--;
    b->l = b->r = b->up = NULL;  // field by field
    b->addr = b->size = 0;
    b->stream = 0;
    c->rng ^= c->rng << 13, c->rng ^= c->rng >> 17, c->rng ^= c->rng << 5;
    b->prio = c->rng;
    b->uses = NULL;
    b->event_count = 0;
    b->prev_free = 1;  // (1 holds whatever the neighbours: the merge test reads prev)
    b->allocated = b->small = b->in_tree = 0;
    b->mapped = 1;
    b->prev = b->next = NULL;
    b->seg = NULL;
    b->requested = b->gc_base = 0;
    b->bin = 0;
    b->cat = 0;
    b->label_state = MN__C_LABEL_ZERO;
    b->tmp = NULL;
    return b;
}

MN__PRIVATE void mn__c_block_delete(mn__c_cache *c, mn__c_block *b) {
    b->tmp = c->spare;
    c->spare = b;
    c->spare_count++;
}

MN__PRIVATE void mn__c_fix_head(mn__c_block *b) {
    if (!b->prev) b->seg->head = b;
}

// ---- address map --------------------------------------------------------------------------------

// Doubles the map (mn__c_map_reserve, when one more entry would fill it past half).
MN__PRIVATE mn_result mn__c_map_grow(mn__c_cache *c) {
    uint64_t i, cap;
    mn__c_slot *nm;
    void *host;
    cap = c->map_cap ? c->map_cap * 2 : 1024;
    if (cap > (1ull << 32) || cap > SIZE_MAX / sizeof *nm) return MN_ERR_OUT_OF_MEMORY;
    nm = (mn__c_slot *)(void *)mn__c_table_alloc(c, (size_t)cap * sizeof *nm, &host);
    if (!nm) return MN_ERR_OUT_OF_MEMORY;
    memset(nm, 0, (size_t)cap * sizeof *nm);
    for (i = 0; i < c->map_cap; i++) {
        uint64_t h;
        if (!c->map[i].id1) continue;
        h = mn__c_home(c->map[i].tag, cap);
        while (nm[h].id1) h = (h + 1) & (cap - 1);
        nm[h] = c->map[i];
    }
    mn__free(&c->alloc, c->map_host);
    c->map = nm;
    c->map_host = host;
    c->map_cap = cap;
    return MN_OK;
}

// Makes room for one more entry (before anything else on the alloc path; the check inline).
MN__C_STEP mn_result mn__c_map_reserve(mn__c_cache *c) {
    return (c->map_count + 1) * 2 <= c->map_cap ? MN_OK : mn__c_map_grow(c);
}

MN__PRIVATE void mn__c_map_put(mn__c_cache *c, mn__c_block *b) {
    uint32_t tag = (uint32_t)(mn__c_hash64(b->addr) >> 32);
    uint64_t h = mn__c_home(tag, c->map_cap);
    while (c->map[h].id1) h = (h + 1) & (c->map_cap - 1);
    c->map[h].tag = tag;
    c->map[h].id1 = b->id + 1;
    c->map_count++;
}

// The block at addr and its slot, NULL if none; the blocks whose tags agree are read to compare.
MN__PRIVATE mn__c_block *mn__c_map_find(const mn__c_cache *c, uint64_t addr, uint64_t *slot) {
    uint32_t tag;
    uint64_t h;
    if (!c->map_cap) return NULL;
    tag = (uint32_t)(mn__c_hash64(addr) >> 32);
    h = mn__c_home(tag, c->map_cap);
    while (c->map[h].id1) {
        if (c->map[h].tag == tag) {
            mn__c_block *b = mn__c_block_at(c, c->map[h].id1 - 1);
            if (b->addr == addr) {
                *slot = h;
                return b;
            }
        }
        h = (h + 1) & (c->map_cap - 1);
    }
    return NULL;
}

// The recent entries: the MN__C_RECENT blocks handed out last that are still allocated, oldest
// first, kept out of the address map. A block released soon after it was handed out, as
// temporaries are, is found there and never reaches the map, where among many blocks its slot
// would be a cache miss on the way in and out. A block handed out when all are taken pushes the
// oldest into the map (which has room: mn__c_map_reserve). An index only: no decision reads it.
MN__PRIVATE void mn__c_recent_put(mn__c_cache *c, mn__c_block *b) {
    uint32_t n = c->recent_count;
    if (n == MN__C_RECENT) {
        mn__c_map_put(c, c->recent[0]);
        memmove(c->recent, c->recent + 1, (n - 1) * sizeof c->recent[0]);
        memmove(c->recent_addr, c->recent_addr + 1, (n - 1) * sizeof c->recent_addr[0]);
        n--;
    }
    c->recent[n] = b, c->recent_addr[n] = b->addr;
    c->recent_count = n + 1;
}

MN__PRIVATE void mn__c_recent_del(mn__c_cache *c, uint32_t k) {
    uint32_t n = --c->recent_count;
    if (k == n) return;  // the newest, the common case (a temporary released at once): no calls
    memmove(c->recent + k, c->recent + k + 1, (n - k) * sizeof c->recent[0]);
    memmove(c->recent_addr + k, c->recent_addr + k + 1, (n - k) * sizeof c->recent_addr[0]);
}

// Removes slot i, shifting later entries of the probe run back (no tombstones).
MN__PRIVATE void mn__c_map_del(mn__c_cache *c, uint64_t i) {
    uint64_t mask = c->map_cap - 1, j = i;
    c->map[i].id1 = 0;
    c->map_count--;
    for (;;) {
        uint64_t k;
        j = (j + 1) & mask;
        if (!c->map[j].id1) return;
        k = mn__c_home(c->map[j].tag, c->map_cap);
        // move j back to i if its home k is not cyclically in (i, j]
        if ((i <= j) ? (i < k && k <= j) : (i < k || k <= j)) continue;
        c->map[i] = c->map[j];
        c->map[j].id1 = 0;
        i = j;
    }
}

// ---- statistics ---------------------------------------------------------------------------------

MN__PRIVATE void mn__c_stat_inc(mn_stat *s, uint64_t n) {
    s->current += n;
    if (s->current > s->peak) s->peak = s->current;
    s->allocated += n;
}

MN__PRIVATE void mn__c_stat_dec(mn_stat *s, uint64_t n) {
    MN_ASSERT(s->current >= n);
    s->current -= n;
    s->freed += n;
}

// A pool statistic changes in its pool and in the aggregate by the same amount
// (get_stat_types_for_pool), so the aggregate's current value and totals are the sums of the
// pools': only its peak is kept as it changes (from the two pools' current values), the rest is
// summed by mn__c_stats_sync before the statistics are read.
MN__PRIVATE void mn__c_stat2_inc(mn_stat *st, int small, uint64_t n) {  // st: [MN_STAT_TYPE_COUNT]
    mn_stat *q = &st[small ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL];
    mn_stat *o = &st[small ? MN_STAT_LARGE_POOL : MN_STAT_SMALL_POOL];
    uint64_t v = q->current + n, a = v + o->current;
    q->current = v;
    if (v > q->peak) q->peak = v;
    if (a > st[MN_STAT_ALL].peak) st[MN_STAT_ALL].peak = a;
    q->allocated += n;
}

MN__PRIVATE void mn__c_stat2_dec(mn_stat *st, int small, uint64_t n) {
    mn_stat *q = &st[small ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL];
    MN_ASSERT(q->current >= n);
    q->current -= n;
    q->freed += n;
}

// op is inc or dec; small: the block's pool.
#define MN__C_STAT2(c, field, small, op, n) mn__c_stat2_##op((c)->st.field, (small), (n))

MN__PRIVATE uint64_t mn__c_all_current(const mn_stat *st) {
    return st[MN_STAT_SMALL_POOL].current + st[MN_STAT_LARGE_POOL].current;
}

MN__PRIVATE void mn__c_stat_sum(mn_stat *st) {
    st[MN_STAT_ALL].current = mn__c_all_current(st);
    st[MN_STAT_ALL].allocated = st[MN_STAT_SMALL_POOL].allocated + st[MN_STAT_LARGE_POOL].allocated;
    st[MN_STAT_ALL].freed = st[MN_STAT_SMALL_POOL].freed + st[MN_STAT_LARGE_POOL].freed;
}

#define MN__C_AGG_POOL(name) mn__c_stat_sum(c->st.name);
#define MN__C_AGG_ONE(name)
#define MN__C_AGG_COUNT(name)
#define MN__C_AGG_VALUE(name)
#define MN__C_AGG_CAT(name)
#define MN__C_AGG_CATV(name)
#define MN__C_AGG(kind, name, unit, label) MN__C_AGG_##kind(name)

// While no release has waited for an event, a block leaves the active statistics in the call
// that takes it out of the allocated ones, by the same amounts: active and active_bytes equal
// allocation and allocated_bytes field for field, peaks and totals included. Until then (twin)
// only the latter are kept and copied here; the first release that waits for an event copies
// them for good. Then the aggregates are summed (above). Before anything reads c->st.
MN__PRIVATE void mn__c_stats_sync(mn__c_cache *c) {
    if (c->twin && !c->lean) {  // (lean: 0, as the rest not kept)
        memcpy(c->st.active, c->st.allocation, sizeof c->st.active);
        memcpy(c->st.active_bytes, c->st.allocated_bytes, sizeof c->st.active_bytes);
    }
    MN_CACHE_STATS(MN__C_AGG)
}

// ---- history ------------------------------------------------------------------------------------

MN__PRIVATE void mn__c_trace_apply(uint64_t *cat, uint64_t *reserved, const mn_trace_entry *e) {
    switch (e->action) {
    case MN_TRACE_ALLOC: cat[e->category] += e->block_size; break;
    case MN_TRACE_FREE_REQUESTED: cat[e->category] -= e->block_size; break;
    case MN_TRACE_SEGMENT_ALLOC: case MN_TRACE_SEGMENT_MAP: *reserved += e->size; break;
    case MN_TRACE_SEGMENT_FREE: case MN_TRACE_SEGMENT_UNMAP: *reserved -= e->size; break;
    default: break;
    }
}

MN__PRIVATE void mn__c_trace_put(mn__c_cache *c, mn_trace_action a, uint64_t addr, uint64_t size,
                                 uint64_t block_size, mn_stream stream, uint8_t cat) {
    mn_trace_entry *e = &c->ring[c->ring_head];
    if (c->ring_count == c->ring_cap) {  // the oldest entry folds into the base state
        mn__c_trace_apply(c->base_cat, &c->base_reserved, e);
        c->ring_dropped++;
    } else {
        c->ring_count++;
    }
    e->action = a;
    e->addr = addr;
    e->size = size;
    e->block_size = block_size;
    e->stream = stream;
    e->category = (mn_category)cat;
    e->time = c->clock;
    c->ring_head = c->ring_head + 1 == c->ring_cap ? 0 : c->ring_head + 1;
}

// A history entry, when the allocator keeps a history (small enough to inline: a test, no call).
MN__PRIVATE void mn__c_trace(mn__c_cache *c, mn_trace_action a, uint64_t addr, uint64_t size,
                             uint64_t block_size, mn_stream stream, uint8_t cat) {
    if (c->ring_cap) mn__c_trace_put(c, a, addr, size, block_size, stream, cat);
}

// ---- init / free --------------------------------------------------------------------------------

MNIMPL mn_result mn_cache_init(mn_cache *cache, const mn_cache_desc *desc) {
    mn__c_cache *c;
    mn_cache_config cfg;
    mn_result r;
    if (!cache) return MN_ERR_INVALID_ARG;
    cache->p = NULL;
    if (!desc) return MN_ERR_INVALID_ARG;
    if (!desc->device.alloc_fn || !desc->device.free_fn) {
        mn__log(&desc->logger, MN_LOG_ERROR, "cache: the device needs alloc_fn and free_fn");
        return MN_ERR_INVALID_ARG;
    }
    if (desc->settings) cfg = *desc->settings;
    else if ((r = mn_cache_config_parse(desc->config, &cfg, &desc->logger)) != MN_OK) return r;
    if (cfg.garbage_collection_threshold < 0.0 || cfg.garbage_collection_threshold >= 1.0 ||
        (cfg.max_split_size && cfg.max_split_size <= MN__C_LARGE_BUFFER) ||
        (cfg.max_non_split_rounding && cfg.max_non_split_rounding <= MN__C_LARGE_BUFFER)) {
        mn__log(&desc->logger, MN_LOG_ERROR, "cache: settings out of range");
        return MN_ERR_CONFIG;
    }
    if (cfg.expandable_segments && (!desc->device.reserve_fn || !desc->device.map_fn ||
                                    !desc->device.unmap_fn)) {
        mn__log(&desc->logger, MN_LOG_ERROR, "cache: expandable_segments:True needs a device "
                "with reserve_fn, map_fn and unmap_fn");
        return MN_ERR_UNSUPPORTED;
    }
    c = (mn__c_cache *)mn__alloc(&desc->allocator, sizeof *c);
    if (!c) return MN_ERR_OUT_OF_MEMORY;
    memset(c, 0, sizeof *c);
    c->dev = desc->device;
    c->cfg = cfg;
    mn__c_policy_resolve(&cfg, &c->pol);
    c->alloc = desc->allocator;
    c->logger = desc->logger;
    c->device_index = desc->device_index;
    c->small.small = 1;
    c->small.expandable = c->large.expandable = cfg.expandable_segments != 0;
    c->twin = 1;
    c->rng = 0x9E3779B9u;
    c->st.max_split_size = c->pol.max_split;
    if (desc->trace_entries) {
        c->ring = (mn_trace_entry *)mn__alloc_array(&c->alloc, desc->trace_entries,
                                                    sizeof *c->ring);
        if (!c->ring) goto fail_ring;
        c->ring_cap = desc->trace_entries;
    }
    if (mn__c_map_reserve(c) != MN_OK) goto fail_map;
#ifndef MEMANAT_NO_THREADS
    if (pthread_mutex_init(&c->mu, NULL) != 0) goto fail_mutex;
#endif
    cache->p = c;
    return MN_OK;
#ifndef MEMANAT_NO_THREADS
fail_mutex:
    mn__free(&c->alloc, c->map_host);
#endif
fail_map:
    mn__free(&c->alloc, c->ring);
fail_ring:
    mn__free(&desc->allocator, c);
    return MN_ERR_OUT_OF_MEMORY;
}

// ---- freeing blocks -----------------------------------------------------------------------------

// Device pointer <-> address (mn_device.addr_shift).
MN__PRIVATE void *mn__c_ptr(const mn__c_cache *c, uint64_t addr) {
    return (void *)(uintptr_t)(addr >> c->dev.addr_shift);
}
MN__PRIVATE uint64_t mn__c_addr(const mn__c_cache *c, const void *ptr) {
    return (uint64_t)(uintptr_t)ptr << c->dev.addr_shift;
}

// try_merge_blocks: src joins dst when it is free, has no pending events or stream uses, and is
// mapped the same way. Returns the bytes taken over (0 = no merge).
MN__C_STEP uint64_t mn__c_try_merge(mn__c_cache *c, mn__c_block *dst, mn__c_block *src) {
    uint64_t sub;
    if (!src || src->allocated || src->event_count > 0 || src->uses || dst->mapped != src->mapped)
        return 0;
    mn__c_pool_erase(mn__c_pool_of(c, src), src);
    if (dst->prev == src) {  // [src dst]
        dst->addr = src->addr;
        dst->prev = src->prev, dst->prev_free = src->prev_free;
        if (dst->prev) dst->prev->next = dst;
        else dst->seg->head = dst;
    } else {  // [dst src]
        dst->next = src->next;
        if (dst->next) dst->next->prev = dst;
    }
    sub = src->size;
    dst->size += sub;
    mn__c_block_delete(c, src);
    return sub;
}

// free_block: the block becomes reusable; it merges with free neighbours and returns to its pool.
MN__C_STEP void mn__c_free_block(mn__c_cache *c, mn__c_block *b) {
    mn__c_pool *p = mn__c_pool_of(c, b);
    uint64_t orig = b->size, req = b->requested, sub;
    int64_t net_blocks = 0, net_bytes = 0;
    int small = b->small;
    mn__c_block *n = b->next;
    mn__c_trace(c, MN_TRACE_FREE_COMPLETED, b->addr, req, orig, b->stream, b->cat);
    sub = b->prev_free ? mn__c_try_merge(c, b, b->prev) : 0;
    if (sub) net_blocks--, net_bytes -= (int64_t)sub;
    sub = mn__c_try_merge(c, b, n);
    if (sub) net_blocks--, net_bytes -= (int64_t)sub;
    else if (n) n->prev_free = 1;  // (its line read by the test; after a merge, b's new next
                                   // had the free block merged as its prev: its bit is 1)
    b->requested = 0;
    mn__c_pool_insert(p, b);
    if (c->lean) return;
    if (b->prev || b->next) net_blocks++, net_bytes += (int64_t)b->size;
    // inactive_split leaves out expandable segments (PyTorch free_block)
    if (!c->cfg.expandable_segments || !b->seg->expandable) {
        uint64_t nb = (uint64_t)(net_blocks < 0 ? -net_blocks : net_blocks);
        uint64_t ns = (uint64_t)(net_bytes < 0 ? -net_bytes : net_bytes);
        if (net_blocks > 0) MN__C_STAT2(c, inactive_split, small, inc, nb);
        if (net_blocks < 0) MN__C_STAT2(c, inactive_split, small, dec, nb);
        if (net_bytes > 0) MN__C_STAT2(c, inactive_split_bytes, small, inc, ns);
        if (net_bytes < 0) MN__C_STAT2(c, inactive_split_bytes, small, dec, ns);
    }
    if (!c->twin) {
        MN__C_STAT2(c, active, small, dec, 1);
        MN__C_STAT2(c, active_bytes, small, dec, orig);
    }
    MN__C_STAT2(c, requested_bytes, small, dec, req);
}

MN__PRIVATE void mn__c_seg_unlink(mn__c_cache *c, mn__c_segment *s) {
    if (--mn__c_sbin_find(s->small ? &c->small : &c->large, s->stream)->segs == 0)
        c->idle_streams++;  // its entry goes at the end of the call (mn__c_sbin_sweep)
    if (s->prev_seg) s->prev_seg->next_seg = s->next_seg;
    else c->segs = s->next_seg;
    if (s->next_seg) s->next_seg->prev_seg = s->prev_seg;
    mn__free(&c->alloc, s);
}

MN__PRIVATE void mn__c_seg_link(mn__c_cache *c, mn__c_segment *s) {
    if (mn__c_sbin_find(s->small ? &c->small : &c->large, s->stream)->segs++ == 0)
        c->idle_streams--;  // the entry was reserved for this segment
    s->prev_seg = NULL;
    s->next_seg = c->segs;
    if (c->segs) c->segs->prev_seg = s;
    c->segs = s;
}

MN__PRIVATE void mn__c_note_dev_error(mn__c_cache *c, mn_result r, const char *what) {
    if (r == MN_OK) return;
    if (c->dev_error == MN_OK) c->dev_error = r;
    mn__log(&c->logger, MN_LOG_ERROR, "cache: device %s failed: %s", what, mn_result_str(r));
}

// release_block: an unsplit free segment goes back to the device.
MN__PRIVATE void mn__c_release_block(mn__c_cache *c, mn__c_block *b) {
    mn__c_segment *s = b->seg;
    int small = b->small;
    MN_ASSERT(!s->expandable && !b->prev && !b->next && !b->allocated);
    c->st.num_device_free++;
    mn__c_trace(c, MN_TRACE_SEGMENT_FREE, b->addr, b->size, b->size, b->stream, 0);
    mn__c_note_dev_error(c, c->dev.free_fn(c->dev.user_data, mn__c_ptr(c, b->addr), b->size),
                         "free");
    c->total_allocated_memory -= b->size;
    MN__C_STAT2(c, segment, small, dec, 1);
    MN__C_STAT2(c, reserved_bytes, small, dec, b->size);
    if (b->size >= c->pol.max_split) mn__c_stat_dec(&c->st.oversize_segments, 1);
    mn__c_pool_erase(mn__c_pool_of(c, b), b);
    mn__c_seg_unlink(c, s);
    mn__c_block_delete(c, b);
}

MN__PRIVATE uint64_t mn__c_page_size(const mn__c_cache *c, int small) {
    return small ? MN__C_SMALL_BUFFER : c->pol.large_segment;  // ExpandableSegment segment_size
}

// unmap_block: the whole pages inside a free block of an expandable segment are unmapped; the
// page-unaligned ends stay mapped as free blocks. A segment left fully unmapped is released.
MN__PRIVATE void mn__c_unmap_block(mn__c_cache *c, mn__c_block *b) {
    mn__c_segment *s = b->seg;
    mn__c_pool *p = mn__c_pool_of(c, b);
    uint64_t page = mn__c_page_size(c, b->small), off = b->addr - s->addr;
    uint64_t beg = (off + page - 1) / page * page, end = (off + b->size) / page * page;
    mn__c_block *bf = NULL, *af = NULL;
    if (beg >= end) return;
    if (s->addr + beg > b->addr && !(bf = mn__c_block_new(c))) return;
    if (s->addr + end < b->addr + b->size && !(af = mn__c_block_new(c))) {
        if (bf) mn__c_block_delete(c, bf);
        return;
    }
    mn__c_note_dev_error(
        c, c->dev.unmap_fn(c->dev.user_data, mn__c_ptr(c, s->addr + beg), end - beg), "unmap");
    mn__c_pool_erase(p, b);
    if (bf) {  // prev? -> bf -> b
        bf->addr = b->addr, bf->size = s->addr + beg - b->addr;
        bf->stream = b->stream, bf->small = b->small, bf->seg = s;
        bf->prev = b->prev, bf->next = b, bf->prev_free = b->prev_free;
        if (bf->prev) bf->prev->next = bf;
        b->prev = bf, b->prev_free = 1;
        mn__c_fix_head(bf);
        mn__c_pool_insert(p, bf);
    }
    if (af) {  // b -> af -> next?
        af->addr = s->addr + end, af->size = b->addr + b->size - (s->addr + end);
        af->stream = b->stream, af->small = b->small, af->seg = s;
        af->next = b->next, af->prev = b, af->prev_free = 1;
        if (af->next) af->next->prev = af;
        b->next = af;
        mn__c_pool_insert(p, af);
    }
    b->addr = s->addr + beg;
    b->size = end - beg;
    b->mapped = 0;
    c->total_allocated_memory -= b->size;
    MN__C_STAT2(c, reserved_bytes, b->small, dec, b->size);
    c->st.num_device_free++;
    mn__c_trace(c, MN_TRACE_SEGMENT_UNMAP, b->addr, b->size, b->size, b->stream, 0);
    mn__c_try_merge(c, b, b->prev);
    mn__c_try_merge(c, b, b->next);
    mn__c_pool_insert(p, b);
    if (!b->prev && !b->next) {  // release_expandable_segment
        if (c->dev.unreserve_fn)
            mn__c_note_dev_error(c,
                                 c->dev.unreserve_fn(c->dev.user_data, mn__c_ptr(c, s->addr),
                                                     s->size),
                                 "unreserve");
        mn__c_pool_erase(p, b);
        mn__c_seg_unlink(c, s);
        mn__c_block_delete(c, b);
    }
}

// release_blocks: every unsplit free segment of the pool goes back; free expandable pages unmap.
MN__PRIVATE void mn__c_release_blocks(mn__c_cache *c, mn__c_pool *p) {
    mn__c_block *b, *next, *unmap = NULL, **tail = &unmap;
    // Nothing to give back: skip the walk over every cached block (it made each out-of-memory
    // retry of a long trace cost the whole pool, quadratic over the trace).
    if (p->whole == 0 && !c->cfg.expandable_segments) return;
    for (b = mn__c_pool_collect(p); b; b = next) {
        next = b->tmp;
        if (b->seg->expandable) {
            *tail = b;
            tail = &b->tmp;
        } else if (!b->prev && !b->next) {
            mn__c_release_block(c, b);
        }
    }
    *tail = NULL;
    for (b = unmap; b; b = next) {
        next = b->tmp;
        mn__c_unmap_block(c, b);
    }
}

// ---- stream events ------------------------------------------------------------------------------

MN__PRIVATE void mn__c_use_recycle(mn__c_cache *c, mn__c_use *u) {
    u->next = c->spare_uses;
    c->spare_uses = u;
}

// An event has completed: the block waits for one event less.
MN__PRIVATE void mn__c_event_done(mn__c_cache *c, mn__c_use *u) {
    mn__c_block *b = u->block;
    if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, u->event);
    mn__c_use_recycle(c, u);
    if (--b->event_count == 0) mn__c_free_block(c, b);
}

// process_events: completed events release their blocks; per stream, in record order, stopping
// at the first event not yet done (events of one stream complete in order).
MN__PRIVATE void mn__c_process_events(mn__c_cache *c) {
    mn_stream blocked[32];
    uint32_t nb = 0, k;
    mn__c_use **pp = &c->ev_head, *u, *last = NULL;
    while ((u = *pp) != NULL) {
        int skip = 0;
        for (k = 0; k < nb; k++) skip |= blocked[k] == u->stream;
        if (!skip && !c->dev.event_query_fn(c->dev.user_data, u->event)) {
            skip = 1;
            blocked[nb++] = u->stream;
        }
        if (skip) {
            last = u;
            pp = &u->next;
            if (nb == 32) return;  // the tail is still further on
            continue;
        }
        *pp = u->next;
        mn__c_event_done(c, u);
    }
    c->ev_tail = last;
}

// synchronize_and_free_events: waits for every outstanding event.
MN__PRIVATE void mn__c_sync_and_free_events(mn__c_cache *c) {
    mn__c_use *u = c->ev_head, *next;
    c->st.num_sync_all_streams++;
    c->ev_head = c->ev_tail = NULL;
    for (; u; u = next) {
        next = u->next;
        if (c->dev.event_sync_fn)
            mn__c_note_dev_error(c, c->dev.event_sync_fn(c->dev.user_data, u->event), "event sync");
        mn__c_event_done(c, u);
    }
}

// release_cached_blocks (also emptyCache).
MN__PRIVATE void mn__c_release_cached(mn__c_cache *c) {
    mn__c_sync_and_free_events(c);
    mn__c_release_blocks(c, &c->large);
    mn__c_release_blocks(c, &c->small);
}

// ---- allocation ---------------------------------------------------------------------------------

// get_free_block: best fit on the same stream, with the oversize rules.
MN__C_STEP mn__c_block *mn__c_get_free_block(mn__c_cache *c, mn__c_pool *p, mn_stream s,
                                             uint64_t size) {
    mn__c_block *b;
    if (c->set_fraction && c->cfg.garbage_collection_threshold > 0.0) p->get_free_calls++;
    b = mn__c_pool_lower_bound(p, s, size);
    if (!b || b->stream != s) return NULL;
    if (c->cfg.expandable_segments && b->seg->expandable) {  // (the segment is not read else)
        // rank by the size the block can grow to (its unmapped successor included)
        mn__c_block *n = mn__c_pool_next(p, b);
        for (;;) {
            uint64_t be = b->size + (b->next && !b->next->mapped ? b->next->size : 0), ne;
            if (!b->seg->expandable || !n || n->stream != s) break;
            ne = n->size + (n->next && !n->next->mapped ? n->next->size : 0);
            if (!(ne < be)) break;
            b = n;
            n = mn__c_pool_next(p, n);
        }
    }
    // do not return an oversized block for a small request, nor a much larger one for a big one
    if (size < c->pol.max_split && b->size >= c->pol.max_split) return NULL;
    if (size >= c->pol.max_split && b->size >= size + c->pol.max_non_split) return NULL;
    mn__c_pool_erase(p, b);
    return b;
}

MN__PRIVATE int mn__c_allocatable(const mn__c_block *b) {
    return b && !b->allocated && b->event_count == 0 && !b->uses;
}

// map_block: maps whole pages at the front of an unmapped block and merges with its neighbours.
MN__PRIVATE mn_result mn__c_map_block(mn__c_cache *c, mn__c_block *to_map, uint64_t size) {
    mn__c_pool *p = mn__c_pool_of(c, to_map);
    uint64_t page = mn__c_page_size(c, to_map->small), m = (size + page - 1) / page * page, at;
    mn__c_block *rem = NULL;
    mn_result r;
    MN_ASSERT(!to_map->mapped && size <= to_map->size);
    if (m > to_map->size) m = to_map->size;
    if (m < to_map->size && !(rem = mn__c_block_new(c))) return MN_ERR_OUT_OF_MEMORY;
    r = c->dev.map_fn(c->dev.user_data, mn__c_ptr(c, to_map->addr), m);
    if (r != MN_OK) {
        if (rem) mn__c_block_delete(c, rem);
        return r;
    }
    mn__c_pool_erase(p, to_map);
    to_map->mapped = 1;
    at = to_map->addr;
    if (rem) {  // to_map -> rem -> next?
        rem->addr = to_map->addr + m, rem->size = to_map->size - m, rem->mapped = 0;
        rem->stream = to_map->stream, rem->small = to_map->small, rem->seg = to_map->seg;
        rem->prev = to_map, rem->next = to_map->next, rem->prev_free = 1;
        if (rem->next) rem->next->prev = rem;
        to_map->next = rem;
        to_map->size = m;
        mn__c_pool_insert(p, rem);
    }
    mn__c_try_merge(c, to_map, to_map->prev);
    if (!mn__c_try_merge(c, to_map, to_map->next) && to_map->next)
        to_map->next->prev_free = 1;  // to_map goes back to the pool, mapped now
    mn__c_pool_insert(p, to_map);
    c->total_allocated_memory += m;
    MN__C_STAT2(c, reserved_bytes, to_map->small, inc, m);
    c->st.num_device_alloc++;
    mn__c_trace(c, MN_TRACE_SEGMENT_MAP, at, m, m, to_map->stream, 0);
    return MN_OK;
}

// find_expandable_block: free address space of this stream's segment (a free block right before
// an unmapped one counts), or a new segment reserving 9/8 of the device.
MN__PRIVATE mn_result mn__c_find_expandable(mn__c_cache *c, mn__c_pool *p, mn_stream s,
                                            uint64_t size, mn__c_block **out) {
    mn__c_block *it, *b;
    mn__c_segment *seg;
    uint64_t total = 0, fr = 0, va, page = mn__c_page_size(c, p->small);
    void *base = NULL;
    mn_result r;
    for (it = mn__c_tr_lower_bound(p->unmapped, s, 0, 0, 1); it && it->stream == s;
         it = mn__c_tr_next(it)) {
        mn__c_block *cand = mn__c_allocatable(it->prev) ? it->prev : it, *w = cand;
        uint64_t bytes = 0;
        while (bytes < size && mn__c_allocatable(w)) bytes += w->size, w = w->next;
        if (bytes >= size) {
            *out = cand;
            return MN_OK;
        }
    }
    if (!c->dev.mem_info_fn || c->dev.mem_info_fn(c->dev.user_data, &fr, &total) != MN_OK ||
        total == 0)
        total = 1ull << 40;
    va = total + total / 8;
    if (va < size) va = size;
    va = (va + page - 1) / page * page;
    if (!(b = mn__c_block_new(c))) return MN_ERR_OUT_OF_MEMORY;
    r = c->dev.reserve_fn(c->dev.user_data, va, &base);
    if (r != MN_OK) {
        mn__c_block_delete(c, b);
        return r == MN_ERR_OUT_OF_MEMORY ? r : MN_ERR_DEVICE_OOM;
    }
    seg = c->spare_seg;
    c->spare_seg = NULL;
    memset(seg, 0, sizeof *seg);
    seg->addr = mn__c_addr(c, base), seg->size = va, seg->stream = s;
    seg->small = (uint8_t)p->small, seg->expandable = 1, seg->head = b;
    mn__c_seg_link(c, seg);
    b->addr = seg->addr, b->size = va, b->mapped = 0, b->stream = s, b->small = seg->small;
    b->seg = seg;
    mn__c_pool_insert(p, b);
    *out = b;
    return MN_OK;
}

// try_allocate_expandable_block
MN__PRIVATE mn_result mn__c_alloc_expandable(mn__c_cache *c, mn__c_pool *p, mn_stream s,
                                             uint64_t size, mn__c_block **out) {
    mn__c_block *cand = NULL;
    mn_result r = mn__c_find_expandable(c, p, s, size, &cand);
    if (r != MN_OK) return r;
    if (!cand->mapped) {
        r = mn__c_map_block(c, cand, cand->size < size ? cand->size : size);
        if (r != MN_OK) return r;
    }
    while (cand->size < size) {  // free -> unmapped -> ...: map more and merge
        mn__c_block *n = cand->next;
        uint64_t rem = size - cand->size;
        MN_ASSERT(n && !n->mapped);
        r = mn__c_map_block(c, n, rem < n->size ? rem : n->size);
        if (r != MN_OK) return r;
        cand = n;
    }
    mn__c_pool_erase(p, cand);
    *out = cand;
    return MN_OK;
}

// alloc_block: a new segment from the device (or mapped pages of an expandable segment).
MN__PRIVATE mn_result mn__c_alloc_block(mn__c_cache *c, mn__c_pool *p, mn_stream s, uint64_t size,
                                      uint64_t alloc_size, int is_retry, mn__c_block **out) {
    mn__c_segment *seg;
    mn__c_block *b;
    void *ptr = NULL;
    mn_result r;
    if (is_retry) c->st.num_alloc_retries++;
    if (c->set_fraction && (alloc_size > c->allowed_max ||
                            c->total_allocated_memory > c->allowed_max - alloc_size))
        return MN_ERR_DEVICE_OOM;
    if (c->cfg.expandable_segments) return mn__c_alloc_expandable(c, p, s, size, out);
    r = c->dev.alloc_fn(c->dev.user_data, alloc_size, &ptr);
    if (r != MN_OK) return r;
    c->total_allocated_memory += alloc_size;
    seg = c->spare_seg;
    c->spare_seg = NULL;
    memset(seg, 0, sizeof *seg);
    seg->addr = mn__c_addr(c, ptr), seg->size = alloc_size, seg->stream = s;
    seg->small = (uint8_t)p->small;
    mn__c_seg_link(c, seg);
    b = mn__c_block_new(c);  // reserved by the caller, cannot fail
    b->addr = seg->addr, b->size = alloc_size, b->stream = s, b->small = seg->small, b->seg = seg;
    seg->head = b;
    MN__C_STAT2(c, segment, p->small, inc, 1);
    MN__C_STAT2(c, reserved_bytes, p->small, inc, alloc_size);
    if (alloc_size >= c->pol.max_split) mn__c_stat_inc(&c->st.oversize_segments, 1);
    c->st.num_device_alloc++;
    mn__c_trace(c, MN_TRACE_SEGMENT_ALLOC, b->addr, alloc_size, alloc_size, s, 0);
    *out = b;
    return MN_OK;
}

// release_available_cached_blocks: with max_split_size set, frees the smallest oversize block of
// this stream that is large enough, or else oversize blocks from the largest down.
MN__PRIVATE int mn__c_release_available(mn__c_cache *c, mn__c_pool *p, mn_stream s, uint64_t size) {
    uint64_t key, released = 0;
    mn__c_block *b;
    if (c->pol.max_split == UINT64_MAX) return 0;
    key = size < c->pol.max_split ? c->pol.max_split : size;
    b = mn__c_pool_lower_bound(p, s, key);
    if (!b || b->stream != s || b->seg->expandable) {
        b = mn__c_pool_before(p, s, key, 0);
        while (b && released < key && b->size >= c->pol.max_split && b->stream == s) {
            mn__c_block *cur = b;
            b = mn__c_pool_before(p, cur->stream, cur->size, cur->addr);
            if (!cur->seg->expandable && !cur->prev && !cur->next) {
                released += cur->size;
                mn__c_release_block(c, cur);
            }
        }
        return released >= key;
    }
    if (b->prev || b->next) return 0;
    mn__c_release_block(c, b);
    return 1;
}

// garbage_collect_cached_blocks: above threshold * allowed memory, frees unsplit large-pool
// blocks whose age (get_free_block calls since they were cached) is at least the average.
MN__PRIVATE void mn__c_garbage_collect(mn__c_cache *c) {
    uint64_t thr = (uint64_t)(c->cfg.garbage_collection_threshold * (double)c->allowed_max);
    uint64_t target, reclaimed = 0, total_age = 0, count = 0;
    mn__c_block *b, *next;
    int freed = 1;
    if (c->total_allocated_memory <= thr) return;
    target = c->total_allocated_memory - thr;
    for (b = mn__c_pool_collect(&c->large); b; b = b->tmp) {
        if (b->prev || b->next) continue;
        total_age += c->large.get_free_calls - b->gc_base;
        count++;
    }
    while (reclaimed < target && freed && count > 0) {
        double age_thr = (double)total_age / (double)count;
        freed = 0;
        for (b = mn__c_pool_collect(&c->large); b; b = next) {
            uint64_t age = c->large.get_free_calls - b->gc_base;
            next = b->tmp;
            if (b->prev || b->next || b->seg->expandable || (double)age < age_thr) continue;
            freed = 1;
            reclaimed += b->size;
            total_age -= age;
            count--;
            mn__c_release_block(c, b);
        }
    }
}

// should_split
MN__PRIVATE int mn__c_should_split(const mn__c_cache *c, const mn__c_block *b, uint64_t size) {
    uint64_t remaining = b->size - size;
    if (b->small || c->cfg.expandable_segments) return remaining >= MN__C_MIN_BLOCK;
    return size < c->pol.max_split && remaining > MN__C_SMALL_SIZE;
}

// alloc_found_block: splits off the front when asked and hands the block out.
MN__C_STEP mn__c_block *mn__c_alloc_found(mn__c_cache *c, mn__c_block *b, uint64_t size,
                                          uint64_t orig, int split, mn_category cat,
                                          const char *label) {
    mn__c_pool *p = mn__c_pool_of(c, b);
    int already_split = b->prev || b->next, small = b->small;
    int exp = c->cfg.expandable_segments && b->seg->expandable;
    if (split) {
        mn__c_block *rem = b;
        b = mn__c_block_new(c);  // reserved by the caller
        b->addr = rem->addr, b->size = size, b->stream = rem->stream, b->small = rem->small;
        b->seg = rem->seg;
        b->prev = rem->prev, b->prev_free = rem->prev_free;
        if (b->prev) b->prev->next = b;
        b->next = rem;
        rem->prev = b, rem->prev_free = 0;  // b is handed out
        rem->addr += size;
        rem->size -= size;
        mn__c_fix_head(b);
        mn__c_pool_insert(p, rem);
        if (!exp && !c->lean && already_split) {
            MN__C_STAT2(c, inactive_split_bytes, small, dec, size);
        } else if (!exp && !c->lean) {
            MN__C_STAT2(c, inactive_split_bytes, small, inc, rem->size);
            MN__C_STAT2(c, inactive_split, small, inc, 1);
        }
    } else if (already_split && !exp && !c->lean) {
        MN__C_STAT2(c, inactive_split_bytes, small, dec, b->size);
        MN__C_STAT2(c, inactive_split, small, dec, 1);
    }
    b->allocated = 1;
    b->requested = orig;
    b->cat = (uint8_t)cat;
    if (label) {
        char *lb = mn__c_label(c, b);
        size_t n = 0;
        if (b->label_state == MN__C_LABEL_ZERO) memset(lb, 0, MN_CACHE_LABEL_MAX);
        while (n < MN_CACHE_LABEL_MAX - 1 && label[n]) lb[n] = label[n], n++;
        lb[n] = 0;
        b->label_state = MN__C_LABEL_SET;
    } else if (b->label_state == MN__C_LABEL_SET) {
        b->label_state = MN__C_LABEL_CLEARED;
    }
    mn__c_trace(c, MN_TRACE_ALLOC, b->addr, orig, b->size, b->stream, b->cat);
    if (c->direct) c->last = b;
    else mn__c_recent_put(c, b);
    MN__C_STAT2(c, allocated_bytes, small, inc, b->size);
    mn__c_stat_inc(&c->st.cat_allocated_bytes[cat], b->size);
    if (mn__c_all_current(c->st.allocated_bytes) == c->st.allocated_bytes[MN_STAT_ALL].peak) {
        int k;
        for (k = 0; k < MN_CAT_COUNT; k++)
            c->st.cat_at_peak[k] = c->st.cat_allocated_bytes[k].current;
    }
    if (c->lean) return b;
    MN__C_STAT2(c, allocation, small, inc, 1);
    if (!c->twin) {
        MN__C_STAT2(c, active, small, inc, 1);
        MN__C_STAT2(c, active_bytes, small, inc, b->size);
    }
    MN__C_STAT2(c, requested_bytes, small, inc, orig);
    mn__c_stat_inc(&c->st.cat_allocation[cat], 1);
    mn__c_stat_inc(&c->st.cat_requested_bytes[cat], orig);
    if (b->size >= c->pol.max_split) mn__c_stat_inc(&c->st.oversize_allocations, 1);
    return b;
}

MNIMPL void mn_cache_format_size(uint64_t n, char *buf, size_t cap) {
    // PyTorch format_size: inclusive comparisons, 1024-based units, two decimals
    if (!buf || !cap) return;
    if (n <= 1024) snprintf(buf, cap, "%llu bytes", (unsigned long long)n);
    else if (n <= 1048576ull) snprintf(buf, cap, "%.2f KiB", (double)n / 1024.0);
    else if (n <= 1073741824ull) snprintf(buf, cap, "%.2f MiB", (double)n / 1048576.0);
    else snprintf(buf, cap, "%.2f GiB", (double)n / 1073741824.0);
}

// The OOM message of CUDACachingAllocator.cpp malloc(), current wording (no NVML process list).
MN__PRIVATE void mn__c_oom_message(mn__c_cache *c, uint64_t alloc_size, uint64_t dev_free,
                                 uint64_t dev_total) {
    char a[32], t[32], f[32], al[32], ub[32], allowed[64];
    uint64_t allocated = mn__c_all_current(c->st.allocated_bytes);
    uint64_t reserved = mn__c_all_current(c->st.reserved_bytes);
    mn_cache_format_size(alloc_size, a, sizeof a);
    mn_cache_format_size(dev_total, t, sizeof t);
    mn_cache_format_size(dev_free, f, sizeof f);
    mn_cache_format_size(allocated, al, sizeof al);
    mn_cache_format_size(reserved - allocated, ub, sizeof ub);
    allowed[0] = 0;
    if (c->set_fraction) {
        mn_cache_format_size(c->allowed_max, allowed, sizeof allowed - 12);
        strcat(allowed, " allowed; ");
    }
    snprintf(c->oom_msg, sizeof c->oom_msg,
             "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of "
             "which %s is free. %sOf the allocated memory %s is allocated by PyTorch, and %s is "
             "reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
             "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
             "fragmentation.  See documentation for Memory Management  "
             "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
             a, c->device_index, t, f, allowed, al, ub);
}

MNIMPL mn_result mn_cache_alloc(mn_cache *cache, uint64_t orig, mn_stream stream,
                                mn_category cat, const char *label, void **ptr_out) {
    mn__c_cache *c;
    mn__c_pool *p;
    mn__c_block *b;
    uint64_t size, alloc_size;
    mn_result r;
    if (!cache || !cache->p || !ptr_out || (unsigned)cat >= MN_CAT_COUNT) return MN_ERR_INVALID_ARG;
    c = cache->p;
    *ptr_out = NULL;
    if (orig == 0) return MN_OK;  // PyTorch hands out nullptr for empty tensors
    mn__c_lock(c);
    c->clock++;
    if (orig >= MN__C_ONE_EXA) {
        snprintf(c->oom_msg, sizeof c->oom_msg, "Tried to allocate more than 1EB memory.");
        mn__c_unlock(c);
        return MN_ERR_DEVICE_OOM;
    }
    // host memory first, so that nothing below fails half-way
    if (!c->direct && (r = mn__c_map_reserve(c)) != MN_OK) goto done;
    if (c->recent_count == MN__C_RECENT) mn__c_map_prefetch(c, c->recent_addr[0]);  // its slot
    if ((r = mn__c_spare_reserve(c, MN__C_SPARE_BLOCKS)) != MN_OK) goto done;
    if (c->ev_head) mn__c_process_events(c);
    size = mn__c_round_size(&c->pol, orig);
    p = size <= MN__C_SMALL_SIZE ? &c->small : &c->large;
    alloc_size = mn__c_allocation_size(&c->pol, size);
    b = mn__c_get_free_block(c, p, stream, size);
    if (!b) {
        if (!c->spare_seg) {
            c->spare_seg = (mn__c_segment *)mn__alloc(&c->alloc, sizeof *c->spare_seg);
            if (!c->spare_seg) {
                r = MN_ERR_OUT_OF_MEMORY;
                goto done;
            }
        }
        if ((r = mn__c_sbin_reserve(c, p, stream)) != MN_OK) goto done;
        if (c->set_fraction && c->cfg.garbage_collection_threshold > 0.0) mn__c_garbage_collect(c);
        r = mn__c_alloc_block(c, p, stream, size, alloc_size, 0, &b);
        if (r == MN_ERR_DEVICE_OOM && mn__c_release_available(c, p, stream, size))
            r = mn__c_alloc_block(c, p, stream, size, alloc_size, 0, &b);
        if (r == MN_ERR_DEVICE_OOM) {
            mn__c_release_cached(c);
            r = mn__c_alloc_block(c, p, stream, size, alloc_size, 1, &b);
        }
        if (r == MN_ERR_DEVICE_OOM) {
            uint64_t fr = 0, total = 0;
            if (!c->dev.mem_info_fn || c->dev.mem_info_fn(c->dev.user_data, &fr, &total) != MN_OK)
                fr = total = 0;
            mn__c_trace(c, MN_TRACE_OOM, fr, size, size, stream, (uint8_t)cat);
            c->st.num_ooms++;
            mn__c_oom_message(c, alloc_size, fr, total);
            mn__log(&c->logger, MN_LOG_WARN, "%s", c->oom_msg);
            goto done;
        }
        if (r != MN_OK) goto done;
    }
    b = mn__c_alloc_found(c, b, size, orig, mn__c_should_split(c, b, size), cat, label);
    *ptr_out = mn__c_ptr(c, b->addr);
    r = MN_OK;
done:
    mn__c_sbin_sweep(c);
    mn__c_unlock(c);
    return r;
}

MN__PRIVATE mn__c_block *mn__c_lookup(mn__c_cache *c, void *ptr, uint64_t *slot) {
    uint64_t i, addr = mn__c_addr(c, ptr);
    uint32_t k = c->recent_count;
    mn__c_block *b;
    while (k-- > 0)  // the newest first
        if (c->recent_addr[k] == addr) {
            if (slot) *slot = MN__C_SLOT_RECENT + k;
            return c->recent[k];
        }
    b = mn__c_map_find(c, addr, &i);
    if (b && slot) *slot = i;
    return b;
}

// The release of allocated block b (where the cache keeps a map: slot is its map slot, or
// MN__C_SLOT_RECENT + its recent entry), under the lock.
MN__C_STEP mn_result mn__c_release_in(mn__c_cache *c, mn__c_block *b, uint64_t slot) {
    mn__c_use *u;
    uint32_t n = 0;
    int small;
    c->clock++;
    if (b->prev_free) mn__c_prefetch(b->prev);  // the merge tests read their first lines
    mn__c_prefetch(b->next);
    if (b->uses && c->dev.event_record_fn) {  // insert_events: one event per use stream
        for (u = b->uses; u; u = u->next) {
            mn_result r = c->dev.event_record_fn(c->dev.user_data, u->stream, &u->event);
            if (r != MN_OK) {
                mn__c_use *v;
                for (v = b->uses; v != u; v = v->next)
                    if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, v->event);
                return r;
            }
            u->block = b;
            n++;
        }
    }
    small = b->small;
    if (n && c->twin) mn__c_stats_sync(c), c->twin = 0;  // active differs while events wait
    if (!c->direct && slot >= MN__C_SLOT_RECENT)
        mn__c_recent_del(c, (uint32_t)(slot - MN__C_SLOT_RECENT));
    else if (!c->direct)
        mn__c_map_del(c, slot);
    b->allocated = 0;
    MN__C_STAT2(c, allocated_bytes, small, dec, b->size);
    mn__c_stat_dec(&c->st.cat_allocated_bytes[b->cat], b->size);
    if (!c->lean) {
        MN__C_STAT2(c, allocation, small, dec, 1);
        mn__c_stat_dec(&c->st.cat_allocation[b->cat], 1);
        mn__c_stat_dec(&c->st.cat_requested_bytes[b->cat], b->requested);
        if (b->size >= c->pol.max_split) mn__c_stat_dec(&c->st.oversize_allocations, 1);
    }
    mn__c_trace(c, MN_TRACE_FREE_REQUESTED, b->addr, b->requested, b->size, b->stream, b->cat);
    if (n) {
        mn__c_use *first = b->uses, *last = b->uses;
        while (last->next) last = last->next;
        b->uses = NULL;
        b->event_count = n;
        if (c->ev_tail) c->ev_tail->next = first;
        else c->ev_head = first;
        c->ev_tail = last;
    } else {
        while ((u = b->uses) != NULL) {
            b->uses = u->next;
            mn__c_use_recycle(c, u);
        }
        mn__c_free_block(c, b);
    }
    return MN_OK;
}

MNIMPL mn_result mn_cache_release(mn_cache *cache, void *ptr) {
    mn__c_cache *c;
    mn__c_block *b;
    uint64_t slot = 0;
    mn_result r;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    if (!ptr) return MN_OK;
    c = cache->p;
    mn__c_lock(c);
    b = c->direct ? NULL : mn__c_lookup(c, ptr, &slot);
    if (!b) {
        mn__c_unlock(c);
        mn__log(&c->logger, MN_LOG_ERROR, "cache: release of %p, which is not allocated%s", ptr,
                c->direct ? " (this cache is released by block)" : "");
        return MN_ERR_INVALID_ARG;
    }
    r = mn__c_release_in(c, b, slot);
    mn__c_unlock(c);
    return r;
}

// The block a direct cache (mn__c_direct) handed out last, and its release.
MN__PRIVATE void *mn__c_last_block(mn_cache *cache) {
    return cache->p->last;
}
MN__PRIVATE mn_result mn__c_release_direct(mn_cache *cache, void *block) {
    mn_result r;
    mn__c_lock(cache->p);
    r = mn__c_release_in(cache->p, (mn__c_block *)block, 0);
    mn__c_unlock(cache->p);
    return r;
}

MNIMPL mn_result mn_cache_record_stream(mn_cache *cache, void *ptr, mn_stream stream) {
    mn__c_cache *c;
    mn__c_block *b;
    mn__c_use *u;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mn__c_lock(c);
    b = mn__c_lookup(c, ptr, NULL);
    if (!b) {
        mn__c_unlock(c);
        return MN_ERR_INVALID_ARG;
    }
    if (stream != b->stream) {  // uses on the allocation stream need no synchronization
        for (u = b->uses; u; u = u->next)
            if (u->stream == stream) break;
        if (!u) {
            u = c->spare_uses;
            if (u) c->spare_uses = u->next;
            else u = (mn__c_use *)mn__alloc(&c->alloc, sizeof *u);
            if (!u) {
                mn__c_unlock(c);
                return MN_ERR_OUT_OF_MEMORY;
            }
            memset(u, 0, sizeof *u);
            u->stream = stream;
            u->block = b;
            u->next = b->uses;
            b->uses = u;
        }
    }
    mn__c_unlock(c);
    return MN_OK;
}

MNIMPL mn_result mn_cache_empty(mn_cache *cache) {
    mn__c_cache *c;
    mn_result r;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mn__c_lock(c);
    c->clock++;
    c->dev_error = MN_OK;
    mn__c_release_cached(c);
    mn__c_sbin_sweep(c);
    r = c->dev_error;
    mn__c_unlock(c);
    return r;
}

MNIMPL mn_result mn_cache_set_memory_fraction(mn_cache *cache, double fraction) {
    mn__c_cache *c;
    uint64_t fr = 0, total = 0;
    mn_result r;
    if (!cache || !cache->p || !(fraction > 0.0) || fraction > 1.0) return MN_ERR_INVALID_ARG;
    c = cache->p;
    if (!c->dev.mem_info_fn) return MN_ERR_UNSUPPORTED;
    mn__c_lock(c);
    r = c->dev.mem_info_fn(c->dev.user_data, &fr, &total);
    if (r == MN_OK) {
        c->allowed_max = (uint64_t)(fraction * (double)total);
        c->set_fraction = 1;
    }
    mn__c_unlock(c);
    return r;
}

MNIMPL mn_result mn_cache_stats(mn_cache *cache, struct mn_cache_stats *out) {
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    mn__c_lock(cache->p);
    mn__c_stats_sync(cache->p);
    *out = cache->p->st;
    mn__c_unlock(cache->p);
    return MN_OK;
}

MN__PRIVATE void mn__c_reset_peak(mn_stat *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) s[i].peak = s[i].current;
}

MN__PRIVATE void mn__c_reset_acc(mn_stat *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) s[i].allocated = s[i].freed = 0;
}

// The resets, generated from MN_CACHE_STATS: peaks fall to the current values; accumulated
// totals and event counters fall to zero; settings stay.
#define MN__C_PEAK_POOL(name) mn__c_reset_peak(c->st.name, MN_STAT_TYPE_COUNT);
#define MN__C_PEAK_ONE(name) mn__c_reset_peak(&c->st.name, 1);
#define MN__C_PEAK_CAT(name) mn__c_reset_peak(c->st.name, MN_CAT_COUNT);
#define MN__C_PEAK_COUNT(name)
#define MN__C_PEAK_VALUE(name)
#define MN__C_PEAK_CATV(name)
#define MN__C_PEAK(kind, name, unit, label) MN__C_PEAK_##kind(name)
#define MN__C_ACC_POOL(name) mn__c_reset_acc(c->st.name, MN_STAT_TYPE_COUNT);
#define MN__C_ACC_ONE(name) mn__c_reset_acc(&c->st.name, 1);
#define MN__C_ACC_CAT(name) mn__c_reset_acc(c->st.name, MN_CAT_COUNT);
#define MN__C_ACC_COUNT(name) c->st.name = 0;
#define MN__C_ACC_VALUE(name)
#define MN__C_ACC_CATV(name)
#define MN__C_ACC(kind, name, unit, label) MN__C_ACC_##kind(name)

MNIMPL void mn_cache_reset_peak_stats(mn_cache *cache) {
    mn__c_cache *c;
    int k;
    if (!cache || !cache->p) return;
    c = cache->p;
    mn__c_lock(c);
    mn__c_stats_sync(c);
    MN_CACHE_STATS(MN__C_PEAK)
    for (k = 0; k < MN_CAT_COUNT; k++) c->st.cat_at_peak[k] = c->st.cat_allocated_bytes[k].current;
    mn__c_unlock(c);
}

MNIMPL void mn_cache_reset_accumulated_stats(mn_cache *cache) {
    mn__c_cache *c;
    if (!cache || !cache->p) return;
    c = cache->p;
    mn__c_lock(c);
    mn__c_stats_sync(c);
    MN_CACHE_STATS(MN__C_ACC)
    mn__c_unlock(c);
}

MNIMPL mn_result mn_cache_config_get(mn_cache *cache, mn_cache_config *out) {
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    *out = cache->p->cfg;
    return MN_OK;
}

MNIMPL void mn_cache_oom_message(mn_cache *cache, char *buf, size_t cap) {
    if (!buf || !cap) return;
    buf[0] = 0;
    if (!cache || !cache->p) return;
    mn__c_lock(cache->p);
    snprintf(buf, cap, "%s", cache->p->oom_msg);
    mn__c_unlock(cache->p);
}

MNIMPL void mn_cache_free(mn_cache *cache) {
    mn__c_cache *c;
    mn__c_segment *s, *sn;
    mn__c_use *u, *un;
    mn__c_block *b, *bn;
    int k;
    if (!cache || !cache->p) return;
    c = cache->p;
    for (u = c->ev_head; u; u = un) {  // pending events: nothing waits any more
        un = u->next;
        if (c->dev.event_free_fn) c->dev.event_free_fn(c->dev.user_data, u->event);
        mn__free(&c->alloc, u);
    }
    for (s = c->segs; s; s = sn) {
        sn = s->next_seg;
        if (!s->expandable) {
            c->dev.free_fn(c->dev.user_data, mn__c_ptr(c, s->addr), s->size);
        }
        for (b = s->head; b; b = bn) {
            bn = b->next;
            if (s->expandable && b->mapped)
                c->dev.unmap_fn(c->dev.user_data, mn__c_ptr(c, b->addr), b->size);
            for (u = b->uses; u; u = un) un = u->next, mn__free(&c->alloc, u);
        }
        if (s->expandable && c->dev.unreserve_fn)
            c->dev.unreserve_fn(c->dev.user_data, mn__c_ptr(c, s->addr), s->size);
        mn__free(&c->alloc, s);
    }
    while (c->slab_count) mn__free(&c->alloc, c->slabs[--c->slab_count]->host);
    mn__free(&c->alloc, c->slabs);
    for (k = 0; k < 2; k++) {
        mn__c_pool *p = k ? &c->large : &c->small;
        uint32_t i;
        for (i = 0; i < p->nstreams; i++) mn__free(&c->alloc, p->streams[i]);
        mn__free(&c->alloc, p->streams);
        mn__free(&c->alloc, p->bins);
    }
    while (c->spare_sbins) {
        mn__c_sbin *e = c->spare_sbins;
        c->spare_sbins = e->spare;
        mn__free(&c->alloc, e);
    }
    for (u = c->spare_uses; u; u = un) un = u->next, mn__free(&c->alloc, u);
    mn__free(&c->alloc, c->spare_seg);
    mn__free(&c->alloc, c->map_host);
    mn__free(&c->alloc, c->ring);
#ifndef MEMANAT_NO_THREADS
    pthread_mutex_destroy(&c->mu);
#endif
    {
        mn_allocator a = c->alloc;
        mn__free(&a, c);
    }
    cache->p = NULL;
}

// ---- invariant check ----------------------------------------------------------------------------

MN__PRIVATE uint64_t mn__c_tree_check(const mn__c_block *t, uint64_t *count, int by_addr,
                                      const mn__c_block **prev, int *bad) {
    if (!t) return 0;
    if ((t->l && (t->l->prio > t->prio || t->l->up != t)) ||
        (t->r && (t->r->prio > t->prio || t->r->up != t)))
        *bad = 1;
    mn__c_tree_check(t->l, count, by_addr, prev, bad);
    if (*prev && !mn__c_node_lt(*prev, t, by_addr)) *bad = 1;
    if (!t->in_tree || (t->mapped != !by_addr) || t->allocated) *bad = 1;
    *prev = t;
    (*count)++;
    mn__c_tree_check(t->r, count, by_addr, prev, bad);
    return *count;
}

#define MN__C_FAIL(...) do { mn__log(&c->logger, MN_LOG_ERROR, __VA_ARGS__); r = MN_ERR_STATE; \
    goto done; } while (0)

// The bins of a pool: each a treap in key order whose nodes belong there and whose first node
// is kept; the stream bitmaps name exactly the (stream, bin) pairs that hold blocks; the stream
// entries are sorted and count the pool's segments. *count: the blocks in the bins.
MN__PRIVATE mn_result mn__c_bins_check(mn__c_cache *c, mn__c_pool *p, uint64_t *count) {
    uint64_t pairs = 0, bits = 0, segs = 0, have = 0;
    const mn__c_segment *sg;
    uint32_t i, k;
    mn_result r = MN_OK;
    int bad = 0;
    *count = 0;
    for (k = 0; k < p->nstreams; k++) {
        const mn__c_sbin *e = p->streams[k];
        if (k && p->streams[k - 1]->stream >= e->stream)
            MN__C_FAIL("cache check: stream entries out of order");
        if (!e->segs || c->idle_streams)
            MN__C_FAIL("cache check: stream %u kept without a segment", e->stream);
        for (i = 0; i < MN__C_BIN_WORDS; i++) {
            uint64_t m = e->w0[i];
            if (!!m != (int)((e->w1[i >> 6] >> (i & 63u)) & 1u))
                MN__C_FAIL("cache check: bitmap summary of stream %u", e->stream);
            for (; m; m &= m - 1) bits++;
        }
        segs += e->segs;
    }
    for (sg = c->segs; sg; sg = sg->next_seg)
        if ((sg->small != 0) == (p->small != 0)) {
            have++;
            if (!mn__c_sbin_find(p, sg->stream))
                MN__C_FAIL("cache check: segment %llx has no stream entry",
                           (unsigned long long)sg->addr);
        }
    if (have != segs) MN__C_FAIL("cache check: stream entries count %llu segments, not %llu",
                                 (unsigned long long)segs, (unsigned long long)have);
    for (i = 0; p->bins && i < MN__C_BINS; i++) {
        const mn__c_bin *bin = &p->bins[i];
        const mn__c_block *prev = NULL, *b;
        uint64_t n = 0;
        if (!p->set[i]) continue;  // never used (fields not set)
        mn__c_tree_check(bin->root, &n, 0, &prev, &bad);
        if (bad || (bin->root && bin->root->up) || (!bin->root) != (!bin->first) ||
            (bin->first && (bin->first->l || mn__c_tr_prev(bin->first))))
            MN__C_FAIL("cache check: bin %u out of order", i);
        for (b = bin->first; b; b = mn__c_tr_next((mn__c_block *)(uintptr_t)b)) {
            mn__c_sbin *e = mn__c_sbin_find(p, b->stream);
            if (b->bin != i || mn__c_bin_of(b->size) != i || !e || !mn__c_bit_get(e, i))
                MN__C_FAIL("cache check: block %llx in bin %u", (unsigned long long)b->addr, i);
            if (b == bin->first || mn__c_tr_prev((mn__c_block *)(uintptr_t)b)->stream != b->stream)
                pairs++;
        }
        *count += n;
    }
    if (pairs != bits) MN__C_FAIL("cache check: %llu stream bits for %llu (stream, bin) pairs",
                                  (unsigned long long)bits, (unsigned long long)pairs);
done:
    return r;
}

// mn_cache_check's use of MN_CACHE_STATS: the pools add up to the aggregate, and every current
// value recounted from the blocks equals the one kept.
#define MN__C_SUM_POOL(name) want.name[0].current += want.name[t].current;
#define MN__C_SUM(kind, name, unit, label) MN__C_SUM_##kind(name)
#define MN__C_SUM_ONE(name)
#define MN__C_SUM_COUNT(name)
#define MN__C_SUM_VALUE(name)
#define MN__C_SUM_CAT(name)
#define MN__C_SUM_CATV(name)
#define MN__C_CMP_ARRAY(name, n) \
    for (t = 0; t < (int)(n); t++) \
        if (want.name[t].current != c->st.name[t].current) \
            MN__C_FAIL("cache check: " #name "[%d] is %llu, blocks say %llu", t, \
                       (unsigned long long)c->st.name[t].current, \
                       (unsigned long long)want.name[t].current);
#define MN__C_CMP_POOL(name) MN__C_CMP_ARRAY(name, MN_STAT_TYPE_COUNT)
#define MN__C_CMP_CAT(name) MN__C_CMP_ARRAY(name, MN_CAT_COUNT)
#define MN__C_CMP_ONE(name) \
    if (want.name.current != c->st.name.current) MN__C_FAIL("cache check: " #name " count");
#define MN__C_CMP_COUNT(name)
#define MN__C_CMP_VALUE(name)
#define MN__C_CMP_CATV(name)
#define MN__C_CMP(kind, name, unit, label) MN__C_CMP_##kind(name)

MNIMPL mn_result mn_cache_check(mn_cache *cache) {
    mn__c_cache *c;
    mn__c_segment *s;
    mn__c_block *b;
    struct mn_cache_stats want;
    uint64_t in_tree[2] = {0, 0}, counted[2] = {0, 0}, unm[2] = {0, 0}, allocated = 0, total = 0;
    uint64_t whole[2] = {0, 0};
    mn_result r = MN_OK;
    int bad = 0, k, t;
    if (!cache || !cache->p) return MN_ERR_INVALID_ARG;
    c = cache->p;
    mn__c_lock(c);
    mn__c_stats_sync(c);
    memset(&want, 0, sizeof want);
    for (s = c->segs; s; s = s->next_seg) {
        uint64_t sum = 0, at = s->addr;
        int split;
        if (!s->head || s->head->prev)
            MN__C_FAIL("cache check: segment %llx head", (unsigned long long)s->addr);
        split = s->head->next != NULL;
        if (!s->expandable) {
            t = s->small ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL;
            want.segment[t].current++;
            want.reserved_bytes[t].current += s->size;
        }
        for (b = s->head; b; b = b->next) {
            int pool = b->small ? 0 : 1;
            t = b->small ? MN_STAT_SMALL_POOL : MN_STAT_LARGE_POOL;
            if (b->seg != s || b->addr != at || b->size == 0 || (b->next && b->next->prev != b) ||
                b->small != s->small || b->stream != s->stream)
                MN__C_FAIL("cache check: block %llx does not tile its segment",
                           (unsigned long long)b->addr);
            if (b->next && !b->allocated && !b->next->allocated && !b->event_count &&
                !b->next->event_count && !b->uses && !b->next->uses &&
                b->mapped == b->next->mapped)
                MN__C_FAIL("cache check: free blocks %llx and its successor were not merged",
                           (unsigned long long)b->addr);
            if (b->next && b->in_tree && !b->next->prev_free)
                MN__C_FAIL("cache check: block %llx follows a free block but says it does not",
                           (unsigned long long)b->next->addr);
            at += b->size, sum += b->size;
            if (s->expandable && b->mapped) want.reserved_bytes[t].current += b->size;
            if (b->allocated) {
                if (b->in_tree || b->event_count ||
                    (!c->direct && mn__c_lookup(c, mn__c_ptr(c, b->addr), NULL) != b))
                    MN__C_FAIL("cache check: allocated block %llx not in the map",
                               (unsigned long long)b->addr);
                allocated++;
                want.allocation[t].current++;
                want.allocated_bytes[t].current += b->size;
                want.cat_allocation[b->cat].current++;
                want.cat_allocated_bytes[b->cat].current += b->size;
                want.cat_requested_bytes[b->cat].current += b->requested;
                if (b->size >= c->pol.max_split) want.oversize_allocations.current++;
            } else if (b->event_count) {
                if (b->in_tree) MN__C_FAIL("cache check: pending block in a pool");
            } else {
                if (!b->in_tree) MN__C_FAIL("cache check: free block %llx not in its pool",
                                            (unsigned long long)b->addr);
                if (b->mapped) in_tree[pool]++;
                else unm[pool]++;
                whole[pool] += (uint64_t)mn__c_whole(mn__c_pool_of(c, b), b);
                if (split && !s->expandable) {
                    want.inactive_split[t].current++;
                    want.inactive_split_bytes[t].current += b->size;
                }
            }
            if (b->allocated || b->event_count) {
                want.active[t].current++;
                want.active_bytes[t].current += b->size;
                want.requested_bytes[t].current += b->requested;
            }
        }
        if (sum != s->size) MN__C_FAIL("cache check: segment %llx blocks sum to %llu, not %llu",
                                       (unsigned long long)s->addr, (unsigned long long)sum,
                                       (unsigned long long)s->size);
        if (!s->expandable && s->size >= c->pol.max_split) want.oversize_segments.current++;
    }
    for (k = 0; k < 2; k++) {
        mn__c_pool *p = k ? &c->large : &c->small;
        const mn__c_block *prev = NULL;
        uint64_t n = 0;
        if ((r = mn__c_bins_check(c, p, &counted[k])) != MN_OK) goto done;
        n = 0, prev = NULL;
        mn__c_tree_check(p->unmapped, &n, 1, &prev, &bad);
        if (bad) MN__C_FAIL("cache check: pool tree out of order");
        if (counted[k] != in_tree[k] || n != unm[k])
            MN__C_FAIL("cache check: pool holds %llu blocks, %llu are free",
                       (unsigned long long)counted[k], (unsigned long long)in_tree[k]);
        if (p->whole != whole[k])
            MN__C_FAIL("cache check: pool counts %llu whole free segments, %llu are",
                       (unsigned long long)p->whole, (unsigned long long)whole[k]);
    }
    if (!c->direct && allocated != c->map_count + c->recent_count)
        MN__C_FAIL("cache check: address map size");
    for (t = 1; t < MN_STAT_TYPE_COUNT; t++) {
        MN_CACHE_STATS(MN__C_SUM)
    }
    total = want.reserved_bytes[0].current;
    if (total != c->total_allocated_memory) MN__C_FAIL("cache check: total_allocated_memory");
    if (c->lean) {  // (mn__c_lean: not kept, 0)
        memset(want.active_bytes, 0, sizeof want.active_bytes);
        memset(want.requested_bytes, 0, sizeof want.requested_bytes);
        memset(want.inactive_split_bytes, 0, sizeof want.inactive_split_bytes);
        memset(want.allocation, 0, sizeof want.allocation);
        memset(want.active, 0, sizeof want.active);
        memset(want.inactive_split, 0, sizeof want.inactive_split);
        memset(&want.oversize_allocations, 0, sizeof want.oversize_allocations);
        memset(want.cat_allocation, 0, sizeof want.cat_allocation);
        memset(want.cat_requested_bytes, 0, sizeof want.cat_requested_bytes);
    }
    MN_CACHE_STATS(MN__C_CMP)
done:
    mn__c_unlock(c);
    return r;
}
#undef MN__C_FAIL

// ---- >>cache/observe: snapshot ------------------------------------------------------------------

MNIMPL const char *mn_trace_action_name(mn_trace_action a) {
    static const char *const names[MN_TRACE_ACTION_COUNT] = {
        "unknown", "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
        "segment_map", "segment_unmap", "oom"};
    return (unsigned)a < MN_TRACE_ACTION_COUNT ? names[a] : "unknown";
}

MNIMPL const char *mn_block_state_name(mn_block_state s) {
    static const char *const names[MN_BLOCK_STATE_COUNT] = {
        "unknown", "active_allocated", "active_pending_free", "inactive"};
    return (unsigned)s < MN_BLOCK_STATE_COUNT ? names[s] : "unknown";
}

MN__PRIVATE int mn__c_seg_cmp(const void *a, const void *b) {
    const mn_segment_info *x = (const mn_segment_info *)a, *y = (const mn_segment_info *)b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

MNIMPL mn_result mn_cache_snapshot_take(mn_cache *cache, mn_cache_snapshot *out) {
    mn__c_cache *c;
    mn__c_segment *s;
    mn__c_block *b;
    uint64_t nseg = 0, nblk = 0, i, bi = 0, si = 0;
    mn_block_info *tmpb = NULL;
    if (!cache || !cache->p || !out) return MN_ERR_INVALID_ARG;
    c = cache->p;
    memset(out, 0, sizeof *out);
    out->allocator = c->alloc;
    mn__c_lock(c);
    for (s = c->segs; s; s = s->next_seg)
        for (b = s->head; b; b = b->next) {
            if (!b->mapped) continue;
            nblk++;
            if (!b->prev || !b->prev->mapped) nseg++;
        }
    out->segments =
        (mn_segment_info *)mn__alloc_array(&c->alloc, (size_t)nseg, sizeof *out->segments);
    out->blocks = (mn_block_info *)mn__alloc_array(&c->alloc, (size_t)nblk, sizeof *out->blocks);
    tmpb = (mn_block_info *)mn__alloc_array(&c->alloc, (size_t)nblk, sizeof *tmpb);
    out->trace = (mn_trace_entry *)mn__alloc_array(&c->alloc, (size_t)c->ring_count,
                                                   sizeof *out->trace);
    if (!out->segments || !out->blocks || !tmpb || !out->trace) {
        mn__c_unlock(c);
        mn__free(&c->alloc, tmpb);
        mn_cache_snapshot_free(out);
        return MN_ERR_OUT_OF_MEMORY;
    }
    for (s = c->segs; s; s = s->next_seg) {
        for (b = s->head; b; b = b->next) {
            mn_segment_info *g;
            mn_block_info *x;
            if (!b->mapped) continue;
            if (!b->prev || !b->prev->mapped) {
                g = &out->segments[si++];
                memset(g, 0, sizeof *g);
                g->addr = b->addr, g->stream = s->stream, g->is_small = s->small;
                g->is_expandable = s->expandable, g->first_block = bi;
            }
            g = &out->segments[si - 1];
            x = &tmpb[bi++];
            memset(x, 0, sizeof *x);
            x->addr = b->addr, x->size = b->size;
            x->state = b->allocated ? MN_BLOCK_ACTIVE_ALLOCATED
                     : b->event_count ? MN_BLOCK_ACTIVE_PENDING_FREE : MN_BLOCK_INACTIVE;
            x->requested = x->state == MN_BLOCK_INACTIVE ? 0 : b->requested;
            x->category = (mn_category)b->cat;
            if (b->label_state != MN__C_LABEL_ZERO)
                memcpy(x->label, mn__c_label(c, b), sizeof x->label);
            if (b->label_state == MN__C_LABEL_CLEARED) x->label[0] = 0;
            g->total_size += b->size;
            g->block_count++;
            if (b->allocated) g->allocated_size += b->size;
            if (x->state != MN_BLOCK_INACTIVE) {
                g->active_size += b->size;
                g->requested_size += b->requested;
            }
        }
    }
    out->segment_count = nseg;
    out->block_count = nblk;
    for (i = 0; i < c->ring_count; i++) {
        uint64_t j = (c->ring_head + c->ring_cap - c->ring_count + i) % c->ring_cap;
        out->trace[i] = c->ring[j];
    }
    out->trace_count = c->ring_count;
    out->trace_dropped = c->ring_dropped;
    memcpy(out->base_cat_allocated, c->base_cat, sizeof c->base_cat);
    out->base_reserved = c->base_reserved;
    out->config = c->cfg;
    out->device_index = c->device_index;
    mn__c_stats_sync(c);
    out->stats = c->st;
    mn__c_unlock(c);
    // segments by address, their blocks gathered in the same order
    qsort(out->segments, (size_t)nseg, sizeof *out->segments, mn__c_seg_cmp);
    for (i = 0, bi = 0; i < nseg; i++) {
        mn_segment_info *g = &out->segments[i];
        memcpy(&out->blocks[bi], &tmpb[g->first_block], (size_t)g->block_count * sizeof *tmpb);
        g->first_block = bi;
        bi += g->block_count;
    }
    mn__free(&c->alloc, tmpb);
    return MN_OK;
}

MNIMPL void mn_cache_snapshot_free(mn_cache_snapshot *s) {
    if (!s) return;
    mn__free(&s->allocator, s->segments);
    mn__free(&s->allocator, s->blocks);
    mn__free(&s->allocator, s->trace);
    s->segments = NULL, s->blocks = NULL, s->trace = NULL;
    s->segment_count = s->block_count = s->trace_count = 0;
}

// ---- text writers -------------------------------------------------------------------------------

typedef struct mn__c_out {
    mn_cache_write_fn fn;
    void *ud;
    mn_result r;
} mn__c_out;

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
MN__PRIVATE void mn__c_printf(mn__c_out *o, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    int n;
    if (o->r != MN_OK) return;
    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0) {
        o->r = MN_ERR_IO;
        return;
    }
    if ((size_t)n >= sizeof buf) n = (int)sizeof buf - 1;
    o->r = o->fn(o->ud, buf, (size_t)n);
}

// memory_summary _format_size: divide by 1024 while the reference (the "all" row) >= 768 KiB.
MN__PRIVATE void mn__c_fmt_size(char *buf, uint64_t sz, uint64_t ref) {
    static const char *const pre[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double pref = (double)ref;
    int i = 0;
    while (i < 5 && !(pref < 768.0 * 1024.0)) sz /= 1024, pref /= 1024.0, i++;
    sprintf(buf, "%6llu %s", (unsigned long long)sz, pre[i]);
}

// _format_count: divide by 1000 while the reference >= 750,000.
MN__PRIVATE void mn__c_fmt_count(char *buf, uint64_t n, uint64_t ref) {
    static const char *const pre[] = {" ", "K", "M"};
    double pref = (double)ref;
    int i = 0;
    while (i < 2 && !(pref < 750.0 * 1000.0)) n /= 1000, pref /= 1000.0, i++;
    sprintf(buf, "%7llu %s ", (unsigned long long)n, pre[i]);
}

MN__PRIVATE void mn__c_summary_row(mn__c_out *o, const char *name, const mn_stat *v,
                                   const mn_stat *ref, int bytes) {
    char cell[4][48];
    const uint64_t val[4] = {v->current, v->peak, v->allocated, v->freed};
    const uint64_t rv[4] = {ref->current, ref->peak, ref->allocated, ref->freed};
    int i;
    for (i = 0; i < 4; i++) {
        if (bytes) mn__c_fmt_size(cell[i], val[i], rv[i]);
        else mn__c_fmt_count(cell[i], val[i], rv[i]);
    }
    mn__c_printf(o, "| %-21s | %s | %s | %s | %s |\n", name, cell[0], cell[1], cell[2], cell[3]);
}

// One group of memory_summary(): the aggregate row, then (unabbreviated) the two pools.
MN__PRIVATE void mn__c_summary_group(mn__c_out *o, const char *label, const mn_stat *st,
                                     int npools, int bytes, int abbreviated) {
    static const char *const dash =
        "---------------------------------------------------------------------------";
    mn__c_printf(o, "|%s|\n", dash);
    mn__c_summary_row(o, label, &st[MN_STAT_ALL], &st[MN_STAT_ALL], bytes);
    if (abbreviated || npools == 1) return;
    mn__c_summary_row(o, "      from large pool", &st[MN_STAT_LARGE_POOL], &st[MN_STAT_ALL], bytes);
    mn__c_summary_row(o, "      from small pool", &st[MN_STAT_SMALL_POOL], &st[MN_STAT_ALL], bytes);
}

#define MN__C_UNIT_BYTES 1
#define MN__C_UNIT_COUNT 0
#define MN__C_GROUP_POOL(name, unit, label) \
    mn__c_summary_group(&o, label, s->name, MN_STAT_TYPE_COUNT, MN__C_UNIT_##unit, abbreviated);
#define MN__C_GROUP_ONE(name, unit, label) mn__c_summary_group(&o, label, &s->name, 1, 0, 0);
#define MN__C_GROUP_COUNT(name, unit, label)
#define MN__C_GROUP_VALUE(name, unit, label)
#define MN__C_GROUP_CAT(name, unit, label)
#define MN__C_GROUP_CATV(name, unit, label)
#define MN__C_GROUP(kind, name, unit, label) MN__C_GROUP_##kind(name, unit, label)

MNIMPL mn_result mn_cache_summary_write(const struct mn_cache_stats *s, int device_index,
                                        int abbreviated, mn_cache_write_fn fn, void *user_data) {
    // torch/cuda/memory.py memory_summary(): 75-character box, rows "all", large, small pool
    static const char *const eq =
        "===========================================================================";
    static const char *const dash =
        "---------------------------------------------------------------------------";
    mn__c_out o;
    if (!s || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    mn__c_printf(&o, "|%s|\n", eq);
    mn__c_printf(&o, "| %16s PyTorch CUDA memory summary, device ID %-17d |\n", "", device_index);
    mn__c_printf(&o, "|%s|\n", dash);
    mn__c_printf(&o, "|  %9s CUDA OOMs: %-12llu | %6s cudaMalloc retries: %-8llu  |\n", "",
                 (unsigned long long)s->num_ooms, "", (unsigned long long)s->num_alloc_retries);
    mn__c_printf(&o, "|%s|\n", eq);
    mn__c_printf(&o, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | "
                 "Tot Freed  |\n");
    MN_CACHE_STATS(MN__C_GROUP)
    mn__c_printf(&o, "|%s|\n", eq);
    return o.r;
}

// torch.cuda.memory_stats(): flat keys, sorted as PyTorch sorts them.
typedef struct mn__c_items {
    mn_stat_item *items;
    uint32_t cap, count;
} mn__c_items;

MN__PRIVATE void mn__c_item(mn__c_items *it, const char *a, const char *b, const char *c,
                            uint64_t v) {
    mn_stat_item *x;
    if (it->count++ >= it->cap) return;
    x = &it->items[it->count - 1];
    snprintf(x->key, sizeof x->key, "%s%s%s%s%s", a, b[0] ? "." : "", b, c[0] ? "." : "", c);
    x->value = v == UINT64_MAX ? -1 : (int64_t)v;
}

MN__PRIVATE void mn__c_item_stat(mn__c_items *it, const char *name, const char *pool,
                                 const mn_stat *st) {
    mn__c_item(it, name, pool, "current", st->current);
    mn__c_item(it, name, pool, "peak", st->peak);
    mn__c_item(it, name, pool, "allocated", st->allocated);
    mn__c_item(it, name, pool, "freed", st->freed);
}

#define MN__C_ITEM_POOL(name) \
    mn__c_item_stat(&it, #name, "all", &s->name[MN_STAT_ALL]); \
    mn__c_item_stat(&it, #name, "small_pool", &s->name[MN_STAT_SMALL_POOL]); \
    mn__c_item_stat(&it, #name, "large_pool", &s->name[MN_STAT_LARGE_POOL]);
#define MN__C_ITEM_ONE(name) mn__c_item_stat(&it, #name, "", &s->name);
#define MN__C_ITEM_COUNT(name) mn__c_item(&it, #name, "", "", s->name);
#define MN__C_ITEM_VALUE(name) mn__c_item(&it, #name, "", "", s->name);
#define MN__C_ITEM_CAT(name)
#define MN__C_ITEM_CATV(name)
#define MN__C_ITEM(kind, name, unit, label) MN__C_ITEM_##kind(name)

MN__PRIVATE int mn__c_item_cmp(const void *a, const void *b) {
    return strcmp(((const mn_stat_item *)a)->key, ((const mn_stat_item *)b)->key);
}

MNIMPL uint32_t mn_cache_stats_items(const struct mn_cache_stats *s, mn_stat_item *items,
                                     uint32_t cap) {
    mn__c_items it;
    it.items = items, it.cap = items ? cap : 0, it.count = 0;
    if (!s) return 0;
    if (it.cap < MN_CACHE_STATS_ITEMS) return MN_CACHE_STATS_ITEMS;
    MN_CACHE_STATS(MN__C_ITEM)
    qsort(items, it.count, sizeof *items, mn__c_item_cmp);
    return it.count;
}

MNIMPL mn_result mn_cache_category_summary_write(const struct mn_cache_stats *s,
                                                 mn_cache_write_fn fn, void *user_data) {
    mn__c_out o;
    int k;
    if (!s || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    mn__c_printf(&o, "%-15s %12s %12s %14s %12s\n", "category", "current", "peak",
                 "at alloc peak", "allocations");
    for (k = 0; k < MN_CAT_COUNT; k++) {
        char cur[32], peak[32], at[32];
        if (!s->cat_allocation[k].allocated && !s->cat_allocation[k].current) continue;
        mn_size_format(s->cat_allocated_bytes[k].current, cur, sizeof cur);
        mn_size_format(s->cat_allocated_bytes[k].peak, peak, sizeof peak);
        mn_size_format(s->cat_at_peak[k], at, sizeof at);
        mn__c_printf(&o, "%-15s %12s %12s %14s %12llu\n", mn_category_name((mn_category)k), cur,
                     peak, at, (unsigned long long)s->cat_allocation[k].allocated);
    }
    return o.r;
}

// JSON string body: quotes, backslashes and control bytes escaped.
MN__PRIVATE void mn__c_json_str(mn__c_out *o, const char *s) {
    char buf[2 * MN_CACHE_LABEL_MAX * 4 + 8];
    size_t n = 0;
    buf[n++] = '"';
    for (; *s && n < sizeof buf - 8; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') buf[n++] = '\\', buf[n++] = (char)ch;
        else if (ch < 0x20) n += (size_t)sprintf(buf + n, "\\u%04x", ch);
        else buf[n++] = (char)ch;
    }
    buf[n++] = '"';
    buf[n] = 0;
    mn__c_printf(o, "%s", buf);
}

MN__PRIVATE void mn__c_json_frames(mn__c_out *o, mn_category cat, const char *label) {
    // memory_viz shows frames as the allocation's stack: one frame names category and label
    mn__c_printf(o, "\"frames\":[{\"filename\":\"%s\",\"line\":0,\"name\":", mn_category_name(cat));
    mn__c_json_str(o, label && label[0] ? label : mn_category_name(cat));
    mn__c_printf(o, "}],\"category\":\"%s\"", mn_category_name(cat));
}

// A snapshot whose arrays are there for their counts (a caller may fill one by hand).
MN__PRIVATE int mn__c_snap_ok(const mn_cache_snapshot *s) {
    return s && (s->segments || !s->segment_count) && (s->blocks || !s->block_count) &&
           (s->trace || !s->trace_count);
}

MNIMPL mn_result mn_cache_snapshot_write_json(const mn_cache_snapshot *s, mn_cache_write_fn fn,
                                              void *user_data) {
    mn__c_out o;
    uint64_t i, j;
    int k;
    if (!mn__c_snap_ok(s) || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    mn__c_printf(&o, "{\"segments\":[");
    for (i = 0; i < s->segment_count && o.r == MN_OK; i++) {
        const mn_segment_info *g = &s->segments[i];
        mn__c_printf(&o, "%s\n{\"device\":%d,\"address\":%llu,\"total_size\":%llu,"
                     "\"allocated_size\":%llu,\"active_size\":%llu,\"requested_size\":%llu,"
                     "\"stream\":%u,\"segment_type\":\"%s\",\"segment_pool_id\":[0,0],"
                     "\"is_expandable\":%s,\"frames\":[],\"blocks\":[",
                     i ? "," : "", s->device_index, (unsigned long long)g->addr,
                     (unsigned long long)g->total_size, (unsigned long long)g->allocated_size,
                     (unsigned long long)g->active_size, (unsigned long long)g->requested_size,
                     (unsigned)g->stream, g->is_small ? "small" : "large",
                     g->is_expandable ? "true" : "false");
        for (j = 0; j < g->block_count; j++) {
            const mn_block_info *b = &s->blocks[g->first_block + j];
            mn__c_printf(&o, "%s{\"address\":%llu,\"size\":%llu,\"requested_size\":%llu,"
                         "\"state\":\"%s\",", j ? "," : "", (unsigned long long)b->addr,
                         (unsigned long long)b->size, (unsigned long long)b->requested,
                         mn_block_state_name(b->state));
            if (b->state == MN_BLOCK_INACTIVE) mn__c_printf(&o, "\"frames\":[]}");
            else mn__c_json_frames(&o, b->category, b->label), mn__c_printf(&o, "}");
        }
        mn__c_printf(&o, "]}");
    }
    mn__c_printf(&o, "],\n\"device_traces\":[");
    for (k = 0; k < s->device_index; k++) mn__c_printf(&o, "[],");
    mn__c_printf(&o, "[");
    for (i = 0; i < s->trace_count && o.r == MN_OK; i++) {
        const mn_trace_entry *e = &s->trace[i];
        mn__c_printf(&o, "%s\n{\"action\":\"%s\",\"%s\":%llu,\"size\":%llu,\"stream\":%u,"
                     "\"time_us\":%llu,", i ? "," : "", mn_trace_action_name(e->action),
                     e->action == MN_TRACE_OOM ? "device_free" : "addr",
                     (unsigned long long)e->addr, (unsigned long long)e->size,
                     (unsigned)e->stream, (unsigned long long)e->time);
        if (e->action == MN_TRACE_ALLOC || e->action == MN_TRACE_FREE_REQUESTED ||
            e->action == MN_TRACE_FREE_COMPLETED || e->action == MN_TRACE_OOM)
            mn__c_json_frames(&o, e->category, NULL), mn__c_printf(&o, "}");
        else mn__c_printf(&o, "\"frames\":[]}");
    }
    mn__c_printf(&o, "]],\n\"allocator_settings\":{\"PYTORCH_CUDA_ALLOC_CONF\":\"\","
                 "\"max_split_size\":%lld,\"garbage_collection_threshold\":%g,"
                 "\"expandable_segments\":%s,\"roundup_power2_divisions\":[",
                 s->config.max_split_size ? (long long)s->config.max_split_size : -1LL,
                 s->config.garbage_collection_threshold,
                 s->config.expandable_segments ? "true" : "false");
    for (k = 0; k < MN_CACHE_ROUNDUP_INTERVALS; k++)
        mn__c_printf(&o, "%s%u", k ? "," : "", s->config.roundup_power2_divisions[k]);
    mn__c_printf(&o, "]}}\n");
    return o.r;
}

// ---- SVG timeline -------------------------------------------------------------------------------

MN__PRIVATE void mn__c_svg_bytes(char *buf, size_t cap, double v) {
    if (v >= 1073741824.0) snprintf(buf, cap, "%.1f GiB", v / 1073741824.0);
    else if (v >= 1048576.0) snprintf(buf, cap, "%.1f MiB", v / 1048576.0);
    else if (v >= 1024.0) snprintf(buf, cap, "%.1f KiB", v / 1024.0);
    else snprintf(buf, cap, "%.0f B", v);
}

#define MN__C_SVG_COLS 600

MNIMPL mn_result mn_cache_timeline_svg(const mn_cache_snapshot *s, const char *title,
                                       mn_cache_write_fn fn, void *user_data) {
    // columns: the state at the moment of largest allocated total within each slice of events
    static const char *const colors[MN_CAT_COUNT] = {"#9e9e9e", "#1f77b4", "#17becf", "#ff7f0e",
                                                     "#d62728", "#2ca02c", "#bcbd22", "#9467bd",
                                                     "#8c564b"};
    const double W = 960, H = 480, L = 80, R = 200, T = 40, B = 50;
    double pw = W - L - R, ph = H - T - B, ymax = 1;
    uint64_t cat[MN_CAT_COUNT], reserved, ncols, i, col;
    uint64_t (*colcat)[MN_CAT_COUNT] = NULL;
    uint64_t *colres = NULL, *coltot = NULL;
    char lab[48];
    mn__c_out o;
    int k, seen;
    if (!mn__c_snap_ok(s) || !fn) return MN_ERR_INVALID_ARG;
    o.fn = fn, o.ud = user_data, o.r = MN_OK;
    ncols = s->trace_count + 1 < MN__C_SVG_COLS ? s->trace_count + 1 : MN__C_SVG_COLS;
    colcat =
        (uint64_t(*)[MN_CAT_COUNT])mn__alloc_array(&s->allocator, (size_t)ncols, sizeof *colcat);
    colres = (uint64_t *)mn__alloc_array(&s->allocator, (size_t)ncols, sizeof *colres);
    coltot = (uint64_t *)mn__alloc_array(&s->allocator, (size_t)ncols, sizeof *coltot);
    if (!colcat || !colres || !coltot) {
        o.r = MN_ERR_OUT_OF_MEMORY;
        goto done;
    }
    memset(coltot, 0, (size_t)ncols * sizeof *coltot);
    memset(colres, 0, (size_t)ncols * sizeof *colres);
    memset(colcat, 0, (size_t)ncols * sizeof *colcat);
    memcpy(cat, s->base_cat_allocated, sizeof cat);
    reserved = s->base_reserved;
    for (i = 0; i <= s->trace_count; i++) {  // point i = state after i entries
        uint64_t tot = 0;
        if (i) mn__c_trace_apply(cat, &reserved, &s->trace[i - 1]);
        for (k = 0; k < MN_CAT_COUNT; k++) tot += cat[k];
        col = i * ncols / (s->trace_count + 1);
        if (tot >= coltot[col] || i == 0) {
            coltot[col] = tot;
            memcpy(colcat[col], cat, sizeof cat);
        }
        if (reserved > colres[col]) colres[col] = reserved;
        if ((double)reserved > ymax) ymax = (double)reserved;
        if ((double)tot > ymax) ymax = (double)tot;
    }
    mn__c_printf(&o, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                 "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n"
                 "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H, W, H);
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"24\" font-size=\"16\">", L);
    {
        const char *t = title ? title : "memory timeline";
        char esc[256];
        size_t n = 0;
        for (; *t && n < sizeof esc - 8; t++) {
            if (*t == '<') memcpy(esc + n, "&lt;", 4), n += 4;
            else if (*t == '>') memcpy(esc + n, "&gt;", 4), n += 4;
            else if (*t == '&') memcpy(esc + n, "&amp;", 5), n += 5;
            else esc[n++] = *t;
        }
        esc[n] = 0;
        mn__c_printf(&o, "%s</text>\n", esc);
    }
    for (k = 0; k <= 4; k++) {  // y axis grid and labels
        double y = T + ph - ph * k / 4.0;
        mn__c_svg_bytes(lab, sizeof lab, ymax * k / 4.0);
        mn__c_printf(&o, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                     "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                     L, y, L + pw, y, L - 6, y + 4, lab);
    }
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">allocator events "
                 "(%llu)</text>\n", L + pw / 2, H - 15, (unsigned long long)s->trace_count);
    // stacked areas, category 0 at the bottom
    for (k = 0, seen = 0; k < MN_CAT_COUNT; k++) {
        uint64_t c2;
        int any = 0;
        for (c2 = 0; c2 < ncols; c2++) any |= colcat[c2][k] != 0;
        if (!any) continue;
        mn__c_printf(&o, "<polygon fill=\"%s\" fill-opacity=\"0.85\" points=\"", colors[k]);
        for (c2 = 0; c2 < ncols; c2++) {  // upper edge left to right
            double top = 0;
            int j;
            for (j = 0; j <= k; j++) top += (double)colcat[c2][j];
            mn__c_printf(&o, "%.1f,%.1f ",
                         L + pw * (double)c2 / (double)(ncols > 1 ? ncols - 1 : 1),
                         T + ph - ph * top / ymax);
        }
        for (c2 = ncols; c2-- > 0;) {  // lower edge right to left
            double bot = 0;
            int j;
            for (j = 0; j < k; j++) bot += (double)colcat[c2][j];
            mn__c_printf(&o, "%.1f,%.1f ",
                         L + pw * (double)c2 / (double)(ncols > 1 ? ncols - 1 : 1),
                         T + ph - ph * bot / ymax);
        }
        mn__c_printf(&o, "\"/>\n");
        mn__c_printf(&o,
                     "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                     "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                     L + pw + 16, T + 18.0 * seen, colors[k], L + pw + 34, T + 18.0 * seen + 10,
                     mn_category_name((mn_category)k));
        seen++;
    }
    mn__c_printf(&o, "<polyline fill=\"none\" stroke=\"black\" stroke-width=\"1.5\" points=\"");
    for (col = 0; col < ncols; col++)
        mn__c_printf(&o, "%.1f,%.1f ", L + pw * (double)col / (double)(ncols > 1 ? ncols - 1 : 1),
                     T + ph - ph * (double)colres[col] / ymax);
    mn__c_printf(&o, "\"/>\n<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\" "
                 "stroke-width=\"1.5\"/><text x=\"%.0f\" y=\"%.0f\">reserved</text>\n",
                 L + pw + 16, T + 18.0 * seen + 6, L + pw + 28, T + 18.0 * seen + 6, L + pw + 34,
                 T + 18.0 * seen + 10);
    mn__c_svg_bytes(lab, sizeof lab, (double)s->stats.allocated_bytes[MN_STAT_ALL].peak);
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"%.0f\">peak allocated %s</text>\n", L + pw + 16,
                 T + 18.0 * (seen + 2), lab);
    mn__c_svg_bytes(lab, sizeof lab, (double)s->stats.reserved_bytes[MN_STAT_ALL].peak);
    mn__c_printf(&o, "<text x=\"%.0f\" y=\"%.0f\">peak reserved %s</text>\n", L + pw + 16,
                 T + 18.0 * (seen + 3), lab);
    mn__c_printf(&o, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
                 "stroke=\"black\"/>\n</svg>\n", L, T, pw, ph);
done:
    mn__free(&s->allocator, colcat);
    mn__free(&s->allocator, colres);
    mn__free(&s->allocator, coltot);
    return o.r;
}
// ---- >>cache/helpers: a cache on a simulated device, a FILE* writer, trace replay ---------------

MNIMPL mn_result mn_sim_cache_init(mn_sim_cache *sc, const mn_simdev_desc *dd,
                                   const mn_cache_desc *cd) {
    mn_simdev_desc d;
    mn_cache_desc c;
    mn_result r;
    if (!sc) return MN_ERR_INVALID_ARG;
    memset(sc, 0, sizeof *sc);
    memset(&d, 0, sizeof d);
    memset(&c, 0, sizeof c);
    if (dd) d = *dd;
    if (cd) c = *cd;
    if (!d.allocator.alloc_fn) d.allocator = c.allocator;
    if ((r = mn_simdev_init(&sc->dev, &d)) != MN_OK) return r;
    c.device = mn_simdev_device(&sc->dev);
    if ((r = mn_cache_init(&sc->cache, &c)) != MN_OK) mn_simdev_free(&sc->dev);
    return r;
}

MNIMPL void mn_sim_cache_free(mn_sim_cache *sc) {
    if (!sc) return;
    mn_cache_free(&sc->cache);
    mn_simdev_free(&sc->dev);
}

MNIMPL mn_result mn_cache_write_file(void *file, const char *data, size_t len) {
    if (!file || (!data && len)) return MN_ERR_INVALID_ARG;
    if (!len) return MN_OK;
    return fwrite(data, 1, len, (FILE *)file) == len ? MN_OK : MN_ERR_IO;
}

MNIMPL mn_result mn_write_file_atomic(const char *path, mn_file_body_fn body, void *ctx) {
    char tmp[4096];
    FILE *f;
    mn_result r;
    int n;
    if (!path || !body) return MN_ERR_INVALID_ARG;
    n = snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (n < 0 || (size_t)n >= sizeof tmp) return MN_ERR_INVALID_ARG;
    if (!(f = fopen(tmp, "wb"))) return MN_ERR_IO;
    r = body(ctx, f);
    if (fflush(f) != 0 && r == MN_OK) r = MN_ERR_IO;
    if (fclose(f) != 0 && r == MN_OK) r = MN_ERR_IO;
    if (r == MN_OK && rename(tmp, path) != 0) r = MN_ERR_IO;
    if (r != MN_OK) remove(tmp);
    return r;
}

// Trace id -> live block, open addressing with linear probing; a NULL block marks an empty slot
// (blocks of size 0 are never stored), so every id value is usable. The table grows with the
// blocks live at once (at most half full), not with the length of the trace: a long trace keeps
// a small, cache-friendly table.
typedef struct mn__c_idmap {
    uint64_t *id;
    void **block;
    uint64_t mask, live;
    uint32_t shift;  // 64 - log2(mask + 1)
    int direct;      // ids 0..mask index block[] themselves (no id[]): small dense ids
    const mn_allocator *al;
} mn__c_idmap;

// Fibonacci hashing (the top bits of the product): dense ids, as traces use, spread evenly.
MN__PRIVATE uint64_t mn__c_idmap_slot(const mn__c_idmap *m, uint64_t id) {
    uint64_t h;
    if (m->direct) return id;
    h = (id * 0x9E3779B97F4A7C15ull) >> m->shift;
    while (m->block[h] && m->id[h] != id) h = (h + 1) & m->mask;
    return h;
}

// A table of cap slots (a power of two), empty. MN_ERR_OUT_OF_MEMORY leaves m as it was.
MN__PRIVATE mn_result mn__c_idmap_alloc(mn__c_idmap *m, uint64_t cap) {
    uint64_t *id;
    void **block;
    if (cap > (uint64_t)SIZE_MAX / sizeof(void *) / 2) return MN_ERR_OVERFLOW;
    id = (uint64_t *)mn__alloc_array(m->al, (size_t)cap, sizeof *id);
    block = (void **)mn__alloc_array(m->al, (size_t)cap, sizeof *block);
    if (!id || !block) {
        mn__free(m->al, id);
        mn__free(m->al, block);
        return MN_ERR_OUT_OF_MEMORY;
    }
    memset(block, 0, (size_t)cap * sizeof *block);
    m->id = id, m->block = block, m->mask = cap - 1;
    m->shift = 64 - mn__c_log2_floor(cap);
    return MN_OK;
}

// Room for one more entry: doubles the table when it would be more than half full.
MN__PRIVATE mn_result mn__c_idmap_reserve(mn__c_idmap *m) {
    mn__c_idmap old = *m;
    uint64_t i;
    mn_result r;
    if (m->direct || (m->live + 1) * 2 <= m->mask + 1) return MN_OK;
    if ((r = mn__c_idmap_alloc(m, (m->mask + 1) * 2)) != MN_OK) return r;
    for (i = 0; i <= old.mask; i++)
        if (old.block[i]) {
            uint64_t h = mn__c_idmap_slot(m, old.id[i]);
            m->id[h] = old.id[i], m->block[h] = old.block[i];
        }
    mn__free(m->al, old.id);
    mn__free(m->al, old.block);
    return MN_OK;
}

// Empties slot h and moves back the entries of its probe run that would no longer be found.
MN__PRIVATE void mn__c_idmap_remove(mn__c_idmap *m, uint64_t h) {
    uint64_t j;
    m->block[h] = NULL;
    m->live--;
    if (m->direct) return;
    for (j = (h + 1) & m->mask; m->block[j]; j = (j + 1) & m->mask) {
        uint64_t id = m->id[j], g;
        void *b = m->block[j];
        m->block[j] = NULL;
        g = mn__c_idmap_slot(m, id);
        m->id[g] = id, m->block[g] = b;
    }
}

MN__PRIVATE mn_result mn__c_replay_event(mn_cache *c, mn__c_idmap *m, const mn_trace_event *e,
                                         mn_replay_counts *n) {
    uint64_t h = mn__c_idmap_slot(m, e->id);
    void *p = NULL;
    mn_result r;
    if (!e->alloc) {
        n->frees++;
        if (!m->block[h]) return n->unmatched_frees++, MN_OK;
        r = mn_cache_release(c, m->block[h]);
        mn__c_idmap_remove(m, h);
        return r;
    }
    n->allocations++;
    if (m->block[h]) {  // the id is live: its free was not recorded
        if ((r = mn_cache_release(c, m->block[h])) != MN_OK) return r;
        mn__c_idmap_remove(m, h);
    }
    if ((r = mn__c_idmap_reserve(m)) != MN_OK) return r;
    h = mn__c_idmap_slot(m, e->id);
    r = mn_cache_alloc(c, e->size, e->stream, (mn_category)e->category,
                       e->phase ? mn_phase_name((mn_phase)e->phase) : NULL, &p);
    if (r == MN_ERR_DEVICE_OOM) return n->failed++, MN_OK;
    if (r == MN_OK && p) {
        if (!m->direct) m->id[h] = e->id;
        m->block[h] = p, m->live++;
    }
    return r;
}

// The replay, with optional marks (mn_cache_replay_marked).
MN__PRIVATE mn_result mn__c_replay(mn_cache *c, const mn_trace_event *events, uint64_t count,
                                   int release_live, const uint64_t *marks, uint64_t nmarks,
                                   mn_replay_mark_fn at_mark, void *user_data,
                                   mn_replay_counts *counts) {
    mn__c_idmap m;
    mn_replay_counts n;
    uint64_t i, k = 0;
    mn_result r = MN_OK;
    if (!c || !c->p || (!events && count)) return MN_ERR_INVALID_ARG;
    if (nmarks && (!marks || !at_mark)) return MN_ERR_INVALID_ARG;
    for (i = 0; i < nmarks; i++)
        if (marks[i] > count || (i && marks[i] < marks[i - 1])) return MN_ERR_INVALID_ARG;
    memset(&n, 0, sizeof n);
    memset(&m, 0, sizeof m);
    m.al = &c->p->alloc;
    {  // ids no larger than a few times the trace (the estimator's tensor ids): a plain array,
       // walked nearly in order, instead of a hash table whose every probe misses the cache
        uint64_t top = 0;
        for (i = 0; i < count; i++) top = events[i].id > top ? events[i].id : top;
        if (count && top < 4 * count + 4096) {
            m.block = (void **)mn__alloc_array(m.al, (size_t)top + 1, sizeof *m.block);
            if (m.block) memset(m.block, 0, ((size_t)top + 1) * sizeof *m.block);
            m.direct = 1, m.mask = top;
        }
    }
    r = m.direct ? (m.block ? MN_OK : MN_ERR_OUT_OF_MEMORY) : mn__c_idmap_alloc(&m, 1024);
    for (i = 0; i <= count && r == MN_OK; i++) {
        for (; k < nmarks && marks[k] == i && r == MN_OK; k++) {
            r = at_mark(user_data, k, c);
            mn_cache_reset_peak_stats(c);
        }
        if (i < count && r == MN_OK) r = mn__c_replay_event(c, &m, &events[i], &n);
    }
    for (i = 0; release_live && m.block && i <= m.mask; i++)
        if (m.block[i]) {
            mn_result rr = mn_cache_release(c, m.block[i]);
            if (r == MN_OK) r = rr;
        }
    mn__free(m.al, m.id);
    mn__free(m.al, m.block);
    if (counts) *counts = n;
    return r;
}

MNIMPL mn_result mn_cache_replay(mn_cache *c, const mn_trace_event *events, uint64_t count,
                                 int release_live, mn_replay_counts *counts) {
    return mn__c_replay(c, events, count, release_live, NULL, 0, NULL, NULL, counts);
}

MNIMPL mn_result mn_cache_replay_marked(mn_cache *c, const mn_trace_event *events, uint64_t count,
                                        const uint64_t *marks, uint64_t nmarks,
                                        mn_replay_mark_fn at_mark, void *user_data,
                                        mn_replay_counts *counts) {
    return mn__c_replay(c, events, count, 0, marks, nmarks, at_mark, user_data, counts);
}

// >>optim implementation --------------------------------------------------------------------------
//
// State per parameter tensor of n elements (fp32 master):
//   SGD 0; SGD+momentum n*4 (momentum_buffer); AdamW n*8 (exp_avg, exp_avg_sq), +n*4 with amsgrad
//   (max_exp_avg_sq); Lion n*4 (exp_avg);
//   8-bit AdamW: n >= min_8bit_size -> 2 uint8 codes per element + one fp32 absmax per block for
//     each state, else 32-bit AdamW (bitsandbytes optim/optimizer.py, Optimizer8bit.init_state);
//   Adafactor (transformers optimization.py): ndim >= 2 -> row means (prod of dims[:-1]) + column
//     means (prod of dims[:-2] * dims[-1]) in fp32, ndim 1 -> full exp_avg_sq; + n*4 if beta1.
// Element updates run in fp32 like the reference implementations; scalars (bias corrections, step
// sizes) and reductions (norms, means) run in double.

MN__PRIVATE mn_result mn__numel(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n = 1;
    uint32_t i;
    if (!dims || ndim == 0 || ndim > 8 || !out) return MN_ERR_INVALID_ARG;
    for (i = 0; i < ndim; i++) {
        if (dims[i] == 0) return MN_ERR_INVALID_ARG;
        if (mn_mul_u64(n, dims[i], &n) != MN_OK) return MN_ERR_OVERFLOW;
    }
    *out = n;
    return MN_OK;
}

MNIMPL mn_result mn_sgd_state_bytes(const uint64_t *dims, uint32_t ndim, int momentum,
                                    uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    if (!momentum) { *out = 0; return MN_OK; }
    return mn_mul_u64(n, 4, out);
}

MNIMPL mn_result mn_adamw_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    return mn_mul_u64(n, 8, out);
}

MNIMPL mn_result mn_lion_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    return mn_mul_u64(n, 4, out);
}

#define MN__OPT_MAX_BLOCK 4096u  // the 8-bit step's largest block (its buffers are on the stack)

MNIMPL mn_result mn_adamw8bit_state_bytes(const uint64_t *dims, uint32_t ndim, uint32_t block_size,
                                          uint64_t min_8bit_size, uint64_t *out) {
    uint64_t n, blocks, codes, scales;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out || block_size > MN__OPT_MAX_BLOCK) return MN_ERR_INVALID_ARG;  // as init
    if (block_size == 0) block_size = 256;
    if (min_8bit_size == 0) min_8bit_size = 4096;
    if (n < min_8bit_size) return mn_mul_u64(n, 8, out);
    blocks = n / block_size + (n % block_size != 0);
    // two uint8 states (n each) + two fp32 absmax arrays (blocks each)
    if (mn_mul_u64(n, 2, &codes) != MN_OK) return MN_ERR_OVERFLOW;
    if (mn_mul_u64(blocks, 8, &scales) != MN_OK) return MN_ERR_OVERFLOW;
    return mn_add_u64(codes, scales, out);
}

MNIMPL mn_result mn_adafactor_state_bytes(const uint64_t *dims, uint32_t ndim, int beta1,
                                          uint64_t *out) {
    uint64_t n, floats, m = 0;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    if (ndim >= 2) {
        // prod(dims[:-1]) row means + prod(dims[:-2]) * dims[-1] column means
        r = mn_add_u64(n / dims[ndim - 1], n / dims[ndim - 2], &floats);
        if (r != MN_OK) return r;
    } else {
        floats = n;
    }
    if (beta1) m = n;
    if (mn_add_u64(floats, m, &floats) != MN_OK) return MN_ERR_OVERFLOW;
    return mn_mul_u64(floats, 4, out);
}

MNIMPL mn_result mn_optim_state_bytes(const mn_optim_desc *d, const uint64_t *dims, uint32_t ndim,
                                      uint64_t *out) {
    mn_optim kind = d ? d->kind : MN_OPTIM_DEFAULT;
    if (!out) return MN_ERR_INVALID_ARG;
    switch (kind) {
    case MN_OPTIM_DEFAULT:
    case MN_OPTIM_ADAMW: {
        uint64_t n = 0, extra;
        mn_result r = mn_adamw_state_bytes(dims, ndim, out);
        if (r != MN_OK || !d || !d->amsgrad) return r;
        if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
        if (mn_mul_u64(n, 4, &extra) != MN_OK) return MN_ERR_OVERFLOW;
        return mn_add_u64(*out, extra, out);
    }
    case MN_OPTIM_ADAMW_8BIT:
        return mn_adamw8bit_state_bytes(dims, ndim, d ? d->block_size : 0,
                                        d ? d->min_8bit_size : 0, out);
    case MN_OPTIM_SGD: return mn_sgd_state_bytes(dims, ndim, 0, out);
    case MN_OPTIM_SGD_MOMENTUM: return mn_sgd_state_bytes(dims, ndim, 1, out);
    case MN_OPTIM_ADAFACTOR:
        return mn_adafactor_state_bytes(dims, ndim, d ? d->adafactor_beta1 : 0, out);
    case MN_OPTIM_LION: return mn_lion_state_bytes(dims, ndim, out);
    case MN_OPTIM_NONE: {
        uint64_t n;
        mn_result r = mn__numel(dims, ndim, &n);
        if (r == MN_OK) *out = 0;
        return r;
    }
    case MN_OPTIM_COUNT: break;
    }
    return MN_ERR_INVALID_ARG;
}

// ---- fp16 / bf16 conversion ---------------------------------------------------------------------
//
// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; bfloat16: the top 16 bits of an
// fp32 (8 exponent bits, bias 127, 7 mantissa bits). fp32 -> 16 bits: keep the sign, rebias the
// exponent, shift the mantissa right rounding to nearest with ties to even (IEEE 754-2008 4.3.1);
// a mantissa carry moves into the exponent, which makes the overflow to inf come out right
// (fp16: |x| >= 65520 -> inf). Results below 2^-14 become fp16 subnormals (unit 2^-24).
// NaNs keep sign and top payload bits and get the quiet bit, as x86 F16C and ARM FCVT do.

MN__PRIVATE float mn__opt_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

MN__PRIVATE int mn__opt_finite(float f) { return (mn_hd_bits(f) & 0x7f800000u) != 0x7f800000u; }

// m >> s rounded to nearest, ties to even; m < 2^24, so s >= 25 always gives 0.
MN__PRIVATE uint32_t mn__opt_shr_rne(uint32_t m, uint32_t s) {
    uint32_t q, rem, half;
    if (s >= 25) return 0;
    q = m >> s;
    rem = m & ((1u << s) - 1u);
    half = 1u << (s - 1);
    return q + ((uint32_t)(rem > half) | ((uint32_t)(rem == half) & q & 1u));
}

MNIMPL uint16_t mn_fp32_to_fp16(float f) {
    uint32_t x = mn_hd_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    int32_t he = (int32_t)e - 127 + 15;  // binary16 biased exponent
    if (e == 0xffu) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u | (m >> 13) : 0u));
    if (he >= 31) return (uint16_t)(sign | 0x7c00u);
    if (he >= 1) return (uint16_t)(sign | (((uint32_t)he << 10) + mn__opt_shr_rne(m, 13)));
    if (e == 0) return (uint16_t)sign;  // fp32 subnormals are far below 2^-25
    // |x| = (2^23 + m) * 2^(e-150) = q * 2^-24 with q = (2^23 + m) >> (126 - e), shift >= 14
    return (uint16_t)(sign | mn__opt_shr_rne(m | 0x800000u, (uint32_t)(126 - (int32_t)e)));
}

MNIMPL float mn_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return mn__opt_float(sign | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0u));
    if (e != 0) return mn__opt_float(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return mn__opt_float(sign);
    e = 113;  // subnormal m * 2^-24: normalize so that bit 10 is the implicit one
    while (!(m & 0x400u)) m <<= 1, e--;
    return mn__opt_float(sign | (e << 23) | ((m & 0x3ffu) << 13));
}

MNIMPL uint16_t mn_fp32_to_bf16(float f) {
    uint32_t x = mn_hd_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

MNIMPL float mn_bf16_to_fp32(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    if ((x & 0x7fffffffu) > 0x7f800000u) x |= 0x400000u;
    return mn__opt_float(x);
}

// The array conversions: the same bits as the scalar functions above (checked for every fp32 and
// every 16-bit value), written without branches or loops per element so that they vectorize.
// fp32 -> fp16 with a = |x|: normal results are (a - 112 * 2^23) >> 13 rounded to nearest even
// (adding 0xfff plus the kept lsb carries into the exponent as it should); below 2^-14 the float
// sum a + 0.5 rounds a to a multiple of 2^-24 (the ulp of 0.5) in the hardware's round-to-nearest-
// even, and its low bits are that multiple, the subnormal's bits; from 2^16 on inf, NaN quieted.
MN__PRIVATE uint16_t mn__fp32_to_fp16_flat(float f) {
    uint32_t x = mn_hd_bits(f), a = x & 0x7fffffffu, r;
    uint32_t nrm = ((a - 0x38000000u) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    uint32_t sub = mn_hd_bits(mn__opt_float(a) + 0.5f) - 0x3f000000u;
    r = a < 0x38800000u ? sub : nrm;
    r = a >= 0x47800000u ? 0x7c00u : r;
    r = a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : r;
    return (uint16_t)(((x >> 16) & 0x8000u) | r);
}

// fp16 -> fp32: normals move the exponent and mantissa up by 13 bits and rebias by 112;
// subnormals m * 2^-24 are (0.5 + m * 2^-24) - 0.5, both steps exact (2^-24 is the ulp of 0.5).
MN__PRIVATE float mn__fp16_to_fp32_flat(uint16_t h) {
    uint32_t em = h & 0x7fffu, m = h & 0x3ffu, r;
    uint32_t nrm = (em << 13) + 0x38000000u;
    uint32_t sub = mn_hd_bits(mn__opt_float(0x3f000000u + em) - 0.5f);
    uint32_t nan = 0x7f800000u | (m << 13) | ((0u - (uint32_t)(m != 0)) & 0x400000u);
    r = em >= 0x400u ? nrm : sub;
    r = em >= 0x7c00u ? nan : r;
    return mn__opt_float(((uint32_t)(h & 0x8000u) << 16) | r);
}

MN__PRIVATE uint16_t mn__fp32_to_bf16_flat(float f) {
    uint32_t x = mn_hd_bits(f);
    uint32_t rne = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16, nan = (x >> 16) | 0x40u;
    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : rne);
}

MN__PRIVATE float mn__bf16_to_fp32_flat(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    return mn__opt_float((x & 0x7fffffffu) > 0x7f800000u ? x | 0x400000u : x);
}

// Elements of the fp32 array x before its first 64-byte aligned address (at most n). The casts
// run their vector loop from there: a vector load or store that straddles two cache lines costs
// about twice one that does not, and with 16-bit values on the other side, at most one of the
// two arrays can be aligned (fp32 -> bf16 at 6.3 M values, both arrays 16 bytes past a line:
// 0.62 of memcpy's bytes per second as it was, 0.92 with the fp32 side aligned).
MN__PRIVATE uint64_t mn__cast_head(const float *x, uint64_t n) {
    uint64_t h = (uint64_t)((64u - (uintptr_t)x % 64u) % 64u) / sizeof *x;
    return h < n ? h : n;
}

MNIMPL mn_result mn_fp32_to_fp16_array(const float *src, uint16_t *dst, uint64_t n) {
    uint64_t i, h;
    if ((n && (!src || !dst)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    for (i = 0, h = mn__cast_head(src, n); i < h; i++) dst[i] = mn__fp32_to_fp16_flat(src[i]);
    for (; i < n; i++) dst[i] = mn__fp32_to_fp16_flat(src[i]);
    return MN_OK;
}

MNIMPL mn_result mn_fp16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n) {
    uint64_t i, h;
    if ((n && (!src || !dst)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    for (i = 0, h = mn__cast_head(dst, n); i < h; i++) dst[i] = mn__fp16_to_fp32_flat(src[i]);
    for (; i < n; i++) dst[i] = mn__fp16_to_fp32_flat(src[i]);
    return MN_OK;
}

MNIMPL mn_result mn_fp32_to_bf16_array(const float *src, uint16_t *dst, uint64_t n) {
    uint64_t i, h;
    if ((n && (!src || !dst)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    for (i = 0, h = mn__cast_head(src, n); i < h; i++) dst[i] = mn__fp32_to_bf16_flat(src[i]);
    for (; i < n; i++) dst[i] = mn__fp32_to_bf16_flat(src[i]);
    return MN_OK;
}

MNIMPL mn_result mn_bf16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n) {
    uint64_t i, h;
    if ((n && (!src || !dst)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    for (i = 0, h = mn__cast_head(dst, n); i < h; i++) dst[i] = mn__bf16_to_fp32_flat(src[i]);
    for (; i < n; i++) dst[i] = mn__bf16_to_fp32_flat(src[i]);
    return MN_OK;
}

// ---- shared optimizer plumbing ------------------------------------------------------------------

// A [z] hyperparameter: 0 selects the default, MN_OPTIM_ZERO an explicit zero.
MN__PRIVATE float mn__opt_z(float v, float def) {
    if (v == 0.0f) return def;
    if (v == MN_OPTIM_ZERO) return 0.0f;
    return v;
}

// lo <= v < hi (or <= hi when hi_incl), and finite.
MN__PRIVATE int mn__opt_in(float v, float lo, float hi, int hi_incl) {
    if (!mn__opt_finite(v) || v < lo) return 0;
    return hi_incl ? v <= hi : v < hi;
}

MN__PRIVATE mn_result mn__opt_dtype(mn_dtype *dt) {
    if (*dt == MN_DTYPE_DEFAULT) *dt = MN_FP32;
    return (*dt == MN_FP32 || *dt == MN_FP16 || *dt == MN_BF16) ? MN_OK : MN_ERR_INVALID_ARG;
}

// One zero-filled block of `bytes` for a state; NULL when bytes is 0.
// OpenMP, when the build has it, for the element-wise optimizer steps and the ops: each thread
// owns a disjoint range of elements, so results do not depend on the thread count.
//
// A team sized to the work: one thread per `per` units of work, at most the OpenMP maximum, one
// (no team) below 2 * per. Its members claim the iterations in order, a run of about
// MN__OMP_CLAIM elements at a time, as they come for them (schedule(dynamic)): a member whose
// core is busy with another process, or that starts late, takes fewer runs and the others take
// the rest, where a fixed split (schedule(static)) would have the loop wait for its whole share.
// The end of the loop still waits for every member to arrive, so a member preempted in the
// middle of a run holds the loop up until it runs again (a scheduler time slice, milliseconds);
// nothing in a call shows that beforehand. The optimizer steps, whose state the caller keeps,
// time their steps and leave the team when it is not the faster (mn_team_tune); the stateless
// ops keep the team that their size gives.
//   MN__OMP_FOR_WORK(work, per, iters)
//   for (i = 0; i < iters; i++) body;      (one `for` over iters iterations, as `omp for`)
#define MN__PRAGMA(x) _Pragma(#x)
#ifdef _OPENMP
#include <omp.h>
// Elements per claim: tens of microseconds of a memory-bound loop (16384 elements measured 7 to
// 19 % slower than a fixed split on two idle cores, 65536 as fast).
#define MN__OMP_CLAIM 65536
MN__PRIVATE int mn__omp_team(uint64_t work, uint64_t per) {
    int max = omp_get_max_threads();
    uint64_t t = work / per;
    return t < 1 ? 1 : t < (uint64_t)max ? (int)t : max;
}
// Iterations per claim for a loop of `iters` iterations doing `work` elements in all (at least 1).
MN__PRIVATE int mn__omp_chunk(uint64_t work, uint64_t iters) {
    uint64_t c = iters / (work / MN__OMP_CLAIM + 1);
    return c < 1 ? 1 : c > (uint64_t)INT_MAX ? INT_MAX : (int)c;
}
#define MN__OMP_FOR_WORK(work, per, iters)                                                    \
    MN__PRAGMA(omp parallel for schedule(dynamic, mn__omp_chunk((work), (iters)))              \
               num_threads(mn__omp_team((work), (per))) if (mn__omp_team((work), (per)) > 1))
// The same loop with a team of `team` threads chosen by the caller (mn__tune_begin).
#define MN__OMP_FOR_TEAM(team, work, iters)                                                   \
    MN__PRAGMA(omp parallel for schedule(dynamic, mn__omp_chunk((work), (iters)))              \
               num_threads(team) if ((team) > 1))
MN__PRIVATE double mn__tune_clock(void) { return omp_get_wtime(); }
#else
#define MN__OMP_FOR_WORK(work, per, iters)
#define MN__OMP_FOR_TEAM(team, work, iters)
MN__PRIVATE int mn__omp_team(uint64_t work, uint64_t per) {
    (void)work, (void)per;
    return 1;
}
MN__PRIVATE double mn__tune_clock(void) { return 0.0; }
#endif

// mn_team_tune: the count for the next step from a team of `team` threads (sized to the work),
// then the step's seconds noted against the count it ran with. A new team size is timed afresh.
// Medians, not means: one step that a busy core or the first touch of the memory made slow
// (with either count) does not decide alone.
#define MN__TUNE_PROBE_TEAM 16u  // with one thread the faster, the team runs every 16th step
#define MN__TUNE_PROBE_ONE 256u  // with the team the faster, one thread every 256th step
// Median of the times kept in v[0..MN_TEAM_TUNE_KEEP) (the lower one of an even count); 0 when
// none is kept.
MN__PRIVATE double mn__tune_median(const double *v) {
    double w[MN_TEAM_TUNE_KEEP];
    int i, j, k = 0;
    for (i = 0; i < MN_TEAM_TUNE_KEEP; i++) {
        if (!(v[i] > 0.0)) continue;
        for (j = k++; j > 0 && w[j - 1] > v[i]; j--) w[j] = w[j - 1];
        w[j] = v[i];
    }
    return k ? w[(k - 1) / 2] : 0.0;
}
MN__PRIVATE int mn__tune_pick(mn_team_tune *t, int team) {
    double m0, m1;
    int best;
    if (team <= 1) return 1;
    if (t->team != team) {
        memset(t->sec[1], 0, sizeof t->sec[1]);
        t->team = team, t->next[1] = 0, t->since = 0;
    }
    m1 = mn__tune_median(t->sec[1]), m0 = mn__tune_median(t->sec[0]);
    if (m1 == 0.0) return team;
    if (m0 == 0.0) return 1;
    best = m1 < m0 ? team : 1;
    if (best != t->best) t->best = best, t->since = 0;
    if (++t->since < (best == 1 ? MN__TUNE_PROBE_TEAM : MN__TUNE_PROBE_ONE)) return best;
    t->since = 0;
    return best == 1 ? team : 1;
}
MN__PRIVATE void mn__tune_note(mn_team_tune *t, int ran, double sec) {
    int k = ran > 1;
    if (!(sec > 0.0)) return;
    t->sec[k][t->next[k] % MN_TEAM_TUNE_KEEP] = sec;
    t->next[k] = (t->next[k] + 1) % MN_TEAM_TUNE_KEEP;
}
MN__PRIVATE int mn__tune_begin(mn_team_tune *t, uint64_t work, uint64_t per, double *t0) {
    *t0 = mn__tune_clock();
    return mn__tune_pick(t, mn__omp_team(work, per));
}
MN__PRIVATE void mn__tune_end(mn_team_tune *t, int ran, double t0) {
    mn__tune_note(t, ran, mn__tune_clock() - t0);
}

// Element-wise steps take one thread per this many elements (two from twice as many): below, a
// team costs more than it saves, and a team whose second core is busy elsewhere waits for it.
#define MN__OPT_MIN_PAR 524288
// Vector iterations per run of the AdamW loop (16384 fp32 elements with AVX-512); a team member
// claims about MN__OMP_CLAIM elements of runs at a time.
#define MN__OPT_RUN 1024

// Vector lanes for the element-wise optimizer steps: GCC/clang vector extensions, the square root
// through the instruction set's intrinsic (sqrtf would keep errno and stay scalar). Square root,
// division and the other operations are correctly rounded per lane, so each element gets the bits
// of the scalar loop. Plain C with MEMANAT_NO_SIMD, other compilers or other machines.
#if (defined(__GNUC__) || defined(__clang__)) && !defined(MEMANAT_NO_SIMD) && \
    (defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__))
#include <immintrin.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>  // __get_cpuid (mn__pf_ahead)
#endif
#define MN__OV 1
#if defined(__AVX512F__)
#define MN__OW 16
// (maskz: the plain form starts from an undefined vector, which g++ 12 calls uninitialized)
#define MN__OSQRT(x) ((mn__ovf)_mm512_maskz_sqrt_ps((__mmask16)0xFFFF, (__m512)(x)))
#elif defined(__AVX__)
#define MN__OW 8
#define MN__OSQRT(x) ((mn__ovf)_mm256_sqrt_ps((__m256)(x)))
#else
#define MN__OW 4
#define MN__OSQRT(x) ((mn__ovf)_mm_sqrt_ps((__m128)(x)))
#endif
typedef float mn__ovf __attribute__((vector_size(MN__OW * sizeof(float))));
static inline mn__ovf mn__ov_load(const float *p) {
    mn__ovf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void mn__ov_store(float *p, mn__ovf v) { memcpy(p, &v, sizeof v); }
// Lane masks (all ones or zero, as vector comparisons give them) and selection by bits.
typedef int32_t mn__ovi __attribute__((vector_size(MN__OW * sizeof(int32_t))));
static inline mn__ovf mn__ov_sel(mn__ovi mask, mn__ovf a, mn__ovf b) {
    return (mn__ovf)((mask & (mn__ovi)a) | (~mask & (mn__ovi)b));
}
static inline mn__ovf mn__ov_abs(mn__ovf a) { return (mn__ovf)((mn__ovi)a & 0x7fffffff); }
// Lanes p[idx[l]] (32-bit elements), where the instruction set has a gather (the masked forms:
// the plain ones start from an undefined vector, as the square root's does).
#if defined(__AVX512F__)
#define MN__OGATHER(p, idx) \
    ((mn__ovf)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), (__mmask16)0xFFFF, (__m512i)(idx), \
                                       (p), 4))
#elif defined(__AVX2__)
#define MN__OGATHER(p, idx) \
    ((mn__ovf)_mm256_mask_i32gather_ps(_mm256_setzero_ps(), (p), (__m256i)(idx), \
                                       _mm256_castsi256_ps(_mm256_set1_epi32(-1)), 4))
#endif
// Lane-wise maximum and minimum of 32-bit integers, where there is a gather; MN__OMAXF(a, b) is
// a > b ? a : b lane by lane (b where either is NaN).
#if defined(__AVX512F__)
#define MN__OMAXF(a, b) ((mn__ovf)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define MN__OMAXI(a, b) ((mn__ovi)_mm512_max_epi32((__m512i)(a), (__m512i)(b)))
#define MN__OMINI(a, b) ((mn__ovi)_mm512_min_epi32((__m512i)(a), (__m512i)(b)))
#elif defined(__AVX2__)
#define MN__OMAXF(a, b) ((mn__ovf)_mm256_max_ps((__m256)(a), (__m256)(b)))
#define MN__OMAXI(a, b) ((mn__ovi)_mm256_max_epi32((__m256i)(a), (__m256i)(b)))
#define MN__OMINI(a, b) ((mn__ovi)_mm256_min_epi32((__m256i)(a), (__m256i)(b)))
#endif
// x / c for a float c (the same c for every lane) as RN32(RN64(x * RN64(1 / c))): x widened to
// double, one multiplication by the reciprocal rounded to double, narrowed back. Wherever x / c
// is not below FLT_MIN in magnitude (or is 0, inf, NaN), this is the correctly rounded quotient:
// the double path's relative error is below 2^-52 (two roundings to 53 bits), while a quotient of
// normal size is never a float midpoint and lies at least 2^-48 away from one (relative). With
// x = X 2^i, c = C 2^j (X, C < 2^24, C >= 2^23) and a midpoint M 2^k (M odd, M >= 2^24), x - c M
// 2^k is a nonzero multiple of 2^(j+k) (i >= j + k, else X, near C M 2^(j+k-i) >= 2^48, could not
// be below 2^24) against c M 2^k < 2^(48 + j + k). Below FLT_MIN, midpoints have small M and a
// quotient can be one exactly (x = 3 * 2^-149, c = 6), where the double path may round the other
// way: callers keep to quotients of normal size. AdamW's sqrt(v) / sqrt(1 - beta2^t) qualifies:
// sqrt of a float is 0 or at least 2^-75, and the divisor is at most 1. (Double rounding through
// binary64 is innocuous for one division of binary32 operands, as 53 >= 2 * 24 + 2: Figueroa,
// "When is double rounding innocuous?", SIGNUM 1995.) No division instruction: the divide/square-
// root unit, which bounds AdamW's loop, serves the rest.
#if defined(__has_builtin)
#if __has_builtin(__builtin_convertvector)
#define MN__OVD 1
typedef double mn__ovd __attribute__((vector_size(MN__OW * sizeof(double))));
static inline mn__ovf mn__ov_divc(mn__ovf x, double rc) {
    return __builtin_convertvector(__builtin_convertvector(x, mn__ovd) * rc, mn__ovf);
}
#endif
#endif
#else
#define MN__OV 0
#endif

// Whether the norms (forward and backward), the GELU and the Adafactor step make their requests
// ahead (mn__prefetch, MN__OPT_AF_PF) in a large call. They were measured to pay on a Zen 5 core
// (the figures at each op) and to cost on a Zen 4 core, where the hardware prefetcher alone does
// better (one Zen 4 core, one thread, 8192 x 768 fp32, medians of 21 to 31 cold runs, alternated:
// layernorm forward 2.9-3.0 ms with them, 2.2 without; its backward 6.6-6.9 with, 3.9-4.1 without,
// and 5.6 asking one line per 16 floats as the row goes instead of the row at once; GELU backward
// 6.1 with, 4.6 without; GELU forward 3.0 either way; an Adafactor step on [8192, 768] 8.4 with,
// 6.2 without, medians of 6 runs' medians). So they are made but on AMD family 19h (Zen 3 and Zen
// 4; Zen 3 not measured), a fact of the CPU read once with cpuid (microseconds under a hypervisor)
// and kept; MEMANAT_PREFETCH decides at build time instead. The causal softmax's requests and those
// of mn__nt_row_pass stay on everywhere: on the Zen 4 core the causal softmax forward took 3.2 ms
// with them, 4.2 without, and the cross-entropy forward lost without them too. A hint only: every
// op's bits are the same.
#if defined(MEMANAT_PREFETCH)
MN__PRIVATE int mn__pf_ahead(void) { return MEMANAT_PREFETCH != 0; }
#elif MN__OV && (defined(__x86_64__) || defined(__i386__))
MN__PRIVATE int mn__pf_ahead(void) {
    static int known;  // 0: not read yet, 1: make them, 2: not
    int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (!k) {
        unsigned a, b, c, d, fam;
        k = 1;
        if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u &&  // "Auth" of AuthenticAMD
            __get_cpuid(1, &a, &b, &c, &d)) {
            fam = (a >> 8) & 0xfu;  // the base family, plus the extended one past 0xf
            if (fam == 0xfu) fam += (a >> 20) & 0xffu;
            if (fam == 0x19u) k = 2;
        }
        __atomic_store_n(&known, k, __ATOMIC_RELAXED);
    }
    return k == 1;
}
#else
MN__PRIVATE int mn__pf_ahead(void) { return 1; }
#endif

MN__PRIVATE mn_result mn__opt_alloc(const mn_allocator *a, uint64_t bytes, void **out) {
    *out = NULL;
    if (bytes == 0) return MN_OK;
    if ((uint64_t)(size_t)bytes != bytes) return MN_ERR_OVERFLOW;
    *out = mn__alloc(a, (size_t)bytes);
    if (!*out) return MN_ERR_OUT_OF_MEMORY;
    memset(*out, 0, (size_t)bytes);
    return MN_OK;
}

MN__PRIVATE mn_result mn__opt_step_check(uint64_t n, const float *param, const float *grad,
                                         mn_dtype dt, const uint16_t *param16) {
    if (n == 0) return MN_ERR_STATE;  // not initialized, or freed
    if (!param || !grad) return MN_ERR_INVALID_ARG;
    if (dt != MN_FP32 && !param16) return MN_ERR_INVALID_ARG;
    return MN_OK;
}

// Rewrites the 16-bit model tensor from the fp32 master after a step.
MN__PRIVATE void mn__opt_store16(mn_dtype dt, const float *param, uint16_t *param16, uint64_t n) {
    if (dt == MN_FP16) mn_fp32_to_fp16_array(param, param16, n);
    else if (dt == MN_BF16) mn_fp32_to_bf16_array(param, param16, n);
}

MN__PRIVATE mn_allocator mn__opt_allocator(const mn_allocator *a) {
    mn_allocator z;
    memset(&z, 0, sizeof z);
    return a ? *a : z;
}

// torch.lerp for float: weight < 0.5 ? a + w (b - a) : b - (b - a)(1 - w)  (aten Lerp.h)
MN__PRIVATE float mn__opt_lerp(float a, float b, float w) {
    return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

// ---- SGD ----------------------------------------------------------------------------------------
//
// torch.optim.SGD docs (algorithm box), per element with lr γ, momentum μ, dampening τ, decay λ:
//   g ← g + λθ;  b ← g at t = 1, else b ← μb + (1−τ)g;  g ← g + μb (nesterov) or g ← b;  θ ← θ − γg

MNIMPL mn_result mn_sgd_init(mn_sgd *s, const uint64_t *dims, uint32_t ndim, const mn_sgd_params *p,
                             const mn_allocator *alloc) {
    mn_sgd_params q;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-3f);
    q.momentum = mn__opt_z(q.momentum, 0.0f);
    q.dampening = mn__opt_z(q.dampening, 0.0f);
    q.weight_decay = mn__opt_z(q.weight_decay, 0.0f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.momentum, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.dampening, 0.0f, 1.0f, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (q.nesterov && (q.momentum <= 0.0f || q.dampening != 0.0f)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    if ((r = mn_sgd_state_bytes(dims, ndim, q.momentum != 0.0f, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->momentum_buffer = (float *)mem;
    s->state_bytes = bytes;
    return MN_OK;
}

MNIMPL mn_result mn_sgd_step(mn_sgd *s, float *param, const float *grad, uint16_t *param16) {
    float lr, mu, damp, wd, g;
    uint64_t i;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    lr = s->params.lr, mu = s->params.momentum;
    damp = s->params.dampening, wd = s->params.weight_decay;
    s->step++;
    i = 0;
#if MN__OV
    {  // the loop below, MN__OW lanes at a time (its tests are the same for every element)
        int64_t jb, nb = (int64_t)(s->n / MN__OW);
        int neg = s->params.maximize, first = s->step == 1, nest = s->params.nesterov;
        float *mb = s->momentum_buffer;
        double t0;
        int team = mn__tune_begin(&s->tune, s->n, MN__OPT_MIN_PAR, &t0);
        MN__OMP_FOR_TEAM(team, s->n, nb)
        for (jb = 0; jb < nb; jb++) {
            uint64_t k = (uint64_t)jb * MN__OW;
            mn__ovf gv = mn__ov_load(grad + k), th = mn__ov_load(param + k), bv;
            if (neg) gv = -gv;
            if (wd != 0.0f) gv = gv + wd * th;
            if (mu != 0.0f) {
                bv = first ? gv : mn__ov_load(mb + k) * mu + (1.0f - damp) * gv;
                mn__ov_store(mb + k, bv);
                gv = nest ? gv + mu * bv : bv;
            }
            mn__ov_store(param + k, th - lr * gv);
        }
        mn__tune_end(&s->tune, team, t0);
        i = (uint64_t)nb * MN__OW;
    }
#endif
    for (; i < s->n; i++) {
        g = s->params.maximize ? -grad[i] : grad[i];
        if (wd != 0.0f) g = g + wd * param[i];
        if (mu != 0.0f) {
            float *b = &s->momentum_buffer[i];
            *b = s->step == 1 ? g : *b * mu + (1.0f - damp) * g;
            g = s->params.nesterov ? g + mu * *b : *b;
        }
        param[i] = param[i] - lr * g;
    }
    mn__opt_store16(s->params.dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_sgd_free(mn_sgd *s) {
    if (!s) return;
    mn__free(&s->alloc, s->momentum_buffer);
    memset(s, 0, sizeof *s);
}

// ---- AdamW --------------------------------------------------------------------------------------
//
// torch.optim.AdamW docs and torch/optim/adam.py (_single_tensor_adam, decoupled weight decay):
//   θ ← θ(1 − γλ);  m ← lerp(m, g, 1−β1);  v ← β2 v + (1−β2) g²;  amsgrad: v̄ ← max(v̄, v), use v̄
//   θ ← θ − (γ / (1−β1^t)) · m / (√v / √(1−β2^t) + ε)        (ε outside the square root)

MNIMPL mn_result mn_adamw_init(mn_adamw *s, const uint64_t *dims, uint32_t ndim,
                               const mn_adamw_params *p, const mn_allocator *alloc) {
    mn_adamw_params q;
    mn_optim_desc d;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-3f);
    q.beta1 = mn__opt_z(q.beta1, 0.9f);
    q.beta2 = mn__opt_z(q.beta2, 0.999f);
    q.eps = mn__opt_z(q.eps, 1e-8f);
    q.weight_decay = mn__opt_z(q.weight_decay, 1e-2f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta2, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    memset(&d, 0, sizeof d);
    d.kind = MN_OPTIM_ADAMW;
    d.amsgrad = q.amsgrad != 0;
    if ((r = mn_optim_state_bytes(&d, dims, ndim, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->exp_avg = (float *)mem;
    s->exp_avg_sq = s->exp_avg + n;
    s->max_exp_avg_sq = q.amsgrad ? s->exp_avg_sq + n : NULL;
    s->state_bytes = bytes;
    return MN_OK;
}

// One element of AdamW's common case (no maximize, no amsgrad), in the general loop's order.
typedef struct mn__opt_aw {
    float decay, w1, b2, step_size, bc2_sqrt, eps;
} mn__opt_aw;
static inline void mn__opt_adamw_el(float *param, const float *grad, float *ea, float *eb,
                                    int64_t j, const mn__opt_aw *c) {
    float g = grad[j], th = param[j] * c->decay, m, v;
    m = ea[j] = mn__opt_lerp(ea[j], g, c->w1);
    v = eb[j] = eb[j] * c->b2 + (1.0f - c->b2) * g * g;
    param[j] = th - c->step_size * (m / (sqrtf(v) / c->bc2_sqrt + c->eps));
}

MNIMPL mn_result mn_adamw_step(mn_adamw *s, float *param, const float *grad, uint16_t *param16) {
    const mn_adamw_params *p;
    double t, bc1, bc2;
    float decay, step_size, bc2_sqrt, w1, b2;
    mn__opt_aw c;
    uint64_t i;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    t = (double)++s->step;
    bc1 = 1.0 - pow((double)p->beta1, t);
    bc2 = 1.0 - pow((double)p->beta2, t);
    decay = (float)(1.0 - (double)p->lr * (double)p->weight_decay);
    step_size = (float)((double)p->lr / bc1);
    bc2_sqrt = (float)sqrt(bc2);
    w1 = 1.0f - p->beta1, b2 = p->beta2;
    c.decay = decay, c.w1 = w1, c.b2 = b2, c.step_size = step_size, c.bc2_sqrt = bc2_sqrt;
    c.eps = p->eps;
    if (!p->maximize && !p->amsgrad) {  // the common case: no branch in the loop, threads
        float *ea = s->exp_avg, *eb = s->exp_avg_sq;
        int64_t j, n = (int64_t)s->n, j0 = 0;
#if MN__OV
        int64_t nb, h, run, nr;
        float eps = p->eps;
        double t0;
        int team;
#ifdef MN__OVD
        const double rc = 1.0 / (double)bc2_sqrt;
#endif
        // the first h elements one by one, so that the lanes store the moments to whole 64-byte
        // lines (a 64-byte access across two lines costs two)
        h = (int64_t)(((64u - ((uintptr_t)ea & 63u)) & 63u) / sizeof(float));
        h = h < n ? h : n;
        for (j = 0; j < h; j++) mn__opt_adamw_el(param, grad, ea, eb, j, &c);
        nb = (n - h) / MN__OW;
        nr = (nb + MN__OPT_RUN - 1) / MN__OPT_RUN;
        team = mn__tune_begin(&s->tune, (uint64_t)n, MN__OPT_MIN_PAR, &t0);
        MN__OMP_FOR_TEAM(team, n, nr)
        for (run = 0; run < nr; run++) {  // runs of MN__OPT_RUN vector iterations
            int64_t jb, end = (run + 1) * MN__OPT_RUN < nb ? (run + 1) * MN__OPT_RUN : nb;
            for (jb = run * MN__OPT_RUN; jb < end; jb++) {  // the loop below, MN__OW lanes
                int64_t k = h + jb * MN__OW;
                mn__ovf g = mn__ov_load(grad + k), a = mn__ov_load(ea + k), m, v;
                mn__ovf th = mn__ov_load(param + k) * decay;
                m = w1 < 0.5f ? a + w1 * (g - a) : g - (g - a) * (1.0f - w1);  // mn__opt_lerp
                v = mn__ov_load(eb + k) * b2 + (1.0f - b2) * g * g;
                mn__ov_store(ea + k, m), mn__ov_store(eb + k, v);
#ifdef MN__OVD
                mn__ovf d = mn__ov_divc(MN__OSQRT(v), rc) + eps;  // = sqrt(v) / bc2_sqrt + eps
#else
                mn__ovf d = MN__OSQRT(v) / bc2_sqrt + eps;
#endif
                mn__ov_store(param + k, th - step_size * (m / d));
            }
        }
        mn__tune_end(&s->tune, team, t0);
        j0 = h + nb * MN__OW;
#endif
#if !MN__OV  // (with lanes, fewer than MN__OW elements are left: no team, not even its call)
        MN__OMP_FOR_WORK(n - j0, MN__OPT_MIN_PAR, n - j0)
#endif
        for (j = j0; j < n; j++) mn__opt_adamw_el(param, grad, ea, eb, j, &c);
        mn__opt_store16(p->dtype, param, param16, s->n);
        return MN_OK;
    }
    for (i = 0; i < s->n; i++) {
        float g = p->maximize ? -grad[i] : grad[i];
        float th = param[i] * decay, m, v, denom;
        m = s->exp_avg[i] = mn__opt_lerp(s->exp_avg[i], g, w1);
        v = s->exp_avg_sq[i] = s->exp_avg_sq[i] * b2 + (1.0f - b2) * g * g;
        if (p->amsgrad) {
            if (v > s->max_exp_avg_sq[i]) s->max_exp_avg_sq[i] = v;
            v = s->max_exp_avg_sq[i];
        }
        denom = sqrtf(v) / bc2_sqrt + p->eps;
        param[i] = th - step_size * (m / denom);
    }
    mn__opt_store16(p->dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_adamw_free(mn_adamw *s) {
    if (!s) return;
    mn__free(&s->alloc, s->exp_avg);
    memset(s, 0, sizeof *s);
}

// Forced inlining for the optimizers' vector helpers (their locals then stay in registers).
#if defined(__GNUC__) || defined(__clang__)
#define MN__OPT_INLINE static inline __attribute__((always_inline, unused))
#else
#define MN__OPT_INLINE static inline
#endif

// ---- 8-bit AdamW --------------------------------------------------------------------------------
//
// bitsandbytes (Dettmers et al. 2022, arXiv 2110.02861; csrc/kernels.cu
// kOptimizerStatic8bit2StateBlockwise, ADAM). Per block of B elements, with maps Q1 (signed) and
// Q2 (unsigned) and scales a1, a2:
//   m ← β1 Q1[c1]·a1 + (1−β1) g;   v ← β2 Q2[c2]·a2 + (1−β2) g²    (both 0 where g is inf/NaN)
//   a1 ← max|m|, a2 ← max v over the block;  c2 ← nearest(v/a2);
//   c1 ← nearest(m/a1), moved one entry down when m < 0 lands on 0 (the sign of m is kept)
//   θ ← θ − γ √(1−β2^t)/(1−β1^t) · m / (√v + ε√(1−β2^t));  θ ← θ(1 − γλ)  (decay after the step)
// The update uses the fp32 m and v before re-quantization. Tensors below min_8bit_size keep fp32 m
// and v with the same update (kOptimizer32bit2State). An element with a non-finite gradient is
// left unchanged. As in bitsandbytes, a v below about 1.6e-7 of its block's absmax is stored as 0,
// so an element whose gradient stays tiny while others are large can take one large step.

// create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) (bitsandbytes functional.py):
// for i = 0..6, midpoints of linspace(0.1, 1, 2^i + 1) (signed) or 2^(i+1) + 1 (unsigned) scaled
// by 10^(i-6), negated copies when signed, plus 0 and 1. The groups are disjoint and increasing,
// so writing them in order gives the sorted map. Computed in fp32 with torch.linspace's formula
// (start + step*k in the first half, end - step*(steps-1-k) in the second).
MNIMPL mn_result mn_dynamic_map(int is_signed, float map[256]) {
    float pos[254];
    int npos = 0, i, k, j = 0;
    if (!map) return MN_ERR_INVALID_ARG;
    for (i = 0; i < 7; i++) {
        int steps = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1, half = steps / 2;
        float start = 0.1f, end = 1.0f, step = (end - start) / (float)(steps - 1), prev = 0.0f;
        float scale = (float)pow(10.0, (double)(i - 6));
        for (k = 0; k < steps; k++) {
            float b = k < half ? start + step * (float)k : end - step * (float)(steps - 1 - k);
            if (k > 0) pos[npos++] = scale * ((prev + b) / 2.0f);
            prev = b;
        }
    }
    if (is_signed)
        for (k = npos - 1; k >= 0; k--) map[j++] = -pos[k];
    map[j++] = 0.0f;
    for (k = 0; k < npos; k++) map[j++] = pos[k];
    map[j++] = 1.0f;
    MN_ASSERT(j == 256);
    return MN_OK;
}

// Index of the map entry nearest to x (map ascending); ties go to the larger entry. Branch-free
// binary search: i ends as the number of entries below x, at most 255.
MN__PRIVATE uint8_t mn__opt_nearest(const float *map, float x) {
    uint32_t i = 0, step;
    for (step = 128; step > 0; step >>= 1) i += step & (0u - (uint32_t)(map[i + step - 1] < x));
    if (i == 0) return 0;
    return (uint8_t)(i - (uint32_t)(x - map[i - 1] < map[i] - x));
}

// The same index without the search, for the two dynamic maps of the 8-bit step. For x between
// map[k-1] and map[k] the search's last comparison, x - map[k-1] < map[k] - x, is true below some
// float and false from it on (the rounded differences are monotone in x): call that float the
// threshold T_k, found by bisection on the float order. The index is then the number of thresholds
// at or below x (x <= map[0]: none; x above map[255]: all 255). The floats are cut into buckets by
// sign, exponent and the top MN__OPT_QM mantissa bits (every |x| < 2^-24 (1 + 2^-7) in the first
// bucket of its sign, every |x| >= 2 - 2^-7 in the last); a bucket keeps the index at its smallest
// float and the one threshold inside it, and the table is used only when no bucket holds two and
// the two edge buckets of each sign hold none (checked as it is built; true for both dynamic maps).
// Every float of an inner bucket shares the top 16 bits of its order key (mn__opt_okey), so x >= T
// is a comparison of the low 16 bits L of the keys, and a bucket is one 32-bit word: the index p
// at its smallest float shifted up by 17, plus 2^17 - L(T) (L(T) = 2^16, which no key reaches,
// where it has none). Adding L(x) < 2^16 to the word carries into bit 17 exactly when
// L(x) >= L(T), so the index of x is (word + L(x)) >> 17. One gather per MN__OW values where the
// instruction set has one: on AVX-512 it costs less than a branch-free binary search of the 255
// thresholds held in registers (eight levels of permutes and compares). The search it replaces is
// bitsandbytes' (csrc/kernels.cu dQuantize: binary search, then the nearer neighbour). The test
// compares the two on each bucket's edges, around every midpoint and on a sweep of [-1, 1]; with
// MN_TEST_EXHAUSTIVE=1 on every float of [-1, 1].
#define MN__OPT_QM 7u
#define MN__OPT_QE0 103u  // biased exponent of 2^-24
#define MN__OPT_QE1 127u  // biased exponent of 1
#define MN__OPT_QJ ((MN__OPT_QE1 - MN__OPT_QE0 + 1u) << MN__OPT_QM)  // buckets per sign
#define MN__OPT_QNONE 0x10000u  // a bucket without a threshold
// The arithmetic form of the same index (mn__opt_qarith_init, mn__opt_codes_a).
typedef struct mn__opt_qarith {
    float split[32];  // bucket e: the first float of its second segment (NaN: one segment)
    float nsplit[32];  // the same for |x| of x < 0 (the mirrored threshold, an ulp off or not)
    int32_t seg[32];  // bucket e: the segment of its first float
    float a[16], c[16];  // segment s: r = a[s] * |x| + c[s]
    int32_t hi[16];      // segment s: the largest index in it
    int mirror;          // x < 0: index 254 - index(|x|) (else 0)
    int ok;
} mn__opt_qarith;
typedef struct mn__opt_qtab {
    uint32_t ent[2 * MN__OPT_QJ];  // negative buckets (most negative first), then positive
    int32_t zero;                  // entries below 0: map[i] >= 0 exactly when i >= zero
    int ok;                        // the conditions above hold
    mn__opt_qarith ar;             // ar.ok: the index without the table where it applies
} mn__opt_qtab;

// Bucket of x (mn_hd_q8_bucket): j orders the magnitudes, the negative half runs backwards.
static inline uint32_t mn__opt_qbucket(float x) { return mn_hd_q8_bucket(mn_hd_bits(x)); }

// Float order as unsigned order (-0 just below +0), and back.
MN__PRIVATE uint32_t mn__opt_okey(float f) {
    uint32_t u = mn_hd_bits(f);
    return (u >> 31) ? ~u : u | 0x80000000u;
}
MN__PRIVATE float mn__opt_ofloat(uint32_t k) {
    return mn__opt_float((k >> 31) ? k & 0x7fffffffu : ~k);
}

// The thresholds T_1 .. T_255 of a map (thr[k - 1] = T_k); 0 unless the map is strictly
// ascending and finite.
MN__PRIVATE int mn__opt_thresholds(const float *map, float thr[255]) {
    uint32_t k;
    for (k = 1; k < 256; k++) {  // T_k: the first float of (map[k-1], map[k]] where the test fails
        float a = map[k - 1], b = map[k];
        uint32_t lo = mn__opt_okey(a), hi = mn__opt_okey(b);  // the test holds at lo, fails at hi
        uint32_t g = mn__opt_okey(a + (b - a) / 2.0f), step;  // T_k is within a few floats of g
        if (!(a < b) || !mn__opt_finite(a) || !mn__opt_finite(b)) return 0;
        for (step = 1; step < 64 && g > lo && g < hi; step *= 2) {  // bracket g: lo < T_k <= hi
            float x = mn__opt_ofloat(g);
            if (x - a < b - x) lo = g, g = g + step < hi ? g + step : hi;
            else hi = g, g = g - step > lo ? g - step : lo;
        }
        while (hi - lo > 1) {
            uint32_t mid = lo + (hi - lo) / 2;
            float x = mn__opt_ofloat(mid);
            if (x - a < b - x) lo = mid;
            else hi = mid;
        }
        thr[k - 1] = mn__opt_ofloat(hi);
    }
    return 1;
}

#if MN__OV && MN__OW == 16 && defined(__AVX512F__) && defined(__AVX512DQ__)
// The index of the nearest entry by arithmetic, for maps made of runs of evenly spaced entries
// (the dynamic maps: decades of linspace midpoints), where a gather costs more (AVX-512). The
// floats |x| are cut into buckets by biased exponent (96 for everything below 2^-30, 127 for
// everything from 1 up) and the thresholds T_k >= 0 into segments: a segment starts at a
// threshold T_s and holds the thresholds after it that lie on one line; r = a |x| + c puts T_k of
// the segment at r = k (to rounding), so that floor(r), capped at the segment's last index, is the
// index of x. A bucket holds at most one segment start (split), found by an exact comparison.
// x < 0 takes 254 - index(|x|) (at least 0) for signed maps, whose negative half mirrors the
// positive one (the mirrored segment starts, an ulp away or not, are their own splits), and 0
// for maps without entries below 0. Where r lies within MN__OPT_QA_WIN of an integer (x next to
// a threshold) or is not a number, the table decides. Checked as it is built, for each sign: on
// every interval of |x| between consecutive thresholds, bucket and segment starts, the indices
// that floor(r) can give outside the windows (r is monotone on it) must equal the search's,
// which is constant on it; ok = 0 (the table alone) where one differs. About 25 instructions
// for 16 values against 12 and a gather; on AMD Zen 5 the two gathers were some 40% of the 8-bit
// step. The lines are good to about 1e-5 of an index: 1 lane in 2000 falls in a window.
#define MN__OPT_QARITH 1
#define MN__OPT_QA_WIN (1.0f / 4096.0f)
#define MN__OPT_QA_E0 96

// Segment of |x| = y >= 0 in the tables of q (neg: x < 0).
static inline int32_t mn__opt_qa_seg(const mn__opt_qarith *q, float y, int neg) {
    uint32_t e = mn_hd_bits(y) >> 23;
    e = e < MN__OPT_QA_E0 ? MN__OPT_QA_E0 : e > MN__OPT_QA_E0 + 31 ? MN__OPT_QA_E0 + 31 : e;
    return q->seg[e & 31u] + (int32_t)(y >= (neg ? q->nsplit : q->split)[e & 31u]);
}

// The codes that the fast path can give for r in [rl, rr] outside the windows all equal want (the
// cap hi, then the sign rule: mirror, neg: 254 - code, or 0 for !mirror and neg).
MN__PRIVATE int mn__opt_qa_check(float rl, float rr, int32_t hi, int neg, int mirror,
                                 uint32_t want) {
    double lo = floor((double)rl - 1.0 + (double)MN__OPT_QA_WIN) + 1.0;
    double up = ceil((double)rr - (double)MN__OPT_QA_WIN) - 1.0;
    double ms[2];
    int i;
    if (!(rl <= rr)) return 0;
    if (lo > up) return 1;  // no fast path on it
    ms[0] = lo, ms[1] = up;
    for (i = 0; i < 2; i++) {
        int64_t m = (int64_t)ms[i], f;
        if (m < -1000 || m > 1000) return 0;
        f = m < 0 ? m + 1 : m;  // truncation toward zero
        f = f < hi ? f : hi;
        if (neg) f = mirror && f < 254 ? 254 - f : 0;
        if (f != (int64_t)want) return 0;
    }
    return 1;
}

MN__PRIVATE int mn__opt_cmpf(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

// Checks the side neg of q on the intervals of y between the breaks brk [nb] (sorted here). The
// search's index of x is the number of thresholds at or below it (thr [255], ascending).
MN__PRIVATE int mn__opt_qa_verify(const mn__opt_qarith *q, const float *thr, float *brk,
                                  int32_t nb, int32_t nseg, int neg) {
    int32_t i, p = 0;
    qsort(brk, (size_t)nb, sizeof brk[0], mn__opt_cmpf);
    while (neg && p < 255 && thr[p] <= 0.0f) p++;  // x = -y falls as y rises
    for (i = 0; i < nb; i++) {  // each interval [brk[i], next break)
        float yl = brk[i], yr, rl, rr;
        int32_t sl, sr;
        uint32_t pl, pr;
        if (i + 1 < nb && brk[i + 1] == yl) continue;
        yr = i + 1 < nb ? nextafterf(brk[i + 1], 0.0f) : FLT_MAX;
        sl = mn__opt_qa_seg(q, yl, neg), sr = mn__opt_qa_seg(q, yr, neg);
        if (sl != sr || sl >= nseg || !(q->a[sl] >= 0.0f)) return 0;
        rl = fmaf(q->a[sl], yl, q->c[sl]), rr = fmaf(q->a[sl], yr, q->c[sl]);
        if (neg) {
            while (p > 0 && thr[p - 1] > -yl) p--;
            pl = (uint32_t)p;
            while (p > 0 && thr[p - 1] > -yr) p--;
            pr = (uint32_t)p;
        } else {
            while (p < 255 && thr[p] <= yl) p++;
            pl = (uint32_t)p;
            while (p < 255 && thr[p] <= yr) p++;
            pr = (uint32_t)p;
        }
        if (pl != pr || !mn__opt_qa_check(rl, rr, q->hi[sl], neg, q->mirror, pl)) return 0;
    }
    return 1;
}

MN__PRIVATE void mn__opt_qarith_init(mn__opt_qarith *q, const float *map, const float *thr) {
    float brk[255 + 32 + 16], st[16], nst[16];
    int32_t ks, k0 = 0, nseg = 0, e, nb, i;
    memset(q, 0, sizeof *q);
    while (k0 < 255 && thr[k0] <= 0.0f) k0++;  // thr[k0] = T_(k0+1): the first above 0
    k0++;                                     // as an index k of T_k
    q->mirror = k0 > 1;
    if (k0 > 255 || (q->mirror && (k0 != 128 || map[127] != 0.0f))) return;
    // segment 0: [0, T_k0), the index k0 - 1
    q->a[0] = 0.0f, q->c[0] = (float)k0 - 0.5f, q->hi[0] = k0 - 1, nseg = 1;
    for (ks = k0; ks <= 255; nseg++) {  // a segment from T_ks
        int32_t ke = ks;
        double a = 0.0, c;
        if (nseg == 16) return;
        if (ks + 1 <= 255) {  // the line through T_(ks+1) and T_(ks+2), as far as it holds
            double t1 = (double)thr[ks], d = ks + 2 <= 255 ? (double)thr[ks + 1] - t1 : 0.0;
            ke = ks + 1;
            while (d > 0.0 && ke + 1 <= 255 &&
                   fabs((double)thr[ke] - t1 - d * (double)(ke + 1 - (ks + 1))) < 1e-3 * d)
                ke++;
            if (ke > ks + 1) a = (double)(ke - (ks + 1)) / ((double)thr[ke - 1] - t1);
            else a = 1.0 / (t1 - (double)thr[ks - 1]);
            c = (double)(ks + 1) - a * t1;
        } else {
            c = 255.5;  // the last index from T_255 on
        }
        q->a[nseg] = (float)a, q->c[nseg] = (float)c, q->hi[nseg] = ke;
        ks = ke + 1;
    }
    for (ks = k0, i = 1; i < nseg; i++) {  // segment i starts at T_ks, mirrored at T_(255-ks)
        st[i] = thr[ks - 1];
        nst[i] = q->mirror && ks < 255 ? nextafterf(-thr[254 - ks], INFINITY) : st[i];
        ks = q->hi[i] + 1;
    }
    for (e = 0; e < 32; e++) {  // buckets: the segment of the first float, the start inside
        float lo = e == 0 ? 0.0f : mn__opt_float((uint32_t)(e + MN__OPT_QA_E0) << 23);
        float hi = e == 31 ? INFINITY : mn__opt_float((uint32_t)(e + MN__OPT_QA_E0 + 1) << 23);
        int32_t s = 0, n = 0, ns = 0, nn = 0;
        q->split[e] = q->nsplit[e] = NAN;
        for (i = 1; i < nseg; i++) {
            if (st[i] <= lo) s = i;
            else if (st[i] < hi) q->split[e] = st[i], n++;
            if (nst[i] <= lo) ns = i;
            else if (nst[i] < hi) q->nsplit[e] = nst[i], nn++;
        }
        if (n > 1 || nn > 1 || s != ns) return;
        if (e == 31 && (n > 0 || q->a[s] != 0.0f)) return;  // (|x| = inf: a NaN r)
        q->seg[e] = s;
    }
    // the breaks: 0 and the bucket starts; for x >= 0 the thresholds above 0 (the segment starts
    // among them), for x < 0 the first |x| past each threshold below 0 and the mirrored starts
    for (i = 0; i < 2; i++) {
        int32_t k;
        nb = 0;
        for (e = 0; e < 32; e++) brk[nb++] = mn__opt_float((uint32_t)(e + MN__OPT_QA_E0) << 23);
        brk[0] = 0.0f;
        for (k = k0; k <= 255 && i == 0; k++) brk[nb++] = thr[k - 1];
        for (k = 1; k < k0 && i == 1; k++) brk[nb++] = nextafterf(-thr[k - 1], INFINITY);
        for (e = 1; e < nseg && i == 1; e++) brk[nb++] = nst[e];
        if (!mn__opt_qa_verify(q, thr, brk, nb, nseg, i)) return;
    }
    q->ok = 1;
}
#endif

// Tensors from this many elements also get the arithmetic form (its build, some 7 us a map,
// costs about what it saves on 5 * 10^4 elements).
#define MN__OPT_QARITH_MIN 65536u

// Builds the table of a map from its thresholds (mn__opt_thresholds), with the arithmetic form
// for n values from MN__OPT_QARITH_MIN; ok only for a strictly ascending map of finite floats
// whose buckets hold at most one threshold each, none in an edge bucket.
MN__PRIVATE void mn__opt_qtab_init(mn__opt_qtab *t, const float *map, const float *thr,
                                   uint64_t n) {
    uint32_t k, p = 0;
    t->ok = thr != NULL;
    for (t->zero = 0; t->zero < 256 && map[t->zero] < 0.0f; t->zero++) {}
    for (k = 0; k < 2 * MN__OPT_QJ && t->ok; k++) {
        // the buckets before that of thr[p] hold none (the word below with lob = MN__OPT_QNONE)
        uint32_t kb = p < 255 ? mn__opt_qbucket(thr[p]) : 2 * MN__OPT_QJ, j, lob, a0, a1;
        int neg;
        float first, last;
        for (; k < kb; k++) t->ent[k] = (p << 17) + 0x20000u - MN__OPT_QNONE;
        if (k == 2 * MN__OPT_QJ) break;
        neg = k < MN__OPT_QJ;
        j = neg ? MN__OPT_QJ - 1u - k : k - MN__OPT_QJ, lob = MN__OPT_QNONE;
        a0 = j == 0 ? 0u : (j + (MN__OPT_QE0 << MN__OPT_QM)) << (23u - MN__OPT_QM);
        a1 = j == MN__OPT_QJ - 1u
                 ? 0x7f800000u
                 : ((j + 1u + (MN__OPT_QE0 << MN__OPT_QM)) << (23u - MN__OPT_QM)) - 1u;
        first = neg ? -mn__opt_float(a1) : mn__opt_float(a0);
        last = neg ? -mn__opt_float(a0) : mn__opt_float(a1);
        while (p < 255 && thr[p] <= first) p++;
        if (p < 255 && thr[p] <= last) {
            if (j == 0 || j == MN__OPT_QJ - 1u) t->ok = 0;  // keys differ above the low 16 bits
            lob = mn__opt_okey(thr[p]) & 0xffffu;
        }
        t->ent[k] = (p << 17) + 0x20000u - lob;
        if (p + 1 < 255 && thr[p + 1] <= last) t->ok = 0;
    }
    t->ar.ok = 0;
#if defined(MN__OPT_QARITH)
    if (t->ok && n >= MN__OPT_QARITH_MIN) mn__opt_qarith_init(&t->ar, map, thr);
#endif
    (void)n;
}

// (mn_hd_q8_nearest_tab reads these tables: the same buckets)
typedef char mn__opt_qtab_size[sizeof(((mn__opt_qtab *)0)->ent) == MN_Q8_TAB * 4 &&
                                       MN__OPT_QM == 7u && MN__OPT_QE0 == 103u ? 1 : -1];
MNIMPL mn_result mn_q8_table(const float *map, uint32_t *tab) {
    mn__opt_qtab *t;
    float thr[255];
    int ok;
    if (!map || !tab) return MN_ERR_INVALID_ARG;
    if (!mn__opt_thresholds(map, thr)) return MN_ERR_UNSUPPORTED;
    t = (mn__opt_qtab *)MN_MALLOC(sizeof *t);
    if (!t) return MN_ERR_OUT_OF_MEMORY;
    mn__opt_qtab_init(t, map, thr, 0);
    ok = t->ok;
    if (ok) memcpy(tab, t->ent, sizeof t->ent);
    MN_FREE(t);
    return ok ? MN_OK : MN_ERR_UNSUPPORTED;
}

static inline uint8_t mn__opt_nearest_tab(const mn__opt_qtab *t, float x) {
    return (uint8_t)mn_hd_q8_nearest_tab(t->ent, x);
}

#if MN__OV && MN__OW == 16 && defined(__AVX512F__)
// map[code] for 16 codes (0..255) of a 256-entry map: eight two-register permutes, then the
// code's top three bits pick among them (exact: a lookup, as the gather's).
static inline __m512 mn__opt_lut256(const float *map, __m512i ix) {
    const __m512i b5 = _mm512_set1_epi32(32), b6 = _mm512_set1_epi32(64);
    __m512 a[8];
    __mmask16 m5 = _mm512_test_epi32_mask(ix, b5), m6 = _mm512_test_epi32_mask(ix, b6);
    __mmask16 m7 = _mm512_test_epi32_mask(ix, _mm512_set1_epi32(128));
    int k;
    for (k = 0; k < 8; k++)
        a[k] = _mm512_permutex2var_ps(_mm512_loadu_ps(map + 32 * k), ix,
                                      _mm512_loadu_ps(map + 32 * k + 16));
    for (k = 0; k < 4; k++) a[k] = _mm512_mask_blend_ps(m5, a[2 * k], a[2 * k + 1]);
    a[0] = _mm512_mask_blend_ps(m6, a[0], a[1]), a[2] = _mm512_mask_blend_ps(m6, a[2], a[3]);
    return _mm512_mask_blend_ps(m7, a[0], a[2]);
}
#define MN__OPT_PERM 1
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
// The same lookup for 64 codes at once through byte permutes: plane k (planes + 256 k) holds
// byte k of every entry's bits, two 128-byte permutes and a blend on the code's top bit look
// one plane up, and two rounds of unpacks put each code's four bytes back together. The
// unpacks interleave within 128-bit lanes, so the codes are first permuted (mn__opt_deq_order)
// so that out[q] holds the entries of codes 16q .. 16q + 15. 22 instructions for 64 lookups
// against about 18 for 16 through mn__opt_lut256.
#define MN__OPT_VBMI 1
MN__PRIVATE void mn__opt_planes(const float *map, uint8_t planes[4 * 256]) {
    int i, k;
    for (i = 0; i < 256; i++)
        for (k = 0; k < 4; k++) planes[256 * k + i] = (uint8_t)(mn_hd_bits(map[i]) >> (8 * k));
}
// Byte 16 L + 4 q + i of the permuted codes is code 16 q + 4 L + i: out[q] takes bytes
// 16 L + 4 q .. 16 L + 4 q + 3 of each lane L.
static const uint8_t mn__opt_deq_order[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
static inline void mn__opt_deq64(const uint8_t *planes, const uint8_t *codes, __m512 out[4]) {
    __m512i x = _mm512_permutexvar_epi8(_mm512_loadu_si512((const void *)mn__opt_deq_order),
                                        _mm512_loadu_si512((const void *)codes));
    __mmask64 top = _mm512_movepi8_mask(x);
    __m512i b[4], w[4];
    int k;
    for (k = 0; k < 4; k++) {
        const uint8_t *pk = planes + 256 * k;
        __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)pk), x,
                                              _mm512_loadu_si512((const void *)(pk + 64)));
        __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)(pk + 128)), x,
                                              _mm512_loadu_si512((const void *)(pk + 192)));
        b[k] = _mm512_mask_blend_epi8(top, lo, hi);
    }
    w[0] = _mm512_unpacklo_epi8(b[0], b[1]), w[1] = _mm512_unpackhi_epi8(b[0], b[1]);
    w[2] = _mm512_unpacklo_epi8(b[2], b[3]), w[3] = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w[0], w[2]));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w[0], w[2]));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w[1], w[3]));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w[1], w[3]));
}
#endif
#endif

// Tensors from this many elements quantize through the tables (their build costs about as much as
// the search for some 10^4 elements); the search below it. Both give the same codes.
#define MN__OPT_QTAB_MIN 16384u

#if defined(MN__OPT_QARITH)
// The tables of a mn__opt_qarith in registers, loaded once per loop (mn__opt_qa_load).
typedef struct mn__opt_qa_v {
    __m512 split0, split1, nsplit0, nsplit1, a, c;
    __m512i seg0, seg1, hi;
} mn__opt_qa_v;
MN__OPT_INLINE void mn__opt_qa_load(const mn__opt_qarith *q, mn__opt_qa_v *v) {
    v->split0 = _mm512_loadu_ps(q->split), v->split1 = _mm512_loadu_ps(q->split + 16);
    v->nsplit0 = _mm512_loadu_ps(q->nsplit), v->nsplit1 = _mm512_loadu_ps(q->nsplit + 16);
    v->a = _mm512_loadu_ps(q->a), v->c = _mm512_loadu_ps(q->c);
    v->seg0 = _mm512_loadu_si512((const void *)q->seg);
    v->seg1 = _mm512_loadu_si512((const void *)(q->seg + 16));
    v->hi = _mm512_loadu_si512((const void *)q->hi);
}

// codes[l] for the 16 values x of mn__opt_codes_v through the tables q of a mn__opt_qarith with
// that mirror flag, or 0 where a lane lies in a window (codes then untouched).
MN__OPT_INLINE int mn__opt_codes_a(const mn__opt_qa_v *q, int mirror, mn__ovf x, float scale,
                                   int keep_sign, int32_t zero, uint8_t *codes) {
    __m512 xv = (__m512)(x * scale), ax = _mm512_abs_ps(xv), r, sp;
    __mmask16 neg = _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_LT_OQ), far;
    __m512i e = _mm512_srli_epi32(_mm512_castps_si512(ax), 23), g, c;
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(MN__OPT_QA_E0)),
                         _mm512_set1_epi32(MN__OPT_QA_E0 + 31));  // (the low 5 bits index)
    g = _mm512_permutex2var_epi32(q->seg0, e, q->seg1);
    sp = _mm512_permutex2var_ps(q->split0, e, q->split1);
    if (mirror)  // (without: x < 0 takes 0 whatever its segment)
        sp = _mm512_mask_blend_ps(neg, sp, _mm512_permutex2var_ps(q->nsplit0, e, q->nsplit1));
    far = _mm512_cmp_ps_mask(ax, sp, _CMP_GE_OQ);
    g = _mm512_mask_add_epi32(g, far, g, _mm512_set1_epi32(1));
    r = _mm512_fmadd_ps(_mm512_permutexvar_ps(g, q->a), ax, _mm512_permutexvar_ps(g, q->c));
    // r - round(r) (vreduceps, nearest even): NaN compares false, so it takes the table
    far = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_reduce_ps(r, 0)),
                             _mm512_set1_ps(MN__OPT_QA_WIN), _CMP_GT_OQ);
    if (far != (__mmask16)0xFFFF) return 0;
    c = _mm512_min_epi32(_mm512_cvttps_epi32(r), _mm512_permutexvar_epi32(g, q->hi));
    if (mirror)  // 254 - c, at least 0
        c = _mm512_max_epi32(_mm512_mask_sub_epi32(c, neg, _mm512_set1_epi32(254), c),
                             _mm512_setzero_si512());
    else
        c = _mm512_mask_mov_epi32(c, neg, _mm512_setzero_si512());
    if (keep_sign) {
        neg = _mm512_cmp_ps_mask((__m512)x, _mm512_setzero_ps(), _CMP_LT_OQ);
        neg = _mm512_mask_cmpge_epi32_mask(neg, c, _mm512_set1_epi32(zero));
        c = _mm512_mask_sub_epi32(c, neg, c, _mm512_set1_epi32(1));
    }
    _mm_storeu_si128((__m128i *)(void *)codes, _mm512_cvtepi32_epi8(c));
    return 1;
}
#endif

#if defined(MN__OGATHER)
// codes[l] for the MN__OW values x of mn__opt_codes (unscaled) through the table t.
static inline void mn__opt_codes_v(const mn__opt_qtab *t, mn__ovf x, float scale, int keep_sign,
                                   int32_t zero, uint8_t *codes) {
    const mn__ovi e0 = {0}, jmax = e0 + (int32_t)(MN__OPT_QJ - 1u);
    const uint32_t *ent = t->ent;
    mn__ovf xv = x * scale;
    mn__ovi u = (mn__ovi)xv, s = u >> 31, j, k, e, c;
    int l;
    j = ((u & 0x7fffffff) >> (23 - MN__OPT_QM)) - (int32_t)(MN__OPT_QE0 << MN__OPT_QM);
    j = MN__OMINI(MN__OMAXI(j, e0), jmax);
    k = (j ^ s) + (int32_t)MN__OPT_QJ;  // j ^ -1 = -1 - j: the negative half runs backwards
    e = (mn__ovi)MN__OGATHER((const float *)ent, k);
    c = (e + ((u ^ s) & 0xffff)) >> 17;  // below 2^25: no sign
    c = c & (xv == xv);
    if (keep_sign) c = c + ((x < 0.0f) & (c >= zero));
    for (l = 0; l < MN__OW; l++) codes[l] = (uint8_t)c[l];
}
#endif

// codes[i] = mn__opt_nearest(map, x[i] * scale) for i < n, through the table t when there is one
// (NULL: the search); with keep_sign, one entry lower where x[i] < 0 and the entry is not below 0.
MN__PRIVATE void mn__opt_codes(const mn__opt_qtab *t, const float *map, const float *x,
                               float scale, uint64_t n, uint8_t *codes, int keep_sign) {
    uint64_t i;
    int32_t zero;
    uint8_t q;
    if (!t) {
        for (i = 0; i < n; i++) {
            q = mn__opt_nearest(map, x[i] * scale);
            codes[i] = (uint8_t)(q - (uint8_t)(keep_sign & (x[i] < 0.0f) & (map[q] >= 0.0f)));
        }
        return;
    }
    zero = t->zero;  // a local: the stores to codes could otherwise alias it
    i = 0;
#if defined(MN__OPT_QARITH)
    if (t->ar.ok) {  // the arithmetic form, the table next to a threshold
        mn__opt_qa_v r;
        int mirror = t->ar.mirror;
        mn__opt_qa_load(&t->ar, &r);
        for (; i + MN__OW <= n; i += MN__OW) {
            mn__ovf xi = mn__ov_load(x + i);
            if (!mn__opt_codes_a(&r, mirror, xi, scale, keep_sign, zero, codes + i))
                mn__opt_codes_v(t, xi, scale, keep_sign, zero, codes + i);
        }
    }
#endif
#if defined(MN__OGATHER)
    for (; i + MN__OW <= n; i += MN__OW)  // mn__opt_nearest_tab, MN__OW lanes at a time
        mn__opt_codes_v(t, mn__ov_load(x + i), scale, keep_sign, zero, codes + i);
#endif
    for (; i < n; i++) {
        q = mn__opt_nearest_tab(t, x[i] * scale);
        codes[i] = (uint8_t)(q - (uint8_t)(keep_sign & (x[i] < 0.0f) & (q >= zero)));
    }
}

MNIMPL mn_result mn_quantize_blockwise(const float *map, const float *x, uint64_t n,
                                       uint32_t block_size, uint8_t *codes, float *absmax) {
    uint64_t b, i, i0, end;
    mn__opt_qtab t;
    float thr[255];
    if (!map || !x || !codes || !absmax || block_size == 0 || !mn__floats_fit(n))
        return MN_ERR_INVALID_ARG;
    t.ok = 0;
    if (n >= MN__OPT_QTAB_MIN)  // any map: ok only where it applies
        mn__opt_qtab_init(&t, map, mn__opt_thresholds(map, thr) ? thr : NULL, n);
    for (b = 0, i0 = 0; i0 < n; b++, i0 += block_size) {
        float am = 0.0f, inv;
        end = n - i0 < block_size ? n : i0 + block_size;
        for (i = i0; i < end; i++) {
            float a = fabsf(x[i]);
            if (a > am) am = a;
        }
        absmax[b] = am;
        inv = am > 0.0f ? 1.0f / am : 0.0f;
        mn__opt_codes(t.ok ? &t : NULL, map, x + i0, inv, end - i0, codes + i0, 0);
    }
    return MN_OK;
}

MNIMPL mn_result mn_dequantize_blockwise(const float *map, const uint8_t *codes,
                                         const float *absmax, uint64_t n, uint32_t block_size,
                                         float *x) {
    uint64_t i;
    if (!map || !codes || !absmax || !x || block_size == 0 || !mn__floats_fit(n))
        return MN_ERR_INVALID_ARG;
    for (i = 0; i < n; i++) x[i] = map[codes[i]] * absmax[i / block_size];
    return MN_OK;
}

MNIMPL mn_result mn_adamw8bit_init(mn_adamw8bit *s, const uint64_t *dims, uint32_t ndim,
                                   const mn_adamw8bit_params *p, const mn_allocator *alloc) {
    mn_adamw8bit_params q;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-3f);
    q.beta1 = mn__opt_z(q.beta1, 0.9f);
    q.beta2 = mn__opt_z(q.beta2, 0.999f);
    q.eps = mn__opt_z(q.eps, 1e-8f);
    q.weight_decay = mn__opt_z(q.weight_decay, 1e-2f);
    if (q.block_size == 0) q.block_size = 256;
    if (q.min_8bit_size == 0) q.min_8bit_size = 4096;
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta2, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (q.block_size > MN__OPT_MAX_BLOCK) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    r = mn_adamw8bit_state_bytes(dims, ndim, q.block_size, q.min_8bit_size, &bytes);
    if (r != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->state_bytes = bytes;
    s->quantized = n >= q.min_8bit_size;
    if (s->quantized) {  // [absmax1 | absmax2 | code1 | code2]: the floats first keep them aligned
        s->blocks = n / q.block_size + (n % q.block_size != 0);
        s->absmax1 = (float *)mem;
        s->absmax2 = s->absmax1 + s->blocks;
        s->code1 = (uint8_t *)(s->absmax2 + s->blocks);
        s->code2 = s->code1 + n;
    } else {
        s->exp_avg = (float *)mem;
        s->exp_avg_sq = s->exp_avg + n;
    }
    return MN_OK;
}

// One block of the quantized step: k0 is its first element, len its length (at most
// MN__OPT_MAX_BLOCK). Two passes: the moments and their new block scales; the parameter update
// (vector lanes: per element the same operations as the plain loop, so the same bits) and the
// codes. The block scales are maxima, which do not depend on the order in which they are taken.
typedef struct mn__opt_a8 {
    const mn__opt_qtab *q1, *q2;
    const float *map1, *map2;  // [256] each
    const uint8_t *planes1, *planes2;  // [4 * 256] each, mn__opt_planes of the maps (or NULL)
    float b1, b2, step_size, eps_c, decay;
    int decay_on;
    int arith;  // both tables have the arithmetic form, m's mirrored and v's not (dynamic maps)
} mn__opt_a8;

#ifdef MN__OGATHER
// The moments of mn__opt_a8_block for MN__OW lanes from the dequantized entries e1, e2 (map[code]
// unscaled) and the gradient g: stored to m and v, their block maxima so far to mx1 and mx2.
// k: the block's scales a1, a2, then b1, b2, w1 = 1 - b1, w2 = 1 - b2.
MN__OPT_INLINE void mn__opt_a8_moments(const float *k, mn__ovf e1, mn__ovf e2, const float *g,
                                       float *m, float *v, mn__ovf *mx1, mn__ovf *mx2) {
    float a1 = k[0], a2 = k[1], b1 = k[2], b2 = k[3], w1 = k[4], w2 = k[5];
    mn__ovf gj = mn__ov_load(g), mj, vj;
    mn__ovi fin = ((mn__ovi)gj & 0x7f800000) != 0x7f800000;
    mj = e1 * a1 * b1 + w1 * gj;
    vj = e2 * a2 * b2 + w2 * gj * gj;
    mj = (mn__ovf)((mn__ovi)mj & fin), vj = (mn__ovf)((mn__ovi)vj & fin);
    mn__ov_store(m, mj);
    mn__ov_store(v, vj);
    *mx1 = MN__OMAXF(mn__ov_abs(mj), *mx1), *mx2 = MN__OMAXF(vj, *mx2);
}
#endif

#if MN__OV
// The parameter update of mn__opt_a8_block for MN__OW lanes: t unchanged where g is not finite.
MN__OPT_INLINE mn__ovf mn__opt_a8_param(float ss, float eps, float decay, int decay_on, mn__ovf t,
                                        mn__ovf m, mn__ovf v, mn__ovf g) {
    mn__ovf u = t + ss * (m / (MN__OSQRT(v) + eps));
    mn__ovi fin = ((mn__ovi)g & 0x7f800000) != 0x7f800000;
    if (decay_on) u = u * decay;
    return mn__ov_sel(fin, u, t);
}
#endif

MN__PRIVATE void mn__opt_a8_block(const mn__opt_a8 *c, mn_adamw8bit *s, float *param,
                                  const float *grad, uint64_t b, uint64_t k0, uint64_t len) {
    float mbuf[MN__OPT_MAX_BLOCK], vbuf[MN__OPT_MAX_BLOCK];
    const float *map1 = c->map1, *map2 = c->map2;
    const uint8_t *code1 = s->code1 + k0, *code2 = s->code2 + k0;
    uint8_t *cd1 = s->code1 + k0, *cd2 = s->code2 + k0;
    const float *g = grad + k0;
    float *th = param + k0;
    float a1 = s->absmax1[b], a2 = s->absmax2[b], n1 = 0.0f, n2 = 0.0f, inv1, inv2;
    float w1 = 1.0f - c->b1, w2 = 1.0f - c->b2, ss = c->step_size, eps = c->eps_c;
    uint64_t j, jc;
    j = 0;
#ifdef MN__OGATHER
    mn__ovf mx1 = {0}, mx2 = {0};  // the block maxima so far, lane by lane (as the scalar loop's)
    const float k[6] = {a1, a2, c->b1, c->b2, w1, w2};
#ifdef MN__OPT_VBMI
    if (c->planes1 && c->planes2)
        for (; j + 64 <= len; j += 64) {  // the loop below, 64 lookups at a time
            __m512 e1[4], e2[4];
            int q;
            mn__opt_deq64(c->planes1, code1 + j, e1);
            mn__opt_deq64(c->planes2, code2 + j, e2);
            for (q = 0; q < 4; q++) {
                uint64_t jq = j + 16u * (uint64_t)q;
                mn__opt_a8_moments(k, (mn__ovf)e1[q], (mn__ovf)e2[q], g + jq, mbuf + jq,
                                   vbuf + jq, &mx1, &mx2);
            }
        }
#endif
    for (; j + MN__OW <= len; j += MN__OW) {  // the loop below, MN__OW lanes at a time
        mn__ovi i1 = {0}, i2 = {0};
        int l;
        for (l = 0; l < MN__OW; l++) i1[l] = code1[j + (uint64_t)l];
        for (l = 0; l < MN__OW; l++) i2[l] = code2[j + (uint64_t)l];
#ifdef MN__OPT_PERM
        mn__opt_a8_moments(k, (mn__ovf)mn__opt_lut256(map1, (__m512i)i1),
                           (mn__ovf)mn__opt_lut256(map2, (__m512i)i2), g + j, mbuf + j, vbuf + j,
                           &mx1, &mx2);
#else
        mn__opt_a8_moments(k, MN__OGATHER(map1, i1), MN__OGATHER(map2, i2), g + j, mbuf + j,
                           vbuf + j, &mx1, &mx2);
#endif
    }
    {
        int l;
        for (l = 0; l < MN__OW; l++) {
            if (mx1[l] > n1) n1 = mx1[l];
            if (mx2[l] > n2) n2 = mx2[l];
        }
    }
#endif
    for (; j < len; j++) {  // dequantize and update the moments; 0 where g is inf/NaN
        float gj = g[j], am;
        int fin = mn__opt_finite(gj);
        float m = map1[code1[j]] * a1 * c->b1 + w1 * gj;
        float v = map2[code2[j]] * a2 * c->b2 + w2 * gj * gj;
        mbuf[j] = fin ? m : 0.0f, vbuf[j] = fin ? v : 0.0f;
        am = fabsf(mbuf[j]);  // the block maxima; a NaN never counts
        if (am > n1) n1 = am;
        if (vbuf[j] > n2) n2 = vbuf[j];
    }
    s->absmax1[b] = n1, s->absmax2[b] = n2;
    inv1 = n1 > 0.0f ? 1.0f / n1 : 0.0f;
    inv2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
    j = 0;
#if defined(MN__OGATHER)
    if (c->q1 && c->q2) {  // the loop below and the codes' of both maps at once: one pass
        int32_t z1 = c->q1->zero;
        float decay = c->decay;
        int decay_on = c->decay_on;
#if defined(MN__OPT_QARITH)
        if (c->arith) {
            mn__opt_qa_v r1, r2;  // (the arithmetic form, the table next to a threshold)
            mn__opt_qa_load(&c->q1->ar, &r1), mn__opt_qa_load(&c->q2->ar, &r2);
            for (; j + MN__OW <= len; j += MN__OW) {
                mn__ovf m = mn__ov_load(mbuf + j), v = mn__ov_load(vbuf + j);
                mn__ov_store(th + j, mn__opt_a8_param(ss, eps, decay, decay_on,
                                                      mn__ov_load(th + j), m, v,
                                                      mn__ov_load(g + j)));
                if (!mn__opt_codes_a(&r1, 1, m, inv1, 1, z1, cd1 + j))  // m < 0 keeps its sign
                    mn__opt_codes_v(c->q1, m, inv1, 1, z1, cd1 + j);
                if (!mn__opt_codes_a(&r2, 0, v, inv2, 0, 0, cd2 + j))
                    mn__opt_codes_v(c->q2, v, inv2, 0, 0, cd2 + j);
            }
        }
#endif
        for (; j + MN__OW <= len; j += MN__OW) {
            mn__ovf m = mn__ov_load(mbuf + j), v = mn__ov_load(vbuf + j);
            mn__ov_store(th + j, mn__opt_a8_param(ss, eps, decay, decay_on, mn__ov_load(th + j),
                                                  m, v, mn__ov_load(g + j)));
            mn__opt_codes_v(c->q1, m, inv1, 1, z1, cd1 + j);  // m < 0 keeps its sign
            mn__opt_codes_v(c->q2, v, inv2, 0, 0, cd2 + j);
        }
    }
#endif
    jc = j;  // the codes are written below jc
#if MN__OV
    for (; j + MN__OW <= len; j += MN__OW)  // the loop below, MN__OW lanes at a time
        mn__ov_store(th + j, mn__opt_a8_param(ss, eps, c->decay, c->decay_on, mn__ov_load(th + j),
                                              mn__ov_load(mbuf + j), mn__ov_load(vbuf + j),
                                              mn__ov_load(g + j)));
#endif
    for (; j < len; j++) {  // parameter update from the fp32 m and v
        if (mn__opt_finite(g[j])) {
            float t = th[j] + ss * (mbuf[j] / (sqrtf(vbuf[j]) + eps));
            th[j] = c->decay_on ? t * c->decay : t;
        }
    }
    mn__opt_codes(c->q1, map1, mbuf + jc, inv1, len - jc, cd1 + jc, 1);  // m < 0 keeps its sign
    mn__opt_codes(c->q2, map2, vbuf + jc, inv2, len - jc, cd2 + jc, 0);
}

#if defined(MN__OPT_VBMI) && defined(MN__OPT_QARITH) && defined(__AVX512VL__)
#define MN__OPT_A8V 1
// mn__opt_codes_a on the moments of one block, the index before its sign rule: x = m or v, scale
// = 1 / (the block's maximum of |x|), so that |x * scale| is below 2 or is inf or NaN and the
// exponent needs no upper clamp (255, 127 and the clamp's 127 share the low 5 bits that index
// the tables). sgn: m, mirrored (neg: m < 0; see mn__opt_a8_whole); else v, never below 0 (a
// NaN falls in a window). *dist: r less its nearest integer, whose size the caller tests against
// MN__OPT_QA_WIN (outside the windows where larger; NaN where r is).
MN__OPT_INLINE __m512i mn__opt_a8_qa(const mn__opt_qa_v *q, int sgn, __m512 x, __m512 scale,
                                     __mmask16 neg, __m512 *dist) {
    __m512 xv = _mm512_mul_ps(x, scale), ax = sgn ? _mm512_abs_ps(xv) : xv, r, sp;
    __m512i e = _mm512_max_epi32(_mm512_srli_epi32(_mm512_castps_si512(ax), 23),
                                 _mm512_set1_epi32(MN__OPT_QA_E0));
    __m512i g = _mm512_permutex2var_epi32(q->seg0, e, q->seg1);
    sp = _mm512_permutex2var_ps(q->split0, e, q->split1);
    if (sgn) sp = _mm512_mask_blend_ps(neg, sp, _mm512_permutex2var_ps(q->nsplit0, e, q->nsplit1));
    g = _mm512_mask_add_epi32(g, _mm512_cmp_ps_mask(ax, sp, _CMP_GE_OQ), g, _mm512_set1_epi32(1));
    r = _mm512_fmadd_ps(_mm512_permutexvar_ps(g, q->a), ax, _mm512_permutexvar_ps(g, q->c));
    *dist = _mm512_reduce_ps(r, 0);
    return _mm512_min_epi32(_mm512_cvttps_epi32(r), _mm512_permutexvar_epi32(g, q->hi));
}

// mn__opt_a8_block on a block of len elements, a multiple of 64, where both maps have the
// arithmetic form (m's mirrored, v's not: the dynamic maps) and the byte planes: the same
// operations on every element, so the same bits. r1, r2: the tables of c->q1, c->q2; decay_on:
// c->decay_on (a constant at each call, so that the loop has no test). Differences that keep the
// bits: the finite test is a class test; the maxima are reduced by a tree (no NaN enters them, so
// the order does not matter); the window test of both maps is one compare of the smaller
// distance where both are ordered and one branch (5 vector instructions for both maps where
// there were 6 and a mask instruction). m's sign rule: on a lane outside the windows, the index c of |x| is at
// least 127 (the mirrored map's 0: the checks of mn__opt_qarith_init hold there), so that for
// m < 0 the mirrored code max(254 - c, 0), one lower where it is 127 or more (zero = 127), is
// min(254 -sat c, 126) in bytes. neg is m < 0 for the mirror as well, not m * scale < 0: the two
// differ only where m * scale is -0, whose index 127 the mirror keeps.
MN__OPT_INLINE void mn__opt_a8_whole(const mn__opt_a8 *c, const mn__opt_qa_v *r1,
                                     const mn__opt_qa_v *r2, mn_adamw8bit *s, float *param,
                                     const float *grad, uint64_t b, uint64_t k0, uint64_t len,
                                     int decay_on, float *mbuf, float *vbuf) {
    const uint8_t *code1 = s->code1 + k0, *code2 = s->code2 + k0;
    uint8_t *cd1 = s->code1 + k0, *cd2 = s->code2 + k0;
    const float *g = grad + k0;
    float *th = param + k0;
    const float a1 = s->absmax1[b], a2 = s->absmax2[b], b1 = c->b1, b2 = c->b2;
    const float w1 = 1.0f - c->b1, w2 = 1.0f - c->b2, ss = c->step_size, eps = c->eps_c;
    const float decay = c->decay;
    const __m128i c254 = _mm_set1_epi8((char)254), c126 = _mm_set1_epi8(126);
    __m512 mx1 = _mm512_setzero_ps(), mx2 = _mm512_setzero_ps(), sc1, sc2;
    int32_t z1 = c->q1->zero;
    float n1, n2, inv1, inv2;
    uint64_t j;
    for (j = 0; j < len; j += 64) {  // the moments and their maxima (mn__opt_a8_moments)
        const uint8_t *p1 = c->planes1, *p2 = c->planes2;
        __m512 e1[4], e2[4];
        int q;
        // (the planes stay in memory: loaded once a block they would be copied to the stack)
        __asm__("" : "+r"(p1), "+r"(p2));
        mn__opt_deq64(p1, code1 + j, e1);
        mn__opt_deq64(p2, code2 + j, e2);
        for (q = 0; q < 4; q++) {
            uint64_t jq = j + 16u * (uint64_t)q;
            mn__ovf gj = mn__ov_load(g + jq), e1q = (mn__ovf)e1[q], e2q = (mn__ovf)e2[q];
            __mmask16 fin = (__mmask16)~_mm512_fpclass_ps_mask((__m512)gj, 0x99);  // finite
            // (the expressions of mn__opt_a8_moments: a compiler that contracts them into fused
            // multiply-adds contracts both alike)
            __m512 mj = _mm512_maskz_mov_ps(fin, (__m512)(e1q * a1 * b1 + w1 * gj));
            __m512 vj = _mm512_maskz_mov_ps(fin, (__m512)(e2q * a2 * b2 + w2 * gj * gj));
            _mm512_storeu_ps(mbuf + jq, mj), _mm512_storeu_ps(vbuf + jq, vj);
            mx1 = _mm512_max_ps(_mm512_abs_ps(mj), mx1), mx2 = _mm512_max_ps(vj, mx2);
        }
    }
    // both maxima at once: lane 0 of mx1's, lane 8 of mx2's; their inverses (0 for 0) alike
    mx1 = _mm512_max_ps(_mm512_shuffle_f32x4(mx1, mx2, 0x44), _mm512_shuffle_f32x4(mx1, mx2, 0xEE));
    mx1 = _mm512_max_ps(mx1, _mm512_shuffle_f32x4(mx1, mx1, 0xB1));
    mx1 = _mm512_max_ps(mx1, _mm512_permute_ps(mx1, 0x4E));
    mx1 = _mm512_max_ps(mx1, _mm512_permute_ps(mx1, 0xB1));
    mx2 = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(mx1, _mm512_setzero_ps(), _CMP_GT_OQ),
                              _mm512_set1_ps(1.0f), mx1);
    n1 = _mm512_cvtss_f32(mx1), n2 = _mm_cvtss_f32(_mm512_extractf32x4_ps(mx1, 2));
    s->absmax1[b] = n1, s->absmax2[b] = n2;
    sc1 = _mm512_permutexvar_ps(_mm512_setzero_si512(), mx2);
    sc2 = _mm512_permutexvar_ps(_mm512_set1_epi32(8), mx2);
    inv1 = _mm512_cvtss_f32(sc1), inv2 = _mm512_cvtss_f32(sc2);
    for (j = 0; j < len; j += 16) {  // the parameters (mn__opt_a8_param) and the codes
        mn__ovf mv = mn__ov_load(mbuf + j), vv = mn__ov_load(vbuf + j), tv = mn__ov_load(th + j);
        mn__ovf uv = tv + ss * (mv / (MN__OSQRT(vv) + eps));  // mn__opt_a8_param's expression
        __m512 m = (__m512)mv, v = (__m512)vv, t = (__m512)tv, u;
        __mmask16 fin = (__mmask16)~_mm512_fpclass_ps_mask(_mm512_loadu_ps(g + j), 0x99);
        __mmask16 neg = _mm512_fpclass_ps_mask(m, 0x50);  // m < 0: finite or -inf
        __m512 f1, f2;
        __m512i i1, i2;
        __m128i k1;
        if (decay_on) uv = uv * decay;
        u = (__m512)uv;
        _mm512_storeu_ps(th + j, _mm512_mask_mov_ps(t, fin, u));
        i1 = mn__opt_a8_qa(r1, 1, m, sc1, neg, &f1);
        i2 = mn__opt_a8_qa(r2, 0, v, sc2, 0, &f2);
        // a lane in a window of either map: the table (the smaller distance of each lane, sign
        // cleared, one instruction; it is the other distance where one is NaN, so a lane
        // counts as outside only where both are ordered)
        if (_mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(f1, f2, _CMP_ORD_Q),
                                    _mm512_range_ps(f1, f2, 0x0A),
                                    _mm512_set1_ps(MN__OPT_QA_WIN), _CMP_GT_OQ) != 0xFFFF) {
            if (!mn__opt_codes_a(r1, 1, (mn__ovf)m, inv1, 1, z1, cd1 + j))
                mn__opt_codes_v(c->q1, (mn__ovf)m, inv1, 1, z1, cd1 + j);
            if (!mn__opt_codes_a(r2, 0, (mn__ovf)v, inv2, 0, 0, cd2 + j))
                mn__opt_codes_v(c->q2, (mn__ovf)v, inv2, 0, 0, cd2 + j);
            continue;
        }
        k1 = _mm512_cvtepi32_epi8(i1);
        k1 = _mm_mask_subs_epu8(k1, neg, c254, k1);
        k1 = _mm_mask_min_epu8(k1, neg, k1, c126);
        _mm_storeu_si128((__m128i *)(void *)(cd1 + j), k1);
        _mm512_mask_cvtepi32_storeu_epi8(cd2 + j, (__mmask16)0xFFFF, i2);
    }
}

// Blocks b0 .. b1 - 1 of the quantized step through mn__opt_a8_whole while they qualify; returns
// the first block left (a last block whose length is not a multiple of 64).
MN__PRIVATE uint64_t mn__opt_a8_run(const mn__opt_a8 *c, mn_adamw8bit *s, float *param,
                                    const float *grad, uint64_t b0, uint64_t b1) {
    float mbuf[MN__OPT_MAX_BLOCK], vbuf[MN__OPT_MAX_BLOCK];
    mn__opt_a8 k = *c;  // (a local: the stores to the block scales cannot change it)
    mn__opt_qa_v r1, r2;
    uint64_t b, bs = s->params.block_size;
    mn__opt_qa_load(&c->q1->ar, &r1), mn__opt_qa_load(&c->q2->ar, &r2);
    for (b = b0; b < b1; b++) {
        uint64_t k0 = b * bs, len = s->n - k0 < bs ? s->n - k0 : bs;
        if (len % 64 != 0) break;
        if (k.decay_on)
            mn__opt_a8_whole(&k, &r1, &r2, s, param, grad, b, k0, len, 1, mbuf, vbuf);
        else
            mn__opt_a8_whole(&k, &r1, &r2, s, param, grad, b, k0, len, 0, mbuf, vbuf);
    }
    return b;
}
#endif

MNIMPL mn_result mn_adamw8bit_step(mn_adamw8bit *s, float *param, const float *grad,
                                   uint16_t *param16) {
    const mn_adamw8bit_params *p;
    float map1[256], map2[256];
    mn__opt_qtab q1, q2;
    mn__opt_a8 c;
#ifdef MN__OPT_VBMI
    uint8_t planes[2][4 * 256];
#endif
    double t, c1, c2, t0;
    uint64_t i, per;
    int64_t run, nb;
    int team;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    t = (double)++s->step;
    c.b1 = p->beta1, c.b2 = p->beta2;
    c1 = 1.0 - pow((double)c.b1, t);
    c2 = sqrt(1.0 - pow((double)c.b2, t));
    c.step_size = (float)(-(double)p->lr * c2 / c1);
    c.eps_c = (float)((double)p->eps * c2);
    c.decay = (float)(1.0 - (double)p->lr * (double)p->weight_decay);
    c.decay_on = p->weight_decay > 0.0f;
    if (!s->quantized) {
        for (i = 0; i < s->n; i++) {
            float g = grad[i], m, v;
            if (!mn__opt_finite(g)) continue;
            m = s->exp_avg[i] = s->exp_avg[i] * c.b1 + (1.0f - c.b1) * g;
            v = s->exp_avg_sq[i] = s->exp_avg_sq[i] * c.b2 + (1.0f - c.b2) * g * g;
            param[i] = param[i] + c.step_size * (m / (sqrtf(v) + c.eps_c));
            if (c.decay_on) param[i] = param[i] * c.decay;
        }
        mn__opt_store16(p->dtype, param, param16, s->n);
        return MN_OK;
    }
    mn_dynamic_map(1, map1);
    mn_dynamic_map(0, map2);
    q1.ok = q2.ok = 0;
    if (s->n >= MN__OPT_QTAB_MIN) {
        float thr[255];
        mn__opt_qtab_init(&q1, map1, mn__opt_thresholds(map1, thr) ? thr : NULL, s->n);
        mn__opt_qtab_init(&q2, map2, mn__opt_thresholds(map2, thr) ? thr : NULL, s->n);
    }
    c.q1 = q1.ok ? &q1 : NULL, c.q2 = q2.ok ? &q2 : NULL, c.map1 = map1, c.map2 = map2;
    c.arith = c.q1 && c.q2 && c.q1->ar.ok && c.q2->ar.ok && c.q1->ar.mirror && !c.q2->ar.mirror;
    c.planes1 = c.planes2 = NULL;
#ifdef MN__OPT_VBMI
    mn__opt_planes(map1, planes[0]), mn__opt_planes(map2, planes[1]);
    c.planes1 = planes[0], c.planes2 = planes[1];
#endif
    // The blocks are independent: threads claim runs of them (about 16384 elements, a few runs
    // per claim) as they come, so that a thread whose core is busy elsewhere takes fewer.
    per = 16384u / p->block_size + 1u;
    nb = (int64_t)((s->blocks + per - 1) / per);
    team = mn__tune_begin(&s->tune, s->n, MN__OPT_MIN_PAR / 8, &t0);
    MN__OMP_FOR_TEAM(team, s->n, nb)
    for (run = 0; run < nb; run++) {
        uint64_t b, b1 = ((uint64_t)run + 1) * per < s->blocks ? ((uint64_t)run + 1) * per
                                                                 : s->blocks;
        b = (uint64_t)run * per;
#ifdef MN__OPT_A8V
        if (c.arith) b = mn__opt_a8_run(&c, s, param, grad, b, b1);
#endif
        for (; b < b1; b++) {
            uint64_t k0 = b * p->block_size;
            mn__opt_a8_block(&c, s, param, grad, b, k0,
                             s->n - k0 < p->block_size ? s->n - k0 : p->block_size);
        }
    }
    mn__tune_end(&s->tune, team, t0);
    mn__opt_store16(p->dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_adamw8bit_free(mn_adamw8bit *s) {
    if (!s) return;
    mn__free(&s->alloc, s->quantized ? (void *)s->absmax1 : (void *)s->exp_avg);
    memset(s, 0, sizeof *s);
}

// ---- Adafactor ----------------------------------------------------------------------------------
//
// Shazeer & Stern 2018 (arXiv 1804.04235), as transformers/optimization.py Adafactor.step:
//   ρ_t = lr, or min(1e-2 (1e-6 t with warmup_init), 1/√t) with the relative step
//   α_t = max(ε2, RMS(θ)) ρ_t (scale_parameter) or ρ_t;   β̂2 = 1 − t^decay_rate;   U = g² + ε1
//   matrix [.., r, c]: R ← β̂2 R + (1−β̂2) mean_c(U);  C ← β̂2 C + (1−β̂2) mean_r(U)
//                      u = g · rsqrt(R / mean_r(R)) ⊗ rsqrt(C)
//   vector:            V ← β̂2 V + (1−β̂2) U;  u = g · rsqrt(V)
//   u ← α_t u / max(1, RMS(u)/d);  (β1: m ← β1 m + (1−β1) u, u = m);  θ ← θ − λα_t θ;  θ ← θ − u
// RMS(x) = ‖x‖₂/√numel. u is recomputed from the state in each pass instead of stored, so the
// state is exactly the moments. Two passes: the second moment with the sums of θ² and u² (one
// read of g and θ: row and column sums together), then the update. A matrix's Σu² needs no u:
// Σ_ij u² = mean(R) Σ_j (Σ_i g_ij² / R_i) / C_j, whose column sums take each row's g² / R_i as
// soon as R_i is known (a second read of the row, from the cache). The sums are double additions
// in a fixed order, the same in the scalar and the vector builds and for any thread count (the
// results do not depend on either): a row's sum of g² + ε1, and the sums behind RMS(θ) and a
// vector's RMS(u), run in 16 interleaved lanes (lane l adds the terms of the columns j ≡ l mod
// 16, row after row) combined by a fixed tree at the end (mn__opt_lanes_total), so that no single
// chain of dependent additions sets the step's pace; a column's sums add its rows in order, and
// Σ_j goes in the same 16 lanes, batch after batch. Beyond 65536 elements the terms go in pieces
// fixed by the shape (MN__OPT_AF_PIECE), each summed from zero in that order and added to the
// total in piece order, so that a team of threads can take the pieces; a tensor of one piece adds
// its terms in one sequence. The update has no sums: the team splits it freely.

MNIMPL mn_result mn_adafactor_init(mn_adafactor *s, const uint64_t *dims, uint32_t ndim,
                                   const mn_adafactor_params *p, const mn_allocator *alloc) {
    mn_adafactor_params q;
    uint64_t n, bytes;
    float *mem;
    void *raw;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    if (q.eps1 == 0.0f) q.eps1 = 1e-30f;
    if (q.eps2 == 0.0f) q.eps2 = 1e-3f;
    if (q.clip_threshold == 0.0f) q.clip_threshold = 1.0f;
    if (q.decay_rate == 0.0f) q.decay_rate = -0.8f;
    q.beta1 = mn__opt_z(q.beta1, 0.0f);
    q.weight_decay = mn__opt_z(q.weight_decay, 0.0f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps1, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps2, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.clip_threshold, FLT_MIN, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.decay_rate, -FLT_MAX, 0.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    if ((r = mn_adafactor_state_bytes(dims, ndim, q.beta1 != 0.0f, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &raw)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    mem = (float *)raw;
    s->params = q;
    s->n = n;
    s->state_bytes = bytes;
    s->factored = ndim >= 2;
    if (s->factored) {
        s->cols = dims[ndim - 1];
        s->rows = dims[ndim - 2];
        s->batch = n / (s->rows * s->cols);
        s->exp_avg_sq_row = mem;
        s->exp_avg_sq_col = mem + s->batch * s->rows;
        mem = s->exp_avg_sq_col + s->batch * s->cols;
    } else {
        s->batch = 1, s->rows = 1, s->cols = n;
        s->exp_avg_sq = mem;
        mem += n;
    }
    s->exp_avg = q.beta1 != 0.0f ? mem : NULL;
    return MN_OK;
}

// Mean of R over the rows of batch b, the normalizer of the factored second moment.
MN__PRIVATE double mn__opt_row_mean(const mn_adafactor *s, uint64_t b) {
    const float *row = s->exp_avg_sq_row + b * s->rows;
    double sum = 0.0;
    uint64_t i;
    for (i = 0; i < s->rows; i++) sum += row[i];
    return sum / (double)s->rows;
}

// The loops of the passes below are inlined into each pass (MN__OPT_INLINE: called from more
// than one place, they are otherwise left as calls, whose tests of their arguments then run per
// chunk).

// The fixed order of the sums: MN__OPT_LANES interleaved double accumulators (lane l takes the
// terms of the columns j with j % 16 == l, in row order), added up by a fixed tree.
#define MN__OPT_LANES 16
MN__PRIVATE double mn__opt_lanes_total(const double *a) {
    double t[MN__OPT_LANES];
    int w, l;
    memcpy(t, a, sizeof t);
    for (w = MN__OPT_LANES / 2; w >= 1; w /= 2)
        for (l = 0; l < w; l++) t[l] += t[l + w];
    return t[0];
}

#if MN__OV && defined(MN__OVD)
// The lanes in MN__OPT_LV vectors of one register each (MN__OPT_DW doubles), held in registers
// through the loops; floats widened MN__OPT_DW at a time.
#if defined(__AVX512F__)
#define MN__OPT_DW 8
#elif defined(__AVX__)
#define MN__OPT_DW 4
#else
#define MN__OPT_DW 2
#endif
#define MN__OPT_LV (MN__OPT_LANES / MN__OPT_DW)
typedef float mn__opt_fv __attribute__((vector_size(MN__OPT_DW * sizeof(float))));
typedef double mn__opt_dv __attribute__((vector_size(MN__OPT_DW * sizeof(double))));
// floats to doubles (exact) in one instruction: GCC 12 builds __builtin_convertvector of 8 floats
// from two 4-wide conversions and inserts
#if defined(__AVX512F__)
#define MN__OPT_CVT(f) ((mn__opt_dv)_mm512_cvtps_pd((__m256)(f)))
#elif defined(__AVX__)
#define MN__OPT_CVT(f) ((mn__opt_dv)_mm256_cvtps_pd((__m128)(f)))
#else
#define MN__OPT_CVT(f) __builtin_convertvector(f, mn__opt_dv)
#endif
#define MN__OPT_LOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define MN__OPT_STORE(p, v) memcpy((p), &(v), sizeof(v))
#endif

// a[j % 16] += x[j]² and b[j % 16] += y[j]² in double (exact products of floats), j < len, where
// x[0] and y[0] are in a lane-0 column.
MN__OPT_INLINE void mn__opt_lanes_sq2(double *a, const float *x, double *b, const float *y,
                                      uint64_t len) {
    uint64_t j = 0;
#if defined(MN__OPT_LV)
    mn__opt_dv va[MN__OPT_LV], vb[MN__OPT_LV], w;
    mn__opt_fv f;
    int l;
    MN__OPT_LOAD(va, a), MN__OPT_LOAD(vb, b);
    for (; j + MN__OPT_LANES <= len; j += MN__OPT_LANES)
        for (l = 0; l < MN__OPT_LV; l++) {
            MN__OPT_LOAD(f, x + j + (uint64_t)(l * MN__OPT_DW));
            w = MN__OPT_CVT(f), va[l] += w * w;
            MN__OPT_LOAD(f, y + j + (uint64_t)(l * MN__OPT_DW));
            w = MN__OPT_CVT(f), vb[l] += w * w;
        }
    MN__OPT_STORE(a, va), MN__OPT_STORE(b, vb);
#endif
    for (; j < len; j++)
        a[j % MN__OPT_LANES] += (double)x[j] * x[j], b[j % MN__OPT_LANES] += (double)y[j] * y[j];
}

// One row of g [cols] for the factored second moment, q_j = (double)(g_j² + ε1): rs[j % 16] += q_j
// and, with cs, cs[j] += q_j (a column's sum in row order), or cs[j] = q_j with set (the same as
// adding to zero, without zeroing); and the row of θ [cols] for RMS(θ): ps[j % 16] += θ_j².
MN__OPT_INLINE void mn__opt_af_rowsq(const float *g, const float *th, uint64_t cols, float eps1,
                                     double *rs, double *ps, double *cs, int set) {
    uint64_t j = 0;
#if defined(MN__OPT_LV)
    mn__opt_dv vr[MN__OPT_LV], vp[MN__OPT_LV], q, c, w;
    mn__opt_fv f;
    int l;
    MN__OPT_LOAD(vr, rs), MN__OPT_LOAD(vp, ps);
    for (; j + MN__OPT_LANES <= cols; j += MN__OPT_LANES)
        for (l = 0; l < MN__OPT_LV; l++) {
            uint64_t k = j + (uint64_t)(l * MN__OPT_DW);
            MN__OPT_LOAD(f, g + k), q = MN__OPT_CVT(f * f + eps1);
            vr[l] += q;
            if (cs && set) MN__OPT_STORE(cs + k, q);
            else if (cs) MN__OPT_LOAD(c, cs + k), c += q, MN__OPT_STORE(cs + k, c);
            MN__OPT_LOAD(f, th + k), w = MN__OPT_CVT(f), vp[l] += w * w;
        }
    MN__OPT_STORE(rs, vr), MN__OPT_STORE(ps, vp);
#endif
    for (; j < cols; j++) {
        double q1 = (double)(g[j] * g[j] + eps1);
        rs[j % MN__OPT_LANES] += q1;
        ps[j % MN__OPT_LANES] += (double)th[j] * th[j];
        if (cs) cs[j] = set ? q1 : cs[j] + q1;
    }
}

// The same row of g once R_i is known (the row is still in cache): as[j] += g_j² inv, inv = 1 / R_i
// (or as[j] = with set), a column's sum of g² / R_i in row order, behind RMS(u). Meanwhile no
// demand reads go to memory: it prefetches the rows of g and θ (th, this row's) from
// MN__OPT_AF_PF elements past the next row's start, where the hardware's prefetcher alone leaves
// the loads of the next rows to stall (on a Zen 5 core at [8192, 768]: the step 0.9 of the time
// without; 512 elements ahead gained less, 2048 and 4096 the same, the next row itself lost),
// where mn__pf_ahead says so (pf).
#define MN__OPT_AF_PF 1024u
MN__OPT_INLINE void mn__opt_af_rowinv(const float *g, const float *th, uint64_t cols, double inv,
                                      double *as, int set, int pf) {
    uint64_t j = 0;
#if defined(MN__OPT_LV)
    mn__opt_dv c, w;
    mn__opt_fv f;
    for (; j + MN__OPT_DW <= cols; j += MN__OPT_DW) {
        if (pf && j % 16 == 0) {  // a line of each (addresses past the tensor: never dereferenced)
            uintptr_t off = (uintptr_t)(cols + MN__OPT_AF_PF + j) * sizeof(float);
            __builtin_prefetch((const void *)((uintptr_t)g + off));
            __builtin_prefetch((const void *)((uintptr_t)th + off));
        }
        MN__OPT_LOAD(f, g + j), w = MN__OPT_CVT(f);
        w = w * w * inv;  // (its own statement, as t below: never contracted into an FMA)
        if (!set) MN__OPT_LOAD(c, as + j), w = c + w;
        MN__OPT_STORE(as + j, w);
    }
#else
    (void)th, (void)pf;
#endif
    for (; j < cols; j++) {
        double t = (double)g[j] * g[j] * inv;
        as[j] = set ? t : as[j] + t;
    }
}

// 1 / sqrt(C_j) for the columns [0, cols) of a batch, once per pass instead of once per row.
MN__PRIVATE void mn__opt_af_icol(const float *col, uint64_t cols, float *ic) {
    uint64_t j = 0;
#if MN__OV
    for (; j + MN__OW <= cols; j += MN__OW)
        mn__ov_store(ic + j, 1.0f / MN__OSQRT(mn__ov_load(col + j)));
#endif
    for (; j < cols; j++) ic[j] = 1.0f / sqrtf(col[j]);
}

// Update u before clipping for elements [j0, j0 + len) of the row at `base`, in the plain loop's
// order of operations: factored rf * (1 / sqrt(C_j)) * g, else (1 / sqrt(V_k)) * g. With ic
// (mn__opt_af_icol of the batch's columns) the factored form reads 1 / sqrt(C_j) from it: the
// same value, without a square root and a division per element.
MN__OPT_INLINE void mn__opt_af_u(const mn_adafactor *s, const float *col, const float *ic, float rf,
                                 const float *grad, uint64_t base, uint64_t j0, uint64_t len,
                                 float *u) {
    const float *g = grad + base + j0;
    const float *c = s->factored ? col + j0 : s->exp_avg_sq + base + j0;
    uint64_t j = 0;
    if (s->factored && ic) {
        ic += j0;
#if MN__OV
        for (; j + MN__OW <= len; j += MN__OW)
            mn__ov_store(u + j, rf * mn__ov_load(ic + j) * mn__ov_load(g + j));
#endif
        for (; j < len; j++) u[j] = rf * ic[j] * g[j];
    } else if (s->factored) {
#if MN__OV
        for (; j + MN__OW <= len; j += MN__OW)
            mn__ov_store(u + j, rf * (1.0f / MN__OSQRT(mn__ov_load(c + j))) * mn__ov_load(g + j));
#endif
        for (; j < len; j++) u[j] = rf * (1.0f / sqrtf(c[j])) * g[j];
    } else {
#if MN__OV
        for (; j + MN__OW <= len; j += MN__OW)
            mn__ov_store(u + j, (1.0f / MN__OSQRT(mn__ov_load(c + j))) * mn__ov_load(g + j));
#endif
        for (; j < len; j++) u[j] = (1.0f / sqrtf(c[j])) * g[j];
    }
}

#define MN__OPT_AF_CHUNK 512u  // elements of a row per piece of the passes below
#define MN__OPT_AF_ICOL 2048u  // columns whose scratch lives on the stack (more: allocated)

// The pieces of the sums, from the shape alone (so the sums do not depend on the thread count):
// about MN__OPT_AF_PIECE elements each (a multiple of MN__OPT_AF_CHUNK, so that a piece's first
// column is a lane-0 column).
//   a batch of at most MN__OPT_AF_PIECE elements: bp = PIECE / (rows * cols) whole batches;
//   else rows of at most PIECE columns: rp = PIECE / cols rows of one batch;
//   else: PIECE columns of one row (sp, the span of a row's piece).
// A piece's sums start from zero and are added to the total in piece order (a row's lanes span
// by span, a column's sums rp rows at a time, the lanes of θ² and of a vector's u² piece by
// piece); a tensor of one piece adds its terms straight in order. The team takes a batch's
// pieces (from large batches), their totals added in order (omp ordered).
#define MN__OPT_AF_PIECE 65536u
typedef struct mn__opt_af_geo {
    uint64_t bp;   // whole batches per piece, 0 = a batch has several pieces
    uint64_t rp;   // rows per piece of a batch (rows when bp > 0)
    uint64_t sp;   // columns per piece of a row (cols, or MN__OPT_AF_PIECE)
    uint64_t spr;  // pieces per row (1 when sp == cols)
    uint64_t npb;  // pieces per batch (1 when bp > 0)
} mn__opt_af_geo;
MN__PRIVATE mn__opt_af_geo mn__opt_af_pieces(uint64_t rows, uint64_t cols) {
    mn__opt_af_geo q;
    q.bp = 0, q.rp = 1, q.sp = cols, q.spr = 1;
    if (cols > MN__OPT_AF_PIECE) {
        q.sp = MN__OPT_AF_PIECE, q.spr = (cols + MN__OPT_AF_PIECE - 1) / MN__OPT_AF_PIECE;
    } else if (rows <= MN__OPT_AF_PIECE / cols) {
        q.bp = MN__OPT_AF_PIECE / (rows * cols), q.rp = rows;
    } else {
        q.rp = MN__OPT_AF_PIECE / cols;
    }
    q.npb = (rows + q.rp - 1) / q.rp * q.spr;
    return q;
}

#ifdef _OPENMP
// A loop over iters pieces whose `MN__OMP_ORDERED { ... }` blocks run in piece order.
#define MN__OMP_FOR_ORDERED(team, iters)                                                      \
    MN__PRAGMA(omp parallel for ordered schedule(dynamic, 1) num_threads(team) if ((team) > 1))
#define MN__OMP_ORDERED MN__PRAGMA(omp ordered)
MN__PRIVATE int mn__omp_me(void) { return omp_get_thread_num(); }
#else
#define MN__OMP_FOR_ORDERED(team, iters)
#define MN__OMP_ORDERED
MN__PRIVATE int mn__omp_me(void) { return 0; }
#endif

MN__PRIVATE void mn__opt_lanes_add(double *to, const double *a) {
    int l;
    for (l = 0; l < MN__OPT_LANES; l++) to[l] += a[l];
}

// What the factored second moment of a batch reads and where its sums go: cs and as (scratch
// [cols], NULL when its allocation failed) the column sums of g² + ε1 and of g² / R_i, part
// ([team][2 cols] scratch beyond MN__OPT_AF_ICOL columns) each piece's partials of both.
typedef struct mn__opt_af_mom {
    const float *grad, *param;
    float b2t, w2t, eps1;
    double *cs, *as, *part;
    int team;
    int pf;  // the rows' requests ahead (mn__pf_ahead)
} mn__opt_af_mom;

// The factored second moment of batch b, the lanes of θ² (ps) and the sum behind RMS(u).
// u_ij = g_ij rsqrt(R_i / mean(R)) rsqrt(C_j), so Σ u² = mean(R) Σ_j (Σ_i g_ij² / R_i) / C_j: each
// row's g² / R_i goes to its column's sum as soon as R_i is known (the row's second read, from
// the cache), and the batch's Σ_j (that sum) / C_j in 16 lanes by column is returned, the
// caller scaling it by mean(R). With cs the column sums come in the same read of g as the
// rows', each piece's into its own partials added in piece order; without cs the columns go 64
// at a time in a second read, in the same order. A batch of several pieces adds each piece's
// lanes of θ² (from zero) to ps in order; a piece of whole batches adds to ps straight.
MN__PRIVATE double mn__opt_af_moment(mn_adafactor *s, const mn__opt_af_mom *m,
                                     const mn__opt_af_geo *q, uint64_t b, double *ps) {
    const float *gb = m->grad + b * s->rows * s->cols, *pb = m->param + b * s->rows * s->cols;
    float *row = s->exp_avg_sq_row + b * s->rows, *col = s->exp_avg_sq_col + b * s->cols;
    float b2t = m->b2t, w2t = m->w2t, eps1 = m->eps1;
    double *cs = m->cs, *as = m->as, uc[MN__OPT_LANES] = {0};
    uint64_t i, j, c0, cw, cols = s->cols;
    int64_t k, nk = (int64_t)q->npb;
    if (q->spr > 1) {  // rows of several pieces, one after the other: a column's sum by row
        for (i = 0; i < s->rows; i++) {
            double rs[MN__OPT_LANES] = {0};
            for (c0 = 0; c0 < cols; c0 += q->sp) {
                double sr[MN__OPT_LANES] = {0}, sp[MN__OPT_LANES] = {0};
                cw = cols - c0 < q->sp ? cols - c0 : q->sp;
                mn__opt_af_rowsq(gb + i * cols + c0, pb + i * cols + c0, cw, eps1, sr, sp,
                                 cs ? cs + c0 : NULL, i == 0);
                mn__opt_lanes_add(rs, sr), mn__opt_lanes_add(ps, sp);
            }
            row[i] = row[i] * b2t + w2t * (float)(mn__opt_lanes_total(rs) / (double)cols);
            if (as)
                mn__opt_af_rowinv(gb + i * cols, pb + i * cols, cols, 1.0 / (double)row[i], as,
                                  i == 0, m->pf);
        }
        nk = 0;
    }
    MN__OMP_FOR_ORDERED(m->team, nk)
    for (k = 0; k < nk; k++) {  // pieces of rp whole rows
        uint64_t ik, i0 = (uint64_t)k * q->rp, i1 = i0 + q->rp < s->rows ? i0 + q->rp : s->rows;
        double pbuf[2 * MN__OPT_AF_ICOL], *pt = NULL, *pa = NULL;
        double kp[MN__OPT_LANES] = {0}, *lp = q->bp ? ps : kp;
        // (the first piece's partials are the sums so far: straight into cs and as, which the
        // others touch only in their ordered blocks, after the first's)
        if (cs && k == 0) pt = cs, pa = as;
        else if (cs && cols <= MN__OPT_AF_ICOL) pt = pbuf, pa = pbuf + cols;
        else if (cs) pt = m->part + (size_t)mn__omp_me() * 2 * cols, pa = pt + cols;
        for (ik = i0; ik < i1; ik++) {
            double rs[MN__OPT_LANES] = {0};
            mn__opt_af_rowsq(gb + ik * cols, pb + ik * cols, cols, eps1, rs, lp, pt, ik == i0);
            row[ik] = row[ik] * b2t + w2t * (float)(mn__opt_lanes_total(rs) / (double)cols);
            if (pa)
                mn__opt_af_rowinv(gb + ik * cols, pb + ik * cols, cols, 1.0 / (double)row[ik], pa,
                                  ik == i0, m->pf);
        }
        MN__OMP_ORDERED {
            uint64_t jk;
            if (pt && k > 0)
                for (jk = 0; jk < cols; jk++) cs[jk] += pt[jk], as[jk] += pa[jk];
            if (!q->bp) mn__opt_lanes_add(ps, kp);
        }
    }
    if (cs) {
        for (j = 0; j < cols; j++) {
            col[j] = col[j] * b2t + w2t * (float)(cs[j] / (double)s->rows);
            uc[j % MN__OPT_LANES] += as[j] / (double)col[j];
        }
        return mn__opt_lanes_total(uc);
    }
    for (c0 = 0; c0 < cols; c0 += 64) {  // column means, 64 columns at a time, rp rows at a time
        double acc[64], sum[64] = {0}, acc2[64], sum2[64] = {0};
        cw = cols - c0 < 64 ? cols - c0 : 64;
        for (i = 0; i < s->rows; i++) {
            double inv = 1.0 / (double)row[i];
            if (i % q->rp == 0) memset(acc, 0, sizeof acc), memset(acc2, 0, sizeof acc2);
            for (j = 0; j < cw; j++) {
                float g = gb[i * cols + c0 + j];
                double t = (double)g * g * inv;
                acc[j] += (double)(g * g + eps1), acc2[j] += t;
            }
            if ((i + 1) % q->rp != 0 && i + 1 < s->rows) continue;
            for (j = 0; j < cw; j++) {
                sum[j] = i < q->rp ? acc[j] : sum[j] + acc[j];
                sum2[j] = i < q->rp ? acc2[j] : sum2[j] + acc2[j];
            }
        }
        for (j = 0; j < cw; j++) {
            col[c0 + j] = col[c0 + j] * b2t + w2t * (float)(sum[j] / (double)s->rows);
            uc[(c0 + j) % MN__OPT_LANES] += sum2[j] / (double)col[c0 + j];
        }
    }
    return mn__opt_lanes_total(uc);
}

// The update's scalars: the clipping divisor max(1, RMS(u)/d), alpha_t, the decay -λα_t (applied
// where λ != 0), beta1.
typedef struct mn__opt_af_coef {
    float clip_div, alpha, decay_coef, b1, w1;
    int decay;
} mn__opt_af_coef;

// θ ← θ(1 − λα_t) − u' for len elements, u' = u / clip_div * alpha_t, or, with the first moment
// m, m ← β1 m + (1 − β1) u' and u' = m.
MN__OPT_INLINE void mn__opt_af_apply(const mn__opt_af_coef *c, const float *u, float *th, float *m,
                                     uint64_t len) {
    uint64_t j = 0;
    float clip_div = c->clip_div, alpha = c->alpha, decay = c->decay_coef, b1 = c->b1, w1 = c->w1;
    int wd = c->decay;
#if MN__OV
    for (; j + MN__OW <= len; j += MN__OW) {  // the loop below, MN__OW lanes
        mn__ovf v = mn__ov_load(u + j) / clip_div * alpha, x = mn__ov_load(th + j);
        if (m) v = mn__ov_load(m + j) * b1 + w1 * v, mn__ov_store(m + j, v);
        if (wd) x = x + decay * x;
        mn__ov_store(th + j, x - v);
    }
#endif
    for (; j < len; j++) {
        float v = u[j] / clip_div * alpha;
        if (m) v = m[j] = m[j] * b1 + w1 * v;
        if (wd) th[j] = th[j] + decay * th[j];
        th[j] = th[j] - v;
    }
}

// The unfactored second moment V of elements [e0, e1) and the lanes of u² (ss) and θ² (ps)
// there, chunk by chunk (u recomputed from the fresh V: keeping it would cost n floats).
MN__OPT_INLINE void mn__opt_af_vec(const mn_adafactor *s, const float *param, const float *grad,
                                   float b2t, float w2t, float eps1, uint64_t e0, uint64_t e1,
                                   double *ss, double *ps) {
    float u[MN__OPT_AF_CHUNK], *v = s->exp_avg_sq;
    uint64_t e, j0, len;
    for (j0 = e0; j0 < e1; j0 += len) {
        len = e1 - j0 < MN__OPT_AF_CHUNK ? e1 - j0 : MN__OPT_AF_CHUNK;
        e = j0;
#if MN__OV
        for (; e + MN__OW <= j0 + len; e += MN__OW) {  // the loop below, MN__OW lanes at a time
            mn__ovf g = mn__ov_load(grad + e);
            mn__ov_store(v + e, mn__ov_load(v + e) * b2t + w2t * (g * g + eps1));
        }
#endif
        for (; e < j0 + len; e++) v[e] = v[e] * b2t + w2t * (grad[e] * grad[e] + eps1);
        mn__opt_af_u(s, NULL, NULL, 1.0f, grad, 0, j0, len, u);
        mn__opt_lanes_sq2(ss, u, ps, param + j0, len);
    }
}

MNIMPL mn_result mn_adafactor_step(mn_adafactor *s, float *param, const float *grad,
                                   uint16_t *param16) {
    const mn_adafactor_params *p;
    double t, rho, beta2t, rms_u, clip, su = 0.0;
    double ss[MN__OPT_LANES] = {0}, ps[MN__OPT_LANES] = {0}, t0;
    double gp[MN__OPT_LANES] = {0};  // a piece of whole batches
    float alpha;
    float icbuf[MN__OPT_AF_ICOL], *ic = NULL;
    double csbuf[2 * MN__OPT_AF_ICOL];
    void *scratch = NULL;
    uint64_t b, n;
    mn__opt_af_geo q;
    mn__opt_af_mom m;
    mn__opt_af_coef c;
    int team;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    n = s->n;
    t = (double)++s->step;
    beta2t = 1.0 - pow(t, (double)p->decay_rate);
    memset(&m, 0, sizeof m);
    m.grad = grad, m.param = param;
    m.b2t = (float)beta2t, m.w2t = (float)(1.0 - beta2t), m.eps1 = p->eps1;
    q = mn__opt_af_pieces(s->rows, s->cols);
    // the thread count of the whole step: a team only for batches of several pieces
    team = mn__tune_begin(&s->tune, q.bp ? 0 : s->rows * s->cols, MN__OPT_MIN_PAR, &t0);
    // scratch for the column sums and factors: without it (allocation failed), the column sums
    // take a second read of g, each row recomputes the factors, and one thread runs the step
    if (s->factored && s->cols <= MN__OPT_AF_ICOL) {
        ic = icbuf, m.cs = csbuf, m.as = csbuf + s->cols;
    } else if (s->factored) {
        scratch = mn__alloc_array(&s->alloc, (size_t)s->cols,
                                  sizeof(double) * (2 + 2 * (size_t)team) + sizeof(float));
        if (scratch) {
            m.cs = (double *)scratch, m.as = m.cs + s->cols, m.part = m.as + s->cols;
            ic = (float *)(m.part + s->cols * 2 * (uint64_t)team);
        } else {
            team = 1;
        }
    }
    m.team = team, m.pf = mn__pf_ahead();
    // pass 0: the second moment and the sums of θ² (before the step) and u², piece by piece
    if (s->factored) {
        for (b = 0; b < s->batch; b++) {
            double ac = mn__opt_af_moment(s, &m, &q, b, q.bp ? gp : ps);
            su += (double)(float)mn__opt_row_mean(s, b) * ac;  // mean(R) as the update's factors
            if (!q.bp || ((b + 1) % q.bp != 0 && b + 1 < s->batch)) continue;
            mn__opt_lanes_add(ps, gp), memset(gp, 0, sizeof gp);
        }
    } else {  // one row of pieces of q.sp elements
        int64_t k, nk = (int64_t)q.spr;
        MN__OMP_FOR_ORDERED(team, nk)
        for (k = 0; k < nk; k++) {
            uint64_t e0 = (uint64_t)k * q.sp, e1 = e0 + q.sp < n ? e0 + q.sp : n;
            double ks[MN__OPT_LANES] = {0}, kp[MN__OPT_LANES] = {0};
            mn__opt_af_vec(s, param, grad, m.b2t, m.w2t, m.eps1, e0, e1, ks, kp);
            MN__OMP_ORDERED {
                mn__opt_lanes_add(ss, ks), mn__opt_lanes_add(ps, kp);
            }
        }
        su = mn__opt_lanes_total(ss);
    }
    // the step's scalars, from pass 0's sums
    s->rms = (float)sqrt(mn__opt_lanes_total(ps) / (double)n);
    if (p->lr > 0.0f) rho = p->lr;
    else rho = fmin(p->warmup_init ? 1e-6 * t : 1e-2, 1.0 / sqrt(t));
    alpha = (float)(p->no_scale_parameter ? rho : fmax((double)p->eps2, (double)s->rms) * rho);
    s->alpha = alpha;
    rms_u = sqrt(su / (double)n);
    clip = rms_u / (double)p->clip_threshold;
    c.clip_div = (float)(clip > 1.0 ? clip : 1.0);  // the divisor max(1, RMS(u)/d)
    s->clip_div = c.clip_div;
    c.alpha = alpha, c.decay_coef = -p->weight_decay * alpha, c.decay = p->weight_decay != 0.0f;
    c.b1 = p->beta1, c.w1 = 1.0f - p->beta1;
    // pass 1: apply u / max(1, RMS(u)/d) * alpha, through the first moment when there is one.
    // No sums: each element on its own, so the team splits a batch's chunks any way it likes.
    for (b = 0; b < s->batch; b++) {
        const float *col = s->factored ? s->exp_avg_sq_col + b * s->cols : NULL;
        float rmean = s->factored ? (float)mn__opt_row_mean(s, b) : 1.0f;
        uint64_t cpr = (s->cols + MN__OPT_AF_CHUNK - 1) / MN__OPT_AF_CHUNK;  // chunks per row
        int64_t k, nk = (int64_t)(s->rows * cpr);
        if (ic) mn__opt_af_icol(col, s->cols, ic);
        MN__OMP_FOR_TEAM(team, s->rows * s->cols, nk)
        for (k = 0; k < nk; k++) {
            uint64_t ik = b * s->rows + (uint64_t)k / cpr;
            uint64_t jk = (uint64_t)k % cpr * MN__OPT_AF_CHUNK;
            uint64_t lk = s->cols - jk < MN__OPT_AF_CHUNK ? s->cols - jk : MN__OPT_AF_CHUNK;
            float uk[MN__OPT_AF_CHUNK];
            float rf = s->factored ? 1.0f / sqrtf(s->exp_avg_sq_row[ik] / rmean) : 1.0f;
            mn__opt_af_u(s, col, ic, rf, grad, ik * s->cols, jk, lk, uk);
            mn__opt_af_apply(&c, uk, param + ik * s->cols + jk,
                             s->exp_avg ? s->exp_avg + ik * s->cols + jk : NULL, lk);
        }
    }
    mn__tune_end(&s->tune, team, t0);
    mn__free(&s->alloc, scratch);
    mn__opt_store16(p->dtype, param, param16, n);
    return MN_OK;
}

MNIMPL void mn_adafactor_free(mn_adafactor *s) {
    if (!s) return;
    mn__free(&s->alloc, s->factored ? s->exp_avg_sq_row : s->exp_avg_sq);
    memset(s, 0, sizeof *s);
}

// ---- Lion ---------------------------------------------------------------------------------------
//
// Chen et al. 2023 (arXiv 2302.06675, Algorithm 2) and lion-pytorch:
//   θ ← θ(1 − γλ);  c = β1 m + (1−β1) g;  θ ← θ − γ sign(c);  m ← β2 m + (1−β2) g   (sign(0) = 0)

MNIMPL mn_result mn_lion_init(mn_lion *s, const uint64_t *dims, uint32_t ndim,
                              const mn_lion_params *p, const mn_allocator *alloc) {
    mn_lion_params q;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-4f);
    q.beta1 = mn__opt_z(q.beta1, 0.9f);
    q.beta2 = mn__opt_z(q.beta2, 0.99f);
    q.weight_decay = mn__opt_z(q.weight_decay, 0.0f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta2, 0.0f, 1.0f, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    if ((r = mn_lion_state_bytes(dims, ndim, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->exp_avg = (float *)mem;
    s->state_bytes = bytes;
    return MN_OK;
}

MNIMPL mn_result mn_lion_step(mn_lion *s, float *param, const float *grad, uint16_t *param16) {
    const mn_lion_params *p;
    float decay, lr, b1, b2;
    uint64_t i;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    s->step++;
    lr = p->lr, b1 = p->beta1, b2 = p->beta2;
    decay = (float)(1.0 - (double)lr * (double)p->weight_decay);
    for (i = 0; i < s->n; i++) {
        float g = grad[i], m = s->exp_avg[i];
        float c = m * b1 + (1.0f - b1) * g;
        float sg = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
        param[i] = param[i] * decay - lr * sg;
        s->exp_avg[i] = m * b2 + (1.0f - b2) * g;
    }
    mn__opt_store16(p->dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_lion_free(mn_lion *s) {
    if (!s) return;
    mn__free(&s->alloc, s->exp_avg);
    memset(s, 0, sizeof *s);
}

// ---- Gradient clipping --------------------------------------------------------------------------
//
// torch.nn.utils.clip_grad_norm_: total = ‖(‖g_1‖_p, ..., ‖g_k‖_p)‖_p = (Σ|g|^p)^(1/p) over every
// element (max |g| for p = inf); coef = max_norm / (total + 1e-6) in fp32, clamped to at most 1;
// every gradient *= coef (also when coef is 1). The sum runs in double.

MNIMPL mn_result mn_clip_grad_norm(float *const *grads, const uint64_t *sizes, uint32_t count,
                                   float max_norm, float norm_type, float *total_norm) {
    double acc = 0.0, pn;
    float norm, coef;
    uint32_t k;
    uint64_t i;
    int inf_norm;
    if (count > 0 && (!grads || !sizes)) return MN_ERR_INVALID_ARG;
    if (!(max_norm >= 0.0f)) return MN_ERR_INVALID_ARG;  // also rejects NaN
    if (norm_type == 0.0f) norm_type = 2.0f;
    if (!(norm_type > 0.0f)) return MN_ERR_INVALID_ARG;
    for (k = 0; k < count; k++)
        if ((!grads[k] && sizes[k] > 0) || !mn__floats_fit(sizes[k])) return MN_ERR_INVALID_ARG;
    inf_norm = !mn__opt_finite(norm_type);
    pn = (double)norm_type;
    for (k = 0; k < count; k++) {
        const float *g = grads[k];
        for (i = 0; i < sizes[k]; i++) {
            double a = fabs((double)g[i]);
            if (inf_norm) {
                if (a > acc || a != a) acc = a;  // a NaN sticks
            } else if (norm_type == 2.0f) {
                acc += a * a;
            } else if (norm_type == 1.0f) {
                acc += a;
            } else {
                acc += pow(a, pn);
            }
        }
    }
    if (inf_norm || norm_type == 1.0f) norm = (float)acc;
    else if (norm_type == 2.0f) norm = (float)sqrt(acc);
    else norm = (float)pow(acc, 1.0 / pn);
    if (total_norm) *total_norm = norm;
    coef = max_norm / (norm + 1e-6f);
    if (coef > 1.0f) coef = 1.0f;
    for (k = 0; k < count; k++)
        for (i = 0; i < sizes[k]; i++) grads[k][i] *= coef;
    return MN_OK;
}

// ---- Dynamic loss scaling -----------------------------------------------------------------------
//
// torch.amp.GradScaler with aten/src/ATen/native/cuda/AmpKernels.cu (_amp_update_scale):
//   found_inf: scale ← scale · backoff, tracker ← 0, the optimizer step is skipped
//   else:      tracker + 1 == interval ? (scale ← scale · growth if finite, tracker ← 0)
//                                      : tracker += 1
// Unscale (_amp_foreach_non_finite_check_and_unscale_): g ← g · inv_scale in fp32, found_inf if any
// g is inf or NaN. The scale is fp32; products are formed in double and rounded, as the kernel
// does.

MNIMPL mn_result mn_loss_scaler_init(mn_loss_scaler *s, const mn_loss_scaler_params *p) {
    mn_loss_scaler_params q;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    if (q.init_scale == 0.0f) q.init_scale = 65536.0f;
    if (q.growth_factor == 0.0f) q.growth_factor = 2.0f;
    if (q.backoff_factor == 0.0f) q.backoff_factor = 0.5f;
    if (q.growth_interval == 0) q.growth_interval = 2000;
    if (!mn__opt_in(q.init_scale, FLT_MIN, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.growth_factor, 1.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (q.growth_factor == 1.0f) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.backoff_factor, FLT_MIN, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    s->params = q;
    s->scale = q.init_scale;
    return MN_OK;
}

MNIMPL float mn_loss_scaler_inv_scale(const mn_loss_scaler *s) {
    return s ? (float)(1.0 / (double)s->scale) : 0.0f;
}

MNIMPL mn_result mn_loss_scaler_update(mn_loss_scaler *s, int found_inf, int *skip_step) {
    if (!s || s->params.growth_interval == 0) return MN_ERR_INVALID_ARG;
    s->steps++;
    if (found_inf) {
        s->scale = (float)((double)s->scale * (double)s->params.backoff_factor);
        s->growth_tracker = 0;
        s->skipped++;
    } else if (s->growth_tracker + 1 == s->params.growth_interval) {
        float grown = (float)((double)s->scale * (double)s->params.growth_factor);
        if (mn__opt_finite(grown)) s->scale = grown;
        s->growth_tracker = 0;
    } else {
        s->growth_tracker++;
    }
    if (skip_step) *skip_step = found_inf != 0;
    return MN_OK;
}

MNIMPL mn_result mn_unscale_grads(mn_dtype dtype, void *grad, uint64_t n, float inv_scale,
                                  int *found_inf) {
    uint64_t i;
    int bad = 0;
    if (dtype == MN_DTYPE_DEFAULT) dtype = MN_FP32;
    if (!found_inf || (n > 0 && !grad) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    if (dtype == MN_FP32) {
        float *g = (float *)grad;
        for (i = 0; i < n; i++) {
            bad |= !mn__opt_finite(g[i]);
            g[i] *= inv_scale;
        }
    } else if (dtype == MN_FP16) {
        uint16_t *g = (uint16_t *)grad;
        for (i = 0; i < n; i++) {
            bad |= (g[i] & 0x7c00u) == 0x7c00u;
            g[i] = mn_fp32_to_fp16(mn_fp16_to_fp32(g[i]) * inv_scale);
        }
    } else if (dtype == MN_BF16) {
        uint16_t *g = (uint16_t *)grad;
        for (i = 0; i < n; i++) {
            bad |= (g[i] & 0x7f80u) == 0x7f80u;
            g[i] = mn_fp32_to_bf16(mn_bf16_to_fp32(g[i]) * inv_scale);
        }
    } else {
        return MN_ERR_INVALID_ARG;
    }
    if (bad) *found_inf = 1;
    return MN_OK;
}

MNIMPL mn_result mn_unscale_grads_to_fp32(mn_dtype dtype, const void *src, float *dst, uint64_t n,
                                          float inv_scale, int *found_inf) {
    uint64_t i;
    int bad = 0;
    if (dtype == MN_DTYPE_DEFAULT) dtype = MN_FP32;
    if (!found_inf || (n > 0 && (!src || !dst))) return MN_ERR_INVALID_ARG;
    if (dtype != MN_FP32 && dtype != MN_FP16 && dtype != MN_BF16) return MN_ERR_INVALID_ARG;
    for (i = 0; i < n; i++) {
        float v = dtype == MN_FP32 ? ((const float *)src)[i]
                : dtype == MN_FP16 ? mn_fp16_to_fp32(((const uint16_t *)src)[i])
                                   : mn_bf16_to_fp32(((const uint16_t *)src)[i]);
        bad |= !mn__opt_finite(v);
        dst[i] = v * inv_scale;
    }
    if (bad) *found_inf = 1;
    return MN_OK;
}
// >>ops implementation ----------------------------------------------------------------------------
//
// Row-major fp32 arrays, llm.c layout. Reductions use eight independent float lanes (vectorizable
// without -ffast-math, and closer to pairwise summation than one running sum).
// Matmul is a packed, register-tiled GEMM: a task computes a block of rows x columns of the
// output (up to 512 x 256: the B block is packed once per task into KC x NR panels and reused by
// every row tile); the A operand is read in place where its rows are contiguous, else packed into
// MR x KC tiles, and an MR x NR register tile accumulates. The summation order over k does not
// depend on the thread count, so results are bitwise identical with and without OpenMP.


// Small math helpers are inlined into every loop that uses them, which is what lets those loops
// vectorize (a call per element would not).
#if defined(__GNUC__) || defined(__clang__)
#define MN__INLINE static inline __attribute__((always_inline, unused))
#else
#define MN__INLINE static inline
#endif
// A helper whose stack frame must stay out of its caller's (a large buffer on a path that the
// caller's other callers never take).
#if defined(__GNUC__) || defined(__clang__)
#define MN__NOINLINE __attribute__((noinline))
#else
#define MN__NOINLINE
#endif

// Elementwise loops take one thread per this many elements (two threads from twice as many), a
// GEMM goes parallel above this many flops: below them the team's start and its end barrier cost
// more than they save, and far more when another process keeps one of the cores busy.
#define MN__OMP_MIN_ELEMS 262144
#define MN__OMP_MIN_FLOPS 33554432.0

// Fused multiply-add where the hardware has it (one rounding), plain multiply-add elsewhere, so
// the tests do not call a libm fmaf emulation in their inner loops.
#ifdef __FMA__
#define MN__FMA(a, b, c) fmaf((a), (b), (c))
#else
#define MN__FMA(a, b, c) ((a) * (b) + (c))
#endif

// The reductions below keep MN__LN independent float lanes (lane l sums the elements i with
// i % MN__LN == l of the vector part) and fold them at the end. Sixteen lanes are two AVX or one
// AVX-512 register, or four SSE ones: enough independent adds to hide the add latency, where
// eight lanes waited on it. The lane count is fixed, not taken from the vector width, so the
// results are the same on every machine and for every thread count.
#define MN__LN 16

#if MN__OV
MN__INLINE mn__ovf mn__ov_set1(float c) {
    mn__ovf v = {0};
    return v + c;
}
// MN__FMA on MN__OW lanes.
#if defined(__FMA__) && defined(__AVX512F__)
#define MN__OFMA(a, b, c) ((mn__ovf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif defined(__FMA__) && defined(__AVX__)
#define MN__OFMA(a, b, c) ((mn__ovf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#elif defined(__FMA__)
#define MN__OFMA(a, b, c) ((mn__ovf)_mm_fmadd_ps((__m128)(a), (__m128)(b), (__m128)(c)))
#else
#define MN__OFMA(a, b, c) ((a) * (b) + (c))  // as MN__FMA: the scalar form's bits either way
#endif
// a > b ? a : b on MN__OW lanes (b where either is NaN): the max instruction is exactly that.
#if defined(__AVX512F__)
#define MN__OMAX(a, b) ((mn__ovf)_mm512_max_ps((__m512)(a), (__m512)(b)))
#elif defined(__AVX__)
#define MN__OMAX(a, b) ((mn__ovf)_mm256_max_ps((__m256)(a), (__m256)(b)))
#else
#define MN__OMAX(a, b) ((mn__ovf)_mm_max_ps((__m128)(a), (__m128)(b)))
#endif
#endif

// sum_i x[i] in MN__LN lanes, folded in double.
MN__PRIVATE float mn__sum(const float *x, size_t n) {
    float acc[MN__LN] = {0};
    double s = 0.0;
    size_t i = 0;
    int l;
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN; l++) acc[l] += x[i + l];
    for (; i < n; i++) s += x[i];
    for (l = 0; l < MN__LN; l++) s += acc[l];
    return (float)s;
}

// sum_i x[i] * y[i] in MN__LN lanes, folded in double.
MN__PRIVATE float mn__dot(const float *x, const float *y, size_t n) {
    float acc[MN__LN] = {0};
    double s = 0.0;
    size_t i = 0;
    int l;
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN; l++) acc[l] = MN__FMA(x[i + l], y[i + l], acc[l]);
    for (; i < n; i++) s += (double)x[i] * y[i];
    for (l = 0; l < MN__LN; l++) s += acc[l];
    return (float)s;
}

// sum_i (x[i] - m)^2 in MN__LN lanes, folded in double.
MN__PRIVATE float mn__sumsq_centered(const float *x, float m, size_t n) {
    float acc[MN__LN] = {0};
    double s = 0.0;
    size_t i = 0;
    int l;
#if MN__OV  // the same lanes on vectors (the compiler leaves the loop below scalar)
    mn__ovf va[MN__LN / MN__OW] = {{0}};
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN / MN__OW; l++) {
            mn__ovf d = mn__ov_load(x + i + l * MN__OW) - m;
            va[l] = MN__OFMA(d, d, va[l]);
        }
    for (l = 0; l < MN__LN / MN__OW; l++) mn__ov_store(acc + l * MN__OW, va[l]);
#else
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN; l++) {
            float d = x[i + l] - m;
            acc[l] = MN__FMA(d, d, acc[l]);
        }
#endif
    for (; i < n; i++) s += (double)(x[i] - m) * (x[i] - m);
    for (l = 0; l < MN__LN; l++) s += acc[l];
    return (float)s;
}

#if MN__OV
// The vector lanes of mn__max_scaled over x[0..n), n a multiple of MN__LN: va[l] = max(va[l],
// scale x[i + l MN__OW ..]) for each i, in order.
MN__INLINE void mn__max_lanes(mn__ovf *va, const float *x, float scale, size_t n) {
    size_t i;
    int l;
    for (i = 0; i < n; i += MN__LN)
        for (l = 0; l < MN__LN / MN__OW; l++) {
            mn__ovf v = scale * mn__ov_load(x + i + l * MN__OW);
            va[l] = MN__OMAX(v, va[l]);
        }
}
#endif

// The end of mn__max_scaled: the max of its MN__LN lanes acc and of scale x[i..n).
MN__PRIVATE float mn__max_finish(const float *acc, const float *x, float scale, size_t i,
                                 size_t n) {
    float m = -INFINITY;
    int l;
    for (; i < n; i++) m = scale * x[i] > m ? scale * x[i] : m;
    for (l = 0; l < MN__LN; l++) m = acc[l] > m ? acc[l] : m;
    return m;
}

// max_i scale x[i] in MN__LN lanes (NaN entries are skipped here and propagate through exp
// later).
MN__PRIVATE float mn__max_scaled(const float *x, float scale, size_t n) {
    float acc[MN__LN];
    size_t i = 0;
    int l;
    for (l = 0; l < MN__LN; l++) acc[l] = -INFINITY;
#if MN__OV  // the same lanes on vectors (the compiler leaves the loop below scalar)
    {
        mn__ovf va[MN__LN / MN__OW];
        for (l = 0; l < MN__LN / MN__OW; l++) va[l] = mn__ov_set1(-INFINITY);
        i = n - n % MN__LN, mn__max_lanes(va, x, scale, i);
        for (l = 0; l < MN__LN / MN__OW; l++) mn__ov_store(acc + l * MN__OW, va[l]);
    }
#else
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN; l++) acc[l] = scale * x[i + l] > acc[l] ? scale * x[i + l] : acc[l];
#endif
    return mn__max_finish(acc, x, scale, i, n);
}

// exp(x) in plain arithmetic that vectorizes (libm's expf is a call per element), after Cephes
// expf.c (S. L. Moshier, Cephes Math Library 2.2, single precision): x = n ln2 + r with
// |r| <= ln2/2 by Cody & Waite's (1980) two-constant reduction (ln2 = 0.693359375 - 2.12194440e-4,
// the first part exact in 9 bits, so n * C1 is exact for |n| < 2^15), then
// exp(r) = 1 + r + r^2 P(r) with Cephes' degree-5 minimax P (relative error 4.2e-9 on
// [-0.5, 0.5] by Cephes' own bound); multiply-adds fused where the hardware has FMA. The scale
// 2^n is built from exponent bits in two halves, so that gradual underflow (results below
// 2^-126 come out subnormal, rounded once) and overflow to inf come out right. Measured against
// double exp over [-104, 89] (test/test_opsmath.c): within 1.5 ulp for normal results (1.01
// measured with FMA, 0.98 without), NaN stays NaN, exp(-inf) = 0, exp(+inf) = inf.
MN__INLINE float mn__expf(float x) {
    const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    float xc = x < 89.0f ? x : 89.0f, n, r, p, s1, s2;  // NaN becomes 89 (restored at the end)
    int32_t ni, h;
    uint32_t b1, b2;
    xc = xc > -104.0f ? xc : -104.0f;
    n = (xc * 1.44269504088896341f + round) - round;
    r = MN__FMA(n, 2.12194440e-4f, MN__FMA(n, -0.693359375f, xc));
    ni = (int32_t)n, h = (int32_t)(n * 0.5f);  // h = ni / 2, in the float unit
    b1 = (uint32_t)(h + 127) << 23, b2 = (uint32_t)(ni - h + 127) << 23;
    p = MN__FMA(r, 1.9875691500e-4f, 1.3981999507e-3f);
    p = MN__FMA(p, r, 8.3334519073e-3f);
    p = MN__FMA(p, r, 4.1665795894e-2f);
    p = MN__FMA(p, r, 1.6666665459e-1f);
    p = MN__FMA(p, r, 5.0000001201e-1f);
    p = MN__FMA(p, r * r, r) + 1.0f;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return x == x ? p * s1 * s2 : x;
}

#if MN__OV
// mn__expf on MN__OW lanes, bit for bit. Where every lane's argument lies in [-86.5, 88] (the
// results are normal: n = round(x log2 e) in [-125, 127] and exp(r) in [0.70, 1.42]), the scale
// 2^n of the scalar form (two exact multiplies by 2^h and 2^(n-h)) is the same as adding n to
// the exponent field of exp(r), so the fast form has no clamps, no selects and no multiplies for
// the scale. n comes out of the rounding sum t = x log2 e + 1.5 * 2^23 itself: for |n| < 2^22
// the bits of t are those of 1.5 * 2^23 plus n. A vector with a lane outside the range (the
// subnormal and overflow tails, +-inf, NaN) takes the scalar form lane by lane; one test of the
// whole vector decides.
typedef uint32_t mn__ovu __attribute__((vector_size(MN__OW * sizeof(uint32_t))));
// Every lane of x in the open interval (lo, hi) (false for a NaN lane): with AVX-512 the two
// comparisons go straight to a mask register (through the vector type's comparison GCC would
// widen the mask to a vector and compare it again).
MN__INLINE int mn__ov_within(mn__ovf x, float lo, float hi) {
#if defined(__AVX512F__)
    __mmask16 k = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(lo), _CMP_GT_OQ);
    return _mm512_mask_cmp_ps_mask(k, (__m512)x, _mm512_set1_ps(hi), _CMP_LT_OQ) == 0xFFFF;
#elif defined(__AVX__)
    return _mm256_movemask_ps((__m256)((x > lo) & (x < hi))) == 0xFF;
#else
    return _mm_movemask_ps((__m128)((x > lo) & (x < hi))) == 0xF;
#endif
}
// The fast form alone, for x whose every lane lies in the range (mn__ov_within).
MN__INLINE mn__ovf mn__ov_expf_fast(mn__ovf x) {
    mn__ovf t, n, r, p;
    t = x * 1.44269504088896341f + 12582912.0f;  // the scalar form's expression, as it is
    n = t - 12582912.0f;
    r = MN__OFMA(n, mn__ov_set1(2.12194440e-4f), MN__OFMA(n, mn__ov_set1(-0.693359375f), x));
    p = MN__OFMA(r, mn__ov_set1(1.9875691500e-4f), mn__ov_set1(1.3981999507e-3f));
    p = MN__OFMA(p, r, mn__ov_set1(8.3334519073e-3f));
    p = MN__OFMA(p, r, mn__ov_set1(4.1665795894e-2f));
    p = MN__OFMA(p, r, mn__ov_set1(1.6666665459e-1f));
    p = MN__OFMA(p, r, mn__ov_set1(5.0000001201e-1f));
    p = MN__OFMA(p, r * r, r) + 1.0f;
    return (mn__ovf)((mn__ovu)p + (((mn__ovu)t - 0x4B400000u) << 23));
}
MN__INLINE mn__ovf mn__ov_expf(mn__ovf x) {
    int l;
    if (!mn__ov_within(x, -86.5f, 88.0f)) {
        float a[MN__OW];
        mn__ov_store(a, x);
        for (l = 0; l < MN__OW; l++) a[l] = mn__expf(a[l]);
        return mn__ov_load(a);
    }
    return mn__ov_expf_fast(x);
}
#endif

// y[i] = exp(scale x[i] - m) (y NULL: not kept) and their sum (MN__LN lanes, folded in double)
// in one pass; pf non-NULL: asks for the lines of pf[0..n) along the way (into L2: a hint, for a
// row of the size of x that comes next).
MN__PRIVATE double mn__exp_store_sum(float *y, const float *x, float scale, float m, size_t n,
                                     const float *pf) {
    float acc[MN__LN] = {0};
    double s = 0.0;
    size_t i = 0;
    int l;
#if MN__OV
    mn__ovf va[MN__LN / MN__OW] = {{0}};
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN / MN__OW; l++) {
            mn__ovf e = mn__ov_expf(scale * mn__ov_load(x + i + l * MN__OW) - m);
            if (y) mn__ov_store(y + i + l * MN__OW, e);
            if (pf && l == 0) __builtin_prefetch(pf + i, 0, 2);
            va[l] += e;
        }
    for (l = 0; l < MN__LN / MN__OW; l++) mn__ov_store(acc + l * MN__OW, va[l]);
#else
    (void)pf;
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN; l++) {
            float e = mn__expf(scale * x[i + l] - m);
            if (y) y[i + l] = e;
            acc[l] += e;
        }
#endif
    for (; i < n; i++) {
        float e = mn__expf(scale * x[i] - m);
        if (y) y[i] = e;
        s += e;
    }
    for (l = 0; l < MN__LN; l++) s += acc[l];
    return s;
}

// sum_i exp(x[i] - m) in MN__LN lanes, folded in double.
MN__PRIVATE double mn__sumexp(const float *x, float m, size_t n) {
    return mn__exp_store_sum(NULL, x, 1.0f, m, n, NULL);
}

// ---- streaming stores ---------------------------------------------------------------------------
//
// An ordinary store to a line that is not in cache first reads the line from memory (read for
// ownership): an op that reads x and writes y moves 12 bytes per element where 8 are needed. A
// streaming (non-temporal) store writes whole lines without reading them and leaves them out of
// the caches. That pays where the output would not stay in cache for its reader anyway, so the
// ops below stream the output of a call that writes MN__NT_MIN_BYTES or more (past the L2 of a
// core and the share of a shared L3 that one core can count on, while the call's input passes
// through the same caches); a smaller output keeps ordinary stores and is read back from cache by
// the next op. (Softmax forward followed by a sum over its output, one Zen 5 core, 1 MiB L2,
// 32 MiB L3: streaming lost by 25% at 1 to 4 MiB, broke even at 8 and won by 10% from 16; the
// threshold takes the side of a reader that reads its input more than once, as a matmul does.)
// Only the store differs: every value is computed by the same code either way, into registers,
// an L1 chunk of MN__NT_CHUNK floats or a scratch row in L2 (the cross-entropy's probs), and
// streamed from there; the row loops of softmax and cross-entropy join the passes of three rows
// in one (mn__nt_row_pass) with the same arithmetic in the same order. Streaming stores are weakly
// ordered: the loops cut the rows into parts (mn__nt_parts), and the thread that computes a part
// fences its stores (sfence) once, at the end of the part (a fence per row cost up to 20%). Large calls
// also ask for their rows ahead (mn__prefetch). With MEMANAT_NO_SIMD or without x86 vector lanes
// every store is an ordinary one.
#define MN__NT_MIN_BYTES ((uint64_t)16 << 20)
#define MN__NT_CHUNK 4096  // floats of the L1 chunk a row is computed into before it is streamed
#define MN__PF_ROWS 2      // rows ahead that a large call asks for
#if MN__OV
#define MN__NT 1
#define MN__NT_ALIGN (MN__OW * sizeof(float))  // bytes: the alignment a streaming store needs
MN__INLINE void mn__ov_stream(float *p, mn__ovf v) {
#if defined(__AVX512F__)
    _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
    _mm256_stream_ps(p, (__m256)v);
#else
    _mm_stream_ps(p, (__m128)v);
#endif
}
MN__INLINE void mn__nt_fence(void) { _mm_sfence(); }
// Elements of y[0..n) before its first MN__NT_ALIGN-aligned address (at most n).
MN__INLINE size_t mn__nt_head(const float *y, size_t n) {
    size_t mis = (size_t)((uintptr_t)y % MN__NT_ALIGN);
    size_t h = mis ? (MN__NT_ALIGN - mis) / sizeof(float) : 0;
    return h < n ? h : n;
}
#else
#define MN__NT 0
MN__INLINE void mn__nt_fence(void) {}
#endif

// Whether a call on N rows of C floats is large (MN__NT_MIN_BYTES or more) with rows that fit an
// L1 chunk.
MN__INLINE int mn__nt_big(size_t N, size_t C) {
    return C <= MN__NT_CHUNK && (uint64_t)N * C >= MN__NT_MIN_BYTES / sizeof(float);
}

// Whether a large call streams its output y (vector lanes, y aligned to its element size).
MN__INLINE int mn__nt_want(const float *y) {
    return MN__NT && (uintptr_t)y % sizeof(float) == 0;
}

// Parts of a loop over rows or blocks, each ending with one fence: one part without a team; with
// the team MN__OMP_FOR_WORK(work, MN__OMP_MIN_ELEMS, parts) starts, parts of about MN__OMP_CLAIM
// elements that its threads claim one at a time as they come (a member whose core is busy
// elsewhere takes fewer).
MN__INLINE size_t mn__nt_parts(uint64_t work) {
#ifdef _OPENMP
    return mn__omp_team(work, MN__OMP_MIN_ELEMS) > 1 ? (size_t)(work / MN__OMP_CLAIM + 1) : 1;
#else
    (void)work;
    return 1;
#endif
}

// First of N items in part p of `parts` (contiguous ranges, as a static schedule deals them).
MN__INLINE size_t mn__part_start(size_t N, size_t parts, size_t p) {
    return N / parts * p + (p < N % parts ? p : N % parts);
}

// Asks for the lines of x[0..n) before they are read (a hint): a large op asks for its next row
// while it computes the current one, so that memory works during the arithmetic as well (the
// hardware prefetcher runs only a few lines ahead of the loads, and the passes over a row that
// is already in L1 make none).
MN__INLINE void mn__prefetch(const float *x, size_t n) {
#if MN__OV
    size_t i;
    for (i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(x + i);
#else
    (void)x, (void)n;
#endif
}

// y[0..n) = src[0..n) c: streaming stores on the aligned vectors of y, ordinary ones before and
// after them (c = 1: a copy, bit for bit, as x 1 = x).
MN__PRIVATE void mn__nt_copy(float *y, const float *src, float c, size_t n) {
    size_t i = 0;
#if MN__NT
    size_t h = mn__nt_head(y, n);
    for (; i < h; i++) y[i] = src[i] * c;
    for (; n - i >= MN__OW; i += MN__OW) mn__ov_stream(y + i, mn__ov_load(src + i) * c);
#endif
    for (; i < n; i++) y[i] = src[i] * c;
}

#define MN__NT_ROW_PAD 16  // floats past a row in a buffer for mn__nt_row_at (one 64-byte line)
// Where a row whose output goes to y[0..n) keeps its exponentials in a buffer b of n +
// MN__NT_ROW_PAD floats shared by the rows one after the other: at the offset of
// y in an aligned vector (the streaming stores then read aligned vectors), and always ahead of
// the part of the row before that mn__nt_row_pass has yet to read.
MN__INLINE float *mn__nt_row_at(float *b, const float *y, size_t n) {
#if MN__NT
    return b + MN__NT_ALIGN / sizeof(float) - mn__nt_head(y, n);
#else
    (void)y, (void)n;
    return b;
#endif
}

// GCC unrolls a short loop of fixed count wholly at -O3, at -O2 only where it asks: the step's
// vectors of mn__nt_row_pass then stay in registers (softmax forward at -O2, 8192 x 768, one Zen 5
// core: 1.58-1.61 ms without, 1.21-1.25 with, 1.12-1.13 at -O3).
#if defined(__GNUC__) && !defined(__clang__)
#define MN__UNROLL _Pragma("GCC unroll 16")
#else
#define MN__UNROLL
#endif
#define MN__ROW_STEP 64     // floats of a row per step of mn__nt_row_pass (a multiple of MN__LN)
#define MN__ROW_AHEAD 2048  // floats ahead of its loads that mn__nt_row_pass asks for (8 KiB)
// One pass over three rows of n floats, for the row loops that stream their output, row r's
// computed from row r + 1's max, sum and stored exponentials: it returns
// mn__exp_store_sum(e, x, scale, m, n, NULL) for row r + 1, bit for bit, while it does
// mn__nt_copy(y, src, c, n) for row r (y NULL: none) and *mn = mn__max_scaled(xn, scale, n) for
// row r + 2 (xn NULL: none), asking for xn[i + MN__ROW_AHEAD] as it reads xn[i] (pf: the floats
// readable from xn, at least n; a loop passes on past the row, into the next one); x NULL: no
// exponentials (returns 0). Apart, the pass of exponentials keeps the arithmetic busy with
// memory idle and the passes of loads and of streaming stores keep memory busy with the
// arithmetic idle; one pass over the three rows keeps both busy. (The cross-entropy forward,
// one Zen 5 core, against its loop row by row with ordinary stores: without the requests ahead
// the one pass was 1.6x slower, as the hardware prefetcher did not keep up; with requests
// 8 KiB ahead into L2 as fast; into L1 1.2 to 1.7x faster; 4 and 16 KiB ahead, and steps of 32
// and 128 floats, within the noise; the step's exponentials computed after one range test for
// all its vectors, 1.05x more.) At each step the stores of row r read src before the
// exponentials of row r + 1 write e, so that the two rows may share a buffer: mn__nt_row_at
// places them (a row r's src ahead of the e of the next by the floats before y's first aligned
// vector, where its stores start).
MN__PRIVATE double mn__nt_row_pass(float *e, const float *x, float scale, float m, float *y,
                                   const float *src, float c, const float *xn, size_t pf,
                                   float *mn, size_t n) {
#if MN__NT
    float acc[MN__LN];
    mn__ovf va[MN__LN / MN__OW], vm[MN__LN / MN__OW];
    double s = 0.0;
    size_t h = y ? mn__nt_head(y, n) : 0, i = 0, j;
    int l;
    for (l = 0; l < MN__LN / MN__OW; l++) va[l] = mn__ov_set1(0.0f), vm[l] = mn__ov_set1(-INFINITY);
    for (j = 0; j < h; j++) y[j] = src[j] * c;
    for (; n - h - i >= MN__ROW_STEP; i += MN__ROW_STEP) {  // (h <= n)
        if (y)
            for (j = h + i; j < h + i + MN__ROW_STEP; j += MN__OW)
                mn__ov_stream(y + j, mn__ov_load(src + j) * c);
        if (x) {  // one range test for the step's vectors, then their exps side by side
            mn__ovf v[MN__ROW_STEP / MN__OW];
            int k, fast = 1;
            MN__UNROLL for (k = 0; k < MN__ROW_STEP / MN__OW; k++) {
                v[k] = scale * mn__ov_load(x + i + (size_t)k * MN__OW) - m;
                fast &= mn__ov_within(v[k], -86.5f, 88.0f);
            }
            MN__UNROLL for (k = 0; k < MN__ROW_STEP / MN__OW; k++)
                v[k] = fast ? mn__ov_expf_fast(v[k]) : mn__ov_expf(v[k]);
            MN__UNROLL for (k = 0; k < MN__ROW_STEP / MN__OW; k++) {
                mn__ov_store(e + i + (size_t)k * MN__OW, v[k]);
                va[k % (MN__LN / MN__OW)] += v[k];
            }
        }
        if (xn) {
            mn__max_lanes(vm, xn + i, scale, MN__ROW_STEP);
            if (pf - i >= MN__ROW_AHEAD + MN__ROW_STEP)
                for (j = i + MN__ROW_AHEAD; j < i + MN__ROW_AHEAD + MN__ROW_STEP; j += 16)
                    __builtin_prefetch(xn + j);
        }
    }
    if (y) mn__nt_copy(y + h + i, src + h + i, c, n - h - i);
    if (xn) {
        for (j = i + MN__ROW_AHEAD; j < n + MN__ROW_AHEAD && j < pf; j += 16)
            __builtin_prefetch(xn + j);
        j = (n - i) - (n - i) % MN__LN, mn__max_lanes(vm, xn + i, scale, j);
        for (l = 0; l < MN__LN / MN__OW; l++) mn__ov_store(acc + l * MN__OW, vm[l]);
        *mn = mn__max_finish(acc, xn, scale, i + j, n);
    }
    if (!x) return 0.0;
    for (; n - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN / MN__OW; l++) {
            mn__ovf v = mn__ov_expf(scale * mn__ov_load(x + i + l * MN__OW) - m);
            mn__ov_store(e + i + l * MN__OW, v);
            va[l] += v;
        }
    for (l = 0; l < MN__LN / MN__OW; l++) mn__ov_store(acc + l * MN__OW, va[l]);
    for (; i < n; i++) {
        float v = mn__expf(scale * x[i] - m);
        e[i] = v, s += v;
    }
    for (l = 0; l < MN__LN; l++) s += acc[l];
    return s;
#else
    (void)pf;
    if (y) mn__nt_copy(y, src, c, n);
    if (xn) *mn = mn__max_scaled(xn, scale, n);
    return x ? mn__exp_store_sum(e, x, scale, m, n, NULL) : 0.0;
#endif
}

// Length of the next tile of a size_t range: min(left, cap) for left >= 1 and a tile size
// cap >= 1. It is an int because it is at most cap (the one place a size becomes an int); written
// as 1 + min(left - 1, cap - 1) so that the compiler sees the range [1, cap] and the tile loops
// need no zero-trip paths (measurably faster for the small tiles of attention).
MN__INLINE int mn__tile_len(size_t left, int cap) {
    return left - 1 < (size_t)cap ? (int)(left - 1) + 1 : cap;
}

// ---- GEMM core ----------------------------------------------------------------------------------
//
// c[m, j] += sum_k A(m, k) * B(k, j) for m < M, j < NC, k < K, where A(m, k) = a[m*a_rs + k*a_cs]
// and B(k, j) = b[k*b_rs + j*b_cs]. The three matmul products are this one loop nest with
// different strides.

// Register tile geometry. With GCC/clang vector extensions the tile is MR rows x two SIMD vectors
// (sized to the register file: 32 registers with AVX-512, 16 with AVX/SSE); plain C elsewhere.
#if (defined(__GNUC__) || defined(__clang__)) && !defined(MEMANAT_NO_SIMD)
#define MN__SIMD 1
#if defined(__AVX512F__)
#define MN__VW 16
#define MN__MR 8
#define MN__EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#elif defined(__AVX__)
#define MN__VW 8
#define MN__MR 6
#define MN__EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)
#else
#define MN__VW 4
#define MN__MR 4
#define MN__EACH_ROW(X) X(0) X(1) X(2) X(3)
#endif
typedef float mn__vf __attribute__((vector_size(MN__VW * sizeof(float))));
#else
#define MN__SIMD 0
#define MN__VW 8
#define MN__MR 4
#endif
#define MN__NR (2 * MN__VW)  // columns of the register tile
#define MN__KC 512           // depth of a packed block
#define MN__MC (2 * MN__MR)  // rows of a transposed A packed at a time (mn__gemm_rows_t)
#define MN__JB 128           // columns per task (a multiple of MN__NR)
#define MN__MB 256           // fewest rows per task of the parallel schedule
#define MN__MB_MAX 65536     // most rows per task

// GCC in ISO C mode does not contract a*b+c into one FMA; the register tile asks for it
// (clang contracts within an expression by default).
#if defined(__GNUC__) && !defined(__clang__)
#define MN__CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define MN__CONTRACT
#endif

// a_dt, b_dt: how A and B are stored: 0 (or MN_FP32) float, MN_FP16 or MN_BF16 uint16_t. A
// 16-bit operand is converted to fp32 (exactly) while it is packed: the register tile only ever
// reads fp32, so the sums are those of the fp32 product on the converted values, bit for bit.
typedef struct mn__gemm {
    float *c;
    size_t ldc;
    const void *a;
    size_t a_rs, a_cs;
    const void *b;
    size_t b_rs, b_cs;
    size_t M, NC, K;
    mn_dtype a_dt, b_dt;
    // init 1: c is not read, but set to bias[j] (0 where bias is NULL) + A B: the first k slice
    // stores base + sum where the later ones add, which gives the bits of filling c first and
    // accumulating, without the pass over c that the fill was (4 % of a GPT-2-tiny forward)
    int init;
    const float *bias;
} mn__gemm;

static const float mn__gemm_zeros[MN__NR] = {0};  // the base of an init product without bias

// A 16-bit operand (a dtype other than 0 and MN_FP32).
MN__INLINE int mn__gemm_is16(mn_dtype dt) { return dt != MN_DTYPE_DEFAULT && dt != MN_FP32; }

// Element i of an operand stored as dt, in fp32 (the slow path of odd strides and edges).
MN__INLINE float mn__gemm_ld(const void *p, mn_dtype dt, size_t i) {
    if (!mn__gemm_is16(dt)) return ((const float *)p)[i];
    if (dt == MN_BF16) return mn__bf16_to_fp32_flat(((const uint16_t *)p)[i]);
    return mn__fp16_to_fp32_flat(((const uint16_t *)p)[i]);
}

// x[0..n) = src[0..n) converted from the 16-bit dt (a contiguous run: one loop per type, so that
// the compiler vectorizes it; bf16 is a shift, fp16 a few integer operations and selects).
// With F16C, fp16 goes eight at a time through vcvtph2ps, which gives the same bits (exact, and a
// signaling NaN comes out quiet with its payload, as mn_fp16_to_fp32 does).
MN__PRIVATE void mn__gemm_cvt(float *x, const uint16_t *src, size_t n, mn_dtype dt) {
    size_t i = 0;
    if (dt == MN_BF16) {
        for (; i < n; i++) x[i] = mn__bf16_to_fp32_flat(src[i]);
        return;
    }
#if MN__OV && defined(__F16C__)
    for (; n - i >= 8; i += 8)
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) x[i] = mn__fp16_to_fp32_flat(src[i]);
}

// The same for exactly eight values, inlined into the transposed packing's column loop (a call
// per eight values there was 10 % of a bf16 forward at the default trainer's shapes).
// bf16 with AVX2: the bits moved up 16, and a NaN's quiet bit set as mn_bf16_to_fp32 does (the
// magnitude compares as a signed integer: its sign bit is clear).
MN__INLINE void mn__gemm_cvt8(float *x, const uint16_t *src, mn_dtype dt) {
    int i;
    (void)i;  // (unused where both types have their instructions)
    if (dt == MN_BF16) {
#if MN__OV && defined(__AVX2__)
        __m256i v = _mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
        v = _mm256_or_si256(v, _mm256_and_si256(nan, _mm256_set1_epi32(0x400000)));
        _mm256_storeu_si256((__m256i *)x, v);
#else
        for (i = 0; i < 8; i++) x[i] = mn__bf16_to_fp32_flat(src[i]);
#endif
        return;
    }
#if MN__OV && defined(__F16C__)
    _mm256_storeu_ps(x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)));
#else
    for (i = 0; i < 8; i++) x[i] = mn__fp16_to_fp32_flat(src[i]);
#endif
}

// Register tile: acc = sum_k A(0..MR, k) (outer) bp[k][0..NR), then c += acc on the valid part
// (mr rows, nr columns), or c = base[j] + acc where base is not NULL (an init product's first k
// slice). A(m, k) = ap[m*ars + k*acs]: a packed tile (ars 1, acs MR) or MR rows of the caller's
// matrix read in place (ars its row stride, acs 1); the same products either way.
// cp, where not NULL, is a copy that rides along: cp->rows rows of a transposed A, packed for a
// later tile, spread evenly over the k loop (see mn__gemm_rows_t).
typedef struct mn__gemm_cp {
    const float *src;  // row 0 of the copy at strip 0: A(m, k) = src[m + k*stride]
    size_t stride;     // floats from one row (k) of src to the next
    float *dst;        // row 0 of strip 0 in a packed block ([strip][MN__KC][MN__MR])
    int rows, strips;  // rows (k) to copy, at most the tile's kc; strips of MN__MR floats per row
    int pf_rows;       // rows of src from row 0 that exist (asked for ahead up to there)
} mn__gemm_cp;
#define MN__CP_AHEAD 16  // rows of src that a copy asks for ahead of the row it copies

// Row r of the copy (its strips, MN__MR floats each), and the lines of row r + MN__CP_AHEAD
// asked for: each row of src is a line or two of its own, OC floats from the next, which the
// hardware prefetcher does not follow.
MN__INLINE void mn__gemm_cp_row(const mn__gemm_cp *cp, int r) {
    const float *s = cp->src + (size_t)r * cp->stride;
    float *d = cp->dst + (size_t)r * MN__MR;
    int t, n = cp->strips * MN__MR;
    if (r + MN__CP_AHEAD < cp->pf_rows) {
        const float *f = s + (size_t)MN__CP_AHEAD * cp->stride;
        for (t = 0; t < n; t += 64 / (int)sizeof(float)) __builtin_prefetch(f + t);
        __builtin_prefetch(f + n - 1);
    }
    for (t = 0; t < cp->strips; t++)
        memcpy(d + (size_t)t * MN__KC * MN__MR, s + (size_t)t * MN__MR, sizeof(float) * MN__MR);
}

MN__PRIVATE MN__CONTRACT void mn__gemm_tile(float *c, size_t ldc, int mr, int nr, const float *ap,
                                            size_t ars, size_t acs, const float *bp, int kc,
                                            const float *base, const mn__gemm_cp *cp) {
    float out[MN__MR][MN__NR];
    int k, m, j, crows = cp ? cp->rows : 0, cr = 0;
#if MN__SIMD
    mn__vf acc0[MN__MR], acc1[MN__MR], b0, b1, zero;
    int cacc = 0;  // copies due: one row each time it passes kc (Bresenham's line stepping)
    // c is read once, after the loop: ask for its lines now (a large c, such as the logits of a
    // big vocabulary, is in memory, not in cache, and the loop hides the wait)
    for (m = 0; m < mr && !base; m++) {
        __builtin_prefetch(c + (size_t)m * ldc, 1);
        __builtin_prefetch(c + (size_t)m * ldc + (nr - 1), 1);
    }
    memset(&zero, 0, sizeof zero);
    for (m = 0; m < MN__MR; m++) acc0[m] = zero, acc1[m] = zero;
    for (k = 0; k < kc; k++) {
        const float *av = ap + (size_t)k * acs, *bv = bp + (size_t)k * MN__NR;
        // A read in place along k with a stride (the weight gradient's transposed A where
        // mn__gemm_rows_t does not pack it: each k a line of its own, OC floats apart) is asked
        // for eight k ahead: the hardware prefetcher does not follow a stride across pages (+4 to
        // 8 % on GPT-2's qkv weight gradient read in place, in alternated runs; a line already in
        // cache, as for rows read along k or a packed A, costs one load).
        __builtin_prefetch(av + 8 * acs);
        if (crows && (cacc += crows) >= kc) cacc -= kc, mn__gemm_cp_row(cp, cr++);
        memcpy(&b0, bv, sizeof b0);
        memcpy(&b1, bv + MN__VW, sizeof b1);
        // the row loop written out, so that -O2 keeps the accumulators in registers too
#define MN__ROW(m) acc0[m] += b0 * av[(m) * ars], acc1[m] += b1 * av[(m) * ars];
        MN__EACH_ROW(MN__ROW)
#undef MN__ROW
    }
    for (m = 0; m < MN__MR; m++) {
        memcpy(&out[m][0], &acc0[m], sizeof acc0[m]);
        memcpy(&out[m][MN__VW], &acc1[m], sizeof acc1[m]);
    }
    for (; cr < crows; cr++) mn__gemm_cp_row(cp, cr);
#else
    for (; cr < crows; cr++) mn__gemm_cp_row(cp, cr);
    for (m = 0; m < MN__MR; m++)
        for (j = 0; j < MN__NR; j++) out[m][j] = 0.0f;
    for (k = 0; k < kc; k++) {
        const float *av = ap + (size_t)k * acs, *bv = bp + (size_t)k * MN__NR;
        for (m = 0; m < MN__MR; m++)
            for (j = 0; j < MN__NR; j++) out[m][j] += av[(size_t)m * ars] * bv[j];
    }
#endif
    if (base) {
        for (m = 0; m < mr; m++)
            for (j = 0; j < nr; j++) c[(size_t)m * ldc + j] = base[j] + out[m][j];
    } else if (mr == MN__MR && nr == MN__NR) {
        for (m = 0; m < MN__MR; m++)
            for (j = 0; j < MN__NR; j++) c[(size_t)m * ldc + j] += out[m][j];
    } else {
        for (m = 0; m < mr; m++)
            for (j = 0; j < nr; j++) c[(size_t)m * ldc + j] += out[m][j];
    }
}

// Packs panel p of the B block (k0.., j0..) of kc rows and jb columns as [k][NR], zero-padded
// past the last column. Rows of B contiguous (b_cs 1): a copy per k. Otherwise (B is a
// transposed matrix, b_rs 1 in the forward product) eight k at a time: each of the panel's
// columns is read along k, eight floats in a row, and the eight land in eight rows of the panel,
// which stay in L1 (a column at a time through all of k wrote one float per line and row).
MN__PRIVATE void mn__gemm_pack_b(const mn__gemm *g, float *bpack, size_t k0, int kc, size_t j0,
                                 int jb, int p) {
    float *dst = bpack + (size_t)p * MN__KC * MN__NR, t[8];
    int jn = jb - p * MN__NR < MN__NR ? jb - p * MN__NR : MN__NR, jj, k, q, qn;
    size_t off = k0 * g->b_rs + (j0 + (size_t)p * MN__NR) * g->b_cs;
    const float *src = (const float *)g->b + off;
    const uint16_t *h = (const uint16_t *)g->b + off;
    int is16 = mn__gemm_is16(g->b_dt);
    if (jn < MN__NR) memset(dst, 0, (size_t)kc * MN__NR * sizeof(float));
    if (g->b_cs == 1) {
        for (k = 0; k < kc; k++) {
            if (is16) mn__gemm_cvt(dst + (size_t)k * MN__NR, h + (size_t)k * g->b_rs, (size_t)jn,
                                   g->b_dt);
            else memcpy(dst + (size_t)k * MN__NR, src + (size_t)k * g->b_rs,
                        (size_t)jn * sizeof(float));
        }
        return;
    }
    for (k = 0; k < kc; k += 8) {
        qn = kc - k < 8 ? kc - k : 8;
        for (jj = 0; jj < jn; jj++) {
            size_t at = (size_t)jj * g->b_cs + (size_t)k * g->b_rs;
            const float *col = src + at;
            float *d = dst + (size_t)k * MN__NR + jj;
            if (qn == 8 && g->b_rs == 1) {
                if (is16) mn__gemm_cvt8(t, h + at, g->b_dt), col = t;
                d[0] = col[0], d[MN__NR] = col[1], d[2 * MN__NR] = col[2];
                d[3 * MN__NR] = col[3], d[4 * MN__NR] = col[4], d[5 * MN__NR] = col[5];
                d[6 * MN__NR] = col[6], d[7 * MN__NR] = col[7];
            } else {
                for (q = 0; q < qn; q++)
                    d[(size_t)q * MN__NR] =
                        mn__gemm_ld(g->b, g->b_dt, off + at + (size_t)q * g->b_rs);
            }
        }
    }
}

// A transposed A (a_rs 1, a_cs OC: the weight gradient's A(o, n) = dy[n, o]) has its MR
// floats per k in a line of their own, OC floats from the next k. Read in place, a strip's kc
// lines are read again for each column panel, and they do not stay in cache: where OC * 4 bytes
// is a multiple of 4096 (GPT-2's 3072 columns) the lines share one L1 set and 16 of L2's (with
// 4 KiB pages), which hold 256 of the 512; where OC is large (the vocabulary) each k is a page
// of its own. That ran the weight gradient at 61-64 % of the FMA peak at those shapes (one Zen 5
// core), against 80-90 % for the other products. So the strips are packed as [k][MR], a block
// of MN__MC rows at a time, and the tiles read them from there. A packing pass of its own costs
// 15-20 % (it waits on every row of A, from L3 or memory, with no FMAs to overlap); instead the
// tiles of a block copy the next block along their k loops (mn__gemm_cp), a row every few k,
// each asking for the row MN__CP_AHEAD rows on. The tiles compute the same sums either way.
// Where A's rows are close (OC below 256: 3 % slower at C 256, OC 64), or where they are less
// than a page apart and there are one or two column panels (C <= 64: 4 to 5 % slower at OC 192
// to 512, 24 % faster at OC 1024), the copy costs more than it saves, and A is read in place.

// Rows [ka, kb) of a block of mc rows of a transposed A whose element (0, 0) is src: strip s of
// the block goes to ap + s * MN__KC * MN__MR as [k][MN__MR], rows past mc repeating the last one
// (their sums are discarded).
MN__PRIVATE void mn__gemm_pack_at(float *ap, const float *src, size_t a_cs, int mc, int ka,
                                  int kb) {
    int k, s, m, ns = (mc + MN__MR - 1) / MN__MR;
    for (k = ka; k < kb; k++) {
        const float *row = src + (size_t)k * a_cs;
        for (s = 0; s < ns; s++) {
            float *d = ap + (size_t)s * MN__KC * MN__MR + (size_t)k * MN__MR;
            int mr = mc - s * MN__MR < MN__MR ? mc - s * MN__MR : MN__MR;
            if (mr == MN__MR) memcpy(d, row + s * MN__MR, sizeof(float) * MN__MR);
            else for (m = 0; m < MN__MR; m++) d[m] = row[s * MN__MR + (m < mr ? m : mr - 1)];
        }
    }
}

// Rows [m0, m0+mb) of c for a transposed fp32 A (see above): blocks of MN__MC rows, packed into
// two buffers in turn; the first block is packed before its tiles, a last partial strip of the
// next block too, and every full strip of the next block by the tiles of the current one (the
// tile call q of nq copies its rows [q kc / nq, (q + 1) kc / nq)). Not inlined: its buffers (64
// KiB with AVX-512) stay out of the frame of mn__gemm_rows, which the attention's tiles use too.
MN__PRIVATE MN__NOINLINE void mn__gemm_rows_t(const mn__gemm *g, const float *bpack, size_t k0, int kc,
                                 size_t j0, int jb, size_t m0, int mb) {
    float apack[2][MN__MC * MN__KC];
    const float *a = (const float *)g->a + m0 + k0 * g->a_cs;
    int npanel = (jb + MN__NR - 1) / MN__NR, i, s, p, cur = 0;
    int mc = mn__tile_len((size_t)mb, MN__MC);
    mn__gemm_pack_at(apack[0], a, g->a_cs, mc, 0, kc);
    for (i = 0; i < mb; i += MN__MC, cur ^= 1) {
        int ns = (mc + MN__MR - 1) / MN__MR, q = 0, nq = ns * npanel;
        int nn = mb - i - mc < MN__MC ? mb - i - mc : MN__MC;  // rows of the next block
        int full = nn > 0 ? nn / MN__MR : 0;  // its full strips, copied along the tiles
        const float *nsrc = a + i + mc;
        mn__gemm_cp cp;
        if (nn % MN__MR)  // a last partial strip: packed here
            mn__gemm_pack_at(apack[cur ^ 1] + (size_t)full * MN__KC * MN__MR,
                             nsrc + full * MN__MR, g->a_cs, nn % MN__MR, 0, kc);
        cp.stride = g->a_cs, cp.strips = full;
        for (s = 0; s < ns; s++) {
            int mr = mc - s * MN__MR < MN__MR ? mc - s * MN__MR : MN__MR;
            for (p = 0; p < npanel; p++, q++) {
                int jn = jb - p * MN__NR < MN__NR ? jb - p * MN__NR : MN__NR;
                int r0 = q * kc / nq, r1 = (q + 1) * kc / nq;
                float *c = g->c + (m0 + (size_t)i + (size_t)s * MN__MR) * g->ldc + j0 +
                           (size_t)p * MN__NR;
                const float *base = NULL;
                cp.src = nsrc + (size_t)r0 * g->a_cs, cp.dst = apack[cur ^ 1] + (size_t)r0 * MN__MR;
                cp.rows = full ? r1 - r0 : 0, cp.pf_rows = kc - r0;
                if (g->init && k0 == 0)
                    base = g->bias ? g->bias + j0 + (size_t)p * MN__NR : mn__gemm_zeros;
                mn__gemm_tile(c, g->ldc, mr, jn, apack[cur] + (size_t)s * MN__KC * MN__MR, 1,
                              MN__MR, bpack + (size_t)p * MN__KC * MN__NR, kc, base, &cp);
            }
        }
        mc = nn;
    }
}

// Rows [m0, m0+mb) of c against a packed B slice (k0.., j0..) of kc x jb: c += A B on that part.
// A transposed fp32 A (the weight gradient) goes to mn__gemm_rows_t where its rows (k) are 1 KiB
// or more apart, and it has more than two column panels or its rows are a page or more apart.
// Else a full fp32 strip of MR rows is read in place when either index of A is contiguous (rows
// of A for the forward and input-gradient products, columns of A for the weight gradient: MR
// floats per k). A 16-bit strip with contiguous rows is converted row by row to [MR][kc] (runs
// the compiler vectorizes), then read like rows in place. A partial strip (or a matrix with
// neither stride 1) is packed as [k][MR] one value at a time; rows past the end repeat the last
// row (their sums are discarded).
MN__PRIVATE void mn__gemm_rows(const mn__gemm *g, const float *bpack, size_t k0, int kc, size_t j0,
                               int jb, size_t m0, int mb) {
    float apack[MN__KC * MN__MR];
    int npanel = (jb + MN__NR - 1) / MN__NR, p, i, k, m, is16 = mn__gemm_is16(g->a_dt);
    if (!is16 && g->a_rs == 1 && g->a_cs >= 1024 / sizeof(float) &&
        (npanel > 2 || g->a_cs >= 4096 / sizeof(float))) {
        mn__gemm_rows_t(g, bpack, k0, kc, j0, jb, m0, mb);
        return;
    }
    for (i = 0; i < mb; i += MN__MR) {
        int mr = mb - i < MN__MR ? mb - i : MN__MR;
        size_t off = (m0 + (size_t)i) * g->a_rs + k0 * g->a_cs;
        const float *src = (const float *)g->a + off, *ap = apack;
        const uint16_t *pf = NULL;  // the next 16-bit strip, to prefetch (pm rows)
        size_t ars = 1, acs = MN__MR;
        int pm = 0;
        if (!is16 && mr == MN__MR && (g->a_cs == 1 || g->a_rs == 1)) {
            ap = src, ars = g->a_rs, acs = g->a_cs;
        } else if (is16 && g->a_cs == 1) {
            const uint16_t *h = (const uint16_t *)g->a + off;
            for (m = 0; m < MN__MR; m++)
                mn__gemm_cvt(apack + (size_t)m * (size_t)kc,
                             h + (size_t)(m < mr ? m : mr - 1) * g->a_rs, (size_t)kc, g->a_dt);
            ars = (size_t)kc, acs = 1;
            // The conversion has no FMAs to hide its wait for A's lines (from L3: the strip is
            // read again for every column block), so the next strip's lines are asked for now,
            // into L2, and arrive while this strip's tiles run (forward GPT-2 fc at 4096 rows,
            // bf16: the conversion took 14 % of the time, waiting on its loads).
            if (mb - i > MN__MR) {
                pf = h + (size_t)MN__MR * g->a_rs;
                pm = mb - i - MN__MR < MN__MR ? mb - i - MN__MR : MN__MR;
            }
        } else if (!is16 && g->a_cs == 1) {  // rows of A are contiguous
            for (m = 0; m < MN__MR; m++) {
                const float *row = src + (size_t)(m < mr ? m : mr - 1) * g->a_rs;
                for (k = 0; k < kc; k++) apack[(size_t)k * MN__MR + m] = row[k];
            }
        } else {
            for (k = 0; k < kc; k++)
                for (m = 0; m < MN__MR; m++)
                    apack[(size_t)k * MN__MR + m] = mn__gemm_ld(
                        g->a, g->a_dt,
                        off + (size_t)k * g->a_cs + (size_t)(m < mr ? m : mr - 1) * g->a_rs);
        }
        for (p = 0; p < npanel; p++) {
            int jn = jb - p * MN__NR < MN__NR ? jb - p * MN__NR : MN__NR;
            float *c = g->c + (m0 + (size_t)i) * g->ldc + j0 + (size_t)p * MN__NR;
            for (m = p * pm / npanel; m < (p + 1) * pm / npanel; m++)
                for (k = 0; k < kc; k += 32) __builtin_prefetch(pf + (size_t)m * g->a_rs + k, 0, 3);
            const float *base = NULL;
            if (g->init && k0 == 0)
                base = g->bias ? g->bias + j0 + (size_t)p * MN__NR : mn__gemm_zeros;
            mn__gemm_tile(c, g->ldc, mr, jn, ap, ars, acs, bpack + (size_t)p * MN__KC * MN__NR,
                          kc, base, NULL);
        }
    }
}

// One task: rows [m0, m0+mb) x columns [j0, j0+jb) of c, all of k: for each MN__KC slice of k in
// order, B's slice is packed once into bpack (MN__KC x jb floats, this thread's own) and every row
// strip of the task runs against it.
MN__PRIVATE void mn__gemm_task(const mn__gemm *g, float *bpack, size_t m0, int mb, size_t j0,
                               int jb) {
    size_t k0;
    int kc, p, npanel = (jb + MN__NR - 1) / MN__NR;
    for (k0 = 0; k0 < g->K; k0 += MN__KC) {
        kc = mn__tile_len(g->K - k0, MN__KC);
        for (p = 0; p < npanel; p++) mn__gemm_pack_b(g, bpack, k0, kc, j0, jb, p);
        mn__gemm_rows(g, bpack, k0, kc, j0, jb, m0, mb);
    }
}

// c = bias (or 0) for an init product that adds nothing to it (K 0) or that CBLAS serves.
MN__PRIVATE void mn__gemm_fill(const mn__gemm *g) {
    size_t m, j;
    for (m = 0; m < g->M; m++)
        for (j = 0; j < g->NC; j++) g->c[m * g->ldc + j] = g->bias ? g->bias[j] : 0.0f;
}

#ifdef MEMANAT_CBLAS
// c += A B through cblas_sgemm (row-major, beta 1): an index of stride 1 makes each operand a
// plain or a transposed matrix. Returns 0 (the native kernel runs) for strides or sizes CBLAS
// cannot take: neither stride 1, a leading dimension below its minimum, a size past INT_MAX.
MN__PRIVATE int mn__gemm_cblas(const mn__gemm *g) {
    enum CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans;
    size_t lda = g->a_rs, ldb = g->b_rs, lim = (size_t)INT_MAX;
    if (mn__gemm_is16(g->a_dt) || mn__gemm_is16(g->b_dt)) return 0;  // CBLAS multiplies floats
    if (g->a_cs != 1) {
        if (g->a_rs != 1) return 0;
        ta = CblasTrans, lda = g->a_cs;
    }
    if (g->b_cs != 1) {
        if (g->b_rs != 1) return 0;
        tb = CblasTrans, ldb = g->b_cs;
    }
    if (g->M > lim || g->NC > lim || g->K > lim || lda > lim || ldb > lim || g->ldc > lim)
        return 0;
    if (lda < (ta == CblasNoTrans ? g->K : g->M) || ldb < (tb == CblasNoTrans ? g->NC : g->K) ||
        g->ldc < g->NC || lda == 0 || ldb == 0 || g->ldc == 0)
        return 0;
    if (g->init) mn__gemm_fill(g);
    cblas_sgemm(CblasRowMajor, ta, tb, (int)g->M, (int)g->NC, (int)g->K, 1.0f,
                (const float *)g->a, (int)lda, (const float *)g->b, (int)ldb, 1.0f, g->c,
                (int)g->ldc);
    return 1;
}
#endif

// Runs every task; the tasks write disjoint blocks of c, so any schedule gives the same bits
// (each output sums its k slices in order, each slice from zero in the register tile). A task
// packs B once for its mb rows, so mb is as large as the parallel schedule allows: all the rows
// (up to MN__MB_MAX) on one thread; with more threads it halves, down to MN__MB, while there are
// fewer than four tasks per thread (the dynamic schedule then absorbs a slow or busy core).
// Block sizes change which thread computes an output, never the order of its sum over k.
// Columns per task: MN__JB, or MN__JB_T when B is read across its rows (the forward product,
// B = weight^T). Each A strip is read (a 16-bit one converted) once per task and k slice, so a
// wider task reads A half as often; the forward measured 6 to 15 % faster at GPT-2 shapes with
// 256 columns (fp32 and bf16, alternated runs), the two backward products no faster (the weight
// gradient about 2 % slower), so they keep 128 and pack on the stack (256 KiB). The wider blocks
// (512 KiB) come from MN_MALLOC, one per thread, once per call: MN_ERR_OUT_OF_MEMORY when that
// fails, and the product is then not computed.
#define MN__JB_T 256
#ifdef _OPENMP
#define MN__GEMM_FOR(team) \
    MN__PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(team) if ((team) > 1))
#else
#define MN__GEMM_FOR(team)
#endif
MN__PRIVATE void mn__gemm_task_stack(const mn__gemm *g, size_t m0, int mb, size_t j0, int jb) {
    float bpack[MN__KC * MN__JB];
    mn__gemm_task(g, bpack, m0, mb, j0, jb);
}

MN__PRIVATE mn_result mn__gemm_run(const mn__gemm *g) {
    float *heap = NULL, *packs = NULL;
    size_t jt, mt, t, ntask, jbw = g->b_cs != 1 ? MN__JB_T : MN__JB, per;
    int mb = MN__MB_MAX, threads = 1, team = 1;
    if (g->M == 0 || g->NC == 0) return MN_OK;
    if (g->K == 0) {
        if (g->init) mn__gemm_fill(g);
        return MN_OK;
    }
#ifdef MEMANAT_CBLAS
    if (mn__gemm_cblas(g)) return MN_OK;
#endif
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    if (jbw > MN__JB && g->NC <= MN__JB) jbw = MN__JB;  // one narrow block: no wider one needed
    jt = (g->NC + jbw - 1) / jbw;
    if (threads > 1 && 2.0 * (double)g->M * (double)g->NC * (double)g->K >= MN__OMP_MIN_FLOPS)
        team = threads;
    while (team > 1 && mb > MN__MB &&
           ((g->M + (size_t)mb - 1) / (size_t)mb) * jt < 4 * (size_t)team)
        mb /= 2;
    mt = (g->M + (size_t)mb - 1) / (size_t)mb, ntask = mt * jt;
    if (ntask < (size_t)team) team = (int)ntask;
    per = MN__KC * jbw;  // floats of one thread's packed block
    if (jbw > MN__JB) {
        // one block per thread, each starting on a 64-byte line (per is a multiple of 16 floats)
        uint64_t bytes;
        if (mn_mul_u64((uint64_t)team, (uint64_t)per * sizeof(float), &bytes) != MN_OK ||
            mn_add_u64(bytes, 64, &bytes) != MN_OK || bytes > (uint64_t)SIZE_MAX)
            return MN_ERR_OVERFLOW;
        heap = (float *)MN_MALLOC((size_t)bytes);
        if (!heap) return MN_ERR_OUT_OF_MEMORY;
        packs = (float *)((char *)heap + (64 - (uintptr_t)heap % 64) % 64);
    }
    MN__GEMM_FOR(team)
    for (t = 0; t < ntask; t++) {
        size_t m0 = (t / jt) * (size_t)mb, j0 = (t % jt) * jbw;
        int me = 0, mlen = mn__tile_len(g->M - m0, mb), jlen = mn__tile_len(g->NC - j0, (int)jbw);
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        if (packs) mn__gemm_task(g, packs + (size_t)me * per, m0, mlen, j0, jlen);
        else mn__gemm_task_stack(g, m0, mlen, j0, jlen);
    }
    MN_FREE(heap);
    return MN_OK;
}

// The same tasks on the calling thread (for callers already inside a parallel loop).
MN__PRIVATE void mn__gemm_serial(const mn__gemm *g) {
    size_t m0, j0;
    if (g->K == 0) return;
    for (m0 = 0; m0 < g->M; m0 += MN__MB_MAX)
        for (j0 = 0; j0 < g->NC; j0 += MN__JB)
            mn__gemm_task_stack(g, m0, mn__tile_len(g->M - m0, MN__MB_MAX), j0,
                                mn__tile_len(g->NC - j0, MN__JB));
}

// c[M, NC] (row stride ldc) += A(m, k) B(k, j) with the strides of mn__gemm, on this thread.
MN__PRIVATE void mn__gemm_acc(float *c, size_t ldc, const float *a, size_t a_rs, size_t a_cs,
                              const float *b, size_t b_rs, size_t b_cs, size_t M, size_t NC,
                              size_t K) {
    mn__gemm g;
    g.c = c, g.ldc = ldc, g.a = a, g.a_rs = a_rs, g.a_cs = a_cs;
    g.b = b, g.b_rs = b_rs, g.b_cs = b_cs, g.M = M, g.NC = NC, g.K = K;
    g.a_dt = g.b_dt = MN_FP32, g.init = 0, g.bias = NULL;
    mn__gemm_serial(&g);
}

// ---- GELU ---------------------------------------------------------------------------------------

// GELU tanh approximation, Hendrycks & Gimpel 2016 (llm.c train_gpt2.c gelu_forward):
// 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as x sigmoid(2u) (the same
// function: 0.5 (1 + tanh u) = sigmoid(2u)), so no tanh is needed and no 1 + tanh cancels for
// negative x. One exp of a non-positive argument serves both signs: with e = exp(-2|u|) in (0, 1]
// and d = 1 / (1 + e), sigmoid(2u) = d for u >= 0 and e d for u < 0 (nothing overflows, and the
// loop has one exp and one division per element). The argument is formed as
// -2|u| = |x| (-2 sqrt(2/pi) - 2 sqrt(2/pi) 0.044715 x^2), one multiply-add and two multiplies;
// u has the sign of x (its second factor is positive), so x chooses between d and e d.
#define MN__GELU_C0 (-1.5957691216057308f)   // -2 sqrt(2/pi)
#define MN__GELU_C1 (-0.07135481627260025f)  // -2 sqrt(2/pi) 0.044715
MN__INLINE float mn__gelu_arg(float x) {  // -2 |u|
    return fabsf(x) * MN__FMA(x * x, MN__GELU_C1, MN__GELU_C0);
}
MN__INLINE float mn__gelu(float x) {
    float e = mn__expf(mn__gelu_arg(x)), d = 1.0f / (1.0f + e);
    return x * (x >= 0.0f ? d : e * d);
}

// d/dx of the above (llm.c gelu_backward): 0.5 (1 + tanh u) + 0.5 x sech^2(u) sqrt(2/pi)
// (1 + 3 a x^2), with s = sigmoid(2u): 0.5 (1 + tanh u) = s and sech^2(u) = 4 s (1 - s).
// With e and d as above, {s, 1 - s} = {d, e d} (1 - s = sigmoid(-2u), no cancelling
// subtraction), so s (1 - s) = e d^2 for either sign of u, and the second term is
// e d^2 x (2 sqrt(2/pi) + 6 sqrt(2/pi) a x^2). Its polynomial takes x clamped to [-20, 20]: past
// |x| ~ 12 its factor e d^2 is exactly 0 (exp of below -104), and the clamp keeps x^2 from
// overflowing to inf there (0 * inf would make the derivative NaN).
#define MN__GELU_D0 (-MN__GELU_C0)          // 2 sqrt(2/pi)
#define MN__GELU_D1 0.21406444881780076f    // 6 sqrt(2/pi) 0.044715
MN__INLINE float mn__gelu_grad(float x) {
    float e = mn__expf(mn__gelu_arg(x)), d = 1.0f / (1.0f + e), ed = e * d;
    float s = x >= 0.0f ? d : ed, xc = x > -20.0f ? (x < 20.0f ? x : 20.0f) : -20.0f;
    return s + (ed * d) * (xc * MN__FMA(xc * xc, MN__GELU_D1, MN__GELU_D0));
}

// Argument checks of the ops: an array that is needed must not be NULL, a width that divides
// must not be 0, and a shape's element count (a * b * c floats) must fit size_t; else
// MN_ERR_INVALID_ARG before anything is written. Aliasing and array lengths cannot be checked
// from here: they are the caller's part (the comments at each declaration state them).
MN__PRIVATE int mn__ops_fits(size_t a, size_t b, size_t c) {
    size_t lim = MN__FLOATS_MAX;
    if (a && b > lim / a) return 0;
    if (a != 0 && b != 0 && c > lim / (a * b)) return 0;
    return 1;
}

// ---- matmul -------------------------------------------------------------------------------------

// The storage types of the matmuls' inp and weight: fp32 (0 or MN_FP32), MN_FP16, MN_BF16.
MN__PRIVATE int mn__matmul_dtype(mn_dtype dt) {
    return dt == MN_DTYPE_DEFAULT || dt == MN_FP32 || dt == MN_FP16 || dt == MN_BF16;
}

MNIMPL mn_result mn_matmul_forward(float *out, float *pre_gelu, const float *inp,
                                   const float *weight, const float *bias, size_t N, size_t C,
                                   size_t OC) {
    return mn_matmul_forward_typed(out, pre_gelu, inp, weight, bias, N, C, OC, MN_FP32);
}

MNIMPL mn_result mn_matmul_backward(float *dinp, float *dweight, float *dbias, float *dout,
                                    const float *inp, const float *weight, const float *pre_gelu,
                                    size_t N, size_t C, size_t OC) {
    return mn_matmul_backward_typed(dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC,
                                    MN_FP32);
}

MNIMPL mn_result mn_matmul_forward_typed(float *out, float *pre_gelu, const void *inp,
                                         const void *weight, const float *bias, size_t N,
                                         size_t C, size_t OC, mn_dtype dtype) {
    // y[n,o] = b[o] + sum_c x[n,c] w[o,c]; the GEMM runs into pre_gelu when the epilogue is on,
    // then out = gelu(pre_gelu) (cuBLASLt CUBLASLT_EPILOGUE_GELU_AUX_BIAS semantics).
    float *y = pre_gelu ? pre_gelu : out;
    mn__gemm g;
    mn_result r;
    size_t n;
    if (!out || !inp || !weight || !mn__ops_fits(N, C, 1) || !mn__ops_fits(N, OC, 1) ||
        !mn__ops_fits(OC, C, 1) || !mn__matmul_dtype(dtype))
        return MN_ERR_INVALID_ARG;
    g.c = y, g.ldc = OC, g.init = 1, g.bias = bias;  // y = bias + the product (no fill pass)
    g.a = inp, g.a_rs = C, g.a_cs = 1;        // A(n, c) = inp[n, c]
    g.b = weight, g.b_rs = 1, g.b_cs = C;     // B(c, o) = weight[o, c]
    g.M = N, g.NC = OC, g.K = C, g.a_dt = g.b_dt = dtype;
    r = mn__gemm_run(&g);
    if (r != MN_OK) return r;
    if (pre_gelu) {
        MN__OMP_FOR_WORK(N * OC, MN__OMP_MIN_ELEMS, N)
        for (n = 0; n < N; n++) {
            size_t o;
            for (o = 0; o < OC; o++) out[n * OC + o] = mn__gelu(pre_gelu[n * OC + o]);
        }
    }
    return MN_OK;
}

MNIMPL mn_result mn_matmul_backward_typed(float *dinp, float *dweight, float *dbias, float *dout,
                                          const void *inp, const void *weight,
                                          const float *pre_gelu, size_t N, size_t C, size_t OC,
                                          mn_dtype dtype) {
    // dpre = dout * gelu'(pre) (fused epilogue); dx[n,c] += sum_o dpre[n,o] w[o,c];
    // dw[o,c] += sum_n dpre[n,o] x[n,c]; db[o] += sum_n dpre[n,o] (llm.c matmul_backward).
    mn__gemm g;
    mn_result r;
    size_t n;
    if (!dout || (dinp && !weight) || (dweight && !inp) || (pre_gelu && !dout) ||
        !mn__ops_fits(N, C, 1) || !mn__ops_fits(N, OC, 1) || !mn__ops_fits(OC, C, 1) ||
        !mn__matmul_dtype(dtype))
        return MN_ERR_INVALID_ARG;
    if (pre_gelu) {
        MN__OMP_FOR_WORK(N * OC, MN__OMP_MIN_ELEMS, N)
        for (n = 0; n < N; n++) {
            size_t o;
            for (o = 0; o < OC; o++) dout[n * OC + o] *= mn__gelu_grad(pre_gelu[n * OC + o]);
        }
    }
    if (dinp) {
        g.c = dinp, g.ldc = C;
        g.a = dout, g.a_rs = OC, g.a_cs = 1;      // A(n, o) = dpre[n, o]
        g.b = weight, g.b_rs = C, g.b_cs = 1;     // B(o, c) = weight[o, c]
        g.M = N, g.NC = C, g.K = OC, g.a_dt = MN_FP32, g.b_dt = dtype, g.init = 0, g.bias = NULL;
        r = mn__gemm_run(&g);
        if (r != MN_OK) return r;
    }
    if (dweight) {
        g.c = dweight, g.ldc = C;
        g.a = dout, g.a_rs = 1, g.a_cs = OC;      // A(o, n) = dpre[n, o]
        g.b = inp, g.b_rs = C, g.b_cs = 1;        // B(n, c) = inp[n, c]
        g.M = OC, g.NC = C, g.K = N, g.a_dt = MN_FP32, g.b_dt = dtype, g.init = 0, g.bias = NULL;
        r = mn__gemm_run(&g);
        if (r != MN_OK) return r;
    }
    if (dbias) {
        // columns in blocks of 64 per thread; each block sums the rows in order
        size_t blk, nblk = (OC + 63) / 64;
        MN__OMP_FOR_WORK(N * OC, MN__OMP_MIN_ELEMS, nblk)
        for (blk = 0; blk < nblk; blk++) {
            size_t o0 = blk * 64, o1 = OC - o0 > 64 ? o0 + 64 : OC, o, r;
            float acc[64];
            for (o = o0; o < o1; o++) acc[o - o0] = 0.0f;
            for (r = 0; r < N; r++) {
                const float *row = dout + r * OC;
                for (o = o0; o < o1; o++) acc[o - o0] += row[o];
            }
            for (o = o0; o < o1; o++) dbias[o] += acc[o - o0];
        }
    }
    return MN_OK;
}

// ---- layernorm / RMSNorm ------------------------------------------------------------------------

// One row of the layernorm forward (mean and rstd NULL: not kept); nt: the row is computed into
// an L1 chunk and streamed (C <= MN__NT_CHUNK).
// rms: the RMSNorm's row (mean 0, no bias: x - 0 is x, so y = x r w and v = mean(x^2)).
MN__PRIVATE void mn__layernorm_row(float *y, float *mean, float *rstd, const float *x,
                                   const float *weight, const float *bias, size_t C, float eps,
                                   int nt, int rms) {
    float buf[MN__NT_CHUNK], *o = nt ? buf : y;
    float m = rms ? 0.0f : mn__sum(x, C) / (float)C;
    float v = mn__sumsq_centered(x, m, C) / (float)C;
    float s = 1.0f / sqrtf(v + eps);
    size_t i;
    if (bias) for (i = 0; i < C; i++) o[i] = (x[i] - m) * s * weight[i] + bias[i];
    else for (i = 0; i < C; i++) o[i] = (x[i] - m) * s * weight[i];
    if (nt) mn__nt_copy(y, buf, 1.0f, C);
    if (mean) *mean = m;
    if (rstd) *rstd = s;
}

// The layernorm forward, or with rms the RMSNorm's (mean and bias NULL).
MN__PRIVATE mn_result mn__norm_forward(float *out, float *mean, float *rstd, const float *inp,
                                       const float *weight, const float *bias, size_t N, size_t C,
                                       float eps, int rms) {
    size_t part, parts;
    int big, nt, pf;
    if (!out || !inp || !weight || C == 0 || !mn__ops_fits(N, C, 1)) return MN_ERR_INVALID_ARG;
    big = mn__nt_big(N, C), nt = big && mn__nt_want(out), pf = big && mn__pf_ahead();
    parts = mn__nt_parts((uint64_t)N * C);
    MN__OMP_FOR_WORK(N * C, MN__OMP_MIN_ELEMS, parts)
    for (part = 0; part < parts; part++) {
        size_t n, n1 = mn__part_start(N, parts, part + 1);
        for (n = mn__part_start(N, parts, part); n < n1; n++) {
            if (pf && n + MN__PF_ROWS < N) mn__prefetch(inp + (n + MN__PF_ROWS) * C, C);
            mn__layernorm_row(out + n * C, mean ? mean + n : NULL, rstd ? rstd + n : NULL,
                              inp + n * C, weight, bias, C, eps, nt, rms);
        }
        if (nt) mn__nt_fence();
    }
    return MN_OK;
}

MNIMPL mn_result mn_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                      const float *weight, const float *bias, size_t N, size_t C,
                                      float eps) {
    // mu = mean(x), var = mean((x - mu)^2) (biased), r = 1/sqrt(var + eps);
    // y = (x - mu) r w + b (llm.c train_gpt2.c layernorm_forward; two-pass variance).
    // A large call with rows that fit an L1 chunk streams its output and asks for a row
    // MN__PF_ROWS ahead as it starts one where mn__pf_ahead says so (>>ops streaming stores); the
    // threads claim parts of rows.
    return mn__norm_forward(out, mean, rstd, inp, weight, bias, N, C, eps, 0);
}

// The two means of a row of the layernorm backward: *gm = mean(g), *gxm = mean(g xh), g = w dy,
// xh = (x - m) r, from MN__LN float lanes folded in double.
MN__PRIVATE void mn__layernorm_dx_means(float *gm, float *gxm, const float *dy, const float *x,
                                        const float *w, float m, float r, size_t C) {
    float ag[MN__LN] = {0}, agx[MN__LN] = {0};
    double sg = 0.0, sgx = 0.0;
    size_t i = 0;
    int l;
    for (; C - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN; l++) {
            float g = w[i + l] * dy[i + l], xh = (x[i + l] - m) * r;
            ag[l] += g;
            agx[l] = MN__FMA(g, xh, agx[l]);
        }
    for (; i < C; i++) {
        float g = w[i] * dy[i];
        sg += g;
        sgx += (double)g * ((x[i] - m) * r);
    }
    for (l = 0; l < MN__LN; l++) sg += ag[l], sgx += agx[l];
    *gm = (float)(sg / (double)C), *gxm = (float)(sgx / (double)C);
}

// Asks for the next row of a norm's backward: x, dy and, when wanted, dinp's row at offset o.
MN__INLINE void mn__prefetch_bwd_row(const float *x, const float *dy, const float *dinp, size_t o,
                                     size_t C) {
    mn__prefetch(x, C);
    mn__prefetch(dy, C);
    if (dinp) mn__prefetch(dinp + o, C);
}

// One row of the layernorm backward: dx += r (g - mean(g) - xh mean(g xh)), g = w dy,
// xh = (x - m) r.
MN__PRIVATE void mn__layernorm_dx_row(float *dx, const float *dy, const float *x, const float *w,
                                      float m, float r, size_t C) {
    float gm, gxm;
    size_t i;
    mn__layernorm_dx_means(&gm, &gxm, dy, x, w, m, r, C);
    for (i = 0; i < C; i++) {
        float g = w[i] * dy[i], xh = (x[i] - m) * r;  // g and xh rounded as in the sums
        dx[i] += r * (g - gm - xh * gxm);
    }
}

#if MN__OV
// One row of the layernorm backward and the row's share of dweight and dbias (either NULL: not
// wanted) in one pass after the means: the values of mn__layernorm_dx_row and
// mn__layernorm_dwb_row, each element computed by the same operations in the same order (vector
// lanes written out: the compiler does not vectorize a loop that stores to four arrays which it
// must assume may overlap).
MN__PRIVATE void mn__layernorm_bwd_row(float *dx, float *dweight, float *dbias, const float *dy,
                                       const float *x, const float *w, float m, float r,
                                       size_t C) {
    float gm, gxm;
    mn__ovf vm, vr, vgm, vgxm;
    size_t i = 0;
    mn__layernorm_dx_means(&gm, &gxm, dy, x, w, m, r, C);
    vm = mn__ov_set1(m), vr = mn__ov_set1(r), vgm = mn__ov_set1(gm), vgxm = mn__ov_set1(gxm);
    for (; C - i >= MN__OW; i += MN__OW) {
        mn__ovf d = mn__ov_load(dy + i), g = mn__ov_load(w + i) * d;
        mn__ovf xh = (mn__ov_load(x + i) - vm) * vr;
        mn__ov_store(dx + i, mn__ov_load(dx + i) + vr * (g - vgm - xh * vgxm));
        if (dweight) mn__ov_store(dweight + i, mn__ov_load(dweight + i) + d * xh);
        if (dbias) mn__ov_store(dbias + i, mn__ov_load(dbias + i) + d);
    }
    for (; i < C; i++) {
        float g = w[i] * dy[i], xh = (x[i] - m) * r;
        dx[i] += r * (g - gm - xh * gxm);
        if (dweight) dweight[i] += dy[i] * xh;
        if (dbias) dbias[i] += dy[i];
    }
}
#endif

// One row's share of the parameter gradients over columns [c0, c1), added straight into dweight
// and dbias as llm.c's layernorm_backward does: every column sums its rows in row order, whichever
// loop (this one after the row above or fused with it in mn__layernorm_bwd_row, or by column
// blocks) runs it, so the bits are the same.
MN__PRIVATE void mn__layernorm_dwb_row(float *dweight, float *dbias, const float *dy,
                                       const float *x, float m, float r, size_t c0, size_t c1) {
    size_t i;
    if (dweight)
        for (i = c0; i < c1; i++) dweight[i] += dy[i] * ((x[i] - m) * r);
    if (dbias)
        for (i = c0; i < c1; i++) dbias[i] += dy[i];
}

MNIMPL mn_result mn_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                       const float *inp, const float *weight, const float *mean,
                                       const float *rstd, size_t N, size_t C) {
    // xh = (x - mu) r, g = w dy; dx += r (g - mean(g) - xh mean(g xh));
    // dw += sum_n dy xh, db += sum_n dy (llm.c train_gpt2.c layernorm_backward).
    size_t n, part;
    int team = 1;
    if (!dout || !inp || !mean || !rstd || C == 0 || (dinp && !weight) || !mn__ops_fits(N, C, 1))
        return MN_ERR_INVALID_ARG;
#ifdef _OPENMP
    team = mn__omp_team((uint64_t)N * C, MN__OMP_MIN_ELEMS);
#endif
    // One row at a time on one thread, while the row is in cache, for dinp and the parameters
    // (dout and inp read once from memory). A team reads them twice (rows for dinp, then columns
    // for the parameters): 1.5x the bytes, so two threads gain at best 1.33x on an idle machine
    // (and lost 3x to one thread on a loaded one); a team starts from three threads.
    // With vector lanes, one pass over the row gives dx, dweight and dbias after the pass for
    // the means (mn__layernorm_bwd_row). A large call asks for the next row of dout, inp and
    // dinp as it starts one (mn__prefetch, where mn__pf_ahead says so: not on Zen 4, where it
    // cost): three rows, as many bytes ahead as the forward's
    // MN__PF_ROWS and more. Two rows ahead was slower, asking for dinp's lines for writing no
    // faster, and streaming dinp slower (the pass reads its lines before it writes them).
    // (8192 x 768, one Zen 5 core: 0.67-0.71 of memcpy's bytes per second before,
    // 0.89-1.03 after; the prefetch alone gave 0.77, the fused pass alone no gain.)
    if (team <= 2) {
        int pf = mn__nt_big(N, C) && mn__pf_ahead();
        for (n = 0; n < N; n++) {
            const float *x = inp + n * C, *dy = dout + n * C;
            if (pf && n + 1 < N) mn__prefetch_bwd_row(x + C, dy + C, dinp, (n + 1) * C, C);
#if MN__OV
            if (dinp) {
                mn__layernorm_bwd_row(dinp + n * C, dweight, dbias, dy, x, weight, mean[n],
                                      rstd[n], C);
                continue;
            }
#else
            if (dinp) mn__layernorm_dx_row(dinp + n * C, dy, x, weight, mean[n], rstd[n], C);
#endif
            mn__layernorm_dwb_row(dweight, dbias, dy, x, mean[n], rstd[n], 0, C);
        }
        return MN_OK;
    }
    if (dinp) {
        MN__OMP_FOR_WORK(N * C, MN__OMP_MIN_ELEMS, N)
        for (n = 0; n < N; n++)
            mn__layernorm_dx_row(dinp + n * C, dout + n * C, inp + n * C, weight, mean[n], rstd[n],
                                 C);
    }
    if (!dweight && !dbias) return MN_OK;
    // parameter gradients: one contiguous range of columns per thread (long runs of each row,
    // which the prefetcher follows), rows summed in order
    MN__OMP_FOR_WORK(N * C, MN__OMP_MIN_ELEMS, (size_t)team)
    for (part = 0; part < (size_t)team; part++) {
        size_t c0 = C / (size_t)team * part, c1 = C / (size_t)team * (part + 1), r;
        if (part + 1 == (size_t)team) c1 = C;
        for (r = 0; r < N; r++)
            mn__layernorm_dwb_row(dweight, dbias, dout + r * C, inp + r * C, mean[r], rstd[r], c0,
                                  c1);
    }
    return MN_OK;
}

MNIMPL mn_result mn_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                                    size_t N, size_t C, float eps) {
    // r = 1/sqrt(mean(x^2) + eps); y = x r w (Zhang & Sennrich 2019, "Root Mean Square Layer
    // Normalization", eq. 4; as in LLaMA's RMSNorm): the layernorm forward's loop with mean 0.
    return mn__norm_forward(out, NULL, rstd, inp, weight, NULL, N, C, eps, 1);
}

// mean(g xh) of a row of the RMSNorm backward, g = w dy, xh = x r, from MN__LN float lanes
// folded in double.
MN__PRIVATE float mn__rmsnorm_gxm(const float *dy, const float *x, const float *w, float r,
                                  size_t C) {
    float agx[MN__LN] = {0};
    double sgx = 0.0;
    size_t i = 0;
    int l;
#if MN__OV  // the same lanes on vectors (as mn__sumsq_centered)
    mn__ovf va[MN__LN / MN__OW] = {{0}};
    for (; C - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN / MN__OW; l++) {
            size_t k = i + (size_t)l * MN__OW;
            va[l] = MN__OFMA(mn__ov_load(w + k) * mn__ov_load(dy + k), mn__ov_load(x + k) * r,
                             va[l]);
        }
    for (l = 0; l < MN__LN / MN__OW; l++) mn__ov_store(agx + l * MN__OW, va[l]);
#else
    for (; C - i >= MN__LN; i += MN__LN)
        for (l = 0; l < MN__LN; l++) agx[l] = MN__FMA(w[i + l] * dy[i + l], x[i + l] * r, agx[l]);
#endif
    for (; i < C; i++) sgx += (double)(w[i] * dy[i]) * (x[i] * r);
    for (l = 0; l < MN__LN; l++) sgx += agx[l];
    return (float)(sgx / (double)C);
}
MN__PRIVATE void mn__rmsnorm_dx_row(float *dx, const float *dy, const float *x, const float *w,
                                    float r, size_t C) {
    float gxm = mn__rmsnorm_gxm(dy, x, w, r, C);  // dx += r (g - xh mean(g xh))
    size_t i;
    for (i = 0; i < C; i++) {
        float g = w[i] * dy[i];
        dx[i] += r * (g - (x[i] * r) * gxm);
    }
}

#if MN__OV
// One row of the RMSNorm backward and the row's share of dweight (NULL: not wanted) in one pass
// after the mean: the values of mn__rmsnorm_dx_row and mn__rmsnorm_dw_row, each element computed
// by the same operations in the same order (as mn__layernorm_bwd_row).
MN__PRIVATE void mn__rmsnorm_bwd_row(float *dx, float *dweight, const float *dy, const float *x,
                                     const float *w, float r, size_t C) {
    float gxm = mn__rmsnorm_gxm(dy, x, w, r, C);
    mn__ovf vr = mn__ov_set1(r), vgxm = mn__ov_set1(gxm);
    size_t i = 0;
    for (; C - i >= MN__OW; i += MN__OW) {
        mn__ovf d = mn__ov_load(dy + i), g = mn__ov_load(w + i) * d;
        mn__ovf xh = mn__ov_load(x + i) * vr;  // (g and xh rounded as in the scalar form)
        mn__ov_store(dx + i, mn__ov_load(dx + i) + vr * (g - xh * vgxm));
        if (dweight) mn__ov_store(dweight + i, mn__ov_load(dweight + i) + d * xh);
    }
    for (; i < C; i++) {
        float g = w[i] * dy[i], xh = x[i] * r;
        dx[i] += r * (g - xh * gxm);
        if (dweight) dweight[i] += dy[i] * xh;
    }
}
#endif

// One row's share of dweight over columns [c0, c1), added straight in, rows in order (as
// mn__layernorm_dwb_row).
MN__PRIVATE void mn__rmsnorm_dw_row(float *dweight, const float *dy, const float *x, float r,
                                    size_t c0, size_t c1) {
    size_t i;
    for (i = c0; i < c1; i++) dweight[i] += dy[i] * (x[i] * r);
}

MNIMPL mn_result mn_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                                     const float *inp, const float *weight, const float *rstd,
                                     size_t N, size_t C) {
    // xh = x r, g = w dy; dx += r (g - xh mean(g xh)); dw += sum_n dy xh
    // (the layernorm backward without the mean terms; derivation in Zhang & Sennrich 2019).
    // One pass over the rows for both gradients; with three or more threads, rows for dinp, then
    // one contiguous column range per thread for dweight (the same order per column, so the same
    // bits). On one thread, as mn_layernorm_backward: with vector lanes dx and dweight in one
    // pass after the mean (mn__rmsnorm_bwd_row), and a large call asks for the next row of dout,
    // inp and dinp as it starts one (where mn__pf_ahead says so).
    size_t n, part;
    int team = 1;
    if (!dout || !inp || !rstd || C == 0 || (dinp && !weight) || !mn__ops_fits(N, C, 1))
        return MN_ERR_INVALID_ARG;
#ifdef _OPENMP
    team = mn__omp_team((uint64_t)N * C, MN__OMP_MIN_ELEMS);
#endif
    if (team <= 2) {  // one thread, one pass (the threshold of mn_layernorm_backward)
        int pf = mn__nt_big(N, C) && mn__pf_ahead();
        for (n = 0; n < N; n++) {
            const float *x = inp + n * C, *dy = dout + n * C;
            if (pf && n + 1 < N) mn__prefetch_bwd_row(x + C, dy + C, dinp, (n + 1) * C, C);
#if MN__OV
            if (dinp) {
                mn__rmsnorm_bwd_row(dinp + n * C, dweight, dy, x, weight, rstd[n], C);
                continue;
            }
#else
            if (dinp) mn__rmsnorm_dx_row(dinp + n * C, dy, x, weight, rstd[n], C);
#endif
            if (dweight) mn__rmsnorm_dw_row(dweight, dy, x, rstd[n], 0, C);
        }
        return MN_OK;
    }
    if (dinp) {
        MN__OMP_FOR_WORK(N * C, MN__OMP_MIN_ELEMS, N)
        for (n = 0; n < N; n++)
            mn__rmsnorm_dx_row(dinp + n * C, dout + n * C, inp + n * C, weight, rstd[n], C);
    }
    if (!dweight) return MN_OK;
    MN__OMP_FOR_WORK(N * C, MN__OMP_MIN_ELEMS, (size_t)team)
    for (part = 0; part < (size_t)team; part++) {
        size_t c0 = C / (size_t)team * part, c1 = C / (size_t)team * (part + 1), r;
        if (part + 1 == (size_t)team) c1 = C;
        for (r = 0; r < N; r++)
            mn__rmsnorm_dw_row(dweight, dout + r * C, inp + r * C, rstd[r], c0, c1);
    }
    return MN_OK;
}

// ---- softmax ------------------------------------------------------------------------------------

// Rows n..n1 of a softmax over rows of L floats without the mask, whose output is streamed
// (the large softmax forward, and the cross-entropy forward with probs): each row's
// exponentials go to buf (L + MN__NT_ROW_PAD floats: an L1 chunk, or a scratch row in L2), and the pass that computes them also streams the row before from there, scaled, and
// finds the max of the row after (mn__nt_row_pass; the same values as the loop row by row).
// With losses, the rows' cross-entropy losses as well (logsumexp - x[target], 0 where the
// target is negative). The caller fences the stores.
MN__PRIVATE void mn__nt_softmax_rows(float *out, const float *inp, size_t N, size_t L,
                                     float scale, size_t n, size_t n1, float *buf, float *losses,
                                     const int *targets) {
    float mnext = 0.0f, inv = 0.0f, *e = NULL;
    if (n >= n1) return;
    mn__nt_row_pass(NULL, NULL, scale, 0.0f, NULL, NULL, 0.0f, inp + n * L, (N - n) * L,
                    &mnext, L);
    for (; n < n1; n++) {  // mx found with the row before; this row's output with the next
        const float *x = inp + n * L;
        float *y = out + n * L, *prev = e, mx = mnext;
        double sum;
        e = mn__nt_row_at(buf, y, L);
        sum = mn__nt_row_pass(e, x, scale, mx, prev ? y - L : NULL, prev, inv,
                              n + 1 < n1 ? x + L : NULL, (N - n - 1) * L, &mnext, L);
        inv = (float)(1.0 / sum);
        if (losses) losses[n] = targets[n] < 0 ? 0.0f : (float)(log(sum) - (x[targets[n]] - mx));
    }
    mn__nt_copy(out + (n1 - 1) * L, e, inv, L);
}

MNIMPL mn_result mn_softmax_forward(float *out, const float *inp, size_t N, size_t L, float scale,
                                    int causal) {
    // z = scale x; p_j = exp(z_j - max z) / sum_k exp(z_k - max z) over the unmasked j
    // (max subtracted for range safety; llm.c train_gpt2.c attention_forward / softmax_forward).
    // A large call with rows that fit an L1 chunk computes each row there and streams it
    // (>>ops streaming stores): without the mask, in one pass with the max of the row after
    // and the stores of the row before (mn__nt_softmax_rows: 1.3x measured, one Zen 5 core,
    // 8192 rows of 768); with it, row by row, asking for a row MN__PF_ROWS ahead as it starts
    // one.
    size_t part, parts;
    int big, nt;
    if (!out || !inp || L == 0 || !mn__ops_fits(N, L, 1)) return MN_ERR_INVALID_ARG;
    big = mn__nt_big(N, L), nt = big && mn__nt_want(out);
    parts = mn__nt_parts((uint64_t)N * L);
    MN__OMP_FOR_WORK(N * L, MN__OMP_MIN_ELEMS, parts)
    for (part = 0; part < parts; part++) {
        size_t n = mn__part_start(N, parts, part), n1 = mn__part_start(N, parts, part + 1);
        float buf[MN__NT_CHUNK + MN__NT_ROW_PAD];
        if (nt && !causal)
            mn__nt_softmax_rows(out, inp, N, L, scale, n, n1, buf, NULL, NULL);
        else for (; n < n1; n++) {
            const float *x = inp + n * L;
            float *y = out + n * L, *p = nt ? buf : y, mx, inv;
            size_t len = causal ? n % L + 1 : L, j;
            if (big && n + MN__PF_ROWS < N) mn__prefetch(x + MN__PF_ROWS * L, L);
            mx = mn__max_scaled(x, scale, len);
            inv = (float)(1.0 / mn__exp_store_sum(p, x, scale, mx, len, NULL));
            if (nt && len == L) {  // scaled on the way out
                mn__nt_copy(y, buf, inv, L);
                continue;
            }
            for (j = 0; j < len; j++) p[j] *= inv;
            for (; j < L; j++) p[j] = 0.0f;
            if (nt) mn__nt_copy(y, buf, 1.0f, L);
        }
        if (nt) mn__nt_fence();
    }
    return MN_OK;
}

MNIMPL mn_result mn_softmax_backward(float *dinp, const float *dout, const float *out, size_t N,
                                     size_t L, float scale, int causal) {
    // dz_j = p_j (dy_j - sum_k p_k dy_k); dx_j += scale dz_j (softmax Jacobian diag(p) - p p^T).
    size_t n;
    if (!dinp || !dout || !out || L == 0 || !mn__ops_fits(N, L, 1)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(N * L, MN__OMP_MIN_ELEMS, N)
    for (n = 0; n < N; n++) {
        const float *p = out + n * L, *dy = dout + n * L;
        float *dx = dinp + n * L;
        size_t len = causal ? n % L + 1 : L, j;
        float d = mn__dot(p, dy, len);
        for (j = 0; j < len; j++) dx[j] += scale * (p[j] * (dy[j] - d));
    }
    return MN_OK;
}

// ---- attention ----------------------------------------------------------------------------------
//
// Per (b, h) and query t: s_j = q_t . k_j / sqrt(hs) over the visible keys j, p = softmax(s),
// out_t = sum_j p_j v_j (Vaswani et al. 2017). Backward in the FlashAttention form (Dao et al.
// 2022, algorithm 4): dp_j = dout_t . v_j, D_t = sum_j p_j dp_j, ds_j = p_j (dp_j - D_t);
// dq_t += ds_j k_j / sqrt(hs), dk_j += ds_j q_t / sqrt(hs), dv_j += p_j dout_t.
// The work is tiled: MN__AQ queries x MN__AK keys of scores live in a stack tile, never a T x T
// matrix, and every product is a small GEMM on the register-tiled core. Row statistics (max and
// 1/sum) come from one pass over the key tiles with the running-max rescaling of online softmax
// (Milakov & Gimelshein 2018); the probabilities from a second pass. Forward and backward build
// every score and probability with the same code in the same order, so probabilities kept by the
// forward and recomputed by the backward are the same floats. Threads own (b, h) pairs, whose
// gradient slices are disjoint.

#define MN__AQ 32  // queries per tile
#define MN__AK 64  // keys per tile
#define MN__AC 4   // key tiles whose scores (and dp) a query tile keeps on the stack (T <= 256)

typedef struct mn__att {
    const float *q, *k, *v;  // this (b, h): position t of each at + t * stride
    const float *dout;       // [T, C] rows of this b, offset to head h (backward only)
    size_t stride, dstride;  // 3C, C
    size_t T, hs;
    int causal;
    float scale;             // 1/sqrt(hs)
} mn__att;

// Keys visible to query t0 + i within the key tile starting at j0 (of nk keys).
MN__PRIVATE int mn__att_visible(const mn__att *a, size_t t0, int i, size_t j0, int nk) {
    size_t end = t0 + (size_t)i + 1;  // the query sees keys [0, end)
    if (!a->causal) return nk;
    return end > j0 ? mn__tile_len(end - j0, nk) : 0;
}

// out[i][j] = x_{t0+i} . y_{j0+j} over hs channels, for i < nq, j < nk (0 past nk): a small
// GEMM, x rows at x + t * xs, y rows at y + j * ys.
MN__PRIVATE void mn__att_dots(const float *x, size_t xs, size_t t0, int nq, const float *y,
                              size_t ys, size_t j0, int nk, size_t hs,
                              float out[MN__AQ][MN__AK]) {
    int i, j;
    for (i = 0; i < nq; i++)
        for (j = 0; j < MN__AK; j++) out[i][j] = 0.0f;
    mn__gemm_acc(&out[0][0], MN__AK, x + t0 * xs, xs, 1, y + j0 * ys, 1, ys, (size_t)nq,
                 (size_t)nk, hs);
}

// Scores of a tile: s[i][j] = scale q_{t0+i} . k_{j0+j}.
MN__PRIVATE void mn__att_scores(const mn__att *a, size_t t0, int nq, size_t j0, int nk,
                                float s[MN__AQ][MN__AK]) {
    int i, j;
    mn__att_dots(a->q, a->stride, t0, nq, a->k, a->stride, j0, nk, a->hs, s);
    for (i = 0; i < nq; i++)
        for (j = 0; j < MN__AK; j++) s[i][j] *= a->scale;
}

// Last key (exclusive) any query of the tile [t0, t0+nq) sees.
MN__PRIVATE size_t mn__att_kend(const mn__att *a, size_t t0, int nq) {
    return a->causal ? t0 + (size_t)nq : a->T;
}

// Row statistics of the query tile: mx[i] = max_j s_ij, inv[i] = 1 / sum_j exp(s_ij - mx[i]).
// keep non-NULL (the query tile sees at most MN__AC key tiles): the score tiles are kept there.
MN__PRIVATE void mn__att_stats(const mn__att *a, size_t t0, int nq, float *mx, float *inv,
                               float (*keep)[MN__AQ][MN__AK]) {
    float tile[MN__AQ][MN__AK];
    double l[MN__AQ];
    size_t j0, kend = mn__att_kend(a, t0, nq);
    int i, j, nk;
    for (i = 0; i < nq; i++) mx[i] = -INFINITY, l[i] = 0.0;
    for (j0 = 0; j0 < kend; j0 += MN__AK) {
        float (*s)[MN__AK] = keep ? keep[j0 / MN__AK] : tile;
        nk = mn__tile_len(kend - j0, MN__AK);
        mn__att_scores(a, t0, nq, j0, nk, s);
        for (i = 0; i < nq; i++) {
            int vis = mn__att_visible(a, t0, i, j0, nk);
            float bm = -INFINITY;
            if (vis == 0) continue;
            for (j = 0; j < vis; j++) bm = s[i][j] > bm ? s[i][j] : bm;
            if (bm > mx[i]) {
                if (l[i] > 0.0) l[i] *= mn__expf(mx[i] - bm);
                mx[i] = bm;
            }
            l[i] += mn__sumexp(s[i], mx[i], (size_t)vis);
        }
    }
    for (i = 0; i < nq; i++) inv[i] = (float)(1.0 / l[i]);
}

// Probabilities of a tile: p[i][j] for visible keys, 0 for masked ones and the padding. kept:
// the tile's scores from mn__att_stats, or NULL to compute them again (the same floats).
MN__PRIVATE void mn__att_probs(const mn__att *a, size_t t0, int nq, size_t j0, int nk,
                               const float *mx, const float *inv, float p[MN__AQ][MN__AK],
                               float (*kept)[MN__AK]) {
    int i, j;
    if (!kept) mn__att_scores(a, t0, nq, j0, nk, p);
    else if (kept != p) memcpy(p, kept, (size_t)nq * sizeof p[0]);
    for (i = 0; i < nq; i++) {
        int vis = mn__att_visible(a, t0, i, j0, nk);
        float m = mx[i], iv = inv[i], *row = p[i];
        for (j = 0; j < vis; j++) row[j] = mn__expf(row[j] - m) * iv;
        for (; j < MN__AK; j++) row[j] = 0.0f;
    }
}

// The same tile read back from the kept probabilities att [T, T] of this (b, h).
MN__PRIVATE void mn__att_probs_kept(const float *att, size_t T, size_t t0, int nq, size_t j0,
                                    int nk, float p[MN__AQ][MN__AK]) {
    int i, j;
    for (i = 0; i < nq; i++) {
        const float *row = att + (t0 + (size_t)i) * T + j0;
        for (j = 0; j < nk; j++) p[i][j] = row[j];
        for (; j < MN__AK; j++) p[i][j] = 0.0f;
    }
}

MN__PRIVATE void mn__att_forward_bh(const mn__att *a, float *out, size_t os,
                                                 float *att) {
    float p[MN__AQ][MN__AK], mx[MN__AQ], inv[MN__AQ], sk[MN__AC][MN__AQ][MN__AK];
    size_t t0, j0, j, d, kend;
    int nq, nk, i, keep;
    for (t0 = 0; t0 < a->T; t0 += MN__AQ) {
        nq = mn__tile_len(a->T - t0, MN__AQ);
        kend = mn__att_kend(a, t0, nq);
        keep = kend <= (size_t)MN__AC * MN__AK;
        mn__att_stats(a, t0, nq, mx, inv, keep ? sk : NULL);
        for (i = 0; i < nq; i++)
            for (d = 0; d < a->hs; d++) out[(t0 + (size_t)i) * os + d] = 0.0f;
        for (j0 = 0; j0 < kend; j0 += MN__AK) {
            nk = mn__tile_len(kend - j0, MN__AK);
            mn__att_probs(a, t0, nq, j0, nk, mx, inv, p, keep ? sk[j0 / MN__AK] : NULL);
            if (att)
                for (i = 0; i < nq; i++)
                    memcpy(att + (t0 + (size_t)i) * a->T + j0, p[i], (size_t)nk * sizeof(float));
            // out_tile += p v_tile
            mn__gemm_acc(out + t0 * os, os, &p[0][0], MN__AK, 1, a->v + j0 * a->stride, a->stride,
                         1, (size_t)nq, a->hs, (size_t)nk);
        }
        if (att)  // keys no query of this tile sees
            for (i = 0; i < nq; i++)
                for (j = kend; j < a->T; j++) att[(t0 + (size_t)i) * a->T + j] = 0.0f;
    }
}

MN__PRIVATE void mn__att_backward_bh(const mn__att *a, float *dq, float *dk, float *dv,
                                                  const float *att) {
    // with at most MN__AC key tiles in view, pass 0 leaves each tile's p and dp on the stack for
    // pass 1; otherwise pass 1 computes them again (the same floats either way)
    float p[MN__AQ][MN__AK], dp[MN__AQ][MN__AK], mx[MN__AQ], inv[MN__AQ], D[MN__AQ];
    float pk[MN__AC][MN__AQ][MN__AK], dpk[MN__AC][MN__AQ][MN__AK];
    size_t t0, j0, kend;
    int nq, nk, i, j, pass, keep;
    for (t0 = 0; t0 < a->T; t0 += MN__AQ) {
        nq = mn__tile_len(a->T - t0, MN__AQ);
        kend = mn__att_kend(a, t0, nq);
        keep = kend <= (size_t)MN__AC * MN__AK;
        if (!att) mn__att_stats(a, t0, nq, mx, inv, keep ? pk : NULL);
        for (i = 0; i < nq; i++) D[i] = 0.0f;
        // pass 0: D_i = sum_j p_ij dp_ij; pass 1: the gradients
        for (pass = 0; pass < 2; pass++) {
            for (j0 = 0; j0 < kend; j0 += MN__AK) {
                float (*pt)[MN__AK] = keep ? pk[j0 / MN__AK] : p;
                float (*dt)[MN__AK] = keep ? dpk[j0 / MN__AK] : dp;
                nk = mn__tile_len(kend - j0, MN__AK);
                if (pass == 0 || !keep) {
                    if (att) mn__att_probs_kept(att, a->T, t0, nq, j0, nk, pt);
                    else mn__att_probs(a, t0, nq, j0, nk, mx, inv, pt, keep ? pt : NULL);
                    mn__att_dots(a->dout, a->dstride, t0, nq, a->v, a->stride, j0, nk, a->hs,
                                 dt);
                }
                if (pass == 0) {
                    for (i = 0; i < nq; i++)
                        for (j = 0; j < nk; j++) D[i] += pt[i][j] * dt[i][j];
                    continue;
                }
                // dp becomes ds = p (dp - D) / sqrt(hs); masked entries have p = 0, so ds = 0
                for (i = 0; i < nq; i++)
                    for (j = 0; j < nk; j++) dt[i][j] = pt[i][j] * (dt[i][j] - D[i]) * a->scale;
                // dq_tile += ds k_tile / dk_tile += ds^T q_tile / dv_tile += p^T dout_tile
                mn__gemm_acc(dq + t0 * a->stride, a->stride, &dt[0][0], MN__AK, 1,
                             a->k + j0 * a->stride, a->stride, 1, (size_t)nq, a->hs, (size_t)nk);
                mn__gemm_acc(dk + j0 * a->stride, a->stride, &dt[0][0], 1, MN__AK,
                             a->q + t0 * a->stride, a->stride, 1, (size_t)nk, a->hs, (size_t)nq);
                mn__gemm_acc(dv + j0 * a->stride, a->stride, &pt[0][0], 1, MN__AK,
                             a->dout + t0 * a->dstride, a->dstride, 1, (size_t)nk, a->hs,
                             (size_t)nq);
            }
        }
    }
}

MN__PRIVATE void mn__att_setup(mn__att *a, const float *qkv, const float *dout, size_t b,
                               size_t h, size_t T, size_t C, size_t NH, int causal) {
    size_t hs = C / NH;
    const float *base = qkv + b * T * 3 * C + h * hs;
    a->q = base, a->k = base + C, a->v = base + 2 * C;
    a->dout = dout ? dout + b * T * C + h * hs : NULL;
    a->stride = 3 * C, a->dstride = C;
    a->T = T, a->hs = hs, a->causal = causal;
    a->scale = 1.0f / sqrtf((float)hs);
}

MNIMPL mn_result mn_attention_forward(float *out, float *att, const float *qkv, size_t B, size_t T,
                                      size_t C, size_t NH, int causal) {
    size_t bh;
    if (!out || !qkv || NH == 0 || C == 0 || C % NH != 0 ||
        !mn__ops_fits(B, T, C) || !mn__ops_fits(B * T, 3, C) ||
        (att && (!mn__ops_fits(B, NH, T) || !mn__ops_fits(B * NH, T, T))))
        return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK((uint64_t)B * T * T * C, (uint64_t)MN__OMP_MIN_FLOPS, B * NH)
    for (bh = 0; bh < B * NH; bh++) {
        size_t b = bh / NH, h = bh % NH;
        mn__att a;
        mn__att_setup(&a, qkv, NULL, b, h, T, C, NH, causal);
        mn__att_forward_bh(&a, out + b * T * C + h * a.hs, C, att ? att + bh * T * T : NULL);
    }
    return MN_OK;
}

MNIMPL mn_result mn_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                       const float *att, size_t B, size_t T, size_t C, size_t NH,
                                       int causal) {
    size_t bh;
    if (!dqkv || !dout || !qkv || NH == 0 || C == 0 || C % NH != 0 ||
        !mn__ops_fits(B, T, C) || !mn__ops_fits(B * T, 3, C) ||
        (att && (!mn__ops_fits(B, NH, T) || !mn__ops_fits(B * NH, T, T))))
        return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK((uint64_t)B * T * T * C, (uint64_t)MN__OMP_MIN_FLOPS, B * NH)
    for (bh = 0; bh < B * NH; bh++) {
        size_t b = bh / NH, h = bh % NH;
        float *dbase = dqkv + b * T * 3 * C;
        mn__att a;
        mn__att_setup(&a, qkv, dout, b, h, T, C, NH, causal);
        mn__att_backward_bh(&a, dbase + h * a.hs, dbase + C + h * a.hs, dbase + 2 * C + h * a.hs,
                            att ? att + bh * T * T : NULL);
    }
    return MN_OK;
}

// ---- elementwise --------------------------------------------------------------------------------

// out[0..n) = mn__gelu(inp[0..n)), bit for bit: MN__OW lanes at a time where the header has
// them (the same expressions on vectors, the exp through mn__ov_expf), the scalar form for the
// rest. The vector form runs in stages over chunks of MN__STAGE elements (u, then the
// exponentials, then the rest, each stage a loop over the chunk through L1): one loop over the
// whole expression is a dependency chain of some 90 cycles per vector, and the out-of-order
// window holds too few of them to keep the units busy (the stages measured 1.5x faster, with the
// same bits). nt: the output goes out through streaming stores on its aligned vectors (>>ops
// streaming stores; the caller fences). pf: inp has that many elements readable from its start
// (at least n), and each chunk asks for the one MN__PF_CHUNKS chunks ahead within them (0: none).
#define MN__STAGE 256     // elements per chunk of a staged loop (a multiple of MN__OW)
#define MN__PF_CHUNKS 4   // chunks ahead that a large GELU call asks for (best of 1, 2, 4, 8)
#if MN__OV
// *p = v through an ordinary store, or a streaming one (p aligned to MN__NT_ALIGN) where nt.
MN__INLINE void mn__ov_put(float *p, mn__ovf v, int nt) {
    if (nt) mn__ov_stream(p, v);
    else mn__ov_store(p, v);
}
// mn__gelu_arg on MN__OW lanes, the same operations.
MN__INLINE mn__ovf mn__ov_gelu_arg(mn__ovf v) {
    return mn__ov_abs(v) * MN__OFMA(v * v, mn__ov_set1(MN__GELU_C1), mn__ov_set1(MN__GELU_C0));
}
// The first two stages over x[0..n) (n a multiple of MN__OW, at most MN__STAGE):
// a = -2|u| (mn__gelu_arg), then e = exp(a), as the scalar form computes them.
MN__INLINE void mn__gelu_stage_e(float *e, const float *x, size_t n) {
    size_t j;
    for (j = 0; j < n; j += MN__OW) mn__ov_store(e + j, mn__ov_gelu_arg(mn__ov_load(x + j)));
    for (j = 0; j < n; j += MN__OW) mn__ov_store(e + j, mn__ov_expf(mn__ov_load(e + j)));
}
#endif

MN__PRIVATE void mn__gelu_span(float *out, const float *inp, size_t n, int nt, size_t pf) {
    size_t i = 0;
#if MN__OV
    float e[MN__STAGE];
    int j;
    if (nt)
        for (j = (int)mn__nt_head(out, n); i < (size_t)j; i++) out[i] = mn__gelu(inp[i]);
    for (; n - i >= MN__STAGE; i += MN__STAGE) {
        const float *x = inp + i;
        if (pf > i + (MN__PF_CHUNKS + 1) * MN__STAGE)
            mn__prefetch(x + MN__PF_CHUNKS * MN__STAGE, MN__STAGE);
        mn__gelu_stage_e(e, x, MN__STAGE);
        for (j = 0; j < MN__STAGE; j += MN__OW) {
            mn__ovf xv = mn__ov_load(x + j), ev = mn__ov_load(e + j), d = 1.0f / (1.0f + ev);
            mn__ov_put(out + i + j, xv * mn__ov_sel(xv >= 0.0f, d, ev * d), nt);
        }
    }
    for (; n - i >= MN__OW; i += MN__OW) {
        mn__ovf x = mn__ov_load(inp + i), e, d;
        e = mn__ov_expf(mn__ov_gelu_arg(x)), d = 1.0f / (1.0f + e);
        mn__ov_store(out + i, x * mn__ov_sel(x >= 0.0f, d, e * d));
    }
#endif
    (void)nt, (void)pf;
    for (; i < n; i++) out[i] = mn__gelu(inp[i]);
}

// g[0..n) = mn__gelu_grad(x[0..n)) for n <= MN__STAGE, bit for bit: the expressions of the
// scalar form on MN__OW lanes, in stages as mn__gelu_span, the scalar form for the rest.
MN__PRIVATE void mn__gelu_grad_chunk(float *g, const float *x, size_t n) {
    size_t i = 0;
#if MN__OV
    float e[MN__STAGE];
    size_t nv = n - n % MN__OW;
    mn__gelu_stage_e(e, x, nv);
    for (i = 0; i < nv; i += MN__OW) {
        mn__ovf v = mn__ov_load(x + i), ev = mn__ov_load(e + i);
        mn__ovf d = 1.0f / (1.0f + ev), ed = ev * d, s = mn__ov_sel(v >= 0.0f, d, ed);
        mn__ovf xc = mn__ov_sel(v > -20.0f, mn__ov_sel(v < 20.0f, v, mn__ov_set1(20.0f)),
                                mn__ov_set1(-20.0f));
        mn__ov_store(g + i, s + (ed * d) * (xc * MN__OFMA(xc * xc, mn__ov_set1(MN__GELU_D1),
                                                          mn__ov_set1(MN__GELU_D0))));
    }
#endif
    for (; i < n; i++) g[i] = mn__gelu_grad(x[i]);
}

#define MN__GELU_BLOCK 4096  // elements per task of the parallel loop (a multiple of MN__STAGE)

MNIMPL mn_result mn_gelu_forward(float *out, const float *inp, size_t n) {
    // y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), Hendrycks & Gimpel 2016
    // A large call streams its output and asks for its input ahead (>>ops streaming stores; 1.1x
    // measured on a Zen 5 core; the requests where mn__pf_ahead says so); parts of blocks claimed
    // by the threads.
    size_t part, parts, nb = n / MN__GELU_BLOCK + (n % MN__GELU_BLOCK != 0);
    int big = mn__nt_big(n, 1), nt, pf;
    if ((n && (!out || !inp)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    nt = big && mn__nt_want(out), pf = big && mn__pf_ahead();
    parts = mn__nt_parts(n);
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, parts)
    for (part = 0; part < parts; part++) {  // (one span a part: one scalar head up to a line)
        size_t i = mn__part_start(nb, parts, part) * MN__GELU_BLOCK;
        size_t i1 = mn__part_start(nb, parts, part + 1) * MN__GELU_BLOCK;
        if (i1 > n) i1 = n;
        if (i < i1) mn__gelu_span(out + i, inp + i, i1 - i, nt, pf ? n - i : 0);
        if (nt) mn__nt_fence();
    }
    return MN_OK;
}

MNIMPL mn_result mn_gelu_backward(float *dinp, const float *dout, const float *inp, size_t n) {
    // dx += dy (0.5 (1 + tanh u) + 0.5 x sech^2(u) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
    // (dinp is read, so its lines are in cache when they are written: ordinary stores). A large
    // call asks for the three arrays MN__PF_CHUNKS chunks ahead where mn__pf_ahead says so (a Zen 5
    // core's hardware prefetcher keeps up with one stream, not with three: 1.4x measured there;
    // a Zen 4 core's was faster alone).
    size_t b, nb = n / MN__GELU_BLOCK + (n % MN__GELU_BLOCK != 0);
    int pf = mn__nt_big(n, 1) && mn__pf_ahead();
    if ((n && (!dinp || !dout || !inp)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, nb)
    for (b = 0; b < nb; b++) {
        size_t i0 = b * MN__GELU_BLOCK, end = n - i0 < MN__GELU_BLOCK ? n : i0 + MN__GELU_BLOCK;
        size_t i, len, j;
        float g[MN__STAGE];
        for (i = i0; i < end; i += len) {
            len = end - i < MN__STAGE ? end - i : MN__STAGE;
            if (pf && n - i > (MN__PF_CHUNKS + 1) * MN__STAGE) {
                size_t k = i + MN__PF_CHUNKS * MN__STAGE;
                mn__prefetch(inp + k, MN__STAGE), mn__prefetch(dout + k, MN__STAGE);
                mn__prefetch(dinp + k, MN__STAGE);
            }
            mn__gelu_grad_chunk(g, inp + i, len);
            for (j = 0; j < len; j++) dinp[i + j] += dout[i + j] * g[j];
        }
    }
    return MN_OK;
}

MNIMPL mn_result mn_gelu_erf_forward(float *out, const float *inp, size_t n) {
    // y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), Hendrycks & Gimpel 2016 (exact GELU); written
    // with erfc(-x / sqrt 2) = 1 + erf(x / sqrt 2), which does not cancel for negative x
    size_t i;
    if ((n && (!out || !inp)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) out[i] = 0.5f * inp[i] * erfcf(-inp[i] * 0.70710678118654752f);
    return MN_OK;
}

MNIMPL mn_result mn_gelu_erf_backward(float *dinp, const float *dout, const float *inp, size_t n) {
    // dy/dx = Phi(x) + x phi(x) = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
    size_t i;
    if ((n && (!dinp || !dout || !inp)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) {
        float x = inp[i];
        float g = 0.5f * erfcf(-x * 0.70710678118654752f) +
                  x * mn__expf(-0.5f * x * x) * 0.39894228040143268f;
        dinp[i] += dout[i] * g;
    }
    return MN_OK;
}

// sigmoid(x) = 1 / (1 + exp(-x)); exp(-x) = inf for very negative x gives 0 as it should.
MN__INLINE float mn__sigmoid(float x) { return 1.0f / (1.0f + mn__expf(-x)); }

MNIMPL mn_result mn_silu_forward(float *out, const float *inp, size_t n) {
    // y = x sigmoid(x), Elfwing et al. 2018
    size_t i;
    if ((n && (!out || !inp)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) out[i] = inp[i] * mn__sigmoid(inp[i]);
    return MN_OK;
}

MNIMPL mn_result mn_silu_backward(float *dinp, const float *dout, const float *inp, size_t n) {
    // dy/dx = s (1 + x (1 - s)), s = sigmoid(x), 1 - s = sigmoid(-x)
    size_t i;
    if ((n && (!dinp || !dout || !inp)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) {
        float x = inp[i], s = mn__sigmoid(x), sm = mn__sigmoid(-x);
        dinp[i] += dout[i] * (s + x * s * sm);
    }
    return MN_OK;
}

MNIMPL mn_result mn_swiglu_forward(float *out, const float *gate, const float *up, size_t n) {
    // y = silu(g) u, Shazeer 2020 (SwiGLU with the projections done by the caller's matmuls)
    size_t i;
    if ((n && (!out || !gate || !up)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) out[i] = gate[i] * mn__sigmoid(gate[i]) * up[i];
    return MN_OK;
}

MNIMPL mn_result mn_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                                    const float *up, size_t n) {
    // dg += dy u silu'(g); du += dy silu(g)
    size_t i;
    if ((n && (!dout || !gate || !up)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) {
        float g = gate[i], s = mn__sigmoid(g), sm = mn__sigmoid(-g);
        if (dgate) dgate[i] += dout[i] * up[i] * (s + g * s * sm);
        if (dup) dup[i] += dout[i] * (g * s);
    }
    return MN_OK;
}

MNIMPL mn_result mn_residual_forward(float *out, const float *a, const float *b, size_t n) {
    // y = a + b (llm.c train_gpt2.c residual_forward)
    size_t i;
    if ((n && (!out || !a || !b)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) out[i] = a[i] + b[i];
    return MN_OK;
}

MNIMPL mn_result mn_residual_backward(float *da, float *db, const float *dout, size_t n) {
    // da += dy, db += dy
    size_t i;
    if ((n && (!dout)) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, n)
    for (i = 0; i < n; i++) {
        if (da) da[i] += dout[i];
        if (db) db[i] += dout[i];
    }
    return MN_OK;
}

// ---- embedding ----------------------------------------------------------------------------------

MN__PRIVATE int mn__ids_valid(const int *ids, size_t n, size_t V, int allow_negative) {
    size_t i;
    for (i = 0; i < n; i++) {
        if (ids[i] >= 0 && (size_t)ids[i] >= V) return 0;
        if (ids[i] < 0 && !allow_negative) return 0;
    }
    return 1;
}

MNIMPL mn_result mn_embedding_forward(float *out, const int *tokens, const float *wte,
                                      const float *wpe, size_t B, size_t T, size_t C, size_t V) {
    // y[b,t,:] = wte[tok[b,t],:] + wpe[t,:] (llm.c train_gpt2.c encoder_forward)
    size_t n;
    if (!out || !tokens || !wte || V == 0) return MN_ERR_INVALID_ARG;
    if (!mn__ops_fits(B, T, C) || !mn__ops_fits(V, C, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(tokens, B * T, V, 0)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(B * T * C, MN__OMP_MIN_ELEMS, B * T)
    for (n = 0; n < B * T; n++) {
        float *y = out + n * C;
        const float *e = wte + (size_t)tokens[n] * C;
        const float *pe = wpe ? wpe + (n % T) * C : NULL;
        size_t i;
        if (pe) for (i = 0; i < C; i++) y[i] = e[i] + pe[i];
        else for (i = 0; i < C; i++) y[i] = e[i];
    }
    return MN_OK;
}

MNIMPL mn_result mn_embedding_backward(float *dwte, float *dwpe, const float *dout,
                                       const int *tokens, size_t B, size_t T, size_t C,
                                       size_t V) {
    // dwte[tok[b,t],:] += dy[b,t,:]; dwpe[t,:] += dy[b,t,:] (llm.c encoder_backward). Threads
    // own column blocks, so repeated tokens never race and the sum order is fixed.
    size_t blk, nblk = (C + 63) / 64;
    if (!dout || !tokens || V == 0) return MN_ERR_INVALID_ARG;
    if (!mn__ops_fits(B, T, C) || !mn__ops_fits(V, C, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(tokens, B * T, V, 0)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(B * T * C, MN__OMP_MIN_ELEMS, nblk)
    for (blk = 0; blk < nblk; blk++) {
        size_t c0 = blk * 64, c1 = C - c0 > 64 ? c0 + 64 : C, i, n;
        for (n = 0; n < B * T; n++) {
            const float *dy = dout + n * C;
            if (dwte) {
                float *dw = dwte + (size_t)tokens[n] * C;
                for (i = c0; i < c1; i++) dw[i] += dy[i];
            }
            if (dwpe) {
                float *dp = dwpe + (n % T) * C;
                for (i = c0; i < c1; i++) dp[i] += dy[i];
            }
        }
    }
    return MN_OK;
}

// ---- cross-entropy ------------------------------------------------------------------------------

#define MN__CE_PART_ROWS 8  // rows of a part of a call that streams its probs (about)

// Softmax statistics of a row of logits: max and log sum exp(x - max).
MN__PRIVATE void mn__logsumexp(const float *x, size_t V, float *mx, double *lse) {
    *mx = mn__max_scaled(x, 1.0f, V);
    *lse = log(mn__sumexp(x, *mx, V));
}

// Floats of the scratch row of one thread in mn_crossentropy_forward for rows of V logits: V
// rounded up to whole 64-byte lines, plus the line for mn__nt_row_at.
MN__INLINE size_t mn__ce_stride(size_t V) { return (V + 15) / 16 * 16 + MN__NT_ROW_PAD; }

MNIMPL mn_result mn_crossentropy_forward(float *losses, float *probs, const float *logits,
                                         const int *targets, size_t N, size_t V) {
    // loss = logsumexp(x) - x[y]; p = exp(x - max) / sum exp(x - max) (llm.c crossentropy_forward
    // over softmax_forward, fused as in llm.c fused_classifier). With probs the exponentials are
    // stored while they are summed (one exp per logit), then scaled.
    // A large call with probs streams them (>>ops streaming stores): the exponentials of a row
    // go to a scratch row of its thread, which stays in L2 with the logits, and one pass per row
    // computes them, streams the probs of the row before from the scratch row, scaled, and
    // finds the max of the row after (mn__nt_row_pass; the same values as the loop row by row;
    // 1.3 to 1.6x measured, one Zen 5 core, 256 rows of 50257, and 1.2x at 128256). Its parts
    // take about MN__CE_PART_ROWS rows, as each starts with a pass of loads alone and ends with
    // one of stores alone (two threads, CPU time against the loop row by row: 1.2x with parts
    // of 4 rows, 1.3x with 8; longer parts leave a team whose second core is busy elsewhere
    // waiting longer). The scratch rows are one allocation per call, MN_MALLOC; without
    // it the call goes row by row with ordinary stores. Otherwise a large call asks for the next
    // row's logits while it computes the exponentials of this one (pf of mn__exp_store_sum), so
    // that the max pass finds them in cache.
    size_t part, parts, stride = mn__ce_stride(V);
    float *heap = NULL, *rows = NULL;
    uint64_t bytes;
    int big, nt, team;
    if (!losses || !logits || !targets || V == 0 || !mn__ops_fits(N, V, 1))
        return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(targets, N, V, 1)) return MN_ERR_INVALID_ARG;
    big = (uint64_t)N * V >= MN__NT_MIN_BYTES / sizeof(float);
    nt = probs && big && mn__nt_want(probs);
    team = mn__omp_team((uint64_t)N * V, MN__OMP_MIN_ELEMS);
    if (nt && mn_mul_u64((uint64_t)team, (uint64_t)stride * sizeof(float), &bytes) == MN_OK &&
        mn_add_u64(bytes, 64, &bytes) == MN_OK && bytes <= (uint64_t)SIZE_MAX)
        heap = (float *)MN_MALLOC((size_t)bytes);
    if (heap) rows = (float *)((char *)heap + (64 - (uintptr_t)heap % 64) % 64);
    nt = rows != NULL;
    parts = mn__nt_parts((uint64_t)N * V);
    if (nt && parts > N / MN__CE_PART_ROWS + 1) parts = N / MN__CE_PART_ROWS + 1;
    MN__OMP_FOR_WORK(N * V, MN__OMP_MIN_ELEMS, parts)
    for (part = 0; part < parts; part++) {
        size_t n = mn__part_start(N, parts, part), n1 = mn__part_start(N, parts, part + 1);
        if (nt) {
            mn__nt_softmax_rows(probs, logits, N, V, 1.0f, n, n1,
                                rows + (size_t)mn__omp_me() * stride, losses, targets);
            mn__nt_fence();
            continue;
        }
        for (; n < n1; n++) {
            const float *x = logits + n * V, *pf = big && n + 1 < N ? x + V : NULL;
            float mx, inv, *p = probs ? probs + n * V : NULL;
            double lse, sum;
            size_t j;
            if (p) {
                mx = mn__max_scaled(x, 1.0f, V);
                sum = mn__exp_store_sum(p, x, 1.0f, mx, V, pf);
                lse = log(sum), inv = (float)(1.0 / sum);
                for (j = 0; j < V; j++) p[j] *= inv;
            } else {
                mn__logsumexp(x, V, &mx, &lse);
            }
            losses[n] = targets[n] < 0 ? 0.0f : (float)(lse - (x[targets[n]] - mx));
        }
    }
    MN_FREE(heap);
    return MN_OK;
}

MNIMPL mn_result mn_crossentropy_backward(float *dlogits, const float *dlosses, const float *probs,
                                          const float *logits, const int *targets, size_t N,
                                          size_t V) {
    // dx_j += (p_j - [j == y]) dloss (llm.c crossentropy_softmax_backward)
    size_t n;
    if (!dlogits || !dlosses || !targets || V == 0) return MN_ERR_INVALID_ARG;
    if ((!probs && !logits) || !mn__ops_fits(N, V, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(targets, N, V, 1)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(N * V, MN__OMP_MIN_ELEMS, N)
    for (n = 0; n < N; n++) {
        float *dx = dlogits + n * V, d = dlosses[n];
        size_t j;
        int y = targets[n];
        if (y < 0) continue;
        if (probs) {
            const float *p = probs + n * V;
            for (j = 0; j < V; j++) dx[j] += p[j] * d;
        } else {
            // the forward's probabilities, recomputed the same way
            const float *x = logits + n * V;
            float mx = mn__max_scaled(x, 1.0f, V), inv;
            inv = (float)(1.0 / mn__sumexp(x, mx, V));
            for (j = 0; j < V; j++) dx[j] += mn__expf(1.0f * x[j] - mx) * inv * d;
        }
        dx[y] -= d;
    }
    return MN_OK;
}

// ---- dropout ------------------------------------------------------------------------------------

MNIMPL void mn_philox4x32(const uint32_t ctr[4], uint64_t key, uint32_t out[4]) {
    // Philox-4x32-10, Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy as
    // 1, 2, 3" (Random123 philox4x32round): multipliers 0xD2511F53, 0xCD9E8D57, Weyl key
    // increments 0x9E3779B9, 0xBB67AE85.
    uint32_t c0, c1, c2, c3, k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    int r;
    if (!ctr || !out) return;
    c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    for (r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c0 = n0, c1 = (uint32_t)p1, c2 = n2, c3 = (uint32_t)p0;
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

#define MN__DROP_CHUNK 4096

MN__PRIVATE int mn__dropout_p_valid(float p) { return p >= 0.0f && p <= 1.0f; }

// keep[i] = 1 when element e = first + i (i < n) survives: word e % 4 of Philox(counter e / 4,
// key seed), read as a uniform in [0, 1), is below 1 - p.
MN__PRIVATE void mn__dropout_keep(uint8_t *keep, size_t n, float p, uint64_t seed, uint64_t first) {
    double thr = (1.0 - (double)p) * 4294967296.0;
    uint32_t ctr[4], word[4] = {0, 0, 0, 0};
    uint64_t e, blk = UINT64_MAX;
    size_t i;
    for (i = 0; i < n; i++) {
        e = first + i;
        if (e / 4 != blk) {
            blk = e / 4;
            ctr[0] = (uint32_t)blk, ctr[1] = (uint32_t)(blk >> 32), ctr[2] = 0, ctr[3] = 0;
            mn_philox4x32(ctr, seed, word);
        }
        keep[i] = (uint8_t)((double)word[e % 4] < thr);
    }
}

MNIMPL mn_result mn_dropout_mask(uint8_t *mask, size_t n, float p, uint64_t seed, uint64_t offset) {
    size_t c, nc = (n + MN__DROP_CHUNK - 1) / MN__DROP_CHUNK;
    if (!mask || !mn__dropout_p_valid(p) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, nc)
    for (c = 0; c < nc; c++) {
        size_t i0 = c * MN__DROP_CHUNK;
        size_t m = n - i0 < MN__DROP_CHUNK ? n - i0 : MN__DROP_CHUNK;
        mn__dropout_keep(mask + i0, m, p, seed, offset + i0);
    }
    return MN_OK;
}

MNIMPL mn_result mn_dropout_forward(float *out, uint8_t *mask, const float *inp, size_t n,
                                    float p, uint64_t seed, uint64_t offset) {
    // y = x keep / (1 - p): inverted dropout, whose expectation is x (nothing to do at test time)
    size_t c, nc = (n + MN__DROP_CHUNK - 1) / MN__DROP_CHUNK;
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    if (!out || !inp || !mn__dropout_p_valid(p) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, nc)
    for (c = 0; c < nc; c++) {
        uint8_t keep[MN__DROP_CHUNK];
        size_t i0 = c * MN__DROP_CHUNK, i;
        size_t m = n - i0 < MN__DROP_CHUNK ? n - i0 : MN__DROP_CHUNK;
        mn__dropout_keep(keep, m, p, seed, offset + i0);
        for (i = 0; i < m; i++) out[i0 + i] = keep[i] ? inp[i0 + i] * scale : 0.0f;
        if (mask) memcpy(mask + i0, keep, m);
    }
    return MN_OK;
}

MNIMPL mn_result mn_dropout_backward(float *dinp, const float *dout, const uint8_t *mask, size_t n,
                                     float p, uint64_t seed, uint64_t offset) {
    // dx += dy keep / (1 - p)
    size_t c, nc = (n + MN__DROP_CHUNK - 1) / MN__DROP_CHUNK;
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    if (!dinp || !dout || !mn__dropout_p_valid(p) || !mn__floats_fit(n)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_WORK(n, MN__OMP_MIN_ELEMS, nc)
    for (c = 0; c < nc; c++) {
        uint8_t keep[MN__DROP_CHUNK];
        size_t i0 = c * MN__DROP_CHUNK, i;
        size_t m = n - i0 < MN__DROP_CHUNK ? n - i0 : MN__DROP_CHUNK;
        const uint8_t *k = keep;
        if (mask) k = mask + i0;
        else mn__dropout_keep(keep, m, p, seed, offset + i0);
        for (i = 0; i < m; i++)
            if (k[i]) dinp[i0 + i] += dout[i0 + i] * scale;
    }
    return MN_OK;
}

#ifdef MN__VECT_PUSHED
#pragma GCC pop_options
#undef MN__VECT_PUSHED
#endif
#endif  // MEMANAT_IMPLEMENTED
#endif  // MEMANAT_IMPLEMENTATION

/*
------------------------------------------------------------------------------
MIT License

Copyright (c) 2026 The memanat authors

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT
OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
------------------------------------------------------------------------------
*/
