"""InboxWatcher against real files and real watchdog observers."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PIL import Image

from ocrvl_daemon.config.model import InboxConfig
from ocrvl_daemon.inbox.filesystems import filesystem_type, needs_polling, parse_mountinfo
from ocrvl_daemon.inbox.watcher import InboxWatcher, opens_as_pdf
from testkit.harness import wait_until

STABLE = 0.3
# Long enough that only the start-up scan runs: later files must arrive through events.
NO_RESCAN = 3600.0
RESCAN = 0.5


def make_pdf(path: Path, height: int = 300) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (200, height), "white").save(path, "PDF")
    return path


def inbox_config(paths: list[Path], **settings: object) -> InboxConfig:
    """Test defaults: short stability, inotify, no periodic rescan."""
    values: dict[str, object] = {"paths": paths, "stable_seconds": STABLE,
                                 "rescan_seconds": NO_RESCAN, "polling": False}
    values.update(settings)
    return InboxConfig.model_validate(values)


class Harness:
    """A started watcher plus everything it has handed on so far."""

    def __init__(self, watcher: InboxWatcher) -> None:
        self.watcher = watcher
        self.ready: list[Path] = []

    def tick(self) -> list[Path]:
        got = self.watcher.poll()
        self.ready.extend(got)
        return got

    def wait_for(self, *paths: Path, timeout: float = 10.0) -> None:
        """Poll until every path has been handed on."""

        def done() -> bool:
            self.tick()
            return all(p in self.ready for p in paths)

        wait_until(done, timeout, what=f"{[p.name for p in paths]} to be handed on; "
                   f"got {[p.name for p in self.ready]}")

    def settle(self, seconds: float) -> None:
        """Keep polling for a while: time must pass to show that nothing else turns up."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.tick()
            time.sleep(0.05)


def logged(caplog: pytest.LogCaptureFixture, text: str) -> int:
    """How many of the watcher's log lines so far contain `text`."""
    return sum(text in record.getMessage() for record in caplog.records)


@pytest.fixture
def inbox(tmp_path: Path) -> Path:
    return tmp_path / "inbox"


@pytest.fixture
def start(inbox: Path) -> Iterator[Callable[..., Harness]]:
    watchers: list[InboxWatcher] = []

    def _start(**settings: object) -> Harness:
        watcher = InboxWatcher(inbox_config([inbox], **settings))
        watchers.append(watcher)
        watcher.start()
        harness = Harness(watcher)
        harness.tick()  # the start-up scan
        return harness

    yield _start
    for watcher in watchers:
        started = time.monotonic()
        watcher.stop()
        assert time.monotonic() - started < 6


def test_copied_in(start: Callable[..., Harness], inbox: Path, tmp_path: Path) -> None:
    h = start()
    assert inbox.is_dir(), "a missing inbox is created at start"
    src = make_pdf(tmp_path / "elsewhere" / "book.pdf")
    shutil.copy(src, inbox / "Book.PDF")
    h.wait_for(inbox / "Book.PDF")
    h.settle(2 * STABLE)
    assert h.ready == [inbox / "Book.PDF"]


def test_moved_in_from_same_filesystem(
    start: Callable[..., Harness], inbox: Path, tmp_path: Path
) -> None:
    h = start()
    src = make_pdf(tmp_path / "outside" / "scan.pdf")
    os.rename(src, inbox / "scan.pdf")
    h.wait_for(inbox / "scan.pdf")


def test_slow_write_is_taken_once_complete(
    start: Callable[..., Harness], inbox: Path, tmp_path: Path
) -> None:
    h = start(stable_seconds=0.5)
    data = make_pdf(tmp_path / "src.pdf", height=2000).read_bytes()
    target = inbox / "slow.pdf"
    chunks = 10
    size = len(data) // chunks + 1
    with target.open("wb") as out:
        for i in range(chunks):
            out.write(data[i * size:(i + 1) * size])
            out.flush()
            h.settle(0.15)  # 10 x 0.15 s = 1.5 s of writing, pauses shorter than stable
            assert h.ready == [], f"handed on after chunk {i + 1} of {chunks}"
    h.wait_for(target)
    h.settle(1.0)
    assert h.ready == [target]


def test_subfolder_recursive(start: Callable[..., Harness], inbox: Path) -> None:
    h = start()
    nested = make_pdf(inbox / "a" / "b" / "deep.pdf")
    h.wait_for(nested)


def test_subfolder_ignored_when_not_recursive(start: Callable[..., Harness], inbox: Path) -> None:
    make_pdf(inbox / "sub" / "old.pdf")
    h = start(recursive=False)
    make_pdf(inbox / "sub" / "new.pdf")
    top = make_pdf(inbox / "top.pdf")
    h.wait_for(top)
    h.settle(2 * STABLE)
    assert h.ready == [top]


def test_present_at_startup(start: Callable[..., Harness], inbox: Path) -> None:
    first = make_pdf(inbox / "first.pdf")
    second = make_pdf(inbox / "sub" / "second.pdf")
    h = start()
    h.wait_for(first, second)


