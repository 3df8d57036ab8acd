"""orchestr.roles.pipeline: pipeline-parallel schedules as pure, testable descriptions.

A model cut into ``ranks * chunks`` stages runs each micro-batch's forward through them in
order and its backward in reverse; a :class:`Schedule` says, for each rank, the order of its
passes (:class:`Op`: a :class:`Pass` of one micro-batch on one chunk). The builders make the
known ones: :func:`gpipe`, :func:`one_f_one_b` (1F1B, PipeDream-Flush), :func:`interleaved_1f1b`
(Megatron-LM's virtual stages) and :func:`zb_h1` (zero-bubble ZB-H1, the backward split into
input- and weight-gradient passes); :func:`build` makes one by name.

:func:`check` proves a schedule runs (each pass exactly once, on its stage's rank, no rank
deadlocked when all run their lists in order over bounded links) and reports each rank's peak
activations in flight; :func:`run` times it under a :class:`Cost` and measures its bubble,
which :func:`bubble_theory` gives in closed form. All of that is pure: no I/O, no torch.

:class:`Pipeline` runs a model cut into stages on a mesh of :class:`PipelineStage` actors, one
per rank, each running its rank's list of the same schedules with real torch passes.
"""

from ._builders import SCHEDULES, build, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from ._check import Report, check
from ._driver import Pipeline, StepResult
from ._engine import Link, links
from ._ops import Op, Pass, Schedule
from ._stage import PipelineStage
from ._timing import Cost, Timing, bubble_theory, run

__all__ = [
    "SCHEDULES",
    "Cost",
    "Link",
    "Op",
    "Pass",
    "Pipeline",
    "PipelineStage",
    "Report",
    "Schedule",
    "StepResult",
    "Timing",
    "bubble_theory",
    "build",
    "check",
    "gpipe",
    "interleaved_1f1b",
    "links",
    "one_f_one_b",
    "run",
    "zb_h1",
]
