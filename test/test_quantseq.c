// Tests of the bitsandbytes storage model (--quant nf4|nf4-dq|fp4|fp4-dq|int8, --bnb-version,
// --quant-head) and of training over a distribution of sequence lengths (mn_estimate_lengths,
// the lengths file reader, the marked allocator replay). References: per-tensor byte counts
// computed here from bitsandbytes' layout (functional.py quantize_4bit), the QLoRA paper's
// 0.127 bit of constants, the plain estimate at one length, an independent prefix replay.
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "harness.h"
#include "../memanat.h"

static mn_model preset(const char *name) {
    mn_model m;
    memset(&m, 0, sizeof m);
    CHECK_OK(mn_preset_find(name, &m));
    return m;
}

static uint64_t rand_in(uint64_t lo, uint64_t hi) { return lo + mnt_rand_u64() % (hi - lo + 1); }

// ---- bitsandbytes storage -----------------------------------------------------------------------

// The layout of quantize_4bit written out again: 4 bits a weight rounded up to whole bytes, one
// absmax per 64 weights (fp32, or uint8 + an fp32 per 256 of them + fp32 offset + the 256-entry
// fp32 map with double quantization), the 16-entry fp32 code. Ceilings in double (exact below
// 2^53), not the library's integer arithmetic.
static void want_4bit(uint64_t n, int dq, mn_quant_tensors *w) {
    double blocks = ceil((double)n / 64.0);
    memset(w, 0, sizeof *w);
    w->data = (uint64_t)ceil((double)n * 4.0 / 8.0);
    w->code = 16 * 4;
    if (dq) {
        w->absmax = (uint64_t)blocks;
        w->offset = 4;
        w->absmax2 = (uint64_t)ceil(blocks / 256.0) * 4;
        w->code2 = 256 * 4;
    } else {
        w->absmax = (uint64_t)blocks * 4;
    }
    w->total = w->data + w->absmax + w->code + w->offset + w->absmax2 + w->code2;
}

