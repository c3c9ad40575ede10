"""Models the loop trains and serves: the built-in tiny character model and its tokenizer, and the
token log-prob computation that trainer and teacher share.
"""
