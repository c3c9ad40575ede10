"""The exactly-once stage runtime: the Stage API that stages implement, the runner that drives one, and the process
lifecycle (``lifecycle.py``: signals, stop deadline, exit codes) that every ``rlstream run`` process lives by.

A stage decodes nothing and produces nothing itself: it receives typed input
records and returns typed outputs. The runner reads them from an input source
(a consumer group, a bounded offset range, or pages of the archive), calls the
stage, and commits outputs and input positions in one Kafka transaction.
"""
