"""Worker tasks of ``tests/test_libs.py``: real model code (a tiny BERT from
``transformers``, built from a config; PEFT's LoRA) on torch FSDP1 and fairscale, against
the unwrapped model in one process. ``transformers`` and ``peft`` are imported inside the
tasks: the module imports without them."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview import optim as fv_optim
from tests.scenarios import backend_context
from tests.user_workers import timm_param_groups

VOCAB = 40


def bert_config(decoder: bool) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=20,
        max_position_embeddings=16,
        is_decoder=decoder,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def tiny_bert() -> nn.Module:
    from transformers import BertLMHeadModel

    torch.manual_seed(0)
    return BertLMHeadModel(bert_config(decoder=True))


def fsdp(model: nn.Module, backend: str, per_layer: bool = True) -> nn.Module:
    """``model`` in FSDP, each ``BertLayer`` its own unit when ``per_layer``."""
    if backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.bert.modeling_bert import BertLayer

        policy = ModuleWrapPolicy({BertLayer}) if per_layer else None
        return TorchFSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

    if per_layer:
        layers = model.bert.encoder.layer  # type: ignore[union-attr]
        for i in range(len(layers)):
            layers[i] = FairscaleFSDP(layers[i])
    return FairscaleFSDP(model)


def user_module(model: nn.Module, backend: str) -> Any:
    """The HF model inside the root wrapper (fairscale: inside its flattening wrapper)."""
    return model.module if backend == "torch" else model.module.module


@contextlib.contextmanager
def summoned(model: nn.Module, backend: str) -> Iterator[None]:
    if backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        with TorchFSDP.summon_full_params(model):
            yield
    else:
        with model.summon_full_params():
            yield


def batch(step: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (token ids, labels); rank ``r`` trains on its chunk."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (rows, 6), generator=g)
    return ids, ids.clone()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.chunk(dist.get_world_size())[dist.get_rank()]


def full_params(model: nn.Module, backend: str) -> dict[str, np.ndarray]:
    """The full parameters by original name (every rank); ``backend`` also ``"fsdp2"``
    or ``"ddp"``."""
    if backend in ("fsdp2", "ddp"):
        inner = model.module if backend == "ddp" else model
        return {
            name: (p.full_tensor() if backend == "fsdp2" else p).detach().clone().numpy()  # type: ignore[operator]
            for name, p in inner.named_parameters()  # type: ignore[union-attr]
        }
    out = {}
    with summoned(model, backend):
        for name, param in user_module(model, backend).named_parameters():
            clean = name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")
            # A clone: numpy() would pin the unsharded storage, which FSDP frees after.
            out[clean] = param.detach().clone().numpy()
    return out


def bert_task(backend: str) -> dict[str, Any]:
    """Generation under ``summon_full_params``, timm-style groups (wrong, then made
    right with ``flatview.optim.param_groups``) and PEFT's parameter counts, on a tiny
    BERT decoder with a unit per layer."""
    out: dict[str, Any] = {}
    prompt = torch.tensor([[5, 7, 9], [3, 2, 11]])
    with backend_context(backend):
        reference = tiny_bert()
        out["want_tokens"] = reference.generate(
            prompt, max_new_tokens=4, do_sample=False, pad_token_id=0
        ).tolist()

        # Bare FSDP with one unit runs generation inside the summoning (with a unit per
        # layer it fails at the summoning's exit): the same tokens.
        plain = fsdp(tiny_bert(), backend, per_layer=False)
        with summoned(plain, backend):
            out["plain_tokens"] = (
                user_module(plain, backend)
                .generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
                .tolist()
            )

        model = fsdp(tiny_bert(), backend)
        fv = flatview.wrap(model)
        with summoned(model, backend):
            out["tokens"] = (
                user_module(model, backend)
                .generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
                .tolist()
            )

        # timm's rule on views: refused by the exact check.
        timm = torch.optim.AdamW(timm_param_groups(fv.named_parameters(), 0.05), lr=1e-2)
        try:
            fv.check_param_groups(timm)
        except flatview.ParamGroupError as error:
            out["timm_check"] = str(error)

        # The fix trains as timm's rule on the unwrapped model (after the generation).
        opt = torch.optim.AdamW(fv_optim.param_groups(fv, weight_decay=0.05), lr=1e-2)
        ref_opt = torch.optim.AdamW(timm_param_groups(reference.named_parameters(), 0.05), lr=1e-2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                ids, labels = batch(step)
                model(input_ids=local(ids), labels=local(labels)).loss.backward()
                reference(input_ids=ids, labels=labels).loss.backward()
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad()
        out["warnings"] = [str(w.message) for w in caught if "shape_of" in str(w.message)]
        got = full_params(model, backend)
        want = {n: p.detach().numpy() for n, p in reference.named_parameters()}
        out["max_diff"] = max(float(np.abs(got[n] - want[n]).max()) for n in want)
        out["names_match"] = sorted(got) == sorted(want)
    return out


def peft_task(backend: str) -> dict[str, Any]:
    """PEFT LoRA, its base frozen by name through the views after wrapping: the whole
    counts from ``fv.numel`` equal PEFT's ``get_nb_trainable_parameters`` on the
    unwrapped model; PEFT's own count on the wrapped model sees this rank's pieces."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertForSequenceClassification

    def lora() -> Any:
        torch.manual_seed(0)
        base = BertForSequenceClassification(bert_config(decoder=False))
        return get_peft_model(base, LoraConfig(r=2, target_modules=["query", "value"]))

    out: dict[str, Any] = {}
    with backend_context(backend):
        out["want"] = lora().get_nb_trainable_parameters()
        peft_model = lora()
        frozen = {n for n, p in peft_model.named_parameters() if not p.requires_grad}
        # FSDP1 without use_orig_params refuses a flat parameter mixing frozen and
        # trained parameters: freeze after wrapping, through the views.
        peft_model.requires_grad_(True)
        model = fsdp(peft_model, backend)
        fv = flatview.wrap(model)
        for name, view in fv.named_parameters():
            if name in frozen:
                view.requires_grad_(False)
        out["got"] = (fv.numel(trainable=True), fv.numel())
        out["peft_on_wrapped"] = peft_model.get_nb_trainable_parameters()
        out["repr"] = repr(fv)
    return out
