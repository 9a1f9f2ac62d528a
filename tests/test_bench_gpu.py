"""The GPU benchmark (bench/gpu/) keeps working where CI runs: its quick mode against the
fake server, and the pieces it hands to vLLM (answer lengths, dummy model dir)."""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from bench.gpu.dummy_model import SPECIAL, VOCAB, write_model_dir
from bench.gpu.gpu_sampler import GpuSampler
from bench.gpu.layout_on import block_lengths, cores_for, shares, summarise, targets
from bench.gpu.layout_on import write as write_layout_on
from bench.gpu.lengths import DEFAULT, LONGEST, SHORTEST, AnswerLengths
from bench.gpu.run import merged, page_requests, round_order, write_json
from bench.gpu.vllm_server import LOGITS_PROCESSOR, ServeOptions
from testkit.documents import make_layout_pdf, make_pdf
from testkit.harness import answers_health, free_port, start_fake_server, wait_until
from testkit.plain_server import _Handler, serving
from testkit.runner import ocrvl_env, run_ocrvl, write_config

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
@pytest.mark.parametrize(("installed", "trusted"), [("0.33.0", True), ("0.26.0", False)])
def test_the_benchmarks_vllm_trusts_image_sizes_where_it_would_refuse_them(
        tmp_path: Path, installed: str, trusted: bool) -> None:
    """vLLM >= 0.31 answers the captured PaddleOCR-VL requests only with
    --trust-request-mm-kwargs (every one was refused on the H100, 2026-12-07); older vLLM
    exits on the flag. The version is the one the bundle on PYTHONPATH holds."""
    info = tmp_path / f"vllm-{installed}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {installed}\n")
    options = ServeOptions(model="/tmp/m", dummy=True, lengths=None, port=8000,
                           pythonpath=str(tmp_path))
    assert options.vllm_version() == installed
    assert ("--trust-request-mm-kwargs" in options.argv()) is trusted


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


# --- layout detection on (bench.gpu.layout_on) -----------------------------------------------

LAYOUT_CPU = {"use_layout_detection": True, "layout_engine": "paddle", "layout_device": "cpu"}




