"""What `ocrvl doctor` found: one `Check` a finding, the report, and how it is shown."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "info"]


MARKS: dict[str, str] = {"ok": "✓", "warn": "!", "fail": "✗", "info": "·"}


@dataclass(frozen=True)
class Check:
    """One finding; `fix` says what to do when it is not ok."""

    name: str
    status: Status
    detail: str
    fix: str | None = None
    # Figures for `--json` readers (the layout engine and its speed).
    data: dict[str, Any] | None = None


@dataclass
class DoctorReport:
    """Every check, in the order they ran."""

    checks: list[Check] = field(default_factory=list)
    config_path: str | None = None

    @property
    def blocking(self) -> bool:
        """True when a check failed: conversion cannot work until it is fixed."""
        return any(c.status == "fail" for c in self.checks)


def render_text(report: DoctorReport) -> str:
    """One screen: a mark, the check and its detail, then `→ fix` under each problem."""
    width = max((len(c.name) for c in report.checks), default=0)
    lines = [f"ocrvl doctor (config: {report.config_path or 'built-in defaults'})"]
    for check in report.checks:
        lines.append(f"{MARKS[check.status]} {check.name:<{width}}  {check.detail}")
        if check.fix:
            indent = f"  {'':<{width}}  "
            lines.append(f"{indent}→ " + check.fix.replace("\n", f"\n{indent}  "))
    failed = sum(c.status == "fail" for c in report.checks)
    warned = sum(c.status == "warn" for c in report.checks)
    if failed:
        lines.append(f"{failed} problem(s) block conversion, {warned} warning(s).")
    else:
        lines.append(f"Nothing blocks conversion; {warned} warning(s).")
    return "\n".join(lines)


def render_json(report: DoctorReport) -> str:
    """The report for scripts: config path, blocking verdict and every check."""
    return json.dumps(
        {"config": report.config_path, "blocking": report.blocking,
         "checks": [asdict(c) for c in report.checks]},
        indent=2, ensure_ascii=False,
    )

