"""casspec: lossless self-speculative decoding. The API is `casspec.engine.Engine`; every bad input raises
`CasspecError` (defined in the bottom layer, dsia/errors.py, so that every layer can raise it)."""
from dsia.errors import CasspecError

__all__ = ["CasspecError"]
