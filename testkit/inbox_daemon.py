"""`ocrvl run` over an inbox, with the fake server it starts itself: the set-up the daemon's
end-to-end tests share, and what they read back (Markdown, checkpoints, status)."""

from __future__ import annotations

import collections
import json
import re
import sqlite3
from pathlib import Path

from testkit.harness import free_port, wait_until
from testkit.runner import DaemonProcess, managed_fake_server, run_ocrvl, write_config


class Setup:
    """An inbox, a config whose server is the fake one, and its request log."""

    def __init__(self, tmp_path: Path, *fake_args: str, **pipeline: object) -> None:
        self.root = tmp_path
        self.inbox = tmp_path / "inbox"
        self.inbox.mkdir(parents=True)
        self.requests = tmp_path / "requests.jsonl"
        self.port = free_port()
        self.config = write_config(
            tmp_path / "config.yaml",
            # A bad file is reported after 1 s, not the 30 s a slow copy is given by default.
            inbox={"paths": [str(self.inbox)], "stable_seconds": 0.3, "poll_interval": 0.2,
                   "bad_file_seconds": 1},
            pipeline={"use_layout_detection": False, "adaptive_concurrency": False, **pipeline},
            server=managed_fake_server(self.port, "--request-log", str(self.requests),
                                       *fake_args),
        )

    def daemon(self) -> DaemonProcess:
        return DaemonProcess(self.config)

    def requests_by_digest(self) -> collections.Counter[str]:
        """Pages the server read, by image digest. A request cut off by the kill before its
        image arrived is logged without a digest: no page was recognised, so it is not one."""
        if not self.requests.exists():
            return collections.Counter()
        records = [json.loads(line) for line in self.requests.read_text("utf-8").splitlines()
                   if line]
        return collections.Counter(r["digest"] for r in records if r["digest"] is not None)

    def checkpointed_digests(self) -> set[str]:
        """The image digests of the pages checkpointed so far."""
        db = self.root / "state" / "jobs.sqlite"
        with sqlite3.connect(db, timeout=10) as conn:
            return {d for (md,) in conn.execute("SELECT markdown FROM pages") for d in digests(md)}

    def checkpointed_pages(self) -> int:
        db = self.root / "state" / "jobs.sqlite"
        if not db.exists():
            return 0
        with sqlite3.connect(db, timeout=10) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM pages").fetchone()[0])

    def status(self) -> dict:
        """`ocrvl status --json --all`: every document, not just the recent ones."""
        result = run_ocrvl("status", "--json", "--all", "--config", self.config, timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


def wait_for_markdown(*pdfs: Path, timeout: float = 90) -> None:
    """Wait until each PDF's Markdown exists."""
    for pdf in pdfs:
        markdown = pdf.with_suffix(".md")
        wait_until(markdown.exists, timeout, what=f"{pdf.name} to be converted")


def digests(markdown: str) -> list[str]:
    """The fake server's page digests in a Markdown text, in order."""
    return re.findall(r"sha=([0-9a-f]{12})", markdown)
