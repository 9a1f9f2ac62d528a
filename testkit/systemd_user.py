"""A real `systemd --user` manager (and journald) on a machine without systemd as PID 1.

For end-to-end tests of the unit: run as root in a container or VM whose PID 1 is not
systemd. `user_manager()` starts, all as direct children of the test process:

1. a holder process in a private mount namespace (`unshare -m --propagation private`), in
   which /run/systemd is a fresh tmpfs holding /run/systemd/system (what sd_booted() checks),
   /run/log is bound to a temporary folder (so the journal is readable from outside) and
   /var/log/journal is hidden (journald must not write the host's persistent journal);
2. systemd-journald inside that namespace (`nsenter --mount=...`);
3. `/usr/lib/systemd/systemd --user` inside it, moved first into its own cgroup
   user.slice/user-UID.slice/user@UID.service (journald derives _SYSTEMD_USER_UNIT from that
   path), with XDG_RUNTIME_DIR, HOME, XDG_CONFIG_HOME... in a temporary folder, logging its
   own messages to that journal.

The manager runs as the invoking user (root): the project's virtual environment may live
under /root, which no other user can execute. `systemctl --user` talks to it over
$XDG_RUNTIME_DIR/systemd/private; no D-Bus is needed. Teardown kills the manager's cgroup
(every service with it), then journald and the holder, reaps them all and removes the
cgroups and the folder.

Run by hand: `python -m testkit.systemd_user` starts one, prints the environment to use with
systemctl/journalctl, and tears it down on Enter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SYSTEMD = Path("/usr/lib/systemd/systemd")
JOURNALD = Path("/usr/lib/systemd/systemd-journald")
CGROUP_FS = Path("/sys/fs/cgroup")
TOOLS = ("unshare", "nsenter", "mount", "systemctl", "journalctl", "sleep")
START_TIMEOUT = 30.0
# journald and the mount-namespace holder live here, so a crashed run's leftovers can be found.
HARNESS_CGROUP = "ocrvl-test-harness"


def unavailable_reason() -> str | None:
    """Why this machine cannot run the harness, or None if it can."""
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root (to create cgroups and a mount namespace)"
    if Path("/run/systemd/system").exists():
        return ("systemd is PID 1 here: this harness is for containers without it (test the "
                "unit with your own `systemctl --user` instead)")
    missing = [str(p) for p in (SYSTEMD, JOURNALD) if not p.exists()]
    missing += [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install systemd util-linux)"
    if not cgroup_roots():
        return f"no writable cgroup hierarchy under {CGROUP_FS}"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"cannot create a mount namespace: {probe.stderr.strip()}"
    return None


def cgroup_roots() -> list[Path]:
    """The cgroup hierarchies a manager must be placed in: v2 alone, or v1's name=systemd
    plus the hybrid unified one."""
    if (CGROUP_FS / "cgroup.controllers").exists():
        return [CGROUP_FS] if os.access(CGROUP_FS, os.W_OK) else []
    return [root for root in (CGROUP_FS / "systemd", CGROUP_FS / "unified")
            if (root / "cgroup.procs").exists() and os.access(root, os.W_OK)]


class UserManager:
    """A running `systemd --user`; see the module docstring."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.uid = os.getuid()
        self.runtime_dir = base / "runtime"
        self.home = base / "home"
        self.config_home = base / "config"
        self.unit_dir = self.config_home / "systemd" / "user"
        self.journal_dir = base / "log" / "journal"
        self.cgroup = f"user.slice/user-{self.uid}.slice/user@{self.uid}.service"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.home),
            "USER": "root",
            "LOGNAME": "root",
            "LANG": "C.UTF-8",
            "XDG_RUNTIME_DIR": str(self.runtime_dir),
            "XDG_CONFIG_HOME": str(self.config_home),
            "XDG_DATA_HOME": str(base / "data"),
            "XDG_STATE_HOME": str(base / "state"),
            "XDG_CACHE_HOME": str(base / "cache"),
        }
        self._procs: list[subprocess.Popen[bytes]] = []
        self.holder: subprocess.Popen[bytes] | None = None
        self.manager: subprocess.Popen[bytes] | None = None

    # -- for tests ------------------------------------------------------------------------

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run with this manager's environment (fits install_service's `run`)."""
        kwargs.setdefault("timeout", 60)
        return subprocess.run(argv, env=self.env, **kwargs)

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`systemctl --user ARGS`; raises with its output when check and it fails."""
        done = self.run(["systemctl", "--user", "--no-pager", *args],
                        capture_output=True, text=True, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"systemctl --user {' '.join(args)} failed "
                                 f"({done.returncode}): {done.stdout}{done.stderr}")
        return done

    def show(self, unit: str, prop: str) -> str:
        """One property of a unit, e.g. show("ocrvl.service", "ActiveState")."""
        return self.systemctl("show", "--value", "-p", prop, unit).stdout.strip()

    def journal(self, *args: str) -> str:
        """`journalctl` over this manager's journal with ARGS (matches, -p, -o...)."""
        done = self.run(["journalctl", "--no-pager", "-D", str(self.journal_dir), *args],
                        capture_output=True, text=True, check=False)
        return done.stdout

    def manager_messages(self, unit: str) -> str:
        """What the manager itself logged about `unit` (started, stopped, killed...)."""
        return self.journal("-o", "cat", f"USER_UNIT={unit}")

    def drop_in(self, unit: str, text: str, name: str = "50-test.conf") -> Path:
        """Add a drop-in (e.g. "[Service]\nEnvironment=X=1\n") to `unit` and reload."""
        path = self.unit_dir / f"{unit}.d" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.systemctl("daemon-reload")
        return path

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
        """Poll `predicate` until it returns something truthy; fail naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                                     f"manager log:\n{self.manager_log()[-3000:]}")
            time.sleep(0.05)

    def manager_log(self) -> str:
        """What the manager and journald printed themselves."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.base.glob("*.log")))

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        for path in (self.runtime_dir, self.home, self.unit_dir, self.journal_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.runtime_dir.chmod(0o700)
        for cgroup in (HARNESS_CGROUP, self.cgroup):
            self._make_cgroup(cgroup)
        self.holder = self._spawn(HARNESS_CGROUP, ["unshare", "-m", "--propagation", "private",
                                                   "--", "sleep", "infinity"], "holder.log")
        own_ns = os.readlink("/proc/self/ns/mnt")
        ns_file = f"/proc/{self.holder.pid}/ns/mnt"
        self.wait_for("the mount namespace", lambda: _readlink(ns_file) not in (None, own_ns),
                      START_TIMEOUT)
        in_ns = ["nsenter", f"--mount={ns_file}", "--"]
        mounts = [["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run/systemd"],
                  ["mkdir", "/run/systemd/system"],
                  ["mount", "--bind", str(self.base / "log"), "/run/log"]]
        if Path("/var/log/journal").is_dir():
            mounts.append(["mount", "-t", "tmpfs", "tmpfs", "/var/log/journal"])
        for argv in mounts:
            subprocess.run(in_ns + argv, check=True, capture_output=True, timeout=30)
        ns_root = Path(f"/proc/{self.holder.pid}/root")
        self._spawn(HARNESS_CGROUP, [*in_ns, str(JOURNALD)], "journald.log")
        self.wait_for("journald's socket", (ns_root / "run/systemd/journal/stdout").exists,
                      START_TIMEOUT)
        # Its own messages ("Killing process ...", "Watchdog timeout") go to the journal,
        # tagged USER_UNIT=<unit>; left to itself it logs nowhere here.
        self.manager = self._spawn(self.cgroup, [*in_ns, str(SYSTEMD), "--user"], "manager.log",
                                   env={**self.env, "SYSTEMD_LOG_TARGET": "journal"})
        self.wait_for("the user manager to finish starting", self._booted, START_TIMEOUT)

    def stop(self) -> None:
        """Kill everything the harness started and remove its cgroups; safe to repeat."""
        for root in cgroup_roots():
            _kill_cgroup(root / self.cgroup)  # the manager and its services first
            _kill_cgroup(root / HARNESS_CGROUP)  # then journald and the namespace holder
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for root in cgroup_roots():
            for cgroup in (self.cgroup, HARNESS_CGROUP):
                _remove_cgroup_tree(root / cgroup)
            for parent in Path(self.cgroup).parents[:-1]:  # only if empty: never another's
                with contextlib.suppress(OSError):
                    (root / parent).rmdir()

    def _booted(self) -> bool:
        if not (self.runtime_dir / "systemd" / "private").exists():
            if self.manager is not None and self.manager.poll() is not None:
                raise RuntimeError(f"systemd --user exited with {self.manager.returncode}:\n"
                                   f"{self.manager_log()[-3000:]}")
            return False
        # Not `is-system-running`: it answers "offline" when it cannot stat /proc/1/root,
        # as under some container inits.
        state = self.systemctl("show", "--value", "-p", "SystemState", check=False).stdout
        return state.strip() in ("running", "degraded")

    def _spawn(self, cgroup: str, argv: list[str], log_name: str,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start `argv` inside `cgroup` from its first instruction: a helper (this file)
        moves itself there and execs `argv`, in one process that stays our child."""
        procs = [str(root / cgroup / "cgroup.procs") for root in cgroup_roots()]
        with (self.base / log_name).open("wb") as log:
            proc = subprocess.Popen([sys.executable, __file__, "--exec-in-cgroups", *procs, "--",
                                     *argv], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
        self._procs.append(proc)
        return proc

    def _make_cgroup(self, cgroup: str) -> None:
        for root in cgroup_roots():
            # What a crashed run left behind would hold the cgroup: end it first.
            _kill_cgroup(root / cgroup)
            (root / cgroup).mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def user_manager(base: Path | None = None) -> Iterator[UserManager]:
    """Start a manager (raising if the machine cannot: check unavailable_reason() first),
    yield it, then tear everything down."""
    # Socket paths must stay under 108 bytes: a short folder in /tmp, not pytest's tmp_path.
    folder = Path(tempfile.mkdtemp(prefix="ocrvl-sd-")) if base is None else base
    manager = UserManager(folder)
    try:
        manager.start()
        yield manager
    finally:
        manager.stop()
        if base is None:
            shutil.rmtree(folder, ignore_errors=True)


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def cgroup_pids(path: Path) -> set[int]:
    pids: set[int] = set()
    for procs in path.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(line) for line in procs.read_text().split())
    return pids


def _kill_cgroup(path: Path, timeout: float = 10.0) -> None:
    """SIGKILL every process in the cgroup tree at `path` until it is empty."""
    if not path.exists():
        return
    deadline = time.monotonic() + timeout
    while pids := cgroup_pids(path):
        if (path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} survive in {path}")
        time.sleep(0.05)


def _remove_cgroup_tree(path: Path) -> None:
    if not path.exists():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()),
                        key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def _exec_in_cgroups(args: list[str]) -> None:
    split = args.index("--")
    for procs in args[:split]:
        Path(procs).write_text(str(os.getpid()))
    os.execvp(args[split + 1], args[split + 1:])


def _main() -> None:
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot run a user manager here: {reason}")
    with user_manager() as manager:
        print("A systemd --user manager is running. In another shell:")
        print(" ".join(f"{k}={manager.env[k]}" for k in ("XDG_RUNTIME_DIR", "XDG_CONFIG_HOME")),
              "systemctl --user status")
        print(f"journalctl -D {manager.journal_dir}")
        print(f"Units go in {manager.unit_dir}. Press Enter to stop it.")
        input()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--exec-in-cgroups"]:
        _exec_in_cgroups(sys.argv[2:])
    else:
        _main()
