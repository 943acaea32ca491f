"""Lambda entry point of the outbox relay (DynamoDB stream of the admission table → poimen.<tenant>.events)."""

from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from poimen import snapstart
from poimen.observability import log_metrics, logger
from poimen.outbox import handle_batch, outbox_service

# SnapStart: each restored environment builds its own producer (connections, MSK IAM tokens) on its first batch.
snapstart.register(after_restore=outbox_service.cache_clear)


@logger.inject_lambda_context
@log_metrics
def lambda_handler(event: Mapping[str, Any], context: LambdaContext) -> None:
    handle_batch(event, context)
