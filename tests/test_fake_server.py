"""The fake vLLM server behaves like vLLM where ocrvl relies on it."""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from testkit.fake_server import (
    DEFAULT_MODEL,
    FakeServerConfig,
    InProcessFakeServer,
    OutputLength,
    image_tokens,
    parse_args,
    plan_startup,
)
from testkit.harness import (
    FakeServerProcess,
    chat_payload,
    fake_server_command,
    free_port,
    make_test_jpeg,
    process_alive,
    start_fake_server,
    wait_until,
)

CHAT = "/v1/chat/completions"
VLLM_ONLY_ARGS = (
    "--trust-remote-code",
    "--limit-mm-per-prompt",
    '{"image": 1}',
    "--no-enable-prefix-caching",
    "--mm-processor-cache-gb",
    "0",
)


@pytest.fixture(scope="module")
def request_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fake") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(request_log: Path) -> Iterator[FakeServerProcess]:
    """One plain server for the read-only tests (started with vLLM-only flags it ignores)."""
    with start_fake_server(free_port(), *VLLM_ONLY_ARGS, "--request-log", str(request_log)) as srv:
        yield srv


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def pixel_digest(jpeg: bytes) -> str:
    with Image.open(io.BytesIO(jpeg)) as img:
        return hashlib.sha256(img.convert("RGB").tobytes()).hexdigest()[:12]


def test_ignores_vllm_args_and_lists_model(server: FakeServerProcess) -> None:
    assert "ignoring unmodelled args: --trust-remote-code" in server.output()
    models = server.get("/v1/models").json()
    assert models["object"] == "list"
    [entry] = models["data"]
    assert entry["id"] == DEFAULT_MODEL
    assert entry["owned_by"] == "vllm"
    assert entry["max_model_len"] == 16384


def test_wrong_model_is_404(server: FakeServerProcess) -> None:
    response = server.post(CHAT, json=chat_payload(make_test_jpeg(1), model="other-model"))
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `other-model` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_over_max_model_len_is_400(server: FakeServerProcess) -> None:
    # 1000x1000 -> 36*36 = 1296 image tokens, + "OCR:" (1) + template (20).
    jpeg = make_test_jpeg(2, (1000, 1000))
    response = server.post(CHAT, json=chat_payload(jpeg, max_completion_tokens=16000))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert error["message"] == (
        "This model's maximum context length is 16384 tokens. However, you requested 17317 "
        "tokens (1317 in the messages, 16000 in the completion). Please reduce the length of "
        "the messages or completion."
    )
    ok = server.post(CHAT, json=chat_payload(jpeg, max_completion_tokens=15000))
    assert ok.json()["usage"]["prompt_tokens"] == 1317


def test_max_pixels_scales_image_tokens(server: FakeServerProcess) -> None:
    jpeg = make_test_jpeg(3, (1000, 1000))
    body = chat_payload(jpeg, mm_processor_kwargs={"max_pixels": 250000})
    assert server.post(CHAT, json=body).json()["usage"]["prompt_tokens"] == 18 * 18 + 21
    assert image_tokens(2000, 1000, 1003520) == 26 * 51  # scaled to 1416x708


def test_reply_is_derived_from_image(server: FakeServerProcess) -> None:
    a, b = make_test_jpeg(10, (300, 400)), make_test_jpeg(11, (300, 400))
    text_a = content(server.post(CHAT, json=chat_payload(a)))
    text_b = content(server.post(CHAT, json=chat_payload(b)))
    assert text_a != text_b
    assert text_a == content(server.post(CHAT, json=chat_payload(a)))
    assert text_a.startswith("fake-ocr OCR 300x400 mean=")
    assert text_a.endswith(f"sha={pixel_digest(a)}")
    table = content(server.post(CHAT, json=chat_payload(a, prompt="Table Recognition:")))
    assert table.startswith("fake-ocr Table 300x400")


def test_request_log_records_pages(server: FakeServerProcess, request_log: Path) -> None:
    jpeg = make_test_jpeg(20, (64, 48))
    server.post(CHAT, json=chat_payload(jpeg, max_completion_tokens=100))
    digest = pixel_digest(jpeg)
    records = [json.loads(line) for line in request_log.read_text().splitlines()]
    [record] = [r for r in records if r["digest"] == digest]
    assert record["w"] == 64 and record["h"] == 48
    assert record["prompt"] == "OCR:"
    assert record["max_tokens"] == 100
    assert record["tokens"] == 16  # the default fixed:16 answer: a replay needs its length
    assert record["status"] == 200
    assert record["model"] == DEFAULT_MODEL
    assert server.stats()["requests_by_digest"][digest] == 1