static void test_quant_storage(void) {
    static const mn_quant qs[] = {MN_QUANT_NF4, MN_QUANT_NF4_DQ, MN_QUANT_FP4, MN_QUANT_FP4_DQ};
    mn_quant_tensors got, want;
    int i, k;
    for (i = 0; i < 200; i++) {  // odd and even shapes, partial last blocks of both levels
        uint64_t rows = rand_in(1, 5000) | (i & 1), cols = rand_in(1, 5000) | (i & 2 ? 1 : 0);
        for (k = 0; k < 4; k++) {
            int dq = qs[k] == MN_QUANT_NF4_DQ || qs[k] == MN_QUANT_FP4_DQ;
            CHECK_OK(mn_quant_storage(qs[k], rows, cols, 0, &got));
            want_4bit(rows * cols, dq, &want);
            CHECK_EQ_U64(got.data, want.data);
            CHECK_EQ_U64(got.absmax, want.absmax);
            CHECK_EQ_U64(got.code, want.code);
            CHECK_EQ_U64(got.offset, want.offset);
            CHECK_EQ_U64(got.absmax2, want.absmax2);
            CHECK_EQ_U64(got.code2, want.code2);
            CHECK_EQ_U64(got.total, want.total);
            CHECK_EQ_INT(got.count, dq ? 6 : 3);
        }
        // 0.43.1 and 0.43.2 share one dynamic map for the second level
        CHECK_OK(mn_quant_storage(MN_QUANT_NF4_DQ, rows, cols, 4301, &got));
        CHECK_EQ_U64(got.code2, 0);
        CHECK_EQ_INT(got.count, 5);
        CHECK_OK(mn_quant_storage(MN_QUANT_INT8, rows, cols, 0, &got));
        CHECK_EQ_U64(got.total, rows * cols + rows * 4);  // CB int8 + SCB fp32 per row
    }
    // QLoRA (arXiv:2305.14314): double quantization cuts the constants from 0.5 to 0.127 bit
    CHECK_OK(mn_quant_storage(MN_QUANT_NF4, 4096, 4096, 0, &got));
    CHECK_NEAR((double)got.absmax * 8 / (4096.0 * 4096.0), 0.5, 0, 1e-12);
    CHECK_OK(mn_quant_storage(MN_QUANT_NF4_DQ, 4096, 4096, 0, &got));
    CHECK_NEAR((double)(got.absmax + got.absmax2) * 8 / (4096.0 * 4096.0), 0.127, 0.0005, 0);
    // bad input
    CHECK_ERR(mn_quant_storage(MN_QUANT_NONE, 4, 4, 0, &got), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_quant_storage(MN_QUANT_COUNT, 4, 4, 0, &got), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_quant_storage(MN_QUANT_NF4, 0, 4, 0, &got), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_quant_storage(MN_QUANT_NF4, 4, 4, 0, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_quant_storage(MN_QUANT_INT8, 1ull << 40, 1ull << 40, 0, &got), MN_ERR_OVERFLOW);
    CHECK_ERR(mn_quant_storage(MN_QUANT_INT8, 1ull << 62, 1, 0, &got), MN_ERR_OVERFLOW);
}

// Sum of mn_quant_storage over a Llama model's quantized linears (q, k, v, o, gate, up, down of
// every layer; the head when head is set) and the count of their weights.
static uint64_t llama_quant_bytes(const mn_model *m, mn_quant q, int head, uint64_t *numel) {
    uint64_t h = m->hidden, qw = m->heads * m->head_dim, kw = m->kv_heads * m->head_dim;
    uint64_t shape[8][2], total = 0, l;
    int i, n = 7;
    mn_quant_tensors t;
    shape[0][0] = qw, shape[0][1] = h;
    shape[1][0] = kw, shape[1][1] = h;
    shape[2][0] = kw, shape[2][1] = h;
    shape[3][0] = h, shape[3][1] = qw;
    shape[4][0] = m->ffn, shape[4][1] = h;
    shape[5][0] = m->ffn, shape[5][1] = h;
    shape[6][0] = h, shape[6][1] = m->ffn;
    *numel = 0;
    for (l = 0; l < m->layers; l++)
        for (i = 0; i < n; i++) {
            CHECK_OK(mn_quant_storage(q, shape[i][0], shape[i][1], 0, &t));
            total += t.total, *numel += shape[i][0] * shape[i][1];
        }
    if (head) {
        CHECK_OK(mn_quant_storage(q, m->vocab, h, 0, &t));
        total += t.total, *numel += m->vocab * h;
    }
    return total;
}

// Pure bf16 (every weight stored 16-bit, no autocast copies): weights = 2 B for each parameter
// not quantized + the bitsandbytes tensors of the quantized ones.
static void test_quant_weights(void) {
    static const mn_quant qs[] = {MN_QUANT_INT8, MN_QUANT_NF4, MN_QUANT_NF4_DQ, MN_QUANT_FP4,
                                  MN_QUANT_FP4_DQ};
    static const char *names[] = {"llama-2-7b", "mistral-7b", "llama-3-8b"};
    mn_model m;
    mn_setup s;
    mn_estimate_result r, rh;
    uint64_t numel, qb;
    int i;
    for (i = 0; i < 5; i++) {
        m = preset(names[mnt_rand_u64() % 3]);
        memset(&s, 0, sizeof s);
        s.precision = MN_PREC_BF16_PURE, s.lora_rank = (uint32_t)rand_in(1, 64);
        s.lora_targets = MN_LORA_ALL, s.seq = rand_in(16, 256), s.quant = qs[i];
        s.context = 1, s.capacity = 1ull << 50;
        CHECK_OK(mn_estimate(&m, &s, &r));
        qb = llama_quant_bytes(&r.model, qs[i], 0, &numel);
        CHECK_EQ_U64(r.weights, (r.params - numel) * 2 + qb);
        // the head quantized too (an untied head: these models have one)
        s.quant_head = 1;
        CHECK_OK(mn_estimate(&m, &s, &rh));
        qb = llama_quant_bytes(&r.model, qs[i], 1, &numel);
        CHECK_EQ_U64(rh.weights, (r.params - numel) * 2 + qb);
        CHECK(rh.weights < r.weights);
    }
}

// bitsandbytes < 0.43.2 keeps each 4-bit linear's input for backward. With LoRA on every
// projection the input is already kept by the adapter (lora_A saves it): nothing changes. With
// LoRA on q, v only, the down projection's input (tokens x ffn, 16-bit) is kept by no other op:
// at least that much more per layer, and at most the inputs of k, o, the MLP and down.
static void test_bnb_version(void) {
    mn_model m = preset("llama-2-7b");
    mn_setup s;
    mn_estimate_result a, b, c;
    uint64_t tok, lo, hi, d;
    memset(&s, 0, sizeof s);
    int amp = (int)(mnt_rand_u64() % 2);
    s.precision = amp ? MN_PREC_BF16 : MN_PREC_BF16_PURE, s.quant = MN_QUANT_NF4_DQ;
    s.lora_rank = 16;
    s.batch = rand_in(1, 4), s.seq = rand_in(64, 1024), s.capacity = 1ull << 50;
    tok = s.batch * s.seq;
    s.lora_targets = MN_LORA_ALL;
    s.torch_version = 110;  // the older stack: adapters in the base dtype share lora_A's input
    CHECK_OK(mn_estimate(&m, &s, &a));
    s.bnb_version = 4301;
    CHECK_OK(mn_estimate(&m, &s, &b));
    CHECK_EQ_U64(b.cat_peak[MN_CAT_ACTIVATIONS], a.cat_peak[MN_CAT_ACTIVATIONS]);
    // torch 2 with peft's fp32 adapters: lora_A keeps an fp32 cast, so the 16-bit input that
    // MatMul4Bit keeps is one more tensor per quantized linear
    s.torch_version = 0, s.bnb_version = 0;
    CHECK_OK(mn_estimate(&m, &s, &a));
    s.bnb_version = 4301;
    CHECK_OK(mn_estimate(&m, &s, &b));
    CHECK(b.cat_peak[MN_CAT_ACTIVATIONS] >= a.cat_peak[MN_CAT_ACTIVATIONS] +
                                                a.model.layers * tok * a.model.ffn * 2);
    s.lora_targets = MN_LORA_Q | MN_LORA_V;
    s.bnb_version = 4302;
    CHECK_OK(mn_estimate(&m, &s, &a));
    s.bnb_version = 0;
    CHECK_OK(mn_estimate(&m, &s, &c));
    // 0.43.2 keeps what today's release keeps (its storage differs by the shared map)
    CHECK_EQ_U64(c.cat_peak[MN_CAT_ACTIVATIONS], a.cat_peak[MN_CAT_ACTIVATIONS]);
    s.bnb_version = 4301;
    CHECK_OK(mn_estimate(&m, &s, &b));
    d = b.cat_peak[MN_CAT_ACTIVATIONS] - a.cat_peak[MN_CAT_ACTIVATIONS];
    lo = a.model.layers * tok * a.model.ffn * 2;
    // at most the input of every 4-bit linear: under torch 2 peft's fp32 adapters keep an fp32
    // cast, so q and v count too. Pure bf16: q, k, v share one input, gate and up another, then
    // o's and down's; under autocast bitsandbytes casts the fp32 stream per 4-bit linear
    // (x.to(compute_dtype)): q, k, v, gate and up each a copy, o's, and down's
    hi = a.model.layers * tok * (a.model.hidden * (amp ? 6 : 3) + a.model.ffn) * 2;
    CHECK_MSG(b.cat_peak[MN_CAT_ACTIVATIONS] > a.cat_peak[MN_CAT_ACTIVATIONS] && d >= lo && d <= hi,
              "extra kept %llu, want %llu..%llu", (unsigned long long)d, (unsigned long long)lo,
              (unsigned long long)hi);
    CHECK(b.peak_allocated > a.peak_allocated);
    // fp4 keeps the same; int8 (MatMul8bitLt keeps (CAt, subA, A)) keeps A in every version
    s.quant = MN_QUANT_FP4;
    CHECK_OK(mn_estimate(&m, &s, &c));
    CHECK(c.cat_peak[MN_CAT_ACTIVATIONS] == b.cat_peak[MN_CAT_ACTIVATIONS]);
    s.quant = MN_QUANT_INT8;
    CHECK_OK(mn_estimate(&m, &s, &c));
    CHECK(c.cat_peak[MN_CAT_ACTIVATIONS] == b.cat_peak[MN_CAT_ACTIVATIONS]);
    s.bnb_version = 0;
    CHECK_OK(mn_estimate(&m, &s, &c));
    CHECK(c.cat_peak[MN_CAT_ACTIVATIONS] == b.cat_peak[MN_CAT_ACTIVATIONS]);
}

static void test_quant_bad_input(void) {
    mn_model m = preset("gpt2");
    mn_setup s;
    mn_estimate_result r;
    mn_quant q;
    mnt_log lg;
    memset(&s, 0, sizeof s);
    memset(&lg, 0, sizeof lg);
    s.logger.log_fn = mnt_log_capture, s.logger.user_data = &lg;
    s.bnb_version = 4301;  // no quantization
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    CHECK(lg.errors == 1);
    s.quant = MN_QUANT_NF4, s.lora_rank = 8, s.bnb_version = 1000000;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    s.bnb_version = 0, s.quant_head = 1;  // gpt2's head is the embedding
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    s.quant = MN_QUANT_NONE, s.lora_rank = 0;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_INVALID_ARG);
    CHECK_OK(mn_quant_parse("nf4-dq", &q));
    CHECK(q == MN_QUANT_NF4_DQ);
    CHECK_OK(mn_quant_parse("fp4", &q));
    CHECK(q == MN_QUANT_FP4);
    CHECK_STR(mn_quant_name(MN_QUANT_FP4_DQ), "fp4-dq");
    CHECK_ERR(mn_quant_parse("nf3", &q), MN_ERR_NOT_FOUND);
}

