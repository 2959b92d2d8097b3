"""Lease manifests (docs/manifest.md)."""
