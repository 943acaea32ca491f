"""Lambda entry point of the inbox relay (MSK event source mapping on poimen.<tenant>.dispatch topics)."""

from aws_lambda_powertools.utilities.data_classes import KafkaEvent, event_source
from aws_lambda_powertools.utilities.typing import LambdaContext

from poimen import snapstart
from poimen.observability import log_metrics, logger
from poimen.relay import handle_batch, relay_service

# SnapStart: each restored environment builds its own HTTP pool, SQS client and credentials on its first batch.
snapstart.register(after_restore=relay_service.cache_clear)


@logger.inject_lambda_context
@log_metrics
@event_source(data_class=KafkaEvent)
def lambda_handler(event: KafkaEvent, context: LambdaContext) -> None:
    handle_batch(event, context)
