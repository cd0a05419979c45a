"""Where users train: Lightning (the Trainer and Fabric), Hugging Face accelerate and
its ``Trainer``, and the layer drop of Hugging Face ``transformers`` models.

* :func:`find_wrapper` (:mod:`flatview.integrations.frameworks`): the DDP or FSDP module
  inside a framework's object; ``flatview.wrap`` calls it first, so it accepts what
  ``fabric.setup`` returns, a Trainer, its strategy or an attached LightningModule.
* :mod:`flatview.integrations.lightning`: ``FlatViewCallback`` for the Trainer, the
  strategies it needs, and Fabric's optimizers over views.
* :mod:`flatview.integrations.accelerate`: ``prepare``, the order accelerate needs
  (model, ``flatview.wrap``, optimizers from views, optimizers) in one call.
* :mod:`flatview.integrations.hf_trainer`: ``attach``, the Hugging Face ``Trainer``
  (DDP, FSDP2, FSDP1) with skip sets and layer drop, in one call.
* :mod:`flatview.integrations.layerdrop`: ``LayerDrop``, the layer drop of a Hugging
  Face ``transformers`` model (BART, Whisper, wav2vec2, ...) drawn alike on every rank
  and declared as each step's skip set.

This package sits above the handle: nothing else in flatview imports it but
``flatview.wrap``. It and :mod:`~flatview.integrations.frameworks` import no framework;
:mod:`~flatview.integrations.lightning` imports Lightning when it is imported, and the
others work on the framework objects they are handed (importing only what a branch
needs, when it runs).
"""

from flatview.integrations.frameworks import find_wrapper

__all__ = ["find_wrapper"]
