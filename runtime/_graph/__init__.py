"""Dataflow graphs: declared (``_graph``), run (``_run``, ``_stage``, ``_channels`` over the
sans-IO ``_channelstate`` and ``_route``), compiled (``_compiled`` over ``_callplan``), drawn
(``_dot``) and dry-run (``_dry``, behind ``orchestr graph``)."""
