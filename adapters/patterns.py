"""PEFT's module targeting with tenant-supplied regexes evaluated by RE2 (linear time), never by ``re``.

An adapter config's ``target_modules`` (a string), ``exclude_modules`` (a string), ``layers_pattern``
and the keys of ``rank_pattern`` / ``alpha_pattern`` are regexes written by whoever made the adapter.
Python's backtracking ``re`` holds the GIL while it runs, so ``(.|.)*Z`` froze every thread of the
process. Here every such pattern is wrapped exactly as PEFT wraps it (``re.fullmatch(target, key)``,
``re.match(rf"(.*\\.)?({key})$", key)``, ``re.match(rf"(?:^|.*?\\.){pattern}\\.(?P<idx>\\d+)\\.", key)``,
see peft.tuners.tuners_utils.check_target_module_exists and peft.utils.other.get_pattern_key) and
compiled by RE2, whose matching time is linear in the key's length.

A pattern is accepted only if Python's ``re`` compiles it (so PEFT would accept it; compiling runs no
match) and RE2 compiles it to at most :data:`MAX_PROGRAM_SIZE` instructions; two constructs that
both parse but mean different things are refused (``x{,n}``: a repeat in Python, literal text in
RE2; ``[[:alpha:]]``: a POSIX class in RE2, a plain set in Python). Module keys are ASCII without
newlines, where ``\\d``, ``\\w``, ``$`` and the rest agree between the two engines. Anything refused,
too long or too numerous is an :class:`InvalidAdapterError` naming the field.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import re2

from adapters.errors import InvalidAdapterError

MAX_PATTERN_CHARS = 1024  # characters of one tenant-supplied pattern
MAX_PATTERN_ENTRIES = 1024  # entries of one list / pattern dict (rank_pattern, target_modules, ...)
MAX_PROGRAM_SIZE = 4096  # RE2 instructions of one compiled pattern (".{1000}" alone is 8004)
_RE2_MAX_MEM = 2 << 20  # bytes RE2 may use to compile and run one pattern
_CACHE_SIZE = 512  # compiled patterns kept across loads (reloading a churned adapter recompiles nothing)

_RANK_WRAP = r"(.*\.)?({})$"  # peft.utils.other.get_pattern_key
_LAYER_WRAP = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."  # peft check_target_module_exists, with layers_pattern
_DEFAULT_LAYER_RE = re2.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")  # ... and without it (a constant)


def _divergent_construct(pattern: str) -> str | None:
    """A construct Python's ``re`` and RE2 both accept but read differently, or None."""
    class_start, i = None, 0  # class_start: index of the first item of the character class we are in
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if class_start is not None:
            if pattern.startswith("[:", i):
                return "'[:' inside a character class (a POSIX class in RE2, plain characters in Python)"
            if pattern[i] == "]" and i > class_start:  # "[]...]" and "[^]...]" start with a literal ]
                class_start = None
        elif pattern[i] == "[":
            class_start = i + 2 if pattern.startswith("[^", i) else i + 1
        elif pattern.startswith("{,", i):
            return "'{,n}' (a repeat in Python, literal text in RE2; write {0,n})"
        i += 1
    return None


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.max_mem = _RE2_MAX_MEM
    options.log_errors = False  # a tenant's bad pattern is our error message, not stderr noise
    return options


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compile(regex: str):
    """RE2 program for ``regex``, or the reason it is refused (a str; errors are cached too)."""
    try:
        re.compile(regex)  # parses only: proves PEFT (which uses re) accepts the pattern
    except (re.error, RecursionError, OverflowError) as exc:
        return f"not a valid Python regex ({exc})"
    divergent = _divergent_construct(regex)
    if divergent:
        return f"uses {divergent}"
    try:
        program = re2.compile(regex, _re2_options())
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        return (f"is not supported by RE2, the linear-time engine adapter patterns run in ({reason}); "
                "backreferences, lookaround, \\Z, possessive and atomic groups are refused")
    if program.programsize > MAX_PROGRAM_SIZE:
        return f"compiles to {program.programsize} RE2 instructions, over the limit {MAX_PROGRAM_SIZE}"
    return program


def compile_pattern(name: str, field: str, pattern, wrap: str = "{}"):
    """RE2 program of ``wrap.format(pattern)``; ``pattern`` comes from the config's ``field``.

    Raises:
        InvalidAdapterError: not a string, longer than MAX_PATTERN_CHARS, or refused (module docstring).
    """
    if not isinstance(pattern, str):
        raise InvalidAdapterError(f"adapter {name!r}: {field} must be a regex string, got {pattern!r:.80}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidAdapterError(f"adapter {name!r}: {field} is a pattern of {len(pattern)} characters, over "
                                  f"the limit {MAX_PATTERN_CHARS}")
    program = _compile(wrap.replace("{}", pattern, 1))
    if isinstance(program, str):
        raise InvalidAdapterError(f"adapter {name!r}: {field} pattern {pattern!r:.120} {program}")
    return program


