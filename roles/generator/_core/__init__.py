"""The generator's sans-IO core, with no torch import: the engine contract (:mod:`._contract`),
what a generator is asked and answers (:mod:`._types`), the block pool and prefix cache
(:mod:`._blocks`), the paged scheduler and the blocks it adopts from elsewhere
(:mod:`._scheduler`) and the streams' outbox (:mod:`._outbox`). The simulator runs this layer on virtual time."""
