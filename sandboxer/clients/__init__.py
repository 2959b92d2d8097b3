"""The broker's clients: `cli` (the `sandboxer` command's standard-library client, on every
command's path: nothing is imported here), `service` (sandboxer.Client, the Python client of the
service) and `transport` (its HTTP on the Unix socket)."""
