"""The models themselves: loading, precision, quantization, their inputs, and how they run across processes.

`loading` loads the policy, tokenizer, PEFT adapter and reference model; `precision` the mixed-precision context and
the fp32 LM head; `quantization` a 4-bit/8-bit base (QLoRA); `multimodal` and `vision_features` a vision-language
model's image inputs; `moe` Mixture-of-Experts routing; `positions` and `packing` the position ids and the
padding-free layout that sampling and scoring share; `checkpointing` activation checkpointing; `distributed` engines
unwrapped, ZeRO-3 and FSDP2 weights, the process group; `cache` where built artefacts are kept.
"""
