"""Tiny transformers models built from configs (no downloads), and FSDP2 wrapping, shared by
the tests that need a real Hugging Face model on CPU ranks."""

import torch

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=32)


def llama(seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA, **overrides}))


def fsdp(model, world: int, device: str = "cpu"):
    """``fully_shard`` every decoder layer, then the model, over a 1-D mesh of ``world`` on
    ``device`` (``"cpu"``, or ``"cuda"`` for a model already on the GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
