"""Engine adapters: the only modules that import an engine (docs/design.md §10)."""
