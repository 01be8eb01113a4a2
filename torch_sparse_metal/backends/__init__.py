"""Backends that are not C++ kernels: the MPS host code (:mod:`.mps`)."""
