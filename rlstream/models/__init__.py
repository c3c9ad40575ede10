"""Models the loop trains and serves: loading the user's model (a Hugging Face folder or hub id, its dtype,
context and chat template: ``loading``), the built-in tiny character model and its tokenizer (``tiny``), and the
token log-prob computation that trainer and teacher share, with rows packed padding-free (``logprobs``).
"""
