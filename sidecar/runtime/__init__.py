"""The control loop, its clients and their liveness."""
