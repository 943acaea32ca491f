"""What the soaks (soak.py, history.py) share around a run: SIGTERM taken as Ctrl-C, fake credentials for
the local moto, a work folder kept unless the run held, and their exit codes: 0 it held, 1 it did not, 2 it
could not be made (the one-line cause printed), 130 interrupted (every process it started is stopped)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_in_work_folder(
    name: str,
    run: Callable[[Path], int],
    *,
    cannot_run: tuple[type[Exception], ...],
    cause: str,
    kept: str,
    keep: bool,
) -> int:
    """`run(folder)`'s exit code; `cannot_run` errors are 2, printed after `cause`; the folder is removed
    after a 0 (unless `keep`), else its path printed after `kept`."""
    signal.signal(signal.SIGTERM, _interrupt)
    # moto takes any credentials; none of this reaches an AWS account.
    os.environ.update({"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak", "AWS_DEFAULT_REGION": "us-east-1"})
    os.environ.pop("AWS_SESSION_TOKEN", None)
    folder = Path(tempfile.mkdtemp(prefix=f"poimen-{name}-"))
    code = 2
    try:
        code = run(folder)
    except cannot_run as error:
        print(f"{name}: {cause}: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; every process it started is stopped", file=sys.stderr)
        code = 130
    finally:
        if code == 0 and not keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"{kept}: {folder}", file=sys.stderr)
    return code
