"""KV blocks moved between engines, typed against :class:`~.._core._contract.PagedKV` and cut
by side: the prefill side's leases (:mod:`._leases`) and streams (:mod:`._streamed`); the
decode side's reads (:mod:`._receive`: staged or streamed; :mod:`._direct`: copied in place on
one host); and the link to a KV store (:mod:`._store_link`)."""
