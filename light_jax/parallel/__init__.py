"""The communication system: the two-level mesh and the gradient collectives over it."""
