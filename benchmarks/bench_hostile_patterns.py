"""How long adapters.lora.load_lora takes on adapters whose config puts a catastrophic-backtracking
regex (tests/factories.HOSTILE_PATTERNS) in each pattern field, next to the same adapter without it.

RE2 answers these in linear time; Python's re would take a minute or more per case. The tests check
that re never matches them (tests/test_adapters_patterns.py); this prints the times.

    python benchmarks/bench_hostile_patterns.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters import AdapterError  # noqa: E402
from adapters.lora import load_lora  # noqa: E402
from tests import factories  # noqa: E402

log = logging.getLogger("bench_hostile_patterns")


def load_ms(path: Path, spec, repeats: int) -> tuple[float, str]:
    """Median milliseconds of load_lora over ``repeats`` and its outcome ("loaded" or the error class)."""
    times, outcome = [], "loaded"
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            load_lora("hostile", str(path), spec, max_lora_rank=16)
        except AdapterError as exc:
            outcome = type(exc).__name__
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    base = factories.build_tiny_model("llama", seed=0)
    spec = factories.model_spec(base)
    with tempfile.TemporaryDirectory() as root:
        plain = Path(root) / "plain"
        factories.save_lora(base, plain, r=4)
        ms, outcome = load_ms(plain, spec, args.repeats)
        log.info("%-16s %-16s %8.2f ms  %s", "(none)", "", ms, outcome)
        for i, field in enumerate(factories.PATTERN_FIELDS):
            for j, pattern in enumerate(factories.HOSTILE_PATTERNS):
                path = Path(root) / f"case-{i}-{j}"
                factories.save_hostile_pattern_lora(base, path, field, pattern, r=4, seed=i)
                ms, outcome = load_ms(path, spec, args.repeats)
                log.info("%-16s %-16r %8.2f ms  %s", field, pattern, ms, outcome)


if __name__ == "__main__":
    main()
