"""Code that `vllm serve` loads into each of its workers (`--worker-extension-cls`), called over `/collective_rpc`.

It imports only torch, vllm and what vllm depends on (safetensors): the server's environment need not have TRL or
gspo-trl's dependencies, only this package on its path (`gspo-trl vllm-serve` arranges that). The methods that read,
write or remove files touch only the folders `folders` allows (snapshot folders, the server's own upload folders).
Importing it registers gspo-trl's gloo weight-transfer engine (`gloo_engine`) with vLLM.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil

import torch

from . import delta, folders

# The loggers of vLLM's in-place reload, which warn about every layer a partial reload (one HTTP chunk) leaves as is.
RELOAD_LOGGERS = tuple(f"vllm.model_executor.model_loader.reload.{name}" for name in ("inplace", "layerwise"))


@contextlib.contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def reload_in_place(worker, **reload_kwargs) -> None:
    """vLLM's in-place reload on `worker` (`weights_path=` a snapshot, or `weights_iterator=` (name, tensor) pairs in
    checkpoint names), then the re-packing the reload leaves stale."""
    worker.model_runner.reload_weights(**reload_kwargs)
    repack_tied_head(worker)


def repack_tied_head(worker) -> None:
    """Re-pack `worker`'s LM head after a reload."""
    repack_lm_head(worker.model_runner.get_model())


def repack_lm_head(model) -> None:
    """Re-pack `model`'s LM head after a reload (or a weight-transfer engine's update)."""
    # A tied LM head shares the embedding's weight, but CPU kernels keep their own pre-packed copy of it that
    # reload_weights does not refresh (the engine would sample with the new embedding and the old head).
    lm_head = getattr(model, "lm_head", None)
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
        quant_method.process_weights_after_loading(lm_head)


