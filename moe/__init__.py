"""MegaBlocks-style mixture-of-experts layers (MoE with capacity, dropless dMoE) for the GPT model."""
