/* The C ABI's promises under misuse (issue 53): error codes out of range have a name, handles
 * are validated (a double close, a junk pointer and a handle of the wrong kind are
 * GPUNVME_ERROR_INVALID_HANDLE, never a crash or a hang), a read-only handle refuses every
 * change up front and lists what is on the medium, and every destructive call refuses without
 * `force`. Exits 0 and prints "c abi: OK" only if every check passed.
 *
 *   scripts/c-test.sh                  builds libgpunvme, this file, runs it
 *   cargo test -p gpunvme_capi         does the same (capi/tests/c_abi.rs)
 *   abi IMAGE                          (IMAGE: an existing file, e.g. `truncate -s 64M img`)
 */
#include <gpunvme.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int failures = 0;

static void expect(const char *what, gpunvme_error got, gpunvme_error want) {
    if (got != want) {
        fprintf(stderr, "FAIL %s: %s (%s), wanted %s\n", what, gpunvme_error_name(got),
                gpunvme_last_error_message(), gpunvme_error_name(want));
        failures++;
    } else {
        printf("ok   %s: %s%s%s\n", what, gpunvme_error_name(got), got ? " - " : "",
               got ? gpunvme_last_error_message() : "");
    }
}

static void expect_str(const char *what, const char *got, const char *want) {
    if (got == NULL || strcmp(got, want) != 0) {
        fprintf(stderr, "FAIL %s: \"%s\", wanted \"%s\"\n", what, got ? got : "(NULL)", want);
        failures++;
    } else {
        printf("ok   %s: \"%s\"\n", what, got);
    }
}

static void expect_u64(const char *what, uint64_t got, uint64_t want) {
    if (got != want) {
        fprintf(stderr, "FAIL %s: %llu, wanted %llu\n", what, (unsigned long long)got,
                (unsigned long long)want);
        failures++;
    } else {
        printf("ok   %s: %llu\n", what, (unsigned long long)got);
    }
}

