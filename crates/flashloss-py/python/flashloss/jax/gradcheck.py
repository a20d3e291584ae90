"""``flashloss.jax`` against an f64 JAX reference of TRL's GRPO loss (every loss type,
token or sequence level) on materialized logits (``jax.value_and_grad`` in float64): the
loss and the gradients of the logits (logits level) or of ``hidden`` and ``weight``
(LM-head level), on one device or sharded over 8 simulated CPU devices (``parallel:
token | vocab | 2d``; 2d is a 2 x 4 mesh). ``impl`` (``auto | ffi | pallas``),
``interpret`` (``false``, ``true``, or ``tpu`` for ``pltpu.InterpretParams()``: TPU
semantics; not sharded: there ``true``, each device's kernel in a host callback outside
the ``shard_map``, see ``pallas/head.py::launch``) and ``weight_layout`` (``vh``: the head ``[V, H]``; ``hv``: its
transpose ``[H, V]`` is passed, and ``dweight`` is transposed back to compare) go to every
``flashloss.jax`` call. Prints ``loss_ref``, ``loss_kernel``,
``abs_diff_loss``, ``max_abs_diff_*``, ``max_rel_diff_*`` and a PASS/FAIL line per gate
(JSON with ``--json``); exits 0 only if every gate passes.

    python -m flashloss.jax.gradcheck --config configs/jax/gradcheck.yaml [--set parallel=vocab] [--json]
    python -m flashloss.jax.gradcheck --config configs/jax/gradcheck.yaml --set impl=pallas --set interpret=true
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .._config import load_yaml
from .._spec import LOSS_TYPES, GrpoArgs

DEFAULTS = dict(level="linear", loss_type="dapo", importance_sampling_level="token", beta=0.04, temperature=0.9,
                use_bias_correction_kl=True,
                batch=4, seq_len=7, hidden=16, vocab=1003, dtype="float32", seed=0, parallel="none",
                devices=8, loss_rel=1e-5, grad_rel=1e-4, impl="auto", interpret=False, weight_layout="vh")  # fmt: skip
IMPLS = ("auto", "ffi", "pallas")
INTERPRET = (False, True, "tpu")
_TRL = GrpoArgs()  # TRL's defaults: ε, sapo's temperatures, vespo's constants
EPS = _TRL.epsilon_low
CISPO_CAP = 1.0 + EPS  # cispo's epsilon_high is the cap on r itself
SAPO = (_TRL.sapo_temperature_pos, _TRL.sapo_temperature_neg)
VESPO = (_TRL.vespo_k_pos, _TRL.vespo_lambda_pos, _TRL.vespo_k_neg, _TRL.vespo_lambda_neg)


def _vespo_phi(jnp, jax, adv, log_ratio, m):
    """vespo's per-sequence weight φ (no gradient), as TRL computes it."""
    lower = float(np.log(1e-8))
    log_w = jnp.clip((jnp.clip(log_ratio, -20.0, 20.0) * m).sum(-1, keepdims=True), lower, 20.0)
    k_pos, lam_pos, k_neg, lam_neg = VESPO
    pos = adv >= 0
    k, lam = jnp.where(pos, k_pos, k_neg), jnp.where(pos, lam_pos, lam_neg)
    return jax.lax.stop_gradient(jnp.exp(lam + k * log_w - lam * jnp.exp(log_w)))


