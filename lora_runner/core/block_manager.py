"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and one block table per request."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from lora_runner.core.prefix_cache import PrefixCache, request_block_hashes
from lora_runner.core.request import Request

logger = logging.getLogger(__name__)


class BlockManager:
    """Hands out KV-cache blocks of `block_size` tokens from a pool of `num_blocks`.

    A request's block table lists the blocks that hold its tokens in order: token position p lives
    in block table[p // block_size] at offset p % block_size, i.e. KV slot
    table[p // block_size] * block_size + p % block_size. Tables only grow while a request runs and
    are returned whole when it finishes or is preempted.

    The most recently freed blocks are handed out first (a stack), so the blocks ever used are only
    as many as were ever held at once: on CPU the cache's untouched pages are never committed (see
    lora_runner.worker.kv_cache.allocate_kv_cache).

    Blocks are reference counted so that requests can share them: ``fork`` gives a request the first
    full blocks of another's table (the parallel samples of one prompt share its prefill this way).
    Shared blocks are never written again (they hold only full, computed blocks), so no
    copy-on-write is needed; a block returns to the free list when its last holder frees it.

    Prefix caching (``enable_caching``, lora_runner.core.prefix_cache): ``cache_computed`` registers
    a request's full computed blocks under their keys; a freed cached block stays cached but
    evictable (it counts as free), and ``cached_prefix`` finds the longest cached chain of a new
    request's blocks, which ``allocate(..., prefix=)`` starts its table with. Allocation takes
    uncached free blocks first, then evicts the least recently freed cached ones (a table's end is
    freed before its start, so chain ends go before their parents).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))  # uncached free blocks, most recently freed first
        self._tables: dict[str, list[int]] = {}
        self._refs: dict[int, int] = {}  # block -> number of tables holding it (held blocks only)
        self._cache = PrefixCache()
        self._num_registered: dict[str, int] = {}  # request -> leading table blocks cache_computed has seen

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (uncached ones and evictable cached ones)."""
        return len(self._free) + self._cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix, held by requests or evictable."""
        return self._cache.num_cached_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> int:
        """Extra blocks `request_id` needs so that its table (started with `prefix`, when it holds none)
        covers `num_tokens` tokens."""
        held = len(self._tables.get(request_id, ())) + len(prefix)
        return max(0, self.blocks_for(num_tokens) - held)

    def can_allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """True when enough blocks are free to cover `num_tokens` tokens of `request_id` (started with
        the cached blocks `prefix`: those a hit takes off the evictable list are not free for the rest)."""
        claimed = sum(1 for block in prefix if self._cache.is_evictable(block))
        return self.blocks_needed(request_id, num_tokens, prefix) <= self.num_free_blocks - claimed

    def allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Grow (or create) the table of `request_id` to cover `num_tokens` tokens; returns the block
        ids appended (the scheduler hands them to the runner's rows as the table's diff). `prefix`:
        cached blocks (``cached_prefix``) a new table starts with, shared (reference counted).

        Raises RuntimeError when too few blocks are free (check with can_allocate first).
        """
        if prefix and request_id in self._tables:
            raise RuntimeError(f"request {request_id!r} holds blocks already: a cached prefix starts a new table")
        if not self.can_allocate(request_id, num_tokens, prefix):
            raise RuntimeError(f"request {request_id!r} needs {self.blocks_needed(request_id, num_tokens, prefix)} "
                               f"KV blocks, only {self.num_free_blocks} free")
        for block in prefix:
            if block not in self._refs:
                self._cache.claim(block)
            self._refs[block] = self._refs.get(block, 0) + 1
        needed = self.blocks_needed(request_id, num_tokens, prefix)
        new_blocks = [self._take_block() for _ in range(needed)]
        for block in new_blocks:
            self._refs[block] = 1
        self._tables.setdefault(request_id, []).extend((*prefix, *new_blocks))
        return [*prefix, *new_blocks]

    def _take_block(self) -> int:
        """An uncached free block if any (most recently freed first), else the LRU evictable cached one."""
        return self._free.popleft() if self._free else self._cache.evict()

    def fork(self, source_id: str, request_id: str, num_blocks: int) -> list[int]:
        """Start the table of `request_id` (which must hold no blocks) with the first `num_blocks`
        blocks of `source_id`'s table, shared (reference counted), and return it. The caller must
        only share blocks that are full and computed: neither request writes them again."""
        source = self._tables.get(source_id, [])
        if request_id in self._tables or not 0 <= num_blocks <= len(source):
            raise RuntimeError(f"cannot fork {num_blocks} blocks of {source_id!r} ({len(source)} held) "
                               f"into {request_id!r}")
        shared = source[:num_blocks]
        for block in shared:
            self._refs[block] += 1
        self._tables[request_id] = list(shared)
        return self._tables[request_id]

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks of the longest chain of `request`'s full blocks, leaving at least its
        last token to compute (it needs its own logits); [] when caching is off."""
        if not self.enable_caching:
            return []
        hashes = request_block_hashes(request, self.block_size)
        return self._cache.lookup(hashes[:(request.num_tokens - 1) // self.block_size])

    def cache_computed(self, request: Request) -> None:
        """Register the full blocks of `request` computed so far under their keys (once per block;
        a block cached already, by a hit or a fork, is skipped). Call after its computed count grew."""
        if not self.enable_caching:
            return
        table = self._tables.get(request.request_id, ())
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:  # most decode steps: no block filled up
            return
        hashes = request_block_hashes(request, self.block_size)
        for index in range(start, num_full):
            if not self._cache.is_cached(table[index]):
                self._cache.register(table[index], hashes[index])
        self._num_registered[request.request_id] = num_full

    def ref_count(self, block: int) -> int:
        """How many tables hold `block` (0 when it is free)."""
        return self._refs.get(block, 0)

    def table(self, request_id: str) -> list[int]:
        """The block table of `request_id` (empty when it holds no blocks)."""
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> int:
        """Release every block of `request_id`; those no other table holds return to the free list
        (cached ones stay cached, evictable). Returns how many returned."""
        table = self._tables.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        uncached: list[int] = []
        freed = 0
        for block in reversed(table):  # the table's end first: a chain's end is evicted before its parents
            self._refs[block] -= 1
            if self._refs[block] == 0:  # its last holder: the block is free again
                del self._refs[block]
                freed += 1
                if self._cache.is_cached(block):
                    self._cache.release(block)
                else:
                    uncached.append(block)
        # reused first, the table's last block at the front (as before caching): their pages are resident
        self._free.extendleft(reversed(uncached))
        if table:
            logger.debug("released %d KV blocks of request %r (%d now free)", len(table), request_id, freed)
        return freed

    def holders(self) -> list[str]:
        """Ids of the requests that hold blocks."""
        return list(self._tables)
