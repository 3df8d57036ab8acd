"""Serving: the router that sends requests to generators by what their prefix caches and the
KV store hold against their load (:class:`Router`, sans-IO). The front door comes next."""

from ._router import POLICIES, Choice, Load, NoWorkerError, Router, ServingError

__all__ = ["POLICIES", "Choice", "Load", "NoWorkerError", "Router", "ServingError"]
