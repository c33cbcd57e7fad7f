"""Who is calling, decided from the headers alone, before any byte of the body is read.

``KeyCheckMiddleware`` is the outermost layer of the app: on every route but /health a missing or
wrong key is a 401 at once, so a keyless 1 MiB body is neither received nor parsed (FastAPI parses
a route's body model before it runs the route's dependencies). The tenant it found rides on the
ASGI scope to the routes' ``authenticate`` dependency.

A request with more than one Authorization header is a 400: servers and proxies disagree on which
one counts (the first, the last, both joined), so accepting either would let a proxy that checked
one key pass a request the server runs as another.
"""

from __future__ import annotations

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.tenants import KeyRing, Tenant

TENANT_SCOPE_KEY = "lora_runner.tenant"
OPEN_PATHS = frozenset({"/health"})


def require_tenant(keys: KeyRing, authorization: str | None) -> Tenant:
    """The tenant of an Authorization header; 401 without a valid key (also used by the Ray Serve ingress)."""
    tenant = keys.authenticate(authorization)
    if tenant is None:
        raise APIError(401, "missing or invalid API key (Authorization: Bearer KEY)", "invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return tenant


def require_operator(tenant: Tenant) -> Tenant:
    """403 unless `tenant` is the operator's (metrics name every tenant's adapters)."""
    if not tenant.operator:
        raise APIError(403, "metrics are for the server's operator (an --api-key key)", "forbidden")
    return tenant


class KeyCheckMiddleware:
    """Wrap an ASGI app so that HTTP requests without a valid key get a 401 before their body is read."""

    def __init__(self, app, keys: KeyRing) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        try:
            authorization = single_header(scope.get("headers") or [], b"authorization")
            scope[TENANT_SCOPE_KEY] = require_tenant(self.keys, authorization)
        except APIError as err:
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


def single_header(headers, name: bytes) -> str | None:
    """The value of header `name` (lower-case bytes) in ASGI `headers`; None when absent, 400 when repeated."""
    values = [value for key, value in headers if key.lower() == name]
    if len(values) > 1:
        raise APIError(400, f"{len(values)} {name.decode()} headers: send exactly one", "ambiguous_credentials")
    return values[0].decode("latin-1") if values else None
