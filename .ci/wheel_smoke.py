"""Smoke test of an installed wheel (.ci/wheel, .ci/aarch64_tests): run from outside the repository by the python
that the wheel was installed for, so that the installed package, its compiled extension and its shaders are what
run.

    python .ci/wheel_smoke.py INSTALL_DIR     # INSTALL_DIR: the site-packages (or pip --target folder) it is in
"""

import platform
import sys
from pathlib import Path

import torch

import torch_sparse_metal
import torch_sparse_metal_tools.bench
import torch_sparse_metal_tools.selfcheck
from torch_sparse_metal import _C, SparseLinear
from torch_sparse_metal.backends import mps, mps_vector_csr_linear
from torch_sparse_metal.backends.metal_source import load_source

install_dir = Path(sys.argv[1]).resolve()
# The library, its extension and the commands a Mac user runs (docs/mac.md) all come from the installed wheel.
for module in (torch_sparse_metal, _C, torch_sparse_metal_tools.selfcheck, torch_sparse_metal_tools.bench):
    assert Path(module.__file__).resolve().is_relative_to(install_dir), (module.__file__, install_dir)

layer = SparseLinear(64, 32, density=0.1, dtype=torch.float64)
dense = layer.to_linear()
x = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
y = layer(x)
y.square().sum().backward()
x_dense = x.detach().clone().requires_grad_()
dense(x_dense).square().sum().backward()
torch.testing.assert_close(y, dense(x_dense))
torch.testing.assert_close(x.grad, x_dense.grad)
families = {
    mps.SHADER_FILES: mps.PLAIN_STAGES + mps.TILED_STAGES,
    mps_vector_csr_linear.SHADER_FILES: mps_vector_csr_linear.STAGES,
}
for files, stages in families.items():  # each family's shader files are found and read whole
    source = load_source(files)
    missing = [stage for stage in stages if f"[[kernel]] void {stage}(" not in source]
    assert not missing, (files, missing)
shaders = Path(torch_sparse_metal.__file__).parent / "shaders"
print(f"wheel smoke test passed on {platform.machine()}: {Path(_C.__file__).name} in {install_dir}, "
      f"shaders {sorted(p.name for p in shaders.iterdir())}")
