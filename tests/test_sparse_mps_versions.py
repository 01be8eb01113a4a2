"""The registrations of torch_sparse_metal.sparse_mps_ops against every torch that setup.py supports (issue #39).

Only torch 2.13 installs here, and its Linux build has no MPS kernels at all, so the other versions' facts come from
their macOS arm64 wheels: ``python -m tsm_dev.aten_schemas`` reads each one's ``native_functions.yaml`` into
tests/data/aten_sparse_mps_ops.json (which ops exist, which keys torch has kernels for). Checked here: the file
covers every supported minor version and every name the module registers or refuses; every name exists in every
version; :func:`sparse_mps_ops.plan` (the rule ``register()`` runs at import) given each version's facts registers
nothing over a kernel torch has for that key or over a CompositeImplicitAutograd decomposition, overrides only the
explicit composites listed below, and skips a missing op with a reason instead of failing; the metadata ops'
redispatch target (torch's SparseCsrCPU kernel) exists everywhere. The file's reading of the schema is checked
against the live dispatcher of the installed torch for every key that a Linux build has.
"""

from __future__ import annotations

import json

import pytest
import torch
from _helpers import run_python_json

import torch_sparse_metal  # noqa: F401  (registers the MPS kernels)
from torch_sparse_metal import sparse_mps_ops
from tsm_dev import aten_schemas

DATA = json.loads(aten_schemas.DATA.read_text())
VERSIONS = list(DATA["torch"])
INSTALLED = ".".join(torch.__version__.split("+")[0].split(".")[:2])
MPS_KEYS = {"SparseCsrMPS", "SparseMPS", "MPS"}
#: Explicit composite kernels of torch's that our kernels take the place of for an MPS key, and why that is right:
#: they are written for dense tensors, and the dispatcher runs a key's own kernel before an explicit composite.
EXPLICIT_COMPOSITES_REPLACED = {
    # accessors whose composite ("*_default") is for strided tensors: torch's MPS wheels have no compressed kernel
    **dict.fromkeys(["crow_indices", "col_indices", "ccol_indices", "row_indices", "values"],
                    "CompositeExplicitAutograd"),
    # dense implementations (empty_like + copy_, addmv) that the compressed layout does not fit
    **dict.fromkeys(["clone", "copy_", "empty_like", "mv"], "CompositeExplicitAutograd"),
    # the functional kernels torchgen generates for structured ops: meta function + the dense out= kernel
    **dict.fromkeys(["mm", "addmm", "addmv", "mul.Tensor", "bmm", "baddbmm", "add.Tensor",
                     "_convert_indices_from_coo_to_csr", "_convert_indices_from_csr_to_coo"],
                    "CompositeExplicitAutogradNonFunctional"),
}


def facts(version: str):
    ops = DATA["torch"][version]["ops"]
    return (lambda name: ops.get(name) is not None), (lambda name, key: key in (ops.get(name) or ()))


def test_the_data_covers_every_supported_version_and_name():
    """Widening SUPPORTED_TORCH or adding an op to sparse_mps_ops means rerunning the script (the message says so)."""
    hint = "rerun `python -m tsm_dev.aten_schemas` (docs/torch_sparse_mps.md)"
    assert VERSIONS == aten_schemas.supported_minors(), hint
    names = {name for name, _key in sparse_mps_ops.entries()}
    for version in VERSIONS:
        assert set(DATA["torch"][version]["ops"]) == names, (version, hint)
        assert DATA["torch"][version]["wheel"].startswith(f"torch-{version}.")
    assert DATA["keys"] == list(aten_schemas.KEYS)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_name_exists(version):
    ops = DATA["torch"][version]["ops"]
    assert [name for name, keys in ops.items() if keys is None] == []


@pytest.mark.parametrize("version", VERSIONS)
def test_the_rule_registers_over_no_kernel_of_torch(version):
    ops = DATA["torch"][version]["ops"]
    todo, why = sparse_mps_ops.plan(*facts(version))
    assert {(f"aten::{n}", k) for n, k in todo} | set(why) == {(f"aten::{n}", k) for n, k in sparse_mps_ops.entries()}
    for name, key in todo:
        assert key not in ops[name] and "CompositeImplicitAutograd" not in ops[name], (version, name, key)
        replaced = {k for k in ops[name] if k.startswith("CompositeExplicit")}
        assert replaced <= {EXPLICIT_COMPOSITES_REPLACED.get(name)}, (version, name, replaced)
    for (qualified, key), reason in why.items():  # what it leaves to torch, it leaves for a reason in the data
        keys = ops[qualified.removeprefix("aten::")]
        assert key in keys or "CompositeImplicitAutograd" in keys, (version, qualified, key, reason)
    # As read from the wheels: no supported torch has any of these kernels for its MPS key, so all are needed.
    assert why == {}, f"torch {version} has kernels of its own now: {why}; update docs/torch_sparse_mps.md"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_metadata_redispatch_target_exists(version):
    """METADATA on MPS redispatches to torch's SparseCsrCPU kernel: it must exist in every version."""
    ops = DATA["torch"][version]["ops"]
    assert [name for name in sparse_mps_ops.METADATA if "SparseCsrCPU" not in ops[name]] == []


