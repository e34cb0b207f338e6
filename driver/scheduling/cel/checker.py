"""The compiler: walks cel-python's parse tree, checks types as the Kubernetes type checker does
(the static type names, the declared `device` object, the overloads it rejects) and builds a
tree of `_Node`s whose `run` closures evaluate the expression, macros included, counting cost."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import lark

from driver.scheduling.cel.cost import _CostExceeded, _tick
from driver.scheduling.cel.errors import _CompileError, _EvalError
from driver.scheduling.cel.evaluator import _apply, _is_num, _map_get, _map_has, _MISSING
from driver.scheduling.cel.library import _LIBRARY, _NoOverload
from driver.scheduling.cel.syntax import _unquote
from driver.scheduling.cel.values import _no_overload, _type_name, INT_MAX, INT_MIN, TypeValue, UInt, UINT_MAX

# -- static types -----------------------------------------------------------------------------------------
DYN = "dyn"
_NUMERIC = {"int", "uint", "double"}
_KNOWN_RESULT = {  # function -> result type, where it does not depend on the arguments
    "quantity": "quantity", "isQuantity": "bool", "semver": "semver", "isSemver": "bool",
    "compareTo": "int", "isGreaterThan": "bool", "isLessThan": "bool", "asInteger": "int",
    "asApproximateFloat": "double", "isInteger": "bool", "sign": "int", "add": "quantity", "sub": "quantity",
    "major": "int", "minor": "int", "patch": "int", "size": "int", "contains": "bool", "startsWith": "bool",
    "endsWith": "bool", "matches": "bool", "int": "int", "uint": "uint", "double": "double",
    "string": "string", "bool": "bool", "bytes": "bytes", "split": "list", "lowerAscii": "string",
    "upperAscii": "string", "trim": "string", "replace": "string", "substring": "string",
    "charAt": "string", "indexOf": "int", "lastIndexOf": "int", "join": "string", "find": "string",
    "findAll": "list", "includes": "bool", "isSorted": "bool", "validate": "optional_type",
    "hasValue": "bool", "type": "type", "reverse": DYN, "distinct": "list", "flatten": "list",
    "sort": "list", "slice": "list", "first": "optional_type", "last": "optional_type",
    "all": "bool", "exists": "bool", "exists_one": "bool", "map": "list", "filter": "list",
    "has": "bool", "quote": "string", "format": "string",
}
_TYPE_IDENTS = {"int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type", "type"}
_NAMESPACES = {"cel", "format", "sets", "optional", "lists", "strings", "math", "ip", "net"}


class _Node:
    """A compiled expression: its static type and how to evaluate it; `path` follows the
    declared `device` object (device, attributes, attribute-domain, capacity,
    capacity-domain), whose capacity values are quantities."""

    __slots__ = ("type", "run", "path")

    def __init__(self, type_: str, run: Callable[[dict, list], Any], path: str | None = None) -> None:
        self.type, self.run, self.path = type_, run, path


def _check_same(op: str, a: _Node, b: _Node) -> None:
    if DYN in (a.type, b.type) or a.type == b.type:
        return
    raise _CompileError(f"found no matching overload for '{op}' applied to '({a.type}, {b.type})'")


def _literal(token: lark.Token) -> _Node:
    kind, text = token.type, token.value
    if kind == "INT_LIT":
        value = int(text, 16) if "x" in text.lower() else int(text)
        if text.startswith("-0x"):
            value = -int(text[3:], 16)
        if not INT_MIN <= value <= INT_MAX:
            raise _CompileError(f"integer literal out of range: {text}")
        return _const(value, "int")
    if kind == "UINT_LIT":
        body = text[:-1]
        value = int(body, 16) if "x" in body.lower() else int(body)
        if not 0 <= value <= UINT_MAX:
            raise _CompileError(f"uint literal out of range: {text}")
        return _const(UInt(value), "uint")
    if kind == "FLOAT_LIT":
        return _const(float(text), "double")
    if kind in ("STRING_LIT", "MLSTRING_LIT"):
        return _const(_unquote(text), "string")
    if kind == "BYTES_LIT":
        value = _unquote(text)
        return _const(value if isinstance(value, bytes) else value.encode(), "bytes")
    if kind == "BOOL_LIT":
        return _const(text == "true", "bool")
    if kind == "NULL_LIT":
        return _const(None, "null_type")
    raise _CompileError(f"unknown literal {text}")


def _const(value, type_: str) -> _Node:
    def run(env, cost):
        _tick(cost)
        return value
    return _Node(type_, run)


# -- the compiler -----------------------------------------------------------------------------------------
_BINARY_RULES = {"relation_lt": "<", "relation_le": "<=", "relation_gt": ">", "relation_ge": ">=",
                 "relation_eq": "==", "relation_ne": "!=", "relation_in": "in",
                 "addition_add": "+", "addition_sub": "-", "multiplication_mul": "*",
                 "multiplication_div": "/", "multiplication_mod": "%"}
_MACROS = {"all", "exists", "exists_one", "existsOne", "map", "filter", "transformList", "transformMap",
           "transformMapEntry"}


class _Compiler:
    def __init__(self, variables: Mapping[str, str]) -> None:
        self.scopes: list[dict[str, str]] = [dict(variables)]

    def lookup_type(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def compile(self, tree) -> _Node:
        if isinstance(tree, lark.Token):
            return _literal(tree)
        rule = tree.data
        handler = getattr(self, "c_" + rule, None)
        if handler is not None:
            return handler(tree)
        if len(tree.children) == 1:  # expr, conditionalor, ... with a single operand
            return self.compile(tree.children[0])
        raise _CompileError(f"unsupported syntax: {rule}")

    # -- operators
    def c_expr(self, tree) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        cond, yes, no = (self.compile(c) for c in tree.children)
        if cond.type not in (DYN, "bool"):
            raise _CompileError(f"found no matching overload for '_?_:_' applied to '({cond.type}, ...)'")

        def run(env, cost):
            _tick(cost)
            c = cond.run(env, cost)
            if not isinstance(c, bool):
                raise _no_overload("_?_:_", c)
            return yes.run(env, cost) if c else no.run(env, cost)
        return _Node(yes.type if yes.type == no.type else DYN, run)

    def _logical(self, tree, is_or: bool) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        left, right = self.compile(tree.children[0]), self.compile(tree.children[1])
        for side in (left, right):
            if side.type not in (DYN, "bool"):
                raise _CompileError(f"found no matching overload for '{'_||_' if is_or else '_&&_'}' "
                                    f"applied to '({left.type}, {right.type})'")

        def run(env, cost):
            _tick(cost)
            error = None
            for side in (left, right):
                try:
                    value = side.run(env, cost)
                except _EvalError as err:
                    error = error or err
                    continue
                if not isinstance(value, bool):
                    error = error or _no_overload("_||_" if is_or else "_&&_", value)
                    continue
                if value is is_or:
                    return value  # true || x, false && x: decided, errors or not
            if error is not None:
                raise error
            return not is_or
        return _Node("bool", run)

    def c_conditionalor(self, tree) -> _Node:
        return self._logical(tree, True)

    def c_conditionaland(self, tree) -> _Node:
        return self._logical(tree, False)

    def _binary(self, tree) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        op_tree, right_tree = tree.children
        op = _BINARY_RULES[op_tree.data]
        left, right = self.compile(op_tree.children[0]), self.compile(right_tree)
        return _binary_node(op, left, right)

    c_relation = c_addition = c_multiplication = _binary

    def c_unary(self, tree) -> _Node:
        if len(tree.children) == 1:
            return self.compile(tree.children[0])
        op, operand_tree = tree.children
        operand = self.compile(operand_tree)
        if op.data == "unary_not":
            if operand.type not in (DYN, "bool"):
                raise _CompileError(f"found no matching overload for '!_' applied to '({operand.type})'")

            def run_not(env, cost):
                _tick(cost)
                v = operand.run(env, cost)
                if not isinstance(v, bool):
                    raise _no_overload("!_", v)
                return not v
            return _Node("bool", run_not)
        if operand.type not in (DYN, "int", "double"):
            raise _CompileError(f"found no matching overload for '-_' applied to '({operand.type})'")

        def run_neg(env, cost):
            _tick(cost)
            v = operand.run(env, cost)
            if isinstance(v, bool) or isinstance(v, UInt) or not _is_num(v):
                raise _no_overload("-_", v)
            if isinstance(v, int) and v == INT_MIN:
                raise _EvalError("integer overflow")
            return -v
        return _Node(operand.type, run_neg)

    # -- members
    def c_member(self, tree) -> _Node:
        return self.compile(tree.children[0])

    def c_primary(self, tree) -> _Node:
        return self.compile(tree.children[0])

    def c_literal(self, tree) -> _Node:
        return _literal(tree.children[0])

    def c_paren_expr(self, tree) -> _Node:
        return self.compile(tree.children[0])

    def c_ident(self, tree) -> _Node:
        name = tree.children[0].value
        type_ = self.lookup_type(name)
        if type_ is None:
            if name in _TYPE_IDENTS:
                return _const(TypeValue(name), "type")
            raise _CompileError(f"undeclared reference to '{name}'")

        def run(env, cost):
            _tick(cost)
            return env[name]
        return _Node(type_, run, "device" if name == "device" and len(self.scopes) == 1 or (
            name == "device" and all(name not in s for s in self.scopes[1:])) else None)

    def c_list_lit(self, tree) -> _Node:
        items = [self.compile(c) for c in tree.children[0].children] if tree.children and tree.children[0] else []
        known = {i.type for i in items if i.type != DYN}
        if len(known) > 1:
            raise _CompileError(f"expected type '{items[0].type}' but found another: {sorted(known)}")

        def run(env, cost):
            _tick(cost)
            return [i.run(env, cost) for i in items]
        return _Node("list", run)

    def c_map_lit(self, tree) -> _Node:
        inits = tree.children[0].children if tree.children and tree.children[0] else []
        pairs = [(self.compile(inits[i]), self.compile(inits[i + 1])) for i in range(0, len(inits), 2)]

        def run(env, cost):
            _tick(cost)
            out: dict = {}
            for k, v in pairs:
                key = k.run(env, cost)
                if not isinstance(key, (str, int)):
                    raise _EvalError(f"unsupported key type: {_type_name(key)}")
                if _map_get(out, key) is not _MISSING:
                    raise _EvalError(f"Failed with repeated key: {key!r}")
                out[key] = v.run(env, cost)
            return out
        return _Node("map", run)

    def c_member_dot(self, tree) -> _Node:
        target_tree, field = tree.children
        field = field.value
        namespace = self._namespace(target_tree)
        if namespace == "net" and field in ("IP", "CIDR"):
            return _const(TypeValue(f"net.{field}"), "type")
        if namespace is not None:
            raise _CompileError(f"undeclared reference to '{namespace}.{field}'")
        target = self.compile(target_tree)
        if target.type not in (DYN, "map"):
            raise _CompileError(f"type '{target.type}' does not support field selection")
        if target.path == "device" and field not in _DEVICE_FIELDS:
            raise _CompileError(f"undefined field '{field}'")

        def run(env, cost):
            _tick(cost)
            value = target.run(env, cost)
            if not isinstance(value, dict):
                raise _EvalError(f"no such overload: {_type_name(value)}.{field}")
            found = _map_get(value, field)
            if found is _MISSING:
                raise _EvalError(f"no such key: {field}")
            return found
        return _typed(target, field, run)

    def c_member_index(self, tree) -> _Node:
        target, index = self.compile(tree.children[0]), self.compile(tree.children[1])
        if target.type not in (DYN, "map", "list"):
            raise _CompileError(f"found no matching overload for '_[_]' applied to '({target.type}, {index.type})'")

        def run(env, cost):
            _tick(cost)
            value, key = target.run(env, cost), index.run(env, cost)
            if isinstance(value, dict):
                found = _map_get(value, key)
                if found is _MISSING:
                    raise _EvalError(f"no such key: {key}")
                return found
            if isinstance(value, list):
                if isinstance(key, float) and key == int(key):
                    key = int(key)
                if not _is_num(key) or isinstance(key, float):
                    raise _no_overload("_[_]", value, key)
                if not 0 <= key < len(value):
                    raise _EvalError(f"index out of bounds: {key}")
                return value[int(key)]
            raise _no_overload("_[_]", value, key)
        return _typed(target, None, run)

    def c_member_object(self, tree) -> _Node:
        raise _CompileError("message construction is not supported by this environment")

    def c_dot_ident(self, tree) -> _Node:
        return self.c_ident(lark.Tree("ident", [tree.children[0]]))

    def c_dot_ident_arg(self, tree) -> _Node:
        return self.c_ident_arg(tree)

    def _namespace(self, tree) -> str | None:
        """`format` in `format.dns1123Label()`: a function namespace, not a variable."""
        while isinstance(tree, lark.Tree) and tree.data in ("member", "primary") and len(tree.children) == 1:
            tree = tree.children[0]
        if isinstance(tree, lark.Tree) and tree.data == "ident":
            name = tree.children[0].value
            if name in _NAMESPACES and self.lookup_type(name) is None:
                return name
        return None

    def _args(self, tree) -> list:
        exprlist = tree.children[-1] if tree.children else None
        return list(exprlist.children) if isinstance(exprlist, lark.Tree) and exprlist.data == "exprlist" else []

    def c_ident_arg(self, tree) -> _Node:
        name = tree.children[0].value
        args = self._args(tree)
        if name == "has":
            return self._has(args)
        if name == "dyn":
            if len(args) != 1:
                raise _CompileError("found no matching overload for 'dyn'")
            inner = self.compile(args[0])
            return _Node(DYN, inner.run)
        return self._call(name, None, [self.compile(a) for a in args])

    def c_member_dot_arg(self, tree) -> _Node:
        target_tree, method = tree.children[0], tree.children[1].value
        args = self._args(tree)
        namespace = self._namespace(target_tree)
        if namespace == "cel" and method == "bind":
            return self._bind(args)
        if namespace is not None:
            return self._call(f"{namespace}.{method}", None, [self.compile(a) for a in args])
        if method in _MACROS and len(args) in (2, 3, 4) and _is_ident(args[0]):
            return self._macro(method, self.compile(target_tree), args)
        target = self.compile(target_tree)
        return self._call(method, target, [self.compile(a) for a in args])

    # -- macros
    def _has(self, args) -> _Node:
        if len(args) != 1:
            raise _CompileError("invalid argument to has() macro")
        node = args[0]
        while isinstance(node, lark.Tree) and len(node.children) == 1 and node.data != "ident":
            node = node.children[0]
        if not (isinstance(node, lark.Tree) and node.data == "member_dot"):
            raise _CompileError("invalid argument to has() macro")
        target, field = self.compile(node.children[0]), node.children[1].value

        def run(env, cost):
            _tick(cost)
            value = target.run(env, cost)
            if isinstance(value, dict):
                return _map_has(value, field)
            raise _no_overload("has", value)
        return _Node("bool", run)

    def _bind(self, args) -> _Node:
        if len(args) != 3 or not _is_ident(args[0]):
            raise _CompileError("cel.bind() variable name must be a simple identifier")
        name = _ident_name(args[0])
        init = self.compile(args[1])
        self.scopes.append({name: init.type})
        try:
            body = self.compile(args[2])
        finally:
            self.scopes.pop()

        def run(env, cost):
            _tick(cost)
            return body.run({**env, name: init.run(env, cost)}, cost)
        return _Node(body.type, run)

    def _macro(self, method: str, target: _Node, args) -> _Node:
        if target.type not in (DYN, "list", "map"):
            raise _CompileError(f"expression of type '{target.type}' cannot be range of a comprehension "
                                "(must be list, map, or dynamic)")
        if method.startswith("transform"):  # transformList(i, v, [filter,] transform)
            if len(args) not in (3, 4) or not _is_ident(args[1]):
                raise _CompileError(f"{method}() takes two variables, an optional filter and a transform")
            names_ = [_ident_name(args[0]), _ident_name(args[1])]
            filter_tree, body_tree = (args[2], args[3]) if len(args) == 4 else (None, args[2])
        elif len(args) == 4:
            raise _CompileError(f"{method}() takes at most three arguments")
        elif method == "map" and len(args) == 3:  # map(x, filter, transform)
            names_ = [_ident_name(args[0])]
            filter_tree, body_tree = args[1], args[2]
        elif len(args) == 3:  # all(i, v, predicate) and the other two-variable forms
            if not _is_ident(args[1]):
                raise _CompileError(f"{method}() variable names must be simple identifiers")
            names_ = [_ident_name(args[0]), _ident_name(args[1])]
            filter_tree, body_tree = None, args[2]
        else:
            names_ = [_ident_name(args[0])]
            filter_tree, body_tree = None, args[1]
        self.scopes.append({n: DYN for n in names_})
        try:
            body = self.compile(body_tree)
            condition = self.compile(filter_tree) if filter_tree is not None else None
        finally:
            self.scopes.pop()
        if method == "existsOne":
            method = "exists_one"
        if method in ("all", "exists", "exists_one", "filter") and body.type not in (DYN, "bool"):
            raise _CompileError(f"found no matching overload for '{method}' predicate of type {body.type}")

        def items(env, cost):
            value = target.run(env, cost)
            if isinstance(value, list):
                pairs = list(enumerate(value)) if len(names_) == 2 else [(v, None) for v in value]
            elif isinstance(value, dict):
                pairs = list(value.items()) if len(names_) == 2 else [(k, None) for k in value]
            else:
                raise _EvalError(f"got '{_go_type(value)}', expected iterable type")
            for first, second in pairs:
                _tick(cost, 2)
                scope = {**env, names_[0]: first}
                if len(names_) == 2:
                    scope[names_[1]] = second
                yield first if len(names_) == 1 else second, scope

        def truth(v):
            if not isinstance(v, bool):
                raise _no_overload(method, v)
            return v

        if method in ("all", "exists"):
            want = method == "exists"

            def run(env, cost):
                _tick(cost)
                error = None
                for _, scope in items(env, cost):
                    try:
                        if truth(body.run(scope, cost)) is want:
                            return want
                    except _EvalError as err:
                        error = error or err
                if error is not None:
                    raise error
                return not want
            return _Node("bool", run)
        if method == "exists_one":
            def run_one(env, cost):
                _tick(cost)
                return sum(truth(body.run(scope, cost)) for _, scope in items(env, cost)) == 1
            return _Node("bool", run_one)
        if method == "filter":
            def run_filter(env, cost):
                _tick(cost)
                out = []
                for value, scope in items(env, cost):
                    _tick(cost, 4)  # cel-go's step: a conditional and a list concatenation
                    if truth(body.run(scope, cost)):
                        out.append(value)
                return out
            return _Node("list", run_filter)

        def run_map(env, cost):
            _tick(cost)
            out = [] if method in ("map", "transformList") else {}
            for _, scope in items(env, cost):
                _tick(cost, 4)  # cel-go's step: a conditional and a list concatenation
                if condition is not None and not truth(condition.run(scope, cost)):
                    continue
                value = body.run(scope, cost)
                if method == "transformMap":
                    out[scope[names_[0]]] = value
                elif method == "transformMapEntry":
                    if not isinstance(value, dict):
                        raise _no_overload(method, value)
                    for key, entry in value.items():
                        if _map_has(out, key):
                            raise _EvalError(f"insert failed: key {key} already exists")
                        out[key] = entry
                else:
                    out.append(value)
            return out
        return _Node("list" if method in ("map", "transformList") else "map", run_map)

    # -- calls
    def _call(self, name: str, target: _Node | None, args: list[_Node]) -> _Node:
        function = _LIBRARY.get(name)
        if function is None:
            raise _CompileError(f"undeclared reference to '{name}'")
        static = _static_check(name, target, args)
        result_type = static or _KNOWN_RESULT.get(name.rsplit(".", 1)[-1], DYN)
        if name == "optional.of" or name == "optional.none" or name == "optional.ofNonZeroValue":
            result_type = "optional_type"
        if name.startswith("format."):
            result_type = "format" if name != "format.named" else "optional_type"
        receiver = target is not None

        def run(env, cost):
            _tick(cost)
            values = ([target.run(env, cost)] if receiver else []) + [a.run(env, cost) for a in args]
            try:
                return function(receiver, cost, *values)
            except (_EvalError, _CostExceeded):
                raise
            except _NoOverload:
                raise _EvalError(f"found no matching overload for '{name}' applied to "
                                 f"'({', '.join(_type_name(v) for v in values)})'") from None
            except RecursionError:
                raise _EvalError("expression too deeply nested") from None
            except (TypeError, ValueError, ArithmeticError, KeyError, IndexError, AttributeError,
                    OverflowError, re.error, UnicodeError) as err:
                raise _EvalError(str(err) or type(err).__name__) from None
        return _Node(result_type, run)


def _is_ident(tree) -> bool:
    return _ident_name(tree) is not None


def _ident_name(tree) -> str | None:
    while isinstance(tree, lark.Tree) and len(tree.children) == 1 and tree.data != "ident":
        tree = tree.children[0]
    if isinstance(tree, lark.Tree) and tree.data == "ident":
        return tree.children[0].value
    return None


def _go_type(value) -> str:
    return {"bool": "types.Bool", "int": "types.Int", "uint": "types.Uint", "double": "types.Double",
            "string": "types.String", "bytes": "types.Bytes", "semver": "cel.Semver",
            "quantity": "cel.Quantity", "null_type": "types.Null"}.get(_type_name(value), _type_name(value))


_DEVICE_FIELDS = {"driver": ("string", None), "allowMultipleAllocations": ("bool", None),
                  "attributes": ("map", "attributes"), "capacity": ("map", "capacity")}


def _typed(target: _Node, field: str | None, run) -> _Node:
    """The static type of a field or index of `target`."""
    if target.path == "device" and field is not None:
        type_, path = _DEVICE_FIELDS[field]
        return _Node(type_, run, path)
    if target.path == "device":  # device["driver"]: not on a declared object
        return _Node(DYN, run)
    if target.path == "attributes":
        return _Node("map", run, "attribute-domain")
    if target.path == "capacity":
        return _Node("map", run, "capacity-domain")
    if target.path == "capacity-domain":
        return _Node("quantity", run)
    return _Node(DYN, run)


def _static_check(name: str, target: _Node | None, args: list[_Node]) -> str | None:
    """The type errors that the Kubernetes type checker reports for calls whose argument
    types are known here; the result type where it depends on them."""
    types_ = ([target.type] if target else []) + [a.type for a in args]
    if name in ("compareTo", "isGreaterThan", "isLessThan") and target is not None:
        kinds = {t for t in types_ if t != DYN}
        if len(kinds) > 1 or kinds - {"quantity", "semver"}:
            raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name in ("isQuantity", "quantity", "isSemver", "semver") and args and args[0].type not in (DYN, "string"):
        raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name in ("asInteger", "asApproximateFloat", "isInteger", "sign") and target is not None and \
            target.type not in (DYN, "quantity"):
        raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name in ("add", "sub") and target is not None and target.type not in (DYN, "quantity"):
        raise _CompileError(f"found no matching overload for '{name}' applied to '({', '.join(types_)})'")
    if name == "size" and types_ and types_[0] not in (DYN, "string", "bytes", "list", "map"):
        raise _CompileError(f"found no matching overload for 'size' applied to '({', '.join(types_)})'")
    if name in ("sum", "min", "max") and target is not None:
        return DYN
    return None


def _binary_node(op: str, left: _Node, right: _Node) -> _Node:
    name = {"==": "_==_", "!=": "_!=_", "<": "_<_", "<=": "_<=_", ">": "_>_", ">=": "_>=_", "in": "@in",
            "+": "_+_", "-": "_-_", "*": "_*_", "/": "_/_", "%": "_%_"}[op]
    lt, rt = left.type, right.type
    if op in ("==", "!="):
        if not (lt in _NUMERIC and rt in _NUMERIC and lt == rt):
            _check_same(name, left, right)
    elif op in ("<", "<=", ">", ">="):
        if {"quantity", "semver"} & {lt, rt} or (
                DYN not in (lt, rt) and lt != rt and not (lt in _NUMERIC and rt in _NUMERIC)) or \
                {lt, rt} & {"list", "map", "null_type", "type", "optional_type", "format"}:
            raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
    elif op == "in":
        if rt not in (DYN, "list", "map"):
            raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
    else:
        if DYN not in (lt, rt) and lt != rt:
            raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
        allowed = {"+": {"int", "uint", "double", "string", "bytes", "list"},
                   "-": _NUMERIC, "*": _NUMERIC, "/": _NUMERIC, "%": {"int", "uint"}}[op]
        for t in (lt, rt):
            if t != DYN and t not in allowed:
                raise _CompileError(f"found no matching overload for '{name}' applied to '({lt}, {rt})'")
    result = "bool" if op in ("==", "!=", "<", "<=", ">", ">=", "in") else (lt if lt == rt else DYN)

    def run(env, cost):
        _tick(cost)
        a, b = left.run(env, cost), right.run(env, cost)
        return _apply(op, a, b, cost)
    return _Node(result, run)
