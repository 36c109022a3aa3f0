// Tests of the >>types section: checked arithmetic, sizes, names.
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
    };
    static const char *const bad[] = {"", "GiB", "-1", "1.5.5", "12 parsecs", "1e3", "0x10",
                                      "18446744073709551616", "99999999999TiB", "1GiBB"};
    uint64_t v = 0;
    size_t i;
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

// NULL where a public function needs a pointer: an mn_result, never a crash (the library's
// functions with no result to return ignore it).
static void test_null_arguments(void) {
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
    {"null_arguments", test_null_arguments},
};
const size_t test_types_count = sizeof test_types_cases / sizeof test_types_cases[0];
