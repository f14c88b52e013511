"""The CPU pool's state: index, leases, staging, decisions, admission, the KV ops."""
