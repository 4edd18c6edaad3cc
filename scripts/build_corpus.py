"""Rebuild src/dtypelab/tasks/data/corpus.txt: English prose from CPython standard-library docstrings.

The docstrings are part of CPython (PSF License, which permits redistribution with notice). The corpus
is shipped so the charlm task works offline and identically everywhere; run this only to regenerate it.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

MODULES = ["argparse", "asyncio.events", "calendar", "collections", "contextlib", "csv", "dataclasses",
           "datetime", "decimal", "difflib", "email.message", "fractions", "functools", "gzip", "heapq",
           "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "numbers",
           "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "smtplib", "socket",
           "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
           "tokenize", "traceback", "typing", "unittest.case", "urllib.parse", "uuid", "warnings", "zipfile"]
OUT = pathlib.Path(__file__).resolve().parent.parent / "src/dtypelab/tasks/data/corpus.txt"
HEADER = ("# Docstrings from the CPython standard library, (c) Python Software Foundation, PSF License.\n")


def docstrings(module) -> list[str]:
    seen, texts = set(), []
    for obj in [module, *(v for _, v in sorted(vars(module).items()))]:
        doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj) else None
        if not doc or id(doc) in seen or getattr(obj, "__module__", module.__name__) != module.__name__:
            continue
        seen.add(id(doc))
        # keep prose paragraphs, drop code examples and tables
        for para in doc.split("\n\n"):
            if ">>>" in para or "::" in para or para.count("\n") > 12 or len(para) < 80:
                continue
            texts.append(re.sub(r"\s+", " ", para).strip())
    return texts


def main() -> None:
    paras = []
    for name in MODULES:
        paras += docstrings(importlib.import_module(name))
    text = "\n".join(dict.fromkeys(paras))
    text = "".join(c for c in text if 32 <= ord(c) < 127 or c == "\n")  # ASCII keeps the vocabulary small
    OUT.write_text(HEADER + text + "\n")
    print(f"wrote {OUT} ({len(text):,} characters, {len(set(text))} distinct)")


if __name__ == "__main__":
    main()
