;; Logs 100 lines through gpuvisor.log per call, then answers an empty ranking: the host must
;; rate-limit the lines, not fail the call.
(module
  (import "gpuvisor" "log" (func $log (param i32 i32 i32)))
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"chatty\",\"version\":\"0.1.0\",\"kinds\":[\"placement\"]}")
  (data (i32.const 4096) "{\"ok\":{\"ranked\":[]}}")
  (data (i32.const 6000) "hello from a chatty plugin")
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  ;; Bump-free allocator: the input always lives at 64 KiB; memory grows to fit it.
  (func (export "gpuvisor_alloc") (param $len i32) (result i32)
    (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
    (i32.const 65536))
  (func (export "gpuvisor_free") (param i32 i32))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511161))  ;; (ptr 1024 << 32) | len 57
  (func (export "gpuvisor_placement") (param i32 i32) (result i64)
    (local $i i32)
    (loop $l
      (call $log (i32.const 2) (i32.const 6000) (i32.const 26))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 100))))
    (i64.const 17592186044436))  ;; (ptr 4096 << 32) | len 20
)
