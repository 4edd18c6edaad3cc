"""Command-line interface. Thin: each command calls one public function. Nothing imports this package."""

from __future__ import annotations

from dtypelab.cli import bench, diagnose, export, numeric, tune  # noqa: F401  (each registers its commands on the app)
from dtypelab.cli._common import app, main

__all__ = ["app", "main"]
