"""Notifier against a real notify socket; child_env; the STATUS= line."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ocrvl_daemon.process.sd_notify import (
    Notifier,
    child_env,
    monotonic_usec,
)
from testkit.notify_socket import NotifySocket


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    path = tmp_path / "notify"
    listener = NotifySocket(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield listener
    listener.close()


MakeNotifier = Callable[[], Notifier]


@pytest.fixture
def make_notifier() -> Iterator[MakeNotifier]:
    """`Notifier()`, each closed after the test (else its socket is left to the collector)."""
    made: list[Notifier] = []

    def make() -> Notifier:
        made.append(Notifier())
        return made[-1]

    yield make
    for notifier in made:
        notifier.close()


def test_lifecycle_messages(make_notifier: MakeNotifier, notify_socket: NotifySocket) -> None:
    notifier = make_notifier()
    assert notifier.enabled
    notifier.extend_timeout(90)
    notifier.ready("idle, 0 done, 0 queued")
    before = monotonic_usec()
    notifier.reloading()
    notifier.stopping()
    texts = notify_socket.texts(4)
    assert texts[:2] == ["EXTEND_TIMEOUT_USEC=90000000", "READY=1\nSTATUS=idle, 0 done, 0 queued"]
    reloading, stamp = texts[2].split("\n")
    assert reloading == "RELOADING=1"
    assert before <= int(stamp.removeprefix("MONOTONIC_USEC=")) <= monotonic_usec()
    assert texts[3] == "STOPPING=1"
    assert {m.pid for m in notify_socket.messages} == {os.getpid()}


def test_status_is_utf8_one_line_and_deduplicated(
        make_notifier: MakeNotifier, notify_socket: NotifySocket) -> None:
    notifier = make_notifier()
    notifier.status("book.pdf p.1/2 · 1.0 p/s", now=100.0)
    notifier.status("book.pdf p.1/2 · 1.0 p/s", now=110.0)  # same line too soon: dropped
    notifier.status("two\nlines", now=111.0)
    notifier.status("two lines", now=140.0)  # same line, 29 s later: still dropped
    notifier.status("two lines", now=141.0)  # 30 s later: repeated
    assert notify_socket.texts(3) == ["STATUS=book.pdf p.1/2 · 1.0 p/s", "STATUS=two lines",
                                      "STATUS=two lines"]
    time.sleep(0.1)
    assert len(notify_socket.messages) == 3


def test_a_status_naming_a_file_that_is_not_utf8_is_sent_escaped(
        make_notifier: Callable[[], Notifier], notify_socket: NotifySocket) -> None:
    make_notifier().status(os.fsdecode(b"\xff\xfebook.pdf p.1/2"))
    assert notify_socket.texts(1) == ["STATUS=\\xff\\xfebook.pdf p.1/2"]


def test_abstract_socket(make_notifier: MakeNotifier, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"ocrvl-test-{uuid.uuid4().hex}"
    listener = NotifySocket("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        make_notifier().ready()
        assert listener.texts(1) == ["READY=1"]
    finally:
        listener.close()


@pytest.mark.quick
def test_no_socket_is_a_quiet_no_op(
        make_notifier: MakeNotifier, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    notifier = make_notifier()
    assert not notifier.enabled
    assert notifier.watchdog_interval() is None
    notifier.ready("x")
    notifier.status("x")
    notifier.tick(0.0)
    notifier.reloading()
    notifier.extend_timeout(1)
    notifier.stopping()


@pytest.mark.quick
def test_missing_socket_warns_and_carries_on(
        make_notifier: MakeNotifier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    notifier = make_notifier()
    notifier.ready()
    assert not notifier.enabled
    assert "NOTIFY_SOCKET" in caplog.text


def test_watchdog_interval(
        make_notifier: MakeNotifier, notify_socket: NotifySocket, monkeypatch:
        pytest.MonkeyPatch) -> None:
    assert make_notifier().watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    assert make_notifier().watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert make_notifier().watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    notifier = make_notifier()
    assert notifier.watchdog_interval() is None
    notifier.tick(0.0)
    time.sleep(0.1)
    assert notify_socket.messages == []


def test_tick_pings_every_half_timeout(
        make_notifier: MakeNotifier, notify_socket: NotifySocket, monkeypatch:
        pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")  # 10 s: ping every 5 s
    notifier = make_notifier()
    expected = 0
    for now, pings in ((100.0, True), (101.0, False), (104.9, False), (105.0, True),
                       (106.0, False), (109.9, False), (110.0, True), (120.0, True)):
        notifier.tick(now)
        expected += pings
        notify_socket.texts(expected)
    time.sleep(0.1)  # let any stray ping arrive
    assert set(notify_socket.texts(4)) == {"WATCHDOG=1"}


def test_pings_come_only_from_the_loop_so_a_stuck_loop_stops_pinging(
        make_notifier: Callable[[], Notifier], notify_socket: NotifySocket, monkeypatch:
        pytest.MonkeyPatch) -> None:
    """The watchdog ping is sent by the main loop's tick(), never by a thread of its own:
    while the loop is stuck nothing reaches systemd (which then restarts ocrvl), and the
    first tick once it turns again pings."""
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping is due every 0.1 s
    notifier = make_notifier()
    notifier.tick()
    assert notify_socket.texts(1) == ["WATCHDOG=1"], "the first tick should ping"
    stuck_since = time.monotonic()
    while time.monotonic() - stuck_since < 0.5:  # stuck for five intervals: no tick
        assert len(notify_socket.messages) == 1, \
            f"a ping reached systemd while the loop was stuck: {notify_socket.messages}"
        time.sleep(0.01)
    notifier.tick()  # the loop turns again: a ping is overdue, so this tick sends it
    assert notify_socket.texts(2) == ["WATCHDOG=1", "WATCHDOG=1"]


@pytest.mark.quick
def test_child_env_drops_notify_variables() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2",
           "JOURNAL_STREAM": "8:9", "INVOCATION_ID": "abc", "PATH": "/bin"}
    assert child_env(env) == {"JOURNAL_STREAM": "8:9", "INVOCATION_ID": "abc", "PATH": "/bin"}
    assert "NOTIFY_SOCKET" in env  # the daemon's own environment is left alone


