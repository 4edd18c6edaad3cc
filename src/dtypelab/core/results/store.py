"""Reading and writing records: pydantic does the JSON, driven by the records' own type hints.

Why pydantic (v2): typer already depends on it, so it adds nothing to install; it validates and
serialises plain frozen dataclasses through a ``TypeAdapter`` (the records stay dataclasses that
renderers read without knowing about it); and it writes non-finite floats as the strings "NaN",
"Infinity", "-Infinity" (strict JSON has none) while reading them back only into *float* fields, so a
string field that happens to say "NaN" stays a string. msgspec would be faster but writes NaN as null,
which does not round-trip. Every float a record can hold is typed (dataclass or TypedDict) for that reason.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic_core import to_json

from dtypelab.core.errors import DtypelabError

RECORD_CONFIG = ConfigDict(ser_json_inf_nan="strings")

T = TypeVar("T")


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


class Record:
    """Mixin for a frozen dataclass saved as ``{"schema": ..., "schema_version": ..., ...fields}``. Each kind of
    record has its own ``version``; ``migrations[v]`` turns a version-``v`` dict into version ``v + 1``, so old
    files render as they did."""

    __pydantic_config__ = RECORD_CONFIG
    schema: ClassVar[str]
    KINDS: ClassVar[dict[str, type[Record]]] = {}  # every record kind by its "schema", filled as each is defined
    version: ClassVar[int] = 2  # the kinds that have not changed since the shared version 2
    migrations: ClassVar[dict[int, Callable[[dict[str, Any]], dict[str, Any]]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "schema" in cls.__dict__:  # a kind registers itself: load_record finds it by its file's "schema"
            Record.KINDS[cls.schema] = cls

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, non-finite floats as strings."""
        return {"schema": self.schema, **json.loads(_adapter(type(self)).dump_json(self))}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    def save(self, path: str) -> None:
        """Write atomically: a crash mid-write leaves the previous complete file in place."""
        save_text(path, self.to_json())

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        if d.get("schema") != cls.schema:
            raise DtypelabError(f"not a dtypelab result file (no 'schema': {cls.schema!r})")
        version = d.get("schema_version")
        if not isinstance(version, int) or not 1 <= version <= cls.version:
            raise DtypelabError(f"{cls.schema} file has schema version {version}; this dtypelab reads 1 to "
                                f"{cls.version}")
        d = dict(d)
        for v in range(version, cls.version):
            d = cls.migrations.get(v, lambda x: x)(d)
        d["schema_version"] = cls.version
        try:
            return _adapter(cls).validate_python(d)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise DtypelabError(f"{cls.schema} file is malformed: {where}: {first['msg']}") from None

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.from_dict(json.loads(text))


def plain_json(obj: Any) -> str:
    """Strict JSON for any data (dataclasses, lists, dicts) that is not a record: non-finite floats as strings."""
    return to_json(obj, indent=1, inf_nan_mode="strings").decode()


def read_json(path: str, what: str = "result file") -> dict[str, Any]:
    """The JSON object in ``path``; a missing, unreadable or non-JSON file, or one holding no object, is a one-line
    error that names ``what`` the file was meant to be (result file, plan file, hardware file)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise DtypelabError(f"no such {what}: {path}") from None
    except OSError as exc:
        raise DtypelabError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        line = f" (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise DtypelabError(f"cannot read {what} {path}: not valid JSON{line}") from None
    if not isinstance(d, dict):
        raise DtypelabError(f"{path} is not a dtypelab {what} (expected a JSON object)")
    return d


def save_bytes(path: str, data: bytes) -> None:
    """Write atomically: a crash mid-write leaves the previous complete file (or none) in place. The file gets
    the usual permissions (umask), unlike a mkstemp file's 0600. A path that cannot be written is a one-line
    error naming it."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{os.path.basename(path)}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise DtypelabError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise


def check_writable(*paths: str | None) -> None:
    """Fail now, in one line, for a path that could not be written later: before the long run it is to hold the
    result of (an empty file is written there and removed; a missing folder is created, as saving would)."""
    for path in filter(None, paths):
        if os.path.isdir(path):
            raise DtypelabError(f"cannot write {path}: it is a folder")
        directory = os.path.dirname(os.path.abspath(path))
        probe = os.path.join(directory, f".tmp-{os.getpid()}-check-{os.path.basename(path)}")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise DtypelabError(f"cannot write {path}: {exc.strerror or exc}") from None


def save_report(record: Record, path: str | None) -> None:
    """Write the record when a path is given (a path that cannot be written is a one-line error)."""
    if path:
        record.save(path)


def save_text(path: str, text: str) -> None:
    save_bytes(path, text.encode())


def default_result_path(task: str, kind: str, directory: str = "dtypelab-results") -> str:
    """dtypelab-results/<task>-<kind>-<timestamp>.json, created empty so that a second run started in the same
    second gets ``…-2.json``: every run is kept unless told otherwise."""
    if task.startswith("hf:"):  # a Hugging Face model: its name (hf:ORG/NAME, hf:PATH/NAME#seq=N)
        stem = os.path.basename(task[3:].partition("#")[0].rstrip("/")) or "hf"
    else:
        stem = os.path.splitext(os.path.basename(task.rpartition(":")[0] or task))[0] or "task"
    return reserve_path(directory, f"{stem}-{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


def reserve_path(directory: str, stem: str, suffix: str = ".json") -> str:
    """A new file ``directory/stem<suffix>`` (or ``stem-2``, ``stem-3``, …), created empty and exclusively so
    that two runs started in the same second never write to the same file."""
    os.makedirs(directory, exist_ok=True)
    for n in range(1, 10_000):
        path = os.path.join(directory, f"{stem}{'' if n == 1 else f'-{n}'}{suffix}")
        try:
            with open(path, "x"):
                return path
        except FileExistsError:
            continue
    raise DtypelabError(f"cannot find a free result file name for {stem} in {directory}")
