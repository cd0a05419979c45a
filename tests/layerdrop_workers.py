"""Worker tasks of ``tests/test_layerdrop.py``: a tiny BART from ``transformers`` with
layer drop in its encoder and decoder, a unit per layer, trained through
:class:`flatview.integrations.layerdrop.LayerDrop` on 2 ranks, against the unwrapped model
in one process whose dropped layers are passed over by hand. ``transformers`` is imported
inside the tasks: the module imports without it."""

from __future__ import annotations

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


def tiny_bart(encoder_p: float = DROP, decoder_p: float = DROP) -> nn.Module:
    from transformers import BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(bart_config(encoder_p, decoder_p))


def layer_classes() -> set[type[nn.Module]]:
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer

    return {BartEncoderLayer, BartDecoderLayer}


def wrapped(model: nn.Module, backend: str) -> nn.Module:
    """``model`` in the backend's wrapper, each encoder and decoder layer a unit."""
    if backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy(layer_classes())
        return TorchFSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for module in list(model.modules()):
            if isinstance(module, tuple(layer_classes())):
                fully_shard(module)
        fully_shard(model)
        return model
    if backend == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

    for stack in (model.model.encoder, model.model.decoder):  # type: ignore[union-attr]
        for i in range(len(stack.layers)):
            stack.layers[i] = FairscaleFSDP(stack.layers[i])
    return FairscaleFSDP(model)


def full(model: nn.Module, backend: str) -> dict[str, np.ndarray]:
    if backend in ("torch", "fairscale"):
        return full_params(model, backend)
    inner = model.module if backend == "ddp" else model
    out = {}
    for name, param in inner.named_parameters():
        tensor = param.full_tensor() if backend == "fsdp2" else param  # type: ignore[operator]
        out[name] = tensor.detach().clone().numpy()
    return out


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
    drops: list[list[str]], model: nn.Module, loss: Callable[[nn.Module, int], torch.Tensor]
) -> dict[str, np.ndarray]:
    """``model`` (unwrapped, its layer drop 0) trained with the layers named in ``drops``
    passed over in each step."""
    model.train()
    opt = adamw(model.parameters())
    for step, dropped in enumerate(drops):
        kept = {name: model.get_submodule(name) for name in dropped}
        for name in dropped:
            model.set_submodule(name, PassOver())
        loss(model, step).backward()
        for name, layer in kept.items():
            model.set_submodule(name, layer)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().numpy() for n, p in model.named_parameters()}


def bart_loss(model: nn.Module, step: int, chunk: bool = False) -> torch.Tensor:
    ids, labels = batch(step)
    if chunk:
        ids, labels = local(ids), local(labels)
    return model(input_ids=ids, labels=labels).loss  # type: ignore[no-any-return]


