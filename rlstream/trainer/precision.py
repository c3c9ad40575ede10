"""The trainer's precision on each device: parameter dtype, autocast, published dtype, from ``--dtype``,
``--autocast`` and ``--publish-dtype`` (each ``auto`` by default).

On CUDA the defaults are fp32 master weights under bf16 autocast, published in bf16. A bf16 checkpoint trained in
bf16 loses its updates: bf16 keeps 8 bits of mantissa, so a weight moves only by steps of about 2^-8 of itself, and
AdamW's update at lr 1e-6 (relative size ~1e-6) rounds to nothing. fp32 masters keep every update; bf16 autocast
keeps the matmuls at bf16 speed; bf16 is what the engines serve, at half the bytes to publish. On the CPU ``auto``
keeps what it always did (the checkpoint's own dtype, no autocast, published as trained): the tiny models of the
tests and the demo are fp32, and CPU bf16 matmuls are not faster there.

A GPU without bf16 (before Ampere) gets no autocast by default, and ``--autocast bf16`` there is refused.
Pure: the caller passes the device kind and whether it has bf16. Not run on a GPU in this project.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlstream.errors import UsageError


@dataclass(frozen=True)
class Precision:
    """Resolved knobs: ``dtype`` (a ``--dtype`` value: auto is the checkpoint's own), ``autocast`` (off, bf16),
    ``publish_dtype`` (a ``--publish-dtype`` value: auto is as trained)."""

    dtype: str
    autocast: str
    publish_dtype: str


def resolve_precision(device_type: str, dtype: str = "auto", autocast: str = "auto", publish_dtype: str = "auto",
                      bf16_supported: bool = True) -> Precision:
    """The trainer's precision on a ``device_type`` (cpu, cuda) device (module docstring)."""
    cuda = device_type == "cuda"
    if autocast == "auto":
        autocast = "bf16" if cuda and bf16_supported else "off"
    elif autocast == "bf16" and cuda and not bf16_supported:
        raise UsageError("--autocast bf16: this GPU has no bf16 (compute capability below 8.0); use --autocast off")
    if dtype == "auto" and cuda:
        dtype = "fp32"  # the master weights (module docstring), whatever the checkpoint's dtype
    if publish_dtype == "auto" and cuda and autocast == "bf16":
        publish_dtype = "bf16"
    return Precision(dtype, autocast, publish_dtype)
