"""Inference: batched generation over KDA states and MLA latent caches (`engine`), sampling, batch-mode serving.

    from k3jax.inference import Engine, SamplingParams
    results = Engine(model).generate(prompts, max_new_tokens=64, sampling=SamplingParams(temperature=0.7), key=key)
"""

from k3jax.inference.engine import Engine, GenerationResult, SamplingParams, generate

__all__ = ["Engine", "GenerationResult", "SamplingParams", "generate"]
