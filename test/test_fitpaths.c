// Tests of mn_fit's shortcuts against the estimates they stand for. This file builds its own
// static copy of the implementation (MEMANAT_STATIC), so the private helpers can be called
// directly; its cases run in the estimate suite (test/test_estimate.c).
//   - an estimate that asks only whether the step fits (mn__sim.decide: the replay at the
//     device's size first, stopped at its first out-of-memory) against the whole estimate with
//     every tensor on its own id (mn__sim.unique_ids): every field equal where it settles,
//     "does not fit" where it stops; the step alone it writes on the way (mn__sim.alone) equal
//     to the estimate with no_replay set; mn_estimate (ids reused) equal to the whole one;
//   - mn_fit against the same fit with every estimate whole and nothing reused (mn__fit_with's
//     whole: no replay memo, no step alone taken from a replayed run, no alias of the setup);
//   - a fit's entry of a setup made in one run with a bound on the peak (mn__fit_entry's below:
//     the greedy pass's candidates; the events no longer kept once the peak passes it or the
//     device) against the step alone and the whole estimate, several setups in one fit (its
//     replay memo and the host memory its replays keep);
//   - a fit's entry where only "does not fit" is read (mn__fit_entry's cut: the run stops once
//     its peak passes the device) against the step alone and the whole estimate, and the same
//     setup asked again whole;
//   - mn_fit's plan against its search written out with mn_estimate alone (ref_plan): the prune
//     by the step alone (replayed for the steps added for the allocator's slack) with one replay
//     of its plan, and the replayed prune where that plan does not fit; the greedy pass stopped
//     unreplayed where the step alone leaves an eighth of the device free, and searched again
//     where its plan does not fit replayed (a quarter of the cases round blocks up to powers of
//     two, so that the allocator's slack exceeds that eighth).
#define MEMANAT_STATIC
#include "harness.h"
#define MN_MALLOC(sz) mnt_malloc(sz)
#define MN_FREE(p) mnt_free(p)
#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"

#include <stdio.h>
#include <string.h>

void test_fit_decide_replay(void);
void test_fit_shortcuts_whole(void);
void test_fit_entry_below(void);
void test_fit_entry_cut(void);
void test_fit_plan_reference(void);
void test_estimate_retry(void);
void test_cache_direct(void);

// A decoder, encoder or encoder-decoder of a few narrow blocks, or a small preset.
static mn_model random_model(void) {
    static const char *names[] = {"gpt2", "t5-small", "bert-base-uncased", "qwen2-0.5b"};
    static const mn_arch arch[] = {MN_ARCH_DECODER, MN_ARCH_ENCODER, MN_ARCH_ENCODER_DECODER};
    mn_model m;
    memset(&m, 0, sizeof m);
    if (mnt_rand_u64() % 4 == 0) {
        CHECK_OK(mn_preset_find(names[mnt_rand_u64() % 4], &m));
        m.layers = 1 + mnt_rand_u64() % 3;  // (a few blocks: the test stays fast)
        if (m.encoder_layers) m.encoder_layers = m.layers;
        return m;
    }
    m.arch = arch[mnt_rand_u64() % 3];
    m.layers = 1 + mnt_rand_u64() % 4, m.heads = 1 + mnt_rand_u64() % 4;
    m.hidden = m.heads * (8 + mnt_rand_u64() % 120), m.vocab = 100 + mnt_rand_u64() % 20000;
    m.max_positions = 1u << 16, m.gated_mlp = (int)(mnt_rand_u64() % 2);
    m.posemb = (mn_posemb)(mnt_rand_u64() % MN_POS_COUNT);
    return m;
}

static mn_setup random_setup(void) {
    mn_setup s;
    memset(&s, 0, sizeof s);
    s.batch = 1 + mnt_rand_u64() % 8, s.seq = 8 + mnt_rand_u64() % 500;
    s.precision = (mn_precision)(mnt_rand_u64() % 4);
    s.checkpointing = (mn_ckpt)(mnt_rand_u64() % 3);
    if (mnt_rand_u64() % 5 == 0) {
        s.framework = MN_FW_MEMANAT;  // (the replay's categories)
    } else if (mnt_rand_u64() % 4 == 0) {  // states on the host: setups the device cannot tell
        s.framework = MN_FW_DEEPSPEED, s.zero_stage = 3, s.offload = MN_OFFLOAD_ALL;
        s.optim = (mn_optim)(mnt_rand_u64() % 3);  // apart (the fit reuses their replays)
    } else if (mnt_rand_u64() % 5 == 0) {
        s.optim = MN_OPTIM_SGD;
    }
    s.context = 1 << 20, s.capacity = 1ull << 40;
    return s;
}

