"""How each record kind is drawn, registered by the function that draws it: ``@section(Kind)`` for its part of the
report page, ``@document(Kind)`` for its terminal document. A new record kind is drawn by adding those two functions
next to its renderer; nothing else lists the kinds. This module is the registry alone: it imports no renderer (they
import it); ``drawing`` loads them and looks a record's functions up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
# record type -> fn(record, key, layers) -> the HTML section
SECTIONS: dict[type, Callable[[Any, str, str | None], str]] = {}
# record type -> fn(record, top) -> (doc, styles, wrapped columns): what `show` prints (bench draws its own table)
DOCUMENTS: dict[type, Callable[[Any, int], tuple[Any, Any, set[int]]]] = {}
DROPS: dict[type, Callable[[Any], tuple[str, ...]]] = {}  # a record's own order of columns to leave out
# record type -> fns(record, top) -> more tables printed under the document (title, headers, rows, notes) each, in the
# order registered: a kind may have several (a forecast's --check table and its time table)
MORE: dict[type, list[Callable[[Any, int], list[Any]]]] = {}


def section(kind: type) -> Callable[[F], F]:
    def register(fn: F) -> F:
        SECTIONS[kind] = fn
        return fn

    return register


def document(kind: type, wrap: set[int] | None = None,
             drop: Callable[[Any], tuple[str, ...]] | None = None) -> Callable[[F], F]:
    """``wrap``: the columns the terminal wraps, for a ``fn(record) -> doc``; without it, ``fn(record, top)`` returns
    (doc, styles, wrap) itself. ``drop``: the record's own order in which a narrow terminal leaves columns out (by
    header prefix; the table's default otherwise)."""
    def register(fn: F) -> F:
        DOCUMENTS[kind] = fn if wrap is None else (lambda record, top: (fn(record), None, wrap))
        if drop is not None:
            DROPS[kind] = drop
        return fn

    return register


def more(kind: type) -> Callable[[F], F]:
    """``fn(record, top) -> [doc, ...]``: tables printed under the record's document (none when the list is empty;
    ``top`` > 0: that many rows of each)."""
    def register(fn: F) -> F:
        if fn not in MORE.setdefault(kind, []):
            MORE[kind].append(fn)
        return fn

    return register
