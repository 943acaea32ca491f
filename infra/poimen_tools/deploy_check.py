"""What `make build` and `make deploy` refuse before SAM runs: more tenants than one stack holds, and (deploy)
a tenant another cell already serves on the same MSK cluster or in the same Stage.

One stack serves at most MAX_EVENT_SOURCE_MAPPINGS MSK event source mappings (one per tenant and dispatch
topic: the tenant's own, and one per peer cluster alias: the kinds of `dispatch_sources`, which the deploy
passes as the template's DispatchSources) and a `Tenants` list of at most MAX_TENANT_CHARACTERS characters
(the admission function carries it in its environment, 4 KB for all its variables). The mappings are what the
500 resources of a stack leave: CloudFormation counts the resources declared, conditions not yet evaluated,
and the template declares no mapping it does not create. tests/unit/test_template_quotas.py transforms the
template at these maxima and one past them and checks every quota AWS enforces at deploy;
docs/operations.md#how-many-tenants-a-stack-serves gives the reasons.

Cells (docs/operations.md#cells) are stacks of this template on one MSK cluster, each serving its own
tenants: two cells serving one tenant would admit its spawns in two tables (twice), and their mappings would
share the tenant's consumer group. `cells` reads every stack of the Region from CloudFormation, and the change
sets of those stacks not yet executed (`sam deploy` leaves one for its confirmation: it serves its tenants once
confirmed), and refuses, before anything changes, a tenant that a stack on the same cluster (its MskClusterArn)
serves already or will serve, and a Cell that differs from the deployed stack's. So does another cell of the
same Stage on another cluster (its records may be replicated to this one and relayed here from
<alias>.poimen.<tenant>.dispatch, or its callers fail over to this one), and in multi-Region mode another cell
of the Stage in a peer Region (read there); the same cell's stack in a peer Region is its own (one table).

Run by the SAM CLI's interpreter (the Makefile's build and deploy need nothing else; it has boto3):

    .venv-sam/bin/python infra/poimen_tools/deploy_check.py --prog "make build" limits --tenants a,b --peer-aliases 2
    .venv-sam/bin/python infra/poimen_tools/deploy_check.py --prog "make deploy" cells --stack-name S --cell C \
        --tenants a,b --msk-cluster-arn arn:aws:kafka:... --stage dev --peer-regions us-east-2,us-west-2

`cells` prints, once it refuses nothing, the DispatchSources parameter to deploy with (`DispatchSources=Source,
Peer1Source`): the kinds of the peer cluster aliases the stack will have, those given, else the deployed stack's
(sam deploy keeps a parameter it is not given), none for one cleared (`--cleared-peer-cluster-aliases 1`).

Poller groups (docs/operations.md#poller-groups): `groups` reads the cluster's event source mappings from Lambda
and prints the RelayPollerGroups parameter to deploy with (`RelayPollerGroups=acme=0,globex=0`): each tenant's
mappings in one of the cluster's groups with room for them beside every other stack's mappings there, a tenant
kept in its deployed group while it still fits; or it refuses, in one line, what Lambda would refuse (a group of
more than 100 mappings or 2,000 MaximumPollers, a name it does not take):

    .venv-sam/bin/python infra/poimen_tools/deploy_check.py --prog "make deploy" groups --stack-name S \
        --tenants a,b --msk-cluster-arn arn:aws:kafka:... --dispatch-sources DispatchSources=Source,Peer1Source

Under on-demand event pollers (RelayEventPollers, given or the deployed stack's) a mapping has no
ProvisionedPollerConfig and joins no group: `groups` then gives every tenant none (`acme=-`), counts nothing and
refuses nothing, so that a cluster whose groups are full refuses no on-demand stack, and an on-demand stack holds
no room in them.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import astuple, dataclass, field
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

# CloudFormation's resources a stack, counted on the template as declared (Resource and Outputs quotas:
# https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cloudformation-limits.html).
RESOURCES_A_STACK = 500
# The template's resources other than the relay's MSK mappings, declared (every Condition'd one counted, and
# SAM's own), with every option on; tests/unit/test_template_quotas.py holds this to template.yaml.
OTHER_RESOURCES = 54
MAX_EVENT_SOURCE_MAPPINGS = RESOURCES_A_STACK - OTHER_RESOURCES
# The template's DispatchSources kinds: each tenant's own topic, and one per peer cluster alias (1, 2).
DISPATCH_SOURCES = ("Source", "Peer1Source", "Peer2Source")
# The admission function's variables are 4 KB in all (Lambda quotas); TENANTS is the Tenants list, and
# the other variables take at most about 600 bytes (the quota test renders them at their longest).
MAX_TENANT_CHARACTERS = 3000
CELLS = "docs/operations.md#cells"
# Poller groups: "You can group up to 100 ESMs per poller group and aggregate maximum pollers across all ESMs in a
# group cannot exceed 2000"; a name is 0-128 of a-z, A-Z, 0-9, '-' and '_' (Lambda API Reference,
# ProvisionedPollerConfig: https://docs.aws.amazon.com/lambda/latest/api/API_ProvisionedPollerConfig.html).
MAPPINGS_A_POLLER_GROUP = 100
MAXIMUM_POLLERS_A_POLLER_GROUP = 2000
POLLER_GROUP_NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,128}")
# A Kafka mapping's MaximumPollers when it sets none, and the most it takes ("between 1 and 2,000", the same page;
# the template's RelayMaximumPollers has the same range).
DEFAULT_MAXIMUM_POLLERS = 200
MOST_MAXIMUM_POLLERS = 2000
# The template's RelayPollerGroups: one character a group (so that the assignment of 446 tenants in 3,000
# characters stays under CloudFormation's 4,096 bytes a parameter value), 36 groups a cluster.
POLLER_GROUPS = "0123456789abcdefghijklmnopqrstuvwxyz"
UNGROUPED = "ungrouped"  # the opt-out, asked for by name: every mapping on an EPU of its own
DEFAULT_POLLER_GROUP = "0"  # the group of a tenant RelayPollerGroups does not name (template_assignment)
NO_GROUP = "-"  # what RelayPollerGroups gives each tenant when ungrouped (the template names its group "")
PARAMETER_VALUE_BYTES = 4096  # CloudFormation quotas (RESOURCES_A_STACK's page)
# The template's RelayEventPollers whose mappings have no ProvisionedPollerConfig (poimen.config's, which this script,
# run by the SAM CLI's interpreter, cannot import).
ON_DEMAND_POLLERS = "on-demand"
DEFAULT_RELAY_MAXIMUM_POLLERS = 3  # the template's RelayMaximumPollers default; tests/unit/test_poller_groups.py
POLLER_GROUPS_DOC = "docs/operations.md#poller-groups"
EVENT_POLLER_MODES_DOC = "docs/operations.md#event-poller-modes"
DEFAULT_STAGE = "dev"  # the template's Stage when none is given, as CloudFormation then describes the stack
CELL_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,15}")  # the template's Cell parameter
TENANT_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # each id of the template's Tenants parameter
# A stack in these states serves nothing: a failed creation rolled back, its mappings deleted.
SERVES_NOTHING = {"ROLLBACK_COMPLETE", "DELETE_COMPLETE"}
# A stack in these states holds two sets of tenants until it settles: CloudFormation describes the update's new
# parameters while the mappings of tenants it removes are still there (deleted in the cleanup, after it), and
# back again if it rolls back; UPDATE_FAILED (rollback disabled) and UPDATE_ROLLBACK_FAILED keep some of each.
UNSETTLED = {
    "UPDATE_IN_PROGRESS",
    "UPDATE_COMPLETE_CLEANUP_IN_PROGRESS",
    "UPDATE_ROLLBACK_IN_PROGRESS",
    "UPDATE_ROLLBACK_COMPLETE_CLEANUP_IN_PROGRESS",
    "UPDATE_FAILED",
    "UPDATE_ROLLBACK_FAILED",
    "IMPORT_IN_PROGRESS",
    "IMPORT_ROLLBACK_IN_PROGRESS",
    "IMPORT_ROLLBACK_FAILED",
}
# A change set in these states may still be executed (or is being): its tenants are served once it is. A new
# stack made by a change set is REVIEW_IN_PROGRESS, with no parameters of its own, until the change set runs.
PENDING_CHANGE_SET = {"CREATE_PENDING", "CREATE_IN_PROGRESS", "CREATE_COMPLETE"}
PENDING_EXECUTION = {"UNAVAILABLE", "AVAILABLE", "EXECUTE_IN_PROGRESS"}


def max_tenants(peer_aliases: int) -> int:
    """The tenants one stack serves with `peer_aliases` peer cluster aliases (each adds a mapping per tenant)."""
    return MAX_EVENT_SOURCE_MAPPINGS // (1 + peer_aliases)


def dispatch_sources(peer_cluster_aliases: tuple[str, str]) -> str:
    """The template's DispatchSources for these PeerClusterAlias1/2 values (empty: none): the kinds of dispatch
    topic each tenant has a mapping on."""
    kinds = [DISPATCH_SOURCES[0]] + [
        kind for kind, alias in zip(DISPATCH_SOURCES[1:], peer_cluster_aliases, strict=True) if alias
    ]
    return ",".join(kinds)


def _shared_logical_id(tenants: list[str]) -> str | None:
    """Two ids of `tenants` whose mappings would have one logical id, named ("'a-b' and 'ab'", "'acme' twice"):
    Fn::ForEach's &{TenantId} keeps only a value's letters and digits, and an id given twice is one id."""
    seen: dict[str, str] = {}
    for tenant in tenants:
        alphanumeric = "".join(ch for ch in tenant if ch.isalnum())
        if alphanumeric in seen:
            first = seen[alphanumeric]
            return f"{first!r} twice" if first == tenant else f"{first!r} and {tenant!r}"
        seen[alphanumeric] = tenant
    return None


def limit_refusal(tenants: list[str], peer_aliases: int) -> str | None:
    """Why one stack cannot serve `tenants` (one line that says how to split them, or which id the template
    would refuse), or None if it can."""
    bad = [tenant for tenant in tenants if not TENANT_PATTERN.fullmatch(tenant)]
    if bad:
        what = repr(bad[0]) if bad[0] else "an empty id"
        return (
            f"TENANTS has {what}: each tenant id is 1-63 of a-z, 0-9 and '-', starting with a letter or digit, the"
            " ids separated by single commas (the template's Tenants; CloudFormation would refuse the deploy)"
        )
    shared = _shared_logical_id(tenants)
    if shared is not None:
        return (
            f"TENANTS has {shared}, and a stack has one MSK event source mapping per tenant id, its logical id"
            " made of the id's letters and digits (RelaySource<id>): CloudFormation would refuse the deploy; give"
            f" each tenant once, and serve ids that differ only by '-' in different cells (CELL=<name>, {CELLS})"
        )
    most = max_tenants(peer_aliases)
    aliases = ["no peer cluster alias", "one peer cluster alias", "two peer cluster aliases"][peer_aliases]
    if len(tenants) > most:
        return (
            f"{len(tenants)} tenants, and one stack serves at most {most} with {aliases} (one MSK event source"
            f" mapping per tenant and dispatch topic: {len(tenants) * (1 + peer_aliases)} mappings and the template's"
            f" {OTHER_RESOURCES} other resources are over CloudFormation's {RESOURCES_A_STACK} a stack): split them"
            f" into cells of at most {most} tenants, one stack each (CELL=<name>, {CELLS})"
        )
    characters = len(",".join(tenants))
    if characters > MAX_TENANT_CHARACTERS:
        return (
            f"TENANTS is {characters:,} characters, and one stack serves at most {MAX_TENANT_CHARACTERS:,} (the"
            f" admission function carries the list in its 4 KB of environment variables): split them into cells"
            f" of at most {MAX_TENANT_CHARACTERS:,} characters, one stack each (CELL=<name>, {CELLS})"
        )
    assignment = len(render_assignment(dict.fromkeys(tenants, POLLER_GROUPS[-1])).encode())
    if assignment > PARAMETER_VALUE_BYTES:
        return (
            f"the poller groups of these tenants (RelayPollerGroups) are {assignment:,} bytes, over CloudFormation's"
            f" {PARAMETER_VALUE_BYTES:,} a parameter value: split them into cells, one stack each (CELL=<name>,"
            f" {CELLS})"
        )
    return None


# --- poller groups ------------------------------------------------------------------------------------------


def poller_group_name(msk_cluster_arn: str, group: str) -> str:
    """The PollerGroupName of `group` on this cluster, as the template makes it: named after the cluster (its ARN's
    last part), so every cell on the cluster shares it and no mapping of another cluster is in it unseen."""
    return f"poimen-{msk_cluster_arn.rsplit('/', 1)[-1]}-{group}"


@dataclass(frozen=True)
class GroupLoad:
    """What a poller group holds: its mappings and their MaximumPollers, summed."""

    mappings: int = 0
    maximum_pollers: int = 0

    def plus(self, mappings: int, maximum_pollers: int) -> GroupLoad:
        return GroupLoad(self.mappings + mappings, self.maximum_pollers + maximum_pollers)

    def fits(self) -> bool:
        return self.mappings <= MAPPINGS_A_POLLER_GROUP and self.maximum_pollers <= MAXIMUM_POLLERS_A_POLLER_GROUP


def _group_names(msk_cluster_arn: str) -> dict[str, str]:
    """Each of the cluster's PollerGroupNames, and its group."""
    return {poller_group_name(msk_cluster_arn, group): group for group in POLLER_GROUPS}


