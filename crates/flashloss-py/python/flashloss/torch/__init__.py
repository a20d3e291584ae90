"""PyTorch's entry to flashloss's fused kernels.

Each loss is a ``torch.library`` custom op (:mod:`flashloss.torch._ops`): it runs its
forward and backward in one fused call (the gradients are formed while each block of
logits is on hand) and autograd scales them by the upstream gradient, so nothing
``[N, V]``-sized is ever allocated, and ``torch.compile(fullgraph=True)`` and
``torch.export`` trace through the ops. Tensors are borrowed, not copied: ``hidden``
and ``weight`` must share a dtype (float32, bfloat16 or float16; a half dtype mixed
with float32 is cast to the half one, as autocast would), and non-contiguous inputs are made contiguous. Every
error is a ``ValueError`` naming the argument.

``vocab_parallel_group`` (a ``torch.distributed`` ``ProcessGroup``) splits the LM head
over ranks by rows (tensor parallel): each rank passes every row of ``hidden`` and its
own contiguous block of ``weight``/``bias``, in rank order (blocks may differ in size);
the row statistics merge over the group, every rank gets the whole loss and ``hidden``
gradient and its own block's gradients. A bad input on any rank is the same
``ValueError`` on every rank. A head given as ``DTensor``s says this itself: ``Shard(0)``
runs vocab-parallel over its 1-D mesh, ``Replicate()`` locally, other layouts are refused
(:mod:`flashloss.torch._dtensor`).

Names and defaults are those of TRL's ``GRPOConfig`` and ``GRPOTrainer._compute_loss``
(see ``docs/torch.md`` for where each argument comes from and where flashloss differs).

The package mirrors :mod:`flashloss.jax`: ``_args`` (argument checks), ``_grpo`` (the GRPO
losses), ``_losses`` (cross-entropy, log-probs), ``_logprobs``, ``_packed``, and the
custom ops (``_ops``, ``_logits_ops``, ``_op_utils``), with ``_dist`` and ``_dtensor`` for
a vocab-parallel head.
"""

from .._spec import GRPOOutputs, LogprobOutputs
from ._grpo import grpo_loss, linear_grpo_loss
from ._losses import linear_cross_entropy, linear_logprobs

__all__ = [
    "GRPOOutputs",
    "LogprobOutputs",
    "grpo_loss",
    "linear_cross_entropy",
    "linear_grpo_loss",
    "linear_logprobs",
]
