"""bagpipe: lookahead-cached training of recommendation models with very large embedding tables."""

__version__ = "0.1.0"
__all__ = ["init_cache"]


def __getattr__(name: str):
    # The trainer API pulls in torch.distributed.rpc: import it only when asked for.
    if name in ("init_cache", "TrainerCache"):
        from bagpipe import api

        return getattr(api, name)
    raise AttributeError(f"module 'bagpipe' has no attribute {name!r}")