def group_loads(listed: list[dict[str, Any]], msk_cluster_arn: str, own: frozenset[str]) -> dict[str, GroupLoad]:
    """The load of each of the cluster's poller groups, from its mappings as ListEventSourceMappings lists them,
    leaving out the stack's own (`own`: their UUIDs; _during_update counts them where own_groups finds them)."""
    names = _group_names(msk_cluster_arn)
    loads: dict[str, GroupLoad] = {}
    for mapping in listed:
        config = mapping.get("ProvisionedPollerConfig", {})
        group = names.get(config.get("PollerGroupName", ""))
        if group is None or mapping["UUID"] in own:
            continue
        pollers = int(config.get("MaximumPollers", DEFAULT_MAXIMUM_POLLERS))
        loads[group] = loads.get(group, GroupLoad()).plus(1, pollers)
    return loads


def own_groups(
    listed: list[dict[str, Any]], msk_cluster_arn: str, own: frozenset[str]
) -> dict[str, tuple[str, GroupLoad]]:
    """Where the stack's own mappings (`own`: their UUIDs) are, as Lambda lists them: each tenant's group (found by
    its topic's second-last part: poimen.<tenant>.dispatch, <alias>.poimen.<tenant>.dispatch; NO_GROUP if ungrouped
    or in a group not the cluster's) and what its mappings hold. What a deploy starts from, whatever the stack's
    parameters say: a creation rolled back has deleted its mappings, an update rolled back has put them back."""
    names = _group_names(msk_cluster_arn)
    groups: dict[str, tuple[str, GroupLoad]] = {}
    for mapping in listed:
        if mapping["UUID"] not in own:
            continue
        config = mapping.get("ProvisionedPollerConfig", {})
        group = names.get(config.get("PollerGroupName", ""), NO_GROUP)
        pollers = int(config.get("MaximumPollers", DEFAULT_MAXIMUM_POLLERS))
        for topic in mapping.get("Topics", []):
            tenant = topic.split(".")[-2]
            first, held = groups.get(tenant, (group, GroupLoad()))
            groups[tenant] = first, held.plus(1, pollers)
    return groups


