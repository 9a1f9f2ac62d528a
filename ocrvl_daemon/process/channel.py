"""A Python child process that answers its parent over a pair of pipes, and the pipe between them.

The messages are pickles, framed by `multiprocessing.connection` (its length prefix, a large
message's longer one included); the engine workers and their layout processes use it, and so
could any other child that serves its parent one message at a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from ocrvl_daemon.process.group import die_with_parent


class Channel:
    """Pickled messages one way over `reader`, the other way over `writer`; `send` is safe
    from many threads (one message's bytes go together)."""

    def __init__(self, reader: Connection, writer: Connection) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = threading.Lock()  # guards _writer

    def send(self, message: object) -> None:
        """Send one message; OSError (or ValueError once closed) when the other side is gone."""
        with self._lock:
            self._writer.send(message)

    def receive(self) -> Any:
        """The next message; None at end of input."""
        try:
            return self._reader.recv()
        except EOFError:
            return None

    @property
    def output_closed(self) -> bool:
        """Whether `close_output` was called."""
        return self._writer.closed

    def close_output(self) -> None:
        """No more messages from this side: the other side's `receive` then gives None."""
        with self._lock:
            self._writer.close()

    def close_input(self) -> None:
        """Stop reading (once the reader is done with it)."""
        self._reader.close()


def start_child(module: str, **popen: Any) -> tuple[subprocess.Popen[bytes], Channel]:
    """Start `module`'s `serve()` in a Python child process that answers over its stdin and
    stdout (`child_channel` is its end); `popen`: more `subprocess.Popen` arguments."""
    argv = [sys.executable, "-c", f"from {module} import serve; serve()", str(os.getpid())]
    to_child, to_parent = os.pipe(), os.pipe()  # (read end, write end) each
    try:
        process = subprocess.Popen(argv, stdin=to_child[0], stdout=to_parent[1], **popen)
    except BaseException:
        for fd in (*to_child, *to_parent):
            os.close(fd)
        raise
    os.close(to_child[0])  # the child's ends are the child's alone: its exit is our EOF
    os.close(to_parent[1])
    return process, Channel(Connection(to_parent[0], writable=False),
                            Connection(to_child[1], readable=False))


def child_channel() -> Channel:
    """The child's end of `start_child`, set up first thing in its `serve()`: it dies with
    its parent however that ends (SIGKILL), leaves Ctrl-C to the daemon, and keeps fd 1 for
    the messages (anything a library prints goes to stderr instead)."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != int(sys.argv[1]):  # the parent died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    channel = Channel(Connection(os.dup(0), writable=False),
                      Connection(os.dup(1), readable=False))
    os.dup2(2, 1)
    return channel
