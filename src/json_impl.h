// >>json implementation --------------------------------------------------------------------------
//
// The reader makes three passes over the text with one iterative walker (no recursion, so a
// hostile document cannot exhaust the C stack):
//   pass 0 validates the grammar (RFC 8259) and counts values, containers and arena bytes;
//   pass 1 counts the direct children of every container (in pre-order);
//   pass 2 builds: each container reserves its children as one contiguous run of the value pool,
//          strings are unescaped and number literals copied into the byte arena, object keys are
//          sorted to find duplicates.
// Memory: one block (values, frames, child counts, bytes) plus one buffer for the key sort.

#include <locale.h>

#define MN__JSON_DEPTH_CAP 4096u
#define MN__JSON_DEFAULT_DEPTH 128u
#define MN__JSON_DEFAULT_BYTES (256ull << 20)

typedef struct mn__jframe {
    uint64_t cidx;          // pass 1: pre-order index of the container
    mn_json_value *self;    // pass 2: the container's value
    mn_json_value *next;    // pass 2: slot of its next child
} mn__jframe;

typedef struct mn__jp {
    const char *s;
    size_t n, i;
    int pass;
    uint32_t max_depth, depth;
    uint64_t nvalues, ncontainers, nbytes;
    uint64_t max_members;     // largest object, in members (pass 1)
    mn_json_value *pool;
    uint64_t pool_next;
    uint64_t *counts;
    uint64_t cidx;
    mn__jframe *frames;
    char *arena;
    uint64_t arena_next;
    uint32_t *sortbuf;
    mn_json_doc *doc;
    unsigned char is_obj[MN__JSON_DEPTH_CAP / 8];
} mn__jp;

MN__PRIVATE mn_result mn__json_fail(mn__jp *p, size_t at, const char *fmt, ...) {
    va_list ap;
    char what[112];
    uint64_t line = 1, col = 1;
    size_t k;
    if (p->doc->error[0]) return MN_ERR_PARSE;  // keep the first error
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (at > p->n) at = p->n;
    for (k = 0; k < at; k++) {
        if (p->s[k] == '\n') line++, col = 1;
        else col++;
    }
    snprintf(p->doc->error, sizeof p->doc->error, "%s at line %llu, column %llu", what,
             (unsigned long long)line, (unsigned long long)col);
    p->doc->error_offset = at;
    return MN_ERR_PARSE;
}

MN__PRIVATE void mn__json_ws(mn__jp *p) {
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->i++;
    }
}

// Describes the byte at i for an error message.
MN__PRIVATE const char *mn__json_what(mn__jp *p, size_t i, char *buf, size_t cap) {
    unsigned char c;
    if (i >= p->n) return "end of input";
    c = (unsigned char)p->s[i];
    if (c == 0) return "NUL byte";
    if (c == '/') return "'/' (comments are not JSON)";
    if (c >= 0x21 && c < 0x7f) snprintf(buf, cap, "'%c'", c);
    else snprintf(buf, cap, "byte 0x%02x", c);
    return buf;
}

MN__PRIVATE int mn__json_hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Length of a well-formed UTF-8 sequence at s[0..n) (Unicode 15, table 3-7), 0 if ill-formed.
MN__PRIVATE size_t mn__utf8_len(const unsigned char *s, size_t n) {
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    size_t len, k;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) len = 3;
    else if (c >= 0xf0 && c <= 0xf4) len = 4;
    else return 0;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;  // no UTF-16 surrogates
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;  // nothing above U+10FFFF
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (k = 2; k < len; k++)
        if (s[k] < 0x80 || s[k] > 0xbf) return 0;
    return len;
}

MN__PRIVATE size_t mn__utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) {
        if (out) out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        if (out) out[0] = (char)(0xc0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        if (out) {
            out[0] = (char)(0xe0 | (cp >> 12));
            out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
            out[2] = (char)(0x80 | (cp & 0x3f));
        }
        return 3;
    }
    if (out) {
        out[0] = (char)(0xf0 | (cp >> 18));
        out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[3] = (char)(0x80 | (cp & 0x3f));
    }
    return 4;
}

MN__PRIVATE mn_result mn__json_u4(mn__jp *p, size_t at, uint32_t *cp) {
    int k, h;
    *cp = 0;
    if (p->n - at < 6) return mn__json_fail(p, at, "truncated \\u escape");
    for (k = 2; k < 6; k++) {
        h = mn__json_hex(p->s[at + (size_t)k]);
        if (h < 0) return mn__json_fail(p, at, "\\u escape needs four hex digits");
        *cp = *cp * 16 + (uint32_t)h;
    }
    return MN_OK;
}

// String at p->i (the opening quote). Writes the unescaped bytes to out when out is not NULL;
// *len receives their count. Leaves p->i after the closing quote.
MN__PRIVATE mn_result mn__json_string(mn__jp *p, char *out, uint64_t *len) {
    size_t start = p->i;
    uint64_t n = 0;
    p->i++;
    for (;;) {
        unsigned char c;
        if (p->i >= p->n) return mn__json_fail(p, start, "unterminated string");
        c = (unsigned char)p->s[p->i];
        if (c == '"') break;
        if (c < 0x20) {
            return mn__json_fail(p, p->i, c == 0 ? "NUL byte in string"
                                              : "unescaped control character 0x%02x in string", c);
        }
        if (c == '\\') {
            char e;
            uint32_t cp;
            if (p->i + 1 >= p->n) return mn__json_fail(p, start, "unterminated string");
            e = p->s[p->i + 1];
            if (e == 'u') {
                if (mn__json_u4(p, p->i, &cp) != MN_OK) return MN_ERR_PARSE;
                if (cp >= 0xdc00 && cp <= 0xdfff)
                    return mn__json_fail(p, p->i, "lone low surrogate \\u%04X", (unsigned)cp);
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    uint32_t lo;
                    if (p->n - p->i < 12 || p->s[p->i + 6] != '\\' || p->s[p->i + 7] != 'u')
                        return mn__json_fail(p, p->i, "lone high surrogate \\u%04X", (unsigned)cp);
                    if (mn__json_u4(p, p->i + 6, &lo) != MN_OK) return MN_ERR_PARSE;
                    if (lo < 0xdc00 || lo > 0xdfff)
                        return mn__json_fail(p, p->i, "high surrogate \\u%04X without a low one",
                                             (unsigned)cp);
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    p->i += 6;
                }
                n += mn__utf8_put(cp, out ? out + n : NULL);
                p->i += 6;
                continue;
            }
            switch (e) {
            case '"': c = '"'; break;
            case '\\': c = '\\'; break;
            case '/': c = '/'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            default: {
                char buf[16];
                return mn__json_fail(p, p->i, "invalid escape \\%s",
                                     mn__json_what(p, p->i + 1, buf, sizeof buf));
            }
            }
            if (out) out[n] = (char)c;
            n++;
            p->i += 2;
            continue;
        }
        if (c < 0x80) {
            if (out) out[n] = (char)c;
            n++;
            p->i++;
        } else {
            size_t k = mn__utf8_len((const unsigned char *)p->s + p->i, p->n - p->i);
            if (k == 0) return mn__json_fail(p, p->i, "invalid UTF-8 in string");
            if (out) memcpy(out + n, p->s + p->i, k);
            n += k;
            p->i += k;
        }
    }
    p->i++;
    if (n > UINT32_MAX - 1) return mn__json_fail(p, start, "string longer than 4 GiB");
    *len = n;
    return MN_OK;
}

