"""The orchestr exception tree, drawn once. Every error orchestr raises derives from
:class:`OrchestrError`. The classes here are ``orchestr``'s; the rest are defined beside what
raises them and exported by their package (``orchestr.fabric.optical``, ``orchestr.roles``,
``orchestr.sim``), marked with it below. Not exported: those marked internal, and those that
reach a user only as a message (``orchestr graph``'s, the head store's, and the front door's
``APIError``, sent as an HTTP error body). ``tests/test_errors.py`` keeps this drawing and the
classes in step.

::

    OrchestrError
    ├── ConfigError                  a setting or environment variable has a bad value
    │   ├── TopologyError                a cabling plan is invalid (fabric.optical)
    │   ├── DryRunError                  ``orchestr graph`` could not run the job's main
    │   └── NoGraphError                 ... or the job built no graph
    ├── SerializationError           a value cannot be sent (unsupported type, bad registration)
    ├── MessageTooLargeError         a message is over ``Config.max_message_bytes``
    ├── ProtocolError                a peer sent a malformed frame
    ├── AuthenticationError          a missing or wrong cluster token, or a refused TLS peer
    │   └── WrongInstanceError           a request signed for another server instance (internal)
    ├── ClosedResourceError          we closed the connection/cluster and then used it
    ├── BrokenResourceError          the peer went away (connection reset, EOF)
    ├── TransportError               a data-plane connection or transfer failed
    │   ├── TransportUnavailableError    the transport cannot run here (no device, no library)
    │   ├── FallbackError                the policy forbids the fallback a transfer needed
    │   └── DescriptorError              a buffer descriptor is malformed, forged, out of bounds
    │       └── StaleDescriptorError         ... or names a released buffer
    ├── ControlPlaneError            a control-plane (gRPC) request failed
    ├── StoreWriteError              the head's database refused a write (a full disk)
    ├── SpawnError                   an actor could not be created
    │   └── PlacementError           no node satisfies the requested resources or labels
    ├── MeshError                    a call mode does not fit the mesh (e.g. call_one on 4 actors)
    ├── CallError                    an actor call did not produce a result
    │   ├── ActorError               the remote endpoint raised; carries type, message, traceback
    │   ├── ActorDiedError           the hosting worker exited or was killed during the call
    │   │   └── SupervisionError         ... and its owner escalated: the job fails
    │   └── CallTimeoutError         the call's deadline passed (also a ``TimeoutError``)
    ├── OcsError                     an optical circuit switch refused or failed (fabric.optical)
    │   ├── InvalidProgramError          a bad port, a busy port, a circuit not live; nothing
    │   │                                applied (also a ``ValueError``)
    │   ├── PortFailedError              a port the program touches has failed
    │   ├── StaleGenerationError         the generation is not newer than the switch's
    │   ├── VerifyError                  the live circuits differ from the expected ones
    │   └── NetnsError                   the emulated fabric's kernel side failed
    ├── InvariantError               a reconfiguration broke a safety invariant: a bug (also an
    │                                ``AssertionError``; fabric.optical)
    ├── WeightSyncError              weights could not be synced (roles)
    │   ├── ManifestMismatchError        the model's tensors differ from the published ones
    │   │                                (also a ``ValueError``)
    │   ├── ChecksumMismatchError        a bucket arrived corrupted
    │   └── StaleWeightsError            the weights or a sample are older than allowed
    ├── KVStoreError                 a KV store request cannot be served (roles.kvstore)
    │   └── LeaseExpiredError            a lease ran out before its reader finished
    ├── HandoffError                 a prompt's prefilled KV could not be read, and the decode
    │                                generator does not recompute it (roles.generator)
    ├── ExpertUnavailableError       an expert tokens were routed to is held by no live expert
    │                                host (roles.experts)
    ├── ServingError                 a request cannot be served (roles.serving)
    │   ├── NoWorkerError                    no generator is in rotation
    │   ├── OverloadedError                  the front door has its most requests in flight
    │   ├── GeneratorLostError               the request's generator died before it finished
    │   └── APIError                         an HTTP request refused: its status and OpenAI's
    │                                        error body (the front door's own)
    ├── SimulationError              a simulation cannot go on: time asked to run backwards, or
    │                                every task waits on something no event will do (sim)
    └── BackendError                 a torch backend is unknown or badly set (roles; also a
        │                            ``ValueError``)
        └── BackendUnavailableError      ... or cannot run on this node

One signal is not an error and stays outside the tree: ``GraphCaptured`` (internal; a
``BaseException`` that carries a dry run's graph past a job's ``except Exception``). The other
exceptions outside it are private, named with a leading ``_``, and caught in the module that
raises them: the OCS conformance suite's failed check (the suite reports every failure at
once), a reward call's alarm in the reward process, and a reward process that is gone.
``tests/test_errors.py`` also reads the source and fails on any other exception class outside
the tree.

Errors translated from a lower layer (grpc, sockets) keep it as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "ActorDiedError",
    "ActorError",
    "AuthenticationError",
    "BrokenResourceError",
    "CallError",
    "CallTimeoutError",
    "ClosedResourceError",
    "ConfigError",
    "ControlPlaneError",
    "DescriptorError",
    "FallbackError",
    "MeshError",
    "MessageTooLargeError",
    "OrchestrError",
    "PlacementError",
    "ProtocolError",
    "SerializationError",
    "SpawnError",
    "StaleDescriptorError",
    "SupervisionError",
    "TransportError",
    "TransportUnavailableError",
]


class OrchestrError(Exception):
    """Root of every error orchestr raises."""


class ConfigError(OrchestrError, ValueError):
    """A setting has a value orchestr cannot use; the message names the setting."""


class SerializationError(OrchestrError, TypeError):
    """A value cannot cross a process boundary; the message names the offending type."""


class MessageTooLargeError(OrchestrError):
    """A message exceeds the configured size limit."""

    def __init__(self, size: int, limit: int, *, bulk: bool = False) -> None:
        if bulk:
            text = (
                f"tensors and arrays of {size} bytes in one message exceed the limit of {limit} "
                f"bytes; raise it with the ORCHESTR_MAX_BULK_BYTES environment variable "
                f"(Config.max_bulk_bytes), or pass an orchestr.Buffer handle instead"
            )
        else:
            text = (
                f"message of {size} bytes exceeds the limit of {limit} bytes; raise it with the "
                f"ORCHESTR_MAX_MESSAGE_BYTES environment variable (Config.max_message_bytes), "
                f"or move bulk data on the data plane"
            )
        super().__init__(text)
        self.size = size
        self.limit = limit


class ProtocolError(OrchestrError):
    """A peer sent bytes that are not a valid orchestr frame."""


class AuthenticationError(OrchestrError):
    """A request carried no cluster token or a wrong one, or mutual TLS refused one side's
    certificate (or its lack of one)."""


class ClosedResourceError(OrchestrError):
    """The resource was closed on this side and then used."""


class BrokenResourceError(OrchestrError):
    """The peer closed or reset the connection."""


class TransportError(OrchestrError):
    """A data-plane connection or transfer failed."""


class TransportUnavailableError(TransportError):
    """A transport cannot run in this process (no device, library missing); the message says
    why."""


class FallbackError(TransportError):
    """The transport policy forbids falling back from the transport that was asked for."""


class DescriptorError(TransportError, ValueError):
    """A buffer descriptor is malformed, forged, or names bytes outside its region."""


class StaleDescriptorError(DescriptorError):
    """The buffer a descriptor names has been released (or its owner has exited)."""


class ControlPlaneError(OrchestrError):
    """A control-plane request to the head, a node or a worker failed."""


class SpawnError(OrchestrError):
    """An actor could not be created (import failure, ``__init__`` raised, worker failed)."""


class PlacementError(SpawnError):
    """No live node can host the actor with the requested resources and labels."""


class MeshError(OrchestrError, ValueError):
    """The call mode does not fit the mesh's shape."""


