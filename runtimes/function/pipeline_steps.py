"""The pipeline's steps of one iteration on a stage: its micro-batches' forwards (the first stage reads
the data, the last computes the loss) and backwards in schedule order, activations and gradients
through storage on the function's uplink and downlink threads.

`PipelineSteps` owns what only they use: the stage module's input and output names, the loss module
(last stage), the training data's reader (first stage: it reads each micro-batch and sends its targets
on to the last), and the two link threads.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ...ir import protocol
from ...ir.schedule import compute_order, local_micro_batches
from ..storage.objects import ObjectError
from ..storage.shards import ShardError
from ..storage.tensors import autocast, pack, unpack, wire_dtype
from .batches import ShardBatches, batch_difference, flat_batch, open_batches, user_module
from .buffer_updates import BufferUpdates
from .data import read_split_meta
from .failures import AbortRecord, ModelFailed
from .stage_context import InvocationState, Span, StageContext


def receive(value: Any) -> Any:
    """A value read from storage as the leaf autograd starts from on this side."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.requires_grad_(True)
    return value


def sent_targets(data: bytes) -> list[Any]:
    """A micro-batch's targets as the first stage sent them (`protocol.target_key`), in order."""
    values = unpack(data)
    return [values[f"target_{j}"] for j in range(len(values))]


