"""One GRPO step in PyTorch: flashloss's fused loss from hidden states and the LM head, checked
against the same DAPO loss computed the plain way, on materialized logits.

Run: python examples/torch_grpo_step.py
"""

import torch

import flashloss.torch as fl

torch.manual_seed(0)
B, T, H, V = 4, 32, 64, 5000
hidden = torch.randn(B, T, H, requires_grad=True)  # the model's last hidden states at the completion positions
lm_head = torch.nn.Linear(H, V, bias=False)
completion_ids = torch.randint(V, (B, T))
completion_mask = torch.ones(B, T, dtype=torch.long)
completion_mask[:, -5:] = 0  # padding after the completions end
advantages = torch.randn(B)
old_logps = -torch.rand(B, T) - 8.0  # the sampling policy's log-probs

loss, out = fl.linear_grpo_loss(
    hidden, lm_head.weight, completion_ids, completion_mask, advantages, old_per_token_logps=old_logps, loss_type="dapo"
)
loss.backward()  # gradients of hidden (so the model) and lm_head.weight; no [B, T, V] tensor was formed
print(f"flashloss loss {loss.item():.6f}, clip ratio {float(out.metrics['clip_ratio/region_mean']):.3f}")
grads = hidden.grad.clone(), lm_head.weight.grad.clone()

# The plain path: logits, log-softmax, TRL's clipped ratio, DAPO's token-normalized sum.
hidden.grad, lm_head.weight.grad = None, None
logp = torch.log_softmax(lm_head(hidden).float(), -1).gather(-1, completion_ids[..., None])[..., 0]
ratio = torch.exp(logp - old_logps)
per_token = -torch.min(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None])
plain = (per_token * completion_mask).sum() / completion_mask.sum()
plain.backward()
print(f"plain loss     {plain.item():.6f}")

torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-6)
for got, want in zip(grads, (hidden.grad, lm_head.weight.grad)):
    # The default plan (mode="auto") may keep probabilities in f16 on the CPU: gradients within 1e-3 of the largest.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
print("OK: loss and gradients agree with the plain path")
