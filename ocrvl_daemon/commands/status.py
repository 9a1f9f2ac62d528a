"""`ocrvl status`: what the daemon is doing and where each document stands."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import psutil

from ocrvl_daemon.commands.install_service import start_command
from ocrvl_daemon.config.file import advice_command
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.values import folder_problem
from ocrvl_daemon.core.document import MAX_ACTIVE_DOCUMENTS
from ocrvl_daemon.core.job import Job, JobState, PageFailure
from ocrvl_daemon.errors import OcrvlError
from ocrvl_daemon.files.names import shell_quote, shown
from ocrvl_daemon.files.pdf import page_count, repair_fix, retry_command
from ocrvl_daemon.observe.daemon_state import GpuView, read_runtime_file
from ocrvl_daemon.observe.stages import StageLoad
from ocrvl_daemon.observe.units import format_duration
from ocrvl_daemon.output.document_files import (
    OutputPlace,
    output_place,
    outputs_for,
    read_header,
    shortened_names,
)
from ocrvl_daemon.storage.jobs import open_store
from ocrvl_daemon.storage.lock import paused_note
from ocrvl_daemon.storage.store import Store

log = logging.getLogger(__name__)

# Without --all: every document not done yet, and this many of the last finished.
RECENT_DONE = 10
# A daemon that has not published for this long is taken for dead (it publishes every 2 s).
STALE_SECONDS = 30.0


def _page_total(job: Job, place: OutputPlace) -> int | None:
    """The document's page count: as recorded when it started, else from ocrvl's Markdown
    (a document found converted already), else from the PDF itself (one not started yet)."""
    if job.page_count:
        return job.page_count
    if job.state is JobState.DONE:
        header = read_header(outputs_for(job.path, place)[0]) or {}
        pages = header.get("pages", "")
        return int(pages) if pages.isdigit() else None
    with contextlib.suppress(OcrvlError, OSError):
        return page_count(job.path)
    return None


def _job_view(store: Store, job: Job, place: OutputPlace, alive: bool) -> dict[str, Any]:
    total = _page_total(job, place)
    done = (
        store.count_pages(job.sha256, job.model)
        if job.state is not JobState.DONE
        else (total or 0)
    )
    # A dead daemon converts nothing: its "running" documents wait for its next start.
    state = "stopped" if job.state is JobState.RUNNING and not alive else job.state.value
    view: dict[str, Any] = {
        "path": shown(job.path),
        # Lossless, for a name that is not UTF-8 (`path` shows its bytes escaped).
        "path_b64": base64.b64encode(os.fsencode(job.path)).decode("ascii"),
        "state": state,
        "pages_done": done,
        "pages_total": total,
        "attempts": job.attempts,
        "error": job.last_error,
        "failed_pages": [p + 1 for p in store.failed_pages(job.sha256, job.model)],
        "damaged_pages": [
            p + 1 for p in store.failed_pages(job.sha256, job.model, PageFailure.DAMAGED)
        ],
        "flagged_pages": [p + 1 for p in store.flagged_pages(job.sha256, job.model)],
        "suspect_pages": [
            p + 1 for p in store.pages_with_verdict(job.sha256, job.model, "suspect")
        ],
        "bad_pages": [p + 1 for p in store.pages_with_verdict(job.sha256, job.model, "bad")],
        "verdicts": store.verdict_counts(job.sha256, job.model),
        "redo_tokens": job.redo_tokens,
        "hook_error": job.hook_error,
    }
    short = shortened_names(job.path, place)
    if short:
        view["names_shortened"] = shown(short)
    if job.state is JobState.QUEUED and job.not_before > time.time():
        view["retry_in_seconds"] = round(job.not_before - time.time())
    return view


def finish_times(
    pages_left: list[tuple[int, int]], rate: float, slots: int = MAX_ACTIVE_DOCUMENTS
) -> dict[int, float]:
    """Seconds until each document is done, as the daemon shares the server.

    `pages_left` holds (job id, pages left) in queue order. Up to `slots` documents are
    converted at once and share `rate` evenly (the plan's fair interleaving), so a
    letter behind a book is done first; the next in the queue takes a freed slot.
    """
    waiting = [(job, float(left)) for job, left in pages_left]
    active: dict[int, float] = {}
    clock, times = 0.0, {}
    while waiting or active:
        while waiting and len(active) < slots:
            job, left = waiting.pop(0)
            active[job] = left
        first = min(active, key=active.__getitem__)
        step = active[first]
        clock += step * len(active) / rate
        active = {job: left - step for job, left in active.items()}
        for job in [j for j, left in active.items() if left <= 0]:
            times[job] = clock
            del active[job]
    return times


def _add_etas(jobs: list[Job], views: dict[int, dict[str, Any]], rate: float) -> None:
    """`eta_seconds` for every document that is being converted or waits its turn."""
    if rate <= 0:
        return
    wall = time.time()
    # Running documents hold their slots; the queue follows in order (as the converter takes it).
    order = sorted(
        (j for j in jobs
         if j.state is JobState.RUNNING
         or (j.state is JobState.QUEUED and j.not_before <= wall and j.page_count)),
        key=lambda j: (j.state is not JobState.RUNNING, j.id),
    )
    left = [(j.id, max(0, (j.page_count or 0) - views[j.id]["pages_done"])) for j in order]
    for job_id, seconds in finish_times(left, rate).items():
        views[job_id]["eta_seconds"] = round(seconds)


def _recent(jobs: list[Job]) -> list[Job]:
    """Every document not done yet, and the last RECENT_DONE finished ones (converted, or
    deleted while they converted)."""
    ended = (JobState.DONE, JobState.GONE)
    finished = sorted((j for j in jobs if j.state in ended), key=lambda j: j.finished or j.updated)
    keep = {j.id for j in finished[-RECENT_DONE:]}
    return [j for j in jobs if j.state not in ended or j.id in keep]


def _server_view(daemon: dict[str, Any], alive: bool) -> dict[str, Any]:
    """The server as the daemon last saw it; only a running daemon can vouch for it."""
    server = dict(daemon.get("server") or {})
    if alive:
        return server
    view: dict[str, Any] = {"state": "unknown", "why": "the daemon is not running"}
    if server:
        view["last_known"] = server
        view["last_known_at"] = daemon.get("updated")
    return view


def daemon_alive(daemon: dict[str, Any]) -> bool:
    """Whether the daemon that wrote runtime file `daemon` still runs."""
    return (
        "updated" in daemon
        and time.time() - float(daemon["updated"]) < STALE_SECONDS
        and psutil.pid_exists(int(daemon["pid"]))  # killed since its last word
    )


def _collect_status(config: Config, everything: bool) -> tuple[dict[str, Any], list[Path]]:
    """The status, and each listed document's path as it is (for the commands shown with it)."""
    store = open_store(config)
    try:
        daemon = read_runtime_file(config.state_dir)
        alive = daemon_alive(daemon)
        # A dead daemon's last rate would promise ETAs nobody is working towards.
        rate = float(daemon.get("pages_per_s") or 0.0) if alive else 0.0
        jobs = store.jobs()
        listed = jobs if everything else _recent(jobs)
        listed_ids = {j.id for j in listed}
        place = output_place(config)
        views = {j.id: _job_view(store, j, place, alive) for j in jobs
                 if j.state in (JobState.RUNNING, JobState.QUEUED) or j.id in listed_ids}
        _add_etas(jobs, views, rate)
    finally:
        store.close()
    # A daemon paused by a full disk cannot publish to the store; its lock file says why.
    paused = paused_note(config.state_dir)
    if paused is not None and psutil.pid_exists(paused[0]):
        alive = True
        daemon = {**daemon, "pid": paused[0], "paused": paused[1]}
    return {
        "daemon": {"running": alive, **{k: v for k, v in daemon.items() if k != "servers"}},
        "server": _server_view(daemon, alive),
        # Each endpoint pages go to: name, url, state, in_flight, pages_per_s, bound...
        "servers": (daemon.get("servers") or []) if alive else [],
        "inbox_problems": [{"path": shown(path), "problem": problem}
                           for path in config.inbox.paths
                           if (problem := folder_problem(path)) is not None],
        "documents": [views[j.id] for j in listed],
        "documents_not_shown": len(jobs) - len(listed),
    }, [j.path for j in listed]


def render_status(config: Config, *, as_json: bool, everything: bool = False,
                  config_path: Path | None = None) -> str:
    """The status as text (one screen) or JSON; recent documents unless `everything`.
    The commands it suggests read `config_path`, the file `config` came from."""
    status, paths = _collect_status(config, everything)
    again = advice_command("retry", config_path)
    if as_json:
        return json.dumps(status, indent=2)
    daemon, server = status["daemon"], status["server"]
    lines = []
    if daemon["running"]:
        lines.append(
            f"daemon: running (pid {daemon.get('pid')}), {daemon.get('pages_per_s', 0):.2f} pages/s"
        )
        state = server.get("state", "unknown")
        if daemon.get("paused"):
            lines.append(daemon["paused"])
        if len(status["servers"]) > 1:
            lines += _endpoint_lines(status["servers"])
        else:
            outlook = _server_outlook(server, config.server.mode == "external", config_path)
            lines.append(f"server: {state}{_phase(server)} at {server.get('url', '?')}"
                         f"{outlook}")
        lines += [GpuView(**gpu).summary() for gpu in daemon.get("gpus") or []]
        if state == "ready":  # a server that is down makes every stage's load stale
            lines += _stage_lines(daemon.get("stages"))
        if server.get("last_error") and len(status["servers"]) <= 1:
            since = " (it has recovered since)" if state == "ready" else ""
            lines.append(f"  last error{since}: {server['last_error']}")
        if server.get("diagnosis"):
            lines.append(f"  likely cause: {server['diagnosis']}")
        if daemon.get("engine_error"):
            lines.append(f"engine: {daemon['engine_error']}")
    else:
        lines.append(f"daemon: not running (start it with {start_command(config_path)})")
        last = server.get("last_known")
        if last:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(server["last_known_at"]))
            lines.append(f"server: unknown (daemon not running; {last.get('state', '?')} "
                         f"at {when}, when the daemon last reported)")
            if last.get("last_error"):
                lines.append(f"  last error: {last['last_error']}")
    for inbox in status["inbox_problems"]:
        lines.append(f"inbox {inbox['path']}: {inbox['problem']}: no PDF is picked up there "
                     "(fix: correct inbox.paths, or the folder)")
    docs = status["documents"]
    if not docs:
        lines.append("no documents yet")
    for doc, path in zip(docs, paths, strict=True):
        pages = f"{doc['pages_done']}/{doc['pages_total'] or '?'} pages"
        extra = ""
        if "eta_seconds" in doc:
            extra = f", ETA {format_duration(doc['eta_seconds'])}"
        if "retry_in_seconds" in doc:
            extra += f", retry in {format_duration(doc['retry_in_seconds'])}"
        if doc["state"] == "stopped":
            extra += " (resumes when the daemon starts)"
        lines.append(f"{doc['state']:>7}  {pages:>14}  {doc['path']}{extra}")
        if doc["error"] and doc["state"] != "done":
            lines.append(f"         reason: {doc['error']}")
        if doc["hook_error"]:
            lines.append(f"         hook: {doc['hook_error']}")
        if doc.get("names_shortened"):
            lines.append(f"         note: {doc['names_shortened']}")
        for key, what in (("failed_pages", "pages that failed"),
                          ("flagged_pages", "pages flagged"),
                          ("damaged_pages", "pages damaged in the PDF")):  # fmt: skip
            if doc[key]:
                pages_list = ",".join(map(str, doc[key]))
                hint = (f"retrying cannot help: {repair_fix(path)}" if key == "damaged_pages"
                        else f"redo: {retry_command(path, pages_list, again)}")  # fmt: skip
                if key == "flagged_pages":
                    verdicts = "".join(f"{v}: {','.join(map(str, doc[f'{v}_pages']))}; "
                                       for v in ("bad", "suspect") if doc[f"{v}_pages"])
                    hint = f"{verdicts}redo: {again} --flagged {shell_quote(path)}"
                lines.append(f"         {what}: {pages_list} ({hint})")
    if status["documents_not_shown"]:
        lines.append(f"... and {status['documents_not_shown']} older converted documents "
                     "(`ocrvl status --all` lists everything)")
    if any("eta_seconds" in doc for doc in docs):
        lines.append("ETA: when each document should be done at the current rate, sharing the "
                     "server with those converting and queued ahead of it")
    return shown("\n".join(lines))  # a daemon error may quote a name, too


