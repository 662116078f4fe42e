import os
import zlib

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


def seed_of(nodeid: str) -> int:
    """The seed a test runs with: a checksum of its id, so that each test draws different inputs and a
    failure reproduces in another process (Python's own string hash is salted per process).
    CUTLASS_EXT_TEST_SEED=n shifts every test's seed, to rerun the suite on other inputs."""
    return (zlib.crc32(nodeid.encode()) + int(os.environ.get("CUTLASS_EXT_TEST_SEED", "0"))) % (2**31)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(seed_of(request.node.nodeid))