def parse_assignment(text: str) -> dict[str, str]:
    """RelayPollerGroups as a tenant -> group map (an entry without '=' maps to "")."""
    pairs = (entry.partition("=") for entry in text.split(",") if entry)
    return {tenant: group for tenant, _, group in pairs}


def template_assignment(text: str, tenants: tuple[str, ...]) -> dict[str, str]:
    """Each tenant's group as the template reads RelayPollerGroups: its first "tenant=g" in
    ",<RelayPollerGroups>,<tenant>=0", so a tenant the value does not name (a deploy by hand, the default "") is in
    group 0 (template.yaml's PollerGroupName)."""
    given: dict[str, str] = {}
    for tenant, _, group in (entry.partition("=") for entry in text.split(",") if entry):
        given.setdefault(tenant, group)
    return {tenant: given.get(tenant, DEFAULT_POLLER_GROUP) for tenant in tenants}


def render_assignment(assignment: dict[str, str]) -> str:
    return ",".join(f"{tenant}={group}" for tenant, group in assignment.items())


def _is_group(group: str) -> bool:
    return len(group) == 1 and group in POLLER_GROUPS


# What each deployed tenant's mappings hold where they are: one load for every tenant, or each tenant's own (as
# Lambda lists them: own_groups); a tenant not in the map holds nothing.
Held = GroupLoad | dict[str, GroupLoad]


def _held(deployed: Held, tenant: str) -> GroupLoad:
    return deployed.get(tenant, GroupLoad()) if isinstance(deployed, dict) else deployed


def _during_update(taken: dict[str, GroupLoad], previous: dict[str, str], deployed: Held) -> dict[str, GroupLoad]:
    """`taken`, and each deployed tenant's mappings (what `deployed` says it holds) in its `previous` group: they
    count there until the update completes, as CloudFormation deletes the mappings of a removed tenant after it has
    created and updated the others (its cleanup), and updates a moved one's group in parallel with the others (room
    it leaves may be taken before it has left)."""
    loads = dict(taken)
    for tenant, group in previous.items():
        if _is_group(group):
            loads[group] = loads.get(group, GroupLoad()).plus(*astuple(_held(deployed, tenant)))
    return loads