def _entries(name: str, field: str, value, kinds: tuple[type, ...]) -> tuple:
    """A config list as a tuple, its length and item types checked."""
    if not isinstance(value, (list, tuple)):
        raise InvalidAdapterError(f"adapter {name!r}: {field} must be a list, got {value!r:.80}")
    if len(value) > MAX_PATTERN_ENTRIES:
        raise InvalidAdapterError(f"adapter {name!r}: {field} has {len(value)} entries, over the limit "
                                  f"{MAX_PATTERN_ENTRIES}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, kinds):
            raise InvalidAdapterError(f"adapter {name!r}: {field} entries must be {kinds[0].__name__}, got "
                                      f"{item!r:.80}")
    return tuple(value)


def _pattern_dict(name: str, field: str, value) -> tuple:
    """rank_pattern / alpha_pattern -> ((program, value), ...) in the config's order (first match wins)."""
    value = value or {}
    if not isinstance(value, dict):
        raise InvalidAdapterError(f"adapter {name!r}: {field} must be a dict, got {value!r:.80}")
    _entries(name, f"{field} keys", list(value), (str,))
    return tuple((compile_pattern(name, f"{field} key", key, _RANK_WRAP), v) for key, v in value.items())


@dataclass(frozen=True)
class PeftTargets:
    """Which modules an adapter config targets, and with which rank / alpha: PEFT's rules, RE2's engine."""

    target: object  # RE2 program (target_modules as a string) or tuple of names (suffix match)
    exclude: object  # RE2 program, tuple of names, or None
    layers: object  # layers_to_transform: int, tuple of ints, or None (every layer)
    layer_patterns: tuple  # RE2 programs of layers_pattern, () for PEFT's default
    ranks: tuple  # ((program, rank), ...) from rank_pattern
    alphas: tuple  # ((program, alpha), ...) from alpha_pattern

    @classmethod
    def from_config(cls, name: str, config: dict) -> "PeftTargets":
        """Validate and compile every pattern field of ``config`` (before any module is matched)."""
        targets = config.get("target_modules")
        target = (compile_pattern(name, "target_modules", targets) if isinstance(targets, str)
                  else _entries(name, "target_modules", targets, (str,)))
        exclude = config.get("exclude_modules") or None
        if exclude is not None:
            exclude = (compile_pattern(name, "exclude_modules", exclude) if isinstance(exclude, str)
                       else _entries(name, "exclude_modules", exclude, (str,)))
        layers = config.get("layers_to_transform")
        if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool)):
            layers = _entries(name, "layers_to_transform", layers, (int,)) or None
        layer_patterns = config.get("layers_pattern") or ()
        if isinstance(layer_patterns, str):
            layer_patterns = (layer_patterns,)
        layer_patterns = tuple(compile_pattern(name, "layers_pattern", p, _LAYER_WRAP)
                               for p in _entries(name, "layers_pattern", layer_patterns, (str,)))
        return cls(target, exclude, layers, layer_patterns, _pattern_dict(name, "rank_pattern", config.get(
            "rank_pattern")), _pattern_dict(name, "alpha_pattern", config.get("alpha_pattern")))

    def is_targeted(self, module_key: str) -> bool:
        """peft check_target_module_exists(config, module_key), truthiness only."""
        if isinstance(self.exclude, tuple):
            if module_key in self.exclude or any(module_key.endswith("." + e) for e in self.exclude):
                return False
        elif self.exclude is not None and self.exclude.fullmatch(module_key):
            return False
        if not isinstance(self.target, tuple):
            return self.target.fullmatch(module_key) is not None
        if module_key in self.target:
            return True
        if not any(module_key.endswith("." + t) for t in self.target):
            return False
        return self.layers is None or self._in_layers(module_key)

    def _in_layers(self, module_key: str) -> bool:
        match = None
        for program in self.layer_patterns or (_DEFAULT_LAYER_RE,):
            match = program.match(module_key)
            if match is not None:
                break  # PEFT stops at the first pattern that matches, even if its idx group is empty
        index = match.group("idx") if match is not None else None
        if index is None:
            return False
        return int(index) == self.layers if isinstance(self.layers, int) else int(index) in self.layers

    def rank(self, module_key: str, default):
        """The rank PEFT gives ``module_key``: the first rank_pattern key matching its end, else ``default``."""
        return _first_value(self.ranks, module_key, default)

    def alpha(self, module_key: str, default):
        """lora_alpha of ``module_key``: the first alpha_pattern key matching its end, else ``default``."""
        return _first_value(self.alphas, module_key, default)


def _first_value(patterns: tuple, module_key: str, default):
    for program, value in patterns:
        if program.match(module_key):
            return value
    return default
