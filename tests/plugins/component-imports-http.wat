;; A component importing wasi:http, which the host does not grant.
(component
  (import "wasi:http/outgoing-handler@0.2.0" (instance))
)
