// Tests of the json section: the strict JSON reader (RFC 8259), the writing helpers and the
// safetensors header reader.
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "../memanat.h"

// Parses text (NUL-terminated) and returns the result; the document is freed.
static int parse_str(const char *text, uint32_t max_depth) {
    mn_json_doc doc;
    mn_json_desc desc;
    int r;
    memset(&desc, 0, sizeof desc);
    desc.max_depth = max_depth;
    r = (int)mn_json_parse(text, strlen(text), &desc, &doc);
    if (r == MN_OK)
        CHECK_MSG(doc.root != NULL && doc.error[0] == 0, "success without a root");
    else
        CHECK_MSG(doc.root == NULL && doc.error[0] != 0, "failure without a message: %s", text);
    mn_json_free(&doc);
    return r;
}

static void test_valid_corpus(void) {
    static const char *const ok[] = {
        "0",
        "-0",
        "1",
        "-1",
        "1.5",
        "-1.5e10",
        "1E+2",
        "1e-2",
        "0.000001",
        "123456789012345678901234567890",
        "true",
        "false",
        "null",
        "\"\"",
        "\"a\"",
        "[]",
        "{}",
        " [ ] ",
        "\t\n\r [1, 2 ,3 ] \n",
        "[[],[[]],{}]",
        "{\"a\":{\"b\":{\"c\":[1,{\"d\":null}]}}}",
        "\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"",
        "\"\\u0041\\u00e9\\u20ac\\ud83d\\ude00\"",
        "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"",
        "{\"a\":1,\"b\":2,\"A\":3,\"a \":4}",
        "{\"\":0}",
        "[true,false,null,0,\"x\",[],{}]",
        "\"\\u0000\"",
        "{\"a\":\"\\u0061\",\"b\":\"a\"}",
        "1e308",
        "-1e-400",
        "[-0.0e-0]",
        "\"\xed\x9f\xbf\xee\x80\x80\xf4\x8f\xbf\xbf\"",
        "\"\x7f\"",
    };
    size_t k;
    for (k = 0; k < sizeof ok / sizeof ok[0]; k++)
        CHECK_MSG(parse_str(ok[k], 0) == MN_OK, "valid document %zu rejected: %s", k, ok[k]);
}

// Every rejection rule, with the byte offset of the error where it is well defined.
static void test_invalid_corpus(void) {
    static const struct {
        const char *text;
        long offset;
    } bad[] = {
        {"", 0},
        {"   ", 3},
        {"[1,]", 3},
        {"{\"a\":1,}", 7},
        {"[,1]", 1},
        {"[1 2]", 3},
        {"{\"a\" 1}", 5},
        {"{a:1}", 1},
        {"{\"a\":}", 5},
        {"{1:2}", 1},
        {"// c\n1", 0},
        {"/* c */ 1", 0},
        {"1 // c", 2},
        {"01", 0},
        {"-01", 0},
        {"00", 0},
        {"1.", 2},
        {".5", 0},
        {"1e", 2},
        {"1e+", 3},
        {"+1", 0},
        {"-", 0},
        {"- 1", 0},
        {"NaN", 0},
        {"Infinity", 0},
        {"-Infinity", 0},
        {"[nan]", 1},
        {"0x10", 1},
        {"1e999", 0},
        {"-1e400", 0},
        {"tru", 0},
        {"nulll", 4},
        {"True", 0},
        {"'a'", 0},
        {"\"abc", 0},
        {"\"a\tb\"", 2},
        {"\"a\nb\"", 2},
        {"\"\\x41\"", 1},
        {"\"\\u12\"", 1},
        {"\"\\u12G4\"", 1},
        {"\"\\ud800\"", 1},
        {"\"\\udc00\"", 1},
        {"\"\\ude00\\ud83d\"", 1},
        {"\"\\ud83d\\u0041\"", 1},
        {"\"\\ud83dx\"", 1},
        {"\"\xc0\x80\"", 1},
        {"\"\xc1\xbf\"", 1},
        {"\"\xe0\x80\x80\"", 1},
        {"\"\xed\xa0\x80\"", 1},
        {"\"\xf0\x80\x80\x80\"", 1},
        {"\"\xf4\x90\x80\x80\"", 1},
        {"\"\xf5\x80\x80\x80\"", 1},
        {"\"\xff\"", 1},
        {"\"\x80\"", 1},
        {"\"\xc3\"", 1},
        {"\"\xe2\x82\"", 1},
        {"[1]x", 3},
        {"[1]]", 3},
        {"{}{}", 2},
        {"1 2", 2},
        {"[", 1},
        {"{", 1},
        {"[1", 2},
        {"{\"a\":1", 6},
        {"]", 0},
        {"}", 0},
        {"{\"a\":1,\"a\":2}", 12},
        {"{\"a\":1,\"\\u0061\":2}", 17},
        {"[{\"k\":[],\"x\":0,\"k\":{}}]", 21},
        {"\xef\xbb\xbf{}", 0},
        {"\xe2\x80\x8b[]", 0},
        {"[\x0c]", 1},
        {"[1,\v2]", 3},
    };
    size_t k;
    for (k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        mn_json_doc doc;
        int r = (int)mn_json_parse(bad[k].text, strlen(bad[k].text), NULL, &doc);
        CHECK_MSG(r == MN_ERR_PARSE, "invalid document %zu accepted (%d): %s", k, r, bad[k].text);
        CHECK_MSG(doc.root == NULL && doc.error[0], "document %zu: no message", k);
        CHECK_MSG((long)doc.error_offset == bad[k].offset,
                  "document %zu (%s): offset %llu want %ld (%s)", k, bad[k].text,
                  (unsigned long long)doc.error_offset, bad[k].offset, doc.error);
        mn_json_free(&doc);
    }
}

