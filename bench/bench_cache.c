// bench_cache: speed and fragmentation of the caching allocator (memanat.h section >>cache).
//
//   ./build/bench_cache                 both tables below
//   ./build/bench_cache speed           ns per malloc/free pair on the cached paths
//   ./build/bench_cache frag            peak reserved / peak allocated on transformer traces
//   ./build/bench_cache csv MODEL OUT   writes the trace of MODEL as an RMM log (memanat replay)
//   ./build/bench_cache svg MODEL CONFIG OUT   its memory timeline under CONFIG ("" = default)
//
// Speed: the allocator runs on the simulated device with 10^3, 10^4 and 10^5 live blocks of
// mixed sizes; each case times a malloc/free pair (same size: a whole cached block; split: a
// small piece cut from a free block and merged back on free; merge: a block freed between two
// free neighbours; miss: a new segment from the device, freed and returned by empty_cache), the
// median of 15 runs of thread CPU time, against the host's malloc/free with as many live
// blocks.
//
// Fragmentation: a generator writes the allocation sequence of transformer training steps
// (forward allocates the activations autograd saves and frees temporaries, backward frees them
// layer by layer and allocates gradients, the optimizer allocates its state on the first step and
// per-tensor temporaries, gradients are set to None after the step), for several model sizes,
// with a fixed sequence length and with a sequence length that changes every step (dynamic
// padding). Each trace is replayed with PyTorch's default policy and with options.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"
#include "bench.h"

#define now_ns bench_cpu_ns  // time spent descheduled on a shared machine does not count

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint64_t rnd(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}


// ---- speed -------------------------------------------------------------------------------------

enum { CASE_SAME, CASE_SPLIT, CASE_MERGE, CASE_MISS, CASE_COUNT };

static uint64_t live_size(void) {  // mixed sizes, mostly small, as tensors are
    uint64_t r = rnd() % 100;
    if (r < 70) return 512 + rnd() % (64 << 10);
    if (r < 95) return (1 << 20) + rnd() % (8 << 20);
    return (10 << 20) + rnd() % (40 << 20);
}

static double time_case(mn_cache *c, int which, uint64_t iters) {
    void *p = NULL, *q[3];
    uint64_t i;
    double t0, t1;
    switch (which) {
    case CASE_SAME:  // a whole cached 20 MiB segment on stream 1: no split, no merge
        mn_cache_alloc(c, 20 << 20, 1, MN_CAT_TEMPORARY, NULL, &p);
        mn_cache_release(c, p);
        break;
    case CASE_SPLIT:  // cut 4 KiB from a free 2 MiB segment on stream 2; free merges it back
        mn_cache_alloc(c, 1 << 20, 2, MN_CAT_TEMPORARY, NULL, &p);
        mn_cache_release(c, p);
        break;
    case CASE_MERGE:  // [free a][b][free c] on stream 3: b's free merges both sides
        mn_cache_alloc(c, 64 << 10, 3, MN_CAT_TEMPORARY, NULL, &q[0]);
        mn_cache_alloc(c, 64 << 10, 3, MN_CAT_TEMPORARY, NULL, &q[1]);
        mn_cache_alloc(c, 64 << 10, 3, MN_CAT_TEMPORARY, NULL, &q[2]);
        mn_cache_release(c, q[0]);
        mn_cache_release(c, q[1]);
        mn_cache_release(c, q[2]);
        break;
    default: break;
    }
    t0 = now_ns();
    for (i = 0; i < iters; i++) {
        switch (which) {
        case CASE_SAME:
            mn_cache_alloc(c, 20 << 20, 1, MN_CAT_TEMPORARY, NULL, &p);
            mn_cache_release(c, p);
            break;
        case CASE_SPLIT:
            mn_cache_alloc(c, 4096, 2, MN_CAT_TEMPORARY, NULL, &p);
            mn_cache_release(c, p);
            break;
        case CASE_MERGE:  // the best fit for 64 KiB is the first hole: [b][rest]
            mn_cache_alloc(c, 64 << 10, 3, MN_CAT_TEMPORARY, NULL, &p);
            mn_cache_release(c, p);
            break;
        case CASE_MISS:  // a stream with nothing cached: every allocation is a new segment
            mn_cache_alloc(c, 24 << 20, (mn_stream)(100 + i), MN_CAT_TEMPORARY, NULL, &p);
            mn_cache_release(c, p);
            break;
        }
    }
    t1 = now_ns();
    if (which == CASE_MISS) mn_cache_empty(c);  // not timed
    return (t1 - t0) / (double)iters;
}

