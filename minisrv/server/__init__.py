"""minisrv's OpenAI-compatible server: HTTP in front, the engine loop in a thread behind.

The request path, module by module: ``middleware`` (body size and time limits, the API
key), ``protocol`` (request and response bodies, errors), ``app`` (FastAPI routes, SSE
streaming), ``door`` (the checks before an engine sees a request), ``frontend`` (replies in
flight, latency metrics, draining), ``messages`` (the typed messages to and from engines),
``worker`` (one engine in a thread, or the body of a worker process), ``dataparallel``
(supervised worker processes behind the cache-aware router; both layouts answer the front
end the same way), ``engine_loop`` (the
scheduler's own thread, fed by a queue), ``textstream`` (detokenizing, stop strings),
``logprobs`` (OpenAI's two logprob shapes), ``responses`` (chunks and bodies), ``metrics``
(Prometheus), ``config`` (``ServerConfig``: every default once), ``shutdown`` (drain on
SIGTERM), ``bench`` (the load generator) and ``cli``. The model and its tokenizer come from
``minisrv.model.load_model`` (``minisrv.tokenizer.load_tokenizer`` for the HTTP process,
which so imports no model code).

Start it with ``python -m minisrv serve`` (or the ``minisrv`` console script) and talk to it
with the official ``openai`` client::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none")
    client.completions.create(model="citylm", prompt="FR:", max_tokens=20, temperature=0)
"""
