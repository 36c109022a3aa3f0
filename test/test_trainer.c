// Tests of trainer.c, included whole (TRAINER_TESTING leaves out its main and the header's
// implementation, which test/main.c provides): gradients against finite differences, gradient
// accumulation, checkpointing, learning the Markov source, the memory accounting, every
// optimizer, the memory history files, bad flags.
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "harness.h"
#include "../memanat.h"

#define TRAINER_TESTING
#include "../trainer.c"

// ---- helpers ------------------------------------------------------------------------------------

// The tiny model of these tests: L=2, C=32, NH=2, T=16, B=2, K=1.
static tr_config tt_config(void) {
    tr_config c;
    tr_config_default(&c);
    c.L = 2, c.C = 32, c.NH = 2, c.T = 16, c.B = 2, c.K = 1;
    c.steps = 1;
    c.seed = mnt_rand_u64();
    return c;
}

static uint64_t tt_numel(const tr_model *m, int i) { return m->dims[i][0] * m->dims[i][1]; }

// max over the parameter tensors of max|a - b| / max|a| (0 for an all-zero tensor pair).
static double tt_grad_rel_diff(tr_model *a, tr_model *b) {
    float **ga[TR_NUM_PARAMS], **gb[TR_NUM_PARAMS];
    double worst = 0.0;
    int i;
    tr_param_slots(&a->grads, ga);
    tr_param_slots(&b->grads, gb);
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        double dmax = 0.0, amax = 0.0;
        uint64_t k;
        for (k = 0; k < tt_numel(a, i); k++) {
            double x = (*ga[i])[k], y = (*gb[i])[k];
            if (fabs(x - y) > dmax || x != x || y != y) dmax = x == x && y == y ? fabs(x - y) : 1e9;
            if (fabs(x) > amax) amax = fabs(x);
        }
        if (amax > 0.0 && dmax / amax > worst) worst = dmax / amax;
        if (amax == 0.0 && dmax > 0.0) worst = 1e9;
    }
    return worst;
}

