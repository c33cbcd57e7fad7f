"""RankWorker: one tensor-parallel rank inside its worker process: its model, KV cache, slots and runner.

``apply(message)`` runs one StepMessage: the queued ops in order (slot writes from shared memory,
clears, freed rows, end ids), then the step, whose SamplerOutput every rank returns (the engine uses
rank 0's and checks the others sampled the same tokens). Every rank samples from the same logits with
the same settings and generators, so every rank's rows commit the same tokens.
"""

from __future__ import annotations

import torch

from lora_runner.distributed import TensorParallel
from lora_runner.executor.rank_model import build_rank_model, build_rank_slots, shard
from lora_runner.executor.runner_factory import make_runner
from lora_runner.executor.shared_weights import open_shared
from lora_runner.executor.slot_proxy import SlotOp
from lora_runner.executor.step_message import StepMessage
from lora_runner.executor.worker_spec import WorkerSpec
from lora_runner.sample.sampler import SamplerOutput


class RankWorker:
    """Rank ``tp.rank`` of ``tp.world_size``, built from ``spec``; ``messages`` counts the messages applied."""

    def __init__(self, spec: WorkerSpec, tp: TensorParallel) -> None:
        self.spec, self.tp = spec, tp
        self.device = spec.rank_device(tp.rank)
        model, model_config, _ = build_rank_model(spec, tp)
        self.model_spec = model_config.spec()  # the whole model's (the shard's sizes: adapters.sharding)
        self.slots = build_rank_slots(spec, self.model_spec, tp)
        self.runner = make_runner(spec, model, model_config, lora_slots=self.slots["lora_only"],
                                  prompt_slots=self.slots["prompt"], vocab_slots=self.slots["vocab"],
                                  device=self.device, tp=tp)
        self._generators: dict[str, torch.Generator] = {}  # a seeded request's generator, across preemptions
        self.messages = 0

    @property
    def slot_nbytes(self) -> dict[str, int]:
        """Device bytes of this rank's slots per kind."""
        return {"lora": self.slots["lora"].nbytes, "prompt": self.slots["prompt"].nbytes}

    def apply(self, message: StepMessage) -> SamplerOutput | None:
        """Run the message's ops, then its step (None when it has none)."""
        self.messages += 1
        for op in message.ops:
            self._apply_op(op)
        sched = message.sched
        if sched is None:
            return None
        for request_id in sched.finished_ids:
            self._generators.pop(request_id, None)
        for new in sched.new_requests:
            if new.generator is not None:
                new.generator = self._generator(new.request_id, new.generator)
        return self.runner.execute(sched, message.grammar)

    def _generator(self, request_id: str, sent: torch.Generator) -> torch.Generator:
        """The request's generator on this rank: the one it used before a preemption, else the engine's
        (never advanced there), moved to this rank's device."""
        if request_id not in self._generators:
            if sent.device != self.device:
                sent = torch.Generator(device=self.device).manual_seed(sent.initial_seed())
            self._generators[request_id] = sent
        return self._generators[request_id]

    def _apply_op(self, op: SlotOp) -> None:
        if op.action == "write":
            weights = shard(open_shared(op.handle), self.model_spec, self.tp.rank, self.tp.world_size)
            self.slots[op.kind].write(op.slot, weights)
            del weights  # the views go, and with them the mapping of the shared file
        elif op.action == "clear":
            self.slots[op.kind].clear(op.slot)
        elif op.action == "forget":
            self.runner.forget(op.request_ids)
        elif op.action == "eos":
            self.runner.eos_token_ids = op.eos_token_ids
        else:
            raise AssertionError(f"unknown op {op.action!r}")