def test_metrics_parse_with_vllm_names(server: FakeServerProcess) -> None:
    server.post(CHAT, json=chat_payload(make_test_jpeg(30)))
    text = server.get("/metrics").text
    samples = {
        (s.name, s.labels.get("finished_reason")): s
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
    ):
        assert samples[(name, None)].labels["model_name"] == DEFAULT_MODEL
    assert samples[("vllm:request_success_total", "stop")].value >= 1
    assert server.metric("vllm:generation_tokens_total") >= 16


def test_api_key_is_enforced_on_v1_only() -> None:
    with start_fake_server(free_port(), "--api-key", "sekrit") as srv:
        body = chat_payload(make_test_jpeg(1))
        assert srv.post(CHAT, json=body).status_code == 401
        assert srv.get("/v1/models").status_code == 401
        assert srv.healthy()
        auth = {"Authorization": "Bearer sekrit"}
        assert srv.post(CHAT, json=body, headers=auth).status_code == 200


def test_ready_only_after_startup_delay_and_sigterm_in_startup() -> None:
    port = free_port()
    started = time.monotonic()
    with start_fake_server(port, "--startup-delay", "1.0", wait=False) as srv:
        wait_until(lambda: "Starting to load model" in srv.output(), 10, what="loading phase")
        assert "Uvicorn running" not in srv.output()
        with pytest.raises(httpx.ConnectError):
            srv.get("/health", timeout=1.0)
        srv.wait_ready()
        assert time.monotonic() - started >= 1.0
        out = srv.output()
        order = [
            "Starting to load model",
            "Loading weights took",
            "Model loading took",
            "Memory profiling takes",
            "Available KV cache memory",
            "GPU KV cache size",
            "Maximum concurrency for 16384 tokens per request",
            "Capturing CUDA graphs",
            "Graph capturing finished",
            "Started server process",
            "Application startup complete.",
            f"Uvicorn running on http://127.0.0.1:{port}",
        ]
        positions = [out.index(marker) for marker in order]
        assert positions == sorted(positions)
    # A stop during start-up is clean too.
    with start_fake_server(free_port(), "--startup-delay", "30", wait=False) as slow:
        wait_until(lambda: "Starting to load model" in slow.output(), 10, what="loading phase")
        t0 = time.monotonic()
        assert slow.stop() == 0
        assert time.monotonic() - t0 < 1.5


def test_port_in_use_fails_like_uvicorn() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with start_fake_server(port, wait=False) as srv:
            assert srv.wait_exit(10) == 1
            assert (
                f"ERROR:    [Errno 98] error while attempting to bind on address "
                f"('127.0.0.1', {port}): address already in use"
            ) in srv.output()


def test_crash_after_kills_engine_then_exits_zero() -> None:
    with start_fake_server(free_port(), "--crash-after", "2", "--crash-exit-delay", "0.5") as srv:
        assert srv.post(CHAT, json=chat_payload(make_test_jpeg(1))).status_code == 200
        crashed = srv.post(CHAT, json=chat_payload(make_test_jpeg(2)))
        assert crashed.status_code == 500
        assert crashed.json()["error"]["type"] == "InternalServerError"
        assert not srv.healthy()
        assert srv.wait_exit(5) == 0
        assert "EngineCore encountered a fatal error" in srv.output()


def test_hang_keeps_health_and_sigterm_is_prompt() -> None:
    with start_fake_server(free_port(), "--hang-after", "2") as srv:
        assert srv.post(CHAT, json=chat_payload(make_test_jpeg(1))).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            srv.post(CHAT, json=chat_payload(make_test_jpeg(2)), timeout=0.5)
        assert srv.healthy()
        assert srv.metric("vllm:num_requests_running") == 1
        stats = srv.stats()
        assert stats["requests_hung"] == 1
        assert stats["requests_completed"] == 1
        t0 = time.monotonic()
        assert srv.stop() == 0
        assert time.monotonic() - t0 < 1.0


