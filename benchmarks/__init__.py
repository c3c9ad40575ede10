"""rlstream's benchmarks: each script answers one question (see README.md). Run them from the repository root as
modules, ``python -m benchmarks.<script>``; what they share is in ``benchmarks.harness``."""
