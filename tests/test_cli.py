"""`lora-runner serve`'s options: generated from EngineConfig, today's names kept, no model needed."""

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest

from lora_runner.config import EngineConfig
from lora_runner.entrypoints import engine_args
from lora_runner.entrypoints.cli import add_serve_arguments, engine_config, server_config
from lora_runner.entrypoints.engine_args import DEFAULT_PROMPT_ADAPTER_TOKENS, option_name

FIELDS = [field.name for field in dataclasses.fields(EngineConfig)]
MODEL = "org/model"
# str fields: a valid value other than the default (a new str field needs one here)
STR_VALUES = {"revision": "v2", "device": "cpu", "dtype": "bfloat16", "scheduling_policy": "fcfs",
              "quantization": "fp8", "distributed_executor_backend": "mp", "structured_outputs_backend": "xgrammar"}
# dict fields, given as JSON text: (the option's words, the dict the config then holds)
JSON_VALUES = {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}
# settings that are only valid together: the option's partner and what the config then holds
PARTNERS = {"max_prompt_adapters": ([], {"max_prompt_adapter_tokens": DEFAULT_PROMPT_ADAPTER_TOKENS}),
            "max_prompt_adapter_tokens": (["--max-prompt-adapters", "1"], {"max_prompt_adapters": 1})}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def _non_default(field: dataclasses.Field) -> tuple[list[str], object]:
    """(command-line words, the value EngineConfig should then hold) for a value unlike the default."""
    option, default = option_name(field.name), field.default
    if field.type in ("bool", "bool | None"):
        return ([option], True) if not default else (["--no-" + option[2:]], False)
    if field.type in ("int", "int | None"):
        value = 40 if default is None else default + 3
    elif field.type == "float":
        value = default / 2
    elif field.name in JSON_VALUES:
        return [option, JSON_VALUES[field.name]], json.loads(JSON_VALUES[field.name])
    else:
        assert field.name in STR_VALUES, f"give EngineConfig.{field.name} a non-default value in STR_VALUES"
        value = STR_VALUES[field.name]
    return [option, str(value)], value


@pytest.mark.parametrize("name", FIELDS)
def test_every_engine_config_field_has_a_described_option(name):
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    assert field.metadata.get("help"), f"EngineConfig.{name} needs field(metadata={{'help': ...}})"
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    actions = {action.dest: action for action in parser._actions}
    assert name in actions and field.metadata["help"].replace("%", "%%") in actions[name].help


@pytest.mark.parametrize("name", [name for name in FIELDS if name != "model"])
def test_a_non_default_value_on_the_command_line_reaches_the_engine_config(name):
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    words, value = _non_default(field)
    partner_words, partner_values = PARTNERS.get(name, ([], {}))
    config = engine_config(_parse([MODEL, *words, *partner_words]))
    assert config == EngineConfig(MODEL, **{name: value, **partner_values})  # this field alone changed


def test_defaults_are_engine_config_defaults():
    assert engine_config(_parse([MODEL])) == EngineConfig(MODEL)


def test_a_field_without_help_is_refused(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        model: str = dataclasses.field(metadata={"help": "base model"})
        new_limit: int = 3

    monkeypatch.setattr(engine_args, "EngineConfig", Undocumented)
    with pytest.raises(ValueError, match="new_limit has no description"):
        engine_args.add_engine_arguments(argparse.ArgumentParser())


def test_todays_prompt_adapter_options_keep_working():
    implied = engine_config(_parse([MODEL, "--prompt-adapters", "soft=/adapters/soft"]))
    assert (implied.max_prompt_adapters, implied.max_prompt_adapter_tokens) == (1, DEFAULT_PROMPT_ADAPTER_TOKENS)
    alias = engine_config(_parse([MODEL, "--prompt-adapters", "soft=/a", "--max-prompt-adapter-token", "8"]))
    assert (alias.max_prompt_adapters, alias.max_prompt_adapter_tokens) == (1, 8)
    off = engine_config(_parse([MODEL]))
    assert (off.max_prompt_adapters, off.max_prompt_adapter_tokens) == (0, 0)


def test_max_logprobs_is_the_engines_alone():
    """One flag: --max-logprobs reaches EngineConfig, and the server has no second default of its own."""
    args = _parse([MODEL, "--max-logprobs", "50"])
    assert engine_config(args).max_logprobs == 50
    assert "max_logprobs" not in {field.name for field in dataclasses.fields(server_config(args))}


ENTRYPOINTS = Path(__file__).resolve().parents[1] / "lora_runner" / "entrypoints"


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ENTRYPOINTS)) for p in ENTRYPOINTS.rglob("*.py")
                                        if p.name != "cli.py"))
def test_nothing_below_the_cli_imports_it(path):
    """The CLI is the top: the server and the Ray deployments take configs, never cli's argparse."""
    tree = ast.parse((ENTRYPOINTS / path).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "lora_runner.entrypoints.cli" not in imported


def test_every_serve_option_has_a_one_line_description_and_help_shows_defaults(capsys):
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(parser)
    undescribed = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert undescribed == []
    from lora_runner.serve import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "(default: 8000)" in out and "(default: 1048576)" in out  # --port, --max-body-bytes


def test_without_the_serve_extra_the_entry_points_say_what_to_install():
    import subprocess
    import sys

    code = ("import sys; sys.modules['uvicorn'] = None\n"  # as if `pip install lora-runner` without [serve]
            "from lora_runner.serve import console_main, main\n"
            "sys.exit(10 * console_main(['serve', 'some-model']) + main(['some-model']))")  # --help needs no extra
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 22, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and all('pip install -e ".[serve]"' in line for line in lines), done.stderr
    assert "lora-runner[serve]'" not in done.stderr  # not on the package index: that command fails
    assert "Traceback" not in done.stderr
