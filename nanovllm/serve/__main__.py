"""`python -m nanovllm.serve MODEL [options]`, the same as `nanovllm serve MODEL [options]`."""

from nanovllm.serve.cli import serve_main

if __name__ == "__main__":  # tensor-parallel workers import this module again: they must not serve
    serve_main()
