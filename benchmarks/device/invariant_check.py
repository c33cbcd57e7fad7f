"""The device run's batch_invariant part: what EngineConfig.batch_invariant costs on the GPU, and that it holds.

Two graphed engines on the run's model, the default and the batch-invariant one, one at a time: decode
tok/s at each batch with rank-16 adapters round-robin (gpu_check.decode_run), and, on the invariant
engine, one greedy request with logprobs run alone and then among batch - 1 random companions (half of
them with adapters, prompts of random lengths): its tokens and logprobs must be the same bits.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import gpu_check

COLUMNS = [("mode", "mode", ""), ("batch", "batch", "d"), ("tokens_per_s", "tok/s", ".0f"),
           ("vs_default", "vs default", ".2f"), ("bitwise_equal", "fixed request bitwise equal", "")]


def run_rows(model_dir: Path, sizes, batches: tuple[int, ...], adapters: int, rows: list, deadline: float) -> None:
    """Append one row per (mode, batch) to `rows` (tok/s; on the invariant engine the bitwise check too)."""
    for batch_invariant in (False, True):
        if time.time() > deadline:
            raise TimeoutError(f"batch_invariant: no time left for batch_invariant={batch_invariant}")
        engine = gpu_check.make_engine(model_dir, sizes, graphs=True, max_loras=adapters, max_num_seqs=max(batches),
                                       batch_invariant=batch_invariant)
        try:
            mode = "batch-invariant" if batch_invariant else "default"
            gpu_check.decode_run(engine, sizes, 2, adapters, f"{mode}-warmup")  # compiles outside the timings
            for batch in batches:
                run = gpu_check.decode_run(engine, sizes, batch, adapters, f"{mode}-{batch}")
                row = dict(mode=mode, batch=batch, tokens_per_s=run["tokens_per_s"], bitwise_equal=None)
                if batch_invariant:
                    row["bitwise_equal"] = fixed_request_equal(engine, sizes, batch, adapters)
                rows.append(row)
        finally:
            engine.adapters.manager.close()
            del engine
            gpu_check.free_device_memory()
    default = {row["batch"]: row["tokens_per_s"] for row in rows if row["mode"] == "default"}
    for row in rows:
        row["vs_default"] = row["tokens_per_s"] / default[row["batch"]] if row["batch"] in default else None


def fixed_request_equal(engine, sizes, batch: int, adapters: int) -> bool:
    """Whether one greedy request's tokens and logprobs are the same bits alone and among batch - 1 others."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    vocab = sizes.model["vocab_size"]
    prompt = torch.randint(4, vocab, (sizes.prompt_len[1],), generator=torch.Generator().manual_seed(0)).tolist()
    fixed = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    lora = LoRARequest("bench-0", "<dummy>") if adapters else None

    def run(companions: int, tag: str):
        engine.add_request(f"{tag}-fixed", prompt, fixed, lora_request=lora)
        for i in range(companions):
            length = int(torch.randint(sizes.prompt_len[0], sizes.prompt_len[1] + 1, (), generator=gen))
            other = LoRARequest(f"bench-{i % adapters}", "<dummy>") if adapters and i % 2 else None
            engine.add_request(f"{tag}-{i}", torch.randint(4, vocab, (length,), generator=gen).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=int(torch.randint(1, 12, (), generator=gen)),
                                              ignore_eos=True), lora_request=other)
        result = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == f"{tag}-fixed" and out.finished:
                    result = (out.outputs[0].token_ids, out.outputs[0].logprobs)
        return result

    return run(0, f"alone-{batch}") == run(batch - 1, f"among-{batch}")