static void test_embedded_nul(void) {
    static const char a[] = "[1,\0 2]", b[] = "\"a\0b\"", c[] = "{}\0";
    mn_json_doc doc;
    CHECK_ERR(mn_json_parse(a, sizeof a - 1, NULL, &doc), MN_ERR_PARSE);
    CHECK_EQ_U64(doc.error_offset, 3);
    CHECK_ERR(mn_json_parse(b, sizeof b - 1, NULL, &doc), MN_ERR_PARSE);
    CHECK_EQ_U64(doc.error_offset, 2);
    CHECK_ERR(mn_json_parse(c, sizeof c - 1, NULL, &doc), MN_ERR_PARSE);
    CHECK_EQ_U64(doc.error_offset, 2);
    // the length is honoured: text after len is never read
    CHECK_OK(mn_json_parse("[1]xyz", 3, NULL, &doc));
    mn_json_free(&doc);
    CHECK_ERR(mn_json_parse(NULL, 0, NULL, &doc), MN_ERR_PARSE);
    CHECK_ERR(mn_json_parse(NULL, 3, NULL, &doc), MN_ERR_INVALID_ARG);
    CHECK_ERR(mn_json_parse("1", 1, NULL, NULL), MN_ERR_INVALID_ARG);
}

static void test_dom(void) {
    static const char text[] =
        "{\"name\": \"bert\", \"layers\": 24, \"ratio\": -2.5e-1, \"tags\": [\"a\", null, true, "
        "false], \"nested\": {\"x\": {}}, \"esc\": \"\\u00e9\\n\\u0000z\"}";
    mn_json_doc doc;
    const mn_json_value *root, *v;
    uint64_t u = 0;
    double f = 0;
    CHECK_OK(mn_json_parse(text, sizeof text - 1, NULL, &doc));
    root = doc.root;
    if (!root) return;
    CHECK_EQ_INT(root->type, MN_JSON_OBJECT);
    CHECK_EQ_U64(root->len, 6);
    CHECK_STR(root->items[0].str, "name");
    CHECK_STR(mn_json_get(root, "name")->str, "bert");
    CHECK_EQ_U64(mn_json_get(root, "name")->len, 4);
    CHECK_OK(mn_json_u64(mn_json_get(root, "layers"), &u));
    CHECK_EQ_U64(u, 24);
    CHECK_STR(mn_json_get(root, "layers")->str, "24");
    CHECK_OK(mn_json_f64(mn_json_get(root, "ratio"), &f));
    CHECK_NEAR(f, -0.25, 0, 0);
    CHECK_STR(mn_json_get(root, "ratio")->str, "-2.5e-1");
    CHECK_ERR(mn_json_u64(mn_json_get(root, "ratio"), &u), MN_ERR_INVALID_ARG);
    v = mn_json_get(root, "tags");
    CHECK_EQ_INT(v->type, MN_JSON_ARRAY);
    CHECK_EQ_U64(v->len, 4);
    CHECK_EQ_INT(v->items[0].type, MN_JSON_STRING);
    CHECK_EQ_INT(v->items[1].type, MN_JSON_NULL);
    CHECK_EQ_INT(v->items[2].type, MN_JSON_TRUE);
    CHECK_EQ_INT(v->items[3].type, MN_JSON_FALSE);
    CHECK(mn_json_get(v, "a") == NULL);  // not an object
    CHECK_ERR(mn_json_f64(v, &f), MN_ERR_INVALID_ARG);
    v = mn_json_get(mn_json_get(root, "nested"), "x");
    CHECK(v && v->type == MN_JSON_OBJECT && v->len == 0);
    v = mn_json_get(root, "esc");
    CHECK_EQ_U64(v->len, 5);
    CHECK(memcmp(v->str, "\xc3\xa9\n\0z", 6) == 0);
    CHECK(mn_json_get(root, "missing") == NULL);
    CHECK(mn_json_get(NULL, "x") == NULL);
    CHECK_STR(mn_json_type_name(MN_JSON_OBJECT), "object");
    CHECK_STR(mn_json_type_name((mn_json_type)99), "invalid");
    mn_json_free(&doc);
    mn_json_free(&doc);  // twice is harmless
}

