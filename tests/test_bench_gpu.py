"""The GPU benchmark (bench/gpu/) keeps working where CI runs: its quick mode against the
fake server, and the pieces it hands to vLLM (answer lengths, dummy model dir)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.gpu.dummy_model import SPECIAL, VOCAB, write_model_dir
from bench.gpu.gpu_sampler import GpuSampler
from bench.gpu.lengths import DEFAULT, LONGEST, SHORTEST, AnswerLengths
from bench.gpu.run import page_requests, round_order
from bench.gpu.vllm_server import LOGITS_PROCESSOR, ServeOptions
from testkit.documents import make_pdf
from testkit.harness import free_port, start_fake_server, wait_until
from testkit.plain_server import _Handler, serving
from testkit.runner import run_ocrvl, write_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.quick
def test_answer_lengths_are_drawn_per_page_and_realistic() -> None:
    lengths = AnswerLengths.parse(DEFAULT)
    pages = range(400, 2400)  # prompt lengths: one per page size
    first = [lengths.length(p) for p in pages]
    again = [lengths.length(p) for p in reversed(pages)][::-1]
    assert first == again, "a page must get the same answer length from every client, any order"
    assert min(first) >= SHORTEST and max(first) <= LONGEST
    assert 400 <= statistics.median(first) <= 600, "median answer should be ~500 tokens"
    assert sum(n < 150 for n in first) > 50, "some pages should be nearly blank"
    assert sum(n > 1500 for n in first) > 50, "some pages should be dense"


@pytest.mark.quick
def test_answer_lengths_spec_error_names_the_format() -> None:
    with pytest.raises(ValueError, match="MEDIAN:SIGMA:SEED"):
        AnswerLengths.parse("500")


@pytest.mark.quick
def test_vllm_for_a_dummy_model_gets_random_weights_and_forced_answer_lengths() -> None:
    dummy = ServeOptions(model="/tmp/m", dummy=True, lengths="300:0.5:1", port=8000,
                         pythonpath="/tmp/site")  # fmt: skip
    argv = dummy.argv()
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert argv[argv.index("--logits-processors") + 1] == LOGITS_PROCESSOR
    env = dummy.env()
    assert env["OCRVL_BENCH_ANSWER_LENGTHS"] == "300:0.5:1"
    assert env["PYTHONPATH"].split(os.pathsep) == ["/tmp/site", str(ROOT)], (
        "vLLM's engine must import the logits processor from this checkout"
    )
    real = ServeOptions(model="PaddlePaddle/PaddleOCR-VL", dummy=False, lengths=None, port=8000)
    assert "--load-format" not in real.argv() and "--logits-processors" not in real.argv()


@pytest.mark.quick
def test_rounds_run_their_contenders_in_a_balanced_order_so_none_always_follows_b2() -> None:
    four = ["capacity", "b2", "convert", "run"]
    orders = [round_order(four, k) for k in range(1, 6)]
    assert all(sorted(o) == sorted(four) for o in orders), orders
    assert orders[4] == orders[0], "the design repeats every four rounds"
    assert sorted(o[0] for o in orders[:4]) == sorted(four), (
        f"each contender should run first once in four rounds: {orders}")
    pairs = [(o[i], o[i + 1]) for o in orders[:4] for i in range(3)]
    assert len(set(pairs)) == 12, f"each contender should follow each other one once: {orders}"
    assert round_order(["capacity", "convert"], 2) == ["convert", "capacity"]


@pytest.mark.quick
def test_dummy_model_dir_has_the_real_special_token_ids(tmp_path: Path) -> None:
    out = write_model_dir(tmp_path / "model")
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == VOCAB and sorted(vocab.values()) == list(range(VOCAB))
    assert all(vocab[t] == i for t, i in SPECIAL.items())
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 18
    assert (out / "chat_template.jinja").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_bench_quick_mode_against_the_fake_server(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    with start_fake_server(free_port(), "--output-tokens", "lognormal:100:0.5",
                           "--disable-uvicorn-access-log") as srv:  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu", "--server-url", srv.url + "/v1",
             "--pages", "6", "--only", "capacity,convert", "--results", str(results),
             "--log-dir", str(tmp_path / "logs"), "--concurrency", "3", "--keep"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # the first round's figures are on disk before the second round ends: a run cut
            # short (a lease ending) keeps what it measured
            deadline = time.monotonic() + 300
            while not results.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            first = json.loads(results.read_text()) if results.exists() else {}
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"bench.gpu failed:\n{stderr[-3000:]}"
    assert first.get("detail", {}).get("rounds") == 1 and first["ocrvl_convert_pages_per_s"], (
        "results.json was not written after the first round, so a run cut short loses it all")
    data = json.loads(results.read_text())
    assert data["detail"]["rounds"] == 2
    assert data["detail"]["round_orders"] == [["capacity", "convert"], ["convert", "capacity"]], (
        "the second round should run its contenders in the other order")
    for key in ("date", "gpu", "vllm", "capacity_pages_per_s", "b2_pages_per_s",
                "ocrvl_convert_pages_per_s", "ocrvl_run_pages_per_s", "small_doc_median_x",
                "small_doc_worst_x"):  # fmt: skip
        assert key in data, f"results.json lacks {key}"
    assert data["capacity_pages_per_s"] > 0 and data["ocrvl_convert_pages_per_s"] > 0
    assert data["b2_pages_per_s"] is None, "contenders left out are written as null"
    assert "| capacity" in stdout and "| ocrvl convert" in stdout, stdout
    convert = data["detail"]["results"]["ocrvl convert"]
    assert len(convert["rounds_pages_per_s"]) == 2, "convert should run once per round (2)"
    assert convert["pages_per_s"] == min(convert["rounds_pages_per_s"]), (
        "of two rounds, the figure of record is the slower one")
    for k in (1, 2):
        assert "ready in" in (tmp_path / "logs" / f"ocrvl-convert.{k}.log").read_text(), (
            f"round {k}'s ocrvl convert log is kept")
    by_round = data["detail"]["round_ratios"]["ocrvl convert / capacity"]
    assert len(by_round) == 2 and "ocrvl convert / capacity, round by round" in stdout, (
        "the report should show each round's convert-to-capacity ratio")
    assert data["concurrency"] == 3 and "3 always in flight" in stderr, stderr[-2000:]
    for name in ("capacity", "ocrvl convert"):
        extra = data["detail"]["results"][name]["extra"]
        assert extra.get("server_api_cpu_s_per_page", 0) > 0, (
            f"the server's CPU per page was not measured for {name}: {extra}")
        # The CPU times and the wall clock are read a moment apart: a fully busy machine can
        # read a little over its core count.
        assert 0 < extra["machine_busy_cores"] <= 1.1 * extra["machine_cpus"], (
            f"the machine's busy CPUs were not measured for {name}: {extra}")
    assert "server CPU s per page, API process + engine core (+ everything else on the " \
        "machine): capacity" in stdout, stdout
    assert "machine CPU while each ran, busy cores of" in stdout, stdout
    work = Path(re.search(r"work directory (\S+)", stderr).group(1))  # type: ignore[union-attr]
    try:
        config = yaml.safe_load((work / "ocrvl-convert.1" / "convert.yaml").read_text())
        assert config["pipeline"].get("max_concurrency") == 3, (
            "ocrvl convert did not get --concurrency as its bound, so it was not measured at "
            f"the feeder's bound: {config['pipeline']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replicas_bench_dry_run_measures_each_count_against_the_fake_server(
        tmp_path: Path) -> None:  # fmt: skip
    results = tmp_path / "replicas.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.replicas", "--fake", "--replicas", "1,2",
         "--pages", "8", "--results", str(results), "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=560, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"bench.gpu.replicas failed:\n{proc.stderr[-3000:]}"
    data = json.loads(results.read_text())
    assert sorted(data["replicas"]) == ["1", "2"], "each replica count gets its entry"
    for n, entry in data["replicas"].items():
        assert len(entry["urls"]) == int(n), f"{n} replicas should be {n} endpoints: {entry}"
        for key in ("start_s", "convert_pages_per_s", "convert_from_start_pages_per_s",
                    "run_pages_per_s"):  # fmt: skip
            assert entry[key] > 0, f"{n} replicas: {key} is {entry[key]}"
        assert len(entry["vllm_settings"]) >= int(n), "each replica's planned settings"
    assert data["b2_pages_per_s"] > 0, "B2 runs on the one-server daemon"
    assert data["ratios"]["2"]["vs_one"] > 0 and data["ratios"]["2"]["vs_b2"] > 0
    assert "| 2 |" in proc.stdout and "Targets:" in proc.stdout, proc.stdout
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    for n in ("1", "2"):
        assert f"ocrvl-convert-{n}-replicas.1.log" in logs, f"convert's log is kept: {logs}"
        run_log = (tmp_path / "logs" / f"ocrvl-run-{n}-replicas.log").read_text()
        assert "ready in" in run_log, f"the daemon's log is kept, timed:\n{run_log[:2000]}"


def _without_image(body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The request without its image, and the image's size in bytes."""
    body = json.loads(json.dumps(body))
    part = body["messages"][0]["content"][0]
    size = len(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
    part["image_url"]["url"] = "<image>"
    return body, size


def test_the_feeder_and_warm_up_send_exactly_what_ocrvl_sends(tmp_path: Path) -> None:
    """capacity and the warm-up stand for ocrvl's requests: the same fields (vLLM builds
    another image processor for other `mm_processor_kwargs`), and an image of about the
    same size."""
    seen: list[dict[str, Any]] = []

    class Capture(_Handler):
        def do_POST(self) -> None:
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._send(200, {"id": "1", "object": "chat.completion", "created": 0,
                             "model": seen[-1]["model"], "choices": [{
                                 "index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "text"}}]})

    pdf = make_pdf(tmp_path / "one.pdf", 1, height=792, seed=1)
    with serving(Capture) as url:
        out = run_ocrvl("convert", "--config", write_config(tmp_path / "c.yaml"),
                        "--server-url", url, pdf)  # fmt: skip
    assert out.returncode == 0 and seen, f"ocrvl convert failed:\n{out.stderr[-3000:]}"
    ocrvl, ocrvl_bytes = _without_image(seen[0])
    feeder, feeder_bytes = _without_image(page_requests(pdf, 1)[0])
    assert feeder == ocrvl, "the benchmark's requests differ from ocrvl's"
    assert 0.8 < feeder_bytes / ocrvl_bytes < 1.25, (
        f"the benchmark's page image is {feeder_bytes} bytes, ocrvl's {ocrvl_bytes}")


def test_the_gpu_sampler_reports_a_contenders_mean_gpu_busy_share_and_power(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    shutil.copyfile(Path(__file__).parent / "fixtures" / "gpu" / "rtx4060.sh", smi)
    smi.chmod(0o755)
    monkeypatch.setenv("OCRVL_NVIDIA_SMI", str(smi))
    monkeypatch.setenv("OCRVL_NO_NVML", "1")
    start = time.monotonic()
    with GpuSampler() as sampler:
        wait_until(lambda: sampler.over(start, time.monotonic()), 10, what="a GPU sample")
    assert sampler.over(start, time.monotonic()) == {"gpu_busy_pct": 37.0, "gpu_watts": 64.1}
