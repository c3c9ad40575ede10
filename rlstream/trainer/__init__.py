"""The trainer: windowed-FIFO consumption, advantages, losses, the update step and its engine (plain torch or
DeepSpeed), the optional supervised warm-up, and the service that trains and publishes policy versions.
"""
