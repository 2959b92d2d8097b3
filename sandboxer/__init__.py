"""sandboxer: a sandbox broker for Linux."""

__version__ = "0.1.0"
