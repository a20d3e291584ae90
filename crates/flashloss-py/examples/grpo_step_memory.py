"""A/B of GRPO training steps on a small Qwen2 model (random weights, Qwen's 151,936-token
vocabulary): TRL's way (the model's logits, log_softmax, the loss of
``GRPOTrainer._compute_loss``) against ``flashloss.torch.linear_grpo_loss`` on the last
hidden states and ``lm_head.weight``. Each arm runs in its own process; the peak resident
memory (``ru_maxrss``) and the step time are printed as JSON. The arm
``flashloss_compiled`` is the flashloss step (model forward and loss) under
``torch.compile(fullgraph=True)`` (``--backend``, Inductor by default); its first step
includes the compilation.

    pip install transformers
    python crates/flashloss-py/examples/grpo_step_memory.py [--tokens 2048] [--steps 3] \
        [--arms trl,flashloss,flashloss_compiled]
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def build(vocab, hidden, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


def trl_loss(model, input_ids, completion_ids, mask, advantages, old_logps, temperature, eps):
    """TRL's dapo loss on materialized logits (the trainer's own path)."""
    t = completion_ids.shape[1]
    logits = model(input_ids).logits[:, -t - 1 : -1] / temperature
    logps = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids[..., None])[..., 0]
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    adv = advantages[:, None]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def fused_loss(model, input_ids, completion_ids, mask, advantages, old_logps, temperature, eps):
    import flashloss.torch as fl

    t = completion_ids.shape[1]
    hidden = model.model(input_ids).last_hidden_state[:, -t - 1 : -1]
    loss, _ = fl.linear_grpo_loss(
        hidden, model.lm_head.weight, completion_ids, mask, advantages,
        old_per_token_logps=old_logps, loss_type="dapo", temperature=temperature, epsilon_low=eps,
    )  # fmt: skip
    return loss


def arm(name, args):
    model = build(args.vocab, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    b, t, prompt = args.tokens // args.completion, args.completion, 16
    input_ids = torch.randint(0, args.vocab, (b, prompt + t), generator=g)
    completion_ids = input_ids[:, prompt:]
    mask = (torch.rand(b, t, generator=g) > 0.1).float()
    advantages = torch.randn(b, generator=g)
    old_logps = torch.full((b, t), -12.0)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step = trl_loss if name == "trl" else fused_loss
    if name == "flashloss_compiled":
        step = torch.compile(fused_loss, fullgraph=True, backend=args.backend)
    times, losses = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = step(model, input_ids, completion_ids, mask, advantages, old_logps, 1.0, 0.2)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(
        arm=name,
        tokens=b * t,
        vocab=args.vocab,
        hidden=args.hidden,
        peak_rss_mib=peak / 1024,
        step_peak_above_model_mib=(peak - base_rss) / 1024,
        step_seconds=times,
        losses=losses,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--arms", default="trl,flashloss", help="comma-separated arms, run in this order")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled arm")
    p.add_argument("--arm", choices=["trl", "flashloss", "flashloss_compiled"])
    args = p.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm, args)))
        return
    results = []
    for name in args.arms.split(","):
        cmd = [sys.executable, __file__, "--arm", name] + sys.argv[1:]
        print(f"arm {name} ...", file=sys.stderr, flush=True)
        results.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))

    def best(r):  # the fastest step after the first (compilation, warm-up)
        return min(r["step_seconds"][1:] or r["step_seconds"])

    first = results[0]
    summary = dict(
        results=results,
        step_memory_ratio_to_first=[r["step_peak_above_model_mib"] / first["step_peak_above_model_mib"]
                                    for r in results],
        step_time_ratio_to_first=[best(r) / best(first) for r in results],
    )  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
