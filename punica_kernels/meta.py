"""Per-step LoRA batch metadata: token -> slot ids turned into segments in fixed-size buffers.

The runner calls :meth:`LoRAMeta.prepare` once per step; every LoRA-aware layer then reads the
same buffers. Tokens are stably sorted by slot; the sorted order is cut into tiles of at most
``block_m`` tokens that never straddle two slots. The Triton kernels launch one program per tile
bound (``max_tiles(T)``), which depends on T and ``max_loras`` only, never on how many distinct
adapters the batch holds, so a CUDA graph captured with one adapter replays correctly with many.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

# slot_ranks value meaning "no per-slot rank known": kernels use the full padded rank R.
FULL_RANK = 1 << 30


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LoRAMeta:
    """Fixed-size segment metadata for a flat batch of up to ``max_num_tokens`` tokens.

    Args:
        max_num_tokens: largest T that :meth:`prepare` will be given.
        max_loras: number of device adapter slots (slot ids are ``0..max_loras-1``).
        device: where the buffers (and the tensors passed to the kernels) live.
        max_rank, max_slices: optional; when both are given the kernels' workspace
            (``[max_num_tokens, max_slices, max_rank]`` float32) is allocated here, so no call
            of ``add_lora`` ever allocates. Otherwise it is allocated (or grown) on first use,
            which must then happen outside CUDA-graph capture.
        block_m: tokens per tile (a power of two >= 16, as ``tl.dot`` needs).

    Buffers (all on ``device``; only the first entries are meaningful after a prepare):
        token_slots    [max_num_tokens] int64: slot per token, -1 = no adapter
        sorted_tokens  [max_num_tokens] int64: token ids stably sorted by slot, -1 tokens last
        slot_starts    [max_loras + 2] int64: first sorted position of each slot; entry
                       ``max_loras`` is where the -1 tokens start, the last entry is T
        slot_ranks     [max_loras] int32: real rank per slot (``FULL_RANK`` when unknown)
        tile_slots     [max_tile_count] int32: slot of each tile, -1 = no work
        tile_starts    [max_tile_count] int32: tile's first position in ``sorted_tokens``
        tile_ends      [max_tile_count] int32: one past its last position
        split_counters [max_tile_count] int32: the split-K shrink's arrival counters, zero between launches

    The three tile buffers are read by the Triton kernels only. On accelerators ``prepare`` writes them
    (a captured graph reads them without calling back into Python); on other devices, where the
    torch path reads ``sorted_tokens`` and ``slot_starts`` alone, they are written on first access
    after a prepare (the Triton interpreter's launchers read them through these attributes).

    The engine's path skips ``prepare``: the table is built on the host (punica_kernels.host_tiles) and
    arrives in the step's one staged upload; :meth:`use_table` points these attributes at those views
    (no device op). ``prepare`` points them back at the meta's own buffers.
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
        self.num_tokens: int | None = None  # T of the last prepare (host int: no sync to read)
        self._host_slot_starts: list[int] | None = None  # cache of slot_starts.tolist()
        self.max_tile_count = _cdiv(max_num_tokens, block_m) + max_loras

        int64 = dict(dtype=torch.int64, device=self.device)
        int32 = dict(dtype=torch.int32, device=self.device)
        self.token_slots = torch.full((max_num_tokens,), -1, **int64)  # [max_num_tokens]
        self.sorted_tokens = torch.zeros(max_num_tokens, **int64)  # [max_num_tokens]
        self.slot_starts = torch.zeros(max_loras + 2, **int64)  # [max_loras + 2]
        self.slot_ranks = torch.full((max_loras,), FULL_RANK, **int32)  # [max_loras]
        self._tile_slots = torch.full((self.max_tile_count,), -1, **int32)  # [max_tile_count]
        self._tile_starts = torch.zeros(self.max_tile_count, **int32)  # [max_tile_count]
        self._tile_ends = torch.zeros(self.max_tile_count, **int32)  # [max_tile_count]
        self._own_buffers = self._buffers()  # what prepare writes (use_table points elsewhere)
        self._full_ranks = torch.full((max_loras,), FULL_RANK, **int32)  # [max_loras] use_table without ranks
        # the shrink's split-K arrival counters (punica_kernels.triton_ops): zero between launches, allocated
        # here so no launch allocates (a first split launch may be inside CUDA-graph capture)
        self.split_counters = torch.zeros(self.max_tile_count, **int32)  # [max_tile_count]
        self._tiles_stale = False  # a prepare since the tile buffers were last written (never on CUDA)
        # scratch written by prepare
        self._sort_keys = torch.zeros(max_num_tokens, **int64)  # [max_num_tokens]
        self._sorted_keys = torch.zeros(max_num_tokens, **int64)  # [max_num_tokens]
        self._slot_ids = torch.arange(max_loras + 2, **int64)  # [max_loras + 2]
        self._tile_ids = torch.arange(self.max_tile_count, **int64)  # [max_tile_count]

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

    def prepare(self, token_slots: torch.Tensor, slot_ranks: torch.Tensor | None = None,
                *, check: bool | None = None) -> None:
        """Write the step's segment metadata into the fixed buffers.

        Args:
            token_slots: [T] integer tensor on ``device``; slot per token, -1 = no adapter.
            slot_ranks: [max_loras] integer tensor (optional): real rank of each slot's
                adapter. Kernels then skip the zero padding beyond it (rounded up to 16).
            check: validate slot and rank values (reads them on the host). Defaults to True
                for CPU tensors and False on accelerators, where it would cost a host sync;
                unchecked out-of-range slots are treated as -1 (never read out of bounds).

        Raises:
            ValueError: wrong shape/dtype/device, T > max_num_tokens, or (when checked) a slot
                outside ``[-1, max_loras)`` or a negative rank.
        """
        self._check_tensor("token_slots", token_slots, 1)
        num_tokens = token_slots.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"batch has {num_tokens} tokens but LoRAMeta was built for "
                             f"max_num_tokens={self.max_num_tokens}")
        if check is None:
            check = token_slots.device.type == "cpu"
        if check and num_tokens and (int(token_slots.min()) < -1
                                     or int(token_slots.max()) >= self.max_loras):
            raise ValueError(f"token_slots must lie in [-1, {self.max_loras}) "
                             f"(max_loras={self.max_loras}); got values in "
                             f"[{int(token_slots.min())}, {int(token_slots.max())}]")
        self._write_slot_ranks(slot_ranks, check)

        self._set_buffers(self._own_buffers)  # after the checks: a refused prepare changes nothing
        self.num_tokens = num_tokens
        self._host_slot_starts = None
        self._tiles_stale = True
        if num_tokens == 0:
            self.slot_starts.zero_()
        else:
            self._sort_by_slot(token_slots)
        if self.device.type != "cpu":  # accelerators: graphs replay the kernels without Python
            self._write_tiles()

    def use_table(self, views: Sequence[torch.Tensor], host_slot_starts: list[int],
                  slot_ranks: torch.Tensor | None = None) -> None:
        """Read the step's table from views built on the host instead of preparing it: no device op,
        no sync (the engine's path; see punica_kernels.host_tiles).

        Args:
            views: on ``device``, in host_tiles.TABLE_FIELDS order: token_slots [T] int64, sorted_tokens
                [T] int64, slot_starts [max_loras + 2] int64, tile_slots / tile_starts / tile_ends
                [max_tile_count] int32 (HostTileTable.build's arrays after the upload).
            host_slot_starts: slot_starts as host ints (the torch path reads them without a sync).
            slot_ranks: [max_loras] int32 on ``device``, read in place (the adapter slots' ranks: a
                persistent tensor); None: the full padded rank.

        Raises:
            ValueError: views of the wrong number, shape, dtype or device.
        """
        if len(views) != 6:
            raise ValueError(f"use_table needs 6 views (token_slots ... tile_ends), got {len(views)}")
        num_tokens = views[0].shape[0]
        shapes = [(num_tokens,), (num_tokens,), (self.max_loras + 2,)] + [(self.max_tile_count,)] * 3
        dtypes = [torch.int64] * 3 + [torch.int32] * 3
        if slot_ranks is not None:
            views, shapes, dtypes = [*views, slot_ranks], [*shapes, (self.max_loras,)], [*dtypes, torch.int32]
        for view, shape, dtype in zip(views, shapes, dtypes):
            if tuple(view.shape) != shape or view.dtype != dtype or not same_device(view.device, self.device):
                raise ValueError(f"use_table: expected {dtype} {list(shape)} on {self.device}, got "
                                 f"{view.dtype} {list(view.shape)} on {view.device}")
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"batch has {num_tokens} tokens but LoRAMeta was built for "
                             f"max_num_tokens={self.max_num_tokens}")
        self._set_buffers((*views[:6], self._full_ranks if slot_ranks is None else slot_ranks))
        self.num_tokens = num_tokens
        self._host_slot_starts = host_slot_starts
        self._tiles_stale = False

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.token_slots, self.sorted_tokens, self.slot_starts, self._tile_slots, self._tile_starts,
                self._tile_ends, self.slot_ranks)

    def _set_buffers(self, buffers: tuple[torch.Tensor, ...]) -> None:
        (self.token_slots, self.sorted_tokens, self.slot_starts, self._tile_slots, self._tile_starts,
         self._tile_ends, self.slot_ranks) = buffers

    @property
    def tile_slots(self) -> torch.Tensor:
        """[max_tile_count] int32: slot of each tile of the last prepare, -1 = no work."""
        return self._tiles()[0]

    @property
    def tile_starts(self) -> torch.Tensor:
        """[max_tile_count] int32: each tile's first position in ``sorted_tokens``."""
        return self._tiles()[1]

    @property
    def tile_ends(self) -> torch.Tensor:
        """[max_tile_count] int32: one past each tile's last position in ``sorted_tokens``."""
        return self._tiles()[2]

    def _tiles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._tiles_stale:
            self._write_tiles()
        return self._tile_slots, self._tile_starts, self._tile_ends

    def _sort_by_slot(self, token_slots: torch.Tensor) -> None:
        """sorted_tokens and slot_starts of a non-empty batch."""
        num_tokens = token_slots.shape[0]
        slots = self.token_slots[:num_tokens]  # [T]
        slots.copy_(token_slots)
        valid = (slots >= 0) & (slots < self.max_loras)  # [T]
        keys = self._sort_keys[:num_tokens]  # [T]: slot, or max_loras for "no adapter"
        keys.copy_(slots).masked_fill_(~valid, self.max_loras)
        sorted_keys = self._sorted_keys[:num_tokens]  # [T]
        torch.sort(keys, stable=True, out=(sorted_keys, self.sorted_tokens[:num_tokens]))
        torch.searchsorted(sorted_keys, self._slot_ids, out=self.slot_starts)  # [max_loras + 2]

    def _write_tiles(self) -> None:
        """Cut each slot's segment of the sorted order into tiles of at most block_m tokens."""
        starts = self.slot_starts[:-2]  # [L] first sorted position per slot
        ends = self.slot_starts[1:-1]  # [L] one past the last
        tiles_per_slot = (ends - starts + self.block_m - 1) // self.block_m  # [L]
        tiles_end = torch.cumsum(tiles_per_slot, 0)  # [L] one past each slot's last tile
        tile_slot = torch.searchsorted(tiles_end, self._tile_ids, right=True)  # [tiles] in [0, L]
        has_slot = tile_slot < self.max_loras  # [tiles]
        slot = tile_slot.clamp(max=self.max_loras - 1)  # [tiles]
        local = self._tile_ids - (tiles_end - tiles_per_slot)[slot]  # [tiles] tile # in slot
        tile_start = starts[slot] + local * self.block_m  # [tiles]
        tile_end = torch.minimum(tile_start + self.block_m, ends[slot])  # [tiles]
        self._tile_slots.copy_(torch.where(has_slot, tile_slot, -1))
        self._tile_starts.copy_(tile_start)
        self._tile_ends.copy_(torch.where(has_slot, tile_end, tile_start))
        self._tiles_stale = False

    def _write_slot_ranks(self, slot_ranks: torch.Tensor | None, check: bool) -> None:
        own_ranks = self._own_buffers[6]  # never the adapter slots' tensor that use_table may have bound
        if slot_ranks is None:
            own_ranks.fill_(FULL_RANK)
            return
        self._check_tensor("slot_ranks", slot_ranks, 1)
        if slot_ranks.shape[0] != self.max_loras:
            raise ValueError(f"slot_ranks must have shape [max_loras={self.max_loras}], "
                             f"got {list(slot_ranks.shape)}")
        if check and int(slot_ranks.min()) < 0:
            raise ValueError("slot_ranks must be >= 0")
        own_ranks.copy_(slot_ranks)

    def _check_tensor(self, name: str, tensor: torch.Tensor, ndim: int) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim:
            raise ValueError(f"{name} must be a {ndim}-D tensor")
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
        if not same_device(tensor.device, self.device):
            raise ValueError(f"{name} is on {tensor.device} but LoRAMeta is on {self.device}")

    def host_slot_starts(self) -> list[int]:
        """slot_starts of the last prepare as host ints, read once per prepare (a device sync
        off the CPU; only the torch path needs it)."""
        if self._host_slot_starts is None:
            self._host_slot_starts = self.slot_starts.tolist()
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
