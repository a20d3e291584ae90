"""flashloss.verl against verl's own torch path (``FusedLinearForPPO``) and an f64
reference: log-probs, entropy and the gradients of the hidden states and the head, f32 and
bf16, vocabularies not a multiple of 256, temperatures; verl's HF forward patch on a tiny
Qwen2 (its torch and Triton backends), patch/unpatch by identity. Skipped without verl
(``scripts/ci_verl.sh`` makes a venv with it)."""

import json
import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")
verl_tf = pytest.importorskip("verl.utils.experimental.torch_functional")
verl_lce = pytest.importorskip("verl.utils.kernel.linear_cross_entropy")

import flashloss.verl as fverl  # noqa: E402 (after the importorskips)

ORIGINAL_FORWARD = verl_tf.FusedLinearForPPO.forward
ORIGINAL_LCE = verl_lce.linear_cross_entropy


@pytest.fixture
def patched():
    fverl.patch()
    try:
        yield
    finally:
        fverl.unpatch()


def make(shape, vocab, hidden_size, dtype, seed, scale=1.0, head_grad=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, hidden_size, generator=g) * scale).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(dtype).requires_grad_(head_grad)
    ids = torch.randint(0, vocab, shape, generator=g)
    g_logp = torch.randn(shape, generator=g)
    g_ent = torch.randn(shape, generator=g)
    return h, w, ids, g_logp, g_ent


def outputs_and_grads(fn, h, w, ids, g_logp, g_ent, temperature):
    """``fn``'s (logp, entropy) and the gradients of ``Σ g_logp·logp + g_ent·entropy``."""
    logp, ent = fn(h, w, ids, temperature)
    loss = (logp.float() * g_logp).sum() + (ent.float() * g_ent).sum()
    inputs = [t for t in (h, w) if t.requires_grad]
    grads = torch.autograd.grad(loss, inputs)
    return logp, ent, grads


