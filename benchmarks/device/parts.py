"""The parts of the device run (run.py's docstring lists them) and the report of their results.

Each part takes the Run (plan, results, model directory, engine, clock) and returns None when it ran
or a reason when it was skipped; it raises when it fails. Parts that need the model or the engine
are skipped, with the reason, when the part that makes them failed.
"""

from __future__ import annotations

import importlib.metadata
import platform
import time

import torch

import checks
import gpu_check
import spec_rows
import gpu_tests
import invariant_check
import lora_decode_profile as profile_sections

VERSIONS = ("torch", "triton", "transformers", "peft", "safetensors", "numpy", "google-re2", "xgrammar", "pytest",
            "pytest-xdist", "pytest-timeout")


def _device(run) -> torch.device:
    return torch.device(run.plan.profile.sizes.device)


def setup(run):
    """Versions, the device, its measured copy bandwidth; `import lora_runner` first of all."""
    import lora_runner  # noqa: F401  (the one import everything else needs: a failure says so here)

    versions = {}
    for dist in VERSIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    device = _device(run)
    info = dict(python=platform.python_version(), versions=versions, date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime()))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                    cuda=torch.version.cuda)
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()})")
    run.results["setup"] = info
    run.results["copy_gbps"] = gpu_check.copy_gbps(device)
    gpu_check.free_device_memory()  # the copy's 2 GiB back before the tests' processes start


def tests(run):
    """pytest -m gpu (gpu_tests.py): counts survive a run killed at its limit."""
    plan = run.plan
    result = gpu_tests.run_gpu_tests(workers=plan.test_workers, per_test_timeout_s=plan.test_timeout_s,
                                     timeout_s=run.deadline("tests") - time.time(),
                                     log_path=run.out_dir / "gpu_tests.log", junit=run.out_dir / "gpu_tests.xml")
    run.results["tests"] = result
    if result["returncode"] not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"gpu tests: {result['counts']}, exit {result['returncode']}"
                           f"{' (killed at the time limit)' if result['killed_at_limit'] else ''}")


def model(run):
    """The one random model every later part uses."""
    path = run.tmp / "model"
    gpu_check.write_random_model(path, run.plan.profile.sizes)
    run.model_dir = path
    run.results["model"] = dict(config=run.plan.profile.sizes.model,
                                weight_bytes=(path / "model.safetensors").stat().st_size)


def kernels(run):
    """add_lora at decode sizes: us, graph us, GB/s and its share of the measured copy bandwidth."""
    section = {"copy_gbps": run.results["copy_gbps"]}
    try:
        gpu_check.run_kernels(run.plan.kernel_sizes, section, run.deadline("kernels"))
    finally:
        run.results["sgmv"] = section.get("kernels", [])


def splitk(run):
    plan = run.plan
    checks.run_splitk(plan.splitk_hidden, plan.splitk_tokens, plan.splitk_repeats, _device(run),
                      plan.profile.sizes.dtype, run.results)


def moe(run):
    """The fused MoE kernels vs the per-expert torch loop, base and with 8 expert LoRAs, on a Qwen3-30B-A3B
    layer (bench_moe_kernels; the dry run: a toy layer under the Triton interpreter)."""
    import bench_moe_kernels

    layer = bench_moe_kernels.TOY if run.dry_run else bench_moe_kernels.QWEN3_30B_A3B
    rows = run.results["moe_kernels"] = []
    bench_moe_kernels.run_rows(layer, run.plan.moe_tokens, _device(run), run.plan.profile.sizes.dtype,
                               run.deadline("moe"), rows, min_seconds=0.01 if run.dry_run else 0.05)


def profile(run):
    """One graphed engine; lora_decode_profile's sections on it (the engine stays for the next parts)."""
    if run.model_dir is None:
        return "no model (the model part failed)"
    plan, deadline = run.plan.profile, run.deadline("profile")
    run.engine = profile_sections.make_engine(run.model_dir, plan)
    gpu_check.decode_run(run.engine, plan.sizes, 4, 1, "warmup")  # compile kernels outside the timings
    section = run.results.setdefault("profile", {})
    for name in ("decode", "kernels", "prepare", "prefill"):
        if time.time() > deadline:
            raise TimeoutError(f"profile: out of time before {name}")
        getattr(profile_sections, f"run_{name}")(run.engine, plan, section)


def graphs(run):
    if run.engine is None:
        return "no engine (the profile part failed)"
    requests, adapters = run.plan.profile.profile_point
    checks.graphs_vs_eager(run.engine, run.plan.profile.sizes, [(requests, 0), (requests, adapters)], run.results)


def prefix(run):
    if run.engine is None:
        return "no engine (the profile part failed)"
    checks.prefix_cache_ttft(run.engine, run.plan.profile.sizes.model["vocab_size"], run.plan.prefix_len,
                             run.plan.prefix_repeats, run.results)


def quant(run):
    """bf16 rows on the shared engine (then closed: the next engines need its memory), FP8 and W4A16."""
    if run.model_dir is None:
        return "no model (the model part failed)"
    plan, deadline = run.plan, run.deadline("quant")
    if run.engine is not None:
        checks.decode_rows(run.engine, "bf16", plan.profile.sizes, plan.quant_batches, run.results)
    close_engine(run)
    checks.quant_decode(run.model_dir, plan.profile.sizes, plan.quant_batches, plan.w4a16_group, run.results, deadline)


def batch_invariant(run):
    """EngineConfig.batch_invariant: decode tok/s vs the default engine (graphs, adapters), and one request's
    bits alone vs among the batch (invariant_check)."""
    if run.model_dir is None:
        return "no model (the model part failed)"
    close_engine(run)  # its memory goes to the two engines here
    rows = run.results["batch_invariant"] = []
    invariant_check.run_rows(run.model_dir, run.plan.profile.sizes, run.plan.quant_batches, 4, rows,
                             run.deadline("batch_invariant"))
    if not all(row["bitwise_equal"] for row in rows if row["mode"] == "batch-invariant"):
        raise RuntimeError(f"batch_invariant: a fixed request's bits changed with the batch: {rows}")


def spec(run):
    """Speculative decoding's rows (spec_rows.py), one engine per method after the shared one is closed."""
    if run.model_dir is None:
        return "no model (the model part failed)"
    close_engine(run)  # its memory: each method's engine profiles the device anew
    plan = run.plan
    spec_rows.spec_decode_rows(run.model_dir, plan.profile.sizes, num_requests=plan.spec_requests,
                               prompt_len=plan.spec_prompt_len, output_len=plan.spec_output_len,
                               adapter_counts=plan.spec_adapters, k=plan.spec_k, draft_layers=1, results=run.results,
                               deadline=run.deadline("spec"))
    skipped = run.results.get("spec_decode_skipped")
    if skipped:
        raise TimeoutError(f"spec: no time left for {skipped}")


def close_engine(run) -> None:
    if run.engine is not None:
        run.engine.adapters.manager.close()
        run.engine = None
        gpu_check.free_device_memory()


PARTS = dict(setup=setup, tests=tests, model=model, kernels=kernels, splitk=splitk, moe=moe, profile=profile,
             graphs=graphs, prefix=prefix, quant=quant, spec=spec, batch_invariant=batch_invariant)
