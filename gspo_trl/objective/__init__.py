"""The paper's math: the loss of a micro-batch, in small pure functions without trainer state.

`loss` computes importance ratios, the KL term and the aggregation per `loss_type`; `objectives` holds the policy
terms of the GSPO family (GSPO, GSPO-token, SAPO, CISPO, VESPO, ...); `loss_masks` which tokens learn;
`sampling_correction` the weight π_old/π_sampler for rollouts another engine sampled; `entropy_control` the entropy
bonus's coefficient.
"""
