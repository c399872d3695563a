"""Model building blocks: linear, attention, norm, rope, activation."""
