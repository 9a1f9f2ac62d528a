"""One exception hierarchy; `cli` maps it to exit codes, nothing else does.

Every message says what went wrong and names the fix, because the user reading it is usually
looking at `journalctl` with no other context.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes of the `ocrvl` command."""

    OK = 0
    CONVERSION_FAILED = 1  # at least one document did not convert
    USAGE = 2  # bad command line (argparse's own code)
    CONFIG = 3
    INPUT_FILE = 4
    SERVER = 5
    DEPENDENCY = 6  # a package, the model server or the layout model is not installed
    PROBLEMS_FOUND = 7  # `ocrvl doctor` found something that blocks conversion
    INTERRUPTED = 130
    OUTPUT_CLOSED = 141  # the reader of stdout left early, as after SIGPIPE (128 + 13)


class OcrvlError(Exception):
    """Base of every error ocrvl reports to the user.

    `permanent` errors are not retried until the input changes or the user asks;
    the others are retried with backoff.
    """

    exit_code: ExitCode = ExitCode.CONVERSION_FAILED
    permanent: bool = False

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} Fix: {self.fix}" if self.fix else self.message


class UsageError(OcrvlError):
    """The command line asks for something that cannot be done; nothing was changed."""

    exit_code = ExitCode.USAGE
    permanent = True


class ConfigError(OcrvlError):
    """The configuration is invalid; nothing was started."""

    exit_code = ExitCode.CONFIG
    permanent = True

    @property
    def problems(self) -> tuple[ConfigError, ...]:
        """Each problem on its own (this one alone, unless it gathers several)."""
        return (self,)


class ConfigProblemsError(ConfigError):
    """Several config problems, reported at once so that one edit can fix them all."""

    def __init__(self, problems: list[ConfigError], where: str) -> None:
        lines = "".join(f"\n  - {problem}" for problem in problems)
        super().__init__(f"{len(problems)} problems in the config{where}:{lines}")
        self._problems = tuple(problems)

    @property
    def problems(self) -> tuple[ConfigError, ...]:
        """Each problem on its own."""
        return self._problems


class UnsetVariableError(ConfigError, ValueError):
    """A config value names an environment variable that is not set.

    A ValueError too, so that a config validator raising it reports the key it is under.
    """

    def __init__(self, name: str) -> None:
        super().__init__(
            f"${name} is not set in the environment",
            f"set {name} where ocrvl runs (for the service: `systemctl --user "
            f"set-environment {name}=...`, then restart it), or write the value out in the "
            "config file",
        )
        self.name = name


class AlreadyRunningError(ConfigError):
    """Another `ocrvl run` already uses this state_dir; this one did not start."""


class StateFullError(OcrvlError):
    """The disk holding state_dir is full: nothing can be checkpointed until space returns."""


class InputFileError(OcrvlError):
    """The input document cannot be converted as it is (not a PDF, encrypted, empty...)."""

    exit_code = ExitCode.INPUT_FILE
    permanent = True


class EncryptedPdfError(InputFileError):
    """The input is a whole PDF, but locked with a password."""


class InputVanishedError(OcrvlError):
    """The input document disappeared or changed while it was being read."""

    exit_code = ExitCode.INPUT_FILE


class OutputError(OcrvlError):
    """The Markdown could not be written (disk full, read-only folder...)."""


class NotOursError(OutputError):
    """A Markdown file ocrvl did not write stands where the output would go."""

    permanent = True


class NameTooLongError(OutputError):
    """The PDF's name leaves no room for `.md` within the filesystem's limit on a name."""

    permanent = True


class ServerError(OcrvlError):
    """The model server is unreachable, not ready, or failed a request."""

    exit_code = ExitCode.SERVER


class ClusterError(ServerError):
    """The Ray cluster (cluster.address) cannot be reached or used: no engine host runs."""


class ServerConfigError(ServerError):
    """The server runs but cannot serve this configuration (e.g. another model name)."""

    permanent = True


class PageError(OcrvlError):
    """One page could not be recognised."""


class PageDamagedError(PageError):
    """A page of the PDF itself cannot be rendered; trying it again cannot help."""

    permanent = True


class PagesFailedError(PageError):
    """A page failed every attempt and `pipeline.fail_on_page_error` is set."""

    permanent = True


class UnitEditedError(OutputError):
    """A unit file ocrvl did not write (or one edited since) stands where the unit goes."""

    permanent = True


class DependencyError(OcrvlError):
    """A package or program ocrvl needs is missing."""

    exit_code = ExitCode.DEPENDENCY
    permanent = True


class ServerMissingError(ServerConfigError, DependencyError):
    """The model server's program or environment is not installed."""

    exit_code = ExitCode.DEPENDENCY


class ModelDownloadError(DependencyError):
    """A model the pipeline needs here (the layout model) is not downloaded and cannot be."""


class ServiceManagerError(DependencyError):
    """`systemctl --user` is missing or cannot reach a user service manager."""
