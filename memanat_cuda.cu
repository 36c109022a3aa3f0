// memanat_cuda.cu - the CUDA backend of memanat.h (cudart + cuBLASLt, nothing else).
//
// Build: nvcc -c memanat_cuda.cu (the Makefile does it when nvcc is present, for sm_80 and
// sm_90); link the object with cudart and cublasLt into a program that instantiates memanat.h
// (MEMANAT_IMPLEMENTATION) somewhere. The API is declared in memanat.h under MEMANAT_CUDA
// (>>cuda). All state lives in the caller's mn_cuda; this file has no mutable file-scope state.
//
// Layout (the order of >>cuda in the header):
//   context      errors and logging, init/free, streams, plain memory
//   device       the caching allocator's mn_device: cudaMalloc, pooled events, virtual memory
//   kernels      storage types, reductions, then one section per op, each with the grep tag of
//                its CPU reference op (>>ops/...): kernels are `static __global__ *_kernel` with
//                their launcher right below
//   gemm         cuBLASLt with epilogues, a per-context heuristics cache, the unfused fallback
//
// Shapes as in >>ops: N rows, C channels, OC output channels, L softmax row length, V vocabulary,
// B batch, T sequence, n elements. The per-element math is the header's mn_hd_* functions.
#define MEMANAT_CUDA
#include "memanat.h"

#include <cublasLt.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MN__GEMM_CACHE 128         // heuristics cache entries per context
#define MN__VM_GRANULE (2ull << 20)  // expandable segments map 2 MiB granules
#define MN__ROWS_PER_BLOCK 8       // warp-per-row kernels: 8 warps of 32 threads
#define MN__SM_PAIR_WARPS 4       // causal softmax row pairs: 4 warps a block
#define MN__EW_THREADS 256         // element-wise kernels
#define MN__CE_THREADS 512         // cross-entropy: one block per row

// ---- context: errors and logging ----------------------------------------------------------------

typedef struct mn__gemm_key {
    int32_t ta, tb, dtype, epilogue, tf32, beta1, bias_type;
    int32_t pad;
    int64_t m, n, k, lda, ldb, ldd;
    int64_t batch, sa, sb, sd;  // strided batches (batch 0 or 1: one GEMM)
    uint32_t align[5];  // A, B, C/D, bias, aux pointer alignments (bytes, <= 256)
    uint32_t pad2;
} mn__gemm_key;

typedef struct mn__gemm_entry {
    mn__gemm_key key;
    cublasLtMatmulAlgo_t algo;
    int used, ok;  // ok 0: cuBLASLt refused this shape/epilogue, go straight to the fallback
} mn__gemm_entry;

struct mn__cuda_priv {
    cudaStream_t streams[MN_CUDA_MAX_STREAMS];  // [0] is ctx->stream
    uint32_t nstreams;
    // event pool: mn_event = index + 1; free events are kept for reuse
    cudaEvent_t *events;
    uint32_t *free_ids;
    uint32_t nevents, cap, nfree;
    mn__gemm_entry gemm[MN__GEMM_CACHE];
    uint32_t gemm_next;
    void *scratch;            // device scratch (partial sums, BGRADB output, embedding buckets)
    size_t scratch_bytes;
    void *user_scratch;       // the caller's scratch (mn_cuda_scratch_set), taken first
    size_t user_scratch_bytes;
    void *host;               // host scratch (embedding bucketing)
    size_t host_bytes;
    int foreign_workspace;    // ctx->workspace is the caller's (mn_cuda_workspace_set)
    int foreign_stream;       // ctx->stream is the caller's (mn_cuda_desc.stream)
    float *q8_maps;           // device: the signed, then the unsigned dynamic map [2][256] (8-bit),
                              // then their tables (mn_q8_table) [2][MN_Q8_TAB] when q8_tab
    int q8_tab;
    cudaEvent_t tune_ev[2];   // desc.gemm_tune's timing events, made at the first tuned shape
    // driver API for virtual memory (NULL when not available)
    PFN_cuMemAddressReserve_v10020 mem_reserve;
    PFN_cuMemAddressFree_v10020 mem_addr_free;
    PFN_cuMemCreate_v10020 mem_create;
    PFN_cuMemRelease_v10020 mem_release;
    PFN_cuMemMap_v10020 mem_map;
    PFN_cuMemUnmap_v10020 mem_unmap;
    PFN_cuMemSetAccess_v10020 mem_set_access;
    PFN_cuGetErrorString_v6000 get_error_string;
};

static void mn__cu_log(const mn_cuda *ctx, mn_log_level level, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    if (!ctx || !ctx->desc.logger.log_fn) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ctx->desc.logger.log_fn(ctx->desc.logger.user_data, level, msg);
}

// A failed CUDA runtime call: logged with its name and text, cleared, mapped to a result.
static mn_result mn__cu_fail(const mn_cuda *ctx, const char *call, cudaError_t e, int line) {
    mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda.cu:%d: %s: %s (%s)", line, call,
               cudaGetErrorString(e), cudaGetErrorName(e));
    (void)cudaGetLastError();  // clears a non-sticky error
    return e == cudaErrorMemoryAllocation ? MN_ERR_DEVICE_OOM : MN_ERR_DEVICE;
}

static mn_result mn__lt_fail(const mn_cuda *ctx, const char *call, cublasStatus_t s, int line) {
    mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda.cu:%d: %s: %s (%s)", line, call,
               cublasLtGetStatusString(s), cublasLtGetStatusName(s));
    return s == CUBLAS_STATUS_ALLOC_FAILED ? MN_ERR_DEVICE_OOM : MN_ERR_DEVICE;
}

static mn_result mn__bad(const mn_cuda *ctx, const char *what) {
    mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda: invalid argument: %s", what);
    return MN_ERR_INVALID_ARG;
}

#define MN__CU(ctx, call) do { cudaError_t mn_e_ = (call); \
    if (mn_e_ != cudaSuccess) return mn__cu_fail(ctx, #call, mn_e_, __LINE__); } while (0)
#define MN__LT(ctx, call) do { cublasStatus_t mn_s_ = (call); \
    if (mn_s_ != CUBLAS_STATUS_SUCCESS) return mn__lt_fail(ctx, #call, mn_s_, __LINE__); } while (0)
#define MN__LAUNCHED(ctx) MN__CU(ctx, cudaGetLastError())
#define MN__CHECK(ctx, cond) do { if (!(cond)) return mn__bad(ctx, #cond); } while (0)

static cudaStream_t mn__stream(const mn_cuda *ctx) { return (cudaStream_t)ctx->stream; }

static void *mn__host_alloc(const mn_cuda *ctx, size_t size) {
    const mn_allocator *a = &ctx->desc.allocator;
    return a->alloc_fn ? a->alloc_fn(a->user_data, size) : malloc(size);
}
static void mn__host_free(const mn_cuda *ctx, void *p) {
    const mn_allocator *a = &ctx->desc.allocator;
    if (!p) return;
    if (a->free_fn) a->free_fn(a->user_data, p);
    else free(p);
}

// Device scratch of at least bytes: the caller's where it is large enough, else the context's own
// (grown, never shrunk; the old buffer is freed after a wait).
static mn_result mn__scratch(mn_cuda *ctx, size_t bytes, void **out) {
    struct mn__cuda_priv *p = ctx->p;
    if (bytes <= p->user_scratch_bytes) {
        *out = p->user_scratch;
        return MN_OK;
    }
    if (bytes > p->scratch_bytes) {
        size_t want = bytes < (1u << 20) ? (size_t)(1u << 20) : bytes;
        MN__CU(ctx, cudaStreamSynchronize(mn__stream(ctx)));
        if (p->scratch) MN__CU(ctx, cudaFree(p->scratch));
        p->scratch = NULL, p->scratch_bytes = 0;
        MN__CU(ctx, cudaMalloc(&p->scratch, want));
        p->scratch_bytes = want;
    }
    *out = p->scratch;
    return MN_OK;
}

static mn_result mn__host_scratch(mn_cuda *ctx, size_t bytes, void **out) {
    struct mn__cuda_priv *p = ctx->p;
    if (bytes > p->host_bytes) {
        void *q = mn__host_alloc(ctx, bytes);
        if (!q) return MN_ERR_OUT_OF_MEMORY;
        mn__host_free(ctx, p->host);
        p->host = q, p->host_bytes = bytes;
    }
    *out = p->host;
    return MN_OK;
}

// ---- context: init / free / streams / memory ----------------------------------------------------

MNDEF mn_result mn_cuda_device_count(int *count, char *reason, size_t cap) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (count) *count = 0;
    if (e != cudaSuccess || n <= 0) {
        if (reason && cap)
            snprintf(reason, cap, "cudaGetDeviceCount: %s",
                     e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        (void)cudaGetLastError();
        return MN_ERR_DEVICE;
    }
    if (count) *count = n;
    if (reason && cap) reason[0] = 0;
    return MN_OK;
}

// The cuBLASLt workspace for an SM: the GPU table's value for the first GPU of that SM, else the
// cuBLAS recommendation the table follows (32 MiB from sm 90 on, 4 MiB before).
static uint64_t mn__workspace_for_sm(int sm) {
    uint32_t i, n = mn_gpu_count();
    for (i = 0; i < n; i++) {
        const mn_gpu *g = mn_gpu_get(i);
        if (g && (int)g->sm == sm && g->cublas_workspace) return g->cublas_workspace;
    }
    return sm >= 90 ? 32ull << 20 : 4ull << 20;
}

// Driver entry points for the virtual-memory API, resolved through the runtime so that nothing
// links libcuda (on a machine without a driver the program still starts and reports no device).
static void mn__resolve_driver(mn_cuda *ctx) {
    struct mn__cuda_priv *p = ctx->p;
    struct {
        const char *name;
        void **fn;
    } want[] = {
        {"cuMemAddressReserve", (void **)&p->mem_reserve},
        {"cuMemAddressFree", (void **)&p->mem_addr_free},
        {"cuMemCreate", (void **)&p->mem_create},
        {"cuMemRelease", (void **)&p->mem_release},
        {"cuMemMap", (void **)&p->mem_map},
        {"cuMemUnmap", (void **)&p->mem_unmap},
        {"cuMemSetAccess", (void **)&p->mem_set_access},
        {"cuGetErrorString", (void **)&p->get_error_string},
    };
    size_t i;
    for (i = 0; i < sizeof want / sizeof want[0]; i++) {
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        void *fn = NULL;
        cudaError_t e = cudaGetDriverEntryPointByVersion(want[i].name, &fn, 12000,
                                                         cudaEnableDefault, &q);
        if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) {
            (void)cudaGetLastError();
            mn__cu_log(ctx, MN_LOG_WARN, "memanat_cuda: driver entry point %s not found: "
                       "expandable_segments unavailable", want[i].name);
            p->mem_reserve = NULL;
            return;
        }
        *want[i].fn = fn;
    }
}

static void mn__release(mn_cuda *ctx) {
    struct mn__cuda_priv *p = ctx->p;
    uint32_t i;
    if (!p) return;
    if (ctx->stream) (void)cudaStreamSynchronize(mn__stream(ctx));
    for (i = 0; i < p->nevents; i++)
        if (p->events[i]) (void)cudaEventDestroy(p->events[i]);
    mn__host_free(ctx, p->events);
    mn__host_free(ctx, p->free_ids);
    for (i = 1; i < p->nstreams; i++) (void)cudaStreamDestroy(p->streams[i]);
    if (p->scratch) (void)cudaFree(p->scratch);
    if (p->q8_maps) (void)cudaFree(p->q8_maps);
    for (i = 0; i < 2; i++)
        if (p->tune_ev[i]) (void)cudaEventDestroy(p->tune_ev[i]);
    mn__host_free(ctx, p->host);
    if (ctx->workspace && !p->foreign_workspace) (void)cudaFree(ctx->workspace);
    if (ctx->lt) (void)cublasLtDestroy((cublasLtHandle_t)ctx->lt);
    if (ctx->stream && !p->foreign_stream) (void)cudaStreamDestroy(mn__stream(ctx));
    mn__host_free(ctx, p);
    ctx->p = NULL, ctx->stream = NULL, ctx->lt = NULL, ctx->workspace = NULL;
}

MNDEF mn_result mn_cuda_init(mn_cuda *ctx, const mn_cuda_desc *desc) {
    cudaDeviceProp prop;
    cudaStream_t s = NULL;
    cublasLtHandle_t lt = NULL;
    size_t free_b = 0, total_b = 0;
    int count = 0;
    mn_result r;
    char reason[160];
    if (!ctx) return MN_ERR_INVALID_ARG;
    memset(ctx, 0, sizeof *ctx);
    if (desc) ctx->desc = *desc;
    if ((r = mn_cuda_device_count(&count, reason, sizeof reason)) != MN_OK) {
        mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda: no CUDA device (%s)", reason);
        return r;
    }
    if (ctx->desc.device < 0 || ctx->desc.device >= count) {
        mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda: device %d does not exist (%d devices)",
                   ctx->desc.device, count);
        return MN_ERR_INVALID_ARG;
    }
    ctx->p = (struct mn__cuda_priv *)mn__host_alloc(ctx, sizeof *ctx->p);
    if (!ctx->p) return MN_ERR_OUT_OF_MEMORY;
    memset(ctx->p, 0, sizeof *ctx->p);
    if ((r = [&]() -> mn_result {
             MN__CU(ctx, cudaSetDevice(ctx->desc.device));
             MN__CU(ctx, cudaGetDeviceProperties(&prop, ctx->desc.device));
             MN__CU(ctx, cudaMemGetInfo(&free_b, &total_b));
             if (ctx->desc.stream) {
                 s = (cudaStream_t)ctx->desc.stream;
                 ctx->p->foreign_stream = 1;
             } else {
                 MN__CU(ctx, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
             }
             ctx->stream = s;
             MN__LT(ctx, cublasLtCreate(&lt));
             ctx->lt = lt;
             return MN_OK;
         }()) != MN_OK)
        goto undo_all;
    ctx->sm = prop.major * 10 + prop.minor;
    ctx->sm_count = prop.multiProcessorCount;
    snprintf(ctx->name, sizeof ctx->name, "%s", prop.name);
    ctx->total_bytes = total_b;
    ctx->workspace_bytes = ctx->desc.workspace ? ctx->desc.workspace
                                               : mn__workspace_for_sm(ctx->sm);
    ctx->desc.workspace = ctx->workspace_bytes;
    {
        cudaError_t e = cudaMalloc(&ctx->workspace, ctx->workspace_bytes);
        if (e != cudaSuccess) {
            ctx->workspace = NULL;
            r = mn__cu_fail(ctx, "cudaMalloc(workspace)", e, __LINE__);
            goto undo_all;
        }
    }
    ctx->p->streams[0] = s;
    ctx->p->nstreams = 1;
    mn__resolve_driver(ctx);
    return MN_OK;
undo_all:
    mn__release(ctx);
    memset(ctx, 0, sizeof *ctx);
    return r;
}

MNDEF void mn_cuda_free(mn_cuda *ctx) {
    if (!ctx) return;
    mn__release(ctx);
    memset(ctx, 0, sizeof *ctx);
}

MNDEF mn_result mn_cuda_sync(mn_cuda *ctx) {
    if (!ctx || !ctx->p) return MN_ERR_INVALID_ARG;
    MN__CU(ctx, cudaStreamSynchronize(mn__stream(ctx)));
    return MN_OK;
}

MNDEF mn_result mn_cuda_stream_create(mn_cuda *ctx, mn_stream *out) {
    struct mn__cuda_priv *p;
    if (!ctx || !ctx->p || !out) return MN_ERR_INVALID_ARG;
    p = ctx->p;
    if (p->nstreams >= MN_CUDA_MAX_STREAMS) return MN_ERR_UNSUPPORTED;
    MN__CU(ctx, cudaStreamCreateWithFlags(&p->streams[p->nstreams], cudaStreamNonBlocking));
    *out = p->nstreams++;
    return MN_OK;
}

MNDEF mn_result mn_cuda_stream_get(mn_cuda *ctx, mn_stream s, void **cuda_stream_out) {
    if (!ctx || !ctx->p || !cuda_stream_out || s >= ctx->p->nstreams) return MN_ERR_INVALID_ARG;
    *cuda_stream_out = (void *)ctx->p->streams[s];
    return MN_OK;
}

MNDEF mn_result mn_cuda_mem_alloc(mn_cuda *ctx, uint64_t bytes, void **ptr_out) {
    if (!ctx || !ctx->p || !ptr_out) return MN_ERR_INVALID_ARG;
    *ptr_out = NULL;
    MN__CU(ctx, cudaMalloc(ptr_out, bytes ? (size_t)bytes : 1));
    return MN_OK;
}

MNDEF mn_result mn_cuda_mem_release(mn_cuda *ctx, void *ptr) {
    if (!ctx || !ctx->p) return MN_ERR_INVALID_ARG;
    if (ptr) MN__CU(ctx, cudaFree(ptr));
    return MN_OK;
}

MNDEF mn_result mn_cuda_mem_copy(mn_cuda *ctx, void *dst, const void *src, uint64_t bytes) {
    if (!ctx || !ctx->p || (bytes && (!dst || !src))) return MN_ERR_INVALID_ARG;
    if (!bytes) return MN_OK;
    MN__CU(ctx, cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDefault, mn__stream(ctx)));
    MN__CU(ctx, cudaStreamSynchronize(mn__stream(ctx)));
    return MN_OK;
}

MNDEF mn_result mn_cuda_mem_set(mn_cuda *ctx, void *ptr, int byte, uint64_t bytes) {
    if (!ctx || !ctx->p || (bytes && !ptr)) return MN_ERR_INVALID_ARG;
    if (bytes) MN__CU(ctx, cudaMemsetAsync(ptr, byte, (size_t)bytes, mn__stream(ctx)));
    return MN_OK;
}

MNDEF mn_result mn_cuda_workspace_set(mn_cuda *ctx, void *ptr, uint64_t bytes) {
    struct mn__cuda_priv *p;
    if (!ctx || !ctx->p || (bytes && !ptr) || (ptr && !bytes) || ((uintptr_t)ptr & 15u) != 0) {
        mn__cu_log(ctx, MN_LOG_ERROR, "mn_cuda_workspace_set: want 16-byte aligned ptr with "
                   "bytes > 0, or NULL with 0 (got %p, %llu)", ptr, (unsigned long long)bytes);
        return MN_ERR_INVALID_ARG;
    }
    p = ctx->p;
    MN__CU(ctx, cudaStreamSynchronize(mn__stream(ctx)));  // no GEMM still uses the old one
    if (ctx->workspace && !p->foreign_workspace) MN__CU(ctx, cudaFree(ctx->workspace));
    ctx->workspace = ptr, ctx->workspace_bytes = bytes, ctx->desc.workspace = bytes;
    p->foreign_workspace = ptr != NULL;
    memset(p->gemm, 0, sizeof p->gemm);  // algorithms were chosen for the old workspace size
    p->gemm_next = 0;
    return MN_OK;
}

MNDEF mn_result mn_cuda_scratch_set(mn_cuda *ctx, void *ptr, uint64_t bytes) {
    if (!ctx || !ctx->p || (bytes && !ptr) || (ptr && !bytes) || ((uintptr_t)ptr & 255u) != 0 ||
        bytes > SIZE_MAX) {
        mn__cu_log(ctx, MN_LOG_ERROR, "mn_cuda_scratch_set: want 256-byte aligned ptr with "
                   "bytes > 0, or NULL with 0 (got %p, %llu)", ptr, (unsigned long long)bytes);
        return MN_ERR_INVALID_ARG;
    }
    MN__CU(ctx, cudaStreamSynchronize(mn__stream(ctx)));  // no kernel still uses the old one
    ctx->p->user_scratch = ptr, ctx->p->user_scratch_bytes = (size_t)bytes;
    return MN_OK;
}

// ---- device: the caching allocator's backend ----------------------------------------------------
// Called by mn_cache under its lock, so the event pool needs no lock of its own.

static mn_result mn__dev_alloc(void *u, uint64_t size, void **ptr_out) {
    mn_cuda *ctx = (mn_cuda *)u;
    cudaError_t e = cudaMalloc(ptr_out, (size_t)size);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();  // an OOM is not sticky: clear it, the allocator retries
        *ptr_out = NULL;
        return MN_ERR_DEVICE_OOM;
    }
    if (e != cudaSuccess) return mn__cu_fail(ctx, "cudaMalloc", e, __LINE__);
    return MN_OK;
}

static mn_result mn__dev_free(void *u, void *ptr, uint64_t size) {
    mn_cuda *ctx = (mn_cuda *)u;
    (void)size;
    MN__CU(ctx, cudaFree(ptr));
    return MN_OK;
}

static mn_result mn__dev_mem_info(void *u, uint64_t *free_out, uint64_t *total_out) {
    mn_cuda *ctx = (mn_cuda *)u;
    size_t f = 0, t = 0;
    MN__CU(ctx, cudaMemGetInfo(&f, &t));
    *free_out = f, *total_out = t;
    return MN_OK;
}

static mn_result mn__dev_event_record(void *u, mn_stream stream, mn_event *event_out) {
    mn_cuda *ctx = (mn_cuda *)u;
    struct mn__cuda_priv *p = ctx->p;
    uint32_t id;
    if (stream >= p->nstreams) return mn__bad(ctx, "event on an unknown mn_stream");
    if (!p->nfree) {  // grow the pool by one event (the arrays double)
        if (p->nevents == p->cap) {
            uint32_t cap = p->cap ? p->cap * 2 : 16;
            cudaEvent_t *ev = (cudaEvent_t *)mn__host_alloc(ctx, cap * sizeof *ev);
            uint32_t *fr = (uint32_t *)mn__host_alloc(ctx, cap * sizeof *fr);
            if (!ev || !fr) {
                mn__host_free(ctx, ev);
                mn__host_free(ctx, fr);
                return MN_ERR_OUT_OF_MEMORY;
            }
            if (p->nevents) memcpy(ev, p->events, p->nevents * sizeof *ev);
            mn__host_free(ctx, p->events);
            mn__host_free(ctx, p->free_ids);
            p->events = ev, p->free_ids = fr, p->cap = cap;
        }
        MN__CU(ctx, cudaEventCreateWithFlags(&p->events[p->nevents], cudaEventDisableTiming));
        p->free_ids[p->nfree++] = p->nevents++;
    }
    id = p->free_ids[--p->nfree];
    {
        cudaError_t e = cudaEventRecord(p->events[id], p->streams[stream]);
        if (e != cudaSuccess) {
            p->free_ids[p->nfree++] = id;
            return mn__cu_fail(ctx, "cudaEventRecord", e, __LINE__);
        }
    }
    *event_out = (mn_event)id + 1;
    return MN_OK;
}

static int mn__dev_event_query(void *u, mn_event event) {
    mn_cuda *ctx = (mn_cuda *)u;
    cudaError_t e = cudaEventQuery(ctx->p->events[event - 1]);
    if (e == cudaErrorNotReady) return 0;
    if (e != cudaSuccess) (void)mn__cu_fail(ctx, "cudaEventQuery", e, __LINE__);
    return 1;  // done, or failed (a failed event would never complete: reported, not waited on)
}

static mn_result mn__dev_event_sync(void *u, mn_event event) {
    mn_cuda *ctx = (mn_cuda *)u;
    MN__CU(ctx, cudaEventSynchronize(ctx->p->events[event - 1]));
    return MN_OK;
}

static void mn__dev_event_free(void *u, mn_event event) {
    mn_cuda *ctx = (mn_cuda *)u;
    if (event) ctx->p->free_ids[ctx->p->nfree++] = (uint32_t)(event - 1);
}

