"""``python -m lora_runner.serve MODEL [options]``: the same server as ``lora-runner serve``.

Both entry points parse the command line first (lora_runner.entrypoints.serve_args: no torch, no
server), so ``--help`` and a bad option answer at once; the server is imported only to run, and
without the ``serve`` extra they say in one line what to install instead of a traceback.
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
    from lora_runner.entrypoints.serve_args import serve_parser

    parser = serve_parser()
    return _run(parser.parse_args(argv), parser)


def console_main(argv: list[str] | None = None) -> int:
    """The ``lora-runner`` console script: ``lora-runner serve MODEL [options]``."""
    from lora_runner.entrypoints.serve_args import command_parser

    parser = command_parser()
    return _run(parser.parse_args(argv), parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The server, imported only now: --help and option errors have answered without it (and its extra)."""
    try:
        from lora_runner.entrypoints.cli import run
    except ModuleNotFoundError as exc:
        return _missing_extra(exc)
    return run(args, parser)


def _missing_extra(exc: ModuleNotFoundError) -> int:
    if (exc.name or "").split(".")[0] not in SERVE_EXTRA_MODULES:
        raise exc
    print(MISSING_EXTRA.format(exc.name), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
