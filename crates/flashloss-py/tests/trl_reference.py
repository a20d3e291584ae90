"""TRL's GRPO loss written in plain PyTorch on materialized logits, in float64: the
oracle of the parity tests. It follows ``GRPOTrainer._compute_loss`` line by line, with
the reductions of ``docs/spec/losses.md`` ("Alignment with TRL 1.16")."""

import math

import torch


def logits_of(hidden, weight, bias, temperature):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    return z / temperature


def truncated_support(z, temperature, top_k=None, top_p=None, min_p=None):
    """Which entries of the float64 logits ``z`` ``[..., V]`` (before the temperature)
    vLLM V1's filters keep, decided on the f32 scaled logits as the spec has it (min-p,
    top-k with ties kept, top-p over a stable ascending sort by ``(s, j)``)."""
    v = z.shape[-1]
    s = z.detach().float() * torch.tensor(1.0 / temperature, dtype=torch.float32) + 0.0
    s64 = s.double()
    s_max = s64.max(-1, keepdim=True).values
    keep = torch.ones_like(s, dtype=torch.bool)
    if min_p is not None and min_p > 0:
        keep &= torch.exp(s64 - s_max) >= min_p
    if top_k is not None and 0 < top_k < v:
        left = s.masked_fill(~keep, float("-inf"))
        kth = left.sort(-1, descending=True).values[..., top_k - 1 : top_k]
        keep &= s >= kth
    if top_p is not None and top_p < 1:
        left = s.masked_fill(~keep, float("-inf"))
        order = torch.sort(left, stable=True, dim=-1).indices
        mass = torch.exp(s64 - s_max).masked_fill(~keep, 0.0)
        q = mass.gather(-1, order) / mass.sum(-1, keepdim=True)
        drop = q.cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        keep &= ~torch.zeros_like(drop).scatter(-1, order, drop)
    return keep


def vespo_phi(advantages, log_ratio, mask, rho, k_pos, lambda_pos, k_neg, lambda_neg):
    lower = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if rho is not None:
        log_rho = rho.double().log().clamp(lower, 20.0).reshape(len(rho), -1)  # [B] -> [B, 1]
        # Per token: over the live tokens (flashloss's batch rule); [B, 1]: once, as TRL.
        seq = seq + (log_rho * mask if log_rho.shape[1] > 1 else log_rho).sum(-1, keepdim=True)
    log_w = seq.clamp(lower, 20.0)
    pos = advantages >= 0
    k = torch.where(pos, k_pos, k_neg)
    lam = torch.where(pos, lambda_pos, lambda_neg)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).detach()


def grpo_reference(
    hidden,
    weight,
    bias,
    ids,
    mask,
    advantages,
    *,
    old=None,
    ref=None,
    rho=None,
    policy_mask=None,
    entropy_mask=None,
    loss_type="dapo",
    beta=0.0,
    epsilon_low=0.2,
    epsilon_high=0.2,
    delta=None,
    importance_sampling_level="token",
    temperature=1.0,
    use_bias_correction_kl=True,
    entropy_coef=0.0,
    num_items_in_batch=None,
    max_completion_length=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo=(2.0, 3.0, 3.0, 2.0),
    per_token=False,
    support=None,
):
    """Loss and per-token logp/entropy; ``hidden`` ``[B, T, H]`` (float64 leaves that
    require grad get their gradients from ``loss.backward()``). ``per_token``: the
    per-token losses ``ℓ·ρ + β·kl`` times the mask ``[B, T]`` (Liger's ``reduce=False``)
    in place of the loss."""
    logps_all = torch.log_softmax(logits_of(hidden, weight, bias, temperature), -1)
    logp = logps_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logps_all.exp() * logps_all).sum(-1)
    if support is not None:
        # flashloss addition 13: logp under the sampler's truncated support (K fixed),
        # and the tokens whose target is outside it masked.
        z = logits_of(hidden, weight, bias, 1.0)
        keep = truncated_support(z, temperature, *support)
        scaled = z / temperature
        logp = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
            scaled.masked_fill(~keep, float("-inf")), -1
        )
        mask = mask & keep.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    m = mask.double()
    adv = advantages.double()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    old = logp.detach() if old is None else old.double()
    log_ratio = logp - old
    if importance_sampling_level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(liw)
    if beta != 0.0:
        d = ref.double() - logp
        kl = torch.exp(d) - d - 1
        if use_bias_correction_kl:
            kl = kl * coef_1
    if loss_type == "cispo":
        ptl = -torch.clamp(coef_1, max=epsilon_high).detach() * adv * logp
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        ptl = -torch.min(coef_1 * adv, coef_2 * adv)
    elif loss_type == "sapo":
        temps = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        ptl = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * adv
    elif loss_type == "vespo":
        phi = vespo_phi(adv, log_ratio, m, rho, *vespo)
        ptl = -phi * adv * logp
    else:
        raise ValueError(loss_type)
    ptl = ptl.expand_as(logp)
    if policy_mask is not None:
        ptl = ptl * policy_mask.double()
    if entropy_mask is not None:
        ptl = ptl * entropy_mask.double()
    if rho is not None and loss_type != "vespo":
        r = rho.double()
        ptl = ptl * (r.unsqueeze(-1) if r.dim() == 1 else r)
    if beta != 0.0:
        ptl = ptl + beta * kl
    if per_token:
        return ptl * m, logp.detach(), entropy.detach()
    bsz = ids.shape[0]
    if loss_type in ("grpo", "sapo"):
        loss = ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (ptl * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (ptl * m).sum() / (bsz * max_completion_length)
    elif loss_type in ("cispo", "dapo", "vespo"):
        norm = m.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
        loss = (ptl * m).sum() / norm
    else:  # luspo, the spec's reduction: (1/B) Σ_b Σ_t m ℓ
        loss = (ptl * m).sum() / bsz
    if entropy_coef != 0.0:
        em = m if entropy_mask is None else m * entropy_mask.double()
        loss = loss - entropy_coef * (entropy * em).sum() / em.sum().clamp(min=1.0)
    return loss, logp.detach(), entropy.detach()
