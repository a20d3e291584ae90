"""One rank of test_distributed.py: a Gloo group of WORLD ranks over a file store, each
rank holding its block of the LM head's rows (blocks of unequal sizes). Every check
compares the vocab-parallel call with the one-process call on the whole head, computed
in this process. Prints one JSON line: the checks run, or the error messages of the
bad-input cases (which the test compares across ranks)."""

import json
import sys

import torch
import torch.distributed as dist

import flashloss.torch as fl

V, H, B, T = 37, 16, 3, 5
BLOCKS = {1: [37], 2: [10, 27], 4: [5, 12, 9, 11]}


def close(name, got, want, rtol=1e-5):
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    if not err <= rtol * max(scale, 1e-3):
        raise AssertionError(f"{name}: max error {err:.3g} against scale {scale:.3g}")


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = torch.randn(V, generator=g) * 0.1
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = True
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 3.6
    return hidden, weight, bias, ids, mask, adv, old


def leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def check_grpo(rank, block, group, loss_type, level, support=None):
    hidden, weight, bias, ids, mask, adv, old = data(1)
    kw = dict(
        old_per_token_logps=old, ref_per_token_logps=old - 0.1, beta=0.04, loss_type=loss_type,
        importance_sampling_level=level, temperature=0.9, epsilon_high=0.28, entropy_coef=0.01, **(support or {}),
    )  # fmt: skip
    h1, w1, b1 = leaves(hidden, weight, bias)
    loss1, out1 = fl.linear_grpo_loss(h1, w1, ids, mask, adv, bias=b1, **kw)
    (loss1 * 1.5).backward()
    h, w, b = leaves(hidden, weight[block], bias[block])
    loss, out = fl.linear_grpo_loss(h, w, ids, mask, adv, bias=b, vocab_parallel_group=group, **kw)
    (loss * 1.5).backward()
    name = f"grpo {loss_type}/{level} {support} rank {rank}"
    close(name + " loss", loss.detach(), loss1.detach())
    if support:  # the tokens outside the sampler's support: the same everywhere, -inf log-probs
        if not torch.equal(out.outside_support, out1.outside_support) or not out1.outside_support.any():
            raise AssertionError(f"{name}: outside_support differs or is empty")
    for k in ("logp", "entropy", "kl"):
        close(f"{name} {k}", getattr(out, k).nan_to_num(neginf=0.0), getattr(out1, k).nan_to_num(neginf=0.0))
    for k in out.metrics:
        close(f"{name} metric {k}", out.metrics[k], out1.metrics[k])
    close(name + " dhidden", h.grad, h1.grad, rtol=1e-4)
    close(name + " dweight", w.grad, w1.grad[block], rtol=1e-4)
    close(name + " dbias", b.grad, b1.grad[block], rtol=1e-4)


def check_ce(rank, block, group, reduction, options):
    hidden, weight, bias, ids, mask, _, _ = data(2)
    targets = ids.masked_fill(~mask, -100)
    upstream = torch.randn(B, T, generator=torch.Generator().manual_seed(3))
    results = []
    for w_rows, b_rows, g in ((weight, bias, None), (weight[block], bias[block], group)):
        h, w, b = leaves(hidden, w_rows, b_rows)
        loss = fl.linear_cross_entropy(h, w, targets, bias=b, reduction=reduction, vocab_parallel_group=g, **options)
        (loss * upstream).sum().backward() if reduction == "none" else (loss * 0.7).backward()
        results.append((loss.detach(), h.grad, w.grad, b.grad))
    (loss1, dh1, dw1, db1), (loss, dh, dw, db) = results
    name = f"ce {reduction} {options} rank {rank}"
    close(name + " loss", loss, loss1)
    close(name + " dhidden", dh, dh1, rtol=1e-4)
    close(name + " dweight", dw, dw1[block], rtol=1e-4)
    close(name + " dbias", db, db1[block], rtol=1e-4)


def check_logprobs(rank, block, group):
    """Values, and gradients through logp and entropy: a trainable head, then a frozen
    one (no weight or bias gradient, the same hidden gradient)."""
    hidden, weight, bias, ids, mask, _, _ = data(4)
    g = torch.Generator().manual_seed(5)
    up_logp, up_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    for frozen in (False, True):
        results = []
        for w_rows, b_rows, grp in ((weight, bias, None), (weight[block], bias[block], group)):
            h, w, b = leaves(hidden, w_rows, b_rows)
            if frozen:
                w.requires_grad_(False), b.requires_grad_(False)
            lp, ent = fl.linear_logprobs(
                h, w, ids, temperature=0.7, return_entropy=True, bias=b, mask=mask, vocab_parallel_group=grp
            )[:2]
            ((lp * up_logp).sum() + (ent * up_ent).sum()).backward()
            results.append((lp.detach(), ent.detach(), h.grad, w.grad, b.grad))
        (lp1, ent1, dh1, dw1, db1), (lp, ent, dh, dw, db) = results
        name = f"logprobs frozen={frozen} rank {rank}"
        close(name, lp, lp1)
        close(name + " entropy", ent, ent1)
        close(name + " dhidden", dh, dh1, rtol=1e-4)
        if frozen:
            assert dw is None and db is None and dw1 is None, name + ": a frozen head got gradients"
        else:
            close(name + " dweight", dw, dw1[block], rtol=1e-4)
            close(name + " dbias", db, db1[block], rtol=1e-4)


