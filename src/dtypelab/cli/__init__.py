"""Command-line interface. Thin: each command builds one validated options object (its flags are made from the
object's fields) and calls one public function. Each module of this package registers its own commands on ``app``
(``_options.command``) when imported; every public module here is imported below, so a new command is a new module.
Nothing imports this package."""

from __future__ import annotations

import importlib
import pkgutil

from dtypelab.cli._common import app

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")


def main() -> None:
    app()


__all__ = ["app", "main"]
