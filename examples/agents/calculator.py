"""The calculator the example agents give their models as a tool: arithmetic only, never `eval`."""

from __future__ import annotations

import ast
import operator

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / and parentheses; ValueError for anything else."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return value(ast.parse(expression, mode="eval").body)


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression (numbers, + - * / and parentheses) and returns its value."""
    try:
        return f"{evaluate(expression):g}"
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"
