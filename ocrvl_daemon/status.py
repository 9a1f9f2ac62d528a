"""`ocrvl status` and `ocrvl retry`: read and nudge the daemon's store while it runs."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import psutil

from ocrvl_daemon.config import Config
from ocrvl_daemon.errors import ExitCode, InputFileError, UsageError
from ocrvl_daemon.pdf import page_count, parse_pages, repair_fix, retry_command, shell_quote
from ocrvl_daemon.state_lock import paused_note
from ocrvl_daemon.store import Job, JobState, PageFailure, Store
from ocrvl_daemon.systemd import format_duration

log = logging.getLogger(__name__)

DAEMON_DB = "jobs.sqlite"


def open_store(config: Config) -> Store:
    """The daemon's store."""
    return Store(config.state_dir / DAEMON_DB)


def _job_view(store: Store, job: Job, rate: float) -> dict[str, Any]:
    done = (
        store.count_pages(job.sha256, job.model)
        if job.state is not JobState.DONE
        else (job.page_count or 0)
    )
    total = job.page_count
    view: dict[str, Any] = {
        "path": str(job.path),
        "state": job.state.value,
        "pages_done": done,
        "pages_total": total,
        "attempts": job.attempts,
        "error": job.last_error,
        "failed_pages": [p + 1 for p in store.failed_pages(job.sha256, job.model)],
        "damaged_pages": [
            p + 1 for p in store.failed_pages(job.sha256, job.model, PageFailure.DAMAGED)
        ],
        "flagged_pages": [p + 1 for p in store.flagged_pages(job.sha256, job.model)],
    }
    if job.state is JobState.RUNNING and total and rate > 0:
        view["eta_seconds"] = round((total - done) / rate)
    if job.state is JobState.QUEUED and job.not_before > time.time():
        view["retry_in_seconds"] = round(job.not_before - time.time())
    return view


def collect_status(config: Config) -> dict[str, Any]:
    """Everything `ocrvl status` shows, as a dict."""
    store = open_store(config)
    try:
        daemon = store.get_meta("daemon") or {}
        rate = float(daemon.get("pages_per_s") or 0.0)
        alive = (
            "updated" in daemon
            and time.time() - float(daemon["updated"]) < 30
            and psutil.pid_exists(int(daemon["pid"]))  # killed since its last word
        )
        jobs = [_job_view(store, j, rate) for j in store.jobs()]
    finally:
        store.close()
    # A daemon paused by a full disk cannot publish to the store; its lock file says why.
    paused = paused_note(config.state_dir)
    if paused is not None and psutil.pid_exists(paused[0]):
        alive = True
        daemon = {**daemon, "pid": paused[0], "paused": paused[1]}
    return {
        "daemon": {"running": alive, **daemon},
        "server": daemon.get("server", {}),
        "documents": jobs,
    }


def render_status(config: Config, *, as_json: bool) -> str:
    """The status as text (one screen) or JSON."""
    status = collect_status(config)
    if as_json:
        return json.dumps(status, indent=2)
    daemon, server = status["daemon"], status["server"]
    lines = []
    if daemon["running"]:
        lines.append(
            f"daemon: running (pid {daemon.get('pid')}), {daemon.get('pages_per_s', 0):.2f} pages/s"
        )
        state = server.get("state", "unknown")
        phase = f", {server['phase']}" if server.get("phase") else ""
        if daemon.get("paused"):
            lines.append(daemon["paused"])
        lines.append(f"server: {state}{phase} at {server.get('url', '?')}")
        if server.get("diagnosis"):
            lines.append(f"  likely cause: {server['diagnosis']}")
        if daemon.get("engine_error"):
            lines.append(f"engine: {daemon['engine_error']}")
    else:
        lines.append("daemon: not running (start it with `systemctl --user start ocrvl`)")
    docs = status["documents"]
    if not docs:
        lines.append("no documents yet")
    for doc in docs:
        pages = f"{doc['pages_done']}/{doc['pages_total'] or '?'} pages"
        extra = ""
        if "eta_seconds" in doc:
            extra = f", ETA {format_duration(doc['eta_seconds'])}"
        if "retry_in_seconds" in doc:
            extra += f", retry in {format_duration(doc['retry_in_seconds'])}"
        lines.append(f"{doc['state']:>7}  {pages:>14}  {doc['path']}{extra}")
        if doc["error"] and doc["state"] != "done":
            lines.append(f"         reason: {doc['error']}")
        path = Path(doc["path"])
        for key, what in (("failed_pages", "pages that failed"),
                          ("flagged_pages", "pages that were cut off"),
                          ("damaged_pages", "pages damaged in the PDF")):  # fmt: skip
            if doc[key]:
                pages_list = ",".join(map(str, doc[key]))
                hint = (f"retrying cannot help: {repair_fix(path)}" if key == "damaged_pages"
                        else f"redo: {retry_command(path, pages_list)}")  # fmt: skip
                lines.append(f"         {what}: {pages_list} ({hint})")
    return "\n".join(lines)


def retry(config: Config, pdfs: list[Path], *, failed: bool, pages: str | None) -> ExitCode:
    """Queue documents again; with `pages`, drop only those checkpoints."""
    if not pdfs and not failed:
        raise UsageError("Nothing to retry.", "name PDFs, or use --failed")
    if pages:
        parse_pages(pages)  # a malformed list is refused before the store is even opened
    store = open_store(config)
    try:
        targets: list[Job] = []
        if failed:
            targets += store.jobs(JobState.FAILED)
            targets += [
                j
                for j in store.jobs()
                if store.failed_pages(j.sha256, j.model) and j not in targets
            ]
        for given in pdfs:
            job = store.job_for_path(given.expanduser().absolute())
            if job is None:
                raise InputFileError(
                    f"{given} is not known to the daemon.",
                    "put it in an inbox folder; it is picked up by itself (a file converted "
                    f"with `ocrvl convert` is redone with `ocrvl convert {shell_quote(given)}`)",
                )
            targets.append(job)
        if not targets:
            log.info("nothing to retry: no document or page failed (pages damaged in the PDF "
                     "are left out: only a repaired file can help them)")
        # Every page list is checked before anything is queued again.
        chosen = {
            job.id: parse_pages(pages, job.page_count or page_count(job.path), job.path)
            if pages else store.failed_pages(job.sha256, job.model)
            for job in targets
        }
        for job in targets:
            redo = chosen[job.id]
            if redo:
                store.drop_pages(job.sha256, job.model, redo)
            elif job.state is JobState.DONE:
                store.drop_pages(job.sha256, job.model)
            store.requeue(job.id)
            what = f"pages {','.join(str(p + 1) for p in redo)} of " if redo else ""
            log.info("queued %s%s again", what, job.path)
    finally:
        store.close()
    return ExitCode.OK
