"""check-pins: fail when a package installed in this Python is not pinned, at its version, in the profile's files.

Usage: python infra/check_pins.py [--report REPORT.json] CONSTRAINTS [CONSTRAINTS ...]  (run by the Python whose
packages it checks). With --report, the packages checked are those of a `pip install --dry-run --report` (what
would be installed), not those installed: how CI checks the GPU profile on a machine without a GPU.
A profile is one or more constraints files (constraints.txt; constraints-gpu.txt; constraints.txt plus
constraints-trl.txt for TRL's venv). A pin may carry an environment marker (`pkg==1.0; python_version >= "3.13"`):
it counts only where the marker holds, so one file serves every supported Python. Only the standard library and
`packaging` (pip's vendored copy where it is not installed) are used: this runs before anything else is known to be
installed.
"""
import argparse
import json
import re
import sys
from importlib import metadata

IGNORED = {"pip", "setuptools", "wheel", "rlstream"}  # the installer's own, and the editable project itself


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def marker_holds(marker: str) -> bool:
    """Whether an environment marker holds on this Python. Imported here, not at the top: importing pip into a
    process turns setuptools' distutils shim off for the rest of it, and a later ``import setuptools`` (torch's
    cpp_extension, inside vLLM) then fails; a test that imports this module must not do that to its process."""
    try:
        from packaging.markers import Marker
    except ImportError:  # a bare venv: pip's own copy
        from pip._vendor.packaging.markers import Marker
    return Marker(marker).evaluate()


def pins(paths: list[str]) -> set[tuple[str, str]]:
    """(name, version) of every pin in the files whose marker holds on this Python."""
    out = set()
    for path in paths:
        for raw in open(path):
            line = raw.split(" #")[0].strip()
            if not line or line.startswith(("#", "-")) or "==" not in line:
                continue
            spec, _, marker = line.partition(";")
            if marker.strip() and not marker_holds(marker.strip()):
                continue
            name, _, version = spec.partition("==")
            out.add((norm(name.strip()), version.strip()))
    return out


def main(paths: list[str], report: str | None = None) -> int:
    pinned = pins(paths)
    if report:
        seen = {(norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in json.load(open(report))["install"]}
    else:
        seen = {(norm(d.metadata["Name"]), d.version) for d in metadata.distributions()}
    loose = sorted(f"{n}=={v}" for n, v in seen if n not in IGNORED and (n, v) not in pinned)
    if loose:
        print(f"{'would be installed' if report else 'installed'} but not pinned in {' + '.join(paths)}: {loose}", file=sys.stderr)
        return 1
    if report:
        versions = dict(seen)
        print(f"resolves: {len(seen)} packages (vllm {versions.get('vllm', '-')}, torch {versions.get('torch', '-')}),"
              f" all pinned in {' + '.join(paths)}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="fail when a package is not pinned in the profile's files")
    parser.add_argument("--report", help="check a `pip install --dry-run --report` file instead of this Python")
    parser.add_argument("constraints", nargs="+")
    args = parser.parse_args()
    sys.exit(main(args.constraints, args.report))
