"""rlstream's tests, a package so that helpers import as ``tests.helpers...`` and stage processes started with the
repository root as their working directory load ``tests.reward_fns:...`` and ``tests.bad_envs`` by dotted path."""
