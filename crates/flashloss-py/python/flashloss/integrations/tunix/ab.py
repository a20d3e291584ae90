"""The original GRPO A/B in JAX, on Tunix's ``GRPOLearner``: a tiny Qwen2-architecture
model (``tunix.models.qwen2``, random init, character tokenizer) is warmed up on the
GSM8K-format arithmetic task by cross-entropy, then trained by GRPO with the task's
verifiable reward. The two arms are one YAML key apart (``loss_impl``: ``tunix`` or
``flashloss``) and start from the same seed::

    python -m flashloss.tunix.ab --config configs/jax/grpo_ab_baseline.yaml
    python -m flashloss.tunix.ab --config configs/jax/grpo_ab_flashloss.yaml
    python -m flashloss.tunix.ab --plot runs/jax_grpo_ab_baseline runs/jax_grpo_ab_flashloss --out docs/jax

Each run writes ``metrics.jsonl`` (per GRPO step: reward, accuracy, KL, loss, entropy,
step time, RSS now and at its peak) and ``memory.json`` (XLA's compiled memory analysis of
the train step: loss, gradient and optimizer update, on the step's batch shape) to
``out_dir``; ``--plot`` draws runs on shared axes (``ab.png``) with a ``summary.md``.
Progress goes to stderr. A bad config key is an error naming it."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from flashloss._config import load_yaml
from flashloss._spec import GrpoArgs
from flashloss.integrations.tunix import _task

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "loss_impl": "tunix",  # the A/B key: "tunix" (Tunix's own logits path) or "flashloss" (patched)
    "flashloss_mode": "auto",  # flashloss's FFI plan (patch(mode=...))
    "flashloss_impl": "auto",  # patch(impl=...): auto (FFI on CPU, Pallas on TPU), ffi or pallas
    "flashloss_interpret": False,  # patch(interpret=...): the Pallas kernels in TPU interpret mode (no TPU)
    "steps": 100,
    "out_dir": "runs/jax_grpo_ab_{loss_impl}",  # {loss_impl} is filled in
    # model: Qwen2 architecture (the tiny config of configs/train/arith_tiny_*.yaml)
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "dtype": "float32",  # the model's parameters and compute (Tunix's default)
    "remat": "none",  # Tunix's RematConfig: none, block (each attention and MLP block) or decoder (each layer)
    # the embedding drawn from N(0, std^2) instead of Tunix's N(0, 1) (null: Tunix's); a
    # tied N(0, 1) embedding of width 896 makes a one-hot next-token distribution
    "init_embedding_std": None,
    # task
    "max_operand": 9,
    "format_reward": 0.1,
    # cross-entropy warm-up (plain JAX, identical in both arms)
    "sft_steps": 150,
    "sft_batch_size": 32,
    "sft_lr": 3.0e-3,
    # GRPO (Tunix's GRPOLearner)
    "prompts_per_step": 8,
    "group_size": 8,
    "lr": 1.0e-4,
    "max_grad_norm": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 20,
    "beta": 0.04,
    "epsilon": GrpoArgs().epsilon_low,  # TRL's and Tunix's ε
    "loss_algo": "grpo",
    "loss_agg_mode": "sequence-mean-token-mean",
    "kl_loss_mode": "low_var_kl",
    "memory_analysis": True,
}
_IMPLS = ("tunix", "flashloss")
_MAX_PROMPT = 16


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[flashloss.tunix.ab] {msg}", file=sys.stderr, flush=True)


def _rss_bytes() -> tuple[int, int]:
    """(resident now, peak resident) of this process, in bytes."""
    now = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    now = int(line.split()[1]) * 1024
    except OSError:
        pass
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(cfg: dict, seed: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen2 import model as qwen2

    heads = cfg["num_attention_heads"]
    if cfg["hidden_size"] % heads:
        raise ValueError(f"hidden_size: {cfg['hidden_size']} is not a multiple of num_attention_heads={heads}")
    remat = str(cfg["remat"]).upper()
    if remat not in qwen2.RematConfig.__members__:
        raise ValueError(f"remat: expected none, block or decoder, got {cfg['remat']!r}")
    config = qwen2.ModelConfig(
        num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"], embed_dim=cfg["hidden_size"],
        hidden_dim=cfg["intermediate_size"], num_heads=heads, head_dim=cfg["hidden_size"] // heads,
        num_kv_heads=cfg["num_key_value_heads"], rope_theta=10_000, norm_eps=1e-6,
        use_tied_embedding=bool(cfg["tie_word_embeddings"]), dtype=jnp.dtype(cfg["dtype"]),
        param_dtype=jnp.dtype(cfg["dtype"]), remat_config=qwen2.RematConfig[remat],
    )  # fmt: skip
    model = qwen2.Qwen2(config, rngs=nnx.Rngs(seed))
    std = cfg["init_embedding_std"]
    if std is not None:
        emb = model.embedder.input_embedding
        emb.value = float(std) * jax.random.normal(jax.random.key(seed + 1), emb.value.shape, emb.value.dtype)
    return model


def _optimizer(lr: float, max_grad_norm: float):
    import optax

    # flashloss train's AdamW: betas (0.9, 0.999), eps 1e-8, no weight decay, clip at 1.0.
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adamw(lr, 0.9, 0.999, 1e-8, weight_decay=0.0))


def _sft(model, cfg: dict, tok: _task.CharTokenizer, progress: bool) -> None:
    """The cross-entropy warm-up on prompt + answer + EOS (the answer's tokens counted),
    in plain JAX on Tunix's model; the same in both arms."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.rl import common

    if cfg["sft_steps"] <= 0:
        return
    graphdef, state = nnx.split(model)
    tx = _optimizer(cfg["sft_lr"], cfg["max_grad_norm"])
    opt = tx.init(state)

    @jax.jit
    def step(state, opt, tokens, targets, weights):
        def loss_fn(st):
            mask = tokens != _task.PAD
            mask = mask.at[:, 0].set(True)
            positions = common.build_positions_from_mask(mask)
            logits, _ = nnx.merge(graphdef, st)(tokens, positions, None, common.make_causal_attn_mask(mask))
            logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return (nll * weights).sum() / weights.sum()

        loss, grads = jax.value_and_grad(loss_fn)(state)
        updates, opt = tx.update(grads, opt, state)
        return optax.apply_updates(state, updates), opt, loss

    for i in range(cfg["sft_steps"]):
        rng = np.random.default_rng([cfg["seed"], i, 0])
        seqs, starts = [], []
        for _ in range(cfg["sft_batch_size"]):
            p = _task.sample(rng, cfg["max_operand"])
            prompt = tok.encode(p.prompt())
            seqs.append(prompt + tok.encode(p.answer) + [_task.EOS])
            starts.append(len(prompt))
        n = max(map(len, seqs))
        tokens = np.full((len(seqs), n), _task.PAD, np.int32)
        weights = np.zeros((len(seqs), n - 1), np.float32)
        for r, (s, p) in enumerate(zip(seqs, starts)):
            tokens[r, : len(s)] = s
            weights[r, p - 1 : len(s) - 1] = 1.0  # position j predicts token j + 1
        state, opt, loss = step(state, opt, tokens, tokens[:, 1:], weights)
        if (i + 1) % 25 == 0 or i + 1 == cfg["sft_steps"]:
            _say(progress, f"warm-up {i + 1}/{cfg['sft_steps']}: cross-entropy {float(loss):.4f}")
    nnx.update(model, state)


def compile_train_step(model, cfg: dict, algo, tok, prompt_len: int = _MAX_PROMPT, sharding=None):
    """One GRPO train step (the registered "grpo" policy loss, its gradient and the
    optimizer update, state and optimizer donated) compiled by XLA at ``cfg``'s batch shape
    from shapes only: ``model`` may be abstract (``nnx.eval_shape``). ``sharding``: where
    every input lies (None: the default device); a TPU's compiles for that TPU."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.rl import function_registry
    from tunix.rl.grpo import grpo_learner

    graphdef, state = nnx.split(model)
    tx = _optimizer(cfg["lr"], cfg["max_grad_norm"])
    loss_fn = function_registry.get_policy_loss_fn("grpo")
    b = cfg["prompts_per_step"] * cfg["group_size"]
    t = cfg["max_new_tokens"]

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    example = grpo_learner.TrainExample(
        prompt_ids=struct((b, prompt_len), jnp.int32), prompt_mask=struct((b, prompt_len), jnp.int32),
        completion_ids=struct((b, t), jnp.int32), completion_mask=struct((b, t), jnp.int32),
        advantages=struct((b,), jnp.float32), ref_per_token_logps=struct((b, t), jnp.float32) if cfg["beta"] else None,
        old_per_token_logps=None,
    )  # fmt: skip

    def train_step(state, opt, example):
        def f(st):
            return loss_fn(nnx.merge(graphdef, st), example, algo, tok.pad_id(), tok.eos_id())

        (loss, _), grads = jax.value_and_grad(f, has_aux=True)(state)
        updates, opt = tx.update(grads, opt, state)
        return optax.apply_updates(state, updates), opt, loss

    shapes = jax.eval_shape(lambda st: (st, tx.init(st)), state)
    shapes = jax.tree.map(lambda x: struct(x.shape, x.dtype), shapes)
    return jax.jit(train_step, donate_argnums=(0, 1)).lower(*shapes, example).compile()


def memory_row(compiled) -> dict:
    """XLA's memory analysis of ``compiled``: temp, argument, output and alias bytes, and
    the peak they make (temp + argument + output - alias)."""
    m = compiled.memory_analysis()
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    out = {k: int(getattr(m, k)) for k in keys}
    out["peak_bytes"] = out["temp_size_in_bytes"] + out["argument_size_in_bytes"] + out["output_size_in_bytes"]
    out["peak_bytes"] -= out["alias_size_in_bytes"]
    return out


def _memory_analysis(model, cfg: dict, algo, tok) -> dict:
    """XLA's compiled memory analysis of one GRPO train step at the run's batch shape."""
    out = memory_row(compile_train_step(model, cfg, algo, tok))
    b = cfg["prompts_per_step"] * cfg["group_size"]
    out["batch"] = {"completions": b, "prompt_len": _MAX_PROMPT, "completion_len": cfg["max_new_tokens"]}
    return out


def algo_config(cfg: dict):
    """Tunix's ``GRPOConfig`` of ``cfg``, with the sampling temperature that ``GRPOLearner``
    copies into it from the rollout config (the loss reads it)."""
    from tunix.rl.grpo import grpo_learner

    algo = grpo_learner.GRPOConfig(
        num_generations=cfg["group_size"], num_iterations=1, beta=cfg["beta"], epsilon=cfg["epsilon"],
        loss_algo=cfg["loss_algo"], loss_agg_mode=cfg["loss_agg_mode"], kl_loss_mode=cfg["kl_loss_mode"],
    )  # fmt: skip
    algo.temperature = cfg["temperature"]
    return algo


class _Recorder:
    """Tunix training hooks: per GRPO step, the loss, the wall time since the previous
    step's end (rollout, reference pass and update), RSS; the next step's sampling seed."""

    def __init__(self, cfg: dict, rollout_config: Any, progress: bool):
        from tunix.sft import hooks

        recorder = self

        class Hooks(hooks.TrainingHooks):
            def on_train_start(self, train_ctx: Any) -> None:
                pass  # called at every GRPO step (each is one trainer.train call)

            def on_train_end(self, train_ctx: Any) -> None:
                pass

            def on_train_step_start(self, train_ctx: Any) -> None:
                pass

            def on_train_step_end(self, train_ctx: Any, train_step: int, train_loss: float) -> None:
                recorder.step_end(train_step, train_loss)

            def on_eval_step_start(self, train_ctx: Any) -> None:
                pass

            def on_eval_step_end(self, train_ctx: Any, eval_loss: float) -> None:
                pass

        self.hooks = Hooks()
        self.cfg, self.rollout_config, self.progress = cfg, rollout_config, progress
        self.rows: list[dict] = []
        self.rewards: list[tuple[float, float]] = []
        self.last = time.perf_counter()
        self._seed(0)

    def _seed(self, step: int) -> None:
        # An int: Tunix's sampler makes PRNGKey(seed) of it (an array key would be donated).
        self.rollout_config.seed = int(self.cfg["seed"] * 1_000_003 + step)

    def reward_fn(self, prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
        out, correct = [], []
        for c, a in zip(completions, answer):
            r, ok = _task.reward(c, _task.Problem("", a), self.cfg["format_reward"])
            out.append(r)
            correct.append(ok)
        self.rewards.append((float(np.mean(out)), float(np.mean(correct))))
        return out

    def step_end(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        rss, peak = _rss_bytes()
        # The learner may generate the next step's batch before this step's update: the
        # k-th reward call is the k-th step's.
        k = len(self.rows)
        reward, accuracy = self.rewards[k] if k < len(self.rewards) else (float("nan"), float("nan"))
        row = {"step": len(self.rows), "loss": float(loss), "reward": reward, "accuracy": accuracy,
               "step_time_s": now - self.last, "rss_bytes": rss, "rss_peak_bytes": peak}  # fmt: skip
        self.rows.append(row)
        self.last = now
        self._seed(len(self.rows))
        n = self.cfg["steps"]
        if len(self.rows) % 10 == 0 or len(self.rows) in (1, n):
            _say(self.progress, f"{self.cfg['loss_impl']} step {len(self.rows)}/{n}: loss {row['loss']:.5f} "
                 f"reward {reward:.3f} {row['step_time_s']:.2f}s RSS peak {peak / 2**20:.0f} MiB")  # fmt: skip


def _dataset(cfg: dict) -> list[dict]:
    batches = []
    for step in range(cfg["steps"]):
        rng = np.random.default_rng([cfg["seed"], step, 1])
        problems = [_task.sample(rng, cfg["max_operand"]) for _ in range(cfg["prompts_per_step"])]
        # Arrays, as a grain batch gives them (the learner slices every field per prompt).
        prompts, answers = np.array([p.prompt() for p in problems]), np.array([p.answer for p in problems])
        batches.append({"prompts": prompts, "answer": answers})
    return batches


def _grpo(model, cfg: dict, tok: _task.CharTokenizer, progress: bool) -> tuple[list[dict], Optional[dict]]:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    graphdef, state = nnx.split(model)
    reference = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=cfg["max_new_tokens"], max_prompt_length=_MAX_PROMPT,
        kv_cache_size=_MAX_PROMPT + cfg["max_new_tokens"] + 8, temperature=cfg["temperature"], top_p=cfg["top_p"],
        eos_tokens=[tok.eos_id()],
    )  # fmt: skip
    training = rlc.RLTrainingConfig(
        actor_optimizer=_optimizer(cfg["lr"], cfg["max_grad_norm"]), eval_every_n_steps=10**9,
        max_steps=cfg["steps"], pbar_description=None,
    )  # fmt: skip
    cluster = rlc.RLCluster(
        actor=model, reference=reference, tokenizer=tok,
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training, rollout_config=rollout,
        ),
    )  # fmt: skip
    algo = algo_config(cfg)
    recorder = _Recorder(cfg, rollout, progress)
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=recorder.reward_fn)
    trainer = cluster.actor_trainer
    trainer.with_rl_metrics_to_log({"kl": np.mean, "pg_clipfrac": np.mean, "entropy": np.mean})
    trainer.with_training_hooks(recorder.hooks)
    memory = None
    if cfg["memory_analysis"]:
        memory = _memory_analysis(model, cfg, algo, tok)
        _say(progress, f"train step, XLA memory analysis: peak {memory['peak_bytes'] / 2**20:.1f} MiB "
             f"(temp {memory['temp_size_in_bytes'] / 2**20:.1f} MiB)")  # fmt: skip
    _say(progress, f"GRPO: {cfg['steps']} steps, {cfg['prompts_per_step']} prompts x {cfg['group_size']}")
    recorder.last = time.perf_counter()
    learner.train(_dataset(cfg))
    logger = trainer.metrics_logger
    rows = recorder.rows
    for name in ("kl", "entropy", "pg_clipfrac"):
        hist = np.asarray(logger.get_metric_history("actor", name, "train")).reshape(-1)
        for row, value in zip(rows, hist[-len(rows) :]):
            row[name] = float(value)
    return rows, memory


def run(cfg: dict, progress: bool = True) -> list[dict]:
    """One arm: the warm-up, then ``steps`` GRPO steps; returns the per-step rows and
    writes them (and ``memory.json``, ``config.json``) under ``out_dir`` if it is set."""
    import flashloss.tunix as ft

    if cfg["loss_impl"] not in _IMPLS:
        raise ValueError(f"loss_impl: expected one of {', '.join(_IMPLS)}, got {cfg['loss_impl']!r}")
    if cfg["vocab_size"] < _task.CharTokenizer().vocab_size:
        raise ValueError(f"vocab_size: {cfg['vocab_size']} is below the tokenizer's {_task.CharTokenizer().vocab_size}")
    tok = _task.CharTokenizer()
    model = _model(cfg, cfg["seed"])
    _sft(model, cfg, tok, progress)
    patched_here = cfg["loss_impl"] == "flashloss" and not ft.is_patched()
    if cfg["loss_impl"] == "flashloss":
        ft.patch(mode=cfg["flashloss_mode"], impl=cfg["flashloss_impl"], interpret=bool(cfg["flashloss_interpret"]))
    elif ft.is_patched():
        raise ValueError("loss_impl: 'tunix' asked for, but flashloss.tunix is patched in this process")
    try:
        rows, memory = _grpo(model, cfg, tok, progress)
    finally:
        if patched_here:
            ft.unpatch()
    if cfg.get("out_dir"):
        out = Path(str(cfg["out_dir"]).format(loss_impl=cfg["loss_impl"]))
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        (out / "memory.json").write_text(json.dumps(memory, indent=1) + "\n")
        (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        _say(progress, f"wrote {out}/metrics.jsonl, memory.json")
    return rows


def _load(run_dir: str) -> tuple[dict, list[dict], Optional[dict]]:
    d = Path(run_dir)
    cfg = json.loads((d / "config.json").read_text())
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    memory = json.loads((d / "memory.json").read_text()) if (d / "memory.json").exists() else None
    return cfg, rows, memory


def plot(run_dirs: list[str], out: str) -> str:
    """Draws the runs on shared axes (``out/ab.png``) and writes ``out/summary.md``; returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [_load(d) for d in run_dirs]
    keys = [("reward", "mean reward"), ("kl", "KL to the reference"), ("loss", "loss"), ("entropy", "entropy"),
            ("step_time_s", "step time (s)"), ("rss_peak_bytes", "peak RSS (MiB)")]  # fmt: skip
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True)
    for ax, (key, title) in zip(axes.flat, keys):
        for (cfg, rows, _), style in zip(runs, ("-", "--", ":", "-.")):
            y = np.array([r.get(key, np.nan) for r in rows], float)
            y = y / 2**20 if key == "rss_peak_bytes" else y
            ax.plot([r["step"] for r in rows], y, style, label=cfg["loss_impl"])
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "step_time_s":
            ax.set_yscale("log")  # the first step compiles
    for ax in axes[1]:
        ax.set_xlabel("GRPO step")
    axes[0, 0].legend()
    c0 = runs[0][0]
    fig.suptitle(f"Tunix GRPOLearner, Qwen2 architecture V={c0['vocab_size']} H={c0['hidden_size']} on GSM8K-format "
                 "arithmetic: Tunix's loss vs flashloss.tunix")  # fmt: skip
    fig.tight_layout()
    Path(out).mkdir(parents=True, exist_ok=True)
    png = Path(out) / "ab.png"
    fig.savefig(png, dpi=110)
    table = summary_table(runs)
    (Path(out) / "summary.md").write_text(table)
    return table


