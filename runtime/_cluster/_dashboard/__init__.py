"""The head's web dashboard: nodes, actors, jobs (their phase timeline and RL curves), serving
rates and latencies, and the fabric, live in a browser. :class:`DashboardServer` is the shell
the head runs (:mod:`._server`), :mod:`._app` the Starlette app, :mod:`._view` what the pages
show as plain data, :mod:`._tail` a job's event log read as it grows, :mod:`._attached` the
logs controllers elsewhere send. Decision record 0020."""

from ._attached import AttachedLogs
from ._server import DashboardServer, WatchedJob

__all__ = ["AttachedLogs", "DashboardServer", "WatchedJob"]
