"""dtypelab's version, kept in every record (a module of its own: nothing heavy loads with it)."""

__version__ = "0.1.0"