def test_folder_moved_in_whole(
    start: Callable[..., Harness], inbox: Path, tmp_path: Path
) -> None:
    h = start()
    folder = tmp_path / "batch"
    make_pdf(folder / "one.pdf")
    make_pdf(folder / "inner" / "two.pdf")
    os.rename(folder, inbox / "batch")
    h.wait_for(inbox / "batch" / "one.pdf", inbox / "batch" / "inner" / "two.pdf")


def test_ignore_patterns(start: Callable[..., Harness], inbox: Path) -> None:
    h = start()
    for name in ("x.pdf.part", ".hidden.pdf", ".cache/inside.pdf", "~$x.pdf", "dl.pdf.crdownload"):
        make_pdf(inbox / name)
    good = make_pdf(inbox / "good.pdf")
    h.wait_for(good)
    h.settle(2 * STABLE)
    assert h.ready == [good]


def test_own_outputs_ignored(start: Callable[..., Harness], inbox: Path) -> None:
    h = start()
    (inbox / "book.md").write_text("# book\n")
    (inbox / "book.pdf.ocrvl-error.txt").write_text("bad\n")
    make_pdf(inbox / "book_images" / "figure.pdf")
    make_pdf(inbox / "x_images" / "a.pdf")
    make_pdf(inbox / "book.ocrvl-tmp.pdf")
    make_pdf(inbox / "sub" / "y_images" / "deeper" / "b.pdf")
    good = make_pdf(inbox / "good.pdf")
    h.wait_for(good)
    h.settle(2 * STABLE)
    assert h.ready == [good]