def test_error_500_every_nth() -> None:
    with start_fake_server(free_port(), "--error-500-every", "2") as srv:
        codes = [srv.post(CHAT, json=chat_payload(make_test_jpeg(i))).status_code for i in range(4)]
        assert codes == [200, 500, 200, 500]
        assert srv.healthy()


def test_health_503_after_completions() -> None:
    with start_fake_server(free_port(), "--health-503-after", "1") as srv:
        assert srv.post(CHAT, json=chat_payload(make_test_jpeg(1))).status_code == 200
        assert srv.get("/health").status_code == 503
        assert srv.post(CHAT, json=chat_payload(make_test_jpeg(2))).status_code == 500


@pytest.mark.parametrize(
    ("kind", "root_cause"),
    [
        ("oom-kv", "ValueError: No available memory for the cache blocks."),
        ("free-memory", "ValueError: Free memory on device (6.5/7.6 GiB) on startup is less"),
        ("max-len", "the estimated maximum model length is 40336."),
        ("cuda-oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.20 GiB."),
    ],
)
def test_fail_start(kind: str, root_cause: str) -> None:
    with start_fake_server(free_port(), "--fail-start", kind, wait=False) as srv:
        assert srv.wait_exit(10) == 1
        out = srv.output()
        assert root_cause in out
        assert out.index(root_cause) < out.index(
            "RuntimeError: Engine core initialization failed. See root cause above."
        )
        assert "Uvicorn running" not in out


VRAM = ("--fake-vram-gib", "8", "--fake-vram-used-gib", "0.5", "--fake-weights-gib", "6")


@pytest.mark.parametrize(
    ("args", "failure"),
    [
        (("--gpu-memory-utilization", "0.95"), "free-memory"),
        (("--max-num-seqs", "256"), "oom-kv"),
        (("--max-num-seqs", "16", "--max-model-len", "131072"), "max-len"),
        (("--max-num-seqs", "16", "--max-model-len", "16384"), None),
    ],
)
def test_fake_vram_model_plan(args: tuple[str, ...], failure: str | None) -> None:
    assert plan_startup(parse_args([*VRAM, *args])).failure == failure


def test_fake_vram_model_fails_then_starts() -> None:
    kv = 0.9 * 8 - 6 - (16 * 0.004 + 0.5)
    fits = int(kv / 0.0000183)
    with start_fake_server(
        free_port(), *VRAM, "--max-num-seqs", "16", "--max-model-len", "131072", wait=False
    ) as srv:
        assert srv.wait_exit(10) == 1
        assert f"the estimated maximum model length is {fits}." in srv.output()
    with start_fake_server(free_port(), *VRAM, "--max-num-seqs", "16") as srv:
        assert f"GPU KV cache size: {fits:,} tokens" in srv.output()
        assert srv.stats()["kv_capacity_tokens"] == fits


def test_engine_child_is_orphaned_by_sigkill_and_killed_with_group() -> None:
    with start_fake_server(free_port(), "--spawn-engine-child") as srv:
        child = srv.stats()["engine_pid"]
        assert process_alive(child)
        assert os.getpgid(child) == srv.pid
        assert "VLLM::EngineCore" in Path(f"/proc/{child}/cmdline").read_text()
        os.kill(srv.pid, signal.SIGKILL)  # only the API server, like a careless supervisor
        srv.proc.wait(5)
        assert process_alive(child)
        srv.stop()
        wait_until(lambda: not process_alive(child), 5, what="engine child to die")


def test_output_length_model_in_process() -> None:
    assert OutputLength.parse("fixed:40").draw("abc") == 40
    lengths = {OutputLength.parse("uniform:20:40").draw(f"d{i}") for i in range(50)}
    assert min(lengths) >= 20 and max(lengths) <= 40 and len(lengths) > 5
    assert OutputLength.parse("lognormal:500:0.5").draw("x") == OutputLength.parse(
        "lognormal:500:0.5"
    ).draw("x")
    with pytest.raises(ValueError):
        OutputLength.parse("uniform:9")

    cfg = FakeServerConfig(port=0, output_tokens="fixed:50", access_log=False)
    with InProcessFakeServer(cfg) as srv:
        jpeg = make_test_jpeg(5, (100, 100))
        full = httpx.post(srv.url + CHAT, json=chat_payload(jpeg)).json()
        assert full["choices"][0]["finish_reason"] == "stop"
        assert full["usage"]["completion_tokens"] == 50
        # Base line = 16 tokens (5 words), then one word per token.
        assert len(full["choices"][0]["message"]["content"].split()) == 5 + 34
        cut = httpx.post(srv.url + CHAT, json=chat_payload(jpeg, max_completion_tokens=20)).json()
        assert cut["choices"][0]["finish_reason"] == "length"
        assert cut["usage"]["completion_tokens"] == 20
        assert (
            cut["choices"][0]["message"]["content"].split()
            == (full["choices"][0]["message"]["content"].split()[: 5 + 4])
        )


