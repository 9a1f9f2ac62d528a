"""`ocrvl status` and `ocrvl retry`: read and nudge the daemon's store while it runs."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import psutil

from ocrvl_daemon.config import Config
from ocrvl_daemon.errors import ExitCode, InputFileError
from ocrvl_daemon.names import shell_quote, shown
from ocrvl_daemon.output import shortened_names
from ocrvl_daemon.pdf import repair_fix, retry_command
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
        "path": shown(job.path),
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
        "suspect_pages": [
            p + 1 for p in store.pages_with_verdict(job.sha256, job.model, "suspect")
        ],
        "bad_pages": [p + 1 for p in store.pages_with_verdict(job.sha256, job.model, "bad")],
        "verdicts": store.verdict_counts(job.sha256, job.model),
        "redo_tokens": job.redo_tokens,
    }
    short = shortened_names(job.path)
    if short:
        view["names_shortened"] = shown(short)
    if job.state is JobState.RUNNING and total and rate > 0:
        view["eta_seconds"] = round((total - done) / rate)
    if job.state is JobState.QUEUED and job.not_before > time.time():
        view["retry_in_seconds"] = round(job.not_before - time.time())
    return view


def collect_status(config: Config) -> dict[str, Any]:
    """Everything `ocrvl status` shows, as a dict (paths `shown`, as people read them)."""
    return _collect_status(config)[0]


def _collect_status(config: Config) -> tuple[dict[str, Any], list[Path]]:
    """The status, and each document's path as it is (for the commands shown with it)."""
    store = open_store(config)
    try:
        daemon = store.get_meta("daemon") or {}
        rate = float(daemon.get("pages_per_s") or 0.0)
        alive = (
            "updated" in daemon
            and time.time() - float(daemon["updated"]) < 30
            and psutil.pid_exists(int(daemon["pid"]))  # killed since its last word
        )
        jobs = store.jobs()
        views = [_job_view(store, j, rate) for j in jobs]
    finally:
        store.close()
    return {
        "daemon": {"running": alive, **daemon},
        "server": daemon.get("server", {}),
        "documents": views,
    }, [j.path for j in jobs]


def render_status(config: Config, *, as_json: bool) -> str:
    """The status as text (one screen) or JSON."""
    status, paths = _collect_status(config)
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
    for doc, path in zip(docs, paths, strict=True):
        pages = f"{doc['pages_done']}/{doc['pages_total'] or '?'} pages"
        extra = ""
        if "eta_seconds" in doc:
            extra = f", ETA {format_duration(doc['eta_seconds'])}"
        if "retry_in_seconds" in doc:
            extra += f", retry in {format_duration(doc['retry_in_seconds'])}"
        lines.append(f"{doc['state']:>7}  {pages:>14}  {doc['path']}{extra}")
        if doc["error"] and doc["state"] != "done":
            lines.append(f"         reason: {doc['error']}")
        if doc.get("names_shortened"):
            lines.append(f"         note: {doc['names_shortened']}")
        for key, what in (("failed_pages", "pages that failed"),
                          ("flagged_pages", "pages flagged"),
                          ("damaged_pages", "pages damaged in the PDF")):  # fmt: skip
            if doc[key]:
                pages_list = ",".join(map(str, doc[key]))
                hint = (f"retrying cannot help: {repair_fix(path)}" if key == "damaged_pages"
                        else f"redo: {retry_command(path, pages_list)}")  # fmt: skip
                if key == "flagged_pages":
                    verdicts = "".join(f"{v}: {','.join(map(str, doc[f'{v}_pages']))}; "
                                       for v in ("bad", "suspect") if doc[f"{v}_pages"])
                    hint = f"{verdicts}redo: ocrvl retry --flagged {shell_quote(path)}"
                lines.append(f"         {what}: {pages_list} ({hint})")
    return shown("\n".join(lines))  # a daemon error may quote a name, too


def parse_pages(spec: str) -> list[int]:
    """'3,7-9' -> [2, 6, 7, 8] (0-based)."""
    pages: set[int] = set()
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 1 or hi < lo:
                raise ValueError
            pages.update(range(lo - 1, hi))
    except ValueError:
        raise InputFileError(
            f"--pages {spec!r} is not a page list.",
            "write pages like 3 or 3,7-9 (1 is the first page)",
        ) from None
    return sorted(pages)


def retry(config: Config, pdfs: list[Path], *, failed: bool, pages: str | None,
          flagged: bool = False) -> ExitCode:
    """Queue documents again; with `pages`, drop only those checkpoints; with `flagged`,
    only the flagged pages (of `pdfs`, or of every document)."""
    if not pdfs and not failed and not flagged:
        raise InputFileError("Nothing to retry.", "name PDFs, or use --failed or --flagged")
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
        if flagged and not pdfs:
            targets += [j for j in store.jobs(JobState.DONE)
                        if store.flagged_pages(j.sha256, j.model) and j not in targets]
        for given in pdfs:
            job = store.job_for_path(given.expanduser().absolute())
            if job is None:
                raise InputFileError(
                    f"{given} is not known to ocrvl.",
                    "put it in an inbox folder; it is picked up by itself",
                )
            targets.append(job)
        if not targets:
            log.info("nothing to retry: no document or page failed or is flagged (pages "
                     "damaged in the PDF are left out: only a repaired file can help them)")
        for job in targets:
            if pages:
                redo = parse_pages(pages)
            elif flagged:
                redo = store.flagged_pages(job.sha256, job.model)
                if not redo:
                    log.info("%s has no flagged pages", job.path)
                    continue
            else:
                redo = store.failed_pages(job.sha256, job.model)
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