// Number at p->i: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? (RFC 8259 section 6).
MN__PRIVATE mn_result mn__json_number(mn__jp *p, size_t *start) {
    const char *s = p->s;
    size_t i = p->i;
    *start = i;
    if (i < p->n && s[i] == '-') i++;
    if (i >= p->n || s[i] < '0' || s[i] > '9') {
        if (i < p->n && (s[i] == 'I' || s[i] == 'N'))
            return mn__json_fail(p, *start, "NaN and Infinity are not JSON");
        return mn__json_fail(p, *start, "'-' must be followed by a digit");
    }
    if (s[i] == '0') {
        i++;
        if (i < p->n && s[i] >= '0' && s[i] <= '9')
            return mn__json_fail(p, *start, "leading zero in number");
    } else {
        while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < p->n && s[i] == '.') {
        i++;
        if (i >= p->n || s[i] < '0' || s[i] > '9')
            return mn__json_fail(p, i, "digit expected after '.'");
        while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < p->n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < p->n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= p->n || s[i] < '0' || s[i] > '9')
            return mn__json_fail(p, i, "digit expected in exponent");
        while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
    }
    p->i = i;
    return MN_OK;
}

// strtod on a NUL-terminated, validated literal; tolerates a locale whose decimal point is not '.'.
MN__PRIVATE int mn__json_strtod(const char *lit, size_t n, double *out) {
    char buf[512], *end = NULL;
    size_t k;
    const struct lconv *lc;
    *out = strtod(lit, &end);
    if (end == lit + n) return 1;
    lc = localeconv();
    if (n >= sizeof buf || !lc || !lc->decimal_point || !lc->decimal_point[0]) return 0;
    for (k = 0; k < n; k++) buf[k] = lit[k] == '.' ? lc->decimal_point[0] : lit[k];
    buf[n] = 0;
    *out = strtod(buf, &end);
    return end == buf + n;
}

// Adds one value: counts it (pass 0), counts it as a child (pass 1) or returns its slot (pass 2).
MN__PRIVATE mn_json_value *mn__json_emit(mn__jp *p) {
    if (p->pass == 0) {
        p->nvalues++;
        return NULL;
    }
    if (p->pass == 1) {
        if (p->depth > 0) p->counts[p->frames[p->depth - 1].cidx]++;
        return NULL;
    }
    if (p->depth == 0) return &p->pool[p->pool_next++];
    return p->frames[p->depth - 1].next++;
}

MN__PRIVATE int mn__json_key_cmp(const mn_json_value *a, const mn_json_value *b) {
    uint32_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->str, b->str, n);
    if (c != 0) return c;
    return a->len < b->len ? -1 : a->len > b->len ? 1 : 0;
}

