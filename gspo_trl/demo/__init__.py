"""The `gspo-trl` command and its embedded default run: the SmolLM2 model, the reasoning-gym task, the vision colour
task and the example environments (a calculator tool, a retry game)."""
