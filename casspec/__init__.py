"""casspec: lossless self-speculative decoding. The API is `casspec.runtime.engine.Engine`; every bad input raises
`CasspecError` (defined in the bottom layer, dsia/errors.py, so that every layer can raise it)."""
from importlib.metadata import PackageNotFoundError, version

from dsia.errors import CasspecError

try:
    __version__ = version("casspec")
except PackageNotFoundError:  # running from a checkout that is not installed
    __version__ = "0+unknown"

__all__ = ["CasspecError", "Engine", "__version__"]


def __getattr__(name: str) -> object:
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'casspec' has no attribute {name!r}")