// Every number of two estimates equal.
static void same_estimate(const mn_estimate_result *a, const mn_estimate_result *b, int it) {
    int k;
    CHECK_MSG(a->peak_allocated == b->peak_allocated && a->peak_reserved == b->peak_reserved &&
              a->peak_requested == b->peak_requested && a->device_used == b->device_used &&
              a->fits == b->fits && a->alloc_events == b->alloc_events,
              "case %d: allocated %llu/%llu reserved %llu/%llu fits %d/%d", it,
              (unsigned long long)a->peak_allocated, (unsigned long long)b->peak_allocated,
              (unsigned long long)a->peak_reserved, (unsigned long long)b->peak_reserved,
              a->fits, b->fits);
    CHECK_EQ_U64(a->activations, b->activations);
    CHECK_EQ_U64(a->temporary, b->temporary);
    CHECK_EQ_U64(a->workspace, b->workspace);
    CHECK_EQ_U64(a->kv_cache, b->kv_cache);
    CHECK_EQ_U64(a->model_states, b->model_states);
    CHECK_EQ_INT(a->peak_phase, b->peak_phase);
    for (k = 0; k < MN_CAT_COUNT; k++) {
        CHECK_EQ_U64(a->at_peak[k], b->at_peak[k]);
        CHECK_EQ_U64(a->cat_peak[k], b->cat_peak[k]);
    }
}

// The setup with room for its allocated peak A plus u of its allocator slack R - A (u in
// [-0.5, 1.3]: below A the device refuses for certain, between A and R the allocator frees its
// cache and retries, above R nothing is refused). 0 when the model cannot take the setup.
static int place_capacity(const mn_model *m, mn_setup *s) {
    mn_estimate_result r;
    double u = mnt_rand_uniform() * 1.8 - 0.5;
    double a, slack;
    if (mn_estimate(m, s, &r) != MN_OK) return 0;
    a = (double)r.peak_allocated, slack = (double)(r.peak_reserved - r.peak_allocated);
    if (u < 0) slack = a;  // (below A: down to half of it)
    s->capacity = s->context + (uint64_t)(a + u * slack > 4096 ? a + u * slack : 4096);
    return 1;
}

// The estimate with every tensor on its own id, as before ids were reused with the replay.
static mn_result estimate_unique_ids(const mn_model *m, const mn_setup *s,
                                     mn_estimate_result *out) {
    mn__sim S;
    mn_result r;
    memset(&S, 0, sizeof S);
    S.unique_ids = 1;
    r = mn__estimate_in(m, s, out, &S, 0, NULL);
    mn__sim_free(&S);
    return r;
}

// The decide path against the whole estimate on random setups, the device placed so that its
// three outcomes happen: settled with nothing refused (the same replay as the unlimited one),
// settled after a refused allocation that freeing the cache granted (that replay is the answer),
// stopped at an out-of-memory (the step does not fit).
void test_fit_decide_replay(void) {
    int it, plain = 0, retried = 0, stopped = 0, skipped = 0;
    for (it = 0; it < 400 && (it < 60 || !plain || !retried || !stopped || !skipped); it++) {
        mn_model m = random_model();
        mn_setup s = random_setup(), u;
        mn_estimate_result whole, reused, dec, unlimited, alone, quick;
        mn__sim S;
        mn_result r;
        if (!place_capacity(&m, &s)) continue;
        u = s, u.capacity = 1ull << 40;
        CHECK_OK(estimate_unique_ids(&m, &u, &unlimited));
        CHECK_OK(estimate_unique_ids(&m, &s, &whole));
        CHECK_OK(mn_estimate(&m, &s, &reused));
        same_estimate(&reused, &whole, it);
        u = s, u.no_replay = 1;
        CHECK_OK(mn_estimate(&m, &u, &quick));
        memset(&S, 0, sizeof S);
        S.decide = 1, S.alone = &alone;
        r = mn__estimate_in(&m, &s, &dec, &S, 0, NULL);
        CHECK_OK(r);
        CHECK(S.alone_set);
        if (S.alone_set) {
            same_estimate(&alone, &quick, it);
            CHECK_EQ_INT(alone.setup.no_replay, 1);
        }
        if (r == MN_OK && S.alone_set && !alone.fits) {  // (then the replay is skipped)
            skipped++;
            CHECK(!whole.fits);
        } else if (r == MN_OK && S.unsettled) {
            stopped++;
            CHECK_MSG(!whole.fits && !dec.fits, "case %d: stopped, but the step fits", it);
        } else if (r == MN_OK) {
            same_estimate(&dec, &whole, it);
            if (whole.peak_reserved != unlimited.peak_reserved) retried++;
            else plain++;
        }
        mn__sim_free(&S);
    }
    if (mnt_verbose())
        printf("       %d setups: %d plain, %d retried, %d stopped, %d skipped\n", it, plain,
               retried, stopped, skipped);
    CHECK_MSG(plain && retried && stopped && skipped, "outcomes not all seen: %d plain, %d "
              "retried, %d stopped, %d skipped", plain, retried, stopped, skipped);
}

