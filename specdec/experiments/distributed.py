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
        """Wait for every process, then tear the process group down.

        Left to interpreter exit, gloo's worker threads can outlive the group and abort the
        process ("terminate called without an active exception", seen in CI on a run whose
        records were all written), so the launch would fail after succeeding.
        """
        if self.state is not None:
            self.state.wait_for_everyone()
            self.state.destroy_process_group()
            self.state = None

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.state is not None:  # a failing process must not wait on a barrier the others never reach
            self.state.destroy_process_group()
            self.state = None
