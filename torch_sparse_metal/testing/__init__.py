"""Test helpers; :mod:`.msl` runs Metal kernels on the CPU and checks them with clang (see docs/metal.md)."""