// The allocator's peaks over the trace on a simulated device of capacity bytes (0: unlimited);
// *failed: the allocations refused after the out-of-memory ladder.
static void replay_trace(const mn_trace_event *ev, uint64_t n, uint64_t capacity,
                         mn_cache_statistics *st, uint64_t *failed) {
    mn_sim_cache sc;
    mn_simdev_desc dd;
    mn_replay_counts k;
    memset(&dd, 0, sizeof dd), memset(&k, 0, sizeof k);
    dd.capacity = capacity;
    memset(st, 0, sizeof *st);
    CHECK_OK(mn_sim_cache_init(&sc, &dd, NULL));
    CHECK_OK(mn_cache_replay(&sc.cache, ev, n, 0, &k));
    CHECK_OK(mn_cache_stats(&sc.cache, st));
    mn_sim_cache_free(&sc);
    *failed = k.failed;
}

// mn_estimate on a device smaller than the unlimited replay's reserved peak, against the
// allocator run on the estimate's own trace (mn_estimate_trace through mn_cache_replay) on a
// simulated device of the real size: where every allocation is granted there (the refused device
// calls granted after the cache was freed), the step fits with that replay's peaks, as PyTorch
// shows them on that device; where one is refused, it does not fit. Below the unlimited reserved
// peak the estimate holds the unlimited replay's peaks.
void test_estimate_retry(void) {
    int it, plain = 0, granted = 0, refused = 0, moved = 0;
    for (it = 0; it < 600 && (it < 60 || !granted || !refused); it++) {
        mn_model m = random_model();
        mn_setup s = random_setup();
        mn_estimate_result e;
        mn_cache_statistics unl, lim;
        mn_trace_event *ev = NULL;
        uint64_t n = 0, limit, fu = 0, fl = 0;
        if (!place_capacity(&m, &s) || mn_estimate(&m, &s, &e) != MN_OK) continue;
        CHECK_OK(mn_estimate_trace(&m, &s, NULL, &ev, &n));
        limit = s.capacity - s.context;
        replay_trace(ev, n, 0, &unl, &fu);
        replay_trace(ev, n, limit, &lim, &fl);
        mn_trace_free(NULL, ev);
        CHECK_EQ_U64(fu, 0);
        if (unl.reserved_bytes[MN_STAT_ALL].peak <= limit) {
            plain++;
            CHECK_MSG(e.fits, "case %d: the unlimited replay fits, the estimate does not", it);
            CHECK_EQ_U64(e.peak_allocated, unl.allocated_bytes[MN_STAT_ALL].peak);
            CHECK_EQ_U64(e.peak_reserved, unl.reserved_bytes[MN_STAT_ALL].peak);
        } else if (fl == 0) {
            granted++;
            moved += lim.allocated_bytes[MN_STAT_ALL].peak != unl.allocated_bytes[MN_STAT_ALL].peak;
            CHECK_MSG(e.fits, "case %d: granted at the device's size, but the estimate does not "
                      "fit", it);
            CHECK_EQ_U64(e.peak_allocated, lim.allocated_bytes[MN_STAT_ALL].peak);
            CHECK_EQ_U64(e.peak_reserved, lim.reserved_bytes[MN_STAT_ALL].peak);
            CHECK(e.peak_reserved <= limit);
        } else {
            refused++;
            CHECK_MSG(!e.fits, "case %d: refused at the device's size, but the estimate fits", it);
        }
    }
    if (mnt_verbose())
        printf("       %d setups: %d plain, %d granted after a retry (%d with another allocated "
               "peak), %d refused\n", it, plain, granted, moved, refused);
    CHECK_MSG(plain && granted && refused, "outcomes not all seen: %d plain, %d granted, %d "
              "refused", plain, granted, refused);
}

static void keep_message(void *user_data, mn_log_level level, const char *msg) {
    (void)level;
    snprintf((char *)user_data, 256, "%s", msg);
}

