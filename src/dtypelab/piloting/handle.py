"""``dtypelab.session(autopilot=...)``: the script handle, with the autopilot on its loop when the script runs on its
own (``python train.py``). Run by ``dtypelab bench``/``trace``/``audit``/``autopilot``, the job decides what the
session does and ``autopilot`` here is not used: bench measures fixed policies."""

from __future__ import annotations

import sys
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import hardware_for
from dtypelab.core.policies import Plan, get_policy
from dtypelab.piloting.options import AutopilotOptions
from dtypelab.piloting.script import PilotDiagnosis
from dtypelab.run import launched
from dtypelab.script import Session


def settings_of(opts: AutopilotOptions, start: Plan) -> dict[str, Any]:
    """What a script's autopilot is told: the options that act in its process (the start resolved)."""
    return {**opts.model_dump(exclude={"hardware", "start", "script_args", "threads"}), "start": start.name}


def session(seed: int | None = None, device: str | None = None, *,
            autopilot: bool | str | Plan | AutopilotOptions | dict[str, Any] = False) -> Session:
    """The handle for measuring your own training script: ``lab = dtypelab.session()`` at its top (see the guide's
    "Your own script"). It touches no global state of the script's: run by ``dtypelab bench``, each policy's process
    is seeded before the script starts, so every policy sees the same shuffle and initial weights unless the script
    seeds itself. ``seed`` is accepted for old scripts and ignored, with a warning.

    ``autopilot``: run on its own, train in a low-precision start and move a layer out of it when its numbers say so
    (``dtypelab autopilot``'s behaviour): ``True`` (start amp-fp16), a start policy's name or plan file, or
    ``AutopilotOptions`` / a dict of their fields (``start``, ``promote_to``, ``json_path``, ``plan_out``, …). Each
    move is printed on stderr as it happens, a summary at ``lab.finish``."""
    if not autopilot or launched():
        return Session(seed, device)
    if isinstance(autopilot, AutopilotOptions):
        opts = autopilot
    elif isinstance(autopilot, dict):
        opts = AutopilotOptions.build(**autopilot)
    else:
        opts = AutopilotOptions.build() if autopilot is True else AutopilotOptions.build(start=autopilot)
    start = get_policy(opts.start)
    wrong = start.mode_error("train")
    if wrong:
        raise DtypelabError(wrong)
    avail = start.availability(hardware_for(device or opts.device, opts.hardware, budget_s=0.02))
    if not avail.ok:
        raise DtypelabError(f"autopilot start {start.name} cannot run here: {avail.reason}")
    if avail.slow and not opts.force:  # the command refuses; a script that asked for it in code is told, and runs
        print(f"dtypelab autopilot: warning: start {start.name} is measured pathologically slow here: {avail.reason}",
              file=sys.stderr)
    return Session(seed, device or opts.device, plan=start,
                   diagnosis=PilotDiagnosis(settings_of(opts, start), script=sys.argv[0] if sys.argv else ""))
