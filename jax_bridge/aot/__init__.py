"""Ahead-of-time compilation for accelerators this host does not have: compile-only TPU
and GPU devices (`targets`), `compile_for` and its report (`compile`), and libtpu's static
cycle estimates (`cycles`); `common` holds what the last two share."""
