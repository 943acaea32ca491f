"""Look-ups of a consumer group's committed offsets, in a process of its own (benchmarks.soak's).

Run: `python -m benchmarks.committed BOOTSTRAP GROUP`; each line on stdin, a JSON list of [topic, partition], is
one look-up, answered by one line on stdout: a JSON list of [topic, partition, offset] (a partition with no
commit is 0), or a JSON object {"error": cause}, also when a partition's answer is an error (its offset is
unknown, not 0). It ends at the end of its input (its caller gone). A process of its own because librdkafka's
admin client, asked while a broker restarts, can abort the process it runs in (confluent-kafka 2.16.1:
"rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0' failed", seen in the soak at its broker
restart); then only the look-up under way is lost, and the caller starts another process.
One process for every look-up, not one each: a Python interpreter importing confluent-kafka costs 0.2 s of CPU,
which a look-up every 0.2 s would take from the stack the soak measures.
"""

from __future__ import annotations

import json
import sys

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

# Of one look-up: the request's, and the wait for its answer.
REQUEST_TIMEOUT_SECONDS = 5
ANSWER_TIMEOUT_SECONDS = 10


def committed(admin: AdminClient, group: str, partitions: list[TopicPartition]) -> list[tuple[str, int, int]]:
    request = ConsumerGroupTopicPartitions(group, partitions)
    (future,) = admin.list_consumer_group_offsets([request], request_timeout=REQUEST_TIMEOUT_SECONDS).values()
    answer = future.result(timeout=ANSWER_TIMEOUT_SECONDS).topic_partitions
    failed = [tp for tp in answer if tp.error is not None]
    if failed:  # 0 would say every record of it may come again
        raise KafkaException(failed[0].error)
    return [(tp.topic, tp.partition, max(int(tp.offset), 0)) for tp in answer]


def main() -> int:
    bootstrap, group = sys.argv[1:3]
    admin = _client(bootstrap)
    # Clients given up on are kept: destroying one with a request outstanding may block.
    abandoned: list[AdminClient] = []
    for line in sys.stdin:
        partitions = [TopicPartition(topic, partition) for topic, partition in json.loads(line)]
        try:
            answer: object = committed(admin, group, partitions)
        except Exception as error:  # the broker away, its coordinator loading: the caller asks again
            answer = {"error": f"{type(error).__name__}: {error}"}
            # A client that outlived a broker restart can time out on every later request (confluent-kafka 2.x;
            # a new client answers at once): the next look-up uses a new one.
            abandoned.append(admin)
            admin = _client(bootstrap)
        print(json.dumps(answer), flush=True)
    return 0


def _client(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})


if __name__ == "__main__":
    sys.exit(main())