static void test_u64(void) {
    static const struct {
        const char *lit;
        int r;
        uint64_t v;
    } cases[] = {
        {"0", MN_OK, 0},
        {"-0", MN_OK, 0},
        {"-0.0e5", MN_OK, 0},
        {"7", MN_OK, 7},
        {"9007199254740993", MN_OK, 9007199254740993ull},  // 2^53 + 1: not a double
        {"18446744073709551615", MN_OK, 18446744073709551615ull},
        {"18446744073709551616", MN_ERR_OVERFLOW, 0},
        {"99999999999999999999", MN_ERR_OVERFLOW, 0},
        {"1e19", MN_OK, 10000000000000000000ull},
        {"1e20", MN_ERR_OVERFLOW, 0},
        {"1.8446744073709551615e19", MN_OK, 18446744073709551615ull},
        {"4.096e3", MN_OK, 4096},
        {"4096.000", MN_OK, 4096},
        {"1E+2", MN_OK, 100},
        {"100e-2", MN_OK, 1},
        {"120e-1", MN_OK, 12},
        {"123e-1", MN_ERR_INVALID_ARG, 0},
        {"2.5", MN_ERR_INVALID_ARG, 0},
        {"-1", MN_ERR_INVALID_ARG, 0},
        {"-1e3", MN_ERR_INVALID_ARG, 0},
        {"1e-999999999", MN_ERR_INVALID_ARG, 0},
        {"1e999999999999", MN_ERR_OVERFLOW, 0},
        {"0e999999999999", MN_OK, 0},
        {"00000000000000000000000000000000001", MN_OK, 1},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        // literals outside the JSON grammar (leading zeros, huge exponents) go through a value
        // built by hand: mn_json_u64 reads only the literal text
        mn_json_value v;
        uint64_t got = 12345;
        int r;
        memset(&v, 0, sizeof v);
        v.type = MN_JSON_NUMBER;
        v.str = cases[k].lit;
        r = (int)mn_json_u64(&v, &got);
        CHECK_MSG(r == cases[k].r, "%s: result %d want %d", cases[k].lit, r, cases[k].r);
        if (r == MN_OK)
            CHECK_MSG(got == cases[k].v, "%s: got %llu", cases[k].lit, (unsigned long long)got);
    }
    {
        mn_json_doc doc;
        uint64_t got = 0;
        CHECK_OK(mn_json_parse("[9007199254740993, \"5\", null]", 29, NULL, &doc));
        CHECK_OK(mn_json_u64(&doc.root->items[0], &got));
        CHECK_EQ_U64(got, 9007199254740993ull);
        CHECK_ERR(mn_json_u64(&doc.root->items[1], &got), MN_ERR_INVALID_ARG);
        CHECK_ERR(mn_json_u64(&doc.root->items[2], &got), MN_ERR_INVALID_ARG);
        CHECK_ERR(mn_json_u64(NULL, &got), MN_ERR_INVALID_ARG);
        mn_json_free(&doc);
    }
}

static void test_f64(void) {
    static const struct {
        const char *text;
        double v;
    } cases[] = {
        {"1.5", 1.5},
        {"-0.0", -0.0},
        {"1e308", 1e308},
        {"5e-324", 5e-324},
        {"1e-400", 0.0},
        {"123456789012345678901234567890", 1.2345678901234568e29},
        {"0.1", 0.1},
        {"2.2250738585072014e-308", 2.2250738585072014e-308},
        {"1.7976931348623157e308", 1.7976931348623157e308},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mn_json_doc doc;
        double got = -1;
        CHECK_OK(mn_json_parse(cases[k].text, strlen(cases[k].text), NULL, &doc));
        if (!doc.root) continue;
        CHECK_OK(mn_json_f64(doc.root, &got));
        CHECK_MSG(got == cases[k].v, "%s: got %.17g", cases[k].text, got);
        mn_json_free(&doc);
    }
    CHECK_EQ_INT(parse_str("1.7976931348623159e308", 0), MN_ERR_PARSE);  // rounds to infinity
}

static void test_unicode(void) {
    static const struct {
        const char *text;
        const char *want;
        uint32_t len;
    } cases[] = {
        {"\"\\u0041\"", "A", 1},
        {"\"\\u00e9\"", "\xc3\xa9", 2},
        {"\"\\u20AC\"", "\xe2\x82\xac", 3},
        {"\"\\uD83D\\uDE00\"", "\xf0\x9f\x98\x80", 4},
        {"\"\\udbff\\udfff\"", "\xf4\x8f\xbf\xbf", 4},
        {"\"\\u0000\"", "\0", 1},
        {"\"\\u007f\\u0080\"", "\x7f\xc2\x80", 3},
        {"\"\\u07ff\\u0800\"", "\xdf\xbf\xe0\xa0\x80", 5},
        {"\"\\uffff\"", "\xef\xbf\xbf", 3},
        {"\"a\\/b\"", "a/b", 3},
        {"\"\xf0\x9f\x98\x80x\"", "\xf0\x9f\x98\x80x", 5},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mn_json_doc doc;
        CHECK_OK(mn_json_parse(cases[k].text, strlen(cases[k].text), NULL, &doc));
        if (!doc.root) continue;
        CHECK_EQ_U64(doc.root->len, cases[k].len);
        CHECK_MSG(memcmp(doc.root->str, cases[k].want, cases[k].len) == 0 &&
                      doc.root->str[cases[k].len] == 0,
                  "case %zu decodes wrong", k);
        mn_json_free(&doc);
    }
}

