"""poimen.client and `poimen runs` routing each tenant to its cell (docs/client.md#cells): a cell map, from a
file (`POIMEN_CELLS_FILE`, `--cells`) or the environment (`POIMEN_CELLS`), sends a tenant's calls to its
cell's endpoints only, failing over between them as between Regions and never to another cell, whose table
does not hold the tenant's keys. A tenant in no cell, or in several, is refused before anything is sent.
Scripted HTTP peers on loopback stand for the cells' APIs, as in test_client.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.credentials import Credentials

from poimen.cells import CELLS_DOCUMENT_VARIABLE, CELLS_FILE_VARIABLE, Cell, CellMap, InvalidCellMap
from poimen.client import (
    AdmissionClient,
    AdmissionError,
    CellRoutingError,
    InvalidRequest,
    RegionalEndpoint,
    TenantInNoCell,
    TenantInSeveralCells,
    Unavailable,
)
from poimen_tools import cli, runs
from tests.unit.test_client import (
    DROP,
    EAST,
    KEY,
    WEST,
    Ceiling,
    Peer,
    Sleeps,
    closed_url,
    on_fake_time,
    problem,
    run_body,
    serving,
    signed_region,
)

ACME, GLOBEX, INITECH = "acme", "globex", "initech"


@pytest.fixture(autouse=True)
def no_cell_map_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CELLS_FILE_VARIABLE, raising=False)
    monkeypatch.delenv(CELLS_DOCUMENT_VARIABLE, raising=False)


@pytest.fixture
def cell_a() -> Iterator[Peer]:
    with serving() as api:
        yield api


@pytest.fixture
def cell_a_west() -> Iterator[Peer]:
    """Cell a's second Region."""
    with serving() as api:
        yield api


@pytest.fixture
def cell_b() -> Iterator[Peer]:
    with serving() as api:
        yield api


def document(a: list[Any], b: list[Any], *, a_tenants: list[str] | None = None) -> dict[str, Any]:
    """Cell a serving acme (and initech), cell b serving globex, at the endpoints given."""
    return {
        "cells": {
            "a": {"endpoints": a, "tenants": a_tenants or [ACME, INITECH]},
            "b": {"endpoints": b, "tenants": [GLOBEX]},
        }
    }


def written(tmp_path: Path, content: dict[str, Any]) -> Path:
    path = tmp_path / "cells.json"
    path.write_text(json.dumps(content))
    return path


def routed(content: dict[str, Any], **options: Any) -> AdmissionClient:
    defaults: dict[str, Any] = {
        "region": EAST,
        "credentials": Credentials(KEY.access_key, KEY.secret_key),
        "timeout": 2.0,
        "sleep": Sleeps(),
        "rng": Ceiling(),
    }
    return AdmissionClient(cells=CellMap.parse(json.dumps(content), "cells.json"), **{**defaults, **options})


def test_each_tenant_goes_to_its_cells_endpoint(cell_a: Peer, cell_b: Peer) -> None:
    api = routed(document([cell_a.url], [cell_b.url]))

    # When acme and globex spawn, get and find through one client
    acme = api.spawn(ACME, "wf/a", {"n": 1}, dispatch_key="k-1")
    globex = api.spawn(GLOBEX, "wf/a", {"n": 2}, dispatch_key="k-1")
    cell_b.script.append(problem(404, "run-not-found"))
    assert api.find(GLOBEX, "k-2") is None

    # Then each tenant's calls reached its own cell's API only
    assert [(r.method, r.header("X-Poimen-Tenant")) for r in cell_a.received] == [("POST", ACME)]
    assert [(r.method, r.header("X-Poimen-Tenant")) for r in cell_b.received] == [("POST", GLOBEX), ("GET", GLOBEX)]
    assert (acme.endpoint.url, globex.endpoint.url) == (cell_a.url, cell_b.url)
    assert (api.endpoint_for(ACME), api.endpoint_for(GLOBEX)) == (acme.endpoint, globex.endpoint)