// ---- the lengths file ---------------------------------------------------------------------------

static void test_seq_dist_parse(void) {
    enum { N = 40 };
    uint64_t want[N + 1];  // count by length 1..N, kept here from the lines written
    mnt_buf b = {NULL, 0, 0};
    mn_seq_dist d;
    char line[64];
    uint32_t i, k, lines = (uint32_t)rand_in(1, 300), distinct = 0;
    memset(want, 0, sizeof want);
    for (i = 0; i < lines; i++) {
        uint64_t len = rand_in(1, N), cnt = rand_in(1, 1000);
        switch (mnt_rand_u64() % 5) {
        case 0: snprintf(line, sizeof line, "%llu\n", (unsigned long long)len), cnt = 1; break;
        case 1: snprintf(line, sizeof line, "  %llu\t%llu  \r\n", (unsigned long long)len,
                         (unsigned long long)cnt); break;
        case 2: snprintf(line, sizeof line, "# comment %llu\n\n", (unsigned long long)len);
                cnt = 0; break;
        default: snprintf(line, sizeof line, "%llu %llu # note\n", (unsigned long long)len,
                          (unsigned long long)cnt);
        }
        want[len] += cnt;
        mnt_buf_str(&b, line);
    }
    mnt_buf_str(&b, "7");  // a last line without a newline
    want[7]++;
    CHECK_OK(mn_seq_dist_parse(b.p, b.n, NULL, NULL, &d));
    for (k = 1; k <= N; k++) distinct += want[k] != 0;
    CHECK_EQ_INT(d.n, distinct);
    for (i = 0, k = 1; k <= N; k++) {
        if (!want[k]) continue;
        CHECK_EQ_U64(d.len[i], k);
        CHECK_EQ_U64(d.count[i], want[k]);
        i++;
    }
    mn_seq_dist_free(NULL, &d);
    CHECK(d.len == NULL && d.n == 0);
    free(b.p);
}

