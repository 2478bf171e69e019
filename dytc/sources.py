"""Names of draft sources: what the router, the cascades and the acceptance estimates call each proposer.

A source is a dsia level (named by its level name, e.g. `int4+vocab`) or a zero-cost lookup: over the token history
(`pld`, `maxgram`: dytc/ngram.py), over the target's own candidates from earlier verifications (`recycle`:
dytc/recycle.py) or over a suffix tree of this generation's and the same client's earlier generations' text
(`suffix`: dytc/suffix.py). A level's top-1 tokens and its lower-ranked ones (siblings) are
separate sources, and so is a lookup token that a level reviewed and disagreed with (overruled): each is
accepted at its own rate.
"""
from __future__ import annotations

PLD = "pld"  # prompt lookup (HF's prompt-lookup decoding)
MAXGRAM = "maxgram"  # CS Drafting's Max-Gram
RECYCLE = "recycle"  # Token Recycling: the target's top-k successors of each token, kept from verifications
SUFFIX = "suffix"  # SuffixDecoding: frequency-scored continuations from suffix trees of earlier text
LOOKUPS = (PLD, MAXGRAM, RECYCLE, SUFFIX)  # the zero-cost sources, in the order a bottom of several uses them
FREE = (RECYCLE, SUFFIX)  # those that draw on what earlier generations left (dytc/shared.py: per client)
BOTTOMS = {"pld": (PLD,), "maxgram": (MAXGRAM,), "both": (PLD, MAXGRAM), "none": (),  # --bottom -> the lookups
           # beneath the levels of vc, tree+vc, vc+hc and dytc ("both": prompt lookup first)
           RECYCLE: (RECYCLE,), SUFFIX: (SUFFIX,), "free": FREE, "maxgram+recycle": (MAXGRAM, RECYCLE),
           "maxgram+suffix": (MAXGRAM, SUFFIX), "maxgram+free": (MAXGRAM, *FREE), "all": LOOKUPS}
DEFAULT_BOTTOM = "maxgram"  # measured best beneath dytc (+5-6% over pld, both: on a par), on a par beneath vc
# (README, "Results on this machine")
OVERRULED = "!"  # suffix of a lookup's source name for its tokens a level reviewed and disagreed with
SIBLING = "#sib"  # suffix of a level's source name for its tokens other than its top-1
HELD = "="  # suffix of a lookup's source name in a step after one where its proposal at the root held over every
# token the step emitted: a copy under way (the dev file's first turns on the AMD EPYC, Max-Gram matching 4+ tokens:
# 0.97 of such tokens accepted, against 0.75 after a proposal that broke)


def is_lookup(source: str) -> bool:
    """Whether a source (or its overruled tokens) is a statistical lookup; its belief is then a match length."""
    return base_lookup(source) in LOOKUPS


def overruled(lookup: str) -> str:
    """The source name of a lookup's tokens that a level reviewed and disagreed with."""
    return lookup + OVERRULED


def held(lookup: str) -> str:
    """The source name of a lookup's tokens while its last proposal at the root held (a copy under way): they are
    accepted far more often than the same match length's otherwise, so they are estimated apart."""
    return lookup + HELD


def base_lookup(source: str) -> str:
    """The lookup a lookup source (held or overruled) names."""
    return source.removesuffix(OVERRULED).removesuffix(HELD)


def sibling(level: str) -> str:
    """The source name of a level's lower-ranked tokens: they are accepted far less often than a top-1 token of
    the same draft probability, so they are estimated apart."""
    return level + SIBLING