def test_failover_moves_within_the_tenants_cell_and_never_to_another(cell_a_west: Peer, cell_b: Peer) -> None:
    # Given cell a in two Regions, the first refusing connections
    a = [closed_url(), {"url": cell_a_west.url, "region": WEST}]
    api = routed(document(a, [cell_b.url]))

    # When acme spawns
    spawned = api.spawn(ACME, "wf/a", {}, dispatch_key="k-1")

    # Then the retry went to cell a's other Region, signed for it, and cell b saw nothing
    (request,) = cell_a_west.received
    assert (spawned.attempts, spawned.endpoint) == (2, RegionalEndpoint(cell_a_west.url, WEST))
    assert (signed_region(request), request.json["dispatch_key"]) == (WEST, "k-1")
    assert cell_b.received == []


def test_a_cell_whose_every_endpoint_fails_is_unavailable_without_trying_another_cell(cell_b: Peer) -> None:
    first, second = closed_url(), closed_url()
    api = routed(document([first, {"url": second, "region": WEST}], [cell_b.url]), max_attempts=4)

    with pytest.raises(Unavailable) as failure:
        api.spawn(ACME, "wf/a", {})

    assert failure.value.endpoints == (RegionalEndpoint(first, EAST), RegionalEndpoint(second, WEST))
    assert failure.value.attempts == 4
    assert f"after 4 attempts at {first} ({EAST}), {second} ({WEST}) in cell a: " in str(failure.value)
    assert cell_b.received == []


def test_each_cell_keeps_its_own_place_in_its_rotation(cell_a: Peer, cell_a_west: Peer) -> None:
    # Given cell b in two Regions too (the same peers stand for both cells' APIs here, told apart by tenant),
    # and cell a moved to its second endpoint by a 503
    with serving() as b_east, serving() as b_west:
        api = routed(document([cell_a.url, {"url": cell_a_west.url, "region": WEST}], [b_east.url, b_west.url]))
        cell_a.script.append(problem(503, "internal-error"))
        api.spawn(ACME, "wf/a", {}, dispatch_key="k-1")

        # When globex calls next
        api.spawn(GLOBEX, "wf/a", {}, dispatch_key="k-1")

        # Then it went to cell b's first endpoint: cell a's move is cell a's alone; acme stays on a's second
        assert (len(b_east.received), b_west.received) == (1, [])
        assert api.endpoint_for(ACME).url == cell_a_west.url
        assert api.endpoint_for(GLOBEX).url == b_east.url


def test_a_retry_after_of_one_cell_holds_back_only_that_cell(cell_a: Peer, cell_b: Peer) -> None:
    cell_a.script.append((503, {"Retry-After": "30"}, {"message": "busy"}))
    clock = on_fake_time(cell_a, cell_b)
    api = routed(document([cell_a.url], [cell_b.url]), max_attempts=1, sleep=clock.sleep, clock=clock)
    with pytest.raises(Unavailable):
        api.spawn(ACME, "wf/a", {}, dispatch_key="k")

    api.spawn(GLOBEX, "wf/a", {}, dispatch_key="k")

    assert clock.delays == []
    assert [request.at for request in cell_b.received] == [1000.0]


@pytest.mark.parametrize(("call", "arguments"), [("spawn", ("wf/a", {})), ("get", ("r",)), ("find", ("k",))])
def test_a_tenant_in_no_cell_is_refused_before_anything_is_sent(
    cell_a: Peer, cell_b: Peer, call: str, arguments: tuple[Any, ...]
) -> None:
    api = routed(document([cell_a.url], [cell_b.url]))

    with pytest.raises(TenantInNoCell) as refused:
        getattr(api, call)("hooli", *arguments)

    error = refused.value
    assert isinstance(error, CellRoutingError)
    assert isinstance(error, AdmissionError)
    assert (error.tenant, error.cells, error.status, error.attempts, error.outcome_unknown) == (
        "hooli", (), None, 0, False
    )  # fmt: skip
    assert "tenant hooli is in no cell of cells.json (cells a, b): nothing was sent" in str(error)
    assert (cell_a.received, cell_b.received) == ([], [])


