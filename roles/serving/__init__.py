"""Serving: OpenAI's API over generator meshes.

- :class:`FrontDoor` routes requests to generators and streams their tokens back
  (:meth:`FrontDoor.open`, :meth:`FrontDoor.stream`), with bounded admission and generators
  taken out of rotation when they die;
- :func:`openai_server` is the one call from a cluster to an app: it spawns the generators
  of a checkpoint, starts a front door over them and yields its app;
- :func:`openai_app` is the HTTP front door, a Starlette (ASGI) app to serve with uvicorn or
  mount in an app of your own; :class:`ServedModel` is the checkpoint's tokenizer, chat
  template and context length it needs;
- :class:`Router` (sans-IO) chooses the generator by what its prefix cache and the KV store
  hold against its load; :func:`should_spill` is the rule that serves a request whole on the
  prefill pool when the decode pool is full.
"""

from ._disagg import should_spill
from ._frontdoor import FrontDoor, GeneratorLostError, OverloadedError, RequestStream
from ._http import openai_app
from ._router import POLICIES, Choice, Load, NoWorkerError, Router, ServingError
from ._served import ServedModel
from ._server import openai_server

__all__ = [
    "POLICIES",
    "Choice",
    "FrontDoor",
    "GeneratorLostError",
    "Load",
    "NoWorkerError",
    "OverloadedError",
    "RequestStream",
    "Router",
    "ServedModel",
    "ServingError",
    "openai_app",
    "openai_server",
    "should_spill",
]
