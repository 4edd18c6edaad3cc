"""The heavy libraries a zygote keeps imported between the processes it forks (workers, scripts).

Apart from ``worker`` and ``boot`` so that the package never imports those two: they are run with ``python -m``, and
runpy warns about a module that its own package imported first.
"""

from __future__ import annotations

import sys

ENV_SEED = "DTYPELAB_SEED"  # the seed a script's RNGs get before its first line (run/boot.py)

# Libraries a worker may import that cost seconds each: a worker says which it loaded, and the zygote imports them
# before it forks the next one (between workers, never while one runs). Only these: a user's modules never run there.
# torch._dynamo: every optimizer's constructor imports it (about 0.7 s of a tiny policy's 1 s run on 2 cores)
WARM = ("torch._dynamo", "numpy", "safetensors", "torchao", "transformers", "tokenizers", "accelerate", "ml_dtypes",
        "lightning", "sklearn", "pydantic", "peft")


# Of those, the packages that import their parts lazily (transformers' models, peft's tuners): the parts a worker
# imported are loaded too, or each worker pays for them again (BERT's modeling and activations: about 5 s on 2 cores)
DEEP = ("transformers", "peft")


def heavy_modules() -> list[str]:
    """Which of ``WARM`` this process has imported, with the parts of ``DEEP``'s it used: a worker (or a script's
    session) says so at its end."""
    deep = sorted(m for m, mod in list(sys.modules.items()) if mod is not None and m.partition(".")[0] in DEEP
                  and "." in m)
    return [m for m in WARM if m in sys.modules] + deep
