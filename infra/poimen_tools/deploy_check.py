"""What `make build` and `make deploy` refuse before SAM runs: more tenants than one stack holds.

One stack serves at most MAX_EVENT_SOURCE_MAPPINGS MSK event source mappings (one per tenant and dispatch
topic: the tenant's own, and one per peer cluster alias) and a `Tenants` list of at most
MAX_TENANT_CHARACTERS characters (the admission function carries it in its environment, 4 KB for all its
variables). tests/unit/test_template_quotas.py transforms the template at these maxima and checks every
quota AWS enforces at deploy; docs/operations.md#how-many-tenants-a-stack-serves gives the reasons.

Run by the SAM CLI's interpreter (the Makefile's build and deploy need nothing else), standard library only:

    .venv-sam/bin/python infra/poimen_tools/deploy_check.py limits --tenants a,b --peer-aliases 2 --prog "make build"
"""

from __future__ import annotations

import argparse
import sys

# CloudFormation's 500 resources per stack, less 100 for everything else (about 50 today): room to grow.
MAX_EVENT_SOURCE_MAPPINGS = 400
# The admission function's variables are 4 KB in all (Lambda quotas); RELAY_TENANTS is the Tenants list, and
# the other variables take at most about 600 bytes (the quota test renders them at their longest).
MAX_TENANT_CHARACTERS = 3000
CELLS = "docs/operations.md#cells"


def max_tenants(peer_aliases: int) -> int:
    """The tenants one stack serves with `peer_aliases` peer cluster aliases (each adds a mapping per tenant)."""
    return MAX_EVENT_SOURCE_MAPPINGS // (1 + peer_aliases)


def limit_refusal(tenants: list[str], peer_aliases: int) -> str | None:
    """Why one stack cannot serve `tenants` (one line that says how to split them), or None if it can."""
    most = max_tenants(peer_aliases)
    aliases = ["no peer cluster alias", "one peer cluster alias", "two peer cluster aliases"][peer_aliases]
    if len(tenants) > most:
        return (
            f"{len(tenants)} tenants, and one stack serves at most {most} with {aliases} (one MSK event source"
            f" mapping per tenant and dispatch topic, {MAX_EVENT_SOURCE_MAPPINGS} a stack): split them into cells"
            f" of at most {most} tenants, one stack each (CELL=<name>, {CELLS})"
        )
    characters = len(",".join(tenants))
    if characters > MAX_TENANT_CHARACTERS:
        return (
            f"TENANTS is {characters:,} characters, and one stack serves at most {MAX_TENANT_CHARACTERS:,} (the"
            f" admission function carries the list in its 4 KB of environment variables): split them into cells"
            f" of at most {MAX_TENANT_CHARACTERS:,} characters, one stack each (CELL=<name>, {CELLS})"
        )
    return None


def main(arguments: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--prog", default="deploy_check", help="the name the refusal starts with")
    commands = parser.add_subparsers(dest="command", required=True)
    limits = commands.add_parser("limits", help="refuse more tenants than one stack serves")
    limits.add_argument("--tenants", required=True, help="the comma-separated tenant ids (TENANTS)")
    limits.add_argument("--peer-aliases", type=int, default=0, help="how many peer cluster aliases are given")
    options = parser.parse_args(arguments)
    refusal = limit_refusal([t for t in options.tenants.split(",") if t], options.peer_aliases)
    if refusal is not None:
        print(f"{options.prog}: {refusal}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
