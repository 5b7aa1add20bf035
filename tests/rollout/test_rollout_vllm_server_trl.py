"""A server as `trl vllm-serve` starts it: described, sampled, and its NCCL sync refused on CPU."""

import pytest
import torch
from helpers import count_digits, small_config, text_dataset
from real_vllm_servers import FIXED_TEXT, trainer_logprobs, vllm_config

from gspo_trl import GSPOTrainer

pytestmark = pytest.mark.xdist_group(
    "vllm_server"
)  # every real server on one worker (tests/rollout/real_vllm_servers.py)


@pytest.mark.slow  # a real vLLM server
def test_a_trl_vllm_serve_server_is_described_and_sampled_and_its_nccl_sync_refused_on_cpu(
    tmp_path, trl_server, served_model_dir
):
    """Everything up to NCCL itself: the trainer reads the server's engine and world size from TRL's endpoints, knows
    the server has no gspo-trl extension, samples from it; the NCCL sync cannot run without a GPU, so the trainer is
    refused at construction with what to run instead."""
    from gspo_trl.vllm.client import VLLMServerClient
    from gspo_trl.vllm.engine_transport import server_backend

    client = VLLMServerClient(trl_server["url"], retries=0)
    config = client.server_config()
    assert server_backend(config) == "nccl" and client.world_size() == 1
    info = client.model_info(config)
    assert info == {"worker_extension": False, "max_lora_rank": None, "dtype": "float32"}
    trainer = GSPOTrainer(served_model_dir, count_digits, args=small_config(tmp_path), train_dataset=text_dataset())
    server = torch.tensor(client.prompt_logprobs(FIXED_TEXT))  # the same checkpoint on both sides
    torch.testing.assert_close(server, trainer_logprobs(trainer, FIXED_TEXT), atol=1e-4, rtol=0)
    (samples,) = client.complete([FIXED_TEXT[:4]], 3, {"max_tokens": 5, "temperature": 1.0})
    assert len(samples) == 3 and all(len(sample["token_ids"]) == len(sample["logprobs"]) for sample in samples)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="NCCL weight-transfer engine.*needs a CUDA GPU.*gspo-trl vllm-serve"):
            GSPOTrainer(
                served_model_dir, count_digits, args=vllm_config(tmp_path, trl_server), train_dataset=text_dataset()
            )
