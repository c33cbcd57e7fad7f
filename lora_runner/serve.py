"""``python -m lora_runner.serve MODEL [options]``: the same server as ``lora-runner serve``.

Both entry points import the server only when run, so that without the ``serve`` extra they say in
one line what to install instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys

# what the serve extra (`pip install -e ".[serve]"` in a checkout) brings that a plain install lacks
SERVE_EXTRA_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "yaml"})
# lora-runner is installed from a checkout (it is not on the package index under that name)
MISSING_EXTRA = "lora-runner serve needs the serve extra ({}): pip install -e \".[serve]\" in the lora-runner checkout"


def main(argv: list[str] | None = None) -> int:
    """Parse the `serve` options and run the server."""
    try:
        from lora_runner.entrypoints.cli import add_serve_arguments, run
    except ModuleNotFoundError as exc:
        return _missing_extra(exc)
    parser = argparse.ArgumentParser(prog="python -m lora_runner.serve",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(parser)
    return run(parser.parse_args(argv), parser)


def console_main(argv: list[str] | None = None) -> int:
    """The ``lora-runner`` console script (lora_runner.entrypoints.cli.main once the extra is installed)."""
    try:
        from lora_runner.entrypoints.cli import main as cli_main
    except ModuleNotFoundError as exc:
        return _missing_extra(exc)
    return cli_main(argv)


def _missing_extra(exc: ModuleNotFoundError) -> int:
    if (exc.name or "").split(".")[0] not in SERVE_EXTRA_MODULES:
        raise exc
    print(MISSING_EXTRA.format(exc.name), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
