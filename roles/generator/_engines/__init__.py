"""What keeps the engine contract (:mod:`.._core._contract`): the recompute engine
(:mod:`._recompute`), the paged engine (:mod:`._paged`) and vLLM's (:mod:`._vllm`), what every
engine keeps of its requests (:mod:`._requests`), the base of a wrapper (:mod:`._forwarding`),
and how a generator builds one (:mod:`._build`)."""
