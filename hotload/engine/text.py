"""Incremental detokenisation with stop strings, as a pure state machine.

A tokenizer decodes a growing list of ids into text that is not always an extension of the
previous decode (WordPiece merges "##" pieces, byte-level BPE completes UTF-8 sequences), and a
stop string may straddle tokens. `TextAssembler` re-decodes the whole completion after each
token and only releases text that is stable: it never emits text it would later take back, and
never emits any part of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextAssembler:
    """Turn token ids into text deltas; stop at the first stop string (excluded from the text)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        # Up to this many trailing characters could be the start of a stop string: hold them.
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.emitted = ""
        self.text = ""
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Account for the completion so far (`token_ids`, all of them); return new stable text."""
        full = self._decode(token_ids)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            self.text = full[:cut]
            return self._release(self.text)
        self.text = full
        # max(0, ...): a text shorter than the hold-back must release nothing, not full[:-k].
        safe = full[: max(0, len(full) - self._holdback)] if self._holdback else full
        # A replacement character at the end is usually half of a multi-byte character.
        while safe.endswith("\ufffd"):
            safe = safe[:-1]
        return self._release(safe)

    def finish(self) -> str:
        """The generation ended: release whatever is still held back."""
        return self._release(self.text)

    def _release(self, upto: str) -> str:
        if len(upto) > len(self.emitted) and upto.startswith(self.emitted):
            delta = upto[len(self.emitted) :]
            self.emitted = upto
            return delta
        return ""

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