def _phase(server: dict[str, Any]) -> str:
    """", PHASE" where the phase adds to the state (a ready server's phase does not)."""
    phase = server.get("phase")
    return f", {phase}" if phase and server.get("state") != "ready" else ""


def _server_outlook(server: dict[str, Any], external: bool, config_path: Path | None) -> str:
    """What happens next to a server that is not ready: retried for ever, or never."""
    if server.get("state") == "restarting":
        return (f" (failed {server.get('attempt') or 1} time(s) in a row; the daemon keeps "
                "trying: fix the cause below to end the wait)")
    if server.get("state") == "unreachable":
        return " (the daemon keeps checking it: start that server, or fix server.url)"
    if server.get("state") == "failed":
        if external:  # it is probed on: a fixed server is used at once
            return " (the daemon keeps checking it: fix the server or the config as below)"
        return (" (the daemon does not start it again: fix the cause below, then stop the "
                f"daemon and start it again with {start_command(config_path)})")
    return ""


def _stage_lines(stages: dict[str, Any] | None) -> list[str]:
    """"stages: layout 97% (limit) · server 40% · rendering 3%", and what would help; nothing
    while no stage worked in the last minute (or the daemon predates stages)."""
    load = StageLoad.from_json(stages or {})
    if not any(load.loads().values()):
        return []
    advice = load.advice()
    return [f"stages: {load.summary()}"] + ([f"  {advice}"] if advice else [])


def _endpoint_lines(servers: list[dict[str, Any]]) -> list[str]:
    """One line per server endpoint (and its last error)."""
    lines = []
    for e in servers:
        gpu = f" (GPU {e['gpu']})" if e.get("gpu") else ""
        lines.append(f"server {e['name']}{gpu}: {e['state']}{_phase(e)} at {e['url']}, "
                     f"{e['in_flight']} in flight, {e['pages_per_s']:.2f} pages/s")
        if e.get("last_error"):
            lines.append(f"  last error: {e['last_error']}")
    return lines
