"""The ``calculator`` tool: arithmetic on ints and floats, parsed with :mod:`ast` and evaluated by
walking the tree (never ``eval``), so no name, call or attribute can run.

Bounds keep every call cheap and in-process: an expression of at most ``MAX_CHARS`` characters,
a power computed only when its result has at most ``MAX_DIGITS`` digits (estimated from the
logarithms before computing), and every intermediate result at most ``10**MAX_DIGITS`` in size.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 500
MAX_DIGITS = 100

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the policy."""


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (ints exact, floats by ``repr``)."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not an arithmetic expression") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
    except OverflowError:
        raise CalculatorError(f"result larger than 1e{MAX_DIGITS}") from None
    return repr(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % ** and "
                          "parentheses only)")


def _check_power(base, exponent) -> None:
    """Refuse before computing a power whose result would exceed ``MAX_DIGITS`` digits (or be
    complex): ``9 ** 9 ** 9`` costs a logarithm, not minutes."""
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if base in (0, 1, -1) or exponent == 0:
        return
    if exponent * math.log10(abs(base)) > MAX_DIGITS:  # log10 of the result
        raise OverflowError


def _bounded(value):
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError
    if abs(value) >= 10 ** MAX_DIGITS:
        raise OverflowError
    return value
