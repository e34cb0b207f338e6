"""DeviceClass and request CEL selectors evaluated as the scheduler evaluates them.

The DRA CEL environment (resource.k8s.io `CELDeviceSelector`, k8s.io/dynamic-resource-
allocation/cel at 1.37): the input is `device` with `driver`, `attributes` and `capacity`
(both grouped by domain; an unqualified name lives under the driver's own domain), and
`allowMultipleAllocations`. Looking up an unknown domain gives an empty map; looking up an
unknown name in a domain is a runtime error, and a runtime error aborts the allocation (it
does not just skip the device). Capacity values are quantities, `version` attributes
semantic versions, list-typed attributes (KEP-5491: ints, bools, strings, versions) lists.

The expression is parsed with cel-python's parser and evaluated here, with the semantics of
cel-go as Kubernetes configures it, because cel-python's own evaluator differs where it
matters for a verdict:

- equality is heterogeneous: `dyn(1) == 1.0` is true and `dyn(1) == "a"` false, while a
  comparison of two values whose types are known and differ (`1.0 == 1`,
  `quantity("1") == "1"`) is a type error, as the Kubernetes type checker rejects it;
  `<` and friends compare int, uint and double with each other;
- `&&` and `||` are commutative over errors (`error || true` is true);
- the macros (`all`, `exists`, `exists_one`, `map`, `filter`, two-variable forms) range over
  lists and maps only: a string is not iterable;
- a call that has no overload for its arguments is an error, never a Python exception;
- the libraries of the Kubernetes base environment that selectors use: `quantity`,
  `semver` (with the `normalize` argument), `format`, the strings extension (`split`,
  `lowerAscii`, ...), regex `find`/`findAll`, the lists libraries, `sets`, optionals,
  `cel.bind`, and `includes` (list-typed attributes);
- a runtime cost limit (resourceapi.CELSelectorExpressionMaxCost, 1,000,000): an expression
  that goes over it fails with the scheduler's error, `operation cancelled: actual cost
  limit exceeded`. The cost is counted per evaluation step and loop iteration, an
  approximation of cel-go's cost model that is never far below it.

Kubernetes reports type errors when the claim is created; here they are errors of the
evaluation. Either way the selector does not select, and explain says why.

The `Quantity` and `SemVer` types and `FUNCTIONS` also plug into cel-python (the tests'
ValidatingAdmissionPolicy check uses them).

The package follows CEL's parts, each module importing only those listed before it:
`errors` and `cost` (the runtime cost limit), `values` (CEL's runtime values and type names),
`kubernetes` (the quantity, semver and format libraries), `evaluator` (operators at runtime),
`library` (the functions, dispatched on their arguments), `syntax` (the parser and syntax
errors), `checker` (the type-checking compiler), `program` (compile, check, evaluate) and
`device` (the `device` variable). This module re-exports what the rest of the driver and the
tests use.
"""

from __future__ import annotations

from driver.scheduling.cel.cost import COST_LIMIT, COST_LIMIT_MESSAGE
from driver.scheduling.cel.device import (
    STANDARD_DOMAIN, activation, by_domain, device_activation, matches, references)
from driver.scheduling.cel.errors import CelError
from driver.scheduling.cel.evaluator import equal
from driver.scheduling.cel.kubernetes import FUNCTIONS
from driver.scheduling.cel.program import _program, check_selector, evaluate, evaluate_value
from driver.scheduling.cel.values import CIDR, IP, Optional, Quantity, SemVer, UInt, _type_name

__all__ = [
    "CIDR", "COST_LIMIT", "COST_LIMIT_MESSAGE", "CelError", "FUNCTIONS", "IP", "Optional", "Quantity",
    "STANDARD_DOMAIN", "SemVer", "UInt", "_program", "_type_name", "activation", "by_domain",
    "check_selector", "device_activation", "equal", "evaluate", "evaluate_value", "matches", "references",
]