static char *nested(size_t depth, char *buf) {
    size_t k;
    for (k = 0; k < depth; k++) buf[k] = '[';
    for (k = 0; k < depth; k++) buf[depth + k] = ']';
    buf[2 * depth] = 0;
    return buf;
}

static void test_depth(void) {
    static char buf[2 * 200001 + 1];
    mn_json_doc doc;
    CHECK_OK(parse_str(nested(128, buf), 0));
    CHECK_ERR(parse_str(nested(129, buf), 0), MN_ERR_PARSE);
    CHECK_OK(parse_str(nested(3, buf), 3));
    CHECK_ERR(parse_str(nested(4, buf), 3), MN_ERR_PARSE);
    CHECK_ERR(parse_str("{\"a\":{\"b\":{\"c\":{}}}}", 3), MN_ERR_PARSE);
    CHECK_OK(parse_str(nested(4096, buf), 100000));  // clamped to 4096
    CHECK_ERR(parse_str(nested(4097, buf), 100000), MN_ERR_PARSE);
    // a hostile depth is rejected without recursion
    nested(200000, buf);
    CHECK_ERR(mn_json_parse(buf, 200000, NULL, &doc), MN_ERR_PARSE);
    CHECK_EQ_U64(doc.error_offset, 128);
}

static void test_max_bytes(void) {
    mn_json_desc desc;
    mn_json_doc doc;
    memset(&desc, 0, sizeof desc);
    desc.max_bytes = 8;
    CHECK_OK(mn_json_parse("[1,2,3] ", 8, &desc, &doc));
    mn_json_free(&doc);
    CHECK_ERR(mn_json_parse("[1,2,3]  ", 9, &desc, &doc), MN_ERR_PARSE);
    CHECK(doc.error[0] != 0);
}

static void test_duplicates_large(void) {
    // 3000 distinct keys, then the same object with one key repeated far apart
    size_t cap = 3001 * 16 + 16, n = 0, k;
    char *buf = (char *)malloc(cap);
    mn_json_doc doc;
    n += (size_t)sprintf(buf + n, "{");
    for (k = 0; k < 3000; k++)
        n += (size_t)sprintf(buf + n, "%s\"k%zu\":%zu", k ? "," : "", k * 7919 % 3001, k);
    n += (size_t)sprintf(buf + n, "}");
    CHECK_OK(mn_json_parse(buf, n, NULL, &doc));
    if (doc.root) CHECK_EQ_U64(doc.root->len, 3000);
    CHECK(mn_json_get(doc.root, "k0") != NULL && mn_json_get(doc.root, "k1917") != NULL);
    CHECK(mn_json_get(doc.root, "k3001") == NULL);
    mn_json_free(&doc);
    n -= 1;
    n += (size_t)sprintf(buf + n, ",\"k%d\":0}", 7919 % 3001);
    CHECK_ERR(mn_json_parse(buf, n, NULL, &doc), MN_ERR_PARSE);
    CHECK_MSG(strstr(doc.error, "\"k1917\"") != NULL, "error does not name the key: %s", doc.error);
    free(buf);
}

// One parse under failure injection: a failed parse holds nothing, even before mn_json_free.
static mn_result parse_small_doc(void *ctx) {
    static const char text[] = "{\"a\":[1,2,{\"b\":\"c\",\"d\":[true,null]}],\"e\":\"f\\u00e9\"}";
    mn_json_doc doc;
    long live = mnt_live_allocs();
    mn_result r = mn_json_parse(text, sizeof text - 1, NULL, &doc);
    (void)ctx;
    if (r == MN_OK) {
        CHECK_EQ_U64(doc.root->len, 2);
    } else {
        CHECK(doc.root == NULL);
        CHECK_EQ_INT(mnt_live_allocs(), live);
    }
    mn_json_free(&doc);
    return r;
}

static void test_alloc_failure(void) {
    // succeeds at the third attempt: the tree block and the key sort buffer
    CHECK_EQ_INT(WALK_ALLOC_FAILURES(parse_small_doc, NULL, 49), 3);
}

static void test_allocator(void) {
    mnt_counting ca;
    mn_json_desc desc;
    mn_json_doc doc;
    memset(&desc, 0, sizeof desc);
    desc.allocator = mnt_counting_allocator(&ca);
    CHECK_OK(mn_json_parse("{\"a\":[1,2],\"b\":3}", 17, &desc, &doc));
    mn_json_free(&doc);
    CHECK_EQ_INT(ca.allocs, 2);
    CHECK_EQ_INT(ca.frees, 2);
}

// Random documents: generated text -> parse -> canonical text -> parse -> same canonical text.
static void gen_ws(mnt_buf *b) {
    static const char *const ws[] = {"", "", "", " ", "\n", "\t", " \r\n "};
    mnt_buf_str(b, ws[mnt_rand_u64() % 7]);
}

