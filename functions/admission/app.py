"""Lambda entry point of the admission API (API Gateway HTTP API, payload format 2.0)."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from poimen import snapstart
from poimen.api import admission_service, app, correlation_id, warm
from poimen.observability import keep_libraries_at_warning, logger, metrics

keep_libraries_at_warning()  # the function logs in Lambda's JSON format (template LoggingConfig)

# SnapStart: the snapshot carries validation already built; each restored environment builds its own
# DynamoDB client (connections, credentials) and grants cache on its first request.
snapstart.register(before_snapshot=warm, after_restore=admission_service.cache_clear)


# clear_state: the keys a request appends (poimen.api.create_run: its tenant and dispatch_key) end with it.
@logger.inject_lambda_context(clear_state=True)
@metrics.log_metrics
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    # The correlation id correlation_paths.API_GATEWAY_HTTP names, read without a JMESPath search per invocation.
    logger.set_correlation_id(correlation_id(event))
    return app.resolve(event, context)