def _arrival(tenant: str, group: str, load: GroupLoad, previous: dict[str, str], deployed: Held) -> GroupLoad:
    """What `tenant`'s mappings (`load`) add to `group`: all of them if it comes from elsewhere, its growth over what
    it holds there if it stays (a peer alias's mapping more, a higher RelayMaximumPollers)."""
    if previous.get(tenant) != group:
        return load
    held = _held(deployed, tenant)
    return GroupLoad(max(0, load.mappings - held.mappings), max(0, load.maximum_pollers - held.maximum_pollers))


def assign_poller_groups(
    tenants: list[str],
    mappings_a_tenant: int,
    maximum_pollers: int,
    taken: dict[str, GroupLoad],
    previous: dict[str, str],
    deployed: Held = GroupLoad(),
) -> dict[str, str]:
    """Each tenant's group (all of its `mappings_a_tenant` mappings, of `maximum_pollers` each, in one), beside what
    other stacks hold (`taken`) and the stack's deployed tenants where they are (`previous`, `deployed` a tenant:
    _during_update): a tenant stays in its `previous` group while that has room (no mapping moves on a redeploy
    that need not), the others go to the first group with room. A tenant no group has room for is left out:
    poller_group_refusal names it."""
    loads = _during_update(taken, previous, deployed)
    load = GroupLoad(mappings_a_tenant, mappings_a_tenant * maximum_pollers)
    assignment: dict[str, str] = {}

    def place(tenant: str, group: str) -> bool:
        after = loads.get(group, GroupLoad()).plus(*astuple(_arrival(tenant, group, load, previous, deployed)))
        if not after.fits():
            return False
        loads[group], assignment[tenant] = after, group
        return True

    for tenant in tenants:
        if _is_group(previous.get(tenant, "")):
            place(tenant, previous[tenant])
    for tenant in tenants:
        if tenant not in assignment:
            any(place(tenant, group) for group in POLLER_GROUPS)
    return {tenant: assignment[tenant] for tenant in tenants if tenant in assignment}


def poller_group_refusal(
    assignment: dict[str, str],
    tenants: list[str],
    mappings_a_tenant: int,
    maximum_pollers: int,
    taken: dict[str, GroupLoad],
    msk_cluster_arn: str,
    previous: dict[str, str] | None = None,
    deployed: Held = GroupLoad(),
) -> str | None:
    """Why Lambda (or the template) would refuse these tenants' mappings in the groups of `assignment` beside
    what other stacks hold (`taken`) and the stack's deployed tenants where they are (`previous`, `deployed` a
    tenant: _during_update), in one line; None if it would not (every tenant given NO_GROUP: ungrouped)."""
    if assignment and set(assignment.values()) == {NO_GROUP} and set(assignment) == set(tenants):
        return None
    one_tenant = mappings_a_tenant * maximum_pollers
    if one_tenant > MAXIMUM_POLLERS_A_POLLER_GROUP:
        return (
            f"RelayMaximumPollers {maximum_pollers} x {mappings_a_tenant} mappings a tenant is {one_tenant:,}"
            f" pollers, over the {MAXIMUM_POLLERS_A_POLLER_GROUP:,} a poller group holds (Lambda refuses the"
            f" mapping): lower RelayMaximumPollers to {MAXIMUM_POLLERS_A_POLLER_GROUP // mappings_a_tenant} or less"
            f" ({POLLER_GROUPS_DOC})"
        )
    missing = [tenant for tenant in tenants if tenant not in assignment]
    if missing:
        return (
            f"no poller group for {_listed(missing)}: each of the cluster's {len(POLLER_GROUPS)} groups"
            f" (0-9, a-z) would be over {MAPPINGS_A_POLLER_GROUP} mappings or {MAXIMUM_POLLERS_A_POLLER_GROUP:,}"
            f" MaximumPollers with their {mappings_a_tenant} mapping(s) of {maximum_pollers} pollers (Lambda refuses"
            f" the mapping): lower RelayMaximumPollers, or serve them from another cluster ({POLLER_GROUPS_DOC})"
        )
    unknown = sorted(set(assignment) - set(tenants))
    if unknown:
        return f"RELAY_POLLER_GROUPS names {_listed(unknown)}, not in TENANTS ({POLLER_GROUPS_DOC})"
    bad = sorted({group for group in assignment.values() if len(group) != 1 or group not in POLLER_GROUPS})
    if bad:
        return (
            f"RELAY_POLLER_GROUPS has the group {bad[0]!r}: a group is one of 0-9 and a-z, for every tenant"
            f" (RELAY_POLLER_GROUPS={UNGROUPED} ungroups them all) ({POLLER_GROUPS_DOC})"
        )
    name = poller_group_name(msk_cluster_arn, "0")
    if not POLLER_GROUP_NAME_PATTERN.fullmatch(name):
        return (
            f"the poller groups of this cluster would be named {name!r}..., and a PollerGroupName is 1-128 of"
            f" a-z, A-Z, 0-9, '-' and '_' (Lambda refuses the mapping): check MSK_CLUSTER_ARN ({POLLER_GROUPS_DOC})"
        )
    loads = _during_update(taken, previous or {}, deployed)
    load = GroupLoad(mappings_a_tenant, one_tenant)
    grown: set[str] = set()  # the groups this deploy adds to; one another cell overfills is that cell's refusal
    for tenant in tenants:
        group = assignment[tenant]
        arrival = _arrival(tenant, group, load, previous or {}, deployed)
        loads[group] = loads.get(group, GroupLoad()).plus(arrival.mappings, arrival.maximum_pollers)
        if arrival != GroupLoad():
            grown.add(group)
    for group, after in sorted(loads.items()):
        if group in grown and not after.fits():
            theirs = taken.get(group, GroupLoad())
            return (
                f"poller group {poller_group_name(msk_cluster_arn, group)} would hold {after.mappings} mappings and"
                f" {after.maximum_pollers:,} MaximumPollers ({theirs.mappings} and {theirs.maximum_pollers:,} of"
                " other stacks, their change sets not yet executed included; this stack's deployed mappings count"
                " where they are until its update completes),"
                f" over the {MAPPINGS_A_POLLER_GROUP} and {MAXIMUM_POLLERS_A_POLLER_GROUP:,} a group holds (Lambda"
                f" refuses the mapping): leave RELAY_POLLER_GROUPS unset and make deploy assigns groups with room"
                f" ({POLLER_GROUPS_DOC})"
            )
    return None


