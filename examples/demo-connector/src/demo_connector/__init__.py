"""An example connector: what an agent harness would use to reach its model or tools.

It never opens a connection here; it only describes where it would connect, so a smoke test
can import it and call it inside a sandbox with no network.
"""

__version__ = "0.1.0"


def describe(endpoint: str = "http://127.0.0.1:8080") -> dict[str, str]:
    """A description of the connection this connector would make."""
    return {"connector": "demo-connector", "version": __version__, "endpoint": endpoint}
