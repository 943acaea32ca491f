"""One look-up of a consumer group's committed offsets, in a process of its own (benchmarks.soak's).

Run: `python -m benchmarks.committed BOOTSTRAP GROUP` with a JSON list of [topic, partition] on stdin; prints
a JSON list of [topic, partition, offset] (a partition with no commit is 0) and exits 0, or exits 1 with the
cause on stderr. A process of its own because librdkafka's admin client, asked while a broker restarts,
can abort the process it runs in (confluent-kafka 2.16.1: "rd_kafka_enq_once_del_source_return: Assertion
`eonce->refcnt > 0' failed", seen in the soak at its broker restart); then only this look-up is lost.
"""

from __future__ import annotations

import json
import sys

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

# Of one look-up: the request's, and the wait for its answer.
REQUEST_TIMEOUT_SECONDS = 5
ANSWER_TIMEOUT_SECONDS = 10


def committed(bootstrap: str, group: str, partitions: list[TopicPartition]) -> list[tuple[str, int, int]]:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    request = ConsumerGroupTopicPartitions(group, partitions)
    (future,) = admin.list_consumer_group_offsets([request], request_timeout=REQUEST_TIMEOUT_SECONDS).values()
    answer = future.result(timeout=ANSWER_TIMEOUT_SECONDS).topic_partitions
    return [(tp.topic, tp.partition, max(int(tp.offset), 0)) for tp in answer]


def main() -> int:
    bootstrap, group = sys.argv[1:3]
    partitions = [TopicPartition(topic, partition) for topic, partition in json.load(sys.stdin)]
    try:
        offsets = committed(bootstrap, group, partitions)
    except Exception as error:  # the broker away, its coordinator loading: the caller asks again
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(offsets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
