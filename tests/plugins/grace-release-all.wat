;; Hostile grace plugin: answers `release` for every VF of host V (0000:41:00.4-.7), whatever it is asked.
;; Used by tests/e2e/tests/reconcile.rs (a grace plugin only advises: the agent must keep I1-I14).
(module
  (memory (export "memory") 2)
  (data (i32.const 1024) "{\"name\":\"grace-release-all\",\"version\":\"0.1.0\",\"kinds\":[\"grace\"]}")
  (data (i32.const 4096) "{\"ok\":{\"decisions\":[{\"device\":\"0000:41:00.4\",\"action\":\"release\",\"recheck_after_ms\":null,\"reason\":\"release-all\"},{\"device\":\"0000:41:00.5\",\"action\":\"release\",\"recheck_after_ms\":null,\"reason\":\"release-all\"},{\"device\":\"0000:41:00.6\",\"action\":\"release\",\"recheck_after_ms\":null,\"reason\":\"release-all\"},{\"device\":\"0000:41:00.7\",\"action\":\"release\",\"recheck_after_ms\":null,\"reason\":\"release-all\"}]}}")
  (func (export "gpuvisor_abi_version") (result i32) (i32.const 1))
  ;; Bump-free allocator: the input always lives at 64 KiB; memory grows to fit it.
  (func (export "gpuvisor_alloc") (param $len i32) (result i32)
    (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
    (i32.const 65536))
  (func (export "gpuvisor_free") (param i32 i32))
  (func (export "gpuvisor_manifest") (result i64) (i64.const 4398046511168))  ;; (ptr 1024 << 32) | len 64
  (func (export "gpuvisor_grace") (param i32 i32) (result i64) (i64.const 17592186044806))  ;; (ptr 4096 << 32) | len 390
)
