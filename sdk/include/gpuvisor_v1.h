/*
 * gpuvisor_v1.h — the gpuvisor policy-plugin ABI, version 1, for C (and anything that
 * speaks the C ABI) compiled to a WebAssembly core module (wasm32).
 *
 * The contract is docs/plugins.md "The ABI (version 1)"; the Rust SDK's `sdk/src/abi.rs`
 * implements the same exports. This header is checked by agent/policy/tests/c_header.rs:
 * a C plugin built against it with clang (--target=wasm32) is loaded and called by the
 * agent's plugin host, and the export and import names here are compared with the SDK's.
 *
 * Build a plugin (clang and lld, e.g. the Debian packages `clang` and `lld`):
 *
 *     clang --target=wasm32 -nostdlib -ffreestanding -O2 -Wl,--no-entry \
 *           -I sdk/include -o my_plugin.wasm my_plugin.c
 *
 * `-nostdlib` because a plugin may import nothing but `gpuvisor.log` (no WASI: no files,
 * no clock, no allocator from the host); the module brings its own memory management.
 * wasm-ld exports the linear memory as `memory` by default.
 *
 * A module defines, with exactly these names and wasm signatures (on wasm32 a pointer is
 * an i32):
 *
 *     export                  wasm signature         C declaration below
 *     memory                  (memory)               (exported by the linker)
 *     gpuvisor_abi_version    () -> i32              gpuvisor_abi_version
 *     gpuvisor_alloc          (i32) -> i32           gpuvisor_alloc
 *     gpuvisor_free           (i32, i32) -> ()       gpuvisor_free
 *     gpuvisor_manifest       () -> i64              gpuvisor_manifest
 *     gpuvisor_placement      (i32, i32) -> i64      one entry point per kind
 *     gpuvisor_hypervisor     (i32, i32) -> i64        the manifest lists
 *     gpuvisor_grace          (i32, i32) -> i64
 *
 * and may import only
 *
 *     gpuvisor.log            (i32, i32, i32) -> ()  gpuvisor_log
 *
 * Any other import makes the agent refuse the module at load.
 *
 * The declarations carry the attributes that make clang export (`export_name`) and import
 * (`import_module`/`import_name`) them under these names, so a plugin only includes this
 * header and defines the functions; the definitions need no attribute of their own. (If
 * you declare an export yourself instead, give it
 * `__attribute__((export_name("gpuvisor_...")))`.) Declaring an entry point a plugin does
 * not define exports nothing: define the ones for the kinds the manifest lists.
 *
 * Data crosses the boundary as UTF-8 JSON in the module's memory (JSON Schemas of every
 * input and answer: docs/schema/v1/). Every call runs in a fresh instance that the host
 * discards afterwards, so a plugin may leak what it returns and keep no state.
 */
#ifndef GPUVISOR_V1_H
#define GPUVISOR_V1_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version `gpuvisor_abi_version()` returns. */
#define GPUVISOR_ABI_VERSION 1

#if defined(__wasm__)
#define GPUVISOR_EXPORT(name) __attribute__((export_name(name)))
#define GPUVISOR_IMPORT(module, name) __attribute__((import_module(module), import_name(name)))
#else
/* Not a wasm build (e.g. a syntax check with the host compiler): no attributes. */
#define GPUVISOR_EXPORT(name)
#define GPUVISOR_IMPORT(module, name)
#endif

#if defined(__wasm32__)
_Static_assert(sizeof(void *) == 4, "ABI v1 is wasm32: pointers are i32");
#endif

/* ---- exports ------------------------------------------------------------------------ */

/* Returns GPUVISOR_ABI_VERSION (1). The agent refuses any other value. */
GPUVISOR_EXPORT("gpuvisor_abi_version") int32_t gpuvisor_abi_version(void);

/* Returns a buffer of `len` bytes the host writes an input into (then passes it to an entry
 * point). Return 0 when `len` is negative or there is no memory: the host reports it. */
