"""Per-step LoRA batch metadata: token -> slot ids turned into segments, read by every LoRA op of a step.

Tokens are stably sorted by slot; the sorted order is cut into tiles of at most ``block_m`` tokens that
never straddle two slots. The table is built on the host (punica_kernels.host_tiles) and uploaded once
per step; :meth:`LoRAMeta.use_table` points the meta at it, and every LoRA-aware layer then reads the
same views. The Triton kernels launch one program per tile bound (``max_tiles(T)``), which depends on T
and ``max_loras`` only, never on how many distinct adapters the batch holds, so a CUDA graph captured
with one adapter replays correctly with many.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# slot_ranks value meaning "no per-slot rank known": kernels use the full padded rank R.
FULL_RANK = 1 << 30

# the order of a table's arrays (HostTileTable.build, TileTable.arrays)
TABLE_FIELDS = ("token_slots", "sorted_tokens", "slot_starts", "tile_slots", "tile_starts", "tile_ends")


@dataclass
class TileTable:
    """One step's segment / tile table where the kernels read it (see LoRAMeta for each array)."""

    arrays: list[torch.Tensor]  # on the meta's device, in TABLE_FIELDS order
    host_slot_starts: list[int]  # slot_starts as host ints (a new list per build)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LoRAMeta:
    """Fixed-size segment metadata for a flat batch of up to ``max_num_tokens`` tokens.

    Args:
        max_num_tokens: largest T a table given to :meth:`use_table` may have.
        max_loras: number of device adapter slots (slot ids are ``0..max_loras-1``).
        device: where the table (and the tensors passed to the kernels) live.
        max_rank, max_slices: optional; when both are given the kernels' workspace
            (``[max_num_tokens, max_slices, max_rank]`` float32) is allocated here, so no call
            of ``add_lora`` ever allocates. Otherwise it is allocated (or grown) on first use,
            which must then happen outside CUDA-graph capture.
        block_m: tokens per tile (a power of two >= 16, as ``tl.dot`` needs).

    The table is built on the host (punica_kernels.host_tiles.HostTileTable) and uploaded by the caller:
    the engine's batch builder in the step's one staged upload, anyone else through
    host_tiles.TableLoader. :meth:`use_table` points these attributes at the uploaded views (no device
    op); they are None before the first one. Only the first entries are meaningful:
        token_slots    [T] int64: slot per token, -1 = no adapter
        sorted_tokens  [T] int64: token ids stably sorted by slot, -1 tokens last
        slot_starts    [max_loras + 2] int64: first sorted position of each slot; entry
                       ``max_loras`` is where the -1 tokens start, the last entry is T
        tile_slots     [max_tile_count] int32: slot of each tile, -1 = no work
        tile_starts    [max_tile_count] int32: tile's first position in ``sorted_tokens``
        tile_ends      [max_tile_count] int32: one past its last position
        slot_ranks     [max_loras] int32: real rank per slot (``FULL_RANK`` when unknown)
    and the meta's own ``split_counters`` [max_tile_count] int32: the split-K shrink's arrival counters,
    zero between launches. A CUDA graph captured over the kernels reads the views' addresses, so the
    uploader keeps them fixed for a given T (see host_tiles).
    """

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device | str = "cpu",
                 *, max_rank: int | None = None, max_slices: int | None = None,
                 block_m: int = 16) -> None:
        if max_num_tokens < 1 or max_loras < 1:
            raise ValueError(f"max_num_tokens ({max_num_tokens}) and max_loras ({max_loras}) "
                             "must be positive")
        if block_m < 16 or block_m & (block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
        self.max_num_tokens = max_num_tokens
        self.max_loras = max_loras
        self.device = torch.device(device)
        self.block_m = block_m
        self.max_tile_count = _cdiv(max_num_tokens, block_m) + max_loras
        self.num_tokens: int | None = None  # T of the table in use (host int: no sync to read)
        self._host_slot_starts: list[int] | None = None
        self.token_slots: torch.Tensor | None = None  # the table's views, set by use_table
        self.sorted_tokens: torch.Tensor | None = None
        self.slot_starts: torch.Tensor | None = None
        self.tile_slots: torch.Tensor | None = None
        self.tile_starts: torch.Tensor | None = None
        self.tile_ends: torch.Tensor | None = None
        int32 = dict(dtype=torch.int32, device=self.device)
        self._full_ranks = torch.full((max_loras,), FULL_RANK, **int32)  # [max_loras] a table without ranks
        self.slot_ranks = self._full_ranks
        # the shrink's split-K arrival counters (punica_kernels.triton_ops): zero between launches, allocated
        # here so no launch allocates (a first split launch may be inside CUDA-graph capture)
        self.split_counters = torch.zeros(self.max_tile_count, **int32)  # [max_tile_count]

        self.workspace: torch.Tensor | None = None  # [capacity] float32, see workspace_for
        self._slice_offsets: dict[tuple[int, ...], torch.Tensor] = {}
        self._unit_scales: dict[int, torch.Tensor] = {}
        if max_rank is not None and max_slices is not None:
            self._grow_workspace(max_num_tokens * max_slices * max_rank)

    def max_tiles(self, num_tokens: int) -> int:
        """Upper bound on the tiles of a batch of ``num_tokens`` tokens (the kernels' grid).

        Each slot's segment wastes at most one partial tile, and at most min(max_loras, T)
        slots are present, so the bound depends on T alone.
        """
        if num_tokens == 0:
            return 0
        return min(self.max_tile_count,
                   _cdiv(num_tokens, self.block_m) + min(self.max_loras, num_tokens))

    def use_table(self, table: TileTable, slot_ranks: torch.Tensor | None = None) -> None:
        """Read the step's table from views uploaded by the caller: no device op, no sync.

        Args:
            table: HostTileTable.build's arrays on ``device`` (TileTable.arrays, in TABLE_FIELDS order)
                and its slot_starts as host ints (the torch path reads them without a sync).
            slot_ranks: [max_loras] int32 on ``device``, read in place (the adapter slots' ranks: a
                persistent tensor); None: the full padded rank.

        Raises:
            ValueError: views of the wrong number, shape, dtype or device, or T > max_num_tokens.
        """
        views = table.arrays
        if len(views) != len(TABLE_FIELDS):
            raise ValueError(f"use_table needs {len(TABLE_FIELDS)} views {TABLE_FIELDS}, got {len(views)}")
        num_tokens = views[0].shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"batch has {num_tokens} tokens but LoRAMeta was built for "
                             f"max_num_tokens={self.max_num_tokens}")
        shapes = [(num_tokens,), (num_tokens,), (self.max_loras + 2,)] + [(self.max_tile_count,)] * 3
        dtypes = [torch.int64] * 3 + [torch.int32] * 3
        if slot_ranks is not None:
            views, shapes, dtypes = [*views, slot_ranks], [*shapes, (self.max_loras,)], [*dtypes, torch.int32]
        for view, shape, dtype in zip(views, shapes, dtypes):
            if tuple(view.shape) != shape or view.dtype != dtype or not same_device(view.device, self.device):
                raise ValueError(f"use_table: expected {dtype} {list(shape)} on {self.device}, got "
                                 f"{view.dtype} {list(view.shape)} on {view.device}")
        (self.token_slots, self.sorted_tokens, self.slot_starts, self.tile_slots, self.tile_starts,
         self.tile_ends) = table.arrays
        self.slot_ranks = self._full_ranks if slot_ranks is None else slot_ranks
        self.num_tokens = num_tokens
        self._host_slot_starts = table.host_slot_starts

    def host_slot_starts(self) -> list[int]:
        """slot_starts of the table in use as host ints (a new list per table: the torch path keys its
        cache on it); raises ValueError before the first use_table."""
        if self._host_slot_starts is None:
            raise ValueError("the meta has no table yet: call use_table (or host_tiles.TableLoader.load) first")
        return self._host_slot_starts

    def slice_offsets(self, slice_sizes: tuple[int, ...]) -> torch.Tensor:
        """[n_slices + 1] int64 cumulative slice offsets on ``device``, cached per layout.

        The first call for a layout allocates, so it must run outside CUDA-graph capture.
        """
        offsets = self._slice_offsets.get(slice_sizes)
        if offsets is None:
            _refuse_allocation_in_capture("slice offsets", self.device)
            values = [0]
            for size in slice_sizes:
                values.append(values[-1] + size)
            offsets = torch.tensor(values, dtype=torch.int64, device=self.device)
            self._slice_offsets[slice_sizes] = offsets
        return offsets

    def unit_scales(self, width: int) -> torch.Tensor:
        """[max_loras, width] float32 ones on ``device``, cached per width: the slice scales the Triton
        kernels read when a caller passes none (laid out as the slots' scales, so the kernels compile
        once for both); as column scales they only fill the pointer of an expand that reads none
        (HAS_COLUMN_SCALES off). The first call for a width allocates, outside CUDA-graph capture.
        """
        ones = self._unit_scales.get(width)
        if ones is None:
            _refuse_allocation_in_capture("unit LoRA scales", self.device)
            ones = torch.ones(self.max_loras, width, dtype=torch.float32, device=self.device)
            self._unit_scales[width] = ones
        return ones

    def workspace_for(self, num_elements: int) -> torch.Tensor:
        """A float32 scratch view of at least ``num_elements``; grows (outside capture) if needed."""
        if self.workspace is None or self.workspace.numel() < num_elements:
            self._grow_workspace(num_elements)
        return self.workspace

    def _grow_workspace(self, num_elements: int) -> None:
        _refuse_allocation_in_capture("the LoRA workspace", self.device)
        logger.debug("LoRAMeta workspace: %d float32 elements on %s", num_elements, self.device)
        self.workspace = torch.empty(num_elements, dtype=torch.float32, device=self.device)


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when two devices name the same place ("cuda" and "cuda:0" included)."""
    if a == b:  # the common case, answered without reading the attributes (this runs per LoRA op)
        return True
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _refuse_allocation_in_capture(what: str, device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} must be allocated before CUDA-graph capture: run one eager "
                           "add_lora call first, or build LoRAMeta with max_rank and max_slices")
