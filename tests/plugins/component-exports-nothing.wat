;; A component that exports no policy interface.
(component)
