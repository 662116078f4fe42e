"""setuptools hook: ships csrc/ inside the package (the JIT build compiles it on first CUDA use)
and, with CUTLASS_EXT_BUILD_AOT=1, builds the CUDA extension into the package at install time:

    CUTLASS_EXT_BUILD_AOT=1 CUTLASS_EXT_ARCH=90a pip install --no-build-isolation .

(--no-build-isolation: the build compiles against the torch you already have.)"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install compiles the checkout's csrc/ directly
        package = Path(self.build_lib) / "cutlass_ext"
        shutil.copytree(ROOT / "csrc", package / "csrc", dirs_exist_ok=True)
        if os.environ.get("CUTLASS_EXT_BUILD_AOT") == "1":
            sys.path.insert(0, str(ROOT))
            from cutlass_ext import _build

            _build.build_aot(package)


setup(cmdclass={"build_py": BuildPy})