static void bench_speed(void) {
    static const uint64_t lives[] = {1000, 10000, 100000};
    size_t li;
    printf("ns per malloc/free pair (median of 15 runs), simulated device, PyTorch default "
           "policy;\nlive blocks of mixed sizes, every 4th freed again: the free trees hold "
           "live/4 blocks\n");
    printf("%-10s %10s %10s %10s %10s %12s\n", "live", "same size", "split", "merge", "miss*",
           "host malloc");
    for (li = 0; li < 3; li++) {
        mn_sim_cache sc;
        mn_cache *cache = &sc.cache;
        void **live = (void **)malloc(lives[li] * sizeof *live);
        void **hlive = (void **)malloc(lives[li] * sizeof *hlive);
        double res[CASE_COUNT + 1], runs[15];
        uint64_t i;
        int k, r;
        if (!live || !hlive || mn_sim_cache_init(&sc, NULL, NULL) != MN_OK) {
            fprintf(stderr, "bench_cache: setup failed\n");
            exit(1);
        }
        for (i = 0; i < lives[li]; i++) {  // live blocks, with holes: every 4th freed again
            mn_cache_alloc(cache, live_size(), 0, MN_CAT_ACTIVATIONS, NULL, &live[i]);
            hlive[i] = malloc((size_t)(live_size() >> 6));  // host: sizes scaled down
        }
        for (i = 0; i < lives[li]; i += 4) {
            mn_cache_release(cache, live[i]);
            live[i] = NULL;
        }
        for (k = 0; k < CASE_COUNT; k++) {
            uint64_t iters = k == CASE_MISS ? 2000 : 50000;
            for (r = 0; r < 15; r++) runs[r] = time_case(cache, k, iters);
            res[k] = bench_median(runs, 15);
        }
        for (r = 0; r < 15; r++) {
            double t0 = now_ns();
            for (i = 0; i < 50000; i++) {
                void *p = malloc(4096 + (i & 7) * 512);
                *(volatile char *)p = 1;
                free(p);
            }
            runs[r] = (now_ns() - t0) / 50000.0;
        }
        res[CASE_COUNT] = bench_median(runs, 15);
        printf("%-10llu %10.1f %10.1f %10.1f %10.1f %12.1f\n", (unsigned long long)lives[li],
               res[0], res[1], res[2], res[3], res[4]);
        for (i = 0; i < lives[li]; i++) {
            mn_cache_release(cache, live[i]);
            free(hlive[i]);
        }
        mn_sim_cache_free(&sc);
        free(live);
        free(hlive);
    }
    printf("* miss = a new 24 MiB segment from the simulated device (a stream with nothing "
           "cached), then its free\n\n");
}

// ---- transformer trace generator ------------------------------------------------------------

typedef struct trace {
    mn_trace_event *e;
    size_t n, cap;
    uint32_t next_id;
} trace;

static mn_trace_event *t_push(trace *t) {
    if (t->n == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 1 << 16;
        t->e = (mn_trace_event *)realloc(t->e, t->cap * sizeof *t->e);
        if (!t->e) exit(1);
    }
    memset(&t->e[t->n], 0, sizeof t->e[t->n]);
    return &t->e[t->n++];
}

static uint32_t t_alloc(trace *t, uint64_t size, mn_category cat) {
    mn_trace_event *e = t_push(t);
    e->id = ++t->next_id, e->size = size, e->alloc = 1, e->category = (uint8_t)cat;
    return t->next_id;
}

static void t_free(trace *t, uint32_t id) { t_push(t)->id = id; }

typedef struct model {
    const char *name;
    uint64_t layers, hidden, heads, vocab, batch, seq;
} model;

