"""An example agent harness: a console entry point that uses the connector library."""

__version__ = "0.1.0"
