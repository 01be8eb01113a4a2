"""Environment settings: one parser (torch_sparse_metal.settings) for every variable the package reads. Booleans
take torch's spellings in any case with surrounding spaces; anything else is refused with the variable, its
value and the accepted values, never taken silently for the default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_sparse_metal
from torch_sparse_metal import _autotune, settings
from torch_sparse_metal.backends.mps import MetalCsrLinear

NAME = "TORCH_SPARSE_METAL_TEST_SETTING"
PACKAGE = Path(torch_sparse_metal.__file__).parent
TOOLS = PACKAGE.parent / "torch_sparse_metal_tools"
TRAINER = PACKAGE.parent / "examples" / "char_lm"
CPU = torch.device("cpu")


def _spellings(words: tuple[str, ...]) -> list[str]:
    return [form for w in words for form in (w, w.upper(), w.capitalize(), f"  {w}\t", f" {w.upper()} ")]


@pytest.mark.parametrize("value", _spellings(settings.TRUE))
def test_true_spellings(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert settings.flag(NAME, default=False) is True


@pytest.mark.parametrize("value", _spellings(settings.FALSE))
def test_false_spellings(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert settings.flag(NAME, default=True) is False


@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("value", [None, "", "   "])
def test_unset_or_empty_is_the_default(monkeypatch, value, default):
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    assert settings.flag(NAME, default=default) is default


@pytest.mark.parametrize("value", ["2", "-1", "tru", "y", "n", "enable", "on off", "0.0", "none", "1 0"])
def test_other_values_are_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ValueError) as info:
        settings.flag(NAME, default=True)
    message = str(info.value)
    assert NAME in message and repr(value) in message
    assert all(word in message for word in settings.TRUE + settings.FALSE)


def test_choice(monkeypatch):
    choices = ("native", "generic")
    for value, expected in (("generic", "generic"), (" GENERIC ", "generic"), ("Native", "native"), ("", "native")):
        monkeypatch.setenv(NAME, value)
        assert settings.choice(NAME, choices, "native") == expected
    monkeypatch.setenv(NAME, "avx512")
    with pytest.raises(ValueError, match=rf"{NAME}='avx512' is not one of native, generic"):
        settings.choice(NAME, choices, "native")


@pytest.mark.parametrize(("value", "expected"), [("off", False), ("false", False), ("No", False), (" 0 ", False),
                                                 ("", False), ("1", True), (" ON ", True), ("yes", True)])
def test_tune_follows_the_parser(monkeypatch, value, expected):
    monkeypatch.setenv("TORCH_SPARSE_METAL_TUNE", value)
    assert _autotune.from_environment() is expected


def test_tune_is_off_unless_set_and_read_at_import(tmp_path):
    """Unset: the ops run the static rules and write nothing; set to on: the switch is on; a value that is no
    boolean stops the import with the variable named."""
    code = ("import torch; layer = t.SparseLinear(40, 30, density=0.3); layer(torch.randn(8, 40)).sum().backward(); "
            "print(t._autotune.enabled)")
    off = _import_with({"TORCH_SPARSE_METAL_CACHE_DIR": str(tmp_path)}, code, drop=("TORCH_SPARSE_METAL_TUNE",))
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False"] and list(tmp_path.iterdir()) == []
    on = _import_with({"TORCH_SPARSE_METAL_TUNE": "1"}, "print(t._autotune.enabled)")
    assert on.returncode == 0 and on.stdout.split() == ["True"], on.stderr
    bad = _import_with({"TORCH_SPARSE_METAL_TUNE": "disabled"}, "")
    assert bad.returncode != 0
    assert "ValueError: TORCH_SPARSE_METAL_TUNE='disabled' is not a boolean" in bad.stderr


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("TRUE", True), (" on ", True), ("0", False),
                                                 ("off", False), ("", False)])
def test_metal_poison_follows_the_parser(monkeypatch, value, expected):
    monkeypatch.setenv("TORCH_SPARSE_METAL_POISON", value)
    assert MetalCsrLinear(lambda src: None, device_type="cpu").poison is expected
    monkeypatch.setenv("TORCH_SPARSE_METAL_POISON", "sometimes")
    with pytest.raises(ValueError, match="TORCH_SPARSE_METAL_POISON='sometimes'"):
        MetalCsrLinear(lambda src: None, device_type="cpu")


def _import_with(env: dict[str, str], code: str, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPARSE_METAL_CPU_KERNELS", *drop)}
    return subprocess.run([sys.executable, "-c", f"import torch_sparse_metal as t\n{code}"], capture_output=True,
                          text=True, timeout=120, env={**base, **env}, cwd=PACKAGE.parent)


def test_cpu_kernel_set_is_parsed_at_import():
    """An unknown kernel set stops the import with the variable named; a known one in any case is used."""
    bad = _import_with({"TORCH_SPARSE_METAL_CPU_KERNELS": "avx9"}, "")
    assert bad.returncode != 0
    assert "ValueError: TORCH_SPARSE_METAL_CPU_KERNELS='avx9' is not one of native, generic" in bad.stderr
    good = _import_with({"TORCH_SPARSE_METAL_CPU_KERNELS": " Generic "}, "print(t.backends.cpu._current)")
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == "generic"


def _sources() -> list[Path]:
    """The Python files of the package, its commands (less their test helpers) and the training example."""
    return [*PACKAGE.rglob("*.py"), *(p for p in TOOLS.rglob("*.py") if "testing" not in p.relative_to(TOOLS).parts),
            *TRAINER.rglob("*.py")]


def test_every_setting_is_read_through_the_parser():
    """Only settings.py touches the environment, besides the readers of other programs' variables (torchrun's in
    the training example, OpenMP's in the commands' start-up note); every variable the package names is a documented
    TORCH_SPARSE_METAL_ setting, none uses another prefix."""
    foreign_readers = {TRAINER / "launch.py", TRAINER / "decoupled.py", TOOLS / "cli.py"}
    readers = {p for p in _sources() if re.search(r"os\.environ|getenv|os\.putenv", p.read_text())}
    assert readers <= {PACKAGE / "settings.py"} | foreign_readers
    documented = set(re.findall(r"``(TORCH_SPARSE_METAL_[A-Z_]+)``", settings.__doc__))
    assert documented == {"TORCH_SPARSE_METAL_TUNE", "TORCH_SPARSE_METAL_CACHE_DIR",
                          "TORCH_SPARSE_METAL_CPU_KERNELS", "TORCH_SPARSE_METAL_POISON", "TORCH_SPARSE_METAL_METAL",
                          "TORCH_SPARSE_METAL_PASSIVE_WAIT", "TORCH_SPARSE_METAL_SPARSE_MPS"}
    for path in _sources():
        text = path.read_text()
        named = set(re.findall(r"\bTORCH_SPARSE_METAL_[A-Z_]*[A-Z]\b", text)) - {NAME, "TORCH_SPARSE_METAL_EXAMPLE"}
        assert named <= documented, (path, named - documented)
        assert not re.search(r"[\"']TSM_[A-Z_]+[\"']", text), path


@pytest.mark.parametrize("value,forced", [(None, False), ("", False), ("kernels", False), (" Reference ", True),
                                          ("REFERENCE", True)])
def test_metal_setting_chooses_the_reference_path(monkeypatch, value, forced):
    """TORCH_SPARSE_METAL_METAL=reference runs the MPS ops on torch's own ops (read at each call until
    use_reference decides); anything but kernels/reference is refused by name."""
    from torch_sparse_metal.backends import metal

    monkeypatch.setattr(metal, "_force_reference", None)
    if value is None:
        monkeypatch.delenv("TORCH_SPARSE_METAL_METAL", raising=False)
    else:
        monkeypatch.setenv("TORCH_SPARSE_METAL_METAL", value)
    assert metal.reference_forced() is forced
    metal.use_reference(not forced)
    assert metal.reference_forced() is (not forced)
    monkeypatch.setenv("TORCH_SPARSE_METAL_METAL", "cpu")
    metal.use_reference(None)
    with pytest.raises(ValueError, match="TORCH_SPARSE_METAL_METAL='cpu' is not one of kernels, reference"):
        metal.reference_forced()


_NOT_BOOLS = ["off", "false", "0", "", "on", 0, 1, 0.0, None, torch.tensor(False), [False]]


@pytest.mark.parametrize("value", _NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("on", [False, True])
def test_tuning_enable_takes_true_or_false_only(monkeypatch, value, on):
    """tuning.enable refuses what is not a bool, as torch's switches do (bool("off") is True), naming the switch
    and the value, and the switch stays as it was; True and False set it."""
    from torch_sparse_metal import tuning

    monkeypatch.setattr(_autotune, "enabled", on)
    with pytest.raises(TypeError, match=re.escape(f"tuning.enable(on) must be True or False, got {value!r}")):
        tuning.enable(value)
    assert tuning.enabled() is on
    tuning.enable(not on)
    assert tuning.enabled() is (not on)


@pytest.mark.parametrize("value", [v for v in _NOT_BOOLS if v is not None], ids=repr)
def test_use_reference_takes_true_false_or_none_only(monkeypatch, value):
    """use_reference refuses what is not a bool or None (None follows TORCH_SPARSE_METAL_METAL), and keeps its
    setting."""
    from torch_sparse_metal.backends import metal

    monkeypatch.setattr(metal, "_force_reference", False)
    monkeypatch.delenv("TORCH_SPARSE_METAL_METAL", raising=False)
    with pytest.raises(TypeError, match=re.escape(f"use_reference(on) must be True, False or None, got {value!r}")):
        metal.use_reference(value)
    assert metal.reference_forced() is False
    for on in (True, False):
        metal.use_reference(on)
        assert metal.reference_forced() is on
