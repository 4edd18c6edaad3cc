"""The profiler's defaults, importable without torch (the CLI and the options modules read them at start-up)."""

PROFILE_STEPS = 5  # enough for a stable breakdown; the profiler's per-op cost makes more wasteful
