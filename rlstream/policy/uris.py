"""Where a weight store URI's folder is on this host: a ``file://`` or plain path as it is, any other fsspec URL
copied once under a cache. ``WeightStore`` writes the folders these read; the weights log's writer reads a LoRA
base's folder through them too, so they sit below both (``rlstream.policy.weights``, ``rlstream.policy.log_bases``).

A store folder is complete when its ``COMPLETE`` marker exists (``WeightStore``: written last, deleted first).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlparse

COMPLETE = "COMPLETE"


def is_local(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


def local_path(uri: str) -> Path:
    """The folder a file:// weights URI points at."""
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme == "file" else uri)


def fetch_uri(uri: str, cache_dir: Path) -> Path:
    """The local folder of a store URI: a file:// or plain path as it is; a remote folder copied under
    ``cache_dir`` (once; OSError when it is not a complete version)."""
    if is_local(uri):
        return local_path(uri)
    from fsspec.core import url_to_fs
    fs, remote = url_to_fs(uri)
    remote = remote.rstrip("/")
    parsed = urlparse(uri)
    final = Path(cache_dir) / "store" / (parsed.scheme + "_" + (parsed.netloc + parsed.path).strip("/").replace("/", "_"))
    if (final / COMPLETE).exists():
        return final
    if not fs.exists(f"{remote}/{COMPLETE}"):
        raise FileNotFoundError(f"{uri}: not a complete version in the store (pruned, or not written yet)")
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in fs.find(remote):
        rel = path[len(remote):].lstrip("/")
        if rel == COMPLETE:
            continue
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(tmp / rel))
    (tmp / COMPLETE).write_text("copied")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final
