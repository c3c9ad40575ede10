"""Every Kafka client of rlstream, and nothing else touches confluent_kafka.

Topics and admin, consumer-group membership, the in-flight commit protocol
(pipelined offsets with a done-ahead bitmap), the one transactional producer
(init with retry, fencing, replacement after a fatal error, bounded calls),
dead letters, decoding a message into a typed record with its headers, typed
produce, and the tail reader that follows a topic to its end.
"""
