"""Tunix's GRPO (and PPO) learner with its per-token log-probs and entropy computed by
:func:`flashloss.jax.linear_logprobs` from the model's last hidden states and its LM head,
so the ``[B, T, V]`` logits are never formed::

    import flashloss.tunix
    flashloss.tunix.patch()          # before building the GRPOLearner
    learner = GRPOLearner(rl_cluster=..., algo_config=GRPOConfig(...), reward_fns=...)
    learner.train(dataset)
    flashloss.tunix.unpatch()        # Tunix exactly as it was

What is replaced (and restored by :func:`unpatch`), in Tunix 0.1.7:

- ``tunix.rl.common.compute_per_token_logps``: every caller (the policy loss, the
  reference pass of the inference worker, the old-policy pass of ``RLCluster``, the
  vanilla rollout's) gets the log-probs from the hidden states. A caller that asks for
  the logits (``return_logits=True``) gets them, from Tunix's own function, unless it
  is one of the two loss functions below.
- the ``policy_loss_fn`` registrations ``"grpo"`` and ``"ppo"`` (the only names
  ``AlgorithmConfig`` accepts): each becomes a wrapper that runs Tunix's own
  ``grpo_loss_fn`` / ``ppo_policy_loss_fn`` (all of its math: ``loss_algo``,
  ``loss_agg_mode``, dual-clip ``epsilon_c``, KL modes and clamp, sampler IS weights,
  its aux metrics) with ``compute_per_token_logps`` returning, in place of the logits,
  the per-token entropy that ``linear_logprobs`` computed in the same pass;
- ``tunix.rl.algo_core.compute_entropy_from_logits``, which returns that entropy.

The learners look the loss function up when they are built, so patch first.

How the hidden states are obtained: the model (Qwen2, Qwen3, Llama3, Gemma, Gemma3,
Gemma4 of ``tunix.models``) runs its own ``__call__`` with its LM head swapped, on the
copy that ``nnx.merge`` builds inside the traced function, for a capture that keeps the
final-normed hidden states and the head's weight as the head would have used them (cast
to the head's compute dtype): the tied embedding ``[V, H]`` (``weight_layout="vh"``) or
the ``Einsum`` ``'BTD,DV->BTV'`` kernel ``[H, V]`` (``"hv"``), no transposed copy. A
final logit soft-cap (Gemma 2's ``final_logit_softcap``, Gemma 4's) is refused with a
``ValueError``: ``linear_logprobs`` has no soft-cap. So is any other model class.

Paths: ``impl="auto"`` runs flashloss's XLA FFI handlers on CPU and the Pallas TPU kernels
when the step is lowered for a TPU; the Pallas path is checked in interpret mode only and
has never run on a TPU.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

__all__ = ["SUPPORTED_MODELS", "is_patched", "patch", "unpatch"]

#: The Tunix model classes whose head is captured: (module, class).
SUPPORTED_MODELS = (
    ("tunix.models.qwen2.model", "Qwen2"),
    ("tunix.models.qwen3.model", "Qwen3"),
    ("tunix.models.llama3.model", "Llama3"),
    ("tunix.models.gemma.model", "Gemma"),
    ("tunix.models.gemma3.model", "Gemma3"),
    ("tunix.models.gemma4.model", "Gemma4"),
)
_LOSS_NAMES = ("grpo", "ppo")
_CATEGORY = "policy_loss_fn"

_state: dict[str, Any] = {}  # what patch() replaced: name -> original
_options: dict[str, Any] = {"impl": "auto", "mode": "auto", "budget_mib": None, "interpret": False}
_local = threading.local()


@dataclass(frozen=True)
class _Entropy:
    """What the patched ``compute_per_token_logps`` returns in place of the logits inside
    a patched loss: the per-token entropy ``[B, T]`` that the patched
    ``compute_entropy_from_logits`` hands back."""

    entropy: jax.Array


class _HeadCapture:
    """Stands in for the LM head (``embedder.decode`` or ``lm_head``): keeps the hidden
    states and the weight in the head's compute dtype, and returns the hidden states (the
    model's remaining casts of them are dead code)."""

    def __init__(self, module: Any, layout: str):
        self.module, self.layout = module, layout
        self.got: Optional[tuple[jax.Array, jax.Array, str]] = None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.got is not None:
            raise ValueError("flashloss.tunix: the model called its LM head twice in one forward")
        m = self.module
        w = m.input_embedding.value if self.layout == "vh" else m.w.value
        dtype = getattr(m, "dtype", None) or getattr(getattr(m, "config", None), "dtype", None)
        dtype = jnp.result_type(x.dtype, w.dtype) if dtype is None else dtype
        self.got = (jnp.astype(x, dtype), jnp.astype(w, dtype), self.layout)
        return x


