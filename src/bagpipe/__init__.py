"""bagpipe: lookahead-cached training of recommendation models with huge embedding tables."""

__version__ = "0.1.0"
