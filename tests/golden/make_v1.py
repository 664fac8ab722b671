"""How tests/golden/v1 was made (with unickpt 0.1.0, format_version 1, before manifest
digests and block checksums). Kept for the record; the committed files are the fixture:
running this with a newer unickpt would write the newer format."""

import torch

import unickpt


def state() -> dict:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"layer.weight": w.to(torch.bfloat16), "layer.bias": torch.arange(32, dtype=torch.float32)},
        "master": {"layer.weight": w.clone(), "layer.bias": torch.arange(32, dtype=torch.float32)},
        "optimizer": {
            "layer.weight.exp_avg": torch.randn(64, 32, generator=g) * 1e-3,
            "layer.weight.exp_avg_sq": torch.rand(64, 32, generator=g) * 1e-6,
        },
        "step": 7,
        "note": "golden",
    }


if __name__ == "__main__":
    import sys

    out = sys.argv[1]
    unickpt.save(state(), f"{out}/plain", step=7, extra={"lr": 0.001})
    unickpt.save(state(), f"{out}/o1", step=7, quant="O1", master="residual", zstd=3)
