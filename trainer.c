// trainer.c - a tiny GPT trained on the CPU, every tensor in memanat's caching allocator.
//
// A decoder-only transformer over bytes (V = 256, or more with --vocab): learned positions,
// pre-norm blocks (layernorm -> qkv -> causal attention -> proj -> residual; layernorm -> fc +
// GELU -> proj -> residual), a final layernorm and a head tied to the token embedding (or its
// own), trained with AdamW (or another of the header's optimizers) on a generated first-order
// Markov source whose entropy rate H is known exactly, so the loss has a floor to fall toward
// (or on the bytes of a file with --data). Read it top to bottom, as llm.c's train_gpt2.c:
// config, data, tensor tables, layer forward/backward, model build/forward/backward/update,
// checkpoints, the prediction, the run, `main` last.
//
// Every tensor comes from one mn_cache over host memory (mn_hostdev) under its memory category:
// weights and gradients at start, optimizer state at the first step, activations allocated in
// forward and released in backward as soon as they are consumed, short-lived buffers as
// temporaries. The allocator's statistics are therefore measurements of this program. Before
// training the run prints the estimator's prediction for exactly this configuration (its
// memanat framework describes this program's allocations); after it, the measured peaks per
// category beside the predicted ones, and PyTorch's memory_summary() table (and, on request,
// the history as an SVG timeline and a torch.cuda.memory._snapshot() JSON).
//
// The seeds' techniques, each a flag: gradient accumulation (--accum), activation
// checkpointing (--checkpointing selective|full), 16-bit storage with fp32 master weights and
// dynamic loss scaling (--precision fp16|bf16), the optimizers (--optim), a memory budget
// planned by the estimator (--budget), checkpoints to resume from (--save, --resume).
//
// --device cuda runs the same model, step and report on a GPU (the section "the GPU path"):
// the tensors in the same caching allocator over cudaMalloc, the ops memanat_cuda.cu's kernels.
//
// Build:  cc -std=c99 -O2 trainer.c -lm -lpthread -o trainer   (add -fopenmp for threads)
//   with the GPU path: cc -std=c99 -O2 -DMEMANAT_CUDA -c trainer.c, then link trainer.o with
//   memanat_cuda.o, cudart and cublasLt (the Makefile does both when nvcc is present)
// Run:    ./trainer [--size NAME] [shape, batch, technique, checkpoint and output flags: --help]
// Under TRAINER_TESTING the file leaves out main and the header's implementation, so a test
// can #include it (test/test_trainer.c).
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L  // clock_gettime
#endif
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#if defined(_OPENMP) && defined(__linux__)
#include <unistd.h>  // execv: the trainer restarts itself with a passive OpenMP wait policy
#endif
#include <string.h>
#include <time.h>

#ifndef TRAINER_TESTING
#define MEMANAT_IMPLEMENTATION
#endif
#include "memanat.h"

#define TR_TRY(expr) do { mn_result tr_r_ = (expr); if (tr_r_ != MN_OK) return tr_r_; } while (0)

// ---- config -------------------------------------------------------------------------------------
// Shapes: L layers, C channels, NH heads, T sequence length (= positions), V vocabulary (256
// bytes, or more with --vocab: the extra tokens never occur), B batch, K micro-batches per
// optimizer step, N = B * T rows.

#define TR_V 256
#define TR_MAX_LAYERS 64
#define TR_MAX_DIM 4096
#define TR_MAX_SEQ 4096
#define TR_MAX_BATCH 4096
#define TR_MAX_VOCAB 262144
#define TR_LN_EPS 1e-5f
#define TR_MIB (1024.0 * 1024.0)
#define TR_TRACE_MIN 4096      // history ring entries with --memory-svg / --snapshot: at least
#define TR_TRACE_MAX 262144    // this many, at most this many (12 MiB of host memory)

// Activation checkpointing: none; selective keeps no attention probabilities (the backward
// recomputes them); full keeps each block's input only and recomputes the block in backward.
enum { TR_CKPT_NONE, TR_CKPT_SELECTIVE, TR_CKPT_FULL };
static const char *const tr_ckpt_names[] = {"none", "selective", "full"};

// Where the model trains: host memory and the reference ops, or a GPU (MEMANAT_CUDA builds).
enum { TR_DEVICE_CPU, TR_DEVICE_CUDA };

typedef struct tr_config {
    size_t L, C, NH, T, V, B, K;
    int tied;             // the head is the token embedding (1) or a tensor of its own (0)
    long steps;
    float lr;             // peak learning rate: linear warmup, then cosine down to lr / 10
    float clip;           // gradient clipping by global norm, 0 = none
    uint64_t seed;
    int checkpointing;    // TR_CKPT_NONE, _SELECTIVE, _FULL
    mn_precision precision;  // MN_PREC_FP32, or MN_PREC_FP16 / MN_PREC_BF16: 16-bit storage
    long inject_overflow; // fp16: plant an inf in the gradients of this step (1-based), 0 = none
    uint64_t capacity;    // bytes the host device may hand out, 0 = unlimited
    uint64_t fail_alloc_at;  // the N-th tensor allocation fails as out of memory, 0 = never
    uint64_t budget;      // plan the techniques to fit this many bytes (mn_fit), 0 = none
    const char *data;     // train on the bytes of this file, NULL = the Markov source
    mn_optim optim;       // MN_OPTIM_ADAMW, _ADAMW_8BIT, _SGD, _SGD_MOMENTUM, _ADAFACTOR, _LION
    const char *memory_svg;  // the cache's timeline as SVG after training, NULL = none
    const char *snapshot;    // the cache's snapshot as JSON after training, NULL = none
    const char *save;     // write a checkpoint here at the end (and every save_every steps)
    long save_every;      // 0 = only at the end
    const char *resume;   // continue from this checkpoint, NULL = a fresh start
    long stop_after;      // stop after this step of the --steps schedule, 0 = run to the end
    const char *json;     // the run's summary as JSON, NULL = none
    int device;           // TR_DEVICE_CPU, TR_DEVICE_CUDA
    int gemm_tune;        // --gemm-tune on: mn_cuda_desc.gemm_tune (--device cuda)
    int help;             // --help was given
    // Set by --device cuda's setup for the prediction: the device's GPU table entry (NULL: the
    // CPU), the device's total bytes and the CUDA context measured by cudaMemGetInfo.
    const char *gpu;
    uint64_t gpu_total, gpu_context;
} tr_config;

// Named sizes (--size), X(name, L, C, NH, T, V): tiny is the default; gpt2 is GPT-2 small's
// shape (124 M parameters with its 50257-token vocabulary) at a 256-token sequence.
#define TR_SIZES(X) \
    X("tiny", 2, 64, 4, 64, 256) \
    X("small", 4, 128, 4, 128, 256) \
    X("medium", 6, 384, 6, 256, 256) \
    X("gpt2", 12, 768, 12, 256, 50257)

static void tr_config_default(tr_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->L = 2, cfg->C = 64, cfg->NH = 4, cfg->T = 64, cfg->V = TR_V, cfg->B = 8, cfg->K = 1;
    cfg->tied = 1;
    cfg->steps = 500;
    cfg->lr = 1e-2f;
    cfg->clip = 1.0f;
    cfg->seed = 1337;
    cfg->precision = MN_PREC_FP32;
    cfg->optim = MN_OPTIM_ADAMW;
}

// Unsigned decimal in [lo, hi]; anything else names the flag in err.
static mn_result tr_parse_size(const char *flag, const char *s, uint64_t lo, uint64_t hi,
                               uint64_t *out, char *err, size_t cap) {
    char *end;
    unsigned long long v;
    if (!s || *s < '0' || *s > '9') {
        snprintf(err, cap, "%s needs a number, got \"%s\"", flag, s ? s : "");
        return MN_ERR_INVALID_ARG;
    }
    errno = 0;
    v = strtoull(s, &end, 10);
    if (*end != '\0' || errno == ERANGE || v < lo || v > hi) {
        snprintf(err, cap, "%s %s is not a whole number in [%llu, %llu]", flag, s,
                 (unsigned long long)lo, (unsigned long long)hi);
        return MN_ERR_INVALID_ARG;
    }
    *out = (uint64_t)v;
    return MN_OK;
}

static mn_result tr_parse_float(const char *flag, const char *s, float lo, float hi, float *out,
                                char *err, size_t cap) {
    char *end;
    double v = s ? strtod(s, &end) : 0.0;
    if (!s || end == s || *end != '\0' || !(v >= lo && v <= hi)) {
        snprintf(err, cap, "%s needs a number in [%g, %g], got \"%s\"", flag, (double)lo,
                 (double)hi, s ? s : "");
        return MN_ERR_INVALID_ARG;
    }
    *out = (float)v;
    return MN_OK;
}

// A size_t flag: *field = the value in [lo, hi].
static mn_result tr_parse_count(const char *flag, const char *s, uint64_t lo, uint64_t hi,
                                size_t *field, char *err, size_t cap) {
    uint64_t v;
    TR_TRY(tr_parse_size(flag, s, lo, hi, &v, err, cap));
    *field = (size_t)v;
    return MN_OK;
}

// A flag of two words: *field = 1 for `one`, 0 for `zero`.
static mn_result tr_parse_pair(const char *flag, const char *s, const char *one, const char *zero,
                               int *field, char *err, size_t cap) {
    if (strcmp(s, one) == 0 || strcmp(s, zero) == 0) {
        *field = strcmp(s, one) == 0;
        return MN_OK;
    }
    snprintf(err, cap, "%s takes %s or %s, got \"%s\"", flag, one, zero, s);
    return MN_ERR_INVALID_ARG;
}

// A byte count: a number with an optional K, M, G or T suffix (powers of 1024, "B" or "iB"
// after it allowed), e.g. 512M, 1.5GiB.
static mn_result tr_parse_bytes(const char *flag, const char *s, uint64_t *out, char *err,
                                size_t cap) {
    char *end;
    double v = s ? strtod(s, &end) : -1.0, mul = 1.0;
    if (s && end != s && v >= 0.0) {
        switch (*end) {
        case 'K': case 'k': mul = 1024.0, end++; break;
        case 'M': case 'm': mul = 1048576.0, end++; break;
        case 'G': case 'g': mul = 1073741824.0, end++; break;
        case 'T': case 't': mul = 1099511627776.0, end++; break;
        default: break;
        }
        if (mul > 1.0 && *end == 'i') end++;
        if (*end == 'B') end++;
        if (*end == '\0' && v * mul >= 1.0 && v * mul < 9.0e18) {
            *out = (uint64_t)(v * mul);
            return MN_OK;
        }
    }
    snprintf(err, cap, "%s needs a byte count such as 512M or 2G, got \"%s\"", flag,
             s ? s : "");
    return MN_ERR_INVALID_ARG;
}

// The flags that take a value, one row each: X(id, flag). The switch in tr_parse_args has a case
// per id (the compiler checks that none is missing).
#define TR_FLAGS(X) \
    X(SIZE, "--size") X(LAYERS, "--layers") X(DIM, "--dim") X(HEADS, "--heads") \
    X(SEQ, "--seq") X(VOCAB, "--vocab") X(HEAD, "--head") X(BATCH, "--batch") \
    X(ACCUM, "--accum") X(STEPS, "--steps") X(SEED, "--seed") X(LR, "--lr") X(CLIP, "--clip") \
    X(DATA, "--data") X(MEMORY_SVG, "--memory-svg") X(SNAPSHOT, "--snapshot") \
    X(OPTIM, "--optim") X(CHECKPOINTING, "--checkpointing") X(PRECISION, "--precision") \
    X(INJECT_OVERFLOW, "--inject-overflow") X(CAPACITY, "--capacity") X(SAVE, "--save") \
    X(SAVE_EVERY, "--save-every") X(RESUME, "--resume") X(STOP_AFTER, "--stop-after") \
    X(FAIL_ALLOC_AT, "--fail-alloc-at") X(JSON, "--json") X(BUDGET, "--budget") \
    X(DEVICE, "--device") X(GEMM_TUNE, "--gemm-tune")
// Of those, the ones that set a size_t field of tr_config: X(id, lo, hi, field).
#define TR_COUNT_FLAGS(X) \
    X(LAYERS, 1, TR_MAX_LAYERS, L) X(DIM, 1, TR_MAX_DIM, C) X(HEADS, 1, TR_MAX_DIM, NH) \
    X(SEQ, 1, TR_MAX_SEQ, T) X(VOCAB, TR_V, TR_MAX_VOCAB, V) X(BATCH, 1, TR_MAX_BATCH, B) \
    X(ACCUM, 1, 1024, K)
#define TR_FLAG_ENUM(id, flag) TR_F_##id,
typedef enum tr_flag { TR_FLAGS(TR_FLAG_ENUM) TR_FLAG_COUNT } tr_flag;
#define TR_FLAG_NAME(id, flag) flag,
static const char *const tr_flag_names[TR_FLAG_COUNT] = { TR_FLAGS(TR_FLAG_NAME) };

// --size NAME sets L, C, NH, T and V; MN_ERR_NOT_FOUND for an unknown name.
static mn_result tr_apply_size(const char *name, tr_config *cfg) {
#define TR_SIZE_ROW(n, l, c, nh, t, v) \
    if (strcmp(name, n) == 0) { \
        cfg->L = l, cfg->C = c, cfg->NH = nh, cfg->T = t, cfg->V = v; \
        return MN_OK; \
    }
    TR_SIZES(TR_SIZE_ROW)
#undef TR_SIZE_ROW
    return MN_ERR_NOT_FOUND;
}

// What --device cuda does not have yet: MN_ERR_INVALID_ARG naming the flag.
static mn_result tr_check_cuda_flags(const tr_config *cfg, char *err, size_t cap) {
    const char *no = NULL;
#ifndef MEMANAT_CUDA
    no = "this trainer was built without CUDA (build it where nvcc is found)";
#endif
    (void)cfg;
    if (!no) return MN_OK;
    snprintf(err, cap, "--device cuda: %s", no);
    return MN_ERR_INVALID_ARG;
}

// --device cuda needs a GPU that answers: MN_ERR_INVALID_ARG with one line in err when none does
// (cudaGetDeviceCount failing for any reason counts as none).
static mn_result tr_check_device(const tr_config *cfg, char *err, size_t cap) {
#ifdef MEMANAT_CUDA
    char why[160];
    if (cfg->device != TR_DEVICE_CUDA || mn_cuda_device_count(NULL, why, sizeof why) == MN_OK)
        return MN_OK;
    snprintf(err, cap, "--device cuda: no GPU answers (%s)", why);
    return MN_ERR_INVALID_ARG;
#else
    (void)cfg, (void)err, (void)cap;
    return MN_OK;  // tr_check_cuda_flags refused --device cuda already
#endif
}

// Fills cfg from the command line (defaults first, then --size wherever it stands, then the
// other flags in order). MN_ERR_INVALID_ARG with one line in err.
static mn_result tr_parse_args(int argc, char **argv, tr_config *cfg, char *err, size_t cap) {
    int i, pass;
    uint64_t v;
    tr_config_default(cfg);
    err[0] = '\0';
    for (pass = 0; pass < 2; pass++)
        for (i = 1; i < argc; i++) {
            const char *f = argv[i], *a = i + 1 < argc ? argv[i + 1] : NULL;
            tr_flag k;
            if (strcmp(f, "--help") == 0 || strcmp(f, "-h") == 0) { cfg->help = 1; continue; }
            if (strncmp(f, "--", 2) != 0) {
                snprintf(err, cap, "unknown argument \"%s\"", f);
                return MN_ERR_INVALID_ARG;
            }
            for (k = (tr_flag)0; k < TR_FLAG_COUNT && strcmp(f, tr_flag_names[k]) != 0;)
                k = (tr_flag)(k + 1);
            if (k == TR_FLAG_COUNT || !a) {
                snprintf(err, cap, k == TR_FLAG_COUNT ? "unknown flag %s" : "%s needs a value", f);
                return MN_ERR_INVALID_ARG;
            }
            i++;
            if ((pass == 0) != (k == TR_F_SIZE)) continue;
            switch (k) {
#define TR_COUNT_CASE(id, lo, hi, field) \
            case TR_F_##id: TR_TRY(tr_parse_count(f, a, lo, hi, &cfg->field, err, cap)); break;
            TR_COUNT_FLAGS(TR_COUNT_CASE)
#undef TR_COUNT_CASE
            case TR_F_SIZE:
                if (tr_apply_size(a, cfg) != MN_OK) {
                    snprintf(err, cap, "--size takes tiny, small, medium or gpt2, got \"%s\"", a);
                    return MN_ERR_INVALID_ARG;
                }
                break;
            case TR_F_HEAD:
                TR_TRY(tr_parse_pair(f, a, "tied", "untied", &cfg->tied, err, cap));
                break;
            case TR_F_STEPS:
                TR_TRY(tr_parse_size(f, a, 1, 100000000, &v, err, cap)); cfg->steps = (long)v;
                break;
            case TR_F_SEED:
                TR_TRY(tr_parse_size(f, a, 0, UINT64_MAX, &v, err, cap)); cfg->seed = v;
                break;
            case TR_F_LR: TR_TRY(tr_parse_float(f, a, 1e-8f, 10.0f, &cfg->lr, err, cap)); break;
            case TR_F_CLIP: TR_TRY(tr_parse_float(f, a, 0.0f, 1e6f, &cfg->clip, err, cap)); break;
            case TR_F_DATA: cfg->data = a; break;
            case TR_F_MEMORY_SVG: cfg->memory_svg = a; break;
            case TR_F_SNAPSHOT: cfg->snapshot = a; break;
            case TR_F_OPTIM:
                if (mn_optim_parse(a, &cfg->optim) != MN_OK || cfg->optim == MN_OPTIM_NONE) {
                    snprintf(err, cap, "--optim takes adamw, adamw-8bit, sgd, sgd-momentum, "
                             "adafactor or lion, got \"%s\"", a);
                    return MN_ERR_INVALID_ARG;
                }
                break;
            case TR_F_CHECKPOINTING:
                for (v = 0; v < 3 && strcmp(a, tr_ckpt_names[v]) != 0; v++) {}
                if (v == 3) {
                    snprintf(err, cap, "--checkpointing takes none, selective or full, "
                             "got \"%s\"", a);
                    return MN_ERR_INVALID_ARG;
                }
                cfg->checkpointing = (int)v;
                break;
            case TR_F_PRECISION:
                if (strcmp(a, "fp32") == 0) cfg->precision = MN_PREC_FP32;
                else if (strcmp(a, "fp16") == 0) cfg->precision = MN_PREC_FP16;
                else if (strcmp(a, "bf16") == 0) cfg->precision = MN_PREC_BF16;
                else {
                    snprintf(err, cap, "--precision takes fp32, fp16 or bf16, got \"%s\"", a);
                    return MN_ERR_INVALID_ARG;
                }
                break;
            case TR_F_INJECT_OVERFLOW:
                TR_TRY(tr_parse_size(f, a, 1, 100000000, &v, err, cap));
                cfg->inject_overflow = (long)v;
                break;
            case TR_F_CAPACITY: TR_TRY(tr_parse_bytes(f, a, &cfg->capacity, err, cap)); break;
            case TR_F_SAVE: cfg->save = a; break;
            case TR_F_SAVE_EVERY:
                TR_TRY(tr_parse_size(f, a, 1, 100000000, &v, err, cap));
                cfg->save_every = (long)v;
                break;
            case TR_F_RESUME: cfg->resume = a; break;
            case TR_F_JSON: cfg->json = a; break;
            case TR_F_BUDGET: TR_TRY(tr_parse_bytes(f, a, &cfg->budget, err, cap)); break;
            case TR_F_FAIL_ALLOC_AT:
                TR_TRY(tr_parse_size(f, a, 1, UINT64_MAX, &cfg->fail_alloc_at, err, cap));
                break;
            case TR_F_DEVICE:
                if (strcmp(a, "cpu") == 0) cfg->device = TR_DEVICE_CPU;
                else if (strcmp(a, "cuda") == 0) cfg->device = TR_DEVICE_CUDA;
                else {
                    snprintf(err, cap, "--device takes cpu or cuda, got \"%s\"", a);
                    return MN_ERR_INVALID_ARG;
                }
                break;
            case TR_F_GEMM_TUNE:
                TR_TRY(tr_parse_pair(f, a, "on", "off", &cfg->gemm_tune, err, cap));
                break;
            case TR_F_STOP_AFTER:
                TR_TRY(tr_parse_size(f, a, 1, 100000000, &v, err, cap));
                cfg->stop_after = (long)v;
                break;
            case TR_FLAG_COUNT: break;  // refused above
            }
        }
    if (cfg->C % cfg->NH != 0) {
        snprintf(err, cap, "--dim %zu is not a multiple of --heads %zu", cfg->C, cfg->NH);
        return MN_ERR_INVALID_ARG;
    }
    if (cfg->inject_overflow && cfg->precision != MN_PREC_FP16) {
        snprintf(err, cap, "--inject-overflow needs --precision fp16 (only fp16 scales the loss)");
        return MN_ERR_INVALID_ARG;
    }
    if (cfg->save_every && !cfg->save) {
        snprintf(err, cap, "--save-every needs --save FILE");
        return MN_ERR_INVALID_ARG;
    }
    if (cfg->stop_after > cfg->steps) {
        snprintf(err, cap, "--stop-after %ld is after the last step (--steps %ld)",
                 cfg->stop_after, cfg->steps);
        return MN_ERR_INVALID_ARG;
    }
    if (cfg->inject_overflow > cfg->steps) {
        snprintf(err, cap, "--inject-overflow %ld is after the last step (--steps %ld)",
                 cfg->inject_overflow, cfg->steps);
        return MN_ERR_INVALID_ARG;
    }
    if (cfg->gemm_tune && cfg->device != TR_DEVICE_CUDA) {
        snprintf(err, cap, "--gemm-tune on needs --device cuda (it times cuBLASLt's GEMMs)");
        return MN_ERR_INVALID_ARG;
    }
    return cfg->device == TR_DEVICE_CUDA ? tr_check_cuda_flags(cfg, err, cap) : MN_OK;
}

