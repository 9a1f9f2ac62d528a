"""README's exit-code table, one row at a time, through the real `ocrvl` command.

0 ok, 1 a document failed, 2 bad command line, 3 bad configuration, 4 bad input file, 5 model
server problem, 6 missing dependency, 7 `doctor` found a blocking problem, 130 interrupted
(141, output closed early: tests/test_status.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from ocrvl_daemon.errors import ExitCode
from ocrvl_daemon.files.pdf import file_identity
from ocrvl_daemon.storage.store import Store
from testkit import fake_server_env
from testkit.documents import (
    make_encrypted_pdf,
    make_pdf,
    make_random_bytes,
    make_truncated_pdf,
    make_zero_byte,
)
from testkit.fake_server_env import FakeVllm
from testkit.harness import (
    FakeServerProcess,
    free_port,
    process_alive,
    start_fake_server,
    wait_until,
)
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    ocrvl_argv,
    ocrvl_env,
    run_ocrvl,
    write_config,
)
from testkit.stubborn import slow_to_stop, stubborn_pids

MODEL = "PaddleOCR-VL-1.6-0.9B"


RTX4060_SMI = Path(__file__).parent / "fixtures" / "gpu" / "rtx4060.sh"


def known_to_daemon(config: Path, pdf: Path) -> None:
    """Queue `pdf` in the daemon's store, as if the daemon had found it in its inbox."""
    ident = file_identity(pdf)
    store = Store(config.parent / "state" / "jobs.sqlite")
    try:
        store.enqueue(pdf, ident.sha256, ident.size, ident.mtime, MODEL)
    finally:
        store.close()


def test_0_ok(tmp_path: Path):
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("status", "--config", config, timeout=60)
    assert result.returncode == ExitCode.OK, result.stderr


def test_1_a_document_failed(tmp_path: Path, fake_server: FakeServerProcess):
    pdf = make_pdf(tmp_path / "notes.pdf", 1)
    (tmp_path / "notes.md").write_text("my own notes\n", encoding="utf-8")
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf)
    assert result.returncode == ExitCode.CONVERSION_FAILED, result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["retry"], "Nothing to retry"),
        (["retry", "--pages", "3-x", "{pdf}"], "'3-x' is not a page list"),
        (["retry", "--pages", "9", "{pdf}"], "book.pdf has 4 pages"),
        (["retry", "--pages", "2,5", "{pdf}"], "book.pdf has 4 pages"),
        (["convert", "--pages", "9", "{pdf}"], "book.pdf has 4 pages"),
        (["convert", "--pages", "0", "{pdf}"], "'0' is not a page list"),
        (["convert"], "the following arguments are required: PDF"),
        (["run", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
    ids=["retry-nothing", "retry-pages-malformed", "retry-pages-beyond-last",
         "retry-pages-partly-beyond", "convert-pages-beyond-last", "convert-pages-zero",
         "convert-no-pdf", "unknown-option"],
)
def test_2_bad_command_line(tmp_path: Path, args: list[str], says: str):
    config = write_config(tmp_path / "config.yaml")
    pdf = make_pdf(tmp_path / "book.pdf", 4)
    known_to_daemon(config, pdf)
    argv = [a.replace("{pdf}", str(pdf)) for a in args]
    # No server answers here: a command line that were accepted would fail otherwise.
    result = run_ocrvl(*argv, "--config", config, timeout=60)
    assert result.returncode == ExitCode.USAGE, (result.returncode, result.stderr)
    assert says in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "book.md").exists()
    store = Store(tmp_path / "state" / "jobs.sqlite")
    try:
        assert all(j.attempts == 0 and j.state.value == "queued" for j in store.jobs()), (
            "a refused command line changed the queue"
        )
    finally:
        store.close()


def test_2_an_unknown_option_shows_the_usage_of_its_command(tmp_path: Path):
    result = run_ocrvl("run", "--bogus", timeout=60)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert result.stderr.startswith("usage: ocrvl run "), result.stderr
    assert "ocrvl run: error: unrecognized arguments: --bogus" in result.stderr, result.stderr


