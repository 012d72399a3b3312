;; A hypervisor plugin that always answers cloud-hypervisor, whatever the input.
;; Used by the agent's end-to-end tests (the agent must refuse a choice that cannot carry the devices).
(module
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"hv-cloud\",\"version\":\"0.1.0\",\"kinds\":[\"hypervisor\"]}")
  (data (i32.const 4096) "{\"ok\":{\"hypervisor\":\"cloud-hypervisor\"}}")
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  ;; Bump-free allocator: the input always lives at 64 KiB; memory grows to fit it.
  (func (export "gpuvisor_alloc") (param $len i32) (result i32)
    (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
    (i32.const 65536))
  (func (export "gpuvisor_free") (param i32 i32))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511164))  ;; (ptr 1024 << 32) | len 60
  (func (export "gpuvisor_hypervisor") (param i32 i32) (result i64) (i64.const 17592186044456))  ;; (ptr 4096 << 32) | len 40
)
