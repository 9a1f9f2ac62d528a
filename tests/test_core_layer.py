"""The core (`ocrvl_daemon.core`) decides from plain values: it reads no clock and does no
I/O, so every decision is a function call in the tests, and the owner's clock is the one
time there is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ocrvl_daemon.core

CORE = Path(ocrvl_daemon.core.__file__).parent
# What reads the clock, touches files or processes, or talks to the network.
FORBIDDEN = {"time", "datetime", "os", "shutil", "subprocess", "sqlite3", "socket", "httpx",
             "threading", "multiprocessing", "pypdfium2", "psutil"}


@pytest.mark.quick
def test_the_core_reads_no_clock_and_does_no_io() -> None:
    found = []
    for module in sorted(CORE.glob("*.py")):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{module.name} imports {n}" for n in names
                      if n.split(".")[0] in FORBIDDEN]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
                found.append(f"{module.name} opens a file")
    assert not found, "the core must take time and data from its caller: " + "; ".join(found)
