"""check-pins (infra/check_pins.py): pins with environment markers count only where they hold; an installed package
missing from the profile's files, or at another version, fails the check with its name."""
import importlib.util
import subprocess
import sys
from importlib import metadata

from tests.helpers import ROOT

spec = importlib.util.spec_from_file_location("check_pins", ROOT / "infra" / "check_pins.py")
check_pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_pins)


def test_markers_select_pins_for_this_python(tmp_path):
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = tmp_path / "c.txt"
    path.write_text("# a comment\n-c other.txt\nFoo_Bar==1.0\n"
                    f'baz==2.0; python_version == "{here}"\n'
                    f'baz==3.0; python_version != "{here}"\n'
                    "qux==4.0  # why\n")
    assert check_pins.pins([str(path)]) == {("foo-bar", "1.0"), ("baz", "2.0"), ("qux", "4.0")}


def test_unpinned_and_wrong_version_are_named(tmp_path):
    pytest_version = metadata.version("pytest")
    path = tmp_path / "c.txt"
    path.write_text(f"pytest=={pytest_version}.post999\n")  # pytest at another version; nothing else pinned
    proc = subprocess.run([sys.executable, str(ROOT / "infra" / "check_pins.py"), str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert f"pytest=={pytest_version}" in proc.stderr and "installed but not pinned" in proc.stderr

