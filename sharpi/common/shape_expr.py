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
_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.Eq: operator.eq, ast.NotEq: operator.ne}


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
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        return _COMPARE[type(node.ops[0])](_eval(node.left, env), _eval(node.comparators[0], env))
    if isinstance(node, ast.IfExp):
        return _eval(node.body, env) if _eval(node.test, env) else _eval(node.orelse, env)
    if isinstance(node, ast.BoolOp):
        values = [_eval(v, env) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _eval(node.operand, env)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
        return _CALLS[node.func.id](*(_eval(a, env) for a in node.args))
    raise TypeError(f"unsupported syntax {ast.dump(node)}")
