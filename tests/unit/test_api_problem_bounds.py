"""A problem body stays small whatever the request: a 256 KiB body can fail validation in thousands of
places, and Lambda answers at most 6 MB (and the relay dead-letters the answer beside the record)."""

from __future__ import annotations

from poimen.api import MAX_PROBLEM_ERRORS
from tests.unit.conftest import Invoke

GOOD = {"workflow_ref": "wf/hello", "input": {}}
# Far below Lambda's 6 MB response cap, and below a few hundred bytes per reported error.
MAX_PROBLEM_BYTES = 32 * 1024


def test_a_body_with_18000_unknown_fields_answers_a_bounded_problem_that_counts_them(invoke: Invoke) -> None:
    # Given a 234 KB body with 18,000 unknown top-level fields
    body = {**GOOD, **{f"x{i:05d}": 0 for i in range(18_000)}}
    # When it is posted
    answer = invoke(body=body)
    # Then the 400 lists the first errors only, says how many there were, and stays small
    assert answer.status == 400
    assert answer.body["type"] == "urn:poimen:problem:validation-error"
    assert len(answer.text.encode()) <= MAX_PROBLEM_BYTES
    assert answer.body["errors_total"] == 18_000
    assert [error["field"] for error in answer.body["errors"]] == [f"body.x{i:05d}" for i in range(MAX_PROBLEM_ERRORS)]
    assert answer.body["detail"].endswith("and 17980 more.")


def test_a_huge_unknown_field_name_is_cut_short_in_the_problem(invoke: Invoke) -> None:
    # Given one unknown field whose name is 200,000 characters long
    answer = invoke(body={**GOOD, "n" * 200_000: 1})
    # Then the problem names it, cut short, and stays small
    assert answer.status == 400
    assert len(answer.text.encode()) <= MAX_PROBLEM_BYTES
    ((error),) = answer.body["errors"]
    assert error["field"].startswith("body.nnnn")
    assert error["field"].endswith("…")
    assert answer.body["errors_total"] == 1


def test_a_few_errors_are_all_listed(invoke: Invoke) -> None:
    answer = invoke(body={"workflow_ref": 7, "input": []})

    assert answer.status == 400
    assert sorted(error["field"] for error in answer.body["errors"]) == ["body.input", "body.workflow_ref"]
    assert answer.body["errors_total"] == 2
    assert answer.body["detail"] == "Invalid fields: body.input, body.workflow_ref."
