"""A generation's text as its tokens come, at a cost linear in its length: incremental detokenization (a short
window decoded per update) and stop strings looked for only where a new match could be."""
from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[list[int]], str]  # token ids -> text (the engine's: the tokenizer's, special tokens skipped)


class IncrementalDetokenizer:
    """The text of a token sequence that grows at its end, decoding a short window per update (the prefix and read
    offsets of HF text-generation-inference and vLLM). ids[prefix:read] are the tokens settled last: they are
    decoded again in front of the new ones, so that a tokenizer which drops the first token's leading space
    (SentencePiece) or joins bytes across tokens (byte-level BPE, byte fallback) gives the new tokens the text that
    the whole sequence's decode gives them. Text settles at the last update whose decode does not end in U+FFFD
    (an unfinished UTF-8 sequence shows as U+FFFD until its last byte comes).

    Invariant: the settled text (the pieces `update` returned) + `tail` == decode(ids), wherever the decode of a
    window that starts at a settled boundary is the whole decode's text from there. Where it is not, the settled
    text stays as it was: a byte-fallback run of byte tokens that turns invalid after a whole char (decode(ids)
    makes the whole run U+FFFD) keeps the chars it settled. The window grows while new tokens add no text (skipped
    special tokens) or end in an unfinished UTF-8 sequence."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.prefix = self.read = 0  # token offsets: the window starts at prefix; text is settled up to read
        self.seen = 0  # tokens decoded
        self.context = ""  # decode(ids[prefix:read])
        self.tail = ""  # the text of ids[read:], not settled yet

    def update(self, ids: Sequence[int]) -> str:
        """Catch up with `ids` (the whole sequence so far); return the text the new tokens settle."""
        if len(ids) == self.seen:
            return ""
        self.seen = len(ids)
        self.tail = self.decode(list(ids[self.prefix:]))[len(self.context):]
        if not self.tail or self.tail.endswith("\ufffd"):
            return ""
        piece, self.tail = self.tail, ""
        self.prefix, self.read = self.read, len(ids)
        self.context = self.decode(list(ids[self.prefix:self.read]))
        return piece


class TextStream:
    """A generation's text, handed out in pieces as its tokens come: decoded incrementally, cut where the earliest
    stop string begins, and holding back the last `hold` settled chars (a stop string could still claim them).
    A stop string is looked for only where a new match could be: the last `hold` settled chars, the text just
    settled and the unsettled tail. The pieces concatenate to `text`: decode(ids), cut at the earliest stop
    string."""

    def __init__(self, decode: Decode, stops: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(decode)
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.unsent = ""  # settled text not handed out: it ends with the last `hold` settled chars
        self.cut: int | None = None  # where the earliest stop string begins, in unsent + tail
        self.pieces: list[str] = []  # handed out

    def update(self, ids: Sequence[int]) -> bool:
        """Catch up with `ids` (the whole output so far); True once the text holds a stop string."""
        if self.cut is not None:
            return True
        piece = self.detok.update(ids)
        if self.stops:
            kept = self.unsent[max(len(self.unsent) - self.hold, 0):]
            window = kept + piece + self.detok.tail
            found = [i for i in (window.find(s) for s in self.stops) if i >= 0]
            if found:
                self.cut = len(self.unsent) - len(kept) + min(found)
        self.unsent += piece
        return self.cut is not None

    def ready(self) -> str:
        """The settled text no stop string can claim any more, not handed out yet ("" once a stop string is in)."""
        n = len(self.unsent) - self.hold
        if self.cut is not None or n <= 0:
            return ""
        return self._hand_out(n)

    def finish(self, ids: Sequence[int]) -> str:
        """Once, at the end: the rest of the text of `ids` (an unfinished UTF-8 sequence as U+FFFD), cut at the stop
        string `update` found (tokens it was not given, such as an EOS, are not looked at for one)."""
        self.unsent += self.detok.update(ids) + self.detok.tail
        return self._hand_out(len(self.unsent) if self.cut is None else self.cut)

    def _hand_out(self, n: int) -> str:
        piece, self.unsent = self.unsent[:n], self.unsent[n:]
        self.pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        return "".join(self.pieces)
