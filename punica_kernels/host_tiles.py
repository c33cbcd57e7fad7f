"""A LoRAMeta's segment / tile table, built on the host in numpy: the one builder of every LoRA op's table.

The token slots are known on the host when a step is written, so :class:`HostTileTable` computes the
table there (a stable argsort and a few numpy passes over T tokens and ``max_tile_count`` tiles) and the
caller uploads it; the meta then reads the uploaded views (``LoRAMeta.use_table``: no device op)::

    table = HostTileTable(meta)
    arrays = table.build(token_slots)          # [T] int host slots -> the arrays below, host numpy
    views = staged_upload(arrays)              # device views, same shapes and dtypes
    meta.use_table(TileTable(views, table.host_slot_starts), slot_ranks)

The engine's batch builder packs the arrays into the step's one staged upload (the layers' table and the
lm_head LoRA's table over the sampled rows); :class:`TableLoader` uploads them itself, into buffers at
fixed addresses, for everyone else (kernel tests and benchmarks, the AOT tool, the prompt-logprob rows).
The arrays keep the meta's meaning and dtypes (the kernels read them unchanged); their sizes depend on T
alone (tile arrays: always ``max_tile_count``), so every replay of one decode graph finds them at the
addresses its capture saw. Tiles without work have slot -1 and an empty range.
"""

from __future__ import annotations

import numpy as np
import torch

from .meta import FULL_RANK, TABLE_FIELDS, LoRAMeta, TileTable, same_device

__all__ = ["TABLE_FIELDS", "HostTileTable", "TableLoader", "TileTable", "load_table"]


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
        slot, in slot order; the remaining tiles get slot -1 and an empty range."""
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


class TableLoader:
    """Builds a meta's tables on the host and uploads each into the same buffers, for callers without a
    staged upload (kernel tests and benchmarks, the AOT tool, the lm_head LoRA of prompt-logprob rows).

    Off the CPU the tables are copied into device buffers allocated here once, so a CUDA graph captured
    over the kernels replays correctly after a later load of the same T; on the CPU the meta reads the
    host table's arrays themselves (no copy).

    Args:
        meta: the meta each load points at its table.
        host: the host builder to use (default: a new one for ``meta``).
    """

    def __init__(self, meta: LoRAMeta, host: HostTileTable | None = None) -> None:
        self.meta = meta
        self.host = HostTileTable(meta) if host is None else host
        largest = self.host.build(np.empty(0, np.int64))  # every array at its largest, token arrays apart
        sizes = [meta.max_num_tokens, meta.max_num_tokens] + [array.shape[0] for array in largest[2:]]
        self._device = None if meta.device.type == "cpu" else [
            torch.zeros(size, dtype=torch.from_numpy(array).dtype, device=meta.device)
            for size, array in zip(sizes, largest)]
        # the ranks the meta reads, copied here so their address is fixed too
        self.slot_ranks = torch.full((meta.max_loras,), FULL_RANK, dtype=torch.int32, device=meta.device)

    def load(self, token_slots: torch.Tensor | np.ndarray, slot_ranks: torch.Tensor | None = None, *,
             check: bool = True) -> TileTable:
        """Build and upload the table of ``token_slots`` and point the meta at it.

        Args:
            token_slots: [T] integer tensor on the meta's device, or a host numpy array; slot per token,
                -1 = no adapter (read on the host: a device sync off the CPU).
            slot_ranks: [max_loras] integer tensor on the meta's device (optional): real rank of each
                slot's adapter. Kernels then skip the zero padding beyond it (rounded up to 16).
            check: refuse slots outside ``[-1, max_loras)`` and negative ranks; unchecked, an
                out-of-range slot is treated as -1 (never read out of bounds).

        Raises:
            ValueError: wrong shape, dtype or device, T > max_num_tokens, or (when checked) a slot
                outside ``[-1, max_loras)`` or a negative rank.
        """
        meta = self.meta
        host_slots = self._host_slots(token_slots)
        if host_slots.shape[0] > meta.max_num_tokens:
            raise ValueError(f"batch has {host_slots.shape[0]} tokens but LoRAMeta was built for "
                             f"max_num_tokens={meta.max_num_tokens}")
        if check and host_slots.size and (host_slots.min() < -1 or host_slots.max() >= meta.max_loras):
            raise ValueError(f"token_slots must lie in [-1, {meta.max_loras}) (max_loras={meta.max_loras}); "
                             f"got values in [{host_slots.min()}, {host_slots.max()}]")
        if slot_ranks is not None:
            _check_integer_tensor("slot_ranks", slot_ranks, meta)
            if slot_ranks.shape[0] != meta.max_loras:
                raise ValueError(f"slot_ranks must have shape [max_loras={meta.max_loras}], "
                                 f"got {list(slot_ranks.shape)}")
            if check and int(slot_ranks.min()) < 0:
                raise ValueError("slot_ranks must be >= 0")
        arrays = [torch.from_numpy(array) for array in self.host.build(host_slots)]
        if self._device is not None:
            arrays = [buffer[:array.shape[0]].copy_(array) for buffer, array in zip(self._device, arrays)]
        table = TileTable(arrays, self.host.host_slot_starts)
        meta.use_table(table, None if slot_ranks is None else self.slot_ranks.copy_(slot_ranks))
        return table

    def _host_slots(self, token_slots: torch.Tensor | np.ndarray) -> np.ndarray:
        if isinstance(token_slots, np.ndarray):
            if token_slots.ndim != 1 or token_slots.dtype.kind not in "iu":
                raise ValueError(f"token_slots must be a 1-D integer array, got {token_slots.dtype} "
                                 f"{list(token_slots.shape)}")
            return token_slots
        _check_integer_tensor("token_slots", token_slots, self.meta)
        return token_slots.cpu().numpy()


def load_table(meta: LoRAMeta, token_slots: torch.Tensor | np.ndarray, slot_ranks: torch.Tensor | None = None,
               *, check: bool = True) -> TileTable:
    """``TableLoader(meta).load(...)``: one table in buffers of its own (tests, tools). A CUDA graph that
    must replay over later tables needs them in the same buffers: keep one TableLoader instead."""
    return TableLoader(meta).load(token_slots, slot_ranks, check=check)


def _check_integer_tensor(name: str, tensor: torch.Tensor, meta: LoRAMeta) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if not same_device(tensor.device, meta.device):
        raise ValueError(f"{name} is on {tensor.device} but LoRAMeta is on {meta.device}")
