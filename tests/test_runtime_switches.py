"""cutlass_ext.ops._runtime.dependent_launch: sets the extension's switch for the block and puts
the previous setting back, also when the block raises; without the extension it changes nothing.
(The launches themselves: tests/ops/test_dependent_launch.py, on a GPU.)"""

from __future__ import annotations

import pytest

from cutlass_ext.ops import _runtime


class FakeExtension:
    def __init__(self, enabled=True):
        self.enabled = enabled
        self.calls = []

    def _set_dependent_launch(self, enabled):
        self.calls.append(enabled)
        previous, self.enabled = self.enabled, enabled
        return previous


@pytest.mark.parametrize("start", [True, False])
def test_sets_and_restores(monkeypatch, start):
    ext = FakeExtension(start)
    monkeypatch.setattr(_runtime, "extension", lambda: ext)
    with _runtime.dependent_launch(not start):
        assert ext.enabled is (not start)
        with _runtime.dependent_launch(start):  # nested: the inner block's setting, then the outer's again
            assert ext.enabled is start
        assert ext.enabled is (not start)
    assert ext.enabled is start
    assert ext.calls == [not start, start, not start, start]


def test_restores_when_the_block_raises(monkeypatch):
    ext = FakeExtension(True)
    monkeypatch.setattr(_runtime, "extension", lambda: ext)
    with pytest.raises(RuntimeError, match="inside"):
        with _runtime.dependent_launch(False):
            assert ext.enabled is False
            raise RuntimeError("inside")
    assert ext.enabled is True


def test_without_the_extension_changes_nothing(monkeypatch):
    monkeypatch.setattr(_runtime, "extension", lambda: None)
    with _runtime.dependent_launch(False):
        pass
