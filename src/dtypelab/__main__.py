"""``python -m dtypelab``: the same CLI as the ``dtypelab`` command."""

from dtypelab.cli import main

if __name__ == "__main__":
    main()
