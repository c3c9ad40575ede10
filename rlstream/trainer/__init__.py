"""The trainer: windowed-FIFO consumption and the gate samples pass to it (``gate``), advantages, losses, the update
step and its engine (plain torch or DDP: ``engine``; DeepSpeed ZeRO or FSDP2, which shard state across ranks:
``sharded``), micro-batches with gradient accumulation (``microbatch``), several ranks as one trainer
(``distributed``), the teacher's signal in the loss and which feedback a step may take (``distill``), the loop's
chain per step (``chain``), the optional supervised warm-up, and the service that trains and publishes policy
versions.
"""
