"""The Idempotency-Key header as a dispatch_key: an RFC 8941 string, or the key itself unquoted."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from poimen.api import openapi_document
from poimen.contract import (
    IDEMPOTENCY_KEY_HEADER_PATTERN,
    IdempotencyKeyMismatch,
    InvalidIdempotencyKey,
    dispatch_key_of,
    idempotency_key,
)
from tests.conftest import REPO
from tests.unit.test_docs import anchors


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ('"k-1"', "k-1"),
        ("k-1", "k-1"),
        (' "k-1" ', "k-1"),
        ("\tk-1 ", "k-1"),
        (r'"say \"hi\""', 'say "hi"'),
        (r'"back\\slash"', "back\\slash"),
        ('" spaced key "', " spaced key "),
        ("unquoted with spaces", "unquoted with spaces"),
        ('un"quoted', 'un"quoted'),
        ("poimen-client/0b5e1c0e-8f0a-4a9b-9c33-7d8a2f4b6e10", "poimen-client/0b5e1c0e-8f0a-4a9b-9c33-7d8a2f4b6e10"),
        ('"' + "k" * 255 + '"', "k" * 255),
        ("k" * 255, "k" * 255),
        ('"a,b"', "a,b"),
    ],
    ids=[
        "quoted",
        "unquoted",
        "quoted-with-spaces-around",
        "unquoted-with-whitespace-around",
        "escaped-quote",
        "escaped-backslash",
        "quoted-spaces-kept",
        "unquoted-spaces-inside",
        "unquoted-quote-inside",
        "client-generated",
        "quoted-255",
        "unquoted-255",
        "quoted-comma",
    ],
)
def test_a_header_value_names_its_key(value: str, key: str) -> None:
    assert idempotency_key(value) == key


@pytest.mark.parametrize(
    "value",
    [
        '"k-1',
        '"k-1"x',
        '"k-1";a=1',
        '"a", "b"',
        r'"bad \n escape"',
        '"trailing backslash\\"',
        '"tab\tinside"',
        '"non-ascii é"',
        '""',
        "",
        "   ",
        '"' + "k" * 256 + '"',
        "k" * 256,
        "line\nbreak",
        "nul\x00",
        "c1\x85",
        "é",
    ],
    ids=[
        "unterminated",
        "text-after-string",
        "parameters",
        "list",
        "unknown-escape",
        "escaped-closing-quote",
        "control-in-string",
        "non-ascii-in-string",
        "empty-string",
        "empty",
        "blank",
        "quoted-256",
        "unquoted-256",
        "newline",
        "nul",
        "c1-control",
        "unquoted-non-ascii",
    ],
)
def test_a_value_that_names_no_key_is_refused(value: str) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        idempotency_key(value)


@pytest.mark.parametrize(
    "value",
    ["k,k", "k-1, k-1", "a,b", 'k,"k"', "k,", ",k", ","],
    ids=["repeated", "repeated-with-space", "two-keys", "bare-then-quoted", "trailing", "leading", "comma"],
)
def test_a_bare_value_with_a_comma_is_refused(value: str) -> None:
    # Given a value API Gateway (payload 2.0) and poimen dev make of repeated header lines: joined with commas
    with pytest.raises(InvalidIdempotencyKey) as refused:
        idempotency_key(value)
    # Then it names no key, and the refusal says how to send a key with a comma
    assert "comma" in str(refused.value)
    assert "quoted" in str(refused.value)


def test_the_key_is_the_header_or_the_body_or_both_when_equal() -> None:
    assert dispatch_key_of(None, None) is None
    assert dispatch_key_of(None, "k-1") == "k-1"
    assert dispatch_key_of('"k-1"', None) == "k-1"
    assert dispatch_key_of("k-1", None) == "k-1"
    assert dispatch_key_of('"k-1"', "k-1") == "k-1"
    assert dispatch_key_of("k-1", "k-1") == "k-1"


@pytest.mark.parametrize("header", ['"k-2"', "k-2", '"k-1 "', "K-1"], ids=["quoted", "unquoted", "space", "case"])
def test_a_header_and_a_body_naming_different_keys_are_refused(header: str) -> None:
    with pytest.raises(IdempotencyKeyMismatch):
        dispatch_key_of(header, "k-1")


def test_a_malformed_header_is_refused_even_when_the_body_has_a_key() -> None:
    with pytest.raises(InvalidIdempotencyKey):
        dispatch_key_of('"k-1', "k-1")


def test_the_openapi_document_links_the_published_specification() -> None:
    # Given the link in the API document's description, relative to infra/openapi.json
    description = openapi_document()["info"]["description"]
    target = re.search(r"\]\(([^)]+)\)", description)
    assert target is not None
    path, _, anchor = target[1].partition("#")
    # Then it reaches the section, and the document lists the header and both problem types
    assert (REPO / "infra" / path).resolve() == REPO / "docs" / "architecture.md"
    assert anchor == "idempotency-specification"
    assert anchor in anchors(REPO / "docs" / "architecture.md")
    create_run = openapi_document()["paths"]["/v1/runs"]["post"]
    assert "idempotency-key" in [parameter["name"] for parameter in create_run["parameters"]]
    assert "`idempotency-key-invalid`" in create_run["responses"]["400"]["description"]
    assert "`idempotency-key-mismatch`" in create_run["responses"]["400"]["description"]


def _accepted(value: str) -> bool:
    try:
        idempotency_key(value)
    except InvalidIdempotencyKey:
        return False
    return True


# Header-like values: printable ASCII and tab, weighted towards quotes, backslashes and commas.
HEADER_VALUES = st.text(st.sampled_from([*map(chr, range(0x20, 0x7F)), "\t", '"', "\\", ",", " "]), max_size=300)


@given(HEADER_VALUES)
@example("k" * 255)
@example("k" * 256)
@example('"' + "k" * 255 + '"')
@example('"' + "k" * 256 + '"')
@example('"' + "\\\\" * 255 + '"')
@example('"a,b", "c"')
def test_the_documented_pattern_is_exactly_what_is_accepted(value: str) -> None:
    # The OpenAPI document's pattern of the header (JSON Schema, ECMA-262) says what the parser accepts
    assert bool(re.fullmatch(IDEMPOTENCY_KEY_HEADER_PATTERN, value)) == _accepted(value)


def test_the_openapi_document_gives_the_header_its_pattern() -> None:
    create_run = openapi_document()["paths"]["/v1/runs"]["post"]
    (header,) = [parameter for parameter in create_run["parameters"] if parameter["name"] == "idempotency-key"]
    assert header["schema"]["pattern"] == IDEMPOTENCY_KEY_HEADER_PATTERN
    assert "comma" in header["description"]
