"""The trainer: windowed-FIFO consumption, advantages, losses, the update step and its engine (plain torch, DDP or
DeepSpeed ZeRO), micro-batches with gradient accumulation (``microbatch``), several ranks as one trainer
(``distributed``), the teacher's signal in the loss and which feedback a step may take (``distill``), the optional
supervised warm-up, and the service that trains and publishes policy versions.
"""