class PipelineSteps:
    """A stage's forward and backward steps, micro-batch by micro-batch."""

    def __init__(
        self,
        context: StageContext,
        invocation: InvocationState,
        *,
        inputs: list[str],
        outputs: list[str],
        loss: torch.nn.Module | None,
        data_name: str,
        buffers: BufferUpdates,
    ) -> None:
        self.context, self.invocation = context, invocation
        # the buffers the forward changes: followed micro-batch by micro-batch when the stage has replicas
        self.buffers = buffers
        self._following_buffers = False
        self.run = context.workflow.run
        self.inputs, self.outputs = inputs, outputs  # the stage module's, in its call's order
        self.loss = loss  # the last stage's loss module
        self.data_name = data_name  # the region's training data in storage
        # the data, opened by the first stage at its first read: it reads, transforms and collates each
        # micro-batch, and sends the targets on to the last stage
        self._data: ShardBatches | None = None
        self._opened_for: str | None = None  # the run (namespace) the data was opened for
        self._link_threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None

    def compute(self, iteration: int, replica: int, timeout: float, spans: list[list[Any]]) -> list[float]:
        """Forward and backward of this replica's micro-batches in schedule order; the last stage's
        losses, in micro-batch order (none elsewhere). Gradients are left on the module's parameters.

        Transfers overlap compute, as the planner's model has them: a downlink thread fetches the
        micro-batches' activations and gradients in the order compute needs them, and an uplink
        thread sends results in the order they are computed."""
        context, channel = self.context, self.context.channel
        namespace = self.invocation.namespace
        local = local_micro_batches(self.run.micro_batches, self.invocation.replicas, replica)
        order = compute_order(self.run.schedule, local, self.invocation.window)
        self._following_buffers = self.invocation.replicas > 1 and bool(self.buffers.tracked)
        if self._following_buffers:
            self.buffers.begin(self.run.micro_batches)
        uplink, downlink = self._links()
        cancelled = threading.Event()
        arriving: dict[tuple[str, int], Future[bytes]] = {}
        targets_sent = context.last and not context.first
        for kind, m in order:
            if kind == "forward" and targets_sent:  # before its activations: the first stage sent it first
                target_name = protocol.target_key(namespace, iteration, m)
                arriving[("target", m)] = downlink.submit(channel.get, target_name, timeout, cancelled)
            if kind == "forward" and not context.first:
                key = protocol.activation_key(namespace, iteration, context.stage - 1, m)
            elif kind == "backward" and not context.last:
                key = protocol.gradient_key(namespace, iteration, context.stage + 1, m)
            else:
                continue
            arriving[(kind, m)] = downlink.submit(channel.get, key, timeout, cancelled)
        sending: list[Future[None]] = []
        received: dict[int, dict[str, Any]] = {}
        produced: dict[int, tuple[Any, ...]] = {}
        losses: dict[int, torch.Tensor] = {}
        try:
            for kind, m in order:
                with Span(spans, f"{kind} {m}"):
                    incoming = arriving.pop((kind, m), None)
                    target = arriving.pop(("target", m), None) if kind == "forward" else None
                    targets = sent_targets(target.result()) if target is not None else None
                    data = incoming.result() if incoming is not None else None
                    if kind == "forward":
                        received[m], produced[m] = self._forward(
                            iteration, replica, m, data, losses, uplink, sending, targets
                        )
                    else:
                        taken, outputs = received.pop(m), produced.pop(m)
                        self._backward(iteration, replica, m, data, taken, outputs, losses, uplink, sending)
            for future in sending:
                future.result()
        finally:
            cancelled.set()  # on an error, stop the fetches still waiting
        return [float(losses[m]) for m in sorted(losses)]

    def _open_data(self, timeout: float) -> ShardBatches:
        """Open the region's training data (the first stage). Once per run: a warm function serving the next
        run reads its `meta` again (the data may have changed in between), and keeps the shards it holds
        when the data is the same."""
        namespace = self.invocation.namespace
        if self._opened_for != namespace or self._data is None:
            channel, run = self.context.channel, self.run
            meta = read_split_meta(channel, self.data_name, "train", timeout)
            data = self._data
            same = (data.fingerprint, data.seed, data.micro_batch, data.global_batch) if data is not None else None
            if same != (meta["fingerprint"], run.seed, run.micro_batch, run.global_batch):
                self._data = open_batches(
                    channel,
                    meta,
                    self.data_name,
                    "train",
                    lambda: user_module(self.context.package, self.context.workflow.data.model_file),
                    seed=run.seed,
                    micro_batch=run.micro_batch,
                    global_batch=run.global_batch,
                    timeout=timeout,
                )
            self._opened_for = namespace
        assert self._data is not None
        return self._data

    def _first_batch(self, iteration: int, replica: int, m: int) -> tuple[list[Any], list[Any]]:
        """The first stage's micro-batch: its flat inputs and flat targets."""
        context = self.context
        data, samples = self._open_data(self.invocation.key_timeout), []
        for located in data.positions(iteration, m):
            try:  # storage, not the model's code: outside its compute share
                raw = data.read(located)
            except (ShardError, ObjectError) as exc:  # damaged, changed or refused: no retry reads it otherwise
                message = f"iteration {iteration}: stage {context.stage} ({context.function.name}) reads "
                message += f"{data.name(located)}: {exc}"
                record = AbortRecord("failed", message, iteration, context.stage, context.function.name)
                raise ModelFailed(record) from exc
            if data.transform is None:  # a staged row: its tensors
                samples.append(data.transformed(located, raw))
                continue
            what = f"transform of {data.name(located)}"
            transform = functools.partial(data.transformed, located, raw)
            samples.append(context.model_code(iteration, replica, what, transform))
        # the replica's next micro-batch (the next iteration's first after its last): read while this one runs
        following = m + self.invocation.replicas
        if following < self.run.micro_batches:
            data.prefetch(iteration, following)
        else:
            data.prefetch(iteration + 1, m % self.invocation.replicas)
        collate = data.collate
        if data.transform is None:
            batch = collate(samples)
        else:
            batch = context.model_code(iteration, replica, f"collate_fn of micro-batch {m}", lambda: collate(samples))
        try:
            inputs, targets = flat_batch(batch, data.keywords)
        except TypeError as exc:
            message = f"iteration {iteration}: collate_fn of micro-batch {m} on stage {context.stage}: {exc}"
            raise ModelFailed(AbortRecord("failed", message, iteration, context.stage, context.function.name)) from None
        if len(inputs) != len(self.inputs):
            message = (
                f"iteration {iteration}: micro-batch {m}'s collated inputs have {len(inputs)} tensors, but the model "
                f"takes {len(self.inputs)} ({', '.join(self.inputs)}), as example_inputs gives them"
            )
            raise ModelFailed(AbortRecord("failed", message, iteration, context.stage, context.function.name))
        examples = data.examples
        for what, leaves, example in (("inputs", inputs, examples[0]), ("targets", targets, examples[1])):
            difference = (
                None
                if example is None
                else batch_difference(what, leaves, example, self.run.micro_batch, context.workflow.data.fixed_shapes)
            )
            if difference is not None:
                message = f"iteration {iteration}: micro-batch {m}'s collate_fn on stage {context.stage}: {difference}"
                raise ModelFailed(AbortRecord("failed", message, iteration, context.stage, context.function.name))
        return inputs, targets

    def _links(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The function's uplink and downlink: one thread each, so each keeps its order."""
        if self._link_threads is None:
            self._link_threads = (
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="uplink"),
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="downlink"),
            )
        return self._link_threads

    def close(self) -> None:
        """Cancel the transfers not started (a failed attempt's); the links end after the current one."""
        for pool in self._link_threads or ():
            pool.shutdown(wait=False, cancel_futures=True)
        self._link_threads = None

    def _forward(
        self,
        iteration: int,
        replica: int,
        m: int,
        data: bytes | None,
        losses: dict[int, torch.Tensor],
        uplink: ThreadPoolExecutor,
        sending: list[Future[None]],
        targets: list[Any] | None = None,
    ) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """`targets`: the last stage's, as the first stage sent them."""
        context = self.context
        if context.first:
            inputs, targets = self._first_batch(iteration, replica, m)
            taken = dict(zip(self.inputs, inputs, strict=True))
            if not context.last:  # the loss's targets, for the last stage
                key = protocol.target_key(self.invocation.namespace, iteration, m)
                packed = pack({f"target_{j}": t for j, t in enumerate(targets)})
                sending.append(uplink.submit(context.channel.put, key, packed))
        else:
            assert data is not None
            values = unpack(data)
            taken = {name: receive(values[name]) for name in self.inputs}
        # Ops that draw random numbers (dropout) draw the same ones on a retry. (The CPU generator
        # alone: torch.manual_seed also queues seeding of every accelerator, at a millisecond a call.)
        torch.default_generator.manual_seed(
            (((self.run.seed * 1_000_003 + iteration) * 1_000_003 + context.stage) * 1_000_003 + m) % 2**63
        )
        precision = self.run.precision

        def forward() -> Any:
            with autocast(precision):
                return context.module(*[taken[n] for n in self.inputs])

        if self._following_buffers:
            self.buffers.before_forward()
        outputs = tuple(context.model_code(iteration, replica, "forward", forward))
        if self._following_buffers:
            self.buffers.after_forward(m)
        if context.last:
            loss = self.loss
            assert loss is not None and targets is not None

            def compute_loss() -> Any:
                with autocast(precision):
                    return loss(*outputs, *targets)

            (losses[m],) = context.model_code(iteration, replica, "loss", compute_loss)
        else:
            key = protocol.activation_key(self.invocation.namespace, iteration, context.stage, m)
            sent = pack(dict(zip(self.outputs, outputs, strict=True)), wire_dtype(precision))
            sending.append(uplink.submit(context.channel.put, key, sent))
        return taken, outputs

    def _backward(
        self,
        iteration: int,
        replica: int,
        m: int,
        data: bytes | None,
        taken: dict[str, Any],
        outputs: tuple[Any, ...],
        losses: dict[int, torch.Tensor],
        uplink: ThreadPoolExecutor,
        sending: list[Future[None]],
    ) -> None:
        context = self.context
        if context.last:
            # The global batch's loss is the mean of its micro-batches' (equal-sized) mean losses.
            loss = losses[m]
            micro_batches = self.run.micro_batches
            context.model_code(iteration, replica, "backward", lambda: (loss / micro_batches).backward())
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
                context.model_code(
                    iteration,
                    replica,
                    "backward",
                    lambda: torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs]),
                )
        if not context.first:
            sent = {
                name: value.grad
                for name, value in taken.items()
                if isinstance(value, torch.Tensor) and value.grad is not None
            }
            key = protocol.gradient_key(self.invocation.namespace, iteration, context.stage, m)
            sending.append(uplink.submit(context.channel.put, key, pack(sent, wire_dtype(self.run.precision))))
