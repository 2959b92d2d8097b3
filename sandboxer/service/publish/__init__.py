"""Published ports: the service's forwarders from the host's 127.0.0.1 into sandboxes
(docs/publish.md)."""
