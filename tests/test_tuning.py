"""The GEMM tuning settings' Python side (file location, the environment switch, the module hook);
the measuring and the table itself are tested on the GPU in tests/ops/test_linear.py."""

from __future__ import annotations

import pytest

from cutlass_ext import _kernel_table, tuning


def test_tuning_file_location(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTLASS_EXT_TUNING_FILE", raising=False)
    monkeypatch.setenv("CUTLASS_EXT_CACHE_DIR", str(tmp_path / "cache"))
    assert tuning.tuning_file() == tmp_path / "cache" / "gemm_tuning.tsv"
    monkeypatch.setenv("CUTLASS_EXT_TUNING_FILE", str(tmp_path / "mine.tsv"))
    assert tuning.tuning_file() == tmp_path / "mine.tsv"


@pytest.mark.parametrize("value,expected", [("", False), ("0", False), ("1", True)])
def test_autotune_switch(monkeypatch, value, expected):
    monkeypatch.setenv("CUTLASS_EXT_AUTOTUNE", value)
    assert tuning.autotune_from_environment() is expected


def test_autotune_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("CUTLASS_EXT_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="CUTLASS_EXT_AUTOTUNE='yes' must be 0 or 1"):
        tuning.autotune_from_environment()


@pytest.mark.parametrize("value,expected", [("", 400), ("0", 0), ("250", 250), ("10000", 10000)])
def test_sustain_setting(monkeypatch, value, expected):
    monkeypatch.setenv("CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS", value)
    assert tuning.sustain_ms_from_environment() == expected


@pytest.mark.parametrize("value", ["-1", "0.5", "abc", "10001", "\u00b2"])
def test_sustain_setting_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS", value)
    with pytest.raises(ValueError, match=f"CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS='{value}' must be a whole number"):
        tuning.sustain_ms_from_environment()


def test_attach_hands_the_table_to_the_module(monkeypatch, tmp_path):
    calls = []

    class Module:
        def _configure_tuning(self, path, enabled):
            calls.append((path, enabled))

        def _set_tuning_sustain_ms(self, ms):
            calls.append(ms)

    monkeypatch.setenv("CUTLASS_EXT_TUNING_FILE", str(tmp_path / "sub" / "table.tsv"))
    monkeypatch.setenv("CUTLASS_EXT_AUTOTUNE", "1")
    monkeypatch.setenv("CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS", "150")
    tuning.attach(Module())
    assert calls == [(str(tmp_path / "sub" / "table.tsv"), True), 150]
    assert (tmp_path / "sub").is_dir()


def test_config_names_are_unique_and_say_their_path():
    names = _kernel_table.config_names()
    assert len(names) == len(set(names))
    for cfg in _kernel_table.all_configs():
        # A config names its GEMM path: transposed configs start with "t", Ampere ones with "sm80".
        assert cfg.name.startswith("t") == cfg.transposed
    assert all(c.name.startswith("sm80_") for c in _kernel_table.SM80_CONFIGS)
