"""Forward hooks that copies of a model do not carry (``copy.deepcopy``, ``pickle``, ``torch.save``).

``copy.deepcopy(model)`` copies every module's ``_forward_hooks``, so an EMA or teacher copy, or
``torch.optim.swa_utils.AveragedModel`` (a deepcopy), would call BNP's hooks and feed the *original*
preconditioner's statistics; and a hook that is a closure cannot be pickled at all. A hook registered
through :func:`register_forward_hook` is a :class:`CopySafeHook`: a copy of its module gets
:func:`inert_hook` in its place, which does nothing, and which the next :func:`register_forward_hook`
on that module removes. A preconditioner copied or unpickled *together with* its model re-registers
its own hooks on the copied modules (``BNPPreconditioner.__setstate__``), so the pair goes on as the
original would; a model copied alone is a plain model that ``BNPPreconditioner(copy)`` can manage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["CopySafeHook", "inert_hook", "register_forward_hook", "register_forward_pre_hook"]


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a copied module has in place of a :class:`CopySafeHook`: nothing."""


def _inert() -> Callable[..., None]:
    return inert_hook


class CopySafeHook:
    """A forward hook whose copies (``copy.deepcopy``, ``pickle``) are :func:`inert_hook`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _inert, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return inert_hook

    def __copy__(self) -> CopySafeHook:
        return self


class _ForwardHook(CopySafeHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:  # fixed arity: cheaper than *args
        return self.fn(module, args, output)


class _ForwardPreHook(CopySafeHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any) -> Any:
        return self.fn(module, args)


class _ForwardHookWithKwargs(CopySafeHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return self.fn(module, args, kwargs, output)


def register_forward_hook(
    module: nn.Module, fn: Callable[..., Any], *, with_kwargs: bool = False, **kwargs: Any
) -> RemovableHandle:
    """``module.register_forward_hook(CopySafeHook(fn), ...)``, after removing the inert hooks that a
    copy of the module carries in place of the original's."""
    stale = [key for key, hook in module._forward_hooks.items() if hook is inert_hook]
    for key in stale:
        del module._forward_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)
    hook = _ForwardHookWithKwargs(fn) if with_kwargs else _ForwardHook(fn)
    return module.register_forward_hook(hook, with_kwargs=with_kwargs, **kwargs)


def register_forward_pre_hook(module: nn.Module, fn: Callable[..., Any]) -> RemovableHandle:
    """``module.register_forward_pre_hook(CopySafeHook(fn))``, after removing the inert pre-hooks that a copy
    of the module carries in place of the original's."""
    stale = [key for key, hook in module._forward_pre_hooks.items() if hook is inert_hook]
    for key in stale:
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    return module.register_forward_pre_hook(_ForwardPreHook(fn))
