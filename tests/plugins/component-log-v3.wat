;; A component built against another version of the WIT package (imports log@3.0.0).
(component
  (import "gpuvisor:policy/log@3.0.0" (instance))
)
