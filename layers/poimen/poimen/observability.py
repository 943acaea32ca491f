"""Logger and metrics shared by every function; Powertools reads its own POWERTOOLS_* settings.

No Powertools Tracer: it imports the X-Ray SDK (~130 ms of cold start, see benchmarks/). Lambda's
tracing (each function's: AdmissionTracing, RelayTracing) still records the function's segments.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.metrics.functions import is_metrics_disabled

logger = Logger()
metrics = Metrics()

# Look-ups (GET) and refusals publish no metric, which is expected: Powertools' documented way to keep
# `log_metrics` from warning about it on each such invocation.
warnings.filterwarnings("ignore", message="No application metrics to publish", category=UserWarning)


def print_count(name: str, metadata: Mapping[str, Any]) -> None:
    """A Count of 1 named `name`, with `metadata`, printed now as the one EMF line `metrics` would print for it
    (Powertools' `serialize_metric_set`, its keys in its order, then `print(json.dumps(...))`), without its
    validation and debug records on every call: an admission's line (poimen.api). For a function that sets no
    dimensions but `service` and a metric set empty until then; otherwise the metric and metadata are added to
    `metrics`, for log_metrics to print. Nothing when metrics are disabled, as in Powertools.
    tests/unit/test_hot_path.py holds the line to Powertools' own.

    https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html
    """
    if is_metrics_disabled():
        return
    if not metrics.service or metrics.dimension_set or metrics.default_dimensions or metrics.metric_set:
        # Not the set-up this line reproduces (no service dimension, other dimensions, metrics added already):
        # Powertools' own, printed by log_metrics at the invocation's end.
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
        for key, value in metadata.items():
            metrics.add_metadata(key=key, value=value)
        return
    directive = {
        "Namespace": metrics.namespace,
        "Dimensions": [["service"]],
        "Metrics": [{"Name": name, "Unit": "Count"}],
    }
    line = {
        "_aws": {"Timestamp": int(time.time() * 1000), "CloudWatchMetrics": [directive]},
        "service": metrics.service,
        **metadata,
        name: [1.0],
    }
    print(json.dumps(line, separators=(",", ":")))


def keep_libraries_at_warning() -> None:
    """For a function with a JSON LogFormat (the admission function's), whose runtime sets the root logger to the
    ApplicationLogLevel, INFO, which would let libraries' INFO records (botocore's "Found credentials ...") into
    the log group: they stay at WARNING, as under the text format. The Logger keeps its own level
    (POWERTOOLS_LOG_LEVEL). Called by that function's entry point, not on import: a process that imports the
    layer (`poimen dev --debug`, which runs the relay in-process) keeps its own logging."""
    logging.getLogger().setLevel(logging.WARNING)
