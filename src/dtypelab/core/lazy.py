"""Public names that load on first use (PEP 562): a package's ``__init__`` maps each name it exports to the module
that defines it, so importing the package (or a light module of it, such as its options) loads nothing heavy. The
CLI builds its flags from the options modules and starts in a fraction of a second, without torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(``__getattr__``, ``__dir__``, ``__all__``) for ``package``: ``names`` maps each public name to its module,
    relative to the package (``"sweep"`` for ``package.sweep``) or absolute."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where if "." in where else f"{package}.{where}")
        value = getattr(module, name)
        namespace[name] = value  # once loaded, a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__, sorted(names)
