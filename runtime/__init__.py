"""The runtime: reads the model graph and the checkpoint; executes steps, samples, schedules and serves."""
