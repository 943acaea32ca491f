"""How `poimen dlq` fails: its exit codes, its errors (each one line: the cause and the fix), and the
translation of a failed AWS call into one of them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import botocore.exceptions

EXIT_OK = 0
EXIT_REMAINING = 1  # some dead letters of the chosen kinds are still there: failing again, or not sendable
EXIT_USAGE = 2  # bad arguments, unknown ID, or redrive refused / not confirmed
EXIT_UNREACHABLE = 3  # AWS or the admission API unreachable, or refusing the caller
EXIT_INTERRUPTED = 130  # Ctrl-C: redrive stopped after the record in flight, as the CLI's Ctrl-C code


class DlqError(Exception):
    """Ends `poimen dlq` with one line (the cause and the fix) and `exit_code`."""

    exit_code = EXIT_UNREACHABLE


class UsageError(DlqError):
    exit_code = EXIT_USAGE


class DeadLetterNotFound(UsageError):
    """No dead letter has this ID."""


class AwsUnavailable(DlqError):
    """SQS or S3 could not be reached, or refused the caller."""


class ApiUnavailable(DlqError):
    """The admission API could not be reached, or answered 408, 429 or 5xx: stop, try again later."""


class ApiRefused(DlqError):
    """The admission API refused the caller itself (401, 403, 404, 405, a redirect): every record would."""


class Interrupted(DlqError):
    """Ctrl-C during a redrive: it stopped once the record in flight was done and recorded."""

    exit_code = EXIT_INTERRUPTED


@contextmanager
def aws_call(action: str, fix: str) -> Iterator[None]:
    """Turns a failed AWS call into one line: what could not be done, why, and what to check."""
    try:
        yield
    except botocore.exceptions.NoCredentialsError as error:
        raise AwsUnavailable(
            f"no AWS credentials to {action}: configure them (AWS_PROFILE, aws sso login), "
            "or against poimen dev add --dev-key"
        ) from error
    except botocore.exceptions.ClientError as error:
        detail = error.response.get("Error", {})
        raise AwsUnavailable(
            f"AWS refused to {action} ({detail.get('Code', '?')}: {detail.get('Message', '')}): {fix}"
        ) from error
    except botocore.exceptions.BotoCoreError as error:
        raise AwsUnavailable(f"cannot {action} ({error}): check --aws-endpoint, --region and the network") from error