// One GPT-style model trained with bf16 autocast (fp32 weights and master, bf16 activations),
// AdamW, fused attention (no s x s scores kept). steps: training steps; vary: the sequence
// length changes from step to step (dynamic padding), as in the expandable segments note.
static void gen_transformer(trace *t, const model *m, int steps, int vary) {
    enum { W_QKV, W_QKVB, W_O, W_OB, W_FC1, W_FC1B, W_FC2, W_FC2B, W_LN1, W_LN1B, W_LN2, W_LN2B,
           W_PER_LAYER };
    uint64_t h = m->hidden, L = m->layers, V = m->vocab, nw = 2 + L * W_PER_LAYER + 2, i, l;
    uint64_t *wsz = (uint64_t *)malloc(nw * sizeof *wsz);
    uint32_t *w = (uint32_t *)malloc(nw * sizeof *w), *g = (uint32_t *)calloc(nw, sizeof *g);
    uint32_t *ms = (uint32_t *)calloc(nw, sizeof *ms), *vs = (uint32_t *)calloc(nw, sizeof *vs);
    uint32_t saved[64][12];
    int s, k;
    if (!wsz || !w || !g || !ms || !vs || L > 64) exit(1);
    // parameters, fp32: token + position embeddings, per layer, final layernorm
    wsz[0] = V * h * 4, wsz[1] = 1024 * h * 4;
    for (l = 0; l < L; l++) {
        uint64_t *p = &wsz[2 + l * W_PER_LAYER];
        p[W_QKV] = 3 * h * h * 4, p[W_QKVB] = 3 * h * 4, p[W_O] = h * h * 4, p[W_OB] = h * 4;
        p[W_FC1] = 4 * h * h * 4, p[W_FC1B] = 4 * h * 4, p[W_FC2] = 4 * h * h * 4;
        p[W_FC2B] = h * 4, p[W_LN1] = p[W_LN1B] = p[W_LN2] = p[W_LN2B] = h * 4;
    }
    wsz[nw - 2] = wsz[nw - 1] = h * 4;
    for (i = 0; i < nw; i++) w[i] = t_alloc(t, wsz[i], MN_CAT_WEIGHTS);
    for (s = 0; s < steps; s++) {
        uint64_t B = m->batch, T = vary ? m->seq - (uint64_t)((s * 7919) % 5) * (m->seq / 8)
                                        : m->seq;
        uint64_t bth2 = B * T * h * 2, x, logits, lse, tmp;
        // forward: embeddings, then per layer the tensors autograd saves (bf16 unless noted)
        x = t_alloc(t, bth2, MN_CAT_ACTIVATIONS);
        for (l = 0; l < L; l++) {
            uint32_t *sv = saved[l];
            // bf16 casts of this layer's weights (autocast caches them for the step)
            sv[0] = t_alloc(t, 3 * h * h * 2, MN_CAT_TEMPORARY);
            sv[1] = t_alloc(t, h * h * 2, MN_CAT_TEMPORARY);
            sv[2] = t_alloc(t, 4 * h * h * 2, MN_CAT_TEMPORARY);
            sv[3] = t_alloc(t, 4 * h * h * 2, MN_CAT_TEMPORARY);
            sv[4] = t_alloc(t, B * T * h * 4, MN_CAT_ACTIVATIONS);       // ln1 out (fp32)
            sv[5] = t_alloc(t, 3 * bth2, MN_CAT_ACTIVATIONS);            // qkv
            sv[6] = t_alloc(t, bth2, MN_CAT_ACTIVATIONS);                // attention out
            sv[7] = t_alloc(t, B * m->heads * T * 4, MN_CAT_ACTIVATIONS);  // logsumexp
            tmp = t_alloc(t, bth2, MN_CAT_TEMPORARY);                    // proj out
            sv[8] = t_alloc(t, B * T * h * 4, MN_CAT_ACTIVATIONS);       // residual (fp32)
            t_free(t, tmp);
            sv[9] = t_alloc(t, B * T * h * 4, MN_CAT_ACTIVATIONS);       // ln2 out
            sv[10] = t_alloc(t, 4 * bth2, MN_CAT_ACTIVATIONS);           // fc1 out
            sv[11] = t_alloc(t, 4 * bth2, MN_CAT_ACTIVATIONS);           // gelu out
            tmp = t_alloc(t, bth2, MN_CAT_TEMPORARY);                    // fc2 out
            t_free(t, tmp);
        }
        logits = t_alloc(t, B * T * V * 2, MN_CAT_ACTIVATIONS);
        tmp = t_alloc(t, B * T * V * 4, MN_CAT_TEMPORARY);  // fp32 logits for the loss
        lse = t_alloc(t, B * T * 4, MN_CAT_ACTIVATIONS);
        t_free(t, tmp);
        // backward: the head, then layers in reverse; weight gradients on first touch
        tmp = t_alloc(t, B * T * V * 4, MN_CAT_TEMPORARY);  // d logits
        if (!g[0]) g[0] = t_alloc(t, wsz[0], MN_CAT_GRADIENTS);
        t_free(t, logits), t_free(t, lse);
        {
            uint32_t dx = t_alloc(t, bth2, MN_CAT_TEMPORARY);
            t_free(t, tmp);
            for (l = L; l-- > 0;) {
                uint32_t *sv = saved[l], d1, d2;
                for (k = W_PER_LAYER; k-- > 0;) {
                    i = 2 + l * W_PER_LAYER + (uint64_t)k;
                    if (!g[i]) g[i] = t_alloc(t, wsz[i], MN_CAT_GRADIENTS);
                }
                d1 = t_alloc(t, 4 * bth2, MN_CAT_TEMPORARY);  // d gelu
                t_free(t, sv[11]);
                d2 = t_alloc(t, 4 * bth2, MN_CAT_TEMPORARY);  // d fc1
                t_free(t, d1), t_free(t, sv[10]);
                d1 = t_alloc(t, B * T * h * 4, MN_CAT_TEMPORARY);
                t_free(t, d2), t_free(t, sv[9]), t_free(t, sv[8]);
                d2 = t_alloc(t, 3 * bth2, MN_CAT_TEMPORARY);  // d qkv
                t_free(t, sv[7]), t_free(t, sv[6]), t_free(t, sv[5]);
                t_free(t, d1);
                d1 = t_alloc(t, bth2, MN_CAT_TEMPORARY);
                t_free(t, d2), t_free(t, sv[4]);
                t_free(t, dx);
                dx = d1;
                for (k = 0; k < 4; k++) t_free(t, sv[k]);
            }
            t_free(t, dx);
        }
        t_free(t, x);
        for (i = 0; i < nw; i++)
            if (!g[i]) g[i] = t_alloc(t, wsz[i], MN_CAT_GRADIENTS);
        // optimizer: AdamW states on the first step, a temporary per parameter tensor
        for (i = 0; i < nw; i++) {
            if (!ms[i]) ms[i] = t_alloc(t, wsz[i], MN_CAT_OPTIMIZER);
            if (!vs[i]) vs[i] = t_alloc(t, wsz[i], MN_CAT_OPTIMIZER);
            tmp = t_alloc(t, wsz[i], MN_CAT_TEMPORARY);
            t_free(t, tmp);
        }
        for (i = 0; i < nw; i++) t_free(t, g[i]), g[i] = 0;  // zero_grad(set_to_none=True)
    }
    free(wsz), free(w), free(g), free(ms), free(vs);
}

