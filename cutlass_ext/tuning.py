"""Persisted GEMM autotuning.

By default each GEMM picks its kernel config with a shape heuristic that needs no tuning run.
With tuning on, the first GEMM of each shape bucket (extents rounded up to powers of two, per
device, dtype, math mode, operand layouts and epilogue) instead times the built candidates (as
below), keeps the winner, and appends it to a table file so later processes reuse it::

    with cutlass_ext.tune():
        model(example_batch)          # tunes the buckets it meets (synchronizes while tuning)
    model(batch)                      # tuned configs are used from now on, also in new processes

``CUTLASS_EXT_AUTOTUNE=1`` turns tuning on for the whole process. The table lives in
``CUTLASS_EXT_TUNING_FILE`` (default: ``gemm_tuning.tsv`` in the cache directory); delete the file
to forget it. Calls captured into a CUDA graph never tune (they use the table or the heuristic),
and an explicit ``config=`` always wins.

A burst of a few calls runs at the GPU's boost clock, while a long run of large products
(training) runs at the power cap, where the tiles' clocks differ by 10-15%: timed by bursts alone,
the tuner picked tiles up to 17% slower there than the heuristic's (bench/NOTES.md section 72).
So the bursts only rank the candidates; those within 10% of the quickest, and the heuristic's
pick, are timed again, each after running alone for ``CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS``
milliseconds (default 400; 0 settles a bucket by the bursts alone), and the heuristic's pick stays
unless one of them is more than 2% faster there. Tuning a bucket thus takes 1-2.5 s. On an H200,
over 14 large bf16 products, the tuner so kept the heuristic's config on all 14; timed alone at
the cap, that config was the fastest on 13 and within 1.2% on the 14th (section 73).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import ModuleType

from . import _build


def tuning_file() -> Path:
    env = os.environ.get("CUTLASS_EXT_TUNING_FILE")
    return Path(env).expanduser() if env else _build.cache_root() / "gemm_tuning.tsv"


def autotune_from_environment() -> bool:
    value = os.environ.get("CUTLASS_EXT_AUTOTUNE", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"CUTLASS_EXT_AUTOTUNE={value!r} must be 0 or 1")
    return value == "1"


def sustain_ms_from_environment() -> int:
    value = os.environ.get("CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS", "")
    if value == "":
        return 400
    if not (value.isascii() and value.isdigit()) or int(value) > 10_000:
        raise ValueError(f"CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS={value!r} must be a whole number of milliseconds "
                         "from 0 to 10000 (0: time the candidates by short bursts alone)")
    return int(value)


def attach(module: ModuleType) -> None:
    """Loads the table into a freshly loaded extension and applies CUTLASS_EXT_AUTOTUNE."""
    path = tuning_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # an unwritable location: the table then lives in memory only
    module._configure_tuning(str(path), autotune_from_environment())
    module._set_tuning_sustain_ms(sustain_ms_from_environment())


@contextlib.contextmanager
def tune(enabled: bool = True):
    """Within the block, GEMMs of shape buckets not in the table are tuned (``enabled=False``
    turns tuning off instead)."""
    ext = _build.load()
    previous = ext._tuning_enabled()
    ext._set_tuning_enabled(enabled)
    try:
        yield
    finally:
        ext._set_tuning_enabled(previous)


def entries() -> dict[str, str]:
    """The tuned table: bucket key -> config name."""
    return dict(_build.load()._tuning_entries())