static mn_result mn__drv_fail(mn_cuda *ctx, const char *call, CUresult e, int line) {
    const char *s = NULL;
    if (ctx->p->get_error_string) ctx->p->get_error_string(e, &s);
    mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda.cu:%d: %s: %s (CUresult %d)", line, call,
               s ? s : "unknown error", (int)e);
    return e == CUDA_ERROR_OUT_OF_MEMORY ? MN_ERR_DEVICE_OOM : MN_ERR_DEVICE;
}
#define MN__DRV(ctx, call) do { CUresult mn_d_ = (call); \
    if (mn_d_ != CUDA_SUCCESS) return mn__drv_fail(ctx, #call, mn_d_, __LINE__); } while (0)

static mn_result mn__dev_reserve(void *u, uint64_t size, void **base_out) {
    mn_cuda *ctx = (mn_cuda *)u;
    CUdeviceptr base = 0;
    MN__DRV(ctx, ctx->p->mem_reserve(&base, (size_t)size, MN__VM_GRANULE, 0, 0));
    *base_out = (void *)base;
    return MN_OK;
}

static mn_result mn__dev_unreserve(void *u, void *base, uint64_t size) {
    mn_cuda *ctx = (mn_cuda *)u;
    MN__DRV(ctx, ctx->p->mem_addr_free((CUdeviceptr)base, (size_t)size));
    return MN_OK;
}

// Unmaps [addr, addr + size) granule by granule (each granule is its own mapping).
static mn_result mn__dev_unmap(void *u, void *addr, uint64_t size) {
    mn_cuda *ctx = (mn_cuda *)u;
    uint64_t off;
    MN__CU(ctx, cudaDeviceSynchronize());  // work in flight on any stream may still use it
    for (off = 0; off < size; off += MN__VM_GRANULE)
        MN__DRV(ctx, ctx->p->mem_unmap((CUdeviceptr)addr + off, MN__VM_GRANULE));
    return MN_OK;
}

// Maps physical memory behind [addr, addr + size): one cuMemCreate per 2 MiB granule, mapped,
// made accessible, and its handle released at once (the mapping keeps the memory alive until
// cuMemUnmap), so any granule-aligned range can be unmapped later. On failure the granules
// mapped by this call are unmapped again.
static mn_result mn__dev_map(void *u, void *addr, uint64_t size) {
    mn_cuda *ctx = (mn_cuda *)u;
    struct mn__cuda_priv *p = ctx->p;
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    uint64_t off;
    mn_result r = MN_OK;
    if (size % MN__VM_GRANULE || (uint64_t)(uintptr_t)addr % MN__VM_GRANULE)
        return mn__bad(ctx, "map range not in 2 MiB granules");
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ctx->desc.device;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (off = 0; off < size; off += MN__VM_GRANULE) {
        CUmemGenericAllocationHandle h = 0;
        CUdeviceptr a = (CUdeviceptr)addr + off;
        CUresult e = p->mem_create(&h, MN__VM_GRANULE, &prop, 0);
        if (e == CUDA_ERROR_OUT_OF_MEMORY) {
            r = MN_ERR_DEVICE_OOM;  // the allocator's OOM ladder takes over: not an error line
            break;
        }
        if (e != CUDA_SUCCESS) {
            r = mn__drv_fail(ctx, "cuMemCreate", e, __LINE__);
            break;
        }
        e = p->mem_map(a, MN__VM_GRANULE, 0, h, 0);
        if (e == CUDA_SUCCESS) {
            e = p->mem_set_access(a, MN__VM_GRANULE, &acc, 1);
            if (e != CUDA_SUCCESS) (void)p->mem_unmap(a, MN__VM_GRANULE);
        }
        (void)p->mem_release(h);
        if (e != CUDA_SUCCESS) {
            r = mn__drv_fail(ctx, "cuMemMap/cuMemSetAccess", e, __LINE__);
            break;
        }
    }
    if (r != MN_OK) {
        uint64_t back;
        for (back = 0; back < off; back += MN__VM_GRANULE)
            (void)p->mem_unmap((CUdeviceptr)addr + back, MN__VM_GRANULE);
    }
    return r;
}

MNDEF mn_device mn_cuda_device(mn_cuda *ctx) {
    mn_device d;
    memset(&d, 0, sizeof d);
    if (!ctx || !ctx->p) return d;
    d.alloc_fn = mn__dev_alloc;
    d.free_fn = mn__dev_free;
    d.mem_info_fn = mn__dev_mem_info;
    d.event_record_fn = mn__dev_event_record;
    d.event_query_fn = mn__dev_event_query;
    d.event_sync_fn = mn__dev_event_sync;
    d.event_free_fn = mn__dev_event_free;
    if (ctx->p->mem_reserve) {
        d.reserve_fn = mn__dev_reserve;
        d.unreserve_fn = mn__dev_unreserve;
        d.map_fn = mn__dev_map;
        d.unmap_fn = mn__dev_unmap;
    }
    d.user_data = ctx;
    return d;
}

// ---- kernels: storage types and reductions ------------------------------------------------------

template <typename T> __device__ __forceinline__ float mn__ld(const T *p);
template <> __device__ __forceinline__ float mn__ld<float>(const float *p) { return *p; }
template <> __device__ __forceinline__ float mn__ld<__half>(const __half *p) {
    return __half2float(*p);
}
template <> __device__ __forceinline__ float mn__ld<__nv_bfloat16>(const __nv_bfloat16 *p) {
    return __bfloat162float(*p);
}
template <typename T> __device__ __forceinline__ T mn__cvt(float x);
template <> __device__ __forceinline__ float mn__cvt<float>(float x) { return x; }
template <> __device__ __forceinline__ __half mn__cvt<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 mn__cvt<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
// x as stored in T and read back: what a later kernel sees.
template <typename T> __device__ __forceinline__ float mn__round(float x) {
    T t = mn__cvt<T>(x);
    return mn__ld<T>(&t);
}

// 128-bit accesses: a pack of 16 / sizeof(T) elements (4 fp32 or 8 fp16/bf16) in one uint4 load
// or store, as llm.c's x128; mn__ldk / mn__stk move K elements, the pack (VEC) or one.
template <typename T> struct __align__(16) mn__pack {
    T v[16 / sizeof(T)];
};
// Asks L2 for the line holding p (no register waits for it): a grid-stride loop names the data of
// its next step so that the step's loads find it in L2.
__device__ __forceinline__ void mn__prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
template <typename T> __device__ __forceinline__ mn__pack<T> mn__ld16(const T *p) {
    mn__pack<T> r;
    *reinterpret_cast<uint4 *>(&r) = *reinterpret_cast<const uint4 *>(p);
    return r;
}
template <typename T> __device__ __forceinline__ void mn__st16(T *p, const mn__pack<T> &r) {
    *reinterpret_cast<uint4 *>(p) = *reinterpret_cast<const uint4 *>(&r);
}
static int mn__is16(const void *p) { return ((uintptr_t)p & 15u) == 0; }
template <typename T, int VEC> __device__ __forceinline__ mn__pack<T> mn__ldk(const T *p) {
    mn__pack<T> r;
    if (VEC) r = mn__ld16(p);
    else r.v[0] = *p;
    return r;
}
template <typename T, int VEC> __device__ __forceinline__ void mn__stk(T *p, const mn__pack<T> &r) {
    if (VEC) mn__st16(p, r);
    else *p = r.v[0];
}

__device__ __forceinline__ float mn__warp_sum(float v) {
    int o;
    for (o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float mn__warp_max(float v) {
    int o;
    for (o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ mn_hd_maxsum mn__warp_maxsum(mn_hd_maxsum s) {
    int o;
    for (o = 16; o > 0; o >>= 1) {
        mn_hd_maxsum t;
        t.max = __shfl_xor_sync(0xffffffffu, s.max, o);
        t.sum = __shfl_xor_sync(0xffffffffu, s.sum, o);
        s = mn_hd_maxsum_merge(s, t);
    }
    return s;
}

// exp for a row's softmax or cross-entropy, by storage type: 16-bit storage takes __expf (the
// hardware's exp2 after a multiply: a few ulp of fp32, far below a half ulp of fp16 or bf16),
// fp32 expf, as the host's mn_hd_* arithmetic.
template <typename T> __device__ __forceinline__ float mn__ce_exp(float x) {
    return sizeof(T) == 4 ? expf(x) : __expf(x);
}
// exp(x a - m) for a row whose maximum m (of x a) is known, in the hot loops: fp32 storage expf of
// the difference, as the host; 16-bit storage mn_hd_exp_fma with al = a log2 e and ml = m log2 e
// taken once a row.
template <typename T>
__device__ __forceinline__ float mn__row_exp(float x, float a, float m, float al, float ml) {
    return sizeof(T) == 4 ? expf(a * x - m) : mn_hd_exp_fma(x, al, ml);
}

static unsigned mn__blocks(uint64_t n, unsigned per_block) {
    uint64_t b = (n + per_block - 1) / per_block;
    return (unsigned)(b > 0x7fffffffull ? 0x7fffffffull : b);
}

// Grid for grid-stride element-wise kernels: enough blocks to fill the device a few times over.
static unsigned mn__ew_grid(const mn_cuda *ctx, uint64_t n) {
    unsigned cap = (unsigned)(ctx->sm_count > 0 ? ctx->sm_count : 1) * 32u;
    unsigned b = mn__blocks(n, MN__EW_THREADS);
    return b < 1 ? 1 : b > cap ? cap : b;
}

// Dispatch on the storage dtype to fn<float>, fn<__half> or fn<__nv_bfloat16>.
#define MN__DISPATCH(ctx, dtype, fn, ...) do { switch (dtype) { \
    case MN_DTYPE_DEFAULT: case MN_FP32: return fn<float>(__VA_ARGS__); \
    case MN_FP16: return fn<__half>(__VA_ARGS__); \
    case MN_BF16: return fn<__nv_bfloat16>(__VA_ARGS__); \
    default: return mn__bad(ctx, "dtype is not fp32, fp16 or bf16"); } } while (0)

static size_t mn__round256(size_t bytes) { return (bytes + 255) / 256 * 256; }

#define MN__CTX(ctx) do { if (!(ctx) || !(ctx)->p) return MN_ERR_INVALID_ARG; } while (0)

// 1 when a shape's a * b * c elements fit size_t as floats (a factor may be 0), as memanat.h's
// mn__ops_fits: every entry point checks the products it uses as element counts or offsets on
// the host, before any launch, so that none wraps. uint64_t: the optimizers' counts are 64-bit.
static int mn__cu_fits(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t lim = (uint64_t)(SIZE_MAX / sizeof(float));
    if (a && b > lim / a) return 0;
    if (a != 0 && b != 0 && c > lim / (a * b)) return 0;
    return 1;
}

// Column partial sums, shared by the LayerNorm parameter gradients and the bias gradient: block
// (32, 8) covers 32 columns and a chunk of rows; partial[chunk, c] is written; the finish kernel
// adds sum_chunk partial[chunk, c] (in chunk order: deterministic) into dst[c].
#define MN__COL_THREADS_Y 8
static unsigned mn__row_chunks(size_t N) {
    size_t chunks = (N + 63) / 64;  // 64 rows per chunk, at most 512 chunks
    return (unsigned)(chunks > 512 ? 512 : chunks < 1 ? 1 : chunks);
}

template <typename T>
static __global__ void __launch_bounds__(256) mn__col_finish_kernel(T *dst, const float *partial,
                                                                    unsigned chunks, size_t C) {
    size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned k;
    float s = 0.0f;
    if (c >= C) return;
    for (k = 0; k < chunks; k++) s += partial[(size_t)k * C + c];
    dst[c] = mn__cvt<T>(mn__ld<T>(dst + c) + s);
}

// ---- kernels: >>ops layernorm -------------------------------------------------------------------
// One warp per row: the mean, then the centred variance (two passes, as the CPU op), then the
// output; a third read of the row comes from L1/L2. RESID: residual = inp1 + inp2 is stored first
// and the statistics are taken over the stored (rounded) values. VEC: each lane moves 16-byte
// packs (C a multiple of the pack, every pointer 16-byte aligned), else one element at a time.

template <typename T, int RESID, int VEC>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__layernorm_forward_kernel(T *residual, T *out, float *mean, float *rstd, const T *inp1,
                             const T *inp2, const T *weight, const T *bias, size_t N, size_t C,
                             float eps) {
    const int K = VEC ? (int)(16 / sizeof(T)) : 1;
    size_t row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32, i;
    unsigned lane = threadIdx.x % 32;
    const T *x;
    float s = 0.0f, m, v = 0.0f, r;
    int k;
    if (row >= N) return;
    x = (RESID ? residual : inp1) + row * C;
    for (i = lane * K; i < C; i += 32 * K) {
        mn__pack<T> p;
        if (RESID) {  // residual = inp1 + inp2, stored; the statistics of the stored values
            mn__pack<T> a = mn__ldk<T, VEC>(inp1 + row * C + i);
            mn__pack<T> b = mn__ldk<T, VEC>(inp2 + row * C + i);
            for (k = 0; k < K; k++) p.v[k] = mn__cvt<T>(mn__ld<T>(&a.v[k]) + mn__ld<T>(&b.v[k]));
            mn__stk<T, VEC>(residual + row * C + i, p);
        } else {
            p = mn__ldk<T, VEC>(x + i);
        }
        for (k = 0; k < K; k++) s += mn__ld<T>(&p.v[k]);
    }
    m = mn__warp_sum(s) / (float)C;
    for (i = lane * K; i < C; i += 32 * K) {  // the lane reads back what it wrote
        mn__pack<T> p = mn__ldk<T, VEC>(x + i);
        for (k = 0; k < K; k++) {
            float d = mn__ld<T>(&p.v[k]) - m;
            v += d * d;
        }
    }
    r = mn_hd_rstd(mn__warp_sum(v) / (float)C, eps);
    for (i = lane * K; i < C; i += 32 * K) {
        mn__pack<T> p = mn__ldk<T, VEC>(x + i), w = mn__ldk<T, VEC>(weight + i), b, o;
        if (bias) b = mn__ldk<T, VEC>(bias + i);
        for (k = 0; k < K; k++)
            o.v[k] = mn__cvt<T>(mn_hd_layernorm_out(mn__ld<T>(&p.v[k]), m, r, mn__ld<T>(&w.v[k]),
                                                    bias ? mn__ld<T>(&b.v[k]) : 0.0f));
        mn__stk<T, VEC>(out + row * C + i, o);
    }
    if (lane == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = r;
    }
}

// The register path, for rows of at most 8 packs a lane (C <= 32 K 8, K = 16 / sizeof(T)) when C
// is a multiple of the pack and every pointer is 16-byte aligned: the warp reads its row once
// into NP packs a lane (pack j of lane l holds columns (32 j + l) K ..; packs past C are not
// read), takes the mean and the centred variance from the registers in the order of the kernel
// above, and writes the output. RESID: inp1 and inp2 are read whole before residual is written,
// so residual may alias either. Bytes: 2 N C sizeof(T) (4 with RESID) + 8 N.
template <typename T, int RESID, int NP>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__layernorm_forward_reg_kernel(T *residual, T *out, float *mean, float *rstd, const T *inp1,
                                 const T *inp2, const T *weight, const T *bias, size_t N, size_t C,
                                 float eps) {
    const int K = (int)(16 / sizeof(T));
    size_t row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    mn__pack<T> p[NP];
    float s = 0.0f, m, v = 0.0f, r;
    int j, k;
    if (row >= N) return;
    if (RESID) {
        mn__pack<T> a[NP], b[NP];
#pragma unroll
        for (j = 0; j < NP; j++) {
            size_t i = ((size_t)j * 32 + lane) * K;
            if (i < C) a[j] = mn__ld16(inp1 + row * C + i), b[j] = mn__ld16(inp2 + row * C + i);
        }
#pragma unroll
        for (j = 0; j < NP; j++) {
            size_t i = ((size_t)j * 32 + lane) * K;
            if (i >= C) continue;
#pragma unroll
            for (k = 0; k < K; k++)
                p[j].v[k] = mn__cvt<T>(mn__ld<T>(&a[j].v[k]) + mn__ld<T>(&b[j].v[k]));
            mn__st16(residual + row * C + i, p[j]);
        }
    } else {
#pragma unroll
        for (j = 0; j < NP; j++) {
            size_t i = ((size_t)j * 32 + lane) * K;
            if (i < C) p[j] = mn__ld16(inp1 + row * C + i);
        }
    }
#pragma unroll
    for (j = 0; j < NP; j++)
        if (((size_t)j * 32 + lane) * K < C)
#pragma unroll
            for (k = 0; k < K; k++) s += mn__ld<T>(&p[j].v[k]);
    m = mn__warp_sum(s) / (float)C;
#pragma unroll
    for (j = 0; j < NP; j++)
        if (((size_t)j * 32 + lane) * K < C)
#pragma unroll
            for (k = 0; k < K; k++) {
                float d = mn__ld<T>(&p[j].v[k]) - m;
                v += d * d;
            }
    r = mn_hd_rstd(mn__warp_sum(v) / (float)C, eps);
#pragma unroll
    for (j = 0; j < NP; j++) {
        size_t i = ((size_t)j * 32 + lane) * K;
        mn__pack<T> w, b, o;
        if (i >= C) continue;
        w = mn__ld16(weight + i);
        if (bias) b = mn__ld16(bias + i);
#pragma unroll
        for (k = 0; k < K; k++)
            o.v[k] = mn__cvt<T>(mn_hd_layernorm_out(mn__ld<T>(&p[j].v[k]), m, r, mn__ld<T>(&w.v[k]),
                                                    bias ? mn__ld<T>(&b.v[k]) : 0.0f));
        mn__st16(out + row * C + i, o);
    }
    if (lane == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = r;
    }
}

// Packs a lane for a row of C elements in packs of K, rounded up to an instantiated count
// (1, 2, 3, 4, 6, 8); 0 when the row does not fit in 8.
static int mn__ln_np(size_t C, size_t K) {
    size_t n = (C / K + 31) / 32;
    return n <= 4 ? (int)n : n <= 6 ? 6 : n <= 8 ? 8 : 0;
}

// The register kernel when C is a multiple of the pack, every pointer is 16-byte aligned and the
// row fits in 8 packs a lane; else the kernel above, 16-byte packs when aligned.
template <typename T, int RESID>
static void mn__layernorm_launch(mn_cuda *ctx, void *residual, void *out, float *mean, float *rstd,
                                 const void *inp1, const void *inp2, const void *weight,
                                 const void *bias, size_t N, size_t C, float eps) {
    unsigned grid = mn__blocks(N, MN__ROWS_PER_BLOCK), threads = 32 * MN__ROWS_PER_BLOCK;
    cudaStream_t s = mn__stream(ctx);
    int vec = C % (16 / sizeof(T)) == 0 && mn__is16(residual) && mn__is16(out) &&
              mn__is16(inp1) && mn__is16(inp2) && mn__is16(weight) && mn__is16(bias);
    int np = vec ? mn__ln_np(C, 16 / sizeof(T)) : 0;
#define MN__LN_FWD(NP) mn__layernorm_forward_reg_kernel<T, RESID, NP><<<grid, threads, 0, s>>>( \
        (T *)residual, (T *)out, mean, rstd, (const T *)inp1, (const T *)inp2, (const T *)weight, \
        (const T *)bias, N, C, eps)
    switch (np) {
    case 1: MN__LN_FWD(1); return;
    case 2: MN__LN_FWD(2); return;
    case 3: MN__LN_FWD(3); return;
    case 4: MN__LN_FWD(4); return;
    case 6: MN__LN_FWD(6); return;
    case 8: MN__LN_FWD(8); return;
    default: break;
    }
#undef MN__LN_FWD
    if (vec)
        mn__layernorm_forward_kernel<T, RESID, 1><<<grid, threads, 0, s>>>(
            (T *)residual, (T *)out, mean, rstd, (const T *)inp1, (const T *)inp2,
            (const T *)weight, (const T *)bias, N, C, eps);
    else
        mn__layernorm_forward_kernel<T, RESID, 0><<<grid, threads, 0, s>>>(
            (T *)residual, (T *)out, mean, rstd, (const T *)inp1, (const T *)inp2,
            (const T *)weight, (const T *)bias, N, C, eps);
}

template <typename T>
static mn_result mn__layernorm_forward(mn_cuda *ctx, void *residual, void *out, float *mean,
                                       float *rstd, const void *inp1, const void *inp2,
                                       const void *weight, const void *bias, size_t N, size_t C,
                                       float eps) {
    if (residual)
        mn__layernorm_launch<T, 1>(ctx, residual, out, mean, rstd, inp1, inp2, weight, bias, N, C,
                                   eps);
    else
        mn__layernorm_launch<T, 0>(ctx, NULL, out, mean, rstd, inp1, NULL, weight, bias, N, C,
                                   eps);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

MNDEF mn_result mn_cuda_layernorm_forward(mn_cuda *ctx, void *out, float *mean, float *rstd,
                                          const void *inp, const void *weight, const void *bias,
                                          size_t N, size_t C, float eps, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, out && inp && weight);
    MN__CHECK(ctx, C > 0);
    if (!mn__cu_fits(N, C, 1)) return mn__bad(ctx, "N * C overflows");
    if (N == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__layernorm_forward, ctx, NULL, out, mean, rstd, inp, NULL, weight,
                 bias, N, C, eps);
}

MNDEF mn_result mn_cuda_residual_layernorm_forward(mn_cuda *ctx, void *residual, void *out,
                                                   float *mean, float *rstd, const void *inp1,
                                                   const void *inp2, const void *weight,
                                                   const void *bias, size_t N, size_t C,
                                                   float eps, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, residual && out && inp1 && inp2 && weight);
    MN__CHECK(ctx, C > 0);
    if (!mn__cu_fits(N, C, 1)) return mn__bad(ctx, "N * C overflows");
    if (N == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__layernorm_forward, ctx, residual, out, mean, rstd, inp1, inp2,
                 weight, bias, N, C, eps);
}

// dinp: one warp per row, sums of g = w dy and g xh in fp32, then dx += r (g - mean g - xh mean).
template <typename T>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__layernorm_backward_kernel(T *dinp, const T *dout, const T *inp, const T *weight,
                              const float *mean, const float *rstd, size_t N, size_t C) {
    size_t row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32, i;
    unsigned lane = threadIdx.x % 32;
    const T *x, *dy;
    T *dx;
    float m, r, sg = 0.0f, sgx = 0.0f, gm, gxm;
    if (row >= N) return;
    x = inp + row * C, dy = dout + row * C, dx = dinp + row * C;
    m = mean[row], r = rstd[row];
    for (i = lane; i < C; i += 32) {
        float g = mn__ld<T>(weight + i) * mn__ld<T>(dy + i);
        sg += g;
        sgx += g * ((mn__ld<T>(x + i) - m) * r);
    }
    gm = mn__warp_sum(sg) / (float)C;
    gxm = mn__warp_sum(sgx) / (float)C;
    for (i = lane; i < C; i += 32) {
        float g = mn__ld<T>(weight + i) * mn__ld<T>(dy + i), xh = (mn__ld<T>(x + i) - m) * r;
        dx[i] = mn__cvt<T>(mn__ld<T>(dx + i) + mn_hd_layernorm_dinp(g, xh, gm, gxm, r));
    }
}

// dweight / dbias partial sums per chunk of rows: pw[chunk, c] = sum dy xh, pb[chunk, c] = sum dy.
template <typename T>
static __global__ void __launch_bounds__(32 * MN__COL_THREADS_Y)
mn__layernorm_param_partial_kernel(float *pw, float *pb, const T *dout, const T *inp,
                                   const float *mean, const float *rstd, size_t N, size_t C,
                                   size_t rows_per_chunk) {
    __shared__ float sw[MN__COL_THREADS_Y][32], sb[MN__COL_THREADS_Y][32];
    size_t c = (size_t)blockIdx.x * 32 + threadIdx.x, r0 = blockIdx.y * rows_per_chunk, r;
    size_t r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
    float aw = 0.0f, ab = 0.0f;
    unsigned k;
    if (c < C)
        for (r = r0 + threadIdx.y; r < r1; r += MN__COL_THREADS_Y) {
            float dy = mn__ld<T>(dout + r * C + c);
            aw += dy * ((mn__ld<T>(inp + r * C + c) - mean[r]) * rstd[r]);
            ab += dy;
        }
    sw[threadIdx.y][threadIdx.x] = aw, sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y != 0 || c >= C) return;
    aw = 0.0f, ab = 0.0f;
    for (k = 0; k < MN__COL_THREADS_Y; k++) aw += sw[k][threadIdx.x], ab += sb[k][threadIdx.x];
    if (pw) pw[(size_t)blockIdx.y * C + c] = aw;
    if (pb) pb[(size_t)blockIdx.y * C + c] = ab;
}

// The register path of the whole backward, for C a multiple of the pack, C <= 1024 (at most 32
// columns a lane: their dweight and dbias sums live in registers) and 16-byte aligned pointers.
// Warp w of the grid takes rows w, w + warps, ..., reads the row's dy and x once into NP packs a
// lane (the columns of the forward's register path: each lane always owns the same ones; their
// weight comes from L1 on each use, registers being short), forms the two row sums, writes
// dx += r (g - mean g - xh mean g xh), and adds dy xh and dy into its columns' sums. At the end
// the block adds its warps' sums in warp order through shared memory into pw[block, C] and
// pb[block, C] (either may be NULL; then the sums are not kept). weight is read only with dinp.
// Bytes: 4 N C sizeof(T) + 8 N, and 2 x 4 C per block of partial sums written and read back.
#define MN__LN_BWD_COLS 32       // register path of the backward: at most 32 columns a lane

