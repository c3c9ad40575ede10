"""Errors whose message tells the user what to do; the CLI prints them without a traceback."""


class UserError(Exception):
    """A problem with the user's setup or input, not a bug (exit code 1)."""


class UsageError(UserError):
    """A wrong command-line argument or setting (exit code 2)."""
