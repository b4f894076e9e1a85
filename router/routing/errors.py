"""What the router core raises; each front maps these to its own protocol in one place
(router/fronts/grpc_front.py `_status_for`, router/fronts/openai/app.py `_http_error`)."""
from __future__ import annotations

import grpc


class RouterError(Exception):
    """Base of the router's errors."""


class RouterStartError(RouterError):
    """The router cannot serve: workers disagree on the model / block hashing (`field` is
    "worker_addresses"), or the model has no usable tokenizer (`field` is "model")."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class NoWorkerAvailable(RouterError):
    """No live worker can take the request now (gRPC UNAVAILABLE, HTTP 503)."""


class TokenizerNotLoaded(NoWorkerAvailable):
    """The router has not loaded the model's tokenizer yet (it fetches it from the first ready
    worker, router/workers/tokenizer.py): gRPC UNAVAILABLE, HTTP 503 `tokenizer_not_loaded`."""

    def __init__(self) -> None:
        super().__init__("the router has not loaded the model's tokenizer yet (it fetches it from the first "
                         "ready worker); retry shortly")


class UpstreamError(RouterError):
    """A worker answered with an error status; passed on to the client as is."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
