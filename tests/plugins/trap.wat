;; Hostile: the placement entry point traps (`unreachable`).
(module
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"trap\",\"version\":\"0.1.0\",\"kinds\":[\"placement\"]}")
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  ;; Bump-free allocator: the input always lives at 64 KiB; memory grows to fit it.
  (func (export "gpuvisor_alloc") (param $len i32) (result i32)
    (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
    (i32.const 65536))
  (func (export "gpuvisor_free") (param i32 i32))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511159))  ;; (ptr 1024 << 32) | len 55
  (func (export "gpuvisor_placement") (param i32 i32) (result i64) (unreachable))
)
