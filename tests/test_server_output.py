"""The managed server's output in ocrvl's log: each line at the level it deserves, readable."""

from __future__ import annotations

import io
import logging

import pytest

from ocrvl_daemon.server.managed import _LogPump

ENGINE = "(EngineCore_DP0 pid=4242) "
VLLM_START_FAILURE = [
    "(APIServer pid=4241) INFO 12-07 03:00:00 [api_server.py:1] vLLM API server version 0.26.0",
    f"{ENGINE}ERROR 12-07 03:00:41 [core.py:708] EngineCore failed to start.",
    f"{ENGINE}Traceback (most recent call last):",
    f'{ENGINE}  File "/venv/vllm/v1/engine/core.py", line 699, in run_engine_core',
    f"{ENGINE}    engine_core = EngineCoreProc(*args, **kwargs)",
    f"{ENGINE}ValueError: No available memory for the cache blocks.",
    "Traceback (most recent call last):",
    '  File "/venv/bin/vllm", line 8, in <module>',
    "RuntimeError: Engine core initialization failed. See root cause above.",
    "",
    "The above exception was the direct cause of the following exception:",
    "Traceback (most recent call last):",
    '  File "/venv/bin/vllm", line 9, in <module>',
    "SystemExit: 1",
    "\x1b[32mINFO\x1b[0m 12-07 03:00:42 [launcher.py:2] Shutting down",
    "a plain line after it",
]


@pytest.mark.quick
def test_a_traceback_from_the_server_is_logged_as_an_error_and_colour_codes_are_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    output = "".join(line + "\n" for line in VLLM_START_FAILURE).encode()
    pump = _LogPump(io.BytesIO(output), lambda _: None, logging.getLogger("test.vllm"))
    with caplog.at_level(logging.DEBUG, logger="test.vllm"):
        pump.run()
    levels = {r.getMessage(): r.levelname for r in caplog.records}
    info = [line for line, level in levels.items() if level == "INFO"]
    assert info == ["(APIServer pid=4241) INFO 12-07 03:00:00 [api_server.py:1] vLLM API "
                    "server version 0.26.0", "INFO 12-07 03:00:42 [launcher.py:2] Shutting "
                    "down", "a plain line after it"], (
        f"a line of the server's traceback was logged as information: {levels}")
    assert not any("\x1b" in line for line in levels), "colour codes reached the log"
