"""Multi-tenant serving demo: one base model, several tenants' LoRA adapters, one batch.

    python examples/multi_tenant.py                      # offline: trains a tiny demo model first
    python examples/multi_tenant.py --model org/base --adapter a=org/lora-a --adapter b=./lora-b \\
        --prompt "Tell me a story"                       # the same flow on real Hub checkpoints

1. Builds (once, then cached) a tiny Llama-shaped base model and tenant LoRAs trained with PEFT
   (see demo_artifacts.py), unless --model is given.
2. Serves one mixed batch with LLM.generate: every prompt once per tenant and once with no adapter,
   printed side by side.
3. Hot-loads a new tenant into the running LLMEngine (``llm.engine``, driven by add_request/step):
   requests of other tenants are already decoding when the new adapter is added, and its request
   is served alongside them.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from demo_artifacts import HOT_LOADED_TENANT, Recipe, build_demo_artifacts, demo_prompts

logger = logging.getLogger("multi_tenant")
BASE = "(base)"  # label of requests without adapter
DEFAULT_HUB_PROMPTS = ["The capital of France is", "Write a haiku about the sea."]


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="base model: local dir or Hub repo id (default: the offline demo model)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH_OR_REPO_ID",
                   help="a tenant's PEFT LoRA (repeatable); with 2+, the last one is hot-loaded")
    p.add_argument("--prompt", action="append", default=[], help="prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--cache-dir", help="where demo artifacts are cached (default: user cache dir)")
    p.add_argument("--rebuild", action="store_true", help="retrain the demo artifacts")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.adapter and not args.model:
        p.error("--adapter needs --model (the demo model comes with its own tenants)")
    return args


def parse_adapter(spec: str) -> tuple[str, str]:
    """'name=path_or_repo_id' -> (name, path); raises ValueError when malformed."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter expects NAME=PATH_OR_REPO_ID, got {spec!r}")
    return name, path


def resolve_setup(args) -> tuple[str, dict[str, str], str | None, list[str]]:
    """(model, {tenant: adapter path}, hot-loaded tenant or None, prompts) for this run."""
    if args.model is None:
        # The demo model is tiny: one thread serves it fastest (two threads spend more time waking
        # each other than computing, badly so when other processes keep the cores busy).
        torch.set_num_threads(1)
        recipe = Recipe()
        artifacts = build_demo_artifacts(args.cache_dir, recipe, rebuild=args.rebuild,
                                         progress=not args.quiet)
        tenants = {name: str(path) for name, path in artifacts.adapters.items()}
        return str(artifacts.base_dir), tenants, HOT_LOADED_TENANT, args.prompt or demo_prompts(2)
    tenants = dict(parse_adapter(spec) for spec in args.adapter)
    hot = list(tenants)[-1] if len(tenants) >= 2 else None
    return args.model, tenants, hot, args.prompt or DEFAULT_HUB_PROMPTS


def one_line(text: str) -> str:
    """Output text on one line, for side-by-side printing."""
    return " ".join(text.split())


