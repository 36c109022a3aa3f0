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
//   MN_ASSERT(c)           programmer-error check (default assert)
//
// QUICK START
//   mn_model model;  mn_setup setup = {0};  mn_estimate_result r;
//   mn_preset_find("llama-3-8b", &model);        // or mn_model_transformer(), mn_hf_config_read()
//   setup.batch = 4; setup.seq = 2048;           // zero means default everywhere
//   setup.precision = MN_PREC_BF16;  setup.optim = MN_OPTIM_ADAMW;
//   setup.gpu = "h100-80gb";
//   if (mn_estimate(&model, &setup, &r) == MN_OK)
//       printf("peak %.1f GiB, fits: %d\n", r.peak_reserved / 1073741824.0, r.fits);
//   mn_fit() answers the largest micro-batch, the longest sequence and a plan that fits.
//
// CONTENTS (grep for the tag; the implementation repeats this order)
//   >>types      results, dtypes, memory categories, host allocator, logger, checked arithmetic
//   >>json       strict JSON reader (DOM), JSON writer helpers, safetensors header reader
//   >>estimate   model description, training/inference setup, estimate, fit, presets, GPUs
//   >>hfconfig   Hugging Face config.json and model-folder reader
//   >>cache      caching allocator (PyTorch policy), simulated device, stats, summary, snapshot
//   >>optim      optimizer steps and state sizes, gradient clipping, loss scaling, fp16/bf16
//   >>ops        CPU reference ops, forward and backward
//
// HISTORY
//   0.1.0  estimator, CLI, caching allocator, optimizers and reference ops
//
// LICENSE: MIT, see the end of this file.

#ifndef MEMANAT_H
#define MEMANAT_H

#include <stddef.h>
#include <stdint.h>

#ifdef MEMANAT_STATIC
#define MNDEF static
#else
#define MNDEF extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define MEMANAT_VERSION "0.1.0"

// >>types ---------------------------------------------------------------------------------------

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
typedef enum mn_log_level { MN_LOG_DEFAULT = 0, MN_LOG_ERROR, MN_LOG_WARN, MN_LOG_INFO, MN_LOG_COUNT } mn_log_level;
typedef struct mn_logger {
    void (*log_fn)(void *user_data, mn_log_level level, const char *msg);
    void *user_data;
} mn_logger;

// Checked 64-bit arithmetic: MN_OK or MN_ERR_OVERFLOW, result through the last pointer.
MNDEF mn_result mn_mul_u64(uint64_t a, uint64_t b, uint64_t *out);
MNDEF mn_result mn_add_u64(uint64_t a, uint64_t b, uint64_t *out);

// Sizes for humans and for command lines. mn_size_parse accepts "123", "4B", "1.5GB" (10^9),
// "16GiB" (2^30), "512MiB", "2KB", "2KiB" (case-insensitive units, no sign).
MNDEF mn_result mn_size_parse(const char *s, uint64_t *out);
MNDEF void mn_size_format(uint64_t bytes, char *buf, size_t cap);  // "1.25 GiB", "512 B"

#include "src/json_decl.h"
#include "src/estimate_decl.h"
#include "src/hfconfig_decl.h"
#include "src/cache_decl.h"
#include "src/optim_decl.h"
#include "src/ops_decl.h"

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
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(MN_MALLOC) && !defined(MN_FREE) || !defined(MN_MALLOC) && defined(MN_FREE)
#error "memanat: define both MN_MALLOC and MN_FREE, or neither"
#endif
#ifndef MN_MALLOC
#define MN_MALLOC(sz) malloc(sz)
#define MN_FREE(p) free(p)
#endif
#ifndef MN_ASSERT
#include <assert.h>
#define MN_ASSERT(c) assert(c)
#endif

#ifdef MEMANAT_STATIC
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

// >>types implementation ------------------------------------------------------------------------

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
    static const char *const names[MN_DTYPE_COUNT] = {"default", "fp32", "fp16", "bf16", "int8", "nf4"};
    return (unsigned)t < MN_DTYPE_COUNT ? names[t] : "unknown";
}

MNIMPL uint32_t mn_dtype_bits(mn_dtype t) {
    static const uint32_t bits[MN_DTYPE_COUNT] = {0, 32, 16, 16, 8, 4};
    return (unsigned)t < MN_DTYPE_COUNT ? bits[t] : 0;
}

MNIMPL const char *mn_category_name(mn_category c) {
    static const char *const names[MN_CAT_COUNT] = {"other", "weights", "master_weights", "gradients",
                                                    "optimizer", "activations", "temporary",
                                                    "kv_cache", "workspace"};
    return (unsigned)c < MN_CAT_COUNT ? names[c] : "unknown";
}

MNIMPL mn_result mn_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return MN_ERR_OVERFLOW;
    *out = a * b;
    return MN_OK;
}

MNIMPL mn_result mn_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (b > UINT64_MAX - a) return MN_ERR_OVERFLOW;
    *out = a + b;
    return MN_OK;
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
    // digits[.digits] followed by an optional unit; the product must be a whole number of bytes
    static const struct { const char *unit; double mult; } units[] = {
        {"", 1.0}, {"b", 1.0}, {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
        {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0},
        {"k", 1024.0}, {"m", 1048576.0}, {"g", 1073741824.0}};
    const char *p = s;
    uint64_t ip = 0;
    double frac = 0.0, scale = 0.1, v;
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
        p++;
        while (*p >= '0' && *p <= '9') frac += (*p++ - '0') * scale, scale *= 0.1, digits++;
    }
    if (digits == 0) return MN_ERR_PARSE;
    while (*p == ' ') p++;
    for (i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (!mn__streq_nocase(p, units[i].unit)) continue;
        if (frac == 0.0) return mn_mul_u64(ip, (uint64_t)units[i].mult, out);
        v = ((double)ip + frac) * units[i].mult + 0.5;
        if (v >= 18446744073709551615.0) return MN_ERR_OVERFLOW;
        *out = (uint64_t)v;
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

#include "src/json_impl.h"
#include "src/estimate_impl.h"
#include "src/hfconfig_impl.h"
#include "src/cache_impl.h"
#include "src/optim_impl.h"
#include "src/ops_impl.h"

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
