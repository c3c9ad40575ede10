"""End-to-end: the whole loop, every stage its own process."""