def test_symlinks(start: Callable[..., Harness], inbox: Path, tmp_path: Path,
                  caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside"
    make_pdf(outside / "secret.pdf")
    target = make_pdf(inbox / "target.pdf")
    (inbox / "out.pdf").symlink_to(outside / "secret.pdf")
    (inbox / "outdir").symlink_to(outside, target_is_directory=True)
    (inbox / "alias.pdf").symlink_to(target)
    caplog.set_level("INFO", logger="ocrvl_daemon.inbox.watcher")
    h = start(rescan_seconds=RESCAN)
    h.wait_for(inbox / "alias.pdf")
    h.settle(2 * STABLE)
    # One hand-off per target in a pass: the link's own path, not the target's.
    assert h.ready == [inbox / "alias.pdf"]

    h.settle(2 * RESCAN)  # rescans see the links again
    outside_logs = [r for r in caplog.records if "outside every inbox" in r.getMessage()]
    assert len(outside_logs) == 2, "each link leading out is logged once"


def test_polling_mode(start: Callable[..., Harness], inbox: Path,
                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="ocrvl_daemon.inbox.watcher")
    h = start(polling=True, poll_interval=0.2)
    assert logged(caplog, f"watching {inbox} (polling every 0.2 s"), "the inbox is not polled"
    pdf = make_pdf(inbox / "polled.pdf")
    h.wait_for(pdf)


MOUNTINFO = r"""
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
70 27 0:50 / /mnt/c rw,noatime - 9p C:\134 rw,aname=drvfs
71 27 0:51 / /mnt/d rw,noatime shared:5 - drvfs D:\134 rw
72 27 0:52 / /srv/share rw,relatime - cifs //nas/share rw
73 27 0:53 / /net/home rw,relatime shared:7 master:1 - nfs4 nas:/home rw
74 27 0:54 / /net/old rw,relatime - nfs nas:/old rw
75 27 8:1 / /data rw,relatime - ext4 /dev/sda1 rw
76 75 0:55 / /data/my\040docs rw,relatime - fuse.sshfs me@host: rw
"""


@pytest.mark.parametrize(
    ("path", "fstype", "polling"),
    [
        ("/mnt/c/Users/me/inbox", "9p", True),
        ("/mnt/d", "drvfs", True),
        ("/srv/share/scans", "cifs", True),
        ("/net/home/me", "nfs4", True),
        ("/net/old/x", "nfs", True),
        ("/data/inbox", "ext4", False),
        ("/data/my docs/inbox", "fuse.sshfs", True),
        ("/mnt/cdrom", "ext4", False),  # a name prefix is not a mount prefix
        ("/home/me/ocr-inbox", "ext4", False),
    ],
)
@pytest.mark.quick
def test_filesystem_type_and_needs_polling(path: str, fstype: str, polling: bool) -> None:
    assert filesystem_type(path, mountinfo=MOUNTINFO) == fstype
    assert needs_polling(fstype) is polling


@pytest.mark.quick
def test_parse_mountinfo_skips_garbage() -> None:
    assert parse_mountinfo("not a mountinfo line\n") == []
    assert filesystem_type("/x", mountinfo="") == "unknown"
    assert not needs_polling("unknown")


def test_inbox_removed_and_recreated(start: Callable[..., Harness], inbox: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="ocrvl_daemon.inbox.watcher")
    h = start()
    before = make_pdf(inbox / "before.pdf")
    h.wait_for(before)
    shutil.rmtree(inbox)
    wait_until(lambda: h.tick() is not None and logged(caplog, f"inbox {inbox} disappeared"),
               5, what="the watcher to notice the inbox is gone")
    inbox.mkdir()
    again = make_pdf(inbox / "again.pdf")
    h.wait_for(again)
    assert logged(caplog, f"watching {inbox} (inotify") == 2, "the inbox was not watched again"
    # Only events can bring this one in (no rescan is due): the observer was re-armed.
    later = make_pdf(inbox / "later.pdf")
    h.wait_for(later)


def test_modified_file_is_handed_on_again(start: Callable[..., Harness], inbox: Path) -> None:
    h = start()
    pdf = make_pdf(inbox / "doc.pdf")
    h.wait_for(pdf)
    make_pdf(pdf, height=600)
    wait_until(lambda: h.tick() is not None and h.ready.count(pdf) == 2, 10,
               what="the changed file to be handed on again")
    h.settle(2 * STABLE)
    assert h.ready == [pdf, pdf]


def test_non_pdf_waits_for_the_long_wait(start: Callable[..., Harness], inbox: Path) -> None:
    long_wait = 1.5
    h = start(bad_file_seconds=long_wait)
    written = time.monotonic()
    junk = inbox / "junk.pdf"
    junk.write_bytes(os.urandom(4096))
    empty = inbox / "empty.pdf"
    empty.touch()
    good = make_pdf(inbox / "good.pdf")
    h.wait_for(good)
    assert junk not in h.ready and empty not in h.ready
    h.wait_for(junk, empty)
    assert time.monotonic() - written >= long_wait
    h.settle(2 * STABLE)
    assert sorted(h.ready) == sorted([good, junk, empty])


@pytest.mark.quick
def test_encrypted_pdf_counts_as_pdf(tmp_path: Path) -> None:
    pypdf = pytest.importorskip("pypdf")
    plain = make_pdf(tmp_path / "plain.pdf")
    writer = pypdf.PdfWriter(clone_from=plain)
    writer.encrypt(user_password="secret", owner_password="owner")
    locked = tmp_path / "locked.pdf"
    with locked.open("wb") as out:
        writer.write(out)
    assert opens_as_pdf(plain)
    assert opens_as_pdf(locked)
    (tmp_path / "junk.pdf").write_bytes(b"%PDF-1.7 not really")
    assert not opens_as_pdf(tmp_path / "junk.pdf")


def test_reconfigure_live(start: Callable[..., Harness], inbox: Path, tmp_path: Path,
                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="ocrvl_daemon.inbox.watcher")
    h = start()
    observer = h.watcher._roots[0].observer
    make_pdf(inbox / "draft.pdf")
    first = make_pdf(inbox / "first.pdf")
    h.wait_for(first, inbox / "draft.pdf")

    # New ignore rules apply at once and do not re-create the observer.
    second_inbox = tmp_path / "second"
    h.watcher.reconfigure(inbox_config([inbox, second_inbox], ignore=["draft*"]))
    assert h.watcher._roots[0].observer is observer
    assert second_inbox.is_dir()
    make_pdf(inbox / "draft2.pdf")
    other = make_pdf(second_inbox / "other.pdf")
    h.wait_for(other)

    # Dropping the first inbox stops watching it.
    h.watcher.reconfigure(inbox_config([second_inbox]))
    assert logged(caplog, f"no longer watching {inbox}") == 1
    make_pdf(inbox / "unwatched.pdf")
    last = make_pdf(second_inbox / "last.pdf")
    h.wait_for(last)
    h.settle(2 * STABLE)
    assert sorted(h.ready[:2]) == [inbox / "draft.pdf", first]
    assert h.ready[2:] == [other, last]


def test_periodic_rescan_finds_missed_files(
    start: Callable[..., Harness], inbox: Path, tmp_path: Path
) -> None:
    # A polling observer that never gets to look stands in for events that were lost.
    h = start(polling=True, poll_interval=3600, rescan_seconds=0.5)
    missed = make_pdf(inbox / "missed.pdf")
    h.wait_for(missed)


def test_polling_auto_follows_the_filesystem(
    start: Callable[..., Harness], inbox: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="ocrvl_daemon.inbox.watcher")
    monkeypatch.setattr("ocrvl_daemon.inbox.watcher.filesystem_type", lambda path: "9p")
    h = start(polling="auto", poll_interval=0.2)
    assert logged(caplog, f"watching {inbox} (polling every 0.2 s"), "a 9p inbox is not polled"
    pdf = make_pdf(inbox / "from-windows.pdf")
    h.wait_for(pdf)


def test_a_missing_inbox_is_created_with_a_log_line(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="ocrvl_daemon.inbox.watcher")
    missing = tmp_path / "new" / "inbox"
    watcher = InboxWatcher(inbox_config([missing]))
    watcher.start()
    try:
        assert missing.is_dir()
        assert logged(caplog, f"created the inbox folder {missing}") == 1
    finally:
        watcher.stop()
