"""The job controller's side: :class:`~._context.JobContext` and the embedded local cluster
(``_context``), phases and their traffic (``_phases``), supervision of meshes
(``_supervise``), reservations (``_reservation``) and the event log (``_events``)."""