def test_a_tenant_in_two_cells_is_refused_and_other_tenants_are_served(cell_a: Peer, cell_b: Peer) -> None:
    # Given a map that lists globex in both cells (a move half done, say)
    content = document([cell_a.url], [cell_b.url], a_tenants=[ACME, GLOBEX])
    api = routed(content)

    # When globex spawns, and acme then
    with pytest.raises(TenantInSeveralCells) as refused:
        api.spawn(GLOBEX, "wf/a", {}, dispatch_key="k-1")
    api.spawn(ACME, "wf/a", {}, dispatch_key="k-1")

    # Then globex was refused before anything was sent (either cell would admit its key in its own table),
    # naming both cells; acme, in one cell, was served
    error = refused.value
    assert (error.tenant, error.cells, error.attempts, error.dispatch_key) == (GLOBEX, ("a", "b"), 0, "k-1")
    assert "tenant globex is in cells a and b of cells.json: nothing was sent" in str(error)
    assert [request.header("X-Poimen-Tenant") for request in cell_a.received] == [ACME]
    assert cell_b.received == []


def test_a_bad_tenant_id_is_an_invalid_request_before_routing(cell_a: Peer, cell_b: Peer) -> None:
    with pytest.raises(InvalidRequest):
        routed(document([cell_a.url], [cell_b.url])).spawn("Not A Tenant", "wf/a", {})


def test_the_map_comes_from_the_file_the_environment_names(
    cell_a: Peer, cell_b: Peer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CELLS_FILE_VARIABLE, str(written(tmp_path, document([cell_a.url], [cell_b.url]))))

    api = AdmissionClient(region=EAST, credentials=Credentials("a", "b"))
    api.spawn(GLOBEX, "wf/a", {}, dispatch_key="k")

    assert (cell_a.received, len(cell_b.received)) == ([], 1)


def test_the_file_the_environment_names_may_start_at_home_or_a_variable_as_aws_config_file_may(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a map at ~/cells/map.json, named as a .env file or a container's environment names it (unexpanded)
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "map.json").write_text(json.dumps(document([URL], ["http://127.0.0.1:2"])))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CELLS_DIR", str(tmp_path / "cells"))
    for named in ("~/cells/map.json", "$CELLS_DIR/map.json"):
        monkeypatch.setenv(CELLS_FILE_VARIABLE, named)

        found = CellMap.from_environment()

        assert found is not None
        assert [cell.name for cell in found.cells] == ["a", "b"]


def test_the_map_comes_from_the_environment_itself(cell_a: Peer, cell_b: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CELLS_DOCUMENT_VARIABLE, json.dumps(document([cell_a.url], [cell_b.url])))

    map_ = CellMap.from_environment()
    AdmissionClient(region=EAST, credentials=Credentials("a", "b")).spawn(ACME, "wf/a", {}, dispatch_key="k")

    assert map_ is not None
    assert map_.source == CELLS_DOCUMENT_VARIABLE
    assert (len(cell_a.received), cell_b.received) == (1, [])


def test_both_variables_set_is_an_error_not_a_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    content = document(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    monkeypatch.setenv(CELLS_FILE_VARIABLE, str(written(tmp_path, content)))
    monkeypatch.setenv(CELLS_DOCUMENT_VARIABLE, json.dumps(content))

    with pytest.raises(InvalidCellMap, match=f"both {CELLS_FILE_VARIABLE} and {CELLS_DOCUMENT_VARIABLE} are set"):
        CellMap.from_environment()


def test_a_client_needs_a_base_url_or_a_cell_map() -> None:
    credentials = Credentials("a", "b")
    map_ = CellMap.parse(json.dumps(document(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])), "m")

    assert CellMap.from_environment() is None
    with pytest.raises(ValueError, match=f"no endpoint: give base_url or cells, or set {CELLS_FILE_VARIABLE}"):
        AdmissionClient(credentials=credentials)
    with pytest.raises(ValueError, match="base_url or cells, not both"):
        AdmissionClient("http://127.0.0.1:1", cells=map_, region=EAST, credentials=credentials)
    with pytest.raises(ValueError, match="routes by tenant: endpoint_for"):
        _ = AdmissionClient(cells=map_, region=EAST, credentials=credentials).endpoint


