"""The local machinery a loop runs on: the Apache Kafka broker (KRaft, one or three nodes) that `rlstream up`
starts from Maven jars, and the supervisor that starts, watches, kills and restarts stage processes.
"""
