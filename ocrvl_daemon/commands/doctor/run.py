"""`ocrvl doctor`: check the GPU, both Python environments, the config, the inboxes, the server
(or, with cluster.address, the Ray cluster's nodes) and systemd, and say how to fix each problem.

Nothing here raises for a problem in the environment: every finding becomes a `Check`, and
`DoctorReport.blocking` tells the CLI whether conversion can work at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ocrvl_daemon.commands.doctor.daemon import (
    inbox_checks,
    server_check,
    state_dir_check,
    systemd_checks,
)
from ocrvl_daemon.commands.doctor.machine import (
    client_checks,
    gpu_checks,
    gpu_found,
    layout_model_checks,
    server_env_checks,
    wsl_checks,
)
from ocrvl_daemon.commands.doctor.report import Check, DoctorReport
from ocrvl_daemon.config.file import CONFIG_ENV, load_config, resolve_config_path
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.errors import ConfigError
from ocrvl_daemon.server import gpu

# What `run_doctor` skips while the config is invalid.
CONFIG_SECTIONS = ("GPU settings", "client packages", "layout model", "server environment",
                   "state_dir", "inbox", "server")


def run_doctor(config_path: str | None, *, osrelease: str | None = None) -> DoctorReport:
    """Run every check; `osrelease` stands in for /proc/sys/kernel/osrelease (tests)."""
    report = DoctorReport()
    config, path, config_checks = _config(config_path)
    report.config_path = str(path) if path else None
    report.checks += config_checks
    sections: list[tuple[str, Callable[[], list[Check]]]]
    if config is None:
        # Built-in defaults would report problems of a configuration nobody asked for:
        # only what does not depend on it is checked.
        sections = [("GPU", lambda: [gpu_found(gpu.probe_gpu())])]
        report.checks.append(Check("skipped", "info", f"{', '.join(CONFIG_SECTIONS)}: they "
                                   "depend on the config, checked once it is valid"))
    else:
        given = config
        gpu_probe = gpu.probe_gpu()
        sections = [
            ("GPU", lambda: gpu_checks(given, gpu_probe)),
            ("client packages", lambda: client_checks(given)),
            ("layout model", lambda: layout_model_checks(given)),
            ("server environment",
             lambda: server_env_checks(given, gpu_probe, gpu.is_wsl(osrelease))),
            ("state_dir", lambda: [state_dir_check(given)]),
            ("inbox", lambda: inbox_checks(given)),
            ("server", lambda: [server_check(given)]),
        ]
        if config.cluster.address is not None:
            # The GPU and the server are each node's: the cluster's check asks the nodes.
            sections = [(name, run) for name, run in sections
                        if name not in ("GPU", "server environment", "server")]
            sections.append(("cluster", lambda: _cluster_checks(given)))
    sections += [("WSL2", lambda: wsl_checks(osrelease)), ("systemd", systemd_checks)]
    for name, run in sections:
        try:
            report.checks.extend(run())
        except Exception as exc:  # a bug or an odd system must not hide the other checks
            report.checks.append(Check(name, "warn", f"could not be checked: {exc!r}"))
    return report


def _cluster_checks(config: Config) -> list[Check]:
    """The Ray cluster of cluster.address (`doctor.cluster`; Ray is imported only here)."""
    from ocrvl_daemon.commands.doctor.cluster import cluster_checks

    return cluster_checks(config)


def _config(config_path: str | None) -> tuple[Config | None, Path | None, list[Check]]:
    """The config, the file it came from, and a check per problem (all of them at once)."""
    # The file read (or named) heads the report even when it is invalid or missing.
    named = config_path or os.environ.get(CONFIG_ENV)
    path = Path(named).expanduser() if named else None
    try:
        path = resolve_config_path(config_path)
        config, _ = load_config(path)
    except ConfigError as exc:
        return None, path, [Check("config", "fail", p.message, p.fix) for p in exc.problems]
    where = str(path) if path else "no config file, built-in defaults"
    return config, path, [Check("config", "ok", f"valid ({where})")]

