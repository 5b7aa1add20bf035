"""The vLLM server's side: the client, the weight sync, the server launcher and the code loaded into vLLM.

The rollout backend that samples through them is `gspo_trl.rollout.vllm_server`.

`worker_extension` runs inside the vLLM server's workers and imports only torch and vllm; everything else
here runs in the training process.
"""
