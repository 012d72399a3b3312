;; Hostile: imports a host function that does not exist (refused at load).
(module
  (import "env" "now_ms" (func $now (result i64)))
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"unknown-import\",\"version\":\"0.1.0\",\"kinds\":[\"placement\"]}")
  (data (i32.const 4096) "{\"ok\":{\"ranked\":[]}}")
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  ;; Bump-free allocator: the input always lives at 64 KiB; memory grows to fit it.
  (func (export "gpuvisor_alloc") (param $len i32) (result i32)
    (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
    (i32.const 65536))
  (func (export "gpuvisor_free") (param i32 i32))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511169))  ;; (ptr 1024 << 32) | len 65
  (func (export "gpuvisor_placement") (param i32 i32) (result i64) (i64.const 17592186044436))  ;; (ptr 4096 << 32) | len 20
)
