"""Options several commands share, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

TaskArg = Annotated[str, typer.Argument(help="built-in name (digits, checkerboard, charlm, minilm), "
                                             "path/file.py:make_task or pkg.module:make_task")]
PolicyOpt = Annotated[str, typer.Option("--policy", "-p", help="precision policy to train under")]
BatchOpt = Annotated[int | None, typer.Option("--batch-size", "-b")]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N [default: cuda if present]")]
ForceOpt = Annotated[bool, typer.Option(help="run policies measured to be pathologically slow here")]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch threads per run [default: torch's]")]
JsonOpt = Annotated[str | None, typer.Option("--json", help="result file [default: dtypelab-results/…]")]
FormatOpt = Annotated[str, typer.Option("--format", help="table, markdown, html or json")]
HtmlOpt = Annotated[str | None, typer.Option("--html", help="also write the offline HTML report (plots) here")]
HardwareOpt = Annotated[str | None, typer.Option(
    "--hardware", envvar="DTYPELAB_HARDWARE",
    help="decide with this saved hardware probe (dtypelab hardware --json FILE, or any record) instead of probing")]
