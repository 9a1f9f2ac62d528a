"""The `ocrvl` command. The only place where exceptions become exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ocrvl_daemon import __version__
from ocrvl_daemon.config.file import load_config
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.values import openai_base_url
from ocrvl_daemon.errors import ExitCode, OcrvlError
from ocrvl_daemon.server import vllm_release

log = logging.getLogger("ocrvl_daemon")

CONFIG_HELP = (
    "config file (default: $OCRVL_CONFIG, then ~/.config/ocrvl/config.yaml, then built-in defaults)"
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subcommand per job."""
    parser = argparse.ArgumentParser(
        prog="ocrvl",
        description="Turn scanned PDFs into Markdown with PaddleOCR-VL on a vLLM server that "
        "ocrvl starts and looks after.",
    )
    parser.add_argument("--version", action="version", version=f"ocrvl {__version__}")
    parser.add_argument("--config", metavar="PATH", help=CONFIG_HELP)
    # Also after the command; SUPPRESS keeps a --config given before it (`ocrvl --config F run`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=CONFIG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "run",
        parents=[common],
        help="run the daemon in the foreground",
        description="Watch the inbox folders and convert every PDF that lands there; "
        "start and supervise the model server. This is what the systemd "
        "unit runs.",
    )
    convert = sub.add_parser(
        "convert",
        parents=[common],
        help="convert PDFs once and exit",
        description="Write <stem>.md (and <stem>_images/) next to each PDF, or under "
        "output.dir. Starts and stops a managed model server unless --server-url is given. "
        "Runs hooks.on_done/on_failed as the daemon does and waits for them. Works on its "
        "own, beside a running daemon: it keeps its own record (state_dir/convert.sqlite) "
        "and never touches the daemon's queue, so `ocrvl status` and `ocrvl retry` do not "
        "see its files; run `ocrvl convert` again to finish or redo them. Exit code 0 only "
        "if every file converted (a failing hook does not change it); else 4 when only bad "
        "input files failed, 5 when the model server failed them, 6 when the model server is "
        "not installed (or a package of the pipeline, or the layout model cannot be "
        "downloaded), 1 otherwise; 2 for a bad command line, 3 for a bad configuration, "
        "130 when interrupted.",
    )
    convert.add_argument("pdfs", nargs="+", metavar="PDF", type=Path)
    convert.add_argument(
        "--pages",
        metavar="LIST",
        help="convert these pages again, e.g. 3,7-9 (pages already converted are kept "
        "otherwise)",
    )
    convert.add_argument(
        "--server-url",
        metavar="URL",
        type=_server_url,
        help="use this OpenAI-compatible server (e.g. http://127.0.0.1:8118/v1) "
        "instead of starting one",
    )

    status = sub.add_parser(
        "status",
        parents=[common],
        help="show the server and the queue",
        description="Server state, each document's state, pages done/total, "
        "rate, ETA and failures. Safe while the daemon runs. Lists the documents not done "
        "yet and the last 10 converted ones, unless --all. A document's ETA is when it "
        "should be done at the current rate, sharing the server with the documents "
        "converting and queued ahead of it.",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--all", action="store_true", help="every document ocrvl knows")

    retry = sub.add_parser(
        "retry",
        parents=[common],
        help="queue the daemon's failed documents again",
        description="Queue the daemon's documents again: the given PDFs (as given, or as "
        "`ocrvl status` shows them), and with --failed every failed one too. With --pages, "
        "redo only those pages; with --flagged, only the pages flagged suspect or bad (of "
        "the given PDFs, or of every document). The options combine. Queued documents are "
        "converted by the running daemon, or once it starts. (A file converted with `ocrvl "
        "convert` is redone with `ocrvl convert` again.)",
    )
    retry.add_argument("pdfs", nargs="*", metavar="PDF", type=Path)
    retry.add_argument("--failed", action="store_true", help="every failed document")
    retry.add_argument("--flagged", action="store_true",
                       help="redo the pages flagged suspect or bad (looping, cut off, empty, "
                       "garbage)")
    retry.add_argument(
        "--pages",
        metavar="LIST",
        help="only these pages, e.g. 3,7-9 (default: the pages that failed, not those "
        "damaged in the PDF; the whole document if none did)",
    )

    doctor = sub.add_parser(
        "doctor",
        parents=[common],
        help="check GPU, packages and settings",
        description="One screen of what works and what to fix: GPU, packages, the layout "
        "model (its engine, device and pages/s here), the server environment, config, "
        "inboxes, the server and systemd; with cluster.address, the Ray cluster's nodes (the "
        "same Ray, Python and ocrvl, engine slots) in place of the GPU and server checks. "
        "Exit code non-zero when something blocks conversion. Without a GPU it prints the "
        "`vllm serve` line to run on a machine that has one (server.mode: external).",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")

    install = sub.add_parser(
        "install-service",
        parents=[common],
        help="install and enable the systemd user unit",
        description="Write ~/.config/systemd/user/ocrvl.service running "
        "this ocrvl, then daemon-reload and enable it.",
    )
    install.add_argument("--dry-run", action="store_true", help="print, change nothing")
    install.add_argument("--force", action="store_true", help="replace a unit you edited")

    setup = sub.add_parser(
        "setup-server",
        parents=[common],
        help="create the vLLM server environment",
        description="Create a separate virtual environment with the vLLM release the project "
        f"measured ({vllm_release.PINNED}; flash-attn too for the genai_server launcher), prove "
        "that it imports, switch --venv to it (an existing one is replaced only then), and set "
        "server.python in the config file. Without an NVIDIA GPU here, or with a driver too "
        "old for that build, it installs nothing, exits with 6 and says what to do instead "
        "(on a machine without a GPU: how to run the server on one that has a GPU).",
    )
    setup.add_argument(
        "--venv",
        metavar="PATH",
        type=Path,
        default=Path("~/.local/share/ocrvl/server-venv"),
        help="where to create it (default: %(default)s)",
    )
    setup.add_argument("--vllm", metavar="VERSION", default=vllm_release.PINNED,
                       help="install this vLLM release instead (default: %(default)s, the one "
                       "the project measured)")
    setup.add_argument("--force", action="store_true",
                       help="install even without an NVIDIA GPU or with a driver too old for it")
    setup.add_argument("--dry-run", action="store_true", help="print the exact plan only")
    for command in sub.choices.values():
        # An unknown option is answered with the usage of the command it was given to.
        command.set_defaults(command_parser=command)
    return parser


def _server_url(value: str) -> str:
    """--server-url checked like server.url, so a bad one is a command-line error (exit 2)."""
    try:
        return openai_base_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ocrvl` command; returns the exit code."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    handler: Callable[[argparse.Namespace], int] = COMMANDS[args.command]
    try:
        return handler(args)
    except OcrvlError as exc:
        _setup_fallback_logging()
        log.error("%s", exc)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        _setup_fallback_logging()
        log.info("interrupted")
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        # The reader left early (`ocrvl status | head`): quietly, like any Unix tool. Python
        # would complain again while flushing stdout at exit, so stdout goes nowhere now.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(ExitCode.OUTPUT_CLOSED)


def _setup_fallback_logging() -> None:
    from ocrvl_daemon.observe.logs import basic_logging

    basic_logging(logging.INFO, "ocrvl: %(message)s")


def _load(
    args: argparse.Namespace, overrides: dict[str, Any] | None = None
) -> tuple[Config, Path | None]:
    return load_config(args.config, overrides)


def _logging(config: Config) -> None:
    from ocrvl_daemon.observe.logs import setup_logging

    setup_logging(config.log_level)


def cmd_run(args: argparse.Namespace) -> int:
    """`ocrvl run`."""
    from ocrvl_daemon.commands.run import Daemon

    config, path = _load(args)
    _logging(config)
    return int(Daemon(config, path).run())


def cmd_convert(args: argparse.Namespace) -> int:
    """`ocrvl convert`."""
    from ocrvl_daemon.commands.convert import convert_files

    # --server-url is the one endpoint: the config's managed or external servers step aside.
    overrides = (
        {"server.mode": "external", "server.url": args.server_url, "server.urls": None,
         "server.replicas": "auto", "server.gpus": "auto"} if args.server_url else None
    )
    config, _ = _load(args, overrides)
    _logging(config)
    # Advice written into notes must work when pasted: the same config and server.
    again = ["ocrvl", "convert"]
    if args.config:
        again += ["--config", str(Path(args.config).expanduser().absolute())]
    if args.server_url:
        again += ["--server-url", args.server_url]
    failures = convert_files(config, args.pdfs, pages=args.pages, again=shlex.join(again))
    return int(_conversion_exit_code(failures.values()))


def _conversion_exit_code(failures: Iterable[OcrvlError]) -> ExitCode:
    """0 when every file converted; the failures' own code when they share one cause (4 bad
    input files, 5 the model server, 6 something not installed: the server, a package, the
    layout model); else 1."""
    codes = {failure.exit_code for failure in failures}
    if not codes:
        return ExitCode.OK
    return codes.pop() if len(codes) == 1 else ExitCode.CONVERSION_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    """`ocrvl status`."""
    from ocrvl_daemon.commands.status import render_status

    config, path = _load(args)
    print(render_status(config, as_json=args.json, everything=args.all, config_path=path))
    return int(ExitCode.OK)


def cmd_retry(args: argparse.Namespace) -> int:
    """`ocrvl retry`."""
    from ocrvl_daemon.commands.retry import retry

    config, path = _load(args)
    _setup_fallback_logging()
    return int(retry(config, args.pdfs, failed=args.failed, pages=args.pages,
                     flagged=args.flagged, config_path=path))


def cmd_doctor(args: argparse.Namespace) -> int:
    """`ocrvl doctor`."""
    from ocrvl_daemon.commands.doctor import render_json, render_text, run_doctor

    report = run_doctor(args.config)
    print(render_json(report) if args.json else render_text(report))
    return int(ExitCode.PROBLEMS_FOUND if report.blocking else ExitCode.OK)


def cmd_install_service(args: argparse.Namespace) -> int:
    """`ocrvl install-service`."""
    from ocrvl_daemon.commands.install_service import install_service
    from ocrvl_daemon.config.file import resolve_config_path

    _setup_fallback_logging()
    _load(args)  # refuse to install a unit that would fail on an invalid config
    install_service(resolve_config_path(args.config), dry_run=args.dry_run, force=args.force)
    return int(ExitCode.OK)


def cmd_setup_server(args: argparse.Namespace) -> int:
    """`ocrvl setup-server`."""
    from ocrvl_daemon.commands.setup_server import setup_server

    _setup_fallback_logging()
    config, path = _load(args)
    return int(setup_server(config, path, args.venv.expanduser(), dry_run=args.dry_run,
                            vllm=args.vllm, force=args.force))


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "convert": cmd_convert,
    "status": cmd_status,
    "retry": cmd_retry,
    "doctor": cmd_doctor,
    "install-service": cmd_install_service,
    "setup-server": cmd_setup_server,
}


if __name__ == "__main__":
    sys.exit(main())
