"""IncrementalDetokenizer: stop strings, held-back text, and multi-byte characters split across tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


class ByteTokenizer:
    """Token ``i`` is ``pieces[i]`` (bytes); decoding joins them and decodes UTF-8 with
    ``errors='replace'``, so an incomplete trailing character shows as U+FFFD (byte-level BPE)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


class ByteFallbackTokenizer(ByteTokenizer):
    """Like SentencePiece byte fallback: one U+FFFD per byte of an incomplete character."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        data = b"".join(self.pieces[i] for i in ids)
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                head = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            return head + REPLACEMENT_CHAR * (len(data) - cut)
        return data.decode("utf-8", errors="replace")


def stream(
    pieces: list[bytes], stop: tuple[str, ...] = (), tokenizer_cls: type[ByteTokenizer] = ByteTokenizer
) -> tuple[list[str], IncrementalDetokenizer, int]:
    """Feed tokens one at a time (``is_last`` on the final one unless stopped earlier).

    Returns the deltas, the detokenizer, and how many tokens were fed.
    """
    detokenizer = IncrementalDetokenizer(tokenizer_cls(pieces), stop)
    deltas: list[str] = []
    for count in range(1, len(pieces) + 1):
        deltas.append(detokenizer.update(list(range(count)), is_last=count == len(pieces)))
        if detokenizer.stopped:
            return deltas, detokenizer, count
    return deltas, detokenizer, len(pieces)


def test_without_stop_strings_text_is_released_at_once() -> None:
    deltas, detok, _ = stream([b"Hel", b"lo", b" world"])
    assert deltas == ["Hel", "lo", " world"]
    assert detok.text == "Hello world"
    assert not detok.stopped


def test_stop_string_split_across_tokens_is_never_released() -> None:
    deltas, detok, fed = stream([b"abc S", b"T", b"O", b"P tail"], stop=("STOP",))
    assert detok.stopped
    assert fed == 4
    assert "".join(deltas) == "abc "
    assert detok.text == "abc "
    for i in range(len(deltas)):
        assert "S" not in "".join(deltas[: i + 1])


def test_stop_string_inside_one_token_cuts_the_text() -> None:
    deltas, detok, fed = stream([b"one", b" two</end> three"], stop=("</end>",))
    assert detok.stopped and fed == 2
    assert "".join(deltas) == "one two"


def test_stop_string_at_the_very_start_releases_nothing() -> None:
    deltas, detok, _ = stream([b"##", b"rest"], stop=("##",))
    assert detok.stopped
    assert deltas == [""]
    assert detok.text == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    deltas, detok, _ = stream([b"x", b"y", b"BBB", b"A"], stop=("A", "BBB"))
    assert detok.stopped
    assert "".join(deltas) == "xy"


def test_held_back_text_is_released_on_the_last_token() -> None:
    deltas, detok, _ = stream([b"ab", b"cS", b"T"], stop=("STOP",))
    assert not detok.stopped
    assert deltas[:2] == ["", ""] or "".join(deltas[:2]) in ("", "a", "ab")
    assert "".join(deltas) == "abcST"
    assert detok.text == "abcST"


def test_partial_stop_prefix_that_does_not_complete_is_released_later() -> None:
    deltas, detok, _ = stream([b"ST", b"AR", b"T!", b"..."], stop=("STOP",))
    assert not detok.stopped
    assert "".join(deltas) == "START!..."


def test_empty_stop_strings_are_ignored() -> None:
    deltas, detok, _ = stream([b"a", b"b"], stop=("",))
    assert deltas == ["a", "b"]
    assert not detok.stopped


def test_multibyte_character_split_across_tokens_is_never_emitted_half() -> None:
    euro = "€".encode()  # 3 bytes
    deltas, detok, _ = stream([b"a", euro[:1], euro[1:2], euro[2:] + b"b"])
    assert deltas == ["a", "", "", "€b"]
    assert detok.text == "a€b"


def test_four_byte_character_split_with_stop_strings_set() -> None:
    emoji = "😀".encode()
    deltas, detok, _ = stream([b"hi ", emoji[:2], emoji[2:], b" there", b"!"], stop=("XYZ",))
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == "hi 😀 there!"


def test_byte_fallback_style_replacement_runs_are_held_back() -> None:
    emoji = "😀".encode()
    pieces = [b"x", emoji[:1], emoji[1:2], emoji[2:3], emoji[3:], b"y"]
    for stop in ((), ("QQ",)):
        deltas, detok, _ = stream(pieces, stop=stop, tokenizer_cls=ByteFallbackTokenizer)
        assert all(REPLACEMENT_CHAR not in d for d in deltas), (stop, deltas)
        assert "".join(deltas) == "x😀y"


class CountingTokenizer(ByteTokenizer):
    """Records how many ids each ``decode`` call gets."""

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__(pieces)
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        self.window_sizes.append(len(ids))
        return super().decode(ids, skip_special_tokens, clean_up_tokenization_spaces)


def test_each_update_decodes_a_window_of_a_few_tokens_whatever_the_output_length() -> None:
    euro = "€".encode()
    pieces = [b"word ", euro[:1], euro[1:], b"x", euro[2:]] * 200  # 1,000 tokens with split characters
    tokenizer = CountingTokenizer(pieces)
    detokenizer = IncrementalDetokenizer(tokenizer, ("STOP",))
    ids: list[int] = []
    for i in range(len(pieces)):
        ids.append(i)
        detokenizer.update(ids, is_last=i == len(pieces) - 1)
    assert max(tokenizer.window_sizes) <= 4
    assert detokenizer.text == b"".join(pieces).decode("utf-8", errors="replace")


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def _expected_answer(pieces: list[bytes], stop: list[str]) -> tuple[str, bool]:
    """Generation ends after the first token whose text holds a stop string, cut at the earliest one."""
    data = b""
    for piece in pieces:
        data += piece
        text = data.decode("utf-8", errors="replace")
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return data.decode("utf-8"), False


def check_stream(text: str, cuts: list[int], stop: list[str]) -> None:
    """Whatever the token split: no half characters, no early stop text, deltas add up."""
    pieces = _split(text.encode(), cuts)
    expected, is_stopped = _expected_answer(pieces, stop)
    deltas, detok, _ = stream(pieces, tuple(stop))
    released = ""
    for delta in deltas:
        assert REPLACEMENT_CHAR not in delta
        released += delta
        assert expected.startswith(released), (pieces, deltas)
    assert released == expected
    assert detok.stopped == is_stopped
    assert detok.text == expected


TEXT = st.text(alphabet="ab €😀S", min_size=1, max_size=16)
CUTS = st.lists(st.integers(min_value=0, max_value=64), max_size=12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=TEXT, cuts=CUTS, stop=st.lists(st.text(alphabet="ab S", min_size=1, max_size=3), max_size=2))
def test_any_token_split_with_ascii_stop_strings(text: str, cuts: list[int], stop: list[str]) -> None:
    check_stream(text, cuts, stop)


def test_stop_string_ending_in_a_split_multibyte_character_is_not_released_early() -> None:
    euro = "€".encode()
    deltas, detok, _ = stream([b"xS" + euro[:1], euro[1:], b"tail"], stop=("S€",))
    assert detok.stopped
    assert deltas[0] == "x"  # "S" must stay held: it may be the start of the stop string
    assert "".join(deltas) == "x"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=TEXT, cuts=CUTS, stop=st.lists(st.text(alphabet="ab €S", min_size=1, max_size=3), max_size=2))
def test_any_token_split_with_unicode_stop_strings(text: str, cuts: list[int], stop: list[str]) -> None:
    check_stream(text, cuts, stop)


# --- the real tokenizer: windowed deltas against a whole decode -----------------------------


class WholeDecodeDetokenizer:
    """The reference: decode every output token on each update (the detokenizer before the
    window), release the new suffix, hold back incomplete characters and stop-string prefixes."""

    def __init__(self, tokenizer: object, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold_chars = max((len(s) for s in self.stop), default=1) - 1
        self.released = 0
        self.stopped = False

    def update(self, ids: list[int], is_last: bool) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]
        hits = [i for i in (text.find(s, max(0, self.released - self.hold_chars)) for s in self.stop) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        end = len(text)
        if not (is_last or self.stopped):
            while end > self.released and text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
            end -= self.hold_chars
        if end <= self.released:
            return ""
        delta, self.released = text[self.released : end], end
        return delta


def feed(detokenizer: IncrementalDetokenizer | WholeDecodeDetokenizer, ids: list[int]) -> list[str]:
    """Deltas of feeding ``ids`` one at a time, stopping after a stop string is found."""
    deltas = []
    for count in range(1, len(ids) + 1):
        deltas.append(detokenizer.update(ids[:count], is_last=count == len(ids)))
        if detokenizer.stopped:
            break
    return deltas


@pytest.fixture(scope="module")
def smollm2() -> tuple[object, list[int], list[int]]:
    """The real SmolLM2 tokenizer (byte-level BPE, fast), the ids of its special tokens, and the
    ids of tokens holding part of a multi-byte character (they decode alone to U+FFFD)."""
    from bench.output_stage import load_tokenizer

    tokenizer = load_tokenizer()
    assert tokenizer.is_fast
    special_ids = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    partial_ids = [i for i in range(tokenizer.vocab_size) if REPLACEMENT_CHAR in tokenizer.decode([i])]
    assert partial_ids
    return tokenizer, special_ids, partial_ids


def token_ids_of(smollm2: tuple[object, list[int], list[int]]) -> st.SearchStrategy[list[int]]:
    tokenizer, special_ids, partial_ids = smollm2
    one_id = st.one_of(
        st.integers(min_value=0, max_value=tokenizer.vocab_size - 1),  # type: ignore[attr-defined]
        st.sampled_from(special_ids),
        st.sampled_from(partial_ids),
    )
    return st.lists(one_id, min_size=1, max_size=48)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data())
def test_windowed_deltas_equal_a_whole_decode_on_the_real_tokenizer(
    smollm2: tuple[object, list[int], list[int]], data: st.DataObject
) -> None:
    tokenizer = smollm2[0]
    ids = data.draw(token_ids_of(smollm2))
    whole = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]
    deltas = feed(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == whole
    assert deltas == feed(WholeDecodeDetokenizer(tokenizer, ()), ids)
    released = ""
    for delta in deltas[:-1]:
        released += delta
        assert whole.startswith(released)  # never half a character that a later token completes


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data())
def test_windowed_deltas_with_stop_strings_equal_a_whole_decode_on_the_real_tokenizer(
    smollm2: tuple[object, list[int], list[int]], data: st.DataObject
) -> None:
    tokenizer = smollm2[0]
    ids = data.draw(token_ids_of(smollm2))
    whole = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]
    stop = [data.draw(st.text(min_size=1, max_size=3))]
    if whole:  # a stop string taken from the text, so that most examples hit one
        start = data.draw(st.integers(min_value=0, max_value=len(whole) - 1))
        stop.append(whole[start : start + data.draw(st.integers(min_value=1, max_value=4))])
    windowed = IncrementalDetokenizer(tokenizer, tuple(stop))
    reference = WholeDecodeDetokenizer(tokenizer, tuple(stop))
    deltas = feed(windowed, ids)
    assert deltas == feed(reference, ids)
    assert windowed.stopped == reference.stopped
    text = "".join(deltas)
    assert windowed.text == text
    assert all(s not in text for s in stop if REPLACEMENT_CHAR not in s)
    assert whole.startswith(text)
