"""Parallelism for the validation trainer, on torch.distributed only.

* :class:`Mesh`: the 2-D layout of ranks, ``rank = dp_rank * tp + tp_rank`` (TP ranks are
  adjacent, as in Megatron), with one TP group and one DP group per rank.
* Megatron TP operators: :func:`copy_to_tp` (identity forward, all-reduce of gradients
  backward) before column-parallel layers, :func:`reduce_from_tp` (all-reduce forward,
  identity backward) after row-parallel ones.
* :class:`FlatUnit`: DeepSpeed-style ZeRO over the DP group for one block of parameters:
  flattened into one buffer, padded to a multiple of dp, cut into equal ranges (ranges cross
  tensor boundaries). Stage 0 keeps everything on every rank; 1 partitions fp32 master weights
  and Adam moments; 2 also reduce-scatters gradients into partitions after every
  micro-batch; 3 also partitions the parameters and all-gathers a block only while it runs
  (forward, and again for the recomputed forward in backward), freeing it afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unickpt import Layout, ShardedTensor

__all__ = ["TPGroup", "Mesh", "copy_to_tp", "reduce_from_tp", "FlatUnit", "zero3_apply"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class TPGroup:
    group: object
    rank: int
    size: int

    @staticmethod
    def single() -> "TPGroup":
        return TPGroup(None, 0, 1)


@dataclass(frozen=True)
class Mesh:
    rank: int
    world: int
    tp: TPGroup
    dp_group: object
    dp_rank: int
    dp_size: int

    @staticmethod
    def build(tp_size: int) -> "Mesh":
        if not dist.is_initialized():
            if tp_size != 1:
                raise ValueError("tensor parallelism needs torch.distributed (launch with torchrun)")
            return Mesh(0, 1, TPGroup.single(), None, 0, 1)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tp_size:
            raise ValueError(f"world size {world} is not divisible by tp={tp_size}")
        dp_size = world // tp_size
        tp_group = dp_group = None
        for d in range(dp_size):  # every rank creates every group, in the same order
            ranks = list(range(d * tp_size, (d + 1) * tp_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                tp_group = g
        for t in range(tp_size):
            ranks = list(range(t, world, tp_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                dp_group = g
        return Mesh(rank, world, TPGroup(tp_group, rank % tp_size, tp_size), dp_group, rank // tp_size, dp_size)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.tp.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


@dataclass
class _Param:
    name: str
    param: torch.nn.Parameter
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # TP block offsets in the full tensor
    shape: tuple[int, ...]  # local (TP block) shape
    start: int  # offset inside the flat buffer
    tp_replicated: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FlatUnit:
    """One block of parameters under ZeRO stage 0-3 over the DP group."""

    def __init__(self, name, params, mesh: Mesh, stage: int, dtype: torch.dtype) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {stage}")
        self.name, self.mesh, self.stage, self.dtype = name, mesh, stage, dtype
        self.params: list[_Param] = []
        pos = 0
        for hf_name, p, full_shape, offsets, tp_dim in params:
            self.params.append(_Param(hf_name, p, tuple(full_shape), tuple(offsets), tuple(p.shape), pos, tp_dim is None))
            pos += p.numel()
        dp = mesh.dp_size
        self.device = params[0][1].device if params else torch.device("cpu")
        self.numel = pos
        self.padded = -(-pos // dp) * dp
        self.part = self.padded // dp
        self.lo = mesh.dp_rank * self.part
        full = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for e in self.params:
            full[e.start : e.start + e.numel] = e.param.detach().reshape(-1).float()
        n_opt = self.padded if stage == 0 else self.part
        self.master = (full if stage == 0 else full[self.lo : self.lo + self.part]).clone()
        self.exp_avg = torch.zeros(n_opt, device=self.device)
        self.exp_avg_sq = torch.zeros(n_opt, device=self.device)
        # stages 0-1 accumulate full gradients and all-reduce once per step; stages 2-3
        # reduce-scatter every micro-batch into this rank's partition
        self._gacc = torch.zeros(self.padded if stage < 2 else self.part, device=self.device)
        if stage < 3:
            self.flat = full.to(dtype)
            self._bind(self.flat)
            self.ppart = None
        else:
            self.flat = None
            self.ppart = full[self.lo : self.lo + self.part].to(dtype).clone()  # not a view of `full`
            self.release()

    # -- parameter storage ------------------------------------------------------------------

    def _bind(self, buf: torch.Tensor) -> None:
        for e in self.params:
            e.param.data = buf[e.start : e.start + e.numel].view(e.shape)

    def gather(self) -> None:
        """Stage 3: materialise the full block from every rank's partition."""
        if self.stage < 3:
            return
        buf = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        if self.mesh.dp_size == 1:
            buf.copy_(self.ppart)
        else:
            _all_gather(buf, self.ppart, group=self.mesh.dp_group)
        self._bind(buf)

    def release(self) -> None:
        if self.stage < 3:
            return
        for e in self.params:
            e.param.data = torch.empty(0, dtype=self.dtype, device=self.device)

    # -- gradients --------------------------------------------------------------------------

    def after_backward(self) -> None:
        """After each micro-batch: fold the parameters' gradients into the accumulator."""
        g = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for e in self.params:
            if e.param.grad is not None:
                g[e.start : e.start + e.numel] = e.param.grad.reshape(-1).float()
                e.param.grad = None
        if self.stage < 2:
            self._gacc += g
        elif self.mesh.dp_size > 1:
            out = torch.empty(self.part, device=self.device)
            _reduce_scatter(out, g, group=self.mesh.dp_group)
            self._gacc += out
        else:
            self._gacc += g

    def reduced_grad(self) -> torch.Tensor:
        """End of step: the summed gradient matching ``master`` (full for stage 0)."""
        if self.stage < 2 and self.mesh.dp_size > 1:
            dist.all_reduce(self._gacc, group=self.mesh.dp_group)
        if self.stage == 1:
            return self._gacc[self.lo : self.lo + self.part]
        return self._gacc

    def sq_norm(self, g: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global squared gradient norm: every element counted on
        exactly one rank (TP-replicated parameters on tp rank 0; stage 0 on dp rank 0)."""
        if self.stage == 0 and self.mesh.dp_rank != 0:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        base = 0 if self.stage == 0 else self.lo
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for e in self.params:
            if e.tp_replicated and self.mesh.tp.rank != 0:
                continue
            a, b = max(e.start, base), min(e.start + e.numel, base + g.numel())
            if b > a:
                total += g[a - base : b - base].double().pow(2).sum()
        return total

    def step(self, g: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float, wd: float, t: int) -> None:
        """AdamW on this rank's partition, then refresh the model parameters."""
        self.exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        denom = (self.exp_avg_sq / bc2).sqrt_().add_(eps)
        if wd:
            self.master.mul_(1 - lr * wd)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bc1)
        self._gacc.zero_()
        self.sync_params()

    def sync_params(self) -> None:
        """Copy fp32 master weights into the model parameters (all-gathering partitions)."""
        if self.stage == 0:
            self.flat.copy_(self.master)
        elif self.stage == 3:
            self.ppart.copy_(self.master)
        elif self.mesh.dp_size == 1:
            self.flat.copy_(self.master)
        else:
            _all_gather(self.flat, self.master.to(self.dtype), group=self.mesh.dp_group)

    # -- checkpoint ----------------------------------------------------------------------

    def _replica(self, e: _Param, dp_replicated: bool) -> int:
        """0 on exactly one holder of each element: TP-replicated parameters count tp ranks,
        DP-replicated buffers count dp ranks."""
        r = 0
        if e.tp_replicated:
            r = self.mesh.tp.rank
        if dp_replicated:
            r = r * self.mesh.dp_size + self.mesh.dp_rank
        return r

    def _pieces(self, buf: torch.Tensor, partitioned: bool) -> dict[str, ShardedTensor]:
        out = {}
        base = self.lo if partitioned else 0
        for e in self.params:
            if partitioned:
                a, b = max(e.start, base), min(e.start + e.numel, base + buf.numel())
                if b <= a:
                    continue
                lay = Layout(e.full_shape, e.offsets, e.shape, (a - e.start, b - e.start), self._replica(e, False))
                out[e.name] = ShardedTensor(buf[a - base : b - base], lay)
            else:
                lay = Layout(e.full_shape, e.offsets, e.shape, None, self._replica(e, True))
                out[e.name] = ShardedTensor(buf[e.start : e.start + e.numel].view(e.shape), lay)
        return out

    def state(self) -> dict[str, dict[str, ShardedTensor]]:
        """Views (no copies) of this rank's model, master and moment pieces, with layouts."""
        opt_partitioned = self.stage >= 1
        model = self._pieces(self.ppart, True) if self.stage == 3 else self._pieces(self.flat, False)
        return {
            "model": model,
            "master": self._pieces(self.master, opt_partitioned),
            "exp_avg": self._pieces(self.exp_avg, opt_partitioned),
            "exp_avg_sq": self._pieces(self.exp_avg_sq, opt_partitioned),
        }


class _Zero3(torch.autograd.Function):
    """Run a block with its parameters gathered only for the call; recompute in backward."""

    @staticmethod
    def forward(ctx, unit: FlatUnit, fn, x, anchor):
        unit.gather()
        try:
            with torch.no_grad():
                out = fn(x)
        finally:
            unit.release()
        ctx.unit, ctx.fn = unit, fn
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, gout):
        (x,) = ctx.saved_tensors
        unit = ctx.unit
        unit.gather()
        try:
            xin = x.detach().requires_grad_(x.is_floating_point())
            with torch.enable_grad():
                out = ctx.fn(xin)
            torch.autograd.backward(out, gout)
            unit.after_backward()
        finally:
            unit.release()
        return None, None, xin.grad if x.is_floating_point() else None, None


_ANCHOR = torch.zeros((), requires_grad=True)  # keeps blocks fed by integer tokens in the graph (any device)


def zero3_apply(unit: FlatUnit, fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with the unit's parameters; under stage 3 gathered only for the call."""
    if unit.stage < 3:
        return fn(x)
    return _Zero3.apply(unit, fn, x, _ANCHOR)
