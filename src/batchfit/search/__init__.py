"""Search for the largest batch size: strategies, the memory model and the runner."""
