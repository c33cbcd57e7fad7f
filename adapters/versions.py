"""Adapter versions: the record of one version, the table of which version serves each name, and the
names the server offers.

An :class:`AdapterRef` is the immutable handle a request holds; an :class:`AdapterVersion` is the
mutable record behind it (load state, weights, holders, slot, and ``pinned``: as SGLang keeps
``pinned`` on its adapter record, a pin is a flag on the version a name serves, never a separate
set). The :class:`VersionTable` knows every live version, the newest version of each name and the
ready one that keeps serving while a replacement loads; it retires, falls back and forgets as
``adapters.tier`` documents in the life of a version. A version leaves the table (is dropped)
once it is retired or failed and no request holds it; the table then calls ``on_drop`` so the tier
frees its CPU tensors and its slot.

The table is also the one registry of served adapters (SGLang's ``LoRARegistry``): a
:class:`ServedAdapter` per name clients may select, with the request that (re)loads it, its kind,
when it was first served and the tenant that loaded it. A served name outlives its versions: when the
CPU cache evicts its weights it stays served, and the next request reloads it from its request.

Not thread-safe on purpose: the owning ``AdapterTier`` holds its lock around every call.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from adapters.request import LoRARequest

logger = logging.getLogger(__name__)

LOADING, READY, FAILED = "loading", "ready", "failed"


@dataclass(frozen=True)
class AdapterRef:
    """One version of a named adapter: what a request holds between acquire and release."""

    name: str
    path: str
    revision: str | None
    version: int  # unique per manager tier: re-adding the same source after removal is a new version


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter clients may select by name: the record the server lists and resolves requests with.

    ``version`` is filled in by the table's readers: the version serving the name when it was read,
    None while no version is live (never loaded, or its weights were evicted: a request reloads it).
    """

    name: str
    request: Any  # LoRARequest | PromptAdapterRequest: what a request for the name runs (and reloads)
    owner: str | None = None  # the tenant that loaded it at runtime; None: the operator (startup)
    created: int = field(default_factory=lambda: int(time.time()))  # unix seconds it was served (or replaced)
    version: AdapterRef | None = None

    @property
    def kind(self) -> str:
        """"lora" or "prompt_adapter"."""
        return "lora" if isinstance(self.request, LoRARequest) else "prompt_adapter"


class AdapterVersion:
    """The state of one adapter version (guarded by the tier's lock)."""

    def __init__(self, ref: AdapterRef, request: Any):
        self.ref, self.request = ref, request
        self.state, self.error, self.weights = LOADING, None, None
        self.done = threading.Event()  # set once state leaves LOADING
        self.holders = 0  # live requests (acquire minus release)
        self.slot: int | None = None  # its device slot while resident (the tier's SlotPool sets it)
        self.retired = False  # removed, replaced or staged unpublished: dropped when holders reaches 0
        self.pinned = False  # the one record of a pin; never True once failed or retired
        self.started = False  # its load was handed to a worker (or runs in an add() caller)

    @property
    def source(self) -> tuple[str, str | None]:
        """(path, revision): what distinguishes two versions of one name."""
        return self.ref.path, self.ref.revision


