"""Zero-cost statistical draft levels: prompt lookup (`pld`) and Max-Gram (`maxgram`).

Both draft from the token history alone (prompt + generated text, ending with the tree root = the last committed
token) and keep an index that grows with `extend`, so one step costs a few dict look-ups, not a rescan.

pld: HF transformers' prompt lookup (`prompt_lookup_num_tokens`, `PromptLookupCandidateGenerator`). For n from
    max_ngram down to 1, take the FIRST (leftmost) occurrence of the last n tokens that has at least one token
    after it, and propose the up to k tokens that followed it, stopping at the end of the history (the copy may
    run into the suffix itself). The first n with such an occurrence wins, even when its continuation is short.
    The proposal is cut before its first EOS; if that leaves nothing, nothing is proposed (no retry with a
    smaller n), as in HF. The index, per n: n-gram -> start of its first occurrence (HF's choice; valid iff it is
    not the suffix itself), in flat dicts: nothing per n-gram for the garbage collector to traverse.
    Note: HF's default max_matching_ngram_size is 2; `hf-pld` compares like for like only with the same value.

maxgram: CS Drafting's Max-Gram (arXiv 2312.11462). A suffix automaton of the history gives, in amortised O(1)
    per appended token, the longest suffix of the history that also occurs ending earlier, and (firstpos) the
    end of its first occurrence, which is CS Drafting's choice of occurrence. Every draft token is Max-Gram on
    the extended text (history + the tokens drafted so far): take the longest suffix of the extended text that
    occurs in the history with at least one history token after it; if it has >= min_match tokens, propose the
    token that followed its first occurrence. Walking the automaton keeps this O(1) per token: while the copy
    lasts it follows one occurrence; where the copy reaches the end of the history it falls back to the longest
    shorter match with an earlier occurrence. Matches shorter than min_match (default 2) fall back to the greedy
    bigram table built online from the history (token -> its most frequent successor so far, ties to the one
    seen most recently): a 1-token match is the same evidence as the bigram table, and the most frequent
    successor is a better guess than the first occurrence's successor. Drafting stops at EOS, or when the last
    token has no successor in the history.

Both implement `Lookup`: `extend` the history with committed tokens, `propose_after(extra, k)` the tokens that
continue history + extra (extra: drafted tokens not committed yet, e.g. a tree path) with the match length behind
the first one, which the router's acceptance estimates bucket by. `LOOKUP_CLASSES` names their classes.

Confidence (per draft token, in [0, 1], conditional on the earlier draft tokens being right; a path's confidence
is the product): a token copied after an n-token match gets match_confidence(n) = n / (n + 1) (1 -> 0.5,
2 -> 0.67, 3 -> 0.75, 9 -> 0.9); a bigram token gets BIGRAM_CONFIDENCE * count(a -> b) / count(a -> *), at most 0.5.
"""
from __future__ import annotations

from typing import Collection, Protocol, Sequence

from .sources import MAXGRAM, PLD

PLD_MAX_NGRAM = 3  # the prompt-lookup-decoding reference's default (HF's max_matching_ngram_size defaults to 2)
PLD_NUM_TOKENS = 10  # tokens proposed per step (`prompt_lookup_num_tokens` of hf-pld)
MAXGRAM_MIN_MATCH = 2  # Max-Gram copies after matches of at least this many tokens, else uses the bigram table
BIGRAM_CONFIDENCE = 0.5  # a bigram-table token's confidence at frequency 1 (a 1-token match's n / (n + 1))


def match_confidence(n: int) -> float:
    """Confidence of a token copied after an n-token match: n / (n + 1)."""
    return n / (n + 1)


class Lookup(Protocol):
    name: str  # its source name (dytc/sources.py)
    tokens: list[int]  # the history: every committed token so far; tokens[-1] is the tree root

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens to the history."""

    def propose_after(self, extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing history + extra, and the match length behind the first one (0: none)."""

    def finish(self) -> None:
        """The generation ended: what the lookup leaves for later generations (dytc/suffix.py)."""


def _cut_eos(tokens: list[int], eos_ids: Collection[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i]
    return tokens


class PromptLookup:
    """Prompt lookup decoding, matching HF's PromptLookupCandidateGenerator (see the module docstring)."""

    name = PLD

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = PLD_MAX_NGRAM,
                 eos_ids: Collection[int] = ()) -> None:
        assert max_ngram >= 1
        self.max_ngram = max_ngram
        self.eos_ids = frozenset(eos_ids)
        self.tokens: list[int] = []
        self.first: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # per n: n-gram -> start
        self.extend(tokens)

    def finish(self) -> None:
        """(Nothing outlives the generation.)"""

    def extend(self, tokens: Sequence[int]) -> None:
        hist, first = self.tokens, self.first
        for t in tokens:
            hist.append(int(t))
            end = len(hist)
            for n in range(1, min(self.max_ngram, end) + 1):
                first[n].setdefault(tuple(hist[end - n:]), end - n)

    def match(self) -> tuple[int, int]:
        """HF's match: (n, start of the occurrence) for the largest n whose suffix n-gram occurs earlier, taking
        the leftmost occurrence; (0, -1) if none."""
        hist, L = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            first = self.first[n][tuple(hist[L - n:])]
            if first < L - n:  # not the suffix itself: at least one token follows
                return n, first
        return 0, -1

    def propose(self, k: int = PLD_NUM_TOKENS) -> tuple[list[int], list[float]]:
        n, start = self.match()
        if n == 0 or k <= 0:
            return [], []
        out = _cut_eos(self.tokens[start + n:start + n + k], self.eos_ids)
        return out, [match_confidence(n)] * len(out)

    def propose_after(self, extra: Sequence[int], k: int = PLD_NUM_TOKENS) -> tuple[list[int], int]:
        """Up to k tokens continuing history + extra (drafted tokens not in the history, e.g. a tree path), copied
        from the history after the leftmost occurrence of the longest matching suffix; and the match length n
        (0: none). With extra = [] this is `propose`."""
        hist, L = self.tokens, len(self.tokens)
        tail = hist[-self.max_ngram:] + list(extra)
        for n in range(min(self.max_ngram, L - 1 + len(extra)), 0, -1):
            if n > len(tail):
                continue
            start = self.first[n].get(tuple(tail[len(tail) - n:]), L)
            if start < L - n:  # at least one history token follows the occurrence
                out = _cut_eos(hist[start + n:start + n + k], self.eos_ids) if k > 0 else []
                return out, (n if out else 0)
        return [], 0


