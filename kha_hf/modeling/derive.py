"""Each family's knocked attention, derived from the family's own transformers code when first needed.

The only change KHA makes to a family is one call: wherever the family's attention calls a projection of the
layout (`self.q_proj(x)`, `self.qkv_proj(x)`, `self.kv_b_proj(...)`), the result passes through
`self._kha_knock("q_proj", ...)`. Everything around it (q/k norms of any shape, RoPE or none, soft-capping, sinks,
windows, scaling, output gates, MLA's latent cache) is the family's own code, unchanged.

Design note: why derived at run time, not generated files. transformers' answer to "many families, one change" is
its modular files (`modular_*.py` expanded into checked-in `modeling_*.py`). Here the derived code must run on
whatever transformers the loading process has: kha-hf's own range, and the older releases vLLM pins (its
Transformers backend runs this file as remote code). A forward generated from one release carries that release's
conventions into the others (the decoder layers' cache keyword changed from `past_key_values` to `cache` in 5.x,
attention interfaces gained arguments); derived at run time, it is always the installed release's own code. It
also keeps this remote-code set to a few short files. What guards it: the derivation must find a call of every
projection of the layout that the module has (`_kha_called`), a method that uses `super()` without arguments is
refused, and the projection sizes must match the layout (`modeling_kha.KnockedAttention`).

How: the method's source (`inspect.getsource`) is parsed, the calls rewritten (an `ast.NodeTransformer`), the
result compiled and given the original function's globals (the family module's namespace, so its helpers resolve as
in the original) and the original decorators; the rewritten source is registered with `linecache`, so tracebacks,
`inspect` and torch.compile show it.

This file is copied next to saved checkpoints (remote code): it may import only torch, transformers and siblings.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
import types
from collections.abc import Callable
from typing import Any

KNOCK_METHOD = "_kha_knock"


class _KnockCalls(ast.NodeTransformer):
    """`self.P(args)` -> `self._kha_knock("P", self.P(args))` for every projection P of the layout."""

    def __init__(self, projections: set[str]) -> None:
        self.projections = projections
        self.found: set[str] = set()

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)  # inner calls first: self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
            and func.attr in self.projections
        ):
            self.found.add(func.attr)
            knock = ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()), attr=KNOCK_METHOD, ctx=ast.Load())
            return ast.Call(func=knock, args=[ast.Constant(func.attr), node], keywords=[])
        return node


def _uses_bare_super(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "super" and not n.args
        for n in ast.walk(tree)
    )


def _derive_function(func: Callable, qualname: str, projections: set[str]) -> tuple[Callable, set[str]] | None:
    """FUNC with its projection calls knocked, or None when it calls none of them."""
    original = inspect.unwrap(func)
    try:
        source = textwrap.dedent(inspect.getsource(original))
    except (OSError, TypeError) as err:
        raise TypeError(f"cannot read the source of {qualname} to add knocks: {err}") from err
    tree = ast.parse(source)
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef):
        raise TypeError(f"{qualname} is not a plain function definition")
    calls = _KnockCalls(projections)
    definition.body = [calls.visit(statement) for statement in definition.body]
    if not calls.found:
        return None
    if _uses_bare_super(definition):
        raise TypeError(f"{qualname} calls super() without arguments, which derived code cannot do")
    decorators, definition.decorator_list = definition.decorator_list, []
    ast.fix_missing_locations(tree)
    text = ast.unparse(tree)
    filename = f"<kha: {qualname} with knocks, derived from {inspect.getsourcefile(original)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    scratch: dict[str, Any] = {}  # the def binds here; the function's globals are the family module's own
    exec(compile(text, filename, "exec"), original.__globals__, scratch)
    derived = scratch[definition.name]
    derived.__qualname__ = qualname
    derived.__doc__ = original.__doc__
    derived.__module__ = original.__module__
    for decorator in reversed(decorators):  # the family's own decorators, evaluated in its own namespace
        derived = eval(compile(ast.Expression(decorator), filename, "eval"), original.__globals__)(derived)
    return derived, calls.found


def derive_knocked_methods(attention_class: type, projections: set[str]) -> tuple[dict[str, Callable], set[str]]:
    """{method name: knocked method} for every method of ATTENTION_CLASS (and its transformers bases) that calls a
    projection in PROJECTIONS, and the set of projections found called."""
    methods: dict[str, Callable] = {}
    for klass in reversed(attention_class.__mro__):  # subclasses override their bases
        if not klass.__module__.startswith("transformers."):
            continue
        for name, value in vars(klass).items():
            if inspect.isfunction(value):
                methods[name] = value
    derived: dict[str, Callable] = {}
    found: set[str] = set()
    for name, func in methods.items():
        result = _derive_function(func, f"{attention_class.__name__}.{name}", projections)
        if result is not None:
            derived[name], called = result
            found |= called
    return derived, found


def find_attention_class(module: types.ModuleType, projections: set[str]) -> type:
    """The attention class of a family's modeling MODULE: the one `...Attention` module class whose methods call
    a projection of the layout."""
    import torch

    candidates = [
        obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, torch.nn.Module)
        and obj.__module__ == module.__name__
        and name.endswith("Attention")
    ]
    calling = [c for c in candidates if _calls_any(c, projections)]
    if len(calling) > 1:  # a multimodal family's module (llama4) also holds its vision tower's attention
        calling = [c for c in calling if "Vision" not in c.__name__] or calling
    if len(calling) != 1:
        names = ", ".join(c.__name__ for c in calling) or "none"
        raise TypeError(
            f"{module.__name__} has {len(calling)} attention classes that call {', '.join(sorted(projections))} "
            f"({names}); KHA needs exactly one"
        )
    return calling[0]


def _calls_any(klass: type, projections: set[str]) -> bool:
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return False
    return any(f"self.{p}(" in source for p in projections)
