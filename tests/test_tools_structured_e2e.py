"""Tool calls enforced by structured outputs, end to end: the official openai client against a live server
on the tiny byte-level checkpoint (tests/structured_support.py) with a Hermes-style tool template.

tool_choice "required" and a named function constrain the output (the engine's xgrammar path): every
call parses and its arguments validate against the tool's parameters (jsonschema), whole and streamed
(the deltas reassemble to the whole answer), with a LoRA and without, n=2. "auto" with response_format is
allowed, as vLLM does (the output follows the format; no call is forced); a forced choice with another
output constraint is a 400. An unconstrained request that shares steps with constrained ones keeps its
greedy tokens.
"""

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from serve_support import serve_args, start_server
from structured_support import save_byte_checkpoint
from test_tool_calls_server import HERMES_TEMPLATE

# bounded arguments (enums, ranged integers): a random model completes them in a few hundred tokens
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["tz"], "additionalProperties": False}
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in PARAMETERS.items()]
USER = [{"role": "user", "content": "weather?"}]
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, ServerState) of a server on the byte checkpoint, LoRAs "a" and "b" served."""
    from transformers import AutoTokenizer

    model_dir, loras = save_byte_checkpoint(tmp_path_factory.mktemp("tools-e2e"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    # the rendered tools are ~400 byte tokens: a longer context (plain RoPE: the weights do not change)
    config_file = Path(model_dir) / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "max_position_embeddings": 1536}))
    server, state = start_server(serve_args(model_dir, loras, extra=["--max-model-len", "1536"]))
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120), state
    server.stop()


def _ask(client, stream=False, **kwargs):
    kwargs = {"model": "base", "messages": USER, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 1.0,
              "seed": 2, **kwargs}  # seeds whose samples close their call arrays well before MAX_TOKENS
    return client.chat.completions.create(stream=stream, **kwargs)


def _whole_calls(response) -> dict[int, list[tuple[str, str]]]:
    """{choice index: [(name, arguments)]}, every choice finished with "tool_calls"."""
    calls = {}
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls[choice.index] = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    return calls


def _streamed_calls(chunks) -> dict[int, list[tuple[str, str]]]:
    """The same from stream chunks: each call's first delta has its id and name, the arguments reassemble."""
    deltas, finish = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content, choice  # a forced call is never content
            for call in choice.delta.tool_calls or []:
                deltas.setdefault(choice.index, {}).setdefault(call.index, []).append(call)
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert set(finish.values()) == {"tool_calls"}, finish
    calls = {}
    for index, by_call in deltas.items():
        calls[index] = []
        for position in sorted(by_call):
            first, *rest = by_call[position]
            assert first.id.startswith("call_") and first.type == "function" and first.function.name
            assert all(d.id is None and d.function.name is None for d in rest)
            calls[index].append((first.function.name, "".join(d.function.arguments or "" for d in by_call[position])))
    return calls


def _validate(calls: dict[int, list[tuple[str, str]]], n: int) -> None:
    assert sorted(calls) == list(range(n))
    for choice_calls in calls.values():
        assert choice_calls
        for name, arguments in choice_calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("model", ["base", "a"])
def test_required_calls_validate_whole_and_streamed(served, model):
    client, _ = served
    whole = _whole_calls(_ask(client, model=model, tool_choice="required", n=2))
    streamed = _streamed_calls(_ask(client, stream=True, model=model, tool_choice="required", n=2))
    _validate(whole, 2)
    assert streamed == whole  # the same seed: the same calls, streamed as OpenAI's deltas


@pytest.mark.parametrize("model", ["base", "b"])
def test_named_function_arguments_validate_whole_and_streamed(served, model):
    client, _ = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _whole_calls(_ask(client, model=model, tool_choice=choice, n=2, seed=5))
    streamed = _streamed_calls(_ask(client, stream=True, model=model, tool_choice=choice, n=2, seed=5))
    _validate(whole, 2)
    assert all(name == "get_weather" for calls in whole.values() for name, _ in calls)
    assert streamed == whole


def test_auto_with_response_format_follows_the_format_and_forced_choices_refuse_it(served):
    client, _ = served
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    response = _ask(client, tool_choice="auto", response_format=response_format, temperature=0.0)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls  # vLLM: allowed with "auto"
    jsonschema.validate(json.loads(choice.message.content), WEATHER)
    for forced in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.BadRequestError, match="forced tool_choice") as info:
            _ask(client, tool_choice=forced, response_format=response_format)
        assert info.value.response.json()["error"]["code"] == "invalid_tool_choice"


def test_an_unconstrained_request_sharing_steps_with_tool_calls_keeps_its_tokens(served):
    client, state = served
    engine = state.engine.engine
    plain = dict(model="a", prompt="plain words", max_tokens=40, temperature=0.0,
                 extra_body={"ignore_eos": True, "return_token_ids": True})
    alone = client.completions.create(**plain).choices[0]
    mixed_steps, execute = [], engine.runner.execute

    def spy(sched, grammar=None):  # a step that sampled constrained and unconstrained rows together
        if grammar is not None and len([s for s in sched.scheduled if s.samples]) > len(grammar.rows):
            mixed_steps.append(len(grammar.rows))
        return execute(sched, grammar)

    engine.runner.execute = spy
    try:
        streams = [_ask(client, stream=True, tool_choice="required", n=2, seed=seed) for seed in (2, 6)]
        firsts = [next(iter(stream)) for stream in streams]  # both running (their first output came)
        beside = client.completions.create(**plain).choices[0]  # while the streams wait unread
        for stream, first in zip(streams, firsts):
            _validate(_streamed_calls([first, *stream]), 2)
    finally:
        del engine.runner.execute
    assert mixed_steps, "the unconstrained request never shared a step with the constrained ones"
    assert beside.model_extra["token_ids"] == alone.model_extra["token_ids"] and beside.text == alone.text
