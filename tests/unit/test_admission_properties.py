"""Properties: under any interleaving of keyed and unkeyed spawns, duplicates sent concurrently, the runs
in the table are the distinct (tenant, dispatch_key) pairs plus one per unkeyed request; and any JSON
input is admitted exactly as sent or refused with a 4xx, nothing written."""

from __future__ import annotations

import json
import math
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
from poimen.wire import MAX_BODY_BYTES
from tests.conftest import count_runs
from tests.unit.conftest import Invoke

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
    admission = Admission(store, grants_cache_seconds=600, tenants=tenants.values())
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
    runs = sum(len(count_runs(dynamodb, table_name, tenant, only="pk")) for tenant in tenants.values())
    assert runs == len(keyed) + unkeyed
    # And every answer for a key carries that key's run, exactly one of them fresh
    for tenant, key in keyed:
        for_key = [admitted for (t, request), admitted in answers if (t, request.dispatch_key) == (tenant, key)]
        assert {admitted.run.run_id for admitted in for_key} == {keyed_run_id(tenant, key)}
        assert sum(not admitted.replayed for admitted in for_key) == 1


class _Number(str):
    """JSON number text, written into a body as is."""


def _number_text() -> st.SearchStrategy[str]:
    return st.from_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?", fullmatch=True)


_values = st.recursive(
    st.none() | st.booleans() | st.text(max_size=8) | st.integers().map(str).map(_Number) | _number_text().map(_Number),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=24,
)


def _json(value: Any, spaced: bool) -> str:
    """`value` as JSON text; numbers exactly as generated, strings escaped or not, spaced or compact."""
    comma, colon = (", ", ": ") if spaced else (",", ":")
    if isinstance(value, _Number):
        return str(value)
    if isinstance(value, dict):
        return "{" + comma.join(_json(key, spaced) + colon + _json(item, spaced) for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + comma.join(_json(item, spaced) for item in value) + "]"
    return json.dumps(value, ensure_ascii=spaced)


def _exactly(text: str) -> Any:
    """JSON with each fraction or exponent kept as its text (ints are exact anyway)."""
    return json.loads(text, parse_float=lambda number: ("number", number))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=_values,
    depth=st.sampled_from([0, 1, 61, 62, 63]),
    spaced=st.booleans(),
    size=st.sampled_from([None, MAX_BODY_BYTES - 1, MAX_BODY_BYTES, MAX_BODY_BYTES + 1]),
)
def test_any_json_input_is_admitted_exactly_or_refused_with_nothing_written(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, value: Any, depth: int, spaced: bool, size: int | None
) -> None:
    # Given an input holding any JSON value, nested `depth` lists deeper, the body padded to `size` bytes
    run_input = '{"value": ' + "[" * depth + _json(value, spaced) + "]" * depth + ', "pad": "'
    body = '{"workflow_ref": "wf/any", "input": ' + run_input
    pad = "" if size is None else "x" * max(0, size - len(body.encode()) - len('"}}'))
    run_input += pad + '"}'
    body += pad + '"}}'
    before = len(count_runs(dynamodb, table_name, tenant, only="pk"))
    # When it is sent
    answer = invoke(raw_body=body)
    # Then it is a new run holding the input exactly as sent, or a 4xx with nothing written; never a 5xx
    runs = count_runs(dynamodb, table_name, tenant, only="pk")
    if answer.status == 201:
        assert _exactly(answer.text)["input"] == _exactly(run_input)
        assert len(runs) == before + 1
    else:
        assert 400 <= answer.status < 500, answer.text
        assert len(runs) == before
    admissible = len(body.encode()) <= MAX_BODY_BYTES and depth + _depth(value) <= 62 and _in_range(value)
    assert (answer.status == 201) == admissible


def _depth(value: Any) -> int:
    """Levels of nesting: a list or object is one more than its deepest child."""
    if isinstance(value, dict | list):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((_depth(child) for child in children), default=0)
    return 0


def _in_range(value: Any) -> bool:
    """Every number with a fraction or exponent is finite as a double: 1e999 is refused, 1e-999 is not."""
    if isinstance(value, dict | list):
        return all(_in_range(child) for child in (value.values() if isinstance(value, dict) else value))
    if isinstance(value, _Number) and any(mark in value for mark in ".eE"):
        return math.isfinite(float(value))
    return True
