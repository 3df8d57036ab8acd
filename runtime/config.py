"""Runtime settings, read once from ``ORCHESTR_*`` environment variables with validated values."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from .errors import ConfigError

__all__ = ["Config", "check_tls_files", "config_environ", "load_config"]


_CHOICES = {
    "transport_fallback": ("allow", "error"),
    "local_call_transport": ("shm", "tcp"),
    "fabric": ("managed", "static"),
}
#: Integer fields that are not simply positive: lowest and highest allowed, and what they mean.
_RANGES = {
    "metrics_port": (-1, 65535, "0 picks a free port, -1 serves no metrics"),
    "dashboard_port": (-1, 65535, "0 picks a free port, -1 serves no dashboard"),
    "call_spans_per_s": (0, 10**9, "0 records none"),
    "max_starting_workers": (0, 10**6, "0: as many as the host has CPUs"),
}
#: Paths of PEM files: empty (no TLS) or all three set.
TLS_FIELDS = ("tls_cert", "tls_key", "tls_ca")
#: Settings that may be empty.
OPTIONAL = (*TLS_FIELDS, "metrics_token")
#: Settings that are secrets: never passed on to the processes started for this one.
_SECRET = ("metrics_token",)


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings shared by every orchestr process.

    Each field can be set with the environment variable ``ORCHESTR_<FIELD>`` in upper case, for
    example ``ORCHESTR_CALL_TIMEOUT=30``.
    """

    #: Default deadline of every actor call, in seconds (override per call with ``.options``).
    call_timeout: float = 60.0
    #: Largest message accepted on the control plane and on the call path, in bytes.
    max_message_bytes: int = 64 * 1024 * 1024
    #: Address services bind to. Loopback unless told otherwise.
    bind_host: str = "127.0.0.1"
    #: Seconds between node heartbeats to the head.
    heartbeat_interval: float = 1.0
    #: A node silent for this long is marked dead.
    heartbeat_timeout: float = 5.0
    #: ``managed``: a job's phase hints go to the cluster's fabric manager (when its head runs
    #: one), which may reconfigure circuits for each phase; ``static``: they stay in the job's
    #: event log and the fabric is left as it is (for comparison).
    fabric: str = "managed"
    #: Seconds a job's controller waits for its head to come back (a restart) before the job
    #: fails; meanwhile its actors keep running and its calls to them go on.
    head_reconnect_timeout: float = 60.0
    #: Finished submitted jobs whose working folder, output and package the head keeps;
    #: those of older ones are removed (their records stay).
    job_retention: int = 100
    #: Seconds a new worker process has to register before the spawn fails.
    worker_start_timeout: float = 60.0
    #: Seconds an actor's ``__init__`` (and ``load_state`` on a restart) may take before the
    #: spawn fails and its worker is stopped.
    actor_init_timeout: float = 300.0
    #: Worker processes a node starts at once; more wait their turn (hundreds of interpreters
    #: importing side by side on a few cores would starve everything, the node included).
    #: 0: as many as the host has CPUs (measured best: on 2 cores, 1,000 actors in 20 workers
    #: spawned in 3.1 s with 2 at once, 5.1 s with 8).
    max_starting_workers: int = 0
    #: Seconds a stopping worker gets after SIGTERM before SIGKILL.
    worker_stop_grace: float = 3.0
    #: Seconds to wait for the head to learn why a worker went away, when a call breaks.
    death_report_wait: float = 1.0
    #: Seconds a call under at-least-once retry (or one that never left) waits for its dead
    #: actor's restart before it fails.
    restart_wait: float = 30.0
    #: Largest total of tensors, arrays and bytes of at least ``inline_max_bytes`` each in one
    #: call-path message (through shared memory on one host, in the frame across hosts).
    max_bulk_bytes: int = 16 * 1024**3
    #: Most bytes a caller lets wait unsent to one actor's worker (it does not read fast
    #: enough, or is stopped); past it, new calls and broadcasts to it fail at once with
    #: TransportError instead of growing the caller's memory.
    max_unsent_bytes: int = 256 * 1024 * 1024
    #: Most bytes of shared memory this process lends to peers for call values at once; past
    #: it, large values go into the call frame (a fallback: logged and counted, or an error).
    shm_pool_bytes: int = 8 * 1024**3
    #: Tensors and arrays of at least this many bytes in call arguments and results travel
    #: through shared memory to processes on the same host instead of inside the call frame.
    inline_max_bytes: int = 1024 * 1024
    #: When the wanted transport cannot be used: "allow" (fall back, logged and counted) or
    #: "error" (the transfer fails with FallbackError).
    transport_fallback: str = "allow"
    #: The stream actor calls ride between processes on one host: "tcp" or "shm" (shared-memory
    #: rings with a socket doorbell). tcp is the default: it measured faster for small calls
    #: (docs/decisions/0002-data-plane.md). Calls across hosts always use tcp.
    local_call_transport: str = "tcp"
    #: Port of the head's Prometheus endpoint (``GET /metrics`` on ``bind_host``): 0 picks a
    #: free one (``JobContext.metrics_address`` says which), -1 serves no metrics.
    metrics_port: int = 0
    #: Port of the head's dashboard (web pages on ``bind_host``, behind ``metrics_token``): 0
    #: picks a free one, -1 serves none. A head daemon serves one on a free port unless this
    #: is set; an embedded cluster's head serves none unless it is set.
    dashboard_port: int = -1
    #: Most bytes a job's event log (``events.jsonl``) takes; past it events are counted by
    #: kind instead of written, and the count is the log's last record.
    event_log_max_bytes: int = 256 * 1024 * 1024
    #: Most calls a second the job's controller records as spans in its event log and trace
    #: (0: none); calls past it in a second are not timed, so the log stays bounded.
    call_spans_per_s: int = 1000
    #: Seconds a one-sided buffer transfer (and a buffer owner's side-channel connection) may
    #: go without progress before the peer is taken as stuck and the transfer fails.
    transfer_stall_timeout: float = 30.0
    #: Seconds a peer has, once connected to a call server, to prove it knows the cluster
    #: token; a connection still unproven then is closed.
    handshake_timeout: float = 10.0
    #: Most connections one call-path listener holds at once; past it new ones are closed
    #: at once (and logged).
    max_connections: int = 4096
    #: Most connections one call-path listener holds that have not yet proven the token.
    max_pending_handshakes: int = 64
    #: A token ``GET /metrics`` must present (``Authorization: Bearer ...``); empty: none.
    #: ``orchestr start --head`` sets it from ``metrics-token`` in the state directory.
    metrics_token: str = ""
    #: Mutual TLS: this process's certificate (PEM), which must name in its subjectAltName the
    #: IP addresses its services are reached at (``bind_host``). Empty: no TLS (the cluster
    #: token still guards every service). Set all three ``tls_*`` settings or none.
    tls_cert: str = ""
    #: Mutual TLS: the private key of ``tls_cert`` (PEM).
    tls_key: str = ""
    #: Mutual TLS: the CA certificate(s) (PEM) that signed every node's certificate; peers whose
    #: certificate it did not sign are refused, on the control plane and on tcp call connections.
    tls_ca: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "str":
                if field.name in OPTIONAL and isinstance(value, str):
                    continue
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{field.name} must be a non-empty string, got {value!r}")
                choices = _CHOICES.get(field.name)
                if choices is not None and value not in choices:
                    raise ConfigError(
                        f"{field.name} must be one of {', '.join(choices)}, got {value!r}"
                    )
                continue
            kinds = (int, float) if field.type == "float" else (int,)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ConfigError(
                    f"{field.name} must be a number of type {field.type}, got {value!r}"
                )
            bounds = _RANGES.get(field.name)
            if bounds is not None:
                low, high, meaning = bounds
                if not low <= value <= high:
                    raise ConfigError(
                        f"{field.name} must be from {low} to {high} ({meaning}), got {value!r}"
                    )
            elif not value > 0:
                raise ConfigError(f"{field.name} must be positive, got {value!r}")
        given = [name for name in TLS_FIELDS if getattr(self, name)]
        if given and len(given) < len(TLS_FIELDS):
            missing = [
                f"ORCHESTR_{name.upper()} (--{name.replace('_', '-')})"
                for name in TLS_FIELDS
                if name not in given
            ]
            raise ConfigError(
                "mutual TLS needs a certificate, its key and the CA that signed the cluster's "
                f"certificates; missing: {', '.join(missing)}"
            )

    @property
    def tls(self) -> bool:
        """Whether mutual TLS is on (all three ``tls_*`` files given)."""
        return bool(self.tls_cert)


