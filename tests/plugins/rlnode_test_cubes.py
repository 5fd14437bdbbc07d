"""Cubes that exist only for the tests: fault injection stays out of the
production cubes.

They reach the daemons the way a third-party cube does, through the
``rlnode.cubes`` entry-point group (rlnode/cubes/registry.py): this
directory holds the module and a ``rlnode_test_cubes-0.dist-info`` that
declares it, and tests/conftest.py puts the directory on ``sys.path`` and on
``PYTHONPATH``, so a daemon the tests start as a subprocess finds these kinds
as well.

``faulty-guessing``: the ``guessing`` cube, except that every Nth train task
(index % N == 0) fails in reset on every attempt, as a broken task server
would; its groups are dropped after the retries and their credits must come
back (tests/test_cluster.py).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from rlnode.cubes.base import CubeError, CubeTask, Reset
from rlnode.cubes.guessing import GuessingCube, GuessingOptions, GuessingTask
from rlnode.cubes.tasks import split_index, task_rng


class FaultyGuessingOptions(GuessingOptions, forbid_unknown_fields=True, kw_only=True):
    # Every Nth train task fails in reset; 0 = none (plain guessing).
    fail_reset_every: Annotated[int, Meta(ge=0)] = 0


class FaultyGuessingTask(GuessingTask):
    async def reset(self) -> Reset:
        every = self.opts.fail_reset_every
        split, idx = split_index(self.ref.task_id)
        if every and split == "train" and idx % every == 0:
            raise CubeError(f"task {self.ref.task_id}: injected reset failure (fail_reset_every={every})")
        return await super().reset()


class FaultyGuessingCube(GuessingCube):
    kind = "faulty-guessing"
    Options = FaultyGuessingOptions

    def target(self, task_id: str) -> int:  # the hidden numbers of ``guessing`` with the same seed
        split, idx = split_index(task_id)
        return task_rng(self.seed, GuessingCube.kind, split, idx).randint(1, self.opts.max_number)

    async def open_task(self, task_id: str) -> CubeTask:
        task = await super().open_task(task_id)
        return FaultyGuessingTask(task.ref, task.target, self.opts)
