"""The stubs of the native module (python-bindings/python/statekit/_native.pyi) name exactly
what `statekit._native` exports: every top-level name, and every public member of each class,
both ways. A function added to the module without its stub, or a stub left behind by a removed
one, fails here."""

import ast
from pathlib import Path

import pytest

import statekit._native as native

STUB = Path(__file__).resolve().parents[3] / "python-bindings" / "python" / "statekit" / "_native.pyi"


def stub_names():
    """Top-level names of the stub, and for each class the members it declares."""
    tree = ast.parse(STUB.read_text())
    top, classes = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef)
            } | {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return top, classes


def public(names):
    return {n for n in names if not n.startswith("_")}


def test_the_stubs_name_every_export_of_the_module_and_nothing_else():
    top, _ = stub_names()
    exported = public(dir(native)) | ({"__version__"} & set(dir(native)))
    assert top == exported, f"only in the stubs: {sorted(top - exported)}; only in the module: {sorted(exported - top)}"


@pytest.mark.parametrize("cls", sorted(stub_names()[1]))
def test_each_class_stub_declares_its_members(cls):
    declared = stub_names()[1][cls]
    members = public(dir(getattr(native, cls)))
    assert public(declared) == members, (
        f"{cls}: only in the stubs: {sorted(public(declared) - members)}; only in the module: {sorted(members - public(declared))}"
    )
    # The special methods the stub declares exist (`__init__` is every class's; `__len__` is not).
    for name in declared - public(declared):
        assert hasattr(getattr(native, cls), name), f"{cls}.{name}"
