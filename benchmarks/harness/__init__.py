"""What the benchmark scripts share, apart from the scripts themselves.

- ``loop``: a fresh run on the local broker and its stage processes (rlstream.infra.supervisor), a paced prompt
  source that can be async or behind a barrier, and the published policy versions (rlstream.kafka.tail);
- ``groups``: a consumer group's committed offsets, which show a stage's progress;
- ``workloads``: the reward functions stage processes load by dotted path, the seeded latency and length draws,
  and the trajectories the bus benchmarks produce;
- ``books``: what a loop's run is checked by (nothing lost, nothing duplicated, versions in order, the trainer's
  train-at-most-once sum, the archive equal to the topics): chaos and three_hosts;
- ``scratch``: a benchmark's run names, and its topics and folders deleted when it is done;
- ``race``: a loop racing to a held-out target, versions scored off the clock (vs_trl, distill_vs_rl);
- ``stats``: percentiles;
- ``result``: every script's last line, ``RESULT <name> date=… commit=… load=… figures…``;
- ``record``: every run's raw result, the one call each benchmark makes at its end,
  ``record(name, figures: dict, goals: list[Goal] = (), seed=None, units=None)``: it prints the RESULT line and
  appends one JSON line (command, commit and dirtiness, UTC date, load before and after, machine, seed, figures with
  units, goals) to ``benchmarks/results/<name>.jsonl``; ``RLSTREAM_BENCH_RESULTS=DIR`` writes under DIR instead,
  ``RLSTREAM_BENCH_RECORD=0`` writes nothing, and a benchmark a test starts never writes into the repository;
- ``verdict``: ``Goal(figure, ">=" or "<=", target)`` and the one rule judging a figure's runs against it
  (met / missed / within noise / one run, no spread);
- ``tables``: ``python -m benchmarks.harness.tables [--write | --check]``: benchmarks/README.md's generated tables
  from the results files (per benchmark and configuration, per figure: runs, median, min–max, goal, verdict, raw
  lines).
"""
