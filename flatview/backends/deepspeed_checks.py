"""Which models flatview's DeepSpeed adapter (:mod:`flatview.backends.deepspeed`) takes,
and what it checks at wrap time (:func:`inspect`): the DeepSpeed version, every engine
and ZeRO internal the adapter reads, calls or replaces, and every configuration flatview
has not made exact, each refused with a :class:`WrapError` that names it (before
anything is patched, and before any collective).

Supported: ZeRO stages 1, 2 and 3 of a ``DeepSpeedEngine`` over one data-parallel group,
fp32 parameters and gradients, or bf16 ones over fp32 masters (reduced and accumulated in
bf16 as DeepSpeed does by default), no offload, any ``gradient_accumulation_steps``
(:mod:`~flatview.backends.deepspeed_grads`), any
``gradient_clipping`` (flatview clips by the global norm exactly as
``torch.nn.utils.clip_grad_norm_``), any bucket sizes, ``overlap_comm``,
``contiguous_gradients``, ``round_robin_gradients``, ZeRO 3's prefetching, persistence
and ``sub_group_size`` (flatview reduces gradients itself; the rest only moves
parameters).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flatview.backends.internals import optional_class, require_attrs, require_autograd_internals
from flatview.deferred import Deferred
from flatview.errors import WrapError

TESTED = "DeepSpeed 0.19.8"
_TESTED_SERIES = (0, 19)
"""The DeepSpeed releases the adapter takes: its internals (and what they mean) change
between minor releases more often than its names, which :func:`require_attrs` checks."""

# Engine members the adapter reads, calls or replaces.
_ENGINE = (
    "module",
    "optimizer",
    "lr_scheduler",
    "zero_optimization_stage",
    "fp16_enabled",
    "bfloat16_enabled",
    "gradient_accumulation_steps",
    "is_gradient_accumulation_boundary",
    "managed_gradient_accumulation",
    "get_data_types",
    "gradient_clipping",
    "postscale_gradients",
    "gradient_predivide_factor",
    "zero_offload_optimizer",
    "zero_offload_param",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_hpz_partition_size",
    "allreduce_gradients",
    "_backward_prologue",
    "no_sync",
    "inside_no_sync_ctxt",
    "save_checkpoint",
    "load_checkpoint",
    "module_state_dict",
    "load_module_state_dict",
    "zero_reduce_bucket_size",
    "zero_compute_grad_norm",
)
_ZERO_COMMON = (
    "optimizer",
    "dp_process_group",
    "step",
    "zero_grad",
    "update_hook_state_and_maybe_run_epilogue",
    "should_refresh_expected_hook_count",
    "reduce_ready_partitions_and_remove_grads",
    "overlapping_partition_gradients_reduce_epilogue",
    "backward_epilogue",
    "state_dict",
    "load_state_dict",
)
_ZERO_12 = (
    "bit16_groups",
    "round_robin_bit16_groups",
    "round_robin_bit16_offsets",
    "bit16_groups_flat",
    "single_partition_of_fp32_groups",
    "process_gradients",
    "reduce_gradients",
    "update_lp_params",
    "_update_model_bit16_weights",
    "refresh_fp32_params",
)
_ZERO_3 = (
    "fp16_groups",
    "fp32_partitioned_groups_flat",
    "sub_group_to_group_id",
    "leaf_parameters",
    "_pre_step",
    "_partition_all_parameters",
    "_reassign_or_swap_out_partitioned_parameters",
    "_post_step",
)


_ENGINE_MODULE = "deepspeed.runtime.engine"


def is_engine(model: object) -> bool:
    """Whether ``model`` is a ``DeepSpeedEngine``. Looked up among the modules already
    imported: an engine exists only once DeepSpeed is, and importing DeepSpeed (seconds,
    and an accelerator chosen for the process) only to turn down another model would
    cost every ``flatview.wrap`` of a model no other backend takes."""
    found = sys.modules.get(_ENGINE_MODULE)
    cls = getattr(found, "DeepSpeedEngine", None)
    return isinstance(cls, type) and isinstance(model, cls)


@dataclass(frozen=True)
class DeepSpeedModel:
    """A DeepSpeed engine that passed every check (:func:`inspect`)."""

    engine: Any
    zero: Any
    """The engine's ZeRO optimizer (``engine.optimizer``)."""
    stage: int
    group: dist.ProcessGroup | None
    """The data-parallel group ZeRO partitions over."""
    rank: int
    world_size: int


