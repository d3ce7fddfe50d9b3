/* Conformance driver for kdtr.h (built by tests/kdtr/test_c_reader.py as C99 and as C++).
 *
 *   kdtr_dump FILE               open + verify; print the metadata, then one line per tensor:
 *                                name \t dtype \t shape (a,b,..) \t offset \t nbytes \t crc32c \t byte sum
 *   kdtr_dump --flips FILE       for every single-bit flip of FILE: '1' if rejected, '0' if accepted
 *   kdtr_dump --truncations FILE for every proper prefix of FILE: '1' if rejected, '0' if accepted
 *   kdtr_dump --shrink FILE      open FILE, truncate it to half its size, then verify (which must fail cleanly)
 *
 * Exit 1 with "error: <message>" on stderr when FILE is rejected.
 */
#define _POSIX_C_SOURCE 200809L
#define KDTR_IMPLEMENTATION
#include "kdtr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rejected(const uint8_t *data, size_t size) {
    kdtr_file f;
    int bad = kdtr_open_memory(&f, data, size) != 0 || kdtr_verify(&f) != 0;
    kdtr_close(&f);
    return bad;
}

static uint8_t *slurp(const char *path, size_t *size) {
    FILE *fp = fopen(path, "rb");
    uint8_t *data;
    long n;
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    data = (uint8_t *)malloc(n > 0 ? (size_t)n : 1);
    *size = fread(data, 1, (size_t)n, fp);
    fclose(fp);
    return data;
}

static int mutations(const char *mode, const char *path) {
    size_t size = 0;
    uint8_t *data = slurp(path, &size);
    if (!data) return 2;
    if (strcmp(mode, "--flips") == 0) {
        for (size_t i = 0; i < size; i++)
            for (int bit = 0; bit < 8; bit++) {
                data[i] ^= (uint8_t)(1u << bit);
                putchar(rejected(data, size) ? '1' : '0');
                data[i] ^= (uint8_t)(1u << bit);
            }
    } else {
        for (size_t n = 0; n < size; n++) {
            uint8_t *prefix = (uint8_t *)malloc(n ? n : 1);
            memcpy(prefix, data, n);
            putchar(rejected(prefix, n) ? '1' : '0');
            free(prefix);
        }
    }
    putchar('\n');
    free(data);
    return 0;
}

static int shrink_then_verify(const char *path) {
    kdtr_file f;
    int status;
    if (kdtr_open(&f, path) != 0 || truncate(path, (off_t)(f.size / 2)) != 0) {
        fprintf(stderr, "error: cannot open or truncate %s\n", path);
        return 2;
    }
    status = kdtr_verify(&f);
    if (status != 0) fprintf(stderr, "error: %s\n", f.error);
    kdtr_close(&f);
    return status != 0;
}

int main(int argc, char **argv) {
    kdtr_file f;
    if (argc == 3 && strcmp(argv[1], "--shrink") == 0) return shrink_then_verify(argv[2]);
    if (argc == 3) return mutations(argv[1], argv[2]);
    if (argc != 2) {
        fprintf(stderr, "usage: kdtr_dump [--flips|--truncations] FILE\n");
        return 2;
    }
    if (kdtr_open(&f, argv[1]) != 0 || kdtr_verify(&f) != 0) {
        fprintf(stderr, "error: %s\n", f.error);
        kdtr_close(&f);
        return 1;
    }
    printf("version %u.%u alignment %u tensors %zu\n", f.version_major, f.version_minor, f.alignment, f.count);
    printf("metadata %.*s\n", (int)f.metadata_len, f.metadata);
    for (size_t i = 0; i < f.count; i++) {
        const kdtr_tensor *t = &f.tensors[i];
        const uint8_t *bytes = (const uint8_t *)kdtr_data(&f, t);
        unsigned long long sum = 0;
        if (kdtr_find(&f, t->name) != t || t->offset % f.alignment != 0) {
            fprintf(stderr, "error: lookup or alignment broken for %s\n", t->name);
            return 1;
        }
        for (uint64_t k = 0; k < t->nbytes; k++) sum += bytes[k];
        printf("%s\t%s\t(", t->name, kdtr_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) printf(d ? ",%llu" : "%llu", (unsigned long long)t->shape[d]);
        printf(")\t%llu\t%llu\t%u\t%llu\n", (unsigned long long)t->offset, (unsigned long long)t->nbytes,
               kdtr_crc32c(0, bytes, (size_t)t->nbytes), sum);
    }
    if (kdtr_find(&f, "no such tensor") != NULL) {
        fprintf(stderr, "error: found a tensor that is not there\n");
        return 1;
    }
    kdtr_close(&f);
    return 0;
}
