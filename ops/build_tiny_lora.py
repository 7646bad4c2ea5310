"""Build a LoRA adapter for the tiny Llama test model, in PEFT's format (adapter_config.json
and adapter_model.safetensors): rank 8 on every layer's q_proj and v_proj, with seeded random
A and B matrices, so that a job naming the adapter gets a different answer from the base
model's. Its weights are not committed: tests build it where they need it, and running this
again reproduces it byte for byte.

    python ops/build_tiny_lora.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

MODEL = Path(__file__).resolve().parent / "tiny-llama"
RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
SEED = 8
# B's spread: the dummy loader draws the base weights from a narrow range, and an adapter
# whose share is as small would leave most greedy answers as they were.
B_SCALE = 10.0

ADAPTER_CONFIG = {
    "base_model_name_or_path": "tiny-llama",
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": RANK,
    "lora_alpha": ALPHA,
    "lora_dropout": 0.0,
    "target_modules": list(TARGETS),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "modules_to_save": None,
}


def build(output: Path) -> Path:
    """Write the adapter into `output` (created if missing) and return that directory.
    B is not zero, as PEFT initialises it before training, or the adapter would change
    nothing."""
    model = json.loads((MODEL / "config.json").read_text())
    hidden = model["hidden_size"]
    head_dim = model["head_dim"]
    out_features = {"q_proj": model["num_attention_heads"] * head_dim,
                    "v_proj": model["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                RANK, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = B_SCALE * torch.randn(
                out_features[target], RANK, generator=generator)
    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output / "adapter_model.safetensors"))
    (output / "adapter_config.json").write_text(
        json.dumps(ADAPTER_CONFIG, indent=2, sort_keys=True) + "\n")
    return output


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(build(Path(sys.argv[1])))
