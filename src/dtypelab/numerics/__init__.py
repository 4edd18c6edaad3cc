"""numerics: every format's properties, what a cast does to values, range statistics, and the audit."""