template <typename T, int NP>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__layernorm_backward_reg_kernel(T *dinp, float *pw, float *pb, const T *dout, const T *inp,
                                  const T *weight, const float *mean, const float *rstd, size_t N,
                                  size_t C) {
    const int K = (int)(16 / sizeof(T)), CW = 32 * K * NP;
    __shared__ float red[MN__ROWS_PER_BLOCK * CW];
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    size_t row, warps = (size_t)gridDim.x * MN__ROWS_PER_BLOCK, c;
    float aw[NP][K], ab[NP][K];
    int j, k, q;
#pragma unroll
    for (j = 0; j < NP; j++)
#pragma unroll
        for (k = 0; k < K; k++) aw[j][k] = 0.0f, ab[j][k] = 0.0f;
    for (row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + warp; row < N; row += warps) {
        mn__pack<T> dy[NP], x[NP];
        float m = mean[row], r = rstd[row], sg = 0.0f, sgx = 0.0f, gm, gxm;
#pragma unroll
        for (j = 0; j < NP; j++) {
            size_t i = ((size_t)j * 32 + lane) * K;
            if (i < C) dy[j] = mn__ld16(dout + row * C + i), x[j] = mn__ld16(inp + row * C + i);
        }
        if (row + warps < N)  // the warp's next row
#pragma unroll
            for (j = 0; j < NP; j++) {
                size_t i = ((size_t)j * 32 + lane) * K, o = (row + warps) * C + i;
                if (i >= C) continue;
                mn__prefetch_l2(dout + o), mn__prefetch_l2(inp + o);
                if (dinp) mn__prefetch_l2(dinp + o);
            }
#pragma unroll
        for (j = 0; j < NP; j++) {
            size_t i = ((size_t)j * 32 + lane) * K;
            mn__pack<T> w;
            if (i >= C) continue;
            if (dinp) w = mn__ld16(weight + i);
#pragma unroll
            for (k = 0; k < K; k++) {
                float d = mn__ld<T>(&dy[j].v[k]), xh = (mn__ld<T>(&x[j].v[k]) - m) * r;
                aw[j][k] += d * xh, ab[j][k] += d;
                if (dinp) {
                    float g = mn__ld<T>(&w.v[k]) * d;
                    sg += g, sgx += g * xh;
                }
            }
        }
        if (!dinp) continue;
        gm = mn__warp_sum(sg) / (float)C;
        gxm = mn__warp_sum(sgx) / (float)C;
#pragma unroll
        for (j = 0; j < NP; j++) {
            size_t i = ((size_t)j * 32 + lane) * K;
            mn__pack<T> o, w;
            if (i >= C) continue;
            o = mn__ld16(dinp + row * C + i), w = mn__ld16(weight + i);
#pragma unroll
            for (k = 0; k < K; k++) {
                float d = mn__ld<T>(&dy[j].v[k]), xh = (mn__ld<T>(&x[j].v[k]) - m) * r;
                float g = mn__ld<T>(&w.v[k]) * d;
                o.v[k] = mn__cvt<T>(mn__ld<T>(&o.v[k]) + mn_hd_layernorm_dinp(g, xh, gm, gxm, r));
            }
            mn__st16(dinp + row * C + i, o);
        }
    }
#pragma unroll
    for (q = 0; q < 2; q++) {  // q 0: dweight's sums, 1: dbias's; the branches are block-uniform
        float *part = q ? pb : pw;
        if (!part) continue;
#pragma unroll
        for (j = 0; j < NP; j++)
#pragma unroll
            for (k = 0; k < K; k++)
                red[warp * CW + (j * 32 + lane) * K + k] = q ? ab[j][k] : aw[j][k];
        __syncthreads();
        for (c = threadIdx.x; c < C; c += blockDim.x) {
            float s = 0.0f;
            for (j = 0; j < MN__ROWS_PER_BLOCK; j++) s += red[j * CW + c];
            part[(size_t)blockIdx.x * C + c] = s;
        }
        __syncthreads();
    }
}

// dweight += sum_b pw[b, C], dbias += sum_b pb[b, C] (either may be NULL) in one launch: block
// (32, 16) covers 32 columns; thread y adds the partial rows y, y + 16, ... in order, then row 0
// adds the 16 sums in order (deterministic). grid (C / 32, 2): y 0 dweight, 1 dbias.
#define MN__LN_FINISH_Y 16
template <typename T>
static __global__ void __launch_bounds__(32 * MN__LN_FINISH_Y)
mn__layernorm_param_finish_kernel(T *dweight, T *dbias, const float *pw, const float *pb,
                                  unsigned parts, size_t C) {
    __shared__ float sh[MN__LN_FINISH_Y][33];
    T *dst = blockIdx.y ? dbias : dweight;
    const float *part = blockIdx.y ? pb : pw;
    size_t c = (size_t)blockIdx.x * 32 + threadIdx.x;
    unsigned k;
    float s = 0.0f;
    if (!dst) return;  // the whole block
    if (c < C)
        for (k = threadIdx.y; k < parts; k += MN__LN_FINISH_Y) s += part[(size_t)k * C + c];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y != 0 || c >= C) return;
    s = 0.0f;
    for (k = 0; k < MN__LN_FINISH_Y; k++) s += sh[k][threadIdx.x];
    dst[c] = mn__cvt<T>(mn__ld<T>(dst + c) + s);
}

// The register path: one kernel over all rows on a grid that the device holds at once (the
// kernel's blocks an SM, at most 4, times the SMs), then one finish kernel for both parameter
// gradients. The grid depends only on the device and the shape: the sums keep their order.
template <typename T, int NP>
static mn_result mn__layernorm_backward_reg(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                            const void *dout, const void *inp, const void *weight,
                                            const float *mean, const float *rstd, size_t N,
                                            size_t C) {
    cudaStream_t s = mn__stream(ctx);
    unsigned grid = mn__blocks(N, MN__ROWS_PER_BLOCK), cap;
    float *pw = NULL, *pb = NULL;
    int occ = 0;
    MN__CU(ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                    &occ, mn__layernorm_backward_reg_kernel<T, NP>, 32 * MN__ROWS_PER_BLOCK, 0));
    occ = occ < 1 ? 1 : occ > 4 ? 4 : occ;
    cap = (unsigned)(ctx->sm_count > 0 ? ctx->sm_count : 1) * (unsigned)occ;
    if (grid > cap) grid = cap;
    if (dweight || dbias) {
        void *scr;
        mn_result r;
        if ((r = mn__scratch(ctx, 2 * (size_t)grid * C * sizeof(float), &scr)) != MN_OK) return r;
        pw = dweight ? (float *)scr : NULL;
        pb = dbias ? (float *)scr + (size_t)grid * C : NULL;
    }
    mn__layernorm_backward_reg_kernel<T, NP><<<grid, 32 * MN__ROWS_PER_BLOCK, 0, s>>>(
        (T *)dinp, pw, pb, (const T *)dout, (const T *)inp, (const T *)weight, mean, rstd, N, C);
    MN__LAUNCHED(ctx);
    if (dweight || dbias) {
        dim3 fgrid(mn__blocks(C, 32), 2), fblock(32, MN__LN_FINISH_Y);
        mn__layernorm_param_finish_kernel<T><<<fgrid, fblock, 0, s>>>((T *)dweight, (T *)dbias,
                                                                      pw, pb, grid, C);
        MN__LAUNCHED(ctx);
    }
    return MN_OK;
}

// The register path when C is a multiple of the pack, at most MN__LN_BWD_COLS columns a lane and
// every pointer 16-byte aligned; else the row kernel, the column kernel and a finish a gradient.
template <typename T>
static mn_result mn__layernorm_backward(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                        const void *dout, const void *inp, const void *weight,
                                        const float *mean, const float *rstd, size_t N,
                                        size_t C) {
    cudaStream_t s = mn__stream(ctx);
    const int K = (int)(16 / sizeof(T));
    int np = C % K == 0 && mn__is16(dinp) && mn__is16(dout) && mn__is16(inp) && mn__is16(weight)
                 ? mn__ln_np(C, K) : 0;
    // NP past MN__LN_BWD_COLS / K never comes here: instantiated as 1, not launched.
#define MN__LN_BWD(NP) return mn__layernorm_backward_reg<T, \
        ((NP) * K <= MN__LN_BWD_COLS ? (NP) : 1)>(ctx, dinp, dweight, dbias, dout, inp, weight, \
                                                   mean, rstd, N, C)
    if (np && (size_t)np * K <= MN__LN_BWD_COLS) switch (np) {
        case 1: MN__LN_BWD(1);
        case 2: MN__LN_BWD(2);
        case 3: MN__LN_BWD(3);
        case 4: MN__LN_BWD(4);
        case 6: MN__LN_BWD(6);
        case 8: MN__LN_BWD(8);
        default: break;
        }
#undef MN__LN_BWD
    if (dinp) {
        mn__layernorm_backward_kernel<T><<<mn__blocks(N, MN__ROWS_PER_BLOCK),
                                           32 * MN__ROWS_PER_BLOCK, 0, s>>>(
            (T *)dinp, (const T *)dout, (const T *)inp, (const T *)weight, mean, rstd, N, C);
        MN__LAUNCHED(ctx);
    }
    if (dweight || dbias) {
        unsigned chunks = mn__row_chunks(N);
        size_t rows = (N + chunks - 1) / chunks;
        void *scr;
        float *pw, *pb;
        mn_result r;
        dim3 grid(mn__blocks(C, 32), chunks), block(32, MN__COL_THREADS_Y);
        if ((r = mn__scratch(ctx, 2 * (size_t)chunks * C * sizeof(float), &scr)) != MN_OK) return r;
        pw = dweight ? (float *)scr : NULL;
        pb = dbias ? (float *)scr + (size_t)chunks * C : NULL;
        mn__layernorm_param_partial_kernel<T><<<grid, block, 0, s>>>(
            pw, pb, (const T *)dout, (const T *)inp, mean, rstd, N, C, rows);
        MN__LAUNCHED(ctx);
        if (dweight) {
            mn__col_finish_kernel<T><<<mn__blocks(C, 256), 256, 0, s>>>((T *)dweight, pw, chunks, C);
            MN__LAUNCHED(ctx);
        }
        if (dbias) {
            mn__col_finish_kernel<T><<<mn__blocks(C, 256), 256, 0, s>>>((T *)dbias, pb, chunks, C);
            MN__LAUNCHED(ctx);
        }
    }
    return MN_OK;
}

MNDEF mn_result mn_cuda_layernorm_backward(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                           const void *dout, const void *inp, const void *weight,
                                           const float *mean, const float *rstd, size_t N,
                                           size_t C, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, dout && inp && mean && rstd);
    MN__CHECK(ctx, !dinp || weight);
    MN__CHECK(ctx, C > 0);
    if (!mn__cu_fits(N, C, 1)) return mn__bad(ctx, "N * C overflows");
    if (N == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__layernorm_backward, ctx, dinp, dweight, dbias, dout, inp, weight,
                 mean, rstd, N, C);
}

// ---- kernels: >>ops softmax ---------------------------------------------------------------------
// One warp per row: the online max/sum over the visible columns (a pack's maximum first, the sum
// rescaled once a pack), then the probabilities (masked columns exactly 0; 16-bit storage by the
// fast exp times 1 / sum, mn__ce_exp). Backward: dot = sum out dout, then dinp += scale out
// (dout - dot). VEC: each lane moves 16-byte packs (L a multiple of the pack, the tensors 16-byte
// aligned), else single elements; a pack wholly past the visible columns is not read.
// Row in registers (L a multiple of the pack K = 16 / sizeof(T), L <= 32 K NP, the tensors
// 16-byte aligned): lane l holds packs j = 0..NP-1 at column (32 j + l) K, every load is issued
// before any arithmetic and the row is read once. The forward takes the row's maximum, then sums
// the exponentials and computes each again for its product (passes over registers, not the online
// rescaling: the same probabilities up to fp32 rounding). The one-row kernels take rows without
// a mask; causal rows go to the pair kernels below (the same layout, two rows a warp, a pack
// wholly past the visible columns neither read nor, backward, written), except the backward's
// long 16-bit rows (mn__softmax_backward says why). Else the streaming kernels: the visible row
// is read twice, the second time from L1/L2.
#define MN__SM_NP_MAX 8  // packs a lane: rows of up to 2048 fp16/bf16 or 1024 fp32 columns
#define MN__SM_BWD_U 2     // the streaming backward's packs in flight a lane in its dot's pass

template <typename T, int NP>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__softmax_forward_reg_kernel(T *out, const T *inp, size_t N, size_t L, float scale) {
    enum { K = 16 / sizeof(T) };
    size_t row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    mn__pack<T> p[NP];
    float mx = -INFINITY, sum = 0.0f, inv;
    int j, k;
    if (row >= N) return;
#pragma unroll
    for (j = 0; j < NP; j++) {  // i < L and L % K == 0: the whole pack is in the row
        size_t i = ((size_t)j * 32 + lane) * K;
        if (i < L) p[j] = mn__ld16(inp + row * L + i);
    }
#pragma unroll
    for (j = 0; j < NP; j++) {
        size_t i = ((size_t)j * 32 + lane) * K;
#pragma unroll
        for (k = 0; k < K; k++)
            if (i < L) mx = fmaxf(mx, scale * mn__ld<T>(&p[j].v[k]));
    }
    mx = mn__warp_max(mx);
    const float al = scale * MN_HD_LOG2E, ml = mx * MN_HD_LOG2E;
#pragma unroll
    for (j = 0; j < NP; j++) {
        size_t i = ((size_t)j * 32 + lane) * K;
#pragma unroll
        for (k = 0; k < K; k++)
            if (i < L) sum += mn__row_exp<T>(mn__ld<T>(&p[j].v[k]), scale, mx, al, ml);
    }
    sum = mn__warp_sum(sum);
    inv = 1.0f / sum;
#pragma unroll
    for (j = 0; j < NP; j++) {
        size_t i = ((size_t)j * 32 + lane) * K;
        mn__pack<T> o;
        if (i >= L) continue;
#pragma unroll
        for (k = 0; k < K; k++) {  // fp32 divides, as mn_hd_softmax_prob
            float e = mn__row_exp<T>(mn__ld<T>(&p[j].v[k]), scale, mx, al, ml);
            o.v[k] = mn__cvt<T>(sizeof(T) == 4 ? e / sum : e * inv);
        }
        mn__st16(out + row * L + i, o);
    }
}

template <typename T, int NP>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__softmax_backward_reg_kernel(T *dinp, const T *dout, const T *out, size_t N, size_t L,
                                float scale) {
    enum { K = 16 / sizeof(T) };
    size_t row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    mn__pack<T> p[NP], q[NP], d[NP];
    float dot = 0.0f;
    int j, k;
    if (row >= N) return;
#pragma unroll
    for (j = 0; j < NP; j++) {  // y, dy and dx of the row's packs, all loads issued at once
        size_t i = ((size_t)j * 32 + lane) * K;
        if (i < L) {
            p[j] = mn__ld16(out + row * L + i), q[j] = mn__ld16(dout + row * L + i);
            d[j] = mn__ld16(dinp + row * L + i);
        }
    }
#pragma unroll
    for (j = 0; j < NP; j++) {
        size_t i = ((size_t)j * 32 + lane) * K;
#pragma unroll
        for (k = 0; k < K; k++)
            if (i < L) dot += mn__ld<T>(&p[j].v[k]) * mn__ld<T>(&q[j].v[k]);
    }
    dot = mn__warp_sum(dot);
#pragma unroll
    for (j = 0; j < NP; j++) {
        size_t i = ((size_t)j * 32 + lane) * K;
        if (i >= L) continue;
#pragma unroll
        for (k = 0; k < K; k++)
            d[j].v[k] = mn__cvt<T>(mn__ld<T>(&d[j].v[k]) +
                                   mn_hd_softmax_dinp(mn__ld<T>(&p[j].v[k]),
                                                      mn__ld<T>(&q[j].v[k]), dot, scale));
        mn__st16(dinp + row * L + i, d[j]);
    }
}

// Causal rows in pairs (mn_hd_softmax_pair) on the register path's layout: rows t and T - 1 - t of
// a T x T matrix see T + 1 columns together, at most NP + 1 packs a lane where one row needs NP.
// A warp takes such a pair: twice the bytes in flight of a lone causal row (on average) for one
// more pack of registers, and every warp the same work. Slot s < ja holds pack s of the short row
// a, slot s >= ja pack s - ja of the long row b. A lane adds each pack's terms, then the pack's
// sum to its row's: fp32 rounding apart from the one-row kernels. The rows of a last, partial
// matrix go one a warp.
struct mn__sm_pair {
    size_t ra, rb;  // the rows (mn_hd_softmax_pair)
    int la, lb;     // their visible lengths; lb 0: row a alone
    int ja, jb;     // packs a lane of each row that any lane of the warp reads
};
__device__ __forceinline__ int mn__sm_pair_rows(mn__sm_pair *q, size_t w, size_t N, size_t L,
                                                int P) {
    uint64_t ra, rb;
    if (w >= mn_hd_softmax_pairs(N, L)) return 0;
    mn_hd_softmax_pair(w, N, L, &ra, &rb);
    q->ra = ra, q->rb = rb, q->la = (int)mn_hd_softmax_len(ra, L, 1);
    q->lb = rb != ra ? (int)mn_hd_softmax_len(rb, L, 1) : 0;
    q->ja = (q->la + P - 1) / P, q->jb = (q->lb + P - 1) / P;
    return 1;
}
// Slot s of a lane: in row b (inb), at column i of its row, rem = visible columns from i on (the
// pack's element k is visible when k < rem). 32-bit: rows of the register path are short.
#define MN__SM_SLOT(s) const int inb = (s) >= q.ja; \
    const int i = ((inb ? (s) - q.ja : (s)) * 32 + (int)lane) * K, rem = (inb ? q.lb : q.la) - i

template <typename T, int NP>
static __global__ void __launch_bounds__(32 * MN__SM_PAIR_WARPS)
mn__softmax_forward_pair_kernel(T *out, const T *inp, size_t N, size_t L, float scale) {
    enum { K = 16 / sizeof(T), S = NP + 1 };
    size_t w = (size_t)blockIdx.x * MN__SM_PAIR_WARPS + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    mn__sm_pair q;
    mn__pack<T> p[S];
    float mxa = -INFINITY, mxb = -INFINITY, sa = 0.0f, sb = 0.0f;
    int s, j, k;
    if (!mn__sm_pair_rows(&q, w, N, L, 32 * K)) return;
    const T *xa = inp + q.ra * L, *xb = inp + q.rb * L;
    T *ya = out + q.ra * L, *yb = out + q.rb * L;
#pragma unroll
    for (s = 0; s < S; s++) {  // all loads first
        MN__SM_SLOT(s);
        if (rem > 0) p[s] = mn__ld16((inb ? xb : xa) + i);
    }
#pragma unroll
    for (s = 0; s < S; s++) {
        MN__SM_SLOT(s);
        float t = -INFINITY;
        (void)i;
#pragma unroll
        for (k = 0; k < K; k++)
            if (k < rem) t = fmaxf(t, scale * mn__ld<T>(&p[s].v[k]));
        if (inb) mxb = fmaxf(mxb, t);
        else mxa = fmaxf(mxa, t);
    }
    mxa = mn__warp_max(mxa), mxb = mn__warp_max(mxb);
    const float al = scale * MN_HD_LOG2E, mla = mxa * MN_HD_LOG2E, mlb = mxb * MN_HD_LOG2E;
#pragma unroll
    for (s = 0; s < S; s++) {
        MN__SM_SLOT(s);
        const float mx = inb ? mxb : mxa, ml = inb ? mlb : mla;
        float t = 0.0f;
        (void)i;
#pragma unroll
        for (k = 0; k < K; k++)
            if (k < rem) t += mn__row_exp<T>(mn__ld<T>(&p[s].v[k]), scale, mx, al, ml);
        if (inb) sb += t;
        else sa += t;
    }
    sa = mn__warp_sum(sa), sb = mn__warp_sum(sb);
#pragma unroll
    for (s = 0; s < S; s++) {  // the packs some lane reads: their masked columns 0
        MN__SM_SLOT(s);
        const float mx = inb ? mxb : mxa, ml = inb ? mlb : mla, sum = inb ? sb : sa;
        const float inv = 1.0f / sum;
        mn__pack<T> o;
        if ((inb && (s) - q.ja >= q.jb) || i >= (int)L) continue;
#pragma unroll
        for (k = 0; k < K; k++) {  // fp32 divides, as mn_hd_softmax_prob
            float e = mn__row_exp<T>(mn__ld<T>(&p[s].v[k]), scale, mx, al, ml);
            o.v[k] = mn__cvt<T>(k >= rem ? 0.0f : sizeof(T) == 4 ? e / sum : e * inv);
        }
        mn__st16((inb ? yb : ya) + i, o);
    }
    mn__pack<T> z;
#pragma unroll
    for (k = 0; k < K; k++) z.v[k] = mn__cvt<T>(0.0f);
#pragma unroll
    for (j = 0; j < NP; j++) {  // the packs no lane reads: zeros
        int i = (j * 32 + (int)lane) * K;
        if (i >= (int)L) continue;
        if (j >= q.ja) mn__st16(ya + i, z);
        if (q.lb && j >= q.jb) mn__st16(yb + i, z);
    }
}

template <typename T, int NP>
static __global__ void __launch_bounds__(32 * MN__SM_PAIR_WARPS)
mn__softmax_backward_pair_kernel(T *dinp, const T *dout, const T *out, size_t N, size_t L,
                                 float scale) {
    enum { K = 16 / sizeof(T), S = NP + 1 };
    size_t w = (size_t)blockIdx.x * MN__SM_PAIR_WARPS + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    mn__sm_pair q;
    mn__pack<T> p[S], g[S], d[S];
    float da = 0.0f, db = 0.0f;
    int s, k;
    if (!mn__sm_pair_rows(&q, w, N, L, 32 * K)) return;
    const size_t oa = q.ra * L, ob = q.rb * L;
#pragma unroll
    for (s = 0; s < S; s++) {  // y, dy and dx of the visible packs, all loads issued at once
        MN__SM_SLOT(s);
        const size_t o = (inb ? ob : oa) + i;
        if (rem > 0) p[s] = mn__ld16(out + o), g[s] = mn__ld16(dout + o), d[s] = mn__ld16(dinp + o);
    }
#pragma unroll
    for (s = 0; s < S; s++) {
        MN__SM_SLOT(s);
        float t = 0.0f;
        (void)i;
#pragma unroll
        for (k = 0; k < K; k++)
            if (k < rem) t += mn__ld<T>(&p[s].v[k]) * mn__ld<T>(&g[s].v[k]);
        if (inb) db += t;
        else da += t;
    }
    da = mn__warp_sum(da), db = mn__warp_sum(db);
#pragma unroll
    for (s = 0; s < S; s++) {  // a pack across the visible end keeps its masked entries
        MN__SM_SLOT(s);
        const float dot = inb ? db : da;
        if (rem <= 0) continue;
#pragma unroll
        for (k = 0; k < K; k++)
            if (k < rem)
                d[s].v[k] = mn__cvt<T>(mn__ld<T>(&d[s].v[k]) +
                                       mn_hd_softmax_dinp(mn__ld<T>(&p[s].v[k]),
                                                          mn__ld<T>(&g[s].v[k]), dot, scale));
        mn__st16(dinp + (inb ? ob : oa) + i, d[s]);
    }
}
#undef MN__SM_SLOT

template <typename T, int VEC>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__softmax_forward_kernel(T *out, const T *inp, size_t N, size_t L, float scale, int causal) {
    const int K = VEC ? (int)(16 / sizeof(T)) : 1;
    size_t row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32, i, len;
    unsigned lane = threadIdx.x % 32;
    const T *x;
    mn_hd_maxsum s = mn_hd_maxsum_init();
    int k;
    if (row >= N) return;
    x = inp + row * L;
    len = (size_t)mn_hd_softmax_len(row, L, causal);
    for (i = lane * K; i < len; i += 32 * K) {  // the pack's maximum, then its exponentials
        mn__pack<T> p = mn__ldk<T, VEC>(x + i);
        float pm = -INFINITY;
        for (k = 0; k < K && i + k < len; k++) pm = fmaxf(pm, scale * mn__ld<T>(&p.v[k]));
        if (pm > s.max) s.sum *= mn__ce_exp<T>(s.max - pm), s.max = pm;
        for (k = 0; k < K && i + k < len; k++)
            s.sum += mn__ce_exp<T>(scale * mn__ld<T>(&p.v[k]) - s.max);
    }
    s = mn__warp_maxsum(s);
    float inv = 1.0f / s.sum;
    for (i = lane * K; i < L; i += 32 * K) {
        mn__pack<T> p, o;
        if (i < len) p = mn__ldk<T, VEC>(x + i);
        for (k = 0; k < K; k++) {
            float y = 0.0f;
            if (i + k < len) {
                float v = scale * mn__ld<T>(&p.v[k]);
                y = sizeof(T) == 4 ? mn_hd_softmax_prob(v, s) : __expf(v - s.max) * inv;
            }
            o.v[k] = mn__cvt<T>(y);
        }
        mn__stk<T, VEC>(out + row * L + i, o);
    }
}

// The dot's pass issues the loads of U packs a lane before their arithmetic (the same sums in the
// same order as one pack at a time); the second pass, which holds three tensors' packs, takes one.
// An H200, bf16, causal 1024 x 1024, cold: U 2 against 1 (46 against 30 registers) 0.116 against
// 0.118-0.128 ms at 96 matrices, 0.221 against 0.248-0.256 at 192, 0.856 against 1.058 at 768
// (74.7 to 92.3 % of a copy's rate); U 2 in both passes (58 registers) 0.121 / 0.233 / 0.905 ms,
// U 4 in the dot's pass 0.177 / 0.344 / 1.352.
template <typename T, int VEC, int U>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__softmax_backward_kernel(T *dinp, const T *dout, const T *out, size_t N, size_t L, float scale,
                            int causal) {
    const int K = VEC ? (int)(16 / sizeof(T)) : 1;
    const size_t S = 32 * (size_t)K;  // a warp's stride
    size_t row = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32, i, len;
    unsigned lane = threadIdx.x % 32;
    const T *y, *dy;
    T *dx;
    float dot = 0.0f;
    int k, u;
    if (row >= N) return;
    y = out + row * L, dy = dout + row * L, dx = dinp + row * L;
    len = (size_t)mn_hd_softmax_len(row, L, causal);
    for (i = lane * K; i < len; i += U * S) {
        mn__pack<T> p[U], q[U];
#pragma unroll
        for (u = 0; u < U; u++)
            if (i + u * S < len)
                p[u] = mn__ldk<T, VEC>(y + i + u * S), q[u] = mn__ldk<T, VEC>(dy + i + u * S);
#pragma unroll
        for (u = 0; u < U; u++)
            for (k = 0; k < K && i + u * S + k < len; k++)
                dot += mn__ld<T>(&p[u].v[k]) * mn__ld<T>(&q[u].v[k]);
    }
    dot = mn__warp_sum(dot);
    for (i = lane * K; i < len; i += S) {  // a pack across len keeps its masked entries
        mn__pack<T> p = mn__ldk<T, VEC>(y + i), q = mn__ldk<T, VEC>(dy + i);
        mn__pack<T> d = mn__ldk<T, VEC>(dx + i);
        for (k = 0; k < K && i + k < len; k++)
            d.v[k] = mn__cvt<T>(mn__ld<T>(&d.v[k]) + mn_hd_softmax_dinp(mn__ld<T>(&p.v[k]),
                                                                         mn__ld<T>(&q.v[k]), dot,
                                                                         scale));
        mn__stk<T, VEC>(dx + i, d);
    }
}