@dataclass(frozen=True)
class DeployedCell:
    """A stack of this template as CloudFormation describes it, or one of its change sets not yet executed: its
    cell, cluster and tenants."""

    stack_name: str
    status: str
    cell: str
    msk_cluster_arn: str
    tenants: tuple[str, ...]
    change_set: str = ""  # the change set's name; empty for the stack as deployed
    stage: str = DEFAULT_STAGE
    region: str = ""  # a peer Region's name; empty for the Region being deployed
    peer_cluster_aliases: tuple[str, str] = ("", "")  # PeerClusterAlias1, PeerClusterAlias2
    poller_groups: str = ""  # RelayPollerGroups
    event_pollers: str = ""  # RelayEventPollers
    mappings_a_tenant: int = 1  # DispatchSources' kinds
    maximum_pollers: int = DEFAULT_RELAY_MAXIMUM_POLLERS  # RelayMaximumPollers

    def __str__(self) -> str:
        where = f" in {self.region}" if self.region else ""
        pending = f", change set {self.change_set} not yet executed" if self.change_set else ""
        return f"{_cell_name(self.cell)} (stack {self.stack_name}{where}{pending})"


def _cell_name(cell: str) -> str:
    return f"cell {cell}" if cell else "the unnamed cell"


def _cell(
    stack: dict[str, Any], parameters: list[dict[str, str]], region: str, change_set: str = ""
) -> DeployedCell | None:
    """The cell these parameters make of `stack`, or None if they are not this template's (Tenants and
    MskClusterArn; stacks deployed before the Cell parameter existed are the unnamed cell)."""
    given = {p["ParameterKey"]: p.get("ParameterValue", "") for p in parameters}
    if "Tenants" not in given or "MskClusterArn" not in given:
        return None
    pollers = given.get("RelayMaximumPollers", "")
    return DeployedCell(
        stack_name=stack["StackName"],
        status=stack["StackStatus"],
        cell=given.get("Cell", ""),
        msk_cluster_arn=given["MskClusterArn"],
        tenants=tuple(t for t in given["Tenants"].split(",") if t),
        change_set=change_set,
        stage=given.get("Stage", DEFAULT_STAGE),
        region=region,
        peer_cluster_aliases=(given.get("PeerClusterAlias1", ""), given.get("PeerClusterAlias2", "")),
        poller_groups=given.get("RelayPollerGroups", ""),
        event_pollers=given.get("RelayEventPollers", ""),
        mappings_a_tenant=len((given.get("DispatchSources") or DISPATCH_SOURCES[0]).split(",")),
        maximum_pollers=int(pollers) if re.fullmatch("[0-9]+", pollers) else DEFAULT_RELAY_MAXIMUM_POLLERS,
    )


def _pending_change_sets(cloudformation: Any, stack: dict[str, Any], region: str) -> list[DeployedCell]:
    """The cells `stack`'s change sets not yet executed would make of it."""
    cells = []
    for page in cloudformation.get_paginator("list_change_sets").paginate(StackName=stack["StackId"]):
        for summary in page["Summaries"]:
            if (
                summary.get("StackId", stack["StackId"]) != stack["StackId"]  # moto lists every stack's
                or summary["Status"] not in PENDING_CHANGE_SET
                or summary["ExecutionStatus"] not in PENDING_EXECUTION
            ):
                continue
            described = cloudformation.describe_change_set(ChangeSetName=summary["ChangeSetId"])
            cell = _cell(stack, described.get("Parameters", []), region, summary["ChangeSetName"])
            if cell is not None:
                cells.append(cell)
    return cells


def deployed_cells(cloudformation: Any, region: str = "") -> list[DeployedCell]:
    """Every stack in the client's Region that is a cell of this template, and every cell its change sets not
    yet executed would make (a new stack's change set included: it has no parameters until it runs). `region`
    names a peer Region's client; empty for the Region being deployed."""
    cells = []
    for page in cloudformation.get_paginator("describe_stacks").paginate():
        for stack in page["Stacks"]:
            cell = _cell(stack, stack.get("Parameters", []), region)
            if cell is not None:
                cells.append(cell)
            if cell is not None or stack["StackStatus"] == "REVIEW_IN_PROGRESS":
                cells += _pending_change_sets(cloudformation, stack, region)
    return cells


def _listed(tenants: list[str]) -> str:
    shown = ", ".join(tenants[:5])
    return shown if len(tenants) <= 5 else f"{shown} and {len(tenants) - 5} more"


def peer_cluster_aliases(
    deployed: list[DeployedCell], stack_name: str, given: tuple[str, str], cleared: frozenset[int] = frozenset()
) -> tuple[tuple[str, str], list[tuple[int, str]]]:
    """The PeerClusterAlias1/2 the stack will have, and those of them kept from the deployed stack (number,
    alias): each given, else cleared (`cleared` numbers it: make deploy passes it empty), else the deployed
    stack's (sam deploy passes UsePreviousValue for a parameter it is not given)."""
    stack = [c for c in deployed if c.region == "" and c.stack_name == stack_name and not c.change_set]
    previous = stack[0].peer_cluster_aliases if stack else ("", "")
    kept = [
        (n, old)
        for n, (new, old) in enumerate(zip(given, previous, strict=True), 1)
        if old and not new and n not in cleared
    ]
    kept_numbers = {n for n, _ in kept}
    first, second = (given[n - 1] or (previous[n - 1] if n in kept_numbers else "") for n in (1, 2))
    return (first, second), kept


