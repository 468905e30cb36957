"""One tensor-parallel rank: its slice of the weights and of the paged KV cache, behind a gRPC service."""
