"""Public batched-LoRA ops: argument validation and backend dispatch (Triton or torch).

``backend="auto"`` runs Triton on CUDA tensors and torch elsewhere (the CPU serving path);
``"triton"`` on CPU tensors runs the Triton interpreter (slow; for tests); ``"torch"`` runs the
vectorized torch implementation anywhere (it syncs off the CPU, see reference.py). The Triton
kernels take fp16, bf16 and fp32; "auto" sends float64 (the oracle dtype) to torch.
Validation reads shapes, dtypes and devices only: no host sync, no allocation.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import invariant, reference
from .meta import LoRAMeta, same_device
from .scales import Scales

logger = logging.getLogger(__name__)

try:
    from . import triton_ops
except ImportError as error:  # triton is Linux-only; the torch path must work without it
    triton_ops = None
    _TRITON_IMPORT_ERROR: ImportError | None = error
else:
    _TRITON_IMPORT_ERROR = None

BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def triton_available() -> bool:
    """True when the Triton kernels imported (backend="triton" works; CUDA graphs can capture
    LoRA). When False, :func:`triton_import_error` says why."""
    return triton_ops is not None


def triton_import_error() -> ImportError | None:
    """The ImportError that made Triton unavailable, or None."""
    return _TRITON_IMPORT_ERROR


class BackendUnavailableError(RuntimeError):
    """backend="triton" was asked for but Triton cannot be imported here."""


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoRAMeta, slice_sizes, *, slice_scales: torch.Tensor | None = None,
             column_scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             backend: str = "auto") -> torch.Tensor:
    """Add every token's own adapter delta to a layer output, in place.

    Semantics: y[t, off_j:off_j+N_j] += (x[t] @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T
    for s = token_slots[t] >= 0 (the meta's table); rows of slot -1 tokens stay
    bit-identical. off_j = sum(slice_sizes[:j]). With scales (all optional), for cols_j the
    columns of slice j and c = column_scales[s, cols_j]:
    y[t, cols_j] = c * y[t, cols_j] + (1 - c) * bias[cols_j]
                   + c * slice_scales[s, j] * (x[t] @ lora_a[s, j].T) @ lora_b[s, cols_j].T
    (LoRA scaling on the fp32 intermediate; DoRA's column scale, which leaves the bias unscaled;
    see :mod:`punica_kernels.scales`).

    Args:
        y: [T, N] layer output, updated in place; N = sum(slice_sizes).
        x: [T, K] layer input, y's dtype (float16, bfloat16, float32; float64 on torch only).
        lora_a: [max_loras, n_slices, R, K] slot weights, zero-padded to the max rank R.
        lora_b: [max_loras, N, R] slot weights.
        meta: holding this batch's table (``meta.num_tokens == T``).
        slice_sizes: output widths of the n_slices slices (q,k,v -> 3 widths).
        slice_scales: [max_loras, n_slices] float32 (or float64 with float64 y) or None (ones).
        column_scales: [max_loras, N], dtype as slice_scales, or None (ones).
        bias: [N] in y's dtype, the bias already inside y; read only with column_scales.
        backend: "auto", "triton" or "torch".

    Returns y. The Triton path allocates nothing once the meta's workspace is large enough
    (see LoRAMeta) and never syncs with the host, so it can be captured in a CUDA graph: run
    each layer shape once eagerly before capture (that compiles the kernels and caches the
    slice offsets), then load the meta's table outside the graph (into the same buffers) before every replay.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, or a meta without a table.
        BackendUnavailableError: backend="triton" without an importable Triton.
    """
    slice_sizes = _check_slice_sizes(slice_sizes)
    _check_x_and_a(x, lora_a, meta, len(slice_sizes))
    _check_y_and_b(y, lora_b, meta, slice_sizes, rank=lora_a.shape[2], dtype=x.dtype)
    scales = _checked_scales(y, meta, len(slice_sizes), slice_scales, column_scales, bias)
    if _resolve(backend, x) == "torch":
        if invariant.enabled():  # the batch-invariant mode (punica_kernels.invariant): per-row fixed shapes
            return invariant.add_lora(y, x, lora_a, lora_b, meta, slice_sizes, scales)
        return reference.add_lora(y, x, lora_a, lora_b, meta, slice_sizes, scales)
    # the batch-invariant mode keeps the shrink's K whole (its split count would follow T)
    return triton_ops.add_lora(y, x, lora_a, lora_b, meta, slice_sizes, scales, unsplit=invariant.enabled())


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """First half of :func:`add_lora`: project each token onto its adapter's A matrices.

    Semantics: out[t, j] = x[t] @ lora_a[s, j].T for s = token_slots[t] >= 0.

    Args:
        x: [T, K]; lora_a: [max_loras, n_slices, R, K] in x's dtype.
        out: [T, n_slices, R] float32 (float64 when x is float64); allocated when None.
            Rows of tokens with slot -1 are not written.

    Returns out. Raises ValueError / BackendUnavailableError as :func:`add_lora`.
    """
    _check_x_and_a(x, lora_a, meta, n_slices=None)
    run_on = _resolve(backend, x)
    _, n_slices, rank, _ = lora_a.shape
    if out is None:
        out = x.new_empty((x.shape[0], n_slices, rank), dtype=reference.compute_dtype(x.dtype))
    _check_inter(out, x.shape[0], n_slices, rank, x.dtype, meta)
    if run_on == "torch":
        if invariant.enabled():
            return invariant.lora_shrink(x, lora_a, meta, out)
        return reference.lora_shrink(x, lora_a, meta, out)
    return triton_ops.lora_shrink(x, lora_a, meta, out)


def lora_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_sizes, *, slice_scales: torch.Tensor | None = None,
                column_scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                backend: str = "auto") -> torch.Tensor:
    """Second half of :func:`add_lora`: add each token's intermediate times its adapter's B.

    Semantics: y[t, off_j:off_j+N_j] += inter[t, j] @ lora_b[s, off_j:off_j+N_j].T for
    s = token_slots[t] >= 0; rows of slot -1 tokens stay bit-identical. The scales apply as in
    :func:`add_lora`, with inter[t, j] in place of x[t] @ lora_a[s, j].T.

    Args:
        y: [T, N] in place, N = sum(slice_sizes); lora_b: [max_loras, N, R] in y's dtype.
        inter: [T, n_slices, R] float32 (float64 with float64 y), e.g. from lora_shrink.
        slice_scales, column_scales, bias: as in :func:`add_lora`.

    Returns y. Raises ValueError / BackendUnavailableError as :func:`add_lora`.
    """
    slice_sizes = _check_slice_sizes(slice_sizes)
    if not isinstance(inter, torch.Tensor) or inter.dim() != 3:
        raise ValueError("inter must be a 3-D tensor [T, n_slices, R]")
    _check_y_and_b(y, lora_b, meta, slice_sizes, rank=inter.shape[2], dtype=None)
    _check_inter(inter, y.shape[0], len(slice_sizes), inter.shape[2], y.dtype, meta)
    scales = _checked_scales(y, meta, len(slice_sizes), slice_scales, column_scales, bias)
    if _resolve(backend, y) == "torch":
        if invariant.enabled():
            return invariant.lora_expand(y, inter, lora_b, meta, slice_sizes, scales)
        return reference.lora_expand(y, inter, lora_b, meta, slice_sizes, scales)
    return triton_ops.lora_expand(y, inter, lora_b, meta, slice_sizes, scales)


def _resolve(backend: str, tensor: torch.Tensor) -> str:
    """The backend that runs: "triton" or "torch"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if tensor.device.type != "cuda" or tensor.dtype == torch.float64:
            return "torch"
        if triton_ops is None:
            _warn_triton_missing()
            return "torch"
        return "triton"
    if backend == "triton":
        if triton_ops is None:
            raise BackendUnavailableError(
                f'backend="triton" needs the triton package, which failed to import: '
                f'{_TRITON_IMPORT_ERROR}. Use backend="torch" or "auto".')
        if tensor.dtype == torch.float64:
            raise ValueError('backend="triton" does not support float64; use backend="torch"')
        if tensor.device.type == "cpu" and tensor.dtype == torch.bfloat16:
            raise ValueError("the Triton interpreter (CPU tensors) has no bfloat16; "
                             'use float16/float32 or backend="torch"')
    return backend


@functools.cache
def _warn_triton_missing() -> None:
    logger.warning("Triton is not importable (%s); LoRA runs on the torch path, which syncs "
                   "with the host and cannot be captured in CUDA graphs", _TRITON_IMPORT_ERROR)


def _check_slice_sizes(slice_sizes) -> tuple[int, ...]:
    sizes = tuple(slice_sizes)
    if not sizes or not all(isinstance(size, int) and size > 0 for size in sizes):
        raise ValueError(f"slice_sizes must be a non-empty sequence of positive ints, got {slice_sizes!r}")
    return sizes


def _check_prepared(meta: LoRAMeta, num_tokens: int, name: str) -> None:
    if not isinstance(meta, LoRAMeta):
        raise ValueError(f"meta must be a LoRAMeta, got {type(meta).__name__}")
    if meta.num_tokens is None:
        raise ValueError("the meta has no table: load one (punica_kernels.load_table, or LoRAMeta.use_table) "
                         "before the LoRA ops")
    if num_tokens != meta.num_tokens:
        raise ValueError(f"{name} has {num_tokens} rows but the meta's table is for "
                         f"{meta.num_tokens} tokens")


def _check_tensor(name: str, tensor, ndim: int, dtype: torch.dtype | None, meta: LoRAMeta) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor")
    if dtype is None and tensor.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {tensor.dtype}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if not same_device(tensor.device, meta.device):
        raise ValueError(f"{name} is on {tensor.device} but meta is on {meta.device}")


def _check_x_and_a(x, lora_a, meta: LoRAMeta, n_slices: int | None) -> None:
    """n_slices None: any slice count (lora_shrink takes it from lora_a)."""
    _check_tensor("x", x, 2, None, meta)
    _check_prepared(meta, x.shape[0], "x")
    _check_tensor("lora_a", lora_a, 4, x.dtype, meta)
    loras, slices, rank, num_features = lora_a.shape
    n_slices = slices if n_slices is None else n_slices
    if (loras, slices, num_features) != (meta.max_loras, n_slices, x.shape[1]) or rank < 1:
        raise ValueError(f"lora_a must be [max_loras={meta.max_loras}, n_slices={n_slices}, R>=1, "
                         f"K={x.shape[1]}], got {list(lora_a.shape)}")


def _check_y_and_b(y, lora_b, meta: LoRAMeta, slice_sizes: tuple[int, ...], rank: int,
                   dtype: torch.dtype | None) -> None:
    """dtype: what y must be (x's dtype), or None for any float dtype; lora_b matches y."""
    _check_tensor("y", y, 2, dtype, meta)
    _check_prepared(meta, y.shape[0], "y")
    if y.shape[1] != sum(slice_sizes):
        raise ValueError(f"y has {y.shape[1]} columns but slice_sizes {slice_sizes} sum to "
                         f"{sum(slice_sizes)}")
    _check_tensor("lora_b", lora_b, 3, y.dtype, meta)
    if tuple(lora_b.shape) != (meta.max_loras, y.shape[1], rank):
        raise ValueError(f"lora_b must be [max_loras={meta.max_loras}, N={y.shape[1]}, R={rank}], "
                         f"got {list(lora_b.shape)}")


def _check_inter(inter, num_tokens: int, n_slices: int, rank: int, dtype: torch.dtype,
                 meta: LoRAMeta) -> None:
    _check_tensor("inter", inter, 3, reference.compute_dtype(dtype), meta)
    if tuple(inter.shape) != (num_tokens, n_slices, rank):
        raise ValueError(f"inter must be [T={num_tokens}, n_slices={n_slices}, R={rank}], "
                         f"got {list(inter.shape)}")


def _checked_scales(y, meta: LoRAMeta, n_slices: int, slice_scales, column_scales, bias) -> Scales:
    """Scales are float32 (float64 also with float64 y, on the torch path)."""
    for name, tensor, width in (("slice_scales", slice_scales, n_slices), ("column_scales", column_scales, y.shape[1])):
        if tensor is None:
            continue
        _check_tensor(name, tensor, 2, None, meta)
        if tensor.dtype not in (torch.float32, reference.compute_dtype(y.dtype)):
            raise ValueError(f"{name} must be float32, got {tensor.dtype}")
        if tuple(tensor.shape) != (meta.max_loras, width):
            raise ValueError(f"{name} must be [max_loras={meta.max_loras}, {width}], got {list(tensor.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, 1, y.dtype, meta)
        if bias.shape[0] != y.shape[1]:
            raise ValueError(f"bias must be [N={y.shape[1]}], got {list(bias.shape)}")
    return Scales(slice_scales, column_scales, bias)
