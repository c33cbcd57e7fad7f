"""Reference mixture-of-experts math, a plain loop over tokens and their experts: the oracle of the fused
MoE kernels (punica_kernels.moe_triton), run in float64 by the tests.

Same layouts as moe_triton (w_gate_up [E, 2I, H], w_down [E, H, I], lora_a [L, E, n, R, K], lora_b
[L, E, N, R], slice_scales [L, E, n]); every operand is cast to ``dtype`` first, so rank padding and
empty slots contribute exact zeros, as in the slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) as transformers' MoE routers: softmax in float32,
    top-k, the k probabilities renormalised to sum 1 when ``renormalize``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _lora_delta(x: torch.Tensor, factors: tuple, slot: int, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One token's delta of one expert projection: concat_j scale_j * (x @ A_j.T) @ B_j.T."""
    lora_a, lora_b, slice_scales = factors
    n_slices = lora_a.shape[2]
    width = lora_b.shape[2] // n_slices
    parts = []
    for j in range(n_slices):
        a = lora_a[slot, expert, j].to(dtype)  # [R, K]
        b = lora_b[slot, expert, j * width:(j + 1) * width].to(dtype)  # [W, R]
        parts.append(slice_scales[slot, expert, j].to(dtype) * (x @ a.T) @ b.T)
    return torch.cat(parts)


def reference_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, lora: tuple | None = None, dtype: torch.dtype = torch.float64,
                  stored: torch.dtype | None = None) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j], each projection
    plus the token's LoRA delta (``lora`` as punica_kernels.moe_triton.fused_moe takes it), in ``dtype``.

    ``stored``: the model dtype the kernels keep their intermediates in (gate_up's output, the SiLU product,
    each weighted expert output): rounded to it there, so a half-precision run is compared with the rounding
    it cannot avoid and not more."""
    num_tokens, top_k = topk_ids.shape
    intermediate = w_down.shape[2]
    out = torch.zeros(num_tokens, w_down.shape[1], dtype=dtype)
    rounded = (lambda v: v) if stored is None else (lambda v: v.to(stored).to(dtype))  # noqa: E731
    for t in range(num_tokens):
        xt = x[t].to(dtype)
        slot = -1 if lora is None else int(lora[0][t])
        for j in range(top_k):
            e = int(topk_ids[t, j])
            gate_up = w_gate_up[e].to(dtype) @ xt  # [2I]
            if slot >= 0:
                gate_up = gate_up + _lora_delta(xt, lora[2], slot, e, dtype)
            gate_up = rounded(gate_up)
            hidden = rounded(F.silu(gate_up[:intermediate]) * gate_up[intermediate:])  # [I]
            y = w_down[e].to(dtype) @ hidden  # [H]
            if slot >= 0:
                y = y + _lora_delta(hidden, lora[3], slot, e, dtype)
            out[t] += rounded(topk_weights[t, j].to(dtype) * y)
    return out


def per_expert_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """The base MoE as a torch loop over the experts hit (one GEMM per projection per expert, as
    lora_runner.model.moe's CPU path): the baseline the fused kernels are benchmarked against."""
    out = torch.zeros_like(x)
    intermediate = w_down.shape[2]
    for expert in topk_ids.unique().tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate_up = x[token_idx] @ w_gate_up[expert].T
        hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = hidden @ w_down[expert].T
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, k_pos, None]).to(out.dtype))
    return out
