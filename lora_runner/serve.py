"""``python -m lora_runner.serve MODEL [options]``: the same server as ``lora-runner serve``."""

from __future__ import annotations

import argparse
import sys

from lora_runner.entrypoints.cli import add_serve_arguments, run


def main(argv: list[str] | None = None) -> int:
    """Parse the `serve` options and run the server."""
    parser = argparse.ArgumentParser(prog="python -m lora_runner.serve")
    add_serve_arguments(parser)
    return run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
