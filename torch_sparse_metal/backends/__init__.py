"""Python parts of the backends: the MPS host code (:mod:`.mps`) and the CPU kernels' setting (:mod:`.cpu`)."""