def test_a_client_of_cells_lists_every_cells_endpoints() -> None:
    map_ = CellMap.parse(
        json.dumps(document(["http://127.0.0.1:1/", "http://127.0.0.1:3"], ["http://127.0.0.1:2"])), "m"
    )

    api = AdmissionClient(cells=map_, region=EAST, credentials=Credentials("a", "b"))

    assert [endpoint.url for endpoint in api.endpoints] == [f"http://127.0.0.1:{port}" for port in (1, 3, 2)]
    assert {cell.name: sorted(cell.tenants) for cell in map_.cells} == {"a": [ACME, INITECH], "b": [GLOBEX]}


URL = "http://127.0.0.1:1"
ONE = json.dumps({"endpoints": [URL], "tenants": []})  # a cell


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{", "is not JSON"),
        ("[]", 'must be a JSON object {"cells": {...}}'),
        ('{"cell": {}}', 'unknown key "cell" (expected "cells")'),
        ('{"cells": {}}', "names no cell"),
        ('{"cells": {"a": []}}', 'cell a must be an object {"endpoints": [...], "tenants": [...]}'),
        ('{"cells": {"a": {"endpoints": [], "tenants": []}}}', "cell a: endpoints must list at least one"),
        ('{"cells": {"a": {"tenants": ["acme"]}}}', 'cell a: "endpoints" is missing'),
        (f'{{"cells": {{"a": {{"endpoints": ["{URL}"]}}}}}}', 'cell a: "tenants" is missing'),
        (f'{{"cells": {{"a": {{"endpoints": ["{URL}"], "tenants": ["acme"], "tenant": 1}}}}}}', 'unknown key "tenant"'),
        (f'{{"cells": {{"a": {{"endpoints": ["{URL}"], "tenants": ["Acme"]}}}}}}', "'Acme' is not a tenant id"),
        (f'{{"cells": {{"a": {{"endpoints": ["{URL}"], "tenants": "acme"}}}}}}', "tenants must be a list"),
        (f'{{"cells": {{"a": {{"endpoints": ["{URL}"], "tenants": ["acme", "acme"]}}}}}}', "lists acme twice"),
        ('{"cells": {"a": {"endpoints": [1], "tenants": []}}}', "an endpoint is a URL or"),
        ('{"cells": {"a": {"endpoints": [{"url": "x"}], "tenants": []}}}', "an endpoint is a URL or"),
        ('{"cells": {"a": {"endpoints": ["127.0.0.1:1"], "tenants": []}}}', "'127.0.0.1:1' is not an http(s) URL"),
        (
            f'{{"cells": {{"a": {{"endpoints": [{{"url": "{URL}", "region": "not a region"}}], "tenants": []}}}}}}',
            "'not a region' is not an AWS Region",
        ),
        (f'{{"cells": {{"a": {ONE}, "b": {ONE.replace(URL, URL + "/")}}}}}', f"the endpoint {URL} is in cells a and b"),
        (f'{{"cells": {{"a": {ONE}, "a": {ONE}}}}}', 'names "a" twice'),
        # One URL spelled two ways (a host name's case, a scheme's default port) is one stack, in two cells
        (
            '{"cells": {"a": {"endpoints": ["https://API.example.com"], "tenants": []}, '
            '"b": {"endpoints": ["HTTPS://api.example.com:443/"], "tenants": []}}}',
            "the endpoint HTTPS://api.example.com:443 is in cells a and b",
        ),
        # An execute-api host is one API of one stack, whatever path follows it
        (
            '{"cells": {"a": {"endpoints": ["https://abc123.execute-api.us-east-1.amazonaws.com"], "tenants": []}, '
            '"b": {"endpoints": ["https://abc123.execute-api.us-east-1.amazonaws.com/b"], "tenants": []}}}',
            "the endpoint https://abc123.execute-api.us-east-1.amazonaws.com/b is in cells a and b",
        ),
        # A host name's trailing dot (the DNS root) names the same host: one API, whatever path follows it
        (
            '{"cells": {"a": {"endpoints": ["https://abc123.execute-api.us-east-1.amazonaws.com"], "tenants": []}, '
            '"b": {"endpoints": ["https://abc123.execute-api.us-east-1.amazonaws.com./b"], "tenants": []}}}',
            "the endpoint https://abc123.execute-api.us-east-1.amazonaws.com./b is in cells a and b",
        ),
        (
            '{"cells": {"a": {"endpoints": ["https://api.example.com/a"], "tenants": []}, '
            '"b": {"endpoints": ["https://API.example.com./a/"], "tenants": []}}}',
            "the endpoint https://API.example.com./a is in cells a and b",
        ),
        # An internationalised host name is the host its IDNA (punycode) name is: the one the client calls
        (
            '{"cells": {"a": {"endpoints": ["https://B\u00fcCHER.example"], "tenants": []}, '
            '"b": {"endpoints": ["https://xn--bcher-kva.example/"], "tenants": []}}}',
            "the endpoint https://xn--bcher-kva.example is in cells a and b",
        ),
        # A path spelled with dot segments or percent-encoded unreserved characters is the path the client calls
        (
            '{"cells": {"a": {"endpoints": ["https://api.example.com/v1"], "tenants": []}, '
            '"b": {"endpoints": ["https://api.example.com/a/../%761/"], "tenants": []}}}',
            "the endpoint https://api.example.com/a/../%761 is in cells a and b",
        ),
        # A host name that is no IDNA name (a soft hyphen) cannot be called: refused now, not sent as outcome unknown
        ('{"cells": {"a": {"endpoints": ["https://ab\u00adc.example"], "tenants": []}}}', "is not an http(s) URL"),
        # One endpoint twice in a cell: its Retry-After would hold back one of the two, and the client call the other
        (
            '{"cells": {"a": {"endpoints": ["https://api.example.com", "https://API.example.com/"], "tenants": []}}}',
            "cell a lists the endpoint https://API.example.com twice",
        ),
        # urlsplit drops tabs and newlines anywhere, and leading spaces: the URL it checks is not the one called
        ('{"cells": {"a": {"endpoints": ["https://api.exa\\nmple.com"], "tenants": []}}}', "is not an http(s) URL"),
        ('{"cells": {"a": {"endpoints": [" https://api.example.com"], "tenants": []}}}', "is not an http(s) URL"),
        (f'{{"cells": {{"": {{"endpoints": ["{URL}"], "tenants": []}}}}}}', "a cell's name must be"),
    ],
)
def test_a_map_that_is_not_one_is_refused_whole(content: str, reason: str) -> None:
    with pytest.raises(InvalidCellMap) as refused:
        CellMap.parse(content, "/etc/poimen/cells.json")

    assert str(refused.value).startswith("/etc/poimen/cells.json: ")
    assert reason in str(refused.value)
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize("url", ["ftp://x.example.com", "https://x.example.com:99999", "not a url", " http://x"])
def test_a_map_made_in_code_with_a_bad_url_is_refused_as_one_parsed(url: str) -> None:
    with pytest.raises(InvalidCellMap, match=r"^m: cell a: .* is not an http\(s\) URL"):
        CellMap((Cell("a", (url,), frozenset({ACME})),), "m")


