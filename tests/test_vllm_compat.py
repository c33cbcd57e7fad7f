"""vLLM's spellings that users bring along (issue 24, "vLLM's habits"): LoRARequest(name, int_id, path),
`from lora_runner import LoRARequest`, `serve --enable-lora`, and --lora-modules in vLLM's JSON form."""

import argparse

import pytest

import adapters
import lora_runner
from lora_runner import LoRARequest, PromptAdapterRequest
from lora_runner.entrypoints.cli import add_serve_arguments, startup_adapters


def test_the_adapter_requests_are_exported_from_the_package():
    assert lora_runner.LoRARequest is adapters.LoRARequest
    assert lora_runner.PromptAdapterRequest is adapters.PromptAdapterRequest


def test_vllm_positional_lora_request_is_the_same_request():
    assert LoRARequest("sql", 1, "/adapters/sql") == LoRARequest("sql", "/adapters/sql")
    request = LoRARequest("sql", 7, "org/sql-lora")
    assert (request.lora_name, request.lora_path, request.revision) == ("sql", "org/sql-lora", None)
    assert LoRARequest("sql", "org/sql-lora", "v2").revision == "v2"  # our own positional form is unchanged
    with pytest.raises(ValueError, match="must be >= 1"):
        LoRARequest("sql", 0, "/adapters/sql")
    with pytest.raises(ValueError, match="path must be a non-empty string"):
        LoRARequest("sql", True, "/adapters/sql")  # a bool is not an id
    with pytest.raises(ValueError, match="path must be a non-empty string"):
        PromptAdapterRequest("soft", 3, None)


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["model-dir", *argv])


def test_serve_takes_enable_lora_and_json_lora_modules():
    args = _parse(["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/a/sql", "base_model_name": "m"}',
                   "chat=org/chat@v1"])  # @REVISION: Hub ids only (refused after a local dir)
    assert args.enable_lora is True
    assert startup_adapters(args).loras == (LoRARequest("sql", "/a/sql"), LoRARequest("chat", "org/chat", "v1"))


@pytest.mark.parametrize("spec", ['{"name": "sql"}', '{"name": "sql", "path": "/a", "extra": 1}',
                                  '{"name": 1, "path": "/a"}', '{"name": "sql", "path": "/a"', '["sql", "/a"]'])
def test_bad_json_lora_modules_are_a_usage_error(spec, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--lora-modules", spec])
    assert exit_info.value.code == 2
    assert "--lora-modules" in capsys.readouterr().err


def test_cumulative_logprob_is_the_sum_of_the_chosen_tokens_logprobs(engine_checkpoint, greedy_oracle):
    from lora_runner import LLM, SamplingParams
    from lora_runner.outputs import CompletionOutput

    assert CompletionOutput(0, [3, 5], logprobs=[{3: -0.5, 1: -0.1}, {5: -0.25}]).cumulative_logprob == -0.75
    assert CompletionOutput(0, [3, 5]).cumulative_logprob is None  # no logprobs asked: None, as vLLM v1
    path, hf, _ = engine_checkpoint
    llm = LLM(path, device="cpu", max_model_len=64)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.close()
    tokens, logprobs = greedy_oracle(hf, [5, 6, 7], 6)
    assert out.token_ids == tokens
    assert out.cumulative_logprob == pytest.approx(float(sum(logprobs)), abs=1e-4)


def test_truncate_prompt_tokens_keeps_the_last_k_prompt_tokens(engine_checkpoint):
    from lora_runner import LLM, SamplingParams

    path, _, _ = engine_checkpoint
    llm = LLM(path, device="cpu", max_model_len=32)
    try:
        long_prompt = [5 + i % 40 for i in range(50)]  # over max_model_len: refused unless truncated
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([long_prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
        cut, whole = llm.generate([long_prompt, long_prompt[-10:]],
                                  [SamplingParams(**greedy, truncate_prompt_tokens=10), SamplingParams(**greedy)],
                                  use_tqdm=False)
        assert cut.prompt_token_ids == long_prompt[-10:] and cut.outputs[0].token_ids == whole.outputs[0].token_ids
        every = llm.generate([long_prompt], SamplingParams(**greedy, truncate_prompt_tokens=-1), use_tqdm=False)[0]
        assert every.prompt_token_ids == long_prompt[-32:]
    finally:
        llm.close()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
