"""Running the model over several processes: one worker per tensor-parallel rank (executor.py),
the step messages the driver sends them (step_wire.py)."""