def reference_loss(jnp, jax, logits, ids, mask, adv, old, ref, cfg):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on ``logits`` ``[B, T, V]`` for every loss
    type, token or sequence level, k3 KL (bias-corrected or not), in the dtype of
    ``logits`` (the reductions of ``docs/spec/losses.md``)."""
    b, t = ids.shape
    lp = jax.nn.log_softmax(logits / cfg["temperature"], axis=-1)
    logp = jnp.take_along_axis(lp, ids[..., None], -1)[..., 0]
    m = mask.astype(logp.dtype)
    a = adv[:, None]
    log_ratio = logp - old
    if cfg["importance_sampling_level"] == "sequence":
        log_ratio_iw = ((log_ratio * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0))[:, None]
    else:
        log_ratio_iw = log_ratio
    r = jnp.exp(log_ratio_iw)
    lt = cfg["loss_type"]
    if lt == "cispo":
        loss = -jax.lax.stop_gradient(jnp.minimum(r, CISPO_CAP)) * a * logp
    elif lt == "sapo":
        temps = jnp.where(a > 0, *SAPO)
        loss = -jax.nn.sigmoid(temps * (r - 1)) * 4 / temps * a
    elif lt == "vespo":
        loss = -_vespo_phi(jnp, jax, a, log_ratio, m) * a * logp
    else:
        loss = -jnp.minimum(r * a, jnp.clip(r, 1.0 - EPS, 1.0 + EPS) * a)
    loss = jnp.broadcast_to(loss, logp.shape)
    if cfg["beta"]:
        d = ref - logp
        kl = jnp.exp(d) - d - 1
        loss = loss + cfg["beta"] * (kl * r if cfg["use_bias_correction_kl"] else kl)
    if lt in ("grpo", "sapo"):
        return ((loss * m).sum(-1) / jnp.maximum(m.sum(-1), 1)).mean()
    if lt == "bnpo" or lt in ("dapo", "cispo", "vespo"):
        return (loss * m).sum() / jnp.maximum(m.sum(), 1)
    if lt == "dr_grpo":
        return (loss * m).sum() / (b * t)
    return (loss * m).sum() / b  # luspo


def draw(cfg):
    rng = np.random.default_rng(cfg["seed"])
    b, t, h, v = cfg["batch"], cfg["seq_len"], cfg["hidden"], cfg["vocab"]
    hidden = rng.standard_normal((b, t, h))
    weight = rng.standard_normal((v, h)) * (2.0 / np.sqrt(h))
    ids = rng.integers(0, v, (b, t))
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None]
    adv = rng.standard_normal(b)
    old = -np.log(v) + 0.3 * rng.standard_normal((b, t))
    ref = -np.log(v) + 0.3 * rng.standard_normal((b, t))
    return hidden, weight, ids, mask, adv, old, ref


def _diffs(name, got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    abs_diff = float(np.abs(got - want).max())
    return {f"max_abs_diff_{name}": abs_diff, f"max_rel_diff_{name}": abs_diff / max(float(np.abs(want).max()), 1e-30)}


def interpret_value(value: Any) -> Any:
    """The ``interpret`` argument of config value ``value``: ``tpu`` is
    ``pltpu.InterpretParams()`` (TPU semantics), else a bool."""
    if value == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return bool(value)


def run(cfg: dict) -> dict:
    import jax
    import jax.numpy as jnp

    import flashloss.jax as fj

    if cfg["parallel"] != "none":
        jax.config.update("jax_num_cpu_devices", cfg["devices"])  # before any JAX operation
    jax.config.update("jax_enable_x64", True)
    hidden, weight, ids, mask, adv, old, ref = draw(cfg)
    dt = jnp.dtype(cfg["dtype"])
    h, w = jnp.asarray(hidden, dt), jnp.asarray(weight, dt)
    ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)
    adv_j, old_j, ref_j = (jnp.asarray(x, jnp.float32) for x in (adv, old, ref))
    cap = CISPO_CAP if cfg["loss_type"] == "cispo" else EPS
    kw = dict(loss_type=cfg["loss_type"], importance_sampling_level=cfg["importance_sampling_level"],
              beta=cfg["beta"], temperature=cfg["temperature"], epsilon_high=cap,
              use_bias_correction_kl=cfg["use_bias_correction_kl"], max_completion_length=cfg["seq_len"])  # fmt: skip
    path = {"impl": cfg["impl"], "interpret": interpret_value(cfg["interpret"])}
    layout = cfg["weight_layout"]
    # The f64 reference runs on the host CPU (a TPU has no f64), on the same rounded inputs.
    host = jax.default_device(jax.devices("cpu")[0])
    with host:
        f64 = [jnp.asarray(x, jnp.float64) for x in (hidden, weight, adv, old, ref)]
        h64, w64 = (jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in (h, w))
        ids_ref, mask_ref = jnp.asarray(ids), jnp.asarray(mask)

    if cfg["level"] == "logits":
        z = (h.astype(jnp.float32).reshape(-1, cfg["hidden"]) @ w.astype(jnp.float32).T).reshape(*ids.shape, -1)
        kz = dict(kw, old_per_token_logps=old_j, ref_per_token_logps=ref_j if cfg["beta"] else None)
        got, dz = jax.value_and_grad(lambda z: fj.grpo_loss(z, ids_j, mask_j, adv_j, **kz, **path)[0])(z)
        ref_fn = lambda z: reference_loss(jnp, jax, z, ids_ref, mask_ref, *f64[2:], cfg)  # noqa: E731
        with host:
            want, dz_ref = jax.value_and_grad(ref_fn)(jnp.asarray(np.asarray(z), jnp.float64))
        diffs = _diffs("dlogits", dz, dz_ref)
    else:

        def kernel(x, wt, i, m, a, o, r, token_axis=None, vocab_axis=None):
            k = dict(kw, old_per_token_logps=o, ref_per_token_logps=r if cfg["beta"] else None)
            return fj.linear_grpo_loss(
                x, wt, i, m, a, **k, token_axis=token_axis, vocab_axis=vocab_axis, **path, weight_layout=layout
            )[0]

        tokens = (ids_j, mask_j, adv_j, old_j, ref_j)
        w_in = w if layout == "vh" else jnp.array(w.T, copy=True)  # the [H, V] head, materialized
        if cfg["parallel"] == "none":
            got, (dh, dw) = jax.value_and_grad(kernel, (0, 1))(h, w_in, *tokens)
        else:
            got, (dh, dw) = _sharded(jax, kernel, cfg, h, w_in, tokens)
        if layout == "hv":
            dw = dw.T  # back to [V, H] to compare

        def ref_fn(x, wt):
            z = (x.reshape(-1, cfg["hidden"]) @ wt.T).reshape(*ids.shape, -1)
            return reference_loss(jnp, jax, z, ids_ref, mask_ref, *f64[2:], cfg)

        with host:
            want, (dh_ref, dw_ref) = jax.value_and_grad(ref_fn, (0, 1))(h64, w64)
        diffs = {**_diffs("dhidden", dh, dh_ref), **_diffs("dweight", dw, dw_ref)}
    loss_rel = abs(float(got) - float(want)) / max(abs(float(want)), 1.0)
    gates = [{"name": "loss", "value": loss_rel, "limit": cfg["loss_rel"]}]
    gates += [
        {"name": k[len("max_rel_diff_") :], "value": v, "limit": cfg["grad_rel"]}
        for k, v in diffs.items()
        if k.startswith("max_rel")
    ]
    for g in gates:
        g["passed"] = bool(g["value"] <= g["limit"])
    return {
        "config": cfg,
        "loss_ref": float(want),
        "loss_kernel": float(got),
        "abs_diff_loss": abs(float(got) - float(want)),
        **diffs,
        "gates": gates,
        "passed": all(g["passed"] for g in gates),
    }


def _sharded(jax, kernel, cfg, h, w, tokens):
    """``kernel``'s loss and gradients inside ``shard_map`` over ``cfg["devices"]``: the
    sequences over axis "t" (token), the head's rows over "v" (vocab), or both (2d: 2 x
    devices/2)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = cfg["devices"]
    shape = {"token": (n, 1), "vocab": (1, n), "2d": (2, n // 2)}[cfg["parallel"]]
    if cfg["batch"] % shape[0]:
        raise ValueError(f"batch: {cfg['batch']} is not a multiple of the {shape[0]} token groups")
    if cfg["vocab"] % shape[1]:
        raise ValueError(f"vocab: {cfg['vocab']} is not a multiple of the {shape[1]} vocab groups")
    names = tuple(a for a, k in zip(("t", "v"), shape) if k > 1)  # a 1-D mesh unless 2d
    mesh = jax.make_mesh(tuple(k for k in shape if k > 1), names, axis_types=(AxisType.Explicit,) * len(names))
    axes = dict(token_axis="t" if "t" in names else None, vocab_axis="v" if "v" in names else None)
    rows = P(axes["token_axis"])
    block = P(axes["vocab_axis"]) if cfg["weight_layout"] == "vh" else P(None, axes["vocab_axis"])
    specs = (rows, block) + (rows,) * len(tokens)

    def local(x, wt, *tok):
        return jax.value_and_grad(lambda x, wt: kernel(x, wt, *tok, **axes), (0, 1))(x, wt)

    step = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), (rows, block)))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((h, w) + tokens, specs)]
    return jax.jit(step)(*placed)


