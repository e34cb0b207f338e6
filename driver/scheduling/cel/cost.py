"""The runtime cost limit of a selector (resourceapi.CELSelectorExpressionMaxCost): every
evaluation step and loop iteration ticks a per-evaluation counter, and going over the limit
fails with the scheduler's `operation cancelled: actual cost limit exceeded`. The count is an
approximation of cel-go's cost model that is never far below it."""

from __future__ import annotations



COST_LIMIT = 1_000_000  # resourceapi.CELSelectorExpressionMaxCost
COST_LIMIT_MESSAGE = "operation cancelled: actual cost limit exceeded"


class _CostExceeded(Exception):
    pass


def _tick(cost: list, amount: int = 1) -> None:
    cost[0] += amount
    if cost[0] > COST_LIMIT:
        raise _CostExceeded()
