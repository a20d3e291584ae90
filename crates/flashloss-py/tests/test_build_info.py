"""``flashloss.build_info()``: what the build holds, and a host without an NVIDIA driver."""

import ctypes.util

import flashloss
from flashloss import _native


def test_build_info_names_what_was_compiled_in():
    info = flashloss.build_info()
    assert set(info) == {"version", "cuda", "cuda_driver", "cpu_features"}
    assert info["version"] == flashloss.__version__
    assert info["cuda"] is _native.cuda_build
    assert all(isinstance(f, str) for f in info["cpu_features"])
    assert set(info["cpu_features"]) <= {"avx2", "fma", "avx512f", "avx512bw", "avx512bf16"}
    if info["cuda"]:
        assert isinstance(info["cuda_driver"], bool)
    else:
        assert info["cuda_driver"] is None


def test_the_driver_is_found_where_the_loader_finds_libcuda():
    info = flashloss.build_info()
    if info["cuda"] and ctypes.util.find_library("cuda") is None:
        # cudarc looks for libcuda.so by its usual names; none is on this host's search path
        assert info["cuda_driver"] is False


def test_a_cpu_call_works_in_a_cuda_build_without_a_driver():
    import torch

    import flashloss.torch as fl

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3), generator=g)
    loss = fl.linear_cross_entropy(hidden, weight, targets)
    want = torch.nn.functional.cross_entropy((hidden @ weight.T).reshape(-1, 11), targets.reshape(-1))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