def test_two_cells_behind_one_custom_domain_at_two_base_paths_are_two_endpoints() -> None:
    cells = {
        name: {"endpoints": [f"https://api.example.com/{name}"], "tenants": [tenant]}
        for name, tenant in (("a", ACME), ("b", GLOBEX))
    }

    map_ = CellMap.parse(json.dumps({"cells": cells}), "m")

    assert [cell.endpoints for cell in map_.cells] == [("https://api.example.com/a",), ("https://api.example.com/b",)]


@pytest.mark.parametrize(
    "content",
    [
        '{"cel\\nls": {}}',
        f'{{"cells": {{"a": {{"endpoints": ["{URL}"], "tenants": [], "ten\\nants": 1}}}}}}',
        f'{{"cells": {{"a": {{"endpoints": ["{URL}"], "tenants": [], "tenants": []}}}}}}'.replace("tenants", "t\\nt"),
    ],
)
def test_a_map_naming_a_key_with_a_newline_is_refused_in_one_line(content: str) -> None:
    with pytest.raises(InvalidCellMap) as refused:
        CellMap.parse(content, "m")

    assert "\n" not in str(refused.value)
    assert "\\n" in str(refused.value)


def test_a_base_url_list_naming_one_endpoint_twice_is_refused() -> None:
    # Failing over from it to itself would call it again against its Retry-After
    with pytest.raises(ValueError, match=r"names the endpoint http://127\.0\.0\.1:1 twice"):
        AdmissionClient(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:1/"], region=EAST)


def test_a_base_url_with_a_newline_or_a_leading_space_is_refused() -> None:
    for url in ("https://api.exa\nmple.com", " https://api.example.com", "https://api.example.com\t"):
        with pytest.raises(ValueError, match="base_url must be an http"):
            AdmissionClient(url, region=EAST, credentials=Credentials("a", "b"))


def test_a_map_file_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidCellMap, match=r"cannot read .*missing\.json"):
        CellMap.load(tmp_path / "missing.json")


