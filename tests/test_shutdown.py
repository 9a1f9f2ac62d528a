"""StopSignals: the first stop signal stops gracefully, a second one forces the stop."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from ocrvl_daemon.process.shutdown import StopSignals
from testkit.harness import wait_until


@pytest.fixture
def signals() -> Iterator[StopSignals]:
    installed = StopSignals(signal.SIGHUP)
    installed.install()
    yield installed
    installed.restore()


@pytest.mark.quick
def test_a_second_stop_signal_forces_the_stop_instead_of_waiting(signals: StopSignals) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # the first: stop gracefully
    wait_until(lambda: signals.stops, 5, what="the first SIGTERM to be recorded")
    stuck = threading.Event()  # a graceful stop that would wait for ever
    forced: list[bool] = []

    def graceful() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the second, while the graceful stop waits
        stuck.wait(60)

    def force() -> None:
        forced.append(True)
        stuck.set()

    assert signals.stop(graceful, force) is False, "the stop should say it was forced"
    assert forced, "a second stop signal did not run the forced stop"
    assert signals.stops == [signal.SIGTERM, signal.SIGINT]


@pytest.mark.quick
def test_one_stop_signal_and_a_sighup_let_the_graceful_stop_finish(signals: StopSignals) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    wait_until(lambda: signals.stops, 5, what="the SIGTERM to be recorded")
    finished: list[bool] = []

    def graceful() -> None:
        os.kill(os.getpid(), signal.SIGHUP)  # not a stop signal: only recorded
        finished.append(True)

    assert signals.stop(graceful, lambda: pytest.fail("forced after a single stop signal"))
    assert finished
    assert signals.pending == [signal.SIGTERM, signal.SIGHUP]


@pytest.mark.quick
def test_what_the_graceful_stop_raises_reaches_the_main_thread(signals: StopSignals) -> None:
    def graceful() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        signals.stop(graceful, lambda: None)
