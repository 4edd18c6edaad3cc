"""``python -m dtypelab.run.boot SCRIPT [ARGS...]``: how the script launcher starts a user's script.

Python's, NumPy's and torch's global RNGs are seeded (``DTYPELAB_SEED``, ``bench --seed``) *before the script's
first line*, then the script runs as ``python SCRIPT ARGS`` would run it (``__name__ == "__main__"``, its folder
first on ``sys.path``). Every run so starts from the same RNG state, whatever the script does or does not seed, and
the script's session (``dtypelab.session()``, which connects to the launcher's channel) never touches an RNG: a
script that seeds itself keeps its own seed, and the same script run without dtypelab trains exactly as before.
"""

from __future__ import annotations

import os
import random
import runpy
import sys

from dtypelab.run.warm import ENV_SEED


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    import torch

    torch.manual_seed(seed)  # every device's generator


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m dtypelab.run.boot SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    seed_everything(int(os.environ.get(ENV_SEED, "0")))
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