@pytest.mark.parametrize("where", ["under-a-file", "under-proc"])
def test_3_a_state_dir_that_cannot_be_created_names_the_key_the_path_and_the_fix(
    tmp_path: Path, where: str
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    state = blocker / "state" if where == "under-a-file" else Path("/proc/ocrvl-test/state")
    config = write_config(tmp_path / "config.yaml", state_dir=str(state))
    for command in ("run", "status"):
        result = run_ocrvl(command, "--config", config, timeout=60)
        assert result.returncode == ExitCode.CONFIG, (command, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        assert f"state_dir = {state} cannot be used" in result.stderr, result.stderr
        assert "set state_dir in the config file" in result.stderr, result.stderr


def test_3_bad_configuration(tmp_path: Path):
    config = tmp_path / "config.yaml"
    config.write_text("inbox:\n  stable_seconds: -1\n", encoding="utf-8")
    result = run_ocrvl("status", "--config", config, timeout=60)
    assert result.returncode == ExitCode.CONFIG, result.stderr


def test_4_bad_input_file(tmp_path: Path):
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", "http://127.0.0.1:9/v1",
                       tmp_path / "missing.pdf", timeout=60)
    assert result.returncode == ExitCode.INPUT_FILE, result.stderr
    assert "missing.pdf does not exist" in result.stderr


def test_4_a_file_neither_named_nor_made_pdf_is_refused_and_nothing_is_written_beside_it(
    tmp_path: Path, fake_server: FakeServerProcess
):
    folder = tmp_path / "code"
    folder.mkdir()
    script = folder / "gen.py"
    script.write_text("print('not a PDF')\n", encoding="utf-8")
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url,
                       script, timeout=120)
    assert result.returncode == ExitCode.INPUT_FILE, (result.returncode, result.stderr)
    assert "gen.py is not a PDF (no %PDF header)" in result.stderr, result.stderr
    assert "though it is named .pdf" not in result.stderr, result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["gen.py"], (
        "ocrvl wrote beside a file that is not a PDF")


@pytest.mark.parametrize(
    "make",
    [make_encrypted_pdf, make_zero_byte, make_truncated_pdf, make_random_bytes],
    ids=["encrypted", "zero-byte", "damaged", "not-a-pdf"],
)
def test_4_a_pdf_that_cannot_be_read_keeps_its_exit_code_through_the_conversion(
    tmp_path: Path, fake_server: FakeServerProcess, make: Callable[[Path], Path]
):
    pdf = make(tmp_path / "bad.pdf")
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf,
                       timeout=120)
    assert result.returncode == ExitCode.INPUT_FILE, (result.returncode, result.stderr)
    assert "drop that in" not in result.stderr, "advice for the inbox given to `convert`"


