"""API keys and tenants: who is calling, which adapters they may see, whether they are an admin.

A tenant-keys file (JSON or YAML) maps each key to a tenant::

    sk-acme-123:
      name: acme            # optional (default tenant-<entry index>); unique; shown in logs and
                            # passed to the engine's fair scheduling
      adapters: [acme-support, acme-sql]   # names this key may list and use ("*": every adapter)
      base: true            # may use the base model (default false)
      admin: false          # may load/unload its own adapters at run time (default false)
      max_concurrent_requests: 8   # optional: more in flight at once is a 429
      adapter_root: acme    # runtime loads come from this folder of --adapter-root (default: the
                            # tenant's name; "." shares the whole root)

Keys given with ``--api-key`` are the operator's: they may use everything, are admins, load from the
whole adapter root and alone may read ``/metrics`` (which names every tenant's adapters). Keys are
compared in constant time (hmac.compare_digest) against every configured key.

A tenant's name keys its prefix-cache salt, fair-share counter and adapter folder, so no two keys
may share one: names (explicit, or the ``tenant-<index>`` of an unnamed entry, or the
``api-key-<index>`` of an --api-key key) that repeat are refused at start.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adapters.files import PathEscapeError, confined_parts

ALL_ADAPTERS = "*"


@dataclass(frozen=True)
class Tenant:
    """What one key may do. adapters: allowed adapter names (None: all). adapter_root: the folder of
    --adapter-root its runtime loads come from, relative ("": the whole root). operator: may read the
    server's metrics (the --api-key keys, and every caller of a server without keys)."""

    name: str
    adapters: frozenset[str] | None = None
    base: bool = True
    admin: bool = False
    max_concurrent_requests: int | None = None
    adapter_root: str = ""
    operator: bool = False

    def may_use(self, adapter_name: str) -> bool:
        """True when this tenant may list, use, load or unload the adapter `adapter_name`."""
        return self.adapters is None or adapter_name in self.adapters


# Without any key configured, every caller is this tenant (the server binds 127.0.0.1 by default).
ANONYMOUS = Tenant("anonymous", None, base=True, admin=True, operator=True)


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = None
    adapters: list[str] = Field(default_factory=list)
    base: bool = False
    admin: bool = False
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    adapter_root: str | None = None


def load_tenant_keys(path: str | Path) -> dict[str, Tenant]:
    """Read a tenant-keys file: key -> Tenant. Raises ValueError with the offending key or field."""
    try:
        raw = yaml.safe_load(Path(path).read_text())  # YAML is a superset of JSON
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read tenant keys file {path}: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"tenant keys file {path} must map API keys to tenant entries")
    tenants = {}
    for index, (key, entry) in enumerate(raw.items()):
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError(f"tenant keys file {path}: entry {index}: keys must be strings of 8+ characters")
        try:
            parsed = _TenantEntry.model_validate(entry or {})
        except ValidationError as exc:
            raise ValueError(f"tenant keys file {path}: entry {index} ({parsed_name(entry)}): {exc}") from exc
        adapters = None if ALL_ADAPTERS in parsed.adapters else frozenset(parsed.adapters)
        name = parsed.name or f"tenant-{index}"
        tenants[key] = Tenant(name, adapters, parsed.base, parsed.admin, parsed.max_concurrent_requests,
                              _sub_root(path, index, name, parsed.adapter_root))
    check_unique_names(tenants, path)
    return tenants


def _sub_root(path, index: int, name: str, adapter_root: str | None) -> str:
    """The entry's adapter sub-root: its own (default: its name) as plain relative parts; "." is the whole root."""
    if adapter_root == ".":
        return ""
    try:
        return os.path.join(*confined_parts(name if adapter_root is None else adapter_root))
    except PathEscapeError as exc:
        raise ValueError(f"tenant keys file {path}: entry {index} ({name}): adapter_root: {exc} (set adapter_root "
                         "to a folder name, or '.' for the whole root)") from None


def check_unique_names(tenants: dict[str, Tenant], tenant_file: str | Path | None) -> None:
    """ValueError naming the first tenant name two keys share (never a key)."""
    seen = set()
    for tenant in tenants.values():
        if tenant.name in seen:
            raise ValueError(f"tenant keys file {tenant_file}: two keys are both tenant {tenant.name!r} (an --api-key "
                             "key is api-key-<i>, an entry without a name tenant-<entry index>): give each entry "
                             "its own name; tenants share no prefix cache, fair share or adapter folder")
        seen.add(tenant.name)


def parsed_name(entry) -> str:
    """The entry's name for an error message (never the key)."""
    return str(entry.get("name")) if isinstance(entry, dict) and entry.get("name") else "unnamed"


class KeyRing:
    """The configured keys; ``authenticate`` finds the tenant of an Authorization header."""

    def __init__(self, tenants: dict[str, Tenant]) -> None:
        self._keys = [(key.encode(), tenant) for key, tenant in tenants.items()]

    @classmethod
    def from_options(cls, api_keys: list[str], tenant_file: str | None) -> KeyRing:
        """--api-key keys (full access, admin) plus the --tenant-keys file's tenants."""
        tenants = {key: Tenant(f"api-key-{i}", None, base=True, admin=True, operator=True)
                   for i, key in enumerate(api_keys)}
        if tenant_file:
            file_tenants = load_tenant_keys(tenant_file)
            clash = set(file_tenants) & set(tenants)
            if clash:
                raise ValueError("a key is given both with --api-key and in --tenant-keys")
            tenants.update(file_tenants)
        check_unique_names(tenants, tenant_file)
        return cls(tenants)

    @property
    def num_tenants(self) -> int:
        """How many distinct tenants the keys name (0 without keys)."""
        return len({tenant.name for _, tenant in self._keys})

    @property
    def enabled(self) -> bool:
        """True when callers must present a key."""
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of ``Authorization: Bearer KEY`` (ANONYMOUS when no key is configured), else None."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        presented, found = token.strip().encode(), None
        for key, tenant in self._keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(key, presented):
                found = tenant
        return found