typedef struct replay_result {
    uint64_t peak_alloc, peak_reserved, ooms, device_allocs;
    double ns_per_event;
} replay_result;

// The trace replayed 5 times on one allocator (each run releases what is left live): the
// statistics of the first run, the median time per event.
static replay_result replay(const trace *t, const char *config) {
    mn_sim_cache sc;
    mn_cache_desc cd;
    struct mn_cache_stats st;
    replay_result res;
    double runs[5];
    int run;
    memset(&cd, 0, sizeof cd);
    cd.config = config;
    if (mn_sim_cache_init(&sc, NULL, &cd) != MN_OK) {
        fprintf(stderr, "bench_cache: cannot start the allocator with '%s'\n", config);
        exit(1);
    }
    memset(&st, 0, sizeof st);
    for (run = 0; run < 5; run++) {
        double t0 = now_ns();
        if (mn_cache_replay(&sc.cache, t->e, t->n, 1, NULL) != MN_OK) exit(1);
        runs[run] = (now_ns() - t0) / (double)t->n;
        if (run == 0) mn_cache_stats(&sc.cache, &st);
    }
    res.ns_per_event = bench_median(runs, 5);
    res.peak_alloc = st.allocated_bytes[MN_STAT_ALL].peak;
    res.peak_reserved = st.reserved_bytes[MN_STAT_ALL].peak;
    res.ooms = st.num_ooms;
    res.device_allocs = st.num_device_alloc;
    mn_sim_cache_free(&sc);
    return res;
}

