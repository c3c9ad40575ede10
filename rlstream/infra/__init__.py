"""The local machinery a loop runs on: the Apache Kafka broker (KRaft, one or three nodes) that `rlstream up`
starts from Maven jars, Kafka's own command-line tools on the same jars (kafka_tools), the compose stack's broker
image written from the same settings (broker_image), and the supervisor that starts, watches, kills and restarts
stage processes.
"""
