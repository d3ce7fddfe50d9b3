/* kdtr.h: single-header C99 reader for KDTR 1.x files (kdtr_format/SPEC.md). Usable from C++.
 *
 * In exactly one C or C++ file:
 *     #define KDTR_IMPLEMENTATION
 *     #include "kdtr.h"
 *
 *     kdtr_file f;
 *     if (kdtr_open(&f, "fixture.kdtr") != 0) { fprintf(stderr, "%s\n", f.error); return 1; }
 *     const kdtr_tensor *t = kdtr_find(&f, "weights/norm");
 *     const float *w = (const float *)kdtr_data(&f, t);     // aligned pointer into the mapping
 *     if (kdtr_verify(&f) != 0) { fprintf(stderr, "%s\n", f.error); }
 *     kdtr_close(&f);
 *
 * kdtr_open validates the whole layout (the same rules, and the same messages, as the Python
 * reader when it opens a file: magic, version, byte order, trailer/index/metadata checksums, caps,
 * canonical offsets, shapes, unique UTF-8 names; metadata UTF-8, no NUL or byte-order mark, a
 * leading '{', nesting depth, integers within [-2**63, 2**64 - 1]). It does not parse the metadata
 * JSON: `metadata` points at the raw UTF-8 text (not NUL-terminated; use `metadata_len`). Tensor
 * checksums, and bool bytes being 0 or 1, are checked by kdtr_verify / kdtr_verify_tensor. Every
 * failure returns non-zero and leaves a one-line message naming the problem and the offset or
 * tensor in `error`.
 *
 * A file truncated while it is open: kdtr_verify checks the file's size first and fails cleanly;
 * touching data past the new end of file through kdtr_data is a bus error (SIGBUS), as with any
 * mmap. POSIX (open/mmap) for kdtr_open; kdtr_open_memory works anywhere.
 */
#ifndef KDTR_H
#define KDTR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDTR_VERSION_MAJOR 1
#define KDTR_VERSION_MINOR 0
#define KDTR_MAX_NDIM 8
#define KDTR_MAX_NAME_BYTES 1024u
#define KDTR_MAX_TENSORS 1000000u
#define KDTR_MAX_INDEX_BYTES (256u << 20)
#define KDTR_MAX_METADATA_BYTES (64u << 20)
#define KDTR_MAX_JSON_DEPTH 64

enum kdtr_dtype {
    KDTR_BOOL = 1, KDTR_INT8, KDTR_INT16, KDTR_INT32, KDTR_INT64,
    KDTR_UINT8, KDTR_UINT16, KDTR_UINT32, KDTR_UINT64,
    KDTR_FLOAT16, KDTR_BFLOAT16, KDTR_FLOAT32, KDTR_FLOAT64,
    KDTR_FLOAT8_E4M3FN, KDTR_FLOAT8_E5M2, KDTR_INT4
};

typedef struct kdtr_tensor {
    const char *name;              /* UTF-8, NUL-terminated, inside the mapping */
    uint32_t name_len;             /* bytes, without the NUL */
    uint8_t dtype;                 /* enum kdtr_dtype */
    uint8_t ndim;
    uint64_t shape[KDTR_MAX_NDIM]; /* unused dims are 0 */
    uint64_t offset;               /* absolute, a multiple of the file's alignment */
    uint64_t nbytes;               /* stored bytes (int4: ceil(elements / 2)) */
    uint32_t crc32c;               /* stored checksum of the bytes */
} kdtr_tensor;

typedef struct kdtr_file {
    const uint8_t *data;           /* the whole file */
    size_t size;
    int mapped;                    /* data came from mmap and is unmapped by kdtr_close */
    int fd;                        /* the open file when mapped (kdtr_verify checks its size), else -1 */
    uint16_t version_major, version_minor;
    uint32_t alignment;
    size_t count;
    kdtr_tensor *tensors;          /* file order */
    const kdtr_tensor **by_name;   /* sorted by name, for kdtr_find */
    const char *metadata;          /* JSON object text, metadata_len bytes, not NUL-terminated */
    size_t metadata_len;
    char error[320];
} kdtr_file;

