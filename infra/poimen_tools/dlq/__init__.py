"""`poimen dlq`: the records that did not become runs (relay dead letters in SQS, parked batches in S3),
listed, shown and redriven. The command is `command`; parsing and stores are `letters` and `parked`,
redrive bookkeeping `redrive`, presentation `render`."""

from poimen_tools.dlq.command import add_dlq_commands, main, run_dlq
from poimen_tools.dlq.errors import EXIT_OK, EXIT_REMAINING, EXIT_UNREACHABLE, EXIT_USAGE

__all__ = ["EXIT_OK", "EXIT_REMAINING", "EXIT_UNREACHABLE", "EXIT_USAGE", "add_dlq_commands", "main", "run_dlq"]
