"""Pickle a user's function by value so that it runs on a worker as it runs here.

cloudpickle, as it is, falls short for code shipped from a user's file in two ways:

- A module object of a ``ModuleType`` subclass (a lazy module: ``optuna.integration``,
  ``six.moves``, transformers' ``_LazyModule``) among a function's globals, or among the
  submodules its code names, cannot be pickled at all (cloudpipe/cloudpickle#397):
  ``TypeError: cannot pickle '_IntegrationModule' object``. Here a module of any type travels
  by reference, as cloudpickle sends plain modules: the worker imports it by name. Only a
  module that cannot be imported by name (not in ``sys.modules``, or registered to go by
  value) goes by value, its attributes in a plain module, as cloudpickle does for those.
- Code keeps no file name (cloudpickle writes ``<dynamic-code>`` for deterministic payloads),
  so a warning or a traceback from shipped code points at ``<dynamic-code>:LINE``. Here each
  code object takes its file name along.
"""

from __future__ import annotations

import importlib
import io
import sys
import types
from typing import Any

import cloudpickle

_BY_CLOUDPICKLE: Any = cloudpickle.Pickler.dispatch_table


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)`` with modules of any type by reference and code's file names
    kept; the result loads with ``cloudpickle.loads`` (or ``pickle.loads``)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return _reduce_module(obj)
        if isinstance(obj, types.CodeType):
            rebuild, args = _BY_CLOUDPICKLE[types.CodeType](obj)
            return code_in_file, (rebuild, args, obj.co_filename)
        return super().reducer_override(obj)


def _reduce_module(module: types.ModuleType) -> Any:
    name = module.__name__
    by_value = set(cloudpickle.list_registry_pickle_by_value())
    parts = name.split(".")
    registered = any(".".join(parts[:i]) in by_value for i in range(1, len(parts) + 1))
    if sys.modules.get(name) is module and not registered:
        return importlib.import_module, (name,)
    state = {k: v for k, v in vars(module).items() if k != "__builtins__"}
    return types.ModuleType, (name,), state


def code_in_file(rebuild: Any, args: tuple[Any, ...], filename: str) -> types.CodeType:
    """Worker side: the code object cloudpickle rebuilds, under its own file name again."""
    code: types.CodeType = rebuild(*args)
    return code.replace(co_filename=filename)
