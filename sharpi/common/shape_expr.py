"""Shape expressions in artifacts: integer arithmetic over symbolic dimension names (e.g. "((n + 31) // 32)"),
written by codegen from TIR expressions and evaluated by the runtime. Evaluated by walking the AST, so an
artifact's expressions can never run arbitrary code."""
from __future__ import annotations

import ast
import operator

from .errors import ArtifactError

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.RShift: operator.rshift, ast.LShift: operator.lshift}
_CALLS = {"min": min, "max": max}


def evaluate(expr: str, env: dict[str, int]) -> int:
    try:
        return int(_eval(ast.parse(expr, mode="eval").body, env))
    except (SyntaxError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise ArtifactError(f"Bad shape expression {expr!r} in the artifact: {exc!r}.") from None


def _eval(node, env):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
        return _CALLS[node.func.id](*(_eval(a, env) for a in node.args))
    raise TypeError(f"unsupported syntax {ast.dump(node)}")