def summary_table(runs: list) -> str:
    head = ("| arm | V x H | steps | first loss | final reward (last 10) | final KL (last 10) | step time (median s) | "
            "peak RSS (MiB) | train step, XLA peak (MiB) | XLA temp (MiB) |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for cfg, rows, memory in runs:
        tail = rows[-10:]
        mem = ("-", "-") if not memory else (f"{memory['peak_bytes'] / 2**20:.1f}",
                                              f"{memory['temp_size_in_bytes'] / 2**20:.1f}")  # fmt: skip
        lines.append(
            f"| {cfg['loss_impl']} | {cfg['vocab_size']} x {cfg['hidden_size']} | {len(rows)} | "
            f"{rows[0]['loss']:.9g} | "
            f"{np.mean([r['reward'] for r in tail]):.3f} | {np.mean([r.get('kl', np.nan) for r in tail]):.2e} | "
            f"{np.median([r['step_time_s'] for r in rows[1:] or rows]):.3f} | "
            f"{max(r['rss_peak_bytes'] for r in rows) / 2**20:.0f} | {mem[0]} | {mem[1]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashloss.tunix.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="YAML config (keys: see DEFAULTS in flashloss/integrations/tunix/ab.py)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--plot", nargs="+", metavar="RUN_DIR", help="draw these runs (no training)")
    ap.add_argument("--out", default=".", help="with --plot: where ab.png and summary.md go")
    args = ap.parse_args(argv)
    try:
        if args.plot:
            print(plot(args.plot, args.out), end="")
            return 0
        cfg = load_yaml(args.config, args.set, DEFAULTS)
        run(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