def train_task(backend: str, encoder_p: float, decoder_p: float, seed: int) -> dict[str, Any]:
    """Train through ``LayerDrop``; also what flatview does without it, the parameters
    left without a gradient each step, and the global generator after each step."""
    out: dict[str, Any] = {}
    with backend_context(backend):
        model = wrapped(tiny_bart(encoder_p, decoder_p), backend)
        fv = flatview.wrap(model)
        ids, labels = batch(0)
        # transformers draws then drop model.encoder.layers.1 and model.decoder.layers.0.
        torch.manual_seed(2)
        try:
            with fv.step():
                model(input_ids=local(ids), labels=local(labels)).loss.backward()
        except flatview.FlatViewError as error:
            out["without"] = f"{type(error).__name__}: {error}"
        for param in fv.parameters():
            param.grad = None
        layerdrop = LayerDrop(fv, seed=seed)
        out["stacks"] = layerdrop.stacks
        opt = adamw(fv.parameters())
        drops, none_grads, rng = [], [], []
        for step in range(STEPS):
            ids, labels = batch(step)
            torch.manual_seed(100 + step)
            with layerdrop.step():
                model(input_ids=local(ids), labels=local(labels)).loss.backward()
            rng.append(float(torch.rand([])))
            drops.append(list(layerdrop.dropped))
            none_grads.append(
                sorted(n for n, p in fv.named_parameters() if p.grad is None and p.numel())
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.update(drops=drops, none_grads=none_grads, rng=rng)
        out["names"] = [n for n, p in fv.named_parameters() if p.numel()]
        got = full(model, backend)
        want = reference(drops, tiny_bart(0.0, 0.0), bart_loss)
        out["names_match"] = sorted(got) == sorted(want)
        out["max_diff"] = max(float(np.abs(got[n] - want[n]).max()) for n in want)
        out["rank"] = dist.get_rank()
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


def wav2vec2_task(backend: str) -> dict[str, Any]:
    import pickle

    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2EncoderLayer

    out: dict[str, Any] = {}
    with backend_context(backend):
        net = tiny_wav2vec2()
        if backend == "torch":
            from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            model = TorchFSDP(
                net,
                auto_wrap_policy=ModuleWrapPolicy({Wav2Vec2EncoderLayer}),
                device_id=torch.device("cpu"),
            )
        else:
            model = nn.parallel.DistributedDataParallel(net)
        fv = flatview.wrap(model)
        layerdrop = LayerDrop(fv, seed=0)
        config = net.config
        out["value"] = (type(config.layerdrop).__name__, config.layerdrop)
        out["json"] = '"layerdrop": 0.5' in config.to_json_string()
        out["pickled"] = type(pickle.loads(pickle.dumps(config)).layerdrop).__name__
        opt = adamw(fv.parameters())
        drops = []
        for step in range(STEPS):
            with layerdrop.step():
                wav2vec2_loss(model, step, chunk=True).backward()
            drops.append(list(layerdrop.dropped))
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["drops"] = drops
        got = full(model, backend)
        want = reference(drops, tiny_wav2vec2(0.0), wav2vec2_loss)
        out["names_match"] = sorted(got) == sorted(want)
        out["diffs"] = {n: float(np.abs(got[n] - want[n]).max()) for n in want}
        out["max_diff"] = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    return out


def wav2vec2_loss(model: nn.Module, step: int, chunk: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, target = torch.randn(4, 40, generator=g), torch.randn(4, 9, 16, generator=g)
    if chunk:
        x, target = local(x), local(target)
    # Against a target: the square of layer-normed states alone is about 1 whatever the
    # parameters, and AdamW would step on the rounding noise of its gradient.
    return (model(x).last_hidden_state - target).pow(2).mean()  # type: ignore[no-any-return]


def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except flatview.FlatViewError as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def edges_task() -> dict[str, Any]:
    """On DDP: refusals, evaluation, the config's value, resuming the draws, gradient
    checkpointing (layers recomputed in the backward), and ``remove``."""
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
    ids, labels = batch(0)
    out["outside"] = _error(
        lambda: model(input_ids=local(ids), labels=local(labels)).loss.backward()
    )
    net.eval()
    with torch.no_grad():
        out["eval_loss"] = float(model(input_ids=ids, labels=labels).loss)
    net.train()
    value = net.model.encoder.layerdrop  # type: ignore[union-attr]
    out["value"] = (type(value).__name__, value)
    out["pickled"] = type(pickle.loads(pickle.dumps(value))).__name__
    out["copied"] = type(copy.deepcopy(value)).__name__
    opt = adamw(fv.parameters())
    drops = []
    for step in range(STEPS):
        if step == 2:
            saved = layerdrop.state_dict()
            out["next"] = [layerdrop.draw() and list(layerdrop.dropped) for _ in range(2)]
            layerdrop.load_state_dict(saved)
        with layerdrop.step():
            bart_loss(model, step, chunk=True).backward()
        drops.append(list(layerdrop.dropped))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["drops"] = drops
    got = full(model, "ddp")
    want = reference(drops, tiny_bart(0.0, 0.0), bart_loss)
    out["max_diff"] = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    plain = tiny_bart(0.0, 0.0).eval()
    with torch.no_grad():
        out["eval_want"] = float(plain(input_ids=ids, labels=labels).loss)
    layerdrop.remove()
    out["removed"] = type(net.model.decoder.layerdrop).__name__
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


def opt_task(backend: str) -> dict[str, Any]:
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    with backend_context(backend):
        if backend == "torch":
            from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            model = TorchFSDP(
                tiny_opt(),
                auto_wrap_policy=ModuleWrapPolicy({OPTDecoderLayer}),
                device_id=torch.device("cpu"),
            )
        else:
            model = nn.parallel.DistributedDataParallel(tiny_opt())
        fv = flatview.wrap(model)
        layerdrop = LayerDrop(fv, seed=0)
        opt = adamw(fv.parameters())
        drops = []
        for step in range(STEPS):
            with layerdrop.step():
                opt_loss(model, step, chunk=True).backward()
            drops.append(list(layerdrop.dropped))
            opt.step()
            opt.zero_grad(set_to_none=True)
        got = full(model, backend)
        want = reference(drops, tiny_opt(0.0), opt_loss)
        return {
            "drops": drops,
            "stacks": layerdrop.stacks,
            "names_match": sorted(got) == sorted(want),
            "max_diff": max(float(np.abs(got[n] - want[n]).max()) for n in want),
        }
