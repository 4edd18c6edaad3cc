"""Command-line interface. Thin: each command builds one validated options object (its flags are made from the
object's fields) and calls one public function. Nothing imports this package."""

from __future__ import annotations

from dtypelab.cli import autopilot, bench, diagnose, export, numeric, tune
from dtypelab.cli._common import app


def main() -> None:
    app()


__all__ = ["app", "main"]
