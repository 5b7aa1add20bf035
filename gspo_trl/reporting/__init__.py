"""What a run shows: the logged metrics, the completions table, the model card and the reward plot."""
