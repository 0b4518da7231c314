"""Device discipline on CPU: which tensors would still be on the host in a GPU job, and a check that none of them
reaches a process group that is NCCL there.

On CPU every tensor is on the CPU, so comparing devices proves nothing. Instead, :class:`HostTensors` (a
``TorchFunctionMode``) marks every tensor created without an explicit device (factories without ``device=``,
tensors from numpy, ``.cpu()``); the mark follows a tensor through operations on it and is cleared only by a move
with an explicit device (``.to(device)``, ``.cuda()``), which is what puts a tensor on the compute device in a GPU
job. :func:`device_discipline` also wraps the tensor collectives of ``torch.distributed``, the functional
collectives (Ulysses, EP, resharding) and ``batch_isend_irecv``: a marked tensor handed to any group but those
created as gloo groups (the host-side exchanges of loader metadata and plans) raises :class:`HostTensorInCollective`.
Both are inherited by fork-started ranks.

:func:`device_syncs` counts, on top of the marks, what would make the host wait for the device in a GPU job: a read of
a tensor that would be on the device (``.item()``, ``.tolist()``, ``float()``/``int()``/``bool()``, ``.cpu()``,
``.numpy()``), and a blocking copy from the host to it (``torch.tensor(data, device=...)``, ``.to(device)`` of a
host tensor without ``non_blocking=True``), both of which wait for every kernel queued before them.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.overrides import TorchFunctionMode

_MARK = "_omni_host"
_FACTORIES = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange", "linspace", "rand",
              "randn", "randint", "eye", "scalar_tensor", "empty_strided"}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "reduce", "send", "recv",
                "isend", "irecv")
_P2P = ("send", "recv", "isend", "irecv")
_FUNCTIONAL = ("all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
               "reduce_scatter_tensor_autograd", "all_to_all_single", "all_to_all_single_autograd")


class HostTensorInCollective(RuntimeError):
    """A tensor that would be on the host in a GPU job reached a collective of a group that is NCCL there."""


def is_host(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and getattr(tensor, _MARK, False)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    for arg in args:
        for tensor in _tensors(arg):
            return tensor
    return None


class HostTensors(TorchFunctionMode):
    """Marks host tensors (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        host = _host_result(name, args, kwargs)
        # On the CPU a move to the CPU returns the tensor itself; in a GPU job it is a copy on the other device, and
        # the original stays where it was: give the copy, so the original keeps its mark.
        if host is not None and args and out is args[0] and host != is_host(out):
            out = out.clone()
        if host is not None:
            inputs = {id(t) for a in (*args, *kwargs.values()) for t in _tensors(a)}
            for tensor in _tensors(out):
                if host and id(tensor) not in inputs:  # e.g. ``as_tensor`` of a tensor: the tensor itself
                    setattr(tensor, _MARK, True)
                elif not host and is_host(tensor):
                    delattr(tensor, _MARK)
        return out


_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "__array__"}


