"""TLS for every kvmesh port that crosses a network, shared by the router, the
workers and `kvmesh client`.

`TlsConfig` holds PEM paths: `cert`/`key` (this process's certificate) and `ca` (the CA that
signs the cluster's certificates). Roles:
- router fronts (HTTP, gRPC): `cert`+`key` serve TLS to clients (`http_ssl_context`,
  `server_credentials` without `ca`);
- workers: `cert`+`key`+`ca` serve mutual TLS: clients without a certificate from `ca` fail
  the handshake (`server_credentials(require_client_cert=True)`);
- the router and workers as clients of a worker: `channel` (`ca` to verify the worker, their own
  `cert`+`key` to be verified); `server_name` overrides the name checked in the worker's
  certificate (pods dialled by IP, certificates issued for a service name).
Torch-free.
"""
from __future__ import annotations

import argparse
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

Options = Sequence[tuple[str, object]]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM paths; all None = plaintext. `cert` and `key` go together."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
                if not Path(value).is_file():
                    raise ValueError(f"tls_{name}: {value} is not a readable file")
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls_cert: --tls-cert and --tls-key go together")
        if self.server_name is not None and not self.server_name:
            raise ValueError("tls_server_name: empty")

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return None if path is None else Path(path).read_bytes()

    # -- servers ----------------------------------------------------------------------------
    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        """gRPC server credentials; with `require_client_cert` (workers) only clients holding a
        certificate signed by `ca` complete the handshake."""
        key, cert = self._read("key"), self._read("cert")
        assert key is not None and cert is not None, "server TLS needs cert and key"
        if require_client_cert and self.ca is None:
            raise ValueError("tls_ca: mutual TLS needs --tls-ca")
        return grpc.ssl_server_credentials([(key, cert)],
                                           root_certificates=self._read("ca") if require_client_cert else None,
                                           require_client_auth=require_client_cert)

    def http_ssl_context(self) -> ssl.SSLContext:
        """The router's HTTPS context (server side, no client certificates)."""
        assert self.cert is not None and self.key is not None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def add_port(self, server: grpc.aio.Server, address: str, require_client_cert: bool) -> int:
        """Bind `address` with TLS when configured, else plaintext; the bound port."""
        if not self.serves_tls:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_credentials(require_client_cert))

    # -- clients ----------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca"), private_key=self._read("key"),
                                            certificate_chain=self._read("cert"))

    def channel_options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def aio_channel(self, address: str, options: Options = (),
                    interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
        """An asyncio channel to `address`: TLS (mutual when `cert` is set) if `ca` is set."""
        opts = [*options, *self.channel_options()]
        if self.ca is None:
            return grpc.aio.insecure_channel(address, options=opts, interceptors=list(interceptors) or None)
        return grpc.aio.secure_channel(address, self.channel_credentials(), options=opts,
                                       interceptors=list(interceptors) or None)

    def sync_channel(self, address: str, options: Options = ()) -> grpc.Channel:
        opts = [*options, *self.channel_options()]
        if self.ca is None:
            return grpc.insecure_channel(address, options=opts)
        return grpc.secure_channel(address, self.channel_credentials(), options=opts)


PLAINTEXT = TlsConfig()


def add_tls_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, role: str) -> None:
    """--tls-cert/--tls-key/--tls-ca (and --tls-server-name) with help for `role`
    (router | worker | serve)."""
    serve = {"router": "serve HTTPS and gRPC over TLS with this certificate (PEM)",
             "worker": "this worker's certificate (PEM): serves mutual TLS and is shown to peers",
             "serve": "passed to the router and every worker (see README: Security)"}[role]
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM", help=serve)
    p.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="CA of the cluster's certificates: workers accept only clients it signed; the router "
                        "and peers verify workers with it")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name expected in workers' certificates (default: the host dialled)")


def tls_from_args(args: argparse.Namespace) -> TlsConfig:
    """ValueError naming the flag when a file is missing or cert/key come alone."""
    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)


def tls_argv(cfg: TlsConfig) -> tuple[str, ...]:
    """`cfg` spelled back as flags for a child process (`kvmesh serve`)."""
    argv: list[str] = []
    for name in ("cert", "key", "ca"):
        value = getattr(cfg, name)
        if value is not None:
            argv += [f"--tls-{name}", str(Path(value).resolve())]
    if cfg.server_name:
        argv += ["--tls-server-name", cfg.server_name]
    return tuple(argv)
