"""TRL's GRPOTrainer with its loss computed by flashloss (FlashlossGRPOTrainer) on a tiny random
Qwen2 made here (a word-level tokenizer, no download): the loss on one generated batch against
TRL's own, then a few training steps.

Run: python examples/trl_grpo_trainer.py
"""

import tempfile

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers

from flashloss.trl import FlashlossGRPOTrainer

WORDS = ["<pad>", "<eos>", "<unk>", "+", "=", "?"] + [str(i) for i in range(40)]


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.padding_side = "left"
    return fast


def tiny_qwen2(path: str) -> str:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def reward_len(completions: list, **kw: object) -> list:
    return [float(len(c.split())) for c in completions]


out_dir = tempfile.mkdtemp()
model_path = tiny_qwen2(f"{out_dir}/tiny-qwen2")
dataset = Dataset.from_dict({"prompt": [f"{a} + {b} = ?" for a in range(8) for b in range(4)]})


def make(cls: type) -> trl.GRPOTrainer:
    args = trl.GRPOConfig(
        output_dir=f"{out_dir}/{cls.__name__}", per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        loss_type="dapo", beta=0.04, entropy_coef=0.01,  # the bonus makes the first loss non-zero
    )  # fmt: skip
    return cls(model=model_path, reward_funcs=reward_len, args=args, train_dataset=dataset,
               processing_class=tiny_tokenizer())  # fmt: skip


trainer = make(FlashlossGRPOTrainer)  # a drop-in for trl.GRPOTrainer
stock = make(trl.GRPOTrainer)

# One generated batch: flashloss's loss and LM-head gradient against TRL's, on the same weights.
torch.manual_seed(1)
inputs = stock._generate_and_score_completions([{"prompt": p} for p in dataset["prompt"][:4]])
ours, theirs = trainer._compute_loss(trainer.model, inputs), stock._compute_loss(stock.model, inputs)
ours.backward()
theirs.backward()
g, want = trainer.model.lm_head.weight.grad.flatten(), stock.model.lm_head.weight.grad.flatten()
cosine = torch.nn.functional.cosine_similarity(g, want, dim=0).item()
print(f"one batch: flashloss loss {ours.item():.6e}, TRL loss {theirs.item():.6e}, head gradients' cosine {cosine:.6f}")
torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)
# TRL's own gradients here are within ~2% of the float64 truth (crates/flashloss-py/tests/test_trl_trainer.py).
assert cosine > 0.999, cosine
trainer.model.zero_grad(set_to_none=True)

before = [p.detach().clone() for p in trainer.model.parameters()]
result = trainer.train()
losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
print(f"trained {result.global_step} steps, losses {losses}")
assert result.global_step == 3 and all(torch.isfinite(torch.tensor(losses)))
assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
print("OK: the loss agrees with TRL's and training updates the weights")
