"""Which function draws a record: every renderer module loaded (each registers its record kinds in ``views`` as it
is imported; nothing lists them), then the record's type looked up there. Apart from ``views`` so that the registry
never imports the renderers that import it."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from dtypelab.render.views import DOCUMENTS, DROPS, MORE, SECTIONS

# not renderers: the registry, this module, the report page (it uses this module) and the commands' options
_NOT_RENDERERS = ("views", "drawing", "page", "options")


@functools.cache
def _loaded() -> None:
    import dtypelab.render as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _NOT_RENDERERS:
            importlib.import_module(f"dtypelab.render.{info.name}")


def more_of(record: Any, top: int = 0) -> list[Any]:
    _loaded()
    fns = next((MORE[c] for c in type(record).__mro__ if c in MORE), [])
    return [doc for fn in fns for doc in fn(record, top)]


def section_of(record: Any) -> Callable[[Any, str, str | None], str]:
    _loaded()
    for cls in type(record).__mro__:
        if cls in SECTIONS:
            return SECTIONS[cls]
    raise TypeError(f"not a dtypelab record: {type(record).__name__}")


def drop_of(record: Any) -> tuple[str, ...] | None:
    """The record's own order of columns a narrow terminal leaves out, or None (the table's default)."""
    _loaded()
    drop = next((DROPS[c] for c in type(record).__mro__ if c in DROPS), None)
    return drop(record) if drop is not None else None


def document_of(record: Any) -> Callable[[Any, int], tuple[Any, Any, set[int]]] | None:
    """The record's terminal document, or None for a bench report (its own table)."""
    _loaded()
    return next((DOCUMENTS[c] for c in type(record).__mro__ if c in DOCUMENTS), None)
