"""How a page's PDF reaches the node that renders it (`cluster.pdfs`).

Pages are rendered on the node, never in the daemon: a page image is ~6 MB, the PDF it
comes from a few KB per page, and rendering is a CPU stage the daemon would have to do for
every node. The node reads the PDF at the daemon's path when it sees the same file there (a
shared mount: same size and modification time), else from a copy the daemon put in Ray's
object store once per document, written once per node to a local cache.

Measured on one machine with stand-in servers (bench/cluster_RESULTS.md): both ways give
the same pages/s, and the copy costs the daemon one read of the file per document (a few ms
of CPU for a 100-page PDF), so `auto` (the default) offers the copy and lets each node use
its own view when it can: a node without the mount still works, and nothing else differs.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ocrvl_daemon.core.messages import PageTask

# Documents whose copies the daemon keeps in the object store (the active ones, in practice).
SHELF_DOCUMENTS = 16
# Copies a node keeps on its disk.
NODE_COPIES = 32


@dataclass(frozen=True)
class PdfCopy:
    """A document's PDF in Ray's object store. Wrapped so that Ray passes the reference to
    the host as it is, instead of fetching the bytes for every page."""

    ref: Any  # ray.ObjectRef of the file's bytes


def copy_key(pdf: str, size: int, mtime: float) -> str:
    """The name one version of one file goes under, in the daemon's shelf and a node's
    cache."""
    return hashlib.sha256(f"{pdf}\0{size}\0{mtime!r}".encode()).hexdigest()[:32]


class PdfShelf:
    """The daemon's side: each document's PDF put in the object store once, while in use."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._copies: OrderedDict[str, PdfCopy] = OrderedDict()
        self._lock = threading.Lock()

    def copy_for(self, task: PageTask) -> PdfCopy | None:
        """The copy of `task`'s PDF a node may need (None with cluster.pdfs: shared_path)."""
        if self.mode == "shared_path":
            return None
        import ray

        key = copy_key(task.pdf, task.size, task.mtime)
        with self._lock:
            copy = self._copies.get(key)
            if copy is None:
                copy = PdfCopy(ray.put(Path(task.pdf).read_bytes()))
                self._copies[key] = copy
                while len(self._copies) > SHELF_DOCUMENTS:
                    self._copies.popitem(last=False)
            self._copies.move_to_end(key)
        return copy


class NodePdfs:
    """A node's side: the path a page is rendered from, fetching the copy when needed."""

    def __init__(self, folder: Path, mode: str,
                 fetch: Callable[[PdfCopy], bytes] | None = None) -> None:
        self.folder = folder
        self.mode = mode
        self._bytes = fetch or _from_object_store
        self._lock = threading.Lock()  # one fetch of a document at a time

    def local(self, task: PageTask, copy: PdfCopy | None) -> PageTask:
        """`task` as this node renders it: unchanged when the node sees the same file at its
        path (or must: shared_path), else pointing at the node's copy."""
        if copy is None or (self.mode == "auto" and _same_file(task)):
            return task
        path = self.folder / f"{copy_key(task.pdf, task.size, task.mtime)}.pdf"
        with self._lock:
            if not path.exists():
                self._fetch(copy, path)
        # The copy never changes: the worker's own check (size, mtime) guards it as it is.
        stat = path.stat()
        return replace(task, pdf=str(path), size=stat.st_size, mtime=stat.st_mtime)

    def _fetch(self, copy: PdfCopy, path: Path) -> None:
        data = self._bytes(copy)
        self.folder.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")  # hosts share the cache
        part.write_bytes(data)
        os.replace(part, path)
        copies = sorted(self.folder.glob("*.pdf"), key=lambda p: p.stat().st_mtime)
        for old in copies[:-NODE_COPIES]:
            old.unlink(missing_ok=True)


def _from_object_store(copy: PdfCopy) -> bytes:
    import ray

    return bytes(ray.get(copy.ref))


def _same_file(task: PageTask) -> bool:
    try:
        stat = os.stat(task.pdf)
    except OSError:
        return False
    return (stat.st_size, stat.st_mtime) == (task.size, task.mtime)