// Heap sort of member indices by key (no recursion, O(n log n)), then adjacent keys compared.
MN__PRIVATE mn_result mn__json_dupkeys(mn__jp *p, const mn_json_value *obj, size_t at) {
    const mn_json_value *it = obj->items;
    uint32_t *a = p->sortbuf, n = obj->len, k, end, root, child, t;
    if (n < 2) return MN_OK;
    for (k = 0; k < n; k++) a[k] = k;
    for (k = n / 2; k-- > 0;) {
        for (root = k; (child = 2 * root + 1) < n; root = child) {
            if (child + 1 < n && mn__json_key_cmp(&it[2 * a[child]], &it[2 * a[child + 1]]) < 0)
                child++;
            if (mn__json_key_cmp(&it[2 * a[root]], &it[2 * a[child]]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
    for (end = n - 1; end > 0; end--) {
        t = a[0], a[0] = a[end], a[end] = t;
        for (root = 0; (child = 2 * root + 1) < end; root = child) {
            if (child + 1 < end && mn__json_key_cmp(&it[2 * a[child]], &it[2 * a[child + 1]]) < 0)
                child++;
            if (mn__json_key_cmp(&it[2 * a[root]], &it[2 * a[child]]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
    for (k = 1; k < n; k++) {
        if (mn__json_key_cmp(&it[2 * a[k - 1]], &it[2 * a[k]]) == 0)
            return mn__json_fail(p, at, "duplicate key \"%.60s\" in the object ending here",
                                 it[2 * a[k]].str);
    }
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_open(mn__jp *p, int obj) {
    mn_json_value *v = mn__json_emit(p);
    uint32_t d = p->depth;
    if (d >= p->max_depth)
        return mn__json_fail(p, p->i, "nesting deeper than %u", (unsigned)p->max_depth);
    if (obj) p->is_obj[d / 8] |= (unsigned char)(1u << (d % 8));
    else p->is_obj[d / 8] &= (unsigned char)~(1u << (d % 8));
    if (p->pass == 0) {
        p->ncontainers++;
    } else if (p->pass == 1) {
        p->frames[d].cidx = p->cidx++;
    } else {
        uint32_t c = (uint32_t)p->counts[p->cidx++];
        v->type = obj ? MN_JSON_OBJECT : MN_JSON_ARRAY;
        v->len = obj ? c / 2 : c;
        v->items = p->pool + p->pool_next;
        p->frames[d].self = v;
        p->frames[d].next = p->pool + p->pool_next;
        p->pool_next += c;
    }
    p->depth++;
    p->i++;
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_close(mn__jp *p) {
    uint32_t d = --p->depth;
    int obj = (p->is_obj[d / 8] >> (d % 8)) & 1;
    if (p->pass == 1) {
        uint64_t c = p->counts[p->frames[d].cidx];
        if (c > UINT32_MAX - 1) return mn__json_fail(p, p->i, "container with over 2^32 items");
        if (obj && c / 2 > p->max_members) p->max_members = c / 2;
    } else if (p->pass == 2 && obj) {
        if (mn__json_dupkeys(p, p->frames[d].self, p->i) != MN_OK) return MN_ERR_PARSE;
    }
    p->i++;
    return MN_OK;
}

// A string value (or key) at p->i.
MN__PRIVATE mn_result mn__json_str_value(mn__jp *p) {
    mn_json_value *v = mn__json_emit(p);
    uint64_t len = 0;
    if (p->pass == 2) {
        char *out = p->arena + p->arena_next;
        if (mn__json_string(p, out, &len) != MN_OK) return MN_ERR_PARSE;
        out[len] = 0;
        v->type = MN_JSON_STRING;
        v->len = (uint32_t)len;
        v->str = out;
        p->arena_next += len + 1;
        return MN_OK;
    }
    if (mn__json_string(p, NULL, &len) != MN_OK) return MN_ERR_PARSE;
    if (p->pass == 0) p->nbytes += len + 1;
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_key(mn__jp *p) {
    char buf[16];
    mn__json_ws(p);
    if (p->i >= p->n || p->s[p->i] != '"')
        return mn__json_fail(p, p->i, "expected a string key, found %s",
                             mn__json_what(p, p->i, buf, sizeof buf));
    if (mn__json_str_value(p) != MN_OK) return MN_ERR_PARSE;
    mn__json_ws(p);
    if (p->i >= p->n || p->s[p->i] != ':')
        return mn__json_fail(p, p->i, "expected ':' after key, found %s",
                             mn__json_what(p, p->i, buf, sizeof buf));
    p->i++;
    return MN_OK;
}

MN__PRIVATE mn_result mn__json_scalar(mn__jp *p) {
    static const struct { const char *lit; size_t n; mn_json_type t; } lits[] = {
        {"null", 4, MN_JSON_NULL}, {"true", 4, MN_JSON_TRUE}, {"false", 5, MN_JSON_FALSE}};
    char c = p->s[p->i], buf[16];
    size_t k, start;
    if (c == '"') return mn__json_str_value(p);
    for (k = 0; k < 3; k++) {
        if (c != lits[k].lit[0]) continue;
        if (p->n - p->i < lits[k].n || memcmp(p->s + p->i, lits[k].lit, lits[k].n) != 0)
            return mn__json_fail(p, p->i, "invalid literal (expected %s)", lits[k].lit);
        {
            mn_json_value *v = mn__json_emit(p);
            if (v) v->type = lits[k].t;
        }
        p->i += lits[k].n;
        return MN_OK;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        mn_json_value *v;
        size_t n;
        if (mn__json_number(p, &start) != MN_OK) return MN_ERR_PARSE;
        n = p->i - start;
        v = mn__json_emit(p);
        if (p->pass == 0) p->nbytes += n + 1;
        if (p->pass == 2) {
            char *out = p->arena + p->arena_next;
            memcpy(out, p->s + start, n);
            out[n] = 0;
            p->arena_next += n + 1;
            v->type = MN_JSON_NUMBER;
            v->len = 0;
            v->str = out;
            if (!mn__json_strtod(out, n, &v->num) || v->num > DBL_MAX || v->num < -DBL_MAX)
                return mn__json_fail(p, start, "number %.40s out of the double range", out);
        }
        return MN_OK;
    }
    if (c == 'N' || c == 'I') return mn__json_fail(p, p->i, "NaN and Infinity are not JSON");
    return mn__json_fail(p, p->i, "expected a value, found %s",
                         mn__json_what(p, p->i, buf, sizeof buf));
}

// One pass over the whole text.
MN__PRIVATE mn_result mn__json_walk(mn__jp *p) {
    char buf[16];
    p->i = 0;
    p->depth = 0;
    p->cidx = 0;
    for (;;) {
        // a value is expected
        mn__json_ws(p);
        if (p->i >= p->n) {
            if (p->depth == 0 && p->nvalues == 0 && p->pass == 0)
                return mn__json_fail(p, p->i, "empty document");
            return mn__json_fail(p, p->i, "unexpected end of input, expected a value");
        }
        if (p->s[p->i] == '[' || p->s[p->i] == '{') {
            int obj = p->s[p->i] == '{';
            if (mn__json_open(p, obj) != MN_OK) return MN_ERR_PARSE;
            mn__json_ws(p);
            if (p->i < p->n && p->s[p->i] == (obj ? '}' : ']')) {
                if (mn__json_close(p) != MN_OK) return MN_ERR_PARSE;
            } else {
                if (obj && mn__json_key(p) != MN_OK) return MN_ERR_PARSE;
                continue;
            }
        } else if (mn__json_scalar(p) != MN_OK) {
            return MN_ERR_PARSE;
        }
        // after a value: ',' or a closing bracket, or the end of the document
        for (;;) {
            int obj;
            char c;
            mn__json_ws(p);
            if (p->depth == 0) {
                if (p->i < p->n)
                    return mn__json_fail(p, p->i, "trailing %s after the document",
                                         mn__json_what(p, p->i, buf, sizeof buf));
                return MN_OK;
            }
            obj = (p->is_obj[(p->depth - 1) / 8] >> ((p->depth - 1) % 8)) & 1;
            c = p->i < p->n ? p->s[p->i] : 0;
            if (c == ',') {
                p->i++;
                mn__json_ws(p);
                if (p->i < p->n && (p->s[p->i] == ']' || p->s[p->i] == '}'))
                    return mn__json_fail(p, p->i, "trailing comma");
                if (obj && mn__json_key(p) != MN_OK) return MN_ERR_PARSE;
                break;
            }
            if (c == (obj ? '}' : ']') && p->i < p->n) {
                if (mn__json_close(p) != MN_OK) return MN_ERR_PARSE;
                continue;
            }
            return mn__json_fail(p, p->i, obj ? "expected ',' or '}', found %s"
                                              : "expected ',' or ']', found %s",
                                 mn__json_what(p, p->i, buf, sizeof buf));
        }
    }
}

MNIMPL mn_result mn_json_parse(const char *text, size_t len, const mn_json_desc *desc,
                               mn_json_doc *doc) {
    mn__jp p;
    mn_json_desc d;
    uint64_t sz_values, sz_frames, sz_counts, total;
    unsigned char *block;
    mn_result r;
    if (!doc) return MN_ERR_INVALID_ARG;
    memset(doc, 0, sizeof *doc);
    if (!text && len) return MN_ERR_INVALID_ARG;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.max_depth == 0) d.max_depth = MN__JSON_DEFAULT_DEPTH;
    if (d.max_depth > MN__JSON_DEPTH_CAP) d.max_depth = MN__JSON_DEPTH_CAP;
    if (d.max_bytes == 0) d.max_bytes = MN__JSON_DEFAULT_BYTES;
    doc->alloc_ = d.allocator;
    memset(&p, 0, sizeof p);
    p.s = text ? text : "";
    p.n = len;
    p.doc = doc;
    p.max_depth = d.max_depth;
    if ((uint64_t)len > d.max_bytes) {
        snprintf(doc->error, sizeof doc->error,
                 "document of %llu bytes exceeds the %llu-byte limit", (unsigned long long)len,
                 (unsigned long long)d.max_bytes);
        return MN_ERR_PARSE;
    }
    if (len >= 3 && (unsigned char)text[0] == 0xef && (unsigned char)text[1] == 0xbb &&
        (unsigned char)text[2] == 0xbf)
        return mn__json_fail(&p, 0, "byte order mark before the document");
    // pass 0: validate and count
    if (mn__json_walk(&p) != MN_OK) return MN_ERR_PARSE;
    // one block: values | frames | child counts | bytes
    sz_frames = (uint64_t)(p.max_depth + 1) * sizeof(mn__jframe);
    if (mn_mul_u64(p.nvalues, sizeof(mn_json_value), &sz_values) != MN_OK ||
        mn_mul_u64(p.ncontainers, sizeof(uint64_t), &sz_counts) != MN_OK ||
        mn_add_u64(sz_values, sz_frames, &total) != MN_OK ||
        mn_add_u64(total, sz_counts, &total) != MN_OK ||
        mn_add_u64(total, p.nbytes, &total) != MN_OK || total > (uint64_t)SIZE_MAX) {
        snprintf(doc->error, sizeof doc->error, "document too large for this host");
        return MN_ERR_OUT_OF_MEMORY;
    }
    block = (unsigned char *)mn__alloc(&d.allocator, (size_t)total);
    if (!block) {
        snprintf(doc->error, sizeof doc->error, "out of memory (%llu bytes for the tree)",
                 (unsigned long long)total);
        return MN_ERR_OUT_OF_MEMORY;
    }
    memset(block, 0, (size_t)(sz_values + sz_frames + sz_counts));
    doc->mem_ = block;
    p.pool = (mn_json_value *)(void *)block;
    p.frames = (mn__jframe *)(void *)(block + sz_values);
    p.counts = (uint64_t *)(void *)(block + sz_values + sz_frames);
    p.arena = (char *)(block + sz_values + sz_frames + sz_counts);
    // pass 1: children per container
    p.pass = 1;
    if (mn__json_walk(&p) != MN_OK) goto fail_parse;
    // pass 2: build
    if (p.max_members > 1) {
        p.sortbuf = (uint32_t *)mn__alloc_array(&d.allocator, (size_t)p.max_members,
                                                sizeof(uint32_t));
        if (!p.sortbuf) {
            snprintf(doc->error, sizeof doc->error, "out of memory (key sort)");
            r = MN_ERR_OUT_OF_MEMORY;
            goto fail;
        }
    }
    p.pass = 2;
    r = mn__json_walk(&p);
    mn__free(&d.allocator, p.sortbuf);
    if (r != MN_OK) goto fail_parse;
    doc->root = p.pool;
    return MN_OK;
fail_parse:
    r = MN_ERR_PARSE;
fail:
    mn__free(&d.allocator, block);
    doc->mem_ = NULL;
    doc->root = NULL;
    return r;
}

MNIMPL void mn_json_free(mn_json_doc *doc) {
    if (!doc) return;
    mn__free(&doc->alloc_, doc->mem_);
    doc->mem_ = NULL;
    doc->root = NULL;
}

MNIMPL const mn_json_value *mn_json_get(const mn_json_value *obj, const char *key) {
    size_t n;
    uint32_t k;
    if (!obj || !key || obj->type != MN_JSON_OBJECT) return NULL;
    n = strlen(key);
    for (k = 0; k < obj->len; k++) {
        const mn_json_value *kv = &obj->items[2 * k];
        if (kv->len == n && memcmp(kv->str, key, n) == 0) return &obj->items[2 * k + 1];
    }
    return NULL;
}

MNIMPL mn_result mn_json_u64(const mn_json_value *v, uint64_t *out) {
    // value = digits * 10^(exp - fraction digits), computed exactly on the literal's digits
    const char *s, *digits, *p;
    int neg = 0, nonzero = 0, seen_dot = 0;
    uint64_t ndig = 0, nfrac = 0, exp = 0, acc = 0, k;
    int exp_neg = 0;
    int64_t shift;
    if (!v || !out || v->type != MN_JSON_NUMBER || !v->str) return MN_ERR_INVALID_ARG;
    s = v->str;
    if (*s == '-') neg = 1, s++;
    digits = s;
    for (p = s; *p && *p != 'e' && *p != 'E'; p++) {
        if (*p == '.') {
            seen_dot = 1;
            continue;
        }
        if (*p < '0' || *p > '9') return MN_ERR_INVALID_ARG;
        if (*p != '0') nonzero = 1;
        ndig++;
        if (seen_dot) nfrac++;
    }
    if (ndig == 0) return MN_ERR_INVALID_ARG;
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-') exp_neg = *p == '-', p++;
        for (; *p >= '0' && *p <= '9'; p++) {
            if (exp < 100000000) exp = exp * 10 + (uint64_t)(*p - '0');
        }
    }
    if (!nonzero) {
        *out = 0;
        return MN_OK;
    }
    if (neg) return MN_ERR_INVALID_ARG;
    // shift = exponent - fraction digits (both bounded by 10^8 and the document size)
    shift = (exp_neg ? -(int64_t)exp : (int64_t)exp) - (int64_t)nfrac;
    // digits dropped by a negative shift must be zeros
    k = 0;
    for (p = digits; *p && *p != 'e' && *p != 'E'; p++) {
        if (*p == '.') continue;
        k++;
        if (shift < 0 && (int64_t)(ndig - k) < -shift) {
            if (*p != '0') return MN_ERR_INVALID_ARG;
            continue;
        }
        if (acc > (UINT64_MAX - (uint64_t)(*p - '0')) / 10) return MN_ERR_OVERFLOW;
        acc = acc * 10 + (uint64_t)(*p - '0');
    }
    for (; shift > 0; shift--) {
        if (acc > UINT64_MAX / 10) return MN_ERR_OVERFLOW;
        acc *= 10;
    }
    *out = acc;
    return MN_OK;
}

MNIMPL mn_result mn_json_f64(const mn_json_value *v, double *out) {
    if (!v || !out || v->type != MN_JSON_NUMBER) return MN_ERR_INVALID_ARG;
    *out = v->num;
    return MN_OK;
}

MNIMPL const char *mn_json_type_name(mn_json_type t) {
    static const char *const names[MN_JSON_TYPE_COUNT] = {"invalid", "null", "false", "true",
                                                          "number", "string", "array", "object"};
    return (unsigned)t < MN_JSON_TYPE_COUNT ? names[t] : "invalid";
}

// Escape of the character at *u into e (at most 6 bytes); returns its length and advances *u.
// A well-formed UTF-8 sequence is copied whole, an ill-formed byte becomes \ufffd, so the output
// is always valid JSON.
MN__PRIVATE size_t mn__json_esc(const unsigned char **u, char *e) {
    static const char hex[] = "0123456789abcdef";
    unsigned char c = **u;
    size_t n, k;
    switch (c) {
    case '"': e[0] = '\\', e[1] = '"'; break;
    case '\\': e[0] = '\\', e[1] = '\\'; break;
    case '\b': e[0] = '\\', e[1] = 'b'; break;
    case '\f': e[0] = '\\', e[1] = 'f'; break;
    case '\n': e[0] = '\\', e[1] = 'n'; break;
    case '\r': e[0] = '\\', e[1] = 'r'; break;
    case '\t': e[0] = '\\', e[1] = 't'; break;
    default:
        if (c < 0x20 || c == 0x7f) {
            e[0] = '\\', e[1] = 'u', e[2] = '0', e[3] = '0', e[4] = hex[c >> 4];
            e[5] = hex[c & 15];
            (*u)++;
            return 6;
        }
        for (n = 0; n < 4 && (*u)[n]; n++) {}  // bytes available before the NUL
        k = mn__utf8_len(*u, n);
        if (k == 0) {
            memcpy(e, "\\ufffd", 6);
            (*u)++;
            return 6;
        }
        memcpy(e, *u, k);
        *u += k;
        return k;
    }
    (*u)++;
    return 2;
}

MNIMPL size_t mn_json_escape(char *buf, size_t cap, const char *s) {
    // pieces are written whole while they fit; the returned length counts them all
    size_t n = 0, w = 0, m;
    int full = buf == NULL || cap == 0, state = 0;  // 0 opening quote, 1 body, 2 done
    char e[8];
    const unsigned char *u = (const unsigned char *)(s ? s : "");
    while (state < 2) {
        if (state == 0) e[0] = '"', m = 1, state = 1;
        else if (*u) m = mn__json_esc(&u, e);
        else e[0] = '"', m = 1, state = 2;
        if (!full && w + m < cap) memcpy(buf + w, e, m), w += m;
        else full = 1;
        n += m;
    }
    if (buf && cap) buf[w] = 0;
    return n;
}

MNIMPL void mn_json_fputs_escaped(FILE *f, const char *s) {
    char e[8];
    const unsigned char *u = (const unsigned char *)(s ? s : "");
    if (!f) return;
    fputc('"', f);
    while (*u) {
        size_t m = mn__json_esc(&u, e);
        fwrite(e, 1, m, f);
    }
    fputc('"', f);
}

// Size of an open file from its end (64-bit offsets on Windows, where long has 32 bits).
MN__PRIVATE int mn__file_size(FILE *f, uint64_t *size) {
#if defined(_WIN32) && defined(_MSC_VER)
    __int64 n;
    if (_fseeki64(f, 0, SEEK_END) != 0 || (n = _ftelli64(f)) < 0 || _fseeki64(f, 0, SEEK_SET) != 0)
        return 0;
#else
    long n;
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) return 0;
#endif
    *size = (uint64_t)n;
    return 1;
}

// Reads a whole file of at most max bytes into a fresh buffer (NUL-terminated for convenience).
// MN_ERR_NOT_FOUND when it does not exist, MN_ERR_IO when it cannot be read or is too long.
MN__PRIVATE mn_result mn__read_file(const mn_allocator *a, const char *path, uint64_t max,
                                    char **data, size_t *len) {
    FILE *f;
    uint64_t size;
    char *buf;
    *data = NULL, *len = 0;
    f = fopen(path, "rb");
    if (!f) return errno == ENOENT ? MN_ERR_NOT_FOUND : MN_ERR_IO;
    if (!mn__file_size(f, &size) || size > max || size >= (uint64_t)SIZE_MAX) {
        fclose(f);
        return MN_ERR_IO;
    }
    buf = (char *)mn__alloc(a, (size_t)size + 1);
    if (!buf) {
        fclose(f);
        return MN_ERR_OUT_OF_MEMORY;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size || ferror(f)) {
        mn__free(a, buf);
        fclose(f);
        return MN_ERR_IO;
    }
    fclose(f);
    buf[size] = 0;
    *data = buf, *len = (size_t)size;
    return MN_OK;
}

// >>safetensors implementation
//
// Invariants checked (safetensors format spec and the reference crate's validate()): the header
// length N is at most 100,000,000 and 8 + N <= file size; the header is a JSON object starting
// with '{'; each tensor's byte length equals prod(shape) * dtype size; sorted by offsets, the
// tensors tile the data section [0, file size - 8 - N) exactly: the first begins at 0, each
// begins where the previous ends, the last ends at the end of the file.

#define MN__ST_MAX_HEADER 100000000ull

static const struct {
    const char *name;
    uint32_t bytes;
    mn_dtype dtype;
} mn__st_dtypes[MN_ST_DTYPE_COUNT] = {
    {"unknown", 0, MN_DTYPE_DEFAULT}, {"BOOL", 1, MN_DTYPE_DEFAULT}, {"U8", 1, MN_INT8},
    {"I8", 1, MN_INT8}, {"F8_E4M3", 1, MN_DTYPE_DEFAULT}, {"F8_E5M2", 1, MN_DTYPE_DEFAULT},
    {"F8_E8M0", 1, MN_DTYPE_DEFAULT}, {"I16", 2, MN_DTYPE_DEFAULT}, {"U16", 2, MN_DTYPE_DEFAULT},
    {"F16", 2, MN_FP16}, {"BF16", 2, MN_BF16}, {"I32", 4, MN_DTYPE_DEFAULT},
    {"U32", 4, MN_DTYPE_DEFAULT}, {"F32", 4, MN_FP32}, {"I64", 8, MN_DTYPE_DEFAULT},
    {"U64", 8, MN_DTYPE_DEFAULT}, {"F64", 8, MN_DTYPE_DEFAULT}};

MNIMPL const char *mn_st_dtype_name(mn_st_dtype t) {
    return (unsigned)t < MN_ST_DTYPE_COUNT ? mn__st_dtypes[t].name : "unknown";
}

MNIMPL uint32_t mn_st_dtype_bytes(mn_st_dtype t) {
    return (unsigned)t < MN_ST_DTYPE_COUNT ? mn__st_dtypes[t].bytes : 0;
}

MNIMPL mn_dtype mn_st_dtype_to_dtype(mn_st_dtype t) {
    return (unsigned)t < MN_ST_DTYPE_COUNT ? mn__st_dtypes[t].dtype : MN_DTYPE_DEFAULT;
}

MN__PRIVATE mn_result mn__st_fail(mn_safetensors_info *out, const mn_logger *lg, mn_result r,
                                  const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->error, sizeof out->error, fmt, ap);
    va_end(ap);
    mn__log(lg, MN_LOG_ERROR, "safetensors: %s", out->error);
    return r;
}

typedef struct mn__st_range {
    uint64_t begin, end;
    uint32_t member;  // index of the tensor in the header object
} mn__st_range;

MN__PRIVATE int mn__st_less(const mn__st_range *a, const mn__st_range *b) {
    return a->begin < b->begin || (a->begin == b->begin && a->end < b->end);
}

MN__PRIVATE void mn__st_sort(mn__st_range *r, uint64_t n) {  // heap sort by (begin, end)
    uint64_t k, end, root, child;
    mn__st_range t;
    if (n < 2) return;
    for (k = n / 2; k-- > 0;) {
        for (root = k; (child = 2 * root + 1) < n; root = child) {
            if (child + 1 < n && mn__st_less(&r[child], &r[child + 1])) child++;
            if (!mn__st_less(&r[root], &r[child])) break;
            t = r[root], r[root] = r[child], r[child] = t;
        }
    }
    for (end = n - 1; end > 0; end--) {
        t = r[0], r[0] = r[end], r[end] = t;
        for (root = 0; (child = 2 * root + 1) < end; root = child) {
            if (child + 1 < end && mn__st_less(&r[child], &r[child + 1])) child++;
            if (!mn__st_less(&r[root], &r[child])) break;
            t = r[root], r[root] = r[child], r[child] = t;
        }
    }
}

// One tensor entry: dtype, element count and offsets, validated against the data section.
MN__PRIVATE mn_result mn__st_tensor(mn_safetensors_info *out, const mn_logger *lg,
                                    const mn_json_value *key, const mn_json_value *v,
                                    uint64_t data_bytes, mn_st_dtype *dt, uint64_t *elements,
                                    mn__st_range *range) {
    static const char *const unsized[] = {"F4", "F6_E2M3", "F6_E3M2", "C64"};
    const mn_json_value *dtype = mn_json_get(v, "dtype"), *shape = mn_json_get(v, "shape");
    const mn_json_value *offs = mn_json_get(v, "data_offsets");
    const char *name = key->str;
    uint64_t n = 1, bytes, b, e;
    uint32_t k;
    int t;
    if (v->type != MN_JSON_OBJECT)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\" is not an object", name);
    if (!dtype || dtype->type != MN_JSON_STRING)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\" has no \"dtype\" string", name);
    if (!shape || shape->type != MN_JSON_ARRAY)
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\" has no \"shape\" array", name);
    if (!offs || offs->type != MN_JSON_ARRAY || offs->len != 2)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\" needs \"data_offsets\": [begin, end]", name);
    *dt = MN_ST_UNKNOWN;
    for (t = 1; t < MN_ST_DTYPE_COUNT; t++)
        if (strcmp(dtype->str, mn__st_dtypes[t].name) == 0) *dt = (mn_st_dtype)t;
    if (*dt == MN_ST_UNKNOWN) {
        for (k = 0; k < sizeof unsized / sizeof unsized[0]; k++) {
            if (strcmp(dtype->str, unsized[k]) == 0)
                return mn__st_fail(out, lg, MN_ERR_UNSUPPORTED,
                                   "tensor \"%.60s\": dtype %s is not supported", name, unsized[k]);
        }
        return mn__st_fail(out, lg, MN_ERR_PARSE, "tensor \"%.60s\": unknown dtype \"%.20s\"", name,
                           dtype->str);
    }
    for (k = 0; k < shape->len; k++) {
        uint64_t d;
        mn_result r = mn_json_u64(&shape->items[k], &d);
        if (r == MN_ERR_OVERFLOW || (r == MN_OK && mn_mul_u64(n, d, &n) != MN_OK))
            return mn__st_fail(out, lg, MN_ERR_OVERFLOW,
                               "tensor \"%.60s\": shape overflows 64 bits", name);
        if (r != MN_OK)
            return mn__st_fail(out, lg, MN_ERR_PARSE,
                               "tensor \"%.60s\": shape[%u] is not a non-negative integer", name,
                               (unsigned)k);
    }
    if (mn_mul_u64(n, mn__st_dtypes[*dt].bytes, &bytes) != MN_OK)
        return mn__st_fail(out, lg, MN_ERR_OVERFLOW, "tensor \"%.60s\": size overflows 64 bits",
                           name);
    if (mn_json_u64(&offs->items[0], &b) != MN_OK || mn_json_u64(&offs->items[1], &e) != MN_OK)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets are not non-negative integers", name);
    if (b > e)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets begin %llu > end %llu", name,
                           (unsigned long long)b, (unsigned long long)e);
    if (e > data_bytes)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets end %llu past the %llu-byte data",
                           name, (unsigned long long)e, (unsigned long long)data_bytes);
    if (e - b != bytes)
        return mn__st_fail(out, lg, MN_ERR_PARSE,
                           "tensor \"%.60s\": data_offsets span %llu bytes, shape needs %llu",
                           name, (unsigned long long)(e - b), (unsigned long long)bytes);
    *elements = n;
    range->begin = b, range->end = e;
    return MN_OK;
}

// Tensors that checkpoints save but that are not parameters: position-id tables, rotary
// frequency tables and GPT-2's causal-mask buffers.
MN__PRIVATE int mn__st_is_buffer(const mn_json_value *key) {
    static const char *const suffix[] = {"position_ids", "rotary_emb.inv_freq", ".attn.bias",
                                         ".attn.masked_bias"};
    size_t k, n;
    for (k = 0; k < sizeof suffix / sizeof suffix[0]; k++) {
        n = strlen(suffix[k]);
        if (key->len >= n && memcmp(key->str + key->len - n, suffix[k], n) == 0) return 1;
    }
    return 0;
}

MNIMPL mn_result mn_safetensors_parse(const uint8_t *data, size_t len, uint64_t file_size,
                                      const mn_safetensors_desc *desc, mn_safetensors_info *out) {
    mn_safetensors_desc d;
    mn_json_desc jd;
    mn_json_doc doc;
    const mn_json_value *root;
    mn__st_range *ranges = NULL;
    uint64_t n_header, data_bytes, ntensors = 0, best = 0, prev_end = 0, k;
    uint32_t m;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.max_header == 0) d.max_header = MN__ST_MAX_HEADER;
    out->alloc_ = d.allocator;
    if (!data && len) return MN_ERR_INVALID_ARG;
    if (file_size == 0) file_size = len;
    if (file_size < len)
        return mn__st_fail(out, &d.logger, MN_ERR_INVALID_ARG, "file_size %llu < %llu bytes given",
                           (unsigned long long)file_size, (unsigned long long)len);
    if (len < 8)
        return mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                           "%llu bytes: shorter than the 8-byte header length",
                           (unsigned long long)len);
    n_header = 0;
    for (k = 0; k < 8; k++) n_header |= (uint64_t)data[k] << (8 * k);
    if (n_header > d.max_header)
        return mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                           "header length %llu exceeds the limit %llu",
                           (unsigned long long)n_header, (unsigned long long)d.max_header);
    if (n_header > file_size - 8)
        return mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                           "header length %llu runs past the end of the %llu-byte file",
                           (unsigned long long)n_header, (unsigned long long)file_size);
    if (n_header > len - 8)
        return mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                           "header truncated: %llu of %llu bytes given",
                           (unsigned long long)(len - 8), (unsigned long long)n_header);
    if (n_header < 2 || data[8] != '{')
        return mn__st_fail(out, &d.logger, MN_ERR_PARSE, "header does not start with '{'");
    data_bytes = file_size - 8 - n_header;
    memset(&jd, 0, sizeof jd);
    jd.allocator = d.allocator;
    jd.max_bytes = n_header;
    r = mn_json_parse((const char *)data + 8, (size_t)n_header, &jd, &doc);
    if (r != MN_OK) {
        mn__st_fail(out, &d.logger, r, "header JSON: %s", doc.error);
        goto done;
    }
    root = doc.root;
    if (root->type != MN_JSON_OBJECT) {
        r = mn__st_fail(out, &d.logger, MN_ERR_PARSE, "header is not a JSON object");
        goto done;
    }
    ranges = (mn__st_range *)mn__alloc_array(&d.allocator, root->len, sizeof *ranges);
    if (!ranges) {
        r = mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
        goto done;
    }
    for (m = 0; m < root->len; m++) {
        const mn_json_value *key = &root->items[2 * m], *v = &root->items[2 * m + 1];
        mn_st_dtype dt = MN_ST_UNKNOWN;
        uint64_t elements = 0, nbytes;
        if (strcmp(key->str, "__metadata__") == 0 && key->len == 12) {
            uint32_t j;
            if (v->type != MN_JSON_OBJECT) {
                r = mn__st_fail(out, &d.logger, MN_ERR_PARSE, "__metadata__ is not an object");
                goto done;
            }
            for (j = 0; j < v->len; j++) {
                if (v->items[2 * j + 1].type != MN_JSON_STRING) {
                    r = mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                                    "__metadata__ value \"%.60s\" is not a string",
                                    v->items[2 * j].str);
                    goto done;
                }
            }
            out->metadata_count = v->len;
            continue;
        }
        r = mn__st_tensor(out, &d.logger, key, v, data_bytes, &dt, &elements, &ranges[ntensors]);
        if (r != MN_OK) goto done;
        ranges[ntensors++].member = m;
        nbytes = mn_st_dtype_bytes(dt) * elements;  // checked in mn__st_tensor
        if (mn__st_is_buffer(key)) {
            if (mn_add_u64(out->buffers, elements, &out->buffers) != MN_OK) {
                r = mn__st_fail(out, &d.logger, MN_ERR_OVERFLOW, "buffer count overflows 64 bits");
                goto done;
            }
            continue;
        }
        if (mn_add_u64(out->params, elements, &out->params) != MN_OK ||
            mn_add_u64(out->params_by_dtype[dt], elements, &out->params_by_dtype[dt]) != MN_OK ||
            mn_add_u64(out->bytes_by_dtype[dt], nbytes, &out->bytes_by_dtype[dt]) != MN_OK) {
            r = mn__st_fail(out, &d.logger, MN_ERR_OVERFLOW, "parameter count overflows 64 bits");
            goto done;
        }
    }
    // the tensors tile the data section: no gap, no overlap, nothing after the last
    mn__st_sort(ranges, ntensors);
    for (k = 0; k < ntensors; k++) {
        const char *name = root->items[2 * ranges[k].member].str;
        if (ranges[k].begin != prev_end) {
            r = mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                            ranges[k].begin < prev_end
                                ? "tensor \"%.60s\" at offset %llu overlaps the previous one"
                                : "tensor \"%.60s\" at offset %llu leaves a gap before it",
                            name, (unsigned long long)ranges[k].begin);
            goto done;
        }
        prev_end = ranges[k].end;
    }
    if (prev_end != data_bytes) {
        r = mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                        "tensors cover %llu of the %llu bytes of the data section",
                        (unsigned long long)prev_end, (unsigned long long)data_bytes);
        goto done;
    }
    if (d.keep_tensors && ntensors > 0) {
        // one block: tensors | shapes | names
        uint64_t dims = 0, names = 0, total;
        unsigned char *block;
        mn_safetensors_tensor *t;
        uint64_t *shape;
        char *name;
        for (k = 0; k < ntensors; k++) {
            const mn_json_value *v = &root->items[2 * ranges[k].member + 1];
            dims += mn_json_get(v, "shape")->len;
            names += root->items[2 * ranges[k].member].len + 1;
        }
        total = ntensors * sizeof(mn_safetensors_tensor) + dims * sizeof(uint64_t) + names;
        block = (unsigned char *)mn__alloc(&d.allocator, (size_t)total);  // < 50 * n_header
        if (!block) {
            r = mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
            goto done;
        }
        t = (mn_safetensors_tensor *)(void *)block;
        shape = (uint64_t *)(void *)(block + ntensors * sizeof(mn_safetensors_tensor));
        name = (char *)(shape + dims);
        for (k = 0; k < ntensors; k++) {
            const mn_json_value *key = &root->items[2 * ranges[k].member];
            const mn_json_value *v = key + 1, *sh = mn_json_get(v, "shape");
            const mn_json_value *dt = mn_json_get(v, "dtype");
            uint32_t j;
            int s;
            memcpy(name, key->str, (size_t)key->len + 1);
            t[k].name = name;
            name += key->len + 1;
            t[k].rank = sh->len;
            t[k].shape = shape;
            t[k].elements = 1;
            for (j = 0; j < sh->len; j++) {
                mn_json_u64(&sh->items[j], &shape[j]);
                t[k].elements *= shape[j];  // checked above
            }
            shape += sh->len;
            t[k].dtype = MN_ST_UNKNOWN;
            for (s = 1; s < MN_ST_DTYPE_COUNT; s++)
                if (strcmp(dt->str, mn__st_dtypes[s].name) == 0) t[k].dtype = (mn_st_dtype)s;
            t[k].begin = ranges[k].begin, t[k].end = ranges[k].end;
        }
        out->mem_ = block;
        out->tensor = t;
    }
    out->files = 1;
    out->header_bytes = n_header;
    out->data_bytes = data_bytes;
    out->tensors = ntensors;
    for (m = 1; m < MN_ST_DTYPE_COUNT; m++) {
        if (out->params_by_dtype[m] > best)
            best = out->params_by_dtype[m], out->st_dtype = (mn_st_dtype)m;
    }
    out->dtype = mn_st_dtype_to_dtype(out->st_dtype);
    r = MN_OK;
