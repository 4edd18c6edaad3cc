"""How work runs, for every capability: one ``Launcher`` protocol (inline, child process, torchrun, a user's script),
one channel that every worker talks over, one error model (``Outcome``), the events progress is shown from, and the
``Target`` that says once whether the work is a Task or a script. Capabilities ask this layer to run their work;
none of them knows how processes are made."""

from dtypelab.run.channel import Reporter, connect, launched, watch_parent
from dtypelab.run.events import Event, OnEvent
from dtypelab.run.fanout import FanOutLauncher
from dtypelab.run.launchers import (
    LAUNCHERS,
    InlineLauncher,
    Launcher,
    OnStep,
    ProcessLauncher,
    Work,
    stop_in_flight,
)
from dtypelab.run.messages import Done, Failed, Message, Note, Started, Step
from dtypelab.run.outcome import Outcome, failure
from dtypelab.run.script import ScriptLauncher, ScriptRun, imported_modules
from dtypelab.run.slurm_options import parse_gpus, parse_minutes, parse_slurm_args
from dtypelab.run.target import Target
from dtypelab.run.torchrun import Torchrun, TorchrunLauncher
from dtypelab.run.warm import heavy_modules

__all__ = ["LAUNCHERS", "Done", "Event", "Failed", "FanOutLauncher", "InlineLauncher", "Launcher", "Message", "Note",
           "OnEvent", "OnStep", "Outcome", "Started", "Step",
           "ProcessLauncher", "Reporter", "ScriptLauncher", "ScriptRun", "Target", "Torchrun", "TorchrunLauncher",
           "Work", "connect", "failure", "heavy_modules", "imported_modules", "launched", "parse_gpus", "parse_minutes",
           "parse_slurm_args", "stop_in_flight", "watch_parent"]
