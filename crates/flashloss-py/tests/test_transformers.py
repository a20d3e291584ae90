"""flashloss.transformers.patch against the unpatched model: for tiny random Qwen2, Llama,
Mistral and Gemma2 (soft-capped) causal LMs on the CPU in float32, the patched model's
loss and every parameter's gradient equal those of a copy run through transformers' own
logits and ``ForCausalLMLoss``: with padding labels (-100), with ``num_items_in_batch``,
with ``logits_to_keep``, through ``Trainer`` with gradient accumulation. Without labels the
logits are unchanged; unsupported models are refused. Skipped without transformers."""

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashloss.transformers as flt  # noqa: E402

VOCAB = 300
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def build(arch, seed=0, **extra):
    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=False)
        return transformers.Qwen2ForCausalLM(cfg)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    if arch == "mistral":
        cfg = transformers.MistralConfig(**SMALL, tie_word_embeddings=False)
        return transformers.MistralForCausalLM(cfg)
    assert arch == "gemma2"
    # Tied embeddings (Gemma's default) and a soft-cap small enough to bend these logits.
    cfg = transformers.Gemma2Config(
        **SMALL, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=extra.get("softcap", 1.0)
    )
    cfg._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20.0)  # logits of a few units: the cap matters
    return model


def batch(seed=1, b=3, t=11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[1, -3:] = -100  # right padding
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return ids, mask, labels


def assert_same(ref_model, ref_out, model, out):
    """Same loss and same gradient of every parameter (f32 tolerance)."""
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    ref_out.loss.backward()
    out.loss.backward()
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        ref = ref_params[name].grad
        assert p.grad is not None, name
        scale = float(ref.abs().max())
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


ARCHS = ["qwen2", "llama", "mistral", "gemma2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_grads_match(arch):
    ref = build(arch)
    model = flt.patch(copy.deepcopy(ref))
    assert flt.is_patched(model) and not flt.is_patched(ref)
    ids, mask, labels = batch()
    assert_same(
        ref, ref(ids, attention_mask=mask, labels=labels), model, model(ids, attention_mask=mask, labels=labels)
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_num_items_in_batch(arch):
    """Sum over tokens divided by num_items_in_batch (gradient accumulation's count)."""
    ref = build(arch, seed=2)
    model = flt.patch(copy.deepcopy(ref))
    ids, mask, labels = batch(seed=3)
    n = torch.tensor(40)
    ref_out = ref(ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    out = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    assert_same(ref, ref_out, model, out)


def test_gemma2_softcap_is_applied():
    """The soft-cap changes the loss here, and the patched loss follows each value of it."""
    losses = []
    ids, mask, labels = batch(seed=4)
    for cap in (1.0, 30.0):
        ref = build("gemma2", softcap=cap)
        model = flt.patch(copy.deepcopy(ref))
        ref_out, out = ref(ids, labels=labels), model(ids, labels=labels)
        torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
        losses.append(out.loss.item())
    assert abs(losses[0] - losses[1]) > 0.1


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_without_labels_logits_unchanged(arch):
    ref = build(arch)
    model = flt.patch(copy.deepcopy(ref))
    ids, mask, _ = batch()
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask), model(ids, attention_mask=mask)
        assert got.loss is None and got.logits is not None
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
        last = model(ids, attention_mask=mask, logits_to_keep=1).logits
        torch.testing.assert_close(last, want.logits[:, -1:], rtol=1e-6, atol=1e-6)
        prompt = ids[:1, :4]
        torch.testing.assert_close(
            model.generate(prompt, max_new_tokens=3, do_sample=False),
            ref.generate(prompt, max_new_tokens=3, do_sample=False),
        )


def test_logits_to_keep_with_labels():
    """Labels for the kept positions only, as without the patch."""
    ref = build("llama")
    model = flt.patch(copy.deepcopy(ref))
    ids, _, labels = batch()
    keep = 5
    assert_same(
        ref, ref(ids, labels=labels[:, -keep:], logits_to_keep=keep),
        model, model(ids, labels=labels[:, -keep:], logits_to_keep=keep),
    )  # fmt: skip
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=labels, logits_to_keep=keep)


def test_return_dict_false_and_shift_labels():
    ref = build("qwen2")
    model = flt.patch(copy.deepcopy(ref))
    ids, _, labels = batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    ref_loss = ref(ids, labels=labels).loss
    out = model(ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0
    torch.testing.assert_close(out[0], ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(ids, labels=labels, shift_labels=shifted).loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_class_patch_and_unpatch():
    ref = build("mistral")
    model = copy.deepcopy(ref)
    ids, _, labels = batch()
    try:
        assert flt.patch("mistral") is None
        assert flt.is_patched(model) and flt.is_patched(ref)
        out = model(ids, labels=labels)
        assert out.logits is None
        flt.unpatch("mistral")
        assert not flt.is_patched(model)
        torch.testing.assert_close(out.loss, model(ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    finally:
        flt.unpatch("mistral")
    inst = flt.patch(build("qwen2"))
    flt.unpatch(inst)
    assert not flt.is_patched(inst) and inst(ids, labels=labels).logits is not None


def test_unsupported_models_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        flt.patch(gpt2)
    with pytest.raises(ValueError, match="gpt2"):
        flt.patch("gpt2")
    cls_model = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**SMALL, num_labels=2))
    with pytest.raises(ValueError, match="Qwen2ForSequenceClassification"):
        flt.patch(cls_model)
    with pytest.raises(ValueError, match="int"):
        flt.patch(3)
    model = flt.patch(build("qwen2"))
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    ids, _, labels = batch()
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        model(ids, labels=labels)


def test_trainer_gradient_accumulation(tmp_path):
    """Two steps of Trainer (plain SGD, gradient accumulation 2, so num_items_in_batch is passed): same
    losses and same weights after training as the unpatched model."""
    Dataset = pytest.importorskip("datasets").Dataset
    ids, mask, labels = batch(seed=5, b=8, t=9)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})
    results = []
    for patched in (False, True):
        model = build("qwen2", seed=6)
        if patched:
            flt.patch(model)
            assert any(p.kind == p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(patched)), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=2, learning_rate=0.1, optim="sgd", logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((logged, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (ref_losses, ref_state), (losses, state) = results
    assert len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for k, v in state.items():
        torch.testing.assert_close(v, ref_state[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