// ---- random numbers and data --------------------------------------------------------------------
// xorshift64* for everything random; the weights and the data draw from separate streams of the
// same seed, so the weights depend on the model shape and the seed only.

static uint64_t tr_rand_u64(uint64_t *s) {
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}
static double tr_rand_uniform(uint64_t *s) { return (double)(tr_rand_u64(s) >> 11) * 0x1p-53; }
static double tr_rand_normal(uint64_t *s) {  // Box-Muller
    double u = 1.0 - tr_rand_uniform(s), v = tr_rand_uniform(s);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}
static uint64_t tr_seed_stream(uint64_t seed, uint64_t stream) {
    uint64_t s = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (stream * 0xD1B54A32D192ED03ull);
    return s ? s : 1;  // xorshift needs a non-zero state
}

// The data: a first-order Markov chain over the 256 bytes, each byte followed by one of
// TR_SUCC successors with fixed random probabilities P. One successor of byte i is i + 1
// (mod 256), so the chain is irreducible. Its entropy rate is
//     H = sum_i pi_i * (-sum_j P_ij ln P_ij)   nats per token,
// pi the stationary distribution (pi = pi P). The stream starts from a byte drawn from pi, so
// the best possible expected loss at every position is exactly H.
#define TR_SUCC 4

typedef struct tr_markov {
    uint8_t next[TR_V][TR_SUCC];    // successors
    double prob[TR_V][TR_SUCC];     // their probabilities, each row sums to 1
    double pi[TR_V];                // stationary distribution
    double entropy;                 // H, nats per token
    uint64_t rng;
    int state;                      // the last byte of the stream
} tr_markov;

static void tr_markov_init(tr_markov *mk, uint64_t seed) {
    double row[TR_V], u, acc, w[TR_SUCC], wsum;
    int i, j, it;
    memset(mk, 0, sizeof *mk);
    mk->rng = tr_seed_stream(seed, 2);
    for (i = 0; i < TR_V; i++) {
        int order = (int)(tr_rand_u64(&mk->rng) % TR_SUCC);  // which probability i + 1 gets
        mk->next[i][order] = (uint8_t)((i + 1) % TR_V);
        for (j = 0, wsum = 0.0; j < TR_SUCC; j++) {  // skewed weights, none below ~1%
            u = tr_rand_uniform(&mk->rng);
            wsum += w[j] = u * u + 0.02;
        }
        for (j = 0; j < TR_SUCC; j++) {
            mk->prob[i][j] = w[j] / wsum;
            if (j == order) continue;
            for (;;) {  // distinct successors
                int k, c = (int)(tr_rand_u64(&mk->rng) % TR_V), dup = c == (i + 1) % TR_V;
                for (k = 0; k < j; k++) dup |= k != order && mk->next[i][k] == c;
                if (!dup) { mk->next[i][j] = (uint8_t)c; break; }
            }
        }
        mk->pi[i] = 1.0 / TR_V;
    }
    // pi <- (pi + pi P) / 2 converges to the stationary distribution of an irreducible chain,
    // periodic or not.
    for (it = 0; it < 100000; it++) {
        double diff = 0.0;
        for (i = 0; i < TR_V; i++) row[i] = 0.5 * mk->pi[i];
        for (i = 0; i < TR_V; i++)
            for (j = 0; j < TR_SUCC; j++) row[mk->next[i][j]] += 0.5 * mk->pi[i] * mk->prob[i][j];
        for (i = 0; i < TR_V; i++) diff += fabs(row[i] - mk->pi[i]), mk->pi[i] = row[i];
        if (diff < 1e-15) break;
    }
    for (i = 0; i < TR_V; i++)
        for (j = 0; j < TR_SUCC; j++)
            mk->entropy -= mk->pi[i] * mk->prob[i][j] * log(mk->prob[i][j]);
    u = tr_rand_uniform(&mk->rng), acc = 0.0;
    for (i = 0; i < TR_V - 1; i++)
        if ((acc += mk->pi[i]) > u) break;
    mk->state = i;
}

static int tr_markov_next(tr_markov *mk) {
    double u = tr_rand_uniform(&mk->rng), acc = 0.0;
    int j;
    for (j = 0; j < TR_SUCC - 1; j++)
        if ((acc += mk->prob[mk->state][j]) > u) break;
    return mk->state = mk->next[mk->state][j];
}

// tokens[B,T], targets[B,T]: B consecutive windows of the stream, targets shifted by one.
static void tr_markov_batch(tr_markov *mk, int *tokens, int *targets, size_t B, size_t T) {
    size_t b, t;
    for (b = 0; b < B; b++)
        for (t = 0; t < T; t++) {
            tokens[b * T + t] = mk->state;
            targets[b * T + t] = tr_markov_next(mk);
        }
}

// ---- tensor tables ------------------------------------------------------------------------------
// The parameters and the activations a block keeps are the header's MN_GPT_PARAMS and
// MN_GPT_ACTS (>>estimate/gpt), the tables the estimator's memanat framework predicts from.
// Parameters ln1w .. fcprojb are stacked per layer (layer l starts at l * numel / L); wte, wpe,
// lnfw, lnfb and lmw (an untied head; 0 rows when tied) are whole.

#define TR_P_ENUM(name, rows, cols, init) TR_P_##name,
enum { MN_GPT_PARAMS(TR_P_ENUM) TR_NUM_PARAMS };
#define TR_P_FIELD(name, rows, cols, init) float *name;
typedef struct tr_params { MN_GPT_PARAMS(TR_P_FIELD) } tr_params;
#define TR_P_NAME(name, rows, cols, init) #name,
static const char *const tr_param_names[TR_NUM_PARAMS] = { MN_GPT_PARAMS(TR_P_NAME) };
#define TR_P_INIT(name, rows, cols, init) init,
static const int tr_param_init[TR_NUM_PARAMS] = { MN_GPT_PARAMS(TR_P_INIT) };

static int tr_param_per_layer(int i) { return i >= TR_P_ln1w && i <= TR_P_fcprojb; }

// dims[i] = {rows, cols} of parameter i.
static void tr_param_dims(const tr_config *cfg, uint64_t dims[TR_NUM_PARAMS][2]) {
    uint64_t L = cfg->L, C = cfg->C, T = cfg->T, V = cfg->V, HV = cfg->tied ? 0 : V;
#define TR_P_DIMS(name, rows, cols, init) \
    dims[TR_P_##name][0] = rows, dims[TR_P_##name][1] = cols;
    MN_GPT_PARAMS(TR_P_DIMS)
#undef TR_P_DIMS
}

// slots[i] = &p->field of parameter i.
static void tr_param_slots(tr_params *p, float **slots[TR_NUM_PARAMS]) {
#define TR_P_SLOT(name, rows, cols, init) slots[TR_P_##name] = &p->name;
    MN_GPT_PARAMS(TR_P_SLOT)
#undef TR_P_SLOT
}

// A tensor in the cache. data holds it in its storage type: fp32, or the 16-bit type of
// --precision fp16|bf16 (half set). f is the fp32 view the ops compute on: data itself for an
// fp32 tensor; for a 16-bit one a temporary copy (MN_CAT_TEMPORARY) while open, else NULL.
typedef struct tr_tensor {
    void *data;
    float *f;
    uint64_t n;      // elements
    int half;        // stored in 16 bits
    const char *name;
} tr_tensor;

#define TR_A_FIELD(name, numel, fp32) tr_tensor name;
typedef struct tr_acts { MN_GPT_ACTS(TR_A_FIELD) } tr_acts;

// Temporaries, always fp32 (MN_CAT_TEMPORARY): released as soon as they are consumed; zeroed,
// since the backward ops add into them, except logits and losses, which are written whole. X(name).
// The activation gradients among them (dx, dln, dfch, datty, dqkv, dlogits) are rounded to the
// 16-bit type after every op under --precision fp16|bf16, as a 16-bit backward would hold them:
// that is where fp16 overflows and the loss scaler earns its keep.
#define TR_TEMPS(X) X(logits) X(losses) X(dlosses) X(dlogits) X(dx) X(dln) X(dfch) X(datty) X(dqkv)
#define TR_T_FIELD(name) float *name;
typedef struct tr_temps { TR_TEMPS(TR_T_FIELD) } tr_temps;

// ---- the model ----------------------------------------------------------------------------------

// The state of one parameter tensor under cfg.optim (the member named after it).
typedef union tr_optim_state {
    mn_adamw adamw;          // MN_OPTIM_ADAMW
    mn_adamw8bit adamw8bit;  // MN_OPTIM_ADAMW_8BIT
    mn_sgd sgd;              // MN_OPTIM_SGD, MN_OPTIM_SGD_MOMENTUM
    mn_adafactor adafactor;  // MN_OPTIM_ADAFACTOR
    mn_lion lion;            // MN_OPTIM_LION
} tr_optim_state;

// The groups of weights one part of the model reads, for tr_weights_open.
enum { TR_G_BLOCK, TR_G_EMBED, TR_G_HEAD };

typedef struct tr_model {
    tr_config cfg;
    mn_dtype half;            // 0 (fp32), MN_FP16 or MN_BF16: the storage of weights and acts
    mn_hostdev dev;           // host memory as the device
    mn_cache cache;           // every tensor below comes from it
    int cache_ready;
    tr_params params;         // fp32 weights: MN_CAT_WEIGHTS, or MN_CAT_MASTER_WEIGHTS when half
    uint16_t *w16[TR_NUM_PARAMS];  // half: the 16-bit weights the model computes with
    tr_params grads;          // MN_CAT_GRADIENTS, fp32, same shapes
    uint64_t dims[TR_NUM_PARAMS][2];
    uint64_t num_params;
    tr_optim_state opt[TR_NUM_PARAMS];  // MN_CAT_OPTIMIZER, created at the first step
    void *opt_block[TR_NUM_PARAMS];     // the one block of state each holds (NULL: none)
    int opt_ready, opt_current;         // opt_current: the tensor whose state is being made
    mn_loss_scaler scaler;    // fp16: the dynamic loss scale
    long step;                // optimizer steps taken (skipped ones included)
    uint64_t save_fail_after; // tests: a --save write fails after this many bytes, 0 = never
    uint64_t alloc_calls;     // tensor allocations so far (for --fail-alloc-at)
    struct tr_step_info *history;  // --json: every step of this run (host memory), or NULL
    long history_len;
    int *tokens, *targets;    // [B,T], MN_CAT_OTHER (the input batch)
    uint8_t *text;            // [text_len] the --data file, MN_CAT_OTHER, or NULL
    uint64_t text_len;
    char error[256];          // what went wrong, for a failure a message can explain
    float *wview;             // half: the fp32 copy of the weights one part reads, or NULL
    tr_tensor x[TR_MAX_LAYERS + 1];  // residual stream [B,T,C], MN_CAT_ACTIVATIONS
    tr_acts acts[TR_MAX_LAYERS];
    tr_tensor lnf, lnf_mean, lnf_rstd, probs;  // [N,C], [N], [N], [N,V] (probs in fp32)
    tr_temps tmp;
    tr_markov data;
    int *tok_host, *tgt_host; // [B,T] the batch as tr_next_batch writes it (tokens, targets on
                              // the CPU; host buffers uploaded each micro-batch on a GPU)
    int gpu;                  // --device cuda: every pointer above is device memory (in the
                              // storage type: half-precision pointers are only cast to float *)
#ifdef MEMANAT_CUDA
    mn_cuda cuda;             // the context: stream, cuBLASLt, kernels' scratch
    int cuda_ready;
    float *norms;             // [tensors] per-tensor gradient norms, MN_CAT_OTHER (device)
    void *workspace;          // the cuBLASLt workspace, MN_CAT_WORKSPACE (device)
    uint64_t workspace_bytes; // its size, as the context resolved it (the GPU table's)
    void *scratch;            // the kernels' scratch, MN_CAT_WORKSPACE (device): attention's
    uint64_t scratch_bytes;   // backward (mn_attention_scratch), the largest they ask for
    float *losses_host, *norms_host;  // [N], [tensors] read back from the device
    uint64_t opt_bytes[TR_NUM_PARAMS];  // each tensor's optimizer state (opt_block) bytes
    uint64_t opt_steps;       // updates the optimizer took (skipped steps not counted)
#endif
} tr_model;

// bytes from the cache under cat, with a label; the fail_alloc_at-th call fails as the device
// would when full. A failure leaves its explanation in m->error.
static mn_result tr_cache_alloc(tr_model *m, uint64_t bytes, mn_category cat, const char *label,
                                void **out) {
    struct mn_cache_stats st;
    mn_result r = ++m->alloc_calls == m->cfg.fail_alloc_at
                  ? MN_ERR_DEVICE_OOM : mn_cache_alloc(&m->cache, bytes, 0, cat, label, out);
    char cap[48] = "";
    if (r == MN_OK) return MN_OK;
    *out = NULL;
    if (m->cfg.capacity)
        snprintf(cap, sizeof cap, " of --capacity %.2f MiB", (double)m->cfg.capacity / TR_MIB);
    if (mn_cache_stats(&m->cache, &st) == MN_OK)
        snprintf(m->error, sizeof m->error, "%s allocating %s (%s, %.2f MiB) with %.2f MiB "
                 "allocated and %.2f MiB reserved%s (allocation %llu)",
                 r == MN_ERR_DEVICE_OOM ? "out of memory" : mn_result_str(r), label,
                 mn_category_name(cat), (double)bytes / TR_MIB,
                 (double)st.allocated_bytes[MN_STAT_ALL].current / TR_MIB,
                 (double)st.reserved_bytes[MN_STAT_ALL].current / TR_MIB, cap,
                 (unsigned long long)m->alloc_calls);
    return r;
}

// A block of n elements of size elem from the cache, zeroed when zero is set.
static mn_result tr_alloc(tr_model *m, uint64_t n, size_t elem, mn_category cat,
                          const char *label, int zero, void *out) {
    uint64_t bytes;
    void *p = NULL;
    TR_TRY(mn_mul_u64(n, elem, &bytes));
    if (bytes > SIZE_MAX) return MN_ERR_OVERFLOW;
    TR_TRY(tr_cache_alloc(m, bytes, cat, label, &p));
#ifdef MEMANAT_CUDA
    if (zero && p && m->gpu) TR_TRY(mn_cuda_mem_set(&m->cuda, p, 0, bytes));
    else
#endif
    if (zero && p) memset(p, 0, (size_t)bytes);
    memcpy(out, &p, sizeof p);  // out is a float **, uint16_t ** or int **
    return MN_OK;
}

static mn_result tr_temp(tr_model *m, uint64_t n, const char *label, float **out) {
    return tr_alloc(m, n, sizeof(float), MN_CAT_TEMPORARY, label, 1, out);
}

// Releases *p (NULL is fine) and clears it.
static mn_result tr_release(tr_model *m, float **p) {
    mn_result r = mn_cache_release(&m->cache, *p);
    *p = NULL;
    return r;
}

// fp32 <-> the 16-bit storage type.
static void tr_to16(const tr_model *m, const float *src, uint16_t *dst, uint64_t n) {
    if (m->half == MN_FP16) mn_fp32_to_fp16_array(src, dst, n);
    else mn_fp32_to_bf16_array(src, dst, n);
}
static void tr_to32(const tr_model *m, const uint16_t *src, float *dst, uint64_t n) {
    if (m->half == MN_FP16) mn_fp16_to_fp32_array(src, dst, n);
    else mn_bf16_to_fp32_array(src, dst, n);
}

// Rounds f [n] to the values the 16-bit type holds (nothing in fp32).
static void tr_round(const tr_model *m, float *f, uint64_t n) {
    uint16_t buf[1024];
    uint64_t i, k;
    if (!m->half) return;
    for (i = 0; i < n; i += k) {
        k = n - i < 1024 ? n - i : 1024;
        tr_to16(m, f + i, buf, k);
        tr_to32(m, buf, f + i, k);
    }
}

// A new activation of n elements (fp32 set: stored in fp32 at every precision), opened. On a GPU
// the kernels read the storage itself: no view (half 0, f NULL).
static mn_result tr_new(tr_model *m, tr_tensor *t, uint64_t n, int fp32, const char *name) {
    int half = m->half && !fp32;
    memset(t, 0, sizeof *t);
    t->n = n, t->half = half && !m->gpu, t->name = name;
    TR_TRY(tr_alloc(m, n, half ? 2 : 4, MN_CAT_ACTIVATIONS, name, 0, &t->data));
    if (m->gpu) return MN_OK;
    if (!t->half) t->f = (float *)t->data;
    else TR_TRY(tr_alloc(m, n, sizeof(float), MN_CAT_TEMPORARY, name, 0, &t->f));
    return MN_OK;
}

// The fp32 view of t, to read: a 16-bit tensor is converted into a temporary copy.
static mn_result tr_open(tr_model *m, tr_tensor *t) {
    if (t->f) return MN_OK;
    TR_TRY(tr_alloc(m, t->n, sizeof(float), MN_CAT_TEMPORARY, t->name, 0, &t->f));
    tr_to32(m, (const uint16_t *)t->data, t->f, t->n);
    return MN_OK;
}

// An op wrote t's view: store it, and round the view to what is stored, so that the rest of the
// forward and the backward read the same values.
static void tr_keep(tr_model *m, tr_tensor *t) {
    if (!t->half) return;
    tr_to16(m, t->f, (uint16_t *)t->data, t->n);
    tr_to32(m, (const uint16_t *)t->data, t->f, t->n);
}

// Releases a 16-bit tensor's fp32 view.
static mn_result tr_close(tr_model *m, tr_tensor *t) {
    if (!t->half) return MN_OK;
    return tr_release(m, &t->f);
}

// Releases the tensor (NULL data is fine).
static mn_result tr_free(tr_model *m, tr_tensor *t) {
    mn_result r = tr_close(m, t), r2 = mn_cache_release(&m->cache, t->data);
    memset(t, 0, sizeof *t);
    return r != MN_OK ? r : r2;
}

// Releases whatever a block still holds.
static mn_result tr_acts_free(tr_model *m, tr_acts *a) {
#define TR_A_FREE(name, numel, fp32) TR_TRY(tr_free(m, &a->name));
    MN_GPT_ACTS(TR_A_FREE)
#undef TR_A_FREE
    return MN_OK;
}

// The fp32 weights of one part of the model, as views into v (a tr_params whose pointers point
// at layer l's rows for TR_G_BLOCK): the parameters themselves in fp32; with 16-bit weights one
// temporary holding their fp32 conversion (m->wview, released by tr_weights_close).
static int tr_in_group(const tr_model *m, int i, int group) {
    if (group == TR_G_BLOCK) return tr_param_per_layer(i);
    if (group == TR_G_EMBED) return i == TR_P_wte || i == TR_P_wpe;
    return i == TR_P_lnfw || i == TR_P_lnfb || i == (m->cfg.tied ? TR_P_wte : TR_P_lmw);
}

static mn_result tr_weights_open(tr_model *m, int group, size_t l, tr_params *v) {
    float **ps[TR_NUM_PARAMS], **vs[TR_NUM_PARAMS];
    uint64_t total = 0, at = 0, n[TR_NUM_PARAMS], off[TR_NUM_PARAMS];
    int i;
    memset(v, 0, sizeof *v);
    tr_param_slots(&m->params, ps);
    tr_param_slots(v, vs);
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        n[i] = off[i] = 0;
        if (!tr_in_group(m, i, group)) continue;
        n[i] = m->dims[i][0] * m->dims[i][1];
        if (tr_param_per_layer(i)) n[i] /= m->cfg.L, off[i] = (uint64_t)l * n[i];
        total += n[i];
    }
    if (m->half) TR_TRY(tr_temp(m, total, "weights.fp32", &m->wview));
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        if (!n[i]) continue;
        if (!m->half) { *vs[i] = *ps[i] + off[i]; continue; }
        *vs[i] = m->wview + at;
        tr_to32(m, m->w16[i] + off[i], *vs[i], n[i]);
        at += n[i];
    }
    return MN_OK;
}