def test_4_a_pdf_locked_while_it_converts_fails_at_once_with_the_fix_not_retried_as_gone(
        tmp_path: Path):
    """The engine worker finds the PDF locked with a password (the same size and mtime: only
    its bytes changed): that permanent input error keeps its kind across the pipe, so the
    document fails with its message and fix, and is not retried as if the file had gone
    (issue 50, item 3)."""
    book = make_pdf(tmp_path / "book.pdf", 40)
    locked = make_encrypted_pdf(tmp_path / "locked.pdf").read_bytes()
    room = book.stat().st_size - len(locked)
    assert room > 0, "the locked PDF must fit in the book's size"
    config = write_config(tmp_path / "config.yaml",
                          pipeline={"max_concurrency": 2, "min_concurrency": 1})
    log = tmp_path / "convert.log"
    with start_fake_server(free_port(), "--step-t0-ms", "25", "--output-tokens",
                           "fixed:200") as server, log.open("wb") as out:
        proc = subprocess.Popen(
            ocrvl_argv("convert", "--config", config, "--server-url", server.api_url, book),
            stdout=out, stderr=subprocess.STDOUT, env=ocrvl_env())
        try:
            wait_until(lambda: server.stats()["requests_received"] >= 2, 120,
                       what="the book's first pages at the server")
            before = book.stat()
            with book.open("r+b") as f:  # the same file, its bytes now a locked PDF
                f.write(locked + b"\n" + b"%" * (room - 1))
            os.utime(book, ns=(before.st_atime_ns, before.st_mtime_ns))
            code = proc.wait(180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text("utf-8")
    assert "retrying in" not in text, (
        "a permanent input error was retried as if the file had gone:\n" + text[-3000:])
    assert code == ExitCode.INPUT_FILE, (code, text[-3000:])
    assert "is encrypted with a password" in text and "save an unprotected copy" in text, (
        text[-3000:])


def test_2_a_server_url_that_is_not_a_url_is_a_command_line_error_naming_the_option(
    tmp_path: Path,
):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml")
    result = run_ocrvl("convert", "--config", config, "--server-url", "notaurl", pdf, timeout=60)
    assert result.returncode == ExitCode.USAGE, (result.returncode, result.stderr)
    assert "--server-url" in result.stderr and "'notaurl'" in result.stderr, result.stderr
    assert "http://" in result.stderr, result.stderr


def test_convert_help_lists_every_exit_code_it_can_end_with():
    result = run_ocrvl("convert", "--help", timeout=60)
    text = " ".join(result.stdout.split())
    for code in (0, 1, 2, 3, 4, 5, 6, 130):
        assert f"{code} " in text, (code, text)
    assert "6 when the model server is not installed" in text, text
    assert "the layout model cannot be downloaded" in text, text


def test_5_a_driver_too_old_for_the_servers_torch_ends_convert_with_the_fix(tmp_path: Path):
    # An RTX 4060 on driver 566 (CUDA 12.7) and a server environment whose torch is built for
    # CUDA 13.0: torch refuses at the server's start, as the real one does.
    python = fake_server_env.make(tmp_path / "server-venv", FakeVllm(driver_cuda="12.7"))
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml", server={
        "launcher": "vllm", "python": str(python), "port": free_port(),
        "restart_backoff_initial": 0.2, "restart_backoff_max": 0.5})
    result = run_ocrvl("convert", "--config", config, pdf, timeout=120, OCRVL_NO_NVML="1",
                       OCRVL_NVIDIA_SMI=str(RTX4060_SMI.with_name("rtx4060-driver566.sh")))
    assert result.returncode == ExitCode.SERVER, result.stderr
    said = result.stderr.split("Fix:")[-1]
    assert "NVIDIA driver is too old" in result.stderr and "CUDA 12.7" in result.stderr, \
        result.stderr
    assert "Windows driver" in said and "--vllm 0.19.1" in said, said
    assert "setup-server`, or set server.python" not in said, "a driver problem was taken for a "\
        "missing vLLM"


def test_5_model_server_problem(tmp_path: Path):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml")
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    result = run_ocrvl("convert", "--config", config, "--server-url", url, pdf, timeout=120)
    assert result.returncode == ExitCode.SERVER, result.stderr
    assert f"Cannot reach the model server at {url}" in result.stderr


def test_5_a_server_that_refuses_every_page_ends_with_its_words_not_a_book_of_placeholders(
        tmp_path: Path):
    pdf = make_pdf(tmp_path / "book.pdf", 4)
    config = write_config(tmp_path / "config.yaml", pipeline={"use_layout_detection": False},
                          server=managed_fake_server(free_port(), "--refused-prompts", "OCR:"))
    result = run_ocrvl("convert", "--config", config, pdf, timeout=180)
    assert result.returncode == ExitCode.SERVER, (result.returncode, result.stderr[-3000:])
    assert "refuses every page of book.pdf" in result.stderr, result.stderr[-3000:]
    assert "HTTP 400: the fake server refuses 'OCR:' requests" in result.stderr, (
        "the server's own words should say why")
    assert not (tmp_path / "book.md").exists(), (
        "a server that refuses every page left a book of placeholders")


