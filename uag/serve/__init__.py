"""``uag serve``: the prepared pair behind an OpenAI-compatible HTTP server (FastAPI + uvicorn),
one generation at a time from a bounded queue (``engine``), the wire format in ``protocol``,
Prometheus counters in ``metrics``, the routes and the server's life in ``app``."""
