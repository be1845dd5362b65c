"""`engine-run serve`: an OpenAI-compatible HTTP server in front of a thread that owns the LLMEngine.

A body over --max-request-bytes gets 413 before it is read (limits.py). HTTP handlers (asyncio,
api.py) never touch the engine's queues: they render the chat template and tokenize on a worker
thread, refusing a prompt that cannot fit before that work (prompts.py), then send add/abort
commands through a thread-safe queue to the engine thread (engine_loop.py), which applies them
between steps and steps while there is work. Each step's outputs come back in one
loop.call_soon_threadsafe into per-request asyncio queues, so a slow client only lengthens its own
queue and never holds a step back.

SIGTERM drains (app.py): new requests get 503, running ones finish (those still running after
drain_timeout seconds are aborted), then uvicorn shuts down and the process exits 0.
"""