class VersionTable:
    """Live adapter versions of one tier and the version each name serves (no lock: the tier's guards it).

    Args:
        kind: "LoRA" or "prompt adapter", for messages.
        on_drop: called with a version as it leaves the table, to free its weights and slot.
    """

    def __init__(self, kind: str, on_drop: Callable[[AdapterVersion], None]):
        self.kind, self._on_drop = kind, on_drop
        self._current: dict[str, AdapterVersion] = {}  # name -> the newest version (loading or ready)
        self._fallback: dict[str, AdapterVersion] = {}  # name -> the ready version serving while the newest loads
        self._versions: dict[AdapterRef, AdapterVersion] = {}  # every live version (current or retired but held)
        self._served: dict[str, ServedAdapter] = {}  # name -> what clients may select (outlives its versions)
        # name -> the ref of its published version whose source never changes (``request.immutable``: handed
        # over in memory): a reload after the CPU cache evicted it reads the same weights, so it keeps the ref
        # (the version a caller was told, and its prefix-cache blocks); a folder's reload is a new version
        self._immutable_refs: dict[str, AdapterRef] = {}
        self._ids = itertools.count()

    def __iter__(self) -> Iterator[AdapterVersion]:
        """Every live version (a snapshot)."""
        return iter(list(self._versions.values()))

    def get(self, ref: AdapterRef) -> AdapterVersion | None:
        """The live version of ``ref``; None once it was dropped (or never existed)."""
        return self._versions.get(ref)

    def names(self) -> list[str]:
        """Every name with a newest version, in the order they were first registered."""
        return list(self._current)

    def serving(self, name: str) -> AdapterVersion | None:
        """The version that serves ``name`` now: the fallback while a replacement loads, else the newest."""
        return self._fallback.get(name) or self._current.get(name)

    def serving_versions(self) -> set[AdapterVersion]:
        """The version every known name serves."""
        return {self.serving(name) for name in [*self._current, *self._fallback]} - {None}

    def num_pinned(self) -> int:
        """How many live versions are pinned."""
        return sum(v.pinned for v in self._versions.values())

    # ---- served names: what clients may select ------------------------------------------------------
    def served(self, name: str) -> ServedAdapter | None:
        """The served adapter ``name``, with the version serving it now (None when not served)."""
        served = self._served.get(name)
        if served is None:
            return None
        version = self.serving(name)
        return dataclasses.replace(served, version=None if version is None or version.state == FAILED else version.ref)

    def served_all(self) -> list[ServedAdapter]:
        """Every served adapter, in the order its name was first served."""
        return [self.served(name) for name in self._served]

    def serve(self, served: ServedAdapter, replace: bool) -> None:
        """Serve ``served`` under its name; ValueError when the name is served already and ``replace``
        is False."""
        if served.name in self._served and not replace:
            raise ValueError(f"an adapter named {served.name!r} is already loaded")
        self._served[served.name] = served

    def unserve(self, name: str) -> ServedAdapter | None:
        """Stop serving ``name`` (its versions stay for the tier to retire); the record, or None."""
        self._immutable_refs.pop(name, None)
        return self._served.pop(name, None)

    def stage(self, request) -> AdapterVersion:
        """A new version of ``request`` that serves no name yet (``retired`` until ``publish``): dropped
        when its last holder releases it unpublished."""
        version = AdapterVersion(self.new_ref(request.name, request.path, request.revision), request)
        version.retired = True
        self._versions[version.ref] = version
        return version

    def publish(self, version: AdapterVersion) -> None:
        """A staged (or already serving) ready version becomes the version its name serves; the versions
        it replaces are retired and it takes over their pin."""
        if version.retired:
            version.pinned = self.retire_name(version.ref.name)
            version.retired = False
            self.register(version)
            if getattr(version.request, "immutable", False):
                self._immutable_refs[version.ref.name] = version.ref
            else:
                self._immutable_refs.pop(version.ref.name, None)

    # ---- versions --------------------------------------------------------------------------------
    def version_for(self, request) -> tuple[AdapterVersion, bool]:
        """(the version of request.name with the request's source, whether it was created now).

        A new source makes a new, loading version that the name refers to; the old one keeps serving
        until the new one is ready (``take_over``), unless it was still loading itself: then it is
        retired at once and its pin moves to the new version."""
        name, current = request.name, self._current.get(request.name)
        for known in (current, self._fallback.get(name)):
            if known is not None and known.source == request.source:
                return known, False
        version = AdapterVersion(self._reloaded_ref(request) or self.new_ref(name, request.path, request.revision),
                                 request)
        if current is not None:
            logger.info("%s %r: replacing %s with %s", self.kind, name, current.source, request.source)
            if current.state == READY:  # keep it serving until the new version loaded
                assert name not in self._fallback, f"{name!r} has a fallback and a ready newest version"
                self._fallback[name] = current
            else:  # a newer source supersedes one still loading (and takes its pin, if any)
                version.pinned = current.pinned
                self.retire(current)
        self.register(version)
        return version, True

    def _reloaded_ref(self, request) -> AdapterRef | None:
        """The ref an immutable source published under, when this loads it again (see _immutable_refs)."""
        ref = self._immutable_refs.get(request.name)
        if ref is None or (ref.path, ref.revision) != request.source or ref in self._versions:
            return None
        return ref

    def new_ref(self, name: str, path: str, revision: str | None) -> AdapterRef:
        """A ref with a version number never used before in this table."""
        return AdapterRef(name, path, revision, next(self._ids))

    def register(self, version: AdapterVersion) -> None:
        """Make ``version`` live and the newest version of its name."""
        self._current[version.ref.name] = version
        self._versions[version.ref] = version

    def release(self, ref: AdapterRef) -> AdapterVersion:
        """One holder of ``ref`` is done; drops the version if it was the last and it is retired or failed."""
        version = self._versions.get(ref)
        if version is None or version.holders == 0:
            raise ValueError(f"release of {ref} without a matching acquire")
        version.holders -= 1
        if version.holders == 0 and (version.retired or version.state == FAILED):
            self.drop(version)
        return version

    def take_over(self, version: AdapterVersion) -> None:
        """A version became ready: if it is the newest of a name another version serves, it takes over
        the name and the old version's pin, and the old one is retired."""
        name = version.ref.name
        if self._current.get(name) is version and name in self._fallback:
            old = self._fallback.pop(name)
            version.pinned = version.pinned or old.pinned
            self.retire(old)

    def fall_back(self, version: AdapterVersion) -> None:
        """A version failed: it loses its pin, its name goes back to the version serving it, and it is
        dropped unless requests hold it (they all see the same failure)."""
        name = version.ref.name
        version.pinned = False
        if self._current.get(name) is version and name in self._fallback:  # the old one serves on
            self._current[name] = self._fallback.pop(name)
        if version.holders == 0:
            self.drop(version)

    def retire_name(self, name: str) -> bool:
        """Retire every version of ``name``; returns whether its serving version was pinned."""
        serving = self.serving(name)
        pinned = serving is not None and serving.pinned
        for version in (self._fallback.get(name), self._current.get(name)):
            if version is not None:
                self.retire(version)
        return pinned

    def retire(self, version: AdapterVersion) -> None:
        """``version`` no longer serves its name; it is dropped now or when its last holder releases it."""
        version.retired, version.pinned = True, False
        self._forget_name(version)
        if version.holders == 0:
            self.drop(version)

    def drop(self, version: AdapterVersion) -> None:
        """Forget a version, then let the tier free its CPU tensors and its slot (``on_drop``)."""
        self._versions.pop(version.ref, None)
        self._forget_name(version)
        version.pinned = False
        self._on_drop(version)

    def _forget_name(self, version: AdapterVersion) -> None:
        name = version.ref.name
        if self._current.get(name) is version:
            del self._current[name]
        if self._fallback.get(name) is version:
            del self._fallback[name]
