"""What a user runs, on top of the runtime library: the CLI, the demo, the
stand-in vLLM HTTP server and the gather-then-broadcast baseline.

These are the only modules of ``m2nkit.engine`` that pick adapters (a
checkpoint reader, a vLLM destination layout) and hand the result to the
runtime; the runtime (plan, transports, trainer engine, receiver, session,
clients) never imports them (``tests/test_layering.py``). They use the
runtime's public names only.
"""
