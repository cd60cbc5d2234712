"""The package's foundation: backend choice, validation and numerics (imports nothing else
of the package)."""