static mn_result tr_weights_close(tr_model *m) { return tr_release(m, &m->wview); }

static void tr_fill_normal(float *w, uint64_t n, double std, uint64_t *rng) {
    uint64_t i;
    for (i = 0; i < n; i++) w[i] = (float)(std * tr_rand_normal(rng));
}

// Reads the --data file into the cache (MN_CAT_OTHER): MN_ERR_IO when it cannot be read,
// MN_ERR_INVALID_ARG when it has fewer than T + 1 bytes (one window), with m->error set.
static mn_result tr_load_text(tr_model *m, const char *path) {
    FILE *f = fopen(path, "rb");
    long len = 0;
    mn_result r = MN_ERR_IO;
    if (!f || fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        snprintf(m->error, sizeof m->error, "cannot read --data %s", path);
        goto close;
    }
    if ((uint64_t)len < (uint64_t)m->cfg.T + 1) {
        snprintf(m->error, sizeof m->error, "--data %s has %ld bytes, fewer than --seq %zu + 1",
                 path, len, m->cfg.T);
        r = MN_ERR_INVALID_ARG;
        goto close;
    }
    if (m->gpu && (uint64_t)len <= SIZE_MAX) {  // read by the host only
        if (!(m->text = (uint8_t *)malloc((size_t)len))) r = MN_ERR_OUT_OF_MEMORY;
        else r = MN_OK;
    } else {
        r = tr_alloc(m, (uint64_t)len, 1, MN_CAT_OTHER, "data", 0, &m->text);
    }
    if (r != MN_OK) goto close;
    m->text_len = (uint64_t)len;
    if (fread(m->text, 1, (size_t)len, f) != (size_t)len) {
        snprintf(m->error, sizeof m->error, "cannot read --data %s", path);
        r = MN_ERR_IO;
    }
close:
    if (f) fclose(f);
    return r;
}

// Entries of the cache's history ring for --memory-svg and --snapshot, enough for one step: a
// micro-batch allocates under 64 tensors per block (twice that recomputing with checkpointing,
// counting the fp32 views of 16-bit storage) and under 64 for the embedding and the head, each
// leaving up to 3 events (alloc, free requested, free completed), plus the optimizer's first
// allocations and the segments. Within [TR_TRACE_MIN, TR_TRACE_MAX]; a longer step keeps its
// most recent events.
static uint32_t tr_trace_entries(const tr_config *cfg) {
    double per_micro = 64.0 * (double)cfg->L * (cfg->checkpointing ? 2.0 : 1.0) + 64.0;
    double n = 4.0 * ((double)cfg->K * per_micro + 2.0 * TR_NUM_PARAMS);
    return n < TR_TRACE_MIN ? TR_TRACE_MIN : n > TR_TRACE_MAX ? TR_TRACE_MAX : (uint32_t)n;
}

// Parameter i's initial values into w[n] (host memory): GPT-2 init, N(0, 0.02), residual
// projections scaled by 1/sqrt(2L), layernorms 1 and 0.
static void tr_param_fill(const tr_model *m, int i, float *w, uint64_t n, uint64_t *rng) {
    uint64_t k;
    if (tr_param_init[i] == MN_GPT_INIT_ONE) {
        for (k = 0; k < n; k++) w[k] = 1.0f;
    } else if (tr_param_init[i] == MN_GPT_INIT_ZERO) {
        memset(w, 0, (size_t)n * sizeof(float));
    } else {
        double std = tr_param_init[i] == MN_GPT_INIT_RESID ? 0.02 / sqrt(2.0 * (double)m->cfg.L)
                                                           : 0.02;
        tr_fill_normal(w, n, std, rng);
    }
}

#ifdef MEMANAT_CUDA
static mn_result tr_gpu_init(tr_model *m, mn_cache_desc *cd);
static mn_result tr_gpu_init_params(tr_model *m, int i, uint64_t n, uint64_t *rng);
static mn_result tr_gpu_init_rest(tr_model *m);
static mn_result tr_gpu_zero_grad(tr_model *m);
static mn_result tr_gpu_forward(tr_model *m, float dloss, double *loss);
static mn_result tr_gpu_backward(tr_model *m);
static mn_result tr_gpu_update(tr_model *m, float lr, float *norm, int *skipped);
static mn_result tr_gpu_optim_init(tr_model *m, int i);
#endif

// Sets up the device, the cache, the weights (tr_param_fill; their 16-bit copies), zeroed
// gradients, the loss scaler, the input batch and the data. On a GPU (tr_gpu_init) the weights
// are made on the host and copied up; the gradients are in the storage type. On failure
// tr_model_free still releases what was made.
static mn_result tr_model_init(tr_model *m, const tr_config *cfg) {
    mn_cache_desc cd;
    mn_hostdev_desc hd;
    float **ps[TR_NUM_PARAMS], **gs[TR_NUM_PARAMS];
    uint64_t rng = tr_seed_stream(cfg->seed, 1), n, N = (uint64_t)cfg->B * cfg->T;
    char label[MN_CACHE_LABEL_MAX];
    int i;
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->half = cfg->precision == MN_PREC_FP16 ? MN_FP16
              : cfg->precision == MN_PREC_BF16 ? MN_BF16 : (mn_dtype)0;
    if (cfg->L < 1 || cfg->L > TR_MAX_LAYERS || cfg->NH < 1 || cfg->C % cfg->NH != 0 ||
        cfg->T < 1 || cfg->B < 1 || cfg->K < 1 || cfg->V < TR_V)
        return MN_ERR_INVALID_ARG;
    memset(&cd, 0, sizeof cd);
    if (cfg->memory_svg || cfg->snapshot) cd.trace_entries = tr_trace_entries(cfg);
    if (cfg->device == TR_DEVICE_CUDA) {
#ifdef MEMANAT_CUDA
        TR_TRY(tr_gpu_init(m, &cd));  // the context, the cache over cudaMalloc
#else
        return MN_ERR_UNSUPPORTED;
#endif
    } else {
        memset(&hd, 0, sizeof hd);
        hd.capacity = cfg->capacity;
        TR_TRY(mn_hostdev_init(&m->dev, &hd));
        cd.device = mn_hostdev_device(&m->dev);
        TR_TRY(mn_cache_init(&m->cache, &cd));
        m->cache_ready = 1;
    }
    tr_param_dims(cfg, m->dims);
    tr_param_slots(&m->params, ps);
    tr_param_slots(&m->grads, gs);
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        if ((n = m->dims[i][0] * m->dims[i][1]) == 0) continue;  // a tied head
        m->num_params += n;
        if (m->half)
            TR_TRY(tr_alloc(m, n, 2, MN_CAT_WEIGHTS, tr_param_names[i], 0, &m->w16[i]));
        snprintf(label, sizeof label, "%s%s", m->half ? "master." : "", tr_param_names[i]);
        TR_TRY(tr_alloc(m, n, sizeof(float), m->half ? MN_CAT_MASTER_WEIGHTS : MN_CAT_WEIGHTS,
                        label, 0, ps[i]));
        snprintf(label, sizeof label, "grad.%s", tr_param_names[i]);
        TR_TRY(tr_alloc(m, n, m->gpu && m->half ? 2 : sizeof(float), MN_CAT_GRADIENTS, label, 1,
                        gs[i]));
#ifdef MEMANAT_CUDA
        if (m->gpu) {
            TR_TRY(tr_gpu_init_params(m, i, n, &rng));
            continue;
        }
#endif
        tr_param_fill(m, i, *ps[i], n, &rng);
        if (m->half) tr_to16(m, *ps[i], m->w16[i], n);
    }
    TR_TRY(mn_loss_scaler_init(&m->scaler, NULL));
    TR_TRY(tr_alloc(m, N, sizeof(int), MN_CAT_OTHER, "tokens", 1, &m->tokens));
    TR_TRY(tr_alloc(m, N, sizeof(int), MN_CAT_OTHER, "targets", 1, &m->targets));
    m->tok_host = m->tokens, m->tgt_host = m->targets;
#ifdef MEMANAT_CUDA
    if (m->gpu) TR_TRY(tr_gpu_init_rest(m));  // host batch, norms, the cuBLASLt workspace
#endif
    tr_markov_init(&m->data, cfg->seed);
    return cfg->data ? tr_load_text(m, cfg->data) : MN_OK;
}

// Releases every activation and temporary still held (after a failed step, or a forward run
// without its backward).
static mn_result tr_release_activations(tr_model *m) {
    size_t l;
    for (l = 0; l <= m->cfg.L; l++) TR_TRY(tr_free(m, &m->x[l]));
    for (l = 0; l < m->cfg.L; l++) TR_TRY(tr_acts_free(m, &m->acts[l]));
    TR_TRY(tr_free(m, &m->lnf));
    TR_TRY(tr_free(m, &m->lnf_mean));
    TR_TRY(tr_free(m, &m->lnf_rstd));
    TR_TRY(tr_free(m, &m->probs));
    TR_TRY(tr_weights_close(m));
#define TR_T_RELEASE(name) TR_TRY(tr_release(m, &m->tmp.name));
    TR_TEMPS(TR_T_RELEASE)
#undef TR_T_RELEASE
    return MN_OK;
}

// ---- optimizer state ----------------------------------------------------------------------------
// One tr_optim_state per parameter tensor, created at the first step by the optimizer named in
// cfg.optim; each keeps one block of state_bytes in the cache (none for plain SGD). --lr is the
// step of every optimizer as given. Settings: no weight decay anywhere (a tiny model, short
// runs); AdamW and 8-bit AdamW betas 0.9, 0.999 (8-bit: 256-element blocks, tensors under 4096
// elements keep fp32 state); SGD momentum 0 or 0.9; Adafactor factored, no first moment, fixed
// step lr without the parameter-scale factor (scale_parameter=False); Lion betas 0.9, 0.99.
// With 16-bit weights the optimizers step the fp32 master weights and rewrite the 16-bit copy.

// The descriptor of cfg.optim with the settings above, for mn_optim_state_bytes.
static mn_optim_desc tr_optim_desc(const tr_config *cfg) {
    mn_optim_desc d;
    memset(&d, 0, sizeof d);
    d.kind = cfg->optim;
    return d;
}

// The optimizer's host memory is the cache, tagged MN_CAT_OPTIMIZER (user_data: the tr_model).
static void *tr_optim_alloc(void *user_data, size_t size) {
    tr_model *m = (tr_model *)user_data;
    void *p = NULL;
    if (tr_cache_alloc(m, size, MN_CAT_OPTIMIZER, mn_optim_name(m->cfg.optim), &p) != MN_OK)
        return NULL;
    m->opt_block[m->opt_current] = p;  // for the checkpoints
    return p;
}
static void tr_optim_free(void *user_data, void *ptr) {
    (void)mn_cache_release(&((tr_model *)user_data)->cache, ptr);
}

// Creates the state of parameter i at step size lr.
static mn_result tr_optim_state_init(tr_model *m, int i, float lr) {
    tr_optim_state *o = &m->opt[i];
    const uint64_t *dims = m->dims[i];
    mn_allocator alloc;
    memset(o, 0, sizeof *o);
    alloc.alloc_fn = tr_optim_alloc, alloc.free_fn = tr_optim_free, alloc.user_data = m;
    m->opt_current = i;
    switch (m->cfg.optim) {
    case MN_OPTIM_DEFAULT:
    case MN_OPTIM_ADAMW: {
        mn_adamw_params p;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.weight_decay = MN_OPTIM_ZERO, p.dtype = m->half;
        return mn_adamw_init(&o->adamw, dims, 2, &p, &alloc);
    }
    case MN_OPTIM_ADAMW_8BIT: {
        mn_adamw8bit_params p;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.weight_decay = MN_OPTIM_ZERO, p.dtype = m->half;
        return mn_adamw8bit_init(&o->adamw8bit, dims, 2, &p, &alloc);
    }
    case MN_OPTIM_SGD:
    case MN_OPTIM_SGD_MOMENTUM: {
        mn_sgd_params p;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.momentum = m->cfg.optim == MN_OPTIM_SGD_MOMENTUM ? 0.9f : 0.0f;
        p.dtype = m->half;
        return mn_sgd_init(&o->sgd, dims, 2, &p, &alloc);
    }
    case MN_OPTIM_ADAFACTOR: {
        mn_adafactor_params p;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.no_scale_parameter = 1, p.dtype = m->half;
        return mn_adafactor_init(&o->adafactor, dims, 2, &p, &alloc);
    }
    case MN_OPTIM_LION: {
        mn_lion_params p;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.weight_decay = MN_OPTIM_ZERO, p.dtype = m->half;
        return mn_lion_init(&o->lion, dims, 2, &p, &alloc);
    }
    case MN_OPTIM_NONE:
    case MN_OPTIM_COUNT: break;
    }
    return MN_ERR_INVALID_ARG;
}

// One step of parameter i: its fp32 values updated in place from its gradient at step size lr
// (and the 16-bit copy rewritten when half).
static mn_result tr_optim_state_step(tr_model *m, int i, float *param, const float *grad,
                                     float lr) {
    tr_optim_state *o = &m->opt[i];
    uint16_t *p16 = m->w16[i];
    switch (m->cfg.optim) {
    case MN_OPTIM_DEFAULT:
    case MN_OPTIM_ADAMW:
        o->adamw.params.lr = lr;
        return mn_adamw_step(&o->adamw, param, grad, p16);
    case MN_OPTIM_ADAMW_8BIT:
        o->adamw8bit.params.lr = lr;
        return mn_adamw8bit_step(&o->adamw8bit, param, grad, p16);
    case MN_OPTIM_SGD:
    case MN_OPTIM_SGD_MOMENTUM:
        o->sgd.params.lr = lr;
        return mn_sgd_step(&o->sgd, param, grad, p16);
    case MN_OPTIM_ADAFACTOR:
        o->adafactor.params.lr = lr;
        return mn_adafactor_step(&o->adafactor, param, grad, p16);
    case MN_OPTIM_LION:
        o->lion.params.lr = lr;
        return mn_lion_step(&o->lion, param, grad, p16);
    case MN_OPTIM_NONE:
    case MN_OPTIM_COUNT: break;
    }
    return MN_ERR_INVALID_ARG;
}

// Bytes of state parameter i holds (0 before the first step).
static uint64_t tr_optim_state_bytes(const tr_model *m, int i) {
    const tr_optim_state *o = &m->opt[i];
    switch (m->cfg.optim) {
    case MN_OPTIM_DEFAULT:
    case MN_OPTIM_ADAMW: return o->adamw.state_bytes;
    case MN_OPTIM_ADAMW_8BIT: return o->adamw8bit.state_bytes;
    case MN_OPTIM_SGD:
    case MN_OPTIM_SGD_MOMENTUM: return o->sgd.state_bytes;
    case MN_OPTIM_ADAFACTOR: return o->adafactor.state_bytes;
    case MN_OPTIM_LION: return o->lion.state_bytes;
    case MN_OPTIM_NONE:
    case MN_OPTIM_COUNT: break;
    }
    return 0;
}

// *held: the state bytes the parameters hold; *predicted: the estimator's mn_optim_state_bytes
// for the same descriptor and shapes (equal once the state exists).
static mn_result tr_optim_bytes(const tr_model *m, uint64_t *held, uint64_t *predicted) {
    mn_optim_desc d = tr_optim_desc(&m->cfg);
    uint64_t bytes;
    int i;
    *held = 0, *predicted = 0;
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        if (m->dims[i][0] * m->dims[i][1] == 0) continue;
        TR_TRY(mn_optim_state_bytes(&d, m->dims[i], 2, &bytes));
        TR_TRY(mn_add_u64(*predicted, bytes, predicted));
#ifdef MEMANAT_CUDA
        if (m->gpu) {
            TR_TRY(mn_add_u64(*held, m->opt_bytes[i], held));
            continue;
        }
#endif
        TR_TRY(mn_add_u64(*held, tr_optim_state_bytes(m, i), held));
    }
    return MN_OK;
}

// Releases the state of parameter i (a zeroed one is a no-op).
static void tr_optim_state_free(tr_model *m, int i) {
    tr_optim_state *o = &m->opt[i];
    switch (m->cfg.optim) {
    case MN_OPTIM_DEFAULT:
    case MN_OPTIM_ADAMW: mn_adamw_free(&o->adamw); break;
    case MN_OPTIM_ADAMW_8BIT: mn_adamw8bit_free(&o->adamw8bit); break;
    case MN_OPTIM_SGD:
    case MN_OPTIM_SGD_MOMENTUM: mn_sgd_free(&o->sgd); break;
    case MN_OPTIM_ADAFACTOR: mn_adafactor_free(&o->adafactor); break;
    case MN_OPTIM_LION: mn_lion_free(&o->lion); break;
    case MN_OPTIM_NONE:
    case MN_OPTIM_COUNT: break;
    }
    m->opt_block[i] = NULL;
}

// The step counter of parameter i's state (for the checkpoints).
static uint64_t *tr_optim_state_steps(tr_model *m, int i) {
    tr_optim_state *o = &m->opt[i];
    switch (m->cfg.optim) {
    case MN_OPTIM_ADAMW_8BIT: return &o->adamw8bit.step;
    case MN_OPTIM_SGD:
    case MN_OPTIM_SGD_MOMENTUM: return &o->sgd.step;
    case MN_OPTIM_ADAFACTOR: return &o->adafactor.step;
    case MN_OPTIM_LION: return &o->lion.step;
    default: return &o->adamw.step;
    }
}

// Frees everything; MN_OK when the device got every segment back.
static mn_result tr_model_free(tr_model *m) {
    int i;
    if (m->cache_ready) (void)tr_release_activations(m);  // mn_cache_free would return them too
    for (i = 0; i < TR_NUM_PARAMS; i++) tr_optim_state_free(m, i);  // zeroed ones are no-ops
    if (m->cache_ready) mn_cache_free(&m->cache);  // returns every segment to the device
    m->cache_ready = 0;
    free(m->history);
    m->history = NULL;
#ifdef MEMANAT_CUDA
    if (m->gpu) {  // the host side of a GPU model, then the context
        free(m->text), free(m->tok_host), free(m->tgt_host);
        free(m->losses_host), free(m->norms_host);
        m->text = NULL, m->tok_host = m->tgt_host = NULL, m->losses_host = m->norms_host = NULL;
        if (m->cuda_ready) mn_cuda_free(&m->cuda);
        m->cuda_ready = 0;
    }
#endif
    return mn_hostdev_free(&m->dev);
}

