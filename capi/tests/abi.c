/* The C ABI's promises under misuse (issue 53): error codes out of range have a name, handles
 * are validated (a double close, a junk pointer and a handle of the wrong kind are
 * GPUNVME_ERROR_INVALID_HANDLE, never a crash or a hang), a read-only handle refuses every
 * change up front and lists what is on the medium, and every destructive call refuses without
 * `force`. Exits 0 and prints "c abi: OK" only if every check passed.
 *
 *   scripts/c-test.sh                  builds libgpunvme, this file, runs it
 *   cargo test -p gpunvme_capi         does the same (capi/tests/c_abi.rs)
 *   abi IMAGE                          (IMAGE: an existing file, e.g. `truncate -s 64M img`)
 *   abi IMAGE FULL                     also: FULL, a 64 MiB image on a host file system with
 *                                      less room (c_abi.rs mounts an 8 MiB tmpfs when it can),
 *                                      where a 16 MiB put must be GPUNVME_ERROR_NO_SPACE
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

/* `text` contains `needle` (want 1) or does not (want 0). */
static void expect_has(const char *what, const char *text, const char *needle, int want) {
    int has = text != NULL && strstr(text, needle) != NULL;
    if (has != want) {
        fprintf(stderr, "FAIL %s: \"%s\" %s \"%s\"\n", what, text ? text : "(NULL)",
                want ? "lacks" : "contains", needle);
        failures++;
    } else {
        printf("ok   %s\n", what);
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
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: %s IMAGE [FULL]\n", argv[0]);
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

    /* The calls the CLI and Python have (issue 54): ls, stat, rename, df as JSON into the
     * caller's buffer; the controller's queue pairs; images made at a size; errors worded for
     * C (no CLI flags). */
    o.controller_queue_pairs = 2000;
    expect("open with 2000 queue pairs", gpunvme_open(&o, &dev), GPUNVME_ERROR_INVALID_ARGUMENT);
    o.controller_queue_pairs = 3;
    expect("open with 3 queue pairs", gpunvme_open(&o, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return 1;
    gpunvme_device *second = NULL;
    expect("a second handle on the image", gpunvme_open(&o, &second), GPUNVME_ERROR_BUSY);
    expect_has("  says it is open in this process", gpunvme_last_error_message(),
               "already open in this process", 1);
    char pid[32];
    snprintf(pid, sizeof pid, "process %d", (int)getpid());
    expect_has("  names no pid of ours", gpunvme_last_error_message(), pid, 0);
    expect("rename", gpunvme_rename(dev, "kept", "dir/renamed", false), GPUNVME_ERROR_NONE);
    expect("put another", gpunvme_put(dev, two, "dir/other", false), GPUNVME_ERROR_NONE);
    expect("rename onto a file", gpunvme_rename(dev, "dir/other", "dir/renamed", false),
           GPUNVME_ERROR_EXISTS);
    expect("rename a missing file", gpunvme_rename(dev, "nope", "x", false),
           GPUNVME_ERROR_NOT_FOUND);
    char buf[4096];
    need = 0;
    expect("ls into no buffer", gpunvme_ls(dev, "dir/", NULL, 0, &need),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("ls", gpunvme_ls(dev, "dir/", buf, sizeof buf, &got), GPUNVME_ERROR_NONE);
    expect_u64("ls's length told before", need, got);
    expect_has("ls names dir/renamed", buf, "\"name\":\"dir/renamed\"", 1);
    expect_has("ls names dir/other", buf, "\"name\":\"dir/other\"", 1);
    expect_has("ls no longer names kept", buf, "\"kept\"", 0);
    expect("stat", gpunvme_stat(dev, "dir/renamed", buf, sizeof buf, &got), GPUNVME_ERROR_NONE);
    expect_has("stat's size", buf, "\"size\":5000", 1);
    expect("stat a missing file", gpunvme_stat(dev, "kept", buf, sizeof buf, &got),
           GPUNVME_ERROR_NOT_FOUND);
    expect("rename by force", gpunvme_rename(dev, "dir/other", "dir/renamed", true),
           GPUNVME_ERROR_NONE);
    expect("stat the replaced file", gpunvme_stat(dev, "dir/renamed", buf, sizeof buf, &got),
           GPUNVME_ERROR_NONE);
    expect_has("  has the other's size", buf, "\"size\":7000", 1);
    expect("df", gpunvme_df(dev, buf, sizeof buf, &got), GPUNVME_ERROR_NONE);
    expect_has("df counts one file", buf, "\"files\":1", 1);
    expect("df into 4 bytes", gpunvme_df(dev, buf, 4, &got), GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("close", gpunvme_close(dev), GPUNVME_ERROR_NONE);
    expect("ls on a closed handle", gpunvme_ls(dev, "", buf, sizeof buf, &got),
           GPUNVME_ERROR_INVALID_HANDLE);

    char made[] = "/tmp/gpunvme-c-abi-made-XXXXXX";
    int fd = mkstemp(made);
    if (fd < 0) return 2;
    close(fd);
    unlink(made);
    gpunvme_open_options m = gpunvme_open_options_default();
    m.device = made;
    expect("open a missing image", gpunvme_open(&m, &dev), GPUNVME_ERROR_NOT_FOUND);
    expect_has("  says how to make it in C", gpunvme_last_error_message(),
               "gpunvme_image_create()", 1);
    expect_has("  names no CLI flag", gpunvme_last_error_message(), "--", 0);
    expect_has("  nor truncate", gpunvme_last_error_message(), "truncate", 0);
    expect("image_create of 1000 bytes", gpunvme_image_create(made, 1000, 512, false),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("nothing made", access(made, F_OK) == 0 ? GPUNVME_ERROR_EXISTS : GPUNVME_ERROR_NONE,
           GPUNVME_ERROR_NONE);
    expect("image_create", gpunvme_image_create(made, 32 << 20, 4096, false), GPUNVME_ERROR_NONE);
    expect("image_create over it", gpunvme_image_create(made, 32 << 20, 4096, false),
           GPUNVME_ERROR_EXISTS);
    expect_has("  says force = true", gpunvme_last_error_message(), "force = true", 1);
    m.lba_size = 4096;
    expect("open the made image", gpunvme_open(&m, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return 1;
    expect("mkfs on it", gpunvme_mkfs(dev, 4096, false), GPUNVME_ERROR_NONE);
    expect("image_create by force while it is open",
           gpunvme_image_create(made, 32 << 20, 4096, true), GPUNVME_ERROR_BUSY);
    expect("close", gpunvme_close(dev), GPUNVME_ERROR_NONE);
    unlink(made);
    m.create_bytes = 16 << 20;
    expect("open with create_bytes", gpunvme_open(&m, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return 1;
    expect("mkfs on the created image", gpunvme_mkfs(dev, 4096, false), GPUNVME_ERROR_NONE);
    expect("close", gpunvme_close(dev), GPUNVME_ERROR_NONE);
    unlink(made);

    /* The host file system holding an image full: ENOSPC by name, not a Write Fault. */
    if (argc == 3) {
        char big[] = "/tmp/gpunvme-c-abi-big-XXXXXX";
        if (host_file(big, 7, 16 << 20)) return 2;
        gpunvme_open_options f = gpunvme_open_options_default();
        f.device = argv[2];
        expect("open the image on a small file system", gpunvme_open(&f, &dev),
               GPUNVME_ERROR_NONE);
        if (!dev) return 1;
        expect("mkfs there", gpunvme_mkfs(dev, 4096, true), GPUNVME_ERROR_NONE);
        expect("put more than the host file system holds", gpunvme_put(dev, big, "big", false),
               GPUNVME_ERROR_NO_SPACE);
        expect_has("  names ENOSPC", gpunvme_last_error_message(),
                   "no space left on the host file system holding", 1);
        expect("nothing stored", gpunvme_file_size(dev, "big", &size), GPUNVME_ERROR_NOT_FOUND);
        expect("close", gpunvme_close(dev), GPUNVME_ERROR_NONE);
        unlink(big);
    }

    unlink(one);
    unlink(two);
    if (failures) {
        fprintf(stderr, "c abi: %d check(s) FAILED\n", failures);
        return 1;
    }
    printf("c abi: OK\n");
    return 0;
}
