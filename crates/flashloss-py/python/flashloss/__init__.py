"""flashloss: fused GRPO and cross-entropy losses computed from the hidden states and the
LM head, without ever holding the ``[tokens x vocab]`` logits or their gradient.

The PyTorch API lives in :mod:`flashloss.torch` (``import flashloss.torch``); this
module imports nothing but the native extension.
"""

from . import _native
from ._native import __version__

__all__ = ["__version__", "build_info", "cpu_bf16_products"]


def build_info() -> dict:
    """What this build of flashloss holds and what it found on this machine:
    ``{"version": str, "cuda": bool, "cuda_driver": bool | None, "cpu_features": [str, ...]}``.

    ``cuda``: the CUDA backend was compiled in (the default wheel; a CPU-only build is
    ``maturin build --no-default-features``). ``cuda_driver``: this machine's NVIDIA driver
    (``libcuda.so``) loads, which CUDA tensors need (None in a CPU-only build). The backend
    loads the driver, NVRTC and cuBLAS at run time, so importing flashloss and CPU calls work
    on a host without them. ``cpu_features``: the x86 features found at run time that the
    CPU kernels dispatch on (``avx2``, ``fma``, ``avx512f``, ``avx512bw``, ``avx512bf16``).
    """
    return dict(_native.build_info())


def cpu_bf16_products(bf16_products: str = "auto") -> dict:
    """What a bfloat16 head runs on the CPU for the setting ``bf16_products``:
    ``{"runs": "widened" | "avx512bf16", "by": ..., "rates": ...}``.

    ``by`` says what decided: ``"option"`` (``widened`` or ``avx512bf16`` asked for),
    ``"environment"`` (``auto`` and ``FLASHLOSS_BF16_PRODUCTS`` set), ``"no_avx512bf16"``
    (``auto`` on a CPU without AVX512-BF16) or ``"measured"`` (``auto``: the faster of the
    two paths on this CPU, measured once per process on a small product; ``rates`` then
    holds the measured ``{"widened": GFLOP/s, "avx512bf16": GFLOP/s}``, else ``None``).
    ``avx512bf16`` is taken only where it is at least 1.1x as fast as ``widened``
    (docs/torch.md). A ``ValueError`` for an unknown setting, a bad environment value,
    or ``avx512bf16`` on a CPU without AVX512-BF16.
    """
    return _native.cpu_bf16_products(bf16_products)
