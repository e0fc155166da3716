"""An OpenAI-compatible HTTP server over one engine: `nanovllm serve MODEL` (`pip install -e
".[serve]"`). build_app (app.py) makes the app; cli.py parses the options and runs uvicorn; the
engine steps in a process of its own (engine_core.py), reached through engine_client.py."""
