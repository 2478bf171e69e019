"""Streaming text (casspec/runtime/detok.py through a generation's text side, live.py): the pieces concatenate to the
whole output's decode (multi-byte characters split across tokens, SentencePiece leading spaces, byte fallback,
skipped special tokens), stop strings end the text where decoding the whole output again after every token ends it,
and the decoding work is linear in the output's length."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from casspec.runtime.engine import Engine, Request
from casspec.runtime.live import Live
from casspec.runtime.stats import Result, Stats
from tiny import tiny_engine, tiny_tokenizer

ALPHABET = "ab xyz.,!\n" + "éïñü" + "世界中文字" + "😀🚀👍🏽🧑‍🚀"  # one to four UTF-8 bytes a char
FEW = settings(max_examples=30, deadline=None)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """A tiny engine whose tokenizer decodes the scripted blocks `stream` feeds a generation's text side. No token
    is an EOS (special tokens are then only skipped by the decode)."""
    e = tiny_engine()
    e.eos_ids = frozenset()
    return e


def stream(e: Engine, tokenizer, blocks: list[list[int]], stop: tuple[str, ...] = ()) -> tuple[list[str], Result]:
    """The pieces a generation streams when its steps commit `blocks` (as Engine._stream feeds them), and its
    Result."""
    e.tokenizer = tokenizer
    req = Request(method="ar", max_new_tokens=sum(map(len, blocks)) + 1, stop=stop)
    live = Live(req, Stats(method="ar"), e.decode, e.eos_ids, None, 0.0)
    pieces = []
    for block in blocks:
        pieces.append(live.feed(block))
        if live.finished:
            break
    result, last = live.close()
    return [p for p in pieces + [last] if p], result


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """ids in consecutive blocks of sizes[0], sizes[1], ... (cycled)."""
    blocks, i = [], 0
    while i < len(ids):
        blocks.append(ids[i:i + sizes[len(blocks) % len(sizes)]])
        i += len(blocks[-1])
    return blocks


def redecoded(decode, ids: list[int], stops: tuple[str, ...]) -> tuple[str, int, bool]:
    """What the engine gave before its text side was incremental: the whole output decoded again after every
    token, the text cut where the earliest stop string begins; the tokens it took, and whether a stop string
    ended it."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], n, True
    return decode(ids), len(ids), False


def byte_tokens(tokenizer, text: str) -> list[int]:
    """A byte-level BPE's single-byte tokens spelling text: every multi-byte char split across tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([chars[b] for b in text.encode()])


def sentencepiece_tokenizer():
    """A tiny SentencePiece-style tokenizer (a Llama-2's decoder): words marked with a leading "▁", the first
    token's leading space dropped by the decode, and the chars it has no piece for spelled as byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    words = ["▁", "▁the", "▁a", "a", "b", "x", "é", "▁é", "ab", "▁ab", "世", "▁世", "!", "▁!", ",", "."]
    tok = Tokenizer(models.Unigram(pieces + [(w, -1.0 - 0.1 * len(w)) for w in words], unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


SENTENCEPIECE = sentencepiece_tokenizer()
WORDS = tiny_tokenizer()


def smol_ids(tokenizer, data) -> list[int]:
    """Segments of SmolLM2 tokens: text as the tokenizer splits it, text spelled byte by byte, any ids (special
    tokens and lone bytes of multi-byte chars among them); cut anywhere (a char's last bytes may never come)."""
    ids: list[int] = []
    for kind, text in data.draw(st.lists(st.tuples(st.sampled_from(["text", "bytes", "ids"]),
                                                   st.text(ALPHABET, min_size=1, max_size=8)), min_size=1, max_size=6)):
        if kind == "text":
            ids += tokenizer.encode(text, add_special_tokens=False)
        elif kind == "bytes":
            ids += byte_tokens(tokenizer, text)
        else:
            ids += data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=4))
    return ids[:data.draw(st.integers(1, len(ids)))]


def sentencepiece_ids(data) -> list[int]:
    """Text with leading and repeated spaces, chars spelled as byte tokens, special tokens anywhere (skipped by the
    decode); maybe a last char cut before its last byte."""
    ids = SENTENCEPIECE.encode(data.draw(st.text(ALPHABET, min_size=1, max_size=30)), add_special_tokens=False)
    for _ in range(data.draw(st.integers(0, 2))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from([1, 2])))
    if data.draw(st.booleans()):  # "▁" then the char's bytes, the last one missing
        ids += SENTENCEPIECE.encode(data.draw(st.sampled_from("界😀ñ")), add_special_tokens=False)[:-1]
    return ids


def word_ids(data) -> list[int]:
    return data.draw(st.lists(st.integers(0, len(WORDS) - 1), min_size=1, max_size=40))  # w0..w2 are special


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # the engine's


