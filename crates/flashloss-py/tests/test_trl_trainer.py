"""flashloss.trl.FlashlossGRPOTrainer against TRL's own GRPOTrainer: on one generated
batch of a tiny Qwen2 (random weights, a word-level tokenizer built here, no download),
``_compute_loss`` gives TRL's loss, and gradients of every parameter that match the same
model run in float64 through TRL's formulas (trl_reference.py) at the spec's f32
tolerance. (TRL 1.16's own gradients, through transformers' ``fused_lm_head``, are off
that float64 truth by up to ~2% here, so they are not the yardstick for gradients.)
Then a few steps of ``train()`` run. Skipped where TRL is not installed."""

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from flashloss.trl import FlashlossGRPOTrainer  # noqa: E402
from trl_reference import grpo_reference  # noqa: E402

ACCUMULATION = 2  # as inside train() with gradient accumulation: TRL scales the loss by it

WORDS = [str(i) for i in range(40)] + ["+", "=", "?"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.padding_side = "left"
    return fast


def model(vocab, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def reward_len(completions, **kw):
    return [float(len(c.split())) for c in completions]


def dataset():
    from datasets import Dataset

    prompts = [f"{a} + {b} = ?" for a in range(8) for b in range(4)]
    return Dataset.from_dict({"prompt": prompts})


def saved_model(tmp_path):
    path = tmp_path / "tiny-qwen2"
    if not path.exists():
        model(len(tokenizer())).save_pretrained(path)
    return str(path)


def trainer(cls, tmp_path, use_cpu=True, **cfg):
    tok = tokenizer()
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=use_cpu,
        seed=0,
        **cfg,
    )
    return cls(
        model=saved_model(tmp_path), reward_funcs=reward_len, args=args, train_dataset=dataset(), processing_class=tok
    )


def loss_and_grads(t, inputs):
    t.current_gradient_accumulation_steps = ACCUMULATION
    t.model.zero_grad(set_to_none=True)
    loss = t._compute_loss(t.model, inputs)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def float64_truth(t, inputs, cfg):
    """The trainer's loss on the float64 copy of its model, through TRL's formulas."""
    m = model(len(tokenizer())).double()
    m.load_state_dict(t.model.state_dict())
    m.train()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    n = inputs["completion_ids"].shape[1]
    hidden = m.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state[:, -n - 1 : -1]
    loss_type = cfg.get("loss_type", "dapo")
    kw = dict(loss_type=loss_type, beta=cfg.get("beta", 0.0), entropy_coef=cfg.get("entropy_coef", 0.0))
    kw["importance_sampling_level"] = cfg.get("importance_sampling_level", "token")
    if loss_type in ("dapo", "cispo", "vespo"):
        kw["num_items_in_batch"] = inputs["num_items_in_batch"].double() * ACCUMULATION / t.args.steps_per_generation
        kw["entropy_coef"] /= ACCUMULATION
    mask = inputs["completion_mask"]
    if "top_entropy_quantile" in cfg:
        with torch.no_grad():
            _, _, entropy = grpo_reference(hidden, m.lm_head.weight, None, inputs["completion_ids"], mask != 0,
                                           inputs["advantages"])  # fmt: skip
        kw["entropy_mask"] = t.get_high_entropy_mask(entropy.float(), mask, 1 - cfg["top_entropy_quantile"]) != 0
    if "off_policy_mask_threshold" in cfg:
        kw["policy_mask"] = (inputs["advantages"] >= 0)[:, None].expand_as(mask)
    if t.use_vllm and t.vllm_importance_sampling_correction:
        kw["rho"] = inputs["importance_sampling_ratio"]
    loss, _, _ = grpo_reference(
        hidden, m.lm_head.weight, None, inputs["completion_ids"], mask != 0,
        inputs["advantages"], ref=inputs.get("ref_per_token_logps"), old=inputs.get("old_per_token_logps"), **kw,
    )  # fmt: skip
    if loss_type not in ("dapo", "cispo", "vespo"):
        loss = loss / ACCUMULATION
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "cfg",
    [
        dict(loss_type="dapo"),
        dict(loss_type="grpo", beta=0.04),
        dict(loss_type="bnpo", entropy_coef=0.01),
        dict(loss_type="luspo", importance_sampling_level="sequence"),
        dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01),
        dict(loss_type="grpo", off_policy_mask_threshold=-1.0),  # drops negative-advantage sequences
    ],
)
def test_compute_loss_matches_trl(tmp_path, cfg):
    stock = trainer(trl.GRPOTrainer, tmp_path, **cfg)
    ours = trainer(FlashlossGRPOTrainer, tmp_path, **cfg)
    stock.model.train()
    ours.model.train()
    batch = [{"prompt": p} for p in dataset()["prompt"][:4]]
    torch.manual_seed(1)
    inputs = stock._generate_and_score_completions(batch)
    assert inputs["advantages"].abs().max() > 0  # the rewards differ, so the loss has a gradient
    trl_loss, _ = loss_and_grads(stock, inputs)
    loss, grads = loss_and_grads(ours, inputs)
    truth_loss, truth_grads = float64_truth(ours, inputs, cfg)
    assert loss == pytest.approx(trl_loss, rel=1e-4, abs=1e-6)
    assert loss == pytest.approx(truth_loss, rel=1e-5, abs=1e-7)
    assert grads.keys() == truth_grads.keys()
    for name, g in truth_grads.items():
        scale = g.abs().max().item()
        assert (grads[name].double() - g).abs().max().item() <= 1e-4 * scale + 1e-8, name