// ---- layers -------------------------------------------------------------------------------------
// One transformer block, forward. Its input is x[l] [B,T,C]. With recompute set (checkpointing)
// the block's output x[l + 1] already exists and its backward does not need it, so the last
// projection is skipped. The residual adds write into the projection's output buffer. Every
// activation is made (tr_new), written through its fp32 view, stored (tr_keep); the views of a
// 16-bit model are released at the end of the block. --checkpointing selective keeps no
// attention probabilities: the backward recomputes them.
static mn_result tr_block_forward(tr_model *m, size_t l, int recompute) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, NH = m->cfg.NH, N = B * T;
    tr_acts *a = &m->acts[l];
    tr_tensor *x = &m->x[l];
    tr_params w;
    float *att;
    TR_TRY(tr_weights_open(m, TR_G_BLOCK, l, &w));
    TR_TRY(tr_open(m, x));
#define TR_A_NEW(name, numel, fp32) \
    if (&a->name != &a->att || m->cfg.checkpointing != TR_CKPT_SELECTIVE) \
        TR_TRY(tr_new(m, &a->name, numel, fp32, #name));
    MN_GPT_ACTS(TR_A_NEW)
#undef TR_A_NEW
    // ln1 [N,C] = layernorm(x); qkv [N,3C] = ln1 @ qkvw^T + qkvb
    TR_TRY(mn_layernorm_forward(a->ln1.f, a->ln1_mean.f, a->ln1_rstd.f, x->f, w.ln1w, w.ln1b, N, C,
                                TR_LN_EPS));
    tr_keep(m, &a->ln1);
    TR_TRY(mn_matmul_forward(a->qkv.f, NULL, a->ln1.f, w.qkvw, w.qkvb, N, C, 3 * C));
    tr_keep(m, &a->qkv);
    // atty [N,C] = causal attention over qkv (att [B,NH,T,T]: its probabilities, or none kept)
    att = a->att.f;
    TR_TRY(mn_attention_forward(a->atty.f, att, a->qkv.f, B, T, C, NH, 1));
    if (att) tr_keep(m, &a->att);
    tr_keep(m, &a->atty);
    // res2 [N,C] = x + atty @ attprojw^T + attprojb
    TR_TRY(mn_matmul_forward(a->res2.f, NULL, a->atty.f, w.attprojw, w.attprojb, N, C, C));
    TR_TRY(mn_residual_forward(a->res2.f, a->res2.f, x->f, N * C));
    tr_keep(m, &a->res2);
    // ln2 [N,C]; fch [N,4C] = ln2 @ fcw^T + fcb, fch_gelu = gelu(fch) (fused epilogue)
    TR_TRY(mn_layernorm_forward(a->ln2.f, a->ln2_mean.f, a->ln2_rstd.f, a->res2.f, w.ln2w, w.ln2b,
                                N, C, TR_LN_EPS));
    tr_keep(m, &a->ln2);
    TR_TRY(mn_matmul_forward(a->fch_gelu.f, a->fch.f, a->ln2.f, w.fcw, w.fcb, N, C, 4 * C));
    tr_keep(m, &a->fch);
    tr_keep(m, &a->fch_gelu);
    if (!recompute) {
        // x[l + 1] [N,C] = res2 + fch_gelu @ fcprojw^T + fcprojb
        TR_TRY(tr_new(m, &m->x[l + 1], N * C, 0, "x"));
        TR_TRY(mn_matmul_forward(m->x[l + 1].f, NULL, a->fch_gelu.f, w.fcprojw, w.fcprojb, N,
                                 4 * C, C));
        TR_TRY(mn_residual_forward(m->x[l + 1].f, m->x[l + 1].f, a->res2.f, N * C));
        tr_keep(m, &m->x[l + 1]);
        TR_TRY(tr_close(m, &m->x[l + 1]));
    }
#define TR_A_CLOSE(name, numel, fp32) TR_TRY(tr_close(m, &a->name));
    MN_GPT_ACTS(TR_A_CLOSE)
#undef TR_A_CLOSE
    TR_TRY(tr_close(m, x));
    return tr_weights_close(m);
}

// One block, backward. On entry tmp.dx [N,C] holds d loss / d x[l + 1]; on return it holds
// d loss / d x[l]. A residual add passes its gradient through unchanged, so one buffer carries
// the residual stream's gradient and each branch's layernorm backward adds into it.
// Every saved activation is opened right before its first use and freed right after its last.
static mn_result tr_block_backward(tr_model *m, size_t l) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, NH = m->cfg.NH, N = B * T;
    const tr_params *g = &m->grads;
    tr_acts *a = &m->acts[l];
    tr_temps *d = &m->tmp;
    tr_params w;
    TR_TRY(tr_free(m, &m->x[l + 1]));  // the block's output: not needed from here on
    if (m->cfg.checkpointing == TR_CKPT_FULL) TR_TRY(tr_block_forward(m, l, 1));
    TR_TRY(tr_weights_open(m, TR_G_BLOCK, l, &w));
    // fc projection: dfch_gelu [N,4C] (into dfch), dfcprojw, dfcprojb; dout = dx
    TR_TRY(tr_temp(m, N * 4 * C, "dfch", &d->dfch));
    TR_TRY(tr_open(m, &a->fch_gelu));
    TR_TRY(mn_matmul_backward(d->dfch, g->fcprojw + l * C * 4 * C, g->fcprojb + l * C, d->dx,
                              a->fch_gelu.f, w.fcprojw, NULL, N, 4 * C, C));
    tr_round(m, d->dfch, N * 4 * C);
    TR_TRY(tr_free(m, &a->fch_gelu));
    // fc with the GELU: dln2 [N,C] (into dln), dfcw, dfcb; dfch becomes d pre-gelu in place
    TR_TRY(tr_temp(m, N * C, "dln", &d->dln));
    TR_TRY(tr_open(m, &a->ln2));
    TR_TRY(tr_open(m, &a->fch));
    TR_TRY(mn_matmul_backward(d->dln, g->fcw + l * 4 * C * C, g->fcb + l * 4 * C, d->dfch, a->ln2.f,
                              w.fcw, a->fch.f, N, C, 4 * C));
    tr_round(m, d->dln, N * C);
    TR_TRY(tr_release(m, &d->dfch));
    TR_TRY(tr_free(m, &a->fch));
    TR_TRY(tr_free(m, &a->ln2));
    // layernorm 2: dx += d res2 through the norm (dx then is d loss / d res2)
    TR_TRY(tr_open(m, &a->res2));
    TR_TRY(mn_layernorm_backward(d->dx, g->ln2w + l * C, g->ln2b + l * C, d->dln, a->res2.f, w.ln2w,
                                 a->ln2_mean.f, a->ln2_rstd.f, N, C));
    tr_round(m, d->dx, N * C);
    TR_TRY(tr_free(m, &a->res2));
    TR_TRY(tr_free(m, &a->ln2_mean));
    TR_TRY(tr_free(m, &a->ln2_rstd));
    // attention projection: datty [N,C], dattprojw, dattprojb; dout = dx
    TR_TRY(tr_temp(m, N * C, "datty", &d->datty));
    TR_TRY(tr_open(m, &a->atty));
    TR_TRY(mn_matmul_backward(d->datty, g->attprojw + l * C * C, g->attprojb + l * C, d->dx,
                              a->atty.f, w.attprojw, NULL, N, C, C));
    tr_round(m, d->datty, N * C);
    TR_TRY(tr_free(m, &a->atty));
    // attention: dqkv [N,3C] (the probabilities from the forward, or recomputed)
    TR_TRY(tr_temp(m, N * 3 * C, "dqkv", &d->dqkv));
    TR_TRY(tr_open(m, &a->qkv));
    if (a->att.data) TR_TRY(tr_open(m, &a->att));
    TR_TRY(mn_attention_backward(d->dqkv, d->datty, a->qkv.f, a->att.f, B, T, C, NH, 1));
    tr_round(m, d->dqkv, N * 3 * C);
    TR_TRY(tr_release(m, &d->datty));
    TR_TRY(tr_free(m, &a->att));
    TR_TRY(tr_free(m, &a->qkv));
    // qkv: dln1 [N,C] (into dln, zeroed again), dqkvw, dqkvb
    memset(d->dln, 0, N * C * sizeof(float));
    TR_TRY(tr_open(m, &a->ln1));
    TR_TRY(mn_matmul_backward(d->dln, g->qkvw + l * 3 * C * C, g->qkvb + l * 3 * C, d->dqkv,
                              a->ln1.f, w.qkvw, NULL, N, C, 3 * C));
    tr_round(m, d->dln, N * C);
    TR_TRY(tr_release(m, &d->dqkv));
    TR_TRY(tr_free(m, &a->ln1));
    // layernorm 1: dx += d x[l] through the norm
    TR_TRY(tr_open(m, &m->x[l]));
    TR_TRY(mn_layernorm_backward(d->dx, g->ln1w + l * C, g->ln1b + l * C, d->dln, m->x[l].f, w.ln1w,
                                 a->ln1_mean.f, a->ln1_rstd.f, N, C));
    tr_round(m, d->dx, N * C);
    TR_TRY(tr_close(m, &m->x[l]));
    TR_TRY(tr_release(m, &d->dln));
    TR_TRY(tr_acts_free(m, a));  // ln1_mean, ln1_rstd
    return tr_weights_close(m);
}

// ---- model forward / backward / update ----------------------------------------------------------

// Forward over m->tokens, m->targets [B,T]: *loss = mean cross-entropy (nats per token).
static mn_result tr_forward(tr_model *m, double *loss) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, L = m->cfg.L, V = m->cfg.V, N = B * T, l, n;
    tr_params w;
    double sum = 0.0;
    // x[0] [N,C] = wte[tokens] + wpe[t]
    TR_TRY(tr_weights_open(m, TR_G_EMBED, 0, &w));
    TR_TRY(tr_new(m, &m->x[0], N * C, 0, "x"));
    TR_TRY(mn_embedding_forward(m->x[0].f, m->tokens, w.wte, w.wpe, B, T, C, V));
    tr_keep(m, &m->x[0]);
    TR_TRY(tr_close(m, &m->x[0]));
    TR_TRY(tr_weights_close(m));
    for (l = 0; l < L; l++) {
        TR_TRY(tr_block_forward(m, l, 0));
        if (m->cfg.checkpointing == TR_CKPT_FULL)
            TR_TRY(tr_acts_free(m, &m->acts[l]));  // keep x[l] only
    }
    // lnf [N,C] = layernorm(x[L]); logits [N,V] = lnf @ head^T (wte when tied, else lmw)
    TR_TRY(tr_weights_open(m, TR_G_HEAD, 0, &w));
    TR_TRY(tr_new(m, &m->lnf, N * C, 0, "lnf"));
    TR_TRY(tr_new(m, &m->lnf_mean, N, 1, "lnf_mean"));
    TR_TRY(tr_new(m, &m->lnf_rstd, N, 1, "lnf_rstd"));
    TR_TRY(tr_open(m, &m->x[L]));
    TR_TRY(mn_layernorm_forward(m->lnf.f, m->lnf_mean.f, m->lnf_rstd.f, m->x[L].f, w.lnfw, w.lnfb,
                                N, C, TR_LN_EPS));
    tr_keep(m, &m->lnf);
    TR_TRY(tr_close(m, &m->x[L]));
    TR_TRY(tr_alloc(m, N * V, sizeof(float), MN_CAT_TEMPORARY, "logits", 0, &m->tmp.logits));
    TR_TRY(mn_matmul_forward(m->tmp.logits, NULL, m->lnf.f, m->cfg.tied ? w.wte : w.lmw, NULL, N,
                             C, V));
    TR_TRY(tr_close(m, &m->lnf));
    TR_TRY(tr_weights_close(m));
    // losses [N], probs [N,V] (fp32, kept for the backward; the logits are not)
    TR_TRY(tr_new(m, &m->probs, N * V, 1, "probs"));
    TR_TRY(tr_alloc(m, N, sizeof(float), MN_CAT_TEMPORARY, "losses", 0, &m->tmp.losses));
    TR_TRY(mn_crossentropy_forward(m->tmp.losses, m->probs.f, m->tmp.logits, m->targets, N, V));
    TR_TRY(tr_release(m, &m->tmp.logits));
    for (n = 0; n < N; n++) sum += m->tmp.losses[n];
    *loss = sum / (double)N;
    return tr_release(m, &m->tmp.losses);
}

// Backward of the loss scaled by dloss per token (scale/(B*T*K) for the mean over an accumulated
// step), adding into the parameter gradients; releases every activation of the forward.
static mn_result tr_backward(tr_model *m, float dloss) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, L = m->cfg.L, V = m->cfg.V, N = B * T, n, l;
    const tr_params *g = &m->grads;
    tr_temps *d = &m->tmp;
    tr_params w;
    // dlogits [N,V] = (probs - onehot(targets)) * dloss
    TR_TRY(tr_temp(m, N, "dlosses", &d->dlosses));
    for (n = 0; n < N; n++) d->dlosses[n] = dloss;
    TR_TRY(tr_temp(m, N * V, "dlogits", &d->dlogits));
    TR_TRY(mn_crossentropy_backward(d->dlogits, d->dlosses, m->probs.f, NULL, m->targets, N, V));
    tr_round(m, d->dlogits, N * V);
    TR_TRY(tr_release(m, &d->dlosses));
    TR_TRY(tr_free(m, &m->probs));
    // head: dlnf [N,C] (into dln), dhead += dlogits^T @ lnf
    TR_TRY(tr_weights_open(m, TR_G_HEAD, 0, &w));
    TR_TRY(tr_temp(m, N * C, "dln", &d->dln));
    TR_TRY(tr_open(m, &m->lnf));
    TR_TRY(mn_matmul_backward(d->dln, m->cfg.tied ? g->wte : g->lmw, NULL, d->dlogits, m->lnf.f,
                              m->cfg.tied ? w.wte : w.lmw, NULL, N, C, V));
    tr_round(m, d->dln, N * C);
    TR_TRY(tr_release(m, &d->dlogits));
    TR_TRY(tr_free(m, &m->lnf));
    // final layernorm: dx [N,C] = d loss / d x[L]
    TR_TRY(tr_temp(m, N * C, "dx", &d->dx));
    TR_TRY(tr_open(m, &m->x[L]));
    TR_TRY(mn_layernorm_backward(d->dx, g->lnfw, g->lnfb, d->dln, m->x[L].f, w.lnfw, m->lnf_mean.f,
                                 m->lnf_rstd.f, N, C));
    tr_round(m, d->dx, N * C);
    TR_TRY(tr_close(m, &m->x[L]));
    TR_TRY(tr_weights_close(m));
    TR_TRY(tr_release(m, &d->dln));
    TR_TRY(tr_free(m, &m->lnf_mean));
    TR_TRY(tr_free(m, &m->lnf_rstd));
    for (l = L; l-- > 0;) TR_TRY(tr_block_backward(m, l));
    // embedding: dwte[tokens] += dx, dwpe[t] += dx
    TR_TRY(mn_embedding_backward(g->wte, g->wpe, d->dx, m->tokens, B, T, C, V));
    TR_TRY(tr_release(m, &d->dx));
    return tr_free(m, &m->x[0]);
}

static void tr_zero_grad(tr_model *m) {
    float **gs[TR_NUM_PARAMS];
    int i;
    tr_param_slots(&m->grads, gs);
    for (i = 0; i < TR_NUM_PARAMS; i++)
        if (*gs[i]) memset(*gs[i], 0, (size_t)(m->dims[i][0] * m->dims[i][1]) * sizeof(float));
}

// The next micro-batch tokens, targets [B,T]: from the Markov stream, or B windows of T + 1
// bytes of the --data file at random offsets.
static void tr_next_batch(tr_model *m) {
    size_t b, t, B = m->cfg.B, T = m->cfg.T;
    if (!m->text) {
        tr_markov_batch(&m->data, m->tok_host, m->tgt_host, B, T);
        return;
    }
    for (b = 0; b < B; b++) {
        uint64_t at = tr_rand_u64(&m->data.rng) % (m->text_len - T);
        for (t = 0; t < T; t++) {
            m->tok_host[b * T + t] = m->text[at + t];
            m->tgt_host[b * T + t] = m->text[at + t + 1];
        }
    }
}

// The gradients of one optimizer step: zeroed, then K micro-batches of the data stream, each
// forward and backward with the loss scaled by scale/(B*T*K) (scale: the fp16 loss scale, else
// 1). *loss: the mean over the K.
static mn_result tr_accumulate(tr_model *m, double *loss) {
    size_t k, K = m->cfg.K;
    double scale = m->half == MN_FP16 ? (double)m->scaler.scale : 1.0;
    float dloss = (float)(scale / ((double)m->cfg.B * (double)m->cfg.T * (double)K));
    double micro, sum = 0.0;
#ifdef MEMANAT_CUDA
    if (m->gpu) {  // the fused cross-entropy needs dloss in the forward
        TR_TRY(tr_gpu_zero_grad(m));
        for (k = 0; k < K; k++, sum += micro) {
            tr_next_batch(m);
            TR_TRY(tr_gpu_forward(m, dloss, &micro));
            TR_TRY(tr_gpu_backward(m));
        }
        *loss = sum / (double)K;
        return MN_OK;
    }
#endif
    tr_zero_grad(m);
    for (k = 0; k < K; k++) {
        tr_next_batch(m);
        TR_TRY(tr_forward(m, &micro));
        TR_TRY(tr_backward(m, dloss));
        sum += micro;
    }
    *loss = sum / (double)K;
    return MN_OK;
}

// One optimizer step at lr, creating the optimizer state at the first call. fp16: the gradients
// are unscaled and checked for inf/NaN (--inject-overflow plants an inf in this step's first
// gradient); an overflow skips the step and the scaler backs off (*skipped = 1). Then the
// gradients are clipped by their global norm (*norm: before clipping).
static mn_result tr_update(tr_model *m, float lr, float *norm, int *skipped) {
    float **ps[TR_NUM_PARAMS], **gs[TR_NUM_PARAMS], *grads[TR_NUM_PARAMS];
    uint64_t sizes[TR_NUM_PARAMS];
    float max_norm = m->cfg.clip > 0.0f ? m->cfg.clip : (float)HUGE_VAL;
    uint32_t count = 0;
    int i, found_inf = 0, skip = 0;
#ifdef MEMANAT_CUDA
    if (m->gpu) return tr_gpu_update(m, lr, norm, skipped);
#endif
    tr_param_slots(&m->params, ps);
    tr_param_slots(&m->grads, gs);
    m->step++;
    *skipped = 0, *norm = 0.0f;
    for (i = 0; i < TR_NUM_PARAMS; i++)
        if (*gs[i]) grads[count] = *gs[i], sizes[count++] = m->dims[i][0] * m->dims[i][1];
    if (m->half == MN_FP16) {
        float inv = mn_loss_scaler_inv_scale(&m->scaler);
        if (m->step == m->cfg.inject_overflow) grads[0][0] = (float)HUGE_VAL;
        for (i = 0; i < (int)count; i++)
            TR_TRY(mn_unscale_grads(MN_FP32, grads[i], sizes[i], inv, &found_inf));
        TR_TRY(mn_loss_scaler_update(&m->scaler, found_inf, &skip));
        if (skip) { *skipped = 1; return MN_OK; }
    }
    TR_TRY(mn_clip_grad_norm(grads, sizes, count, max_norm, 2.0f, norm));
    if (!m->opt_ready) {
        for (i = 0; i < TR_NUM_PARAMS; i++)
            if (*ps[i]) TR_TRY(tr_optim_state_init(m, i, lr));
        m->opt_ready = 1;
    }
    for (i = 0; i < TR_NUM_PARAMS; i++)
        if (*ps[i]) TR_TRY(tr_optim_state_step(m, i, *ps[i], *gs[i], lr));
    return MN_OK;
}


