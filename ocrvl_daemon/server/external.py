"""Watching an external server (`server.mode: external`): readiness and health by probing
`server.url`; ocrvl starts, stops and restarts nothing."""

from __future__ import annotations

import logging

from ocrvl_daemon.errors import ServerConfigError
from ocrvl_daemon.server.probe import ENDPOINT_ABSENT, ServerProbe
from ocrvl_daemon.server.supervisor import (
    STARTUP_POLL,
    UNHEALTHY_PROBES,
    ServerState,
    ServerSupervisor,
)

log = logging.getLogger(__name__)


class ExternalServer(ServerSupervisor):
    """Follows an external server's readiness; a hang is reported, not repaired."""

    # Not "starting": ocrvl starts nothing; it waits for the server at the URL to answer.
    _waiting_state = ServerState.UNREACHABLE

    def _first_phase(self) -> str:
        return ""  # what there is to say is the URL, which is shown with the state

    def note_unreachable(self, reason: str) -> None:
        """A request found no server: it is down from now, not after UNHEALTHY_PROBES probes
        (status would say ready meanwhile); the probes find it up again."""
        with self._cond:
            if self._state is not ServerState.READY:
                return
            self._last_error = reason
        self._set(ServerState.UNREACHABLE, self._first_phase())

    def _refused(self, exc: ServerConfigError) -> None:
        """The server answers but cannot serve this configuration (another model name,
        another API key). FAILED, said once; probing goes on, so fixing the server is
        enough (ocrvl need not be restarted)."""
        with self._cond:
            repeated = self._error is not None and str(self._error) == str(exc)
            self._error = exc
            self._last_error = str(exc)
        if not repeated:
            log.error("%s (checking again every %g s)", exc, self._server.health_interval)
        self._set(ServerState.FAILED, "")

    def _keep(self, probe: ServerProbe) -> None:
        """No process: readiness and health by probing `server.url`."""
        failed_probes = 0
        stall_reported = False
        first = True  # a server that is already up is seen at once, not a poll later
        while True:
            ready = self._state is ServerState.READY
            if not first:
                self._wait(self._server.health_interval if ready or self._error else
                           min(STARTUP_POLL, self._server.health_interval))
            first = False
            status = probe.health()
            try:
                # Not every OpenAI-compatible server has vLLM's /health: /v1/models decides.
                up = (status == 200 and (ready or probe.serves_model())) or (
                    status in ENDPOINT_ABSENT and probe.serves_model())
            except ServerConfigError as exc:
                self._refused(exc)
                continue
            if up:
                failed_probes = 0
                if not ready:
                    with self._cond:
                        self._error = None
                    log.info("external server ready at %s", self._server.base_url)
                    self._set(ServerState.READY, "ready")
                hung = self._check_stall()
                if hung and not stall_reported:
                    log.error("external server at %s is %s; ocrvl cannot restart it: restart "
                              "it yourself", self._server.base_url, hung)
                stall_reported = bool(hung)
                continue
            failed_probes += 1
            if ready and (status == 503 or failed_probes >= UNHEALTHY_PROBES):
                with self._cond:
                    self._last_error = (f"/health answered {status}" if status else
                                        probe.last_error)
                log.warning("external server at %s is down (%s); waiting for it",
                            self._server.base_url, self._last_error)
                self._set(ServerState.UNREACHABLE, self._first_phase())