static void gen_string(mnt_buf *b) {
    size_t n = mnt_rand_u64() % 8, k;
    char tmp[16];
    mnt_buf_str(b, "\"");
    for (k = 0; k < n; k++) {
        uint64_t pick = mnt_rand_u64() % 6;
        if (pick == 0) {  // raw ASCII
            char c = (char)(' ' + mnt_rand_u64() % 95);
            if (c == '"' || c == '\\') mnt_buf_str(b, "\\");
            mnt_buf_put(b, &c, 1);
        } else if (pick == 1) {
            static const char *const esc[] = {"\\\"", "\\\\", "\\/", "\\b",
                                              "\\f",  "\\n",  "\\r", "\\t"};
            mnt_buf_str(b, esc[mnt_rand_u64() % 8]);
        } else if (pick == 2) {  // \u escape of a BMP non-surrogate
            unsigned cp = (unsigned)(mnt_rand_u64() % 0xd800);
            sprintf(tmp, "\\u%04x", cp);
            mnt_buf_str(b, tmp);
        } else if (pick == 3) {  // surrogate pair
            unsigned cp = 0x10000 + (unsigned)(mnt_rand_u64() % 0x100000);
            sprintf(tmp, "\\u%04X\\u%04X", 0xd800 + ((cp - 0x10000) >> 10),
                    0xdc00 + ((cp - 0x10000) & 0x3ff));
            mnt_buf_str(b, tmp);
        } else if (pick == 4) {
            mnt_buf_str(b, "\xe2\x82\xac");
        } else {
            mnt_buf_str(b, "\xf0\x9f\x98\x80");
        }
    }
    mnt_buf_str(b, "\"");
}

static void gen_value(mnt_buf *b, int depth) {
    uint64_t pick = mnt_rand_u64() % (depth > 5 ? 6 : 9);
    char tmp[64];
    size_t n, k;
    gen_ws(b);
    switch (pick) {
    case 0: mnt_buf_str(b, "null"); break;
    case 1: mnt_buf_str(b, "true"); break;
    case 2: mnt_buf_str(b, "false"); break;
    case 3:
        sprintf(tmp, "%llu", (unsigned long long)(mnt_rand_u64() >> (mnt_rand_u64() % 64)));
        mnt_buf_str(b, tmp);
        break;
    case 4:
        sprintf(tmp, "%.17g", mnt_rand_normal() * 1e10);
        mnt_buf_str(b, tmp);
        break;
    case 5: gen_string(b); break;
    case 6:
    case 7:
        mnt_buf_str(b, "[");
        n = mnt_rand_u64() % 5;
        for (k = 0; k < n; k++) {
            if (k) mnt_buf_str(b, ",");
            gen_value(b, depth + 1);
        }
        gen_ws(b);
        mnt_buf_str(b, "]");
        break;
    default:
        mnt_buf_str(b, "{");
        n = mnt_rand_u64() % 5;
        for (k = 0; k < n; k++) {
            if (k) mnt_buf_str(b, ",");
            gen_ws(b);
            sprintf(tmp, "\"key%zu_%llu\"", k, (unsigned long long)(mnt_rand_u64() % 100));
            mnt_buf_str(b, tmp);
            gen_ws(b);
            mnt_buf_str(b, ":");
            gen_value(b, depth + 1);
        }
        gen_ws(b);
        mnt_buf_str(b, "}");
        break;
    }
    gen_ws(b);
}

// Canonical text of a parsed value (strings through mn_json_escape).
static void canon(mnt_buf *b, const mn_json_value *v) {
    uint32_t k;
    switch (v->type) {
    case MN_JSON_NULL: mnt_buf_str(b, "null"); break;
    case MN_JSON_TRUE: mnt_buf_str(b, "true"); break;
    case MN_JSON_FALSE: mnt_buf_str(b, "false"); break;
    case MN_JSON_NUMBER: mnt_buf_str(b, v->str); break;
    case MN_JSON_STRING: {
        size_t n = mn_json_escape(NULL, 0, v->str);
        char *tmp = (char *)malloc(n + 1);
        CHECK_EQ_U64(mn_json_escape(tmp, n + 1, v->str), n);
        mnt_buf_put(b, tmp, n);
        free(tmp);
        break;
    }
    case MN_JSON_ARRAY:
        mnt_buf_str(b, "[");
        for (k = 0; k < v->len; k++) {
            if (k) mnt_buf_str(b, ",");
            canon(b, &v->items[k]);
        }
        mnt_buf_str(b, "]");
        break;
    case MN_JSON_OBJECT:
        mnt_buf_str(b, "{");
        for (k = 0; k < v->len; k++) {
            if (k) mnt_buf_str(b, ",");
            canon(b, &v->items[2 * k]);
            mnt_buf_str(b, ":");
            canon(b, &v->items[2 * k + 1]);
        }
        mnt_buf_str(b, "}");
        break;
    default: CHECK(0); break;
    }
}