#ifdef MEMANAT_CUDA
// ---- the GPU path (--device cuda) ---------------------------------------------------------------
// The same model, step and allocation discipline on the device: every tensor from the caching
// allocator over mn_cuda_device (cudaMalloc), every op a launcher of memanat_cuda.cu taking the
// CPU op's arguments in the same order (>>cuda), all on the context's stream. What differs (and
// the estimator's memanat framework on a GPU replays, mn__gpt_*): the kernels read and write the
// storage type directly, so there are no fp32 views and no weight temporaries, and with 16-bit
// storage the gradients and the backward's temporaries are 16-bit too (llm.c's train_gpt2.cu
// keeps them so); the fused cross-entropy writes dlogits over the logits in the forward (dloss is
// known then), so no probabilities are stored; the gradient norm is taken per tensor on the
// device and summed on the host, which decides the fp16 loss scaler's skip, and the unscale and
// the clipping are fused into the optimizer kernels; the cuBLASLt workspace comes from the cache.
// The host keeps the input batch and reads back the losses and the norms (a few KiB a step).

// The storage type the kernels take.
static mn_dtype tr_gpu_dtype(const tr_model *m) { return m->half ? m->half : MN_FP32; }

// Device failures: the launcher's logged CUDA / cuBLAS text becomes the run's error line.
static void tr_gpu_log(void *user_data, mn_log_level level, const char *msg) {
    tr_model *m = (tr_model *)user_data;
    if (level == MN_LOG_ERROR) snprintf(m->error, sizeof m->error, "%s", msg);
}

// The GPU table entry of a device with this SM and total memory: of the entries with its SM,
// the one whose capacity is nearest (the first of equals), so that an H200 is named h200 and not
// h100-80gb; entries of one SM share the rules the prediction takes from the table (the
// workspace). A device of an SM the table lacks: h100-80gb from sm 90 on, else a100-80gb.
static const char *tr_gpu_entry(int sm, uint64_t total) {
    const mn_gpu *best = NULL;
    uint64_t dbest = 0;
    uint32_t i;
    for (i = 0; i < mn_gpu_count(); i++) {
        const mn_gpu *g = mn_gpu_get(i);
        uint64_t d = g->capacity > total ? g->capacity - total : total - g->capacity;
        if (g->sm == (uint32_t)sm && (!best || d < dbest)) best = g, dbest = d;
    }
    return best ? best->name : sm >= 90 ? "h100-80gb" : "a100-80gb";
}

// What the estimator needs of the device behind ctx: its memory (cudaMemGetInfo: total, and the
// CUDA context's bytes as total - free, so other processes on the GPU count too) and its GPU
// table entry for the prediction (tr_gpu_entry).
static mn_result tr_gpu_describe(mn_cuda *ctx, tr_config *cfg) {
    mn_device dev = mn_cuda_device(ctx);
    uint64_t free_b = 0, total_b = 0;
    if (dev.mem_info_fn) TR_TRY(dev.mem_info_fn(dev.user_data, &free_b, &total_b));
    cfg->gpu_total = total_b, cfg->gpu_context = total_b > free_b ? total_b - free_b : 0;
    cfg->gpu = tr_gpu_entry(ctx->sm, total_b);
    return MN_OK;
}

// --budget on a GPU plans before the model exists: a context of its own, opened and closed, tells
// the device's memory, its context's bytes and its GPU table entry (tr_gpu_init measures them
// again for the run). A failure is the run's error line.
static void tr_probe_log(void *user_data, mn_log_level level, const char *msg) {
    if (level == MN_LOG_ERROR) snprintf((char *)user_data, 160, "%s", msg);
}

static mn_result tr_gpu_probe(tr_config *cfg, char *err, size_t cap) {
    mn_cuda ctx;
    mn_cuda_desc d;
    char why[160] = "";
    mn_result r;
    memset(&d, 0, sizeof d);
    d.logger.log_fn = tr_probe_log, d.logger.user_data = why;
    r = mn_cuda_init(&ctx, &d);
    if (r == MN_OK) r = tr_gpu_describe(&ctx, cfg);
    if (r != MN_OK)
        snprintf(err, cap, "--device cuda --budget: cannot read the GPU's memory: %s",
                 why[0] ? why : mn_result_str(r));
    mn_cuda_free(&ctx);
    return r;
}

// The context, the CUDA context's bytes (cudaMemGetInfo once the context exists and holds no
// workspace: total - free, so other processes on the GPU count too), the cache over the device
// (--capacity as PyTorch's per-process memory fraction), and the GPU table entry for the
// prediction (tr_gpu_entry).
static mn_result tr_gpu_init(tr_model *m, mn_cache_desc *cd) {
    mn_cuda_desc d;
    mn_device dev;
    uint64_t total_b;
    memset(&d, 0, sizeof d);
    d.logger.log_fn = tr_gpu_log, d.logger.user_data = m;  // tf32 0: full fp32 GEMMs
    d.gemm_tune = m->cfg.gemm_tune;
    m->gpu = 1;
    TR_TRY(mn_cuda_init(&m->cuda, &d));
    m->cuda_ready = 1;
    m->workspace_bytes = m->cuda.workspace_bytes;
    TR_TRY(mn_cuda_workspace_set(&m->cuda, NULL, 0));  // the cache holds it (tr_gpu_init_rest)
    dev = mn_cuda_device(&m->cuda);
    TR_TRY(tr_gpu_describe(&m->cuda, &m->cfg));
    total_b = m->cfg.gpu_total;
    cd->device = dev;
    TR_TRY(mn_cache_init(&m->cache, cd));
    m->cache_ready = 1;
    if (m->cfg.capacity && m->cfg.capacity < total_b)  // (more than the device: no limit)
        TR_TRY(mn_cache_set_memory_fraction(&m->cache, (double)m->cfg.capacity / (double)total_b));
    return MN_OK;
}

// Parameter i [n]: made on the host (tr_param_fill, the same stream as the CPU's), copied to the
// fp32 weights and, converted, to the 16-bit copy.
static mn_result tr_gpu_init_params(tr_model *m, int i, uint64_t n, uint64_t *rng) {
    float **ps[TR_NUM_PARAMS];
    float *w = n <= SIZE_MAX / sizeof(float) ? (float *)malloc((size_t)n * sizeof(float)) : NULL;
    uint16_t *w16 = m->half ? (uint16_t *)malloc((size_t)n * 2) : NULL;
    mn_result r = MN_ERR_OUT_OF_MEMORY;
    tr_param_slots(&m->params, ps);
    if (w && (w16 || !m->half)) {
        tr_param_fill(m, i, w, n, rng);
        r = mn_cuda_mem_copy(&m->cuda, *ps[i], w, n * sizeof(float));
        if (r == MN_OK && m->half) {
            tr_to16(m, w, w16, n);
            r = mn_cuda_mem_copy(&m->cuda, m->w16[i], w16, n * 2);
        }
    }
    free(w), free(w16);
    return r;
}

// After the tokens and targets: their host buffers and the host's copies of the losses and
// norms; then on the device one gradient norm per tensor (MN_CAT_OTHER), the cuBLASLt workspace
// the context resolved and the kernels' scratch (both MN_CAT_WORKSPACE), handed to the context.
// The scratch is sized for attention's backward, which asks for the most (its per-head buffers
// and the B x NH x T x T products; 468 MiB for GPT-2 small at B 8, T 1024 in bf16); a kernel that
// needs more takes the context's own buffer, outside the cache (tr_gpu_report shows it).
static mn_result tr_gpu_init_rest(tr_model *m) {
    size_t N = m->cfg.B * m->cfg.T;
    int i, tensors = 0;
    for (i = 0; i < TR_NUM_PARAMS; i++) tensors += m->dims[i][0] * m->dims[i][1] != 0;
    m->tok_host = (int *)calloc(N, sizeof(int)), m->tgt_host = (int *)calloc(N, sizeof(int));
    m->losses_host = (float *)malloc(N * sizeof(float));
    m->norms_host = (float *)malloc((size_t)tensors * sizeof(float));
    if (!m->tok_host || !m->tgt_host || !m->losses_host || !m->norms_host)
        return MN_ERR_OUT_OF_MEMORY;
    TR_TRY(tr_alloc(m, (uint64_t)tensors, sizeof(float), MN_CAT_OTHER, "grad_norms", 0,
                    &m->norms));
    if (m->workspace_bytes) {
        TR_TRY(tr_alloc(m, m->workspace_bytes, 1, MN_CAT_WORKSPACE, "cublaslt_workspace", 0,
                        &m->workspace));
        TR_TRY(mn_cuda_workspace_set(&m->cuda, m->workspace, m->workspace_bytes));
    }
    TR_TRY(mn_attention_scratch(m->cfg.B, m->cfg.T, m->cfg.C, m->cfg.NH, m->half ? 2 : 4, 1,
                                m->cfg.checkpointing != TR_CKPT_SELECTIVE, &m->scratch_bytes));
    TR_TRY(tr_alloc(m, m->scratch_bytes, 1, MN_CAT_WORKSPACE, "kernel_scratch", 0, &m->scratch));
    return mn_cuda_scratch_set(&m->cuda, m->scratch, m->scratch_bytes);
}

// A backward temporary of n elements in the storage type, zeroed (the launchers add into it).
static mn_result tr_gpu_temp(tr_model *m, uint64_t n, const char *label, float **out) {
    return tr_alloc(m, n, m->half ? 2 : 4, MN_CAT_TEMPORARY, label, 1, out);
}

// v: device pointers into the weights the kernels read (which 0: the 16-bit copies when half,
// else the fp32 weights) or the gradients (which 1), in the storage type: layer l's rows of the
// stacked block tensors, the others whole. Cast to float *, never read on the host.
static void tr_gpu_view(tr_model *m, int which, size_t l, tr_params *v) {
    float **ps[TR_NUM_PARAMS], **gs[TR_NUM_PARAMS], **vs[TR_NUM_PARAMS];
    size_t esz = m->half ? 2 : 4;
    int i;
    tr_param_slots(&m->params, ps);
    tr_param_slots(&m->grads, gs);
    tr_param_slots(v, vs);
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        uint64_t n = m->dims[i][0] * m->dims[i][1], off = 0;
        char *base = (char *)(which ? (void *)*gs[i] : m->half ? (void *)m->w16[i] : *ps[i]);
        if (tr_param_per_layer(i)) off = (uint64_t)l * (n / m->cfg.L);
        *vs[i] = base ? (float *)(void *)(base + off * esz) : NULL;
    }
}

static mn_result tr_gpu_zero_grad(tr_model *m) {
    float **gs[TR_NUM_PARAMS];
    int i;
    tr_param_slots(&m->grads, gs);
    for (i = 0; i < TR_NUM_PARAMS; i++)
        if (*gs[i])
            TR_TRY(mn_cuda_mem_set(&m->cuda, *gs[i], 0,
                                   m->dims[i][0] * m->dims[i][1] * (m->half ? 2 : 4)));
    return MN_OK;
}

// tr_block_forward on the device. The residual adds: res2 = x + proj is fused with the layernorm
// that follows it; x[l + 1] = res2 + proj by the residual kernel.
static mn_result tr_gpu_block_forward(tr_model *m, size_t l, int recompute) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, NH = m->cfg.NH, N = B * T;
    mn_cuda *cu = &m->cuda;
    mn_dtype dt = tr_gpu_dtype(m);
    tr_acts *a = &m->acts[l];
    void *x = m->x[l].data;
    tr_params w;
    tr_gpu_view(m, 0, l, &w);
#define TR_A_NEW(name, numel, fp32) \
    if (&a->name != &a->att || m->cfg.checkpointing != TR_CKPT_SELECTIVE) \
        TR_TRY(tr_new(m, &a->name, numel, fp32, #name));
    MN_GPT_ACTS(TR_A_NEW)
#undef TR_A_NEW
    TR_TRY(mn_cuda_layernorm_forward(cu, a->ln1.data, (float *)a->ln1_mean.data,
                                     (float *)a->ln1_rstd.data, x, w.ln1w, w.ln1b, N, C,
                                     TR_LN_EPS, dt));
    TR_TRY(mn_cuda_matmul_forward(cu, a->qkv.data, NULL, a->ln1.data, w.qkvw, w.qkvb, N, C,
                                  3 * C, dt));
    TR_TRY(mn_cuda_attention_forward(cu, a->atty.data, a->att.data, a->qkv.data, B, T, C, NH, 1,
                                     dt));
    TR_TRY(mn_cuda_matmul_forward(cu, a->res2.data, NULL, a->atty.data, w.attprojw, w.attprojb,
                                  N, C, C, dt));
    TR_TRY(mn_cuda_residual_layernorm_forward(cu, a->res2.data, a->ln2.data,
                                              (float *)a->ln2_mean.data,
                                              (float *)a->ln2_rstd.data, x, a->res2.data, w.ln2w,
                                              w.ln2b, N, C, TR_LN_EPS, dt));
    TR_TRY(mn_cuda_matmul_forward(cu, a->fch_gelu.data, a->fch.data, a->ln2.data, w.fcw, w.fcb,
                                  N, C, 4 * C, dt));
    if (recompute) return MN_OK;
    TR_TRY(tr_new(m, &m->x[l + 1], N * C, 0, "x"));
    TR_TRY(mn_cuda_matmul_forward(cu, m->x[l + 1].data, NULL, a->fch_gelu.data, w.fcprojw,
                                  w.fcprojb, N, 4 * C, C, dt));
    return mn_cuda_residual_forward(cu, m->x[l + 1].data, m->x[l + 1].data, a->res2.data, N * C,
                                    dt);
}

// tr_block_backward on the device: the same buffers in the same order.
static mn_result tr_gpu_block_backward(tr_model *m, size_t l) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, NH = m->cfg.NH, N = B * T;
    mn_cuda *cu = &m->cuda;
    mn_dtype dt = tr_gpu_dtype(m);
    tr_acts *a = &m->acts[l];
    tr_temps *d = &m->tmp;
    tr_params w, g;
    TR_TRY(tr_free(m, &m->x[l + 1]));
    if (m->cfg.checkpointing == TR_CKPT_FULL) TR_TRY(tr_gpu_block_forward(m, l, 1));
    tr_gpu_view(m, 0, l, &w);
    tr_gpu_view(m, 1, l, &g);
    // fc projection: dfch_gelu [N,4C] (into dfch), dfcprojw, dfcprojb
    TR_TRY(tr_gpu_temp(m, N * 4 * C, "dfch", &d->dfch));
    TR_TRY(mn_cuda_matmul_backward(cu, d->dfch, g.fcprojw, g.fcprojb, d->dx, a->fch_gelu.data,
                                   w.fcprojw, NULL, N, 4 * C, C, dt));
    TR_TRY(tr_free(m, &a->fch_gelu));
    // fc with the GELU: dln2 (into dln), dfcw, dfcb; dfch becomes d pre-gelu in place
    TR_TRY(tr_gpu_temp(m, N * C, "dln", &d->dln));
    TR_TRY(mn_cuda_matmul_backward(cu, d->dln, g.fcw, g.fcb, d->dfch, a->ln2.data, w.fcw,
                                   a->fch.data, N, C, 4 * C, dt));
    TR_TRY(tr_release(m, &d->dfch));
    TR_TRY(tr_free(m, &a->fch));
    TR_TRY(tr_free(m, &a->ln2));
    // layernorm 2: dx += d res2 through the norm
    TR_TRY(mn_cuda_layernorm_backward(cu, d->dx, g.ln2w, g.ln2b, d->dln, a->res2.data, w.ln2w,
                                      (const float *)a->ln2_mean.data,
                                      (const float *)a->ln2_rstd.data, N, C, dt));
    TR_TRY(tr_free(m, &a->res2));
    TR_TRY(tr_free(m, &a->ln2_mean));
    TR_TRY(tr_free(m, &a->ln2_rstd));
    // attention projection: datty [N,C]
    TR_TRY(tr_gpu_temp(m, N * C, "datty", &d->datty));
    TR_TRY(mn_cuda_matmul_backward(cu, d->datty, g.attprojw, g.attprojb, d->dx, a->atty.data,
                                   w.attprojw, NULL, N, C, C, dt));
    TR_TRY(tr_free(m, &a->atty));
    // attention: dqkv [N,3C] (probabilities from the forward, or recomputed in the scratch)
    TR_TRY(tr_gpu_temp(m, N * 3 * C, "dqkv", &d->dqkv));
    TR_TRY(mn_cuda_attention_backward(cu, d->dqkv, d->datty, a->qkv.data, a->att.data, B, T, C,
                                      NH, 1, dt));
    TR_TRY(tr_release(m, &d->datty));
    TR_TRY(tr_free(m, &a->att));
    TR_TRY(tr_free(m, &a->qkv));
    // qkv: dln1 (into dln, zeroed again)
    TR_TRY(mn_cuda_mem_set(cu, d->dln, 0, (uint64_t)N * C * (m->half ? 2 : 4)));
    TR_TRY(mn_cuda_matmul_backward(cu, d->dln, g.qkvw, g.qkvb, d->dqkv, a->ln1.data, w.qkvw,
                                   NULL, N, C, 3 * C, dt));
    TR_TRY(tr_release(m, &d->dqkv));
    TR_TRY(tr_free(m, &a->ln1));
    // layernorm 1: dx += d x[l] through the norm
    TR_TRY(mn_cuda_layernorm_backward(cu, d->dx, g.ln1w, g.ln1b, d->dln, m->x[l].data, w.ln1w,
                                      (const float *)a->ln1_mean.data,
                                      (const float *)a->ln1_rstd.data, N, C, dt));
    TR_TRY(tr_release(m, &d->dln));
    return tr_acts_free(m, a);  // ln1_mean, ln1_rstd
}

// tr_forward on the device, with the head's backward start fused in: m->probs holds the logits
// [N,V], then, overwritten by the fused cross-entropy, dlogits = (softmax - onehot) * dloss.
// *loss: the mean of the losses read back.
static mn_result tr_gpu_forward(tr_model *m, float dloss, double *loss) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, L = m->cfg.L, V = m->cfg.V, N = B * T, l, n;
    mn_cuda *cu = &m->cuda;
    mn_dtype dt = tr_gpu_dtype(m);
    tr_params w;
    double sum = 0.0;
    TR_TRY(mn_cuda_mem_copy(cu, m->tokens, m->tok_host, N * sizeof(int)));
    TR_TRY(mn_cuda_mem_copy(cu, m->targets, m->tgt_host, N * sizeof(int)));
    tr_gpu_view(m, 0, 0, &w);
    TR_TRY(tr_new(m, &m->x[0], N * C, 0, "x"));
    TR_TRY(mn_cuda_embedding_forward(cu, m->x[0].data, m->tokens, w.wte, w.wpe, B, T, C, V, dt));
    for (l = 0; l < L; l++) {
        TR_TRY(tr_gpu_block_forward(m, l, 0));
        if (m->cfg.checkpointing == TR_CKPT_FULL) TR_TRY(tr_acts_free(m, &m->acts[l]));
    }
    TR_TRY(tr_new(m, &m->lnf, N * C, 0, "lnf"));
    TR_TRY(tr_new(m, &m->lnf_mean, N, 1, "lnf_mean"));
    TR_TRY(tr_new(m, &m->lnf_rstd, N, 1, "lnf_rstd"));
    TR_TRY(mn_cuda_layernorm_forward(cu, m->lnf.data, (float *)m->lnf_mean.data,
                                     (float *)m->lnf_rstd.data, m->x[L].data, w.lnfw, w.lnfb, N,
                                     C, TR_LN_EPS, dt));
    TR_TRY(tr_new(m, &m->probs, N * V, 0, "logits"));
    TR_TRY(mn_cuda_matmul_forward(cu, m->probs.data, NULL, m->lnf.data,
                                  m->cfg.tied ? w.wte : w.lmw, NULL, N, C, V, dt));
    TR_TRY(tr_alloc(m, N, sizeof(float), MN_CAT_TEMPORARY, "losses", 0, &m->tmp.losses));
    TR_TRY(mn_cuda_crossentropy_forward_backward(cu, m->tmp.losses, m->probs.data, m->probs.data,
                                                 m->targets, dloss, N, V, dt));
    TR_TRY(mn_cuda_mem_copy(cu, m->losses_host, m->tmp.losses, N * sizeof(float)));
    for (n = 0; n < N; n++) sum += m->losses_host[n];
    *loss = sum / (double)N;
    return tr_release(m, &m->tmp.losses);
}