// A direct cache (mn__c_direct: no address map, blocks released by handle, as the estimate's
// replay runs it) against the same cache released by pointer: random allocations and releases of
// mixed sizes on a device small enough for the out-of-memory ladder (cached blocks freed, the
// allocation retried, refused): the same pointers and refusals at every step, the same statistics,
// both consistent (mn_cache_check). A direct cache refuses a release by pointer. A third, direct
// and lean (mn__c_lean, as the replay runs it), hands out the same pointers and keeps the
// statistics the estimate reads equal to the full cache's (allocated and reserved bytes, segments,
// the categories' allocated bytes and their values at the peak, OOMs), the others 0.
static void check_lean_stats(const mn_cache_statistics *full, const mn_cache_statistics *lean) {
    mn_cache_statistics want;
    memset(&want, 0, sizeof want);
    memcpy(want.allocated_bytes, full->allocated_bytes, sizeof want.allocated_bytes);
    memcpy(want.reserved_bytes, full->reserved_bytes, sizeof want.reserved_bytes);
    memcpy(want.segment, full->segment, sizeof want.segment);
    want.oversize_segments = full->oversize_segments;
    want.num_alloc_retries = full->num_alloc_retries, want.num_ooms = full->num_ooms;
    want.num_sync_all_streams = full->num_sync_all_streams;
    want.num_device_alloc = full->num_device_alloc, want.num_device_free = full->num_device_free;
    want.max_split_size = full->max_split_size;
    memcpy(want.cat_allocated_bytes, full->cat_allocated_bytes, sizeof want.cat_allocated_bytes);
    memcpy(want.cat_at_peak, full->cat_at_peak, sizeof want.cat_at_peak);
    CHECK(memcmp(&want, lean, sizeof want) == 0);
}

void test_cache_direct(void) {
    enum { SLOTS = 64 };
    int round;
    for (round = 0; round < 6; round++) {
        mn_sim_cache a, b, l;
        mn_simdev_desc dd;
        mn_cache_desc cd;
        mn_cache_statistics sa, sb, sl;
        void *pa[SLOTS], *hb[SLOTS], *hl[SLOTS];
        char msg[256] = "";
        int it, refused = 0;
        memset(&dd, 0, sizeof dd), memset(&cd, 0, sizeof cd);
        dd.capacity = (64ull << 20) + (mnt_rand_u64() % 64) * (1ull << 20);
        cd.logger.log_fn = keep_message, cd.logger.user_data = msg;
        CHECK_OK(mn_sim_cache_init(&a, &dd, &cd));
        CHECK_OK(mn_sim_cache_init(&b, &dd, &cd));
        CHECK_OK(mn_sim_cache_init(&l, &dd, &cd));
        mn__c_direct(&b.cache);
        mn__c_direct(&l.cache), mn__c_lean(&l.cache);
        memset(pa, 0, sizeof pa), memset(hb, 0, sizeof hb), memset(hl, 0, sizeof hl);
        for (it = 0; it < 3000; it++) {
            int k = (int)(mnt_rand_u64() % SLOTS);
            if (pa[k]) {
                CHECK_OK(mn_cache_release(&a.cache, pa[k]));
                CHECK_OK(mn__c_release_direct(&b.cache, hb[k]));
                CHECK_OK(mn__c_release_direct(&l.cache, hl[k]));
                pa[k] = hb[k] = hl[k] = NULL;
            } else {
                uint64_t r = mnt_rand_u64() % 100, size;
                mn_category cat = (mn_category)(mnt_rand_u64() % MN_CAT_COUNT);
                void *q = NULL, *ql = NULL;
                mn_result ra, rb, rl;
                size = r < 60 ? 1 + mnt_rand_u64() % (1 << 20)
                              : r < 95 ? (1 << 20) + mnt_rand_u64() % (12 << 20)
                                       : (12 << 20) + mnt_rand_u64() % (40 << 20);
                ra = mn_cache_alloc(&a.cache, size, 0, cat, NULL, &pa[k]);
                rb = mn_cache_alloc(&b.cache, size, 0, cat, NULL, &q);
                rl = mn_cache_alloc(&l.cache, size, 0, cat, NULL, &ql);
                CHECK_EQ_INT(ra, rb);
                CHECK_EQ_INT(ra, rl);
                CHECK(pa[k] == q && pa[k] == ql);
                refused += ra == MN_ERR_DEVICE_OOM;
                if (rb == MN_OK) hb[k] = mn__c_last_block(&b.cache);
                if (rl == MN_OK) hl[k] = mn__c_last_block(&l.cache);
            }
            if (it % 500 == 0) {
                CHECK_OK(mn_cache_check(&a.cache));
                CHECK_OK(mn_cache_check(&b.cache));
                CHECK_OK(mn_cache_check(&l.cache));
                CHECK_OK(mn_cache_stats(&a.cache, &sa));
                CHECK_OK(mn_cache_stats(&l.cache, &sl));
                check_lean_stats(&sa, &sl);
            }
        }
        CHECK_OK(mn_cache_check(&a.cache));
        CHECK_OK(mn_cache_check(&b.cache));
        CHECK_OK(mn_cache_check(&l.cache));
        CHECK_OK(mn_cache_stats(&a.cache, &sa));
        CHECK_OK(mn_cache_stats(&b.cache, &sb));
        CHECK_OK(mn_cache_stats(&l.cache, &sl));
        CHECK(memcmp(&sa, &sb, sizeof sa) == 0);
        check_lean_stats(&sa, &sl);
        CHECK(refused > 0);
        for (it = 0; it < SLOTS && !hb[it]; it++) {}
        if (it < SLOTS) {
            CHECK_ERR(mn_cache_release(&b.cache, pa[it]), MN_ERR_INVALID_ARG);
            CHECK_MSG(strstr(msg, "released by block") != NULL, "message: %s", msg);
        }
        mn_sim_cache_free(&a);
        mn_sim_cache_free(&b);
        mn_sim_cache_free(&l);
    }
}

