"""The sync among a stage's replicas (a scatter-reduce of their gradients, float buffers averaged)
and among the stages holding a tied parameter (the sum of their gradients)."""

from __future__ import annotations

from typing import Any

import torch

from cloudless.ir import protocol

from .sync import scatter_reduce
from .tensors import pack, unpack
from .worker_base import WorkerBase


class ReplicaSync(WorkerBase):
    def _synchronise(self, iteration: int, replica: int, timeout: float) -> None:
        """Sum gradients over the stage's replicas (and average float buffers), then tied parameters'
        gradients over the stages that hold them."""
        params = self.trained_parameters()
        buffers = [(n, b) for n, b in self.module.named_buffers() if b.is_floating_point()]
        if self.replicas > 1 and (params or buffers):  # a stage of frozen parameters only syncs nothing
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in params]
                + [b.reshape(-1) / self.replicas for _, b in buffers]
            )
            total = scatter_reduce(
                self.channel,
                protocol.sync_key(self.namespace, iteration, self.stage),
                flat,
                replica,
                self.replicas,
                piece_bytes=self.sync.piece_bytes,
                max_pieces=self.sync.max_pieces,
                pipelined=self.pipelined_sync,
                timeout=timeout,
                abort=self.channel.check_abort,
            )
            offset = 0
            for _, p in params:
                p.grad = total[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            with torch.no_grad():
                for _, b in buffers:
                    b.copy_(total[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
        if self.holders:
            by_name = dict(params)
            mine: dict[str, torch.Tensor] = {
                n: (by_name[n].grad if by_name[n].grad is not None else torch.zeros_like(by_name[n]))  # type: ignore[misc]
                for n in self.holders
            }
            if replica == 0:
                self.channel.put(protocol.shared_gradient_key(self.namespace, iteration, self.stage), pack(mine))
            partners: dict[int, dict[str, Any]] = {}
            for name, stages in self.holders.items():
                total_grad: torch.Tensor | None = None
                for s in sorted(stages):
                    if s == self.stage:
                        part = mine[name]
                    else:
                        if s not in partners:
                            key = protocol.shared_gradient_key(self.namespace, iteration, s)
                            partners[s] = unpack(self.channel.get(key, timeout))
                        part = partners[s][name]
                    total_grad = part.clone() if total_grad is None else total_grad + part
                by_name[name].grad = total_grad
