"""``python -m tsm_dev.selfcheck``: the self-check (:mod:`torch_sparse_metal_tools.selfcheck`, same options) with the
repository's development tools handed in: where there is no MPS its checks run through the MSL-on-CPU executor
(:mod:`tsm_dev.msl`), and ``--model`` prints the executor's traffic model (:mod:`tsm_dev.traffic_model`). On a Mac
with MPS it is the installed command itself.

Example::

    $ python -m tsm_dev.selfcheck --no-bench --json report.json   # the checks on the CPU, through the executor
    $ python -m tsm_dev.selfcheck --model --json model.json       # the traffic model's tables
"""

from __future__ import annotations

import sys

from torch_sparse_metal_tools import selfcheck
from tsm_dev import msl, traffic_model

__all__ = ["DESCRIPTION", "PROG", "executor", "main"]

#: This command's name in its usage and help, and what it does.
PROG = "python -m tsm_dev.selfcheck"
DESCRIPTION = ("The self-check of torch_sparse_metal's Metal kernels (the options of python -m "
               "torch_sparse_metal_tools.selfcheck): on MPS where there is MPS, else through the repository's "
               "MSL-on-CPU executor on the CPU; --model prints the executor's traffic model.")


def executor() -> selfcheck.Executor:
    """The executor and its traffic model, as the self-check takes them (the compiler looked up at each call)."""
    return selfcheck.Executor(compile_shader=lambda source: msl.compile_shader(source), error=msl.MslError,
                              model_rows=traffic_model.model_rows, format_tables=traffic_model.format_tables)


def main(argv: list[str] | None = None) -> int:
    """:func:`torch_sparse_metal_tools.selfcheck.main` with :func:`executor`, under this command's name; returns the
    exit status."""
    return selfcheck.main(argv, executor=executor(), prog=PROG, description=DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
