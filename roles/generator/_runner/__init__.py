"""One model step over the paged KV cache, in torch: the cache and the runner
(:mod:`._paged`), its batches, linears, decode attention and kernels, micro-batches, where
blocks lie in the cache's memory (:mod:`._spans`) and each next token from the logits
(:mod:`._token_choice`)."""
