"""Planning: which samples each batch holds — the epoch order of one split (``sampling``)
and of a mix of sources (``mixing``), pure functions of the request."""