// Bad files: one error, naming the line.
static void test_seq_dist_bad(void) {
    static const struct { const char *text; mn_result r; const char *line; } t[] = {
        {"12\n13\nx\n", MN_ERR_PARSE, "line 3:"},
        {"12 4 5\n", MN_ERR_PARSE, "line 1:"},
        {"# a\n\n-4\n", MN_ERR_PARSE, "line 3:"},
        {"1.5\n", MN_ERR_PARSE, "line 1:"},
        {"12 3x\n", MN_ERR_PARSE, "line 1:"},
        {"12\n0\n", MN_ERR_INVALID_ARG, "line 2:"},
        {"12\n67108865\n", MN_ERR_INVALID_ARG, "line 2:"},
        {"12 0\n", MN_ERR_INVALID_ARG, "line 1:"},
        {"1\n2\n3 1000000000001\n", MN_ERR_INVALID_ARG, "line 3:"},
        {"99999999999999999999\n", MN_ERR_PARSE, "line 1:"},
        {"# nothing\n\n", MN_ERR_INVALID_ARG, NULL},
        {"", MN_ERR_INVALID_ARG, NULL},
    };
    char longline[400];
    mn_seq_dist d;
    mn_logger lgr;
    mnt_log lg;
    size_t i;
    lgr.log_fn = mnt_log_capture, lgr.user_data = &lg;
    for (i = 0; i < sizeof t / sizeof t[0]; i++) {
        memset(&lg, 0, sizeof lg);
        CHECK_ERR(mn_seq_dist_parse(t[i].text, strlen(t[i].text), NULL, &lgr, &d), t[i].r);
        CHECK_MSG(lg.errors == 1 && (!t[i].line || strstr(lg.last, t[i].line)),
                  "case %u: %d errors, \"%s\"", (unsigned)i, lg.errors, lg.last);
        CHECK(d.len == NULL && d.n == 0);
    }
    memset(longline, '1', sizeof longline);  // a line of 300 bytes, then one with a NUL
    longline[0] = '5', longline[1] = '\n', longline[302] = '\n';
    memset(&lg, 0, sizeof lg);
    CHECK_ERR(mn_seq_dist_parse(longline, 303, NULL, &lgr, &d), MN_ERR_PARSE);
    CHECK(strstr(lg.last, "line 2:") != NULL);
    memset(&lg, 0, sizeof lg);
    CHECK_ERR(mn_seq_dist_parse("5\n6\0\n", 5, NULL, &lgr, &d), MN_ERR_PARSE);
    CHECK(strstr(lg.last, "line 2:") != NULL);
    memset(&lg, 0, sizeof lg);
    CHECK_ERR(mn_seq_dist_read_file("/nonexistent/lengths.txt", NULL, &lgr, &d), MN_ERR_NOT_FOUND);
    CHECK(lg.errors == 1);
    // MIN:MAX:MEAN
    CHECK_OK(mn_seq_dist_range("32:2048:400.5", NULL, &d));
    CHECK(d.n == 0 && d.min == 32 && d.max == 2048 && d.mean == 400.5);
    CHECK_ERR(mn_seq_dist_range("32:2048", NULL, &d), MN_ERR_PARSE);
    CHECK_ERR(mn_seq_dist_range("32:2048:x", NULL, &d), MN_ERR_PARSE);
    CHECK_ERR(mn_seq_dist_range("32:16:20", NULL, &d), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_seq_dist_range("32:64:20", NULL, &d), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_seq_dist_range("0:64:20", NULL, &d), MN_ERR_INVALID_ARG);
}

typedef struct parse_ctx { const char *text; } parse_ctx;

static mn_result parse_once(void *ctx) {
    const char *t = ((parse_ctx *)ctx)->text;
    mn_seq_dist d;
    mn_result r = mn_seq_dist_parse(t, strlen(t), NULL, NULL, &d);
    if (r == MN_OK) {
        CHECK(d.n == 3 && d.count[2] == 4);
        mn_seq_dist_free(NULL, &d);
    }
    return r;
}

// ---- the marked replay --------------------------------------------------------------------------

typedef struct mark_ctx {
    const mn_trace_event *ev;
    const uint64_t *marks;
    uint64_t prev_peak_start;  // allocated at the previous mark
    int calls;
} mark_ctx;

// At each mark the cache holds what a fresh replay of the prefix holds; the peak since the last
// mark is at most the prefix's peak (and equal to it at the first mark).
static mn_result check_mark(void *user, uint64_t k, mn_cache *c) {
    mark_ctx *x = (mark_ctx *)user;
    mn_sim_cache sc;
    mn_cache_statistics a, b;
    CHECK_EQ_U64(k, (uint64_t)x->calls);
    x->calls++;
    CHECK_OK(mn_cache_stats(c, &a));
    CHECK_OK(mn_sim_cache_init(&sc, NULL, NULL));
    CHECK_OK(mn_cache_replay(&sc.cache, x->ev, x->marks[k], 0, NULL));
    CHECK_OK(mn_cache_stats(&sc.cache, &b));
    CHECK_EQ_U64(a.allocated_bytes[MN_STAT_ALL].current, b.allocated_bytes[MN_STAT_ALL].current);
    CHECK_EQ_U64(a.reserved_bytes[MN_STAT_ALL].current, b.reserved_bytes[MN_STAT_ALL].current);
    if (k == 0)
        CHECK_EQ_U64(a.allocated_bytes[MN_STAT_ALL].peak, b.allocated_bytes[MN_STAT_ALL].peak);
    else
        CHECK(a.allocated_bytes[MN_STAT_ALL].peak <= b.allocated_bytes[MN_STAT_ALL].peak);
    mn_sim_cache_free(&sc);
    return MN_OK;
}

