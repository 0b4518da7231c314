"""OmniStrategy's launchers. The fork/spawn one is Lightning's, without shipping rank 0's weights back, and letting
the survivors of a dead worker fail by themselves first. Every launcher (fork/spawn, the subprocess launcher, and the
in-place one of torchrun and SLURM, which start the processes themselves) turns ``fit(ckpt_path="last")`` into
the newest checkpoint of the ``ModelCheckpoint``'s directory that verifies (:class:`~.manifest.LastVerified`)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from lightning.fabric.strategies.launchers.multiprocessing import _check_bad_cuda_fork, _check_missing_main_guard
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from omni_lightning.strategies.manifest import LastVerified

__all__ = ["InPlaceLauncher", "NoWeightsMultiProcessingLauncher", "SubprocessLauncher", "last_verified"]

# Seconds a worker gets to fail by itself once another has died, then again after SIGTERM, before SIGKILL.
_SURVIVOR_GRACE_S = 2.0


class NoWeightsMultiProcessingLauncher(_MultiProcessingLauncher):
    """Fork/spawn launcher that does not ship rank 0's weights back to the parent.

    The stock launcher pickles rank 0's state dict for the main process, which fails for DTensor shards and is
    meaningless for a sharded model; results and trainer state still come back.
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Lightning's launch, except that when a worker dies the others get ``_SURVIVOR_GRACE_S`` seconds to fail
        by themselves before they are terminated. They do within a fraction of a second: their next collective raises
        gloo's ``Connection closed by peer``. torch's default SIGTERMs them at once instead, and then they stayed
        blocked in collectives until its SIGKILL 30 s later (Lightning's SIGTERM handler itself enters a collective).
        The error still names the worker that died first and how (``process 2 terminated with signal SIGKILL``)."""
        if (check := getattr(self._strategy, "check_model_fits", None)) is not None:  # before any worker starts
            check(self._strategy.lightning_module)
        args, kwargs = last_verified(function, args, kwargs, trainer)
        if self._start_method in ("fork", "forkserver"):
            _check_bad_cuda_fork()
        if self._start_method == "spawn":
            _check_missing_main_guard()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError("fit() twice on one Trainer with the fork/spawn launcher: create a new Trainer "
                                      "and pass fit(ckpt_path=...)")
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
        return_queue = mp.get_context(self._start_method).SimpleQueue()
        process_args = [trainer, function, args, kwargs, return_queue]
        if self._start_method == "spawn":
            process_args.append(_GlobalStateSnapshot.capture())
        context = mp.start_processes(self._wrapping_function, args=process_args, nprocs=self._strategy.num_processes,
                                     start_method=self._start_method, join=False)
        self.procs = context.processes
        while not context.join(grace_period=_SURVIVOR_GRACE_S):
            pass
        worker_output = return_queue.get()
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        """Lightning's worker, except that a worker failing because another failed first (its collective broken by
        that rank's exit) raises ``JobStopped`` quoting that rank's error, posted in the job's failure notice."""
        try:
            super()._wrapping_function(process_idx, *args, **kwargs)
        except Exception as error:
            notice = getattr(self._strategy, "failure_notice", None)
            if notice is not None and (stopped := notice.stopped_by_another_rank(error)) is not None:
                raise stopped from error
            raise

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        return _WorkerOutput(best_model_path, None, trainer.state, results, self.get_extra_results(trainer))


class SubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher (it re-runs the script for the other local ranks), resolving ``"last"``."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = last_verified(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class InPlaceLauncher(_Launcher):
    """The launcher of processes that torchrun or SLURM started: runs the function here, resolving ``"last"``."""

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = last_verified(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        pass  # the processes are the cluster's


def last_verified(function: Callable, args: tuple[Any, ...], kwargs: dict[str, Any], trainer: Any
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``function``'s arguments, with ``fit``'s ``ckpt_path="last"`` replaced by :class:`LastVerified` of the
    checkpoint directory when the trainer has one ``ModelCheckpoint`` with a ``dirpath`` holding checkpoints
    (otherwise Lightning's own ``"last"``: its ``last.ckpt``, checked when it loads)."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return args, kwargs
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    if bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    folders = {str(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath}
    if len(folders) != 1 or not any(p.suffix == ModelCheckpoint.FILE_EXTENSION and not p.name.startswith(".")
                                     for p in Path(next(iter(folders))).glob("*")):
        return args, kwargs
    bound.arguments["ckpt_path"] = LastVerified(next(iter(folders)))
    return bound.args, bound.kwargs