static const model models[] = {
    {"gpt2-124m", 12, 768, 12, 50257, 8, 1024},
    {"gpt2-350m", 24, 1024, 16, 50257, 8, 1024},
    {"gpt2-1.3b", 24, 2048, 16, 50257, 4, 1024},
    {"llama-7b-ish", 32, 4096, 32, 32000, 1, 2048},
};

static const struct { const char *label, *config; } policies[] = {
    {"pytorch default", ""},
    {"expandable_segments", "expandable_segments:True"},
    {"max_split_size_mb:128", "max_split_size_mb:128"},
    {"roundup_power2_divisions:4", "roundup_power2_divisions:4"},
};

static void bench_frag(void) {
    size_t mi, pi;
    int vary;
    printf("peak reserved / peak allocated on transformer training traces (3 steps, bf16 "
           "autocast, AdamW)\n");
    printf("%-13s %-6s %9s %10s", "model", "seq", "events", "peak alloc");
    for (pi = 0; pi < sizeof policies / sizeof policies[0]; pi++) printf(" %26s", policies[pi].label);
    printf("\n");
    for (mi = 0; mi < sizeof models / sizeof models[0]; mi++)
        for (vary = 0; vary < 2; vary++) {
            trace t;
            memset(&t, 0, sizeof t);
            gen_transformer(&t, &models[mi], 3, vary);
            printf("%-13s %-6s %9zu", models[mi].name, vary ? "varies" : "fixed", t.n);
            for (pi = 0; pi < sizeof policies / sizeof policies[0]; pi++) {
                replay_result r = replay(&t, policies[pi].config);
                if (pi == 0) printf(" %7.2f GiB", (double)r.peak_alloc / 1073741824.0);
                printf("   %6.3f (%7.2f GiB, %3.0f ns)",
                       (double)r.peak_reserved / (double)r.peak_alloc,
                       (double)r.peak_reserved / 1073741824.0, r.ns_per_event);
            }
            printf("\n");
            free(t.e);
        }
    printf("cells: peak reserved / peak allocated (peak reserved, ns per replayed event)\n");
}

// The same comparison on the allocation sequences the estimator simulates for real models
// (mn_estimate_trace: load + two training steps, HF conventions, bf16 autocast, AdamW).
static void bench_frag_estimator(void) {
    static const struct { const char *model; uint64_t batch, seq; mn_attn attn; } cases[] = {
        {"gpt2", 8, 1024, MN_ATTN_SDPA},
        {"bert-large-uncased", 4, 512, MN_ATTN_EAGER},
        {"gpt2-xl", 4, 1024, MN_ATTN_SDPA},
        {"llama-3.2-1b", 4, 2048, MN_ATTN_SDPA},
        {"llama-2-7b", 1, 2048, MN_ATTN_SDPA},
    };
    size_t ci, pi;
    printf("\nthe estimator's traces (memanat estimate --precision bf16; 2 steps)\n");
    printf("%-20s %9s %10s", "model", "events", "peak alloc");
    for (pi = 0; pi < sizeof policies / sizeof policies[0]; pi++) printf(" %26s", policies[pi].label);
    printf("\n");
    for (ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        mn_model m;
        mn_setup su;
        mn_trace_event *te = NULL;
        uint64_t n = 0;
        trace t;
        memset(&su, 0, sizeof su);
        memset(&t, 0, sizeof t);
        su.batch = cases[ci].batch, su.seq = cases[ci].seq, su.attention = cases[ci].attn;
        su.precision = MN_PREC_BF16;
        if (mn_preset_find(cases[ci].model, &m) != MN_OK || mn_estimate_trace(&m, &su, NULL, &te, &n) != MN_OK) exit(1);
        t.e = te, t.n = t.cap = (size_t)n;
        printf("%-20s %9zu", cases[ci].model, t.n);
        for (pi = 0; pi < sizeof policies / sizeof policies[0]; pi++) {
            replay_result r = replay(&t, policies[pi].config);
            if (pi == 0) printf(" %7.2f GiB", (double)r.peak_alloc / 1073741824.0);
            printf("   %6.3f (%7.2f GiB, %3.0f ns)", (double)r.peak_reserved / (double)r.peak_alloc,
                   (double)r.peak_reserved / 1073741824.0, r.ns_per_event);
        }
        printf("\n");
        mn_trace_free(NULL, te);
    }
}

