"""Generate the torch-shaped mirror (`jb.cuda.enable_flash_sdp`, `jb.cudnn.deterministic = True`, ...).

Each `Flag` in `flag_declarations.DECLARATIONS` lists where torch spells it (`Flag.mirrors`). A mirror module calls
`install(module)` once at its end; this turns every declaration naming that module into a function or a
property. Properties need a class: the module's `__class__` becomes a generated `ModuleType` subclass (the
module object itself stays in `sys.modules`; nothing is swapped). Nested names such as `cuda.matmul`
become small objects with generated properties.
"""

from __future__ import annotations

import types
from typing import Any

from jbackends._src import flag_declarations as _flag_declarations
from jbackends._src import flag_scope as _flag_scope
from jbackends._src import flag_state as _flag_state


def _getter(flag: _flag_declarations.Flag):
    def get() -> Any:
        return getattr(_flag_state.current_flags(), flag.name)

    get.__name__ = f"get_{flag.name}"
    get.__doc__ = f"Return `{flag.name}` in force here. {flag.help}"
    return get


def _setter(flag: _flag_declarations.Flag):
    def set_(value: Any) -> None:
        _flag_scope.set_flags(**{flag.name: value})

    set_.__name__ = f"set_{flag.name}"
    set_.__doc__ = f"Set the process default of `{flag.name}` (torch semantics). {flag.help}"
    return set_


def _getset(flag: _flag_declarations.Flag):
    def getset(backend: Any = None) -> Any:
        if backend is not None:
            _flag_scope.set_flags(**{flag.name: backend})
        return getattr(_flag_state.current_flags(), flag.name)

    getset.__name__ = flag.name
    getset.__doc__ = (
        f"Return `{flag.name}` in force here; with an argument, first set its process default "
        f"(torch's getter-and-setter in one). {flag.help} Scoped form: "
        f"`jb.with_backends({flag.name}=...)`."
    )
    return getset


_FUNCTION_KINDS = {"setter": _setter, "getter": _getter, "getset": _getset}


def _guarded_setattr(valid: tuple[str, ...]):
    """`__setattr__` refusing new public names: `jb.cudnn.determinstic = True` must not pass silently."""

    def __setattr__(self, name: str, value: Any) -> None:
        cls_attr = getattr(type(self), name, None)
        if name.startswith("_") or name in self.__dict__ or isinstance(cls_attr, property):
            return types.ModuleType.__setattr__(self, name, value)
        raise AttributeError(
            f"module {self.__name__!r} has no attribute {name!r} to set; its flag attributes are "
            f"{list(valid)} (see jb.with_backends for every flag)"
        )

    return __setattr__


def _property(flag: _flag_declarations.Flag) -> property:
    return property(
        lambda self: getattr(_flag_state.current_flags(), flag.name),
        lambda self, value: _flag_scope.set_flags(**{flag.name: value}),
        doc=f"{flag.help} Reading gives the value in force; assigning sets the process default.",
    )


def _namespace(path: str, props: dict[str, property]) -> Any:
    cls = type(
        f"{path.replace('.', '_')}_flags",
        (),
        {"__slots__": (), **props, "__repr__": lambda self: _repr(path, props)},
    )
    return cls()


def _repr(path: str, props: dict[str, property]) -> str:
    return (
        f"<jbackends.{path}: "
        + ", ".join(f"{name}={prop.fget(None)!r}" for name, prop in props.items())
        + ">"
    )


def install(module: types.ModuleType) -> None:
    """Add the generated functions and properties that the registry declares for `module`."""
    path = module.__name__.removeprefix("jbackends").removeprefix(".")
    module_props: dict[str, property] = {}
    nested: dict[str, dict[str, property]] = {}
    for flag in _flag_declarations.FLAGS.values():
        for where, kind, name in flag.mirrors:
            if kind in _FUNCTION_KINDS and where == path:
                setattr(module, name, _FUNCTION_KINDS[kind](flag))
            elif kind == "attr" and where == path:
                module_props[name] = _property(flag)
            elif kind == "attr" and path and where.startswith(path + "."):
                nested.setdefault(where[len(path) + 1 :], {})[name] = _property(flag)
    for sub, props in nested.items():
        setattr(module, sub, _namespace(f"{path}.{sub}", props))
    if module_props:
        base = type(module)
        module.__class__ = type(
            f"{path}_module", (base,), {**module_props, "__setattr__": _guarded_setattr(tuple(module_props))}
        )


def names(path: str) -> list[str]:
    """The mirror names declared for a module path (for docs and the environment report)."""
    return [name for f in _flag_declarations.FLAGS.values() for where, _, name in f.mirrors if where == path]
