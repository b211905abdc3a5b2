"""Hugging Face ``transformers`` models as :class:`kiln.Model`\\ s (Composer's ``HuggingFaceModel``).

The wrapper adds no layers: its one child is the transformers model, under the attribute
``model``, so a checkpoint's weights are the model's own ``state_dict`` keys behind ``model.``,
beside an ``_extra_state`` entry holding the model's class and ``config`` as JSON. That entry is
what lets ``kiln checkpoint export PATH --hf OUT`` (:func:`kiln.checkpoint.export.export_hf`)
write a folder ``from_pretrained`` loads, from the checkpoint alone.

Only :meth:`HuggingFaceModel.from_config` and :meth:`HuggingFaceModel.from_pretrained` import
transformers themselves; wrapping a model that exists uses what its own import loaded.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from kiln.core.batch import IGNORE_INDEX
from kiln.core.model import Model
from kiln.models.hf_stages import self_contained_layers
from kiln.models.tp_plan import (
    full_logits,
    huggingface_sequence_parallel_plan,
    huggingface_sequence_parallel_refusal,
    huggingface_tp_plan,
    token_mean_cross_entropy,
)

__all__ = ["HuggingFaceModel", "EXTRA_STATE_FORMAT", "is_huggingface_model", "model_task"]

EXTRA_STATE_FORMAT = "kiln.huggingface/1"
"""The ``format`` field of the JSON a :class:`HuggingFaceModel` keeps in its ``_extra_state``."""


# Class-name endings of the classifier heads whose default metric is accuracy.
_CLASSIFIER_SUFFIXES = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForImageClassification",
    "ForAudioClassification",
    "ForVideoClassification",
    "ForMultipleChoice",
)


def is_huggingface_model(module: Any) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (told without importing transformers)."""
    return (
        isinstance(module, nn.Module)
        and hasattr(type(module), "base_model_prefix")
        and callable(getattr(getattr(module, "config", None), "to_dict", None))
    )


def model_task(model: nn.Module) -> str | None:
    """``"causal_lm"``, ``"classification"`` or None (anything else), from the model's class.

    A causal LM is a class transformers' ``AutoModelForCausalLM`` builds (or, without that table,
    one whose name ends in ``ForCausalLM``/``LMHeadModel``); a classifier is a ``...For*Classification``
    or ``...ForMultipleChoice`` head.
    """
    name = type(model).__name__
    if name.endswith(_CLASSIFIER_SUFFIXES):
        return "classification"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    try:  # transformers is loaded already: the model is one of its classes
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - a transformers-like model without transformers
        return None
    causal = {n for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in _as_names(value)}
    return "causal_lm" if name in causal else None


