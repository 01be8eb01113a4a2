"""The hosts: each device type's kernels, registered for the ops with ``torch.library`` and declared to the backend
seam (:mod:`torch_sparse_metal.devices`).

- :mod:`.cpu`, :mod:`.cuda`: the declarations of the C++ and CUDA kernels (``csrc/``) and the CPU's kernel-set switch;
- :mod:`.mps`: the MPS backend, registrar and router, over one Metal host per layout
  (``mps_<layout>_csr_linear.py``), the Metal machinery they share (:mod:`.metal`, :mod:`.metal_contract`,
  :mod:`.metal_platform`, :mod:`.metal_source`) and the reference path (:mod:`.mps_reference`).

The package face imports each host once, which registers its kernels; nothing else of the library imports them.
"""
