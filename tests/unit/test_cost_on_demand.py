"""A tenant's fixed cost under on-demand event pollers (benchmarks/cost_on_demand.py): no poller charge, its share of
the brokers as under provisioned pollers, within issue 35's goal (at most the tenant's MSK share, about $5.4)."""

from __future__ import annotations

import pytest

from benchmarks.cost_model import Settings, fixed_lines
from benchmarks.cost_on_demand import on_demand_fixed_lines
from poimen_tools.local.template import Template
from tests.conftest import REPO


@pytest.mark.parametrize("aliases", [0, 1, 2])
def test_on_demand_a_tenant_pays_its_brokers_share_and_no_pollers(aliases: int) -> None:
    settings = Settings.of(Template(REPO / "template.yaml"))

    pollers, *brokers = on_demand_fixed_lines(settings, aliases)
    provisioned = fixed_lines(settings, aliases, grouped=False)

    assert (pollers.price, pollers.usd) == ("epu_hour", 0)
    assert f"{1 + aliases} mapping" in pollers.item
    assert brokers == [line for line in provisioned if line.price == "msk_broker_hour"]
    assert sum(line.usd for line in brokers) < sum(line.usd for line in provisioned)


def test_on_demand_a_tenant_costs_at_most_its_msk_share() -> None:
    settings = Settings.of(Template(REPO / "template.yaml"))

    total = sum(line.usd for line in on_demand_fixed_lines(settings, aliases=0))

    assert round(total, 2) == 5.36