int kdtr_open(kdtr_file *f, const char *path);
int kdtr_open_memory(kdtr_file *f, const void *data, size_t size); /* data must outlive f */
void kdtr_close(kdtr_file *f);
const kdtr_tensor *kdtr_find(const kdtr_file *f, const char *name); /* NULL when absent */
const void *kdtr_data(const kdtr_file *f, const kdtr_tensor *t);
int kdtr_verify_tensor(kdtr_file *f, const kdtr_tensor *t);
int kdtr_verify(kdtr_file *f);
uint32_t kdtr_crc32c(uint32_t crc, const void *data, size_t n);
const char *kdtr_dtype_name(int dtype);
uint64_t kdtr_elements(const kdtr_tensor *t);

#ifdef __cplusplus
}
#endif
#endif /* KDTR_H */

#ifdef KDTR_IMPLEMENTATION
#ifndef KDTR_IMPLEMENTATION_DONE
#define KDTR_IMPLEMENTATION_DONE

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if !defined(_WIN32)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define KDTR__HEADER 64u
#define KDTR__TRAILER 64u
#define KDTR__RECORD 104u
#define KDTR__TRAILER_CRC_SPAN 52u
#define KDTR__MAX_ELEMENT_BYTES ((uint64_t)1 << 62)

static const char *const kdtr__dtype_names[17] = {
    NULL, "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "int4"};
static const uint8_t kdtr__itemsize[17] = {0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1, 1};

const char *kdtr_dtype_name(int dtype) {
    return dtype >= 1 && dtype <= 16 ? kdtr__dtype_names[dtype] : NULL;
}

static uint16_t kdtr__u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t kdtr__u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t kdtr__u64(const uint8_t *p) { return (uint64_t)kdtr__u32(p) | ((uint64_t)kdtr__u32(p + 4) << 32); }

static int kdtr__fail(kdtr_file *f, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(f->error, sizeof f->error, fmt, args);
    va_end(args);
    return -1;
}

/* CRC32C (Castagnoli, reflected 0x82F63B78), slicing-by-8 tables built on first use. */
static uint32_t kdtr__crc_table[8][256];
static int kdtr__crc_ready = 0;

static void kdtr__crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        kdtr__crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int s = 1; s < 8; s++)
            kdtr__crc_table[s][i] = (kdtr__crc_table[s - 1][i] >> 8) ^ kdtr__crc_table[0][kdtr__crc_table[s - 1][i] & 0xFF];
    kdtr__crc_ready = 1;
}

uint32_t kdtr_crc32c(uint32_t crc, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    if (!kdtr__crc_ready) kdtr__crc_init();
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo = crc ^ kdtr__u32(p), hi = kdtr__u32(p + 4);
        crc = kdtr__crc_table[7][lo & 0xFF] ^ kdtr__crc_table[6][(lo >> 8) & 0xFF] ^
              kdtr__crc_table[5][(lo >> 16) & 0xFF] ^ kdtr__crc_table[4][lo >> 24] ^
              kdtr__crc_table[3][hi & 0xFF] ^ kdtr__crc_table[2][(hi >> 8) & 0xFF] ^
              kdtr__crc_table[1][(hi >> 16) & 0xFF] ^ kdtr__crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ kdtr__crc_table[0][(crc ^ *p++) & 0xFF];
    return ~crc;
}

/* Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF); returns the offset of
 * the first bad byte, or n when all is valid. */
static size_t kdtr__utf8_error(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
        else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }
        else return i;
        if (n - i < len) return i;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
            return i;
        i += len;
    }
    return n;
}

static int kdtr__name_cmp(const void *a, const void *b) {
    const kdtr_tensor *x = *(const kdtr_tensor *const *)a, *y = *(const kdtr_tensor *const *)b;
    return strcmp(x->name, y->name);
}

