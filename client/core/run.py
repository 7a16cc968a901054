"""One plan in progress: the pure half of a shell's driver loop.

A shell's driver (`StoreClient._drive`, `AsyncStoreClient._drive`) is this loop, with the step
taken its own way (blocking or awaited)::

    run = Run(plan)
    step = run.advance()
    while step is not None:
        try:
            outcome = take(step)
        except BaseException as exc:
            step = run.advance(error=typed(exc))
        else:
            step = run.advance(outcome)
    return run.result
"""

from __future__ import annotations

from typing import Generic, cast

from client.core.steps import Plan, R, Step


class Run(Generic[R]):
    """Drives `plan`: `advance` hands it a step's outcome (or failure) and returns its next
    step, or None once the plan has returned (its value is then `result`). An error the plan
    does not handle is raised out of `advance`."""

    __slots__ = ("_plan", "_result")

    def __init__(self, plan: Plan[R]) -> None:
        self._plan = plan
        self._result: object = None

    def advance(self, outcome: object = None, *, error: BaseException | None = None) -> Step | None:
        try:
            if error is not None:
                return self._plan.throw(error)
            return self._plan.send(outcome)
        except StopIteration as done:
            self._result = done.value
            return None

    @property
    def result(self) -> R:
        return cast(R, self._result)
