"""Worker tasks of ``tests/test_layerdrop.py``: tiny ``transformers`` models with layer
drop (BART: encoder and decoder; wav2vec2: read from the config; OPT: decoder-only), a
unit per layer, trained through :class:`flatview.integrations.layerdrop.LayerDrop` on 2
ranks, against the unwrapped model in one process whose dropped layers are passed over by
hand. ``transformers`` is imported inside the tasks: the module imports without it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.integrations.layerdrop import LayerDrop
from tests.lib_workers import full_params, local
from tests.scenarios import backend_context

VOCAB = 40
LAYERS = 3
STEPS = 5
DROP = 0.5

Loss = Callable[..., torch.Tensor]
"""``loss(model, step, chunk=False)``: a step's loss on the global batch, or on this
rank's chunk of it."""


def bart_config(encoder_p: float, decoder_p: float) -> Any:
    from transformers import BartConfig

    return BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=20,
        decoder_ffn_dim=20,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=encoder_p,
        decoder_layerdrop=decoder_p,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )


def tiny_bart(encoder_p: float = DROP, decoder_p: float = DROP, tie: bool = True) -> nn.Module:
    """``tie``: the output projection is the shared embedding (accelerate's FSDP2 cannot
    wrap that: the bare ``Trainer`` refuses it too)."""
    from transformers import BartForConditionalGeneration

    torch.manual_seed(0)
    config = bart_config(encoder_p, decoder_p)
    config.tie_word_embeddings = tie
    return BartForConditionalGeneration(config)


def bart_layers() -> set[type[nn.Module]]:
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer

    return {BartEncoderLayer, BartDecoderLayer}


def wrapped(model: nn.Module, backend: str, layers: set[type[nn.Module]]) -> nn.Module:
    """``model`` in the backend's wrapper, each module of a type in ``layers`` a unit."""
    kinds = tuple(layers)
    if backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy(layers)
        return TorchFSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    if backend == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for _, module in units:
            fully_shard(module)
        fully_shard(model)
        return model
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

    for name, module in units:
        model.set_submodule(name, FairscaleFSDP(module))
    return FairscaleFSDP(model)


