"""cutlass_ext.ops._runtime.dependent_launch and gemm_dependent_launch: each sets its own switch of
the extension for the block and puts the previous setting back, also when the block raises;
without the extension they change nothing. (The launches themselves: tests/ops/test_dependent_launch.py,
on a GPU.)"""

from __future__ import annotations

import pytest

from cutlass_ext.ops import _runtime


class FakeExtension:
    def __init__(self, enabled=True):
        self.enabled = {"all": enabled, "gemm": enabled}
        self.calls = []

    def _set(self, which, enabled):
        self.calls.append((which, enabled))
        previous, self.enabled[which] = self.enabled[which], enabled
        return previous

    def _set_dependent_launch(self, enabled):
        return self._set("all", enabled)

    def _set_gemm_dependent_launch(self, enabled):
        return self._set("gemm", enabled)


SWITCHES = {"all": _runtime.dependent_launch, "gemm": _runtime.gemm_dependent_launch}


@pytest.mark.parametrize("which", list(SWITCHES))
@pytest.mark.parametrize("start", [True, False])
def test_sets_and_restores(monkeypatch, start, which):
    ext = FakeExtension(start)
    monkeypatch.setattr(_runtime, "extension", lambda: ext)
    other = "gemm" if which == "all" else "all"
    switch = SWITCHES[which]
    with switch(not start):
        assert ext.enabled[which] is (not start)
        with switch(start):  # nested: the inner block's setting, then the outer's again
            assert ext.enabled[which] is start
        assert ext.enabled[which] is (not start)
    assert ext.enabled[which] is start
    assert ext.calls == [(which, not start), (which, start), (which, not start), (which, start)]
    assert ext.enabled[other] is start  # the other switch is left alone


@pytest.mark.parametrize("which", list(SWITCHES))
def test_restores_when_the_block_raises(monkeypatch, which):
    ext = FakeExtension(True)
    monkeypatch.setattr(_runtime, "extension", lambda: ext)
    with pytest.raises(RuntimeError, match="inside"):
        with SWITCHES[which](False):
            assert ext.enabled[which] is False
            raise RuntimeError("inside")
    assert ext.enabled[which] is True


@pytest.mark.parametrize("which", list(SWITCHES))
def test_without_the_extension_changes_nothing(monkeypatch, which):
    monkeypatch.setattr(_runtime, "extension", lambda: None)
    with SWITCHES[which](False):
        pass