def _supported(model: Any) -> None:
    cls = type(model)
    if (cls.__module__, cls.__name__) not in SUPPORTED_MODELS:
        names = ", ".join(n for _, n in SUPPORTED_MODELS)
        raise ValueError(
            f"flashloss.tunix: unsupported model class {cls.__module__}.{cls.__name__} (supported: {names})"
        )
    softcap = getattr(model, "final_logits_softcap", None)
    if softcap is None:
        softcap = getattr(getattr(model, "config", None), "final_logit_softcap", None)
    if softcap is not None:
        raise ValueError(
            f"flashloss.tunix: {cls.__name__} has final_logit_softcap={softcap}; flashloss.jax.linear_logprobs "
            "has no logit soft-cap, so this model is not supported (unpatch, or set final_logit_softcap=None)"
        )


def _install_capture(model: Any) -> list[_HeadCapture]:
    """Swaps the head(s) of ``model`` (a fresh ``nnx.merge`` copy) for captures."""
    from flax import nnx

    caps = []
    embedder = getattr(model, "embedder", None)
    if embedder is not None:
        cap = _HeadCapture(embedder, "vh")
        embedder.decode = cap
        caps.append(cap)
    head = getattr(model, "lm_head", None)
    if head is not None:
        if getattr(head, "einsum_str", None) != "BTD,DV->BTV":
            einsum = getattr(head, "einsum_str", None)
            raise ValueError(f"flashloss.tunix: lm_head einsum {einsum!r} is not 'BTD,DV->BTV'")
        if len(jax.tree.leaves(nnx.state(head, nnx.LoRAParam))):
            raise ValueError("flashloss.tunix: a LoRA lm_head is not supported")
        cap = _HeadCapture(head, "hv")
        model.lm_head = cap
        caps.append(cap)
    return caps


def _model_kwargs(model: Any, positions, attn_mask, seg_ids, segment_ids, images) -> dict:
    """The keyword arguments Tunix's ``compute_per_token_logps`` passes the model."""
    kwargs = {"positions": positions, "cache": None, "attention_mask": attn_mask}
    try:
        sig = inspect.signature(model.__call__)
        has_segment_ids = "segment_ids" in sig.parameters or any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
        )
    except (TypeError, ValueError):
        has_segment_ids = False
    if has_segment_ids:
        if segment_ids is not None:
            kwargs["segment_ids"] = segment_ids
        elif seg_ids is not None:
            kwargs["segment_ids"] = seg_ids
    if images is not None:
        kwargs["images"] = images
    return kwargs


def _logps(graphdef, state, prompt_tokens, completion_tokens, images, segment_ids, segment_positions, *,
           pad_id: int, eos_id: int, stop_gradient: bool, temperature: float, entropy: bool, impl: str,
           mode: str, budget_mib: Optional[float], interpret: bool):  # fmt: skip
    """Tunix's ``compute_per_token_logps`` with the head's logits replaced by
    ``linear_logprobs`` on the captured hidden states: ``(logp, entropy or None)``."""
    from flax import nnx
    from tunix.rl import common

    from ...jax import linear_logprobs
    from ...jax._head import vocab_size

    model = nnx.merge(graphdef, state)
    _supported(model)
    tokens, positions, attn_mask, seg_ids = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions
    )
    kwargs = _model_kwargs(model, positions, attn_mask, seg_ids, segment_ids, images)
    caps = _install_capture(model)
    model(tokens, **kwargs)
    got = [c.got for c in caps if c.got is not None]
    if len(got) != 1:
        raise ValueError(f"flashloss.tunix: expected the model to call one LM head, it called {len(got)}")
    hidden, weight, layout = got[0]
    keep = tokens.shape[1] - 1 if segment_ids is not None else completion_tokens.shape[1]
    hidden = hidden[:, -keep - 1 : -1]
    ids = tokens[:, -keep:]
    temp = 1.0 if temperature in (0.0, 1.0) else float(temperature)
    logp, ent = linear_logprobs(
        hidden,
        weight,
        ids,
        temperature=temp,
        return_entropy=True,
        impl=impl,
        mode=mode,
        budget_mib=budget_mib,
        weight_layout=layout,
        interpret=interpret,
    )[:2]
    if segment_ids is not None:
        # Tunix pads the logits' first position with zeros: log-prob 0, entropy log V.
        vocab = vocab_size(weight, layout)
        logp = jnp.pad(logp, ((0, 0), (1, 0)), constant_values=0.0)
        ent = jnp.pad(ent, ((0, 0), (1, 0)), constant_values=float(jnp.log(jnp.float32(vocab))))
    if stop_gradient:
        logp, ent = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ent)
    return logp, (ent if entropy else None)


_logps_jit = jax.jit(
    _logps,
    static_argnames=(
        "pad_id",
        "eos_id",
        "stop_gradient",
        "temperature",
        "entropy",
        "impl",
        "mode",
        "budget_mib",
        "interpret",
    ),
)


