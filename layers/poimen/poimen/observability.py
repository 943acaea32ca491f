"""Logger and metrics shared by every function; Powertools reads its own POWERTOOLS_* settings.

No Powertools Tracer: it imports the X-Ray SDK (~130 ms of cold start, see benchmarks/). Lambda's
active tracing (template Globals) still records the function and API Gateway segments.
"""

from __future__ import annotations

import warnings

from aws_lambda_powertools import Logger, Metrics

logger = Logger()
metrics = Metrics()

# Look-ups (GET) and refusals publish no metric, which is expected: Powertools' documented way to keep
# `log_metrics` from warning about it on each such invocation.
warnings.filterwarnings("ignore", message="No application metrics to publish", category=UserWarning)
