import importlib


def import_extra(module: str, extra: str, needs: str):
    """`module`, or an ImportError: "<needs>: pip install 'nanovllm[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{needs}: pip install 'nanovllm[{extra}]'") from None
