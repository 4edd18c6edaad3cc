"""A user's own precision kinds and policies, in their own file: ``--policies my_precision.py:NAME`` (or
``pkg.module:NAME``) imports the file once per process, where its ``Config`` subclasses register themselves and its
``register(...)`` calls name its policies; NAME is then a policy the file registered, or a ``Config`` / ``Plan`` it
defines. A kind remembers the file that defined it (``configs.SOURCES``), and its configs carry it in their JSON, so
that a child process, a script's session or a torchrun rank reading the plan imports the same file first."""

from __future__ import annotations

import os
import sys
from typing import Any

from dtypelab.core.errors import DtypelabError, TaskError
from dtypelab.core.policies.configs import SOURCES, Config, set_source_loader
from dtypelab.core.policies.plan import Plan, single
from dtypelab.core.task import import_source, user_module_name


def load_source(source: str) -> Any:
    """Import a user's precision file (``path.py``) or module once per process (importing it again would define
    its kinds again, as classes no earlier config is equal to)."""
    if source.endswith(".py") or os.sep in source:
        module = sys.modules.get(user_module_name(source))
        if module is not None and os.path.abspath(getattr(module, "__file__", "") or "") == os.path.abspath(source):
            return module
    try:
        return import_source(source, "precision file")
    except TaskError as exc:
        raise DtypelabError(str(exc)) from None


def lookup(spec: str, registry: dict[str, Plan]) -> Plan:
    """``FILE.py:NAME`` or ``pkg.module:NAME``: the file imported, NAME a policy it registered or a Config / Plan it
    defines (named NAME)."""
    where, _, name = spec.rpartition(":")
    module = load_source(where)
    if name in registry:
        return registry[name]
    value = getattr(module, name, None)
    if isinstance(value, Plan):
        return value
    if isinstance(value, Config):
        return single(value, name=name)
    defined = sorted(n for n, v in vars(module).items() if isinstance(v, (Config, Plan)))
    here = {os.path.abspath(getattr(module, "__file__", "") or ""), where}
    registered = [n for n, p in registry.items() if any(SOURCES.get(c.kind) in here for c in p.configs)]
    raise DtypelabError(f"{where} defines no policy {name!r}; it registers {', '.join(registered) or 'none'} and "
                        f"defines {', '.join(defined) or 'no config or plan'}")


set_source_loader(load_source)  # config_from_dict imports a user's kind through it
