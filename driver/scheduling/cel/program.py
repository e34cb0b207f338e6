"""The entry points that run a selector: `_program` compiles and caches an expression,
`check_selector` is what the API server checks when a claim is written, `evaluate_value` and
`evaluate` run a compiled program and turn every internal error into one `CelError`."""

from __future__ import annotations

from functools import lru_cache

import celpy

from driver.scheduling.cel.checker import _Compiler, _Node, DYN
from driver.scheduling.cel.cost import _CostExceeded, COST_LIMIT, COST_LIMIT_MESSAGE
from driver.scheduling.cel.errors import _CompileError, _EvalError, CelError
from driver.scheduling.cel.syntax import _parse, _syntax_error
from driver.scheduling.cel.values import _type_name

@lru_cache(maxsize=1024)
def _program(expression: str, variables: tuple[tuple[str, str], ...] = (("device", "map"),)) -> _Node:
    try:
        tree = _parse(expression)
    except celpy.CELParseError as err:
        raise CelError(expression, _syntax_error(expression, err)) from None
    except Exception as err:  # noqa: BLE001 - a parser bug must not crash explain
        raise CelError(expression, f"does not compile: {err}") from None
    try:
        return _Compiler(dict(variables)).compile(tree)
    except _CompileError as err:
        raise CelError(expression, f"compilation failed: {err}") from None
    except RecursionError:
        raise CelError(expression, "compilation failed: expression too deeply nested") from None


def check_selector(expression: str) -> None:
    """What the API server checks of a selector when a claim or class is written: that it
    compiles and returns a bool; CelError otherwise. Devices are not looked at."""
    program = _program(expression)
    if program.type not in (DYN, "bool"):
        raise CelError(expression, f"must return a bool (compilation failed: must evaluate to bool or "
                                   f"the unknown type, not {program.type})")


def evaluate_value(expression: str, variables: dict | None = None, cost_limit: int | None = None):
    """The expression's value (for tests and conformance checks); CelError on any error."""
    variables = variables or {}
    program = _program(expression, tuple(sorted((k, "map" if k == "device" else DYN) for k in variables)))
    cost = [0 if cost_limit is None else COST_LIMIT - cost_limit]
    try:
        return program.run(variables, cost)
    except _EvalError as err:
        raise CelError(expression, str(err)) from None
    except _CostExceeded:
        raise CelError(expression, COST_LIMIT_MESSAGE) from None
    except RecursionError:
        raise CelError(expression, "expression too deeply nested") from None
    except Exception as err:  # noqa: BLE001 - never crash the caller: report it as CEL would
        raise CelError(expression, f"{type(err).__name__}: {err}") from None


def evaluate(expression: str, variables: dict) -> bool:
    """The selector's verdict; CelError when Kubernetes would report a CEL error."""
    check_selector(expression)
    result = evaluate_value(expression, variables)
    if not isinstance(result, bool):
        raise CelError(expression, f"must return a bool, returned {_type_name(result)} "
                                   f"(CEL result of type {_type_name(result)} could not be converted to bool)")
    return result
