"""What the installed package offers for testing code that uses it: the test axes from the op contract
(:mod:`.axes`) and independent float64 and ``torch.sparse`` references (:mod:`.reference`). The Metal emulation and
the fuzz harnesses are development tools of the repository (``tsm_dev``), not installed."""
