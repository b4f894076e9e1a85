"""gRPC server options shared by the router and the worker servers: message size limits,
keepalive, and the closing of idle or never-handshaking connections.

Plain tuples: this module imports no grpc, so every layer may use it.
"""
from __future__ import annotations

KEEPALIVE_TIMEOUT_S = 20.0        # a client that does not answer a keepalive ping by then is dropped
MAX_HANDSHAKE_S = 20.0            # a connection that never completes its HTTP/2 (or TLS) handshake


def grpc_server_options(max_message_bytes: int, idle_timeout_s: float,
                        keepalive_s: float = 60.0, max_send_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options for grpc.aio.server: messages above `max_message_bytes` are refused
    (RESOURCE_EXHAUSTED); a connection with no call for `idle_timeout_s` gets GOAWAY and is
    closed; one that has not completed its handshake after min(idle, 20 s) is dropped; clients
    are pinged every `keepalive_s` and dropped when they do not answer within 20 s. Answers may
    be up to `max_send_bytes` (default `max_message_bytes`)."""
    if max_send_bytes is None:
        max_send_bytes = max_message_bytes
    if max_message_bytes <= 0 or max_send_bytes <= 0 or not idle_timeout_s > 0 or not keepalive_s > 0:
        raise ValueError("grpc_server_options: sizes and times must be positive")

    def ms(seconds: float) -> int:
        return max(int(seconds * 1000), 1)
    return [("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_send_bytes),
            ("grpc.max_connection_idle_ms", ms(idle_timeout_s)),
            ("grpc.server_handshake_timeout_ms", ms(min(idle_timeout_s, MAX_HANDSHAKE_S))),
            ("grpc.keepalive_time_ms", ms(keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(KEEPALIVE_TIMEOUT_S))]
