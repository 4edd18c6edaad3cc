"""Where an op came from in the user's code (shared by trace and profile): the frame that runs it, walked out
through torch, installed libraries and dtypelab's plan regions, stopping at dtypelab's own loop; and, when no
line of the user's runs it, where the user set it up (the model factory, the loss function)."""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the dtypelab package
_TASKS_DIR = os.path.join(_PKG_DIR, "core", "tasks") + os.sep
# dtypelab code that runs *inside* an op's call (plan regions, the op tracer): walked through, not a driver.
_PASS_THROUGH = (os.path.join(_PKG_DIR, "core", "policies") + os.sep,
                 os.path.join(_PKG_DIR, "tracing", "nonfinite.py"), os.path.abspath(__file__))
_DISPATCH = ("__torch_dispatch__", "__torch_function__")
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
# Installed packages (typer, click, rich, transformers, …) are nobody's "line of your code".
_SITE = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})


def _frame_kind(filename: str) -> str:
    """'user', 'driver' (dtypelab's own loop: nothing above it ran the op) or 'library'. The built-in tasks
    are user code as far as a report is concerned."""
    name = os.path.abspath(filename)
    if name.startswith(_TASKS_DIR):
        return "user"
    if name.startswith(_PKG_DIR) and not name.startswith(_PASS_THROUGH):
        return "driver"
    if (name.startswith((_TORCH_DIR, _PKG_DIR, _STDLIB, *_SITE)) or filename.startswith("<")
            or f"{os.sep}site-packages{os.sep}" in name or f"{os.sep}dist-packages{os.sep}" in name):
        return "library"
    return "user"


def where(path: str, line: int) -> tuple[str, str]:
    """('file.py:42', 'the code on that line'), the path relative to the working directory when inside it."""
    rel = os.path.relpath(path)
    return f"{path if rel.startswith('..') else rel}:{line}", linecache.getline(path, line).strip()


def user_source(marks: dict[Any, str] | None = None) -> tuple[str, str, str]:
    """(file:line, code, how) of the innermost user frame that runs the current op, walking out through torch,
    installed libraries and dtypelab's plan regions, and stopping at dtypelab's own loop: frames above it
    (typer, a script that called ``dtypelab.trace``) did not run the op. ``how`` is "" when that frame runs the
    op itself, "module" when it calls into a built-in module that does. With no user frame: ("", "", label)
    where label is ``marks[code]`` for the first library function walked through that ``marks`` names (the
    task's loss function), else ""."""
    frame, through_module, mark = sys._getframe(1), False, ""
    while frame is not None:
        # any dtypelab dispatch mode (the op tracer, the profiler's dtype pass) is walked through
        kind = "library" if frame.f_code.co_name in _DISPATCH else _frame_kind(frame.f_code.co_filename)
        if kind == "user":
            return (*where(frame.f_code.co_filename, frame.f_lineno), "module" if through_module else "")
        if kind == "driver":
            break
        through_module = through_module or frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl")
        mark = mark or (marks or {}).get(frame.f_code, "")
        frame = frame.f_back
    return "", "", mark


def _code_of(fn: Any) -> Any:
    """The Python code object that runs when ``fn`` is called (a function, or an nn.Module's forward)."""
    code = getattr(fn, "__code__", None)
    if code is None and isinstance(fn, nn.Module):
        code = getattr(type(fn).forward, "__code__", None)
    return code


def _defined_at(fn: Any) -> tuple[str, str] | None:
    code = _code_of(fn)
    if code is None or _frame_kind(code.co_filename) != "user":
        return None
    return where(code.co_filename, code.co_firstlineno)


@dataclass(frozen=True)
class Sites:
    """Where the user's code sets up what runs an op when no line of theirs runs it directly: the model's
    factory and the loss function (``file:line``, code), and the loss function's code object to recognise
    its frames."""

    model: tuple[str, str] | None = None
    loss: tuple[str, str] | None = None
    loss_name: str = ""
    loss_code: Any = None

    @classmethod
    def of(cls, make_model: Any, loss_fn: Any, origin: Any = None) -> Sites:
        """``origin``: the (file, first line, call line) of the code that built the task, searched for the
        ``loss_fn=`` / ``make_model=`` argument when those are library functions."""
        def fallback(word: str) -> tuple[str, str] | None:
            if not origin or _frame_kind(origin[0]) != "user":
                return None
            path, first, call = origin
            # the keyword nearest the call (which Python may report at its first or its last line)
            hits = [n for n in range(first, call + 60) if re.search(rf"\b{word}\s*=", linecache.getline(path, n))]
            return where(path, min(hits, key=lambda n: abs(n - call)) if hits else call)

        name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
        module = getattr(loss_fn, "__module__", None) or type(loss_fn).__module__
        return cls(model=_defined_at(make_model) or fallback("make_model"),
                   loss=_defined_at(loss_fn) or fallback("loss_fn"),
                   loss_name=f"{module}.{name}" if module else name, loss_code=_code_of(loss_fn))