// The bytes of the file at path (malloc'ed, *len bytes), or NULL.
static char *tt_read_all(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    char *bytes = NULL;
    if (f && fseek(f, 0, SEEK_END) == 0 && (*len = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (bytes = (char *)malloc((size_t)*len)) && fread(bytes, 1, (size_t)*len, f) != (size_t)*len)
        free(bytes), bytes = NULL;
    if (f) fclose(f);
    return bytes;
}

static uint64_t tt_peak(tr_model *m, mn_category cat) {
    struct mn_cache_stats st;
    CHECK_OK(mn_cache_stats(&m->cache, &st));
    return st.cat_allocated_bytes[cat].peak;
}

static uint64_t tt_current(tr_model *m, mn_category cat) {
    struct mn_cache_stats st;
    CHECK_OK(mn_cache_stats(&m->cache, &st));
    return st.cat_allocated_bytes[cat].current;
}

// ---- 1. gradients against finite differences ----------------------------------------------------
// The analytic gradient of the mean loss on one fixed batch against central differences
// (L(w + h) - L(w - h)) / 2h, h the perturbation really applied to the fp32 weight, the loss
// summed in double, h = 5e-3. Tolerance: |analytic - fd| <= 6e-5 + 3e-3 * max|fd| over the kind
// + 5e-2 * |fd|: the fp32 loss's rounding divided by 2h leaves up to about 3e-5 of noise in fd
// (a k-bias gradient is exactly 0), and h^2 times the third derivative up to a few percent of
// an embedding row used several times. 300 runs stayed inside; a wrong term is far outside.
static void test_gradients_finite_differences(void) {
    static const int kinds[] = {TR_P_wte, TR_P_wpe, TR_P_ln1w, TR_P_ln1b, TR_P_qkvw,
                                TR_P_qkvb, TR_P_attprojw, TR_P_ln2w, TR_P_fcw, TR_P_fcb,
                                TR_P_fcprojw, TR_P_lnfw, TR_P_lnfb};
    tr_config cfg = tt_config();
    tr_model m;
    float **ps[TR_NUM_PARAMS], **gs[TR_NUM_PARAMS];
    double loss, worst = 0.0;
    long live = mnt_live_allocs();
    size_t q;
    int j;
    CHECK_OK(tr_model_init(&m, &cfg));
    tr_param_slots(&m.params, ps);
    tr_param_slots(&m.grads, gs);
    // larger weights than the init, so every kind has gradients well above the loss's rounding
    for (q = 0; q < TR_NUM_PARAMS; q++) {
        uint64_t k;
        for (k = 0; k < tt_numel(&m, (int)q); k++)
            (*ps[q])[k] += (float)(0.3 * mnt_rand_normal());
    }
    tr_markov_batch(&m.data, m.tokens, m.targets, cfg.B, cfg.T);
    tr_zero_grad(&m);
    CHECK_OK(tr_forward(&m, &loss));
    CHECK_OK(tr_backward(&m, 1.0f / (float)(cfg.B * cfg.T)));
    for (q = 0; q < sizeof kinds / sizeof kinds[0]; q++) {
        int i = kinds[q];
        float *w = *ps[i], *g = *gs[i];
        float an[6];
        double fd[6], fmax = 0.0;
        for (j = 0; j < 6; j++) {
            uint64_t k = mnt_rand_u64() % tt_numel(&m, i);
            if (i == TR_P_wte)  // a row of a token in the batch: the embedding's gradient too
                k = (uint64_t)m.tokens[mnt_rand_u64() % (cfg.B * cfg.T)] * cfg.C + k % cfg.C;
            float w0 = w[k], wp = w0 + 5e-3f, wm = w0 - 5e-3f;
            double lp, lm;
            w[k] = wp;
            CHECK_OK(tr_forward(&m, &lp));
            CHECK_OK(tr_release_activations(&m));
            w[k] = wm;
            CHECK_OK(tr_forward(&m, &lm));
            CHECK_OK(tr_release_activations(&m));
            w[k] = w0;
            fd[j] = (lp - lm) / ((double)wp - (double)wm);
            an[j] = g[k];
            if (fabs(fd[j]) > fmax) fmax = fabs(fd[j]);
        }
        CHECK_MSG(fmax > 1e-5, "%s: gradients too small to test (%g)", tr_param_names[i], fmax);
        CHECK_CLOSE(tr_param_names[i], an, fd, 6, 6e-5 + 3e-3 * fmax, 5e-2);
        for (j = 0; j < 6; j++)
            if (fabs(an[j] - fd[j]) / (6e-5 + fmax) > worst)
                worst = fabs(an[j] - fd[j]) / (6e-5 + fmax);
    }
    if (mnt_verbose())
        printf("    finite differences: max |analytic - fd| / (6e-5 + max|fd|) = %.2e\n", worst);
    CHECK_OK(tr_model_free(&m));
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// ---- 2. gradient accumulation -------------------------------------------------------------------
// K = 4 micro-batches of B = 1 see the same tokens as one batch of B = 4 (the data stream is the
// same, drawn in the same order) and must give the same gradients up to fp32 rounding, with
// about a quarter of the activation memory.
static void test_accumulation(void) {
    tr_config ca = tt_config(), cb;
    tr_model a, b;
    double la, lb, diff;
    uint64_t pa, pb;
    ca.B = 4, ca.K = 1;
    cb = ca;
    cb.B = 1, cb.K = 4;
    CHECK_OK(tr_model_init(&a, &ca));
    CHECK_OK(tr_model_init(&b, &cb));
    CHECK_OK(tr_accumulate(&a, &la));
    CHECK_OK(tr_accumulate(&b, &lb));
    diff = tt_grad_rel_diff(&a, &b);
    pa = tt_peak(&a, MN_CAT_ACTIVATIONS), pb = tt_peak(&b, MN_CAT_ACTIVATIONS);
    if (mnt_verbose())
        printf("    accumulation: max rel grad diff %.2e, loss %.7f vs %.7f, activation peak "
               "B=4: %llu B, B=1 K=4: %llu B (%.3f)\n", diff, la, lb, (unsigned long long)pa,
               (unsigned long long)pb, (double)pb / (double)pa);
    CHECK_MSG(diff < 1e-5, "accumulated gradients differ: max rel diff %g", diff);
    CHECK_NEAR(lb, la, 1e-6, 0);
    CHECK_MSG(pb * 3 < pa, "activation peak with B=1 K=4 %llu B, with B=4 %llu B",
              (unsigned long long)pb, (unsigned long long)pa);
    CHECK_OK(tr_model_free(&a));
    CHECK_OK(tr_model_free(&b));
}

// ---- 3. checkpointing ---------------------------------------------------------------------------
// Recomputing each block in backward (full), or only the attention probabilities (selective),
// gives the same gradients bit for bit, with a lower activation peak.
static void test_checkpointing(void) {
    static const int modes[] = {TR_CKPT_SELECTIVE, TR_CKPT_FULL};
    tr_config cn = tt_config(), cf;
    tr_model n, f;
    float **gn[TR_NUM_PARAMS], **gf[TR_NUM_PARAMS];
    double ln, lf;
    uint64_t pn, pf;
    size_t q;
    int i;
    cn.L = 3;
    CHECK_OK(tr_model_init(&n, &cn));
    CHECK_OK(tr_accumulate(&n, &ln));
    tr_param_slots(&n.grads, gn);
    pn = tt_peak(&n, MN_CAT_ACTIVATIONS);
    for (q = 0; q < 2; q++) {
        cf = cn;
        cf.checkpointing = modes[q];
        CHECK_OK(tr_model_init(&f, &cf));
        CHECK_OK(tr_accumulate(&f, &lf));
        tr_param_slots(&f.grads, gf);
        for (i = 0; i < TR_NUM_PARAMS; i++)
            CHECK_MSG(!tt_numel(&n, i) ||
                      memcmp(*gn[i], *gf[i], (size_t)tt_numel(&n, i) * sizeof(float)) == 0,
                      "gradient of %s differs with checkpointing %s", tr_param_names[i],
                      tr_ckpt_names[modes[q]]);
        CHECK(ln == lf);
        pf = tt_peak(&f, MN_CAT_ACTIVATIONS);
        if (mnt_verbose())
            printf("    checkpointing: activation peak none %llu B, %s %llu B\n",
                   (unsigned long long)pn, tr_ckpt_names[modes[q]], (unsigned long long)pf);
        CHECK_MSG(pf < pn, "activation peak with checkpointing %s %llu B, without %llu B",
                  tr_ckpt_names[modes[q]], (unsigned long long)pf, (unsigned long long)pn);
        CHECK_EQ_U64(tt_current(&f, MN_CAT_ACTIVATIONS), 0);
        CHECK_OK(tr_model_free(&f));
    }
    CHECK_OK(tr_model_free(&n));
}

// ---- 4. learning --------------------------------------------------------------------------------
// A tiny model learns the Markov source: after 300 steps of 256 tokens the mean loss of the last
// 10 steps is within 0.4 nats of the entropy rate H (it starts near ln 256 = 5.55, about 4.4 nats
// above; runs of this setting end 0.18 to 0.25 nats above H).
static void test_learning(void) {
    tr_config cfg = tt_config();
    tr_result res;
    cfg.T = 32, cfg.B = 8, cfg.steps = 300, cfg.lr = 2e-2f;
    CHECK_OK(tr_run(&cfg, NULL, &res));
    if (mnt_verbose())
        printf("    learning: H %.4f, first loss %.4f, last loss %.4f (+%.4f), %.2f s\n",
               res.entropy, res.first_loss, res.last_loss, res.last_loss - res.entropy,
               res.seconds);
    CHECK(res.entropy > 0.5 && res.entropy < 1.4);  // 4 successors: at most ln 4 = 1.386
    CHECK_NEAR(res.first_loss, log(256.0), 0.1, 0);
    CHECK_MSG(res.last_loss < res.entropy + 0.4, "loss %.4f after %ld steps, H %.4f",
              res.last_loss, cfg.steps, res.entropy);
    CHECK(res.last_loss > res.entropy - 0.1);  // no better than the source allows
    CHECK_EQ_U64(res.stats.cat_allocated_bytes[MN_CAT_ACTIVATIONS].current, 0);
    CHECK_EQ_U64(res.stats.cat_allocated_bytes[MN_CAT_TEMPORARY].current, 0);
}

// The entropy rate against an independent estimate: the empirical mean of -ln P(next | byte)
// over a long stream.
static void test_markov_entropy(void) {
    tr_markov mk;
    double sum = 0.0, psum = 0.0;
    long n, count = 200000;
    int i, j;
    tr_markov_init(&mk, mnt_rand_u64());
    for (i = 0; i < TR_V; i++) psum += mk.pi[i];
    CHECK_NEAR(psum, 1.0, 1e-12, 0);
    for (n = 0; n < count; n++) {
        int prev = mk.state, next = tr_markov_next(&mk);
        for (j = 0; j < TR_SUCC; j++)
            if (mk.next[prev][j] == next) break;
        CHECK(j < TR_SUCC);
        if (j == TR_SUCC) return;
        sum -= log(mk.prob[prev][j]);
    }
    CHECK_NEAR(sum / (double)count, mk.entropy, 0.02, 0);
}

// ---- 5. memory accounting -----------------------------------------------------------------------
static void test_memory_accounting(void) {
    tr_config cfg = tt_config();
    tr_model m;
    uint64_t weights = 0, optim = 0, bytes;
    double loss;
    float norm;
    long live = mnt_live_allocs();
    int i, skipped;
    cfg.K = 2;
    CHECK_OK(tr_model_init(&m, &cfg));
    for (i = 0; i < TR_NUM_PARAMS; i++) {
        if (!tt_numel(&m, i)) continue;  // the head is tied
        weights += mn_cache_round_size(NULL, 4 * tt_numel(&m, i));
        CHECK_OK(mn_adamw_state_bytes(m.dims[i], 2, &bytes));
        optim += mn_cache_round_size(NULL, bytes);
    }
    CHECK_EQ_U64(tt_current(&m, MN_CAT_WEIGHTS), weights);
    CHECK_EQ_U64(tt_current(&m, MN_CAT_GRADIENTS), weights);
    CHECK_EQ_U64(tt_current(&m, MN_CAT_OPTIMIZER), 0);
    CHECK_OK(tr_accumulate(&m, &loss));
    CHECK_OK(tr_update(&m, 1e-3f, &norm, &skipped));
    CHECK(norm > 0.0f && norm == norm);
    CHECK_EQ_U64(tt_current(&m, MN_CAT_OPTIMIZER), optim);
    CHECK_EQ_U64(tt_current(&m, MN_CAT_ACTIVATIONS), 0);
    CHECK_EQ_U64(tt_current(&m, MN_CAT_TEMPORARY), 0);
    CHECK(tt_peak(&m, MN_CAT_ACTIVATIONS) > 0);
    CHECK(tt_peak(&m, MN_CAT_TEMPORARY) > 0);
    CHECK_OK(tr_accumulate(&m, &loss));  // a second step: no more optimizer state
    CHECK_OK(tr_update(&m, 1e-3f, &norm, &skipped));
    CHECK_EQ_U64(tt_current(&m, MN_CAT_OPTIMIZER), optim);
    CHECK_EQ_U64(tt_current(&m, MN_CAT_WEIGHTS), weights);
    CHECK_OK(mn_cache_check(&m.cache));
    CHECK_OK(tr_model_free(&m));
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// Every host allocation of a short run made to fail in turn (the device's segments come from
// the host, so this also walks the device running out): the run returns an out-of-memory
// result, frees everything, and leaves the host allocations where they were.
static void test_allocation_failures(void) {
    tr_config cfg = tt_config();
    tr_result res;
    long n, live = mnt_live_allocs();
    mn_result r = MN_ERR_OUT_OF_MEMORY;
    cfg.L = 1, cfg.T = 8, cfg.steps = 2, cfg.checkpointing = TR_CKPT_FULL;
    for (n = 1; n <= 5000 && r != MN_OK; n++) {
        mnt_fail_alloc_after(n);
        r = tr_run(&cfg, NULL, &res);
        mnt_fail_alloc_after(0);
        CHECK_MSG(r == MN_OK || r == MN_ERR_OUT_OF_MEMORY || r == MN_ERR_DEVICE_OOM,
                  "allocation %ld failing gave %s", n, mn_result_str(r));
        CHECK_EQ_INT(mnt_live_allocs(), live);
        if (mnt_failed()) return;
    }
    CHECK_OK(r);
    if (mnt_verbose()) printf("    allocation failures: the run succeeds at attempt %ld\n", n - 1);
}

// --data FILE: a short repeating text is learned (runs end at 0.1 to 0.2 nats; the text's byte
// frequencies alone give 3.05); a missing file and one shorter than a window fail with
// their result and a message, leaving nothing allocated.
static void test_data_file(void) {
    static const char text[] = "the quick brown fox jumps over the lazy dog. ";
    char path[] = "/tmp/memanat_trainer_XXXXXX";
    tr_config cfg = tt_config();
    tr_result res;
    long live = mnt_live_allocs();
    int i, fd = mkstemp(path);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    CHECK(f != NULL);
    if (!f) return;
    for (i = 0; i < 40; i++) fputs(text, f);
    fclose(f);
    cfg.data = path, cfg.T = 8, cfg.B = 8, cfg.steps = 200, cfg.lr = 2e-2f;
    CHECK_OK(tr_run(&cfg, NULL, &res));
    if (mnt_verbose())
        printf("    data file: first loss %.4f, last loss %.4f\n", res.first_loss, res.last_loss);
    CHECK_NEAR(res.first_loss, log(256.0), 0.2, 0);
    CHECK_MSG(res.last_loss < 1.0, "loss %.4f on a repeating text", res.last_loss);
    CHECK_EQ_INT(res.error[0], 0);
    cfg.T = 40 * (sizeof text - 1);  // one byte short of a window
    CHECK_ERR(tr_run(&cfg, NULL, &res), MN_ERR_INVALID_ARG);
    CHECK(strstr(res.error, "--data") != NULL);
    remove(path);
    cfg.T = 8;
    CHECK_ERR(tr_run(&cfg, NULL, &res), MN_ERR_IO);
    CHECK(strstr(res.error, path) != NULL);
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// Every optimizer of --optim, 40 steps of the tiny model with T = 32, B = 8: the loss stays
// finite and falls by more than 0.1 nats (runs fall 0.3 to 2.3; the first step's loss is about
// ln 256 = 5.55), and after the first step the cache holds exactly the
// state the optimizer reports, each non-empty block rounded as the cache rounds it, which is
// also the estimator's mn_optim_state_bytes for the same descriptor (plain SGD: nothing
// allocated). SGD gets a larger step (lr 1): at 1e-2 it barely moves in 40 steps.
static void test_optimizers(void) {
    static const mn_optim kinds[] = {MN_OPTIM_ADAMW, MN_OPTIM_ADAMW_8BIT, MN_OPTIM_SGD,
                                     MN_OPTIM_SGD_MOMENTUM, MN_OPTIM_ADAFACTOR, MN_OPTIM_LION};
    long live = mnt_live_allocs();
    size_t q;
    for (q = 0; q < sizeof kinds / sizeof kinds[0]; q++) {
        tr_config cfg = tt_config();
        tr_model m;
        mn_optim_desc d;
        uint64_t rounded = 0, held, predicted, bytes;
        double loss, first = 0.0, tail = 0.0;
        float norm;
        long s;
        int i, skipped;
        cfg.optim = kinds[q], cfg.steps = 40, cfg.T = 32, cfg.B = 8;
        if (kinds[q] == MN_OPTIM_SGD || kinds[q] == MN_OPTIM_SGD_MOMENTUM) cfg.lr = 1.0f;
        d = tr_optim_desc(&cfg);
        CHECK_OK(tr_model_init(&m, &cfg));
        for (s = 0; s < cfg.steps; s++) {
            CHECK_OK(tr_accumulate(&m, &loss));
            CHECK_OK(tr_update(&m, tr_lr(&cfg, s), &norm, &skipped));
            CHECK_MSG(isfinite(loss), "%s: loss %g at step %ld", mn_optim_name(kinds[q]), loss, s);
            if (s == 0) {
                struct mn_cache_stats st;
                for (i = 0; i < TR_NUM_PARAMS; i++) {
                    if (!tt_numel(&m, i)) continue;  // the head is tied
                    CHECK_OK(mn_optim_state_bytes(&d, m.dims[i], 2, &bytes));
                    CHECK_EQ_U64(tr_optim_state_bytes(&m, i), bytes);
                    if (bytes > 0) rounded += mn_cache_round_size(NULL, bytes);
                }
                CHECK_EQ_U64(tt_current(&m, MN_CAT_OPTIMIZER), rounded);
                CHECK_OK(mn_cache_stats(&m.cache, &st));
                if (kinds[q] == MN_OPTIM_SGD) {
                    CHECK_EQ_U64(rounded, 0);
                    CHECK_EQ_U64(st.cat_allocated_bytes[MN_CAT_OPTIMIZER].allocated, 0);
                } else {
                    CHECK(rounded > 0);
                }
                first = loss;
            }
            if (s >= cfg.steps - 5) tail += loss / 5.0;
        }
        CHECK_OK(tr_optim_bytes(&m, &held, &predicted));
        CHECK_EQ_U64(held, predicted);
        CHECK_EQ_U64(tt_current(&m, MN_CAT_OPTIMIZER), rounded);
        if (mnt_verbose())
            printf("    %-12s first loss %.4f, last 5 %.4f, state %llu B (cache %llu B)\n",
                   mn_optim_name(kinds[q]), first, tail, (unsigned long long)held,
                   (unsigned long long)rounded);
        CHECK_MSG(isfinite(tail) && tail < first - 0.1, "%s: loss %.4f -> %.4f",
                  mn_optim_name(kinds[q]), first, tail);
        CHECK_OK(mn_cache_check(&m.cache));
        CHECK_OK(tr_model_free(&m));
    }
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// ---- 6. memory history files --------------------------------------------------------------------

// The first cap - 1 bytes of path into buf ("" when it cannot be read); the byte count.
static size_t tt_read_file(const char *path, char *buf, size_t cap) {
    long len = 0;
    char *all = tt_read_all(path, &len);
    size_t n = all ? ((size_t)len < cap - 1 ? (size_t)len : cap - 1) : 0;
    if (n) memcpy(buf, all, n);
    buf[n] = '\0';
    free(all);
    return n;
}

static int tt_exists(const char *path) { return access(path, F_OK) == 0; }

static mn_result tt_body_fail(void *s, FILE *f) {
    (void)s;
    fputs("partial", f);
    return MN_ERR_IO;
}
static mn_result tt_body_new(void *s, FILE *f) {
    (void)s;
    return fputs("new", f) < 0 ? MN_ERR_IO : MN_OK;
}

// --memory-svg and --snapshot write an SVG and a snapshot JSON; a file in a directory that does
// not exist fails with MN_ERR_IO naming it, leaving no temporary; a failing writer leaves an
// earlier file as it was and no temporary.
static void test_memory_files(void) {
    static char buf[1 << 16];
    char dir[] = "/tmp/memanat_trainer_XXXXXX", svg[96], json[96], tmp[128], bad[112];
    tr_config cfg = tt_config();
    tr_result res;
    mn_cache_snapshot snap;
    char err[160];
    long live = mnt_live_allocs();
    FILE *f;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(svg, sizeof svg, "%s/memory.svg", dir);
    snprintf(json, sizeof json, "%s/snapshot.json", dir);
    cfg.steps = 3, cfg.memory_svg = svg, cfg.snapshot = json;
    CHECK_OK(tr_run(&cfg, NULL, &res));
    tt_read_file(svg, buf, sizeof buf);
    CHECK(strncmp(buf, "<svg", 4) == 0);
    tt_read_file(json, buf, sizeof buf);
    CHECK(buf[0] == '{' && strstr(buf, "\"segments\"") != NULL);
    CHECK(strstr(buf, "\"device_traces\"") != NULL);
    snprintf(tmp, sizeof tmp, "%s.tmp", svg);
    CHECK(!tt_exists(tmp));
    // a directory that does not exist
    snprintf(bad, sizeof bad, "%s/missing/memory.svg", dir);
    cfg.memory_svg = bad, cfg.snapshot = NULL;
    CHECK_ERR(tr_run(&cfg, NULL, &res), MN_ERR_IO);
    CHECK(strstr(res.error, bad) != NULL);
    snprintf(tmp, sizeof tmp, "%s.tmp", bad);
    CHECK(!tt_exists(tmp) && !tt_exists(bad));
    // a failing writer: the earlier file survives, no temporary is left
    memset(&snap, 0, sizeof snap);
    f = fopen(json, "wb");
    CHECK(f != NULL);
    if (f) fputs("old", f), fclose(f);
    snprintf(tmp, sizeof tmp, "%s.tmp", json);
    CHECK_ERR(tr_write_file("--snapshot", json, tt_body_fail, &snap, err, sizeof err), MN_ERR_IO);
    CHECK(strstr(err, json) != NULL);
    tt_read_file(json, buf, sizeof buf);
    CHECK_STR(buf, "old");
    CHECK(!tt_exists(tmp));
    CHECK_OK(tr_write_file("--snapshot", json, tt_body_new, &snap, err, sizeof err));
    tt_read_file(json, buf, sizeof buf);
    CHECK_STR(buf, "new");
    CHECK(!tt_exists(tmp));
    remove(svg);
    remove(json);
    CHECK_EQ_INT(rmdir(dir), 0);
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// ---- 7. flags -----------------------------------------------------------------------------------
static void test_flags(void) {
    static const char *const bad[][3] = {
        {"--layers", "0", NULL}, {"--layers", "65", NULL}, {"--dim", "x", NULL},
        {"--dim", "30", NULL},   // not a multiple of the default 4 heads
        {"--heads", "-1", NULL}, {"--seq", "", NULL}, {"--batch", "2k", NULL},
        {"--accum", "0", NULL},  {"--steps", NULL, NULL}, {"--lr", "0", NULL},
        {"--lr", "nan", NULL},   {"--clip", "-1", NULL}, {"--checkpointing", "some", NULL},
        {"--bogus", "1", NULL},  {"--bogus", NULL, NULL}, {"layers", NULL, NULL},
        {"--seed", "99999999999999999999999", NULL}, {"--optim", "adam", NULL},
        {"--optim", "none", NULL}, {"--optim", NULL, NULL}, {"--memory-svg", NULL, NULL},
        {"--snapshot", NULL, NULL}, {"--precision", "fp8", NULL},
        {"--inject-overflow", "3", NULL},  // only fp16 scales the loss
        {"--head", "both", NULL}, {"--vocab", "100", NULL}, {"--size", "huge", NULL},
        {"--capacity", "lots", NULL}, {"--capacity", "0", NULL}, {"--save-every", "5", NULL},
        {"--stop-after", "501", NULL}, {"--resume", NULL, NULL}, {"--fail-alloc-at", "0", NULL},
        {"--budget", "-1G", NULL},
    };
    tr_config cfg;
    char err[256];
    size_t i;
    char *argv[8];
    char *good[] = {"trainer", "--layers", "3", "--dim", "48", "--heads", "6", "--seq", "8",
                    "--batch", "5", "--accum", "2", "--steps", "7", "--lr", "0.003",
                    "--clip", "0", "--seed", "42", "--checkpointing", "full", "--data", "x.txt",
                    "--optim", "adamw-8bit", "--memory-svg", "m.svg", "--snapshot", "s.json"};
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int argc = 1;
        argv[0] = "trainer";
        while (argc < 3 && bad[i][argc - 1]) argv[argc] = (char *)bad[i][argc - 1], argc++;
        CHECK_MSG(tr_parse_args(argc, argv, &cfg, err, sizeof err) == MN_ERR_INVALID_ARG,
                  "flags %s %s accepted", bad[i][0], bad[i][1] ? bad[i][1] : "");
        CHECK_MSG(err[0] != '\0' && strchr(err, '\n') == NULL, "message \"%s\"", err);
    }
    CHECK_OK(tr_parse_args((int)(sizeof good / sizeof good[0]), good, &cfg, err, sizeof err));
    CHECK_EQ_U64(cfg.L, 3);
    CHECK_EQ_U64(cfg.C, 48);
    CHECK_EQ_U64(cfg.NH, 6);
    CHECK_EQ_U64(cfg.T, 8);
    CHECK_EQ_U64(cfg.B, 5);
    CHECK_EQ_U64(cfg.K, 2);
    CHECK_EQ_INT(cfg.steps, 7);
    CHECK_NEAR(cfg.lr, 0.003, 1e-9, 0);
    CHECK(cfg.clip == 0.0f);
    CHECK_EQ_U64(cfg.seed, 42);
    CHECK_EQ_INT(cfg.checkpointing, TR_CKPT_FULL);
    CHECK_STR(cfg.data, "x.txt");
    CHECK_EQ_INT(cfg.optim, MN_OPTIM_ADAMW_8BIT);
    CHECK_STR(cfg.memory_svg, "m.svg");
    CHECK_STR(cfg.snapshot, "s.json");
    CHECK_EQ_INT(cfg.help, 0);
    argv[0] = "trainer";
    CHECK_OK(tr_parse_args(1, argv, &cfg, err, sizeof err));  // the defaults are valid
    CHECK_EQ_INT(cfg.checkpointing, 0);
    CHECK_EQ_INT(cfg.optim, MN_OPTIM_ADAMW);
    CHECK(cfg.memory_svg == NULL && cfg.snapshot == NULL);
    argv[1] = "--help";
    CHECK_OK(tr_parse_args(2, argv, &cfg, err, sizeof err));
    CHECK_EQ_INT(cfg.help, 1);
    {   // --size wherever it stands, the other flags override it
        char *sized[] = {"trainer", "--layers", "3", "--size", "gpt2", "--precision", "bf16",
                         "--head", "untied", "--capacity", "1.5G", "--inject-overflow", "2"};
        CHECK_MSG(tr_parse_args(13, sized, &cfg, err, sizeof err) == MN_ERR_INVALID_ARG,
                  "--inject-overflow with bf16 accepted");
        sized[6] = "fp16";
        CHECK_OK(tr_parse_args(13, sized, &cfg, err, sizeof err));
        CHECK_EQ_U64(cfg.L, 3);
        CHECK_EQ_U64(cfg.C, 768);
        CHECK_EQ_U64(cfg.V, 50257);
        CHECK_EQ_INT(cfg.tied, 0);
        CHECK_EQ_INT(cfg.precision, MN_PREC_FP16);
        CHECK_EQ_U64(cfg.capacity, 1610612736);
        CHECK_EQ_INT(cfg.inject_overflow, 2);
    }
}

// ---- 8. mixed precision -------------------------------------------------------------------------
// fp16 and bf16 storage train like fp32: over 60 steps every step's loss is within 0.03 nats of
// the fp32 run's (the default 500-step run stays within 0.0004 for fp16 and 0.003 for bf16). The
// weights take 6 bytes per parameter (2 in MN_CAT_WEIGHTS, 4 in MN_CAT_MASTER_WEIGHTS), the
// gradients 4, as the allocator measures them; activations are 16-bit except the layernorm
// statistics and the probabilities.
static void test_precision(void) {
    static const mn_precision precs[] = {MN_PREC_FP16, MN_PREC_BF16};
    tr_config c32 = tt_config();
    tr_model m32, m16;
    float **ps[TR_NUM_PARAMS];
    double l32, l16, worst[2] = {0.0, 0.0};
    long live = mnt_live_allocs(), s;
    size_t q;
    int i, skipped;
    c32.T = 32, c32.B = 8, c32.steps = 60;
    for (q = 0; q < 2; q++) {
        tr_config c16 = c32;
        uint64_t w16 = 0, w32 = 0;
        float norm;
        c16.precision = precs[q];
        CHECK_OK(tr_model_init(&m32, &c32));
        CHECK_OK(tr_model_init(&m16, &c16));
        for (i = 0; i < TR_NUM_PARAMS; i++) {
            if (!tt_numel(&m16, i)) continue;
            w16 += mn_cache_round_size(NULL, 2 * tt_numel(&m16, i));
            w32 += mn_cache_round_size(NULL, 4 * tt_numel(&m16, i));
        }
        CHECK_EQ_U64(tt_current(&m16, MN_CAT_WEIGHTS), w16);
        CHECK_EQ_U64(tt_current(&m16, MN_CAT_MASTER_WEIGHTS), w32);
        CHECK_EQ_U64(tt_current(&m16, MN_CAT_GRADIENTS), w32);
        CHECK_EQ_U64(tt_current(&m32, MN_CAT_WEIGHTS), w32);
        CHECK_EQ_U64(tt_current(&m32, MN_CAT_MASTER_WEIGHTS), 0);
        for (s = 0; s < c32.steps; s++) {
            CHECK_OK(tr_accumulate(&m32, &l32));
            CHECK_OK(tr_update(&m32, tr_lr(&c32, s), &norm, &skipped));
            CHECK_OK(tr_accumulate(&m16, &l16));
            CHECK_OK(tr_update(&m16, tr_lr(&c16, s), &norm, &skipped));
            CHECK_EQ_INT(skipped, 0);
            if (fabs(l16 - l32) > worst[q]) worst[q] = fabs(l16 - l32);
        }
        CHECK_MSG(worst[q] < 0.03, "%s: loss %.4f from fp32's", mn_precision_name(precs[q]),
                  worst[q]);
        // the 16-bit weights are the rounded master weights
        tr_param_slots(&m16.params, ps);
        for (i = 0; i < TR_NUM_PARAMS; i++) {
            uint64_t k, n = tt_numel(&m16, i), bad = 0;
            for (k = 0; k < n; k++) {
                float w = (*ps[i])[k];
                uint16_t h = precs[q] == MN_PREC_FP16 ? mn_fp32_to_fp16(w) : mn_fp32_to_bf16(w);
                bad += h != m16.w16[i][k];
            }
            CHECK_MSG(bad == 0, "%s: %llu 16-bit weights are not the master's rounding",
                      tr_param_names[i], (unsigned long long)bad);
        }
        CHECK_OK(tr_model_free(&m32));
        CHECK_OK(tr_model_free(&m16));
    }
    if (mnt_verbose())
        printf("    precision: max |loss - fp32 loss| fp16 %.5f, bf16 %.5f\n", worst[0], worst[1]);
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// fp16: an overflow planted in step 3's gradients skips that update (the weights stay as they
// were), halves the loss scale and is counted; the steps before and after update.
static void test_overflow(void) {
    tr_config cfg = tt_config();
    tr_model m;
    float **ps[TR_NUM_PARAMS], *before;
    double loss;
    float norm, scale;
    long s;
    int skipped;
    cfg.precision = MN_PREC_FP16, cfg.steps = 5, cfg.inject_overflow = 3;
    CHECK_OK(tr_model_init(&m, &cfg));
    tr_param_slots(&m.params, ps);
    before = (float *)malloc((size_t)tt_numel(&m, TR_P_qkvw) * sizeof(float));
    CHECK(before != NULL);
    for (s = 0; s < cfg.steps && before; s++) {
        scale = m.scaler.scale;
        memcpy(before, m.params.qkvw, (size_t)tt_numel(&m, TR_P_qkvw) * sizeof(float));
        CHECK_OK(tr_accumulate(&m, &loss));
        CHECK_OK(tr_update(&m, 1e-2f, &norm, &skipped));
        CHECK_EQ_INT(skipped, s == 2);
        CHECK(m.scaler.scale == (s == 2 ? scale / 2.0f : scale));
        CHECK_EQ_INT(memcmp(before, m.params.qkvw, (size_t)tt_numel(&m, TR_P_qkvw) * 4) == 0,
                     s == 2);
    }
    CHECK(m.scaler.scale == 32768.0f);
    CHECK_EQ_U64(m.scaler.skipped, 1);
    free(before);
    CHECK_OK(tr_model_free(&m));
}

// ---- 9. checkpoints -----------------------------------------------------------------------------
// N steps, --save, --resume, M more steps: the same losses and weights, bit for bit, as N + M
// steps uninterrupted, in fp32 and in fp16 (where an overflow before the save changed the loss
// scaler's state), with accumulation and a non-default optimizer drawn at random.
static void tt_steps(tr_model *m, long n, double *losses) {
    long s;
    for (s = 0; s < n; s++) {
        tr_step_info st;
        CHECK_OK(tr_step(m, &st));
        losses[s] = st.loss;
    }
}

static void test_resume(void) {
    static const mn_optim optims[] = {MN_OPTIM_ADAMW, MN_OPTIM_ADAMW_8BIT, MN_OPTIM_SGD_MOMENTUM,
                                      MN_OPTIM_ADAFACTOR, MN_OPTIM_LION};
    char dir[] = "/tmp/mnt_resumeXXXXXX", path[64];
    long live = mnt_live_allocs();
    int q;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/ck.bin", dir);
    for (q = 0; q < 2; q++) {
        tr_config cfg = tt_config();
        tr_model a, b, c;
        float **pa[TR_NUM_PARAMS], **pc[TR_NUM_PARAMS];
        double la[7], lb[3], lc[4];
        int i;
        cfg.steps = 7, cfg.K = 1 + (size_t)(mnt_rand_u64() % 2);
        cfg.optim = optims[mnt_rand_u64() % 5];
        cfg.save = path, cfg.resume = path;
        if (q == 1) cfg.precision = MN_PREC_FP16, cfg.inject_overflow = 2;
        CHECK_OK(tr_model_init(&a, &cfg));
        tt_steps(&a, 7, la);
        CHECK_OK(tr_model_init(&b, &cfg));
        tt_steps(&b, 3, lb);
        CHECK_OK(tr_save(&b));
        CHECK_OK(tr_model_free(&b));
        CHECK_OK(tr_model_init(&c, &cfg));
        CHECK_OK(tr_resume(&c));
        CHECK_EQ_INT(c.step, 3);
        tt_steps(&c, 4, lc);
        CHECK_MSG(memcmp(la, lb, sizeof lb) == 0 && memcmp(la + 3, lc, sizeof lc) == 0,
                  "%s %s: losses differ after resume", mn_precision_name(cfg.precision),
                  mn_optim_name(cfg.optim));
        tr_param_slots(&a.params, pa);
        tr_param_slots(&c.params, pc);
        for (i = 0; i < TR_NUM_PARAMS; i++)
            CHECK_MSG(!tt_numel(&a, i) ||
                      memcmp(*pa[i], *pc[i], (size_t)tt_numel(&a, i) * 4) == 0,
                      "%s %s: weights %s differ after resume", mn_precision_name(cfg.precision),
                      mn_optim_name(cfg.optim), tr_param_names[i]);
        CHECK(a.scaler.scale == c.scaler.scale && a.scaler.skipped == c.scaler.skipped);
        CHECK_OK(tr_model_free(&a));
        CHECK_OK(tr_model_free(&c));
    }
    remove(path);
    rmdir(dir);
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// A checkpoint write that fails mid-way (the stand-in for a crash) leaves the previous one in
// place and loadable, and no temporary; corrupt, truncated, foreign and missing files are
// refused with a reason, and the model that refused them is untouched.
static void test_checkpoint_errors(void) {
    char dir[] = "/tmp/mnt_ckptXXXXXX", path[64], tmp[80], bad[64];
    tr_config cfg = tt_config(), other;
    tr_model m, r;
    FILE *f;
    long size;
    char *bytes;
    float w0;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/ck.bin", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    snprintf(bad, sizeof bad, "%s/bad.bin", dir);
    cfg.steps = 4, cfg.save = path, cfg.resume = path;
    CHECK_OK(tr_model_init(&m, &cfg));
    tt_steps(&m, 2, (double[2]){0});
    CHECK_OK(tr_save(&m));
    tt_steps(&m, 1, (double[1]){0});
    m.save_fail_after = 1 + mnt_rand_u64() % 4000;  // dies somewhere in the header or weights
    CHECK_EQ_INT(tr_save(&m), MN_ERR_IO);
    CHECK(strstr(m.error, "previous file is unchanged") != NULL);
    CHECK(access(tmp, F_OK) != 0);
    CHECK_OK(tr_model_init(&r, &cfg));
    CHECK_OK(tr_resume(&r));
    CHECK_EQ_INT(r.step, 2);
    CHECK_OK(tr_model_free(&r));
    CHECK_OK(tr_model_free(&m));
    // the file's bytes, to spoil
    bytes = tt_read_all(path, &size);
    CHECK(bytes != NULL);
    if (!bytes) return;
    {
        struct { long at, len; int flip; const char *why; } cases[] = {
            {0, 0, 0, "truncated"},                       // shortened below
            {0, 0, 1, "not a memanat trainer checkpoint"}, // the magic
            {8, 0, 1, "format version"},
            {0, 0, 1, "checksum"},                        // a weight byte
        };
        size_t k;
        cases[0].len = 1 + (long)(mnt_rand_u64() % (uint64_t)(size - 1));
        cases[3].at = 136 + (long)(mnt_rand_u64() % (uint64_t)(size - 144));
        for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            f = fopen(bad, "wb");
            CHECK(f != NULL);
            if (!f) break;
            if (cases[k].flip) bytes[cases[k].at] ^= 0x5a;
            fwrite(bytes, 1, cases[k].len ? (size_t)cases[k].len : (size_t)size, f);
            if (cases[k].flip) bytes[cases[k].at] ^= 0x5a;
            fclose(f);
            cfg.resume = bad;
            CHECK_OK(tr_model_init(&r, &cfg));
            w0 = r.params.wte[0];
            CHECK_EQ_INT(tr_resume(&r) != MN_OK, 1);
            CHECK_MSG(strstr(r.error, cases[k].why) != NULL, "\"%s\" lacks \"%s\"", r.error,
                      cases[k].why);
            CHECK(r.step == 0 && r.params.wte[0] == w0 && !r.opt_ready);
            CHECK_OK(tr_model_free(&r));
        }
    }
    other = cfg;
    other.C = 48, other.NH = 4, other.resume = path;
    CHECK_OK(tr_model_init(&r, &other));
    CHECK(tr_resume(&r) != MN_OK && strstr(r.error, "--dim 32 there, 48 here") != NULL);
    CHECK_OK(tr_model_free(&r));
    other = cfg;
    other.resume = bad;
    remove(bad);
    CHECK_OK(tr_model_init(&r, &other));
    CHECK_EQ_INT(tr_resume(&r), MN_ERR_IO);
    CHECK(strstr(r.error, "cannot read") != NULL);
    CHECK_OK(tr_model_free(&r));
    free(bytes);
    remove(path);
    rmdir(dir);
}

// Every tensor allocation of one step (the second: the optimizer state exists) failing in turn,
// in fp16 with full checkpointing and accumulation (the most allocations): each failure is
// reported as out of memory naming the tensor, nothing leaks, and the model frees cleanly.
static void test_step_allocation_failures(void) {
    tr_config cfg = tt_config();
    tr_result res;
    uint64_t first, last, n;
    tr_model m;
    long live = mnt_live_allocs();
    cfg.steps = 2, cfg.K = 2, cfg.precision = MN_PREC_FP16;
    cfg.checkpointing = mnt_rand_u64() % 2 ? TR_CKPT_FULL : TR_CKPT_SELECTIVE;
    CHECK_OK(tr_model_init(&m, &cfg));
    tt_steps(&m, 1, (double[1]){0});
    first = m.alloc_calls + 1;
    tt_steps(&m, 1, (double[1]){0});
    last = m.alloc_calls;
    CHECK_OK(tr_model_free(&m));
    CHECK(last > first + 100);
    for (n = first; n <= last; n++) {
        cfg.fail_alloc_at = n;
        CHECK_EQ_INT(tr_run(&cfg, NULL, &res), MN_ERR_DEVICE_OOM);
        CHECK_MSG(strstr(res.error, "out of memory allocating") != NULL, "allocation %llu: %s",
                  (unsigned long long)n, res.error);
        CHECK_EQ_INT(mnt_live_allocs(), live);
        if (mnt_failed()) return;
    }
    if (mnt_verbose())
        printf("    step allocation failures: allocations %llu..%llu each failed in turn\n",
               (unsigned long long)first, (unsigned long long)last);
}

// ---- 10. the estimator's prediction -------------------------------------------------------------
// mn_estimate with --framework memanat (tr_predict) predicts this program exactly: every
// category's peak, peak allocated and peak reserved equal, to the byte, what the trainer's cache
// measured over 2 or 3 steps. Configurations are drawn from a grid with fresh seeds; the first
// draws force fp16 with full checkpointing and SGD, bf16 with selective checkpointing,
// accumulation, an untied head and 8-bit AdamW; later ones are free. A step that fp16 skipped
// for an overflow makes the optimizer state later than predicted, so such a draw is not compared.
static void test_prediction_exact(void) {
    static const mn_category cats[] = {MN_CAT_WEIGHTS, MN_CAT_MASTER_WEIGHTS, MN_CAT_GRADIENTS,
                                       MN_CAT_OPTIMIZER, MN_CAT_ACTIVATIONS, MN_CAT_TEMPORARY,
                                       MN_CAT_OTHER};
    static const mn_precision precs[] = {MN_PREC_FP32, MN_PREC_FP16, MN_PREC_BF16};
    long live = mnt_live_allocs();
    int draw, k;
    for (draw = 0; draw < 5; draw++) {
        tr_config cfg = tt_config();
        mn_estimate_result pred;
        tr_result res;
        cfg.L = 1 + mnt_rand_u64() % 3, cfg.NH = 1 + mnt_rand_u64() % 4;
        cfg.C = cfg.NH * (8 + 8 * (mnt_rand_u64() % 3)), cfg.T = 4 + mnt_rand_u64() % 29;
        cfg.V = mnt_rand_u64() % 2 ? 256 : 256 + mnt_rand_u64() % 200;
        cfg.B = 1 + mnt_rand_u64() % 4, cfg.K = 1 + mnt_rand_u64() % 3;
        cfg.tied = (int)(mnt_rand_u64() % 2), cfg.steps = 2 + (long)(mnt_rand_u64() % 2);
        cfg.precision = precs[mnt_rand_u64() % 3];
        cfg.checkpointing = (int)(mnt_rand_u64() % 3);
        cfg.optim = (mn_optim)(MN_OPTIM_ADAMW + mnt_rand_u64() % 6);
        if (draw == 0) {
            cfg.precision = MN_PREC_FP16, cfg.checkpointing = TR_CKPT_FULL;
            cfg.optim = MN_OPTIM_SGD;
        }
        if (draw == 1) {
            cfg.precision = MN_PREC_BF16, cfg.checkpointing = TR_CKPT_SELECTIVE, cfg.K = 3;
            cfg.tied = 0, cfg.optim = MN_OPTIM_ADAMW_8BIT;
            cfg.C = 64, cfg.NH = 4;  // 8-bit blocks: tensors of 4096 elements and more
        }
        CHECK_OK(tr_predict(&cfg, &pred));
        CHECK_OK(tr_run(&cfg, NULL, &res));
        if (mnt_failed() || res.skipped) continue;
        for (k = 0; k < (int)(sizeof cats / sizeof cats[0]); k++)
            CHECK_MSG(pred.cat_peak[cats[k]] == res.stats.cat_allocated_bytes[cats[k]].peak,
                      "draw %d L %zu C %zu NH %zu T %zu V %zu B %zu K %zu %s %s %s %s: %s "
                      "predicted %llu, measured %llu", draw, cfg.L, cfg.C, cfg.NH, cfg.T, cfg.V,
                      cfg.B, cfg.K, cfg.tied ? "tied" : "untied", mn_precision_name(cfg.precision),
                      tr_ckpt_names[cfg.checkpointing], mn_optim_name(cfg.optim),
                      mn_category_name(cats[k]), (unsigned long long)pred.cat_peak[cats[k]],
                      (unsigned long long)res.stats.cat_allocated_bytes[cats[k]].peak);
        CHECK_EQ_U64(pred.peak_allocated, res.stats.allocated_bytes[MN_STAT_ALL].peak);
        CHECK_EQ_U64(pred.peak_reserved, res.stats.reserved_bytes[MN_STAT_ALL].peak);
        for (k = 0; k < MN_CAT_COUNT; k++)
            CHECK_EQ_U64(pred.at_peak[k], res.stats.cat_at_peak[k]);
        CHECK_EQ_U64(pred.optimizer, res.optim_bytes);  // the model states, without a replay
        CHECK_EQ_U64(pred.params, res.num_params);
        CHECK_EQ_U64(pred.context + pred.workspace, 0);  // host memory
    }
    CHECK_EQ_INT(mnt_live_allocs(), live);
}

// --framework memanat predicts trainer.c's GPT and nothing else: another model, a sequence
// other than the position table, pure 16-bit or sharded training are MN_ERR_UNSUPPORTED, each
// with one message; the trainer's model with the same setup is predicted.
static void test_prediction_unsupported(void) {
    mn_model gpt, m;
    mn_setup s;
    mn_estimate_result r;
    mnt_log lg;
    memset(&lg, 0, sizeof lg);
    memset(&s, 0, sizeof s);
    s.framework = MN_FW_MEMANAT, s.no_replay = 1;
    s.logger.log_fn = mnt_log_capture, s.logger.user_data = &lg;
    CHECK_OK(mn_gpt_model(2, 64, 4, 32, 256, 1, &gpt));
    CHECK_OK(mn_estimate(&gpt, &s, &r));
    CHECK_STR(r.gpu.name, "cpu");
    CHECK_EQ_U64(r.setup.seq, 32);
    CHECK_EQ_INT(lg.count, 0);
    CHECK_OK(mn_preset_find("gpt2", &m));  // GPT-2 itself: gelu_new, dropout
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_UNSUPPORTED);
    CHECK_EQ_INT(lg.count, 1);
    CHECK_OK(mn_preset_find("llama-3.2-1b", &m));
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_UNSUPPORTED);
    m = gpt, m.act = MN_ACT_GELU;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_UNSUPPORTED);
    m = gpt, m.ffn = 3 * 64;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_UNSUPPORTED);
    m = gpt, m.dropout = 0.1f;
    CHECK_ERR(mn_estimate(&m, &s, &r), MN_ERR_UNSUPPORTED);
    s.seq = 16;  // the trainer's wpe has exactly seq rows
    CHECK_ERR(mn_estimate(&gpt, &s, &r), MN_ERR_UNSUPPORTED);
    s.seq = 0, s.precision = MN_PREC_BF16_PURE;
    CHECK_ERR(mn_estimate(&gpt, &s, &r), MN_ERR_UNSUPPORTED);
    s.precision = MN_PREC_BF16, s.zero_stage = 1, s.gpus = 2;
    CHECK_ERR(mn_estimate(&gpt, &s, &r), MN_ERR_UNSUPPORTED);
    s.zero_stage = 0, s.gpus = 0, s.attention = MN_ATTN_FLASH;
    CHECK_ERR(mn_estimate(&gpt, &s, &r), MN_ERR_UNSUPPORTED);
    s.attention = MN_ATTN_DEFAULT, s.infer = 1;
    CHECK_ERR(mn_estimate(&gpt, &s, &r), MN_ERR_UNSUPPORTED);
    CHECK_EQ_INT(lg.count, 10);
}

// ---- 11. --budget and --json --------------------------------------------------------------------
// A budget the setup fits leaves it as it is; a tighter one gets mn_fit's plan, which the run
// then keeps to (its reserved peak, measured, is within the budget, which is also its capacity);
// a budget nothing fits is refused with the reason.
static void test_budget(void) {
    tr_config cfg = tt_config(), c;
    tr_result res;
    char err[256];
    uint64_t need;
    mn_estimate_result pred;
    cfg.steps = 2, cfg.B = 8, cfg.T = 32;
    CHECK_OK(tr_predict(&cfg, &pred));
    need = pred.peak_reserved;
    c = cfg;
    c.budget = need;
    CHECK_OK(tr_plan(&c, NULL, err, sizeof err));
    CHECK(c.B == cfg.B && c.K == cfg.K && c.precision == cfg.precision &&
          c.optim == cfg.optim && c.checkpointing == cfg.checkpointing);
    CHECK_EQ_U64(c.capacity, need);
    c = cfg;
    c.budget = need / 2 + mnt_rand_u64() % (need / 4);
    CHECK_OK(tr_plan(&c, NULL, err, sizeof err));
    CHECK(c.B < cfg.B || c.precision != cfg.precision || c.optim != cfg.optim ||
          c.checkpointing != cfg.checkpointing);
    CHECK_EQ_U64((uint64_t)c.B * c.K, (uint64_t)cfg.B * cfg.K);  // the same effective batch
    c = cfg;
    c.budget = need / 2 + mnt_rand_u64() % (need / 4);
    CHECK_OK(tr_run(&c, NULL, &res));
    CHECK_MSG(res.stats.reserved_bytes[MN_STAT_ALL].peak <= c.budget,
              "reserved %llu B over the budget %llu B",
              (unsigned long long)res.stats.reserved_bytes[MN_STAT_ALL].peak,
              (unsigned long long)c.budget);
    c = cfg;
    c.budget = 1 + mnt_rand_u64() % 65536;
    CHECK_EQ_INT(tr_run(&c, NULL, &res), MN_ERR_INVALID_ARG);
    CHECK_MSG(strstr(res.error, "nothing this trainer can do fits --budget") != NULL, "\"%s\"",
              res.error);
}

// --json FILE: valid JSON whose memory section is the allocator's measurement beside the
// estimator's prediction, with one entry per step and the configuration as resolved.
static void test_json(void) {
    char dir[] = "/tmp/mnt_jsonXXXXXX", path[64];
    tr_config cfg = tt_config();
    tr_result res;
    mn_json_doc doc;
    const mn_json_value *mem, *steps, *v;
    char *text;
    long len;
    uint64_t x;
    int k;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/run.json", dir);
    cfg.steps = 3, cfg.json = path;
    cfg.precision = mnt_rand_u64() % 2 ? MN_PREC_BF16 : MN_PREC_FP32;
    CHECK_OK(tr_run(&cfg, NULL, &res));
    text = tt_read_all(path, &len);
    CHECK(text != NULL);
    if (!text) return;
    CHECK_OK(mn_json_parse(text, (size_t)len, NULL, &doc));
    steps = mn_json_get(doc.root, "steps");
    CHECK(steps && steps->type == MN_JSON_ARRAY && steps->len == 3);
    v = mn_json_get(mn_json_get(doc.root, "config"), "precision");
    CHECK(v && v->type == MN_JSON_STRING && strcmp(v->str, mn_precision_name(cfg.precision)) == 0);
    mem = mn_json_get(doc.root, "memory");
    for (k = 0; k < MN_CAT_COUNT; k++) {
        const mn_json_value *e = mn_json_get(mem, mn_category_name((mn_category)k));
        CHECK_OK(mn_json_u64(mn_json_get(e, "measured"), &x));
        CHECK_EQ_U64(x, res.stats.cat_allocated_bytes[k].peak);
        CHECK_OK(mn_json_u64(mn_json_get(e, "predicted"), &x));
        CHECK_EQ_U64(x, res.stats.cat_allocated_bytes[k].peak);  // predicted to the byte
    }
    CHECK_OK(mn_json_u64(mn_json_get(mn_json_get(mem, "peak_reserved"), "measured"), &x));
    CHECK_EQ_U64(x, res.stats.reserved_bytes[MN_STAT_ALL].peak);
    mn_json_free(&doc);
    free(text);
    remove(path);
    rmdir(dir);
}

const mnt_case test_trainer_cases[] = {
    {"gradients_finite_differences", test_gradients_finite_differences},
    {"accumulation", test_accumulation},
    {"checkpointing", test_checkpointing},
    {"markov_entropy", test_markov_entropy},
    {"learning", test_learning},
    {"memory_accounting", test_memory_accounting},
    {"allocation_failures", test_allocation_failures},
    {"data_file", test_data_file},
    {"optimizers", test_optimizers},
    {"memory_files", test_memory_files},
    {"flags", test_flags},
    {"precision", test_precision},
    {"overflow", test_overflow},
    {"resume", test_resume},
    {"checkpoint_errors", test_checkpoint_errors},
    {"step_allocation_failures", test_step_allocation_failures},
    {"prediction_exact", test_prediction_exact},
    {"prediction_unsupported", test_prediction_unsupported},
    {"budget", test_budget},
    {"json", test_json},
};
const size_t test_trainer_count = sizeof test_trainer_cases / sizeof test_trainer_cases[0];
