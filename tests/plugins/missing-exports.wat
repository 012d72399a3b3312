;; Hostile: lacks gpuvisor_alloc and gpuvisor_free (refused at load).
(module
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"missing-exports\",\"version\":\"0.1.0\",\"kinds\":[\"placement\"]}")
  (data (i32.const 4096) "{\"ok\":{\"ranked\":[]}}")
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511170))  ;; (ptr 1024 << 32) | len 66
  (func (export "gpuvisor_placement") (param i32 i32) (result i64) (i64.const 17592186044436))  ;; (ptr 4096 << 32) | len 20
)
