;; Keeps a counter in a global and a flag in memory: answers "first-call" when both are
;; fresh, "state-survived" otherwise. With a fresh instance per call it always says first-call.
(module
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"stateful\",\"version\":\"0.1.0\",\"kinds\":[\"placement\"]}")
  (data (i32.const 4096) "{\"ok\":{\"ranked\":[\"first-call\"]}}")
  (data (i32.const 4352) "{\"ok\":{\"ranked\":[\"state-survived\"]}}")
  (global $calls (mut i32) (i32.const 0))
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  ;; Bump-free allocator: the input always lives at 64 KiB; memory grows to fit it.
  (func (export "gpuvisor_alloc") (param $len i32) (result i32)
    (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
    (i32.const 65536))
  (func (export "gpuvisor_free") (param i32 i32))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511163))  ;; (ptr 1024 << 32) | len 59
  (func (export "gpuvisor_placement") (param i32 i32) (result i64)
    (local $seen i32)
    (local.set $seen (i32.or (global.get $calls) (i32.load8_u (i32.const 8192))))
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (i32.store8 (i32.const 8192) (i32.const 1))
    (if (result i64) (local.get $seen) (then (i64.const 18691697672228)) (else (i64.const 17592186044448))))  ;; (ptr 4352 << 32) | len 36
)