class CallError(OrchestrError):
    """An actor call did not produce a result."""


class ActorError(CallError):
    """The remote endpoint raised. The remote exception's details are kept as text."""

    def __init__(
        self,
        actor: str,
        endpoint: str,
        remote_type: str,
        remote_message: str,
        remote_traceback: str,
    ) -> None:
        text = f"{actor}.{endpoint} raised {remote_type}: {remote_message}"
        if remote_traceback:
            text += f"\n--- remote traceback ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.actor = actor
        self.endpoint = endpoint
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback


class ActorDiedError(CallError):
    """The worker hosting the actor exited or was killed before answering."""

    def __init__(
        self, message: str, *, actor: str, exit_code: int | None = None, signal: str | None = None
    ) -> None:
        super().__init__(message)
        self.actor = actor
        self.exit_code = exit_code
        self.signal = signal


class SupervisionError(ActorDiedError):
    """An actor's failure reached the root of the job's supervision: its mesh had no restart
    left, or its ``supervise`` hook escalated. The job fails with this error; the message
    carries the root cause (signal or exit code, and the worker's last output)."""


class CallTimeoutError(CallError, TimeoutError):
    """The call's deadline passed before a result arrived."""

    def __init__(self, actor: str, endpoint: str, timeout: float) -> None:
        super().__init__(
            f"call to {actor}.{endpoint} did not finish within its deadline of {timeout:g} s "
            f"(the actor drops it if it had not started it, and cancels it if it runs an "
            f"endpoint marked cancel_safe; otherwise it may still run to its end); pass a "
            f"longer one with .options(timeout=...) or set ORCHESTR_CALL_TIMEOUT"
        )
        self.actor = actor
        self.endpoint = endpoint
        self.timeout = timeout
