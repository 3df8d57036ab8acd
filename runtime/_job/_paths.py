"""The job's import path: what workers put first on theirs to import the job's actor classes."""

from __future__ import annotations

import os
import sys


def import_path() -> list[str]:
    """The driver's import path, which workers need to import actor classes by path: the
    entries of ``sys.path`` that are existing folders, made absolute (a worker on another node
    has another working folder), in order, each once. The interpreter's own folders (the
    standard library, site-packages: anything under ``sys.prefix``, ``sys.exec_prefix`` or
    ``sys.base_prefix``) are left out: a worker's interpreter has its own, and a node with
    another Python must not have this one's put first."""
    own = tuple(
        os.path.join(os.path.abspath(p), "") for p in {sys.prefix, sys.exec_prefix, sys.base_prefix}
    )
    entries = (os.path.abspath(p) for p in sys.path if p and os.path.isdir(p))
    return [p for p in dict.fromkeys(entries) if not os.path.join(p, "").startswith(own)]


def worker_pythonpath() -> str:
    """The driver's import path as a ``PYTHONPATH`` value."""
    return os.pathsep.join(import_path())
