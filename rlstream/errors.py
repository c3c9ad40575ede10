"""Errors whose message tells the user what to do; the CLI prints them without a traceback."""


class UserError(Exception):
    """A problem with the user's setup or input, not a bug (exit code 1)."""


class UsageError(UserError):
    """A wrong command-line argument or setting (exit code 2)."""


class RestartToResume(Exception):
    """Not a bug and not the user's: this process cannot go on, and a restart of it resumes from what the topics
    say (exit code 75, EX_TEMPFAIL; every supervisor rlstream ships restarts a process that exits non-zero)."""

    EXIT_CODE = 75


#: Optional packages, by the name they are imported as: the command that installs each (run from the checkout).
INSTALL_COMMANDS = {
    "vllm": "make setup-vllm (vLLM's CPU build) or make setup-gpu (its CUDA build)",
    "faust": "make side-installs (faust-streaming goes in beside pip's resolver: see the Makefile)",
    "mode": "make side-installs (faust-streaming's requirements)",
    "aiokafka": "make side-installs (faust-streaming's requirements)",
    "sglang": "make setup-sglang",
    "flash_attn": "make setup-gpu WITH_FLASH_ATTN=1",
    "mkdocs": "pip install -c constraints.txt -e '.[docs]'",
    "grimp": "pip install -c constraints.txt -e '.[dev]'",
}


class MissingPackage(UserError):
    """An optional package that the command needs is not installed (exit code 1); the message says how to install
    it."""

    @classmethod
    def of(cls, exc: ModuleNotFoundError) -> "MissingPackage | None":
        """The error for a failed import of an optional package; None for any other module (a user's own module,
        a broken install), whose traceback is the useful answer."""
        top = (exc.name or "").split(".")[0]
        if top not in INSTALL_COMMANDS:
            return None
        return cls(f"the optional package {top!r} is not installed ({exc}): install it with "
                   f"{INSTALL_COMMANDS[top]}")
