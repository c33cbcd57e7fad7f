"""Host->device upload of a step's int arrays: packed into one pinned staging buffer, one copy.

Two staging buffers alternate (vLLM v1's double buffering): a step packs into the buffer the step
before last used, whose copy has normally finished long ago, so the host waits (on that buffer's
CUDA event) only when it runs two steps ahead of the device. The arrays are packed back to back at
16-byte-aligned offsets in the order given, and the device buffer holds the same layout, so a
step's device views are slices of one device tensor. The layout depends only on the arrays' sizes
and dtypes in order: two uploads of equal shapes (every replay of one decode graph) get the same
device addresses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes; covers every dtype's alignment
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def packed_bytes(nbytes: Sequence[int]) -> int:
    """Bytes the packed layout of arrays of these byte sizes takes."""
    return sum(_aligned(n) for n in nbytes)


class StagedUpload:
    """Two-deep packed staging (pinned on CUDA) and its device mirror; one copy per upload.

    Args:
        max_bytes: the largest packed upload (packed_bytes of the largest step's arrays).
        device: where the arrays go; a CPU device keeps the same plumbing (tests) without pinning.
        stages: staging buffers in rotation.
    """

    def __init__(self, max_bytes: int, device: torch.device, stages: int = 2) -> None:
        on_cuda = device.type == "cuda"
        self._staging = [torch.zeros(max_bytes, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(stages)]
        self._staging_np = [t.numpy() for t in self._staging]
        self.device_bytes = torch.zeros(max_bytes, dtype=torch.uint8, device=device)
        # recorded after each stage's copy; the stage is packed again only once its event has passed
        self._copied = [torch.cuda.Event() if on_cuda else None for _ in range(stages)]
        self._device = device
        self.stage = 0  # the staging buffer the last upload packed
        self.num_uploads = 0

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Pack `arrays` (C-contiguous int32/int64) into the next staging buffer, queue one
        non-blocking copy, and return their device views (same shapes and dtypes), valid until the
        next upload's copy runs on the stream."""
        self.stage = (self.stage + 1) % len(self._staging)
        copied = self._copied[self.stage]
        if copied is not None:
            copied.synchronize()  # queued two uploads ago: the device is rarely that far behind
        host = self._staging_np[self.stage]
        offsets = np.cumsum([0] + [_aligned(array.nbytes) for array in arrays]).tolist()
        end = offsets.pop()
        if end > host.shape[0]:
            raise ValueError(f"upload of {end} bytes exceeds the staging buffers ({host.shape[0]})")
        for offset, array in zip(offsets, arrays):
            host[offset:offset + array.nbytes].view(array.dtype)[:] = array.reshape(-1)
        self.device_bytes[:end].copy_(self._staging[self.stage][:end], non_blocking=True)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self._device))
        self.num_uploads += 1
        return [self.device_bytes[offset:offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
                for offset, array in zip(offsets, arrays)]
