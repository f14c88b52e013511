"""Observability: what the sidecar tells an operator (session outcomes, the structured session
log line, Prometheus exposition).  Nothing here changes sidecar state."""
