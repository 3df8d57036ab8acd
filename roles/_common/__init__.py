"""What every role shares: torch execution backends (``_backend``), models by name
(``_factory``) and the small :class:`~._model.TinyLM`, sampling and log-probs over any causal LM
(``_rollout``), named seeds (``_seeding``) and versioned weight sync (``_weights`` over the
sans-IO ``_weightplan``)."""