def test_trains(tmp_path):
    t = trainer(FlashlossGRPOTrainer, tmp_path, loss_type="dapo")
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    result = t.train()
    assert result.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in t.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


@pytest.mark.parametrize(
    "cfg,ratio_shape",
    [
        (dict(loss_type="grpo", importance_sampling_level="sequence"), "b1"),  # sequence_* vLLM modes
        (dict(loss_type="dapo"), "bt"),  # token_* modes
        (dict(loss_type="luspo", importance_sampling_level="sequence"), "b1"),
    ],
)
def test_vllm_importance_sampling_ratio_and_clip_metrics(tmp_path, cfg, ratio_shape):
    """TRL 1.16's vLLM importance-sampling correction passes a ratio of shape [B, 1]
    (sequence_* modes) or [B, T] (token_* modes); with off-policy old log-probs the logged
    clip metrics are TRL's (at sequence level, means over sequences) (issue 33)."""
    stock = trainer(trl.GRPOTrainer, tmp_path, **cfg)
    ours = trainer(FlashlossGRPOTrainer, tmp_path, **cfg)
    batch = [{"prompt": p} for p in dataset()["prompt"][:4]]
    torch.manual_seed(2)
    inputs = stock._generate_and_score_completions(batch)
    b, t = inputs["completion_ids"].shape
    g = torch.Generator().manual_seed(0)
    shape = (b, 1) if ratio_shape == "b1" else (b, t)
    inputs["importance_sampling_ratio"] = torch.rand(shape, generator=g) + 0.5
    with torch.no_grad():
        logp = stock._get_per_token_logps_and_entropies(
            stock.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), t,
        )[0]  # fmt: skip
    # Sequence ratios on both sides of the clips and far from them (TRL's own log-probs
    # differ from the float64 ones by ~1e-4 here, which must not flip a flag).
    shift = torch.tensor([-0.5, -0.05, 0.05, 0.5]).repeat(b // 4 + 1)[:b, None]
    inputs["old_per_token_logps"] = logp + shift + 0.01 * torch.randn(b, t, generator=g)
    for tr in (stock, ours):
        tr.model.train()
        tr.use_vllm, tr.vllm_importance_sampling_correction = True, True
    trl_loss, _ = loss_and_grads(stock, inputs)
    loss, grads = loss_and_grads(ours, inputs)
    truth_loss, truth_grads = float64_truth(ours, inputs, cfg)
    assert loss == pytest.approx(truth_loss, rel=1e-5, abs=1e-7)
    assert loss == pytest.approx(trl_loss, rel=5e-3)  # TRL's log-probs are the less exact here
    for name, grad in truth_grads.items():
        assert (grads[name].double() - grad).abs().max().item() <= 1e-4 * grad.abs().max().item() + 1e-8, name
    if cfg["loss_type"] != "cispo":
        clipped = 0.0
        for name in ("low_mean", "high_mean", "region_mean"):
            key = f"clip_ratio/{name}"
            assert ours._metrics["train"][key][-1] == pytest.approx(stock._metrics["train"][key][-1], abs=1e-6), key
            clipped += stock._metrics["train"][key][-1]
        assert clipped > 0
