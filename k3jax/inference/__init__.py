"""Inference: batched generation over KDA states and MLA latent caches (`engine`), continuous batching
(`scheduler`, with an optional `prefix_cache`), sampling, speculative decoding (`speculative`, drafts in `drafts`),
batch-mode serving (`batch`) and the OpenAI-compatible HTTP server (`server`, driven by one `engine_loop` thread).

    from k3jax.inference import Engine, SamplingParams
    results = Engine(model).generate(prompts, max_new_tokens=64, sampling=SamplingParams(temperature=0.7), key=key)

    from k3jax.inference import Request, Scheduler
    sched = Scheduler(model, num_slots=8, max_len=2048)
    sched.add(Request("r1", prompt_ids, max_tokens=64))
    for event in sched.events(): ...          # TokenEvent(request_id, token, index, finish_reason)
"""

from k3jax.inference.engine import Engine, GenerationResult, SamplingParams, generate
from k3jax.inference.scheduler import Request, Scheduler, TokenEvent
from k3jax.inference.speculative import SpeculativeEngine

__all__ = ["Engine", "GenerationResult", "Request", "SamplingParams", "Scheduler", "SpeculativeEngine", "TokenEvent",
           "generate"]
