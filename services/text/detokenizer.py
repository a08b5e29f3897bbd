"""Incremental detokenization and stop strings, per request.

Text is decoded from a sliding window of ids (prefix_offset..read_offset), so a multi-byte
character split across tokens is emitted only once it is complete. With stop strings, the last
len(longest stop) - 1 characters are held back from streaming until they cannot start a match;
the final text is cut right before the first stop string. As in vLLM, stop strings are looked
for only once `min_tokens` tokens are out (in the text those tokens add from then on).
"""

from __future__ import annotations

from moemesh.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], prompt_token_ids: list[int], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.num_tokens = 0  # output tokens appended
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids = prompt_token_ids[-6:]  # a little context so the first word decodes right
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all output text decoded so far
        self.num_emitted = 0  # characters of text already returned as deltas
        self.stopped = False

    def append(self, token_id: int) -> None:
        """Add one generated token; sets `stopped` when a stop string appears."""
        self.token_ids.append(token_id)
        self.num_tokens += 1
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # incomplete character: wait for more tokens
        new_text = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        start = max(0, len(self.text) - self.hold)
        self.text += new_text
        if self.stop and self.num_tokens >= self.min_tokens:
            cut = _first_stop(self.text, self.stop, start)
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True

    def delta(self, finished: bool) -> str:
        """Text not yet returned, keeping back what could still begin a stop string."""
        end = len(self.text) if finished or self.stopped else max(self.num_emitted, len(self.text) - self.hold)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta


def _first_stop(text: str, stop: tuple[str, ...], start: int) -> int | None:
    positions = [i for s in stop if (i := text.find(s, start)) >= 0]
    return min(positions) if positions else None