def _as_names(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


class HuggingFaceModel(Model):
    """A Hugging Face ``transformers`` model (``PreTrainedModel``) as a :class:`kiln.Model`.

    Batches are dicts of the model's keyword arguments (``input_ids``, ``attention_mask``,
    ``labels``, ``pixel_values``, ...): ``forward(batch)`` is ``model(**batch)``, with
    ``use_cache=False`` added for models that take it (a training step keeps no key/value cache).
    The loss is the output's ``loss``, which transformers computes from ``labels``; without one
    (a model that returns none, or a pipeline, whose stages run without the labels) it is the
    cross-entropy of ``logits`` against ``labels``, shifted as ``shift_labels`` says. ``eval_forward`` returns the ``logits``, so ``Trainer.predict`` gives
    logits too.

    Args:
        model: the transformers model (any ``nn.Module`` with a ``config`` that has ``to_dict``).
        tokenizer: kept as ``self.tokenizer`` for the user's own use (kiln reads nothing from it).
        metrics: evaluation metrics, a dict of torchmetrics ``Metric`` objects by name or a list
            of them (named by class); None: ``LanguagePerplexity`` for causal LMs, ``Accuracy``
            for classifiers, nothing else (the evaluator always adds ``loss``).
        shift_labels: the metrics compare the logits at position ``t`` with the label at ``t + 1``
            (next-token prediction). None: True for causal LMs, False otherwise. transformers
            shifts inside its own loss either way; this only concerns metrics and a loss kiln
            computes itself.

    Under every strategy the wrapper is the model kiln parallelises: its blocks are the
    transformers model's layers (``model.model.layers.0``, ...), tensor parallelism uses the
    model's own ``config.base_model_tp_plan`` when given no plan, and pipeline split points are
    module names such as ``"model.model.layers.2"``. For Llama-family causal LMs (Llama, Mistral,
    Qwen2) tensor parallelism adds sequence and loss parallelism by default
    (:mod:`kiln.parallel.transforms.sequence_parallel`): the logits then stay sharded over the
    vocabulary, the labels are kept from the transformers model and :meth:`loss` computes the
    token-mean cross-entropy on the shards; :meth:`eval_forward` and the metrics gather them whole.

    Example::

        from transformers import LlamaConfig, LlamaForCausalLM
        model = kiln.models.HuggingFaceModel(LlamaForCausalLM(LlamaConfig(...)))
        trainer = kiln.Trainer(model, train_dataloader=loader, max_duration="100ba", strategy="zero3")
        # loader batches: {"input_ids": LongTensor (N, T), "labels": LongTensor (N, T)}
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        metrics: Mapping[str, Any] | Sequence[Any] | Any | None = None,
        shift_labels: bool | None = None,
    ) -> None:
        super().__init__()
        config = getattr(model, "config", None)
        if not isinstance(model, nn.Module) or not callable(getattr(config, "to_dict", None)):
            raise TypeError(
                f"HuggingFaceModel(model=...) takes a transformers model (an nn.Module with a config), "
                f"got a {type(model).__name__}; build one with e.g. transformers.AutoModelForCausalLM.from_config(config)"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.task = model_task(model)
        self.shift_labels = self.task == "causal_lm" if shift_labels is None else bool(shift_labels)
        self._metrics = _named_metrics(metrics)
        # Set by tensor parallelism when its plan leaves the LM head's logits sharded over the
        # vocabulary (kiln.parallel.transforms.sequence_parallel): forward then keeps the labels from
        # the transformers model and loss computes the cross-entropy on the shards.
        self.loss_parallel = False
        # A causal LM builds a key/value cache by default (config.use_cache), which training never
        # reads and a pipeline cannot pass between stages: turned off per call, not in the config,
        # so an exported model still generates with its cache.
        self._no_cache = "use_cache" in _parameters(model.forward)

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | str | Any,
        *,
        auto_class: str = "AutoModelForCausalLM",
        dtype: str | torch.dtype | None = None,
        tokenizer: str | None = None,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
        shift_labels: bool | None = None,
    ) -> HuggingFaceModel:
        """A freshly initialised model from a config (for YAML: ``model.type:
        kiln.models.HuggingFaceModel.from_config``).

        Args:
            config: a dict with ``model_type`` and the config's fields (``{"model_type": "llama",
                "hidden_size": 64, ...}``), a folder or ``config.json`` file, or a config object.
            auto_class: the transformers ``AutoModelFor...`` class that builds the model.
            dtype: the parameters' dtype (``"float64"``, ``"bfloat16"``, ...); None: transformers' default.
            tokenizer: a folder (or hub name) to load the tokenizer from with ``AutoTokenizer``.
            metrics / shift_labels: as for the constructor.

        Example::

            model = HuggingFaceModel.from_config({"model_type": "llama", "vocab_size": 256,
                                                  "hidden_size": 64, "num_hidden_layers": 2})
        """
        transformers = _transformers()
        config = _config(transformers, config)
        model = _auto_class(transformers, auto_class).from_config(config)
        if dtype is not None:
            model = model.to(_dtype(dtype))
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None
        return cls(model, tok, metrics=metrics, shift_labels=shift_labels)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        auto_class: str = "AutoModelForCausalLM",
        dtype: str | torch.dtype | None = None,
        tokenizer: bool | str = False,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
        shift_labels: bool | None = None,
        meta_init: bool = True,
        **kwargs: Any,
    ) -> HuggingFaceModel:
        """A pretrained model (a folder, e.g. one ``kiln checkpoint export --hf`` wrote, or a hub
        name), with its tokenizer when ``tokenizer`` is True (from the same place) or a folder or
        hub name to load it from. ``kwargs`` go to the config (or the auto class's ``from_pretrained``).

        From a local folder of safetensors files (one, or several with
        ``model.safetensors.index.json``) the model is built on the meta device and its weights are
        read after the strategy has sharded it, each rank reading only its own shards
        (:mod:`kiln.models.hf_weights`; the strategy's setup calls :meth:`load_deferred_weights`).
        The weights equal transformers' ``from_pretrained`` to the bit. Used without a strategy,
        the first forward reads them onto the CPU. ``meta_init=False`` (or a hub name) loads the
        whole model now with transformers' ``from_pretrained``.
        """
        transformers = _transformers()
        auto = _auto_class(transformers, auto_class)
        from kiln.models import hf_weights

        if meta_init and hf_weights.is_local_checkpoint(name_or_path):
            model = hf_weights.meta_model(auto, Path(name_or_path), None if dtype is None else _dtype(dtype), kwargs)
        else:
            if dtype is not None:
                kwargs["dtype"] = _dtype(dtype)
            model = auto.from_pretrained(name_or_path, **kwargs)
        tok = None
        if tokenizer:
            source = name_or_path if tokenizer is True else tokenizer
            tok = transformers.AutoTokenizer.from_pretrained(source)
        wrapped = cls(model, tok, metrics=metrics, shift_labels=shift_labels)
        if meta_init and hf_weights.is_local_checkpoint(name_or_path):
            wrapped._pretrained = hf_weights.PretrainedWeights(Path(name_or_path))
            # used without a strategy (no setup to read them after): the first forward reads them
            wrapped._pretrained_hook = wrapped.register_forward_pre_hook(_load_before_forward)
        return wrapped

    # -- weights read after the strategy's steps (from_pretrained) -----------------------------
    _pretrained: Any = None  # kiln.models.hf_weights.PretrainedWeights while the weights are deferred
    _pretrained_hook: Any = None  # the forward pre-hook that reads them when no strategy did

    @property
    def deferred_weights(self) -> bool:
        """Whether the weights are still to be read: built on the meta device by
        :meth:`from_pretrained`, they are read by :meth:`load_deferred_weights`."""
        return getattr(self, "_pretrained", None) is not None

    def load_deferred_weights(self, device: torch.device | str | None = None) -> None:
        """Give the (possibly sharded) meta tensors storage on ``device`` (None: where the
        buffers are, else the CPU) and read this rank's part of the pretrained weights into them.
        A strategy's setup calls it once its sharding steps are done
        (:func:`kiln.parallel.transforms.parallelize.materialize`). Does nothing when nothing is deferred.

        After :meth:`read_weights_per_stage` (a pipeline, before its whole-model steps) only the
        buffers are read here; the parameters stay on the meta device through the trace and the
        cut, and each rank reads its stages' own in :meth:`load_stage_weights`."""
        from kiln.models.hf_weights import load_pretrained_buffers, load_pretrained_weights, materialize_meta

        pretrained = getattr(self, "_pretrained", None)
        if pretrained is None:
            return
        if device is None:
            device = next(
                (t.device for t in [*self.parameters(), *self.buffers()] if not t.is_meta), torch.device("cpu")
            )
        if self._per_stage:  # once: the trace runs the forward (and this pre-hook) again
            if any(b.is_meta for b in self.buffers()):
                load_pretrained_buffers(self.model, pretrained.folder, device)
            return
        # on the wrapper, not only the transformers model: FSDP2 re-registers its shards in its own
        # modules' _apply, and the wrapper is FSDP's root
        materialize_meta(self, device)
        load_pretrained_weights(self.model, pretrained.folder, device)
        self._loaded()

    _per_stage = False  # set by read_weights_per_stage: the parameters are read stage by stage

    def read_weights_per_stage(self) -> None:
        """Have a pipeline read the weights stage by stage: :meth:`load_deferred_weights` (the end
        of the pipeline's whole-model steps) then reads the buffers only, and the parameters stay
        on the meta device until :meth:`load_stage_weights`, after the cut and the stages' own
        sharding steps, so no pipeline rank ever holds the whole model. A model whose files lack
        some parameter (transformers initialises it, at random) is read whole here, as before a cut."""
        from kiln.models.hf_weights import missing_parameters

        pretrained = getattr(self, "_pretrained", None)
        if pretrained is not None and not missing_parameters(self.model, pretrained.folder):
            self._per_stage = True

    def load_stage_weights(self, stages: Sequence[nn.Module], device: torch.device | str, prefix: str = "") -> None:
        """Storage on ``device`` and this rank's part of the pretrained weights for the meta tensors
        of ``stages`` (pipeline stage modules cut from a model that holds this wrapper at
        ``prefix``, with the original names), after their tensor-parallel and FSDP steps: each
        reads the weights it keeps and no more (:func:`kiln.models.hf_weights.load_stage_weights`).
        Called once, with every stage of the rank; the weights are then no longer deferred."""
        from kiln.models.hf_weights import load_stage_weights

        pretrained = getattr(self, "_pretrained", None)
        if pretrained is None:
            return
        for stage in stages:
            load_stage_weights(self.model, pretrained.folder, device, stage, prefix + "model.")
        self._loaded()

    def _loaded(self) -> None:
        self._pretrained = None
        self._per_stage = False
        self._pretrained_hook.remove()

    # -- kiln.Model ----------------------------------------------------------------------------
    def forward(self, batch: Any) -> Any:  # noqa: D102
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"HuggingFaceModel takes dict batches of the model's arguments ({{'input_ids': ..., "
                f"'labels': ...}}), got a {type(batch).__name__}; have the dataset or collate_fn return dicts"
            )
        kwargs = dict(batch)
        if self.loss_parallel:  # logits sharded over the vocabulary: transformers' loss cannot take them
            for key in _LABEL_KEYS:
                kwargs.pop(key, None)
        if self._no_cache and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return self.model(**kwargs)

    def pipeline_inputs(self, batch: Any) -> Any:
        """What pipeline stages take of ``batch``: all but the labels (see :mod:`kiln.parallel.pipeline`).

        torch passes a pipeline's inputs to its first stage only, so labels cannot reach the loss
        transformers computes in the last stage; :meth:`loss` computes it from the logits there.
        """
        if isinstance(batch, Mapping):
            return {k: v for k, v in batch.items() if k not in _LABEL_KEYS}
        return batch

    def pipeline_trace(self, batch: Any = None) -> AbstractContextManager[None]:
        """Entered around a pipeline's trace of ``batch`` (the stages' inputs): each decoder layer
        computes its own rotary embeddings (and, for a batch without ``attention_mask`` and
        ``position_ids``, its own positions and causal mask), so the model can be cut into any
        number of stages and run by every schedule (:mod:`kiln.models.hf_stages`)."""
        return self_contained_layers(self.model, batch if isinstance(batch, Mapping) else None)

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        """The output's ``loss``; else (a model that computes none, or a pipeline, which runs the
        model without labels) the cross-entropy of its ``logits`` against ``batch["labels"]``,
        shifted when ``shift_labels``: what transformers computes for causal LMs and single-label
        classifiers."""
        labels = _labels(batch)
        loss = _output_loss(outputs)
        if loss is not None:
            return loss
        if labels is None:
            raise ValueError(
                f"{type(self.model).__name__} returned no loss and the batch has no 'labels' "
                f"(its keys: {', '.join(map(str, batch))}); add labels to the batch (a causal LM "
                "takes labels=input_ids and shifts them itself)"
            )
        logits, target = self._aligned(_logits(outputs, batch), labels)
        return token_mean_cross_entropy(logits, target)

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """The ``logits`` of ``batch`` (all positions, not shifted); under loss parallelism gathered
        whole over the vocabulary here (an all-gather), for predictions."""
        return full_logits(_logits(outputs if outputs is not None else self(batch), batch))

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        """Fresh copies of the metrics (each evaluator keeps its own)."""
        if self._metrics is not None:
            return {name: metric.clone() for name, metric in self._metrics.items()}
        if self.task == "causal_lm":
            from kiln.models.perplexity import LanguagePerplexity

            return {"LanguagePerplexity": LanguagePerplexity()}
        if self.task == "classification":
            from kiln.metrics import Accuracy

            return {"Accuracy": Accuracy(ignore_index=IGNORE_INDEX)}
        return {}

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        """``metric.update(logits, labels)``, shifted for next-token prediction when ``shift_labels``."""
        labels = _labels(batch)
        if labels is None:
            raise ValueError(
                f"HuggingFaceModel metrics compare logits with batch['labels'], and this batch has none "
                f"(its keys: {', '.join(map(str, batch))})"
            )
        # under loss parallelism the metrics (accuracy, perplexity) take the whole logits: gathered here only
        metric.update(*self._aligned(full_logits(_logits(outputs, batch)), labels))

    def _aligned(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shift_labels:
            return logits[:, :-1], labels[:, 1:]
        return logits, labels

    def sequence_parallel_plan(self, *, loss_parallel: bool) -> dict[str, Any] | None:
        """The tensor-parallel plan with sequence parallelism (and, with ``loss_parallel``, the
        logits left sharded over the vocabulary) of a Llama-family causal LM
        (:func:`kiln.models.tp_plan.huggingface_sequence_parallel_plan`); what ``TensorParallel()``
        and ``Hybrid(tp=N)`` use by default. None when kiln has none for this model
        (:meth:`sequence_parallel_refusal` says why)."""
        return huggingface_sequence_parallel_plan(self, loss_parallel=loss_parallel)

    def sequence_parallel_refusal(self) -> str | None:
        """Why kiln has no sequence-parallel plan for this model, or None when it has one."""
        return huggingface_sequence_parallel_refusal(self)

    @property
    def tp_plan(self) -> dict[str, str] | None:
        """The tensor-parallel plan the model brings: its ``config.base_model_tp_plan`` under this
        wrapper's path (:func:`kiln.models.tp_plan.huggingface_tp_plan`); what ``TensorParallel()``
        and ``Hybrid(tp=N)`` use without a plan, and ``kiln plan`` counts. None when the config has
        none, or one kiln cannot translate (tensor parallelism then says which style)."""
        try:
            return huggingface_tp_plan(self)
        except ValueError:
            return None

    # -- what a checkpoint keeps beside the weights ------------------------------------------
    def get_extra_state(self) -> str:
        """The model's class and config as JSON: what an export needs besides the weights."""
        config: Any = self.model.config  # a transformers PretrainedConfig
        return json.dumps(
            {
                "format": EXTRA_STATE_FORMAT,
                "class": type(self.model).__name__,
                "task": self.task,
                "config": json.loads(config.to_json_string(use_diff=False)),
            },
            sort_keys=True,
        )

    def set_extra_state(self, state: Any) -> None:
        # The model was built from its own config: a checkpoint's copy of it is for exports only.
        pass


def _load_before_forward(module: nn.Module, args: Any) -> None:
    # a from_pretrained model used without a strategy: read its weights where its buffers are
    cast(HuggingFaceModel, module).load_deferred_weights()


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _named_metrics(metrics: Any) -> dict[str, Any] | None:
    if metrics is None:
        return None
    if isinstance(metrics, Mapping):
        named = dict(metrics)
    elif isinstance(metrics, (list, tuple)):
        named = {type(m).__name__: m for m in metrics}
    else:
        named = {type(metrics).__name__: metrics}
    for name, metric in named.items():
        if not callable(getattr(metric, "update", None)) or not callable(getattr(metric, "compute", None)):
            raise TypeError(
                f"HuggingFaceModel metrics[{name!r}] is a {type(metric).__name__}; expected a torchmetrics "
                "Metric (with update and compute), e.g. kiln.metrics.Accuracy()"
            )
    return named


_LABEL_KEYS = ("labels", "label")


def _labels(batch: Any) -> torch.Tensor | None:
    if not isinstance(batch, Mapping):
        return None
    labels = batch.get("labels")
    return labels if labels is not None else batch.get("label")


def _has_loss_first(outputs: Any) -> bool:
    # transformers' tuple form (return_dict=False, or a pipeline's flattened output) is
    # (loss, logits, ...) when the model computed a loss, else (logits, ...); a loss is 0-dim.
    first = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else None
    return isinstance(first, torch.Tensor) and first.dim() == 0


def _output_loss(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return outputs[0] if _has_loss_first(outputs) else None


def _logits(outputs: Any, batch: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        return outputs["logits"] if "logits" in outputs else outputs
    if isinstance(outputs, (tuple, list)):
        return outputs[1] if _has_loss_first(outputs) and len(outputs) > 1 else outputs[0]
    return outputs


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "kiln.models.HuggingFaceModel.from_config/from_pretrained need transformers: pip install 'kiln-train[hf]'"
        ) from None
    return transformers


def _auto_class(transformers: Any, name: str) -> Any:
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_config"):
        autos = sorted(n for n in dir(transformers) if n.startswith("AutoModel"))
        raise ValueError(f"auto_class={name!r} is not a transformers auto class; expected one of {', '.join(autos)}")
    return cls


def _config(transformers: Any, config: Any) -> Any:
    if isinstance(config, Mapping):
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise ValueError(
                "HuggingFaceModel.from_config(config={...}) needs config['model_type'] (e.g. 'llama', 'gpt2') "
                "to know which config class to build"
            )
        return transformers.AutoConfig.for_model(model_type, **fields)
    if isinstance(config, str):
        return transformers.AutoConfig.from_pretrained(config)
    return config


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype name; expected e.g. 'float32', 'bfloat16', 'float64'")
    return value