static void test_replay_marked(void) {
    enum { N = 600 };
    mn_trace_event ev[N];
    uint64_t live[N], nlive = 0, marks[6], i;
    mn_sim_cache sc, sc2;
    mn_cache_statistics a, b;
    mark_ctx x;
    int k;
    for (i = 0; i < N; i++) {  // random allocations and frees of live ids
        memset(&ev[i], 0, sizeof ev[i]);
        if (nlive && mnt_rand_u64() % 3 == 0) {
            uint64_t j = mnt_rand_u64() % nlive;
            ev[i].id = live[j], ev[i].alloc = 0;
            live[j] = live[--nlive];
        } else {
            ev[i].id = i + 1, ev[i].alloc = 1, ev[i].size = rand_in(1, 8u << 20);
            live[nlive++] = i + 1;
        }
    }
    for (k = 0; k < 6; k++) marks[k] = (uint64_t)k * N / 5;  // 0, ..., N
    memset(&x, 0, sizeof x);
    x.ev = ev, x.marks = marks;
    CHECK_OK(mn_sim_cache_init(&sc, NULL, NULL));
    CHECK_OK(mn_cache_replay_marked(&sc.cache, ev, N, marks, 6, check_mark, &x, NULL));
    CHECK_EQ_INT(x.calls, 6);
    CHECK_OK(mn_cache_stats(&sc.cache, &a));
    CHECK_OK(mn_sim_cache_init(&sc2, NULL, NULL));
    CHECK_OK(mn_cache_replay(&sc2.cache, ev, N, 0, NULL));
    CHECK_OK(mn_cache_stats(&sc2.cache, &b));
    CHECK_EQ_U64(a.reserved_bytes[MN_STAT_ALL].peak, b.reserved_bytes[MN_STAT_ALL].current);
    CHECK_EQ_U64(a.allocated_bytes[MN_STAT_ALL].current, b.allocated_bytes[MN_STAT_ALL].current);
    marks[2] = marks[1] - 1;  // not ascending
    CHECK_ERR(mn_cache_replay_marked(&sc2.cache, ev, N, marks, 6, check_mark, &x, NULL),
              MN_ERR_INVALID_ARG);
    marks[2] = N + 1;
    CHECK_ERR(mn_cache_replay_marked(&sc2.cache, ev, N, marks, 3, check_mark, &x, NULL),
              MN_ERR_INVALID_ARG);
    mn_sim_cache_free(&sc);
    mn_sim_cache_free(&sc2);
}

// ---- training over lengths ----------------------------------------------------------------------

static mn_setup small_setup(void) {
    mn_setup s;
    memset(&s, 0, sizeof s);
    s.batch = rand_in(1, 4), s.capacity = 1ull << 50;  // no capacity pressure: nothing released
    switch (mnt_rand_u64() % 3) {
    case 0: s.precision = MN_PREC_BF16; break;
    case 1: s.precision = MN_PREC_FP32, s.checkpointing = MN_CKPT_FULL; break;
    default: s.precision = MN_PREC_BF16_PURE, s.lora_rank = 8;
    }
    if (mnt_rand_u64() % 2) s.accum = rand_in(2, 4);
    if (mnt_rand_u64() % 2) s.torch_version = 200;
    return s;
}

// One length: two steps are exactly the plain estimate's two steps, so the answer is the plain
// estimate. More steps ask for the same bytes (peak_live), but the cache may go on fragmenting
// after the second step: reserved never less than the plain estimate's.
static void test_lengths_one(void) {
    static const char *names[] = {"gpt2", "llama-3.2-1b", "qwen2-0.5b", "bert-base-uncased"};
    int i;
    for (i = 0; i < 4; i++) {
        mn_model m = preset(names[i]);
        mn_setup s = small_setup();
        mn_seq_dist d;
        mn_lengths_desc desc;
        mn_lengths_result *l = (mn_lengths_result *)malloc(sizeof *l);
        mn_estimate_result r;
        uint64_t len = rand_in(8, 512), cnt = rand_in(1, 100);
        uint32_t k;
        memset(&d, 0, sizeof d);
        memset(&desc, 0, sizeof desc);
        d.len = &len, d.count = &cnt, d.n = 1;
        desc.dist = &d, desc.steps = 2, desc.seed = mnt_rand_u64();
        CHECK_OK(mn_estimate_lengths(&m, &s, &desc, l));
        s.seq = len;
        CHECK_OK(mn_estimate(&m, &s, &r));
        CHECK_EQ_U64(l->longest_len, len);
        CHECK_EQ_U64(l->peak_allocated, r.peak_allocated);
        CHECK_EQ_U64(l->reserved, r.peak_reserved);
        CHECK_EQ_U64(l->longest.peak_reserved, r.peak_reserved);
        desc.steps = (uint32_t)rand_in(3, 12);
        CHECK_OK(mn_estimate_lengths(&m, &s, &desc, l));
        CHECK(l->reserved >= r.peak_reserved && l->peak_allocated >= r.peak_allocated);
        for (k = 0; k < l->steps; k++) CHECK_EQ_U64(l->step_len[k], len);
        CHECK_EQ_INT(l->steps, desc.steps);
        CHECK_NEAR(l->mean_len, (double)len, 0, 0);
        s.no_replay = 1;
        CHECK_OK(mn_estimate(&m, &s, &r));
        CHECK_EQ_U64(l->peak_live, r.peak_allocated);
        free(l);
    }
}