async def _burst(srv: FakeServerProcess, n: int) -> tuple[list[int], int]:
    """Send ``n`` requests at once; poll /metrics meanwhile; return statuses, max waiting."""
    max_waiting = 0
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:

        async def one(i: int) -> int:
            response = await client.post(CHAT, json=chat_payload(make_test_jpeg(100 + i, (64, 64))))
            return response.status_code

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        while not all(t.done() for t in tasks):
            text = (await client.get("/metrics")).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "vllm:num_requests_waiting":
                        max_waiting = max(max_waiting, int(sample.value))
            await asyncio.sleep(0.02)
        return [t.result() for t in tasks], max_waiting


def test_continuous_batching_queues_beyond_max_num_seqs() -> None:
    args = ("--step-t0-ms", "10", "--step-t1-ms", "1", "--max-num-seqs", "8")
    with start_fake_server(free_port(), *args) as srv:
        statuses, max_waiting = asyncio.run(_burst(srv, 16))
        assert statuses == [200] * 16
        assert max_waiting > 0
        stats: dict[str, Any] = srv.stats()
        assert stats["requests_completed"] == 16
        assert stats["completion_tokens"] == stats["generation_tokens"] > 0
        assert stats["max_active"] == 8
        assert stats["max_waiting"] >= max_waiting
        assert 0.5 < stats["occupancy"] <= 1.0
        # Two waves of 16 steps of ~18 ms each: well under a second, well over 0.4 s.
        assert 0.4 < stats["busy_seconds"] < 3.0
        assert srv.metric("vllm:request_success_total", finished_reason="stop") == 16


