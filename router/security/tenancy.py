"""Tenant isolation and request bounds on the router: which
`cache_salt` a request's blocks are hashed with, who may abort a request, how many tokens a
request may ask for (and the `--max-tokens-limit` flag).

- **Salts.** A request's own `cache_salt` (HTTP body / gRPC field) wins; otherwise its
  tenant's default: the keys file's `salt=` for that tenant, else one derived from the tenant
  name with a server secret (an HMAC keyed by a hash of every configured API key, so it is
  the same on every router replica given the same keys, and no single tenant can compute
  another's). Without keys (one anonymous tenant) the default is no salt, so block keys are
  exactly those of kvstore.keys without a salt. Tenants share blocks only by sending (or
  being configured with) the same explicit salt.
- **Busy tenants.** `TenantActivity` counts the tenants with requests in flight on this
  router, or within `TENANT_BUSY_WINDOW_S` after their last one ended; each request it sends
  carries that count (contracts `TenantShare.busy_tenants`, its own tenant included). A worker
  holding only one tenant's requests learns from it that another tenant shares the cluster and
  keeps its steps short (worker/engine/fairness.py), so the other tenant's next request, routed
  there, does not wait out a step of thousands of prompt tokens.
- **max_tokens.** An explicit `max_tokens` above `--max-tokens-limit` or beyond the context
  (prompt + max_tokens > max_model_len) is a BadRequest naming the field; a front's default
  is shortened to the limit and to what the context leaves.

The gRPC server limits (keepalive, idle, handshake) are in contracts/grpc_options.py (the
worker uses them too).

Torch-free.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
from collections.abc import Iterable

import grpc

from contracts.busy import BusyTenants
from contracts.requests import BadRequest, GenerateInput, context_length_error
from contracts.sampling import SamplingParams
from router.security.auth import ANONYMOUS, ApiKey, Authenticator

_SECRET_PERSON = b"kvmesh-tenantsec"          # blake2b personalisation (16 bytes)
TENANT_SALT_PREFIX = "tenant:"
TENANT_LABEL_PREFIX = "t-"
_LABEL_DOMAIN = b"kvmesh metrics tenant label\0"   # keeps labels apart from salts (same secret)


class TenantSalts:
    """The default `cache_salt` of each tenant of one router's key set."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        keys = tuple(keys)
        material = b"\0".join(sorted(k.key.encode("utf-8") for k in keys))
        self._secret = hashlib.blake2b(material, digest_size=32, person=_SECRET_PERSON).digest()
        self._explicit = {k.tenant: k.salt for k in keys if k.salt is not None}

    def default_for(self, caller: ApiKey) -> str:
        """The salt of `caller`'s requests that name none ("" for the anonymous tenant)."""
        if caller is ANONYMOUS:
            return ""
        explicit = self._explicit.get(caller.tenant)
        if explicit is not None:
            return explicit
        digest = hmac.new(self._secret, caller.tenant.encode("utf-8"), hashlib.sha256).hexdigest()
        return TENANT_SALT_PREFIX + digest[:32]

    def salt_for(self, caller: ApiKey, requested: str) -> str:
        """The salt a request of `caller` is hashed with: its own `cache_salt`, else the default."""
        return requested or self.default_for(caller)

    def label_for(self, tenant: str) -> str:
        """The opaque metrics label of `tenant` (`t-` + 16 hex digits): an HMAC of its name with
        the same server secret as the salts but another message, so the label tells neither the
        name nor the salt. Stable across restarts and replicas with the same keys; it changes
        when the key set does."""
        digest = hmac.new(self._secret, _LABEL_DOMAIN + tenant.encode("utf-8"), hashlib.sha256).hexdigest()
        return TENANT_LABEL_PREFIX + digest[:16]


class TenantActivity(BusyTenants):
    """Which tenants are busy on one router (contracts.busy): requests in flight (`arrive` ..
    `leave`), or the last one ended within `window_s`. On the router's event loop."""

    def busy_with(self, tenant: str) -> int:
        """The tenants busy now, `tenant` counted whether or not it is."""
        return len(self.busy() | {tenant})


def grpc_caller(auth: Authenticator, context: grpc.aio.ServicerContext) -> ApiKey:
    """The key of a gRPC call the auth interceptor let through (router/security/auth.py): ANONYMOUS
    without keys. Raises PermissionError for a call without a valid key, which the
    interceptor never lets reach a handler."""
    if not auth.enabled:
        return ANONYMOUS
    value = dict(context.invocation_metadata() or ()).get("authorization")
    key = auth.check(value) if isinstance(value, str) else None
    if key is None:
        raise PermissionError("a call without a valid key reached a handler")
    return key


def bound_max_tokens(inp: GenerateInput, prompt_tokens: int, max_model_len: int,
                     limit: int | None) -> SamplingParams:
    """`inp.params` with `max_tokens` checked (given by the client) or shortened (a front's
    default) against `limit` (--max-tokens-limit; None: none) and the room the context
    leaves after `prompt_tokens` (< max_model_len). Raises BadRequest naming max_tokens, or
    min_tokens when it is above the shortened default."""
    params, room = inp.params, max_model_len - prompt_tokens
    if inp.max_tokens_given:
        if limit is not None and params.max_tokens > limit:
            raise BadRequest(f"max_tokens: {params.max_tokens} exceeds this server's limit of {limit} "
                             f"(--max-tokens-limit)")
        if params.max_tokens > room:
            raise BadRequest(context_length_error(max_model_len, prompt_tokens, params.max_tokens))
        return params
    cap = room if limit is None else min(room, limit)
    if params.max_tokens <= cap:
        return params
    if params.min_tokens > cap:   # min_tokens above the shortened default: the client's error, named
        why = "--max-tokens-limit" if limit is not None and limit < room else "the context left after the prompt"
        raise BadRequest(f"min_tokens: {params.min_tokens} exceeds the {cap} token(s) this request may "
                         f"generate ({why})")
    return dataclasses.replace(params, max_tokens=cap)


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """`--max-tokens-limit` of `kvmesh router` and `kvmesh serve` (router/flags.py)."""
    p.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="most tokens one request may generate: the default max_tokens of requests "
                        "without one, and a 400 / INVALID_ARGUMENT above it (default: the context)")
