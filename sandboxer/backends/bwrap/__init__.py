"""bubblewrap: one long-lived namespace per sandbox (namespace.py), its argv (argv.py), stopping
it (stop.py), and the Backend the core uses (backend.py)."""
