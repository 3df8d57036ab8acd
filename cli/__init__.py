"""orchestr.cli: the ``orchestr`` command."""

from ._main import main

__all__ = ["main"]
