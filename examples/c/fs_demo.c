/* gpunvme from C: open an image, make blockfs, put a file, read it back, and check that
 * every error comes back as its code with a message. Exits 0 and prints "c fs_demo: OK" only
 * if every check passed.
 *
 *   scripts/c-test.sh            builds libgpunvme, this file (with pkg-config), runs it
 *   fs_demo IMAGE                (IMAGE: an existing file, e.g. `truncate -s 64M img`)
 */
#include <gpunvme.h>

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

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s IMAGE\n", argv[0]);
        return 2;
    }
    printf("libgpunvme %s\n", gpunvme_version());

    /* A host file of known bytes. */
    enum { N = 300000 };
    unsigned char *data = malloc(N), *back = malloc(N + 16);
    if (!data || !back) return 2;
    for (size_t i = 0; i < N; i++) data[i] = (unsigned char)(i * 2654435761u >> 13);
    char src[] = "/tmp/gpunvme-c-demo-XXXXXX";
    int fd = mkstemp(src);
    if (fd < 0) return 2;
    FILE *f = fdopen(fd, "wb");
    if (!f || fwrite(data, 1, N, f) != N || fclose(f) != 0) return 2;

    gpunvme_open_options o = gpunvme_open_options_default();
    o.device = argv[1];
    o.lba_size = 4096;
    gpunvme_device *dev = NULL;
    expect("open", gpunvme_open(&o, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return 1;
    expect("mkfs", gpunvme_mkfs(dev, 4096, true), GPUNVME_ERROR_NONE);
    expect("put", gpunvme_put(dev, src, "c/data.bin", false), GPUNVME_ERROR_NONE);

    uint64_t size = 0;
    expect("file_size", gpunvme_file_size(dev, "c/data.bin", &size), GPUNVME_ERROR_NONE);
    if (size != N) {
        fprintf(stderr, "FAIL size %llu, wanted %d\n", (unsigned long long)size, N);
        failures++;
    }
    size_t got = 0;
    expect("read", gpunvme_read(dev, "c/data.bin", 0, back, N + 16, &got), GPUNVME_ERROR_NONE);
    if (got != N || memcmp(back, data, N) != 0) {
        fprintf(stderr, "FAIL read back %zu bytes, or they differ\n", got);
        failures++;
    }
    expect("read at an odd offset", gpunvme_read(dev, "c/data.bin", 12345, back, 1000, &got),
           GPUNVME_ERROR_NONE);
    if (got != 1000 || memcmp(back, data + 12345, 1000) != 0) {
        fprintf(stderr, "FAIL odd-offset read\n");
        failures++;
    }

    /* Every error as its code, nothing changed. */
    gpunvme_device *second = NULL;
    expect("a second handle on the image", gpunvme_open(&o, &second), GPUNVME_ERROR_BUSY);
    expect("read of a missing file", gpunvme_read(dev, "nope", 0, back, 8, &got),
           GPUNVME_ERROR_NOT_FOUND);
    expect("put over a file", gpunvme_put(dev, src, "c/data.bin", false), GPUNVME_ERROR_EXISTS);
    expect("mkfs over files", gpunvme_mkfs(dev, 4096, false), GPUNVME_ERROR_REFUSED);
    expect("a NULL name", gpunvme_read(dev, NULL, 0, back, 8, &got),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("a NULL handle", gpunvme_file_size(NULL, "c/data.bin", &size),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    gpunvme_open_options bad = o;
    bad.lba_size = 1000;
    expect("lba_size 1000", gpunvme_open(&bad, &second), GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("file_size after the errors", gpunvme_file_size(dev, "c/data.bin", &size),
           GPUNVME_ERROR_NONE);

    char dst[] = "/tmp/gpunvme-c-demo-out-XXXXXX";
    int dfd = mkstemp(dst);
    if (dfd < 0) return 2;
    close(dfd); /* get replaces the file (a new one renamed into place): reopen it by name */
    expect("get", gpunvme_get(dev, "c/data.bin", dst), GPUNVME_ERROR_NONE);
    FILE *g = fopen(dst, "rb");
    memset(back, 0, N);
    if (!g || fread(back, 1, N + 16, g) != N || memcmp(back, data, N) != 0) {
        fprintf(stderr, "FAIL get: the host copy differs\n");
        failures++;
    }
    if (g) fclose(g);
    /* The GPU calls' refusals need no GPU: a NULL destination or name, a NULL out. */
    size_t nread = 0;
    expect("gpu_read NULL dst", gpunvme_gpu_read(dev, 0, "c/data.bin", 0, NULL, 16, NULL, &nread),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("gpu_read NULL name", gpunvme_gpu_read(dev, 0, NULL, 0, NULL, 0, NULL, &nread),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("gpu_queues NULL out", gpunvme_gpu_queues(dev, 0, NULL), GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("gpu_write NULL src", gpunvme_gpu_write(dev, 0, "c/x", NULL, 8, NULL, false),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    /* The GPU is a CUDA device ordinal: a negative one is refused before any GPU is asked. */
    gpunvme_gpu_queues_info q;
    expect("gpu_queues gpu -1", gpunvme_gpu_queues(dev, -1, &q), GPUNVME_ERROR_INVALID_ARGUMENT);
    if (!strstr(gpunvme_last_error_message(), "gpu -1")) {
        fprintf(stderr, "FAIL gpu_queues gpu -1: message %s\n", gpunvme_last_error_message());
        failures++;
    }
    expect("gpu_read gpu -1", gpunvme_gpu_read(dev, -1, "c/data.bin", 0, back, 0, NULL, &nread),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    expect("remove", gpunvme_remove(dev, "c/data.bin"), GPUNVME_ERROR_NONE);
    expect("file_size after remove", gpunvme_file_size(dev, "c/data.bin", &size),
           GPUNVME_ERROR_NOT_FOUND);
    gpunvme_close(dev);

    /* Closed: a new handle opens the image. */
    expect("reopen after close", gpunvme_open(&o, &dev), GPUNVME_ERROR_NONE);
    gpunvme_close(dev);
    unlink(src);
    unlink(dst);
    free(data);
    free(back);
    if (failures) {
        fprintf(stderr, "c fs_demo: %d checks failed\n", failures);
        return 1;
    }
    printf("c fs_demo: OK\n");
    return 0;
}