// mn_fit against the same fit with every estimate whole: the same answers, field by field.
void test_fit_shortcuts_whole(void) {
    int it;
    for (it = 0; it < 24; it++) {
        mn_model m = random_model();
        mn_setup s = random_setup();
        mn_fit_result a, b;
        mn_result ra, rb;
        uint32_t i;
        if (!place_capacity(&m, &s)) continue;
        ra = mn_fit(&m, &s, &a);
        rb = mn__fit_with(&m, &s, &b, 1);
        CHECK_EQ_INT(ra, rb);
        if (ra != MN_OK || rb != MN_OK) continue;
        CHECK_EQ_U64(a.max_batch, b.max_batch);
        CHECK_EQ_U64(a.max_seq, b.max_seq);
        CHECK_EQ_INT(a.plan_found, b.plan_found);
        CHECK_EQ_INT(a.plan_len, b.plan_len);
        CHECK(a.plan_slowdown == b.plan_slowdown);
        for (i = 0; i < a.plan_len && i < b.plan_len; i++) {
            CHECK(!strcmp(a.plan[i].what, b.plan[i].what));
            CHECK(!strcmp(a.plan[i].why, b.plan[i].why));
        }
        CHECK_EQ_U64(a.plan_setup.batch, b.plan_setup.batch);
        CHECK_EQ_U64(a.plan_setup.accum, b.plan_setup.accum);
        CHECK_EQ_INT(a.plan_setup.checkpointing, b.plan_setup.checkpointing);
        CHECK_EQ_INT(a.plan_setup.optim, b.plan_setup.optim);
        CHECK_EQ_INT(a.plan_setup.precision, b.plan_setup.precision);
        CHECK_EQ_INT(a.plan_setup.zero_stage, b.plan_setup.zero_stage);
        CHECK_EQ_U64(a.plan_setup.lora_rank, b.plan_setup.lora_rank);
        same_estimate(&a.plan_estimate, &b.plan_estimate, it);
    }
}

// The plan's search written out with mn_estimate alone (no memo, no cut runs, every estimate
// whole), from the setup as the fit resolves it. The greedy pass adds the first technique that
// lowers the allocated peak until the replay fits; the steps added once the allocated peak fits
// are those for the allocator's slack (*slack: how many). When none fits: the last setup tried,
// its step alone where that does not fit either. The prune drops each step, the slowest
// technique first, whose removal still fits: replayed for a step added for the slack, judged by
// the step alone for the others, and the plan left replayed once (*alone 1 where that fits, -1
// where not); where it does not, each removal replayed. The first pass stops the greedy pass,
// unreplayed, at a step alone that leaves an eighth of the device free, and keeps its plan where
// the plan left (or that step, where the prune drops nothing) fits replayed; else the search
// runs again without that stop (*deferred: 1 where the first pass's plan was kept, -1 where
// not, 0 where it did not stop so). Returns the number of steps; *plan gets the estimate of the
// setup they arrive at.
static uint32_t ref_plan(const mn_model *m, const mn_estimate_result *given, uint8_t *steps,
                         mn_estimate_result *plan, int *alone, uint32_t *slack, int *deferred) {
    mn_setup base = given->setup, s, t;
    mn_estimate_result q, qn, cur;
    uint32_t n, i, k, from;  // (from: the first step added for the slack)
    int bf16 = given->gpu.bf16, progress, pass, defer, stop, stopped;
    *deferred = 0;
    for (defer = 1;; defer = 0) {
        uint64_t room = defer ? given->capacity - given->capacity / 8 : 0;
        s = base, cur = *given, n = 0, from = 32, progress = 1, stop = stopped = 0, *alone = 0;
        t = s, t.no_replay = 1;
        CHECK_OK(mn_estimate(m, &t, &q));
        if (q.fits) from = 0;
        while (!cur.fits && progress && n < 32) {
            progress = 0;
            for (k = 0; k < MN__T_COUNT && !progress; k++) {
                t = s;
                if (!mn__tech_apply((mn__tech)k, &t, bf16)) continue;
                t.no_replay = 1;
                CHECK_OK(mn_estimate(m, &t, &qn));
                if (qn.peak_allocated >= q.peak_allocated) continue;
                t.no_replay = 0;
                steps[n++] = (uint8_t)k, s = t, q = qn, progress = 1;
                if (n > 1 && q.fits && q.device_used <= room) {
                    cur = q, stop = stopped = 1;
                    break;
                }
                CHECK_OK(mn_estimate(m, &s, &cur));
                if (q.fits && !cur.fits && from > n) from = n;
            }
        }
        *slack = n > from ? n - from : 0;
        if (!cur.fits && n > 0) {  // (the last tried; the step alone where that does not fit)
            if (q.fits) CHECK_OK(mn_estimate(m, &s, &cur));
            else cur = q;
        }
        for (pass = 0; pass < 2 && cur.fits && n > 0; pass++) {
            uint8_t kept[32];
            uint32_t j = n, f = from;
            mn_estimate_result r = cur;
            memcpy(kept, steps, n);
            t = s;
            for (k = MN__T_COUNT; k-- > 0;) {
                for (i = j; i-- > 0;) {
                    mn_setup u;
                    if (kept[i] != k) continue;
                    u = mn__plan_setup(&base, kept, j, i, bf16);
                    u.no_replay = pass == 0 && i < f;
                    CHECK_OK(mn_estimate(m, &u, &qn));
                    if (!qn.fits) continue;
                    memmove(&kept[i], &kept[i + 1], (j - i - 1) * sizeof kept[0]);
                    j--, t = u, r = qn;
                    if (i < f) f--;
                }
            }
            if (pass == 0 && j < n) {  // (the plan left, replayed)
                t.no_replay = 0;
                CHECK_OK(mn_estimate(m, &t, &r));
                *alone = r.fits ? 1 : -1;
                if (!r.fits) {
                    if (stop) break;  // (the search again, without the stop)
                    continue;
                }
                stop = 0;
            }
            memcpy(steps, kept, j), n = j, cur = r;
            break;
        }
        if (stop && *alone == 0) {  // (nothing dropped: that step, replayed)
            t = s, t.no_replay = 0;
            CHECK_OK(mn_estimate(m, &t, &cur));
            if (cur.fits) stop = 0;
        }
        if (stopped) *deferred = stop ? -1 : 1;
        if (!stop) break;
    }
    *plan = cur;
    return n;
}

