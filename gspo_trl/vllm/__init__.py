"""Generation on a vLLM server: the client, the weight sync, the server launcher and the code loaded into vLLM.

`worker_extension` runs inside the vLLM server's workers and imports only torch and vllm; everything else
here runs in the training process.
"""
