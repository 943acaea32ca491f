"""Instructions per admission under callgrind: the handler as it ships, or the same-item floor, in-process moto.

Run (docs/architecture.md, "Where an admission's time goes"), one variant a process, and divide the total by
the admissions:

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \
        .venv/bin/python -m benchmarks.admission_callgrind ours 20
    callgrind_annotate callgrind.out.<pid> | head   # "PROGRAM TOTALS", or `grep summary: callgrind.out.<pid>`

Only what runs inside `functools.reduce` is counted: the admissions, after 50 that warm the caches (grants,
client, validation). moto answers in the calling thread (`mock_aws`, no server, no socket), so its work is
counted with the client's, in both variants alike; a loaded machine does not change the counts.
"""

from __future__ import annotations

import argparse
import functools
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import boto3
from moto import mock_aws

from benchmarks.admission_bench import (
    PRINCIPAL,
    TABLE,
    TEMPLATE,
    _through_handler,
    captured_put,
    same_item_floor,
)
from benchmarks.quiet import silenced
from poimen import api
from poimen_tools.local.moto import serialise_dynamodb_writes

WARM_ADMISSIONS = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", choices=["ours", "same-item"], help="the handler, or its PutItem alone")
    parser.add_argument("admissions", type=int, help="admissions counted")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    serialise_dynamodb_writes()
    with mock_aws(), silenced():
        boto3.client("dynamodb").create_table(**TEMPLATE.create_table_request("AdmissionTable", TABLE))
        handler = TEMPLATE.load_handler("AdmissionFunction")
        store = api.admission_service()._store
        store.grant(PRINCIPAL, "*")
        admit: Callable[[str], Any]
        if args.variant == "ours":
            admit = _through_handler(handler)
        else:
            admit, _ = same_item_floor(captured_put(handler, store.client), store.client)
        for _ in range(WARM_ADMISSIONS):
            admit(str(uuid.uuid4()))
        keys = [str(uuid.uuid4()) for _ in range(args.admissions)]

        def counted(_: None, __: None) -> None:
            for key in keys:
                admit(key)

        functools.reduce(counted, [None, None])  # --toggle-collect=functools_reduce: only this is counted


if __name__ == "__main__":
    main()