// tr_backward on the device, from the dlogits the forward left in m->probs.
static mn_result tr_gpu_backward(tr_model *m) {
    size_t B = m->cfg.B, T = m->cfg.T, C = m->cfg.C, L = m->cfg.L, V = m->cfg.V, N = B * T, l;
    mn_cuda *cu = &m->cuda;
    mn_dtype dt = tr_gpu_dtype(m);
    tr_temps *d = &m->tmp;
    tr_params w, g;
    tr_gpu_view(m, 0, 0, &w);
    tr_gpu_view(m, 1, 0, &g);
    // head: dlnf [N,C] (into dln), dhead += dlogits^T @ lnf
    TR_TRY(tr_gpu_temp(m, N * C, "dln", &d->dln));
    TR_TRY(mn_cuda_matmul_backward(cu, d->dln, m->cfg.tied ? g.wte : g.lmw, NULL, m->probs.data,
                                   m->lnf.data, m->cfg.tied ? w.wte : w.lmw, NULL, N, C, V, dt));
    TR_TRY(tr_free(m, &m->probs));
    TR_TRY(tr_free(m, &m->lnf));
    // final layernorm: dx [N,C] = d loss / d x[L]
    TR_TRY(tr_gpu_temp(m, N * C, "dx", &d->dx));
    TR_TRY(mn_cuda_layernorm_backward(cu, d->dx, g.lnfw, g.lnfb, d->dln, m->x[L].data, w.lnfw,
                                      (const float *)m->lnf_mean.data,
                                      (const float *)m->lnf_rstd.data, N, C, dt));
    TR_TRY(tr_release(m, &d->dln));
    TR_TRY(tr_free(m, &m->lnf_mean));
    TR_TRY(tr_free(m, &m->lnf_rstd));
    for (l = L; l-- > 0;) TR_TRY(tr_gpu_block_backward(m, l));
    TR_TRY(mn_cuda_embedding_backward(cu, g.wte, g.wpe, d->dx, m->tokens, B, T, C, V, dt));
    TR_TRY(tr_release(m, &d->dx));
    return tr_free(m, &m->x[0]);
}

// One step of parameter i's state at step size lr, t the optimizer's step. The state is one
// zeroed block of mn_optim_state_bytes made at the first update, laid out as the host optimizers
// lay theirs out: AdamW m then v; SGD's momentum; Lion's m; 8-bit AdamW [absmax1 | absmax2 |
// code1 | code2] for a tensor of 4096 elements or more (256-element blocks), else m then v;
// Adafactor the row then the column means of the [rows, cols] tensor. The gradient norm, the loss
// scaler's 1/scale (0 = 1) and the clipping go to the kernel, which unscales and clips as it reads.
static mn_result tr_gpu_optim_step(tr_model *m, int i, float lr, uint64_t t, float inv) {
    float **ps[TR_NUM_PARAMS], **gs[TR_NUM_PARAMS], *state = (float *)m->opt_block[i];
    uint64_t n = m->dims[i][0] * m->dims[i][1], want, blocks = (n + 255) / 256;
    int q8 = n >= 4096;  // mn_adamw8bit's min_8bit_size
    mn_cuda_optim_flat f;
    tr_param_slots(&m->params, ps);
    tr_param_slots(&m->grads, gs);
    switch (m->cfg.optim) {  // the layout below must be the block's size
    case MN_OPTIM_SGD: want = 0; break;
    case MN_OPTIM_SGD_MOMENTUM: case MN_OPTIM_LION: want = 4 * n; break;
    case MN_OPTIM_ADAMW_8BIT: want = q8 ? 2 * n + 8 * blocks : 8 * n; break;
    case MN_OPTIM_ADAFACTOR: want = 4 * (m->dims[i][0] + m->dims[i][1]); break;
    default: want = 8 * n; break;
    }
    if (m->opt_bytes[i] != want) return MN_ERR_STATE;
    memset(&f, 0, sizeof f);
    f.param = *ps[i], f.param16 = m->half ? (void *)m->w16[i] : NULL, f.grad = *gs[i], f.n = n;
    f.grad_dtype = tr_gpu_dtype(m), f.param16_dtype = m->half, f.step = t;
    f.grad_norm = m->norms, f.inv_scale = inv, f.max_norm = m->cfg.clip;
    switch (m->cfg.optim) {
    case MN_OPTIM_SGD:
    case MN_OPTIM_SGD_MOMENTUM: {
        mn_sgd_params p;
        mn_cuda_sgd_args a;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.momentum = m->cfg.optim == MN_OPTIM_SGD_MOMENTUM ? 0.9f : 0.0f;
        a.flat = f, a.momentum_buffer = state;
        return mn_cuda_sgd_step(&m->cuda, &p, &a);
    }
    case MN_OPTIM_LION: {
        mn_lion_params p;
        mn_cuda_lion_args a;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.weight_decay = MN_OPTIM_ZERO;
        a.flat = f, a.exp_avg = state;
        return mn_cuda_lion_step(&m->cuda, &p, &a);
    }
    case MN_OPTIM_ADAMW_8BIT: {
        mn_adamw8bit_params p;
        mn_cuda_adamw8bit_args a;
        memset(&p, 0, sizeof p), memset(&a, 0, sizeof a);
        p.lr = lr, p.weight_decay = MN_OPTIM_ZERO;
        a.flat = f;
        if (q8) {
            a.absmax1 = state, a.absmax2 = state + blocks;
            a.code1 = (uint8_t *)(state + 2 * blocks), a.code2 = a.code1 + n;
        } else {
            a.exp_avg = state, a.exp_avg_sq = state + n;
        }
        return mn_cuda_adamw8bit_step(&m->cuda, &p, &a);
    }
    case MN_OPTIM_ADAFACTOR: {
        mn_adafactor_params p;
        mn_cuda_adafactor_args a;
        memset(&p, 0, sizeof p), memset(&a, 0, sizeof a);
        p.lr = lr, p.no_scale_parameter = 1;
        a.flat = f, a.exp_avg_sq_row = state, a.exp_avg_sq_col = state + m->dims[i][0];
        a.batch = 1, a.rows = m->dims[i][0], a.cols = m->dims[i][1];
        return mn_cuda_adafactor_step(&m->cuda, &p, &a);
    }
    default: {
        mn_adamw_params p;
        mn_cuda_adamw_args a;
        memset(&p, 0, sizeof p);
        p.lr = lr, p.weight_decay = MN_OPTIM_ZERO;
        a.flat = f, a.exp_avg = state, a.exp_avg_sq = state + n;
        return mn_cuda_adamw_step(&m->cuda, &p, &a);
    }
    }
}

// Parameter i's optimizer state on the device: one zeroed block of mn_optim_state_bytes
// (MN_CAT_OPTIMIZER; none for plain SGD).
static mn_result tr_gpu_optim_init(tr_model *m, int i) {
    mn_optim_desc od = tr_optim_desc(&m->cfg);
    TR_TRY(mn_optim_state_bytes(&od, m->dims[i], 2, &m->opt_bytes[i]));
    if (!m->opt_bytes[i]) return MN_OK;
    return tr_alloc(m, m->opt_bytes[i], 1, MN_CAT_OPTIMIZER, mn_optim_name(m->cfg.optim), 1,
                    &m->opt_block[i]);
}

// tr_update on the device. The norm of every gradient tensor into m->norms, read back and summed
// on the host: non-finite is fp16's found-inf (the scaler skips the step and backs off);
// otherwise the global norm of the (scaled) gradients goes back to norms[0] for the kernels.
static mn_result tr_gpu_update(tr_model *m, float lr, float *norm, int *skipped) {
    float **gs[TR_NUM_PARAMS], inv = 0.0f, total;
    mn_cuda *cu = &m->cuda;
    double sq = 0.0;
    int i, j = 0, skip = 0;
    tr_param_slots(&m->grads, gs);
    m->step++;
    *skipped = 0, *norm = 0.0f;
    if (m->half == MN_FP16) {
        inv = mn_loss_scaler_inv_scale(&m->scaler);
        if (m->step == m->cfg.inject_overflow) {  // an fp16 inf in the first gradient
            uint16_t inf16 = 0x7C00;
            for (i = 0; !*gs[i]; i++) {}
            TR_TRY(mn_cuda_mem_copy(cu, *gs[i], &inf16, 2));
        }
    }
    for (i = 0; i < TR_NUM_PARAMS; i++)
        if (*gs[i])
            TR_TRY(mn_cuda_global_norm(cu, m->norms + j++, *gs[i],
                                       m->dims[i][0] * m->dims[i][1], tr_gpu_dtype(m)));
    TR_TRY(mn_cuda_mem_copy(cu, m->norms_host, m->norms, (uint64_t)j * sizeof(float)));
    for (i = 0; i < j; i++) sq += (double)m->norms_host[i] * (double)m->norms_host[i];
    total = (float)sqrt(sq);
    if (m->half == MN_FP16) {
        TR_TRY(mn_loss_scaler_update(&m->scaler, !mn_hd_isfinite(total), &skip));
        if (skip) { *skipped = 1; return MN_OK; }
    }
    *norm = inv != 0.0f ? total * inv : total;
    TR_TRY(mn_cuda_mem_copy(cu, m->norms, &total, sizeof total));
    if (!m->opt_ready) {
        for (i = 0; i < TR_NUM_PARAMS; i++)
            if (*gs[i]) TR_TRY(tr_gpu_optim_init(m, i));
        m->opt_ready = 1;
    }
    m->opt_steps++;
    for (i = 0; i < TR_NUM_PARAMS; i++)
        if (*gs[i]) TR_TRY(tr_gpu_optim_step(m, i, lr, m->opt_steps, inv));
    return MN_OK;
}

// After training: the device's memory as cudaMemGetInfo sees it, against the context and the
// cache's reservation; what remains is outside the cache (the context's own scratch, taken only
// by a kernel that needs more than the cache's block, and its small buffers such as 8-bit AdamW's
// maps), and the prediction's device total (context + peak reserved).
static mn_result tr_gpu_report(tr_model *m, const struct mn_cache_stats *st,
                               const mn_estimate_result *pred, double tokens_per_s, FILE *out) {
    mn_device dev = mn_cuda_device(&m->cuda);
    const tr_config *c = &m->cfg;
    mn_gpu g;
    // model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; llm.c gpt2_estimate_mfu):
    // 6 per parameter (forward and backward) plus the attention's 6 L C T
    double flops = 6.0 * (double)m->num_params + 6.0 * (double)c->L * (double)c->C * (double)c->T;
    uint64_t free_b = 0, total_b = 0, used, cached;
    fprintf(out, "speed: %.0f tokens/s over the last steps, %.3g model FLOPs per token (6N + "
            "6LCT): %.2f TFLOP/s", tokens_per_s, flops, tokens_per_s * flops / 1e12);
    if (mn_gpu_find(c->gpu, &g) == MN_OK && g.bf16_tflops > 0.0)
        fprintf(out, ", MFU %.1f%% of %s's dense bf16 peak %.0f TFLOP/s (GPU table)\n",
                100.0 * tokens_per_s * flops / (g.bf16_tflops * 1e12), g.name, g.bf16_tflops);
    else fprintf(out, "; MFU unknown (no bf16 peak in the GPU table for %s)\n", c->gpu);
    if (c->gemm_tune)
        fprintf(out, "--gemm-tune on: %llu GEMM shapes ran the fastest of cuBLASLt's candidates "
                "(timed at their first use)\n", (unsigned long long)m->cuda.gemm_tuned);
    TR_TRY(mn_cuda_sync(&m->cuda));
    if (!dev.mem_info_fn) return MN_OK;
    TR_TRY(dev.mem_info_fn(dev.user_data, &free_b, &total_b));
    used = total_b - free_b, cached = st->reserved_bytes[MN_STAT_ALL].current;
    fprintf(out, "device memory (cudaMemGetInfo): %.2f MiB used = context %.2f + reserved by the "
            "cache %.2f + outside the cache %.2f\n", (double)used / TR_MIB,
            (double)m->cfg.gpu_context / TR_MIB, (double)cached / TR_MIB,
            ((double)used - (double)m->cfg.gpu_context - (double)cached) / TR_MIB);
    if (pred)
        fprintf(out, "predicted device use: %.2f MiB (context + peak reserved), fits: %s\n\n",
                (double)pred->device_used / TR_MIB, pred->fits ? "yes" : "no");
    return MN_OK;
}
#endif  // MEMANAT_CUDA

// ---- checkpoints --------------------------------------------------------------------------------
// --save FILE writes, and --resume FILE reads, everything the next step depends on, so that a run
// resumed from step s continues bit for bit as the uninterrupted run would. The format, version 1,
// every integer little-endian (a big-endian host is refused):
//     offset  bytes  field
//     0       8      magic "MNTRCKPT"
//     8       4      version, 1
//     12      4      0
//     16      64     the model: L, C, NH, T, V, tied, precision, optim (u64 each; mn_precision and
//                    mn_optim values); a resume refuses a file whose model differs in any of them
//     80      8      optimizer steps taken
//     88      24     the data stream: its RNG state, the Markov chain's last byte, 0
//     112     24     the fp16 loss scaler: scale (fp32 bits), growth tracker (u32), updates, skips
//     136            per parameter tensor in table order (a tied head has none): its fp32 values
//                    (the master weights with 16-bit storage; the 16-bit copy is their rounding)
//                    then per parameter tensor: optimizer steps (u64), state bytes S (u64, 0 before
//                    the first step and for plain SGD), S bytes: the state block as the header's
//                    optimizer lays it out
//     end - 8 8      FNV-1a 64 of every byte before it
// Written through FILE.tmp and renamed (mn_write_file_atomic): a failed or killed write leaves
// the previous FILE as it was.

#define TR_CKPT_MAGIC "MNTRCKPT"
#define TR_CKPT_VERSION 1u
#define TR_CKPT_HEADER 136u

typedef struct tr_stream {  // a checkpoint being written or read, with its running checksum
    FILE *f;
    uint64_t hash, bytes;
    uint64_t fail_after;    // writing: fail once this many bytes are written, 0 = never (tests)
} tr_stream;

static void tr_fnv(tr_stream *s, const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    size_t i;
    for (i = 0; i < n; i++) s->hash = (s->hash ^ b[i]) * 0x100000001b3ull;
    s->bytes += n;
}

static mn_result tr_put(tr_stream *s, const void *p, size_t n) {
    if (s->fail_after && s->bytes + n > s->fail_after) return MN_ERR_IO;
    if (n && fwrite(p, 1, n, s->f) != n) return MN_ERR_IO;
    tr_fnv(s, p, n);
    return MN_OK;
}
static mn_result tr_put_u64(tr_stream *s, uint64_t v) {
    unsigned char b[8];
    int i;
    for (i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    return tr_put(s, b, 8);
}

static mn_result tr_get(tr_stream *s, void *p, size_t n) {
    if (n && fread(p, 1, n, s->f) != n) return MN_ERR_IO;
    tr_fnv(s, p, n);
    return MN_OK;
}
static mn_result tr_get_u64(tr_stream *s, uint64_t *v) {
    unsigned char b[8];
    int i;
    TR_TRY(tr_get(s, b, 8));
    for (*v = 0, i = 0; i < 8; i++) *v |= (uint64_t)b[i] << (8 * i);
    return MN_OK;
}

static int tr_little_endian(void) {
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

// The model fields of the header, in order, with the flag that sets each.
static void tr_ckpt_model(const tr_config *c, uint64_t v[8]) {
    v[0] = c->L, v[1] = c->C, v[2] = c->NH, v[3] = c->T, v[4] = c->V, v[5] = (uint64_t)c->tied;
    v[6] = (uint64_t)c->precision, v[7] = (uint64_t)c->optim;
}
static const char *const tr_ckpt_model_flags[8] = {
    "--layers", "--dim", "--heads", "--seq", "--vocab", "--head", "--precision", "--optim"};

// Field i's value v as its flag would spell it.
static void tr_ckpt_value(int i, uint64_t v, char *buf, size_t cap) {
    if (i == 5) snprintf(buf, cap, "%s", v == 1 ? "tied" : v == 0 ? "untied" : "?");
    else if (i == 6 && v < MN_PREC_COUNT)
        snprintf(buf, cap, "%s", mn_precision_name((mn_precision)v));
    else if (i == 7 && v < MN_OPTIM_COUNT) snprintf(buf, cap, "%s", mn_optim_name((mn_optim)v));
    else snprintf(buf, cap, "%llu", (unsigned long long)v);
}

// The checkpoint body (ctx: the tr_model), for mn_write_file_atomic.
// Model memory through the stream: host memory as is; on a GPU through a host buffer, 64 KiB at a
// time (the layouts are the host's, so a checkpoint moves between the CPU and a GPU).
static mn_result tr_put_buf(tr_model *m, tr_stream *s, const void *p, uint64_t n) {
#ifdef MEMANAT_CUDA
    if (m->gpu) {
        unsigned char buf[65536];
        uint64_t at, k;
        for (at = 0; at < n; at += k) {
            k = n - at < sizeof buf ? n - at : sizeof buf;
            TR_TRY(mn_cuda_mem_copy(&m->cuda, buf, (const unsigned char *)p + at, k));
            TR_TRY(tr_put(s, buf, (size_t)k));
        }
        return MN_OK;
    }
#endif
    (void)m;
    return tr_put(s, p, (size_t)n);
}
static mn_result tr_get_buf(tr_model *m, tr_stream *s, void *p, uint64_t n) {
#ifdef MEMANAT_CUDA
    if (m->gpu) {
        unsigned char buf[65536];
        uint64_t at, k;
        for (at = 0; at < n; at += k) {
            k = n - at < sizeof buf ? n - at : sizeof buf;
            TR_TRY(tr_get(s, buf, (size_t)k));
            TR_TRY(mn_cuda_mem_copy(&m->cuda, (unsigned char *)p + at, buf, k));
        }
        return MN_OK;
    }
#endif
    (void)m;
    return tr_get(s, p, (size_t)n);
}

// Parameter i [n] from the stream, and its 16-bit copy rewritten.
static mn_result tr_get_param(tr_model *m, tr_stream *s, int i, uint64_t n) {
    float **ps[TR_NUM_PARAMS];
    tr_param_slots(&m->params, ps);
#ifdef MEMANAT_CUDA
    if (m->gpu) {
        float *h = n <= SIZE_MAX / 4 ? (float *)malloc((size_t)n * 4) : NULL;
        uint16_t *h16 = m->half && h ? (uint16_t *)malloc((size_t)n * 2) : NULL;
        mn_result r = !h || (m->half && !h16) ? MN_ERR_OUT_OF_MEMORY : tr_get(s, h, (size_t)n * 4);
        if (r == MN_OK) r = mn_cuda_mem_copy(&m->cuda, *ps[i], h, n * 4);
        if (r == MN_OK && m->half) {
            tr_to16(m, h, h16, n);
            r = mn_cuda_mem_copy(&m->cuda, m->w16[i], h16, n * 2);
        }
        free(h), free(h16);
        return r;
    }
#endif
    TR_TRY(tr_get(s, *ps[i], (size_t)n * 4));
    if (m->half) tr_to16(m, *ps[i], m->w16[i], n);
    return MN_OK;
}

// Parameter i's optimizer state: its bytes (0 before the first step), its step counter, making it.
static uint64_t tr_state_bytes(const tr_model *m, int i) {
#ifdef MEMANAT_CUDA
    if (m->gpu) return m->opt_ready ? m->opt_bytes[i] : 0;
#endif
    return m->opt_ready ? tr_optim_state_bytes(m, i) : 0;
}
static uint64_t tr_state_steps(tr_model *m, int i) {
#ifdef MEMANAT_CUDA
    if (m->gpu) return m->opt_ready ? m->opt_steps : 0;
#endif
    return m->opt_ready ? *tr_optim_state_steps(m, i) : 0;
}
static mn_result tr_state_init(tr_model *m, int i, uint64_t steps) {
#ifdef MEMANAT_CUDA
    if (m->gpu) {
        m->opt_steps = steps;
        return tr_gpu_optim_init(m, i);
    }
#endif
    TR_TRY(tr_optim_state_init(m, i, m->cfg.lr));
    *tr_optim_state_steps(m, i) = steps;
    return MN_OK;
}

static mn_result tr_ckpt_body(void *ctx, FILE *f) {
    tr_model *m = (tr_model *)ctx;
    tr_stream s;
    float **ps[TR_NUM_PARAMS];
    uint64_t v[8], bits = 0;
    uint32_t scale_bits;
    int i;
    memset(&s, 0, sizeof s);
    s.f = f, s.hash = 0xcbf29ce484222325ull, s.fail_after = m->save_fail_after;
    TR_TRY(tr_put(&s, TR_CKPT_MAGIC, 8));
    TR_TRY(tr_put_u64(&s, TR_CKPT_VERSION));
    tr_ckpt_model(&m->cfg, v);
    for (i = 0; i < 8; i++) TR_TRY(tr_put_u64(&s, v[i]));
    TR_TRY(tr_put_u64(&s, (uint64_t)m->step));
    TR_TRY(tr_put_u64(&s, m->data.rng));
    TR_TRY(tr_put_u64(&s, (uint64_t)m->data.state));
    TR_TRY(tr_put_u64(&s, 0));
    memcpy(&scale_bits, &m->scaler.scale, 4);
    bits = scale_bits | (uint64_t)m->scaler.growth_tracker << 32;
    TR_TRY(tr_put_u64(&s, bits));
    TR_TRY(tr_put_u64(&s, m->scaler.steps));
    TR_TRY(tr_put_u64(&s, m->scaler.skipped));
    tr_param_slots(&m->params, ps);
    for (i = 0; i < TR_NUM_PARAMS; i++)
        if (*ps[i]) TR_TRY(tr_put_buf(m, &s, *ps[i], m->dims[i][0] * m->dims[i][1] * 4));
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        uint64_t bytes = tr_state_bytes(m, i);
        if (!*ps[i]) continue;
        TR_TRY(tr_put_u64(&s, tr_state_steps(m, i)));
        TR_TRY(tr_put_u64(&s, bytes));
        TR_TRY(tr_put_buf(m, &s, m->opt_block[i], bytes));
    }
    return tr_put_u64(&s, s.hash);
}

// Writes the checkpoint to cfg.save; m->error names a failure.
static mn_result tr_save(tr_model *m) {
    mn_result r;
    if (!tr_little_endian()) {
        snprintf(m->error, sizeof m->error, "--save: checkpoints are little-endian only");
        return MN_ERR_UNSUPPORTED;
    }
    r = mn_write_file_atomic(m->cfg.save, tr_ckpt_body, m);
    if (r != MN_OK)
        snprintf(m->error, sizeof m->error, "cannot write --save %.120s: %s (the previous file "
                 "is unchanged)", m->cfg.save, mn_result_str(r));
    return r;
}

// The bytes a checkpoint of m has, its optimizer state present (opt 1) or not (0).
static uint64_t tr_ckpt_size(const tr_model *m, int opt) {
    mn_optim_desc d = tr_optim_desc(&m->cfg);
    uint64_t size = TR_CKPT_HEADER + 8, bytes;
    int i;
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        uint64_t n = m->dims[i][0] * m->dims[i][1];
        if (!n) continue;
        size += 4 * n + 16;
        if (opt && mn_optim_state_bytes(&d, m->dims[i], 2, &bytes) == MN_OK) size += bytes;
    }
    return size;
}

