"""The one exception type for bad input: its message is a single line saying what was wrong and what to do; and
the one warning line printed where bad input is recovered from instead."""
import sys

_warned: set[str] = set()  # the keys warned about in this process


class CasspecError(ValueError):
    """A user-facing error. The CLI prints `casspec: error: <message>` and exits with status 2."""


def warn(message: str, key: str | None = None) -> None:
    """One warning line on stderr (`casspec: warning: <message>`) for bad input that is recovered from. With a key,
    only the first warning of that key in a process is printed (one bad setting, one line, however often it
    bites)."""
    if key is not None:
        if key in _warned:
            return
        _warned.add(key)
    print(f"casspec: warning: {message}", file=sys.stderr)
