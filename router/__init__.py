"""The router: HTTP API, request queue, token budgets, the KV block table and the batching loop."""
