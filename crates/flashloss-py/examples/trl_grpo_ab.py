"""A/B of GRPO training in TRL 1.16: ``trl.GRPOTrainer`` against
``flashloss.trl.FlashlossGRPOTrainer`` (the same trainer with ``_compute_loss`` replaced by
flashloss's fused loss), on the same tiny Qwen2-architecture model (random weights) and the
same verifiable reward, from the same seed, each arm in its own process, one after the other.

Task: prompts ``"a + b = ?"`` with ``a, b`` in 0..9. Reward of a completion, from its first
word ``w``: 1 if ``w`` is the sum; otherwise, if ``w`` is a number, the shaping term
``0.25 * max(0, 1 - |w - (a + b)| / 10)``; otherwise 0.

Model: Qwen2 (transformers), random weights, hidden 64, 2 layers. The tokenizer is a local
word-level one (numbers 0..19, ``+ = ?`` and three specials: 26 words, no download); the
model's ``vocab_size`` is padded far beyond it (``--vocab``, default Qwen's 151,936), so the
LM head and every softmax of the loss run over the padded vocabulary. Generation suppresses
the padded ids (``GRPOConfig.generation_kwargs={"suppress_tokens": ...}``, the mechanism TRL
uses for image tokens), as a trained model would never sample them; the loss does not.

Recorded per step: TRL's logged ``loss``, ``reward``, ``kl`` (``beta`` > 0), ``entropy``;
the step's wall time (a ``TrainerCallback``, ``on_step_begin`` to ``on_step_end``) and the
part of it spent in TRL's generation and scoring; at the end, the process's peak RSS
(``ru_maxrss``). Writes JSON (``--out``) and a plot (``--plot``, needs matplotlib).

    python crates/flashloss-py/examples/trl_grpo_ab.py --steps 100 \\
        --out docs/bench/results/trl_grpo_ab_cpu.json --plot docs/python_trl_ab.png
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MAX_NUMBER = 19  # the numbers the tokenizer knows: 0..19 (sums of 0..9 + 0..9 reach 18)
SPECIALS = ["<pad>", "<eos>", "<unk>"]
WORDS = [str(i) for i in range(MAX_NUMBER + 1)] + ["+", "=", "?"]


def build_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.padding_side = "left"
    return fast


def build_model(vocab, hidden, layers, seed):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def arithmetic_reward(completions, answer, **kwargs):
    """1 for the right sum as the first word; a number near it earns up to 0.25."""
    rewards = []
    for text, target in zip(completions, answer):
        words = text.split()
        if not words or not words[0].isdigit():
            rewards.append(0.0)
        elif int(words[0]) == target:
            rewards.append(1.0)
        else:
            rewards.append(0.25 * max(0.0, 1.0 - abs(int(words[0]) - target) / 10.0))
    return rewards


def dataset():
    from datasets import Dataset

    pairs = [(a, b) for a in range(10) for b in range(10)]
    return Dataset.from_dict({"prompt": [f"{a} + {b} = ?" for a, b in pairs], "answer": [a + b for a, b in pairs]})


def run_arm(args):
    import torch
    import trl
    from transformers import PreTrainedTokenizerFast, TrainerCallback

    torch.set_num_threads(args.threads)
    from flashloss.trl import FlashlossGRPOTrainer

    base = trl.GRPOTrainer if args.arm == "trl" else FlashlossGRPOTrainer

    class Timed(base):
        """Records the seconds of TRL's generation and scoring (old/ref log-probs, rewards) per call."""

        generate_seconds = []

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.generate_seconds.append(time.perf_counter() - start)
            return out

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._start)

    tok = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
    vocab = args.vocab
    config = trl.GRPOConfig(
        output_dir=os.path.join(args.work_dir, args.arm),
        per_device_train_batch_size=args.batch,
        num_generations=args.generations,
        max_completion_length=args.completion,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=args.beta,
        loss_type="dapo",
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        disable_tqdm=True,
        generation_kwargs={"suppress_tokens": list(range(len(tok), vocab))} if vocab > len(tok) else None,
    )
    timer = StepTimer()
    trainer = Timed(
        model=args.model_dir,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset(),
        processing_class=tok,
        callbacks=[timer],
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "step" in entry]
    per_step = {key: [entry.get(key) for entry in logs] for key in ("loss", "reward", "kl", "entropy", "step_time")}
    return dict(
        arm=args.arm,
        trainer=base.__name__,
        steps=len(logs),
        step=[entry["step"] for entry in logs],
        **per_step,
        step_seconds=timer.seconds,
        generate_seconds=Timed.generate_seconds,
        train_seconds=total,
        peak_rss_mib=peak / 1024,
        rss_before_train_mib=rss_before / 1024,
        torch_threads=torch.get_num_threads(),
        versions=dict(torch=torch.__version__, trl=trl.__version__),
    )


