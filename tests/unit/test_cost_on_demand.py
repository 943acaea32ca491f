"""A tenant's fixed cost under on-demand event pollers (benchmarks/cost_model.py, `--mode on-demand`): no poller
charge, its share of the brokers as under provisioned pollers, within issue 35's goal (at most the tenant's MSK
share, about $5.4)."""

from __future__ import annotations

import pytest

from benchmarks.cost_model import Deployment, Settings, a_tenant, fixed_lines
from poimen_tools.local.template import Template
from tests.conftest import REPO


@pytest.mark.parametrize("aliases", [0, 1, 2])
def test_on_demand_a_tenant_pays_its_brokers_share_and_no_pollers(aliases: int) -> None:
    settings = Settings.of(Template(REPO / "template.yaml"))

    on_demand = fixed_lines(settings, Deployment(1, aliases, mode="on-demand"))
    provisioned = fixed_lines(settings, Deployment(1, aliases, grouped=False))

    assert [line.price for line in on_demand] == ["msk_broker_hour"]
    assert on_demand == [line for line in provisioned if line.price == "msk_broker_hour"]
    assert sum(line.usd for line in on_demand) < sum(line.usd for line in provisioned)


@pytest.mark.parametrize(("aliases", "usd"), [(0, 5.36), (1, 8.04), (2, 10.72)])
def test_on_demand_a_tenant_costs_at_most_its_msk_share(aliases: int, usd: float) -> None:
    settings = Settings.of(Template(REPO / "template.yaml"))

    for tenants in (1, 2, 100):
        assert round(a_tenant(settings, Deployment(tenants, aliases, mode="on-demand")), 2) == usd
