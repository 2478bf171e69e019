"""The one exception type for bad input: its message is a single line saying what was wrong and what to do."""


class CasspecError(ValueError):
    """A user-facing error. The CLI prints `casspec: error: <message>` and exits with status 2."""
