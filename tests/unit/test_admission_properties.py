"""Property: under any interleaving of keyed and unkeyed spawns, duplicates sent concurrently, the runs
in the table are the distinct (tenant, dispatch_key) pairs plus one per unkeyed request."""

from __future__ import annotations

import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poimen.admission import Admission
from poimen.contract import RunRequest
from poimen.ids import keyed_run_id
from poimen.store import Store
from tests.conftest import count_runs

PRINCIPAL = "arn:aws:iam::1:role/property"
spawns = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),  # tenant
        st.one_of(st.none(), st.sampled_from(["k1", "k2", "k3", "#", "ключ"])),  # dispatch_key
        st.integers(min_value=1, max_value=4),  # copies sent at once
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=spawns, seed=st.integers(min_value=0, max_value=2**16))
def test_runs_are_distinct_keys_plus_unkeyed_requests(
    store: Store, dynamodb: Any, table_name: str, plan: list[tuple[str, str | None, int]], seed: int
) -> None:
    # Given tenants of this example only, granted to one principal
    prefix = uuid.uuid4().hex[:8]
    tenants = {name: f"p{prefix}-{name}" for name in ("a", "b")}
    admission = Admission(store, grants_cache_seconds=600)
    store.grant(PRINCIPAL, "*")
    calls = [
        (tenants[tenant], RunRequest(workflow_ref=f"wf/{key}", input={"key": key}, dispatch_key=key))
        for tenant, key, copies in plan
        for _ in range(copies)
    ]
    random.Random(seed).shuffle(calls)
    # When every request is sent at once
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda call: (call, admission.admit_run(PRINCIPAL, *call)), calls))
    # Then the table holds one run per distinct key plus one per unkeyed request
    keyed = {(tenants[t], k) for t, k, _ in plan if k is not None}
    unkeyed = sum(copies for _, k, copies in plan if k is None)
    runs = sum(len(count_runs(dynamodb, table_name, tenant)) for tenant in tenants.values())
    assert runs == len(keyed) + unkeyed
    # And every answer for a key carries that key's run, exactly one of them fresh
    for tenant, key in keyed:
        for_key = [admitted for (t, request), admitted in answers if (t, request.dispatch_key) == (tenant, key)]
        assert {admitted.run.run_id for admitted in for_key} == {keyed_run_id(tenant, key)}
        assert sum(not admitted.replayed for admitted in for_key) == 1
