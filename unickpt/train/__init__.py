"""The validation trainer: Llama-style model, ZeRO 0-3 + TP on torch.distributed, real text."""

from .data import TextData
from .model import Llama, LlamaConfig, hf_config
from .trainer import OptimConfig, ParallelConfig, Trainer, UnifiedCheckpoint

__all__ = ["TextData", "Llama", "LlamaConfig", "hf_config", "OptimConfig", "ParallelConfig", "Trainer", "UnifiedCheckpoint"]
