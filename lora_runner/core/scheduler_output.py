"""What one schedule() decided, as the engine and the runner read it (vLLM v1's SchedulerOutput).

The engine side reads `scheduled` (live requests: postprocess appends their tokens, the adapter seam
activates their adapters). The runner's persistent rows read plain data only, and trust it:

- `new_requests`: requests admitted this step, in full (token ids, computed count, every block id,
  adapter refs, virtual-token count, sampling params, generator, prompt length); a request resumed
  after preemption is new again, since its row was freed when it was preempted;
- `continuing`: requests that ran before and keep their row, as diffs (computed count, the block ids
  their table gained this step);
- `finished_ids` / `preempted_ids`: requests that left the running set since the previous output;
  their rows are freed before the step's rows are placed;
- `scheduled_ids` / `num_scheduled_tokens`: every scheduled request's id and token count, in batch
  order (the order of the flat batch and of the sampled rows);
- `lora_slots` / `prompt_slots`: adapter ref -> the device slot it holds this step (the placement
  schedule() asked for; a request whose adapter got none is in `failed`, never scheduled);
- `scheduled_spec_decode_tokens` (vLLM's name): request id -> the draft tokens its chunk verifies
  after its last token (speculative decoding, lora_runner.spec_decode); its `num_scheduled_tokens`
  count them, its token ids (request and row) do not.

The output is never edited after schedule() returns. The step's structured-output mask is its own
object, :class:`GrammarOutput` (vLLM's), made from the output and handed to the executor beside it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from lora_runner.core.request import Request
from lora_runner.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """A live request's share of one step: `num_new_tokens` tokens from position `start`, the last
    len(draft_token_ids) of them draft tokens proposed after the request's last token (speculative
    decoding: the step verifies them and yields 1 to len + 1 tokens)."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so a new token is sampled."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no row for: everything its row holds."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt (placeholders first) and any tokens generated before a preemption
    num_computed_tokens: int  # 0, or the leader's prompt blocks it shares (Scheduler.add)
    block_ids: tuple[int, ...]  # its whole KV block table after this step's allocation
    lora_ref: Hashable | None
    prompt_adapter_ref: Hashable | None
    num_virtual_tokens: int
    # its sampling settings, written into the row once (lora_runner.sample.sampling_state)
    params: SamplingParams | None = None  # None only where the rows keep no sampling settings (tests)
    generator: torch.Generator | None = None  # its own (seeded) generator; None: the sampler's
    num_prompt_tokens: int = 0  # the prompt after the placeholders; the tokens after it are generated


@dataclass(slots=True)
class ContinuingRequestData:
    """A request whose row the runner holds: what changed since its previous step."""

    request_id: str
    num_computed_tokens: int  # must equal the row's computed count
    new_block_ids: tuple[int, ...]  # blocks its table gained this step, appended in order


@dataclass
class Placement:
    """What making a step's adapters resident gave: the slots, and the requests whose adapter got none.

    ``unplaced``: request -> the error it fails with (its adapter's slot write raised, or making the
    step's adapters resident raised as a whole); schedule() takes those out of the step."""

    lora_slots: dict[Hashable, int] = field(default_factory=dict)  # LoRA ref -> device slot
    prompt_slots: dict[Hashable, int] = field(default_factory=dict)  # prompt-adapter ref -> device slot
    unplaced: dict[Request, BaseException] = field(default_factory=dict)


@dataclass(frozen=True)
class GrammarOutput:
    """The step's structured-output mask (vLLM's GrammarOutput), made after schedule() and handed to
    sampling beside the SchedulerOutput: for each constrained sampled row (its index among the step's
    sampled rows) a packed bitmask row of the ids it may sample. In a step with draft tokens the
    sampled rows are the verified positions (a speculating sequence with d drafts has d + 1 in order;
    position j's mask follows its first j drafts: lora_runner.spec_decode.grammar_masks)."""

    rows: tuple[int, ...]  # [C] sampled-row (position) index of each bitmask row
    bitmask: torch.Tensor  # [C, ceil(V / 32)] int32, bit t of a row: id t allowed


@dataclass
class SchedulerOutput:
    """What to run this step, and what left the running set (see the module docstring)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running first, then admitted
    # to finish with "error" (request.error or its adapter's load error): an adapter that failed to load or
    # got no slot, a grammar that failed, an error the engine set; none of them is in the step
    failed: list[Request] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    continuing: list[ContinuingRequestData] = field(default_factory=list)
    scheduled_ids: list[str] = field(default_factory=list)  # [B] batch order
    num_scheduled_tokens: list[int] = field(default_factory=list)  # [B] batch order
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the previous output
    preempted_ids: list[str] = field(default_factory=list)  # preempted by this schedule()
    lora_slots: dict[Hashable, int] = field(default_factory=dict)  # LoRA ref -> device slot this step
    prompt_slots: dict[Hashable, int] = field(default_factory=dict)  # prompt-adapter ref -> device slot
    # request id -> the draft tokens it verifies this step (only speculating requests have an entry)
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def add_new(self, scheduled: ScheduledRequest, block_ids: list[int]) -> None:
        """Schedule a request admitted this step (sent in full)."""
        request = scheduled.request
        self._add(scheduled)
        self.new_requests.append(NewRequestData(
            request.request_id, tuple(request.token_ids), scheduled.start, tuple(block_ids), request.lora_ref,
            request.prompt_adapter_ref, request.num_virtual_tokens, request.params, request.generator,
            request.num_prompt_tokens))

    def add_continuing(self, scheduled: ScheduledRequest, new_block_ids: list[int]) -> None:
        """Schedule a request that ran before (sent as a diff)."""
        self._add(scheduled)
        self.continuing.append(ContinuingRequestData(scheduled.request.request_id, scheduled.start,
                                                     tuple(new_block_ids)))

    def _add(self, scheduled: ScheduledRequest) -> None:
        self.scheduled.append(scheduled)
        self.scheduled_ids.append(scheduled.request.request_id)
        self.num_scheduled_tokens.append(scheduled.num_new_tokens)
        drafts = getattr(scheduled, "draft_token_ids", ())  # test doubles of ScheduledRequest may lack it
        if drafts:
            self.scheduled_spec_decode_tokens[scheduled.request.request_id] = drafts

    @property
    def left_ids(self) -> list[str]:
        """Ids whose rows go before this step's are placed: finished, aborted or preempted."""
        return self.finished_ids + self.preempted_ids

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's flat batch."""
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.scheduled