// mn_fit's plan against ref_plan: the same steps, setup and estimate, on setups placed about
// their allocator slack or well below their allocated peak (so that both the plan by the step
// alone and the replayed search decide some of them), and on a device too small for any plan.
void test_fit_plan_reference(void) {
    int it, by_alone = 0, by_replay = 0, by_slack = 0, none = 0, kept = 0, again = 0;
    for (it = 0; it < 320 || !by_alone || !by_replay || !by_slack || !none || !kept || !again;
         it++) {
        mn_model m = random_model();
        mn_setup s = random_setup();
        mn_estimate_result given, want;
        mn_fit_result f;
        uint8_t steps[32];
        uint32_t n, i;
        int alone, deferred;
        uint32_t slack;
        if (it >= 600) break;
        if (s.framework == MN_FW_DEEPSPEED) s.framework = MN_FW_HF, s.zero_stage = 0, s.offload = 0;
        s.batch = 2 + mnt_rand_u64() % 7;  // (room to halve)
        // (blocks rounded up to powers of two: slack beyond an eighth of the device, so that a
        // step alone that leaves that free may not fit replayed)
        if (it % 4 == 1) s.alloc_conf = "roundup_power2_divisions:1";
        if (!place_capacity(&m, &s)) continue;
        if (mn_estimate(&m, &s, &given) != MN_OK) continue;
        if (it % 8 == 7) {  // (no plan fits)
            s.capacity = s.context + (64 << 10);
        } else if (it % 8 > 3) {  // (room to spare once the plan is made)
            double f = 0.3 + 0.6 * mnt_rand_uniform();
            s.capacity = s.context + (uint64_t)((double)given.peak_allocated * f);
        }
        if (mn_estimate(&m, &s, &given) != MN_OK || given.fits) continue;
        if (mn_fit(&m, &s, &f) != MN_OK) continue;
        n = ref_plan(&m, &given, steps, &want, &alone, &slack, &deferred);
        by_alone += alone == 1, by_replay += alone == -1;
        kept += deferred == 1, again += deferred == -1;
        by_slack += slack > 0 && alone != 0 && want.fits;
        none += !want.fits;
        CHECK_MSG(f.plan_len == n && f.plan_found == want.fits,
                  "case %d: %u steps (found %d), reference %u (found %d, by the step alone %d, "
                  "%u for the slack)", it, f.plan_len, f.plan_found, n, want.fits, alone, slack);
        for (i = 0; i < n && i < f.plan_len; i++) {
            mn_setup u = given.setup;
            char what[sizeof f.plan[0].what];
            uint32_t j;
            for (j = 0; j <= i; j++) mn__tech_apply((mn__tech)steps[j], &u, given.gpu.bf16);
            mn__tech_describe((mn__tech)steps[i], &u, what, sizeof what);
            CHECK_MSG(!strcmp(f.plan[i].what, what), "case %d step %u: %s, reference %s", it, i,
                      f.plan[i].what, what);
        }
        same_estimate(&f.plan_estimate, &want, it);
    }
    CHECK_MSG(by_alone && by_replay && by_slack && none && kept && again,
              "%d fits: %d plans pruned by the step alone, %d by replays where that plan did not "
              "fit, %d with steps for the slack, %d none; %d plans of the deferred pass kept, %d "
              "searched again", it, by_alone, by_replay, by_slack, none, kept, again);
}

