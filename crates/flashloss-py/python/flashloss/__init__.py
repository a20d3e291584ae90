"""flashloss: fused GRPO and cross-entropy losses computed from the hidden states and the
LM head, without ever holding the ``[tokens x vocab]`` logits or their gradient.

The PyTorch API lives in :mod:`flashloss.torch` (``import flashloss.torch``); this
module imports nothing but the native extension.
"""

from ._native import __version__

__all__ = ["__version__"]
