"""Code that `vllm serve` loads into each of its workers (`--worker-extension-cls`), called over `/collective_rpc`.

It imports only torch and vllm: the server's environment need not have TRL or gspo-trl's dependencies, only this
package on its path (`gspo-trl vllm-serve` arranges that).
"""

from __future__ import annotations

import os

import torch


def reload_in_place(worker, **reload_kwargs) -> None:
    """vLLM's in-place reload on `worker` (`weights_path=` a snapshot, or `weights_iterator=` (name, tensor) pairs in
    checkpoint names), then the re-packing the reload leaves stale."""
    runner = worker.model_runner
    runner.reload_weights(**reload_kwargs)
    model = runner.get_model()
    # A tied LM head shares the embedding's weight, but CPU kernels keep their own pre-packed copy of it that
    # reload_weights does not refresh (the engine would sample with the new embedding and the old head).
    lm_head = getattr(model, "lm_head", None)
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
        quant_method.process_weights_after_loading(lm_head)


class WeightSyncExtension:
    """Methods a vLLM worker gains: reload the weights a trainer wrote, and describe the served model."""

    def gspo_reload_weights(self, weights_path: str) -> str:
        """Load the safetensors snapshot in `weights_path` in place, then re-pack what the load left stale."""
        reload_in_place(self, weights_path=weights_path)
        return {"reloaded": weights_path}

    def gspo_can_read(self, path: str) -> dict:
        """Whether this worker sees `path` (the trainer checks that both sides share the weight-sync directory).
        A dict, since /collective_rpc passes dicts and lists through but turns other results into strings."""
        return {"readable": os.path.isfile(path)}

    def gspo_model_info(self) -> dict:
        """What a trainer checks before it trusts this server: architecture, vocabulary, tied head, dtype."""
        model = self.model_runner.get_model()
        config = self.model_runner.model_config.hf_config
        embed = next((p for n, p in model.named_parameters() if "embed_tokens" in n), None)
        lora_config = getattr(self.model_runner, "lora_config", None)
        return {
            "max_lora_rank": int(lora_config.max_lora_rank) if lora_config is not None else None,
            "architectures": list(getattr(config, "architectures", None) or []),
            "vocab_size": int(getattr(config, "vocab_size", 0)),
            "hidden_size": int(getattr(config, "hidden_size", 0)),
            "num_hidden_layers": int(getattr(config, "num_hidden_layers", 0)),
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
            "dtype": str(embed.dtype if embed is not None else torch.get_default_dtype()).replace("torch.", ""),
        }
