"""The cold-start floor: botocore, one DynamoDB client made at INIT, one PutItem per invocation."""

import os
from typing import Any

import botocore.session

_table = os.environ["TABLE_NAME"]
_dynamodb: Any = botocore.session.get_session().create_client("dynamodb")


def lambda_handler(event: dict[str, Any], context: Any) -> dict[str, int]:
    _dynamodb.put_item(TableName=_table, Item={"pk": {"S": f"floor#{context.aws_request_id}"}})
    return {"statusCode": 200}
