"""The cluster's processes and the state they keep.

- the head: ``_head`` (the gRPC service), ``_headstate`` (nodes, resources, placement, actors;
  no I/O), ``_headstore`` (SQLite, WAL), ``_submitted`` (submitted jobs), ``_fabric`` (the
  head's side of the fabric manager);
- ``_node`` (starts workers, reports their exits, heartbeats) and ``_worker`` (a worker
  process);
- the daemons: ``_daemon`` (a head on a state directory), ``_statedir`` (trusting only what
  we made);
- metrics: a worker's counters (read by ``_worker`` into ``orchestr._stats``),
  ``_exposition`` (the Prometheus text), ``_metrics`` (the head's HTTP endpoint).
"""
