"""Integration tests against the real broker (and chDB), with real stage processes."""
