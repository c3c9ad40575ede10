"""Code that runs inside the sandbox, never imported by rlstream: each file is read as text and handed to a
sandboxed interpreter (``hook.py`` as its ``sitecustomize``, with ``_CONFIG`` prepended; ``init.py`` as the
trusted first process, ``python -I -c``). Real files rather than strings, so that they are linted and read as code.
"""
from pathlib import Path


def source(name: str) -> str:
    """The text of ``name`` (hook or init) in this folder."""
    return (Path(__file__).parent / f"{name}.py").read_text()
