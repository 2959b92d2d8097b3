"""The broker's edges on the host outside an engine: the registry, processes, mounts, files.

See docs/architecture.md for what each module is for."""