def test_a_client_that_goes_away_aborts_its_request_like_vllm(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    args = ("--step-t0-ms", "20", "--output-tokens", "fixed:500", "--request-log", str(log))
    with start_fake_server(free_port(), *args) as srv:

        async def abandon() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
                request = asyncio.create_task(
                    client.post(CHAT, json=chat_payload(make_test_jpeg(7, (64, 64)))))
                while srv.stats()["running"] == 0:
                    await asyncio.sleep(0.05)
                request.cancel()  # the connection closes with the request unanswered

        asyncio.run(abandon())
        stats = wait_until(
            lambda: (s := srv.stats())["requests_aborted"] == 1 and s["running"] == 0 and s,
            10, what="the abandoned request to leave the batch")
        assert stats["requests_completed"] == 0
        assert stats["generation_tokens"] < 400, "the server went on decoding for nobody"
        assert stats["completion_tokens"] == 0, "an abandoned request counted as answered"
        (record,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert record["status"] == 499


def test_kv_capacity_preempts() -> None:
    args = (
        "--step-t0-ms", "2", "--max-num-seqs", "8",
        "--kv-capacity-tokens", "120", "--output-tokens", "fixed:30",
    )  # fmt: skip
    with start_fake_server(free_port(), *args) as srv:
        # 64x64 -> 9 image tokens + 21 = 30 prompt tokens; 4 fit, growth forces preemption.
        statuses, _ = asyncio.run(_burst(srv, 6))
        assert statuses == [200] * 6
        assert srv.metric("vllm:num_preemptions_total") > 0


def test_the_fake_server_command_runs_from_any_directory(tmp_path: Path) -> None:
    """A fake server that ocrvl (or a test's own supervisor) launches imports testkit from
    this checkout even though testkit is not installed and the child runs elsewhere."""
    done = subprocess.run(fake_server_command("--help"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, f"`python -m testkit.fake_server` failed:\n{done.stderr}"
    assert "--served-model-name" in done.stdout


def test_the_test_kit_is_not_part_of_the_installed_package() -> None:
    """The fake server needs aiohttp, which ocrvl does not depend on: the kit stays in the
    checkout (tests, bench) and out of the package pip installs."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = [name for name in ("ocrvl_daemon", "testkit", "testkit.fake_server")
               if any(fnmatch.fnmatchcase(name, pattern) for pattern in include)]
    assert shipped == ["ocrvl_daemon"], f"pyproject.toml ships {shipped}"
    assert not (root / "ocrvl_daemon" / "testing").exists(), "the old kit is back"


def events(response: httpx.Response) -> Iterator[Any]:
    """The server-sent events of a streamed answer, decoded (``[DONE]`` as the string)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def test_a_streamed_answer_comes_in_vllm_chunks(server: FakeServerProcess) -> None:
    jpeg = make_test_jpeg(40, (120, 80))
    whole = server.post(CHAT, json=chat_payload(jpeg, max_completion_tokens=30)).json()
    body = chat_payload(jpeg, max_completion_tokens=30, stream=True,
                        stream_options={"include_usage": True})
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = list(events(response))
    assert received[-1] == "[DONE]"
    *chunks, usage, _ = received
    assert {c["object"] for c in received[:-1]} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        whole["choices"][0]["finish_reason"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


def test_a_stream_is_paced_by_the_batching_simulation_and_loops_like_the_answer(
        tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    args = ("--step-t0-ms", "5", "--output-tokens", "fixed:40", "--loop-widths", "64",
            "--request-log", str(log))
    with start_fake_server(free_port(), *args) as srv:
        body = chat_payload(make_test_jpeg(41, (64, 64)), max_completion_tokens=60, stream=True,
                            stream_options={"continuous_usage_stats": True})
        with httpx.stream("POST", srv.url + CHAT, json=body, timeout=30) as response:
            chunks = [e for e in events(response) if e != "[DONE]"]
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
        assert sum(bool(d) for d in deltas) > 10, "the answer came in one piece, not as decoded"
        so_far = [c["usage"]["completion_tokens"] for c in chunks]
        assert so_far == sorted(so_far) and so_far[-1] == 60, "vLLM's usage so far, per chunk"
        words = "".join(deltas).split()[5:]  # after the base line
        assert len(words) == 60 - 16 and words[:6] * 7 == words[:42], "a loop page did not loop"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # The record is written once the stream has ended, which the client may see first.
        record = wait_until(lambda: log.exists() and log.read_text() and json.loads(
            log.read_text()), 10, what="the request's record")
        assert record["stream"] is True and record["status"] == 200
        assert record["tokens"] == record["generated_tokens"] == 60


def test_a_stream_closed_mid_answer_aborts_the_request_like_vllm(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    args = ("--step-t0-ms", "5", "--loop-widths", "64", "--request-log", str(log))
    with start_fake_server(free_port(), *args) as srv:
        body = chat_payload(make_test_jpeg(42, (64, 64)), max_completion_tokens=4096, stream=True)
        read = 0
        with httpx.stream("POST", srv.url + CHAT, json=body, timeout=30) as response:
            for event in events(response):
                read += len(event["choices"][0]["delta"].get("content", "").split())
                if read >= 100:
                    break  # leaving the block closes the stream
        stats = wait_until(
            lambda: (s := srv.stats())["requests_aborted"] == 1 and s["running"] == 0 and s,
            10, what="the abandoned stream's request to leave the batch")
        assert stats["requests_completed"] == 0
        (record,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert record["aborted"] is True and record["status"] == 499
        assert 100 <= record["generated_tokens"] < 400, "the server went on decoding for nobody"
        assert record["generated_tokens"] == stats["generation_tokens"]
        assert srv.metric("vllm:request_success_total", finished_reason="abort") == 1


def test_an_engine_death_mid_stream_ends_the_stream_with_the_error() -> None:
    args = ("--step-t0-ms", "10", "--output-tokens", "fixed:500", "--crash-after", "2",
            "--crash-exit-delay", "5")
    with start_fake_server(free_port(), *args) as srv:
        body = chat_payload(make_test_jpeg(43, (64, 64)), stream=True)
        with httpx.stream("POST", srv.url + CHAT, json=body, timeout=30) as response:
            received = events(response)
            next(received)  # the role: the request is in the engine
            assert srv.post(CHAT, json=chat_payload(make_test_jpeg(44))).status_code == 500
            *_, error, done = received
        assert done == "[DONE]"
        assert error["error"]["code"] == 500
        assert error["error"]["type"] == "InternalServerError"
        wait_until(lambda: srv.stats()["requests_failed"] == 2, 10, what="both requests failed")