GPUVISOR_EXPORT("gpuvisor_alloc") void *gpuvisor_alloc(int32_t len);

/* Frees a buffer `gpuvisor_alloc(len)` returned (the host may call it, or not). */
GPUVISOR_EXPORT("gpuvisor_free") void gpuvisor_free(void *ptr, int32_t len);

/* Returns the packed location (see gpuvisor_pack) of the manifest, UTF-8 JSON
 *     {"name": "my-plugin", "version": "1.0.0", "kinds": ["placement"]}
 * `kinds` lists the entry points the module defines ("placement", "hypervisor", "grace");
 * the agent checks it against the exports and the config slot the plugin is put in. */
GPUVISOR_EXPORT("gpuvisor_manifest") int64_t gpuvisor_manifest(void);

/* The entry points, one per kind. Each gets `len` bytes of UTF-8 JSON input at `input`
 * (a buffer from gpuvisor_alloc; not NUL-terminated) and returns the packed location of a
 * UTF-8 JSON reply envelope (see "reply envelope" below).
 *   gpuvisor_placement:  input placement-input.json,  answer placement-answer.json
 *                        {"ranked": ["<device>", ...]} or {"reject": "<reason>"}
 *   gpuvisor_hypervisor: input hypervisor-input.json, answer hypervisor-answer.json
 *                        {"hypervisor": "qemu"} or {"reject": "<reason>"}
 *   gpuvisor_grace:      input grace-input.json,      answer grace-answer.json
 *                        {"decisions": [{"device", "action": "release"|"keep",
 *                                        "recheck_after_ms", "reason"}]}        */
GPUVISOR_EXPORT("gpuvisor_placement") int64_t gpuvisor_placement(const char *input, int32_t len);
GPUVISOR_EXPORT("gpuvisor_hypervisor") int64_t gpuvisor_hypervisor(const char *input, int32_t len);
GPUVISOR_EXPORT("gpuvisor_grace") int64_t gpuvisor_grace(const char *input, int32_t len);

/* ---- the reply envelope ------------------------------------------------------------- */

/* Every entry point returns exactly one of
 *     {"ok": <answer>}          the kind's answer
 *     {"error": "<message>"}    the plugin could not decide; the agent fails closed
 *                               (placement/hypervisor: the request fails with
 *                               policy_failed; grace: every item is kept this pass).
 * A trap, running out of fuel or time, an oversized reply or JSON that does not decode
 * count as a failed call too. Schemas: docs/schema/v1/<kind>-reply.json. */
#define GPUVISOR_REPLY_OK "ok"
#define GPUVISOR_REPLY_ERROR "error"

/* The packed i64 location of a reply or manifest: (ptr << 32) | len. */
static inline int64_t gpuvisor_pack(const void *ptr, uint32_t len) {
    return (int64_t)(((uint64_t)(uint32_t)(uintptr_t)ptr << 32) | (uint64_t)len);
}

/* ---- the import --------------------------------------------------------------------- */

/* Levels of gpuvisor_log; the host maps unknown values to trace. */
enum gpuvisor_log_level {
    GPUVISOR_LOG_ERROR = 0,
    GPUVISOR_LOG_WARN = 1,
    GPUVISOR_LOG_INFO = 2,
    GPUVISOR_LOG_DEBUG = 3,
    GPUVISOR_LOG_TRACE = 4,
};

/* gpuvisor.log(level: i32, ptr: i32, len: i32): one UTF-8 line of `len` bytes at `message`
 * to the agent's log, tagged with the plugin's name. Rate-limited and truncated by the
 * host: log decisions, not data. */
GPUVISOR_IMPORT("gpuvisor", "log") void gpuvisor_log(int32_t level, const char *message, int32_t len);

#ifdef __cplusplus
}
#endif

#endif /* GPUVISOR_V1_H */