def test_5_a_vllm_that_gates_image_sizes_names_the_flag_and_the_flag_converts(
        tmp_path: Path):
    """vLLM >= 0.31 refuses PaddleOCR-VL's per-block image sizes unless started with
    --trust-request-mm-kwargs; a managed server ocrvl cannot read the version of (here the
    user's own command) gets the fix named, and the fix converts the book."""
    pdf = make_pdf(tmp_path / "book.pdf", 4)
    server = managed_fake_server(free_port(), "--gate-request-mm-kwargs")
    config = write_config(tmp_path / "config.yaml", pipeline={"use_layout_detection": False},
                          server=server)
    result = run_ocrvl("convert", "--config", config, pdf, timeout=180)
    assert result.returncode == ExitCode.SERVER, (result.returncode, result.stderr[-3000:])
    assert "Start the server with --trust-request-mm-kwargs" in result.stderr, (
        "vLLM's own words should say why every page is refused")
    assert "set server.vllm_args: {trust-request-mm-kwargs: true}" in result.stderr, \
        result.stderr[-3000:]
    assert not (tmp_path / "book.md").exists()
    config = write_config(tmp_path / "config.yaml", pipeline={"use_layout_detection": False},
                          server={**server, "vllm_args": {"trust-request-mm-kwargs": True}})
    result = run_ocrvl("convert", "--config", config, pdf, timeout=180)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert (tmp_path / "book.md").exists()


def test_5_convert_gives_up_on_a_managed_server_whose_port_another_program_holds(
    tmp_path: Path,
):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = write_config(tmp_path / "config.yaml", server=managed_fake_server(
            port, restart_backoff_initial=0.2, restart_backoff_max=0.5))
        result = run_ocrvl("convert", "--config", config, pdf, timeout=120)
    assert result.returncode == ExitCode.SERVER, (result.returncode, result.stderr)
    assert "failed 3 times in a row" in result.stderr, result.stderr
    assert f"port {port} on 127.0.0.1 is taken by another program" in result.stderr
    assert "set server.port to a free port" in result.stderr, result.stderr


def test_6_a_layout_model_that_cannot_be_downloaded(tmp_path: Path,
                                                    fake_server: FakeServerProcess):
    """No layout model in PaddleX's cache and no model hub within reach (every connection
    goes through a proxy that is not there)."""
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml", pipeline={"use_layout_detection": True,
                                                              "layout_device": "cpu"})
    nowhere = f"http://127.0.0.1:{free_port()}"
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf,
                       timeout=300, PADDLE_PDX_CACHE_HOME=str(tmp_path / "empty-cache"),
                       HTTPS_PROXY=nowhere, HTTP_PROXY=nowhere, https_proxy=nowhere,
                       http_proxy=nowhere, NO_PROXY="127.0.0.1,localhost",
                       no_proxy="127.0.0.1,localhost")
    assert result.returncode == ExitCode.DEPENDENCY, (result.returncode, result.stderr[-3000:])
    assert "the layout model (PP-DocLayout) is downloaded once on first use" in result.stderr


def test_6_missing_dependency(tmp_path: Path):
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    config = write_config(tmp_path / "config.yaml",
                          server={"launcher": "vllm", "python": str(missing),
                                  "port": free_port()})
    result = run_ocrvl("convert", "--config", config, pdf, timeout=120, OCRVL_NO_NVML="1",
                       OCRVL_NVIDIA_SMI=str(RTX4060_SMI))
    assert result.returncode == ExitCode.DEPENDENCY, result.stderr
    assert f"server.python = {missing} is not an executable Python" in result.stderr


