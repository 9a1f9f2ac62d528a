"""A stand-in for systemd's notify socket: collects what a process tells systemd."""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    at: float  # time.monotonic() on receipt
    pid: int  # the sender, from SO_PASSCRED (what NotifyAccess=main checks)
    text: str


class NotifySocket:
    """An AF_UNIX datagram socket standing in for systemd's, collecting what arrives."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)
        self.sock.settimeout(0.05)
        self.messages: list[Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        creds = struct.calcsize("3i")
        while not self._stop.is_set():
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(creds))
            except TimeoutError:
                continue
            pid = next(struct.unpack("3i", d[:creds])[0] for level, kind, d in ancdata
                       if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
            self.messages.append(Message(time.monotonic(), pid, data.decode("utf-8")))

    def texts(self, count: int, timeout: float = 5.0) -> list[str]:
        """The messages so far, once there are at least `count`."""
        deadline = time.monotonic() + timeout
        while len(self.messages) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"expected {count} messages, got {self.messages}")
            time.sleep(0.01)
        return [m.text for m in self.messages]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
