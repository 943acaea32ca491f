"""Domain exceptions raised by admission and the store; the API maps each to one problem type."""

from __future__ import annotations


class AdmissionError(Exception):
    """Base of every error the admission rules raise on purpose."""


class IdentityMissing(AdmissionError):
    """The request carries no authenticated principal."""


class TenantNotGranted(AdmissionError):
    def __init__(self, principal: str, tenant_id: str) -> None:
        super().__init__(f"{principal} is not granted tenant {tenant_id}")
        self.principal = principal
        self.tenant_id = tenant_id


class TenantNotServed(AdmissionError):
    """The stack does not serve this tenant (it is not in its Tenants): its runs could have no events, and
    no grant changes that; only a deploy with the tenant does."""

    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"this stack does not serve tenant {tenant_id}")
        self.tenant_id = tenant_id


class RunNotFound(AdmissionError):
    """No such run for this tenant; said the same way whether or not another tenant has it."""


class DispatchKeyReused(AdmissionError):
    """The dispatch_key already admitted a run that asked for something else."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"dispatch_key already admitted run {run_id} with a different request")
        self.run_id = run_id


class StoreUnavailable(AdmissionError):
    """DynamoDB throttled or failed after the bounded retries, nothing written; the caller should retry later.
    `throttled`: DynamoDB throttled it (the API asks its caller to slow down), rather than failed."""

    def __init__(self, reason: str, retry_after_seconds: int = 1, *, throttled: bool = False) -> None:
        super().__init__(reason)
        self.retry_after_seconds = retry_after_seconds
        self.throttled = throttled


class RunTooLarge(AdmissionError):
    """The run's item would exceed DynamoDB's item size limit; refused before any write."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the run's item would be {size} bytes, over the {limit}-byte limit")
        self.size = size
        self.limit = limit


class RunNotStorable(AdmissionError):
    """DynamoDB refused the run's item as invalid (ValidationException): the request cannot be stored."""


class OutcomeUnknown(AdmissionError):
    """The run's write was sent, and whether it committed could not be told (its answer was lost, or a
    5xx, and the store could not be asked after). `run_id` names the run it would be: GET it to find out.
    `keyed`: the request carried a dispatch_key, so sending it again is safe (it can only admit that run)."""

    def __init__(self, run_id: str, reason: str, *, keyed: bool, retry_after_seconds: int = 1) -> None:
        super().__init__(f"the write of run {run_id} may have committed: {reason}")
        self.run_id = run_id
        self.keyed = keyed
        self.retry_after_seconds = retry_after_seconds
