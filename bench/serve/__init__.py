"""``kvmesh bench serve``: an online serving benchmark (load generator) for kvmesh's gRPC gateway
and for OpenAI-compatible HTTP servers (vLLM, llama.cpp), after vLLM's ``vllm bench serve``
(``benchmarks/benchmark_serving.py``): the same arrival process, metrics and result keys.

Requests arrive at ``--request-rate`` per second (``inf``: all at t=0), with gamma-distributed
gaps of shape ``--burstiness`` (1 = Poisson) and mean ``1/rate``; ``--max-concurrency`` caps the
requests in flight. Each request is streamed and timed on the client (seconds internally,
milliseconds in reports):

- TTFT: request sent -> first streamed chunk carrying a token (kvmesh: a message with token
  ids; OpenAI: a non-empty ``delta.content``)
- ITL: the gaps between successive token-carrying chunks; a chunk with n tokens (speculative
  decoding, a server that batches its stream) gives one gap, as in vLLM
- TPOT: (E2EL - TTFT) / (output_tokens - 1), output tokens from the server's usage
- E2EL: request sent -> end of the stream
- goodput: completed requests per second that meet every SLO given (``--goodput ttft:500
  tpot:50 e2el:5000``, ms; a request with one output token counts TPOT 0, as vLLM)

Datasets: ``policydesk`` (single-turn questions), ``policydesk-chat`` (multi-turn sessions: one
arrival each, turns sent one after the other with the model's own answers in the history),
``random`` (uniformly random token ids of the model's vocabulary, special tokens excluded),
or ``--workload FILE`` (JSONL written by ``--save-workload``). See docs/benchmarks.md.

Usage::

    kvmesh bench serve --model smollm2-135m-instruct --executor local --num-prompts 32 --request-rate 2
    kvmesh bench serve --address 127.0.0.1:50051 --dataset policydesk-chat --max-concurrency 8
    kvmesh bench serve --backend openai-chat --base-url http://127.0.0.1:8000/v1 --workload w.jsonl
    kvmesh bench serve --backend openai-chat --model smollm2-135m-instruct --executor local   # kvmesh's own HTTP API
    kvmesh bench serve --dataset random --random-input-len 256 --save-workload random.jsonl

Modules: :mod:`~bench.serve.workload` (requests, data sets, workload files),
:mod:`~bench.serve.backends` (kvmesh gRPC, OpenAI chat completions over HTTP),
:mod:`~bench.serve.load` (arrivals and the run), :mod:`~bench.serve.metrics` (records, summary,
report), :mod:`~bench.serve.plots`, :mod:`~bench.serve.command` (``kvmesh bench serve``).
"""