// Packs a lane of the register row: the smallest NP in 1, 2, 4, 8 with L <= 32 K NP; 0 when the
// row is longer (the streaming kernels take it).
static int mn__softmax_np(size_t L, size_t K) {
    int np = 1;
    if (L > 32 * K * MN__SM_NP_MAX) return 0;
    while (L > 32 * K * (size_t)np) np *= 2;
    return np;
}

template <typename T>
static mn_result mn__softmax_forward(mn_cuda *ctx, void *out, const void *inp, size_t N, size_t L,
                                     float scale, int causal) {
    unsigned grid = mn__blocks(N, MN__ROWS_PER_BLOCK), block = 32 * MN__ROWS_PER_BLOCK;
    int vec = L % (16 / sizeof(T)) == 0 && mn__is16(out) && mn__is16(inp);
    cudaStream_t s = mn__stream(ctx);
    T *y = (T *)out;
    const T *x = (const T *)inp;
    unsigned pgrid = mn__blocks(mn_hd_softmax_pairs(N, L), MN__SM_PAIR_WARPS);
#define MN__SM_FWD(NP) \
    if (causal) mn__softmax_forward_pair_kernel<T, NP><<<pgrid, 32 * MN__SM_PAIR_WARPS, 0, s>>>( \
        y, x, N, L, scale); \
    else mn__softmax_forward_reg_kernel<T, NP><<<grid, block, 0, s>>>(y, x, N, L, scale)
    switch (vec ? mn__softmax_np(L, 16 / sizeof(T)) : 0) {
    case 1: MN__SM_FWD(1); break;
    case 2: MN__SM_FWD(2); break;
    case 4: MN__SM_FWD(4); break;
    case 8: MN__SM_FWD(8); break;
    default:
        if (vec) mn__softmax_forward_kernel<T, 1><<<grid, block, 0, s>>>(y, x, N, L, scale, causal);
        else mn__softmax_forward_kernel<T, 0><<<grid, block, 0, s>>>(y, x, N, L, scale, causal);
    }
#undef MN__SM_FWD
    MN__LAUNCHED(ctx);
    return MN_OK;
}

template <typename T>
static mn_result mn__softmax_backward(mn_cuda *ctx, void *dinp, const void *dout, const void *out,
                                      size_t N, size_t L, float scale, int causal) {
    unsigned grid = mn__blocks(N, MN__ROWS_PER_BLOCK), block = 32 * MN__ROWS_PER_BLOCK;
    int vec = L % (16 / sizeof(T)) == 0 && mn__is16(dinp) && mn__is16(dout) && mn__is16(out);
    cudaStream_t s = mn__stream(ctx);
    T *dx = (T *)dinp;
    const T *dy = (const T *)dout, *y = (const T *)out;
    unsigned pgrid = mn__blocks(mn_hd_softmax_pairs(N, L), MN__SM_PAIR_WARPS);
    // causal rows in 16-bit storage from 1024 columns on: the streaming kernel, whose registers
    // let an SM hold more warps (an H200, bf16, with one pack in flight: 0.116 against the pairs'
    // 0.140 ms at 96 x 1024 x 1024, 0.139 against 0.185 at 24 x 2048 x 2048; the pairs were
    // faster at 128 and 256 columns and in fp32, by 2 to 18 %; with two, 0.856 ms at 768 x 1024 x
    // 1024 against the pairs' 1.007 in another run)
    int stream = causal && sizeof(T) == 2 && L >= 1024;
#define MN__SM_BWD(NP) \
    if (causal) mn__softmax_backward_pair_kernel<T, NP><<<pgrid, 32 * MN__SM_PAIR_WARPS, 0, s>>>( \
        dx, dy, y, N, L, scale); \
    else mn__softmax_backward_reg_kernel<T, NP><<<grid, block, 0, s>>>(dx, dy, y, N, L, scale)
    switch (vec && !stream ? mn__softmax_np(L, 16 / sizeof(T)) : 0) {
    case 1: MN__SM_BWD(1); break;
    case 2: MN__SM_BWD(2); break;
    case 4: MN__SM_BWD(4); break;
    case 8: MN__SM_BWD(8); break;
    default:
        if (vec)
            mn__softmax_backward_kernel<T, 1, MN__SM_BWD_U><<<grid, block, 0, s>>>(
                dx, dy, y, N, L, scale, causal);
        else
            mn__softmax_backward_kernel<T, 0, 1><<<grid, block, 0, s>>>(dx, dy, y, N, L, scale,
                                                                         causal);
    }
#undef MN__SM_BWD
    MN__LAUNCHED(ctx);
    return MN_OK;
}

MNDEF mn_result mn_cuda_softmax_forward(mn_cuda *ctx, void *out, const void *inp, size_t N,
                                        size_t L, float scale, int causal, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, out && inp);
    MN__CHECK(ctx, L > 0);
    if (!mn__cu_fits(N, L, 1)) return mn__bad(ctx, "N * L overflows");
    if (N == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__softmax_forward, ctx, out, inp, N, L, scale, causal);
}

MNDEF mn_result mn_cuda_softmax_backward(mn_cuda *ctx, void *dinp, const void *dout,
                                         const void *out, size_t N, size_t L, float scale,
                                         int causal, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, dinp && dout && out);
    MN__CHECK(ctx, L > 0);
    if (!mn__cu_fits(N, L, 1)) return mn__bad(ctx, "N * L overflows");
    if (N == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__softmax_backward, ctx, dinp, dout, out, N, L, scale, causal);
}

// ---- kernels: element-wise maps with 128-bit accesses -------------------------------------------
// out[i] = op(a[i], b[i], c[i]) (b, c may be NULL: read as 0). When n is a multiple of the pack
// and every pointer is 16-byte aligned, each thread moves 16 bytes per access (4 fp32 or 8
// fp16/bf16 elements in one uint4 load or store), else one element. Each thread reads all its
// inputs before it writes, so out may alias any of them.

template <typename T, int VEC, typename OP>
static __global__ void __launch_bounds__(MN__EW_THREADS)
mn__map_kernel(T *out, const T *a, const T *b, const T *c, size_t n, OP op) {
    const int K = VEC ? (int)(16 / sizeof(T)) : 1;
    size_t i, nk = n / (size_t)K;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nk;
         i += (size_t)gridDim.x * blockDim.x) {
        mn__pack<T> pa, pb, pc, po;
        int k;
        if (VEC) {
            pa = mn__ld16(a + i * K);
            if (b) pb = mn__ld16(b + i * K);
            if (c) pc = mn__ld16(c + i * K);
        } else {
            pa.v[0] = a[i];
            if (b) pb.v[0] = b[i];
            if (c) pc.v[0] = c[i];
        }
        for (k = 0; k < K; k++)
            po.v[k] = mn__cvt<T>(op(mn__ld<T>(&pa.v[k]), b ? mn__ld<T>(&pb.v[k]) : 0.0f,
                                    c ? mn__ld<T>(&pc.v[k]) : 0.0f));
        if (VEC) mn__st16(out + i * K, po);
        else out[i] = po.v[0];
    }
}

template <typename T, typename OP>
static mn_result mn__map(mn_cuda *ctx, void *out, const void *a, const void *b, const void *c,
                         size_t n, OP op) {
    const size_t K = 16 / sizeof(T);
    if (n % K == 0 && mn__is16(out) && mn__is16(a) && mn__is16(b) && mn__is16(c))
        mn__map_kernel<T, 1, OP><<<mn__ew_grid(ctx, n / K), MN__EW_THREADS, 0, mn__stream(ctx)>>>(
            (T *)out, (const T *)a, (const T *)b, (const T *)c, n, op);
    else
        mn__map_kernel<T, 0, OP><<<mn__ew_grid(ctx, n), MN__EW_THREADS, 0, mn__stream(ctx)>>>(
            (T *)out, (const T *)a, (const T *)b, (const T *)c, n, op);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

// >>ops residual: out = inp1 + inp2. >>ops gelu: out = gelu(inp); dinp += dout gelu'(inp).
struct mn__add_op {
    __device__ float operator()(float x, float y, float) const { return x + y; }
};
struct mn__gelu_op {
    __device__ float operator()(float x, float, float) const { return mn_hd_gelu(x); }
};
struct mn__gelu_fast_op {  // 16-bit storage: mn_hd_gelu_fast
    __device__ float operator()(float x, float, float) const { return mn_hd_gelu_fast(x); }
};
struct mn__gelu_grad_op {  // (dinp, dout, inp)
    __device__ float operator()(float dx, float dy, float x) const {
        return dx + dy * mn_hd_gelu_grad(x);
    }
};

template <typename T>
static mn_result mn__residual_forward(mn_cuda *ctx, void *out, const void *inp1, const void *inp2,
                                      size_t n) {
    return mn__map<T>(ctx, out, inp1, inp2, NULL, n, mn__add_op());
}

MNDEF mn_result mn_cuda_residual_forward(mn_cuda *ctx, void *out, const void *inp1,
                                         const void *inp2, size_t n, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, out && inp1 && inp2);
    if (!mn__cu_fits(n, 1, 1)) return mn__bad(ctx, "n overflows");
    if (n == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__residual_forward, ctx, out, inp1, inp2, n);
}

template <typename T>
static mn_result mn__gelu_forward(mn_cuda *ctx, void *out, const void *inp, size_t n) {
    if (sizeof(T) == 2) return mn__map<T>(ctx, out, inp, NULL, NULL, n, mn__gelu_fast_op());
    return mn__map<T>(ctx, out, inp, NULL, NULL, n, mn__gelu_op());
}

template <typename T>
static mn_result mn__gelu_backward(mn_cuda *ctx, void *dinp, const void *dout, const void *inp,
                                   size_t n) {
    return mn__map<T>(ctx, dinp, dinp, dout, inp, n, mn__gelu_grad_op());
}

MNDEF mn_result mn_cuda_gelu_forward(mn_cuda *ctx, void *out, const void *inp, size_t n,
                                     mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, out && inp);
    if (!mn__cu_fits(n, 1, 1)) return mn__bad(ctx, "n overflows");
    if (n == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__gelu_forward, ctx, out, inp, n);
}

MNDEF mn_result mn_cuda_gelu_backward(mn_cuda *ctx, void *dinp, const void *dout, const void *inp,
                                      size_t n, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, dinp && dout && inp);
    if (!mn__cu_fits(n, 1, 1)) return mn__bad(ctx, "n overflows");
    if (n == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__gelu_backward, ctx, dinp, dout, inp, n);
}

// ---- kernels: >>ops crossentropy (the LM head, fused) -------------------------------------------
// One block per row: the target logit is read first (dlogits may overwrite logits), then the
// online max/sum over the row (thread, warp, block), then dlogit = (p - onehot) dloss.
// The row is read once from DRAM: VEC moves 16-byte packs (K elements; the row's start is aligned
// only every few rows, so a scalar head up to the first 16-byte boundary and a scalar tail go to
// threads 0..ns-1), and CACHE keeps each thread's packs in shared memory between the two passes
// (V * size of T bytes: 100 KB for 50257 bf16, two blocks per H100 SM); without it the second
// pass reads them again. A thread writes only elements it has read itself, so in place is safe.
// The arithmetic is the kernel's budget, not memory: per chunk of U packs the chunk's maximum
// first, so that the running sum is rescaled once a chunk (not tested element by element), and
// the probabilities multiply by dloss / sum; 16-bit storage takes the fast exp (mn__row_exp), fp32
// keeps expf and the division of mn_hd_ce_dlogit.

#define MN__CE_UNROLL 4  // packs a thread has in flight
template <typename T, int VEC, int CACHE>
static __global__ void __launch_bounds__(MN__CE_THREADS, 2)
mn__crossentropy_kernel(float *losses, T *dlogits, const T *logits, const int *targets,
                        float dloss, size_t N, size_t V) {
    extern __shared__ uint4 mn__ce_cache[];  // [np] packs when CACHE
    const int K = VEC ? (int)(16 / sizeof(T)) : 1, U = MN__CE_UNROLL;
    __shared__ mn_hd_maxsum warp_s[MN__CE_THREADS / 32];
    __shared__ mn_hd_maxsum row_s;
    __shared__ float target_logit;
    mn__pack<T> *cache = reinterpret_cast<mn__pack<T> *>(mn__ce_cache);
    size_t row = blockIdx.x, head = 0, np, ns, js = 0, p;
    const T *x = logits + row * V, *xv;
    int tgt = targets[row], u, k;
    unsigned t = threadIdx.x, B = blockDim.x, lane = t % 32, warp = t / 32;
    float xs = 0.0f;
    mn_hd_maxsum s = mn_hd_maxsum_init();
    (void)N;
    if (VEC) {  // the base is 16-byte aligned: the row starts row * V * sizeof(T) % 16 bytes past
        size_t off = row * V * sizeof(T) % 16;
        head = off ? (16 - off) / sizeof(T) : 0;
        if (head > V) head = V;
    }
    np = (V - head) / (size_t)K, ns = V - np * (size_t)K, xv = x + head;
    if (t == 0)
        target_logit = tgt >= 0 && (size_t)tgt < V ? mn__ld<T>(x + tgt) : __int_as_float(0x7fc00000);
    if (t < ns) {  // head elements 0..head-1, then the tail after the packs
        js = t < head ? t : head + np * (size_t)K + (t - head);
        xs = mn__ld<T>(x + js);
        s = mn_hd_maxsum_add(s, xs);
    }
    for (p = t; p < np; p += (size_t)U * B) {
        mn__pack<T> q[MN__CE_UNROLL];
#pragma unroll
        for (u = 0; u < U; u++)
            if (p + (size_t)u * B < np) q[u] = mn__ldk<T, VEC>(xv + (p + (size_t)u * B) * K);
        float cm = -INFINITY;
#pragma unroll
        for (u = 0; u < U; u++)
            if (p + (size_t)u * B < np)
#pragma unroll
                for (k = 0; k < K; k++) cm = fmaxf(cm, mn__ld<T>(&q[u].v[k]));
        if (cm > s.max) s.sum *= mn__ce_exp<T>(s.max - cm), s.max = cm;
        const float ml = s.max * MN_HD_LOG2E;
#pragma unroll
        for (u = 0; u < U; u++)
            if (p + (size_t)u * B < np) {
                if (CACHE) cache[p + (size_t)u * B] = q[u];
#pragma unroll
                for (k = 0; k < K; k++)
                    s.sum += mn__row_exp<T>(mn__ld<T>(&q[u].v[k]), 1.0f, s.max, MN_HD_LOG2E, ml);
            }
    }
    s = mn__warp_maxsum(s);
    if (lane == 0) warp_s[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < B / 32 ? warp_s[lane] : mn_hd_maxsum_init();
        s = mn__warp_maxsum(s);
        if (lane == 0) {
            row_s = s;
            losses[row] = tgt < 0 ? 0.0f : mn_hd_ce_loss(s, target_logit);
        }
    }
    __syncthreads();
    if (!dlogits) return;
    s = row_s;
    // 16-bit: dlogit = exp(l - max) (dloss / sum) - [target] dloss, one FMA after the exp
    const float ml = s.max * MN_HD_LOG2E, sd = dloss / s.sum;
    if (t < ns)
        dlogits[row * V + js] =
            mn__cvt<T>(tgt < 0 ? 0.0f : mn_hd_ce_dlogit(xs, s, (size_t)tgt == js, dloss));
    for (p = t; p < np; p += (size_t)U * B) {
        T *dv = dlogits + row * V + head;
        mn__pack<T> q[MN__CE_UNROLL];
#pragma unroll
        for (u = 0; u < U; u++)
            if (p + (size_t)u * B < np)
                q[u] = CACHE ? cache[p + (size_t)u * B]
                             : mn__ldk<T, VEC>(xv + (p + (size_t)u * B) * K);
#pragma unroll
        for (u = 0; u < U; u++)
            if (p + (size_t)u * B < np) {
                // the target's place in the pack: K or more when it is elsewhere (or tgt < 0)
                size_t tk = (size_t)tgt - (head + (p + (size_t)u * B) * K);
                int kt = tk < (size_t)K ? (int)tk : K;
                mn__pack<T> o;
#pragma unroll
                for (k = 0; k < K; k++) {
                    float l = mn__ld<T>(&q[u].v[k]), d;
                    if (sizeof(T) == 4) d = mn_hd_ce_dlogit(l, s, k == kt, dloss);
                    else d = fmaf(mn_hd_exp_fma(l, MN_HD_LOG2E, ml), sd, k == kt ? -dloss : 0.0f);
                    o.v[k] = mn__cvt<T>(tgt < 0 ? 0.0f : d);
                }
                mn__stk<T, VEC>(dv + (p + (size_t)u * B) * K, o);
            }
    }
}

template <typename T>
static mn_result mn__crossentropy(mn_cuda *ctx, float *losses, void *dlogits, const void *logits,
                                  const int *targets, float dloss, size_t N, size_t V) {
    const size_t K = 16 / sizeof(T);
    size_t cache_bytes = (V / K) * 16;  // at least the packs of any row
    int optin = 0;
    T *d = (T *)dlogits;
    const T *x = (const T *)logits;
    MN__CU(ctx, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                       ctx->desc.device));
    optin -= 1024;  // room for the kernel's own shared arrays
    if (!(mn__is16(logits) && (!dlogits || mn__is16(dlogits)))) {
        mn__crossentropy_kernel<T, 0, 0><<<(unsigned)N, MN__CE_THREADS, 0, mn__stream(ctx)>>>(
            losses, d, x, targets, dloss, N, V);
    } else if (optin > 0 && cache_bytes <= (size_t)optin) {
        MN__CU(ctx, cudaFuncSetAttribute(mn__crossentropy_kernel<T, 1, 1>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
        MN__CU(ctx, cudaFuncSetAttribute(mn__crossentropy_kernel<T, 1, 1>,
                                         cudaFuncAttributePreferredSharedMemoryCarveout,
                                         (int)cudaSharedmemCarveoutMaxShared));
        mn__crossentropy_kernel<T, 1, 1><<<(unsigned)N, MN__CE_THREADS, cache_bytes,
                                           mn__stream(ctx)>>>(losses, d, x, targets, dloss, N, V);
    } else {
        mn__crossentropy_kernel<T, 1, 0><<<(unsigned)N, MN__CE_THREADS, 0, mn__stream(ctx)>>>(
            losses, d, x, targets, dloss, N, V);
    }
    MN__LAUNCHED(ctx);
    return MN_OK;
}

MNDEF mn_result mn_cuda_crossentropy_forward_backward(mn_cuda *ctx, float *losses, void *dlogits,
                                                      const void *logits, const int *targets,
                                                      float dloss, size_t N, size_t V,
                                                      mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, losses && logits && targets);
    MN__CHECK(ctx, V > 0);
    MN__CHECK(ctx, N <= 0x7fffffffu);
    if (!mn__cu_fits(N, V, 1)) return mn__bad(ctx, "N * V overflows");
    if (N == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__crossentropy, ctx, losses, dlogits, logits, targets, dloss, N, V);
}

// ---- kernels: >>ops embedding -------------------------------------------------------------------

template <typename T>
static __global__ void __launch_bounds__(MN__EW_THREADS)
mn__embedding_forward_kernel(T *out, const int *tokens, const T *wte, const T *wpe, size_t B,
                             size_t T_, size_t C, size_t V) {
    size_t i, n = B * T_ * C;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t bt = i / C, c = i % C, t = bt % T_;
        int tok = tokens[bt];
        float v = tok >= 0 && (size_t)tok < V ? mn__ld<T>(wte + (size_t)tok * C + c)
                                              : __int_as_float(0x7fc00000);
        if (wpe) v += mn__ld<T>(wpe + t * C + c);
        out[i] = mn__cvt<T>(v);
    }
}

// dwte: block (bucket, channel tile); the bucket's positions are summed in order.
template <typename T>
static __global__ void __launch_bounds__(MN__EW_THREADS)
mn__embedding_dwte_kernel(T *dwte, const T *dout, const int *order, const int *start,
                          const int *btok, size_t C) {
    int b = blockIdx.x, k;
    size_t c = (size_t)blockIdx.y * blockDim.x + threadIdx.x;
    float s = 0.0f;
    T *d;
    if (c >= C) return;
    for (k = start[b]; k < start[b + 1]; k++) s += mn__ld<T>(dout + (size_t)order[k] * C + c);
    d = dwte + (size_t)btok[b] * C + c;
    *d = mn__cvt<T>(mn__ld<T>(d) + s);
}

template <typename T>
static __global__ void __launch_bounds__(MN__EW_THREADS)
mn__embedding_dwpe_kernel(T *dwpe, const T *dout, size_t B, size_t T_, size_t C) {
    size_t i, b;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < T_ * C;
         i += (size_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (b = 0; b < B; b++) s += mn__ld<T>(dout + b * T_ * C + i);
        dwpe[i] = mn__cvt<T>(mn__ld<T>(dwpe + i) + s);
    }
}

template <typename T>
static mn_result mn__embedding_forward(mn_cuda *ctx, void *out, const int *tokens, const void *wte,
                                       const void *wpe, size_t B, size_t T_, size_t C, size_t V) {
    mn__embedding_forward_kernel<T><<<mn__ew_grid(ctx, B * T_ * C), MN__EW_THREADS, 0,
                                      mn__stream(ctx)>>>((T *)out, tokens, (const T *)wte,
                                                         (const T *)wpe, B, T_, C, V);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

// Host bucketing: tokens copied down, a stable counting sort by token into order[BT], one
// bucket per distinct token (start[nb + 1], btok[nb]), uploaded, then one kernel per gradient.
template <typename T>
static mn_result mn__embedding_backward(mn_cuda *ctx, void *dwte, void *dwpe, const void *dout,
                                        const int *tokens, size_t B, size_t T_, size_t C,
                                        size_t V) {
    cudaStream_t s = mn__stream(ctx);
    size_t BT = B * T_, i;
    mn_result r;
    if (dwte) {
        // host layout: tok[BT] | order[BT] | start[BT+1] | btok[BT] | count[V+1]
        size_t host_ints = 4 * BT + 1 + V + 1, nb = 0;
        int *tok, *order, *start, *btok, *count;
        void *h, *d;
        if (BT > 0x7fffffffu || V > 0x7fffffffu) return mn__bad(ctx, "B*T or V above 2^31");
        if ((r = mn__host_scratch(ctx, host_ints * sizeof(int), &h)) != MN_OK) return r;
        tok = (int *)h, order = tok + BT, start = order + BT, btok = start + BT + 1;
        count = btok + BT;
        MN__CU(ctx, cudaMemcpyAsync(tok, tokens, BT * sizeof(int), cudaMemcpyDeviceToHost, s));
        MN__CU(ctx, cudaStreamSynchronize(s));
        for (i = 0; i < BT; i++)
            if (tok[i] < 0 || (size_t)tok[i] >= V) {
                mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda: embedding backward: token %d at "
                           "position %zu is outside [0, %zu)", tok[i], i, V);
                return MN_ERR_INVALID_ARG;
            }
        memset(count, 0, (V + 1) * sizeof(int));
        for (i = 0; i < BT; i++) count[tok[i] + 1]++;
        for (i = 0; i < V; i++) {
            if (count[i + 1]) start[nb] = count[i], btok[nb] = (int)i, nb++;
            count[i + 1] += count[i];
        }
        start[nb] = (int)BT;
        for (i = 0; i < BT; i++) order[count[tok[i]]++] = (int)i;  // stable: positions ascending
        if ((r = mn__scratch(ctx, (3 * BT + 1) * sizeof(int), &d)) != MN_OK) return r;
        // order | start[nb+1] | btok[nb]: one upload of the contiguous host region
        memmove(start + nb + 1, btok, nb * sizeof(int));
        MN__CU(ctx, cudaMemcpyAsync(d, order, (BT + 2 * nb + 1) * sizeof(int),
                                    cudaMemcpyHostToDevice, s));
        {
            int *d_order = (int *)d, *d_start = d_order + BT, *d_btok = d_start + nb + 1;
            dim3 grid((unsigned)nb, mn__blocks(C, MN__EW_THREADS));
            mn__embedding_dwte_kernel<T><<<grid, MN__EW_THREADS, 0, s>>>(
                (T *)dwte, (const T *)dout, d_order, d_start, d_btok, C);
            MN__LAUNCHED(ctx);
        }
        MN__CU(ctx, cudaStreamSynchronize(s));  // the host scratch is reused by the next call
    }
    if (dwpe) {
        mn__embedding_dwpe_kernel<T><<<mn__ew_grid(ctx, T_ * C), MN__EW_THREADS, 0, s>>>(
            (T *)dwpe, (const T *)dout, B, T_, C);
        MN__LAUNCHED(ctx);
    }
    return MN_OK;
}

