"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Phi-3; Mixtral, Qwen3-MoE, Qwen2-MoE and
OLMoE with the sparse-MoE block of lora_runner.model.moe) over a flat batch and a paged KV cache.

Projections sharing an input are packed (q,k,v -> "qkv"; gate,up -> "gate_up") so each layer makes
four LoRA-aware matmuls, each built from the LoRA module it declares (lora_runner.model.lora_linear:
PEFT / checkpoint names, slice sizes, tensor-parallel split); module paths are
``layers.<i>.<parent>.<name>`` with parent "self_attn" or "mlp", and checkpoint tensors are mapped
onto them through those declarations. Phi-3 checkpoints store the packed weights as they are
(qkv_proj, gate_up_proj). What differs per family is a ModelConfig option (lora_runner/model/families.py):
q/k norms (Qwen3), the gate activation, (1 + w) norms, norms around both blocks and attention
soft-capping (Gemma 2); Gemma 2's embedding scale and final soft-capping are in gemma2.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from adapters.sharding import shard_spec, vocab_range
from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.model import cpu_gemm
from lora_runner.model.attention import paged_attention, token_seq_lens, write_kv
from lora_runner.model.config import ModelConfig
from lora_runner.model.forward_context import ForwardContext, LoRAContext, PromptAdapterContext
from lora_runner.model.layers import RMSNorm, RotaryEmbedding
from lora_runner.model.lora_linear import LoRALinear, attention_lora_modules, mlp_lora_modules
from lora_runner.model.moe import SparseMoeBlock
from lora_runner.model.quant.linear import linear_method
from lora_runner.model.vocab_lora import LMHeadLoRAContext, add_embedding_lora, add_lm_head_lora

logger = logging.getLogger(__name__)

_IGNORED_KEYS = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some old checkpoints saved
_NORM_KEY = re.compile(r"layers\.\d+\.((input|post_attention|pre_feedforward|post_feedforward)_layernorm"
                       r"|self_attn\.[qk]_norm)\.weight")
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def make_norm(config: ModelConfig, size: int, dtype: torch.dtype, device) -> RMSNorm:
    """The family's RMSNorm over `size` features ((1 + w) for Gemma)."""
    return RMSNorm(size, config.rms_norm_eps, dtype, device, unit_offset=config.norm_unit_offset)


def check_attention_split(config: ModelConfig, world_size: int) -> None:
    """ValueError when this family's attention cannot be split over ``world_size`` ranks: OLMoE's q / k
    norms span every head (the engine checks before any rank starts; each rank's layers again)."""
    if config.qk_norm_whole and world_size > 1:
        raise ValueError(f"{config.architecture} normalises q and k over every head together (q_norm / k_norm "
                         "over the whole projection), which is not split over tensor-parallel ranks: serve it "
                         "with tensor_parallel_size=1")