def check_logprob_outputs(rank, block, group):
    """lse, max logit, Σp² and the log-probs of candidate ids on every rank's block, and
    the gradients through logp, lse and the candidates (each id's one-hot term on the rank
    holding it)."""
    hidden, weight, bias, ids, mask, _, _ = data(6)
    g = torch.Generator().manual_seed(7)
    gather = torch.randint(0, V, (B, T, 3), generator=g)
    gather[..., 0] = ids
    gather[0, 0] = torch.tensor([0, V - 1, V - 1])
    up = torch.randn(2, B, T, generator=g)
    up_k = torch.randn(B, T, 3, generator=g)
    results = []
    for w_rows, b_rows, grp in ((weight, bias, None), (weight[block], bias[block], group)):
        h, w, b = leaves(hidden, w_rows, b_rows)
        out = fl.linear_logprobs(
            h, w, ids, temperature=0.9, bias=b, mask=mask, vocab_parallel_group=grp, return_lse=True, return_max=True,
            return_sum_p2=True, gather_ids=gather,
        )  # fmt: skip
        ((out.logp * up[0]).sum() + (out.lse * up[1]).sum() + (out.gathered_logp * up_k).sum()).backward()
        results.append(([t.detach() for t in out if t is not None], h.grad, w.grad, b.grad))
    (outs1, dh1, dw1, db1), (outs, dh, dw, db) = results
    name = f"logprob outputs rank {rank}"
    for k, (got, want) in enumerate(zip(outs, outs1)):
        close(f"{name} output {k}", got, want)
    close(name + " dhidden", dh, dh1, rtol=1e-4)
    close(name + " dweight", dw, dw1[block], rtol=1e-4)
    close(name + " dbias", db, db1[block], rtol=1e-4)


def check_logprob_support(rank, block, group):
    """Log-probs under a truncated support (top-k, top-p, min-p) on every rank's block:
    the same support, ``logp`` (``-inf`` outside) and gradients as one process."""
    hidden, weight, bias, ids, mask, _, _ = data(8)
    up = torch.randn(B, T, generator=torch.Generator().manual_seed(9))
    for top_k, top_p, min_p in ((5, None, None), (None, 0.7, None), (12, 0.8, 0.05)):
        results = []
        for w_rows, b_rows, grp in ((weight, bias, None), (weight[block], bias[block], group)):
            h, w, b = leaves(hidden, w_rows, b_rows)
            out = fl.linear_logprobs(
                h,
                w,
                ids,
                temperature=0.9,
                bias=b,
                mask=mask,
                vocab_parallel_group=grp,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
            )
            inside = ~out.outside_support
            (out.logp.masked_fill(~inside, 0.0) * up).sum().backward()
            results.append((out.logp.detach(), out.outside_support, h.grad, w.grad, b.grad))
        (lp1, out1, dh1, dw1, db1), (lp, out, dh, dw, db) = results
        name = f"logprob support {top_k}/{top_p}/{min_p} rank {rank}"
        if not torch.equal(out, out1):
            raise AssertionError(name + ": supports differ")
        close(name + " logp", lp[~out], lp1[~out1])
        close(name + " dhidden", dh, dh1, rtol=1e-4)
        close(name + " dweight", dw, dw1[block], rtol=1e-4)
        close(name + " dbias", db, db1[block], rtol=1e-4)


def bad_inputs(rank, block, group):
    """Each case is bad on one rank only; returns every case's error message."""
    hidden, weight, _, ids, mask, adv, _ = data(5)
    w = weight[block]
    cases = {
        "nan hidden on rank 1": lambda: fl.linear_grpo_loss(
            hidden.masked_fill(torch.zeros_like(hidden, dtype=torch.bool).index_fill(0, torch.tensor([0]), rank == 1),
                               float("nan")),
            w, ids, mask, adv, vocab_parallel_group=group),
        "float64 weight on the last rank": lambda: fl.linear_cross_entropy(
            hidden, w.double() if rank == dist.get_world_size(group) - 1 else w, ids, vocab_parallel_group=group),
        "fewer rows on rank 0": lambda: fl.linear_cross_entropy(
            hidden[: 2 if rank == 0 else 3], w, ids[: 2 if rank == 0 else 3], vocab_parallel_group=group),
        "id beyond the vocabulary": lambda: fl.linear_logprobs(
            hidden, w, ids.clamp(max=V - 1) + (V if rank == 0 else 0) * (ids == ids.max()), vocab_parallel_group=group),
        "a tensor on the meta device on rank 1": lambda: fl.linear_grpo_loss(
            hidden, w.to("meta") if rank == 1 else w, ids, mask, adv, vocab_parallel_group=group),
    }  # fmt: skip
    errors = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors


def main():
    world, rank, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))  # a group other than the default one
    start = sum(BLOCKS[world][:rank])
    block = slice(start, start + BLOCKS[world][rank])
    for loss_type, level in (("dapo", "token"), ("grpo", "sequence"), ("luspo", "token"), ("cispo", "token")):
        check_grpo(rank, block, group, loss_type, level)
    for loss_type, level, support in (
        ("dapo", "token", dict(top_k=20, top_p=0.9)),
        ("grpo", "sequence", dict(top_p=0.6)),
    ):
        check_grpo(rank, block, group, loss_type, level, support)
    for reduction, options in (
        ("mean", {}),
        ("sum", dict(label_smoothing=0.1, z_loss=1e-3)),
        ("none", dict(softcap=5.0)),
        ("mean", dict(temperature=0.8, label_smoothing=0.05)),
    ):
        check_ce(rank, block, group, reduction, options)
    check_logprobs(rank, block, group)
    check_logprob_outputs(rank, block, group)
    check_logprob_support(rank, block, group)
    errors = bad_inputs(rank, block, group) if world > 1 else {}
    print(json.dumps({"rank": rank, "errors": errors}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
