"""The arithmetic recipe: GSM8K-style word problems and a small chat model that RL improves (see build.py)."""