def kept_aliases_refusal(
    deployed: list[DeployedCell],
    stack_name: str,
    tenants: list[str],
    given: tuple[str, str],
    cleared: frozenset[int] = frozenset(),
) -> str | None:
    """limit_refusal for the peer cluster aliases the stack will have (peer_cluster_aliases): an alias not given
    stays, and its mappings with it, while make build counted only the aliases given."""
    aliases, kept = peer_cluster_aliases(deployed, stack_name, given, cleared)
    refusal = limit_refusal(tenants, sum(bool(alias) for alias in aliases))
    if refusal is None or not kept:
        return refusal
    names = " and ".join(f"PeerClusterAlias{n} ({alias})" for n, alias in kept)
    return (
        f"{refusal}; {names} kept from the deployed stack, as sam deploy keeps a parameter it is not given"
        " (PEER_CLUSTER_ALIAS_<n>= clears it)"
    )


def _shares_tenants(other: DeployedCell, stack_name: str, cell: str, msk_cluster_arn: str, stage: str) -> bool:
    """Whether `other` and the stack being deployed must not serve one tenant: the same cluster's topics and
    consumer groups, or two tables of one Stage. The same cell in a peer Region is that cell's (its table)."""
    if other.region == "" and other.stack_name == stack_name:
        return False
    if other.msk_cluster_arn == msk_cluster_arn:
        return True
    return other.stage == stage and (other.region == "" or other.cell != cell)


def cell_refusal(
    deployed: list[DeployedCell],
    stack_name: str,
    cell: str,
    tenants: list[str],
    msk_cluster_arn: str,
    stage: str = DEFAULT_STAGE,
) -> str | None:
    """Why `stack_name` may not be deployed as `cell` of `stage` serving `tenants` on that cluster (one line), or
    None."""
    if cell and not CELL_PATTERN.fullmatch(cell):
        return f"CELL {cell!r} is not 1-16 of a-z, 0-9 and '-' starting with a letter or digit (the template's Cell)"
    for other in deployed:
        if other.region == "" and other.stack_name == stack_name and other.cell != cell:
            return (
                f"stack {stack_name} is {_cell_name(other.cell)}, not {_cell_name(cell)}: a stack's cell"
                " never changes (its layers and its multi-Region table are named after it); a new cell is a new stack"
            )
    neighbours = [other for other in deployed if _shares_tenants(other, stack_name, cell, msk_cluster_arn, stage)]
    for other in neighbours:
        if other.status in UNSETTLED and not other.change_set:
            return (
                f"{other} is {other.status}: until it settles, the tenants it serves are not known (it may still"
                " serve those its update removes, or again those of before if it rolls back); deploy when it is"
                f" complete or rolled back (a failed one: continue its rollback, or update it, first) ({CELLS})"
            )
    wanted = set(tenants)
    taken = [
        (sorted(wanted & set(other.tenants)), other)
        for other in neighbours
        if other.status not in SERVES_NOTHING and wanted & set(other.tenants)
    ]
    if not taken:
        return None
    served = "; ".join(f"{_listed(shared)} served by {other}" for shared, other in taken)
    pending = any(other.change_set for _, other in taken)
    scopes = ["on this MSK cluster" if o.msk_cluster_arn == msk_cluster_arn else f"in Stage {stage}" for _, o in taken]
    scope = " or ".join(dict.fromkeys(scopes))
    return (
        f"{served} already, {scope}: a tenant in two cells would be admitted twice, once in each cell's table;"
        " remove it from TENANTS, or deploy that cell without it first"
        f"{' (a change set not yet executed counts: execute or delete it first)' if pending else ''} ({CELLS})"
    )


def pending_loads(
    cells: list[DeployedCell], stack_name: str, msk_cluster_arn: str, listed: list[dict[str, Any]]
) -> dict[str, GroupLoad]:
    """What the other cells on the cluster will hold in its groups beyond what Lambda lists there yet: each of their
    tenants' mappings where the cell's parameters, or its change set's not yet executed, place them, less what that
    tenant's mappings Lambda lists in that group hold. A cell waiting for its change set's confirmation, or whose
    creation or update is under way, has not created or moved them yet, and two cells deploying at once must not
    both take the room (Lambda would refuse the second's mapping, and a rollback moving one back could fail)."""
    names = _group_names(msk_cluster_arn)
    listed_at: dict[tuple[str, str], GroupLoad] = {}
    for mapping in listed:
        config = mapping.get("ProvisionedPollerConfig", {})
        group = names.get(config.get("PollerGroupName", ""))
        if group is None:
            continue
        for topic in mapping.get("Topics", []):
            key = (topic.split(".")[-2], group)
            listed_at[key] = listed_at.get(key, GroupLoad()).plus(
                1, int(config.get("MaximumPollers", DEFAULT_MAXIMUM_POLLERS))
            )
    loads: dict[str, GroupLoad] = {}
    for cell in cells:
        if (
            cell.msk_cluster_arn != msk_cluster_arn
            or (cell.region == "" and cell.stack_name == stack_name)
            or cell.status in SERVES_NOTHING
        ):
            continue
        if cell.event_pollers == ON_DEMAND_POLLERS:
            continue  # its mappings are in no group (the template declares no ProvisionedPollerConfig)
        for tenant, group in template_assignment(cell.poller_groups, cell.tenants).items():
            if not _is_group(group):
                continue
            there = listed_at.get((tenant, group), GroupLoad())
            loads[group] = loads.get(group, GroupLoad()).plus(
                max(0, cell.mappings_a_tenant - there.mappings),
                max(0, cell.mappings_a_tenant * cell.maximum_pollers - there.maximum_pollers),
            )
    return loads