def inspect(model: Any) -> DeepSpeedModel:
    """Check ``model`` (a ``DeepSpeedEngine``) for everything the adapter relies on, and
    refuse what flatview does not support (see the module docstring), before anything is
    patched."""
    stage = _check(model)
    zero = model.optimizer
    group: dist.ProcessGroup | None = zero.dp_process_group
    return DeepSpeedModel(
        model, zero, stage, group, dist.get_rank(group), dist.get_world_size(group)
    )


def check_version() -> str:
    """The running DeepSpeed's version (an engine exists, so it is imported), refused
    unless of the tested series."""
    version = str(getattr(sys.modules.get("deepspeed"), "__version__", "unknown"))
    parts = version.split(".")[:2]
    series = tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else ()
    if series != _TESTED_SERIES:
        raise WrapError(
            f"flatview's DeepSpeed backend is tested with DeepSpeed "
            f"{'.'.join(map(str, _TESTED_SERIES))}.x ({TESTED}), found {version}: the ZeRO "
            "internals it drives change between releases"
        )
    return version


def _check(engine: Any) -> int:
    """Every check of the module docstring, in order; the ZeRO stage."""
    found = f"{TESTED}; found DeepSpeed {check_version()}"
    require_autograd_internals(found)
    require_attrs(engine, _ENGINE, "the DeepSpeed engine", found)
    pipeline = optional_class("deepspeed.runtime.pipe.engine", "PipelineEngine")
    if pipeline is not None and isinstance(engine, pipeline):
        raise WrapError("flatview does not support DeepSpeed's pipeline engine")
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2, 3):
        raise WrapError(
            f"flatview supports DeepSpeed's ZeRO stages 1, 2 and 3; this engine runs stage "
            f"{stage} (for plain data parallelism wrap a DistributedDataParallel model)"
        )
    zero = engine.optimizer
    if zero is None or not hasattr(zero, "optimizer"):
        raise WrapError(
            "the DeepSpeed engine has no ZeRO optimizer: build it with an optimizer "
            "(deepspeed.initialize(model=..., optimizer=..., config=...))"
        )
    # The configuration first: some choose another ZeRO optimizer class (bf16 with fp32
    # accumulation on ZeRO 1), whose missing internals would hide the setting to change.
    _check_config(engine)
    require_attrs(zero, _ZERO_COMMON, f"DeepSpeed's {type(zero).__name__}", found)
    require_attrs(zero, _ZERO_3 if stage == 3 else _ZERO_12, type(zero).__name__, found)
    _check_precision(engine, zero)
    _check_parallelism(engine, zero, stage)
    _check_optimizer(engine, zero)
    return stage


def _check_precision(engine: Any, zero: Any) -> None:
    if engine.fp16_enabled():
        raise WrapError(
            "flatview supports DeepSpeed's fp32 and bf16 training; this engine trains with "
            "fp16 and fp32 master weights (fp16 cannot be driven on a CPU, where flatview "
            "is tested: use bf16)"
        )
    bf16 = engine.bfloat16_enabled()
    autocast = getattr(engine, "torch_autocast_enabled", None)
    if autocast is not None and autocast():
        raise WrapError("flatview does not support DeepSpeed's torch_autocast")
    dtype = torch.bfloat16 if bf16 else torch.float32
    dtypes = {p.dtype for p in engine.module.parameters()}
    if dtypes != {dtype}:
        raise WrapError(
            f"flatview supports {dtype} parameters on this DeepSpeed engine; this model has "
            f"{', '.join(sorted(map(str, dtypes)))}"
        )
    communication = engine.communication_data_type
    if communication not in (None, dtype):
        raise WrapError(
            f"the config reduces gradients in {communication} (communication_data_type); "
            f"flatview reduces {dtype} gradients in {dtype}, as DeepSpeed does by default: "
            "leave it unset"
        )