def summarize(r, last):
    rewards = r["reward"][-last:]
    return dict(
        step_seconds_median=statistics.median(r["step_seconds"]),
        generate_seconds_median=statistics.median(r["generate_seconds"]),
        rest_seconds_median=statistics.median(s - g for s, g in zip(r["step_seconds"], r["generate_seconds"])),
        peak_rss_mib=r["peak_rss_mib"],
        reward_mean_last=sum(rewards) / len(rewards),
        step1_loss=r["loss"][0],
    )


def first_divergence(a, b, rel, abs_tol=0.0):
    """The first step (1-based) whose values differ by more than ``rel`` of their magnitude plus
    ``abs_tol`` (None: never)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            continue
        if abs(x - y) > rel * max(abs(x), abs(y)) + abs_tol:
            return i + 1
    return None


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for key, ax in zip(("reward", "kl", "loss"), axes):
        for r, style in zip(results, ("-", "--")):
            ax.plot(r["step"], r[key], style, label=r["trainer"], linewidth=1.2)
        ax.set_title(key)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    a, b = results
    ax = axes[3]
    for key in ("loss", "kl", "reward"):
        diff = [abs(x - y) if x is not None and y is not None else None for x, y in zip(a[key], b[key])]
        ax.plot(a["step"], [d if d else float("nan") for d in diff], ".", label=key, markersize=3)
    ax.set_yscale("log")
    ax.set_title("|difference| between the arms (0 not drawn)")
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle("TRL 1.16 GRPO, tiny Qwen2 (random init), arithmetic reward: GRPOTrainer vs FlashlossGRPOTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--vocab", type=int, default=151936, help="the model's vocab_size (padded past the tokenizer)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--completion", type=int, default=4, help="max_completion_length")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads and RAYON_NUM_THREADS (flashloss)")
    p.add_argument("--last", type=int, default=10, help="steps averaged for the final reward")
    p.add_argument("--out", help="JSON file")
    p.add_argument("--plot", help="PNG file")
    p.add_argument("--arm", choices=["trl", "flashloss"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--work-dir", help=argparse.SUPPRESS)
    p.add_argument("--arm-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        result = run_arm(args)
        with open(args.arm_out, "w") as f:
            json.dump(result, f)
        return

    with tempfile.TemporaryDirectory() as work:
        model_dir = os.path.join(work, "tiny-qwen2")
        build_model(args.vocab, args.hidden, args.layers, args.seed).save_pretrained(model_dir)
        build_tokenizer().save_pretrained(model_dir)
        results = []
        env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
        for arm in ("trl", "flashloss"):
            arm_out = os.path.join(work, f"{arm}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
            cmd += ["--arm", arm, "--model-dir", model_dir, "--work-dir", work, "--arm-out", arm_out]
            print(f"running the {arm} arm ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, env=env)
            with open(arm_out) as f:
                results.append(json.load(f))

    trl_run, fused_run = results
    loss1_trl, loss1_fused = trl_run["loss"][0], fused_run["loss"][0]
    summary = dict(
        command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
        setup=dict(
            model="Qwen2ForCausalLM, random init",
            vocab_size=args.vocab,
            tokenizer_words=len(SPECIALS + WORDS),
            hidden=args.hidden,
            layers=args.layers,
            completions_per_step=args.batch,
            num_generations=args.generations,
            max_completion_length=args.completion,
            loss_type="dapo",
            beta=args.beta,
            learning_rate=args.lr,
            seed=args.seed,
            threads=args.threads,
            reward="1 if first word == a+b; else 0.25*max(0, 1-|w-(a+b)|/10) if first word is a number; else 0",
        ),
        arms={r["arm"]: summarize(r, args.last) for r in results},
        step1_loss=dict(
            trl=loss1_trl,
            flashloss=loss1_fused,
            abs_diff=abs(loss1_trl - loss1_fused),
            rel_diff=abs(loss1_trl - loss1_fused) / max(abs(loss1_trl), 1e-30),
        ),
        first_step_differing=dict(
            loss_rel_1e_4_abs_1e_7=first_divergence(trl_run["loss"], fused_run["loss"], 1e-4, 1e-7),
            reward_exact=first_divergence(trl_run["reward"], fused_run["reward"], 0.0),
            kl_rel_1e_3_abs_1e_6=first_divergence(trl_run["kl"], fused_run["kl"], 1e-3, 1e-6),
        ),
        results=results,
    )
    text = json.dumps(summary, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(results, args.plot)
    print(json.dumps({k: summary[k] for k in ("arms", "step1_loss", "first_step_differing")}, indent=1))


if __name__ == "__main__":
    main()
