// Tests of the >>types section: checked arithmetic, sizes, names.
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "../memanat.h"

static void test_checked_arith(void) {
    uint64_t r = 0, a, b;
    int i;
    CHECK_OK(mn_mul_u64(1ull << 32, 1ull << 31, &r));
    CHECK_EQ_U64(r, 1ull << 63);
    CHECK_ERR(mn_mul_u64(1ull << 32, 1ull << 32, &r), MN_ERR_OVERFLOW);
    CHECK_ERR(mn_add_u64(UINT64_MAX, 1, &r), MN_ERR_OVERFLOW);
    CHECK_OK(mn_add_u64(UINT64_MAX - 5, 5, &r));
    CHECK_EQ_U64(r, UINT64_MAX);
    for (i = 0; i < 10000; i++) {  // against 128-bit arithmetic where the compiler has it
        a = mnt_rand_u64() >> (mnt_rand_u64() % 64);
        b = mnt_rand_u64() >> (mnt_rand_u64() % 64);
#ifdef __SIZEOF_INT128__
        {
            __extension__ typedef unsigned __int128 u128;
            u128 p = (u128)a * b;
            mn_result res = mn_mul_u64(a, b, &r);
            CHECK_EQ_INT(res == MN_OK, p <= UINT64_MAX);
            if (res == MN_OK) CHECK_EQ_U64(r, (uint64_t)p);
        }
#endif
        CHECK_EQ_INT(mn_add_u64(a, b, &r) == MN_OK, a <= UINT64_MAX - b);
    }
}

static void test_size_parse(void) {
    static const struct { const char *s; uint64_t want; } ok[] = {
        {"0", 0}, {"512", 512}, {"4B", 4}, {"2KB", 2000}, {"2KiB", 2048}, {"1343MiB", 1343ull << 20},
        {"16GiB", 16ull << 30}, {"1.5GB", 1500000000ull}, {"80gb", 80000000000ull},
        {"0.5GiB", 1ull << 29}, {"1TiB", 1ull << 40}, {"18446744073709551615", UINT64_MAX},
        // exact at any size, to the nearest byte (a half up)
        {"9007199254740993.25", 9007199254740993ull}, {"18446744073.709551615GB", UINT64_MAX},
        {"1.5", 2}, {"0.5B", 1}, {"0.49999999999999999999999", 0}, {"2.5KiB", 2560},
        {"1.0000000001KiB", 1024}, {"0.0009765625KiB", 1}, {"0.00048828125KiB", 1},
        {"0.00048828124KiB", 0}, {"3.", 3}, {"12.345678901234567890123456789TB", 12345678901235ull},
    };
    static const char *const bad[] = {"", "GiB", "-1", "1.5.5", "12 parsecs", "1e3", "0x10",
                                      "18446744073709551616", "99999999999TiB", "1GiBB", ".",
                                      "18446744073.7095516155GB", "16777216TiB"};
    uint64_t v = 0;
    size_t i;
    int k;
    for (k = 0; k < 2000; k++) {  // bytes written in TiB, exactly (r / 2^40 has 40 decimals)
        uint64_t b = mnt_rand_u64() >> (mnt_rand_u64() % 64), r = b & ((1ull << 40) - 1);
        char txt[80];
        int n = snprintf(txt, sizeof txt, "%llu.", (unsigned long long)(b >> 40)), d;
        for (d = 0; d < 40; d++) {
            r *= 10;
            txt[n++] = (char)('0' + (r >> 40));
            r &= (1ull << 40) - 1;
        }
        memcpy(txt + n, "TiB", 4);
        CHECK_OK(mn_size_parse(txt, &v));
        CHECK_MSG(v == b, "%s parsed as %llu, want %llu", txt, (unsigned long long)v,
                  (unsigned long long)b);
    }
    for (i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        CHECK_OK(mn_size_parse(ok[i].s, &v));
        CHECK_EQ_U64(v, ok[i].want);
    }
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(mn_size_parse(bad[i], &v) != MN_OK, "\"%s\" parsed as %llu", bad[i], (unsigned long long)v);
}

static void test_size_format(void) {
    char buf[32];
    mn_size_format(512, buf, sizeof buf);
    CHECK_STR(buf, "512 B");
    mn_size_format(1536ull << 20, buf, sizeof buf);
    CHECK_STR(buf, "1.50 GiB");
    mn_size_format(UINT64_MAX, buf, sizeof buf);
    CHECK_STR(buf, "16.00 EiB");
}

static void test_names(void) {
    int c;
    CHECK_STR(mn_category_name(MN_CAT_WEIGHTS), "weights");
    CHECK_STR(mn_category_name(MN_CAT_KV_CACHE), "kv_cache");
    for (c = 0; c < MN_CAT_COUNT; c++) CHECK(strcmp(mn_category_name((mn_category)c), "unknown") != 0);
    CHECK_EQ_U64(mn_dtype_bits(MN_BF16), 16);
    CHECK_EQ_U64(mn_dtype_bits(MN_NF4), 4);
    CHECK_STR(mn_result_str(MN_ERR_OVERFLOW), "size overflows 64 bits");
}

