"""bench.gpu.answer_lengths: a random-weight server's answers read like text to ocrvl's quality
checks (and its streaming loop detector), with the lengths of record; looping pages still
loop. Without vLLM: the processor's scripts are driven as vLLM's engine would (a row a
request, the forced token appended every step), the answers decoded with the dummy model's
own tokenizer.json."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from bench.gpu import loop_pages
from bench.gpu.answer_lengths import LognormalAnswerLengths, MoveDirectionality
from bench.gpu.dummy_model import write_model_dir
from bench.gpu.lengths import ENV, SHORTEST, AnswerLengths
from bench.gpu.loop_pages import LoopingAnswerLengths
from ocrvl_daemon.core.messages import LOOP
from ocrvl_daemon.core.quality import (
    LOOP_COMPRESSION_RATIO,
    LOOP_WINDOW_CHARS,
    bad_char_share,
    looks_like_a_loop,
    repetition,
)
from ocrvl_daemon.worker.streaming import CHECK_EVERY_TOKENS, stream_completion

tokenizers = pytest.importorskip("tokenizers")
from tokenizers.decoders import DecodeStream  # noqa: E402

# Not in the quick tier: these check the GPU benchmark's answers (seconds of CPU drawing and
# reading prose), not the daemon's code.

GREEDY = SimpleNamespace(repetition_penalty=1.0)
BREAK_LOOPS = SimpleNamespace(repetition_penalty=1.05)  # what ocrvl sends a looping page again
LIMIT = 4096  # ocrvl's token limit
Request = tuple[int, Any]  # (prompt length, sampling params)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_model_dir(tmp_path_factory.mktemp("model"))
    return tokenizers.Tokenizer.from_file(str(Path(model) / "tokenizer.json"))


def batch(added: Sequence[tuple[int, Any, list[int], list[int]]] = (),
          removed: Sequence[int] = (), moved: Sequence[tuple[int, int, Any]] = ()) -> Any:
    return SimpleNamespace(added=list(added), removed=list(removed), moved=list(moved))


def serve(processor: LognormalAnswerLengths, arrivals: Sequence[Sequence[Request]],
          swap_every: int = 0) -> list[list[int]]:
    """Each request's answer (token ids, EOS included), as vLLM's engine makes them with the
    processor: `arrivals[k]` join the batch at step k, into the lowest free rows; a row ends
    at EOS or LIMIT; with `swap_every`, the first two rows swap every that many steps."""
    outputs: list[list[int]] = []
    rows: dict[int, int] = {}  # row -> request
    step = 0
    removed: list[int] = []
    while step < len(arrivals) or rows:
        added = []
        for prompt, params in arrivals[step] if step < len(arrivals) else ():
            row = min(set(range(len(rows) + 1)) - set(rows))
            rows[row] = len(outputs)
            outputs.append([])
            added.append((row, params, [7] * prompt, outputs[-1]))
        moved = []
        if swap_every and step % swap_every == 0 and {0, 1} <= set(rows):
            moved.append((0, 1, MoveDirectionality.SWAP))
            rows[0], rows[1] = rows[1], rows[0]
        processor.update_state(batch(added, removed, moved))
        assert sorted(row for row, _ in processor.due) == sorted(rows), "every row, every step"
        removed = []
        for row, token in processor.due:  # what `apply` makes the sampler pick
            out = outputs[rows[row]]
            out.append(token)
            if token == processor.eos or len(out) >= LIMIT:
                removed.append(row)
        for row in removed:
            del rows[row]
        step += 1
    return outputs


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


def stream(tokenizer: Any, ids: Sequence[int]) -> Any:
    """ocrvl's streaming reader (`stream_completion`, loop stopping on) over `ids` as vLLM
    streams them: a chunk a token, its text from the tokenizer's incremental decoder, the
    usage with every chunk."""
    decoder = DecodeStream(skip_special_tokens=True)
    events = []
    for n, token in enumerate(ids, 1):
        last = n == len(ids)
        finish = ("stop" if token == 2 else "length") if last else None
        choice = {"index": 0, "delta": {"content": decoder.step(tokenizer, token) or ""},
                  "finish_reason": finish}
        events.append({"choices": [choice], "usage": {"completion_tokens": n}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def read() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await stream_completion(client, "http://vllm/v1/chat/completions", {},
                                           {}, timeout=5.0)

    return asyncio.run(read())


def one_batch(pages: Iterable[int], params: Any = GREEDY) -> list[list[Request]]:
    return [[(page, params) for page in pages]]


def test_every_answer_reads_like_text_at_its_drawn_length(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = range(1000, 1100)
    seen = set()
    for seed in range(8):  # 800 answers: lengths from 16 to 3000
        spec = f"500:0.9:{seed}" if seed < 6 else ("3000:0:" if seed == 6 else "16:0:") + str(seed)
        monkeypatch.setenv(ENV, spec)
        processor = LognormalAnswerLengths(None)
        for page, ids in zip(pages, serve(processor, one_batch(pages)), strict=True):
            assert len(ids) == processor.lengths.length(page) and ids[-1] == processor.eos
            text = decode(tokenizer, ids)
            seen.add(len(ids))
            assert text.strip() and bad_char_share(text) == 0, text
            assert repetition(text) < LOOP_COMPRESSION_RATIO / 3, (spec, page, text[-300:])
            assert not looks_like_a_loop(text)
            # ocrvl scores the answer's end every 64 tokens: so is every end of it
            for end in range(LOOP_WINDOW_CHARS, len(text), CHECK_EVERY_TOKENS):
                assert repetition(text[:end]) < LOOP_COMPRESSION_RATIO / 3, (spec, page, end)
    assert min(seen) == SHORTEST and max(seen) == 3000 and len(seen) > 300


def test_ocrvls_streaming_loop_check_never_stops_an_answer(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "2000:0.3:5")  # long answers: the check runs from 2,000 chars
    processor = LognormalAnswerLengths(None)
    pages = range(1500, 1530)
    answers = serve(processor, one_batch(pages, BREAK_LOOPS))  # the retry too: text
    assert max(map(len, answers)) > LOOP_WINDOW_CHARS + 10 * CHECK_EVERY_TOKENS
    for ids in answers:
        streamed = stream(tokenizer, ids)
        assert streamed.finish_reason == "stop" and streamed.tokens == len(ids)
        assert streamed.text == decode(tokenizer, ids)


def test_a_looping_page_loops_and_its_retry_reads_like_text(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(loop_pages.ENV, "0.1:23")
    processor = LoopingAnswerLengths(None)
    looping = [n for n in range(1000, 3000) if processor.looping.loops(n)][:5]
    plain = [n for n in range(1000, 3000) if not processor.looping.loops(n)][:5]
    answers = serve(processor, one_batch(looping + plain))
    for page, ids in zip(looping + plain, answers, strict=True):
        text = decode(tokenizer, ids)
        if page in looping:
            assert len(ids) == LIMIT and looks_like_a_loop(text), "to the limit, looping"
            streamed = stream(tokenizer, ids)
            assert streamed.finish_reason == LOOP
            assert streamed.tokens <= LOOP_WINDOW_CHARS + CHECK_EVERY_TOKENS, "stopped at once"
        else:
            assert len(ids) == processor.lengths.length(page) and not looks_like_a_loop(text)
    for page, ids in zip(looping, serve(processor, one_batch(looping, BREAK_LOOPS)),
                         strict=True):  # fmt: skip
        assert len(ids) == processor.lengths.length(page), "the retry ends at its length"
        assert not looks_like_a_loop(decode(tokenizer, ids))


def test_a_page_gets_the_same_answer_in_any_order_batch_and_server() -> None:
    pages = list(range(1200, 1260))
    alone = {page: serve(LognormalAnswerLengths(None), one_batch([page]))[0]
             for page in pages[:6]}  # fmt: skip
    together = dict(zip(pages, serve(LognormalAnswerLengths(None), one_batch(pages)),
                        strict=True))  # fmt: skip
    staggered_pages = pages[::-1]
    arrivals = [[(page, GREEDY)] for page in staggered_pages]  # one a step, reversed
    staggered = dict(zip(staggered_pages, serve(LognormalAnswerLengths(None), arrivals,
                                                swap_every=7), strict=True))  # fmt: skip
    retried = dict(zip(pages, serve(LognormalAnswerLengths(None),
                                    one_batch(pages, BREAK_LOOPS)), strict=True))  # fmt: skip
    for page in pages:
        assert together[page] == staggered[page] == retried[page]
        assert alone.get(page, together[page]) == together[page]
    assert len({tuple(ids[:40]) for ids in together.values()}) == len(pages), "a text a page"


def test_the_lengths_of_record_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    # Drawn before the answers became text (bench.gpu.lengths, 500:0.9:17).
    record = {1000: 272, 1234: 38, 2000: 1525, 2500: 161, 3000: 834, 64: 745, 100: 2173}
    processor = LognormalAnswerLengths(None)
    answers = serve(processor, one_batch(record))
    assert {page: len(ids) for page, ids in zip(record, answers, strict=True)} == record
    for spec in ("500:0.9:17", "300:0.5:3"):
        monkeypatch.setenv(ENV, spec)
        pages = range(400, 700, 3)
        lengths = AnswerLengths.parse(spec)
        answers = serve(LognormalAnswerLengths(None), one_batch(pages))
        assert [len(ids) for ids in answers] == [lengths.length(page) for page in pages]


def test_apply_makes_greedy_sampling_pick_the_forced_tokens() -> None:
    torch = pytest.importorskip("torch")
    processor = LognormalAnswerLengths(None)
    outputs: list[list[int]] = [[], []]
    processor.update_state(batch([(0, GREEDY, [7] * 1000, outputs[0]),
                                  (1, BREAK_LOOPS, [7] * 1001, outputs[1])]))
    logits = torch.randn(2, 103424) * 30
    picked = processor.apply(logits).argmax(dim=-1).tolist()
    assert picked == [token for _, token in sorted(processor.due)]
    assert torch.softmax(logits / 0.01, dim=-1).max(dim=-1).values.min() == 1.0