def abandon_layerwise_reload(model) -> int:
    """Undo what an unfinished layer-wise reload (vLLM's weight-transfer update, `/start_weight_update` without its
    `/finish_weight_update`: a trainer that died or failed during a sync) left behind: every layer still waiting for
    weights sits on the meta device, and would crash the next forward or mix the next update's weights with stale
    buffered ones. Each gets back the tensors it served with (layers the update had finished keep their new weights),
    the reload's bookkeeping is cleared and the LM head re-packed. Returns how many layers were put back."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        LOADING_LAYERS,
        _place_kernel_tensors,  # vLLM has no public abort; its sharded engine restores layers with it too
    )

    restored = 0
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():  # never reloaded, or finished
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
            restored += 1
        info.reset()
    LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    if restored:
        repack_lm_head(model)  # the embedding may be one of the layers the update finished
    return restored


class WeightSyncExtension:
    """Methods a vLLM worker gains: reload the weights a trainer wrote or sent, and describe the served model."""

    def gspo_reload_weights(self, weights_path: str) -> str:
        """Load the safetensors snapshot in `weights_path` (a snapshot folder the server allows) in place, then re-pack
        what the load left stale."""
        reload_in_place(self, weights_path=folders.snapshot_folder(weights_path))
        return {"reloaded": weights_path}

    def gspo_load_weights_chunk(self, data: str, version: str = "", delta_base: str = "") -> dict:
        """Load one chunk of weights sent over HTTP (base64 of a safetensors file) in place.

        A chunk holds whole layers (the trainer splits between them), since vLLM's in-place reload processes a layer
        (fusing q/k/v, re-packing for CPU kernels) once all of its weights arrived; layers absent from the chunk keep
        their weights. `gspo_finish_weight_load` follows the last chunk.

        With a `version` (a delta sync, `delta`), the chunk may hold deltas against the tensors this worker kept in
        version `delta_base`; the worker keeps what it loads as `version`. If it does not hold a tensor in
        `delta_base`, it loads nothing of the chunk and names the tensors, which the trainer then sends whole."""
        from safetensors.torch import load

        tensors = load(base64.b64decode(data))
        receiver = self.__dict__.setdefault("gspo_delta_receiver", delta.DeltaReceiver())
        if version:
            tensors, stale = receiver.rebuild(tensors, delta_base or None)
            if stale:
                return {"stale": stale}
        receiver.forget(list(tensors))  # until the load succeeds, no base for these tensors
        with _quiet_partial_reload():
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        if version:
            receiver.keep(tensors, version)
        return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    def gspo_delta_digest(self) -> dict:
        """The SHA-256 of each tensor this worker holds for delta syncs (the last it loaded of each), by name: what a
        trainer compares with its own copy to check that the server's weights are its own bit for bit."""
        import hashlib

        held = self.__dict__.get("gspo_delta_receiver")
        return {
            name: hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, (_, tensor) in (held.held.items() if held is not None else ())
        }

    def gspo_finish_weight_load(self) -> dict:
        """After the last chunk: re-pack what the reloads left stale."""
        repack_tied_head(self)
        return {"finished": True}

    def gspo_abandon_weight_update(self) -> dict:
        """End a weight-transfer update a trainer started and never finished (it was killed, or failed half-way):
        the layers left waiting for weights get back the ones they served with, and the worker takes a new
        `/start_weight_update` again (vLLM refuses one while it thinks an update is active). A no-op otherwise."""
        active = bool(getattr(self, "_weight_update_active", False))
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.reset_weight_update_target()
            engine.shutdown()  # the group of a trainer that failed or died: it joins afresh
        self._weight_update_active = False
        return {"was_active": active, "layers_restored": abandon_layerwise_reload(self.model_runner.get_model())}

    def gspo_receive_file(self, directory: str, name: str, data: str, offset: str, last: str) -> dict:
        """Write one piece (base64, at byte `offset`) of a file the trainer sends into upload folder `directory` of
        the server's own root, within its size cap; on the `last` piece the file takes its name (atomically, since
        every worker of a server writes the same file). Returns the folder, which the trainer then names in
        /v1/load_lora_adapter."""
        target = folders.upload_file(directory, name)
        folder, offset = os.path.dirname(target), int(offset)
        piece = base64.b64decode(data)
        partial = f"{target}.part-{os.getpid()}"
        written = os.path.getsize(partial) if offset and os.path.isfile(partial) else 0
        if offset != written:
            raise ValueError(f"piece of {name!r} at byte {offset}, but {written} bytes arrived so far")
        folders.check_upload(folder, name, offset, len(piece))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with open(partial, "r+b" if offset else "wb") as handle:
            handle.seek(offset)
            handle.write(piece)
        if str(last) == "1":
            os.replace(partial, target)
        return {"directory": folder}

    def gspo_remove_directory(self, directory: str) -> dict:
        """Remove an upload folder `gspo_receive_file` wrote (when the trainer is done with it)."""
        shutil.rmtree(folders.upload_folder(directory), ignore_errors=True)
        return {"removed": directory}

    def gspo_can_read(self, path: str) -> dict:
        """Whether this worker sees `path`, a probe file in a snapshot folder the server allows (the trainer checks
        that both sides share the weight-sync folder); `refused` says why a path outside those is not looked at.
        A dict, since /collective_rpc passes dicts and lists through but turns other results into strings."""
        try:
            folders.snapshot_folder(os.path.dirname(path))
        except PermissionError as error:
            return {"readable": False, "refused": str(error)}
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


def register_gloo_engine() -> None:
    """Make `--weight-transfer-config '{"backend": "gloo"}'` name gspo-trl's engine (`gloo_engine`) in this process:
    vLLM imports this module into each worker before it builds the worker's weight-transfer engine."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # not inside a vLLM worker (the trainer's environment need not have vLLM)
        return
    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", "gspo_trl.vllm.gloo_engine", "GlooWeightTransferEngine")


register_gloo_engine()
