import os

# Every CUDA output is NaN-filled before its kernel runs, so an unwritten element fails a test;
# and a CUDA build problem is an error here, never a silent fallback to the reference.
os.environ.setdefault("CUTLASS_EXT_POISON_OUTPUTS", "1")
os.environ.setdefault("CUTLASS_EXT_STRICT", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    # A different but reproducible seed per test: fresh inputs without flaky reruns.
    torch.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
