"""What a policy is between processes: the weight store that holds each version's checkpoint (local or any fsspec
URI, with its retention), the weights log that carries versions through Kafka to hosts that share no path with the
trainer (anchors and deltas, ``weight_log``; content hash and payloads, ``deltas``; safetensors files and blobs
written and read without copies of their bytes, ``tensorfile``), the watcher that follows the policy-versions
topic, the staleness rules (η) that trainer and rollout share, and the load probe (``probe``: the trainer's
log-probs of a fixed token sequence, which every engine must reproduce after a load).
"""
