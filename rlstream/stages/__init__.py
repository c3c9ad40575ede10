"""The loop's stream processors: rollout (its engines are rlstream/engine/), env, reward,
teacher (a package: scoring, tokenizer alignment, its replay), and replay (the reward or the teacher stage
over a past range).

Each is decode -> handle -> encode only: a Stage subclass whose handler maps typed
input records to typed outputs; the Kafka plumbing is the runtime's.
"""
