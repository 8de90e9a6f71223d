"""Generated ids as text, handed out while they are generated, and the stop strings that end a sequence."""
from __future__ import annotations


class TextStream:
    """The text of generated ids, handed out in pieces that add up to the final text: a character split over byte
    tokens is held back until complete, and so is any tail that could begin a stop string. `feed` returns (new
    text, whether a stop string ended the text); the text then ends before the stop string."""

    def __init__(self, tokenizer, skip_ids: set[int], stops: list[str]) -> None:
        self.tokenizer, self.skip, self.stops = tokenizer, skip_ids, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = ""

    def feed(self, token_id: int) -> tuple[str, bool]:
        if token_id in self.skip:
            return "", False
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            return self._emit(text[:min(hits)]), True
        if text.endswith("\ufffd"):
            return "", False
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(text[:len(text) - hold]), False

    def finish(self) -> str:
        """What was held back (a partial stop string that never completed, a cut-off character)."""
        return self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece
