"""Pallas (Mosaic TPU) kernels of flashloss.jax: the logits-level and LM-head-fused losses."""
