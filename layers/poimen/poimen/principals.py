"""Principal ARNs as grants must name them: only IAM and STS principals, roles without their path."""

from __future__ import annotations

import re
from dataclasses import dataclass

# IAM users (with their path), roles (path captured), the account root; STS assumed-role sessions and
# federated users. Names and paths use IAM's characters; session names may carry more (e.g. an e-mail).
_PRINCIPAL = re.compile(
    r"arn:(?P<partition>aws(?:-[a-z]+)*):(?:"
    r"iam::(?P<account>\d{12}):(?:root|user/(?:[\w+=,.@-]+/)*[\w+=,.@-]+"
    r"|role/(?P<path>(?:[\w+=,.@-]+/)+)?(?P<role>[\w+=,.@-]+))"
    r"|sts::\d{12}:(?:assumed-role/[\w+=,.@-]+/[\x21-\x7e]+|federated-user/[\w+=,.@-]+)"
    r")",
    re.ASCII,
)


class InvalidPrincipal(ValueError):
    """The string is not the ARN of an IAM or STS principal."""


@dataclass(frozen=True)
class GrantPrincipal:
    arn: str
    # Why `arn` differs from what was given, for the operator; None when it does not.
    note: str | None = None


def grant_principal(arn: str) -> GrantPrincipal:
    """The ARN a grant must carry for callers presenting `arn`, or InvalidPrincipal.

    A role's path is dropped: the role's sessions present `arn:<partition>:sts::<account>:
    assumed-role/<role>/<session>`, which carries no path, and admission matches that as
    `arn:<partition>:iam::<account>:role/<role>`. Sessions themselves are left to
    `poimen.admission.normalise_principal`.
    """
    match = _PRINCIPAL.fullmatch(arn)
    if match is None:
        raise InvalidPrincipal(
            f"{arn!r} is not an IAM or STS principal ARN (arn:aws:iam::<12-digit account>:role/<name>, "
            "...:user/<name>, or arn:aws:sts::<account>:assumed-role/<role>/<session>)"
        )
    if not match["path"]:
        return GrantPrincipal(arn)
    pathless = f"arn:{match['partition']}:iam::{match['account']}:role/{match['role']}"
    return GrantPrincipal(
        pathless,
        f"granting {pathless}, without the path /{match['path']}: sessions of the role present no path",
    )
