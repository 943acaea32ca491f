"""Process groups on Linux: who is in one (from /proc), killing all of it with SIGKILL as a crash would, and a
process started in a session of its own whose group can be killed or stopped.

The fault soaks (benchmarks/soak.py, the API history of tests/history) start `poimen dev` in a session of its
own and kill its whole group mid-run: the front process and its execution environments die at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def process_group(pgid: int) -> list[int]:
    """The live processes of a process group (Linux /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses, so split after the last ')'
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGKILL every process of the group and wait (bounded) until none is left."""
    deadline = time.monotonic() + timeout
    while process_group(pgid) and time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.1)


class SessionProcess:
    """A process its owner starts in a session of its own (`start_new_session=True`), as `process`: its whole
    group can be killed at once, as a crash would end it, or stopped as a person stops it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def kill(self) -> int:
        """SIGKILL the whole process group; how many processes died."""
        assert self.process is not None
        members = len(process_group(self.process.pid))
        kill_group(self.process.pid)
        self.process.wait()
        return members

    def stop(self) -> None:
        """Ctrl-C as a person would stop it, then SIGKILL whatever of its group is left."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        kill_group(process.pid)
        process.wait()
