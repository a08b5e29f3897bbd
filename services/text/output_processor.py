"""One request's output as text: incremental detokenization, stop strings and min_tokens.

Used by the offline engine (LLMEngine, for `LLM.generate`) and by the router (for every stream
it serves), so both cut the same text at the same place. Each call takes the tokens a step
produced and returns the text to send, so the work per step is proportional to the new tokens,
never to the output so far:

- Text is decoded from a short window of ids (the tokens since the last complete piece of text,
  after a little prompt context), so a multi-byte character split across tokens is emitted only
  once it is complete.
- With stop strings, the last len(longest stop) - 1 characters are held back until they cannot
  start a match; the text is cut right before the first stop string, and the tokens after the
  one that completed it (a speculative round's extra tokens) are not kept.
- As in vLLM, stop strings are looked for only once `min_tokens` tokens are out (in the text
  those tokens add from then on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moemesh.text.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first output token, so its first word decodes right


@dataclass(frozen=True)
class OutputDelta:
    num_kept: int  # how many of the given tokens are output (fewer when a stop string ended it)
    text: str  # text to send now
    stopped: bool  # a stop string ended the output


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...], prompt_token_ids: Sequence[int], min_tokens: int = 0
    ):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.num_tokens = 0  # output tokens taken
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1
        # the ids of the last piece of text out (the decoding's context), then those not decoded yet
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._num_read = len(self._window)  # how many of the window are context
        self._pending = ""  # decoded text not yet sent (held back for a stop string, or the step's)

    def process(self, token_ids: Sequence[int], finished: bool) -> OutputDelta:
        """Take one step's new tokens; `finished`: the request ended (EOS, a stop token, length,
        abort), so nothing is held back."""
        num_kept = 0
        for token_id in token_ids:
            if self.stopped:
                break
            self._append(token_id)
            num_kept += 1
        return OutputDelta(num_kept, self._take(finished or self.stopped), self.stopped)

    def _append(self, token_id: int) -> None:
        window = self._window
        window.append(token_id)
        self.num_tokens += 1
        prefix = self.tokenizer.decode(window[: self._num_read])
        full = self.tokenizer.decode(window)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # incomplete character: wait for more tokens
        del window[: self._num_read]  # what decoded before is only context now: keep the new ids
        self._num_read = len(window)
        start = max(0, len(self._pending) - self._hold)  # a match may begin in the held-back text
        self._pending += full[len(prefix) :]
        if self.stop and self.num_tokens >= self.min_tokens:
            cut = _first_stop(self._pending, self.stop, start)
            if cut is not None:
                self._pending = self._pending[:cut]
                self.stopped = True

    def _take(self, final: bool) -> str:
        """The text to send, keeping back (unless `final`) what could still begin a stop string."""
        end = len(self._pending) if final else max(0, len(self._pending) - self._hold)
        text, self._pending = self._pending[:end], self._pending[end:]
        return text


def _first_stop(text: str, stop: tuple[str, ...], start: int) -> int | None:
    positions = [i for s in stop if (i := text.find(s, start)) >= 0]
    return min(positions) if positions else None
