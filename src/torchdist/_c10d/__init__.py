"""Layer 1: what users call — init, groups, collectives, point-to-point, object collectives."""
