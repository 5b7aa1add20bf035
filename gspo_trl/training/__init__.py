"""What turns a scored rollout into optimizer steps.

`schedule` holds the buffered micro-batches and where a resumed run continues; `micro_batch` the typed record from
scoring to the loss; `micro_batch_loss` one micro-batch's loss and metrics; `passes` a micro-batch as forward/backward
passes of bounded size; `logprobs` the completions' log-probabilities; `logprob_check` the first rollout's check of
them; `gather` a rollout gathered over processes; `async_rollouts` the next rollout sampled while this one trains;
`rollout_checkpoint` and `reference_sync` what a checkpoint holds beside the model; `cpu_memory` freed memory kept
pooled on CPU.
"""