static void test_random_roundtrip(void) {
    int round;
    for (round = 0; round < 300; round++) {
        mnt_buf text = {NULL, 0, 0}, c1 = {NULL, 0, 0}, c2 = {NULL, 0, 0};
        mn_json_doc d1, d2;
        int dup;
        gen_value(&text, 0);
        // keys are random: a duplicate is possible and must then be the error
        dup = mn_json_parse(text.p, text.n, NULL, &d1) != MN_OK;
        if (dup) {
            CHECK_MSG(strstr(d1.error, "duplicate key") != NULL, "%s: %s", text.p, d1.error);
        } else {
            canon(&c1, d1.root);
            CHECK_OK(mn_json_parse(c1.p, c1.n, NULL, &d2));
            if (d2.root) canon(&c2, d2.root);
            CHECK_MSG(c2.p && strcmp(c1.p, c2.p) == 0, "round trip differs:\n%s\n%s", c1.p, c2.p);
            mn_json_free(&d2);
        }
        mn_json_free(&d1);
        free(text.p), free(c1.p), free(c2.p);
        if (mnt_failed()) break;
    }
}

static void test_escape_writer(void) {
    char buf[64];
    FILE *f;
    size_t n;
    CHECK_EQ_U64(mn_json_escape(buf, sizeof buf, "a\"b\\c\n\x01\x7f\xc3\xa9"), 25);
    CHECK_STR(buf, "\"a\\\"b\\\\c\\n\\u0001\\u007f\xc3\xa9\"");
    CHECK_EQ_U64(mn_json_escape(buf, sizeof buf, ""), 2);
    CHECK_STR(buf, "\"\"");
    // truncation: whole pieces only, always NUL-terminated
    n = mn_json_escape(buf, 5, "ab\ncd");
    CHECK_EQ_U64(n, 8);
    CHECK_STR(buf, "\"ab");
    CHECK_EQ_U64(mn_json_escape(buf, 1, "x"), 3);
    CHECK_STR(buf, "");
    CHECK_EQ_U64(mn_json_escape(NULL, 0, "x\t"), 5);
    // ill-formed UTF-8 becomes U+FFFD, well-formed sequences stay
    CHECK_EQ_U64(mn_json_escape(buf, sizeof buf, "a\xff\xc3\xa9\xe2\x82"), 23);
    CHECK_STR(buf, "\"a\\ufffd\xc3\xa9\\ufffd\\ufffd\"");
    CHECK_EQ_U64(mn_json_escape(buf, sizeof buf, "\xed\xa0\x80\xf0\x9f\x98\x80"), 2 + 18 + 4);
    f = tmpfile();
    if (!f) SKIP("no tmpfile");
    mn_json_fputs_escaped(f, "q\"\r\x1f");
    rewind(f);
    n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    CHECK_STR(buf, "\"q\\\"\\r\\u001f\"");
}

// ---- safetensors ------------------------------------------------------------------------------

// 8-byte length + header + data_bytes zero bytes, into a malloc'ed buffer.
static uint8_t *st_build(const char *header, uint64_t data_bytes, size_t *len) {
    size_t n = strlen(header), k;
    uint8_t *b = (uint8_t *)calloc(1, 8 + n + (size_t)data_bytes + 1);
    for (k = 0; k < 8; k++) b[k] = (uint8_t)((uint64_t)n >> (8 * k));
    memcpy(b + 8, header, n);
    *len = 8 + n + (size_t)data_bytes;
    return b;
}

static int st_try(const char *header, uint64_t data_bytes, mn_safetensors_info *info) {
    size_t len;
    uint8_t *b = st_build(header, data_bytes, &len);
    int r = (int)mn_safetensors_parse(b, len, 0, NULL, info);
    free(b);
    mn_safetensors_free(info);
    return r;
}

static void test_st_valid(void) {
    static const char h[] =
        "{\"__metadata__\":{\"format\":\"pt\"},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
        "\"z\":{\"dtype\":\"I8\",\"shape\":[0,5],\"data_offsets\":[32,32]},"
        "\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[32,40]},"
        "\"h.0.attn.bias\":{\"dtype\":\"BOOL\",\"shape\":[2,2],\"data_offsets\":[40,44]}}   ";
    mn_safetensors_desc desc;
    mn_safetensors_info info;
    size_t len;
    uint8_t *b = st_build(h, 44, &len);
    memset(&desc, 0, sizeof desc);
    desc.keep_tensors = 1;
    CHECK_OK(mn_safetensors_parse(b, len, 0, &desc, &info));
    CHECK_EQ_U64(info.files, 1);
    CHECK_EQ_U64(info.tensors, 5);
    CHECK_EQ_U64(info.params, 11);  // 6 + 4 + 0 + 1; the mask buffer apart
    CHECK_EQ_U64(info.buffers, 4);
    CHECK_EQ_U64(info.header_bytes, strlen(h));
    CHECK_EQ_U64(info.data_bytes, 44);
    CHECK_EQ_U64(info.bytes_by_dtype[MN_ST_F32], 24);
    CHECK_EQ_U64(info.bytes_by_dtype[MN_ST_BF16], 8);
    CHECK_EQ_U64(info.params_by_dtype[MN_ST_F64], 1);
    CHECK_EQ_INT(info.st_dtype, MN_ST_F32);
    CHECK_EQ_INT(info.dtype, MN_FP32);
    CHECK_EQ_U64(info.metadata_count, 1);
    if (info.tensor) {
        CHECK_STR(info.tensor[0].name, "a");
        CHECK_EQ_U64(info.tensor[0].rank, 2);
        CHECK_EQ_U64(info.tensor[0].shape[1], 3);
        CHECK_EQ_U64(info.tensor[0].elements, 6);
        CHECK_STR(info.tensor[1].name, "b");
        CHECK_EQ_INT(info.tensor[1].dtype, MN_ST_BF16);
        CHECK_EQ_U64(info.tensor[1].begin, 24);
        CHECK_STR(info.tensor[2].name, "z");
        CHECK_EQ_U64(info.tensor[2].elements, 0);
        CHECK_STR(info.tensor[3].name, "s");
        CHECK_EQ_U64(info.tensor[3].rank, 0);
        CHECK_EQ_U64(info.tensor[3].elements, 1);
    } else {
        CHECK(0);
    }
    mn_safetensors_free(&info);
    // only the header given, the file size separately
    CHECK_OK(mn_safetensors_parse(b, 8 + strlen(h), len, NULL, &info));
    CHECK(info.tensor == NULL);
    mn_safetensors_free(&info);
    free(b);
    CHECK_OK(st_try("{}", 0, &info));
    CHECK_OK(st_try("{\"__metadata__\":{}}", 0, &info));
    CHECK_STR(mn_st_dtype_name(MN_ST_F8_E4M3), "F8_E4M3");
    CHECK_EQ_INT(mn_st_dtype_bytes(MN_ST_I64), 8);
    CHECK_EQ_INT(mn_st_dtype_to_dtype(MN_ST_U8), MN_INT8);
    CHECK_EQ_INT(mn_st_dtype_to_dtype(MN_ST_F16), MN_FP16);
}