// A fit's state as mn__fit_with sets it up (the replay memo on), for calling its entries alone.
static mn__fit *fit_new(const mn_model *m, mn_fit_result *fo) {
    mn__fit *F = (mn__fit *)calloc(1, sizeof *F);
    if (!F) return NULL;
    memset(fo, 0, sizeof *fo);
    F->m = m, F->out = fo, F->S.rmemo = &F->rmemo;
    return F;
}

static void fit_free(mn__fit *F) {
    mn__sim_free(&F->S);
    mn__replay_memo_free(&F->rmemo);
    free(F);
}

// Setup j of the model's fit (s0's model with another batch) into *s, and its step alone (the
// estimate with no_replay set) into *quick; 0 where that estimate fails.
static int fit_setup(const mn_model *m, const mn_setup *s0, int j, mn_setup *s,
                     mn_estimate_result *quick) {
    mn_setup u;
    *s = *s0;
    s->batch = 1 + (s0->batch + (uint64_t)j * 3) % 8;
    u = *s, u.no_replay = 1;
    return mn_estimate(m, &u, quick) == MN_OK;
}

// mn__fit_entry with a bound (below): its step alone equal to the estimate with no_replay set;
// replayed exactly when that fits and its peak allocated is below the bound, the replay then
// equal to the whole estimate ("does not fit" where it stopped at an out-of-memory). Several
// setups of one model share a fit, as the greedy pass's candidates do.
void test_fit_entry_below(void) {
    int it, replayed = 0, bounded = 0, alone_out = 0;
    for (it = 0; it < 60 || !replayed || !bounded || !alone_out; it++) {
        mn_model m = random_model();
        mn_setup s0 = random_setup();
        mn__fit *F;
        mn_fit_result fo;
        int j;
        if (it >= 400) break;
        if (!place_capacity(&m, &s0)) continue;
        if (!(F = fit_new(&m, &fo))) return;
        for (j = 0; j < 3; j++) {
            mn_setup s;
            mn_estimate_result quick, whole;
            mn__fit_memo *e;
            uint64_t below;
            if (!fit_setup(&m, &s0, j, &s, &quick)) continue;
            switch (mnt_rand_u64() % 4) {  // none, below the peak, at it, above it
            case 0: below = 0; break;
            case 1: below = quick.peak_allocated / 2 + 1; break;
            case 2: below = quick.peak_allocated; break;
            default: below = quick.peak_allocated + 1 + mnt_rand_u64() % 4096; break;
            }
            e = mn__fit_entry(F, &s, 1, 1, below, 0);
            CHECK_OK(e->quick_err);
            if (e->quick_err != MN_OK) continue;
            same_estimate(&e->quick, &quick, it);
            if (!quick.fits) {
                alone_out++;
                CHECK_EQ_INT(e->has_full, 0);
                continue;
            }
            if (below && quick.peak_allocated >= below) {
                bounded++;
                CHECK_EQ_INT(e->has_full, 0);
                continue;
            }
            replayed++;
            CHECK(e->has_full == 1 || e->has_full == 2);
            CHECK_OK(e->full_err);
            CHECK_OK(estimate_unique_ids(&m, &s, &whole));
            if (e->has_full == 2) CHECK_MSG(!whole.fits, "case %d: stopped, but it fits", it);
            else if (e->has_full == 1) same_estimate(&e->full, &whole, it);
        }
        fit_free(F);
    }
    if (mnt_verbose())
        printf("       %d models: %d replayed, %d above the bound, %d not fitting alone\n", it,
               replayed, bounded, alone_out);
    CHECK_MSG(replayed && bounded && alone_out, "outcomes not all seen: %d replayed, %d bounded, "
              "%d not fitting alone", replayed, bounded, alone_out);
}

