"""User-facing errors: one line for the user, no traceback."""

from __future__ import annotations

import os
import traceback


class DtypelabError(Exception):
    """A mistake the user can fix (bad name, bad path, bad value). The CLI prints it as one line."""


class Unsupported(DtypelabError):
    """This policy has no meaning for this model or optimizer (an optimizer with no low-bit variant): the policy is
    reported skipped with the reason, not failed."""


class OptionError(DtypelabError):
    """An option the user gave does not apply to their model or script (found only once it is built): the policy
    fails with it, and the command, its other results saved, exits non-zero with this line (``misapplied``)."""

    MARK = "not apply to this model:"

    def __init__(self, flags: list[str], why: str) -> None:
        verb = "does" if len(flags) == 1 else "do"
        super().__init__(f"{', '.join(flags)} {verb} not apply to this model: {why}; leave "
                         f"{'it' if len(flags) == 1 else 'them'} out")


def misapplied(reason: str) -> str:
    """The ``OptionError`` line inside a failed run's reason ("" for none)."""
    if OptionError.MARK not in reason:
        return ""
    start = reason.find("--")
    return reason[start:] if start >= 0 else reason


class TaskError(DtypelabError):
    """The user's task could not be loaded, or its code raised."""


_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dtypelab/, not dtypelab/core/


def _is_library_frame(filename: str) -> bool:
    # Frames from dtypelab itself, torch, and the stdlib are noise to someone debugging their model.
    name = os.path.abspath(filename)
    return (
        name.startswith(_PKG_DIR)
        or f"{os.sep}site-packages{os.sep}" in name
        or f"{os.sep}lib{os.sep}python" in name
        or name.startswith("<")
    )


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of an exception's traceback that belong to the user's own code."""
    return [f for f in traceback.extract_tb(exc.__traceback__) if not _is_library_frame(f.filename)]


def describe_exception(exc: BaseException) -> str:
    """'TypeError: msg (at my_model.py:12 in forward)', naming the user's innermost frame if any; dtypelab's own
    errors are their message alone (their class name is no news to the user)."""
    own = isinstance(exc, DtypelabError) and str(exc)
    text = (str(exc) if own else f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__).strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    frames = user_frames(exc)
    if frames:
        f = frames[-1]
        text += f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"
    return text


def format_user_traceback(exc: BaseException) -> str:
    """The user's part of the traceback, for showing below the one-line error."""
    frames = user_frames(exc)
    return "".join(traceback.format_list(frames)) if frames else ""
