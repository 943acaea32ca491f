"""Logger and metrics shared by every function; Powertools reads its own POWERTOOLS_* settings.

No Powertools Tracer: it imports the X-Ray SDK (~130 ms of cold start, see benchmarks/). Lambda's
active tracing (template Globals) still records the function and API Gateway segments.
"""

from __future__ import annotations

from aws_lambda_powertools import Logger, Metrics

logger = Logger()
metrics = Metrics()
