"""adapters.patterns: regexes in a tenant's adapter config never run in a backtracking engine.

``target_modules`` (a string), ``exclude_modules`` (a string), ``layers_pattern`` and the keys of
``rank_pattern`` / ``alpha_pattern`` are evaluated by RE2 with PEFT's exact wrapping. Checked here:
the issue's catastrophic patterns in each field load (or are refused as PEFT would) without Python's
``re`` ever matching them (in a subprocess whose ``re`` refuses to, so a regression is an error, not
a frozen run); a bystander's greedy tokens are unchanged while such adapters are loaded next to it;
patterns RE2 cannot run, or too long or too many, are InvalidAdapterError naming the field; and a
grid of legitimate patterns targets exactly the modules, ranks and scalings PEFT itself gives.
How long each hostile load takes: benchmarks/bench_hostile_patterns.py.
"""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from adapters import InvalidAdapterError, LoRARequest
from adapters.lora import _targeted_ranks, load_lora, parse_lora
from adapters.patterns import MAX_PATTERN_CHARS, MAX_PATTERN_ENTRIES
from adapters.weights import read_adapter_config
from lora_runner import SamplingParams
from tests import factories

from engine_support import make_engine

REPO = Path(__file__).resolve().parents[1]
CASES = [(field, pattern) for field in factories.PATTERN_FIELDS for pattern in factories.HOSTILE_PATTERNS]
# What PEFT itself concludes (once its backtracking finishes): nothing matches the pattern
EXPECTED = {"target_modules": "matches no module", "layers_pattern": "matches no module",
            "exclude_modules": None, "rank_pattern": None, "alpha_pattern": None}  # None: loads, pattern inert
ATTACK_PASSES = 3  # each hostile adapter is loaded this many times under a new name while the bystander runs

# Loads every case with Python's re refusing to match (or search, ...) any regex that contains a
# hostile pattern: re2 must do all the matching; re may only parse (PEFT's syntax check).
_GUARDED_LOAD_SCRIPT = """
import json, re, sys, types
from adapters import AdapterError, ModelSpec
from adapters.lora import load_lora
from lora_runner.model.lora_linear import decoder_lora_modules
spec, cases, hostile = (json.loads(arg) for arg in sys.argv[1:4])
spec["modules"] = decoder_lora_modules(types.SimpleNamespace(**spec, fused_projections=False))
ran_in_re, compile_pattern = [], re._compile

class RefusesToMatch:
    def __init__(self, compiled):
        self.compiled = compiled
    def __getattr__(self, name):
        if name not in ("match", "fullmatch", "search", "finditer", "findall", "sub", "subn", "split"):
            return getattr(self.compiled, name)
        def refuse(*args, **kwargs):
            ran_in_re.append(self.compiled.pattern)
            raise RuntimeError("Python's re ran a hostile pattern: " + self.compiled.pattern)
        return refuse

def guarded_compile(pattern, flags):
    compiled = compile_pattern(pattern, flags)
    return RefusesToMatch(compiled) if isinstance(pattern, str) and any(h in pattern for h in hostile) else compiled

re._compile = guarded_compile
results = []
for path in cases:
    outcome = None
    try:
        load_lora("hostile", path, ModelSpec(**spec), max_lora_rank=16)
    except AdapterError as exc:
        outcome = [type(exc).__name__, str(exc)]
    results.append(outcome)
print(json.dumps({"results": results, "ran_in_re": ran_in_re}))
"""


@pytest.fixture(scope="module")
def base():
    return factories.build_tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def hostile_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-patterns")
    dirs = {}
    for i, (field, pattern) in enumerate(CASES):
        dirs[field, pattern] = root / f"case{i}"
        factories.save_hostile_pattern_lora(base, dirs[field, pattern], field, pattern, r=4, seed=i)
    return dirs


def spec_kwargs(model) -> dict:
    spec = factories.model_spec(model)
    return {k: getattr(spec, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                          "intermediate_size")}


