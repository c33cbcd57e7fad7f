"""Prefix caching: content-addressed full KV blocks, kept after their requests finish until memory is needed.

A full block's key chains everything its KV depends on: its parent block's key, its token ids, and the
request's *cache identity* = (the LoRA version, the prompt adapter's version, the cache salt). The
version is the adapter tier's ``AdapterRef`` (name, path, revision and a number never reused by its
tier), not the name: an adapter replaced under the same name never hits the blocks the old weights
computed (vLLM #42125 keyed by name). A request without adapters keys with None and so never meets an
adapter's blocks, nor the reverse (SGLang #24638). The salt separates tenants: a hit shows in time to
first token, so a shared cache would leak which prompts another tenant sent.

Reuse is exact: the K/V of position p depend only on tokens 0..p (and the adapters), never on what
follows. That holds with sliding windows too: our paged attention keeps every block of a sequence
allocated and masks the window (lora_runner.model.attention), so a block computed once reads the same
later. Soft-prompt placeholders (id 0) sit at the front of token_ids; the prompt adapter's version in
the identity covers their KV.

Keys are SHA-256 digests (collision-resistant: one tenant cannot craft a prompt that hits another's
block), computed once per block per request and kept on the request (``Request.block_hashes``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from lora_runner.core.request import Request


def _ref_identity(ref) -> tuple | None:
    """What identifies one adapter version (AdapterRef: name, path, revision, version), or None."""
    if ref is None:
        return None
    return (ref.name, ref.path, ref.revision, ref.version)


def cache_identity(request: Request) -> bytes:
    """The digest of what every block key of `request` includes besides its tokens."""
    identity = (_ref_identity(request.lora_ref), _ref_identity(request.prompt_adapter_ref), request.cache_salt)
    return hashlib.sha256(repr(identity).encode()).digest()


def block_key(parent: bytes | None, identity: bytes, token_ids) -> bytes:
    """The key of one full block: sha256(parent key, identity, the block's token ids as int64)."""
    digest = hashlib.sha256(parent or b"root")
    digest.update(identity)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def request_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """The keys of every full block of `request`'s tokens, extended incrementally on the request
    (each block hashed once). Its adapters' placeholders must be in place (they shift every block)."""
    assert not request.awaiting_virtual_tokens, f"request {request.request_id!r} hashed before its placeholders"
    hashes = request.block_hashes
    num_full = len(request.token_ids) // block_size
    if len(hashes) < num_full:
        if request.cache_identity is None:
            request.cache_identity = cache_identity(request)
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), num_full):
            parent = block_key(parent, request.cache_identity,
                               request.token_ids[index * block_size:(index + 1) * block_size])
            hashes.append(parent)
    return hashes


class PrefixCache:
    """Which block holds which key, and the LRU of cached blocks no request holds (evictable).

    The block manager owns reference counts; this class only maps keys to blocks. A block enters
    with ``register`` once its tokens are computed, becomes evictable when its last holder frees it
    (``release``, in the order freed: the manager frees a table's end first, so chain ends leave
    before their parents) and stops being evictable on a hit (``claim``). ``evict`` forgets the least
    recently released block so it can be overwritten.
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (in use or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds: free memory that still answers hits."""
        return len(self._evictable)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached chain of `hashes` (from the first)."""
        blocks = []
        for key in hashes:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_cached(self, block: int) -> bool:
        """True when `block` holds a cached prefix."""
        return block in self._key_of

    def is_evictable(self, block: int) -> bool:
        """True when `block` is cached and no request holds it."""
        return block in self._evictable

    def register(self, block: int, key: bytes) -> bool:
        """Cache `block` (held, computed) under `key`; False when another block holds that key
        already (two requests computed the same prefix at once: the first stays, this one does not)."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def claim(self, block: int) -> None:
        """A request takes `block` on a hit: it is no longer evictable."""
        self._evictable.pop(block, None)

    def release(self, block: int) -> None:
        """`block`'s last holder freed it: it stays cached, evictable, most recently released."""
        self._evictable[block] = None

    def evict(self) -> int:
        """Forget the least recently released cached block and return it (free to overwrite)."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block
