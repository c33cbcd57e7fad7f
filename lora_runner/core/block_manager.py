"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and one block table per request."""

from __future__ import annotations

import logging
from collections import deque

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
    Shared blocks are never written again (they hold only full, computed prompt blocks), so no
    copy-on-write is needed; a block returns to the free list when its last holder frees it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._refs: dict[int, int] = {}  # block -> number of tables holding it (held blocks only)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks `request_id` needs so that its table covers `num_tokens` tokens."""
        held = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - held)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """True when enough blocks are free to cover `num_tokens` tokens of `request_id`."""
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow (or create) the table of `request_id` to cover `num_tokens` tokens; returns the block
        ids appended (the scheduler hands them to the runner's rows as the table's diff).

        Raises RuntimeError when too few blocks are free (check with can_allocate first).
        """
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"request {request_id!r} needs {needed} KV blocks, only "
                               f"{len(self._free)} free")
        new_blocks = [self._free.popleft() for _ in range(needed)]
        for block in new_blocks:
            self._refs[block] = 1
        self._tables.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

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

    def ref_count(self, block: int) -> int:
        """How many tables hold `block` (0 when it is free)."""
        return self._refs.get(block, 0)

    def table(self, request_id: str) -> list[int]:
        """The block table of `request_id` (empty when it holds no blocks)."""
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> int:
        """Release every block of `request_id`; those no other table holds return to the free list.
        Returns how many returned."""
        table = self._tables.pop(request_id, [])
        freed = 0
        for block in table:
            self._refs[block] -= 1
            if self._refs[block] == 0:  # its last holder: the block is free again
                del self._refs[block]
                self._free.appendleft(block)  # reused first: its pages are resident already
                freed += 1
        if table:
            logger.debug("released %d KV blocks of request %r (%d now free)", len(table), request_id, freed)
        return freed

    def holders(self) -> list[str]:
        """Ids of the requests that hold blocks."""
        return list(self._tables)
