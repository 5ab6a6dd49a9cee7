"""Load a user's model file by path and check it follows the contract (docs/model-file.md).

Required: build_model() -> nn.Module; example_inputs(batch_size) -> tuple of tensors (or a dict of them by
the forward's parameter names: `model(**inputs)`).
Optional: example_targets, loss_fn, make_optimizer, make_scheduler, load_shard, transform, collate_fn,
TRAINING.

The functions run the model file's own code where a run needs it (a `transform` of samples read where they
lie): the packages ship the file and the modules beside it that it imports (`user_sources`).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from keyword import iskeyword
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...ir.checkpoint_loading import checked_checkpoint_loads
from ...ir.protocol import user_module_name
from ...ir.workflow import PRECISIONS, ParameterGroup
from ...runtimes.storage.shards import in_place_pattern
from ..errors import ModelFileError, describe, display_path, frame_location, name_as_typed, user_frame
from .stand_ins import STAGED_WEIGHTS_BYTES, parameter_bytes, parameters_on_meta, replace_with_stand_ins

TRAINING_KEYS: dict[str, type | tuple[type, ...]] = {
    "global_batch_size": int,
    "micro_batch_sizes": list,
    "iterations": int,
    "epochs": int,
    "learning_rate": (int, float),
    "max_grad_norm": (int, float),
    "precision": str,
}


#: the optimizer when the model file makes none: SGD at TRAINING["learning_rate"], else this rate
DEFAULT_LEARNING_RATE = 0.01


@dataclass(frozen=True)
class OptimizerProbe:
    """The model file's optimizer as the functions rebuild it (a torch.optim class and its options),
    and how many parameter-sized state tensors it keeps per parameter (what planning charges memory for)."""

    class_name: str
    options: dict[str, Any]
    state_per_parameter: int
    #: None: torch.optim's; else the module of the class (OptimizerSpec.module)
    module: str | None = None


def default_loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """The contract's default loss: without targets, the loss the model returns (`output.loss`, as a Hugging
    Face model computes it from its `labels` input); else cross-entropy."""
    if target is None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"the model returned {type(output).__name__} without a loss, and the model file defines no "
                "example_targets: define example_targets and loss_fn, or return the loss (output.loss)"
            )
        return loss
    return nn.functional.cross_entropy(output, target)


def call_by_keywords(model: nn.Module, keys: tuple[str, ...]) -> None:
    """Make `model(*values)` call its forward with keywords, `forward(**dict(zip(keys, values)))`, in place: its
    class becomes a subclass (same name) whose forward takes the keys as positional parameters, so that every
    pass calls and traces it positionally and its parameters keep their names."""
    cls = type(model)
    original = cls.forward
    namespace: dict[str, Any] = {"_forward": original}
    exec(  # a forward whose parameters are the keys: fx and torch.export name the program's inputs after them
        f"def forward(self, {', '.join(keys)}):\n    return _forward(self, {', '.join(f'{k}={k}' for k in keys)})\n",
        namespace,
    )
    attributes = {"forward": namespace["forward"], "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    model.__class__ = type(cls.__name__, (cls,), attributes)


@dataclass
class ModelFile:
    """The functions and settings a model file provides."""

    path: Path
    build_model: Callable[[], nn.Module]
    example_inputs: Callable[[int], tuple[Any, ...]]
    example_targets: Callable[[int], Any] | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    make_scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None
    load_shard: Callable[[str, str], Any] | None = None
    transform: Callable[..., Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    training: dict[str, Any] = field(default_factory=dict)
    #: example_inputs' keys when it returns a dict: the model is called `model(**inputs)` (call_by_keywords)
    keyword_inputs: tuple[str, ...] = field(default=(), init=False)

    @property
    def name(self) -> str:
        """The file's name, as the build records it (workflow.yaml, the graph)."""
        return self.path.name

    @property
    def shown(self) -> str:
        """The file as messages name it: as the user typed it."""
        return display_path(self.path)

    def call(self, function_name: str, *args: Any) -> Any:
        """Call one of the file's functions; an exception becomes one error naming its line."""
        function = getattr(self, function_name)
        try:
            return function(*args)
        except SystemExit as exc:  # would end the compiler silently, with the file's exit status
            raise self.error_at(exc, _exited(exc, f"in {_signature(function_name, args)}")) from None
        except Exception as exc:
            raise self.error_at(exc, f"{_signature(function_name, args)} raised {describe(exc)}") from exc

    def error_at(self, exc: BaseException, message: str) -> ModelFileError:
        frame = user_frame(exc, self.path)
        where = frame_location(frame) if frame else display_path(self.path)
        return ModelFileError(f"{where}: {message}")

    def _build_model(self, *, on_meta: bool) -> Any:
        """build_model(), its parameters on the meta device or not; a transformers checkpoint it loads
        must match the model (checkpoint_loading.py)."""
        with checked_checkpoint_loads(), parameters_on_meta() if on_meta else nullcontext():
            return self.call("build_model")

    def instantiate(self, batch_size: int, *, stand_ins: bool | None = False) -> tuple[nn.Module, tuple[Any, ...], Any]:
        """Build the model and one micro-batch of example inputs and targets, type-checked. `stand_ins`:
        the model's parameters are stand-ins of their shapes, not weights (stand_ins.py); None: stand-ins
        when they would take more than STAGED_WEIGHTS_BYTES (the model built on meta first, with the
        random generator's state put back, so that a model built for real gets the same weights)."""
        if stand_ins is None:
            rng = torch.random.get_rng_state()
            model = self._build_model(on_meta=True)
            stand_ins = isinstance(model, nn.Module) and parameter_bytes(model) > STAGED_WEIGHTS_BYTES
            if not stand_ins:
                torch.random.set_rng_state(rng)
                model = self._build_model(on_meta=False)
        else:
            model = self._build_model(on_meta=stand_ins)
        if stand_ins and isinstance(model, nn.Module):
            replace_with_stand_ins(model)
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{display_path(self.path)}: build_model() returned {type(model).__name__}; expected a torch.nn.Module"
            )
        if not any(p.requires_grad for p in model.parameters()):
            raise ModelFileError(
                f"{display_path(self.path)}: build_model() returned a {type(model).__name__} with no trainable "
                "parameters; there is nothing to train"
            )
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "use_cache", None) is True:
                # A transformers model keeps its attention keys and values for generation unless told
                # not to, and returns them as a cache object, no tensor; training never reads it.
                config.use_cache = False
        inputs, targets = self.examples(batch_size)
        if self.keyword_inputs:
            call_by_keywords(model, self.keyword_inputs)
        return model, inputs, targets

    def examples(self, batch_size: int) -> tuple[tuple[Any, ...], Any]:
        """One micro-batch of example inputs and targets (None without example_targets), type-checked."""
        inputs = self.call("example_inputs", batch_size)
        if isinstance(inputs, Mapping) and inputs:
            # keyword inputs, `model(**inputs)`: the Hugging Face convention
            wrong = next((k for k in inputs if not (isinstance(k, str) and k.isidentifier()) or iskeyword(k)), None)
            if wrong is not None:
                raise ModelFileError(
                    f"{display_path(self.path)}: example_inputs({batch_size}) returned a dict with the key {wrong!r}; "
                    "expected the names of the forward's parameters"
                )
            self.keyword_inputs = tuple(inputs)
            inputs = tuple(inputs.values())
        if not isinstance(inputs, tuple) or not inputs:
            raise ModelFileError(
                f"{display_path(self.path)}: example_inputs({batch_size}) returned "
                f"{type(inputs).__name__}; expected a non-empty tuple of tensors (wrap one tensor as (x,)), or a "
                "dict of them by the forward's parameter names"
            )
        bad = [type(leaf).__name__ for leaf in pytree.tree_leaves(inputs) if not isinstance(leaf, torch.Tensor)]
        if bad:
            raise ModelFileError(
                f"{display_path(self.path)}: example_inputs({batch_size}) holds {bad[0]}; expected only tensors"
            )
        inputs = _distinct(inputs)
        targets = None
        if self.example_targets is not None:
            targets = self.call("example_targets", batch_size)
            if not all(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(targets)):
                raise ModelFileError(
                    f"{display_path(self.path)}: example_targets({batch_size}) returned "
                    f"{type(targets).__name__}; expected a tensor"
                )
        return inputs, targets

    def check_inputs_fit(self, model: nn.Module, inputs: tuple[Any, ...], batch_size: int) -> None:
        """Call the model on its example inputs once, eagerly (without gradients; the random number
        generator is left as it was): a mismatch is the user's, and says so before any tracing
        error could blame the tracer. The caller restores buffers and training flags."""
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                model(*inputs)
        except SystemExit as exc:
            raise self.error_at(exc, _exited(exc, f"in the model's forward on example_inputs({batch_size})")) from None
        except Exception as exc:
            shapes = ", ".join(_tensor_shape(leaf) for leaf in pytree.tree_leaves(inputs))
            raise self.error_at(
                exc,
                f"the example inputs do not fit the model: calling the model of build_model() on "
                f"example_inputs({batch_size}) ({shapes}) raised {describe(exc)}",
            ) from exc


