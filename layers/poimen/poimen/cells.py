"""The cell map: which cell (stack) serves each tenant, and that cell's admission endpoints, so that a client
sends a tenant's calls to its own cell only (docs/client.md#cells). A JSON document, from a file
(`POIMEN_CELLS_FILE`) or from the environment itself (`POIMEN_CELLS`):

    {"cells": {"c1": {"endpoints": ["https://abc123.execute-api.us-east-1.amazonaws.com",
                                    {"url": "https://admission-west.example.com", "region": "us-west-2"}],
                      "tenants": ["acme", "initech"]},
               "c2": {"endpoints": ["https://def456.execute-api.us-east-1.amazonaws.com"], "tenants": ["globex"]}}}

A map that is not one is refused whole (InvalidCellMap); a tenant listed in no cell, or in several, is refused
by the client when it is called for, so that one tenant's mistake never stops another's calls.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from botocore.exceptions import InvalidRegionError
from botocore.utils import validate_region_name

from poimen.endpoints import RegionalEndpoint, endpoint_identity, is_base_url
from poimen.wire import TENANT_PATTERN

CELLS_FILE_VARIABLE: Final = "POIMEN_CELLS_FILE"
CELLS_DOCUMENT_VARIABLE: Final = "POIMEN_CELLS"
# A label for messages and for the operator: `make deploy`'s CELL fits, and so does a name for a stack deployed
# before cells (its cell has no CELL).
_CELL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TENANT = re.compile(TENANT_PATTERN)
_SHAPE = '{"endpoints": [...], "tenants": [...]}'
# Far more than any map needs (each cell's tenants fit its admission function's 4 KB of environment variables,
# docs/client.md#cells); a file past it (a log, /dev/zero) is not one, and is not read whole.
MAX_MAP_BYTES: Final = 16 * 1024 * 1024


class InvalidCellMap(ValueError):
    """The cell map is not one (or cannot be read): its source, then what is wrong with it."""


@dataclass(frozen=True)
class Cell:
    """One cell: its name, its endpoints in order of preference (each a URL, its Region found as the client
    finds a base_url's, or a RegionalEndpoint), and the tenants it serves."""

    name: str
    endpoints: tuple[str | RegionalEndpoint, ...]
    tenants: frozenset[str]


@dataclass(frozen=True)
class CellMap:
    """Cells in the map's order; `source` names where the map came from (a path, POIMEN_CELLS) in messages."""

    cells: tuple[Cell, ...]
    source: str = "the cell map"

    def __post_init__(self) -> None:
        if not self.cells:
            raise self._wrong("names no cell")
        names = [cell.name for cell in self.cells]
        if len(set(names)) != len(names):
            raise self._wrong(f"names a cell twice ({', '.join(names)})")
        owner: dict[tuple[str, str, int, str], str] = {}
        for cell in self.cells:
            if not cell.endpoints:
                raise self._wrong(f"cell {cell.name}: endpoints must list at least one")
            for endpoint in cell.endpoints:
                given = endpoint.url if isinstance(endpoint, RegionalEndpoint) else endpoint
                if not is_base_url(given):
                    raise self._wrong(
                        f"cell {cell.name}: {given!r} is not an http(s) URL without query, fragment or spaces"
                    )
                url = given.rstrip("/")
                # Two cells at one URL (however spelled) would be one stack serving both cells' tenants from one table.
                # Two host names of one API (custom domains) are beyond an offline check: the stack refuses the
                # tenants it does not serve (403 tenant-not-served), so they are refused, never admitted twice.
                # One endpoint twice in a cell: its Retry-After would hold back one of the two, not the other.
                same = endpoint_identity(url)
                if owner.get(same) == cell.name:
                    raise self._wrong(f"cell {cell.name} lists the endpoint {url} twice")
                if same in owner:
                    raise self._wrong(f"the endpoint {url} is in cells {owner[same]} and {cell.name}")
                owner[same] = cell.name

    def cells_of(self, tenant: str) -> tuple[Cell, ...]:
        """The cells that list `tenant`: exactly one, for a tenant the map routes."""
        return tuple(cell for cell in self.cells if tenant in cell.tenants)

    def names(self) -> str:
        return ", ".join(cell.name for cell in self.cells)

    def _wrong(self, what: str) -> InvalidCellMap:
        return InvalidCellMap(f"{self.source}: {what}")

    @classmethod
    def parse(cls, text: str | bytes, source: str) -> CellMap:
        """The map a JSON document describes (see the module doc); InvalidCellMap if it describes none."""

        def wrong(what: str) -> InvalidCellMap:
            return InvalidCellMap(f"{source}: {what}")

        try:
            document = json.loads(text, object_pairs_hook=_refusing_duplicates)
        except _DuplicateKey as error:
            raise wrong(f"names {json.dumps(str(error))} twice") from None
        except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep
            raise wrong(f"is not JSON ({error})") from error
        if not isinstance(document, dict) or not isinstance(document.get("cells", {}), dict):
            raise wrong('must be a JSON object {"cells": {...}}')
        for key in document.keys() - {"cells"}:
            raise wrong(f'unknown key {json.dumps(key)} (expected "cells")')
        cells = []
        for name, entry in document.get("cells", {}).items():
            if not _CELL_NAME.fullmatch(name):
                raise wrong(f"a cell's name must be 1-64 letters, digits, '.', '_' or '-': {name!r}")
            cells.append(_cell(name, entry, wrong))
        return cls(tuple(cells), source)

    @classmethod
    def load(cls, path: Path) -> CellMap:
        try:
            with path.open("rb") as file:
                text = file.read(MAX_MAP_BYTES + 1)
        except OSError as error:
            raise InvalidCellMap(f"cannot read {path} ({(error.strerror or str(error)).lower()})") from error
        if len(text) > MAX_MAP_BYTES:
            raise InvalidCellMap(f"{path}: is larger than {MAX_MAP_BYTES // 1024 // 1024} MiB: not a cell map")
        return cls.parse(text, str(path))

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> CellMap | None:
        """The map `POIMEN_CELLS_FILE` names (`~` and the process's `$VARIABLES` expanded), or the one
        `POIMEN_CELLS` holds; None if neither is set. Both set is an error rather than a choice: which one is
        meant cannot be known."""
        env = os.environ if environ is None else environ
        path, document = env.get(CELLS_FILE_VARIABLE, ""), env.get(CELLS_DOCUMENT_VARIABLE, "")
        if path and document:
            raise InvalidCellMap(f"both {CELLS_FILE_VARIABLE} and {CELLS_DOCUMENT_VARIABLE} are set: set one")
        if path:  # as botocore reads AWS_CONFIG_FILE: $VARIABLES, then a leading ~, expanded
            return cls.load(Path(os.path.expanduser(os.path.expandvars(path))))
        return cls.parse(document, CELLS_DOCUMENT_VARIABLE) if document else None


class _DuplicateKey(Exception):
    pass


def _refusing_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key it holds twice (json keeps the last one silently)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _cell(name: str, entry: Any, wrong: Callable[[str], InvalidCellMap]) -> Cell:
    if not isinstance(entry, dict):
        raise wrong(f"cell {name} must be an object {_SHAPE}")
    for key in entry.keys() - {"endpoints", "tenants"}:
        raise wrong(f"cell {name}: unknown key {json.dumps(key)} (expected {_SHAPE})")
    for key in ("endpoints", "tenants"):
        if key not in entry:
            raise wrong(f'cell {name}: "{key}" is missing (expected {_SHAPE})')
    endpoints, tenants = entry["endpoints"], entry["tenants"]
    if not isinstance(endpoints, list) or not endpoints:
        raise wrong(f"cell {name}: endpoints must list at least one, in order of preference")
    if not isinstance(tenants, list):
        raise wrong(f"cell {name}: tenants must be a list of tenant ids")
    seen: set[str] = set()
    for tenant in tenants:
        if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
            raise wrong(f"cell {name}: {tenant!r} is not a tenant id ({TENANT_PATTERN})")
        if tenant in seen:
            raise wrong(f"cell {name} lists {tenant} twice")
        seen.add(tenant)
    return Cell(name, tuple(_endpoint(name, each, wrong) for each in endpoints), frozenset(tenants))


def _endpoint(cell: str, entry: Any, wrong: Callable[[str], InvalidCellMap]) -> str | RegionalEndpoint:
    if isinstance(entry, dict) and entry.keys() == {"url", "region"} and isinstance(entry["region"], str):
        url, region = entry["url"], entry["region"]
        try:
            validate_region_name(region)
        except InvalidRegionError:
            raise wrong(f"cell {cell}: {region!r} is not an AWS Region (like us-east-1)") from None
    elif isinstance(entry, str):
        url, region = entry, None
    else:
        raise wrong(f'cell {cell}: an endpoint is a URL or {{"url": URL, "region": REGION}}, not {entry!r}')
    return url if region is None else RegionalEndpoint(url, region)  # its URL checked by CellMap
