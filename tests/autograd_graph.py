"""What a backward runs: the kinds of autograd node behind some outputs, for tests that pin a graph's shape."""

from __future__ import annotations

import collections
from collections.abc import Iterable

import torch


def backward_node_kinds(outputs: Iterable[torch.Tensor]) -> collections.Counter[str]:
    """The kinds of autograd node the backward of ``outputs`` runs, each node counted once."""
    seen, kinds, stack = set(), collections.Counter(), [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        kinds[type(node).__name__] += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return kinds
