"""The pipeline's steps of one micro-batch on a stage: its forward (the first stage reads the data, the
last computes the loss) and its backward, activations and gradients through storage on the function's
uplink and downlink threads."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ...ir import protocol
from ...ir.schedule import sample_indices
from ..storage.tensors import autocast, pack, unpack, wire_dtype
from .data import SplitReader
from .worker_base import WorkerBase


def receive(value: Any) -> Any:
    """A value read from storage as the leaf autograd starts from on this side."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.requires_grad_(True)
    return value


class PipelineSteps(WorkerBase):
    def _indices(self, iteration: int, m: int) -> list[int]:
        if self._reader is None:
            self._reader = SplitReader(self.channel, self.data_name, timeout=self.key_timeout)
        if self._batch[0] != iteration:  # the whole iteration's samples at once, then its slices
            self._batch = (
                iteration,
                sample_indices(iteration, 0, self.global_batch, self.global_batch, self._reader.samples, self.seed),
            )
        return self._batch[1][m * self.micro_batch : (m + 1) * self.micro_batch]

    def _links(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The function's uplink and downlink: one thread each, so each keeps its order."""
        if self._link_threads is None:
            self._link_threads = (
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="uplink"),
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="downlink"),
            )
        return self._link_threads

    def _forward(
        self,
        iteration: int,
        m: int,
        data: bytes | None,
        losses: dict[int, torch.Tensor],
        uplink: ThreadPoolExecutor,
        sending: list[Future[None]],
    ) -> tuple[dict[str, Any], tuple[Any, ...]]:
        if self.first:
            indices = self._indices(iteration, m)
            assert self._reader is not None
            taken = dict(zip(self.inputs, self._reader.gather(indices, "input"), strict=True))
        else:
            assert data is not None
            values = unpack(data)
            taken = {name: receive(values[name]) for name in self.inputs}
        # Ops that draw random numbers (dropout) draw the same ones on a retry. (The CPU generator
        # alone: torch.manual_seed also queues seeding of every accelerator, at a millisecond a call.)
        torch.default_generator.manual_seed(
            (((self.seed * 1_000_003 + iteration) * 1_000_003 + self.stage) * 1_000_003 + m) % 2**63
        )
        precision = self.workflow.run.precision

        def forward() -> Any:
            with autocast(precision):
                return self.module(*[taken[n] for n in self.inputs])

        outputs = tuple(self._model_code(iteration, "forward", forward))
        if self.last:
            loss = self.loss
            assert loss is not None
            indices = self._indices(iteration, m)
            assert self._reader is not None
            targets = self._reader.gather(indices, "target")

            def compute_loss() -> Any:
                with autocast(precision):
                    return loss(*outputs, *targets)

            (losses[m],) = self._model_code(iteration, "loss", compute_loss)
        else:
            key = protocol.activation_key(self.namespace, iteration, self.stage, m)
            sent = pack(dict(zip(self.outputs, outputs, strict=True)), wire_dtype(precision))
            sending.append(uplink.submit(self.channel.put, key, sent))
        return taken, outputs

    def _backward(
        self,
        iteration: int,
        m: int,
        data: bytes | None,
        taken: dict[str, Any],
        outputs: tuple[Any, ...],
        losses: dict[int, torch.Tensor],
        uplink: ThreadPoolExecutor,
        sending: list[Future[None]],
    ) -> None:
        if self.last:
            # The global batch's loss is the mean of its micro-batches' (equal-sized) mean losses.
            loss = losses[m]
            self._model_code(iteration, "backward", lambda: (loss / self.micro_batches).backward())
            losses[m] = losses[m].detach()
        else:
            assert data is not None
            grads = unpack(data)
            pairs = [
                (value, grads[name])
                for name, value in zip(self.outputs, outputs, strict=True)
                if name in grads and isinstance(value, torch.Tensor) and value.requires_grad
            ]
            if pairs:
                self._model_code(
                    iteration, "backward", lambda: torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
                )
        if not self.first:
            sent = {
                name: value.grad
                for name, value in taken.items()
                if isinstance(value, torch.Tensor) and value.grad is not None
            }
            key = protocol.gradient_key(self.namespace, iteration, self.stage, m)
            sending.append(uplink.submit(self.channel.put, key, pack(sent, wire_dtype(self.workflow.run.precision))))
