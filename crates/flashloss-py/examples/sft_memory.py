"""A/B of supervised fine-tuning with Hugging Face's ``Trainer`` on a small Qwen2 (random
weights, Qwen's 151,936-token vocabulary): the model as transformers ships it (logits,
then ``ForCausalLMLoss``) against the same model after ``flashloss.transformers.patch``
(the loss from the last hidden states, no logits). Random token sequences, the first
``--prompt`` tokens of each masked with -100 as a prompt would be. Each arm runs in its
own process, one after the other; each reports its peak resident memory
(``ru_maxrss``), the peak above the process once the model and trainer are built, the
time of each optimizer step and the logged losses, as JSON.

    pip install transformers datasets accelerate
    python crates/flashloss-py/examples/sft_memory.py --steps 4 --out sft.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def arm(name: str, args: argparse.Namespace) -> dict:
    import torch
    import transformers
    from datasets import Dataset

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    if name == "flashloss":
        import flashloss.transformers

        flashloss.transformers.patch(model)
    model_rss = rss_mib()

    g = torch.Generator().manual_seed(1)
    rows = args.batch * args.steps * args.accumulation
    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    labels = ids.clone()
    labels[:, : args.prompt] = -100
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})

    times: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out_dir:
        targs = transformers.TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accumulation,
            max_steps=args.steps,
            learning_rate=1e-4,
            optim=args.optim,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[StepTimer()])
        base_rss = rss_mib()
        trainer.train()
    peak = rss_mib()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return dict(
        arm=name,
        tokens_per_step=args.batch * args.seq * args.accumulation,
        peak_rss_mib=round(peak, 1),
        rss_after_model_mib=round(model_rss, 1),
        rss_before_train_mib=round(base_rss, 1),
        train_peak_above_model_mib=round(peak - base_rss, 1),
        step_seconds=[round(t, 3) for t in times],
        losses=losses,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--prompt", type=int, default=32, help="tokens of each sequence masked with -100")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--out", help="write the JSON summary here too")
    p.add_argument("--arm", choices=["transformers", "flashloss"], help=argparse.SUPPRESS)
    p.add_argument("--arm-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        with open(args.arm_out, "w") as f:
            json.dump(arm(args.arm, args), f)
        return

    import torch
    import transformers

    config = {k: v for k, v in vars(args).items() if k not in ("arm", "arm_out", "out")}
    forwarded = [x for k, v in config.items() for x in (f"--{k}", str(v))]
    results = []
    for name in ("transformers", "flashloss"):
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, __file__, *forwarded, "--arm", name, "--arm-out", tmp.name]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(tmp.name) as f:
                results.append(json.load(f))
    base, fused = results

    def steady(r):  # the fastest step after the first (which warms up)
        return min(r["step_seconds"][1:] or r["step_seconds"])

    summary = dict(
        command="python crates/flashloss-py/examples/sft_memory.py " + " ".join(sys.argv[1:]),
        config=dict(config, tied_embeddings=False, dtype="float32", device="cpu"),
        environment=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            cpus=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
        ),
        results=results,
        train_peak_ratio=round(fused["train_peak_above_model_mib"] / base["train_peak_above_model_mib"], 3),
        peak_rss_ratio=round(fused["peak_rss_mib"] / base["peak_rss_mib"], 3),
        steady_step_time_ratio=round(steady(fused) / steady(base), 3),
    )
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
