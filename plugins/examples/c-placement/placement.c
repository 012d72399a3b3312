/* A placement plugin in C against sdk/include/gpuvisor_v1.h (ABI v1), no libc: it ranks
 * the first device of the inventory (the first "address" after "devices") and logs one
 * line. Built and loaded by agent/policy/tests/c_header.rs:
 *
 *     clang --target=wasm32 -nostdlib -ffreestanding -O2 -Wl,--no-entry \
 *           -I sdk/include -o c_placement.wasm plugins/examples/c-placement/placement.c
 */
#include "gpuvisor_v1.h"

/* A bump allocator over a static arena: every call runs in a fresh instance. */
static unsigned char arena[1 << 20];
static uint32_t used;

void *gpuvisor_alloc(int32_t len) {
    if (len < 0 || (uint32_t)len > sizeof arena - used) {
        return 0;
    }
    void *p = &arena[used];
    used += ((uint32_t)len + 7u) & ~7u;
    return p;
}

void gpuvisor_free(void *ptr, int32_t len) {
    (void)ptr;
    (void)len;
}

int32_t gpuvisor_abi_version(void) {
    return GPUVISOR_ABI_VERSION;
}

static uint32_t length(const char *s) {
    uint32_t n = 0;
    while (s[n]) {
        n++;
    }
    return n;
}

static const char manifest[] = "{\"name\":\"c-placement\",\"version\":\"0.1.0\",\"kinds\":[\"placement\"]}";

int64_t gpuvisor_manifest(void) {
    return gpuvisor_pack(manifest, sizeof manifest - 1);
}

/* The offset just after the first `needle` in `hay[from..len]`, or -1. */
static int32_t after(const char *hay, int32_t from, int32_t len, const char *needle) {
    int32_t n = (int32_t)length(needle);
    for (int32_t i = from; i + n <= len; i++) {
        int32_t j = 0;
        while (j < n && hay[i + j] == needle[j]) {
            j++;
        }
        if (j == n) {
            return i + n;
        }
    }
    return -1;
}

static char reply[512];

static int64_t answer(const char *text) {
    uint32_t n = length(text);
    for (uint32_t i = 0; i < n; i++) {
        reply[i] = text[i];
    }
    return gpuvisor_pack(reply, n);
}

int64_t gpuvisor_placement(const char *input, int32_t len) {
    int32_t at = after(input, 0, len, "\"devices\":[");
    if (at >= 0) {
        at = after(input, at, len, "\"address\":\"");
    }
    if (at < 0) {
        static const char none[] = "c-placement: no device in the inventory";
        gpuvisor_log(GPUVISOR_LOG_INFO, none, (int32_t)(sizeof none - 1));
        return answer("{\"" GPUVISOR_REPLY_OK "\":{\"reject\":\"no device\"}}");
    }
    static const char head[] = "{\"" GPUVISOR_REPLY_OK "\":{\"ranked\":[\"";
    uint32_t n = 0;
    for (uint32_t i = 0; i < sizeof head - 1; i++) {
        reply[n++] = head[i];
    }
    while (at < len && input[at] != '"' && n < sizeof reply - 8) {
        reply[n++] = input[at++];
    }
    reply[n++] = '"';
    reply[n++] = ']';
    reply[n++] = '}';
    reply[n++] = '}';
    static const char line[] = "c-placement: ranked the first device";
    gpuvisor_log(GPUVISOR_LOG_INFO, line, (int32_t)(sizeof line - 1));
    return gpuvisor_pack(reply, n);
}
