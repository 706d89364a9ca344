"""What the engine bench records (`facts`: the model, dtype and engine path as it ran) and
fits (`step_cost`: the virtual clock's step cost model, from its rows)."""
