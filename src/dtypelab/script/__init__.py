"""Measure the user's own training — a plain PyTorch script through ``dtypelab.session()``, a LightningModule through
``dtypelab.lightning.Trainer``, a Hugging Face model through ``dtypelab.hf.Trainer`` — once per policy, each run in
its own process (runner, on ``dtypelab.run``'s script launcher), with the same record, table and recommendation as a
Task gets. ``Diagnosis`` is what ``trace`` and ``audit`` put on the script's loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "session": "handle", "Session": "handle", "Diagnosis": "diagnose", "bench_script": "runner",
    "diagnose_script": "runner", "script_record": "runner",
    "script_environment": "runner", "baseline_failed": "runner", "ScriptJob": "messages", "ScriptResult": "messages",
    "ScriptSkip": "messages", "HF_ARGUMENTS": "adapters", "HF_CONVERTS": "adapters", "HF_OPTIM": "adapters",
    "trainer_arguments": "adapters",
    "LIGHTNING_PRECISION": "adapters",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.script.adapters import HF_ARGUMENTS, HF_CONVERTS, HF_OPTIM, LIGHTNING_PRECISION, trainer_arguments
    from dtypelab.script.diagnose import Diagnosis
    from dtypelab.script.handle import Session, session
    from dtypelab.script.messages import ScriptJob, ScriptResult, ScriptSkip
    from dtypelab.script.runner import baseline_failed, bench_script, diagnose_script, script_environment, script_record