def load(path, overrides):
    cfg = load_yaml(path, overrides, DEFAULTS)
    if cfg["loss_type"] not in LOSS_TYPES:
        raise ValueError(f"loss_type: the reference covers {LOSS_TYPES}, got {cfg['loss_type']!r}")
    if cfg["importance_sampling_level"] not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: token or sequence, got {cfg['importance_sampling_level']!r}")
    if cfg["parallel"] not in ("none", "token", "vocab", "2d"):
        raise ValueError(f"parallel: expected none, token, vocab or 2d, got {cfg['parallel']!r}")
    if cfg["impl"] not in IMPLS:
        raise ValueError(f"impl: expected one of {', '.join(IMPLS)}, got {cfg['impl']!r}")
    if cfg["interpret"] not in INTERPRET:
        raise ValueError(f"interpret: expected false, true or tpu (pltpu.InterpretParams()), got {cfg['interpret']!r}")
    if cfg["interpret"] == "tpu" and cfg["parallel"] != "none":
        raise ValueError("interpret: tpu (pltpu.InterpretParams) does not run sharded; use interpret=true")
    if cfg["weight_layout"] not in ("vh", "hv"):
        raise ValueError(f"weight_layout: expected vh ([V, H]) or hv ([H, V]), got {cfg['weight_layout']!r}")
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    cfg = load(a.config, a.set)
    print(f"gradcheck: {cfg['level']} {cfg['loss_type']} [B={cfg['batch']}, T={cfg['seq_len']}, H={cfg['hidden']}, "
          f"V={cfg['vocab']}] {cfg['dtype']} parallel={cfg['parallel']} impl={cfg['impl']} "
          f"interpret={cfg['interpret']} weight_layout={cfg['weight_layout']}", file=sys.stderr)  # fmt: skip
    r = run(cfg)
    if a.json:
        print(json.dumps(r))
    else:
        for k in ("loss_ref", "loss_kernel", "abs_diff_loss"):
            print(f"{k:<22} {r[k]:.9e}")
        for k, v in r.items():
            if k.startswith("max_"):
                print(f"{k:<22} {v:.3e}")
        for g in r["gates"]:
            print(f"{'PASS' if g['passed'] else 'FAIL'} {g['name']:<9} {g['value']:.3e} <= {g['limit']:.3e}")
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
