"""The vLLM server's side: the client, the weight sync, the server launcher and the code loaded into vLLM, the
server's token (`auth`), its address (`address`) and the folders weights pass through (`folders`).

The rollout backend that samples through them is `gspo_trl.rollout.vllm_server`.

`worker_extension` and `gloo_engine` (with `folders`, `collective` and `shared_buffers`) run inside the vLLM server's
workers and `auth.TokenMiddleware` in its API server; they import only the standard library, torch, numpy and vllm.
The rest runs in the training process.
"""
