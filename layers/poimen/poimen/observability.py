"""Logger and metrics shared by every function; Powertools reads its own POWERTOOLS_* settings.

No Powertools Tracer: it imports the X-Ray SDK (~130 ms of cold start, see benchmarks/). Lambda's
tracing (each function's: AdmissionTracing, RelayTracing) still records the function's segments.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.metrics.functions import is_metrics_disabled

logger = Logger()
metrics = Metrics()

Event = TypeVar("Event")
Result = TypeVar("Result")
# Built once: json.dumps with arguments other than its defaults builds an encoder on every call.
_emf_json = json.JSONEncoder(separators=(",", ":")).encode


def log_metrics(handler: Callable[[Event, Any], Result]) -> Callable[[Event, Any], Result]:
    """`metrics.log_metrics` for a function's entry point: the metrics the invocation added printed at its end as
    Powertools prints them (`flush_metrics`), then whatever it left in `metrics` cleared, printed or not, so that
    nothing of one invocation is in the next one's line. Powertools clears only a set it printed: metadata added
    without a metric (a batch's whose spawns were all refused), or all of it when metrics are disabled (until a
    metric's 100th value, which it then prints), would be carried into another request's line. An invocation that
    adds no metric prints none, and is not warned about (Powertools warns each time: look-ups, most refusals and
    an admission, whose line is printed directly, add none)."""

    @functools.wraps(handler)
    def invoked(event: Event, context: Any) -> Result:
        try:
            return handler(event, context)
        finally:
            if metrics.metric_set:
                metrics.flush_metrics()
            metrics.clear_metrics()

    return invoked


@functools.cache
def metrics_disabled() -> bool:
    """Powertools' `is_metrics_disabled`, read from the environment once per process (on the first line printed)
    rather than three environment reads a line: a function's variables are part of its version's configuration,
    fixed for an execution environment (https://docs.aws.amazon.com/lambda/latest/dg/configuration-envvars.html)."""
    return is_metrics_disabled()


def add_count(name: str, value: int = 1) -> None:
    """A Count added to `metrics`, for log_metrics to print at the invocation's end; none when metrics are
    disabled. Powertools' add_metric prints the set at a metric's 100th value whether or not they are, and one
    invocation can get there: a batch's 100 spawns each refused (DispatchKeyConflicts, StoreUnavailable)."""
    if not metrics_disabled():
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=value)


def print_count(name: str, metadata: Mapping[str, Any]) -> None:
    """A Count of 1 named `name`, with `metadata` (keys other than `_aws`), printed now as the one EMF line
    `metrics` would print for it (Powertools' `serialize_metric_set`, its keys in its order, then
    `print(json.dumps(...))`), without its validation and debug records on every call: an admission's line
    (poimen.api). For a function that sets no dimensions but `service` and a metric set empty until then; otherwise
    the metric and metadata are added to `metrics`, for log_metrics to print. Nothing when metrics are disabled,
    as in Powertools.
    tests/unit/test_hot_path.py holds the line to Powertools' own.

    https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html
    """
    if metrics_disabled():
        return
    if not metrics.service or metrics.dimension_set or metrics.default_dimensions or metrics.metric_set:
        # Not the set-up this line reproduces (no service dimension, other dimensions, metrics added already):
        # Powertools' own, printed by log_metrics at the invocation's end.
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
        for key, value in metadata.items():
            metrics.add_metadata(key=key, value=value)
        return
    # The line json.dumps writes for {"_aws": {"Timestamp": ..., "CloudWatchMetrics": [directive]}, "service": ...,
    # **metadata, name: [1.0]}, its directive's text written once a metric.
    rest = _emf_json({"service": metrics.service, **metadata, name: [1.0]})
    directive = _directive(metrics.namespace, name)
    print(f'{{"_aws":{{"Timestamp":{int(time.time() * 1000)},"CloudWatchMetrics":[{directive}]}},{rest[1:]}')


@functools.lru_cache(maxsize=16)
def _directive(namespace: str | None, name: str) -> str:
    """The CloudWatchMetrics directive of `print_count`'s line, as Powertools' `serialize_metric_set` has it."""
    metric = {"Name": name, "Unit": "Count"}
    return _emf_json({"Namespace": namespace, "Dimensions": [["service"]], "Metrics": [metric]})


def keep_libraries_at_warning() -> None:
    """For a function with a JSON LogFormat (the admission function's), whose runtime sets the root logger to the
    ApplicationLogLevel, INFO, which would let libraries' INFO records (botocore's "Found credentials ...") into
    the log group: they stay at WARNING, as under the text format. The Logger keeps its own level
    (POWERTOOLS_LOG_LEVEL). Called by that function's entry point, not on import: a process that imports the
    layer (`poimen dev --debug`, which runs the relay in-process) keeps its own logging."""
    logging.getLogger().setLevel(logging.WARNING)
