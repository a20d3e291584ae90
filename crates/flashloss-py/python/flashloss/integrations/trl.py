"""TRL's ``GRPOTrainer`` with its loss computed by flashloss from the last hidden states
and the LM head, so the ``[B, T, V]`` logits are never formed::

    from flashloss.trl import FlashlossGRPOTrainer
    trainer = FlashlossGRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(...), ...)
    trainer.train()

Everything but ``_compute_loss`` is TRL's (generation, rewards, advantages, the old and
reference log-probs). The loss is TRL 1.16's, including its scaling for gradient
accumulation and its logged metrics. Supported: causal LMs whose ``get_decoder()``
returns the hidden states that ``get_output_embeddings()`` maps to logits (Qwen2, Llama,
Mistral, ...), text only, one process or FSDP2 (accelerate's ``fsdp_version: 2``); the
trainer refuses what it does not support (auxiliary router losses, adaptive entropy,
vision inputs, several processes other than FSDP2's) with a ``ValueError``. TRL's
top-entropy mask (``top_entropy_quantile < 1``) and off-policy mask
(``off_policy_mask_threshold``) need the current policy's entropies and log-probs before
the loss: they come from one more forward of the head without gradient
(``linear_logprobs``), 2NHV more FLOPs.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from ..torch import linear_grpo_loss, linear_logprobs

__all__ = ["FlashlossGRPOTrainer"]

_ACCUMULATED = ("grpo", "bnpo", "dr_grpo", "sapo", "luspo")
_TOKEN_NORMALIZED = ("cispo", "dapo", "vespo")


class FlashlossGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose ``_compute_loss`` calls :func:`flashloss.torch.linear_grpo_loss`."""

    def _check_supported(self, inputs):
        reasons = []
        if self.aux_loss_enabled:
            reasons.append("router auxiliary loss")
        if self.use_adaptive_entropy:
            reasons.append("adaptive entropy")
        if inputs.get("pixel_values") is not None:
            reasons.append("vision inputs")
        if self.accelerator.num_processes != 1 and not self.accelerator.is_fsdp2:
            # The hidden states come from the decoder, past DDP's forward (its gradient sync); FSDP2's units
            # (accelerate wraps the embedding, the layers, the final norm with the LM head) unshard there.
            reasons.append("more than one process (other than FSDP2)")
        if reasons:
            raise ValueError("FlashlossGRPOTrainer does not support: " + ", ".join(reasons))

    def _compute_loss(self, model, inputs):
        self._check_supported(inputs)
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        t = completion_ids.size(1)

        lm = self.accelerator.unwrap_model(model)
        hidden = lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden = hidden[:, -t - 1 : -1]  # the positions that predict the completion tokens
        head = lm.get_output_embeddings()
        entropy_mask, policy_mask = self._masks(inputs, hidden, head, completion_ids, mask)

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        num_items = None
        entropy_coef = self.entropy_coef if self._entropy_bonus_enabled else 0.0
        if self.loss_type in _TOKEN_NORMALIZED:
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            entropy_coef = entropy_coef / accumulation  # TRL scales the bonus for accumulation only
        ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            ratio = inputs.get("importance_sampling_ratio")
        loss, out = linear_grpo_loss(
            hidden,
            head.weight,
            completion_ids,
            mask,
            inputs["advantages"],
            bias=head.bias,
            old_per_token_logps=inputs.get("old_per_token_logps"),
            ref_per_token_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            importance_sampling_ratio=ratio,
            policy_mask=policy_mask,
            entropy_mask=entropy_mask,
            loss_type=self.loss_type,
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            importance_sampling_level=self.importance_sampling_level,
            temperature=self.temperature,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            entropy_coef=entropy_coef,
            num_items_in_batch=num_items,
            max_completion_length=self.max_completion_length,
            sapo_temperature_pos=self.args.sapo_temperature_pos,
            sapo_temperature_neg=self.args.sapo_temperature_neg,
            vespo_k_pos=self.args.vespo_k_pos,
            vespo_lambda_pos=self.args.vespo_lambda_pos,
            vespo_k_neg=self.args.vespo_k_neg,
            vespo_lambda_neg=self.args.vespo_lambda_neg,
        )
        if self.loss_type in _ACCUMULATED:
            loss = loss / accumulation

        metrics = self._metrics[mode]

        def mean(name):  # this process's value, averaged over the processes as TRL's are
            return float(self.accelerator.gather(out.metrics[name].reshape(1)).nanmean())

        if self.beta != 0.0:
            metrics["kl"].append(mean("kl"))
        metrics["entropy"].append(mean("entropy"))
        if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            for name in ("low_mean", "high_mean", "region_mean"):
                metrics[f"clip_ratio/{name}"].append(mean(f"clip_ratio/{name}"))
        return loss.to(hidden.device)

    def _masks(self, inputs, hidden, head, completion_ids, mask):
        """TRL's top-entropy mask and off-policy sequence mask, from one no-grad pass."""
        if self.top_entropy_quantile >= 1.0 and self.off_policy_mask_threshold is None:
            return None, None
        bias = None if head.bias is None else head.bias.detach()
        logp, entropy = linear_logprobs(
            hidden.detach(),
            head.weight.detach(),
            completion_ids,
            temperature=self.temperature,
            return_entropy=True,
            bias=bias,
        )[:2]
        entropy_mask = policy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropy, mask, 1 - self.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            old = inputs.get("old_per_token_logps")
            old = logp if old is None else old
            sampling = inputs.get("sampling_per_token_logps", old)
            advantages = inputs["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            keep = self.get_off_policy_mask(advantages, logp, sampling, mask, self.off_policy_mask_threshold)
            policy_mask = keep.expand_as(mask)
        return entropy_mask, policy_mask