/* An integer of metadata: the digit run m[start, end) outside strings, with no fraction or exponent,
 * must lie in [-2**63, 2**64 - 1] (the Python reader's rule, byte for byte). */
static int kdtr__check_integer(kdtr_file *f, const uint8_t *m, size_t n, size_t start, size_t end, uint64_t at) {
    uint8_t prev = m[start - 1], prev2 = start >= 2 ? m[start - 2] : 0, next = end < n ? m[end] : 0;
    int negative = prev == '-';
    size_t len = end - start, begin = start - (size_t)negative;
    if (prev == '.' || prev == 'e' || prev == 'E' || prev == '+' || (negative && (prev2 == 'e' || prev2 == 'E')) ||
        next == '.' || next == 'e' || next == 'E' || len < 19)
        return 0;
    if (len > 20 || (len == 20 && (negative || memcmp(m + start, "18446744073709551615", 20) > 0)) ||
        (len == 19 && negative && memcmp(m + start, "9223372036854775808", 19) > 0))
        return kdtr__fail(f, "metadata integer %.*s%s is outside [-2**63, 2**64 - 1] (offset %llu)",
                          (int)(end - begin < 40 ? end - begin : 40), (const char *)(m + begin), end - begin > 40 ? "..." : "",
                          (unsigned long long)(at + begin));
    return 0;
}

/* A byte is escaped when an odd run of backslashes precedes it (inside strings or not); unescaped
 * quotes open and close strings; brackets and digits outside strings are structure. */
