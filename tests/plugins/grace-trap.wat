;; Hostile grace plugin: the grace entry point traps (`unreachable`).
;; Used by tests/e2e/tests/reconcile.rs (a grace plugin only advises: the agent must keep I1-I14).
(module
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"grace-trap\",\"version\":\"0.1.0\",\"kinds\":[\"grace\"]}")
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  ;; Bump-free allocator: the input always lives at 64 KiB; memory grows to fit it.
  (func (export "gpuvisor_alloc") (param $len i32) (result i32)
    (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
    (i32.const 65536))
  (func (export "gpuvisor_free") (param i32 i32))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511161))  ;; (ptr 1024 << 32) | len 57
  (func (export "gpuvisor_grace") (param i32 i32) (result i64) (unreachable))
)
