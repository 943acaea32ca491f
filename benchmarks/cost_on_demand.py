"""A tenant's fixed monthly cost with on-demand event pollers (template RelayEventPollers=on-demand), for
benchmarks.cost_model's `--mode on-demand`: docs/operations.md#event-poller-modes.

The Lambda pricing page (https://aws.amazon.com/lambda/pricing/) bills event pollers only in "Provisioned Mode
for Event Source Mapping (ESM)": "Pricing is based on the provisioned minimum event pollers, and the event pollers
consumed during autoscaling", in Event Poller Units. A mapping in on-demand mode, the default ("Using provisioned
mode incurs additional costs", https://docs.aws.amazon.com/lambda/latest/dg/kafka-scaling-modes.html), pays no
poller charge: only the invocations and duration of the function it invokes, which the per-admission lines of
benchmarks.cost_model count already. What stays fixed is the tenant's share of the brokers.
"""

from __future__ import annotations

from benchmarks.cost_model import Line, Settings, fixed_lines


def on_demand_fixed_lines(settings: Settings, aliases: int) -> list[Line]:
    """A tenant's monthly cost before any admission under on-demand pollers: its mappings' pollers, free, and its
    share of the brokers its partition replicas take (as provisioned mode's, benchmarks.cost_model.fixed_lines)."""
    mappings = 1 + aliases
    pollers = Line(
        f"event pollers ({mappings} mapping{'s' if mappings > 1 else ''}, on-demand: no poller charge)",
        0,
        "EPU-hours",
        "epu_hour",
    )
    brokers = [line for line in fixed_lines(settings, aliases, grouped=False) if line.price == "msk_broker_hour"]
    return [pollers, *brokers]