class _Capture(_Handler):
    """Answers every chat completion at once, whole, and keeps its body."""

    seen: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        self.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self._send(200, {"id": "1", "object": "chat.completion", "created": 0,
                         "model": self.seen[-1]["model"], "choices": [{
                             "index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "text"}}]})


def test_the_block_feeder_sends_exactly_the_blocks_ocrvl_sends(layout_cache: Path,
                                                               tmp_path: Path) -> None:
    """Layout on, capacity stands for ocrvl's block requests: the same blocks cut from the
    same pages, the same bytes of JPEG, prompt and fields, byte for byte."""
    pdf = make_layout_pdf(tmp_path / "book.pdf", 2, seed=1)
    _Capture.seen = []
    config = write_config(tmp_path / "c.yaml", pipeline=LAYOUT_CPU)
    with serving(_Capture) as url:
        out = run_ocrvl("convert", "--config", config, "--server-url", url, pdf,
                        PADDLE_PDX_CACHE_HOME=str(layout_cache))  # fmt: skip
    assert out.returncode == 0, f"ocrvl convert failed:\n{out.stderr[-3000:]}"
    bodies = tmp_path / "blocks.jsonl"
    settings = {k: v for k, v in LAYOUT_CPU.items() if k != "use_layout_detection"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu.layout_on", "capture", json.dumps(settings), str(pdf),
         "2", str(bodies)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env=ocrvl_env(PADDLE_PDX_CACHE_HOME=str(layout_cache)))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    caught = [json.loads(line)["body"] for line in bodies.read_text().splitlines()]
    assert len(caught) == len(_Capture.seen) == summary["requests"] > 2, (
        f"{len(caught)} blocks caught, ocrvl sent {len(_Capture.seen)}: not one per block; "
        f"ocrvl said:\n{out.stderr[-4000:]}")
    assert summary["blocks_per_page"] > summary["requests_per_page"], (
        "figures are laid out but not sent: blocks per page counts them")

    def key(body: dict[str, Any]) -> str:
        return json.dumps(body, sort_keys=True)

    # ocrvl's pages run at once, so the order differs; the multiset of requests must not
    assert sorted(map(key, caught)) == sorted(map(key, _Capture.seen)), (
        "the blocks the benchmark feeds differ from ocrvl's requests: "
        f"{[_without_image(b)[0] for b in caught[:2]]} vs "
        f"{[_without_image(b)[0] for b in _Capture.seen[:2]]}")
    prompts = {b["messages"][0]["content"][1]["text"] for b in caught}
    assert prompts == {"OCR:", "Table Recognition:", "Formula Recognition:"}, prompts


@pytest.mark.quick
def test_layout_on_results_merge_into_the_file_and_keep_the_layout_off_figures(
        tmp_path: Path) -> None:  # fmt: skip
    path = tmp_path / "results.json"
    write_json(path, merged(path, {"capacity_pages_per_s": 9.1, "detail": {"pages": 256}}))
    res: dict[str, Any] = {"results": {}, "alone": {"pages_per_s": 20.0}}
    write_layout_on(res, None, path, {})
    data = json.loads(path.read_text())
    assert data["capacity_pages_per_s"] == 9.1 and data["detail"] == {"pages": 256}, (
        "writing layout-on figures lost the layout-off run's")
    assert data["layout_on"]["layout_alone_pages_per_s"] == 20.0
    # a layout-off run written afterwards keeps `layout_on`
    write_json(path, merged(path, {"capacity_pages_per_s": 9.5, "detail": {"pages": 128}}))
    data = json.loads(path.read_text())
    assert data["capacity_pages_per_s"] == 9.5 and data["layout_on"]["layout_alone_pages_per_s"] \
        == 20.0, "a layout-off run's write lost the layout-on figures"
    # --merge: an earlier run's contenders and parts are kept where this run has none
    kept = data["layout_on"] | {"results": {"B2": {"pages_per_s": 4.0}}}
    res = {"results": {}, "small": {"median_x": 1.5, "worst_x": 1.9}}
    write_layout_on(res, None, path, kept)
    on = json.loads(path.read_text())["layout_on"]
    assert on["layout_alone_pages_per_s"] == 20.0 and on["small_doc_median_x"] == 1.5
    assert not (tmp_path / "results.json.part").exists()


@pytest.mark.quick
def test_layout_on_ratios_judge_convert_against_b2_and_the_lower_ceiling() -> None:
    res = {"results": {"capacity": {"pages_per_s": 12.0}, "B2": {"pages_per_s": 5.0},
                       "ocrvl convert": {"pages_per_s": 9.0}},
           "alone": {"pages_per_s": 10.0}, "small": {"median_x": 1.4, "worst_x": 2.2}}
    s = summarise(res)
    assert s["convert_vs_b2"] == 1.8 and s["convert_vs_ceiling"] == 0.9
    assert s["ceiling"] == "layout alone", "the layout model alone is the lower ceiling here"
    assert s["ocrvl_run_pages_per_s"] is None, "contenders not run are written as null"
    assert [ok for _, ok, _ in targets(s)] == [True, True, True]
    s = summarise({"results": {"ocrvl convert": {"pages_per_s": 9.0}}})
    assert [ok for _, ok, _ in targets(s)] == [None, None, None], "not run is neither met nor not"


@pytest.mark.quick
def test_block_answers_add_up_to_a_pages_and_core_counts_fit_the_machine() -> None:
    assert block_lengths(12.5, 500) == "40:0.9:17", "500 tokens a page over 12.5 blocks"
    assert block_lengths(100, 500).startswith("16:"), "never below the shortest answer"
    cores = list(range(16))
    assert cores_for("4,8,all", cores) == [("4", cores[-4:]), ("8", cores[-8:]), ("all", cores)]
    assert cores_for("4,8,all", [0, 1]) == [("all", [0, 1])], "counts above the machine's skipped"
    assert cores_for("2,all", [0, 1]) == [("2", [0, 1])], "the same cores are measured once"
    assert shares(5, 2) == [[0, 2, 4], [1, 3]] and shares(2, 4) == [[0], [1]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_bench_layout_on_against_the_fake_server(layout_cache: Path, tmp_path: Path) -> None:
    """`bench.gpu --layout` end to end on a tiny book (the small stand-in on the CPU): the
    blocks caught, fed as capacity, convert with layout on, the layout model alone; its
    figures merged under `layout_on` beside what the file held."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"capacity_pages_per_s": 9.1, "detail": {}}))
    with start_fake_server(free_port(), "--output-tokens", "lognormal:40:0.5",
                           "--disable-uvicorn-access-log") as srv:  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "bench.gpu", "--server-url", srv.url + "/v1", "--layout",
             "--layout-engine", "paddle", "--layout-device", "cpu", "--layout-cache",
             str(layout_cache), "--pages", "2", "--only", "capacity,convert,alone",
             "--concurrency", "4", "--results", str(results), "--log-dir",
             str(tmp_path / "logs")],
            cwd=ROOT, capture_output=True, text=True, timeout=560, check=False)  # fmt: skip
    assert proc.returncode == 0, f"bench.gpu --layout failed:\n{proc.stderr[-3000:]}"
    data = json.loads(results.read_text())
    assert data["capacity_pages_per_s"] == 9.1, "the layout-off figures were lost"
    on = data["layout_on"]
    assert on["layout_engine"] == "paddle" and on["layout_device"] == "cpu"
    assert on["requests_per_page"] == 7 and on["blocks_per_page"] == 8, on
    for key in ("capacity_pages_per_s", "ocrvl_convert_pages_per_s", "layout_alone_pages_per_s",
                "convert_vs_ceiling"):  # fmt: skip
        assert on[key] and on[key] > 0, f"layout_on lacks {key}: {on}"
    assert on["b2_pages_per_s"] is None and on["b2_kwargs"]["engine"] == "paddle_static"
    convert = on["results"]["ocrvl convert"]["extra"]
    assert any("cpu (paddle_static" in line for line in convert["layout"]), (
        f"ocrvl convert did not run the layout model as asked: {convert['layout']}")
    assert "Targets:" in proc.stdout and "ocrvl convert >= 1.3x B2: not run" in proc.stdout


# --- a stopped bench stops what it started; --vllm-python; the layout-on budget -------------

FAKE_VLLM_MAIN = '''"""Stands in for `python -m vllm.entrypoints.cli.main serve MODEL ...`:
testkit's fake server on the same port (the vLLM flags it does not know are ignored)."""
import sys

from testkit.fake_server.cli import main

args = sys.argv[1:]
if args[:1] == ["serve"]:
    args = args[2:]
sys.exit(main(args))
'''


def fake_vllm_site(root: Path) -> Path:
    """A PYTHONPATH entry whose `vllm.entrypoints.cli.main` is testkit's fake server."""
    pkg = root / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for folder in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "main.py").write_text(FAKE_VLLM_MAIN)
    return root


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_bench_stopped_by_a_signal_stops_the_vllm_server_it_started(
        tmp_path: Path, sig: str) -> None:  # fmt: skip
    """`timeout 500 python3 -m bench.gpu ...` on the H100: killed at its limit, its vLLM (a
    session of its own) lived on with 41 GB and the next bench's vLLM could not start."""
    import psutil

    site = fake_vllm_site(tmp_path / "site")
    err = tmp_path / "bench.err"
    with err.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu", "--model-dir", str(tmp_path / "model"),
             "--vllm-pythonpath", str(site), "--pages", "4", "--only", "capacity",
             "--rounds", "500", "--concurrency", "4", "--results", str(tmp_path / "r.json"),
             "--log-dir", str(tmp_path / "logs")],
            cwd=ROOT, env=ocrvl_env(), stdout=subprocess.DEVNULL, stderr=out)  # fmt: skip
    server: list[int] = []
    try:
        wait_until(lambda: "vLLM ready in" in err.read_text() or proc.poll() is not None, 120,
                   what="the fake vLLM ready")  # fmt: skip
        assert proc.poll() is None, err.read_text()[-3000:]
        server = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                  if "vllm.entrypoints.cli.main" in " ".join(p.cmdline())]  # fmt: skip
        assert server, "the bench's vLLM was not found among its children"
        assert os.getpgid(server[0]) == server[0] != os.getpgid(proc.pid), (
            "vLLM should lead a process group of its own (its engine core goes with it)")
        proc.send_signal(getattr(__import__("signal"), sig))
        proc.wait(90)
        wait_until(lambda: _gone(server[0]), 60, interval=0.1,
                   what=f"the vLLM server {server[0]} gone after the bench's {sig}")  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
        for pid in server:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.killpg(pid, 9)
    assert f"signal {getattr(__import__('signal'), sig).value}: stopping" in err.read_text()


# where the plan asks for 16384 batched tokens, exit as vLLM 0.33.0 did on the 8 GB card
FAKE_VLLM_033_8GB_MAIN = '''import sys
from pathlib import Path

from testkit.fake_server.cli import main

args = sys.argv[1:]
if args[args.index("--max-num-batched-tokens") + 1] == "16384":
    print(Path(%r).read_text(), flush=True)
    sys.exit(1)
sys.exit(main(args[2:]))
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_small_card_bench_starts_vllm_on_the_plan_ocrvl_steps_down_to(
        tmp_path: Path) -> None:  # fmt: skip
    """vLLM 0.33.0 on the 8 GB card beside the layout model found no room for its KV cache
    under ocrvl's plan: the bench must go on as ocrvl's managed server does, to the next plan,
    and say which plan started."""
    from bench.gpu import small_card
    from ocrvl_daemon.config.model import Config
    from ocrvl_daemon.server import autotune

    site = fake_vllm_site(tmp_path / "site")
    log = ROOT / "tests" / "fixtures" / "vllm-0.33-no-kv-cache-8gb-layout.log"
    (site / "vllm" / "entrypoints" / "cli" / "main.py").write_text(
        FAKE_VLLM_033_8GB_MAIN % str(log))
    planned = {autotune.UTILIZATION: 0.46, autotune.MAX_MODEL_LEN: 5632,
               autotune.MAX_NUM_SEQS: 24, autotune.BATCHED_TOKENS: 16384}
    serve = functools.partial(ServeOptions, model=str(tmp_path / "model"), dummy=False,
                              lengths=None, port=free_port(), pythonpath=str(site))
    res: dict[str, Any] = {}
    with small_card.started_stepping_down(serve, planned, Config.model_validate({}), 0.1,
                                          tmp_path / "vllm.log", res) as url:
        assert answers_health(url), "the bench did not hand over a server that answers"
    assert [s["started"] for s in res["starts"]] == [False, True], res["starts"]
    assert res["started_plan"] == {**planned, autotune.MAX_NUM_SEQS: 12,
                                   autotune.BATCHED_TOKENS: 8192}, \
        "the second start is not the plan ocrvl's managed server steps down to"
    assert res["served_utilization"] == 0.046, "the small card's share, scaled to the real one"
    assert "No available memory for the cache blocks" in res["starts"][0]["failure"]
    assert (tmp_path / "vllm-start-1.log").exists(), "the failed start's log was not kept"
    lines = small_card.plan_lines(res)
    assert "did not start: " in lines[0] and lines[1].startswith("then, stepped down")


@pytest.mark.quick
def test_a_failed_first_start_on_the_small_card_is_vllms_not_the_layout_models_or_ocrvls(
        tmp_path: Path) -> None:  # fmt: skip
    """vLLM 0.33.0's first start on the 8 GB card ran out of memory and the second served
    every page: the bench said it did not fit, because it read the failed start's log as
    ocrvl's and its engine core's memory as the layout model's."""
    from bench.gpu import small_card

    (tmp_path / "vllm.log").write_text("INFO served\n")
    (tmp_path / "vllm-start-1.log").write_text(
        "ValueError: No available memory for the cache blocks.\n")
    (tmp_path / "blocks.log").write_text("INFO 64 pages\n")
    (tmp_path / "adaptive.1.log").write_text("INFO 64 pages\n")
    assert small_card.ocrvl_out_of_memory(tmp_path) == [], \
        "a start of vLLM that failed was counted as ocrvl running out of memory"
    (tmp_path / "adaptive.1.log").write_text("torch.OutOfMemoryError: CUDA out of memory\n")
    assert small_card.ocrvl_out_of_memory(tmp_path) == ["adaptive.1.log"], \
        "ocrvl's own out of memory was missed"

    memory = small_card.CardMemory()
    failed_core, core, layout = 9315, 9986, 10632
    memory.names = {failed_core: "VLLM::EngineCore", core: "VLLM::EngineCore",
                    layout: "python3 -c from ocrvl_daemon.worker.main import serve"}
    memory.samples = [(7600, {failed_core: 6908}), (7400, {core: 4616, layout: 1786})]
    peaks = memory.peaks(700, {core})
    assert peaks["peak_server_mib"] == 6908, "the failed start's engine core is vLLM's"
    assert peaks["peak_layout_mib"] == 1786, \
        "the failed start's engine core was counted as the layout model's memory"
    assert peaks["peak_card_used_mib"] == 6900


@pytest.mark.quick
def test_vllm_python_is_passed_on_as_an_absolute_executable(tmp_path: Path) -> None:
    """`--vllm-python python3`: ocrvl's managed server refuses a bare name for server.python
    (every replica "failed"), so every bench resolves it on its PATH first."""
    from bench.gpu.run import parse_args
    from bench.gpu.vllm_server import managed_vllm, model_dir_parser

    found = shutil.which("python3")
    assert found
    args = parse_args(["--model-dir", "m", "--vllm-python", "python3"])
    assert args.vllm_python == os.path.abspath(found)
    ap = model_dir_parser("x", None)
    assert ap.parse_args(["--model-dir", "m", "--vllm-python", "python3"]).vllm_python \
        == os.path.abspath(found)
    assert os.path.isabs(ap.parse_args(["--model-dir", "m"]).vllm_python)
    with pytest.raises(SystemExit):
        ap.parse_args(["--model-dir", "m", "--vllm-python", "no-such-python-here"])
    assert managed_vllm("m", "python3", "", 8000)["server"]["python"] == os.path.abspath(found)
    with pytest.raises(ValueError, match="not an executable Python"):
        managed_vllm("m", str(tmp_path / "nothing"), "", 8000)


@pytest.mark.quick
def test_the_layout_on_budget_runs_parts_by_importance_and_skips_what_does_not_fit(
        tmp_path: Path) -> None:  # fmt: skip
    from types import SimpleNamespace

    from bench.gpu import layout_on

    plan = layout_on.estimates({"cpu", "small", "run", "convert", "b2", "capacity", "alone"},
                               "gpu:0", 64, 1, 10, 12, [4, 8, 16], 16)  # fmt: skip
    assert [p for p, _ in plan] == ["alone", "capacity", "b2", "convert", "run", "small",
                                    "cpu 4", "cpu 8", "cpu 16"], "layout alone first, CPU last"
    cost = dict(plan)
    # the H100 run of 2026-12-05: capacity 22 s, B2 40 s, convert 46 s, run 44 s (64 pages)
    assert 20 < cost["capacity"] < cost["b2"] < cost["run"] < cost["convert"] < 60
    assert cost["alone"] < 60, "layout alone is bounded (pages and seconds)"
    assert layout_on.cpu_s(4, 48) > layout_on.cpu_s(16, 48), "fewer cores, slower"
    assert cost["cpu 16"] == layout_on.cpu_s(16, 96), "16 cores: 6 workers, a 96-page book"
    assert layout_on.cpu_book_pages(48, 6) == 96 and layout_on.cpu_book_pages(48, 1) == 48, (
        "the CPU sweep's book must give every worker 16 pages (8 each never filled the pipeline)")
    # the run that overran: alone first (before vLLM), then vLLM and the contenders
    total = cost["alone"] + layout_on.server_s(64) + sum(cost[c] for c in
                                                         ("capacity", "b2", "convert", "run"))
    assert total < 500, "the 500 s limit holds layout alone, vLLM and the four contenders"

    now = [0.0]
    budget = layout_on.Budget(100, clock=lambda: now[0])
    args = SimpleNamespace(budget_s=100, results=tmp_path / "r.json")
    res: dict[str, Any] = {"results": {}}
    run = layout_on.LayoutRun(args, res, {}, budget)  # type: ignore[arg-type]
    assert run.fits("alone", 60)
    now[0] = 50
    assert not run.fits("capacity", 60) and run.fits("b2", 50)
    assert res["skipped"] == {"capacity": "skipped: budget"}
    assert json.loads(args.results.read_text())["layout_on"]["skipped"] == res["skipped"], (
        "a skipped part is written at once")
    assert layout_on.Budget(None).fits(1e9), "no budget: everything runs"


@pytest.mark.quick
def test_a_books_steady_pace_leaves_out_its_first_and_last_pages() -> None:
    from bench.gpu.run import steady_pages_per_s

    # 5 s before the first page (a page's layout, then its slowest block), 2 s for the last
    readings = [(0.0, 0), (5.0, 0), (6.0, 10), (7.0, 30), (8.0, 50), (9.0, 70), (10.0, 90),
                (12.0, 100)]  # fmt: skip
    assert steady_pages_per_s(readings, 100) == 20.0, (
        "the pace between a tenth and nine tenths of the book should be 80 pages in 4 s")
    assert steady_pages_per_s([(0.0, 0), (9.0, 100)], 100) is None, (
        "a book done between two progress lines has no steady pace")


@pytest.mark.quick
def test_a_layout_alone_measurement_is_bounded_in_time() -> None:
    from bench.gpu.layout_on import ALONE_MAX_PAGES, detect_within

    calls: list[int] = []

    def slow(image: int) -> int:
        calls.append(image)
        time.sleep(0.02)
        return 3

    start, end, pages, blocks = detect_within(slow, list(range(1000)), 0.1)
    assert 1 <= pages < 20 and blocks == 3 * pages and end - start < 1, (pages, end - start)
    assert detect_within(lambda i: 1, [1, 2, 3], 60)[2:] == (3, 3)
    assert ALONE_MAX_PAGES <= 64


# --- the lease plan (bench.gpu.lease) ----------------------------------------------------------


@pytest.mark.quick
def test_the_lease_splits_its_budget_in_priority_order() -> None:
    from bench.gpu import lease

    steps = lease.chosen("layout, mps,rerun,loops,small-card")
    assert [s.name for s in steps] == ["layout", "mps", "rerun", "loops", "small-card"]
    assert [s.name for s in lease.chosen("loops,layout,loops")] == ["loops", "layout"]
    with pytest.raises(ValueError, match="unknown step"):
        lease.chosen("layout,nope")
    grace = lease.GRACE_S
    # 25 minutes: layout and mps get their estimates, rerun what is left, the rest nothing
    shares = dict(lease.split(steps, 1500))
    assert shares["layout"] == lease.STEPS["layout"].estimate_s
    assert shares["mps"] == lease.STEPS["mps"].estimate_s
    left = 1500 - shares["layout"] - shares["mps"] - 2 * grace
    assert shares["rerun"] is None if left - grace < lease.STEPS["rerun"].minimum_s else \
        shares["rerun"] == min(lease.STEPS["rerun"].estimate_s, left - grace)
    used = sum(s + grace for s in shares.values() if s is not None)
    assert used <= 1500, "every share with its grace fits the budget"
    assert lease.share_s(lease.STEPS["loops"], 100) is None, "below its minimum: skipped"
    assert lease.share_s(lease.STEPS["loops"], 10_000) == lease.STEPS["loops"].estimate_s
    assert lease.share_s(lease.STEPS["loops"], 300 + grace) == 300, "what is left, if less"
    assert lease.rerun_estimate_s(5) > lease.rerun_estimate_s(2)


@pytest.mark.quick
def test_the_lease_writes_progress_lines_and_the_benches_commands(tmp_path: Path) -> None:
    from bench.gpu import lease

    line = lease.progress_line("layout", "start (share 780 s)", now=0)
    assert re.fullmatch(r"\d\d:\d\d:\d\d layout: start \(share 780 s\)", line), line
    progress = lease.Progress(tmp_path / "progress.txt")
    progress("mps", "done (exit 0) in 500 s")
    progress("rerun", "skipped: budget")
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [x.split(" ", 1)[1] for x in lines] == ["mps: done (exit 0) in 500 s",
                                                   "rerun: skipped: budget"]
    args = lease.parse_args(["--budget-s", "1500", "--out", str(tmp_path / "out"),
                             "--model-dir", str(tmp_path / "model"), "--layout-cache",
                             str(tmp_path / "lm"), "--vllm-python", "python3",
                             "--vllm-pythonpath", "/tmp/site"])  # fmt: skip
    assert os.path.isabs(args.vllm_python) and os.path.isabs(args.python)
    layout = lease.commands("layout", args, 780)
    assert layout[0][1:] == ["-m", "bench.gpu.dummy_model", str(tmp_path / "model")]
    assert layout[1][1:] == ["-m", "testkit.layout_model", str(tmp_path / "lm"), "--format",
                             "transformers"], "the stand-in is written where it is missing"
    main = layout[-1]
    assert main[1:4] == ["-m", "bench.gpu", "--model-dir"] and "--layout" in main
    assert main[main.index("--layout-device") + 1] == "gpu:0"
    assert main[main.index("--layout-engine") + 1] == "transformers"
    assert float(main[main.index("--budget-s") + 1]) < 780, "the bench's own budget"
    assert main[main.index("--results") + 1] == str(tmp_path / "out" / "layout.json")
    assert main[main.index("--vllm-pythonpath") + 1] == "/tmp/site"
    mps = lease.commands("mps", args, 540)[-1]
    assert mps[2] == "bench.gpu.big_gpu" and "x2,x2-sync,x2-api2,x2-batched-8k" in mps
    assert "256" in mps
    args.mps_settings = "mps-x2,mps-x4"
    assert "mps-x2,mps-x4" in lease.commands("mps", args, 540)[-1], "--mps-settings is used"
    rerun = lease.commands("rerun", args, 600)[-1]
    assert rerun[2] == "bench.gpu" and "--layout" not in rerun
    assert rerun[rerun.index("--concurrency") + 1] == "128" and "--rounds" in rerun
    loops = lease.commands("loops", args, 300)[-1]
    assert loops[2] == "bench.gpu.loop_savings"
    assert Path(loops[loops.index("--log-dir") + 1]).is_dir(), \
        "the loops bench opens its log in --log-dir without making it (it failed so on a GPU)"
    small = lease.commands("small-card", args, 300)[-1]
    assert small[2] == "bench.gpu.small_card" and "--layout" in small
    auto = lease.commands("auto-replicas", args, 600)[-1]
    assert auto[2] == "bench.gpu.ray_vs_local" and auto[auto.index("--order") + 1] == "local"
    assert auto[auto.index("--vllm-pythonpath") + 1] == "/tmp/site", "the release measured"
    assert auto[auto.index("--modes") + 1] == "off,on"
    args.auto_modes = "on"
    auto = lease.commands("auto-replicas", args, 600)[-1]
    assert auto[auto.index("--modes") + 1] == "on", "--auto-modes is not passed on"


@pytest.mark.quick
def test_the_lease_layout_mps_step_runs_big_gpu_with_layout_on_over_mps_replicas(
        tmp_path: Path) -> None:  # fmt: skip
    from bench.gpu import lease

    args = lease.parse_args(["--budget-s", "1500", "--out", str(tmp_path / "out"),
                             "--model-dir", str(tmp_path / "model"), "--layout-cache",
                             str(tmp_path / "lm"), "--plan", "layout-mps,mps"])  # fmt: skip
    assert [s.name for s in args.steps] == ["layout-mps", "mps"]
    step = lease.STEPS["layout-mps"]
    assert (step.estimate_s, step.minimum_s) == (480, 330), "4 replicas start in ~270 s"
    commands = lease.commands("layout-mps", args, 480)
    assert commands[1][1:] == ["-m", "testkit.layout_model", str(tmp_path / "lm"), "--format",
                               "transformers"], "the stand-in is written where it is missing"
    main = commands[-1]
    assert main[1:3] == ["-m", "bench.gpu.big_gpu"] and "--layout" in main
    for flag, value in (("--layout-engine", "transformers"), ("--layout-device", "gpu:0"),
                        ("--layout-cache", str(tmp_path / "lm")),
                        ("--settings", "mps-x4,mps-x2"), ("--pages", "64"),
                        ("--results", str(tmp_path / "out" / "layout-mps.json")),
                        ("--log-dir", str(tmp_path / "out" / "layout-mps-logs")),
                        ("--model-dir", str(tmp_path / "model"))):  # fmt: skip
        assert main[main.index(flag) + 1] == value, (flag, main)
    assert float(main[main.index("--budget-s") + 1]) == 480 - lease.BENCH_MARGIN_S
    stand_in = tmp_path / "lm" / "official_models" / "PP-DocLayoutV3_safetensors"
    stand_in.mkdir(parents=True)
    assert lease.commands("layout-mps", args, 480)[1][2] == "testkit.layout_model", (
        "the folder PaddleX makes as its cache holds no model: the stand-in is still written")
    (stand_in / "model.safetensors").write_bytes(b"")
    assert lease.commands("layout-mps", args, 480)[1][2] == "bench.gpu.big_gpu", (
        "a cache with the stand-in is used as it is")


@pytest.mark.quick
def test_the_lease_layout_cpu_step_runs_only_the_cpu_sweep(tmp_path: Path) -> None:
    from bench.gpu import lease

    args = lease.parse_args(["--budget-s", "1500", "--out", str(tmp_path / "out"),
                             "--layout-cache", str(tmp_path / "lm"), "--plan", "layout-cpu"])
    main = lease.commands("layout-cpu", args, 540)[-1]
    assert main[1:3] == ["-m", "bench.gpu"] and "--layout" in main
    assert main[main.index("--only") + 1] == "cpu", "the CPU sweep alone, not the whole bench"
    assert main[main.index("--layout-engine") + 1] == "transformers", main
    assert "layout-cpu" in lease.DEFAULT_PLAN.split(","), "the next lease runs it"


STUB_BENCH = '''
import os, signal, subprocess, sys, time
# like a bench that started vLLM in a session of its own, then hung deaf to SIGTERM
server = subprocess.Popen([sys.executable, "-m", "testkit.fake_server", "--port", sys.argv[1]],
                          start_new_session=True)
open(sys.argv[2], "w").write(str(server.pid))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(1)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_lease_step_cut_at_its_deadline_leaves_nothing_behind(tmp_path: Path) -> None:
    """A step that outlives its share is SIGTERMed, then SIGKILLed, and every process it
    started (here a fake server in a session of its own, as vLLM is) is ended; progress.txt
    says so and the lease goes on to the next step."""
    import psutil

    from testkit.harness import answers_health

    port = free_port()
    pid_file = tmp_path / "server.pid"
    stub = tmp_path / "stub.py"
    stub.write_text(STUB_BENCH)
    out = tmp_path / "lease"
    env = ocrvl_env(OCRVL_LEASE_STUB_COMMAND=f"{sys.executable} {stub} {port} {pid_file}")
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu.lease", "--budget-s", "60", "--out", str(out),
         "--plan", "stub", "--share", "stub=8", "--grace-s", "2", "--model-dir",
         str(tmp_path / "model")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100, check=False)  # fmt: skip
    server = int(pid_file.read_text())
    try:
        assert _gone(server), "the step's server outlived the lease"
        assert not answers_health(f"http://127.0.0.1:{port}")
        progress = (out / "progress.txt").read_text()
        for said in ("stub: start (share 8 s", "stub: deadline: SIGTERM",
                     "stub: still there 2 s after SIGTERM: SIGKILL",
                     "stub: ended 1 leftover process(es)", "stub: cut (exit None)",
                     "lease: end after", "processes of ours left: 0"):  # fmt: skip
            assert said in progress, f"{said!r} not in progress.txt:\n{progress}"
        assert re.search(r"^\d\d:\d\d:\d\d stub: start", progress, re.M), progress
        assert (out / "stub.log").exists(), "the step's output is kept under --out"
        assert done.returncode == 1, "a step that was cut is not a success"
        assert time.monotonic() - t0 < 60
    finally:
        with __import__("contextlib").suppress(psutil.Error):
            psutil.Process(server).kill()