static void test_st_invalid(void) {
    static const struct {
        const char *header;
        uint64_t data;
        int r;
    } bad[] = {
        {"[]", 0, MN_ERR_PARSE},
        {" {}", 0, MN_ERR_PARSE},  // must start with '{'
        {"{", 0, MN_ERR_PARSE},
        {"{\"a\":1}", 0, MN_ERR_PARSE},
        {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"X32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,1]}}", 1, MN_ERR_UNSUPPORTED},
        {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-1,3]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 5,
         MN_ERR_PARSE},  // trailing
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
         MN_ERR_PARSE},  // gap at 0
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
         6, MN_ERR_PARSE},  // overlap
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
         4, MN_ERR_PARSE},  // same
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[6,10]}}",
         10, MN_ERR_PARSE},  // gap
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", 0,
         MN_ERR_OVERFLOW},
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,1073741824],\"data_offsets\":[0,0]}}", 0,
         MN_ERR_OVERFLOW},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[18446744073709551616],\"data_offsets\":[0,0]}}", 0,
         MN_ERR_OVERFLOW},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,18446744073709551615]}}", 4,
         MN_ERR_PARSE},
        {"{\"__metadata__\":{\"a\":1}}", 0, MN_ERR_PARSE},
        {"{\"__metadata__\":[]}", 0, MN_ERR_PARSE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{}}", 4,
         MN_ERR_PARSE},
    };
    size_t k;
    for (k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        mn_safetensors_info info;
        int r = st_try(bad[k].header, bad[k].data, &info);
        CHECK_MSG(r == bad[k].r, "header %zu: result %d want %d (%s)", k, r, bad[k].r, info.error);
        CHECK_MSG(info.error[0] != 0, "header %zu: no message", k);
    }
}

static void test_st_lengths(void) {
    static const char h[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    mn_safetensors_info info;
    mn_safetensors_desc desc;
    size_t len, k;
    uint8_t *b = st_build(h, 4, &len);
    memset(&desc, 0, sizeof desc);
    CHECK_OK(mn_safetensors_parse(b, len, 0, NULL, &info));
    mn_safetensors_free(&info);
    for (k = 0; k < 8; k++) CHECK_ERR(mn_safetensors_parse(b, k, 0, NULL, &info), MN_ERR_PARSE);
    CHECK_ERR(mn_safetensors_parse(b, len - 5, 0, NULL, &info), MN_ERR_PARSE);  // truncated header
    CHECK_ERR(mn_safetensors_parse(b, len - 4, len - 1, NULL, &info), MN_ERR_PARSE);
    CHECK_ERR(mn_safetensors_parse(b, len, len - 1, NULL, &info), MN_ERR_INVALID_ARG);
    desc.max_header = strlen(h) - 1;
    CHECK_ERR(mn_safetensors_parse(b, len, 0, &desc, &info), MN_ERR_PARSE);
    b[7] = 0x80;  // N = 2^63 + ...
    CHECK_ERR(mn_safetensors_parse(b, len, 0, NULL, &info), MN_ERR_PARSE);
    b[7] = 0, b[4] = 1;  // N = 4 GiB + ...: past the file
    CHECK_ERR(mn_safetensors_parse(b, len, 1ull << 40, NULL, &info), MN_ERR_PARSE);
    memset(b, 0xff, 8);
    CHECK_ERR(mn_safetensors_parse(b, len, UINT64_MAX, NULL, &info), MN_ERR_PARSE);
    CHECK_ERR(mn_safetensors_parse(NULL, 0, 0, NULL, &info), MN_ERR_PARSE);
    CHECK_ERR(mn_safetensors_parse(b, len, 0, NULL, NULL), MN_ERR_INVALID_ARG);
    free(b);
}

typedef struct st_parse_ctx {
    const uint8_t *b;
    size_t len;
    const mn_safetensors_desc *desc;
} st_parse_ctx;

static mn_result st_parse_once(void *ctx) {
    const st_parse_ctx *c = (const st_parse_ctx *)ctx;
    mn_safetensors_info info;
    mn_result r = mn_safetensors_parse(c->b, c->len, 0, c->desc, &info);
    if (r == MN_OK) {
        CHECK_EQ_U64(info.params, 10);
        CHECK(info.tensor != NULL);
    }
    mn_safetensors_free(&info);
    return r;
}

static void test_st_alloc_failure(void) {
    static const char h[] = "{\"__metadata__\":{\"format\":\"pt\"},"
                            "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                            "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]}}";
    mn_safetensors_desc desc;
    st_parse_ctx ctx;
    uint8_t *b = st_build(h, 32, &ctx.len);
    memset(&desc, 0, sizeof desc);
    desc.keep_tensors = 1;
    ctx.b = b, ctx.desc = &desc;
    WALK_ALLOC_FAILURES(st_parse_once, &ctx, 49);
    free(b);
}

