"""bench.gpu.loop_pages: which pages loop and what the logits processor forces per row,
without vLLM (the module's vLLM and torch imports are guarded; `apply` needs them)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from bench.gpu import loop_pages
from bench.gpu.answer_lengths import LognormalAnswerLengths, MoveDirectionality
from bench.gpu.dummy_model import vocabulary
from bench.gpu.lengths import AnswerLengths
from bench.gpu.loop_pages import LoopingAnswerLengths, LoopingPages

pytestmark = pytest.mark.quick

GREEDY = SimpleNamespace(repetition_penalty=1.0)
BREAK_LOOPS = SimpleNamespace(repetition_penalty=1.05)  # what ocrvl sends a looping page again


def batch(added: Sequence[tuple[int, Any, list[int], list[int]]] = (),
          removed: Sequence[int] = (), moved: Sequence[tuple[int, int, Any]] = ()) -> Any:
    return SimpleNamespace(added=list(added), removed=list(removed), moved=list(moved))


DEFAULT_PAGES = LoopingPages.parse(loop_pages.DEFAULT)


def prompt_lengths(looping: bool, pages: LoopingPages = DEFAULT_PAGES) -> list[int]:
    return [n for n in range(1000, 3000) if pages.loops(n) is looping]


def test_a_chosen_share_of_pages_loops_the_same_way_every_time() -> None:
    pages = LoopingPages.parse("0.1:23")
    share = len(prompt_lengths(True, pages)) / 2000
    assert 0.08 <= share <= 0.12, share
    assert [pages.loops(n) for n in range(500)] == [pages.loops(n) for n in range(500)]
    assert prompt_lengths(True, pages) != prompt_lengths(True, LoopingPages.parse("0.1:24"))
    assert not any(LoopingPages(0, 1).loops(n) for n in range(500))
    assert all(LoopingPages(1, 1).loops(n) for n in range(500))
    for bad in ("0.1", "x:1", "1.5:3"):
        with pytest.raises(ValueError, match="looping pages"):
            LoopingPages.parse(bad)


def test_the_phrase_is_the_dummy_tokenizers_characters() -> None:
    by_id = {i: t for t, i in vocabulary().items()}
    text = "".join(by_id[i] for i in loop_pages.phrase_tokens()).replace("\u2581", " ")
    assert text == loop_pages.PHRASE


def test_a_looping_page_repeats_the_phrase_and_the_others_end_at_their_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(loop_pages.ENV, "0.1:23")
    processor = LoopingAnswerLengths(None)
    cycle = loop_pages.phrase_tokens()
    loops, plain = prompt_lengths(True)[0], prompt_lengths(False)[0]
    looping_out: list[int] = []
    plain_out: list[int] = []
    again_out: list[int] = []
    processor.update_state(batch(added=[(0, GREEDY, [7] * loops, looping_out),
                                        (1, GREEDY, [7] * plain, plain_out),
                                        (2, BREAK_LOOPS, [7] * loops, again_out)]))
    text = processor.text
    assert processor.due == [(0, cycle[0]),
                             (1, text[processor.text_start(plain)]),
                             (2, text[processor.text_start(loops)])], \
        "the looping page starts its phrase, the others (and the retry) their text"
    for step in range(1, 3 * len(cycle)):
        looping_out.append(cycle[(step - 1) % len(cycle)])
        processor.update_state(None)
        assert (0, cycle[step % len(cycle)]) in processor.due
    length = processor.lengths.length(plain)
    assert length == AnswerLengths.parse("500:0.9:17").length(plain), "one length drawing"
    plain_out.extend([5] * (length - 1))
    again_out.extend([5] * (processor.lengths.length(loops) - 1))
    processor.update_state(None)
    assert (1, processor.eos) in processor.due, "a page that does not loop ends at its length"
    assert (2, processor.eos) in processor.due, "the loop-breaking retry gets a real answer"


def test_rows_follow_the_batchs_removals_and_moves() -> None:
    processor = LognormalAnswerLengths(None)
    a_out, b_out = [5] * 5000, [5]
    processor.update_state(batch(added=[(0, GREEDY, [7] * 1200, a_out),
                                        (1, GREEDY, [7] * 1300, b_out)]))
    b_token = processor.text[processor.text_start(1300) + 1]
    assert processor.due == [(0, processor.eos), (1, b_token)]
    processor.update_state(batch(moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert sorted(processor.due) == [(0, b_token), (1, processor.eos)], \
        "swapped rows keep their requests"
    processor.update_state(batch(removed=[1]))
    assert processor.due == [(0, b_token)] and set(processor.rows) == {0}
