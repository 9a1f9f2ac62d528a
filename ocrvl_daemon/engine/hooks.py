"""The user's programs run after each document: `hooks.on_done` and `hooks.on_failed`.

A hook is an argv list run without a shell, with `{pdf}`, `{md}`... filled in (inside a shell's
`-c` script, as references to their variables, so that no value becomes code) and the same
values in its environment as `OCRVL_PDF`, `OCRVL_MD`... It runs on a small pool of threads,
in its own process group, so a slow or hanging hook never holds up the main loop or another
document. Its output is logged under the document. A hook that fails, or outlives
`hooks.timeout` and is stopped (TERM, bounded wait, KILL, reap), is logged and reported back
to the owner's loop through `outcomes()`, for `ocrvl status`; it never re-runs a conversion.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import subprocess
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

from ocrvl_daemon.config.model import HOOK_PLACEHOLDERS, HooksConfig
from ocrvl_daemon.core.job import Job, PageFailure
from ocrvl_daemon.observe.logs import doc_fields
from ocrvl_daemon.process.group import ProcessGroup
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)
# A hook's own output, line by line.
output_log = logging.getLogger(__name__ + ".output")

# Hooks running at once; more wait their turn (in order).
MAX_RUNNING = 4
# Between SIGTERM and SIGKILL for a hook that timed out or is stopped at shutdown.
STOP_SECONDS = 5.0
# Only the last lines of a chatty hook are logged.
OUTPUT_LINES = 50
# Programs whose `-c` argument is POSIX shell code.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox"})
# Shell options that take the next argument as their value (`-o pipefail`).
_SHELL_OPTIONS_WITH_VALUE = frozenset({"-o", "+o", "-O", "+O"})
_PLACEHOLDER = re.compile(r"\{(" + "|".join(HOOK_PLACEHOLDERS) + r")\}")


@dataclass(frozen=True)
class HookValues:
    """What a hook is told about its document; "" where a value does not apply."""

    pdf: str
    md: str = ""
    json: str = ""  # no JSON output exists yet
    images: str = ""
    pages: str = ""
    flagged: str = ""
    error: str = ""

    def expand(self, argv: list[str]) -> list[str]:
        """`argv` with every `{placeholder}` filled in (nothing else: JSON braces stay).

        Outside a shell each argv item is data, so the value goes in as it is. In the script
        of a shell's `-c` the placeholder becomes a reference to its `$OCRVL_<NAME>` variable,
        quoted for where it stands: the shell expands a variable but never runs its value,
        so a file name like `x$(id).pdf` or an error with backticks stays text.
        """
        values = asdict(self)
        script = _shell_script_index(argv)
        expanded = []
        for index, arg in enumerate(argv):
            if index == script:
                expanded.append(_fill_shell_script(arg))
            else:
                expanded.append(_PLACEHOLDER.sub(lambda m: values[m[1]], arg))
        return expanded

    def environment(self) -> dict[str, str]:
        """The same values as `OCRVL_<NAME>` variables."""
        return {f"OCRVL_{name.upper()}": value for name, value in asdict(self).items()}


@dataclass(frozen=True)
class HookOutcome:
    """How a hook ended; `error` is None when it succeeded."""

    job_id: int
    event: str  # "on_done" or "on_failed"
    error: str | None


class HookRunner:
    """Runs hooks on a bounded pool; `stop()` ends them all."""

    def __init__(self, max_running: int = MAX_RUNNING) -> None:
        self._pool = ThreadPoolExecutor(max_running, thread_name_prefix="ocrvl-hook")
        self._outcomes: queue.SimpleQueue[HookOutcome] = queue.SimpleQueue()
        # Guards _running, _futures and _stopping: the main thread (submit, stop, kill), the
        # pool's threads (_run) and the futures' done-callbacks (_forget) all change them.
        self._lock = threading.Lock()
        self._running: set[ProcessGroup] = set()
        self._futures: set[Future[None]] = set()
        self._stopping = False

    def submit(self, event: str, argv: list[str], timeout: float, job_id: int,
               values: HookValues) -> None:
        """Run `argv` for a document in the background (returns at once)."""
        with self._lock:
            if self._stopping:
                return
            future = self._pool.submit(self._run, event, argv, timeout, job_id, values)
            self._futures.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def outcomes(self) -> list[HookOutcome]:
        """Hooks that ended since the last call."""
        ended = []
        while True:
            try:
                ended.append(self._outcomes.get_nowait())
            except queue.Empty:
                return ended

    def _run(self, event: str, argv: list[str], timeout: float, job_id: int,
             values: HookValues) -> None:
        name = Path(values.pdf).name
        fields = doc_fields(Path(values.pdf), None, job_id)
        with self._lock:
            if self._stopping:
                return
            try:
                group = ProcessGroup.spawn(values.expand(argv),
                                           {**os.environ, **values.environment()},
                                           what=f"{event} hook for {name}")
            except OSError as exc:
                failed = f"{event} hook {argv[0]!r} could not start: {exc.strerror or exc}"
                log.error("%s: %s", name, failed, extra=fields)
                self._outcomes.put(HookOutcome(job_id, event, failed))
                return
            self._running.add(group)
        try:
            output, timed_out = _communicate(group, timeout)
        finally:
            with self._lock:
                self._running.discard(group)
        lines = output.decode("utf-8", errors="replace").splitlines()
        if len(lines) > OUTPUT_LINES:
            output_log.info("%s: %s: (%d earlier lines not logged)", name, event,
                            len(lines) - OUTPUT_LINES, extra=fields)
        for line in lines[-OUTPUT_LINES:]:
            output_log.info("%s: %s: %s", name, event, line, extra=fields)
        status = group.proc.returncode
        error: str | None = None
        if timed_out:
            error = f"{event} hook ran longer than hooks.timeout ({timeout:g} s) and was stopped"
        elif status != 0:
            stopped = " (stopped: ocrvl is shutting down)" if self._stopping else ""
            error = f"{event} hook {argv[0]!r} exited with status {status}{stopped}"
        if error is None:
            log.info("%s: %s hook succeeded", name, event, extra=fields)
        else:
            log.error("%s: %s; its output is logged above", name, error, extra=fields)
        self._outcomes.put(HookOutcome(job_id, event, error))

    def stop(self, wait_seconds: float | None = 0.0) -> None:
        """Let hooks finish for up to `wait_seconds` (None: all of them, each bounded by its
        timeout), then stop those still running (TERM, bounded wait, KILL, reap); hooks not
        started yet are not run."""
        with self._lock:
            futures = set(self._futures)
        if (wait_seconds is None or wait_seconds > 0) and futures:
            wait(futures, timeout=wait_seconds)
        with self._lock:
            self._stopping = True
            running = list(self._running)
            waiting = sum(not f.running() and not f.done() for f in self._futures)
        if waiting:
            log.warning("stopping: %d hook(s) not run", waiting)
        for group in running:
            group.stop(STOP_SECONDS)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def kill(self) -> None:
        """A forced stop: SIGKILL the hooks running now (and reap them); start no more."""
        with self._lock:
            self._stopping = True
            running = list(self._running)
        for group in running:
            group.kill()


class DocumentHooks:
    """The user's hooks for the documents of `store`: started in the background by `run`,
    how they ended recorded in the store by `record` (call it from the owner's loop)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.runner = HookRunner()
        self.failures: Counter[str] = Counter()  # hooks that failed or timed out, by event

    def run(self, hooks: HooksConfig, event: str, job: Job, *, md: str = "", images: str = "",
            json: str = "", pages: int | None = None, error: str = "") -> None:
        """Start `hooks.<event>` for `job`, if there is one (in the background)."""
        argv: list[str] | None = getattr(hooks, event)
        if argv is None:
            return
        pages = job.page_count if pages is None else pages
        flagged = sorted(
            {*self.store.failed_pages(job.sha256, job.model),
             *self.store.failed_pages(job.sha256, job.model, PageFailure.DAMAGED),
             *self.store.flagged_pages(job.sha256, job.model)}
        )
        values = HookValues(
            pdf=str(job.path),
            md=md,
            json=json,
            images=images,
            pages="" if pages is None else str(pages),
            flagged=",".join(str(p + 1) for p in flagged),
            error=error,
        )
        self.runner.submit(event, argv, hooks.timeout, job.id, values)

    def record(self) -> None:
        """Write how the hooks that ended since the last call went to the store."""
        for outcome in self.runner.outcomes():
            self.store.set_hook_error(outcome.job_id, outcome.error)
            if outcome.error is not None:
                self.failures[outcome.event] += 1

    def stop(self, wait_seconds: float | None = 0.0) -> None:
        """`HookRunner.stop`, then record how they ended."""
        self.runner.stop(wait_seconds)
        self.record()

    def kill(self) -> None:
        """A forced stop: `HookRunner.kill`."""
        self.runner.kill()


def _communicate(group: ProcessGroup, timeout: float) -> tuple[bytes, bool]:
    """The hook's output once it ends; stopped after `timeout`. True if it timed out."""
    try:
        output, _ = group.proc.communicate(timeout=timeout)
        return output, False
    except subprocess.TimeoutExpired:
        pass
    group.stop(STOP_SECONDS)
    try:
        output, _ = group.proc.communicate(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:  # something outside its group still holds the pipe
        group.stdout.close()
        output = b""
    return output, True


def _shell_script_index(argv: list[str]) -> int | None:
    """Where the script of `sh -c SCRIPT ...` is in `argv`; None if argv runs no shell code."""
    if not argv or Path(argv[0]).name not in SHELLS:
        return None
    start = 2 if Path(argv[0]).name == "busybox" else 1  # busybox sh -c ...
    takes_script = False
    skip_value = False
    for index in range(start, len(argv)):
        arg = argv[index]
        if skip_value:
            skip_value = False
        elif arg in _SHELL_OPTIONS_WITH_VALUE:
            skip_value = True
        elif arg == "--":
            continue
        elif arg[:1] in "-+" and len(arg) > 1:
            takes_script = takes_script or (arg[:1] == "-" and "c" in arg[1:]
                                            and not arg.startswith("--"))
        else:
            return index if takes_script else None
    return None


def _fill_shell_script(script: str) -> str:
    """`script` with each placeholder replaced by its `$OCRVL_<NAME>`, quoted for where it
    stands: `"${OCRVL_PDF}"` outside quotes, `${OCRVL_PDF}` inside double quotes, and
    `'"${OCRVL_PDF}"'` inside single quotes (the quote closed around it and reopened).
    Whatever the quoting, the value is only ever expanded, never parsed as code."""
    out: list[str] = []
    quote = ""  # "", "'" or '"': the quotes the shell is inside at this point
    i = 0
    while i < len(script):
        match = _PLACEHOLDER.match(script, i)
        if match:
            variable = "${OCRVL_" + match[1].upper() + "}"
            out.append({"": f'"{variable}"', '"': variable, "'": f"'\"{variable}\"'"}[quote])
            i = match.end()
            continue
        char = script[i]
        out.append(char)
        if char == "\\" and quote != "'" and i + 1 < len(script):
            out.append(script[i + 1])
            i += 1
        elif char in "'\"" and quote in ("", char):
            quote = "" if quote == char else char
        i += 1
    return "".join(out)
