"""Device-neutral model building blocks (linear, attention metadata, norm, rope, activation)
and the `Backend` interface they ask for every op."""