MNDEF mn_result mn_cuda_embedding_forward(mn_cuda *ctx, void *out, const int *tokens,
                                          const void *wte, const void *wpe, size_t B, size_t T,
                                          size_t C, size_t V, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, out && tokens && wte);
    MN__CHECK(ctx, C > 0 && V > 0);
    if (!mn__cu_fits(B, T, C) || !mn__cu_fits(V, C, 1))
        return mn__bad(ctx, "B * T * C or V * C overflows");
    if (B * T == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__embedding_forward, ctx, out, tokens, wte, wpe, B, T, C, V);
}

MNDEF mn_result mn_cuda_embedding_backward(mn_cuda *ctx, void *dwte, void *dwpe, const void *dout,
                                           const int *tokens, size_t B, size_t T, size_t C,
                                           size_t V, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, dout && tokens);
    MN__CHECK(ctx, C > 0 && V > 0);
    if (!mn__cu_fits(B, T, C) || !mn__cu_fits(V, C, 1))
        return mn__bad(ctx, "B * T * C or V * C overflows");
    if (B * T == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__embedding_backward, ctx, dwte, dwpe, dout, tokens, B, T, C, V);
}

// ---- kernels: >>optim global norm, AdamW, SGD, Lion, Adafactor -----------------------------------
// Norm: each of a fixed number of blocks (two 1024-thread blocks per SM, all resident at once)
// sums squares (fp32) over a grid-stride range of 16-byte packs, MN__NORM_UNROLL of them in
// flight per thread (the last, partial round one at a time); the scalar head before the first
// 16-byte boundary and the tail after the last pack go to the first threads. Each block writes
// its partial; one thread adds the partials in order in double: deterministic on a given device.

#define MN__NORM_THREADS 1024
#define MN__NORM_UNROLL 4
static_assert(MN__NORM_THREADS == 1024, "one warp adds the block's 32 warp sums");
template <typename T>
static __global__ void __launch_bounds__(MN__NORM_THREADS, 2)
mn__norm_partial_kernel(float *partial, const T *g, size_t n) {
    __shared__ float ws[MN__NORM_THREADS / 32];
    const size_t K = 16 / sizeof(T);
    const int U = MN__NORM_UNROLL;
    size_t head = (16 - ((uintptr_t)g & 15)) % 16 / sizeof(T), np, i;
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    const T *gv;
    float s = 0.0f;
    int u, k;
    if (head > n) head = n;  // g is T-aligned: head elements up to the first 16-byte boundary
    np = (n - head) / K, gv = g + head;
    if (tid < n - np * K) {  // head elements 0..head-1, then the tail after the packs
        float v = mn__ld<T>(g + (tid < head ? tid : head + np * K + (tid - head)));
        s = v * v;
    }
    for (i = tid; i + (size_t)(U - 1) * stride < np; i += (size_t)U * stride) {
        mn__pack<T> q[MN__NORM_UNROLL];
#pragma unroll
        for (u = 0; u < U; u++) q[u] = mn__ld16<T>(gv + (i + (size_t)u * stride) * K);
#pragma unroll
        for (u = 0; u < U; u++)
            for (k = 0; k < (int)K; k++) {
                float v = mn__ld<T>(&q[u].v[k]);
                s += v * v;
            }
    }
    for (; i < np; i += stride) {  // the last, partial round
        mn__pack<T> q = mn__ld16<T>(gv + i * K);
        for (k = 0; k < (int)K; k++) {
            float v = mn__ld<T>(&q.v[k]);
            s += v * v;
        }
    }
    s = mn__warp_sum(s);
    if (threadIdx.x % 32 == 0) ws[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x >= 32) return;
    s = mn__warp_sum(ws[threadIdx.x]);  // MN__NORM_THREADS / 32 == 32 warp sums
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

static __global__ void mn__norm_finish_kernel(float *norm, const float *partial, unsigned count) {
    double acc = 0.0;
    unsigned k;
#pragma unroll 8
    for (k = 0; k < count; k++) acc += (double)partial[k];
    *norm = (float)sqrt(acc);
}

template <typename T>
static mn_result mn__global_norm(mn_cuda *ctx, float *norm_out, const void *grad, uint64_t n) {
    // __launch_bounds__(MN__NORM_THREADS, 2) keeps two blocks resident per SM
    unsigned grid = (unsigned)(ctx->sm_count > 0 ? ctx->sm_count : 1) * 2u;
    unsigned need = mn__blocks(n / (16 / sizeof(T)) + 1, MN__NORM_THREADS);
    void *scr;
    mn_result r;
    if (grid > need) grid = need;
    if (grid < 1) grid = 1;
    if ((r = mn__scratch(ctx, grid * sizeof(float), &scr)) != MN_OK) return r;
    mn__norm_partial_kernel<T><<<grid, MN__NORM_THREADS, 0, mn__stream(ctx)>>>(
        (float *)scr, (const T *)grad, (size_t)n);
    MN__LAUNCHED(ctx);
    mn__norm_finish_kernel<<<1, 1, 0, mn__stream(ctx)>>>(norm_out, (const float *)scr, grid);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

MNDEF mn_result mn_cuda_global_norm(mn_cuda *ctx, float *norm_out, const void *grad, uint64_t n,
                                    mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, norm_out && (grad || n == 0));
    if (!mn__cu_fits(n, 1, 1)) return mn__bad(ctx, "n overflows");
    MN__DISPATCH(ctx, dtype, mn__global_norm, ctx, norm_out, grad, n);
}

// mn_adamw_params defaults as mn_adamw_init resolves them (0 = default, MN_OPTIM_ZERO = 0).
static float mn__z(float v, float def) { return v == 0.0f ? def : v == MN_OPTIM_ZERO ? 0.0f : v; }

// Found inf and clipping, once per thread at a step kernel's start: 1 when the global norm (given)
// is not finite, so that the step is skipped; else *clip = the clip coefficient of the unscaled
// norm (mn_hd_clip_coef), 1 without a norm.
__device__ __forceinline__ int mn__step_clip(const float *grad_norm, float inv_scale,
                                             float max_norm, float *clip) {
    float nrm;
    *clip = 1.0f;
    if (!grad_norm) return 0;
    nrm = *grad_norm;
    if (!mn_hd_isfinite(nrm)) return 1;
    *clip = mn_hd_clip_coef(nrm * inv_scale, max_norm);
    return 0;
}

// AdamW, SGD and Lion: one kernel over a per-element functor. Found inf (a non-finite norm skips
// the whole step), unscale, clip and the update in one pass; the 16-bit copy is written from the
// new master weight.
struct mn__adamw_op {
    float *m, *v;
    mn_hd_adamw_coef k;
    __device__ void operator()(float *p, size_t i, float g, float clip) const {
        float mm = m[i], vv = v[i];
        mn_hd_adamw(p, &mm, &vv, g, clip, &k);
        m[i] = mm, v[i] = vv;
    }
};
struct mn__sgd_op {
    float *b;
    mn_hd_sgd_coef k;
    __device__ void operator()(float *p, size_t i, float g, float clip) const {
        float bb = b ? b[i] : 0.0f;
        mn_hd_sgd(p, &bb, g, clip, &k);
        if (b) b[i] = bb;
    }
};
struct mn__lion_op {
    float *m;
    mn_hd_lion_coef k;
    __device__ void operator()(float *p, size_t i, float g, float clip) const {
        float mm = m[i];
        mn_hd_lion(p, &mm, g, clip, &k);
        m[i] = mm;
    }
};

template <typename G, typename P, typename OP>
static __global__ void __launch_bounds__(MN__EW_THREADS)
mn__optim_kernel(float *param, P *param16, const G *grad, size_t n, OP op, const float *grad_norm,
                 float inv_scale, float max_norm) {
    size_t i;
    float clip;
    if (mn__step_clip(grad_norm, inv_scale, max_norm, &clip)) return;  // found inf: skipped
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float p = param[i];
        op(&p, i, mn__ld<G>(grad + i) * inv_scale, clip);
        param[i] = p;
        if (param16) param16[i] = mn__cvt<P>(p);
    }
}

