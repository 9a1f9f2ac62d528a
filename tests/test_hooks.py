"""hooks.on_done / hooks.on_failed: real hook processes run by `ocrvl convert`, `ocrvl run`
and the hook runner itself."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs

import pytest
import yaml

from ocrvl_daemon.config.file import validate_config
from ocrvl_daemon.config.model import HOOK_PLACEHOLDERS
from ocrvl_daemon.engine.hooks import HookRunner, HookValues
from ocrvl_daemon.errors import ConfigError
from testkit.documents import make_damaged_page_pdf, make_html_as_pdf, make_pdf
from testkit.harness import free_port, process_alive, start_fake_server, wait_until
from testkit.plain_server import serving
from testkit.runner import (
    DaemonProcess,
    managed_fake_server,
    run_ocrvl,
    write_config,
)

# Writes one JSON line per call: its arguments and its OCRVL_* environment.
RECORDER = """\
import json, os, sys
record = {"argv": sys.argv[1:],
          "env": {k: v for k, v in os.environ.items() if k.startswith("OCRVL_")}}
with open(sys.argv[1], "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\\n")
print("hook saw", os.environ["OCRVL_PDF"])
"""


def recorder_hook(folder: Path, log: Path, *args: str) -> list[str]:
    script = folder / "record_hook.py"
    script.write_text(RECORDER, encoding="utf-8")
    return [sys.executable, str(script), str(log), *args]


def records(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text("utf-8").splitlines() if line]


PLACEHOLDER_ARGS = [f"{name}={{{name}}}" for name in HOOK_PLACEHOLDERS]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `ocrvl convert` run writing Markdown and JSON: a book with a damaged page (done) and
    a non-PDF (failed)."""
    root = tmp_path_factory.mktemp("hooks")
    done_log, failed_log = root / "done.jsonl", root / "failed.jsonl"
    book = make_damaged_page_pdf(root / "book.pdf")
    broken = make_html_as_pdf(root / "broken.pdf")
    config = write_config(
        root / "config.yaml",
        output={"formats": ["markdown", "json"]},
        hooks={
            "on_done": recorder_hook(root, done_log, *PLACEHOLDER_ARGS, '{"keep": "{pdf}"}'),
            "on_failed": recorder_hook(root, failed_log, *PLACEHOLDER_ARGS),
        },
    )
    with start_fake_server(free_port()) as server:
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url,
                           book, broken)
    assert result.returncode == 4, (
        f"broken.pdf should fail as a bad input (exit 4), book.pdf convert:\n{result.stderr}")
    done, failed = records(done_log), records(failed_log)
    assert len(done) == 1 and len(failed) == 1, (
        f"each hook should run once, per document: on_done {done}, on_failed {failed}\n"
        f"{result.stderr}")
    return {"root": root, "book": book, "broken": broken, "done": done[0],
            "failed": failed[0], "stderr": result.stderr}


