"""The host-side layer for packed sequences (plain JAX/numpy; imports only `core`)."""
