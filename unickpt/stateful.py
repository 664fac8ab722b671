"""Stateful objects in a state dict, as torch.distributed.checkpoint accepts them.

A top-level value of the state dict given to :func:`unickpt.save` or :func:`unickpt.load`
may be an ``nn.Module``, an optimizer, an LR scheduler or any object with ``state_dict()``
and ``load_state_dict()`` (DCP's ``Stateful`` protocol). unickpt calls them:

* **save**: the value is replaced by its state dict. Modules and optimizers go through
  ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
  ``get_optimizer_state_dict``), so FSDP2 (``fully_shard``) and TP (``parallelize_module``)
  models give their sharded DTensors and optimizer state is keyed by parameter name
  (``state.<fqn>.exp_avg``), exactly as DCP users store it: the same checkpoint loads through
  ``dcp.load`` and through :func:`unickpt.load` with the state dicts ``get_state_dict`` makes.
  An optimizer is matched to the module of the same state dict that holds its parameters;
  without one, its plain ``state_dict()`` (parameters numbered) is used.
* **load**: the targets come from the same functions, after optimizer state that does not
  exist yet has been created (as ``set_state_dict`` does: one step with zero gradients and
  learning rate 0), so a fresh optimizer receives its moments, step and param groups.
  After the tensors are read, every object's ``load_state_dict`` is called with what was
  loaded: modules first, then optimizers, then the rest, in state-dict order.

Only top-level values are resolved (as in DCP); nested objects are refused by the state
dict checks like any other non-tensor, non-JSON value.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable

import torch

from .state import PerRank, is_stateful  # noqa: F401 (is_stateful: re-exported)

__all__ = ["is_stateful", "for_save", "for_load"]

_WRAPPERS = {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def _modules(state_dict: Mapping[str, Any]) -> list[torch.nn.Module]:
    return [v for v in state_dict.values() if isinstance(v, torch.nn.Module)]


def _owner(opt: torch.optim.Optimizer, modules: list[torch.nn.Module]) -> torch.nn.Module | None:
    """The module of the state dict that holds every parameter of ``opt``."""
    want = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in modules:
        if want <= {id(p) for p in m.parameters()}:
            return m
    return None


def _fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _empty_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What ``get_optimizer_state_dict`` gives for an optimizer without state, without
    creating that state (which would change the optimizer being saved)."""
    names = {id(p): _fqn(n) for n, p in model.named_parameters()}
    groups = []
    for g in opt.state_dict()["param_groups"]:
        groups.append(dict(g))
    for g, live in zip(groups, opt.param_groups):
        g["params"] = [names[id(p)] for p in live["params"]]
    return {"state": {}, "param_groups": groups}


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has none, changing no parameter: one step with
    zero gradients and learning rate 0 (what ``set_state_dict`` does before loading)."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    made = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            made.append(p)
    lrs = []
    for g in opt.param_groups:
        lr = g.get("lr")
        lrs.append(lr)
        if isinstance(lr, torch.Tensor):
            g["lr"] = torch.zeros_like(lr)
        elif lr is not None:
            g["lr"] = 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p in made:
            p.grad = None


def _unwrap(value: Any) -> Any:
    """A stateful object's loaded state dict with each :func:`~unickpt.per_rank` wrapper its
    ``state_dict()`` returned replaced by the value (what it put in is what it gets back)."""

    if isinstance(value, PerRank):
        return value.value
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value


