"""Training to serving without a converter: a trainer job publishes its weights, an inference
job with its own world size keeps a model resident in the fused serving layout and updates it
in place (docs/serving.md).

Two jobs, each under its own ``torchrun`` (gloo on CPU here; the same code runs on GPUs)::

    torchrun --nproc-per-node 2 --master-port 29500 examples/serving_loop.py trainer --dir run
    torchrun --nproc-per-node 2 --master-port 29501 examples/serving_loop.py inference --dir run

The trainer (a ``transformers`` Llama, FSDP2 over its ranks, AdamW) publishes its model as
bf16 every ``--publish-every`` steps through ``UnifiedCheckpoint(publish_dir=...)``. Each
inference rank holds its tensor-parallel shard of the fused layout (``qkv_proj``,
``gate_up_proj``, row-parallel ``o_proj``/``down_proj``: ``Mapping.fused``) and calls
``WeightSubscriber.update``, which waits for a newer version and loads only the bytes that
rank needs, verified, into the tensors it already holds. With ``--probe``, the trainer
writes the logits of a fixed prompt for each version it publishes (a full bf16 copy of its
weights in a plain model), and the inference job rebuilds the model from its ranks' shards
and checks that its logits are those, bit for bit. Each side prints one JSON line per event.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import unickpt  # noqa: E402

PROMPT = torch.arange(12).view(1, -1)


def config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                       tie_word_embeddings=False)


def plain_model(cfg, state: dict | None = None):
    """A bf16 ``transformers`` Llama (the probe's reference, and the inference check)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def emit(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")  # one write: the ranks share the output
    sys.stdout.flush()


def trainer(args, rank: int, world: int) -> None:
    from transformers import AutoModelForCausalLM

    cfg = config(args)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = unickpt.UnifiedCheckpoint(os.path.join(args.dir, "ckpt"), every=0, publish_dir=os.path.join(args.dir, "pub"),
                                     publish_every=args.publish_every, publish_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if args.probe and step % args.publish_every == 0:
            probe(args, cfg, model, step, rank)  # (before the version appears)
        ckpt.step(step, {"model": model})  # publishes every publish_every steps
        if step % args.publish_every == 0:
            emit(side="trainer", rank=rank, event="published", step=step)
    ckpt.close(final_save=False)


def probe(args, cfg, model, step: int, rank: int) -> None:
    """The logits of the trainer's weights of ``step`` cast to bf16 (rank 0 writes them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if dist.is_initialized() else model.state_dict()
    if rank == 0:
        with torch.no_grad():
            logits = plain_model(cfg, {k: v.to(torch.bfloat16) for k, v in full.items()})(PROMPT).logits
        os.makedirs(os.path.join(args.dir, "probe"), exist_ok=True)
        tmp = os.path.join(args.dir, "probe", f".{step}.pt")
        torch.save(logits, tmp)
        os.replace(tmp, os.path.join(args.dir, "probe", f"{step}.pt"))


def inference(args, rank: int, world: int) -> None:
    cfg = config(args)
    mapping = unickpt.Mapping.fused(cfg, tp_rank=rank, tp_size=world)
    with torch.device("meta"):  # the fused shapes of this rank, from the config alone
        shapes = {k: tuple(v.shape) for k, v in plain_model(cfg).state_dict().items()}
    serving = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in mapping.targets(shapes).items()}
    sub = unickpt.WeightSubscriber(os.path.join(args.dir, "pub"), mapping=mapping, group=None, timeout_s=args.timeout)
    while True:
        version = sub.update(serving, timeout=args.timeout)  # None: nothing newer came in time
        if version is None:
            emit(side="inference", rank=rank, event="idle", version=sub.version)
            break
        line = dict(side="inference", rank=rank, event="updated", version=version, pid=os.getpid())
        if args.probe:
            line["logits_equal"] = check(args, cfg, serving, version, rank, world)
        emit(**line)
        if version >= args.steps:
            break


def check(args, cfg, serving: dict, version: int, rank: int, world: int) -> bool | None:
    """The model the ranks' fused shards make, put back together, gives the trainer's logits
    of this version bit for bit (None: the trainer wrote no probe for it)."""
    parts = {}
    for k, v in serving.items():
        got = [torch.empty_like(v) for _ in range(world)] if world > 1 else [v]
        if world > 1:
            dist.all_gather(got, v.contiguous())
        parts[k] = got
    path = os.path.join(args.dir, "probe", f"{version}.pt")
    if not os.path.exists(path):
        return None
    with torch.no_grad():
        logits = plain_model(cfg, unfuse(cfg, parts, world))(PROMPT).logits
    return bool(torch.equal(logits, torch.load(path, weights_only=True)))


def unfuse(cfg, parts: dict, world: int) -> dict:
    """Hugging Face's tensors from every TP rank's fused shards (KV heads replicated when
    there are fewer of them than ranks: one copy each)."""
    hd = cfg.hidden_size // cfg.num_attention_heads
    q_rows = cfg.num_attention_heads // world * hd
    kv_rows = max(1, cfg.num_key_value_heads // world) * hd
    keep = [r for r in range(world) if cfg.num_key_value_heads >= world or r % (world // cfg.num_key_value_heads) == 0]
    out = {}
    for k, shards in parts.items():
        if ".qkv_proj." in k:
            split = [torch.split(s, [q_rows, kv_rows, kv_rows]) for s in shards]
            for i, x in enumerate("qkv"):
                out[k.replace("qkv_proj", f"{x}_proj")] = torch.cat([split[r][i] for r in (range(world) if x == "q" else keep)])
        elif ".gate_up_proj." in k:
            halves = [s.chunk(2) for s in shards]
            out[k.replace("gate_up_proj", "gate_proj")] = torch.cat([h[0] for h in halves])
            out[k.replace("gate_up_proj", "up_proj")] = torch.cat([h[1] for h in halves])
        elif k.endswith(("o_proj.weight", "down_proj.weight")):
            out[k] = torch.cat(shards, dim=1)
        elif k.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[k] = torch.cat(shards)
        else:
            out[k] = shards[0]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("side", choices=["trainer", "inference"])
    p.add_argument("--dir", required=True, help="the run's folder: ckpt/, pub/ (versions) and probe/ go there")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--publish-every", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--timeout", type=float, default=60.0, help="inference: seconds to wait for a newer version")
    p.add_argument("--probe", action="store_true", help="check each version's logits against the trainer's")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    (trainer if args.side == "trainer" else inference)(args, rank, world)
    if dist.is_initialized():  # (after a failure the process exits with it: no barrier with a dead peer)
        dist.barrier()  # the ranks leave together: torch's gloo may abort at exit while a peer still talks
        dist.destroy_process_group()
    gc.collect()  # (and while an object holding a group, a device mesh of the model, lives)


if __name__ == "__main__":
    main()
