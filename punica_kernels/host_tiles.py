"""A LoRAMeta's segment / tile table built on the host, in numpy, for the step's one staged upload.

``LoRAMeta.prepare`` builds the table with ~30 eager device ops (sort, searchsorted, cumsum, ...)
before every step; on the engine path the batch builder already holds the token slots on the host,
so :class:`HostTileTable` computes the same buffers there (a stable argsort and a few numpy passes
over T tokens and ``max_tile_count`` tiles) and the runner packs them into the step's one upload::

    table = HostTileTable(meta)
    arrays = table.build(token_slots)          # [T] int host slots -> the arrays below, host numpy
    views = staged_upload(arrays)              # device views, same shapes and dtypes
    meta.use_table(views, table.host_slot_starts, slot_ranks)   # no device op

The arrays keep the meta's buffers' meaning and dtypes (the kernels read them unchanged); their sizes
depend on T alone (tile arrays: always ``max_tile_count``), so every replay of one decode graph finds
them at the addresses its capture saw. Tiles without work have slot -1 and an empty range.
"""

from __future__ import annotations

import numpy as np

from .meta import LoRAMeta

# the order of build()'s arrays (and of LoRAMeta.use_table's views)
TABLE_FIELDS = ("token_slots", "sorted_tokens", "slot_starts", "tile_slots", "tile_starts", "tile_ends")


class HostTileTable:
    """Persistent host buffers of one LoRAMeta's table (allocated once at their maximum size).

    Args:
        meta: the meta whose buffers the table stands for (its max_num_tokens, max_loras, block_m).
    """

    def __init__(self, meta: LoRAMeta) -> None:
        self.max_num_tokens, self.max_loras, self.block_m = meta.max_num_tokens, meta.max_loras, meta.block_m
        self.max_tile_count = meta.max_tile_count
        self.token_slots = np.full(self.max_num_tokens, -1, np.int64)  # [max_num_tokens]
        self.sorted_tokens = np.zeros(self.max_num_tokens, np.int64)  # [max_num_tokens]
        self.slot_starts = np.zeros(self.max_loras + 2, np.int64)  # [max_loras + 2]
        self.tile_slots = np.full(self.max_tile_count, -1, np.int32)  # [max_tile_count]
        self.tile_starts = np.zeros(self.max_tile_count, np.int32)  # [max_tile_count]
        self.tile_ends = np.zeros(self.max_tile_count, np.int32)  # [max_tile_count]
        self._slot_ids = np.arange(self.max_loras, dtype=np.int64)  # [max_loras]
        self._tile_ids = np.arange(self.max_tile_count, dtype=np.int64)  # [max_tile_count]
        self.host_slot_starts: list[int] = [0] * (self.max_loras + 2)  # of the last build, as host ints

    def build(self, token_slots: np.ndarray) -> list[np.ndarray]:
        """The table of a batch whose token t is on slot ``token_slots[t]`` (-1, or any value outside
        ``[0, max_loras)``: no adapter), as views of the persistent buffers in :data:`TABLE_FIELDS` order.

        Raises ValueError when T exceeds the meta's max_num_tokens.
        """
        num_tokens = token_slots.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"batch has {num_tokens} tokens but the table holds {self.max_num_tokens}")
        slots = self.token_slots[:num_tokens]  # [T]
        slots[:] = token_slots
        keys = np.where((slots >= 0) & (slots < self.max_loras), slots, self.max_loras)  # [T] L = no adapter
        sorted_tokens = self.sorted_tokens[:num_tokens]  # [T]
        sorted_tokens[:] = np.argsort(keys, kind="stable")
        counts = np.bincount(keys, minlength=self.max_loras + 1)  # [L + 1] tokens per slot, then -1 tokens
        self.slot_starts[0] = 0
        np.cumsum(counts, out=self.slot_starts[1:])
        self._write_tiles(counts[:self.max_loras])
        self.host_slot_starts = self.slot_starts.tolist()
        return [slots, sorted_tokens, self.slot_starts, self.tile_slots, self.tile_starts, self.tile_ends]

    def _write_tiles(self, counts: np.ndarray) -> None:
        """Cut each slot's segment of the sorted order into tiles of at most block_m tokens, slot by
        slot (LoRAMeta._write_tiles' order); the remaining tiles get slot -1 and an empty range."""
        tiles_per_slot = -(-counts // self.block_m)  # [L]
        num_tiles = int(tiles_per_slot.sum())
        tile_slot = np.repeat(self._slot_ids, tiles_per_slot)  # [num_tiles]
        first_tile = np.cumsum(tiles_per_slot) - tiles_per_slot  # [L] each slot's first tile
        local = self._tile_ids[:num_tiles] - first_tile[tile_slot]  # [num_tiles] tile number in its slot
        starts = self.slot_starts[tile_slot] + local * self.block_m  # [num_tiles]
        self.tile_slots[:num_tiles] = tile_slot
        self.tile_starts[:num_tiles] = starts
        self.tile_ends[:num_tiles] = np.minimum(starts + self.block_m, self.slot_starts[tile_slot + 1])
        self.tile_slots[num_tiles:] = -1
        self.tile_starts[num_tiles:] = 0
        self.tile_ends[num_tiles:] = 0
