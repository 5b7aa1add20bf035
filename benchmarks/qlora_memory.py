"""Memory of a model loaded in fp32, bf16 and 4 bits (NF4, bitsandbytes), measured from the loaded tensors.

A random-init model of a real architecture (SmolLM2-135M's by default; `--smoke`: a tiny one) is saved once in bf16,
then loaded each way; the bytes counted are every parameter and buffer, plus each 4-bit weight's quantization state
(its block scales and, with double quantization, their own scales). Printed as the table of
docs/performance-options.md#qlora-a-4-bit-base and written to --out as JSON.

    python benchmarks/qlora_memory.py --out benchmarks/results/qlora_memory.json
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=False,
)


def quant_state_bytes(state) -> int:
    total = state.absmax.numel() * state.absmax.element_size() + state.code.numel() * state.code.element_size()
    if state.nested:
        total += quant_state_bytes(state.state2)
    return total


def measure(model) -> dict:
    """Bytes of the whole model and of its quantizable linear layers (the decoder's), per parameter of each."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:  # a tied head counts once
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    linear_parameters = linear_bytes = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        state = getattr(weight, "quant_state", None)
        stored = weight.numel() * weight.element_size()
        if state is not None:
            stored += quant_state_bytes(state)
            total += quant_state_bytes(state)
        linear_parameters += state.shape.numel() if state is not None else weight.numel()
        linear_bytes += stored
    return {"model_bytes": total, "linear_parameters": linear_parameters, "linear_bytes": linear_bytes}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny architecture (seconds)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = TINY if args.smoke else SMOLLM2_135M
    results = {"architecture": "tiny" if args.smoke else "SmolLM2-135M", "rows": []}
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**sizes), dtype=torch.bfloat16).save_pretrained(folder)
        ways = {
            "fp32": dict(dtype=torch.float32),
            "bf16": dict(dtype=torch.bfloat16),
            "NF4": dict(dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(load_in_4bit=True)),
            "NF4, double quantization": dict(
                dtype=torch.bfloat16,
                quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True),
            ),
        }
        for name, kwargs in ways.items():
            if "quantization_config" in kwargs:
                kwargs["quantization_config"].bnb_4bit_quant_type = "nf4"
            model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
            row = {"weights": name, "parameters": sum(p.numel() for p in model.parameters()), **measure(model)}
            if "quantization_config" in kwargs:  # the loaded parameters count the packed codes, two per element
                row["parameters"] = sum(p.numel() for p in model.parameters()) + row["linear_parameters"] // 2
            results["rows"].append(row)
            del model
    print(f"{results['architecture']}: | weights | linear layers, bytes per parameter | whole model, MB |")
    for row in results["rows"]:
        per_parameter = row["linear_bytes"] / row["linear_parameters"]
        print(f"| {row['weights']} | {per_parameter:.4f} | {row['model_bytes'] / 1e6:.0f} |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
