"""The router's pure core: requests, steps, the KV manager and the scheduler (no torch, grpc or asyncio), so
the engine, the simulator and the unit tests all run this very code."""
