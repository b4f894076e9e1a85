"""The worker's metrics port: `MetricsHTTP` serves one `CollectorRegistry` on `/metrics`
(prometheus_client's WSGI server in a daemon thread), and the worker's probes next to it:
`GET /livez` and `GET /readyz` answer 200 "ok" or 503 with the reason (worker/server/health.py),
for kubelets that cannot speak gRPC health over mutual TLS. Torch-free.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class Probes(Protocol):
    """What /livez and /readyz ask (worker.server.health.WorkerHealth): None = ok, else the reason."""

    def live_reason(self) -> str | None: ...
    def ready_reason(self) -> str | None: ...


class MetricsHTTP:
    """`/metrics` of one registry on host:port (0 = a free port) in a daemon thread, always in
    the Prometheus text format: prometheus_client's OpenMetrics output (what a Prometheus server
    asks for first) writes `kvmesh:x_total` as `kvmesh_x_total`, so the Accept header is ignored
    and the names stay vLLM-style, as on the router. With `probes`, `/livez` and `/readyz`
    answer 200 "ok" or 503 and the reason (text/plain); every other path is the metrics app's."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, probes: Probes | None = None) -> None:
        app = make_wsgi_app(registry)
        checks = {"/livez": probes.live_reason, "/readyz": probes.ready_reason} if probes is not None else {}

        def text_only(environ: dict[str, Any], start_response: Any) -> Any:
            check = checks.get(environ.get("PATH_INFO", ""))
            if check is not None:
                reason = check()
                body = ("ok" if reason is None else reason).encode() + b"\n"
                start_response("200 OK" if reason is None else "503 Service Unavailable",
                               [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
                return [body]
            return app({k: v for k, v in environ.items() if k != "HTTP_ACCEPT"}, start_response)
        self._server: WSGIServer = make_server(host, port, text_only, ThreadingWSGIServer, handler_class=_Quiet)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:   # no access line per scrape on stderr
        pass