def test_the_rule_skips_what_torch_has_or_lacks():
    """A version with its own kernel for a key, a CompositeImplicitAutograd decomposition, or without the op: the
    entry is skipped, with the reason, and everything else is still registered."""
    exists, has = facts(VERSIONS[-1])
    todo, why = sparse_mps_ops.plan(lambda n: n != "sparse_mask" and exists(n),
                                    lambda n, k: (n, k) in {("mm", "SparseCsrMPS"), ("mv", "CompositeImplicitAutograd")}
                                    or has(n, k))
    assert why == {("aten::sparse_mask", "SparseCsrMPS"): f"torch {torch.__version__.split('+')[0]} has no "
                                                          "aten::sparse_mask",
                   ("aten::mm", "SparseCsrMPS"): "torch has a SparseCsrMPS kernel",
                   ("aten::mv", "SparseCsrMPS"): "torch has a CompositeImplicitAutograd kernel"}
    assert len(todo) == len(sparse_mps_ops.entries()) - 3 and ("addmm", "SparseCsrMPS") in todo


def test_import_survives_a_torch_without_an_op():
    """In a fresh process whose torch lacks aten::sparse_mask, importing the package registers the rest and says
    why it skipped that one."""
    code = ("import json, torch\n"
            "namespace = type(torch.ops.aten)\n"
            "real = namespace.__getattr__\n"
            "def hide(self, name):\n"
            "    if name == 'sparse_mask':\n"
            "        raise AttributeError(name)\n"
            "    return real(self, name)\n"
            "namespace.__getattr__ = hide\n"
            "from torch_sparse_metal import sparse_mps_ops\n"
            "skipped = [[*k, v] for k, v in sparse_mps_ops.skipped().items()]\n"
            "print(json.dumps([sparse_mps_ops.registered(), skipped]))\n")
    registered, skipped = run_python_json(code)
    assert [s[:2] for s in skipped] == [["aten::sparse_mask", "SparseCsrMPS"]]
    assert "has no aten::sparse_mask" in skipped[0][2]
    assert len(registered) == len(sparse_mps_ops.entries()) - 1 and ["aten::mm", "SparseCsrMPS"] in registered


def test_the_schema_reading_matches_the_installed_dispatcher():
    """tsm_dev.aten_schemas's reading of the yaml (structured delegates, ufunc kernels, generated and default
    composites) against the live dispatcher of this torch, for every recorded key a Linux build has."""
    if INSTALLED not in DATA["torch"]:
        pytest.skip(f"torch {INSTALLED} is not in the data file")
    wrong = []
    for name, keys in DATA["torch"][INSTALLED]["ops"].items():
        for key in set(DATA["keys"]) - MPS_KEYS:
            live = torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key)
            if live != (key in keys):
                wrong.append((name, key, live))
    assert wrong == []


def test_the_live_registrations_follow_the_rule():
    """On the installed torch: every entry was registered at import (and the dispatcher now has a kernel for its key)
    or skipped for a reason; with this torch's facts from the data file, the plan is the same."""
    registered, skipped = sparse_mps_ops.registered(), sparse_mps_ops.skipped()
    entries = [(f"aten::{n}", k) for n, k in sparse_mps_ops.entries()]
    assert sorted(registered + list(skipped)) == sorted(entries) and len(set(registered)) == len(registered)
    for name, key in registered:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)
    if INSTALLED in DATA["torch"]:
        todo, why = sparse_mps_ops.plan(*facts(INSTALLED))
        assert registered == [(f"aten::{n}", k) for n, k in todo] and skipped == why


def test_the_script_reads_a_wheel(tmp_path):
    """read_wheel on a small zip laid out like a torch wheel (the real download is the command's job)."""
    import zipfile

    yaml = ("- func: mm(Tensor self, Tensor mat2) -> Tensor\n  structured_delegate: mm.out\n  dispatch:\n"
            "    SparseCsrCPU, SparseCsrCUDA: f\n"
            "- func: mm.out(Tensor self, Tensor mat2, *, Tensor(a!) out) -> Tensor(a!)\n  structured: True\n"
            "  dispatch:\n    CPU: g\n    MPS: h\n    SparseCsrCPU: i\n"
            "- func: add.out(Tensor self, Tensor other, *, Tensor(a!) out) -> Tensor(a!)\n  structured: True\n"
            "  ufunc_inner_loop:\n    Generic: add (AllAndComplex)\n  dispatch:\n    MPS: j\n"
            "- func: add.Tensor(Tensor self, Tensor other) -> Tensor\n  structured_delegate: add.out\n"
            "- func: to_sparse_csc(Tensor self) -> Tensor\n")
    wheel = tmp_path / "torch-9.9.0-cp311-cp311-macosx_14_0_arm64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(aten_schemas.YAML_PATH, yaml)
    got = aten_schemas.read_wheel(wheel, ["mm", "add.Tensor", "to_sparse_csc", "nope"])
    non_functional = "CompositeExplicitAutogradNonFunctional"
    assert got == {"wheel": wheel.name, "ops": {"mm": ["MPS", "SparseCsrCPU", "CPU", non_functional],
                                                "add.Tensor": ["MPS", "CPU", non_functional],
                                                "to_sparse_csc": ["CompositeImplicitAutograd"], "nope": None}}
    assert json.loads(aten_schemas.dump({"about": "x", "keys": ["CPU"], "torch": {"9.9": got}}))["torch"]["9.9"] == got
