"""Incremental detokenization: each step's new text of one request, without re-decoding its output.

Decoding token by token goes wrong two ways: a byte-level token may end inside a UTF-8 sequence
(its text is a replacement character until the next token completes it), and a tokenizer may join
tokens (spaces between words, a leading-space marker dropped at the start of a text). So, as vLLM
does, the decoder keeps two offsets into the output ids: `prefix_offset..read_offset` is a window
of already-reported tokens, decoded again as context; the text of `prefix_offset..end` minus that
context's text is the new text. It is reported only when it does not end in an unfinished
character ("\\ufffd"), and then the window moves on. `flush()` reports what is still held back once
the request ends, so the concatenated deltas equal ``tokenizer.decode(all ids)``.

Stop strings are matched on that stable text (OutputText), across token boundaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a UTF-8 sequence cut short decodes to


class IncrementalDetokenizer:
    """One request's output ids -> text deltas. decode: ids -> text (for a transformers tokenizer,
    ``lambda ids: tok.decode(ids, skip_special_tokens=True)``), or None for no text."""

    def __init__(self, decode: Callable[[list[int]], str] | None) -> None:
        self.decode = decode
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window (already reported tokens)
        self.read_offset = 0  # first token whose text is not reported yet

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the text they complete ("" while a character is unfinished)."""
        self.token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character, as the tokenizer decodes it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.decode is None or self.read_offset == len(self.token_ids):
            return ""
        context = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(context) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing new yet (special tokens skipped, or a character cut short)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(context):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.decode(token_ids) if token_ids else ""


class OutputText:
    """One request's output text: decoded incrementally, cut at its first stop string.

    decode: as for IncrementalDetokenizer. stop: the stop strings; include_stop: keep the matched one
    in the text; holdback: characters at the end of the text not reported yet
    (SamplingParams.stop_text_holdback), since a stop string completing later may cut them.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, stop: Sequence[str] = (),
                 include_stop: bool = False, holdback: int = 0) -> None:
        self.detokenizer = IncrementalDetokenizer(decode)
        self.stop = list(stop)
        self.include_stop = include_stop
        self.holdback = holdback
        self.text = ""  # stable text so far (ends at the stop string once one matched)
        self.num_reported = 0  # characters of text handed out by take_delta
        self.stopped = False

    def add(self, token_id: int, match_stop: bool = True) -> str | None:
        """Append one token; returns the stop string it completed (the text is cut there), else None.
        match_stop=False (before min_tokens): the new text is not searched."""
        return self._extend(self.detokenizer.add([token_id]), match_stop)

    def finish(self, match_stop: bool = True) -> str | None:
        """The request ends: the held-back text joins (searched for stop strings like the rest).
        Returns the stop string it completed, else None. Nothing is held back from now on."""
        matched = None if self.stopped else self._extend(self.detokenizer.flush(), match_stop)
        self.holdback = 0
        return matched

    def _extend(self, new_text: str, match_stop: bool) -> str | None:
        if not new_text or self.stopped:
            return None
        start = len(self.text)
        self.text += new_text
        if not (match_stop and self.stop):
            return None
        return self._cut_at_stop(start)

    def _cut_at_stop(self, new_start: int) -> str | None:
        """Find the stop string completed first (the earliest end; at equal ends the longest) among
        those ending in the new text; cut the text there."""
        hits = []  # (end, -length, stop string); searched from where an occurrence would end in the new text
        for stop in self.stop:
            found = self.text.find(stop, max(0, new_start - len(stop) + 1))
            if found >= 0:
                hits.append((found + len(stop), -len(stop), stop))
        if not hits:
            return None
        end, neg_length, stop = min(hits)
        self.text = self.text[:end if self.include_stop else end + neg_length]
        self.stopped = True
        return stop

    @property
    def reportable(self) -> str:
        """The text that may be handed out now (the held-back tail excluded)."""
        if self.stopped or not self.holdback:
            return self.text
        return self.text[:max(len(self.text) - self.holdback, 0)]

    def take_delta(self) -> str:
        """The reportable text not handed out before; marks it handed out."""
        text = self.reportable
        delta = text[self.num_reported:]
        self.num_reported = max(self.num_reported, len(text))
        return delta