// Several lengths: reserved never falls from step to step (no capacity pressure), the percentile
// is the nearest rank of the steps' values, the steps of the longest length peak where the plain
// estimate at that length does, and the same seed draws the same steps.
static void test_lengths_steps(void) {
    static const char *names[] = {"gpt2", "llama-3.2-1b", "qwen2-0.5b"};
    int i;
    for (i = 0; i < 6; i++) {
        mn_model m = preset(names[i % 3]);
        mn_setup s = small_setup();
        uint64_t len[8], cnt[8], sorted[MN_LENGTHS_MAX_STEPS], rank, t;
        mn_seq_dist d;
        mn_lengths_desc desc;
        mn_lengths_result *l = (mn_lengths_result *)malloc(sizeof *l * 2), *l2 = l + 1;
        mn_estimate_result r, r2;
        uint32_t k, j, n = (uint32_t)rand_in(2, 8), longest_seen = 0;
        memset(&d, 0, sizeof d);
        memset(&desc, 0, sizeof desc);
        for (k = 0; k < n; k++)
            len[k] = (k ? len[k - 1] : 0) + rand_in(1, 128), cnt[k] = rand_in(1, 50);
        if (i == 5) {  // MIN:MAX:MEAN
            d.min = len[0], d.max = len[n - 1];
            d.mean = (double)d.min + ((double)d.max - (double)d.min) * mnt_rand_uniform();
        } else {
            d.len = len, d.count = cnt, d.n = n;
        }
        desc.dist = &d, desc.steps = (uint32_t)rand_in(2, 40), desc.seed = mnt_rand_u64();
        desc.percentile = i % 2 ? 0 : 1 + 99 * mnt_rand_uniform();
        CHECK_OK(mn_estimate_lengths(&m, &s, &desc, l));
        CHECK_EQ_U64(l->longest_len, len[n - 1]);
        for (k = 0; k < l->steps; k++) {
            CHECK(k == 0 || l->step_reserved[k] >= l->step_reserved[k - 1]);
            CHECK(l->step_peak[k] <= l->step_reserved[k]);
            CHECK(l->step_len[k] >= len[0] && l->step_len[k] <= len[n - 1]);
            if (d.n) {
                for (j = 0; j < n && len[j] != l->step_len[k]; j++) continue;
                CHECK(j < n);  // a length of the histogram
            }
            longest_seen += k > 0 && l->step_len[k] == len[n - 1];
            sorted[k] = l->step_reserved[k];
        }
        CHECK(longest_seen > 0);
        CHECK_EQ_U64(l->reserved, l->step_reserved[l->steps - 1]);
        for (k = 1; k < l->steps; k++)  // insertion sort: the nearest rank by hand
            for (j = k; j > 0 && sorted[j - 1] > sorted[j]; j--)
                t = sorted[j], sorted[j] = sorted[j - 1], sorted[j - 1] = t;
        rank = (uint64_t)ceil((desc.percentile ? desc.percentile : 99.0) / 100.0 * l->steps);
        CHECK_EQ_U64(l->reserved_pct, sorted[(rank ? rank : 1) - 1]);
        s.seq = len[n - 1];
        CHECK_OK(mn_estimate(&m, &s, &r));
        // the cache's history changes which blocks are split (a remainder under 1 MiB stays
        // with its block and counts as allocated): close, not equal
        CHECK_NEAR(l->peak_allocated, r.peak_allocated, 0, 0.02);
        s.no_replay = 1;  // the bytes the tensors ask for: exactly the plain estimate's
        CHECK_OK(mn_estimate(&m, &s, &r2));
        CHECK_EQ_U64(l->peak_live, r2.peak_allocated);
        s.no_replay = 0;
        CHECK(l->reserved >= r.peak_allocated);
        CHECK_EQ_U64(l->device_used, r.context + l->reserved);
        CHECK_OK(mn_estimate_lengths(&m, &s, &desc, l2));  // setup->seq plays no part
        CHECK(memcmp(l->step_len, l2->step_len, sizeof l->step_len) == 0);
        CHECK(memcmp(l->step_reserved, l2->step_reserved, sizeof l->step_reserved) == 0);
        free(l);
    }
}

// The draws: the same seed, the same steps; a range's padded lengths average near its mean
// (batch 1, no accumulation: one draw a step; 256 draws, 6 standard errors).
static void test_lengths_draws(void) {
    mn_model m = preset("gpt2");
    mn_setup s;
    mn_seq_dist d;
    mn_lengths_desc desc;
    mn_lengths_result *l = (mn_lengths_result *)malloc(sizeof *l * 2);
    double mean = 0, sd;
    uint32_t k;
    memset(&s, 0, sizeof s);
    memset(&d, 0, sizeof d);
    memset(&desc, 0, sizeof desc);
    s.batch = 1, s.capacity = 1ull << 50, s.precision = MN_PREC_BF16;
    d.min = rand_in(1, 64), d.max = rand_in(512, 1024);
    d.mean = (double)d.min + (double)(d.max - d.min) * (0.05 + 0.9 * mnt_rand_uniform());
    desc.dist = &d, desc.steps = MN_LENGTHS_MAX_STEPS, desc.seed = mnt_rand_u64();
    CHECK_OK(mn_estimate_lengths(&m, &s, &desc, &l[0]));
    CHECK_OK(mn_estimate_lengths(&m, &s, &desc, &l[1]));
    CHECK(memcmp(l[0].step_len, l[1].step_len, sizeof l[0].step_len) == 0);
    CHECK(memcmp(l[0].step_reserved, l[1].step_reserved, sizeof l[0].step_reserved) == 0);
    for (k = 0; k + 1 < l[0].steps; k++)  // the last may be forced
        mean += (double)l[0].step_len[k];
    mean /= l[0].steps - 1;
    sd = (double)(d.max - d.min) / sqrt(12.0) * 2.0;  // generous: at most the range's spread
    CHECK_MSG(fabs(mean - d.mean) <= 6 * sd / sqrt((double)l[0].steps - 1),
              "mean padded length %.1f, want about %.1f", mean, d.mean);
    // a wider batch pads to the longer of more draws: its steps are never shorter on average
    s.batch = 8;
    CHECK_OK(mn_estimate_lengths(&m, &s, &desc, &l[1]));
    CHECK(l[1].mean_len >= l[0].mean_len);
    free(l);
}

