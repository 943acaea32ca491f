"""The HTTP contract of POST /v1/runs: request and response bodies, limits and header names.

Everything that speaks to the API (the handler, the relay, publishers) shares these definitions;
this module depends on nothing else in the package.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TENANT_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
# 1-255 characters, none of them a C0/C1 control character or DEL.
DISPATCH_KEY_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]{1,255}$"
MAX_BODY_BYTES = 256 * 1024
# Run ids are UUIDs (v8 when derived from a dispatch_key, v7 otherwise), lower-case as the API writes them.
RUN_ID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"

TENANT_HEADER = "X-Poimen-Tenant"
REPLAYED_HEADER = "Idempotent-Replayed"

TenantId = Annotated[str, Field(pattern=TENANT_PATTERN, description="Tenant id; part of Kafka topic names")]
DispatchKey = Annotated[
    str,
    Field(
        min_length=1,
        max_length=255,
        pattern=DISPATCH_KEY_PATTERN,
        description="Caller-chosen, opaque; repeats of a key admit the first run again",
    ),
]
WorkflowRef = Annotated[str, Field(min_length=1, max_length=256)]
GoalId = Annotated[str, Field(min_length=1, max_length=256)]


class RunRequest(BaseModel):
    """Body of POST /v1/runs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    workflow_ref: WorkflowRef
    input: dict[str, Any]
    goal_id: GoalId | None = None
    dispatch_key: DispatchKey | None = None


class Run(BaseModel):
    """A run as the API returns it; a replayed admission returns the first answer unchanged."""

    run_id: str
    tenant_id: str
    workflow_ref: str
    input: dict[str, Any]
    goal_id: str | None
    dispatch_key: str | None
    status: Literal["admitted"]
    created_at: str = Field(description="RFC 3339 UTC timestamp of the first admission")


class Problem(BaseModel):
    """RFC 9457 problem details; extension members (`errors`, `run_id`) ride along."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
