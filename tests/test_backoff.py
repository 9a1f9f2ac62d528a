"""The one exponential backoff (`core.backoff.Backoff`): documents tried again, pages the
server failed, engine workers that cannot start and the managed server's restarts all wait
by it."""

from __future__ import annotations

import pytest

from ocrvl_daemon.core.backoff import Backoff


@pytest.mark.quick
def test_the_wait_doubles_after_each_failure_up_to_the_longest() -> None:
    backoff = Backoff(2.0, 10.0)
    assert [backoff.delay(n) for n in range(1, 6)] == [2, 4, 8, 10, 10], (
        "the waits after failures 1-5 in a row should double from 2 s and stop at 10 s")


@pytest.mark.quick
def test_it_gives_up_after_its_attempts_and_never_without_them() -> None:
    once = Backoff(1.0, 1.0, attempts=3)
    assert [once.gives_up(n) for n in (1, 2, 3, 4)] == [False, False, True, True]
    assert not Backoff(1.0, 1.0).gives_up(10_000), "a backoff without attempts never gives up"


@pytest.mark.quick
def test_a_factor_other_than_two_grows_by_that_factor() -> None:
    assert [Backoff(1.0, 100.0, factor=3.0).delay(n) for n in (1, 2, 3)] == [1, 3, 9]