// A device too small for the unlimited replay's cache: the replay at the device's size (PyTorch
// gives its cached blocks back and retries) is used when it refuses nothing, and then the reserved
// bytes stay within the device.
static void test_lengths_capacity(void) {
    mn_model m = preset("llama-3.2-1b");
    mn_setup s;
    mn_seq_dist d;
    mn_lengths_desc desc;
    mn_lengths_result *l = (mn_lengths_result *)malloc(sizeof *l * 2);
    uint32_t k;
    memset(&s, 0, sizeof s);
    memset(&d, 0, sizeof d);
    memset(&desc, 0, sizeof desc);
    s.precision = MN_PREC_BF16, s.lora_rank = 16, s.quant = MN_QUANT_NF4_DQ;
    s.lora_targets = MN_LORA_ALL, s.batch = rand_in(2, 8), s.capacity = 1ull << 50;
    d.min = 64, d.max = 2048, d.mean = (double)rand_in(200, 800);
    desc.dist = &d, desc.seed = mnt_rand_u64();
    CHECK_OK(mn_estimate_lengths(&m, &s, &desc, &l[0]));
    s.capacity = l[0].longest.context + (l[0].peak_allocated + l[0].reserved) / 2;
    CHECK_OK(mn_estimate_lengths(&m, &s, &desc, &l[1]));
    CHECK_EQ_U64(l[1].device_used, l[1].longest.context + l[1].reserved);
    CHECK(l[1].reserved >= l[1].peak_allocated && l[1].reserved_pct <= l[1].reserved);
    if (l[1].fits) {
        CHECK(l[1].reserved <= s.capacity - l[1].longest.context);
        CHECK(l[1].reserved < l[0].reserved);
    } else {  // the retry refused an allocation: the unlimited replay's numbers
        CHECK_EQ_U64(l[1].reserved, l[0].reserved);
    }
    for (k = 0; k < l[1].steps; k++) CHECK(l[1].step_reserved[k] <= l[1].reserved);
    free(l);
}

static void test_lengths_bad(void) {
    mn_model m = preset("gpt2");
    mn_setup s;
    mn_seq_dist d;
    mn_lengths_desc desc;
    mn_lengths_result *l = (mn_lengths_result *)malloc(sizeof *l);
    uint64_t len[2] = {64, 32}, cnt[2] = {1, 1};
    memset(&s, 0, sizeof s);
    memset(&desc, 0, sizeof desc);
    memset(&d, 0, sizeof d);
    d.min = 16, d.max = 512, d.mean = 100;
    desc.dist = &d, desc.steps = 1;
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_INVALID_ARG);
    desc.steps = MN_LENGTHS_MAX_STEPS + 1;
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_INVALID_ARG);
    desc.steps = 0, desc.percentile = 101;
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_INVALID_ARG);
    desc.percentile = -1;
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_INVALID_ARG);
    desc.percentile = 0, d.max = 4096;  // gpt2 has 1024 positions
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_INVALID_ARG);
    d.max = 512, d.mean = 600;
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_INVALID_ARG);
    d.mean = 100, s.infer = 1;
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_UNSUPPORTED);
    s.infer = 0;
    d.len = len, d.count = cnt, d.n = 2;  // not ascending
    CHECK_ERR(mn_estimate_lengths(&m, &s, &desc, l), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_estimate_lengths(&m, &s, NULL, l), MN_ERR_INVALID_ARG);
    free(l);
}

typedef struct lengths_ctx { mn_model m; mn_setup s; mn_lengths_desc desc; } lengths_ctx;

static mn_result lengths_once(void *ctx) {
    lengths_ctx *x = (lengths_ctx *)ctx;
    mn_lengths_result *l = (mn_lengths_result *)malloc(sizeof *l);
    mn_result r = mn_estimate_lengths(&x->m, &x->s, &x->desc, l);
    if (r == MN_OK) CHECK(l->reserved >= l->peak_allocated);
    free(l);
    return r;
}

static void test_lengths_alloc_failures(void) {
    parse_ctx p;
    lengths_ctx x;
    mn_seq_dist d;
    p.text = "5\n6 2\n# x\n9 4\n";
    CHECK(WALK_ALLOC_FAILURES(parse_once, &p, 100) > 0);
    memset(&x, 0, sizeof x);
    memset(&d, 0, sizeof d);
    x.m = preset("gpt2");
    x.m.layers = 2;
    x.s.capacity = 1ull << 50;
    d.min = 8, d.max = 64, d.mean = 20;
    x.desc.dist = &d, x.desc.steps = 3;
    CHECK(WALK_ALLOC_FAILURES(lengths_once, &x, 2000) > 0);
}

// ---- the CLI ------------------------------------------------------------------------------------

typedef struct cli_out {
    char out[65536], err[2048];
    int status;
} cli_out;

// Runs `memanat ARGS` (stderr through a temporary file). 0 when it could not be started.
static int cli(const char *args, cli_out *r) {
    return mnt_cli_run(args, r->out, sizeof r->out, r->err, sizeof r->err, &r->status);
}

static int one_line(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n == 1;
}