template <typename G, typename P, typename OP>
static mn_result mn__optim(mn_cuda *ctx, const mn_cuda_optim_flat *a, OP op) {
    mn__optim_kernel<G, P, OP><<<mn__ew_grid(ctx, a->n), MN__EW_THREADS, 0, mn__stream(ctx)>>>(
        a->param, (P *)a->param16, (const G *)a->grad, (size_t)a->n, op, a->grad_norm,
        a->inv_scale == 0.0f ? 1.0f : a->inv_scale, a->max_norm);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

template <typename G, typename OP>
static mn_result mn__optim_g(mn_cuda *ctx, const mn_cuda_optim_flat *a, OP op) {
    if (!a->param16) return mn__optim<G, float, OP>(ctx, a, op);
    if (a->param16_dtype == MN_FP16) return mn__optim<G, __half, OP>(ctx, a, op);
    if (a->param16_dtype == MN_BF16) return mn__optim<G, __nv_bfloat16, OP>(ctx, a, op);
    return mn__bad(ctx, "param16_dtype must be MN_FP16 or MN_BF16");
}

template <typename OP>
static mn_result mn__optim_step(mn_cuda *ctx, const mn_cuda_optim_flat *a, OP op) {
    MN__CHECK(ctx, a->param && a->grad);
    MN__CHECK(ctx, a->max_norm == 0.0f || a->grad_norm);
    MN__CHECK(ctx, a->max_norm >= 0.0f && a->inv_scale >= 0.0f);
    if (!mn__cu_fits(a->n, 1, 1)) return mn__bad(ctx, "n overflows");
    if (a->n == 0) return MN_OK;
    switch (a->grad_dtype) {
    case MN_DTYPE_DEFAULT: case MN_FP32: return mn__optim_g<float, OP>(ctx, a, op);
    case MN_FP16: return mn__optim_g<__half, OP>(ctx, a, op);
    case MN_BF16: return mn__optim_g<__nv_bfloat16, OP>(ctx, a, op);
    default: return mn__bad(ctx, "grad_dtype is not fp32, fp16 or bf16");
    }
}

MNDEF mn_result mn_cuda_adamw_step(mn_cuda *ctx, const mn_adamw_params *p,
                                   const mn_cuda_adamw_args *a) {
    mn_adamw_params q;
    mn__adamw_op op;
    MN__CTX(ctx);
    MN__CHECK(ctx, a && a->flat.param && a->flat.grad && a->exp_avg && a->exp_avg_sq);
    MN__CHECK(ctx, a->flat.step >= 1);
    MN__CHECK(ctx, a->flat.max_norm == 0.0f || a->flat.grad_norm);
    MN__CHECK(ctx, a->flat.max_norm >= 0.0f && a->flat.inv_scale >= 0.0f);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    if (q.amsgrad) return MN_ERR_UNSUPPORTED;
    q.lr = mn__z(q.lr, 1e-3f), q.beta1 = mn__z(q.beta1, 0.9f), q.beta2 = mn__z(q.beta2, 0.999f);
    q.eps = mn__z(q.eps, 1e-8f), q.weight_decay = mn__z(q.weight_decay, 1e-2f);
    MN__CHECK(ctx, q.lr >= 0.0f && q.eps >= 0.0f && q.weight_decay >= 0.0f);
    MN__CHECK(ctx, q.beta1 >= 0.0f && q.beta1 < 1.0f && q.beta2 >= 0.0f && q.beta2 < 1.0f);
    op.m = a->exp_avg, op.v = a->exp_avg_sq;
    op.k = mn_hd_adamw_coefs(q.lr, q.beta1, q.beta2, q.eps, q.weight_decay, q.maximize,
                             a->flat.step);
    return mn__optim_step(ctx, &a->flat, op);
}

MNDEF mn_result mn_cuda_sgd_step(mn_cuda *ctx, const mn_sgd_params *p, const mn_cuda_sgd_args *a) {
    mn_sgd_params q;
    mn__sgd_op op;
    MN__CTX(ctx);
    MN__CHECK(ctx, a);
    MN__CHECK(ctx, a->flat.step >= 1);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__z(q.lr, 1e-3f), q.momentum = mn__z(q.momentum, 0.0f);
    q.dampening = mn__z(q.dampening, 0.0f), q.weight_decay = mn__z(q.weight_decay, 0.0f);
    MN__CHECK(ctx, q.lr >= 0.0f && q.momentum >= 0.0f && q.weight_decay >= 0.0f);
    MN__CHECK(ctx, q.dampening >= 0.0f && q.dampening <= 1.0f);
    MN__CHECK(ctx, !q.nesterov || (q.momentum > 0.0f && q.dampening == 0.0f));
    MN__CHECK(ctx, q.momentum == 0.0f || a->momentum_buffer);
    memset(&op, 0, sizeof op);
    op.b = q.momentum != 0.0f ? a->momentum_buffer : NULL;
    op.k.lr = q.lr, op.k.momentum = q.momentum, op.k.dampening = q.dampening;
    op.k.weight_decay = q.weight_decay, op.k.nesterov = q.nesterov, op.k.maximize = q.maximize;
    op.k.first = a->flat.step == 1;
    return mn__optim_step(ctx, &a->flat, op);
}

MNDEF mn_result mn_cuda_lion_step(mn_cuda *ctx, const mn_lion_params *p,
                                  const mn_cuda_lion_args *a) {
    mn_lion_params q;
    mn__lion_op op;
    MN__CTX(ctx);
    MN__CHECK(ctx, a && a->exp_avg);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__z(q.lr, 1e-4f), q.beta1 = mn__z(q.beta1, 0.9f), q.beta2 = mn__z(q.beta2, 0.99f);
    q.weight_decay = mn__z(q.weight_decay, 0.0f);
    MN__CHECK(ctx, q.lr >= 0.0f && q.weight_decay >= 0.0f);
    MN__CHECK(ctx, q.beta1 >= 0.0f && q.beta1 <= 1.0f && q.beta2 >= 0.0f && q.beta2 <= 1.0f);
    op.m = a->exp_avg;
    op.k = mn_hd_lion_coefs(q.lr, q.beta1, q.beta2, q.weight_decay);
    return mn__optim_step(ctx, &a->flat, op);
}

// ---- kernels: >>optim 8-bit AdamW ---------------------------------------------------------------
// One thread block per quantization block (a grid-stride loop over the blocks): the moments of
// each element from its dequantized codes into shared memory with the block's maxima (a warp
// shuffle, then the warps in order: max is order-free, so the scales equal the host's), then the
// parameter update and the new codes. The maps live in shared memory, the block's moments too:
// dynamic shared memory of (512 + 2 block_size) floats (at most 34 KiB for 4096-element blocks).
// A small tensor (fp32 moments) runs the element-wise optimizer kernel.
#define MN__Q8_THREADS 256
struct mn__adamw8bit32_op {
    float *m, *v;
    mn_hd_adamw8bit_coef k;
    __device__ void operator()(float *p, size_t i, float g, float clip) const {
        float mm, vv;
        g *= clip;
        if (!mn_hd_adamw8bit_moments(&mm, &vv, g, m[i], v[i], &k)) return;  // left unchanged
        m[i] = mm, v[i] = vv;
        mn_hd_adamw8bit_param(p, mm, vv, &k);
    }
};

template <typename G, typename P>
static __global__ void __launch_bounds__(MN__Q8_THREADS)
mn__adamw8bit_kernel(float *param, P *param16, const G *grad, uint8_t *code1, uint8_t *code2,
                     float *absmax1, float *absmax2, const float *maps, size_t n,
                     unsigned block_size, mn_hd_adamw8bit_coef k, const float *grad_norm,
                     float inv_scale, float max_norm) {
    extern __shared__ float mn__q8_smem[];
    __shared__ float red[2][MN__Q8_THREADS / 32];
    float *map1 = mn__q8_smem, *map2 = map1 + 256, *mbuf = map2 + 256, *vbuf = mbuf + block_size;
    size_t nblocks = (n + block_size - 1) / block_size, b;
    unsigned j, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    float clip, scale;
    if (mn__step_clip(grad_norm, inv_scale, max_norm, &clip)) return;  // found inf: skipped
    scale = inv_scale * clip;
    for (j = threadIdx.x; j < 512; j += blockDim.x) map1[j] = maps[j];
    __syncthreads();
    for (b = blockIdx.x; b < nblocks; b += gridDim.x) {
        size_t i0 = b * block_size;
        unsigned len = (unsigned)(n - i0 < block_size ? n - i0 : block_size);
        float a1 = absmax1[b], a2 = absmax2[b], n1 = 0.0f, n2 = 0.0f, inv1, inv2;
        for (j = threadIdx.x; j < len; j += blockDim.x) {
            float g = mn__ld<G>(grad + i0 + j) * scale;
            mn_hd_adamw8bit_moments(&mbuf[j], &vbuf[j], g, map1[code1[i0 + j]] * a1,
                                    map2[code2[i0 + j]] * a2, &k);
            n1 = fmaxf(n1, fabsf(mbuf[j])), n2 = fmaxf(n2, vbuf[j]);
        }
        n1 = mn__warp_max(n1), n2 = mn__warp_max(n2);
        if (lane == 0) red[0][w] = n1, red[1][w] = n2;
        __syncthreads();
        for (n1 = 0.0f, n2 = 0.0f, j = 0; j < MN__Q8_THREADS / 32; j++)
            n1 = fmaxf(n1, red[0][j]), n2 = fmaxf(n2, red[1][j]);
        if (threadIdx.x == 0) absmax1[b] = n1, absmax2[b] = n2;
        inv1 = n1 > 0.0f ? 1.0f / n1 : 0.0f;
        inv2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
        for (j = threadIdx.x; j < len; j += blockDim.x) {
            size_t i = i0 + j;
            float p = param[i];
            if (mn_hd_isfinite(mn__ld<G>(grad + i) * scale)) {
                mn_hd_adamw8bit_param(&p, mbuf[j], vbuf[j], &k);
                param[i] = p;
            }
            if (param16) param16[i] = mn__cvt<P>(p);
            code1[i] = (uint8_t)mn_hd_q8_code_signed(map1, mbuf[j], inv1);
            code2[i] = (uint8_t)mn_hd_q8_nearest(map2, vbuf[j] * inv2);
        }
        __syncthreads();  // red, mbuf and vbuf are reused by the next block
    }
}

// The default block size, 256, a warp a block: each lane holds 8 consecutive elements in
// registers (16-byte loads and stores), the block's maxima by warp shuffles alone, no shared
// buffers and no barrier but the one after the maps are loaded, once per thread block: a grid of
// resident blocks walks the whole quantization blocks (a partial last block goes to the kernel
// above). The arithmetic per element is the kernel's above, in the same order, but for the
// update's square root and divide: the hardware's approximations (sqrt.approx, div.approx: within
// 2 ulp where the host rounds once; an H200 measured 2.7 % of the kernel's time in the exact ones,
// and on 2^20 elements a largest relative difference from the host's parameters of 1.8e-7
// against 1.5e-7). TAB: the new codes from the maps' threshold tables (mn_hd_q8_nearest_tab, one
// shared-memory read a code) instead of the binary search (eight dependent reads), the same
// codes; the unsigned map's codes from its table's upper half (mn_hd_q8_nearest_tab_pos, v is
// never negative): 37.5 KiB of tables a block. A warp loads its next block's inputs (as they
// come: 16-byte packs, code words) before this block's arithmetic, for 64 registers: four blocks
// of 8 warps an SM, each with two blocks' loads in flight, where the kernel without it had five
// with one (48 registers). An H200, 124M elements, cold: 0.657-0.665 against 0.685-0.696 ms
// (70.3-71.0 to 73.5-74.0 % of a copy's rate), the same bytes out; capped at 3 blocks, 0.662-0.669.
#define MN__Q8_LANE 8  // elements per lane: 32 x 8 = 256, one quantization block
template <typename T>
__device__ __forceinline__ void mn__ld8(const T *p, float *x) {
    const int K = 16 / sizeof(T);
    int u, k;
#pragma unroll
    for (u = 0; u < MN__Q8_LANE / K; u++) {
        mn__pack<T> q = mn__ld16<T>(p + u * K);
#pragma unroll
        for (k = 0; k < K; k++) x[u * K + k] = mn__ld<T>(&q.v[k]);
    }
}
// 8 codes packed back into one 8-byte store (p 8-byte aligned).
__device__ __forceinline__ void mn__st8_codes(uint8_t *p, const uint8_t *c) {
    uint2 w = make_uint2(0u, 0u);
    int e;
#pragma unroll
    for (e = 0; e < 4; e++) w.x |= (unsigned)c[e] << (8 * e), w.y |= (unsigned)c[4 + e] << (8 * e);
    *reinterpret_cast<uint2 *>(p) = w;
}
template <typename T>
__device__ __forceinline__ void mn__st8(T *p, const float *x) {
    const int K = 16 / sizeof(T);
    int u, k;
#pragma unroll
    for (u = 0; u < MN__Q8_LANE / K; u++) {
        mn__pack<T> q;
#pragma unroll
        for (k = 0; k < K; k++) q.v[k] = mn__cvt<T>(x[u * K + k]);
        mn__st16<T>(p + u * K, q);
    }
}

// mn_hd_adamw8bit_param with sqrt.approx and div.approx (v = +0 gives 0, v = inf a zero step),
// within 2 ulp while the divisor sqrt(v) + eps_c is a normal float (below 2^65 always; above
// 2^-126 unless eps times sqrt(1 - beta2^t) is under it).
__device__ __forceinline__ void mn__adamw8bit_param_fast(float *p, float m, float v,
                                                        const mn_hd_adamw8bit_coef *k) {
    float r;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    *p = *p + k->step_size * __fdividef(m, r + k->eps_c);
    if (k->decay_on) *p = *p * k->decay;
}

#define MN__Q8W_WORDS(TAB) (512u + ((TAB) ? MN_Q8_TAB + MN_Q8_TAB / 2 : 0u))  // shared words
// One quantization block's inputs as a lane loads them: 16-byte packs, 8 codes a word each.
template <typename G>
struct mn__q8_in {
    mn__pack<G> g[MN__Q8_LANE * sizeof(G) / 16];
    mn__pack<float> p[2];
    uint2 c1, c2;
    float a1, a2;
};
template <typename G>
__device__ __forceinline__ void mn__q8_load(mn__q8_in<G> *in, const float *param, const G *grad,
                                            const uint8_t *code1, const uint8_t *code2,
                                            const float *absmax1, const float *absmax2, size_t b,
                                            size_t i0) {
    const int KG = 16 / sizeof(G);
    int u;
    in->a1 = absmax1[b], in->a2 = absmax2[b];
#pragma unroll
    for (u = 0; u < MN__Q8_LANE / KG; u++) in->g[u] = mn__ld16<G>(grad + i0 + u * KG);
    in->p[0] = mn__ld16<float>(param + i0), in->p[1] = mn__ld16<float>(param + i0 + 4);
    in->c1 = *reinterpret_cast<const uint2 *>(code1 + i0);
    in->c2 = *reinterpret_cast<const uint2 *>(code2 + i0);
}
template <typename G, typename P, int TAB>
static __global__ void __launch_bounds__(MN__Q8_THREADS, 4)
mn__adamw8bit_warp_kernel(float *param, P *param16, const G *grad, uint8_t *code1,
                          uint8_t *code2, float *absmax1, float *absmax2, const float *maps,
                          size_t nblocks, mn_hd_adamw8bit_coef k, const float *grad_norm,
                          float inv_scale, float max_norm) {
    // the maps [512]; TAB: the signed map's table [MN_Q8_TAB], the upper half of the unsigned's
    extern __shared__ float mn__q8w_smem[];
    float *map1 = mn__q8w_smem, *map2 = map1 + 256;
    uint32_t *tab1 = reinterpret_cast<uint32_t *>(map1 + 512), *half2 = tab1 + MN_Q8_TAB;
    const uint32_t *src = reinterpret_cast<const uint32_t *>(maps);
    const unsigned W = MN__Q8_THREADS / 32;
    const size_t stride = (size_t)gridDim.x * W;
    size_t b = (size_t)blockIdx.x * W + threadIdx.x / 32;
    unsigned j, lane = threadIdx.x % 32;
    float clip, scale;
    mn__q8_in<G> in, next;
    if (mn__step_clip(grad_norm, inv_scale, max_norm, &clip)) return;  // found inf: skipped
    scale = inv_scale * clip;
    if (b < nblocks)
        mn__q8_load(&next, param, grad, code1, code2, absmax1, absmax2, b,
                    b * 256 + lane * MN__Q8_LANE);
    for (j = threadIdx.x; j < MN__Q8W_WORDS(TAB); j += blockDim.x)  // maps[] skips tab2's lower half
        reinterpret_cast<uint32_t *>(mn__q8w_smem)[j] =
            src[j < 512 + MN_Q8_TAB ? j : j + MN_Q8_TAB / 2];
    __syncthreads();
    for (; b < nblocks; b += stride) {
        const int KG = 16 / sizeof(G);
        size_t i0 = b * 256 + lane * MN__Q8_LANE;
        unsigned e;
        float g[MN__Q8_LANE], p[MN__Q8_LANE], m[MN__Q8_LANE], v[MN__Q8_LANE];
        float n1 = 0.0f, n2 = 0.0f, inv1, inv2, a1, a2;
        uint8_t c1[MN__Q8_LANE], c2[MN__Q8_LANE];
        in = next;  // this block's inputs, loaded during the last block's arithmetic
        if (b + stride < nblocks)
            mn__q8_load(&next, param, grad, code1, code2, absmax1, absmax2, b + stride,
                        i0 + stride * 256);
        a1 = in.a1, a2 = in.a2;
#pragma unroll
        for (e = 0; e < MN__Q8_LANE; e++) {
            g[e] = mn__ld<G>(&in.g[e / KG].v[e % KG]), p[e] = in.p[e / 4].v[e % 4];
            c1[e] = (uint8_t)((e < 4 ? in.c1.x : in.c1.y) >> (8 * (e % 4)));
            c2[e] = (uint8_t)((e < 4 ? in.c2.x : in.c2.y) >> (8 * (e % 4)));
        }
#pragma unroll
        for (e = 0; e < MN__Q8_LANE; e++) {
            g[e] *= scale;
            mn_hd_adamw8bit_moments(&m[e], &v[e], g[e], map1[c1[e]] * a1, map2[c2[e]] * a2, &k);
            n1 = fmaxf(n1, fabsf(m[e])), n2 = fmaxf(n2, v[e]);
        }
        n1 = mn__warp_max(n1), n2 = mn__warp_max(n2);
        if (lane == 0) absmax1[b] = n1, absmax2[b] = n2;
        inv1 = n1 > 0.0f ? 1.0f / n1 : 0.0f;
        inv2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
#pragma unroll
        for (e = 0; e < MN__Q8_LANE; e++) {
            if (mn_hd_isfinite(g[e])) mn__adamw8bit_param_fast(&p[e], m[e], v[e], &k);
            if (TAB) {  // mn_hd_q8_code_signed with the table's index, without a branch
                uint32_t c = mn_hd_q8_nearest_tab(tab1, m[e] * inv1);
                c1[e] = (uint8_t)(c - (uint32_t)((m[e] < 0.0f) & (map1[c] >= 0.0f)));
                c2[e] = (uint8_t)mn_hd_q8_nearest_tab_pos(half2, v[e] * inv2);
            } else {
                c1[e] = (uint8_t)mn_hd_q8_code_signed(map1, m[e], inv1);
                c2[e] = (uint8_t)mn_hd_q8_nearest(map2, v[e] * inv2);
            }
        }
        mn__st8<float>(param + i0, p);
        if (param16) mn__st8<P>(param16 + i0, p);
        mn__st8_codes(code1 + i0, c1), mn__st8_codes(code2 + i0, c2);
    }
}

template <typename G, typename P>
static mn_result mn__adamw8bit(mn_cuda *ctx, const mn_cuda_adamw8bit_args *a, unsigned block_size,
                               mn_hd_adamw8bit_coef k) {
    const mn_cuda_optim_flat *f = &a->flat;
    size_t o = 0, ob = 0, nblocks, smem = (512 + 2 * (size_t)block_size) * sizeof(float);
    if (block_size == 256 && mn__is16(f->param) && mn__is16(f->grad) &&
        (!f->param16 || mn__is16(f->param16)) && ((uintptr_t)a->code1 & 7u) == 0 &&
        ((uintptr_t)a->code2 & 7u) == 0) {
        // resident blocks only, each walking its share of the whole quantization blocks; a
        // partial last block on one thread block of the kernel below (from element o, block ob)
        size_t want, cap;
        int per_sm = 0, tab = ctx->p->q8_tab;
        size_t wsm = (size_t)MN__Q8W_WORDS(tab) * 4;
        void (*kern)(float *, P *, const G *, uint8_t *, uint8_t *, float *, float *,
                     const float *, size_t, mn_hd_adamw8bit_coef, const float *, float, float) =
            tab ? mn__adamw8bit_warp_kernel<G, P, 1> : mn__adamw8bit_warp_kernel<G, P, 0>;
        ob = (size_t)f->n / 256, o = ob * 256;
        want = (ob + MN__Q8_THREADS / 32 - 1) / (MN__Q8_THREADS / 32);
        if (ob > 0) {
            MN__CU(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)wsm));
            MN__CU(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             (int)cudaSharedmemCarveoutMaxShared));
            MN__CU(ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern,
                                                                      MN__Q8_THREADS, wsm));
            cap = (size_t)(ctx->sm_count > 0 ? ctx->sm_count : 1) *
                  (size_t)(per_sm > 0 ? per_sm : 1);
            kern<<<(unsigned)(want < cap ? want : cap), MN__Q8_THREADS, wsm, mn__stream(ctx)>>>(
                f->param, (P *)f->param16, (const G *)f->grad, a->code1, a->code2, a->absmax1,
                a->absmax2, ctx->p->q8_maps, ob, k, f->grad_norm,
                f->inv_scale == 0.0f ? 1.0f : f->inv_scale, f->max_norm);
            MN__LAUNCHED(ctx);
        }
        if (o == f->n) return MN_OK;
    }
    nblocks = ((size_t)f->n - o + block_size - 1) / block_size;
    if (smem > 48 * 1024)
        MN__CU(ctx, cudaFuncSetAttribute(mn__adamw8bit_kernel<G, P>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    mn__adamw8bit_kernel<G, P><<<(unsigned)(nblocks < 65535u * 16u ? nblocks : 65535u * 16u),
                                 MN__Q8_THREADS, smem, mn__stream(ctx)>>>(
        f->param + o, f->param16 ? (P *)f->param16 + o : NULL, (const G *)f->grad + o,
        a->code1 + o, a->code2 + o, a->absmax1 + ob, a->absmax2 + ob, ctx->p->q8_maps,
        (size_t)f->n - o, block_size, k, f->grad_norm,
        f->inv_scale == 0.0f ? 1.0f : f->inv_scale, f->max_norm);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

template <typename G>
static mn_result mn__adamw8bit_g(mn_cuda *ctx, const mn_cuda_adamw8bit_args *a,
                                 unsigned block_size, mn_hd_adamw8bit_coef k) {
    if (!a->flat.param16) return mn__adamw8bit<G, float>(ctx, a, block_size, k);
    if (a->flat.param16_dtype == MN_FP16) return mn__adamw8bit<G, __half>(ctx, a, block_size, k);
    if (a->flat.param16_dtype == MN_BF16)
        return mn__adamw8bit<G, __nv_bfloat16>(ctx, a, block_size, k);
    return mn__bad(ctx, "param16_dtype must be MN_FP16 or MN_BF16");
}

MNDEF mn_result mn_cuda_adamw8bit_step(mn_cuda *ctx, const mn_adamw8bit_params *p,
                                       const mn_cuda_adamw8bit_args *a) {
    mn_adamw8bit_params q;
    mn_hd_adamw8bit_coef k;
    MN__CTX(ctx);
    MN__CHECK(ctx, a && a->flat.param && a->flat.grad);
    MN__CHECK(ctx, a->flat.step >= 1);
    MN__CHECK(ctx, a->code1 ? a->code2 && a->absmax1 && a->absmax2
                            : a->exp_avg && a->exp_avg_sq);
    MN__CHECK(ctx, a->flat.max_norm == 0.0f || a->flat.grad_norm);
    MN__CHECK(ctx, a->flat.max_norm >= 0.0f && a->flat.inv_scale >= 0.0f);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__z(q.lr, 1e-3f), q.beta1 = mn__z(q.beta1, 0.9f), q.beta2 = mn__z(q.beta2, 0.999f);
    q.eps = mn__z(q.eps, 1e-8f), q.weight_decay = mn__z(q.weight_decay, 1e-2f);
    if (q.block_size == 0) q.block_size = 256;
    MN__CHECK(ctx, q.lr >= 0.0f && q.eps >= 0.0f && q.weight_decay >= 0.0f);
    MN__CHECK(ctx, q.beta1 >= 0.0f && q.beta1 < 1.0f && q.beta2 >= 0.0f && q.beta2 < 1.0f);
    MN__CHECK(ctx, q.block_size <= 4096);
    if (!mn__cu_fits(a->flat.n, 1, 1)) return mn__bad(ctx, "n overflows");
    k = mn_hd_adamw8bit_coefs(q.lr, q.beta1, q.beta2, q.eps, q.weight_decay, a->flat.step);
    if (!a->code1) {  // a small tensor: fp32 moments, element by element
        mn__adamw8bit32_op op;
        op.m = a->exp_avg, op.v = a->exp_avg_sq, op.k = k;
        return mn__optim_step(ctx, &a->flat, op);
    }
    if (a->flat.n == 0) return MN_OK;
    if (!ctx->p->q8_maps) {  // once per context: mn_dynamic_map's two maps and their tables
        const size_t bytes = (512 + 2 * (size_t)MN_Q8_TAB) * 4;
        float *maps = (float *)mn__host_alloc(ctx, bytes), *dev = NULL;
        uint32_t *tabs = (uint32_t *)(maps + 512);
        cudaError_t e = cudaSuccess;
        mn_result r1, r2;
        if (!maps) return MN_ERR_OUT_OF_MEMORY;
        mn_dynamic_map(1, maps), mn_dynamic_map(0, maps + 256);
        r1 = mn_q8_table(maps, tabs), r2 = mn_q8_table(maps + 256, tabs + MN_Q8_TAB);
        if (r1 != MN_ERR_OUT_OF_MEMORY && r2 != MN_ERR_OUT_OF_MEMORY &&
            (e = cudaMalloc((void **)&dev, bytes)) == cudaSuccess &&
            (e = cudaMemcpy(dev, maps, bytes, cudaMemcpyHostToDevice)) != cudaSuccess)
            (void)cudaFree(dev);
        mn__host_free(ctx, maps);
        if (r1 == MN_ERR_OUT_OF_MEMORY || r2 == MN_ERR_OUT_OF_MEMORY) return MN_ERR_OUT_OF_MEMORY;
        MN__CU(ctx, e);
        ctx->p->q8_maps = dev;
        ctx->p->q8_tab = r1 == MN_OK && r2 == MN_OK;  // (else the search: the same codes)
    }
    MN__DISPATCH(ctx, a->flat.grad_dtype, mn__adamw8bit_g, ctx, a, q.block_size, k);
}

// Adafactor: small kernels in stream order (see the header); each one returns at once when the
// gradient norm is not finite (found inf), so a skipped step writes nothing. g is the unscaled,
// clipped gradient, rounded as mn_unscale_grads_to_fp32 + mn_clip_grad_norm round it.
#define MN__AF_THREADS 256
typedef struct mn__af_grad {
    const float *norm;
    float inv_scale, max_norm;
    float clip;  // the clip coefficient, set on the device by mn__af_begin
} mn__af_grad;

// 1 when the step is skipped (found inf); else q->clip is set, once per thread.
__device__ __forceinline__ int mn__af_begin(mn__af_grad *q) {
    return mn__step_clip(q->norm, q->inv_scale, q->max_norm, &q->clip);
}
__device__ __forceinline__ float mn__af_gx(float x, const mn__af_grad *q) {
    return x * q->inv_scale * q->clip;
}
template <typename G>
__device__ __forceinline__ float mn__af_g(const G *grad, size_t i, const mn__af_grad *q) {
    return mn__af_gx(mn__ld<G>(grad + i), q);
}

__device__ __forceinline__ double mn__warp_sum_d(double v) {
    int o;
    for (o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// The block's sum (MN__AF_THREADS threads), valid in thread 0; warps added in order. A caller
// that sums again in the same kernel first waits at a barrier (ws is reused).
__device__ __forceinline__ double mn__block_sum_d(double v) {
    __shared__ double ws[MN__AF_THREADS / 32];
    unsigned k;
    v = mn__warp_sum_d(v);
    if (threadIdx.x % 32 == 0) ws[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x != 0) return 0.0;
    for (v = 0.0, k = 0; k < MN__AF_THREADS / 32; k++) v += ws[k];
    return v;
}

// sum p^2 per block (VEC: 16-byte loads of 4, param 16-byte aligned; the last n % 4 singly);
// then alpha_t into scal[0] from RMS(p).
template <int VEC>
static __global__ void __launch_bounds__(MN__AF_THREADS)
mn__af_sumsq_kernel(double *partial, const float *param, size_t n) {
    size_t i, tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x, n4 = VEC ? n / 4 : 0;
    double s = 0.0, s2 = 0.0;
#pragma unroll 4
    for (i = tid; i < n4; i += stride) {
        float4 v = reinterpret_cast<const float4 *>(param)[i];
        s += (double)v.x * v.x + (double)v.y * v.y;
        s2 += (double)v.z * v.z + (double)v.w * v.w;
    }
    for (i = n4 * 4 + tid; i < n; i += stride) s += (double)param[i] * param[i];
    s = mn__block_sum_d(s + s2);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
// The partial sums [count] in one block of MN__AF_THREADS threads, in a fixed order (valid in
// thread 0).
__device__ __forceinline__ double mn__af_total(const double *partial, size_t count) {
    double acc = 0.0;
    size_t c;
    for (c = threadIdx.x; c < count; c += MN__AF_THREADS) acc += partial[c];
    return mn__block_sum_d(acc);
}
static __global__ void __launch_bounds__(MN__AF_THREADS)
mn__af_alpha_kernel(float *scal, const double *partial, unsigned count, size_t n,
                    mn_hd_adafactor_coef k) {
    double acc = mn__af_total(partial, count);
    if (threadIdx.x == 0) scal[0] = mn_hd_adafactor_alpha(&k, (float)sqrt(acc / (double)n));
}

// R: one warp per row r of [batch*rows, cols]; rinv[r] = 1 / R_r (new) for the update's RMS.
// VEC: 16-byte packs (cols a multiple of the pack, grad 16-byte aligned).
template <typename G, int VEC>
static __global__ void __launch_bounds__(32 * MN__ROWS_PER_BLOCK)
mn__af_row_kernel(float *row, double *rinv, const G *grad, size_t R, size_t cols,
                  mn_hd_adafactor_coef k, mn__af_grad q) {
    const int K = VEC ? (int)(16 / sizeof(G)) : 1;
    size_t r = (size_t)blockIdx.x * MN__ROWS_PER_BLOCK + threadIdx.x / 32, j;
    unsigned lane = threadIdx.x % 32;
    double s = 0.0;
    int e;
    if (r >= R || mn__af_begin(&q)) return;
    for (j = (size_t)lane * K; j < cols; j += 32 * (size_t)K) {
        mn__pack<G> pk = mn__ldk<G, VEC>(grad + r * cols + j);
#pragma unroll
        for (e = 0; e < K; e++) {
            float g = mn__af_gx(mn__ld<G>(&pk.v[e]), &q);
            s += (double)(g * g + k.eps1);
        }
    }
    s = mn__warp_sum_d(s);
    if (lane == 0) {
        float x = mn_hd_adafactor_moment(row[r], s, cols, &k);
        row[r] = x, rinv[r] = 1.0 / (double)x;
    }
}

// C: column sums per chunk of rows as the column kernels above (block (32, 8): 32 V columns of a
// chunk, V = 8 with 16-byte loads when cols % 8 == 0 and grad is 16-byte aligned, else 1; grid z
// walks the batches), partial [batch, chunks, cols] in double, and beside them (partial2) the
// sums of g^2 / R_i that the update's RMS takes. The blocks of the first column group also sum
// the chunk's fresh R_i into rpart [batch, chunks]: the finish takes mean(R) from them, in chunk
// order, so that no kernel walks a whole column of R alone.
template <typename G, int V>
static __global__ void __launch_bounds__(32 * MN__COL_THREADS_Y)
mn__af_col_partial_kernel(double *partial, double *partial2, double *rpart, const G *grad,
                          const double *rinv, const float *row, size_t batch, size_t rows,
                          size_t cols, size_t rows_per_chunk, mn_hd_adafactor_coef k,
                          mn__af_grad q) {
    __shared__ double sb[MN__COL_THREADS_Y][32 * V], sb2[MN__COL_THREADS_Y][32 * V];
    __shared__ double rs[MN__COL_THREADS_Y];
    size_t j0 = ((size_t)blockIdx.x * 32 + threadIdx.x) * V, r0 = blockIdx.y * rows_per_chunk;
    size_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows, b, i;
    unsigned u, t = threadIdx.y * 32 + threadIdx.x;
    int e;
    if (mn__af_begin(&q)) return;
    for (b = blockIdx.z; b < batch; b += gridDim.z) {
        double acc[V], acc2[V];
#pragma unroll
        for (e = 0; e < V; e++) acc[e] = 0.0, acc2[e] = 0.0;
        if (j0 < cols)  // V = 8: cols % 8 == 0, so the whole pack is in the row
#pragma unroll 2
            for (i = r0 + threadIdx.y; i < r1; i += MN__COL_THREADS_Y) {
                float g[V];
                double ri = rinv[b * rows + i];
                if (V == 8) mn__ld8<G>(grad + (b * rows + i) * cols + j0, g);
                else g[0] = mn__ld<G>(grad + (b * rows + i) * cols + j0);
#pragma unroll
                for (e = 0; e < V; e++) {
                    float x = mn__af_gx(g[e], &q);
                    acc[e] += (double)(x * x + k.eps1);
                    acc2[e] += (double)x * x * ri;
                }
            }
#pragma unroll
        for (e = 0; e < V; e++)
            sb[threadIdx.y][threadIdx.x * V + e] = acc[e],
            sb2[threadIdx.y][threadIdx.x * V + e] = acc2[e];
        if (blockIdx.x == 0) {  // sum R_i over the chunk: the block's threads in order
            double s = 0.0;
            for (i = r0 + t; i < r1; i += 32 * MN__COL_THREADS_Y) s += row[b * rows + i];
            s = mn__warp_sum_d(s);
            if (threadIdx.x == 0) rs[threadIdx.y] = s;
        }
        __syncthreads();
        if (threadIdx.y == 0 && j0 < cols)
#pragma unroll
            for (e = 0; e < V; e++) {
                double s = 0.0, s2 = 0.0;
                for (u = 0; u < MN__COL_THREADS_Y; u++)
                    s += sb[u][threadIdx.x * V + e], s2 += sb2[u][threadIdx.x * V + e];
                partial[(b * gridDim.y + blockIdx.y) * cols + j0 + e] = s;
                partial2[(b * gridDim.y + blockIdx.y) * cols + j0 + e] = s2;
            }
        if (blockIdx.x == 0 && t == 0) {
            double s = 0.0;
            for (u = 0; u < MN__COL_THREADS_Y; u++) s += rs[u];
            rpart[b * gridDim.y + blockIdx.y] = s;
        }
        __syncthreads();
    }
}
// ... then per column (b, j) the chunks in order: block (32, MN__AF_FIN_Y), thread y adds the
// chunks y, y + MN__AF_FIN_Y, ... and row 0 the MN__AF_FIN_Y sums (deterministic); mean(R) from
// rpart the same way (every block alike; the first column group's writes rmean[b] for the
// update). From the new C_j and mean(R): term[b, j] = mean(R) sum_i (g^2 / R_i) / C_j, the
// column's share of sum u^2 (u^2 = g^2 mean(R) / (R_i C_j): the host's sum, mn_adafactor_step),
// and icol[b, j] = 1 / sqrt(C_j), the factor the update takes per column. Grid (cols / 32,
// batches).
#define MN__AF_FIN_Y 16
static __global__ void __launch_bounds__(32 * MN__AF_FIN_Y)
mn__af_col_finish_kernel(float *col, double *term, float *icol, float *rmean,
                         const double *partial, const double *partial2, const double *rpart,
                         size_t batch, unsigned chunks, size_t rows, size_t cols,
                         mn_hd_adafactor_coef k, mn__af_grad q) {
    __shared__ double sh[MN__AF_FIN_Y][33], sh2[MN__AF_FIN_Y][33], shr[MN__AF_FIN_Y];
    size_t j = (size_t)blockIdx.x * 32 + threadIdx.x, b;
    unsigned u;
    if (mn__af_begin(&q)) return;
    for (b = blockIdx.y; b < batch; b += gridDim.y) {
        double s = 0.0, s2 = 0.0;
        if (j < cols)
            for (u = threadIdx.y; u < chunks; u += MN__AF_FIN_Y)
                s += partial[(b * chunks + u) * cols + j],
                s2 += partial2[(b * chunks + u) * cols + j];
        sh[threadIdx.y][threadIdx.x] = s, sh2[threadIdx.y][threadIdx.x] = s2;
        if (threadIdx.x == 0) {
            for (s = 0.0, u = threadIdx.y; u < chunks; u += MN__AF_FIN_Y)
                s += rpart[b * chunks + u];
            shr[threadIdx.y] = s;
        }
        __syncthreads();
        if (threadIdx.y == 0) {
            float rm, x;
            for (s = 0.0, u = 0; u < MN__AF_FIN_Y; u++) s += shr[u];
            rm = (float)(s / (double)rows);  // mean(R), as every block of the batch finds it
            if (blockIdx.x == 0 && threadIdx.x == 0) rmean[b] = rm;
            if (j < cols) {
                size_t c = b * cols + j;
                for (s = 0.0, s2 = 0.0, u = 0; u < MN__AF_FIN_Y; u++)
                    s += sh[u][threadIdx.x], s2 += sh2[u][threadIdx.x];
                col[c] = x = mn_hd_adafactor_moment(col[c], s, rows, &k);
                term[c] = (double)rm * (s2 / (double)x);
                icol[c] = mn_hd_adafactor_col_factor(x);
            }
        }
        __syncthreads();
    }
}

// The update before clipping (V updated first when not factored).
template <typename G>
__device__ __forceinline__ float mn__af_u(float *v, const float *row, const float *col,
                                          const float *rmean, const G *grad, size_t e,
                                          size_t rows, size_t cols, int update_v,
                                          const mn_hd_adafactor_coef *k, const mn__af_grad *q) {
    float g = mn__af_g<G>(grad, e, q);
    if (!row) {
        float vv = v[e];
        if (update_v) v[e] = vv = mn_hd_adafactor_moment(vv, (double)(g * g + k->eps1), 1, k);
        return mn_hd_adafactor_u_vec(g, vv);
    } else {
        size_t bi = e / cols, b = bi / rows;
        return mn_hd_adafactor_u(g, row[bi], rmean[b], col[b * cols + e % cols]);
    }
}

// Not factored: V and the partial sums of u^2 from the fresh V.
template <typename G>
static __global__ void __launch_bounds__(MN__AF_THREADS)
mn__af_u2_kernel(double *partial, float *v, const G *grad, size_t n, mn_hd_adafactor_coef k,
                 mn__af_grad q) {
    size_t e;
    double s = 0.0;
    if (mn__af_begin(&q)) return;
    for (e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        float u = mn__af_u<G>(v, NULL, NULL, NULL, grad, e, 1, n, 1, &k, &q);
        s += (double)u * u;
    }
    s = mn__block_sum_d(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
// clip_div from the sum of u^2: the u2 kernel's partials, or the factored update's column terms.
static __global__ void __launch_bounds__(MN__AF_THREADS)
mn__af_clip_kernel(float *scal, const double *partial, size_t count, size_t n,
                   float clip_threshold) {
    double acc = mn__af_total(partial, count);
    if (threadIdx.x == 0) scal[1] = mn_hd_adafactor_clip_div(acc, n, clip_threshold);
}

// The update element by element: not factored, or factored rows of few columns.
template <typename G, typename P>
static __global__ void __launch_bounds__(MN__AF_THREADS)
mn__af_apply_kernel(float *param, P *param16, float *m, float *v, const float *row,
                    const float *col, const float *rmean, const float *scal, const G *grad,
                    size_t n, size_t rows, size_t cols, mn_hd_adafactor_coef k, mn__af_grad q) {
    size_t e;
    float alpha, clip_div;
    if (mn__af_begin(&q)) return;
    alpha = scal[0], clip_div = scal[1];
    for (e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        float u = mn__af_u<G>(v, row, col, rmean, grad, e, rows, cols, 0, &k, &q), p = param[e];
        float mm = m ? m[e] : 0.0f;
        mn_hd_adafactor_apply(&p, m ? &mm : NULL, u, clip_div, alpha, &k);
        param[e] = p;
        if (m) m[e] = mm;
        if (param16) param16[e] = mn__cvt<P>(p);
    }
}

// The factored update a row at a time (rows of at least MN__AF_ROW_MIN columns): a thread block
// walks rows, its threads the columns, the row's factor once per row and the column's from icol:
// u = rf cf g as mn_hd_adafactor_u, without a division per element to find the row.
#define MN__AF_ROW_MIN 128
template <typename G, typename P>
static __global__ void __launch_bounds__(MN__AF_THREADS)
mn__af_apply_rows_kernel(float *param, P *param16, float *m, const float *row, const float *icol,
                         const float *rmean, const float *scal, const G *grad, size_t R,
                         size_t rows, size_t cols, mn_hd_adafactor_coef k, mn__af_grad q) {
    size_t r, j;
    float alpha, clip_div;
    if (mn__af_begin(&q)) return;
    alpha = scal[0], clip_div = scal[1];
    for (r = blockIdx.x; r < R; r += gridDim.x) {
        size_t b = r / rows, e0 = r * cols;
        const float *ic = icol + b * cols;
        float rf = mn_hd_adafactor_row_factor(row[r], rmean[b]);
        for (j = threadIdx.x; j < cols; j += MN__AF_THREADS) {
            float g = mn__af_g<G>(grad, e0 + j, &q);
            float u = rf * ic[j] * g, p = param[e0 + j], mm = m ? m[e0 + j] : 0.0f;
            mn_hd_adafactor_apply(&p, m ? &mm : NULL, u, clip_div, alpha, &k);
            param[e0 + j] = p;
            if (m) m[e0 + j] = mm;
            if (param16) param16[e0 + j] = mn__cvt<P>(p);
        }
    }
}

// The same in packs of 8 (cols a multiple of 8, every tensor 16-byte aligned, fewer than 2^32
// packs): a thread a pack, its row and batch by 32-bit divisions once per 8 elements.
template <typename G, typename P>
static __global__ void __launch_bounds__(MN__AF_THREADS)
mn__af_apply_vec_kernel(float *param, P *param16, float *m, const float *row, const float *icol,
                        const float *rmean, const float *scal, const G *grad, unsigned npk,
                        unsigned ppr, unsigned rows, mn_hd_adafactor_coef k, mn__af_grad q) {
    unsigned t;
    float alpha, clip_div;
    int e;
    if (mn__af_begin(&q)) return;
    alpha = scal[0], clip_div = scal[1];
    for (t = blockIdx.x * blockDim.x + threadIdx.x; t < npk; t += gridDim.x * blockDim.x) {
        unsigned r = t / ppr, jp = t - r * ppr, b = r / rows;
        size_t e0 = (size_t)t * 8;  // r cols + 8 jp
        float g[8], p[8], mm[8], ic[8], rf = mn_hd_adafactor_row_factor(row[r], rmean[b]);
        mn__ld8<G>(grad + e0, g), mn__ld8<float>(param + e0, p);
        mn__ld8<float>(icol + ((size_t)b * ppr + jp) * 8, ic);
        if (m) mn__ld8<float>(m + e0, mm);
#pragma unroll
        for (e = 0; e < 8; e++) {
            float u = rf * ic[e] * mn__af_gx(g[e], &q);
            mn_hd_adafactor_apply(&p[e], m ? &mm[e] : NULL, u, clip_div, alpha, &k);
        }
        mn__st8<float>(param + e0, p);
        if (param16) mn__st8<P>(param16 + e0, p);
        if (m) mn__st8<float>(m + e0, mm);
    }
}

template <typename G, typename P>
static mn_result mn__adafactor(mn_cuda *ctx, const mn_cuda_adafactor_args *a,
                               mn_hd_adafactor_coef k, float clip_threshold, mn__af_grad q) {
    cudaStream_t s = mn__stream(ctx);
    size_t n = (size_t)(a->batch * a->rows * a->cols), R = (size_t)(a->batch * a->rows);
    size_t BC = (size_t)(a->batch * a->cols);
    unsigned grid = mn__ew_grid(ctx, n);
    unsigned chunks = a->exp_avg_sq_row ? mn__row_chunks((size_t)a->rows) : 0;
    unsigned bgrid = (unsigned)(a->batch < 65535 ? a->batch : 65535);
    // scratch: partial [grid], scal [2], rmean [batch]; factored: the column partials (two
    // [batch, chunks, cols]), 1 / R [R], term [batch, cols] (double), icol [batch, cols], the
    // row partials [batch, chunks] (double)
    size_t pb = mn__round256(grid * sizeof(double)), mb = mn__round256(a->batch * sizeof(float));
    size_t cb = chunks ? mn__round256((size_t)chunks * BC * sizeof(double)) : 0;
    size_t rb = chunks ? mn__round256(R * sizeof(double)) : 0;
    size_t tb = chunks ? mn__round256(BC * sizeof(double)) : 0;
    size_t ib = chunks ? mn__round256(BC * sizeof(float)) : 0;
    size_t qb = chunks ? mn__round256((size_t)chunks * a->batch * sizeof(double)) : 0;
    char *scr;
    double *partial, *cpart, *cpart2, *rinv, *term, *rpart;
    float *scal, *rmean, *icol;
    const G *g = (const G *)a->flat.grad;
    const int K = (int)(16 / sizeof(G));
    mn_result r;
    if ((r = mn__scratch(ctx, pb + 256 + mb + 2 * cb + rb + tb + ib + qb, (void **)&scr)) != MN_OK)
        return r;
    partial = (double *)scr, scal = (float *)(scr + pb), rmean = (float *)(scr + pb + 256);
    cpart = (double *)(scr + pb + 256 + mb), cpart2 = (double *)((char *)cpart + cb);
    rinv = (double *)((char *)cpart2 + cb), term = (double *)((char *)rinv + rb);
    icol = (float *)((char *)term + tb), rpart = (double *)((char *)icol + ib);
    if (mn__is16(a->flat.param))
        mn__af_sumsq_kernel<1><<<grid, MN__AF_THREADS, 0, s>>>(partial, a->flat.param, n);
    else
        mn__af_sumsq_kernel<0><<<grid, MN__AF_THREADS, 0, s>>>(partial, a->flat.param, n);
    MN__LAUNCHED(ctx);
    mn__af_alpha_kernel<<<1, MN__AF_THREADS, 0, s>>>(scal, partial, grid, n, k);
    MN__LAUNCHED(ctx);
    if (!a->exp_avg_sq_row) {  // V, then sum u^2 from the fresh V, then the update
        mn__af_u2_kernel<G><<<grid, MN__AF_THREADS, 0, s>>>(partial, a->exp_avg_sq, g, n, k, q);
        MN__LAUNCHED(ctx);
        mn__af_clip_kernel<<<1, MN__AF_THREADS, 0, s>>>(scal, partial, grid, n, clip_threshold);
        MN__LAUNCHED(ctx);
        mn__af_apply_kernel<G, P><<<grid, MN__AF_THREADS, 0, s>>>(
            a->flat.param, (P *)a->flat.param16, a->exp_avg, a->exp_avg_sq, NULL, NULL, NULL,
            scal, g, n, 1, n, k, q);
        MN__LAUNCHED(ctx);
        return MN_OK;
    }
    if (a->cols % K == 0 && mn__is16(g))
        mn__af_row_kernel<G, 1><<<mn__blocks(R, MN__ROWS_PER_BLOCK), 32 * MN__ROWS_PER_BLOCK, 0,
                                  s>>>(a->exp_avg_sq_row, rinv, g, R, a->cols, k, q);
    else
        mn__af_row_kernel<G, 0><<<mn__blocks(R, MN__ROWS_PER_BLOCK), 32 * MN__ROWS_PER_BLOCK, 0,
                                  s>>>(a->exp_avg_sq_row, rinv, g, R, a->cols, k, q);
    MN__LAUNCHED(ctx);
    {
        size_t rpc = ((size_t)a->rows + chunks - 1) / chunks;
        dim3 blk(32, MN__COL_THREADS_Y);
        if (a->cols % 8 == 0 && mn__is16(g))
            mn__af_col_partial_kernel<G, 8><<<dim3(mn__blocks(a->cols, 256), chunks, bgrid), blk, 0,
                                              s>>>(cpart, cpart2, rpart, g, rinv,
                                                   a->exp_avg_sq_row, a->batch, a->rows, a->cols,
                                                   rpc, k, q);
        else
            mn__af_col_partial_kernel<G, 1><<<dim3(mn__blocks(a->cols, 32), chunks, bgrid), blk, 0,
                                              s>>>(cpart, cpart2, rpart, g, rinv,
                                                   a->exp_avg_sq_row, a->batch, a->rows, a->cols,
                                                   rpc, k, q);
        MN__LAUNCHED(ctx);
    }
    mn__af_col_finish_kernel<<<dim3(mn__blocks(a->cols, 32), bgrid), dim3(32, MN__AF_FIN_Y), 0,
                               s>>>(a->exp_avg_sq_col, term, icol, rmean, cpart, cpart2, rpart,
                                    a->batch, chunks, a->rows, a->cols, k, q);
    MN__LAUNCHED(ctx);
    mn__af_clip_kernel<<<1, MN__AF_THREADS, 0, s>>>(scal, term, BC, n, clip_threshold);
    MN__LAUNCHED(ctx);
    if (a->cols % 8 == 0 && n / 8 <= 0xffffffffu && mn__is16(a->flat.param) && mn__is16(g) &&
        (!a->flat.param16 || mn__is16(a->flat.param16)) && (!a->exp_avg || mn__is16(a->exp_avg))) {
        unsigned npk = (unsigned)(n / 8);
        mn__af_apply_vec_kernel<G, P><<<mn__ew_grid(ctx, npk), MN__AF_THREADS, 0, s>>>(
            a->flat.param, (P *)a->flat.param16, a->exp_avg, a->exp_avg_sq_row, icol, rmean, scal,
            g, npk, (unsigned)(a->cols / 8), (unsigned)a->rows, k, q);
    } else if (a->cols >= MN__AF_ROW_MIN) {
        size_t cap = (size_t)(ctx->sm_count > 0 ? ctx->sm_count : 1) * 16u;
        mn__af_apply_rows_kernel<G, P><<<(unsigned)(R < cap ? R : cap), MN__AF_THREADS, 0, s>>>(
            a->flat.param, (P *)a->flat.param16, a->exp_avg, a->exp_avg_sq_row, icol, rmean, scal,
            g, R, a->rows, a->cols, k, q);
    } else {  // short rows: element by element
        mn__af_apply_kernel<G, P><<<grid, MN__AF_THREADS, 0, s>>>(
            a->flat.param, (P *)a->flat.param16, a->exp_avg, NULL, a->exp_avg_sq_row,
            a->exp_avg_sq_col, rmean, scal, g, n, a->rows, a->cols, k, q);
    }
    MN__LAUNCHED(ctx);
    return MN_OK;
}

template <typename G>
static mn_result mn__adafactor_g(mn_cuda *ctx, const mn_cuda_adafactor_args *a,
                                 mn_hd_adafactor_coef k, float clip_threshold, mn__af_grad q) {
    if (!a->flat.param16) return mn__adafactor<G, float>(ctx, a, k, clip_threshold, q);
    if (a->flat.param16_dtype == MN_FP16)
        return mn__adafactor<G, __half>(ctx, a, k, clip_threshold, q);
    if (a->flat.param16_dtype == MN_BF16)
        return mn__adafactor<G, __nv_bfloat16>(ctx, a, k, clip_threshold, q);
    return mn__bad(ctx, "param16_dtype must be MN_FP16 or MN_BF16");
}

MNDEF mn_result mn_cuda_adafactor_step(mn_cuda *ctx, const mn_adafactor_params *p,
                                       const mn_cuda_adafactor_args *a) {
    mn_adafactor_params q;
    mn_hd_adafactor_coef k;
    mn__af_grad gq;
    uint64_t n;
    MN__CTX(ctx);
    MN__CHECK(ctx, a && a->flat.param && a->flat.grad);
    MN__CHECK(ctx, a->flat.step >= 1);
    MN__CHECK(ctx, a->exp_avg_sq_row ? a->exp_avg_sq_col != NULL : a->exp_avg_sq != NULL);
    MN__CHECK(ctx, a->flat.max_norm == 0.0f || a->flat.grad_norm);
    MN__CHECK(ctx, a->flat.max_norm >= 0.0f && a->flat.inv_scale >= 0.0f);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    if (q.eps1 == 0.0f) q.eps1 = 1e-30f;
    if (q.eps2 == 0.0f) q.eps2 = 1e-3f;
    if (q.clip_threshold == 0.0f) q.clip_threshold = 1.0f;
    if (q.decay_rate == 0.0f) q.decay_rate = -0.8f;
    q.beta1 = mn__z(q.beta1, 0.0f), q.weight_decay = mn__z(q.weight_decay, 0.0f);
    MN__CHECK(ctx, q.lr >= 0.0f && q.eps1 >= 0.0f && q.eps2 >= 0.0f && q.clip_threshold > 0.0f);
    MN__CHECK(ctx, q.decay_rate < 0.0f && q.weight_decay >= 0.0f);
    MN__CHECK(ctx, q.beta1 >= 0.0f && q.beta1 < 1.0f);
    MN__CHECK(ctx, q.beta1 == 0.0f || a->exp_avg);
    if ((a->rows && a->batch > UINT64_MAX / a->rows) ||
        (a->cols && a->batch * a->rows > UINT64_MAX / a->cols))
        return mn__bad(ctx, "batch * rows * cols overflows");
    if (!mn__cu_fits(a->batch, a->rows, a->cols))
        return mn__bad(ctx, "batch * rows * cols overflows");
    n = a->batch * a->rows * a->cols;
    MN__CHECK(ctx, a->flat.n == n);
    if (n == 0) return MN_OK;
    k = mn_hd_adafactor_coefs(q.lr, q.eps1, q.eps2, q.decay_rate, q.beta1, q.weight_decay,
                              q.no_scale_parameter, q.warmup_init, a->flat.step);
    gq.norm = a->flat.grad_norm;
    gq.inv_scale = a->flat.inv_scale == 0.0f ? 1.0f : a->flat.inv_scale;
    gq.max_norm = a->flat.max_norm, gq.clip = 1.0f;
    if (q.beta1 == 0.0f) {  // no first moment: exp_avg unused
        mn_cuda_adafactor_args b = *a;
        b.exp_avg = NULL;
        MN__DISPATCH(ctx, a->flat.grad_dtype, mn__adafactor_g, ctx, &b, k, q.clip_threshold, gq);
    }
    MN__DISPATCH(ctx, a->flat.grad_dtype, mn__adafactor_g, ctx, a, k, q.clip_threshold, gq);
}

// ---- gemm: >>ops matmul through cuBLASLt --------------------------------------------------------
// Row-major out[N,OC] = inp[N,C] @ weight[OC,C]^T is column-major out^T (OC x N) = weight^T-op
// (A = weight, transa = T, lda = C) times inp^T (B = inp, ldb = C): m = OC, n = N, k = C, so the
// bias (one per OC) runs along the rows of D, as cuBLASLt's BIAS epilogue adds it.
//   dinp^T (C x N) += weight (A, no transpose, lda = C) @ dpre^T (B, ldb = OC):  m = C, n = N, k = OC
//   dweight^T (C x OC) += inp^T (A, lda = C) @ dpre (B transposed, ldb = OC):   m = C, n = OC, k = N
// and BGRADB on the second sums B = dpre over k = N: dbias, one per column of D.

typedef struct mn__gemm_args {
    int ta, tb;                 // 1 = transposed
    int64_t m, n, k, lda, ldb, ldd;
    const void *A, *B;
    void *D;                    // also C (beta)
    float beta;                 // 0 = overwrite, 1 = accumulate
    cublasLtEpilogue_t epi;
    void *bias;                 // BIAS: [m] input; BGRADB: [n] output
    void *aux;                  // GELU_AUX: [ldd, n] pre-activation output
    int64_t batch;              // > 1: strided batches, A + i sa, B + i sb, D + i sd (elements)
    int64_t sa, sb, sd;
} mn__gemm_args;

static cudaDataType_t mn__cuda_type(mn_dtype dt) {
    return dt == MN_FP16 ? CUDA_R_16F : dt == MN_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

static uint32_t mn__align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    if (!p) return 256;
    while (al > 1 && a % al) al >>= 1;
    return al;
}

// mn_cuda_desc.gemm_tune: each of cuBLASLt's n candidates for one shape runs once (a candidate
// that fails to launch is passed over), then MN__TUNE_RUNS times between two events, on the
// call's stream and buffers. Only for beta 0: the runs write the call's outputs (D, and the
// epilogue's aux or dbias) and read none of them, and the real call that follows writes them
// again. *best: the index of the fastest, 0 when none ran or the stream is being captured into a
// graph (no synchronisation is allowed there).
#define MN__TUNE_RUNS 5
static mn_result mn__gemm_tune(mn_cuda *ctx, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                               cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld,
                               const mn__gemm_args *g,
                               const cublasLtMatmulHeuristicResult_t *cand, int n, int *best) {
    struct mn__cuda_priv *p = ctx->p;
    cublasLtHandle_t lt = (cublasLtHandle_t)ctx->lt;
    cudaStream_t s = mn__stream(ctx);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    const float alpha = 1.0f, beta = 0.0f;
    float t = 0.0f, tbest = 0.0f;
    int c, i, ok, timed = 0;
    *best = 0;
    MN__CU(ctx, cudaStreamIsCapturing(s, &cs));
    if (cs != cudaStreamCaptureStatusNone) return MN_OK;
    for (i = 0; i < 2; i++)
        if (!p->tune_ev[i]) MN__CU(ctx, cudaEventCreate(&p->tune_ev[i]));
    for (c = 0; c < n; c++) {
        for (i = -1, ok = 1; i < MN__TUNE_RUNS && ok; i++) {  // run -1: the warm-up
            if (i == 0) MN__CU(ctx, cudaEventRecord(p->tune_ev[0], s));
            ok = cublasLtMatmul(lt, op, &alpha, g->A, la, g->B, lb, &beta, g->D, ld, g->D, ld,
                                &cand[c].algo, ctx->workspace, ctx->workspace_bytes, s) ==
                 CUBLAS_STATUS_SUCCESS;
        }
        if (!ok) continue;
        MN__CU(ctx, cudaEventRecord(p->tune_ev[1], s));
        MN__CU(ctx, cudaEventSynchronize(p->tune_ev[1]));
        MN__CU(ctx, cudaEventElapsedTime(&t, p->tune_ev[0], p->tune_ev[1]));
        if (timed++ == 0 || t < tbest) *best = c, tbest = t;
    }
    if (timed) ctx->gemm_tuned++;
    return MN_OK;
}

// Runs one GEMM. MN_ERR_UNSUPPORTED (nothing logged, nothing launched) when cuBLASLt has no
// algorithm for this epilogue and shape: the caller falls back to the plain GEMM and a kernel.
static mn_result mn__gemm(mn_cuda *ctx, const mn__gemm_args *g, mn_dtype dt) {
    struct mn__cuda_priv *p = ctx->p;
    cublasLtHandle_t lt = (cublasLtHandle_t)ctx->lt;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res[MN_CUDA_TUNE_CANDIDATES];
    cudaDataType_t ty = mn__cuda_type(dt);
    cublasComputeType_t ct = (dt == MN_FP32 || dt == MN_DTYPE_DEFAULT) && ctx->desc.tf32
                                 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasOperation_t ta = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    mn__gemm_key key;
    mn__gemm_entry *e = NULL;
    float alpha = 1.0f, beta = g->beta;
    uint64_t ws = ctx->workspace_bytes;
    uint32_t i, al[5];
    int nres = 0, best = 0, tune = ctx->desc.gemm_tune && beta == 0.0f;
    mn_result r = MN_OK;
    memset(&key, 0, sizeof key);
    key.ta = g->ta, key.tb = g->tb, key.dtype = (int32_t)ty, key.epilogue = (int32_t)g->epi;
    key.tf32 = ct == CUBLAS_COMPUTE_32F_FAST_TF32, key.beta1 = beta != 0.0f;
    key.m = g->m, key.n = g->n, key.k = g->k, key.lda = g->lda, key.ldb = g->ldb, key.ldd = g->ldd;
    if (g->batch > 1) key.batch = g->batch, key.sa = g->sa, key.sb = g->sb, key.sd = g->sd;
    al[0] = mn__align(g->A), al[1] = mn__align(g->B), al[2] = mn__align(g->D);
    al[3] = mn__align(g->bias), al[4] = mn__align(g->aux);
    memcpy(key.align, al, sizeof al);
    for (i = 0; i < MN__GEMM_CACHE; i++)
        if (p->gemm[i].used && !memcmp(&p->gemm[i].key, &key, sizeof key)) {
            e = &p->gemm[i];
            break;
        }
    if (e && !e->ok) return MN_ERR_UNSUPPORTED;

#define MN__LTG(call) do { cublasStatus_t mn_s_ = (call); \
    if (mn_s_ != CUBLAS_STATUS_SUCCESS) { r = mn__lt_fail(ctx, #call, mn_s_, __LINE__); goto undo; } } while (0)
    MN__LTG(cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F));
    MN__LTG(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    MN__LTG(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    MN__LTG(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g->epi,
                                           sizeof g->epi));
    if (g->bias)
        MN__LTG(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias,
                                               sizeof g->bias));
    if (g->aux) {
        int64_t aux_ld = g->ldd;
        MN__LTG(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                               &g->aux, sizeof g->aux));
        MN__LTG(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                               sizeof aux_ld));
    }
    // stored shapes: A is (ta ? k x m : m x k) column-major, B is (tb ? n x k : k x n)
    MN__LTG(cublasLtMatrixLayoutCreate(&la, ty, g->ta ? g->k : g->m, g->ta ? g->m : g->k, g->lda));
    MN__LTG(cublasLtMatrixLayoutCreate(&lb, ty, g->tb ? g->n : g->k, g->tb ? g->k : g->n, g->ldb));
    MN__LTG(cublasLtMatrixLayoutCreate(&ld, ty, g->m, g->n, g->ldd));
    if (g->batch > 1) {
        int32_t nb = (int32_t)g->batch;
        cublasLtMatrixLayout_t lay[3] = {la, lb, ld};
        int64_t st[3] = {g->sa, g->sb, g->sd};
        for (i = 0; i < 3; i++) {
            MN__LTG(cublasLtMatrixLayoutSetAttribute(lay[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                     &nb, sizeof nb));
            MN__LTG(cublasLtMatrixLayoutSetAttribute(
                lay[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st[i], sizeof st[i]));
        }
    }
    if (!e) {  // ask the heuristic once per shape and remember the answer
        MN__LTG(cublasLtMatmulPreferenceCreate(&pref));
        MN__LTG(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &ws, sizeof ws));
        MN__LTG(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                     &al[0], sizeof al[0]));
        MN__LTG(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                     &al[1], sizeof al[1]));
        MN__LTG(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                     &al[2], sizeof al[2]));
        MN__LTG(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                     &al[2], sizeof al[2]));
        memset(res, 0, sizeof res);
        {
            cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
                lt, op, la, lb, ld, ld, pref, tune ? MN_CUDA_TUNE_CANDIDATES : 1, res, &nres);
            if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) {
                r = mn__lt_fail(ctx, "cublasLtMatmulAlgoGetHeuristic", st, __LINE__);
                goto undo;
            }
            if (st != CUBLAS_STATUS_SUCCESS) nres = 0;
        }
        if (nres > 1 && (r = mn__gemm_tune(ctx, op, la, lb, ld, g, res, nres, &best)) != MN_OK)
            goto undo;
        e = &p->gemm[p->gemm_next];
        p->gemm_next = (p->gemm_next + 1) % MN__GEMM_CACHE;
        e->key = key, e->used = 1, e->ok = nres > 0;
        if (nres > 0) e->algo = res[best].algo;
        if (!e->ok) {
            r = MN_ERR_UNSUPPORTED;
            goto undo;
        }
    }
    {
        cublasStatus_t st = cublasLtMatmul(lt, op, &alpha, g->A, la, g->B, lb, &beta, g->D, ld,
                                           g->D, ld, &e->algo, ctx->workspace, ctx->workspace_bytes,
                                           mn__stream(ctx));
        if (st == CUBLAS_STATUS_NOT_SUPPORTED && g->epi != CUBLASLT_EPILOGUE_DEFAULT) {
            e->ok = 0;  // refused at launch: remember, fall back
            r = MN_ERR_UNSUPPORTED;
        } else if (st != CUBLAS_STATUS_SUCCESS) {
            r = mn__lt_fail(ctx, "cublasLtMatmul", st, __LINE__);
        }
    }
undo:
#undef MN__LTG
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    return r;
}

// The unfused forward epilogue: x = D (+ bias[oc]); GELU: pre_gelu = x, out = gelu(x).
template <typename T>
static __global__ void __launch_bounds__(MN__EW_THREADS)
mn__bias_gelu_kernel(T *out, T *pre_gelu, const T *bias, size_t N, size_t OC) {
    size_t i, n = N * OC;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        T *src = pre_gelu ? pre_gelu : out;
        float x = mn__ld<T>(src + i);
        if (bias) {
            x += mn__ld<T>(bias + i % OC);
            src[i] = mn__cvt<T>(x);
            x = mn__ld<T>(src + i);  // GELU of the stored pre-activation, as the fused path
        }
        if (pre_gelu) out[i] = mn__cvt<T>(mn_hd_gelu(x));
    }
}

