"""The nemesis of a history: faults while the clients run, in cycles until it is stopped. A cycle is random
DynamoDB faults at the proxy (every kind of tests/integration/dynamodb_proxy.Fault) with, in its middle
(every `kill_every` cycles), `kill -9` of `poimen dev`'s whole process group and its restart on the same
port and table; a calm; the proxy refusing connections for a while; a calm. Each step is an event of the
history."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from tests.history.history import History
from tests.history.stack import Stack
from tests.integration.dynamodb_proxy import Chaos


@dataclass(frozen=True)
class Plan:
    chaos_rate: float = 0.2  # the share of run calls given a fault while chaos is on
    chaos_seconds: float = 12.0
    refuse_seconds: float = 2.0
    calm_seconds: float = 3.0
    kill_every: int = 1  # cycles; the first cycle always kills


class Nemesis(threading.Thread):
    def __init__(self, stack: Stack, history: History, rng: random.Random, plan: Plan) -> None:
        super().__init__(name="history-nemesis", daemon=True)
        self._stack = stack
        self._history = history
        self._rng = rng
        self._plan = plan
        self._stopping = threading.Event()
        self.kills = 0
        self.cycles = 0
        self.failure: BaseException | None = None

    def stop(self) -> None:
        """End after the step under way (a restart is finished), the proxy back to no faults."""
        self._stopping.set()
        self.join()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._cycle()
        except BaseException as error:  # poimen dev did not restart, say: the runner reports it
            self.failure = error
        finally:
            self._stack.proxy.chaos = None

    def _cycle(self) -> None:
        plan, proxy, pause = self._plan, self._stack.proxy, self._stopping.wait
        with self._history.event("dynamodb faults", f"{plan.chaos_rate:.0%} of run calls"):
            proxy.chaos = Chaos(plan.chaos_rate, self._rng)
            if not pause(plan.chaos_seconds / 2) and self.cycles % plan.kill_every == 0:
                self._kill_and_restart()
            pause(plan.chaos_seconds / 2)
            proxy.chaos = None
        if pause(plan.calm_seconds):
            return
        with self._history.event("connections refused"):
            proxy.refuse()
            try:
                pause(plan.refuse_seconds)
            finally:
                proxy.accept()
        pause(plan.calm_seconds)
        self.cycles += 1

    def _kill_and_restart(self) -> None:
        with self._history.event("kill -9 poimen dev") as event:
            event.detail = f"{self._stack.dev.kill()} processes of its group"
        self.kills += 1
        with self._history.event("poimen dev restarting"):
            self._stack.dev.start()