def _in_loss() -> bool:
    return getattr(_local, "depth", 0) > 0


def compute_per_token_logps(
    graphdef,
    state,
    prompt_tokens: jax.Array,
    completion_tokens: jax.Array,
    pad_id: int,
    eos_id: int,
    images: Optional[jax.Array] = None,
    stop_gradient: bool = True,
    return_logits: bool = False,
    segment_ids: Optional[jax.Array] = None,
    segment_positions: Optional[jax.Array] = None,
    temperature: float = 1.0,
):
    """The replacement of ``tunix.rl.common.compute_per_token_logps`` (same arguments).
    Inside a patched loss, ``return_logits=True`` gives ``(logp, entropy)`` with the
    entropy in place of the logits; elsewhere it calls Tunix's own function."""
    if return_logits and not _in_loss():
        return _state["compute_per_token_logps"](
            graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, images=images,
            stop_gradient=stop_gradient, return_logits=True, segment_ids=segment_ids,
            segment_positions=segment_positions, temperature=temperature,
        )  # fmt: skip
    logp, ent = _logps_jit(
        graphdef, state, prompt_tokens, completion_tokens, images, segment_ids, segment_positions,
        pad_id=int(pad_id), eos_id=int(eos_id), stop_gradient=bool(stop_gradient), temperature=float(temperature),
        entropy=bool(return_logits), impl=_options["impl"], mode=_options["mode"], budget_mib=_options["budget_mib"],
        interpret=_options["interpret"],
    )  # fmt: skip
    return (logp, _Entropy(ent)) if return_logits else logp


def compute_entropy_from_logits(logits: Any) -> jax.Array:
    """The replacement of ``tunix.rl.algo_core.compute_entropy_from_logits``: the entropy
    that the patched ``compute_per_token_logps`` computed, or Tunix's on real logits."""
    if isinstance(logits, _Entropy):
        return logits.entropy
    return _state["compute_entropy_from_logits"](logits)


def _wrap_loss(original: Callable) -> Callable:
    def loss_fn(*args: Any, **kwargs: Any):
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _local.depth -= 1

    loss_fn.__name__ = f"flashloss_{getattr(original, '__name__', 'loss_fn')}"
    loss_fn.__doc__ = f"Tunix's {getattr(original, '__name__', 'loss')} with log-probs and entropy from flashloss."
    loss_fn.__wrapped__ = original  # type: ignore[attr-defined]
    return loss_fn


def _registry():
    from tunix.rl import function_registry

    return function_registry.default_registry


def patch(
    *, impl: str = "auto", mode: str = "auto", budget_mib: Optional[float] = None, interpret: bool = False
) -> None:
    """Routes Tunix's per-token log-probs and entropy through flashloss (see the module).
    ``impl``: ``"auto"`` (FFI on CPU, Pallas on TPU), ``"ffi"`` or ``"pallas"``;
    ``mode`` and ``budget_mib``: the FFI kernel's plan (``"auto_f32"`` keeps f32
    exponentials; ``"auto"`` may pick the compact block, gradients within 1e-3 of the
    largest) and workspace budget; ``interpret=True`` runs the Pallas kernels in TPU interpret
    mode (``impl="pallas"`` on a machine without a TPU). Patching twice only updates the options."""
    if impl not in ("auto", "ffi", "pallas"):
        raise ValueError(f"argument `impl`: expected 'auto', 'ffi' or 'pallas', got {impl!r}")
    _options.update(
        impl=impl, mode=mode, budget_mib=None if budget_mib is None else float(budget_mib), interpret=bool(interpret)
    )
    if _state:
        return
    from tunix.rl import algo_core, common

    registry = _registry()
    _state["compute_per_token_logps"] = common.compute_per_token_logps
    _state["compute_entropy_from_logits"] = algo_core.compute_entropy_from_logits
    with registry._lock:
        table = registry._registry[_CATEGORY]
        for name in _LOSS_NAMES:
            if name in table:
                _state[f"{_CATEGORY}/{name}"] = table[name]
                table[name] = _wrap_loss(table[name])
    common.compute_per_token_logps = compute_per_token_logps
    algo_core.compute_entropy_from_logits = compute_entropy_from_logits


def unpatch() -> None:
    """Restores every function and registration :func:`patch` replaced."""
    if not _state:
        return
    from tunix.rl import algo_core, common

    common.compute_per_token_logps = _state.pop("compute_per_token_logps")
    algo_core.compute_entropy_from_logits = _state.pop("compute_entropy_from_logits")
    registry = _registry()
    with registry._lock:
        table = registry._registry[_CATEGORY]
        for key in list(_state):
            table[key.split("/", 1)[1]] = _state.pop(key)
    _options.update(impl="auto", mode="auto", budget_mib=None, interpret=False)


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_state)
