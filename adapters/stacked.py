"""PEFT ``target_parameters`` LoRA on stacked parameters, rewritten as the per-module LoRA it equals.

A layer may hold several LoRA modules as entries of one stacked parameter (a mixture of experts'
``mlp.experts.gate_up_proj`` [E, N, K]); such a module says so in its descriptor
(``LoRAModule.stacked``: parameter path, entry, entries). PEFT (0.17+) trains LoRA on the whole
parameter with ``target_parameters``, storing ``lora_A`` [E * r, K] (entry e: rows e*r..(e+1)*r) and
``lora_B`` [N, E * r] (entry e: columns e, E + e, 2E + e, ...: PEFT reshapes it to [N, r, E]), so
entry e's delta is ``scaling * x @ A_e.T @ B_e.T``: exactly a LoRA of rank r on module e. Its keys
name the parameter's owner module, once per wrapped parameter, nested as PEFT wraps them
(``experts.lora_A``, ``experts.base_layer.lora_A``, ...): which parameter each pair belongs to is
told by its shapes. :func:`unstack_parameters` rewrites such an adapter into per-module keys and
target_modules, so the rest of adapters.lora reads it as any other.
"""

from __future__ import annotations

import re

import torch

from adapters.errors import InvalidAdapterError, UnsupportedAdapterError
from adapters.spec import LoRAModule, ModelSpec

_WRAPPED_KEY = re.compile(r"base_model\.model\.(?P<owner>.+?)(?P<depth>(?:\.base_layer)*)\.(?P<ab>lora_A|lora_B)"
                          r"(?:\.default)?\.weight")


def _stacked_parameters(spec: ModelSpec) -> dict[str, list[LoRAModule]]:
    """Stacked parameter path -> its entries' modules, in entry order."""
    stacked: dict[str, list] = {}
    for module in spec.modules:
        if module.stacked is not None:
            path, entry, entries = module.stacked
            stacked.setdefault(path, [None] * entries)[entry] = module
    return stacked


def _targeted_parameters(name: str, config: dict, spec: ModelSpec) -> dict[str, list[LoRAModule]]:
    """The stacked parameters ``target_parameters`` names (PEFT's suffix match); UnsupportedAdapterError
    for a name matching none of this model's, or a rank / alpha pattern (not mapped onto entries)."""
    stacked, wanted = _stacked_parameters(spec), config.get("target_parameters") or []
    if not isinstance(wanted, list) or not all(isinstance(p, str) for p in wanted):
        raise InvalidAdapterError(f"adapter {name!r}: target_parameters must be a list of names, got {wanted!r}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise UnsupportedAdapterError(f"adapter {name!r}: rank_pattern / alpha_pattern with target_parameters is "
                                      "not supported")
    targeted = {}
    for suffix in wanted:
        matched = {p: m for p, m in stacked.items() if p == suffix or p.endswith("." + suffix)}
        if not matched:
            known = sorted({re.sub(r"\.\d+\.", ".N.", p, count=1) for p in stacked}) or ["none in this model"]
            raise UnsupportedAdapterError(f"adapter {name!r}: target_parameters {suffix!r} names no stacked "
                                          f"parameter LoRA is served on; supported: {', '.join(known)}")
        targeted.update(matched)
    return targeted


def _escaped(path: str) -> str:
    return re.sub(r"([^A-Za-z0-9_])", r"\\\1", path)


def unstack_config(name: str, config: dict, spec: ModelSpec) -> dict:
    """``config`` without target_parameters: their entries' PEFT modules join target_modules."""
    if not config.get("target_parameters"):
        return config
    paths = [path for modules in _targeted_parameters(name, config, spec).values()
             for module in modules for path, _ in module.peft_modules]
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = "|".join([f"(?:{targets})", *map(_escaped, paths)])
    elif isinstance(targets, list):
        targets = [*targets, *paths]
    return {**config, "target_parameters": None, "target_modules": targets}


def unstack_parameters(name: str, config: dict, tensors: dict[str, torch.Tensor],
                       spec: ModelSpec) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the per-module LoRA a target_parameters adapter equals (both as they are
    without target_parameters). InvalidAdapterError when a wrapped pair matches no targeted parameter
    by shape, or two, or a targeted parameter has none."""
    if not config.get("target_parameters"):
        return config, tensors
    targeted, rank = _targeted_parameters(name, config, spec), config.get("r")
    owners: dict[str, list[str]] = {}
    for path in targeted:
        owners.setdefault(path.rsplit(".", 1)[0], []).append(path)
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    kept = {}
    for key, tensor in tensors.items():
        match = _WRAPPED_KEY.fullmatch(key)
        if match is None or match.group("owner") not in owners:
            kept[key] = tensor
            continue
        pairs.setdefault((match.group("owner"), match.group("depth")), {})[match.group("ab")] = tensor
    found = {}
    for (owner, depth), factors in pairs.items():
        if set(factors) != {"lora_A", "lora_B"} or not isinstance(rank, int):
            raise InvalidAdapterError(f"adapter {name!r}: {owner}{depth} needs both lora_A and lora_B (and an int r)")
        a, b = factors["lora_A"], factors["lora_B"]
        fits = [p for p in owners[owner] if tuple(a.shape) == (len(targeted[p]) * rank, targeted[p][0].in_features)
                and tuple(b.shape) == (targeted[p][0].out_features, len(targeted[p]) * rank) and p not in found]
        if len(fits) != 1:
            raise InvalidAdapterError(f"adapter {name!r}: {owner}{depth}.lora_A {tuple(a.shape)} / lora_B "
                                      f"{tuple(b.shape)} fit {len(fits)} of the targeted parameters {owners[owner]} "
                                      f"at r={rank}")
        found[fits[0]] = (a, b)
    missing = sorted(set(targeted) - set(found))
    if missing:
        raise InvalidAdapterError(f"adapter {name!r}: target_parameters names {missing[0]}, but the adapter has no "
                                  "lora_A / lora_B for it")
    for path, (a, b) in found.items():
        modules = targeted[path]
        b_entries = b.reshape(b.shape[0], rank, len(modules))  # [N, r, E]: PEFT's layout of lora_B
        for entry, module in enumerate(modules):
            a_entry, b_entry = a[entry * rank:(entry + 1) * rank], b_entries[:, :, entry]  # [r, K], [N, r]
            for peft_path, indices in module.peft_modules:  # the entry's A is shared by its slices
                rows = torch.cat([b_entry[module.slice_offsets[i]:module.slice_offsets[i] + module.slice_sizes[i]]
                                  for i in indices])
                kept[f"base_model.model.{peft_path}.lora_A.weight"] = a_entry
                kept[f"base_model.model.{peft_path}.lora_B.weight"] = rows
    return unstack_config(name, config, spec), kept