static void test_st_files(void) {
    mn_safetensors_info info;
    mn_safetensors_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.keep_tensors = 1;
    CHECK_OK(mn_safetensors_read_file("test/data/hf/tiny-gpt2/model.safetensors", &desc, &info));
    CHECK_EQ_U64(info.tensors, 17);
    CHECK_EQ_U64(info.params, 1272);
    CHECK_EQ_U64(info.buffers, 256);
    CHECK_EQ_INT(info.dtype, MN_FP32);
    CHECK(info.tensor != NULL && strcmp(info.tensor[0].name, "wte.weight") == 0);
    mn_safetensors_free(&info);
    CHECK_OK(mn_safetensors_read_dir("test/data/hf/tiny-llama", NULL, &info));
    CHECK_EQ_U64(info.files, 2);
    CHECK_EQ_U64(info.tensors, 21);
    CHECK_EQ_U64(info.params, 6736);
    CHECK_EQ_U64(info.params_by_dtype[MN_ST_F32], 80);
    CHECK_EQ_U64(info.bytes_by_dtype[MN_ST_BF16], (6736 - 80) * 2);
    CHECK_EQ_INT(info.dtype, MN_BF16);
    mn_safetensors_free(&info);
    CHECK_OK(mn_safetensors_read_dir("test/data/hf/tiny-gpt2", NULL, &info));
    CHECK_EQ_U64(info.params, 1272);
    mn_safetensors_free(&info);
    CHECK_ERR(mn_safetensors_read_dir("test/data/hf/bad-shard", NULL, &info), MN_ERR_PARSE);
    CHECK(info.error[0] != 0);
    CHECK_ERR(mn_safetensors_read_dir("test/data/hf", NULL, &info), MN_ERR_NOT_FOUND);
    CHECK_ERR(mn_safetensors_read_dir("test/data/hf/missing-shard", NULL, &info), MN_ERR_IO);
    CHECK_ERR(mn_safetensors_read_file("test/data/hf", NULL, &info), MN_ERR_IO);  // a folder
    CHECK_ERR(mn_safetensors_read_file("test/data/hf/missing.safetensors", NULL, &info),
              MN_ERR_NOT_FOUND);
    CHECK_ERR(mn_safetensors_read_file("test/data/hf/llama-2-7b.json", NULL, &info), MN_ERR_PARSE);
}

static mn_result st_read_dir_once(void *ctx) {
    mn_safetensors_info info;
    mn_result r = mn_safetensors_read_dir("test/data/hf/tiny-llama", NULL, &info);
    (void)ctx;
    if (r == MN_OK) CHECK_EQ_U64(info.params, 6736);
    mn_safetensors_free(&info);
    return r;
}

static void test_st_dir_alloc_failure(void) { WALK_ALLOC_FAILURES(st_read_dir_once, NULL, 99); }

const mnt_case test_json_cases[] = {
    {"valid_corpus", test_valid_corpus},
    {"invalid_corpus", test_invalid_corpus},
    {"embedded_nul", test_embedded_nul},
    {"dom", test_dom},
    {"u64_exact", test_u64},
    {"f64", test_f64},
    {"unicode", test_unicode},
    {"depth_limit", test_depth},
    {"max_bytes", test_max_bytes},
    {"duplicate_keys_large", test_duplicates_large},
    {"alloc_failure", test_alloc_failure},
    {"allocator_passthrough", test_allocator},
    {"random_roundtrip", test_random_roundtrip},
    {"escape_writer", test_escape_writer},
    {"safetensors_valid", test_st_valid},
    {"safetensors_invalid", test_st_invalid},
    {"safetensors_lengths", test_st_lengths},
    {"safetensors_alloc_failure", test_st_alloc_failure},
    {"safetensors_files", test_st_files},
    {"safetensors_dir_alloc_failure", test_st_dir_alloc_failure},
};
const size_t test_json_count = sizeof test_json_cases / sizeof test_json_cases[0];
