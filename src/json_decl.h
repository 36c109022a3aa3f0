// >>json ----------------------------------------------------------------------------------------
//
// A strict JSON reader (RFC 8259) that builds a read-only tree in one arena, small JSON-writing
// helpers, and a reader for safetensors headers. Both readers take untrusted files: every rule of
// the grammar is enforced, every size is checked, and the fuzz driver (test/fuzz.c) runs them.

// FILE, for the writing helpers (included outside the header's extern "C" block)
#ifdef __cplusplus
}
#endif
#include <stdio.h>
#ifdef __cplusplus
extern "C" {
#endif

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

// >>safetensors header reader
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
