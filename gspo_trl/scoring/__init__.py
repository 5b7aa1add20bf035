"""From completions to a scored rollout: rewards, then each row's (or turn's) advantage.

`rewards` calls and validates reward functions and reward models; `advantages` holds the pure math (reward
aggregation, group-relative advantages, per-turn returns); `score` turns a rollout's reward table, over all
processes, into the advantages the loss reads; `dynamic_sampling` keeps the informative groups and samples more.
"""