static int write_csv(const char *name, const char *path) {
    size_t mi, i;
    for (mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
        trace t;
        FILE *f;
        if (strcmp(models[mi].name, name) != 0) continue;
        memset(&t, 0, sizeof t);
        gen_transformer(&t, &models[mi], 3, 1);
        f = fopen(path, "w");
        if (!f) {
            fprintf(stderr, "bench_cache: cannot write %s\n", path);
            return 1;
        }
        fprintf(f, "Thread,Time,Action,Pointer,Size,Stream\n");
        {
            uint64_t *sz = (uint64_t *)calloc(t.next_id + 1, sizeof *sz);
            if (!sz) return 1;
            for (i = 0; i < t.n; i++) {
                const mn_trace_event *e = &t.e[i];
                if (e->alloc) sz[e->id] = e->size;
                fprintf(f, "1,00:00:%02u.%06u,%s,0x%llx,%llu,0x0\n", (unsigned)(i / 1000000 % 60),
                        (unsigned)(i % 1000000), e->alloc ? "allocate" : "free",
                        (unsigned long long)e->id << 12, (unsigned long long)sz[e->id]);
            }
            free(sz);
        }
        fclose(f);
        free(t.e);
        printf("wrote %s (%zu events)\n", path, t.n);
        return 0;
    }
    fprintf(stderr, "bench_cache: unknown model '%s'\n", name);
    return 1;
}

// The memory timeline of one model's trace, stacked by category, under a policy.
static int write_svg(const char *name, const char *config, const char *path) {
    size_t mi;
    for (mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
        trace t;
        mn_sim_cache sc;
        mn_cache_desc cd;
        mn_cache_snapshot snap;
        FILE *f;
        char title[160];
        int bad;
        if (strcmp(models[mi].name, name) != 0) continue;
        memset(&t, 0, sizeof t);
        gen_transformer(&t, &models[mi], 3, 1);
        memset(&cd, 0, sizeof cd);
        cd.config = config;
        cd.trace_entries = (uint32_t)(t.n * 2 + 64);
        if (mn_sim_cache_init(&sc, NULL, &cd) != MN_OK) return 1;
        bad = mn_cache_replay(&sc.cache, t.e, t.n, 0, NULL) != MN_OK ||
              mn_cache_snapshot_take(&sc.cache, &snap) != MN_OK;
        f = bad ? NULL : fopen(path, "w");
        if (!f) return 1;
        snprintf(title, sizeof title, "%s, 3 training steps, %s", name,
                 config[0] ? config : "PyTorch default policy");
        bad = mn_cache_timeline_svg(&snap, title, mn_cache_write_file, f) != MN_OK;
        bad |= fclose(f) != 0;
        mn_cache_snapshot_free(&snap);
        mn_sim_cache_free(&sc);
        free(t.e);
        if (bad) return 1;
        printf("wrote %s\n", path);
        return 0;
    }
    fprintf(stderr, "bench_cache: unknown model '%s'\n", name);
    return 1;
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "all";
    if (strcmp(what, "csv") == 0) return argc == 4 ? write_csv(argv[2], argv[3]) : 2;
    if (strcmp(what, "svg") == 0) return argc == 5 ? write_svg(argv[2], argv[3], argv[4]) : 2;
    if (strcmp(what, "speed") == 0 || strcmp(what, "all") == 0) bench_speed();
    if (strcmp(what, "frag") == 0 || strcmp(what, "all") == 0) bench_frag(), bench_frag_estimator();
    return 0;
}