def serve_mixed_batch(llm, prompts: list[str], tenants: dict[str, str], max_tokens: int,
                      use_tqdm: bool = True) -> list[tuple]:
    """One LLM.generate call: each prompt with every tenant and with none; prints and returns
    (prompt, tenant, text) rows."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    labels = list(tenants) + [BASE]
    batch = [(prompt, label) for prompt in prompts for label in labels]
    loras = [LoRARequest(label, tenants[label]) if label != BASE else None for _, label in batch]
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in batch],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), lora_request=loras,
                           use_tqdm=use_tqdm)
    logger.info("served %d requests in one batch in %.2f s", len(batch), time.perf_counter() - start)
    rows = [(prompt, label, one_line(out.outputs[0].text)) for (prompt, label), out in zip(batch, outputs)]
    width = max(len(label) for label in labels)
    print(f"\n=== one mixed batch: {len(batch)} requests, {len(tenants)} tenants + base ===")
    for prompt in prompts:
        print(f"\nprompt: {prompt!r}")
        for p, label, text in rows:
            if p == prompt:
                print(f"  {label:<{width}} | {text}")
    return rows


def hot_load(engine, prompts: list[str], tenants: dict[str, str], new_tenant: str,
             max_tokens: int) -> dict[str, dict]:
    """Start requests of already known tenants, then add `new_tenant`'s adapter and a request for it
    while they decode; prints progress and returns per-request
    {tenant, prompt, added_step, finished_step, text, finish_reason}."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    running = [name for name in tenants if name != new_tenant][:2] + [BASE]
    info: dict[str, dict] = {}

    def add(request_id: str, tenant: str, prompt: str, step: int) -> None:
        lora = LoRARequest(tenant, tenants[tenant]) if tenant != BASE else None
        engine.add_request(request_id, prompt, params, lora_request=lora)
        info[request_id] = {"tenant": tenant, "prompt": prompt, "added_step": step, "finished_step": None,
                            "text": "", "finish_reason": None, "num_tokens": 0}

    print(f"\n=== hot-loading tenant {new_tenant!r} into a running engine ===")
    for i, tenant in enumerate(running):
        add(f"early-{i}", tenant, prompts[i % len(prompts)], step=0)
    step = 0
    while engine.has_unfinished_requests() or "hot-0" not in info:
        step += 1
        # by step 4 the early requests are decoding (with a tiny --max-tokens they may be done)
        if "hot-0" not in info and (step == 4 or not engine.has_unfinished_requests()):
            progress = ", ".join(f"{rid}: {r['num_tokens']} tokens" for rid, r in info.items()
                                 if r["finished_step"] is None) or "none still running"
            engine.add_lora(LoRARequest(new_tenant, tenants[new_tenant]))
            add("hot-0", new_tenant, prompts[0], step)
            print(f"step {step}: added adapter {new_tenant!r} and a request for it; running: {progress}")
        for out in engine.step():
            r = info[out.request_id]
            r["num_tokens"] = len(out.outputs[0].token_ids)
            if out.finished:
                r.update(finished_step=step, text=one_line(out.outputs[0].text),
                         finish_reason=out.outputs[0].finish_reason)
                print(f"step {step}: {out.request_id} [{r['tenant']}] finished "
                      f"(added at step {r['added_step']}): {r['text']}")
    return info


def main(argv=None) -> dict:
    """Run the demo; returns what it printed as data (for tests)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from lora_runner import LLM

    start = time.perf_counter()
    model, tenants, hot, prompts = resolve_setup(args)
    if not tenants:
        logger.warning("no --adapter given: serving the base model only, nothing to hot-load")
    engine_kwargs = dict(max_loras=max(2, min(4, len(tenants))), max_lora_rank=args.max_lora_rank,
                         device=args.device)
    batch_tenants = {name: path for name, path in tenants.items() if name != hot}
    llm = LLM(model=model, **engine_kwargs)
    batch = serve_mixed_batch(llm, prompts, batch_tenants, args.max_tokens, use_tqdm=not args.quiet)
    # TODO(prompt adapters issue): serve a prompt-tuning tenant (PromptAdapterRequest) in this batch
    # once the engine supports it; demo_artifacts.py has the matching spot for training it.
    hot_info = {}
    if tenants:
        if hot is None:  # a single --adapter: served above, so hot-load it again under a new name
            hot = f"{next(iter(tenants))}-hot"
            tenants = {**tenants, hot: next(iter(tenants.values()))}
        hot_info = hot_load(llm.engine, prompts, tenants, hot, args.max_tokens)
    logger.info("demo finished in %.1f s", time.perf_counter() - start)
    return {"batch": batch, "hot_load": hot_info, "model": model, "tenants": tenants}


if __name__ == "__main__":
    main()
