"""Decoding loops on the trained model, used by the HF rollout backend (`gspo_trl.rollout.hf`) only.

`dynamic` is the loop on transformers' own cache (growing buffers, the shared sampler and its random
sources), `static` the loop on a preallocated cache that CUDA graphs can capture, `prefix_sharing` the
prefill that runs a prefix shared by several rows once, `kv_cache` how a cache is handed to a model,
`memory` how many rows fit the device at once, `truncation` the mass top-k / top-p / min-p keep (whose
`policy_logps` the schedule also reads), and `cpu` the accelerations of the dynamic loop's steps on CPU
(`GSPOConfig.cpu_decoding_kernels`).
"""