def _check_config(engine: Any) -> None:
    if not engine.managed_gradient_accumulation():
        raise WrapError(
            "flatview supports DeepSpeed's managed gradient accumulation (the engine counts "
            "micro-steps to its boundary): leave managed_gradient_accumulation on"
        )
    model_dtype, accumulated = engine.get_data_types()
    if accumulated != model_dtype:
        raise WrapError(
            f"the config accumulates gradients in {accumulated} (data_types.grad_accum_dtype) "
            f"over {model_dtype} parameters; flatview accumulates them in the parameters' "
            "dtype, as DeepSpeed does by default: leave it unset"
        )
    if _offloads(engine.zero_offload_optimizer()) or _offloads(engine.zero_offload_param()):
        raise WrapError(
            "flatview does not support ZeRO offload (offload_optimizer / offload_param): "
            "the optimizer must step the partitions where the engine keeps them"
        )
    if engine.zero_quantized_weights() or engine.zero_quantized_gradients():
        raise WrapError(
            "flatview does not support ZeRO++ quantized weights or gradients "
            "(zero_quantized_weights / zero_quantized_gradients)"
        )
    if engine.zero_hpz_partition_size() > 1:
        raise WrapError(
            "flatview does not support ZeRO++ hierarchical partitioning "
            f"(zero_hpz_partition_size={engine.zero_hpz_partition_size()})"
        )
    if not engine.postscale_gradients() or engine.gradient_predivide_factor() != 1.0:
        raise WrapError(
            "flatview averages gradients as DeepSpeed does by default (sum over the ranks, "
            "then divide by the world size): leave prescale_gradients and "
            "gradient_predivide_factor at their defaults"
        )
    if not getattr(engine, "enable_backward_allreduce", True):
        raise WrapError(
            "this engine's backward does not reduce gradients (enable_backward_allreduce is "
            "off); flatview reduces them in every backward"
        )
    deepcompile = getattr(engine, "is_deepcompile_enabled", None)
    if deepcompile is not None and deepcompile():
        raise WrapError("flatview does not support DeepSpeed's DeepCompile")
    if getattr(engine, "zenflow", False):
        raise WrapError("flatview does not support DeepSpeed's ZenFlow")


def _offloads(config: Any) -> bool:
    """Whether an offload section of the config moves something off the device."""
    if config is None:
        return False
    device = getattr(config, "device", "none")
    return str(getattr(device, "value", device)) != "none"


def _check_parallelism(engine: Any, zero: Any, stage: int) -> None:
    if getattr(engine, "mpu", None) is not None:
        raise WrapError(
            "flatview does not support DeepSpeed with model parallelism (an mpu was given)"
        )
    if getattr(engine, "has_moe_layers", False):
        raise WrapError("flatview does not support DeepSpeed's mixture-of-experts layers")
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        raise WrapError("flatview does not support DeepSpeed's sequence parallelism")
    if stage == 3 and zero.leaf_parameters:
        raise WrapError(
            "flatview does not support ZeRO 3 leaf modules (set_z3_leaf_modules): their "
            "parameters are reduced by module hooks flatview does not drive"
        )


def _check_optimizer(engine: Any, zero: Any) -> None:
    client = zero.optimizer
    if not isinstance(client, torch.optim.Optimizer):
        raise WrapError(
            f"the engine steps a {type(client).__name__}, not a torch optimizer: build the "
            "engine with a torch optimizer (or flatview.optim.Deferred), not with one the "
            "config names (DeepSpeed's own fused or CPU optimizers)"
        )
    if isinstance(client, torch.optim.Adagrad):
        raise WrapError(
            "ZeRO replaces a torch Adagrad by one over its flat partitions (dropping its "
            "parameter groups) whose state is made when it is built; flatview cannot step "
            "it per parameter. Use another optimizer, or flatview.optim.Deferred with an "
            "Adagrad built over the views"
        )
    if client.state:
        raise WrapError(
            "the engine's optimizer has state already (it stepped): wrap the engine right "
            "after deepspeed.initialize, before the first step"
        )
    if isinstance(client, Deferred) and engine.lr_scheduler is not None:
        raise WrapError(
            "the engine was built with flatview.optim.Deferred and a learning-rate "
            "scheduler: the scheduler would set the Deferred's learning rate, which steps "
            "nothing. Schedule the optimizers given to Deferred.set instead"
        )