def load_config(environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
    """Build a :class:`Config` from ``ORCHESTR_*`` variables, then ``overrides``.

    Raises :class:`ConfigError` naming the variable when a value does not parse, and naming
    the file when a ``tls_*`` file cannot be read. TLS paths come out absolute.
    """
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for field in dataclasses.fields(Config):
        var = f"ORCHESTR_{field.name.upper()}"
        raw = env.get(var)
        if raw is None:
            continue
        kind = {"float": float, "int": int, "str": str}[str(field.type)]
        try:
            values[field.name] = kind(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not a valid {field.type}") from None
    values.update(overrides)
    unknown = set(values) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    for name in TLS_FIELDS:  # absolute: workers may run in another folder
        if isinstance(values.get(name), str) and values[name]:
            values[name] = os.path.abspath(str(values[name]))
    config = Config(**values)  # type: ignore[arg-type]
    check_tls_files(config)
    return config


def check_tls_files(config: Config) -> None:
    """Raise :class:`ConfigError` naming the setting and the file when a ``tls_*`` file is
    missing, unreadable or empty."""
    for name in TLS_FIELDS if config.tls else ():
        path = getattr(config, name)
        var = f"ORCHESTR_{name.upper()}"
        try:
            with open(path, "rb") as f:
                empty = not f.read(1)
        except OSError as exc:
            raise ConfigError(f"{var}: cannot read {path}: {exc.strerror or exc}") from None
        if empty:
            raise ConfigError(f"{var}: {path} is empty; it should hold PEM data")


def config_environ(config: Config) -> dict[str, str]:
    """``config`` as ``ORCHESTR_*`` variables, for processes started on its behalf (workers)."""
    return {
        f"ORCHESTR_{f.name.upper()}": str(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if f.name not in _SECRET
    }