// Checks cfg.resume against m (pass 1: header, size, checksum), then loads it (pass 2): weights,
// their 16-bit copies, optimizer state, loss scaler, data position, step. m->error names the
// reason for a refusal, and m is unchanged by one.
static mn_result tr_resume(tr_model *m) {
    const char *path = m->cfg.resume;
    tr_stream s;
    FILE *f = fopen(path, "rb");
    unsigned char buf[65536];
    char magic[8];
    uint64_t v[8], want[8], version = 0, size, step, rng, state, zero, scaler[3], sum, left;
    float **ps[TR_NUM_PARAMS];
    long len;
    size_t k;
    int i;
    mn_result r = MN_ERR_INVALID_ARG;
    memset(&s, 0, sizeof s);
    s.f = f, s.hash = 0xcbf29ce484222325ull;
    if (!tr_little_endian()) {
        snprintf(m->error, sizeof m->error, "--resume: checkpoints are little-endian only");
        r = MN_ERR_UNSUPPORTED;
        goto close;
    }
    if (!f || fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        snprintf(m->error, sizeof m->error, "cannot read --resume %.120s", path);
        r = MN_ERR_IO;
        goto close;
    }
    if ((uint64_t)len < TR_CKPT_HEADER + 8 || tr_get(&s, magic, 8) != MN_OK ||
        memcmp(magic, TR_CKPT_MAGIC, 8) != 0) {
        snprintf(m->error, sizeof m->error, "--resume %.120s is not a memanat trainer "
                 "checkpoint%s", path, (uint64_t)len < TR_CKPT_HEADER + 8 ? " (too short)" : "");
        goto close;
    }
    if (tr_get_u64(&s, &version) != MN_OK || version != TR_CKPT_VERSION) {
        snprintf(m->error, sizeof m->error, "--resume %.120s has format version %llu; this "
                 "trainer reads version %u", path, (unsigned long long)(version & 0xffffffffu),
                 TR_CKPT_VERSION);
        goto close;
    }
    tr_ckpt_model(&m->cfg, want);
    for (i = 0; i < 8; i++)
        if (tr_get_u64(&s, &v[i]) != MN_OK) goto close;  // the file is long enough
    for (i = 0; i < 8; i++)
        if (v[i] != want[i]) {
            char there[32], here[32];
            tr_ckpt_value(i, v[i], there, sizeof there);
            tr_ckpt_value(i, want[i], here, sizeof here);
            snprintf(m->error, sizeof m->error, "--resume %.100s was saved by a different model: "
                     "%s %s there, %s here", path, tr_ckpt_model_flags[i], there, here);
            goto close;
        }
    if (tr_get_u64(&s, &step) != MN_OK) goto close;
    size = tr_ckpt_size(m, step > 0);
    if ((uint64_t)len != size) {
        snprintf(m->error, sizeof m->error, "--resume %.120s has %ld bytes where this model's "
                 "checkpoint has %llu: it is truncated or corrupt", path, len,
                 (unsigned long long)size);
        goto close;
    }
    for (left = size - 8 - s.bytes; left > 0; left -= k) {
        k = left < sizeof buf ? (size_t)left : sizeof buf;
        if (tr_get(&s, buf, k) != MN_OK) break;
    }
    sum = s.hash;
    if (left > 0 || tr_get_u64(&s, &v[0]) != MN_OK || v[0] != sum) {
        snprintf(m->error, sizeof m->error, "--resume %.120s fails its checksum: the file is "
                 "corrupt", path);
        goto close;
    }
    // pass 2: the contents, known good
    r = MN_ERR_IO;
    if (fseek(f, 80, SEEK_SET) != 0 || tr_get_u64(&s, &step) != MN_OK ||  // offset 80: the step
        tr_get_u64(&s, &rng) != MN_OK || tr_get_u64(&s, &state) != MN_OK ||
        tr_get_u64(&s, &zero) != MN_OK)
        goto io;
    for (i = 0; i < 3; i++)
        if (tr_get_u64(&s, &scaler[i]) != MN_OK) goto io;
    tr_param_slots(&m->params, ps);
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        uint64_t n = m->dims[i][0] * m->dims[i][1];
        if (n && tr_get_param(m, &s, i, n) != MN_OK) goto io;
    }
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        uint64_t opt_steps, bytes;
        if (!*ps[i]) continue;
        if (tr_get_u64(&s, &opt_steps) != MN_OK || tr_get_u64(&s, &bytes) != MN_OK) goto io;
        if (step == 0) continue;
        if ((r = tr_state_init(m, i, opt_steps)) != MN_OK) goto close;
        r = MN_ERR_IO;
        m->opt_ready = 1;  // (tr_state_bytes reads it)
        if (bytes != tr_state_bytes(m, i) || tr_get_buf(m, &s, m->opt_block[i], bytes) != MN_OK)
            goto io;
    }
    m->opt_ready = step > 0;
    m->step = (long)step;
    m->data.rng = rng, m->data.state = (int)state;
    memcpy(&m->scaler.scale, &scaler[0], 4);
    m->scaler.growth_tracker = (uint32_t)(scaler[0] >> 32);
    m->scaler.steps = scaler[1], m->scaler.skipped = scaler[2];
    r = MN_OK;
    goto close;
io:
    snprintf(m->error, sizeof m->error, "cannot read --resume %.120s", path);
close:
    if (f) fclose(f);
    return r;
}

// Learning rate of step s (0-based): linear warmup over the first tenth (at most 100 steps),
// then cosine from lr down to lr / 10 at the last step.
static float tr_lr(const tr_config *cfg, long s) {
    long warm = cfg->steps / 10 < 100 ? cfg->steps / 10 : 100;
    double frac;
    if (s < warm) return cfg->lr * (float)(s + 1) / (float)warm;
    frac = cfg->steps - warm > 1 ? (double)(s - warm) / (double)(cfg->steps - warm - 1) : 0.0;
    return (float)(cfg->lr * (0.1 + 0.9 * 0.5 * (1.0 + cos(3.141592653589793 * frac))));
}

static double tr_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// One optimizer step of the --steps schedule, m->step the one before: the gradients of K
// micro-batches, then the update.
typedef struct tr_step_info {
    double loss;       // mean over the micro-batches
    float lr, norm;    // the learning rate, the gradient norm before clipping
    int skipped;       // fp16 overflow: no update
    double seconds;
} tr_step_info;

static mn_result tr_step(tr_model *m, tr_step_info *st) {
    double t0 = tr_now();
    st->lr = tr_lr(&m->cfg, m->step);
    TR_TRY(tr_accumulate(m, &st->loss));
    TR_TRY(tr_update(m, st->lr, &st->norm, &st->skipped));
    st->seconds = tr_now() - t0;
    return MN_OK;
}

// ---- prediction ---------------------------------------------------------------------------------
// The estimator's memanat framework predicts this program from its configuration alone: the
// model from mn_gpt_model, the allocation sequence of tr_model_init, tr_forward, tr_backward and
// the first tr_update, replayed through a cache with the default configuration.

// *out: memanat's prediction for cfg (host memory: no context, no workspace; with --device cuda
// the GPU table's entry tr_gpu_init chose, its workspace, the measured context).
// The estimator's checkpointing modes, indexed by TR_CKPT_*.
static const mn_ckpt tr_ckpt_mn[] = {MN_CKPT_NONE, MN_CKPT_SELECTIVE, MN_CKPT_FULL};

// The estimator's model and setup for cfg (framework memanat) on a device of capacity bytes
// (0: the host's, unlimited as mn_hostdev's; with --device cuda the GPU's total).
static mn_result tr_estimator_inputs(const tr_config *cfg, uint64_t capacity, mn_model *model,
                                     mn_setup *s) {
    TR_TRY(mn_gpt_model(cfg->L, cfg->C, cfg->NH, cfg->T, cfg->V, cfg->tied, model));
    memset(s, 0, sizeof *s);
    if (cfg->gpu) {  // --device cuda: the GPU's schedule, its workspace, the measured context
        s->gpu = cfg->gpu, s->context = cfg->gpu_context;
        if (!capacity) capacity = cfg->gpu_total;
    }
    s->framework = MN_FW_MEMANAT, s->capacity = capacity;
    s->batch = cfg->B, s->seq = cfg->T, s->accum = cfg->K;
    s->precision = cfg->precision, s->optim = cfg->optim;
    s->checkpointing = tr_ckpt_mn[cfg->checkpointing];
    return MN_OK;
}

static mn_result tr_predict(const tr_config *cfg, mn_estimate_result *out) {
    mn_model model;
    mn_setup s;
    TR_TRY(tr_estimator_inputs(cfg, cfg->capacity, &model, &s));
    return mn_estimate(&model, &s, out);
}

// Predicted vs measured: each category's peak, peak allocated and peak reserved, in MiB, with
// the error in percent of the measurement. st NULL: the prediction alone, before training.
static mn_result tr_write_anatomy(const mn_estimate_result *pred, const struct mn_cache_stats *st,
                                  FILE *out) {
    static const mn_category cats[] = {MN_CAT_WEIGHTS, MN_CAT_MASTER_WEIGHTS, MN_CAT_GRADIENTS,
                                       MN_CAT_OPTIMIZER, MN_CAT_ACTIVATIONS, MN_CAT_TEMPORARY,
                                       MN_CAT_OTHER, MN_CAT_WORKSPACE};
    uint64_t p[10], m[10] = {0};
    const char *name[10];
    size_t i, n = sizeof cats / sizeof cats[0];
    int w = 0;
    // the workspace (a cuBLASLt workspace: --device cuda) only when there is one
    if (!pred->cat_peak[MN_CAT_WORKSPACE] &&
        (!st || !st->cat_allocated_bytes[MN_CAT_WORKSPACE].peak))
        n--;
    for (i = 0; i < n; i++) {
        name[i] = mn_category_name(cats[i]), p[i] = pred->cat_peak[cats[i]];
        if (st) m[i] = st->cat_allocated_bytes[cats[i]].peak;
    }
    name[n] = "peak allocated", p[n] = pred->peak_allocated;
    name[n + 1] = "peak reserved", p[n + 1] = pred->peak_reserved;
    if (!st) {
        w = fprintf(out, "predicted by memanat's estimator (framework memanat): peak allocated "
                    "%.2f MiB, reserved %.2f MiB\n  peaks:", (double)p[n] / TR_MIB,
                    (double)p[n + 1] / TR_MIB);
        for (i = 0; i < n && w >= 0; i++)
            w = fprintf(out, "%s %s %.2f", i ? "," : "", name[i], (double)p[i] / TR_MIB);
        if (w >= 0) w = fprintf(out, " MiB\n");
        return w < 0 ? MN_ERR_IO : MN_OK;
    }
    m[n] = st->allocated_bytes[MN_STAT_ALL].peak, m[n + 1] = st->reserved_bytes[MN_STAT_ALL].peak;
    w = fprintf(out, "memory anatomy, predicted vs measured (peaks):\n%-16s %14s %14s %9s\n",
                "", "predicted MiB", "measured MiB", "error");
    for (i = 0; i < n + 2 && w >= 0; i++) {
        double err = m[i] ? 100.0 * ((double)p[i] - (double)m[i]) / (double)m[i]
                          : p[i] ? 100.0 : 0.0;
        w = fprintf(out, "%-16s %14.3f %14.3f %8.2f%%\n", name[i], (double)p[i] / TR_MIB,
                    (double)m[i] / TR_MIB, err);
    }
    return w < 0 ? MN_ERR_IO : MN_OK;
}

// --budget SIZE: mn_fit's plan for this model in SIZE bytes, from the techniques this trainer has
// (16-bit storage, 8-bit AdamW, a smaller micro-batch with more accumulation, selective or full
// checkpointing, Adafactor), cheapest in step time first; cfg takes the planned setup, and its
// --capacity becomes the budget, so that the allocator holds the run to it. err names a budget
// nothing fits.
static mn_result tr_plan(tr_config *cfg, FILE *out, char *err, size_t cap) {
    mn_model model;
    mn_setup s;
    mn_fit_result *fit = (mn_fit_result *)malloc(sizeof *fit);  // large for a stack
    char a[32], b[32];
    uint32_t i;
    int k;
    mn_result r;
    if (!fit) return MN_ERR_OUT_OF_MEMORY;
    mn_size_format(cfg->budget, a, sizeof a);
    if (cfg->gpu && cfg->budget <= cfg->gpu_context) {  // (the estimator refuses such a setup)
        mn_size_format(cfg->gpu_context, b, sizeof b);
        snprintf(err, cap, "nothing this trainer can do fits --budget %s: the CUDA context "
                 "alone takes %s of the GPU (cudaMemGetInfo)", a, b);
        r = MN_ERR_INVALID_ARG;
        goto done;
    }
    if ((r = tr_estimator_inputs(cfg, cfg->budget, &model, &s)) != MN_OK ||
        (r = mn_fit(&model, &s, fit)) != MN_OK) {
        snprintf(err, cap, "--budget %s: the estimator cannot plan this configuration (%s)", a,
                 mn_result_str(r));
        goto done;
    }
    mn_size_format(fit->plan_estimate.peak_reserved, b, sizeof b);
    if (!fit->plan_found) {
        snprintf(err, cap, "nothing this trainer can do fits --budget %s: the smallest plan "
                 "still reserves %s (try a smaller --size or --batch)", a, b);
        r = MN_ERR_INVALID_ARG;
        goto done;
    }
    if (out) {
        fprintf(out, "budget %s: %s, peak reserved %s predicted\n", a,
                fit->plan_len ? "the plan" : "fits as given", b);
        for (i = 0; i < fit->plan_len; i++)
            fprintf(out, "  %-28s %s\n", fit->plan[i].what, fit->plan[i].why);
    }
    cfg->B = (size_t)fit->plan_setup.batch, cfg->K = (size_t)fit->plan_setup.accum;
    cfg->precision = fit->plan_setup.precision, cfg->optim = fit->plan_setup.optim;
    for (cfg->checkpointing = TR_CKPT_NONE, k = 0; k < 3; k++)
        if (tr_ckpt_mn[k] == fit->plan_setup.checkpointing) cfg->checkpointing = k;
    if (!cfg->capacity || cfg->capacity > cfg->budget) cfg->capacity = cfg->budget;
done:
    free(fit);
    return r;
}

// ---- the run ------------------------------------------------------------------------------------

typedef struct tr_result {
    double entropy;               // H of the Markov source, nats per token (0 with --data)
    double first_loss, last_loss; // the first step's, the mean of the last min(10, steps)
    double seconds;
    double tail_seconds;          // the last min(10, steps) steps' (the loss's tail) seconds
    long tail_steps;
    uint64_t num_params;
    uint64_t optim_bytes;         // optimizer state the parameters hold (cfg.optim)
    uint64_t optim_predicted;     // mn_optim_state_bytes for the same descriptor and shapes
    long steps_run;               // optimizer steps this run took (a resumed run: after the saved)
    long skipped;                 // fp16 steps skipped for an overflow
    float loss_scale;             // fp16: the loss scale at the end
    struct mn_cache_stats stats;  // at the end of training
    char error[256];              // a failure's explanation, "" when the result code says it
} tr_result;



// What goes into a file: a picture or a dump of the snapshot (ctx), written to f.
static mn_result tr_write_svg(void *snap, FILE *f) {
    return mn_cache_timeline_svg((const mn_cache_snapshot *)snap,
                                 "trainer: allocated bytes per category", mn_cache_write_file, f);
}
static mn_result tr_write_json(void *snap, FILE *f) {
    return mn_cache_snapshot_write_json((const mn_cache_snapshot *)snap, mn_cache_write_file, f);
}

// Writes body(s) to path with mn_write_file_atomic (an earlier path survives a failure).
// err: one line naming the flag and the file.
static mn_result tr_write_file(const char *flag, const char *path, mn_file_body_fn body,
                               mn_cache_snapshot *s, char *err, size_t cap) {
    mn_result r = mn_write_file_atomic(path, body, s);
    if (r == MN_ERR_INVALID_ARG)
        snprintf(err, cap, "%s %.60s...: the path is too long", flag, path);
    else if (r != MN_OK)
        snprintf(err, cap, "cannot write %s %.120s: %s", flag, path, mn_result_str(r));
    return r;
}

