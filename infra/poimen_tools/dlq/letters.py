"""The inbox relay's dead-letter queue (SQS): how its messages are read, and the queue itself."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import botocore.exceptions

from poimen.dead_letter import holds_value, is_dead_letter, record_id, recorded_retention
from poimen_tools.dlq.errors import aws_call
from poimen_tools.dlq.model import DeadLetter, Parcel, coordinates, older, timestamp
from poimen_tools.dlq.parked import failed_batch, is_on_failure_record, unrecognised

# Long polling asks every SQS server, so an empty answer means an empty queue (short polling samples).
SQS_WAIT_SECONDS = 1
_QUEUE_FIX = (
    "check --queue-url (stack output RelayDeadLetterQueueUrl) and that you may Receive, Send, Delete and "
    "ChangeMessageVisibility on it"
)


def parse_message(message_id: str, body: str, sent_at: datetime | None = None) -> Parcel:
    """One SQS message of the relay's queue: a relay dead letter, or an on-failure record sent to SQS
    (metadata only, as Lambda sends to SQS destinations), or something else (unrecognised)."""
    parcel_id = f"sqs:{message_id}"
    try:
        document = json.loads(body)
    except ValueError:
        return unrecognised(parcel_id, sent_at, "the message body is not JSON")
    if is_dead_letter(document):
        record: dict[str, Any] = document["record"]
        reason: dict[str, Any] = document["reason"]
        kind = str(reason["kind"])
        at = older(timestamp(document.get("deadLetteredAt")), sent_at)
        blocked = None
        if not holds_value(record):
            blocked = f"value omitted; read it again from Kafka at {coordinates(record)}"
        retention = recorded_retention(document)
        letter = DeadLetter(parcel_id, kind, parcel_id, at, reason, record, blocked, record_id(record), retention)
        return Parcel(parcel_id, kind, at, [letter], 1)
    if is_on_failure_record(document):
        return failed_batch(parcel_id, document, sent_at)
    return unrecognised(parcel_id, sent_at, "neither a relay dead letter nor a Lambda on-failure record")


class DeadLetterQueue:
    """The relay's dead-letter queue. Every message read stays hidden until deleted or released."""

    def __init__(self, sqs: Any, url: str) -> None:
        self._sqs = sqs
        self.url = url
        self._held: dict[str, str] = {}  # MessageId -> latest receipt handle

    def read_all(self, visibility: int) -> list[Parcel]:
        """Every message, each read once and hidden for `visibility` seconds (SQS cannot peek)."""
        parcels: dict[str, Parcel] = {}
        while True:
            with aws_call(f"read the dead-letter queue {self.url}", _QUEUE_FIX):
                answer = self._sqs.receive_message(
                    QueueUrl=self.url,
                    MaxNumberOfMessages=10,
                    VisibilityTimeout=visibility,
                    WaitTimeSeconds=SQS_WAIT_SECONDS,
                    MessageSystemAttributeNames=["SentTimestamp"],
                )
            fresh = 0
            for message in answer.get("Messages", []):
                message_id = message["MessageId"]
                # Seen again only if the scan outlived the visibility timeout: keep the newest handle.
                self._held[message_id] = message["ReceiptHandle"]
                if message_id in parcels:
                    parcels[message_id].receipt_handle = message["ReceiptHandle"]
                    continue
                fresh += 1
                sent = message.get("Attributes", {}).get("SentTimestamp")
                sent_at = datetime.fromtimestamp(int(sent) / 1000, UTC) if sent else None
                parcel = parse_message(message_id, message["Body"], sent_at)
                parcel.receipt_handle = message["ReceiptHandle"]
                parcels[message_id] = parcel
            if not fresh:
                return list(parcels.values())

    def delete(self, parcel: Parcel) -> None:
        message_id = parcel.id.removeprefix("sqs:")
        with aws_call(f"delete {parcel.id} from {self.url}", _QUEUE_FIX):
            self._sqs.delete_message(QueueUrl=self.url, ReceiptHandle=self._held.get(message_id, parcel.receipt_handle))
        self._held.pop(message_id, None)

    def send(self, body: str, attributes: dict[str, dict[str, str]]) -> str:
        """A relay dead letter: its body, and its record's coordinates as message attributes."""
        with aws_call(f"send a dead letter to {self.url}", _QUEUE_FIX):
            answer = self._sqs.send_message(QueueUrl=self.url, MessageBody=body, MessageAttributes=attributes)
        message_id: str = answer["MessageId"]
        return message_id

    def release(self) -> None:
        """Make every message still held visible again, at once rather than when its timeout ends.
        Best effort: whatever is not released reappears by itself."""
        held = list(self._held.values())
        self._held.clear()
        for start in range(0, len(held), 10):
            entries = [
                {"Id": str(index), "ReceiptHandle": handle, "VisibilityTimeout": 0}
                for index, handle in enumerate(held[start : start + 10])
            ]
            try:
                self._sqs.change_message_visibility_batch(QueueUrl=self.url, Entries=entries)
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                return