// dpre = dout * gelu'(pre_gelu) in place (when pre_gelu) and, when partial, the column sums of
// dpre per chunk of rows (for dbias), in one pass over dout.
template <typename T>
static __global__ void __launch_bounds__(32 * MN__COL_THREADS_Y)
mn__dgelu_bias_partial_kernel(float *partial, T *dout, const T *pre_gelu, size_t N, size_t OC,
                              size_t rows_per_chunk) {
    __shared__ float sb[MN__COL_THREADS_Y][32];
    size_t c = (size_t)blockIdx.x * 32 + threadIdx.x, r0 = blockIdx.y * rows_per_chunk, r;
    size_t r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
    float acc = 0.0f;
    unsigned k;
    if (c < OC)
        for (r = r0 + threadIdx.y; r < r1; r += MN__COL_THREADS_Y) {
            T *d = dout + r * OC + c;
            float v = mn__ld<T>(d);
            if (pre_gelu) {
                T t = mn__cvt<T>(v * mn_hd_gelu_grad(mn__ld<T>(pre_gelu + r * OC + c)));
                *d = t;
                v = mn__ld<T>(&t);
            }
            acc += v;
        }
    if (!partial) return;
    sb[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y != 0 || c >= OC) return;
    acc = 0.0f;
    for (k = 0; k < MN__COL_THREADS_Y; k++) acc += sb[k][threadIdx.x];
    partial[(size_t)blockIdx.y * OC + c] = acc;
}

