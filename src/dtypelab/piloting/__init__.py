"""The live precision autopilot: train in a low-precision start configuration and move a layer out of it, without a
restart, when its ranges say it will overflow or has underflowed (``autopilot`` on ``AutopilotOptions``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {"autopilot": "run", "AutopilotOptions": "options",
                                                   "session": "handle", "PilotDiagnosis": "script",
                                                   "PROMOTABLE": "adapters", "PROMOTION": "adapters"})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.piloting.adapters import PROMOTABLE, PROMOTION
    from dtypelab.piloting.handle import session
    from dtypelab.piloting.options import AutopilotOptions
    from dtypelab.piloting.run import autopilot
    from dtypelab.piloting.script import PilotDiagnosis