def test_a_map_file_larger_than_any_map_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    # Given a file of 16 MiB and a byte (POIMEN_CELLS_FILE=/dev/zero would be endless)
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (16 * 1024 * 1024 + 1))

    with pytest.raises(InvalidCellMap) as refused:
        CellMap.load(huge)

    assert str(refused.value) == f"{huge}: is larger than 16 MiB: not a cell map"


# --- poimen runs ----------------------------------------------------------------------------------------


def spawn_argv(*options: str, tenant: str = ACME) -> list[str]:
    return ["runs", "spawn", *options, "--tenant", tenant, "--workflow-ref", "wf/a", "--input", '{"n": 1}']


def test_poimen_runs_routes_by_the_cells_file(
    cell_a: Peer, cell_b: Peer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = written(tmp_path, document([cell_a.url], [{"url": cell_b.url, "region": WEST}]))

    codes = [cli.main(spawn_argv("--cells", str(path), tenant=tenant)) for tenant in (ACME, GLOBEX)]

    assert codes == [0, 0]
    assert [request.header("X-Poimen-Tenant") for request in cell_a.received] == [ACME]
    assert [request.header("X-Poimen-Tenant") for request in cell_b.received] == [GLOBEX]
    # a loopback endpoint without a Region is signed for poimen dev's us-east-1, one with a Region for it
    assert (signed_region(cell_a.received[0]), signed_region(cell_b.received[0])) == (EAST, WEST)
    assert capsys.readouterr().err == ""


def test_poimen_runs_reads_the_map_from_the_environment_unless_given_a_base_url(
    cell_a: Peer, cell_b: Peer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CELLS_FILE_VARIABLE, str(written(tmp_path, document([cell_a.url], [cell_b.url]))))

    assert cli.main(spawn_argv(tenant=GLOBEX)) == 0
    assert cli.main(spawn_argv("--base-url", cell_a.url, tenant=GLOBEX)) == 0  # the command line wins

    assert (len(cell_a.received), len(cell_b.received)) == (1, 1)


def test_poimen_runs_fails_over_within_the_cell(
    cell_a_west: Peer, cell_b: Peer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = written(tmp_path, document([closed_url(), {"url": cell_a_west.url, "region": WEST}], [cell_b.url]))
    cell_a_west.script.append((200, {}, run_body()))

    code = cli.main(["runs", "get", "--cells", str(path), "--tenant", ACME, "r-1"])

    out, err = capsys.readouterr()
    assert (code, err, json.loads(out)["tenant_id"]) == (0, "", ACME)
    assert (len(cell_a_west.received), cell_b.received) == (1, [])


@pytest.mark.parametrize(
    ("tenant", "a_tenants", "said"),
    [
        ("hooli", None, "tenant hooli is in no cell of {path} (cells a, b): nothing was sent"),
        (GLOBEX, [ACME, GLOBEX], "tenant globex is in cells a and b of {path}: nothing was sent"),
    ],
)
def test_poimen_runs_refuses_a_tenant_in_no_cell_or_in_two_in_one_line(
    cell_a: Peer,
    cell_b: Peer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tenant: str,
    a_tenants: list[str] | None,
    said: str,
) -> None:
    path = written(tmp_path, document([cell_a.url], [cell_b.url], a_tenants=a_tenants))

    code = cli.main(spawn_argv("--cells", str(path), tenant=tenant))

    (line,) = capsys.readouterr().err.splitlines()
    assert code == runs.EXIT_USAGE
    assert line.startswith("poimen runs spawn: ")
    assert said.format(path=path) in line
    assert (cell_a.received, cell_b.received) == ([], [])


def test_poimen_runs_refuses_cells_with_a_base_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = written(tmp_path, document([URL], ["http://127.0.0.1:2"]))

    with pytest.raises(SystemExit) as exited:
        cli.main(spawn_argv("--cells", str(path), "--base-url", URL))

    (line,) = capsys.readouterr().err.splitlines()
    assert exited.value.code == runs.EXIT_USAGE
    assert "not allowed with argument" in line


def test_poimen_runs_refuses_a_bad_map_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cells.json"
    path.write_text('{"cells": {"a": {"endpoints": [], "tenants": []}}}')

    with pytest.raises(SystemExit) as exited:
        cli.main(spawn_argv("--cells", str(path)))

    (line,) = capsys.readouterr().err.splitlines()
    assert exited.value.code == runs.EXIT_USAGE
    assert f"argument --cells: {path}: cell a: endpoints must list at least one" in line


def test_poimen_runs_refuses_a_bad_map_in_the_environment_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CELLS_DOCUMENT_VARIABLE, '{"cells": []}')

    code = cli.main(spawn_argv())

    (line,) = capsys.readouterr().err.splitlines()
    assert code == runs.EXIT_USAGE
    assert line.startswith(f"poimen runs spawn: {CELLS_DOCUMENT_VARIABLE}: ")


def test_poimen_runs_safe_retry_line_names_the_cells_file(
    cell_a: Peer, cell_b: Peer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given acme's cell losing every answer of a keyless spawn
    cell_a.script += [DROP, DROP]
    path = written(tmp_path, document([cell_a.url], [cell_b.url]))

    code = cli.main(spawn_argv("--cells", str(path), "--max-attempts", "2"))

    # Then the commands it names address the cell the same way: through the map
    (line,) = capsys.readouterr().err.splitlines()
    key = cell_a.received[0].json["dispatch_key"]
    assert code == runs.EXIT_UNAVAILABLE
    assert f"poimen runs find --cells {path} --tenant {ACME} {key}," in line
    assert f"poimen runs spawn --cells {path} --tenant {ACME} --workflow-ref" in line


def test_poimen_runs_says_which_stack_to_call_when_the_api_does_not_serve_the_tenant(
    cell_b: Peer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given acme sent to a stack that does not serve it (another cell's)
    cell_b.script.append(problem(403, "tenant-not-served"))

    code = cli.main(spawn_argv("--base-url", cell_b.url, "--dispatch-key", "k-1"))

    # Then the line says so, and how to reach its own cell, rather than to check credentials and grants
    (line,) = capsys.readouterr().err.splitlines()
    assert code == runs.EXIT_UNAVAILABLE
    assert f"the API at {cell_b.url} does not serve tenant acme (nothing was written)" in line
    assert "call its own stack's AdmissionApiUrl, or its cell's endpoints with --cells (docs/client.md#cells)" in line
    assert "grants" not in line
