"""Logger and metrics shared by every function; Powertools reads its own POWERTOOLS_* settings.

No Powertools Tracer: it imports the X-Ray SDK (~130 ms of cold start, see benchmarks/). Lambda's
tracing (each function's: AdmissionTracing, RelayTracing) still records the function's segments.
"""

from __future__ import annotations

import logging
import warnings

from aws_lambda_powertools import Logger, Metrics

logger = Logger()
metrics = Metrics()

# Look-ups (GET) and refusals publish no metric, which is expected: Powertools' documented way to keep
# `log_metrics` from warning about it on each such invocation.
warnings.filterwarnings("ignore", message="No application metrics to publish", category=UserWarning)


def keep_libraries_at_warning() -> None:
    """For a function with a JSON LogFormat (the admission function's), whose runtime sets the root logger to the
    ApplicationLogLevel, INFO, which would let libraries' INFO records (botocore's "Found credentials ...") into
    the log group: they stay at WARNING, as under the text format. The Logger keeps its own level
    (POWERTOOLS_LOG_LEVEL). Called by that function's entry point, not on import: a process that imports the
    layer (`poimen dev --debug`, which runs the relay in-process) keeps its own logging."""
    logging.getLogger().setLevel(logging.WARNING)
