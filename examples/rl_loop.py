"""A reinforcement-learning loop with a LoRA policy that changes every step (issue 36), on CPU.

Each step: the engine samples completions from the current policy version, a toy reward scores them
(the share of its tokens among the vocabulary's first LOW_TOKENS), PEFT takes one REINFORCE step on the trainer's copy of
the LoRA, and the new weights go to the engine from memory (``LLM.update_lora``: no folder, no
re-read). Every sample names the adapter version it came from (``RequestOutput.lora_version``), and
the loop checks it is the version just pushed. Printed per step: the version, the mean reward, the
update latency (the ``update_lora`` call) and the time from the call to the first token served by the
new version.

    python examples/rl_loop.py --steps 8

The model is a tiny random Llama written to a temporary folder (no download); the loop is the point,
not the learning.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch

LOW_TOKENS = 16  # the toy reward: the share of a completion's tokens below this id
PROMPTS = [[1, 20 + i, 30 + i, 40 + i] for i in range(4)]

logger = logging.getLogger("rl_loop")


def tiny_model(path: str, vocab_size: int = 64, seed: int = 0):
    """A small random Llama saved to ``path`` (the engine's base) and returned (the trainer's base)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def completion_logprob(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The trainer's log-probability of ``completion`` after ``prompt`` (differentiable)."""
    ids = torch.tensor([prompt + completion])  # [1, L]
    logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [len(completion), V]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None]).sum()


def run(steps: int = 5, samples_per_prompt: int = 4, max_tokens: int = 6, lr: float = 5e-3, seed: int = 0) -> list[dict]:
    """Run the loop; one record per step: version, mean reward, update and first-token latency (s)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from lora_runner import LLM, SamplingParams

    records = []
    with tempfile.TemporaryDirectory() as folder:
        base = tiny_model(folder, seed=seed)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        policy = get_peft_model(base, config)
        optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=lr)
        llm = LLM(folder, device="cpu", dtype="float32", max_model_len=64, max_loras=2, max_lora_rank=8,
                  max_num_seqs=16, block_size=4)
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=samples_per_prompt, seed=seed)
        first_token = SamplingParams(temperature=0.0, max_tokens=1)
        try:
            for step in range(steps):
                start = time.perf_counter()
                served = llm.update_lora("policy", get_peft_model_state_dict(policy), config)
                pushed = time.perf_counter()
                llm.generate([PROMPTS[0]], first_token, lora_request=served.request, use_tqdm=False)
                first = time.perf_counter()
                outputs = llm.generate(PROMPTS, params, lora_request=served.request, use_tqdm=False)
                assert all(output.lora_version == served.version for output in outputs), "a sample of another version"
                samples = [(output.prompt_token_ids, list(c.token_ids)) for output in outputs for c in output.outputs]
                rewards = torch.tensor([sum(t < LOW_TOKENS for t in tokens) / len(tokens) for _, tokens in samples])
                advantages = rewards - rewards.mean()
                loss = -sum(a * completion_logprob(policy, p, c) for a, (p, c) in zip(advantages, samples)) / len(samples)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                records.append(dict(step=step, version=served.version.version, reward=float(rewards.mean()),
                                    update_s=pushed - start, first_token_s=first - start))
                logger.info("step %d: version %d, mean reward %.3f, update %.1f ms, first token of the new "
                            "version %.1f ms", step, served.version.version, rewards.mean(), 1e3 * (pushed - start),
                            1e3 * (first - start))
        finally:
            llm.close()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    records = run(args.steps, args.samples_per_prompt)
    versions = [r["version"] for r in records]
    print(f"versions served: {versions}; every sample named the version it came from")
    print(f"update latency: median {1e3 * sorted(r['update_s'] for r in records)[len(records) // 2]:.1f} ms")


if __name__ == "__main__":
    main()
