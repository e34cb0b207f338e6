"""CEL syntax: parsing through cel-python's lark parser (one cached parser for the process),
cel-go's layout for syntax errors (position, the line and a caret), and unquoting of string
and bytes literals with CEL's escapes."""

from __future__ import annotations

import celpy

from driver.scheduling.cel.errors import _CompileError

# -- literals ---------------------------------------------------------------------------------------------
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            '"': '"', "'": "'", "\\": "\\", "?": "?", "`": "`"}


def _unquote(token: str) -> str | bytes:
    is_bytes = token[:1] in "bB"
    if is_bytes:
        token = token[1:]
    raw = token[:1] in "rR"
    if raw:
        token = token[1:]
    quote = token[:3] if token[:3] in ('"""', "'''") else token[:1]
    body = token[len(quote):-len(quote)]
    if raw:
        return body.encode() if is_bytes else body
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        if n in _ESCAPES:
            out.append(_ESCAPES[n])
            i += 2
        elif n in "xX":
            out.append(chr(int(body[i + 2:i + 4], 16)))
            i += 4
        elif n == "u":
            out.append(chr(int(body[i + 2:i + 6], 16)))
            i += 6
        elif n == "U":
            out.append(chr(int(body[i + 2:i + 10], 16)))
            i += 10
        elif n in "01234567":
            out.append(chr(int(body[i + 1:i + 4], 8)))
            i += 4
        else:
            raise _CompileError(f"invalid escape sequence \\{n}")
    text = "".join(out)
    return text.encode("latin-1" if any(ord(c) > 127 for c in text) and all(ord(c) < 256 for c in text)
                       else "utf-8") if is_bytes else text


# -- entry points -----------------------------------------------------------------------------------------
_PARSER = None


def _parse(expression: str):
    global _PARSER
    if _PARSER is None:
        _PARSER = celpy.Environment()
    return _PARSER.compile(expression)


def _syntax_error(expression: str, err) -> str:
    """cel-go's layout (what the API server prints): the position, then the line with a
    caret under it, so that a user sees where; celpy knows the position, not the words
    ANTLR would have used for what it expected."""
    line, column = getattr(err, "line", None), getattr(err, "column", None)
    if not isinstance(line, int) or not isinstance(column, int):
        return f"compilation failed: ERROR: <input>: Syntax error: {' '.join(str(err).split())}"
    lines = expression.split("\n")
    text = lines[line - 1] if 0 < line <= len(lines) else expression
    return (f"compilation failed: ERROR: <input>:{line}:{column + 1}: Syntax error: unexpected input\n"
            f" | {text}\n | {'.' * column}^")
