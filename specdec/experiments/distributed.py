"""One process or several: the prompt split and the record gather of multi-process experiments.

Under ``accelerate launch --multi_gpu --num_processes N -m specdec ...`` (or ``torchrun
--nproc_per_node N -m specdec ...``) every process runs the whole Hydra app; ``WORLD_SIZE > 1``
tells them apart from a plain run. Each process takes its contiguous share of the prompts
(accelerate's ``PartialState().split_between_processes``), runs it on its own GPU (or on the
CPU with ``device=cpu``: the gloo backend), and the records are gathered
(``accelerate.utils.gather_object``) on the main process, which alone writes the outputs.
"""

from __future__ import annotations

import os

__all__ = ["Processes", "world_size"]


def world_size() -> int:
    """Processes of this launch (``WORLD_SIZE`` as torchrun / accelerate set it; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class Processes:
    """The launch this process belongs to.

    Args:
        device: ``"cpu"`` makes the process group use the CPU (gloo) even where GPUs exist.
    """

    def __init__(self, device: str = "auto"):
        self.num_processes = world_size()
        self.state = None
        if self.num_processes > 1:
            from accelerate import PartialState

            self.state = PartialState(cpu=str(device) == "cpu")
            _register_exit_hook()

    @property
    def index(self) -> int:
        return self.state.process_index if self.state is not None else 0

    @property
    def is_main(self) -> bool:
        return self.state is None or self.state.is_main_process

    def split(self, items: list) -> list:
        """This process's contiguous share of ``items`` (all of them in a single process)."""
        if self.state is None:
            return list(items)
        with self.state.split_between_processes(list(items)) as part:
            return list(part)

    def gather(self, records: list) -> list | None:
        """Every process's ``records`` in process order, on the main process; None elsewhere."""
        if self.state is None:
            return records
        from accelerate.utils import gather_object

        allr = gather_object(list(records))
        return allr if self.is_main else None

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()

    def close(self) -> None:
        """Wait for every process. The process group itself stays up for the next experiment of
        this process (a Hydra ``--multirun`` sweep runs its jobs one after another in one process:
        accelerate's ``PartialState`` keeps its state, so a group torn down here would not be set
        up again) and is destroyed once, at interpreter exit (:func:`_destroy_at_exit`)."""
        if self.state is not None:
            self.state.wait_for_everyone()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        # a failing process does not wait on a barrier the others may never reach: the launcher
        # stops the rest when it exits non-zero


_EXIT_HOOK: list = []


def _destroy_at_exit() -> None:
    """Tear the default process group down before the interpreter's own teardown: left to it,
    gloo's worker threads can outlive the group and abort the process ("terminate called without
    an active exception", seen in CI on a 2-process run whose records were all written)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _register_exit_hook() -> None:
    if not _EXIT_HOOK:
        import atexit

        atexit.register(_destroy_at_exit)
        _EXIT_HOOK.append(True)
