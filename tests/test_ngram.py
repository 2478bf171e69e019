"""The zero-cost draft levels (dytc/ngram.py) against brute-force references and HF's prompt lookup."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dytc.ngram import LOOKUP_CLASSES, MaxGram, PromptLookup, match_confidence
from dytc.shared import new_lookup

SETTINGS = settings(max_examples=150, deadline=None)
histories = st.lists(st.integers(0, 4), max_size=50)  # a small alphabet: many repeats
nonempty = st.lists(st.integers(0, 4), min_size=1, max_size=50)
ks = st.integers(0, 12)


# ---------------------------------------------------------------------------------------------- references
def ref_pld(hist: list[int], k: int, max_ngram: int = 3, eos: frozenset[int] = frozenset()) -> list[int]:
    """A literal port of HF's PromptLookupCandidateGenerator.get_candidates (no logits processor)."""
    L = len(hist)
    for n in range(min(max_ngram, L - 1), 0, -1):
        for idx in range(L - n + 1):  # windows left to right
            if hist[idx:idx + n] == hist[L - n:]:
                start, end = idx + n, min(idx + n + k, L)
                if start < end:
                    out = hist[start:end]
                    cut = next((i for i, t in enumerate(out) if t in eos), len(out))
                    return out[:cut]
    return []


def ref_longest_match(hist: list[int]) -> tuple[int, int]:
    """The longest suffix that also ends at an earlier position, and its earliest end."""
    L = len(hist)
    for n in range(L - 1, 0, -1):
        ends = [e for e in range(n - 1, L - 1) if hist[e - n + 1:e + 1] == hist[L - n:]]
        if ends:
            return n, ends[0]
    return 0, -1


def ref_bigram(hist: list[int], a: int) -> tuple[int, float] | None:
    """Most frequent successor of a (ties: latest last occurrence) and its frequency."""
    counts: dict[int, int] = {}
    latest: dict[int, int] = {}
    for i in range(len(hist) - 1):
        if hist[i] == a:
            counts[hist[i + 1]] = counts.get(hist[i + 1], 0) + 1
            latest[hist[i + 1]] = i
    if not counts:
        return None
    b = max(counts, key=lambda t: (counts[t], latest[t]))
    return b, counts[b] / sum(counts.values())


def ref_maxgram(hist: list[int], k: int, min_match: int = 2, eos: frozenset[int] = frozenset(),
                extra: list[int] = (), matches: list[int] | None = None) -> tuple[list[int], list[float]]:
    """Max-Gram on the extended text (hist + extra + the tokens drafted so far), token by token, by brute force;
    `matches` gets the match length behind each token (a bigram token: 1)."""
    L = len(hist)
    out: list[int] = []
    conf: list[float] = []
    matches = [] if matches is None else matches
    if L == 0:
        return out, conf
    while len(out) < k:
        ext = hist + list(extra) + out
        n_best, e_best = 0, -1
        for n in range(1, len(ext) + 1):  # longest suffix of ext occurring in hist with a token after it
            ends = [e for e in range(n - 1, L - 1) if hist[e - n + 1:e + 1] == ext[-n:]]
            if not ends:
                break
            n_best, e_best = n, ends[0]
        if n_best >= min_match:
            t, c = hist[e_best + 1], match_confidence(n_best)
        else:
            bg = ref_bigram(hist, ext[-1])
            if bg is None:
                break
            t, c = bg[0], 0.5 * bg[1]
        if t in eos:
            break
        out.append(t)
        conf.append(c)
        matches.append(n_best if n_best >= min_match else 1)
    return out, conf


# ---------------------------------------------------------------------------------------------- PLD
@SETTINGS
@given(histories, ks, st.integers(1, 4))
def test_pld_equals_reference(hist, k, max_ngram):
    out, conf = PromptLookup(hist, max_ngram=max_ngram).propose(k)
    assert out == ref_pld(hist, k, max_ngram)
    assert len(conf) == len(out) and all(0 < c < 1 for c in conf)


