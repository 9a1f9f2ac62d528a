"""Inbox watcher: turns filesystem events, a start-up scan and periodic rescans of the inbox
folders into the PDFs that have stopped changing, each version handed on once.

Which files count is `inbox_scan`'s job. Watchdog's threads only record paths in a
lock-protected set. Everything that touches the disk (stat, scans, opening PDFs, re-arming
observers) happens in `poll()`, which the daemon's main loop calls about twice a second.
Events only make the watcher react faster; the start-up scan and the periodic rescan make it
correct when events are missed (inotify overflow, network filesystems, an inbox that was
deleted and re-created).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from ocrvl_daemon.config.model import InboxConfig
from ocrvl_daemon.errors import EncryptedPdfError, InputFileError, InputVanishedError
from ocrvl_daemon.files.names import is_pdf_name
from ocrvl_daemon.files.pdf import PDFIUM_LOCK, open_pdf
from ocrvl_daemon.inbox.filesystems import filesystem_type, needs_polling
from ocrvl_daemon.inbox.scan import Listing, ignored_dir, outermost, walk, wanted_name

log = logging.getLogger(__name__)

# A stable file that does not open as a PDF may still be arriving (a slow copy that pauses);
# after this long it is handed on anyway so the converter reports the bad file.
BAD_FILE_WAIT_MIN = 30.0
BAD_FILE_WAIT_FACTOR = 10.0


def bad_file_wait(inbox: InboxConfig) -> float:
    """How long a stable file that does not open as a PDF is given to finish arriving:
    `inbox.bad_file_seconds`, else BAD_FILE_WAIT_MIN or, for a slow inbox, a multiple of
    its stable_seconds."""
    if inbox.bad_file_seconds is not None:
        return inbox.bad_file_seconds
    return max(BAD_FILE_WAIT_MIN, BAD_FILE_WAIT_FACTOR * inbox.stable_seconds)
STOP_TIMEOUT = 5.0

# Events that say a file's content or name changed. Opens and read-only closes are left
# out on purpose: the PDF check in poll() itself opens the file.
_FILE_EVENTS = frozenset({"created", "modified", "closed", "moved", "deleted", "attrib"})


def opens_as_pdf(path: Path) -> bool:
    """Whether the file opens as the converter will open it (`pdf.open_pdf`): a PDF still
    being written does not yet. An encrypted PDF is whole, and is handed on at once to be
    reported as such."""
    with PDFIUM_LOCK:
        try:
            open_pdf(path).close()
        except EncryptedPdfError:
            return True
        except (InputFileError, InputVanishedError, OSError):
            return False
    return True


@dataclass
class _FileState:
    """What poll() knows about one candidate path."""

    version: tuple[int, int] | None  # (size, mtime_ns); None for a link leading out
    since: float  # monotonic time this version was first seen
    emitted: bool = False
    opens: bool | None = None  # opens_as_pdf() for this version, once asked
    outside: bool = False  # a symlink whose target is outside every inbox


@dataclass
class _Root:
    """One inbox folder and the observer watching it."""

    path: Path  # absolute, as configured: the paths handed on are under this one
    real: Path  # resolved, to decide whether a symlink target is inside an inbox
    observer: BaseObserver | None = None
    polling: bool = False
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the folder being watched
    trouble_logged: bool = False  # warn once per outage, not on every tick


class _Recorder(FileSystemEventHandler):
    """Runs on watchdog's threads: records paths for poll(), nothing else."""

    def __init__(self, watcher: InboxWatcher) -> None:
        self._watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        log.debug("event %s %s%s%s", event.event_type, event.src_path,
                  " -> " if event.dest_path else "", event.dest_path)
        self._watcher._record(event)


