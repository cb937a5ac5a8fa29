"""minisrv's OpenAI-compatible server: HTTP in front, the engine loop in a thread behind.

The request path, module by module: ``protocol`` (request and response bodies, errors,
CityLM's chat template), ``app`` (FastAPI routes, SSE streaming), ``frontend`` (replies in
flight, latency metrics), ``textstream`` (detokenizing, stop strings), ``engine_loop`` (the
scheduler's own thread, fed by a queue), ``workers`` (one engine in a thread, or ``--dp N``
worker processes behind the cache-aware router), ``metrics`` (Prometheus), ``loading``
(CityLM or a local HF Llama folder), ``bench`` (the load generator) and ``cli``.

Start it with ``python -m minisrv serve`` (or the ``minisrv`` console script) and talk to it
with the official ``openai`` client::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none")
    client.completions.create(model="citylm", prompt="FR:", max_tokens=20, temperature=0)
"""