@dataclass(frozen=True)
class DeployedGroups:
    """What the deploy's poller groups depend on, as AWS describes it: the load of the cluster's groups without the
    stack's own mappings; where those are (own_groups, as RelayPollerGroups; empty if none) and what each tenant's
    hold; the stack's deployed RelayMaximumPollers and RelayEventPollers (empty if none), and which of its own
    mappings Lambda lists as provisioned."""

    taken: dict[str, GroupLoad]
    previous: str
    maximum_pollers: str
    event_pollers: str = ""
    # The stack's own mappings in provisioned mode (Lambda lists a ProvisionedPollerConfig), by UUID.
    provisioned: tuple[str, ...] = ()
    held: dict[str, GroupLoad] = field(default_factory=dict)


def deployed_groups(cloudformation: Any, lambda_: Any, stack_name: str, msk_cluster_arn: str) -> DeployedGroups:
    """The cluster's poller groups from Lambda's ListEventSourceMappings, the stack's own mappings (its resources
    in CloudFormation) left out and found where they are, with what the other cells on the cluster will add
    (pending_loads, from CloudFormation's stacks and change sets), and the stack's deployed parameters; a stack not
    yet deployed has none."""
    try:
        (stack,) = cloudformation.describe_stacks(StackName=stack_name)["Stacks"]
    except ClientError as error:
        if "does not exist" not in str(error):
            raise
        stack = None
    own: set[str] = set()
    if stack is not None:
        for page in cloudformation.get_paginator("list_stack_resources").paginate(StackName=stack_name):
            own.update(
                summary["PhysicalResourceId"]
                for summary in page["StackResourceSummaries"]
                if summary["ResourceType"] == "AWS::Lambda::EventSourceMapping" and summary.get("PhysicalResourceId")
            )
    listed = [
        mapping
        for page in lambda_.get_paginator("list_event_source_mappings").paginate(EventSourceArn=msk_cluster_arn)
        for mapping in page["EventSourceMappings"]
    ]
    given = {p["ParameterKey"]: p.get("ParameterValue", "") for p in (stack or {}).get("Parameters", [])}
    placed = own_groups(listed, msk_cluster_arn, frozenset(own))
    taken = group_loads(listed, msk_cluster_arn, frozenset(own))
    for group, pending in pending_loads(deployed_cells(cloudformation), stack_name, msk_cluster_arn, listed).items():
        taken[group] = taken.get(group, GroupLoad()).plus(*astuple(pending))
    return DeployedGroups(
        taken=taken,
        previous=render_assignment({tenant: group for tenant, (group, _) in placed.items()}),
        maximum_pollers=given.get("RelayMaximumPollers", ""),
        event_pollers=given.get("RelayEventPollers", ""),
        provisioned=tuple(m["UUID"] for m in listed if m["UUID"] in own and m.get("ProvisionedPollerConfig")),
        held={tenant: held for tenant, (_, held) in placed.items()},
    )


def on_demand_refusal(provisioned: tuple[str, ...]) -> str | None:
    """Why a deploy to on-demand pollers must wait while some of the stack's mappings are provisioned: a template
    that drops ProvisionedPollerConfig leaves provisioned mode on, and billed, on a mapping that has it; `{}`
    turns it off on an existing mapping (docs/operations.md#event-poller-modes)."""
    if not provisioned:
        return None
    count = f"{len(provisioned)} of the stack's mappings {'is' if len(provisioned) == 1 else 'are'}"
    clear = "; ".join(
        f"aws lambda update-event-source-mapping --uuid {uuid} --provisioned-poller-config '{{}}'"
        for uuid in provisioned
    )
    return (
        f"RelayEventPollers=on-demand, but {count} provisioned, and a deploy that drops ProvisionedPollerConfig"
        f" leaves provisioned mode on (its pollers billed): clear it first ({clear}), then deploy again"
        f" ({EVENT_POLLER_MODES_DOC})"
    )


def _groups(options: argparse.Namespace, tenants: list[str]) -> tuple[str | None, str, bool]:
    """The `groups` verb: (its refusal, the RelayPollerGroups to deploy with, whether the pollers are provisioned)."""
    deployed = deployed_groups(
        boto3.client("cloudformation"), boto3.client("lambda"), options.stack_name, options.msk_cluster_arn
    )
    if (options.event_pollers or deployed.event_pollers) == ON_DEMAND_POLLERS:
        # No mapping joins a group (module doc), nor may one stay provisioned (on_demand_refusal).
        return on_demand_refusal(deployed.provisioned), render_assignment(dict.fromkeys(tenants, NO_GROUP)), False
    # As sam deploy passes it: given (samconfig.toml's overrides), else the deployed stack's, else the default.
    relay_maximum_pollers = options.maximum_pollers or deployed.maximum_pollers or str(DEFAULT_RELAY_MAXIMUM_POLLERS)
    if not re.fullmatch("[0-9]+", relay_maximum_pollers) or not 1 <= int(relay_maximum_pollers) <= MOST_MAXIMUM_POLLERS:
        return (
            (
                f"RelayMaximumPollers {relay_maximum_pollers!r} is not a whole number of 1 to"
                f" {MOST_MAXIMUM_POLLERS} (the template's range, and Lambda's for a Kafka mapping): fix it in"
                f" samconfig.toml's parameter_overrides ({POLLER_GROUPS_DOC})"
            ),
            "",
            True,
        )
    maximum_pollers = int(relay_maximum_pollers)
    sources = options.dispatch_sources.removeprefix("DispatchSources=").split(",")
    previous = parse_assignment(deployed.previous)
    # What each deployed tenant's mappings hold where they are (nothing where the stack is deployed on-demand, its
    # RelayPollerGroups of an earlier provisioned deploy notwithstanding)
    held = deployed.held
    if deployed.event_pollers == ON_DEMAND_POLLERS:
        previous, held = {}, {}
    if options.poller_groups == UNGROUPED:
        assignment = dict.fromkeys(tenants, NO_GROUP)
    elif options.poller_groups:
        assignment = parse_assignment(options.poller_groups)
        given = [entry.partition("=")[0] for entry in options.poller_groups.split(",") if entry]
        twice = [tenant for tenant in assignment if given.count(tenant) > 1]
        if twice:
            return (
                (
                    f"RELAY_POLLER_GROUPS gives {_listed(twice)} more than one group: give each tenant once"
                    f" ({POLLER_GROUPS_DOC})"
                ),
                "",
                True,
            )
        missing = [tenant for tenant in tenants if tenant not in assignment]
        if missing:
            return (
                (
                    f"RELAY_POLLER_GROUPS gives {_listed(missing)} no group: give each tenant of TENANTS one"
                    f" (0-9, a-z), or leave it unset and make deploy assigns them ({POLLER_GROUPS_DOC})"
                ),
                "",
                True,
            )
    else:
        assignment = assign_poller_groups(tenants, len(sources), maximum_pollers, deployed.taken, previous, held)
    refusal = poller_group_refusal(
        assignment, tenants, len(sources), maximum_pollers, deployed.taken, options.msk_cluster_arn, previous, held
    )
    return refusal, render_assignment(assignment), True


