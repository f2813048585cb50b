"""Planning: which samples each batch holds, a pure function of the request. A session's
sources make its epochs (``mixing.Mixing``): a weighted mix of splits (``mixing``), or one
split as a mix of one (``one_split``) in the order of ``sampling``."""
