"""The Kafka client's own error, named once for the rest of rlstream: a broker-side failure whose message says what
went wrong (the CLI prints it without a traceback)."""
from confluent_kafka import KafkaException

__all__ = ["KafkaException"]