static void test_cli_flags(void) {
    static const char *bad[] = {
        "estimate --model gpt2 --seq-lengths %s",            // the bad file
        "estimate --model gpt2 --seq-lengths /nonexistent/lengths.txt",
        "estimate --model gpt2 --seq 128 --seq-lengths 32:512:100",
        "estimate --model gpt2 --seq-lengths 32:512:900",
        "estimate --model gpt2 --seq-lengths 32:512:100 --steps 1",
        "estimate --model gpt2 --seq-lengths 32:512:100 --percentile 0",
        "estimate --model gpt2 --seq-lengths 32:512:100 --infer",
        "estimate --model gpt2 --steps 4",
        "estimate --model llama-3.2-1b --quant nf4 --lora-rank 8 --bnb-version 0.43",
        "estimate --model llama-2-7b --quant nf4 --lora-rank 8 --quant-head maybe",
        "estimate --model gpt2 --quant nf4 --lora-rank 8 --quant-head yes",  // tied head
        "estimate --model gpt2 --bnb-version 0.43.1",                         // no --quant
        "estimate --model gpt2 --quant nf5 --lora-rank 8",
    };
    char path[] = "/tmp/memanat_len_XXXXXX", args[512];
    mn_json_doc doc;
    const mn_json_value *o, *v;
    cli_out *r = (cli_out *)malloc(sizeof *r);
    double a0 = 0, a1 = 0;
    size_t i;
    int fd;
    FILE *f;
    if (access(mnt_cli_path(), X_OK) != 0) { free(r); SKIP("./memanat not built"); }
    fd = mkstemp(path);
    CHECK(fd >= 0);
    f = fdopen(fd, "w");
    fputs("# lengths\n128 40\n256\n-3\n", f);  // line 4 is wrong
    fclose(f);
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(args, sizeof args, bad[i], path);
        CHECK(cli(args, r));
        CHECK_MSG(r->status == 2 && one_line(r->err) && r->out[0] == 0, "%s: status %d, \"%s\"",
                  args, r->status, r->err);
        if (i == 0) CHECK(strstr(r->err, "line 4") != NULL);
    }
    // a good file, JSON out
    f = fopen(path, "w");
    fputs("# lengths\n128 40\n256\n64 7\n", f);
    fclose(f);
    snprintf(args, sizeof args, "estimate --model gpt2 --batch 2 --seq-lengths %s --steps 9 "
             "--seed 7 --percentile 50 --json", path);
    CHECK(cli(args, r));
    CHECK_EQ_INT(r->status, 0);
    CHECK_OK(mn_json_parse(r->out, strlen(r->out), NULL, &doc));
    o = doc.root ? mn_json_get(doc.root, "seq_lengths") : NULL;
    CHECK(o != NULL && o->type == MN_JSON_OBJECT);
    if (o) {
        v = mn_json_get(doc.root, "seq");
        CHECK(v && v->num == 256);  // the plain estimate's fields: the longest length
        v = mn_json_get(o, "longest");
        CHECK(v && v->num == 256);
        v = mn_json_get(o, "step_reserved");
        CHECK(v && v->type == MN_JSON_ARRAY && v->len == 9);
        v = mn_json_get(o, "percentile");
        CHECK(v && v->num == 50);
        CHECK(mn_json_get(o, "reserved") && mn_json_get(o, "peak_allocated") &&
              mn_json_get(o, "reserved_percentile") && mn_json_get(o, "fits"));
        CHECK(mn_json_get(o, "reserved")->num >= mn_json_get(o, "reserved_percentile")->num);
    }
    mn_json_free(&doc);
    remove(path);
    // MIN:MAX:MEAN, the table
    CHECK(cli("estimate --model gpt2 --seq-lengths 32:1024:200", r));
    CHECK(r->status == 0 && strstr(r->out, "sequence lengths: 32 steps") &&
          strstr(r->out, "reserved p99"));
    // the quantization flags
    CHECK(cli("estimate --model llama-3.2-1b --quant fp4-dq --lora-rank 8 --json", r));
    CHECK(r->status == 0 && strstr(r->out, "\"quant\": \"fp4-dq\""));
    CHECK(cli("estimate --model llama-2-7b --quant nf4 --lora-rank 8 --seq 256 --json", r));
    CHECK(r->status == 0);
    CHECK(mn_json_parse(r->out, strlen(r->out), NULL, &doc) == MN_OK && doc.root);
    if (doc.root && (v = mn_json_get(doc.root, "activations")) != NULL) a0 = v->num;
    mn_json_free(&doc);
    CHECK(cli("estimate --model llama-2-7b --quant nf4 --lora-rank 8 --seq 256 --bnb-version "
              "0.43.1 --quant-head yes --json", r));
    CHECK(r->status == 0);
    CHECK(mn_json_parse(r->out, strlen(r->out), NULL, &doc) == MN_OK && doc.root);
    if (doc.root && (v = mn_json_get(doc.root, "activations")) != NULL) a1 = v->num;
    mn_json_free(&doc);
    CHECK(a1 > a0 && a0 > 0);
    CHECK(cli("estimate --help", r));
    CHECK(r->status == 0 && strstr(r->out, "--seq-lengths") && strstr(r->out, "nf4-dq") &&
          strstr(r->out, "--bnb-version") && strstr(r->out, "--quant-head") &&
          strstr(r->out, "--percentile"));
    free(r);
}

const mnt_case test_quantseq_cases[] = {
    {"quant_storage", test_quant_storage},
    {"quant_weights", test_quant_weights},
    {"bnb_version", test_bnb_version},
    {"quant_bad_input", test_quant_bad_input},
    {"seq_dist_parse", test_seq_dist_parse},
    {"seq_dist_bad", test_seq_dist_bad},
    {"replay_marked", test_replay_marked},
    {"lengths_one", test_lengths_one},
    {"lengths_steps", test_lengths_steps},
    {"lengths_draws", test_lengths_draws},
    {"lengths_capacity", test_lengths_capacity},
    {"lengths_bad", test_lengths_bad},
    {"lengths_alloc_failures", test_lengths_alloc_failures},
    {"cli_flags", test_cli_flags},
};
const size_t test_quantseq_count = sizeof test_quantseq_cases / sizeof test_quantseq_cases[0];
