"""Optional numeric backends (torchao, transformers), imported without their import-time noise."""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

# torchao logs a warning per CUDA-only extension it cannot load on a CPU machine, and registers an enum
# that newer torch warns about: noise for users, silenced only while importing.
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)


def torchao_module(name: str = "") -> Any:
    """``torchao`` or ``torchao.<name>``, imported without its import-time noise."""
    with quiet():
        return importlib.import_module("torchao" + (f".{name}" if name else ""))


def torchao_missing() -> str | None:
    try:
        torchao_module()
    except Exception as exc:  # ImportError, or a torchao built for another torch
        return f"torchao cannot be imported ({type(exc).__name__}: {exc}); pip install torchao"
    return None
