"""The pure core: what a sandbox is, from the owner's files and the caller's documents.

See docs/architecture.md for what each module is for."""
