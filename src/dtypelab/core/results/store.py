"""Reading and writing records: schema checks, strict JSON for non-finite floats, atomic saves."""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
from typing import Any

from dtypelab.core.errors import DtypelabError

SCHEMA_VERSION = 1


def check_schema(d: dict[str, Any], schema: str) -> None:
    if d.get("schema") != schema:
        raise DtypelabError(f"not a dtypelab result file (no 'schema': {schema!r})")
    if d.get("schema_version") != SCHEMA_VERSION:
        raise DtypelabError(f"file has schema version {d.get('schema_version')}; this dtypelab reads "
                            f"{SCHEMA_VERSION}")


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise DtypelabError(f"no such result file: {path}") from None
    except OSError as exc:
        raise DtypelabError(f"cannot read {path}: {exc.strerror}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DtypelabError(f"{path} is not valid JSON (line {exc.lineno}): {exc.msg}") from None
    if not isinstance(d, dict):
        raise DtypelabError(f"{path} is not a dtypelab result file")
    return d


def save_bytes(path: str, data: bytes) -> None:
    """Write atomically: a crash mid-write leaves the previous complete file (or none) in place. The file gets
    the usual permissions (umask), unlike a mkstemp file's 0600."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{os.path.basename(path)}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_text(path: str, text: str) -> None:
    save_bytes(path, text.encode())


# Strict JSON has no NaN/Infinity, yet a diverged loss curve is full of them: store them as strings.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def from_json_safe(obj: Any) -> Any:
    if isinstance(obj, str) and obj in _NONFINITE:
        return _NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: from_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json_safe(v) for v in obj]
    return obj
