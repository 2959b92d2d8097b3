"""The broker as a service: `sandboxer serve` answers HTTP/JSON on a Unix socket in the state dir
(serve.py), for callers the kernel identifies (peer.py), with the embedded core API behind every
route (app.py); exec output travels in frames (frames.py). The client is sandboxer.clients.service.
docs/service.md describes the API."""
