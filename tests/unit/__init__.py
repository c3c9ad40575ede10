"""Unit tests: no broker, no archive server."""