def for_save(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with every top-level stateful object replaced by its state dict (the
    same mapping when there is none)."""
    if not isinstance(state_dict, Mapping) or not any(is_stateful(v) or _stateful_per_rank(v) for v in state_dict.values()):
        return state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict


    modules = _modules(state_dict)
    out: dict[str, Any] = {}
    for k, v in state_dict.items():
        if isinstance(v, torch.nn.Module):
            out[k] = get_model_state_dict(v)
        elif isinstance(v, torch.optim.Optimizer):
            model = _owner(v, modules)
            if model is None:
                out[k] = v.state_dict()
            elif not v.state:
                out[k] = _empty_optimizer_state(model, v)
            else:
                out[k] = get_optimizer_state_dict(model, v)
        elif is_stateful(v):
            out[k] = v.state_dict()
        elif _stateful_per_rank(v):
            out[k] = PerRank(v.value.state_dict())
        else:
            out[k] = v
    return out


def _stateful_per_rank(v: Any) -> bool:
    """``per_rank(obj)`` of a stateful object (a data loader)."""

    return isinstance(v, PerRank) and is_stateful(v.value)


def _numbered(saved: Any) -> bool:
    """The saved optimizer state dict names parameters by number (``Optimizer.state_dict()``,
    as ``dcp.save`` stores an optimizer object), not by name."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list):
        return False
    params = [p for g in groups if isinstance(g, Mapping) for p in (g.get("params") or [])]
    return bool(params) and all(type(p) is int for p in params)


def for_load(state_dict: Mapping[str, Any], stored_roles: set[str] | None = None,
             saved_state: Mapping[str, Any] | None = None) -> tuple[Mapping[str, Any], Callable[[], None]]:
    """``(targets, finish)``: the state dict with every top-level stateful object replaced by
    a target state dict to load into, and a function that hands what was loaded to the
    objects, and the plain values it replaced to ``state_dict`` (call it after the load
    succeeded on every rank). ``stored_roles``: the roles
    the checkpoint holds tensors of; an optimizer saved before it had any state is restored
    without state (its param groups only), not given state it never had. ``saved_state``:
    the checkpoint's JSON state; an optimizer saved with numbered parameters (its plain
    ``state_dict()``, as ``dcp.save`` stores an optimizer object) is loaded the same way."""
    if not isinstance(state_dict, Mapping) or not any(is_stateful(v) or _stateful_per_rank(v) for v in state_dict.values()):
        return state_dict, lambda: None
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    modules = _modules(state_dict)
    out: dict[str, Any] = {}
    first: list[Callable[[], None]] = []
    then: list[Callable[[], None]] = []
    last: list[Callable[[], None]] = []
    for k, v in state_dict.items():
        if isinstance(v, torch.nn.Module):
            sd = out[k] = get_model_state_dict(v)
            first.append(lambda v=v, sd=sd: set_model_state_dict(v, sd))
        elif isinstance(v, torch.optim.Optimizer):
            model = _owner(v, modules)
            if model is not None and saved_state is not None and _numbered(saved_state.get(k)):
                model = None
            stateless = stored_roles is not None and k not in stored_roles and not v.state
            if model is None:
                if not stateless:
                    _init_optimizer_state(v)
                sd = out[k] = v.state_dict()
                then.append(lambda v=v, sd=sd: v.load_state_dict(sd))
            else:  # get_optimizer_state_dict creates missing state first
                sd = out[k] = _empty_optimizer_state(model, v) if stateless else get_optimizer_state_dict(model, v)
                then.append(lambda v=v, m=model, sd=sd: set_optimizer_state_dict(m, v, sd))
        elif is_stateful(v):
            sd = out[k] = v.state_dict()
            last.append(lambda v=v, sd=sd: v.load_state_dict(_unwrap(sd)))
        elif _stateful_per_rank(v):  # restored only when this rank's own value was loaded
            cur = v.value.state_dict()
            pr = out[k] = PerRank(cur)
            last.append(lambda obj=v.value, pr=pr, cur=cur: pr.value is cur or obj.load_state_dict(_unwrap(pr.value)))
        else:
            out[k] = v

    def finish() -> None:
        for f in (*first, *then, *last):
            f()
        if isinstance(state_dict, MutableMapping):  # the plain values the load replaced in ``out``
            for k, v in out.items():  # (top-level JSON leaves: "step": 100) go to the caller's dict
                if not is_stateful(state_dict[k]) and not _stateful_per_rank(state_dict[k]) and state_dict[k] is not v:
                    state_dict[k] = v

    return out, finish
