"""Workload balancing: cost models, decentralized grouped reordering and encoder resharding plans."""