class MaxGram:
    """CS Drafting's Max-Gram over a suffix automaton, with an online greedy bigram fallback (see the module
    docstring)."""

    name = MAXGRAM

    def __init__(self, tokens: Sequence[int] = (), min_match: int = MAXGRAM_MIN_MATCH,
                 eos_ids: Collection[int] = ()) -> None:
        assert min_match >= 1
        self.min_match = min_match
        self.eos_ids = frozenset(eos_ids)
        self.tokens: list[int] = []
        # suffix automaton: per state its transitions, suffix link, longest length, end of first occurrence
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first: list[int] = [-1]
        self.last = 0  # the state of the whole history
        # bigram table: successor counts, successor totals, most frequent successor (ties: most recent)
        self.follow: dict[int, dict[int, int]] = {}
        self.total: dict[int, int] = {}
        self.best: dict[int, int] = {}
        self.extend(tokens)

    def finish(self) -> None:
        """(Nothing outlives the generation.)"""

    def _state(self, length: int, link: int, first: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        return len(self.length) - 1

    def _append(self, c: int) -> None:
        """The standard online suffix-automaton extension, with firstpos."""
        nxt, link, length = self.next, self.link, self.length
        cur = self._state(length[self.last] + 1, 0, len(self.tokens) - 1, {})
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._state(length[p] + 1, link[q], self.first[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            t = int(t)
            if self.tokens:
                a = self.tokens[-1]
                counts = self.follow.setdefault(a, {})
                counts[t] = counts.get(t, 0) + 1
                self.total[a] = self.total.get(a, 0) + 1
                b = self.best.get(a)
                if b is None or counts[t] >= counts[b]:
                    self.best[a] = t
            self.tokens.append(t)
            self._append(t)

    def longest_match(self) -> tuple[int, int]:
        """(length, end): the longest suffix of the history that also occurs ending earlier, and the end position
        of its first occurrence; (0, -1) if the last token is new (or the history is empty)."""
        v = self.link[self.last]
        return (self.length[v], self.first[v]) if v > 0 else (0, -1)

    def propose(self, k: int) -> tuple[list[int], list[float]]:
        """Up to k tokens continuing the history, and the confidence of each."""
        tokens, conf, _ = self._draft((), k)
        return tokens, conf

    def propose_after(self, extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing history + extra, and the match length behind the first one (a bigram-table
        token counts as a 1-token match: the same evidence); 0 when nothing is proposed."""
        tokens, _, match = self._draft(extra, k)
        return tokens, match

    def _draft(self, extra: Sequence[int], k: int) -> tuple[list[int], list[float], int]:
        """Max-Gram token by token on history + extra + the tokens drafted so far: (tokens, confidences, match
        length behind the first token)."""
        hist, L = self.tokens, len(self.tokens)
        if L == 0 or k <= 0:
            return [], [], 0
        v = max(self.link[self.last], 0)  # state of the current match; invariant: v == 0 or first[v] <= L - 2
        n = self.length[v]  # current match length (between length[link[v]] + 1 and length[v])
        prev = hist[-1]
        for t in extra:
            v, n = self._advance(v, n, t)
            prev = t
        out: list[int] = []
        conf: list[float] = []
        first_match = 0
        while len(out) < k:
            if n >= self.min_match:
                t, c, m = hist[self.first[v] + 1], match_confidence(n), n
            else:
                t = self.best.get(prev)
                if t is None:  # prev has no successor in the history
                    break
                c, m = BIGRAM_CONFIDENCE * self.follow[prev][t] / self.total[prev], 1
            if t in self.eos_ids:
                break
            out.append(t)
            conf.append(c)
            first_match = first_match or m
            prev = t
            v, n = self._advance(v, n, t)
        return out, conf, first_match

    def _advance(self, v: int, n: int, t: int) -> tuple[int, int]:
        """The state and length of the longest suffix of (text + t) that occurs in the history with a token after
        it, from those of the text (v, n)."""
        nxt, link, length, first, L = self.next, self.link, self.length, self.first, len(self.tokens)
        while v > 0 and t not in nxt[v]:
            v = link[v]
            n = length[v]
        if t in nxt[v]:
            v, n = nxt[v][t], n + 1
        while v > 0 and first[v] >= L - 1:  # only occurrence ends at the last token: nothing follows
            v = link[v]
            n = length[v]
        return v, n


LOOKUP_CLASSES: dict[str, type] = {PLD: PromptLookup, MAXGRAM: MaxGram}  # source name -> lookup class (those over
# the history alone; dytc/shared.py's new_lookup makes every source's)