class _DeviceSyncs(TorchFunctionMode):
    """Records every operation that would wait for the device (see the module docstring), inside :class:`HostTensors`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        device_tensor = isinstance(first, torch.Tensor) and not is_host(first)
        if name in _READS and device_tensor:
            self.syncs.append(name)
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None and not (
                isinstance(first, torch.Tensor) and not is_host(first)):
            self.syncs.append(f"{name}(device=)")
        elif name == "to" and is_host(first) and not kwargs.get("non_blocking", False) and (
                kwargs.get("device") is not None or any(isinstance(a, str | torch.device) for a in args[1:])):
            self.syncs.append("to(device)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_syncs() -> Iterator[list[str]]:
    """The operations inside the block that would wait for the device in a GPU job, by name (see the module
    docstring). Tensors made before the block count as on the device."""
    with HostTensors(), _DeviceSyncs() as counter:
        yield counter.syncs


def _host_result(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool | None:
    """Whether the result is a host tensor (``None``: leave its mark as the operation left it)."""
    if name in _FACTORIES:
        if kwargs.get("device") is not None:
            return False
        if name == "as_tensor" and args and isinstance(args[0], torch.Tensor):
            return is_host(args[0])
        return True
    if name in _LIKE:
        return False if kwargs.get("device") is not None else is_host(args[0])
    if name == "cpu":
        return True
    if name in ("to", "cuda"):
        explicit = kwargs.get("device") is not None or name == "cuda" or any(
            isinstance(a, str | torch.device | torch.Tensor) for a in args[1:])
        return False if explicit else is_host(args[0])
    if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs:
        return None  # in place: the destination keeps its own device
    first = _first_tensor(args)
    return True if first is not None and is_host(first) else None


def _group_of(args: tuple[Any, ...], kwargs: dict[str, Any], position: int) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    return args[position] if len(args) > position else None


class _Checker:
    def __init__(self) -> None:
        self.host_groups: set[str] = set()

    def is_device_group(self, group: Any) -> bool:
        if group is None:
            group = dist.group.WORLD
        return not (isinstance(group, dist.ProcessGroup) and group.group_name in self.host_groups)

    def check(self, what: str, tensors: list[torch.Tensor], group: Any) -> None:
        if self.is_device_group(group) and any(is_host(t) for t in tensors):
            shapes = [list(t.shape) for t in tensors if is_host(t)]
            ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                    if "omni_lightning" in f.filename]
            raise HostTensorInCollective(
                f"{what} on a group that is NCCL in a GPU job got host tensor(s) of shape {shapes} (from "
                f"{' < '.join(reversed(ours[-4:])) or 'outside the package'}): create them with device= (the compute "
                "device), or move them there, or use a gloo group made for host data")

    def record_gloo(self, result: Any, backend: Any) -> Any:
        if backend == "gloo":
            groups = result[1] if isinstance(result, tuple) else [result]
            self.host_groups |= {g.group_name for g in groups if isinstance(g, dist.ProcessGroup)}
        return result


@contextlib.contextmanager
def device_discipline() -> Iterator[_Checker]:
    """Mark host tensors and check every collective (see the module docstring) while the block runs."""
    checker = _Checker()
    patches: list[tuple[Any, str, Any]] = []

    def patch(module: Any, name: str, wrapper: Any) -> None:
        patches.append((module, name, getattr(module, name)))
        setattr(module, name, wrapper)

    new_group, new_subgroups = dist.new_group, dist.new_subgroups_by_enumeration
    patch(dist, "new_group", lambda *a, **k: checker.record_gloo(new_group(*a, **k), k.get("backend")))
    patch(dist, "new_subgroups_by_enumeration",
          lambda *a, **k: checker.record_gloo(new_subgroups(*a, **k), k.get("backend")))
    for module, names, prefix in ((dist, _COLLECTIVES, "torch.distributed"), (funcol, _FUNCTIONAL, "functional")):
        for name in names:
            if module is dist and name in _P2P:
                continue  # wrapped where the runtime calls them (below): P2POp insists on the originals
            if not hasattr(module, name):
                continue
            original = getattr(module, name)
            position = list(inspect.signature(original).parameters).index("group")

            def wrapped(*args: Any, _what: str = f"{prefix} {name}", _op: Any = original, _at: int = position,
                        **kwargs: Any) -> Any:
                checker.check(_what, [t for a in args for t in _tensors(a)], _group_of(args, kwargs, _at))
                return _op(*args, **kwargs)

            patch(module, name, wrapped)
    for name, module in list(sys.modules.items()):
        if name.startswith("omni_lightning") and getattr(module, "dist", None) is dist:
            proxy = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if not n.startswith("__")})
            for p2p in _P2P:
                original = getattr(dist, p2p)
                position = list(inspect.signature(original).parameters).index("group")

                def sent(*args: Any, _what: str = f"torch.distributed {p2p}", _op: Any = original, _at: int = position,
                         **kwargs: Any) -> Any:
                    checker.check(_what, list(_tensors(args[0] if args else kwargs.get("tensor"))),
                                  _group_of(args, kwargs, _at))
                    return _op(*args, **kwargs)

                setattr(proxy, p2p, sent)
            patch(module, "dist", proxy)
    from_numpy = torch.from_numpy  # not a torch function the mode sees

    def marked_from_numpy(array: Any) -> torch.Tensor:
        tensor = from_numpy(array)
        setattr(tensor, _MARK, True)
        return tensor

    patch(torch, "from_numpy", marked_from_numpy)
    batch = dist.batch_isend_irecv

    def batched(ops: list[Any]) -> Any:
        for op in ops:
            checker.check("torch.distributed.batch_isend_irecv", [op.tensor], op.group)
        return batch(ops)

    patch(dist, "batch_isend_irecv", batched)
    try:
        with HostTensors():
            yield checker
    finally:
        for module, name, original in reversed(patches):
            setattr(module, name, original)
