"""Helpers with no dependencies: the optional-extra importer, the scripts' Ctrl-C hook."""

import importlib
import sys


def import_extra(module: str, extra: str, needs: str):
    """`module`, or an ImportError: "<needs>: pip install 'nanovllm[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{needs}: pip install 'nanovllm[{extra}]'") from None


def ctrl_c_in_one_line():
    """From now on a Ctrl-C prints one line; Python then exits with SIGINT's status (130). An
    engine stops its workers while the interrupt unwinds through the `with LLM(...)` block."""
    default = sys.excepthook

    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            print("Interrupted.", file=sys.stderr)
        else:
            default(kind, value, traceback)

    sys.excepthook = hook