def check_stream(e: Engine, tokenizer, ids: list[int], data) -> None:
    blocks = split(ids, data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    pieces, res = stream(e, tokenizer, blocks)
    assert "".join(pieces) == full == res.text
    assert res.token_ids == ids


def check_stops(e: Engine, tokenizer, ids: list[int], data) -> None:
    """Stop strings taken from the text (so they span tokens and pieces) and one made up: the engine ends where the
    old re-decoding did, after the same token."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stops = [data.draw(st.text(ALPHABET, min_size=1, max_size=3))]
    for _ in range(data.draw(st.integers(0, 2)) if full else 0):
        i = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[i:i + data.draw(st.integers(1, 6))])
    # (not a stop string holding U+FFFD: re-decoding shows an unfinished byte-fallback run as U+FFFD, replacing
    # chars the stream settled before, which it keeps, as IncrementalDetokenizer documents; no writer's stop string)
    stops = tuple(s for s in stops if "\ufffd" not in s) or ("a",)
    blocks = split(ids, data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    pieces, res = stream(e, tokenizer, blocks, stops)
    text, n, stopped = redecoded(decoder(tokenizer), ids, stops)
    assert "".join(pieces) == text == res.text
    assert res.token_ids == ids[:n]
    assert res.stats.finish_reason == ("stop" if stopped else "context")


@pytest.mark.embedded
@FEW
@given(data=st.data())
def test_byte_level_stream_is_the_whole_decode(engine, embedded_tokenizer, data):
    check_stream(engine, embedded_tokenizer, smol_ids(embedded_tokenizer, data), data)


@FEW
@given(data=st.data())
def test_sentencepiece_stream_is_the_whole_decode(engine, data):
    check_stream(engine, SENTENCEPIECE, sentencepiece_ids(data), data)


@FEW
@given(data=st.data())
def test_word_stream_is_the_whole_decode(engine, data):
    check_stream(engine, WORDS, word_ids(data), data)


@pytest.mark.embedded
@FEW
@given(data=st.data())
def test_byte_level_stop_strings_end_where_redecoding_ends(engine, embedded_tokenizer, data):
    check_stops(engine, embedded_tokenizer, smol_ids(embedded_tokenizer, data), data)


@FEW
@given(data=st.data())
def test_sentencepiece_stop_strings_end_where_redecoding_ends(engine, data):
    check_stops(engine, SENTENCEPIECE, sentencepiece_ids(data), data)


@FEW
@given(data=st.data())
def test_word_stop_strings_end_where_redecoding_ends(engine, data):
    check_stops(engine, WORDS, word_ids(data), data)


@pytest.mark.embedded
def test_a_char_split_across_steps_streams_once_its_last_byte_comes(engine, embedded_tokenizer):
    tok = embedded_tokenizer
    emoji = byte_tokens(tok, "😀")
    blocks = [[t] for t in emoji] + [tok.encode(" a", add_special_tokens=False)]
    pieces, res = stream(engine, tok, blocks)
    assert pieces == ["😀", " a"] and res.text == "😀 a"
    pieces, res = stream(engine, tok, blocks[:3])  # the last byte never comes: the decode's U+FFFD, at the end
    assert pieces == ["\ufffd"] == [tok.decode(emoji[:3])]


def test_sentencepiece_leading_spaces_stream_as_the_whole_decode(engine):
    ids = SENTENCEPIECE.encode("  a  ab", add_special_tokens=False)
    pieces, res = stream(engine, SENTENCEPIECE, [[t] for t in ids])
    assert "".join(pieces) == SENTENCEPIECE.decode(ids) == "  a  ab"  # (the first "▁" is dropped)
    assert len(pieces) > 1


@pytest.mark.parametrize("stop", [("w999",), ()])
def test_decoding_work_is_linear_in_the_output(engine, monkeypatch, stop):
    """2,000 tokens in blocks of 3: the tokens the tokenizer decodes, summed over its calls, stay a few per output
    token (decoding the whole output again after every token, or every step, sums to about n^2/2 or n^2/6)."""
    words = tiny_tokenizer()
    decode, decoded = words.decode, []

    def counting(ids, **kw):
        decoded.append(len(ids))
        return decode(ids, **kw)

    monkeypatch.setattr(words, "decode", counting)
    ids = [3 + i * 7 % 90 for i in range(2000)]
    pieces, res = stream(engine, words, split(ids, [3]), stop)
    assert "".join(pieces) == res.text == decode(ids, skip_special_tokens=True)
    assert len(pieces) > 600  # streamed step by step, not at the end
    assert sum(decoded) < 20 * len(ids)
