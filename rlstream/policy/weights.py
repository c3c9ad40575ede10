"""The weight store: one safetensors folder per policy version, written before it is announced.

A URI names it: ``file:///abs/dir`` or a plain path (the default), laid out as
``<root>/<policy>/v<version>/``. Each folder is a complete transformers
checkpoint (config, tokenizer, model.safetensors), so any engine loads it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

COMPLETE = "COMPLETE"


class WeightStore:
    """A local-folder weight store (S3-compatible buckets would slot in behind the same methods)."""

    def __init__(self, uri: str):
        parsed = urlparse(uri)
        if parsed.scheme not in ("", "file"):
            raise ValueError(f"weight store {uri!r}: only file:// or a local path is supported here")
        self.root = Path(parsed.path if parsed.scheme == "file" else uri).resolve()

    def uri(self, policy: str, version: int) -> str:
        return (self.root / policy / f"v{version}").as_uri()

    def path(self, policy: str, version: int) -> Path:
        return self.root / policy / f"v{version}"

    def put(self, policy: str, version: int, write) -> str:
        """Write a version through ``write(folder)`` atomically; return its URI."""
        final = self.path(policy, version)
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        (tmp / COMPLETE).write_text(str(version))
        shutil.rmtree(final, ignore_errors=True)
        # A reader never sees a half-written version: the folder appears whole.
        os.replace(tmp, final)
        return final.as_uri()

    def versions(self, policy: str) -> list[int]:
        """Complete versions in the store, oldest first."""
        folder = self.root / policy
        if not folder.is_dir():
            return []
        found = []
        for p in folder.glob("v*"):
            if p.name[1:].isdigit() and (p / COMPLETE).exists():
                found.append(int(p.name[1:]))
        return sorted(found)

    def prune(self, policy: str, keep_from: int, keep: set[int] = frozenset()) -> list[int]:
        """Delete versions older than ``keep_from`` (what η can no longer need), except ``keep``."""
        removed = []
        for v in self.versions(policy):
            if v < keep_from and v not in keep:
                shutil.rmtree(self.path(policy, v), ignore_errors=True)
                removed.append(v)
        return removed


def local_path(uri: str) -> Path:
    """The folder a file:// weights URI points at."""
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme == "file" else uri)


def tokenizer_hash(folder: Path) -> str:
    """A short hash of the tokenizer files, to catch a teacher or engine with another tokenizer."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        p = folder / name
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]
