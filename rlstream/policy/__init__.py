"""What a policy is between processes: the weight store that holds each version's checkpoint, the
watcher that follows the policy-versions topic, and the staleness rules (η) that trainer and rollout share.
"""
