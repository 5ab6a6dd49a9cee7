"""The sync among a stage's replicas (a scatter-reduce of their gradients and of the parts of the buffers
their forwards changed)
and among the stages holding a tied parameter (the sum of their gradients), and the clip of every
stage's gradients to their global norm.

`ReplicaSync` owns the tied parameters' holders and how the scatter-reduce runs (pipelined or not);
the gradients it reduces are on the shared module's parameters (`StageContext`).
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ...ir import protocol
from ...ir.protocol import AbortRecord
from ..storage.tensors import pack, unpack
from .buffer_updates import BufferUpdates
from .failures import Diverged
from .scatter_reduce import scatter_reduce
from .stage_context import InvocationState, StageContext


class ReplicaSync:
    """The stage's gradients summed over its replicas and its tied partners, and clipped."""

    def __init__(
        self,
        context: StageContext,
        invocation: InvocationState,
        *,
        holders: dict[str, list[int]],
        pipelined: bool,
        buffers: BufferUpdates,
    ) -> None:
        self.context, self.invocation = context, invocation
        self.buffers = buffers  # the buffers the forward changes, and this iteration's parts of them
        self.holders = holders  # tied parameters of this stage -> the stages holding them
        self.pipelined = pipelined  # the scatter-reduce's pieces in flight at once (else one at a time)
        self.sync = context.workflow.sync

    def synchronise(self, iteration: int, replica: int, timeout: float) -> None:
        """Sum gradients over the stage's replicas (and the parts of the buffers the forward changed, which
        then hold the plain loop's values: buffer_updates.py), then tied parameters' gradients over the stages
        that hold them."""
        context, channel, namespace = self.context, self.context.channel, self.invocation.namespace
        replicas = self.invocation.replicas
        params = context.trained_parameters()
        parts = self.buffers.parts() if replicas > 1 else []
        if replicas > 1 and (params or parts):  # a stage of frozen parameters only syncs nothing
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in params] + parts
            )
            total = scatter_reduce(
                channel,
                protocol.sync_key(namespace, iteration, context.stage),
                flat,
                replica,
                replicas,
                piece_bytes=self.sync.piece_bytes,
                max_pieces=self.sync.max_pieces,
                pipelined=self.pipelined,
                timeout=timeout,
                abort=channel.check_abort,
            )
            offset = 0
            for _, p in params:
                p.grad = total[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            sums = []
            for part in parts:
                sums.append(total[offset : offset + part.numel()])
                offset += part.numel()
            if sums:
                self.buffers.adopt(sums)
        if self.holders:
            by_name = dict(params)
            mine: dict[str, torch.Tensor] = {
                n: (by_name[n].grad if by_name[n].grad is not None else torch.zeros_like(by_name[n]))  # type: ignore[misc]
                for n in self.holders
            }
            if replica == 0:
                channel.put(protocol.shared_gradient_key(namespace, iteration, context.stage), pack(mine))
            partners: dict[int, dict[str, Any]] = {}
            for name, stages in self.holders.items():
                total_grad: torch.Tensor | None = None
                for s in sorted(stages):
                    if s == context.stage:
                        part = mine[name]
                    else:
                        if s not in partners:
                            key = protocol.shared_gradient_key(namespace, iteration, s)
                            partners[s] = unpack(channel.get(key, timeout))
                        part = partners[s][name]
                    total_grad = part.clone() if total_grad is None else total_grad + part
                by_name[name].grad = total_grad

    def clip_to_global_norm(self, iteration: int, replica: int, timeout: float, max_norm: float) -> None:
        """Scale the stage's gradients as torch.nn.utils.clip_grad_norm_(every trained parameter of the
        model, max_norm) would: by max_norm / (norm + 1e-6) when that is below 1, `norm` the 2-norm over
        every stage's gradients (after the replicas' reduce and the tied sum; a tied parameter counted
        once, at the first stage holding it). Replica 0 of each stage writes its sum of squares; every
        function reads all of them. A norm that is not finite stops the run as divergence does."""
        context, channel, namespace = self.context, self.context.channel, self.invocation.namespace
        counted = [
            p.grad
            for name, p in context.trained_parameters()
            if p.grad is not None and (name not in self.holders or context.stage == min(self.holders[name]))
        ]
        # per tensor, as clip_grad_norm_ takes its norms, then their squares summed in float64
        own = math.fsum(float(torch.linalg.vector_norm(g, 2)) ** 2 for g in counted)
        if replica == 0:
            channel.put(protocol.grad_norm_key(namespace, iteration, context.stage), json.dumps(own).encode())

        def read(stage: int) -> float:
            if stage == context.stage:
                return own
            key = protocol.grad_norm_key(namespace, iteration, stage)
            return float(json.loads(channel.get(key, timeout)))

        # the other stages' at once: one request's latency, not one per stage (as the cost model counts)
        with ThreadPoolExecutor(max_workers=max(1, context.stages - 1), thread_name_prefix="norms") as pool:
            squares = list(pool.map(read, range(context.stages)))
        norm = math.sqrt(math.fsum(squares))
        if not math.isfinite(norm):
            message = (
                f"iteration {iteration}: the gradients' global norm is {norm} on stage {context.stage} "
                f"({context.function.name}, replica {replica}): training diverged; lower the learning rate or "
                "check the data"
            )
            raise Diverged(AbortRecord("diverged", message, iteration, context.stage, context.function.name))
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for _, p in context.trained_parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