/* A host file holding `n` bytes of `byte`; its path in `path` (a mkstemp template). */
static int host_file(char *path, unsigned char byte, size_t n) {
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    unsigned char *buf = malloc(n ? n : 1);
    if (!buf) return -1;
    memset(buf, byte, n);
    ssize_t w = write(fd, buf, n);
    free(buf);
    close(fd);
    return w == (ssize_t)n ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s IMAGE\n", argv[0]);
        return 2;
    }

    /* Error names: every code, and any other int, without undefined behaviour. */
    expect_str("error_name(NONE)", gpunvme_error_name(GPUNVME_ERROR_NONE), "none");
    expect_str("error_name(NOT_FOUND)", gpunvme_error_name(GPUNVME_ERROR_NOT_FOUND), "not_found");
    expect_str("error_name(INVALID_HANDLE)", gpunvme_error_name(GPUNVME_ERROR_INVALID_HANDLE),
               "invalid_handle");
    expect_str("error_name(9999)", gpunvme_error_name(9999), "unknown");
    expect_str("error_name(-1)", gpunvme_error_name(-1), "unknown");
    expect_str("error_name(17)", gpunvme_error_name(GPUNVME_ERROR_INVALID_HANDLE + 1), "unknown");
    expect_str("error_name(INT32_MIN)", gpunvme_error_name(INT32_MIN), "unknown");

    char one[] = "/tmp/gpunvme-c-abi-one-XXXXXX", two[] = "/tmp/gpunvme-c-abi-two-XXXXXX";
    if (host_file(one, 1, 5000) || host_file(two, 2, 7000)) return 2;

    gpunvme_open_options o = gpunvme_open_options_default();
    o.device = argv[1];
    gpunvme_device *dev = NULL;
    expect("open", gpunvme_open(&o, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return 1;
    expect("mkfs", gpunvme_mkfs(dev, 4096, true), GPUNVME_ERROR_NONE);
    expect("put", gpunvme_put(dev, one, "kept", false), GPUNVME_ERROR_NONE);

    /* Every destructive call refuses without force, and nothing changes. */
    expect("mkfs over a file system without force", gpunvme_mkfs(dev, 4096, false),
           GPUNVME_ERROR_REFUSED);
    expect("put over a file without force", gpunvme_put(dev, two, "kept", false),
           GPUNVME_ERROR_EXISTS);
    expect("get onto the device's own image", gpunvme_get(dev, "kept", argv[1]),
           GPUNVME_ERROR_REFUSED);
    uint64_t size = 0;
    expect("file_size after the refusals", gpunvme_file_size(dev, "kept", &size),
           GPUNVME_ERROR_NONE);
    expect_u64("the old file's size", size, 5000);

    /* Junk handles: never dereferenced, always GPUNVME_ERROR_INVALID_HANDLE. */
    int on_the_stack = 0;
    gpunvme_device *junk[] = {
        (gpunvme_device *)(uintptr_t)0xdeadbeef0,
        (gpunvme_device *)(uintptr_t)0x10,
        (gpunvme_device *)&on_the_stack,
        (gpunvme_device *)((uintptr_t)dev + 16),
    };
    for (size_t i = 0; i < sizeof junk / sizeof junk[0]; i++) {
        gpunvme_device *j = junk[i];
        size_t got = 0;
        char buf[8];
        printf("-- junk handle %zu\n", i);
        expect("mkfs(junk)", gpunvme_mkfs(j, 4096, true), GPUNVME_ERROR_INVALID_HANDLE);
        expect("put(junk)", gpunvme_put(j, one, "x", true), GPUNVME_ERROR_INVALID_HANDLE);
        expect("get(junk)", gpunvme_get(j, "kept", "/tmp/gpunvme-c-abi-never"),
               GPUNVME_ERROR_INVALID_HANDLE);
        expect("file_size(junk)", gpunvme_file_size(j, "kept", &size),
               GPUNVME_ERROR_INVALID_HANDLE);
        expect("read(junk)", gpunvme_read(j, "kept", 0, buf, sizeof buf, &got),
               GPUNVME_ERROR_INVALID_HANDLE);
        expect("remove(junk)", gpunvme_remove(j, "kept"), GPUNVME_ERROR_INVALID_HANDLE);
        expect("release_gpu(junk)", gpunvme_release_gpu(j), GPUNVME_ERROR_INVALID_HANDLE);
        expect("close(junk)", gpunvme_close(j), GPUNVME_ERROR_INVALID_HANDLE);
        expect("gpu_unmap(junk)", gpunvme_gpu_unmap((gpunvme_gpu_mapping *)j),
               GPUNVME_ERROR_INVALID_HANDLE);
        expect("gpu_file_close(junk)", gpunvme_gpu_file_close((gpunvme_gpu_file *)j),
               GPUNVME_ERROR_INVALID_HANDLE);
    }
    /* A handle of the wrong kind: a device is no mapping and no GPU file. */
    expect("gpu_unmap(a device)", gpunvme_gpu_unmap((gpunvme_gpu_mapping *)dev),
           GPUNVME_ERROR_INVALID_HANDLE);
    expect("gpu_file_close(a device)", gpunvme_gpu_file_close((gpunvme_gpu_file *)dev),
           GPUNVME_ERROR_INVALID_HANDLE);
    expect("the device still works", gpunvme_file_size(dev, "kept", &size), GPUNVME_ERROR_NONE);
    /* NULL stays "nothing" for the closers and an argument error elsewhere. */
    expect("close(NULL)", gpunvme_close(NULL), GPUNVME_ERROR_NONE);
    expect("gpu_unmap(NULL)", gpunvme_gpu_unmap(NULL), GPUNVME_ERROR_NONE);
    expect("gpu_file_close(NULL)", gpunvme_gpu_file_close(NULL), GPUNVME_ERROR_NONE);
    expect("file_size(NULL)", gpunvme_file_size(NULL, "kept", &size),
           GPUNVME_ERROR_INVALID_ARGUMENT);

    /* Close, then a double close and calls on the closed handle. */
    expect("close", gpunvme_close(dev), GPUNVME_ERROR_NONE);
    expect("close again", gpunvme_close(dev), GPUNVME_ERROR_INVALID_HANDLE);
    expect("file_size on a closed handle", gpunvme_file_size(dev, "kept", &size),
           GPUNVME_ERROR_INVALID_HANDLE);
    expect("mkfs on a closed handle", gpunvme_mkfs(dev, 4096, true),
           GPUNVME_ERROR_INVALID_HANDLE);

    /* Read-only: changes refused up front, the listing as on the medium. */
    o.read_only = true;
    gpunvme_device *ro = NULL;
    expect("open read-only", gpunvme_open(&o, &ro), GPUNVME_ERROR_NONE);
    if (!ro) return 1;
    if (ro == dev) {
        /* Tokens are never reused: the closed handle must not name the new device. */
        fprintf(stderr, "FAIL a new handle reuses a closed one's value\n");
        failures++;
    }
    expect("put on a read-only handle", gpunvme_put(ro, two, "new", false),
           GPUNVME_ERROR_READ_ONLY);
    expect("put --force on a read-only handle", gpunvme_put(ro, two, "kept", true),
           GPUNVME_ERROR_READ_ONLY);
    expect("remove on a read-only handle", gpunvme_remove(ro, "kept"), GPUNVME_ERROR_READ_ONLY);
    expect("mkfs --force on a read-only handle", gpunvme_mkfs(ro, 4096, true),
           GPUNVME_ERROR_READ_ONLY);
    expect("the refused put left no file", gpunvme_file_size(ro, "new", &size),
           GPUNVME_ERROR_NOT_FOUND);
    size = 0;
    expect("the refused remove hid nothing", gpunvme_file_size(ro, "kept", &size),
           GPUNVME_ERROR_NONE);
    expect_u64("the kept file's size", size, 5000);
    expect("close the read-only handle", gpunvme_close(ro), GPUNVME_ERROR_NONE);
    expect("and again", gpunvme_close(ro), GPUNVME_ERROR_INVALID_HANDLE);

    /* A fresh read-write handle sees the same. */
    o.read_only = false;
    expect("reopen", gpunvme_open(&o, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return 1;
    expect("no file from the refused put", gpunvme_file_size(dev, "new", &size),
           GPUNVME_ERROR_NOT_FOUND);
    expect("the kept file", gpunvme_file_size(dev, "kept", &size), GPUNVME_ERROR_NONE);
    expect_u64("its size", size, 5000);

    /* fsck: the report as JSON, its length told when the buffer is too small. */
    size_t need = 0;
    bool consistent = false;
    expect("fsck into no buffer", gpunvme_fsck(dev, false, true, NULL, 0, &need, &consistent),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    if (need == 0) {
        fprintf(stderr, "FAIL fsck told no report length\n");
        failures++;
    }
    char *report = malloc(need + 1);
    size_t got = 0;
    expect("fsck", gpunvme_fsck(dev, false, true, report, need + 1, &got, &consistent),
           GPUNVME_ERROR_NONE);
    expect_u64("fsck's report length", got, need);
    expect_u64("consistent", consistent, 1);
    if (!strstr(report, "\"lost\":[]") || !strstr(report, "\"reverted\":[]")) {
        fprintf(stderr, "FAIL fsck's report lacks empty lost/reverted lists: %s\n", report);
        failures++;
    }
    free(report);
    expect("fsck(NULL outputs)", gpunvme_fsck(dev, false, false, NULL, 0, NULL, NULL),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("close", gpunvme_close(dev), GPUNVME_ERROR_NONE);
    expect("fsck on a closed handle", gpunvme_fsck(dev, false, false, NULL, 0, &got, &consistent),
           GPUNVME_ERROR_INVALID_HANDLE);

    unlink(one);
    unlink(two);
    if (failures) {
        fprintf(stderr, "c abi: %d check(s) FAILED\n", failures);
        return 1;
    }
    printf("c abi: OK\n");
    return 0;
}
