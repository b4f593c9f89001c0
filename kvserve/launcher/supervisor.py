"""Keeping a local cluster serving: restart what dies, with exponential backoff, and give up only when the
cluster cannot keep a minimum running.

The life of one supervised process (a worker, the router, or the embedded Redis)::

    UP --dies--> WAITING --backoff passed--> STARTING --answers its health check--> UP
                                             STARTING --dies, or no answer in time--> WAITING (a start failure)
                 more than ``max_start_failures`` start failures in a row --> ABANDONED

The backoff doubles with every death (0.5 s, 1 s, 2 s, ... up to 30 s) and starts over once the process
has stayed up for ``stable_after_s``. The cluster fails (``ClusterFailed``) when the router or Redis is
abandoned, or every decode worker is; an abandoned prefill worker only costs speed (decode workers then
prefill locally).

Every death and restart is logged with the exit code or signal, and the seconds from the death until the
process answered again. A process counts as answering only when the answer comes from it, not from another
process on its port (see ``processes.Child``); a death while another process holds the port is logged as
such, since every restart then fails with "Address already in use". What a dead process leaves behind (a
decode worker's shared-memory pool file) is removed as soon as its death is noticed.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rpc import tracing

log = logging.getLogger(__name__)


class ClusterFailed(RuntimeError):
    """The cluster can no longer keep its minimum running (router, Redis and at least one decode worker)."""


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0  # up this long: the next death is treated as the first
    max_start_failures: int = 5  # deaths in a row before ever answering: the process is abandoned
    startup_timeout_s: float = 180.0  # a restarted process that does not answer by then is killed
    tick_s: float = 0.2

    def delay_s(self, deaths_in_a_row: int) -> float:
        return min(self.max_delay_s, self.initial_delay_s * 2 ** max(0, deaths_in_a_row - 1))


class Supervised(Protocol):
    """What the supervisor needs of a process: see ``processes.Child`` and ``processes.RedisChild``. It imports
    nothing of ours: the units bring everything that knows about workers, ports and pool files."""

    name: str
    role: str

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def exit_status(self) -> str | None:
        """``None`` while the process runs, else how it ended ("exited with code 1", "killed by SIGKILL")."""

    def answers(self) -> bool:
        """Whether the process serves (a health check with a short timeout that this very process answers)."""

    def port_taken(self) -> bool:
        """Whether, now that the process is dead, something else listens on its port."""

    def remove_leftovers(self) -> None:
        """Called once per death, before any restart: remove what the dead process left behind."""

    def kill(self) -> None: ...


class State(enum.Enum):
    UP = "up"
    WAITING = "waiting"
    STARTING = "starting"
    ABANDONED = "abandoned"


@dataclass
class _Track:
    """One process's restart bookkeeping. ``since`` is when the current state began."""

    state: State
    since: float
    deaths_in_a_row: int = 0
    start_failures_in_a_row: int = 0
    died_at: float = 0.0
    restart_at: float = 0.0


class Supervisor:
    """Watches started processes (``units``, each up when given, names unique) and restarts them (one thread;
    see ``run``). The roles decide the minimum: ``router`` and ``redis`` units are essential, and so is at
    least one ``decode`` unit when there are any.

    Linux delivers a child's parent-death signal when the *thread* that started it exits, so the thread
    running ``run`` must outlive the processes it restarts: ``Cluster.stop`` ends them right after ``run``
    returns (the command line runs both on the main thread).
    """

    def __init__(self, units: Sequence[Supervised], policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.units = list(units)
        now = time.monotonic()
        self._tracks = {unit.name: _Track(State.UP, now) for unit in self.units}

    def state(self, name: str) -> State:
        return self._tracks[name].state

    def run(self, stop: threading.Event) -> None:
        """Supervise until ``stop`` is set; raises ``ClusterFailed`` when the minimum cannot be kept."""
        while not stop.wait(self.policy.tick_s):
            for unit in self.units:
                self._step(unit, self._tracks[unit.name], time.monotonic())
            self._check_minimum()

    def _step(self, unit: Supervised, track: _Track, now: float) -> None:
        if track.state in (State.UP, State.STARTING):
            status = unit.exit_status()
            if status is not None:
                self._on_death(unit, track, status, now)
            elif track.state is State.STARTING:
                self._check_started(unit, track, now)
            elif track.deaths_in_a_row and now - track.since >= self.policy.stable_after_s:
                track.deaths_in_a_row = 0
        elif track.state is State.WAITING and now >= track.restart_at:
            log.info("restarting %s %s (attempt %d)", unit.role, unit.name, track.start_failures_in_a_row + 1)
            track.state, track.since = State.STARTING, now
            unit.start()

    def _check_started(self, unit: Supervised, track: _Track, now: float) -> None:
        if unit.answers():
            track.state, track.since, track.start_failures_in_a_row = State.UP, now, 0
            log.info("%s %s (pid %s) serves again, %.1f s after it died", unit.role, unit.name, unit.pid,
                     now - track.died_at)  # fmt: skip
            with tracing.start("launcher.restart", role=unit.role, name=unit.name, pid=unit.pid) as span:
                span.event("serving", down_s=now - track.died_at)
        elif now - track.since > self.policy.startup_timeout_s:
            log.warning("%s %s (pid %s) did not answer within %.0f s of its start; killing it", unit.role,
                        unit.name, unit.pid, self.policy.startup_timeout_s)  # fmt: skip
            unit.kill()

    def _on_death(self, unit: Supervised, track: _Track, status: str, now: float) -> None:
        pid = unit.pid
        unit.remove_leftovers()
        if unit.port_taken():
            status += "; another process holds its port (Address already in use), so it cannot serve there"
        if track.state is State.STARTING:
            track.start_failures_in_a_row += 1
        else:
            track.died_at = now
        track.deaths_in_a_row += 1
        if track.start_failures_in_a_row > self.policy.max_start_failures:
            track.state, track.since = State.ABANDONED, now
            log.error("%s %s (pid %s) %s; giving up on it after %d failed starts in a row", unit.role, unit.name,
                      pid, status, track.start_failures_in_a_row)  # fmt: skip
            return
        delay = self.policy.delay_s(track.deaths_in_a_row)
        with tracing.start("launcher.death", role=unit.role, name=unit.name, pid=pid) as span:
            span.event("died", status=status, restart_in_s=delay, deaths_in_a_row=track.deaths_in_a_row)
        track.state, track.since, track.restart_at = State.WAITING, now, now + delay
        log.warning("%s %s (pid %s) %s; restarting it in %.1f s", unit.role, unit.name, pid, status, delay)

    def _check_minimum(self) -> None:
        abandoned = {unit.name for unit in self.units if self._tracks[unit.name].state is State.ABANDONED}
        if not abandoned:
            return
        essential = [unit.name for unit in self.units if unit.role in ("router", "redis") and unit.name in abandoned]
        decode = [unit.name for unit in self.units if unit.role == "decode"]
        if essential:
            raise ClusterFailed(f"{', '.join(essential)} cannot be kept running; see the log above")
        if decode and all(name in abandoned for name in decode):
            raise ClusterFailed("no decode worker can be kept running; see the log above")