class Attention(nn.Module):
    """Self-attention of one layer: packed qkv, RoPE, paged KV write + attention, o projection.

    Over several ranks (``tp``) this rank holds its share of the query and KV heads (qkv
    column-parallel) and o row-parallel, reduced over ``tp`` (attention_lora_modules)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device, tp: TensorParallel = SINGLE):
        super().__init__()
        method, (qkv, o) = linear_method(config.quantization), attention_lora_modules(config, layer)
        self.qkv = LoRALinear(qkv, config.qkv_bias, dtype, device, method, tp)
        self.o = LoRALinear(o, config.o_bias, dtype, device, method, tp)
        self.head_dim = config.head_dim
        self.num_heads, kv_rows = self.qkv.slice_sizes[0] // self.head_dim, self.qkv.slice_sizes[1]
        self.num_kv_heads = kv_rows // self.head_dim
        check_attention_split(config, tp.world_size)
        if config.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE; OLMoE: over the whole projection
            whole = config.qk_norm_whole
            self.q_norm = make_norm(config, self.qkv.slice_sizes[0] if whole else self.head_dim, dtype, device)
            self.k_norm = make_norm(config, self.qkv.slice_sizes[1] if whole else self.head_dim, dtype, device)
        self.qk_norm, self.qk_norm_whole, self.clip_qkv = config.qk_norm, config.qk_norm_whole, config.clip_qkv
        self.layer = layer
        self.scale = config.attn_scale
        self.softcap = config.attn_logit_softcap
        self.sliding_window = config.sliding_window(layer)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden, ctx.lora).split(self.qkv.slice_sizes, dim=-1)  # [T, H*D], [T, Hkv*D] x2
        if self.qk_norm_whole:  # OLMoE: one norm over all heads of q, one over k
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = RotaryEmbedding.apply(q, cos, sin)  # [T, H, D]
        k = RotaryEmbedding.apply(k, cos, sin)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        kv_layer = ctx.kv_cache[self.layer]  # [2, num_blocks, block_size, Hkv, D]
        write_kv(kv_layer, k, v, ctx.attn.slot_mapping)
        out = paged_attention(q, kv_layer, ctx.attn, self.scale, self.sliding_window,
                              softcap=self.softcap)  # [T, H, D]
        return self.o(out.reshape(num_tokens, self.num_heads * self.head_dim), ctx.lora)  # [T, hidden]


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)) with gate/up packed; act is silu (SwiGLU) or
    tanh-approximated GELU (Gemma's GeGLU). Over several ranks: gate_up column-parallel (this rank's
    intermediate rows of each), down row-parallel, reduced over ``tp`` (mlp_lora_modules)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device, tp: TensorParallel = SINGLE):
        super().__init__()
        method, (gate_up, down) = linear_method(config.quantization), mlp_lora_modules(config, layer)
        self.gate_up = LoRALinear(gate_up, config.mlp_bias, dtype, device, method, tp)
        self.down = LoRALinear(down, config.mlp_bias, dtype, device, method, tp)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate, up = self.gate_up(hidden, ctx.lora).chunk(2, dim=-1)  # [T, I] each
        return self.down(self.act(gate) * up, ctx.lora)  # [T, hidden]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)).

    With sandwich norms (Gemma 2) each block's output is normed too: x + post_attention_norm(attn(
    input_norm(x))), then + post_feedforward_norm(mlp(pre_feedforward_norm(.))).
    """

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size, dtype, device)
        self.self_attn = Attention(config, layer, dtype, device, tp)
        self.post_attention_layernorm = make_norm(config, config.hidden_size, dtype, device)
        mlp = SparseMoeBlock if layer in config.moe_layers else MLP  # MoE families: lora_runner.model.moe
        self.mlp = mlp(config, layer, dtype, device, tp)
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size, dtype, device)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.sandwich_norms:
            attended = self.self_attn(self.input_layernorm(hidden), cos, sin, ctx)  # [T, hidden]
            hidden = hidden + self.post_attention_layernorm(attended)
            mixed = self.mlp(self.pre_feedforward_layernorm(hidden), ctx)  # [T, hidden]
            return hidden + self.post_feedforward_layernorm(mixed)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, ctx)  # [T, hidden]
        return hidden + self.mlp(self.post_attention_layernorm(hidden), ctx)  # [T, hidden]


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head for Llama, Mistral, Qwen2, Qwen3 and Phi-3 checkpoints (one class; config picks
    the options; Gemma 2 subclasses it in gemma2.py).

    ``model(input_ids [T], positions [T], ctx) -> hidden [T, hidden]`` for a flat batch of mixed
    prefill chunks and decodes; ``compute_logits(hidden [S, hidden]) -> [S, vocab]`` float32.
    Weights are allocated uninitialized; fill them with :meth:`load_weights`.

    ``tp``: this process's rank of a tensor-parallel group; the model is then that rank's shard
    (adapters.sharding): column-parallel qkv / gate_up, row-parallel o / down (one all-reduce each),
    the embedding and lm_head split over the vocabulary (padded to a multiple of the ranks: V_w rows
    here). The embedding all-reduces its masked lookup (+ LoRA); compute_logits all-gathers the
    logits and drops the padding, so every rank sees the same [S, vocab] logits. ``config`` stays the
    whole model's; ``spec`` is the rank's sizes.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = config, tp
        self.spec = shard_spec(config.spec(), tp.rank, tp.world_size)  # ValueError for an impossible split
        self.vocab_start, self.vocab_end = vocab_range(config.vocab_size, tp.rank, tp.world_size)
        vocab = self.spec.vocab_size  # this rank's rows (all of them at one rank)
        self.embed_tokens = nn.Parameter(torch.empty(vocab, config.hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)  # [V_w, hidden]
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device, tp) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size, dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope, device)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings else
                        nn.Parameter(torch.empty(vocab, config.hidden_size, dtype=dtype, device=device),
                                     requires_grad=False))  # [V_w, hidden]
        self.lm_head_packed: torch.Tensor | None = None  # lm_head in oneDNN's layout (after_loading, CPU)
        # checkpoint prefix ("model.layers.0.self_attn.q_proj") -> (linear's path, slice index or None)
        self._checkpoint_names = {prefix: (path, index) for path, module in self.named_modules()
                                  if isinstance(module, LoRALinear) for prefix, index in module.checkpoint_slices()}

    def after_loading(self) -> None:
        """Once the weights are in: each linear converts its weight for this device's GEMM (float32 on
        CPU: oneDNN's packed layout, lora_runner.model.cpu_gemm), the LM head too. An untied head then
        lives only packed; a tied one keeps its dense rows for the embedding lookup as well."""
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.method.after_loading(module)
        if self.lm_head_packed is None and cpu_gemm.packable(self.lm_head):
            self.lm_head_packed = cpu_gemm.pack(self.lm_head)
            if self.lm_head is not self.embed_tokens:
                self.lm_head = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def embed(self, input_ids: torch.Tensor, prompt_adapter: PromptAdapterContext | None,
              lora: LoRAContext | None = None) -> torch.Tensor:
        """Token embeddings [T, hidden] plus each token's embedding LoRA delta (lora_runner.model.vocab_lora);
        soft-prompt rows then replace placeholder tokens' embeddings (PEFT never embeds virtual tokens).
        Over several ranks each looks up (and adds the LoRA of) the tokens of its vocabulary rows, zeros
        for the others, and one all-reduce sums them, before the (replicated) soft prompts."""
        if self.tp.is_parallel:
            hidden = self._vocab_parallel_embed(input_ids, lora)  # [T, hidden]
        else:
            hidden = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
            if lora is not None and lora.vocab is not None:
                add_embedding_lora(hidden, input_ids, lora)
        if prompt_adapter is None:
            return hidden
        slots, rows = prompt_adapter.token_slots, prompt_adapter.token_positions  # [T], [T]
        soft = prompt_adapter.embeddings[slots.clamp(min=0), rows.clamp(min=0)].to(hidden.dtype)  # [T, hidden]
        return torch.where((slots >= 0)[:, None], soft, hidden)

    def _vocab_parallel_embed(self, input_ids: torch.Tensor, lora: LoRAContext | None) -> torch.Tensor:
        """The embeddings [T, hidden] summed over the ranks, each adding its vocabulary rows' share."""
        local_ids = input_ids - self.vocab_start  # [T]
        mine = (local_ids >= 0) & (local_ids < self.embed_tokens.shape[0])  # [T]
        local_ids = torch.where(mine, local_ids, 0)
        hidden = F.embedding(local_ids, self.embed_tokens).masked_fill_(~mine[:, None], 0)  # [T, hidden]
        if lora is not None and lora.vocab is not None:
            add_embedding_lora(hidden, local_ids, lora, token_mask=mine)
        return self.tp.all_reduce(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of a flat batch; writes this step's K/V into ctx.kv_cache."""
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                             "must both be [T]")
        hidden = self.embed(input_ids, ctx.prompt_adapter, ctx.lora)  # [T, hidden]
        per_sequence = self.config.rope.rope_type in RotaryEmbedding.PER_SEQUENCE_TYPES
        seq_lens = token_seq_lens(ctx.attn, input_ids.shape[0]) if per_sequence else None
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, seq_lens)  # [T, D] each
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, ctx)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, lm_head_lora: LMHeadLoRAContext | None = None) -> torch.Tensor:
        """Logits [S, vocab] float32 of the rows to sample, hidden [S, hidden]; lm_head_lora: the
        lm_head LoRA over these rows (lora_runner.model.vocab_lora.LMHeadLoRA), None for none. Over
        several ranks: this rank's vocabulary rows (its lm_head LoRA B rows too), then one all-gather."""
        logits = cpu_gemm.matmul(hidden, self.lm_head, self.lm_head_packed)  # [S, V_w]
        if lm_head_lora is not None:
            add_lm_head_lora(logits, hidden, lm_head_lora)
        if self.tp.is_parallel:
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.config.vocab_size]  # [S, V], padding dropped
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors into the packed parameters; a quantized linear's tensors
        (``q_proj.weight`` + ``weight_scale``, ``qweight`` / ``scales`` / ..., see lora_runner.model.quant)
        are collected per slice and converted by its method once the slices are all there.
        ValueError on missing, misshapen or unexpectedly quantized tensors."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, int]] = set()
        ignored: list[str] = []
        pending: dict[str, dict[int | None, tuple[str, dict[str, torch.Tensor]]]] = {}  # module -> slices
        for name, tensor in weights:
            target = self._map_name(name)
            module = self._quantized_module(target)
            if module is not None:
                path, suffix = target[0].rsplit(".", 1)
                if suffix not in (*module.method.suffixes, *module.method.optional_suffixes):
                    ignored.append(name)
                    continue
                prefix = name[:-len(suffix) - 1]
                pending.setdefault(path, {}).setdefault(target[1], (prefix, {}))[1][suffix] = tensor
                if self._slices_complete(module, pending[path], optional=True):
                    loaded |= self._load_quantized(path, pending.pop(path))
                continue
            if target is None or target[0] not in params:
                ignored.append(name)
                continue
            param_name, index = target
            dst = params[param_name]
            if index is not None:
                module = self.get_submodule(param_name.rsplit(".", 1)[0])
                dst = dst.narrow(0, module.slice_offsets()[index], module.slice_sizes[index])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)} (config.json does not match the weights)")
            if not tensor.is_floating_point() or tensor.element_size() == 1:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}: a quantized weight, but config.json "
                                 "has no quantization_config saying how to read it (or it is an MoE router or "
                                 "shared expert gate, read unquantized under any)")
            dst.copy_(tensor)
            loaded |= self._weight_keys(param_name, index)
        for path, slices in pending.items():  # slices still waiting for optional tensors (g_idx), or short of some
            if self._slices_complete(self.get_submodule(path), slices, optional=False):
                loaded |= self._load_quantized(path, slices)
            else:
                self._raise_if_partial(path, slices)
        missing = sorted(self._required_weights() - loaded)
        if missing:
            shown = ", ".join(f"{p}[slice {i}]" if i >= 0 else p for p, i in missing[:8])
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")
        unexpected = [n for n in ignored if not _IGNORED_KEYS.match(n)]
        if unexpected:
            logger.warning("ignored %d checkpoint tensor(s) the model has no place for: %s", len(unexpected),
                           ", ".join(unexpected[:8]))

    def _quantized_module(self, target: tuple[str, int | None] | None) -> LoRALinear | None:
        """The quantized linear a mapped checkpoint tensor (not its bias) belongs to, else None."""
        if target is None or "." not in target[0]:
            return None
        path, suffix = target[0].rsplit(".", 1)
        try:
            module = self.get_submodule(path)
        except AttributeError:
            return None
        if not isinstance(module, LoRALinear) or not module.method.quantized or suffix == "bias":
            return None
        return module

    @staticmethod
    def _slices_complete(module: LoRALinear, slices: dict, optional: bool) -> bool:
        """Every slice of the module (or the one fused tensor) is there with its required (and, if
        `optional`, its optional) tensors."""
        wanted = set(module.method.suffixes) | (set(module.method.optional_suffixes) if optional else set())
        indices = [None] if None in slices else list(range(len(module.slice_sizes)))
        return all(i in slices and wanted <= set(slices[i][1]) for i in indices)

    def _raise_if_partial(self, path: str, slices: dict) -> None:
        """ValueError naming the first tensor a present slice lacks (a slice absent altogether is
        reported with the other missing weights)."""
        module = self.get_submodule(path)
        for prefix, tensors in slices.values():
            lacking = [s for s in module.method.suffixes if s not in tensors]
            if lacking:
                raise ValueError(f"checkpoint lacks {prefix}.{lacking[0]} (quantization_config needs "
                                 f"{', '.join(module.method.suffixes)} for every quantized linear)")

    def _load_quantized(self, path: str, slices: dict) -> set[tuple[str, int]]:
        """Convert one quantized linear's slices into its tensors; the (parameter, slice) keys it fills."""
        module = self.get_submodule(path)
        self._raise_if_partial(path, slices)
        if None in slices:
            prefix, tensors = slices[None]
            parts = [(prefix, tensors, module.out_features)]
        else:
            parts = [(*slices[i], size) for i, size in enumerate(module.slice_sizes)]
        module.method.load(module, parts)
        return self._weight_keys(f"{path}.weight", None)

    def _map_name(self, name: str) -> tuple[str, int | None] | None:
        """transformers tensor name -> (our parameter name, slice index within a packed weight or None)."""
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else ("lm_head", None)
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if name == "norm.weight":
            return "norm.weight", None
        if _NORM_KEY.fullmatch(name):
            return name, None
        prefix, _, kind = f"model.{name}".rpartition(".")  # a linear's tensors: weight, bias, qweight, scales, ...
        if prefix not in self._checkpoint_names:
            return None
        path, index = self._checkpoint_names[prefix]
        return f"{path}.{kind}", index

    def _weight_keys(self, param_name: str, index: int | None) -> set[tuple[str, int]]:
        """(parameter, slice) keys a loaded tensor fills: one slice, or every slice of the parameter
        (-1 for an unpacked one)."""
        if index is not None:
            return {(param_name, index)}
        owner = self.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else self
        slices = len(owner.slice_sizes) if isinstance(owner, LoRALinear) else 1
        return {(param_name, i if slices > 1 else -1) for i in range(slices)}

    def _required_weights(self) -> set[tuple[str, int]]:
        required = set()
        for name, param in self.named_parameters(remove_duplicate=False):
            if name == "lm_head" and self.config.tie_word_embeddings:
                continue
            required |= self._weight_keys(name, None)
        for name, module in self.named_modules():
            if isinstance(module, LoRALinear) and module.method.quantized:  # its weight is buffers, not a parameter
                required |= self._weight_keys(f"{name}.weight", None)
        return required
