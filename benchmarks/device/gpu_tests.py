"""``pytest -m gpu`` over the gpu test files, in a subprocess that cannot lose the counts.

Workers (pytest-xdist ``-n``) share the compile cache; a per-test timeout (pytest-timeout) fails a
hung test alone; the whole run has a wall-clock limit after which it is killed. The verbose log is
written as it runs and each test's outcome is read from it, so a run killed at its limit still
reports what finished; the junit file is pytest's own (written only when pytest ends).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from image import ROOT, gpu_test_files

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
# "[gw3] [ 12%] PASSED tests/test_x.py::test_y[cuda]" (xdist) or "tests/test_x.py::test_y PASSED [ 12%]"
_LINE = re.compile(r"(?:(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+))|(?:(\S+::\S+) (PASSED|FAILED|ERROR|"
                   r"SKIPPED|XFAIL|XPASS))")
_WORD = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfailed",
         "XPASS": "xpassed"}


def pytest_command(files: list[str], *, workers: int, per_test_timeout_s: int, junit: Path | None) -> list[str]:
    """The pytest command line (run from the repository root)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-m", "gpu", "-p", "no:cacheprovider", "-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:  # the image has it; this CI machine may not
        cmd.append(f"--timeout={per_test_timeout_s}")
    if junit is not None:
        cmd.append(f"--junitxml={junit}")
    return cmd + files


def outcomes(log: str) -> dict[str, str]:
    """test id -> outcome word, from pytest's verbose output (the last word seen for a test wins)."""
    found = {}
    for match in _LINE.finditer(log):
        word, test = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
        found[test] = _WORD[word]
    return found


def run_gpu_tests(*, workers: int, per_test_timeout_s: int, timeout_s: float, log_path: Path,
                  junit: Path | None = None, paths: tuple[str, ...] = ("tests",)) -> dict:
    """Run the gpu tests of `paths` (folders or files); returns counts, failures and the log's tail.

    ``returncode`` is pytest's (5: nothing collected), or None when the run was killed at `timeout_s`.
    """
    files = [str(path.relative_to(ROOT)) for p in paths
             for path in (gpu_test_files(ROOT / p) if (ROOT / p).is_dir() else [ROOT / p])]
    cmd = pytest_command(files, workers=workers, per_test_timeout_s=per_test_timeout_s, junit=junit)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ},
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # pytest and its xdist workers: the group this Popen started
            proc.wait()
            returncode = None
    text = log_path.read_text(errors="replace")
    seen = outcomes(text)
    counts = Counter(seen.values())
    return dict(returncode=returncode, killed_at_limit=returncode is None, files=len(files),
                counts={outcome: counts[outcome] for outcome in OUTCOMES if counts[outcome]},
                failed=sorted(test for test, outcome in seen.items() if outcome in ("failed", "error")),
                tail=text.strip().splitlines()[-15:], command=" ".join(cmd))
