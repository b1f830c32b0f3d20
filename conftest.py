"""Suite-wide settings for tests/ and integration-tests/ (here, at the root, so both folders get them).

int4 layers on CPUs round activations to int8 by default (`serve --cpu-int8-activations auto`,
kernels/cpu_act_int8.py). The suite's exactness tests compare layers and models against exact
references (dequantized weights, transformers), so it runs with exact activations unless the caller
chose (`TGS_CPU_INT8_ACTIVATIONS=auto pytest ...` runs it under the default); tests/test_cpu_act_int8.py
sets the policy per test.

Kernel measurements (kernels/select.py: the choices warmup times per machine) go to a folder of the
session's own unless the caller names one in TGS_KERNEL_CACHE: a test must neither read choices an
earlier run or a benchmark left in ~/.cache nor leave its tiny models' entries there. The servers
the tests start inherit it.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("TGS_CPU_INT8_ACTIVATIONS", "off")
if "TGS_KERNEL_CACHE" not in os.environ:
    _kernel_cache = tempfile.mkdtemp(prefix="tgs-test-kernel-cache-")
    os.environ["TGS_KERNEL_CACHE"] = _kernel_cache
    atexit.register(shutil.rmtree, _kernel_cache, ignore_errors=True)


@pytest.fixture
def native():
    """The native CPU kernels' extension, or the test skipped where it cannot be built (test_cpu_native's
    build test fails on such a machine and says why)."""
    from text_generation_server.kernels import cpu_native

    module = cpu_native.native()
    if module is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    return module


@pytest.fixture
def native_pool(native):
    """`native`, with torch's thread count and the kernels' pool settings put back after the test (tests that
    vary the threads, the split mode or the chunks per thread)."""
    import torch

    from text_generation_server.kernels import cpu_native

    threads = torch.get_num_threads()
    yield native
    torch.set_num_threads(threads)
    cpu_native.set_parallel_mode(native, True, 50, 20, 8)


@pytest.fixture
def torch_pointwise(monkeypatch):
    """The model's norms in torch's own ops, summed in the order transformers' are, for the fp8
    tests that compare a server model with transformers' through dynamic e4m3 input roundings.

    The native float32 RMSNorm (kernels/cpu_native_pointwise_src.py) sums x^2 in its own order, a
    float32 ulp from torch's in about half the rows (tests/test_cpu_pointwise_f32.py bounds that).
    Before an e4m3 rounding an ulp can cross a rounding boundary, and a random tiny model carries
    one flipped code to a greedy choice (an Ice Lake CPU: prompt log-probs 0.03 apart, tokens parted
    at the second). Those tests judge the declared input arithmetic, so the norms run the
    reference's; the native ones are judged where they are the subject. Spawned ranks inherit it."""
    from text_generation_server.kernels import cpu_pointwise

    monkeypatch.setenv(cpu_pointwise.ENV, "0")
