"""What the benchmark scripts share, apart from the scripts themselves.

- ``loop``: a fresh run on the local broker and its stage processes (rlstream.infra.supervisor), a paced prompt
  source that can be async or behind a barrier, and the published policy versions (rlstream.kafka.tail);
- ``groups``: a consumer group's committed offsets, which show a stage's progress;
- ``workloads``: the reward functions stage processes load by dotted path, the seeded latency and length draws,
  and the trajectories the bus benchmarks produce;
- ``race``: a loop racing to a held-out target, versions scored off the clock (vs_trl, distill_vs_rl);
- ``stats``: percentiles;
- ``result``: every script's last line, ``RESULT <name> date=… commit=… load=… figures…``.
"""