class InboxWatcher:
    """Turns an inbox configuration into a stream of stable PDF paths via `poll()`."""

    def __init__(self, inbox: InboxConfig) -> None:
        self._inbox = inbox
        self._handler = _Recorder(self)
        # Guards _pending_files and _pending_dirs, filled by the observers' threads (_record)
        # and taken by the main loop (poll); every other field belongs to the main loop.
        self._lock = threading.Lock()
        self._pending_files: set[Path] = set()
        self._pending_dirs: set[Path] = set()
        self._roots: list[_Root] = []
        self._files: dict[Path, _FileState] = {}
        self._active: set[Path] = set()  # paths poll() must stat until emitted or gone
        self._outside_dirs: set[Path] = set()  # directory links leading out, logged once
        self._retiring: list[tuple[threading.Thread, BaseObserver]] = []
        self._next_rescan = float("-inf")
        self._started = False

    # -- lifecycle (main loop) ---------------------------------------------------------

    def start(self) -> None:
        """Create missing inbox folders and start watching; the first poll() scans them."""
        if self._started:
            return
        self._started = True
        for path in self._inbox.paths:
            self._add_root(path)
        self._next_rescan = float("-inf")

    def stop(self) -> None:
        """Stop every observer and join its threads, within STOP_TIMEOUT in all."""
        self._started = False
        for root in self._roots:
            self._disarm(root)
        self._roots.clear()
        self._active.clear()
        deadline = time.monotonic() + STOP_TIMEOUT
        for stopper, observer in self._retiring:
            stopper.join(max(0.0, deadline - time.monotonic()))
            observer.join(max(0.0, deadline - time.monotonic()))
            if observer.is_alive():
                log.warning("watchdog observer %s did not stop within %s s; leaving it",
                            observer.name, STOP_TIMEOUT)
        self._retiring.clear()

    def reconfigure(self, inbox: InboxConfig) -> None:
        """Apply a new inbox configuration; observers are re-created only where needed."""
        old, self._inbox = self._inbox, inbox
        if not self._started:
            return
        rearm = old.recursive != inbox.recursive or old.polling != inbox.polling
        wanted = {_absolute(p) for p in inbox.paths}
        for root in list(self._roots):
            interval_changed = root.polling and old.poll_interval != inbox.poll_interval
            if root.path not in wanted:
                log.info("no longer watching %s", root.path)
                self._disarm(root)
                self._roots.remove(root)
            elif rearm or interval_changed:
                self._arm(root)
        for path in [p for p in self._files if self._root_of(p) is None]:
            self._forget(path)
        known = {root.path for root in self._roots}
        for path in inbox.paths:
            if _absolute(path) not in known:
                self._add_root(path)
        # New ignore rules or a new `recursive` change which files count: look again.
        self._next_rescan = float("-inf")

    # -- the main-loop tick --------------------------------------------------------------

    def poll(self, now: float | None = None) -> list[Path]:
        """Do pending work and return the files that just became stable, each version once."""
        now = time.monotonic() if now is None else now
        with self._lock:
            files, self._pending_files = self._pending_files, set()
            dirs, self._pending_dirs = self._pending_dirs, set()
        self._reap_retired()
        if self._started:
            dirs |= self._check_roots()
        if now >= self._next_rescan:
            self._next_rescan = now + self._inbox.rescan_seconds
            dirs = {root.path for root in self._roots}
        for top in outermost(dirs):
            self._scan(top)
        for path in files:
            if self._wanted(path):
                self._active.add(path)
            else:
                self._forget(path)

        ready: list[Path] = []
        targets: set[str] = set()
        for path in sorted(self._active):
            if self._check(path, now, targets):
                ready.append(path)
        return ready

    # -- events (watchdog threads) -------------------------------------------------------

    def _record(self, event: FileSystemEvent) -> None:
        if event.event_type not in _FILE_EVENTS:
            return
        paths = [os.fsdecode(event.src_path)]
        if event.dest_path:
            paths.append(os.fsdecode(event.dest_path))
        with self._lock:
            for raw in paths:
                if event.is_directory:
                    # A directory modified event is just a child changing; its child's own
                    # event says which one. Anything else (created, moved in or out,
                    # deleted) is settled by scanning that directory.
                    if event.event_type != "modified":
                        self._pending_dirs.add(Path(raw))
                elif is_pdf_name(raw):
                    self._pending_files.add(Path(raw))

    # -- observers -----------------------------------------------------------------------

    def _add_root(self, configured: Path) -> None:
        path = _absolute(configured)
        try:
            if not path.is_dir():
                path.mkdir(parents=True, exist_ok=True)
                log.info("created the inbox folder %s", path)
        except OSError as exc:
            log.warning("cannot create inbox %s: %s; will watch it once it exists", path, exc)
        root = _Root(path=path, real=path)
        self._roots.append(root)
        self._arm(root)

    def _arm(self, root: _Root) -> bool:
        """(Re-)start the observer for `root`; False when it cannot be watched (yet)."""
        self._disarm(root)
        try:
            st = os.stat(root.path)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
            root.real = Path(os.path.realpath(root.path))
            polling = self._wants_polling(root)
            try:
                observer = self._start_observer(root, polling)
            except OSError as exc:
                if polling:
                    raise
                # Typically the inotify watch limit (fs.inotify.max_user_watches); polling
                # has no such limit.
                log.warning("inotify cannot watch %s (%s); polling it every %s s instead",
                            root.path, exc, self._inbox.poll_interval)
                polling = True
                observer = self._start_observer(root, polling)
        except OSError as exc:
            if not root.trouble_logged:
                log.warning("cannot watch inbox %s (%s); trying again while running",
                            root.path, exc)
                root.trouble_logged = True
            return False
        root.trouble_logged = False
        root.observer, root.polling, root.ident = observer, polling, (st.st_dev, st.st_ino)
        log.info("watching %s (%s%s)", root.path,
                 f"polling every {self._inbox.poll_interval} s" if polling else "inotify",
                 ", recursive" if self._inbox.recursive else "")
        return True

    def _start_observer(self, root: _Root, polling: bool) -> BaseObserver:
        observer: BaseObserver = (
            PollingObserver(timeout=self._inbox.poll_interval) if polling else Observer()
        )
        observer.name = f"ocrvl-watch:{root.path}"
        try:
            observer.schedule(self._handler, str(root.path), recursive=self._inbox.recursive)
            observer.start()
        except OSError:
            self._retire(observer)
            raise
        return observer

    def _wants_polling(self, root: _Root) -> bool:
        if self._inbox.polling != "auto":
            return bool(self._inbox.polling)
        fstype = filesystem_type(root.real)
        if needs_polling(fstype):
            log.info("inbox %s is on %s, where inotify sees no changes: polling it", root.path,
                     fstype)
            return True
        return False

    def _disarm(self, root: _Root) -> None:
        if root.observer is not None:
            self._retire(root.observer)
        root.observer, root.ident = None, None

    def _retire(self, observer: BaseObserver) -> None:
        """Stop an observer without waiting: stopping joins its emitters, and a polling
        emitter in the middle of a snapshot of a slow share can take a while."""
        stopper = threading.Thread(target=_stop_quietly, args=(observer,),
                                   name=f"{observer.name}-stop", daemon=True)
        stopper.start()
        self._retiring.append((stopper, observer))

    def _reap_retired(self) -> None:
        self._retiring = [(s, o) for s, o in self._retiring if s.is_alive() or o.is_alive()]

    def _check_roots(self) -> set[Path]:
        """Re-arm observers whose folder came back, was replaced, or whose thread died;
        returns the roots that need a scan because events may have been missed."""
        rescan: set[Path] = set()
        for root in self._roots:
            try:
                st = os.stat(root.path)
                ident = (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
            except OSError:
                ident = None
            if ident is None:
                if root.observer is not None:
                    log.warning("inbox %s disappeared; watching it again once it is back",
                                root.path)
                    root.trouble_logged = True
                    self._disarm(root)
                continue
            healthy = (
                root.observer is not None
                and root.observer.is_alive()
                and all(emitter.is_alive() for emitter in root.observer.emitters)
            )
            if ident == root.ident and healthy:
                continue
            if root.observer is not None:
                log.warning("observer for %s stopped or its folder was replaced; re-arming",
                            root.path)
            if self._arm(root):
                rescan.add(root.path)
        return rescan

    # -- scanning and stability (main loop) --------------------------------------------

    def _root_of(self, path: Path) -> _Root | None:
        best: _Root | None = None
        for root in self._roots:
            if path.is_relative_to(root.path) and (
                best is None or len(root.path.parts) > len(best.path.parts)
            ):
                best = root
        return best

    def _wanted(self, path: Path) -> bool:
        """True for a PDF path inside an inbox that no ignore rule hides."""
        root = self._root_of(path)
        if root is None:
            return False
        parts = path.relative_to(root.path).parts
        if not parts or (len(parts) > 1 and not self._inbox.recursive):
            return False
        return wanted_name(parts[-1], self._inbox) and not any(
            ignored_dir(part, self._inbox) for part in parts[:-1])

    def _scan(self, top: Path) -> None:
        """Mark every candidate under `top` for checking; forget what is no longer there."""
        root = self._root_of(top)
        if root is None:
            return
        parts = top.relative_to(root.path).parts
        listing = Listing()
        if not parts or (self._inbox.recursive
                         and not any(ignored_dir(part, self._inbox) for part in parts)):
            listing = walk(top, self._inbox, self._inside)
        for link in sorted(listing.links_out - self._outside_dirs):
            log.info("%s links to %s, outside every inbox; ignoring it", link,
                     os.path.realpath(link))
        self._outside_dirs = {
            d for d in self._outside_dirs if not d.is_relative_to(top)
        } | listing.links_out
        # A folder that could not be read (a share gone for a moment) keeps what was known
        # about it; forgetting would hand every file on again once it is back.
        stale = [
            p for p in self._files
            if p not in listing.files and p.is_relative_to(top)
            and not any(p.is_relative_to(u) for u in listing.unreadable)
        ]
        for path in stale:
            self._forget(path)
        self._active |= listing.files

    def _inside(self, real: str) -> bool:
        return any(Path(real).is_relative_to(root.real) for root in self._roots)

    def _forget(self, path: Path) -> None:
        self._files.pop(path, None)
        self._active.discard(path)

    def _check(self, path: Path, now: float, targets: set[str]) -> bool:
        """Stat one candidate; True when it has just become ready to hand on."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            self._forget(path)
            return False
        except OSError as exc:
            # The next event or rescan tries again; warning every tick would flood the log.
            log.warning("cannot stat %s: %s", path, exc)
            self._forget(path)
            return False
        if not stat.S_ISREG(st.st_mode):
            self._forget(path)
            return False
        state = self._files.get(path)
        real = os.path.realpath(path)
        if not self._inside(real):
            if state is None or not state.outside:
                log.info("%s links to %s, outside every inbox; ignoring it", path, real)
                self._files[path] = _FileState(version=None, since=now, outside=True)
            self._active.discard(path)
            return False

        version = (st.st_size, st.st_mtime_ns)
        if state is None or state.outside or state.version != version:
            state = self._files[path] = _FileState(version=version, since=now)
        if state.emitted:
            self._active.discard(path)
            return False
        stable_for = now - state.since
        if stable_for < self._inbox.stable_seconds:
            return False
        if state.opens is None:
            state.opens = opens_as_pdf(path)
            if not state.opens:
                log.debug("%s does not open as a PDF (yet); waiting", path)
        if not state.opens and stable_for < bad_file_wait(self._inbox):
            return False

        state.emitted = True
        self._active.discard(path)
        if real in targets:
            log.debug("%s leads to %s, already queued in this pass", path, real)
            return False
        targets.add(real)
        if state.opens:
            log.debug("%s is stable, queueing", path)  # the daemon says what it did with it
        else:
            log.info("%s is stable but does not open as a PDF; queueing it so the failure "
                     "is reported", path)
        return True



def _absolute(path: Path) -> Path:
    return Path(os.path.abspath(path))


def _stop_quietly(observer: BaseObserver) -> None:
    try:
        observer.stop()
    except (OSError, RuntimeError) as exc:
        log.warning("stopping watchdog observer %s failed: %s", observer.name, exc)
