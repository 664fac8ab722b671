"""Hugging Face models: the side files that make a checkpoint load with ``from_pretrained``.

A checkpoint's model role is already a Hugging Face weight folder (safetensors shards and
``model.safetensors.index.json``); what ``from_pretrained`` also needs is ``config.json``
(and, for models that generate, ``generation_config.json``). :func:`hf_extra_files` gives
their text, exactly as ``save_pretrained`` writes them, for ``save(..., extra_files=...)``::

    unickpt.save({"model": model.state_dict()}, path,
                 options=unickpt.SaveOptions(extra_files=unickpt.hf.hf_extra_files(model)))
    AutoModelForCausalLM.from_pretrained(path)

transformers is optional: it is imported only when one of its objects is passed in, and the
predicates here never import it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["hf_extra_files", "is_hf_model", "is_hf_config"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


def _unwrap(obj: Any) -> Any:
    """The model inside DistributedDataParallel / DataParallel and ``torch.compile`` wrappers
    (FSDP2-sharded models need no unwrapping: they stay instances of their class)."""
    for _ in range(8):
        inner = getattr(obj, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is None and type(obj).__name__ in ("DistributedDataParallel", "DataParallel"):
            inner = getattr(obj, "module", None)
        if inner is None:
            return obj
        obj = inner
    return obj


def is_hf_model(obj: Any) -> bool:
    """Whether ``obj`` is a transformers ``PreTrainedModel`` (possibly wrapped in DDP or
    ``torch.compile``). Never imports transformers: if it is not loaded, nothing is one."""
    mod = sys.modules.get("transformers.modeling_utils")
    return mod is not None and isinstance(_unwrap(obj), mod.PreTrainedModel)


def is_hf_config(obj: Any) -> bool:
    """Whether ``obj`` is a transformers ``PretrainedConfig``, without importing transformers."""
    mod = sys.modules.get("transformers.configuration_utils")
    cls = getattr(mod, "PreTrainedConfig", None) or getattr(mod, "PretrainedConfig", None)
    return cls is not None and isinstance(obj, cls)


def hf_extra_files(obj: Any) -> dict[str, str]:
    """The text of the files ``save_pretrained`` writes beside the weights, by name.

    ``obj`` is a transformers ``PreTrainedModel`` (possibly wrapped in DDP or
    ``torch.compile``) or ``PretrainedConfig``. For a model: ``config.json`` with
    ``dtype`` and ``architectures`` set from the model as ``save_pretrained`` sets them (the
    model's own config is not modified), plus ``generation_config.json`` when the model can
    generate. For a config: ``config.json`` as ``config.save_pretrained`` writes it. A custom
    (remote-code) config also gets the Python file ``config.save_pretrained`` copies.

    The result goes to ``unickpt.SaveOptions(extra_files=...)``; the checkpoint then loads
    with ``AutoModelForCausalLM.from_pretrained(path)``, and ``unickpt export`` copies it.

    Example::

        files = hf_extra_files(model)
        sorted(files)   # ['config.json', 'generation_config.json']
    """
    import copy

    obj = _unwrap(obj)
    if is_hf_model(obj):
        config = copy.deepcopy(obj.config)
        # what PreTrainedModel.save_pretrained sets on the config before writing it
        config.dtype = str(obj.dtype).split(".")[1]
        config.architectures = [type(obj).__name__.removeprefix("FSDP")]
        generation = obj.generation_config if obj.can_generate() else None
    elif is_hf_config(obj):
        config, generation = copy.deepcopy(obj), None  # (save_pretrained drops attributes of what it saves)
    else:
        raise InvalidArgumentError(
            f"hf_extra_files: expected a transformers PreTrainedModel or PretrainedConfig, got {type(obj).__name__}"
        )
    with tempfile.TemporaryDirectory(prefix="unickpt-hf-") as tmp:
        try:
            config.save_pretrained(tmp)
        except ValueError as e:  # transformers refuses to save an invalid config
            raise InvalidArgumentError(f"{CONFIG_NAME}: transformers refuses to save this config: {e}") from None
        if generation is not None:
            try:
                generation.save_pretrained(tmp)
            except ValueError as e:
                raise InvalidArgumentError(f"{GENERATION_CONFIG_NAME}: transformers refuses to save the model's "
                                           f"generation config: {e}") from None
        out = {}
        for name in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, encoding="utf-8") as f:
                    out[name] = f.read()
    return out
