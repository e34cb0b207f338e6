"""The errors of the DRA CEL environment: `CelError`, the one error callers see (a selector that
does not compile, fails at runtime or does not return a bool), and the two internal ones the
type checker (`_CompileError`) and the evaluator (`_EvalError`, cel-go's error value) raise
before the entry points turn them into a `CelError`."""

from __future__ import annotations



class CelError(Exception):
    """A selector that does not compile, fails at runtime, or does not return a bool."""

    def __init__(self, expression: str, message: str) -> None:
        super().__init__(message)
        self.expression = expression
        self.message = message


class _EvalError(Exception):
    """A CEL runtime error (an error value in cel-go)."""


class _CompileError(Exception):
    """What the Kubernetes type checker or parser would reject."""
