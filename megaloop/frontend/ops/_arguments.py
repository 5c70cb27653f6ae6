"""What ``_guard`` says when a builder fails in a way its rules did not anticipate: the argument whose
value does not fit the builder's type annotation, and the type it asks for."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from megaloop.dtypes import DType
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.validate import is_int

_UNKNOWN = object()  # an annotation this module cannot judge: never blamed


def argument_error(name: str, fn: Callable[..., Any], signature: inspect.Signature, bound: Any, e: Exception) -> str:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve at run time: judge none
        hints = {}
    for param, value in bound.arguments.items():
        hint = hints.get(param)
        kind = signature.parameters[param].kind
        if hint is None or kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if _matches(value, hint) is False:
            return f"{name}: {param} must be {_describe(hint)}, got {type(value).__name__} {value!r:.60}"
    given = ", ".join(f"{k}={type(v).__name__}" for k, v in bound.arguments.items())
    return (
        f"{name}: these arguments ({given}) could not be used ({type(e).__name__}: {e}); "
        f"megaloop.{name} takes {name}{signature} (see help(megaloop.{name}))"
    )


def _matches(value: Any, hint: Any) -> bool | object:
    """Whether ``value`` fits ``hint``; ``_UNKNOWN`` where this module cannot tell."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_matches(value, a) for a in args]
        return True if True in verdicts else (_UNKNOWN if _UNKNOWN in verdicts else False)
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_int(value) or (isinstance(value, (float, np.floating)) and not isinstance(value, bool))
    if hint is bool:
        return isinstance(value, (bool, np.bool_))
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence, typing.Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args else Any
        verdicts = [_matches(v, item) for v in value]
        return False if False in verdicts else True
    if origin in (dict, Mapping, typing.Mapping) or hint in (dict, Mapping):
        return isinstance(value, Mapping)
    if isinstance(hint, type) and hint in (Tensor, DType):
        return isinstance(value, hint)
    return _UNKNOWN


def _describe(hint: Any) -> str:
    names = {int: "an int", float: "a number", bool: "True or False", str: "a string", Tensor: "a megaloop Tensor"}
    if hint is None or hint is type(None):
        return "None"
    if hint is Any:
        return "anything"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (list, tuple, Sequence, typing.Sequence):
        return f"a list or tuple of {_plural(args[0])}" if args else "a list or tuple"
    if origin in (dict, Mapping, typing.Mapping):
        return "a dict"
    if hint is DType:
        return "a megaloop dtype"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _plural(hint: Any) -> str:
    names = {int: "ints", float: "numbers", bool: "bools", str: "strings", Tensor: "megaloop Tensors"}
    if hint is None or hint is type(None):
        return "None"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_plural(a) for a in typing.get_args(hint))
    return names.get(hint, "values")