@SETTINGS
@given(nonempty, st.integers(1, 12), st.integers(1, 3), st.sampled_from([None, 0, 3]))
def test_pld_equals_hf(hist, k, max_ngram, eos):
    """Our `pld` proposes exactly what HF's prompt lookup (hf-pld) proposes, EOS handling included."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    hf = PromptLookupCandidateGenerator(eos_token_id=None if eos is None else torch.tensor([eos]),
                                        num_output_tokens=k, max_matching_ngram_size=max_ngram,
                                        max_length=len(hist) + 100)
    ids, _ = hf.get_candidates(torch.tensor([hist]))
    ours, _ = PromptLookup(hist, max_ngram=max_ngram, eos_ids=() if eos is None else (eos,)).propose(k)
    assert ours == ids[0, len(hist):].tolist()


def test_pld_takes_leftmost_occurrence_and_largest_n():
    hist = [7, 1, 2, 8, 1, 2, 9, 3, 1, 2]
    d = PromptLookup(hist)
    assert d.match() == (2, 1)  # "1 2" first occurs at 1 (the trigram "3 1 2" is new)
    assert d.propose(3) == ([8, 1, 2], [match_confidence(2)] * 3)
    assert d.propose(1)[0] == [8]


def test_pld_short_continuation_is_kept():
    # the only earlier occurrence of the last trigram ends right before the suffix: the copy stops at the end
    d = PromptLookup([1, 2, 3, 1, 2, 3])
    assert d.match() == (3, 0)
    assert d.propose(10)[0] == [1, 2, 3]


def test_pld_eos_cuts_and_does_not_retry():
    d = PromptLookup([5, 6, 2, 9, 5, 6], eos_ids=(2,))
    assert d.propose(10) == ([], [])  # HF: the match was found, its continuation starts with EOS
    d = PromptLookup([5, 6, 4, 2, 9, 5, 6], eos_ids=(2,))
    assert d.propose(10)[0] == [4]


def test_pld_empty_and_short():
    assert PromptLookup().propose(10) == ([], [])
    assert PromptLookup([3]).propose(10) == ([], [])
    assert PromptLookup([3, 3]).propose(10)[0] == [3]
    assert PromptLookup([1, 2, 1]).propose(0) == ([], [])


# ---------------------------------------------------------------------------------------------- Max-Gram
@SETTINGS
@given(histories)
def test_maxgram_longest_match_equals_brute_force(hist):
    d = MaxGram(hist)
    assert d.longest_match() == ref_longest_match(hist)
    assert len(d.length) <= max(2 * len(hist), 1)  # suffix automaton size bound (states incl. the root)


@SETTINGS
@given(histories, ks, st.integers(1, 3), st.sampled_from([(), (0,)]))
def test_maxgram_propose_equals_reference(hist, k, min_match, eos):
    out, conf = MaxGram(hist, min_match=min_match, eos_ids=eos).propose(k)
    ref_out, ref_conf = ref_maxgram(hist, k, min_match, frozenset(eos))
    assert out == ref_out
    assert conf == pytest.approx(ref_conf)
    assert len(out) <= k and all(0 < c < 1 for c in conf)


def test_maxgram_bigram_fallback():
    hist = [1, 2, 1, 3, 1, 3, 4, 1]  # the last token's longest earlier match is 1 token long
    d = MaxGram(hist)
    assert d.longest_match() == (1, 0)
    out, conf = d.propose(4)
    assert out == [3, 1, 3, 4]  # bigram 1 -> 3 (2 of 3), then copies after "1 3", "1 3 1", "1 3 1 3"
    assert conf == pytest.approx([0.5 * 2 / 3, 2 / 3, 3 / 4, 4 / 5])
    assert MaxGram(hist, min_match=1).propose(1)[0] == [2]  # a 1-token match copies the first occurrence


def test_maxgram_bigram_ties_go_to_most_recent():
    assert MaxGram([1, 2, 1, 3, 1]).propose(1) == ([3], [0.25])
    assert MaxGram([1, 3, 1, 2, 1]).propose(1) == ([2], [0.25])


def test_maxgram_extends_past_the_copied_span():
    # a loop: the copy reaches the end of the history and continues periodically
    d = MaxGram([9, 1, 2, 3, 1, 2, 3, 1, 2])
    assert d.propose(7)[0] == [3, 1, 2, 3, 1, 2, 3]


def test_maxgram_empty_and_short():
    assert MaxGram().propose(5) == ([], [])
    assert MaxGram().longest_match() == (0, -1)
    assert MaxGram([4]).propose(5) == ([], [])
    assert MaxGram([4, 4]).propose(3)[0] == [4, 4, 4]
    assert MaxGram([1, 2, 3]).propose(5) == ([], [])  # the last token has no successor
    assert MaxGram([1, 2, 1]).propose(0) == ([], [])


# ---------------------------------------------------------------------------------------------- shared
@SETTINGS
@given(histories, st.lists(st.integers(1, 6), max_size=12), st.sampled_from(["pld", "maxgram"]))
def test_incremental_extend_equals_from_scratch(hist, cuts, name):
    d = new_lookup(name, [], ())
    i = 0
    for c in cuts + [len(hist)]:
        d.extend(hist[i:i + c])
        i = min(i + c, len(hist))
        fresh = new_lookup(name, hist[:i], ())
        assert d.tokens == fresh.tokens
        assert d.propose(10) == fresh.propose(10)
        if name == "maxgram":
            assert d.longest_match() == fresh.longest_match()


@SETTINGS
@given(nonempty, st.lists(st.integers(0, 4), max_size=6), ks, st.integers(1, 3))
def test_maxgram_propose_after_equals_reference(hist, extra, k, min_match):
    """Max-Gram after drafted tokens not in the history (a tree path) = Max-Gram on history + path."""
    out, match = MaxGram(hist, min_match=min_match, eos_ids={0}).propose_after(extra, k)
    matches: list[int] = []
    ref_out, _ = ref_maxgram(hist, k, min_match, frozenset({0}), extra, matches)
    assert out == ref_out
    assert match == (matches[0] if matches else 0)


@SETTINGS
@given(histories, st.sampled_from(sorted(LOOKUP_CLASSES)))
def test_every_lookup_proposes_after_nothing_as_it_proposes(hist, name):
    d = new_lookup(name, hist, ())
    assert d.propose_after([], 6)[0] == d.propose(6)[0]