def _distinct(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The inputs, each its own tensor: one tensor given twice (`labels=input_ids`) is two inputs to the
    program, which a trace would otherwise read as one (its data then fed where the other goes)."""
    seen: set[int] = set()

    def own(leaf: torch.Tensor) -> torch.Tensor:
        storage = leaf.untyped_storage().data_ptr() if leaf.device.type != "meta" else id(leaf)
        if storage in seen and leaf.numel():
            return leaf.clone()
        seen.add(storage)
        return leaf

    return tuple(pytree.tree_map_only(torch.Tensor, own, inputs))


def _tensor_shape(tensor: torch.Tensor) -> str:
    """`float32[8, 4]`"""
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _exited(exc: SystemExit, where: str) -> str:
    """`called sys.exit(3) <where>; a model file must not exit ...`: SystemExit (sys.exit, exit(), raise
    SystemExit) is no Exception, and the compiler would end with the file's status and no line."""
    return f"called sys.exit({exc.code!r}) {where}; a model file must not exit (raise an exception to report a problem)"


def _signature(function_name: str, args: tuple[Any, ...]) -> str:
    shown = ", ".join(repr(a) if isinstance(a, int | str) else "…" for a in args)
    return f"{function_name}({shown})"


def load_model_file(path: Path) -> ModelFile:
    """Import `path` as a module and collect the contract's functions, with clear errors."""
    name_as_typed(path)  # every message, a traceback's frames in it too, names the file as given
    shown = display_path(path)
    if not path.exists():
        raise ModelFileError(f"{shown}: no such file; expected a Python model file (docs/model-file.md)")
    if not path.is_file() or path.suffix != ".py":
        raise ModelFileError(f"{shown}: not a .py file; expected a Python model file")
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFileError(
            f"{shown}: not UTF-8 text ({exc.reason} at byte {exc.start}); expected Python source"
        ) from exc
    try:
        compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise ModelFileError(f"{shown}:{exc.lineno}: syntax error: {exc.msg}") from exc

    folder = str(path.resolve().parent)
    if folder not in sys.path:
        # Like `python model.py`: the model file may import modules that sit beside it.
        sys.path.insert(0, folder)
    module_name = f"cloudless_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered, as an import would: torch.cond/map and pickling look a function's module up by name; and by
    # the name generated stage code finds the model file's helpers under (protocol.user_attribute).
    sys.modules[module_name] = sys.modules[user_module_name(path.name)] = module
    # Nothing is left in the user's folder: no __pycache__ beside the model file or the modules it imports.
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        sys.modules.pop(module_name, None)
        frame = user_frame(exc, path)
        where = frame_location(frame) if frame else shown
        raise ModelFileError(f"{where}: {_exited(exc, 'while importing the model file')}") from None
    except Exception as exc:
        sys.modules.pop(module_name, None)
        frame = user_frame(exc, path)
        where = frame_location(frame) if frame else shown
        raise ModelFileError(f"{where}: importing the model file failed: {describe(exc)}") from exc
    finally:
        sys.dont_write_bytecode = writes_bytecode

    functions: dict[str, Callable[..., Any]] = {}
    for name in ("build_model", "example_inputs"):
        value = getattr(module, name, None)
        if value is None:
            raise ModelFileError(
                f"{shown}: no function {name}(); a model file must define build_model() -> torch.nn.Module "
                "and example_inputs(batch_size) -> tuple of tensors"
            )
        if not callable(value):
            raise ModelFileError(f"{shown}: {name} is {type(value).__name__}; expected a function")
        functions[name] = value
    for name in (
        "example_targets",
        "loss_fn",
        "make_optimizer",
        "make_scheduler",
        "load_shard",
        "transform",
        "collate_fn",
    ):
        value = getattr(module, name, None)
        if value is not None and not callable(value):
            raise ModelFileError(f"{shown}: {name} is {type(value).__name__}; expected a function")
        if value is not None:
            functions[name] = value

    training = getattr(module, "TRAINING", {})
    _check_training(training, shown)
    return ModelFile(path=path, training=dict(training), **functions)


def data_in_place(model_file: ModelFile, regions: Iterable[str]) -> dict[str, list[str]]:
    """Per region whose train split names shards where they lie (shards' `in_place_pattern`: the first
    stage's functions then read them, importing the model file for its transform), its patterns; none when
    every region's is a dataset."""
    if model_file.load_shard is None:
        return {}
    folder = model_file.path.resolve().parent
    found = {}
    for region in regions:
        given = model_file.call("load_shard", region, "train")
        if in_place_pattern(given, folder) is not None:  # as given: a folder's path stays relative in the build
            found[region] = [given] if isinstance(given, str) else list(given)
    return found


def user_sources(path: Path) -> dict[str, bytes]:
    """The model file and the modules beside it that it imports, directly or through one another (a module
    `name` of the model's folder: `name.py`, or the package `name/`, every .py file of it), by path relative
    to the folder, in path order: what a function needs to import the model file as `python model.py` does.
    Found from the import statements (static: an import inside a function counts, an `importlib` call does not)."""
    folder = path.resolve().parent
    found: dict[str, bytes] = {}
    pending = [path.resolve()]
    while pending:
        source = pending.pop()
        relative = source.relative_to(folder).as_posix()
        if relative in found:
            continue
        found[relative] = source.read_bytes()
        try:
            tree = ast.parse(found[relative])
        except SyntaxError:
            continue  # the import reports it, as Python would
        names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        names += [
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
        ]
        for name in names:
            top = name.split(".")[0]
            module, package = folder / f"{top}.py", folder / top
            if module.is_file():
                pending.append(module)
            elif (package / "__init__.py").is_file():
                pending += sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
    return dict(sorted(found.items()))


def _check_training(training: Any, shown: str) -> None:
    if not isinstance(training, dict):
        raise ModelFileError(f"{shown}: TRAINING is {type(training).__name__}; expected a dict")
    for key, value in training.items():
        if key not in TRAINING_KEYS:
            raise ModelFileError(
                f"{shown}: TRAINING key {key!r} is unknown; expected one of {', '.join(sorted(TRAINING_KEYS))}"
            )
        expected = TRAINING_KEYS[key]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise ModelFileError(
                f"{shown}: TRAINING[{key!r}] is {type(value).__name__}; expected {_type_name(expected)}"
            )
        if key in ("iterations", "epochs", "global_batch_size") and typing.cast(int, value) < 1:
            raise ModelFileError(f"{shown}: TRAINING[{key!r}] is {value}; expected at least 1")
        if key == "max_grad_norm" and not (math.isfinite(typing.cast(float, value)) and typing.cast(float, value) > 0):
            raise ModelFileError(f"{shown}: TRAINING['max_grad_norm'] is {value}; expected a positive number")
        if key == "precision" and value not in PRECISIONS:
            raise ModelFileError(
                f"{shown}: TRAINING['precision'] is {value!r}; expected one of {', '.join(map(repr, PRECISIONS))}"
            )
        if key == "micro_batch_sizes" and not all(isinstance(v, int) and v > 0 for v in typing.cast(list, value)):
            raise ModelFileError(f"{shown}: TRAINING['micro_batch_sizes'] must be a list of positive ints")
    if "iterations" in training and "epochs" in training:
        raise ModelFileError(
            f"{shown}: TRAINING gives both 'iterations' and 'epochs'; give one (epochs: the iterations follow from "
            "the training data's size and the global batch)"
        )


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


#: make_optimizer's first argument, when so named, is the model's (name, parameter) pairs (as
#: `model.named_parameters()` gives them), for groups chosen by name; otherwise its parameters
NAMED_PARAMETERS = "named_parameters"


def takes_named_parameters(model_file: ModelFile) -> bool:
    """Whether make_optimizer's first argument is named `named_parameters` (see NAMED_PARAMETERS)."""
    if model_file.make_optimizer is None:
        return False
    try:
        first = next(iter(inspect.signature(model_file.make_optimizer).parameters), None)
    except (TypeError, ValueError):
        return False
    return first == NAMED_PARAMETERS


def make_model_optimizer(model_file: ModelFile, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The model file's optimizer over the parameters `named` (the default SGD when it makes none),
    called as a plain PyTorch loop calls it: with the parameters, or with (name, parameter) pairs."""
    if model_file.make_optimizer is None:
        lr = float(model_file.training.get("learning_rate", DEFAULT_LEARNING_RATE))
        return torch.optim.SGD([p for _, p in named], lr=lr)
    argument = named if takes_named_parameters(model_file) else [p for _, p in named]
    return model_file.call("make_optimizer", argument)


def _optimizer_of(model_file: ModelFile, probe: nn.Parameter) -> torch.optim.Optimizer:
    """The model file's optimizer over `probe` (the default SGD when it makes none)."""
    return make_model_optimizer(model_file, [("probe", probe)])


def _option_value(model_file: ModelFile, key: str, value: Any) -> Any:
    """An optimizer option as workflow.yaml writes it (a one-element tensor as its number, a tuple as a list)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, tuple):
        value = list(value)
    if value is None or isinstance(value, bool | int | float | str | list):
        return value
    raise ModelFileError(
        f"{model_file.shown}: make_optimizer's option {key}={value!r} cannot be written to workflow.yaml"
    )


def probe_optimizer(model_file: ModelFile) -> OptimizerProbe:
    """Build the model file's optimizer on a probe parameter and take one step: its class and options,
    and the state it then holds per parameter (counted, so any torch.optim optimizer is sized right)."""
    if model_file.make_optimizer is None:
        lr = model_file.training.get("learning_rate", DEFAULT_LEARNING_RATE)
        return OptimizerProbe("SGD", {"lr": float(lr)}, 0)
    probe = nn.Parameter(torch.zeros(4))
    optimizer = _optimizer_of(model_file, probe)
    cls = type(optimizer)
    module = None if getattr(torch.optim, cls.__name__, None) is cls else optimizer_module(model_file, cls)
    options: dict[str, Any] = {}
    # One group: its options are the constructor's (a group dict may set them); several: each group's own
    # are its `ParameterGroup.options` (probe_parameter_groups), beside the constructor's defaults.
    group = optimizer.param_groups[0] if len(optimizer.param_groups) == 1 else optimizer.defaults
    # Only what the constructor takes: the functions call cls(params, **options), and some classes
    # keep defaults their constructor does not accept (AdamW's `decoupled_weight_decay`).
    signature = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    for key in sorted(optimizer.defaults):
        if not takes_any and key not in signature:
            continue
        options[key] = _option_value(model_file, key, group.get(key, optimizer.defaults[key]))
    probe.grad = torch.ones_like(probe)
    try:
        optimizer.step()
    except Exception as exc:
        raise model_file.error_at(exc, f"one step of make_optimizer's {cls.__name__} raised {describe(exc)}") from exc
    state = optimizer.state.get(probe, {})
    # Scalars (Adam's step count) are not per-parameter memory; tensors shaped like the parameter are.
    sized = sum(1 for value in state.values() if isinstance(value, torch.Tensor) and value.shape == probe.shape)
    return OptimizerProbe(cls.__name__ if module is None else cls.__qualname__, options, sized, module)


def optimizer_module(model_file: ModelFile, cls: type) -> str:
    """Where a function imports an optimizer class outside torch.optim from: its module (an installed
    package's, or one beside the model file, which the package ships), or the model file's own name there
    (`user_module_name`). ModelFileError for a class no module holds by name (one made inside a function)."""
    if "<locals>" in cls.__qualname__:
        raise ModelFileError(
            f"{model_file.shown}: make_optimizer returned {cls.__qualname__}, a class made inside a function; the "
            "functions import the optimizer's class by name, so define it at the top of the model file or a module"
        )
    if cls.__module__.startswith("cloudless_user_model_"):
        return user_module_name(model_file.path.name)
    return cls.__module__


def probe_learning_rates(model_file: ModelFile, iterations: int) -> tuple[float, ...] | None:
    """Each iteration's learning rate under the model file's `make_scheduler(optimizer, iterations)`,
    stepped once after each optimizer step as a PyTorch loop does: the functions set it from this
    list, so they never run the model file's code. None without a scheduler. (Several parameter
    groups: `probe_parameter_groups` records each group's.)"""
    if model_file.make_scheduler is None:
        return None
    rates = scheduled_rates(model_file, _optimizer_of(model_file, nn.Parameter(torch.zeros(1))), iterations)
    return tuple(rate[0] for rate in rates)


def scheduled_rates(model_file: ModelFile, optimizer: torch.optim.Optimizer, iterations: int) -> list[list[float]]:
    """Per iteration, each parameter group's learning rate under `make_scheduler(optimizer, iterations)`
    stepped as a PyTorch loop steps it; refused with one error where the functions cannot follow it."""
    # The functions follow the learning rate alone: a scheduler that moves another option (OneCycleLR's
    # momentum) would train differently there, so it is refused rather than half followed.
    others = [
        {key: repr(group[key]) for key in optimizer.defaults if key != "lr" and key in group}
        for group in optimizer.param_groups
    ]
    scheduler = model_file.call("make_scheduler", optimizer, iterations)
    cls = type(scheduler)
    wanted = "return a torch.optim.lr_scheduler scheduler of the optimizer it is given"
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        returned = f"{cls.__module__}.{cls.__qualname__}"
        raise ModelFileError(f"{model_file.shown}: make_scheduler returned {returned}; {wanted}")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ModelFileError(
            f"{model_file.shown}: make_scheduler returned ReduceLROnPlateau, which follows a metric the run "
            "only knows as it trains; the learning rates are fixed at compile time, so use a schedule by iteration"
        )
    if scheduler.optimizer is not optimizer:
        raise ModelFileError(f"{model_file.shown}: make_scheduler's scheduler drives another optimizer; {wanted}")
    rates: list[list[float]] = []
    for iteration in range(iterations):
        moved = sorted(
            {
                key
                for group, kept in zip(optimizer.param_groups, others, strict=True)
                for key, value in kept.items()
                if repr(group.get(key)) != value
            }
        )
        if moved:
            raise ModelFileError(
                f"{model_file.shown}: make_scheduler's {cls.__name__} changes the optimizer's {', '.join(moved)} "
                f"at iteration {iteration}, not only its learning rate; the functions follow the learning rate "
                "alone: keep the others fixed (OneCycleLR: cycle_momentum=False)"
            )
        now = []
        for group in optimizer.param_groups:
            rate = group["lr"]
            rate = float(rate.item() if isinstance(rate, torch.Tensor) else rate)
            if not (math.isfinite(rate) and rate >= 0):
                raise ModelFileError(
                    f"{model_file.shown}: make_scheduler's learning rate at iteration {iteration} is {rate}; "
                    "expected a finite number >= 0"
                )
            now.append(rate)
        rates.append(now)
        if iteration + 1 == iterations:
            break  # a step past the run's end is not the loop's (OneCycleLR refuses it)
        optimizer.step()  # no gradient: nothing changes, but the scheduler sees the step it expects
        try:
            scheduler.step()
        except Exception as exc:
            what = f"step {iteration + 1} of make_scheduler's {cls.__name__} raised {describe(exc)}"
            raise model_file.error_at(exc, what) from exc
    return rates


def probe_parameter_groups(model_file: ModelFile, model: nn.Module, iterations: int) -> tuple[ParameterGroup, ...]:
    """make_optimizer's parameter groups over the model's own parameters, by the model's names: each
    group's parameters, the options it sets beside the constructor's (`probe_optimizer`), and with a
    schedule its rate at each iteration. One group holding every trained parameter: () (the constructor's
    options say it all). A trained parameter in no group would not train in a PyTorch loop either, but
    still cost a function its gradient and sync: refused, with the fix."""
    # Stand-ins on the meta device, with the parameters' names, shapes, dtypes and flags (what a recipe
    # selects by): probing, and stepping a scheduler, touches neither the model nor memory.
    named = [
        (n, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad))
        for n, p in model.named_parameters()
    ]
    optimizer = make_model_optimizer(model_file, named)
    if len(optimizer.param_groups) == 1:
        return ()
    name_of = {id(p): n for n, p in named}
    grouped = {name_of.get(id(p), "") for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in named if p.requires_grad and n not in grouped]
    if missing:
        raise ModelFileError(
            f"{model_file.shown}: make_optimizer's parameter groups leave out {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}: put every trained parameter in a group, or freeze it "
            "(requires_grad_(False))"
        )
    if "" in grouped:
        raise ModelFileError(f"{model_file.shown}: make_optimizer's parameter groups hold a tensor not of the model")
    # the groups' own options as make_optimizer set them, before a scheduler moves their rates
    options = [
        {
            key: _option_value(model_file, key, group[key])
            for key in sorted(optimizer.defaults)
            if key != "params" and key in group and repr(group[key]) != repr(optimizer.defaults[key])
        }
        for group in optimizer.param_groups
    ]
    rates = scheduled_rates(model_file, optimizer, iterations) if model_file.make_scheduler is not None else None
    return tuple(
        ParameterGroup(
            tuple(name_of[id(p)] for p in group["params"]),
            options[index],
            tuple(r[index] for r in rates) if rates is not None else None,
        )
        for index, group in enumerate(optimizer.param_groups)
    )