def test_6_a_layout_device_on_a_gpu_not_there_fails_with_its_own_fix(
        tmp_path: Path, fake_server: FakeServerProcess):
    """The daemon decides where the layout model runs (once); a GPU the configuration names
    and CUDA does not show fails every worker's start with that error's own kind and fix, not
    a guess from its text (issue 50, items 2 and 3)."""
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml", pipeline={
        "use_layout_detection": True, "layout_device": "gpu:7"})
    result = run_ocrvl("convert", "--config", config, "--server-url", fake_server.api_url, pdf,
                       timeout=120, OCRVL_NO_NVML="1", OCRVL_NVIDIA_SMI=str(RTX4060_SMI))
    assert result.returncode == ExitCode.DEPENDENCY, (result.returncode, result.stderr[-2000:])
    assert "pipeline.layout_device = 'gpu:7': no such GPU is visible here" in result.stderr
    assert "Fix: set pipeline.layout_device: auto or cpu" in result.stderr, result.stderr[-2000:]
    assert "reinstall ocrvl" not in result.stderr, "a fix guessed from the error's text"


@pytest.mark.parametrize("command", ["convert", "run"])
def test_6_no_gpu_starts_no_managed_vllm_and_points_to_an_external_server(tmp_path: Path,
                                                                          command: str):
    # The server environment a user without a GPU got from `setup-server --force`: its vLLM
    # warns "No module named 'vllm._C'" and dies with "Failed to infer device type".
    python = fake_server_env.make(tmp_path / "server-venv", FakeVllm(gpu=False))
    pdf = make_pdf(tmp_path / "book.pdf", 1)
    config = write_config(tmp_path / "config.yaml", server={"launcher": "vllm",
                                                            "python": str(python),
                                                            "port": free_port()},
                          inbox={"paths": [str(tmp_path / "inbox")]})
    args = [pdf] if command == "convert" else []
    result = run_ocrvl(command, "--config", config, *args, timeout=120, OCRVL_NO_NVML="1",
                       OCRVL_NVIDIA_SMI=str(tmp_path / "no-nvidia-smi"))
    assert result.returncode == ExitCode.DEPENDENCY, result.stderr
    assert "No NVIDIA GPU is visible here" in result.stderr, result.stderr
    assert "mode: external" in result.stderr, result.stderr
    assert "setup-server" not in result.stderr.split("Fix:")[-1], result.stderr
    assert "Failed to infer device type" not in result.stderr, "vLLM was started without a GPU"


def test_7_doctor_found_a_blocking_problem(tmp_path: Path):
    config = tmp_path / "config.yaml"
    config.write_text("server:\n  vllm_args:\n    max-model-len: 1024\n", encoding="utf-8")
    result = run_ocrvl("doctor", "--config", config, timeout=120)
    assert result.returncode == ExitCode.PROBLEMS_FOUND, result.stdout + result.stderr


def test_config_may_come_before_the_command(tmp_path: Path):
    config = write_config(tmp_path / "config.yaml", state_dir=str(tmp_path / "here"))
    for argv in (["--config", config, "status"], ["status", "--config", config]):
        result = run_ocrvl(*argv, timeout=60)
        assert result.returncode == ExitCode.OK, (argv, result.stderr)
    assert (tmp_path / "here" / "jobs.sqlite").exists(), "--config before the command was ignored"
    bad = tmp_path / "bad.yaml"
    bad.write_text("inbox:\n  stable_seconds: -1\n", encoding="utf-8")
    result = run_ocrvl("--config", bad, "status", timeout=60)
    assert result.returncode == ExitCode.CONFIG, "--config before the command was ignored"


def interrupt_like_ctrl_c(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, float]:
    """SIGINT to the process group, as a terminal's Ctrl-C; (exit code, seconds to exit)."""
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    wait_until(lambda: "stopping" in log.read_text(errors="replace"), 3,
               what="a line saying it is stopping, at once")
    try:
        code = proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"still running 20 s after Ctrl-C:\n{log.read_text()}") from None
    return code, time.monotonic() - start


