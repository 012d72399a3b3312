;; A component importing an interface no host defines.
(component
  (import "evil:net/socket" (instance))
)