def expected_values(converted: dict) -> dict[str, dict[str, str]]:
    book, broken = converted["book"], converted["broken"]
    return {
        "done": {"pdf": str(book), "md": str(book.with_suffix(".md")),
                 "json": str(book.with_suffix(".json")),
                 "images": "", "pages": "3", "flagged": "2", "error": ""},
        "failed": {"pdf": str(broken), "md": "", "json": "", "images": "", "pages": "",
                   "flagged": ""},
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", HOOK_PLACEHOLDERS)
@pytest.mark.parametrize("event", ["done", "failed"])
def test_each_placeholder_reaches_the_hook_in_its_argv_and_environment(converted, event, name):
    record = converted[event]
    argv = dict(arg.split("=", 1) for arg in record["argv"][1:1 + len(HOOK_PLACEHOLDERS)])
    env_value = record["env"][f"OCRVL_{name.upper()}"]
    assert argv[name] == env_value, f"{{{name}}} and $OCRVL_{name.upper()} differ"
    expected = expected_values(converted)[event]
    if name in expected:
        assert argv[name] == expected[name], f"on_{event}: {{{name}}} is {argv[name]!r}"
    else:  # {error}: the reason, and its fix
        assert argv[name] == (f"{converted['broken']} is an HTML page (no %PDF header), though "
                              "it is named .pdf. Fix: save or download the document again as "
                              "a real PDF"), argv[name]


@pytest.mark.slow
def test_braces_that_are_not_placeholders_reach_the_hook_as_written(converted):
    assert converted["done"]["argv"][-1] == f'{{"keep": "{converted["book"]}"}}'


@pytest.mark.slow
def test_convert_runs_the_hooks_and_logs_their_output_under_the_document(converted):
    assert f"book.pdf: on_done: hook saw {converted['book']}" in converted["stderr"]
    assert "book.pdf: on_done hook succeeded" in converted["stderr"]
    assert f"broken.pdf: on_failed: hook saw {converted['broken']}" in converted["stderr"]


def test_a_hook_past_its_timeout_is_stopped_with_its_children_and_others_still_run(tmp_path):
    pids = tmp_path / "pids"
    hanging = ["sh", "-c", f"sleep 300 & echo $$ $! >> {pids}; wait"]
    quick = ["sh", "-c", f"echo quick >> {tmp_path / 'quick'}"]
    runner = HookRunner(max_running=2)
    try:
        started = time.monotonic()
        runner.submit("on_done", hanging, 1.5, 1, HookValues(pdf=str(tmp_path / "a.pdf")))
        wait_until(pids.exists, 10, what="the hanging hook to start")
        runner.submit("on_done", quick, 10, 2, HookValues(pdf=str(tmp_path / "b.pdf")))
        wait_until(lambda: (tmp_path / "quick").exists(), 10,
                   what="a second hook to run while the first hangs")
        outcomes: list = []
        wait_until(lambda: outcomes.extend(runner.outcomes()) or len(outcomes) == 2, 30,
                   what="both hooks to end")
        elapsed = time.monotonic() - started
    finally:
        runner.stop()
    by_job = {o.job_id: o.error for o in outcomes}
    assert by_job[2] is None, f"the quick hook failed: {by_job[2]}"
    assert by_job[1] and "hooks.timeout (1.5 s)" in by_job[1], by_job[1]
    assert elapsed < 20, f"the hanging hook was stopped only after {elapsed:.0f} s"
    shell, sleeper = map(int, pids.read_text().split())
    wait_until(lambda: not process_alive(shell) and not process_alive(sleeper), 10,
               what="the hook and its child to be gone")


def test_a_hook_that_cannot_start_is_reported(tmp_path):
    runner = HookRunner()
    try:
        runner.submit("on_failed", [str(tmp_path / "missing")], 5, 7,
                      HookValues(pdf=str(tmp_path / "a.pdf")))
        outcomes = wait_until(runner.outcomes, 10, what="the hook's outcome")
    finally:
        runner.stop()
    assert outcomes[0].job_id == 7 and "could not start" in (outcomes[0].error or "")


# File names and error texts that a shell would run if they were pasted into its script.
HOSTILE_TEXTS = [
    "x$(touch PWNED).pdf",
    "x`touch PWNED`.pdf",
    "x; touch PWNED; .pdf",
    "it's \"quoted\" $HOME.pdf",
    "two\nlines; touch PWNED.pdf",
    "x'$(touch PWNED)'.pdf",
    'x"$(touch PWNED)".pdf',
]
# One script that uses {pdf} and {error} unquoted, in double quotes and in single quotes,
# as README readers write them.
SHELL_SCRIPT = ("printf '%s\\n' {pdf} > unquoted; printf '%s\\n' \"done {pdf}\" > double; "
                "printf '%s\\n' 'done {pdf}' > single; printf '%s\\n' \"{error}\" > error")


@pytest.mark.parametrize("text", HOSTILE_TEXTS)
@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_file_name_or_error_never_runs_as_code_in_a_shell_hook(tmp_path, shell, text):
    """`[sh, -c, '... {pdf} ...']`: whatever the name holds, the shell only prints it."""
    runner = HookRunner()
    try:
        runner.submit("on_done", [shell, "-c", f"cd '{tmp_path}' && {SHELL_SCRIPT}"], 10, 1,
                      HookValues(pdf=text, error="failed: `touch PWNED` $(touch PWNED)"))
        outcomes = wait_until(runner.outcomes, 10, what="the hook's outcome")
    finally:
        runner.stop()
    assert outcomes[0].error is None, outcomes[0].error
    assert not (tmp_path / "PWNED").exists(), f"the name {text!r} ran as shell code"
    # The script sees the exact text in every quoting (unquoted it is word-split, as usual).
    assert (tmp_path / "double").read_text() == f"done {text}\n"
    assert (tmp_path / "single").read_text() == f"done {text}\n"
    assert (tmp_path / "unquoted").read_text() == f"{text}\n"
    assert (tmp_path / "error").read_text() == "failed: `touch PWNED` $(touch PWNED)\n"


@pytest.mark.quick
def test_placeholders_outside_a_shell_script_are_whole_values():
    values = HookValues(pdf="x$(id).pdf", pages="3")
    assert values.expand(["notify-send", "{pdf}: {pages} pages", "{pdf}"]) == [
        "notify-send", "x$(id).pdf: 3 pages", "x$(id).pdf"]
    # After the script, a shell's arguments are data too ($0, $1...).
    assert values.expand(["sh", "-ec", 'echo "$1"', "hook", "{pdf}"])[4] == "x$(id).pdf"
    assert values.expand(["bash", "-o", "pipefail", "-c", "echo {pdf}"])[4] == (
        'echo "${OCRVL_PDF}"')
    assert values.expand(["/bin/sh", "script.sh", "{pdf}"])[2] == "x$(id).pdf"


@pytest.mark.parametrize(
    ("hook", "needle"),
    [
        ([], "empty list"),
        (["true", "{pdff}"], "unknown placeholder {pdff}"),
        (["surely-not-a-program-ocrvl"], "not an executable found on PATH"),
    ],
)
@pytest.mark.quick
def test_a_bad_hook_is_refused_at_load_naming_the_key_and_the_fix(hook, needle):
    with pytest.raises(ConfigError) as err:
        validate_config({"hooks": {"on_done": hook}})
    assert "hooks.on_done" in str(err.value) and needle in str(err.value), str(err.value)


class DaemonSetup:
    def __init__(self, tmp_path: Path, **hooks: object) -> None:
        self.inbox = tmp_path / "inbox"
        self.inbox.mkdir()
        self.requests = tmp_path / "requests.jsonl"
        self.config = write_config(
            tmp_path / "config.yaml",
            inbox={"paths": [str(self.inbox)], "stable_seconds": 0.3, "poll_interval": 0.2},
            pipeline={"adaptive_concurrency": False},
            server=managed_fake_server(free_port(), "--request-log", str(self.requests)),
            hooks=hooks,
        )

    def status(self) -> dict:
        result = run_ocrvl("status", "--json", "--config", self.config, timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def hook_error(self, pdf: Path) -> str | None:
        docs = {d["path"]: d for d in self.status()["documents"]}
        return docs[str(pdf)]["hook_error"] if str(pdf) in docs else None


@pytest.mark.slow
def test_a_failing_or_hanging_hook_is_logged_shown_in_status_and_changes_nothing_else(
        tmp_path: Path):
    pids = tmp_path / "pids"
    setup = DaemonSetup(
        tmp_path,
        on_done=["sh", "-c", f'echo "$$" >> {pids}; echo "no space left" >&2; '
                             'case "$OCRVL_PDF" in *slow*) sleep 300;; esac; exit 3'],
        timeout=3,
    )
    with DaemonProcess(setup.config) as daemon:
        daemon.wait_ready()
        first = make_pdf(setup.inbox / "slow.pdf", 2, seed=1)
        wait_until(lambda: pids.exists(), 90, what="the first document's hook to start")
        second = make_pdf(setup.inbox / "second.pdf", 2, seed=2)
        wait_until(lambda: second.with_suffix(".md").exists(), 90,
                   what="the second document to convert while the first one's hook hangs")
        wait_until(lambda: setup.hook_error(second), 30, what="status to show the failed hook")
        assert "exited with status 3" in (setup.hook_error(second) or "")
        wait_until(lambda: "hooks.timeout (3 s)" in (setup.hook_error(first) or ""), 30,
                   what="status to show the hanging hook's timeout")
        text = run_ocrvl("status", "--config", setup.config, timeout=60).stdout
        assert "hook: on_done hook 'sh' exited with status 3" in text, text
        assert "second.pdf: on_done: no space left" in daemon.log()
        assert all(d["state"] == "done" for d in setup.status()["documents"]), \
            "a failing hook changed its document's state"
        assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon stopped"
        for pid in map(int, pids.read_text().split()):
            assert not process_alive(pid), f"hook process {pid} is still running"
        pages = len(setup.requests.read_text("utf-8").splitlines())
        assert pages == 4, f"{pages} page requests for 4 pages: a hook re-ran a conversion"
        assert first.exists() and second.exists()


@pytest.mark.slow
def test_hooks_still_running_are_stopped_when_the_daemon_stops(tmp_path: Path):
    pids = tmp_path / "pids"
    setup = DaemonSetup(tmp_path, on_done=["sh", "-c", f"sleep 300 & echo $$ $! >> {pids}; wait"])
    daemon = DaemonProcess(setup.config).start()
    try:
        daemon.wait_ready()
        make_pdf(setup.inbox / "book.pdf", 1)
        wait_until(pids.exists, 90, what="the hook to start")
        started = time.monotonic()
        code = daemon.terminate(timeout=60)
        took = time.monotonic() - started
    finally:
        daemon.kill()
    assert code == 0, daemon.log()
    assert took < 30, f"the daemon took {took:.0f} s to stop with a hook running"
    for pid in map(int, pids.read_text().split()):
        assert not process_alive(pid), f"hook process {pid} outlived the daemon"
    assert "SIGTERM to process group" in daemon.log()



REPO = Path(__file__).resolve().parents[1]


def readme_hooks() -> dict[str, tuple[str, list[str]]]:
    """README's example hooks, by program: (key, argv)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    found = {}
    for key, flow in re.findall(r"^  `(on_done|on_failed): (\[.*\])`$", text, re.M):
        argv = yaml.safe_load(flow)
        found[argv[0]] = (key, argv)
    return found


@contextmanager
def webhook_receiver() -> Iterator[tuple[str, list[dict[str, list[str]]]]]:
    """A local HTTP server that records each POSTed form; yields its URL and the forms."""
    received: list[dict[str, list[str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(parse_qs(body.decode("utf-8")))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield f"{url}/hooks/ocrvl", received


@pytest.mark.slow
def test_readme_archive_and_webhook_examples_work_through_a_real_daemon(tmp_path: Path):
    examples = readme_hooks()
    assert set(examples) == {"calibredb", "notify-send", "mv", "curl"}, examples
    for key, argv in examples.values():
        validate_config({"hooks": {key: ["true", *argv[1:]]}})  # placeholders all known
    archive = tmp_path / "archive"
    archive.mkdir()
    mv_key, mv = examples["mv"]
    curl_key, curl = examples["curl"]
    assert (mv_key, curl_key) == ("on_done", "on_failed")
    mv = [f"{archive}/" if a == "/home/me/ocr-archive/" else a for a in mv]
    with webhook_receiver() as (url, received):
        curl = [url if a.startswith("https://example.org/") else a for a in curl]
        setup = DaemonSetup(tmp_path, on_done=mv, on_failed=curl)
        with DaemonProcess(setup.config) as daemon:
            daemon.wait_ready()
            make_pdf(setup.inbox / "good.pdf", 2)
            broken = make_html_as_pdf(setup.inbox / "broken.pdf")
            wait_until(lambda: (archive / "good.pdf").exists(), 90,
                       what="good.pdf to be converted and moved to the archive")
            wait_until(lambda: received, 60, what="the webhook to be called for broken.pdf")
            assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
    assert (setup.inbox / "good.md").exists() and not (setup.inbox / "good.pdf").exists()
    form = received[0]
    assert form["pdf"] == [str(broken)], form
    assert "is an HTML page" in form["error"][0], form
