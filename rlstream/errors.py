"""Errors whose message tells the user what to do; the CLI prints them without a traceback."""


class UserError(Exception):
    """A problem with the user's setup or input, not a bug."""