static int kdtr__check_metadata(kdtr_file *f, const uint8_t *m, size_t n, uint64_t at) {
    size_t bad = kdtr__utf8_error(m, n), i = 0, run_start = 0;
    int depth = 0, in_string = 0, odd_backslashes = 0, in_run = 0;
    if (bad != n) return kdtr__fail(f, "metadata is not valid UTF-8 (offset %llu)", (unsigned long long)(at + bad));
    {
        const uint8_t *nul = (const uint8_t *)memchr(m, 0, n);
        if (nul || (n >= 3 && m[0] == 0xEF && m[1] == 0xBB && m[2] == 0xBF))
            return kdtr__fail(f, "metadata contains a NUL or a byte-order mark (offset %llu)",
                              (unsigned long long)(at + (nul ? (size_t)(nul - m) : 0)));
    }
    while (i < n && (m[i] == ' ' || m[i] == '\t' || m[i] == '\r' || m[i] == '\n')) i++;
    if (i == n || m[i] != '{')
        return kdtr__fail(f, "metadata must be a JSON object (text starting with '{') (offset %llu)", (unsigned long long)(at + i));
    for (i = 0; i < n; i++) {
        uint8_t c = m[i];
        int quote = c == '"' && !odd_backslashes, structural = !in_string && !quote;
        int digit = structural && c >= '0' && c <= '9';
        odd_backslashes = c == '\\' ? !odd_backslashes : 0;
        if (in_run && !digit) {
            if (kdtr__check_integer(f, m, n, run_start, i, at) != 0) return -1;
            in_run = 0;
        }
        if (digit && !in_run) {
            in_run = 1;
            run_start = i;
        }
        if (quote) in_string = !in_string;
        if (!structural) continue;
        if (c == '{' || c == '[') {
            if (++depth > KDTR_MAX_JSON_DEPTH)
                return kdtr__fail(f, "metadata nests deeper than %d levels (offset %llu)", KDTR_MAX_JSON_DEPTH, (unsigned long long)(at + i));
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return in_run ? kdtr__check_integer(f, m, n, run_start, n, at) : 0;
}

static int kdtr__check_records(kdtr_file *f, const uint8_t *records, uint64_t index_offset) {
    uint64_t previous_end = KDTR__HEADER, a = f->alignment;
    for (size_t i = 0; i < f->count; i++) {
        const uint8_t *r = records + i * KDTR__RECORD;
        unsigned long long at = (unsigned long long)(index_offset + i * KDTR__RECORD);
        kdtr_tensor *t = &f->tensors[i];
        uint64_t bytes_bound, elements = 1, expected, canonical;
        t->offset = kdtr__u64(r);
        t->nbytes = kdtr__u64(r + 8);
        t->crc32c = kdtr__u32(r + 28);
        t->dtype = r[32];
        t->ndim = r[33];
        if (t->dtype < 1 || t->dtype > 16)
            return kdtr__fail(f, "unknown dtype code %u (tensor '%s', offset %llu)", t->dtype, t->name, at + 32);
        if (t->ndim > KDTR_MAX_NDIM)
            return kdtr__fail(f, "ndim %u exceeds %d (tensor '%s', offset %llu)", t->ndim, KDTR_MAX_NDIM, t->name, at + 33);
        if (f->version_minor <= KDTR_VERSION_MINOR)
            for (int k = 34; k < 40; k++)
                if (r[k]) return kdtr__fail(f, "reserved record bytes are not zero (tensor '%s', offset %llu)", t->name, at + 34);
        bytes_bound = kdtr__itemsize[t->dtype];
        for (int d = 0; d < KDTR_MAX_NDIM; d++) {
            uint64_t dim = kdtr__u64(r + 40 + 8 * d);
            t->shape[d] = dim;
            if (d >= t->ndim) {
                if (dim) return kdtr__fail(f, "shape slots past ndim are not zero (tensor '%s', offset %llu)", t->name, at + 40);
                continue;
            }
            if (dim > 1 && bytes_bound > KDTR__MAX_ELEMENT_BYTES / dim)
                return kdtr__fail(f, "shape is too large (over 2**62 bytes) (tensor '%s', offset %llu)", t->name, at + 40);
            if (dim > 1) bytes_bound *= dim;
            elements *= dim;
        }
        expected = t->dtype == KDTR_INT4 ? (elements + 1) / 2 : elements * kdtr__itemsize[t->dtype];
        if (t->nbytes != expected)
            return kdtr__fail(f, "byte length %llu does not match shape and dtype (expected %llu) (tensor '%s', offset %llu)",
                              (unsigned long long)t->nbytes, (unsigned long long)expected, t->name, at + 8);
        canonical = (previous_end + a - 1) & ~(a - 1);
        if (t->offset > index_offset || t->nbytes > index_offset - t->offset)
            return kdtr__fail(f, "data runs past the tensor region, which ends at %llu (tensor '%s', offset %llu)",
                              (unsigned long long)index_offset, t->name, at);
        if (t->offset % a)
            return kdtr__fail(f, "data offset %llu is not a multiple of the alignment %llu (tensor '%s', offset %llu)",
                              (unsigned long long)t->offset, (unsigned long long)a, t->name, at);
        if (t->offset < previous_end)
            return kdtr__fail(f, "data offset %llu overlaps %s, which ends at %llu (tensor '%s', offset %llu)",
                              (unsigned long long)t->offset, i == 0 ? "the header" : "the previous tensor",
                              (unsigned long long)previous_end, t->name, at);
        if (t->offset != canonical)
            return kdtr__fail(f, "data offset %llu leaves a gap after the previous tensor (expected %llu) (tensor '%s', offset %llu)",
                              (unsigned long long)t->offset, (unsigned long long)canonical, t->name, at);
        previous_end = t->offset + t->nbytes;
    }
    if (((previous_end + a - 1) & ~(a - 1)) != index_offset)
        return kdtr__fail(f, "index offset %llu does not follow the last tensor (offset %llu)",
                          (unsigned long long)index_offset, (unsigned long long)index_offset);
    return 0;
}

static int kdtr__parse(kdtr_file *f) {
    const uint8_t *d = f->data;
    size_t size = f->size;
    uint8_t crc_span[KDTR__HEADER + KDTR__TRAILER_CRC_SPAN];
    const uint8_t *tr, *records, *names;
    uint64_t trailer_at, index_offset, count, names_size, metadata_size, name_cursor = 0;
    static const uint8_t magic[8] = {0x89, 'K', 'D', 'T', 'R', '\r', '\n', 0x1A};

    if (size < KDTR__HEADER + KDTR__TRAILER)
        return kdtr__fail(f, "file is %llu bytes, smaller than header plus trailer (128) (offset %llu)",
                          (unsigned long long)size, (unsigned long long)size);
    if (memcmp(d, magic, 8) != 0) return kdtr__fail(f, "not a KDTR file: bad magic (offset 0)");
    f->version_major = kdtr__u16(d + 8);
    f->version_minor = kdtr__u16(d + 10);
    if (f->version_major != KDTR_VERSION_MAJOR)
        return kdtr__fail(f, "unsupported KDTR major version %u.%u; this reader knows 1.x (offset 8)", f->version_major, f->version_minor);
    if (kdtr__u32(d + 12) != 0x01020304u) return kdtr__fail(f, "byte-order mark is not little-endian 0x01020304 (offset 12)");
    trailer_at = size - KDTR__TRAILER;
    tr = d + trailer_at;
    if (memcmp(tr + 56, "KDTR_END", 8) != 0)
        return kdtr__fail(f, "end magic is not KDTR_END (truncated file?) (offset %llu)", (unsigned long long)(size - 8));
    memcpy(crc_span, d, KDTR__HEADER);
    memcpy(crc_span + KDTR__HEADER, tr, KDTR__TRAILER_CRC_SPAN);
    if (kdtr_crc32c(0, crc_span, sizeof crc_span) != kdtr__u32(tr + 52))
        return kdtr__fail(f, "trailer checksum mismatch (offset %llu)", (unsigned long long)(trailer_at + 52));
    f->alignment = kdtr__u32(d + 16);
    if (f->alignment < 64 || f->alignment > 4096 || (f->alignment & (f->alignment - 1)))
        return kdtr__fail(f, "alignment %u is not a power of two from 64 to 4096 (offset 16)", f->alignment);
    if (f->version_minor <= KDTR_VERSION_MINOR) {
        for (int k = 20; k < 64; k++)
            if (d[k]) return kdtr__fail(f, "reserved header or trailer bytes are not zero (offset 20)");
        for (int k = 40; k < 52; k++)
            if (tr[k]) return kdtr__fail(f, "reserved header or trailer bytes are not zero (offset %llu)", (unsigned long long)(trailer_at + 40));
    }
    index_offset = kdtr__u64(tr);
    count = kdtr__u64(tr + 8);
    names_size = kdtr__u64(tr + 16);
    metadata_size = kdtr__u64(tr + 24);
    if (count > KDTR_MAX_TENSORS)
        return kdtr__fail(f, "tensor count %llu exceeds the cap of %u (offset %llu)", (unsigned long long)count,
                          KDTR_MAX_TENSORS, (unsigned long long)(trailer_at + 8));
    if (names_size > KDTR_MAX_INDEX_BYTES || count * KDTR__RECORD + names_size > KDTR_MAX_INDEX_BYTES)
        return kdtr__fail(f, "index exceeds the cap of %u bytes (offset %llu)", KDTR_MAX_INDEX_BYTES, (unsigned long long)trailer_at);
    if (metadata_size > KDTR_MAX_METADATA_BYTES)
        return kdtr__fail(f, "metadata of %llu bytes exceeds the cap of %u (offset %llu)", (unsigned long long)metadata_size,
                          KDTR_MAX_METADATA_BYTES, (unsigned long long)(trailer_at + 24));
    if (index_offset % f->alignment || index_offset < f->alignment)
        return kdtr__fail(f, "index offset %llu is not a multiple of %u past the header (offset %llu)",
                          (unsigned long long)index_offset, f->alignment, (unsigned long long)trailer_at);
    if (index_offset > trailer_at || trailer_at - index_offset != count * KDTR__RECORD + names_size + metadata_size)
        return kdtr__fail(f, "index and metadata do not end where the trailer starts (offset %llu)", (unsigned long long)trailer_at);
    records = d + index_offset;
    names = records + count * KDTR__RECORD;
    if (kdtr_crc32c(0, records, (size_t)(count * KDTR__RECORD + names_size)) != kdtr__u32(tr + 32))
        return kdtr__fail(f, "index checksum mismatch (offset %llu)", (unsigned long long)index_offset);

    f->count = (size_t)count;
    f->tensors = (kdtr_tensor *)calloc(count ? (size_t)count : 1, sizeof(kdtr_tensor));
    f->by_name = (const kdtr_tensor **)calloc(count ? (size_t)count : 1, sizeof(kdtr_tensor *));
    if (!f->tensors || !f->by_name) return kdtr__fail(f, "out of memory for %llu tensors", (unsigned long long)count);
    for (size_t i = 0; i < f->count; i++) {
        const uint8_t *r = records + i * KDTR__RECORD;
        unsigned long long at = (unsigned long long)(index_offset + i * KDTR__RECORD);
        uint64_t name_offset = kdtr__u64(r + 16);
        uint32_t name_len = kdtr__u32(r + 24);
        size_t bad;
        if (name_len == 0 || name_len > KDTR_MAX_NAME_BYTES)
            return kdtr__fail(f, "name length %u of record %zu is not 1..%u (offset %llu)", name_len, i, KDTR_MAX_NAME_BYTES, at + 24);
        if (name_offset != name_cursor)
            return kdtr__fail(f, "name offset %llu of record %zu, expected %llu (offset %llu)", (unsigned long long)name_offset, i,
                              (unsigned long long)name_cursor, at + 16);
        if (names_size - name_cursor <= name_len || names[name_cursor + name_len] != 0 ||
            memchr(names + name_cursor, 0, name_len))
            return kdtr__fail(f, "name of record %zu is not NUL-terminated where its length says, or holds a NUL (offset %llu)", i,
                              (unsigned long long)(index_offset + count * KDTR__RECORD + name_cursor));
        bad = kdtr__utf8_error(names + name_cursor, name_len);
        if (bad != name_len)
            return kdtr__fail(f, "name of record %zu is not valid UTF-8 (offset %llu)", i,
                              (unsigned long long)(index_offset + count * KDTR__RECORD + name_cursor + bad));
        f->tensors[i].name = (const char *)(names + name_cursor);
        f->tensors[i].name_len = name_len;
        f->by_name[i] = &f->tensors[i];
        name_cursor += (uint64_t)name_len + 1;
    }
    if (name_cursor != names_size)
        return kdtr__fail(f, "names take %llu bytes, the records say %llu (offset %llu)", (unsigned long long)names_size,
                          (unsigned long long)name_cursor, (unsigned long long)(index_offset + count * KDTR__RECORD));
    qsort((void *)f->by_name, f->count, sizeof(kdtr_tensor *), kdtr__name_cmp);
    for (size_t i = 1; i < f->count; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
            return kdtr__fail(f, "duplicate tensor name (tensor '%s', offset %llu)", f->by_name[i]->name, (unsigned long long)index_offset);
    if (kdtr__check_records(f, records, index_offset) != 0) return -1;

    f->metadata = (const char *)(names + names_size);
    f->metadata_len = (size_t)metadata_size;
    if (kdtr_crc32c(0, f->metadata, f->metadata_len) != kdtr__u32(tr + 36))
        return kdtr__fail(f, "metadata checksum mismatch (offset %llu)", (unsigned long long)(trailer_at - metadata_size));
    return kdtr__check_metadata(f, (const uint8_t *)f->metadata, f->metadata_len, trailer_at - metadata_size);
}

int kdtr_open_memory(kdtr_file *f, const void *data, size_t size) {
    memset(f, 0, sizeof *f);
    f->fd = -1;
    f->data = (const uint8_t *)data;
    f->size = size;
    if (kdtr__parse(f) != 0) {
        char error[sizeof f->error];
        memcpy(error, f->error, sizeof error);
        kdtr_close(f);
        memcpy(f->error, error, sizeof error);
        return -1;
    }
    return 0;
}

int kdtr_open(kdtr_file *f, const char *path) {
#if defined(_WIN32)
    memset(f, 0, sizeof *f);
    return kdtr__fail(f, "kdtr_open needs POSIX mmap; use kdtr_open_memory");
#else
    struct stat st;
    void *map;
    int fd = open(path, O_RDONLY | O_NONBLOCK), status;   /* a FIFO must not block the open */
    memset(f, 0, sizeof *f);
    if (fd < 0) return kdtr__fail(f, "cannot open %s", path);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return kdtr__fail(f, "%s is not a regular file", path);
    }
    if (st.st_size < (off_t)(KDTR__HEADER + KDTR__TRAILER)) {
        close(fd);
        return kdtr__fail(f, "file is %lld bytes, smaller than header plus trailer (128) (offset %lld)",
                          (long long)st.st_size, (long long)st.st_size);
    }
    map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        close(fd);
        return kdtr__fail(f, "cannot map %s", path);
    }
    status = kdtr_open_memory(f, map, (size_t)st.st_size);
    if (status != 0) {
        munmap(map, (size_t)st.st_size);
        close(fd);
        return status;
    }
    f->mapped = 1;
    f->fd = fd;
    return 0;
#endif
}

void kdtr_close(kdtr_file *f) {
#if !defined(_WIN32)
    if (f->mapped && f->data) munmap((void *)f->data, f->size);
    if (f->mapped) close(f->fd);
#endif
    free(f->tensors);
    free((void *)f->by_name);
    memset(f, 0, sizeof *f);
}

const kdtr_tensor *kdtr_find(const kdtr_file *f, const char *name) {
    size_t lo = 0, hi = f->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->by_name[mid]->name, name);
        if (c == 0) return f->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

const void *kdtr_data(const kdtr_file *f, const kdtr_tensor *t) { return f->data + t->offset; }

uint64_t kdtr_elements(const kdtr_tensor *t) {
    uint64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

int kdtr_verify_tensor(kdtr_file *f, const kdtr_tensor *t) {
    uint32_t actual;
#if !defined(_WIN32)
    struct stat st;
    if (f->mapped && fstat(f->fd, &st) != 0)
        return kdtr__fail(f, "cannot stat the open file (tensor '%s', offset %llu)", t->name, (unsigned long long)t->offset);
    if (f->mapped && (uint64_t)st.st_size < f->size)   /* names lie in the mapping too: number the tensor */
        return kdtr__fail(f, "the file is %lld bytes now, %llu when it was opened (changed while open?) (tensor #%zu, offset %llu)",
                          (long long)st.st_size, (unsigned long long)f->size, (size_t)(t - f->tensors), (unsigned long long)t->offset);
#endif
    if (t->dtype == KDTR_BOOL)
        for (uint64_t k = 0; k < t->nbytes; k++)
            if (f->data[t->offset + k] > 1)
                return kdtr__fail(f, "bool byte %u is not 0 or 1 (tensor '%s', offset %llu)", f->data[t->offset + k], t->name,
                                  (unsigned long long)(t->offset + k));
    actual = kdtr_crc32c(0, f->data + t->offset, (size_t)t->nbytes);
    if (actual != t->crc32c)
        return kdtr__fail(f, "data checksum mismatch: stored crc32c 0x%08x, computed 0x%08x (tensor '%s', offset %llu)",
                          t->crc32c, actual, t->name, (unsigned long long)t->offset);
    return 0;
}

int kdtr_verify(kdtr_file *f) {
    for (size_t i = 0; i < f->count; i++)
        if (kdtr_verify_tensor(f, &f->tensors[i]) != 0) return -1;
    return 0;
}

#ifdef __cplusplus
}
#endif
#endif /* KDTR_IMPLEMENTATION_DONE */
#endif /* KDTR_IMPLEMENTATION */
