"""bubblewrap: one long-lived namespace per sandbox, started (namespace.py) from its argv (argv.py),
probed and checked while it runs (live.py), stopped (stop.py), and the Backend the core uses
(backend.py)."""
