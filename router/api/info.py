"""GET /info: TGI's fields, and what the scheduler and the KV pools settled on at start-up. Typed, so that the
tools (cb-bench, cb-sim's replay) read back exactly what the server ran with."""
from typing import Optional

from pydantic import BaseModel, ConfigDict


class Info(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model_id: str
    model_dtype: str
    model_device_type: str
    quantize: Optional[str]  # "int8", or None: weights in model_dtype
    num_shard: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int
    waiting_served_ratio: float
    max_waiting_tokens: int
    max_concurrent_requests: int
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    num_window_blocks: int
    scheduler: str
    safety_margin: float
    prefill_step_ratio: float = 0.0  # 0: prompt chunks bounded by max_batch_prefill_tokens alone
    prefix_caching: bool
    speculate: int = 0  # TGI's field: tokens speculation may propose a step (0: off)
    compiled_step_sizes: list[int] = []  # steps of these many tokens run compiled graphs (once compile_state is ready)
    compile_seconds: float = 0.0  # from the compile's start until its graphs served
    compile_state: str = "off"  # off, pending, compiling (steps run eagerly meanwhile), ready or failed
    max_stop_sequences: int
    max_top_n_tokens: int
    router: str = "cb-router"
    version: str = "0.1.0"
    model_sha: Optional[str] = None
    model_pipeline_tag: str = "text-generation"
    max_best_of: int = 1
    validation_workers: int = 1
    max_client_batch_size: int = 1
    sha: Optional[str] = None
    docker_label: Optional[str] = None