// The same with 16-byte packs (OC a multiple of the pack K, dout and pre_gelu 16-byte aligned):
// thread (x, y) owns the K columns of pack blockIdx.x * 32 + x and rows r0 + y, r0 + y + 8, ..
// of the chunk, so a warp moves 512 contiguous bytes of a row per access; the 8 row-threads of
// each column are then added in y order through shared memory (deterministic).
template <typename T>
static __global__ void __launch_bounds__(32 * MN__COL_THREADS_Y)
mn__dgelu_bias_partial_vec_kernel(float *partial, T *dout, const T *pre_gelu, size_t N, size_t OC,
                                  size_t rows_per_chunk) {
    const int K = (int)(16 / sizeof(T));
    __shared__ float sb[MN__COL_THREADS_Y][32 * (16 / sizeof(T))];
    size_t c = ((size_t)blockIdx.x * 32 + threadIdx.x) * K, r0 = blockIdx.y * rows_per_chunk, r;
    size_t r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
    float acc[16 / sizeof(T)];
    unsigned t, y;
    int k;
#pragma unroll
    for (k = 0; k < K; k++) acc[k] = 0.0f;
    if (c < OC)  // OC % K == 0: a pack is wholly inside the row or wholly past it
        for (r = r0 + threadIdx.y; r < r1; r += MN__COL_THREADS_Y) {
            T *d = dout + r * OC + c;
            mn__pack<T> v = mn__ld16(d);
            if (pre_gelu) {
                mn__pack<T> x = mn__ld16(pre_gelu + r * OC + c);
#pragma unroll
                for (k = 0; k < K; k++)
                    v.v[k] = mn__cvt<T>(mn__ld<T>(&v.v[k]) * mn_hd_gelu_grad(mn__ld<T>(&x.v[k])));
                mn__st16(d, v);
            }
#pragma unroll
            for (k = 0; k < K; k++) acc[k] += mn__ld<T>(&v.v[k]);
        }
    if (!partial) return;
#pragma unroll
    for (k = 0; k < K; k++) sb[threadIdx.y][threadIdx.x * K + k] = acc[k];
    __syncthreads();
    // column t of the block's 32 K: the sum of its 8 row-threads, in y order
    for (t = threadIdx.y * 32 + threadIdx.x; t < 32u * K; t += 32 * MN__COL_THREADS_Y) {
        size_t col = (size_t)blockIdx.x * 32 * K + t;
        float s = 0.0f;
        if (col >= OC) continue;
        for (y = 0; y < MN__COL_THREADS_Y; y++) s += sb[y][t];
        partial[(size_t)blockIdx.y * OC + col] = s;
    }
}

template <typename T>
static __global__ void __launch_bounds__(256) mn__add_kernel(T *dst, const T *src, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = mn__cvt<T>(mn__ld<T>(dst + i) + mn__ld<T>(src + i));
}

template <typename T>
static mn_result mn__matmul_forward_fallback(mn_cuda *ctx, void *out, void *pre_gelu,
                                             const void *bias, size_t N, size_t OC) {
    if (!bias && !pre_gelu) return MN_OK;
    mn__bias_gelu_kernel<T><<<mn__ew_grid(ctx, N * OC), MN__EW_THREADS, 0, mn__stream(ctx)>>>(
        (T *)out, (T *)pre_gelu, (const T *)bias, N, OC);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

MNDEF mn_result mn_cuda_matmul_forward(mn_cuda *ctx, void *out, void *pre_gelu, const void *inp,
                                       const void *weight, const void *bias, size_t N, size_t C,
                                       size_t OC, mn_dtype dtype) {
    mn__gemm_args g;
    mn_result r;
    MN__CTX(ctx);
    MN__CHECK(ctx, out && inp && weight);
    MN__CHECK(ctx, C > 0 && OC > 0);
    MN__CHECK(ctx, dtype == MN_DTYPE_DEFAULT || dtype == MN_FP32 || dtype == MN_FP16 ||
                   dtype == MN_BF16);
    if (!mn__cu_fits(N, C, 1) || !mn__cu_fits(N, OC, 1) || !mn__cu_fits(OC, C, 1))
        return mn__bad(ctx, "N * C, N * OC or OC * C overflows");
    if (N == 0) return MN_OK;
    memset(&g, 0, sizeof g);
    g.ta = 1, g.tb = 0, g.m = (int64_t)OC, g.n = (int64_t)N, g.k = (int64_t)C;
    g.lda = (int64_t)C, g.ldb = (int64_t)C, g.ldd = (int64_t)OC;
    g.A = weight, g.B = inp, g.D = out, g.beta = 0.0f;
    // fused: BIAS, GELU_AUX(_BIAS); the aux leading dimension must be a multiple of 8
    if (!ctx->desc.no_fused_epilogues && (bias || pre_gelu) && (!pre_gelu || OC % 8 == 0)) {
        g.epi = pre_gelu ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                         : CUBLASLT_EPILOGUE_BIAS;
        g.bias = (void *)bias, g.aux = pre_gelu;
        r = mn__gemm(ctx, &g, dtype);
        if (r == MN_OK) {
            ctx->gemm_fused++;
            return MN_OK;
        }
        if (r != MN_ERR_UNSUPPORTED) return r;
    }
    g.epi = CUBLASLT_EPILOGUE_DEFAULT, g.bias = NULL, g.aux = NULL;
    g.D = pre_gelu ? pre_gelu : out;
    if ((r = mn__gemm(ctx, &g, dtype)) != MN_OK) return r;
    if (bias || pre_gelu) ctx->gemm_unfused++;
    MN__DISPATCH(ctx, dtype, mn__matmul_forward_fallback, ctx, out, pre_gelu, bias, N, OC);
}

// dpre in place and/or dbias by the column kernel (the path when BGRADB is not used).
template <typename T>
static mn_result mn__dgelu_bias(mn_cuda *ctx, void *dbias, void *dout, const void *pre_gelu,
                                size_t N, size_t OC) {
    const size_t K = 16 / sizeof(T);
    unsigned chunks = mn__row_chunks(N);
    size_t rows = (N + chunks - 1) / chunks;
    float *part = NULL;
    int vec = OC % K == 0 && mn__is16(dout) && mn__is16(pre_gelu);
    dim3 grid(mn__blocks(vec ? OC / K : OC, 32), chunks), block(32, MN__COL_THREADS_Y);
    if (dbias) {
        void *scr;
        mn_result r = mn__scratch(ctx, (size_t)chunks * OC * sizeof(float), &scr);
        if (r != MN_OK) return r;
        part = (float *)scr;
    }
    if (vec)
        mn__dgelu_bias_partial_vec_kernel<T><<<grid, block, 0, mn__stream(ctx)>>>(
            part, (T *)dout, (const T *)pre_gelu, N, OC, rows);
    else
        mn__dgelu_bias_partial_kernel<T><<<grid, block, 0, mn__stream(ctx)>>>(
            part, (T *)dout, (const T *)pre_gelu, N, OC, rows);
    MN__LAUNCHED(ctx);
    if (dbias) {
        mn__col_finish_kernel<T><<<mn__blocks(OC, 256), 256, 0, mn__stream(ctx)>>>(
            (T *)dbias, part, chunks, OC);
        MN__LAUNCHED(ctx);
    }
    return MN_OK;
}

template <typename T>
static mn_result mn__add(mn_cuda *ctx, void *dst, const void *src, size_t n) {
    mn__add_kernel<T><<<mn__blocks(n, 256), 256, 0, mn__stream(ctx)>>>((T *)dst, (const T *)src, n);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

MNDEF mn_result mn_cuda_matmul_backward(mn_cuda *ctx, void *dinp, void *dweight, void *dbias,
                                        void *dout, const void *inp, const void *weight,
                                        const void *pre_gelu, size_t N, size_t C, size_t OC,
                                        mn_dtype dtype) {
    mn__gemm_args g;
    mn_result r;
    int dbias_done = dbias == NULL;
    size_t es = dtype == MN_FP16 || dtype == MN_BF16 ? 2 : 4;
    MN__CTX(ctx);
    MN__CHECK(ctx, dout);
    MN__CHECK(ctx, !dinp || weight);
    MN__CHECK(ctx, !dweight || inp);
    MN__CHECK(ctx, C > 0 && OC > 0);
    MN__CHECK(ctx, dtype == MN_DTYPE_DEFAULT || dtype == MN_FP32 || dtype == MN_FP16 ||
                   dtype == MN_BF16);
    if (!mn__cu_fits(N, C, 1) || !mn__cu_fits(N, OC, 1) || !mn__cu_fits(OC, C, 1))
        return mn__bad(ctx, "N * C, N * OC or OC * C overflows");
    if (N == 0) return MN_OK;
    if (pre_gelu) {  // dpre over dout, with dbias from the same pass
        switch (dtype) {
        case MN_FP16: r = mn__dgelu_bias<__half>(ctx, dbias, dout, pre_gelu, N, OC); break;
        case MN_BF16: r = mn__dgelu_bias<__nv_bfloat16>(ctx, dbias, dout, pre_gelu, N, OC); break;
        default: r = mn__dgelu_bias<float>(ctx, dbias, dout, pre_gelu, N, OC); break;
        }
        if (r != MN_OK) return r;
        dbias_done = 1;
    }
    memset(&g, 0, sizeof g);
    g.beta = 1.0f;
    if (dinp) {
        g.ta = 0, g.tb = 0, g.m = (int64_t)C, g.n = (int64_t)N, g.k = (int64_t)OC;
        g.lda = (int64_t)C, g.ldb = (int64_t)OC, g.ldd = (int64_t)C;
        g.A = weight, g.B = dout, g.D = dinp, g.epi = CUBLASLT_EPILOGUE_DEFAULT;
        if ((r = mn__gemm(ctx, &g, dtype)) != MN_OK) return r;
    }
    if (dweight) {
        g.ta = 0, g.tb = 1, g.m = (int64_t)C, g.n = (int64_t)OC, g.k = (int64_t)N;
        g.lda = (int64_t)C, g.ldb = (int64_t)OC, g.ldd = (int64_t)C;
        g.A = inp, g.B = dout, g.D = dweight, g.epi = CUBLASLT_EPILOGUE_DEFAULT;
        if (!dbias_done && !ctx->desc.no_fused_epilogues) {
            // BGRADB writes sum_n dpre into a scratch [OC] (the epilogue overwrites); then += .
            void *scr;
            if ((r = mn__scratch(ctx, OC * es, &scr)) != MN_OK) return r;
            g.epi = CUBLASLT_EPILOGUE_BGRADB, g.bias = scr;
            r = mn__gemm(ctx, &g, dtype);
            if (r == MN_OK) {
                ctx->gemm_fused++;
                MN__DISPATCH(ctx, dtype, mn__add, ctx, dbias, scr, OC);
            }
            if (r != MN_ERR_UNSUPPORTED) return r;
            g.epi = CUBLASLT_EPILOGUE_DEFAULT, g.bias = NULL;
        }
        if ((r = mn__gemm(ctx, &g, dtype)) != MN_OK) return r;
    }
    if (!dbias_done) {
        ctx->gemm_unfused++;
        switch (dtype) {
        case MN_FP16: return mn__dgelu_bias<__half>(ctx, dbias, dout, NULL, N, OC);
        case MN_BF16: return mn__dgelu_bias<__nv_bfloat16>(ctx, dbias, dout, NULL, N, OC);
        default: return mn__dgelu_bias<float>(ctx, dbias, dout, NULL, N, OC);
        }
    }
    return MN_OK;
}

// ---- kernels: >>ops attention (batched GEMMs + the fused causal softmax) -----------------------
// Per head (b, h), row-major: S = q k^T [T,T], P = softmax(S / sqrt(hs)) (causal: row t sees keys
// 0..t), y = P v [T,hs]; backward dP = dy v^T, dS = P (dP - rowsum(P dP)) / sqrt(hs), dq = dS k,
// dk = dS^T q, dv = P^T dy. q, k, v, dy are gathered into per-head buffers [B*NH, T, hsp] (one
// batch stride for every head, 16-byte aligned rows), so each product is one strided-batched
// GEMM over B*NH heads; in cuBLASLt's column-major view a row-major [T,hs] head buffer is the
// hs x T matrix X^T with ld hsp and a row-major [T,T] buffer the T x T matrix S^T with ld T:
//   S^T  = (k^T)^T-op . q^T : ta = T, m = T,  n = T, k = hs   (also dP^T from v and dy)
//   y^T  = v^T . P^T        : ta = N, m = hs, n = T, k = T    (also dq^T from k and dS)
//   dk^T = q^T . (dS^T)^T-op: tb = T, m = hs, n = T, k = T    (also dv^T from dy and P)
// Causal from T = 256 on, each product runs as 4 query blocks that skip the masked keys (the
// header's mn_hd_att_gemm_block: shapes and offsets, tested on the host), 37 % fewer FLOPs.

// mode 0: heads[part] <- flat; mode 1: flat <- heads[0] (out); mode 2: flat += heads[part]
// (dqkv). flat [B,T,parts*C], heads [B,NH,T,hsp] each.
template <typename T>
static __global__ void __launch_bounds__(MN__EW_THREADS)
mn__att_heads_kernel(T *flat, T *h0, T *h1, T *h2, size_t n, size_t T_, size_t C, size_t NH,
                     size_t hsp, unsigned parts, int mode) {
    size_t i;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t part, j = mn_hd_head_index(i, T_, C, NH, hsp, parts, &part);
        T *h = part == 0 ? h0 : part == 1 ? h1 : h2;
        if (mode == 0) h[j] = flat[i];
        else if (mode == 1) flat[i] = h[j];
        else flat[i] = mn__cvt<T>(mn__ld<T>(flat + i) + mn__ld<T>(h + j));
    }
}

template <typename T>
static mn_result mn__att_heads(mn_cuda *ctx, const void *flat, T *h0, T *h1, T *h2, size_t B,
                               size_t T_, size_t C, size_t NH, size_t hsp, unsigned parts,
                               int mode) {
    size_t n = B * T_ * parts * C;
    mn__att_heads_kernel<T><<<mn__ew_grid(ctx, n), MN__EW_THREADS, 0, mn__stream(ctx)>>>(
        (T *)flat, h0, h1, h2, n, T_, C, NH, hsp, parts, mode);
    MN__LAUNCHED(ctx);
    return MN_OK;
}

// One query block [r0, r1) of one of the three GEMM forms (mn_hd_att_gemm_block gives its shape,
// leading dimensions and offsets), batched over the heads; beta 0 (D written).
static mn_result mn__att_gemm(mn_cuda *ctx, int form, const void *A, const void *Bm, void *D,
                              size_t BH, size_t T_, size_t hs, size_t hsp, uint64_t r0,
                              uint64_t r1, mn_dtype dt) {
    mn_hd_att_gemm b = mn_hd_att_gemm_block(form, T_, hs, hsp, r0, r1);
    mn__gemm_args g;
    mn_result r;
    size_t es = dt == MN_FP16 || dt == MN_BF16 ? 2 : 4;
    int64_t th = (int64_t)(T_ * hsp), tt = (int64_t)(T_ * T_);
    if (b.n == 0) return MN_OK;
    memset(&g, 0, sizeof g);
    g.A = (const char *)A + b.a * es, g.B = (const char *)Bm + b.b * es, g.D = (char *)D + b.d * es;
    g.beta = 0.0f, g.epi = CUBLASLT_EPILOGUE_DEFAULT, g.batch = (int64_t)BH;
    g.ta = b.ta, g.tb = b.tb, g.m = (int64_t)b.m, g.n = (int64_t)b.n, g.k = (int64_t)b.k;
    g.lda = (int64_t)b.lda, g.ldb = (int64_t)b.ldb, g.ldd = (int64_t)b.ldd;
    g.sa = th, g.sb = form == MN_HD_ATT_QKT ? th : tt, g.sd = form == MN_HD_ATT_QKT ? tt : th;
    r = mn__gemm(ctx, &g, dt);
    if (r == MN_ERR_UNSUPPORTED) {
        mn__cu_log(ctx, MN_LOG_ERROR, "memanat_cuda: cuBLASLt has no algorithm for the attention "
                   "GEMM (form %d, T %zu, hs %zu, %zu heads, rows %llu..%llu)", form, T_, hs, BH,
                   (unsigned long long)r0, (unsigned long long)r1);
        return MN_ERR_DEVICE;
    }
    return r;
}

// Every query block of a form: causal from T = 256 on skips the masked half (mn_hd_att_blocks).
static mn_result mn__att_gemms(mn_cuda *ctx, int form, const void *A, const void *Bm, void *D,
                               size_t BH, size_t T_, size_t hs, size_t hsp, int causal,
                               mn_dtype dt) {
    uint64_t nb = mn_hd_att_blocks(T_, causal), c, r0, r1;
    mn_result r;
    for (c = 0; c < nb; c++) {
        mn_hd_att_block_rows(T_, nb, c, &r0, &r1);
        if ((r = mn__att_gemm(ctx, form, A, Bm, D, BH, T_, hs, hsp, r0, r1, dt)) != MN_OK)
            return r;
    }
    return MN_OK;
}

template <typename T>
static mn_result mn__attention_forward(mn_cuda *ctx, void *out, void *att, const void *qkv,
                                       size_t B, size_t T_, size_t C, size_t NH, int causal,
                                       mn_dtype dt) {
    size_t hs = C / NH, hsp = (size_t)mn_hd_head_ld(hs), BH = B * NH;
    size_t hb = mn__round256(BH * T_ * hsp * sizeof(T)), sb = mn__round256(BH * T_ * T_ * sizeof(T));
    char *scr;
    T *q, *k, *v, *y, *S;
    mn_result r;
    float scale = 1.0f / sqrtf((float)hs);
    uint64_t need;  // 4 hb + (att ? 0 : sb)
    if (mn_attention_scratch(B, T_, C, NH, sizeof(T), 0, att != NULL, &need) != MN_OK ||
        need > SIZE_MAX)
        return mn__bad(ctx, "attention's scratch overflows");
    if ((r = mn__scratch(ctx, (size_t)need, (void **)&scr)) != MN_OK) return r;
    q = (T *)scr, k = (T *)(scr + hb), v = (T *)(scr + 2 * hb), y = (T *)(scr + 3 * hb);
    S = att ? (T *)att : (T *)(scr + 4 * hb);
    if ((r = mn__att_heads<T>(ctx, qkv, q, k, v, B, T_, C, NH, hsp, 3, 0)) != MN_OK) return r;
    if ((r = mn__att_gemms(ctx, MN_HD_ATT_QKT, k, q, S, BH, T_, hs, hsp, causal, dt)) != MN_OK)
        return r;
    if ((r = mn__softmax_forward<T>(ctx, S, S, BH * T_, T_, scale, causal)) != MN_OK) return r;
    if ((r = mn__att_gemms(ctx, MN_HD_ATT_PV, v, S, y, BH, T_, hs, hsp, causal, dt)) != MN_OK)
        return r;
    return mn__att_heads<T>(ctx, out, y, y, y, B, T_, C, NH, hsp, 1, 1);
}

template <typename T>
static mn_result mn__attention_backward(mn_cuda *ctx, void *dqkv, const void *dout,
                                        const void *qkv, const void *att, size_t B, size_t T_,
                                        size_t C, size_t NH, int causal, mn_dtype dt) {
    size_t hs = C / NH, hsp = (size_t)mn_hd_head_ld(hs), BH = B * NH;
    size_t hb = mn__round256(BH * T_ * hsp * sizeof(T)), sb = mn__round256(BH * T_ * T_ * sizeof(T));
    char *scr;
    T *q, *k, *v, *dy, *dq, *dk, *dv, *dP, *dS, *P;
    mn_result r;
    float scale = 1.0f / sqrtf((float)hs);
    uint64_t need;  // 7 hb + (att ? 2 : 3) sb
    if (mn_attention_scratch(B, T_, C, NH, sizeof(T), 1, att != NULL, &need) != MN_OK ||
        need > SIZE_MAX)
        return mn__bad(ctx, "attention's scratch overflows");
    if ((r = mn__scratch(ctx, (size_t)need, (void **)&scr)) != MN_OK) return r;
    q = (T *)scr, k = (T *)(scr + hb), v = (T *)(scr + 2 * hb), dy = (T *)(scr + 3 * hb);
    dq = (T *)(scr + 4 * hb), dk = (T *)(scr + 5 * hb), dv = (T *)(scr + 6 * hb);
    dP = (T *)(scr + 7 * hb), dS = (T *)(scr + 7 * hb + sb);
    P = att ? (T *)att : (T *)(scr + 7 * hb + 2 * sb);
    if ((r = mn__att_heads<T>(ctx, qkv, q, k, v, B, T_, C, NH, hsp, 3, 0)) != MN_OK) return r;
    if ((r = mn__att_heads<T>(ctx, dout, dy, dy, dy, B, T_, C, NH, hsp, 1, 0)) != MN_OK) return r;
    if (!att) {  // the forward's probabilities again (the same GEMM and kernel: the same values)
        r = mn__att_gemms(ctx, MN_HD_ATT_QKT, k, q, P, BH, T_, hs, hsp, causal, dt);
        if (r != MN_OK) return r;
        if ((r = mn__softmax_forward<T>(ctx, P, P, BH * T_, T_, scale, causal)) != MN_OK) return r;
    }
    if ((r = mn__att_gemms(ctx, MN_HD_ATT_QKT, v, dy, dP, BH, T_, hs, hsp, causal, dt)) != MN_OK)
        return r;
    MN__CU(ctx, cudaMemsetAsync(dS, 0, BH * T_ * T_ * sizeof(T), mn__stream(ctx)));
    if ((r = mn__softmax_backward<T>(ctx, dS, dP, P, BH * T_, T_, scale, causal)) != MN_OK)
        return r;
    if ((r = mn__att_gemms(ctx, MN_HD_ATT_PV, k, dS, dq, BH, T_, hs, hsp, causal, dt)) != MN_OK)
        return r;
    if ((r = mn__att_gemms(ctx, MN_HD_ATT_PTV, q, dS, dk, BH, T_, hs, hsp, causal, dt)) != MN_OK)
        return r;
    if ((r = mn__att_gemms(ctx, MN_HD_ATT_PTV, dy, P, dv, BH, T_, hs, hsp, causal, dt)) != MN_OK)
        return r;
    return mn__att_heads<T>(ctx, dqkv, dq, dk, dv, B, T_, C, NH, hsp, 3, 2);
}

MNDEF mn_result mn_cuda_attention_forward(mn_cuda *ctx, void *out, void *att, const void *qkv,
                                          size_t B, size_t T, size_t C, size_t NH, int causal,
                                          mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, out && qkv);
    MN__CHECK(ctx, NH > 0 && C > 0 && C % NH == 0);
    MN__CHECK(ctx, T <= 0x7fffffffu && B * NH <= 0x7fffffffu);
    if (!mn__cu_fits(B, T, C) || !mn__cu_fits(B * T, 3, C))
        return mn__bad(ctx, "B * T * 3C overflows");
    if (att && (!mn__cu_fits(B, NH, T) || !mn__cu_fits(B * NH, T, T)))
        return mn__bad(ctx, "B * NH * T * T overflows");
    if (B * T == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__attention_forward, ctx, out, att, qkv, B, T, C, NH, causal,
                 dtype);
}

MNDEF mn_result mn_cuda_attention_backward(mn_cuda *ctx, void *dqkv, const void *dout,
                                           const void *qkv, const void *att, size_t B, size_t T,
                                           size_t C, size_t NH, int causal, mn_dtype dtype) {
    MN__CTX(ctx);
    MN__CHECK(ctx, dqkv && dout && qkv);
    MN__CHECK(ctx, NH > 0 && C > 0 && C % NH == 0);
    MN__CHECK(ctx, T <= 0x7fffffffu && B * NH <= 0x7fffffffu);
    if (!mn__cu_fits(B, T, C) || !mn__cu_fits(B * T, 3, C))
        return mn__bad(ctx, "B * T * 3C overflows");
    if (att && (!mn__cu_fits(B, NH, T) || !mn__cu_fits(B * NH, T, T)))
        return mn__bad(ctx, "B * NH * T * T overflows");
    if (B * T == 0) return MN_OK;
    MN__DISPATCH(ctx, dtype, mn__attention_backward, ctx, dqkv, dout, qkv, att, B, T, C, NH,
                 causal, dtype);
}
