"""From logits to tokens: the sampler, its random draws, grammars and speculative decoding."""