def main(arguments: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--prog", default="deploy_check", help="the name the refusal starts with")
    commands = parser.add_subparsers(dest="command", required=True)
    limits = commands.add_parser("limits", help="refuse more tenants than one stack serves")
    limits.add_argument("--tenants", required=True, help="the comma-separated tenant ids (TENANTS)")
    limits.add_argument(
        "--peer-aliases", type=int, choices=(0, 1, 2), default=0, help="how many peer cluster aliases are given"
    )
    cells = commands.add_parser("cells", help="refuse a tenant another cell on the cluster or of the Stage serves")
    cells.add_argument("--stack-name", required=True, help="the stack being deployed")
    cells.add_argument("--cell", default="", help="its cell (CELL; empty: the unnamed cell)")
    cells.add_argument("--tenants", required=True, help="the comma-separated tenant ids (TENANTS)")
    cells.add_argument("--msk-cluster-arn", required=True, help="the stack's MSK cluster (MSK_CLUSTER_ARN)")
    cells.add_argument("--stage", required=True, help="the stack's Stage (samconfig.toml's parameter overrides)")
    cells.add_argument(
        "--peer-cluster-aliases",
        default=",",
        help="PEER_CLUSTER_ALIAS_1,PEER_CLUSTER_ALIAS_2 as given (an empty one: the deployed stack's stays)",
    )
    cells.add_argument(
        "--cleared-peer-cluster-aliases",
        default="",
        help="the numbers (1, 2; separated by spaces or commas) of the peer cluster aliases the deploy clears",
    )
    cells.add_argument(
        "--peer-regions", default="", help="multi-Region mode: the comma-separated peer Regions, whose cells count too"
    )
    groups = commands.add_parser(
        "groups", help="print the RelayPollerGroups to deploy with, or refuse one Lambda would refuse"
    )
    groups.add_argument("--stack-name", required=True, help="the stack being deployed")
    groups.add_argument("--tenants", required=True, help="the comma-separated tenant ids (TENANTS)")
    groups.add_argument("--msk-cluster-arn", required=True, help="the stack's MSK cluster (MSK_CLUSTER_ARN)")
    groups.add_argument(
        "--dispatch-sources", required=True, help="the DispatchSources the stack deploys with (what `cells` prints)"
    )
    groups.add_argument(
        "--maximum-pollers", default="", help="RelayMaximumPollers if given (empty: the deployed stack's, or 3)"
    )
    groups.add_argument(
        "--event-pollers", default="", help="RelayEventPollers if given (empty: the deployed stack's, or provisioned)"
    )
    groups.add_argument(
        "--poller-groups",
        default="",
        help=f"RELAY_POLLER_GROUPS: tenant=group,... checked instead of computed, or {UNGROUPED} (empty: computed)",
    )
    options = parser.parse_args(arguments)
    tenants = options.tenants.split(",")
    if options.command == "limits":
        refusal = limit_refusal(tenants, options.peer_aliases)
    elif options.command == "groups":
        try:
            refusal, assignment, provisioned = _groups(options, tenants)
        except (BotoCoreError, ClientError) as error:
            print(
                f"{options.prog}: could not read the cluster's poller groups from Lambda and CloudFormation ({error}):"
                " nothing deployed",
                file=sys.stderr,
            )
            return 3
        if refusal is None:
            print(f"RelayPollerGroups={assignment}")
        if refusal is None and provisioned and set(parse_assignment(assignment).values()) == {NO_GROUP}:
            print(
                f"{options.prog}: RELAY_POLLER_GROUPS={options.poller_groups}: each MSK event source mapping's pollers"
                f" on an EPU of its own, about $135 a month a mapping whatever its traffic ({POLLER_GROUPS_DOC})",
                file=sys.stderr,
            )
    else:
        peers = dict.fromkeys(region for region in options.peer_regions.split(",") if region)
        try:
            deployed = deployed_cells(boto3.client("cloudformation"))
            for region in peers:
                deployed += deployed_cells(boto3.client("cloudformation", region_name=region), region)
        except (BotoCoreError, ClientError) as error:
            print(
                f"{options.prog}: could not read the deployed cells from CloudFormation ({error}): nothing deployed",
                file=sys.stderr,
            )
            return 3
        first, _, second = options.peer_cluster_aliases.partition(",")
        cleared = frozenset(int(n) for n in options.cleared_peer_cluster_aliases.replace(",", " ").split())
        given = (first, second)
        refusal = kept_aliases_refusal(deployed, options.stack_name, tenants, given, cleared) or cell_refusal(
            deployed, options.stack_name, options.cell, tenants, options.msk_cluster_arn, options.stage
        )
        if refusal is None:
            aliases, _ = peer_cluster_aliases(deployed, options.stack_name, given, cleared)
            print(f"DispatchSources={dispatch_sources(aliases)}")
    if refusal is not None:
        print(f"{options.prog}: {refusal}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
