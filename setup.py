"""Build torch_sparse_metal's C++ (CPU) extension, and its CUDA kernels when a CUDA toolkit and a CUDA
build of torch are both present. CPU-only machines build the CPU kernels alone."""

import glob
import os
import sys
from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _want_cuda() -> bool:
    flag = os.environ.get("TORCH_SPARSE_METAL_CUDA", "auto").lower()
    if flag in ("0", "off", "false"):
        return False
    available = CUDA_HOME is not None and torch.version.cuda is not None
    if flag in ("1", "on", "true") and not available:
        raise RuntimeError("TORCH_SPARSE_METAL_CUDA=1 but no CUDA toolkit or no CUDA build of torch was found")
    return available


#: The torch releases this package builds against (pyproject.toml's build requirement says the same).
SUPPORTED_TORCH = "torch>=2.7,<2.16"


def _torch_requirement() -> str:
    """``torch==X.Y.*`` for the torch this build compiles against, one of :data:`SUPPORTED_TORCH`."""
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if not (2, 7) <= (major, minor) < (2, 16):
        raise RuntimeError(f"torch {torch.__version__} is installed; torch_sparse_metal builds against "
                           f"{SUPPORTED_TORCH}: install one of those first")
    return f"torch=={major}.{minor}.*"


def _debug_build() -> bool:
    """TORCH_SPARSE_METAL_DEBUG=1 keeps debug information in the compiled extension (for a debugger or a profiler
    that reads source lines); a build without it leaves none."""
    return os.environ.get("TORCH_SPARSE_METAL_DEBUG", "0").lower() in ("1", "on", "true")


def _extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # -Werror=switch: a strategy or dtype added to csrc/contract.h that a backend's switch does not handle fails
    # the build instead of falling through. -g0 comes after Python's own flags (which hold -g) and wins over them:
    # the debug information would be most of the extension's size.
    cxx = ["-O3", "-fno-math-errno", "-fopenmp-simd", "-Werror=switch", "-g" if _debug_build() else "-g0"]
    link = []
    if os.environ.get("TORCH_SPARSE_METAL_SANITIZE", "0").lower() in ("1", "on", "true"):
        # ASan + UBSan test build for .ci/sanitize (docs/architecture.md, "Sanitizers"): -O1 keeps reports'
        # stacks readable; -fno-sanitize-recover makes any UB report end the process, so the test run fails;
        # -fno-wrapv undoes Python's -fwrapv, under which signed overflow is defined and UBSan does not check it.
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
        cxx = ["-O1", "-g", "-fno-wrapv", "-fno-math-errno", "-fopenmp-simd", "-Werror=switch", *san]
        link = list(san)
    # at::parallel_for is inline code that runs serially unless the extension is built with OpenMP.
    if sys.platform.startswith("linux"):
        # At run time the libgomp that torch loads (same soname) serves both.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    elif sys.platform == "darwin":
        # Apple's clang takes OpenMP only as a front-end flag (as torch's inductor passes it on macOS). torch's
        # macOS wheel ships include/omp.h and lib/libomp.dylib, both on the extension's search paths, and
        # libtorch_cpu loads that libomp, so the process has one OpenMP runtime. .ci/macos_cross_build checks it.
        cxx += ["-Xclang", "-fopenmp"]
        link.append("-lomp")
    if _want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "-Xcompiler", "-Werror=switch"]
        return CUDAExtension("torch_sparse_metal._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                             extra_link_args=link)
    return CppExtension("torch_sparse_metal._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link)


setup(
    name="torch_sparse_metal",
    version="0.1.0",
    description="Unstructured-sparse (CSR) linear layers for PyTorch with Metal, CUDA and CPU kernels",
    long_description=(Path(__file__).resolve().parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: C++",
        "Operating System :: MacOS",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # Two packages: the library (torch_sparse_metal) and the commands a user runs on their machine
    # (torch_sparse_metal_tools: the self-check, the benchmark, the tuner). shaders/ lives at the top of the repo and
    # ships inside the wheel as torch_sparse_metal/shaders.
    packages=find_packages(include=["torch_sparse_metal", "torch_sparse_metal.*", "torch_sparse_metal_tools",
                                    "torch_sparse_metal_tools.*"]) + ["torch_sparse_metal.shaders"],
    package_dir={"torch_sparse_metal.shaders": "shaders"},
    package_data={"torch_sparse_metal.shaders": ["*.metal", "*.h"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    # The layer needs torch alone; the training example and the benchmark plots need the [train] extra. The compiled
    # extension links against the torch it is built with, whose C++ ABI changes between minor releases: a build
    # (a wheel, or an install from source) asks for that minor release.
    install_requires=[_torch_requirement(), "numpy"],
    # "ecosystem": the libraries tests/test_ecosystem.py runs the layer through, pinned so that none of them can
    # resolve another torch (install torch first).
    extras_require={"train": ["tqdm", "matplotlib"],
                    "test": ["pytest", "ruff", "tqdm", "matplotlib", "expecttest==0.3.0"],
                    "data": ["datasets"],
                    "ecosystem": ["transformers==5.25.0", "safetensors==0.8.0", "accelerate==1.16.0", "peft==0.21.2",
                                  "huggingface_hub==2.4.0"],
                    "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings[python]==1.0.8",
                             "mkdocstrings-python==2.0.11"]},
)
