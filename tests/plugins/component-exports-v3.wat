;; A component exporting the placement interface of another version of the WIT package.
(component
  (instance $i)
  (export "gpuvisor:policy/placement@3.0.0" (instance $i))
)