@pytest.mark.slow
def test_130_ctrl_c_stops_ocrvl_run_at_once_with_pages_in_flight(tmp_path: Path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    requests = tmp_path / "requests.jsonl"
    port = free_port()
    config = write_config(
        tmp_path / "config.yaml",
        inbox={"paths": [str(inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
        # The server never answers: pages stay in flight until ocrvl stops.
        server=managed_fake_server(port, "--hang-after", "0", "--request-log", str(requests)),
    )
    daemon = DaemonProcess(config).start()
    try:
        daemon.wait_ready(90)
        make_pdf(inbox / "book.pdf", 3)
        wait_until(lambda: requests.exists() and requests.stat().st_size, 60,
                   what="a page request to reach the server")
        assert daemon.proc is not None
        code, seconds = interrupt_like_ctrl_c(daemon.proc, daemon.log_path)
    finally:
        daemon.terminate()
    assert code == ExitCode.INTERRUPTED, daemon.log()[-3000:]
    assert seconds < 15, f"took {seconds:.1f} s to stop after Ctrl-C"


@pytest.mark.slow
def test_130_ctrl_c_stops_ocrvl_convert_at_once_with_pages_in_flight(tmp_path: Path):
    requests = tmp_path / "requests.jsonl"
    pdf = make_pdf(tmp_path / "book.pdf", 3)
    config = write_config(tmp_path / "config.yaml")
    log = tmp_path / "convert.log"
    with start_fake_server(free_port(), "--hang-after", "0", "--request-log",
                           str(requests)) as server, log.open("wb") as out:
        proc = subprocess.Popen(
            ocrvl_argv("convert", "--config", config, "--server-url", server.api_url, pdf),
            stdout=out, stderr=subprocess.STDOUT, env=ocrvl_env(), start_new_session=True)
        try:
            wait_until(lambda: requests.exists() and requests.stat().st_size, 90,
                   what="a page request to reach the server")
            code, seconds = interrupt_like_ctrl_c(proc, log)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == ExitCode.INTERRUPTED, log.read_text()[-3000:]
    assert seconds < 15, f"took {seconds:.1f} s to stop after Ctrl-C"


@pytest.mark.slow
def test_130_a_second_ctrl_c_stops_ocrvl_convert_at_once_while_its_server_is_slow_to_stop(
        tmp_path: Path):
    """The first Ctrl-C waits (bounded) for the server to stop; one that ignores SIGTERM
    takes `server.stop_timeout`. A second Ctrl-C kills everything and exits within seconds."""
    requests = tmp_path / "requests.jsonl"
    stubborn = tmp_path / "stubborn.pid"
    pdf = make_pdf(tmp_path / "book.pdf", 3)
    server = managed_fake_server(free_port(), "--hang-after", "0", "--request-log",
                                 str(requests), stop_timeout=120)
    config = write_config(tmp_path / "config.yaml", server=slow_to_stop(server, stubborn))
    log = tmp_path / "convert.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(ocrvl_argv("convert", "--config", config, pdf), stdout=out,
                                stderr=subprocess.STDOUT, env=ocrvl_env(),
                                start_new_session=True)
    try:
        wait_until(lambda: requests.exists() and requests.stat().st_size, 120,
                   what="a page request to reach the server")
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        wait_until(lambda: "SIGTERM to process group" in log.read_text(errors="replace"), 30,
                   what="the first Ctrl-C's stop to reach the server")
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError("still running 30 s after a second Ctrl-C:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}") from None
        took = time.monotonic() - start
        wait_until(lambda: not any(process_alive(p.pid) for p in children), 10,
                   what=f"no process left behind ({children})")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in stubborn_pids(stubborn):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert code == ExitCode.INTERRUPTED, log.read_text(errors="replace")[-3000:]
    assert took < 10, f"took {took:.1f} s to stop after a second Ctrl-C"