// The cache's history after training: --memory-svg and --snapshot, when given.
static mn_result tr_write_memory(tr_model *m, FILE *out) {
    const tr_config *c = &m->cfg;
    mn_cache_snapshot snap;
    mn_result r = MN_OK;
    if (!c->memory_svg && !c->snapshot) return MN_OK;
    TR_TRY(mn_cache_snapshot_take(&m->cache, &snap));
    if (c->memory_svg)
        r = tr_write_file("--memory-svg", c->memory_svg, tr_write_svg, &snap, m->error,
                          sizeof m->error);
    if (r == MN_OK && c->snapshot)
        r = tr_write_file("--snapshot", c->snapshot, tr_write_json, &snap, m->error,
                          sizeof m->error);
    if (r == MN_OK && out)
        fprintf(out, "\nhistory: the last %llu events (%llu older ones dropped) in%s%s%s%s\n",
                (unsigned long long)snap.trace_count, (unsigned long long)snap.trace_dropped,
                c->memory_svg ? " " : "", c->memory_svg ? c->memory_svg : "",
                c->snapshot ? " " : "", c->snapshot ? c->snapshot : "");
    mn_cache_snapshot_free(&snap);
    return r;
}

// --json FILE: the run for scripts. The configuration as resolved, every step of this run, the
// summary, and the memory: per category, peak allocated and peak reserved, the bytes measured
// by the allocator beside those the estimator predicted (null when there is no prediction).
typedef struct tr_json_ctx {
    const tr_model *m;
    const tr_result *res;
    const mn_estimate_result *pred;  // or NULL
} tr_json_ctx;

static void tr_json_pair(FILE *f, const char *key, uint64_t measured, const uint64_t *predicted,
                         const char *sep) {
    fprintf(f, "    \"%s\": {\"measured\": %llu, \"predicted\": ", key,
            (unsigned long long)measured);
    if (predicted) fprintf(f, "%llu}%s\n", (unsigned long long)*predicted, sep);
    else fprintf(f, "null}%s\n", sep);
}

static mn_result tr_json_body(void *ctx, FILE *f) {
    const tr_json_ctx *j = (const tr_json_ctx *)ctx;
    const tr_model *m = j->m;
    const tr_config *c = &m->cfg;
    const tr_result *res = j->res;
    const struct mn_cache_stats *st = &res->stats;
    double tokens = (double)c->B * (double)c->T * (double)c->K;
    long i;
    int k;
    fprintf(f, "{\n  \"trainer\": \"memanat %s\",\n  \"config\": {\"layers\": %zu, \"dim\": %zu, "
            "\"heads\": %zu, \"seq\": %zu, \"vocab\": %zu, \"head\": \"%s\", \"batch\": %zu, "
            "\"accum\": %zu, \"steps\": %ld, \"lr\": %.9g, \"clip\": %.9g, \"seed\": %llu, "
            "\"checkpointing\": \"%s\", \"precision\": \"%s\", \"optim\": \"%s\", "
            "\"capacity\": %llu, \"device\": \"%s\", \"gpu\": \"%s\", \"gemm_tune\": %s, "
            "\"data\": ",
            MEMANAT_VERSION, c->L, c->C, c->NH, c->T, c->V, c->tied ? "tied" : "untied", c->B,
            c->K, c->steps, (double)c->lr, (double)c->clip, (unsigned long long)c->seed,
            tr_ckpt_names[c->checkpointing], mn_precision_name(c->precision),
            mn_optim_name(c->optim), (unsigned long long)c->capacity,
            c->device == TR_DEVICE_CUDA ? "cuda" : "cpu", c->gpu ? c->gpu : "cpu",
            c->gemm_tune ? "true" : "false");
    if (c->data) mn_json_fputs_escaped(f, c->data);
    else fputs("null", f);
    fprintf(f, "},\n  \"parameters\": %llu,\n  \"entropy\": ", (unsigned long long)m->num_params);
    if (m->text) fputs("null", f);
    else fprintf(f, "%.9g", res->entropy);
    fprintf(f, ",\n  \"steps\": [\n");
    for (i = 0; i < m->history_len; i++) {
        const tr_step_info *h = &m->history[i];
        fprintf(f, "    {\"step\": %ld, \"loss\": %.9g, \"lr\": %.9g, \"norm\": %.9g, "
                "\"skipped\": %s, \"tokens_per_second\": %.1f}%s\n",
                m->step - m->history_len + i + 1, h->loss, (double)h->lr, (double)h->norm,
                h->skipped ? "true" : "false", tokens / h->seconds,
                i + 1 < m->history_len ? "," : "");
    }
    fprintf(f, "  ],\n  \"summary\": {\"seconds\": %.6f, \"samples_per_second\": %.3f, "
            "\"tokens_per_second\": %.1f, \"first_loss\": %.9g, \"final_loss\": %.9g, "
            "\"skipped_steps\": %ld, \"loss_scale\": %.9g},\n  \"memory\": {\n",
            res->seconds, (double)res->steps_run * c->B * c->K / res->seconds,
            (double)res->steps_run * tokens / res->seconds, res->first_loss, res->last_loss,
            res->skipped, (double)res->loss_scale);
    for (k = 0; k < MN_CAT_COUNT; k++)
        tr_json_pair(f, mn_category_name((mn_category)k), st->cat_allocated_bytes[k].peak,
                     j->pred ? &j->pred->cat_peak[k] : NULL, ",");
    tr_json_pair(f, "peak_allocated", st->allocated_bytes[MN_STAT_ALL].peak,
                 j->pred ? &j->pred->peak_allocated : NULL, ",");
    tr_json_pair(f, "peak_reserved", st->reserved_bytes[MN_STAT_ALL].peak,
                 j->pred ? &j->pred->peak_reserved : NULL, "");
    fprintf(f, "  }\n}\n");
    return ferror(f) ? MN_ERR_IO : MN_OK;
}

// Trains as cfg says; prints to out (NULL: silent). The model's memory is gone on return.
static mn_result tr_run_model(tr_model *m, FILE *out, tr_result *res) {
    const tr_config *c = &m->cfg;
    double t0 = tr_now(), tail = 0.0, tokens = (double)c->B * (double)c->T * (double)c->K;
    long s, first = m->step, last = c->stop_after ? c->stop_after : c->steps, ntail;
    mn_estimate_result pred;
    mn_result pr = out || c->json ? tr_predict(c, &pred) : MN_ERR_STATE;  // reported only
    if (c->steps < 1) return MN_ERR_INVALID_ARG;
    if (first >= last) {
        snprintf(m->error, sizeof m->error, "--resume %.100s is after step %ld already: "
                 "nothing to do before step %ld", c->resume, first, last);
        return MN_ERR_INVALID_ARG;
    }
    ntail = last - first < 10 ? last - first : 10;
    if (out) {
        fprintf(out, "trainer: L=%zu C=%zu NH=%zu T=%zu V=%zu head=%s  B=%zu K=%zu  steps=%ld "
                "lr=%g clip=%g seed=%llu\n         checkpointing=%s precision=%s optim=%s\n",
                c->L, c->C, c->NH, c->T, c->V, c->tied ? "tied" : "untied", c->B, c->K,
                c->steps, (double)c->lr, (double)c->clip, (unsigned long long)c->seed,
                tr_ckpt_names[c->checkpointing], mn_precision_name(c->precision),
                mn_optim_name(c->optim));
        fprintf(out, "parameters: %llu (%.2f MiB fp32%s)\n", (unsigned long long)m->num_params,
                (double)m->num_params * 4.0 / TR_MIB,
                m->half ? ", plus their 16-bit copies: 6 bytes per parameter" : "");
#ifdef MEMANAT_CUDA
        if (m->gpu)
            fprintf(out, "device: %s (sm %d, %d SMs, %.0f MiB; GPU table entry %s); CUDA "
                    "context %.2f MiB (cudaMemGetInfo); cuBLASLt workspace %.2f MiB and "
                    "kernels' scratch %.2f MiB from the cache\n", m->cuda.name, m->cuda.sm,
                    m->cuda.sm_count, (double)c->gpu_total / TR_MIB, c->gpu,
                    (double)c->gpu_context / TR_MIB, (double)m->workspace_bytes / TR_MIB,
                    (double)m->scratch_bytes / TR_MIB);
#endif
        if (m->text)
            fprintf(out, "data: %s, %llu bytes, random windows (uniform guess: ln V = %.4f)\n",
                    c->data, (unsigned long long)m->text_len, log((double)c->V));
        else
            fprintf(out, "data: Markov source, %d successors per byte, entropy rate H = %.4f "
                    "nats/token (uniform guess: ln V = %.4f)\n", TR_SUCC, m->data.entropy,
                    log((double)c->V));
        if (pr == MN_OK) TR_TRY(tr_write_anatomy(&pred, NULL, out));
        if (pr == MN_OK && c->capacity && !pred.fits)
            fprintf(out, "that is more than --capacity %.2f MiB: expect an out-of-memory "
                    "(--budget plans a configuration that fits)\n", (double)c->capacity / TR_MIB);
        else if (pr != MN_OK) fprintf(out, "no prediction: %s\n", mn_result_str(pr));
    }
    res->entropy = m->text ? 0.0 : m->data.entropy;
    res->num_params = m->num_params;
    if (m->step > 0 && out)
        fprintf(out, "resumed from %s after step %ld\n", c->resume, m->step);
    if (c->json) {  // the steps, for the JSON summary
        m->history = (tr_step_info *)malloc((size_t)(last - first) * sizeof *m->history);
        if (!m->history) return MN_ERR_OUT_OF_MEMORY;
    }
    for (s = first; s < last; s++) {
        tr_step_info st;
        TR_TRY(tr_step(m, &st));
        if (m->history) m->history[m->history_len++] = st;
        if (s == first) res->first_loss = st.loss;
        if (s >= last - ntail) tail += st.loss, res->tail_seconds += st.seconds;
        res->skipped += st.skipped;
        res->steps_run++;
        if (out) {
            TR_TRY(mn_cache_stats(&m->cache, &res->stats));
            fprintf(out, "step %5ld/%ld | loss %.4f | lr %.2e | norm %7.4f | ", s + 1, c->steps,
                    st.loss, (double)st.lr, (double)st.norm);
            if (m->half == MN_FP16) fprintf(out, "scale %5.0f | ", (double)m->scaler.scale);
            fprintf(out, "%8.0f tok/s | allocated %.2f MiB (peak %.2f) | reserved %.2f MiB%s\n",
                    tokens / st.seconds,
                    (double)res->stats.allocated_bytes[MN_STAT_ALL].current / TR_MIB,
                    (double)res->stats.allocated_bytes[MN_STAT_ALL].peak / TR_MIB,
                    (double)res->stats.reserved_bytes[MN_STAT_ALL].current / TR_MIB,
                    st.skipped ? " | overflow: step skipped, loss scale halved" : "");
        }
        if (c->save && ((c->save_every && m->step % c->save_every == 0) || s + 1 == last)) {
            TR_TRY(tr_save(m));
            if (out) fprintf(out, "saved %s after step %ld\n", c->save, m->step);
        }
    }
    res->seconds = tr_now() - t0;
    res->last_loss = tail / (double)ntail;
    res->tail_steps = ntail;
    res->loss_scale = m->scaler.scale;
    TR_TRY(mn_cache_stats(&m->cache, &res->stats));
    TR_TRY(tr_optim_bytes(m, &res->optim_bytes, &res->optim_predicted));
    if (out) {
        fprintf(out, "done: %.2f s, %.1f samples/s, %.0f tokens/s; final loss %.4f",
                res->seconds, (double)res->steps_run * c->B * c->K / res->seconds,
                (double)res->steps_run * tokens / res->seconds, res->last_loss);
        if (m->text) fprintf(out, "\n");
        else fprintf(out, " vs H %.4f (+%.4f)\n", res->entropy, res->last_loss - res->entropy);
        fprintf(out, "\nmeasured memory per category:\n");
        TR_TRY(mn_cache_category_summary_write(&res->stats, mn_cache_write_file, out));
        fprintf(out, "\n");
        if (pr == MN_OK) TR_TRY(tr_write_anatomy(&pred, &res->stats, out));
        if (pr == MN_OK && first == 0 && last == 1)
            fprintf(out, "(one step: the optimizer state is made after its backward, so the step "
                    "the prediction\n describes, a forward and backward beside that state, did "
                    "not run here)\n");
        if (pr == MN_OK) fprintf(out, "\n");
        fprintf(out, "optimizer: %s, state %llu bytes (mn_optim_state_bytes: %llu)\n\n",
                mn_optim_name(c->optim), (unsigned long long)res->optim_bytes,
                (unsigned long long)res->optim_predicted);
#ifdef MEMANAT_CUDA
        if (m->gpu)
            TR_TRY(tr_gpu_report(m, &res->stats, pr == MN_OK ? &pred : NULL,
                                 tokens * (double)res->tail_steps / res->tail_seconds, out));
#endif
        TR_TRY(mn_cache_summary_write(&res->stats, 0, 0, mn_cache_write_file, out));
    }
    if (c->json) {
        tr_json_ctx j;
        mn_result r;
        j.m = m, j.res = res, j.pred = pr == MN_OK ? &pred : NULL;
        if ((r = mn_write_file_atomic(c->json, tr_json_body, &j)) != MN_OK) {
            snprintf(m->error, sizeof m->error, "cannot write --json %.120s: %s", c->json,
                     mn_result_str(r));
            return r;
        }
    }
    return tr_write_memory(m, out);
}

static mn_result tr_run(const tr_config *cfg_in, FILE *out, tr_result *res) {
    tr_config planned = *cfg_in, *cfg = &planned;
    tr_model m;
    mn_result r, r2;
    memset(res, 0, sizeof *res);
    if ((r = tr_check_device(cfg, res->error, sizeof res->error)) != MN_OK) return r;
#ifdef MEMANAT_CUDA
    if (cfg->budget && cfg->device == TR_DEVICE_CUDA &&
        (r = tr_gpu_probe(cfg, res->error, sizeof res->error)) != MN_OK)
        return r;
#endif
    if (cfg->budget && (r = tr_plan(cfg, out, res->error, sizeof res->error)) != MN_OK) return r;
    r = tr_model_init(&m, cfg);
    if (r == MN_OK && cfg->resume) r = tr_resume(&m);
    if (r == MN_OK) r = tr_run_model(&m, out, res);
    memcpy(res->error, m.error, sizeof res->error);
    r2 = tr_model_free(&m);
    return r != MN_OK ? r : r2;
}

// ---- main ---------------------------------------------------------------------------------------
#ifndef TRAINER_TESTING
int main(int argc, char **argv) {
    tr_config cfg;
    tr_result res;
    char err[256];
    mn_result r;
#if defined(_OPENMP) && defined(__linux__)
    // libgomp reads its wait policy once, when it loads, and by default a thread that finished its
    // part spins for a while: with another process on the second core, the spinning and the wait
    // for a descheduled team member made 2 threads slower than 1. Unless the user chose a policy,
    // run again with a passive one (threads sleep between loops); if exec fails, go on as we are.
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT")) {
        setenv("OMP_WAIT_POLICY", "passive", 1);
        execv("/proc/self/exe", argv);
    }
#endif
    if (tr_parse_args(argc, argv, &cfg, err, sizeof err) != MN_OK ||
        (!cfg.help && tr_check_device(&cfg, err, sizeof err) != MN_OK)) {
        fprintf(stderr, "trainer: %s\n", err);
        return 2;
    }
    if (cfg.help) {
        printf("usage: trainer [--size tiny|small|medium|gpt2] [--layers L] [--dim C]\n"
               "               [--heads NH] [--seq T] [--vocab V] [--head tied|untied]\n"
               "               [--batch B] [--accum K] [--steps N] [--lr X] [--clip X]\n"
               "               [--seed N] [--checkpointing none|selective|full]\n"
               "               [--precision fp32|fp16|bf16] [--inject-overflow STEP]\n"
               "               [--optim adamw|adamw-8bit|sgd|sgd-momentum|adafactor|lion]\n"
               "               [--budget SIZE] [--capacity SIZE] [--data FILE]\n"
               "               [--save FILE] [--save-every N] [--resume FILE] [--stop-after S]\n"
               "               [--json FILE] [--memory-svg FILE] [--snapshot FILE]\n"
               "               [--fail-alloc-at N] [--device cpu|cuda] [--gemm-tune on|off]\n"
               "Trains a tiny GPT on a generated Markov source (or the bytes of FILE);\n"
               "every tensor lives in memanat's caching allocator. Before training it\n"
               "prints the estimator's prediction for this configuration, after it the\n"
               "measured peaks per memory category beside the prediction.\n"
               "--size: tiny (default: 2 layers, 64 wide, 4 heads, T 64, V 256), small (4,\n"
               "  128, 4, 128, 256), medium (6, 384, 6, 256, 256), gpt2 (GPT-2 small: 12,\n"
               "  768, 12, T 256, V 50257); the other shape flags override it.\n"
               "--checkpointing selective: recompute the attention probabilities in\n"
               "  backward; full: keep each block's input, recompute the block.\n"
               "--precision fp16|bf16: weights and activations stored in 16 bits, computed\n"
               "  in fp32, fp32 master weights, gradients and optimizer state; fp16 scales\n"
               "  the loss (dynamic, from 65536) and skips a step whose gradients overflow;\n"
               "  --inject-overflow STEP plants one.\n"
               "--optim: every optimizer steps at --lr (default 1e-2, warmup then cosine),\n"
               "  no weight decay. adamw: betas 0.9, 0.999 (the default). adamw-8bit: the\n"
               "  same, state in 8-bit blocks of 256 (tensors under 4096 elements in fp32).\n"
               "  sgd: plain, no state. sgd-momentum: momentum 0.9. adafactor: factored\n"
               "  second moment, no first moment, step lr without the parameter scale.\n"
               "  lion: betas 0.9, 0.99 (usually wants a 3-10x smaller --lr than adamw).\n"
               "--budget SIZE (512M, 2G, ...): the estimator's plan of these techniques to\n"
               "  fit SIZE bytes; the run uses it, with --capacity SIZE.\n"
               "--capacity SIZE: the host device hands out at most SIZE bytes.\n"
               "--save FILE: a checkpoint at the end (and every --save-every N steps);\n"
               "  --resume FILE continues it to --steps; --stop-after S ends the run early\n"
               "  on the --steps schedule. Checkpoints carry a checksum and are written\n"
               "  through FILE.tmp, so a failed write leaves the previous FILE intact.\n"
               "--json FILE: the configuration, every step, the summary, and the memory\n"
               "  measured and predicted, for scripts.\n"
               "--memory-svg FILE, --snapshot FILE: after training, the allocator's history\n"
               "  (sized for one step, 4096 to 262144 events) as an SVG timeline and as\n"
               "  the JSON of torch.cuda.memory._snapshot(); each written through FILE.tmp,\n"
               "  then renamed.\n"
               "--fail-alloc-at N: the N-th tensor allocation fails as out of memory (for\n"
               "  testing the failure path).\n"
               "--device cuda: train on the GPU (a build with nvcc): the same model, log and\n"
               "  prediction; gradients in the storage type. With --budget the plan counts\n"
               "  the CUDA context (cudaMemGetInfo) in the budget.\n"
               "--gemm-tune on (--device cuda): each GEMM shape that overwrites its output\n"
               "  (the forward's, attention's) times cuBLASLt's candidates at its first use\n"
               "  and keeps the fastest: no memory of its own, a slower first step, and the\n"
               "  last bits can differ between runs. off (the default): the heuristic's\n"
               "  first, bit-reproducible.\n");
        return 0;
    }
    r = tr_run(&cfg, stdout, &res);
    if (r != MN_OK) {
        fprintf(stderr, "trainer: %s\n", res.error[0] ? res.error : mn_result_str(r));
        return 1;
    }
    return 0;
}
#endif