def batch(step: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, VOCAB, (rows, 6), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with eps 1e-4 on both sides: some gradients are exactly 0 in exact arithmetic
    (attention's key bias: softmax ignores what adds to every score) and rounding noise
    in float, which eps 1e-8 would turn into steps of the learning rate that differ
    between 2 ranks and 1 process."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)


class PassOver(nn.Module):
    """A dropped layer in the reference: the hidden states go on unchanged, as
    ``transformers`` does when it drops one."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


def reference(
    drops: list[list[str]], model: nn.Module, loss: Loss, micros: int = 1
) -> dict[str, np.ndarray]:
    """``model`` (unwrapped, its layer drop 0) trained with the layers named in ``drops``
    passed over in each micro-batch, stepped every ``micros`` of them."""
    model.train()
    opt = adamw(model.parameters())
    for index, dropped in enumerate(drops):
        kept = {name: model.get_submodule(name) for name in dropped}
        for name in dropped:
            model.set_submodule(name, PassOver())
        loss(model, index).backward()
        for name, layer in kept.items():
            model.set_submodule(name, layer)
        if index % micros == micros - 1:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().numpy() for n, p in model.named_parameters()}


def train(
    model: nn.Module,
    fv: flatview.FlatView,
    layerdrop: LayerDrop,
    loss: Loss,
    before: Callable[[int], Any] | None = None,
    after: Callable[[int], Any] | None = None,
    micros: int = 1,
) -> list[list[str]]:
    """:data:`STEPS` optimizer steps through ``layerdrop`` on this rank's chunks, each of
    ``micros`` micro-batches (all but the last under the wrapper's ``no_sync()``;
    ``before`` and ``after`` each one's forward and backward, given its index); the layers
    each micro-batch dropped."""
    opt = adamw(fv.parameters())
    drops = []
    for index in range(STEPS * micros):
        if before is not None:
            before(index)
        last = index % micros == micros - 1
        with contextlib.nullcontext() if last else model.no_sync(), layerdrop.step():  # type: ignore[operator]
            loss(model, index, chunk=True).backward()
        drops.append(list(layerdrop.dropped))
        if after is not None:
            after(index)
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return drops


def compared(
    model: nn.Module,
    backend: str,
    drops: list[list[str]],
    plain: nn.Module,
    loss: Loss,
    micros: int = 1,
) -> dict[str, Any]:
    """The trained ``model`` against ``plain`` trained by :func:`reference`."""
    got = full_params(model, backend)
    want = reference(drops, plain, loss, micros)
    return {
        "names_match": sorted(got) == sorted(want),
        "max_diff": max(float(np.abs(got[n] - want[n]).max()) for n in want),
    }


def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except flatview.FlatViewError as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def bart_loss(model: nn.Module, step: int, chunk: bool = False) -> torch.Tensor:
    ids, labels = batch(step)
    if chunk:
        ids, labels = local(ids), local(labels)
    return model(input_ids=ids, labels=labels).loss  # type: ignore[no-any-return]


def train_task(backend: str, encoder_p: float, decoder_p: float, seed: int) -> dict[str, Any]:
    """Train a BART through ``LayerDrop``; also what flatview does without it, the
    parameters left without a gradient each step, and the global generator after each
    step."""
    out: dict[str, Any] = {}
    with backend_context(backend):
        model = wrapped(tiny_bart(encoder_p, decoder_p), backend, bart_layers())
        fv = flatview.wrap(model)

        def without() -> None:
            with fv.step():
                bart_loss(model, 0, chunk=True).backward()

        # transformers draws then drop model.encoder.layers.1 and model.decoder.layers.0.
        torch.manual_seed(2)
        out["without"] = _error(without)
        for param in fv.parameters():
            param.grad = None
        layerdrop = LayerDrop(fv, seed=seed)
        out["stacks"] = layerdrop.stacks
        none_grads, rng = [], []

        def record(step: int) -> None:
            rng.append(float(torch.rand([])))
            none_grads.append(
                sorted(n for n, p in fv.named_parameters() if p.grad is None and p.numel())
            )

        drops = train(
            model, fv, layerdrop, bart_loss, lambda step: torch.manual_seed(100 + step), record
        )
        out.update(drops=drops, none_grads=none_grads, rng=rng)
        out["names"] = [n for n, p in fv.named_parameters() if p.numel()]
        out.update(compared(model, backend, drops, tiny_bart(0.0, 0.0), bart_loss))
    return out


def tiny_wav2vec2(layerdrop: float = DROP) -> nn.Module:
    """A wav2vec2 encoder: its stack reads ``self.config.layerdrop`` and runs dropped
    layers anyway under torch FSDP (``synced_gpus``)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        hidden_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        intermediate_size=20,
        conv_dim=(8, 8),
        conv_stride=(2, 2),
        conv_kernel=(3, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        layerdrop=layerdrop,
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
    )
    torch.manual_seed(0)
    return Wav2Vec2Model(config)


def wav2vec2_loss(model: nn.Module, step: int, chunk: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, target = torch.randn(4, 40, generator=g), torch.randn(4, 9, 16, generator=g)
    if chunk:
        x, target = local(x), local(target)
    # Against a target: the square of layer-normed states alone is about 1 whatever the
    # parameters, and AdamW would step on the rounding noise of its gradient.
    return (model(x).last_hidden_state - target).pow(2).mean()  # type: ignore[no-any-return]


def edges_task() -> dict[str, Any]:
    """On DDP: refusals, evaluation, the stack's value, resuming the draws, gradient
    checkpointing (layers recomputed in the backward), ranks given different seeds,
    ``unwrap`` and ``remove``."""
    import copy
    import pickle

    from transformers import BertModel

    from tests.lib_workers import bert_config

    out: dict[str, Any] = {}
    bert = nn.parallel.DistributedDataParallel(BertModel(bert_config(decoder=False)))
    out["no_stack"] = _error(lambda: LayerDrop(flatview.wrap(bert)))

    net = tiny_bart()
    net.gradient_checkpointing_enable({"use_reentrant": False})
    model = nn.parallel.DistributedDataParallel(net)
    fv = flatview.wrap(model)
    layerdrop = LayerDrop(fv, seed=0)
    out["second"] = _error(lambda: LayerDrop(fv))
    out["outside"] = _error(lambda: bart_loss(model, 0, chunk=True).backward())
    ids, labels = batch(0)
    net.eval()
    with torch.no_grad():
        out["eval_loss"] = float(model(input_ids=ids, labels=labels).loss)
    net.train()
    value = net.model.encoder.layerdrop  # type: ignore[union-attr]
    out["value"] = (type(value).__name__, value)
    out["pickled"] = type(pickle.loads(pickle.dumps(value))).__name__
    out["copied"] = type(copy.deepcopy(value)).__name__

    def resume_at_2(step: int) -> None:
        if step == 2:
            saved = layerdrop.state_dict()
            out["next"] = [layerdrop.draw() and list(layerdrop.dropped) for _ in range(2)]
            layerdrop.load_state_dict(saved)

    out["drops"] = train(model, fv, layerdrop, bart_loss, resume_at_2)
    out.update(compared(model, "ddp", out["drops"], tiny_bart(0.0, 0.0), bart_loss))
    plain = tiny_bart(0.0, 0.0).eval()
    with torch.no_grad():
        out["eval_want"] = float(plain(input_ids=ids, labels=labels).loss)
    layerdrop.remove()
    out["removed"] = type(net.model.decoder.layerdrop).__name__  # type: ignore[union-attr]

    # One rank's seed differs: its first step drops other layers.
    differing = LayerDrop(fv, seed=dist.get_rank())

    def one_step() -> None:
        with differing.step():
            bart_loss(model, 0, chunk=True).backward()

    out["seeds"] = _error(one_step)
    fv.unwrap()
    out["unwrapped"] = _error(one_step)
    differing.remove()
    return out


def tiny_opt(layerdrop: float = DROP) -> nn.Module:
    """A decoder-only model: one stack, ``self.layerdrop``."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=LAYERS,
        ffn_dim=20,
        num_attention_heads=2,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=layerdrop,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return OPTForCausalLM(config)


def opt_loss(model: nn.Module, step: int, chunk: bool = False) -> torch.Tensor:
    ids, _ = batch(step)
    if chunk:
        ids = local(ids)
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def wav2vec2_layers() -> set[type[nn.Module]]:
    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2EncoderLayer

    return {Wav2Vec2EncoderLayer}


def opt_layers() -> set[type[nn.Module]]:
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    return {OPTDecoderLayer}


KINDS: dict[str, tuple[Callable[..., nn.Module], Callable[[], set[type[nn.Module]]], Loss]] = {
    "wav2vec2": (tiny_wav2vec2, wav2vec2_layers, wav2vec2_loss),
    "opt": (tiny_opt, opt_layers, opt_loss),
}
"""Models with one stack: how to build one (its probability), its layers' types, its loss."""


def model_task(kind: str, backend: str) -> dict[str, Any]:
    """Train one of :data:`KINDS` through ``LayerDrop``, against the reference; also what
    its config reads as its probability (JSON, pickled)."""
    import pickle

    build, layers, loss = KINDS[kind]
    with backend_context(backend):
        net = build(DROP)
        model = wrapped(net, backend, layers())
        fv = flatview.wrap(model)
        layerdrop = LayerDrop(fv, seed=0)
        config = net.config
        out: dict[str, Any] = {
            "stacks": layerdrop.stacks,
            "value": (type(config.layerdrop).__name__, config.layerdrop),
            "json": f'"layerdrop": {DROP}' in config.to_json_string(),
            "pickled": type(pickle.loads(pickle.dumps(config)).layerdrop).__name__,
        }
        out["drops"] = train(model, fv, layerdrop, loss)
        out.update(compared(model, backend, out["drops"], build(0.0), loss))
    return out


def accumulation_task(backend: str) -> dict[str, Any]:
    """A BART through ``LayerDrop``, 2 micro-batches per optimizer step (the first under
    ``no_sync()``), each drawing its own layers."""
    with backend_context(backend):
        model = wrapped(tiny_bart(), backend, bart_layers())
        fv = flatview.wrap(model)
        drops = train(model, fv, LayerDrop(fv, seed=0), bart_loss, micros=2)
        out = {"drops": drops}
        out.update(compared(model, backend, drops, tiny_bart(0.0, 0.0), bart_loss, micros=2))
    return out