def test_issue_patterns_in_every_field_never_run_in_pythons_re(base, hostile_dirs):
    paths = [str(hostile_dirs[case]) for case in CASES]
    args = [json.dumps(spec_kwargs(base)), json.dumps(paths), json.dumps(list(factories.HOSTILE_PATTERNS))]
    done = subprocess.run([sys.executable, "-c", _GUARDED_LOAD_SCRIPT, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # hang guard: Python's re takes 60 s+ per case
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ran_in_re"] == []
    for (field, pattern), outcome in zip(CASES, report["results"]):
        if EXPECTED[field] is None:
            assert outcome is None, (field, pattern, outcome)
        else:
            assert outcome[0] == "InvalidAdapterError" and EXPECTED[field] in outcome[1], (field, outcome)


def _run_bystander(engine, prompts, params) -> dict:
    for request_id, (prompt, lora) in prompts.items():
        engine.add_request(request_id, prompt, params, lora_request=lora)
    done = {}
    while len(done) < len(prompts):
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


def test_bystander_keeps_its_tokens_while_hostile_patterns_load(engine_checkpoint, hostile_dirs):
    path, _, adapters = engine_checkpoint
    engine = make_engine(path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {"base": ([5, 6, 7], None), "lora": ([8, 9, 10, 11], LoRARequest("r4", adapters["r4"][0]))}
    _run_bystander(engine, {f"warm-{k}": v for k, v in prompts.items()}, params)
    expected = _run_bystander(engine, prompts, params)
    rounds, stop, attacking = [], threading.Event(), threading.Event()

    def bystander():
        while not stop.is_set() or not rounds:
            during_attack = attacking.is_set()
            tokens = _run_bystander(engine, {f"{k}-{len(rounds)}": v for k, v in prompts.items()}, params)
            during_attack |= attacking.is_set()
            rounds.append(({k.rsplit("-", 1)[0]: v for k, v in tokens.items()}, during_attack))

    thread = threading.Thread(target=bystander)
    thread.start()
    loads = 0
    try:
        attacking.set()
        for (field, pattern), adapter_dir in list(hostile_dirs.items()) * ATTACK_PASSES:
            try:
                engine.add_lora(LoRARequest(f"hostile-{field}-{loads}", str(adapter_dir)))
            except InvalidAdapterError as exc:
                assert EXPECTED[field] in str(exc)
            loads += 1
            if loads == len(hostile_dirs):  # at least one bystander round overlaps the attack
                assert_waits_for(lambda: any(during for _, during in rounds))
    finally:
        attacking.clear()
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert loads == len(hostile_dirs) * ATTACK_PASSES and any(during for _, during in rounds)
    assert all(tokens == expected for tokens, _ in rounds)


def assert_waits_for(predicate, timeout: float = 60.0) -> None:
    """Wait until predicate() holds (the deadline is a hang guard)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.001)


REFUSED = {  # pattern -> what the message says
    r"(q_proj)\1": "not supported by RE2",  # backreference
    r"(?=q)q_proj": "not supported by RE2",  # lookahead
    r".*\Z": "not supported by RE2",
    "(": "not a valid Python regex",
    "q{,3}_proj": "{,n}",  # a repeat in Python, literal text in RE2
    "[[:alpha:]]_proj": "POSIX class",
    ".{1000}": "RE2 instructions",  # program size
    ".*" + "q" * MAX_PATTERN_CHARS: f"over the limit {MAX_PATTERN_CHARS}",
}


@pytest.fixture(scope="module")
def valid_config(base, tmp_path_factory):
    path = tmp_path_factory.mktemp("valid")
    factories.save_lora(base, path, r=4)
    return read_adapter_config("valid", str(path))


@pytest.mark.parametrize("field", factories.PATTERN_FIELDS)
@pytest.mark.parametrize("pattern", list(REFUSED), ids=lambda p: p[:16])
def test_patterns_re2_cannot_run_safely_are_invalid_naming_the_field(base, valid_config, field, pattern):
    config = {**valid_config, **factories.hostile_pattern_fields(field, pattern)}
    with pytest.raises(InvalidAdapterError, match=field) as info:
        parse_lora("bad", config, {}, factories.model_spec(base), max_lora_rank=16)
    assert REFUSED[pattern] in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("rank_pattern", {f"layers.{i}.q_proj": 2 for i in range(MAX_PATTERN_ENTRIES + 1)}),
    ("target_modules", ["q_proj"] * (MAX_PATTERN_ENTRIES + 1)),
    ("exclude_modules", ["k_proj"] * (MAX_PATTERN_ENTRIES + 1)),
    ("layers_pattern", ["layers"] * (MAX_PATTERN_ENTRIES + 1)),
    ("layers_to_transform", list(range(MAX_PATTERN_ENTRIES + 1))),
    ("target_modules", ["q_proj", 7]),
    ("layers_pattern", 7),
])
def test_too_many_or_mistyped_pattern_entries_are_invalid(base, valid_config, field, value):
    config = {**valid_config, field: value, "layers_to_transform": valid_config.get("layers_to_transform") or [0]}
    config[field] = value
    with pytest.raises(InvalidAdapterError, match=field):
        parse_lora("bad", config, {}, factories.model_spec(base), max_lora_rank=16)


# Legitimate PEFT configs whose targeting depends on the pattern rules (all on the 2-layer tiny Llama)
PEFT_GRID = {
    "regex-qv": dict(target_modules=r".*\.(q_proj|v_proj)"),
    "regex-layer1": dict(target_modules=r"model\.layers\.1\..*proj"),
    "regex-mlp-classes": dict(target_modules=r".*layers\.[01]\.mlp\.(up|down)_proj"),
    "regex-ignorecase": dict(target_modules=r"(?i).*\.Q_PROJ"),
    "layers-pattern": dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1], layers_pattern="layers"),
    "layers-pattern-list": dict(target_modules=["k_proj", "o_proj", "up_proj"], layers_to_transform=0,
                                layers_pattern=["blocks", "layers"]),
    "layers-default": dict(target_modules=["v_proj", "gate_proj"], layers_to_transform=[0]),
    # overlapping keys in sorted order (PEFT saves configs with sorted keys): the first match wins
    "rank-alpha-dotted": dict(rank_pattern={r"layers\.0\..*_proj": 5, "mlp.down_proj": 3,
                                            "model.layers.1.self_attn.q_proj": 2},
                              alpha_pattern={"v_proj": 7, "layers.1.mlp.up_proj": 1}),
    "rank-alternation": dict(rank_pattern={"q_proj|k_proj": 6, "proj": 2}, alpha_pattern={"o_.*": 3},
                             use_rslora=True),
    "exclude-regex": dict(exclude_modules=r".*\.1\.self_attn\.k_proj"),
    "exclude-list": dict(exclude_modules=["layers.0.mlp.gate_proj", "o_proj"]),
}


@pytest.mark.parametrize("kwargs", list(PEFT_GRID.values()), ids=list(PEFT_GRID))
def test_targets_ranks_and_scalings_match_peft(base, tmp_path, kwargs):
    import copy

    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    factories.save_lora(base, tmp_path, **{"r": 4, "lora_alpha": 8, **kwargs})
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))  # as PEFT serves the saved file
    peft_layers = {name.removeprefix("base_model.model."): (module.r["default"], module.scaling["default"])
                   for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)}
    spec = factories.model_spec(base)
    ours = _targeted_ranks("grid", read_adapter_config("grid", str(tmp_path)), spec, max_lora_rank=16)
    assert ours == peft_layers
    assert load_lora("grid", str(tmp_path), spec, max_lora_rank=16).rank == max(r for r, _ in peft_layers.values())
