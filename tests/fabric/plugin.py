"""An out-of-tree buffer backend, found through the ``orchestr.transports`` entry points."""

from __future__ import annotations

from orchestr.fabric._buffers._inproc import InprocBuffers


class CarrierBuffers(InprocBuffers):
    scheme = "carrier"
