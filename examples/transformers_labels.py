"""A Hugging Face model's own ``labels=`` loss through flashloss.transformers.patch: the same
cross-entropy, from the last hidden states and lm_head, without the [B, T, V] logits. Checked
against an unpatched copy of the model. A tiny random Qwen2 made here, no download.

Run: python examples/transformers_labels.py
"""

import copy

import torch
import transformers

import flashloss.transformers

torch.manual_seed(0)
config = transformers.Qwen2Config(
    vocab_size=3000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip
model = transformers.Qwen2ForCausalLM(config)
plain = copy.deepcopy(model)

input_ids = torch.randint(config.vocab_size, (2, 48))
labels = input_ids.clone()
labels[:, :10] = -100  # the prompt takes no part in the loss

flashloss.transformers.patch(model)  # this instance; patch("qwen2") patches the class
out = model(input_ids=input_ids, labels=labels)
out.loss.backward()
print(f"patched loss   {out.loss.item():.6f}, logits {out.logits}")  # logits=None: never formed

want = plain(input_ids=input_ids, labels=labels).loss
want.backward()
print(f"unpatched loss {want.item():.6f}")
torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
for (name, p), q in zip(model.named_parameters(), plain.parameters()):
    # The default plan (mode="auto") may keep probabilities in f16 on the CPU: gradients within 1e-3 of the largest.
    torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-3 * q.grad.abs().max().item(), msg=name)
print("OK: loss and every parameter's gradient agree with the unpatched model")
