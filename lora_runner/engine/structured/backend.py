"""The structured-output backend (xgrammar), imported when the first constraint needs it.

An engine that never sees a constraint never imports xgrammar, so the package (and its own
dependencies: apache-tvm-ffi, pydantic, ...) is needed only where constraints are served. A
constraint asked for where it is missing fails its request with StructuredOutputError (a ValueError:
HTTP 400), naming the package to install.
"""

from __future__ import annotations

import importlib

BACKEND_PACKAGE = "xgrammar"
BACKEND_REQUIREMENT = "xgrammar>=0.1.20"  # as pyproject.toml's dependencies


class StructuredOutputError(ValueError):
    """A request's structured-output constraint cannot be used: its schema, regex or grammar does not
    compile, compiling it took longer than the engine allows, or the backend is not installed. The
    request alone fails (a 400 over HTTP)."""


def compile_timeout_error(timeout_s: float) -> StructuredOutputError:
    """What a request gets when its constraint is still compiling past ``timeout_s``."""
    return StructuredOutputError(f"structured_outputs took longer than {timeout_s:g} s to compile; simplify the "
                                 "constraint")


def xgrammar():
    """The xgrammar module (imported once, then from sys.modules).

    Raises:
        StructuredOutputError: xgrammar (or one of its dependencies) cannot be imported.
    """
    try:
        return importlib.import_module(BACKEND_PACKAGE)
    except ImportError as exc:
        raise StructuredOutputError(
            f"structured_outputs needs the {BACKEND_PACKAGE!r} package, which this server cannot import ({exc}); "
            f"install it (pip install '{BACKEND_REQUIREMENT}') or send the request without a constraint") from exc
