"""Generated gRPC stubs for generate.proto (built by `make proto`, never edited by hand)."""