def reference(h, w, ids, g_logp, g_ent, temperature):
    """f64 log-probs, entropy and gradients on the same (rounded) inputs."""
    hd = h.detach().double().requires_grad_(True)
    wd = w.detach().double().requires_grad_(w.requires_grad)
    z = hd @ wd.T / temperature
    logp_all = z.log_softmax(-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = (logp * g_logp.double()).sum() + (ent * g_ent.double()).sum()
    grads = torch.autograd.grad(loss, [t for t in (hd, wd) if t.requires_grad])
    return logp, ent, grads


def verl_fused(h, w, ids, temperature):
    return verl_tf.FusedLinearForPPO()(h, w, ids, temperature)


def max_rel(a, b):
    """The largest difference relative to the largest entry of ``b``."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def test_patch_and_unpatch_restore_by_identity():
    assert not fverl.is_patched()
    fverl.patch()
    try:
        assert fverl.is_patched()
        assert verl_tf.FusedLinearForPPO.forward is fverl.fused_linear_for_ppo_forward
        assert verl_lce.linear_cross_entropy is fverl.linear_cross_entropy
        fverl.patch(budget_mib=64)  # idempotent: only the options change
        assert fverl._state["FusedLinearForPPO.forward"] is ORIGINAL_FORWARD
        assert fverl._state[verl_lce.__name__] is ORIGINAL_LCE
    finally:
        fverl.unpatch()
    assert not fverl.is_patched()
    assert verl_tf.FusedLinearForPPO.forward is ORIGINAL_FORWARD
    assert verl_lce.linear_cross_entropy is ORIGINAL_LCE
    fverl.unpatch()  # a second unpatch changes nothing
    assert verl_tf.FusedLinearForPPO.forward is ORIGINAL_FORWARD


def test_modules_that_bound_linear_cross_entropy_on_load_are_rebound(monkeypatch):
    # Megatron's fused forward does `from ...linear_cross_entropy import linear_cross_entropy`
    # when loaded (it needs Megatron, so a module standing in for it here).
    name = "verl.models.mcore.model_forward_fused"
    loaded = types.ModuleType(name)
    loaded.linear_cross_entropy = ORIGINAL_LCE
    monkeypatch.setitem(sys.modules, name, loaded)
    fverl.patch()
    try:
        assert loaded.linear_cross_entropy is fverl.linear_cross_entropy
    finally:
        fverl.unpatch()
    assert loaded.linear_cross_entropy is ORIGINAL_LCE


def test_bad_budget_is_refused_before_patching():
    with pytest.raises(ValueError, match="budget_mib"):
        fverl.patch(budget_mib=-1)
    assert not fverl.is_patched()


@pytest.mark.parametrize("vocab", [1000, 151, 256])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("shape", [(13,), (2, 9)])
def test_fused_linear_for_ppo_f32_matches_verl(patched, vocab, temperature, shape):
    h, w, ids, g_logp, g_ent = make(shape, vocab, 48, torch.float32, seed=vocab + len(shape))
    fverl.unpatch()
    want_logp, want_ent, want_grads = outputs_and_grads(verl_fused, h, w, ids, g_logp, g_ent, temperature)
    fverl.patch()
    logp, ent, grads = outputs_and_grads(verl_fused, h, w, ids, g_logp, g_ent, temperature)
    ref_logp, ref_ent, ref_grads = reference(h, w, ids, g_logp, g_ent, temperature)
    assert logp.shape == want_logp.shape == ids.shape and ent.shape == want_ent.shape
    assert (logp.dtype, ent.dtype) == (want_logp.dtype, want_ent.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    for got, want, ref in zip(grads, want_grads, ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert max_rel(got, want) < 1e-4
        assert max_rel(got, ref) < 1e-5
    assert max_rel(logp, ref_logp) < 1e-5 and max_rel(ent, ref_ent) < 1e-5


@pytest.mark.parametrize("vocab", [1000, 151])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_linear_for_ppo_bf16_matches_verl_and_the_reference(patched, vocab, temperature):
    h, w, ids, g_logp, g_ent = make((3, 7), vocab, 64, torch.bfloat16, seed=vocab)
    fverl.unpatch()
    want_logp, want_ent, want_grads = outputs_and_grads(verl_fused, h, w, ids, g_logp, g_ent, temperature)
    fverl.patch()
    logp, ent, grads = outputs_and_grads(verl_fused, h, w, ids, g_logp, g_ent, temperature)
    ref_logp, ref_ent, ref_grads = reference(h, w, ids, g_logp, g_ent, temperature)
    # verl >= 0.8: log-probs float32, entropy in the hidden states' dtype.
    assert (logp.dtype, ent.dtype) == (want_logp.dtype, want_ent.dtype) == (torch.float32, torch.bfloat16)
    # flashloss keeps the logits in f32: its log-probs are the f64 ones to f32 rounding, and
    # its entropy to bf16 rounding; verl rounds the logits to bf16 first.
    assert max_rel(logp, ref_logp) < 1e-5
    assert max_rel(ent, ref_ent) < 2**-8
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=0.05)
    torch.testing.assert_close(ent.float(), want_ent.float(), rtol=0, atol=0.05)
    for got, want, ref in zip(grads, want_grads, ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
        assert max_rel(got, ref) < 1e-2
        assert max_rel(got, want) < 3e-2


def test_frozen_head_gets_the_hidden_gradient_only(patched):
    h, w, ids, g_logp, g_ent = make((2, 5), 300, 32, torch.float32, seed=3, head_grad=False)
    fverl.unpatch()
    _, _, (want,) = outputs_and_grads(verl_fused, h, w, ids, g_logp, g_ent, 0.9)
    fverl.patch()
    _, _, (got,) = outputs_and_grads(verl_fused, h, w, ids, g_logp, g_ent, 0.9)
    assert w.grad is None
    assert max_rel(got, want) < 1e-4


def test_no_positive_log_probs_on_extreme_logits(patched):
    # verl#2656 (positive log-probs) and verl#2899 (V not a multiple of 256).
    h, w, ids, g_logp, g_ent = make((4, 16), 151, 32, torch.float32, seed=5, scale=300.0)
    logp, ent, _ = outputs_and_grads(verl_fused, h, w, ids, g_logp, g_ent, 1.0)
    ref_logp, ref_ent, _ = reference(h, w, ids, g_logp, g_ent, 1.0)
    assert bool((logp <= 0).all()) and bool(torch.isfinite(logp).all()) and bool(torch.isfinite(ent).all())
    assert max_rel(logp, ref_logp) < 1e-5
    assert float((ent.detach().double() - ref_ent.detach()).abs().max()) < 1e-3


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_triton_entry_matches_verl_torch_path(patched, reduction):
    # verl's Triton kernel runs CUDA tensors only: the patched entry is checked against
    # verl's torch path, which computes the same quantities.
    h, w, ids, _, _ = make((2, 11), 1000, 32, torch.float32, seed=7)
    fverl.unpatch()
    want_logp, want_ent = verl_fused(h, w, ids, 0.8)
    fverl.patch()
    logp, ent = verl_lce.linear_cross_entropy(h, w, ids, 0.8, reduction)
    assert ent.shape == (22,) and ent.dtype == torch.float32
    torch.testing.assert_close(ent, want_ent.reshape(-1), rtol=1e-5, atol=1e-5)
    want = {"none": want_logp.reshape(-1), "sum": want_logp.sum(), "mean": want_logp.mean()}[reduction]
    assert logp.shape == want.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
    (dh,) = torch.autograd.grad(logp.sum() + ent.sum(), [h])
    (want_dh,) = torch.autograd.grad(want.sum() + want_ent.sum(), [h])
    assert dh.shape == h.shape and max_rel(dh, want_dh) < 1e-4


def test_errors_name_the_argument(patched):
    h, w, ids, _, _ = make((6,), 50, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="temperature"):
        verl_fused(h, w, ids, torch.ones(6))
    with pytest.raises(TypeError, match="temperature"):
        verl_fused(h, w, ids, "hot")
    with pytest.raises(ValueError, match="hidden_states"):
        verl_fused(h.reshape(1, 1, 6, 16), w, ids.reshape(1, 1, 6), 1.0)
    with pytest.raises(ValueError, match="ids"):
        verl_fused(h, w, ids[:5], 1.0)
    with pytest.raises(ValueError, match="reduction"):
        verl_lce.linear_cross_entropy(h, w, ids, 1.0, "max")
    with pytest.raises(ValueError, match="labels"):
        verl_lce.linear_cross_entropy(h, w, ids[:5], 1.0, "none")
    with pytest.raises(ValueError, match="ids|vocabulary|range"):
        verl_fused(h, w, torch.full((6,), 50), 1.0)


def tiny_qwen2(vocab=151):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(11)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture
def fused_forward_restored():
    """verl's ``patch_forward_with_backends`` replaces the model class's ``forward``."""
    transformers = pytest.importorskip("transformers")
    original = transformers.Qwen2ForCausalLM.forward
    try:
        yield
    finally:
        transformers.Qwen2ForCausalLM.forward = original


def verl_step(model, ids, temperature):
    """What verl's actor does with use_fused_kernels: the patched model forward's log-probs
    and entropy, and the gradients of a loss of both in the head and the embeddings."""
    out = model(
        input_ids=ids, attention_mask=None, position_ids=torch.arange(ids.shape[1])[None], use_cache=False,
        temperature=temperature, return_dict=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    logp, ent = out.log_probs.reshape(-1), out.entropy.reshape(-1)
    loss = (logp * torch.randn(logp.shape, generator=g)).sum() + (ent * torch.randn(ent.shape, generator=g)).sum()
    params = [model.lm_head.weight, model.model.embed_tokens.weight]
    return logp, ent, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verl_model_forward_patch_on_a_tiny_qwen2(fused_forward_restored, backend):
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    model = tiny_qwen2()
    ids = torch.randint(0, 151, (1, 17), generator=torch.Generator().manual_seed(4))
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    want_logp, want_ent, want_grads = verl_step(model, ids, 0.8)  # verl's own torch path
    # verl's Triton path runs CUDA tensors only; patched, it runs flashloss on the CPU.
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    fverl.patch()
    try:
        logp, ent, grads = verl_step(model, ids, 0.8)
    finally:
        fverl.unpatch()
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        assert max_rel(got, want) < 1e-4


def verl_remove_padding_step(model, lengths, temperature):
    """What verl 0.9.1's FSDP engine does with ``use_remove_padding=True`` and
    ``use_fused_kernels=True`` (``transformer_impl.prepare_model_inputs``): the sequences'
    tokens packed into ``[1, total_nnz]``, ``position_ids`` restarting at 0 for each, the
    labels rolled over the whole pack and passed as ``shift_labels``, no attention mask;
    then a loss of the fused forward's log-probs and entropy."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 151, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    out = model(
        input_ids=ids, attention_mask=None, position_ids=position_ids, shift_labels=torch.roll(ids, -1, dims=1),
        use_cache=False, temperature=temperature, return_dict=True,
    )  # fmt: skip
    logp, ent = out.log_probs.squeeze(0), out.entropy.squeeze(0)
    loss = (logp * torch.randn(logp.shape, generator=g)).sum() + (ent * torch.randn(ent.shape, generator=g)).sum()
    params = [model.lm_head.weight, model.model.embed_tokens.weight]
    return logp, ent, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verl_remove_padding_forward_on_a_tiny_qwen2(fused_forward_restored, backend):
    """verl's ``use_remove_padding=True`` path: its packed ``[1, total_nnz]`` model call
    with the fused kernels patched equals verl's own torch backend on the same call."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    model = tiny_qwen2()
    lengths = [5, 1, 7, 3]
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    want_logp, want_ent, want_grads = verl_remove_padding_step(model, lengths, 0.7)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    fverl.patch()
    try:
        logp, ent, grads = verl_remove_padding_step(model, lengths, 0.7)
    finally:
        fverl.unpatch()
    assert logp.shape == (sum(lengths),)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        assert max_rel(got, want) < 1e-4


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_triton_entry_matches_one_process(world, tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    worker = os.path.join(os.path.dirname(__file__), "verl_dist_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    store = str(tmp_path / "store")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    procs = [subprocess.Popen([sys.executable, worker, str(world), str(rank), store], **pipes) for rank in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank exited with {p.returncode}:\n{err[-4000:]}"
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["rank"] for o in outs] == list(range(world))
    for o in outs:
        for key in ("logp", "entropy", "dhidden_summed", "dhidden_share", "dweight_block"):
            assert o[key] < 1e-5, f"rank {o['rank']} {key}: {o[key]:.3g}"


def test_verl_before_0_8_gets_log_probs_in_the_hidden_dtype(monkeypatch):
    # verl <= 0.7's FusedLinearForPPO returned both outputs in the hidden states' dtype.
    monkeypatch.setattr(sys.modules["verl"], "__version__", "0.7.1")
    h, w, ids, _, _ = make((5,), 100, 16, torch.bfloat16, seed=2)
    fverl.patch()
    try:
        logp, ent = verl_fused(h, w, ids, 1.0)
    finally:
        fverl.unpatch()
    assert (logp.dtype, ent.dtype) == (torch.bfloat16, torch.bfloat16)


def test_verl_imports_the_autopatch_module_it_is_told_to():
    # VERL_USE_EXTERNAL_MODULES is read by `import verl` in every process (Ray workers too).
    code = (
        "import verl, flashloss.verl as f\n"
        "from verl.utils.experimental.torch_functional import FusedLinearForPPO\n"
        "print(f.is_patched(), FusedLinearForPPO.forward is f.fused_linear_for_ppo_forward)"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="flashloss.verl_autopatch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=True)
    assert out.stdout.split() == ["True", "True"]
    # actor_rollout_ref.model.external_lib goes through verl's import_external_libs.
    from verl.utils.import_utils import import_external_libs

    assert not fverl.is_patched()
    sys.modules.pop("flashloss.verl_autopatch", None)
    try:
        import_external_libs("flashloss.verl_autopatch")
        assert fverl.is_patched() and verl_lce.linear_cross_entropy is fverl.linear_cross_entropy
    finally:
        fverl.unpatch()
    assert verl_lce.linear_cross_entropy is ORIGINAL_LCE


class TopKStandIn(torch.nn.Module):
    """verl's ``FusedLinearForPPOTopK`` contract (on-policy distillation; not in verl 0.9.1),
    written on materialized logits: the module attribute the patch looks for."""

    def forward(self, hidden_states, vocab_weights, input_ids, gather_ids, temperature=1.0):
        logits = (hidden_states @ vocab_weights.t()) / temperature
        dtype = logits.dtype
        logp_all = logits.float().log_softmax(-1)
        logp = logp_all.gather(-1, input_ids.long().unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        gathered = logp_all.gather(-1, gather_ids.long())
        return logp.to(dtype), ent.to(dtype), gathered.to(dtype)


@pytest.fixture
def topk_class(monkeypatch):
    monkeypatch.setattr(verl_tf, "FusedLinearForPPOTopK", TopKStandIn, raising=False)
    original = TopKStandIn.forward
    yield TopKStandIn
    assert TopKStandIn.forward is original


def topk_case(shape, vocab, k, dtype, seed):
    h, w, ids, g_logp, g_ent = make(shape, vocab, 40, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    gather = torch.randint(0, vocab, (*shape, k), generator=g)
    gather[..., 0] = ids  # the target among the candidates
    gather[..., 1] = gather[..., 2]  # a repeat
    g_gathered = torch.randn((*shape, k), generator=g)
    return h, w, ids, gather, (g_logp, g_ent, g_gathered)


def topk_run(cls, h, w, ids, gather, upstream, temperature):
    outs = cls()(h, w, ids, gather, temperature)
    loss = sum((o.double() * u.double()).sum() for o, u in zip(outs, upstream))
    return outs, torch.autograd.grad(loss, [h, w])


@pytest.mark.parametrize(
    ("dtype", "shape", "temperature"), [(torch.float32, (2, 9), 0.7), (torch.bfloat16, (13,), 1.0)]
)
def test_topk_variant_is_routed_when_verl_has_it(topk_class, dtype, shape, temperature):
    h, w, ids, gather, upstream = topk_case(shape, 151, 6, dtype, seed=21)
    hd, wd = (t.detach().double().requires_grad_() for t in (h, w))
    want, want_grads = topk_run(topk_class, hd, wd, ids, gather, upstream, temperature)  # f64 reference
    fverl.patch()
    try:
        assert topk_class.forward is fverl.fused_linear_for_ppo_topk_forward
        outs, grads = topk_run(topk_class, h, w, ids, gather, upstream, temperature)
        plain = verl_fused(h, w, ids, temperature)
    finally:
        fverl.unpatch()
    assert [o.shape for o in outs] == [ids.shape, ids.shape, gather.shape]
    assert all(o.dtype == dtype for o in outs)
    out_tol, grad_tol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-8, 1e-2)
    for got, ref in zip(outs, want):
        assert max_rel(got, ref) < out_tol
    for got, ref in zip(grads, want_grads):
        assert max_rel(got, ref) < grad_tol
    # The token log-probs and entropy are the plain call's (FusedLinearForPPO, patched), and
    # the target's candidate is its log-prob (the two paths may round differently).
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(outs[0].float(), plain[0].float(), rtol=0, atol=atol)
    torch.testing.assert_close(outs[1].float(), plain[1].float(), rtol=0, atol=atol)
    torch.testing.assert_close(outs[2][..., 0], outs[0], rtol=0, atol=atol)


def test_topk_variant_errors_name_the_argument(topk_class):
    h, w, ids, gather, _ = topk_case((7,), 60, 3, torch.float32, seed=8)
    fverl.patch()
    try:
        with pytest.raises(TypeError, match="gather_ids"):
            topk_class()(h, w, ids, gather.tolist(), 1.0)
        with pytest.raises(ValueError, match="gather_ids"):
            topk_class()(h, w, ids, gather[:5], 1.0)
        with pytest.raises(ValueError, match="gather_ids"):
            topk_class()(h, w, ids, gather.float(), 1.0)
    finally:
        fverl.unpatch()