// Every name of every setting parses back to its value, in any case; 0 (the default) names the
// default's value; a name no table holds and a value past the table are refused or "unknown".
#define NAMES_ROUND_TRIP(fn, type, count)                                                        \
    do {                                                                                         \
        int v_;                                                                                  \
        type got_;                                                                               \
        for (v_ = 0; v_ < (count); v_++) {                                                       \
            const char *n_ = mn_##fn##_name((type)v_);                                           \
            char up_[32];                                                                        \
            size_t k_;                                                                           \
            CHECK_MSG(strcmp(n_, "unknown") != 0, #fn " %d has no name", v_);                  \
            CHECK_OK(mn_##fn##_parse(n_, &got_));                                                \
            CHECK_STR(mn_##fn##_name(got_), n_);                                                 \
            CHECK_MSG(v_ == 0 || (int)got_ == v_, #fn " \"%s\" parses to %d, not %d", n_,       \
                      (int)got_, v_);                                                            \
            for (k_ = 0; n_[k_] && k_ + 1 < sizeof up_; k_++) up_[k_] = (char)toupper(n_[k_]);  \
            up_[k_] = 0;                                                                         \
            CHECK_OK(mn_##fn##_parse(up_, &got_));                                               \
            CHECK_STR(mn_##fn##_name(got_), n_);                                                 \
        }                                                                                        \
        CHECK_STR(mn_##fn##_name((type)(count)), "unknown");                                     \
        CHECK(mn_##fn##_parse("no-such-name", &got_) != MN_OK);                                  \
        CHECK_ERR(mn_##fn##_parse(NULL, &got_), MN_ERR_INVALID_ARG);                             \
        CHECK_ERR(mn_##fn##_parse(mn_##fn##_name((type)1), NULL), MN_ERR_INVALID_ARG);          \
    } while (0)

static void test_names_round_trip(void) {
    // the snapshot's strings, as PyTorch's _memory_viz and CUDACachingAllocator write them
    // (shared/reference/allocator.md: block "state" and trace "action")
    static const char *const states[] = {"active_allocated", "active_pending_free", "inactive"};
    static const char *const actions[] = {"alloc", "free_requested", "free_completed",
                                          "segment_alloc", "segment_free", "segment_map",
                                          "segment_unmap", "oom"};
    int i, j;
    NAMES_ROUND_TRIP(precision, mn_precision, MN_PREC_COUNT);
    NAMES_ROUND_TRIP(optim, mn_optim, MN_OPTIM_COUNT);
    NAMES_ROUND_TRIP(ckpt, mn_ckpt, MN_CKPT_COUNT);
    NAMES_ROUND_TRIP(attn, mn_attn, MN_ATTN_COUNT);
    NAMES_ROUND_TRIP(framework, mn_framework, MN_FW_COUNT);
    NAMES_ROUND_TRIP(offload, mn_offload, MN_OFFLOAD_COUNT);
    NAMES_ROUND_TRIP(quant, mn_quant, MN_QUANT_COUNT);
    NAMES_ROUND_TRIP(head, mn_head, MN_HEAD_COUNT);
    NAMES_ROUND_TRIP(optim_impl, mn_optim_impl, MN_OPTIM_IMPL_COUNT);
    NAMES_ROUND_TRIP(loop, mn_loop, MN_LOOP_COUNT);
    for (i = 0; i < MN_ARCH_COUNT; i++) CHECK(strcmp(mn_arch_name((mn_arch)i), "unknown") != 0);
    CHECK_STR(mn_arch_name(MN_ARCH_COUNT), "unknown");
    for (i = 1; i < MN_BLOCK_STATE_COUNT; i++)
        CHECK_STR(mn_block_state_name((mn_block_state)i), states[i - 1]);
    CHECK_EQ_INT(MN_BLOCK_STATE_COUNT - 1, sizeof states / sizeof states[0]);
    CHECK_STR(mn_block_state_name(MN_BLOCK_STATE_COUNT), "unknown");
    for (i = 1; i < MN_TRACE_ACTION_COUNT; i++)
        CHECK_STR(mn_trace_action_name((mn_trace_action)i), actions[i - 1]);
    CHECK_EQ_INT(MN_TRACE_ACTION_COUNT - 1, sizeof actions / sizeof actions[0]);
    CHECK_STR(mn_trace_action_name(MN_TRACE_ACTION_COUNT), "unknown");
    // each framework's description starts with its name and a colon, and no two are the same
    for (i = 1; i < MN_FW_COUNT; i++) {
        const char *d = mn_framework_describe((mn_framework)i), *n = mn_framework_name((mn_framework)i);
        CHECK_MSG(strncmp(d, n, strlen(n)) == 0 && d[strlen(n)] == ':', "\"%s\" for %s", d, n);
        for (j = 1; j < i; j++) CHECK(strcmp(d, mn_framework_describe((mn_framework)j)) != 0);
    }
    CHECK_STR(mn_framework_describe(MN_FW_DEFAULT), mn_framework_describe(MN_FW_HF));
}

// The adapters' targets: a comma list of module names, any case, or "all".
static void test_lora_targets_parse(void) {
    static const char *const bad[] = {"q,x", "q,,v", "q,", ",q", "qq", "all,", "q v"};
    uint32_t t = 0;
    size_t i;
    CHECK_OK(mn_lora_targets_parse("q,v", &t));
    CHECK_EQ_U64(t, MN_LORA_Q | MN_LORA_V);
    CHECK_OK(mn_lora_targets_parse("Gate,UP,down,o,k", &t));
    CHECK_EQ_U64(t, MN_LORA_GATE | MN_LORA_UP | MN_LORA_DOWN | MN_LORA_O | MN_LORA_K);
    CHECK_OK(mn_lora_targets_parse("all", &t));
    CHECK_EQ_U64(t, MN_LORA_ALL);
    CHECK_OK(mn_lora_targets_parse("v,q,v", &t));
    CHECK_EQ_U64(t, MN_LORA_Q | MN_LORA_V);
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        t = 12345;
        CHECK_MSG(mn_lora_targets_parse(bad[i], &t) == MN_ERR_NOT_FOUND && t == 12345,
                  "\"%s\" was taken", bad[i]);
    }
    CHECK_ERR(mn_lora_targets_parse("", &t), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_lora_targets_parse(NULL, &t), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_lora_targets_parse("q", NULL), MN_ERR_INVALID_ARG);
}

// NULL where a public function needs a pointer: an mn_result, never a crash (the library's
// functions with no result to return ignore it).
static void test_null_arguments(void) {
    mnt_buf buf = {NULL, 0, 0};
    uint64_t u = 0;
    mn_model m;
    mn_setup s;
    mn_estimate_result r;
    memset(&m, 0, sizeof m), memset(&s, 0, sizeof s);
    CHECK_ERR(mn_mul_u64(1, 2, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_add_u64(1, 2, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_size_parse(NULL, &u), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_dynamic_map(1, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_estimate(NULL, &s, &r), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_estimate(&m, &s, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_fit(&m, &s, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_cache_alloc(NULL, 1, 0, MN_CAT_OTHER, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_cache_replay(NULL, NULL, 0, 0, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_cache_config_parse(NULL, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_hf_config_read(NULL, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_adamw_step(NULL, NULL, NULL, NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_precision_parse("fp32", NULL), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_cache_write_file(stdout, NULL, 1), MN_ERR_INVALID_ARG);
    CHECK_OK(mn_cache_write_file(stdout, NULL, 0));
    {  // a device of no device has no functions, and a cache refuses it
        mn_cache c;
        mn_cache_desc cd;
        mn_device d = mn_simdev_device(NULL), h = mn_hostdev_device(NULL);
        CHECK(!d.alloc_fn && !d.free_fn && !d.user_data && !h.alloc_fn && !h.user_data);
        memset(&cd, 0, sizeof cd);
        cd.device = d;
        CHECK_ERR(mn_cache_init(&c, &cd), MN_ERR_INVALID_ARG);
    }
    {  // a snapshot whose array is missing for its count, and Philox without its arrays
        mn_cache_snapshot snap;
        uint32_t ctr[4] = {1, 2, 3, 4}, out[4] = {7, 7, 7, 7};
        memset(&snap, 0, sizeof snap);
        CHECK_OK(mn_cache_snapshot_write_json(&snap, mnt_buf_write, &buf));
        snap.segment_count = 1;
        CHECK_ERR(mn_cache_snapshot_write_json(&snap, mnt_buf_write, &buf), MN_ERR_INVALID_ARG);
        snap.segment_count = 0, snap.trace_count = 2;
        CHECK_ERR(mn_cache_timeline_svg(&snap, NULL, mnt_buf_write, &buf), MN_ERR_INVALID_ARG);
        snap.trace_count = 0, snap.block_count = 3;
        CHECK_ERR(mn_cache_timeline_svg(&snap, NULL, mnt_buf_write, &buf), MN_ERR_INVALID_ARG);
        mn_philox4x32(NULL, 1, out);
        CHECK(out[0] == 7 && out[3] == 7);
        mn_philox4x32(ctr, 1, NULL);
        free(buf.p);
    }
    CHECK_EQ_U64(mn_simdev_pending_events(NULL), 0);
    mn_simdev_fail_alloc_at(NULL, 1);
    mn_simdev_complete_event(NULL, 1);
    mn_simdev_sync_stream(NULL, 1);
    mn_simdev_sync(NULL);
    mn_size_format(1, NULL, 0);
    mn_json_free(NULL);
    mn_cache_free(NULL);
    mn_sim_cache_free(NULL);
}

const mnt_case test_types_cases[] = {
    {"checked_arith", test_checked_arith},
    {"size_parse", test_size_parse},
    {"size_format", test_size_format},
    {"names", test_names},
    {"names_round_trip", test_names_round_trip},
    {"lora_targets_parse", test_lora_targets_parse},
    {"null_arguments", test_null_arguments},
};
const size_t test_types_count = sizeof test_types_cases / sizeof test_types_cases[0];
