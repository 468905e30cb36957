"""cb-launcher: converts the model once, starts the shards and the router, and supervises them."""
