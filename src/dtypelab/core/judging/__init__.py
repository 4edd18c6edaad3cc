"""Judging records: the recommendation of a bench record (``recommend``, ``judged``) and why a profiled policy is
(not) faster (``why``). Reads record types; builds the ``Recommendation`` they carry."""

from dtypelab.core.judging.explain import bound_text, breakdown_text, why
from dtypelab.core.judging.notes import table_notes
from dtypelab.core.judging.recommend import disturbed_text, judged, recommend
from dtypelab.core.judging.speed import speed_text, speedup
from dtypelab.core.results import Recommendation
from dtypelab.core.tolerance import Tolerance, delta_text, judge

__all__ = ["Recommendation", "Tolerance", "bound_text", "breakdown_text", "delta_text", "disturbed_text", "judge",
           "judged", "recommend", "speed_text", "speedup", "table_notes", "why"]
