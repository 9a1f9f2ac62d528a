"""The daemon's pause for a full state disk: it resumes only once the disk has room again."""

from __future__ import annotations

from pathlib import Path

import pytest

from ocrvl_daemon.errors import StateFullError
from ocrvl_daemon.storage import disk_pause
from ocrvl_daemon.storage.disk_pause import RESUME_FREE_BYTES, RETRY_SECONDS, StatePause

FULL = StateFullError("The disk holding the state folder is full.")


@pytest.mark.quick
def test_a_disk_that_stays_full_keeps_the_daemon_paused_without_claiming_space_again(
        tmp_path: Path) -> None:
    free = {"bytes": 0}
    pause = StatePause(tmp_path, lambda _: free["bytes"])
    assert pause.may_work(0.0) and not pause.worked(), "paused before any write failed"
    assert pause.full(FULL, 0.0), "the first full write did not start the pause"
    now = 0.0
    for _ in range(20):  # well past every retry: the disk is still full
        now += RETRY_SECONDS
        assert not pause.may_work(now), "the daemon went back to work on a full disk"
    assert not pause.full(FULL, now), "a pause already on was started again (logged twice)"

    free["bytes"] = RESUME_FREE_BYTES
    assert not pause.may_work(now + 1), "the free space was read more often than every retry"
    assert pause.may_work(now + RETRY_SECONDS + 1), "space came back but the pause held"
    assert pause.worked(), "the end of the pause was not reported"
    assert pause.may_work(now + RETRY_SECONDS + 2) and not pause.worked()


@pytest.mark.quick
def test_the_real_free_space_of_the_state_folder_is_read(tmp_path: Path) -> None:
    assert disk_pause.free_bytes(tmp_path) > 0
