"""The fork/spawn launcher of OmniStrategy: Lightning's, without shipping rank 0's weights back, and letting the
survivors of a dead worker fail by themselves first."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from lightning.fabric.strategies.launchers.multiprocessing import _check_bad_cuda_fork, _check_missing_main_guard
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["NoWeightsMultiProcessingLauncher"]

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