// mn__fit_entry with cut set, as a fit's probes ask (mn__fits, and the searches' first value):
// cut short only where the step alone does not fit, its answer (mn__fits) that of the whole
// estimate, its result otherwise the step alone's; asked again without cut, the same setup gets
// the step alone whole. Several setups of one model share a fit.
void test_fit_entry_cut(void) {
    int it, cut = 0, fitting = 0;
    for (it = 0; it < 60 || !cut || !fitting; it++) {
        mn_model m = random_model();
        mn_setup s0 = random_setup();
        mn__fit *F;
        mn_fit_result fo;
        int j;
        if (it >= 400) break;
        if (!place_capacity(&m, &s0)) continue;
        if (!(F = fit_new(&m, &fo))) return;
        for (j = 0; j < 3; j++) {
            mn_setup s;
            mn_estimate_result quick, whole, r;
            mn__fit_memo *e;
            mn_result err = MN_OK;
            int fits, replay = (int)(mnt_rand_u64() % 2);
            if (!fit_setup(&m, &s0, j, &s, &quick)) continue;
            CHECK_OK(estimate_unique_ids(&m, &s, &whole));
            if (replay) {  // (mn__fits: its entry, with the replay when the step alone fits)
                fits = mn__fits(F, &s, &r, &err, 0);
                CHECK_OK(err);
                CHECK_EQ_INT(fits, whole.fits);
                e = mn__fit_entry(F, &s, 1, 1, 0, 1);  // (the entry it made)
            } else {
                e = mn__fit_entry(F, &s, 0, 0, 0, 1);
            }
            CHECK_OK(e->quick_err);
            CHECK_EQ_INT(e->quick.fits, quick.fits);
            if (e->cut) {
                cut++;
                CHECK_MSG(!quick.fits, "case %d: cut short, but the step alone fits", it);
                CHECK_EQ_INT(e->has_full, 0);
            } else {
                same_estimate(&e->quick, &quick, it);
            }
            fitting += quick.fits;
            e = mn__fit_entry(F, &s, 0, 0, 0, 0);  // (asked whole: run again when cut short)
            CHECK_OK(e->quick_err);
            CHECK_EQ_INT(e->cut, 0);
            same_estimate(&e->quick, &quick, it);
        }
        fit_free(F);
    }
    if (mnt_verbose())
        printf("       %d models: %d cut short, %d fitting alone\n", it, cut, fitting);
    CHECK_MSG(cut && fitting, "outcomes not all seen: %d cut short, %d fitting alone", cut,
              fitting);
}

// mn_cache_check is the oracle of the allocator's tests, so it must see damage: each kind it
// looks for, done by hand to a real cache (a large segment of 2 MiB blocks with a free one
// between two allocated ones), is reported as MN_ERR_STATE with a message naming it, and once
// undone the cache checks clean again.
void test_cache_check_detects(void) {
    mn_sim_cache e;
    mn_cache_desc cd;
    char msg[256] = "";
    void *p[6];
    mn__c_cache *c;
    mn__c_block *a, *f = NULL;
    uint64_t keep;
    int i;
    memset(&cd, 0, sizeof cd);
    cd.logger.log_fn = keep_message, cd.logger.user_data = msg;
    CHECK_OK(mn_sim_cache_init(&e, NULL, &cd));
    for (i = 0; i < 6; i++)
        CHECK_OK(mn_cache_alloc(&e.cache, 2u << 20, 0, MN_CAT_OTHER, NULL, &p[i]));
    CHECK_OK(mn_cache_release(&e.cache, p[2]));
    CHECK_OK(mn_cache_check(&e.cache));
    c = e.cache.p;
    CHECK(c->segs && !c->segs->next_seg);
    if (!c->segs) goto done;
    a = c->segs->head;
    for (f = a; f && (f->allocated || !f->in_tree); f = f->next) continue;
    CHECK(a && a->allocated && f && f->next && f->next->allocated);
    if (!a || !f || !f->next) goto done;
#define DAMAGED(what)                                                                          \
    do {                                                                                       \
        msg[0] = 0;                                                                            \
        CHECK_ERR(mn_cache_check(&e.cache), MN_ERR_STATE);                                     \
        CHECK_MSG(strstr(msg, what) != NULL, "want \"%s\", the check said \"%s\"", what, msg); \
    } while (0)
    a->size += 512;  // a block longer than its place
    DAMAGED("does not tile its segment");
    a->size -= 512;
    f->next->prev_free = 0;  // the block after a free one says its prev is in no pool
    DAMAGED("follows a free block");
    f->next->prev_free = 1;
    f->in_tree = 0;  // a free block out of its pool
    DAMAGED("not in its pool");
    f->in_tree = 1;
    keep = c->st.allocated_bytes[MN_STAT_LARGE_POOL].current;  // a statistic off the blocks
    c->st.allocated_bytes[MN_STAT_LARGE_POOL].current += 512;
    DAMAGED("allocated_bytes[");
    c->st.allocated_bytes[MN_STAT_LARGE_POOL].current = keep;
    c->total_allocated_memory += 2u << 20;  // reserved bytes the segments do not hold
    DAMAGED("total_allocated_memory");
    c->total_allocated_memory -= 2u << 20;
    c->segs->head = a->next;  // a segment that starts past its first block
    DAMAGED("head");
    c->segs->head = a;
#undef DAMAGED
    CHECK_OK(mn_cache_check(&e.cache));
done:
    mn_sim_cache_free(&e);
}
