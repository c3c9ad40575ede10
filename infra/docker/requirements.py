"""Print what the rlstream image installs before the package itself, one a line (constraints.txt pins each):
the dependencies in pyproject.toml and its build backend. The Dockerfile installs them and prepare.sh makes the
wheelhouse of them, so both list the same packages. Standard library only: it runs on the base image's Python.

    python3 requirements.py PYPROJECT
"""
import sys
import tomllib

with open(sys.argv[1], "rb") as fh:
    pyproject = tomllib.load(fh)
print("\n".join([*pyproject["project"]["dependencies"], *pyproject["build-system"]["requires"]]))
