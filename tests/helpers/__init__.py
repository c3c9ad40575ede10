"""Helpers for the tests: typed records and their produce/read (``tests.helpers.kafka``).

Fixtures (the broker, a fresh run, stage processes) are in tests/conftest.py.
"""
from pathlib import Path

#: The repository root: the working directory of stage processes and CLI runs the tests start.
ROOT = Path(__file__).resolve().parents[2]