done:
    mn__free(&d.allocator, ranges);
    mn_json_free(&doc);
    return r;
}

MNIMPL void mn_safetensors_free(mn_safetensors_info *info) {
    if (!info) return;
    mn__free(&info->alloc_, info->mem_);
    info->mem_ = NULL;
    info->tensor = NULL;
}

MNIMPL mn_result mn_safetensors_read_file(const char *path, const mn_safetensors_desc *desc,
                                          mn_safetensors_info *out) {
    mn_safetensors_desc d;
    FILE *f;
    uint64_t size;
    unsigned char pre[8];
    uint8_t *buf;
    uint64_t n = 0, max;
    size_t want;
    int k;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    out->alloc_ = d.allocator;
    if (!path) return MN_ERR_INVALID_ARG;
    max = d.max_header ? d.max_header : MN__ST_MAX_HEADER;
    f = fopen(path, "rb");
    if (!f)
        return mn__st_fail(out, &d.logger, errno == ENOENT ? MN_ERR_NOT_FOUND : MN_ERR_IO,
                           "%.100s: cannot open", path);
    if (!mn__file_size(f, &size) || fread(pre, 1, 8, f) != 8) {
        fclose(f);
        return mn__st_fail(out, &d.logger, MN_ERR_IO, "%.100s: cannot read the header length",
                           path);
    }
    for (k = 0; k < 8; k++) n |= (uint64_t)pre[k] << (8 * k);
    if (n > max || n > size - 8 || n > (uint64_t)SIZE_MAX - 8) {
        fclose(f);
        return mn_safetensors_parse(pre, 8, size, &d, out);  // reports the bad length
    }
    want = (size_t)(8 + n);
    buf = (uint8_t *)mn__alloc(&d.allocator, want);
    if (!buf) {
        fclose(f);
        return mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
    }
    memcpy(buf, pre, 8);
    if (fread(buf + 8, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        mn__free(&d.allocator, buf);
        return mn__st_fail(out, &d.logger, MN_ERR_IO, "%.100s: cannot read the header", path);
    }
    fclose(f);
    r = mn_safetensors_parse(buf, want, size, &d, out);
    mn__free(&d.allocator, buf);
    return r;
}

// Heap sort of strings (no recursion, O(n log n) even on hostile input).
MN__PRIVATE void mn__sort_strs(const char **a, size_t n) {
    size_t k, end, root, child;
    const char *t;
    if (n < 2) return;
    for (k = n / 2; k-- > 0;) {
        for (root = k; (child = 2 * root + 1) < n; root = child) {
            if (child + 1 < n && strcmp(a[child], a[child + 1]) < 0) child++;
            if (strcmp(a[root], a[child]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
    for (end = n - 1; end > 0; end--) {
        t = a[0], a[0] = a[end], a[end] = t;
        for (root = 0; (child = 2 * root + 1) < end; root = child) {
            if (child + 1 < end && strcmp(a[child], a[child + 1]) < 0) child++;
            if (strcmp(a[root], a[child]) >= 0) break;
            t = a[root], a[root] = a[child], a[child] = t;
        }
    }
}

// "dir/name" in a fresh buffer.
MN__PRIVATE char *mn__path_join(const mn_allocator *a, const char *dir, const char *name) {
    size_t nd = strlen(dir), nn = strlen(name);
    char *p = (char *)mn__alloc(a, nd + nn + 2);
    if (!p) return NULL;
    memcpy(p, dir, nd);
    p[nd] = '/';
    memcpy(p + nd + 1, name, nn + 1);
    return p;
}

MN__PRIVATE mn_result mn__st_add_shard(const char *dir, const char *name,
                                       const mn_safetensors_desc *d, mn_safetensors_info *out) {
    mn_safetensors_info one;
    mn_safetensors_desc d1 = *d;
    char *path = mn__path_join(&d->allocator, dir, name);
    mn_result r;
    int t;
    if (!path) return mn__st_fail(out, &d->logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
    d1.keep_tensors = 0;
    d1.logger.log_fn = NULL;
    r = mn_safetensors_read_file(path, &d1, &one);
    mn__free(&d->allocator, path);
    if (r != MN_OK) {
        // a missing file is the caller's to judge (no weights at all, or a missing shard)
        if (r == MN_ERR_NOT_FOUND) snprintf(out->error, sizeof out->error, "%.60s: missing", name);
        else r = mn__st_fail(out, &d->logger, r, "%.60s: %s", name, one.error);
        mn_safetensors_free(&one);
        return r;
    }
    out->files++;
    if (mn_add_u64(out->header_bytes, one.header_bytes, &out->header_bytes) != MN_OK ||
        mn_add_u64(out->data_bytes, one.data_bytes, &out->data_bytes) != MN_OK ||
        mn_add_u64(out->tensors, one.tensors, &out->tensors) != MN_OK ||
        mn_add_u64(out->params, one.params, &out->params) != MN_OK ||
        mn_add_u64(out->buffers, one.buffers, &out->buffers) != MN_OK)
        return mn__st_fail(out, &d->logger, MN_ERR_OVERFLOW, "totals overflow 64 bits");
    for (t = 0; t < MN_ST_DTYPE_COUNT; t++) {
        if (mn_add_u64(out->params_by_dtype[t], one.params_by_dtype[t], &out->params_by_dtype[t]) ||
            mn_add_u64(out->bytes_by_dtype[t], one.bytes_by_dtype[t], &out->bytes_by_dtype[t]))
            return mn__st_fail(out, &d->logger, MN_ERR_OVERFLOW, "totals overflow 64 bits");
    }
    out->metadata_count += one.metadata_count;
    mn_safetensors_free(&one);
    return MN_OK;
}

MNIMPL mn_result mn_safetensors_read_dir(const char *dir, const mn_safetensors_desc *desc,
                                         mn_safetensors_info *out) {
    mn_safetensors_desc d;
    mn_json_desc jd;
    mn_json_doc doc;
    const mn_json_value *map;
    const char **shards = NULL;
    char *path, *text = NULL;
    size_t len;
    uint32_t k, j, nshards = 0;
    uint64_t best = 0;
    int t;
    mn_result r;
    if (!out) return MN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    memset(&doc, 0, sizeof doc);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    out->alloc_ = d.allocator;
    if (!dir) return MN_ERR_INVALID_ARG;
    path = mn__path_join(&d.allocator, dir, "model.safetensors.index.json");
    if (!path) return mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
    r = mn__read_file(&d.allocator, path, 256ull << 20, &text, &len);
    mn__free(&d.allocator, path);
    if (r == MN_ERR_NOT_FOUND) {
        r = mn__st_add_shard(dir, "model.safetensors", &d, out);
        if (r == MN_ERR_NOT_FOUND)  // not an error in itself: logged by callers that need weights
            snprintf(out->error, sizeof out->error, "%.100s: no model.safetensors[.index.json]",
                     dir);
        goto totals;
    }
    if (r != MN_OK) {
        return mn__st_fail(out, &d.logger, r, "%.100s: cannot read model.safetensors.index.json",
                           dir);
    }
    memset(&jd, 0, sizeof jd);
    jd.allocator = d.allocator;
    r = mn_json_parse(text, len, &jd, &doc);
    if (r != MN_OK) {
        mn__st_fail(out, &d.logger, r, "model.safetensors.index.json: %s", doc.error);
        goto done;
    }
    map = mn_json_get(doc.root, "weight_map");
    if (!map || map->type != MN_JSON_OBJECT) {
        r = mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                        "model.safetensors.index.json has no \"weight_map\" object");
        goto done;
    }
    shards = (const char **)mn__alloc_array(&d.allocator, map->len, sizeof *shards);
    if (!shards) {
        r = mn__st_fail(out, &d.logger, MN_ERR_OUT_OF_MEMORY, "out of memory");
        goto done;
    }
    for (k = 0; k < map->len; k++) {
        const mn_json_value *v = &map->items[2 * k + 1];
        if (v->type != MN_JSON_STRING || v->len == 0 || strlen(v->str) != v->len ||
            strchr(v->str, '/') || strchr(v->str, '\\') || v->str[0] == '.') {
            r = mn__st_fail(out, &d.logger, MN_ERR_PARSE,
                            "weight_map: \"%.60s\" does not name a file in the folder",
                            map->items[2 * k].str);
            goto done;
        }
        shards[k] = v->str;
    }
    // the distinct shard names, in order
    mn__sort_strs(shards, map->len);
    for (k = 0; k < map->len; k++) {
        if (nshards == 0 || strcmp(shards[nshards - 1], shards[k]) != 0)
            shards[nshards++] = shards[k];
    }
    for (j = 0; j < nshards; j++) {
        r = mn__st_add_shard(dir, shards[j], &d, out);
        if (r == MN_ERR_NOT_FOUND)  // named by the index: missing is an error, not "no weights"
            r = mn__st_fail(out, &d.logger, MN_ERR_IO, "%.60s: listed in the index, missing",
                            shards[j]);
        if (r != MN_OK) goto done;
    }
    if (out->tensors != map->len)
        mn__log(&d.logger, MN_LOG_WARN,
                "safetensors: weight_map lists %u tensors, shards hold %llu", (unsigned)map->len,
                (unsigned long long)out->tensors);
totals:
    if (r == MN_OK) {
        for (t = 1; t < MN_ST_DTYPE_COUNT; t++) {
            if (out->params_by_dtype[t] > best)
                best = out->params_by_dtype[t], out->st_dtype = (mn_st_dtype)t;
        }
        out->dtype = mn_st_dtype_to_dtype(out->st_dtype);
    }
done:
    mn__free(&d.allocator, (void *)shards);
    mn_json_free(&doc);
    mn__free(&d.allocator, text);
    return r;
}
