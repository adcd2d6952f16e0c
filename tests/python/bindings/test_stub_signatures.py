"""The stubs of the native module (python-bindings/python/statekit/_native.pyi) declare each
function and method with the signature the compiled module has, not only its name
(test_bindings_api.py checks the names): the parameters in order, each one's name and kind
(positional-only, positional or keyword, `*args`, keyword-only, `**kwargs`) and whether it has a
default, against the `__text_signature__` pyo3 writes for it. A class's `__init__` stub is
compared with the class's own signature (pyo3's `#[new]`). Annotations are not compared: the
native signatures carry none."""

import ast
import inspect
from pathlib import Path

import pytest

import statekit._native as native

STUB = Path(__file__).resolve().parents[3] / "python-bindings" / "python" / "statekit" / "_native.pyi"

P = inspect.Parameter


def stub_functions():
    """`(class name or None, function node)` for every function the stub declares, properties
    left out (they have no call signature)."""
    tree = ast.parse(STUB.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out.append((None, node))
        elif isinstance(node, ast.ClassDef):
            for n in node.body:
                if isinstance(n, ast.FunctionDef) and "property" not in decorators(n):
                    out.append((node.name, n))
    return out


def decorators(fn):
    return {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}


def stub_params(cls, fn):
    """`(name, kind, has default)` of each parameter the stub gives `fn`, without a method's
    `self`."""
    a = fn.args
    positional = [(p, P.POSITIONAL_ONLY) for p in a.posonlyargs] + [(p, P.POSITIONAL_OR_KEYWORD) for p in a.args]
    first_default = len(positional) - len(a.defaults)
    out = [(p.arg, kind, i >= first_default) for i, (p, kind) in enumerate(positional)]
    if a.vararg:
        out.append((a.vararg.arg, P.VAR_POSITIONAL, False))
    out += [(p.arg, P.KEYWORD_ONLY, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append((a.kwarg.arg, P.VAR_KEYWORD, False))
    if cls is not None and "staticmethod" not in decorators(fn):
        assert out and out[0][0] == "self", f"{cls}.{fn.name}: a method's first parameter is `self`"
        out = out[1:]
    return out


def native_params(cls, fn):
    """The same, from the compiled function's signature (a method's `$self` left out)."""
    if cls is None:
        obj = getattr(native, fn.name)
    elif fn.name == "__init__":
        obj = getattr(native, cls)
    else:
        obj = getattr(getattr(native, cls), fn.name)
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    # `inspect.signature` already binds a class's first parameter; a method descriptor's
    # `$self` comes back as a positional-only `self`.
    if cls is not None and fn.name != "__init__" and "staticmethod" not in decorators(fn):
        assert params and params[0].name == "self", f"{cls}.{fn.name}: {sig}"
        params = params[1:]
    return [(p.name, p.kind, p.default is not P.empty) for p in params]


def label(item):
    cls, fn = item
    return f"{cls}.{fn.name}" if cls else fn.name


FUNCTIONS = stub_functions()


def test_the_stub_declares_functions_and_methods():
    assert any(cls is None for cls, _ in FUNCTIONS)
    assert any(cls is not None and fn.name == "__init__" for cls, fn in FUNCTIONS)


@pytest.mark.parametrize("item", FUNCTIONS, ids=label)
def test_each_stub_has_the_native_signature(item):
    cls, fn = item
    stub, real = stub_params(cls, fn), native_params(cls, fn)
    assert stub == real, f"{label(item)}: the stub says {stub}, the module {real}"
