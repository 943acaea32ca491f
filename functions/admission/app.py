"""Lambda entry point of the admission API (API Gateway HTTP API, payload format 2.0)."""

import gc

# INIT is mostly imports (Powertools, pydantic, pynamodb, botocore: some 580 modules), which allocate objects
# that live as long as the environment; the collector would run some 40 times over them while they load (a tenth
# of INIT), to free a few hundred objects in all. So it is off while they load, and they are then frozen (moved to
# the permanent generation, which no collection scans; those few hundred stay) before it is on again: the first
# request's collections, and every later one, scan only what requests allocate
# (https://docs.python.org/3/library/gc.html#gc.freeze).
gc.disable()
try:
    from typing import Any

    from aws_lambda_powertools.utilities.typing import LambdaContext

    from poimen import snapstart
    from poimen.api import admission_service, app, correlation_id, warm
    from poimen.observability import keep_libraries_at_warning, log_metrics, logger

    gc.freeze()
finally:
    # On again however the imports ended: a process that goes on after this module failed to load (a test's, a
    # local loader's; Lambda's runtime exits) would otherwise never collect a cycle again.
    gc.enable()

keep_libraries_at_warning()  # the function logs in Lambda's JSON format (template LoggingConfig)

# SnapStart: the snapshot carries validation already built; each restored environment builds its own
# DynamoDB client (connections, credentials) and grants cache on its first request.
snapstart.register(before_snapshot=warm, after_restore=admission_service.cache_clear)


# clear_state: the keys a request appends (poimen.api.create_run: its tenant and dispatch_key) end with it.
@logger.inject_lambda_context(clear_state=True)
@log_metrics
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    # The correlation id correlation_paths.API_GATEWAY_HTTP names, read without a JMESPath search per invocation.
    logger.set_correlation_id(correlation_id(event))
    return app.resolve(event, context)
