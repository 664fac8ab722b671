"""What the snippets of README.md and docs/*.md assume exists (tests/test_docs.py): a model,
an optimizer, a state, a process group. Only objects a reader would have in their own
program; never anything the snippet claims to show."""

PREAMBLE = """\
import warnings
warnings.filterwarnings("error", message=r".*is deprecated", category=DeprecationWarning)
import logging
logging.basicConfig(level=logging.WARNING)
"""

_PLAIN = """
import torch, unickpt
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
model(torch.randn(4, 64)).square().mean().backward()
opt.step(); opt.zero_grad(); sched.step()
state = {"model": model, "optim": opt, "sched": sched, "step": 1}
"""

_DIST = """
import os, torch, torch.distributed as dist, unickpt
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
"""

_FSDP = _DIST + """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cpu", (world,))
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
step = 100
"""

_HF = """
import torch, unickpt
from transformers import AutoModelForCausalLM, LlamaConfig
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=32)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(input_ids=torch.randint(0, 128, (2, 8)), labels=torch.randint(0, 128, (2, 8))).loss.backward()
opt.step(); opt.zero_grad()
"""

# after the snippet, for the setups that initialize the process group: torch 2.13's gloo may
# abort the process at interpreter exit while a group object is alive (a worker thread still
# joinable): destroy the groups, as torch's docs advise, and free what holds them (a device
# mesh inside an FSDP2 module) while the interpreter is whole, as examples/own_loop.py does
TEARDOWNS = {
    "dist": """
import gc as _gc, torch.distributed as _dist
for _k in [k for k in globals() if not k.startswith("_")]:
    del globals()[_k]
if _dist.is_initialized():
    _dist.destroy_process_group()
_gc.collect()
""",
}
TEARDOWNS["fsdp"] = TEARDOWNS["dist"]

SETUPS = {
    "plain": _PLAIN,
    "dist": _DIST,
    "fsdp": _FSDP,
    "hf": _HF,
}
