"""What a user runs, on top of the runtime library: the CLI (``cli.py``, with
what it prints in ``report.py`` and ``plan --verify``/``--dump`` in
``verify.py``), the demos (``demo.py``; ``demo_bridge.py`` for Megatron-Bridge
and Megatron-Core trainers; ``demo_vllm.py``), the stand-in vLLM HTTP server,
the gather-then-broadcast baseline, and ``procs.py``, the one process toolkit
(ports, ranks, reports, process groups, memory) they, the benchmarks and the
tests share.

These are the only modules of ``m2nkit.engine`` that pick adapters (a
checkpoint reader, a vLLM destination layout) and hand the result to the
runtime; the runtime (plan, transports, trainer engine, receiver, session,
clients) never imports them (``tests/test_layering.py``). They use the
runtime's public names only.
"""
